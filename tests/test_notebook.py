"""notebooks/quickstart.ipynb runs top to bottom at its tiny size (ARBOR_NOTEBOOK_TINY=1): the
tokenizer, a short SFT, RL steps with rollouts in bwrap sandboxes, the reward plot.

The code cells are executed in order in one namespace (no Jupyter kernel needed); IPython-only
lines (`!cmd`, `%magic`: the commented install commands, once uncommented) are skipped.
"""

import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "quickstart.ipynb")


def code_cells(path: str) -> list[str]:
  with open(path) as f:
    nb = json.load(f)
  assert nb["nbformat"] == 4
  cells = []
  for cell in nb["cells"]:
    if cell["cell_type"] != "code":
      continue
    source = "".join(cell["source"])
    cells.append("\n".join(line for line in source.splitlines()
                           if not line.lstrip().startswith(("!", "%"))))
  return cells


def test_cells_are_plain_python_without_outputs():
  cells = code_cells(NOTEBOOK)
  assert len(cells) >= 4
  for i, source in enumerate(cells):
    compile(source, f"{NOTEBOOK}[code cell {i}]", "exec")
  with open(NOTEBOOK) as f:
    nb = json.load(f)
  assert all(not c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code"), (
      "commit the notebook without outputs")
  assert "TINY" in cells[0] and "ARBOR_NOTEBOOK_TINY" in cells[0]  # the sizes come first


@pytest.mark.slow
def test_quickstart_runs_tiny(tmp_path, monkeypatch):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from trainer.metrics import read_jsonl

  workdir = tmp_path / "quickstart"
  monkeypatch.setenv("ARBOR_NOTEBOOK_TINY", "1")
  monkeypatch.setenv("ARBOR_NOTEBOOK_WORKDIR", str(workdir))
  monkeypatch.chdir(ROOT)
  namespace = {"__name__": "__main__"}
  for i, source in enumerate(code_cells(NOTEBOOK)):
    exec(compile(source, f"{NOTEBOOK}[code cell {i}]", "exec"), namespace)
  try:
    assert namespace["TINY"] is True
    rows = read_jsonl(workdir / "rl" / "rl" / "metrics.jsonl")
    steps = namespace["RL_STEPS"]
    assert sorted(rows) == list(range(1, steps + 1))
    for m in rows.values():
      assert m["episodes"] == namespace["PROMPTS_PER_STEP"] * namespace["GROUP_SIZE"]
      assert 0.0 <= m["reward_mean"] <= 1.0
      assert m["groups_trained"] >= 1  # the train step ran
      assert "loss" in m
    assert rows[steps]["policy_version"] == steps
    sft_rows = read_jsonl(workdir / "sft" / "sft" / "metrics.jsonl")
    assert sorted(sft_rows) == list(range(1, namespace["SFT_STEPS"] + 1))
    png = workdir / "rewards.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = namespace["fig"]
    assert list(fig.axes[0].lines[0].get_xdata()) == list(range(1, steps + 1))
  finally:
    plt.close("all")
