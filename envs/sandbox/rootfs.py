"""A task root filesystem bound into a bwrap sandbox without following a link on the host.

A root filesystem (an unpacked task image) is untrusted content: any entry of it may be a
symbolic link, and a bind that followed one on the host would put host paths in the sandbox
(with `etc -> /`, the host's processes, its /tmp and its UNIX sockets). The rule: **nothing
bwrap binds from a root filesystem, or creates inside it, is reached through a link on the
host.**

- The root filesystem's path is opened one component at a time from `/` with
  O_PATH|O_DIRECTORY|O_NOFOLLOW (`open_dir`): a link anywhere on it, the last component
  included, is refused with ValueError, so the path names the very directory it spells.
- Each top-level entry is opened relative to that descriptor with O_PATH|O_NOFOLLOW. A
  directory or a regular file is bound read-only from its descriptor (`bwrap --ro-bind-fd N
  DEST`: bwrap mounts the path the descriptor resolves to, stops unless the mount holds the
  descriptor's very inode, and closes the descriptor before the command starts; a plain bind
  of `/proc/self/fd/N` would leave it open in the sandbox, where a descriptor of a host
  directory leads out through `..`). A link is made again inside the
  sandbox with the same target (`--symlink TARGET DEST`) and so is resolved in the sandbox's
  own mount namespace, never on the host. Other kinds (devices, FIFOs, sockets) are left out,
  and so are the entries the sandbox provides itself (`SKIP`).
- The sandbox's generated passwd and group are bound over the image's only where `etc` is a
  directory and they are regular files, all checked on descriptors.
- While it sets up, bwrap creates the missing mount points of later binds by path, following
  links, in a mount namespace where the host's root is still reachable (as `/oldroot`): an
  extra bind whose sandbox path crosses a link of the image is refused (`check`).

Descriptors are opened for each exec; the caller passes them to the bwrap child and closes
its own copies once the child has started.
"""

from __future__ import annotations

import errno
import functools
import os
import posixpath
import stat
import subprocess
from typing import Iterable, Mapping, NamedTuple, Optional

from envs.sandbox.base import SandboxError

# Top-level entries of a root filesystem that the sandbox provides itself.
SKIP = frozenset({"proc", "dev", "sys", "tmp", "run", "workspace", "root", "home", "mnt",
                  "media", "lost+found"})
_DIR = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_ANY = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


def open_dir(path: str) -> int:
  """An O_PATH descriptor of directory `path`, reached from `/` without following a link.

  Args:
    path: the root filesystem's path (made absolute against the working directory).

  Returns:
    The descriptor (close-on-exec); the caller closes it.

  Raises:
    ValueError: a component of the path is a link, not a directory, or missing.
  """
  parts = [p for p in posixpath.normpath(os.path.abspath(path)).split("/") if p]
  fd = os.open("/", _DIR)
  try:
    for i, part in enumerate(parts):
      try:
        new = os.open(part, _DIR, dir_fd=fd)
      except OSError as e:
        where = "/" + "/".join(parts[:i + 1])
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
          kind = "a link" if _is_link(part, fd) else "not a directory"
          raise ValueError(f"rootfs={path!r}: {where} is {kind} (a root filesystem is given by "
                           "its real path, with no link on the way)") from None
        raise ValueError(f"rootfs={path!r}: {where}: {os.strerror(e.errno)}") from None
      os.close(fd)
      fd = new
    return fd
  except BaseException:
    os.close(fd)
    raise


def real_path(path: str) -> str:
  """The path of directory `path` as its descriptor resolves it (`open_dir`): equal to the
  normalized absolute `path`, since no link on the way is accepted.

  Raises:
    ValueError: as `open_dir`.
  """
  fd = open_dir(path)
  try:
    return os.readlink(f"/proc/self/fd/{fd}")
  finally:
    os.close(fd)


def _is_link(name: str, dir_fd: int) -> bool:
  try:
    return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
  except OSError:
    return False


def _names(dir_fd: int) -> list[str]:
  fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
  try:
    return os.listdir(fd)
  finally:
    os.close(fd)


def _open_entry(name: str, dir_fd: int) -> tuple[int, os.stat_result]:
  fd = os.open(name, _ANY, dir_fd=dir_fd)
  try:
    return fd, os.fstat(fd)
  except BaseException:
    os.close(fd)
    raise


