"""The generation engine's paged decode cache: fixed-size pages shared copy-on-write.

Every layer's cache is one pool of `num_pages` pages of `page_size` positions
(`Transformer.init_paged_cache`); a sequence is a list of pages (its page table) plus, on the
host, the token ids its positions hold. Pages are reference-counted:

- Prefix sharing: a request whose tokens start like a cached sequence's takes that sequence's
  pages up to the common prefix (one more reference each) instead of prefilling them, so G
  samples of a prompt hold its pages once, and the next turn of an episode holds the previous
  turn's pages.
- Copy-on-write: before a sequence writes a position, the page holding it must be its own; a
  shared page (the partial last page of a common prefix) is copied to a fresh page first.
- Memory follows use: pages are allocated as positions are written (`reserve`), not for the
  longest possible sequence, so the engine admits requests while free pages last.
- Sequences nobody runs keep their pages for prefix reuse until the pages are needed (least
  recently used first), or beyond `retain` such sequences.

`PagedPool` has the interface of `models.cache_pool.CachePool` (sequence ids stand for rows),
plus `reserve`, `table` and `pages_free`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import numpy as np

from models import sampler


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _common(a: np.ndarray, b: np.ndarray) -> int:
  """Length of the common prefix of two token arrays."""
  n = min(len(a), len(b))
  diff = np.flatnonzero(a[:n] != b[:n])
  return int(diff[0]) if len(diff) else n


class PageAllocator:
  """Reference counts of `num_pages` pages and the list of free ones.

  Args:
    num_pages: pages in the pool.
  """

  def __init__(self, num_pages: int):
    self.num_pages = num_pages
    self.refs = np.zeros(num_pages, np.int32)
    self._free = list(range(num_pages - 1, -1, -1))  # a stack: page 0 is handed out first

  @property
  def free(self) -> int:
    """Pages nobody holds."""
    return len(self._free)

  def alloc(self) -> int:
    """A free page, now held once.

    Raises:
      RuntimeError: no page is free.
    """
    if not self._free:
      raise RuntimeError(f"PageAllocator: all {self.num_pages} pages are in use")
    page = self._free.pop()
    self.refs[page] = 1
    return page

  def share(self, page: int) -> None:
    """One more holder of a held page."""
    if self.refs[page] <= 0:
      raise RuntimeError(f"PageAllocator.share: page {page} is free")
    self.refs[page] += 1

  def drop(self, page: int) -> None:
    """One holder fewer; the page is free again when none is left."""
    if self.refs[page] <= 0:
      raise RuntimeError(f"PageAllocator.drop: page {page} is free")
    self.refs[page] -= 1
    if self.refs[page] == 0:
      self._free.append(page)


class _Seq:
  """Host-side state of one cached sequence."""

  def __init__(self, capacity: int, version: int, owner: Any, experts_shape):
    self.tokens = np.zeros(capacity, np.int32)
    self.length = 0  # positions holding valid cache entries
    self.pages: list[int] = []  # page of positions [i * page_size, (i + 1) * page_size)
    self.version = version
    self.owner = owner
    self.used = 0
    self.experts = None if experts_shape is None else np.zeros(experts_shape, np.int16)


class PagedPool:
  """Sequences in a paged decode cache and what each holds.

  Args:
    model: the (unstacked) Transformer whose `init_paged_cache` makes the pages.
    num_pages: pages in the pool.
    page_size: positions per page.
    capacity: most positions of one sequence (the engine's max_seq_len).
    count: called with counter increments (prefill_calls, prefill_tokens,
      prefill_padded_tokens, evictions, pages_allocated, pages_shared, page_copies).
    experts: keep the MoE routing of every cached position (routing replay).
    retain: most sequences kept for prefix reuse once nobody runs them.

  Raises:
    ValueError: a sequence of `capacity` positions does not fit in `num_pages` pages.
  """

  def __init__(self, model, num_pages: int, page_size: int, capacity: int,
               count: Callable[..., None], experts: bool = False, retain: int = 8):
    if num_pages * page_size < capacity:
      raise ValueError(f"num_pages={num_pages} x page_size={page_size} cannot hold one "
                       f"sequence of {capacity} positions")
    self.num_pages, self.page_size, self.capacity = num_pages, page_size, capacity
    self.pages_per_seq = -(-capacity // page_size)
    self.retain = retain
    self._init_cache = lambda: model.init_paged_cache(num_pages, page_size)
    self._count = count
    self._experts_shape = ((capacity, model.cfg.num_moe_layers, model.cfg.experts_per_token)
                           if experts else None)
    self.caches = self._init_cache()
    self.alloc = PageAllocator(num_pages)
    self.seqs: dict[int, _Seq] = {}
    self._next_id = 0
    self._tick = 0
    # Copy-on-write copies not yet run on device, {dst: src}. Pages are only written by
    # prefill and decode calls, which run the copies first, so a pending copy reads the
    # source as it is now.
    self._copies: dict[int, int] = {}

  # ---------------------------------------------------------------- bookkeeping

  @property
  def pages_free(self) -> int:
    """Pages nobody holds."""
    return self.alloc.free

  @property
  def pages_used(self) -> int:
    """Pages some sequence holds."""
    return self.num_pages - self.alloc.free

  def reset(self) -> None:
    """Zeroes the pages and forgets every sequence.

    Called after a failed call that may have consumed the donated caches.
    """
    self.caches = self._init_cache()
    self.alloc = PageAllocator(self.num_pages)
    self.seqs.clear()
    self._copies.clear()

  def _touch(self, seq: _Seq) -> None:
    self._tick += 1
    seq.used = self._tick

  def _drop(self, sid: int) -> None:
    """Forgets a sequence and gives its pages back."""
    for page in self.seqs.pop(sid).pages:
      self._drop_page(page)

  def _drop_page(self, page: int) -> None:
    """One holder fewer; a page that falls free needs no pending copy into it."""
    self.alloc.drop(page)
    if self.alloc.refs[page] == 0:
      self._copies.pop(page, None)

  def _evict_one(self, keep: Optional[int] = None) -> bool:
    """Drops the least recently used sequence nobody runs (never `keep`); False if none."""
    idle = [sid for sid, s in self.seqs.items() if s.owner is None and sid != keep]
    if not idle:
      return False
    self._drop(min(idle, key=lambda sid: self.seqs[sid].used))
    self._count(evictions=1)
    return True

  def expert_row(self, sid: int) -> np.ndarray:
    """[capacity, moe_layers, k] int16 the experts of each of the sequence's positions."""
    return self.seqs[sid].experts

  # ---------------------------------------------------------------- prefix reuse

  def best_row(self, target: np.ndarray, version: int, min_prefix: int
               ) -> tuple[Optional[int], int]:
    """The sequence sharing the longest prefix with `target`, among those of `version`.

    Args:
      target: the token ids a request needs in its cache.
      version: the current weights version.
      min_prefix: the shortest prefix worth reusing.

    Returns:
      (sequence id, prefix length), or (None, 0) when none shares `min_prefix` tokens. Among
      equally good sequences an idle one that `target` just extends is preferred (its pages
      pass to the request whole).
    """
    best, best_m, best_exact = None, 0, False
    for sid, s in self.seqs.items():
      if s.version != version:
        continue
      m = _common(s.tokens[:s.length], target)
      exact = s.owner is None and s.length == m
      if m > best_m or (m == best_m and exact and not best_exact):
        best, best_m, best_exact = sid, m, exact
    if not len(target) or best_m < min_prefix:
      return None, 0
    return best, best_m

  def claim(self, owner: Any, src: Optional[int], m: int, version: int) -> int:
    """A new sequence for `owner` holding the first m positions of sequence `src`.

    The pages of those positions are shared, not copied (a shared partial page is copied when
    the new sequence first writes into it, see `reserve`). An idle `src` that holds exactly m
    positions passes to the new sequence.

    Args:
      owner: the request that will run the sequence.
      src: a sequence from `best_row`, or None.
      m: positions of `src` to take (0 without a source).
      version: the current weights version.

    Returns:
      The new sequence's id.
    """
    seq = _Seq(self.capacity, version, owner, self._experts_shape)
    if src is not None and m > 0:
      source = self.seqs[src]
      seq.pages = source.pages[:-(-m // self.page_size)]
      for page in seq.pages:
        self.alloc.share(page)
      seq.tokens[:m] = source.tokens[:m]
      if seq.experts is not None:
        seq.experts[:m] = source.experts[:m]
      seq.length = m
      if source.owner is None and source.length == m:
        self._drop(src)  # superseded: the new sequence holds all of it
      else:
        self._count(pages_shared=len(seq.pages))
    sid = self._next_id
    self._next_id += 1
    self.seqs[sid] = seq
    self._touch(seq)
    return sid

  def release(self, sid: int) -> None:
    """The sequence's request is done: keep its pages for prefix reuse (evictable); an empty
    sequence is forgotten."""
    seq = self.seqs[sid]
    if seq.length == 0:
      self._drop(sid)
      return
    seq.owner = None
    self._touch(seq)
    while sum(s.owner is None for s in self.seqs.values()) > self.retain:
      self._evict_one()

  def free(self, sid: int) -> None:
    """Forget a sequence now and give its pages back."""
    self._drop(sid)

  # ---------------------------------------------------------------- pages

  def _needed(self, seq: _Seq, upto: int) -> int:
    """Fresh pages `reserve(.., upto)` takes: new pages, plus a copy of a shared page that
    positions seq.length.. would write into."""
    need = max(0, -(-upto // self.page_size) - len(seq.pages))
    first = seq.length // self.page_size
    if seq.length < upto and first < len(seq.pages) and self.alloc.refs[seq.pages[first]] > 1:
      need += 1
    return need

  def reserve(self, sid: int, upto: int) -> bool:
    """Makes positions seq.length..upto-1 of a sequence writable: pages of its own.

    Allocates the pages those positions need, and copies a page the sequence shares (the
    copy runs on device before the next prefill or decode). Idle sequences are evicted, least
    recently used first, while pages are short; running ones are never touched.

    Args:
      sid: the sequence.
      upto: one past the last position the sequence will write (at most `capacity`).

    Returns:
      Whether the pages were found (nothing changes when not).
    """
    seq = self.seqs[sid]
    upto = min(upto, self.capacity)
    while self._needed(seq, upto) > self.alloc.free:
      if not self._evict_one(keep=sid):
        return False
    first = seq.length // self.page_size
    if seq.length < upto and first < len(seq.pages) and self.alloc.refs[seq.pages[first]] > 1:
      page, old = self.alloc.alloc(), seq.pages[first]
      self._copies[page] = self._copies.get(old, old)  # a page still waiting for its own copy
      self._drop_page(old)                             # is read from that copy's source
      seq.pages[first] = page
      self._count(page_copies=1, pages_allocated=1)
    new = max(0, -(-upto // self.page_size) - len(seq.pages))
    seq.pages.extend(self.alloc.alloc() for _ in range(new))
    self._count(pages_allocated=new)
    return True

  def table(self, sids: list[Optional[int]], rows: int) -> np.ndarray:
    """[rows, pages_per_seq] int32 page table of the given sequences (None or past the list:
    no pages); missing pages read as `num_pages` (nothing is read or written there)."""
    out = np.full((rows, self.pages_per_seq), self.num_pages, np.int32)
    for i, sid in enumerate(sids):
      if sid is not None:
        pages = self.seqs[sid].pages
        out[i, :len(pages)] = pages
    return out

  def flush(self) -> None:
    """Runs the pending copy-on-write page copies on device."""
    if not self._copies:
      return
    n = 1 << (len(self._copies) - 1).bit_length()  # few shapes: few compiles
    src = np.zeros(n, np.int32)
    dst = np.full(n, self.num_pages, np.int32)  # padding: dropped
    dst[:len(self._copies)], src[:len(self._copies)] = zip(*self._copies.items())
    self.caches = sampler.copy_pages(self.caches, src, dst)
    self._copies.clear()

  # ---------------------------------------------------------------- device calls

  def prefill(self, graphdef, state, items: list[tuple[int, np.ndarray, int]], max_rows: int,
              chunk: int, bucket: int) -> None:
    """Prefill target[start:] into each (sequence, target, start), in chunks, many per call.

    The sequences' pages must cover their targets (`reserve`).

    Args:
      graphdef: the (unstacked) model's graphdef.
      state: the model's weights.
      items: (sequence id, target token ids, tokens of target the sequence already holds).
      max_rows: most sequences per call (padded to a power of two up to it).
      chunk: most tokens per sequence per call.
      bucket: lengths are padded to a multiple of this (at most `chunk`).
    """
    self.flush()
    todo = [[sid, target, start] for sid, target, start in items if start < len(target)]
    while todo:
      batch = todo[:max_rows]
      chunks = [min(len(t) - s, chunk) for _, t, s in batch]
      length = min(_round_up(max(chunks), bucket), chunk)
      b = min(1 << (len(batch) - 1).bit_length(), max_rows)
      table = self.table([sid for sid, _, _ in batch], b)
      tokens = np.zeros((b, length), np.int32)
      starts = np.zeros(b, np.int32)
      for i, ((sid, target, start), n) in enumerate(zip(batch, chunks)):
        starts[i] = start
        tokens[i, :n] = target[start:start + n]
      if self._experts_shape is None:
        self.caches = sampler.prefill_paged(graphdef, state, self.caches, table, tokens, starts)
      else:
        self.caches, ids = sampler.prefill_paged(graphdef, state, self.caches, table, tokens,
                                                 starts, experts=True)
        ids = np.asarray(jax.device_get(ids)).transpose(1, 2, 0, 3)  # [b, p, moe_layers, k]
      for i, (item, n) in enumerate(zip(batch, chunks)):
        sid, target, start = item
        seq = self.seqs[sid]
        if seq.experts is not None:
          seq.experts[start:start + n] = ids[i, :n]
        seq.tokens[start:start + n] = target[start:start + n]
        seq.length = start + n
        item[2] = start + n
      self._count(prefill_calls=1, prefill_tokens=sum(chunks), prefill_padded_tokens=b * length)
      todo = [item for item in todo if item[2] < len(item[1])]

  def record(self, sid: int, seq_tokens: np.ndarray) -> None:
    """Notes that the sequence now holds seq_tokens[:-1] (after a decode call wrote them).

    Args:
      sid: the sequence.
      seq_tokens: [n] int32 its whole token sequence; the last token is not yet cached.
    """
    seq = self.seqs[sid]
    start = seq.length
    seq.tokens[start:len(seq_tokens) - 1] = seq_tokens[start:-1]
    seq.length = len(seq_tokens) - 1
