"""Sandbox server: sandboxes of one backend behind a small authenticated HTTP/JSON API.

    python -m envs.sandbox_server --host 127.0.0.1 --port 8910 --backend bwrap \\
        --max_sandboxes 64 --token-file /etc/arbor/sandbox.token [--tls-cert C --tls-key K]

Every request carries `Authorization: Bearer <token>` (compared in constant time) or gets 401.
Routes (JSON bodies; bytes as base64):

  GET    /health                    {"ok", "backend", "live", "warm", "max_sandboxes"}
  POST   /sandboxes                 {"limits": {...}?}        -> {"id", "limits"}  (429 if full)
  POST   /sandboxes/ID/exec         {"cmd", "timeout"?, "stdin"? | "stdin_b64"?, "env"?}
                                                              -> ExecResult fields
  POST   /sandboxes/ID/write        {"path", "content_b64"}   -> {}
  POST   /sandboxes/ID/read         {"path"}                  -> {"content_b64"}
  POST   /sandboxes/ID/list         {"path"?}                 -> {"files"}
  DELETE /sandboxes/ID                                        -> {}

Errors are `{"error": message, "type": name}` with 400 (bad input, PathError), 401, 404
(unknown sandbox or file), 405, 411, 413 (body over --max_request_bytes), 429 (capacity),
500 (sandbox failure). Requested limits may not exceed the server's (its flags). A sandbox
untouched for --ttl seconds is closed. A warm pool of --warm sandboxes with the server's limits
is kept ahead of demand (warm + live <= --max_sandboxes). SIGTERM/SIGINT: stop accepting, close
every sandbox, exit. Binding a non-loopback address requires TLS. Stdlib only; no pickle.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import dataclasses
import hmac
import http.server
import json
import logging
import os
import secrets
import signal
import ssl
import sys
import threading
import time
from typing import Optional

from envs.net import is_loopback, read_secret
from envs.sandbox import create_sandbox
from envs.sandbox.base import Limits, PathError, Sandbox, SandboxError, SandboxFull

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

  Raises:
    ValueError: max_sandboxes < 1, or warm outside 0..max_sandboxes.
  """

  def __init__(self, backend: str, *, max_sandboxes: int, limits: Limits, ttl: float = 3600.0,
               warm: int = 0, max_timeout: float = 600.0, backend_kw: Optional[dict] = None):
    if max_sandboxes < 1:
      raise ValueError(f"max_sandboxes={max_sandboxes}: expected >= 1")
    if not 0 <= warm <= max_sandboxes:
      raise ValueError(f"warm={warm}: expected 0..max_sandboxes={max_sandboxes}")
    self.backend, self.max_sandboxes, self.limits = backend, max_sandboxes, limits
    self.ttl, self.warm_target, self.max_timeout = ttl, warm, max_timeout
    self.backend_kw = backend_kw or {}
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

  async def _new(self, limits: Limits) -> Sandbox:
    """Create a sandbox in a slot the caller reserved with `self.creating += 1`."""
    try:
      return await create_sandbox(self.backend, limits=limits, **self.backend_kw)
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
      requested: the request's "limits" object (None: the server's limits).

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
        raise HTTPError(400, f"limits.{k}={v} exceeds this server's {cap}", "ValueError")
      values[k] = type(cap)(v)
    return dataclasses.replace(self.limits, **values)

  async def create(self, limits: Limits) -> str:
    """Makes a new live sandbox, taking a warm one when the limits match.

    Args:
      limits: checked by `check_limits`.

    Returns:
      The sandbox's id.

    Raises:
      SandboxFull: max_sandboxes are live.
      HTTPError: 503 while the server shuts down.
    """
    if self._stopping:
      raise HTTPError(503, "server is shutting down", "SandboxError")
    if limits == self.limits and self.warm:
      sb = self.warm.pop()
    elif self._room() > 0:
      self.creating += 1
      sb = await self._new(limits)
    elif self.warm:  # other limits than the warm ones: give a warm slot to this request
      self.creating += 1
      try:
        await self.warm.pop().close()
      except Exception as e:  # the slot is free either way
        log.warning("closing a warm sandbox: %s", e)
      sb = await self._new(limits)
    else:
      raise SandboxFull(f"{self.max_sandboxes} sandboxes live (max_sandboxes)")
    sid = secrets.token_hex(8)
    self.live[sid] = _Entry(sb, time.monotonic())
    self._wake.set()
    return sid

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


