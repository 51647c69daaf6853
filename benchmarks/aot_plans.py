"""The training plans of docs/scaling.md compiled for their TPU slices (trainer/aot.py).

    python -m benchmarks.aot_plans                       # every plan, JSON per plan on stdout
    python -m benchmarks.aot_plans --plans=qwen7b-v5p-full --out_dir=docs/aot --update_docs
    python -m benchmarks.aot_plans --plans=dsv3-v5p-ep-a2a --search   # alternatives if no fit
    python -m benchmarks.aot_plans --programs=decode --out_dir=docs/aot   # only the engine's
                                                          # programs anew, the rest kept

Each plan is the RL template (configs/rl.py) for a model preset, with the mesh, remat policy and
batch shape the sizing arithmetic (benchmarks/sizing.py) chose (or, for the MoE plans, an
expert-parallel mesh): rows of 32,768 tokens, one row per batch shard in a micro-batch, bf16
compute, Muon, the Pallas TPU tree kernel. The train step, the scoring pass and the engine's
decode step (its `rl.concurrency` slots of `rl.max_context_tokens`, the paged pool in the
decode layout on the plan's mesh) and the colocated weight sync (the trained weights moved to
the engine's layout after each step) are compiled by the real XLA TPU compiler on this machine
(no TPU) and set beside the arithmetic's per-chip memory and roofline step. `--update_docs`
rewrites the "compiled" block of docs/scaling.md (between
`<!-- aot:start -->` and `<!-- aot:end -->`) from every plan with a JSON in --out_dir.

Long-context plans (`LONG_PLANS`, the "Long contexts" section of docs/scaling.md between
`<!-- aot-long:start -->` and `<!-- aot-long:end -->`) train rows of 65,536 or 131,072 tokens
(the `-128k` YaRN presets; RoPE settings do not change the cost) with the same tokens per step
(256 rows of 32,768), with and without a `sequence` (context-parallel) mesh axis. Their train
step is compiled (`--programs` defaults to train for them); their estimate is arithmetic scaled
from the 32,768-token sizing (`long_estimate`), and the compiled roofline gets the causal
attention FLOPs added, which the compiled count leaves out (`attention_flops`).

    python -m benchmarks.aot_plans --plans=long --out_dir=docs/aot --update_docs
    python -m benchmarks.aot_plans --plans=long --docs_only --out_dir=docs/aot --update_docs

`--critic` compiles a plan as PPO with a learned critic (`rl.advantage` "gae", loss "ppo"):
the train step and the critic's two programs (`trainer.critic`), each side's HBM peak counted
with the other's state resident (JSON `<plan>-ppo.json`, the "PPO with a critic" block of
docs/scaling.md between `<!-- aot-critic:start -->` and `<!-- aot-critic:end -->`).

    python -m benchmarks.aot_plans --critic --plans=qwen7b-v5p-full --out_dir=docs/aot --update_docs
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import time
from typing import NamedTuple

from benchmarks import common, sizing
from configs import rl as rl_config
from models.presets import get_preset
from trainer import aot
from trainer import aot_search

# prefill: `--programs` (the unrolled engine model)
PROGRAMS = ("train", "score", "decode", "weight_sync")
LONG_PROGRAMS = ("train",)  # long-context plans: the train step (compiles take minutes each)
CRITIC_PROGRAMS = ("train", "critic")  # `--critic`: PPO with a learned critic

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
# the engine's own layout of the plan's devices (rl.engine_mesh_shape) where the trainer's
# does not fit it (32B on fsdp 64 would hold the whole bf16 model on every chip) or decodes
# slower (7B on v6e-64: the engine search's choice, docs/scaling.md)
ENGINE_MESH_SHAPES = {"qwen32b-v5p-full": "tensor=4", "qwen7b-v6e-full": "tensor=4"}
# The engine's slots (`rl.concurrency`, default 64) where the slice has more batch shards
# (fsdp x expert) than that: one slot per shard.
ENGINE_SLOTS = {"kimi-k2-v5p-ep-a2a": 256}


class Plan(NamedTuple):
  """A compiled plan: model, slice, mesh, batch shape."""
  preset: str  # models/presets.py name
  family: str  # configs/rl.py argument
  topology: str  # libtpu topology, "GEN:AxB[xC]"
  slice: str  # the sizing arithmetic's slice name (benchmarks/sizing.py)
  mesh: dict  # axis -> size (fsdp, tensor, expert, sequence)
  remat: str  # ModelConfig.remat
  micro_batches: int  # micro-batches per step
  overrides: dict  # further ModelConfig fields
  row_len: int = ROW_LEN  # training row length (tokens)


# Long rows: the same 8.4M tokens per step as the 32,768-token plans (256 rows); rows per
# micro-batch = the batch shards (data x fsdp x expert), each row split over `sequence`.
_QWEN32_LONG = ("qwen2.5-coder-32b-128k", "qwen2.5-coder", "v5p:4x4x4", "v5p-128")
_DSV3_LONG = ("deepseek-v3", "deepseek-v3", "v5p:8x8x8", "v5p-1024")
_DSV3_MOE = {"moe_dispatch": "all_to_all", "moe_dispatch_chunk": 1024, **SPLIT_RESIDUAL}
LONG_PLANS = {
    # the 32,768-token plan's mesh, then the residual stream split over tensor 4
    "qwen32b-v5p-64k": Plan(*_QWEN32_LONG, {"fsdp": 64, "tensor": 1}, "full", 2, {}, 65536),
    "qwen32b-v5p-64k-tp4": Plan(*_QWEN32_LONG, {"fsdp": 16, "tensor": 4}, "full", 8,
                                SPLIT_RESIDUAL, 65536),
    "qwen32b-v5p-128k-tp4": Plan(*_QWEN32_LONG, {"fsdp": 16, "tensor": 4}, "full", 4,
                                 SPLIT_RESIDUAL, 131072),
    # context parallelism: each row over 4 chips, 32,768 positions per chip
    "qwen32b-v5p-128k-cp4": Plan(*_QWEN32_LONG, {"fsdp": 16, "tensor": 1, "sequence": 4},
                                 "full", 4, {}, 131072),
    # the 32,768-token plan's mesh (fsdp 8 x tensor 8 x expert 8) at 64K and 128K rows
    "dsv3-v5p-64k": Plan(*_DSV3_LONG, {"fsdp": 8, "tensor": 8, "expert": 8}, "full", 2,
                         _DSV3_MOE, 65536),
    "dsv3-v5p-128k": Plan(*_DSV3_LONG, {"fsdp": 8, "tensor": 8, "expert": 8}, "full", 1,
                          _DSV3_MOE, 131072),
    # the same mesh 4 times over `sequence`: 2,048 chips, 32,768 positions per chip
    "dsv3-v5p-128k-cp4": Plan("deepseek-v3", "deepseek-v3", "v5p:8x16x16", "v5p-4096",
                              {"fsdp": 8, "tensor": 8, "expert": 8, "sequence": 4}, "full", 1,
                              _DSV3_MOE, 131072),
}
PLANS = {name: Plan(*plan) for name, plan in PLANS.items()}
ALL_PLANS = {**PLANS, **LONG_PLANS}


def plan_config(name: str):
  """The RL config of plan `name` (no files needed: model.init stays random)."""
  plan = ALL_PLANS[name]
  preset, family, mesh, remat, micro_batches, overrides = (
      plan.preset, plan.family, plan.mesh, plan.remat, plan.micro_batches, plan.overrides)
  c = rl_config.get_config(family)
  c.model.preset, c.model.init = preset, "random"
  c.optimizer.name = "muon"  # as the sizing arithmetic assumes
  c.model.overrides.remat = remat
  c.model.overrides.attention_impl = "pallas_tpu"
  c.model.overrides.update(overrides)
  c.mesh.data, c.mesh.expert = 1, mesh.get("expert", 1)
  c.mesh.fsdp, c.mesh.tensor = mesh["fsdp"], mesh["tensor"]
  if mesh.get("sequence", 1) > 1:
    c.mesh.sequence = mesh["sequence"]
  c.data.row_len, c.data.seq_len = plan.row_len, SEQ_LEN
  c.rl.max_context_tokens = max(c.rl.max_context_tokens, plan.row_len)
  c.rl.kv_cache = "paged"  # the engine's pool at scale: pages split over the batch shards
  c.rl.engine_mesh_shape = ENGINE_MESH_SHAPES.get(name, "")
  c.rl.concurrency = ENGINE_SLOTS.get(name, c.rl.concurrency)
  batch_shards = mesh["fsdp"] * mesh.get("expert", 1)
  c.data.rows_per_batch = c.data.max_seqs = batch_shards  # one row per batch shard
  c.data.microbatches = micro_batches
  return c


def estimate(name: str) -> dict:
  """The sizing arithmetic's figures for the plan: per-chip GB (`sizing.memory_per_chip`) and
  the roofline step (`sizing.step_time`: seconds, and its ICI part over the step)."""
  preset, _, _, slice_, mesh, remat, _, _, _ = PLANS[name]
  cfg, m = get_preset(preset), sizing.Mesh(mesh["fsdp"], mesh["tensor"], mesh.get("expert", 1))
  memory = sizing.memory_per_chip(cfg, m, remat, "muon")
  chip, _ = sizing.slice_chips(slice_)
  step = sizing.step_time(cfg, chip, m, remat, "muon")
  return {"gb": round(sum(memory.values()), 1), "step_s": round(step["roofline"], 2),
          "ici_s": round(step["ici"] * step["micro_batches"], 2)}


def attention_seconds(name: str) -> float:
  """Per-chip compute seconds of a step's causal attention (`attention_flops` / peak)."""
  plan = ALL_PLANS[name]
  cfg, mesh = get_preset(plan.preset), plan.mesh
  chip, _ = sizing.slice_chips(plan.slice)
  chips = math.prod(mesh.values())
  tokens = plan.micro_batches * mesh["fsdp"] * mesh.get("expert", 1) * plan.row_len
  return attention_flops(cfg, plan.row_len, tokens, plan.remat, mesh.get("sequence", 1)) / (
      chips * chip.peak_flops)


