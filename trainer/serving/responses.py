"""POST /v1/responses: the OpenAI Responses API over the engine (a mixin of
`trainer.serving.server.PolicyServer`).

The request is converted to the chat form every protocol shares (`trainer.serving.render`):
`instructions` is a system message, `input` a user message (a string) or a list of items:
messages (roles system, developer, user, assistant; content as a string or input_text /
output_text parts), `function_call` items (an assistant's tool calls), `function_call_output`
items (tool results) and `reasoning` items (an assistant's reasoning, from their reasoning_text
content or else their summary). Tools are function tools in Responses' flat shape
({"type": "function", "name", "description", "parameters"}); tool_choice none | auto | required
| {"type": "function", "name"}; parallel_tool_calls; max_output_tokens, temperature, top_p (and,
as extensions, top_k, seed, session_id, chat_template_kwargs).

The reply's output items are read from the sampled ids: a `reasoning` item (reasoning_text
content) when the chat format reads reasoning back, a `message` with one output_text, and a
`function_call` per tool call (call_id, name, arguments); status "incomplete" with
incomplete_details.reason "max_output_tokens" when the token limit cut the reply. A streamed
reply sends response.created, response.in_progress, then per item output_item.added,
content_part.added, output_text / reasoning_text / function_call_arguments deltas and done
events, content_part.done, output_item.done, and last response.completed carrying the same
response as the non-streamed reply (also when incomplete: its status says so, and the official
client's `get_final_response` needs that event).

`text.format` {"type": "json_schema", "name", "schema", "strict"} or {"type": "json_object"}
makes the message's output_text JSON (valid under the schema), and tool_choice "required" or
{"type": "function", "name"} a reply of function_call items whose arguments are valid under
the function's parameters: both are sampled under a grammar (`trainer.serving.render`), streamed
or not; what cannot be compiled (with strict, a schema keyword the grammar does not implement)
is a 400 naming text.format or tool_choice.

Nothing is stored: `previous_response_id`, `conversation` and `background` are refused (send the
whole conversation as input), `store` is accepted and answered with store false. Refused too,
rather than ignored: non-function tools, `include` other than "reasoning.encrypted_content"
(reasoning comes back as plain text content; there is no encrypted form), top_logprobs,
max_tool_calls, and input items other than the four above. `reasoning`
(effort, summary) is accepted and changes nothing: whether the model reasons is its chat
template's business (`chat_template_kwargs`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from trainer.serving.render import ChatRequest, render_prompt
from trainer.serving.text import _Blocks, _sse_event
from trainer.serving.validate import (HTTPError, _field, _integer, _refuse_unsupported,
                                      _tool_choice)

INPUT_ROLES = {"system": "system", "developer": "system", "user": "user",
               "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")
INCLUDE_OK = ("reasoning.encrypted_content",)
ITEM_PREFIX = {"reasoning": "rs", "text": "msg", "call": "fc"}


def _text_of(content: Any, where: str) -> str:
  """The text of a message's content: a string, or text parts joined by "\\n"."""
  if isinstance(content, str):
    return content
  if not isinstance(content, list):
    raise HTTPError(400, f"{where}={content!r:.100}: expected a string or a list of "
                         "input_text parts", where)
  texts = []
  for j, part in enumerate(content):
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
      raise HTTPError(400, f"{where}[{j}]: content part type {kind!r:.50} is not supported "
                           f"(only {', '.join(TEXT_PARTS)})", f"{where}[{j}].type")
    texts.append(part["text"])
  return "\n".join(texts)


def _assistant(messages: list[dict], part: str) -> dict:
  """The assistant message an item's `part` ("reasoning" | "content" | "call") belongs to: the
  last message when it is an assistant message that can still take it, else a new one."""
  last = messages[-1] if messages else None
  if last is not None and last["role"] == "assistant":
    taken = {"reasoning": ("reasoning_content", "content", "tool_calls"),
             "content": ("content", "tool_calls"), "call": ()}[part]
    if not any(last.get(k) for k in taken):
      return last
  messages.append({"role": "assistant", "content": None})
  return messages[-1]


def _string(item: dict, key: str, where: str) -> str:
  value = item.get(key)
  if not isinstance(value, str):
    raise HTTPError(400, f"{where}.{key}={value!r:.100}: expected a string", f"{where}.{key}")
  return value


