"""The rollout queue between rollout workers and the trainer (docs/design.md §2, §5).

Two sides, one object:

* **Trajectories** (workers → trainer), at-least-once with idempotent consumption:
  `put(trajectory)`; `get_batch(n, timeout) -> [Delivery]`; `ack(entry_ids)`. An entry stays
  pending until the trainer acks it, which it does only *after* the checkpoint that includes the
  step that trained it. A pending entry that nobody acks within `claim_timeout` seconds (its
  consumer died) is re-claimed and delivered again, so `claim_timeout` must be longer than the
  trainer's checkpoint interval plus the group deadline (`check_claim_timeout`). An entry
  delivered more than `max_deliveries` times, or one that is not a Trajectory, is moved to the
  dead-letter stream and acked, never handed out and never crashing the consumer.
* **Tasks** (queue → workers), leased: `lease_task(worker_id, ttl)` hands out a *draw* (a
  global, durable counter: draw d is task `task_order(...)[d % T]` of epoch `d // T`), which
  the worker renews while its episodes run and ends with `complete_task(lease, trajectories)`:
  that puts the group's trajectories and ends the lease in one atomic step, and only if the
  worker still holds the lease. A worker that dies stops renewing; once the lease expires the
  draw is issued to another worker. So each draw produces at most one delivered group.

Idempotent consumption (how the trainer uses this module):

    q = make_queue("redis://127.0.0.1:6379", password_file=..., consumer="trainer")
    assembler = GroupAssembler(group_size=G, min_group_size=G // 2, deadline=120)
    seen = set(ckpt.consumed_ids)           # trajectory ids of the last checkpoints
    q.ack(ckpt.unacked_entry_ids)           # trained before the crash, checkpointed, not acked
    while training:
      fresh, dup = filter_unseen(q.get_batch(64, timeout=5), seen)
      to_ack += [d.entry_id for d in dup]   # already trained: ack, never train again
      assembler.add(fresh)
      groups, dropped = assembler.pop_ready()
      groups, stale = drop_stale(groups, policy_version, max_staleness, q.counters)
      train(groups)
      for d in (all deliveries of groups) + dropped + stale:
        seen.add(d.trajectory.trajectory_id); to_ack.append(d.entry_id)
      if checkpoint_due:
        save(state, consumed_ids=seen, unacked_entry_ids=to_ack)  # wait until it is durable
        q.ack(to_ack); to_ack = []

Dropped entries are acked like trained ones (else they would come back and end in the dead
letter). After a crash the restarted consumer (same `consumer` name) first gets its own pending
entries again: those in the checkpoint's `seen` are skipped by `filter_unseen` and acked, the
others are trained. `seen` may be pruned to the ids of the last few checkpoints: once an entry is
acked Redis never delivers it again, and `complete_task` never puts a group twice.

Backends: `InMemoryQueue` (default; one process, same semantics, injectable clock for tests) and
`RedisQueue` (Redis Streams with a consumer group; XADD / XREADGROUP / XACK / XAUTOCLAIM; the
stream is never trimmed past an unacked entry; AUTH password and `rediss://` TLS). Every drop
(dead letter, malformed, staleness, partial group, duplicate, lost lease, dead task) is counted
in `queue.counters` and logged; `metrics()` adds backlog and task counts.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import socket
import threading
import time
import uuid
from typing import Callable, Iterable, Optional, Protocol, Sequence
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from envs.trajectory import Trajectory

log = logging.getLogger(__name__)

# Counter names that mean "data was thrown away": logged as warnings when counted.
DROPS = ("dead_letter", "malformed", "dropped_stale", "dropped_partial_group", "duplicate",
         "lease_lost", "dead_task")


@dataclasses.dataclass(frozen=True)
class Delivery:
  """One trajectory handed to a consumer. `deliveries` = how many times this entry has been
  delivered so far (1 the first time; more after a consumer died without acking it)."""

  entry_id: str
  trajectory: Trajectory
  deliveries: int


@dataclasses.dataclass(frozen=True)
class TaskLease:
  """A task draw held by one worker. `deliveries` counts issues of this draw (>1: re-issued
  after a worker died or released it)."""

  draw: int
  worker_id: str
  deliveries: int = 1


class Counters:
  """Thread-safe event counters of one queue handle; drops are logged as they are counted."""

  def __init__(self):
    self._lock = threading.Lock()
    self._counts: collections.Counter = collections.Counter()

  def count(self, name: str, n: int = 1, why: str = "") -> None:
    if n <= 0:
      return
    with self._lock:
      self._counts[name] += n
    if name in DROPS:
      log.warning("rollout queue: %s += %d%s", name, n, f" ({why})" if why else "")

  def __getitem__(self, name: str) -> int:
    with self._lock:
      return self._counts[name]

  def as_dict(self) -> dict[str, int]:
    with self._lock:
      return {name: self._counts[name] for name in sorted(set(self._counts) | set(DROPS))}


def check_claim_timeout(claim_timeout: float, checkpoint_interval_s: float,
                        group_deadline_s: float = 0.0) -> None:
  """Raise unless pending entries outlive the time the trainer legitimately holds them unacked.

  The trainer acks only after the checkpoint that includes a step, so it may hold an entry for
  up to the group deadline plus one checkpoint interval; a shorter claim timeout would re-deliver
  entries of a healthy trainer.
  """
  if claim_timeout <= checkpoint_interval_s + group_deadline_s:
    raise ValueError(
        f"queue claim_timeout={claim_timeout}s must be longer than checkpoint interval "
        f"({checkpoint_interval_s}s) + group deadline ({group_deadline_s}s)")


def task_order(num_tasks: int, epoch: int, seed: int = 0) -> np.ndarray:
  """The task indices of one epoch in sampling order: a permutation fixed by (seed, epoch), so
  every worker maps a draw to the same task without talking to the others."""
  if num_tasks <= 0:
    raise ValueError(f"num_tasks={num_tasks}: need at least one task")
  return np.random.default_rng([seed, epoch]).permutation(num_tasks)


class RolloutQueue(Protocol):
  """What the trainer and the workers call; `InMemoryQueue` and `RedisQueue` implement it."""

  counters: Counters

  def with_consumer(self, consumer: str) -> "RolloutQueue": ...
  def put(self, trajectory: Trajectory) -> str: ...
  def put_raw(self, data: bytes) -> str: ...
  def get_batch(self, n: int, timeout: float) -> list[Delivery]: ...
  def ack(self, entry_ids: Iterable[str]) -> int: ...
  def backlog(self) -> int: ...
  def unread(self) -> int: ...
  def dead_letters(self, count: int = 100) -> list[dict]: ...
  def check_task_source(self, fingerprint: str) -> None: ...
  def lease_task(self, worker_id: str, ttl: float,
                 max_draws: Optional[int] = None) -> Optional[TaskLease]: ...
  def renew_task(self, lease: TaskLease, ttl: float) -> bool: ...
  def complete_task(self, lease: TaskLease, trajectories: Sequence[Trajectory] = ()) -> bool: ...
  def release_task(self, lease: TaskLease) -> bool: ...
  def task_status(self) -> dict[str, int]: ...
  def metrics(self) -> dict[str, float]: ...
  def close(self) -> None: ...


def _check_args(claim_timeout: float, max_deliveries: int, task_max_deliveries: int) -> None:
  if not claim_timeout > 0:
    raise ValueError(f"claim_timeout={claim_timeout!r}: must be > 0 seconds")
  if max_deliveries < 1:
    raise ValueError(f"max_deliveries={max_deliveries!r}: must be >= 1")
  if task_max_deliveries < 1:
    raise ValueError(f"task_max_deliveries={task_max_deliveries!r}: must be >= 1")


def _check_ttl(ttl: float) -> None:
  if not ttl > 0:
    raise ValueError(f"lease ttl={ttl!r}: must be > 0 seconds")


def _check_types(t: Trajectory) -> None:
  """ValueError naming the field unless the record has the types the trainer relies on.

  `Trajectory.from_bytes` checks the record's shape, not its types: an entry from a buggy or
  hostile producer could hold strings where token ids belong and crash the trainer later.
  """
  if isinstance(t.reward, bool) or not isinstance(t.reward, (int, float)) or not math.isfinite(
      t.reward):
    raise ValueError(f"reward={t.reward!r:.50}: expected a finite number")
  for name in ("task_id", "group_id", "trajectory_id"):
    if not isinstance(getattr(t, name), str):
      raise ValueError(f"{name}={getattr(t, name)!r:.50}: expected a string")
  if not isinstance(t.metadata, dict):
    raise ValueError(f"metadata={t.metadata!r:.50}: expected a map")
  for i, c in enumerate(t.calls):
    if isinstance(c.policy_version, bool) or not isinstance(c.policy_version, int):
      raise ValueError(f"calls[{i}].policy_version={c.policy_version!r:.50}: expected an int")
    for name, kinds in (("input_ids", "iu"), ("output_ids", "iu"), ("output_logprobs", "iuf")):
      values = getattr(c, name)
      a = np.asarray(values) if isinstance(values, list) else None
      if a is None or a.ndim != 1 or (a.size and a.dtype.kind not in kinds):
        raise ValueError(f"calls[{i}].{name}={values!r:.50}: expected a list of "
                         f"{'numbers' if 'f' in kinds else 'token ids'}")


def _decode(data: bytes, entry_id: str) -> Trajectory:
  """The trajectory of an entry, or ValueError naming the entry."""
  try:
    t = Trajectory.from_bytes(data)
    _check_types(t)
    return t
  except ValueError as e:
    raise ValueError(f"entry {entry_id}: {e}") from e


# --------------------------------------------------------------------------------------------
# In-memory backend.


def _admit(queue, entry_id: str, data: Optional[bytes], count: int, taken: set[str],
           out: list[Delivery]) -> None:
  """Append one fetched entry to `out` as a Delivery, or dead-letter it (delivered more than
  `max_deliveries` times, or not a trajectory). Both backends' get_batch go through here."""
  if entry_id in taken:  # re-claimed by ourselves in a call longer than claim_timeout
    return
  taken.add(entry_id)
  if count > queue.max_deliveries:
    why = f"entry {entry_id} delivered {count - 1} times without ack"
    queue._dead_letter(entry_id, data, count, why)
    queue.counters.count("dead_letter", why=why)
    return
  try:
    if data is None:
      raise ValueError(f"entry {entry_id}: no 'data' field")
    out.append(Delivery(entry_id, _decode(data, entry_id), count))
  except ValueError as e:
    queue._dead_letter(entry_id, data, count, str(e))
    queue.counters.count("malformed", why=str(e))
    queue.counters.count("dead_letter", why=str(e))


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


