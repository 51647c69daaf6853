"""Token-in/token-out policy server: the generation engine behind a small asyncio HTTP server.

    python -m trainer.serve --ckpt DIR [--host 127.0.0.1 --port 8000 --chat_format qwen2.5]
    python -m trainer.serve --preset tiny-dense          # random weights (tests, demos)

DIR is a checkpoint written by `python -m models.hf import` (its `hf_extra/` tokenizer files
enable the chat endpoint). Endpoints:

  POST /generate              {"input_ids", "max_tokens", "temperature", "top_p", "top_k",
                               "stop_token_ids", "stop", "seed"} -> {"output_ids", "logprobs",
                               "finish_reason", "policy_version", "token_versions", ...}
                              (the protocol of envs.policy.HTTPPolicy)
  POST /v1/chat/completions   OpenAI-compatible; renders messages and tools with envs.chat,
                              parses tool calls; with "session_id" (body field or X-Session-Id
                              header) every call's exact ids and log-probs are logged
  GET  /v1/sessions/{id}      that log; DELETE frees it
  GET  /health                status, policy version, engine counters

Requests from all clients go to one engine queue and are decoded together. The server binds
to loopback by default; any other address needs a bearer token (--token or ARBOR_SERVE_TOKEN),
which every endpoint but /health then requires. Bodies and session logs are size-bounded; a bad
request gets a 4xx with a message and the server keeps serving. Nothing is unpickled.

One module (~640 lines, half of them docstrings): the endpoints share the request checks,
the engine queue and the session log, and read best side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import hmac
import json
import logging
import os
import sys
import threading
import time
import uuid
from typing import Any, Optional, Sequence

from envs.chat import load_tokenizer, make_chat
from envs.net import check_bind
from envs.policy import Generation, SamplingParams
from models import hf, transformer
from models.engine import Engine, EngineConfig
from models.presets import get_preset
from trainer import config as config_lib
from trainer import harness

logger = logging.getLogger(__name__)

REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
           405: "Method Not Allowed", 408: "Request Timeout", 413: "Payload Too Large",
           500: "Internal Server Error", 501: "Not Implemented"}
GENERATE_FIELDS = ("input_ids", "max_tokens", "temperature", "top_p", "top_k", "stop_token_ids",
                   "stop", "seed")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
  """Address, auth and size limits of a PolicyServer (each field's meaning beside it)."""
  host: str = "127.0.0.1"            # bind address; non-loopback needs `token`
  port: int = 8000                   # 0 = any free port
  token: Optional[str] = None        # bearer token required on every endpoint but /health
  served_name: str = "arbor"         # the "model" field of chat replies
  max_body_bytes: int = 4 << 20      # larger request bodies get 413
  max_header_bytes: int = 16 << 10   # request line + headers
  read_timeout_s: float = 30.0       # to receive a request
  max_n: int = 16                    # most samples per chat request
  max_sessions: int = 1024           # session logs kept (least recently used dropped first)
  max_session_tokens: int = 1 << 21  # logged input + output tokens per session
  max_log_tokens: int = 1 << 24      # logged tokens over all sessions


class HTTPError(Exception):
  """A request error answered with an HTTP status and {"error": message}.

  Args:
    status: the HTTP status code (4xx / 5xx).
    message: the error's text, sent to the client.
  """
  def __init__(self, status: int, message: str):
    super().__init__(message)
    self.status = status


# ----------------------------------------------------------------------------- request checks


def _field(body: dict, name: str, kind, default=None, *, where: str = ""):
  value = body.get(name, default)
  if value is None:
    return default
  numeric = kind in (int, float, (int, float))
  ok = (isinstance(value, kind) and not isinstance(value, bool)) if numeric else isinstance(
      value, kind)
  if not ok:
    expected = getattr(kind, "__name__", "a number")
    raise HTTPError(400, f"{where}{name}={value!r:.100}: expected {expected}")
  return value


def _int_list(body: dict, name: str) -> list[int]:
  value = body.get(name, [])
  if value is None:
    return []
  if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                            for x in value):
    raise HTTPError(400, f"{name}: expected a list of integers")
  return value


def _stop_strings(body: dict) -> tuple[str, ...]:
  stop = body.get("stop")
  if stop is None:
    return ()
  if isinstance(stop, str):
    stop = [stop]
  if (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
      or len(stop) > 16):
    raise HTTPError(400, f"stop={stop!r:.100}: expected up to 16 non-empty strings")
  return tuple(stop)


