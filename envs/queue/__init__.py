"""The rollout queue: trajectories from rollout workers to the trainer (at-least-once, consumed
once) and task leases from the queue to the workers.

    base.py           the contract (`RolloutQueue`), `Delivery`, `TaskLease`, counters, checks
    memory.py         `InMemoryQueue`: one process (tests, in-process rollouts)
    redis_streams.py  `RedisQueue`: Redis Streams, for workers on other machines
    assembly.py       the trainer's side: `GroupAssembler`, `drop_stale`, `filter_unseen`
"""

from __future__ import annotations

from typing import Optional

from envs.net import read_secret
from envs.queue.assembly import Group, GroupAssembler, drop_stale, filter_unseen
from envs.queue.base import (DROPS, Counters, Delivery, RolloutQueue, TaskLease,
                             check_claim_timeout, default_worker_id, task_order)
from envs.queue.memory import InMemoryQueue
from envs.queue.redis_streams import RedisQueue

__all__ = ["DROPS", "Counters", "Delivery", "Group", "GroupAssembler", "InMemoryQueue",
           "RedisQueue", "RolloutQueue", "TaskLease", "check_claim_timeout", "default_worker_id",
           "drop_stale", "filter_unseen", "make_queue", "task_order"]


def make_queue(url: Optional[str] = None, *, password_file: Optional[str] = None,
               **kwargs) -> RolloutQueue:
  """The queue at `url`.

  Args:
    url: None, "" or "memory" for an `InMemoryQueue`; `redis://` / `rediss://` for a
      `RedisQueue` (Redis-only keyword arguments are ignored for memory).
    password_file: a file holding the Redis password (keeps it off command lines and out of
      `ps`); the password may also come from the URL or `password=`.
    **kwargs: the backend's keyword arguments (consumer, claim_timeout, prefix, ...).

  Returns:
    The queue handle.
  """
  if url in (None, "", "memory"):
    for redis_only in ("password", "ca_file", "prefix", "group"):
      kwargs.pop(redis_only, None)
    return InMemoryQueue(**kwargs)
  if password_file:
    kwargs["password"] = read_secret(password_file)
  return RedisQueue(url, **kwargs)