class InMemoryQueue:
  """Single-process queue with the semantics of `RedisQueue` (tests, in-process rollouts).

  `clock` drives claim and lease expiry (inject a fake one in tests); blocking in `get_batch`
  uses real time.
  """

  def __init__(self, *, consumer: str = "trainer", claim_timeout: float = 600.0,
               max_deliveries: int = 5, task_max_deliveries: int = 3,
               clock: Callable[[], float] = time.monotonic, _state: Optional[_MemState] = None):
    _check_args(claim_timeout, max_deliveries, task_max_deliveries)
    self.consumer = consumer
    self.claim_timeout = claim_timeout
    self.max_deliveries = max_deliveries
    self.task_max_deliveries = task_max_deliveries
    self.clock = clock
    self.counters = Counters()
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

  def put(self, trajectory: Trajectory) -> str:
    return self.put_raw(trajectory.to_bytes())

  def put_raw(self, data: bytes) -> str:
    """Append serialised bytes as they are (tests use it for malformed entries)."""
    with self._s.cond:
      entry_id = self._add(bytes(data))
    self.counters.count("put")
    return entry_id

  def _take(self, n: int) -> list[tuple[str, bytes, int]]:
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

  def _dead_letter(self, entry_id: str, data: bytes, deliveries: int, reason: str) -> None:
    s = self._s
    s.dead.append({"entry_id": entry_id, "data": data, "deliveries": deliveries,
                   "reason": reason})
    s.pending.pop(entry_id, None)
    s.entries.pop(entry_id, None)

  def get_batch(self, n: int, timeout: float) -> list[Delivery]:
    """Up to n deliveries; waits up to `timeout` seconds for the first one."""
    if n < 1:
      raise ValueError(f"get_batch n={n}: must be >= 1")
    deadline = time.monotonic() + max(timeout, 0.0)
    out: list[Delivery] = []
    taken: set[str] = set()
    with self._s.cond:
      while True:
        for entry_id, data, count in self._take(n - len(out)):
          _admit(self, entry_id, data, count, taken, out)
        remaining = deadline - time.monotonic()
        if len(out) >= n or remaining <= 0:
          break
        if not self._s.unread:
          self._s.cond.wait(min(remaining, 0.05))  # short: claims expire on the (fake) clock
    self.counters.count("delivered", len(out))
    self.counters.count("redelivered", sum(d.deliveries > 1 for d in out))
    return out

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
    """Entries not yet acked (unread + pending)."""
    with self._s.cond:
      return len(self._s.entries)

  def unread(self) -> int:
    """Entries no consumer has taken yet: what workers' backpressure counts."""
    with self._s.cond:
      return len(self._s.unread)

  def dead_letters(self, count: int = 100) -> list[dict]:
    with self._s.cond:
      return [dict(d) for d in self._s.dead[:count]]

  # Tasks.

  def check_task_source(self, fingerprint: str) -> None:
    """Refuse a worker whose task list differs from the one the queue's draws refer to."""
    with self._s.cond:
      if self._s.fingerprint is None:
        self._s.fingerprint = fingerprint
      elif self._s.fingerprint != fingerprint:
        raise ValueError(f"task list fingerprint={fingerprint} differs from the queue's "
                         f"{self._s.fingerprint}: all workers of a queue need the same tasks "
                         f"(use a new queue prefix for a new task list)")

  def lease_task(self, worker_id: str, ttl: float,
                 max_draws: Optional[int] = None) -> Optional[TaskLease]:
    """An expired lease if any (re-issued), else the next draw; None when `max_draws` are out."""
    _check_ttl(ttl)
    s, now = self._s, self.clock()
    with s.cond:
      for draw in sorted(d for d, l in s.leases.items() if l[0] <= now):
        count = s.leases[draw][2] + 1
        if count > self.task_max_deliveries:
          del s.leases[draw]
          s.dead_tasks.append(draw)
          self.counters.count("dead_task", why=f"draw {draw} leased {count - 1} times")
          continue
        s.leases[draw] = [now + ttl, worker_id, count]
        self.counters.count("task_reissued")
        return TaskLease(draw, worker_id, count)
      if max_draws is not None and s.draws >= max_draws:
        return None
      draw, s.draws = s.draws, s.draws + 1
      s.leases[draw] = [now + ttl, worker_id, 1]
      return TaskLease(draw, worker_id, 1)

  def _holds(self, lease: TaskLease) -> bool:
    held = self._s.leases.get(lease.draw)
    return held is not None and held[1:] == [lease.worker_id, lease.deliveries]

  def renew_task(self, lease: TaskLease, ttl: float) -> bool:
    """Extend a held lease by `ttl` from now; False if it was re-issued to someone else."""
    _check_ttl(ttl)
    with self._s.cond:
      if not self._holds(lease):
        return False
      self._s.leases[lease.draw][0] = self.clock() + ttl
      return True

  def complete_task(self, lease: TaskLease, trajectories: Sequence[Trajectory] = ()) -> bool:
    """Put the draw's trajectories and end the lease atomically, if the lease is still held."""
    blobs = [t.to_bytes() for t in trajectories]
    with self._s.cond:
      if not self._holds(lease):
        self.counters.count("lease_lost", len(blobs) or 1,
                            why=f"draw {lease.draw} re-issued; {len(blobs)} trajectories dropped")
        return False
      for blob in blobs:
        self._add(blob)
      del self._s.leases[lease.draw]
      self._s.done += 1
    self.counters.count("put", len(blobs))
    return True

  def release_task(self, lease: TaskLease) -> bool:
    """Give a held lease back for immediate re-issue (not counted as a failed delivery)."""
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

  def metrics(self) -> dict[str, float]:
    out = {f"queue/{k}": v for k, v in self.counters.as_dict().items()}
    out["queue/backlog"] = self.backlog()
    with self._s.cond:
      out["queue/dead_letter_total"] = len(self._s.dead)
    out.update({f"queue/tasks_{k}": v for k, v in self.task_status().items()})
    return out

  def close(self) -> None:
    pass


