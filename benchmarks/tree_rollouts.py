"""Independent episodes vs entropy-guided branching (tree rollouts) on the demo model and tasks.

    python -m benchmarks.tree_rollouts --sft_dir=/tmp/arbor_demo/seed_0/sft \\
        --workdir=/tmp/tree_bench --seeds=0,1 --steps=8 --update_docs

From one SFT checkpoint of the demo (configs/demo.py's SFT stage), per seed and per arm, the
demo's RL stage (CISPO, generated tasks, bwrap sandboxes) runs `--steps` steps, then the greedy
held-out pass@1 of its last checkpoint is measured on `--eval_tasks` tasks. The arms (`--arms`):
  independent     rl.group_size = `--independent_k` independent episodes per task, GRPO
                  advantages, CISPO (the demo's RL stage);
  branching       one entropy-guided tree of `--branching_k` leaves per task (envs.branching),
                  TreeRL advantages per call and the AEPO loss (entropy-aware advantage α 0.3);
  branching_grpo  the same trees, trained as the independent arm (GRPO per leaf, CISPO): what
                  the rollouts alone change.
`--branching_k` > `--independent_k` spends about the same sampled tokens per task, since the
branches share their ancestors' calls. Reported per arm (means over steps and seeds): rollout
wall time per step, sampled and trained tokens per task, pass@1 and pass@k of the groups (share
of episodes passing; share of tasks with a passing episode), held-out pass@1 per seed, and the
paired bootstrap 95% interval of each arm - independent over seeds x tasks. Finished runs and
evaluations in `--workdir` are reused. Prints JSON.

    python -m benchmarks.tree_rollouts --sft_dir=/tmp/arbor_demo/seed_0/sft \
        --workdir=/tmp/tree_bench --guidance --guidance_tasks=32 --branching_k=16 --update_docs

`--guidance` trains nothing: from the same SFT checkpoint it samples one branching group of
`--branching_k` leaves per held-out task (the first `--guidance_tasks` tasks, seed `--seeds`'
first) once per configuration of `GUIDANCE`: each step-entropy measure of envs.branching
("nats": mean full entropy in nats; "arpo": ARPO's top-k truncated sum over ln|V|) with
everything else as the branching arm, and ARPO's whole rule ("arpo_rule"). It reports whether
branching is entropy-guided under each: the mean step entropy at branch points against the mean
over all tool steps (`tree_stats`), each in its own measure's units. Finished configurations in
`--workdir` are reused.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import time

import ml_collections
import numpy as np

from benchmarks.common import machine, today, write_section
from configs import demo
from envs.branching import BranchConfig, make_branching_group, tree_stats
from envs.episode import make_sandbox_factory
from envs.policy import Generation
from models.engine import Engine
from trainer import config as config_lib
from trainer import demo as demo_lib
from trainer import evaluate, harness, rl, rollouts
from trainer.metrics import read_jsonl
from trainer.tasks import held_out_tasks

ARMS = ("independent", "branching", "branching_grpo")


def arm_config(base, seed: int, sft_dir: str, arm: str, args) -> ml_collections.ConfigDict:
  """The demo's RL stage from `sft_dir`, as arm `arm` ("independent" | "branching")."""
  _, cfg = demo_lib.stage_configs(base, seed, os.path.dirname(sft_dir))
  cfg.train.steps = cfg.optimizer.total_steps = args.steps
  cfg.train.checkpoint_every = args.steps
  cfg.eval.num_tasks = args.eval_tasks
  cfg.metrics.progress = False
  cfg.metrics.report = False
  if arm.startswith("branching"):
    cfg.rl.rollout = "branching"
    cfg.rl.group_size = args.branching_k
  else:
    cfg.rl.group_size = args.independent_k
  if arm == "branching":
    cfg.rl.advantage = "treerl"
    cfg.loss.name = "aepo"
    cfg.loss.entropy_adv_coef = 0.3
    cfg.loss.eps_high = None  # aepo's clip-higher default
  cfg.data.row_len = 8192  # a tree of up to 12 leaves fits one row
  return cfg


