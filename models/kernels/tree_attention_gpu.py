"""Tree-rule flash attention as a Pallas GPU kernel (Triton backend), forward and backward.

The rule (docs/design.md §3): query at row `i` may attend to key `j` iff `j <= i < end[j]`,
with `end[j]` the exclusive end of `j`'s subtree in depth-first pre-order. Causal rows have
`end = len`, packed sequences their own end, padding `end = j + 1`. The kernels take `end`
itself; no [L, L] mask exists anywhere.

API::

    out, max_logits = tree_attention(q, k, v, end, scale=..., block_q=64, block_k=64)
    out, max_logits, blocks = tree_attention(..., debug_blocks=True)

  q    [batch, L, heads, qk_dim]        k [batch, L, kv_heads, qk_dim]
  v    [batch, L, kv_heads, v_dim]      end [batch, L] int
  out  [batch, L, heads, v_dim] in q.dtype
  max_logits [heads] fp32: max over the batch and all allowed (i, j) of scale * q_i . k_j
             (stop-gradient; for QK-Clip), exactly as `models.kernels.attention.attention`.
  blocks [batch, num_q_blocks, num_k_blocks] int32, 1 where the forward kernel computed the
             (q block, k block) tile, 0 where it skipped it (num_*_blocks of the padded length).

`heads` must be a multiple of `kv_heads` (GQA: query head h reads kv head h // (heads //
kv_heads)); qk_dim and v_dim may differ (MLA). Inputs may be fp32 or bf16; logits, the online
softmax and all accumulators are fp32. Differentiable in q, k, v (jax.custom_vjp).

Block skipping. The only metadata are per key block (per batch row) `min_end[kb]` and
`max_end[kb]` = min/max of `end[k0:k1]`, two [batch, num_k_blocks] int32 arrays computed in the
wrapper: O(L / block_k) memory, on top of `end` itself (O(L)). For a query block [q0, q1) and
a key block [k0, k1):
  * skip       iff k0 >= q1 or max_end <= q0 (no key of the block is visible to any query);
  * full tile  iff k1 <= q0 + 1 and min_end >= q1 (every pair allowed: no elementwise mask);
  * otherwise  the elementwise rule j <= i < end[j] is applied to the tile.
With valid `end` (end[j] > j) the skip test is exact: a tile is skipped iff the mask has no
allowed pair in it. Forward and dQ kernels (grid: q block x batch x head) loop over key blocks
0 .. cdiv(q1, block_k) - 1 (the last block with k0 < q1) and branch with lax.cond: skip / full
/ masked. The dK/dV kernel (grid: k block x batch x kv head) loops over the query heads of its
GQA group and, for each, over query blocks from the block containing k0 up to the last block
with q0 < max_end (blocks outside that range are exactly those the skip rule removes),
branching full / masked; dK and dV are summed over the group inside the kernel.

Backward is the standard flash backward: the forward saves logsumexp per row;
D_i = rowsum(dO o O) (computed in the wrapper), P = exp(S - lse), dV = P^T dO,
dP = dO V^T, dS = P o (dP - D), dQ = scale dS K, dK = scale dS^T Q.

Padding. Triton needs power-of-two tiles: head dims are zero-padded to the next power of two
(at least 16, the smallest tl.dot size; MLA qk 192 -> 256, v 128 stays), lengths to a multiple
of max(block_q, block_k) (both must be powers of two >= 16). Padded keys get end = j + 1 and
come after every real row, so real queries never see them; padded query rows are dropped and
left out of max_logits. `end` is clipped to L (a value past the row end means the same as L).
Precondition, as for the reference: end[j] > j (every query sees itself); a row that sees no key
gives 0 here (the XLA reference gives a uniform average).

Hardware. With interpret=False the kernels compile through Pallas' Triton backend and run on
NVIDIA GPUs (Ampere or newer; the Pallas docs call this backend best-effort). Defaults:
num_warps = 4, num_stages = 2 (on an H100 at head_dim 128, bf16, 4 warps ran forward+backward
1.6x faster than 8 on causal and tree rows, despite a few register spills in dK/dV:
docs/benchmarks.md). fp32 dots run at
HIGHEST precision, i.e. IEEE fp32 (not TF32: `_dot`). interpret=True runs the same kernels
through the Pallas interpreter on any backend (this is how the tests run on CPU); it is slow
and meant for correctness only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from models.kernels.mask import MASK_VALUE

_MIN_DIM = 16  # smallest operand size of tl.dot


@dataclasses.dataclass(frozen=True)
class _Config:
  scale: float
  block_q: int
  block_k: int
  interpret: bool
  debug_blocks: bool
  num_warps: int | None
  num_stages: int


def _pow2(n: int) -> int:
  return max(_MIN_DIM, pl.next_power_of_2(n))


def _tile_kind(q0, block_q, k0, block_k, min_end, max_end):
  """(skip, full) predicates of a (q block, k block) tile from the block metadata only."""
  skip = (k0 >= q0 + block_q) | (max_end <= q0)
  full = (k0 + block_k <= q0 + 1) & (min_end >= q0 + block_q)
  return skip, full


def _dot(a, b, trans_b=False):
  """plgpu.dot; fp32 operands at HIGHEST precision, i.e. IEEE fp32 (at the default precision
  Triton would take TF32 for fp32 dots on Ampere and newer)."""
  fp32 = a.dtype == jnp.float32 and b.dtype == jnp.float32
  return plgpu.dot(a, b, trans_b=trans_b, precision=lax.Precision.HIGHEST if fp32 else None)


def _run_tile(skip, full, tile, carry):
  """carry unchanged for a skipped tile, else tile(carry, masked=...) (no mask when full)."""
  computed = lambda c: lax.cond(full, functools.partial(tile, masked=False),
                                functools.partial(tile, masked=True), c)
  return lax.cond(skip, lambda c: c, computed, carry)


def _tile_mask(rows, cols, end_cols):
  """Elementwise rule for a [rows, cols] tile: j <= i < end[j]."""
  return (cols[None, :] <= rows[:, None]) & (rows[:, None] < end_cols[None, :])


# --------------------------------------------------------------------------- forward kernel


def _fwd_kernel(q_ref, k_ref, v_ref, end_ref, min_ref, max_ref,  # inputs
                o_ref, lse_ref, ml_ref, *dbg_ref,  # outputs
                scale, block_q, block_k, seq_len, num_k_pad):
  qb = pl.program_id(0)
  q0 = qb * block_q
  rows = q0 + jnp.arange(block_q, dtype=jnp.int32)
  q = q_ref[...]
  dv = v_ref.shape[-1]

  def tile(kb, carry, masked):
    acc, m, l, bits = carry
    k0 = kb * block_k
    ks = pl.ds(k0, block_k)
    k = k_ref[ks, :]
    v = v_ref[ks, :]
    s = _dot(q, k, trans_b=True) * scale  # [bq, bk] fp32
    if masked:
      allow = _tile_mask(rows, k0 + jnp.arange(block_k, dtype=jnp.int32), end_ref[ks])
      s = jnp.where(allow, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    if masked:
      p = jnp.where(allow, p, 0.0)
    l = alpha * l + jnp.sum(p, axis=1)
    acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v)
    if dbg_ref:
      bits = bits | (jnp.arange(num_k_pad, dtype=jnp.int32) == kb).astype(jnp.int32)
    return acc, m_new, l, bits

  def body(kb, carry):
    skip, full = _tile_kind(q0, block_q, kb * block_k, block_k, min_ref[kb], max_ref[kb])
    return _run_tile(skip, full, functools.partial(tile, kb), carry)

  carry = (jnp.zeros((block_q, dv), jnp.float32),
           jnp.full((block_q,), -jnp.inf, jnp.float32),
           jnp.zeros((block_q,), jnp.float32),
           jnp.zeros((num_k_pad,), jnp.int32))
  num_k = lax.div(q0 + block_q + block_k - 1, block_k)  # key blocks with k0 < q1
  acc, m, l, bits = lax.fori_loop(0, num_k, body, carry)

  l_safe = jnp.where(l == 0.0, 1.0, l)
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log(l_safe)
  # Every row sees itself, so m is the max over allowed logits; padded rows are left out.
  ml_ref[...] = jnp.max(jnp.where(rows < seq_len, m, -jnp.inf))
  if dbg_ref:
    dbg_ref[0][...] = bits


def _forward(cfg: _Config, q, k, v, end, min_end, max_end, seq_len):
  b, lp, h, dqk = q.shape
  kvh, dv = k.shape[2], v.shape[-1]
  group = h // kvh
  bq, bk = cfg.block_q, cfg.block_k
  nqb, nkb = lp // bq, lp // bk
  nkb_pad = pl.next_power_of_2(nkb)
  kernel = functools.partial(_fwd_kernel, scale=cfg.scale, block_q=bq, block_k=bk,
                             seq_len=seq_len, num_k_pad=nkb_pad)
  in_specs = [
      pl.BlockSpec((None, bq, None, dqk), lambda i, bi, hi: (bi, i, hi, 0)),
      pl.BlockSpec((None, lp, None, dqk), lambda i, bi, hi: (bi, 0, hi // group, 0)),
      pl.BlockSpec((None, lp, None, dv), lambda i, bi, hi: (bi, 0, hi // group, 0)),
      pl.BlockSpec((None, lp), lambda i, bi, hi: (bi, 0)),
      pl.BlockSpec((None, nkb), lambda i, bi, hi: (bi, 0)),
      pl.BlockSpec((None, nkb), lambda i, bi, hi: (bi, 0)),
  ]
  out_shape = [
      jax.ShapeDtypeStruct((b, lp, h, dv), q.dtype),
      jax.ShapeDtypeStruct((b, h, lp), jnp.float32),  # logsumexp
      jax.ShapeDtypeStruct((b, h, nqb), jnp.float32),  # max logit per q block
  ]
  out_specs = [
      pl.BlockSpec((None, bq, None, dv), lambda i, bi, hi: (bi, i, hi, 0)),
      pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, i)),
      pl.BlockSpec((None, None, None), lambda i, bi, hi: (bi, hi, i)),
  ]
  if cfg.debug_blocks:
    out_shape.append(jax.ShapeDtypeStruct((b, h, nqb, nkb_pad), jnp.int32))
    out_specs.append(pl.BlockSpec((None, None, None, nkb_pad),
                                  lambda i, bi, hi: (bi, hi, i, 0)))
  return pl.pallas_call(
      kernel, grid=(nqb, b, h), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=_compiler_params(cfg), interpret=cfg.interpret,
      name="tree_attention_fwd",
  )(q, k, v, end, min_end, max_end)


# --------------------------------------------------------------------------- backward kernels


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, end_ref, min_ref, max_ref,
               dq_ref, *, scale, block_q, block_k):
  qb = pl.program_id(0)
  q0 = qb * block_q
  rows = q0 + jnp.arange(block_q, dtype=jnp.int32)
  q = q_ref[...]
  do = do_ref[...]
  lse = lse_ref[...]
  delta = delta_ref[...]

  def tile(kb, dq, masked):
    k0 = kb * block_k
    ks = pl.ds(k0, block_k)
    k = k_ref[ks, :]
    v = v_ref[ks, :]
    s = _dot(q, k, trans_b=True) * scale
    p = jnp.exp(s - lse[:, None])
    if masked:
      allow = _tile_mask(rows, k0 + jnp.arange(block_k, dtype=jnp.int32), end_ref[ks])
      p = jnp.where(allow, p, 0.0)
    dp = _dot(do, v, trans_b=True)
    ds = p * (dp - delta[:, None])
    return dq + _dot(ds.astype(k.dtype), k)

  def body(kb, dq):
    skip, full = _tile_kind(q0, block_q, kb * block_k, block_k, min_ref[kb], max_ref[kb])
    return _run_tile(skip, full, functools.partial(tile, kb), dq)

  num_k = lax.div(q0 + block_q + block_k - 1, block_k)
  dq = lax.fori_loop(0, num_k, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, end_ref, min_ref, max_ref,
                dk_ref, dv_ref, *, scale, block_q, block_k, group):
  kb = pl.program_id(0)
  k0 = kb * block_k
  cols = k0 + jnp.arange(block_k, dtype=jnp.int32)
  k = k_ref[...]
  v = v_ref[...]
  end_cols = end_ref[...]
  min_end, max_end = min_ref[kb], max_ref[kb]
  # Query blocks [first, last): the block containing k0 up to the last one with q0 < max_end.
  # Every block outside that range satisfies the skip rule and every block inside fails it.
  first = lax.div(k0, block_q)
  last = lax.div(max_end + block_q - 1, block_q)

  def tile(g, qb, carry, masked):
    dk, dv = carry
    q0 = qb * block_q
    qs = pl.ds(q0, block_q)
    q = q_ref[qs, g, :]
    do = do_ref[qs, g, :]
    lse = lse_ref[g, qs]
    delta = delta_ref[g, qs]
    s_t = _dot(k, q, trans_b=True) * scale  # [bk, bq]: keys on rows
    p_t = jnp.exp(s_t - lse[None, :])
    if masked:
      rows = q0 + jnp.arange(block_q, dtype=jnp.int32)
      allow_t = (cols[:, None] <= rows[None, :]) & (rows[None, :] < end_cols[:, None])
      p_t = jnp.where(allow_t, p_t, 0.0)
    dv = dv + _dot(p_t.astype(do.dtype), do)
    dp_t = _dot(v, do, trans_b=True)
    ds_t = p_t * (dp_t - delta[None, :])
    dk = dk + _dot(ds_t.astype(q.dtype), q)
    return dk, dv

  def q_body(g, qb, carry):
    _, full = _tile_kind(qb * block_q, block_q, k0, block_k, min_end, max_end)
    return lax.cond(full, functools.partial(tile, g, qb, masked=False),
                    functools.partial(tile, g, qb, masked=True), carry)

  def g_body(g, carry):
    return lax.fori_loop(first, last, functools.partial(q_body, g), carry)

  carry = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  dk, dv = lax.fori_loop(0, group, g_body, carry)
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _backward_kernels(cfg: _Config, q, k, v, end, min_end, max_end, lse, delta, do):
  b, lp, h, dqk = q.shape
  kvh, dv = k.shape[2], v.shape[-1]
  group = h // kvh
  bq, bk = cfg.block_q, cfg.block_k
  nqb, nkb = lp // bq, lp // bk
  params = _compiler_params(cfg)

  dq = pl.pallas_call(
      functools.partial(_dq_kernel, scale=cfg.scale, block_q=bq, block_k=bk),
      grid=(nqb, b, h),
      in_specs=[
          pl.BlockSpec((None, bq, None, dqk), lambda i, bi, hi: (bi, i, hi, 0)),
          pl.BlockSpec((None, lp, None, dqk), lambda i, bi, hi: (bi, 0, hi // group, 0)),
          pl.BlockSpec((None, lp, None, dv), lambda i, bi, hi: (bi, 0, hi // group, 0)),
          pl.BlockSpec((None, bq, None, dv), lambda i, bi, hi: (bi, i, hi, 0)),
          pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, i)),
          pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, i)),
          pl.BlockSpec((None, lp), lambda i, bi, hi: (bi, 0)),
          pl.BlockSpec((None, nkb), lambda i, bi, hi: (bi, 0)),
          pl.BlockSpec((None, nkb), lambda i, bi, hi: (bi, 0)),
      ],
      out_specs=pl.BlockSpec((None, bq, None, dqk), lambda i, bi, hi: (bi, i, hi, 0)),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=params, interpret=cfg.interpret, name="tree_attention_dq",
  )(q, k, v, do, lse, delta, end, min_end, max_end)

  dk, dv_ = pl.pallas_call(
      functools.partial(_dkv_kernel, scale=cfg.scale, block_q=bq, block_k=bk, group=group),
      grid=(nkb, b, kvh),
      in_specs=[
          pl.BlockSpec((None, lp, group, dqk), lambda j, bi, gi: (bi, 0, gi, 0)),
          pl.BlockSpec((None, bk, None, dqk), lambda j, bi, gi: (bi, j, gi, 0)),
          pl.BlockSpec((None, bk, None, dv), lambda j, bi, gi: (bi, j, gi, 0)),
          pl.BlockSpec((None, lp, group, dv), lambda j, bi, gi: (bi, 0, gi, 0)),
          pl.BlockSpec((None, group, lp), lambda j, bi, gi: (bi, gi, 0)),
          pl.BlockSpec((None, group, lp), lambda j, bi, gi: (bi, gi, 0)),
          pl.BlockSpec((None, bk), lambda j, bi, gi: (bi, j)),
          pl.BlockSpec((None, nkb), lambda j, bi, gi: (bi, 0)),
          pl.BlockSpec((None, nkb), lambda j, bi, gi: (bi, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, bk, None, dqk), lambda j, bi, gi: (bi, j, gi, 0)),
          pl.BlockSpec((None, bk, None, dv), lambda j, bi, gi: (bi, j, gi, 0)),
      ],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=params, interpret=cfg.interpret, name="tree_attention_dkv",
  )(q, k, v, do, lse, delta, end, min_end, max_end)
  return dq, dk, dv_


def _compiler_params(cfg: _Config):
  num_warps = cfg.num_warps or 4
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=cfg.num_stages)


# --------------------------------------------------------------------------- wrapper + VJP


def _pad_inputs(cfg: _Config, q, k, v, end):
  """Pad lengths to a multiple of the blocks and head dims to powers of two; block metadata."""
  b, seq_len = end.shape
  mult = max(cfg.block_q, cfg.block_k)
  lp = -(-seq_len // mult) * mult
  pad_l = lp - seq_len

  def pad(x):
    return jnp.pad(x, ((0, 0), (0, pad_l), (0, 0), (0, _pow2(x.shape[-1]) - x.shape[-1])))

  end = jnp.minimum(end.astype(jnp.int32), seq_len)
  tail = jnp.broadcast_to(jnp.arange(seq_len + 1, lp + 1, dtype=jnp.int32), (b, pad_l))
  end = jnp.concatenate([end, tail], axis=1)
  blocks = end.reshape(b, lp // cfg.block_k, cfg.block_k)
  return pad(q), pad(k), pad(v), end, jnp.min(blocks, -1), jnp.max(blocks, -1)


def _fwd_impl(cfg: _Config, q, k, v, end):
  seq_len = q.shape[1]
  qp, kp, vp, endp, min_end, max_end = _pad_inputs(cfg, q, k, v, end)
  outs = _forward(cfg, qp, kp, vp, endp, min_end, max_end, seq_len)
  o, lse, ml = outs[:3]
  out = o[:, :seq_len, :, :v.shape[-1]]
  max_logits = lax.stop_gradient(jnp.max(ml, axis=(0, 2)))
  result = (out, max_logits)
  if cfg.debug_blocks:
    result += (outs[3][:, 0, :, :max_end.shape[1]],)
  return result, (qp, kp, vp, endp, min_end, max_end, o, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tree_attention(cfg: _Config, q, k, v, end):
  return _fwd_impl(cfg, q, k, v, end)[0]


def _vjp_fwd(cfg: _Config, q, k, v, end):
  result, res = _fwd_impl(cfg, q, k, v, end)
  return result, (res, q.shape, k.shape, v.shape)


def _vjp_bwd(cfg: _Config, saved, cotangents):
  (qp, kp, vp, endp, min_end, max_end, o, lse), qs, ks, vs = saved
  d_out = cotangents[0]  # max_logits is stop-gradient; the block bitmap is integer
  seq_len = qs[1]
  lp = qp.shape[1]
  do = jnp.pad(d_out.astype(o.dtype),
               ((0, 0), (0, lp - seq_len), (0, 0), (0, o.shape[-1] - d_out.shape[-1])))
  delta = jnp.einsum("blhd,blhd->bhl", o.astype(jnp.float32), do.astype(jnp.float32))
  dq, dk, dv = _backward_kernels(cfg, qp, kp, vp, endp, min_end, max_end, lse, delta, do)
  return (dq[:, :seq_len, :, :qs[-1]], dk[:, :seq_len, :, :ks[-1]],
          dv[:, :seq_len, :, :vs[-1]], None)


_tree_attention.defvjp(_vjp_fwd, _vjp_bwd)


def tree_attention(q: jax.Array, k: jax.Array, v: jax.Array, end: jax.Array, *, scale: float,
                   block_q: int = 64, block_k: int = 64, interpret: bool = False,
                   debug_blocks: bool = False, num_warps: int | None = None,
                   num_stages: int = 2):
  """Flash attention under the tree rule `j <= i < end[j]` (see the module docstring).

  Args:
    q: [batch, L, heads, qk_dim] fp32 or bf16 queries.
    k: [batch, L, kv_heads, qk_dim] keys; `heads` is a multiple of `kv_heads` (GQA).
    v: [batch, L, kv_heads, v_dim] values (v_dim may differ from qk_dim: MLA).
    end: [batch, L] int, exclusive subtree end of each key; precondition end[j] > j.
    scale: the softmax scale applied to q·k.
    block_q: query rows per tile, a power of two >= 16.
    block_k: key rows per tile, a power of two >= 16.
    interpret: run the kernels in the Pallas interpreter (any backend; slow, for tests).
    debug_blocks: also return the bitmap of computed tiles.
    num_warps: Triton warps per kernel; None: 4.
    num_stages: Triton software-pipelining stages.

  Returns:
    (out [batch, L, heads, v_dim] in q.dtype, max_logits [heads] fp32 stop-gradient), plus the
    [batch, num_q_blocks, num_k_blocks] int32 bitmap of computed tiles when debug_blocks=True.

  Raises:
    ValueError: mismatched shapes, heads not a multiple of kv_heads, or a bad block size.
  """
  b, seq_len, h, dqk = q.shape
  if k.shape[:2] != (b, seq_len) or v.shape[:3] != k.shape[:3] or k.shape[-1] != dqk:
    raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
  if end.shape != (b, seq_len):
    raise ValueError(f"end must be [batch, L] = {(b, seq_len)}, got {end.shape}")
  if h % k.shape[2]:
    raise ValueError(f"heads={h} is not a multiple of kv_heads={k.shape[2]}")
  for name, blk in (("block_q", block_q), ("block_k", block_k)):
    if blk < _MIN_DIM or blk & (blk - 1):
      raise ValueError(f"{name}={blk} must be a power of two >= {_MIN_DIM}")
  cfg = _Config(float(scale), block_q, block_k, bool(interpret), bool(debug_blocks),
                num_warps, num_stages)
  return _tree_attention(cfg, q, k, v, end)
