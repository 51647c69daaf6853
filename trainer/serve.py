"""Token-in/token-out policy server: the generation engine behind Starlette under uvicorn.

    python -m trainer.serve --ckpt DIR [--host 127.0.0.1 --port 8000 --chat_format qwen2.5]
    python -m trainer.serve --preset tiny-dense          # random weights (tests, demos)

DIR is a checkpoint written by `python -m models.hf import` (its `hf_extra/` tokenizer files
enable the OpenAI endpoints, and its chat template renders them, as transformers and vLLM do,
unless --chat_format names a built-in format). Endpoints:

  POST /generate              {"input_ids", "max_tokens", "temperature", "top_p", "top_k",
                               "stop_token_ids", "stop", "seed"} -> {"output_ids", "logprobs",
                               "entropies" (per output token, nats), "finish_reason",
                               "policy_version", "token_versions", ...}
                              (the protocol of envs.policy.HTTPPolicy)
  POST /v1/chat/completions   OpenAI chat completions: messages (content as text or text parts,
                              the developer role as system) and tools rendered with envs.chat,
                              tool calls parsed; tool_choice (none | auto | required | a named
                              function), parallel_tool_calls, n, stop, seed, logprobs and
                              top_logprobs, chat_template_kwargs, stream (Server-Sent Events,
                              stream_options.include_usage)
  POST /v1/completions        OpenAI completions: prompt as text, texts, token ids or lists of
                              them; echo, logprobs (int), n, stop, max_tokens, stream
  GET  /v1/models[/{id}]      the served model
  GET  /v1/sessions/{id}      the session log; DELETE frees it
  GET  /health                status, policy version, engine counters

Sessions: a chat or completions request with "session_id" (body field or X-Session-Id header)
logs every sample's exact ids (the prompt as the engine saw it, a forced tool-call opening
included; the sampled ids) with their log-probs, policy versions and sampling parameters, for
training on what was served. Text is never re-tokenized: replies are decoded from those ids, and
stop strings are cut from the text only (the log keeps every sampled id).

Requests from all clients go to one engine queue and are decoded together; streamed replies
leave as the engine produces tokens (its `on_tokens` hook). The server binds to loopback by
default; any other address needs a bearer token (--token or ARBOR_SERVE_TOKEN), which every
endpoint but /health then requires. Bodies, connections and session logs are bounded; errors
are OpenAI error objects ({"error": {"message", "type", "param", "code"}}) and the server keeps
serving. Nothing is unpickled.

Against hostile clients (the front door of `envs.untrusted.door`, shared with the sandbox
server): a request's headers must be complete --header_timeout s after its connection opened (or
after the previous response), its body within --body_timeout s (408) and max_body_bytes (413);
beyond --max_connections open connections the oldest idle one is closed, those that never
carried a valid token first, so silent or dribbling sockets cannot lock real clients out; the
TLS handshake must finish within --handshake_timeout s. A body nested deeper than
max_json_depth is refused before it is parsed. Every number a request carries is checked: token
ids inside the vocabulary, max_tokens within the context, temperature a finite number in
[0, MAX_TEMPERATURE], top_p in (0, 1], top_k, n, seed, logprobs integers in range; anything else
is a 400 naming the field and value, before the engine sees it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import hmac
import inspect
import json
import logging
import math
import os
import re
import sys
import threading
import time
import uuid
from typing import Any, Optional, Sequence

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from envs.chat import load_chat, load_tokenizer, make_chat
from envs.net import check_bind, serve_in_thread
from envs.policy import Generation, SamplingParams, encode_expert_ids
from envs.untrusted.decode import TooDeep, loads
from envs.untrusted.door import ConnectionLimits, Door, RequestError
from models import hf, transformer
from models.engine import Engine, EngineConfig
from models.presets import get_preset
from trainer import config as config_lib
from trainer import harness

logger = logging.getLogger(__name__)

GENERATE_FIELDS = ("input_ids", "max_tokens", "temperature", "top_p", "top_k", "stop_token_ids",
                   "stop", "seed")
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}  # OpenAI role -> envs.chat role
# Fields whose non-default values would change what is sampled; refused rather than ignored.
UNSUPPORTED = {"presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
               "logit_bias": (None, {}), "suffix": (None, ""), "best_of": (None, 1)}
MAX_TEMPERATURE = 100.0        # hotter is uniform sampling for any model
MAX_TOP_K = 2**31 - 1          # the engine's int32 (any k >= the vocabulary is "off")
SEED_RANGE = (-2**63, 2**63 - 1)  # int64, as OpenAI's and vLLM's APIs take it


@dataclasses.dataclass(frozen=True)
class ServerConfig:
  """Address, auth and limits of a PolicyServer (each field's meaning beside it)."""
  host: str = "127.0.0.1"            # bind address; non-loopback needs `token`
  port: int = 8000                   # 0 = any free port
  token: Optional[str] = None        # bearer token required on every endpoint but /health
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


class HTTPError(Exception):
  """A request error answered with an HTTP status and an OpenAI error object.

  Args:
    status: the HTTP status code (4xx / 5xx).
    message: the error's text, sent to the client.
    param: the request field at fault (None: none in particular).
    code: a machine-readable code (e.g. "model_not_found"), or None.
  """

  def __init__(self, status: int, message: str, param: Optional[str] = None,
               code: Optional[str] = None):
    super().__init__(message)
    self.status, self.param, self.code = status, param, code


def error_response(status: int, message: str, param: Optional[str] = None,
                   code: Optional[str] = None) -> JSONResponse:
  """An OpenAI error object: {"error": {"message", "type", "param", "code"}}.

  Args:
    status: the HTTP status (the official client raises BadRequestError for 400,
      AuthenticationError for 401, NotFoundError for 404, ...).
    message: what went wrong, naming the field and value.
    param: the field at fault, or None.
    code: a machine-readable code, or None.

  Returns:
    The JSON response.
  """
  kind = "server_error" if status >= 500 else "invalid_request_error"
  return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                 "code": code}}, status_code=status)


