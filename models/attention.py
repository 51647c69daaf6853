"""Attention layers: grouped-query attention (Qwen2/Qwen3), multi-head latent attention (DeepSeek).

Both go through `models.kernels.attention.attention` and return the per-head max logit for
QK-Clip. With a decode cache, new keys are written at each row's `index` and queries attend to
the cache; MLA then caches only the compressed latent and the rotary key, with the key/value
up-projections absorbed into the query and the output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from models.config import ModelConfig
from models.kernels import paged_attention_tpu, paged_write_tpu
from models.kernels.attention import attention, target_platform
from models.kernels.paged_attention import paged_attention
from models.layers import Dense, RMSNorm, dtype_of, round_to
from models.rope import apply_rope
from models.sharding import constrain, logical_to_spec, param_spec

# DeepSeek's reference code and transformers build the MLA latent norms (q_a_layernorm,
# kv_a_layernorm) with eps 1e-6 whatever rms_norm_eps says.
MLA_LATENT_NORM_EPS = 1e-6


def write_cache(cache: jax.Array, new: jax.Array, index: jax.Array, seq_axis: int = 1
                ) -> jax.Array:
  """Write new entries into a cache at per-row offsets.

  Positions past the capacity are dropped, never clamped: a padded prefill chunk near the end
  of a row must not shift back over cached keys (and the scatter is faster than a vmapped
  dynamic_update_slice on CPU).

  Args:
    cache: the batch first, the capacity at `seq_axis` and new's trailing axes, in order,
      elsewhere (e.g. [batch, capacity, ...] or [batch, kv_heads, capacity, head_dim]).
    new: [batch, s, ...] entries to write.
    index: [batch] slot of each row's first new entry.
    seq_axis: the cache's capacity axis.

  Returns:
    The updated cache (in the cache's dtype).
  """
  b, s = new.shape[:2]
  pos = index[:, None] + jnp.arange(s, dtype=index.dtype)[None]
  where = [slice(None)] * cache.ndim
  where[0], where[seq_axis] = jnp.arange(b)[:, None], pos
  return cache.at[tuple(where)].set(new.astype(cache.dtype), mode="drop")


def cache_view(index: jax.Array, s: int, capacity: int) -> tuple[jax.Array, jax.Array]:
  """The tree-rule view of a cache for queries at slots index..index+s-1.

  Every cached key is visible to all later queries (end = capacity); slots past the query are
  excluded by the rule's j <= i, so stale or unwritten slots are never read.

  Args:
    index: [batch] slot of each row's first query.
    s: queries per row.
    capacity: slots per cache row.

  Returns:
    (q_index [batch, s], end [batch, capacity]) for `models.kernels.attention.attention`.
  """
  q_index = index[:, None] + jnp.arange(s, dtype=jnp.int32)[None]
  end = jnp.full((index.shape[0], capacity), capacity, jnp.int32)
  return q_index, end


def write_pages(pages: jax.Array, new: jax.Array, page_table: jax.Array, index: jax.Array
                ) -> jax.Array:
  """Write new entries into a paged cache at per-sequence positions.

  Positions whose page-table entry is past the table or names no page (an id >= num_pages)
  are dropped: padding rows and padded prefill positions past a sequence's pages write
  nothing. A decode step (s = 1) for a TPU is written by the Pallas kernel
  `models.kernels.paged_write_tpu.write_entries` (the same entries, in place).

  Args:
    pages: [kv_heads, num_pages, page_size, dim] the layer's pages.
    new: [batch, s, kv_heads, dim] entries to write.
    page_table: [batch, pages_per_seq] int32 page ids of each sequence.
    index: [batch] position of each sequence's first new entry.

  Returns:
    The updated pages (in their dtype).
  """
  num_pages, page_size = pages.shape[1:3]
  b, s = new.shape[:2]
  pos = index[:, None] + jnp.arange(s, dtype=index.dtype)[None]  # [b, s]
  slot = pos // page_size
  n = page_table.shape[1]
  page = jnp.take_along_axis(page_table, jnp.minimum(slot, n - 1), axis=1)
  page = jnp.where(slot < n, page, num_pages)
  values = jnp.transpose(new, (2, 0, 1, 3)).astype(pages.dtype)  # [kv_heads, b, s, dim]
  if target_platform() == "tpu" and s == 1:  # a decode step: DMA'd in place, costed as such
    return paged_write_tpu.write_entries(pages, values[:, :, 0], page[:, 0],
                                         pos[:, 0] % page_size)
  # Every index explicit, the head's too: the scatter's window is then one entry's `dim`
  # values, contiguous in the pages' row-major layout, which XLA keeps (with the heads as a
  # window it lays the pages out heads-minor and copies them whole around the TPU kernel).
  heads = jnp.arange(pages.shape[0])[:, None, None]
  return pages.at[heads, page[None], (pos % page_size)[None]].set(values, mode="drop")


def _paged_attention(q, k_pages, v_pages, page_table, q_start, **kwargs):
  """Paged attention: decode steps (one query per row) through the Pallas TPU kernel when
  kernels target a TPU; else, and for prefill chunks (whose query rows would not fit the
  kernel's VMEM blocks), the XLA reference (`models.kernels.paged_attention.paged_attention`,
  same arguments)."""
  if target_platform() == "tpu" and q.shape[1] == 1:
    return paged_attention_tpu.paged_attention(q, k_pages, v_pages, page_table, q_start,
                                               **kwargs)
  return paged_attention(q, k_pages, v_pages, page_table, q_start, **kwargs)


def paged_step(cfg: ModelConfig, attend, queries: tuple, new: dict, pages: dict,
               page_table: jax.Array, index: jax.Array):
  """Writes a step's keys and values into a paged cache, then attends (GQA's and MLA's paged
  path), per batch shard when the decode layout splits the pages over the mesh.

  The decode layout (models/engine/layout.py) maps the logical axis `pages` to the batch
  shards: each shard holds its own pages and the sequences of its own rows, and `page_table`
  holds page ids local to the row's shard. Then the write and the attention run under
  `jax.shard_map` (rows and pages over those axes, heads over `tensor` where they divide), so a
  step reads only the shard's pages and no page crosses devices. Without that rule (one device,
  or a pool replicated over the shards) they run as is.

  Args:
    cfg: the model config (its `sharding_rules`).
    attend: attend(queries, pages, page_table, index) -> out [b, s, heads, d'], e.g.
      `_paged_attention` over the written pages.
    queries: arrays [b, s, heads, ...].
    new: {name: [b, s, kv_heads, d]} the entries to write into pages[name].
    pages: {name: [kv_heads, num_pages, page_size, d]} the layer's pages.
    page_table: [b, pages_per_seq] int32 (shard-local ids under the rule).
    index: [b] the position of each row's first new entry.

  Returns:
    (out, the updated pages).
  """
  def local(queries, new, pages, page_table, index):
    pages = {n: write_pages(pages[n], new[n], page_table, index) for n in pages}
    return attend(queries, pages, page_table, index), pages

  mesh = jax.sharding.get_abstract_mesh()
  rules = dict(cfg.sharding_rules)
  if mesh.empty or not rules.get("pages"):
    return local(queries, new, pages, page_table, index)
  rows = logical_to_spec(("pages",), cfg.sharding_rules, mesh)[0]
  kv_heads = next(iter(pages.values())).shape[0]
  heads = param_spec(("kv_heads",), (kv_heads,), cfg.sharding_rules, mesh)
  heads = heads[0] if len(heads) else None
  if kv_heads == 1:  # one latent head (MLA, MQA): every query head reads it
    q_heads = param_spec(("act_heads",), (queries[0].shape[2],), cfg.sharding_rules, mesh)
    q_heads = q_heads[0] if len(q_heads) else None
  else:  # a query head stays with its key/value head, or no head is split
    q_heads = heads
  q_spec = PartitionSpec(rows, None, q_heads)
  page_spec = {n: PartitionSpec(heads, rows) for n in pages}
  # check_vma off: the Pallas TPU kernel's outputs carry no varying-axes annotation
  run = jax.shard_map(local, mesh=mesh, out_specs=(q_spec, page_spec), check_vma=False, in_specs=(
      (q_spec,) * len(queries), {n: PartitionSpec(rows, None, heads) for n in new}, page_spec,
      PartitionSpec(rows), PartitionSpec(rows)))
  return run(queries, new, pages, page_table, index)


def _partition(cfg: ModelConfig):
  """(batch, head, sequence) mesh axes of the attention activations [batch, seq, heads, dim]
  under the current mesh, or None outside one."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return None
  spec = logical_to_spec(("batch", "seq", "act_heads"), cfg.sharding_rules, mesh)
  return spec[0], spec[2], spec[1]

class GQA(nnx.Module):
  """Grouped-query attention with optional q/k/v bias (Qwen2) and q/k RMSNorm (Qwen3).

  Args:
    cfg: the model config (`num_heads`, `num_kv_heads`, `head_dim`, `qkv_bias`, `qk_norm`).

  References:
    Ainslie et al., "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head
    Checkpoints", arXiv:2305.13245.
  """

  def __init__(self, cfg: ModelConfig):
    self.cfg = cfg
    d, h, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.q_proj = Dense((d,), (h, hd), ("embed",), ("heads", "kv"), cfg, bias=cfg.qkv_bias)
    self.k_proj = Dense((d,), (kvh, hd), ("embed",), ("kv_heads", "kv"), cfg,
                        bias=cfg.qkv_bias)
    self.v_proj = Dense((d,), (kvh, hd), ("embed",), ("kv_heads", "kv"), cfg,
                        bias=cfg.qkv_bias)
    self.o_proj = Dense((h, hd), (d,), ("heads", "kv"), ("embed",), cfg)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
      self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

  def init_cache(self, batch: int, capacity: int) -> dict:
    """Allocates this layer's empty KV cache.

    The layouts are those the two attention matmuls read without transposing the cache every
    decode step.

    Args:
      batch: cache rows.
      capacity: token slots per row.

    Returns:
      {"k": [batch, kv_heads, capacity, head_dim], "v": [batch, kv_heads, head_dim, capacity]}
      zeros in the compute dtype.
    """
    kvh, hd, dt = self.cfg.num_kv_heads, self.cfg.head_dim, dtype_of(self.cfg)
    return {"k": jnp.zeros((batch, kvh, capacity, hd), dt),
            "v": jnp.zeros((batch, kvh, hd, capacity), dt)}

  def init_paged_cache(self, num_pages: int, page_size: int) -> dict:
    """Allocates this layer's empty paged KV cache (`models.kernels.paged_attention`).

    Args:
      num_pages: pages in the pool.
      page_size: token positions per page.

    Returns:
      {"k", "v": [kv_heads, num_pages, page_size, head_dim]} zeros in the compute dtype.
    """
    kvh, hd, dt = self.cfg.num_kv_heads, self.cfg.head_dim, dtype_of(self.cfg)
    return {"k": jnp.zeros((kvh, num_pages, page_size, hd), dt),
            "v": jnp.zeros((kvh, num_pages, page_size, hd), dt)}

  def __call__(self, x, cos, sin, end, cache=None, index=None, page_table=None):
    """Attend over x (or, with a cache, over the cache after writing x's keys and values).

    Args:
      x: [batch, seq, hidden] normed input.
      cos: rotary cosine table of x's positions (`models.rope.cos_sin`).
      sin: the matching sine table.
      end: [batch, seq] tree-rule ends; ignored (may be None) with a cache.
      cache: this layer's cache from `init_cache` (or `init_paged_cache`), or None.
      index: [batch] cache slot of each row's first token (with a cache).
      page_table: [batch, pages_per_seq] int32 pages of each row, with a paged cache.

    Returns:
      (out [batch, seq, hidden], max_logits [heads] fp32, updated cache or None). With a paged
      cache max_logits are zeros (QK-Clip reads training passes only).
    """
    cfg = self.cfg
    q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q = apply_rope(q, cos, sin, interleaved=False)
    k = apply_rope(k, cos, sin, interleaved=False)
    q = constrain(q, ("batch", "seq", "act_heads", None), cfg)
    q_index = None
    if page_table is not None:
      def attend(queries, pages, table, start):
        return _paged_attention(queries[0], pages["k"], pages["v"], table, start,
                                scale=cfg.softmax_scale)
      out, cache = paged_step(cfg, attend, (q,), {"k": k, "v": v}, cache, page_table, index)
      return self.o_proj(out), jnp.zeros((cfg.num_heads,), jnp.float32), cache
    if cache is not None:
      cache = {"k": write_cache(cache["k"], k, index, 2), "v": write_cache(cache["v"], v, index, 3)}
      k, v = jnp.swapaxes(cache["k"], 1, 2), jnp.transpose(cache["v"], (0, 3, 1, 2))
      q_index, end = cache_view(index, x.shape[1], k.shape[1])
    out, max_logits = attention(q, k, v, end, scale=cfg.softmax_scale, q_index=q_index,
                                impl=cfg.attention_impl, partition=_partition(cfg))
    return self.o_proj(out), max_logits, cache


class MLA(nnx.Module):
  """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2).

  Query: q = W_UQ·RMSNorm(W_DQ·x) (or a direct projection when q_lora_rank is None), split
  into a no-RoPE part [nope] and a rotary part [rope] per head. Keys/values: a latent
  c_kv = RMSNorm(first kv_lora_rank of W_DKV·x) expanded per head by kv_b_proj into
  [k_nope, v]; the rotary key (last rope features of W_DKV·x) is one vector shared by heads.

  Args:
    cfg: the model config (`q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`,
      `qk_rope_head_dim`, `v_head_dim`, `rope_interleave`).

  References:
    DeepSeek-AI, "DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts Language
    Model", arXiv:2405.04434, §2.1.
  """

  def __init__(self, cfg: ModelConfig):
    self.cfg = cfg
    d, h = cfg.hidden_size, cfg.num_heads
    qk, r = cfg.qk_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank is None:
      self.q_proj = Dense((d,), (h, qk), ("embed",), ("heads", "kv"), cfg)
    else:
      self.q_a_proj = Dense((d,), (cfg.q_lora_rank,), ("embed",), ("q_lora",), cfg)
      self.q_a_norm = RMSNorm(cfg.q_lora_rank, MLA_LATENT_NORM_EPS)
      self.q_b_proj = Dense((cfg.q_lora_rank,), (h, qk), ("q_lora",), ("heads", "kv"), cfg)
    self.kv_a_proj = Dense((d,), (r + cfg.qk_rope_head_dim,), ("embed",), ("kv_lora",), cfg)
    self.kv_a_norm = RMSNorm(r, MLA_LATENT_NORM_EPS)
    self.kv_b_proj = Dense((r,), (h, cfg.qk_nope_head_dim + cfg.v_head_dim), ("kv_lora",),
                           ("heads", "kv"), cfg)
    self.o_proj = Dense((h, cfg.v_head_dim), (d,), ("heads", "kv"), ("embed",), cfg)

  def init_cache(self, batch: int, capacity: int) -> dict:
    """Allocates this layer's empty latent cache.

    Args:
      batch: cache rows.
      capacity: token slots per row.

    Returns:
      {"c_kv": [batch, capacity, kv_lora_rank], "k_rope": [batch, capacity, qk_rope_head_dim]}
      zeros in the compute dtype.
    """
    cfg = self.cfg
    return {"c_kv": jnp.zeros((batch, capacity, cfg.kv_lora_rank), dtype_of(cfg)),
            "k_rope": jnp.zeros((batch, capacity, cfg.qk_rope_head_dim), dtype_of(cfg))}

  def init_paged_cache(self, num_pages: int, page_size: int) -> dict:
    """Allocates this layer's empty paged latent cache (one key/value head).

    Args:
      num_pages: pages in the pool.
      page_size: token positions per page.

    Returns:
      {"c_kv": [1, num_pages, page_size, kv_lora_rank],
       "k_rope": [1, num_pages, page_size, qk_rope_head_dim]} zeros in the compute dtype.
    """
    cfg = self.cfg
    return {"c_kv": jnp.zeros((1, num_pages, page_size, cfg.kv_lora_rank), dtype_of(cfg)),
            "k_rope": jnp.zeros((1, num_pages, page_size, cfg.qk_rope_head_dim),
                                dtype_of(cfg))}

  def _query(self, x, cos, sin):
    cfg = self.cfg
    if cfg.q_lora_rank is None:
      q = self.q_proj(x)
    else:
      q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
    q_nope, q_rope = q[..., :cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
    return q_nope, apply_rope(q_rope, cos, sin, cfg.rope_interleave)

  def _latent(self, x, cos, sin):
    cfg = self.cfg
    kv = self.kv_a_proj(x)
    c_kv = self.kv_a_norm(kv[..., :cfg.kv_lora_rank])
    k_rope = apply_rope(kv[..., None, cfg.kv_lora_rank:], cos, sin, cfg.rope_interleave)
    return c_kv, k_rope[:, :, 0]

  def __call__(self, x, cos, sin, end, cache=None, index=None, page_table=None):
    """Attend over x, or, with a cache, in latent space over the cache (`_absorbed`).

    Arguments and outputs as `GQA.__call__`.
    """
    cfg = self.cfg
    q_nope, q_rope = self._query(x, cos, sin)
    c_kv, k_rope = self._latent(x, cos, sin)
    if page_table is not None:
      out, cache = self._absorbed_paged(q_nope, q_rope, c_kv, k_rope, cache, index, page_table)
      return self.o_proj(out), jnp.zeros((cfg.num_heads,), jnp.float32), cache
    if cache is not None:
      cache = {"c_kv": write_cache(cache["c_kv"], c_kv, index),
               "k_rope": write_cache(cache["k_rope"], k_rope, index)}
      q_index, end = cache_view(index, x.shape[1], cache["c_kv"].shape[1])
      out, max_logits = self._absorbed(q_nope, q_rope, cache["c_kv"], cache["k_rope"], end,
                                       q_index)
      return self.o_proj(out), max_logits, cache
    if cfg.mla_absorbed_training:
      out, max_logits = self._absorbed(q_nope, q_rope, c_kv, k_rope, end)
      return self.o_proj(out), max_logits, None
    kv = self.kv_b_proj(c_kv)  # [b, s, h, nope + v]
    k_nope, v = kv[..., :cfg.qk_nope_head_dim], kv[..., cfg.qk_nope_head_dim:]
    k_rope = jnp.broadcast_to(k_rope[:, :, None], k_nope.shape[:-1] + k_rope.shape[-1:])
    q = constrain(jnp.concatenate([q_nope, q_rope], -1), ("batch", "seq", "act_heads", None), cfg)
    k = jnp.concatenate([k_nope, k_rope], -1)
    out, max_logits = attention(q, k, v, end, scale=cfg.softmax_scale, impl=cfg.attention_impl,
                                partition=_partition(cfg))
    return self.o_proj(out), max_logits, None

  def _absorbed(self, q_nope, q_rope, c_kv, k_rope, end, q_index=None):
    """Attention in latent space: MQA with key [c_kv; k_rope] and value c_kv, shared by heads.

    q_nope·k_nope = (W_UK^T q_nope)·c_kv, and the output up-projection W_UV is applied after
    the softmax-weighted sum of latents, so the cache never holds per-head keys or values.
    Both products accumulate in fp32 and round once, as `Dense` does.

    Args:
      q_nope, q_rope: [b, s, h, d_nope], [b, s, h, d_rope] queries.
      c_kv, k_rope: [b, t, r], [b, t, d_rope] latents and rotary keys (the cache, or the row).
      end: [b, t] the tree-rule end of each key.
      q_index: [b, s] the queries' slots in a cache; None: the row itself (full pass).

    Returns:
      (out [b, s, h, d_v] before o_proj, max_logits [h]).
    """
    cfg = self.cfg
    q_latent, w_uv = self._absorb_query(q_nope)
    q = jnp.concatenate([q_latent, q_rope], -1)
    k = jnp.concatenate([c_kv, k_rope], -1)[:, :, None]
    if q_index is None:
      q = constrain(q, ("batch", "seq", "act_heads", None), cfg)
      out_latent, max_logits = attention(q, k, c_kv[:, :, None], end, scale=cfg.softmax_scale,
                                         impl=cfg.attention_impl, partition=_partition(cfg))
    else:
      out_latent, max_logits = attention(q, k, c_kv[:, :, None], end, scale=cfg.softmax_scale,
                                         q_index=q_index)
    out = round_to(jnp.einsum("bshr,rhv->bshv", out_latent, w_uv,
                              preferred_element_type=jnp.float32), q_nope.dtype)
    return out, max_logits

  def _absorb_query(self, q_nope):
    """(q_latent [b, s, h, r] = W_UK^T q_nope rounded to the compute dtype, W_UV [r, h, v])."""
    cfg, dt = self.cfg, q_nope.dtype
    w = self.kv_b_proj.kernel[...].astype(dt)  # [r, h, nope + v]
    w_uk, w_uv = w[..., :cfg.qk_nope_head_dim], w[..., cfg.qk_nope_head_dim:]
    return round_to(jnp.einsum("bshn,rhn->bshr", q_nope, w_uk,
                               preferred_element_type=jnp.float32), dt), w_uv

  def _absorbed_paged(self, q_nope, q_rope, c_kv, k_rope, pages, index, page_table):
    """`_absorbed` over a paged cache, after writing the new latents into it (`paged_step`).

    Args:
      q_nope, q_rope: [b, s, h, d_nope], [b, s, h, d_rope] queries.
      c_kv, k_rope: [b, s, r], [b, s, d_rope] the new positions' latents and rotary keys.
      pages: {"c_kv": [1, num_pages, page_size, r], "k_rope": [1, num_pages, page_size,
        d_rope]} the layer's pages.
      index: [b] the position of each row's first query.
      page_table: [b, pages_per_seq] int32.

    Returns:
      (out [b, s, h, d_v] before o_proj, the updated pages).
    """
    cfg = self.cfg
    q_latent, w_uv = self._absorb_query(q_nope)
    def attend(queries, pages, table, start):
      return _paged_attention(queries[0], pages["c_kv"], pages["c_kv"], table, start,
                              scale=cfg.softmax_scale, q_rope=queries[1],
                              k_rope_pages=pages["k_rope"])
    out_latent, pages = paged_step(cfg, attend, (q_latent, q_rope),
                                   {"c_kv": c_kv[:, :, None], "k_rope": k_rope[:, :, None]},
                                   pages, page_table, index)
    out = round_to(jnp.einsum("bshr,rhv->bshv", out_latent, w_uv,
                              preferred_element_type=jnp.float32), q_nope.dtype)
    return out, pages
