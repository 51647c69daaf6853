"""A task's repository as files: its directory, tar archive, or the checkout of its mirrored
commit, read without following any link (the sandbox file API writes regular files only).

`envs.tasks` re-exports these names; `envs.environments` reads repositories through them
without depending on the task loaders.
"""

from __future__ import annotations

import os
import stat
import tarfile

from envs import dataset_paths
from envs.swe_mirror import DEFAULT_CACHE, check_rel, checkout


_SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".hg", ".svn"}


def is_cache_path(path: str) -> bool:
  """Byte-code and tool caches: never part of a task or of an agent's change."""
  parts = path.split("/")
  return any(p in _SKIP_DIRS for p in parts[:-1]) or parts[-1].endswith((".pyc", ".pyo"))



def repo_dir(task) -> str:
  """The directory or tarball holding a "swe" task's repository: its `repo_path`, or the
  checkout of `base_commit` from its mirror (made on first use, then reused).

  Raises:
    ValueError: the task has no repository.
    GitError: the checkout failed.
  """
  if task.repo_path:
    return task.repo_path
  if not (task.mirror and task.base_commit):
    raise ValueError(f"Task {task.instance_id!r}: repo_path=None: this task has no repository")
  return checkout(task.mirror, task.base_commit, task.cache_dir or os.path.expanduser(
      DEFAULT_CACHE), task.repo or "unknown/repo")


def load_repo_files(task_or_path) -> dict[str, bytes]:
  """The snapshot's regular files as {relative path: bytes} (caches and .git left out).

  Symlinks and special files are skipped: the sandbox file API writes regular files only. A
  directory is read with descriptors (`envs.dataset_paths.read_tree`), so no link inside it is
  ever followed.

  Args:
    task_or_path: a Task (its `repo_dir`), or a path to a directory or a .tar / .tar.gz /
      .tgz archive.

  Raises:
    ValueError: the task has no repository, the path is neither a directory nor a tar archive,
      or an archive member has an unsafe path.
    GitError: checking a mirrored commit out failed.
  """
  path = (task_or_path if isinstance(task_or_path, (str, os.PathLike))
          else repo_dir(task_or_path))
  if path is None:
    raise ValueError("repo_path=None: this task has no repository")
  if os.path.isdir(path):
    return dataset_paths.read_tree(path, "", f"repo_path={path!r}", skip_dirs=_SKIP_DIRS,
                                   keep=lambda rel: not is_cache_path(rel))
  files: dict[str, bytes] = {}
  try:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
  except OSError as e:
    raise ValueError(f"repo_path={path!r}: not a directory or tar archive ({e.strerror})"
                     ) from None
  with os.fdopen(fd, "rb") as f:
    if not (stat.S_ISREG(os.fstat(fd).st_mode) and tarfile.is_tarfile(f)):
      raise ValueError(f"repo_path={path!r}: not a directory or tar archive")
    f.seek(0)
    with tarfile.open(fileobj=f) as tar:
      for m in tar:
        if not m.isfile():
          continue
        rel = check_rel(m.name, f"repo_path={path!r}")
        if not is_cache_path(rel):
          files[rel] = tar.extractfile(m).read()
  return files
