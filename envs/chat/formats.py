"""Chat formats: messages and tools rendered directly to token ids, and sampled ids parsed back.

Messages are dicts in the OpenAI shape: {"role": "system" | "user" | "assistant" | "tool",
"content": str}; an assistant message may carry "tool_calls" ([{"function": {"name",
"arguments"}}] or [{"name", "arguments"}], arguments a dict or a JSON string) and "train": False
(its tokens get loss mask 0, for error-masked SFT).

A rendering is a list of pieces, each a text or a token id, marked trained (written by the
assistant) or not. Adjacent text pieces with the same mark are encoded together; control tokens
and a change of mark cut the text, so:
- an assistant turn's tokens are exactly `assistant_ids(message)`: what a sampler emits after
  the generation prompt (its text encoded on its own, then the end-of-turn token);
- `render(messages + more)` extends `render(messages)` (generation prompt included) by the
  turn's ids and `continuation(more)`: a scaffold appends sampled ids verbatim and
  continuations, and never re-tokenizes sampled text.
Elsewhere the ids equal Hugging Face's tokenization of the template's text, which also cuts text
at added tokens. (HF tokenizes the whole string, so the two differ only if BPE would merge across
the generation prompt, e.g. assistant text starting with a newline after "assistant\\n", or if
message text contains special-token strings, which Arbor keeps as plain text.)

Formats: `chatml` / `qwen2.5` (Hermes/Qwen `<tool_call>` JSON, Qwen's tools system block),
`deepseek_v3` (DeepSeek-V3's tool-call tokens), `plain` (headers and EOS only, for tiny models).
Which official templates they equal: `qwen2.5` is Qwen2.5-Instruct's (and Qwen2.5-Coder-Instruct's)
template, token for token; `chatml` is the same template without the default system prompt;
`deepseek_v3` is DeepSeek-V3's published template with its multi-round tool-use fixes (see
`DeepSeekV3`). JSON-string tool-call arguments are read as their object first (as vLLM hands
them to templates; transformers passes the string, which Qwen2.5's template writes quoted).
Those Jinja equivalents ship in envs/chat/templates (`builtin_template`): an exported run
carries its format's. A checkpoint's own Jinja template is rendered by
`envs.chat.jinja_format`.

These formats take no template kwargs (`render(..., template_kwargs=...)` with any raises
ValueError naming them).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Optional, Sequence, Union

from envs.chat.tokenizer import Tokenizer
from envs.chat.toolcalls import (ParsedTurn, ToolCall, arguments_json, make_call,
                                 message_tool_calls, parse_hermes, tool_schemas)

Piece = tuple[Union[str, int], bool]  # (text or token id, trained)
ROLES = ("system", "user", "assistant", "tool")

QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


@dataclasses.dataclass
class RenderedChat:
  """Token ids of a rendered conversation and their loss mask (same length)."""

  ids: list[int]
  loss_mask: list[int]  # 1 where the token was written by the assistant (SFT targets), else 0


def encode_pieces(tok: Tokenizer, pieces: Sequence[Piece]) -> RenderedChat:
  """Encodes pieces to token ids and their loss mask.

  Adjacent text pieces with the same mark are encoded together; a token id or a change of mark
  cuts the text (see the module docstring).

  Args:
    tok: the tokenizer that encodes the text pieces.
    pieces: (text or token id, trained) pairs, in order.

  Returns:
    The ids, with loss mask 1 on the tokens of trained pieces.
  """
  ids: list[int] = []
  mask: list[int] = []
  text, trained = "", False

  def flush():
    part = tok.encode(text) if text else []
    ids.extend(part)
    mask.extend([int(trained)] * len(part))

  for value, t in pieces:
    if isinstance(value, int):
      flush()
      text = ""
      ids.append(value)
      mask.append(int(t))
    elif value:
      if text and t != trained:
        flush()
        text = ""
      text += value
      trained = t
  flush()
  return RenderedChat(ids, mask)


def check_messages(messages: Sequence[dict]) -> None:
  """Checks that messages are role/content dicts as the module docstring describes.

  Raises:
    ValueError: a message is not a dict, has an unknown role, a non-string content (None is
      allowed for an assistant message), or tool_calls on a non-assistant message.
  """
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or m.get("role") not in ROLES:
      raise ValueError(f"messages[{i}]={m!r:.200}: expected a dict with role in {ROLES}")
    content = m.get("content")
    if not (isinstance(content, str) or (content is None and m["role"] == "assistant")):
      raise ValueError(f"messages[{i}].content={content!r:.200}: expected a string")
    if m.get("tool_calls") and m["role"] != "assistant":
      raise ValueError(f"messages[{i}]: only assistant messages carry tool_calls")


class ChatFormat:
  """Base of the formats; subclasses define the pieces of each part of a conversation.

  Args:
    tokenizer: encodes the text and holds the format's control tokens.

  Raises:
    ValueError: the tokenizer lacks a control token the format needs.
  """

  name = "base"
  end_id: int                      # closes an assistant turn
  stop_token_ids: tuple[int, ...]  # tokens that end sampling
  # True: render(messages + more) extends render(messages) by the sampled turn and
  # continuation(more), so a scaffold appends ids. False: the format rewrites earlier turns
  # (e.g. drops their reasoning) and `continuation` is undefined; re-render instead.
  extends_history = True

  def __init__(self, tokenizer: Tokenizer):
    self.tokenizer = tokenizer

  def _no_template_kwargs(self, template_kwargs: Optional[dict]) -> None:
    if template_kwargs:
      raise ValueError(f"chat format {self.name!r} takes no template kwargs, got "
                       f"{', '.join(map(repr, template_kwargs))}")

  def _token(self, token: str) -> int:
    i = self.tokenizer.token_to_id(token)
    if i is None:
      raise ValueError(f"chat format {self.name!r} needs the token {token!r}, which the "
                       f"tokenizer does not have")
    return i

  # --- what subclasses define -------------------------------------------------------------
  def _start(self, messages: list[dict], tools: list[dict]) -> tuple[list[Piece], int]:
    """Pieces of the conversation start (BOS, system prompt, tools) and how many leading
    messages they consumed."""
    raise NotImplementedError

  def _header(self, prev: Optional[str]) -> list[Piece]:
    """Context before an assistant turn (= the generation prompt) after a `prev` message."""
    raise NotImplementedError

  def _body(self, message: dict) -> list[Piece]:
    """An assistant turn's own pieces, without the end-of-turn token."""
    raise NotImplementedError

  def _tail(self) -> list[Piece]:
    """Context right after an assistant turn's end token."""
    return []

  def _other(self, message: dict, prev: Optional[str], next: Optional[str]) -> list[Piece]:
    """Pieces of a system, user or tool message."""
    raise NotImplementedError

  def parse_assistant(self, output_ids: Sequence[int],
                      tools: Optional[Sequence[Any]] = None) -> ParsedTurn:
    """Reads the content and tool calls back from a sampled assistant turn.

    Args:
      output_ids: the sampled ids, with or without the stop token.
      tools: schemas or Tool objects the calls are checked against; None: no check of names
        and arguments.

    Returns:
      The parsed turn; malformed calls are kept with `.error` set (never raised).
    """
    ids = list(output_ids)
    finished = bool(ids) and ids[-1] in self.stop_token_ids
    if finished:
      ids.pop()
    text = self.tokenizer.decode(ids)
    content, calls = parse_hermes(text, tools)
    return ParsedTurn(content, calls, finished, text)

  def tool_call_prefix_ids(self, name: Optional[str] = None,
                           template_kwargs: Optional[dict] = None) -> list[int]:
    """Ids that open an assistant turn with a tool call (OpenAI's tool_choice "required" or a
    named function): appended to the prompt, they force the sampler into a call.

    `parse_assistant(prefix + sampled ids)` reads the forced call back.

    Args:
      name: the function to call; None: any function (the sampler writes the name).
      template_kwargs: those the prompt was rendered with (as in `render`).

    Returns:
      The ids of the call's opening, up to the name (None) or up to the arguments (a name).
    """
    self._no_template_kwargs(template_kwargs)
    text = '<tool_call>\n{"name": "' + (f'{name}", "arguments": ' if name is not None else "")
    return self.tokenizer.encode(text)

  # --- public API -------------------------------------------------------------------------
  def _messages(self, messages: Sequence[dict], prev: Optional[str]) -> list[Piece]:
    pieces = []
    for i, m in enumerate(messages):
      nxt = messages[i + 1]["role"] if i + 1 < len(messages) else None
      if m["role"] == "assistant":
        t = bool(m.get("train", True))
        pieces += self._header(prev) + [(v, t) for v, _ in self._body(m)]
        pieces += [(self.end_id, t)] + self._tail()
      else:
        pieces += self._other(m, prev, nxt)
      prev = m["role"]
    return pieces

  def render(self, messages: Sequence[dict], tools: Optional[Sequence[Any]] = None,
             add_generation_prompt: bool = True,
             template_kwargs: Optional[dict] = None) -> RenderedChat:
    """Renders a conversation to token ids and its loss mask.

    Args:
      messages: the conversation (see the module docstring for the message shape).
      tools: schemas or Tool objects shown to the model; None: no tools.
      add_generation_prompt: end with the context that opens an assistant turn.
      template_kwargs: extra variables of a Jinja chat template (e.g. {"enable_thinking":
        False}); the hand-written formats take none.

    Returns:
      The ids and loss mask: 1 on assistant-written tokens, including each turn's end token; 0
      elsewhere and on messages with "train": False.

    Raises:
      ValueError: a malformed message, one the format cannot place, or template kwargs the
        format does not take.
    """
    self._no_template_kwargs(template_kwargs)
    messages = list(messages)
    check_messages(messages)
    pieces, n = self._start(messages, tool_schemas(tools))
    pieces += self._messages(messages[n:], None)
    if add_generation_prompt:
      pieces += self._header(messages[-1]["role"] if len(messages) > n else None)
    return encode_pieces(self.tokenizer, pieces)

  def continuation(self, messages: Sequence[dict], prev_output_ids: Optional[Sequence[int]] = None,
                   add_generation_prompt: bool = True,
                   template_kwargs: Optional[dict] = None) -> list[int]:
    """Ids to append after a sampled assistant turn.

    They are the turn's closing context, `messages` and the next generation prompt, so that
    prompt + sampled ids + continuation equals `render` of the longer conversation.

    Args:
      messages: all the observations up to the next assistant turn.
      prev_output_ids: the sampled turn. If it does not end with the end-of-turn token (it was
        cut by the token limit, or stopped on another stop token), the end token comes first.
        None: the turn is known to be closed.
      add_generation_prompt: end with the context that opens the next assistant turn.
      template_kwargs: as in `render`.

    Returns:
      The ids to append.

    Raises:
      ValueError: a malformed message, or one the format cannot place.
    """
    self._no_template_kwargs(template_kwargs)
    messages = list(messages)
    check_messages(messages)
    pieces: list[Piece] = []
    if prev_output_ids is not None and (not prev_output_ids or
                                        prev_output_ids[-1] != self.end_id):
      pieces.append((self.end_id, False))
    pieces += self._tail() + self._messages(messages, "assistant")
    if add_generation_prompt:
      pieces += self._header(messages[-1]["role"] if messages else "assistant")
    return encode_pieces(self.tokenizer, pieces).ids

  def assistant_ids(self, message: Union[dict, str],
                    template_kwargs: Optional[dict] = None) -> list[int]:
    """The ids a sampler emits for an assistant turn after the generation prompt.

    Args:
      message: an assistant message, or its raw text.
      template_kwargs: as in `render`.

    Returns:
      The turn's ids, end-of-turn token included.
    """
    self._no_template_kwargs(template_kwargs)
    if isinstance(message, str):
      message = {"role": "assistant", "content": message}
    check_messages([message])
    return encode_pieces(self.tokenizer, self._body(message) + [(self.end_id, True)]).ids


