import collections
import glob
import os

APP = os.environ["APP_DIR"]


def expected():
  counts = collections.Counter()
  for path in glob.glob(os.path.join(APP, "logs", "*.log")):
    with open(path) as f:
      counts.update(line.split()[1] for line in f if line.strip())
  return [f"{level} {n}" for level, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def test_logs_are_there():
  assert len(glob.glob(os.path.join(APP, "logs", "*.log"))) == 3


def test_summary():
  with open(os.path.join(APP, "summary.txt")) as f:
    assert f.read().strip().splitlines() == expected()
