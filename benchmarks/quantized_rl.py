"""Quantized rollouts in RL on the demo: does sampling from an int8 / fp8 copy of the policy learn
as well as sampling from the training weights, with a mismatch correction on?

    python -m benchmarks.quantized_rl --sft=/tmp/arbor_sft_demo --workdir=/tmp/quantized_rl \\
        --qtypes=none,int8 --seeds=0,1 --correction=icepop --update_docs

Each (rollout qtype, seed) is the demo's RL stage (configs/demo.py: CISPO, Muon, 12 steps of
8 tasks x 8 samples on generated bug-fixing tasks, bwrap sandboxes) started from the SFT
checkpoint `--sft`, with `rl.rollout_qtype` (the engine samples from a weight-only qwix copy,
re-quantized at every weight sync; the trainer stays fp32) and `rl.correction`, which weighs
the trainer's π_old (`rl.recompute_old`: one scoring pass per step) against the sampler's
log-probs. Reported per run: the greedy held-out pass@1 of its last checkpoint (the demo's
held-out tasks), the mean reward of the first and last steps, and the per-step train/sampler mismatch the step measures
(`mismatch_kl_k3`, `mismatch_max_abs_log_ratio`: max |Δ log-prob| over the step's loss
tokens); per qtype the seeds' mean pass@1 and its spread, and the paired bootstrap 95% interval
of each quantized run minus the full-precision run of the same seed. Finished runs in
`--workdir` are reused. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from benchmarks.common import machine, today, write_section
from configs import demo
from trainer import demo as demo_lib
from trainer import evaluate, rl
from trainer.metrics import JSONL, read_jsonl


def rl_config(sft_dir: str, seed: int, qtype: str, correction: str, steps: int):
  """The demo's RL stage for one seed, from `sft_dir`, sampling from `qtype` weights."""
  _, cfg = demo_lib.stage_configs(demo.get_config(), seed, os.path.dirname(sft_dir))
  cfg.model.init = f"ckpt:{sft_dir}"
  cfg.tokenizer.path = os.path.join(sft_dir, "tokenizer")
  cfg.rl.correction = correction
  cfg.rl.recompute_old = correction != "none"  # the correction weighs the trainer's π_old / μ
  cfg.rl.rollout_qtype = None if qtype == "none" else qtype
  if steps:
    cfg.train.steps = cfg.optimizer.total_steps = steps
  return cfg


