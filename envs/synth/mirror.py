"""A git mirror that synthesis writes: the clean source as one commit, each instance's bug as a
commit on a branch of its own, written with git plumbing only.

Objects are written with `hash-object` (`--no-filters`: the bytes as given), `mktree` and
`commit-tree`, refs with `update-ref` and `symbolic-ref`: no work tree, no index, no porcelain.
git runs as `envs.safe_git` runs it: no system or global configuration, none of the caller's
GIT_* variables, the `safe_git.OVERRIDES` that keep hooks, signing programs, pagers and
transports off, and a repository that passes `safe_git.check_repository`. The repository is
created with an empty template folder, so it holds no sample hooks. Commits carry a fixed
author and committer (`AUTHOR`) and the dates they are given, so the same files, parents,
message and date always give the same commit id: a rerun writes the same mirror.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import Mapping, Optional, Sequence

from envs import safe_git

AUTHOR = ("Arbor Synth", "synth@arbor.invalid")
FILE, EXECUTABLE = "100644", "100755"


class MirrorWriter:
  """Writes objects and refs into one bare repository (created on first use).

  Args:
    git_dir: the bare repository's folder, e.g. OUT/mirror/owner__name.git.

  Raises:
    safe_git.RepositoryError: the folder exists and is refused by `check_repository`.
    safe_git.GitError: git failed.
  """

  def __init__(self, git_dir: str):
    self.git_dir = os.path.abspath(git_dir)
    self._trees: dict[tuple, str] = {}  # a folder's entries -> its tree id (this writer's)
    if not os.path.exists(self.git_dir):
      os.makedirs(os.path.dirname(self.git_dir), exist_ok=True)
      with tempfile.TemporaryDirectory(prefix="arbor-template-") as template:
        self._run(["init", "--bare", "--quiet", f"--template={template}", self.git_dir],
                  git_dir=None)
    safe_git.check_repository(self.git_dir)

  def _run(self, args: Sequence[str], stdin: Optional[bytes] = None,
           env: Optional[Mapping[str, str]] = None, git_dir: Optional[str] = "") -> bytes:
    """git ARGS with `envs.safe_git`'s environment and overrides (its module docstring)."""
    where = [] if git_dir is None else ["--git-dir", git_dir or self.git_dir]
    if git_dir is not None:
      safe_git.check_repository(self.git_dir)
    overrides = [a for kv in safe_git.OVERRIDES for a in ("-c", kv)]
    full_env = {**safe_git.environment(), **(env or {})}
    res = subprocess.run(["git", "--no-pager", "--no-replace-objects", *where, *overrides,
                          *args], input=stdin, capture_output=True, env=full_env,
                         cwd=full_env["HOME"])
    if res.returncode:
      raise safe_git.GitError(f"git {' '.join(args)[:200]} in {self.git_dir}: "
                              f"{res.stderr.decode(errors='replace').strip()[-500:]}")
    return res.stdout

  def blobs(self, files: Mapping[str, bytes]) -> dict[str, str]:
    """Writes file contents as blobs.

    Args:
      files: {path: bytes}; the paths only name the results.

    Returns:
      {path: blob id}.
    """
    contents = list(dict.fromkeys(files.values()))
    if not contents:
      return {}
    with tempfile.TemporaryDirectory(prefix="arbor-blobs-") as tmp:
      names = []
      for i, data in enumerate(contents):
        names.append(os.path.join(tmp, str(i)))
        with open(names[-1], "wb") as f:
          f.write(data)
      # One process for every blob: the file names are ours (digits), never a newline.
      ids = self._run(["hash-object", "-w", "--no-filters", "--stdin-paths"],
                      stdin="".join(n + "\n" for n in names).encode()).decode().split()
    by_content = dict(zip(contents, ids))
    return {path: by_content[data] for path, data in files.items()}

  def tree(self, entries: Mapping[str, tuple[str, str]]) -> str:
    """Writes the trees of a file listing and returns the root tree's id.

    Args:
      entries: {path: (mode, blob id)}; mode FILE or EXECUTABLE; paths relative, "/"-separated.

    Raises:
      ValueError: naming the path, for an empty, absolute or ".."/"." part, or a NUL.
    """
    root: dict = {}
    for path, (mode, sha) in entries.items():
      parts = path.split("/")
      if "\0" in path or any(p in ("", ".", "..", ".git") for p in parts):
        raise ValueError(f"path {path!r}: not a clean relative path for a git tree")
      if mode not in (FILE, EXECUTABLE):
        raise ValueError(f"path {path!r}: mode {mode!r}: expected {FILE} or {EXECUTABLE}")
      node = root
      for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
          raise ValueError(f"path {path!r}: a file of the listing is one of its folders")
      if isinstance(node.get(parts[-1]), dict):
        raise ValueError(f"path {path!r}: a folder of the listing is one of its files")
      node[parts[-1]] = (mode, sha)
    return self._write_tree(root)

  def _write_tree(self, node: dict) -> str:
    lines = []
    for name, child in node.items():
      if isinstance(child, dict):
        lines.append(("040000", "tree", self._write_tree(child), name))
      else:
        lines.append((child[0], "blob", child[1], name))
    key = tuple(sorted(lines, key=lambda l: l[3]))
    if key not in self._trees:
      # mktree sorts the entries itself; -z: names may hold any byte but NUL.
      data = b"".join(f"{mode} {kind} {sha}\t".encode() + name.encode(
          "utf-8", "surrogateescape") + b"\0" for mode, kind, sha, name in key)
      self._trees[key] = self._run(["mktree", "-z"], stdin=data).decode().strip()
    return self._trees[key]

  def commit(self, tree: str, parents: Sequence[str], message: str, date: int) -> str:
    """Writes a commit by `AUTHOR` at `date` (seconds since the epoch, UTC) and returns its id.

    Unsigned whatever the repository's configuration says (`--no-gpg-sign`).
    """
    stamp = f"{int(date)} +0000"
    env = {"GIT_AUTHOR_NAME": AUTHOR[0], "GIT_AUTHOR_EMAIL": AUTHOR[1],
           "GIT_AUTHOR_DATE": stamp, "GIT_COMMITTER_NAME": AUTHOR[0],
           "GIT_COMMITTER_EMAIL": AUTHOR[1], "GIT_COMMITTER_DATE": stamp}
    args = ["commit-tree", "--no-gpg-sign", tree]
    for p in parents:
      args += ["-p", p]
    return self._run(args, stdin=message.encode("utf-8"), env=env).decode().strip()

  def set_branch(self, name: str, commit: str) -> None:
    """Points refs/heads/NAME at `commit`.

    Raises:
      ValueError: naming the branch, when git would not take it as a branch name.
    """
    ref = f"refs/heads/{name}"
    if not re.match(r"^[\w][\w.-]*$", name) or ".." in name or name.endswith(".lock"):
      raise ValueError(f"branch {name!r}: expected letters, digits, '_', '.' and '-'")
    self._run(["update-ref", "--no-deref", ref, commit])

  def set_head(self, name: str) -> None:
    """Makes HEAD the branch NAME (what a clone checks out)."""
    self._run(["symbolic-ref", "HEAD", f"refs/heads/{name}"])

  def diff(self, old: str, new: str, paths: Sequence[str] = ()) -> str:
    """The unified diff (git's, a/ b/ prefixes, no renames) from commit `old` to `new`,
    limited to `paths` when given. Empty when they do not differ there."""
    return self._run(["diff-tree", "-r", "-p", "--no-color", "--no-ext-diff", "--no-textconv",
                      "--no-renames", "--full-index", "--src-prefix=a/", "--dst-prefix=b/",
                      old, new, "--", *paths]).decode("utf-8", errors="replace")
