"""Paged attention as a Pallas TPU kernel: the decode step's queries read the KV pages their
page table names, page by page, with an online softmax.

Same signature and result as the XLA reference `models.kernels.paged_attention.paged_attention`
(see its module docstring for the layouts), plus `interpret`.

Grid (batch, kv_heads, pages_per_seq / pages_per_block). For one sequence and key/value head
the kernel keeps the s queries x heads-per-kv-head rows of that head group in VMEM and walks the
sequence's pages, `pages_per_block` per grid step: the page table and query starts are
scalar-prefetched (SMEM), and the pages are `pages_per_block` inputs whose block indices are
read from the table, so the pipeline DMAs exactly the pages the sequence holds, several at a
time. Pages past the sequence's last query position are skipped (their block index repeats the
last needed page); positions past a query are masked. MLA passes the rotary query and
key as a second part whose logits add to the first's.

    CPU:  paged_attention(..., interpret=True)   # Pallas interpreter, for tests
    TPU:  paged_attention(...)                    # Mosaic

Rows (s x heads per kv head) are padded to a multiple of 8 (the TPU sublane tile); page_size
and the head dims are whole block dims, so any sizes lower, and TPU-friendly ones (page_size a
multiple of 8, head dims of 128) run at full tiles.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from models.kernels.paged_attention import check_shapes

LANES = 128
SUBLANES = 8
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _precision(dtype) -> jax.lax.Precision:
  """fp32 pages multiply in full fp32; bf16 ones natively (Mosaic takes no fp32 contraction of
  bf16 operands, whatever the default matmul precision says)."""
  return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def _kernel(table_ref, start_ref, *refs, scale: float, s: int, group: int, blocks: int,
            page_size: int, per_block: int, has_rope: bool):
  refs = list(refs)
  q_ref = refs.pop(0)
  k_refs, v_refs = refs[:per_block], refs[per_block:2 * per_block]
  refs = refs[2 * per_block:]
  qr_ref, kr_refs = (refs[0], refs[1:1 + per_block]) if has_rope else (None, None)
  o_ref, m_sc, l_sc, acc_sc = refs[-4:]
  b, i = pl.program_id(0), pl.program_id(2)
  start = start_ref[b]
  # Non-negative integers: lax.div (truncating) lowers without the sign fix-up of floor
  # division, which Mosaic cannot lower without a TPU to ask for its generation.
  last = jax.lax.div(start + s - 1, page_size)  # last page any query sees

  @pl.when(i == 0)
  def _():
    m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  def attend(j):
    """Online-softmax update with the block's j-th page."""
    dims = (((1,), (1,)), ((), ()))  # q [rows, d] . k [page_size, d]^T
    dot = functools.partial(jax.lax.dot_general, precision=_precision(k_refs[j].dtype),
                            preferred_element_type=jnp.float32)
    logits = dot(q_ref[...], k_refs[j][...], dims)
    if has_rope:
      logits += dot(qr_ref[...], kr_refs[j][...], dims)
    logits = logits * scale
    rows = logits.shape[0]
    q_pos = start + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (rows, page_size), 0),
                                group)
    k_pos = ((i * per_block + j) * page_size
             + jax.lax.broadcasted_iota(jnp.int32, (rows, page_size), 1))
    logits = jnp.where(k_pos <= q_pos, logits, MASK_VALUE)
    m_prev = m_sc[...][:, :1]
    m_new = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
    p = jnp.exp(logits - m_new)
    alpha = jnp.exp(m_prev - m_new)
    l_new = alpha * l_sc[...][:, :1] + jnp.sum(p, axis=1, keepdims=True)
    v = v_refs[j][...]
    acc_sc[...] = alpha * acc_sc[...] + dot(p.astype(v.dtype), v, (((1,), (0,)), ((), ())))
    m_sc[...] = jnp.broadcast_to(m_new, m_sc.shape)
    l_sc[...] = jnp.broadcast_to(l_new, l_sc.shape)

  for j in range(per_block):
    pl.when(i * per_block + j <= last)(functools.partial(attend, j))

  @pl.when(i == blocks - 1)
  def _():
    o_ref[...] = (acc_sc[...] / l_sc[...][:, :1]).astype(o_ref.dtype)


def in_hbm(pages: jax.Array, interpret: Any) -> jax.Array:
  """`pages` pinned to HBM as the kernel's operand (Mosaic only; the interpreter has one memory).

  The kernel reads only the pages its tables name, but XLA sees the whole pool as an operand
  and, when a layer's pool fits in VMEM (a shard of a few tens of MB on v6e), stages all of it
  there before every call: the full pool read from HBM each decode step instead of the
  sequences' pages.
  """
  return pages if interpret else pltpu.with_memory_space_constraint(pages, pltpu.HBM)


