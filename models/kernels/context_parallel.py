"""Tree attention over a token-sharded row (context parallelism on the `sequence` mesh axis).

With `mesh.sequence = n`, each row of L tokens is split into n contiguous chunks of C = L / n
tokens: shard r holds queries, keys, values and `end` of row indices [r·C, (r+1)·C). The tree
rule (docs/design.md §3) lets query i attend key j iff j <= i < end[j].

Skipping. Rows are in depth-first pre-order, so every visible key j <= i: chunks of later
shards are never visible to shard r. Inside a chunk, keys are walked in blocks of `block`
rows; a key block [k0, k1) is visible to the shard's queries [q_lo, q_hi] iff

    k0 <= q_hi  and  max(end[k0:k1]) > q_lo,

and a block that fails the test is skipped with `lax.cond` (no matmul). The test needs only
the block's start and the maximum of its `end` values, which travel with the chunk. A visible
block is seen only by the contiguous queries [k0, max(end[k0:k1])), so it is computed against
the query blocks of that range only (a tree row of many short subtrees costs what its mask
allows, not C x C per chunk pair).
`expected_block_counts` gives, with NumPy, how many blocks each shard computes;
`tree_attention(..., return_counts=True)` reports what the kernel did.

Ring ("ring"). Step s = 0 .. n-1: shard r holds the K/V/end chunk of shard (r - s) mod n,
merges the visible blocks into its running softmax statistics (running max m, normaliser l
and fp32 accumulator: the flash / log-sum-exp merge), then passes the chunk to shard r + 1
with `lax.ppermute`. A chunk from a later shard is skipped whole. The forward keeps only the
output and each query's log-sum-exp. The backward (a custom VJP, the flash backward with
recomputed probabilities) runs the same ring again: dQ accumulates on the query's shard, and
each chunk's dK/dV accumulators travel with it and take one last step home. A shard holds
two chunks of K/V (its own and the visiting one) and one [block, block] tile of
probabilities at a time.

All-gather ("all_gather"). One `all_gather` of K/V/end along the axis, then the same
per-chunk loop; its backward gathers again and reduce-scatters dK/dV (`psum_scatter`). It
moves the same bytes per device as the ring, but in one collective that cannot overlap this
layer's compute, and it holds all n chunks (and full-row dK/dV accumulators) at once. It is
the cheaper choice when K/V is small next to the query-side work (GQA with few key/value
heads; short rows; n of 2) because one large collective has less latency than n - 1
ppermutes; the ring is the choice when a row's K/V does not fit beside the activations (long
rows, MLA's per-head expanded keys) or when the per-step compute hides the transfers. "auto"
picks all-gather when the gathered K/V of a shard's rows is at
most `ALL_GATHER_MAX_BYTES`, the ring otherwise.

Cost. Each shard computes only the visible blocks, but in a depth-first row the later shards
see more keys (causal-like imbalance: for one causal row shard r computes r + 1 chunks); the
ring always takes n - 1 transfer steps of C·kv bytes forward and n of C·(kv + dkv) bytes
backward (`rl.packing.pack(..., shards=n)` evens out the visible pairs per shard where a
row's parts allow). Every chunk pair is computed by plain XLA matmuls (the per-chunk flash
step is not a Pallas kernel).

Shapes: q [batch, L, heads, qk_dim], k [batch, L, kv_heads, qk_dim], v [batch, L, kv_heads,
v_dim], end [batch, L] (global row indices) -> out [batch, L, heads, v_dim] (q.dtype),
max_logits [heads] fp32 (stop-gradient, the max over allowed pairs of the whole batch, for
QK-Clip), and with return_counts an int32 [batch, n] count of the key blocks each shard
computed for each row.

References:
  Liu et al., "Ring Attention with Blockwise Transformers for Near-Infinite Context",
  arXiv:2310.01889.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from models.kernels.mask import MASK_VALUE

BLOCK = 128  # rows per key block (skip test) and per query tile inside a chunk
METHODS = ("ring", "all_gather", "auto")
ALL_GATHER_MAX_BYTES = 256 * 2**20  # "auto": gather K/V when a shard's rows' K/V is this small


def _names(axes) -> tuple[str, ...]:
  return (axes,) if isinstance(axes, str) else tuple(axes or ())


def tree_attention(q: jax.Array, k: jax.Array, v: jax.Array, end: jax.Array, *, scale: float,
                   axis: Any, batch: Any = None, heads: Any = None, block: int = BLOCK,
                   method: str = "auto", return_counts: bool = False):
  """Tree attention with the row dimension sharded over mesh axes `axis`.

  Runs inside `jax.shard_map` over the current mesh (`jax.set_mesh`).

  Args:
    q: [batch, L, heads, qk_dim] queries.
    k: [batch, L, kv_heads, qk_dim] keys; heads is a multiple of kv_heads (GQA).
    v: [batch, L, kv_heads, v_dim] values.
    end: [batch, L] int, exclusive subtree end of each key (row indices of the whole row).
    scale: the softmax scale applied to q·k.
    axis: the mesh axis (or tuple of axes) the L dimension is split over.
    batch: mesh axes of the batch dimension, or None.
    heads: mesh axes of the head dimension, or None (ignored unless they divide kv_heads).
    block: rows per key block (skip test) and per query tile; the largest divisor of the
      chunk length up to it is used.
    method: "ring" | "all_gather" | "auto" (see the module docstring).
    return_counts: also return the [batch, n] int32 count of key blocks each shard computed.

  Returns:
    (out [batch, L, heads, v_dim] in q.dtype, max_logits [heads] fp32 stop-gradient), plus the
    counts with return_counts.

  Raises:
    ValueError: no mesh set, an unknown method, heads not a multiple of kv_heads, or L not a
      multiple of the axis size.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    raise ValueError("context-parallel attention needs a mesh (jax.set_mesh)")
  if method not in METHODS:
    raise ValueError(f"method={method!r}: expected one of {METHODS}")
  b, length, h, _ = q.shape
  kvh = k.shape[2]
  if h % kvh:
    raise ValueError(f"heads={h} is not a multiple of kv_heads={kvh}")
  seq = _names(axis)
  n = math.prod(mesh.shape[a] for a in seq)
  if length % n:
    raise ValueError(f"row length {length} is not a multiple of the sequence shards {n}")
  if heads is not None and kvh % math.prod(mesh.shape[a] for a in _names(heads)):
    heads = None  # a GQA group stays on one shard
  if batch is not None and b % math.prod(mesh.shape[a] for a in _names(batch)):
    batch = None  # fewer rows than batch shards: each shard takes all rows
  chunk = length // n
  if method == "auto":
    rows = b // math.prod(mesh.shape[a] for a in _names(batch))
    kv_bytes = rows * length * kvh * (k.shape[-1] * k.dtype.itemsize
                                      + v.shape[-1] * v.dtype.itemsize)
    method = "all_gather" if kv_bytes <= ALL_GATHER_MAX_BYTES else "ring"
  heads_spec = heads if heads is None or isinstance(heads, str) else tuple(heads)
  batch_spec = batch if batch is None or isinstance(batch, str) else tuple(batch)
  cfg = _Cfg(float(scale), math.gcd(block, chunk), chunk, n, h // kvh, method, seq,
             batch_spec, heads_spec)
  out, max_logits, counts = _attend(cfg, q, k, v, end.astype(jnp.int32))
  max_logits = jax.lax.stop_gradient(max_logits)
  return (out, max_logits, counts) if return_counts else (out, max_logits)


