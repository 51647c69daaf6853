"""Replies of the policy server read back from sampled ids: stop strings cut, the part of a
growing text that more tokens cannot change, chat reasoning / content / tool calls, streamed
deltas, the blocks (reasoning, text, tool calls) the Responses and Messages replies stream as,
and Server-Sent Events."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import uuid
from typing import Any, Callable, Optional, Sequence


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
  `_settled`; trailing whitespace too, which the final content strips). Reasoning followed by
  content or a call is final as read.

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
    if reasoning is not None and not (content or calls):  # still thinking: it may grow
      reasoning = _settled(reasoning, (), self.markers).rstrip()
    return reasoning, _settled(content, self.stops, self.markers).rstrip(), calls, errors


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


def _sse_event(name: str, data: Any) -> str:
  """A named Server-Sent Event (the Responses and Anthropic Messages streams name theirs)."""
  return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def _stop_hit(text: str, stops: Sequence[str]) -> Optional[str]:
  """The stop string that occurs first in a sample's text (None: none does)."""
  found = [(i, s) for s in stops for i in [text.find(s)] if i >= 0]
  return min(found)[1] if found else None


@dataclasses.dataclass
class _Block:
  """One block of a reply: its reasoning, its text, or one of its tool calls.

  Attributes:
    kind: "reasoning" | "text" | "call".
    index: its place in the reply (0, 1, ...).
    id: the block's own id (the protocol's item id).
    text: the reasoning or text sent so far (the final text once closed).
    call: the envs.chat ToolCall of a call block.
    call_id: the call's id (the model's own where its format writes one).
    arguments: the call's arguments as a JSON string.
  """
  kind: str
  index: int
  id: str
  text: str = ""
  call: Any = None
  call_id: str = ""
  arguments: str = ""


class _Blocks:
  """A reply as a sequence of blocks (reasoning, text, then each tool call), the same whether
  read at the end or while it grows, and the events that stream it.

  Each `update` with the reply read so far returns events ("open", block), ("delta", block,
  new text) and ("close", block), in order; a block is closed when the next one opens (a tool
  call at once: its arguments are streamed in fragments) and the last one by the final update.
  Tool calls come with the final update. Empty reasoning or text makes no block.

  Args:
    new_id: kind ("reasoning" | "text" | "call") -> a fresh block id.
    call_id: ToolCall -> the id the reply gives the call.
  """

  def __init__(self, new_id: Callable[[str], str], call_id: Callable[[Any], str] = _call_id):
    self.new_id, self.call_id = new_id, call_id
    self.blocks: list[_Block] = []
    self.closed = 0  # blocks [0, closed) are closed

  def update(self, reasoning: Optional[str], content: str, calls: list,
             final: bool = False) -> list[tuple]:
    """Events of the reply read so far (see the class docstring).

    Raises:
      RuntimeError: the reply changed a block already sent (e.g. the engine restarted the
        sample on new weights).
    """
    # Calls are sent once the sample is finished: text may still follow a call, and the text
    # block must stay open to take it.
    parts = ([("reasoning", reasoning)] if reasoning else []) + (
        [("text", content)] if content else []) + [("call", c) for c in calls if final]
    events = []
    for i, (kind, value) in enumerate(parts):
      if i < len(self.blocks):
        events += self._grow(self.blocks[i], kind, value)
        continue
      events += self._close_open()
      block = _Block(kind, i, self.new_id(kind))
      self.blocks.append(block)
      events.append(("open", block))
      if kind == "call":
        block.call, block.call_id = value, self.call_id(value)
        block.arguments = json.dumps(value.arguments, ensure_ascii=False)
        events += [("delta", block, part) for part in _fragments(block.arguments)]
        events += self._close_open()
      else:
        events += self._grow(block, kind, value)
    if final:
      if len(parts) != len(self.blocks):
        raise RuntimeError("the sample's reply changed after part of it was streamed")
      events += self._close_open()
    return events

  def _grow(self, block: _Block, kind: str, value) -> list[tuple]:
    if block.kind != kind:
      raise RuntimeError("the sample's reply changed after part of it was streamed")
    if kind == "call" or value == block.text:
      return []
    if block.index < self.closed or not value.startswith(block.text):
      raise RuntimeError("the sample's text changed after part of it was streamed")
    new, block.text = value[len(block.text):], value
    return [("delta", block, new)]

  def _close_open(self) -> list[tuple]:
    events = [("close", b) for b in self.blocks[self.closed:]]
    self.closed = len(self.blocks)
    return events
