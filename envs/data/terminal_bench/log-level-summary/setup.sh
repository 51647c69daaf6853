#!/bin/bash
set -e
mkdir -p logs
python3 - <<'PY'
levels = ["INFO", "DEBUG", "INFO", "ERROR", "WARNING", "INFO", "DEBUG", "ERROR", "INFO"]
for part in range(3):
  with open(f"logs/app-{part}.log", "w") as f:
    for i, level in enumerate(levels[part:] + levels[:part * 2]):
      f.write(f"2026-01-05T10:{part:02d}:{i:02d} {level} event {i} of part {part}\n")
PY
