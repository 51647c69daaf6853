"""LoRA / QLoRA vs full fine-tuning on the demo's teacher SFT: held-out pass@1, trainable
parameters, adapter checkpoint sizes.

    python -m benchmarks.lora_sft --teacher=/tmp/arbor_sft_demo --workdir=/tmp/lora_sft \\
        --teacher_eval --update_docs

The data are benchmarks/teacher_sft.py's: the teacher (a demo SFT run's workdir) samples
`--attempts` episodes on each of `--tasks` generated training-split tasks, and the verified ones
(deduplicated, at most `--max_per_task` per task) are the SFT set. Every run starts from the
teacher's checkpoint on that set with the same steps and the same data order (the demo SFT's
packing and data seed, `--epochs` passes, cosine schedule); only the trained parameters and the
optimizer differ:

  - full: full fine-tuning, Muon at the demo SFT's peak lr (teacher_sft's student);
  - lora_r{R}_lr{LR}: LoRA adapters of rank R on the attention and MLP projections
    (alpha = 2 R), Muon, for every R in `--ranks` and LR in `--lrs`;
  - ..._adamw: the best Muon LoRA setting (held-out pass@1, then the lower last loss) with AdamW;
  - ..._int8: the same setting as QLoRA, the frozen base stored as int8;
  - ..._experts / ..._shared_experts: the same setting with adapters on the routed experts too,
    one pair per expert or one per layer shared by its experts (`--expert_adapters`).

Each is evaluated by the greedy held-out pass@1 on the demo's `--eval_tasks` held-out tasks
(`trainer.demo.held_out_eval`; a LoRA checkpoint is merged into a plain model first), with the
paired bootstrap 95% interval of run - full. Reported per run: trainable parameters, bytes of
its latest checkpoint directory, SFT minutes (the steps' time, compile included), loss first ->
last step. Finished stages in `--workdir` are reused. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import ml_collections

from benchmarks.common import machine, today, write_section
from benchmarks.teacher_sft import teacher_stage
from models import transformer
from trainer import config as config_lib
from trainer import demo as demo_lib
from trainer import evaluate, rejection, sft
from trainer import state as state_lib
from trainer.metrics import JSONL, read_jsonl


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--teacher", required=True,
                 help="the workdir of a demo SFT run (config.json, checkpoints/, tokenizer/)")
  p.add_argument("--workdir", required=True)
  p.add_argument("--tasks", type=int, default=150, help="training-split tasks sampled")
  p.add_argument("--attempts", type=int, default=4)
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--max_per_task", type=int, default=2)
  p.add_argument("--epochs", type=int, default=3)
  p.add_argument("--eval_tasks", type=int, default=200)
  p.add_argument("--ranks", default="8,32", help="LoRA ranks of the Muon sweep")
  p.add_argument("--lrs", default="3e-3,1e-2", help="peak learning rates of the Muon sweep")
  p.add_argument("--qlora_qtype", default="int8", help="base_qtype of the QLoRA run ('': none)")
  p.add_argument("--no_adamw", action="store_true", help="skip the AdamW LoRA run")
  p.add_argument("--expert_adapters", default="per_expert,shared",
                 help="config.model.lora.experts modes of the runs that add routed-expert "
                      "adapters to the best Muon setting ('': none)")
  p.add_argument("--teacher_eval", action="store_true",
                 help="also evaluate the teacher itself (the starting point)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--update_docs", action="store_true")
  args = p.parse_args()
  t0 = time.monotonic()
  sft_base, rl_cfg, data, stats = teacher_stage(args)
  _, _, chat, _ = rejection.load_checkpoint(args.teacher)
  steps = rejection.sft_steps(rejection.round_sft_config(sft_base, args.teacher, data, 1), data,
                             chat)
  ctx = dict(args=args, sft_base=sft_base, rl_cfg=rl_cfg, data=data, steps=steps)

  full = _run(ctx, _spec("full", 0, sft_base.optimizer.learning_rate, "muon"), None)
  ref = full["per_task"]
  runs = [full]
  sweep = [_run(ctx, _spec(f"lora_r{r}_lr{lr:g}", r, lr, "muon"), ref)
           for r in _ints(args.ranks) for lr in _floats(args.lrs)]
  runs += sweep
  out = {"teacher": args.teacher, "tasks": stats["tasks"], "attempts": stats["attempts"],
         "verified": stats["verified"], "kept": stats["kept"],
         "kept_tokens": stats["kept_tokens"], "sampling_minutes": stats["time_s"] / 60,
         "sft_steps": steps, "epochs": args.epochs, "eval_tasks": len(ref)}
  if sweep:
    best = max(sweep, key=lambda r: (r["pass@1"], -r["loss"][1]))
    out["best_muon_lora"] = best["name"]
    if not args.no_adamw:
      runs.append(_run(ctx, dict(best, name=best["name"] + "_adamw", optimizer="adamw"), ref))
    if args.qlora_qtype:
      runs.append(_run(ctx, dict(best, name=f"{best['name']}_{args.qlora_qtype}",
                                 base_qtype=args.qlora_qtype), ref))
    for mode in [m.strip() for m in args.expert_adapters.split(",") if m.strip()]:
      suffix = "experts" if mode == "per_expert" else f"{mode}_experts"
      runs.append(_run(ctx, dict(best, name=f"{best['name']}_{suffix}",
                                 modules="attention,mlp,experts", experts=mode), ref))
    for r in runs[1 + len(sweep):]:  # against the Muon LoRA run they repeat
      r["minus_best_muon"] = evaluate.paired_bootstrap(best["per_task"], r["per_task"])
  if args.teacher_eval:
    t = demo_lib.held_out_eval(rl_cfg, args.teacher,
                               os.path.join(args.workdir, "eval_teacher.json"), None)
    out["teacher_pass@1"] = t["pass@1"]
    out["teacher_terminations"] = t["terminations"]
    out["minus_teacher"] = {r["name"]: evaluate.paired_bootstrap(t["per_task"], r["per_task"])
                            for r in runs}
  for r in runs:
    r.pop("per_task")
  out["runs"] = runs
  out["wall_minutes"] = (time.monotonic() - t0) / 60  # this invocation (stages may be reused)
  print(json.dumps(out, indent=1), flush=True)
  with open(os.path.join(args.workdir, "result.json"), "w") as f:
    json.dump(out, f, indent=1)
  if args.update_docs:
    write_section("lora_sft", _markdown(out))


def _ints(s: str) -> list[int]:
  return [int(x) for x in s.split(",") if x.strip()]


def _floats(s: str) -> list[float]:
  return [float(x) for x in s.split(",") if x.strip()]


def _spec(name: str, rank: int, lr: float, optimizer: str, base_qtype: str | None = None) -> dict:
  """A run's settings: LoRA rank (0: full fine-tuning, alpha = 2 rank), peak lr, optimizer,
  adapted modules (`config.model.lora.modules`, `.experts`)."""
  return {"name": name, "rank": rank, "alpha": 2.0 * rank, "lr": lr, "optimizer": optimizer,
          "base_qtype": base_qtype, "modules": "attention,mlp", "experts": "per_expert"}


def run_config(sft_base: ml_collections.ConfigDict, teacher: str, data: str, steps: int,
               spec: dict) -> ml_collections.ConfigDict:
  """The SFT config of one run: the teacher's SFT round config with the run's settings.

  Args:
    sft_base: the demo SFT stage config (data.num_epochs set).
    teacher: the teacher run's workdir.
    data: the SFT file (the verified teacher episodes).
    steps: the steps of every run (same data, same order).
    spec: `_spec`'s dict.

  Returns:
    The config `trainer.sft.run` trains.
  """
  cfg = rejection.round_sft_config(sft_base, teacher, data, steps)
  cfg.optimizer.name = spec["optimizer"]
  cfg.optimizer.learning_rate = spec["lr"]
  cfg.model.lora.rank = spec["rank"]
  if spec["rank"]:
    cfg.model.lora.alpha = spec["alpha"]
    cfg.model.lora.modules = spec.get("modules", "attention,mlp")
    cfg.model.lora.experts = spec.get("experts", "per_expert")
    cfg.model.lora.base_qtype = spec["base_qtype"]
  return cfg


def trainable_params(cfg: ml_collections.ConfigDict) -> int:
  """Parameters the run's optimizer updates (the adapters of a LoRA run), from abstract shapes."""
  model_cfg = config_lib.model_config(cfg)
  params, _ = jax.eval_shape(lambda: state_lib.split_model(transformer.abstract(model_cfg)))
  return int(sum(x.size for x in jax.tree.leaves(params)))