class Handler(http.server.BaseHTTPRequestHandler):
  """The HTTP routes of the module docstring (bound to a service and token by `make_server`)."""
  server_version = "arbor-sandbox/1"
  timeout = 60  # seconds of socket inactivity while reading a request (slow clients)

  # set on the subclass made by make_server
  service: SandboxService
  token: bytes
  max_request_bytes: int

  def setup(self):
    super().setup()
    if isinstance(self.request, ssl.SSLSocket):
      self.request.do_handshake()  # here, on this connection's thread, not in accept()

  def log_message(self, fmt, *args):
    log.debug("%s " + fmt, self.address_string(), *args)

  def _reply(self, status: int, obj: dict) -> None:
    data = json.dumps(obj).encode()
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  def _authorized(self) -> bool:
    got = self.headers.get("Authorization", "")
    scheme, _, value = got.partition(" ")
    return scheme == "Bearer" and hmac.compare_digest(value.strip().encode(), self.token)

  def _body(self) -> dict:
    if self.command == "GET" or self.command == "DELETE":
      return {}
    length = self.headers.get("Content-Length")
    if length is None:
      raise HTTPError(411, "Content-Length required", "ValueError")
    try:
      n = int(length)
    except ValueError:
      raise HTTPError(400, f"Content-Length={length!r}: not an integer", "ValueError")
    if n < 0 or n > self.max_request_bytes:
      raise HTTPError(413, f"body of {n} bytes > max_request_bytes={self.max_request_bytes}",
                      "ValueError")
    raw = self.rfile.read(n)
    try:
      body = json.loads(raw) if raw else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise HTTPError(400, f"body is not valid JSON: {e}", "ValueError")
    if not isinstance(body, dict):
      raise HTTPError(400, "body must be a JSON object", "ValueError")
    return body

  def _handle(self) -> None:
    try:
      if not self._authorized():
        self.close_connection = True  # never read an unauthenticated body
        raise HTTPError(401, "missing or wrong token (Authorization: Bearer ...)", "AuthError")
      body = self._body()
      self._reply(200, self._route(body))
    except HTTPError as e:
      self.close_connection = self.close_connection or e.status in (411, 413)
      self._reply(e.status, {"error": str(e), "type": e.type})
    except SandboxFull as e:
      self._reply(429, {"error": str(e), "type": "SandboxFull"})
    except PathError as e:
      self._reply(400, {"error": str(e), "type": "PathError"})
    except FileNotFoundError as e:
      self._reply(404, {"error": str(e), "type": "FileNotFoundError"})
    except (ValueError, TypeError) as e:
      self._reply(400, {"error": str(e), "type": "ValueError"})
    except SandboxError as e:
      self._reply(500, {"error": str(e), "type": "SandboxError"})
    except OSError as e:  # e.g. ENOSPC when the workspace quota is full
      self._reply(400, {"error": str(e), "type": "OSError", "errno": e.errno})
    except Exception as e:
      log.exception("internal error on %s %s", self.command, self.path)
      self._reply(500, {"error": f"internal error: {type(e).__name__}", "type": "SandboxError"})

  do_GET = do_POST = do_DELETE = _handle

  def do_PUT(self):
    self.close_connection = True
    self._reply(405, {"error": f"method {self.command} not allowed", "type": "HTTPError"})

  do_PATCH = do_HEAD = do_PUT

  def _route(self, body: dict) -> dict:
    svc, parts = self.service, [p for p in self.path.split("?")[0].split("/") if p]
    if self.command == "GET" and parts == ["health"]:
      return {"ok": True, "backend": svc.backend, "live": len(svc.live), "warm": len(svc.warm),
              "max_sandboxes": svc.max_sandboxes}
    if self.command == "POST" and parts == ["sandboxes"]:
      limits = svc.check_limits(body.get("limits"))
      sid = svc.run(svc.create(limits))
      return {"id": sid, "limits": dataclasses.asdict(limits)}
    if len(parts) == 2 and parts[0] == "sandboxes" and self.command == "DELETE":
      svc.run(svc.close(parts[1]))
      return {}
    if len(parts) != 3 or parts[0] != "sandboxes" or self.command != "POST":
      raise HTTPError(404, f"no route {self.command} {self.path[:100]!r}", "NotFound")
    sid, op = parts[1], parts[2]
    if op == "exec":
      timeout = _field(body, "timeout", (int, float), None)
      if timeout is not None and not 0 < timeout <= svc.max_timeout:
        raise HTTPError(400, f"timeout={timeout}: expected (0, max_timeout={svc.max_timeout}]",
                        "ValueError")
      env = _field(body, "env", dict, None)
      stdin = _field(body, "stdin", str, None)
      if "stdin_b64" in body:
        stdin = _b64(_field(body, "stdin_b64", str), "stdin_b64")
      result = svc.run(svc.use(sid, "exec", _field(body, "cmd", str), timeout=timeout,
                               stdin=stdin, env=env))
      return result.to_dict()
    if op == "write":
      data = _b64(_field(body, "content_b64", str), "content_b64")
      svc.run(svc.use(sid, "write_file", _field(body, "path", str), data))
      return {}
    if op == "read":
      data = svc.run(svc.use(sid, "read_file", _field(body, "path", str)))
      return {"content_b64": base64.b64encode(data).decode()}
    if op == "list":
      return {"files": svc.run(svc.use(sid, "list_files", _field(body, "path", str, ".")))}
    raise HTTPError(404, f"no operation {op!r}", "NotFound")