# --------------------------------------------------------------------------------------------
# Redis Streams backend.

# Lease bookkeeping lives in Lua so that check-and-set is atomic on the server, and expiry uses
# the server's clock (workers' clocks may disagree). KEYS/ARGV are documented per script.
# info[draw] = "<deliveries>|<worker_id>"; leases = zset draw -> expiry in ms.
_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: draws, leases, info, dead_tasks. ARGV: worker, ttl_ms, max_draws (-1: none), max_deliv.
# Returns {draw or -1 when max_draws are out, deliveries, draws moved to dead_tasks}.
_LEASE = _NOW_MS + """
local dead = 0
while true do
  local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 1)
  if #expired == 0 then break end
  local draw = expired[1]
  local info = redis.call('HGET', KEYS[3], draw) or '0|'
  local count = tonumber(string.match(info, '^(%d+)')) + 1
  if count > tonumber(ARGV[4]) then
    redis.call('ZREM', KEYS[2], draw)
    redis.call('HDEL', KEYS[3], draw)
    redis.call('RPUSH', KEYS[4], draw)
    dead = dead + 1
  else
    redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), draw)
    redis.call('HSET', KEYS[3], draw, count .. '|' .. ARGV[1])
    return {tonumber(draw), count, dead}
  end
end
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[3]) >= 0 and n >= tonumber(ARGV[3]) then return {-1, 0, dead} end
redis.call('SET', KEYS[1], n + 1)
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), n)
redis.call('HSET', KEYS[3], n, '1|' .. ARGV[1])
return {n, 1, dead}
"""

