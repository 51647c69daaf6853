"""Debian root filesystems built with mmdebstrap, cached by content, and their Docker images.

    path = rootfs("bookworm", ["git"])          # ROOT/debian/<key>/rootfs, python3 included
    tag = docker_image("bookworm", ["git"])     # "arbor-debian:<key[:24]>", imported once

A root filesystem is `mmdebstrap --variant=minbase` of one suite from one mirror with
python3 and the given packages; its key is the SHA-256 of {suite, sorted packages, mirror,
variant, format version}, so asking again (in any package order) returns the same directory
without a build. Builds are atomic and run once across processes (`cache.build_once`). The
mirror's contents move on between builds (a suite's point releases and security-free main
only), so the exact package versions a build got are written to ROOT/debian/<key>/manifest.json
(`dpkg-query` of the result); mtimes are clamped to SOURCE_DATE_EPOCH.

The result is made fit for a sandbox: /etc/resolv.conf and /etc/hostname (copied from the host
during the build) are removed or neutral, /dev is emptied (every backend mounts its own), and
the apt lists are gone (mmdebstrap's cleanup). The directory is bound entry by entry,
read-only, by the bwrap backend (`envs.sandbox.rootfs`), and imported as an image (no
registry involved) for the Docker backend.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from typing import Callable, Optional, Sequence

from envs.environments import cache
from envs.sandbox import docker_engine

log = logging.getLogger(__name__)

# Suites whose archive deb.debian.org serves, and the python3 each ships.
SUITES = {"bullseye": "3.9", "bookworm": "3.11", "trixie": "3.13"}
DEFAULT_SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
VARIANT = "minbase"
FORMAT = 1             # bump when the build recipe changes what a key's directory holds
SOURCE_DATE_EPOCH = "1700000000"
IMAGE_REPOSITORY = "arbor-debian"
# A Debian package name, optionally "=VERSION" (apt's syntax for pinning one).
_PACKAGE = re.compile(r"^[a-z0-9][a-z0-9+.-]+(=[A-Za-z0-9.+~:-]+)?$")
_MIRROR = re.compile(r"^https?://[A-Za-z0-9.-]+(:\d+)?(/[A-Za-z0-9._~/-]*)?$")
BUILD_TIMEOUT = 1800   # seconds for one mmdebstrap run


def check_suite(suite: str, field: str = "suite") -> str:
  """`suite` if it is one of SUITES, else ValueError naming `field` and the value."""
  if suite not in SUITES:
    raise ValueError(f"{field}={suite!r}: expected a Debian suite, one of {sorted(SUITES)}")
  return suite


def check_packages(packages: Sequence[str], field: str = "packages") -> tuple[str, ...]:
  """The sorted, deduplicated package names (python3 not added); ValueError naming `field`
  and the first bad entry otherwise (a name must be a Debian package name, optionally
  "=VERSION", never an option or a path)."""
  if isinstance(packages, str):
    raise ValueError(f"{field}={packages!r}: expected a list of Debian package names")
  for i, p in enumerate(packages):
    if not isinstance(p, str) or not _PACKAGE.match(p):
      raise ValueError(f"{field}[{i}]={p!r}: not a Debian package name (e.g. 'git' or "
                       "'libxml2-dev=2.9.14+dfsg-1.3')")
  return tuple(sorted(set(packages)))


def spec(suite: str = DEFAULT_SUITE, packages: Sequence[str] = (),
         mirror: Optional[str] = None) -> dict:
  """The canonical description of a root filesystem (what its key hashes).

  Raises:
    ValueError: naming 'suite', 'packages[i]' or 'mirror'.
  """
  mirror = mirror or DEFAULT_MIRROR
  if not _MIRROR.match(mirror):
    raise ValueError(f"mirror={mirror!r}: expected an http(s) URL of a Debian archive")
  return {"kind": "debian-rootfs", "format": FORMAT, "suite": check_suite(suite),
          "packages": list(check_packages(tuple(packages) + ("python3",))),
          "mirror": mirror, "variant": VARIANT}


def key(suite: str = DEFAULT_SUITE, packages: Sequence[str] = (),
        mirror: Optional[str] = None) -> str:
  """The content key (64 hex digits) of `spec(suite, packages, mirror)`."""
  return cache.content_key(spec(suite, packages, mirror))


def rootfs(suite: str = DEFAULT_SUITE, packages: Sequence[str] = (),
           cache_dir: Optional[str] = None, *, mirror: Optional[str] = None,
           progress: Optional[Callable[[str], None]] = None) -> str:
  """A cached Debian root filesystem directory with python3 and `packages`.

  Args:
    suite: one of SUITES.
    packages: Debian package names (python3 is always included).
    cache_dir: the cache root (`cache.root`: default $ARBOR_ENV_CACHE, else
      ~/.cache/arbor/environments, /var/cache/arbor/environments for root); every directory
      on its path must be searchable by other users (sandbox uids mount from it).
    mirror: the Debian archive (default DEFAULT_MIRROR).
    progress: called with each line of mmdebstrap's output (default: logged at INFO).

  Returns:
    The absolute path ROOT/debian/<key>/rootfs of the finished directory (bound read-only by
    sandboxes; never modify it).

  Raises:
    ValueError: naming a bad argument.
    RuntimeError: mmdebstrap is missing or failed (its output's tail in the message).
  """
  s = spec(suite, packages, mirror)
  k = cache.content_key(s)
  cache.check_searchable(cache.root(cache_dir))
  path = cache.build_once(cache_dir, "debian", k, lambda tmp: _build(tmp, s, progress))
  return os.path.join(path, "rootfs")


def _build(tmp: str, s: dict, progress: Optional[Callable[[str], None]]) -> None:
  exe = shutil.which("mmdebstrap")
  if exe is None:
    raise RuntimeError("mmdebstrap is not installed (apt-get install mmdebstrap)")
  target = os.path.join(tmp, "rootfs")
  # As root the tree is made with real ownership; otherwise in a user namespace.
  mode = "root" if os.geteuid() == 0 else "unshare"
  argv = [exe, f"--variant={s['variant']}", f"--mode={mode}", "--format=directory",
          "--include=" + ",".join(s["packages"]), s["suite"], target, s["mirror"]]
  env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
         "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH, "HOME": tmp, "TMPDIR": tmp}
  say = progress or (lambda line: log.info("debian %s: %s", s["suite"], line))
  start = time.monotonic()
  say(f"mmdebstrap {s['suite']} +{','.join(s['packages'])}")
  out = _run_streaming(argv, env, say, BUILD_TIMEOUT)
  if out[0] != 0:
    raise RuntimeError(f"mmdebstrap {s['suite']} {s['packages']} failed (exit code {out[0]}):"
                       f"\n{out[1][-3000:]}")
  _neutralize(target)
  versions = subprocess.run(
      ["dpkg-query", f"--admindir={target}/var/lib/dpkg", "-W", "-f=${Package}=${Version}\n"],
      capture_output=True, text=True, check=True, timeout=120).stdout.split()
  cache.write_manifest(tmp, {"spec": s, "installed": sorted(versions),
                             "seconds": round(time.monotonic() - start, 1)})


def _run_streaming(argv: list[str], env: dict, say: Callable[[str], None],
                   timeout: float) -> tuple[int, str]:
  """Runs argv with stdout+stderr passed line by line to `say`: (exit code, all output)."""
  lines = []
  with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL, text=True, errors="replace") as p:
    killed = threading.Event()
    timer = threading.Timer(timeout, lambda: (killed.set(), p.kill()))  # a silent hang too
    timer.start()
    try:
      for line in p.stdout:
        lines.append(line)
        say(line.rstrip())
      rc = p.wait()
    finally:
      timer.cancel()
    if killed.is_set():
      lines.append(f"killed after {timeout} s\n")
  return rc, "".join(lines)


def _neutralize(target: str) -> None:
  """Removes what the build copied from the host, and device nodes."""
  etc = os.path.join(target, "etc")
  for name in ("resolv.conf",):
    if os.path.lexists(os.path.join(etc, name)):
      os.unlink(os.path.join(etc, name))
  with open(os.path.join(etc, "hostname"), "w") as f:
    f.write("sandbox\n")
  dev = os.path.join(target, "dev")
  for name in os.listdir(dev):
    p = os.path.join(dev, name)
    if os.path.isdir(p) and not os.path.islink(p):
      shutil.rmtree(p)
    else:
      os.unlink(p)


# ----------------------------------------------------------------------------- Docker


def docker_client():
  """A docker-py client of the local engine, started when none answers
  (`envs.sandbox.docker_engine.ensure_engine`)."""
  return docker_engine.ensure_engine()


def image_exists(client, tag: str) -> bool:
  """Whether the engine has an image tagged `tag`."""
  import docker
  try:
    client.images.get(tag)
    return True
  except docker.errors.ImageNotFound:
    return False


def import_directory(client, directory: str, tag: str) -> str:
  """Imports a root filesystem directory as image `tag` (`docker import`, no registry).

  The tar is written with numeric owners, sorted names and mtimes clamped, so the same tree
  gives the same layer. The image runs `sleep infinity` by default and has PATH set.

  Returns:
    The tag.
  """
  with tempfile.TemporaryDirectory(prefix="arbor-import-") as tmp:
    tar = os.path.join(tmp, "rootfs.tar")
    subprocess.run(["tar", "--numeric-owner", "--sort=name", "--xattrs",
                    f"--mtime=@{SOURCE_DATE_EPOCH}", "--clamp-mtime", "-C", directory,
                    "-cf", tar, "."], check=True, timeout=1800)
    repository, _, version = tag.rpartition(":")
    client.api.import_image_from_file(
        tar, repository=repository, tag=version,
        changes=["ENV PATH=/usr/local/bin:/usr/bin:/bin", "ENV LANG=C.UTF-8",
                 'CMD ["sleep", "infinity"]'])
  if not image_exists(client, tag):
    raise RuntimeError(f"docker import of {directory} did not produce image {tag!r}")
  return tag


def docker_image(suite: str = DEFAULT_SUITE, packages: Sequence[str] = (),
                 cache_dir: Optional[str] = None, *, mirror: Optional[str] = None,
                 progress: Optional[Callable[[str], None]] = None) -> str:
  """The root filesystem of `rootfs(suite, packages, ...)` as a local Docker image.

  Args:
    as `rootfs`.

  Returns:
    Its tag, "arbor-debian:<first 24 hex digits of the key>"; imported once (an existing
    tag is reused), the root filesystem built first if needed.

  Raises:
    ValueError: naming a bad argument.
    RuntimeError: the build or the import failed.
    envs.sandbox.base.SandboxError: no usable Docker engine.
  """
  k = key(suite, packages, mirror)
  tag = f"{IMAGE_REPOSITORY}:{k[:24]}"
  client = docker_client()
  if image_exists(client, tag):
    return tag
  path = rootfs(suite, packages, cache_dir, mirror=mirror, progress=progress)
  (progress or log.info)(f"docker import {path} as {tag}")
  return import_directory(client, path, tag)