def _hermes_body(message: dict) -> str:
  """Assistant text with Hermes/Qwen tool calls, as Qwen's template writes it."""
  blocks = [f'<tool_call>\n{{"name": "{name}", "arguments": {_qwen_args(args)}}}\n</tool_call>'
            for name, args in message_tool_calls(message)]
  content = message.get("content") or ""
  return "\n".join(([content] if content else []) + blocks)


def _qwen_args(arguments: Any) -> str:
  # Qwen's template dumps a dict with tojson; a JSON-string argument is parsed to dump it the same.
  if isinstance(arguments, str):
    try:
      arguments = json.loads(arguments)
    except json.JSONDecodeError:
      return arguments
  return arguments_json(arguments)


QWEN_TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query."
                   "\n\nYou are provided with function signatures within <tools></tools> XML "
                   "tags:\n<tools>")
QWEN_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function "
                   "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                   '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


class ChatML(ChatFormat):
  """ChatML: `<|im_start|>role\\n...<|im_end|>\\n` turns, tools as in Qwen2.5's template.

  Tools go in a "# Tools" system block, calls are written as
  `<tool_call>\\n{json}\\n</tool_call>`, and consecutive tool results share one user turn of
  `<tool_response>` blocks.

  Args:
    tokenizer: must have `<|im_start|>` and `<|im_end|>`.
    default_system: the system prompt used when the conversation has none (Qwen2.5's "You are
      Qwen..."); None: no system block, as Qwen3.
  """

  name = "chatml"

  def __init__(self, tokenizer: Tokenizer, default_system: Optional[str] = None):
    super().__init__(tokenizer)
    self.default_system = default_system
    self.im_start, self.end_id = self._token("<|im_start|>"), self._token("<|im_end|>")
    eos = tokenizer.eos_id
    self.stop_token_ids = (self.end_id,) + ((eos,) if eos not in (None, self.end_id) else ())

  def _block(self, role: str, text: str) -> list[Piece]:
    return [(self.im_start, False), (f"{role}\n{text}", False), (self.end_id, False),
            ("\n", False)]

  def _start(self, messages, tools):
    n = int(bool(messages) and messages[0]["role"] == "system")
    system = messages[0]["content"] if n else self.default_system
    if tools:
      text = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
      system = ("" if system is None else system + "\n\n") + QWEN_TOOLS_HEAD + text + \
          QWEN_TOOLS_TAIL
    return (self._block("system", system) if system is not None else []), n

  def _header(self, prev):
    return [(self.im_start, False), ("assistant\n", False)]

  def _body(self, message):
    return [(_hermes_body(message), True)]

  def _tail(self):
    return [("\n", False)]

  def _other(self, message, prev, next):
    if message["role"] != "tool":
      return self._block(message["role"], message["content"])
    pieces = [] if prev == "tool" else [(self.im_start, False), ("user", False)]
    pieces.append((f"\n<tool_response>\n{message['content']}\n</tool_response>", False))
    return pieces + ([] if next == "tool" else [(self.end_id, False), ("\n", False)])


