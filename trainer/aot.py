"""Ahead-of-time compilation of a run's programs for a TPU slice, on a machine without one.

Size: the programs' compilation, their reports and the command line share this module (the
HLO's collectives and HBM traffic are `trainer.aot_hlo`'s); the report arithmetic
(`program_report`, `engine_report`, `train_peak`, `resident_peak`, `out_of_memory`) is the
piece to move out next (a `trainer/aot_report.py`).

    python -m trainer.aot --config=configs/rl.py:qwen2.5-coder \\
        --config.model.preset=qwen2.5-coder-7b --config.model.init=random \\
        --topology=v5p:2x2x2 [--programs=train,score,decode,weight_sync] [--out=aot.json] [--search]

`libtpu` (the `jax[tpu]` extra; installed with the test dependencies) carries the XLA TPU
compiler, Mosaic included, and the descriptions of TPU topologies: `topology_devices` gives the
devices of a slice ("v5p:2x2x2" = 8 chips, "v6e:2x2" = 4), the config's mesh and sharding rules
are laid over them, and the run's own jitted programs are lowered on abstract inputs
(`jax.ShapeDtypeStruct`s carrying their shardings) and compiled:

  train   `TrainStep.compile`: the accumulation over micro-batches (the scan, remat policy,
          chunked log-probs, the loss) and the optimizer update (Muon / AdamW, QK-Clip, the
          router bias step), with the state's real shardings;
  score   `make_score_fn`: the forward-only pass of the reference / teacher / pi_old scoring;
  critic  (RL with `rl.advantage` "gae" only) the learned critic's two programs
          (`trainer.critic`): "critic/values", the forward pass its GAE fields read, and
          "critic/update", the value loss's accumulation and Adam update; the critic's state
          is resident beside the policy's, so each side's peak counts the other's state;
  prefill, decode  the generation engine's calls (`trainer.aot_engine`) for the run's engine
          (`rl.concurrency` slots of `rl.max_context_tokens`), on the same mesh: the weights
          and the KV cache (MLA: the absorbed latent cache) sharded by the model's rules.

Batch shapes come from the config: M = data.microbatches micro-batches of R = data.rows_per_batch
rows of L = data.row_len tokens, S = data.max_seqs sequences of T = data.seq_len sampled tokens,
and the fields the loss needs (`step.required_inputs`). Nothing runs and no weights are read
(`model.init` may stay a placeholder: the architecture comes from `model.preset` or the
checkpoint's config.json).

Per program the report holds, per chip: HBM (arguments, outputs, temporaries, generated code,
their total against the chip's capacity), FLOPs and bytes accessed (`cost_analysis`, which
counts a loop body once: the micro-batch and layer scans make them per-iteration figures), every
collective of the optimized HLO with the number of times it runs (loop trip counts applied) and
its result bytes, the Mosaic kernel calls, the compile time; and the roofline time (the largest
of FLOPs / peak, bytes / HBM bandwidth, collective bytes / ICI bandwidth; the compute term uses
the model FLOPs, 6 N T for the accumulation (8 N T with full remat, which runs the forward
twice) and 2 N T for scoring, N the active parameters and T the step's row positions per chip,
when they exceed the compiled count; attention's FLOPs are left out) with the model-FLOPs
utilisation it implies. Prefill and decode add `min_bytes`, the HBM bytes a call must read at
least per chip (`aot_engine.engine_programs`: the weights once, the cache it touches), and
`bytes_ratio`, the compiled program's HBM bytes over it (`engine_report`: for decode, per
step, from the optimized HLO's memory spaces, `trainer.aot_hlo.hbm_bytes`; their roofline
takes its HBM term from it too). `weight_sync` is the colocated transfer of the trained weights
to the engine's layout after each step (`aot_engine.weight_sync_program`): its collectives and
roofline time (ICI-bound: it moves data, computes nothing) are the transfer's cost per update,
`engine_bytes` what each chip then holds of the engine's copy of what changed.

With `--search`, when the train step does not fit (or always, with `--search_all`),
`trainer.aot_search` ranks the config's other valid layouts (mesh, rows per micro-batch, remat,
residual split, chunks) by arithmetic, compiles the most promising (`--search_budget`, until
`--search_fits` fit) and names the best plan that fits. When the decode call does not fit
within that line (or always, with `--search_all`), `trainer.aot_engine_search` compiles it on
other engine layouts (`rl.engine_mesh_shape`) and names the fastest that fits.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
import sys
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import optax
from absl import app, flags
from jax.experimental import topologies
from ml_collections import config_flags

from models import presets, sharding
from models.hardware import CHIPS, GB, Chip, storage_bits
from models.kernels import attention
from rl import advantages, corrections
from trainer import aot_engine
from trainer import aot_engine_search
from trainer import aot_hlo
from trainer import aot_search
from trainer import config as config_lib
from trainer import critic as critic_lib
from trainer import optim
from trainer import rollouts
from trainer import state as state_lib
from trainer import step as step_lib
from trainer.batches import MicroBatches

PROGRAMS = ("train", "score", "critic", "prefill", "decode", "weight_sync")


def topology_devices(topology: str) -> tuple[Chip, list]:
  """The devices of a TPU slice, described by libtpu (no TPU needed).

  Args:
    topology: "GEN:AxB[xC]", e.g. "v5p:2x2x1" (4 chips), "v5p:4x4x4" (64), "v6e:2x2" (4).

  Returns:
    (the generation's Chip, the slice's devices: one per chip, to build a mesh over).

  Raises:
    ConfigError: an unknown generation or a shape libtpu does not know.
  """
  gen, _, shape = topology.partition(":")
  if gen not in CHIPS or not re.fullmatch(r"\d+(x\d+){1,2}", shape):
    raise config_lib.ConfigError(f"--topology={topology!r}: expected GEN:AxB[xC] with GEN one "
                                 f"of {sorted(CHIPS)} (e.g. v5p:2x2x2, v6e:4x4)")
  # Only the compiler is used (no TPU is opened), so several processes may load libtpu at once
  # (a test runner's workers, a compile beside a run).
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    desc = topologies.get_topology_desc(platform="tpu", topology_name=topology)
  except Exception as e:  # libtpu's message says what it accepts
    raise config_lib.ConfigError(f"--topology={topology!r}: {e}") from None
  return CHIPS[gen], list(desc.devices)


def _struct(shape: Sequence[int], dtype, sharding_) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding_)


def abstract_micro_batches(config, model_cfg, mesh) -> MicroBatches:
  """The step's micro-batches as ShapeDtypeStructs with their shardings (nothing allocated).

  Args:
    config: the run's config (data.microbatches, rows_per_batch, row_len, max_seqs, seq_len;
      the loss and correction that name the fields).
    model_cfg: the model's ModelConfig.
    mesh: the mesh the batch is sharded over.

  Returns:
    MicroBatches of `jax.ShapeDtypeStruct`s: [M, R, L] positions, [M, S, T] sequences, the
    fields "loss_mask", "turn" and what the loss needs, the scalar "group" (and "advantage",
    "reward" where needed); RL modes also carry the sampler's "logprobs".
  """
  d = config.data
  m, r, l = max(1, d.microbatches), d.rows_per_batch, d.row_len
  s, t = d.max_seqs, d.seq_len
  loss_cfg = config_lib.loss_config(config)
  correction = corrections.CorrectionConfig(kind=config.rl.correction)
  fields, scalars = {"loss_mask", "turn"}, {"group"}
  for where, name, _ in step_lib.required_inputs(loss_cfg, correction):
    (scalars if where in ("scalars", "either") else fields).add(name)
  if config.mode in ("rl", "distill"):
    fields.add("logprobs")
  if config.mode == "rl" and config.rl.advantage in advantages.CRITIC_ADVANTAGES:
    # the critic's per-token fields (`trainer.critic.Critic.gae_fields`)
    scalars.discard("advantage")
    fields |= {"advantage", "returns", "old_values"}
    scalars.add("reward")
  i32, f32 = jnp.int32, jnp.float32
  plain = MicroBatches(
      tokens=_struct((m, r, l), i32, None), positions=_struct((m, r, l), i32, None),
      end=_struct((m, r, l), i32, None), token_weights=_struct((m, r, l), f32, None),
      seq_pred=_struct((m, s, t), i32, None), seq_tokens=_struct((m, s, t), i32, None),
      seq_valid=_struct((m, s, t), jnp.bool_, None), seq_id=_struct((m, s), i32, None),
      fields={k: _struct((m, s, t), f32, None) for k in sorted(fields)},
      scalars={k: _struct((m, s), f32, None) for k in sorted(scalars)}, expert_ids=None)
  shardings = step_lib.batch_shardings(model_cfg, mesh, plain)
  return jax.tree.map(lambda x, sh: _struct(x.shape, x.dtype, sh), plain, shardings)


def program_report(compiled, seconds: float, chip: Chip, model_flops: Optional[float],
                   useful_flops: Optional[float] = None,
                   hbm_bytes: Optional[float] = None, hlo_text: Optional[str] = None) -> dict:
  """What one compiled program costs per chip (see the module docstring).

  Args:
    compiled: a `jax.stages.Compiled` for the slice.
    seconds: its compile time.
    chip: the slice's Chip.
    model_flops: the FLOPs per chip the program runs by the model's count (8 N T, 6 N T,
      2 N T), or None (no utilisation reported).
    useful_flops: those that count for the utilisation (6 N T for a train step whatever the
      remat); default model_flops.
    hbm_bytes: the HBM bytes per step for the roofline's HBM term (`engine_report`: the
      compiled HBM traffic); default XLA's bytes accessed.
    hlo_text: `compiled.as_text()` when the caller has it (large programs print slowly).

  Returns:
    A JSON-able dict: hbm_gb {arguments, outputs, temporaries, code, aliased, total,
    capacity, fits}, flops and bytes_accessed (XLA's cost analysis: loop bodies counted
    once), collectives (per execution, `collectives`), mosaic_kernels (Mosaic calls by
    Pallas kernel name, "other" for the compiler's own, e.g. ragged_dot), roofline_s
    {compute, hbm, ici, step, bound}, mfu, compile_s.
  """
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis() or {}
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  hbm = {"arguments": mem.argument_size_in_bytes, "outputs": mem.output_size_in_bytes,
         "temporaries": mem.temp_size_in_bytes, "code": mem.generated_code_size_in_bytes,
         "aliased": mem.alias_size_in_bytes}
  total = (hbm["arguments"] + hbm["outputs"] + hbm["temporaries"] + hbm["code"]
           - hbm["aliased"])
  text = compiled.as_text() if hlo_text is None else hlo_text
  coll = aot_hlo.collectives(text)
  kernels = collections.Counter(
      (re.search(r'op_name="[^"]*?(\w+)/pallas_call"', line) or re.search("()", "")).group(1)
      or "other" for line in text.splitlines() if 'custom_call_target="tpu_custom_call"' in line)
  flops, accessed = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
  # XLA's cost analysis counts a loop body once (the micro-batch and layer scans): the
  # compute term takes the model's FLOPs when they are larger, and the HBM term is a floor.
  terms = {"compute": max(flops, model_flops or 0.0) / chip.peak_flops,
           "hbm": (accessed if hbm_bytes is None else hbm_bytes) / chip.hbm_bw,
           "ici": sum(c["bytes"] for c in coll.values()) / chip.ici_bw}
  step_s = max(terms.values())
  return {
      "hbm_gb": {**{k: round(v / GB, 3) for k, v in hbm.items()}, "total": round(total / GB, 3),
                 "capacity": chip.hbm_bytes / GB, "fits": total <= chip.hbm_bytes},
      "flops": flops, "bytes_accessed": accessed, "collectives": coll,
      "mosaic_kernels": dict(sorted(kernels.items())),
      "roofline_s": {**{k: round(v, 6) for k, v in terms.items()}, "step": round(step_s, 6),
                     "bound": max(terms, key=terms.get)},
      "mfu": (round((useful_flops or model_flops) / chip.peak_flops / step_s, 4)
              if model_flops and step_s > 0 else None),
      "compile_s": round(seconds, 2),
  }


def engine_report(compiled, seconds: float, chip: Chip, min_bytes: float, steps: int,
                  slots: int) -> dict:
  """`program_report` of an engine call, its HBM term from the compiled HBM traffic.

  Args:
    compiled: the compiled prefill or decode call.
    seconds: its compile time.
    chip: the slice's Chip.
    min_bytes: the call's floor per chip (`aot_engine.engine_programs`; decode: one step's).
    steps: decode steps per call (`steps_per_call`; 1 for prefill).
    slots: the engine's slots (sequences decoded together).

  Returns:
    The report plus steps, slots, hbm_bytes {loop, outside, per_step} (`aot_hlo.hbm_bytes`:
    one iteration of the decode loop, the code around it per call, and their sum per step, the
    code around the loop shared by the call's `steps`), min_bytes, bytes_ratio (per_step over
    min_bytes) and xla_bytes_ratio (XLA's bytes accessed, which counts VMEM staging too, over
    min_bytes); the roofline's HBM term is per_step over the chip's bandwidth.
  """
  text = compiled.as_text()
  hbm = aot_hlo.hbm_bytes(text)
  per_step = hbm["loop"] + hbm["outside"] / steps
  report = program_report(compiled, seconds, chip, None, hbm_bytes=per_step, hlo_text=text)
  report.update(steps=steps, slots=slots, hbm_bytes={**hbm, "per_step": per_step},
                min_bytes=min_bytes, bytes_ratio=round(per_step / max(min_bytes, 1.0), 2),
                xla_bytes_ratio=round(report["bytes_accessed"] / max(min_bytes, 1.0), 2))
  return report


def compile_run(config, topology: str, programs: Sequence[str] = PROGRAMS) -> dict:
  """Compiles a run's programs for a TPU slice and reports their costs.

  Args:
    config: an "sft", "rl" or "distill" config, as the run would use it (files are not read).
    topology: the slice, "GEN:AxB[xC]" (`topology_devices`).
    programs: which of `PROGRAMS` to compile.

  Returns:
    {"topology", "chips", "mesh", "model", "batch", "programs": {name: `program_report`}}.

  Raises:
    ConfigError: a bad config field, topology or program name, or a mesh that does not
      divide the slice's chips.
  """
  with attention.compile_for("tpu"):  # kernels for the TPU, not this host's backend
    return _compile_run(config, topology, programs)


def _compile_run(config, topology: str, programs: Sequence[str]) -> dict:
  config_lib.validate(config, None, files=False)
  if config.mode not in ("sft", "rl", "distill"):
    raise config_lib.ConfigError(f"config.mode={config.mode!r}: the compiled programs are "
                                 "those of 'sft', 'rl' or 'distill'")
  if not programs:
    raise config_lib.ConfigError(f"--programs: empty; name some of {PROGRAMS}")
  for name in programs:
    if name not in PROGRAMS:
      raise config_lib.ConfigError(f"--programs: {name!r} is not one of {PROGRAMS}")
  chip, devices = topology_devices(topology)
  shape = config_lib.mesh_shape(config, len(devices))
  mesh_cfg = sharding.MeshConfig(**dict(zip(sharding.MESH_AXES, shape)))
  mesh = sharding.make_mesh(mesh_cfg, devices)
  model_cfg = config_lib.model_config(config)
  optimizer = optim.build(config.optimizer, model_cfg)
  state = state_lib.abstract(model_cfg, optimizer, mesh)
  mb = abstract_micro_batches(config, model_cfg, mesh)
  d = config.data
  tokens = max(1, d.microbatches) * d.rows_per_batch * d.row_len
  active = presets.count_active_params(model_cfg)
  per_chip = lambda passes: 2 * passes * active * tokens / len(devices)
  report = {"topology": topology, "chips": len(devices), "mesh": dict(mesh.shape),
            "model": {"params": presets.count_params(model_cfg), "active_params": active,
                      "attention_impl": model_cfg.attention_impl, "remat": model_cfg.remat,
                      "dtype": str(model_cfg.dtype)},
            "batch": {"micro_batches": max(1, d.microbatches), "rows": d.rows_per_batch,
                      "row_len": d.row_len, "seqs": d.max_seqs, "seq_len": d.seq_len},
            "programs": {}}
  if "train" in programs:
    train_step = step_lib.make_train_step(
        model_cfg, config_lib.loss_config(config), optimizer, mesh=mesh,
        correction_cfg=corrections.CorrectionConfig(kind=config.rl.correction))
    for name, (compiled, seconds) in train_step.compile(state, mb).items():
      if isinstance(compiled, Exception):
        report["programs"][f"train/{name}"] = out_of_memory(compiled, chip, seconds)
        continue
      # forward + backward (2x), and the forward again under full remat
      flops = per_chip(3 + (model_cfg.remat == "full")) if name == "gradients" else None
      report["programs"][f"train/{name}"] = program_report(
          compiled, seconds, chip, flops, per_chip(3) if flops else None)
    report["train_peak_gb"] = train_peak(report["programs"], state, chip)
  if "critic" in programs and config.rl.advantage in advantages.CRITIC_ADVANTAGES:
    critic = critic_lib.Critic(model_cfg, optax.adam(config.rl.critic_lr),
                               config.rl.value_clip or None, mesh=mesh)
    cstate = critic.abstract()
    for name, (compiled, seconds) in critic.compile(cstate, mb).items():
      if isinstance(compiled, Exception):
        report["programs"][f"critic/{name}"] = out_of_memory(compiled, chip, seconds)
        continue
      flops = (per_chip(1) if name == "values"
               else per_chip(3 + (model_cfg.remat == "full")))
      report["programs"][f"critic/{name}"] = program_report(
          compiled, seconds, chip, flops, per_chip(1 if name == "values" else 3))
    resident = per_chip_bytes(cstate) / GB
    report["critic_peak_gb"] = resident_peak(report["programs"], ("critic/values",
                                                                   "critic/update"),
                                             per_chip_bytes(state) / GB, chip)
    report["critic_peak_gb"]["critic_state"] = round(resident, 4)
    if "train_peak_gb" in report:  # the policy's step runs beside the critic's state
      report["train_peak_gb"] = train_peak(report["programs"], state, chip, resident)
  if "score" in programs:
    score = step_lib.make_score_fn(model_cfg, mesh=mesh)
    t0 = time.perf_counter()
    try:
      compiled = score.lower(state, mb).compile()
      report["programs"]["score"] = program_report(compiled, time.perf_counter() - t0, chip,
                                                   per_chip(1))
    except jax.errors.JaxRuntimeError as e:
      report["programs"]["score"] = out_of_memory(e, chip, time.perf_counter() - t0)
  try:  # the engine's own layout of the same devices (`rl.engine_mesh_shape`)
    engine_mesh = rollouts.decode_mesh(config, mesh)
  except ValueError as e:
    raise config_lib.ConfigError(str(e)) from e
  if engine_mesh is not mesh:
    report["engine_mesh"] = dict(engine_mesh.shape)
  engine = [name for name in ("prefill", "decode") if name in programs]
  if engine:
    t0 = time.perf_counter()
    try:
      compiled = aot_engine.engine_programs(config, model_cfg, engine_mesh)
    except jax.errors.JaxRuntimeError as e:
      compiled = {}
      for name in engine:
        report["programs"][name] = out_of_memory(e, chip, time.perf_counter() - t0)
    engine_cfg = rollouts.engine_config(config, model_cfg)
    for name in engine if compiled else ():
      program, seconds, min_bytes = compiled[name]
      steps = engine_cfg.steps_per_call if name == "decode" else 1
      report["programs"][name] = engine_report(program, seconds, chip, min_bytes, steps,
                                               engine_cfg.slots)
  if "weight_sync" in programs:
    t0 = time.perf_counter()
    try:
      compiled, seconds, held = aot_engine.weight_sync_program(model_cfg, state, engine_mesh)
      report["programs"]["weight_sync"] = {**program_report(compiled, seconds, chip, None),
                                           "engine_bytes": held}
    except jax.errors.JaxRuntimeError as e:
      report["programs"]["weight_sync"] = out_of_memory(e, chip, time.perf_counter() - t0)
  return report


def per_chip_bytes(tree) -> float:
  """The bytes one chip holds of a tree of sharded arrays or ShapeDtypeStructs (int4 at half
  a byte)."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * storage_bits(x.dtype) / 8
             for x in jax.tree.leaves(tree))


