"""The local Docker engine behind the docker sandbox backend: found, or started.

    python -m envs.sandbox.docker_engine   # starts dockerd if none answers; prints its info

`ensure_engine()` pings the engine that `DOCKER_HOST` (default: the local socket) names. When
none answers, we are root, `dockerd` is installed (Debian: `apt-get install docker.io`) and
the engine would be the local one, it starts it as

    dockerd --storage-driver=overlay2 --bridge=none --iptables=false

detached in its own session, logging to `LOG` with its pid in `PIDFILE`: no bridge network
exists, so no container can be given one (every sandbox runs with network none), and the
host's firewall rules are left alone. Concurrent callers start one engine between them (a
lock file).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time

from envs.sandbox.base import SandboxError
from envs.sandbox.docker import docker_client

DOCKERD_ARGS = ("--storage-driver=overlay2", "--bridge=none", "--iptables=false")
LOG = "/var/log/arbor-dockerd.log"
PIDFILE = "/var/run/docker.pid"
_LOCK = "/var/run/arbor-dockerd.lock"
_LOCAL = ("", "unix:///var/run/docker.sock", "unix:///run/docker.sock")


def _answers():
  """(a client, None) if an engine answers, else (None, why not)."""
  try:
    client = docker_client()
    client.ping()
    return client, None
  except SandboxError:  # DOCKER_HOST refused: no engine of ours to start
    raise
  except Exception as e:  # docker.errors.DockerException, requests' ConnectionError
    return None, f"{type(e).__name__}: {str(e)[:200]}"


def _tail(path: str, n: int = 2000) -> str:
  try:
    with open(path, "rb") as f:
      f.seek(0, os.SEEK_END)
      f.seek(max(0, f.tell() - n))
      return f.read().decode(errors="replace")
  except OSError as e:
    return f"(no log: {e})"


def ensure_engine(start: bool = True, timeout: float = 60):
  """A docker-py client of an engine that answers, starting the local one if needed.

  Args:
    start: start dockerd (see the module docstring) when no engine answers; False: only check.
    timeout: seconds to wait for a started engine to answer.

  Returns:
    A `docker.DockerClient` whose engine answered a ping.

  Raises:
    SandboxError: no engine answers and none can be started: `start` is False, `DOCKER_HOST`
      names another engine, dockerd is not installed, we are not root, or the started engine
      exited or did not answer within `timeout` (the message carries the tail of its log).
  """
  client, why = _answers()
  if client is not None:
    return client
  host = os.environ.get("DOCKER_HOST", "")
  if not start:
    raise SandboxError(f"no Docker engine answers ({why})")
  if host not in _LOCAL:
    raise SandboxError(f"no Docker engine answers at DOCKER_HOST={host!r} ({why}); only the "
                       "local engine is started here")
  dockerd = shutil.which("dockerd")
  if dockerd is None:
    raise SandboxError(f"no Docker engine answers ({why}) and dockerd is not installed: "
                       "apt-get install docker.io (Debian/Ubuntu)")
  if os.geteuid() != 0:
    raise SandboxError(f"no Docker engine answers ({why}); starting dockerd needs root: run "
                       f"`sudo {sys.executable} -m envs.sandbox.docker_engine`")
  with open(_LOCK, "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be starting it right now
    client, why = _answers()
    if client is not None:
      return client
    with open(LOG, "ab") as log:
      proc = subprocess.Popen([dockerd, *DOCKERD_ARGS, f"--pidfile={PIDFILE}"],
                              stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                              start_new_session=True, close_fds=True)
    deadline = time.monotonic() + timeout
    while True:
      client, why = _answers()
      if client is not None:
        return client
      if proc.poll() is not None:
        raise SandboxError(f"dockerd exited with status {proc.returncode} before answering; "
                           f"the end of {LOG}:\n{_tail(LOG)}")
      if time.monotonic() > deadline:
        raise SandboxError(f"dockerd (pid {proc.pid}) did not answer within timeout={timeout} "
                           f"s ({why}); the end of {LOG}:\n{_tail(LOG)}")
      time.sleep(0.2)


def main() -> int:
  try:
    client = ensure_engine()
  except SandboxError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  info, version = client.info(), client.version()
  runc = next((c.get("Version", "") for c in version.get("Components", [])
               if c.get("Name") == "runc"), "?")
  print(f"Docker engine {version.get('Version')} (API {version.get('ApiVersion')}) answers at "
        f"{client.api.base_url}: storage {info.get('Driver')}, cgroup v"
        f"{info.get('CgroupVersion')}, runc {runc}, {info.get('Containers')} containers, "
        f"{info.get('Images')} images")
  return 0


if __name__ == "__main__":
  sys.exit(main())
