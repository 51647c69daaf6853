"""The contiguous KV-cache pool: one row of `capacity` positions per sequence.

The pool is `slots + prefix_cache_rows` rows (`Transformer.init_cache`); a sequence id is a
row index. A request takes a row: the row with the longest common prefix is reused in place
when the request just extends it and nobody runs it, else its prefix is copied into the least
recently used free row (one device call, `programs.copy_row`). So G samples of a prompt
prefill it once and the next turn of an agent episode prefills only its new tokens. A row
nobody runs keeps its cache until it is overwritten (least recently used first). Every row
holds `capacity` positions, so `reserve` always succeeds and nothing is ever preempted.

Prefill and decode gather the rows they address from the pool and scatter them back
(`programs.prefill`, `programs.decode`); rows out of range are padding.

On a mesh (layout.py) the rows are replicated over the batch shards and their key/value heads
split over `tensor`; the rows a call gathers are split over the batch shards like the slots.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import numpy as np

from models.engine import programs
from models.engine.cache import KVCache, weights_device, zeros
from models.engine.config import EngineConfig
from models.engine.layout import Layout, specs_of


def _lcp(rows: np.ndarray, lengths: np.ndarray, target: np.ndarray) -> np.ndarray:
  """Common-prefix length of target [n] with each row's tokens rows[r, :lengths[r]]."""
  n = len(target)
  if n == 0:
    return np.zeros(len(rows), np.int64)
  eq = (rows[:, :n] == target[None]) & (np.arange(n)[None] < lengths[:, None])
  return np.where(eq.all(1), n, np.argmin(eq, axis=1))


