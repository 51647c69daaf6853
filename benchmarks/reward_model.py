"""A reward model trained on the demo's verified episodes: held-out pairwise and ORM accuracy.

    python -m benchmarks.reward_model [--workdir /tmp/arbor_rm_bench] [--steps 200]
        [--tasks 160] [--eval_tasks 80] [--environment bookworm-pytest]
    python -m benchmarks.reward_model --episodes=policy --ckpt=/tmp/arbor_demo/seed_0/sft \
        --attempts=4 --tasks 80 --eval_tasks 40 [--temperature 0.7] [--init ckpt|random]

--episodes=scripted (the default): mode "reward_model" with configs/reward_model.py (tokenizer,
scripted episodes with and without the fix graded by the tasks' tests in bwrap sandboxes,
training, held-out evaluation). An unfixed scripted episode has no edit at all: an easy test.

--episodes=policy: the episodes are the policy's own. `--attempts` episodes per task are
sampled from the SFT checkpoint `--ckpt` (trainer.rejection.sample: the react scaffold in bwrap
sandboxes, the demo RL stage's limits, `--temperature`) on `--tasks` generated training tasks
(taskgen seed `--task_seed`, "train" split) and `--eval_tasks` held-out ones (same seed, "eval"
split: programs no training task shares); every attempt is graded by the task's tests and all
of them (passed and failed) are written to <workdir>/data/{train,eval}.jsonl. Only tasks with
both a passed and a failed attempt give pairs: the pairs then differ in what the policy did,
not in whether an edit exists - the harder test. The reward model reads the policy's tokenizer,
with the SFT architecture initialised from the checkpoint (`--init ckpt`) or at random
(`--init random`), in <workdir>/rm_<init>/.

Prints one JSON object: the held-out metrics at each evaluation (policy episodes: bootstrap
95% intervals over held-out tasks of the pairwise accuracy on all pairs and on the hard ones,
whose failed episode has as many agent turns as the passed one, and of two baselines that read
no tokens: more turns wins, longer wins), data counts, minutes,
the machine and the date. A rerun with the same --workdir reuses the recorded episodes and
resumes the training.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import platform
import sys
import time

import numpy as np

from configs import demo as demo_config
from configs import reward_model as rm_config
from envs.trajectory import Trajectory
from trainer import config as config_lib
from trainer import reward_model
from trainer.metrics import read_jsonl


def _cpu() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def sample_policy(args, data_dir: str) -> dict:
  """All `args.attempts` episodes per task of the policy `args.ckpt`, graded by the tests.

  Writes <data_dir>/{train,eval}.jsonl (every attempt that sampled a token, passed or failed;
  `Trajectory.to_dict` rows) and <data_dir>/sampling.json (counts, minutes); a rerun reuses them.

  Returns:
    The sampling record: per split tasks, episodes, errors, pass rate, tasks with both a passed
    and a failed attempt, pairs, minutes.
  """
  record = os.path.join(data_dir, "sampling.json")
  if os.path.isfile(record):
    with open(record) as f:
      return json.load(f)
  from envs import task_environments, taskgen  # pylint: disable=g-import-not-at-top
  from envs.scaffold import ScaffoldConfig  # pylint: disable=g-import-not-at-top
  from trainer import rejection  # pylint: disable=g-import-not-at-top
  os.makedirs(data_dir, exist_ok=True)
  demo_rl = demo_config.get_config().rl.rl  # the demo RL stage's episode limits
  scaffold = ScaffoldConfig(max_turns=demo_rl.max_turns, max_new_tokens=demo_rl.max_new_tokens,
                            max_context_tokens=demo_rl.max_context_tokens,
                            timeout_s=300.0, temperature=args.temperature)
  model, _, chat, _ = rejection.load_checkpoint(args.ckpt)
  policy = rejection.engine_teacher(model, chat, concurrency=args.concurrency,
                                    max_context_tokens=scaffold.max_context_tokens,
                                    seed=args.seed)
  env = task_environments.default_environment(args.environment, "environment")
  info = {"ckpt": args.ckpt, "temperature": args.temperature, "attempts": args.attempts,
          "task_seed": args.task_seed}
  try:
    for split, n in (("train", args.tasks), ("eval", args.eval_tasks)):
      t0 = time.perf_counter()
      tasks = task_environments.with_environments(
          taskgen.write_tasks(os.path.join(data_dir, f"tasks_{split}"), n, 0, args.task_seed,
                              0, split=split), default=env)
      task_environments.build_all(tasks[:1], "bwrap")
      results = rejection.sample(policy, chat, tasks, scaffold=scaffold,
                                 attempts=args.attempts, seed=args.seed, sandbox="bwrap",
                                 concurrency=args.concurrency)
      kept, errors, mixed, pairs = [], 0, 0, 0
      for attempts in results:
        ok = [t for t in attempts if not isinstance(t, Exception)
              and any(len(c.output_ids) for c in t.calls)]
        errors += len(attempts) - len(ok)
        passed = sum(t.reward >= reward_model.PASS for t in ok)
        mixed += bool(passed and passed < len(ok))
        pairs += passed * (len(ok) - passed)
        kept += ok
      with open(os.path.join(data_dir, f"{split}.jsonl"), "w") as f:
        for t in kept:
          meta = {k: t.metadata.get(k) for k in ("attempt", "seed", "scaffold")}
          f.write(json.dumps(dataclasses.replace(t, metadata=meta).to_dict()) + "\n")
      info[split] = {"tasks": n, "episodes": len(kept), "errors": errors,
                     "pass_rate": float(np.mean([t.reward >= reward_model.PASS for t in kept]))
                     if kept else float("nan"),
                     "tasks_with_pairs": mixed, "pairs": pairs,
                     "minutes": (time.perf_counter() - t0) / 60}
      print(f"sampled {split}: {json.dumps(info[split])}", file=sys.stderr, flush=True)
  finally:
    policy.engine.stop()
  with open(record, "w") as f:
    json.dump(info, f, indent=1)
  return info


def _bootstrap(per_task: list[list[float]], draws: int, seed: int) -> dict:
  """Mean of the pooled pair outcomes and its bootstrap 95% interval over tasks."""
  if not per_task:
    return {"accuracy": float("nan"), "interval": [float("nan")] * 2, "tasks": 0, "pairs": 0}
  rng = np.random.default_rng(seed)
  stats = [np.mean([x for i in rng.integers(0, len(per_task), len(per_task))
                    for x in per_task[i]]) for _ in range(draws)]
  return {"accuracy": float(np.mean([x for t in per_task for x in t])),
          "interval": [float(np.percentile(stats, 2.5)), float(np.percentile(stats, 97.5))],
          "tasks": len(per_task), "pairs": sum(len(t) for t in per_task)}


def held_out_pairs(rm_dir: str, eval_path: str, draws: int = 2000, seed: int = 0) -> dict:
  """Held-out pairwise accuracy of the reward model in `rm_dir` with bootstrap 95% intervals
  over held-out tasks (tasks resampled with replacement, their pairs pooled): on all pairs, on
  the hard pairs (the failed episode has at least as many agent turns as the passed one: it
  did not just skip the edit), and two baselines that read no tokens (the episode with more
  turns wins; the longer one wins; ties 1/2)."""
  from trainer import reward_scoring  # pylint: disable=g-import-not-at-top
  scorer = reward_scoring.Scorer(rm_dir)
  with open(eval_path) as f:
    trajectories = [Trajectory.from_dict(json.loads(line)) for line in f if line.strip()]
  episodes = [reward_model.episode(t, scorer.max_len) for t in trajectories]
  finals, _ = reward_model.score_episodes(scorer.rm, scorer.state, episodes, scorer.batch_rows)
  turns = [len(t.calls) for t in trajectories]
  length = [len(t.calls[-1].input_ids) + len(t.calls[-1].output_ids) for t in trajectories]
  win = lambda a, b: float((a > b) + 0.5 * (a == b))
  out: dict[str, dict[str, list[float]]] = {"all": {}, "hard": {}, "more_turns": {},
                                            "longer": {}}
  for c, r in reward_model.make_pairs(episodes):
    task = episodes[c].task_id
    out["all"].setdefault(task, []).append(win(finals[c], finals[r]))
    if turns[r] >= turns[c]:
      out["hard"].setdefault(task, []).append(win(finals[c], finals[r]))
    out["more_turns"].setdefault(task, []).append(win(turns[c], turns[r]))
    out["longer"].setdefault(task, []).append(win(length[c], length[r]))
  return {k: _bootstrap(list(v.values()), draws, seed) for k, v in out.items()}


def policy_config(args, data_dir: str, init: str):
  """configs/reward_model.py on the sampled episodes, the policy's tokenizer and architecture."""
  c = rm_config.get_config()
  r = c.reward_model
  r.episodes, r.eval_episodes = (os.path.join(data_dir, f"{s}.jsonl") for s in ("train", "eval"))
  r.demo_tasks = r.demo_eval_tasks = 0
  r.max_len = args.max_len
  c.tokenizer.path, c.tokenizer.train_vocab_size = os.path.join(args.ckpt, "tokenizer"), 0
  with open(os.path.join(args.ckpt, "config.json")) as f:
    sft = json.load(f)
  c.tokenizer.chat_format = sft["tokenizer"]["chat_format"]
  c.model.overrides.vocab_size = sft["model"]["overrides"]["vocab_size"]
  if init == "ckpt":
    c.model.init, c.model.preset = f"ckpt:{args.ckpt}", ""
  else:
    c.model.init, c.model.preset = "random", sft["model"]["preset"]
  r.learning_rate = args.lr if args.lr else (1e-4 if init == "ckpt" else 1e-3)
  return c


