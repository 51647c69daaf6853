"""Sandbox server: sandboxes of one backend behind a small authenticated HTTP/JSON API.

    python -m envs.sandbox_server --host 127.0.0.1 --port 8910 --backend bwrap \\
        --max_sandboxes 64 --token_file /etc/arbor/sandbox.token [--tls_cert C --tls_key K]

Every request carries `Authorization: Bearer <token>` (compared in constant time) or gets 401.
Routes (JSON bodies; bytes as base64):

  GET    /health                    {"ok", "backend", "live", "warm", "max_sandboxes"}
  POST   /sandboxes                 {"limits": {...}?, "rootfs"? | "image"?}
                                                              -> {"id", "limits", "workspace"}
                                                              (429 if full)
  POST   /sandboxes/ID/exec         {"cmd": str | [argv], "timeout"?, "stdin"? | "stdin_b64"?,
                                     "env"?}
                                                              -> ExecResult fields
  POST   /sandboxes/ID/write        {"path", "content_b64"}   -> {}
  POST   /sandboxes/ID/read         {"path"}                  -> {"content_b64"}
  POST   /sandboxes/ID/list         {"path"?}                 -> {"files"}
  POST   /sandboxes/ID/fork         {}                        -> {"id", "limits", "workspace"}
                                                              (429 if full)
  DELETE /sandboxes/ID                                        -> {}

Errors are `{"error": message, "type": name}` with 400 (bad input, PathError, a body nested
deeper than MAX_JSON_DEPTH), 401, 404 (unknown sandbox or file), 405, 408 (body not in within
--body_timeout), 413 (body over --max_request_bytes), 429 (capacity), 500 (sandbox failure).
Requested limits may not exceed the server's (its flags). A sandbox untouched for --ttl
seconds is closed. A warm pool of --warm sandboxes with the server's limits is kept ahead of
demand (warm + live <= --max_sandboxes). SIGTERM/SIGINT: stop accepting, close every sandbox,
exit. Binding a non-loopback address requires TLS. No pickle.

HTTP runs on Starlette under uvicorn (h11 parsing, one event loop; the sandboxes run on a
second loop so their work never delays accepting and parsing). Against idle or slow clients:
the TLS handshake must finish within --handshake_timeout, each request's headers within
--header_timeout of the connection opening (or of the previous response), its body within
--body_timeout; idle keep-alive connections close after --keep_alive; beyond
--max_connections open connections the oldest idle one is closed, those that never carried a
valid token first. Flags are spelled with `_`; the `-` spellings are aliases.

bwrap backend: on start-up the server reclaims what a crashed server left for its uid pool
(tmpfs mounts with workspace data, cgroups, uid locks; uids held by live processes are left
alone), and with --cgroup_parent=own (the default) every sandbox's cgroup is made under the
server's own cgroup, so the service's memory and pids limits bound all of its sandboxes (the
fleet's unit delegates that cgroup: systemd `Delegate=yes`). --ro_bind binds host paths
read-only into every sandbox; --rootfs NAME=DIR lets a request ask for DIR (e.g. a task image's
unpacked root filesystem) as its system view by "rootfs": NAME, nothing outside that allow-list.
DIR is given by its real path: a link at or above it is refused at start-up, and at every
request DIR is opened again component by component without following links and must resolve
to the same path (a directory swapped for a link later gets 400); what is inside DIR is
bound without following its links on the host (`envs.sandbox.rootfs`).
docker backend: --image REF (repeatable) is the allow-list of images a request may ask for by
"image": REF, exactly as listed; the first is the default (and the warm pool's). At start-up
the engine must answer (the local one is started when root can) and every listed image must be
in it or pulled from a registry (`envs.sandbox.images.ensure_image`); otherwise the server
exits naming the image. The image's name picks its profile: a SWE-bench image's sandbox has
its workspace at /testbed, seeded from the image's repository.
The service and HTTP front are `envs.sandbox_service`; this module is the command line and
its start-up checks.
"workspace" is the workspace's path as the sandbox's commands see it (their working directory).
A fork (`Sandbox.fork`) is a new sandbox with the limits and options of ID and a copy of its
workspace (no processes, no /tmp); it takes a slot of --max_sandboxes as a create does and is
closed with its own DELETE. Any holder of the token may use, fork or close any sandbox id.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import resource
import signal
import threading

from envs.net import is_loopback, read_secret
from envs.sandbox import cgroups, docker_engine, images, rootfs as rootfs_dir
from envs.sandbox.base import Limits, SandboxError
# The service and its HTTP front, also importable from here as before.
from envs.sandbox_service import (MAX_JSON_DEPTH, HTTPError, SandboxHTTP,  # noqa: F401
                                  SandboxService, parse_body, reclaim_bwrap)
from envs.untrusted.door import ConnectionLimits

log = logging.getLogger("arbor.sandbox_server")


def check_images(refs) -> None:
  """Every image of the docker allow-list is in the engine (pulled when allowed).

  Raises:
    SandboxError: no engine answers, or an image is absent and cannot be had (the message
      names it and the fallbacks).
  """
  client = docker_engine.ensure_engine(start=os.geteuid() == 0)
  for ref in refs:
    try:
      images.ensure_image(client, ref, images.profile_for(ref).pull)
    except (LookupError, ValueError) as e:
      raise SandboxError(f"--image={ref!r}: {e}") from None


def read_token(path: str) -> str:
  """The server's bearer token from its file (warns when others may read the file).

  Args:
    path: the token file.

  Returns:
    The token.

  Raises:
    ValueError: the token is shorter than 16 characters.
  """
  if os.stat(path).st_mode & 0o077:
    log.warning("token file %s is readable by group/others: chmod 600 it", path)
  token = read_secret(path)
  if len(token) < 16:
    raise ValueError(f"token file {path!r}: expected a token of at least 16 characters")
  return token


def main(argv=None) -> None:
  """The command line (see the module docstring and `--help`)."""
  d, c = Limits(), ConnectionLimits()
  p = argparse.ArgumentParser(prog="python -m envs.sandbox_server",
                              description=__doc__.split("\n")[0])

  def flag(name: str, **kw):  # --a_b, with --a-b kept as an alias
    names = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    p.add_argument(*names, dest=name, **kw)

  flag("host", default="127.0.0.1", help="bind address (non-loopback needs TLS)")
  flag("port", type=int, default=8910, help="TCP port (0: any free port)")
  flag("backend", default="bwrap", choices=("bwrap", "docker", "local"))
  flag("allow_unsafe_local", action="store_true", help="allow --backend local")
  flag("max_sandboxes", type=int, default=32, help="live + warm sandboxes at most")
  flag("warm", type=int, default=0, help="sandboxes pre-created ahead of demand")
  flag("ttl", type=float, default=3600.0, help="close a sandbox idle this many s")
  flag("token_file", required=True, help="file holding the shared bearer token (>= 16 chars)")
  flag("tls_cert", help="PEM certificate chain")
  flag("tls_key", help="PEM private key")
  flag("max_request_bytes", type=int, default=16 << 20, help="413 above this")
  flag("max_timeout", type=float, default=600.0, help="largest exec timeout, s")
  flag("max_connections", type=int, default=c.max_connections,
       help="open connections; beyond, the oldest idle one is closed (tokenless first)")
  flag("handshake_timeout", type=float, default=c.handshake_s, help="TLS handshake deadline, s")
  flag("header_timeout", type=float, default=c.header_s, help="request headers deadline, s")
  flag("body_timeout", type=float, default=c.body_s, help="request body deadline, s (408)")
  flag("keep_alive", type=int, default=c.keep_alive_s, help="idle keep-alive close, s")
  flag("port_file", help="write the bound port here once listening")
  flag("uid_base", type=int, default=2_000_000_000, help="bwrap: first pool uid")
  flag("uid_count", type=int, default=256, help="bwrap: number of pool uids")
  flag("ro_bind", action="append", default=[], metavar="HOST[:SANDBOX]",
       help="bwrap: a host path bound read-only into every sandbox (repeatable)")
  flag("rootfs", action="append", default=[], metavar="NAME=DIR",
       help="bwrap: a root filesystem a request may ask for by NAME (repeatable allow-list)")
  flag("image", action="append", default=[], metavar="REF",
       help="docker: an image a request may ask for by REF (repeatable allow-list; the first "
       "is the default and the warm pool's)")
  flag("cgroup_parent", default="own", choices=("own", "top"),
       help="bwrap: sandbox cgroups under this process's own cgroup (own: the service's "
       "limits bound them all) or at the top of the hierarchy")
  for f in dataclasses.fields(Limits):
    flag(f.name, type=type(getattr(d, f.name)), default=getattr(d, f.name),
         help=f"largest (and default) per-sandbox {f.name}")
  a = p.parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
  limits = Limits(**{f.name: getattr(a, f.name) for f in dataclasses.fields(Limits)})
  backend_kw = {"local": {"allow_unsafe": True}, "docker": {},
                "bwrap": {"uids": range(a.uid_base, a.uid_base + a.uid_count)}}[a.backend]
  if (a.ro_bind or a.rootfs) and a.backend != "bwrap":
    p.error(f"--ro_bind/--rootfs: only the bwrap backend binds host paths, not {a.backend}")
  if a.ro_bind:
    binds = []
    for b in a.ro_bind:
      host, _, dest = b.partition(":")
      if not os.path.isabs(host) or not os.path.exists(host) or (dest and not
                                                                  os.path.isabs(dest)):
        p.error(f"--ro_bind={b!r}: expected an existing absolute host path[:absolute path]")
      binds.append((host, dest) if dest else host)
    backend_kw["ro_binds"] = binds
  rootfs = {}
  for r in a.rootfs:
    name, _, path = r.partition("=")
    try:
      if not name:
        raise ValueError("no NAME")
      rootfs_dir.real_path(path)  # an existing directory with no link on its path
    except ValueError as e:
      p.error(f"--rootfs={r!r}: expected NAME=an existing directory's real path ({e})")
    rootfs[name] = path
  if a.image and a.backend != "docker":
    p.error(f"--image: only the docker backend starts from images, not {a.backend}")
  if a.backend == "docker":
    if not a.image:
      p.error("--backend docker needs --image REF (the images requests may ask for; the "
              "first is the default)")
    try:
      check_images(a.image)
    except SandboxError as e:
      p.error(str(e))
    backend_kw["image"] = a.image[0]
  if a.backend == "local" and not a.allow_unsafe_local:
    p.error("--backend local runs code without isolation: add --allow_unsafe_local")
  try:
    token = read_token(a.token_file)
  except (OSError, ValueError) as e:
    p.error(str(e))
  if a.tls_cert is None and not is_loopback(a.host):
    p.error(f"--host {a.host} is not loopback: exposing the sandbox server needs --tls_cert "
            "and --tls_key (TLS) and the token")
  for name in ("max_connections", "handshake_timeout", "header_timeout", "body_timeout",
               "keep_alive"):
    if not getattr(a, name) > 0:
      p.error(f"--{name}={getattr(a, name)}: expected > 0")
  conn = ConnectionLimits(max_connections=a.max_connections, handshake_s=a.handshake_timeout,
                          header_s=a.header_timeout, body_s=a.body_timeout,
                          keep_alive_s=a.keep_alive)
  _raise_fd_limit(a.max_connections)
  if a.backend == "bwrap" and os.geteuid() == 0:  # else create_sandbox says what is missing
    if a.cgroup_parent == "own":
      try:
        log.info("sandbox cgroups under %s", cgroups.nest_under_own_cgroup())
      except OSError as e:
        p.error(f"--cgroup_parent=own: cannot nest under this process's cgroup ({e}); "
                "delegate it (systemd Delegate=yes) or pass --cgroup_parent=top")
    stale = reclaim_bwrap(backend_kw["uids"])
    if stale:
      log.warning("reclaimed what a crashed server left for uids %s", stale)
  service = SandboxService(a.backend, max_sandboxes=a.max_sandboxes, limits=limits, ttl=a.ttl,
                           warm=a.warm, max_timeout=a.max_timeout, backend_kw=backend_kw,
                           rootfs=rootfs, images=a.image)
  try:
    http = SandboxHTTP(service, token, a.host, a.port, a.tls_cert, a.tls_key,
                       a.max_request_bytes, conn)
    port = http.start()
  except Exception:
    service.stop()
    raise
  stop = threading.Event()

  def on_signal(signum, _frame):
    log.info("signal %d: shutting down", signum)
    stop.set()

  signal.signal(signal.SIGTERM, on_signal)
  signal.signal(signal.SIGINT, on_signal)
  if a.port_file:
    with open(a.port_file + ".tmp", "w") as f:
      f.write(str(port))
    os.replace(a.port_file + ".tmp", a.port_file)
  log.info("serving %s sandboxes on %s://%s:%d", a.backend, "https" if a.tls_cert else "http",
           a.host, port)
  while not stop.wait(0.5):
    if not http._thread.is_alive():
      log.error("the HTTP server stopped on its own")
      break
  http.stop_accepting()
  try:
    service.stop()  # closing the sandboxes ends the execs in flight, so their replies go out
  finally:
    http.join(15)
    log.info("stopped; every sandbox closed")


def _raise_fd_limit(max_connections: int) -> None:
  """Raises the soft open-file limit toward the hard one: every connection holds a socket."""
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  want = max_connections * 2 + 1024  # a connection, a TLS handshake in flight, sandbox pipes
  if soft != resource.RLIM_INFINITY and soft < want:
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


if __name__ == "__main__":
  main()
