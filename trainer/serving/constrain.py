"""Grammar-constrained decoding: JSON output and forced tool calls as engine token masks.

An OpenAI request's `response_format` ({"type": "json_object"} or {"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}) and `tool_choice` ("required" or a named
function) become a grammar over the reply's text, compiled with llguidance against the
server's tokenizer; the engine samples each token under the grammar's mask
(`models.engine.constraint`), so the reply parses and validates by construction (unless it
runs out of max_tokens first: then finish_reason is "length" and the text is cut).

The policy server makes this call once for every chat protocol, in `trainer.serving.render`
(`Prompt.constraint`; Responses' text.format and Anthropic's tool_choice converted to the
arguments below). How a caller wires it, after `render_prompt` and `sampling_params` (one call):

    from trainer.serving import constrain
    fields = constrain.sampling_fields(
        self.chat, self.tokenizer,
        response_format=body.get("response_format"),  # None, {"type": "text"}, json_object,
                                                      # or json_schema (as the client sent it)
        tools=tools,                # the request's tools (OpenAI schemas), or None
        tool_choice=mode,           # "none" | "auto" | "required" | "named" (validate._tool_choice)
        tool_name=name,             # the named function ("named"), else None
        parallel_tool_calls=parallel,
        prompt_prefix=prompt.prefix,  # the forced tool-call opening render_prompt appended
                                      # to input_ids ([] when none)
        template_kwargs=kwargs)     # the chat_template_kwargs the prompt was rendered with
    params = dataclasses.replace(params, **fields)   # {} when nothing is constrained

`sampling_fields` raises ValueError naming the field and value for a malformed
response_format, a schema llguidance cannot compile (strict: any keyword it does not
implement), a tool_name not among the tools, or a chat format whose tool-call syntax it cannot
express; the endpoint answers 400 with the message. The reply is read back as usual
(`prompt.reader(...)`: the format's own tool-call parser).

What each request becomes (the grammar is over the reply's text, then one of the format's
stop tokens, which ends the sample):
- response_format json_object: one JSON object; json_schema: one JSON value valid under the
  schema. With tool_choice "auto" and tools, the reply may instead be tool calls; with
  "required" or a named function response_format is not used (the reply has no content).
- tool_choice "required": one call (or, with parallel_tool_calls, several) of any of the
  tools, in the format's syntax, with ARGS valid under that tool's parameters schema (Hermes:
  `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`); "named": calls of that
  tool only.
  When the prompt already ends with the format's forced opening (`prompt_prefix`), the grammar
  starts after it.
- JSON is written compactly with ", " and ": " separators (as the chat templates' json.dumps
  writes tool calls), so a model cannot loop on whitespace; `whitespace_flexible=True` allows
  any JSON whitespace.
- json_schema "strict": true refuses a schema with a keyword llguidance does not implement;
  otherwise such keywords are ignored (the output then satisfies the rest of the schema).

Formats (`call_syntax`): those that write Hermes/Qwen calls (`<tool_call>` JSON, read by
`envs.chat.toolcalls.parse_hermes`): chatml, qwen2.5, plain, and checkpoint templates of that
family (a thinking template's opening, e.g. an empty `<think></think>`, comes first as
`tool_call_prefix_ids` writes it); and DeepSeek-V3's tool-call tokens (deepseek_v3 and
templates of that family): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
\\n```json\\nARGS\\n```<｜tool▁call▁end｜>` (joined by "\\n") `<｜tool▁calls▁end｜>`. Kimi K2's
call syntax is refused for tool_choice (response_format works with every format).

Tokenizers: a Hugging Face `tokenizer.json` (envs.chat.tokenizer.HFTokenizer: llguidance reads
its byte-level / byte-fallback vocabulary itself) or a sentencepiece model
(SentencePieceTokenizer: each piece's bytes, "▁" as a space, `<0xNN>` byte-fallback pieces as
their byte, control pieces as special tokens). Compiled grammars are cached per (grammar,
tokenizer, stop tokens): a repeated schema costs a copy of the compiled matcher.

Library: llguidance (Rust, no Python dependencies; JSON schema and Lark grammars).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from typing import Any, Optional, Sequence

import numpy as np

from envs.chat.formats import DeepSeekV3
from envs.chat.toolcalls import tool_schemas

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_NAME_OPEN = '{"name": "'
_ARGS_OPEN = '", "arguments": '
CACHE_SIZE = 64  # compiled grammars kept (least recently used dropped)
_LOCK = threading.Lock()
_TOKENIZERS: dict[tuple, tuple[Any, Any]] = {}  # key -> (tokenizer, LLTokenizer)
_MATCHERS: collections.OrderedDict = collections.OrderedDict()  # (grammar, key) -> LLMatcher


class _State:
  """One sample's grammar state (a `models.engine.constraint.TokenConstraint`).

  The grammar's text complete, the matcher allows only the stop tokens; the sample is done
  once it took one (so a reply ends with the chat format's end-of-turn token, as unconstrained
  replies do).
  """

  def __init__(self, matcher, n_words: int, stop_ids: frozenset):
    self._m, self._stop_ids, self._last = matcher, stop_ids, None
    self._mask = np.zeros((1, n_words), np.int32)

  def allowed(self) -> np.ndarray:
    """Packed bitmask int32 [ceil(tokenizer vocab / 32)] of the tokens that may come next."""
    import llguidance.numpy

    if self._m.is_error():
      raise RuntimeError(f"constraint: the grammar matcher failed: {self._m.get_error()}")
    llguidance.numpy.fill_next_token_bitmask(self._m, self._mask)
    return self._mask[0].copy()

  def advance(self, token_id: int) -> None:
    if not self._m.consume_token(int(token_id)):
      raise RuntimeError(f"constraint: token {token_id} is not allowed by the grammar: "
                         f"{self._m.get_error()}")
    self._last = int(token_id)

  def is_done(self) -> bool:
    return self._m.is_stopped() and self._last in self._stop_ids


class GrammarConstraint:
  """A compiled grammar: what `SamplingParams.constraint` holds
  (`models.engine.constraint.Constraint`).

  Args:
    matcher: the compiled llguidance matcher in its start state (never advanced itself).
    vocab_size: the tokenizer vocabulary the masks cover.
    grammar: the grammar's text (llguidance Lark), for messages and logs.
    stop_ids: the tokens that end a complete reply.
  """

  def __init__(self, matcher, vocab_size: int, grammar: str, stop_ids: Sequence[int]):
    self._matcher, self.vocab_size, self.grammar = matcher, vocab_size, grammar
    self.stop_ids = frozenset(int(t) for t in stop_ids)

  def start(self) -> _State:
    """A fresh state for one sample."""
    with _LOCK:  # the compiled matcher is shared by every request of this grammar
      matcher = self._matcher.deep_copy()
    return _State(matcher, -(-self.vocab_size // 32), self.stop_ids)

  def __repr__(self) -> str:
    return f"GrammarConstraint({self.grammar[:80]!r}...)"


# ------------------------------------------------------------------ tokenizers

class _SentencePieceVocab:
  """A sentencepiece model as llguidance's TokenizerWrapper reads it (token bytes, encode)."""

  def __init__(self, sp, stop_ids: Sequence[int]):
    self._sp = sp
    self.eos_token_id = int(stop_ids[0]) if stop_ids else sp.eos_id()
    self.bos_token_id = sp.bos_id() if sp.bos_id() >= 0 else None
    self.tokens, self.special_token_ids = [], []
    for i in range(sp.get_piece_size()):
      piece = sp.id_to_piece(i)
      if sp.is_byte(i):  # byte fallback: "<0x0A>" is the byte 0x0A
        self.tokens.append(bytes([int(piece[3:-1], 16)]))
      elif sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
        self.tokens.append(b"\xff" + piece.encode())  # llguidance's mark of a special token
        self.special_token_ids.append(i)
      else:
        self.tokens.append(piece.replace("\u2581", " ").encode())

  def __call__(self, text) -> list[int]:
    return self._sp.encode(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)


