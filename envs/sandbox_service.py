"""The sandbox server's service and HTTP front: `SandboxService` (the sandboxes of one backend,
on an event loop of their own) and `SandboxHTTP` (Starlette under uvicorn). The routes, limits
and flags are described by `envs.sandbox_server`, its command line."""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import hmac
import logging
import os
import secrets
import shlex
import ssl
import threading
import time
from typing import Optional, Sequence

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from envs.net import is_loopback, serve_in_thread
from envs.sandbox import bwrap, cgroups, create_sandbox, rootfs as rootfs_dir
from envs.sandbox.base import Limits, PathError, Sandbox, SandboxError, SandboxFull
from envs.untrusted.decode import TooDeep, loads
from envs.untrusted.door import ConnectionLimits, Door, RequestError

log = logging.getLogger("arbor.sandbox_server")


class HTTPError(Exception):
  """An error reply.

  Args:
    status: the HTTP status.
    message: the reply's "error".
    type_: the reply's "type": the exception name the client raises (see `envs.sandbox.remote`).
  """
  def __init__(self, status: int, message: str, type_: str = "HTTPError"):
    super().__init__(message)
    self.status, self.type = status, type_


@dataclasses.dataclass
class _Entry:
  sandbox: Sandbox
  last_used: float
  busy: int = 0


def _field(body: dict, name: str, types, default=...):
  """body[name] checked against `types` (never bool); null or absent gives `default`."""
  value = body.get(name)
  if value is None:
    if default is ...:
      raise HTTPError(400, f"missing field {name!r}", "ValueError")
    return default
  if isinstance(value, bool) or not isinstance(value, types):
    raise HTTPError(400, f"field {name!r}={str(value)[:80]!r}: wrong type "
                    f"{type(value).__name__}", "ValueError")
  return value


def _command(body: dict) -> str:
  """An exec's "cmd": a shell string, or an argv list run exactly as given (quoted here)."""
  cmd = _field(body, "cmd", (str, list))
  if isinstance(cmd, list):
    if not cmd or not all(isinstance(a, str) for a in cmd):
      raise HTTPError(400, f"field 'cmd'={str(cmd)[:80]!r}: expected a shell string or a "
                      "non-empty list of strings", "ValueError")
    return shlex.join(cmd)
  return cmd


def _b64(text: str, name: str) -> bytes:
  try:
    return base64.b64decode(text, validate=True)
  except binascii.Error as e:
    raise HTTPError(400, f"field {name!r}: not base64 ({e})", "ValueError")


