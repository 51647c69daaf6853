"""A checkpoint's own Jinja chat template, rendered and tokenized as Hugging Face does.

    chat = load_chat("path/to/checkpoint")   # chat_template.jinja or tokenizer_config.json
    r = chat.render(messages, tools, template_kwargs={"enable_thinking": False})
    turn = chat.parse_assistant(output_ids, tools)   # content, reasoning_content, tool_calls

Rendering follows transformers' `apply_chat_template`: the template runs in jinja2's
ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loopcontrols extension,
a `{% generation %}` tag that renders its body, `raise_exception`, `strftime_now`, a `tojson`
filter that is `json.dumps` (ensure_ascii=False by default; indent, separators and sort_keys
taken), and a `namespace` that refuses underscore names. The template sees `messages` (keys whose
value is None dropped; "reasoning_content" filled from "thinking" or "reasoning"), `tools` (JSON
schemas, or None), `documents` (None), `add_generation_prompt`, the tokenizer's special tokens
(`bos_token`, `eos_token`, ...) and the template kwargs. The text is then encoded with the
template's special-token strings as their control tokens (`Tokenizer.encode_special`), so the ids
equal `apply_chat_template(..., tokenize=True)` token for token.

One deliberate difference: special-token strings inside message text, tools or template kwargs
stay text (as `apply_chat_template(..., sanitize_control_tokens=True)` encodes them), so a tool
result cannot forge a turn boundary.

Loss mask (SFT). An assistant message is trained where the rendering shows it as the model wrote
it: with P = the rendering of the messages before it plus the generation prompt, and G = what
the template appends for the message when it is the last one (up to its end-of-turn token), the
full rendering must start with P + G; then G's tokens get mask 1. A turn the template rewrites
later (Qwen3 drops the reasoning of turns before the last user query, Kimi K2 Thinking that of
finished answers) is context only: train such conversations one call per assistant turn
(render(messages[:i]) + assistant_ids(messages[i])), as recorded trajectories are. A token that
BPE merges across the start of a turn is not trained.

Tool calls are parsed by the family the template's markers show: DeepSeek-V3 tool tokens,
Kimi K2's `<|tool_calls_section_begin|>` section, else Hermes/Qwen `<tool_call>` JSON. A template
that mentions `</think>` is a thinking template: `<think>...</think>` (or, after a generation
prompt that opens `<think>`, the text up to `</think>`) is read back as `reasoning_content`.
"""

from __future__ import annotations

import functools
import json
import os
import re
from datetime import datetime
from typing import Any, Optional, Sequence, Union

import jinja2

from envs.chat.formats import (ChatFormat, DeepSeekV3, RenderedChat, check_messages, make_chat,
                               parse_deepseek_calls)
from envs.chat.tokenizer import Tokenizer, _name, _read_config, load_tokenizer
from envs.chat.toolcalls import ParsedTurn, ToolCall, make_call, parse_hermes, tool_schemas

CHAT_TEMPLATE_FILE = "chat_template.jinja"       # transformers' file for the default template
CHAT_TEMPLATE_DIR = "additional_chat_templates"  # and its folder of named ones
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
KIMI_TOKENS = dict(section_begin="<|tool_calls_section_begin|>",
                   section_end="<|tool_calls_section_end|>", call_begin="<|tool_call_begin|>",
                   argument_begin="<|tool_call_argument_begin|>", call_end="<|tool_call_end|>")
_RESERVED = ("messages", "tools", "documents", "add_generation_prompt")
# Private-use characters that wrap special-token strings found in user data while the template
# renders; the encoder turns a wrapped string into plain-text ids.
_OPEN, _CLOSE = "\U000f0000", "\U000f0001"
# Stand-ins for a tool's name and arguments, to find where a template writes them.
_NAME, _ARGS = "\U000f0002", "\U000f0003"


# ------------------------------------------------------------------------------ templates


