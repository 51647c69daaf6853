"""The generation engine's pool of decode-cache rows: the caches on device and a host mirror of
the tokens each row holds, for prefix reuse and least-recently-used eviction.

A row holds the cache of one token sequence, computed by one version of the weights. A running
request owns one row; a row nobody owns keeps its cache for a later request that shares a
prefix with it, until it is evicted (least recently used first).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from models import sampler


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _lcp(rows: np.ndarray, lengths: np.ndarray, target: np.ndarray) -> np.ndarray:
  """Common-prefix length of target [n] with each row's tokens rows[r, :lengths[r]]."""
  n = len(target)
  if n == 0:
    return np.zeros(len(rows), np.int64)
  eq = (rows[:, :n] == target[None]) & (np.arange(n)[None] < lengths[:, None])
  return np.where(eq.all(1), n, np.argmin(eq, axis=1))


class CachePool:
  """Rows of decode caches and what each holds.

  Args:
    model: the (unstacked) Transformer whose `init_cache` makes the rows.
    num_rows: rows in the pool.
    capacity: tokens per row.
    count: called with counter increments (evictions, row_copies, prefill_calls,
      prefill_tokens, prefill_padded_tokens).
  """

  def __init__(self, model, num_rows: int, capacity: int, count: Callable[..., None],
               experts: bool = False):
    self.num_rows, self.capacity = num_rows, capacity
    self._init_cache = lambda: model.init_cache(num_rows, capacity)
    self._count = count
    self.caches = self._init_cache()
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

  def reset(self) -> None:
    """Zeroes the caches and empties every row.

    Called after a failed call that may have consumed the donated caches.
    """
    self.caches = self._init_cache()
    self.length[:] = 0
    self.version[:] = -1

  def expert_row(self, row: int) -> np.ndarray:
    """[capacity, moe_layers, k] int16 the experts of each of the row's positions (a view)."""
    return self.experts[row]

  def _touch(self, row: int) -> None:
    self._tick += 1
    self.used[row] = self._tick

  def best_row(self, target: np.ndarray, version: int, min_prefix: int
               ) -> tuple[Optional[int], int]:
    """The row sharing the longest prefix with `target`, among rows computed by `version`.

    Args:
      target: the token ids a request needs in its row.
      version: the current weights version.
      min_prefix: the shortest prefix worth reusing.

    Returns:
      (row, prefix length), or (None, 0) when no row shares `min_prefix` tokens. Among equally
      good rows a free one that `target` just extends is preferred (no copy).
    """
    lcp = _lcp(self.tokens, self.length, target)
    lcp[self.version != version] = 0
    if not len(target) or lcp.max() < min_prefix:
      return None, 0
    m = int(lcp.max())
    free_exact = [r for r in np.flatnonzero(lcp == m)
                  if self.owner[r] is None and self.length[r] == m]
    return (free_exact[0] if free_exact else int(np.argmax(lcp))), m

  def claim(self, owner: Any, src: Optional[int], m: int, version: int) -> int:
    """Give `owner` a row holding the first m tokens of row `src` (in place, or copied).

    Args:
      owner: the request that will run on the row.
      src: the row from `best_row`, or None.
      m: tokens of `src` to keep (0 without a source).
      version: the current weights version.

    Returns:
      The claimed row.
    """
    if src is not None and self.owner[src] is None and self.length[src] == m:
      dst = src
    else:
      free = [r for r in range(self.num_rows) if self.owner[r] is None]
      dst = min(free, key=lambda r: self.used[r])  # least recently used
      if dst != src and self.length[dst] > 0:
        self._count(evictions=1)
      if src is not None and dst != src:
        self.caches = sampler.copy_row(self.caches, np.int32(src), np.int32(dst))
        self.tokens[dst, :m] = self.tokens[src, :m]
        if self.experts is not None:
          self.experts[dst, :m] = self.experts[src, :m]
        self._count(row_copies=1)
    self.owner[dst] = owner
    self.length[dst] = m
    self.version[dst] = version
    self._touch(dst)
    return dst

  def release(self, row: int) -> None:
    """Give a row back (its cache stays reusable until evicted)."""
    self.owner[row] = None
    self._touch(row)

  def prefill(self, graphdef, state, items: list[tuple[int, np.ndarray, int]], max_rows: int,
              chunk: int, bucket: int) -> None:
    """Prefill target[start:] into each (row, target, start), in chunks, many rows per call.

    Args:
      graphdef: the (unstacked) model's graphdef.
      state: the model's weights.
      items: (row, target token ids, tokens of target the row already holds).
      max_rows: most rows per call (rows are padded to a power of two up to it).
      chunk: most tokens per row per call.
      bucket: lengths are padded to a multiple of this (at most `chunk`).
    """
    todo = [[row, target, start] for row, target, start in items if start < len(target)]
    while todo:
      batch = todo[:max_rows]
      chunks = [min(len(t) - s, chunk) for _, t, s in batch]
      length = min(_round_up(max(chunks), bucket), chunk)
      b = min(1 << (len(batch) - 1).bit_length(), max_rows)
      rows = np.full(b, self.num_rows, np.int32)  # padding rows: out of range, dropped
      tokens = np.zeros((b, length), np.int32)
      starts = np.zeros(b, np.int32)
      for i, ((row, target, start), n) in enumerate(zip(batch, chunks)):
        rows[i], starts[i] = row, start
        tokens[i, :n] = target[start:start + n]
      if self.experts is None:
        self.caches = sampler.prefill(graphdef, state, self.caches, rows, tokens, starts)
      else:
        self.caches, ids = sampler.prefill(graphdef, state, self.caches, rows, tokens, starts,
                                           experts=True)
        ids = np.asarray(ids).transpose(1, 2, 0, 3)  # [b, p, moe_layers, k]
      for i, (item, n) in enumerate(zip(batch, chunks)):
        row, target, start = item
        if self.experts is not None:
          self.experts[row, start:start + n] = ids[i, :n]
        self.tokens[row, start:start + n] = target[start:start + n]
        self.length[row] = start + n
        item[2] = start + n
      self._count(prefill_calls=1, prefill_tokens=sum(chunks), prefill_padded_tokens=b * length)
      todo = [item for item in todo if item[2] < len(item[1])]

  def record(self, row: int, seq: np.ndarray) -> None:
    """Notes that `row` now holds seq[:-1] (after a decode call wrote its new tokens).

    Args:
      row: the cache row.
      seq: [n] int32, the row's whole sequence; its last token is not yet in the cache.
    """
    start = self.length[row]
    self.tokens[row, start:len(seq) - 1] = seq[start:-1]
    self.length[row] = len(seq) - 1
