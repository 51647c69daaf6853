"""The sandbox protocol every backend implements (bwrap, local, docker, remote).

A sandbox is one isolated workspace where untrusted, model-written code runs. All methods are
async so that a rollout worker can drive many sandboxes from one event loop. Paths given to the
file methods are relative to the workspace root; anything that would leave it (absolute paths,
`..`, symlinks pointing out) raises `PathError` (see `confine`).

    sb = await create_sandbox("bwrap", limits=Limits(memory_mb=512))
    async with sb:
      await sb.write_file("main.py", "print(1)")
      result = await sb.exec("python3 main.py", timeout=10)
"""

from __future__ import annotations

import abc
import dataclasses
import os
import posixpath
from typing import Awaitable, Callable, Mapping, Optional, Sequence


class SandboxError(RuntimeError):
  """The sandbox itself failed (could not start, died, server unreachable): not the command."""


class PathError(ValueError):
  """A file-API path leaves the workspace (absolute, `..`, or through a symlink)."""


class SandboxFull(SandboxError):
  """No capacity for another sandbox (server answered 429, or the uid pool is exhausted)."""


@dataclasses.dataclass(frozen=True)
class Limits:
  """Resource bounds of one sandbox.

  Every backend enforces what its platform allows and documents the rest.
  """

  memory_mb: int = 1024          # memory (+swap) for all processes of the sandbox
  pids: int = 128                # processes/threads of the sandbox
  cpus: float = 1.0              # CPU quota in cores (cgroup cpu.max where available)
  disk_mb: int = 256             # size of each tmpfs: workspace, /tmp, /dev/shm
  output_bytes: int = 64 * 1024  # stdout and stderr each keep this many bytes (head and tail)
  file_bytes: int = 8 * 1024 * 1024  # largest file accepted by write_file / returned by read_file
  default_timeout: float = 60.0  # seconds, when exec() is called without one