def read_chat_templates(directory: str) -> Union[None, str, dict[str, str]]:
  """Reads a checkpoint's chat template(s) as transformers does.

  `chat_template.jinja` (the default) and `additional_chat_templates/*.jinja` (named) take
  priority over tokenizer_config.json's "chat_template", which is a string or a list of
  {"name", "template"}.

  Args:
    directory: the checkpoint or tokenizer directory (or a tokenizer file in it).

  Returns:
    The template, a dict name -> template, or None when the directory has none.

  Raises:
    ValueError: tokenizer_config.json's "chat_template" is neither a string nor a list of
      {"name", "template"}.
  """
  directory = directory if os.path.isdir(directory) else os.path.dirname(directory)
  templates = {}
  path = os.path.join(directory, CHAT_TEMPLATE_FILE)
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      templates["default"] = f.read()
  extra = os.path.join(directory, CHAT_TEMPLATE_DIR)
  if os.path.isdir(extra):
    for file in sorted(os.listdir(extra)):
      if file.endswith(".jinja"):
        with open(os.path.join(extra, file), encoding="utf-8") as f:
          templates[file[:-len(".jinja")]] = f.read()
  if templates:
    return templates["default"] if list(templates) == ["default"] else templates
  value = _read_config(directory).get("chat_template")
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str) and
                                     isinstance(t.get("template"), str) for t in value):
    return {t["name"]: t["template"] for t in value}
  raise ValueError(f"{directory}/tokenizer_config.json: chat_template={value!r:.100}: expected "
                   "a string or a list of {name, template}")


def special_tokens_from_config(directory: str) -> dict[str, str]:
  """The special-token strings a template sees, as transformers' `special_tokens_map`.

  Args:
    directory: holds tokenizer_config.json (missing: no special tokens).

  Returns:
    bos_token, eos_token, unk_token, ... -> their strings, for those the config sets.
  """
  config = _read_config(directory)
  return {k: _name(config[k]) for k in SPECIAL_TOKEN_NAMES if _name(config.get(k)) is not None}


class _TemplateError(Exception):
  """raise_exception() in a template."""


@functools.lru_cache(maxsize=32)
def compile_template(source: str):
  """Compiles a chat template in a sandbox with the globals transformers gives templates.

  Args:
    source: the Jinja template text.

  Returns:
    The jinja2 Template.

  Raises:
    ValueError: the template does not compile (the message names the line).
  """
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class Generation(jinja2.ext.Extension):
    # transformers marks assistant text with {% generation %}...{% endgeneration %}; the
    # loss mask here has its own rule (module docstring), so the tag only renders its body.
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  class Namespace(jinja2.utils.Namespace):
    # As transformers': no underscore names, so a template cannot reach Python internals.
    def __init__(*args, **kwargs):
      self, rest = args[0], args[1:]
      attrs = dict(*rest, **kwargs)
      for name in attrs:
        Namespace._check(name)
      jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
      Namespace._check(name)
      jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
      if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r}: underscore names "
                                              "are not allowed")

  def raise_exception(message):
    raise _TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML; templates expect plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[Generation, jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  class Dict:  # dict(...) and dict.fromkeys(...), without the type itself
    def __call__(self, *args, **kwargs):
      return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
      return dict.fromkeys(*args, **kwargs)

  env.globals.update(raise_exception=raise_exception, namespace=Namespace, dict=Dict(),
                     strftime_now=lambda fmt: datetime.now().strftime(fmt))
  try:
    return env.from_string(source)
  except jinja2.TemplateSyntaxError as e:
    raise ValueError(f"chat template does not compile: line {e.lineno}: {e.message}") from e


def template_family(source: str) -> str:
  """The tool-call syntax a template writes: "deepseek_v3", "kimi_k2" or "hermes"."""
  if DeepSeekV3.TOKENS["calls_begin"] in source:
    return "deepseek_v3"
  if KIMI_TOKENS["section_begin"] in source:
    return "kimi_k2"
  return "hermes"


# ------------------------------------------------------------------------------ the format


def _plain(value: Any, marker: Optional[re.Pattern], where: str) -> Any:
  """A copy of JSON-like data for the template, special-token strings in its strings wrapped."""
  if isinstance(value, str):
    value = value.replace(_OPEN, "").replace(_CLOSE, "")
    return marker.sub(_OPEN + r"\g<0>" + _CLOSE, value) if marker else value
  if value is None or isinstance(value, (bool, int, float)):
    return value
  if isinstance(value, dict):
    return {k: _plain(v, marker, f"{where}.{k}") for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v, marker, f"{where}[{i}]") for i, v in enumerate(value)]
  raise ValueError(f"{where}: a {type(value).__name__} is not JSON data a template can read")


