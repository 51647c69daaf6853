"""The trainer's side of the rollout queue: whole groups, fresh policies, each trajectory once.

Idempotent consumption (how the trainer uses the queue):

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
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Iterable, Optional

from envs.queue.base import Counters, Delivery
from envs.trajectory import Trajectory


def filter_unseen(deliveries: Iterable[Delivery],
                  seen_ids: Iterable[str] | set[str]) -> tuple[list[Delivery], list[Delivery]]:
  """Splits deliveries into those to train and those already consumed.

  Args:
    deliveries: what `get_batch` returned.
    seen_ids: trajectory ids the trainer has already consumed (from its checkpoint).

  Returns:
    (fresh, already_seen): a delivery whose trajectory id is in `seen_ids`, or repeats one
    earlier in this batch, goes to `already_seen`, which the trainer acks without training.
  """
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
  """The trajectories of one group (same group_id).

  Attributes:
    group_id: the group.
    deliveries: its members as delivered.
    partial: fewer than its group size (released at the deadline).
  """

  group_id: str
  deliveries: list[Delivery]
  partial: bool = False

  @property
  def trajectories(self) -> list[Trajectory]:
    """The members' trajectories, in delivery order."""
    return [d.trajectory for d in self.deliveries]

  @property
  def entry_ids(self) -> list[str]:
    """The members' queue entries (to ack once trained)."""
    return [d.entry_id for d in self.deliveries]

  @property
  def policy_version(self) -> int:
    """The oldest policy version of any member's tokens."""
    return min(d.trajectory.policy_version for d in self.deliveries)


class GroupAssembler:
  """Collects deliveries into whole groups (G trajectories with the same `group_id`).

  Rule: a group is ready as soon as it has G members (G = the trajectories'
  `metadata["group_size"]` when workers set it, else `group_size`). A group still short
  `deadline` seconds after its first member arrived is released as partial if it has at least
  `min_group_size` members, and dropped otherwise. Members arriving after their group was
  released or dropped, and repeated trajectory ids, are dropped. Every drop is counted; dropped
  deliveries are returned so the trainer acks them like trained ones.

  Args:
    group_size: G when the trajectories do not say.
    min_group_size: the fewest members a partial group is trained with (default G).
    deadline: seconds a group may wait for its missing members.
    counters: where drops are counted (default: the assembler's own).
    clock: the time deadlines are measured by.
    remember: how many closed group ids are remembered to drop late members.

  Raises:
    ValueError: group_size < 1, min_group_size outside [1, group_size], or deadline < 0.
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
    """Adds deliveries to their groups (late members and repeated ids are dropped)."""
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
    """Releases the groups that are complete or past their deadline.

    Returns:
      (groups ready to train, deliveries dropped since the last call).
    """
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
  """Async admission control: drops whole groups sampled by too old a policy.

  Args:
    groups: ready groups.
    policy_version: the trainer's current policy version.
    max_staleness: versions a group's oldest token may lag behind `policy_version`.
    counters: where drops are counted, if anywhere.

  Returns:
    (fresh groups, dropped deliveries).

  Raises:
    ValueError: max_staleness < 0.
  """
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
