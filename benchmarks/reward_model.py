"""A reward model trained on the demo's verified episodes: held-out pairwise and ORM accuracy.

    python -m benchmarks.reward_model [--workdir /tmp/arbor_rm_bench] [--steps 200]
        [--tasks 160] [--eval_tasks 80] [--environment bookworm-pytest]

Runs mode "reward_model" with configs/reward_model.py (tokenizer, scripted episodes with and
without the fix graded by the tasks' tests in bwrap sandboxes, training, held-out evaluation)
and prints one JSON object: the held-out metrics at each evaluation, data counts, minutes per
phase, the machine and the date. A rerun with the same --workdir reuses the recorded episodes
and resumes the training.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

from configs import reward_model as rm_config
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


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workdir", default="/tmp/arbor_rm_bench")
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--tasks", type=int, default=160, help="training tasks (2 episodes each)")
  p.add_argument("--eval_tasks", type=int, default=80, help="held-out tasks (2 episodes each)")
  p.add_argument("--environment", default="bookworm-pytest",
                 help="the sandboxes' environment ('' = the host's root filesystem)")
  p.add_argument("--preset", default="", help="model preset (default: the config's)")
  args = p.parse_args()
  c = rm_config.get_config()
  c.train.steps = args.steps
  c.train.eval_every = min(c.train.eval_every, args.steps)
  c.train.checkpoint_every = min(c.train.checkpoint_every, args.steps)
  c.reward_model.demo_tasks, c.reward_model.demo_eval_tasks = args.tasks, args.eval_tasks
  c.data.demo.environment = args.environment
  if args.preset:
    c.model.preset = args.preset
  config_lib.validate(c, args.workdir)
  t0 = time.perf_counter()
  summary = reward_model.run(c, args.workdir)
  lines = read_jsonl(os.path.join(args.workdir, "reward_model", "metrics.jsonl"))
  curve = {step: {k[5:]: v for k, v in line.items() if k.startswith("eval/")}
           for step, line in sorted(lines.items()) if "eval/pairwise_accuracy" in line}
  print(json.dumps({
      "benchmark": "reward_model", "date": datetime.date.today().isoformat(),
      "machine": f"{os.cpu_count()} CPU cores, {_cpu()}", "model": c.model.preset,
      "steps": summary["steps"], "batch_pairs": c.reward_model.batch_pairs,
      "losses": {"pairwise": c.reward_model.pairwise_coef, "orm": c.reward_model.orm_coef,
                 "prm": c.reward_model.prm_coef},
      "train_episodes": summary["train_episodes"], "train_pairs": summary["train_pairs"],
      "train_pass_rate": summary["train_pass_rate"], "held_out": summary["eval"],
      "held_out_by_step": curve, "minutes": (time.perf_counter() - t0) / 60}, indent=1))


if __name__ == "__main__":
  main()
