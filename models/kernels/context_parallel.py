"""Tree attention over a token-sharded row (context parallelism on the `sequence` mesh axis).

With `mesh.sequence = n`, each row of L tokens is split into n contiguous chunks of C = L / n
tokens: shard r holds queries, keys, values and `end` of row indices [r·C, (r+1)·C). The tree
rule (docs/design.md §3) lets query i attend key j iff j <= i < end[j].

Skipping. Rows are in depth-first pre-order, so every visible key j <= i: chunks of later
shards are never visible to shard r. Inside a chunk, keys are walked in blocks of `block`
rows; a key block [k0, k1) is visible to the shard's queries [q_lo, q_hi] iff

    k0 <= q_hi  and  max(end[k0:k1]) > q_lo,

and a block that fails the test is skipped with `lax.cond` (no matmul). The test needs only
the block's start and the maximum of its `end` values, which travel with the chunk.
`expected_block_counts` gives, with NumPy, how many blocks each shard computes;
`tree_attention(..., return_counts=True)` reports what the kernel did.

Ring ("ring"). Step s = 0 .. n-1: shard r holds the K/V/end chunk of shard (r - s) mod n,
merges the visible blocks into its running softmax statistics (running max m, normaliser l
and fp32 accumulator, the flash / log-sum-exp merge; m is a stop-gradient constant, since
the result does not depend on it), then passes the chunk to shard r + 1 with
`lax.ppermute`. A chunk from a later shard is skipped whole. Gradients come from automatic
differentiation of this loop: the transpose of `ppermute` sends dK/dV back around the ring,
and each step is rematerialised (`jax.checkpoint`), so the backward holds the chunks a shard
received (n·C keys and values, like all-gather) plus one step's [C, block] probabilities per
block at a time.

All-gather ("all_gather"). One `all_gather` of K/V/end along the axis, then the same
per-chunk loop; its backward is a reduce-scatter of dK/dV. It moves the same bytes per
device as the ring, but in one collective that cannot overlap this layer's compute, and it
holds all n chunks at once. It is the cheaper choice when K/V is small next to the query-side
work (GQA with few key/value heads; short rows; n of 2) because one large collective has
less latency than n - 1 ppermutes; the ring is the choice when a row's K/V does not fit
beside the activations (long rows, MLA's per-head expanded keys) or when the per-step compute
hides the transfers. "auto" picks all-gather when the gathered K/V of a shard's rows is at
most `ALL_GATHER_MAX_BYTES`, the ring otherwise.

Cost. Each shard computes only the visible blocks, but in a depth-first row the later shards
see more keys (causal-like imbalance: for one causal row shard r computes r + 1 chunks); the
ring always takes n - 1 transfer steps of C·kv bytes. Every chunk pair is computed by plain
XLA matmuls (the per-chunk flash step is not a Pallas kernel).

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

BLOCK = 128  # key rows per skip test inside a chunk
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
    block: key rows per skip test; the largest divisor of the chunk length up to it is used.
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
    kv_bytes = rows * length * kvh * (k.shape[-1] * k.dtype.itemsize + v.shape[-1] * v.dtype.itemsize)
    method = "all_gather" if kv_bytes <= ALL_GATHER_MAX_BYTES else "ring"
  cfg = _Cfg(float(scale), math.gcd(block, chunk), chunk, n, h // kvh, method)
  seq_spec = seq[0] if len(seq) == 1 else seq
  rows_spec = PartitionSpec(batch, seq_spec, heads, None)
  run = jax.shard_map(functools.partial(_local, cfg, seq, _names(batch)), mesh=mesh,
                      in_specs=(rows_spec, rows_spec, rows_spec, PartitionSpec(batch, seq_spec)),
                      out_specs=(rows_spec, PartitionSpec(heads), PartitionSpec(batch, seq_spec)),
                      check_vma=False)
  out, max_logits, counts = run(q, k, v, end.astype(jnp.int32))
  max_logits = jax.lax.stop_gradient(max_logits)
  return (out, max_logits, counts) if return_counts else (out, max_logits)


class _Cfg(tuple):
  """Static configuration: scale, key block, chunk length, shards, GQA groups, method."""

  def __new__(cls, scale, block, chunk, shards, groups, method):
    return super().__new__(cls, (scale, block, chunk, shards, groups, method))

  scale = property(lambda s: s[0])
  block = property(lambda s: s[1])
  chunk = property(lambda s: s[2])
  shards = property(lambda s: s[3])
  groups = property(lambda s: s[4])
  method = property(lambda s: s[5])


def _local(cfg, seq, batch, q, k, v, end):
  """One shard: q/k/v [b, C, heads, d], end [b, C] -> (out, max_logits [heads], counts [b, 1])."""
  b, c, h, _ = q.shape
  kvh, g, dv = k.shape[2], cfg.groups, v.shape[-1]
  r = jax.lax.axis_index(seq)
  q_lo = r * c
  qg = q.reshape(b, c, kvh, g, q.shape[-1])
  state = (jnp.full((b, kvh, g, c), MASK_VALUE, jnp.float32), jnp.zeros((b, kvh, g, c), jnp.float32),
           jnp.zeros((b, kvh, g, c, dv), jnp.float32), jnp.zeros((b,), jnp.int32))
  visit = jax.checkpoint(functools.partial(_visit, cfg, qg, q_lo))

  def merge(state, kv, src):
    # a chunk from a later shard holds only keys j > every query of this shard
    return jax.lax.cond(src <= r, lambda s: visit(s, kv, src), lambda s: s, state)

  if cfg.method == "ring":
    ring = [(i, (i + 1) % cfg.shards) for i in range(cfg.shards)]

    def step(carry, s):
      state, kv = carry
      state = merge(state, kv, (r - s) % cfg.shards)
      return (state, jax.lax.ppermute(kv, seq, ring)), None

    (state, kv), _ = jax.lax.scan(step, (state, (k, v, end)), jnp.arange(cfg.shards - 1))
    state = merge(state, kv, (r + 1) % cfg.shards)  # step n - 1: the last chunk, no transfer
  else:
    full = jax.lax.all_gather((k, v, end), seq, axis=1, tiled=True)

    def step(state, src):
      kv = tuple(jax.lax.dynamic_slice_in_dim(x, src * c, c, axis=1) for x in full)
      return merge(state, kv, src), None

    state, _ = jax.lax.scan(step, state, jnp.arange(cfg.shards))
  m, l, acc, counts = state
  out = (acc / l[..., None]).transpose(0, 3, 1, 2, 4).reshape(b, c, h, dv)
  max_logits = m.max(axis=(0, 3)).reshape(h)
  max_logits = jax.lax.pmax(jax.lax.stop_gradient(max_logits), seq + batch)
  return out.astype(q.dtype), max_logits, counts[:, None]


def _visit(cfg, qg, q_lo, state, kv, src):
  """Merges the visible key blocks of the chunk of shard `src` into each row's statistics."""
  kc, vc, ec = kv
  bk, c = cfg.block, cfg.chunk
  nb = c // bk
  k_start = src * c
  i = q_lo + jnp.arange(c)

  def row(args):
    qr, kr, vr, er, m, l, acc, count = args
    kmax = er.reshape(nb, bk).max(-1)

    @jax.checkpoint
    def compute(j, carry):
      m, l, acc, count = carry
      k0 = j * bk
      kb = jax.lax.dynamic_slice_in_dim(kr, k0, bk)
      vb = jax.lax.dynamic_slice_in_dim(vr, k0, bk)
      eb = jax.lax.dynamic_slice_in_dim(er, k0, bk)
      s = jnp.einsum("qkgd,skd->kgqs", qr, kb, preferred_element_type=jnp.float32) * cfg.scale
      jj = k_start + k0 + jnp.arange(bk)
      mask = (jj[None, :] <= i[:, None]) & (i[:, None] < eb[None, :])
      m_new = jax.lax.stop_gradient(jnp.maximum(m, jnp.where(mask, s, MASK_VALUE).max(-1)))
      # masked logits go through exp as m_new (exp(0) = 1, then zeroed): exp of a masked
      # pair's real logit minus a still-masked running max would overflow and poison the VJP
      p = jnp.where(mask, jnp.exp(jnp.where(mask, s, m_new[..., None]) - m_new[..., None]), 0.0)
      alpha = jnp.exp(m - m_new)
      pv = jnp.einsum("kgqs,skd->kgqd", p.astype(vr.dtype), vb, preferred_element_type=jnp.float32)
      return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + pv, count + 1

    def body(j, carry):
      visible = (k_start + j * bk <= q_lo + c - 1) & (kmax[j] > q_lo)
      return jax.lax.cond(visible, functools.partial(compute, j), lambda x: x, carry)

    return jax.lax.fori_loop(0, nb, body, (m, l, acc, count))

  return jax.lax.map(row, (qg, kc, vc, ec) + tuple(state))


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
  visible = (starts[None, None, :] <= q_hi[None, :, None]) & (kmax[:, None, :] > q_lo[None, :, None])
  return visible.sum(-1)