# KEYS: leases, info. ARGV: draw, "<deliveries>|<worker>", ttl_ms.
_RENEW = _NOW_MS + """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
return 1
"""

# KEYS: leases, info, stream, done. ARGV: draw, "<deliveries>|<worker>", trajectory bytes...
_COMPLETE = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
for i = 3, #ARGV do redis.call('XADD', KEYS[3], '*', 'data', ARGV[i]) end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('INCR', KEYS[4])
return 1
"""

# KEYS: leases, info. ARGV: draw, "<deliveries>|<worker>", deliveries - 1.
_RELEASE = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('ZADD', KEYS[1], 0, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3] .. '|')
return 1
"""


def _redact(url: str) -> str:
  """The URL without its password (for messages and logs)."""
  parts = urlsplit(url)
  if parts.password is None:
    return url
  netloc = parts.netloc.rsplit("@", 1)[1]
  user = parts.username or ""
  return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def _s(x) -> str:
  return x.decode() if isinstance(x, bytes) else str(x)


def _next_id(entry_id: str) -> str:
  ms, seq = entry_id.split("-")
  return f"{ms}-{int(seq) + 1}"


def _id_key(entry_id: str) -> tuple[int, int]:
  ms, seq = entry_id.split("-")
  return int(ms), int(seq)


