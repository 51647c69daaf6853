"""A black-box episode: a scaffold's CLI run inside a task's sandbox, scored by the task's verifier.

    result = await run_blackbox_episode(task, "mini-swe-agent", "http://127.0.0.1:8000",
                                        token=token, model="policy")
    result.session_id, result.reward     # the gateway's session of every model call; [0, 1]

Steps: the task's environment with the scaffold installed (`with_scaffold`: built once, cached
by its key) → a sandbox of it (bwrap or docker) holding the task's files (`envs.episode.
start_sandbox`: a swe task's repository, a shell task's set-up) with the episode's channel
bound in (`Channel`) → one exec that copies the launch's configuration files into $HOME,
starts the in-sandbox relay on 127.0.0.1:`port` and runs the scaffold's command in the
workspace, bounded by `timeout` seconds → the task's verifier (`envs.verifiers.verify`) on
what the scaffold left: the workspace files (swe, in a fresh sandbox of the task's own
environment) or the sandbox itself (shell) → the channel closes.

Every model call the scaffold makes lands in the gateway's session `session_id` (the channel
forces it); turning that session into a `Trajectory` is the caller's next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Optional

from envs import episode as episodes
from envs.environments import build as environment_build
from envs.sandbox import Limits, SandboxError, create_sandbox
from envs.scaffolds.channel import SANDBOX_DIR, Channel
from envs.scaffolds.registry import LaunchRequest, Scaffold, get, with_scaffold
from envs.tasks import Task
from envs.verifiers import verify, workspace_files
from envs.verifiers.cache import VerdictCache

# CLIs run Node or Python with many threads and a few hundred MiB: roomier than tool calls.
DEFAULT_LIMITS = Limits(memory_mb=4096, pids=512, cpus=2.0, disk_mb=1024,
                        default_timeout=1800.0)
DEFAULT_TIMEOUT = 1800.0  # seconds a scaffold may run, when the task sets no agent_timeout
RELAY_PORT = 4000
API_KEY = "arbor-channel"  # what the scaffold is given: the channel sends the real token
KINDS = ("swe", "shell")   # tasks scored on what the scaffold left in the sandbox
# Runs in the sandbox: configuration into $HOME, the relay up, then the scaffold ("$@").
_START = ('cp -R {dir}/home/. "$HOME"/ && {relay} && cd "{workspace}" && exec "$@"')


@dataclasses.dataclass
class BlackboxResult:
  """What a black-box episode gives back.

  Attributes:
    session_id: the gateway session holding every model call of the episode.
    reward: the verifier's reward in [0, 1] (0 on "sandbox_error").
    details: the verifier's details.
    termination: "exited" (the CLI exited 0: it finished, or stopped at its own turn limit,
      which some CLIs report with status 0 too), "exit_error" (it exited non-zero),
      "timeout" (killed at `timeout`) or "sandbox_error".
    exit_code: the CLI's exit status (-1 on timeout or sandbox error).
    stdout: the CLI's output (capped by the sandbox's `output_bytes`).
    stderr: its error output, or the sandbox error's message.
    requests: (method, path, status) of every request through the channel.
    seconds: wall time of the whole episode.
    scaffold: the scaffold's name.
  """

  session_id: str
  reward: float
  details: dict
  termination: str
  exit_code: int
  stdout: str
  stderr: str
  requests: list
  seconds: float
  scaffold: str


def _sandbox_maker(backend: str, made: str, limits: Limits, channel: Channel, extra: dict):
  kw = {"rootfs": made} if backend == "bwrap" else {"image": made}

  async def make(task: Task):
    return await create_sandbox(backend, limits=limits, **kw, **extra,
                                **channel.sandbox_kwargs(backend))
  return make


async def run_blackbox_episode(task: Task, scaffold: "str | Scaffold", gateway_url: str, *,
                               model: str, token: Optional[str] = None,
                               session_id: Optional[str] = None, backend: str = "bwrap",
                               max_turns: int = 50, timeout: Optional[float] = None,
                               limits: Limits = DEFAULT_LIMITS, prompt: Optional[str] = None,
                               cache_dir: Optional[str] = None,
                               verifier_backend: Optional[str] = None,
                               port: int = RELAY_PORT,
                               sandbox_kw: Optional[dict] = None,
                               verdict_cache: Optional[VerdictCache] = None) -> BlackboxResult:
  """Runs one episode of `task` with a sandboxed scaffold (module docstring).

  Args:
    task: a "swe" or "shell" task with an `environment`.
    scaffold: a registry name or entry (not a host-side one).
    gateway_url: the policy gateway's root, "http(s)://HOST:PORT".
    model: the model name the gateway serves (what the CLI asks for).
    token: the gateway's bearer token (never enters the sandbox).
    session_id: the episode's gateway session (default: "episode-" + a random hex id).
    backend: "bwrap" or "docker".
    max_turns: the CLI's turn/step limit, where it has one.
    timeout: seconds the CLI may run (default: the task's agent_timeout, else
      DEFAULT_TIMEOUT).
    limits: the agent sandbox's limits.
    prompt: the instruction (default: the task's first problem statement).
    cache_dir: the environment build cache.
    verifier_backend: the backend of the verifier's fresh sandboxes (default: `backend`).
    port: the relay's port inside the sandbox.
    sandbox_kw: more `create_sandbox` arguments of the agent's sandbox (bwrap `uids`, docker
      `user`, ...), not the image, root filesystem or binds.
    verdict_cache: grade each distinct final workspace once (`envs.verifiers.cache`); None:
      every one.

  Returns:
    The result; a sandbox failure gives termination "sandbox_error" and reward 0.

  Raises:
    ValueError: a task without environment or of another kind, a host-side scaffold, an
      unknown backend, or a bad argument of the channel.
    BuildError / RuntimeError: building the environment failed.
  """
  sc = get(scaffold)
  if sc.host_side:
    raise ValueError(f"scaffold={sc.name!r} runs host-side: use envs.episode.make_react_episode")
  if task.kind not in KINDS:
    raise ValueError(f"Task {task.instance_id!r}: kind={task.kind!r}: a black-box episode is "
                     f"scored on the sandbox it leaves (kinds {KINDS})")
  if backend not in ("bwrap", "docker"):
    raise ValueError(f"backend={backend!r}: expected 'bwrap' or 'docker'")
  if task.environment is None:
    raise ValueError(f"Task {task.instance_id!r}: environment=None: a scaffold is installed "
                     "into the task's Environment")
  timeout = float(timeout or task.agent_timeout or DEFAULT_TIMEOUT)
  session_id = session_id or f"episode-{uuid.uuid4().hex}"
  start = time.monotonic()
  scaffolded = dataclasses.replace(task, environment=with_scaffold(task.environment, sc))
  made = await asyncio.to_thread(environment_build.for_task, scaffolded, backend, cache_dir)
  verifier_sandboxes = episodes.make_sandbox_factory(verifier_backend or backend)
  termination, exit_code, stdout, stderr = "sandbox_error", -1, "", ""
  reward, details = 0.0, {}
  async with Channel(gateway_url, session_id, token) as channel:
    try:
      sandbox = await episodes.start_sandbox(
          task, _sandbox_maker(backend, made, limits, channel, dict(sandbox_kw or {})))
    except SandboxError as e:
      return BlackboxResult(session_id, 0.0, {}, "sandbox_error", -1, "", str(e),
                            list(channel.requests), round(time.monotonic() - start, 2), sc.name)
    try:
      launch = sc.launch(LaunchRequest(prompt or task.problem_statement,
                                       f"http://127.0.0.1:{port}", API_KEY, model, max_turns,
                                       sandbox.workspace_path))
      for path, text in launch.files.items():
        channel.write_home_file(path, text)
      script = _START.format(dir=SANDBOX_DIR, relay=channel.relay_command(port),
                             workspace=sandbox.workspace_path)
      res = await sandbox.exec(["/bin/sh", "-c", script, sc.name, *launch.argv],
                               timeout=timeout, env=dict(launch.env))
      exit_code, stdout, stderr = res.exit_code, res.stdout, res.stderr
      termination = ("timeout" if res.timed_out else
                     "exited" if res.exit_code == 0 else "exit_error")
      submission = await workspace_files(sandbox) if task.kind == "swe" else sandbox

      def grade():
        return verify(task, submission, make_sandbox=verifier_sandboxes)
      verdict = await (grade() if verdict_cache is None else
                       verdict_cache.verdict(task, submission, False, grade))
      reward, details = float(verdict.reward), verdict.details
    except SandboxError as e:
      termination, stderr, reward, details = "sandbox_error", f"{stderr}\n{e}".strip(), 0.0, {}
    finally:
      await sandbox.close()
  requests = list(channel.requests)  # after close: requests cut at the episode's end included
  return BlackboxResult(session_id, reward, details, termination, exit_code, stdout, stderr,
                        requests, round(time.monotonic() - start, 2), sc.name)