def input_messages(value: Any, instructions: Optional[str]) -> list[dict]:
  """Responses `input` (and `instructions`) as normalized chat messages.

  Args:
    value: the request's "input": a string, or a list of items.
    instructions: the request's "instructions", or None.

  Returns:
    The messages (see `trainer.serving.validate.normalize_messages`).

  Raises:
    HTTPError: 400 naming the item and field.
  """
  messages = [{"role": "system", "content": instructions}] if instructions else []
  if isinstance(value, str):
    return messages + [{"role": "user", "content": value}]
  if not isinstance(value, list) or not value:
    raise HTTPError(400, f"input={value!r:.100}: expected a string or a non-empty list of "
                         "items", "input")
  names: dict[str, str] = {}  # call_id -> function name, for the results
  for i, item in enumerate(value):
    where = f"input[{i}]"
    if not isinstance(item, dict):
      raise HTTPError(400, f"{where}={item!r:.100}: expected an object", where)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
      role = INPUT_ROLES.get(item.get("role"))
      if role is None:
        raise HTTPError(400, f"{where}.role={item.get('role')!r:.50}: expected one of "
                             f"{', '.join(INPUT_ROLES)}", f"{where}.role")
      text = _text_of(item.get("content"), f"{where}.content")
      if role == "assistant":
        _assistant(messages, "content")["content"] = text
      else:
        messages.append({"role": role, "content": text})
    elif kind == "function_call":
      call_id, name = _string(item, "call_id", where), _string(item, "name", where)
      names[call_id] = name
      _assistant(messages, "call").setdefault("tool_calls", []).append(
          {"type": "function", "id": call_id,
           "function": {"name": name, "arguments": _string(item, "arguments", where)}})
    elif kind == "function_call_output":
      call_id = _string(item, "call_id", where)
      result = {"role": "tool", "tool_call_id": call_id,
                "content": _text_of(item.get("output"), f"{where}.output")}
      messages.append({**result, **({"name": names[call_id]} if call_id in names else {})})
    elif kind == "reasoning":
      parts = item.get("content") or item.get("summary") or []
      text = "\n".join(p["text"] for p in parts if isinstance(p, dict)
                       and isinstance(p.get("text"), str)) if isinstance(parts, list) else None
      if text is None:
        raise HTTPError(400, f"{where}.content={parts!r:.100}: expected a list of "
                             "reasoning_text parts", f"{where}.content")
      _assistant(messages, "reasoning")["reasoning_content"] = text
    else:
      raise HTTPError(400, f"{where}.type={kind!r:.50}: not supported (message, function_call, "
                           "function_call_output, reasoning)", f"{where}.type")
  return messages


def function_tools(body: dict) -> Optional[list[dict]]:
  """Responses' flat function tools as OpenAI chat function schemas (None: no tools)."""
  tools = body.get("tools")
  if tools is None or tools == []:
    return None
  if not isinstance(tools, list):
    raise HTTPError(400, "tools: expected a list", "tools")
  out = []
  for i, t in enumerate(tools):
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(
        t.get("name"), str):
      kind = t.get("type") if isinstance(t, dict) else None
      raise HTTPError(400, f"tools[{i}]: only function tools are served ({{\"type\": "
                           f"\"function\", \"name\": ..., \"parameters\": ...}}), got type "
                           f"{kind!r:.50}", f"tools[{i}]")
    fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
    out.append({"type": "function", "function": fn})
  return out


def responses_tool_choice(body: dict, tools: Optional[list[dict]]) -> tuple[str, Optional[str]]:
  """(mode, function name) of Responses' tool_choice (see `_tool_choice`)."""
  choice = body.get("tool_choice")
  if isinstance(choice, dict):
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
      raise HTTPError(400, f"tool_choice={choice!r:.100}: expected \"none\", \"auto\", "
                           '"required" or {"type": "function", "name": ...}', "tool_choice")
    choice = {"type": "function", "function": {"name": choice["name"]}}
  return _tool_choice({"tool_choice": choice}, tools)


def _refuse_responses_fields(body: dict) -> None:
  """400 for the fields this server does not implement (module docstring)."""
  for name in ("previous_response_id", "conversation", "prompt"):
    if body.get(name) is not None:
      raise HTTPError(400, f"{name}={body[name]!r:.100}: not supported by this server (it "
                           "stores nothing: send the whole conversation as input)", name)
  if body.get("max_tool_calls") is not None:
    raise HTTPError(400, f"max_tool_calls={body['max_tool_calls']!r:.50}: not supported by this "
                         "server (parallel_tool_calls=false allows one call)", "max_tool_calls")
  if _field(body, "background", bool, False):
    raise HTTPError(400, "background=True: not supported by this server", "background")
  _field(body, "store", bool, False)
  include = _field(body, "include", list, [])
  for value in include:
    if value not in INCLUDE_OK:
      raise HTTPError(400, f"include={include!r:.100}: {value!r:.60} is not supported (only "
                           f"{', '.join(INCLUDE_OK)})", "include")
  _integer(body, "top_logprobs", 0, 0, 0, " (log-probs are not served on /v1/responses)")
  _field(body, "reasoning", dict, None)
  _refuse_unsupported(body)


