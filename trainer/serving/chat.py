"""POST /v1/chat/completions: OpenAI chat completions over the engine, rendered through the
shared path of the chat protocols (`trainer.serving.render`: the server's envs.chat format) and
read back from the sampled ids (a mixin of `trainer.serving.server.PolicyServer`).

`response_format` ({"type": "text"}, {"type": "json_object"}, {"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}) and a forced `tool_choice` ("required", or
{"type": "function", "function": {"name"}}) are sampled under a grammar (`render`), streamed
or not: the content is JSON valid under the schema, a forced reply is tool calls the format's
parser reads, with schema-valid arguments (finish_reason "tool_calls").
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from trainer.serving.render import ChatRequest, render_prompt
from trainer.serving.text import (_ChatReader, _TextDeltas, _call_id, _call_json, _finish_reason,
                                  _fragments, _usage)
from trainer.serving.validate import (HTTPError, _field, _integer, _tool_choice, _tools,
                                      normalize_messages)


class ChatEndpoint:
  """The chat completions endpoint of `PolicyServer` (its engine, chat format, sessions)."""

  async def _chat(self, request: Request) -> Response:
    body = await self._body(request)
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
    prompt = render_prompt(self.chat, ChatRequest(
        messages, tools, mode, name, parallel, _field(body, "chat_template_kwargs", dict, None),
        {"template_kwargs": "chat_template_kwargs"}, body.get("response_format")))
    input_ids = prompt.input_ids
    n, params, stream, include_usage = self._common(body, [len(input_ids)], 1,
                                                    self.chat.stop_token_ids, formats=True)
    params = dataclasses.replace(params, **prompt.constraint)
    self._reserve(session, [len(input_ids)], n, params)
    reader = prompt.reader(self.chat, params.stop)
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
      self._log(session, sample, out, logged, "chat_completions")
    reply = {**self._head("chat.completion"), "choices": choices,
             "usage": _usage([len(input_ids)], outs)}
    if session is not None:
      reply["session_id"] = session
    return JSONResponse(reply)

  def _chat_logprobs(self, ids, lps, top, top_n: int, start: int = 0) -> list[dict]:
    dec = self.tokenizer.decode

    def entry(token_id, logprob):
      token = dec([token_id])
      return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return [{**entry(ids[k], lps[k]),
             "top_logprobs": [entry(j, v) for j, v in (top[k][:top_n] if top_n else [])]}
            for k in range(start, len(ids))]

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
      self._log(session, samples[k], out, logged, "chat_completions")
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