def train_peak(programs: dict, state, chip: Chip, resident_gb: float = 0.0) -> dict:
  """The train step's per-chip HBM peak: the larger of its two programs, the accumulation
  counted with the optimizer state it does not take but that stays resident meanwhile.

  Args:
    programs: the report's programs ("train/gradients", "train/update").
    state: the abstract TrainState (its shardings give the optimizer state per chip).
    chip: the slice's Chip.
    resident_gb: what else stays in HBM meanwhile, per chip (a learned critic's state).

  Returns:
    {"total", "optimizer_state", "headroom", "fits"} in GB (and "resident" when given);
    "total" is the compiler's lower bound (its temporaries alone) for a program it refused.
  """
  opt = per_chip_bytes(state.opt_state) / GB
  hbm = [programs[name]["hbm_gb"] for name in ("train/gradients", "train/update")
         if name in programs]
  need = [h.get("total", h.get("temporaries", 0.0)) for h in hbm]
  total = max([need[0] + opt] + need[1:]) + resident_gb
  capacity = chip.hbm_bytes / GB
  return {"total": round(total, 3), "optimizer_state": round(opt, 4),
          "headroom": round(capacity - total, 3),
          "fits": bool(all(h["fits"] for h in hbm) and total <= capacity),
          **({"resident": round(resident_gb, 4)} if resident_gb else {})}


