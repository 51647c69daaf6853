"""Git on repositories that arrive with a dataset: read-only plumbing that runs none of their
programs.

A repository's own configuration (`.git/config`, files it includes, `info/attributes`) is as
untrusted as its files: options such as `log.showSignature` with `gpg.program`,
`core.fsmonitor`, `core.pager`, `diff.external`, textconv and filter drivers make ordinary git
commands run a program it names, with the caller's rights. Every git command that envs/ runs on
a mirror or a source repository goes through `git` below, which

- runs git with an environment of its own: no system or global configuration
  (GIT_CONFIG_NOSYSTEM=1, GIT_CONFIG_GLOBAL=/dev/null, HOME and XDG_CONFIG_HOME an empty
  directory, GIT_ATTR_NOSYSTEM=1), no inherited GIT_* variable (GIT_DIR, GIT_CONFIG_PARAMETERS,
  GIT_EXEC_PATH, GIT_EXTERNAL_DIFF, GIT_SSH_COMMAND, GIT_ALTERNATE_OBJECT_DIRECTORIES ...),
  GIT_TERMINAL_PROMPT=0, GIT_NO_REPLACE_OBJECTS=1, GIT_OPTIONAL_LOCKS=0, PAGER=GIT_PAGER=cat,
  LC_ALL=C, and the empty directory as working directory;
- passes `-c` overrides (`OVERRIDES`: command-line configuration wins over the repository's)
  for every key that runs a program or a transport: signature checks, fsmonitor, hooks, pager,
  editor, ssh, askpass, credential helpers, every transport protocol;
- is used only with plumbing (`rev-parse`, `cat-file`, `ls-tree`, `diff-tree`, `rev-list`,
  `describe`): they never read the work tree or the index (fsmonitor, filters), never verify
  signatures, and `diff-tree` runs no textconv or external diff (`--no-textconv
  --no-ext-diff` are passed as well). File contents are read with `cat-file` without
  `--filters` / `--textconv`, so no filter or textconv driver of `info/attributes` runs.

Per-driver keys (`diff.<driver>.textconv`, `diff.<driver>.command`, `filter.<driver>.*`,
`merge.<driver>.driver`) cannot be overridden by name; the commands above never consult them.
`uploadpack.packObjectsHook` is honoured by git only from protected (system, global, command
line) configuration, which is not read here; `core.gitProxy`, `remote.*` commands and
`core.alternateRefsCommand` belong to fetch and push, which `protocol.allow=never` stops.

`check_repository` then does what git's `safe.directory` does not do for `--git-dir`: it
refuses a git directory (or its `config`) that is a symbolic link or is not owned by the user
running this, object directories and packs that are symbolic links, a `commondir` file (a
linked worktree's git directory reads another repository), and `objects/info/alternates`
entries outside the folder holding the repository (they would make another repository's
objects, e.g. a private one on the host, readable through this one).
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import stat
import subprocess
import tempfile
from typing import Iterator, Optional

# Configuration that wins over the repository's own (`git -c`); see the module docstring.
OVERRIDES = (
    "log.showSignature=false", "gpg.program=false", "gpg.openpgp.program=false",
    "gpg.x509.program=false", "gpg.ssh.program=false", "gpg.ssh.defaultKeyCommand=false",
    "gpg.ssh.allowedSignersFile=/dev/null", "core.fsmonitor=false", "core.hooksPath=/dev/null",
    "core.pager=cat", "core.editor=false", "sequence.editor=false", "core.sshCommand=false",
    "core.askPass=", "credential.helper=", "diff.external=", "core.attributesFile=/dev/null",
    "log.mailmap=false", "mailmap.file=/dev/null", "gc.auto=0", "maintenance.auto=false",
    "core.quotePath=false", "protocol.allow=never",
    *(f"protocol.{p}.allow=never" for p in ("ext", "fd", "file", "git", "http", "https", "ssh")),
)
_MAX_ALTERNATES_DEPTH = 5  # git's own limit on chains of alternates
_REV = re.compile(r"^[^-\s\x00][^\s\x00]*$")  # a revision name, never an option


class GitError(RuntimeError):
  """A git command on a repository failed (its stderr is in the message)."""


class RepositoryError(ValueError):
  """A path is not a git repository, or is one that is not safe to read (the message says why
  and names the path)."""


_home: Optional[str] = None


def _empty_home() -> str:
  """An empty directory of this process: git's HOME and working directory."""
  global _home
  if _home is None or not os.path.isdir(_home):
    _home = tempfile.mkdtemp(prefix="arbor-git-home-")
    atexit.register(shutil.rmtree, _home, True)
  return _home


def environment() -> dict[str, str]:
  """The environment git runs with: nothing of the caller's but PATH (see module docstring)."""
  home = _empty_home()
  return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home,
          "XDG_CONFIG_HOME": home, "LC_ALL": "C", "GIT_CONFIG_NOSYSTEM": "1",
          "GIT_CONFIG_GLOBAL": os.devnull, "GIT_ATTR_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0",
          "GIT_NO_REPLACE_OBJECTS": "1", "GIT_OPTIONAL_LOCKS": "0", "GIT_PAGER": "cat",
          "PAGER": "cat"}