def sampling_params(body: dict, *, max_tokens: int, stop_token_ids: Sequence[int] = ()):
  """Builds engine SamplingParams from a request body.

  Args:
    body: the request's JSON object (fields of GENERATE_FIELDS; absent ones take defaults:
      temperature 1, top_p 1, top_k 0, no stop, no seed).
    max_tokens: the default (and, from the chat endpoint, the room left) when the body has none.
    stop_token_ids: stop tokens added to the body's (e.g. the chat format's end of turn).

  Returns:
    The SamplingParams.

  Raises:
    HTTPError: 400 on a field of the wrong type, max_tokens < 1 or a bad "stop".
  """
  mt = _field(body, "max_tokens", int, max_tokens)
  if mt < 1:
    raise HTTPError(400, f"max_tokens={mt}: must be >= 1")
  return SamplingParams(
      max_tokens=mt,
      temperature=float(_field(body, "temperature", (int, float), 1.0)),
      top_p=float(_field(body, "top_p", (int, float), 1.0)),
      top_k=_field(body, "top_k", int, 0),
      stop_token_ids=tuple(dict.fromkeys(list(stop_token_ids) + _int_list(body, "stop_token_ids"))),
      stop=_stop_strings(body),
      seed=_field(body, "seed", int, None))


# ----------------------------------------------------------------------------- session log


class SessionLog:
  """Exact ids and log-probs of each chat call, per session id, bounded in size.

  Args:
    max_sessions: sessions kept (the least recently used is dropped first).
    max_session_tokens: logged input + output tokens per session.
    max_total_tokens: logged tokens over all sessions (least recently used dropped first).
  """

  def __init__(self, max_sessions: int, max_session_tokens: int, max_total_tokens: int):
    self.max_sessions, self.max_session_tokens = max_sessions, max_session_tokens
    self.max_total_tokens = max_total_tokens
    self._sessions: collections.OrderedDict[str, list[dict]] = collections.OrderedDict()
    self._tokens: dict[str, int] = {}
    self._lock = threading.Lock()

  def reserve_check(self, session: str, tokens: int) -> None:
    """Checks that logging `tokens` more fits the session's limit.

    Args:
      session: the session id.
      tokens: the most tokens the coming call may log (n x (input + max_tokens)).

    Raises:
      HTTPError: 413 when the session's log would exceed `max_session_tokens`.
    """
    with self._lock:
      used = self._tokens.get(session, 0)
    if used + tokens > self.max_session_tokens:
      raise HTTPError(413, f"session {session!r}: its log holds {used} tokens and this call may "
                           f"add {tokens}, over the limit of {self.max_session_tokens}")

  def add(self, session: str, call: dict) -> None:
    """Appends one call's record to a session, dropping least recently used sessions when full.

    Args:
      session: the session id.
      call: the call's record; its "input_ids" and "output_ids" count against the limits.
    """
    n = len(call["input_ids"]) + len(call["output_ids"])
    with self._lock:
      self._sessions.setdefault(session, []).append(call)
      self._sessions.move_to_end(session)
      self._tokens[session] = self._tokens.get(session, 0) + n
      while len(self._sessions) > self.max_sessions or \
          (sum(self._tokens.values()) > self.max_total_tokens and len(self._sessions) > 1):
        old, _ = self._sessions.popitem(last=False)
        self._tokens.pop(old)
        logger.warning("session log full: dropped session %s", old)

  def get(self, session: str) -> list[dict]:
    """Returns a copy of a session's call records (HTTPError 404 for an unknown session)."""
    with self._lock:
      if session not in self._sessions:
        raise HTTPError(404, f"unknown session {session!r}")
      return list(self._sessions[session])

  def delete(self, session: str) -> None:
    """Frees a session's log (HTTPError 404 for an unknown session)."""
    with self._lock:
      if self._sessions.pop(session, None) is None:
        raise HTTPError(404, f"unknown session {session!r}")
      self._tokens.pop(session)


# ----------------------------------------------------------------------------- server