def _latest_step(run_dir: str) -> int | None:
  """The step of a run's latest committed checkpoint; None: none yet."""
  root = os.path.join(run_dir, "checkpoints")
  if not os.path.isdir(root):
    return None
  steps = [int(d) for d in os.listdir(root)
           if d.isdigit() and os.path.isfile(os.path.join(root, d, "commit_success.txt"))]
  return max(steps, default=None)


def checkpoint_bytes(run_dir: str) -> tuple[int, int]:
  """(step, bytes on disk) of the latest checkpoints/N directory of a run."""
  root = os.path.join(run_dir, "checkpoints")
  step = max(int(d) for d in os.listdir(root) if d.isdigit())
  total = 0
  for dirpath, _, files in os.walk(os.path.join(root, str(step))):
    total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
  return step, total


def _run(ctx: dict, spec: dict, ref: list[float] | None) -> dict:
  """SFT (reused when finished) and held-out eval of one run; `ref`: full FT's per-task rewards."""
  args = ctx["args"]
  run_dir = os.path.join(args.workdir, spec["name"])
  cfg = run_config(ctx["sft_base"], args.teacher, ctx["data"], ctx["steps"], spec)
  print(f"--- {spec['name']}", flush=True)
  if _latest_step(run_dir) != ctx["steps"]:  # else finished earlier: reused as it is
    sft.run(cfg, run_dir)
  lines = read_jsonl(os.path.join(run_dir, "sft", JSONL))  # the run's own lines
  losses = [lines[k]["loss"] for k in sorted(lines) if "loss" in lines[k]]
  result = demo_lib.held_out_eval(ctx["rl_cfg"], run_dir,
                                  os.path.join(args.workdir, f"eval_{spec['name']}.json"), None)
  step, size = checkpoint_bytes(run_dir)
  row = dict(spec, trainable_params=trainable_params(cfg), checkpoint_step=step,
             checkpoint_bytes=size,
             sft_minutes=sum(x.get("time/step", 0.0) for x in lines.values()) / 60,
             loss=[losses[0], losses[-1]], **{"pass@1": result["pass@1"]},
             terminations=result["terminations"], eval_minutes=result["time_s"] / 60,
             per_task=result["per_task"])
  if ref is not None:
    row["minus_full"] = evaluate.paired_bootstrap(ref, result["per_task"])
  print(json.dumps({k: v for k, v in row.items() if k != "per_task"}), flush=True)
  return row


