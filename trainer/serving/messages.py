"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API over the engine
(a mixin of `trainer.serving.server.PolicyServer`).

The request is converted to the chat form every protocol shares (`trainer.serving.render`):
`system` (a string or text blocks) is a system message; a message's content is a string or
blocks: text, `tool_use` (an assistant's tool call; its input object becomes the call's JSON
arguments), `tool_result` (a tool message; content a string or text blocks; with is_error the
text is rendered after "Error: ", as chat templates have no field for it) and `thinking` (an
earlier assistant turn's reasoning, given to the template as reasoning_content). Tools are
{name, description, input_schema}; tool_choice auto | any | tool (a name) | none, with
disable_parallel_tool_use; max_tokens (required), stop_sequences, temperature, top_p, top_k
(and, as extensions, seed, session_id, chat_template_kwargs).

`thinking`: {"type": "enabled", "budget_tokens": N} (N >= 1024 and below max_tokens, as Anthropic
requires), "adaptive" or "between_tools" needs a chat format that reads reasoning back (a
thinking template); with any other format it is refused (400 naming `thinking`), as Anthropic
refuses it for a model without extended thinking. The budget is checked, not enforced apart from
max_tokens. When the template takes an `enable_thinking` variable, those types set it true and
"disabled" false; without `thinking` the template's default applies. Whatever reasoning the
model writes comes back as a thinking block, in full (display "summarized" gets it all;
"omitted" is refused), with signature "" (there is nothing to verify).
`output_config.effort` is accepted and changes nothing.

The reply's content blocks are read from the sampled ids: thinking, text, then a tool_use block
per call (id, name, input as an object); stop_reason max_tokens (the token limit), stop_sequence
(with the stop_sequence that ended it), tool_use (calls) or end_turn; usage input_tokens and
output_tokens. A streamed reply sends message_start, ping, per block content_block_start,
content_block_delta (text_delta, thinking_delta, input_json_delta) and content_block_stop, then
message_delta (stop_reason, stop_sequence, usage) and message_stop, so that the official client
assembles the non-streamed reply. count_tokens answers the length of the rendered prompt, the
ids the engine would be given. Errors on these routes are Anthropic errors ({"type": "error",
"error": {"type", "message"}}, the field named in the message); clients authenticate with
X-Api-Key or a bearer token.

tool_choice {"type": "any"} or {"type": "tool", "name"} makes the reply tool_use blocks (one
when disable_parallel_tool_use is set) whose input is valid under the tool's input_schema: the
call is sampled under a grammar (`trainer.serving.render`), streamed or not, so it always
parses (stop_reason tool_use unless max_tokens cuts it). A tool schema that cannot be compiled
is a 400 naming tools or tool_choice.

Refused rather than ignored: image and document blocks, redacted_thinking, a final assistant
message (prefill: continuing it is not supported), non-custom (server) tools, mcp_servers,
container, output_format and output_config.format (structured output).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from trainer.serving.render import ChatRequest, render_prompt
from trainer.serving.text import _Blocks, _call_id, _sse_event, _stop_hit
from trainer.serving.validate import HTTPError, _field, _refuse_unsupported, _tool_choice

CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # Anthropic -> OpenAI
THINKING = ("enabled", "adaptive", "between_tools", "disabled")


def _texts(blocks: Any, where: str) -> str:
  """The text of a string or a list of text blocks, joined by "\\n"."""
  if isinstance(blocks, str):
    return blocks
  if not isinstance(blocks, list):
    raise HTTPError(400, f"{where}={blocks!r:.100}: expected a string or a list of text "
                         "blocks", where)
  for j, b in enumerate(blocks):
    if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
      kind = b.get("type") if isinstance(b, dict) else None
      raise HTTPError(400, f"{where}[{j}]: block type {kind!r:.50} is not supported here "
                           "(only text)", where)
  return "\n".join(b["text"] for b in blocks)


def _user_turn(blocks: list, where: str, names: dict) -> list[dict]:
  """A user message's blocks as chat messages: tool results as tool messages, text between
  them as user messages, in order."""
  out, texts = [], []

  def flush():
    if texts:
      out.append({"role": "user", "content": "\n".join(texts)})
      texts.clear()

  for j, b in enumerate(blocks):
    kind = b.get("type") if isinstance(b, dict) else None
    if kind == "text" and isinstance(b.get("text"), str):
      texts.append(b["text"])
    elif kind == "tool_result" and isinstance(b.get("tool_use_id"), str):
      flush()
      text = _texts(b.get("content", ""), f"{where}[{j}].content")
      if _field(b, "is_error", bool, False):
        text = "Error: " + text
      name = names.get(b["tool_use_id"])
      out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text,
                  **({"name": name} if name else {})})
    else:
      raise HTTPError(400, f"{where}[{j}]: block type {kind!r:.50} is not supported in a user "
                           "message (text, tool_result with tool_use_id)", where)
  flush()
  return out


