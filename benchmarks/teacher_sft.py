"""Teacher rollouts -> rejection sampling -> SFT on the demo: does training on a teacher's verified
episodes beat the teacher?

    python -m benchmarks.teacher_sft --teacher=/tmp/arbor_demo/seed_0/sft \\
        --workdir=/tmp/teacher_sft --tasks=150 --attempts=4 --control --rft_rounds=2 \\
        --update_docs

The teacher is a demo SFT checkpoint (configs/demo.py's SFT stage). It samples `--attempts`
episodes at `--temperature` on each of `--tasks` generated tasks of the demo's training split
(envs.taskgen "train", the RL stage's level and seed; never the held-out "eval" programs), with
the demo's RL episode limits, bwrap sandboxes and the tests verifier (`trainer.rejection`).
The verified episodes (reward 1), deduplicated and at most `--max_per_task` per task, become
trajectory records; the student is SFT from the teacher's checkpoint on them for `--epochs`
passes with the demo SFT hyper-parameters (configs/sft_demo.py: Muon, peak lr 3e-3, cosine;
warmup at most half the steps). Reported: attempts, verified share, kept before/after
deduplication, the greedy held-out pass@1 of teacher and student on the demo's `--eval_tasks`
held-out tasks, and the paired bootstrap 95% interval of student - teacher. `--control` adds a
student SFT (one epoch) on the same episodes unfiltered (every distinct one), which isolates
what the verifier's filter contributes; `--rft_rounds` runs that many RFT rounds
(`trainer.rejection.rft`) from the teacher on the next training tasks and evaluates each round's
checkpoint. Finished stages in `--workdir` are reused. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import ml_collections

from benchmarks.common import machine, today, write_section
from configs import demo
from envs import taskgen
from trainer import demo as demo_lib
from trainer import evaluate, rejection, rollouts, sft
from trainer.metrics import JSONL, read_jsonl


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--teacher", required=True, help="a demo seed's sft/ directory")
  p.add_argument("--workdir", required=True)
  p.add_argument("--tasks", type=int, default=150, help="training-split tasks sampled")
  p.add_argument("--attempts", type=int, default=4)
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--max_per_task", type=int, default=2)
  p.add_argument("--epochs", type=int, default=3)
  p.add_argument("--eval_tasks", type=int, default=200)
  p.add_argument("--lr", type=float, default=0.0,
                 help="peak learning rate of the student's SFT (0: the demo SFT's)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--control", action="store_true",
                 help="also SFT on every sampled episode, unfiltered (one epoch): what the "
                      "verifier's filter adds")
  p.add_argument("--rft_rounds", type=int, default=0,
                 help="also RFT rounds (trainer.rejection.rft) from the teacher on fresh tasks")
  p.add_argument("--update_docs", action="store_true")
  args = p.parse_args()
  t0 = time.monotonic()

  # --- teacher rollouts and rejection sampling
  sft_base, rl_cfg, data, stats = teacher_stage(args)

  # --- SFT of the teacher's checkpoint on its verified episodes
  student = os.path.join(args.workdir, "student")
  if args.lr:
    sft_base.optimizer.learning_rate = args.lr
  _, _, chat, _ = rejection.load_checkpoint(args.teacher)
  steps = rejection.sft_steps(rejection.round_sft_config(sft_base, args.teacher, data, 1), data,
                             chat)
  cfg = rejection.round_sft_config(sft_base, args.teacher, data, steps)
  sft.run(cfg, student)
  lines = read_jsonl(os.path.join(student, "sft", JSONL))  # the run's own lines (a reused run too)
  losses = [lines[k]["loss"] for k in sorted(lines) if "loss" in lines[k]]
  sft_minutes = sum(x.get("time/step", 0.0) for x in lines.values()) / 60

  # --- greedy held-out pass@1, teacher and student, on the same tasks
  teacher_eval = demo_lib.held_out_eval(rl_cfg, args.teacher,
                                        os.path.join(args.workdir, "eval_teacher.json"), None)
  student_eval = demo_lib.held_out_eval(rl_cfg, student,
                                        os.path.join(args.workdir, "eval_student.json"), None)
  ci = evaluate.paired_bootstrap(teacher_eval["per_task"], student_eval["per_task"])
  out = {"teacher": args.teacher, "tasks": stats["tasks"], "attempts": stats["attempts"],
         "attempts_per_task": args.attempts, "temperature": args.temperature,
         "errors": stats["errors"], "verified": stats["verified"],
         "verified_share": stats["verified_share"],
         "tasks_with_verified": stats["tasks_with_verified"],
         "kept_before_dedup": stats["kept_before_dedup"],
         "kept_after_dedup": stats["kept_after_dedup"], "kept": stats["kept"],
         "kept_tokens": stats["kept_tokens"], "sampling_minutes": stats["time_s"] / 60,
         "sft_steps": steps, "epochs": args.epochs, "lr": cfg.optimizer.learning_rate,
         "sft_minutes": sft_minutes,
         "sft_loss": [losses[0], losses[-1]],
         "eval_tasks": len(teacher_eval["per_task"]),
         "teacher_pass@1": teacher_eval["pass@1"], "student_pass@1": student_eval["pass@1"],
         "student_minus_teacher": ci, "student_terminations": student_eval["terminations"],
         "teacher_terminations": teacher_eval["terminations"],
         "eval_minutes": (teacher_eval["time_s"] + student_eval["time_s"]) / 60,
         "wall_minutes": (time.monotonic() - t0) / 60}  # this invocation (stages may be reused)
  if args.control:
    out["control"] = control(args, rl_cfg, sft_base, chat, teacher_eval)
  if args.rft_rounds:
    out["rft"] = rft_rounds(args, rl_cfg, sft_base, teacher_eval)
  print(json.dumps(out, indent=1), flush=True)
  with open(os.path.join(args.workdir, "result.json"), "w") as f:
    json.dump(out, f, indent=1)
  if args.update_docs:
    write_section("teacher_sft", _markdown(out))


def teacher_stage(args) -> tuple[ml_collections.ConfigDict, ml_collections.ConfigDict, str,
                                   dict]:
  """The demo's stages pointed at the teacher, and the teacher's verified episodes.

  Args:
    args: the command line (--teacher, --workdir, --seed, --eval_tasks, --epochs, the sampling
      flags of `teacher_episodes`).

  Returns:
    (sft_base, rl_cfg, data, stats): the demo's SFT stage config (`--epochs` over the data),
    its RL stage config starting from the teacher (weights, tokenizer; `--eval_tasks` held-out
    tasks), the JSONL of the kept episodes and their stats.
  """
  os.makedirs(args.workdir, exist_ok=True)
  # The seed dir only names the RL stage's default init / tokenizer, both set here.
  sft_base, rl_cfg = demo_lib.stage_configs(demo.get_config(), args.seed,
                                            os.path.dirname(args.teacher))
  rl_cfg.model.init = f"ckpt:{args.teacher}"
  rl_cfg.tokenizer.path = os.path.join(args.teacher, "tokenizer")
  rl_cfg.eval.num_tasks = args.eval_tasks
  sft_base.data.num_epochs = args.epochs
  data = os.path.join(args.workdir, "teacher.jsonl")
  stats = teacher_episodes(args, rl_cfg, data,
                           rejection.FilterConfig(max_per_task=args.max_per_task))
  print(rejection.summary_line(stats), flush=True)
  return sft_base, rl_cfg, data, stats


def teacher_episodes(args, rl_cfg, data: str, filter_cfg: rejection.FilterConfig) -> dict:
  """The teacher's episodes on the training-split tasks, filtered into `data`; their stats.

  A finished earlier invocation's file (its .stats.json beside it) is reused.
  """
  if os.path.isfile(data + ".stats.json"):
    with open(data + ".stats.json") as f:
      return json.load(f)
  tasks = taskgen.write_tasks(os.path.join(args.workdir, "tasks"), args.tasks,
                              rl_cfg.rl.task_level, rl_cfg.rl.task_seed, split="train")
  return rejection.run_checkpoint(
      args.teacher, tasks, scaffold=rollouts.scaffold_config(rl_cfg, args.temperature),
      attempts=args.attempts, seed=args.seed, filter_cfg=filter_cfg, out=data,
      concurrency=rl_cfg.rl.concurrency)


def control(args, rl_cfg, sft_base, chat, teacher_eval) -> dict:
  """The same teacher episodes (the same seeds), unfiltered: every distinct attempt, one epoch."""
  data = os.path.join(args.workdir, "unfiltered.jsonl")
  stats = teacher_episodes(args, rl_cfg, data,
                           rejection.FilterConfig(threshold=0.0, max_per_task=args.attempts))
  cfg = ml_collections.ConfigDict(sft_base.to_dict())
  cfg.data.num_epochs = 1
  steps = rejection.sft_steps(rejection.round_sft_config(cfg, args.teacher, data, 1), data, chat)
  run_dir = os.path.join(args.workdir, "student_unfiltered")
  sft.run(rejection.round_sft_config(cfg, args.teacher, data, steps), run_dir)
  result = demo_lib.held_out_eval(rl_cfg, run_dir,
                                  os.path.join(args.workdir, "eval_unfiltered.json"), None)
  with open(data) as f:
    passing = sum(json.loads(line)["reward"] >= 1.0 for line in f)
  return {"records": stats["kept"], "verified": passing, "sft_steps": steps,
          "pass@1": result["pass@1"], "terminations": result["terminations"],
          "minus_teacher": evaluate.paired_bootstrap(teacher_eval["per_task"],
                                                     result["per_task"])}


def rft_rounds(args, rl_cfg, sft_base, teacher_eval) -> list[dict]:
  """RFT from the teacher: each round samples `--tasks` fresh training tasks (after the ones
  above) with the latest checkpoint, keeps the verified episodes and SFTs on them (`--epochs`
  passes); the held-out pass@1 of every round's checkpoint."""
  info = rejection.rft(
      sft_base, os.path.join(args.workdir, "rft"), init_dir=args.teacher,
      rounds=args.rft_rounds, tasks_per_round=args.tasks, attempts=args.attempts,
      scaffold=rollouts.scaffold_config(rl_cfg, args.temperature),
      filter_cfg=rejection.FilterConfig(max_per_task=args.max_per_task),
      task_level=rl_cfg.rl.task_level, task_seed=rl_cfg.rl.task_seed, task_start=args.tasks,
      seed=args.seed, concurrency=rl_cfg.rl.concurrency)
  out = []
  for r in info:
    row = {k: r[k] for k in ("round", "teacher_step", "verified_share", "kept", "steps")}
    if r["sft_dir"]:
      result = demo_lib.held_out_eval(rl_cfg, r["sft_dir"], os.path.join(
          args.workdir, f"eval_rft_{r['round']}.json"), None)
      row["pass@1"] = result["pass@1"]
      row["minus_teacher"] = evaluate.paired_bootstrap(teacher_eval["per_task"],
                                                       result["per_task"])
    out.append(row)
  return out