def attention_flops(cfg, row_len: int, tokens: int, remat: str, sequence: int = 1) -> float:
  """FLOPs of causal attention over full rows, all chips together, as the slowest chip sets
  the pace.

  Per query and layer, QK and PV cost 2 x heads x (qk width + value width) per key; a causal
  row's queries see row_len / 2 keys on average. Passes: forward, backward (2x), and the
  forward again under full remat. Rows split into `sequence` contiguous chunks leave the last
  chunk's chip (queries at the end of the row) with 2 - 1/sequence times the average keys.

  Args:
    cfg: the model config.
    row_len: tokens per row.
    tokens: row positions per step.
    remat: the remat policy ("full" adds a forward pass).
    sequence: the context-parallel axis size.

  Returns:
    The step's attention FLOPs (times chips: divide by the chips for per-chip FLOPs).
  """
  passes = 3 + (remat == "full")
  keys = row_len / 2 * (2 - 1 / sequence)
  return (2 * cfg.num_layers * cfg.num_heads * (cfg.qk_head_dim + cfg.value_head_dim) * keys
          * tokens * passes)


def long_estimate(name: str) -> dict:
  """Arithmetic for a long-context plan: `sizing.memory_per_chip` at 32,768 tokens per chip
  with its token-proportional items (saved activations, the layer working set) scaled to the
  plan's row_len / sequence tokens per chip (the saved activations also split over `tensor`
  when the plan splits the residual stream; parameters and optimizer state over fsdp x
  sequence); the compute roofline of the step (matmuls over
  every row position, 2 x active parameters per pass, plus `attention_flops`)."""
  plan = ALL_PLANS[name]
  cfg, mesh = get_preset(plan.preset), plan.mesh
  seq = mesh.get("sequence", 1)
  # parameters and optimizer state: FSDP over fsdp x sequence (the `embed` rule)
  m = sizing.Mesh(mesh["fsdp"] * seq, mesh["tensor"], mesh.get("expert", 1))
  memory = sizing.memory_per_chip(cfg, m, plan.remat, "muon")
  scale = plan.row_len / seq / sizing.ROW
  for item in ("activations", "layer working set"):
    memory[item] *= scale
  if plan.overrides.get("sharding_rules", {}).get("act_embed") == "tensor":
    memory["activations"] /= mesh["tensor"]  # the saved layer inputs split over tensor
  chip, _ = sizing.slice_chips(plan.slice)
  chips = math.prod(mesh.values())
  tokens = plan.micro_batches * mesh["fsdp"] * mesh.get("expert", 1) * plan.row_len
  matmuls = 2 * sizing.active_matmul_params(cfg) * tokens * (3 + (plan.remat == "full"))
  attention = attention_seconds(name)
  return {"gb": round(sum(memory.values()), 1), "attention_s": round(attention, 2),
          "step_s": round(matmuls / chips / chip.peak_flops + attention, 2)}


