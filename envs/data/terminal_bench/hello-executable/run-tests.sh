#!/bin/bash
# Graded by exit code: 0 iff every check holds.
set -u
[ -x bin/greet ] || { echo "bin/greet is not an executable file"; exit 1; }
[ "$(bin/greet Ada)" = "Hello, Ada!" ] || { echo "wrong greeting for Ada"; exit 1; }
[ "$(bin/greet)" = "Hello, world!" ] || { echo "wrong greeting without argument"; exit 1; }
echo "all checks passed"
