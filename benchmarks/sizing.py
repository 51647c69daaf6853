"""Sizing arithmetic behind docs/scaling.md: memory per chip, roofline step time, rollout
throughput and the sandbox fleet that keeps a trainer busy. Pure arithmetic (no JAX).

    python -m benchmarks.sizing            # print the generated tables
    python -m benchmarks.sizing --write    # rewrite the generated block of docs/scaling.md
    python -m benchmarks.sizing --json     # every number as JSON

Every number in the generated block of docs/scaling.md comes from `render()`;
tests/test_sizing.py checks that the block equals it. Model dimensions come from
models/presets.py (the published Hugging Face configs). The model of memory, FLOPs and traffic
is stated next to each function; docs/scaling.md explains the choices. One module because
`render()` writes one generated block from all of it (memory, step time, rollouts, sandboxes
share the model and mesh arithmetic); its sections follow the block's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from typing import Optional

from models.config import ModelConfig
from models.hardware import CHIPS, GB, Chip
from models.presets import count_active_params, count_params, get_preset

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                   "scaling.md")
START, END = "<!-- sizing:start -->", "<!-- sizing:end -->"


# ---------------------------------------------------------------------------------------------
# Hardware: models/hardware.py (sources in docs/scaling.md)

HBM_USABLE = 0.9  # fraction of HBM a plan may fill (XLA scratch, fragmentation)

# e2-standard-8: 8 vCPUs, 32 GB (cloud.google.com/compute/docs/general-purpose-machines).
VM_VCPUS, VM_MEMORY_GB, VM_RESERVED_GB = 8, 32, 4


# ---------------------------------------------------------------------------------------------
# Workload (the stated episode profile; docs/scaling.md §Assumptions)


@dataclasses.dataclass(frozen=True)
class Episode:
  prompt: int = 2000  # tokens: system prompt + task statement
  turns: int = 20  # policy calls per episode
  gen: int = 400  # tokens sampled per call
  obs: int = 1000  # tool-output tokens appended after each call but the last
  tool_cpu_s: float = 1.0  # CPU seconds of one tool call inside the sandbox
  verify_s: float = 0.92  # wall (= CPU) seconds of the final test run

  @property
  def tree_tokens(self) -> int:
    """Tokens of one trajectory as a trie: each call extends the previous one."""
    return self.prompt + self.turns * self.gen + (self.turns - 1) * self.obs

  @property
  def linear_tokens(self) -> int:
    """Tokens if every call were trained as its own sequence (input + output)."""
    return sum(self.prompt + i * (self.gen + self.obs) + self.gen for i in range(self.turns))

  @property
  def loss_fraction(self) -> float:
    return self.turns * self.gen / self.tree_tokens

  @property
  def mean_call_context(self) -> float:
    """Average input length of a call (what decoding attends to)."""
    return sum(self.prompt + i * (self.gen + self.obs) for i in range(self.turns)) / self.turns

  @property
  def prefill_tokens(self) -> int:
    """New input tokens per trajectory with a prefix cache: the prompt, then observations."""
    return self.prompt + (self.turns - 1) * self.obs


TOY = Episode()  # bundled SWE tasks: verify time measured (docs/scaling.md)
SWE = Episode(tool_cpu_s=3.0, verify_s=60.0)  # real repositories: stated, heavier

ROW = 32768  # training row length (tokens)
TRAJ_PER_STEP = 256  # trajectories per RL step (32 tasks x G=8)
LOGITS_CHUNK = 1024  # models.config logits_chunk
PLANNING_EFFICIENCY = 0.5  # fraction of the roofline a well-tuned step reaches (planning)

# Measured on this project's 2-core CI VM (docs/benchmarks.md "sandbox", 2026-11-23):
BWRAP_LIFECYCLES_PER_S = 67.5  # create + exec + close, 4 concurrent, 2 cores
BWRAP_EXEC_MEDIAN_S = 0.02649  # one `true` exec in a live sandbox
BENCH_CORES = 2
SANDBOX_MEMORY_GB = 1.0  # envs.sandbox Limits.memory_mb default (1024)


# ---------------------------------------------------------------------------------------------
# Parameters by sharding class


@dataclasses.dataclass(frozen=True)
class Leaf:
  name: str
  count: int  # parameters, all layers
  axes: tuple[str, ...]  # mesh axes the leaf is sharded over (logical rules, data = 1)
  muon: bool  # Muon branch (matrices) or AdamW branch (embeddings, lm_head, router, norms)
  layer_kind: str  # "dense", "moe", "attn" (every layer) or "" (not per layer)


def leaves(cfg: ModelConfig) -> list[Leaf]:
  """The parameter groups of `cfg` with their sharding under DEFAULT_SHARDING_RULES
  (embed -> fsdp, heads/mlp/vocab/expert_mlp -> tensor, experts -> expert)."""
  h, v, n = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
  out = [Leaf("embedding", v * h, ("fsdp", "tensor"), False, "")]
  if not cfg.tie_embeddings:
    out.append(Leaf("lm_head", v * h, ("fsdp", "tensor"), False, ""))
  norms = h + n * 2 * h
  if cfg.attention == "gqa":
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out.append(Leaf("attention q,k,v,o", n * (2 * h * q + 2 * h * kv), ("fsdp", "tensor"),
                    True, "attn"))
    if cfg.qkv_bias:
      out.append(Leaf("q/k/v biases", n * (q + 2 * kv), ("tensor",), False, "attn"))
    if cfg.qk_norm:
      norms += n * 2 * cfg.head_dim
  else:
    nh, qk = cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    kvr = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    if cfg.q_lora_rank:
      out.append(Leaf("MLA q_a, kv_a", n * (h * cfg.q_lora_rank + h * kvr), ("fsdp",), True,
                      "attn"))
      out.append(Leaf("MLA q_b, kv_b", n * (cfg.q_lora_rank * nh * qk + cfg.kv_lora_rank * nh *
                                            (cfg.qk_nope_head_dim + cfg.v_head_dim)),
                      ("tensor",), True, "attn"))
      norms += n * (cfg.q_lora_rank + cfg.kv_lora_rank)
    else:
      out.append(Leaf("MLA q, kv_a", n * (h * nh * qk + h * kvr), ("fsdp",), True, "attn"))
      out.append(Leaf("MLA kv_b", n * cfg.kv_lora_rank * nh * (cfg.qk_nope_head_dim +
                                                                 cfg.v_head_dim),
                      ("tensor",), True, "attn"))
      norms += n * cfg.kv_lora_rank
    out.append(Leaf("MLA o", n * nh * cfg.v_head_dim * h, ("fsdp", "tensor"), True, "attn"))
  out.append(Leaf("dense MLP", cfg.num_dense_layers * 3 * h * cfg.intermediate_size,
                  ("fsdp", "tensor"), True, "dense"))
  if cfg.is_moe:
    m, e = cfg.moe_intermediate_size, cfg.num_moe_layers
    out.append(Leaf("router", e * h * cfg.num_experts, ("fsdp", "expert"), False, "moe"))
    out.append(Leaf("routed experts", e * cfg.num_experts * 3 * h * m,
                    ("expert", "fsdp", "tensor"), True, "moe"))
    if cfg.num_shared_experts:
      out.append(Leaf("shared experts", e * cfg.num_shared_experts * 3 * h * m,
                      ("fsdp", "tensor"), True, "moe"))
  out.append(Leaf("norm gains", norms, (), False, ""))
  return [leaf for leaf in out if leaf.count]


def total_params(cfg: ModelConfig) -> int:
  return sum(leaf.count for leaf in leaves(cfg))


def active_matmul_params(cfg: ModelConfig) -> float:
  """Parameters one token multiplies through in the blocks (no embedding gather, no lm_head)."""
  active = count_active_params(cfg) - cfg.vocab_size * cfg.hidden_size * (
      1 if cfg.tie_embeddings else 2)
  norms = next(leaf.count for leaf in leaves(cfg) if leaf.name == "norm gains")
  return active - norms


# ---------------------------------------------------------------------------------------------
# Meshes, memory, step time


@dataclasses.dataclass(frozen=True)
class Mesh:
  fsdp: int
  tensor: int
  expert: int

  @property
  def chips(self) -> int:
    return self.fsdp * self.tensor * self.expert

  def size(self, axes) -> int:
    return math.prod(getattr(self, a) for a in axes)

  @property
  def batch_shards(self) -> int:
    """Rows in flight per micro-batch: one row per (data x fsdp x expert) shard. For MoE this
    shards the batch over `expert` as well (the `batch` rule: data, fsdp, expert)."""
    return self.fsdp * self.expert

  def __str__(self) -> str:
    return f"fsdp {self.fsdp} x tensor {self.tensor}" + (
        f" x expert {self.expert}" if self.expert > 1 else "")


def per_layer_dot_values(cfg: ModelConfig, t: int) -> tuple[float, float]:
  """(dense-layer, MoE-layer) matmul outputs per token per chip, attention included: what
  the `save_dots` policy keeps. Head/MLP widths are split over tensor; d is replicated."""
  h = cfg.hidden_size
  if cfg.attention == "gqa":
    attn = (cfg.num_heads * cfg.head_dim + 2 * cfg.num_kv_heads * cfg.head_dim) / t + h
  else:
    nh = cfg.num_heads
    attn = ((cfg.q_lora_rank or 0) + cfg.kv_lora_rank + cfg.qk_rope_head_dim
            + nh * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) / t
            + nh * (cfg.qk_nope_head_dim + cfg.v_head_dim) / t + h)
  dense = attn + 2 * cfg.intermediate_size / t + h
  if not cfg.is_moe:
    return dense, dense
  m, k = cfg.moe_intermediate_size, cfg.experts_per_token
  moe = (attn + 2 * cfg.num_experts  # router logits, fp32 = 2 bf16 values
         + k * (2 * m / t + h) + cfg.num_shared_experts * 2 * m / t + h)
  return dense, moe


@dataclasses.dataclass(frozen=True)
class Plan:
  model: str
  tpu: str
  chips: int
  mesh: Mesh
  remat: str
  optimizer: str
  memory: dict  # GB per chip by item
  fits: bool
  micro_batches: int
  step: dict  # seconds by item


def gathered_layer_bytes(cfg: ModelConfig, mesh: Mesh) -> float:
  """bf16 bytes of the largest layer's weights on a chip after the FSDP all-gather (a layer is
  its attention plus a dense MLP or a MoE block)."""
  per = {"attn": 0.0, "dense": 0.0, "moe": 0.0}
  layers = {"attn": cfg.num_layers, "dense": cfg.num_dense_layers, "moe": cfg.num_moe_layers}
  for leaf in leaves(cfg):
    if leaf.layer_kind and "fsdp" in leaf.axes and layers[leaf.layer_kind]:
      per[leaf.layer_kind] += 2 * leaf.count / layers[leaf.layer_kind] / mesh.size(
          [a for a in leaf.axes if a != "fsdp"])
  return per["attn"] + max(per["dense"], per["moe"])


def gathered_model_bytes(cfg: ModelConfig, mesh: Mesh) -> float:
  """bf16 bytes a chip reads per pass over all layers (each layer gathered over fsdp)."""
  return sum(2 * leaf.count / mesh.size([a for a in leaf.axes if a != "fsdp"])
             for leaf in leaves(cfg) if leaf.layer_kind)


def memory_per_chip(cfg: ModelConfig, mesh: Mesh, remat: str, optimizer: str,
                    state_bytes: int = 4) -> dict:
  """GB per chip: params fp32, grads fp32, optimizer state, gathered bf16 weights (FSDP
  prefetch: two layers), saved activations and one layer's backward working set."""
  mem = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
  for leaf in leaves(cfg):
    local = leaf.count / mesh.size(leaf.axes)
    mem["params"] += 4 * local
    mem["grads"] += 4 * local
    moments = 1 if (optimizer == "muon" and leaf.muon) else 2
    mem["optimizer"] += moments * state_bytes * local
  mem["gathered weights"] = 2 * gathered_layer_bytes(cfg, mesh)
  tokens = ROW  # one row per batch shard
  dense_v, moe_v = per_layer_dot_values(cfg, mesh.tensor)
  h = cfg.hidden_size
  if remat == "full":
    saved = cfg.num_layers * tokens * h * 2
  else:  # save_dots: matmul outputs of every layer, plus the residual
    saved = tokens * 2 * (cfg.num_dense_layers * (dense_v + h) + cfg.num_moe_layers * (moe_v + h))
  mem["activations"] = saved
  mem["layer working set"] = 2 * tokens * 2 * max(dense_v, moe_v)  # values and their grads
  mem["logits chunk"] = 3 * LOGITS_CHUNK * cfg.vocab_size / mesh.tensor * 4
  return {k: v / GB for k, v in mem.items()}