def resident_peak(programs: dict, names: Sequence[str], resident_gb: float, chip: Chip
                  ) -> dict:
  """The per-chip HBM peak of programs that run while other state stays resident (the
  critic's, beside the policy's TrainState).

  Returns:
    {"total", "resident", "headroom", "fits"} in GB.
  """
  hbm = [programs[name]["hbm_gb"] for name in names if name in programs]
  total = max(h.get("total", h.get("temporaries", 0.0)) for h in hbm) + resident_gb
  capacity = chip.hbm_bytes / GB
  return {"total": round(total, 3), "resident": round(resident_gb, 4),
          "headroom": round(capacity - total, 3),
          "fits": bool(all(h["fits"] for h in hbm) and total <= capacity)}


def out_of_memory(error: Exception, chip: Chip, seconds: float) -> dict:
  """The report of a program the compiler refused because it does not fit in HBM.

  Args:
    error: the compiler's error ("RESOURCE_EXHAUSTED: ... HLO temporaries (76.23G) exceeds
      available HBM (31.25G)"); any other error is raised again.
    chip: the slice's Chip.
    seconds: the time until the compiler gave up.

  Returns:
    {"hbm_gb": {"temporaries", "available", "capacity", "fits": False}, "error", "compile_s"}
    (GiB figures as the compiler states them, converted to GB).
  """
  message = str(error)
  if "RESOURCE_EXHAUSTED" not in message:
    raise error
  need = re.search(r"temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)", message)
  gib = 2**30 / GB
  hbm = {"capacity": chip.hbm_bytes / GB, "fits": False}
  if need:
    hbm.update(temporaries=round(float(need.group(1)) * gib, 2),
               available=round(float(need.group(2)) * gib, 2))
  return {"hbm_gb": hbm, "error": message.strip().splitlines()[0][:500],
          "compile_s": round(seconds, 2)}


