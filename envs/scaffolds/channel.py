"""The per-episode channel from a sandboxed scaffold to the policy gateway.

    async with Channel("http://127.0.0.1:8000", session_id="ep-1", token=token) as ch:
      sb = await create_sandbox("bwrap", rootfs=root, **ch.sandbox_kwargs("bwrap"))
      await sb.exec(["/bin/sh", "-c", ch.relay_command(4000) + " && scaffold ..."])

A sandbox has no network. The host side of the channel is a UNIX socket in a fresh host
directory that is bound read-only into the sandbox at SANDBOX_DIR (bwrap `ro_binds`, Docker
`binds`; connecting to a socket needs no write access to its mount), beside `relay.py`, the
in-sandbox end: a stdlib script the sandbox's python3 runs in the background before the
scaffold, listening on 127.0.0.1:PORT and relaying each TCP connection to the socket, since
the CLIs want a TCP base URL.

Each connection carries one HTTP/1.1 request (the forwarded request says `Connection: close`,
so the reply ends the connection and a client opens a new one for its next call). The host
reads the request head (at most MAX_HEAD_BYTES) and body (Content-Length or chunked, at most
`max_request_bytes`), and forwards it to the gateway:
- only model calls pass: POST to [/v1]/chat/completions, /completions, /responses, /messages,
  /messages/count_tokens, and GET of [/v1]/models[/ID]; anything else (the gateway's session
  logs above all) is answered 403 here;
- the episode's session is forced: `x-session-id` is set to the channel's id, overwriting any
  the scaffold sends, and a JSON body's `session_id` field (which the gateway prefers to the
  header) is overwritten too; a compressed body (Content-Encoding), which could hide one, is
  refused with 415;
- the scaffold's credentials (Authorization, x-api-key, Proxy-Authorization, Cookie) are
  dropped and the gateway's token is sent as `Authorization: Bearer`, so the sandbox never
  holds the real token;
- the reply is relayed as the gateway sends it, chunk by chunk with no buffering (SSE streams
  arrive as they are produced).
At most `max_connections` requests are in flight (more are answered 503), and a request whose
client sends nothing for `idle_timeout` seconds is dropped. `close()` (the end of the
episode) stops the server, cuts open connections and removes the directory.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import re
import secrets
import shutil
import ssl
import tempfile
import urllib.parse
from typing import Optional

log = logging.getLogger(__name__)

SANDBOX_DIR = "/run/arbor-channel"
MAX_HEAD_BYTES = 64 * 1024
MAX_REQUEST_BYTES = 32 << 20
MAX_CONNECTIONS = 16
IDLE_TIMEOUT = 600.0
MAX_LOGGED = 10000        # entries of `Channel.requests` kept
CHUNK = 65536
DISCARD_BYTES = 1 << 20   # input read and dropped after a refusal, so the client gets it
DISCARD_SECONDS = 2.0
_POST = re.compile(r"^(?:/v1)?/(?:chat/completions|completions|responses|messages"
                   r"(?:/count_tokens)?)$")
_GET = re.compile(r"^(?:/v1)?/models(?:/[A-Za-z0-9._:@-]+)?$")
# Request headers never forwarded: hop-by-hop ones, the scaffold's credentials and session,
# and those the channel sets itself.
_DROP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authorization", "te",
                   "trailer", "transfer-encoding", "upgrade", "host", "content-length",
                   "authorization", "x-api-key", "x-session-id", "cookie", "expect"})
_SESSION = re.compile(r"^[^/\x00-\x1f]{1,128}$")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


class ChannelError(ValueError):
  """A malformed request: answered with `status` and `message`."""

  def __init__(self, status: int, message: str):
    super().__init__(message)
    self.status, self.message = status, message


class Channel:
  """One episode's channel (see the module docstring). Use as `async with`.

  Args:
    gateway_url: "http(s)://HOST:PORT[/PREFIX]": the gateway's root; a request's path is
      appended to PREFIX.
    session_id: the episode's session (1-128 characters, no '/').
    token: the gateway's bearer token, or None for a gateway without one.
    max_connections: requests in flight at once.
    max_request_bytes: largest request body.
    idle_timeout: seconds a client may stay silent while sending its request, and the gateway
      while replying.
    root_dir: where the channel's host directory is made (default: the system's temporary
      directory); every directory on the way must be searchable by the sandbox's uid.
    cafile: CA bundle for an https gateway (default: the system's).

  Attributes:
    host_dir: the host directory bound at SANDBOX_DIR (after `start`).
    socket_name: the socket's name in it (random: the directory cannot be listed).
    requests: (method, path, status) of the last MAX_LOGGED requests, in order (status 0: the
      connection ended before a reply).

  Raises:
    ValueError: naming a bad gateway_url, session_id or limit.
  """

  def __init__(self, gateway_url: str, session_id: str, token: Optional[str] = None, *,
               max_connections: int = MAX_CONNECTIONS,
               max_request_bytes: int = MAX_REQUEST_BYTES, idle_timeout: float = IDLE_TIMEOUT,
               root_dir: Optional[str] = None, cafile: Optional[str] = None):
    url = urllib.parse.urlsplit(gateway_url)
    if url.scheme not in ("http", "https") or not url.hostname or url.query or url.fragment:
      raise ValueError(f"gateway_url={gateway_url!r}: expected http(s)://HOST:PORT[/PREFIX]")
    if not isinstance(session_id, str) or not _SESSION.match(session_id):
      raise ValueError(f"session_id={session_id!r}: expected 1-128 characters, no '/' or "
                       "control characters")
    if token is not None and (not token or any(c in token for c in "\r\n")):
      raise ValueError("token: expected a non-empty single-line string")
    for name, value in (("max_connections", max_connections),
                        ("max_request_bytes", max_request_bytes), ("idle_timeout", idle_timeout)):
      if not value > 0:
        raise ValueError(f"{name}={value!r}: expected > 0")
    self.session_id, self._token = session_id, token
    self._host, self._tls = url.hostname, url.scheme == "https"
    self._port = url.port or (443 if self._tls else 80)
    self._netloc, self._prefix = url.netloc, url.path.rstrip("/")
    self._cafile = cafile
    self.max_connections, self.max_request_bytes = max_connections, max_request_bytes
    self.idle_timeout = idle_timeout
    self._root_dir = root_dir
    self.host_dir: Optional[str] = None
    self.socket_name = f"gateway-{secrets.token_hex(8)}.sock"
    self.requests: collections.deque = collections.deque(maxlen=MAX_LOGGED)
    self._server: Optional[asyncio.base_events.Server] = None
    self._active = 0
    self._tasks: set[asyncio.Task] = set()

  # ------------------------------------------------------------------ lifetime

  async def start(self) -> "Channel":
    """Makes the host directory (mode 0711: enterable, not listable), writes relay.py and
    binds the socket (mode 0666: the sandbox's uid connects). Returns self."""
    self.host_dir = tempfile.mkdtemp(prefix="arbor-channel-", dir=self._root_dir)
    os.chmod(self.host_dir, 0o711)
    os.makedirs(os.path.join(self.host_dir, "home"), mode=0o755)
    os.chmod(os.path.join(self.host_dir, "home"), 0o755)
    relay = os.path.join(os.path.dirname(os.path.abspath(__file__)), "relay.py")
    shutil.copyfile(relay, os.path.join(self.host_dir, "relay.py"))
    os.chmod(os.path.join(self.host_dir, "relay.py"), 0o644)
    path = os.path.join(self.host_dir, self.socket_name)
    self._server = await asyncio.start_unix_server(self._handle, path, limit=MAX_HEAD_BYTES)
    os.chmod(path, 0o666)
    return self

  async def close(self) -> None:
    """Stops the server, cuts open connections and removes the directory. Idempotent."""
    if self._server is not None:
      self._server.close()
      self._server = None
    for task in list(self._tasks):
      task.cancel()
    if self._tasks:
      await asyncio.gather(*self._tasks, return_exceptions=True)
    if self.host_dir is not None:
      shutil.rmtree(self.host_dir, ignore_errors=True)
      self.host_dir = None

  async def __aenter__(self) -> "Channel":
    return await self.start()

  async def __aexit__(self, *exc) -> None:
    await self.close()

  # ------------------------------------------------------------------ sandbox side

  def sandbox_kwargs(self, backend: str) -> dict:
    """`create_sandbox` arguments binding the channel's directory at SANDBOX_DIR.

    Raises:
      ValueError: a backend other than "bwrap" or "docker" (remote and local sandboxes cannot
        take a host bind).
    """
    if self.host_dir is None:
      raise ValueError("Channel.sandbox_kwargs: start the channel first")
    if backend == "bwrap":
      return {"ro_binds": [(self.host_dir, SANDBOX_DIR)]}
    if backend == "docker":
      return {"binds": [(self.host_dir, SANDBOX_DIR)]}
    raise ValueError(f"backend={backend!r}: a channel binds into 'bwrap' or 'docker' sandboxes")

  @property
  def sandbox_socket(self) -> str:
    """The socket's path inside the sandbox."""
    return f"{SANDBOX_DIR}/{self.socket_name}"

  def relay_command(self, port: int) -> str:
    """A shell command that starts the in-sandbox relay on 127.0.0.1:`port` and returns once
    it listens (exit status 0)."""
    if not isinstance(port, int) or not 1024 <= port <= 65535:
      raise ValueError(f"port={port!r}: expected an unprivileged TCP port (1024-65535)")
    return f"python3 -I {SANDBOX_DIR}/relay.py {port} {self.sandbox_socket}"

  def write_home_file(self, relative: str, text: str) -> str:
    """Writes a configuration file under home/ of the channel's directory (the scaffold's
    launch copies home/ into its $HOME); returns its sandbox path.

    Raises:
      ValueError: a path that is absolute or has '..'.
    """
    parts = [p for p in relative.split("/") if p not in ("", ".")]
    if not parts or relative.startswith("/") or ".." in parts:
      raise ValueError(f"path={relative!r}: expected a relative path without '..'")
    path = os.path.join(self.host_dir, "home", *parts)
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    for d in range(1, len(parts)):
      os.chmod(os.path.join(self.host_dir, "home", *parts[:d]), 0o755)
    with open(path, "w", encoding="utf-8") as f:
      f.write(text)
    os.chmod(path, 0o644)
    return f"{SANDBOX_DIR}/home/{'/'.join(parts)}"

  # ------------------------------------------------------------------ host side

  async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    task = asyncio.current_task()
    self._tasks.add(task)
    entry = ["?", "?", 0]
    try:
      if self._active >= self.max_connections:
        entry[2] = 503
        await self._answer(writer, 503, "too many requests in flight on this channel")
        await self._discard(reader)
        return
      self._active += 1
      try:
        await self._forward(reader, writer, entry)
      finally:
        self._active -= 1
    except ChannelError as e:
      entry[2] = e.status
      await self._answer(writer, e.status, e.message)
      await self._discard(reader)
    except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError,
            asyncio.LimitOverrunError, OSError) as e:
      log.debug("channel %s: connection ended: %r", self.session_id, e)
    finally:
      self.requests.append(tuple(entry))
      self._tasks.discard(task)
      writer.close()

  async def _answer(self, writer: asyncio.StreamWriter, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "channel_error"}}).encode()
    reason = {403: "Forbidden", 413: "Payload Too Large", 415: "Unsupported Media Type",
              400: "Bad Request", 503: "Service Unavailable", 502: "Bad Gateway"}.get(status, "")
    try:
      writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
      await writer.drain()
      if writer.can_write_eof():
        writer.write_eof()  # the answer is complete: the client need not wait for the close
    except (ConnectionError, OSError):
      pass

  @staticmethod
  async def _discard(reader: asyncio.StreamReader) -> None:
    """Reads what the client still sends (at most DISCARD_BYTES, DISCARD_SECONDS) before the
    connection closes: closing a socket with unread input resets it, and the client would
    lose the answer."""
    left, deadline = DISCARD_BYTES, asyncio.get_running_loop().time() + DISCARD_SECONDS
    try:
      while left > 0:
        timeout = deadline - asyncio.get_running_loop().time()
        data = await asyncio.wait_for(reader.read(min(left, CHUNK)), max(timeout, 0.001))
        if not data:
          return
        left -= len(data)
    except (asyncio.TimeoutError, ConnectionError, OSError):
      pass

  async def _read(self, coro):
    return await asyncio.wait_for(coro, self.idle_timeout)

  async def _forward(self, reader, writer, entry) -> None:
    try:
      head = await self._read(reader.readuntil(b"\r\n\r\n"))
    except asyncio.LimitOverrunError:
      raise ChannelError(400, f"request head longer than {MAX_HEAD_BYTES} bytes") from None
    except asyncio.IncompleteReadError:
      return  # the client went away before a request
    text = head.decode("latin-1")
    if _CONTROL.search(text[:-4].replace("\r\n", "")):  # a bare CR or LF could split a header
      raise ChannelError(400, "control characters in the request head")
    lines = text.split("\r\n")
    try:
      method, target, version = lines[0].split(" ")
    except ValueError:
      raise ChannelError(400, "malformed request line") from None
    headers = []
    for line in lines[1:]:
      if line:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
          raise ChannelError(400, "malformed header line")
        headers.append((name, value.strip()))
    lower = {n.lower(): v for n, v in headers}
    path, _, query = target.partition("?")
    entry[0], entry[1] = method, path
    if not ((method == "POST" and _POST.match(path)) or (method == "GET" and _GET.match(path))):
      raise ChannelError(403, f"{method} {path[:200]}: only model calls pass this channel")
    if lower.get("content-encoding", "identity").lower() != "identity":
      raise ChannelError(415, "compressed request bodies are not accepted by this channel")
    if lower.get("expect", "").lower() == "100-continue":
      writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    body = await self._body(reader, lower)
    body = self._force_session(body, lower.get("content-type", ""))
    out = [f"{method} {self._prefix}{path}{'?' + query if query else ''} HTTP/1.1",
           f"Host: {self._netloc}", "Connection: close", f"Content-Length: {len(body)}",
           f"x-session-id: {self.session_id}"]
    if self._token is not None:
      out.append(f"Authorization: Bearer {self._token}")
    out += [f"{n}: {v}" for n, v in headers if n.lower() not in _DROP]
    context = None
    if self._tls:
      context = ssl.create_default_context(cafile=self._cafile)
    try:
      up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(
          self._host, self._port, ssl=context, limit=CHUNK), self.idle_timeout)
    except (OSError, asyncio.TimeoutError) as e:
      raise ChannelError(502, f"the gateway does not answer: {e}") from None
    try:
      up_writer.write(("\r\n".join(out) + "\r\n\r\n").encode("latin-1") + body)
      await up_writer.drain()
      first = True
      while True:
        chunk = await self._read(up_reader.read(CHUNK))
        if not chunk:
          break
        if first:
          first = False
          status = chunk.split(b"\r\n", 1)[0].split(b" ")
          entry[2] = int(status[1]) if len(status) > 1 and status[1].isdigit() else 0
        writer.write(chunk)
        await writer.drain()  # each chunk goes on at once: SSE events are not held back
    finally:
      up_writer.close()

  async def _body(self, reader: asyncio.StreamReader, lower: dict) -> bytes:
    """The request body (Content-Length or chunked), at most max_request_bytes."""
    if "chunked" in lower.get("transfer-encoding", "").lower():
      parts, total = [], 0
      while True:
        size_line = await self._read(reader.readuntil(b"\r\n"))
        try:
          size = int(size_line.split(b";")[0].strip(), 16)
        except ValueError:
          raise ChannelError(400, "malformed chunk size") from None
        if size == 0:
          while (await self._read(reader.readuntil(b"\r\n"))) != b"\r\n":
            pass  # trailers: dropped
          return b"".join(parts)
        total += size
        if total > self.max_request_bytes:
          raise ChannelError(413, f"request body over {self.max_request_bytes} bytes")
        parts.append(await self._read(reader.readexactly(size)))
        await self._read(reader.readexactly(2))
    length = lower.get("content-length", "0")
    if not length.isdigit():
      raise ChannelError(400, f"Content-Length={length[:40]!r}: expected a number")
    if int(length) > self.max_request_bytes:
      raise ChannelError(413, f"request body over {self.max_request_bytes} bytes")
    return await self._read(reader.readexactly(int(length))) if int(length) else b""

  def _force_session(self, body: bytes, content_type: str) -> bytes:
    """The body with a JSON object's `session_id` set to this channel's (when it names one);
    other bodies unchanged. A body that is not JSON but looks like it is refused: the gateway
    would reject it anyway, and it must not carry a session past this check."""
    if not body.strip():
      return body
    try:
      obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
      if "json" in content_type.lower():
        raise ChannelError(400, "request body is not valid JSON") from None
      return body
    if isinstance(obj, dict) and "session_id" in obj:  # re-encoded: no duplicate key survives
      obj["session_id"] = self.session_id
      return json.dumps(obj).encode()
    return body
