"""The in-memory rollout queue: one process, the semantics of `RedisQueue` (envs/queue/base.py).

Used by tests and by in-process rollouts. Handles made with `with_consumer` share one state, as
separate processes share a Redis server. `clock` drives claim and lease expiry (inject a fake
one in tests); blocking in `get_batch` uses real time.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Iterable, Optional, Sequence

from envs.queue.base import Fetched, RolloutQueue, TaskLease


class _MemState:
  """Everything an in-memory queue holds; shared by handles made with `with_consumer`."""

  def __init__(self):
    self.cond = threading.Condition()
    self.seq = 0
    self.entries: dict[str, bytes] = {}        # unacked entries, in id order
    self.unread: collections.deque[str] = collections.deque()
    self.pending: dict[str, list] = {}         # id -> [consumer, delivered_at, deliveries]
    self.dead: list[dict] = []
    self.draws = 0
    self.leases: dict[int, list] = {}          # draw -> [expires_at, worker_id, deliveries]
    self.done = 0
    self.dead_tasks: list[int] = []
    self.fingerprint: Optional[str] = None


class InMemoryQueue(RolloutQueue):
  """Single-process queue with the semantics of `RedisQueue` (tests, in-process rollouts).

  Args:
    consumer: this handle's consumer name.
    claim_timeout: seconds before a pending entry of a silent consumer is re-claimed.
    max_deliveries: deliveries of one entry before it goes to the dead letters.
    task_max_deliveries: issues of one draw before it is given up.
    clock: the time that claims and leases expire by (a fake one in tests).

  Raises:
    ValueError: claim_timeout <= 0, or a delivery limit < 1.
  """

  def __init__(self, *, consumer: str = "trainer", claim_timeout: float = 600.0,
               max_deliveries: int = 5, task_max_deliveries: int = 3,
               clock: Callable[[], float] = time.monotonic, _state: Optional[_MemState] = None):
    super().__init__(consumer=consumer, claim_timeout=claim_timeout,
                     max_deliveries=max_deliveries, task_max_deliveries=task_max_deliveries)
    self.clock = clock
    self._s = _state or _MemState()
    self._recovered = False  # own pending entries re-read once, like a restarted consumer

  def with_consumer(self, consumer: str) -> "InMemoryQueue":
    """Another consumer on the same queue (what a second process would be)."""
    return InMemoryQueue(consumer=consumer, claim_timeout=self.claim_timeout,
                         max_deliveries=self.max_deliveries,
                         task_max_deliveries=self.task_max_deliveries, clock=self.clock,
                         _state=self._s)

  # Trajectories.

  def _add(self, data: bytes) -> str:
    s = self._s
    s.seq += 1
    entry_id = f"{s.seq}-0"
    s.entries[entry_id] = data
    s.unread.append(entry_id)
    s.cond.notify_all()
    return entry_id

  def put_raw(self, data: bytes) -> str:
    """Appends serialised bytes as they are (tests use it for malformed entries)."""
    with self._s.cond:
      entry_id = self._add(bytes(data))
    self.counters.count("put")
    return entry_id

  def _take(self, n: int) -> list[Fetched]:
    """Up to n (id, data, deliveries): own pending first (once), then expired claims, then new."""
    s, now, out = self._s, self.clock(), []
    candidates = []
    if not self._recovered:
      candidates += [i for i, p in s.pending.items() if p[0] == self.consumer]
      self._recovered = True
    mine = set(candidates)
    candidates += [i for i, p in s.pending.items()
                   if now - p[1] >= self.claim_timeout and i not in mine]
    for entry_id in candidates[:n]:
      p = s.pending[entry_id]
      p[0], p[1], p[2] = self.consumer, now, p[2] + 1
      out.append((entry_id, s.entries[entry_id], p[2]))
    while len(out) < n and s.unread:
      entry_id = s.unread.popleft()
      s.pending[entry_id] = [self.consumer, now, 1]
      out.append((entry_id, s.entries[entry_id], 1))
    return out

  def _fetch(self, n: int, deadline: float) -> list[Fetched]:
    with self._s.cond:
      got = self._take(n)
      remaining = deadline - time.monotonic()
      if not got and remaining > 0 and not self._s.unread:
        self._s.cond.wait(min(remaining, 0.05))  # short: claims expire on the (fake) clock
        got = self._take(n)
      return got

  def _dead_letter(self, entry_id: str, data: Optional[bytes], deliveries: int,
                   reason: str) -> None:
    with self._s.cond:
      s = self._s
      s.dead.append({"entry_id": entry_id, "data": data, "deliveries": deliveries,
                     "reason": reason})
      s.pending.pop(entry_id, None)
      s.entries.pop(entry_id, None)

  def ack(self, entry_ids: Iterable[str]) -> int:
    n = 0
    with self._s.cond:
      for entry_id in entry_ids:
        if self._s.pending.pop(entry_id, None) is not None:
          self._s.entries.pop(entry_id, None)
          n += 1
    self.counters.count("acked", n)
    return n

  def backlog(self) -> int:
    with self._s.cond:
      return len(self._s.entries)

  def unread(self) -> int:
    with self._s.cond:
      return len(self._s.unread)

  def dead_letters(self, count: int = 100) -> list[dict]:
    with self._s.cond:
      return [dict(d) for d in self._s.dead[:count]]

  def _dead_letter_total(self) -> int:
    with self._s.cond:
      return len(self._s.dead)

  # Tasks.

  def _store_fingerprint(self, fingerprint: str) -> tuple[str, str]:
    with self._s.cond:
      if self._s.fingerprint is None:
        self._s.fingerprint = fingerprint
      return self._s.fingerprint, ""

  def _lease(self, worker_id: str, ttl: float,
             max_draws: Optional[int]) -> tuple[Optional[TaskLease], int]:
    s, now, dead = self._s, self.clock(), 0
    with s.cond:
      for draw in sorted(d for d, l in s.leases.items() if l[0] <= now):
        count = s.leases[draw][2] + 1
        if count > self.task_max_deliveries:
          del s.leases[draw]
          s.dead_tasks.append(draw)
          dead += 1
          continue
        s.leases[draw] = [now + ttl, worker_id, count]
        return TaskLease(draw, worker_id, count), dead
      if max_draws is not None and s.draws >= max_draws:
        return None, dead
      draw, s.draws = s.draws, s.draws + 1
      s.leases[draw] = [now + ttl, worker_id, 1]
      return TaskLease(draw, worker_id, 1), dead

  def _holds(self, lease: TaskLease) -> bool:
    held = self._s.leases.get(lease.draw)
    return held is not None and held[1:] == [lease.worker_id, lease.deliveries]

  def _renew(self, lease: TaskLease, ttl: float) -> bool:
    with self._s.cond:
      if not self._holds(lease):
        return False
      self._s.leases[lease.draw][0] = self.clock() + ttl
      return True

  def _complete(self, lease: TaskLease, blobs: Sequence[bytes]) -> bool:
    with self._s.cond:
      if not self._holds(lease):
        return False
      for blob in blobs:
        self._add(blob)
      del self._s.leases[lease.draw]
      self._s.done += 1
      return True

  def release_task(self, lease: TaskLease) -> bool:
    with self._s.cond:
      if not self._holds(lease):
        return False
      self._s.leases[lease.draw] = [float("-inf"), "", lease.deliveries - 1]
      return True

  def task_status(self) -> dict[str, int]:
    with self._s.cond:
      s = self._s
      return {"draws": s.draws, "open": len(s.leases), "done": s.done,
              "dead": len(s.dead_tasks)}

  def close(self) -> None:
    pass