def run(name: str, programs=PROGRAMS, search: bool = False, critic: bool = False) -> dict:
  """Compiles plan `name`; the aot report plus the plan, the estimate and, with `search`, the
  settings tried when the train step does not fit (`aot.search`). With `critic`, the plan as
  PPO with a learned critic (report["critic"] True)."""
  t0 = time.perf_counter()
  config = plan_config(name)
  if critic:
    config.rl.advantage, config.loss.name = "gae", "ppo"
  report = aot.compile_run(config, ALL_PLANS[name].topology, programs)
  report["plan"] = name
  if critic:
    report["critic"] = True
    report["compiled"] = {"date": common.today(), "machine": common.machine()}
  report["estimate"] = long_estimate(name) if name in LONG_PLANS else estimate(name)
  if name in LONG_PLANS:
    report["preset"] = ALL_PLANS[name].preset
    report["compiled"] = {"date": common.today(), "machine": common.machine()}
  if search:
    report["search"] = aot_search.search(config, ALL_PLANS[name].topology, report,
                                         compile_fn=aot.compile_run)
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
  # programs compiled again after a plan's first compile (`--programs`): when and where
  again = sorted({f"{name} {when['date']} ({when['machine']})" for r in reports
                  for name, when in r.get("recompiled", {}).items()})
  lines = [f"Written {common.today()} on {common.machine()} from the plans' JSONs in docs/aot, "
           "compiled with libtpu (no TPU); `python -m benchmarks.aot_plans --update_docs`"
           + (f"; programs compiled again since: {', '.join(again)}" if again else "")
           + ". **Compiled** columns come from the XLA TPU compiler (memory_analysis, the "
           "optimized HLO's collectives with loop trip counts); **estimate** columns from the "
           "arithmetic above.", "",
           "| plan | slice (chips) | mesh | remat | train peak GB / chip (compiled) | estimate | "
           "headroom GB | score GB | decode GB (HBM bytes / min, per step) | "
           "weight sync GB gathered (ms) | "
           "ICI s / step (compiled) | estimate | step s (compiled roofline) | estimate | "
           "compile s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
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
                f"{decode['hbm_gb']['total']:.1f} ({decode['bytes_ratio']:.2f}x)")
    sync = p.get("weight_sync")
    sync_s = ("-" if sync is None else "refused" if "error" in sync else
              f"{sum(c['bytes'] for c in sync['collectives'].values()) / 1e9:.1f} "
              f"({1e3 * sync['roofline_s']['step']:.0f})")
    step = _step_s(r)
    lines.append(
        f"| {r['plan']} | {r['topology']} ({r['chips']}) | {mesh} | {r['model']['remat']} | "
        f"{train} | {est['gb']} | {headroom} | {_total(p.get('score'))} | {decode_s} | "
        f"{sync_s} | {ici} | "
        f"{est['ici_s']} | {'-' if step is None else f'{step:.1f}'} | {est['step_s']} | "
        f"{sum(x['compile_s'] for x in p.values()):.0f} |")
  searched = [r for r in reports if r.get("search")]
  if searched:
    lines += ["", "Plans that do not fit, and what `--search` compiled instead:", ""]
    for r in searched:
      tried = "; ".join(f"{t['layout']}: {t['verdict']}" for t in r["search"].get("tried", []))
      lines.append(f"- {r['plan']}: {tried}")
  return "\n".join(lines)