class _Server(http.server.ThreadingHTTPServer):
  daemon_threads = True
  ssl_context: Optional[ssl.SSLContext] = None

  def handle_error(self, request, client_address):  # e.g. a failed TLS handshake
    log.warning("connection from %s failed: %s", client_address[0],
                sys.exc_info()[1] or "unknown error")

  def get_request(self):
    sock, addr = super().get_request()
    if self.ssl_context is not None:  # handshake later, in the connection's thread
      sock = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
    return sock, addr


def make_server(service: SandboxService, token: str, host: str = "127.0.0.1", port: int = 0,
                tls_cert: Optional[str] = None, tls_key: Optional[str] = None,
                max_request_bytes: int = 16 << 20) -> _Server:
  """An HTTP(S) server for `service` (not yet serving: call serve_forever()).

  Args:
    service: the sandboxes.
    token: the bearer token every request must carry (>= 16 characters).
    host: the bind address (a non-loopback one needs TLS).
    port: the TCP port (0: any free port).
    tls_cert: PEM certificate chain (with tls_key: HTTPS).
    tls_key: PEM private key.
    max_request_bytes: larger bodies get 413.

  Returns:
    The server.

  Raises:
    ValueError: a short token, only one of tls_cert/tls_key, or a non-loopback host without TLS.
  """
  if len(token) < 16:
    raise ValueError("token: expected at least 16 characters")
  if (tls_cert is None) != (tls_key is None):
    raise ValueError("tls_cert and tls_key go together")
  if tls_cert is None and not is_loopback(host):
    raise ValueError(f"host={host!r} is not loopback: exposing the sandbox server needs "
                     "--tls-cert/--tls-key (and the token)")
  handler = type("BoundHandler", (Handler,), {
      "service": service, "token": token.encode(), "max_request_bytes": max_request_bytes})
  server = _Server((host, port), handler)
  if tls_cert is not None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(tls_cert, tls_key)
    server.ssl_context = ctx
  return server


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
  d = Limits()
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--host", default="127.0.0.1", help="bind address (non-loopback needs TLS)")
  p.add_argument("--port", type=int, default=8910, help="TCP port (0: any free port)")
  p.add_argument("--backend", default="bwrap", choices=("bwrap", "docker", "local"))
  p.add_argument("--allow_unsafe_local", action="store_true", help="allow --backend local")
  p.add_argument("--max_sandboxes", type=int, default=32, help="live + warm sandboxes at most")
  p.add_argument("--warm", type=int, default=0, help="sandboxes pre-created ahead of demand")
  p.add_argument("--ttl", type=float, default=3600.0, help="close a sandbox idle this many s")
  p.add_argument("--token-file", "--token_file", dest="token_file", required=True,
                 help="file holding the shared bearer token (>= 16 characters)")
  p.add_argument("--tls-cert", "--tls_cert", dest="tls_cert", help="PEM certificate chain")
  p.add_argument("--tls-key", "--tls_key", dest="tls_key", help="PEM private key")
  p.add_argument("--max_request_bytes", type=int, default=16 << 20, help="413 above this")
  p.add_argument("--max_timeout", type=float, default=600.0, help="largest exec timeout, s")
  p.add_argument("--port_file", help="write the bound port here once listening")
  p.add_argument("--uid_base", type=int, default=2_000_000_000, help="bwrap: first pool uid")
  p.add_argument("--uid_count", type=int, default=256, help="bwrap: number of pool uids")
  for f in dataclasses.fields(Limits):
    p.add_argument(f"--{f.name}", type=type(getattr(d, f.name)), default=getattr(d, f.name),
                   help=f"largest (and default) per-sandbox {f.name}")
  a = p.parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
  limits = Limits(**{f.name: getattr(a, f.name) for f in dataclasses.fields(Limits)})
  backend_kw = {"local": {"allow_unsafe": True}, "docker": {},
                "bwrap": {"uids": range(a.uid_base, a.uid_base + a.uid_count)}}[a.backend]
  if a.backend == "local" and not a.allow_unsafe_local:
    p.error("--backend local runs code without isolation: add --allow_unsafe_local")
  try:
    token = read_token(a.token_file)
  except (OSError, ValueError) as e:
    p.error(str(e))
  if a.tls_cert is None and not is_loopback(a.host):
    p.error(f"--host {a.host} is not loopback: exposing the sandbox server needs --tls-cert "
            "and --tls-key (and the token)")
  service = SandboxService(a.backend, max_sandboxes=a.max_sandboxes, limits=limits, ttl=a.ttl,
                           warm=a.warm, max_timeout=a.max_timeout, backend_kw=backend_kw)
  try:
    server = make_server(service, token, a.host, a.port, a.tls_cert, a.tls_key,
                         a.max_request_bytes)
  except Exception:
    service.stop()
    raise

  def on_signal(signum, _frame):
    log.info("signal %d: shutting down", signum)
    threading.Thread(target=server.shutdown, daemon=True).start()

  signal.signal(signal.SIGTERM, on_signal)
  signal.signal(signal.SIGINT, on_signal)
  port = server.server_address[1]
  if a.port_file:
    with open(a.port_file + ".tmp", "w") as f:
      f.write(str(port))
    os.replace(a.port_file + ".tmp", a.port_file)
  log.info("serving %s sandboxes on %s://%s:%d", a.backend, "https" if a.tls_cert else "http",
           a.host, port)
  try:
    server.serve_forever(poll_interval=0.2)
  finally:
    server.server_close()
    service.stop()
    log.info("stopped; every sandbox closed")


if __name__ == "__main__":
  main()
