"""The content-addressed build cache shared by every builder of this package.

Layout under the cache root (`root()`: the `cache_dir` argument, else $ARBOR_ENV_CACHE, else
~/.cache/arbor/environments, or /var/cache/arbor/environments for root, whose home is closed to
the sandbox uids that must reach a root filesystem):

    ROOT/<kind>/<key>/          a finished build (never modified once renamed into place)
    ROOT/<kind>/<key>.lock      flock held while one process builds <key>
    ROOT/<kind>/.tmp-<key>-*    a build in progress (removed on failure)

`key` is `content_key(spec)`: the SHA-256 of the spec's canonical JSON (sorted keys, no
whitespace, ASCII), so equal specs share one build whatever the order of their fields.
`build_once` makes a build atomic (a temporary directory renamed into place: a reader sees a
whole build or none) and runs it once across processes (a second builder of the same key waits
on the lock, then finds the result).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any, Callable, Optional

ENV_VAR = "ARBOR_ENV_CACHE"
DEFAULT = "~/.cache/arbor/environments"
ROOT_DEFAULT = "/var/cache/arbor/environments"  # root's home (0700) hides builds from sandboxes


def root(cache_dir: Optional[str] = None) -> str:
  """The absolute cache root: `cache_dir`, else $ARBOR_ENV_CACHE, else DEFAULT
  (ROOT_DEFAULT when running as root).

  The path is not resolved through links: a bwrap sandbox refuses a root filesystem reached
  through one (`envs.sandbox.rootfs.open_dir`), so give a real path.
  """
  default = ROOT_DEFAULT if os.geteuid() == 0 else DEFAULT
  return os.path.abspath(os.path.expanduser(cache_dir or os.environ.get(ENV_VAR) or default))


def check_searchable(path: str) -> None:
  """Raises ValueError naming the first directory on `path` that other users cannot enter: a
  bwrap sandbox runs as an unprivileged uid, which must traverse every component to mount a
  root filesystem from the cache."""
  parts = os.path.abspath(path).split("/")
  for i in range(2, len(parts) + 1):
    p = "/".join(parts[:i]) or "/"
    try:
      mode = os.stat(p).st_mode
    except FileNotFoundError:
      return
    if not mode & 0o001:
      raise ValueError(f"cache_dir: {p} is closed to other users (mode {oct(mode & 0o777)}); a "
                       f"sandbox uid cannot reach {path}: choose a cache under a searchable "
                       f"directory ({ENV_VAR}=..., e.g. {ROOT_DEFAULT})")


def canonical_json(obj: Any) -> str:
  """JSON with sorted keys, no whitespace and ASCII escapes: equal values, equal text."""
  return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def content_key(obj: Any) -> str:
  """64 hex digits: SHA-256 of `canonical_json(obj)`."""
  return hashlib.sha256(canonical_json(obj).encode("ascii")).hexdigest()


def build_once(cache_dir: Optional[str], kind: str, key: str,
               build: Callable[[str], None]) -> str:
  """The directory of build `key` of `kind`, built by `build(tmp_dir)` if absent.

  Args:
    cache_dir: the cache root (`root`).
    kind: a subdirectory name ("debian", "env", ...).
    key: the build's content key.
    build: fills the empty directory it is given; raising leaves nothing behind.

  Returns:
    ROOT/<kind>/<key>, complete.
  """
  parent = os.path.join(root(cache_dir), kind)
  final = os.path.join(parent, key)
  if os.path.isdir(final):
    return final
  os.makedirs(parent, exist_ok=True)
  with open(os.path.join(parent, key + ".lock"), "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
    if os.path.isdir(final):
      return final
    tmp = tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=parent)
    try:
      build(tmp)
      os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the build from sandbox uids
      os.rename(tmp, final)
    finally:
      if os.path.lexists(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
  return final


def read_manifest(build_dir: str) -> dict:
  """The manifest.json a builder wrote beside its result."""
  with open(os.path.join(build_dir, "manifest.json"), encoding="utf-8") as f:
    return json.load(f)


def write_manifest(build_dir: str, manifest: dict) -> None:
  with open(os.path.join(build_dir, "manifest.json"), "w", encoding="utf-8") as f:
    json.dump(manifest, f, indent=1, sort_keys=True)
    f.write("\n")