def text_format(body: dict) -> Optional[dict]:
  """Responses' `text.format` as a Chat Completions response_format (None: plain text).

  Raises:
    HTTPError: 400 naming text.format and the value.
  """
  text = _field(body, "text", dict, {})
  fmt = text.get("format")
  if fmt is None or fmt == {"type": "text"}:
    return None
  kind = fmt.get("type") if isinstance(fmt, dict) else None
  if kind == "json_object":
    return {"type": "json_object"}
  if kind == "json_schema" and isinstance(fmt.get("schema"), dict) and isinstance(
      fmt.get("strict", False), (bool, type(None))):
    spec = {"name": fmt.get("name"), "schema": fmt["schema"], "strict": bool(fmt.get("strict"))}
    return {"type": "json_schema", "json_schema": spec}
  raise HTTPError(400, f"text.format={fmt!r:.100}: expected {{\"type\": \"text\"}}, "
                       '{"type": "json_object"} or {"type": "json_schema", "name": ..., '
                       '"schema": {...}, "strict": true | false}', "text.format")


class ResponsesEndpoint:
  """The Responses endpoint of `PolicyServer` (its engine, chat format, sessions)."""

  async def _responses(self, request: Request) -> Response:
    body = await self._body(request)
    self._check_model(body)
    _refuse_responses_fields(body)
    instructions = _field(body, "instructions", str, None)
    messages = input_messages(body.get("input"), instructions)
    tools = function_tools(body)
    mode, name = responses_tool_choice(body, tools)
    parallel = _field(body, "parallel_tool_calls", bool, True)
    session = self._session_id(body, request)
    stream = _field(body, "stream", bool, False)
    prompt = render_prompt(self.chat, ChatRequest(
        messages, tools, mode, name, parallel, _field(body, "chat_template_kwargs", dict, None),
        {"messages": "input", "template_kwargs": "chat_template_kwargs",
         "response_format": "text.format"}, text_format(body)))
    sampling = {"max_tokens": body.get("max_output_tokens"), **{
        k: body.get(k) for k in ("temperature", "top_p", "top_k", "seed")}}
    sample, queue, params, reader = self._start_turn(
        prompt, sampling, session, stream, {"max_tokens": "max_output_tokens"})
    logged = {"n": 1, "tool_choice": body.get("tool_choice", mode)}
    head = self._response_head(body, params, parallel)
    blocks = _Blocks(lambda kind: f"{ITEM_PREFIX[kind]}_{uuid.uuid4().hex}")
    if stream:
      return self._streaming(self._response_stream(sample, queue, reader, blocks, head, session,
                                                   logged))
    out = await asyncio.wrap_future(sample.future)
    self._log(session, sample, out, logged, "responses")
    reasoning, content, calls, _ = reader.read(out.output_ids)
    blocks.update(reasoning, content, calls, final=True)
    return JSONResponse(self._response(head, blocks, sample, out, session))

  def _response_head(self, body: dict, params, parallel: bool) -> dict:
    """The response object before its output: what the request asked for."""
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response",
            "created_at": int(time.time()), "status": "in_progress", "error": None,
            "incomplete_details": None, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "model": self.cfg.served_name,
            "output": [], "parallel_tool_calls": parallel, "previous_response_id": None,
            "reasoning": body.get("reasoning"), "store": False,
            "temperature": params.temperature,
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "top_p": params.top_p, "truncation": body.get("truncation", "disabled"),
            "usage": None, "metadata": body.get("metadata") or {}}

  def _response(self, head: dict, blocks: _Blocks, sample, out, session) -> dict:
    """The finished response object."""
    incomplete = out.finish_reason == "length"
    reasoning = sum(1 for b in blocks.blocks if b.kind == "reasoning")
    n_in, n_out = len(sample.input_ids), len(out.output_ids)
    reply = {**head, "status": "incomplete" if incomplete else "completed",
             "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
             "output": [_item(b, _status(blocks, b, incomplete)) for b in blocks.blocks],
             "usage": {"input_tokens": n_in,
                       "input_tokens_details": {"cached_tokens": out.cached_tokens,
                                                "cache_write_tokens": 0},
                       "output_tokens": n_out,
                       "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens(
                           out.output_ids) if reasoning else 0},
                       "total_tokens": n_in + n_out}}
    if session is not None:
      reply["session_id"] = session
    return reply

  def _reasoning_tokens(self, ids: list[int]) -> int:
    """How many of a reply's tokens are its reasoning: those up to the one that completes
    "</think>" (all of them if it never does); found by bisection over decoded prefixes."""
    dec = self.tokenizer.decode
    lo, hi = 0, len(ids)
    if "</think>" not in dec(ids):
      return hi
    while lo < hi:
      mid = (lo + hi) // 2
      lo, hi = (lo, mid) if "</think>" in dec(ids[:mid]) else (mid + 1, hi)
    return lo

  async def _response_stream(self, sample, queue, reader, blocks: _Blocks, head: dict,
                             session, logged):
    seq = iter(range(1 << 62))

    def event(kind: str, **fields) -> str:
      return _sse_event(kind, {"type": kind, "sequence_number": next(seq), **fields})

    def opening():
      return [event("response.created", response=head),
              event("response.in_progress", response=head)]

    def on_tokens(k, ids, lps, top):
      reasoning, content, calls, _ = reader.read(ids, final=False)
      return _stream_events(event, blocks.update(reasoning, content, calls), False, blocks)

    def on_done(k, out):
      self._log(session, sample, out, logged, "responses")
      reasoning, content, calls, _ = reader.read(out.output_ids)
      incomplete = out.finish_reason == "length"
      events = _stream_events(event, blocks.update(reasoning, content, calls, final=True),
                              incomplete, blocks)
      return events + [event("response.completed",
                             response=self._response(head, blocks, sample, out, session))]

    def on_error(message):
      return event("error", code="server_error", message=message, param=None)

    async for e in self._stream("responses", [sample], queue, opening, on_tokens, on_done,
                                lambda: [], on_error):
      yield e


