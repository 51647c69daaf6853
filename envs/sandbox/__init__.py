"""Sandboxes: one async protocol (`base.Sandbox`), backends bwrap | local | docker | remote.

    sb = await create_sandbox("bwrap", limits=Limits(memory_mb=512))
    async with sb:
      await sb.write_file("main.py", "print(1)")
      result = await sb.exec("python3 main.py", timeout=10)

`create_sandbox` is async because starting a sandbox may block (mounts, cgroups, a container,
an HTTP round trip); it returns a started sandbox, closed by `close()` / `async with`.
"""

from __future__ import annotations

from envs.sandbox.base import (ExecResult, Limits, PathError, Sandbox, SandboxError, SandboxFull,
                               confine)
from envs.sandbox.bwrap import BwrapSandbox
from envs.sandbox.docker import DockerSandbox
from envs.sandbox.local import LocalSandbox
from envs.sandbox.remote import RemoteSandbox

__all__ = ["BACKENDS", "ExecResult", "Limits", "PathError", "Sandbox", "SandboxError",
           "SandboxFull", "confine", "create_sandbox"]
BACKENDS = ("bwrap", "local", "docker", "remote")


async def create_sandbox(backend: str, *, limits: Limits = Limits(), **kw) -> Sandbox:
  """A started sandbox of `backend`.

  Args:
    backend: one of BACKENDS.
    limits: the sandbox's limits.
    **kw: the backend's own arguments:
      bwrap: `BwrapSandbox.create(limits, rootfs=, ro_binds=, uids=, root_dir=, cgroups=)`;
      local: `LocalSandbox(limits, allow_unsafe=True)` (refused without it);
      docker: `DockerSandbox.create(limits, image=, user=)`;
      remote: `RemoteSandbox.create(url, token=, limits=, token_file=, cafile=)`.

  Returns:
    The sandbox, closed by `close()` / `async with`.
  """
  if backend == "local":
    return LocalSandbox(limits, **kw)
  if backend == "bwrap":
    return await BwrapSandbox.create(limits, **kw)
  if backend == "docker":
    return await DockerSandbox.create(limits, **kw)
  if backend == "remote":
    return await RemoteSandbox.create(limits=limits, **kw)
  raise ValueError(f"backend={backend!r}: expected one of {', '.join(BACKENDS)}")