class Binds(NamedTuple):
  """bwrap arguments for a root filesystem and the descriptors they name."""
  args: list[str]      # the top-level entries
  identity: list[str]  # the generated /etc files bound over the image's
  fds: list[int]       # for the bwrap child (which closes them); the caller closes its own


def binds(path: Optional[str], identity: Mapping[str, str]) -> Binds:
  """bwrap arguments that show root filesystem `path` read-only, with descriptors opened now.

  Args:
    path: the root filesystem; None: no arguments, no descriptors.
    identity: generated `/etc` files to bind over the image's ({"passwd": host file, ...});
      each is bound only where the image's `etc` is a directory holding a regular file of
      that name.

  Returns:
    The arguments and descriptors; the descriptors must be passed to the bwrap child and
    closed by the caller once the child has started (or failed to).

  Raises:
    ValueError: as `open_dir`.
  """
  args, ident, fds = [], [], []
  if path is None:
    return Binds(args, ident, fds)
  root = open_dir(path)
  try:
    for name in sorted(set(_names(root)) - SKIP):
      try:
        fd, st = _open_entry(name, root)
      except FileNotFoundError:  # removed while listing
        continue
      if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        try:
          if stat.S_ISLNK(st.st_mode):  # the link this descriptor holds, made again inside
            args += ["--symlink", os.readlink("", dir_fd=fd), "/" + name]
        finally:
          os.close(fd)
        continue
      fds.append(fd)
      args += ["--ro-bind-fd", str(fd), "/" + name]
      if name == "etc" and stat.S_ISDIR(st.st_mode):
        ident = _identity_binds(fd, identity)
  except BaseException:
    close_all(fds)
    raise
  finally:
    os.close(root)
  return Binds(args, ident, fds)


def close_all(fds: list[int]) -> None:
  """Closes and forgets every descriptor of `fds`."""
  while fds:
    os.close(fds.pop())


def _identity_binds(etc_fd: int, identity: Mapping[str, str]) -> list[str]:
  args = []
  for name, host_file in identity.items():
    try:
      mode = os.stat(name, dir_fd=etc_fd, follow_symlinks=False).st_mode
    except OSError:
      continue
    if stat.S_ISREG(mode):
      args += ["--ro-bind", host_file, "/etc/" + name]
  return args


@functools.lru_cache(maxsize=None)
def bwrap_binds_fds(bwrap: str) -> bool:
  """Whether this bwrap has `--ro-bind-fd` (bubblewrap >= 0.5)."""
  r = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30)
  return "--ro-bind-fd" in r.stdout + r.stderr


def check(path: str, dests: Iterable[str], bwrap: Optional[str] = None) -> None:
  """Checks, before a sandbox starts, that root filesystem `path` can be bound safely.

  Args:
    path: the root filesystem.
    dests: absolute sandbox paths of the extra binds.
    bwrap: the bwrap binary, checked for `--ro-bind-fd`; None: not checked.

  Raises:
    ValueError: `path` fails `open_dir`, or a destination crosses a link of the image (its
      last component included): bwrap would follow it on the host while making the mount
      point.
    SandboxError: bwrap lacks `--ro-bind-fd`.
  """
  if bwrap is not None and not bwrap_binds_fds(bwrap):
    raise SandboxError(f"{bwrap} lacks --ro-bind-fd: binding a root filesystem needs "
                       "bubblewrap >= 0.5")
  root = open_dir(path)
  try:
    for dest in dests:
      parts = [p for p in posixpath.normpath(dest).split("/") if p]
      if not parts or parts[0] in SKIP:
        continue
      fd = os.dup(root)
      try:
        for i, part in enumerate(parts):
          try:
            new, st = _open_entry(part, fd)
          except OSError:  # missing (bwrap makes it on the sandbox's side) or unreadable
            break
          os.close(fd)
          fd = new
          if stat.S_ISLNK(st.st_mode):
            raise ValueError(f"ro_binds destination {dest!r}: /{'/'.join(parts[:i + 1])} is a "
                             f"link in rootfs={path!r}; bind to a path the image has as a "
                             "directory")
          if not stat.S_ISDIR(st.st_mode):
            break
      finally:
        os.close(fd)
  finally:
    os.close(root)