def token_bytes(tokenizer) -> list[bytes]:
  """The bytes of every token of `tokenizer` as the grammar sees them (special tokens prefixed
  with b"\\xff", which no text contains). For tests and inspection."""
  llt = _ll_tokenizer(tokenizer, ())
  return [llt.decode_bytes([i]) if not llt.is_special_token(i) else b"\xff" +
          llt.decode_bytes([i]) for i in range(llt.vocab_size)]


def _ll_tokenizer(tokenizer, stop_ids: Sequence[int]):
  """llguidance's tokenizer of an envs.chat tokenizer whose end-of-sample tokens are
  `stop_ids` (cached).

  Raises:
    ValueError: a tokenizer type whose token bytes cannot be read.
  """
  import llguidance

  key = (id(tokenizer), tuple(stop_ids))
  with _LOCK:
    hit = _TOKENIZERS.get(key)
    if hit is not None and hit[0] is tokenizer:
      return hit[1]
  eos = [int(t) for t in stop_ids] or [int(tokenizer.eos_id)]
  hf, sp = getattr(tokenizer, "_tok", None), getattr(tokenizer, "_sp", None)
  if hf is not None and hasattr(hf, "to_str"):  # tokenizers.Tokenizer (HFTokenizer)
    llt = llguidance.LLTokenizer(hf.to_str(), n_vocab=tokenizer.vocab_size, eos_token=eos)
  elif sp is not None and hasattr(sp, "id_to_piece"):  # SentencePieceTokenizer
    llt = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_SentencePieceVocab(sp, eos)),
                                 n_vocab=tokenizer.vocab_size, eos_token=eos)
  else:
    raise ValueError(f"tokenizer {type(tokenizer).__name__}: constrained decoding reads the "
                     "token bytes of Hugging Face tokenizer.json and sentencepiece tokenizers "
                     "only")
  with _LOCK:
    _TOKENIZERS[key] = (tokenizer, llt)
  return llt