def step_stats(run_dir: str, tasks_per_step: int) -> dict:
  """Means over a run's steps of its rollout metrics."""
  lines = [x for x in read_jsonl(os.path.join(run_dir, "rl", "metrics.jsonl")).values()
           if "episodes" in x]
  get = lambda k: [x[k] for x in lines if k in x]
  # response_tokens: sampled per episode, a leaf's shared calls included (= trained per leaf)
  trained = [x["response_tokens"] * x["episodes"] / tasks_per_step for x in lines]
  # the run's own clock (a reused run is not timed again): its steps' wall time
  minutes = sum(get("time/step")) / 60
  out = {"rl_minutes": minutes, "time_rollout_s": float(np.mean(get("time/rollout"))),
         "pass_rate": float(np.mean(get("pass_rate"))),
         "group_pass_rate": float(np.mean(get("group_pass_rate"))),
         "episodes": float(np.mean(get("episodes"))),
         "trained_tokens_per_task": float(np.mean(trained)),
         "sampled_tokens_per_task": float(np.mean(get("tree/tokens_sampled") or trained))}
  for k in ("tree/branches_per_task", "tree/global_samples", "tree/branch_entropy",
            "tree/step_entropy", "tree/segment_advantage_std", "tree/shared_fraction",
            "tree_token_ratio"):
    if get(k):
      out[k] = float(np.mean(get(k)))
  return out


# The configurations `--guidance` compares: changes to the run's BranchConfig.
GUIDANCE = {"nats": {"entropy_measure": "nats"},
            "arpo": {"entropy_measure": "arpo"},
            # ARPO's whole rule: its entropy, each branch's own root entropy, the global samples
            # at once (half the budget), no consecutive-branch penalty
            "arpo_rule": {"entropy_measure": "arpo", "reset_root": True, "premonitor": False,
                          "consecutive_penalty": 0.0}}


class _TopLogprobsPolicy:
  """The engine as a Policy that also reports each token's top log-probs (ARPO's entropy)."""

  def __init__(self, engine: Engine):
    self.engine = engine
    engine.start()

  async def generate(self, input_ids, params) -> Generation:
    out = await asyncio.wrap_future(self.engine.submit(list(input_ids), params))
    return Generation(out.output_ids, out.logprobs, out.finish_reason, out.policy_version,
                      token_versions=out.token_versions, entropies=out.entropies,
                      top_logprobs=out.top_logprobs)


def guidance(args) -> dict:
  """Branching groups of the SFT checkpoint under each entropy measure (see the docstring)."""
  seed = int(args.seeds.split(",")[0])
  cfg = arm_config(demo.get_config(), seed, args.sft_dir, "branching", args)
  cfg.eval.num_tasks = args.guidance_tasks
  model_cfg = config_lib.model_config(cfg)
  model = harness.initial_model(cfg, model_cfg)
  chat = config_lib.make_chat_format(cfg, cfg.tokenizer.path)
  tasks = held_out_tasks(cfg, os.path.join(args.workdir, "guidance_tasks"))
  branch = BranchConfig(**cfg.rl.branch.to_dict())
  engine_cfg = dataclasses.replace(rollouts.engine_config(cfg, model_cfg),
                                   top_logprobs=branch.entropy_top_k)
  engine = Engine(model, engine_cfg, detokenize=chat.tokenizer.decode)
  policy = _TopLogprobsPolicy(engine)
  make_sandbox = make_sandbox_factory(cfg.rl.sandbox)
  out = {"seed": seed, "tasks": len(tasks), "k": args.branching_k, "branch": dataclasses.asdict(
      branch), "vocab_size": chat.tokenizer.vocab_size, "measures": {}}
  try:
    for name, change in GUIDANCE.items():
      cache = os.path.join(args.workdir, f"guidance_s{seed}_t{len(tasks)}_k{args.branching_k}_"
                           f"{name}.json")
      if os.path.isfile(cache):  # a finished configuration is reused
        with open(cache) as f:
          out["measures"][name] = json.load(f)
        continue
      group = make_branching_group(policy, chat, make_sandbox, rollouts.scaffold_config(cfg),
                                   dataclasses.replace(branch, **change))
      counters: dict = {}

      async def run_all():
        limiter = asyncio.Semaphore(cfg.rl.concurrency)
        return await asyncio.gather(*(group(t, args.branching_k, draw=0, seed=seed,
                                            limiter=limiter, counters=counters) for t in tasks))
      t0 = time.perf_counter()
      groups = asyncio.run(run_all())
      stats = tree_stats(groups)
      rewards = [[float(t.reward) for t in g] for g in groups]
      out["measures"][name] = {
          **stats, "rollout_s": time.perf_counter() - t0,
          "leaves": float(np.mean([len(g) for g in groups])),
          "pass_rate": float(np.mean([r >= 1.0 for g in rewards for r in g])),
          "group_pass_rate": float(np.mean([max(g, default=0.0) >= 1.0 for g in rewards])),
          "entropy_guided": stats.get("tree/branch_entropy", 0.0) > stats["tree/step_entropy"],
          "branch_over_step": stats.get("tree/branch_entropy", 0.0) / stats["tree/step_entropy"],
          "failed": counters.get("episodes_failed", 0)}
      with open(cache, "w") as f:
        json.dump(out["measures"][name], f)
      print(json.dumps({"measure": name, **out["measures"][name]}), flush=True)
  finally:
    engine.stop()
  return out