def summary_lines(report: dict) -> list[str]:
  """One line per program: HBM total / capacity, roofline step and bound, MFU, compile time."""
  lines = [f"{report['topology']} ({report['chips']} chips), mesh {report['mesh']}"]
  for name, p in report["programs"].items():
    if "error" in p:
      lines.append(f"  {name}: does NOT fit: {p['error']}")
      continue
    hbm, roof = p["hbm_gb"], p["roofline_s"]
    coll = ", ".join(f"{k} x{v['count']} {v['bytes'] / GB:.2f} GB"
                     for k, v in sorted(p["collectives"].items())) or "none"
    extra = f", MFU {100 * p['mfu']:.0f}%" if p["mfu"] is not None else ""
    if "bytes_ratio" in p:
      extra += f", bytes accessed {p['bytes_ratio']:.1f}x the minimum"
    if "engine_bytes" in p:
      extra += f", the engine's copy {p['engine_bytes'] / GB:.2f} GB per chip"
    lines.append(f"  {name}: HBM {hbm['total']:.2f} / {hbm['capacity']:.0f} GB per chip "
                 f"({'fits' if hbm['fits'] else 'does NOT fit'}; temporaries "
                 f"{hbm['temporaries']:.2f}), roofline {1e3 * roof['step']:.1f} ms "
                 f"({roof['bound']}-bound{extra}), collectives: {coll}; compiled in "
                 f"{p['compile_s']:.0f} s")
  if "train_peak_gb" in report:
    peak = report["train_peak_gb"]
    lines.append(f"  train step peak (with the resident optimizer state"
                 f"{' and critic' if 'resident' in peak else ''}): {peak['total']:.2f} GB "
                 f"per chip, headroom {peak['headroom']:.2f} GB")
  if "critic_peak_gb" in report:
    peak = report["critic_peak_gb"]
    lines.append(f"  critic peak (with the resident policy state): {peak['total']:.2f} GB per "
                 f"chip, headroom {peak['headroom']:.2f} GB; the critic's state "
                 f"{peak['critic_state']:.2f} GB per chip")
  return lines


