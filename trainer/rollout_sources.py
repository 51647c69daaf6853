"""Where the RL loop's groups come from: this process's rollouts, or remote rollout workers.

    source = make_source(config, engine, chat, scaffold, tasks, consumed, restored_extra, ckpt)
    groups, step_tasks, counts = source.take(step, policy_version)
    source.consumed(trained_groups, dropped_groups)     # after the step
    extra = source.checkpoint_extra()                   # stored with the checkpoint
    source.close()

`rl.rollout_workers`:
  "inprocess"  `InProcessSource`: episodes sampled here (trainer.rollouts, the engine in this
               process), `lookahead` steps ahead in the async loop; each task runs the
               scaffold `rl.scaffold` draws for it (react, or a black-box CLI whose calls go
               through a loopback gateway over the same engine: trainer.blackbox);
  "queue"      `QueueSource`: this engine behind a policy server (trainer.serve) for rollout
               workers (`python -m envs.rollout_worker`, launch/fleet.py), whose groups arrive
               through the rollout queue (envs.queue). A delivery is acknowledged only after
               the checkpoint that covers its step (`Checkpointer.on_saved`); a re-delivered
               trajectory that checkpoint already consumed is acknowledged without training.
"""

from __future__ import annotations

import collections
import os
import time

from envs.queue import GroupAssembler, drop_stale, filter_unseen, make_queue
from trainer import metrics
from trainer.rollouts import Rollouts, branch_config
from trainer.serve import PolicyServer, ServerConfig
from trainer.tasks import TaskSource


class InProcessSource:
  """Groups sampled in this process (trainer.rollouts), `lookahead` steps ahead (async).

  Step s's groups are draw s of each of the step's tasks: a rerun samples them alike.

  Args:
    rollouts: samples the groups.
    tasks: the run's TaskSource (`for_step`).
    group_size: G, episodes per task.
    seed: the run's seed (with the step, it fixes each episode's sampling).
    lookahead: steps sampled ahead of the one taken (0: the sync loop).
    last_step: the last step of the run (nothing is sampled beyond it).
  """

  def __init__(self, rollouts: Rollouts, tasks: TaskSource, group_size: int, seed: int,
               lookahead: int, last_step: int):
    self.rollouts, self.tasks, self.group_size, self.seed = rollouts, tasks, group_size, seed
    self.lookahead, self.last_step = lookahead, last_step
    self._pending: collections.deque = collections.deque()  # (step, tasks, future)

  def _submit(self, step: int) -> None:
    tasks = self.tasks.for_step(step)
    self._pending.append((step, tasks, self.rollouts.groups(
        [(t, step) for t in tasks], self.group_size, seed=self.seed)))

  def take(self, step: int, version: int) -> tuple[list[list], list, dict]:
    """Returns the groups of `step`, sampling it (and the lookahead) if not yet submitted.

    Args:
      step: the training step.
      version: the policy version (unused: the loop filters in-process groups for staleness).

    Returns:
      (groups, their tasks, drop counts); the counts are always {} here.
    """
    del version  # in-process groups are filtered for staleness by the loop
    while not self._pending or self._pending[-1][0] < min(step + self.lookahead, self.last_step):
      self._submit(self._pending[-1][0] + 1 if self._pending else step)
    _, tasks, future = self._pending.popleft()
    return future.result(), tasks, {}

  def consumed(self, groups: list[list], dropped: list[list]) -> None:
    """Does nothing: in-process groups need no acknowledgement.

    Args:
      groups: the trained groups.
      dropped: the filtered groups.
    """

  def checkpoint_extra(self) -> dict:
    """Returns {}: in-process sampling stores nothing with the checkpoint."""
    return {}

  def close(self) -> None:
    """Closes the rollouts: cancels running episodes, stops their loop and the engine."""
    self.rollouts.close()


