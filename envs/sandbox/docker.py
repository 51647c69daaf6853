"""`docker` backend (docker-py): one container per sandbox.

Size: the container's life and its file API over `docker exec` live here together; the
file API (~150 lines) is the part to move out when this module grows.

The container runs `sleep infinity` from `image` with no network (`network_mode="none"`: no
sandbox is ever given one, and the engine Arbor starts has no bridge to give), a read-only
root file system, tmpfs /workspace and /tmp of `limits.disk_mb` with an inode quota (exec
allowed, nosuid, nodev) and /dev/shm of the same size, memory = memory+swap, pids and CPU
limits, a non-root user (default 65534:65534), every capability dropped, no-new-privileges,
the seccomp profile of `seccomp.docker_profile` (the bwrap backend's deny list as a Docker
profile: keyring, io_uring, bpf, userfaultfd, perf, ptrace, module/kexec/clock/mount calls,
socket families other than AF_UNIX and AF_INET/AF_INET6 (the container's loopback), plus the
namespace and other calls Docker's default profile denies, since a custom profile replaces it)
and Docker's init as pid 1. Keyrings: Docker gives each container a fresh session keyring,
and the profile denies the keyring calls.

Everything runs through `docker exec` as the sandbox user, the file API included: a command
is `timeout -k 1 T sh -c cmd` (the image needs `sh` and coreutils' `timeout`, `stat`, `find`,
`tar`), its stdin streamed in over the exec's connection and its output streamed out and
capped; the client also stops reading at the deadline. What a command leaves running (a
background job, a `setsid` daemon) is killed once no operation of the sandbox is in flight any
more (`_SWEEP`, one more exec), as bwrap's per-exec PID namespace ends it; commands that run
at the same time share the container, so a leftover of one lives until the last ends. Files
move in and out as
the stdin and stdout of small shell scripts that walk the path one component at a time and
refuse symlinks (the engine's archive API cannot be used: it refuses to write into a container
whose root is read-only, and does not see inside tmpfs mounts). Since those scripts run inside
the container with the sandbox's own uid and no capabilities, a symlink swapped in mid-way
reaches nothing the sandbox could not reach itself; for the same reason a file the sandbox
made unreadable (or read-only) raises PermissionError from read_file (write_file), where bwrap,
reading and writing as root on the host, succeeds. `fork()` streams /workspace as a tar
archive from this container into a new one of the same image, user and limits.

Docker's additions to the image are kept small: /etc/hosts (localhost only), /etc/hostname,
/etc/resolv.conf naming 127.0.0.1 (the container's own loopback, where nothing answers; not
the host's resolvers), and /dev/mqueue is an empty read-only tmpfs.

The image's name picks its profile (`envs.sandbox.images`): the workspace's path (/testbed
for SWE-bench / SWE-smith images), what every command's environment adds (their conda env on
PATH), the default user, and whether the workspace starts as a copy of the image's own content
there (the repository with what its editable install built), unpacked by the sandbox user
like a fork's. An absent image is pulled when the profile allows it and a registry answers;
otherwise `create` names the image and the fallbacks (`envs.environments`, `docker load`).

The engine: `docker_engine.ensure_engine()` (or `python -m envs.sandbox.docker_engine`)
starts the local one when none answers. `DOCKER_HOST` may name a remote engine only over TLS
(DOCKER_TLS_VERIFY=1, DOCKER_CERT_PATH): plain tcp:// and ssh:// are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import select
import socket
import struct
import tarfile
import tempfile
import threading
import time
from typing import Callable, Mapping, Optional, Sequence

from envs.sandbox import hostfs, images, process, seccomp
from envs.sandbox.base import (ExecResult, Limits, PathError, Sandbox, SandboxError,
                               fill_fork)

WORKSPACE = "/workspace"
# Docker mounts the message-queue file system of the container's IPC namespace at /dev/mqueue,
# writable by everyone; an empty read-only tmpfs takes its place, so that nothing outside
# /workspace, /tmp and /dev/shm can be written (mq_open does not need the mount).
_EMPTY = "ro,size=4k,mode=0555,nosuid,nodev,noexec"
# Kills what commands left running: every process but pid 1 (Docker's init), the container's
# main process (the oldest other one: `sleep infinity` started first) and itself, in rounds
# until none is left (a process may fork while it is killed). /proc/PID/stat: the command name
# may hold spaces and parentheses, so the fields are counted after its last ")"; the start
# time is the 22nd field.
_SWEEP = r'''
for round in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16; do
  main=; oldest=; others=
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    [ "$p" = 1 ] || [ "$p" = $$ ] && continue
    read -r s < "$d/stat" 2>/dev/null || continue
    set -- ${s##*) }
    if [ -z "$main" ] || [ "${20}" -lt "$oldest" ]; then
      others="$others $main"; main=$p; oldest=${20}
    else
      others="$others $p"
    fi
  done
  [ -z "${others# }" ] && exit 0
  kill -9 $others 2>/dev/null
done
exit 1
'''
_SPOOL_BYTES = 16 << 20  # a fork's workspace archive stays in memory up to this, then on disk
_OP_TIMEOUT = 120.0      # seconds for one file-API transfer or one side of a fork's copy
# The file API's path walk. $1: write | read | list; $2: the size (write: of the input; read:
# the cap; list: the depth cap); then the components.
# Parents are entered one at a time with `cd -P` after a symlink test (write makes missing
# ones); exit codes: 3 a symlink, 4 a parent that is not a directory, 5 missing, 6 not a
# regular file, 7 too large (size on stderr), 8 a parent the sandbox user cannot enter.
_WALK = r'''
op=$1; cap=$2; shift 2; cd /workspace || exit 2
while [ $# -gt 1 ]; do
  [ -L "$1" ] && exit 3
  if [ ! -e "$1" ]; then [ "$op" = write ] || exit 5; mkdir -- "$1" || exit 4; fi
  [ -d "$1" ] || exit 4; cd -P -- "$1" 2>/dev/null || exit 8; shift
done
if [ $# -eq 0 ]; then set -- .; else [ -L "$1" ] && exit 3; fi
case $op in
write) [ -e "$1" ] && [ ! -f "$1" ] && exit 6; exec head -c "$cap" > "./$1";;
read) [ -e "$1" ] || exit 5; [ -f "$1" ] || exit 6
      size=$(stat -c %s -- "$1") || exit 2
      [ "$size" -gt "$cap" ] && { echo "$size" >&2; exit 7; }; exec head -c $((cap + 1)) -- "./$1";;
list) [ -e "$1" ] || exit 5; exec find -P "./$1" -maxdepth $((cap + 1)) -printf '%y %d %p\0';;
esac
exit 2
'''
# A fork's source side. Entries the sandbox user cannot read (a file without u+r, a directory
# without u+rx) get that bit while tar reads them; `_UNLOCK` prints their original modes as
# "MODE ./PATH\0" (the copy restores them in the archive, `_RESTORE` here afterwards). A
# directory is opened up before find descends into it (`;`), files in batches (`+`).
_UNLOCK = r'''
cd /workspace || exit 2
exec find . -mindepth 1 \( -type d ! -perm -u=rx -printf '%m %p\0' -exec chmod u+rx {} \; \) \
  -o \( -type f ! -perm -u=r -printf '%m %p\0' -exec chmod u+r {} + \)
'''
_PACK = 'cd /workspace && exec tar -cf - --numeric-owner .'
# $0: the size of the input (MODE\0PATH\0 pairs; the archive).
_RESTORE = 'cd /workspace && head -c "$0" | xargs -0 -r -n 2 chmod --'
_UNPACK = ('cd /workspace && head -c "$0" | tar -xf - --no-same-owner '
           '--delay-directory-restore')
# $0: the size of the input, the engine's archive of the image's workspace folder, whose
# entries all sit under that folder's own name (dropped).
_SEED = ('cd /workspace && head -c "$0" | tar -xf - --no-same-owner '
         '--delay-directory-restore --strip-components=1')


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


class _Bytes:
  """All of a stream up to `cap` bytes; `over` is set when more came (the rest is dropped)."""

  def __init__(self, cap: int):
    self.data, self.cap, self.over = bytearray(), cap, False

  def add(self, chunk: bytes) -> None:
    room = self.cap - len(self.data)
    self.data += chunk[:max(0, room)]
    self.over = self.over or len(chunk) > room


class DockerSandbox(Sandbox):
  """One container per sandbox (see the module docstring).

  Create with `await DockerSandbox.create(limits, image=..., user=...)`. `workspace_path` is
  the profile's workspace (/workspace for Arbor's images, /testbed for SWE images).
  """

  workspace_path = WORKSPACE

  def __init__(self, client, container, limits: Limits, image: str = "", user: str = "",
               profile: images.ImageProfile = images.ARBOR,
               binds: Sequence[tuple[str, str]] = ()):
    self._client, self._container, self.limits, self._closed = client, container, limits, False
    self._image, self._user, self.profile = image, user, profile  # for fork()
    self._binds = tuple(binds)
    self.workspace_path = profile.workspace
    # Operations in flight (commands, file transfers), whether a command ran since the last
    # sweep, and the sweep running now (operations wait for it).
    self._busy, self._dirty, self._sweeping = 0, False, None

  @classmethod
  async def create(cls, limits: Limits = Limits(), *, image: str = "python:3.11-slim",
                   user: Optional[str] = None, seed: bool = True,
                   binds: Sequence[tuple[str, str]] = ()) -> "DockerSandbox":
    """Starts a container.

    Args:
      limits: the sandbox's limits; with a seeded workspace, `disk_mb` must hold the copy.
      image: the image; its name picks the profile (`images.profile_for`). Absent from the
        engine, it is pulled when the profile allows it and a registry answers. It needs `sh`
        and coreutils, findutils and tar.
      user: "uid[:gid]" the commands run as (numeric ids need no entry in the image's
        /etc/passwd); never root. None: the profile's user.
      seed: start the workspace as a copy of the image's content at that path when the
        profile says the image holds the repository there (`fork` passes False: it copies
        the workspace it forks instead).
      binds: (host_path, container_path) pairs bound read-only (e.g. the directory of a
        scaffold's channel socket: connecting to a socket needs no write access); both
        absolute, the host path existing on the engine's host.

    Returns:
      The started sandbox.

    Raises:
      ValueError: user or its group is root, `image` is not a string, or a binds entry is not
        a pair of absolute paths with an existing host path.
      SandboxError: no usable Docker engine, the image is absent and cannot be pulled (the
        message names it and the fallbacks), the container could not start, or the seed copy
        failed (e.g. larger than limits.disk_mb).
    """
    profile = images.profile_for(image)
    user = profile.user if user is None else user
    uid, _, gid = user.partition(":")
    if uid in ("0", "root", "") or gid in ("0", "root"):
      raise ValueError(f"user={user!r}: the sandbox user and group must not be root")
    ws = profile.workspace
    volumes = {}
    for b in binds:
      if not (isinstance(b, (tuple, list)) and len(b) == 2 and all(
          isinstance(p, str) and os.path.isabs(p) for p in b) and os.path.exists(b[0])):
        raise ValueError(f"binds entry {b!r}: expected (existing absolute host path, absolute "
                         "container path)")
      volumes[b[0]] = {"bind": b[1], "mode": "ro"}

    def start():
      try:
        client = docker_client()
        client.ping()
      except SandboxError:
        raise
      except Exception as e:  # docker.errors.DockerException: nothing answers at the socket
        raise SandboxError(f"docker: no Docker engine answers ({e}); start the local one with "
                           "`python -m envs.sandbox.docker_engine` (as root)") from e
      try:
        images.ensure_image(client, image, profile.pull)
      except LookupError as e:
        raise SandboxError(f"docker: {e}") from None
      opts = (f"size={limits.disk_mb}m,nr_inodes={max(1024, limits.disk_mb * 256)},mode=0700,"
              f"uid={uid},gid={gid or uid},exec,nosuid,nodev")
      container = client.containers.run(
          image, ["sleep", "infinity"], detach=True, network_mode="none", user=user,
          cap_drop=["ALL"], security_opt=seccomp.docker_security_opt(inet=True),
          read_only=True, init=True,
          mem_limit=f"{limits.memory_mb}m", memswap_limit=f"{limits.memory_mb}m",
          pids_limit=limits.pids, nano_cpus=int(limits.cpus * 1e9),
          shm_size=f"{limits.disk_mb}m", working_dir=ws, environment={},
          tmpfs={ws: opts, "/tmp": opts, "/dev/mqueue": _EMPTY}, dns=["127.0.0.1"],
          labels={"arbor.sandbox": "1"}, volumes=volumes)
      return client, container

    try:
      client, container = await asyncio.to_thread(start)
    except SandboxError:
      raise
    except Exception as e:  # docker.errors.*: engine down, image missing, ...
      raise SandboxError(f"docker: could not start a container from {image!r}: {e}") from e
    sb = cls(client, container, limits, image, user, profile, binds)
    if seed and profile.seed:
      try:
        await asyncio.to_thread(sb._seed)
      except BaseException:
        await sb.close()
        raise
    return sb

  def _script(self, script: str) -> str:
    """A shell script of this module with its `cd /workspace` moved to this workspace (a
    plain absolute path: `ImageProfile` checks it)."""
    return script.replace("cd /workspace", f"cd {self.workspace_path}")

  def _seed(self) -> None:
    """Blocking: the image's content at the workspace path into the workspace (see `create`):
    the engine's archive of that folder (`images.read_folder`), spooled here, unpacked by the
    sandbox user inside the sandbox."""
    err = _Bytes(4096)
    with tempfile.SpooledTemporaryFile(_SPOOL_BYTES) as raw:
      try:
        images.read_folder(self._client, self._image, self.workspace_path, raw.write)
      except LookupError as e:
        raise SandboxError(f"docker: {e} (profile {self.profile.name} seeds the workspace "
                           "from it)") from None
      size = raw.tell()
      raw.seek(0)

      def send(push):
        while chunk := raw.read(1 << 16):
          push(chunk)

      code = self._stream(["sh", "-c", self._script(_SEED), str(size)],
                          time.monotonic() + _OP_TIMEOUT, _Bytes(0).add, err.add, stdin=send)
    if code != 0:
      message = bytes(err.data).decode(errors="replace")
      if "No space left" in message:
        message = f"larger than limits.disk_mb={self.limits.disk_mb}: {message}"
      raise SandboxError(f"docker: seeding {self.workspace_path} from image {self._image!r} "
                         f"failed (exit {code}): {message[:300]}")

  def _check_open(self) -> None:
    if self._closed:
      raise SandboxError("sandbox is closed")

  @contextlib.asynccontextmanager
  async def _op(self, command: bool = False):
    """Brackets one operation; when the last one in flight ends after a command, kills what
    the commands left running (`_SWEEP`), as bwrap's per-exec PID namespace does."""
    while self._sweeping is not None:
      await asyncio.shield(self._sweeping)
    self._check_open()
    self._busy += 1
    try:
      yield
    finally:
      self._busy -= 1
      self._dirty = self._dirty or command
      if self._busy == 0 and self._dirty and not self._closed:
        # Set before any await, so no operation starts in between; cleared when the sweep is
        # done, even if this caller is cancelled meanwhile.
        self._dirty = False
        sweeping = self._sweeping = asyncio.ensure_future(asyncio.to_thread(self._sweep))
        sweeping.add_done_callback(lambda f: setattr(self, "_sweeping", None))
        await asyncio.shield(sweeping)

  def _sweep(self) -> None:
    """Blocking: runs `_SWEEP` until the engine lists only Docker's init and the main process in
    the container (usually at once: listing costs a third of an exec). A fork bomb may hold
    every pid the container has, so an exec that cannot start is tried again for a while. A
    sandbox removed meanwhile is no error."""
    deadline, why = time.monotonic() + 30, ""
    while True:
      try:
        if len(self._client.api.top(self._container.id, ps_args="-o pid")["Processes"]) <= 2:
          return
        code = self._stream(["sh", "-c", _SWEEP], time.monotonic() + 30, _Bytes(0).add,
                            _Bytes(0).add)
        why = f"exit {code}"
      except Exception as e:  # docker.errors.*: closed, the container died, no pid left
        if self._closed:
          return
        why = f"{type(e).__name__}: {e}"
      if time.monotonic() > deadline:
        raise SandboxError(f"docker: processes a command left behind survived ({why[:300]})")
      time.sleep(0.1)

  def _stream(self, argv: list[str], deadline: float, out, err, *,
              stdin: Optional[Callable[[Callable[[bytes], None]], None]] = None,
              env: Optional[dict] = None) -> int:
    """Blocking: runs argv in the container (as its user, in its workspace) and waits.

    Args:
      argv: the program and its arguments.
      deadline: `time.monotonic()` after which reading stops (the exit code is then unknown).
      out, err: called with each chunk of stdout and of stderr.
      stdin: called in a thread with a `send(bytes)` function to feed the standard input (a
        process that exits without reading it all is no error). The input is never closed
        (a TLS connection cannot be half-closed from Python), so the command reads exactly
        what is sent, e.g. through `head -c N`. None: no standard input.
      env: the environment.

    Returns:
      The exit status, or -1 if it is not known by the deadline.
    """
    api = self._client.api
    exec_id = api.exec_create(self._container.id, argv, stdin=stdin is not None, stdout=True,
                              stderr=True, workdir=self.workspace_path,
                              environment=env or {})["Id"]
    # The exec's HTTP connection, upgraded to a raw stream (what docker-py's exec_start does);
    # the buffered reader keeps any bytes that arrived with the response's headers.
    res = api._post_json(api._url("/exec/{0}/start", exec_id), stream=True,
                         headers={"Connection": "Upgrade", "Upgrade": "tcp"},
                         data={"Tty": False, "Detach": False})
    api._raise_for_status(res)
    reader = res.raw._fp.fp
    sock = reader.raw._sock
    writer = None
    try:
      # Bytes that came with the response's headers wait in the reader's buffer; take them
      # (without blocking, and before the writer below uses the socket), then read the socket.
      sock.setblocking(False)
      try:
        pending = reader.peek()
        buf = bytearray(reader.read(len(pending)) if pending else b"")
      except BlockingIOError:
        buf = bytearray()
      finally:
        sock.setblocking(True)
      if stdin is not None:
        def feed():
          try:
            stdin(sock.sendall)
          except OSError:  # the process exited without reading it all
            pass
        writer = threading.Thread(target=feed, daemon=True)
        writer.start()
      poller = select.poll()  # not select(): a busy worker's descriptors pass FD_SETSIZE
      poller.register(sock, select.POLLIN)
      # Multiplexed frames: 1 byte stream (1 stdout, 2 stderr), 3 zero bytes, 4 bytes length.
      sinks = {1: out, 2: err}
      while True:
        while len(buf) >= 8:
          kind, size = struct.unpack(">BxxxL", buf[:8])
          if len(buf) < 8 + size:
            break
          if kind in sinks:
            sinks[kind](bytes(buf[8:8 + size]))
          del buf[:8 + size]
        left = deadline - time.monotonic()
        tls_pending = getattr(sock, "pending", lambda: 0)()
        if left <= 0 or not (tls_pending or poller.poll(left * 1000)):
          return -1
        chunk = sock.recv(1 << 16)
        if not chunk:
          break
        buf += chunk
    finally:
      try:
        sock.shutdown(socket.SHUT_RDWR)  # also ends a writer still blocked in sendall
      except OSError:
        pass
      res.close()
      if writer is not None:
        writer.join(5)
    # The stream ends when the process's output is closed; its exit is recorded just after.
    while True:
      info = api.exec_inspect(exec_id)
      if not info.get("Running") or time.monotonic() > deadline:
        code = info.get("ExitCode")
        return -1 if code is None or info.get("Running") else code
      time.sleep(0.01)

  async def exec(self, cmd: str | Sequence[str], timeout: Optional[float] = None,
                 stdin: Optional[str] = None,
                 env: Optional[Mapping[str, str]] = None) -> ExecResult:
    self._check_open()
    cmd, timeout = process.check_exec_args(cmd, timeout, stdin, self.limits.default_timeout)
    env = {"HOME": "/tmp", "LANG": "C.UTF-8", **dict(self.profile.env),
           **process.check_env(env)}
    data = stdin.encode() if isinstance(stdin, str) else stdin
    argv = ["timeout", "-k", "1", f"{timeout:.3f}", "sh", "-c", cmd]
    if data is not None:  # the command's input ends after len(data) bytes (see `_stream`)
      argv = ["sh", "-c", 'head -c "$0" | "$@"', str(len(data)), *argv]
    out, err = process.CappedOutput(self.limits.output_bytes), \
        process.CappedOutput(self.limits.output_bytes)
    async with self._op(command=True):
      t0 = time.monotonic()
      try:
        code = await asyncio.to_thread(self._stream, argv, t0 + timeout + 5, out.add, err.add,
                                       stdin=None if data is None else lambda send: send(data),
                                       env=env)
      except Exception as e:  # docker.errors.*, a broken connection
        if not self._closed:
          raise SandboxError(f"docker: running {cmd[:100]!r}: {type(e).__name__}: {e}") from e
        code = 128 + 9  # close() removed the container (SIGKILL) while the command ran
      duration = time.monotonic() - t0
    timed_out = code in (124, 137, -1) and duration >= timeout
    return ExecResult(exit_code=-1 if timed_out else code, stdout=out.text(), stderr=err.text(),
                      timed_out=timed_out, duration=duration, stdout_truncated=out.truncated,
                      stderr_truncated=err.truncated, stdout_bytes=out.total,
                      stderr_bytes=err.total)

  async def _walk(self, op: str, path: str, parts: list[str], cap: int, out,
                  data: Optional[bytes] = None) -> None:
    """Runs `_WALK` for `op` on the components `parts` of `path`; raises what its exit means."""
    err = _Bytes(4096)
    async with self._op():
      try:
        code = await asyncio.to_thread(
            self._stream, ["sh", "-c", self._script(_WALK), "walk", op,
                           str(cap if data is None else len(data)), *parts],
            time.monotonic() + _OP_TIMEOUT, out.add, err.add,
            stdin=None if data is None else lambda send: send(data))
      except Exception as e:  # docker.errors.*, a broken connection
        raise SandboxError(f"docker: {op} of {path!r}: {type(e).__name__}: {e}") from e
    message = bytes(err.data).decode(errors="replace").strip()
    if code == 0:
      return
    if code == 3:
      raise PathError(f"path={path!r}: a component is a symlink")
    if code == 4:
      raise PathError(f"path={path!r}: a parent is not a directory")
    if code == 5:
      raise FileNotFoundError(errno.ENOENT, f"path={path!r}: no such file or directory")
    if code == 6:
      raise PathError(f"path={path!r}: not a regular file")
    if code == 7:
      raise ValueError(f"{path!r}: {message} bytes > limits.file_bytes={cap}")
    if code == 8:
      raise PermissionError(errno.EACCES, f"path={path!r}: the sandbox user may not enter a "
                            "parent directory (its mode)")
    if "No space left" in message or "Disk quota" in message:
      raise OSError(errno.ENOSPC, f"path={path!r}: the workspace is full ({message})")
    if "Permission denied" in message:
      raise PermissionError(errno.EACCES, f"path={path!r}: {message}")
    raise SandboxError(f"docker: {op} of {path!r} failed (exit {code}): {message[:300]}")

  async def write_file(self, path: str, content: str | bytes) -> None:
    self._check_open()
    data = content.encode() if isinstance(content, str) else content
    if not isinstance(data, bytes):
      raise ValueError(f"content: expected str or bytes, got {type(content).__name__}")
    if len(data) > self.limits.file_bytes:
      raise ValueError(f"content of {path!r}: {len(data)} bytes > "
                       f"limits.file_bytes={self.limits.file_bytes}")
    await self._walk("write", path, _parts(path), self.limits.file_bytes, _Bytes(4096), data)

  async def read_file(self, path: str) -> bytes:
    self._check_open()
    cap = self.limits.file_bytes
    out = _Bytes(cap)
    await self._walk("read", path, _parts(path), cap, out)
    if out.over:  # grew between the size check and the read
      raise ValueError(f"{path!r}: more than limits.file_bytes={cap} bytes")
    return bytes(out.data)

  async def list_files(self, path: str = ".") -> list[str]:
    """See `Sandbox.list_files`; bounded like `hostfs.list_files` (MAX_DEPTH, MAX_ENTRIES)."""
    self._check_open()
    parts = [] if path in (".", "./") else _parts(path)
    # find prints "TYPE DEPTH ./PATH\0" per entry, down to one level below the deepest walked.
    out = _Bytes((hostfs.MAX_ENTRIES + 1) * 512)
    await self._walk("list", path, parts, hostfs.MAX_DEPTH, out)
    entries = bytes(out.data).split(b"\0")[:-1]
    if out.over or len(entries) > hostfs.MAX_ENTRIES + 1:
      raise ValueError(f"list_files(path={path!r}): more than "
                       f"max_entries={hostfs.MAX_ENTRIES} entries")
    prefix, files = "/".join(parts[:-1]), []
    for entry in entries:
      kind, depth, name = entry.split(b" ", 2)
      if kind == b"d" and int(depth) > hostfs.MAX_DEPTH:
        raise ValueError(f"list_files(path={path!r}): deeper than "
                         f"max_depth={hostfs.MAX_DEPTH} levels")
      if kind == b"f":
        name = os.path.normpath(os.fsdecode(name))
        files.append(f"{prefix}/{name}" if prefix else name)
    return sorted(files)

  async def fork(self) -> "DockerSandbox":
    """A new container from the same image, user and limits whose workspace is a copy of this
    one's (see `Sandbox.fork`); its /tmp starts empty.

    Not `docker commit`: /workspace is a tmpfs, which a commit leaves out of the image. The
    workspace travels as a tar stream instead, packed here and unpacked there by the sandbox
    user (the same in both containers), each entry keeping its mode and mtime. The user owns
    every entry of its workspace, so one it made unreadable (mode 000) is given read access
    for the time tar reads it; its mode is restored here and written into the archive.
    """
    self._check_open()
    fork = await DockerSandbox.create(self.limits, image=self._image, user=self._user,
                                      seed=False, binds=self._binds)

    async def copy():
      async with self._op():
        await asyncio.to_thread(self._copy_workspace, fork)
    return await fill_fork(fork, copy)

  def _copy_workspace(self, fork: "DockerSandbox") -> None:
    """Blocking: this workspace's content into the fork's, through a spooled tar stream."""
    modes, err = _Bytes(64 << 20), _Bytes(4096)
    code = self._stream(["sh", "-c", self._script(_UNLOCK)], time.monotonic() + _OP_TIMEOUT,
                        modes.add, err.add)
    changed = [e.split(b" ", 1) for e in bytes(modes.data).split(b"\0") if b" " in e]
    with tempfile.SpooledTemporaryFile(_SPOOL_BYTES) as raw, \
         tempfile.SpooledTemporaryFile(_SPOOL_BYTES) as out:
      try:
        code = -2 if code != 0 else self._stream(
            ["sh", "-c", self._script(_PACK)], time.monotonic() + _OP_TIMEOUT, raw.write,
            err.add)
      finally:  # the modes go back even when the copy failed half-way
        if changed:  # children before their parents: a directory may lose its x bit again
          listing = b"".join(m + b"\0" + p + b"\0" for m, p in reversed(changed))
          self._stream(["sh", "-c", self._script(_RESTORE), str(len(listing))],
                       time.monotonic() + _OP_TIMEOUT, _Bytes(0).add, _Bytes(0).add,
                       stdin=lambda send: send(listing))
      # -2: _UNLOCK failed; 1: a file changed while tar read it (fine: a snapshot, see fork)
      if code not in (0, 1):
        raise SandboxError(f"docker: packing the workspace failed (exit {code}): "
                           f"{bytes(err.data).decode(errors='replace')[:300]}")
      original = {os.path.normpath(os.fsdecode(p)): int(m, 8) for m, p in changed}
      raw.seek(0)
      with tarfile.open(fileobj=raw, mode="r|") as src, \
           tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as dst:
        for member in src:
          name = os.path.normpath(member.name)
          if name == "." or not (member.isfile() or member.isdir() or member.issym()
                                 or member.islnk()):
            continue  # the workspace itself keeps the fork's own mode; no FIFOs or devices
          if name in original:
            member.mode = (member.mode & ~0o7777) | original[name]
          dst.addfile(member, src.extractfile(member) if member.isfile() else None)
      size = out.tell()
      out.seek(0)
      err = _Bytes(4096)

      def send_archive(send):
        while chunk := out.read(1 << 16):
          send(chunk)

      code = fork._stream(["sh", "-c", fork._script(_UNPACK), str(size)],
                          time.monotonic() + _OP_TIMEOUT, _Bytes(4096).add, err.add,
                          stdin=send_archive)
      if code != 0:
        raise SandboxError(f"docker: unpacking the fork's workspace failed (exit {code}): "
                           f"{bytes(err.data).decode(errors='replace')[:300]}")

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
  file system; symlinks are refused inside the container by `_WALK`)."""
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
