"""The front door of Arbor's HTTP servers (the sandbox server, the policy server): uvicorn's h11
protocol with deadlines and a connection cap that idle or slow clients cannot exhaust.

uvicorn gives h11 parsing with a header size cap, `timeout_keep_alive` between requests, and
503 beyond `limit_concurrency`. It has no deadline for a connection's first request, none for a
request's headers once bytes started coming, and it 503s a real client while idle sockets hold
every slot. A `Door` adds:

  - every request's line and headers must be complete `header_s` after the connection opened
    or after the previous response ended, else the connection is closed;
  - a request's body must arrive within `body_s` of its headers (`Door.read_body`: 408), and
    within `max_bytes` (413), counted as it arrives (chunked bodies too);
  - beyond `max_connections` open connections the oldest idle one is closed, those that never
    carried a valid credential first (the server calls `Door.authenticated` once a request's
    token checks out), so a flood of silent sockets cannot lock out a real client;
  - the TLS handshake must finish within `handshake_s` (`Door.serve`).

    door = Door(ConnectionLimits(max_connections=256))
    server = uvicorn.Server(uvicorn.Config(app, host=..., port=..., **door.uvicorn_options()))
    await door.serve(server, tls=False)       # in the serving thread's event loop
    ...
    door.authenticated(request)              # in the app, after the token check
    raw = await door.read_body(request, max_bytes=16 << 20)
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools

from starlette.requests import Request
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclasses.dataclass(frozen=True)
class ConnectionLimits:
  """What one client may hold of an HTTP front (each field's meaning beside it)."""
  max_connections: int = 256       # open connections; a new one beyond evicts an idle one
  handshake_s: float = 10.0        # TLS handshake must finish within this
  header_s: float = 10.0           # a request's line + headers must arrive within this
  body_s: float = 30.0             # a request's body must arrive within this once headers did
  keep_alive_s: int = 5            # an idle keep-alive connection closes after this
  max_header_bytes: int = 16 << 10  # request line + headers

  def check(self) -> None:
    """Raises ValueError naming the first field that is not positive."""
    for f in dataclasses.fields(self):
      if not getattr(self, f.name) > 0:
        raise ValueError(f"{f.name}={getattr(self, f.name)}: expected > 0")


class RequestError(Exception):
  """A request the door refuses: `status` (400, 408, 413) and a message naming the limit."""

  def __init__(self, status: int, message: str):
    super().__init__(message)
    self.status = status


class Connections:
  """The open connections of one server, oldest first, and which ever carried a valid token."""

  def __init__(self):
    self.open: dict = {}            # protocol -> None, in connection order
    self.by_peer: dict = {}         # (host, port) -> protocol: the app's scope names the peer
    self.authenticated: set = set()  # protocols that carried a valid token
    self.evicted = 0


class DoorProtocol(H11Protocol):
  """uvicorn's h11 protocol with the header deadline and the connection cap (module docstring).

  A subclass bound to one server's `Connections` and `ConnectionLimits` is what uvicorn is
  given (`Door.protocol`).
  """

  conns: Connections
  limits: ConnectionLimits

  def connection_made(self, transport) -> None:
    super().connection_made(transport)
    conns = self.conns
    conns.open[self] = None
    if self.client:
      conns.by_peer[tuple(self.client)] = self
    self._arm_header_deadline()
    while len(conns.open) > self.limits.max_connections:
      victim = self._victim()
      if victim is None:  # every other one has a request in flight: refuse the newcomer
        victim = self
      conns.evicted += 1
      victim.transport.close()
      victim._forget()
      if victim is self:
        return

  def _victim(self):
    idle = [p for p in self.conns.open if p is not self
            and (p.cycle is None or p.cycle.response_complete)]
    fresh = [p for p in idle if p not in self.conns.authenticated]
    return (fresh or idle or [None])[0]

  def _forget(self) -> None:
    self.conns.open.pop(self, None)
    self.conns.authenticated.discard(self)
    if self.client and self.conns.by_peer.get(tuple(self.client)) is self:
      del self.conns.by_peer[tuple(self.client)]

  def connection_lost(self, exc) -> None:
    self._forget()
    super().connection_lost(exc)

  def _arm_header_deadline(self) -> None:
    scope = self.scope  # a new request replaces it; the same one at expiry means none came
    def expire():
      if self.scope is scope and not self.transport.is_closing():
        self.transport.close()
    self.loop.call_later(self.limits.header_s, expire)

  def on_response_complete(self) -> None:
    super().on_response_complete()
    if not self.transport.is_closing():
      self._arm_header_deadline()


class Door:
  """The front door of one server: its connections, limits and the protocol uvicorn runs.

  Args:
    limits: connection caps and deadlines.

  Raises:
    ValueError: a limit that is not positive.
  """

  def __init__(self, limits: ConnectionLimits = ConnectionLimits()):
    limits.check()
    self.limits, self.conns = limits, Connections()
    self.protocol = type("BoundDoorProtocol", (DoorProtocol,),
                         {"conns": self.conns, "limits": limits})

  def uvicorn_options(self) -> dict:
    """The `uvicorn.Config` arguments that put this door in front of an app."""
    return {"http": self.protocol,
            # a backstop only: the protocol keeps the connections at max_connections
            "limit_concurrency": self.limits.max_connections + 1,
            "timeout_keep_alive": self.limits.keep_alive_s,
            "h11_max_incomplete_event_size": self.limits.max_header_bytes}

  async def serve(self, server, tls: bool) -> None:
    """Runs a uvicorn Server built with `uvicorn_options` (with `tls`, under the handshake
    deadline: uvicorn passes none, and asyncio's default is 60 s)."""
    if tls:
      loop = asyncio.get_running_loop()
      loop.create_server = functools.partial(loop.create_server,
                                             ssl_handshake_timeout=self.limits.handshake_s)
    await server.serve()

  def authenticated(self, request: Request) -> None:
    """Marks the request's connection as one that carried a valid credential (evicted last)."""
    if request.client is not None:
      proto = self.conns.by_peer.get((request.client.host, request.client.port))
      if proto is not None:
        self.conns.authenticated.add(proto)

  async def read_body(self, request: Request, max_bytes: int,
                      limit_name: str = "max_request_bytes") -> bytes:
    """A request's body, counted as it arrives and due within `body_s`.

    Args:
      request: the request.
      max_bytes: the largest body accepted.
      limit_name: the server's name for `max_bytes`, for the 413's message.

    Returns:
      The body's bytes.

    Raises:
      RequestError: 400 for a Content-Length that is not an integer, 413 for a body over
        `max_bytes` (declared or counted), 408 when it is not in within `body_s`.
    """
    too_large = RequestError(413, f"bodies are limited to {max_bytes} bytes ({limit_name})")
    declared = request.headers.get("content-length")
    if declared is not None:
      if not declared.isdigit():
        raise RequestError(400, f"Content-Length={declared[:40]!r}: not an integer")
      if int(declared) > max_bytes:
        raise too_large
    parts, size = [], 0

    async def read():
      nonlocal size
      async for part in request.stream():  # chunked bodies are counted as they arrive
        size += len(part)
        if size > 2 * max_bytes:
          raise too_large
        if size <= max_bytes:
          parts.append(part)
      # A body up to twice the cap is read to its end and dropped, so a client still sending
      # gets the 413 rather than a reset of the connection closed under its unread bytes.
      if size > max_bytes:
        raise too_large
    try:
      await asyncio.wait_for(read(), self.limits.body_s)
    except asyncio.TimeoutError:
      raise RequestError(408, f"body not received within body_timeout={self.limits.body_s} s"
                         ) from None
    return b"".join(parts)
