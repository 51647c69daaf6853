"""Regression check of the headline figures against their history (docs/benchmarks_history.jsonl).

    python -m benchmarks.check                      # rerun, compare (~10 min on 2 cores)
    python -m benchmarks.check --only=rl_step       # rerun only the RL step benchmark
    python -m benchmarks.check --only= --demo_results=/tmp/arbor_demo/demo_results.json
    python -m benchmarks.check --from_json=figures.json   # {"rl_step/tree_vs_tunix": 3.7, ...}
    python -m benchmarks.check --latest             # no reruns: what CI prints
    python -m benchmarks.check --record             # also append the new figures to the history

Reruns (`--only`, each a subprocess on this machine):
  rl_step   `python -m benchmarks.rl_step --part=step`: tokens/s of the tree-packed and the
            linearized Arbor step, and the ratios tree-packed / tunix and linearized / torch
            (the tunix side needs its virtualenv, `bash benchmarks/setup_tunix.sh`; without it
            the tunix ratio is skipped, the other figures are still checked).
  demo_sft  the demo's SFT stage for seed 0, `python -m trainer.main
            --config=configs/sft_demo.py`: the last step's training loss, the last held-out
            eval loss, and the minutes from the run's start (config.json written) to its last
            metrics line (tokenizer, episodes, compile, steps and evals).
`--demo_results` adds the figures of a finished `make demo` (its demo_results.json): per seed
SFT and RL held-out pass@1 and minutes, the improvement's mean and lower 95% bound.

Each figure is compared with the best value recorded for it on the same machine kind
(benchmarks.history.kind): more than `--tolerance` worse is a regression; a figure without
history on the kind is "new". `--latest` compares, for every figure and kind, the newest record
with the best earlier one. Prints a table, then one JSON line with the findings. Exit status 0
(a report) unless --strict, where a regression or a failed rerun exits 1.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Iterable, Optional

from absl import app, flags

from benchmarks import history

RERUNS = ("rl_step", "demo_sft")

flags.DEFINE_list("only", list(RERUNS), f"benchmarks to rerun, of {', '.join(RERUNS)} "
                  "(empty: none)")
flags.DEFINE_string("from_json", None, "compare the figures of this JSON file, "
                    '{"benchmark/figure": value, ...}, instead of rerunning anything')
flags.DEFINE_string("demo_results", None, "also check a finished demo's demo_results.json")
flags.DEFINE_string("history", history.PATH, "the history file")
flags.DEFINE_float("tolerance", 0.05, "relative share a figure may be worse than its best")
flags.DEFINE_bool("record", False, "append the figures measured to the history after comparing")
flags.DEFINE_string("note", None, "with --record: a note stored with the new records")
flags.DEFINE_bool("strict", False, "exit 1 when a figure regressed or a rerun failed")
flags.DEFINE_bool("latest", False, "no reruns: the newest record of every figure and machine "
                  "kind against the best earlier one")
flags.DEFINE_string("machine", None, "the machine the figures were measured on, as "
                    "benchmarks.common.machine() writes it (default: this one's)")
flags.DEFINE_integer("rl_step_repeats", 5, "interleaved rounds of the rl_step rerun (its default)")
FLAGS = flags.FLAGS

# The figures each rerun reports and which way is better.
RL_STEP_FIGURES = {"tree_vs_tunix": "higher", "linear_vs_torch": "higher",
                   "arbor_tree_tokens_per_s": "higher", "arbor_linear_tokens_per_s": "higher"}
DEMO_SFT_FIGURES = {"final_loss": "lower", "eval_loss": "lower", "minutes": "lower"}
TUNIX_VENV = os.environ.get("TUNIX_VENV", os.path.join(history.ROOT, "build", "tunix-venv"))


def say(msg: str) -> None:
  """Progress, on stderr (stdout carries the table and the JSON line)."""
  print(f"[check] {msg}", file=sys.stderr, flush=True)


def direction(benchmark: str, figure: str, records: Iterable[dict]) -> str:
  """Which way a figure is better: as recorded in the history, else by the naming convention
  of the figures (the part after the last "/"): "*_per_s" is higher; "*minutes", "*loss",
  "*_ms", "*_s" are lower; anything else (ratios, speed-ups, pass@1) is higher."""
  for r in records:
    if r["benchmark"] == benchmark and r["figure"] == figure:
      return r["better"]
  name = figure.rsplit("/", 1)[-1]
  if name.endswith("_per_s"):
    return "higher"
  if name.endswith(("minutes", "loss", "_ms", "_s")):
    return "lower"
  return "higher"


# ----------------------------------------------------------------------------- reading results


def read_json_figures(path: str) -> dict[str, dict[str, float]]:
  """{"benchmark/figure": value} from a file -> {benchmark: {figure: value}}.

  Raises:
    ValueError: not a JSON object, a key without "/", a value that is not a number.
  """
  with open(path) as f:
    data = json.load(f)
  if not isinstance(data, dict):
    raise ValueError(f"{path}: expected a JSON object {{\"benchmark/figure\": value}}")
  out: dict[str, dict[str, float]] = {}
  for key, value in data.items():
    benchmark, sep, figure = key.partition("/")
    if not sep or not benchmark or not figure:
      raise ValueError(f"{path}: key {key!r} is not 'benchmark/figure'")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ValueError(f"{path}: {key}: {value!r} is not a number")
    out.setdefault(benchmark, {})[figure] = float(value)
  return out


def rl_step_figures(result: dict) -> dict[str, float]:
  """The headline figures of a `benchmarks.rl_step --part=step` JSON result (those present)."""
  return {k: float(result[k]) for k in RL_STEP_FIGURES if k in result}


def sft_run_figures(workdir: str) -> dict[str, float]:
  """final_loss, eval_loss and minutes of an SFT run's workdir.

  Reads <workdir>/sft/metrics.jsonl (trainer.metrics: one JSON line per step with "step",
  "wall_time", "loss", and "eval/loss" on eval steps; a last line cut short is skipped) and the
  modification time of <workdir>/config.json, which the run writes when it starts.

  Raises:
    ValueError: no complete metrics line with a loss.
  """
  lines = []
  with open(os.path.join(workdir, "sft", "metrics.jsonl")) as f:
    for line in f:
      try:
        lines.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  losses = [l for l in lines if "loss" in l]
  if not losses:
    raise ValueError(f"{workdir}: no training loss in sft/metrics.jsonl")
  out = {"final_loss": float(losses[-1]["loss"])}
  evals = [l for l in lines if "eval/loss" in l]
  if evals:
    out["eval_loss"] = float(evals[-1]["eval/loss"])
  start = os.path.getmtime(os.path.join(workdir, "config.json"))
  out["minutes"] = (lines[-1]["wall_time"] - start) / 60
  return out


def demo_figures(results: dict) -> dict[str, float]:
  """The figures of a demo_results.json (trainer/demo.py): seed_<s>/sft_pass@1,
  seed_<s>/rl_pass@1, seed_<s>/minutes per seed, improvement/diff and improvement/low (the
  paired bootstrap 95% interval's mean and lower bound, as fractions: 0.345 = 34.5 points)."""
  out = {}
  for s in results["seeds"]:
    for key in ("sft_pass@1", "rl_pass@1", "minutes"):
      out[f"seed_{s['seed']}/{key}"] = float(s[key])
  for key in ("diff", "low"):
    out[f"improvement/{key}"] = float(results["improvement"][key])
  return out


# ----------------------------------------------------------------------------- reruns


def run_command(cmd: list[str], what: str) -> bool:
  """Runs a command in the repository root with its output on stderr; True if it succeeded."""
  say(f"{what}: {' '.join(cmd)}")
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, cwd=history.ROOT, stdout=sys.stderr, stderr=sys.stderr)
  say(f"{what}: {'done' if proc.returncode == 0 else f'FAILED (exit {proc.returncode})'} "
      f"in {(time.perf_counter() - t0) / 60:.1f} min")
  return proc.returncode == 0


