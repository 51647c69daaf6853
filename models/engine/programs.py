"""The engine's jitted programs: prefill, prefix copies and decode, over the rows of a
contiguous pool (`prefill`, `copy_row`, `decode`) or the pages of a paged one (`prefill_paged`,
`copy_pages`, `decode_paged`). The pools (contiguous.py, paged.py) call them; the loop never
does. Decode samples with sampling.py's functions.

The programs are module-level with the model's graphdef and sizes as static arguments, so
engines of one model config share compiled code. On a mesh (layout.py) the static `specs`
(flat PartitionSpecs of the cache leaves) keep every cache in the pool's own sharding, so a
donated pool is replaced in place; None (one device) constrains nothing. Every cache argument
is donated: a call consumes the pool's arrays and returns their successors. `TRACES` counts
traces per program: a retrace is a recompile. For a TPU the programs compile with
`TPU_COMPILER_OPTIONS`.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from models.engine import sampling
from models.engine.layout import constrain
from models.kernels import attention

TRACES: collections.Counter = collections.Counter()

# XLA:TPU's dot strength reduction rewrites a matmul with one row per shard (decode with one
# slot per batch shard) as an fp32 multiply-reduce; for a kernel reshaped to 2-D
# (`layers.Dense` with several input dimensions: attention's o_proj) it leaves the kernel's
# fp32 conversion unfused, so the weight crosses HBM in bf16 and then twice in fp32 every
# step. The MXU's matrix-vector product reads the bf16 weight once, and decode is bound by
# those reads, not by the MXU.
TPU_COMPILER_OPTIONS = {"xla_tpu_enable_dot_strength_reduction": False}


class _Program:
  """`jax.jit(fn, **jit_kwargs)`, compiled with `TPU_COMPILER_OPTIONS` when the target is a TPU
  (`attention.target_platform`: the running backend, or `compile_for`'s when lowering ahead of
  time); other backends reject those options."""

  def __init__(self, fn, **jit_kwargs):
    functools.update_wrapper(self, fn)
    self._tpu = jax.jit(fn, compiler_options=TPU_COMPILER_OPTIONS, **jit_kwargs)
    self._other = jax.jit(fn, **jit_kwargs)

  def _jitted(self):
    return self._tpu if attention.target_platform() == "tpu" else self._other

  def __call__(self, *args, **kwargs):
    return self._jitted()(*args, **kwargs)

  def lower(self, *args, **kwargs):
    return self._jitted().lower(*args, **kwargs)


def _program(**jit_kwargs):
  return lambda fn: _Program(fn, **jit_kwargs)


def _gather_rows(pool: dict, rows: jax.Array) -> dict:
  """Rows [n] of every cache array [pool_rows, ...]; out-of-range rows read zeros."""
  return jax.tree.map(lambda a: jnp.take(a, rows, axis=0, mode="fill", fill_value=0), pool)


def _scatter_rows(pool: dict, rows: jax.Array, sub: dict) -> dict:
  """Write sub [n, ...] back to rows [n]; out-of-range rows are dropped (padding)."""
  return jax.tree.map(lambda a, s: a.at[rows].set(s, mode="drop"), pool, sub)


def _forward(graphdef, state, tokens, positions, cache, index, page_table=None):
  """(final hidden [b, s, hidden], aux, cache) after running tokens [b, s] against the cache
  (paged when `page_table` [b, pages_per_seq] is given)."""
  model = nnx.merge(graphdef, state)
  return model.hidden(tokens, positions, None, cache=cache, index=index, page_table=page_table)


@_program(static_argnums=(0,), static_argnames=("experts", "specs"),
          donate_argnums=(2,))
def prefill(graphdef, state, pool: dict, rows: jax.Array, tokens: jax.Array,
            starts: jax.Array, *, experts: bool = False, specs=None):
  """Write the cache of tokens into pool rows.

  Args:
    graphdef: the (unstacked) model's graphdef (static).
    state: the model's state.
    pool: decode caches [pool_rows, ...] (donated).
    rows: [b] pool row of each batch row; out-of-range rows are padding.
    tokens: [b, p] int32 tokens to prefill.
    starts: [b] cache slot of each row's first token.
    experts: also return the MoE expert choices of every prefilled token (static).
    specs: None, or (the pool's specs, the gathered rows' specs) on a mesh (static).

  Returns:
    The updated pool; with `experts`, (pool, expert_ids [moe_layers, b, p, k] int32).
  """
  TRACES["prefill"] += 1
  pool_specs, sub_specs = specs or (None, None)
  sub = constrain(_gather_rows(pool, rows), sub_specs)
  positions = starts[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
  _, aux, sub = _forward(graphdef, state, tokens, positions, sub, starts)
  pool = constrain(_scatter_rows(pool, rows, constrain(sub, sub_specs)), pool_specs)
  return (pool, aux["expert_ids"]) if experts else pool


@_program(static_argnums=(0,), static_argnames=("experts", "specs"),
          donate_argnums=(2,))
def prefill_paged(graphdef, state, pages: dict, page_table: jax.Array, tokens: jax.Array,
                  starts: jax.Array, *, experts: bool = False, specs=None):
  """Write the cache of tokens into a paged cache (`prefill` for `Transformer.init_paged_cache`).

  Args:
    graphdef: the (unstacked) model's graphdef (static).
    state: the model's state.
    pages: paged decode caches (donated).
    page_table: [b, pages_per_seq] int32 pages of each batch row (padding rows and positions
      past a row's pages name page ids >= num_pages: nothing is written there).
    tokens: [b, p] int32 tokens to prefill.
    starts: [b] position of each row's first token.
    experts: also return the MoE expert choices of every prefilled token (static).
    specs: None, or the pages' specs on a mesh (static).

  Returns:
    The updated pages; with `experts`, (pages, expert_ids [moe_layers, b, p, k] int32).
  """
  TRACES["prefill_paged"] += 1
  positions = starts[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
  _, aux, pages = _forward(graphdef, state, tokens, positions, pages, starts, page_table)
  pages = constrain(pages, specs)
  return (pages, aux["expert_ids"]) if experts else pages


@_program(donate_argnums=(0,), static_argnames=("specs",))
def copy_pages(pages: dict, src: jax.Array, dst: jax.Array, *, specs=None) -> dict:
  """Copies pages src[i] to dst[i] in every layer (copy-on-write); all reads come first.

  Pages split over the batch shards (the paged pool on a mesh, `specs`' page dimension) are
  copied per shard: each shard reads the sources it holds, one `psum` over the shards gives
  every shard the n copied pages (a page of another shard arrives that way, nothing else
  moves), and each shard writes the destinations it holds.

  Args:
    pages: paged decode caches, leaves [..., num_pages, page_size, dim] (donated).
    src: [n] int32 pages read (global ids).
    dst: [n] int32 pages overwritten; ids >= num_pages are padding (dropped).
    specs: None, or the pages' specs on a mesh (static).

  Returns:
    The new pages.
  """
  TRACES["copy_pages"] += 1
  def copy(a, src, dst):
    return a.at[..., dst, :, :].set(a[..., src, :, :], mode="drop")
  shards = specs[0][1] if specs and len(specs[0]) > 1 else None  # [kv_heads, num_pages, ..]
  if shards is None:
    return constrain(jax.tree.map(lambda a: copy(a, src, dst), pages), specs)

  def local(pages, src, dst):
    index = jax.lax.axis_index(shards)  # this shard's
    def one(a):
      per = a.shape[-3]
      mine = (src >= index * per) & (src < (index + 1) * per)
      got = jnp.where(mine[:, None, None], a[..., jnp.clip(src - index * per, 0, per - 1), :, :],
                      jnp.zeros((), a.dtype))
      got = jax.lax.psum(got, shards)  # the one shard holding a source contributes it
      at = dst - index * per
      return a.at[..., jnp.where((at >= 0) & (at < per), at, per), :, :].set(got, mode="drop")
    return jax.tree.map(one, pages)

  tree = jax.tree.unflatten(jax.tree.structure(pages), specs)
  return jax.shard_map(local, in_specs=(tree, PartitionSpec(), PartitionSpec()),
                       out_specs=tree)(pages, src, dst)


@_program(donate_argnums=(0,), static_argnames=("specs",))
def copy_row(pool: dict, src: jax.Array, dst: jax.Array, *, specs=None) -> dict:
  """Copies cache row `src` to row `dst` (prefix reuse) in the donated pool.

  Args:
    pool: decode caches [pool_rows, ...] (donated).
    src: int32 [] the row copied.
    dst: int32 [] the row overwritten.
    specs: None, or the pool's specs on a mesh (static).

  Returns:
    The new pool.
  """
  TRACES["copy"] += 1
  return constrain(jax.tree.map(lambda a: a.at[dst].set(a[src]), pool), specs)


@_program(static_argnums=(0, 1, 2, 3), static_argnames=("specs",),
          donate_argnums=(5,))
def decode(graphdef, k: int, top_n: int, experts: bool, state, pool, rows, tokens, lengths,
           active, counts, limits, temperature, top_k, top_p, seeds, stop_ids, max_steps,
           exit_on_finish, *, mask=None, min_p=None, min_tokens=None, specs=None):
  """Up to `max_steps` (<= k) decode steps of the slots batch, in one `lax.while_loop`.

  Arrays are [slots] unless noted. Each step samples with `sampling.sample` (keys: `seeds`
  folded with the tokens generated so far) and stops a slot at a stop token or its limit.

  Token masks: with `mask`, the tokens a row may sample are those its bitmask allows, less its
  stop ids while it holds fewer than `min_tokens` tokens; the others get logit -inf before
  temperature, min-p, top-k, top-p and greedy, and the log-probs, entropy and top log-probs
  are those of the model's distribution renormalised over the allowed tokens (temperature 1,
  no truncation). An all-allowed row (every bit set, min_tokens 0) samples and reports exactly
  what it would without a mask. The mask holds for every step of the call: a caller whose
  masks change per token runs one step per call.

  Args:
    graphdef: the (unstacked) model's graphdef (static).
    k: steps of per-step output room (static).
    top_n: top log-probs recorded per token (static; 0 = none).
    experts: record MoE expert ids (static).
    state: the model's state.
    pool: decode caches [pool_rows, ...] (donated).
    rows: pool row of each slot (out of range = empty slot).
    tokens: the next input token.
    lengths: its position (= tokens in the row).
    active: whether the slot decodes.
    counts: tokens generated so far.
    limits: tokens to generate at most.
    temperature: sampling temperature; 0 = greedy (see `sampling.sample`).
    top_k: keep the k most likely tokens; 0 = off.
    top_p: nucleus mass kept; 1 = off.
    seeds: uint32 per-request seeds.
    stop_ids: [slots, max_stop_token_ids] stop token ids (-1 = none).
    max_steps: steps to run at most (<= k).
    exit_on_finish: stop after the step in which any slot finishes.
    mask: [slots, ceil(vocab / 32)] uint32 token bitmask (`sampling.allowed_tokens`); None:
      no masks (nor min_p / min_tokens: the three come together).
    min_p: [slots] float32 min-p of `sampling.sample`; 0 = off.
    min_tokens: [slots] int32; a row's stop ids are masked while `counts` < this.
    specs: None, or (the pool's specs, the slots' rows' specs) on a mesh (static).

  Returns:
    (pool, steps run, final tokens, lengths, active, counts, per-step outputs {name: [k, ...]}:
    tokens, logprobs, entropy (of the distribution the log-probs come from, see
    `sampling.entropy`), and top_ids/top_logprobs [k, slots, top_n] and expert_ids
    [k, moe_layers, slots, experts_per_token] when asked for).
  """
  TRACES["decode"] += 1
  pool_specs, sub_specs = specs or (None, None)
  sub = constrain(_gather_rows(pool, rows), sub_specs)
  sub, *rest = _decode_loop(graphdef, k, top_n, experts, state, sub, None, tokens, lengths,
                            active, counts, limits, temperature, top_k, top_p, seeds, stop_ids,
                            max_steps, exit_on_finish, mask, min_p, min_tokens, sub_specs)
  return (constrain(_scatter_rows(pool, rows, sub), pool_specs), *rest)


@_program(static_argnums=(0, 1, 2, 3), static_argnames=("specs",),
          donate_argnums=(5,))
def decode_paged(graphdef, k: int, top_n: int, experts: bool, state, pages, page_table, tokens,
                 lengths, active, counts, limits, temperature, top_k, top_p, seeds, stop_ids,
                 max_steps, exit_on_finish, *, mask=None, min_p=None, min_tokens=None,
                 specs=None):
  """`decode` over a paged cache: `pages` (donated) replaces the pool and `page_table`
  [slots, pages_per_seq] int32 (each slot's pages; an empty slot names no page, ids >=
  num_pages) the rows. Every position a slot writes in the call must lie in its own pages;
  `specs` (static): None, or the pages' specs on a mesh. Returns what `decode` returns, with
  the updated pages first."""
  TRACES["decode_paged"] += 1
  return _decode_loop(graphdef, k, top_n, experts, state, pages, page_table, tokens, lengths,
                      active, counts, limits, temperature, top_k, top_p, seeds, stop_ids,
                      max_steps, exit_on_finish, mask, min_p, min_tokens, specs)


def _decode_loop(graphdef, k, top_n, experts, state, cache, page_table, tokens, lengths, active,
                 counts, limits, temperature, top_k, top_p, seeds, stop_ids, max_steps,
                 exit_on_finish, mask=None, min_p=None, min_tokens=None, specs=None):
  """The while loop of `decode` over the slots' caches (rows gathered from the pool, or the
  pages with `page_table`), each step's caches constrained to `specs`."""
  model = nnx.merge(graphdef, state)
  mc = model.cfg
  lm_head = model.lm_head_weight()
  s = tokens.shape[0]
  out = {"tokens": jnp.zeros((k, s), jnp.int32), "logprobs": jnp.zeros((k, s), jnp.float32),
         "entropy": jnp.zeros((k, s), jnp.float32)}
  if top_n:
    out["top_ids"] = jnp.zeros((k, s, top_n), jnp.int32)
    out["top_logprobs"] = jnp.zeros((k, s, top_n), jnp.float32)
  if experts:
    out["expert_ids"] = jnp.zeros((k, mc.num_moe_layers, s, mc.experts_per_token), jnp.int32)
  base_keys = jax.vmap(jax.random.key)(seeds)
  allowed = None if mask is None else sampling.allowed_tokens(mask, lm_head.shape[-1])

  def cond(carry):
    step, _, _, _, act, _, finished, _ = carry
    return (step < max_steps) & jnp.any(act) & ~(exit_on_finish & finished)

  def body(carry):
    step, sub, tok, length, act, count, finished, out = carry
    h, aux, sub = _forward(graphdef, state, tok[:, None], length[:, None], sub, length,
                           page_table)
    sub = constrain(sub, specs)
    logits = jnp.dot(h[:, 0].astype(jnp.float32), lm_head)
    if allowed is not None:
      logits = sampling.restrict(logits, allowed, count, min_tokens, stop_ids)
    logp = jax.nn.log_softmax(logits, axis=-1)
    keys = jax.vmap(jax.random.fold_in)(base_keys, count)
    nxt = sampling.sample(logits, temperature, top_k, top_p, keys, min_p)
    out = dict(out)
    out["tokens"] = out["tokens"].at[step].set(nxt)
    out["logprobs"] = out["logprobs"].at[step].set(
        jnp.take_along_axis(logp, nxt[:, None], axis=-1)[:, 0])
    out["entropy"] = out["entropy"].at[step].set(sampling.entropy(logp))
    if top_n:
      vals, ids = jax.lax.top_k(logp, top_n)
      out["top_ids"] = out["top_ids"].at[step].set(ids)
      out["top_logprobs"] = out["top_logprobs"].at[step].set(vals)
    if experts:
      out["expert_ids"] = out["expert_ids"].at[step].set(aux["expert_ids"][:, :, 0])
    count = count + act
    done = act & (jnp.any(nxt[:, None] == stop_ids, axis=-1) | (count >= limits))
    length = length + act
    tok = jnp.where(act, nxt, tok)
    return (step + 1, sub, tok, length, act & ~done, count, finished | jnp.any(done), out)

  carry = (jnp.int32(0), cache, tokens, lengths, active, counts, jnp.bool_(False), out)
  step, cache, tokens, lengths, active, counts, _, out = jax.lax.while_loop(cond, body, carry)
  return cache, step, tokens, lengths, active, counts, out