class DeepSeekV3(ChatFormat):
  """DeepSeek-V3's chat format, with its tool-call tokens.

  A conversation is
  `<｜begin▁of▁sentence｜>{system}<｜User｜>...<｜Assistant｜>...<｜end▁of▁sentence｜>`,
  tool calls as `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\\n```json\\n
  {arguments}\\n```<｜tool▁call▁end｜>` (joined by "\\n") `<｜tool▁calls▁end｜>`, results as
  `<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>...<｜tool▁output▁end｜>` (joined by "\\n")
  `<｜tool▁outputs▁end｜>`, after which the assistant writes with no `<｜Assistant｜>`.

  This is the published DeepSeek-V3 template where that template is right. It is wrong for
  multi-round tool use, and there we do the evident thing: every tool-calling turn opens with
  `<｜Assistant｜>` (or follows `<｜tool▁outputs▁end｜>`), keeps its content and closes its calls
  section; every group of results is opened and closed. The published template does not show
  tools to the model; we append them to the system prompt (`DEEPSEEK_TOOLS_HEAD` + one JSON
  schema per tool). Leading system messages are joined by "\\n\\n" as in the template; later
  ones cannot be placed and raise ValueError. Assistant text is kept whole (the template drops
  history up to `</think>`, which would break prefix extension).

  Args:
    tokenizer: must have the DeepSeek-V3 control tokens (`TOKENS`).
  """

  name = "deepseek_v3"
  TOKENS = dict(
      bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", user="<｜User｜>",
      assistant="<｜Assistant｜>", calls_begin="<｜tool▁calls▁begin｜>",
      calls_end="<｜tool▁calls▁end｜>", call_begin="<｜tool▁call▁begin｜>",
      call_end="<｜tool▁call▁end｜>", sep="<｜tool▁sep｜>",
      outputs_begin="<｜tool▁outputs▁begin｜>", outputs_end="<｜tool▁outputs▁end｜>",
      output_begin="<｜tool▁output▁begin｜>", output_end="<｜tool▁output▁end｜>")

  def __init__(self, tokenizer: Tokenizer):
    super().__init__(tokenizer)
    self.t = {k: self._token(v) for k, v in self.TOKENS.items()}
    self.end_id = self.t["eos"]
    self.stop_token_ids = (self.end_id,)

  def _start(self, messages, tools):
    n = 0
    while n < len(messages) and messages[n]["role"] == "system":
      n += 1
    system = "\n\n".join(m["content"] for m in messages[:n])
    if tools:
      system = (system + "\n\n" if system else "") + DEEPSEEK_TOOLS_HEAD + "".join(
          "\n```json\n" + json.dumps(t, ensure_ascii=False) + "\n```" for t in tools)
    return [(self.t["bos"], False), (system, False)], n

  def _header(self, prev):
    return [] if prev == "tool" else [(self.t["assistant"], False)]

  def _body(self, message):
    t = self.t
    pieces: list[Piece] = [(message.get("content") or "", True)]
    calls = message_tool_calls(message)
    if calls:
      pieces.append((t["calls_begin"], True))
      for i, (name, args) in enumerate(calls):
        pieces += [("\n", True)] if i else []
        pieces += [(t["call_begin"], True), ("function", True), (t["sep"], True),
                   (f"{name}\n```json\n{arguments_json(args)}\n```", True), (t["call_end"], True)]
      pieces.append((t["calls_end"], True))
    return pieces

  def _other(self, message, prev, next):
    t = self.t
    if message["role"] == "system":
      raise ValueError("deepseek_v3: a system message after the first non-system message "
                       f"cannot be rendered (content {message['content']!r:.80})")
    if message["role"] == "user":
      return [(t["user"], False), (message["content"], False)]
    pieces = [("\n", False)] if prev == "tool" else [(t["outputs_begin"], False)]
    pieces += [(t["output_begin"], False), (message["content"], False), (t["output_end"], False)]
    return pieces + ([] if next == "tool" else [(t["outputs_end"], False)])

  def tool_call_prefix_ids(self, name=None, template_kwargs=None):
    self._no_template_kwargs(template_kwargs)
    t = self.t
    ids = [t["calls_begin"], t["call_begin"]] + self.tokenizer.encode("function") + [t["sep"]]
    return ids + (self.tokenizer.encode(f"{name}\n```json\n") if name is not None else [])

  def parse_assistant(self, output_ids, tools=None):
    """Reads content and tool-call tokens back from a sampled turn.

    Args:
      output_ids: the sampled ids, with or without the stop token.
      tools: schemas or Tool objects the calls are checked against; None: no check.

    Returns:
      The parsed turn; malformed calls are kept with `.error` set (never raised).
    """
    ids = list(output_ids)
    finished = bool(ids) and ids[-1] in self.stop_token_ids
    if finished:
      ids.pop()
    before, calls = parse_deepseek_calls(self.tokenizer, self.t, ids, tools)
    return ParsedTurn(self.tokenizer.decode(before).strip(), calls, finished,
                      self.tokenizer.decode(ids))