def _guidance_markdown(s: dict) -> str:
  m = s["measures"]
  rows = [("mean step entropy, all tool steps", "tree/step_entropy", "{:.4f}"),
          ("mean step entropy, branch points", "tree/branch_entropy", "{:.4f}"),
          ("branch points / all steps", "branch_over_step", "{:.2f}"),
          ("entropy-guided (branch points above)", "entropy_guided", "{}"),
          ("branches / task", "tree/branches_per_task", "{:.1f}"),
          ("global samples / task", "tree/global_samples", "{:.1f}"),
          ("leaves / task", "leaves", "{:.1f}"),
          ("shared fraction of trained tokens", "tree/shared_fraction", "{:.2f}"),
          ("group pass@1 (sampled)", "pass_rate", "{:.3f}"),
          ("failed paths (all groups)", "failed", "{}"),
          ("rollout s (all groups)", "rollout_s", "{:.0f}")]
  table = ["| | " + " | ".join(m) + " |", "| --- |" + " --- |" * len(m)]
  for name, key, fmt in rows:
    cells = [fmt.format(m[x][key]) if key in m[x] else "–" for x in m]
    table.append(f"| {name} | " + " | ".join(cells) + " |")
  b = s["branch"]
  return (f"### Entropy guidance: the step-entropy measures\n\n"
          f"{today()}, {machine()}; `python -m benchmarks.tree_rollouts --guidance` (demo SFT "
          f"checkpoint, no training: one branching group of k={s['k']} leaves on each of "
          f"{s['tasks']} held-out tasks per measure, seed {s['seed']}; α {b['base_prob']}, "
          f"γ {b['entropy_weight']}, width {b['width']}, penalty {b['consecutive_penalty']}, "
          f"pre-monitoring, n = {b['entropy_tokens']} tokens, ARPO's k = {b['entropy_top_k']} "
          f"top log-probs, |V| = {s['vocab_size']}; arpo_rule: ARPO's whole rule, its "
          f"entropy with each branch's own root entropy, half the budget as global samples "
          f"started at once and no consecutive penalty). Entropies are in each measure's own "
          f"units: nats (mean per token) and ARPO's (sum over the n tokens / ln|V|).\n\n"
          + "\n".join(table) + "\n")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--sft_dir", required=True, help="a demo seed's sft/ directory")
  p.add_argument("--workdir", required=True)
  p.add_argument("--seeds", default="0,1")
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--eval_tasks", type=int, default=100)
  p.add_argument("--independent_k", type=int, default=8)
  p.add_argument("--branching_k", type=int, default=10)
  p.add_argument("--arms", default="independent,branching,branching_grpo",
                 help=f"some of {ARMS}; the first is the baseline of the intervals")
  p.add_argument("--update_docs", action="store_true")
  p.add_argument("--guidance", action="store_true",
                 help="compare the step-entropy measures' branching (no training)")
  p.add_argument("--guidance_tasks", type=int, default=32)
  args = p.parse_args()
  if args.guidance:
    summary = guidance(args)
    print(json.dumps(summary, indent=1))
    if args.update_docs:
      write_section("tree_rollouts_entropy", _guidance_markdown(summary))
    return
  base = demo.get_config()
  seeds = [int(s) for s in args.seeds.split(",")]
  arms = args.arms.split(",")
  if not set(arms) <= set(ARMS):
    raise SystemExit(f"--arms={args.arms!r}: expected some of {ARMS}")
  results: dict = {arm: {} for arm in arms}
  for seed in seeds:
    for arm in results:
      run_dir = os.path.join(args.workdir, f"seed_{seed}", arm)
      cfg = arm_config(base, seed, args.sft_dir, arm, args)
      rl.run(cfg, run_dir)
      held = demo_lib.held_out_eval(cfg, run_dir, os.path.join(run_dir, "eval.json"), None)
      results[arm][seed] = {"held_out": held["per_task"], "held_out_pass@1": held["pass@1"],
                            **step_stats(run_dir, cfg.rl.prompts_per_step)}
      print(json.dumps({"seed": seed, "arm": arm, **{k: v for k, v in results[arm][seed].items()
                                                      if k != "held_out"}}), flush=True)
  base_arm = arms[0]
  ci = {arm: evaluate.paired_bootstrap_seeds([results[base_arm][s]["held_out"] for s in seeds],
                                             [results[arm][s]["held_out"] for s in seeds])
        for arm in arms[1:]}
  summary = {"seeds": seeds, "steps": args.steps, "eval_tasks": args.eval_tasks,
             "baseline": base_arm, "minus_baseline": ci,
             "arms": {arm: {k: float(np.mean([r[s][k] for s in seeds]))
                            for k in next(iter(r.values())) if k != "held_out"}
                      for arm, r in results.items()},
             "per_seed": {arm: {s: r[s]["held_out_pass@1"] for s in seeds}
                          for arm, r in results.items()}}
  print(json.dumps(summary, indent=1))
  if args.update_docs:
    write_section("tree_rollouts", _markdown(summary, args))


