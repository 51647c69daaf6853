"""PPO with a learned critic (GAE) against the demo's CISPO + GRPO, on the demo's RL budget.

    python -m benchmarks.critic_demo --workdir=/tmp/critic_demo/seed_0 \\
        --arms=cispo_grpo,ppo_gae_l0.95,ppo_gae_l1 --update_docs

`--workdir` is one demo seed's directory (`trainer.main --config=configs/demo.py` writes
<workdir>/seed_<s>/): its sft/ is the SFT checkpoint every arm starts from (run here, as the
demo's SFT stage of seed `--seed`, when it is missing), and a finished demo's rl/, eval_sft.json
and eval_rl.json are reused as the SFT and cispo_grpo results. Every arm is the demo's RL
stage (configs/demo.py: 12 steps x 8 tasks x 8 episodes, taskgen seed 1, Muon lr 3e-4) with:
  cispo_grpo        nothing changed (CISPO, group-normalised advantages);
  <loss>_gae_l<λ>   loss <loss> ("ppo": the clipped ratio, token mean; "cispo") on per-token
                    GAE advantages of a learned critic (trainer.critic: a copy of the SFT policy
                    with a zero value head, Adam `--critic_lr`, one update per step), γ 1, λ <λ>;
                    the policy trains after `--critic_warmup` critic-only steps;
                    `--keep_constant_groups` keeps all-pass / all-fail groups (the critic's
                    advantages -V are not 0 on them, and its value targets are real data).
Each arm's last checkpoint is evaluated greedily on the demo's held-out tasks (`--eval_tasks`
of them, taskgen seed 1 far past the RL tasks: the demo's `held_out_eval`); reported per arm:
held-out pass@1, its paired bootstrap 95% interval over the tasks minus the SFT checkpoint and
minus cispo_grpo (`trainer.evaluate.paired_bootstrap`), RL and eval minutes, the sampled pass
rate per step and, for a critic, its value loss, explained variance and mean value per step.
Finished runs and evaluations in `--workdir` are reused. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re

import jax
import ml_collections
import numpy as np

from benchmarks.common import machine, today, write_section
from configs import demo
from trainer import config as config_lib
from trainer import demo as demo_lib
from trainer import evaluate, rl, sft
from trainer.metrics import read_jsonl
from trainer.rejection import latest_step

BASELINE = "cispo_grpo"
ARM = re.compile(r"^(?P<loss>[a-z_]+?)_gae_l(?P<lam>[0-9.]+)$")
CURVES = ("reward_mean", "pass_rate", "groups_trained", "value_loss", "value_error",
          "value_explained_variance", "value_mean", "returns_mean")


def arm_config(base, args, arm: str) -> ml_collections.ConfigDict:
  """The demo's RL stage of seed `args.seed` from <workdir>/sft, as arm `arm`.

  Raises:
    SystemExit: an arm name that is neither `BASELINE` nor <loss>_gae_l<λ>.
  """
  _, cfg = demo_lib.stage_configs(base, args.seed, args.workdir)
  cfg.eval.num_tasks = args.eval_tasks
  cfg.metrics.progress = False
  if arm == BASELINE:
    return cfg
  m = ARM.match(arm)
  if m is None:
    raise SystemExit(f"--arms: {arm!r} is neither {BASELINE!r} nor <loss>_gae_l<lambda>")
  cfg.loss.name = m["loss"]
  if m["loss"] != "cispo":
    cfg.loss.eps_high = None  # the loss's own defaults (ppo: ε 0.2 / 0.2)
  cfg.rl.advantage = "gae"
  cfg.rl.gae_gamma = 1.0
  cfg.rl.gae_lambda = float(m["lam"])
  cfg.rl.critic_lr = args.critic_lr
  cfg.rl.critic_warmup_steps = args.critic_warmup
  cfg.rl.drop_constant_groups = not args.keep_constant_groups
  return cfg


def run_name(arm: str, args) -> str:
  """The arm's run directory under --workdir: the demo's own "rl" for the baseline."""
  if arm == BASELINE:
    return "rl"
  return (f"rl_{arm}_clr{args.critic_lr:g}_w{args.critic_warmup}"
          f"{'_keep' if args.keep_constant_groups else ''}")


def eval_path(workdir: str, name: str, tasks: int, demo_tasks: int) -> str:
  """eval_<name>.json as the demo names it for its own task count, else with the count."""
  return os.path.join(workdir, f"eval_{name}" + ("" if tasks == demo_tasks else f"_t{tasks}")
                      + ".json")


def run_stats(run_dir: str) -> dict:
  """The run's clock (its steps' wall time, so a reused run is not timed again) and per-step
  curves."""
  lines = [x for _, x in sorted(read_jsonl(os.path.join(run_dir, "rl", "metrics.jsonl")).items())
           if "episodes" in x]
  out = {"rl_minutes": sum(x.get("time/step", 0.0) for x in lines) / 60,
         "critic_s_per_step": float(np.mean([x.get("time/critic", 0.0) for x in lines])),
         "train_s_per_step": float(np.mean([x.get("time/train", 0.0) for x in lines]))}
  for k in CURVES:
    if any(k in x for x in lines):
      out[k] = [round(float(x[k]), 4) if k in x else None for x in lines]
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", required=True, help="a demo seed's directory (holds sft/)")
  p.add_argument("--seed", type=int, default=0, help="the demo seed of --workdir")
  p.add_argument("--arms", default=f"{BASELINE},ppo_gae_l0.95,ppo_gae_l1",
                 help=f"{BASELINE} and <loss>_gae_l<lambda> arms")
  p.add_argument("--eval_tasks", type=int, default=200)
  p.add_argument("--critic_lr", type=float, default=1e-3)
  p.add_argument("--critic_warmup", type=int, default=1)
  p.add_argument("--keep_constant_groups", action=argparse.BooleanOptionalAction, default=True)
  p.add_argument("--update_docs", action="store_true")
  args = p.parse_args()
  base = demo.get_config()
  demo_tasks = base.rl.eval.num_tasks
  jax.config.update("jax_compilation_cache_dir", os.path.join(args.workdir, "xla_cache"))
  arms = args.arms.split(",")
  cfgs = {arm: arm_config(base, args, arm) for arm in arms}

  # the SFT checkpoint (the demo's SFT stage, unless finished) and its eval
  demo_lib.prepare_environment(base)
  sft_cfg, rl_cfg = demo_lib.stage_configs(base, args.seed, args.workdir)
  sft_dir = os.path.join(args.workdir, "sft")
  if (latest_step(sft_dir) or 0) < sft_cfg.train.steps:
    sft.run(sft_cfg, sft_dir)
  for arm, cfg in cfgs.items():  # (the RL stages read the SFT checkpoint's model config)
    config_lib.validate(cfg, os.path.join(args.workdir, run_name(arm, args)))
  rl_cfg.eval.num_tasks = args.eval_tasks
  sft_eval = demo_lib.held_out_eval(rl_cfg, sft_dir,
                                    eval_path(args.workdir, "sft", args.eval_tasks, demo_tasks),
                                    None)
  print(json.dumps({"arm": "sft", "pass@1": sft_eval["pass@1"]}), flush=True)

  results = {}
  for arm, cfg in cfgs.items():
    name = run_name(arm, args)
    run_dir = os.path.join(args.workdir, name)
    if (latest_step(run_dir) or 0) < cfg.train.steps:
      rl.run(cfg, run_dir)
    held = demo_lib.held_out_eval(cfg, run_dir,
                                  eval_path(args.workdir, name, args.eval_tasks, demo_tasks), None)
    results[arm] = {"run": name, "pass@1": held["pass@1"], "per_task": held["per_task"],
                    "eval_minutes": held["time_s"] / 60, **run_stats(run_dir)}
    print(json.dumps({"arm": arm, **{k: v for k, v in results[arm].items()
                                     if k != "per_task"}}), flush=True)

  summary = {"date": today(), "machine": machine(), "seed": args.seed,
             "eval_tasks": args.eval_tasks, "steps": base.rl.train.steps,
             "tasks_per_step": base.rl.rl.prompts_per_step, "group_size": base.rl.rl.group_size,
             "critic_lr": args.critic_lr, "critic_warmup": args.critic_warmup,
             "keep_constant_groups": args.keep_constant_groups,
             "sft_pass@1": sft_eval["pass@1"], "sft_eval_minutes": sft_eval["time_s"] / 60,
             "arms": {arm: {k: v for k, v in r.items() if k != "per_task"}
                      for arm, r in results.items()},
             "minus_sft": {arm: evaluate.paired_bootstrap(sft_eval["per_task"], r["per_task"])
                           for arm, r in results.items()}}
  if BASELINE in results:
    summary["minus_baseline"] = {
        arm: evaluate.paired_bootstrap(results[BASELINE]["per_task"], r["per_task"])
        for arm, r in results.items() if arm != BASELINE}
  print(json.dumps(summary, indent=1))
  if args.update_docs:
    write_section("critic_demo", markdown(summary))


def _ci(ci: dict) -> str:
  return f"{ci['diff']:+.3f} ({ci['low']:+.3f} .. {ci['high']:+.3f})"


def markdown(s: dict) -> str:
  """The docs/benchmarks.md section of a summary."""
  rows = ["| arm | held-out pass@1 | minus SFT (95% CI) | minus cispo_grpo (95% CI) | "
          "RL min | eval min | sampled pass rate, steps 1 -> last |",
          "| --- | --- | --- | --- | --- | --- | --- |",
          f"| SFT | {s['sft_pass@1']:.3f} | | | | {s['sft_eval_minutes']:.1f} | |"]
  for arm, a in s["arms"].items():
    vs_base = s.get("minus_baseline", {}).get(arm)
    rates = [x for x in a.get("pass_rate", []) if x is not None]
    rows.append(f"| {arm} | {a['pass@1']:.3f} | {_ci(s['minus_sft'][arm])} | "
                f"{_ci(vs_base) if vs_base else ''} | {a['rl_minutes']:.1f} | "
                f"{a['eval_minutes']:.1f} | "
                f"{f'{rates[0]:.2f} -> {rates[-1]:.2f}' if rates else ''} |")
  curves = []
  for arm, a in s["arms"].items():
    if "value_loss" in a:
      fmt = lambda xs, d=2: ", ".join("–" if x is None else f"{x:.{d}f}" for x in xs)
      curves.append(f"- {arm}: value loss per step {fmt(a['value_loss'], 3)}; explained variance "
                    f"{fmt(a.get('value_explained_variance', []))}; mean value "
                    f"{fmt(a.get('value_mean', []))} (mean target "
                    f"{fmt(a.get('returns_mean', []))})")
  return (f"## PPO with a learned critic (GAE) vs the demo's CISPO + GRPO\n\n"
          f"{s['date']}, {s['machine']}; `python -m benchmarks.critic_demo` (demo seed "
          f"{s['seed']}'s SFT checkpoint, every arm the demo's RL stage: {s['steps']} steps x "
          f"{s['tasks_per_step']} tasks x {s['group_size']} episodes; critic arms: γ 1, Adam "
          f"lr {s['critic_lr']:g}, {s['critic_warmup']} critic-only step(s), constant groups "
          f"{'kept' if s['keep_constant_groups'] else 'dropped'}; greedy pass@1 on "
          f"{s['eval_tasks']} held-out tasks, paired bootstrap over the tasks).\n\n"
          + "\n".join(rows) + "\n\n" + "\n".join(curves) + "\n")


if __name__ == "__main__":
  main()