def _assistant_turn(blocks: list, where: str, names: dict) -> dict:
  """An assistant message's blocks as one chat message."""
  texts, thoughts, calls = [], [], []
  for j, b in enumerate(blocks):
    kind = b.get("type") if isinstance(b, dict) else None
    if kind == "text" and isinstance(b.get("text"), str):
      texts.append(b["text"])
    elif kind == "thinking" and isinstance(b.get("thinking"), str):
      thoughts.append(b["thinking"])
    elif (kind == "tool_use" and isinstance(b.get("id"), str) and isinstance(b.get("name"), str)
          and isinstance(b.get("input", {}), dict)):
      names[b["id"]] = b["name"]
      calls.append({"type": "function", "id": b["id"], "function": {
          "name": b["name"], "arguments": json.dumps(b.get("input", {}), ensure_ascii=False)}})
    else:
      raise HTTPError(400, f"{where}[{j}]: block type {kind!r:.50} is not supported in an "
                           "assistant message (text, thinking, tool_use with id, name and "
                           "input)", where)
  message = {"role": "assistant", "content": "\n".join(texts) if texts else None}
  if thoughts:
    message["reasoning_content"] = "\n".join(thoughts)
  if calls:
    message["tool_calls"] = calls
  return message


def anthropic_messages(system: Any, messages: Any) -> list[dict]:
  """Anthropic `system` and `messages` as normalized chat messages.

  Raises:
    HTTPError: 400 naming the message and block.
  """
  out = [] if system is None else [{"role": "system", "content": _texts(system, "system")}]
  if not isinstance(messages, list) or not messages:
    raise HTTPError(400, "messages: expected a non-empty list", "messages")
  names: dict[str, str] = {}  # tool_use id -> name, for the results
  for i, m in enumerate(messages):
    where = f"messages[{i}]"
    role = m.get("role") if isinstance(m, dict) else None
    if role not in ("user", "assistant"):
      raise HTTPError(400, f"{where}.role={role!r:.50}: expected user or assistant",
                      f"{where}.role")
    content = m["content"] if "content" in m else None
    if isinstance(content, str):
      out.append({"role": role, "content": content})
    elif isinstance(content, list):
      turn = _user_turn if role == "user" else _assistant_turn
      got = turn(content, f"{where}.content", names)
      out += got if isinstance(got, list) else [got]
    else:
      raise HTTPError(400, f"{where}.content={content!r:.100}: expected a string or a list of "
                           "blocks", f"{where}.content")
  if messages[-1]["role"] == "assistant":
    raise HTTPError(400, f"messages[{len(messages) - 1}]: a final assistant message (prefill) is "
                         "not supported: the reply starts a new assistant turn", "messages")
  return out