class SandboxService:
  """The sandboxes of one server, driven by an asyncio loop on its own thread.

  Args:
    backend: the sandbox backend (bwrap | docker | local).
    max_sandboxes: live + warm sandboxes at most.
    limits: the largest (and default) per-sandbox limits.
    ttl: seconds an untouched sandbox lives.
    warm: sandboxes kept created ahead of demand.
    max_timeout: the largest exec timeout, seconds.
    backend_kw: keyword arguments of the backend's `create`.
    rootfs: bwrap: the root filesystems a request may name ({"name": host directory, by its
      real path}); a sandbox without one sees the host's system read-only.
    images: docker: the images a request may name (exact references); a sandbox without one
      starts from `backend_kw["image"]` (the warm pool's).

  Raises:
    ValueError: max_sandboxes < 1, warm outside 0..max_sandboxes, rootfs with another
      backend than bwrap, images with another backend than docker, or a rootfs directory
      with a link on its path.
  """

  def __init__(self, backend: str, *, max_sandboxes: int, limits: Limits, ttl: float = 3600.0,
               warm: int = 0, max_timeout: float = 600.0, backend_kw: Optional[dict] = None,
               rootfs: Optional[dict[str, str]] = None, images: Sequence[str] = ()):
    if max_sandboxes < 1:
      raise ValueError(f"max_sandboxes={max_sandboxes}: expected >= 1")
    if not 0 <= warm <= max_sandboxes:
      raise ValueError(f"warm={warm}: expected 0..max_sandboxes={max_sandboxes}")
    self.backend, self.max_sandboxes, self.limits = backend, max_sandboxes, limits
    self.ttl, self.warm_target, self.max_timeout = ttl, warm, max_timeout
    self.backend_kw = backend_kw or {}
    if rootfs and backend != "bwrap":
      raise ValueError(f"rootfs: only the bwrap backend binds a root filesystem, not {backend}")
    if images and backend != "docker":
      raise ValueError(f"images: only the docker backend starts from images, not {backend}")
    self.images = tuple(images)
    # Each directory as its descriptor resolves it; a link anywhere on its path is refused.
    self.rootfs = {name: rootfs_dir.real_path(path) for name, path in (rootfs or {}).items()}
    self.live: dict[str, _Entry] = {}
    self.warm: list[Sandbox] = []
    self.creating = 0  # sandboxes being created (counted against capacity)
    self.loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                    name="sandbox-loop")
    self._thread.start()
    self._wake: Optional[asyncio.Event] = None  # warm pool: a slot was freed or taken
    self._stop: Optional[asyncio.Event] = None
    self._stopping = False
    self._bg = self.run(self._start_background(), timeout=10)

  def run(self, coro, timeout: Optional[float] = None):
    """Runs a coroutine on the service loop from another thread and waits for it.

    Args:
      coro: the coroutine.
      timeout: seconds to wait; None: no limit.

    Returns:
      The coroutine's result (its exception is raised here).
    """
    return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

  async def _start_background(self):
    self._wake, self._stop = asyncio.Event(), asyncio.Event()
    return [asyncio.ensure_future(self._keep_warm()), asyncio.ensure_future(self._reap())]

  def _room(self) -> int:
    return self.max_sandboxes - len(self.live) - len(self.warm) - self.creating

  async def _new(self, limits: Limits, rootfs: Optional[str] = None,
                 image: Optional[str] = None) -> Sandbox:
    """Create a sandbox in a slot the caller reserved with `self.creating += 1`."""
    kw = dict(self.backend_kw)
    if rootfs is not None:
      kw["rootfs"] = self.rootfs[rootfs]
    if image is not None:
      kw["image"] = image
    try:
      return await create_sandbox(self.backend, limits=limits, **kw)
    finally:
      self.creating -= 1

  async def _keep_warm(self) -> None:
    while not self._stopping:
      if len(self.warm) < self.warm_target and self._room() > 0:
        self.creating += 1
        try:
          sb = await self._new(self.limits)
        except Exception as e:  # keep serving; creation errors reach clients on demand
          log.warning("warm pool: %s", e)
          await asyncio.sleep(1.0)
          continue
        if self._stopping:
          await sb.close()
        else:
          self.warm.append(sb)
        continue
      self._wake.clear()
      try:
        await asyncio.wait_for(self._wake.wait(), 1.0)
      except asyncio.TimeoutError:
        pass

  async def _reap(self) -> None:
    while not self._stopping:
      try:  # not a plain sleep: shutdown must never cancel a close() half-way
        await asyncio.wait_for(self._stop.wait(), min(5.0, max(0.05, self.ttl / 10)))
      except asyncio.TimeoutError:
        pass
      now = time.monotonic()
      for sid, e in list(self.live.items()):
        if e.busy == 0 and now - e.last_used > self.ttl and not self._stopping:
          log.info("sandbox %s idle for %.0f s > ttl: closing", sid, now - e.last_used)
          await self.close(sid)

  def check_limits(self, requested: Optional[dict]) -> Limits:
    """The limits a request asks for, within the server's.

    Args:
      requested: the request's "limits" object (None: the server's limits); fields it leaves
        out take the server's.

    Returns:
      The limits.

    Raises:
      HTTPError: 400 for an unknown name, a non-positive or non-integer value, or a value over
        the server's.
    """
    if requested is None:
      return self.limits
    if not isinstance(requested, dict):
      raise HTTPError(400, "field 'limits': expected an object", "ValueError")
    names = {f.name for f in dataclasses.fields(Limits)}
    values = {}
    for k, v in requested.items():
      if k not in names:
        raise HTTPError(400, f"limits.{k}: unknown (expected {sorted(names)})", "ValueError")
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise HTTPError(400, f"limits.{k}={v!r}: expected a positive number", "ValueError")
      cap = getattr(self.limits, k)
      if isinstance(cap, int) and not isinstance(v, int):
        raise HTTPError(400, f"limits.{k}={v!r}: expected an integer", "ValueError")
      if v > cap:
        raise HTTPError(400, f"limits.{k}={v} exceeds this server's cap {k}={cap} "
                        f"(its --{k})", "ValueError")
      values[k] = type(cap)(v)
    return dataclasses.replace(self.limits, **values)

  def check_rootfs(self, name) -> Optional[str]:
    """A request's "rootfs": None or a name of the allow-list whose directory, opened again
    without following links, is still the one allowed; HTTPError 400 otherwise."""
    if name is None:
      return None
    if not isinstance(name, str) or name not in self.rootfs:
      raise HTTPError(400, f"rootfs={str(name)[:80]!r}: not one this server offers (its "
                      f"--rootfs: {sorted(self.rootfs)})", "ValueError")
    try:
      real = rootfs_dir.real_path(self.rootfs[name])
    except ValueError as e:
      raise HTTPError(400, f"rootfs={name!r}: {e}", "ValueError") from None
    if real != self.rootfs[name]:
      raise HTTPError(400, f"rootfs={name!r}: {self.rootfs[name]} now resolves to {real}",
                      "ValueError")
    return name

  def check_image(self, name) -> Optional[str]:
    """A request's "image": None or an image of the allow-list; HTTPError 400 otherwise."""
    if name is None:
      return None
    if not isinstance(name, str) or name not in self.images:
      raise HTTPError(400, f"image={str(name)[:200]!r}: not one this server offers (its "
                      f"--image: {list(self.images)})", "ValueError")
    return name

  async def create(self, limits: Limits, rootfs: Optional[str] = None,
                   image: Optional[str] = None) -> str:
    """Makes a new live sandbox, taking a warm one when the limits match.

    Args:
      limits: checked by `check_limits`.
      rootfs: a name checked by `check_rootfs` (warm sandboxes have none).
      image: an image checked by `check_image` (warm sandboxes have the default one).

    Returns:
      The sandbox's id.

    Raises:
      SandboxFull: max_sandboxes are live.
      HTTPError: 503 while the server shuts down.
    """
    if self._stopping:
      raise HTTPError(503, "server is shutting down", "SandboxError")
    default = image is None or image == self.backend_kw.get("image")
    if limits == self.limits and rootfs is None and default and self.warm:
      sb = self.warm.pop()
    else:
      await self._reserve()
      sb = await self._new(limits, rootfs, image)
    sid = secrets.token_hex(8)
    self.live[sid] = _Entry(sb, time.monotonic())
    self._wake.set()
    return sid

  async def _reserve(self) -> None:
    """Takes a slot for a new sandbox (`self.creating += 1`; the creator gives it back).

    Raises:
      SandboxFull: max_sandboxes are live and none is warm.
    """
    if self._room() > 0:
      self.creating += 1
    elif self.warm:  # a request that a warm sandbox cannot serve takes a warm one's slot
      self.creating += 1
      try:
        await self.warm.pop().close()
      except Exception as e:  # the slot is free either way
        log.warning("closing a warm sandbox: %s", e)
    else:
      raise SandboxFull(f"{self.max_sandboxes} sandboxes live (max_sandboxes)")

  async def fork(self, sid: str) -> str:
    """Makes a new live sandbox whose workspace is a copy of sandbox `sid`'s (`Sandbox.fork`).

    The fork takes a slot of max_sandboxes as a create does; meanwhile `sid` is busy (never
    reaped).

    Args:
      sid: the id of the live sandbox to fork.

    Returns:
      The fork's id.

    Raises:
      SandboxFull: max_sandboxes are live.
      HTTPError: 404 when `sid` is unknown or closed, 503 while the server shuts down.
      SandboxError: the fork failed.
    """
    if self._stopping:
      raise HTTPError(503, "server is shutting down", "SandboxError")
    e = self.entry(sid)
    await self._reserve()
    e.busy += 1
    try:
      sb = await e.sandbox.fork()
    finally:
      self.creating -= 1
      e.busy -= 1
      e.last_used = time.monotonic()
    if self._stopping:  # shutdown collected the live sandboxes meanwhile
      await sb.close()
      raise HTTPError(503, "server is shutting down", "SandboxError")
    new = secrets.token_hex(8)
    self.live[new] = _Entry(sb, time.monotonic())
    self._wake.set()
    return new

  def entry(self, sid: str) -> _Entry:
    """The live sandbox `sid`; HTTPError 404 when it is unknown or closed."""
    e = self.live.get(sid)
    if e is None:
      raise HTTPError(404, f"sandbox id={sid!r}: unknown or closed", "NotFound")
    return e

  async def use(self, sid: str, method: str, *args, **kw):
    """Calls a method of a live sandbox; meanwhile the sandbox is busy (never reaped).

    Args:
      sid: the sandbox's id.
      method: a `Sandbox` method name (exec, write_file, read_file, list_files).
      *args: its positional arguments.
      **kw: its keyword arguments.

    Returns:
      What the method returns.

    Raises:
      HTTPError: 404 when the sandbox is unknown or closed.
    """
    e = self.entry(sid)
    e.busy += 1
    e.last_used = time.monotonic()
    try:
      return await getattr(e.sandbox, method)(*args, **kw)
    finally:
      e.busy -= 1
      e.last_used = time.monotonic()

  async def close(self, sid: str) -> None:
    """Closes sandbox `sid`; HTTPError 404 when it is unknown or closed."""
    e = self.live.pop(sid, None)
    if e is None:
      raise HTTPError(404, f"sandbox id={sid!r}: unknown or closed", "NotFound")
    try:
      await e.sandbox.close()
    finally:
      self._wake.set()

  async def shutdown(self) -> None:
    """Stops the warm pool and the reaper and closes every sandbox."""
    self._stopping = True
    self._stop.set()
    self._wake.set()
    await asyncio.wait(self._bg, timeout=60)  # let a warm creation in flight finish
    sandboxes = [e.sandbox for e in self.live.values()] + self.warm
    self.live, self.warm = {}, []
    results = await asyncio.gather(*(sb.close() for sb in sandboxes), return_exceptions=True)
    for r in results:
      if isinstance(r, Exception):
        log.error("close on shutdown: %s", r)

  def stop(self) -> None:
    """Shuts down (from another thread) and stops the service loop."""
    self.run(self.shutdown(), timeout=60)
    self.loop.call_soon_threadsafe(self.loop.stop)
    self._thread.join(10)


