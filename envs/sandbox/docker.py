"""`docker` backend (docker-py): one container per sandbox.

The container runs `sleep infinity` from `image` with no network (`network_mode="none"`), a
read-only root file system, tmpfs /workspace and /tmp of `limits.disk_mb` (exec allowed,
nosuid, nodev) and /dev/shm of the same size, memory = memory+swap, pids and CPU limits, a
non-root user (default 65534:65534), every capability dropped, no-new-privileges, the seccomp
profile of `seccomp.docker_profile` (the bwrap backend's deny list as a Docker profile: keyring,
io_uring, bpf, userfaultfd, perf, ptrace, module/kexec/clock/mount calls, socket families other
than AF_UNIX and, for the container's loopback, AF_INET/AF_INET6, plus the namespace and other
calls Docker's default profile denies, since a custom profile replaces it) and Docker's init as
pid 1. Keyrings: Docker gives each container a fresh session keyring, and the profile denies the
keyring calls. Each exec is `docker exec` of `timeout -k 1 T sh -c cmd` (the image needs
coreutils' `timeout`; the client also stops reading at the deadline); its output is streamed and
capped. Background processes of an exec live until close() (the container is removed with
force), unlike bwrap. The file API checks every path component for symlinks inside the container
and moves data with tar archives; `fork()` streams /workspace into a new container of the
same image, user and limits the same way. `DOCKER_HOST` may name a remote engine only over TLS
(DOCKER_TLS_VERIFY=1, DOCKER_CERT_PATH): plain tcp:// and ssh:// are refused.
"""

from __future__ import annotations

import asyncio
import io
import os
import secrets
import shlex
import tarfile
import tempfile
import time
from typing import Mapping, Optional, Sequence

from envs.sandbox import process, seccomp
from envs.sandbox.base import (ExecResult, Limits, PathError, Sandbox, SandboxError,
                               fill_fork)

WORKSPACE = "/workspace"
_SPOOL_BYTES = 16 << 20  # a fork's workspace archive stays in memory up to this, then on disk
# Walk the path components from /workspace; exit 3 on a symlink, 4 if a parent is not a dir,
# 0 at the first missing one (write_file makes the rest, then checks again).
_CHECK = ('cd /workspace || exit 2; i=0; for c; do i=$((i+1)); '
          '[ -L "$c" ] && exit 3; [ -e "$c" ] || exit 0; '
          '[ $i -lt $# ] && { cd -- "$c" 2>/dev/null || exit 4; }; done; exit 0')


def docker_client():
  """A docker-py client from the environment; remote engines only over TLS.

  Raises:
    SandboxError: docker-py is not installed, or DOCKER_HOST names a remote engine without TLS.
  """
  try:
    import docker
  except ImportError as e:
    raise SandboxError("backend 'docker' needs the docker package (pip install docker)") from e
  host = os.environ.get("DOCKER_HOST", "")
  if host and not host.startswith("unix://"):
    if not host.startswith("tcp://") or os.environ.get("DOCKER_TLS_VERIFY", "") in ("", "0"):
      raise SandboxError(f"DOCKER_HOST={host!r}: a remote Docker engine is allowed only over "
                         "TLS (tcp:// with DOCKER_TLS_VERIFY=1 and DOCKER_CERT_PATH)")
  client = docker.from_env()
  if host.startswith("tcp://") and not client.api.base_url.startswith("https://"):
    raise SandboxError(f"DOCKER_HOST={host!r}: client is not using TLS")
  return client