def _status(blocks: _Blocks, block, incomplete: bool) -> str:
  """An item's status: the last one of a reply cut by the token limit is incomplete."""
  return "incomplete" if incomplete and block is blocks.blocks[-1] else "completed"


def _part(block) -> dict:
  """The content part of a reasoning or message item."""
  if block.kind == "reasoning":
    return {"type": "reasoning_text", "text": block.text}
  return {"type": "output_text", "text": block.text, "annotations": [], "logprobs": []}


def _item(block, status: str, started: bool = False) -> dict:
  """The output item of a block; `started`: as announced when it opens (empty)."""
  if block.kind == "call":
    return {"id": block.id, "type": "function_call", "status": status,
            "call_id": block.call_id, "name": block.call.name,
            "arguments": "" if started else block.arguments}
  content = [] if started else [_part(block)]
  if block.kind == "reasoning":
    return {"id": block.id, "type": "reasoning", "status": status, "summary": [],
            "content": content}
  return {"id": block.id, "type": "message", "status": status, "role": "assistant",
          "content": content}


def _stream_events(event, changes: list[tuple], incomplete: bool, blocks: _Blocks) -> list[str]:
  """The Responses events of block changes (`_Blocks.update`)."""
  out = []
  for change in changes:
    what, block = change[0], change[1]
    where = {"item_id": block.id, "output_index": block.index}
    part = {**where, "content_index": 0}
    if what == "open":
      out.append(event("response.output_item.added", output_index=block.index,
                       item=_item(block, "in_progress", started=True)))
      if block.kind != "call":
        out.append(event("response.content_part.added", **part,
                         part={**_part(block), "text": ""}))
    elif what == "delta" and block.kind == "call":
      out.append(event("response.function_call_arguments.delta", **where, delta=change[2]))
    elif what == "delta":
      kind = "reasoning_text" if block.kind == "reasoning" else "output_text"
      extra = {} if block.kind == "reasoning" else {"logprobs": []}
      out.append(event(f"response.{kind}.delta", **part, delta=change[2], **extra))
    else:
      status = _status(blocks, block, incomplete)
      if block.kind == "call":
        out.append(event("response.function_call_arguments.done", **where,
                         name=block.call.name, arguments=block.arguments))
      else:
        kind = "reasoning_text" if block.kind == "reasoning" else "output_text"
        extra = {} if block.kind == "reasoning" else {"logprobs": []}
        out.append(event(f"response.{kind}.done", **part, text=block.text, **extra))
        out.append(event("response.content_part.done", **part, part=_part(block)))
      out.append(event("response.output_item.done", output_index=block.index,
                       item=_item(block, status)))
  return out
