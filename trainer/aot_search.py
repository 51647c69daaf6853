"""Searching the layouts of a run's train step on a TPU slice (`python -m trainer.aot --search`).

A `Layout` is how the step is spread over the slice's chips and what it keeps in memory: the
mesh (fsdp, tensor, expert, sequence; `data` stays as configured), the rows per micro-batch
(with as many micro-batches as keep the step's rows, hence its tokens), the remat policy, the
residual stream split over `tensor` (`sharding_rules.act_embed`), the log-prob chunk
(`logits_chunk`) and, with expert parallelism, the dispatch round (`moe_dispatch_chunk`).

  candidates  every valid layout of a config on n chips (nothing compiled): tensor divides the
              heads (GQA: the key/value heads too), the vocabulary and the MLP widths; expert
              (MoE models with ragged experts) divides the experts; sequence divides the row
              length; rows per micro-batch are a multiple of the batch shards (data x fsdp x
              expert) that divides the step's rows. Remat only grows stronger than the config's
              (none < save_dots < full), chunks only smaller.
  estimate    per chip, from arithmetic: HBM (parameters, gradients and optimizer state from
              the model's own parameter shapes and sharding rules; a layer's weights gathered;
              the activations the remat policy saves; one layer's working set, with the MoE
              dispatch buffers; the gathered vocabulary tables and the logit chunks) and a
              step-time proxy (model and attention FLOPs at peak plus the collectives' bytes
              at ICI bandwidth, without overlap: FSDP gathers and gradient reduce-scatters,
              tensor all-reduces, expert all-to-alls or the global dispatch's token gathers,
              the sequence axis's K/V ring). On the compiled plans of docs/aot (dense, MoE,
              64K-128K rows) the HBM estimate is within 0.7x-1.4x of the compiled peak.
  rank        estimated to fit in `FIT_FRACTION` of HBM first, then the faster estimated step,
              then fewer changes from the config, then less estimated HBM.
  search      compiles the train step (`aot.compile_run`) in rank order, `budget` compiles at
              most, until `enough` layouts fit in `FIT_FRACTION` of HBM (the planning line of
              docs/scaling.md: the rest is XLA scratch and fragmentation). A layout a compile
              has already decided is not compiled: one that saves at least as much memory as a
              layout that fits under the line (the same mesh; rows, remat, residual split and
              chunks as light or lighter) fits too but is no faster; one that saves no more
              than a layout that does not fit does not fit.

The best plan is, among the compiled layouts that fit under the line (all that fit when none
does), the one with the fastest compiled roofline step (the accumulation's plus the update's,
`aot.program_report`); layouts within `TIE` of the fastest count as equally fast, and of those
the one with the fewest collective bytes per step wins, then the one with the most headroom.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import json
import math
import types
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from models import lora, presets, transformer
from models.config import ModelConfig
from models.hardware import GB, Chip, slice_chips, storage_bits
from models.sharding import MESH_AXES, param_spec
from trainer import config as config_lib
from trainer import optim
from trainer import state as state_lib

REMAT_ORDER = ("none", "save_dots", "full")  # weakest to strongest (least memory)
FIT_FRACTION = 0.9  # the share of HBM a plan may fill (estimated to rank, compiled to choose)
TIE = 0.05  # compiled steps within this fraction of the fastest count as equally fast
BUDGET = 6  # compiles at most (the config's own, compiled before, not counted)
ENOUGH = 2  # stop once this many layouts fit in FIT_FRACTION of HBM (the config's own included)
DISPATCH_CHUNK = 1024  # the smaller MoE dispatch round proposed (tokens per device)
MIN_LOGITS_CHUNK = 128  # the smallest log-prob chunk proposed
SKIPPED_SHOWN = 10  # layouts decided without compiling that the summary lists


@dataclasses.dataclass(frozen=True)
class Layout:
  """One way to run a config's train step on a slice (see the module docstring)."""

  mesh: tuple[int, ...]  # sizes of MESH_AXES (data, fsdp, tensor, expert, sequence)
  rows_per_batch: int  # rows per micro-batch
  microbatches: int  # micro-batches per step
  max_seqs: int  # sequences per micro-batch
  remat: str  # ModelConfig.remat
  split_residual: bool  # the residual stream (act_embed) split over tensor
  logits_chunk: int  # ModelConfig.logits_chunk
  dispatch_chunk: int  # ModelConfig.moe_dispatch_chunk (0 = one round)

  def size(self, axis: str) -> int:
    return self.mesh[MESH_AXES.index(axis)]

  @property
  def batch_shards(self) -> int:
    """The chips a micro-batch's rows are spread over (data x fsdp x expert)."""
    return self.size("data") * self.size("fsdp") * self.size("expert")

  def describe(self) -> str:
    """E.g. "fsdp 2 x expert 8, 16 rows x 1 micro-batch, remat full, logits_chunk 1024,
    dispatch_chunk 4096"."""
    mesh = " x ".join(f"{a} {n}" for a, n in zip(MESH_AXES, self.mesh) if n > 1) or "1 chip"
    plural = lambda n, word, suffix: f"{n} {word}{suffix if n > 1 else ''}"
    parts = [mesh, f"{plural(self.rows_per_batch, 'row', 's')} x "
             f"{plural(self.microbatches, 'micro-batch', 'es')}", f"remat {self.remat}"]
    if self.split_residual and self.size("tensor") > 1:
      parts.append("residual split over tensor")
    parts.append(f"logits_chunk {self.logits_chunk}")
    if self.size("expert") > 1:
      parts.append(f"dispatch_chunk {self.dispatch_chunk}")
    return ", ".join(parts)

  def lighter_or_equal(self, other: "Layout") -> bool:
    """Whether this layout keeps no more in memory than `other`: the same mesh, and rows per
    micro-batch, remat, residual split and chunks each as light or lighter."""
    strength = lambda r: REMAT_ORDER.index(r) if r in REMAT_ORDER else None
    remat = self.remat == other.remat or (
        None not in (strength(self.remat), strength(other.remat))
        and strength(self.remat) >= strength(other.remat))
    rounds = lambda c: c or math.inf  # 0: one round of all the tokens
    return (self.mesh == other.mesh and self.rows_per_batch <= other.rows_per_batch and remat
            and self.split_residual >= other.split_residual
            and self.logits_chunk <= other.logits_chunk
            and rounds(self.dispatch_chunk) <= rounds(other.dispatch_chunk))