class CachePool(KVCache):
  """Rows of decode caches and what each holds (the `KVCache` interface; sequence = row).

  Args:
    model: the (unstacked) Transformer whose `init_cache` lays the rows out (no weight is
      kept).
    num_rows: rows in the pool.
    capacity: positions per row.
    count: called with counter increments (evictions, row_copies).
    experts: keep the MoE routing of every cached position (routing replay).
    layout: the engine's decode layout on a mesh (places the rows), or None (one device).
  """

  def __init__(self, model, num_rows: int, capacity: int, count: Callable[..., None],
               experts: bool = False, layout: Optional[Layout] = None):
    self.num_rows, self.capacity = num_rows, capacity
    self._shapes = jax.eval_shape(lambda: model.init_cache(num_rows, capacity))
    self._layout = layout
    self._device = None if layout is not None else weights_device(model)
    self._shardings = self._specs = None  # one device: unconstrained
    if layout is not None:
      heads = 1 if model.cfg.attention == "gqa" else None  # k/v [rows, kv_heads, ...]
      self._shardings = layout.cache_shardings(self._shapes, heads)
      self._specs = (specs_of(self._shardings),
                     specs_of(layout.cache_shardings(self._shapes, heads, rows_dim=0)))
    self._count = count
    self.caches = self._zeros()
    self.tokens = np.zeros((num_rows, capacity), np.int32)  # each row's token ids
    self.length = np.zeros(num_rows, np.int64)  # valid tokens of each row
    self.version = np.full(num_rows, -1, np.int64)  # weights version that computed the row
    self.used = np.zeros(num_rows, np.int64)  # last use, for LRU eviction
    self.owner: list[Any] = [None] * num_rows  # the request running on each row
    # MoE routing of every cached position (routing replay), kept on the host beside the
    # cache so that reused prefixes bring their experts along; int16 holds any expert count.
    self.experts = np.zeros((num_rows, capacity, model.cfg.num_moe_layers,
                             model.cfg.experts_per_token), np.int16) if experts else None
    self._tick = 0

  @classmethod
  def create(cls, model, config: EngineConfig, count: Callable[..., None],
             layout: Optional[Layout] = None) -> "CachePool":
    """`slots + prefix_cache_rows` rows of `max_seq_len` positions."""
    return cls(model, config.slots + config.prefix_cache_rows, config.max_seq_len, count,
               experts=config.return_expert_ids, layout=layout)

  def _zeros(self) -> Any:
    return zeros(self._shapes, self._layout, self._shardings, self._device)

  def reset(self) -> None:
    self.caches = self._zeros()
    self.length[:] = 0
    self.version[:] = -1

  def _touch(self, row: int) -> None:
    self._tick += 1
    self.used[row] = self._tick

  def longest_prefix(self, target: np.ndarray, version: int, min_prefix: int
                     ) -> tuple[Optional[int], int]:
    lcp = _lcp(self.tokens, self.length, target)
    lcp[self.version != version] = 0
    if not len(target) or lcp.max() < min_prefix:
      return None, 0
    m = int(lcp.max())
    free_exact = [r for r in np.flatnonzero(lcp == m)
                  if self.owner[r] is None and self.length[r] == m]
    return (free_exact[0] if free_exact else int(np.argmax(lcp))), m

  def claim(self, owner: Any, src: Optional[int], m: int, version: int, shard: int = 0
            ) -> int:
    """A free `src` holding exactly m positions is taken in place; otherwise the least
    recently used free row, with `src`'s first m positions copied into it now."""
    if src is not None and self.owner[src] is None and self.length[src] == m:
      dst = src
    else:
      free = [r for r in range(self.num_rows) if self.owner[r] is None]
      dst = min(free, key=lambda r: self.used[r])  # least recently used
      if dst != src and self.length[dst] > 0:
        self._count(evictions=1)
      if src is not None and dst != src:
        self.caches = programs.copy_row(self.caches, np.int32(src), np.int32(dst),
                                        specs=self._specs and self._specs[0])
        self.tokens[dst, :m] = self.tokens[src, :m]
        if self.experts is not None:
          self.experts[dst, :m] = self.experts[src, :m]
        self._count(row_copies=1)
    self.owner[dst] = owner
    self.length[dst] = m
    self.version[dst] = version
    self._touch(dst)
    return dst

  def reserve(self, sid: int, upto: int) -> bool:
    """Always True: a row holds `capacity` positions from the start."""
    return True

  def release(self, sid: int) -> None:
    self.owner[sid] = None
    self._touch(sid)

  def _rows(self, sids: list[Optional[int]], b: int) -> np.ndarray:
    """[b] int32 the row of each of `b` batch rows; None and rows past `sids` are padding
    (`num_rows`: out of range, read as zeros and never written)."""
    rows = np.full(b, self.num_rows, np.int32)
    for i, sid in enumerate(sids):
      if sid is not None:
        rows[i] = sid
    return rows

  def prefill(self, graphdef, state, sids: list[int], tokens: np.ndarray, starts: np.ndarray,
              lengths: list[int]) -> None:
    if self._layout is not None:
      tokens, starts = self._layout.pad_rows(tokens, starts)
    rows = self._rows(sids, len(starts))
    if self.experts is None:
      self.caches = programs.prefill(graphdef, state, self.caches, rows, tokens, starts,
                                     specs=self._specs)
    else:
      self.caches, ids = programs.prefill(graphdef, state, self.caches, rows, tokens, starts,
                                          experts=True, specs=self._specs)
      ids = np.asarray(ids).transpose(1, 2, 0, 3)  # [b, p, moe_layers, k]
    for i, (row, n) in enumerate(zip(sids, lengths)):
      start = int(starts[i])
      if self.experts is not None:
        self.experts[row, start:start + n] = ids[i, :n]
      self.tokens[row, start:start + n] = tokens[i, :n]
      self.length[row] = start + n

  def decode(self, graphdef, k: int, top_n: int, experts: bool, state,
             sids: list[Optional[int]], *inputs, **masks) -> tuple:
    self.caches, *out = programs.decode(graphdef, k, top_n, experts, state, self.caches,
                                        self._rows(sids, len(sids)), *inputs, **masks,
                                        specs=self._specs)
    return tuple(out)

  def record(self, sid: int, seq: np.ndarray, experts: Optional[np.ndarray] = None) -> None:
    start = self.length[sid]
    if experts is not None:
      self.experts[sid, start:start + len(experts)] = experts
    self.tokens[sid, start:len(seq) - 1] = seq[start:-1]
    self.length[sid] = len(seq) - 1

  def expert_ids(self, sid: int) -> np.ndarray:
    return self.experts[sid, :self.length[sid]].copy()