def one_run(args, qtype: str, seed: int) -> dict:
  """RL (reused when finished), its held-out eval and its per-step metrics."""
  cfg = rl_config(args.sft, seed, qtype, args.correction, args.steps)
  run_dir = os.path.join(args.workdir, f"{qtype}_seed{seed}")
  rl.run(cfg, run_dir)
  # evaluated in full precision, as every other checkpoint: the policy learnt, not its sampler
  eval_cfg = rl_config(args.sft, seed, "none", args.correction, args.steps)
  result = demo_lib.held_out_eval(eval_cfg, run_dir, os.path.join(run_dir, "eval.json"), None)
  lines = read_jsonl(os.path.join(run_dir, "rl", JSONL))
  steps = [lines[k] for k in sorted(lines)]
  kl = [s["mismatch_kl_k3"] for s in steps if "mismatch_kl_k3" in s]
  dmax = [s["mismatch_max_abs_log_ratio"] for s in steps if "mismatch_max_abs_log_ratio" in s]
  rewards = [s["reward_mean"] for s in steps if "reward_mean" in s]
  minutes = sum(s.get("time/step", 0.0) for s in steps) / 60  # the run's own steps (reused too)
  return {"qtype": qtype, "seed": seed, "pass@1": result["pass@1"],
          "per_task": result["per_task"], "reward_first": rewards[0], "reward_last": rewards[-1],
          "mismatch_kl_k3_mean": statistics.fmean(kl), "mismatch_kl_k3_max": max(kl),
          "max_abs_dlogprob": max(dmax), "steps": len(steps), "minutes": minutes}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--sft", required=True, help="the SFT demo's workdir (its latest checkpoint)")
  p.add_argument("--workdir", required=True)
  p.add_argument("--qtypes", default="none,int8", help="'none' = the training weights")
  p.add_argument("--seeds", default="0,1")
  p.add_argument("--correction", default="icepop", help="rl.correction of every run")
  p.add_argument("--steps", type=int, default=0, help="RL steps (0: the demo's)")
  p.add_argument("--update_docs", action="store_true")
  args = p.parse_args()
  os.makedirs(args.workdir, exist_ok=True)
  qtypes, seeds = args.qtypes.split(","), [int(s) for s in args.seeds.split(",")]
  runs = [one_run(args, q, s) for q in qtypes for s in seeds]
  base_cfg = rl_config(args.sft, seeds[0], "none", args.correction, args.steps)
  sft = demo_lib.held_out_eval(base_cfg, args.sft, os.path.join(args.workdir, "eval_sft.json"),
                               None)
  full = {r["seed"]: r for r in runs if r["qtype"] == "none"}
  for r in runs:
    if r["qtype"] != "none" and r["seed"] in full:
      r["minus_full"] = evaluate.paired_bootstrap(full[r["seed"]]["per_task"], r["per_task"])
  summary = {}
  for q in qtypes:
    mine = [r for r in runs if r["qtype"] == q]
    summary[q] = {"pass@1": [r["pass@1"] for r in mine],
                  "mean": statistics.fmean(r["pass@1"] for r in mine),
                  "mismatch_kl_k3_mean": statistics.fmean(r["mismatch_kl_k3_mean"] for r in mine),
                  "max_abs_dlogprob": max(r["max_abs_dlogprob"] for r in mine)}
  out = {"sft": args.sft, "sft_pass@1": sft["pass@1"], "correction": args.correction,
         "summary": summary,
         "runs": [{k: v for k, v in r.items() if k != "per_task"} for r in runs]}
  print(json.dumps(out, indent=1), flush=True)
  with open(os.path.join(args.workdir, "result.json"), "w") as f:
    json.dump(out, f, indent=1)
  if args.update_docs:
    write_section("quantized_rl", markdown(out))


def markdown(out: dict) -> str:
  rows = "\n".join(
      f"| {r['qtype']} | {r['seed']} | {r['pass@1']:.3f} | {r['reward_first']:.3f} -> "
      f"{r['reward_last']:.3f} | {r['mismatch_kl_k3_mean']:.2e} (max {r['mismatch_kl_k3_max']:.2e})"
      f" | {r['max_abs_dlogprob']:.3f} | "
      + (f"{r['minus_full']['diff']:+.3f} ({r['minus_full']['low']:+.3f} .. "
         f"{r['minus_full']['high']:+.3f})" if "minus_full" in r else "-")
      + f" | {r['minutes']:.1f} |" for r in out["runs"])
  means = "; ".join(f"{q}: {s['mean']:.3f} ({', '.join(f'{x:.3f}' for x in s['pass@1'])})"
                    for q, s in out["summary"].items())
  return (
      "## Quantized rollouts in RL\n\n"
      f"{today()}, {machine()}; `python -m benchmarks.quantized_rl`. The demo's RL stage "
      f"(CISPO, Muon) from the SFT demo checkpoint (held-out greedy pass@1 "
      f"{out['sft_pass@1']:.3f}), with `rl.correction={out['correction']}` weighing the fp32 "
      "trainer's π_old (`rl.recompute_old`) against the sampler's log-probs; `rl.rollout_qtype` "
      "makes the engine sample from a weight-only qwix copy re-quantized at every weight sync "
      "(the trainer stays fp32). Mismatch: the step's k3 KL between trainer and sampler "
      "log-probs over its loss tokens (mean over steps, and the largest step) and max |Δ "
      "log-prob|. Runs of one seed draw the same random numbers, so their samples part only "
      "where quantization moves a token across a draw's threshold. Minutes: the RL steps' "
      "time on a shared machine.\n\n"
      "| rollouts | seed | held-out pass@1 | reward first -> last step | mismatch KL (k3) | "
      "max abs Δ log-prob | minus full precision, same seed (95%) | minutes |\n"
      "| --- | --- | --- | --- | --- | --- | --- | --- |\n"
      f"{rows}\n\nMean held-out pass@1 per rollout precision (seeds): {means}.\n")


if __name__ == "__main__":
  main()