class PolicyServer:
  """HTTP front of an `models.engine.Engine` (see module docstring).

  Args:
    engine: the generation engine (started by `start`, stopped by `stop`).
    config: address, token and limits.
    tokenizer: decodes tokens for chat log-probs (None: no chat endpoint).
    chat: the envs.chat format of /v1/chat/completions (None: that endpoint answers 501).

  Raises:
    ValueError: a non-loopback host without a token (envs.net.check_bind).
  """

  def __init__(self, engine, config: ServerConfig = ServerConfig(), tokenizer=None, chat=None):
    check_bind(config.host, config.token)
    self.engine, self.cfg, self.tokenizer, self.chat = engine, config, tokenizer, chat
    self.sessions = SessionLog(config.max_sessions, config.max_session_tokens,
                               config.max_log_tokens)
    self._server: Optional[asyncio.AbstractServer] = None
    self._loop: Optional[asyncio.AbstractEventLoop] = None
    self._thread: Optional[threading.Thread] = None
    self.port: Optional[int] = None

  # --- lifecycle
  async def start(self) -> None:
    """Starts the engine and listens on the configured address (sets `port`)."""
    self.engine.start()
    self._server = await asyncio.start_server(self._handle, self.cfg.host, self.cfg.port,
                                              limit=self.cfg.max_header_bytes)
    self.port = self._server.sockets[0].getsockname()[1]
    logger.info("serving on http://%s:%d", self.cfg.host, self.port)

  async def serve_forever(self) -> None:
    """Starts, then serves until cancelled."""
    await self.start()
    async with self._server:
      await self._server.serve_forever()

  def start_in_thread(self) -> str:
    """Serves from a daemon thread with its own event loop.

    Returns:
      The base URL, "http://host:port".

    Raises:
      RuntimeError: the server did not start within 60 s.
    """
    started = threading.Event()

    def run():
      self._loop = asyncio.new_event_loop()
      self._loop.run_until_complete(self.start())
      started.set()
      self._loop.run_forever()

    self._thread = threading.Thread(target=run, name="arbor-serve", daemon=True)
    self._thread.start()
    if not started.wait(60):
      raise RuntimeError("policy server did not start within 60 s")
    return f"http://{self.cfg.host}:{self.port}"

  def stop(self) -> None:
    """Closes the server (when started in a thread) and stops the engine."""
    if self._loop is not None:
      async def close():
        self._server.close()
        await self._server.wait_closed()
      asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
      self._loop.call_soon_threadsafe(self._loop.stop)
      self._thread.join(10)
    self.engine.stop()

  # --- HTTP
  async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    status, reply = 500, {"error": "internal error"}
    try:
      method, path, headers, body = await asyncio.wait_for(self._read(reader),
                                                           self.cfg.read_timeout_s)
      status, reply = 200, await self._route(method, path, headers, body)
    except HTTPError as e:
      status, reply = e.status, {"error": str(e)}
    except asyncio.TimeoutError:
      status, reply = 408, {"error": f"request not received within {self.cfg.read_timeout_s} s"}
    except (asyncio.LimitOverrunError, ValueError) as e:
      status, reply = 400, {"error": f"malformed request: {e}"}
    except Exception as e:  # the server keeps serving whatever one request does
      logger.exception("request failed")
      status, reply = 500, {"error": f"{type(e).__name__}: {e}"}
    data = json.dumps(reply).encode()
    head = (f"HTTP/1.1 {status} {REASONS.get(status, '')}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n")
    try:
      writer.write(head.encode() + data)
      await writer.drain()
      writer.close()
      await writer.wait_closed()
    except (ConnectionError, OSError):
      pass  # the client went away

  async def _read(self, reader: asyncio.StreamReader):
    line = await reader.readline()
    parts = line.decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
      raise HTTPError(400, f"malformed request line {line[:100]!r}")
    method, path = parts[0], parts[1]
    headers, size = {}, len(line)
    while True:
      line = await reader.readline()
      size += len(line)
      if size > self.cfg.max_header_bytes:
        raise HTTPError(413, f"headers exceed {self.cfg.max_header_bytes} bytes")
      if line in (b"\r\n", b"\n", b""):
        break
      name, _, value = line.decode("latin-1").partition(":")
      headers[name.strip().lower()] = value.strip()
    body = b""
    if method in ("POST", "PUT"):
      if "chunked" in headers.get("transfer-encoding", ""):
        raise HTTPError(400, "chunked request bodies are not supported: send Content-Length")
      try:
        length = int(headers.get("content-length", ""))
      except ValueError:
        raise HTTPError(400, "Content-Length: missing or not an integer") from None
      if length < 0 or length > self.cfg.max_body_bytes:
        raise HTTPError(413, f"Content-Length={length}: bodies are limited to "
                             f"{self.cfg.max_body_bytes} bytes")
      body = await reader.readexactly(length)
    return method, path.split("?", 1)[0], headers, body

  def _authorize(self, headers: dict) -> None:
    if not self.cfg.token:
      return
    given = headers.get("authorization", "")
    if not given.startswith("Bearer ") or not hmac.compare_digest(
        given[len("Bearer "):].encode(), self.cfg.token.encode()):
      raise HTTPError(401, "missing or wrong bearer token (Authorization: Bearer <token>)")

  async def _route(self, method: str, path: str, headers: dict, body: bytes) -> dict:
    if path == "/health":
      if method != "GET":
        raise HTTPError(405, f"{method} {path}: use GET")
      return {"status": "ok", "policy_version": self.engine.version,
              "pending": self.engine.pending(), "counters": self.engine.counters}
    self._authorize(headers)
    routes = {"/generate": ("POST", self._generate),
              "/v1/chat/completions": ("POST", self._chat)}
    if path in routes:
      want, fn = routes[path]
      if method != want:
        raise HTTPError(405, f"{method} {path}: use {want}")
      return await fn(_json(body), headers)
    if path.startswith("/v1/sessions/"):
      session = path[len("/v1/sessions/"):]
      if method == "GET":
        return {"session_id": session, "calls": self.sessions.get(session)}
      if method == "DELETE":
        self.sessions.delete(session)
        return {"session_id": session, "deleted": True}
      raise HTTPError(405, f"{method} {path}: use GET or DELETE")
    raise HTTPError(404, f"no endpoint {method} {path}")

  async def _run(self, input_ids: list[int], params) -> Any:
    try:
      future = self.engine.submit(input_ids, params)
    except ValueError as e:
      raise HTTPError(400, str(e)) from None
    return await asyncio.wrap_future(future)

  # --- endpoints
  async def _generate(self, body: dict, headers: dict) -> dict:
    unknown = sorted(set(body) - set(GENERATE_FIELDS))
    if unknown:
      raise HTTPError(400, f"unknown fields {unknown}; expected {list(GENERATE_FIELDS)}")
    if "input_ids" not in body:
      raise HTTPError(400, "input_ids: required")
    input_ids = _int_list(body, "input_ids")
    # default: 256 new tokens, or what the cache row has room for
    max_tokens = max(1, min(256, self.engine.capacity - len(input_ids)))
    params = sampling_params(body, max_tokens=max_tokens)
    out = await self._run(input_ids, params)
    reply = {"output_ids": out.output_ids, "logprobs": out.logprobs,
             "finish_reason": out.finish_reason, "policy_version": out.policy_version,
             "token_versions": out.token_versions, "cached_tokens": out.cached_tokens}
    if out.top_logprobs is not None:
      reply["top_logprobs"] = out.top_logprobs
    if out.expert_ids is not None:
      reply["expert_ids"] = out.expert_ids.tolist()
    return reply

  async def _chat(self, body: dict, headers: dict) -> dict:
    if self.chat is None:
      raise HTTPError(501, "no tokenizer/chat format loaded: use /generate, or start the server "
                           "with a checkpoint that has tokenizer files (or --tokenizer)")
    messages, tools = body.get("messages"), body.get("tools")
    if not isinstance(messages, list) or not messages:
      raise HTTPError(400, "messages: expected a non-empty list")
    if tools is not None and not isinstance(tools, list):
      raise HTTPError(400, "tools: expected a list")
    n = _field(body, "n", int, 1)
    if not 1 <= n <= self.cfg.max_n:
      raise HTTPError(400, f"n={n}: must be in [1, {self.cfg.max_n}]")
    session = body.get("session_id", headers.get("x-session-id"))
    if session is not None and (not isinstance(session, str) or not 0 < len(session) <= 128
                                or "/" in session):
      raise HTTPError(400, f"session_id={session!r:.140}: expected 1-128 characters, no '/'")
    want_logprobs = bool(_field(body, "logprobs", bool, False))
    top_n = _field(body, "top_logprobs", int, 0)
    if top_n and (not want_logprobs or top_n > self.engine.cfg.top_logprobs):
      raise HTTPError(400, f"top_logprobs={top_n}: needs logprobs=true and at most "
                           f"{self.engine.cfg.top_logprobs} (the engine's top_logprobs)")
    try:
      input_ids = self.chat.render(messages, tools, add_generation_prompt=True).ids
    except (ValueError, KeyError, TypeError) as e:
      raise HTTPError(400, f"messages/tools: {e}") from None
    room = self.engine.capacity - len(input_ids)
    if room < 1:
      raise HTTPError(400, f"the rendered prompt has {len(input_ids)} tokens, more than the "
                           f"engine's max_seq_len={self.engine.capacity} allows")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    params = sampling_params({**body, "max_tokens": limit}, max_tokens=room,
                             stop_token_ids=self.chat.stop_token_ids)
    if session is not None:
      self.sessions.reserve_check(session, n * (len(input_ids) + params.max_tokens))
    outs = await asyncio.gather(*(self._run(input_ids, dataclasses.replace(
        params, seed=None if params.seed is None else params.seed + i)) for i in range(n)))
    choices = []
    for i, out in enumerate(outs):
      turn = self.chat.parse_assistant(out.output_ids, tools)
      message = turn.to_message()
      reason = "length" if out.finish_reason == "length" else (
          "tool_calls" if turn.valid_calls else "stop")
      choice = {"index": i, "message": message, "finish_reason": reason}
      if turn.errors:
        choice["tool_call_errors"] = turn.errors
      if want_logprobs:
        choice["logprobs"] = {"content": [
            {"token": self.tokenizer.decode([t]), "logprob": lp,
             "top_logprobs": [{"token": self.tokenizer.decode([j]), "logprob": v}
                              for j, v in (out.top_logprobs[k][:top_n] if top_n else [])]}
            for k, (t, lp) in enumerate(zip(out.output_ids, out.logprobs))]}
      choices.append(choice)
      if session is not None:
        self.sessions.add(session, {
            "input_ids": input_ids, "output_ids": out.output_ids, "logprobs": out.logprobs,
            "token_versions": out.token_versions, "policy_version": out.policy_version,
            "finish_reason": out.finish_reason, "time": time.time()})
    completion = sum(len(o.output_ids) for o in outs)
    reply = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
             "created": int(time.time()), "model": self.cfg.served_name, "choices": choices,
             "usage": {"prompt_tokens": len(input_ids), "completion_tokens": completion,
                       "total_tokens": len(input_ids) + completion}}
    if session is not None:
      reply["session_id"] = session
    return reply