def compile_grammar(grammar: str, tokenizer, stop_ids: Sequence[int],
                    what: str = "grammar") -> GrammarConstraint:
  """Compiles an llguidance Lark grammar for a tokenizer (cached per grammar, tokenizer and
  stop tokens: compilation is the slow part).

  Args:
    grammar: the grammar (llguidance's Lark dialect; `%json {schema}` for JSON values).
    tokenizer: an envs.chat tokenizer (HFTokenizer or SentencePieceTokenizer).
    stop_ids: the tokens that end the sample once the grammar is complete (the chat format's
      stop_token_ids).
    what: the request field the grammar comes from, for messages.

  Returns:
    The constraint.

  Raises:
    ValueError: the grammar does not compile (naming `what` and llguidance's message).
  """
  import llguidance

  llt = _ll_tokenizer(tokenizer, stop_ids)
  key = (grammar, id(tokenizer), tuple(stop_ids))
  with _LOCK:
    matcher = _MATCHERS.get(key)
    if matcher is not None:
      _MATCHERS.move_to_end(key)
  if matcher is None:
    spec = llguidance.LLMatcher.grammar_from_lark(grammar)
    error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(spec, llt)
    if error:
      raise ValueError(f"{what}: cannot be compiled to a grammar: {messages[0].strip()}")
    matcher = llguidance.LLMatcher(llt, spec, log_level=0)
    if matcher.is_error():
      raise ValueError(f"{what}: cannot be compiled to a grammar: {matcher.get_error()}")
    with _LOCK:
      _MATCHERS[key] = matcher
      while len(_MATCHERS) > CACHE_SIZE:
        _MATCHERS.popitem(last=False)
  return GrammarConstraint(matcher, llt.vocab_size, grammar, llt.eos_tokens)


# ------------------------------------------------------------------ grammars

def _json_rule(schema: Any, strict: bool, whitespace_flexible: bool, what: str) -> str:
  """A Lark `%json` body for a JSON schema, with the output's layout options."""
  if isinstance(schema, bool):
    schema = {} if schema else {"not": {}}
  if not isinstance(schema, dict):
    raise ValueError(f"{what}={schema!r:.100}: expected a JSON schema object")
  options = {"whitespace_flexible": whitespace_flexible, "lenient": not strict}
  if not whitespace_flexible:
    options.update(item_separator=", ", key_separator=": ")
  return "%json " + json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)


