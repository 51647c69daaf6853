#!/usr/bin/env bash
# Make the separate virtualenv with google/tunix for benchmarks/generate.py (tunix pins its own
# jax/flax; Arbor's .venv stays untouched). Idempotent: does nothing if it is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TUNIX_VENV:-build/tunix-venv}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import tunix.generate.sampler" 2>/dev/null; then
  exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q google-tunix==0.1.7
"$VENV/bin/python" -c "import tunix.generate.sampler; print('tunix ready in $VENV')"