class RedisQueue:
  """Redis Streams backend. Keys: `{prefix}:rollouts` (stream, consumer group `group`),
  `{prefix}:dead` (dead-letter stream), `{prefix}:task:*` (draw counter, leases, done count,
  dead draws, task-list fingerprint), braces included.

  `url`: `redis://[:password@]host:port[/db]` or `rediss://...` (TLS; `ca_file` verifies the
  server's certificate). `password` (or the URL's) is sent with AUTH. `consumer` must be stable
  across restarts of the same trainer, so a restarted one takes its own pending entries back
  at once instead of after `claim_timeout`.
  """

  def __init__(self, url: str, *, password: Optional[str] = None, ca_file: Optional[str] = None,
               prefix: str = "arbor", consumer: str = "trainer", group: str = "trainer",
               claim_timeout: float = 600.0, max_deliveries: int = 5,
               task_max_deliveries: int = 3, _client=None):
    import redis  # only the Redis backend needs it
    _check_args(claim_timeout, max_deliveries, task_max_deliveries)
    scheme = urlsplit(url).scheme
    if scheme not in ("redis", "rediss"):
      raise ValueError(f"queue url={_redact(url)!r}: expected redis:// or rediss://")
    self.url, self.prefix, self.consumer, self.group = url, prefix, consumer, group
    self.claim_timeout = claim_timeout
    self.max_deliveries = max_deliveries
    self.task_max_deliveries = task_max_deliveries
    self.counters = Counters()
    # "{prefix}" is a hash tag: in a Redis Cluster all keys of a queue share one slot, which
    # the Lua scripts (several keys each) need.
    tag = f"{{{prefix}}}"
    self.stream, self.dead = f"{tag}:rollouts", f"{tag}:dead"
    self._task_keys = {k: f"{tag}:task:{k}"
                       for k in ("draws", "leases", "info", "dead", "done", "fingerprint")}
    if _client is None:
      kwargs = dict(password=password, socket_connect_timeout=10, health_check_interval=30)
      if scheme == "rediss" and ca_file:
        kwargs["ssl_ca_certs"] = ca_file
      _client = redis.Redis.from_url(url, **kwargs)
      try:
        _client.ping()
      except redis.AuthenticationError as e:
        raise PermissionError(f"Redis at {_redact(url)} refused authentication (password "
                              f"wrong or missing): {e}") from e
      except redis.ResponseError as e:
        if "NOAUTH" in str(e):
          raise PermissionError(f"Redis at {_redact(url)} requires a password") from e
        raise
      except redis.ConnectionError as e:
        raise ConnectionError(f"cannot reach Redis at {_redact(url)}: {e}") from e
    self._r = _client
    try:
      self._r.xgroup_create(self.stream, group, id="0", mkstream=True)
    except redis.ResponseError as e:
      if "BUSYGROUP" not in str(e):
        raise
    self._lease = self._r.register_script(_LEASE)
    self._renew = self._r.register_script(_RENEW)
    self._complete = self._r.register_script(_COMPLETE)
    self._release = self._r.register_script(_RELEASE)
    self._history = "0"         # cursor through our own pending entries (restart recovery)
    self._claim_cursor = "0-0"  # XAUTOCLAIM cursor

  def with_consumer(self, consumer: str) -> "RedisQueue":
    """Another consumer on the same stream and connection pool."""
    return RedisQueue(self.url, prefix=self.prefix, consumer=consumer, group=self.group,
                      claim_timeout=self.claim_timeout, max_deliveries=self.max_deliveries,
                      task_max_deliveries=self.task_max_deliveries, _client=self._r)

  # Trajectories.

  def put(self, trajectory: Trajectory) -> str:
    return self.put_raw(trajectory.to_bytes())

  def put_raw(self, data: bytes) -> str:
    """XADD serialised bytes as they are (never trimmed: no MAXLEN)."""
    entry_id = _s(self._r.xadd(self.stream, {"data": bytes(data)}))
    self.counters.count("put")
    return entry_id

  def _fetch(self, n: int, block_ms: Optional[int]) -> list[tuple[str, Optional[bytes], int]]:
    """Up to n (id, data, deliveries): own pending once after start, expired claims, new."""
    got: list[tuple[str, Optional[bytes], Optional[int]]] = []
    if self._history is not None:
      reply = self._r.xreadgroup(self.group, self.consumer, {self.stream: self._history},
                                 count=n)
      entries = reply[0][1] if reply else []
      if not entries:
        self._history = None
      else:  # return before reading new entries: they would join our pending list and the
        # next history read would return them a second time
        self._history = _s(entries[-1][0])
        got = [(_s(i), (f or {}).get(b"data"), None) for i, f in entries]
        return self._with_counts(got)
    if len(got) < n:
      cursor, entries, _deleted = self._r.xautoclaim(
          self.stream, self.group, self.consumer, min_idle_time=int(self.claim_timeout * 1000),
          start_id=self._claim_cursor, count=n - len(got))
      self._claim_cursor = _s(cursor)
      got += [(_s(i), (f or {}).get(b"data"), None) for i, f in entries]
    if len(got) < n:
      reply = self._r.xreadgroup(self.group, self.consumer, {self.stream: ">"},
                                 count=n - len(got), block=None if got else block_ms)
      got += [(_s(i), (f or {}).get(b"data"), 1) for i, f in (reply[0][1] if reply else [])]
    return self._with_counts(got)

  def _with_counts(self, got: list) -> list[tuple[str, Optional[bytes], int]]:
    """Fill in the delivery counts of re-read entries (None) from the pending list, where
    XREADGROUP and XAUTOCLAIM incremented them."""
    unknown = [i for i, _, c in got if c is None]
    if not unknown:
      return got
    pipe = self._r.pipeline(transaction=False)
    for entry_id in unknown:
      pipe.xpending_range(self.stream, self.group, entry_id, entry_id, 1)
    counts = {i: (r[0]["times_delivered"] if r else 1) for i, r in zip(unknown, pipe.execute())}
    return [(i, d, counts[i] if c is None else c) for i, d, c in got]

  def _dead_letter(self, entry_id: str, data: Optional[bytes], deliveries: int,
                   reason: str) -> None:
    pipe = self._r.pipeline(transaction=True)  # both or neither
    pipe.xadd(self.dead, {"data": data or b"", "entry_id": entry_id, "reason": reason,
                          "deliveries": deliveries, "stream": self.stream})
    pipe.xack(self.stream, self.group, entry_id)
    pipe.execute()

  def get_batch(self, n: int, timeout: float) -> list[Delivery]:
    """Up to n deliveries; blocks up to `timeout` seconds for the first one."""
    if n < 1:
      raise ValueError(f"get_batch n={n}: must be >= 1")
    deadline = time.monotonic() + max(timeout, 0.0)
    out: list[Delivery] = []
    taken: set[str] = set()
    while True:
      remaining = deadline - time.monotonic()
      block_ms = max(1, int(remaining * 1000)) if remaining > 0 else None
      for entry_id, data, count in self._fetch(n - len(out), block_ms):
        _admit(self, entry_id, data, count, taken, out)
      if len(out) >= n or time.monotonic() >= deadline:
        break
    self.counters.count("delivered", len(out))
    self.counters.count("redelivered", sum(d.deliveries > 1 for d in out))
    return out

  def ack(self, entry_ids: Iterable[str]) -> int:
    ids, n = list(entry_ids), 0
    for start in range(0, len(ids), 1000):
      n += int(self._r.xack(self.stream, self.group, *ids[start:start + 1000]))
    self.counters.count("acked", n)
    return n

  def backlog(self) -> int:
    """Entries not yet acked (unread + pending)."""
    for g in self._r.xinfo_groups(self.stream):
      if _s(g["name"]) == self.group:
        return int(g["pending"]) + self._unread(g)
    return int(self._r.xlen(self.stream))

  def unread(self) -> int:
    """Entries the consumer group has not taken yet: what workers' backpressure counts."""
    for g in self._r.xinfo_groups(self.stream):
      if _s(g["name"]) == self.group:
        return self._unread(g)
    return int(self._r.xlen(self.stream))

  def _unread(self, group_info: dict) -> int:
    lag = group_info.get("lag")  # Redis >= 7; else count the entries past the last delivered
    if lag is not None:
      return int(lag)
    last = _s(group_info["last-delivered-id"])
    return len(self._r.xrange(self.stream, min="(" + last if last != "0-0" else "-", max="+",
                              count=100_000))

  def trim_acked(self) -> int:
    """Delete entries that are delivered and acked (never an unread or pending one); returns
    how many. Call now and then in long runs: the stream otherwise keeps every trajectory."""
    last = None
    for g in self._r.xinfo_groups(self.stream):
      if _s(g["name"]) == self.group:
        last = _s(g["last-delivered-id"])
    if last is None or last == "0-0":
      return 0
    threshold = _next_id(last)  # everything below was delivered
    pending = self._r.xpending(self.stream, self.group)
    if pending["pending"]:
      threshold = min(threshold, _s(pending["min"]), key=_id_key)
    return int(self._r.xtrim(self.stream, minid=threshold, approximate=False))

  def dead_letters(self, count: int = 100) -> list[dict]:
    out = []
    for _, fields in self._r.xrange(self.dead, count=count):
      d = {_s(k): v for k, v in fields.items()}
      out.append({"entry_id": _s(d["entry_id"]), "data": d["data"],
                  "deliveries": int(d["deliveries"]), "reason": _s(d["reason"])})
    return out

  # Tasks.

  def check_task_source(self, fingerprint: str) -> None:
    """Refuse a worker whose task list differs from the one the queue's draws refer to."""
    key = self._task_keys["fingerprint"]
    self._r.set(key, fingerprint, nx=True)
    stored = _s(self._r.get(key))
    if stored != fingerprint:
      raise ValueError(f"task list fingerprint={fingerprint} differs from the queue's {stored} "
                       f"at {key}: all workers of a queue need the same tasks (use a new queue "
                       f"prefix for a new task list)")

  def lease_task(self, worker_id: str, ttl: float,
                 max_draws: Optional[int] = None) -> Optional[TaskLease]:
    """An expired lease if any (re-issued), else the next draw; None when `max_draws` are out."""
    _check_ttl(ttl)
    if "|" in worker_id:
      raise ValueError(f"worker_id={worker_id!r}: must not contain '|'")
    k = self._task_keys
    draw, count, dead = self._lease(keys=[k["draws"], k["leases"], k["info"], k["dead"]],
                                    args=[worker_id, max(1, int(ttl * 1000)),
                                          -1 if max_draws is None else int(max_draws),
                                          self.task_max_deliveries])
    self.counters.count("dead_task", int(dead), why=f"leased {self.task_max_deliveries} times "
                                                    f"without completing")
    if int(draw) < 0:
      return None
    lease = TaskLease(int(draw), worker_id, int(count))
    if lease.deliveries > 1:
      self.counters.count("task_reissued")
    return lease

  def _holder(self, lease: TaskLease) -> str:
    return f"{lease.deliveries}|{lease.worker_id}"

  def renew_task(self, lease: TaskLease, ttl: float) -> bool:
    """Extend a held lease by `ttl` from now; False if it was re-issued to someone else."""
    _check_ttl(ttl)
    k = self._task_keys
    return bool(self._renew(keys=[k["leases"], k["info"]],
                            args=[lease.draw, self._holder(lease), max(1, int(ttl * 1000))]))

  def complete_task(self, lease: TaskLease, trajectories: Sequence[Trajectory] = ()) -> bool:
    """Put the draw's trajectories and end the lease atomically, if the lease is still held."""
    k = self._task_keys
    blobs = [t.to_bytes() for t in trajectories]
    ok = bool(self._complete(keys=[k["leases"], k["info"], self.stream, k["done"]],
                             args=[lease.draw, self._holder(lease), *blobs]))
    if ok:
      self.counters.count("put", len(blobs))
    else:
      self.counters.count("lease_lost", len(blobs) or 1,
                          why=f"draw {lease.draw} re-issued; {len(blobs)} trajectories dropped")
    return ok

  def release_task(self, lease: TaskLease) -> bool:
    """Give a held lease back for immediate re-issue (not counted as a failed delivery)."""
    k = self._task_keys
    return bool(self._release(keys=[k["leases"], k["info"]],
                              args=[lease.draw, self._holder(lease), lease.deliveries - 1]))

  def task_status(self) -> dict[str, int]:
    k = self._task_keys
    pipe = self._r.pipeline(transaction=False)
    pipe.get(k["draws"]), pipe.zcard(k["leases"]), pipe.get(k["done"]), pipe.llen(k["dead"])
    draws, open_, done, dead = pipe.execute()
    return {"draws": int(draws or 0), "open": int(open_), "done": int(done or 0),
            "dead": int(dead)}

  def metrics(self) -> dict[str, float]:
    out = {f"queue/{k}": v for k, v in self.counters.as_dict().items()}
    out["queue/backlog"] = self.backlog()
    out["queue/dead_letter_total"] = int(self._r.xlen(self.dead))
    out.update({f"queue/tasks_{k}": v for k, v in self.task_status().items()})
    return out

  def close(self) -> None:
    self._r.close()


