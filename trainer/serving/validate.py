"""Request validation of the policy server: the request errors it answers with (OpenAI error
objects; Anthropic's on the Messages routes) and the checks of every field a request carries.

Every number is checked before anything reaches the engine: token ids inside the vocabulary,
max_tokens within the context, temperature a finite number in [0, MAX_TEMPERATURE], top_p in
(0, 1], top_k in [0, MAX_TOP_K] (and -1, vLLM's "off", as 0 on the OpenAI and Anthropic
endpoints), seed an int64, min_p in [0, 1],
min_tokens in [0, max_tokens], n and log-prob counts in range. Anything else is a 400 whose
message names the field and its value (`HTTPError`, with `param` the field). Fields the server
does not implement (UNSUPPORTED: penalties, logit_bias, rendering without the generation prompt
or continuing the last message, ...) are refused unless given the value that changes nothing,
never silently ignored. Chat Completions' response_format and the other protocols' reply
formats and forced tool choices are checked where they are compiled to a grammar
(`trainer.serving.render`, `trainer.serving.constrain`).
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional, Sequence

from starlette.responses import JSONResponse

from envs.policy import SamplingParams

GENERATE_FIELDS = ("input_ids", "max_tokens", "temperature", "top_p", "top_k", "stop_token_ids",
                   "stop", "seed", "min_p", "min_tokens", "ignore_eos")
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}  # OpenAI role -> envs.chat role
# Fields whose non-default values would change what is sampled or rendered; refused rather than
# ignored, each accepted only with the values that change nothing. vLLM's extensions are here
# too: lifting one (once the sampler or the renderer implements it) is deleting its line.
UNSUPPORTED = {"presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
               "logit_bias": (None, {}), "suffix": (None, ""), "best_of": (None, 1),
               "repetition_penalty": (None, 1, 1.0), "add_generation_prompt": (None, True),
               "continue_final_message": (None, False)}
MAX_TEMPERATURE = 100.0        # hotter is uniform sampling for any model
MAX_TOP_K = 2**31 - 1          # the engine's int32 (any k >= the vocabulary is "off")
SEED_RANGE = (-2**63, 2**63 - 1)  # int64, as OpenAI's and vLLM's APIs take it


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


# Anthropic's error types by HTTP status (others: invalid_request_error, api_error from 500).
ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 500: "api_error", 529: "overloaded_error"}


def anthropic_error(status: int, message: str) -> JSONResponse:
  """An Anthropic error: {"type": "error", "error": {"type", "message"}}.

  Args:
    status: the HTTP status (the official `anthropic` client raises BadRequestError for 400,
      AuthenticationError for 401, NotFoundError for 404, ...).
    message: what went wrong, naming the field and value (Anthropic's errors have no param).

  Returns:
    The JSON response.
  """
  kind = ANTHROPIC_ERRORS.get(status, "api_error" if status >= 500 else "invalid_request_error")
  return JSONResponse({"type": "error", "error": {"type": kind, "message": message}},
                      status_code=status)


def _param_of(message: str) -> Optional[str]:
  """The field an engine error names first ("max_tokens=9: ..." -> "max_tokens")."""
  m = re.match(r"([a-z_]+)[=:]", message)
  return m.group(1) if m else None


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


def _top_k(body: dict, minus_one_off: bool) -> int:
  """top_k in [0, MAX_TOP_K]; 0 is off, and so is vLLM's -1 with `minus_one_off`."""
  if minus_one_off and body.get("top_k") == -1 and not isinstance(body["top_k"], bool):
    return 0
  return _integer(body, "top_k", 0, 0, MAX_TOP_K)


def sampling_params(body: dict, *, room: int, capacity: int, vocab_size: int,
                    max_tokens: Optional[int] = None, stop_token_ids: Sequence[int] = (),
                    vllm: bool = False):
  """Builds engine SamplingParams from a request body, every number checked.

  Args:
    body: the request's JSON object (fields of GENERATE_FIELDS; absent ones take defaults:
      max_tokens `max_tokens`, temperature 1, top_p 1, top_k 0 (off), no stop, no seed,
      min_p 0, min_tokens 0, ignore_eos false).
    room: the most new tokens the context has room for (>= 1): the engine's capacity less
      the prompt.
    capacity: the engine's max_seq_len (for the message).
    vocab_size: stop_token_ids must be below this.
    max_tokens: the default when the body has none (None: `room`).
    stop_token_ids: stop tokens added to the body's (e.g. the chat format's end of turn).
    vllm: take top_k -1 as off, as vLLM's OpenAI-compatible endpoints do (/generate does not).

  Returns:
    The SamplingParams.

  Raises:
    HTTPError: 400 naming the field and value: a field of the wrong type, max_tokens outside
      [1, room], temperature outside [0, MAX_TEMPERATURE] or not finite, top_p outside (0, 1],
      top_k outside [0, MAX_TOP_K] (but -1 with `vllm`), a seed outside int64, a stop token
      id outside the vocabulary, a bad "stop", min_p outside [0, 1], min_tokens outside
      [0, max_tokens], a non-bool ignore_eos.
  """
  limit = _integer(body, "max_tokens", room if max_tokens is None else max_tokens, 1, room,
                   f" (the prompt's {capacity - room} tokens + max_tokens fit the engine's "
                   f"max_seq_len={capacity})")
  return SamplingParams(
      max_tokens=limit,
      temperature=_real(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE),
      top_p=_real(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
      top_k=_top_k(body, vllm),
      stop_token_ids=tuple(dict.fromkeys(list(stop_token_ids) + check_token_ids(
          body.get("stop_token_ids", []) or [], "stop_token_ids", vocab_size))),
      stop=_stop_strings(body),
      seed=_integer(body, "seed", None, *SEED_RANGE),
      min_p=_real(body, "min_p", 0.0, 0.0, 1.0),
      min_tokens=_integer(body, "min_tokens", 0, 0, limit, " (at most max_tokens)"),
      ignore_eos=_field(body, "ignore_eos", bool, False))


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


def _neutral(value, defaults: tuple) -> bool:
  """Whether a value is one of a field's neutral ones (a bool is never a number: True is not 1,
  and False is no penalty of 0)."""
  return any(value is None if d is None else
             (type(value) is type(d) or {type(value), type(d)} <= {int, float}) and value == d
             for d in defaults)


def _refuse_unsupported(body: dict, formats: bool = False) -> None:
  """400 for a field of UNSUPPORTED given a value other than its neutral ones, and, unless the
  endpoint constrains replies to a format (`formats`: Chat Completions), for a response_format
  other than text."""
  for name, defaults in UNSUPPORTED.items():
    if not _neutral(body.get(name), defaults):
      neutral = " or ".join(repr(d) for d in defaults if d is not None)
      raise HTTPError(400, f"{name}={body[name]!r:.100}: not supported by this server (only "
                           f"{neutral}, which changes nothing)", name)
  fmt = body.get("response_format")
  if not formats and fmt is not None and fmt != {"type": "text"}:
    raise HTTPError(400, f"response_format={fmt!r:.100}: only {{\"type\": \"text\"}} is "
                         "supported", "response_format")
