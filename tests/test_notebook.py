"""notebooks/quickstart.ipynb under a real Jupyter kernel (nbclient + ipykernel), as Colab runs
it: a kernel whose event loop is already running when the cells start.

At its tiny size (ARBOR_NOTEBOOK_TINY=1) the notebook trains the tokenizer, runs a short SFT,
two RL steps with rollouts in bwrap sandboxes on a fixed pool of tasks, plots the rewards
and prints how far RL moved the weights. The test reads what the cells printed and displayed
and checks it against the run's metrics file: the mechanics, not how much RL learns in two
steps (too few to tell at this size; configs/demo.py measures that).
"""

import json
import os
import re

import nbclient
import nbformat
import pytest

from tests.conftest import FAST_COMPILE_FLAGS
from trainer.metrics import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "quickstart.ipynb")
STEP_LINE = re.compile(r"^step (\d+): reward ([0-9.]+), pass ([0-9.]+), (\d+) groups trained",
                       re.M)
MOVED_LINE = re.compile(r"RL moved the weights by ([0-9.e+-]+)% ")


def test_cells_are_plain_python_without_outputs():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  cells = [c for c in nb.cells if c.cell_type == "code"]
  assert len(cells) >= 4
  assert all(not c.outputs and c.execution_count is None for c in cells), (
      "commit the notebook without outputs")
  for i, cell in enumerate(cells):  # IPython-only lines (!cmd, %magic) are the install lines
    source = "\n".join(line for line in cell.source.splitlines()
                       if not line.lstrip().startswith(("!", "%")))
    compile(source, f"{NOTEBOOK}[code cell {i}]", "exec")
  assert "ARBOR_NOTEBOOK_TINY" in cells[0].source  # every size is set in the first cell


def _stdout(cell) -> str:
  return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream"
                 and o.name == "stdout")


@pytest.mark.slow
def test_quickstart_runs_under_a_jupyter_kernel(tmp_path, monkeypatch):
  workdir = tmp_path / "quickstart"
  monkeypatch.setenv("ARBOR_NOTEBOOK_TINY", "1")
  monkeypatch.setenv("ARBOR_NOTEBOOK_WORKDIR", str(workdir))
  monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
  # the kernel runs as a user's would, with XLA's default backend: this run's time is in the
  # training and sampling, not the compiles (conftest.py's compile flags make it ~35% slower)
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "").replace(
      FAST_COMPILE_FLAGS, "").strip())
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=900,
                                   resources={"metadata": {"path": ROOT}})
  client.execute()  # raises CellExecutionError (with the cell's traceback) if a cell fails
  out = "".join(_stdout(c) for c in nb.cells if c.cell_type == "code")

  # SFT trained, and the loss fell.
  sft = re.search(r"SFT: (\d+) steps, training loss ([0-9.]+) -> ([0-9.]+)", out)
  assert sft, out
  assert float(sft.group(3)) < float(sft.group(2))

  # RL: every step ran its 2 x 4 episodes (the tiny size), rewarded by tests run in sandboxes,
  # and printed its metrics; a step that trained groups made a policy version; RL moved the
  # weights exactly when it trained.
  steps = [(int(s), float(r), float(p), int(g)) for s, r, p, g in STEP_LINE.findall(out)]
  assert [s for s, *_ in steps] == [1, 2], out
  rows = read_jsonl(workdir / "rl" / "rl" / "metrics.jsonl")
  for s, reward, pass_rate, groups in steps:
    m = rows[s]
    assert round(m["reward_mean"], 3) == reward and round(m.get("pass_rate", 0), 2) == pass_rate
    assert m.get("groups_trained", 0) == groups
    assert m["episodes"] == 8 and m["tests_run"] == 1.0
  trained = sum(1 for *_, g in steps if g)
  assert rows[len(steps)]["policy_version"] == trained
  moved = MOVED_LINE.search(out)
  assert moved, out
  assert (float(moved.group(1)) > 0) == (trained > 0), (moved.group(0), steps)

  # The plot is displayed inline and saved.
  images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "display_data" and "image/png" in o.data]
  assert images, "no inline plot"
  png = workdir / "rewards.png"
  assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  with open(workdir / "rl" / "config.json") as f:
    assert json.load(f)["rl"]["tasks"]  # the fixed task pool