@dataclasses.dataclass(frozen=True)
class Estimate:
  """The arithmetic's figures for a layout, per chip."""

  hbm_gb: float  # the train step's peak
  step_s: float  # the step-time proxy: compute + collectives, no overlap


# ----------------------------------------------------------------------------- candidates


def config_layout(config, num_devices: int) -> Layout:
  """The layout a config asks for on `num_devices` chips (its -1 mesh axis resolved)."""
  cfg = config_lib.model_config(config)
  d = config.data
  return Layout(mesh=tuple(config_lib.mesh_shape(config, num_devices)),
                rows_per_batch=d.rows_per_batch, microbatches=max(1, d.microbatches),
                max_seqs=d.max_seqs, remat=cfg.remat,
                split_residual=dict(cfg.sharding_rules).get("act_embed") == ("tensor",),
                logits_chunk=cfg.logits_chunk, dispatch_chunk=cfg.moe_dispatch_chunk)


def divisors(n: int) -> list[int]:
  """The positive divisors of n, ascending."""
  return [k for k in range(1, n + 1) if n % k == 0]


def tensor_divides(cfg: ModelConfig, tensor: int) -> bool:
  """Whether `tensor` splits the heads (GQA: key/value heads too), vocabulary and MLP widths."""
  sizes = [cfg.num_heads, cfg.vocab_size]
  sizes += [cfg.num_kv_heads] if cfg.attention == "gqa" else []
  sizes += [cfg.intermediate_size] if cfg.num_dense_layers else []
  sizes += [cfg.moe_intermediate_size] if cfg.is_moe else []
  return all(n % tensor == 0 for n in sizes)