def _template_message(message: dict) -> dict:
  # As apply_chat_template: keys whose value is None are dropped, reasoning fields aliased.
  m = {k: v for k, v in message.items() if v is not None}
  reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if k in m),
                   None)
  if reasoning is not None:
    m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
  return m


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n


class JinjaChat(ChatFormat):
  """A chat format that runs a checkpoint's Jinja chat template (see the module docstring).

  Args:
    tokenizer: the checkpoint's tokenizer; it must have `encode_special`.
    template: the template, or a dict name -> template ("default" used without tools,
      "tool_use" when tools are given, as transformers chooses).
    special_tokens: the special-token strings the template sees (bos_token, eos_token, ...);
      None: the tokenizer's BOS and EOS.
    template_kwargs: default template kwargs (e.g. {"enable_thinking": False}); a call's own
      take precedence.
    name: the format's name.

  Raises:
    ValueError: the template does not compile, a dict has no "default", the tokenizer lacks
      the family's tool-call tokens or `encode_special`.
  """

  def __init__(self, tokenizer: Tokenizer, template: Union[str, dict[str, str]], *,
               special_tokens: Optional[dict[str, str]] = None,
               template_kwargs: Optional[dict] = None, name: str = "jinja"):
    super().__init__(tokenizer)
    self.name = name
    if not hasattr(tokenizer, "encode_special"):
      raise ValueError(f"chat format {name!r}: the tokenizer {type(tokenizer).__name__} has no "
                       "encode_special")
    self.templates = {"default": template} if isinstance(template, str) else dict(template)
    if "default" not in self.templates:
      raise ValueError(f"chat template: no 'default' among the named templates "
                       f"{sorted(self.templates)}")
    for source in self.templates.values():
      compile_template(source)
    if special_tokens is None:
      special_tokens = {"eos_token": tokenizer.decode([tokenizer.eos_id])}
      if tokenizer.bos_id is not None:
        special_tokens["bos_token"] = tokenizer.decode([tokenizer.bos_id])
    self.special_tokens = dict(special_tokens)
    self.template_kwargs = self._check_kwargs(template_kwargs or {})
    specials = {tokenizer.decode([i]) for i in tokenizer.special_ids}
    longest = sorted((s for s in specials if s), key=len, reverse=True)
    self._marker = re.compile("|".join(map(re.escape, longest))) if longest else None
    self._split = re.compile(f"{_OPEN}({self._marker.pattern if longest else '(?!)'}){_CLOSE}"
                             f"|[{_OPEN}{_CLOSE}]")
    source = "\n".join(self.templates.values())
    self.family = template_family(source)
    self.thinking = "</think>" in source
    if self.family == "deepseek_v3":
      self.t = {k: self._token(v) for k, v in DeepSeekV3.TOKENS.items()}
    elif self.family == "kimi_k2":
      self.t = {k: self._token(v) for k, v in KIMI_TOKENS.items()}
    self._end_text: Optional[str] = None  # set by _find_turn_end
    self._find_turn_end()
    self.extends_history = self._probe_extension()

  # --- rendering ------------------------------------------------------------------------
  def _check_kwargs(self, kwargs: dict) -> dict:
    for k in kwargs:
      if k in _RESERVED:
        raise ValueError(f"template_kwargs[{k!r}]: reserved (set it with the render arguments)")
    return dict(kwargs)

  def _kwargs(self, template_kwargs: Optional[dict]) -> dict:
    return {**self.template_kwargs, **self._check_kwargs(template_kwargs or {})}

  def _text(self, messages: Sequence[dict], tools: Optional[list[dict]], generation: bool,
            kwargs: dict) -> str:
    """The template's text, special-token strings from the data wrapped in markers."""
    name = "tool_use" if tools is not None and "tool_use" in self.templates else "default"
    template = compile_template(self.templates[name])
    msgs = [_plain(_template_message(m), self._marker, f"messages[{i}]")
            for i, m in enumerate(messages)]
    variables = {**self.special_tokens, **_plain(kwargs, self._marker, "template_kwargs")}
    try:
      return template.render(messages=msgs, tools=_plain(tools, self._marker, "tools"),
                             documents=None, add_generation_prompt=generation, **variables)
    except _TemplateError as e:  # raise_exception(message)
      raise ValueError(f"chat template {self.name!r}: {e}") from e
    except (jinja2.TemplateError, TypeError) as e:  # e.g. a key the template needs is missing
      raise ValueError(f"chat template {self.name!r} cannot render this conversation: "
                       f"{type(e).__name__}: {e}") from e

  def _encode(self, text: str) -> list[int]:
    """Ids of a rendering: template text with its special tokens, wrapped strings as text."""
    parts = self._split.split(text)
    ids = self.tokenizer.encode_special(parts[0]) if parts[0] else []
    for i, part in enumerate(parts[1:], start=1):
      if part:  # odd parts are wrapped strings (None: a lone marker, which only cuts the text)
        ids += self.tokenizer.encode(part) if i % 2 else self.tokenizer.encode_special(part)
    return ids

  def _turn_text(self, message: dict, kwargs: dict) -> Optional[tuple[str, str]]:
    """(P, G): the prompt after a user message and what the template writes for an assistant
    message when it is the last one (up to its end-of-turn token); None if P is not a prefix."""
    context = [{"role": "user", "content": "x"}]
    prompt = self._text(context, None, True, kwargs)
    full = self._text(context + [message], None, False, kwargs)
    if not full.startswith(prompt):
      return None
    turn = full[len(prompt):]
    end = turn.rfind(self._end_text) if self._end_text else -1
    return prompt, (turn[:end + len(self._end_text)] if end >= 0 else turn)

  def _find_turn_end(self) -> None:
    """Finds the end-of-turn token: the last control token the template writes after a short
    assistant reply."""
    try:
      pair = self._turn_text({"role": "assistant", "content": "Hi"}, self.template_kwargs)
    except ValueError:  # the template refuses a bare user/assistant exchange
      pair = None
    ids = self._encode(pair[1]) if pair else []  # no turn to read: the end token is EOS
    ends = [i for i in ids if i in self.tokenizer.special_ids]
    self.end_id = ends[-1] if ends else self.tokenizer.eos_id
    self._end_text = self.tokenizer.decode([self.end_id])
    eos = self.tokenizer.eos_id
    self.stop_token_ids = (self.end_id,) + ((eos,) if eos not in (None, self.end_id) else ())
    # A prompt that opens <think> (Qwen3 Thinking-2507): the reply starts inside the reasoning.
    try:
      gen = self._text([{"role": "user", "content": "x"}], None, True, self.template_kwargs)
      bare = self._text([{"role": "user", "content": "x"}], None, False, self.template_kwargs)
      self._opens_think = gen.startswith(bare) and gen[len(bare):].rstrip().endswith("<think>")
    except ValueError:
      self._opens_think = False

  def render(self, messages: Sequence[dict], tools: Optional[Sequence[Any]] = None,
             add_generation_prompt: bool = True,
             template_kwargs: Optional[dict] = None) -> RenderedChat:
    """Renders a conversation with the template (see `ChatFormat.render`).

    The ids equal transformers' `apply_chat_template(..., tokenize=True)`; the loss mask marks
    the assistant turns the rendering shows as written (module docstring).

    Raises:
      ValueError: a malformed message, reserved template kwargs, or the template's
        raise_exception.
    """
    messages = list(messages)
    check_messages(messages)
    kwargs = self._kwargs(template_kwargs)
    schemas = None if tools is None else tool_schemas(tools)
    text = self._text(messages, schemas, add_generation_prompt, kwargs)
    ids = self._encode(text)
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
      if m["role"] != "assistant" or not m.get("train", True):
        continue
      prompt = self._text(messages[:i], schemas, True, kwargs) if i else None
      full = self._text(messages[:i + 1], schemas, False, kwargs)
      if prompt is None or not full.startswith(prompt):
        continue
      turn = full[len(prompt):]
      end = turn.rfind(self._end_text)
      turn = turn[:end + len(self._end_text)] if end >= 0 else turn
      if not turn or not text.startswith(prompt + turn):
        continue  # rewritten by later messages: context only
      head = self._encode(prompt)
      start = _common_prefix(head, ids)
      start += start < len(head)  # a token merged across the turn's start is not trained
      stop = _common_prefix(self._encode(prompt + turn), ids)
      mask[start:stop] = [1] * max(0, stop - start)
    return RenderedChat(ids, mask)

  def assistant_ids(self, message: Union[dict, str],
                    template_kwargs: Optional[dict] = None) -> list[int]:
    """The ids the template writes for an assistant message as the last turn of a conversation
    (after the generation prompt, end-of-turn token included): what a sampler emits.

    Parts the template drops from a last turn (Kimi K2 Thinking drops a final answer's
    reasoning) are not there.
    """
    if isinstance(message, str):
      message = {"role": "assistant", "content": message}
    check_messages([message])
    pair = self._turn_text(message, self._kwargs(template_kwargs))
    if pair is None:
      raise ValueError(f"chat template {self.name!r}: the generation prompt is not a prefix of "
                       "the rendered assistant turn")
    return self._encode(pair[1])

  def continuation(self, messages: Sequence[dict], prev_output_ids: Optional[Sequence[int]] = None,
                   add_generation_prompt: bool = True,
                   template_kwargs: Optional[dict] = None) -> list[int]:
    """Ids to append after a sampled turn (see `ChatFormat.continuation`).

    They are the template's text after an assistant turn's end token, for a conversation that
    ends with `messages` (checked on a probe conversation at construction: `extends_history`).

    Raises:
      ValueError: the template rewrites history (`extends_history` is False): re-render the
        conversation with `render` instead; or a malformed message.
    """
    if not self.extends_history:
      raise ValueError(f"chat template {self.name!r} rewrites earlier turns (extends_history "
                       "is False): render the whole conversation instead of continuing it")
    messages = list(messages)
    check_messages(messages)
    kwargs = self._kwargs(template_kwargs)
    head = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    before = self._text(head, None, False, kwargs)
    after = self._text(head + messages, None, add_generation_prompt, kwargs)
    cut = before.rfind(self._end_text) + len(self._end_text)
    if cut < len(self._end_text) or after[:cut] != before[:cut]:
      raise ValueError(f"chat template {self.name!r}: cannot continue after an assistant turn")
    ids = self._encode(after[cut:])
    if prev_output_ids is not None and (not prev_output_ids or prev_output_ids[-1] != self.end_id):
      ids = [self.end_id] + ids
    return ids

  def _probe_extension(self) -> bool:
    """Whether render(longer) == render(shorter) + sampled turn + continuation on a probe
    conversation with tools, reasoning, tool calls and a second user query."""
    tools = [{"type": "function", "function": {
        "name": "bash", "description": "Run a command.", "parameters": {
            "type": "object", "properties": {"command": {"type": "string"}},
            "required": ["command"]}}}]

    def call(i, command):  # arguments a JSON string, as OpenAI clients send them
      return {"id": f"functions.bash:{i}", "type": "function",
              "function": {"name": "bash", "arguments": json.dumps({"command": command})}}

    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Fix it."},
        {"role": "assistant", "content": "Looking.", "reasoning_content": "Start with ls.",
         "tool_calls": [call(0, "ls")]},
        {"role": "tool", "content": "a.py", "tool_call_id": "functions.bash:0", "name": "bash"},
        {"role": "assistant", "content": "", "tool_calls": [call(0, "cat a.py"),
                                                           call(1, "pwd")]},
        {"role": "tool", "content": "x = 1", "tool_call_id": "functions.bash:0", "name": "bash"},
        {"role": "tool", "content": "/src", "tool_call_id": "functions.bash:1", "name": "bash"},
        {"role": "assistant", "content": "Fixed.", "reasoning_content": "Done."},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "Welcome."},
    ]
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    try:
      for a, b in zip(turns, turns[1:] + [len(msgs)]):
        out = self.assistant_ids(msgs[a])
        last = b == len(msgs)
        want = self.render(msgs[:b], tools, add_generation_prompt=not last).ids
        got = (self.render(msgs[:a], tools).ids + out +
               self.continuation(msgs[a + 1:b], out, add_generation_prompt=not last))
        if got != want:
          return False
    except ValueError:
      return False
    return True

  # --- parsing --------------------------------------------------------------------------
  def _split_reasoning(self, text: str) -> tuple[Optional[str], str]:
    """(reasoning_content, the rest) of a thinking model's turn."""
    if not self.thinking:
      return None, text
    if "</think>" in text:
      reasoning, rest = text.split("</think>", 1)
      reasoning = reasoning.split("<think>", 1)[1] if "<think>" in reasoning else reasoning
      return reasoning.strip("\n"), rest
    stripped = text.lstrip()
    if stripped.startswith("<think>"):  # cut off while thinking
      return stripped[len("<think>"):].strip("\n"), ""
    if self._opens_think:  # the prompt opened <think> and the turn never closed it
      return text.strip("\n"), ""
    return None, text

  def parse_assistant(self, output_ids: Sequence[int],
                      tools: Optional[Sequence[Any]] = None) -> ParsedTurn:
    """Reads reasoning, content and tool calls back from a sampled turn, in the template's
    family (module docstring). Malformed calls are kept with `.error` set (never raised)."""
    ids = list(output_ids)
    finished = bool(ids) and ids[-1] in self.stop_token_ids
    if finished:
      ids.pop()
    dec = self.tokenizer.decode
    text = dec(ids)
    if self.family == "hermes":
      reasoning, rest = self._split_reasoning(text)
      content, calls = parse_hermes(rest, tools)
    else:
      if self.family == "deepseek_v3":
        before, calls = parse_deepseek_calls(self.tokenizer, self.t, ids, tools)
      else:
        before, calls = self._kimi_calls(ids, tools)
      reasoning, rest = self._split_reasoning(dec(before))
      content = rest.strip()
    return ParsedTurn(content, calls, finished, text, reasoning)

  def _kimi_calls(self, ids: list[int], tools) -> tuple[list[int], list[ToolCall]]:
    """Splits a turn with Kimi K2's tool-call section (ids before it, the calls)."""
    t, dec = self.t, self.tokenizer.decode
    if t["section_begin"] not in ids:
      return ids, []
    k = ids.index(t["section_begin"])
    rest = ids[k + 1:]
    if t["section_end"] in rest:
      rest = rest[:rest.index(t["section_end"])]
    starts = [i for i, x in enumerate(rest) if x == t["call_begin"]]
    calls = []
    for j, s in enumerate(starts):
      seg = rest[s + 1:starts[j + 1] if j + 1 < len(starts) else len(rest)]
      n, raw = len(calls), dec(seg)
      if t["call_end"] not in seg:
        calls.append(ToolCall("", {}, f"call_{n}", raw=raw, error=(
            f"tool call {n + 1}: never closed by <|tool_call_end|>: {raw[:200]!r}")))
        continue
      seg = seg[:seg.index(t["call_end"])]
      m = None
      if t["argument_begin"] in seg:
        a = seg.index(t["argument_begin"])
        call_id, arguments = dec(seg[:a]).strip(), dec(seg[a + 1:])
        m = re.fullmatch(r"(?:functions\.)?([^:\s]+):\d+", call_id)
      if m is None:
        calls.append(ToolCall("", {}, f"call_{n}", raw=raw, error=(
            f"tool call {n + 1}: expected functions.NAME:INDEX<|tool_call_argument_begin|>"
            f"ARGUMENTS, got {raw[:200]!r}")))
        continue
      call = make_call(m.group(1), arguments, n, tools, raw)
      call.id = call_id  # Kimi K2 answers a call by this id ("## Return of functions.NAME:0")
      calls.append(call)
    return ids[:k], calls

  def tool_call_prefix_ids(self, name: Optional[str] = None,
                           template_kwargs: Optional[dict] = None) -> list[int]:
    """Ids that open an assistant turn with a tool call, as the template writes one after the
    generation prompt (a thinking template's empty reasoning included, unless the prompt of
    these template kwargs already closed it): up to the name (None) or up to the arguments (a
    name).

    Raises:
      ValueError: the template writes no tool calls.
    """
    call = {"id": f"functions.{_NAME}:0", "type": "function",
            "function": {"name": _NAME, "arguments": _ARGS}}
    pair = self._turn_text({"role": "assistant", "content": "", "tool_calls": [call]},
                           self._kwargs(template_kwargs))
    turn = pair[1] if pair else ""
    if _NAME not in turn or _ARGS not in turn:
      raise ValueError(f"chat template {self.name!r} does not write tool calls")
    if name is None:
      return self._encode(turn[:turn.index(_NAME)])
    head = turn[:turn.index(_ARGS)]
    head = head[:-1] if head.endswith('"') else head  # tojson quoted the stand-in string
    marked = _plain(name, self._marker, "name")
    return self._encode(head.replace(_NAME, marked))


