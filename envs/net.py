"""Network-service helpers shared by every server Arbor starts and every client or launcher that
talks to one (policy server, sandbox server, Redis queue): what counts as loopback, and how a
token or password is read from its file.

Every service binds to loopback by default and requires a token or a password when exposed.
Secrets travel in files, never on command lines (where `ps` would show them).
"""

from __future__ import annotations

import ipaddress


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
