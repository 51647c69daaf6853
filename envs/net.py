"""Network-service helpers shared by every server Arbor starts and every client or launcher that
talks to one (policy server, sandbox server, Redis queue): what counts as loopback, how a
token or password is read from its file, and how a uvicorn server runs in a background thread.

Every service binds to loopback by default and requires a token or a password when exposed.
Secrets travel in files, never on command lines (where `ps` would show them).
"""

from __future__ import annotations

import asyncio
import ipaddress
import threading
import time
from typing import Any, Awaitable, Callable


def is_loopback(host: str) -> bool:
  """Whether `host` is this machine only: "localhost" or a loopback IP literal.

  Any other host name counts as reachable from elsewhere (names are not resolved, so the
  answer never depends on DNS), which errs on the side of asking for a token.

  Args:
    host: a bind address or the host part of a URL.

  Returns:
    True for "localhost", 127.0.0.0/8 and ::1.
  """
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def read_secret(path: str) -> str:
  """The token or password held in a file, without surrounding whitespace.

  Args:
    path: the file (e.g. a `--token_file` or `--queue_password_file` flag).

  Returns:
    The file's text, stripped.

  Raises:
    OSError: the file cannot be read.
  """
  with open(path) as f:
    return f.read().strip()


def check_bind(host: str, token: str | None) -> None:
  """Refuses to expose a server beyond loopback without a token.

  Args:
    host: the bind address.
    token: the bearer token clients must send (None or "": no token).

  Raises:
    ValueError: `host` is not loopback and there is no token.
  """
  if not is_loopback(host) and not token:
    raise ValueError(f"refusing to bind host={host!r} without a token: pass --token (or set "
                     "ARBOR_SERVE_TOKEN); clients send it as 'Authorization: Bearer <token>'")


def serve_in_thread(serve: Callable[[], Awaitable[Any]], server, what: str, name: str,
                    timeout: float) -> tuple[threading.Thread, int]:
  """Runs `serve()` in a daemon thread with its own event loop until `server` listens.

  Args:
    serve: the coroutine function that serves (e.g. a uvicorn Server's `serve`).
    server: the uvicorn Server (its `started` flag and bound sockets are read).
    what: names the server in the error, e.g. "sandbox server on 127.0.0.1:0".
    name: the thread's name.
    timeout: seconds to wait for the listener.

  Returns:
    (the serving thread, the bound port).

  Raises:
    RuntimeError: the server did not start in time, or failed (e.g. the port is taken).
  """
  failure: list[BaseException] = []

  def run():
    try:
      asyncio.run(serve())
    except BaseException as e:  # uvicorn exits (SystemExit) when it cannot bind
      failure.append(e)

  thread = threading.Thread(target=run, name=name, daemon=True)
  thread.start()
  deadline = time.monotonic() + timeout
  while not server.started and not failure and time.monotonic() < deadline:
    time.sleep(0.01)
  if not server.started:
    raise RuntimeError(f"{what} did not start" + (f" ({failure[0]!r}; see the log)" if failure
                                                  else f" within {timeout:g} s"))
  return thread, server.servers[0].sockets[0].getsockname()[1]
