"""The KV-cache interface: everything the engine's loop asks of a pool of decode caches.

The loop (loop.py) schedules requests; a pool (`KVCache`) holds their caches. The loop never
learns how a pool lays its memory out: how a sequence is addressed on device (a row index, a
page table), when memory runs short, how a reused prefix is copied and which program a
prefill or decode call runs are all the pool's. The pools are contiguous.py's `CachePool`
(one row of `max_seq_len` positions per sequence) and paged.py's `PagedPool` (pages of
`page_size` positions, shared by common prefixes); `EngineConfig.cache` picks one from the
registry in loop.py.

Terms:
- A *sequence* is the cache of one token sequence, named by an int id the pool hands out
  (`claim`): positions 0..length-1 computed by one weights version, plus the token ids they
  hold (on the host) and, with `experts`, the MoE routing of each position (on the host).
- A *request* owns one sequence while it runs. With `seq` its tokens (input and output so
  far), the sequence holds `seq[:-1]` and the request decodes from `seq[-1]`.
- A *slot* is a place in the decode batch (`EngineConfig.slots`). The loop gives `decode` the
  sequence of each slot (None: an empty slot); per-slot inputs are in slot order.
- An *idle* sequence (released: no request owns it) stays cached for prefix reuse until the
  pool wants its memory (least recently used first).

A request's sequence, as the loop drives it:

    src, m = pool.longest_prefix(target, version, min_prefix)  # target = seq[:-1]
    shard = pool.pick_shard(src, shards with a free slot)   # the request's slot is on it
    sid = pool.claim(request, src, m, version, shard)  # holds target[:m], copied or shared
    pool.reserve(sid, len(target) + steps)          # memory to write; False: none now
    pool.prefill(graphdef, state, [sid, ...], tokens, starts, lengths)   # target[m:]
    per decode call: pool.reserve(sid, length + steps)   # False: the loop preempts a request
                     pool.decode(...); pool.record(sid, seq, experts)
    pool.release(sid)                               # finished or preempted: idle, cached

Arrays a pool owns: `caches`, the device pytree of every layer's cache that each program call
donates and replaces (`Transformer.init_cache` rows or `init_paged_cache` pages, compute dtype),
and its host mirror: per sequence the token ids, length, weights version, owner, last use and
expert ids. Nothing else holds device cache arrays, so a pool is free to shard them.

Sharding (a pool over a mesh, layout.py): the interface passes sequence ids and host arrays
only; every device array is created and addressed inside the pool (`caches`, the rows or page
tables fed to the programs, the prefix copies). A pool given a `Layout` creates `caches` with a
NamedSharding per leaf (key/value heads over `tensor`) and passes the matching specs to the
programs it calls, so each call replaces the donated caches in place. A pool may split its
memory over the layout's batch shards (`shards` > 1: the paged pool): the slots are split over
them in order (slot i on shard i // (slots / shards)), and a sequence lives on the shard of the
slot its request decodes in. The loop picks that slot before `claim` (`pick_shard`), preempts
on the shard that runs short, and passes `decode` the slots' sequences in slot order; the pool
places prefill rows on their sequences' shards itself. A pool replicated over the shards
(`shards` = 1: the contiguous pool) lets a sequence decode in any slot.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.engine.config import EngineConfig


def weights_device(model_or_state) -> jax.Device:
  """The device holding a one-device engine's weights (a model or its nnx.State)."""
  state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
  return next(iter(jax.tree.leaves(state)[0].devices()))


def zeros(shapes, layout, shardings, device: Optional[jax.Device]) -> Any:
  """Zeroed caches of `shapes` (ShapeDtypeStructs): placed by `layout` with `shardings` on a
  mesh, else committed to `device` (the weights' device: every array a program takes is then
  committed, so the programs compiled at the first call serve every later one; a mix of
  committed and uncommitted arguments would compile them again once the outputs, committed,
  come back)."""
  if layout is not None:
    return layout.zeros(shapes, shardings)
  return jax.device_put(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), device)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
  """Length of the common prefix of two token arrays."""
  n = min(len(a), len(b))
  diff = np.flatnonzero(a[:n] != b[:n])
  return int(diff[0]) if len(diff) else n


