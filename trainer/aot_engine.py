"""Ahead-of-time compilation of the generation engine's programs for a TPU slice.

    from trainer import aot, aot_engine
    chip, devices = aot.topology_devices("v5p:2x2x1")
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=4), devices)
    with attention.compile_for("tpu"), jax.default_matmul_precision("default"):
      programs = aot_engine.engine_programs(config, model_cfg, mesh)
    compiled, seconds, min_bytes = programs["decode"]

The programs are the engine's own jitted calls, `models.engine.programs.prefill` and
`decode` (contiguous pool) or `prefill_paged` and `decode_paged` (paged pool, `rl.kv_cache`),
as a mesh engine (`Engine(model, cfg, mesh=mesh)`) runs them
in its decode layout (`models.engine.layout.Layout`), with the static arguments it passes for
the run's `EngineConfig` (`trainer.rollouts.engine_config`): the unstacked model's graphdef
with the decode rules in its config (the one the engine builds, so the compiled code is the code
it would run), `steps_per_call`, `top_logprobs`, `return_expert_ids` (decode's, and prefill's
`experts`: an MoE policy with `rl.routing_replay` records the experts of every position), and
the pool's `specs` (`models.engine.contiguous.CachePool`, `models.engine.paged.PagedPool`).
They are lowered on
abstract inputs only (`jax.ShapeDtypeStruct`s; nothing is allocated) and compiled under
`jax.set_mesh(mesh)`, so the decode rules' activation constraints apply.

Shapes and shardings (E = the EngineConfig):
  state    the unstacked model's variables, as the engine holds them (projection kernels and
           expert stacks in the compute dtype, the rest fp32), in the decode
           layout (`Layout.shardings`: tensor/expert-parallel weights, routers whole, nothing
           over data, fsdp or sequence);
  pool     contiguous: `model.init_cache(E.slots + E.prefix_cache_rows, E.max_seq_len)`, per
           layer {"k": [rows, kv_heads, capacity, head_dim], "v": [rows, kv_heads, head_dim,
           capacity]} (GQA) or {"c_kv": [rows, capacity, kv_lora_rank], "k_rope": [rows,
           capacity, qk_rope_head_dim]} (MLA's absorbed latent cache), rows replicated over
           the batch shards; paged: `model.init_paged_cache(PagedPool.num_pages_for(E),
           E.page_size)`, per layer [kv_heads, num_pages, page_size, dim] (MLA: one latent
           head), pages split over the batch shards (each shard's sequences read their own
           pages, the Pallas paged-attention kernel per shard); key/value heads over `tensor`
           (`Layout.cache_shardings`, as the pools place them). Rows or page tables [rows,
           ceil(E.max_seq_len / E.page_size)] address them;
  prefill  `E.prefill_rows or E.slots` rows, padded to a multiple of the batch shards
           (`Layout.pad_rows`, `PagedPool._by_shard`), of the longest chunk the engine issues
           (`prefill_len`);
  decode   the `E.slots` decode batch: per-slot arrays [slots] (and stop ids [slots,
           max(E.max_stop_token_ids, 1)]) and the token masks the engine passes to every call
           (`models.engine.constraint.Controls`): `mask` [slots, ceil(vocab_size / 32)]
           uint32, `min_p` [slots] float32, `min_tokens` [slots] int32 (one program whether
           or not a request is constrained).
  The host arrays (rows, tokens, per-slot arrays, masks, scalars) carry no sharding, as the
  engine's numpy arguments do: the compiler places them.

`weight_sync` compiles the colocated weight transfer (`rl.engine_mesh = "colocated"`, on the
trainer's mesh or its devices laid out anew, `rl.engine_mesh_shape`): after each optimizer
step the trainer's new weights go from their training layout (FSDP-sharded, layer-stacked,
fp32: `trainer.state.abstract`) to the engine's (unstacked, decode layout, projections in the
compute dtype), on the same devices, as `Engine.update_params` does it
(`models.engine.weights.unstack_values`, the cast, `Layout.place`): one program whose
collectives are the transfer's. A LoRA run moves its adapters (and a MoE router's bias) only:
the engine keeps its frozen base.

`min_bytes` is a floor on the HBM bytes one call must read per chip (`engine_programs`): each
chip's shard of the weights in the decode layout once, in the compute dtype (of an untied
embedding table, the rows looked up), plus its share of the cache the call must touch, the rows
split over the batch shards as the slots are; for decode, one step's. `trainer.aot` compares it
with the compiled program's HBM traffic (`trainer.aot_hlo.hbm_bytes`, from the memory spaces
of the optimized HLO: XLA's "bytes accessed" also counts the compiler's VMEM staging, and the
code around the decode loop, such as the LM head's cast to the compute dtype, once per call of
`steps_per_call` steps). The Pallas paged-attention kernel declares what it reads (the pages
its tables name), not its operands' full size; its pages stay in HBM
(`models.kernels.paged_attention_tpu.in_hbm`).
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from models import transformer
from models.config import ModelConfig
from models.engine import EngineConfig, constraint, programs, weights
from models.engine.layout import Layout, specs_of
from models.engine.paged import PagedPool
from trainer import rollouts
from trainer import state as state_lib


def _struct(shape, dtype, sharding_=None) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding_)


def abstract_model(model_cfg: ModelConfig, mesh) -> tuple[nnx.GraphDef, nnx.State]:
  """The engine's (unstacked) decode model as a graphdef and an abstract, placed state.

  Args:
    model_cfg: the model's ModelConfig (its training sharding rules).
    mesh: the engine's mesh (axes `models.sharding.MESH_AXES`).

  Returns:
    (graphdef, state): the graphdef equals the one a mesh engine splits off its decode model
    (`Layout.decode_model` of `transformer.unstack(model)`: the jit cache key); the state's
    variables hold `jax.ShapeDtypeStruct`s carrying the decode layout's shardings
    (`Layout.shardings`), in the engine's dtypes (projections in the compute dtype,
    `models.engine.weights.compute_dtype`; the rest fp32).
  """
  layout = Layout(mesh, model_cfg)
  model = nnx.eval_shape(lambda: transformer.with_adapters(
      transformer.Transformer(model_cfg, stacked=False)))  # LoRA adapters, quantized base
  graphdef, state = nnx.split(layout.decode_model(model))
  narrow = weights.compute_dtype(model)  # projections held in the compute dtype, as the engine
  if narrow is not None:
    state = jax.eval_shape(lambda s: weights.projections_to(s, narrow), state)
  state = jax.tree.map(lambda v, sh: _struct(v.shape, v.dtype, sh), state,
                       layout.shardings(state))
  return graphdef, state


def abstract_pool(model_cfg: ModelConfig, engine_cfg: EngineConfig, mesh) -> tuple[dict, Any]:
  """The engine's pool of decode caches, abstract and placed as its pool places it.

  Args:
    model_cfg: the model config.
    engine_cfg: the engine's sizes and pool (`cache`: contiguous rows = slots +
      prefix_cache_rows of max_seq_len positions, or paged: `PagedPool.num_pages_for` pages of
      page_size positions).
    mesh: the engine's mesh.

  Returns:
    (pool, specs): pool {stack: [per layer {name: ShapeDtypeStruct}]}, as the unstacked
    model's `init_cache` (contiguous: [rows, ...], rows replicated over the batch shards) or
    `init_paged_cache` (paged: [kv_heads, num_pages, page_size, dim], pages split over the
    batch shards), compute dtype, key/value heads over `tensor`; specs the static `specs` the
    pool passes its programs (contiguous: (the pool's, the gathered rows'); paged: the
    pages').
  """
  layout = Layout(mesh, model_cfg)
  model = nnx.eval_shape(lambda: transformer.Transformer(layout.cfg, stacked=False))
  e = engine_cfg
  if e.cache == "paged":
    shapes = jax.eval_shape(lambda: model.init_paged_cache(PagedPool.num_pages_for(e, layout),
                                                           e.page_size))
    shardings = layout.cache_shardings(shapes, heads_dim=0, rows_dim=1)
    specs = specs_of(shardings)
  else:
    rows = e.slots + e.prefix_cache_rows
    shapes = jax.eval_shape(lambda: model.init_cache(rows, e.max_seq_len))
    heads = 1 if model_cfg.attention == "gqa" else None  # k/v [rows, kv_heads, ...]
    shardings = layout.cache_shardings(shapes, heads)
    specs = (specs_of(shardings), specs_of(layout.cache_shardings(shapes, heads, rows_dim=0)))
  pool = jax.tree.map(lambda s, sh: _struct(s.shape, s.dtype, sh), shapes, shardings)
  return pool, specs


def position_bytes_per_chip(pool: dict, engine_cfg: EngineConfig) -> float:
  """Bytes one cached position of one sequence takes on a chip, over every layer: its share
  of the key/value heads (MLA's latent whole).

  Args:
    pool: the abstract pool of `abstract_pool` (leaves carry their shardings).
    engine_cfg: its EngineConfig (`cache`, `max_seq_len`, `page_size`).

  Returns:
    The bytes.
  """
  paged = engine_cfg.cache == "paged"
  dim, per_entry = (1, engine_cfg.page_size) if paged else (0, engine_cfg.max_seq_len)
  total = 0.0
  for leaf in jax.tree.leaves(pool):
    shard = leaf.sharding.shard_shape(leaf.shape)  # positions held: shard[dim] * per_entry
    total += jnp.dtype(leaf.dtype).itemsize * math.prod(shard) / (shard[dim] * per_entry)
  return total


def prefill_len(engine_cfg: EngineConfig) -> int:
  """The longest prefill the engine issues: `prefill_chunk`, or less when a row holds less.

  A chunk is at most capacity - 1 tokens (a row holds seq[:-1]), padded to a multiple of
  `prefill_bucket` and capped at `prefill_chunk` (`Engine._prefill`, models/engine/loop.py).
  """
  c = engine_cfg
  return min(c.prefill_chunk, -(-(c.max_seq_len - 1) // c.prefill_bucket) * c.prefill_bucket)


def weight_bytes_per_chip(state: nnx.State, model_cfg: ModelConfig,
                          lookups: Optional[int] = None) -> float:
  """Bytes of one chip's shards of every variable, floating ones in the compute dtype.

  Args:
    state: an abstract state of `abstract_model` (leaves carry their shardings).
    model_cfg: the model config (`dtype`, `tie_embeddings`).
    lookups: the token embeddings a call looks up on the chip: an untied embedding table
      counts those rows only (a lookup reads rows, not the table; a tied table is the LM head
      too, read whole). None: the whole table.

  Returns:
    The bytes. Every MoE expert is counted (a simplification: a step of s slots reads at
    most s * experts_per_token experts of a layer).
  """
  compute = jnp.dtype(model_cfg.dtype).itemsize
  total = 0.0
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    size = jnp.dtype(leaf.dtype).itemsize
    itemsize = compute if jnp.issubdtype(leaf.dtype, jnp.floating) else size
    shard = leaf.sharding.shard_shape(leaf.shape)
    count = math.prod(shard)
    if (lookups is not None and not model_cfg.tie_embeddings
        and getattr(path[0], "key", None) == "embed"):
      count = min(count, lookups * shard[-1])
    total += itemsize * count
  return total


def engine_programs(config, model_cfg: ModelConfig, mesh,
                    engine_cfg: Optional[EngineConfig] = None
                    ) -> dict[str, tuple[jax.stages.Compiled, float, float]]:
  """Compiles the engine's prefill and decode calls for the mesh's devices.

  Call under `models.kernels.attention.compile_for(platform)` to pick the kernels of the
  slice's platform (and a matmul precision its compiler accepts).

  min_bytes, per chip (W = `weight_bytes_per_chip`: every variable's decode-layout shard in
  the compute dtype, of an untied embedding table the rows the call looks up; P =
  `position_bytes_per_chip`; rows split over the batch shards as the slots are):
    prefill  W + P x (padded prefill rows / shards) x `prefill_len`: the weights once and the
             new entries written (a contiguous pool's call gathers and scatters whole rows,
             so it accesses more);
    decode   W + P x (slots / shards) x max_seq_len, per decode step: the weights once and
             the slots' caches read at full length (the step attends over every position;
             the per-step outputs are small). Compare it with the compiled program's HBM
             bytes per step (`trainer.aot_hlo.hbm_bytes`: the loop's iteration plus the
             code around the loop over `steps_per_call`).

  Args:
    config: the run's config (`rl.concurrency`, `rl.max_context_tokens`, `rl.kv_cache`,
      `seed`: the engine of `trainer.rollouts.engine_config`).
    model_cfg: the model's ModelConfig.
    mesh: the engine's mesh over the slice's devices (`models.sharding.make_mesh`).
    engine_cfg: the EngineConfig to compile for instead of the config's.

  Returns:
    {"prefill": (compiled, compile seconds, min_bytes), "decode": (...)}; compile seconds
    include the lowering.

  Raises:
    ValueError: an EngineConfig the mesh does not fit (`Layout.check`).
  """
  e = engine_cfg or rollouts.engine_config(config, model_cfg)
  layout = Layout(mesh, model_cfg)
  layout.check(e)
  paged = e.cache == "paged"
  graphdef, state = abstract_model(model_cfg, mesh)
  pool, specs = abstract_pool(model_cfg, e, mesh)
  i32, f32 = jnp.int32, jnp.float32
  # contiguous: the pool row of each batch row; paged: its page table
  pages_per_seq = -(-e.max_seq_len // e.page_size)
  rows = lambda b: _struct((b, pages_per_seq) if paged else (b,), i32)  # noqa: E731

  b, p = e.prefill_rows or e.slots, prefill_len(e)
  b += -b % layout.shards  # Layout.pad_rows, PagedPool._by_shard
  prefill_args = (graphdef, state, pool, rows(b), _struct((b, p), i32), _struct((b,), i32))

  s, n_stop = e.slots, max(e.max_stop_token_ids, 1)
  slot = lambda dtype: _struct((s,), dtype)  # noqa: E731
  # rows, tokens, lengths, active, counts, limits, temperature, top_k, top_p, seeds, stop_ids,
  # max_steps, exit_on_finish (as Engine._decode_call passes them)
  decode_args = (graphdef, e.steps_per_call, e.top_logprobs, e.return_expert_ids, state, pool,
                 rows(s), slot(i32), slot(i32), slot(jnp.bool_), slot(i32), slot(i32),
                 slot(f32), slot(i32), slot(f32), slot(jnp.uint32), _struct((s, n_stop), i32),
                 _struct((), i32), _struct((), jnp.bool_))
  # the masking inputs, keyword arguments (`models.engine.constraint.Controls.kwargs`)
  words = constraint.words(model_cfg.vocab_size)
  decode_kwargs = {"mask": _struct((s, words), jnp.uint32), "min_p": slot(f32),
                   "min_tokens": slot(i32), "specs": specs}

  position = position_bytes_per_chip(pool, e)
  rows_b, rows_s = b // layout.shards, s // layout.shards  # a chip's rows
  floors = {"prefill": (weight_bytes_per_chip(state, model_cfg, rows_b * p)
                        + position * rows_b * p),
            "decode": (weight_bytes_per_chip(state, model_cfg, rows_s)
                       + position * rows_s * e.max_seq_len)}
  prefill_fn, decode_fn = ((programs.prefill_paged, programs.decode_paged) if paged else
                           (programs.prefill, programs.decode))
  out = {}
  with jax.set_mesh(mesh):
    # prefill returns the prefilled positions' experts too when the engine records them
    prefill_kwargs = {"specs": specs, **({"experts": True} if e.return_expert_ids else {})}
    for name, fn, args, kwargs in (("prefill", prefill_fn, prefill_args, prefill_kwargs),
                                   ("decode", decode_fn, decode_args, decode_kwargs)):
      t0 = time.perf_counter()
      compiled = fn.lower(*args, **kwargs).compile()
      out[name] = (compiled, time.perf_counter() - t0, floors[name])
  return out


def _flat(tree) -> dict[str, Any]:
  """A nested dict's leaves by path, "moe_layers/0/mlp/router_bias"."""
  return {"/".join(str(getattr(k, "key", k)) for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _nested(flat: dict[str, Any]) -> dict:
  """The inverse of `_flat` (integer path parts are layer indices, as in a pure state)."""
  out: dict = {}
  for path, leaf in flat.items():
    node, parts = out, [int(p) if p.isdigit() else p for p in path.split("/")]
    for part in parts[:-1]:
      node = node.setdefault(part, {})
    node[parts[-1]] = leaf
  return out


def weight_sync_program(model_cfg: ModelConfig, train_state, mesh
                        ) -> tuple[jax.stages.Compiled, float, float]:
  """Compiles the colocated weight transfer from the trainer's layout to the engine's.

  Args:
    model_cfg: the model's ModelConfig.
    train_state: the abstract TrainState the train step compiles for (`trainer.state.abstract`
      on the trainer's mesh: leaves carry their training shardings).
    mesh: the engine's mesh over the same devices, in the same order (the trainer's, or
      `trainer.rollouts.decode_mesh`'s).

  Returns:
    (compiled, compile seconds, bytes per chip): the program maps the trained variables
    (`params` and the non-frozen `model_state`, stacked) to the engine's variables of the same
    names (unstacked, in the engine's dtypes and decode layout); the bytes are what each chip
    holds of the result.

  Raises:
    ValueError: a trained variable the engine's model does not have.
  """
  _, engine_state = abstract_model(model_cfg, mesh)
  target = _flat(nnx.to_pure_dict(engine_state))
  frozen = {"/".join(map(str, path)) for path in state_lib.frozen_paths(model_cfg)}
  trained = {**_flat(nnx.to_pure_dict(train_state.params)),
             **{p: v for p, v in _flat(nnx.to_pure_dict(train_state.model_state)).items()
                if p not in frozen}}
  source = _nested(trained)
  names = list(_flat(jax.eval_shape(weights.unstack_values, source)))
  missing = [n for n in names if n not in target]
  if missing:
    raise ValueError(f"weight sync: the engine's model has no variable {missing[0]!r}")

  def sync(values):  # as Engine.update_params: unstack, cast to the engine's dtypes, place
    flat = _flat(weights.unstack_values(values))
    return {n: flat[n].astype(target[n].dtype) for n in names}

  t0 = time.perf_counter()
  with jax.set_mesh(mesh):
    compiled = jax.jit(sync, out_shardings={n: target[n].sharding for n in names}).lower(
        source).compile()
  held = sum(jnp.dtype(target[n].dtype).itemsize
             * math.prod(target[n].sharding.shard_shape(target[n].shape)) for n in names)
  return compiled, time.perf_counter() - t0, float(held)
