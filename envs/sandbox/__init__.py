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

__all__ = ["BACKENDS", "ExecResult", "Limits", "PathError", "Sandbox", "SandboxError",
           "SandboxFull", "confine", "create_sandbox"]
BACKENDS = ("bwrap", "local", "docker", "remote")


async def create_sandbox(backend: str, *, limits: Limits = Limits(), **kw) -> Sandbox:
  """A started sandbox of `backend`; keyword arguments go to that backend's `create`.

  bwrap: `envs.sandbox.bwrap.BwrapSandbox.create(limits, rootfs=, ro_binds=, uids=,
    root_dir=, cgroups=)`.
  local: `LocalSandbox(limits, allow_unsafe=True)` (refused without it).
  docker: `DockerSandbox.create(limits, image=, user=)`.
  remote: `RemoteSandbox.create(url, token=, limits=, token_file=, cafile=)`.
  """
  if backend == "local":
    from envs.sandbox.local import LocalSandbox
    return LocalSandbox(limits, **kw)
  if backend == "bwrap":
    from envs.sandbox.bwrap import BwrapSandbox
    return await BwrapSandbox.create(limits, **kw)
  if backend == "docker":
    from envs.sandbox.docker import DockerSandbox
    return await DockerSandbox.create(limits, **kw)
  if backend == "remote":
    from envs.sandbox.remote import RemoteSandbox
    return await RemoteSandbox.create(limits=limits, **kw)
  raise ValueError(f"backend={backend!r}: expected one of {', '.join(BACKENDS)}")
