"""The one rendering path of the policy server's chat protocols.

Chat Completions, Responses and Anthropic Messages each convert their request into a
`ChatRequest` (OpenAI-style messages as `normalize_messages` returns them: roles system / user /
assistant / tool, an assistant's tool_calls and reasoning_content, a tool result's tool_call_id;
tools as OpenAI function schemas; a tool_choice mode), and `render_prompt` turns it into the
prompt's token ids with the server's envs.chat format. Replies are read back from the sampled ids
by the prompt's `_ChatReader` (`Prompt.reader`), never re-tokenized.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Optional, Sequence

from trainer.serving.text import _ChatReader
from trainer.serving.validate import HTTPError


@dataclasses.dataclass
class ChatRequest:
  """A chat request in the form every protocol converts to.

  Attributes:
    messages: normalized messages (see `trainer.serving.validate.normalize_messages`).
    tools: OpenAI function schemas ({"type": "function", "function": {...}}), or None.
    mode: the tool_choice mode: "none" | "auto" | "required" | "named".
    name: the function of mode "named".
    parallel: several tool calls per reply (False: the first one is kept).
    template_kwargs: extra variables of a Jinja chat template, or None.
    fields: the request's own field names for errors, by internal name ("messages",
      "template_kwargs", "tool_choice"); absent ones are named as internally.
  """
  messages: list[dict]
  tools: Optional[list[dict]] = None
  mode: str = "none"
  name: Optional[str] = None
  parallel: bool = True
  template_kwargs: Optional[dict] = None
  fields: dict = dataclasses.field(default_factory=dict)

  def field(self, internal: str) -> str:
    """The request's name of an internal field (for error messages)."""
    return self.fields.get(internal, internal)


@dataclasses.dataclass
class Prompt:
  """A rendered chat request.

  Attributes:
    input_ids: what the engine continues: the rendered conversation and the forced opening.
    prefix: the forced tool-call opening at the end of input_ids ([] when none).
    opening: the format's tool-call opening (what the reader holds back while streaming).
    tools, mode, parallel: as in the request.
  """
  input_ids: list[int]
  prefix: list[int]
  opening: list[int]
  tools: Optional[list[dict]]
  mode: str
  parallel: bool

  def reader(self, chat, stops: Sequence[str]) -> _ChatReader:
    """The reader of this prompt's samples (reasoning, content, tool calls), cutting `stops`."""
    return _ChatReader(chat, self.tools, self.mode, self.parallel, self.prefix, stops,
                       self.opening)


def _takes_template_kwargs(fn) -> bool:
  return "template_kwargs" in inspect.signature(fn).parameters


def render_prompt(chat, request: ChatRequest) -> Prompt:
  """Renders a chat request to the prompt's ids with the chat format.

  Tool choice "none" renders no tools; "required" appends the format's tool-call opening,
  "named" the opening up to the function's arguments (the sampler then writes a call).

  Args:
    chat: the server's envs.chat format (None: 400).
    request: the request in internal form.

  Returns:
    The Prompt.

  Raises:
    HTTPError: 400 naming the request's field: no chat format, template kwargs the format does
      not take, a conversation the format cannot render, or a forced tool call the format cannot
      write.
  """
  if chat is None:
    raise HTTPError(400, "no tokenizer/chat format loaded: use /generate, or start the server "
                         "with a checkpoint that has tokenizer files (or --tokenizer)")
  kwargs = {}
  if request.template_kwargs:
    if not _takes_template_kwargs(chat.render):
      where = request.field("template_kwargs")
      raise HTTPError(400, f"{where}={request.template_kwargs!r:.100}: this chat format "
                           f"({chat.name}) takes no template kwargs", where)
    kwargs["template_kwargs"] = request.template_kwargs
  # The forced opening is written as after this prompt (e.g. with thinking off).
  opening_kwargs = kwargs if _takes_template_kwargs(chat.tool_call_prefix_ids) else {}
  mode = request.mode
  try:
    rendered = chat.render(request.messages, None if mode == "none" else request.tools,
                           add_generation_prompt=True, **kwargs).ids
  except (ValueError, KeyError, TypeError) as e:
    param = request.field("template_kwargs" if kwargs and "template kwargs" in str(e)
                          else "messages")
    raise HTTPError(400, f"{param}: {e}", param) from None
  try:
    opening = [] if mode == "none" else chat.tool_call_prefix_ids(None, **opening_kwargs)
  except ValueError as e:  # a template that writes no tool calls cannot be forced into one
    if mode in ("required", "named"):
      where = request.field("tool_choice")
      raise HTTPError(400, f"{where}: {e}", where) from None
    opening = []
  prefix = opening if mode == "required" else []  # the forced opening, part of the prompt
  if mode == "named":
    prefix = chat.tool_call_prefix_ids(request.name, **opening_kwargs)
  return Prompt(rendered + prefix, prefix, opening, request.tools, mode, request.parallel)