def _lit(text: str) -> str:
  """A Lark string literal of `text`."""
  return json.dumps(text, ensure_ascii=False)


def _text_expr(text: str, tokenizer, llt) -> str:
  """A Lark expression of fixed text. Control-token strings in it (DeepSeek's tool-call tokens)
  and markers the vocabulary holds as added tokens (Qwen's `<tool_call>`, `<think>`:
  llguidance reads every added token as a special token, which text cannot spell) are written
  as that token (`<[id]>`), the rest as string literals: the model writes exactly the ids the
  chat format renders."""
  parts, run = [], []
  encode = getattr(tokenizer, "encode_special", tokenizer.encode)
  for t in encode(text):
    if llt.is_special_token(t):
      if run:
        parts.append(_lit(tokenizer.decode(run)))
        run = []
      parts.append(f"<[{t}]>")
    else:
      run.append(t)
  if run:
    parts.append(_lit(tokenizer.decode(run)))
  return " ".join(parts) if parts else '""'


def _response_schema(response_format: Any) -> Optional[tuple[Any, bool]]:
  """(schema, strict) of a response_format, or None for text / none.

  Raises:
    ValueError: a malformed response_format.
  """
  if response_format is None:
    return None
  if not isinstance(response_format, dict) or response_format.get("type") not in (
      "text", "json_object", "json_schema"):
    raise ValueError(f"response_format={response_format!r:.100}: expected {{\"type\": "
                     "\"text\" | \"json_object\" | \"json_schema\", ...}")
  kind = response_format["type"]
  if kind == "text":
    return None
  if kind == "json_object":
    return {"type": "object"}, False
  spec = response_format.get("json_schema")
  if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
    raise ValueError(f"response_format.json_schema={spec!r:.100}: expected {{\"name\": ..., "
                     "\"schema\": {...}, \"strict\": true | false}")
  strict = spec.get("strict", False)
  if not isinstance(strict, bool):
    raise ValueError(f"response_format.json_schema.strict={strict!r}: expected a bool")
  return spec.get("schema", {}), strict


@dataclasses.dataclass(frozen=True)
class CallSyntax:
  """How a chat format writes a turn of tool calls, as text (control tokens as their strings):
  `first` NAME `args` ARGUMENTS `close` (`later` NAME `args` ARGUMENTS `close`)* `end`."""

  first: str   # opens the turn's first call, up to the name (a thinking template's lead too)
  later: str   # opens a later call, up to the name
  args: str    # between the name and the arguments (a JSON object)
  close: str   # after the arguments
  end: str     # after the last call


def call_syntax(chat, template_kwargs: Optional[dict] = None) -> CallSyntax:
  """The tool-call syntax of a chat format: Hermes/Qwen `<tool_call>` JSON (chatml, qwen2.5,
  plain, templates of that family) or DeepSeek-V3's tool-call tokens (deepseek_v3, templates of
  that family). The opening of the first call is the format's own `tool_call_prefix_ids`.

  Raises:
    ValueError: another syntax (e.g. Kimi K2's), or an opening that is not the family's.
  """
  family = getattr(chat, "family", None) or (
      "deepseek_v3" if type(chat).__name__ == "DeepSeekV3" else "hermes")
  name = getattr(chat, "name", type(chat).__name__)
  if family not in ("hermes", "deepseek_v3"):
    raise ValueError(f"tool_choice: chat format {name!r} writes tool calls in the {family!r} "
                     "syntax, which constrained decoding does not express (supported: Hermes/"
                     "Qwen <tool_call> JSON and DeepSeek-V3's tool-call tokens)")
  kwargs = {"template_kwargs": template_kwargs} if template_kwargs else {}
  try:
    first = chat.tokenizer.decode(chat.tool_call_prefix_ids(None, **kwargs))
  except ValueError as e:  # e.g. a template that writes no tool calls
    raise ValueError(f"tool_choice: {e}") from e
  if family == "hermes":
    if not first.endswith(_NAME_OPEN) or _OPEN not in first:
      raise ValueError(f"tool_choice: chat format {name!r} opens a tool call as {first!r}, "
                       f"not as {_OPEN}...{_NAME_OPEN}: cannot constrain its calls")
    return CallSyntax(first, "\n" + first[first.rindex(_OPEN):], _ARGS_OPEN,
                      "}\n" + _CLOSE, "")
  t = DeepSeekV3.TOKENS
  opening = t["call_begin"] + "function" + t["sep"]
  if not first.endswith(opening):
    raise ValueError(f"tool_choice: chat format {name!r} opens a tool call as {first!r}, not "
                     f"as ...{opening}: cannot constrain its calls")
  return CallSyntax(first, "\n" + opening, "\n```json\n", "\n```" + t["call_end"],
                    t["calls_end"])


