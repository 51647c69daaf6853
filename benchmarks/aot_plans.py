"""The training plans of docs/scaling.md compiled for their TPU slices (trainer/aot.py).

    python -m benchmarks.aot_plans                       # every plan, JSON per plan on stdout
    python -m benchmarks.aot_plans --plans=qwen7b-v5p-full --update_docs

Each plan is the RL template (configs/rl.py) for a model preset, with the mesh, remat policy and
batch shape the sizing arithmetic (benchmarks/sizing.py) chose: rows of 32,768 tokens, one row
per batch shard in a micro-batch, bf16 compute, the Pallas TPU tree kernel. The train step and
the scoring pass are compiled by the real XLA TPU compiler on this machine (no TPU) and
compared with the arithmetic's per-chip memory estimate. `--update_docs` rewrites the
"compiled" block of docs/scaling.md (between `<!-- aot:start -->` and `<!-- aot:end -->`).
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
                         {"fsdp": 64, "tensor": 4}, "full", 4, {}),
    "qwen3-30b-a3b-v5p-ep": ("qwen3-30b-a3b", "qwen3", "v5p:4x4x2", "v5p-64",
                             {"fsdp": 4, "tensor": 1, "expert": 8}, "full", 4,
                             {"moe_dispatch": "all_to_all"}),
    "dsv3-v5p-ep-a2a": ("deepseek-v3", "deepseek-v3", "v5p:8x8x8", "v5p-1024",
                        {"fsdp": 8, "tensor": 8, "expert": 8}, "full", 4,
                        {"moe_dispatch": "all_to_all"}),
    "dsv3-v5p-ep-global": ("deepseek-v3", "deepseek-v3", "v5p:8x8x8", "v5p-1024",
                           {"fsdp": 8, "tensor": 8, "expert": 8}, "full", 4,
                           {"moe_dispatch": "global"}),
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


def estimate_gb(name: str) -> float:
  """The sizing arithmetic's per-chip total (`sizing.memory_per_chip`) for the plan."""
  preset, _, _, _, mesh, remat, _, _ = PLANS[name]
  memory = sizing.memory_per_chip(
      get_preset(preset), sizing.Mesh(mesh["fsdp"], mesh["tensor"], mesh.get("expert", 1)),
      remat, "muon")
  return round(sum(memory.values()), 1)


def run(name: str) -> dict:
  """Compiles plan `name`; the aot report plus the plan and the estimate."""
  t0 = time.perf_counter()
  report = aot.compile_run(plan_config(name), PLANS[name][2])
  report["plan"] = name
  report["estimate_gb"] = estimate_gb(name)
  report["wall_s"] = round(time.perf_counter() - t0, 1)
  return report


def markdown(reports: list[dict]) -> str:
  """The docs table: compiled vs estimated HBM per chip and the roofline of each plan."""
  lines = [f"Compiled {common.today()} on {common.machine()} with libtpu (no TPU); "
           "`python -m benchmarks.aot_plans --update_docs`.", "",
           "| plan | slice | mesh | remat | train HBM / chip (compiled) | estimate | fits | "
           "temporaries | score HBM | collectives per step (train) | compile s |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in reports:
    g, s = r["programs"]["train/gradients"], r["programs"].get("score")
    mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items() if v > 1)
    if "error" in g:
      need = g["hbm_gb"].get("temporaries", "?")
      lines.append(f"| {r['plan']} | {r['topology']} ({r['chips']}) | {mesh} | "
                   f"{r['model']['remat']} | > {need} (temporaries alone) | {r['estimate_gb']} | "
                   f"no | {need} | - | - | {g['compile_s']:.0f} |")
      continue
    coll = ", ".join(f"{k} {v['count']} ({v['bytes'] / 1e9:.0f} GB)"
                     for k, v in sorted(g["collectives"].items()))
    lines.append(
        f"| {r['plan']} | {r['topology']} ({r['chips']}) | {mesh} | {r['model']['remat']} | "
        f"{g['hbm_gb']['total']:.1f} | {r['estimate_gb']} | "
        f"{'yes' if g['hbm_gb']['fits'] else 'no'} | {g['hbm_gb']['temporaries']:.1f} | "
        f"{_total(s)} | {coll} | "
        f"{sum(p['compile_s'] for p in r['programs'].values()):.0f} |")
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
  args = p.parse_args()
  reports = []
  for name in args.plans.split(","):
    report = run(name)
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