def make_queue(url: Optional[str] = None, *, password_file: Optional[str] = None,
               **kwargs) -> InMemoryQueue | RedisQueue:
  """`None` / "memory" → InMemoryQueue; `redis://` / `rediss://` → RedisQueue.

  The password comes from the URL, `password=`, or `password_file` (keeps it off command lines
  and out of `ps`).
  """
  if url in (None, "", "memory"):
    for redis_only in ("password", "ca_file", "prefix", "group"):
      kwargs.pop(redis_only, None)
    return InMemoryQueue(**kwargs)
  if password_file:
    with open(password_file) as f:
      kwargs["password"] = f.read().strip()
  return RedisQueue(url, **kwargs)


def default_worker_id() -> str:
  """host-pid-random: unique per process, readable in logs."""
  return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


# --------------------------------------------------------------------------------------------
# Consumption helpers for the trainer.


def filter_unseen(deliveries: Iterable[Delivery],
                  seen_ids: Iterable[str] | set[str]) -> tuple[list[Delivery], list[Delivery]]:
  """(fresh, already_seen): a delivery whose trajectory id the trainer has already consumed
  (from its checkpoint), or that repeats one earlier in this batch, goes to `already_seen`,
  which the trainer acks without training."""
  seen = seen_ids if isinstance(seen_ids, (set, frozenset)) else set(seen_ids)
  batch: set[str] = set()
  fresh, dup = [], []
  for d in deliveries:
    tid = d.trajectory.trajectory_id
    (dup if tid in seen or tid in batch else fresh).append(d)
    batch.add(tid)
  return fresh, dup