def check_rev(rev: str, field: str = "revision") -> str:
  """`rev` when it is a revision name git cannot take for an option.

  Raises:
    ValueError: naming `field`, for an empty value, one starting with "-", or holding
      whitespace or NUL.
  """
  if not isinstance(rev, str) or not _REV.match(rev):
    raise ValueError(f"{field}={rev!r}: expected a commit id or revision name")
  return rev


def _lstat(path: str) -> Optional[os.stat_result]:
  try:
    return os.lstat(path)
  except FileNotFoundError:
    return None


def find_git_dir(path: str) -> str:
  """The git directory of a repository: PATH/.git of a work tree, or PATH itself when bare.

  Args:
    path: a work tree or a bare repository.

  Returns:
    The absolute git directory (not yet checked: see `check_repository`).

  Raises:
    RepositoryError: PATH/.git is a symbolic link or a file (a linked worktree or submodule:
      it points at another repository), or PATH is not a repository.
  """
  path = os.path.abspath(path)
  dot = os.path.join(path, ".git")
  st = _lstat(dot)
  if st is not None:
    if stat.S_ISDIR(st.st_mode):
      return dot
    what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a folder"
    raise RepositoryError(f"{dot}: {what} (a linked worktree or submodule points at another "
                          "repository: give that repository)")
  if os.path.isfile(os.path.join(path, "HEAD")) and os.path.isdir(os.path.join(path, "objects")):
    return path
  raise RepositoryError(f"{path}: not a git repository")


def _owned(path: str, st: os.stat_result, what: str) -> None:
  if st.st_uid != os.geteuid():
    raise RepositoryError(
        f"{path}: {what} is owned by uid {st.st_uid}, not by uid {os.geteuid()} that runs "
        "this; a repository of another user is not read (its configuration could run "
        "programs): copy it, or change its owner, if you trust it")


def _check_objects(objects: str, holder: str, depth: int = 0) -> None:
  """No symbolic link among the object store's folders and packs; alternates inside `holder`."""
  st = _lstat(objects)
  if st is None:
    return  # git reports a missing object store itself
  if not stat.S_ISDIR(st.st_mode):
    raise RepositoryError(f"{objects}: a symbolic link or not a folder")
  with os.scandir(objects) as top:
    subdirs = []
    for entry in top:
      if entry.is_symlink():
        raise RepositoryError(f"{entry.path}: a symbolic link in the object store")
      if entry.is_dir(follow_symlinks=False):
        subdirs.append(entry.path)
  for sub in subdirs:  # fan-out folders of loose objects, pack/ and info/
    with os.scandir(sub) as it:
      for entry in it:
        if entry.is_symlink():
          raise RepositoryError(f"{entry.path}: a symbolic link in the object store")
  alternates = os.path.join(objects, "info", "alternates")
  st = _lstat(alternates)
  if st is None:
    return
  if not stat.S_ISREG(st.st_mode):
    raise RepositoryError(f"{alternates}: not a regular file")
  if depth >= _MAX_ALTERNATES_DEPTH:
    raise RepositoryError(f"{alternates}: alternates nested deeper than "
                          f"{_MAX_ALTERNATES_DEPTH} levels")
  with open(alternates, encoding="utf-8", errors="surrogateescape") as f:
    lines = [l.strip() for l in f if l.strip() and not l.startswith("#")]
  root = os.path.realpath(holder)
  for line in lines:
    if line.startswith('"'):
      raise RepositoryError(f"{alternates}: quoted alternate {line!r} is not supported")
    target = os.path.realpath(os.path.join(objects, line))
    if os.path.commonpath([root, target]) != root:
      raise RepositoryError(f"{alternates}: alternate {line!r} lies outside {root}, the folder "
                            "holding the repository")
    _check_objects(target, holder, depth + 1)


_checked: dict[str, tuple] = {}  # git dir -> the stat signature it passed the check with