MAX_JSON_DEPTH = 32  # request bodies are flat objects; deeper nesting is refused with 400


def parse_body(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict:
  """A request body: a JSON object nested at most `max_depth` deep ({} when empty).

  Args:
    raw: the body's bytes.
    max_depth: the deepest nesting of objects/arrays accepted.

  Returns:
    The object.

  Raises:
    HTTPError: 400 naming what is wrong (not JSON, not an object, nested too deep).
  """
  if not raw:
    return {}
  try:
    body = loads(raw, max_depth, "body")
  except TooDeep as e:
    raise HTTPError(400, str(e), "ValueError") from None
  except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an over-long integer
    raise HTTPError(400, f"body is not valid JSON: {e}", "ValueError") from None
  if not isinstance(body, dict):
    raise HTTPError(400, "body must be a JSON object", "ValueError")
  return body


class SandboxHTTP:
  """The HTTP(S) front of a `SandboxService`: Starlette under uvicorn (h11) on its own thread.

  Args:
    service: the sandboxes.
    token: the bearer token every request must carry (>= 16 characters).
    host: the bind address (a non-loopback one needs TLS).
    port: the TCP port (0: any free port).
    tls_cert: PEM certificate chain (with tls_key: HTTPS, TLS 1.2 at least).
    tls_key: PEM private key.
    max_request_bytes: larger bodies get 413.
    connections: connection caps and deadlines.

  Raises:
    ValueError: a short token, only one of tls_cert/tls_key, or a non-loopback host without TLS.
  """

  def __init__(self, service: SandboxService, token: str, host: str = "127.0.0.1",
               port: int = 0, tls_cert: Optional[str] = None, tls_key: Optional[str] = None,
               max_request_bytes: int = 16 << 20,
               connections: ConnectionLimits = ConnectionLimits()):
    if len(token) < 16:
      raise ValueError("token: expected at least 16 characters")
    if (tls_cert is None) != (tls_key is None):
      raise ValueError("tls_cert and tls_key go together")
    if tls_cert is None and not is_loopback(host):
      raise ValueError(f"host={host!r} is not loopback: exposing the sandbox server needs "
                       "--tls-cert/--tls-key (and the token)")
    self.door = Door(connections)  # ValueError for a limit that is not positive
    self.service, self.token, self.max_request_bytes = service, token.encode(), max_request_bytes
    self.limits, self.conns, self.tls = connections, self.door.conns, tls_cert is not None
    methods = ["GET", "POST", "DELETE", "PUT", "PATCH", "HEAD", "OPTIONS"]
    self.app = Starlette(routes=[Route("/{path:path}", self._handle, methods=methods)])
    self.config = uvicorn.Config(
        self.app, host=host, port=port, loop="asyncio", ws="none", lifespan="off",
        log_config=None, access_log=False, server_header=False, timeout_graceful_shutdown=10,
        **self.door.uvicorn_options())
    self.config.load()
    if tls_cert is not None:
      ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
      ctx.minimum_version = ssl.TLSVersion.TLSv1_2
      ctx.load_cert_chain(tls_cert, tls_key)
      self.config.ssl = ctx
    self.server = uvicorn.Server(self.config)
    self.port: Optional[int] = None
    self._thread: Optional[threading.Thread] = None

  async def _serve(self) -> None:
    await self.door.serve(self.server, self.tls)

  def start(self) -> int:
    """Serves from a daemon thread with its own event loop.

    Returns:
      The bound port.

    Raises:
      RuntimeError: the server did not start within 30 s (e.g. the port is taken).
    """
    self._thread, self.port = serve_in_thread(
        self._serve, self.server, f"sandbox server on {self.config.host}:{self.config.port}",
        "sandbox-http", 30)
    return self.port

  def stop_accepting(self) -> None:
    """Closes the listener; requests in flight finish (or are cut after 10 s)."""
    self.server.should_exit = True

  def join(self, timeout: float = 30.0) -> None:
    """Waits for the serving thread to end (after `stop_accepting`)."""
    if self._thread is not None:
      self._thread.join(timeout)

  # --- requests
  def _authorized(self, request: Request) -> bool:
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    return scheme == "Bearer" and hmac.compare_digest(value.strip().encode(), self.token)

  async def _body(self, request: Request) -> dict:
    if request.method in ("GET", "DELETE"):
      return {}
    try:
      raw = await self.door.read_body(request, self.max_request_bytes, "max_request_bytes")
    except RequestError as e:
      raise HTTPError(e.status, str(e), "ValueError") from None
    return parse_body(raw)

  async def _call(self, coro):
    """Runs a service coroutine on the service's loop (sandbox work never blocks this one)."""
    return await asyncio.wrap_future(
        asyncio.run_coroutine_threadsafe(coro, self.service.loop))

  async def _handle(self, request: Request) -> Response:
    close = False
    try:
      if not self._authorized(request):
        close = True  # never read an unauthenticated body
        raise HTTPError(401, "missing or wrong token (Authorization: Bearer ...)", "AuthError")
      self.door.authenticated(request)
      if request.method not in ("GET", "POST", "DELETE"):
        close = True
        raise HTTPError(405, f"method {request.method} not allowed", "HTTPError")
      body = await self._body(request)
      status, reply = 200, await self._route(request, body)
    except HTTPError as e:
      close = close or e.status in (408, 413)
      status, reply = e.status, {"error": str(e), "type": e.type}
    except SandboxFull as e:
      status, reply = 429, {"error": str(e), "type": "SandboxFull"}
    except PathError as e:
      status, reply = 400, {"error": str(e), "type": "PathError"}
    except FileNotFoundError as e:
      status, reply = 404, {"error": str(e), "type": "FileNotFoundError"}
    except RecursionError:  # a listing deeper than the interpreter's stack
      status, reply = 400, {"error": "directory tree too deep to list", "type": "ValueError"}
    except (ValueError, TypeError) as e:
      status, reply = 400, {"error": str(e), "type": "ValueError"}
    except SandboxError as e:
      status, reply = 500, {"error": str(e), "type": "SandboxError"}
    except OSError as e:  # e.g. ENOSPC when the workspace quota is full
      status, reply = 400, {"error": str(e), "type": "OSError", "errno": e.errno}
    except Exception as e:
      log.exception("internal error on %s %s", request.method, request.url.path)
      status, reply = 500, {"error": f"internal error: {type(e).__name__}",
                            "type": "SandboxError"}
    return JSONResponse(reply, status_code=status,
                        headers={"Connection": "close"} if close else None)

  async def _route(self, request: Request, body: dict) -> dict:
    svc, method = self.service, request.method
    path = request.url.path
    parts = [p for p in path.split("/") if p]
    if method == "GET" and parts == ["health"]:
      return {"ok": True, "backend": svc.backend, "live": len(svc.live), "warm": len(svc.warm),
              "max_sandboxes": svc.max_sandboxes}
    if method == "POST" and parts == ["sandboxes"]:
      limits = svc.check_limits(body.get("limits"))
      rootfs = svc.check_rootfs(body.get("rootfs"))
      image = svc.check_image(body.get("image"))
      sid = await self._call(svc.create(limits, rootfs, image))
      return {"id": sid, "limits": dataclasses.asdict(limits),
              "workspace": svc.live[sid].sandbox.workspace_path}
    if len(parts) == 2 and parts[0] == "sandboxes" and method == "DELETE":
      await self._call(svc.close(parts[1]))
      return {}
    if len(parts) != 3 or parts[0] != "sandboxes" or method != "POST":
      raise HTTPError(404, f"no route {method} {path[:100]!r}", "NotFound")
    sid, op = parts[1], parts[2]
    if op == "fork":
      new = await self._call(svc.fork(sid))
      sb = svc.live[new].sandbox
      return {"id": new, "limits": dataclasses.asdict(sb.limits), "workspace": sb.workspace_path}
    if op == "exec":
      timeout = _field(body, "timeout", (int, float), None)
      if timeout is not None and not 0 < timeout <= svc.max_timeout:
        raise HTTPError(400, f"timeout={timeout}: expected (0, max_timeout={svc.max_timeout}]",
                        "ValueError")
      env = _field(body, "env", dict, None)
      stdin = _field(body, "stdin", str, None)
      if "stdin_b64" in body:
        stdin = _b64(_field(body, "stdin_b64", str), "stdin_b64")
      result = await self._call(svc.use(sid, "exec", _command(body), timeout=timeout,
                                        stdin=stdin, env=env))
      return result.to_dict()
    if op == "write":
      data = _b64(_field(body, "content_b64", str), "content_b64")
      await self._call(svc.use(sid, "write_file", _field(body, "path", str), data))
      return {}
    if op == "read":
      data = await self._call(svc.use(sid, "read_file", _field(body, "path", str)))
      return {"content_b64": base64.b64encode(data).decode()}
    if op == "list":
      return {"files": await self._call(svc.use(sid, "list_files",
                                                _field(body, "path", str, ".")))}
    raise HTTPError(404, f"no operation {op!r}", "NotFound")


def reclaim_bwrap(uids) -> list[int]:
  """Cleans what a crashed holder of a pool uid left behind: its processes, tmpfs mounts (with
  workspace data), cgroups and lock. Uids other live processes hold are left alone.

  Args:
    uids: the bwrap uid pool.

  Returns:
    The uids that had leftovers.
  """
  pool = bwrap._pool(uids, bwrap.DEFAULT_ROOT)
  taken, stale_uids = [], []
  try:
    while True:
      try:
        uid, stale = pool.acquire()
      except SandboxFull:  # every free uid is taken now; the rest are live elsewhere
        break
      taken.append(uid)
      if not stale:
        continue
      stale_uids.append(uid)
      bwrap.BwrapSandbox._sweep(uid, os.path.join(bwrap.DEFAULT_ROOT, str(uid)))
      # under this service's cgroup, or at the top where a server before nesting put them
      for parent in (None, cgroups.SANDBOXES):
        group = cgroups.Cgroup.existing(str(uid), parent)
        if group is not None:
          group.kill()
          group.remove()
  finally:
    for uid in taken:
      pool.release(uid)  # marked clean
  return stale_uids