def _ci(c: dict) -> str:
  return f"{c['diff']:+.3f} ({c['low']:+.3f} .. {c['high']:+.3f})"


def _expert_label(r: dict) -> str:
  if "experts" not in r.get("modules", ""):
    return ""
  return " + routed experts" + (" (shared)" if r.get("experts") == "shared" else " (per expert)")


def _markdown(s: dict) -> str:
  full = s["runs"][0]
  rows = []
  for r in s["runs"]:
    kind = ("full fine-tuning" if not r["rank"] else
            f"{'QLoRA ' + r['base_qtype'] if r['base_qtype'] else 'LoRA'} r{r['rank']} "
            f"alpha {r['alpha']:g}" + _expert_label(r))
    rows.append(
        f"| {kind} | {r['optimizer']} | {r['lr']:g} | {r['trainable_params']:,} | "
        f"{r['checkpoint_bytes'] / 1e6:.2f} MB "
        f"({r['checkpoint_bytes'] / full['checkpoint_bytes']:.3f}) | {r['sft_minutes']:.1f} | "
        f"{r['loss'][0]:.3f} -> {r['loss'][1]:.3f} | {r['pass@1']:.3f} | "
        + (_ci(r["minus_full"]) if "minus_full" in r else "-") + " |")
  text = (
      "## LoRA vs full fine-tuning on the teacher's verified episodes\n\n"
      f"{today()}, {machine()}; `python -m benchmarks.lora_sft` (`config.model.lora`, "
      f"models/lora.py). Teacher: the demo's SFT checkpoint ({s['teacher']}). As in the "
      "teacher SFT above (its stages, run again here for this teacher), it drew "
      f"{s['attempts']} episodes at temperature 1 on "
      f"{s['tasks']} training-split tasks; {s['verified']} were verified and {s['kept']} kept "
      f"({s['kept_tokens']} sampled tokens). Every run SFTs the teacher on them with the same "
      f"{s['sft_steps']} steps ({s['epochs']} epochs, cosine) and the same data order; LoRA "
      "adapters sit on the attention and MLP projections (\"+ routed experts\": on the "
      "MoE layers' routed experts too), alpha = 2 rank. The LoRA sweep uses Muon; AdamW, QLoRA "
      "(the frozen base stored int8) and the routed-expert runs repeat the best Muon setting "
      f"(`{s.get('best_muon_lora', '-')}`), chosen by the held-out pass@1 itself, so that "
      "setting's gap is optimistic. Checkpoint: bytes of the latest checkpoints/N directory (a "
      "LoRA checkpoint holds the adapters, their optimizer state and the MoE router bias; in "
      "parentheses the ratio to full fine-tuning's). SFT minutes: the steps' time, compile "
      f"included, on a shared machine. Greedy held-out pass@1 on the same {s['eval_tasks']} "
      "tasks; the last column is run - full fine-tuning with its paired bootstrap 95% "
      "interval.\n\n"
      "| run | optimizer | peak lr | trainable params | checkpoint | SFT min | loss first -> "
      "last | pass@1 | minus full (95%) |\n"
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n" + "\n".join(rows) + "\n\n")
  notes = []
  if "teacher_pass@1" in s:
    notes.append(f"The teacher itself scores {s['teacher_pass@1']:.3f}; full fine-tuning "
                 f"minus the teacher {_ci(s['minus_teacher'][full['name']])}.")
  for r in s["runs"]:
    if "minus_best_muon" in r:
      if r["optimizer"] == "adamw":
        what = "AdamW minus Muon (same adapters, lr and data)"
      elif r["base_qtype"]:
        what = f"QLoRA {r['base_qtype']} minus the unquantized base (same adapters, lr and data)"
      else:
        kind = "shared" if r.get("experts") == "shared" else "per-expert"
        what = (f"Adding {kind} routed-expert adapters to the attention and MLP ones "
                f"({r['trainable_params']:,} trainable parameters in all; same lr and data)")
      notes.append(f"{what}: {_ci(r['minus_best_muon'])}"
                   + ("; one peak lr for both, AdamW's own best lr was not searched."
                      if r["optimizer"] == "adamw" else "."))
  notes.append("Checkpoint sizes follow the saved state: fp32 parameters plus one momentum "
               "(Muon) or two moments (AdamW) per trained parameter; a QLoRA checkpoint is "
               "the LoRA one, since the quantized base is rebuilt from the teacher.")
  sweep = [r for r in s["runs"] if r["rank"] and r["optimizer"] == "muon" and
           not r["base_qtype"] and not _expert_label(r)]
  if sweep:
    above = [r for r in sweep if r["minus_full"]["low"] > 0]
    below = [r for r in sweep if r["minus_full"]["high"] < 0]
    notes.append(
        f"{len(above)} of the {len(sweep)} Muon LoRA settings beat full fine-tuning with the "
        f"interval above zero, {len(below)} fall below it. Full fine-tuning updates "
        f"{full['trainable_params']:,} parameters with the same lr and steps and reaches the "
        f"lowest last-step loss ({full['loss'][1]:.4f}): on {s['kept']} episodes the "
        "low-rank update is the milder one at this lr. One data draw, one seed and one set "
        "of held-out tasks; the LoRA settings were not compared with each other by a "
        "bootstrap (only the runs that repeat the best setting, against it), and full "
        "fine-tuning's learning rate was not swept.")
  return text + " ".join(notes) + "\n"


if __name__ == "__main__":
  main()