def check_repository(git_dir: str) -> str:
  """Refuses a git directory whose configuration or objects may not be the owner's own.

  Checks (module docstring): the git directory and its `config` (and `config.worktree`) are no
  symbolic links and are owned by the user running this; no `commondir`; no symbolic link in
  the object store; alternates inside the folder that holds the repository (for a clone's
  `.git`, the folder above its work tree). A passed check is remembered until the directory,
  its config or its object store changes.

  Args:
    git_dir: the git directory.

  Returns:
    The absolute git directory.

  Raises:
    RepositoryError: naming the path and the reason.
  """
  git_dir = os.path.abspath(git_dir)
  st = _lstat(git_dir)
  if st is None:
    raise RepositoryError(f"{git_dir}: no such git directory")
  if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
    raise RepositoryError(f"{git_dir}: a symbolic link or not a folder")
  sig = [(st.st_ino, st.st_mtime_ns)]
  _owned(git_dir, st, "the git directory")
  for name in ("config", "config.worktree"):
    path = os.path.join(git_dir, name)
    cst = _lstat(path)
    if cst is None:
      continue
    if not stat.S_ISREG(cst.st_mode):
      raise RepositoryError(f"{path}: a symbolic link or not a regular file")
    _owned(path, cst, "its configuration")
    sig.append((name, cst.st_ino, cst.st_mtime_ns))
  if _lstat(os.path.join(git_dir, "commondir")) is not None:
    raise RepositoryError(f"{git_dir}: has a commondir file (a linked worktree's git directory "
                          "reads another repository): give the main repository")
  objects = os.path.join(git_dir, "objects")
  ost = _lstat(objects)
  sig.append(ost and (ost.st_ino, ost.st_mtime_ns))
  if _checked.get(git_dir) == sig:
    return git_dir
  holder = os.path.dirname(git_dir)
  if os.path.basename(git_dir) == ".git":
    holder = os.path.dirname(holder)
  _check_objects(objects, holder)
  _checked[git_dir] = sig
  return git_dir


def git(git_dir: str, *args: str, stdin: Optional[bytes] = None, trusted: bool = False) -> bytes:
  """Runs `git --git-dir GIT_DIR ARGS` safely (module docstring) and returns its stdout.

  Args:
    git_dir: the git directory.
    *args: the git command and its arguments (plumbing: see the module docstring).
    stdin: bytes fed to the command.
    trusted: skip `check_repository` (the caller vouches for the repository's owner and
      objects); the environment and overrides apply all the same.

  Raises:
    RepositoryError: the repository fails `check_repository`.
    GitError: git failed.
  """
  git_dir = os.path.abspath(git_dir) if trusted else check_repository(git_dir)
  overrides = [a for kv in OVERRIDES for a in ("-c", kv)]
  res = subprocess.run(["git", "--no-pager", "--no-replace-objects", "--git-dir", git_dir,
                        *overrides, *args], input=stdin, capture_output=True,
                       env=environment(), cwd=_empty_home())
  if res.returncode:
    what = " ".join(args)[:200]
    raise GitError(f"git {what} in {git_dir}: "
                   f"{res.stderr.decode(errors='replace').strip()[-500:]}")
  return res.stdout


def rev_parse(git_dir: str, rev: str) -> Optional[str]:
  """The full id of the commit `rev` names, or None when it names none."""
  try:
    out = git(git_dir, "rev-parse", "--verify", "--quiet", f"{check_rev(rev)}^{{commit}}")
  except GitError:
    return None
  return out.decode().strip()


def read_blob(git_dir: str, rev: str, path: str) -> bytes:
  """The exact bytes of file `path` at `rev` (no filter, no textconv).

  Raises:
    ValueError: `rev` is not a revision name.
    GitError: no such file at `rev`.
  """
  return git(git_dir, "cat-file", "blob", f"{check_rev(rev)}:{path}")


def commit_header(git_dir: str, commit: str) -> tuple[str, int]:
  """(subject, committer time in seconds since the epoch) of a commit, read with `cat-file`.

  The subject is the message's first paragraph with its lines joined by spaces (git's %s).

  Raises:
    GitError: `commit` is not a commit.
  """
  raw = git(git_dir, "cat-file", "commit", check_rev(commit)).decode("utf-8", "replace")
  head, _, message = raw.partition("\n\n")
  committer = [l for l in head.split("\n") if l.startswith("committer ")]
  m = re.search(r"> (\d+) [+-]\d{4}$", committer[0]) if committer else None
  subject = " ".join(l.strip() for l in message.lstrip("\n").split("\n\n", 1)[0].splitlines())
  return subject.strip(), int(m.group(1)) if m else 0


def tree_files(git_dir: str, commit: str) -> Iterator[tuple[str, str, bytes]]:
  """(mode, path, bytes) of every regular file of a commit's tree, as stored (no filter, no
  end-of-line conversion); symbolic links and submodules are left out.

  Raises:
    GitError: git failed.
  """
  entries = []
  for entry in git(git_dir, "ls-tree", "-r", "-z", "--full-tree", check_rev(commit)
                   ).split(b"\0"):
    if entry:
      meta, path = entry.split(b"\t", 1)
      mode, kind, sha = meta.decode().split()
      if kind == "blob" and mode in ("100644", "100755"):
        entries.append((mode, sha, path.decode("utf-8", "surrogateescape")))
  blobs = git(git_dir, "cat-file", "--batch",
              stdin="".join(sha + "\n" for _, sha, _ in entries).encode())
  at = 0
  for mode, _, path in entries:
    header_end = blobs.index(b"\n", at)
    size = int(blobs[at:header_end].split()[2])
    yield mode, path, blobs[header_end + 1:header_end + 1 + size]
    at = header_end + 1 + size + 1  # the blob, then "\n"