class KVCache(abc.ABC):
  """A pool of decode caches for the engine's sequences (see the module docstring).

  Attributes:
    capacity: most positions one sequence holds (`EngineConfig.max_seq_len`).
    caches: the device arrays of every layer's cache; each program call donates them and the
      pool keeps the result.
    shards: the batch shards the pool's memory is split over (1: one device, or replicated).
  """

  capacity: int
  caches: Any
  shards: int = 1

  @classmethod
  @abc.abstractmethod
  def create(cls, model, config: EngineConfig, count: Callable[..., None],
             layout=None) -> "KVCache":
    """The pool an engine of `config` uses.

    Args:
      model: the unstacked Transformer the engine decodes with (its config and cache layout;
        no weight is kept).
      config: the engine's `EngineConfig`.
      count: called with counter increments (e.g. `count(evictions=1)`).
      layout: the engine's decode layout on a mesh (`layout.Layout`), or None (one device).
    """

  @abc.abstractmethod
  def reset(self) -> None:
    """Zeroes the caches and forgets every sequence (after a failed call that may have
    consumed the donated caches)."""

  @abc.abstractmethod
  def longest_prefix(self, target: np.ndarray, version: int, min_prefix: int
                     ) -> tuple[Optional[int], int]:
    """The cached sequence sharing the longest prefix with `target` (prefix lookup).

    Args:
      target: [n] int32 the token ids a request needs in its sequence.
      version: the current weights version; sequences of other versions never match.
      min_prefix: the shortest prefix worth reusing.

    Returns:
      (sequence id, prefix length m), or (None, 0) when none shares `min_prefix` tokens.
      Among equally good sequences an idle one that `target` just extends is preferred (it
      passes to the request whole, nothing copied).
    """

  def shard(self, sid: int) -> int:
    """The batch shard a sequence lives on (always 0 with `shards` = 1)."""
    return 0

  def pick_shard(self, src: Optional[int], shards: list[int]) -> int:
    """The shard, among `shards` (those with a free slot, ascending), for a new sequence
    whose prefix is in `src` (or None); with `shards` = 1, the only one."""
    return shards[0]

  @abc.abstractmethod
  def claim(self, owner: Any, src: Optional[int], m: int, version: int, shard: int = 0
            ) -> int:
    """A sequence for `owner` holding the first m positions of `src` (prefix reuse).

    How the prefix arrives is the pool's: taken over in place, copied on device, or shared
    (copied on write later, or copied from another shard when memory is reserved). Nothing
    is written into the new sequence yet.

    Args:
      owner: the request that will run on the sequence.
      src: a sequence from `longest_prefix`, or None.
      m: positions of `src` to keep (0 without a source).
      version: the current weights version.
      shard: the batch shard the sequence lives on (`pick_shard`).

    Returns:
      The sequence id.
    """

  @abc.abstractmethod
  def reserve(self, sid: int, upto: int) -> bool:
    """Makes positions length..upto-1 of a sequence writable (memory for a prefill or the
    next decode call); evicts idle sequences if the pool needs their memory, never running
    ones.

    Args:
      sid: the sequence.
      upto: one past the last position it will write (capped at `capacity`).

    Returns:
      Whether the memory was found; nothing changes when not (the loop then preempts a
      running request, or waits).
    """

  @abc.abstractmethod
  def release(self, sid: int) -> None:
    """The sequence's request finished or was preempted: the sequence stays cached, idle,
    for prefix reuse until the pool needs its memory (a preempted request may find it
    again)."""

  @abc.abstractmethod
  def prefill(self, graphdef, state, sids: list[int], tokens: np.ndarray, starts: np.ndarray,
              lengths: list[int]) -> None:
    """One prefill program call: writes tokens[i, :lengths[i]] at positions starts[i].. of
    sequence sids[i] (its memory reserved), and notes what the sequence now holds.

    Args:
      graphdef: the unstacked model's graphdef (the programs' static argument).
      state: the model's weights.
      sids: the sequences of the call's first len(sids) rows.
      tokens: [b, p] int32, b >= len(sids) (rows past len(sids) are padding).
      starts: [b] int32 the position of each row's first token (= the sequence's length).
      lengths: real tokens of each of the first len(sids) rows.
    """

  @abc.abstractmethod
  def decode(self, graphdef, k: int, top_n: int, experts: bool, state,
             sids: list[Optional[int]], *inputs, **masks) -> tuple:
    """One decode program call (`programs.decode` or its equivalent) over the slots'
    sequences; the positions it writes must be reserved.

    Args:
      graphdef, k, top_n, experts, state: the program's static arguments and weights.
      sids: the sequence of each slot, None for an empty slot.
      *inputs: the per-slot inputs that follow the cache in `programs.decode` (tokens,
        lengths, active, counts, limits, temperature, top_k, top_p, seeds, stop_ids,
        max_steps, exit_on_finish).
      **masks: its token-mask keyword arguments (`constraint.Controls.kwargs`).

    Returns:
      The program's results after the cache: (steps, tokens, lengths, active, counts,
      per-step outputs).
    """

  @abc.abstractmethod
  def record(self, sid: int, seq: np.ndarray, experts: Optional[np.ndarray] = None) -> None:
    """Notes what a decode call wrote: the sequence now holds seq[:-1].

    Args:
      sid: the sequence.
      seq: [n] int32 the request's whole token sequence; its last token is not yet cached.
      experts: [t, moe_layers, k] the MoE routing of the t positions the call fed, from the
        sequence's previous length on (routing replay); None when not recorded.
    """

  @abc.abstractmethod
  def expert_ids(self, sid: int) -> np.ndarray:
    """[length, moe_layers, k] int16 the experts every cached position went through (a copy;
    pools made with `experts` only)."""

  def gauges(self) -> dict[str, int]:
    """Current levels to report beside the engine's counters (e.g. pages in use)."""
    return {}
