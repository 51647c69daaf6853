"""`local` backend: a plain subprocess in a temporary directory. NO ISOLATION.

The command runs as this process's user with its privileges, its network and its view of the
file system; only the timeout, the output caps and the file-API path checks apply. It exists
for tests and trusted debugging, so it is refused unless `allow_unsafe=True`.

Each exec runs `/bin/sh -c cmd` in a new session with the workspace as working directory and a
small fresh environment (PATH, HOME=the workspace, LANG, TMPDIR, plus `env`). When the command
exits, or on timeout, its process group is killed: a plain background child does not outlive
the exec (a child that calls setsid escapes; bwrap's PID namespace has no such gap).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from typing import Mapping, Optional, Sequence

from envs.sandbox import hostfs, process
from envs.sandbox.base import ExecResult, Limits, Sandbox, SandboxError, fill_fork

BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


class LocalSandbox(Sandbox):
  """Unsafe subprocess backend.

  `async with LocalSandbox(allow_unsafe=True) as sb: ...`

  Args:
    limits: the limits it can enforce (timeout, output and file sizes; see the module docstring).
    allow_unsafe: must be True: the command runs with no isolation.
    parent_dir: where the temporary workspace is made; None: the system's temp directory.

  Raises:
    SandboxError: allow_unsafe is not True.
  """

  def __init__(self, limits: Limits = Limits(), *, allow_unsafe: bool = False,
               parent_dir: Optional[str] = None):
    if allow_unsafe is not True:
      raise SandboxError(
          "backend 'local' runs model-written code as this user with no isolation (network, "
          "files, processes); pass allow_unsafe=True only for tests and trusted code, else use "
          "'bwrap'")
    self.limits, self._parent_dir = limits, parent_dir
    self.root = tempfile.mkdtemp(prefix="arbor-local-", dir=parent_dir)
    self.workspace_path = self.root
    self._pgids: set[int] = set()  # process groups of running execs
    self._closed = False

  def _check_open(self) -> None:
    if self._closed:
      raise SandboxError("sandbox is closed")

  async def exec(self, cmd: str | Sequence[str], timeout: Optional[float] = None,
                 stdin: Optional[str] = None,
                 env: Optional[Mapping[str, str]] = None) -> ExecResult:
    self._check_open()
    cmd, timeout = process.check_exec_args(cmd, timeout, stdin, self.limits.default_timeout)
    full_env = {**BASE_ENV, "HOME": self.root, "TMPDIR": self.root, **process.check_env(env)}
    pids = []
    try:
      return await process.run(["/bin/sh", "-c", cmd], timeout=timeout,
                               output_bytes=self.limits.output_bytes, stdin=stdin, env=full_env,
                               cwd=self.root, after_exit=process.kill_group,
                               on_start=lambda pid: (pids.append(pid), self._pgids.add(pid)))
    finally:
      self._pgids.difference_update(pids)

  async def write_file(self, path: str, content: str | bytes) -> None:
    self._check_open()
    hostfs.write_file(self.root, path, content, self.limits.file_bytes)

  async def read_file(self, path: str) -> bytes:
    self._check_open()
    return hostfs.read_file(self.root, path, self.limits.file_bytes)

  async def list_files(self, path: str = ".") -> list[str]:
    self._check_open()
    return hostfs.list_files(self.root, path)

  async def fork(self) -> "LocalSandbox":
    """A new sandbox whose workspace is a copy of this one's (see `Sandbox.fork`).

    The temporary directory is copied as this process's user: running as root, files the
    commands made unreadable (mode 000) are copied too; otherwise they fail the fork.
    """
    self._check_open()
    fork = LocalSandbox(self.limits, allow_unsafe=True, parent_dir=self._parent_dir)
    return await fill_fork(fork, lambda: asyncio.to_thread(hostfs.copy_tree, self.root,
                                                           fork.root))

  async def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    for pgid in self._pgids:
      process.kill_group(pgid)
    shutil.rmtree(self.root, ignore_errors=True)
