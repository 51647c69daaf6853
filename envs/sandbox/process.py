"""Run one child process with a deadline and capped output (shared by the local and bwrap
backends).

The child's stdout/stderr are read concurrently; of each, the first and the last
`output_bytes / 2` bytes are kept (a test run's summary is its last line), the middle is read and
discarded (closing the pipe instead would SIGPIPE a test run that is merely verbose) and marked
with the number of bytes left out. A process killed by signal N reports exit code 128 + N, as
shells (and bwrap, for what runs inside it) do, so every backend reports signal deaths alike. On timeout the caller's `kill` callback must make the process exit (and take its
descendants with it); we then wait for it, so no zombie and no open pipe outlives the call.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import time
from typing import Callable, Mapping, Optional, Sequence

from envs.sandbox.base import ExecResult

_CHUNK = 1 << 16


def check_env(env: Optional[Mapping[str, str]]) -> dict[str, str]:
  """Validated copy of a caller-given environment (None: empty).

  Raises:
    ValueError: a name is not `[A-Za-z_][A-Za-z0-9_]*`, or a value is not a NUL-free string.
  """
  out = {}
  for k, v in (env or {}).items():
    if not isinstance(k, str) or not k or not (k[0].isalpha() or k[0] == "_") or not all(
        c.isalnum() or c == "_" for c in k):
      raise ValueError(f"env name {k!r}: expected [A-Za-z_][A-Za-z0-9_]*")
    if not isinstance(v, str) or "\x00" in v:
      raise ValueError(f"env[{k!r}]={v!r}: expected a string without NUL")
    out[k] = v
  return out


def check_exec_args(cmd, timeout, stdin, default_timeout: float) -> tuple[str, float]:
  """Validates the arguments of `Sandbox.exec`.

  Args:
    cmd: the command line, a non-empty string without NUL; or an argv list of such strings,
      run exactly as given (quoted into a command line here).
    timeout: seconds, or None for `default_timeout`.
    stdin: str, bytes or None.
    default_timeout: seconds used when timeout is None.

  Returns:
    (the shell command line, the timeout in seconds, in (0, 1e6)).

  Raises:
    ValueError: naming the bad argument.
  """
  if isinstance(cmd, (list, tuple)):
    if not cmd or not all(isinstance(a, str) and "\x00" not in a for a in cmd):
      raise ValueError(f"cmd={cmd!r}: expected a non-empty list of strings without NUL")
    cmd = shlex.join(cmd)
  if not isinstance(cmd, str) or not cmd or "\x00" in cmd:
    raise ValueError(f"cmd={cmd!r}: expected a non-empty string without NUL, or an argv list")
  if stdin is not None and not isinstance(stdin, (str, bytes)):
    raise ValueError(f"stdin: expected str, bytes or None, got {type(stdin).__name__}")
  timeout = default_timeout if timeout is None else timeout
  if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e6:
    raise ValueError(f"timeout={timeout!r}: expected seconds in (0, 1e6)")
  return cmd, float(timeout)


class CappedOutput:
  """The first and last bytes of a stream, `cap` in all, and its total length."""

  def __init__(self, cap: int):
    self.head_cap, self.tail_cap = cap - cap // 2, cap // 2
    self.head, self.tail, self.total = bytearray(), bytearray(), 0

  def add(self, chunk: bytes) -> None:
    self.total += len(chunk)
    room = self.head_cap - len(self.head)
    if room > 0:
      self.head += chunk[:room]
      chunk = chunk[room:]
    if chunk and self.tail_cap:
      self.tail += chunk[-self.tail_cap:]
      del self.tail[:max(0, len(self.tail) - self.tail_cap)]

  @property
  def truncated(self) -> bool:
    return self.total > len(self.head) + len(self.tail)

  def text(self) -> str:
    head, tail = bytes(self.head), bytes(self.tail)
    if not self.truncated:
      return (head + tail).decode("utf-8", "replace")
    omitted = self.total - len(head) - len(tail)
    return (head.decode("utf-8", "replace") + truncation_marker(omitted, self.total)
            + tail.decode("utf-8", "replace"))


def truncation_marker(omitted: int, total: int) -> str:
  """The line that stands for the middle of an over-long output."""
  return f"\n[... {omitted} bytes left out of {total} ...]\n"


class _Protocol(asyncio.SubprocessProtocol):
  """Collects capped output and tells apart "the process exited" from "its pipes closed" (a
  background child may hold them open after the command itself is done)."""

  def __init__(self, cap: int):
    loop = asyncio.get_running_loop()
    self.out, self.err = CappedOutput(cap), CappedOutput(cap)
    self.exited, self.closed = loop.create_future(), loop.create_future()

  def pipe_data_received(self, fd: int, data: bytes) -> None:
    (self.out if fd == 1 else self.err).add(data)

  def process_exited(self) -> None:
    if not self.exited.done():
      self.exited.set_result(None)

  def connection_lost(self, exc) -> None:
    if not self.closed.done():
      self.closed.set_result(None)


async def run(argv: Sequence[str], *, timeout: float, output_bytes: int,
              stdin: Optional[str | bytes] = None, env: Optional[Mapping[str, str]] = None,
              cwd: Optional[str] = None, kill: Optional[Callable[[int], None]] = None,
              after_exit: Optional[Callable[[int], None]] = None,
              on_start: Optional[Callable[[int], None]] = None,
              pass_fds: Sequence[int] = ()) -> ExecResult:
  """Runs argv with no shell, no inherited fds but `pass_fds`, in a new session, and waits.

  Args:
    argv: the program and its arguments.
    timeout: seconds before `kill` is called.
    output_bytes: how much of stdout and of stderr is kept (each).
    stdin: the child's standard input; None: empty.
    env: the child's whole environment; None: empty.
    cwd: the child's working directory; None: this process's.
    kill: called with the child's pid on timeout or cancellation; must end the process and
      everything it started. None: SIGKILL its process group.
    after_exit: called with the pid once the process exited by itself, to clean up what it
      left behind.
    on_start: called with the pid once started, so the caller can track the process (e.g. to
      kill it on close()).
    pass_fds: file descriptors the child inherits (e.g. a seccomp program for bwrap).

  Returns:
    The result; exit code 128 + N when killed by signal N, -1 on timeout, and truncation flags
    set also when the pipes stayed open 5 s after the exit (a child escaped `kill`).
  """
  t0 = time.monotonic()
  data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
  kill = kill or kill_group
  loop = asyncio.get_running_loop()
  transport, proto = await loop.subprocess_exec(
      lambda: _Protocol(output_bytes), *argv, stdin=asyncio.subprocess.PIPE,
      stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=dict(env or {}),
      cwd=cwd, close_fds=True, start_new_session=True, pass_fds=tuple(pass_fds))
  pid = transport.get_pid()
  timed_out = cut_short = False
  try:
    if on_start is not None:
      on_start(pid)
    pipe = transport.get_pipe_transport(0)
    if data:
      pipe.write(data)  # buffered by the loop; a command that never reads it is no error
    pipe.close()
    try:
      await asyncio.wait_for(asyncio.shield(proto.exited), timeout)
    except asyncio.TimeoutError:
      timed_out = True
      kill(pid)
    else:
      if after_exit is not None:
        after_exit(pid)
    await proto.exited
    # Normally the pipes close with the process; one that escaped `kill` (possible only in the
    # local backend) may hold them, so this wait is bounded and keeps what was read.
    try:
      await asyncio.wait_for(asyncio.shield(proto.closed), 5.0)
    except asyncio.TimeoutError:
      cut_short = True
  except BaseException:  # cancelled: do not leave the child running
    kill(pid)
    raise
  finally:
    transport.close()
  code = transport.get_returncode()
  code = -1 if timed_out else 128 - code if code < 0 else code
  return ExecResult(exit_code=code, stdout=proto.out.text(), stderr=proto.err.text(),
                    timed_out=timed_out, duration=time.monotonic() - t0,
                    stdout_truncated=proto.out.truncated or cut_short,
                    stderr_truncated=proto.err.truncated or cut_short,
                    stdout_bytes=proto.out.total, stderr_bytes=proto.err.total)


def kill_group(pgid: int) -> None:
  """SIGKILLs a process group; a group that is already gone is fine."""
  try:
    os.killpg(pgid, 9)
  except (ProcessLookupError, PermissionError):
    pass
