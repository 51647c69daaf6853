"""Paged attention: queries of a decode (or prefill) step against a KV cache kept in pages.

A paged cache holds every sequence's keys and values in fixed-size pages of one shared pool;
a page table lists, per sequence, the pages holding its positions 0..page_size-1,
page_size..2*page_size-1, and so on. A query at position p sees the keys at positions 0..p of
its own sequence (causal), which is what a decode step of the engine needs: the new tokens'
keys are written first, then the queries attend.

Layouts (per layer):
  k_pages, v_pages: [kv_heads, num_pages, page_size, dim]. MLA keeps its latent cache as one
    key/value head (kv_heads = 1): key [c_kv; k_rope], value c_kv.
  page_table: [batch, pages_per_seq] int32 page ids; entries past a sequence's pages may hold
    any value (an id >= num_pages reads zeros), since no query sees those positions.

`paged_attention` is the XLA reference: it gathers each sequence's pages into a contiguous
run of positions per key/value head and computes attention as
`models.kernels.attention.attention` does over a contiguous cache. models/kernels/paged_attention_tpu.py
is the Pallas TPU kernel with the same signature; the attention layers (models/attention.py)
take the kernel when kernels target a TPU, the reference elsewhere.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from models.kernels.mask import MASK_VALUE


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
  """Each sequence's pages, in order, as one contiguous run of positions.

  Args:
    pages: [kv_heads, num_pages, page_size, dim].
    page_table: [batch, pages_per_seq] int32; ids >= num_pages read zeros.

  Returns:
    [batch, pages_per_seq * page_size, kv_heads, dim].
  """
  return jnp.transpose(_pages_by_head(pages, page_table), (1, 2, 0, 3))


def _pages_by_head(pages: jax.Array, page_table: jax.Array) -> jax.Array:
  """[kv_heads, batch, pages_per_seq * page_size, dim]: `gather_pages` without moving the
  head axis (a reshape, no transpose)."""
  kvh, _, ps, d = pages.shape
  b, n = page_table.shape
  g = jnp.take(pages, page_table, axis=1, mode="fill", fill_value=0)  # [kvh, b, n, ps, d]
  return g.reshape(kvh, b, n * ps, d)


def check_shapes(q, k_pages, v_pages, page_table, q_start, q_rope, k_rope_pages) -> None:
  """Raises ValueError naming the argument whose shape does not fit the others."""
  b, _, h, d = q.shape
  kvh, num_pages, ps, _ = k_pages.shape
  if k_pages.shape[-1] != d:
    raise ValueError(f"k_pages {k_pages.shape}: head dim {k_pages.shape[-1]} != q's {d}")
  if v_pages.shape[:3] != k_pages.shape[:3]:
    raise ValueError(f"v_pages {v_pages.shape}: leading dims differ from k_pages {k_pages.shape}")
  if h % kvh:
    raise ValueError(f"q {q.shape}: heads={h} is not a multiple of kv_heads={kvh}")
  if page_table.ndim != 2 or page_table.shape[0] != b:
    raise ValueError(f"page_table {page_table.shape}: expected [batch={b}, pages_per_seq]")
  if q_start.shape != (b,):
    raise ValueError(f"q_start {q_start.shape}: expected [batch={b}]")
  if (q_rope is None) != (k_rope_pages is None):
    raise ValueError("q_rope and k_rope_pages: give both or neither")
  if q_rope is not None and (q_rope.shape[:3] != q.shape[:3]
                             or k_rope_pages.shape[:3] != k_pages.shape[:3]
                             or q_rope.shape[-1] != k_rope_pages.shape[-1]):
    raise ValueError(f"q_rope {q_rope.shape} / k_rope_pages {k_rope_pages.shape} do not match "
                     f"q {q.shape} / k_pages {k_pages.shape}")


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    page_table: jax.Array, q_start: jax.Array, *, scale: float,
                    q_rope: Optional[jax.Array] = None,
                    k_rope_pages: Optional[jax.Array] = None) -> jax.Array:
  """Causal attention of s new queries per sequence over the sequence's pages (XLA reference).

  Query t of sequence b sits at position q_start[b] + t and sees the keys at positions
  0..q_start[b] + t. The logit of a key is scale * (q·k + q_rope·k_rope): MLA passes its
  rotary parts separately so that the cache never holds the concatenated key.

  Args:
    q: [batch, s, heads, dim] queries.
    k_pages: [kv_heads, num_pages, page_size, dim] keys.
    v_pages: [kv_heads, num_pages, page_size, v_dim] values.
    page_table: [batch, pages_per_seq] int32 pages of each sequence.
    q_start: [batch] int32 position of each sequence's first query.
    scale: softmax scale.
    q_rope: [batch, s, heads, rope_dim] second query part, or None.
    k_rope_pages: [kv_heads, num_pages, page_size, rope_dim] second key part, or None.

  Returns:
    [batch, s, heads, v_dim] in q's dtype.

  Raises:
    ValueError: shapes that do not fit together.
  """
  check_shapes(q, k_pages, v_pages, page_table, q_start, q_rope, k_rope_pages)
  b, s, h, _ = q.shape
  kvh = k_pages.shape[0]
  k, v = _pages_by_head(k_pages, page_table), _pages_by_head(v_pages, page_table)
  if q_rope is not None:
    q = jnp.concatenate([q, q_rope], -1)
    k = jnp.concatenate([k, _pages_by_head(k_rope_pages, page_table)], -1)
  t = k.shape[2]
  # The math of `models.kernels.attention.attention` (fp32 logits, probabilities rounded to
  # the values' dtype, fp32 accumulation), on the pages' head-major layout.
  qg = q.reshape(b, s, kvh, h // kvh, q.shape[-1])
  logits = jnp.einsum("bqkgd,kbtd->bkgqt", qg, k, preferred_element_type=jnp.float32) * scale
  q_pos = q_start[:, None].astype(jnp.int32) + jnp.arange(s, dtype=jnp.int32)[None]  # [b, s]
  visible = jnp.arange(t, dtype=jnp.int32)[None, None] <= q_pos[:, :, None]  # [b, s, t]
  logits = jnp.where(visible[:, None, None], logits, MASK_VALUE)
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgqt,kbtd->bqkgd", probs, v, preferred_element_type=jnp.float32)
  return out.reshape(b, s, h, v.shape[-1]).astype(q.dtype)

