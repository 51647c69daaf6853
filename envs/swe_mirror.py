"""Git mirrors of SWE repositories: finding a repository's mirror, resolving a row's commit,
SWE-smith's hidden-test commits, and cached checkouts (`envs.tasks` re-exports these names).

A directory of mirrors holds DIR/<owner>__<name>.git, DIR/<owner>__<name>, DIR/<owner>/<name>.git
or DIR/<owner>/<name>, bare or not, read only through `envs.safe_git` (none of the repository's
configured programs runs). A dataset file's folder may hold its own directory of mirrors,
`mirror/` (what `envs.synth` writes beside tasks.jsonl): `dataset_mirror` finds it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from typing import Optional

from envs import dataset_paths, safe_git

log = logging.getLogger(__name__)

DEFAULT_CACHE = "~/.cache/arbor/swe"  # checkouts of mirrored commits, unless told otherwise
DATASET_MIRROR = "mirror"  # a dataset folder's directory of mirrors (envs.synth's OUT/mirror)
SMITH_REMOVAL = "Remove F2P Tests"  # subject of SWE-smith's commit hiding the failing tests


def check_rel(path: str, where: str) -> str:
  """`path` normalised ("" and "." components dropped), or ValueError naming `where` when it is
  absolute, empty or has a ".." component."""
  parts = path.split("/")
  if path.startswith("/") or ".." in parts or "\x00" in path or not path:
    raise ValueError(f"{where}: unsafe path {path!r} (absolute, '..' or empty)")
  return "/".join(p for p in parts if p not in ("", "."))


def dataset_mirror(folder: str) -> Optional[str]:
  """The directory of mirrors a dataset file's folder holds (FOLDER/mirror), or None.

  Only a real folder counts (`envs.dataset_paths`: a symbolic link named `mirror` is left out,
  with a warning, since the dataset is untrusted).

  Args:
    folder: the folder of the dataset file.

  Returns:
    Its absolute path, or None when there is none.
  """
  try:
    return dataset_paths.resolve(folder, DATASET_MIRROR, "the dataset's mirror", kind="dir")
  except dataset_paths.MissingPath:
    return None
  except dataset_paths.DatasetPathError as e:
    log.warning("%s: not used", e)
    return None


_GIT_REF = re.compile(r"^[\w][\w./@+-]*$")  # a commit or branch name, never an option
_REPO = re.compile(r"^[\w.-]+/[\w.-]+$")


def find_mirror(mirror: str, repo: str) -> str:
  """The git directory of `repo` ("owner/name") in a directory of mirrors.

  Looked for, in order: MIRROR/owner__name.git, MIRROR/owner__name, MIRROR/owner/name.git,
  MIRROR/owner/name; each a bare repository or a clone with a .git directory. The row's `repo`
  names a path inside MIRROR (`envs.dataset_paths`: no "..", no symbolic link on the way), and
  the repository must pass `envs.safe_git.check_repository` (owned by the user running this,
  no linked config or objects, no alternates outside the folder holding it).

  Args:
    mirror: the directory of mirrors.
    repo: the row's `repo`.

  Returns:
    The absolute git directory.

  Raises:
    ValueError: naming 'repo' (a malformed name, no mirror of it, or one that is refused).
  """
  if not _REPO.match(repo) or ".." in repo.split("/"):
    raise ValueError(f"field 'repo': {repo!r}: expected 'owner/name'")
  owner, name = repo.split("/")
  mirror = os.path.abspath(os.path.expanduser(mirror))  # the caller's, not the row's
  tried = []
  for rel in (f"{owner}__{name}.git", f"{owner}__{name}", f"{owner}/{name}.git",
              f"{owner}/{name}"):
    tried.append(os.path.join(mirror, rel))
    try:
      path = dataset_paths.resolve(mirror, rel, f"field 'repo': {repo!r}: mirror", kind="dir")
    except dataset_paths.MissingPath:
      continue
    try:
      git_dir = safe_git.find_git_dir(path)
    except safe_git.RepositoryError as e:
      if os.path.lexists(os.path.join(path, ".git")):  # a linked or file .git: refused
        raise ValueError(f"field 'repo': {repo!r}: {e}") from None
      continue  # a folder that is no repository (e.g. MIRROR/owner holding owner/name)
    try:
      return safe_git.check_repository(git_dir)
    except safe_git.RepositoryError as e:
      raise ValueError(f"field 'repo': {repo!r}: {e}") from None
  raise ValueError(f"field 'repo': {repo!r}: no git mirror of it (looked for {', '.join(tried)})")


def resolve_commit(git_dir: str, ref: str) -> str:
  """The full commit id of `ref` (a commit id, possibly abbreviated, or a branch) in a mirror.

  A branch is also looked for as origin/BRANCH (a clone keeps the remote's branches there).

  Raises:
    ValueError: naming 'base_commit' (malformed, or not in the mirror).
  """
  if not _GIT_REF.match(ref) or ".." in ref:
    raise ValueError(f"field 'base_commit': {ref!r}: expected a commit id or branch name")
  for candidate in (ref, f"origin/{ref}"):
    commit = safe_git.rev_parse(git_dir, candidate)
    if commit:
      return commit
  raise ValueError(f"field 'base_commit': {ref!r}: no such commit in the mirror {git_dir}")


def smith_test_patch(git_dir: str, commit: str) -> str:
  """SWE-smith's test patch: when `commit` is its "Remove F2P Tests" commit, the diff that
  brings the failing tests back from its parent (the "Bug Patch" commit); else ""."""
  if safe_git.commit_header(git_dir, commit)[0] != SMITH_REMOVAL:
    return ""
  return safe_git.git(git_dir, "-c", "core.quotePath=false", "diff-tree", "-r", "-p",
                      "--no-color", "--no-ext-diff", "--no-textconv", "--no-renames",
                      "--src-prefix=a/", "--dst-prefix=b/", commit, f"{commit}~1", "--"
                      ).decode("utf-8", errors="replace")


def checkout(git_dir: str, commit: str, cache_dir: str, repo: str) -> str:
  """The files of `commit` in a cache directory keyed by (repo, commit), written once.

  The tree is read with `envs.safe_git.tree_files` (exact blob bytes: no export-ignore, no
  end-of-line or filter conversion); regular files only (symlinks and submodules are left
  out, as `load_repo_files` would). It is written to a temporary directory that is renamed
  into place, so concurrent or interrupted checkouts never leave a partial tree.

  Args:
    git_dir: the mirror's git directory.
    commit: a full commit id in it.
    cache_dir: the cache's root.
    repo: "owner/name" (the cache's subdirectory is owner__name).

  Returns:
    The checkout's directory.

  Raises:
    GitError: git failed.
    ValueError: the repository is refused (`envs.safe_git.check_repository`) or holds a path
      that is not safe.
  """
  parent = os.path.join(cache_dir, repo.replace("/", "__"))
  final = os.path.join(parent, commit)
  if os.path.isdir(final):
    return final
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
  try:
    for mode, path, data in safe_git.tree_files(git_dir, commit):
      target = os.path.join(tmp, check_rel(path, f"{repo}@{commit}"))
      os.makedirs(os.path.dirname(target), exist_ok=True)
      with open(target, "wb") as f:
        f.write(data)
      os.chmod(target, 0o755 if mode == "100755" else 0o644)
    try:
      os.rename(tmp, final)
    except OSError:
      if not os.path.isdir(final):  # not another process's finished checkout: a real error
        raise
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return final

