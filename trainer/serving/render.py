"""The one rendering path of the policy server's chat protocols.

Chat Completions, Responses and Anthropic Messages each convert their request into a
`ChatRequest` (OpenAI-style messages as `normalize_messages` returns them: roles system / user /
assistant / tool, an assistant's tool_calls and reasoning_content, a tool result's tool_call_id;
tools as OpenAI function schemas; a tool_choice mode), and `render_prompt` turns it into the
prompt's token ids with the server's envs.chat format. Replies are read back from the sampled ids
by the prompt's `_ChatReader` (`Prompt.reader`), never re-tokenized.

Constrained replies are decided here too, once for every protocol: a request's response format
(Chat Completions' `response_format`, Responses' `text.format`, converted to the Chat
Completions shape) and a forced tool choice ("required" / "named": Chat Completions'
"required" and named function, Responses' "required" and {"type": "function", "name"},
Anthropic's {"type": "any"} and {"type": "tool", "name"}) become a grammar over the reply's
text (`trainer.serving.constrain`), and `Prompt.constraint` holds the SamplingParams fields
that make the engine sample under it. A forced call is therefore always one the chat format's
parser reads, with arguments valid under the tool's parameters schema, and a json_schema reply
validates, whatever the model (unless max_tokens cuts the reply first: finish reason "length").
What constrain refuses (a malformed or, with strict, unsupported schema; a chat format whose
tool-call syntax it cannot express) is a 400 naming the request's own field.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any, Optional, Sequence

from trainer.serving import constrain
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
      "template_kwargs", "tool_choice", "tools", "response_format"); absent ones are named as
      internally.
    response_format: the reply's format in Chat Completions' shape (None, {"type": "text"},
      {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name", "schema",
      "strict"}}).
  """
  messages: list[dict]
  tools: Optional[list[dict]] = None
  mode: str = "none"
  name: Optional[str] = None
  parallel: bool = True
  template_kwargs: Optional[dict] = None
  fields: dict = dataclasses.field(default_factory=dict)
  response_format: Any = None

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
    constraint: SamplingParams fields that constrain the reply ({"constraint": ...}; {} when
      nothing does): `dataclasses.replace(params, **prompt.constraint)`.
  """
  input_ids: list[int]
  prefix: list[int]
  opening: list[int]
  tools: Optional[list[dict]]
  mode: str
  parallel: bool
  constraint: dict = dataclasses.field(default_factory=dict)

  def reader(self, chat, stops: Sequence[str]) -> _ChatReader:
    """The reader of this prompt's samples (reasoning, content, tool calls), cutting `stops`."""
    return _ChatReader(chat, self.tools, self.mode, self.parallel, self.prefix, stops,
                       self.opening)


def _takes_template_kwargs(fn) -> bool:
  return "template_kwargs" in inspect.signature(fn).parameters


def render_prompt(chat, request: ChatRequest) -> Prompt:
  """Renders a chat request to the prompt's ids with the chat format.

  Tool choice "none" renders no tools; "required" appends the format's tool-call opening,
  "named" the opening up to the function's arguments; the rest of the call (and a
  response_format's JSON) is sampled under a grammar (`Prompt.constraint`).

  Args:
    chat: the server's envs.chat format (None: 400).
    request: the request in internal form.

  Returns:
    The Prompt.

  Raises:
    HTTPError: 400 naming the request's field: no chat format, template kwargs the format does
      not take, a conversation the format cannot render, a forced tool call the format cannot
      write, a response format or tool schema that cannot be compiled to a grammar.
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
  return Prompt(rendered + prefix, prefix, opening, request.tools, mode, request.parallel,
                _constraint(chat, request, prefix, opening_kwargs.get("template_kwargs")))


# constrain's names of the fields it refuses -> the internal name of the request's field
_CONSTRAIN_FIELDS = {"response_format": "response_format", "tool_choice": "tool_choice",
                     "tool_name": "tool_choice", "prompt_prefix": "tool_choice",
                     "tools": "tools"}


def _constraint(chat, request: ChatRequest, prefix: list[int],
                template_kwargs: Optional[dict]) -> dict:
  """The SamplingParams fields of the request's response format and forced tool choice.

  Raises:
    HTTPError: 400 naming the request's field (as the request names it) and the value.
  """
  try:
    return constrain.sampling_fields(
        chat, chat.tokenizer, response_format=request.response_format, tools=request.tools,
        tool_choice=request.mode, tool_name=request.name, parallel_tool_calls=request.parallel,
        prompt_prefix=prefix, template_kwargs=template_kwargs)
  except ValueError as e:
    message = str(e)
    head = re.match(r"[a-z_]*", message).group()  # the field constrain names first
    forced = request.mode in ("required", "named")
    where = request.field(_CONSTRAIN_FIELDS.get(
        head, "tool_choice" if forced else "response_format"))
    if head == "response_format":  # as the request names it (Responses: text.format)
      message = where + message[len(head):]
    raise HTTPError(400, message, where) from None
