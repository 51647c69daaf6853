"""The paged KV-cache pool: fixed-size pages shared copy-on-write.

Every layer's cache is one pool of `num_pages` pages of `page_size` positions
(`Transformer.init_paged_cache`); a sequence is a list of pages (its page table) plus, on the
host, the token ids its positions hold. Pages are reference-counted:

- Prefix sharing: a request whose tokens start like a cached sequence's takes that sequence's
  pages up to the common prefix (one more reference each) instead of prefilling them, so G
  samples of a prompt hold its pages once, and the next turn of an episode holds the previous
  turn's pages.
- Copy-on-write: before a sequence writes a position, the page holding it must be its own; a
  shared page (the partial last page of a common prefix) is copied to a fresh page first. The
  copies wait on the host and run as one device call (`programs.copy_pages`) before the next
  prefill or decode.
- Memory follows use: pages are allocated as positions are written (`reserve`), not for the
  longest possible sequence, so the engine admits requests while free pages last, and
  `reserve` refuses when they run out (the loop then preempts the newest running request).
- Sequences nobody runs keep their pages for prefix reuse until the pages are needed (least
  recently used first), or beyond `retain` such sequences.

Prefill and decode address the pages through page tables [rows, pages_per_seq]
(`programs.prefill_paged`, `programs.decode_paged`); decode attention reads them with
`models.kernels.paged_attention`.

On a mesh (layout.py) the pages are split over the batch shards, each shard a pool of its own
(`num_pages / shards` pages, key/value heads over `tensor`; MLA's single latent head
replicated), and a sequence lives on one shard: the shard of the decode slot its request runs
in (`pick_shard`, `claim(..., shard)`). Its page table then holds ids local to its shard, and
every prefill and decode call reads and writes each shard's pages on that shard
(`models.attention.paged_step`). A prefix held on another shard is not shared but copied
across (`reserve` treats such pages as it treats a shared page about to be written: a fresh
page of the sequence's own shard and a pending copy; `programs.copy_pages` moves only the
copied pages between devices).
"""


from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import numpy as np

from models.engine import programs
from models.engine.cache import KVCache, common_prefix, weights_device, zeros
from models.engine.config import EngineConfig
from models.engine.layout import Layout, specs_of


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


class PageAllocator:
  """Reference counts of `num_pages` pages and the free ones of each shard.

  Page ids are global; shard i owns pages [i * per_shard, (i + 1) * per_shard).

  Args:
    num_pages: pages in the pool.
    shards: shards the pages are split over (a multiple of them: `num_pages % shards == 0`).
  """

  def __init__(self, num_pages: int, shards: int = 1):
    self.num_pages, self.shards = num_pages, shards
    self.per_shard = num_pages // shards
    self.refs = np.zeros(num_pages, np.int32)
    # a stack per shard: each shard's lowest page is handed out first
    self._free = [list(range((i + 1) * self.per_shard - 1, i * self.per_shard - 1, -1))
                  for i in range(shards)]

  @property
  def free(self) -> int:
    """Pages nobody holds."""
    return sum(len(f) for f in self._free)

  def free_in(self, shard: int) -> int:
    """Pages of `shard` nobody holds."""
    return len(self._free[shard])

  def shard_of(self, page: int) -> int:
    """The shard that holds `page`."""
    return page // self.per_shard

  def alloc(self, shard: int = 0) -> int:
    """A free page of `shard`, now held once.

    Raises:
      RuntimeError: no page of the shard is free.
    """
    if not self._free[shard]:
      raise RuntimeError(f"PageAllocator: all {self.per_shard} pages of shard {shard} are "
                         "in use")
    page = self._free[shard].pop()
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
      self._free[self.shard_of(page)].append(page)


class _Seq:
  """Host-side state of one cached sequence."""

  def __init__(self, capacity: int, version: int, owner: Any, experts_shape, shard: int):
    self.shard = shard  # the batch shard whose pages the sequence reads and writes
    self.tokens = np.zeros(capacity, np.int32)
    self.length = 0  # positions holding valid cache entries
    self.pages: list[int] = []  # page of positions [i * page_size, (i + 1) * page_size)
    self.version = version
    self.owner = owner
    self.used = 0
    self.experts = None if experts_shape is None else np.zeros(experts_shape, np.int16)