class DockerSandbox(Sandbox):
  """One container per sandbox (see the module docstring).

  Create with `await DockerSandbox.create(limits, image=..., user=...)`.
  """

  workspace_path = WORKSPACE

  def __init__(self, client, container, limits: Limits, image: str = "", user: str = ""):
    self._client, self._container, self.limits, self._closed = client, container, limits, False
    self._image, self._user = image, user  # for fork()

  @classmethod
  async def create(cls, limits: Limits = Limits(), *, image: str = "python:3.11-slim",
                   user: str = "65534:65534") -> "DockerSandbox":
    """Starts a container.

    Args:
      limits: the sandbox's limits.
      image: the image; it needs `sh` and coreutils' `timeout`.
      user: "uid[:gid]" the commands run as; never root.

    Returns:
      The started sandbox.

    Raises:
      ValueError: user is root.
      SandboxError: no usable Docker engine, or the container could not start.
    """
    if user.split(":")[0] in ("0", "root"):
      raise ValueError(f"user={user!r}: the sandbox user must not be root")

    def start():
      client = docker_client()
      uid, _, gid = user.partition(":")
      opts = f"size={limits.disk_mb}m,mode=0700,uid={uid},gid={gid or uid},exec,nosuid,nodev"
      container = client.containers.run(
          image, ["sleep", "infinity"], detach=True, network_mode="none", user=user,
          cap_drop=["ALL"], security_opt=seccomp.docker_security_opt(inet=True),
          read_only=True, init=True,
          mem_limit=f"{limits.memory_mb}m", memswap_limit=f"{limits.memory_mb}m",
          pids_limit=limits.pids, nano_cpus=int(limits.cpus * 1e9),
          shm_size=f"{limits.disk_mb}m", working_dir=WORKSPACE, environment={},
          tmpfs={WORKSPACE: opts, "/tmp": opts}, labels={"arbor.sandbox": "1"})
      return client, container

    try:
      client, container = await asyncio.to_thread(start)
    except SandboxError:
      raise
    except Exception as e:  # docker.errors.*: engine down, image missing, ...
      raise SandboxError(f"docker: could not start a container from {image!r}: {e}") from e
    return cls(client, container, limits, image, user)

  def _check_open(self) -> None:
    if self._closed:
      raise SandboxError("sandbox is closed")

  def _run(self, argv: list[str], deadline: float, env: Optional[dict] = None
           ) -> tuple[int, process.CappedOutput, process.CappedOutput]:
    """Blocking exec with streamed output, head and tail kept: (exit, out, err)."""
    api, cap = self._client.api, self.limits.output_bytes
    exec_id = api.exec_create(self._container.id, argv, stdout=True, stderr=True,
                              workdir=WORKSPACE, environment=env or {})["Id"]
    out, err = process.CappedOutput(cap), process.CappedOutput(cap)
    for o, e in api.exec_start(exec_id, stream=True, demux=True):
      if o:
        out.add(o)
      if e:
        err.add(e)
      if time.monotonic() > deadline:
        break
    code = api.exec_inspect(exec_id).get("ExitCode")
    return -1 if code is None else code, out, err

  async def exec(self, cmd: str | Sequence[str], timeout: Optional[float] = None,
                 stdin: Optional[str] = None,
                 env: Optional[Mapping[str, str]] = None) -> ExecResult:
    self._check_open()
    cmd, timeout = process.check_exec_args(cmd, timeout, stdin, self.limits.default_timeout)
    env = {"HOME": "/tmp", "LANG": "C.UTF-8", **process.check_env(env)}
    t0 = time.monotonic()
    shell = cmd
    if stdin:
      name = f".arbor-stdin-{secrets.token_hex(6)}"
      await asyncio.to_thread(self._put, "/tmp", name, stdin.encode()
                              if isinstance(stdin, str) else stdin)
      shell = f"exec < /tmp/{name}; rm -f /tmp/{name}; {cmd}"
    argv = ["timeout", "-k", "1", f"{timeout:.3f}", "sh", "-c", shell]
    code, out, err = await asyncio.to_thread(self._run, argv, t0 + timeout + 5, env)
    duration = time.monotonic() - t0
    timed_out = code in (124, 137, -1) and duration >= timeout
    return ExecResult(exit_code=-1 if timed_out else code, stdout=out.text(), stderr=err.text(),
                      timed_out=timed_out, duration=duration, stdout_truncated=out.truncated,
                      stderr_truncated=err.truncated, stdout_bytes=out.total,
                      stderr_bytes=err.total)

  async def _check(self, path: str, parts: list[str]) -> None:
    code, *_ = await asyncio.to_thread(self._run, ["sh", "-c", _CHECK, "check", *parts],
                                       time.monotonic() + 30)
    if code == 3:
      raise PathError(f"path={path!r}: a component is a symlink")
    if code == 4:
      raise PathError(f"path={path!r}: a parent is not a directory")
    if code != 0:
      raise SandboxError(f"path check of {path!r} failed (exit {code})")

  def _put(self, directory: str, name: str, data: bytes) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
      info = tarfile.TarInfo(name)
      info.size, info.mode = len(data), 0o644
      tar.addfile(info, io.BytesIO(data))
    if not self._container.put_archive(directory, buf.getvalue()):
      raise SandboxError(f"docker: put_archive to {directory} failed")

  async def write_file(self, path: str, content: str | bytes) -> None:
    self._check_open()
    data = content.encode() if isinstance(content, str) else content
    if not isinstance(data, bytes):
      raise ValueError(f"content: expected str or bytes, got {type(content).__name__}")
    if len(data) > self.limits.file_bytes:
      raise ValueError(f"content of {path!r}: {len(data)} bytes > "
                       f"limits.file_bytes={self.limits.file_bytes}")
    parts = _parts(path)
    await self._check(path, parts)
    parent = "/".join([WORKSPACE] + parts[:-1])
    mk = await self.exec(f"mkdir -p -- {shlex.quote(parent)}", timeout=30)
    if mk.exit_code != 0:
      raise SandboxError(f"mkdir {parent}: {mk.stderr.strip()}")
    await self._check(path, parts)  # mkdir -p went through no symlink planted meanwhile
    await asyncio.to_thread(self._put, parent, parts[-1], data)

  async def read_file(self, path: str) -> bytes:
    self._check_open()
    parts = _parts(path)
    await self._check(path, parts)

    def get():
      stream, stat = self._container.get_archive("/".join([WORKSPACE] + parts))
      if stat.get("size", 0) > self.limits.file_bytes:
        raise ValueError(f"{path!r}: {stat['size']} bytes > "
                         f"limits.file_bytes={self.limits.file_bytes}")
      raw = b"".join(stream)
      with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        member = tar.next()
        if member is None or not member.isfile():
          raise PathError(f"path={path!r}: not a regular file")
        return tar.extractfile(member).read()

    try:
      return await asyncio.to_thread(get)
    except (PathError, ValueError):
      raise
    except Exception as e:  # docker.errors.NotFound
      if "404" in str(e) or "NotFound" in type(e).__name__:
        raise FileNotFoundError(f"path={path!r}: no such file") from None
      raise SandboxError(f"docker: reading {path!r}: {e}") from e

  async def list_files(self, path: str = ".") -> list[str]:
    self._check_open()
    parts = [] if path in (".", "./") else _parts(path)
    if parts:
      await self._check(path, parts)
    top = "/".join(parts) or "."
    r = await self.exec(f"[ -e {shlex.quote(top)} ] || exit 44; "
                        f"find -P {shlex.quote(top)} -type f", timeout=60)
    if r.exit_code == 44:
      raise FileNotFoundError(f"path={path!r}: no such file or directory")
    if r.exit_code != 0 or r.stdout_truncated:
      raise SandboxError(f"list {path!r}: exit {r.exit_code}, {r.stderr.strip()[:200]}")
    return sorted(os.path.normpath(l) for l in r.stdout.splitlines() if l)

  async def fork(self) -> "DockerSandbox":
    """A new container from the same image, user and limits whose workspace is a copy of this
    one's (see `Sandbox.fork`); its /tmp starts empty.

    Not `docker commit`: /workspace is a tmpfs, which a commit leaves out of the image. The
    workspace travels as a tar stream instead: the engine reads it here (as root: files made
    unreadable inside are copied too) and writes it there, each entry keeping its mode, times
    and owner (the same user runs both containers).
    """
    self._check_open()
    fork = await DockerSandbox.create(self.limits, image=self._image, user=self._user)
    return await fill_fork(fork, lambda: asyncio.to_thread(self._copy_workspace, fork))

  def _copy_workspace(self, fork: "DockerSandbox") -> None:
    """Blocking: this /workspace's content into the fork's, through a spooled tar stream."""
    stream, _ = self._container.get_archive(WORKSPACE)
    with tempfile.SpooledTemporaryFile(_SPOOL_BYTES) as raw, \
         tempfile.SpooledTemporaryFile(_SPOOL_BYTES) as out:
      for chunk in stream:
        raw.write(chunk)
      raw.seek(0)
      # The engine names entries "workspace/..."; the fork's archive is unpacked in /workspace.
      with tarfile.open(fileobj=raw, mode="r|") as src, \
           tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as dst:
        for member in src:
          member.name = member.name.partition("/")[2]
          if not member.name or not (member.isfile() or member.isdir() or member.issym()
                                     or member.islnk()):
            continue  # the workspace itself keeps the fork's own mode; no FIFOs or devices
          if member.islnk():
            member.linkname = member.linkname.partition("/")[2]
          dst.addfile(member, src.extractfile(member) if member.isfile() else None)
      out.seek(0)
      if not fork._container.put_archive(WORKSPACE, out):
        raise SandboxError(f"docker: put_archive to the fork's {WORKSPACE} failed")

  async def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    try:
      await asyncio.to_thread(self._container.remove, force=True)
    except Exception as e:
      if "404" not in str(e):
        raise SandboxError(f"docker: removing container: {e}") from e


def _parts(path: str) -> list[str]:
  """Components of a workspace-relative path (the checks of `base.confine` that need no host
  file system; symlinks are checked inside the container by `_check`)."""
  if not isinstance(path, str) or not path or "\x00" in path:
    raise PathError(f"path={path!r}: expected a non-empty workspace-relative path")
  if path.startswith("/"):
    raise PathError(f"path={path!r}: absolute paths are not allowed (workspace-relative only)")
  parts = [p for p in path.split("/") if p not in ("", ".")]
  if ".." in parts:
    raise PathError(f"path={path!r}: '..' is not allowed")
  if not parts:
    raise PathError(f"path={path!r}: names the workspace itself")
  return parts