def _expert_allowed(cfg: ModelConfig, expert: int) -> bool:
  """Whether the mesh's expert axis may be `expert`: > 1 only for a MoE model whose experts
  it divides, with ragged experts dispatched by all-to-all (not "global", not adapters on the
  routed experts); 1 unless the config asks for the all-to-all dispatch."""
  if expert == 1:
    return cfg.moe_dispatch != "all_to_all"
  return (cfg.is_moe and cfg.num_experts % expert == 0 and cfg.moe_impl == "ragged"
          and cfg.moe_dispatch != "global" and not cfg.lora_experts_on)


def candidates(config, num_devices: int) -> list[Layout]:
  """Every valid layout of a config's train step on `num_devices` chips.

  Args:
    config: the run's config (its mesh, data shape and model).
    num_devices: the slice's chips.

  Returns:
    The layouts with the config's `data` axis and rows per step (rows_per_batch x
    microbatches; the sequences per step likewise, rounded up per micro-batch), in a fixed
    order, the config's own among them (see the module docstring for what varies and the
    rules each obeys).
  """
  cfg = config_lib.model_config(config)
  base = config_layout(config, num_devices)
  data = base.size("data")
  rows, seqs = base.rows_per_batch * base.microbatches, base.max_seqs * base.microbatches
  remats = (REMAT_ORDER[REMAT_ORDER.index(cfg.remat):] if cfg.remat in REMAT_ORDER
            else (cfg.remat,))
  logits = [base.logits_chunk] + [base.logits_chunk // f for f in (2, 4)
                                  if base.logits_chunk // f >= MIN_LOGITS_CHUNK]
  residual_unset = dict(cfg.sharding_rules).get("act_embed") is None
  out = []
  rest = num_devices // data
  for tensor in filter(lambda t: tensor_divides(cfg, t), divisors(rest)):
    splits = (False, True) if (tensor > 1 and residual_unset
                               and cfg.hidden_size % tensor == 0) else (base.split_residual,)
    for expert in filter(lambda e: _expert_allowed(cfg, e), divisors(rest // tensor)):
      dispatch = [base.dispatch_chunk]
      if expert > 1 and (base.dispatch_chunk == 0 or base.dispatch_chunk > DISPATCH_CHUNK):
        dispatch.append(DISPATCH_CHUNK)
      for sequence in divisors(rest // tensor // expert):
        if config.data.row_len % sequence:
          continue
        fsdp = rest // (tensor * expert * sequence)
        shards = data * fsdp * expert
        for per_batch in range(shards, rows + 1, shards):
          if rows % per_batch:
            continue
          micro = rows // per_batch
          for remat, split, chunk, dchunk in itertools.product(remats, splits, logits, dispatch):
            out.append(Layout((data, fsdp, tensor, expert, sequence), per_batch, micro,
                              -(-seqs // micro), remat, split, chunk, dchunk))
  return out


def reasons(layout: Layout, base: Layout, cfg: ModelConfig, row_len: int) -> list[str]:
  """Why each of a layout's differences from the config's was proposed (what it saves, what
  it costs), one line each; empty for the config's own layout. (fsdp, the chips the other axes
  leave, changes with them and has no line.)"""
  out = []
  for axis, n, was in zip(MESH_AXES, layout.mesh, base.mesh):
    if n == was:
      continue
    if axis == "expert":
      out.append(f"expert {n}: each chip holds {cfg.num_experts // n} of the {cfg.num_experts} "
                 "experts, its tokens sent to them by all-to-all instead of gathering every "
                 "expert" if n > 1 else "expert 1: every expert gathered over fsdp")
    elif axis == "tensor":
      out.append(f"tensor {n}: heads, MLP widths and vocabulary split {n} ways (smaller "
                 "activations and logits, all-reduces in every layer)")
    elif axis == "sequence":
      out.append(f"sequence {n}: each row in {n} chunks of {row_len // n} positions (1/{n} of "
                 "its activations per chip, a K/V ring in every layer)")
  if layout.rows_per_batch != base.rows_per_batch:
    out.append(f"{layout.rows_per_batch} rows x {layout.microbatches} micro-batches: the same "
               "rows per step, fewer in flight")
  if layout.remat != base.remat:
    out.append(f"remat {layout.remat}: " + (
        "only each layer's input saved, the layer recomputed in the backward pass"
        if layout.remat == "full" else "only matmul outputs saved"))
  if layout.split_residual != base.split_residual:
    out.append(f"residual stream split over tensor: the saved layer inputs 1/"
               f"{layout.size('tensor')} the size, gathered for the matmuls")
  if layout.logits_chunk != base.logits_chunk:
    out.append(f"logits_chunk {layout.logits_chunk}: smaller fp32 logit chunks")
  if layout.dispatch_chunk != base.dispatch_chunk and layout.size("expert") > 1:
    out.append(f"moe_dispatch_chunk {layout.dispatch_chunk}: dispatch buffers for "
               f"{layout.dispatch_chunk} tokens per round")
  return out


def apply(config, layout: Layout):
  """The config with a layout's mesh, batch shape and model settings (a copy)."""
  cfg = config_lib.model_config(config)
  c = config.copy_and_resolve_references()
  with c.unlocked():
    for axis, n in zip(MESH_AXES, layout.mesh):
      c.mesh[axis] = n
    c.data.rows_per_batch, c.data.microbatches = layout.rows_per_batch, layout.microbatches
    c.data.max_seqs = layout.max_seqs
    o = c.model.overrides
    if layout.remat != cfg.remat:
      o.remat = layout.remat
    if layout.split_residual and dict(cfg.sharding_rules).get("act_embed") is None:
      if o.get("sharding_rules") is None:
        o.sharding_rules = {}
      o.sharding_rules.act_embed = "tensor"
    if layout.logits_chunk != cfg.logits_chunk:
      o.logits_chunk = layout.logits_chunk
    if layout.dispatch_chunk != cfg.moe_dispatch_chunk:
      o.moe_dispatch_chunk = layout.dispatch_chunk
  return c


# ----------------------------------------------------------------------------- estimate


@dataclasses.dataclass(frozen=True)
class _Leaf:
  shape: tuple[int, ...]
  axes: Optional[tuple]  # logical axes (None: replicated)
  nbytes: float  # bytes per element as stored
  trainable: bool
  stack: str  # the layer stack it belongs to ("" outside one)


@functools.lru_cache(maxsize=8)
def _model_state(cfg: ModelConfig, optimizer: str) -> tuple[tuple[_Leaf, ...], float]:
  """The model's variables (shapes, logical axes, storage bytes) and the optimizer state's
  bytes per trainable parameter (`optimizer`: the config's optimizer section as JSON)."""
  _, trainable, rest = nnx.split(transformer.abstract(cfg), lora.trainable(cfg), ...)
  leaves = []
  for train, state in ((True, trainable), (False, rest)):
    for path, var in nnx.to_flat_state(state):
      axes = var.get_metadata().get("axes")
      stack = str(path[0]) if axes and axes[0] == "layers" else ""
      for x in jax.tree.leaves(var.get_value()):  # a quantized kernel: values and scales
        leaves.append(_Leaf(tuple(x.shape), axes, storage_bits(x.dtype) / 8, train, stack))
  shapes = state_lib.abstract(cfg, optim.build(ml_collections.ConfigDict(json.loads(optimizer)),
                                               cfg))
  opt_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes.opt_state))
  params = sum(math.prod(leaf.shape) for leaf in leaves if leaf.trainable)
  return tuple(leaves), opt_bytes / max(params, 1)


def _per_chip(leaf: _Leaf, rules, sizes: dict) -> float:
  """Elements of a leaf one chip holds on a mesh of `sizes` (`models.sharding.param_spec`)."""
  if leaf.axes is None:
    return math.prod(leaf.shape)
  spec = param_spec(leaf.axes, leaf.shape, rules, types.SimpleNamespace(shape=sizes))
  names = [a for s in spec if s for a in ((s,) if isinstance(s, str) else s)]
  return math.prod(leaf.shape) / math.prod(sizes[a] for a in names)


def _layer_values(cfg: ModelConfig, tensor: int) -> tuple[float, float]:
  """(attention, MLP) matmul outputs per token per chip of the largest layer."""
  h, hd = cfg.hidden_size, cfg.head_dim
  if cfg.attention == "gqa":
    attn = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd / tensor + h
  else:
    attn = ((cfg.q_lora_rank or 0) + cfg.kv_lora_rank + cfg.qk_rope_head_dim + h
            + cfg.num_heads * (cfg.qk_head_dim + cfg.qk_nope_head_dim + 2 * cfg.value_head_dim)
            / tensor)
  mlp = 3 * cfg.intermediate_size / tensor + h if cfg.num_dense_layers else 0.0
  if cfg.is_moe:
    m = cfg.moe_intermediate_size
    mlp = max(mlp, cfg.experts_per_token * (3 * m / tensor + h) + cfg.num_experts + h
              + 3 * m * cfg.num_shared_experts / tensor)
  return attn, mlp


def estimate(config, layout: Layout, chip: Chip) -> Estimate:
  """The arithmetic's per-chip HBM peak and step-time proxy of a layout (module docstring).

  Args:
    config: the run's config (its model, optimizer and row length).
    layout: the layout.
    chip: the slice's chip.

  Returns:
    The Estimate.
  """
  cfg = config_lib.model_config(config)
  leaves, opt_per_param = _model_state(cfg, json.dumps(config.optimizer.to_dict(), sort_keys=True,
                                                       default=str))
  sizes = dict(zip(MESH_AXES, layout.mesh))
  tensor, expert, sequence = sizes["tensor"], sizes["expert"], sizes["sequence"]
  all_to_all = cfg.is_moe and expert > 1 and cfg.moe_dispatch != "global"
  # a layer's weights once gathered: whole over fsdp and sequence (over expert too, unless
  # the all-to-all dispatch brings the tokens to the experts)
  whole_sizes = dict(sizes, fsdp=1, sequence=1, **({} if all_to_all else {"expert": 1}))
  state = gathered_elems = tables = 0.0
  per_layer = collections.Counter()
  for leaf in leaves:
    mine, whole = _per_chip(leaf, cfg.sharding_rules, sizes), _per_chip(
        leaf, cfg.sharding_rules, whole_sizes)
    state += mine * (leaf.nbytes + (4 + opt_per_param if leaf.trainable else 0))
    gathered_elems += (whole - mine) if leaf.trainable else 0
    if leaf.stack:
      per_layer[leaf.stack] += whole / leaf.shape[0]
    elif len(leaf.shape) > 1:  # the embedding and the LM head
      tables += whole
  act = jnp.dtype(cfg.dtype).itemsize
  h, layers, row_len = cfg.hidden_size, cfg.num_layers, config.data.row_len
  t = layout.rows_per_batch * row_len / (layout.batch_shards * sequence)  # tokens per chip
  attn_v, mlp_v = _layer_values(cfg, tensor)
  residual = h / (tensor if layout.split_residual else 1)
  saved = layers * t * act * (residual if layout.remat in ("full", "offload")
                              else attn_v + mlp_v + residual)
  working = 2 * act * t * (attn_v + (0.0 if cfg.is_moe else mlp_v))  # values and gradients
  # whole-width fp32 arrays (the residual, norms, their gradients): 8 matches the compiled plans
  working += 8 * 4 * t * h
  if cfg.is_moe:
    m, k = cfg.moe_intermediate_size, cfg.experts_per_token
    if all_to_all:  # a round's receive buffer: room for every chip's copies
      chunk = min(layout.dispatch_chunk or t, t)
      copies = expert * chunk * k
    else:  # global dispatch: the micro-batch's copies, replicated
      copies = layout.rows_per_batch * row_len * k
    working += 2 * act * copies * (2 * h + 3 * m / tensor)
  vocab = 3 * layout.logits_chunk * cfg.vocab_size / tensor * 4 + tables * (act + 4)
  hbm = (state + (2 * act + 4) * max(per_layer.values(), default=0.0) + saved + working + vocab)
  # the step: FLOPs at peak, collective bytes at ICI bandwidth
  chips = math.prod(layout.mesh)
  tokens = layout.rows_per_batch * layout.microbatches * row_len
  passes = 3 + (layout.remat in ("full", "offload"))
  keys = row_len / 2 * (2 - 1 / sequence)  # the slowest sequence shard's mean keys per query
  flops = passes * tokens / chips * (2 * presets.count_active_params(cfg) + 2 * layers
                                     * cfg.num_heads * (cfg.qk_head_dim + cfg.value_head_dim)
                                     * keys)
  ici = gathered_elems * (act * (passes - 1) + 4)  # FSDP gathers, gradient reduce-scatter
  if tensor > 1:
    ici += 2 * layers * passes * t * h * act * 2 * (tensor - 1) / tensor
  if all_to_all:
    ici += 2 * cfg.num_moe_layers * passes * t * cfg.experts_per_token * h * act * (
        expert - 1) / expert
  elif cfg.is_moe and layout.batch_shards > 1:  # the micro-batch's tokens gathered and back
    ici += 2 * cfg.num_moe_layers * passes * layout.rows_per_batch * row_len * h * act
  if sequence > 1:
    kv = (2 * cfg.num_kv_heads * cfg.head_dim if cfg.attention == "gqa"
          else cfg.num_heads * (cfg.qk_head_dim + cfg.value_head_dim))
    ici += layers * passes * t * kv / tensor * act * (sequence - 1)
  step = flops / chip.peak_flops + layout.microbatches * ici / chip.ici_bw
  return Estimate(hbm_gb=hbm / GB, step_s=step)


def rank(config, layouts: list[Layout], chip: Chip) -> list[tuple[Layout, Estimate]]:
  """Layouts with their estimates, most promising first: estimated to fit in `FIT_FRACTION`
  of HBM, then the faster estimated step, fewer changes from the config, less HBM."""
  cfg = config_lib.model_config(config)
  base = config_layout(config, math.prod(layouts[0].mesh)) if layouts else None  # same chips
  usable = FIT_FRACTION * chip.hbm_bytes / GB
  scored = [(layout, estimate(config, layout, chip)) for layout in layouts]
  changes = lambda layout: len(reasons(layout, base, cfg, config.data.row_len))
  return sorted(scored, key=lambda le: (le[1].hbm_gb > usable, le[1].step_s, changes(le[0]),
                                        le[1].hbm_gb))


# ----------------------------------------------------------------------------- search


def _fits(report: dict) -> bool:
  """Whether a report's train step fits (its peak, with the resident optimizer state)."""
  if "train_peak_gb" in report:
    return report["train_peak_gb"]["fits"]
  return all(p["hbm_gb"]["fits"] for name, p in report["programs"].items()
             if name.startswith("train/"))


def _outcome(report: dict, capacity: float) -> dict:
  """A train-step report's fit, HBM peak, roofline step, collective bytes and compile time."""
  programs = {n: p for n, p in report["programs"].items() if n.startswith("train/")}
  hbm = max(p["hbm_gb"].get("total", p["hbm_gb"].get("temporaries", 0.0))
            for p in programs.values())
  hbm = report.get("train_peak_gb", {}).get("total", hbm)
  refused = any("error" in p for p in programs.values())
  fits = _fits(report) and not refused
  step = None if refused else round(sum(p["roofline_s"]["step"] for p in programs.values()), 3)
  coll = None if refused else round(sum(c["bytes"] for p in programs.values()
                                        for c in p["collectives"].values()) / GB, 1)
  planned = fits and hbm <= FIT_FRACTION * capacity
  verdict = (f"fits: {hbm:.1f} GB, {capacity - hbm:.1f} GB headroom" + (
                 "" if planned else f", above {FIT_FRACTION:.0%} of HBM") if fits else
             f"refused by the compiler: needs more than {hbm:.1f} GB" if refused else
             f"does not fit: {hbm:.1f} GB of {capacity:.0f} GB")
  return {"fits": fits, "planned": planned, "hbm_gb": round(hbm, 2), "step_s": step,
          "collective_gb": coll,
          "compile_s": round(sum(p["compile_s"] for p in programs.values()), 1),
          "verdict": verdict}


def _decided_by(layout: Layout, tried: list[tuple[Layout, dict]]) -> Optional[str]:
  """Why a compile already tried decides the layout (see the module docstring), or None."""
  for other, entry in tried:
    if entry.get("failed"):
      continue
    if entry["planned"] and layout.lighter_or_equal(other):
      return (f"not compiled: as light as {other.describe()}, which fits in "
              f"{FIT_FRACTION:.0%} of HBM (and no faster)")
    if not entry["fits"] and other.lighter_or_equal(layout):
      return f"not compiled: as heavy as {other.describe()}, which does not fit"
  return None


def best(entries: list[dict]) -> Optional[dict]:
  """The best of the compiled layouts that fit: of those within `FIT_FRACTION` of HBM (all
  that fit when none is), the fastest roofline step; of those within `TIE` of it, the fewest
  collective bytes, then the most headroom (lowest HBM)."""
  fit = [e for e in entries if e.get("fits") and e.get("step_s") is not None]
  fit = [e for e in fit if e["planned"]] or fit
  if not fit:
    return None
  fastest = min(e["step_s"] for e in fit)
  near = [e for e in fit if e["step_s"] <= fastest * (1 + TIE)]
  return min(near, key=lambda e: (e["collective_gb"], e["hbm_gb"]))


def search(config, topology: str, report: dict, *, compile_fn: Callable,
           budget: int = BUDGET, enough: int = ENOUGH, explore: bool = False,
           log: Callable[[str], None] = lambda line: print(line, flush=True)) -> dict:
  """Compiles the most promising layouts of a config's train step on a slice.

  Args:
    config: the run's config.
    topology: the slice ("v5p:2x2x4").
    report: `aot.compile_run`'s report of the config (its train step).
    budget: compiles at most, the config's own (in `report`) not counted.
    enough: stop once this many layouts fit in `FIT_FRACTION` of HBM, the config's own
      included.
    explore: search even when the config's train step fits.
    compile_fn: compiles a config's train step: `aot.compile_run` (config, topology,
      programs) -> its report.
    log: where progress lines go.

  Returns:
    {} when the report has no train step, or it fits and `explore` is off; else
    {"candidates": how many valid layouts were ranked, "tried": one entry per compiled layout
    in order, the config's own first ({"layout", "why" (the reasons for its changes),
    "estimate_gb", "estimate_step_s", "fits", "planned" (fits in `FIT_FRACTION` of HBM),
    "hbm_gb", "step_s" (compiled roofline), "collective_gb", "compile_s", "verdict",
    "best"}; a compile that failed otherwise has "failed" and its error as "verdict"),
    "skipped": [{"layout", "verdict"}] for the layouts passed over on the way,
    "not_compiled": the ranked layouts left when the search stopped, "best": the best
    entry's layout or None}.
  """
  if "train/gradients" not in report["programs"] or (_fits(report) and not explore):
    return {}
  chip, num_devices = slice_chips(topology)
  capacity = chip.hbm_bytes / GB
  cfg = config_lib.model_config(config)
  base = config_layout(config, num_devices)
  ranked = rank(config, candidates(config, num_devices), chip)
  log(f"search: {len(ranked)} valid layouts; compiling at most {budget}, most promising first")

  def entry(layout: Layout, est: Estimate, outcome: dict) -> dict:
    return {"layout": layout.describe(), "why": reasons(layout, base, cfg, config.data.row_len),
            "estimate_gb": round(est.hbm_gb, 2), "estimate_step_s": round(est.step_s, 4),
            **outcome, "best": False}

  tried = [(base, entry(base, estimate(config, base, chip), _outcome(report, capacity)))]
  skipped, left = [], 0
  for i, (layout, est) in enumerate(ranked):
    if layout == base:
      continue
    if len(tried) > budget or sum(e["planned"] for _, e in tried) >= enough:
      left = len(ranked) - i
      break
    why_not = _decided_by(layout, tried)
    if why_not:
      skipped.append({"layout": layout.describe(), "verdict": why_not})
      continue
    log(f"search: compiling {layout.describe()} (estimated {est.hbm_gb:.1f} GB)")
    try:
      outcome = _outcome(compile_fn(apply(config, layout), topology, ("train",)), capacity)
    except Exception as e:  # a layout the compiler cannot build: reported, the search goes on
      outcome = {"fits": False, "planned": False, "failed": True, "hbm_gb": None, "step_s": None,
                 "collective_gb": None, "compile_s": None,
                 "verdict": f"failed: {str(e).strip().splitlines()[0][:300]}"}
    tried.append((layout, entry(layout, est, outcome)))
    log(f"search:   {outcome['verdict']}")
  entries = [e for _, e in tried]
  chosen = best(entries)
  if chosen is not None:
    chosen["best"] = True
  return {"candidates": len(ranked), "tried": entries, "skipped": skipped,
          "not_compiled": left, "best": chosen["layout"] if chosen else None}


def summary_lines(result: dict) -> list[str]:
  """The search's report: each compiled layout with its verdict, estimate, roofline step and
  compile time, and why it was proposed; what was skipped; the best plan."""
  if not result:
    return []
  lines = [f"search: {result['candidates']} valid layouts, {len(result['tried'])} compiled "
           f"(the config's own first), {len(result['skipped'])} decided without compiling, "
           f"{result['not_compiled']} not compiled"]
  for e in result["tried"]:
    step = f", roofline step {e['step_s']:.3g} s" if e.get("step_s") is not None else ""
    compiled = f", compiled in {e['compile_s']:.0f} s" if e.get("compile_s") is not None else ""
    lines.append(f"  {'*' if e['best'] else '-'} {e['layout']}: {e['verdict']} (estimated "
                 f"{e['estimate_gb']:.1f} GB){step}{compiled}")
    lines += [f"      why: {why}" for why in e["why"]]
  lines += [f"  - {s['layout']}: {s['verdict']}" for s in result["skipped"][:SKIPPED_SHOWN]]
  if len(result["skipped"]) > SKIPPED_SHOWN:
    lines.append(f"  ... {len(result['skipped']) - SKIPPED_SHOWN} more not compiled (the JSON "
                 "report lists them)")
  lines.append(f"search: best plan: {result['best']}" if result["best"] else
               "search: no layout tried fits (raise --search_budget, or a larger slice)")
  return lines
