"""The policy server: the generation engine behind Starlette under uvicorn, with the shared
front door (`envs.untrusted.door`), the token-in/token-out endpoint (/generate), the model and
session endpoints, and what the protocol endpoints share (`trainer.serving.chat`,
`trainer.serving.completions`, `trainer.serving.responses`, `trainer.serving.messages`): auth,
bodies, errors in each protocol's shape, sampling, the session log and event streams."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import threading
import time
import uuid
from typing import Any, Optional

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from envs.net import check_bind, serve_in_thread
from envs.policy import SamplingParams, encode_expert_ids
from envs.untrusted.decode import TooDeep, loads
from envs.untrusted.door import ConnectionLimits, Door, RequestError
from trainer.serving.chat import ChatEndpoint
from trainer.serving.completions import CompletionsEndpoint
from trainer.serving.messages import MessagesEndpoint
from trainer.serving.render import Prompt
from trainer.serving.responses import ResponsesEndpoint
from trainer.serving.sessions import SessionLog
from trainer.serving.text import _post, _sse
from trainer.serving.validate import (GENERATE_FIELDS, HTTPError, _field, _integer, _param_of,
                                      _refuse_unsupported, anthropic_error, check_token_ids,
                                      error_response, sampling_params)

logger = logging.getLogger("trainer.serve")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
  """Address, auth and limits of a PolicyServer (each field's meaning beside it)."""
  host: str = "127.0.0.1"            # bind address; non-loopback needs `token`
  port: int = 8000                   # 0 = any free port
  token: Optional[str] = None        # token required on every endpoint but /health (as a
                                     # bearer token, or Anthropic clients' X-Api-Key)
  served_name: str = "arbor"         # the model's id in /v1/models and replies
  top_logprobs: int = 20             # most top_logprobs (chat) / logprobs (completions) per
                                     # token; `build`/`run` give the engine this many (an engine
                                     # built elsewhere caps it at its EngineConfig.top_logprobs)
  max_body_bytes: int = 4 << 20      # larger request bodies get 413
  max_header_bytes: int = 16 << 10   # request line + headers
  max_json_depth: int = 128          # bodies nested deeper get 400 (measured before parsing)
  max_connections: int = 1024        # open connections; beyond, the oldest idle one is closed,
                                     # those that never carried a valid token first
  keep_alive_s: int = 5              # idle keep-alive connections close after this
  header_timeout_s: float = 10.0     # a request's headers are due this long after the
                                     # connection opened or the previous response ended
  body_timeout_s: float = 30.0       # a request's body is due this long after its headers (408)
  handshake_timeout_s: float = 10.0  # the TLS handshake is due this long after connecting
  max_n: int = 64                    # most samples per request (n x prompts)
  max_sessions: int = 1024           # session logs kept (least recently used dropped first)
  max_session_tokens: int = 1 << 21  # logged input + output tokens per session
  max_log_tokens: int = 1 << 24      # logged tokens over all sessions
  ssl_certfile: Optional[str] = None  # TLS certificate (PEM); with ssl_keyfile serves https
  ssl_keyfile: Optional[str] = None  # TLS private key (PEM)


def check_vocab(tokenizer, vocab_size: int) -> None:
  """Refuses a tokenizer whose ids go beyond the model's vocabulary.

  Args:
    tokenizer: the tokenizer (its `vocab_size`: every id is below it).
    vocab_size: the model's vocabulary size (it may be larger: padded embeddings).

  Raises:
    ValueError: naming both sizes.
  """
  if tokenizer.vocab_size > vocab_size:
    raise ValueError(f"the tokenizer has {tokenizer.vocab_size} token ids but the model's "
                     f"vocab_size is {vocab_size}: its ids would fall outside the model's "
                     "vocabulary (wrong tokenizer for this checkpoint?)")


@dataclasses.dataclass
class _Sample:
  """One sample of a request: the prompt it continues and how it is sampled."""
  prompt: int                     # index of the prompt
  input_ids: list[int]
  params: SamplingParams
  future: Any = None              # the engine's concurrent Future


class PolicyServer(ChatEndpoint, CompletionsEndpoint, ResponsesEndpoint, MessagesEndpoint):
  """HTTP front of an `models.engine.Engine` (the API: `trainer.serve`'s docstring).

  Args:
    engine: the generation engine (started by `start_in_thread` / `serve_forever`, stopped by
      `stop`).
    config: address, token and limits.
    tokenizer: decodes tokens for the OpenAI endpoints (None: /generate only).
    chat: the envs.chat format of the chat protocols (None: they answer 400).

  Raises:
    ValueError: a non-loopback host without a token (envs.net.check_bind), a connection
      limit that is not positive, or a tokenizer with ids beyond the model's vocabulary.
  """

  def __init__(self, engine, config: ServerConfig = ServerConfig(), tokenizer=None, chat=None):
    check_bind(config.host, config.token)
    if tokenizer is not None:
      check_vocab(tokenizer, engine.model_cfg.vocab_size)
    self.engine, self.cfg, self.tokenizer, self.chat = engine, config, tokenizer, chat
    self.door = Door(ConnectionLimits(  # ValueError for a limit that is not positive
        max_connections=config.max_connections, handshake_s=config.handshake_timeout_s,
        header_s=config.header_timeout_s, body_s=config.body_timeout_s,
        keep_alive_s=config.keep_alive_s, max_header_bytes=config.max_header_bytes))
    self.sessions = SessionLog(config.max_sessions, config.max_session_tokens,
                               config.max_log_tokens)
    self.created = int(time.time())
    self.app = Starlette(routes=[
        Route("/health", self._health, methods=["GET"]),
        Route("/generate", self._generate, methods=["POST"]),
        Route("/v1/chat/completions", self._chat, methods=["POST"]),
        Route("/v1/completions", self._completions, methods=["POST"]),
        Route("/v1/responses", self._responses, methods=["POST"]),
        Route("/v1/messages", self._messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", self._count_tokens, methods=["POST"]),
        Route("/v1/models", self._models, methods=["GET"]),
        Route("/v1/models/{model:path}", self._model, methods=["GET"]),
        Route("/v1/sessions/{session}", self._session, methods=["GET", "DELETE"]),
    ], exception_handlers={HTTPError: self._on_error, HTTPException: self._on_http_exception,
                           Exception: self._on_crash})
    self._server: Optional[uvicorn.Server] = None
    self._thread: Optional[threading.Thread] = None
    self.port: Optional[int] = None

  # --- lifecycle
  def _uvicorn(self) -> uvicorn.Server:
    c = self.cfg
    self._server = uvicorn.Server(uvicorn.Config(
        self.app, host=c.host, port=c.port, loop="asyncio", ws="none", lifespan="off",
        log_config=None, ssl_certfile=c.ssl_certfile, ssl_keyfile=c.ssl_keyfile,
        timeout_graceful_shutdown=5, **self.door.uvicorn_options()))
    return self._server

  async def _serve(self) -> None:
    await self.door.serve(self._server, tls=self.cfg.ssl_certfile is not None)

  @property
  def url(self) -> str:
    """The base URL, "http(s)://host:port" (port known once started)."""
    return f"{'https' if self.cfg.ssl_certfile else 'http'}://{self.cfg.host}:{self.port}"

  async def serve_forever(self) -> None:
    """Starts the engine and serves until interrupted (SIGINT / SIGTERM), then stops both."""
    self.engine.start()
    self._uvicorn()
    try:
      await self._serve()
    finally:
      self.engine.stop()

  def start_in_thread(self) -> str:
    """Starts the engine and serves from a daemon thread with its own event loop.

    Returns:
      The base URL, "http://host:port".

    Raises:
      RuntimeError: the server did not start within 60 s (e.g. the port is taken).
    """
    self.engine.start()
    server = self._uvicorn()
    try:
      self._thread, self.port = serve_in_thread(
          self._serve, server, f"policy server on {self.cfg.host}:{self.cfg.port}",
          "arbor-serve", 60)
    except RuntimeError:
      self.engine.stop()
      raise
    return self.url

  def stop(self) -> None:
    """Stops serving (when started in a thread) and stops the engine."""
    if self._thread is not None:
      self._server.should_exit = True
      self._thread.join(30)
      self._thread = None
    self.engine.stop()

  # --- errors and shared checks
  @staticmethod
  def _error(request: Request, status: int, message: str, param: Optional[str] = None,
             code: Optional[str] = None) -> Response:
    """An error in the shape of the request's protocol: Anthropic's on /v1/messages routes (the
    field named in the message), OpenAI's elsewhere."""
    if request.url.path.startswith("/v1/messages"):
      return anthropic_error(status, message)
    return error_response(status, message, param, code)

  async def _on_error(self, request: Request, e: HTTPError) -> Response:
    response = self._error(request, e.status, str(e), e.param, e.code)
    if e.status in (401, 408, 413):  # a body left unread, or a client not to keep
      response.headers["Connection"] = "close"
    return response

  async def _on_http_exception(self, request: Request, e: HTTPException) -> Response:
    where = f"{request.method} {request.url.path}"
    if e.status_code == 404:
      return self._error(request, 404, f"no endpoint {where}")
    if e.status_code == 405:
      return self._error(request, 405, f"{where}: use {(e.headers or {}).get('Allow', '')}")
    return self._error(request, e.status_code, f"{where}: {e.detail}")

  async def _on_crash(self, request: Request, e: Exception) -> Response:
    logger.error("request %s %s failed: %r", request.method, request.url.path, e)
    return self._error(request, 500, f"{type(e).__name__}: {e}")

  def _authorize(self, request: Request) -> None:
    """Checks the token (if the server has one): a bearer token, or the X-Api-Key header that
    Anthropic clients send; its connection is then one of a real client's, closed last when
    connections run out."""
    if self.cfg.token:
      given = request.headers.get("authorization", "")
      tokens = [given[len("Bearer "):]] if given.startswith("Bearer ") else []
      tokens += [request.headers["x-api-key"]] if "x-api-key" in request.headers else []
      if not any(hmac.compare_digest(t.encode(), self.cfg.token.encode()) for t in tokens):
        raise HTTPError(401, "missing or wrong bearer token (Authorization: Bearer <token>, "
                             "or X-Api-Key: <token>)", code="invalid_api_key")
    self.door.authenticated(request)

  async def _body(self, request: Request) -> dict:
    self._authorize(request)
    try:
      raw = await self.door.read_body(request, self.cfg.max_body_bytes, "max_body_bytes")
    except RequestError as e:
      raise HTTPError(e.status, str(e)) from None
    try:
      value = loads(raw, self.cfg.max_json_depth, "body")
    except TooDeep as e:
      raise HTTPError(400, str(e)) from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an over-long integer
      raise HTTPError(400, f"malformed JSON body: {e}") from None
    if not isinstance(value, dict):
      raise HTTPError(400, "the JSON body must be an object")
    return value

  def _check_model(self, body: dict) -> None:
    model = body.get("model")
    if model is not None and model != self.cfg.served_name:
      raise HTTPError(404, f"model={model!r:.100}: this server serves "
                           f"{self.cfg.served_name!r}", "model", "model_not_found")

  def _session_id(self, body: dict, request: Request) -> Optional[str]:
    session = body.get("session_id", request.headers.get("x-session-id"))
    if session is not None and (not isinstance(session, str) or not 0 < len(session) <= 128
                                or "/" in session):
      raise HTTPError(400, f"session_id={session!r:.140}: expected 1-128 characters, no '/'",
                      "session_id")
    return session

  def _top_limit(self) -> int:
    return min(self.cfg.top_logprobs, self.engine.cfg.top_logprobs)

  def _submit(self, input_ids: list[int], params, on_tokens=None, ids_field="input_ids"):
    kwargs = {} if on_tokens is None else {"on_tokens": on_tokens}
    try:
      return self.engine.submit(input_ids, params, **kwargs)
    except ValueError as e:
      param = _param_of(str(e))
      raise HTTPError(400, str(e), ids_field if param == "input_ids" else param) from None

  def _samples(self, prompts: list[list[int]], n: int, params, stream: bool,
               ids_field: str = "input_ids") -> tuple[list[_Sample], Optional[asyncio.Queue]]:
    """Submits n samples of each prompt (seeds seed, seed + 1, ...).

    With `stream`, each sample's progress (k, ids, logprobs, top) and end (k, future) go to
    the returned queue as the engine produces them.
    """
    samples = [_Sample(p, ids, dataclasses.replace(
        params, seed=None if params.seed is None else params.seed + j))
               for p, ids in enumerate(prompts) for j in range(n)]
    queue = asyncio.Queue() if stream else None
    loop = asyncio.get_running_loop()
    for k, s in enumerate(samples):
      hook = None if queue is None else (
          lambda ids, lps, top, k=k: _post(loop, queue, (k, ids, lps, top)))
      s.future = self._submit(s.input_ids, s.params, hook, ids_field)
      if queue is not None:
        s.future.add_done_callback(lambda f, k=k: _post(loop, queue, (k, f)))
    return samples, queue

  def _log(self, session: Optional[str], sample: _Sample, out, extra: dict,
           protocol: str = "completions") -> None:
    """Appends a finished sample's record to its session (`trainer.serving.sessions`).

    Args:
      session: the session id (None: nothing is logged).
      sample: the sample (its prompt ids and SamplingParams).
      out: the engine's Completion.
      extra: request fields logged with the sampling parameters (n, tool_choice).
      protocol: the endpoint the call came in by: "chat_completions" | "completions" |
        "responses" | "anthropic_messages" | "generate".
    """
    if session is None:
      return
    p = sample.params
    record = {
        "protocol": protocol, "input_ids": list(sample.input_ids),
        "output_ids": list(out.output_ids), "logprobs": out.logprobs,
        "token_versions": out.token_versions, "policy_version": out.policy_version,
        "finish_reason": out.finish_reason,
        "constrained": getattr(p, "constraint", None) is not None,
        "params": {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k,
                   "max_tokens": p.max_tokens, "stop": list(p.stop),
                   "stop_token_ids": list(p.stop_token_ids), "seed": p.seed, **extra},
        "time": time.time()}
    experts = getattr(out, "expert_ids", None)
    if experts is not None:
      record["expert_ids"] = encode_expert_ids(experts)
    self.sessions.add(session, record)

  def _head(self, kind: str) -> dict:
    return {"id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{uuid.uuid4().hex}",
            "object": kind, "created": int(time.time()), "model": self.cfg.served_name,
            "system_fingerprint": f"arbor-policy-{self.engine.version}"}

  async def _events(self, samples: list[_Sample], queue: asyncio.Queue, on_tokens, on_done):
    """Yields lists of chunks as the samples progress: on_tokens(k, ids, lps, top) while
    sample k runs, on_done(k, completion) once it is finished; stops after the last one."""
    left = len(samples)
    while left:
      event = await queue.get()
      k = event[0]
      if len(event) == 4:
        yield on_tokens(*event)
        continue
      left -= 1
      yield on_done(k, event[1].result())

  # --- endpoints
  async def _health(self, request: Request) -> Response:
    return JSONResponse({"status": "ok", "policy_version": self.engine.version,
                         "pending": self.engine.pending(), "counters": self.engine.counters})

  async def _models(self, request: Request) -> Response:
    self._authorize(request)
    return JSONResponse({"object": "list", "data": [self._model_card()]})

  async def _model(self, request: Request) -> Response:
    self._authorize(request)
    self._check_model({"model": request.path_params["model"]})
    return JSONResponse(self._model_card())

  def _model_card(self) -> dict:
    return {"id": self.cfg.served_name, "object": "model", "created": self.created,
            "owned_by": "arbor", "max_model_len": self.engine.capacity}

  async def _session(self, request: Request) -> Response:
    self._authorize(request)
    session = request.path_params["session"]
    if request.method == "DELETE":
      self.sessions.delete(session)
      return JSONResponse({"session_id": session, "deleted": True})
    return JSONResponse({"session_id": session, "calls": self.sessions.get(session)})

  async def _generate(self, request: Request) -> Response:
    body = await self._body(request)
    fields = list(GENERATE_FIELDS) + ["session_id"]
    unknown = sorted(set(body) - set(fields))
    if unknown:
      raise HTTPError(400, f"unknown fields {unknown}; expected {fields}", unknown[0])
    if "input_ids" not in body:
      raise HTTPError(400, "input_ids: required", "input_ids")
    input_ids = check_token_ids(body["input_ids"], "input_ids", self._vocab(), empty=False)
    room = self._room([len(input_ids)], "input_ids")
    # default: 256 new tokens, or what the cache row has room for
    params = sampling_params(body, room=room, capacity=self.engine.capacity,
                             vocab_size=self._vocab(), max_tokens=min(256, room))
    session = self._session_id(body, request)
    self._reserve(session, [len(input_ids)], 1, params)
    sample = _Sample(0, input_ids, params)
    out = await asyncio.wrap_future(self._submit(input_ids, params))
    self._log(session, sample, out, {"n": 1}, "generate")
    reply = {"output_ids": out.output_ids, "logprobs": out.logprobs, "entropies": out.entropies,
             "finish_reason": out.finish_reason, "policy_version": out.policy_version,
             "token_versions": out.token_versions, "cached_tokens": out.cached_tokens}
    if out.top_logprobs is not None:
      reply["top_logprobs"] = out.top_logprobs
    if out.expert_ids is not None:
      reply["expert_ids"] = encode_expert_ids(out.expert_ids)
    return JSONResponse(reply)

  def _common(self, body: dict, prompt_lens: list[int], n_prompts: int, stop_token_ids,
              formats: bool = False):
    """Checks the fields chat and completions share; returns (n, params, stream, usage).
    `formats`: the endpoint constrains replies to a response_format (checked where it is
    compiled), else only {"type": "text"} is accepted."""
    _refuse_unsupported(body, formats)
    n = _integer(body, "n", 1, 1, max(1, self.cfg.max_n // n_prompts),
                 f" (n x {n_prompts} prompt(s) at most {self.cfg.max_n} samples)")
    stream = _field(body, "stream", bool, False)
    options = _field(body, "stream_options", dict, None)
    if options is not None and not stream:
      raise HTTPError(400, "stream_options: only allowed with stream=true", "stream_options")
    include_usage = bool((options or {}).get("include_usage", False))
    room = self._room(prompt_lens, None)
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    params = sampling_params({**body, "max_tokens": limit}, room=room,
                             capacity=self.engine.capacity, vocab_size=self._vocab(),
                             stop_token_ids=stop_token_ids, vllm=True)
    return n, params, stream, include_usage

  def _vocab(self, decoded: bool = False) -> int:
    """Token ids a request may carry are in [0, this): the model's vocabulary, or for ids the
    server decodes (a completions prompt) the part of it the tokenizer knows."""
    vocab = self.engine.model_cfg.vocab_size
    return min(vocab, self.tokenizer.vocab_size) if decoded else vocab

  def _room(self, prompt_lens: list[int], param: Optional[str]) -> int:
    """The most new tokens the longest prompt leaves room for (400 when none)."""
    room = self.engine.capacity - max(prompt_lens)
    if room < 1:
      raise HTTPError(400, f"the prompt has {max(prompt_lens)} tokens, more than the engine's "
                           f"max_seq_len={self.engine.capacity} allows", param)
    return room

  def _reserve(self, session, prompt_lens: list[int], n: int, params) -> None:
    if session is not None:
      self.sessions.reserve_check(session, sum(n * (k + params.max_tokens) for k in prompt_lens))

  async def _stream(self, what: str, samples, queue, opening, on_tokens, on_done, closing,
                    on_error):
    """The events of a streamed reply, as text: opening(), the samples' events as they progress
    (`_events`: on_tokens / on_done), then closing(); each returns a list of formatted events.
    An error after the status line is sent becomes on_error(message)'s event."""
    try:
      for event in opening():
        yield event
      async for events in self._events(samples, queue, on_tokens, on_done):
        for event in events:
          yield event
      for event in closing():
        yield event
    except Exception as e:  # the status line is sent: report the error as an event
      logger.exception("%s stream failed", what)
      yield on_error(f"{type(e).__name__}: {e}")
    finally:
      for s in samples:
        s.future.cancel()  # a client gone early frees the samples still queued

  def _sse_stream(self, what: str, samples, queue, opening, on_tokens, on_done, usage):
    """The Server-Sent Events of a streamed OpenAI (chat) completion: opening() chunks, the
    samples' chunks as they progress, the usage() chunk (None: none), then [DONE]."""
    def formatted(chunks):
      return lambda *a: [_sse(c) for c in chunks(*a)]

    def closing():
      return ([] if usage is None else [_sse(usage())]) + ["data: [DONE]\n\n"]

    def on_error(message):
      return _sse({"error": {"message": message, "type": "server_error", "param": None,
                             "code": None}})

    return self._stream(what, samples, queue, formatted(opening), formatted(on_tokens),
                        formatted(on_done), closing, on_error)

  @staticmethod
  def _streaming(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})

  def _start_turn(self, prompt: Prompt, sampling: dict, session: Optional[str], stream: bool,
                  names: Optional[dict] = None):
    """Submits one sample of a rendered chat prompt (the Responses and Messages endpoints).

    Args:
      prompt: the rendered request.
      sampling: the sampling fields by their internal names (those of `sampling_params`).
      session: the session id, or None.
      stream: report the sample's progress to the returned queue.
      names: the request's own names of the sampling fields (e.g. {"max_tokens":
        "max_output_tokens"}), for the errors.

    Returns:
      (the _Sample, its queue or None, its SamplingParams, its _ChatReader).

    Raises:
      HTTPError: 400 naming the request's field and value.
    """
    try:
      room = self._room([len(prompt.input_ids)], None)
      params = sampling_params(sampling, room=room, capacity=self.engine.capacity,
                               vocab_size=self._vocab(), stop_token_ids=self.chat.stop_token_ids,
                               vllm=True)
    except HTTPError as e:
      new = (names or {}).get(e.param)
      if new is None:
        raise
      raise HTTPError(e.status, str(e).replace(e.param, new), new) from None
    params = dataclasses.replace(params, **prompt.constraint)
    self._reserve(session, [len(prompt.input_ids)], 1, params)
    samples, queue = self._samples([prompt.input_ids], 1, params, stream)
    return samples[0], queue, params, prompt.reader(self.chat, params.stop)
