"""The file API on a host directory that untrusted code can modify concurrently.

`confine` rejects absolute paths and `..` up front; the walk below then opens every component
relative to its parent's descriptor with O_NOFOLLOW, so a symlink planted by the sandbox (even
between the check and the open) is never followed, and a FIFO or device is never opened for
real I/O (O_NONBLOCK + a regular-file check). `copy_tree` copies a workspace the same way
(for `Sandbox.fork`). Used by the local and bwrap backends.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import Iterator, Optional

from envs.sandbox.base import PathError, confine

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# list_files bounds: deeper or larger trees are refused rather than walked (a sandbox makes
# them in a second; a real project is far below both).
MAX_DEPTH = 256
MAX_ENTRIES = 200_000


def _parts(root: str, path: str) -> list[str]:
  confine(root, path)  # absolute / `..` / NUL / existing symlinks: clear errors first
  return [p for p in path.split("/") if p not in ("", ".")]


@contextlib.contextmanager
def _walk(root: str, path: str, parts: list[str], create: bool = False,
          owner: Optional[tuple[int, int]] = None) -> Iterator[int]:
  """A descriptor of the directory root/parts (created if asked), never through a symlink."""
  fd = os.open(root, _DIR)
  try:
    for part in parts:
      try:
        new = os.open(part, _DIR, dir_fd=fd)
      except FileNotFoundError:
        if not create:
          raise FileNotFoundError(errno.ENOENT, f"path={path!r}: no such directory {part!r}")
        os.mkdir(part, 0o755, dir_fd=fd)
        if owner is not None:
          os.chown(part, *owner, dir_fd=fd, follow_symlinks=False)
        new = os.open(part, _DIR, dir_fd=fd)
      except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
          raise PathError(f"path={path!r}: {part!r} is a symlink or not a directory") from None
        raise
      os.close(fd)
      fd = new
    yield fd
  finally:
    os.close(fd)


def _open_file(name: str, flags: int, dir_fd: int, path: str, mode: int = 0o644) -> int:
  try:
    fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
  except OSError as e:
    if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.ENOTDIR):
      raise PathError(f"path={path!r}: a symlink, directory or special file") from None
    if e.errno == errno.ENOENT:
      raise FileNotFoundError(errno.ENOENT, f"path={path!r}: no such file") from None
    raise
  if not stat.S_ISREG(os.fstat(fd).st_mode):
    os.close(fd)
    raise PathError(f"path={path!r}: not a regular file")
  return fd


def write_file(root: str, path: str, content: str | bytes, max_bytes: int,
               owner: Optional[tuple[int, int]] = None) -> None:
  """Creates or replaces root/path; missing parent directories are created.

  Args:
    root: the workspace's host directory.
    path: workspace-relative path of the file.
    content: the file's content (str is written as UTF-8).
    max_bytes: the largest content accepted.
    owner: (uid, gid) the file and new directories are chowned to; None: left as created.

  Raises:
    PathError: the path leaves the workspace, names it, or goes through a symlink or a
      special file.
    ValueError: content is not str/bytes, or is larger than max_bytes.
  """
  data = content.encode() if isinstance(content, str) else content
  if not isinstance(data, bytes):
    raise ValueError(f"content: expected str or bytes, got {type(content).__name__}")
  if len(data) > max_bytes:
    raise ValueError(f"content of {path!r}: {len(data)} bytes > limits.file_bytes={max_bytes}")
  parts = _parts(root, path)
  if not parts:
    raise PathError(f"path={path!r}: names the workspace itself, not a file")
  with _walk(root, path, parts[:-1], create=True, owner=owner) as dfd:
    fd = _open_file(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, dfd, path)
    try:
      if owner is not None:
        os.fchown(fd, *owner)
      view = memoryview(data)
      while view:
        view = view[os.write(fd, view):]
    finally:
      os.close(fd)


def read_file(root: str, path: str, max_bytes: int) -> bytes:
  """Reads root/path.

  Args:
    root: the workspace's host directory.
    path: workspace-relative path of the file.
    max_bytes: the largest file accepted.

  Returns:
    The file's bytes.

  Raises:
    PathError: the path leaves the workspace, names it, or goes through a symlink or a
      special file.
    FileNotFoundError: no such file.
    ValueError: the file is larger than max_bytes (also if it grows while read).
  """
  parts = _parts(root, path)
  if not parts:
    raise PathError(f"path={path!r}: names the workspace itself, not a file")
  with _walk(root, path, parts[:-1]) as dfd:
    fd = _open_file(parts[-1], os.O_RDONLY, dfd, path)
    try:
      size = os.fstat(fd).st_size
      if size > max_bytes:
        raise ValueError(f"{path!r}: {size} bytes > limits.file_bytes={max_bytes}")
      chunks, n = [], 0
      while n <= max_bytes and (chunk := os.read(fd, 1 << 20)):
        chunks.append(chunk)
        n += len(chunk)
      if n > max_bytes:  # grew while we read it
        raise ValueError(f"{path!r}: more than limits.file_bytes={max_bytes} bytes")
      return b"".join(chunks)
    finally:
      os.close(fd)


def list_files(root: str, path: str = ".", max_depth: int = MAX_DEPTH,
               max_entries: int = MAX_ENTRIES) -> list[str]:
  """Lists the regular files under root/path; symlinks and special files are skipped.

  The walk is iterative (a sandbox can make a tree deeper than Python's recursion limit) and
  holds one descriptor per level of the current branch only.

  Args:
    root: the workspace's host directory.
    path: workspace-relative file or directory ("." is the whole workspace).
    max_depth: deepest directory level below `path` that is walked.
    max_entries: most directory entries (files, directories, anything) looked at.

  Returns:
    The files' workspace-relative paths, sorted (just `path` when it is a regular file).

  Raises:
    PathError: the path leaves the workspace, or is a symlink or a special file.
    FileNotFoundError: no such file or directory.
    ValueError: the tree is deeper than `max_depth` or has more than `max_entries` entries.
  """
  parts = _parts(root, path)
  prefix = "/".join(parts)
  with _walk(root, path, parts[:-1]) as dfd:
    if not parts:
      top = os.dup(dfd)
    else:
      try:
        st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
      except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"path={path!r}: no such file or directory") from None
      if stat.S_ISREG(st.st_mode):
        return [prefix]
      if not stat.S_ISDIR(st.st_mode):
        raise PathError(f"path={path!r}: a symlink or special file")
      try:
        top = os.open(parts[-1], _DIR, dir_fd=dfd)
      except OSError as e:  # replaced by a symlink after the stat
        raise PathError(f"path={path!r}: {e.strerror}") from None
  out, seen = [], 0
  # Depth-first; each frame: (dir fd, its relative path, names of its subdirectories to visit).
  stack: list[tuple[int, str, list[str]]] = []

  def enter(fd: int, rel: str) -> None:
    nonlocal seen
    subdirs = []
    with os.scandir(fd) as it:
      for entry in it:
        seen += 1
        if seen > max_entries:
          raise ValueError(f"list_files(path={path!r}): more than max_entries={max_entries} "
                           "entries")
        try:
          mode = entry.stat(follow_symlinks=False).st_mode
        except FileNotFoundError:  # deleted by the sandbox while we walked
          continue
        name = f"{rel}/{entry.name}" if rel else entry.name
        if stat.S_ISREG(mode):
          out.append(f"{prefix}/{name}" if prefix else name)
        elif stat.S_ISDIR(mode):
          subdirs.append(entry.name)
    stack.append((fd, rel, subdirs))

  try:
    enter(top, "")
    top = -1  # owned by the stack now
    while stack:
      fd, rel, subdirs = stack[-1]
      if not subdirs:
        os.close(stack.pop()[0])
        continue
      name = subdirs.pop()
      if len(stack) > max_depth:
        raise ValueError(f"list_files(path={path!r}): deeper than max_depth={max_depth} "
                         f"levels at {rel!r}")
      try:
        sub = os.open(name, _DIR, dir_fd=fd)
      except OSError:  # removed, or replaced by a symlink, since the listing
        continue
      try:
        enter(sub, f"{rel}/{name}" if rel else name)
      except BaseException:
        os.close(sub)
        raise
  finally:
    if top >= 0:
      os.close(top)
    for fd, _, _ in stack:
      os.close(fd)
  return sorted(out)


def copy_tree(src: str, dst: str, owner: Optional[tuple[int, int]] = None,
              max_depth: int = MAX_DEPTH) -> None:
  """Copies what the directory `src` holds into the empty directory `dst`.

  Regular files keep their content (holes stay holes), mode and times; directories, empty ones
  too, keep mode and times; symlinks are recreated as links, never followed; files linked more
  than once stay one file with several names. FIFOs, sockets and devices are left out. Every
  name is opened relative to its parent's descriptor with O_NOFOLLOW, so commands changing
  `src` meanwhile (swapping a directory for a symlink) can never make the copy read outside
  it: an entry that changes under the walk is copied as it is then, or skipped if it is gone.
  Nothing in `src` is modified. Run as root, unreadable files (mode 000) are copied too.

  Args:
    src: the directory copied from.
    dst: the directory copied into (its own mode and owner are kept).
    owner: (uid, gid) everything made in `dst` is chowned to; None: left as created.
    max_depth: deepest directory level below `src` that is copied.

  Raises:
    ValueError: `src` is deeper than `max_depth` levels.
    OSError: reading or writing failed (e.g. ENOSPC when `dst` is full).
  """
  links: dict[tuple[int, int], str] = {}  # (dev, inode) of a multiply linked file -> its copy
  root = os.open(dst, _DIR)
  # Depth-first; each frame: (src dir fd, dst dir fd, relative path, names left, the src
  # directory's stat, applied to its copy once its entries are in: None for the root).
  stack: list[tuple[int, int, str, list[str], Optional[os.stat_result]]] = []
  try:
    top = os.open(src, _DIR)
    stack.append((top, os.dup(root), "", os.listdir(top), None))
    while stack:
      sfd, dfd, rel, names, st = stack[-1]
      if not names:
        if st is not None:
          _set_attrs(dfd, st, owner)
        stack.pop()
        os.close(sfd)
        os.close(dfd)
        continue
      name = names.pop()
      path = f"{rel}/{name}" if rel else name
      try:
        mode = os.stat(name, dir_fd=sfd, follow_symlinks=False).st_mode
        if stat.S_ISDIR(mode):
          if len(stack) > max_depth:
            raise ValueError(f"copy of {src}: deeper than max_depth={max_depth} levels at "
                             f"{rel!r}")
          sub = os.open(name, _DIR, dir_fd=sfd)
          try:
            os.mkdir(name, 0o700, dir_fd=dfd)
            stack.append((sub, os.open(name, _DIR, dir_fd=dfd), path, os.listdir(sub),
                          os.fstat(sub)))
          except BaseException:
            os.close(sub)
            raise
        elif stat.S_ISREG(mode):
          _copy_file(sfd, dfd, root, name, path, owner, links)
        elif stat.S_ISLNK(mode):
          target = os.readlink(name, dir_fd=sfd)
          lst = os.stat(name, dir_fd=sfd, follow_symlinks=False)
          os.symlink(target, name, dir_fd=dfd)
          if owner is not None:
            os.chown(name, *owner, dir_fd=dfd, follow_symlinks=False)
          os.utime(name, ns=(lst.st_atime_ns, lst.st_mtime_ns), dir_fd=dfd,
                   follow_symlinks=False)
      except OSError as e:
        # Removed, or swapped for something else, by a command running in `src` meanwhile.
        if e.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR, errno.EINVAL):
          raise
  finally:
    os.close(root)
    for sfd, dfd, *_ in stack:
      os.close(sfd)
      os.close(dfd)


def _set_attrs(fd: int, st: os.stat_result, owner: Optional[tuple[int, int]]) -> None:
  if owner is not None:
    os.fchown(fd, *owner)  # before the mode: chown clears set-id bits
  os.fchmod(fd, stat.S_IMODE(st.st_mode))
  os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))


def _copy_file(sfd: int, dfd: int, root: int, name: str, path: str,
               owner: Optional[tuple[int, int]], links: dict[tuple[int, int], str]) -> None:
  """Copies one regular file of copy_tree (a hard link to an earlier copy when it is one)."""
  fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=sfd)
  try:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # swapped for a FIFO or device since the listing
      return
    key = (st.st_dev, st.st_ino)
    if st.st_nlink > 1 and key in links:
      os.link(links[key], name, src_dir_fd=root, dst_dir_fd=dfd, follow_symlinks=False)
      return
    out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                  0o600, dir_fd=dfd)
    try:
      os.ftruncate(out, st.st_size)
      pos = 0
      while pos < st.st_size:  # data segments only: a sparse file stays sparse
        try:
          pos = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
          if e.errno == errno.ENXIO:  # only a hole is left
            break
          raise
        end = min(os.lseek(fd, pos, os.SEEK_HOLE), st.st_size)
        os.lseek(fd, pos, os.SEEK_SET)
        os.lseek(out, pos, os.SEEK_SET)
        while pos < end:
          n = os.sendfile(out, fd, None, end - pos)
          if n == 0:  # shrunk meanwhile: the rest reads as zeros
            pos = end = st.st_size
            break
          pos += n
      _set_attrs(out, st, owner)
    finally:
      os.close(out)
    if st.st_nlink > 1:
      links[key] = path
  finally:
    os.close(fd)