def _markdown(s: dict) -> str:
  ci = s["student_minus_teacher"]
  loss = s["sft_loss"]
  return (
      "## Teacher rollouts and rejection sampling\n\n"
      f"{today()}, {machine()}; `python -m benchmarks.teacher_sft` (`trainer.rejection`). "
      f"Teacher: the demo's SFT checkpoint (seed 0). It ran {s['attempts_per_task']} episodes "
      f"at temperature {s['temperature']:g} on each of {s['tasks']} tasks of the demo's "
      "generated training split (bwrap sandboxes, the tests verifier); the verified ones "
      "(reward 1), deduplicated and at most 2 per task (shortest first), were the SFT data of "
      f"a student started from the teacher's checkpoint ({s['epochs']} epochs, "
      f"{s['sft_steps']} steps, the demo's SFT hyper-parameters, peak lr {s['lr']:g}).\n\n"
      "| | |\n| --- | --- |\n"
      f"| episodes (errors) | {s['attempts']} ({s['errors']}) |\n"
      f"| verified share | {s['verified_share']:.3f} ({s['verified']} episodes, "
      f"{s['tasks_with_verified']} tasks with one) |\n"
      f"| kept before / after dedup / after the per-task cap | {s['kept_before_dedup']} / "
      f"{s['kept_after_dedup']} / {s['kept']} |\n"
      f"| kept sampled tokens | {s['kept_tokens']} |\n"
      f"| SFT loss first -> last step | {loss[0]:.3f} -> {loss[1]:.3f} |\n"
      f"| greedy held-out pass@1, teacher | {s['teacher_pass@1']:.3f} |\n"
      f"| greedy held-out pass@1, student | {s['student_pass@1']:.3f} |\n"
      f"| minutes: sampling / SFT steps / both evals | {s['sampling_minutes']:.1f} / "
      f"{s['sft_minutes']:.1f} / {s['eval_minutes']:.1f} |\n\n"
      f"Student - teacher on the same {s['eval_tasks']} held-out tasks: {ci['diff']:+.3f}, "
      f"paired bootstrap 95% interval {ci['low']:+.3f} .. {ci['high']:+.3f}. Terminations "
      f"(held-out): teacher {s['teacher_terminations']}, student "
      f"{s['student_terminations']}.\n" + _control_markdown(s) + _rft_markdown(s))