def train_and_report(c, workdir: str) -> dict:
  """Trains (or resumes) mode "reward_model" in `workdir`; the held-out metrics by step."""
  t0 = time.perf_counter()
  summary = reward_model.run(c, workdir)
  lines = read_jsonl(os.path.join(workdir, "reward_model", "metrics.jsonl"))
  curve = {step: {k[5:]: v for k, v in line.items() if k.startswith("eval/")}
           for step, line in sorted(lines.items()) if "eval/pairwise_accuracy" in line}
  return {"model": c.model.preset or c.model.init, "learning_rate": c.reward_model.learning_rate,
          "steps": summary["steps"], "batch_pairs": c.reward_model.batch_pairs,
          "losses": {"pairwise": c.reward_model.pairwise_coef, "orm": c.reward_model.orm_coef,
                     "prm": c.reward_model.prm_coef},
          "train_episodes": summary["train_episodes"], "train_pairs": summary["train_pairs"],
          "train_pass_rate": summary["train_pass_rate"], "held_out": summary["eval"],
          "held_out_by_step": curve, "minutes": (time.perf_counter() - t0) / 60}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workdir", default="/tmp/arbor_rm_bench")
  p.add_argument("--episodes", default="scripted", choices=("scripted", "policy"),
                 help="scripted: the demo solver with / without the fix; policy: --ckpt's own "
                 "sampled attempts")
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--tasks", type=int, default=160, help="training tasks (scripted: 2 episodes "
                 "each; policy: --attempts each)")
  p.add_argument("--eval_tasks", type=int, default=80, help="held-out tasks")
  p.add_argument("--environment", default="bookworm-pytest",
                 help="the sandboxes' environment ('' = the host's root filesystem)")
  p.add_argument("--preset", default="", help="model preset (scripted; default: the config's)")
  p.add_argument("--ckpt", default="", help="policy: the SFT run directory that samples (its "
                 "tokenizer/ and architecture are the reward model's)")
  p.add_argument("--attempts", type=int, default=4, help="policy: episodes per task")
  p.add_argument("--temperature", type=float, default=0.7, help="policy: sampling temperature "
                 "(the demo RL stage's; at 1.0 only 2-6%% of its samples pass)")
  p.add_argument("--task_seed", type=int, default=1, help="policy: taskgen seed (the demo's "
                 "RL tasks: 1; held-out tasks are its 'eval' split)")
  p.add_argument("--seed", type=int, default=0, help="policy: sampling seed")
  p.add_argument("--concurrency", type=int, default=16, help="policy: episodes at once")
  p.add_argument("--init", default="ckpt", help="policy: 'ckpt', 'random' or 'ckpt,random' "
                 "(one reward model each)")
  p.add_argument("--lr", type=float, default=0.0,
                 help="policy: learning rate (0: 1e-4 from the checkpoint, 1e-3 at random)")
  p.add_argument("--max_len", type=int, default=2048, help="policy: tokens per episode at most")
  args = p.parse_args()
  logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
  logging.getLogger("trainer.rejection").setLevel(logging.INFO)  # sampling progress
  started = time.perf_counter()
  out = {"benchmark": "reward_model", "episodes": args.episodes,
         "date": datetime.date.today().isoformat(),
         "machine": f"{os.cpu_count()} CPU cores, {_cpu()}"}
  if args.episodes == "policy":
    if not args.ckpt:
      p.error("--episodes=policy needs --ckpt (an SFT run directory)")
    data_dir = os.path.join(args.workdir, "data")
    out["sampling"] = sample_policy(args, data_dir)
    for init in args.init.split(","):
      c = policy_config(args, data_dir, init)
      c.train.steps = args.steps
      c.train.eval_every = min(c.train.eval_every, args.steps)
      c.train.checkpoint_every = min(c.train.checkpoint_every, args.steps)
      rm_dir = os.path.join(args.workdir, f"rm_{init}")
      config_lib.validate(c, rm_dir)
      out[f"init_{init}"] = result = train_and_report(c, rm_dir)
      result["held_out_pairs"] = held_out_pairs(rm_dir, c.reward_model.eval_episodes)
      print(json.dumps({init: result["held_out"], **result["held_out_pairs"]}),
            file=sys.stderr, flush=True)
    out["minutes"] = (time.perf_counter() - started) / 60
    print(json.dumps(out, indent=1))
    return
  c = rm_config.get_config()
  c.train.steps = args.steps
  c.train.eval_every = min(c.train.eval_every, args.steps)
  c.train.checkpoint_every = min(c.train.checkpoint_every, args.steps)
  c.reward_model.demo_tasks, c.reward_model.demo_eval_tasks = args.tasks, args.eval_tasks
  c.data.demo.environment = args.environment
  if args.preset:
    c.model.preset = args.preset
  config_lib.validate(c, args.workdir)
  result = train_and_report(c, args.workdir)
  result["model"] = c.model.preset
  print(json.dumps({**out, **result}, indent=1))


if __name__ == "__main__":
  main()