def muon_ns_flops(cfg: ModelConfig) -> float:
  """Newton-Schulz FLOPs of one Muon update (5 iterations, 4 m^2 n + 2 m^3 each, m <= n)."""
  def ns(a: int, b: int, batch: int) -> float:
    m, n = min(a, b), max(a, b)
    return batch * 5 * (4 * m * m * n + 2 * m ** 3)
  h, n = cfg.hidden_size, cfg.num_layers
  total = 0.0
  if cfg.attention == "gqa":
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    total += ns(h, q, n) * 2 + ns(h, kv, n) * 2
  else:
    nh, qk = cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.q_lora_rank:
      total += ns(h, cfg.q_lora_rank, n) + ns(cfg.q_lora_rank, nh * qk, n)
    else:
      total += ns(h, nh * qk, n)
    total += ns(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, n)
    total += ns(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), n)
    total += ns(nh * cfg.v_head_dim, h, n)
  total += 3 * ns(h, cfg.intermediate_size, cfg.num_dense_layers)
  if cfg.is_moe:
    total += 3 * ns(h, cfg.moe_intermediate_size, cfg.num_moe_layers * (
        cfg.num_experts + cfg.num_shared_experts))
  return total


def step_time(cfg: ModelConfig, chip: Chip, mesh: Mesh, remat: str, optimizer: str,
              episode: Episode = TOY) -> dict:
  """Roofline seconds of one RL step (TRAJ_PER_STEP trajectories, one per ROW-token row).

  Per micro-batch and chip: compute = FLOPs / peak; HBM = weight and saved-activation traffic
  / bandwidth; ICI = FSDP all-gathers (bf16) + gradient reduce-scatter (fp32) + MoE
  all-to-all, / ICI bandwidth. A micro-batch takes the largest of the three (perfect overlap);
  the optimizer update (HBM traffic + Newton-Schulz FLOPs) is added once per step.
  """
  passes = 3 + (1 if remat == "full" else 0)  # fwd + 2x bwd (+ recomputed fwd)
  rows = mesh.batch_shards
  micro = math.ceil(TRAJ_PER_STEP / rows)
  tokens = rows * ROW  # matmul tokens per micro-batch (padding included)
  real = rows * episode.tree_tokens
  mm = 2 * active_matmul_params(cfg) * tokens * passes
  head = 2 * cfg.vocab_size * cfg.hidden_size * real * episode.loss_fraction * 3
  ctx = episode.tree_tokens / 2  # mean keys per query on a causal trajectory
  attn = (2 * cfg.num_layers * cfg.num_heads * (cfg.qk_head_dim + cfg.value_head_dim) * ctx *
          real * passes)
  flops_chip = (mm + head + attn) / mesh.chips
  compute = flops_chip / chip.peak_flops
  mem = memory_per_chip(cfg, mesh, remat, optimizer)
  # Every chip reads the gathered weights of each layer on every pass.
  weight_reads = gathered_model_bytes(cfg, mesh) * passes
  act_traffic = 2 * mem["activations"] * GB
  hbm = (weight_reads + act_traffic) / chip.hbm_bw
  gather = sum(2 * leaf.count / mesh.size(leaf.axes) * (mesh.fsdp - 1)
               for leaf in leaves(cfg) if "fsdp" in leaf.axes) * (passes - 1)
  scatter = sum(4 * leaf.count / mesh.size(leaf.axes) * (mesh.fsdp - 1)
                for leaf in leaves(cfg) if "fsdp" in leaf.axes)
  a2a = 0.0
  if cfg.is_moe and mesh.expert > 1:
    a2a = (ROW * cfg.experts_per_token * cfg.hidden_size * 2 * 2 * passes * cfg.num_moe_layers
           * (mesh.expert - 1) / mesh.expert)
  # Tensor parallelism: an all-reduce (reduce-scatter + all-gather) of the residual stream
  # after attention and after the MLP of every layer, on every pass.
  tp = 0.0
  if mesh.tensor > 1:
    tp = (2 * 2 * cfg.num_layers * passes * ROW * cfg.hidden_size * 2
          * (mesh.tensor - 1) / mesh.tensor)
  ici = (gather + scatter + a2a + tp) / chip.ici_bw
  # Read params, grads and moments; write params and moments.
  opt_bytes = (mem["params"] * 2 + mem["grads"]) * GB + mem["optimizer"] * GB * 2
  opt = opt_bytes / chip.hbm_bw
  if optimizer == "muon":
    opt += muon_ns_flops(cfg) / mesh.chips / chip.peak_flops
  per_micro = max(compute, hbm, ici)
  total = micro * per_micro + opt
  return {"micro_batches": micro, "compute": compute, "hbm": hbm, "ici": ici,
          "optimizer": opt, "roofline": total, "planning": total / PLANNING_EFFICIENCY,
          "tokens_per_s": TRAJ_PER_STEP * episode.tree_tokens / total,
          "bound": max((compute, "compute"), (hbm, "HBM"), (ici, "ICI"))[1]}