def parse_deepseek_calls(tok: Tokenizer, t: dict, ids: list[int],
                         tools: Optional[Sequence[Any]]) -> tuple[list[int], list[ToolCall]]:
  """Splits a turn written with DeepSeek-V3's tool-call tokens.

  Args:
    tok: decodes the ids.
    t: the ids of DeepSeekV3.TOKENS ("calls_begin", "call_begin", "sep", "call_end").
    ids: the turn's ids, without the stop token.
    tools: schemas or Tool objects the calls are checked against; None: no check.

  Returns:
    (the ids before the calls section, the calls in written order; malformed ones with `.error`).
  """
  if t["calls_begin"] not in ids:
    return ids, []
  k = ids.index(t["calls_begin"])
  rest, calls = ids[k + 1:], []
  starts = [i for i, x in enumerate(rest) if x == t["call_begin"]]
  for j, s in enumerate(starts):
    seg = rest[s + 1:starts[j + 1] if j + 1 < len(starts) else len(rest)]
    calls.append(_deepseek_call(tok, t, seg, len(calls), tools))
  return ids[:k], calls


def _deepseek_call(tok: Tokenizer, t: dict, seg: list[int], index: int, tools) -> ToolCall:
  raw = tok.decode(seg)
  if t["call_end"] not in seg:
    return ToolCall("", {}, f"call_{index}", raw=raw, error=(
        f"tool call {index + 1}: never closed by <｜tool▁call▁end｜>: {raw[:200]!r}"))
  seg = seg[:seg.index(t["call_end"])]
  if t["sep"] not in seg:
    return ToolCall("", {}, f"call_{index}", raw=raw, error=(
        f"tool call {index + 1}: expected function<｜tool▁sep｜>NAME, got {raw[:200]!r}"))
  body = tok.decode(seg[seg.index(t["sep"]) + 1:])
  m = re.fullmatch(r"\s*([^\n`]*?)\s*\n```(?:json)?[ \t]*\n?(.*?)\n?```\s*", body, re.S)
  if not m:
    return ToolCall("", {}, f"call_{index}", raw=raw, error=(
        f"tool call {index + 1}: expected NAME, then the arguments in a ```json block, got "
        f"{body[:200]!r}"))
  return make_call(m.group(1), m.group(2), index, tools, raw)


