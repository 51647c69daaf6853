"""Paths a dataset names, resolved inside the dataset's own folder.

A dataset (a JSONL or Parquet file of rows, a Terminal-Bench-style task folder) is untrusted:
a row's `repo_path` or `rootfs`, or a task folder's `setup.sh` or `tests/`, must not make the
loader, which may run as root, read or hand on a host path such as /etc or /root. So every
path a dataset names is relative to its folder (`root`, given by the caller and trusted,
symbolic links in it included) and

- is not absolute, does not start with "~" (nothing is expanded), and has no ".." component;
- has no symbolic link at any component below `root`: each component is opened relative to its
  parent's descriptor with O_NOFOLLOW, so a link is refused even if it is planted between a
  check and the open;
- names a regular file or a folder (no FIFO or device), as the caller asks.

Errors are `DatasetPathError` (a ValueError) whose message starts with what the caller names
(e.g. "field 'repo_path'") and the value, so loaders can report and skip the row.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Callable, Collection, Optional

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
MAX_DEPTH = 256  # folder levels `read_tree` walks; deeper trees are refused


class DatasetPathError(ValueError):
  """A dataset names a path outside its folder, through a symbolic link, or of the wrong kind."""


class MissingPath(DatasetPathError):
  """A dataset names a path that does not exist in its folder."""


def parts(root: str, path: str, name: str) -> list[str]:
  """The components of a dataset-relative path, checked without touching the filesystem.

  Args:
    root: the dataset's folder (only named in messages).
    path: the value the dataset gives.
    name: what the value is, for messages ("field 'repo_path'").

  Returns:
    Its components, "" and "." left out ([] names `root` itself).

  Raises:
    DatasetPathError: not a string, NUL, absolute, "~" or "..".
  """
  if not isinstance(path, str) or "\x00" in path:
    raise DatasetPathError(f"{name}: {path!r}: expected a path relative to the dataset's folder "
                           f"({root})")
  if path.startswith("/"):
    raise DatasetPathError(f"{name}: {path!r}: absolute paths are not allowed; give a path "
                           f"relative to the dataset's folder ({root})")
  if path.startswith("~"):
    raise DatasetPathError(f"{name}: {path!r}: '~' is not expanded; give a path relative to "
                           f"the dataset's folder ({root})")
  out = [p for p in path.split("/") if p not in ("", ".")]
  if ".." in out:
    raise DatasetPathError(f"{name}: {path!r}: '..' is not allowed; give a path inside the "
                           f"dataset's folder ({root})")
  return out


def _refuse(fd: int, part: str, name: str, path: str, shown: str) -> DatasetPathError:
  """The error for a component that could not be opened as a folder."""
  where = f"{path!r}" if shown == path else f"{path!r}: {shown!r}"
  try:
    mode = os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode
  except FileNotFoundError:
    return MissingPath(f"{name}: {where} does not exist")
  if stat.S_ISLNK(mode):
    return DatasetPathError(f"{name}: {where} is a symbolic link; dataset paths may not go "
                            "through links")
  return DatasetPathError(f"{name}: {where} is not a folder")


def _open_dir(root: str, comps: list[str], name: str, path: str) -> int:
  """A descriptor of the folder root/comps; no component below `root` may be a link."""
  try:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
  except FileNotFoundError:
    raise MissingPath(f"{name}: {path!r}: the dataset's folder {root} does not exist") from None
  try:
    for i, part in enumerate(comps):
      try:
        new = os.open(part, _DIR, dir_fd=fd)
      except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
          raise
        raise _refuse(fd, part, name, path, "/".join(comps[:i + 1])) from None
      os.close(fd)
      fd = new
  except BaseException:
    os.close(fd)
    raise
  return fd


def resolve(root: str, path: str, name: str, kind: Optional[str] = None) -> str:
  """The host path of `path` inside the dataset folder `root`, checked (module docstring).

  Args:
    root: the dataset's folder.
    path: the value the dataset gives.
    name: what the value is, for messages ("field 'repo_path'").
    kind: "dir" or "file" to ask for one; None: either.

  Returns:
    abspath(root) joined with the path's components.

  Raises:
    MissingPath: it does not exist.
    DatasetPathError: it is absolute, uses "~" or "..", goes through a symbolic link, or is
      not of the kind asked for.
  """
  comps = parts(root, path, name)
  if comps:
    fd = _open_dir(root, comps[:-1], name, path)
    try:
      mode = os.stat(comps[-1], dir_fd=fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
      raise MissingPath(f"{name}: {path!r} does not exist in the dataset's folder "
                        f"({root})") from None
    finally:
      os.close(fd)
    if stat.S_ISLNK(mode):
      raise DatasetPathError(f"{name}: {path!r} is a symbolic link; give the file or folder "
                             f"itself, inside the dataset's folder ({root})")
    ok = {"dir": stat.S_ISDIR(mode), "file": stat.S_ISREG(mode)}
    if not (ok[kind] if kind else any(ok.values())):
      wanted = {"dir": "a folder", "file": "a regular file"}.get(kind, "a file or folder")
      raise DatasetPathError(f"{name}: {path!r}: not {wanted}")
  return os.path.join(os.path.abspath(root), *comps)


def _read_at(fd: int, entry: str, name: str, shown: str) -> bytes:
  """The bytes of the regular file `entry` of the folder `fd`, never through a link."""
  try:
    f = os.open(entry, _FILE, dir_fd=fd)
  except FileNotFoundError:
    raise MissingPath(f"{name}: {shown!r} does not exist") from None
  except OSError as e:
    if e.errno == errno.ELOOP:
      raise DatasetPathError(f"{name}: {shown!r} is a symbolic link; dataset files must be "
                             "regular files inside the dataset's folder") from None
    if e.errno in (errno.ENXIO, errno.EISDIR, errno.ENOTDIR):
      raise DatasetPathError(f"{name}: {shown!r} is not a regular file") from None
    raise
  try:
    if not stat.S_ISREG(os.fstat(f).st_mode):
      raise DatasetPathError(f"{name}: {shown!r} is not a regular file")
    chunks = []
    while chunk := os.read(f, 1 << 20):
      chunks.append(chunk)
    return b"".join(chunks)
  finally:
    os.close(f)


def read_file(root: str, path: str, name: str) -> bytes:
  """The bytes of the regular file `path` inside the dataset folder `root`.

  Raises:
    MissingPath: no such file.
    DatasetPathError: the path is not allowed (see `resolve`), goes through a symbolic link,
      or is not a regular file.
  """
  comps = parts(root, path, name)
  if not comps:
    raise DatasetPathError(f"{name}: {path!r}: names the dataset's folder, not a file")
  fd = _open_dir(root, comps[:-1], name, path)
  try:
    return _read_at(fd, comps[-1], name, "/".join(comps))
  finally:
    os.close(fd)


def read_tree(root: str, path: str, name: str, *, links: str = "skip",
              skip_dirs: Collection[str] = (),
              keep: Optional[Callable[[str], bool]] = None) -> dict[str, bytes]:
  """The regular files under the folder `path` inside `root`, {relative path: bytes}.

  Folders are walked in name order, each folder's files before its subfolders (the order of
  `os.walk`), holding one descriptor per level; FIFOs, sockets and devices are left out.

  Args:
    root: the dataset's folder.
    path: the folder inside it ("" or "." for `root` itself).
    name: what the folder is, for messages.
    links: "skip" leaves symbolic links out; "error" raises on the first one.
    skip_dirs: names of folders not walked into (e.g. "__pycache__").
    keep: keep(relative path) says whether a file is read; None: every file.

  Returns:
    The files, keyed by "/"-separated paths relative to `path`.

  Raises:
    MissingPath: the folder does not exist.
    DatasetPathError: the path is not allowed, goes through a symbolic link, or (with
      links="error") the tree holds one; the tree is deeper than MAX_DEPTH.
  """
  if links not in ("skip", "error"):
    raise ValueError(f"links={links!r}: expected 'skip' or 'error'")
  comps = parts(root, path, name)
  prefix = "/".join(comps)
  out: dict[str, bytes] = {}
  stack: list[tuple[int, str, list[str]]] = []  # (folder fd, relative path, subfolders left)

  def enter(fd: int, rel: str) -> None:
    subdirs = []
    try:
      for entry in sorted(os.scandir(fd), key=lambda e: e.name):
        child = f"{rel}/{entry.name}" if rel else entry.name
        mode = entry.stat(follow_symlinks=False).st_mode
        if stat.S_ISLNK(mode):
          if links == "error":
            shown = f"{prefix}/{child}" if prefix else child
            raise DatasetPathError(f"{name}: {shown!r} is a symbolic link; dataset files must "
                                   f"be regular files inside the dataset's folder ({root})")
        elif stat.S_ISDIR(mode):
          if entry.name not in skip_dirs:
            subdirs.append(entry.name)
        elif stat.S_ISREG(mode) and (keep is None or keep(child)):
          out[child] = _read_at(fd, entry.name, name, f"{prefix}/{child}" if prefix else child)
    except BaseException:
      os.close(fd)
      raise
    stack.append((fd, rel, subdirs[::-1]))

  enter(_open_dir(root, comps, name, path), "")
  try:
    while stack:
      fd, rel, subdirs = stack[-1]
      if not subdirs:
        os.close(stack.pop()[0])
        continue
      sub = subdirs.pop()
      if len(stack) > MAX_DEPTH:
        raise DatasetPathError(f"{name}: {path!r}: deeper than {MAX_DEPTH} folder levels")
      child = f"{rel}/{sub}" if rel else sub
      try:
        new = os.open(sub, _DIR, dir_fd=fd)
      except OSError as e:  # removed, or replaced by a link, since the listing
        if e.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
          raise
        if links == "error" and e.errno != errno.ENOENT:
          shown = f"{prefix}/{child}" if prefix else child
          raise _refuse(fd, sub, name, shown, shown) from None
        continue
      enter(new, child)
  finally:
    for fd, _, _ in stack:
      os.close(fd)
  return out