def _define_flags() -> dict:
  """The command line's flags (defined only when run as a program: trainer.main, imported in
  the same process, owns --config there)."""
  return {
      "config": config_flags.DEFINE_config_file("config", None,
                                                "The run's config file (sft/rl/distill)."),
      "topology": flags.DEFINE_string("topology", None, "The TPU slice, e.g. v5p:2x2x2, v6e:4x4."),
      "programs": flags.DEFINE_list("programs", list(PROGRAMS), f"Which of {PROGRAMS}."),
      "out": flags.DEFINE_string("out", None, "Also write the report as JSON to this file."),
      "search": flags.DEFINE_bool("search", False, "When the train step does not fit, compile "
                                  "the most promising other layouts (mesh, micro-batches, "
                                  "remat, chunks) and name the best that fits "
                                  "(trainer.aot_search)."),
      "search_all": flags.DEFINE_bool("search_all", False, "With --search: search even when "
                                      "the config's train step fits."),
      "search_budget": flags.DEFINE_integer("search_budget", aot_search.BUDGET,
                                            "With --search: compiles at most."),
      "search_fits": flags.DEFINE_integer("search_fits", aot_search.ENOUGH, "With --search: "
                                          "stop once this many layouts fit in 90% of HBM "
                                          "(the config's own included)."),
  }


