#!/bin/bash
set -e
mkdir -p data
python3 -c "
import sys
sys.stdout.buffer.write(bytes((i * 37 + 11) % 256 for i in range(5000)))
" > data/payload.bin
