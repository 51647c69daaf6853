"""benchmarks.history and benchmarks.check on a synthetic history (nothing is rerun)."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import check, history

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = "vm, Intel(R) Xeon(R) Processor @ 2.50GHz, 2 cores, cpu cpu"
THERE = "vm, AMD EPYC 7B13, 2 cores, cpu cpu"
KIND = history.kind(HERE)


def _history(path, machine=HERE):
  """Two dated measurements of rl_step and one of demo and demo_sft, on `machine`."""
  recs = []
  for date, tps, ratio in (("2026-11-20", 8000.0, 3.5), ("2026-11-23", 8916.0, 3.9)):
    recs += history.make_records("rl_step", {"arbor_tree_tokens_per_s": tps,
                                             "tree_vs_tunix": ratio}, "higher", machine,
                                 date=date, commit_id=f"c{date[-2:]}")
  recs += history.make_records("demo", {"seed_0/rl_pass@1": 0.305, "seed_0/minutes": 13.7},
                               {"seed_0/rl_pass@1": "higher", "seed_0/minutes": "lower"},
                               machine, date="2026-11-23", commit_id="a7c0da0")
  history.append(recs, str(path))
  return history.load(str(path))


def _verdicts(findings):
  return {(f.benchmark, f.figure): f.verdict for f in findings}


def test_kind_normalises_the_cpu_model():
  assert KIND == "cpu x2 Intel Xeon"
  assert history.kind("vm, Intel(R) Xeon(R) Processor, 2 cores, cpu cpu") == KIND
  assert history.kind("h, Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz, 8 cores, cpu cpu") == (
      "cpu x8 Intel Xeon Platinum 8481C")
  assert history.kind("h, AMD EPYC 7B13 64-Core Processor, 16 cores, gpu NVIDIA H100") == (
      "gpu NVIDIA H100, cpu x16 AMD EPYC 7B13")


def test_slower_step_is_flagged(tmp_path):
  records = _history(tmp_path / "h.jsonl")
  [f] = history.compare({("rl_step", "arbor_tree_tokens_per_s"): 8916.0 * 0.9}, records, KIND)
  assert f.regression and f.verdict == "regression"
  assert (f.best, f.best_date, f.best_commit) == (8916.0, "2026-11-23", "c23")
  assert f.change == pytest.approx(-0.1)
  [f] = history.compare({("rl_step", "arbor_tree_tokens_per_s"): float("nan")}, records, KIND)
  assert f.regression  # a broken run is not "within tolerance"


def test_lower_demo_pass_rate_is_flagged(tmp_path):
  records = _history(tmp_path / "h.jsonl")
  [f] = history.compare({("demo", "seed_0/rl_pass@1"): 0.25}, records, KIND)
  assert f.regression and f.best == 0.305


def test_small_change_and_better_figures_pass(tmp_path):
  records = _history(tmp_path / "h.jsonl")
  found = history.compare({("rl_step", "arbor_tree_tokens_per_s"): 8916.0 * 0.97,
                           ("rl_step", "tree_vs_tunix"): 4.2}, records, KIND)
  assert _verdicts(found) == {("rl_step", "arbor_tree_tokens_per_s"): "ok",
                              ("rl_step", "tree_vs_tunix"): "better"}


def test_lower_is_better_figures(tmp_path):
  records = _history(tmp_path / "h.jsonl")
  found = history.compare({("demo", "seed_0/minutes"): 15.5}, records, KIND)
  assert found[0].regression and found[0].worse == pytest.approx(1.8 / 13.7)
  found = history.compare({("demo", "seed_0/minutes"): 11.0}, records, KIND)
  assert found[0].verdict == "better"
  assert history.best(records, "demo", "seed_0/minutes", KIND)["value"] == 13.7


def test_figure_of_another_kind_is_new(tmp_path):
  records = _history(tmp_path / "h.jsonl", machine=THERE)
  [f] = history.compare({("rl_step", "tree_vs_tunix"): 1.0}, records, KIND)
  assert f.verdict == "new" and not f.regression and f.best is None


def test_load_names_the_bad_line(tmp_path):
  path = tmp_path / "h.jsonl"
  _history(path)
  good = path.read_text().splitlines()
  bad = dict(json.loads(good[0]), better="faster")
  path.write_text("\n".join(good[:2] + [json.dumps(bad)] + good[2:]) + "\n")
  with pytest.raises(history.HistoryError, match=r"h\.jsonl:3: field 'better'"):
    history.load(str(path))
  missing = {k: v for k, v in json.loads(good[0]).items() if k != "value"}
  path.write_text(good[0] + "\n" + json.dumps(missing) + "\n")
  with pytest.raises(history.HistoryError, match=r":2: field 'value' is missing"):
    history.load(str(path))
  path.write_text(good[0] + "\n{not json\n")
  with pytest.raises(history.HistoryError, match=r":2: not valid JSON"):
    history.load(str(path))


def test_append_keeps_lines_whole(tmp_path):
  path = tmp_path / "h.jsonl"
  recs = history.make_records("x", {"a": 1.0}, "higher", HERE, date="2026-01-01", commit_id="c")
  path.write_text(json.dumps(recs[0]))  # an earlier writer stopped before its newline
  history.append(recs, str(path))
  assert len(history.load(str(path))) == 2


def test_latest_compares_the_newest_with_the_best_earlier(tmp_path):
  records = _history(tmp_path / "h.jsonl")
  records += history.make_records("rl_step", {"tree_vs_tunix": 3.0}, "higher", HERE,
                                  date="2026-11-24", commit_id="c24")
  found = {(f.benchmark, f.figure): f for f in history.latest(records)}
  assert found["rl_step", "tree_vs_tunix"].regression
  assert found["rl_step", "tree_vs_tunix"].date == "2026-11-24"
  assert found["rl_step", "arbor_tree_tokens_per_s"].verdict == "better"
  assert found["demo", "seed_0/minutes"].verdict == "new"


def test_result_readers(tmp_path):
  (tmp_path / "sft").mkdir()
  (tmp_path / "config.json").write_text("{}")
  start = os.path.getmtime(tmp_path / "config.json")
  lines = [{"step": 1, "wall_time": start + 30, "loss": 7.6},
           {"step": 2, "wall_time": start + 60, "loss": 0.5, "eval/loss": 0.9},
           {"step": 3, "wall_time": start + 120, "loss": 0.02}]
  (tmp_path / "sft" / "metrics.jsonl").write_text(
      "".join(json.dumps(l) + "\n" for l in lines) + '{"step": 4, "wall')
  assert check.sft_run_figures(str(tmp_path)) == pytest.approx(
      {"final_loss": 0.02, "eval_loss": 0.9, "minutes": 2.0})
  demo = {"seeds": [{"seed": 0, "sft_pass@1": 0.025, "rl_pass@1": 0.305, "minutes": 13.7}],
          "improvement": {"diff": 0.345, "low": 0.298, "high": 0.392}}
  assert check.demo_figures(demo) == {"seed_0/sft_pass@1": 0.025, "seed_0/rl_pass@1": 0.305,
                                      "seed_0/minutes": 13.7, "improvement/diff": 0.345,
                                      "improvement/low": 0.298}
  assert check.rl_step_figures({"tree_vs_tunix": 3.9, "step_s": {}}) == {"tree_vs_tunix": 3.9}
  assert check.direction("sandbox", "bwrap/exec_median_ms", []) == "lower"
  assert check.direction("rl_step", "arbor_tree_tokens_per_s", []) == "higher"


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "benchmarks.check", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=60)


def test_cli_from_json(tmp_path):
  path = tmp_path / "h.jsonl"
  _history(path)
  figures = tmp_path / "now.json"
  figures.write_text(json.dumps({"rl_step/arbor_tree_tokens_per_s": 8000.0,
                                 "demo/seed_0/minutes": 13.0, "demo_sft/eval_loss": 0.08}))
  args = [f"--from_json={figures}", f"--history={path}", f"--machine={HERE}", "--record"]
  proc = _cli(*args)
  assert proc.returncode == 0, proc.stderr
  assert "REGRESSION" in proc.stdout and "1 regression(s) of 3" in proc.stdout
  report = json.loads(proc.stdout.splitlines()[-1])
  assert _verdicts(history.Finding(**{k: v for k, v in f.items() if k != "regression"})
                   for f in report["findings"]) == {
      ("rl_step", "arbor_tree_tokens_per_s"): "regression", ("demo", "seed_0/minutes"): "better",
      ("demo_sft", "eval_loss"): "new"}
  recorded = history.load(str(path))[-3:]  # --record appended after comparing
  assert [(r["figure"], r["better"], r["kind"]) for r in recorded] == [
      ("arbor_tree_tokens_per_s", "higher", KIND), ("seed_0/minutes", "lower", KIND),
      ("eval_loss", "lower", KIND)]
  assert _cli(*args[:3], "--strict").returncode == 1


def test_cli_latest_on_the_real_history():
  proc = _cli("--latest")
  assert proc.returncode == 0, proc.stderr
  report = json.loads(proc.stdout.splitlines()[-1])
  figures = {(f["benchmark"], f["figure"]) for f in report["findings"]}
  assert ("rl_step", "tree_vs_tunix") in figures and ("demo", "improvement/low") in figures