def _planned(program: dict) -> bool:
  """Whether a compiled program fits within the planning line (`aot_search.FIT_FRACTION`)."""
  hbm = program["hbm_gb"]  # a refused program's has no total
  return bool(hbm["fits"] and hbm.get("total", math.inf)
              <= aot_search.FIT_FRACTION * hbm["capacity"])


def main(argv, cli: dict) -> None:
  """Compiles, prints a summary line per program, writes the JSON report.

  Args:
    argv: what absl left (unused).
    cli: the flag holders of `_define_flags`.
  """
  del argv
  config, topology = cli["config"].value, cli["topology"].value
  if config is None or topology is None:
    raise app.UsageError("--config and --topology are required")
  try:
    report = compile_run(config, topology, cli["programs"].value)
  except config_lib.ConfigError as e:
    print(f"config error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  print("\n".join(summary_lines(report)), flush=True)
  if cli["search"].value:
    report["search"] = aot_search.search(
        config, topology, report, compile_fn=compile_run, budget=cli["search_budget"].value,
        enough=cli["search_fits"].value, explore=cli["search_all"].value)
    print("\n".join(aot_search.summary_lines(report["search"])
                    or ["search: the train step fits (--search_all searches anyway)"]),
          flush=True)
    decode = report["programs"].get("decode")
    if decode is not None and (cli["search_all"].value or not _planned(decode)):
      report["engine_search"] = aot_engine_search.search(
          config, topology, report, compile_fn=compile_run, topology_devices=topology_devices)
      print("\n".join(aot_engine_search.summary_lines(report["engine_search"])), flush=True)
  if cli["out"].value:
    with open(cli["out"].value, "w") as f:
      json.dump(report, f, indent=1)
    print(f"wrote {cli['out'].value}")


if __name__ == "__main__":
  _cli = _define_flags()
  app.run(lambda argv: main(argv, _cli))