def load_chat(directory: str, tokenizer: Optional[Tokenizer] = None, name: Optional[str] = None,
              template_kwargs: Optional[dict] = None) -> ChatFormat:
  """The chat format of a checkpoint: its own template when it has one, else a named format.

  Args:
    directory: the checkpoint or tokenizer directory (chat_template.jinja,
      additional_chat_templates/, tokenizer_config.json), or a tokenizer file in it.
    tokenizer: its tokenizer; None: `load_tokenizer(directory)`.
    name: a key of envs.chat.FORMATS, used when the directory has no template.
    template_kwargs: default template kwargs of the checkpoint's template.

  Returns:
    A JinjaChat, or the named hand-written format.

  Raises:
    ValueError: no template and no name, template kwargs for a hand-written format, or what
      JinjaChat / make_chat raise.
  """
  tokenizer = tokenizer if tokenizer is not None else load_tokenizer(directory)
  directory = directory if os.path.isdir(directory) else os.path.dirname(directory)
  templates = read_chat_templates(directory)
  if templates is not None:
    return JinjaChat(tokenizer, templates, special_tokens=special_tokens_from_config(directory),
                     template_kwargs=template_kwargs)
  if name is None:
    raise ValueError(f"{directory}: no chat template ({CHAT_TEMPLATE_FILE} or "
                     "tokenizer_config.json's chat_template) and no chat format name given")
  chat = make_chat(name, tokenizer)
  chat._no_template_kwargs(template_kwargs)
  return chat