class PagedPool(KVCache):
  """Sequences in a paged decode cache and what each holds (the `KVCache` interface).

  Args:
    model: the (unstacked) Transformer whose `init_paged_cache` lays the pages out (no weight
      is kept).
    num_pages: pages in the pool.
    page_size: positions per page.
    capacity: most positions of one sequence (the engine's max_seq_len).
    count: called with counter increments (evictions, pages_allocated, pages_shared,
      page_copies).
    experts: keep the MoE routing of every cached position (routing replay).
    retain: most sequences kept for prefix reuse once nobody runs them.
    layout: the engine's decode layout on a mesh (places the pages), or None (one device).

  Raises:
    ValueError: a sequence of `capacity` positions does not fit in one shard's pages, or
      `num_pages` is not a multiple of the layout's batch shards.
  """

  def __init__(self, model, num_pages: int, page_size: int, capacity: int,
               count: Callable[..., None], experts: bool = False, retain: int = 8,
               layout: Optional[Layout] = None):
    self.shards = layout.shards if layout is not None else 1
    if num_pages % self.shards:
      raise ValueError(f"EngineConfig.num_pages={num_pages}: must be a multiple of the "
                       f"mesh's {self.shards} batch shards (each holds its own pages)")
    if num_pages // self.shards * page_size < capacity:
      raise ValueError(f"EngineConfig.num_pages={num_pages} x page_size={page_size} cannot "
                       f"hold one sequence of {capacity} positions"
                       + (f" in each of {self.shards} shards" if self.shards > 1 else ""))
    self.num_pages, self.page_size, self.capacity = num_pages, page_size, capacity
    self.pages_per_seq = -(-capacity // page_size)
    self.retain = retain
    self._shapes = jax.eval_shape(lambda: model.init_paged_cache(num_pages, page_size))
    self._layout = layout
    self._device = None if layout is not None else weights_device(model)
    self._shardings = self._specs = None  # one device: unconstrained
    if layout is not None:  # pages [kv_heads, num_pages, page_size, dim]
      self._shardings = layout.cache_shardings(self._shapes, heads_dim=0, rows_dim=1)
      self._specs = specs_of(self._shardings)
    self._count = count
    self._experts_shape = ((capacity, model.cfg.num_moe_layers, model.cfg.experts_per_token)
                           if experts else None)
    self.caches = self._zeros()
    self.alloc = PageAllocator(num_pages, self.shards)
    self.pages_peak = 0  # most pages held at once, seen at decode calls
    self.seqs: dict[int, _Seq] = {}
    self._next_id = 0
    self._tick = 0
    # Copy-on-write copies not yet run on device, {dst: src}. Pages are only written by
    # prefill and decode calls, which run the copies first, so a pending copy reads the
    # source as it is now.
    self._copies: dict[int, int] = {}

  @classmethod
  def create(cls, model, config: EngineConfig, count: Callable[..., None],
             layout: Optional[Layout] = None) -> "PagedPool":
    """`num_pages` pages of `page_size` positions; by default (num_pages 0) the contiguous
    pool's memory, (slots + prefix_cache_rows) * ceil(max_seq_len / page_size) pages, rounded
    up to a multiple of the batch shards. At most `prefix_cache_rows` idle sequences are
    kept."""
    return cls(model, cls.num_pages_for(config, layout), config.page_size, config.max_seq_len,
               count, experts=config.return_expert_ids, retain=config.prefix_cache_rows,
               layout=layout)

  @staticmethod
  def num_pages_for(config: EngineConfig, layout: Optional[Layout] = None) -> int:
    """The pool's pages: `config.num_pages`, or by default (0) the contiguous pool's memory
    rounded up to a multiple of the layout's batch shards."""
    rows = config.slots + config.prefix_cache_rows
    shards = layout.shards if layout is not None else 1
    return config.num_pages or _round_up(rows * -(-config.max_seq_len // config.page_size),
                                         shards)

  def _zeros(self) -> Any:
    return zeros(self._shapes, self._layout, self._shardings, self._device)

  # ---------------------------------------------------------------- bookkeeping

  @property
  def pages_free(self) -> int:
    """Pages nobody holds."""
    return self.alloc.free

  @property
  def pages_used(self) -> int:
    """Pages some sequence holds."""
    return self.num_pages - self.alloc.free

  def gauges(self) -> dict[str, int]:
    return {"pages_used": self.pages_used, "pages_peak": self.pages_peak}

  def reset(self) -> None:
    self.caches = self._zeros()
    self.alloc = PageAllocator(self.num_pages, self.shards)
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

  def _evict_one(self, keep: Optional[int] = None, shard: Optional[int] = None) -> bool:
    """Drops the least recently used sequence nobody runs (never `keep`; with `shard`, one
    holding a page of that shard); False if none."""
    idle = [sid for sid, s in self.seqs.items() if s.owner is None and sid != keep and (
        shard is None or any(self.alloc.shard_of(p) == shard for p in s.pages))]
    if not idle:
      return False
    self._drop(min(idle, key=lambda sid: self.seqs[sid].used))
    self._count(evictions=1)
    return True

  # ---------------------------------------------------------------- prefix reuse

  def longest_prefix(self, target: np.ndarray, version: int, min_prefix: int
                     ) -> tuple[Optional[int], int]:
    best, best_m, best_exact = None, 0, False
    for sid, s in self.seqs.items():
      if s.version != version:
        continue
      m = common_prefix(s.tokens[:s.length], target)
      exact = s.owner is None and s.length == m
      if m > best_m or (m == best_m and exact and not best_exact):
        best, best_m, best_exact = sid, m, exact
    if not len(target) or best_m < min_prefix:
      return None, 0
    return best, best_m

  def shard(self, sid: int) -> int:
    return self.seqs[sid].shard

  def pick_shard(self, src: Optional[int], shards: list[int]) -> int:
    """`src`'s shard when it is offered (its pages are shared, not copied), else the offered
    shard with the most free pages."""
    if src is not None and self.seqs[src].shard in shards:
      return self.seqs[src].shard
    return max(shards, key=lambda i: (self.alloc.free_in(i), -i))

  def claim(self, owner: Any, src: Optional[int], m: int, version: int, shard: int = 0
            ) -> int:
    """A new sequence on `shard` holding the pages of `src`'s first m positions, not copying
    them yet: a shared partial page is copied when the new sequence first writes into it, and
    pages of another shard when its memory is reserved (see `reserve`). An idle `src` that
    holds exactly m positions passes to the new sequence."""
    seq = _Seq(self.capacity, version, owner, self._experts_shape, shard)
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
    """Keeps the sequence's pages for prefix reuse (evictable; at most `retain` idle
    sequences); an empty sequence is forgotten."""
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

  def _to_copy(self, seq: _Seq, upto: int) -> list[int]:
    """Indices into seq.pages of the pages `reserve(.., upto)` copies: those of another shard,
    and a shared page that positions seq.length.. would write into."""
    out = [i for i, p in enumerate(seq.pages) if self.alloc.shard_of(p) != seq.shard]
    first = seq.length // self.page_size
    if (seq.length < upto and first < len(seq.pages) and first not in out
        and self.alloc.refs[seq.pages[first]] > 1):
      out.append(first)
    return out

  def _needed(self, seq: _Seq, upto: int) -> int:
    """Fresh pages `reserve(.., upto)` takes: new pages, plus the copies (`_to_copy`)."""
    return max(0, -(-upto // self.page_size) - len(seq.pages)) + len(self._to_copy(seq, upto))

  def reserve(self, sid: int, upto: int) -> bool:
    """Gives positions length..upto-1 of a sequence pages of its own shard: allocates the
    pages they need and copies the pages it holds on another shard and a page it shares that
    it would write into (the copies run on device before the next prefill or decode). Idle
    sequences holding pages of its shard are evicted, least recently used first, while pages
    are short."""
    seq = self.seqs[sid]
    upto = min(upto, self.capacity)
    while self._needed(seq, upto) > self.alloc.free_in(seq.shard):
      if not self._evict_one(keep=sid, shard=seq.shard):
        return False
    for i in self._to_copy(seq, upto):
      page, old = self.alloc.alloc(seq.shard), seq.pages[i]
      self._copies[page] = self._copies.get(old, old)  # a page still waiting for its own copy
      self._drop_page(old)                             # is read from that copy's source
      seq.pages[i] = page
      self._count(page_copies=1, pages_allocated=1,
                  shard_copies=int(self.alloc.shard_of(old) != seq.shard))
    new = max(0, -(-upto // self.page_size) - len(seq.pages))
    seq.pages.extend(self.alloc.alloc(seq.shard) for _ in range(new))
    self._count(pages_allocated=new)
    return True

  def table(self, sids: list[Optional[int]], rows: int) -> np.ndarray:
    """[rows, pages_per_seq] int32 page table of the given sequences (None or past the list:
    no pages), in ids local to each row's shard (rows split evenly over the shards, in
    order; one shard: the global ids); missing pages read as the shard's page count (nothing
    is read or written there).

    Raises:
      RuntimeError: a row's sequence holds a page of another shard (not yet reserved).
    """
    per, rows_per_shard = self.alloc.per_shard, rows // self.shards
    out = np.full((rows, self.pages_per_seq), per, np.int32)
    for i, sid in enumerate(sids):
      if sid is not None:
        local = np.asarray(self.seqs[sid].pages, np.int64) - i // rows_per_shard * per
        if len(local) and (local.min() < 0 or local.max() >= per):
          raise RuntimeError(f"PagedPool.table: sequence {sid} in row {i} holds pages of "
                             f"another shard than the row's ({i // rows_per_shard})")
        out[i, :len(local)] = local
    return out

  def _by_shard(self, sids: list[int], tokens: np.ndarray, starts: np.ndarray
                ) -> tuple[list[Optional[int]], np.ndarray, np.ndarray, list[int]]:
    """A prefill batch laid out for the shards: rows grouped by their sequence's shard, each
    group padded to the same power of two.

    Returns:
      (the sequence of each new row (None: padding), tokens, starts, the new row of each of
      `sids`).
    """
    if self.shards == 1:
      return list(sids), tokens, starts, list(range(len(sids)))
    groups: list[list[int]] = [[] for _ in range(self.shards)]
    for i, sid in enumerate(sids):
      groups[self.seqs[sid].shard].append(i)
    per = 1 << (max(len(g) for g in groups) - 1).bit_length()
    rows = np.full(len(sids), -1)
    for shard, group in enumerate(groups):
      rows[group] = shard * per + np.arange(len(group))
    order: list[Optional[int]] = [None] * (per * self.shards)
    new_tokens = np.zeros((per * self.shards, tokens.shape[1]), tokens.dtype)
    new_starts = np.zeros(per * self.shards, starts.dtype)
    for i, row in enumerate(rows):
      order[row], new_tokens[row], new_starts[row] = sids[i], tokens[i], starts[i]
    return order, new_tokens, new_starts, rows.tolist()

  def flush(self) -> None:
    """Runs the pending copy-on-write page copies on device."""
    if not self._copies:
      return
    n = 1 << (len(self._copies) - 1).bit_length()  # few shapes: few compiles
    src = np.zeros(n, np.int32)
    dst = np.full(n, self.num_pages, np.int32)  # padding: dropped
    dst[:len(self._copies)], src[:len(self._copies)] = zip(*self._copies.items())
    self.caches = programs.copy_pages(self.caches, src, dst, specs=self._specs)
    self._copies.clear()

  # ---------------------------------------------------------------- device calls

  def prefill(self, graphdef, state, sids: list[int], tokens: np.ndarray, starts: np.ndarray,
              lengths: list[int]) -> None:
    self.flush()
    order, tokens, starts, rows = self._by_shard(sids, tokens, starts)
    table = self.table(order, len(starts))
    if self._experts_shape is None:
      self.caches = programs.prefill_paged(graphdef, state, self.caches, table, tokens, starts,
                                           specs=self._specs)
    else:
      self.caches, ids = programs.prefill_paged(graphdef, state, self.caches, table, tokens,
                                                starts, experts=True, specs=self._specs)
      ids = np.asarray(jax.device_get(ids)).transpose(1, 2, 0, 3)  # [b, p, moe_layers, k]
    for i, sid, n in zip(rows, sids, lengths):
      seq, start = self.seqs[sid], int(starts[i])
      if seq.experts is not None:
        seq.experts[start:start + n] = ids[i, :n]
      seq.tokens[start:start + n] = tokens[i, :n]
      seq.length = start + n

  def decode(self, graphdef, k: int, top_n: int, experts: bool, state,
             sids: list[Optional[int]], *inputs, **masks) -> tuple:
    self.flush()
    table = self.table(sids, len(sids))
    self.caches, *out = programs.decode_paged(graphdef, k, top_n, experts, state, self.caches,
                                              table, *inputs, **masks, specs=self._specs)
    self.pages_peak = max(self.pages_peak, self.pages_used)
    return tuple(out)

  def record(self, sid: int, seq: np.ndarray, experts: Optional[np.ndarray] = None) -> None:
    cached = self.seqs[sid]
    start = cached.length
    if experts is not None:
      cached.experts[start:start + len(experts)] = experts
    cached.tokens[start:len(seq) - 1] = seq[start:-1]
    cached.length = len(seq) - 1

  def expert_ids(self, sid: int) -> np.ndarray:
    seq = self.seqs[sid]
    return seq.experts[:seq.length].copy()
