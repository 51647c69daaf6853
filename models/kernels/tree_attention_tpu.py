"""Tree-masked flash attention for TPU (Pallas / Mosaic), forward and backward.

Same signature and contract as the pure-XLA reference `models.kernels.attention.attention`
(without `q_index`: queries and keys are the same rows), plus block-size knobs.

The rule (docs/design.md §3): query row `i` may attend to key row `j` iff

    j <= i < end[j]

with `end[j]` the exclusive end of j's subtree in depth-first pre-order. One O(L) int32 array
per batch row describes causal rows (`end = len`), packed independent sequences (`end` = their
own end), trees, and padding (`end = j + 1`). No L x L mask ever exists in memory.

Shapes
  q    [batch, L, heads, qk_dim]
  k    [batch, L, kv_heads, qk_dim]     heads % kv_heads == 0; query head h uses kv head
  v    [batch, L, kv_heads, v_dim]      h // (heads // kv_heads) (GQA; MQA when kv_heads == 1)
  end  [batch, L] int
  ->   out [batch, L, heads, v_dim] in q.dtype,
       max_logits [heads] fp32 = max over the batch and all allowed (i, j) of scale * q_i . k_j
       (stop-gradient; what QK-Clip needs),
       and with `debug_blocks=True` a bool bitmap [batch, num_q_blocks, num_k_blocks] of the
       (q block, k block) pairs the forward kernel computed.
  qk_dim and v_dim may differ (MLA: 192 / 128). fp32 and bf16 inputs; softmax statistics and all
  accumulators are fp32; matmul operands stay in the input dtype (MXU-friendly).

Block skipping (per batch row, from O(L / block) metadata only)
  For query block [q0, q1) and key block [k0, k1), with kmin/kmax = min/max of end[k0:k1]:
    skip       iff  k0 >= q1  or  kmax <= q0
    unmasked   iff  k1 <= q0 + 1  and  kmin >= q1   (every pair allowed: no elementwise mask)
    otherwise       the elementwise rule j <= i < end[j] is applied inside the block.
  The skip test is exact: a block that is not skipped always holds at least one allowed pair
  (if the ranges overlap, the diagonal i == j; otherwise k1 <= q0 and the key with
  end[j] = kmax > q0 is seen by query q0). kmin and kmax are computed in the wrapper and passed by
  scalar prefetch (SMEM); the kernels test them with `pl.when`.

  Memory traffic of skipped blocks: in the forward and dQ kernels (grid ..., q block, k block)
  the k/v index_map sends a skipped k block to the *next computed* k block of the same q block
  (above the diagonal: the diagonal block, which was just fetched), so the pipeline either keeps
  the buffer it has or prefetches what it needs next; nothing is fetched for nothing. Finding
  "the next k block with kmax > q0" in O(log) scalar reads uses a suffix-max table over the
  per-block kmax ([batch, levels, num_k_blocks], levels = ceil(log2 num_k_blocks); level 0 is
  kmax itself). In the dK/dV kernel (grid ..., k block, q head of the group, q block) the
  computed q blocks of a k block are one contiguous range [k0 // block_q, (kmax - 1) // block_q],
  so the q-side index_map is a clamp into that range.

Memory: the metadata is O(L) (the end row itself, one small VMEM block per k block) plus
O(L / block * log) scalars; the backward keeps the forward's logsumexp ([batch, heads, L] fp32)
and recomputes probabilities block by block.

Kernels
  forward   grid (batch, heads, q blocks, k blocks): online softmax (running max m, sum l,
            accumulator in VMEM scratch), output in q.dtype, logsumexp row for the backward, and
            per (batch, head, q block) the max of the allowed scaled logits (= max of m over
            the real rows), reduced to [heads] in the wrapper.
  dQ        grid (batch, heads, q blocks, k blocks), same skipping as the forward.
  dK, dV    grid (batch, kv heads, k blocks, group heads, q blocks): summed over the q heads of
            the GQA group and the q blocks, accumulated in VMEM scratch.
  Standard flash backward: D_i = rowsum(dO * O) (in XLA), P = exp(S - lse), dP = dO V^T,
  dS = P * (dP - D), dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO. The backward kernels work
  on transposed blocks [k rows, q rows] so the per-query vectors (lse, D) are lane-dense rows.

Layout and padding: the wrapper transposes to [batch, heads, L, dim] (blocks (block, full head
dim)) and pads L to a multiple of lcm(block_q, block_k). Padded keys get end = j + 1 (nobody else
sees them: they lie after every real query), padded queries are dropped and excluded from
max_logits. `end` is clipped to [j + 1, L] (a no-op for valid input), so every query sees itself
and no row is ever fully masked; the final division is guarded anyway.

Running
  TPU:  tree_attention(q, k, v, end, scale=...)            # compiled by Mosaic
  CPU:  tree_attention(..., interpret=True)                # Pallas HLO interpreter (fast)
        tree_attention(..., interpret=pltpu.InterpretParams())
                                                           # TPU interpret mode: simulates
                                                           # VMEM/SMEM/DMA, NaN-fills scratch
  On TPU block_q / block_k must be multiples of 128 (defaults; the lane-dense logsumexp rows
  need it); interpret mode also accepts multiples of 8. Tests: tests/test_kernels_tpu.py
  compares with the XLA reference on CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from models.kernels.mask import MASK_VALUE

LANES = 128  # lane width; m / l scratch is lane-replicated [block_q, LANES]
_NT = (((1,), (1,)), ((), ()))  # a @ b.T


@dataclasses.dataclass(frozen=True)
class _Cfg:
  scale: float
  bq: int
  bk: int
  seq_len: int       # real L (rows >= seq_len are padding)
  padded_len: int    # Lp
  groups: int        # heads // kv_heads
  levels: int        # levels of the suffix-max table of per-k-block max(end)
  interpret: Any
  debug: bool

  @property
  def nq(self) -> int:
    return self.padded_len // self.bq

  @property
  def nk(self) -> int:
    return self.padded_len // self.bk


# ----------------------------------------------------------------------------- block tests



def _run_block(computed, unmasked, step) -> None:
  """Run step(masked=...) for a block the metadata says is computed: without the elementwise
  rule when the block is fully allowed, with it otherwise."""
  pl.when(computed & unmasked)(lambda: step(masked=False))
  pl.when(computed & jnp.logical_not(unmasked))(lambda: step(masked=True))

def _div(a, b: int):
  """a // b for non-negative a: truncating division (jnp's floor_divide adds a sign fix-up
  that Mosaic lowers with chip-specific rules)."""
  return jax.lax.div(a, jnp.asarray(b, jnp.asarray(a).dtype))


def _block_tests(cfg: _Cfg, b, qi, kj, kmin_ref, ktab_ref):
  """(computed, unmasked) for q block qi and k block kj of batch row b (traced scalars)."""
  q0 = qi * cfg.bq
  q1 = q0 + cfg.bq
  k0 = kj * cfg.bk
  k1 = k0 + cfg.bk
  kmin = kmin_ref[b * cfg.nk + kj]
  kmax = ktab_ref[b * cfg.levels * cfg.nk + kj]  # level 0 of the table
  computed = jnp.logical_and(k0 < q1, kmax > q0)
  unmasked = jnp.logical_and(k1 <= q0 + 1, kmin >= q1)
  return computed, unmasked


def _next_k_block(cfg: _Cfg, b, qi, kj, ktab_ref):
  """The k block to fetch at grid step (qi, kj): kj if it is computed, else the next computed
  k block of q block qi (one exists: the diagonal block, a query sees itself)."""
  q0 = qi * cfg.bq
  diag = _div(q0 + cfg.bq - 1, cfg.bk)
  pos = jnp.minimum(kj, diag)
  base = b * cfg.levels * cfg.nk
  # Binary lifting: ktab[l, p] = max(kmax[p : p + 2**l]). If that is <= q0, the blocks
  # p .. p + 2**l - 1 are all skipped (and p + 2**l <= diag, since diag is computed).
  for lvl in reversed(range(cfg.levels)):
    dead = ktab_ref[base + lvl * cfg.nk + pos] <= q0
    pos = jnp.where(dead, pos + (1 << lvl), pos)
  return pos


def _q_block_range(cfg: _Cfg, b, kj, ktab_ref):
  """[first, last] q blocks computed for k block kj: k0 < q1 and q0 < kmax."""
  k0 = kj * cfg.bk
  kmax = ktab_ref[b * cfg.levels * cfg.nk + kj]
  return _div(k0, cfg.bq), _div(kmax - 1, cfg.bq)


def _dkv_q_block(cfg: _Cfg, b, kj, qi, ktab_ref):
  """The q block to fetch at dK/dV grid step (kj, qi): qi clamped into the computed range."""
  lo, hi = _q_block_range(cfg, b, kj, ktab_ref)
  return jnp.clip(qi, lo, hi)


def _end_column(end_row, rows: int):
  """[1, rows] int row -> [rows, 1] column (via a tile-aligned 2-D transpose)."""
  return jnp.broadcast_to(end_row, (8, rows)).T[:, :1]


# ----------------------------------------------------------------------------- forward


def _fwd_kernel(cfg: _Cfg, kmin_ref, ktab_ref, q_ref, k_ref, v_ref, end_ref, *rest):
  if cfg.debug:
    o_ref, lse_ref, mx_ref, dbg_ref, m_scr, l_scr, acc_scr = rest
  else:
    o_ref, lse_ref, mx_ref, m_scr, l_scr, acc_scr = rest
    dbg_ref = None
  b, qi, kj = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  computed, unmasked = _block_tests(cfg, b, qi, kj, kmin_ref, ktab_ref)

  @pl.when(kj == 0)
  def _init():
    m_scr[...] = jnp.full(m_scr.shape, MASK_VALUE, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

  if dbg_ref is not None:
    dbg_ref[0, kj] = computed.astype(jnp.int32)

  def step(masked: bool):
    q = q_ref[...]
    k = k_ref[...]
    s = jax.lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * cfg.scale
    if masked:
      i = qi * cfg.bq + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
      j = kj * cfg.bk + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
      allow = (j <= i) & (i < end_ref[...])  # end_ref: [1, bk]
      s = jnp.where(allow, s, MASK_VALUE)
    m_prev = m_scr[...][:, :1]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.exp(s - m_new)
    if masked:
      p = jnp.where(allow, p, 0.0)  # a row with nothing allowed yet adds nothing
    l_new = alpha * l_scr[...][:, :1] + jnp.sum(p, axis=1, keepdims=True)
    pv = jax.lax.dot_general(p.astype(v_ref.dtype), v_ref[...], (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)
    acc_scr[...] = alpha * acc_scr[...] + pv
    m_scr[...] = jnp.broadcast_to(m_new, m_scr.shape)
    l_scr[...] = jnp.broadcast_to(l_new, l_scr.shape)

  _run_block(computed, unmasked, step)

  @pl.when(kj == pl.num_programs(3) - 1)
  def _finish():
    m = m_scr[...]                              # [bq, LANES], lane-replicated
    l = l_scr[...]
    l_safe = jnp.where(l > 0.0, l, 1.0)
    o_ref[...] = (acc_scr[...] / l_safe[:, :1]).astype(o_ref.dtype)
    lse = m + jnp.log(l_safe)                   # [bq, LANES]
    lse_ref[...] = lse.T[:1, :]                 # -> lane-dense row [1, bq]
    row = qi * cfg.bq + jax.lax.broadcasted_iota(jnp.int32, m.shape, 0)
    mx = jnp.max(jnp.where(row < cfg.seq_len, m, -jnp.inf))
    mx_ref[...] = jnp.full(mx_ref.shape, mx, jnp.float32)


def _forward(cfg: _Cfg, q, k, v, end_row, kmin, ktab):
  """q [B, H, Lp, Dqk], k [B, KVH, Lp, Dqk], v [B, KVH, Lp, Dv], end_row [B, 1, Lp]."""
  bsz, heads, lp, dqk = q.shape
  dv = v.shape[-1]
  g = cfg.groups
  bq, bk = cfg.bq, cfg.bk

  def q_map(b, h, qi, kj, kmin_ref, ktab_ref):
    return b, h, qi, 0

  def kv_map(b, h, qi, kj, kmin_ref, ktab_ref):
    return b, _div(h, g), _next_k_block(cfg, b, qi, kj, ktab_ref), 0

  def end_map(b, h, qi, kj, kmin_ref, ktab_ref):
    return b, 0, _next_k_block(cfg, b, qi, kj, ktab_ref)

  in_specs = [
      pl.BlockSpec((None, None, bq, dqk), q_map),
      pl.BlockSpec((None, None, bk, dqk), kv_map),
      pl.BlockSpec((None, None, bk, dv), kv_map),
      pl.BlockSpec((None, 1, bk), end_map),
  ]
  out_shape = [
      jax.ShapeDtypeStruct((bsz, heads, lp, dv), q.dtype),
      jax.ShapeDtypeStruct((bsz, heads, 1, lp), jnp.float32),             # logsumexp
      jax.ShapeDtypeStruct((bsz, heads, cfg.nq, 1, LANES), jnp.float32),  # block max logit
  ]
  out_specs = [
      pl.BlockSpec((None, None, bq, dv), q_map),
      pl.BlockSpec((None, None, 1, bq), lambda b, h, qi, kj, *_: (b, h, 0, qi)),
      pl.BlockSpec((None, None, None, 1, LANES), lambda b, h, qi, kj, *_: (b, h, qi, 0, 0)),
  ]
  if cfg.debug:
    out_shape.append(jax.ShapeDtypeStruct((bsz, heads, cfg.nq, 1, cfg.nk), jnp.int32))
    out_specs.append(pl.BlockSpec((None, None, None, 1, cfg.nk),
                                  lambda b, h, qi, kj, *_: (b, h, qi, 0, 0),
                                  memory_space=pltpu.SMEM))
  outs = pl.pallas_call(
      functools.partial(_fwd_kernel, cfg),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(bsz, heads, cfg.nq, cfg.nk),
          in_specs=in_specs,
          out_specs=out_specs,
          scratch_shapes=[
              pltpu.VMEM((bq, LANES), jnp.float32),  # m
              pltpu.VMEM((bq, LANES), jnp.float32),  # l
              pltpu.VMEM((bq, dv), jnp.float32),     # acc
          ]),
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=cfg.interpret,
      name="tree_attention_fwd",
  )(kmin, ktab, q, k, v, end_row)
  return outs


# ----------------------------------------------------------------------------- backward


def _probs_and_dscores(cfg: _Cfg, qi, kj, masked, q, k, v, do, lse, delta, end_row):
  """Transposed block [bk, bq]: P^T and dS^T (fp32)."""
  s = jax.lax.dot_general(k, q, _NT, preferred_element_type=jnp.float32) * cfg.scale
  p = jnp.exp(s - lse)                                   # lse: [1, bq]
  if masked:
    j = kj * cfg.bk + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
    i = qi * cfg.bq + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    allow = (j <= i) & (i < _end_column(end_row, cfg.bk))
    p = jnp.where(allow, p, 0.0)
  dp = jax.lax.dot_general(v, do, _NT, preferred_element_type=jnp.float32)
  ds = p * (dp - delta)                                  # delta: [1, bq]
  return p, ds


def _dq_kernel(cfg: _Cfg, kmin_ref, ktab_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
               end_ref, dq_ref, dq_scr):
  b, qi, kj = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  computed, unmasked = _block_tests(cfg, b, qi, kj, kmin_ref, ktab_ref)

  @pl.when(kj == 0)
  def _init():
    dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

  def step(masked: bool):
    k = k_ref[...]
    _, ds = _probs_and_dscores(cfg, qi, kj, masked, q_ref[...], k, v_ref[...], do_ref[...],
                               lse_ref[...], delta_ref[...], end_ref[...])
    dq_scr[...] += jax.lax.dot(ds.T.astype(k.dtype), k, preferred_element_type=jnp.float32)

  _run_block(computed, unmasked, step)

  @pl.when(kj == pl.num_programs(3) - 1)
  def _finish():
    dq_ref[...] = (dq_scr[...] * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(cfg: _Cfg, kmin_ref, ktab_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                end_ref, dk_ref, dv_ref, dk_scr, dv_scr):
  b, kj, gi, qi = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
  computed, unmasked = _block_tests(cfg, b, qi, kj, kmin_ref, ktab_ref)

  @pl.when((gi == 0) & (qi == 0))
  def _init():
    dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
    dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

  def step(masked: bool):
    q = q_ref[...]
    do = do_ref[...]
    p, ds = _probs_and_dscores(cfg, qi, kj, masked, q, k_ref[...], v_ref[...], do,
                               lse_ref[...], delta_ref[...], end_ref[...])
    dv_scr[...] += jax.lax.dot_general(p.astype(do.dtype), do, (((1,), (0,)), ((), ())),
                                       preferred_element_type=jnp.float32)
    dk_scr[...] += jax.lax.dot_general(ds.astype(q.dtype), q, (((1,), (0,)), ((), ())),
                                       preferred_element_type=jnp.float32)

  _run_block(computed, unmasked, step)

  @pl.when((gi == pl.num_programs(3) - 1) & (qi == pl.num_programs(4) - 1))
  def _finish():
    dk_ref[...] = (dk_scr[...] * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _backward(cfg: _Cfg, q, k, v, end_row, kmin, ktab, lse, do, delta):
  bsz, heads, lp, dqk = q.shape
  kv_heads = k.shape[1]
  dv = v.shape[-1]
  g = cfg.groups
  bq, bk = cfg.bq, cfg.bk
  args = (kmin, ktab, q, k, v, do, lse, delta, end_row)

  # dQ: grid (b, h, qi, kj); the same k-block fetch order as the forward.
  def q_map(b, h, qi, kj, kmin_ref, ktab_ref):
    return b, h, qi, 0

  def row_map(b, h, qi, kj, kmin_ref, ktab_ref):
    return b, h, 0, qi

  def kv_map(b, h, qi, kj, kmin_ref, ktab_ref):
    return b, _div(h, g), _next_k_block(cfg, b, qi, kj, ktab_ref), 0

  def end_map(b, h, qi, kj, kmin_ref, ktab_ref):
    return b, 0, _next_k_block(cfg, b, qi, kj, ktab_ref)

  dq = pl.pallas_call(
      functools.partial(_dq_kernel, cfg),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(bsz, heads, cfg.nq, cfg.nk),
          in_specs=[
              pl.BlockSpec((None, None, bq, dqk), q_map),
              pl.BlockSpec((None, None, bk, dqk), kv_map),
              pl.BlockSpec((None, None, bk, dv), kv_map),
              pl.BlockSpec((None, None, bq, dv), q_map),
              pl.BlockSpec((None, None, 1, bq), row_map),
              pl.BlockSpec((None, None, 1, bq), row_map),
              pl.BlockSpec((None, 1, bk), end_map),
          ],
          out_specs=pl.BlockSpec((None, None, bq, dqk), q_map),
          scratch_shapes=[pltpu.VMEM((bq, dqk), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=cfg.interpret,
      name="tree_attention_dq",
  )(*args)

  # dK, dV: grid (b, kv head, kj, group head, qi); computed q blocks of kj are contiguous, so
  # skipped q blocks are clamped into that range (no fetch for nothing).
  def q_map2(b, kh, kj, gi, qi, kmin_ref, ktab_ref):
    return b, kh * g + gi, _dkv_q_block(cfg, b, kj, qi, ktab_ref), 0

  def row_map2(b, kh, kj, gi, qi, kmin_ref, ktab_ref):
    return b, kh * g + gi, 0, _dkv_q_block(cfg, b, kj, qi, ktab_ref)

  def kv_map2(b, kh, kj, gi, qi, kmin_ref, ktab_ref):
    return b, kh, kj, 0

  def end_map2(b, kh, kj, gi, qi, kmin_ref, ktab_ref):
    return b, 0, kj

  dk, dv_ = pl.pallas_call(
      functools.partial(_dkv_kernel, cfg),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(bsz, kv_heads, cfg.nk, g, cfg.nq),
          in_specs=[
              pl.BlockSpec((None, None, bq, dqk), q_map2),
              pl.BlockSpec((None, None, bk, dqk), kv_map2),
              pl.BlockSpec((None, None, bk, dv), kv_map2),
              pl.BlockSpec((None, None, bq, dv), q_map2),
              pl.BlockSpec((None, None, 1, bq), row_map2),
              pl.BlockSpec((None, None, 1, bq), row_map2),
              pl.BlockSpec((None, 1, bk), end_map2),
          ],
          out_specs=[
              pl.BlockSpec((None, None, bk, dqk), kv_map2),
              pl.BlockSpec((None, None, bk, dv), kv_map2),
          ],
          scratch_shapes=[pltpu.VMEM((bk, dqk), jnp.float32),
                          pltpu.VMEM((bk, dv), jnp.float32)]),
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary")),
      interpret=cfg.interpret,
      name="tree_attention_dkv",
  )(*args)
  return dq, dk, dv_


# ----------------------------------------------------------------------------- custom VJP


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg: _Cfg, q, k, v, end_row, kmin, ktab):
  outs = _forward(cfg, q, k, v, end_row, kmin, ktab)
  return outs[0], outs[2], (outs[3] if cfg.debug else None)


def _flash_fwd(cfg: _Cfg, q, k, v, end_row, kmin, ktab):
  outs = _forward(cfg, q, k, v, end_row, kmin, ktab)
  out, lse = outs[0], outs[1]
  res = (q, k, v, end_row, kmin, ktab, out, lse)
  return (out, outs[2], (outs[3] if cfg.debug else None)), res


def _flash_bwd(cfg: _Cfg, res, cts):
  q, k, v, end_row, kmin, ktab, out, lse = res
  do = cts[0]  # max_logits is stop-gradient, the bitmap is an integer: their cotangents drop
  delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)[:, :, None, :]
  dq, dk, dv = _backward(cfg, q, k, v, end_row, kmin, ktab, lse, do.astype(q.dtype), delta)
  return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------- wrapper


def block_metadata(end: jax.Array, block_k: int, levels: int):
  """Computes the block-skipping metadata of the wrapper (see "Block skipping" above).

  Args:
    end: [B, Lp] int32 padded tree ends; Lp a multiple of `block_k`.
    block_k: key rows per block.
    levels: levels of the suffix-max table (ceil(log2 nk), at least 1).

  Returns:
    (kmin [B, nk]: min(end) per k block, table [B, levels, nk]: level l holds the max of max(end)
    over blocks kb .. kb + 2**l - 1, clipped to the row).
  """
  bsz, lp = end.shape
  nk = lp // block_k
  blocks = end.reshape(bsz, nk, block_k)
  kmin = blocks.min(axis=-1)
  table = [blocks.max(axis=-1)]
  for lvl in range(1, levels):
    prev = table[-1]
    shift = 1 << (lvl - 1)
    tail = jnp.broadcast_to(prev[:, -1:], (bsz, shift))
    shifted = jnp.concatenate([prev[:, shift:], tail], axis=1)[:, :nk]
    table.append(jnp.maximum(prev, shifted))
  return kmin, jnp.stack(table, axis=1)


def tree_attention(q: jax.Array, k: jax.Array, v: jax.Array, end: jax.Array, *, scale: float,
                   block_q: int = 128, block_k: int = 128, interpret: Any = False,
                   debug_blocks: bool = False):
  """Flash attention under the tree rule j <= i < end[j] (see the module docstring).

  Args:
    q: [B, L, H, Dqk] fp32 or bf16 queries.
    k: [B, L, KV, Dqk] keys; H is a multiple of KV (GQA).
    v: [B, L, KV, Dv] values (Dv may differ from Dqk: MLA).
    end: [B, L] int, exclusive subtree end of each key (clipped to [j + 1, L]).
    scale: the softmax scale applied to q·k.
    block_q: query rows per block, a positive multiple of 128 (of 8 in interpret mode).
    block_k: key rows per block, likewise.
    interpret: False (compile for TPU), True (Pallas interpreter) or a pltpu.InterpretParams.
    debug_blocks: also return the bitmap of computed block pairs.

  Returns:
    (out [B, L, H, Dv] in q.dtype, max_logits [H] fp32 stop-gradient) and, with
    debug_blocks=True, a third output: bool [B, num_q_blocks, num_k_blocks], the block pairs the
    forward computed.

  Raises:
    ValueError: mismatched shapes, H not a multiple of KV, or a bad block size.
  """
  bsz, seq_len, heads, dqk = q.shape
  kv_heads = k.shape[2]
  if k.shape[:2] != (bsz, seq_len) or v.shape[:3] != k.shape[:3] or k.shape[3] != dqk:
    raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
  if end.shape != (bsz, seq_len):
    raise ValueError(f"end must be [batch, L] = {(bsz, seq_len)}, got {end.shape}")
  if heads % kv_heads:
    raise ValueError(f"heads={heads} is not a multiple of kv_heads={kv_heads}")
  for name, blk in (("block_q", block_q), ("block_k", block_k)):
    if blk <= 0 or blk % (8 if interpret else 128):
      raise ValueError(f"{name}={blk} must be a positive multiple of 128 "
                       "(of 8 in interpret mode)")

  step = math.lcm(block_q, block_k)
  lp = -(-seq_len // step) * step
  pad = lp - seq_len
  j = jnp.arange(lp, dtype=jnp.int32)
  end = jnp.clip(end.astype(jnp.int32), j[None, :seq_len] + 1, seq_len)  # valid input: no-op
  end = jnp.concatenate([end, jnp.broadcast_to(j[seq_len:] + 1, (bsz, pad))], axis=1)
  nk = lp // block_k
  levels = max(1, (nk - 1).bit_length())
  kmin, ktab = block_metadata(end, block_k, levels)

  def to_heads_major(x):
    x = jnp.swapaxes(x, 1, 2)  # [B, H, L, D]
    return jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) if pad else x

  cfg = _Cfg(scale=float(scale), bq=block_q, bk=block_k, seq_len=seq_len, padded_len=lp,
             groups=heads // kv_heads, levels=levels, interpret=interpret, debug=debug_blocks)
  out, mx, dbg = _flash(cfg, to_heads_major(q), to_heads_major(k), to_heads_major(v),
                        end[:, None, :], kmin.reshape(-1), ktab.reshape(-1))
  out = jnp.swapaxes(out[:, :, :seq_len], 1, 2)
  max_logits = jax.lax.stop_gradient(jnp.max(mx[..., 0, 0], axis=(0, 2)))
  if debug_blocks:
    return out, max_logits, dbg[:, 0, :, 0] != 0
  return out, max_logits