def anthropic_tools(body: dict) -> Optional[list[dict]]:
  """Anthropic tools ({name, description, input_schema}) as OpenAI function schemas."""
  tools = body.get("tools")
  if tools is None or tools == []:
    return None
  if not isinstance(tools, list):
    raise HTTPError(400, "tools: expected a list", "tools")
  out = []
  for i, t in enumerate(tools):
    if (not isinstance(t, dict) or t.get("type", "custom") != "custom"
        or not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema"), dict)):
      raise HTTPError(400, f"tools[{i}]={t!r:.100}: expected a custom tool {{\"name\", "
                           "\"description\", \"input_schema\"}} (server tools are not served)",
                      f"tools[{i}]")
    # in OpenAI's order: templates show the schema as JSON, keys as given
    fn = {"name": t["name"], **({"description": t["description"]} if isinstance(
        t.get("description"), str) else {}), "parameters": t["input_schema"]}
    out.append({"type": "function", "function": fn})
  return out


def anthropic_tool_choice(body: dict, tools) -> tuple[str, Optional[str], bool]:
  """(mode, function name, parallel) of Anthropic's tool_choice (see `_tool_choice`)."""
  choice = _field(body, "tool_choice", dict, None)
  if choice is None:
    return *_tool_choice({}, tools), True
  kind = choice.get("type")
  if kind == "tool" and isinstance(choice.get("name"), str):
    mapped = {"type": "function", "function": {"name": choice["name"]}}
  elif kind in CHOICES:
    mapped = CHOICES[kind]
  else:
    raise HTTPError(400, f"tool_choice={choice!r:.100}: expected type auto, any, tool (with a "
                         "name) or none", "tool_choice")
  parallel = not _field(choice, "disable_parallel_tool_use", bool, False)
  return *_tool_choice({"tool_choice": mapped}, tools), parallel


def _tool_use_id(call) -> str:
  """A tool_use id: the model's own id where its format writes one, else "toolu_..."."""
  cid = _call_id(call)
  return cid if cid == call.id else "toolu_" + uuid.uuid4().hex[:24]


def _block(block) -> dict:
  """A reply block as an Anthropic content block."""
  if block.kind == "reasoning":
    return {"type": "thinking", "thinking": block.text, "signature": ""}
  if block.kind == "text":
    return {"type": "text", "text": block.text}
  return {"type": "tool_use", "id": block.call_id, "name": block.call.name,
          "input": block.call.arguments}


class MessagesEndpoint:
  """The Anthropic Messages endpoints of `PolicyServer` (its engine, chat format, sessions)."""

  def _thinking_kwargs(self, body: dict, max_tokens: Any) -> dict:
    """Template kwargs of the request's `thinking` (module docstring)."""
    thinking = _field(body, "thinking", dict, None)
    if thinking is None:
      return {}
    kind = thinking.get("type")
    if kind not in THINKING:
      raise HTTPError(400, f"thinking={thinking!r:.100}: expected type "
                           f"{', '.join(THINKING)}", "thinking")
    if thinking.get("display") == "omitted":
      raise HTTPError(400, f"thinking={thinking!r:.100}: display \"omitted\" is not supported "
                           "(the reasoning is returned as written)", "thinking")
    if kind != "disabled" and not getattr(self.chat, "thinking", False):
      raise HTTPError(400, f"thinking={thinking!r:.100}: this chat format "
                           f"({getattr(self.chat, 'name', None)}) writes no reasoning",
                      "thinking")
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and not (isinstance(budget, int) and not isinstance(budget, bool)
                                  and 1024 <= budget and (not isinstance(max_tokens, int)
                                                          or budget < max_tokens)):
      raise HTTPError(400, f"thinking.budget_tokens={budget!r:.50}: expected an integer >= 1024 "
                           f"and below max_tokens={max_tokens!r:.20}", "thinking")
    sources = "\n".join(getattr(self.chat, "templates", {}).values())
    return {"enable_thinking": kind != "disabled"} if "enable_thinking" in sources else {}

  def _messages_request(self, body: dict) -> ChatRequest:
    """The request in the shared chat form (what /v1/messages and count_tokens render)."""
    self._check_model(body)
    for name in ("mcp_servers", "container", "output_format"):
      if body.get(name) is not None:
        raise HTTPError(400, f"{name}={body[name]!r:.100}: not supported by this server", name)
    output = _field(body, "output_config", dict, {})
    if output.get("format") is not None:
      raise HTTPError(400, f"output_config.format={output['format']!r:.100}: not supported by "
                           "this server", "output_config.format")
    _refuse_unsupported(body)
    messages = anthropic_messages(body.get("system"), body.get("messages"))
    tools = anthropic_tools(body)
    mode, name, parallel = anthropic_tool_choice(body, tools)
    kwargs = {**self._thinking_kwargs(body, body.get("max_tokens")),
              **(_field(body, "chat_template_kwargs", dict, None) or {})}
    return ChatRequest(messages, tools, mode, name, parallel, kwargs or None,
                       {"template_kwargs": "chat_template_kwargs"})

  async def _count_tokens(self, request: Request) -> Response:
    body = await self._body(request)
    prompt = render_prompt(self.chat, self._messages_request(body))
    return JSONResponse({"input_tokens": len(prompt.input_ids)})

  async def _messages(self, request: Request) -> Response:
    body = await self._body(request)
    if body.get("max_tokens") is None:
      raise HTTPError(400, "max_tokens: required", "max_tokens")
    chat_request = self._messages_request(body)
    session = self._session_id(body, request)
    stream = _field(body, "stream", bool, False)
    prompt = render_prompt(self.chat, chat_request)
    sampling = {"max_tokens": body["max_tokens"], "stop": body.get("stop_sequences"),
                **{k: body.get(k) for k in ("temperature", "top_p", "top_k", "seed")}}
    sample, queue, params, reader = self._start_turn(prompt, sampling, session, stream,
                                                     {"stop": "stop_sequences"})
    logged = {"n": 1, "tool_choice": body.get("tool_choice", chat_request.mode)}
    head = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
            "model": self.cfg.served_name, "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": {"input_tokens": len(prompt.input_ids),
                                             "output_tokens": 0}}
    blocks = _Blocks(lambda kind: "", _tool_use_id)
    if stream:
      return self._streaming(self._message_stream(sample, queue, reader, blocks, head, session,
                                                  logged, params.stop))
    out = await asyncio.wrap_future(sample.future)
    self._log(session, sample, out, logged, "anthropic_messages")
    reasoning, content, calls, _ = reader.read(out.output_ids)
    blocks.update(reasoning, content, calls, final=True)
    reply = {**head, "content": [_block(b) for b in blocks.blocks],
             **self._stop(out, calls, params.stop),
             "usage": {**head["usage"], "output_tokens": len(out.output_ids)}}
    if session is not None:
      reply["session_id"] = session
    return JSONResponse(reply)

  def _stop(self, out, calls: list, stops) -> dict:
    """stop_reason and stop_sequence of a finished sample (`stops`: the request's strings)."""
    if out.finish_reason == "length":
      return {"stop_reason": "max_tokens", "stop_sequence": None}
    ids = out.output_ids
    ended = bool(ids) and ids[-1] in self.chat.stop_token_ids
    hit = None if ended else _stop_hit(self.tokenizer.decode(ids), stops)
    if hit is not None:  # the engine stopped on a stop string
      return {"stop_reason": "stop_sequence", "stop_sequence": hit}
    return {"stop_reason": "tool_use" if calls else "end_turn", "stop_sequence": None}

  async def _message_stream(self, sample, queue, reader, blocks: _Blocks, head: dict, session,
                            logged, stops):
    def event(kind: str, **fields) -> str:
      return _sse_event(kind, {"type": kind, **fields})

    def opening():
      return [event("message_start", message=head), event("ping")]

    def on_tokens(k, ids, lps, top):
      reasoning, content, calls, _ = reader.read(ids, final=False)
      return [e for c in blocks.update(reasoning, content, calls) for e in _events(event, c)]

    def on_done(k, out):
      self._log(session, sample, out, logged, "anthropic_messages")
      reasoning, content, calls, _ = reader.read(out.output_ids)
      changes = blocks.update(reasoning, content, calls, final=True)
      return [e for c in changes for e in _events(event, c)] + [
          event("message_delta", delta=self._stop(out, calls, stops),
                usage={"output_tokens": len(out.output_ids)}),
          event("message_stop")]

    def on_error(message):
      return event("error", error={"type": "api_error", "message": message})

    async for e in self._stream("messages", [sample], queue, opening, on_tokens, on_done,
                                lambda: [], on_error):
      yield e


def _events(event, change: tuple) -> list[str]:
  """The Anthropic stream events of one block change (`_Blocks.update`)."""
  what, block = change[0], change[1]
  if what == "open":
    start = _block(block)
    start = {**start, "input": {}} if block.kind == "call" else {
        **start, ("thinking" if block.kind == "reasoning" else "text"): ""}
    return [event("content_block_start", index=block.index, content_block=start)]
  if what == "close":
    return [event("content_block_stop", index=block.index)]
  delta = {"reasoning": {"type": "thinking_delta", "thinking": change[2]},
           "text": {"type": "text_delta", "text": change[2]},
           "call": {"type": "input_json_delta", "partial_json": change[2]}}[block.kind]
  return [event("content_block_delta", index=block.index, delta=delta)]