def rerun_rl_step(skipped: dict[str, str]) -> Optional[dict[str, float]]:
  """`benchmarks.rl_step --part=step` in a subprocess; its figures, or None if it failed."""
  sides = ["arbor_tree", "arbor_linear", "torch"]
  if os.access(os.path.join(TUNIX_VENV, "bin", "python"), os.X_OK):
    sides.append("tunix")
  else:
    skipped["rl_step/tree_vs_tunix"] = (f"no tunix virtualenv at {TUNIX_VENV} "
                                        "(bash benchmarks/setup_tunix.sh makes it)")
    say(f"rl_step: {skipped['rl_step/tree_vs_tunix']}: tree_vs_tunix is skipped")
  tmp = tempfile.mkdtemp(prefix="arbor_check_rl_step_")
  try:
    out = os.path.join(tmp, "rl_step.json")
    cmd = [sys.executable, "-m", "benchmarks.rl_step", "--part=step", f"--out={out}",
           f"--sides={','.join(sides)}", f"--repeats={FLAGS.rl_step_repeats}"]
    if not run_command(cmd, "rl_step (a few minutes)"):
      return None
    with open(out) as f:
      return rl_step_figures(json.load(f))
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def rerun_demo_sft() -> Optional[dict[str, float]]:
  """The demo's SFT stage (configs/sft_demo.py, seed 0) in a fresh workdir; its figures, or
  None if it failed."""
  tmp = tempfile.mkdtemp(prefix="arbor_check_sft_")
  try:
    cmd = [sys.executable, "-m", "trainer.main", "--config=configs/sft_demo.py",
           "--config.seed=0", f"--workdir={tmp}"]
    if not run_command(cmd, "demo_sft (about 7 min on 2 cores)"):
      return None
    return sft_run_figures(tmp)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- report