def _param_of(message: str) -> Optional[str]:
  """The field an engine error names first ("max_tokens=9: ..." -> "max_tokens")."""
  m = re.match(r"([a-z_]+)[=:]", message)
  return m.group(1) if m else None


# ----------------------------------------------------------------------------- request checks


def _field(body: dict, name: str, kind, default=None):
  """body[name] of type `kind` (never a bool for a number); absent or null gives `default`."""
  value = body.get(name, default)
  if value is None:
    return default
  numeric = kind in (int, float, (int, float))
  ok = (isinstance(value, kind) and not isinstance(value, bool)) if numeric else isinstance(
      value, kind)
  if not ok:
    expected = getattr(kind, "__name__", "a number")
    raise HTTPError(400, f"{name}={value!r:.100}: expected {expected}", name)
  return value


def _integer(body: dict, name: str, default: Optional[int], low: int, high: int,
             why: str = "") -> Optional[int]:
  """body[name], an integer in [low, high] (400 naming the field and value otherwise)."""
  value = _field(body, name, int, default)
  if value is not None and not low <= value <= high:
    raise HTTPError(400, f"{name}={value!r:.100}: must be an integer in [{low}, {high}]{why}",
                    name)
  return value


def _real(body: dict, name: str, default: float, low: float, high: float,
          open_low: bool = False) -> float:
  """body[name], a finite number in [low, high] ((low, high] with `open_low`): never inf or
  nan (JSON's 1e400, Infinity, NaN), never an integer too large for a float."""
  value = _field(body, name, (int, float), default)
  try:
    x = float(value)
  except OverflowError:  # an integer beyond float range
    x = math.inf if value > 0 else -math.inf
  if not (math.isfinite(x) and (low < x if open_low else low <= x) and x <= high):
    raise HTTPError(400, f"{name}={value!r:.100}: must be a finite number in "
                         f"{'(' if open_low else '['}{low:g}, {high:g}]", name)
  return x


def _is_ids(value) -> bool:
  return isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool)
                                         for x in value)


def check_token_ids(value: Any, name: str, vocab_size: int, param: Optional[str] = None,
                    empty: bool = True) -> list[int]:
  """A list of token ids of the vocabulary [0, vocab_size).

  Args:
    value: what the request gave.
    name: how the message names it (e.g. "prompt[2]").
    vocab_size: ids must be below this.
    param: the error's field (default `name`).
    empty: whether an empty list is accepted.

  Returns:
    The ids.

  Raises:
    HTTPError: 400 naming the field and the first bad id.
  """
  param = param or name
  if not _is_ids(value):
    raise HTTPError(400, f"{name}: expected a list of integers", param)
  if not value and not empty:
    raise HTTPError(400, f"{name}: expected at least one token id", param)
  for i, t in enumerate(value):
    if not 0 <= t < vocab_size:
      raise HTTPError(400, f"{name}[{i}]: token id {t!r:.100} is outside the vocabulary "
                           f"[0, {vocab_size})", param)
  return value


def _stop_strings(body: dict) -> tuple[str, ...]:
  stop = body.get("stop")
  if stop is None:
    return ()
  if isinstance(stop, str):
    stop = [stop]
  if (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
      or len(stop) > 16):
    raise HTTPError(400, f"stop={stop!r:.100}: expected up to 16 non-empty strings", "stop")
  return tuple(stop)