def _group_rows(x: jax.Array, kvh: int, rows: int) -> jax.Array:
  """[b, s, heads, d] -> [b, kv_heads, rows, d]: row t * group + g is query t's head g of the
  kv head's group; rows past s * group are zeros."""
  b, s, h, d = x.shape
  x = x.reshape(b, s, kvh, h // kvh, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, -1, d)
  return jnp.pad(x, ((0, 0), (0, 0), (0, rows - x.shape[2]), (0, 0)))


def _cost(q, k_pages, v_pages, page_table, q_rope) -> pl.CostEstimate:
  """What one call costs at most: every page the tables name read once (the pipeline DMAs a
  sequence's pages only, never the pool: XLA would otherwise count each page operand whole),
  the queries read and the outputs written once."""
  b, s, h, d = q.shape
  kvh, _, page_size, dv = v_pages.shape
  dr = 0 if q_rope is None else q_rope.shape[-1]
  keys = b * page_table.shape[1] * page_size  # key positions per kv head
  size = jnp.dtype(k_pages.dtype).itemsize
  return pl.CostEstimate(
      flops=2 * b * s * h * page_table.shape[1] * page_size * (d + dr + dv),
      transcendentals=b * s * h * page_table.shape[1] * page_size,
      bytes_accessed=size * kvh * keys * (d + dv + dr) + 4 * page_table.size
      + jnp.dtype(q.dtype).itemsize * b * s * h * (d + dr + dv))


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    page_table: jax.Array, q_start: jax.Array, *, scale: float,
                    q_rope: Optional[jax.Array] = None, k_rope_pages: Optional[jax.Array] = None,
                    pages_per_block: int = 8, interpret: Any = False) -> jax.Array:
  """Causal attention of s new queries per sequence over its pages (Pallas TPU kernel).

  Args:
    q: [batch, s, heads, dim] queries.
    k_pages: [kv_heads, num_pages, page_size, dim] keys.
    v_pages: [kv_heads, num_pages, page_size, v_dim] values.
    page_table: [batch, pages_per_seq] int32 pages of each sequence; the pages holding
      positions 0..q_start + s - 1 must be valid ids (later entries are never read).
    q_start: [batch] int32 position of each sequence's first query.
    scale: softmax scale.
    q_rope: [batch, s, heads, rope_dim] second query part (MLA), or None.
    k_rope_pages: [kv_heads, num_pages, page_size, rope_dim] second key part, or None.
    pages_per_block: pages one grid step reads (fewer grid steps for small pages).
    interpret: run the kernel in the Pallas interpreter (True, or `pltpu.InterpretParams()`).

  Returns:
    [batch, s, heads, v_dim] in q's dtype.

  Raises:
    ValueError: shapes that do not fit together, or pages_per_block < 1.
  """
  check_shapes(q, k_pages, v_pages, page_table, q_start, q_rope, k_rope_pages)
  if pages_per_block < 1:
    raise ValueError(f"pages_per_block={pages_per_block}: must be >= 1")
  b, s, h, d = q.shape
  kvh, num_pages, page_size, _ = k_pages.shape
  dv = v_pages.shape[-1]
  n = page_table.shape[1]
  group = h // kvh
  rows = -(-s * group // SUBLANES) * SUBLANES
  has_rope = q_rope is not None
  # Out-of-range ids (pages a sequence does not hold) are clamped: such blocks are never read
  # by a visible position, and a DMA must stay inside the pool.
  table = jnp.clip(page_table.astype(jnp.int32), 0, num_pages - 1).reshape(-1)
  q_start = q_start.astype(jnp.int32)

  per_block = min(pages_per_block, n)
  blocks = -(-n // per_block)

  def page_map(j):
    """Block index of the j-th page of grid step i: pages past the last one any query sees
    repeat it (the pipeline fetches nothing new for them)."""
    def index(b_, h_, i, table_ref, start_ref):
      last = jnp.minimum(jax.lax.div(start_ref[b_] + s - 1, page_size), n - 1)
      return h_, table_ref[b_ * n + jnp.minimum(i * per_block + j, last)], 0, 0
    return index

  row_map = lambda b_, h_, i, *_: (b_, h_, 0, 0)
  pages = lambda dim: [pl.BlockSpec((None, None, page_size, dim), page_map(j))
                       for j in range(per_block)]
  in_specs = [pl.BlockSpec((None, None, rows, d), row_map), *pages(d), *pages(dv)]
  k_pages, v_pages = in_hbm(k_pages, interpret), in_hbm(v_pages, interpret)
  args = [_group_rows(q, kvh, rows), *[k_pages] * per_block, *[v_pages] * per_block]
  if has_rope:
    dr = q_rope.shape[-1]
    in_specs += [pl.BlockSpec((None, None, rows, dr), row_map), *pages(dr)]
    args += [_group_rows(q_rope, kvh, rows), *[in_hbm(k_rope_pages, interpret)] * per_block]
  kernel = functools.partial(_kernel, scale=scale, s=s, group=group, blocks=blocks,
                             page_size=page_size, per_block=per_block, has_rope=has_rope)
  out = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(b, kvh, blocks),
          in_specs=in_specs,
          out_specs=pl.BlockSpec((None, None, rows, dv), row_map),
          scratch_shapes=[pltpu.VMEM((rows, LANES), jnp.float32),  # running max
                          pltpu.VMEM((rows, LANES), jnp.float32),  # running sum
                          pltpu.VMEM((rows, dv), jnp.float32)]),   # output accumulator
      out_shape=jax.ShapeDtypeStruct((b, kvh, rows, dv), q.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret,
      name="paged_attention",
      cost_estimate=_cost(q, k_pages, v_pages, page_table, q_rope),
  )(table, q_start, *args)
  out = out[:, :, :s * group].reshape(b, kvh, s, group, dv).transpose(0, 2, 1, 3, 4)
  return out.reshape(b, s, h, dv)
