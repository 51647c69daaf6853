"""Rollout worker: leases tasks from the rollout queue, runs G episodes per task, puts the group.

    python -m envs.rollout_worker --policy_url http://127.0.0.1:8000 \\
        --queue redis://127.0.0.1:6379 --queue_password_file pw --tasks tasks.jsonl \\
        --group_size 8 --concurrency 16 --sandbox bwrap --tokenizer tok.model --chat chatml

One asyncio loop drives everything. `ceil(concurrency / group_size)` task slots each repeat:
wait while `max_backlog` or more trajectories wait unread in the queue (backpressure); lease a
draw (`envs.queue`); run its G episodes, at most `concurrency` at a time across the worker
(`run_task_group`, or with `--rollout branching` one entropy-guided tree of G leaves,
`envs.branching`); then `complete_task` puts the group and ends the lease in one atomic step.
Leases are renewed every ttl/3 while episodes run, so a live worker keeps its draws however long
its episodes take, and a killed one (SIGKILL, lost VM) stops renewing: its draws are re-issued
to another worker after `lease_ttl`, and its late results, if any, are refused.

SIGTERM / SIGINT: lease nothing new, let running groups finish for `grace` seconds and deliver
them; when the grace runs out, cancel the remaining episodes and deliver the finished ones of
each group (a partial group, which the trainer's group rule completes or drops); a group with
nothing finished is released for immediate re-issue. Then exit 0.

Tasks without an `environment` get one as the trainer gives them (`envs.task_environments`):
`--env_from` for SWE rows, `--default_environment` for the others.

Workers run Arbor's react scaffold. Black-box scaffolds (`envs.scaffolds`: mini-swe-agent,
Claude Code, ...) run in the trainer's process for now, through its own gateway (`rl.scaffold`
with `rl.rollout_workers="inprocess"`; a config combining a black-box `rl.scaffold` with
"queue" is refused at start-up), and a task file whose rows name a black-box "scaffold" is
refused here (exit status 2) rather than run with react.

The in-process entry point (`RolloutWorker(...).run()`, e.g. from the trainer with an
`InMemoryQueue` and an engine-backed `Policy`) is the same code as the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import logging
import math
import signal
import threading
import time
from typing import Any, Optional, Sequence

from envs.chat import load_chat, load_tokenizer, make_chat
from envs.branching import add_branch_flags, branch_config_from_flags, make_branching_group
from envs.episode import (EpisodeFn, GroupFn, independent_groups, load_task_file,
                          make_react_episode, make_sandbox_factory)
from envs.net import read_secret
from envs.policy import HTTPPolicy
from envs.queue import RolloutQueue, TaskLease, default_worker_id, make_queue, task_order
from envs import task_environments
from envs.scaffold import add_scaffold_flags, scaffold_config_from_flags
from envs.tasks import Task
from envs.trajectory import Trajectory
from envs.verifiers.cache import VerdictCache

log = logging.getLogger(__name__)


def tasks_fingerprint(tasks: Sequence[Task], seed: int) -> str:
  """Identifies what a draw number means: the task ids in order and the seed.

  Workers sharing a queue must agree on it (`RolloutQueue.check_task_source`).

  Args:
    tasks: the worker's task list.
    seed: the worker's seed (task order per epoch).

  Returns:
    16 hex digits.
  """
  body = json.dumps({"ids": [t.instance_id for t in tasks], "seed": seed})
  return hashlib.sha256(body.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
  """How a worker paces itself. Validated by `check()`."""

  group_size: int = 8                # episodes per task draw (G)
  concurrency: int = 8               # episodes in flight across the worker
  lease_ttl: float = 120.0           # seconds a lease lives without renewal (renewed every ttl/3)
  max_backlog: int = 1024            # lease nothing while this many trajectories wait unread
  max_draws: Optional[int] = None    # stop once this many draws are done (None: run until stopped)
  grace: float = 30.0                # after SIGTERM, seconds for running groups to finish
  poll: float = 1.0                  # seconds between backpressure / lease polls
  queue_patience: float = 300.0      # seconds a queue call is retried before the worker gives up
  seed: int = 0                      # task order per epoch and per-episode seeds

  def check(self) -> "WorkerConfig":
    """Validates the fields.

    Returns:
      self.

    Raises:
      ValueError: naming the first bad field.
    """
    for name in ("group_size", "concurrency", "max_backlog"):
      if getattr(self, name) < 1:
        raise ValueError(f"WorkerConfig.{name}={getattr(self, name)}: must be >= 1")
    for name in ("lease_ttl", "poll", "queue_patience"):
      if not getattr(self, name) > 0:
        raise ValueError(f"WorkerConfig.{name}={getattr(self, name)}: must be > 0 seconds")
    if self.grace < 0:
      raise ValueError(f"WorkerConfig.grace={self.grace}: must be >= 0 seconds")
    if self.max_draws is not None and self.max_draws < 0:
      raise ValueError(f"WorkerConfig.max_draws={self.max_draws}: must be >= 0 or None")
    return self


class RolloutWorker:
  """Leases draws, runs G episodes per draw and completes each draw with its group.

  See the module docstring for the loop, the leases and the graceful stop.

  Args:
    queue: the rollout queue (its task leases and its trajectory stream).
    tasks: the task list; draw d is `task_for(d)`.
    episode: the episode function (`envs.episode.make_react_episode`, or a fake in tests).
    group_fn: samples a draw's group instead of G independent `episode`s (tree rollouts:
      `envs.branching.make_branching_group`); None: `independent_groups(episode)`.
    config: pacing (group size, concurrency, leases, backpressure, grace).
    worker_id: the name in leases and logs (default host-pid-random).

  Raises:
    ValueError: no tasks, or a bad config field.
  """

  def __init__(self, queue: RolloutQueue, tasks: Sequence[Task], episode: EpisodeFn,
               config: WorkerConfig = WorkerConfig(), worker_id: Optional[str] = None,
               group_fn: Optional[GroupFn] = None):
    if not tasks:
      raise ValueError("tasks: the worker needs at least one task")
    self.queue, self.tasks, self.episode = queue, list(tasks), episode
    self.group_fn = group_fn or independent_groups(episode)
    self.config = config.check()
    self.worker_id = worker_id or default_worker_id()
    self.counters: dict[str, float] = {}
    self._stopping: Optional[asyncio.Event] = None
    self._held: dict[int, tuple[TaskLease, asyncio.Event]] = {}  # draw -> (lease, abort)
    self._orders: dict[int, Any] = {}

  def _count(self, name: str, n: float = 1) -> None:
    self.counters[name] = self.counters.get(name, 0) + n

  def task_for(self, draw: int) -> Task:
    """The task of a draw.

    Draw d is task `task_order(T, d // T)[d % T]`: epoch by epoch, shuffled per epoch.

    Args:
      draw: the draw number.

    Returns:
      The task.
    """
    n = len(self.tasks)
    epoch = draw // n
    if epoch not in self._orders:
      self._orders = {epoch: task_order(n, epoch, self.config.seed)}  # one epoch at a time
    return self.tasks[int(self._orders[epoch][draw % n])]

  def stop(self) -> None:
    """Graceful stop: lease nothing new; running groups get `grace` seconds, then are cut."""
    if self._stopping is None or self._stopping.is_set():
      return
    log.info("worker %s stopping: %d group(s) running, %.0fs grace", self.worker_id,
             len(self._held), self.config.grace)
    self._stopping.set()
    asyncio.get_running_loop().call_later(self.config.grace, self._abort_all)

  def _abort_all(self) -> None:
    for _, abort in self._held.values():
      abort.set()

  async def _call(self, fn, *args):
    """A queue call, off the event loop (it blocks on the network), retried with backoff for
    up to `queue_patience` seconds so that a Redis restart or failover does not kill the worker
    (errors in our own arguments are not retried)."""
    deadline, delay = time.monotonic() + self.config.queue_patience, 0.5
    while True:
      try:
        return await asyncio.to_thread(fn, *args)
      except (ValueError, TypeError, PermissionError):
        raise
      except Exception as e:
        if time.monotonic() + delay > deadline:
          raise
        log.warning("queue %s failed (%r); retrying in %.1fs", fn.__name__, e, delay)
        self._count("queue_errors")
        await asyncio.sleep(delay)
        delay = min(2 * delay, 5.0)

  async def _sleep(self, seconds: float) -> None:
    """Sleep, waking early on stop."""
    try:
      await asyncio.wait_for(self._stopping.wait(), seconds)
    except asyncio.TimeoutError:
      pass

  async def _renew_loop(self) -> None:
    """Renew held leases every ttl/3; a lease lost (we were presumed dead) aborts its group."""
    while True:
      await asyncio.sleep(self.config.lease_ttl / 3)
      for lease, abort in list(self._held.values()):
        try:
          ok = await asyncio.to_thread(self.queue.renew_task, lease, self.config.lease_ttl)
        except Exception as e:  # a queue hiccup: the next round retries, expiry is the backstop
          log.warning("renewing draw %d failed: %r", lease.draw, e)
          continue
        if not ok:
          log.warning("lease of draw %d was re-issued elsewhere: aborting its episodes",
                      lease.draw)
          abort.set()

  async def _backpressure(self) -> bool:
    """Wait while the queue is full; False if stopped meanwhile."""
    waited = False
    while not self._stopping.is_set():
      # unread only: entries the trainer took stay pending until its next checkpoint acks
      # them, and counting those would stall workers for a whole checkpoint interval
      backlog = await self._call(self.queue.unread)
      if backlog < self.config.max_backlog:
        return True
      if not waited:
        log.info("queue: %d trajectories unread >= max_backlog %d: waiting", backlog,
                 self.config.max_backlog)
        self._count("backpressure_waits")
        waited = True
      start = time.monotonic()
      await self._sleep(self.config.poll)
      self._count("backpressure_seconds", time.monotonic() - start)
    return False

  async def _slot(self, limiter: asyncio.Semaphore) -> None:
    cfg = self.config
    while not self._stopping.is_set():
      if not await self._backpressure():
        return
      lease = await self._call(self.queue.lease_task, self.worker_id, cfg.lease_ttl,
                               cfg.max_draws)
      if lease is None:  # every draw is out; finished once nobody holds one (else one may expire)
        if (await self._call(self.queue.task_status))["open"] == 0:
          return
        await self._sleep(cfg.poll)
        continue
      if self._stopping.is_set():  # stopped while we asked: hand it straight back
        await self._call(self.queue.release_task, lease)
        return
      if lease.deliveries > 1:
        self._count("leases_reissued")
      abort = asyncio.Event()
      self._held[lease.draw] = (lease, abort)
      try:
        group = await self.group_fn(self.task_for(lease.draw), cfg.group_size,
                                    draw=lease.draw, seed=cfg.seed, limiter=limiter,
                                    abort=abort, counters=self.counters)
      finally:
        del self._held[lease.draw]
      await self._finish(lease, group)

  async def _finish(self, lease: TaskLease, group: list[Trajectory]) -> None:
    if not group:
      released = await self._call(self.queue.release_task, lease)
      self._count("groups_released" if released else "groups_lost_lease")
      return
    if await self._call(self.queue.complete_task, lease, group):
      self._count("groups_done")
      self._count("trajectories_put", len(group))
      if len(group) < self.config.group_size:
        self._count("groups_partial")
    else:
      self._count("groups_lost_lease")

  async def run(self, handle_signals: bool = False) -> dict[str, float]:
    """Works until stopped or until `max_draws` are done.

    Args:
      handle_signals: SIGTERM / SIGINT stop the worker gracefully (as `stop()` does).

    Returns:
      The worker's counters (groups_done, trajectories_put, episodes_failed, ...).
    """
    self._stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    if handle_signals:
      for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, self.stop)
    fingerprint = tasks_fingerprint(self.tasks, self.config.seed)
    await self._call(self.queue.check_task_source, fingerprint)
    limiter = asyncio.Semaphore(self.config.concurrency)
    n_slots = math.ceil(self.config.concurrency / self.config.group_size)
    log.info("worker %s: %d tasks (fingerprint %s), %d slot(s) of %d episodes", self.worker_id,
             len(self.tasks), fingerprint, n_slots, self.config.group_size)
    renew = asyncio.ensure_future(self._renew_loop())
    try:
      await asyncio.gather(*(self._slot(limiter) for _ in range(n_slots)))
    finally:
      renew.cancel()
      if handle_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
          loop.remove_signal_handler(sig)
    log.info("worker %s done: %s", self.worker_id, self.counters)
    return dict(self.counters)


class WorkerThread:
  """A RolloutWorker on its own event loop in a daemon thread.

  This is the trainer's in-process mode (with an InMemoryQueue, or Redis), while the trainer's
  own thread stays synchronous.

      thread = WorkerThread(RolloutWorker(queue, tasks, episode, config)).start()
      ... queue.get_batch(...) in the trainer loop ...
      stats = thread.stop()   # graceful: finished trajectories are still delivered

  Args:
    worker: the worker to run.
  """

  def __init__(self, worker: RolloutWorker):
    self.worker = worker
    self.stats: Optional[dict] = None
    self.error: Optional[BaseException] = None
    self._loop: Optional[asyncio.AbstractEventLoop] = None
    self._ready = threading.Event()
    self._thread = threading.Thread(target=self._main, name="rollout-worker", daemon=True)

  def _main(self) -> None:
    async def main():
      self._loop = asyncio.get_running_loop()
      self._ready.set()
      return await self.worker.run()
    try:
      self.stats = asyncio.run(main())
    except BaseException as e:  # surfaced by stop()
      self.error = e
    finally:
      self._ready.set()

  def start(self) -> "WorkerThread":
    """Starts the worker's thread; returns self once its event loop runs."""
    self._thread.start()
    self._ready.wait()
    return self

  def stop(self, timeout: Optional[float] = None) -> Optional[dict]:
    """Stops the worker gracefully (as SIGTERM would) and waits for its thread.

    Args:
      timeout: seconds to wait (None: until it has finished).

    Returns:
      The worker's counters (None if it has not finished).

    Raises:
      RuntimeError: the worker failed.
    """
    loop = self._loop
    if loop is not None and self._thread.is_alive():
      try:
        loop.call_soon_threadsafe(self.worker.stop)
      except RuntimeError:  # the loop just closed: the worker finished on its own
        pass
    self._thread.join(timeout)
    if self.error is not None:
      raise RuntimeError(f"rollout worker failed: {self.error!r}") from self.error
    return self.stats