def sampling_params(body: dict, *, room: int, capacity: int, vocab_size: int,
                    max_tokens: Optional[int] = None, stop_token_ids: Sequence[int] = ()):
  """Builds engine SamplingParams from a request body, every number checked.

  Args:
    body: the request's JSON object (fields of GENERATE_FIELDS; absent ones take defaults:
      max_tokens `max_tokens`, temperature 1, top_p 1, top_k 0, no stop, no seed).
    room: the most new tokens the context has room for (>= 1): the engine's capacity less
      the prompt.
    capacity: the engine's max_seq_len (for the message).
    vocab_size: stop_token_ids must be below this.
    max_tokens: the default when the body has none (None: `room`).
    stop_token_ids: stop tokens added to the body's (e.g. the chat format's end of turn).

  Returns:
    The SamplingParams.

  Raises:
    HTTPError: 400 naming the field and value: a field of the wrong type, max_tokens outside
      [1, room], temperature outside [0, MAX_TEMPERATURE] or not finite, top_p outside (0, 1],
      top_k outside [0, MAX_TOP_K], a seed outside int64, a stop token id outside the
      vocabulary, or a bad "stop".
  """
  return SamplingParams(
      max_tokens=_integer(body, "max_tokens", room if max_tokens is None else max_tokens, 1,
                          room, f" (the prompt's {capacity - room} tokens + max_tokens fit "
                          f"the engine's max_seq_len={capacity})"),
      temperature=_real(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE),
      top_p=_real(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
      top_k=_integer(body, "top_k", 0, 0, MAX_TOP_K),
      stop_token_ids=tuple(dict.fromkeys(list(stop_token_ids) + check_token_ids(
          body.get("stop_token_ids", []) or [], "stop_token_ids", vocab_size))),
      stop=_stop_strings(body),
      seed=_integer(body, "seed", None, *SEED_RANGE))


def normalize_messages(messages: Any) -> list[dict]:
  """OpenAI chat messages in the shape envs.chat formats render.

  Content given as a list of parts keeps its text parts, joined by "\\n" (as vLLM does); the
  developer role is the system role. What chat templates read is kept: name, tool_call_id,
  an assistant message's tool calls (id, name, arguments as given) and its reasoning
  ("reasoning_content" or "reasoning"); other fields (refusal, audio, ...) are dropped.

  Args:
    messages: the request's "messages".

  Returns:
    The messages, ready for `ChatFormat.render`.

  Raises:
    HTTPError: 400 naming the message and field: not a non-empty list of objects, an unknown
      role, a non-text content part, or a malformed tool call.
  """
  if not isinstance(messages, list) or not messages:
    raise HTTPError(400, "messages: expected a non-empty list", "messages")
  out = []
  for i, m in enumerate(messages):
    where = f"messages[{i}]"
    if not isinstance(m, dict):
      raise HTTPError(400, f"{where}={m!r:.100}: expected an object", where)
    role = ROLES.get(m.get("role"))
    if role is None:
      raise HTTPError(400, f"{where}.role={m.get('role')!r:.50}: expected one of "
                           f"{', '.join(ROLES)}", f"{where}.role")
    content = m.get("content")
    if isinstance(content, list):
      texts = []
      for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
          raise HTTPError(400, f"{where}.content[{j}]: content part type {kind!r:.50} is not "
                               "supported (only text parts)", f"{where}.content[{j}].type")
        texts.append(part["text"])
      content = "\n".join(texts)
    if not (isinstance(content, str) or (content is None and role == "assistant")):
      raise HTTPError(400, f"{where}.content={content!r:.100}: expected a string or a list of "
                           "text parts", f"{where}.content")
    message = {"role": role, "content": content}
    # what templates may read (the hand-written formats ignore them)
    message.update({k: m[k] for k in ("name", "tool_call_id") if isinstance(m.get(k), str)})
    reasoning = m.get("reasoning_content", m.get("reasoning"))
    if role == "assistant" and isinstance(reasoning, str):
      message["reasoning_content"] = reasoning
    calls = m.get("tool_calls")
    if calls and role == "assistant":
      if not isinstance(calls, list):
        raise HTTPError(400, f"{where}.tool_calls: expected a list", f"{where}.tool_calls")
      message["tool_calls"] = []
      for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(
            fn.get("arguments", "{}"), (str, dict)):
          raise HTTPError(400, f"{where}.tool_calls[{j}]={call!r:.100}: expected "
                               '{"function": {"name": str, "arguments": str}}',
                          f"{where}.tool_calls[{j}]")
        message["tool_calls"].append({
            "type": "function", **({"id": call["id"]} if isinstance(call.get("id"), str) else {}),
            "function": {"name": fn["name"], "arguments": fn.get("arguments", "{}")}})
    out.append(message)
  return out


def _tools(body: dict) -> Optional[list[dict]]:
  tools = body.get("tools")
  if tools is None:
    return None
  if not isinstance(tools, list):
    raise HTTPError(400, "tools: expected a list", "tools")
  for i, t in enumerate(tools):
    fn = t.get("function") if isinstance(t, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
      raise HTTPError(400, f"tools[{i}]={t!r:.100}: expected "
                           '{"type": "function", "function": {"name": ..., "parameters": ...}}',
                      f"tools[{i}]")
  return tools or None


def _tool_choice(body: dict, tools: Optional[list[dict]]) -> tuple[str, Optional[str]]:
  """(mode, function name): mode "none" | "auto" | "required" | "named"."""
  choice = body.get("tool_choice")
  if choice is None:
    return ("auto" if tools else "none"), None
  if choice in ("none", "auto", "required"):
    mode, name = choice, None
  elif (isinstance(choice, dict) and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)):
    mode, name = "named", choice["function"]["name"]
  else:
    raise HTTPError(400, f"tool_choice={choice!r:.100}: expected \"none\", \"auto\", "
                         '"required" or {"type": "function", "function": {"name": ...}}',
                    "tool_choice")
  if mode in ("required", "named") and not tools:
    raise HTTPError(400, f"tool_choice={choice!r:.100}: needs tools", "tool_choice")
  names = [t["function"]["name"] for t in tools or ()]
  if mode == "named" and name not in names:
    raise HTTPError(400, f"tool_choice names function {name!r}, which is not in tools "
                         f"({', '.join(names)})", "tool_choice")
  return mode, name


def _refuse_unsupported(body: dict) -> None:
  for name, defaults in UNSUPPORTED.items():
    if body.get(name) not in defaults:
      raise HTTPError(400, f"{name}={body[name]!r:.100}: not supported by this server", name)
  fmt = body.get("response_format")
  if fmt is not None and fmt != {"type": "text"}:
    raise HTTPError(400, f"response_format={fmt!r:.100}: only {{\"type\": \"text\"}} is "
                         "supported", "response_format")


# ----------------------------------------------------------------------------- text of samples


def _cut_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
  """The text before its first stop string, and whether one was found."""
  found = [i for i in (text.find(s) for s in stops) if i >= 0]
  return (text[:min(found)], True) if found else (text, False)


def _settled(text: str, stops: Sequence[str], markers: Sequence[str] = ()) -> str:
  """The part of a growing text that more tokens cannot change.

  It holds back an incomplete UTF-8 tail (decoded as U+FFFD), the last len(longest stop) - 1
  characters (a stop string may be starting there), and a tail that may be the start of a
  marker (a tool-call opening or a reasoning tag, which the parse would take out of the text).
  """
  text, found = _cut_stop(text, stops)
  if stops and not found:
    text = text[:max(0, len(text) - max(map(len, stops)) + 1)]
  text = text.rstrip("\ufffd")
  hold = max((k for m in markers for k in range(1, min(len(m), len(text) + 1))
              if text.endswith(m[:k])), default=0)
  return text[:len(text) - hold]


class _TextDeltas:
  """Deltas of a growing text, such that their concatenation is the final text."""

  def __init__(self):
    self.sent = ""

  def delta(self, text: str) -> str:
    """The new suffix of `text` (empty if it does not extend what was sent)."""
    if len(text) <= len(self.sent) or not text.startswith(self.sent):
      return ""
    new, self.sent = text[len(self.sent):], text
    return new

  def final(self, text: str) -> Optional[str]:
    """The rest of the final text; None if it does not extend what was sent."""
    if not text.startswith(self.sent):
      return None
    new, self.sent = text[len(self.sent):], text
    return new


class _ChatReader:
  """Reads one chat request's samples back: reasoning, content and tool calls, final or so far.

  A sample still being generated is read as its final form would begin: its parse only grows
  as tokens arrive, once the tails that more tokens could change are held back (see
  `_settled`; trailing whitespace too, which the final content strips).

  Args:
    chat: the envs.chat format.
    tools: the request's tools (None: none).
    mode: the tool_choice mode ("none": no calls are parsed).
    parallel: parallel_tool_calls (False: only the first call is kept).
    prefix: the forced tool-call opening appended to the prompt ([] when none).
    stops: the request's stop strings.
    opening: the format's tool-call opening (`tool_call_prefix_ids(None)`).
  """

  def __init__(self, chat, tools, mode: str, parallel: bool, prefix: list[int],
               stops: Sequence[str], opening: list[int]):
    self.chat, self.tools, self.mode, self.parallel = chat, tools, mode, parallel
    self.prefix, self.stops = prefix, stops
    # The lines of a tool-call opening (e.g. "<tool_call>") and reasoning tags.
    lines = [] if mode == "none" else chat.tokenizer.decode(opening).split("\n")
    self.markers = [m for m in map(str.strip, lines + ["<think>", "</think>"]) if m]

  def read(self, output_ids: Sequence[int], final: bool = True):
    """(reasoning or None, content, well-formed calls, errors of malformed calls).

    Args:
      output_ids: the sampled ids so far.
      final: the sample is finished; False: hold back what more tokens could change.
    """
    turn = self.chat.parse_assistant(self.prefix + list(output_ids), self.tools)
    reasoning = turn.reasoning_content
    if self.mode == "none":  # the text as written (tool calls not parsed)
      content = turn.text.strip() if reasoning is None else turn.content
      calls, errors = [], []
    else:
      content, errors = turn.content, turn.errors
      calls = turn.valid_calls if self.parallel else turn.valid_calls[:1]
    if final:
      return reasoning, _cut_stop(content, self.stops)[0], calls, errors
    return (None if reasoning is None else _settled(reasoning, (), self.markers).rstrip(),
            _settled(content, self.stops, self.markers).rstrip(), calls, errors)


def _call_id(call=None) -> str:
  """A unique id for a tool call; the model's own id where its format writes one (Kimi K2's
  "functions.NAME:0", which its template shows again with the result), not the parser's
  positional "call_0"."""
  if call is not None and call.id and not re.fullmatch(r"call_\d+", call.id):
    return call.id
  return "call_" + uuid.uuid4().hex[:24]


def _call_json(call, call_id: str) -> dict:
  return {"id": call_id, "type": "function",
          "function": {"name": call.name,
                       "arguments": json.dumps(call.arguments, ensure_ascii=False)}}


def _finish_reason(engine_reason: str, calls: list) -> str:
  return "length" if engine_reason == "length" else ("tool_calls" if calls else "stop")


def _sse(data: Any) -> str:
  return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _post(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item) -> None:
  """Hands an engine-thread event to the event loop (dropped once the loop is closed)."""
  try:
    loop.call_soon_threadsafe(queue.put_nowait, item)
  except RuntimeError:
    pass


# ----------------------------------------------------------------------------- session log


class SessionLog:
  """Exact ids and log-probs of each call, per session id, bounded in size.

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
                           f"add {tokens}, over the limit of {self.max_session_tokens}",
                      "session_id")

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
        raise HTTPError(404, f"unknown session {session!r}", "session_id")
      return list(self._sessions[session])

  def delete(self, session: str) -> None:
    """Frees a session's log (HTTPError 404 for an unknown session)."""
    with self._lock:
      if self._sessions.pop(session, None) is None:
        raise HTTPError(404, f"unknown session {session!r}", "session_id")
      self._tokens.pop(session)


# ----------------------------------------------------------------------------- server


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


class PolicyServer:
  """HTTP front of an `models.engine.Engine` (see module docstring).

  Args:
    engine: the generation engine (started by `start_in_thread` / `serve_forever`, stopped by
      `stop`).
    config: address, token and limits.
    tokenizer: decodes tokens for the OpenAI endpoints (None: /generate only).
    chat: the envs.chat format of /v1/chat/completions (None: that endpoint answers 400).

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
  async def _on_error(self, request: Request, e: HTTPError) -> Response:
    response = error_response(e.status, str(e), e.param, e.code)
    if e.status in (401, 408, 413):  # a body left unread, or a client not to keep
      response.headers["Connection"] = "close"
    return response

  async def _on_http_exception(self, request: Request, e: HTTPException) -> Response:
    where = f"{request.method} {request.url.path}"
    if e.status_code == 404:
      return error_response(404, f"no endpoint {where}")
    if e.status_code == 405:
      return error_response(405, f"{where}: use {(e.headers or {}).get('Allow', '')}")
    return error_response(e.status_code, f"{where}: {e.detail}")

  async def _on_crash(self, request: Request, e: Exception) -> Response:
    logger.error("request %s %s failed: %r", request.method, request.url.path, e)
    return error_response(500, f"{type(e).__name__}: {e}")

  def _authorize(self, request: Request) -> None:
    """Checks the bearer token (if the server has one); its connection is then one of a real
    client's, closed last when connections run out."""
    if self.cfg.token:
      given = request.headers.get("authorization", "")
      if not given.startswith("Bearer ") or not hmac.compare_digest(
          given[len("Bearer "):].encode(), self.cfg.token.encode()):
        raise HTTPError(401, "missing or wrong bearer token (Authorization: Bearer <token>)",
                        code="invalid_api_key")
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

  def _log(self, session: Optional[str], sample: _Sample, out, extra: dict) -> None:
    if session is None:
      return
    p = sample.params
    self.sessions.add(session, {
        "input_ids": list(sample.input_ids), "output_ids": out.output_ids,
        "logprobs": out.logprobs, "token_versions": out.token_versions,
        "policy_version": out.policy_version, "finish_reason": out.finish_reason,
        "params": {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k,
                   "max_tokens": p.max_tokens, "stop": list(p.stop),
                   "stop_token_ids": list(p.stop_token_ids), "seed": p.seed, **extra},
        "time": time.time()})

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
    unknown = sorted(set(body) - set(GENERATE_FIELDS))
    if unknown:
      raise HTTPError(400, f"unknown fields {unknown}; expected {list(GENERATE_FIELDS)}",
                      unknown[0])
    if "input_ids" not in body:
      raise HTTPError(400, "input_ids: required", "input_ids")
    input_ids = check_token_ids(body["input_ids"], "input_ids", self._vocab(), empty=False)
    room = self._room([len(input_ids)], "input_ids")
    # default: 256 new tokens, or what the cache row has room for
    params = sampling_params(body, room=room, capacity=self.engine.capacity,
                             vocab_size=self._vocab(), max_tokens=min(256, room))
    out = await asyncio.wrap_future(self._submit(input_ids, params))
    reply = {"output_ids": out.output_ids, "logprobs": out.logprobs, "entropies": out.entropies,
             "finish_reason": out.finish_reason, "policy_version": out.policy_version,
             "token_versions": out.token_versions, "cached_tokens": out.cached_tokens}
    if out.top_logprobs is not None:
      reply["top_logprobs"] = out.top_logprobs
    if out.expert_ids is not None:
      reply["expert_ids"] = encode_expert_ids(out.expert_ids)
    return JSONResponse(reply)

  def _common(self, body: dict, prompt_lens: list[int], n_prompts: int, stop_token_ids):
    """Checks the fields chat and completions share; returns (n, params, stream, usage)."""
    _refuse_unsupported(body)
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
                             stop_token_ids=stop_token_ids)
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

  # --- chat completions
  async def _chat(self, request: Request) -> Response:
    body = await self._body(request)
    if self.chat is None:
      raise HTTPError(400, "no tokenizer/chat format loaded: use /generate, or start the server "
                           "with a checkpoint that has tokenizer files (or --tokenizer)")
    self._check_model(body)
    messages = normalize_messages(body.get("messages"))
    tools = _tools(body)
    mode, name = _tool_choice(body, tools)
    parallel = _field(body, "parallel_tool_calls", bool, True)
    session = self._session_id(body, request)
    want_logprobs = _field(body, "logprobs", bool, False)
    top_n = _integer(body, "top_logprobs", 0, 0, self._top_limit(),
                     f" (at most {self._top_limit()} on this server: its --top_logprobs)")
    if top_n and not want_logprobs:
      raise HTTPError(400, f"top_logprobs={top_n}: needs logprobs=true", "top_logprobs")
    template_kwargs = _field(body, "chat_template_kwargs", dict, None)
    kwargs = {}
    if template_kwargs:
      if "template_kwargs" not in inspect.signature(self.chat.render).parameters:
        raise HTTPError(400, f"chat_template_kwargs={template_kwargs!r:.100}: this chat format "
                             f"({self.chat.name}) takes no template kwargs",
                        "chat_template_kwargs")
      kwargs["template_kwargs"] = template_kwargs
    # The forced opening is written as after this prompt (e.g. with thinking off).
    opening_kwargs = kwargs if "template_kwargs" in inspect.signature(
        self.chat.tool_call_prefix_ids).parameters else {}
    try:
      rendered = self.chat.render(messages, None if mode == "none" else tools,
                                  add_generation_prompt=True, **kwargs).ids
    except (ValueError, KeyError, TypeError) as e:
      param = "chat_template_kwargs" if kwargs and "template kwargs" in str(e) else "messages"
      raise HTTPError(400, f"{param}: {e}", param) from None
    try:
      opening = [] if mode == "none" else self.chat.tool_call_prefix_ids(None, **opening_kwargs)
    except ValueError as e:  # a template that writes no tool calls cannot be forced into one
      if mode in ("required", "named"):
        raise HTTPError(400, f"tool_choice: {e}", "tool_choice") from None
      opening = []
    prefix = opening if mode == "required" else []  # the forced opening, part of the prompt
    if mode == "named":
      prefix = self.chat.tool_call_prefix_ids(name, **opening_kwargs)
    input_ids = rendered + prefix
    n, params, stream, include_usage = self._common(body, [len(input_ids)], 1,
                                                    self.chat.stop_token_ids)
    self._reserve(session, [len(input_ids)], n, params)
    reader = _ChatReader(self.chat, tools, mode, parallel, prefix, params.stop, opening)
    samples, queue = self._samples([input_ids], n, params, stream)
    logged = {"n": n, "tool_choice": body.get("tool_choice", mode)}
    logprobs = top_n if want_logprobs else None
    if stream:
      return StreamingResponse(self._chat_stream(samples, queue, reader, session, logged,
                                                 logprobs, include_usage),
                               media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
    outs = await asyncio.gather(*(asyncio.wrap_future(s.future) for s in samples))
    choices = []
    for i, (sample, out) in enumerate(zip(samples, outs)):
      reasoning, content, calls, errors = reader.read(out.output_ids)
      message = {"role": "assistant", "content": content or None}
      if reasoning is not None:
        message["reasoning_content"] = reasoning
      if calls:
        message["tool_calls"] = [_call_json(c, _call_id(c)) for c in calls]
      choice = {"index": i, "message": message, "logprobs": None,
                "finish_reason": _finish_reason(out.finish_reason, calls)}
      if logprobs is not None:
        choice["logprobs"] = {"content": self._chat_logprobs(out.output_ids, out.logprobs,
                                                             out.top_logprobs, logprobs)}
      if errors:
        choice["tool_call_errors"] = errors
      choices.append(choice)
      self._log(session, sample, out, logged)
    reply = {**self._head("chat.completion"), "choices": choices,
             "usage": _usage([len(input_ids)], outs)}
    if session is not None:
      reply["session_id"] = session
    return JSONResponse(reply)

  def _chat_logprobs(self, ids, lps, top, top_n: int, start: int = 0) -> list[dict]:
    dec = self.tokenizer.decode
    return [{"token": dec([ids[k]]), "logprob": lps[k],
             "top_logprobs": [{"token": dec([j]), "logprob": v}
                              for j, v in (top[k][:top_n] if top_n else [])]}
            for k in range(start, len(ids))]

  async def _sse_stream(self, what: str, samples, queue, opening, on_tokens, on_done, usage):
    """The Server-Sent Events of a streamed reply: opening() chunks, the samples' chunks as they
    progress (`_events`), the usage() chunk (None: none), then [DONE]; an error after the
    status line is sent becomes an error event."""
    try:
      for c in opening():
        yield _sse(c)
      async for chunks in self._events(samples, queue, on_tokens, on_done):
        for c in chunks:
          yield _sse(c)
      if usage is not None:
        yield _sse(usage())
      yield "data: [DONE]\n\n"
    except Exception as e:  # the status line is sent: report the error as an event
      logger.exception("%s stream failed", what)
      yield _sse({"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error",
                            "param": None, "code": None}})
    finally:
      for s in samples:
        s.future.cancel()  # a client gone early frees the samples still queued

  async def _chat_stream(self, samples, queue, reader: _ChatReader, session, logged,
                         logprobs: Optional[int], include_usage: bool):
    head = self._head("chat.completion.chunk")
    texts = [_TextDeltas() for _ in samples]
    thoughts = [_TextDeltas() for _ in samples]
    call_ids: list[list[str]] = [[] for _ in samples]  # ids of the calls sent, per choice
    reported = [0] * len(samples)                       # tokens whose log-probs were sent
    outs = []

    def chunk(k, delta, reason=None):
      choice = {"index": k, "delta": delta, "logprobs": None, "finish_reason": reason}
      return {**head, "choices": [choice], **({"usage": None} if include_usage else {})}

    def deltas(k, reasoning: str, content: str, calls: list) -> list[dict]:
      """Chunks of new reasoning, new content and the calls not sent yet."""
      out = [chunk(k, {"reasoning_content": reasoning})] if reasoning else []
      out += [chunk(k, {"content": content})] if content else []
      for c in calls[len(call_ids[k]):]:
        index, cid = len(call_ids[k]), _call_id(c)
        call_ids[k].append(cid)
        args = _call_json(c, cid)["function"]["arguments"]
        out.append(chunk(k, {"tool_calls": [{"index": index, "id": cid, "type": "function",
                                             "function": {"name": c.name, "arguments": ""}}]}))
        out += [chunk(k, {"tool_calls": [{"index": index, "function": {"arguments": part}}]})
                for part in _fragments(args)]
      return out

    def with_logprobs(chunks, k, ids, lps, top) -> list[dict]:
      """The last chunk carries the log-probs of the tokens not reported yet."""
      if chunks and logprobs is not None and len(ids) > reported[k]:
        chunks[-1]["choices"][0]["logprobs"] = {
            "content": self._chat_logprobs(ids, lps, top, logprobs, reported[k])}
        reported[k] = len(ids)
      return chunks

    def on_tokens(k, ids, lps, top):
      reasoning, content, calls, _ = reader.read(ids, final=False)
      chunks = deltas(k, thoughts[k].delta(reasoning or ""), texts[k].delta(content), calls)
      return with_logprobs(chunks, k, ids, lps, top)

    def on_done(k, out):
      outs.append(out)
      self._log(session, samples[k], out, logged)
      reasoning, content, calls, _ = reader.read(out.output_ids)
      more, rest = thoughts[k].final(reasoning or ""), texts[k].final(content)
      if more is None or rest is None:
        raise RuntimeError("the sample's text changed after part of it was streamed (e.g. the "
                           "engine restarted it on new weights)")
      chunks = deltas(k, more, rest, calls) + [
          chunk(k, {}, _finish_reason(out.finish_reason, calls))]
      return with_logprobs(chunks, k, out.output_ids, out.logprobs, out.top_logprobs)

    def opening():
      return [chunk(k, {"role": "assistant", "content": ""}) for k in range(len(samples))]

    def usage():
      return {**head, "choices": [], "usage": _usage([len(samples[0].input_ids)], outs)}

    async for event in self._sse_stream("chat", samples, queue, opening, on_tokens, on_done,
                                        usage if include_usage else None):
      yield event

  # --- completions
  async def _completions(self, request: Request) -> Response:
    body = await self._body(request)
    if self.tokenizer is None:
      raise HTTPError(400, "no tokenizer loaded: use /generate, or start the server with a "
                           "checkpoint that has tokenizer files (or --tokenizer)")
    self._check_model(body)
    prompts, texts = self._prompts(body.get("prompt"))
    session = self._session_id(body, request)
    echo = _field(body, "echo", bool, False)
    top_n = _integer(body, "logprobs", None, 0, self._top_limit(),
                     f" (at most {self._top_limit()} on this server: its --top_logprobs)")
    if echo and top_n is not None:
      raise HTTPError(400, "echo with logprobs: the prompt's log-probs are not computed by "
                           "this server; ask without echo", "echo")
    eos = [] if self.tokenizer.eos_id is None else [self.tokenizer.eos_id]
    n, params, stream, include_usage = self._common(body, [len(p) for p in prompts],
                                                    len(prompts), eos)
    self._reserve(session, [len(p) for p in prompts], n, params)
    samples, queue = self._samples(prompts, n, params, stream, "prompt")
    logged = {"n": n, "tool_choice": None}
    echoed = [texts[s.prompt] if echo else "" for s in samples]

    def text(ids):
      ids = ids[:-1] if ids and ids[-1] in params.stop_token_ids else ids
      return self.tokenizer.decode(ids)

    if stream:
      return StreamingResponse(self._completion_stream(samples, queue, text, echoed, session,
                                                       logged, top_n, include_usage),
                               media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
    outs = await asyncio.gather(*(asyncio.wrap_future(s.future) for s in samples))
    choices = []
    for i, (sample, out) in enumerate(zip(samples, outs)):
      choice = {"index": i, "text": echoed[i] + _cut_stop(text(out.output_ids), params.stop)[0],
                "logprobs": None, "finish_reason": out.finish_reason}
      if top_n is not None:
        choice["logprobs"] = self._legacy_logprobs(out.output_ids, out.logprobs,
                                                   out.top_logprobs, top_n, 0, 0)
      choices.append(choice)
      self._log(session, sample, out, logged)
    reply = {**self._head("text_completion"), "choices": choices,
             "usage": _usage([len(p) for p in prompts], outs)}
    if session is not None:
      reply["session_id"] = session
    return JSONResponse(reply)

  def _prompts(self, prompt) -> tuple[list[list[int]], list[str]]:
    """A completions "prompt" as token ids and text, one per prompt."""
    single = isinstance(prompt, str) or _is_ids(prompt)
    if single:
      prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(
        isinstance(p, str) or _is_ids(p) for p in prompt):
      raise HTTPError(400, f"prompt={prompt!r:.100}: expected a string, a list of strings, a "
                           "list of token ids or a list of such lists", "prompt")
    for k, p in enumerate(prompt):
      if not isinstance(p, str):
        check_token_ids(p, "prompt" if single else f"prompt[{k}]", self._vocab(decoded=True),
                        "prompt")
    ids = [self.tokenizer.encode(p) if isinstance(p, str) else p for p in prompt]
    if not all(ids):
      raise HTTPError(400, "prompt: an empty prompt has no token to continue", "prompt")
    return ids, [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompt]

  def _legacy_logprobs(self, ids, lps, top, top_n: int, start: int, offset: int) -> dict:
    """Completions log-probs of ids[start:]: tokens, their log-probs, the top_n alternatives
    (the sampled token always among them) and each token's character offset."""
    dec = self.tokenizer.decode
    tokens, offsets, tops = [], [], []
    for k in range(start, len(ids)):
      token = dec([ids[k]])
      alternatives: dict[str, float] = {}
      for j, v in (top[k][:top_n] if top_n else []):
        alternatives.setdefault(dec([j]), v)  # ids that decode alike: the likelier one
      alternatives.setdefault(token, lps[k])
      tokens.append(token)
      offsets.append(offset)
      tops.append(alternatives)
      offset += len(token)
    return {"tokens": tokens, "token_logprobs": list(lps[start:]), "top_logprobs": tops,
            "text_offset": offsets}

  async def _completion_stream(self, samples, queue, text, echoed, session, logged,
                               top_n: Optional[int], include_usage: bool):
    head = self._head("text_completion")
    stops = samples[0].params.stop
    texts = [_TextDeltas() for _ in samples]
    reported, offsets, outs = [0] * len(samples), [len(e) for e in echoed], []

    def chunk(k, new, ids=None, lps=None, top=None, reason=None):
      choice = {"index": k, "text": new, "logprobs": None, "finish_reason": reason}
      if top_n is not None and ids is not None and len(ids) > reported[k]:
        choice["logprobs"] = lp = self._legacy_logprobs(ids, lps, top, top_n, reported[k],
                                                        offsets[k])
        reported[k] = len(ids)
        offsets[k] = lp["text_offset"][-1] + len(lp["tokens"][-1])
      return {**head, "choices": [choice], **({"usage": None} if include_usage else {})}

    def on_tokens(k, ids, lps, top):
      new = texts[k].delta(echoed[k] + _settled(text(ids), stops))
      return [chunk(k, new, ids, lps, top)] if new else []

    def on_done(k, out):
      outs.append(out)
      self._log(session, samples[k], out, logged)
      rest = texts[k].final(echoed[k] + _cut_stop(text(out.output_ids), stops)[0])
      if rest is None:
        raise RuntimeError("the sample's text changed after it was streamed (the engine "
                           "restarted it on new weights)")
      return [chunk(k, rest, out.output_ids, out.logprobs, out.top_logprobs,
                    out.finish_reason)]

    def opening():
      return [chunk(k, texts[k].delta(e)) for k, e in enumerate(echoed) if e]

    def usage():
      prompts = {s.prompt: len(s.input_ids) for s in samples}
      return {**head, "choices": [], "usage": _usage(list(prompts.values()), outs)}

    async for event in self._sse_stream("completion", samples, queue, opening, on_tokens,
                                        on_done, usage if include_usage else None):
      yield event


def _usage(prompt_lens: list[int], outs) -> dict:
  prompt, completion = sum(prompt_lens), sum(len(o.output_ids) for o in outs)
  return {"prompt_tokens": prompt, "completion_tokens": completion,
          "total_tokens": prompt + completion}


def _fragments(text: str, size: int = 16) -> list[str]:
  """A tool call's arguments in pieces, as OpenAI streams them."""
  return [text[i:i + size] for i in range(0, len(text), size)] or [""]


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
      The envs.policy.Generation: output ids, log-probs, per-token entropies, finish reason,
      policy versions and (an engine with return_expert_ids) the experts of every position.
    """
    out = await asyncio.wrap_future(self.engine.submit(list(input_ids), params))
    return Generation(output_ids=out.output_ids, logprobs=out.logprobs,
                      finish_reason=out.finish_reason, policy_version=out.policy_version,
                      token_versions=out.token_versions, expert_ids=out.expert_ids,
                      entropies=out.entropies)


# ----------------------------------------------------------------------------- CLI


def default_chat_format(model_cfg) -> str:
  """The chat format of a model family: "deepseek_v3" for MLA models, else "qwen2.5"."""
  return "deepseek_v3" if model_cfg.attention == "mla" else "qwen2.5"


def checkpoint_chat(tokenizer_path: str, tokenizer, chat_format: Optional[str], model_cfg):
  """The chat format the CLI serves with.

  Args:
    tokenizer_path: the tokenizer directory or file.
    tokenizer: the tokenizer loaded from it.
    chat_format: a built-in format name (--chat_format), or None.
    model_cfg: the served model's config (its family picks the fallback format).

  Returns:
    The named built-in format; with no name, the checkpoint's own chat template (as
    transformers and vLLM use it), else `default_chat_format(model_cfg)`.
  """
  if chat_format:
    return make_chat(chat_format, tokenizer)
  return load_chat(tokenizer_path, tokenizer, name=default_chat_format(model_cfg))


def build(args) -> PolicyServer:
  """Builds the model, tokenizer, engine and server from parsed command-line arguments.

  Args:
    args: the `parse_args` namespace.

  Returns:
    The PolicyServer, not yet started; without tokenizer files it serves /generate only.

  Raises:
    ValueError: a non-loopback host without a token, a connection limit that is not positive,
      or a tokenizer with ids beyond the model's vocabulary.
  """
  token = args.token or os.environ.get("ARBOR_SERVE_TOKEN") or None
  check_bind(args.host, token)  # before loading anything
  for name in ("max_connections", "header_timeout", "body_timeout", "handshake_timeout"):
    if not getattr(args, name) > 0:
      raise ValueError(f"--{name}={getattr(args, name)}: expected > 0")
  if args.ckpt:
    model = hf.restore(args.ckpt)
  else:
    model = transformer.init(get_preset(args.preset), seed=args.seed)
  tokenizer = chat = None
  tok_path = args.tokenizer or (os.path.join(args.ckpt, "hf_extra") if args.ckpt else None)
  if tok_path and (args.tokenizer or any(os.path.exists(os.path.join(tok_path, f)) for f in (
      "tokenizer.json", "tiktoken.model", "tokenizer.model"))):
    tokenizer = load_tokenizer(tok_path)
    check_vocab(tokenizer, model.cfg.vocab_size)
    chat = checkpoint_chat(tok_path, tokenizer, args.chat_format, model.cfg)
  engine = Engine(model, EngineConfig(
      slots=args.slots, max_seq_len=args.max_seq_len, prefix_cache_rows=args.prefix_cache_rows,
      steps_per_call=args.steps_per_call, prefill_chunk=args.prefill_chunk,
      top_logprobs=args.top_logprobs, on_update=args.on_update),
      detokenize=None if tokenizer is None else tokenizer.decode)
  return PolicyServer(engine, ServerConfig(
      host=args.host, port=args.port, token=token, served_name=args.served_name,
      top_logprobs=args.top_logprobs, max_connections=args.max_connections,
      header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
      handshake_timeout_s=args.handshake_timeout, ssl_certfile=args.ssl_certfile,
      ssl_keyfile=args.ssl_keyfile),
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
    ValueError: a non-loopback host without a token (ARBOR_SERVE_TOKEN), or a tokenizer with
      ids beyond the model's vocabulary.
  """
  token = os.environ.get("ARBOR_SERVE_TOKEN") or None
  check_bind(config.serve.host, token)
  model_cfg = config_lib.model_config(config)
  chat = config_lib.make_chat_format(config, config_lib.tokenizer_source(config, workdir))
  tokenizer = chat.tokenizer
  check_vocab(tokenizer, model_cfg.vocab_size)
  model = (harness.initial_model(config, model_cfg)
           or transformer.init(model_cfg, seed=config.seed))
  top_logprobs = config.serve.top_logprobs
  engine = Engine(model, EngineConfig(slots=config.serve.slots,
                                      max_seq_len=config.serve.max_seq_len,
                                      prefix_cache_rows=config.serve.slots, seed=config.seed,
                                      top_logprobs=top_logprobs),
                  detokenize=tokenizer.decode)
  server = PolicyServer(engine, ServerConfig(host=config.serve.host, port=config.serve.port,
                                             token=token, served_name=config.serve.served_name,
                                             top_logprobs=top_logprobs),
                        tokenizer=tokenizer, chat=chat)
  print(f"serve: {config.model.init} on http://{config.serve.host}:{config.serve.port} "
        "(/generate, /v1/chat/completions, /v1/completions, /v1/models, /health)", flush=True)
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
  p.add_argument("--chat_format", default=None, help="a built-in envs.chat format (default: the "
                 "checkpoint's own chat template, else by model family)")
  p.add_argument("--served_name", default="arbor", help="the model's id in the OpenAI API")
  p.add_argument("--slots", type=int, default=16, help="sequences decoded together")
  p.add_argument("--max_seq_len", type=int, default=4096, help="longest input + output")
  p.add_argument("--prefix_cache_rows", type=int, default=16, help="extra cache rows for reuse")
  p.add_argument("--steps_per_call", type=int, default=16, help="decode steps per device call")
  p.add_argument("--prefill_chunk", type=int, default=512, help="prefill tokens per row and call")
  p.add_argument("--top_logprobs", type=int, default=ServerConfig.top_logprobs,
                 help="most top log-probs a request may ask for per token")
  p.add_argument("--on_update", default="finish", help="finish | resubmit | restart")
  p.add_argument("--max_connections", type=int, default=ServerConfig.max_connections,
                 help="open connections; beyond, the oldest idle one is closed (tokenless first)")
  p.add_argument("--header_timeout", type=float, default=ServerConfig.header_timeout_s,
                 help="a request's headers are due this many s after its connection opened")
  p.add_argument("--body_timeout", type=float, default=ServerConfig.body_timeout_s,
                 help="a request's body is due this many s after its headers (408)")
  p.add_argument("--handshake_timeout", type=float, default=ServerConfig.handshake_timeout_s,
                 help="the TLS handshake is due this many s after connecting")
  p.add_argument("--ssl_certfile", default=None, help="TLS certificate (PEM): serve https")
  p.add_argument("--ssl_keyfile", default=None, help="TLS private key (PEM)")
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
  try:
    asyncio.run(server.serve_forever())
  except KeyboardInterrupt:
    pass
  return 0


if __name__ == "__main__":
  sys.exit(main())
