"""POST /v1/completions: OpenAI (legacy) completions over the engine, prompts as text or token
ids (a mixin of `trainer.serving.server.PolicyServer`)."""

from __future__ import annotations

import asyncio
from typing import Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from trainer.serving.text import _TextDeltas, _cut_stop, _settled, _usage
from trainer.serving.validate import HTTPError, _field, _integer, _is_ids, check_token_ids


class CompletionsEndpoint:
  """The completions endpoint of `PolicyServer` (its engine, tokenizer, sessions)."""

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