@dataclasses.dataclass
class Group:
  """The trajectories of one group (same group_id). `partial`: fewer than its group size."""

  group_id: str
  deliveries: list[Delivery]
  partial: bool = False

  @property
  def trajectories(self) -> list[Trajectory]:
    return [d.trajectory for d in self.deliveries]

  @property
  def entry_ids(self) -> list[str]:
    return [d.entry_id for d in self.deliveries]

  @property
  def policy_version(self) -> int:
    return min(d.trajectory.policy_version for d in self.deliveries)


class GroupAssembler:
  """Collects deliveries into whole groups (G trajectories with the same `group_id`).

  Rule: a group is ready as soon as it has G members (G = the trajectories'
  `metadata["group_size"]` when workers set it, else `group_size`). A group still short
  `deadline` seconds after its first member arrived is released as partial if it has at least
  `min_group_size` members, and dropped otherwise. Members arriving after their group was
  released or dropped, and repeated trajectory ids, are dropped. Every drop is counted; dropped
  deliveries are returned so the trainer acks them like trained ones.
  """

  def __init__(self, group_size: int, *, min_group_size: Optional[int] = None,
               deadline: float = 300.0, counters: Optional[Counters] = None,
               clock: Callable[[], float] = time.monotonic, remember: int = 100_000):
    min_group_size = group_size if min_group_size is None else min_group_size
    if group_size < 1:
      raise ValueError(f"group_size={group_size}: must be >= 1")
    if not 1 <= min_group_size <= group_size:
      raise ValueError(f"min_group_size={min_group_size}: must be in [1, group_size="
                       f"{group_size}]")
    if deadline < 0:
      raise ValueError(f"deadline={deadline}: must be >= 0 seconds")
    self.group_size, self.min_group_size, self.deadline = group_size, min_group_size, deadline
    self.counters = counters if counters is not None else Counters()
    self.clock, self.remember = clock, remember
    self._open: dict[str, tuple[float, list[Delivery]]] = {}
    self._closed: collections.OrderedDict[str, None] = collections.OrderedDict()
    self._ids: set[str] = set()     # trajectory ids in open groups
    self._dropped: list[Delivery] = []

  def _size(self, d: Delivery) -> int:
    size = d.trajectory.metadata.get("group_size", self.group_size)
    return size if isinstance(size, int) and size >= 1 else self.group_size

  def _close(self, group_id: str) -> list[Delivery]:
    _, members = self._open.pop(group_id)
    self._ids.difference_update(d.trajectory.trajectory_id for d in members)
    self._closed[group_id] = None
    while len(self._closed) > self.remember:
      self._closed.popitem(last=False)
    return members

  def add(self, deliveries: Iterable[Delivery]) -> None:
    now = self.clock()
    for d in deliveries:
      gid, tid = d.trajectory.group_id, d.trajectory.trajectory_id
      if gid in self._closed:
        self._dropped.append(d)
        self.counters.count("dropped_partial_group", why=f"late member of closed group {gid}")
      elif tid in self._ids:
        self._dropped.append(d)
        self.counters.count("duplicate", why=f"trajectory {tid} twice in group {gid}")
      else:
        self._open.setdefault(gid, (now, []))[1].append(d)
        self._ids.add(tid)

  def pop_ready(self) -> tuple[list[Group], list[Delivery]]:
    """(groups ready to train, deliveries dropped since the last call)."""
    now, ready = self.clock(), []
    for gid, (first, members) in list(self._open.items()):
      size = self._size(members[0])
      if len(members) >= size:
        ready.append(Group(gid, self._close(gid)))
      elif now - first >= self.deadline:
        members = self._close(gid)
        if len(members) >= min(self.min_group_size, size):
          ready.append(Group(gid, members, partial=True))
          self.counters.count("partial_group_trained")
        else:
          self._dropped += members
          self.counters.count("dropped_partial_group", len(members),
                              why=f"group {gid} had {len(members)}/{size} after "
                                  f"{self.deadline}s")
    dropped, self._dropped = self._dropped, []
    return ready, dropped

  @property
  def waiting(self) -> int:
    """Deliveries held in incomplete groups."""
    return sum(len(m) for _, m in self._open.values())


def drop_stale(groups: Iterable[Group], policy_version: int, max_staleness: int,
               counters: Optional[Counters] = None) -> tuple[list[Group], list[Delivery]]:
  """(fresh groups, dropped deliveries): a group whose oldest token came from a policy more than
  `max_staleness` versions behind `policy_version` is dropped whole (async admission control)."""
  if max_staleness < 0:
    raise ValueError(f"max_staleness={max_staleness}: must be >= 0")
  fresh, dropped = [], []
  for g in groups:
    lag = policy_version - g.policy_version
    if lag > max_staleness:
      dropped += g.deliveries
      if counters is not None:
        counters.count("dropped_stale", len(g.deliveries),
                       why=f"group {g.group_id} is {lag} versions old (max {max_staleness})")
    else:
      fresh.append(g)
  return fresh, dropped
