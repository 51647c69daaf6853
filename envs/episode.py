"""Episodes in-process: one task's group of episodes, and the react episode that the rollout
worker process and the trainer's in-process rollouts both run.

    make_sandbox = make_sandbox_factory("bwrap")
    episode = make_react_episode(policy, chat, make_sandbox, ScaffoldConfig(max_turns=30))
    group = await run_task_group(task, group_size=8, episode=episode, draw=3, seed=0)

An episode function builds its trajectory with its final ids: `task_id` is the task's
`instance_id` and `group_id` the one it is given (`run_task_group` gives `f"{task_id}/{draw}"`
and records {group_size, draw, index} in the metadata); nothing is patched afterwards.
Sampling is reproducible: episode i of (task, draw) samples with `episode_seed(seed, draw, i)`
(its prompt phrasing and every call's sampling seed follow from it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import logging
import os
from typing import Any, Awaitable, Callable, Mapping, Optional, Protocol

import numpy as np

from envs.chat.formats import ChatFormat
from envs.environments import build as environment_build
from envs.net import read_secret
from envs.policy import Policy
from envs.sandbox import BACKENDS, Limits, Sandbox, SandboxError, create_sandbox
from envs.scaffold import EpisodeResult, ScaffoldConfig, run_episode
from envs.livecodebench import is_livecodebench_row, load_livecodebench_jsonl
from envs.tasks import Task, jsonl_records, load_repo_files, load_tasks
from envs.terminal_bench import load_terminal_bench
from envs.tools import default_tools
from envs.trajectory import Trajectory
from envs.verifiers import Verdict, verify, workspace_files
from envs.verifiers.cache import VerdictCache

log = logging.getLogger(__name__)

SandboxMaker = Callable[[Task], Awaitable[Sandbox]]
SETUP_TIMEOUT = 300.0  # seconds a "shell" task's set-up script may run


class EpisodeFn(Protocol):
  """Runs one episode of a task and returns its finished trajectory.

  Args:
    task: the task.
    index: the episode's place in its group.
    seed: the episode's sampling seed.
    group_id: the trajectory's group_id ("" for an episode outside a group).
    metadata: extra trajectory metadata from the caller (e.g. the group's size and draw).

  Returns:
    The trajectory, with task_id = task.instance_id and the given group_id.
  """

  def __call__(self, task: Task, index: int, seed: int, *, group_id: str = "",
               metadata: Optional[Mapping[str, Any]] = None) -> Awaitable[Trajectory]:
    ...


class GroupFn(Protocol):
  """Samples one task draw's group of trajectories (`independent_groups`, or the tree
  rollouts of `envs.branching.make_branching_group`).

  Args:
    task: the task.
    group_size: G, the trajectories to return.
    draw: the task draw (group_id `f"{task.instance_id}/{draw}"`).
    seed: the run's seed.
    limiter: bounds the episodes in flight (shared across groups), if given.
    abort: cuts the group short when set.
    counters: where failures and cancellations are counted (a plain dict).

  Returns:
    The finished trajectories (possibly fewer than G).
  """

  def __call__(self, task: Task, group_size: int, *, draw: int = 0, seed: int = 0,
               limiter: Optional[asyncio.Semaphore] = None,
               abort: Optional[asyncio.Event] = None,
               counters: Optional[dict] = None) -> Awaitable[list[Trajectory]]:
    ...


def independent_groups(episode: EpisodeFn) -> GroupFn:
  """The default group function: G independent episodes of `episode` (`run_task_group`)."""
  return functools.partial(run_task_group, episode=episode)


def episode_seed(seed: int, draw: int, index: int) -> int:
  """A per-episode seed fixed by (run seed, draw, index): reruns of a draw sample alike.

  Args:
    seed: the run's (or worker's) seed.
    draw: the task draw.
    index: the episode's place in its group.

  Returns:
    A 32-bit seed.
  """
  return int.from_bytes(hashlib.sha256(f"{seed}/{draw}/{index}".encode()).digest()[:4], "little")


async def run_task_group(task: Task, group_size: int, episode: EpisodeFn, *, draw: int = 0,
                         seed: int = 0, limiter: Optional[asyncio.Semaphore] = None,
                         abort: Optional[asyncio.Event] = None,
                         counters: Optional[dict] = None) -> list[Trajectory]:
  """Runs `group_size` episodes of `task` concurrently.

  Each episode holds one slot of `limiter` (the worker's concurrency) while it runs. An episode
  that raises, or returns anything but a trajectory of this task and group, is logged, counted
  ("episodes_failed") and left out. When `abort` is set, unfinished episodes are cancelled
  ("episodes_cancelled") and the finished ones returned.

  Args:
    task: the task.
    group_size: G, the episodes to run.
    episode: the episode function; episode i gets group_id `f"{task.instance_id}/{draw}"`,
      seed `episode_seed(seed, draw, i)` and metadata {group_size, draw, index}.
    draw: the task draw the group answers.
    seed: the run's seed.
    limiter: bounds the episodes in flight (shared across groups), if given.
    abort: cuts the group short when set.
    counters: where failures and cancellations are counted (a plain dict).

  Returns:
    The finished trajectories, in episode order (possibly fewer than G).

  Raises:
    ValueError: group_size < 1.
  """
  if group_size < 1:
    raise ValueError(f"group_size={group_size}: must be >= 1")
  task_id = task.instance_id
  group_id = f"{task_id}/{draw}"
  counters = counters if counters is not None else {}

  def start(index: int) -> Awaitable[Trajectory]:
    return episode(task, index, episode_seed(seed, draw, index), group_id=group_id,
                   metadata={"group_size": group_size, "draw": draw, "index": index})

  async def one(index: int) -> Trajectory:
    if limiter is None:
      return await start(index)
    async with limiter:
      return await start(index)

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
    if not isinstance(t, Trajectory) or (t.task_id, t.group_id) != (task_id, group_id):
      counters["episodes_failed"] = counters.get("episodes_failed", 0) + 1
      log.warning("episode %d of task %s returned %.200r, not a Trajectory of group %s", index,
                  task_id, t, group_id)
      continue
    out.append(t)
  return out


def make_sandbox_factory(backend: str, *, limits: Optional[Limits] = None,
                         url: Optional[str] = None, token_file: Optional[str] = None,
                         cafile: Optional[str] = None, allow_unsafe: bool = False) -> SandboxMaker:
  """The sandboxes of episodes: the agent's, and the verifier's fresh one.

  Args:
    backend: "remote" | "bwrap" | "local" (docker too, with its defaults).
    limits: per-sandbox limits (default `Limits()`).
    url: the sandbox server (remote).
    token_file: file holding the sandbox server's token (remote).
    cafile: CA certificate of an https sandbox server (remote).
    allow_unsafe: permits "local", which runs code without isolation.

  Returns:
    `async make(task) -> Sandbox`; a task's `environment` (`envs.environments`) comes first:
    bwrap starts from its root filesystem, docker from its image, built on first use; else
    bwrap honours a task's `rootfs`, docker its `image_name` (SWE-bench / SWE-smith rows name
    the prepared image of their repository). remote asks its server for the environment's image
    (`build.image_tag`, built and loaded on the fleet beforehand) or the row's `image_name`:
    a docker-backed server offers the images of its --image list; without either, the
    server's default.

  Raises:
    ValueError: an unknown backend, or remote without url or token_file.
  """
  if backend not in BACKENDS:
    raise ValueError(f"sandbox={backend!r}: expected one of {', '.join(BACKENDS)}")
  limits = limits or Limits()
  token = None
  if backend == "remote":
    if not url:
      raise ValueError("sandbox=remote needs sandbox_url")
    if not token_file:
      raise ValueError("sandbox=remote needs token_file (the sandbox server's token)")
    token = read_secret(token_file)

  async def make(task: Task) -> Sandbox:
    if backend == "remote":  # a docker-backed server offers environments and row images
      image = (environment_build.image_tag(task.environment)
               if getattr(task, "environment", None) is not None
               else getattr(task, "image_name", None))
      return await create_sandbox("remote", limits=limits, url=url, token=token, cafile=cafile,
                                  image=image)
    if backend == "local":
      return await create_sandbox("local", limits=limits, allow_unsafe=allow_unsafe)
    if backend in ("bwrap", "docker") and getattr(task, "environment", None) is not None:
      # the task's environment, built on first use (cached by its key afterwards)
      made = await asyncio.to_thread(environment_build.for_task, task, backend)
      kw = {"rootfs": made} if backend == "bwrap" else {"image": made}
      return await create_sandbox(backend, limits=limits, **kw)
    if backend == "bwrap" and task.rootfs:
      return await create_sandbox("bwrap", limits=limits, rootfs=task.rootfs)
    if backend == "docker" and getattr(task, "image_name", None):  # a SWE row's prepared image
      return await create_sandbox("docker", limits=limits, image=task.image_name)
    return await create_sandbox(backend, limits=limits)
  return make


def _jsonable(x: Any) -> Any:
  """Verifier details as plain JSON types (they travel in msgpack'd trajectory metadata)."""
  return json.loads(json.dumps(x, default=str))


async def _submission(task: Task, sandbox: Sandbox, result: EpisodeResult) -> Any:
  """What the verifier scores: the workspace (swe), the agent's sandbox itself (shell: the
  check runs in it), else the submitted answer or last reply."""
  if task.kind == "swe":
    return await workspace_files(sandbox)
  if task.kind == "shell":
    return sandbox
  if result.answer is not None:
    return result.answer
  replies = [m.get("text", "") for m in result.messages if m.get("role") == "assistant"]
  return replies[-1] if replies else ""


class SetupError(RuntimeError):
  """A "shell" task's set-up script failed: the task, not the agent, is broken."""


async def start_sandbox(task: Task, make_sandbox: SandboxMaker) -> Sandbox:
  """A fresh sandbox for an episode of `task`: holding the task's repository ("swe" tasks), or
  the workspace its set-up script made ("shell" tasks: the script runs with bash in the
  workspace, for at most SETUP_TIMEOUT seconds, and is not left there).

  Args:
    task: the task.
    make_sandbox: the sandboxes (`make_sandbox_factory`).

  Returns:
    The started sandbox (the caller closes it); closed again if loading the repository or the
    set-up fails.

  Raises:
    SetupError: the set-up script exited non-zero or timed out.
  """
  sandbox = await make_sandbox(task)
  try:
    if task.kind == "swe":
      for path, data in (await asyncio.to_thread(load_repo_files, task)).items():
        await sandbox.write_file(path, data)
    elif task.kind == "shell" and task.setup_script.strip():
      res = await sandbox.exec(["bash", "-c", task.setup_script], timeout=SETUP_TIMEOUT)
      if res.exit_code != 0 or res.timed_out:
        raise SetupError(f"Task {task.instance_id!r}: setup.sh failed (exit code "
                         f"{res.exit_code}, timed out {res.timed_out}): {res.stderr[-500:]}")
  except BaseException:
    await sandbox.close()
    raise
  return sandbox


def make_verifier(chat: ChatFormat, make_sandbox: SandboxMaker, policy: Policy, *,
                  partial_credit: bool = False, verdict_cache: Optional[VerdictCache] = None
                  ) -> Callable[[Task, Sandbox, EpisodeResult], Awaitable[tuple[float, dict]]]:
  """The reward of a finished episode: the task's verifier on what the agent left.

  Args:
    chat: renders a judge's prompt and decodes its reply.
    make_sandbox: the verifier's fresh sandboxes.
    policy: grades "judge" tasks.
    partial_credit: reward = fraction of tests passing instead of all-or-nothing.
    verdict_cache: grade each distinct submission once (`envs.verifiers.cache`); None: every
      one.

  Returns:
    `async verify(task, sandbox, result) -> (reward, details)`: 0 and {} for an episode that
    ended with "sandbox_error"; a SandboxError while verifying turns the result's termination
    into "sandbox_error" (reward 0).
  """
  def render(text: str) -> list[int]:  # a judge's prompt
    return chat.render([{"role": "user", "content": text}], add_generation_prompt=True).ids

  async def score(task: Task, sandbox: Sandbox, result: EpisodeResult) -> tuple[float, dict]:
    if result.termination == "sandbox_error":
      return 0.0, {}
    try:
      submission = await _submission(task, sandbox, result)

      def run() -> Awaitable[Verdict]:
        return verify(task, submission, make_sandbox=make_sandbox, policy=policy, render=render,
                      decode=chat.tokenizer.decode, partial=partial_credit)
      verdict = await (run() if verdict_cache is None else
                       verdict_cache.verdict(task, submission, partial_credit, run))
      return float(verdict.reward), verdict.details
    except SandboxError as e:
      result.termination, result.error = "sandbox_error", f"verifier: {e}"
      return 0.0, {}
  return score


def episode_metadata(details: Any, prompt: str, metadata: Optional[Mapping[str, Any]]) -> dict:
  """A trajectory's metadata from its episode: the verifier's details and the prompt's head."""
  return {"verdict": _jsonable(details), "prompt": prompt[:200], **(metadata or {})}


def make_react_episode(policy: Policy, chat: ChatFormat, make_sandbox: SandboxMaker,
                       config: Optional[ScaffoldConfig] = None, *, partial_credit: bool = False,
                       judge_policy: Optional[Policy] = None,
                       verdict_cache: Optional[VerdictCache] = None) -> EpisodeFn:
  """The episode of a rollout worker: the react scaffold in a sandbox, rewarded by a verifier.

  A fresh sandbox gets the task's repository (or a shell task's set-up), the react scaffold
  (`envs.scaffold.run_episode`) runs with the default tools for at most the config's timeout
  (or the task's `agent_timeout`, when shorter), then the task's verifier
  (`envs.verifiers.verify`) gives the reward. Sampling seeds come from the episode seed. A
  sandbox failure during the episode or the verification gives termination "sandbox_error",
  reward 0; one at creation raises (the episode is left out of its group).

  Args:
    policy: samples the agent's turns.
    chat: renders messages to token ids and parses tool calls.
    make_sandbox: the sandboxes (`make_sandbox_factory`).
    config: the scaffold's settings (default `ScaffoldConfig()`); its seed is the episode's.
    partial_credit: reward = fraction of tests passing instead of all-or-nothing.
    judge_policy: grades "judge" tasks (default `policy`).
    verdict_cache: grade each distinct submission once (`envs.verifiers.cache`); None: every
      one.

  Returns:
    The episode function (see `EpisodeFn`); trajectories carry metadata "verdict" (the
    verifier's details) and "prompt" (the phrasing's first 200 characters).
  """
  config = config or ScaffoldConfig()
  score = make_verifier(chat, make_sandbox, judge_policy or policy, partial_credit=partial_credit,
                        verdict_cache=verdict_cache)

  async def episode(task: Task, index: int, seed: int, *, group_id: str = "",
                    metadata: Optional[Mapping[str, Any]] = None) -> Trajectory:
    prompt = task.prompt(np.random.default_rng(seed))
    limit = config.timeout_s if task.agent_timeout is None else min(config.timeout_s,
                                                                    task.agent_timeout)
    sandbox = await start_sandbox(task, make_sandbox)
    try:
      result = await run_episode(policy, sandbox, prompt, default_tools(task.test_command or None),
                                 chat, dataclasses.replace(config, seed=seed, timeout_s=limit))
      reward, details = await score(task, sandbox, result)
    finally:
      await sandbox.close()
    return result.to_trajectory(reward, task.instance_id, group_id,
                                metadata=episode_metadata(details, prompt, metadata))
  return episode


def _first_record(path: str) -> Any:
  """The first JSON record of a JSONL file (None if there is none or it is not JSON)."""
  for _, _, record in jsonl_records(path):
    return None if isinstance(record, ValueError) else record
  return None


def load_task_file(path: str, *, mirror: Optional[str] = None,
                   cache_dir: Optional[str] = None) -> tuple[list[Task], int]:
  """The tasks of a task file or directory, skipping bad lines (or tasks).

  Dispatch: a directory is Terminal-Bench-style tasks (`envs.terminal_bench`: one task
  directory or a directory of them); a JSONL file whose first record is a LiveCodeBench row
  (question_content + test cases) is LiveCodeBench problems (`envs.livecodebench`); any other
  JSONL file holds SWE rows or problems (code / exact / judge), per line (`envs.tasks`); a
  .parquet file holds SWE rows.

  Args:
    path: the task file or directory.
    mirror: the directory of git mirrors SWE rows check out from (None: $ARBOR_SWE_MIRROR).
    cache_dir: where their checkouts go (None: $ARBOR_SWE_CACHE, else ~/.cache/arbor/swe).

  Returns:
    (tasks, number of bad lines); bad lines are logged with file:line and skipped.

  Raises:
    TaskFormatError: a directory holding no task.
    OSError: the path cannot be read.
  """
  errors: list = []
  if os.path.isdir(path):
    tasks = load_terminal_bench(path, skip_bad=True, errors=errors)
  elif path.endswith(".jsonl") and is_livecodebench_row(_first_record(path)):
    tasks = load_livecodebench_jsonl(path, skip_bad=True, errors=errors)
  else:
    tasks = load_tasks(path, skip_bad=True, errors=errors, mirror=mirror, cache_dir=cache_dir)
  return tasks, len(errors)
