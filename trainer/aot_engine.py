"""Ahead-of-time compilation of the generation engine's programs for a TPU slice.

    from trainer import aot, aot_engine
    chip, devices = aot.topology_devices("v5p:2x2x1")
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=4), devices)
    with attention.compile_for("tpu"), jax.default_matmul_precision("default"):
      programs = aot_engine.engine_programs(config, model_cfg, mesh)
    compiled, seconds, min_bytes = programs["decode"]

The programs are the engine's own jitted calls, `models.engine.programs.prefill` and
`models.engine.programs.decode`, with the static arguments the engine passes for the run's
`EngineConfig` (`trainer.rollouts.engine_config`): the unstacked model's graphdef (the one the
engine builds, so the compiled code is the code it would run), `steps_per_call`,
`top_logprobs`, `return_expert_ids` (decode's, and prefill's `experts`: an MoE policy with
`rl.routing_replay` records the experts of every position). They are lowered on abstract inputs only
(`jax.ShapeDtypeStruct`s carrying `NamedSharding`s; nothing is allocated) and compiled under
`jax.set_mesh(mesh)`, so the model's activation constraints apply.

Shapes (E = the EngineConfig):
  state    the unstacked model's variables, fp32 as the engine holds them, sharded by the
           model's rules (`models.sharding.state_shardings`);
  pool     `model.init_cache(E.slots + E.prefix_cache_rows, E.max_seq_len)`: per layer
           {"k": [rows, kv_heads, capacity, head_dim], "v": [rows, kv_heads, head_dim,
           capacity]} (GQA) or {"c_kv": [rows, capacity, kv_lora_rank], "k_rope": [rows,
           capacity, qk_rope_head_dim]} (MLA's absorbed latent cache), the row dimension over
           the rules' `batch` mesh axes and the key/value heads over their `kv_heads` axes,
           each where the axes divide the dimension (`CACHE_AXES`);
  prefill  `E.prefill_rows or E.slots` rows of the longest chunk the engine issues
           (`prefill_len`);
  decode   the `E.slots` decode batch; per-slot arrays [slots] (and stop ids [slots,
           max(E.max_stop_token_ids, 1)]) are sharded like the pool's rows, and so are the
           token masks the engine passes to every call
           (`models.engine.constraint.Controls`): `mask` [slots, ceil(vocab_size / 32)]
           uint32, `min_p` [slots] float32, `min_tokens` [slots] int32 (one program whether
           or not a request is constrained).

An engine with `cache="paged"` (`rl.kv_cache`) runs `decode_paged` over a pool of pages
instead (models/engine/paged.py); it is planned here as the contiguous pool (by default the
paged pool holds the same memory, and the weights, masks and per-step work are the same).

`min_bytes` is a floor on the HBM bytes one call must read per chip (`engine_programs`): each
chip's shard of the weights once, in the compute dtype, plus the cache the call must touch.
With parameters sharded over `fsdp` the programs all-gather the weights (decode: every step)
and each chip then reads all of them, so the floor is that of a layout where no chip needs
another's weights. XLA's `cost_analysis` counts a while loop's body once, so decode's compiled
"bytes accessed" is about one decode step plus the gather and scatter of the slots' cache rows;
`min_bytes` for decode is one step's floor, to compare with it.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from models import sharding, transformer
from models.config import ModelConfig
from models.engine import EngineConfig, constraint, programs
from trainer import rollouts

# Logical axes of the decode cache leaves (`init_cache` of models/attention.py), by leaf name.
# A leaf not listed is sharded over its rows only.
CACHE_AXES: dict[str, tuple[Optional[str], ...]] = {
    "k": ("batch", "kv_heads", None, None),  # GQA [rows, kv_heads, capacity, head_dim]
    "v": ("batch", "kv_heads", None, None),  # GQA [rows, kv_heads, head_dim, capacity]
    "c_kv": ("batch", None, None),  # MLA [rows, capacity, kv_lora_rank]
    "k_rope": ("batch", None, None),  # MLA [rows, capacity, qk_rope_head_dim]
}


def _struct(shape, dtype, sharding_) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding_)


def _spec(axes: tuple[Optional[str], ...], shape: tuple[int, ...], cfg: ModelConfig,
          mesh) -> PartitionSpec:
  """The PartitionSpec of logical axes; a dimension its mesh axes do not divide is replicated."""
  spec = sharding.logical_to_spec(axes, cfg.sharding_rules, mesh)
  out = []
  for dim, names in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    names_ = (names,) if isinstance(names, str) else (names or ())
    out.append(names if dim % math.prod(mesh.shape[a] for a in names_) == 0 else None)
  return PartitionSpec(*out)


def _per_row(cfg: ModelConfig, mesh, shape: tuple[int, ...]) -> NamedSharding:
  """The sharding of a per-row array [rows, ...]: rows over the `batch` axes where they divide."""
  return NamedSharding(mesh, _spec(("batch",) + (None,) * (len(shape) - 1), shape, cfg, mesh))


def abstract_model(model_cfg: ModelConfig, mesh) -> tuple[nnx.GraphDef, nnx.State]:
  """The engine's (unstacked) model as a graphdef and an abstract, sharded state.

  Args:
    model_cfg: the model's ModelConfig.
    mesh: the mesh the parameters are laid over.

  Returns:
    (graphdef, state): the graphdef equals the one `models.engine.Engine` splits off
    `transformer.unstack(model)` (the jit cache key); the state's variables hold
    `jax.ShapeDtypeStruct`s (fp32 parameters) carrying their `state_shardings`.
  """
  model = nnx.eval_shape(lambda: transformer.with_adapters(
      transformer.Transformer(model_cfg, stacked=False)))  # LoRA adapters, quantized base
  graphdef, state = nnx.split(model)
  shardings = sharding.state_shardings(state, model_cfg, mesh)
  state = jax.tree.map(lambda v, sh: _struct(v.shape, v.dtype, sh), state, shardings)
  return graphdef, state


def cache_sharding(name: str, shape: tuple[int, ...], model_cfg: ModelConfig,
                   mesh) -> NamedSharding:
  """The sharding of one pool leaf.

  Args:
    name: the leaf's name in its layer's cache dict ("k", "v", "c_kv", "k_rope", ...).
    shape: its shape, rows first.
    model_cfg: the model config (its `sharding_rules`, `num_kv_heads`).
    mesh: the mesh.

  Returns:
    Rows over the `batch` mesh axes and key/value heads over the `kv_heads` axes
    (`CACHE_AXES`), each only where the axes divide the dimension; other dimensions
    replicated.

  Raises:
    ValueError: a leaf named as a GQA cache whose heads dimension is not `num_kv_heads` (a
      layout that `CACHE_AXES` no longer describes).
  """
  axes = CACHE_AXES.get(name, ("batch",))
  axes = tuple(axes) + (None,) * (len(shape) - len(axes))
  if "kv_heads" in axes and shape[axes.index("kv_heads")] != model_cfg.num_kv_heads:
    raise ValueError(f"cache leaf {name!r} {list(shape)}: dimension {axes.index('kv_heads')} "
                     f"is not num_kv_heads={model_cfg.num_kv_heads}; update CACHE_AXES")
  return NamedSharding(mesh, _spec(axes, shape, model_cfg, mesh))


def abstract_pool(model_cfg: ModelConfig, engine_cfg: EngineConfig, mesh) -> dict:
  """The engine's pool of decode caches, abstract and sharded (`cache_sharding`).

  Args:
    model_cfg: the model config.
    engine_cfg: the engine's sizes (rows = slots + prefix_cache_rows, capacity = max_seq_len).
    mesh: the mesh.

  Returns:
    {stack: [per layer {name: ShapeDtypeStruct [rows, ...]}]}, as `Transformer.init_cache` of
    the unstacked model (compute dtype).
  """
  model = nnx.eval_shape(lambda: transformer.Transformer(model_cfg, stacked=False))
  rows = engine_cfg.slots + engine_cfg.prefix_cache_rows
  pool = jax.eval_shape(lambda: model.init_cache(rows, engine_cfg.max_seq_len))

  def one(path, leaf):
    name = path[-1].key if isinstance(path[-1], jax.tree_util.DictKey) else None
    return _struct(leaf.shape, leaf.dtype, cache_sharding(name, leaf.shape, model_cfg, mesh))
  return jax.tree_util.tree_map_with_path(one, pool)


def prefill_len(engine_cfg: EngineConfig) -> int:
  """The longest prefill the engine issues: `prefill_chunk`, or less when a row holds less.

  A chunk is at most capacity - 1 tokens (a row holds seq[:-1]), padded to a multiple of
  `prefill_bucket` and capped at `prefill_chunk` (`Engine._prefill`, models/engine/loop.py).
  """
  c = engine_cfg
  return min(c.prefill_chunk, -(-(c.max_seq_len - 1) // c.prefill_bucket) * c.prefill_bucket)


def weight_bytes_per_chip(state: nnx.State, model_cfg: ModelConfig) -> float:
  """Bytes of one chip's shards of every variable, floating ones in the compute dtype.

  Args:
    state: an abstract state of `abstract_model` (leaves carry their shardings).
    model_cfg: the model config (`dtype`).

  Returns:
    The bytes. Every MoE expert is counted (a simplification: a step of s slots reads at
    most s * experts_per_token experts of a layer).
  """
  compute = jnp.dtype(model_cfg.dtype).itemsize
  total = 0.0
  for leaf in jax.tree.leaves(state):
    size = jnp.dtype(leaf.dtype).itemsize
    itemsize = compute if jnp.issubdtype(leaf.dtype, jnp.floating) else size
    total += itemsize * math.prod(leaf.sharding.shard_shape(leaf.shape))
  return total


def cache_bytes_per_chip(pool: dict, capacity: int, rows: int, tokens: int) -> float:
  """Bytes per chip of `tokens` cache entries of each of `rows` rows.

  Args:
    pool: the abstract pool of `abstract_pool` (leaves [pool_rows, ...] carrying shardings).
    capacity: entries per row (the pool's `max_seq_len`; that dimension is never sharded).
    rows: rows read or written.
    tokens: entries per row read or written.

  Returns:
    Each chip's share of the pool scaled by rows / pool_rows and tokens / capacity (an average
    over chips when the rows are sharded).
  """
  total = 0.0
  for leaf in jax.tree.leaves(pool):
    per_chip = jnp.dtype(leaf.dtype).itemsize * math.prod(leaf.sharding.shard_shape(leaf.shape))
    total += per_chip * min(rows, leaf.shape[0]) / leaf.shape[0] * min(tokens, capacity) / capacity
  return total


def engine_programs(config, model_cfg: ModelConfig, mesh,
                    engine_cfg: Optional[EngineConfig] = None
                    ) -> dict[str, tuple[jax.stages.Compiled, float, float]]:
  """Compiles the engine's prefill and decode calls for the mesh's devices.

  Call under `models.kernels.attention.compile_for(platform)` to pick the kernels of the
  slice's platform (and a matmul precision its compiler accepts).

  min_bytes, per chip (W = `weight_bytes_per_chip`: every variable's shard in the compute
  dtype; C(r, t) = `cache_bytes_per_chip`: t cache entries of r rows):
    prefill  W + C(prefill rows, `prefill_len`): the weights once and the new entries written
             (the call gathers and scatters whole rows, so it accesses more);
    decode   W + C(slots, max_seq_len), per decode step: the weights once and the slots' rows
             read at full capacity (the step attends over the whole row; the per-step outputs
             are small). Compare it with the compiled bytes accessed, which counts the loop
             body once.

  Args:
    config: the run's config (`rl.concurrency`, `rl.max_context_tokens`, `seed`: the engine of
      `trainer.rollouts.engine_config`).
    model_cfg: the model's ModelConfig.
    mesh: the mesh over the slice's devices (`models.sharding.make_mesh`).
    engine_cfg: the EngineConfig to compile for instead of the config's.

  Returns:
    {"prefill": (compiled, compile seconds, min_bytes), "decode": (...)}; compile seconds
    include the lowering.

  Raises:
    ValueError: a cache layout `CACHE_AXES` does not describe.
  """
  e = engine_cfg or rollouts.engine_config(config, model_cfg)
  graphdef, state = abstract_model(model_cfg, mesh)
  pool = abstract_pool(model_cfg, e, mesh)
  i32, f32 = jnp.int32, jnp.float32
  weights = weight_bytes_per_chip(state, model_cfg)
  replicated = NamedSharding(mesh, PartitionSpec())

  b, p = e.prefill_rows or e.slots, prefill_len(e)
  prefill_args = (graphdef, state, pool, _struct((b,), i32, _per_row(model_cfg, mesh, (b,))),
                  _struct((b, p), i32, _per_row(model_cfg, mesh, (b, p))),
                  _struct((b,), i32, _per_row(model_cfg, mesh, (b,))))

  s, n_stop = e.slots, max(e.max_stop_token_ids, 1)
  slot = lambda dtype: _struct((s,), dtype, _per_row(model_cfg, mesh, (s,)))
  # rows, tokens, lengths, active, counts, limits, temperature, top_k, top_p, seeds, stop_ids,
  # max_steps, exit_on_finish (as Engine._decode_call passes them)
  decode_args = (graphdef, e.steps_per_call, e.top_logprobs, e.return_expert_ids, state, pool,
                 slot(i32), slot(i32), slot(i32), slot(jnp.bool_), slot(i32), slot(i32),
                 slot(f32), slot(i32), slot(f32), slot(jnp.uint32),
                 _struct((s, n_stop), i32, _per_row(model_cfg, mesh, (s, n_stop))),
                 _struct((), i32, replicated), _struct((), jnp.bool_, replicated))
  # the masking inputs, keyword arguments (`models.engine.constraint.Controls.kwargs`)
  words = constraint.words(model_cfg.vocab_size)
  decode_kwargs = {"mask": _struct((s, words), jnp.uint32,
                                   _per_row(model_cfg, mesh, (s, words))),
                   "min_p": slot(f32), "min_tokens": slot(i32)}

  floors = {"prefill": weights + cache_bytes_per_chip(pool, e.max_seq_len, b, p),
            "decode": weights + cache_bytes_per_chip(pool, e.max_seq_len, s, e.max_seq_len)}
  out = {}
  with jax.set_mesh(mesh):
    # prefill returns the prefilled positions' experts too when the engine records them
    prefill_kwargs = {"experts": True} if e.return_expert_ids else {}
    for name, fn, args, kwargs in (("prefill", programs.prefill, prefill_args, prefill_kwargs),
                                   ("decode", programs.decode, decode_args, decode_kwargs)):
      t0 = time.perf_counter()
      compiled = fn.lower(*args, **kwargs).compile()
      out[name] = (compiled, time.perf_counter() - t0, floors[name])
  return out