# --------------------------------------------------------------------------------------------
# Command line.


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  """The worker's command line (see `python -m envs.rollout_worker --help`).

  Args:
    argv: the arguments (default: sys.argv[1:]).

  Returns:
    The parsed flags.
  """
  p = argparse.ArgumentParser(prog="python -m envs.rollout_worker", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  a = p.add_argument
  a("--policy_url", required=True, help="policy server, e.g. http://127.0.0.1:8000")
  a("--policy_token_file", help="file holding the policy server's bearer token")
  a("--queue", required=True, help="redis://HOST:PORT or rediss://HOST:PORT")
  a("--queue_password_file", help="file holding the Redis password (AUTH)")
  a("--queue_ca_file", help="CA certificate for a rediss:// server")
  a("--queue_prefix", default="arbor", help="key prefix of the queue (one per run)")
  a("--tasks", required=True, help="task JSONL (SWE or problem format) or SWE Parquet; bad "
    "lines are skipped")
  a("--swe_mirror", default="", help="directory of git mirrors SWE rows check out from "
    "(default: $ARBOR_SWE_MIRROR)")
  a("--swe_cache", default="", help="where their checkouts go (default: $ARBOR_SWE_CACHE)")
  a("--env_from", choices=task_environments.ENV_FROM, default="none",
    help="where SWE rows without an `environment` get one (envs.task_environments)")
  a("--default_environment", default="", help="the environment of every other task without "
    "one: '' (none), a preset (bookworm-pytest) or a .json / .toml spec file")
  a("--group_size", type=int, default=8, help="episodes per task draw (G)")
  a("--concurrency", type=int, default=8, help="episodes in flight")
  a("--sandbox", choices=("remote", "bwrap", "local"), default="bwrap",
    help="where episodes run; local = no isolation, refused without --allow_unsafe_sandbox")
  a("--sandbox_url", help="sandbox server URL (--sandbox remote)")
  a("--token_file", help="file holding the sandbox server's token (--sandbox remote)")
  a("--sandbox_cafile", help="CA certificate of an https sandbox server")
  a("--allow_unsafe_sandbox", action="store_true", help="permit --sandbox local")
  a("--tokenizer", required=True, help="tokenizer.json / tiktoken / sentencepiece (file or dir)")
  a("--chat", default="chatml", help="chat format: template (the tokenizer directory's own "
    "Jinja chat template) | chatml | qwen2.5 | deepseek_v3 | plain")
  add_scaffold_flags(p)
  a("--rollout", choices=("independent", "branching"), default="independent",
    help="a draw's group: G independent episodes, or one entropy-guided tree of G leaves")
  add_branch_flags(p)
  a("--partial_credit", action="store_true", help="reward = fraction of tests passing")
  a("--cache_verdicts", action=argparse.BooleanOptionalAction, default=True,
    help="grade each distinct submission once: identical final workspaces of a task share "
    "one test run (envs.verifiers.cache)")
  a("--lease_ttl", type=float, default=120.0, help="seconds a lease lives without renewal")
  a("--max_backlog", type=int, default=1024,
    help="wait while this many trajectories wait unread in the queue")
  a("--epochs", type=int, default=0, help="passes over the tasks (0: until stopped)")
  a("--grace", type=float, default=30.0, help="seconds to finish running groups after SIGTERM")
  a("--seed", type=int, default=0, help="task order and sampling seeds")
  a("--worker_id", help="name in leases and logs (default host-pid-random)")
  return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs a worker until it is stopped or its epochs are done; prints its counters as JSON.

  Args:
    argv: the arguments (default: sys.argv[1:]).

  Returns:
    The exit status: 0, or 2 when the task file holds no valid task or a task names a
    black-box scaffold.
  """
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  args = parse_args(argv)
  if not args.queue.startswith(("redis://", "rediss://")):
    raise SystemExit(f"--queue={args.queue!r}: expected redis:// or rediss:// (a worker process "
                     "cannot share an in-memory queue)")

  tasks, bad = load_task_file(args.tasks, mirror=args.swe_mirror or None,
                              cache_dir=args.swe_cache or None)
  try:
    tasks = task_environments.with_environments(
        tasks, args.env_from,
        task_environments.default_environment(args.default_environment, "--default_environment"))
  except ValueError as e:
    log.error("%s: %s", args.tasks, e)
    return 2
  if bad:
    log.warning("%s: %d bad task line(s) skipped", args.tasks, bad)
  if not tasks:
    log.error("%s: no valid task", args.tasks)
    return 2
  boxed = [(t.instance_id, t.metadata.get("scaffold")) for t in tasks
           if t.metadata.get("scaffold") not in (None, "", "react")]
  if boxed:
    log.error("%s: task %r has scaffold=%r: rollout workers run the react scaffold only; run "
              "black-box scaffolds in the trainer (rl.scaffold, rl.rollout_workers="
              "'inprocess')", args.tasks, *boxed[0])
    return 2
  tokenizer = load_tokenizer(args.tokenizer)
  if args.chat == "template":
    chat = load_chat(args.tokenizer, tokenizer)
  else:
    chat = make_chat(args.chat, tokenizer)
  token = read_secret(args.policy_token_file) if args.policy_token_file else None
  policy = HTTPPolicy(args.policy_url, token=token)
  make_sandbox = make_sandbox_factory(args.sandbox, url=args.sandbox_url,
                                      token_file=args.token_file, cafile=args.sandbox_cafile,
                                      allow_unsafe=args.allow_unsafe_sandbox)
  scaffold = scaffold_config_from_flags(args)
  verdicts = VerdictCache() if args.cache_verdicts else None
  episode = make_react_episode(policy, chat, make_sandbox, scaffold,
                               partial_credit=args.partial_credit, verdict_cache=verdicts)
  group_fn = None
  if args.rollout == "branching":
    group_fn = make_branching_group(policy, chat, make_sandbox, scaffold,
                                    branch_config_from_flags(args),
                                    partial_credit=args.partial_credit, verdict_cache=verdicts)
  config = WorkerConfig(group_size=args.group_size, concurrency=args.concurrency,
                        lease_ttl=args.lease_ttl, max_backlog=args.max_backlog,
                        max_draws=args.epochs * len(tasks) if args.epochs else None,
                        grace=args.grace, seed=args.seed)
  queue = make_queue(args.queue, password_file=args.queue_password_file,
                     ca_file=args.queue_ca_file, prefix=args.queue_prefix)
  worker = RolloutWorker(queue, tasks, episode, config, worker_id=args.worker_id,
                         group_fn=group_fn)
  stats = asyncio.run(worker.run(handle_signals=True))
  stats["bad_task_lines"] = bad
  print(json.dumps({"worker": worker.worker_id, **stats}), flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
