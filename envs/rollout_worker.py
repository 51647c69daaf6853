"""Rollout worker: leases tasks from the rollout queue, runs G episodes per task, puts the group.

    python -m envs.rollout_worker --policy_url http://127.0.0.1:8000 \\
        --queue redis://127.0.0.1:6379 --queue_password_file pw --tasks tasks.jsonl \\
        --group_size 8 --concurrency 16 --sandbox bwrap --tokenizer tok.model --chat chatml

One asyncio loop drives everything. `ceil(concurrency / group_size)` task slots each repeat:
wait while `max_backlog` or more trajectories wait unread in the queue (backpressure); lease a
draw (`envs.queue`); run its G episodes, at most `concurrency` at a time across the worker
(`run_task_group`); then `complete_task` puts the group and ends the lease in one atomic step.
Leases are renewed every ttl/3 while episodes run, so a live worker keeps its draws however long
its episodes take, and a killed one (SIGKILL, lost VM) stops renewing: its draws are re-issued
to another worker after `lease_ttl`, and its late results, if any, are refused.

SIGTERM / SIGINT: lease nothing new, let running groups finish for `grace` seconds and deliver
them; when the grace runs out, cancel the remaining episodes and deliver the finished ones of
each group (a partial group, which the trainer's group rule completes or drops); a group with
nothing finished is released for immediate re-issue. Then exit 0.

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
from typing import Any, Awaitable, Callable, Optional, Sequence

from envs.queue import RolloutQueue, TaskLease, default_worker_id, make_queue, task_order
from envs.trajectory import Trajectory

log = logging.getLogger(__name__)

# (task, index in group, seed) -> one finished episode. task_id / group_id are set by the worker.
EpisodeFn = Callable[[Any, int, int], Awaitable[Trajectory]]


def task_id_of(task: Any) -> str:
  """The id of a task: `envs.tasks.Task.instance_id`, or `id` / `task_id` of other objects."""
  for name in ("instance_id", "task_id", "id"):
    value = task.get(name) if isinstance(task, dict) else getattr(task, name, None)
    if value is not None:
      return str(value)
  raise ValueError(f"task {task!r:.100}: has no instance_id / task_id / id")


def tasks_fingerprint(tasks: Sequence[Any], seed: int) -> str:
  """Identifies (task ids in order, seed): what a draw number means. Workers sharing a queue
  must agree on it (`RolloutQueue.check_task_source`)."""
  body = json.dumps({"ids": [task_id_of(t) for t in tasks], "seed": seed})
  return hashlib.sha256(body.encode()).hexdigest()[:16]


def episode_seed(seed: int, draw: int, index: int) -> int:
  """A per-episode seed fixed by (worker seed, draw, index): reruns of a draw sample alike."""
  return int.from_bytes(hashlib.sha256(f"{seed}/{draw}/{index}".encode()).digest()[:4], "little")


async def run_task_group(task: Any, group_size: int, episode: EpisodeFn, *, draw: int = 0,
                         seed: int = 0, limiter: Optional[asyncio.Semaphore] = None,
                         abort: Optional[asyncio.Event] = None,
                         counters: Optional[dict] = None) -> list[Trajectory]:
  """Run `group_size` episodes of `task` concurrently and return the finished trajectories.

  Each episode holds one slot of `limiter` (the worker's concurrency) while it runs. An episode
  that raises is logged and left out. When `abort` is set, unfinished episodes are cancelled and
  the finished ones returned. Every trajectory gets `task_id`, `group_id = f"{task_id}/{draw}"`
  and `metadata` {group_size, draw, index}.
  """
  if group_size < 1:
    raise ValueError(f"group_size={group_size}: must be >= 1")
  task_id = task_id_of(task)
  counters = counters if counters is not None else {}

  async def one(index: int) -> Trajectory:
    if limiter is None:
      return await episode(task, index, episode_seed(seed, draw, index))
    async with limiter:
      return await episode(task, index, episode_seed(seed, draw, index))

  runs = [asyncio.ensure_future(one(i)) for i in range(group_size)]
  waiters = set(runs)
  abort_wait = asyncio.ensure_future(abort.wait()) if abort is not None else None
  try:
    while waiters:
      done, waiters = await asyncio.wait(
          waiters | ({abort_wait} if abort_wait else set()), return_when=asyncio.FIRST_COMPLETED)
      waiters.discard(abort_wait)
      if abort_wait in done:
        break
  finally:
    for run in runs:
      run.cancel()  # no-op for finished ones
    if abort_wait is not None:
      abort_wait.cancel()
    await asyncio.gather(*runs, return_exceptions=True)
  out = []
  for index, run in enumerate(runs):
    if run.cancelled():
      counters["episodes_cancelled"] = counters.get("episodes_cancelled", 0) + 1
      continue
    if run.exception() is not None:
      counters["episodes_failed"] = counters.get("episodes_failed", 0) + 1
      log.warning("episode %d of task %s (draw %d) failed: %r", index, task_id, draw,
                  run.exception())
      continue
    t = run.result()
    if not isinstance(t, Trajectory):
      counters["episodes_failed"] = counters.get("episodes_failed", 0) + 1
      log.warning("episode %d of task %s returned %r, not a Trajectory", index, task_id, type(t))
      continue
    t.task_id, t.group_id = task_id, f"{task_id}/{draw}"
    t.metadata = {**t.metadata, "group_size": group_size, "draw": draw, "index": index}
    out.append(t)
  return out


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
  """How a worker paces itself. Validated by `check()`; errors name the field."""

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
  """Leases draws from `queue`, runs `episode` G times per draw, completes the draw with the
  group. `run()` returns its counters when stopped (SIGTERM, `stop()`) or when `max_draws` are
  all done."""

  def __init__(self, queue: RolloutQueue, tasks: Sequence[Any], episode: EpisodeFn,
               config: WorkerConfig = WorkerConfig(), worker_id: Optional[str] = None):
    if not tasks:
      raise ValueError("tasks: the worker needs at least one task")
    self.queue, self.tasks, self.episode = queue, list(tasks), episode
    self.config = config.check()
    self.worker_id = worker_id or default_worker_id()
    self.counters: dict[str, float] = {}
    self._stopping: Optional[asyncio.Event] = None
    self._held: dict[int, tuple[TaskLease, asyncio.Event]] = {}  # draw -> (lease, abort)
    self._orders: dict[int, Any] = {}

  def _count(self, name: str, n: float = 1) -> None:
    self.counters[name] = self.counters.get(name, 0) + n

  def task_for(self, draw: int) -> Any:
    """Draw d is task `task_order(T, d // T)[d % T]`: epoch by epoch, shuffled per epoch."""
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
        group = await run_task_group(self.task_for(lease.draw), cfg.group_size, self.episode,
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
    """Work until stopped or until `max_draws` are done; returns the counters."""
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
  """A RolloutWorker on its own event loop in a daemon thread: the trainer's in-process mode
  (with an InMemoryQueue, or Redis), while the trainer's own thread stays synchronous.

      thread = WorkerThread(RolloutWorker(queue, tasks, episode, config)).start()
      ... queue.get_batch(...) in the trainer loop ...
      stats = thread.stop()   # graceful: finished trajectories are still delivered
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
    self._thread.start()
    self._ready.wait()
    return self

  def stop(self, timeout: Optional[float] = None) -> Optional[dict]:
    """Stop gracefully (as SIGTERM would) and wait; returns the worker's counters."""
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
# The real episode: react scaffold in a sandbox, verifier reward.


def make_sandbox_factory(backend: str, *, limits=None, url: Optional[str] = None,
                         token_file: Optional[str] = None, cafile: Optional[str] = None,
                         allow_unsafe: bool = False) -> Callable[[Any], Awaitable[Any]]:
  """`async make(task) -> Sandbox` for `backend` (remote | bwrap | local), used for the agent's
  sandbox and the verifier's fresh one. bwrap honours a task's `rootfs`."""
  from envs.sandbox import BACKENDS, create_sandbox
  from envs.sandbox.base import Limits

  if backend not in BACKENDS:
    raise ValueError(f"sandbox={backend!r}: expected one of {', '.join(BACKENDS)}")
  limits = limits or Limits()
  token = None
  if backend == "remote":
    if not url:
      raise ValueError("sandbox=remote needs sandbox_url")
    if not token_file:
      raise ValueError("sandbox=remote needs token_file (the sandbox server's token)")
    with open(token_file) as f:
      token = f.read().strip()

  async def make(task):
    if backend == "remote":
      return await create_sandbox("remote", limits=limits, url=url, token=token, cafile=cafile)
    if backend == "local":
      return await create_sandbox("local", limits=limits, allow_unsafe=allow_unsafe)
    if backend == "bwrap" and getattr(task, "rootfs", None):
      return await create_sandbox("bwrap", limits=limits, rootfs=task.rootfs)
    return await create_sandbox(backend, limits=limits)
  return make


def _jsonable(x: Any) -> Any:
  """Verifier details as plain JSON types (they travel in msgpack'd trajectory metadata)."""
  return json.loads(json.dumps(x, default=str))


def make_react_episode(policy, chat, make_sandbox: Callable[[Any], Awaitable[Any]],
                       config=None, *, partial_credit: bool = False,
                       judge_policy=None) -> EpisodeFn:
  """The episode function of a worker: a fresh sandbox holding the task's repository, the react
  scaffold (`envs.scaffold.run_episode`) with the default tools, then the task's verifier
  (`envs.verifiers.verify`) for the reward. Sampling seeds come from the episode seed. A sandbox
  failure during the episode or the verification gives termination "sandbox_error", reward 0;
  one at creation raises (the episode is left out of its group)."""
  import numpy as np

  from envs.sandbox.base import SandboxError
  from envs.scaffold import ScaffoldConfig, run_episode
  from envs.tasks import load_repo_files
  from envs.tools import default_tools
  from envs.verifiers import verify, workspace_files

  config = config or ScaffoldConfig()

  def render(text: str) -> list[int]:  # a judge's prompt
    return chat.render([{"role": "user", "content": text}], add_generation_prompt=True).ids

  async def submission(task, sandbox, result):
    if task.kind == "swe":
      return await workspace_files(sandbox)
    if result.answer is not None:
      return result.answer
    replies = [m.get("text", "") for m in result.messages if m.get("role") == "assistant"]
    return replies[-1] if replies else ""

  async def episode(task, index: int, seed: int) -> Trajectory:
    prompt = task.prompt(np.random.default_rng(seed))
    sandbox = await make_sandbox(task)
    reward, details = 0.0, {}
    try:
      if task.kind == "swe":
        for path, data in (await asyncio.to_thread(load_repo_files, task)).items():
          await sandbox.write_file(path, data)
      result = await run_episode(policy, sandbox, prompt, default_tools(task.test_command or None),
                                 chat, dataclasses.replace(config, seed=seed))
      if result.termination != "sandbox_error":
        try:
          verdict = await verify(task, await submission(task, sandbox, result),
                                 make_sandbox=make_sandbox, policy=judge_policy or policy,
                                 render=render, decode=chat.tokenizer.decode,
                                 partial=partial_credit)
          reward, details = float(verdict.reward), verdict.details
        except SandboxError as e:
          result.termination, result.error = "sandbox_error", f"verifier: {e}"
    finally:
      await sandbox.close()
    return result.to_trajectory(reward, task.instance_id, "", metadata={
        "verdict": _jsonable(details), "prompt": prompt[:200]})
  return episode


def load_task_file(path: str) -> tuple[list[Any], int]:
  """(tasks, number of bad lines): bad lines are logged with file:line and skipped."""
  from envs.tasks import load_tasks

  errors: list = []
  tasks = load_tasks(path, skip_bad=True, errors=errors)
  return tasks, len(errors)


# --------------------------------------------------------------------------------------------
# Command line.


def _read(path: Optional[str]) -> Optional[str]:
  if not path:
    return None
  with open(path) as f:
    return f.read().strip()


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m envs.rollout_worker", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  a = p.add_argument
  a("--policy_url", required=True, help="policy server, e.g. http://127.0.0.1:8000")
  a("--policy_token_file", help="file holding the policy server's bearer token")
  a("--queue", required=True, help="redis://HOST:PORT or rediss://HOST:PORT")
  a("--queue_password_file", help="file holding the Redis password (AUTH)")
  a("--queue_ca_file", help="CA certificate for a rediss:// server")
  a("--queue_prefix", default="arbor", help="key prefix of the queue (one per run)")
  a("--tasks", required=True, help="task JSONL (SWE or problem format); bad lines are skipped")
  a("--group_size", type=int, default=8, help="episodes per task draw (G)")
  a("--concurrency", type=int, default=8, help="episodes in flight")
  a("--sandbox", choices=("remote", "bwrap", "local"), default="bwrap",
    help="where episodes run; local = no isolation, refused without --allow_unsafe_sandbox")
  a("--sandbox_url", help="sandbox server URL (--sandbox remote)")
  a("--token_file", help="file holding the sandbox server's token (--sandbox remote)")
  a("--sandbox_cafile", help="CA certificate of an https sandbox server")
  a("--allow_unsafe_sandbox", action="store_true", help="permit --sandbox local")
  a("--tokenizer", required=True, help="tokenizer.json / tiktoken / sentencepiece (file or dir)")
  a("--chat", default="chatml", help="chat format: chatml | qwen2.5 | deepseek_v3 | plain")
  a("--max_turns", type=int, default=30, help="agent turns per episode")
  a("--max_new_tokens", type=int, default=2048, help="tokens sampled per policy call")
  a("--max_context_tokens", type=int, default=32768, help="input + output of one call")
  a("--episode_timeout", type=float, default=1800.0, help="wall-clock seconds per episode")
  a("--temperature", type=float, default=1.0, help="sampling temperature")
  a("--partial_credit", action="store_true", help="reward = fraction of tests passing")
  a("--lease_ttl", type=float, default=120.0, help="seconds a lease lives without renewal")
  a("--max_backlog", type=int, default=1024, help="wait while this many trajectories wait unread in the queue")
  a("--epochs", type=int, default=0, help="passes over the tasks (0: until stopped)")
  a("--grace", type=float, default=30.0, help="seconds to finish running groups after SIGTERM")
  a("--seed", type=int, default=0, help="task order and sampling seeds")
  a("--worker_id", help="name in leases and logs (default host-pid-random)")
  return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  args = parse_args(argv)
  if not args.queue.startswith(("redis://", "rediss://")):
    raise SystemExit(f"--queue={args.queue!r}: expected redis:// or rediss:// (a worker process "
                     "cannot share an in-memory queue)")
  from envs.chat import load_tokenizer, make_chat
  from envs.policy import HTTPPolicy
  from envs.scaffold import ScaffoldConfig

  tasks, bad = load_task_file(args.tasks)
  if bad:
    log.warning("%s: %d bad task line(s) skipped", args.tasks, bad)
  if not tasks:
    log.error("%s: no valid task", args.tasks)
    return 2
  chat = make_chat(args.chat, load_tokenizer(args.tokenizer))
  policy = HTTPPolicy(args.policy_url, token=_read(args.policy_token_file))
  make_sandbox = make_sandbox_factory(args.sandbox, url=args.sandbox_url,
                                      token_file=args.token_file, cafile=args.sandbox_cafile,
                                      allow_unsafe=args.allow_unsafe_sandbox)
  scaffold = ScaffoldConfig(max_turns=args.max_turns, max_new_tokens=args.max_new_tokens,
                            max_context_tokens=args.max_context_tokens,
                            timeout_s=args.episode_timeout, temperature=args.temperature)
  episode = make_react_episode(policy, chat, make_sandbox, scaffold,
                               partial_credit=args.partial_credit)
  config = WorkerConfig(group_size=args.group_size, concurrency=args.concurrency,
                        lease_ttl=args.lease_ttl, max_backlog=args.max_backlog,
                        max_draws=args.epochs * len(tasks) if args.epochs else None,
                        grace=args.grace, seed=args.seed)
  queue = make_queue(args.queue, password_file=args.queue_password_file,
                     ca_file=args.queue_ca_file, prefix=args.queue_prefix)
  worker = RolloutWorker(queue, tasks, episode, config, worker_id=args.worker_id)
  stats = asyncio.run(worker.run(handle_signals=True))
  stats["bad_task_lines"] = bad
  print(json.dumps({"worker": worker.worker_id, **stats}), flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
