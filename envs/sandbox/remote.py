"""`remote` backend: the client of `envs.sandbox_server` (HTTP/JSON, bearer token).

    sb = await RemoteSandbox.create("http://127.0.0.1:8910", token=TOKEN, limits=Limits())

Requests run in a dedicated pool of worker threads (stdlib urllib; a thread blocked on a long
exec costs little), so one event loop can drive hundreds of sandboxes.
Server errors come back as the same exception types the local backends raise (PathError,
FileNotFoundError, ValueError, SandboxFull on 429, SandboxError otherwise). Use https:// for
a server on another machine; `cafile` pins its certificate authority.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import dataclasses
import http.client
import json
import ssl
import urllib.error
import urllib.request
from typing import Mapping, Optional, Sequence

from envs.net import read_secret
from envs.sandbox.base import ExecResult, Limits, PathError, Sandbox, SandboxError, SandboxFull

# Not asyncio's default executor (a handful of threads): long execs would queue behind each other.
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=512, thread_name_prefix="sandbox-http")
_ERRORS = {"PathError": PathError, "ValueError": ValueError, "SandboxFull": SandboxFull,
           "FileNotFoundError": FileNotFoundError}


class _Client:
  def __init__(self, url: str, token: str, cafile: Optional[str] = None):
    if not url.startswith(("http://", "https://")):
      raise ValueError(f"url={url!r}: expected http:// or https://")
    if not token:
      raise ValueError("token: the sandbox server requires one")
    self.url, self.token = url.rstrip("/"), token
    self.ssl = ssl.create_default_context(cafile=cafile) if url.startswith("https://") else None

  def _request(self, method: str, path: str, body: Optional[dict], timeout: float) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(self.url + path, data=data, method=method, headers={
        "Authorization": f"Bearer {self.token}", "Content-Type": "application/json"})
    try:
      with urllib.request.urlopen(req, timeout=timeout, context=self.ssl) as r:
        try:
          return json.loads(r.read())
        except (OSError, http.client.HTTPException, ValueError) as e:  # cut mid-body
          raise SandboxError(f"sandbox server {self.url}: bad or cut-off response "
                             f"({type(e).__name__}: {e})") from None
    except urllib.error.HTTPError as e:
      try:
        err = json.loads(e.read())
        message, kind = err.get("error", str(e)), err.get("type", "")
      except (ValueError, OSError):
        message, kind = f"HTTP {e.code} {e.reason}", ""
      if e.code == 429:
        raise SandboxFull(message) from None
      if kind == "OSError":
        raise OSError(err.get("errno"), message) from None
      raise _ERRORS.get(kind, SandboxError)(f"{method} {path}: {message}") from None
    except (urllib.error.URLError, OSError) as e:
      raise SandboxError(f"sandbox server {self.url} unreachable: {e}") from None
    except (http.client.HTTPException, ValueError) as e:  # cut mid-response (IncompleteRead)
      raise SandboxError(f"sandbox server {self.url}: bad or cut-off response "
                         f"({type(e).__name__}: {e})") from None

  async def request(self, method: str, path: str, body: Optional[dict] = None,
                    timeout: float = 60.0) -> dict:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_POOL, self._request, method, path, body, timeout)


class RemoteSandbox(Sandbox):
  """One sandbox on a sandbox server."""

  def __init__(self, client: _Client, sid: str, limits: Limits, workspace: str = ""):
    self._client, self.id, self.limits, self._closed = client, sid, limits, False
    self.workspace_path = workspace  # the workspace inside the sandbox (the commands' cwd)

  @classmethod
  async def create(cls, url: str, token: Optional[str] = None, *,
                   limits: Optional[Limits] = None, token_file: Optional[str] = None,
                   cafile: Optional[str] = None, timeout: float = 120.0,
                   rootfs: Optional[str] = None,
                   image: Optional[str] = None) -> "RemoteSandbox":
    """Asks the sandbox server at `url` for a sandbox.

    Args:
      url: the server (http:// or https://).
      token: the server's bearer token.
      limits: the sandbox's limits. Fields left at `Limits()`'s defaults are not sent: the
        server fills them with its own caps, so a server started with smaller caps still
        grants a plain request (None: every field the server's).
      token_file: a file holding the token, read when `token` is None.
      cafile: CA certificate of an https server.
      timeout: seconds for the request.
      rootfs: the name of a root filesystem the server offers (its --rootfs allow-list).
      image: an image a docker-backed server offers (its --image allow-list).

    Returns:
      The sandbox, with the limits the server granted.

    Raises:
      ValueError: url is not http(s)://, no token is given, or a limit exceeds the server's
        cap (the message names the field and the cap).
      SandboxFull: the server has no capacity (429).
      SandboxError: the server is unreachable or refuses.
    """
    if token is None and token_file is not None:
      token = read_secret(token_file)
    client = _Client(url, token or "", cafile)
    body = {}
    if limits is not None:
      default = Limits()
      body["limits"] = {f.name: getattr(limits, f.name) for f in dataclasses.fields(Limits)
                        if getattr(limits, f.name) != getattr(default, f.name)}
    if rootfs is not None:
      body["rootfs"] = rootfs
    if image is not None:
      body["image"] = image
    r = await client.request("POST", "/sandboxes", body, timeout)
    return cls(client, r["id"], Limits(**r["limits"]), r.get("workspace", ""))

  def _path(self, op: str) -> str:
    if self._closed:
      raise SandboxError(f"sandbox {self.id} is closed")
    return f"/sandboxes/{self.id}/{op}"

  async def exec(self, cmd: str | Sequence[str], timeout: Optional[float] = None,
                 stdin: Optional[str] = None,
                 env: Optional[Mapping[str, str]] = None) -> ExecResult:
    """Runs a command (see `Sandbox.exec`); `cmd` may also be an argv list, run as given."""
    if not isinstance(cmd, str):
      if not isinstance(cmd, (list, tuple)) or not cmd or not all(isinstance(a, str)
                                                                   for a in cmd):
        raise ValueError(f"cmd={cmd!r}: expected a shell string or a non-empty list of strings")
      cmd = list(cmd)
    t = self.limits.default_timeout if timeout is None else timeout
    body = {"cmd": cmd, "timeout": timeout, "env": None if env is None else dict(env)}
    if isinstance(stdin, bytes):
      body["stdin_b64"] = base64.b64encode(stdin).decode()
    else:
      body["stdin"] = stdin
    # The server enforces the command's timeout; the HTTP wait only guards a lost server.
    wait = float(t) + 60 if isinstance(t, (int, float)) else 60.0
    return ExecResult.from_dict(await self._client.request("POST", self._path("exec"), body, wait))

  async def write_file(self, path: str, content: str | bytes) -> None:
    data = content.encode() if isinstance(content, str) else content
    if not isinstance(data, bytes):
      raise ValueError(f"content: expected str or bytes, got {type(content).__name__}")
    if len(data) > self.limits.file_bytes:  # say so here rather than as a 413
      raise ValueError(f"content of {path!r}: {len(data)} bytes > "
                       f"limits.file_bytes={self.limits.file_bytes}")
    await self._client.request("POST", self._path("write"),
                               {"path": path, "content_b64": base64.b64encode(data).decode()})

  async def read_file(self, path: str) -> bytes:
    r = await self._client.request("POST", self._path("read"), {"path": path})
    return base64.b64decode(r["content_b64"])

  async def list_files(self, path: str = ".") -> list[str]:
    return (await self._client.request("POST", self._path("list"), {"path": path}))["files"]

  async def fork(self, timeout: float = 120.0) -> "RemoteSandbox":
    """A new sandbox on the same server whose workspace is a copy of this one's, made there
    (`POST /sandboxes/ID/fork`, see `Sandbox.fork`); it takes a slot of the server's
    max_sandboxes.

    Args:
      timeout: seconds for the request.

    Raises:
      SandboxFull: the server has no capacity (429).
      SandboxError: this sandbox is closed, or the server failed to fork it.
    """
    r = await self._client.request("POST", self._path("fork"), {}, timeout)
    return RemoteSandbox(self._client, r["id"], Limits(**r["limits"]), r.get("workspace", ""))

  async def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    try:
      await self._client.request("DELETE", f"/sandboxes/{self.id}")
    except SandboxError as e:
      if "unknown or closed" not in str(e):  # already gone (e.g. its ttl expired): fine
        raise
