"""Replies of the policy server read back from sampled ids: stop strings cut, the part of a
growing text that more tokens cannot change, chat reasoning / content / tool calls, streamed
deltas and Server-Sent Events."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from typing import Any, Optional, Sequence

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


def _usage(prompt_lens: list[int], outs) -> dict:
  prompt, completion = sum(prompt_lens), sum(len(o.output_ids) for o in outs)
  return {"prompt_tokens": prompt, "completion_tokens": completion,
          "total_tokens": prompt + completion}


def _fragments(text: str, size: int = 16) -> list[str]:
  """A tool call's arguments in pieces, as OpenAI streams them."""
  return [text[i:i + size] for i in range(0, len(text), size)] or [""]