class QueueSource:
  """Groups from the rollout queue (see the module docstring).

  The queue is filled by rollout workers that sample from this trainer's policy server.

  Args:
    queue: the RolloutQueue.
    group_size: G.
    prompts: groups per step.
    seen: ids of trajectories already trained or dropped (the checkpoint's consumed ids).
    max_staleness: a group more than this many policy versions behind is dropped.
    deadline: seconds an incomplete group waits for its last members.
    unacked: entry ids consumed but not yet covered by a checkpoint.
    server: the policy server (stopped by `close`).
  """

  def __init__(self, queue, group_size: int, prompts: int, seen: set, max_staleness: int,
               deadline: float, unacked: list, server=None):
    self.queue, self.group_size, self.prompts, self.seen = queue, group_size, prompts, seen
    self.max_staleness, self.server = max_staleness, server
    self.assembler = GroupAssembler(group_size, deadline=deadline)
    self.unacked: list[str] = list(unacked)  # trained or dropped, waiting for a checkpoint
    self._entries: dict[str, str] = {}  # trajectory id -> entry id (taken, not yet consumed)
    self._ready: list[list] = []  # whole groups assembled beyond a step's need

  def take(self, step: int, version: int) -> tuple[list[list], list, dict]:
    """Returns exactly `prompts` groups from the queue (any beyond wait for the next step).

    Blocks until enough whole, fresh groups arrived; logs every 60 s while waiting.

    Args:
      step: the training step (for the waiting message).
      version: the trainer's policy version; older groups beyond `max_staleness` are dropped.

    Returns:
      (groups, [] (tasks are not known here), drop counts: "dropped/duplicates",
      "dropped/partial_trajectories", "dropped/stale_trajectories").
    """
    ready, counts, waited = self._ready, collections.Counter(), time.monotonic()
    while len(ready) < self.prompts:
      # take only what this step lacks: the rest stays unread in the queue, where the workers'
      # backpressure (max_backlog) sees it
      need = (self.prompts - len(ready)) * self.group_size - self.assembler.waiting
      fresh, dup = filter_unseen(self.queue.get_batch(min(64, max(need, 1)), timeout=1.0),
                                 self.seen)
      self.unacked += [d.entry_id for d in dup]
      counts["dropped/duplicates"] += len(dup)
      self.assembler.add(fresh)
      groups, dropped = self.assembler.pop_ready()
      groups, stale = drop_stale(groups, version, self.max_staleness)
      for d in dropped + stale:
        self.seen.add(d.trajectory.trajectory_id)
        self.unacked.append(d.entry_id)
      counts["dropped/partial_trajectories"] += len(dropped)
      counts["dropped/stale_trajectories"] += len(stale)
      for g in groups:
        self._entries.update((d.trajectory.trajectory_id, d.entry_id) for d in g.deliveries)
      ready += [g.trajectories for g in groups]
      if time.monotonic() - waited > 60:
        metrics.say("rl", f"step {step}: waiting for rollout workers ({len(ready)}/"
                    f"{self.prompts} groups, {self.assembler.waiting} trajectories in open "
                    "groups)")
        waited = time.monotonic()
    ready, self._ready = ready[:self.prompts], ready[self.prompts:]
    return ready, [], dict(counts)

  def consumed(self, groups: list[list], dropped: list[list]) -> None:
    """Records the trajectories of trained and filtered groups, acked after the next checkpoint.

    Args:
      groups: the trained groups.
      dropped: the groups the loop filtered out.
    """
    for g in groups + dropped:
      for t in g:
        self.unacked.append(self._entries.pop(t.trajectory_id))

  def checkpoint_extra(self) -> dict:
    """Returns {"unacked_entry_ids": ...} to store with the checkpoint, and starts a new list."""
    extra = {"unacked_entry_ids": self.unacked}
    self.unacked = []
    return extra

  def close(self) -> None:
    """Stops the policy server (if any) and closes the queue."""
    if self.server is not None:
      self.server.stop()
    self.queue.close()


def make_source(config, engine, chat, scaffold, tasks: TaskSource, consumed: set,
                restored_extra: dict, ckpt):
  """Builds the rollout source of `config.rl.rollout_workers` (see the module docstring).

  Args:
    config: the run's config.
    engine: the generation engine (in-process sampling, or behind the policy server).
    chat: the chat format episodes render with.
    scaffold: the episodes' ScaffoldConfig (`trainer.rollouts.scaffold_config`).
    tasks: the run's TaskSource.
    consumed: ids of the trajectories already trained (shared with the loop).
    restored_extra: the restored checkpoint's extra ({} for a fresh run).
    ckpt: the run's Checkpointer (queue entries are acked when a save commits).

  Returns:
    An InProcessSource ("inprocess") or a QueueSource ("queue", whose policy server is started
    in a thread).
  """
  rl = config.rl
  if rl.rollout_workers == "inprocess":
    lookahead = max(1, rl.max_staleness // max(1, rl.minibatches)) if rl.loop == "async" else 0
    return InProcessSource(Rollouts(engine, chat, scaffold, sandbox=rl.sandbox,
                                    concurrency=rl.concurrency, sandbox_url=rl.sandbox_url,
                                    sandbox_token_file=rl.sandbox_token_file,
                                    branch=branch_config(config),
                                    scaffolds=rl.get("scaffold", "react"),
                                    scaffold_seed=config.seed,
                                    served_name=config.serve.served_name,
                                    cache_verdicts=rl.cache_verdicts),
                           tasks, rl.group_size, config.seed, lookahead, config.train.steps)
  queue = make_queue(rl.queue_url, password_file=rl.queue_password_file or None)
  queue.ack(restored_extra.get("unacked_entry_ids", ()))  # trained and checkpointed, not acked
  ckpt.on_saved(lambda step, extra: queue.ack(extra.get("unacked_entry_ids", ())))
  server = PolicyServer(engine, ServerConfig(
      host=config.serve.host, port=config.serve.port,
      token=os.environ.get("ARBOR_SERVE_TOKEN") or None), tokenizer=chat.tokenizer, chat=chat)
  url = server.start_in_thread()
  metrics.say("rl", f"policy server for rollout workers on {url}; queue {rl.queue_url}")
  # remote workers sample while the trainer trains, whatever rl.loop says: admission control by
  # rl.max_staleness (validated >= 1 for the queue)
  return QueueSource(queue, rl.group_size, rl.prompts_per_step, consumed, rl.max_staleness,
                     deadline=rl.group_deadline_s, unacked=[], server=server)
