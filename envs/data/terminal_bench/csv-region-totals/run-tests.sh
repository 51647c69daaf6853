#!/bin/bash
# The hidden tests run from their own directory with an isolated python3 (the workspace is not
# on sys.path) and no configuration or conftest.py from outside that directory (-c /dev/null,
# --confcutdir): the agent can write /tmp and its workspace, not the tests. They find the
# agent's files under $APP_DIR.
export APP_DIR="$PWD"
cd "$TEST_DIR" && python3 -I -m pytest -c /dev/null --rootdir="$TEST_DIR" \
  --confcutdir="$TEST_DIR" -p no:cacheprovider -rA test_outputs.py