def long_markdown(reports: list[dict]) -> str:
  """The docs table of the long-context plans: compiled vs estimated HBM per chip and step."""
  when = reports[0].get("compiled", {}) if reports else {}
  lines = [f"Compiled {when.get('date', common.today())} on "
           f"{when.get('machine', common.machine())} with libtpu (no TPU); "
           "`python -m benchmarks.aot_plans --plans=long --out_dir=docs/aot --update_docs`. "
           "Each step trains 256 x 32,768 = 8.4M row positions. **Compiled** HBM is the train "
           "step's peak with the resident optimizer state; the compiled step is the compiled "
           "roofline with the causal attention's compute added (`attention s`: the compiler's "
           "FLOP count leaves the attention kernel out); **estimate** columns are the "
           "arithmetic (`aot_plans.long_estimate`).", "",
           "| plan | model | slice (chips) | row tokens | mesh | sequence axis | train peak GB / "
           "chip (compiled) | estimate | fits? | attention s | step s (compiled + attention) | "
           "estimate | compile s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in reports:
    p, est, peak = r["programs"], r["estimate"], r.get("train_peak_gb", {})
    g, u = p.get("train/gradients", {}), p.get("train/update", {})
    refused = "error" in g or "error" in u
    mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items() if v > 1)
    seq = r["mesh"].get("sequence", 1)
    attention = attention_seconds(r["plan"])
    if refused or not peak:
      train, fits, step = (f"> {peak['total']:.1f} (refused)" if peak else "-"), "no", "-"
    else:
      roof = g["roofline_s"]
      step_s = max(roof["compute"] + attention, roof["hbm"], roof["ici"]) + \
          u["roofline_s"]["step"]
      train, fits, step = f"{peak['total']:.1f}", "yes" if peak["fits"] else "no", f"{step_s:.1f}"
    lines.append(
        f"| {r['plan']} | {r.get('preset', '-')} | {r['topology']} ({r['chips']}) | "
        f"{r['batch']['row_len']:,} | {mesh} | {seq if seq > 1 else 'none'} | {train} | "
        f"{est['gb']} | {fits} | {attention:.1f} | {step} | {est['step_s']} | "
        f"{sum(x['compile_s'] for x in p.values()):.0f} |")
  return "\n".join(lines)


