import os

APP = os.environ["APP_DIR"]


def test_totals():
  with open(os.path.join(APP, "totals.csv")) as f:
    lines = f.read().strip().splitlines()
  assert lines == ["region,total", "east,200", "north,151", "south,100", "west,5"]
