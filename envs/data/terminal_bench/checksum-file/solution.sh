#!/bin/bash
sha256sum data/payload.bin | cut -d' ' -f1 > checksum.txt