def _rft_markdown(s: dict) -> str:
  if "rft" not in s:
    return ""
  lines = []
  for r in s["rft"]:
    ci = r.get("minus_teacher")
    lines.append(f"Round {r['round']}: sampled by the checkpoint of step {r['teacher_step']}, "
                 f"verified share {r['verified_share']:.3f}, {r['kept']} kept, {r['steps']} SFT "
                 "steps" + (f", held-out pass@1 {r['pass@1']:.3f} (minus the teacher "
                            f"{ci['diff']:+.3f}, 95% interval {ci['low']:+.3f} .. "
                            f"{ci['high']:+.3f})" if ci else ""))
  return ("\nRFT (`--rft_rounds`, `trainer.rejection.rft`): each round samples the next "
          f"{s['tasks']} training tasks x {s['attempts_per_task']} with the latest checkpoint "
          "and SFTs on its verified episodes as above. " + "; ".join(lines) + ".\n")


def _control_markdown(s: dict) -> str:
  if "control" not in s:
    return ""
  c = s["control"]
  ci = c["minus_teacher"]
  return (f"\nControl (`--control`): the same episodes unfiltered, every distinct one "
          f"({c['records']} records, {c['verified']} of them verified), one epoch "
          f"({c['sft_steps']} steps): held-out pass@1 {c['pass@1']:.3f}, minus the teacher "
          f"{ci['diff']:+.3f} (95% interval {ci['low']:+.3f} .. {ci['high']:+.3f}); "
          f"terminations {c['terminations']}. The filter is what helps: trained on its own "
          f"samples, {c['records'] - c['verified']} of which fail the tests, the teacher does "
          "not improve.\n")


if __name__ == "__main__":
  main()