@dataclasses.dataclass(frozen=True)
class ExecResult:
  """What one command did. `stdout`/`stderr` are decoded as UTF-8 with replacement; an output
  longer than the sandbox's `output_bytes` keeps its first and last halves around a line
  "[... N bytes left out of TOTAL ...]" (so a test run's closing summary survives)."""

  exit_code: int              # exit status; 128 + N if killed by signal N (as shells report
                              # it, on every backend); -1 on timeout
  stdout: str
  stderr: str
  timed_out: bool = False
  duration: float = 0.0       # seconds of wall time
  stdout_truncated: bool = False
  stderr_truncated: bool = False
  stdout_bytes: int = 0       # bytes the command wrote to stdout in all (kept or not)
  stderr_bytes: int = 0

  def to_dict(self) -> dict:
    """The fields as a JSON-ready dict."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: Mapping) -> "ExecResult":
    """The result a `to_dict` dict describes (unknown keys ignored, missing ones default)."""
    return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


class Sandbox(abc.ABC):
  """One isolated workspace. Use as `async with`; `close()` kills everything inside."""

  limits: Limits = Limits()
  workspace_path: str = ""  # the workspace as the sandbox's commands see it (their cwd)

  @abc.abstractmethod
  async def exec(self, cmd: str | Sequence[str], timeout: Optional[float] = None,
                 stdin: Optional[str] = None,
                 env: Optional[Mapping[str, str]] = None) -> ExecResult:
    """Runs a shell command in the workspace.

    Args:
      cmd: the command line, run with `/bin/sh -c` with the workspace as working directory;
        or an argv list, run exactly as given (no shell expansion of its items).
      timeout: seconds before the command is killed; None: `limits.default_timeout`.
      stdin: the command's standard input; None: empty.
      env: variables added to the sandbox's small fixed environment (names must be
        `[A-Za-z_][A-Za-z0-9_]*`).

    Returns:
      What the command did; a timeout or a non-zero exit is a result, not an exception.

    Raises:
      ValueError: a malformed cmd, timeout, stdin or env.
      SandboxError: the sandbox is closed or failed.
    """

  @abc.abstractmethod
  async def write_file(self, path: str, content: str | bytes) -> None:
    """Creates or replaces a workspace file; parent directories are created.

    Args:
      path: workspace-relative path.
      content: the file's content (str is written as UTF-8).

    Raises:
      PathError: the path leaves the workspace.
      ValueError: the content is larger than `limits.file_bytes`.
      SandboxError: the sandbox is closed or failed.
    """

  @abc.abstractmethod
  async def read_file(self, path: str) -> bytes:
    """The bytes of a workspace file.

    Raises:
      PathError: the path leaves the workspace.
      FileNotFoundError: no such file.
      ValueError: the file is larger than `limits.file_bytes`.
    """

  @abc.abstractmethod
  async def list_files(self, path: str = ".") -> list[str]:
    """Workspace-relative paths of the regular files under `path`, sorted."""

  @abc.abstractmethod
  async def close(self) -> None:
    """Kills every process of the sandbox and deletes its workspace. Idempotent."""

  async def fork(self) -> "Sandbox":
    """A new, started sandbox whose workspace is a copy of this one's now.

    Tree rollouts branch an episode after a tool result: every branch starts from the same
    files and diverges afterwards. The fork has the same limits and the same system view
    (root filesystem, image, read-only binds, network and backend options) as this sandbox,
    and its own workspace holding a copy of this one's at the time of the call: regular files
    with their content, mode and mtime, directories (empty ones too), symlinks as links
    (never followed), hard links as links. Other special files (FIFOs, sockets) are left out.
    From then on the two are independent: what one writes the other never sees.

    Process state is not carried: a command still running here (an exec in flight, with
    what it started) is not in the fork, and nothing outside the workspace
    (/tmp, /dev/shm, a HOME outside it) is copied. That loses nothing an agent relies on:
    every tool call is a fresh `exec` (a new process with a fixed environment), so tools carry
    state from one call to the next only through the workspace files. A copy taken while a
    command writes here is a snapshot of some moment during that write.

    Returns:
      The fork; the caller closes it (as well as this sandbox) with `close()`. Closing either
      one leaves the other working.

    Raises:
      SandboxError: this sandbox is closed, or making or filling the fork failed (a
        half-made fork is closed first).
      SandboxFull: no capacity for another sandbox.
      NotImplementedError: the backend cannot fork.
    """
    raise NotImplementedError(f"{type(self).__name__} cannot fork")

  async def __aenter__(self) -> "Sandbox":
    return self

  async def __aexit__(self, *exc) -> None:
    await self.close()


async def fill_fork(fork: Sandbox, copy: Callable[[], Awaitable[None]]) -> Sandbox:
  """Fills a new fork with `copy()`; a fork that could not be filled is closed, not returned.

  Args:
    fork: the started, empty fork.
    copy: copies the parent's workspace into it.

  Returns:
    The fork.

  Raises:
    SandboxError: the copy failed (any other exception, e.g. an OSError such as ENOSPC or a
      ValueError for a tree too deep to copy, is wrapped in one).
  """
  try:
    await copy()
  except BaseException as e:
    try:
      await fork.close()
    except Exception:  # the copy's error is the one worth reporting
      pass
    if isinstance(e, Exception) and not isinstance(e, SandboxError):
      raise SandboxError(f"fork: copying the workspace failed: {type(e).__name__}: {e}") from e
    raise
  return fork


def confine(root: str, path: str) -> str:
  """Maps a workspace-relative path to its host path, refusing any way out of the workspace.

  Rejects absolute paths, `..` components and any existing symlink along the path (a symlink
  inside the workspace is written by untrusted code and may point anywhere).

  Args:
    root: the workspace's host directory.
    path: the workspace-relative path.

  Returns:
    The host path under the real path of `root`.

  Raises:
    PathError: an empty, absolute or NUL-holding path, a `..` component, or a symlink on the way.
  """
  if not isinstance(path, str) or not path or "\x00" in path:
    raise PathError(f"path={path!r}: expected a non-empty workspace-relative path")
  if posixpath.isabs(path):
    raise PathError(f"path={path!r}: absolute paths are not allowed (workspace-relative only)")
  parts = [p for p in path.split("/") if p not in ("", ".")]
  if ".." in parts:
    raise PathError(f"path={path!r}: '..' is not allowed")
  current = os.path.realpath(root)
  for part in parts:
    current = os.path.join(current, part)
    if os.path.islink(current):
      raise PathError(f"path={path!r}: {part!r} is a symlink")
  return current