def _json(body: bytes) -> dict:
  try:
    value = json.loads(body)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise HTTPError(400, f"malformed JSON body: {e}") from None
  if not isinstance(value, dict):
    raise HTTPError(400, "the JSON body must be an object")
  return value


# ----------------------------------------------------------------------------- in-process policy


class EnginePolicy:
  """envs.policy.Policy over an in-process engine (started in its background thread).

  Args:
    engine: the generation engine; started here.
  """

  def __init__(self, engine):
    self.engine = engine
    engine.start()

  async def generate(self, input_ids, params):
    """Samples one completion from the engine.

    Args:
      input_ids: the prompt's token ids.
      params: the envs.policy.SamplingParams.

    Returns:
      The envs.policy.Generation: output ids, log-probs, finish reason and policy versions.
    """
    out = await asyncio.wrap_future(self.engine.submit(list(input_ids), params))
    return Generation(output_ids=out.output_ids, logprobs=out.logprobs,
                      finish_reason=out.finish_reason, policy_version=out.policy_version,
                      token_versions=out.token_versions)


# ----------------------------------------------------------------------------- CLI


def default_chat_format(model_cfg) -> str:
  """The chat format of a model family: "deepseek_v3" for MLA models, else "qwen2.5"."""
  return "deepseek_v3" if model_cfg.attention == "mla" else "qwen2.5"