DEEPSEEK_TOOLS_HEAD = ("## Tools\n\nYou can call the following functions (JSON schemas); "
                       "write each call with the tool-call tokens, its arguments as a JSON "
                       "object in a ```json block.\n")


PLAIN_TOOLS_HEAD = ("# Tools\n\nTo call a tool, write\n<tool_call>\n{\"name\": <tool-name>, "
                    "\"arguments\": <args-json-object>}\n</tool_call>\nTools (JSON schemas):")


class Plain(ChatFormat):
  """Headers and EOS only, for tiny models with small vocabularies.

  A conversation is
  `[BOS]### System\\n{system}\\n\\n### User\\n{text}\\n\\n### Assistant\\n{text}[EOS]\\n\\n`,
  tool results are `### Tool\\n{result}\\n\\n`, calls Hermes `<tool_call>` JSON in the assistant
  text. BOS only if the tokenizer has one.

  Args:
    tokenizer: its EOS token ends assistant turns.
  """

  name = "plain"

  def __init__(self, tokenizer: Tokenizer):
    super().__init__(tokenizer)
    self.end_id = tokenizer.eos_id
    self.stop_token_ids = (self.end_id,)

  def _start(self, messages, tools):
    n = int(bool(messages) and messages[0]["role"] == "system")
    pieces = [] if self.tokenizer.bos_id is None else [(self.tokenizer.bos_id, False)]
    system = messages[0]["content"] if n else None
    if tools:
      system = ("" if system is None else system + "\n\n") + PLAIN_TOOLS_HEAD + "".join(
          "\n" + json.dumps(t["function"], ensure_ascii=False) for t in tools)
    if system is not None:
      pieces.append((f"### System\n{system}\n\n", False))
    return pieces, n

  def _header(self, prev):
    return [("### Assistant\n", False)]

  def _body(self, message):
    return [(_hermes_body(message), True)]

  def _tail(self):
    return [("\n\n", False)]

  def _other(self, message, prev, next):
    title = {"system": "System", "user": "User", "tool": "Tool"}[message["role"]]
    return [(f"### {title}\n{message['content']}\n\n", False)]


FORMATS = {
    "chatml": ChatML,
    "qwen2.5": lambda tok: ChatML(tok, default_system=QWEN25_SYSTEM),
    "deepseek_v3": DeepSeekV3,
    "plain": Plain,
}


TEMPLATES_DIR = os.path.join(os.path.dirname(__file__), "templates")


def builtin_template(name: str) -> Optional[str]:
  """The Jinja chat template that renders as the built-in format `name` (token for token, with
  transformers' apply_chat_template), or None where there is none (templates/README.md)."""
  path = os.path.join(TEMPLATES_DIR, f"{name}.jinja")
  if name not in FORMATS or not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    return f.read()


def make_chat(name: str, tokenizer: Tokenizer) -> ChatFormat:
  """Builds a chat format by name.

  Args:
    name: a key of FORMATS.
    tokenizer: the tokenizer the format encodes with.

  Returns:
    The format, with `.name` set to `name`.

  Raises:
    ValueError: an unknown name, or a tokenizer without the format's control tokens.
  """
  if name not in FORMATS:
    raise ValueError(f"chat format {name!r}: expected one of {', '.join(FORMATS)}")
  chat = FORMATS[name](tokenizer)
  chat.name = name
  return chat