def tool_grammar_rules(tools: Sequence[Any], name: Optional[str], syntax: CallSyntax,
                       parallel: bool, strict: bool, whitespace_flexible: bool,
                       skip: str = "", lit=_lit) -> tuple[str, list[str]]:
  """The Lark rules of a turn of tool calls.

  Args:
    tools: the request's tools (schemas or Tool objects).
    name: the only function allowed, or None (any of the tools).
    syntax: how the format writes calls.
    parallel: allow more than one call.
    strict: refuse parameter schemas with keywords llguidance does not implement (a function
      with "strict": true is strict anyway).
    whitespace_flexible: allow any JSON whitespace.
    skip: text the prompt already holds of the first call (the grammar starts after it).
    lit: fixed text -> its Lark expression.

  Returns:
    (the start symbol's expression, the rule definitions).

  Raises:
    ValueError: `name` is not a tool, or `skip` does not open the first call.
  """
  fns = [t["function"] for t in tool_schemas(tools)]
  if name is not None:
    fns = [f for f in fns if f.get("name") == name]
    if not fns:
      raise ValueError(f"tool_name={name!r}: not among the tools")
  rules, alts = [], []
  for i, fn in enumerate(fns):
    params = fn.get("parameters") or {"type": "object"}
    rules.append(f"args_{i}: " + _json_rule(params, strict or fn.get("strict") is True,
                                           whitespace_flexible,
                                           f"tools[{fn['name']!r}].parameters"))
    alts.append(f"{lit(fn['name'] + syntax.args)} args_{i}")
  close = lit(syntax.close)
  rules.append("call_rest: (" + " | ".join(alts) + ") " + close)
  full = syntax.first
  if not (full.startswith(skip) or skip.startswith(full)):
    raise ValueError(f"prompt_prefix: {skip!r} does not open a tool call ({full!r})")
  if len(skip) <= len(full):
    head = lit(full[len(skip):]) + " call_rest" if full[len(skip):] else "call_rest"
  else:  # the prefix names the function: the arguments come next
    after = skip[len(full):]
    match = [i for i, fn in enumerate(fns) if after == fn["name"] + syntax.args]
    if not match:
      raise ValueError(f"prompt_prefix: {skip!r} does not open a call of "
                       f"{[f['name'] for f in fns]}")
    head = f"args_{match[0]} {close}"
  more = f" ({lit(syntax.later)} call_rest)*" if parallel else ""
  return head + more + (" " + lit(syntax.end) if syntax.end else ""), rules