def _markdown(s: dict, args) -> str:
  a = s["arms"]
  rows = [("rollout s / step", "time_rollout_s", "{:.1f}"),
          ("sampled tokens / task", "sampled_tokens_per_task", "{:.0f}"),
          ("trained tokens / task", "trained_tokens_per_task", "{:.0f}"),
          ("branches / task", "tree/branches_per_task", "{:.1f}"),
          ("episodes (leaves) / step", "episodes", "{:.0f}"),
          ("group pass@1 (sampled)", "pass_rate", "{:.3f}"),
          ("group pass@k (sampled)", "group_pass_rate", "{:.3f}"),
          ("held-out pass@1", "held_out_pass@1", "{:.3f}"),
          ("RL minutes", "rl_minutes", "{:.1f}")]
  table = ["| | " + " | ".join(a) + " |", "| --- |" + " --- |" * len(a)]
  for name, key, fmt in rows:
    cells = [fmt.format(a[arm][key]) if key in a[arm] else "–" for arm in a]
    table.append(f"| {name} | " + " | ".join(cells) + " |")
  diffs = "; ".join(f"{arm} - {s['baseline']}: {ci['diff']:+.3f}, paired bootstrap 95% interval "
                    f"{ci['low']:+.3f} .. {ci['high']:+.3f}" for arm, ci in
                    s["minus_baseline"].items())
  return (f"## Tree rollouts: independent episodes vs entropy-guided branching\n\n"
          f"{today()}, {machine()}; `python -m benchmarks.tree_rollouts` (demo SFT checkpoint, "
          f"{s['steps']} RL steps per arm, seeds {s['seeds']}, {s['eval_tasks']} held-out "
          f"tasks; independent: k={args.independent_k} episodes, GRPO + CISPO; branching: "
          f"k={args.branching_k} leaves, TreeRL + AEPO; branching_grpo: the same trees with "
          f"GRPO + CISPO).\n\n" + "\n".join(table) +
          f"\n\nHeld-out pass@1 per seed: {s['per_seed']}. {diffs}.\n")


if __name__ == "__main__":
  main()