def build(args) -> PolicyServer:
  """Builds the model, tokenizer, engine and server from parsed command-line arguments.

  Args:
    args: the `parse_args` namespace.

  Returns:
    The PolicyServer, not yet started; without tokenizer files it serves /generate only.

  Raises:
    ValueError: a non-loopback host without a token.
  """
  token = args.token or os.environ.get("ARBOR_SERVE_TOKEN") or None
  check_bind(args.host, token)  # before loading anything
  if args.ckpt:
    model = hf.restore(args.ckpt)
  else:
    model = transformer.init(get_preset(args.preset), seed=args.seed)
  tokenizer = chat = None
  tok_path = args.tokenizer or (os.path.join(args.ckpt, "hf_extra") if args.ckpt else None)
  if tok_path and (args.tokenizer or any(os.path.exists(os.path.join(tok_path, f)) for f in (
      "tokenizer.json", "tiktoken.model", "tokenizer.model"))):
    tokenizer = load_tokenizer(tok_path)
    chat = make_chat(args.chat_format or default_chat_format(model.cfg), tokenizer)
  engine = Engine(model, EngineConfig(
      slots=args.slots, max_seq_len=args.max_seq_len, prefix_cache_rows=args.prefix_cache_rows,
      steps_per_call=args.steps_per_call, prefill_chunk=args.prefill_chunk,
      top_logprobs=args.top_logprobs, on_update=args.on_update),
      detokenize=None if tokenizer is None else tokenizer.decode)
  return PolicyServer(engine, ServerConfig(host=args.host, port=args.port, token=token,
                                           served_name=args.served_name),
                      tokenizer=tokenizer, chat=chat)


