"""Tree-masked flash attention in plain XLA: blocked, skipping fully masked blocks.

Same signature and contract as the reference `models.kernels.attention.attention` (without
`q_index`) and the Pallas kernels beside it. It is the long-row path for backends without a
Pallas kernel (CPU): the reference materialises [batch, heads, L, L] logits and spends L² work
on every row whatever `end` says, while this one walks (query block, key block) pairs with
`lax.cond`, so a packed row of short sequences or a sparse tree costs what its mask allows and
memory is O(L · block).

Shapes: q [batch, L, heads, qk_dim], k [batch, L, kv_heads, qk_dim], v [batch, L, kv_heads,
v_dim], end [batch, L] -> out [batch, L, heads, v_dim] (q.dtype), max_logits [heads] fp32
(stop-gradient), and with `debug_blocks=True` a bool bitmap [batch, q blocks, k blocks] of the
block pairs the forward computed.

Block tests (the Pallas kernels' rule, docs in tree_attention_tpu.py): for query block [q0, q1)
and key block [k0, k1) the pair is skipped iff k0 >= q1 or max(end[k0:k1]) <= q0. The forward
loop of a query block runs over key blocks [0, (q1 - 1) // block_k] and skips with `cond`; the
backward's loop of a key block runs over the contiguous range of query blocks that can see it,
[k0 // block_q, (max(end[k0:k1]) - 1) // block_q], so it needs no skip test at all.

Standard flash backward with recomputed probabilities: D = rowsum(dO · O), P = exp(S - lse),
dV = Pᵀ dO, dS = P (dO Vᵀ - D), dQ = scale dS K, dK = scale dSᵀ Q. P and dS of a block pair are
computed once and feed dV, dK and dQ (5 block matmuls, not 7 as with separate dQ and dK/dV
loops); dQ lives in one fp32 buffer that the key blocks add to in ascending order, the order a
per-query-block loop adds them in, so the result is the same to the bit. Softmax statistics and
accumulators are fp32; matmul operands stay in the input dtype.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from models.kernels.mask import MASK_VALUE


def tree_attention(q: jax.Array, k: jax.Array, v: jax.Array, end: jax.Array, *, scale: float,
                   block_q: int = 256, block_k: int = 256, debug_blocks: bool = False):
  """Blocked tree attention under the rule j <= i < end[j] (see the module docstring).

  Args:
    q: [batch, L, heads, qk_dim] queries.
    k: [batch, L, kv_heads, qk_dim] keys; heads is a multiple of kv_heads (GQA).
    v: [batch, L, kv_heads, v_dim] values.
    end: [batch, L] int, exclusive subtree end of each key (clipped to [j + 1, L]).
    scale: the softmax scale applied to q·k.
    block_q: query rows per block (> 0).
    block_k: key rows per block (> 0).
    debug_blocks: also return the bitmap of computed block pairs.

  Returns:
    (out [batch, L, heads, v_dim] in q.dtype, max_logits [heads] fp32 stop-gradient), plus a
    bool [batch, q blocks, k blocks] bitmap of the block pairs the forward computed with
    debug_blocks=True.

  Raises:
    ValueError: heads not a multiple of kv_heads, or a block size <= 0.
  """
  b, length, heads, _ = q.shape
  kv_heads = k.shape[2]
  if heads % kv_heads:
    raise ValueError(f"heads={heads} is not a multiple of kv_heads={kv_heads}")
  if block_q <= 0 or block_k <= 0:
    raise ValueError(f"block_q={block_q}, block_k={block_k}: must be positive")
  step = math.lcm(block_q, block_k)
  padded = -(-length // step) * step
  pad = padded - length
  j = jnp.arange(padded, dtype=jnp.int32)
  # Padded keys see only themselves (end = j + 1); clipping keeps every query's own key allowed.
  end = jnp.concatenate([end.astype(jnp.int32), jnp.broadcast_to(j[length:] + 1, (b, pad))], 1)
  end = jnp.clip(end, j + 1, padded)
  widen = lambda x: jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
  cfg = _Cfg(float(scale), block_q, block_k, length, padded, heads // kv_heads)
  out, max_logits, bitmap = _flash(cfg, widen(q), widen(k), widen(v), end)
  out = out[:, :length]
  return (out, max_logits, bitmap) if debug_blocks else (out, max_logits)


class _Cfg(tuple):
  """Static configuration (hashable for custom_vjp's nondiff argument)."""

  def __new__(cls, scale, bq, bk, length, padded, groups):
    return super().__new__(cls, (scale, bq, bk, length, padded, groups))

  scale = property(lambda s: s[0])
  bq = property(lambda s: s[1])
  bk = property(lambda s: s[2])
  length = property(lambda s: s[3])
  padded = property(lambda s: s[4])
  groups = property(lambda s: s[5])


def _grouped(cfg, q):
  """[b, L, heads, d] -> [b, L, kv_heads, groups, d]."""
  return q.reshape(*q.shape[:2], q.shape[2] // cfg.groups, cfg.groups, q.shape[3])


def _block_logits(cfg, qb, kb, end_b, q0, k0):
  """Masked scaled logits [kv_heads, groups, bq, bk] fp32 of one block pair, and its mask."""
  s = jnp.einsum("qkgd,skd->kgqs", qb, kb, preferred_element_type=jnp.float32) * cfg.scale
  i = q0 + jnp.arange(qb.shape[0])[:, None]
  jj = k0 + jnp.arange(kb.shape[0])[None, :]
  mask = (jj <= i) & (i < end_b[None, :])
  return jnp.where(mask, s, MASK_VALUE), mask


def _forward(cfg, q, k, v, end):
  """(out [b, L, heads, dv], lse [b, kv_heads, groups, L], max_logits [heads], bitmap)."""
  b, padded, kvh, _ = k.shape
  g, dv, bq, bk = cfg.groups, v.shape[-1], cfg.bq, cfg.bk
  nq, nk = padded // bq, padded // bk
  qg = _grouped(cfg, q)
  kmax = end.reshape(b, nk, bk).max(-1)

  def one_q_block(idx):
    bi, qi = idx // nq, idx % nq
    q0 = qi * bq
    qb = jax.lax.dynamic_slice_in_dim(qg[bi], q0, bq)

    def body(kj, carry):
      def compute(carry):
        m, l, acc, seen = carry
        k0 = kj * bk
        kb = jax.lax.dynamic_slice_in_dim(k[bi], k0, bk)
        vb = jax.lax.dynamic_slice_in_dim(v[bi], k0, bk)
        s, _ = _block_logits(cfg, qb, kb, jax.lax.dynamic_slice_in_dim(end[bi], k0, bk), q0, k0)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        alpha = jnp.exp(m - m_new)
        pv = jnp.einsum("kgqs,skd->kgqd", p.astype(v.dtype), vb,
                        preferred_element_type=jnp.float32)
        return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + pv, seen.at[kj].set(True)

      return jax.lax.cond(kmax[bi, kj] <= q0, lambda c: c, compute, carry)

    init = (jnp.full((kvh, g, bq), MASK_VALUE, jnp.float32), jnp.zeros((kvh, g, bq), jnp.float32),
            jnp.zeros((kvh, g, bq, dv), jnp.float32), jnp.zeros((nk,), bool))
    last = (q0 + bq - 1) // bk  # key blocks after it start at or after q1
    m, l, acc, seen = jax.lax.fori_loop(0, last + 1, body, init)
    out = (acc / l[..., None]).transpose(2, 0, 1, 3)  # [bq, kvh, g, dv]
    real = (q0 + jnp.arange(bq)) < cfg.length  # padded queries stay out of max_logits
    row_max = jnp.where(real, m, MASK_VALUE).max(-1).reshape(kvh * g)
    return out.astype(q.dtype), m + jnp.log(l), row_max, seen

  out, lse, row_max, seen = jax.lax.map(one_q_block, jnp.arange(b * nq))
  out = out.reshape(b, padded, kvh * g, dv)
  lse = lse.reshape(b, nq, kvh, g, bq).transpose(0, 2, 3, 1, 4).reshape(b, kvh, g, padded)
  return out, lse, row_max.max(0), seen.reshape(b, nq, nk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, end):
  out, _, max_logits, bitmap = _forward(cfg, q, k, v, end)
  return out, jax.lax.stop_gradient(max_logits), bitmap


def _flash_fwd(cfg, q, k, v, end):
  out, lse, max_logits, bitmap = _forward(cfg, q, k, v, end)
  return (out, max_logits, bitmap), (q, k, v, end, out, lse)


def _flash_bwd(cfg, residuals, cotangents):
  q, k, v, end, out, lse = residuals
  d_out = cotangents[0]  # max_logits is stop-gradient, the bitmap is not differentiable
  b, padded, kvh, _ = k.shape
  g, bq, bk = cfg.groups, cfg.bq, cfg.bk
  nk = padded // bk
  qg, dog = _grouped(cfg, q), _grouped(cfg, d_out)
  # D_i = rowsum(dO · O): [b, kv_heads, groups, L]
  delta = jnp.einsum("blkgd,blkgd->bkgl", dog.astype(jnp.float32),
                     _grouped(cfg, out).astype(jnp.float32))
  kmax = end.reshape(b, nk, bk).max(-1)

  def probs(bi, q0, k0, qb, kb, dob, vb):
    """P and dS [kv_heads, groups, bq, bk] of one block pair, recomputed."""
    s, mask = _block_logits(cfg, qb, kb, jax.lax.dynamic_slice_in_dim(end[bi], k0, bk), q0, k0)
    lse_b = jax.lax.dynamic_slice_in_dim(lse[bi], q0, bq, axis=2)
    p = jnp.where(mask, jnp.exp(s - lse_b[..., None]), 0.0)
    dp = jnp.einsum("qkgd,skd->kgqs", dob, vb, preferred_element_type=jnp.float32)
    ds = p * (dp - jax.lax.dynamic_slice_in_dim(delta[bi], q0, bq, axis=2)[..., None])
    return p, ds

  def dkv_block(dq, idx):
    """dK, dV of key block idx, and its share of dQ added to `dq` (P and dS computed once)."""
    bi, kj = idx // nk, idx % nk
    k0 = kj * bk
    kb = jax.lax.dynamic_slice_in_dim(k[bi], k0, bk)
    vb = jax.lax.dynamic_slice_in_dim(v[bi], k0, bk)

    def body(qi, carry):
      dk, dv, dq = carry
      q0 = qi * bq
      qb = jax.lax.dynamic_slice_in_dim(qg[bi], q0, bq)
      dob = jax.lax.dynamic_slice_in_dim(dog[bi], q0, bq)
      p, ds = probs(bi, q0, k0, qb, kb, dob, vb)
      dv = dv + jnp.einsum("kgqs,qkgd->skd", p.astype(v.dtype), dob,
                           preferred_element_type=jnp.float32)
      dk = dk + jnp.einsum("kgqs,qkgd->skd", ds.astype(q.dtype), qb,
                           preferred_element_type=jnp.float32)
      dqb = jax.lax.dynamic_slice(dq, (bi, q0, 0, 0, 0), (1, bq) + dq.shape[2:])[0]
      dqb = dqb + jnp.einsum("kgqs,skd->qkgd", ds.astype(k.dtype), kb,
                             preferred_element_type=jnp.float32)
      return dk, dv, jax.lax.dynamic_update_slice(dq, dqb[None], (bi, q0, 0, 0, 0))

    init = (jnp.zeros(kb.shape, jnp.float32), jnp.zeros(vb.shape, jnp.float32), dq)
    dk, dv, dq = jax.lax.fori_loop(k0 // bq, (kmax[bi, kj] - 1) // bq + 1, body, init)
    return dq, (dk * cfg.scale, dv)

  # One pass over the computed block pairs, key blocks in order: each query block's dQ gets its
  # key blocks' terms in ascending order, as a per-query-block loop would add them.
  dq, (dk, dv) = jax.lax.scan(dkv_block, jnp.zeros(qg.shape, jnp.float32), jnp.arange(b * nk))
  dq = (dq * cfg.scale).reshape(q.shape)
  return (dq.astype(q.dtype), dk.reshape(k.shape).astype(k.dtype),
          dv.reshape(v.shape).astype(v.dtype), None)


_flash.defvjp(_flash_fwd, _flash_bwd)