def _num(v: Optional[float]) -> str:
  if v is None:
    return "-"
  return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def table(findings: list[history.Finding]) -> str:
  """The findings as a plain-text table, one block per machine kind."""
  head = ("benchmark", "figure", "now", "best", "when / commit", "change", "verdict")
  out = []
  for kind in dict.fromkeys(f.kind for f in findings):
    rows = [head]
    for f in (f for f in findings if f.kind == kind):
      now = _num(f.value) + (f" ({f.date})" if f.date else "")
      when = f"{f.best_date} {f.best_commit}" if f.best_date else "-"
      change = "-" if f.change is None else (
          f"{f.change:+.1%}" if math.isfinite(f.change) else f"{f.change:+}")
      verdict = f.verdict.upper() if f.regression else f.verdict
      rows.append((f.benchmark, f.figure, now, _num(f.best), when, change, verdict))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    out.append(f"machine kind: {kind}")
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    out.append("")
  return "\n".join(out) if out else "no figures to compare\n"


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  unknown = sorted(set(FLAGS.only) - set(RERUNS))
  if unknown:
    raise app.UsageError(f"--only: unknown {unknown}; choose from {', '.join(RERUNS)}")
  if FLAGS.latest and (FLAGS.record or FLAGS.from_json or FLAGS.demo_results):
    raise app.UsageError("--latest compares the history with itself: no --record, "
                         "--from_json or --demo_results")
  records = history.load(FLAGS.history)
  say(f"history: {len(records)} records in {FLAGS.history}")

  current: dict[str, dict[str, float]] = {}
  failed: dict[str, str] = {}
  skipped: dict[str, str] = {}
  machine = kind = None
  if FLAGS.latest:
    findings = history.latest(records, FLAGS.tolerance)
  else:
    machine = FLAGS.machine or history.current_machine()
    kind = history.kind(machine)
    say(f"machine: {machine} (kind: {kind})")
    if FLAGS.from_json:
      current.update(read_json_figures(FLAGS.from_json))
    else:
      for name, rerun in (("rl_step", lambda: rerun_rl_step(skipped)),
                          ("demo_sft", rerun_demo_sft)):
        if name in FLAGS.only:
          figures = rerun()
          if figures is None:
            failed[name] = "the rerun failed (its output is above)"
          else:
            current[name] = figures
    if FLAGS.demo_results:
      with open(FLAGS.demo_results) as f:
        current["demo"] = demo_figures(json.load(f))
    findings = history.compare({(b, f): v for b, figs in current.items()
                                for f, v in figs.items()}, records, kind, FLAGS.tolerance)

  print(table(findings), end="")
  for name, why in {**failed, **skipped}.items():
    print(f"{'FAILED' if name in failed else 'skipped'}: {name}: {why}")
  regressions = [f for f in findings if f.regression]
  print(f"{len(regressions)} regression(s) of {len(findings)} figure(s), tolerance "
        f"{FLAGS.tolerance:.0%}" + (f"; failed: {', '.join(failed)}" if failed else ""))
  if FLAGS.record and current:
    for benchmark, figures in current.items():
      for name in [f for f, v in figures.items() if not math.isfinite(v)]:
        say(f"not recorded: {benchmark}/{name} = {figures.pop(name)}")
      better = {f: direction(benchmark, f, records) for f in figures}
      history.append(history.make_records(benchmark, figures, better, machine, note=FLAGS.note),
                     FLAGS.history)
    say(f"recorded {sum(map(len, current.values()))} figure(s) in {FLAGS.history}")
  print(json.dumps({"kind": kind, "tolerance": FLAGS.tolerance,
                    "regressions": len(regressions), "failed": failed, "skipped": skipped,
                    "findings": [f.to_dict() for f in findings]}))
  if FLAGS.strict and (regressions or failed):
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
