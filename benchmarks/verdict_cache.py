"""The verdict cache on the demo's RL stage: the same steps with and without it.

    python -m benchmarks.verdict_cache --sft_dir=/tmp/arbor_demo/seed_0/sft \\
        --workdir=/tmp/verdict_bench --steps=4 --rounds=2 --update_docs

From one SFT checkpoint of the demo (configs/demo.py's SFT stage), the demo's RL stage (CISPO,
8 generated tasks x 8 episodes per step, bwrap sandboxes) runs `--steps` steps with
`rl.cache_verdicts` on and off, `--rounds` times each, alternating (one persistent XLA cache,
so no arm pays the compiles alone; finished runs in `--workdir` are reused). A step's rewards
come from the tasks' tests (pytest in a fresh sandbox per distinct submission with the cache,
per episode without), so both arms must train the same: per step, the rewards and the groups
trained must be equal and the loss and gradient norm equal to rounding (relative 1e-5: the
sampler's log-probs may differ in the last bits with how the engine batched the calls), or the
script stops with an error. Reported: rollout seconds per step (median over the
rounds, per step, then the mean over steps), the share of rewards taken from an identical
submission's test run (`verdicts_shared`), the ratio off / on. Prints JSON; `--update_docs`
rewrites its section of docs/benchmarks.md and appends the ratio to the figures' history.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics

import jax

from benchmarks import history
from benchmarks.common import machine, today, write_section
from configs import demo
from trainer import demo as demo_lib
from trainer import rl
from trainer.metrics import read_jsonl

EXACT = ("reward_mean", "pass_rate", "groups_trained")
ROUNDED = ("loss", "grad_norm")  # relative tolerance RTOL
RTOL = 1e-5


def steps_of(run_dir: str) -> list[dict]:
  """The per-step metric lines of an RL run."""
  return [x for _, x in sorted(read_jsonl(os.path.join(run_dir, "rl", "metrics.jsonl")).items())
          if "episodes" in x]


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--sft_dir", required=True, help="the demo's SFT stage workdir (seed_<s>/sft)")
  p.add_argument("--workdir", required=True, help="where the runs go (finished ones reused)")
  p.add_argument("--seed", type=int, default=0, help="the demo seed of --sft_dir")
  p.add_argument("--steps", type=int, default=4)
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--update_docs", action="store_true")
  args = p.parse_args()
  base = demo.get_config()
  os.makedirs(args.workdir, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", os.path.join(args.workdir, "xla_cache"))
  demo_lib.prepare_environment(base)
  runs: dict[bool, list[list[dict]]] = {True: [], False: []}
  for r in range(args.rounds):
    for cached in (True, False):
      _, cfg = demo_lib.stage_configs(base, args.seed, os.path.dirname(args.sft_dir))
      cfg.model.init = f"ckpt:{args.sft_dir}"
      cfg.tokenizer.path = os.path.join(args.sft_dir, "tokenizer")
      cfg.train.steps = cfg.optimizer.total_steps = args.steps
      cfg.train.checkpoint_every = args.steps
      cfg.metrics.progress = False
      cfg.rl.cache_verdicts = cached
      run_dir = os.path.join(args.workdir, f"{'on' if cached else 'off'}_{r}")
      if len(steps_of(run_dir)) != args.steps:
        shutil.rmtree(run_dir, ignore_errors=True)
        rl.run(cfg, run_dir)
      lines = steps_of(run_dir)
      runs[cached].append(lines)
      print(json.dumps({"cache": cached, "round": r,
                        "rollout_s": [round(x["time/rollout"], 2) for x in lines],
                        "verdicts_shared": [round(x.get("verdicts_shared", 0.0), 3)
                                            for x in lines]}), flush=True)
  reference = runs[True][0]
  for lines in runs[True] + runs[False]:
    for step, (a, b) in enumerate(zip(reference, lines), 1):
      for k in EXACT + ROUNDED:
        same = (a.get(k) == b.get(k) if k in EXACT else
                math.isclose(a[k], b[k], rel_tol=RTOL) if k in a and k in b else k not in a
                and k not in b)
        if not same:
          raise SystemExit(f"step {step}: {k} {a.get(k)!r} with the cache vs {b.get(k)!r}: the "
                           "runs did not train the same")

  def rollout_s(cached: bool) -> float:
    per_step = [statistics.median(run[i]["time/rollout"] for run in runs[cached])
                for i in range(args.steps)]
    return statistics.fmean(per_step)
  on, off = rollout_s(True), rollout_s(False)
  summary = {"date": today(), "machine": machine(), "seed": args.seed, "steps": args.steps,
             "rounds": args.rounds, "rollout_s_cache_on": round(on, 2),
             "rollout_s_cache_off": round(off, 2), "speedup": round(off / on, 3),
             "verdicts_shared": round(statistics.fmean(x.get("verdicts_shared", 0.0)
                                                       for x in reference), 3),
             "identical_training": True}
  print(json.dumps(summary, indent=1))
  if args.update_docs:
    write_section("verdict_cache", markdown(summary))
    history.record("verdict_cache", {"rollout_speedup": summary["speedup"]}, "higher")


def markdown(s: dict) -> str:
  """The docs/benchmarks.md section of a summary."""
  return (f"## Verdict cache on the demo's RL stage\n\n"
          f"{s['date']}, {s['machine']}; `python -m benchmarks.verdict_cache` (demo seed "
          f"{s['seed']}'s SFT checkpoint, the demo's RL stage for {s['steps']} steps, "
          f"`rl.cache_verdicts` on and off alternating, {s['rounds']} rounds each, median per "
          f"step then the mean over steps). Both arms trained the same (every step's rewards "
          f"and groups equal, loss and gradient norm to 1e-5).\n\n"
          f"| rollout s / step, cache off | cache on | off / on | rewards shared |\n"
          f"| --- | --- | --- | --- |\n"
          f"| {s['rollout_s_cache_off']:.1f} | {s['rollout_s_cache_on']:.1f} | "
          f"{s['speedup']:.2f}x | {s['verdicts_shared']:.0%} |\n")


if __name__ == "__main__":
  main()
