"""The rollout queue's contract and the logic both backends share (docs/design.md §2, §5).

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

Every drop (dead letter, malformed, staleness, partial group, duplicate, lost lease, dead task)
is counted in `queue.counters` and logged; `metrics()` adds backlog and task counts.
`RolloutQueue` holds what the backends share (argument checks, admission of fetched entries,
counting, metrics); each backend supplies the storage operations marked abstract.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import logging
import math
import os
import socket
import threading
import time
import uuid
from typing import Iterable, Optional, Sequence

import numpy as np

from envs.trajectory import Trajectory

log = logging.getLogger(__name__)

# Counter names that mean "data was thrown away": logged as warnings when counted.
DROPS = ("dead_letter", "malformed", "dropped_stale", "dropped_partial_group", "duplicate",
         "lease_lost", "dead_task")

# (entry id, serialised trajectory or None when the entry has no data, deliveries so far)
Fetched = tuple[str, Optional[bytes], int]


@dataclasses.dataclass(frozen=True)
class Delivery:
  """One trajectory handed to a consumer.

  Attributes:
    entry_id: the queue entry, to `ack` once the trajectory is safely trained.
    trajectory: the decoded record.
    deliveries: how many times this entry has been delivered so far (1 the first time; more
      after a consumer died without acking it).
  """

  entry_id: str
  trajectory: Trajectory
  deliveries: int


@dataclasses.dataclass(frozen=True)
class TaskLease:
  """A task draw held by one worker.

  Attributes:
    draw: the global draw number (which task it is: `task_order`).
    worker_id: the holder.
    deliveries: issues of this draw so far (>1: re-issued after a worker died or released it).
  """

  draw: int
  worker_id: str
  deliveries: int = 1


class Counters:
  """Thread-safe event counters of one queue handle; drops are logged as they are counted."""

  def __init__(self):
    self._lock = threading.Lock()
    self._counts: collections.Counter = collections.Counter()

  def count(self, name: str, n: int = 1, why: str = "") -> None:
    """Adds to a counter; a drop counter (one of DROPS) is also logged as a warning.

    Args:
      name: the counter.
      n: how much to add (nothing when n <= 0).
      why: the reason, logged with a drop.
    """
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
    """Every counter seen so far plus every drop counter (0 when none), by name."""
    with self._lock:
      return {name: self._counts[name] for name in sorted(set(self._counts) | set(DROPS))}


def check_claim_timeout(claim_timeout: float, checkpoint_interval_s: float,
                        group_deadline_s: float = 0.0) -> None:
  """Raises unless pending entries outlive the time the trainer legitimately holds them unacked.

  The trainer acks only after the checkpoint that includes a step, so it may hold an entry for
  up to the group deadline plus one checkpoint interval; a shorter claim timeout would re-deliver
  entries of a healthy trainer.

  Args:
    claim_timeout: the queue's claim timeout, seconds.
    checkpoint_interval_s: the trainer's checkpoint interval, seconds.
    group_deadline_s: the group assembler's deadline, seconds.

  Raises:
    ValueError: claim_timeout is not longer than the two together.
  """
  if claim_timeout <= checkpoint_interval_s + group_deadline_s:
    raise ValueError(
        f"queue claim_timeout={claim_timeout}s must be longer than checkpoint interval "
        f"({checkpoint_interval_s}s) + group deadline ({group_deadline_s}s)")


def task_order(num_tasks: int, epoch: int, seed: int = 0) -> np.ndarray:
  """The task indices of one epoch in sampling order.

  A permutation fixed by (seed, epoch), so every worker maps a draw to the same task without
  talking to the others.

  Args:
    num_tasks: T, the number of tasks.
    epoch: which pass over the tasks.
    seed: the run's task-order seed.

  Returns:
    [T] int array, a permutation of range(T).

  Raises:
    ValueError: num_tasks < 1.
  """
  if num_tasks <= 0:
    raise ValueError(f"num_tasks={num_tasks}: need at least one task")
  return np.random.default_rng([seed, epoch]).permutation(num_tasks)


def default_worker_id() -> str:
  """A worker name unique per process and readable in logs: host-pid-random."""
  return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def _check_ttl(ttl: float) -> None:
  """ValueError unless a lease ttl is a positive number of seconds."""
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


def decode_entry(data: bytes, entry_id: str) -> Trajectory:
  """The trajectory of a queue entry, with the types the trainer relies on checked.

  Args:
    data: the entry's serialised trajectory (`Trajectory.to_bytes`).
    entry_id: the entry, named in errors.

  Returns:
    The trajectory.

  Raises:
    ValueError: naming the entry, when the bytes are not a well-typed trajectory record.
  """
  try:
    t = Trajectory.from_bytes(data)
    _check_types(t)
    return t
  except ValueError as e:
    raise ValueError(f"entry {entry_id}: {e}") from e


class RolloutQueue(abc.ABC):
  """What the trainer and the workers call (see the module docstring).

  `InMemoryQueue` and `RedisQueue` implement it. The methods here are the backend-independent
  halves of the operations; the abstract ones are storage operations each backend supplies.

  Attributes:
    consumer: this handle's consumer name (stable across restarts of the same trainer).
    claim_timeout: seconds before a pending entry of a silent consumer is re-claimed.
    max_deliveries: deliveries of one entry before it goes to the dead letters.
    task_max_deliveries: issues of one draw before it is given up as a dead task.
    counters: this handle's event counters.
  """

  def __init__(self, *, consumer: str, claim_timeout: float, max_deliveries: int,
               task_max_deliveries: int):
    if not claim_timeout > 0:
      raise ValueError(f"claim_timeout={claim_timeout!r}: must be > 0 seconds")
    if max_deliveries < 1:
      raise ValueError(f"max_deliveries={max_deliveries!r}: must be >= 1")
    if task_max_deliveries < 1:
      raise ValueError(f"task_max_deliveries={task_max_deliveries!r}: must be >= 1")
    self.consumer = consumer
    self.claim_timeout = claim_timeout
    self.max_deliveries = max_deliveries
    self.task_max_deliveries = task_max_deliveries
    self.counters = Counters()

  # Trajectories.

  @abc.abstractmethod
  def with_consumer(self, consumer: str) -> "RolloutQueue":
    """Another consumer on the same queue (what a second process would be).

    Args:
      consumer: the new handle's consumer name.

    Returns:
      A handle sharing this queue's storage.
    """

  @abc.abstractmethod
  def put_raw(self, data: bytes) -> str:
    """Appends serialised bytes as they are (tests use it for malformed entries).

    Args:
      data: a serialised trajectory (or anything, to test dead-lettering).

    Returns:
      The new entry's id.
    """

  def put(self, trajectory: Trajectory) -> str:
    """Appends one trajectory.

    Args:
      trajectory: the record.

    Returns:
      The new entry's id.
    """
    return self.put_raw(trajectory.to_bytes())

  @abc.abstractmethod
  def _fetch(self, n: int, deadline: float) -> list[Fetched]:
    """Up to n entries for this consumer: its own pending ones once after start, then claims
    older than claim_timeout, then new ones; may wait until `deadline` (time.monotonic) when
    there is nothing to take."""

  @abc.abstractmethod
  def _dead_letter(self, entry_id: str, data: Optional[bytes], deliveries: int,
                   reason: str) -> None:
    """Moves an entry to the dead letters and acks it, both or neither."""

  def _admit(self, fetched: Fetched, taken: set[str], out: list[Delivery]) -> None:
    """Appends one fetched entry to `out` as a Delivery, or dead-letters it (delivered more
    than `max_deliveries` times, or not a trajectory)."""
    entry_id, data, count = fetched
    if entry_id in taken:  # re-claimed by ourselves in a call longer than claim_timeout
      return
    taken.add(entry_id)
    if count > self.max_deliveries:
      why = f"entry {entry_id} delivered {count - 1} times without ack"
      self._dead_letter(entry_id, data, count, why)
      self.counters.count("dead_letter", why=why)
      return
    try:
      if data is None:
        raise ValueError(f"entry {entry_id}: no 'data' field")
      out.append(Delivery(entry_id, decode_entry(data, entry_id), count))
    except ValueError as e:
      self._dead_letter(entry_id, data, count, str(e))
      self.counters.count("malformed", why=str(e))
      self.counters.count("dead_letter", why=str(e))

  def get_batch(self, n: int, timeout: float) -> list[Delivery]:
    """Up to n deliveries; waits up to `timeout` seconds for the first one.

    Args:
      n: the most deliveries to return (>= 1).
      timeout: seconds to wait while there is nothing to deliver.

    Returns:
      The deliveries, in the order they were taken (each stays pending until acked).

    Raises:
      ValueError: n < 1.
    """
    if n < 1:
      raise ValueError(f"get_batch n={n}: must be >= 1")
    deadline = time.monotonic() + max(timeout, 0.0)
    out: list[Delivery] = []
    taken: set[str] = set()
    while True:
      for fetched in self._fetch(n - len(out), deadline):
        self._admit(fetched, taken, out)
      if len(out) >= n or time.monotonic() >= deadline:
        break
    self.counters.count("delivered", len(out))
    self.counters.count("redelivered", sum(d.deliveries > 1 for d in out))
    return out

  @abc.abstractmethod
  def ack(self, entry_ids: Iterable[str]) -> int:
    """Acknowledges entries (trained and checkpointed, or dropped): never delivered again.

    Args:
      entry_ids: the entries.

    Returns:
      How many of them were pending.
    """

  @abc.abstractmethod
  def backlog(self) -> int:
    """Entries not yet acked (unread + pending)."""

  @abc.abstractmethod
  def unread(self) -> int:
    """Entries no consumer has taken yet: what workers' backpressure counts."""

  @abc.abstractmethod
  def dead_letters(self, count: int = 100) -> list[dict]:
    """The first dead letters.

    Args:
      count: how many at most.

    Returns:
      [{"entry_id", "data", "deliveries", "reason"}].
    """

  @abc.abstractmethod
  def _dead_letter_total(self) -> int:
    """How many entries the dead letters hold."""

  # Tasks.

  @abc.abstractmethod
  def _store_fingerprint(self, fingerprint: str) -> tuple[str, str]:
    """Stores `fingerprint` unless one is stored; (the stored one, where it is stored)."""

  def check_task_source(self, fingerprint: str) -> None:
    """Refuses a worker whose task list differs from the one the queue's draws refer to.

    Args:
      fingerprint: identifies the worker's task list and seed (the first worker's is kept).

    Raises:
      ValueError: the queue already holds another fingerprint.
    """
    stored, where = self._store_fingerprint(fingerprint)
    if stored != fingerprint:
      raise ValueError(f"task list fingerprint={fingerprint} differs from the queue's {stored}"
                       f"{where}: all workers of a queue need the same tasks (use a new queue "
                       f"prefix for a new task list)")

  @abc.abstractmethod
  def _lease(self, worker_id: str, ttl: float,
             max_draws: Optional[int]) -> tuple[Optional[TaskLease], int]:
    """(an expired lease re-issued, else the next draw, else None; draws given up as dead)."""

  def lease_task(self, worker_id: str, ttl: float,
                 max_draws: Optional[int] = None) -> Optional[TaskLease]:
    """Leases a draw: an expired lease if any (re-issued), else the next draw.

    A draw already issued `task_max_deliveries` times is given up (counted "dead_task").

    Args:
      worker_id: the leasing worker.
      ttl: seconds the lease lives without renewal.
      max_draws: draws to issue at most (None: no limit).

    Returns:
      The lease, or None when `max_draws` are all out.

    Raises:
      ValueError: ttl <= 0.
    """
    _check_ttl(ttl)
    lease, dead = self._lease(worker_id, ttl, max_draws)
    self.counters.count("dead_task", dead, why=f"leased {self.task_max_deliveries} times "
                                               f"without completing")
    if lease is not None and lease.deliveries > 1:
      self.counters.count("task_reissued")
    return lease

  @abc.abstractmethod
  def _renew(self, lease: TaskLease, ttl: float) -> bool:
    """Moves a held lease's expiry to `ttl` from now; False if it is not held."""

  def renew_task(self, lease: TaskLease, ttl: float) -> bool:
    """Extends a held lease by `ttl` seconds from now.

    Args:
      lease: the worker's lease.
      ttl: seconds the lease lives from now.

    Returns:
      False if the draw was re-issued to someone else.

    Raises:
      ValueError: ttl <= 0.
    """
    _check_ttl(ttl)
    return self._renew(lease, ttl)

  @abc.abstractmethod
  def _complete(self, lease: TaskLease, blobs: Sequence[bytes]) -> bool:
    """If the lease is held: appends the blobs, ends the lease, counts the draw done (all or
    nothing); else False."""

  def complete_task(self, lease: TaskLease, trajectories: Sequence[Trajectory] = ()) -> bool:
    """Puts the draw's trajectories and ends the lease atomically, if the lease is still held.

    Args:
      lease: the worker's lease.
      trajectories: the draw's group (possibly partial; empty ends the lease only).

    Returns:
      False (nothing put) if the draw was re-issued to someone else.
    """
    blobs = [t.to_bytes() for t in trajectories]
    if self._complete(lease, blobs):
      self.counters.count("put", len(blobs))
      return True
    self.counters.count("lease_lost", len(blobs) or 1,
                        why=f"draw {lease.draw} re-issued; {len(blobs)} trajectories dropped")
    return False

  @abc.abstractmethod
  def release_task(self, lease: TaskLease) -> bool:
    """Gives a held lease back for immediate re-issue (not counted as a failed delivery).

    Args:
      lease: the worker's lease.

    Returns:
      False if the lease was no longer held.
    """

  @abc.abstractmethod
  def task_status(self) -> dict[str, int]:
    """{"draws" issued, "open" leases, "done" draws, "dead" draws}."""

  def metrics(self) -> dict[str, float]:
    """The counters, backlog, dead-letter total and task status, as "queue/..." metrics."""
    out = {f"queue/{k}": v for k, v in self.counters.as_dict().items()}
    out["queue/backlog"] = self.backlog()
    out["queue/dead_letter_total"] = self._dead_letter_total()
    out.update({f"queue/tasks_{k}": v for k, v in self.task_status().items()})
    return out

  @abc.abstractmethod
  def close(self) -> None:
    """Releases the handle's connection (if any)."""