def slice_chips(tpu: str) -> tuple[Chip, int]:
  gen, n = tpu.split("-")
  chip = CHIPS[gen]
  return chip, int(n) // chip.cores_per_chip


def candidate_meshes(cfg: ModelConfig, chips: int) -> list[Mesh]:
  heads = cfg.num_kv_heads if cfg.attention == "gqa" else cfg.num_heads
  out = []
  for t in (1, 2, 4, 8):
    if heads % t:
      continue
    for e in ((1,) if not cfg.is_moe else (1, 8, 16, 32, 64, 128, 256)):
      if cfg.is_moe and cfg.num_experts % e:
        continue
      if chips % (t * e):
        continue
      out.append(Mesh(chips // (t * e), t, e))
  return out


def plan(model: str, tpu: str, optimizer: str = "muon") -> Plan:
  """The fitting (mesh, remat) with the smallest roofline step time (ties within 0.1 s: less
  tensor, then expert parallelism); if none fits, the one with the least memory (reported as
  not fitting)."""
  cfg = get_preset(model)
  chip, chips = slice_chips(tpu)
  plans = []
  for mesh in candidate_meshes(cfg, chips):
    for remat in ("save_dots", "full"):
      mem = memory_per_chip(cfg, mesh, remat, optimizer)
      st = step_time(cfg, chip, mesh, remat, optimizer)
      plans.append(Plan(model, tpu, chips, mesh, remat, optimizer, mem,
                        sum(mem.values()) <= HBM_USABLE * chip.hbm_bytes / GB,
                        st["micro_batches"], st))
  fitting = [p for p in plans if p.fits]
  if fitting:
    return min(fitting, key=lambda p: (round(p.step["roofline"], 1), p.mesh.tensor,
                                       p.mesh.expert))
  return min(plans, key=lambda p: sum(p.memory.values()))


# ---------------------------------------------------------------------------------------------
# Generation (rollouts) and the sandbox fleet


def kv_bytes_per_token(cfg: ModelConfig) -> float:
  """bf16 decode cache per token, all layers: GQA K+V; MLA latent + rotary key."""
  if cfg.attention == "gqa":
    per_layer = 2 * cfg.num_kv_heads * cfg.head_dim
  else:
    per_layer = cfg.kv_lora_rank + cfg.qk_rope_head_dim
  return 2 * per_layer * cfg.num_layers


@dataclasses.dataclass(frozen=True)
class Engine:
  model: str
  chip: str
  chips: int  # one engine replica (tensor parallel)
  batch: int  # sequences decoding together
  step_s: float  # one decode step
  decode_tps: float  # tokens/s of the replica
  prefill_s_per_traj: float
  engine_s_per_traj: float  # replica-seconds of generation per trajectory


def engine(model: str, chip_name: str, episode: Episode = TOY, max_batch: int = 512) -> Engine:
  """Smallest replica (1, 4, 8, 16, ... chips) whose HBM holds the bf16 weights in half of
  its usable memory; batch = as many sequences at the longest context as the rest holds."""
  cfg, chip = get_preset(model), CHIPS[chip_name]
  weights = 2 * count_params(cfg)
  n = 1
  while weights > 0.5 * HBM_USABLE * chip.hbm_bytes * n:
    n = 4 if n == 1 else 2 * n
  free = HBM_USABLE * chip.hbm_bytes * n - weights
  batch = int(min(max_batch, free // (kv_bytes_per_token(cfg) * episode.tree_tokens)))
  if cfg.is_moe:  # distinct experts a step touches, routing uniform
    touched = cfg.num_experts * (1 - (1 - cfg.experts_per_token / cfg.num_experts) ** batch)
    expert_bytes = 2 * 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_moe_layers
    read = weights - expert_bytes * (cfg.num_experts - touched)
  else:
    read = weights
  kv = batch * episode.mean_call_context * kv_bytes_per_token(cfg)
  mem_s = (read + kv) / (n * chip.hbm_bw)
  flop_s = batch * 2 * count_active_params(cfg) / (n * chip.peak_flops)
  step = max(mem_s, flop_s)
  tps = batch / step
  prefill = (2 * count_active_params(cfg) * episode.prefill_tokens
             + 2 * cfg.num_layers * cfg.num_heads * (cfg.qk_head_dim + cfg.value_head_dim)
             * episode.prefill_tokens * episode.tree_tokens / 2) / (n * chip.peak_flops)
  per_traj = episode.turns * episode.gen / tps + prefill
  return Engine(model, chip_name, n, batch, step, tps, prefill, per_traj)


@dataclasses.dataclass(frozen=True)
class Fleet:
  profile: str
  trajectories_per_s: float
  episode_wall_s: float
  concurrent_episodes: float
  cpu_s_per_episode: float
  sandboxes_per_vm: int
  vms_for_concurrency: int
  vms_for_cpu: int
  vms: int
  gen_chips: int


def fleet(p: Plan, episode: Episode, profile: str, cpu_target: float = 0.75) -> Fleet:
  """Sandbox VMs (e2-standard-8) that keep plan `p`'s trainer busy at its planning step time.

  Little's law: episodes in flight = trajectories/s x episode wall time. A VM holds
  (memory - reserve) / sandbox memory sandboxes and gives `cpu_target` of its vCPUs to tools.
  """
  rate = TRAJ_PER_STEP / p.step["planning"]
  eng = engine(p.model, p.tpu.split("-")[0], episode)
  call_s = episode.gen * eng.step_s + eng.prefill_s_per_traj / episode.turns
  exec_overhead = BWRAP_EXEC_MEDIAN_S
  episode_s = (episode.turns * (call_s + episode.tool_cpu_s + exec_overhead)
               + episode.verify_s)
  lifecycle_cpu = BENCH_CORES / BWRAP_LIFECYCLES_PER_S  # core-seconds per sandbox
  cpu_s = (episode.turns * (episode.tool_cpu_s + exec_overhead) + episode.verify_s
           + 2 * lifecycle_cpu)  # the episode's sandbox and the verifier's
  per_vm = int((VM_MEMORY_GB - VM_RESERVED_GB) // SANDBOX_MEMORY_GB)
  concurrent = rate * episode_s
  by_conc = math.ceil(concurrent / per_vm)
  by_cpu = math.ceil(rate * cpu_s / (VM_VCPUS * cpu_target))
  gen_chips = math.ceil(rate * eng.engine_s_per_traj) * eng.chips
  return Fleet(profile, rate, episode_s, concurrent, cpu_s, per_vm, by_conc, by_cpu,
               max(by_conc, by_cpu), gen_chips)


# ---------------------------------------------------------------------------------------------
# Report

CASES = [("qwen2.5-coder-7b", "v5p-64"), ("qwen2.5-coder-7b", "v6e-64"),
         ("qwen2.5-coder-32b", "v5p-128"), ("qwen2.5-coder-32b", "v6e-256"),
         ("deepseek-v3", "v5p-1024"), ("deepseek-v3", "v6e-256")]


def _b(x: float) -> str:
  return f"{x / 1e9:.2f}B"


def _f(x: float, nd: int = 1) -> str:
  return f"{x:,.{nd}f}"


def render() -> str:
  """The generated block of docs/scaling.md (markdown)."""
  out = []
  e = TOY
  out.append("### Episode profile and tokens\n")
  out.append("| quantity | value |\n|---|---|")
  for k, v in [("prompt / turns / sampled per call / observation per turn (tokens)",
                f"{e.prompt} / {e.turns} / {e.gen} / {e.obs}"),
               ("trajectory as a tree (trained tokens)", f"{e.tree_tokens:,}"),
               ("same trajectory linearized (each call its own sequence)",
                f"{e.linear_tokens:,} ({e.linear_tokens / e.tree_tokens:.1f}x)"),
               ("loss tokens / tree tokens", f"{e.loss_fraction:.3f}"),
               ("mean call context (decode attends to)", f"{e.mean_call_context:,.0f}"),
               ("prefill tokens per trajectory with a prefix cache", f"{e.prefill_tokens:,}"),
               ("row length / trajectories per step", f"{ROW:,} / {TRAJ_PER_STEP}")]:
    out.append(f"| {k} | {v} |")

  out.append("\n### Parameters\n")
  out.append("| model | total | active per token | Muon leaves | AdamW leaves |\n"
             "|---|---|---|---|---|")
  for model in ("qwen2.5-coder-7b", "qwen2.5-coder-32b", "deepseek-v3"):
    cfg = get_preset(model)
    muon = sum(l.count for l in leaves(cfg) if l.muon)
    out.append(f"| {model} | {_b(total_params(cfg))} | {_b(count_active_params(cfg))} | "
               f"{_b(muon)} | {_b(total_params(cfg) - muon)} |")

  out.append("\n### Training: mesh, memory per chip (GB), roofline step (estimates)\n")
  out.append("| model | slice (chips) | mesh | remat | params | grads | Muon state | gathered "
             "| activations | working set | total / usable | fits |\n"
             "|---|---|---|---|---|---|---|---|---|---|---|---|")
  plans = [plan(m, t) for m, t in CASES]
  for p in plans:
    m, chip = p.memory, CHIPS[p.tpu.split("-")[0]]
    total = sum(m.values())
    out.append(f"| {p.model} | {p.tpu} ({p.chips}) | {p.mesh} | {p.remat} | "
               f"{m['params']:.1f} | {m['grads']:.1f} | {m['optimizer']:.1f} | "
               f"{m['gathered weights']:.1f} | {m['activations']:.1f} | "
               f"{m['layer working set'] + m['logits chunk']:.1f} | "
               f"{total:.1f} / {HBM_USABLE * chip.hbm_bytes / GB:.1f} | "
               f"{'yes' if p.fits else 'no'} |")
  out.append("\n| model | slice | micro-batches | compute s | HBM s | ICI s | bound | optimizer s "
             "| roofline step s | planning step s (x2) | tokens/s (roofline) |\n"
             "|---|---|---|---|---|---|---|---|---|---|---|")
  for p in plans:
    s = p.step
    if not p.fits:
      out.append(f"| {p.model} | {p.tpu} | - | - | - | - | - | - | does not fit | - | - |")
      continue
    out.append(f"| {p.model} | {p.tpu} | {s['micro_batches']} | {s['compute']:.2f} | "
               f"{s['hbm']:.2f} | {s['ici']:.2f} | {s['bound']} | {s['optimizer']:.2f} | "
               f"{s['roofline']:.1f} | {s['planning']:.1f} | {_f(s['tokens_per_s'], 0)} |")

  out.append("\n### Optimizer state per chip (GB) for the chosen meshes (estimates)\n")
  out.append("| model | slice | AdamW fp32 | AdamW bf16 | Muon fp32 | Muon bf16 |\n"
             "|---|---|---|---|---|---|")
  for p in plans:
    cfg = get_preset(p.model)
    vals = [memory_per_chip(cfg, p.mesh, p.remat, o, b)["optimizer"]
            for o, b in (("adamw", 4), ("adamw", 2), ("muon", 4), ("muon", 2))]
    out.append(f"| {p.model} | {p.tpu} | " + " | ".join(f"{v:.1f}" for v in vals) + " |")

  out.append("\n### Generation (one engine replica, decode roofline; estimates)\n")
  out.append("Compiled: each plan's engine decoding on its whole slice (HBM per chip, bytes "
             "per step against the floor, roofline step, tokens per second) is in \"Compiled "
             "for the slice\", \"Decode\"; this table sizes one replica by arithmetic.\n")
  out.append("| model | chip | replica chips | batch | decode step ms | tokens/s per replica | "
             "replica-s per trajectory |\n|---|---|---|---|---|---|---|")
  for model, tpu in CASES:
    if not plan(model, tpu).fits:
      continue
    g = engine(model, tpu.split("-")[0])
    out.append(f"| {model} | {g.chip} | {g.chips} | {g.batch} | {g.step_s * 1e3:.2f} | "
               f"{_f(g.decode_tps, 0)} | {g.engine_s_per_traj:.2f} |")

  out.append("\n### Sandbox fleet that keeps the trainer busy (e2-standard-8; estimates)\n")
  out.append("| model | slice | profile | trajectories/s | episode wall s | episodes in flight | "
             "CPU s / episode | VMs (memory) | VMs (CPU) | VMs | generation chips |\n"
             "|---|---|---|---|---|---|---|---|---|---|---|")
  for p in plans:
    if not p.fits:
      continue
    for name, ep in (("toy", TOY), ("swe", SWE)):
      f = fleet(p, ep, name)
      out.append(f"| {p.model} | {p.tpu} | {name} | {f.trajectories_per_s:.2f} | "
                 f"{f.episode_wall_s:.0f} | {f.concurrent_episodes:.0f} | "
                 f"{f.cpu_s_per_episode:.1f} | {f.vms_for_concurrency} | {f.vms_for_cpu} | "
                 f"{f.vms} | {f.gen_chips} |")
  return "\n".join(out) + "\n"


def numbers() -> dict:
  """Everything as JSON-able data (for --json and tests)."""
  plans = [plan(m, t) for m, t in CASES]
  return {"plans": [{**dataclasses.asdict(p), "mesh": str(p.mesh)} for p in plans],
          "engines": [dataclasses.asdict(engine(m, t.split("-")[0])) for m, t in CASES
                      if plan(m, t).fits],
          "fleets": [dataclasses.asdict(fleet(p, ep, n)) for p in plans if p.fits
                     for n, ep in (("toy", TOY), ("swe", SWE))]}


def doc_block(path: str = DOC) -> Optional[str]:
  with open(path) as f:
    text = f.read()
  m = re.search(re.escape(START) + r"\n(.*?)" + re.escape(END), text, re.S)
  return m.group(1) if m else None


def write(path: str = DOC) -> None:
  with open(path) as f:
    text = f.read()
  if START not in text or END not in text:
    raise SystemExit(f"{path}: markers {START} / {END} not found")
  head, rest = text.split(START, 1)
  _, tail = rest.split(END, 1)
  with open(path, "w") as f:
    f.write(head + START + "\n" + render() + END + tail)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--write", action="store_true", help="rewrite docs/scaling.md's block")
  p.add_argument("--json", action="store_true", help="print every number as JSON")
  a = p.parse_args(argv)
  if a.json:
    print(json.dumps(numbers(), indent=1, default=str))
  elif a.write:
    write()
    print(f"wrote {DOC}")
  else:
    sys.stdout.write(render())


if __name__ == "__main__":
  main()