def grammar_for(chat, tokenizer=None, *, response_format: Any = None,
                tools: Optional[Sequence[Any]] = None, tool_choice: Optional[str] = None,
                tool_name: Optional[str] = None,
                parallel_tool_calls: bool = True, prompt_prefix: Sequence[int] = (),
                template_kwargs: Optional[dict] = None,
                whitespace_flexible: bool = False) -> Optional[tuple[str, str]]:
  """The grammar (llguidance Lark) of a request's reply, or None when nothing constrains it.

  Arguments as `sampling_fields`.

  Returns:
    (grammar, the request field it comes from), or None.
  """
  if tool_choice not in (None, "none", "auto", "required", "named"):
    raise ValueError(f"tool_choice={tool_choice!r}: expected None, \"none\", \"auto\", "
                     "\"required\" or \"named\"")
  if tool_choice == "named" and tool_name is None:
    raise ValueError("tool_name=None: tool_choice \"named\" needs the function's name")
  calls = tool_choice in ("required", "named") or (tool_choice == "auto" and bool(tools))
  if calls and not tools:
    raise ValueError(f"tool_choice={tool_choice!r}: needs tools")
  response = None if tool_choice in ("required", "named") else _response_schema(response_format)
  if response is None and tool_choice not in ("required", "named"):
    return None
  if prompt_prefix and tool_choice not in ("required", "named"):
    raise ValueError(f"prompt_prefix: a forced tool-call opening needs tool_choice "
                     f"\"required\" or \"named\", got {tool_choice!r}")
  starts, rules = [], []
  if response is not None:
    schema, strict = response
    rules.append("response: " + _json_rule(schema, strict, whitespace_flexible,
                                           "response_format"))
    starts.append("response")
  if calls:
    syntax = call_syntax(chat, template_kwargs)
    tok = chat.tokenizer if tokenizer is None else tokenizer
    skip = tok.decode(list(prompt_prefix)) if prompt_prefix else ""
    llt = _ll_tokenizer(tok, chat.stop_token_ids)
    head, tool_rules = tool_grammar_rules(
        tools, tool_name if tool_choice == "named" else None, syntax, parallel_tool_calls,
        False, whitespace_flexible, skip, lambda text: _text_expr(text, tok, llt))
    rules += tool_rules
    starts.append(head)
  grammar = "start: " + " | ".join(f"({s})" for s in starts) + "\n" + "\n".join(rules) + "\n"
  return grammar, ("tool_choice" if calls and response is None else "response_format")


def sampling_fields(chat, tokenizer=None, *, response_format: Any = None,
                    tools: Optional[Sequence[Any]] = None, tool_choice: Optional[str] = None,
                    tool_name: Optional[str] = None, parallel_tool_calls: bool = True,
                    prompt_prefix: Sequence[int] = (), template_kwargs: Optional[dict] = None,
                    whitespace_flexible: bool = False) -> dict:
  """The SamplingParams fields that constrain a chat request's reply (see the module
  docstring for the wiring).

  Args:
    chat: the server's chat format (envs.chat); its stop_token_ids end a complete reply.
    tokenizer: its tokenizer (None: `chat.tokenizer`).
    response_format: the request's response_format as sent (None, {"type": "text"},
      {"type": "json_object"}, {"type": "json_schema", "json_schema": {"schema", "strict"}}).
    tools: the request's tools (OpenAI function schemas or Tool objects), or None.
    tool_choice: "none" | "auto" | "required" | "named" (None: as "none").
    tool_name: the function of "named".
    parallel_tool_calls: whether a forced reply may hold several calls.
    prompt_prefix: ids of a forced tool-call opening already at the end of the prompt
      (`chat.tool_call_prefix_ids(...)`); the grammar then covers the rest of the call.
    template_kwargs: the template kwargs the prompt was rendered with.
    whitespace_flexible: allow any JSON whitespace (default: compact ", " / ": " layout).

  Returns:
    {"constraint": GrammarConstraint} to merge into the request's SamplingParams, or {} when
    nothing constrains the reply.

  Raises:
    ValueError: naming the field and value (see the module docstring).
  """
  tokenizer = chat.tokenizer if tokenizer is None else tokenizer
  found = grammar_for(chat, tokenizer, response_format=response_format, tools=tools,
                      tool_choice=tool_choice, tool_name=tool_name,
                      parallel_tool_calls=parallel_tool_calls, prompt_prefix=prompt_prefix,
                      template_kwargs=template_kwargs, whitespace_flexible=whitespace_flexible)
  if found is None:
    return {}
  grammar, what = found
  return {"constraint": compile_grammar(grammar, tokenizer, chat.stop_token_ids, what)}