class _Cfg(tuple):
  """Static configuration (hashable for custom_vjp's nondiff argument)."""

  def __new__(cls, scale, block, chunk, shards, groups, method, seq, batch, heads):
    return super().__new__(cls, (scale, block, chunk, shards, groups, method, seq, batch, heads))

  scale = property(lambda s: s[0])
  block = property(lambda s: s[1])  # rows per key block and per query tile
  chunk = property(lambda s: s[2])  # C, a shard's rows
  shards = property(lambda s: s[3])  # n
  groups = property(lambda s: s[4])  # query heads per key/value head
  method = property(lambda s: s[5])
  seq = property(lambda s: s[6])  # tuple of the sequence mesh axes
  batch = property(lambda s: s[7])  # PartitionSpec entry of the batch dimension
  heads = property(lambda s: s[8])  # PartitionSpec entry of the head dimension

  def specs(self):
    """PartitionSpecs of [b, L, heads, d] arrays, [b, L] arrays and [heads]."""
    seq = self.seq[0] if len(self.seq) == 1 else self.seq
    return (PartitionSpec(self.batch, seq, self.heads, None), PartitionSpec(self.batch, seq),
            PartitionSpec(self.heads))

  def shard_map(self, fn, in_specs, out_specs):
    return jax.shard_map(functools.partial(fn, self), mesh=jax.sharding.get_abstract_mesh(),
                         in_specs=in_specs, out_specs=out_specs, check_vma=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(cfg, q, k, v, end):
  out, _, max_logits, counts = _forward(cfg, q, k, v, end)
  return out, max_logits, counts


def _attend_fwd(cfg, q, k, v, end):
  out, lse, max_logits, counts = _forward(cfg, q, k, v, end)
  return (out, max_logits, counts), (q, k, v, end, out, lse)


def _attend_bwd(cfg, residuals, cotangents):
  q, k, v, end, out, lse = residuals
  rows, ends, _ = cfg.specs()
  run = cfg.shard_map(_backward_local, (rows,) * 3 + (ends, rows, rows, rows), (rows,) * 3)
  dq, dk, dv = run(q, k, v, end, out, lse, cotangents[0])  # max_logits, counts: no gradient
  return dq, dk, dv, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def _forward(cfg, q, k, v, end):
  rows, ends, head = cfg.specs()
  run = cfg.shard_map(_forward_local, (rows, rows, rows, ends), (rows, rows, head, ends))
  return run(q, k, v, end)


def _chunks(cfg, k, v, end, visit, state, carried=()):
  """Runs `visit(state, (k, v, end) + carried, src)` on the chunk of every shard src <= this
  shard's index (later chunks are invisible), ring or all-gather; returns the final state and
  the carried values of this shard's own chunk (summed over shards for all-gather)."""
  r = jax.lax.axis_index(cfg.seq)
  c, n = cfg.chunk, cfg.shards

  def merge(state, chunk, src):
    return jax.lax.cond(src <= r, visit, lambda s, ch, _: (s, ch[3:]), state, chunk, src)

  if cfg.method == "ring":
    ring = [(i, (i + 1) % n) for i in range(n)]

    def step(travel, s):
      state, chunk = travel
      state, extra = merge(state, chunk, (r - s) % n)
      return (state, jax.lax.ppermute(chunk[:3] + extra, cfg.seq, ring)), None

    (state, chunk), _ = jax.lax.scan(step, (state, (k, v, end) + carried), jnp.arange(n - 1))
    state, extra = merge(state, chunk, (r + 1) % n)  # step n - 1: the last chunk
    # the chunk held now is shard r + 1's: its carried values go home
    return state, jax.lax.ppermute(extra, cfg.seq, ring) if extra else ()
  full = jax.lax.all_gather((k, v, end), cfg.seq, axis=1, tiled=True)
  acc = tuple(jnp.zeros(x.shape[:1] + (n * c,) + x.shape[2:], x.dtype) for x in carried)

  def step(travel, src):
    state, acc = travel
    chunk = tuple(jax.lax.dynamic_slice_in_dim(x, src * c, c, axis=1) for x in full)
    state, extra = merge(state, chunk + tuple(
        jax.lax.dynamic_slice_in_dim(a, src * c, c, axis=1) for a in acc), src)
    acc = tuple(jax.lax.dynamic_update_slice_in_dim(a, e, src * c, axis=1)
                for a, e in zip(acc, extra))
    return (state, acc), None

  (state, acc), _ = jax.lax.scan(step, (state, acc), jnp.arange(n))
  return state, tuple(jax.lax.psum_scatter(a, cfg.seq, scatter_dimension=1, tiled=True)
                      for a in acc)


def _blocks(cfg, kr, er, src, fn, carry, per_key_block=None):
  """Runs fn(carry, k0, q0) on the (query block, key block) tiles that can hold an allowed pair.

  Key blocks [k0, k1) of the chunk of shard `src` that fail the shard test are skipped; for
  the others, the queries that can see any of their keys are the contiguous rows [k0,
  max(end[k0:k1])), so only the query blocks meeting that range run (a dynamic trip count:
  the loops are never differentiated, the backward being explicit).
  `per_key_block(carry, k0, fn_loop)` wraps the query loop of a visible key block.
  """
  c, bk = cfg.chunk, cfg.block
  q_lo = jax.lax.axis_index(cfg.seq) * c
  kmax = er.reshape(c // bk, bk).max(-1)

  def body(j, carry):
    k0 = j * bk
    start = src * c + k0  # the block's first key, a row index
    visible = (start <= q_lo + c - 1) & (kmax[j] > q_lo)

    def queries(carry):
      first = jnp.maximum(start - q_lo, 0) // bk
      last = (jnp.minimum(kmax[j] - q_lo, c) - 1) // bk
      return jax.lax.fori_loop(first, last + 1, lambda qi, x: fn(x, k0, qi * bk), carry)

    run = queries if per_key_block is None else lambda x: per_key_block(x, k0, queries)
    return jax.lax.cond(visible, run, lambda x: x, carry)

  return jax.lax.fori_loop(0, c // bk, body, carry)


def _block_logits(cfg, qb, kb, eb, src, k0, q0):
  """Masked scaled logits [kv_heads, groups, block, block] fp32 of a tile, and its mask."""
  c = cfg.chunk
  i = jax.lax.axis_index(cfg.seq) * c + q0 + jnp.arange(qb.shape[0])
  jj = src * c + k0 + jnp.arange(kb.shape[0])
  s = jnp.einsum("qkgd,skd->kgqs", qb, kb, preferred_element_type=jnp.float32) * cfg.scale
  mask = (jj[None, :] <= i[:, None]) & (i[:, None] < eb[None, :])
  return jnp.where(mask, s, MASK_VALUE), mask


def _slice(x, start, size, axis):
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _put(x, update, start, axis):
  return jax.lax.dynamic_update_slice_in_dim(x, update, start, axis=axis)


def _forward_local(cfg, q, k, v, end):
  """One shard: q/k/v [b, C, heads, d], end [b, C] -> out, lse [b, C, kv_heads, groups],
  max_logits [heads], counts [b, 1]."""
  b, c, h, _ = q.shape
  kvh, g, dv, bk = k.shape[2], cfg.groups, v.shape[-1], cfg.block
  qg = q.reshape(b, c, kvh, g, q.shape[-1])

  def visit(state, chunk, src):
    def row(args):
      qr, kr, vr, er, m, l, acc, count = args

      def tile(carry, k0, q0):
        m, l, acc, count = carry
        kb, vb, eb = (_slice(x, k0, bk, 0) for x in (kr, vr, er))
        s, mask = _block_logits(cfg, _slice(qr, q0, bk, 0), kb, eb, src, k0, q0)
        m_b, l_b, acc_b = _slice(m, q0, bk, 2), _slice(l, q0, bk, 2), _slice(acc, q0, bk, 2)
        m_new = jnp.maximum(m_b, s.max(-1))
        # a masked logit minus a still-masked running max would be exp(0); zero it
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m_b - m_new)
        pv = jnp.einsum("kgqs,skd->kgqd", p.astype(vr.dtype), vb,
                        preferred_element_type=jnp.float32)
        return (_put(m, m_new, q0, 2), _put(l, l_b * alpha + p.sum(-1), q0, 2),
                _put(acc, acc_b * alpha[..., None] + pv, q0, 2), count)

      counted = lambda carry, k0, queries: queries(carry[:3] + (carry[3] + 1,))
      return _blocks(cfg, kr, er, src, tile, (m, l, acc, count), counted)

    return jax.lax.map(row, (qg,) + tuple(chunk) + tuple(state)), ()

  state = (jnp.full((b, kvh, g, c), MASK_VALUE, jnp.float32),
           jnp.zeros((b, kvh, g, c), jnp.float32),
           jnp.zeros((b, kvh, g, c, dv), jnp.float32), jnp.zeros((b,), jnp.int32))
  (m, l, acc, counts), _ = _chunks(cfg, k, v, end, visit, state)
  out = (acc / l[..., None]).transpose(0, 3, 1, 2, 4).reshape(b, c, h, dv)
  lse = (m + jnp.log(l)).transpose(0, 3, 1, 2)  # [b, C, kvh, g]
  max_logits = jax.lax.pmax(m.max(axis=(0, 3)).reshape(h), cfg.seq + _names(cfg.batch))
  return out.astype(q.dtype), lse, max_logits, counts[:, None]


def _backward_local(cfg, q, k, v, end, out, lse, d_out):
  """One shard of the flash backward: P = exp(S - lse), D = rowsum(dO · O), dV = Pᵀ dO,
  dS = P (dO Vᵀ - D), dQ = scale dS K, dK = scale dSᵀ Q; dK/dV travel with their chunk."""
  b, c, h, _ = q.shape
  kvh, g, bk = k.shape[2], cfg.groups, cfg.block
  grouped = lambda x: x.reshape(b, c, kvh, g, x.shape[-1])
  qg, dog = grouped(q), grouped(d_out)
  delta = jnp.einsum("bqkgd,bqkgd->bkgq", dog.astype(jnp.float32),
                     grouped(out).astype(jnp.float32))
  lse = lse.transpose(0, 2, 3, 1)  # [b, kvh, g, C]

  def visit(dq, chunk, src):
    def row(args):
      qr, dor, lr, dr, dqr, kr, vr, er, dkr, dvr = args

      def tile(carry, k0, q0):
        dq, dk, dv, dkb, dvb = carry
        kb, vb, eb = (_slice(x, k0, bk, 0) for x in (kr, vr, er))
        qb, dob = _slice(qr, q0, bk, 0), _slice(dor, q0, bk, 0)
        s, mask = _block_logits(cfg, qb, kb, eb, src, k0, q0)
        p = jnp.where(mask, jnp.exp(s - _slice(lr, q0, bk, 2)[..., None]), 0.0)
        dp = jnp.einsum("qkgd,skd->kgqs", dob, vb, preferred_element_type=jnp.float32)
        ds = p * (dp - _slice(dr, q0, bk, 2)[..., None])
        dq_b = _slice(dq, q0, bk, 0) + jnp.einsum("kgqs,skd->qkgd", ds.astype(kr.dtype), kb,
                                                  preferred_element_type=jnp.float32)
        dkb = dkb + jnp.einsum("kgqs,qkgd->skd", ds.astype(qr.dtype), qb,
                               preferred_element_type=jnp.float32)
        dvb = dvb + jnp.einsum("kgqs,qkgd->skd", p.astype(vr.dtype), dob,
                               preferred_element_type=jnp.float32)
        return _put(dq, dq_b, q0, 0), dk, dv, dkb, dvb

      def key_block(carry, k0, queries):
        dq, dk, dv = carry
        zero = lambda acc: jnp.zeros((bk,) + acc.shape[1:], jnp.float32)
        dq, dk, dv, dkb, dvb = queries((dq, dk, dv, zero(dk), zero(dv)))
        add = lambda acc, x: _put(acc, _slice(acc, k0, bk, 0) + x, k0, 0)
        return dq, add(dk, dkb), add(dv, dvb)

      return _blocks(cfg, kr, er, src, tile, (dqr, dkr, dvr), key_block)

    dq, dk, dv = jax.lax.map(row, (qg, dog, lse, delta, dq) + tuple(chunk))
    return dq, (dk, dv)

  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  dq, (dk, dv) = _chunks(cfg, k, v, end, visit, zeros(qg), (zeros(k), zeros(v)))
  dq = dq.reshape(q.shape) * cfg.scale
  return dq.astype(q.dtype), (dk * cfg.scale).astype(k.dtype), dv.astype(v.dtype)


def expected_block_counts(end: np.ndarray, shards: int, block: int = BLOCK) -> np.ndarray:
  """How many key blocks each shard computes for each row, by the skipping rule.

  Args:
    end: [batch, L] int, the rows' `end`.
    shards: the sequence axis size n (divides L).
    block: the kernel's `block` argument.

  Returns:
    [batch, n] int: for shard r with queries [q_lo, q_hi], the number of key blocks [k0, k1)
    (of every shard's chunk) with k0 <= q_hi and max(end[k0:k1]) > q_lo.
  """
  end = np.asarray(end)
  b, length = end.shape
  chunk = length // shards
  bk = math.gcd(block, chunk)
  starts = np.arange(0, length, bk)
  kmax = end.reshape(b, length // bk, bk).max(-1)  # [b, blocks]
  q_lo = np.arange(shards) * chunk
  q_hi = q_lo + chunk - 1
  visible = ((starts[None, None, :] <= q_hi[None, :, None])
             & (kmax[:, None, :] > q_lo[None, :, None]))
  return visible.sum(-1)