def run(config, workdir: str) -> dict:
  """Runs trainer.main mode "serve" until interrupted.

  Serves the config's model (model.init: a preset, hf:DIR or an Arbor run's ckpt:DIR) and
  tokenizer behind the policy server (config.serve).

  Args:
    config: a validated mode "serve" config.
    workdir: the run's directory (where a trained tokenizer is found).

  Returns:
    {"served": True}.

  Raises:
    ValueError: a non-loopback host without a token (ARBOR_SERVE_TOKEN).
  """
  token = os.environ.get("ARBOR_SERVE_TOKEN") or None
  check_bind(config.serve.host, token)
  model_cfg = config_lib.model_config(config)
  model = (harness.initial_model(config, model_cfg)
           or transformer.init(model_cfg, seed=config.seed))
  tokenizer = load_tokenizer(config_lib.tokenizer_source(config, workdir))
  chat = make_chat(config.tokenizer.chat_format, tokenizer)
  engine = Engine(model, EngineConfig(slots=config.serve.slots,
                                      max_seq_len=config.serve.max_seq_len,
                                      prefix_cache_rows=config.serve.slots, seed=config.seed),
                  detokenize=tokenizer.decode)
  server = PolicyServer(engine, ServerConfig(host=config.serve.host, port=config.serve.port,
                                             token=token, served_name=config.serve.served_name),
                        tokenizer=tokenizer, chat=chat)
  print(f"serve: {config.model.init} on http://{config.serve.host}:{config.serve.port} "
        "(/generate, /v1/chat/completions, /health)", flush=True)
  try:
    asyncio.run(server.serve_forever())
  except KeyboardInterrupt:
    pass
  return {"served": True}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
  """Parses the command line of `python -m trainer.serve` (None: sys.argv)."""
  p = argparse.ArgumentParser(prog="python -m trainer.serve", description=__doc__.split("\n")[0])
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--ckpt", help="checkpoint directory written by `python -m models.hf import`")
  src.add_argument("--preset", help="random weights of a models.presets preset (tests, demos)")
  p.add_argument("--seed", type=int, default=0, help="initialisation seed for --preset")
  p.add_argument("--host", default="127.0.0.1", help="bind address (non-loopback needs --token)")
  p.add_argument("--port", type=int, default=8000, help="port (0 = any free port)")
  p.add_argument("--token", default=None, help="bearer token (default: $ARBOR_SERVE_TOKEN)")
  p.add_argument("--tokenizer", default=None, help="tokenizer path (default: CKPT/hf_extra)")
  p.add_argument("--chat_format", default=None, help="envs.chat format (default: by model)")
  p.add_argument("--served_name", default="arbor", help="model name in chat replies")
  p.add_argument("--slots", type=int, default=16, help="sequences decoded together")
  p.add_argument("--max_seq_len", type=int, default=4096, help="longest input + output")
  p.add_argument("--prefix_cache_rows", type=int, default=16, help="extra cache rows for reuse")
  p.add_argument("--steps_per_call", type=int, default=16, help="decode steps per device call")
  p.add_argument("--prefill_chunk", type=int, default=512, help="prefill tokens per row and call")
  p.add_argument("--top_logprobs", type=int, default=0, help="top-n log-probs per token")
  p.add_argument("--on_update", default="finish", help="finish | resubmit | restart")
  return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
  """Serves from the command line until interrupted; returns 2 on a bad argument."""
  logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
  args = parse_args(argv)
  try:
    server = build(args)
  except ValueError as e:
    print(f"trainer.serve: {e}", file=sys.stderr)
    return 2
  asyncio.run(server.serve_forever())
  return 0


if __name__ == "__main__":
  sys.exit(main())
