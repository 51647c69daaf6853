"""Tool calls: what a parsed assistant turn holds, argument validation against JSON schemas, and
the Hermes/Qwen text syntax `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

A malformed call (bad JSON, unknown tool, missing or mistyped argument) is never an exception:
it becomes a `ToolCall` with `error` set, which the scaffold shows to the model as an
observation so that it can correct itself.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional, Sequence

_TYPES = {
    # JSON schema type -> Python check (bool is an int in Python, but not in JSON).
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


@dataclasses.dataclass
class ToolCall:
  """One call the model wrote. `error` is set (and the call must not run) when it is malformed."""

  name: str                 # "" when unreadable
  arguments: dict
  id: str = ""
  error: Optional[str] = None
  raw: str = ""             # the call's text as written (for logs and error messages)


@dataclasses.dataclass
class ParsedTurn:
  """An assistant turn read back from sampled ids."""

  content: str                   # the text outside tool calls, stripped
  tool_calls: list[ToolCall]     # in written order, malformed ones included (with .error)
  finished: bool                 # ended with a stop token (False: cut by the token limit)
  text: str = ""                 # the whole decoded turn, without the stop token
  reasoning_content: Optional[str] = None  # the <think> text of a thinking model, if any

  @property
  def errors(self) -> list[str]:
    """Error messages of the malformed calls, in written order."""
    return [c.error for c in self.tool_calls if c.error]

  @property
  def valid_calls(self) -> list[ToolCall]:
    """The well-formed calls, in written order."""
    return [c for c in self.tool_calls if not c.error]

  def to_message(self) -> dict:
    """OpenAI chat message (arguments as a JSON string); malformed calls are left out.

    "reasoning_content" is there when the turn has one (the field chat templates read).
    """
    msg: dict[str, Any] = {"role": "assistant", "content": self.content or None}
    if self.reasoning_content is not None:
      msg["reasoning_content"] = self.reasoning_content
    calls = [{"id": c.id, "type": "function",
              "function": {"name": c.name, "arguments": json.dumps(c.arguments,
                                                                   ensure_ascii=False)}}
             for c in self.valid_calls]
    if calls:
      msg["tool_calls"] = calls
    return msg


def tool_schema(tool: Any) -> dict:
  """The OpenAI function schema of a tool.

  Args:
    tool: the schema dict itself, a bare {name, description, parameters} dict, or an object
      with a `schema()` method (envs.tools.Tool).

  Returns:
    {"type": "function", "function": {name, description, parameters}}.

  Raises:
    TypeError: `tool` is neither a dict nor has `schema()`.
    ValueError: the dict has neither a "function" nor a "name" key.
  """
  if hasattr(tool, "schema") and callable(tool.schema):
    tool = tool.schema()
  if not isinstance(tool, dict):
    raise TypeError(f"tool={tool!r}: expected a schema dict or an object with schema()")
  if "function" in tool:
    return tool
  if "name" in tool:
    return {"type": "function", "function": tool}
  raise ValueError(f"tool={tool!r}: expected a 'function' or a 'name' key")


def tool_schemas(tools: Optional[Sequence[Any]]) -> list[dict]:
  """`tool_schema` of each tool (None: no tools)."""
  return [tool_schema(t) for t in tools or ()]


def message_tool_calls(message: dict) -> list[tuple[str, Any]]:
  """The (name, arguments) pairs of an assistant message's tool calls.

  Args:
    message: a message whose "tool_calls" are in OpenAI form {"function": {"name",
      "arguments"}} or flat {"name", "arguments"}.

  Returns:
    One pair per call, in order; arguments stay as given (a dict, or a JSON string).

  Raises:
    ValueError: a call has no name.
  """
  out = []
  for i, call in enumerate(message.get("tool_calls") or ()):
    fn = call.get("function", call)
    if "name" not in fn:
      raise ValueError(f"tool_calls[{i}]={call!r}: no 'name'")
    out.append((fn["name"], fn.get("arguments", {})))
  return out


def arguments_json(arguments: Any) -> str:
  """Arguments as the JSON text a model writes.

  A dict is dumped (", " and ": " separators, non-ASCII kept, as the tojson filter of Hugging
  Face chat templates); a string is kept as it is.
  """
  if isinstance(arguments, str):
    return arguments
  return json.dumps(arguments, ensure_ascii=False)


def _excerpt(text: str, n: int = 200) -> str:
  return text if len(text) <= n else text[:n] + "..."


def validate(value: Any, schema: dict, where: str = "arguments") -> Optional[str]:
  """Finds the first violation of a JSON schema by a value.

  Supports the JSON-schema subset tool schemas use: type (or a list of types), enum,
  properties, required, additionalProperties (false or a schema), items, minimum, maximum,
  minLength, maxLength; other keywords are ignored.

  Args:
    value: the decoded JSON value.
    schema: the JSON schema.
    where: the value's path, which error messages start with (e.g. "arguments.path").

  Returns:
    A message naming the first violation, or None when the value conforms.
  """
  types = schema.get("type")
  if types is not None:
    names = [types] if isinstance(types, str) else list(types)
    if not any(_TYPES.get(t, lambda v: True)(value) for t in names):
      return (f"{where} must be {' or '.join(names)}, got {type(value).__name__} "
              f"{_excerpt(json.dumps(value, ensure_ascii=False), 60)}")
  if "enum" in schema and value not in schema["enum"]:
    return f"{where} must be one of {schema['enum']}, got {value!r}"
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    if "minimum" in schema and value < schema["minimum"]:
      return f"{where} must be >= {schema['minimum']}, got {value}"
    if "maximum" in schema and value > schema["maximum"]:
      return f"{where} must be <= {schema['maximum']}, got {value}"
  if isinstance(value, str):
    if "minLength" in schema and len(value) < schema["minLength"]:
      return f"{where} must have at least {schema['minLength']} characters"
    if "maxLength" in schema and len(value) > schema["maxLength"]:
      return f"{where} must have at most {schema['maxLength']} characters, got {len(value)}"
  if isinstance(value, dict):
    props = schema.get("properties", {})
    for key in schema.get("required", ()):
      if key not in value:
        return f"{where}: missing required {key!r}"
    extra = schema.get("additionalProperties", True)
    for key, v in value.items():
      if key in props:
        error = validate(v, props[key], f"{where}.{key}")
      elif extra is False:
        error = f"{where}: unknown key {key!r} (expected: {', '.join(props) or 'none'})"
      else:
        error = validate(v, extra, f"{where}.{key}") if isinstance(extra, dict) else None
      if error:
        return error
  if isinstance(value, list) and isinstance(schema.get("items"), dict):
    for i, v in enumerate(value):
      error = validate(v, schema["items"], f"{where}[{i}]")
      if error:
        return error
  return None


def check_call(name: str, arguments: Any, tools: Optional[Sequence[Any]]) -> Optional[str]:
  """Says why a tool call is invalid.

  Args:
    name: the called tool.
    arguments: the decoded arguments; they must be a dict.
    tools: schemas or Tool objects; None: only check that the arguments are a dict.

  Returns:
    An error message, or None when the call is valid.
  """
  if not isinstance(arguments, dict):
    return (f"tool {name!r}: arguments must be a JSON object, got "
            f"{_excerpt(json.dumps(arguments, ensure_ascii=False), 80)}")
  if tools is None:
    return None
  schemas = {s["function"]["name"]: s["function"] for s in tool_schemas(tools)}
  if name not in schemas:
    return f"unknown tool {name!r}; available tools: {', '.join(schemas) or 'none'}"
  error = validate(arguments, schemas[name].get("parameters") or {"type": "object"})
  return f"tool {name!r}: {error}" if error else None


def make_call(name: str, arguments: Any, index: int, tools: Optional[Sequence[Any]],
              raw: str = "") -> ToolCall:
  """Builds a ToolCall and checks it against the tools.

  Args:
    name: the called tool.
    arguments: a dict, or a JSON string of one (some models double-encode).
    index: the call's position in the turn (0-based); gives the id `call_{index}`.
    tools: schemas or Tool objects; None: only check that the arguments are an object.
    raw: the call's text as written.

  Returns:
    The call, with `error` set when it is malformed.
  """
  if isinstance(arguments, str):
    try:
      arguments = json.loads(arguments)
    except json.JSONDecodeError as e:
      return ToolCall(name, {}, f"call_{index}", raw=raw, error=(
          f"tool call {index + 1} ({name!r}): arguments are not valid JSON ({e.msg} at line "
          f"{e.lineno} column {e.colno}): {_excerpt(arguments.strip())}"))
  error = check_call(name, arguments, tools)
  return ToolCall(name, arguments if isinstance(arguments, dict) else {}, f"call_{index}",
                  error=error, raw=raw)


def call_from_json(raw: str, index: int, tools: Optional[Sequence[Any]]) -> ToolCall:
  """Builds a ToolCall from the JSON body of one `<tool_call>` block.

  Args:
    raw: the block's text, `{"name": ..., "arguments": {...}}`.
    index: the call's position in the turn (0-based).
    tools: schemas or Tool objects; None: no check of names and arguments.

  Returns:
    The call, with `error` set when the JSON or the call is malformed.
  """
  try:
    obj = json.loads(raw)
  except json.JSONDecodeError as e:
    return ToolCall("", {}, f"call_{index}", raw=raw, error=(
        f"tool call {index + 1}: invalid JSON ({e.msg} at line {e.lineno} column {e.colno}): "
        f"{_excerpt(raw.strip())}"))
  if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
    return ToolCall("", {}, f"call_{index}", raw=raw, error=(
        f'tool call {index + 1}: expected {{"name": <tool name>, "arguments": {{...}}}}, got '
        f"{_excerpt(raw.strip())}"))
  return make_call(obj["name"], obj.get("arguments", {}), index, tools, raw)


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def parse_hermes(text: str, tools: Optional[Sequence[Any]]) -> tuple[str, list[ToolCall]]:
  """Splits a turn written with `<tool_call>{json}</tool_call>` blocks.

  Args:
    text: the decoded assistant turn.
    tools: schemas or Tool objects; None: no check of names and arguments.

  Returns:
    (content, calls): the text outside the blocks, stripped, and one call per block in order
    (an unclosed last block gives a call with `error` set).
  """
  content, calls, pos = [], [], 0
  while True:
    start = text.find(_OPEN, pos)
    if start < 0:
      content.append(text[pos:])
      break
    content.append(text[pos:start])
    end = text.find(_CLOSE, start)
    raw = text[start + len(_OPEN):] if end < 0 else text[start + len(_OPEN):end]
    if end < 0:
      calls.append(ToolCall("", {}, f"call_{len(calls)}", raw=raw, error=(
          f"tool call {len(calls) + 1}: {_OPEN} is never closed by {_CLOSE}: "
          f"{_excerpt(raw.strip())}")))
      break
    calls.append(call_from_json(raw, len(calls), tools))
    pos = end + len(_CLOSE)
  return "".join(content).strip(), calls
