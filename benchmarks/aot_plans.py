"""The training plans of docs/scaling.md compiled for their TPU slices (trainer/aot.py).

    python -m benchmarks.aot_plans                       # every plan, JSON per plan on stdout
    python -m benchmarks.aot_plans --plans=qwen7b-v5p-full --out_dir=docs/aot --update_docs
    python -m benchmarks.aot_plans --plans=dsv3-v5p-ep-a2a --search   # alternatives if no fit

Each plan is the RL template (configs/rl.py) for a model preset, with the mesh, remat policy and
batch shape the sizing arithmetic (benchmarks/sizing.py) chose (or, for the MoE plans, an
expert-parallel mesh): rows of 32,768 tokens, one row per batch shard in a micro-batch, bf16
compute, Muon, the Pallas TPU tree kernel. The train step, the scoring pass and the engine's
decode step (its `rl.concurrency` slots of `rl.max_context_tokens`) are compiled by the real
XLA TPU compiler on this machine (no TPU) and set beside the arithmetic's per-chip memory and
roofline step. `--update_docs` rewrites the "compiled" block of docs/scaling.md (between
`<!-- aot:start -->` and `<!-- aot:end -->`) from every plan with a JSON in --out_dir.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

from benchmarks import common, sizing
from configs import rl as rl_config
from models.presets import get_preset
from trainer import aot

PROGRAMS = ("train", "score", "decode")  # prefill: `--programs` (the unrolled engine model)

# the residual stream (and the layer inputs full remat saves) split over `tensor`
SPLIT_RESIDUAL = {"sharding_rules": {"act_embed": "tensor"}}
# name -> (preset, family, topology, sizing slice, mesh, remat, micro-batches, model overrides)
PLANS = {
    "qwen7b-v5p-save_dots": ("qwen2.5-coder-7b", "qwen2.5-coder", "v5p:4x4x2", "v5p-64",
                             {"fsdp": 16, "tensor": 2}, "save_dots", 16, {}),
    "qwen7b-v5p-full": ("qwen2.5-coder-7b", "qwen2.5-coder", "v5p:4x4x2", "v5p-64",
                        {"fsdp": 16, "tensor": 2}, "full", 16, {}),
    "qwen7b-v6e-full": ("qwen2.5-coder-7b", "qwen2.5-coder", "v6e:8x8", "v6e-64",
                        {"fsdp": 64, "tensor": 1}, "full", 4, {}),
    "qwen32b-v5p-full": ("qwen2.5-coder-32b", "qwen2.5-coder", "v5p:4x4x4", "v5p-128",
                         {"fsdp": 64, "tensor": 1}, "full", 4, {}),
    "qwen32b-v6e-full": ("qwen2.5-coder-32b", "qwen2.5-coder", "v6e:16x16", "v6e-256",
                         {"fsdp": 64, "tensor": 4}, "full", 4, SPLIT_RESIDUAL),
    "qwen3-30b-a3b-v5p-ep": ("qwen3-30b-a3b", "qwen3", "v5p:4x4x2", "v5p-64",
                             {"fsdp": 4, "tensor": 1, "expert": 8}, "full", 8,
                             {"moe_dispatch": "all_to_all"}),
    "dsv3-v5p-ep-a2a": ("deepseek-v3", "deepseek-v3", "v5p:8x8x8", "v5p-1024",
                        {"fsdp": 8, "tensor": 8, "expert": 8}, "full", 4,
                        {"moe_dispatch": "all_to_all", "moe_dispatch_chunk": 1024,
                         **SPLIT_RESIDUAL}),
    "dsv3-v5p-ep-global": ("deepseek-v3", "deepseek-v3", "v5p:8x8x8", "v5p-1024",
                           {"fsdp": 8, "tensor": 8, "expert": 8}, "full", 4,
                           {"moe_dispatch": "global", **SPLIT_RESIDUAL}),
    "kimi-k2-v5p-ep-a2a": ("kimi-k2", "deepseek-v3", "v5p:8x16x16", "v5p-4096",
                           {"fsdp": 16, "tensor": 8, "expert": 16}, "full", 1,
                           {"moe_dispatch": "all_to_all", "moe_dispatch_chunk": 1024,
                         **SPLIT_RESIDUAL}),
}
ROW_LEN, SEQ_LEN = 32768, 8192  # docs/scaling.md: one trajectory's trie fills a row


def plan_config(name: str):
  """The RL config of plan `name` (no files needed: model.init stays random)."""
  preset, family, _, _, mesh, remat, micro_batches, overrides = PLANS[name]
  c = rl_config.get_config(family)
  c.model.preset, c.model.init = preset, "random"
  c.optimizer.name = "muon"  # as the sizing arithmetic assumes
  c.model.overrides.remat = remat
  c.model.overrides.attention_impl = "pallas_tpu"
  c.model.overrides.update(overrides)
  c.mesh.data, c.mesh.expert = 1, mesh.get("expert", 1)
  c.mesh.fsdp, c.mesh.tensor = mesh["fsdp"], mesh["tensor"]
  c.data.row_len, c.data.seq_len = ROW_LEN, SEQ_LEN
  batch_shards = mesh["fsdp"] * mesh.get("expert", 1)
  c.data.rows_per_batch = c.data.max_seqs = batch_shards  # one row per batch shard
  c.data.microbatches = micro_batches
  return c


def estimate(name: str) -> dict:
  """The sizing arithmetic's figures for the plan: per-chip GB (`sizing.memory_per_chip`) and
  the roofline step (`sizing.step_time`: seconds, and its ICI part over the step)."""
  preset, _, _, slice_, mesh, remat, _, _ = PLANS[name]
  cfg, m = get_preset(preset), sizing.Mesh(mesh["fsdp"], mesh["tensor"], mesh.get("expert", 1))
  memory = sizing.memory_per_chip(cfg, m, remat, "muon")
  chip, _ = sizing.slice_chips(slice_)
  step = sizing.step_time(cfg, chip, m, remat, "muon")
  return {"gb": round(sum(memory.values()), 1), "step_s": round(step["roofline"], 2),
          "ici_s": round(step["ici"] * step["micro_batches"], 2)}


def run(name: str, programs=PROGRAMS, search: bool = False) -> dict:
  """Compiles plan `name`; the aot report plus the plan, the estimate and, with `search`, the
  settings tried when the train step does not fit (`aot.search`)."""
  t0 = time.perf_counter()
  config = plan_config(name)
  report = aot.compile_run(config, PLANS[name][2], programs)
  report["plan"] = name
  report["estimate"] = estimate(name)
  if search:
    report["search"] = aot.search(config, PLANS[name][2], report)
  report["wall_s"] = round(time.perf_counter() - t0, 1)
  return report


def _step_s(r: dict) -> float | None:
  """The compiled roofline of one step: the accumulation plus the update."""
  p = r["programs"]
  if any("error" in p.get(name, {"error": 1}) for name in ("train/gradients", "train/update")):
    return None
  return p["train/gradients"]["roofline_s"]["step"] + p["train/update"]["roofline_s"]["step"]


def markdown(reports: list[dict]) -> str:
  """The docs table: compiled vs estimated HBM per chip and step time of each plan."""
  lines = [f"Compiled {common.today()} on {common.machine()} with libtpu (no TPU); "
           "`python -m benchmarks.aot_plans --update_docs`. **Compiled** columns come from the "
           "XLA TPU compiler (memory_analysis, the optimized HLO's collectives with loop trip "
           "counts); **estimate** columns from the arithmetic above.", "",
           "| plan | slice (chips) | mesh | remat | train peak GB / chip (compiled) | estimate | "
           "headroom GB | score GB | decode GB (bytes / min) | ICI s / step (compiled) | "
           "estimate | step s (compiled roofline) | estimate | compile s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in reports:
    p, est = r["programs"], r["estimate"]
    mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items() if v > 1)
    peak = r.get("train_peak_gb", {})
    g, u = p.get("train/gradients", {}), p.get("train/update", {})
    refused = "error" in g or "error" in u
    if refused:
      train = f"> {peak['total']:.1f} (refused)"
    else:
      train = f"{peak['total']:.1f}" if peak else "-"
    headroom = f"{peak['headroom']:.1f}" if peak and not refused else "-"
    ici = ("-" if refused or not g or not u else
           f"{g['roofline_s']['ici'] + u['roofline_s']['ici']:.2f}")
    decode = p.get("decode")
    decode_s = ("-" if decode is None else "refused" if "error" in decode else
                f"{decode['hbm_gb']['total']:.1f} ({decode['bytes_ratio']:.1f}x)")
    step = _step_s(r)
    lines.append(
        f"| {r['plan']} | {r['topology']} ({r['chips']}) | {mesh} | {r['model']['remat']} | "
        f"{train} | {est['gb']} | {headroom} | {_total(p.get('score'))} | {decode_s} | {ici} | "
        f"{est['ici_s']} | {'-' if step is None else f'{step:.1f}'} | {est['step_s']} | "
        f"{sum(x['compile_s'] for x in p.values()):.0f} |")
  searched = [r for r in reports if r.get("search")]
  if searched:
    lines += ["", "Plans that do not fit, and what `--search` compiled instead:", ""]
    for r in searched:
      tried = "; ".join(f"{t['change']}: {t['hbm_gb']:.1f} GB, "
                        f"{'fits' if t['fits'] else 'no'}" for t in r["search"])
      lines.append(f"- {r['plan']}: {tried}")
  return "\n".join(lines)


def _total(program: dict | None) -> str:
  if program is None:
    return "-"
  return "no fit" if "error" in program else f"{program['hbm_gb']['total']:.1f}"


def write_docs(block: str) -> None:
  """Replaces the aot block of docs/scaling.md."""
  with open(sizing.DOC) as f:
    text = f.read()
  new = re.sub(r"<!-- aot:start -->.*<!-- aot:end -->",
               lambda _: f"<!-- aot:start -->\n{block}\n<!-- aot:end -->", text, flags=re.S)
  with open(sizing.DOC, "w") as f:
    f.write(new)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated, of {list(PLANS)}")
  p.add_argument("--out_dir", default="", help="also write <plan>.json here")
  p.add_argument("--update_docs", action="store_true", help="rewrite docs/scaling.md's block")
  p.add_argument("--programs", default=",".join(PROGRAMS), help=f"of {aot.PROGRAMS}")
  p.add_argument("--search", action="store_true",
                 help="when a train step does not fit, compile alternatives (aot.search)")
  args = p.parse_args()
  reports = []
  for name in args.plans.split(","):
    report = run(name, tuple(args.programs.split(",")), args.search)
    print(json.dumps(report), flush=True)
    if args.out_dir:
      os.makedirs(args.out_dir, exist_ok=True)
      with open(os.path.join(args.out_dir, f"{name}.json"), "w") as f:
        json.dump(report, f, indent=1)
    reports.append(report)
  if args.update_docs:  # every plan with a report in --out_dir, in PLANS order
    if args.out_dir:
      done = {r["plan"]: r for r in reports}
      for name in PLANS:
        path = os.path.join(args.out_dir, f"{name}.json")
        if name not in done and os.path.isfile(path):
          with open(path) as f:
            done[name] = json.load(f)
      reports = [done[n] for n in PLANS if n in done]
    write_docs(markdown(reports))


if __name__ == "__main__":
  main()
