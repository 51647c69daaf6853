"""SFT records: their formats, checks, readers, and their rendering to LLM calls.

Records (one per JSONL line, Parquet row or msgpack map; or dicts / Trajectory objects in memory):
  chat record  {"messages": [...], "tools": [...]?, "group": str | int?, "branches": [[...]]?}
               OpenAI-style messages (system | user | assistant | tool; assistant "tool_calls"
               [{"function": {"name", "arguments"}}], arguments an object or a JSON string).
               "branches": several continuations of "messages", each its own conversation.
  trajectory   `envs.trajectory.Trajectory.to_dict()` ({"calls": [...], "group_id", ...}), as
               recorded by the scaffold; its calls are used as they are (never re-tokenized).
Other fields are ignored. Files: *.jsonl, *.parquet (nested columns drop struct fields that are
null, and may reorder object keys: store "tools" and tool-call arguments as JSON strings to keep
their text exact; "messages", "tools", "branches", "calls" may each be a JSON string column),
*.msgpack (maps back to back, e.g. `Trajectory.to_bytes()` of each trajectory).

Conversation -> trajectory. One `rl.tree.CallTokens` per assistant message: input = the rendered
conversation before it, generation prompt included; output = the turn's ids
(`chat.assistant_ids`, end-of-turn token included), as a sampler would have produced them. The
inputs are built as the scaffold builds them (previous input + output +
`chat.continuation(messages in between)`), so each call extends the previous one and the last
call's tokens are a prefix of `chat.render(conversation)`. Per output token fields: "loss_mask"
(1 = trained) and "failed" (1 = the turn's tool call failed); build_tree adds "turn".
Messages after the last assistant turn are not needed and are dropped.

Error-masked SFT (KAT-Coder). An assistant turn *failed* when the message has
"tool_error": true, or when a tool message answering it (one of the tool messages right after
it) has "error": true; for a trajectory, when the call's meta["tool_error"] is true. With
mask_tool_errors (default) a failed turn gets loss_mask 0: it stays in the context of later
turns but is not trained. "train": false on an assistant message (meta["train"] = false on a
call) also gives loss_mask 0. "failed" is set either way (`rl.losses` can mask it instead).

Errors are `RecordError`s naming where the record is (file:line, file:row N, file:record N,
records[i]) and the field.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Iterator, Optional, Sequence

from envs.chat.formats import ROLES, ChatFormat
from rl.tree import CallTokens, TrajectoryTokens, from_trajectory

GROUP_BY = ("field", "prompt", "system", "none")  # see trainer.data


class RecordError(ValueError):
  """A malformed SFT record; the message names where it is and the field."""


# ----------------------------------------------------------------------------- records


def _check_message(m: Any, where: str) -> None:
  if not isinstance(m, dict):
    raise RecordError(f"{where}={m!r:.100}: expected a message object")
  role = m.get("role")
  if role not in ROLES:
    raise RecordError(f"{where}.role={role!r:.100}: expected one of {ROLES}")
  content = m.get("content")
  if not (isinstance(content, str) or (content is None and role == "assistant")):
    raise RecordError(f"{where}.content={content!r:.100}: expected a string")
  for flag in ("train", "tool_error", "error"):
    if flag in m and not isinstance(m[flag], bool):
      raise RecordError(f"{where}.{flag}={m[flag]!r:.100}: expected true or false")
  calls = m.get("tool_calls")
  if calls is None:
    return
  if role != "assistant":
    raise RecordError(f"{where}.tool_calls: only assistant messages carry tool calls")
  if not isinstance(calls, list):
    raise RecordError(f"{where}.tool_calls={calls!r:.100}: expected a list")
  for j, c in enumerate(calls):
    fn = c.get("function", c) if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
      raise RecordError(f"{where}.tool_calls[{j}]={c!r:.100}: expected "
                        '{"function": {"name": str, "arguments": object or JSON string}}')
    if not isinstance(fn.get("arguments", {}), (dict, str)):
      raise RecordError(f"{where}.tool_calls[{j}].function.arguments="
                        f"{fn['arguments']!r:.100}: expected an object or a JSON string")


def _check_messages(messages: Any, where: str) -> None:
  if not isinstance(messages, list) or not messages:
    raise RecordError(f"{where}={messages!r:.100}: expected a non-empty list of messages")
  for i, m in enumerate(messages):
    _check_message(m, f"{where}[{i}]")


def check_record(record: Any, where: str = "record") -> str:
  """Validates a record's structure.

  Args:
    record: a parsed record (chat record or trajectory dict).
    where: where the record is (file:line, records[i], ...), for the error message.

  Returns:
    The record's kind: "chat" or "trajectory".

  Raises:
    RecordError: the record is malformed; the message names `where` and the field.
  """
  if not isinstance(record, dict):
    raise RecordError(f"{where}: expected a JSON object, got {type(record).__name__}")
  if "calls" in record:
    calls = record["calls"]
    if not isinstance(calls, list) or not calls:
      raise RecordError(f"{where}: field calls={calls!r:.100}: expected a non-empty list")
    for i, c in enumerate(calls):
      for name in ("input_ids", "output_ids"):
        ids = c.get(name) if isinstance(c, dict) else None
        if not isinstance(ids, list) or not all(isinstance(x, int) and x >= 0 for x in ids):
          raise RecordError(f"{where}: field calls[{i}].{name}={ids!r:.100}: expected a list "
                            "of token ids")
      if not c["input_ids"]:
        raise RecordError(f"{where}: field calls[{i}].input_ids is empty (the first sampled "
                          "token needs a context)")
      if not isinstance(c.get("meta", {}), dict):
        raise RecordError(f"{where}: field calls[{i}].meta={c['meta']!r:.100}: expected an "
                          "object")
    return "trajectory"
  if "messages" not in record:
    raise RecordError(f"{where}: expected a 'messages' field (chat record) or a 'calls' field "
                      f"(trajectory), got fields {sorted(record)[:10]}")
  _check_messages(record["messages"], f"{where}: field messages")
  tools = record.get("tools")
  if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict)
                                                                 for t in tools)):
    raise RecordError(f"{where}: field tools={tools!r:.100}: expected a list of tool schemas")
  branches = record.get("branches")
  convs = [record["messages"]]
  if branches is not None:
    if not isinstance(branches, list) or not branches:
      raise RecordError(f"{where}: field branches={branches!r:.100}: expected a non-empty list "
                        "of message lists")
    for b, branch in enumerate(branches):
      _check_messages(branch, f"{where}: field branches[{b}]")
    convs = [record["messages"] + branch for branch in branches]
  for c, conv in enumerate(convs):
    if not any(m["role"] == "assistant" for m in conv):
      what = "messages" if branches is None else f"messages + branches[{c}]"
      raise RecordError(f"{where}: field {what}: no assistant message, nothing to train")
  group = record.get("group")
  if group is not None and not isinstance(group, (str, int)):
    raise RecordError(f"{where}: field group={group!r:.100}: expected a string or an integer")
  return "chat"


def failed_turns(messages: Sequence[dict]) -> list[bool]:
  """Marks the assistant messages whose tool call failed.

  Args:
    messages: a checked conversation.

  Returns:
    Per message: True for an assistant message with "tool_error": true, or "error": true on one
    of the tool messages right after it; else False.
  """
  out = [False] * len(messages)
  for i, m in enumerate(messages):
    if m["role"] != "assistant":
      continue
    failed = bool(m.get("tool_error", False))
    j = i + 1
    while j < len(messages) and messages[j]["role"] == "tool":
      failed |= bool(messages[j].get("error", False))
      j += 1
    out[i] = failed
  return out


def conversation_calls(chat: ChatFormat, messages: Sequence[dict],
                       tools: Optional[Sequence[dict]] = None,
                       mask_tool_errors: bool = True) -> list[CallTokens]:
  """Renders a conversation as one CallTokens per assistant message (see the module docstring).

  Input = the conversation before the message with the generation prompt, output =
  `chat.assistant_ids(message)`.

  Args:
    chat: the chat format.
    messages: a checked conversation; messages after the last assistant turn are dropped.
    tools: the tool schemas rendered with the conversation (None: no tools).
    mask_tool_errors: a failed turn gets loss_mask 0.

  Returns:
    The calls, with per output token fields "loss_mask" (1 = trained; 0 for "train": false or a
    masked failed turn) and "failed" (1 = the turn's tool call failed).
  """
  messages = list(messages)
  failed = failed_turns(messages)
  turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
  calls: list[CallTokens] = []
  ids: list[int] = []
  for k, i in enumerate(turns):
    m = messages[i]
    if k == 0 or not chat.extends_history:  # a template that rewrites history: render anew
      ids = chat.render(messages[:i], tools, add_generation_prompt=True).ids
    else:
      prev = calls[-1]
      ids = list(prev.input_ids) + list(prev.output_ids) + chat.continuation(
          messages[turns[k - 1] + 1:i], prev.output_ids)
    out = chat.assistant_ids(m)
    train = bool(m.get("train", True)) and not (mask_tool_errors and failed[i])
    calls.append(CallTokens(ids, out, {"loss_mask": [float(train)] * len(out),
                                       "failed": [float(failed[i])] * len(out)}))
  return calls


def record_trajectories(record: Any, chat: ChatFormat, mask_tool_errors: bool = True,
                        where: str = "record") -> list[TrajectoryTokens]:
  """Renders one record as its trajectories.

  Args:
    record: a chat record, a trajectory dict, or a Trajectory object.
    chat: the chat format chat records render with.
    mask_tool_errors: a failed turn gets loss_mask 0.
    where: where the record is, for the error message.

  Returns:
    One TrajectoryTokens per conversation (a record with "branches" has one per branch), or the
    trajectory itself.

  Raises:
    RecordError: the record is malformed or cannot be rendered; the message names `where`.
  """
  record = as_dict(record)
  kind = check_record(record, where)
  try:
    if kind == "trajectory":
      return [from_trajectory(record, logprobs=False, mask_tool_errors=mask_tool_errors)]
    convs = ([record["messages"]] if record.get("branches") is None else
             [record["messages"] + b for b in record["branches"]])
    return [TrajectoryTokens(conversation_calls(chat, conv, record.get("tools"),
                                                mask_tool_errors)) for conv in convs]
  except RecordError:
    raise
  except (ValueError, TypeError, KeyError) as e:
    raise RecordError(f"{where}: cannot be rendered with chat format {chat.name!r}: "
                      f"{type(e).__name__}: {e}") from e


def as_dict(record: Any) -> Any:
  """Trajectory objects (or anything with to_dict) as their dicts."""
  return record.to_dict() if hasattr(record, "to_dict") and not isinstance(record, dict) \
      else record


def group_key(record: dict, group_by: str) -> Optional[str]:
  """Names the tree a (checked) record belongs to.

  Args:
    record: a checked chat record or trajectory dict.
    group_by: one of GROUP_BY: "field" (its "group" / "group_id"), "prompt" (the conversation
      before the first assistant message, with the tools), "system" (the leading system
      messages, with the tools; trajectories: none), "none".

  Returns:
    The key (records with equal keys share a tree), or None: a tree of its own.
  """
  if group_by == "none":
    return None
  is_traj = "calls" in record
  if group_by == "field":
    key = record.get("group_id") if is_traj else record.get("group")
    return None if key is None else json.dumps(["field", key])
  if is_traj:
    if group_by == "system":
      return None
    body = ["prompt", record["calls"][0]["input_ids"]]
  else:
    msgs = record["messages"]
    if group_by == "prompt":
      n = next(i for i, m in enumerate(msgs + [{"role": "assistant"}])
               if m["role"] == "assistant")
    else:
      n = next(i for i, m in enumerate(msgs + [{"role": "end"}]) if m["role"] != "system")
    body = [group_by, record.get("tools") or [], msgs[:n]]
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


# ----------------------------------------------------------------------------- files


def _drop_nones(x: Any) -> Any:
  """Parquet gives every struct field of a column, missing ones as None: drop them."""
  if isinstance(x, dict):
    return {k: _drop_nones(v) for k, v in x.items() if v is not None}
  if isinstance(x, list):
    return [_drop_nones(v) for v in x]
  return x


class Reader:
  """Records of one source by key (byte offset, row or index)."""

  def scan(self) -> Iterator[tuple[int, str, Any]]:
    """Reads the whole source once.

    Yields:
      (key, where, record or the RecordError that reading it raised); `read(key)` reads the
      record again.
    """
    raise NotImplementedError

  def read(self, key: int) -> Any:
    """Reads the record at `key` (from `scan`) again."""
    raise NotImplementedError


class JsonlReader(Reader):
  """Records of a JSONL file, keyed by byte offset.

  Args:
    path: the .jsonl file.
  """
  def __init__(self, path: str):
    self.path = path

  def _parse(self, line: bytes, where: str) -> Any:
    try:
      return json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise RecordError(f"{where}: not valid JSON: {e}") from None

  def scan(self):
    """Yields (byte offset, "path:line", record or RecordError) per non-blank line."""
    with open(self.path, "rb") as f:
      offset, n = 0, 0
      for line in f:
        n += 1
        if line.strip():
          where = f"{self.path}:{n}"
          try:
            yield offset, where, self._parse(line, where)
          except RecordError as e:
            yield offset, where, e
        offset += len(line)

  def read(self, key):
    """Parses the line at byte offset `key`."""
    with open(self.path, "rb") as f:
      f.seek(key)
      return self._parse(f.readline(), f"{self.path}@{key}")


class ParquetReader(Reader):
  """Records of a Parquet file, keyed by row (needs pyarrow; the table is loaded on first use).

  Columns "messages" / "tools" / "branches" may hold nested lists and structs or JSON strings;
  trajectory tables hold "calls" and the other Trajectory fields.

  Args:
    path: the .parquet file.
  """

  def __init__(self, path: str):
    self.path = path
    self._table = None

  def _load(self):
    if self._table is None:
      try:
        import pyarrow.parquet as pq
      except ImportError as e:
        raise ImportError("reading Parquet needs pyarrow (pip install pyarrow)") from e
      self._table = pq.read_table(self.path)
    return self._table

  @staticmethod
  def _row(d: dict, where: str) -> dict:
    d = _drop_nones(d)
    for k in ("messages", "tools", "branches", "calls"):
      if isinstance(d.get(k), str):
        try:
          d[k] = json.loads(d[k])
        except json.JSONDecodeError as e:
          raise RecordError(f"{where}: field {k}: not valid JSON: {e}") from None
    return d

  def scan(self):
    """Yields (row, "path:row N", record or RecordError) per row."""
    row = 0
    for batch in self._load().to_batches():
      for d in batch.to_pylist():
        where = f"{self.path}:row {row}"
        try:
          yield row, where, self._row(d, where)
        except RecordError as e:
          yield row, where, e
        row += 1

  def read(self, key):
    """Reads row `key`."""
    return self._row(self._load().slice(key, 1).to_pylist()[0], f"{self.path}:row {key}")


class MsgpackReader(Reader):
  """A stream of msgpack maps (e.g. `Trajectory.to_bytes()` written back to back), keyed by offset.

  Args:
    path: the .msgpack / .mpk file.
  """

  def __init__(self, path: str):
    self.path = path

  def scan(self):
    """Yields (byte offset, "path:record N", record) per map; a corrupt map ends the scan."""
    import msgpack

    with open(self.path, "rb") as f:
      unpacker = msgpack.Unpacker(f, raw=False, strict_map_key=True)
      n, offset = 0, 0
      while True:
        where = f"{self.path}:record {n}"
        try:
          record = unpacker.unpack()
        except msgpack.OutOfData:
          return
        except (msgpack.UnpackException, ValueError, TypeError) as e:
          yield offset, where, RecordError(f"{where}: not a msgpack record: {e}")
          return  # the stream cannot be resynchronised after a corrupt record
        yield offset, where, record
        offset, n = unpacker.tell(), n + 1

  def read(self, key):
    """Unpacks the map at byte offset `key`."""
    import msgpack

    with open(self.path, "rb") as f:
      f.seek(key)
      return msgpack.Unpacker(f, raw=False, strict_map_key=True).unpack()


class MemoryReader(Reader):
  """Records held in memory (dicts or Trajectory objects), keyed by index.

  Args:
    records: the records.
  """
  def __init__(self, records: Sequence[Any]):
    self.records = records

  def scan(self):
    """Yields (index, "records[i]", record as a dict) per record."""
    for i, r in enumerate(self.records):
      yield i, f"records[{i}]", as_dict(r)

  def read(self, key):
    """Returns record `key` as a dict."""
    return as_dict(self.records[key])


def reader_for(path: str) -> Reader:
  """The reader of a source file, by its extension (ValueError for an unknown one)."""
  if path.endswith(".jsonl"):
    return JsonlReader(path)
  if path.endswith(".parquet"):
    return ParquetReader(path)
  if path.endswith(".msgpack") or path.endswith(".mpk"):
    return MsgpackReader(path)
  raise ValueError(f"SFTDataConfig.sources: {path!r}: expected a .jsonl, .parquet or "
                   ".msgpack file")


# ----------------------------------------------------------------------------- files out


def write_jsonl(path: str, records: Sequence[Any]) -> None:
  """Writes records as JSONL, atomically (a temporary file renamed over `path`).

  Args:
    path: the output file.
    records: dicts or Trajectory objects (anything with `to_dict`).
  """
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    for r in records:
      f.write(json.dumps(as_dict(r), ensure_ascii=False) + "\n")
  os.replace(path + ".tmp", path)