def critic_markdown(reports: list[dict]) -> str:
  """The docs table of the plans compiled as PPO with a learned critic."""
  when = reports[0].get("compiled", {}) if reports else {}
  lines = [f"Compiled {when.get('date', common.today())} on "
           f"{when.get('machine', common.machine())} with libtpu (no TPU); "
           "`python -m benchmarks.aot_plans --critic --plans=... --out_dir=docs/aot "
           "--update_docs`. The critic (`trainer.critic`: the policy's architecture with a "
           "value head, fp32 weights and Adam moments sharded like the policy's) stays "
           "resident beside the policy's state: the policy's peak counts the critic's state, "
           "the critic's update counts the policy's TrainState. Roofline seconds per step: the "
           "policy's accumulation + update, the critic's forward (its GAE fields) + update.", "",
           "| plan | slice (chips) | critic state GB / chip | policy peak GB / chip (with "
           "critic) | critic peak GB / chip (with policy) | fits? | policy step s | critic s "
           "(values + update) | compile s |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in reports:
    p, peak, cpeak = r["programs"], r.get("train_peak_gb", {}), r.get("critic_peak_gb", {})
    values, update = p.get("critic/values", {}), p.get("critic/update", {})
    step = _step_s(r)
    critic_s = (None if "error" in values or "error" in update or not update
                else values["roofline_s"]["step"] + update["roofline_s"]["step"])
    fits = bool(peak.get("fits") and cpeak.get("fits"))
    lines.append(
        f"| {r['plan']} | {r['topology']} ({r['chips']}) | {cpeak.get('critic_state', 0):.1f} | "
        f"{peak.get('total', float('nan')):.1f} | {cpeak.get('total', float('nan')):.1f} | "
        f"{'yes' if fits else 'no'} | {'-' if step is None else f'{step:.2f}'} | "
        f"{'-' if critic_s is None else f'{critic_s:.2f}'} | "
        f"{sum(x['compile_s'] for x in p.values()):.0f} |")
  return "\n".join(lines)


def decode_markdown(reports: list[dict]) -> str:
  """The docs table of each plan's compiled decode step: HBM per chip, the HBM bytes a step
  reads and writes against its floor, the roofline step, XLA's count beside them."""
  lines = ["| plan (engine mesh) | slots | decode HBM GB / chip | headroom | HBM GB / step (loop "
           "+ around it / steps) | minimum GB | ratio | roofline step ms | tokens/s (slice, "
           "roofline) | XLA bytes accessed GB (ratio) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in reports:
    d = r["programs"].get("decode")
    if d is None or "error" in d or "hbm_bytes" not in d:
      continue
    mesh = r.get("engine_mesh") or r["mesh"]
    mesh_s = " x ".join(f"{k} {v}" for k, v in mesh.items() if v > 1)
    hbm, total = d["hbm_bytes"], d["hbm_gb"]["total"]
    slots, step_s = d["slots"], d["roofline_s"]["step"]
    lines.append(
        f"| {r['plan']} ({mesh_s}) | {slots} | {total:.1f} | "
        f"{1 - total / d['hbm_gb']['capacity']:.0%} | "
        f"{hbm['per_step'] / 1e9:.2f} ({hbm['loop'] / 1e9:.2f} + {hbm['outside'] / 1e9:.2f} / "
        f"{d['steps']}) | "
        f"{d['min_bytes'] / 1e9:.2f} | {d['bytes_ratio']:.2f}x | "
        f"{1e3 * step_s:.1f} | {slots / step_s:,.0f} | {d['bytes_accessed'] / 1e9:.1f} "
        f"({d['xla_bytes_ratio']:.2f}x) |")
  return "\n".join("  " + line for line in lines)  # inside the docs' "Decode" item


def _total(program: dict | None) -> str:
  if program is None:
    return "-"
  return "no fit" if "error" in program else f"{program['hbm_gb']['total']:.1f}"


def write_docs(block: str, tag: str = "aot") -> None:
  """Replaces the `tag` block of docs/scaling.md ("aot"; "aot-decode", "aot-long", "aot-critic")."""
  with open(sizing.DOC) as f:
    text = f.read()
  new = re.sub(rf"<!-- {tag}:start -->.*<!-- {tag}:end -->",
               lambda _: f"<!-- {tag}:start -->\n{block}\n<!-- {tag}:end -->", text, flags=re.S)
  with open(sizing.DOC, "w") as f:
    f.write(new)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--plans", default=",".join(PLANS),
                 help=f"comma-separated, of {list(ALL_PLANS)}; 'long' = {list(LONG_PLANS)}")
  p.add_argument("--out_dir", default="", help="also write <plan>.json here")
  p.add_argument("--update_docs", action="store_true", help="rewrite docs/scaling.md's block")
  p.add_argument("--programs", default="",
                 help=f"of {aot.PROGRAMS}; default {PROGRAMS}, long-context plans {LONG_PROGRAMS}")
  p.add_argument("--search", action="store_true",
                 help="when a train step does not fit, compile alternatives (aot.search)")
  p.add_argument("--critic", action="store_true",
                 help="compile the plans as PPO with a learned critic (<plan>-ppo.json)")
  p.add_argument("--docs_only", action="store_true",
                 help="compile nothing: rewrite the blocks of --plans from the JSONs in --out_dir")
  args = p.parse_args()
  names = ",".join(LONG_PLANS) if args.plans == "long" else args.plans
  reports = []
  for name in [] if args.docs_only else names.split(","):
    if name not in ALL_PLANS:
      p.error(f"--plans: {name!r} is not one of {list(ALL_PLANS)}")
    default = (CRITIC_PROGRAMS if args.critic else LONG_PROGRAMS if name in LONG_PLANS
               else PROGRAMS)
    programs = tuple(args.programs.split(",")) if args.programs else default
    report = run(name, programs, args.search, args.critic)
    print(json.dumps(report), flush=True)
    if args.out_dir:
      os.makedirs(args.out_dir, exist_ok=True)
      path = os.path.join(args.out_dir, f"{name}{'-ppo' if args.critic else ''}.json")
      if args.programs and os.path.isfile(path):  # some programs anew: keep the others
        with open(path) as f:
          old = json.load(f)
        old["programs"].update(report["programs"])
        old.pop("engine_mesh", None)  # the engine's layout these programs were compiled in
        old.update({k: report[k] for k in ("engine_mesh",) if k in report})
        old.setdefault("recompiled", {}).update(
            {p: {"date": common.today(), "machine": common.machine()} for p in programs})
        report = old
      with open(path, "w") as f:
        json.dump(report, f, indent=1)
    reports.append(report)
  if args.update_docs and args.critic:  # every plan with a -ppo report in --out_dir
    done = {r["plan"]: r for r in reports}
    for name in ALL_PLANS if args.out_dir else ():
      path = os.path.join(args.out_dir, f"{name}-ppo.json")
      if name not in done and os.path.isfile(path):
        with open(path) as f:
          done[name] = json.load(f)
    write_docs(critic_markdown([done[n] for n in ALL_PLANS if n in done]), "aot-critic")
  elif args.update_docs:  # every plan with a report in --out_dir, in PLANS order
    done = {r["plan"]: r for r in reports}
    for name in (names.split(",") if args.docs_only else ALL_PLANS) if args.out_dir else ():
      path = os.path.join(args.out_dir, f"{name}.json")
      if name not in done and os.path.isfile(path):
        with open(path) as f:
          done[name] = json.load(f)
    if any(n in done for n in PLANS):
      write_docs(markdown([done[n] for n in PLANS if n in done]))
      write_docs(decode_markdown([done[n] for n in PLANS if n in done]), "aot-decode")
    if any(n in done for n in LONG_PLANS):
      write_docs(long_markdown([done[n] for n in LONG_PLANS if n in done]), "aot-long")


if __name__ == "__main__":
  main()
