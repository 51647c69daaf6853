"""The source of a synthesis: a git repository's HEAD, or a source tree or sdist."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
import re
import tarfile
import tomllib
from typing import Mapping, Optional

from envs import safe_git
from envs.tasks import checkout, load_repo_files

# The commit time of a source without one (a directory or an sdist): 1980-01-01, the ZIP
# epoch that reproducible builds use, so the same files always give the same commit ids.
SOURCE_EPOCH = 315532800


class SynthError(RuntimeError):
  """The source cannot be synthesized from (no passing tests, a broken baseline run, an output
  directory holding another source's run)."""


@dataclasses.dataclass
class Source:
  """The files to synthesize from, and what the rows say about them."""

  files: dict[str, bytes]
  package: str
  version: str
  base_commit: str = ""       # the HEAD commit of a git repository
  repo_dir: Optional[str] = None  # the git work tree (commit reverts need it)
  created_at: str = ""        # the commit's date (git), else ""
  date: int = SOURCE_EPOCH    # the commit's time in seconds (git), else SOURCE_EPOCH
  executables: frozenset = frozenset()  # paths of files with an executable bit


def _strip_top(files: dict[str, bytes]) -> dict[str, bytes]:
  """An sdist's files without its one top-level folder ("pkg-1.0/setup.py" -> "setup.py")."""
  tops = {p.split("/", 1)[0] for p in files}
  if len(tops) == 1 and all("/" in p for p in files):
    return {p.split("/", 1)[1]: data for p, data in files.items()}
  return files


def _metadata(files: Mapping[str, bytes], fallback: str) -> tuple[str, str]:
  """(package name, version) from PKG-INFO or pyproject.toml; (fallback, "") otherwise."""
  if "PKG-INFO" in files:
    text = files["PKG-INFO"].decode("utf-8", "replace")
    name = re.search(r"^Name:\s*(.+)$", text, re.M)
    version = re.search(r"^Version:\s*(.+)$", text, re.M)
    if name:
      return name.group(1).strip(), version.group(1).strip() if version else ""
  if "pyproject.toml" in files:
    try:
      project = tomllib.loads(files["pyproject.toml"].decode("utf-8")).get("project", {})
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
      project = {}
    if isinstance(project.get("name"), str):
      return project["name"], str(project.get("version", ""))
  return fallback, ""


def load_source(path: str, work_dir: str) -> Source:
  """The files of a git repository's HEAD, or of a directory or tarball of a source tree.

  The path is the caller's; what the repository holds is not trusted: git reads it through
  `envs.safe_git` (none of its configured programs runs, a repository of another user is
  refused) and a directory's files are read without following links.

  Args:
    path: a git work tree, a directory, or a .tar / .tar.gz / .tgz archive (an sdist's single
      top-level folder is stripped).
    work_dir: where a git commit's files are checked out (a cache).

  Returns:
    The source.

  Raises:
    ValueError: naming `repo` when the path is none of these, or a repository that
      `envs.safe_git.check_repository` refuses.
    SynthError: git failed.
  """
  path = os.path.abspath(os.path.expanduser(path))
  if not os.path.exists(path):
    raise ValueError(f"repo={path!r}: does not exist")
  base = os.path.basename(path.rstrip("/"))
  fallback = re.sub(r"(\.tar\.gz|\.tgz|\.tar)$", "", base)
  if os.path.isdir(path) and os.path.lexists(os.path.join(path, ".git")):
    try:
      git_dir = safe_git.check_repository(safe_git.find_git_dir(path))
      commit = safe_git.rev_parse(git_dir, "HEAD")
      if commit is None:
        raise SynthError(f"{path}: HEAD names no commit")
      tree = checkout(git_dir, commit, os.path.join(work_dir, "checkout"), f"local/{fallback}")
      files = load_repo_files(tree)
      executables = _executables(tree, files)
      name, version = _metadata(files, fallback)
      date = safe_git.commit_header(git_dir, commit)[1]
      version = version or safe_git.git(git_dir, "describe", "--tags", "--always",
                                        commit).decode().strip()
    except safe_git.RepositoryError as e:
      raise ValueError(f"repo={path!r}: {e}") from None
    except safe_git.GitError as e:
      raise SynthError(str(e)) from None
    created = datetime.datetime.fromtimestamp(date, datetime.timezone.utc)
    return Source(files, name, version, commit, path, created.strftime("%Y-%m-%dT%H:%M:%SZ"),
                  date, executables)
  try:
    files = load_repo_files(path)
  except ValueError as e:
    raise ValueError(f"repo={path!r}: {e}") from None
  if os.path.isdir(path):
    executables = _executables(path, files)
  else:
    executables = _tar_executables(path, files)
    files = _strip_top(files)
  name, version = _metadata(files, fallback)
  return Source(files, name, version, executables=executables)


def _executables(root: str, files: Mapping[str, bytes]) -> frozenset:
  """The files under `root` with an executable bit (read without following links)."""
  out = set()
  for path in files:
    try:
      if os.lstat(os.path.join(root, path)).st_mode & 0o111:
        out.add(path)
    except OSError:
      continue
  return frozenset(out)


def _tar_executables(path: str, files: Mapping[str, bytes]) -> frozenset:
  """The archive's regular files with an executable bit, named as `_strip_top` names them."""
  try:
    with tarfile.open(path) as tar:
      names = [m.name.removeprefix("./") for m in tar if m.isfile() and m.mode & 0o111]
  except (OSError, tarfile.TarError):
    return frozenset()
  stripped = _strip_top({p: b"" for p in files})
  if len(stripped) == len(files) and set(stripped) != set(files):
    names = [n.split("/", 1)[1] for n in names if "/" in n]
  return frozenset(names)


def digest(files: Mapping[str, bytes], test_command: str) -> str:
  """A fingerprint of a source and its test command (a journal belongs to exactly one)."""
  h = hashlib.sha256(test_command.encode())
  for path in sorted(files):
    h.update(f"\0{path}\0{len(files[path])}\0".encode())
    h.update(files[path])
  return h.hexdigest()

