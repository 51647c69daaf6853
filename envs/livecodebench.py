"""LiveCodeBench code-generation problems as "code" tasks (code_style "livecodebench").

Rows have the fields of the Hugging Face dataset "livecodebench/code_generation_lite":
  question_title, question_content, platform ("leetcode" | "codeforces" | "atcoder"),
  question_id, contest_id, contest_date (ISO), starter_code, difficulty ("easy" | "medium" |
  "hard"), public_test_cases and private_test_cases (JSON strings of
  [{"input": str, "output": str, "testtype": "stdin" | "functional"}]; private_test_cases may
  instead be base64 of zlib of a pickle of that JSON string), metadata (a JSON string, e.g.
  {"func_name": "maxScore"} for LeetCode's functional tests).
Ours, optional: time_limit (seconds per test, default `DEFAULT_TIME_LIMIT` = 6, the per-test
timeout of LiveCodeBench's harness) and memory_limit (MiB of address space per test process,
default `DEFAULT_MEMORY_LIMIT` = 1024; LiveCodeBench itself sets none).

A functional test calls `Solution().<func_name>(*args)`, one JSON value per line of its input,
and compares the returned value with the JSON of its output; a stdin test runs the program on
its input and compares the output line by line (`envs.verifiers.livecodebench_output_equal`).
The prompt shows the statement, the starter code and the public tests; the verifier runs the
public and the private tests (as LiveCodeBench does) in a fresh sandbox of its own, so the
private tests never reach the agent.

The compressed private tests are decoded without running pickle's object machinery: the pickle
may only hold one string (`decode_test_cases` checks its opcodes and unpickles with
`StrOnlyUnpickler`, which resolves no global), anything else is refused.

Rows are untrusted input, read within bounds (`envs.untrusted`): compressed tests inflate a chunk
at a time up to `max_decompressed_bytes` (default `MAX_DECOMPRESSED_BYTES` = 64 MiB), and every
JSON document (the JSONL line, the test-case and metadata fields, each functional test's values)
and every already-decoded field may nest at most `MAX_JSON_DEPTH` (100) arrays/objects deep,
measured before parsing. A row over either bound is a ValueError naming the field (skipped with
that reason under `skip_bad`), never a RecursionError or an unbounded allocation.

    tasks = load_livecodebench_jsonl("envs/data/livecodebench/problems.jsonl")
    rows = datasets.load_dataset("livecodebench/code_generation_lite", split="test",
                                 version_tag="release_v5")   # or the same rows, any source
    tasks = load_livecodebench_rows(rows)
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import json
import pickle
import pickletools
import zlib
from typing import Any, Iterable, Mapping, Optional

from envs.tasks import Task, _parse_all
from envs.untrusted.decode import MAX_JSON_DEPTH, TooDeep, TooLarge, check_depth, inflate, loads

DEFAULT_TIME_LIMIT = 6.0    # seconds per test (LiveCodeBench's run_test timeout)
DEFAULT_MEMORY_LIMIT = 1024  # MiB of address space per test process
MAX_DECOMPRESSED_BYTES = 64 << 20  # compressed test sets inflate to at most this (bytes)
PLATFORMS = ("leetcode", "codeforces", "atcoder")
DIFFICULTIES = ("easy", "medium", "hard")
TEST_TYPES = ("stdin", "functional")
# Opcodes that build nothing but one string (protocols 0-5): framing, memo and string pushes.
_STR_OPCODES = frozenset({
    "PROTO", "FRAME", "STOP", "MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT", "UNICODE",
    "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"})


class StrOnlyUnpickler(pickle.Unpickler):
  """An unpickler that resolves no class or function: only plain data can come out of it."""

  def find_class(self, module: str, name: str):
    raise pickle.UnpicklingError(f"refused global {module}.{name}: only a string is admitted")

  def persistent_load(self, pid):
    raise pickle.UnpicklingError("refused persistent id: only a string is admitted")


def unpickle_str(data: bytes, field: str = "private_test_cases") -> str:
  """The string a pickle holds; any other pickle is refused without being run.

  Args:
    data: the pickle's bytes.
    field: the field named in errors.

  Returns:
    The string.

  Raises:
    ValueError: naming the field, for a pickle that is malformed or holds anything but one str.
  """
  try:
    ops = [op.name for op, _, _ in pickletools.genops(data)]
  except Exception as e:  # pickletools raises ValueError and others on malformed input
    raise ValueError(f"field {field!r}: not a pickle ({e})") from None
  bad = sorted(set(ops) - _STR_OPCODES)
  if bad:
    raise ValueError(f"field {field!r}: the pickle holds more than a string (opcodes {bad}); "
                     "refused")
  try:
    value = StrOnlyUnpickler(io.BytesIO(data)).load()
  except (pickle.UnpicklingError, EOFError) as e:
    raise ValueError(f"field {field!r}: {e}") from None
  if type(value) is not str:
    raise ValueError(f"field {field!r}: the pickle holds a {type(value).__name__}, not a str")
  return value


def encode_test_cases(tests: Iterable[Mapping[str, str]], compress: bool = False) -> str:
  """Test cases as a row stores them: a JSON string, or (compress) base64(zlib(pickle(JSON))).

  Args:
    tests: [{"input", "output", "testtype"}].
    compress: write the compressed form LiveCodeBench uses for large private test sets.

  Returns:
    The field's value.
  """
  text = json.dumps([dict(t) for t in tests])
  if not compress:
    return text
  return base64.b64encode(zlib.compress(pickle.dumps(text))).decode("ascii")


def decode_test_cases(value: Any, field: str = "private_test_cases",
                      max_decompressed_bytes: int = MAX_DECOMPRESSED_BYTES) -> list[dict]:
  """The test cases of a row's field: a JSON string (or an already-decoded list), else the
  compressed form base64 -> zlib -> pickle (of one str, `unpickle_str`) -> JSON.

  Args:
    value: the field's value.
    field: its name, for errors.
    max_decompressed_bytes: the most the compressed form may inflate to.

  Returns:
    [{"input": str, "output": str, "testtype": "stdin" | "functional"}].

  Raises:
    ValueError: naming the field and the problem (among them: inflating beyond
      `max_decompressed_bytes`, nesting deeper than `MAX_JSON_DEPTH`).
  """
  what = f"field {field!r}"
  if isinstance(value, str):
    try:
      value = loads(value, MAX_JSON_DEPTH, what)
    except TooDeep:
      raise
    except ValueError:
      try:
        data = base64.b64decode(value.encode("ascii"), validate=True)
      except (binascii.Error, UnicodeEncodeError) as e:
        raise ValueError(f"{what}: neither JSON nor base64/zlib data ({e}): "
                         f"{value!r:.80}") from None
      try:
        raw = inflate(data, max_decompressed_bytes, what)
      except TooLarge:
        raise
      except ValueError as e:  # not a complete zlib stream
        raise ValueError(f"{e}; neither JSON nor base64/zlib data: {value!r:.80}") from None
      text = unpickle_str(raw, field)
      del raw
      try:
        value = loads(text, MAX_JSON_DEPTH, f"{what} (decompressed)")
      except TooDeep:
        raise
      except ValueError as e:
        raise ValueError(f"{what}: the decompressed text is not JSON ({e})") from None
  else:
    check_depth(value, MAX_JSON_DEPTH, what)
  if not isinstance(value, list):
    raise ValueError(f"field {field!r}: expected a list of test cases, got {value!r:.100}")
  for i, t in enumerate(value):
    if not (isinstance(t, dict) and isinstance(t.get("input"), str)
            and isinstance(t.get("output"), str) and t.get("testtype") in TEST_TYPES):
      raise ValueError(f"field '{field}[{i}]': expected {{'input': str, 'output': str, "
                       f"'testtype': 'stdin' | 'functional'}}, got {t!r:.100}")
  return value


def _verifier_case(t: Mapping[str, str], field: str, i: int) -> dict:
  """A test case as the python_io verifier runs it."""
  if t["testtype"] == "stdin":
    return {"input": t["input"], "output": t["output"]}
  what = f"field '{field}[{i}]'"
  try:
    args = [loads(line, MAX_JSON_DEPTH, what) for line in t["input"].split("\n")]
    expected = loads(t["output"], MAX_JSON_DEPTH, what)
  except TooDeep:
    raise
  except ValueError as e:  # JSONDecodeError, or an integer literal too long to convert
    raise ValueError(f"{what}: a functional test needs one JSON value per input line and a "
                     f"JSON output ({e})") from None
  return {"args": args, "expected": expected}


def _str_field(row: Mapping, field: str, default: Optional[str] = None) -> str:
  value = row.get(field, default)
  if not isinstance(value, str):
    raise ValueError(f"field {field!r}: expected a string, got {value!r:.100}")
  return value


def _number(row: Mapping, field: str, default: float, low: float, high: float) -> float:
  value = row.get(field)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
    raise ValueError(f"field {field!r}: {value!r}: expected a number in [{low}, {high}]")
  return value


def prompt(row: Mapping, public: list[dict], func_name: Optional[str]) -> str:
  """The instruction of a problem: statement, starter code, public tests and how to answer.

  Args:
    row: the LiveCodeBench row.
    public: its decoded public test cases.
    func_name: the method functional tests call (None: a stdin/stdout program).

  Returns:
    The prompt text.
  """
  parts = [f"### {row['question_title']}\n\n{row['question_content'].strip()}\n"]
  if func_name:
    parts.append(f"Complete the class below; the tests call `Solution().{func_name}(...)` "
                 "and compare the value it returns.\n```python\n"
                 f"{row.get('starter_code', '').rstrip()}\n```\n")
  else:
    parts.append("Write a Python 3 program that reads the input from standard input and "
                 "prints the answer to standard output.\n")
  for i, t in enumerate(public, 1):
    parts.append(f"Example {i}\nInput:\n```\n{t['input'].rstrip()}\n```\nExpected "
                 f"{'return value' if func_name else 'output'}:\n```\n{t['output'].rstrip()}\n"
                 "```\n")
  parts.append("Hidden tests check more cases. When you are done, call submit with the "
               "complete Python program as the answer.")
  return "\n".join(parts)


def task_from_row(row: Mapping, max_decompressed_bytes: int = MAX_DECOMPRESSED_BYTES) -> Task:
  """The "code" task (code_style "livecodebench") of one LiveCodeBench row.

  Args:
    row: the row (module docstring); fields other than the tests go to `metadata`.
    max_decompressed_bytes: the most a compressed test set may inflate to.

  Returns:
    The task: id "lcb-<question_id>", tests = public + private, timeout = time_limit,
    memory_mb = memory_limit, metadata {"format": "livecodebench", platform, difficulty, ...}.

  Raises:
    ValueError: naming the field that is missing or malformed.
  """
  if not isinstance(row, Mapping):
    raise ValueError(f"expected a JSON object, got {type(row).__name__}")
  for field, value in row.items():  # decoded rows (e.g. a `datasets` split) nest how they like
    check_depth(value, MAX_JSON_DEPTH, f"field {field!r}")
  for field in ("question_title", "question_content", "question_id"):
    if not _str_field(row, field).strip():
      raise ValueError(f"field {field!r}: empty")
  platform = _str_field(row, "platform")
  if platform not in PLATFORMS:
    raise ValueError(f"field 'platform': {platform!r}: expected one of {PLATFORMS}")
  difficulty = _str_field(row, "difficulty")
  if difficulty not in DIFFICULTIES:
    raise ValueError(f"field 'difficulty': {difficulty!r}: expected one of {DIFFICULTIES}")
  meta = row.get("metadata", "{}")
  try:
    meta = loads(meta, MAX_JSON_DEPTH, "field 'metadata'") if isinstance(meta, str) else meta
  except TooDeep:
    raise
  except ValueError as e:
    raise ValueError(f"field 'metadata': not JSON ({e}): {meta!r:.100}") from None
  if not isinstance(meta, dict):
    raise ValueError(f"field 'metadata': expected a JSON object, got {meta!r:.100}")
  public = decode_test_cases(row.get("public_test_cases", "[]"), "public_test_cases",
                             max_decompressed_bytes)
  private = decode_test_cases(row.get("private_test_cases", "[]"), "private_test_cases",
                              max_decompressed_bytes)
  if not public + private:
    raise ValueError("field 'private_test_cases': no test cases (public ones neither)")
  functional = any(t["testtype"] == "functional" for t in public + private)
  func_name = meta.get("func_name")
  if functional and not (isinstance(func_name, str) and func_name.isidentifier()):
    raise ValueError(f"field 'metadata': functional tests need a 'func_name', got "
                     f"{func_name!r}")
  cases = ([_verifier_case(t, "public_test_cases", i) for i, t in enumerate(public)]
           + [_verifier_case(t, "private_test_cases", i) for i, t in enumerate(private)])
  time_limit = _number(row, "time_limit", DEFAULT_TIME_LIMIT, 0.1, 600)
  memory_limit = _number(row, "memory_limit", DEFAULT_MEMORY_LIMIT, 16, 65536)
  if memory_limit != int(memory_limit):
    raise ValueError(f"field 'memory_limit': {memory_limit!r}: expected whole MiB")
  question_id = row["question_id"]
  return Task(
      instance_id=f"lcb-{question_id}", kind="code",
      problem_statements=(prompt(row, public, func_name if functional else None),),
      tests=tuple(cases), entry_point=f"Solution.{func_name}" if functional else None,
      code_style="livecodebench", timeout=float(time_limit), memory_mb=int(memory_limit),
      metadata={"format": "livecodebench", "question_id": question_id,
                "question_title": row["question_title"], "platform": platform,
                "difficulty": difficulty, "contest_id": str(row.get("contest_id", "")),
                "contest_date": str(row.get("contest_date", "")),
                "starter_code": row.get("starter_code", ""), "func_name": func_name,
                "public_tests": len(public), "private_tests": len(private)})


def is_livecodebench_row(record: Any) -> bool:
  """Whether a record looks like a LiveCodeBench row (it has question_content and tests)."""
  return isinstance(record, Mapping) and "question_content" in record and (
      "public_test_cases" in record or "private_test_cases" in record)


def jsonl_rows(path: str, max_depth: int = MAX_JSON_DEPTH):
  """(where "file:line", "line N", row) per non-blank line of a JSONL file, each line parsed with
  its nesting bounded (`envs.untrusted.loads`); a line that is not JSON, or nests deeper than
  `max_depth`, yields a ValueError as its row (the caller decides whether to skip it)."""
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = loads(line, max_depth, "the line")
      except json.JSONDecodeError as e:
        record = ValueError(f"invalid JSON ({e.msg} at column {e.colno})")
      except ValueError as e:  # nested too deep, or an integer literal too long to convert
        record = ValueError(f"invalid JSON ({e})")
      yield f"{path}:{lineno}", f"line {lineno}", record


def load_livecodebench_jsonl(path: str, skip_bad: bool = False,
                             errors: Optional[list] = None, *,
                             max_decompressed_bytes: int = MAX_DECOMPRESSED_BYTES) -> list[Task]:
  """The tasks of a JSONL file of LiveCodeBench rows, in file order.

  Args:
    path: the file.
    skip_bad: log and skip a bad line instead of raising.
    errors: when given, the skipped lines' errors are appended to it.
    max_decompressed_bytes: the most a row's compressed test set may inflate to.

  Raises:
    TaskFormatError: "FILE:LINE: field 'NAME': ..." for a bad line (unless skip_bad).
  """
  parse = functools.partial(task_from_row, max_decompressed_bytes=max_decompressed_bytes)
  return _parse_all(jsonl_rows(path), parse, skip_bad, errors, path)


def load_livecodebench_rows(rows: Iterable[Mapping], skip_bad: bool = False,
                            errors: Optional[list] = None, *, source: str = "rows",
                            max_decompressed_bytes: int = MAX_DECOMPRESSED_BYTES) -> list[Task]:
  """The tasks of LiveCodeBench rows given as dicts (e.g. a Hugging Face `datasets` split).

  Args:
    rows: the rows, in order.
    skip_bad: log and skip a bad row instead of raising.
    errors: when given, the skipped rows' errors are appended to it.
    source: how errors name the rows ("SOURCE[INDEX]: field ...").
    max_decompressed_bytes: the most a row's compressed test set may inflate to.

  Raises:
    TaskFormatError: "SOURCE[INDEX]: field 'NAME': ..." for a bad row (unless skip_bad).
  """
  records = ((f"{source}[{i}]", f"{source}[{i}]", r) for i, r in enumerate(rows))
  parse = functools.partial(task_from_row, max_decompressed_bytes=max_decompressed_bytes)
  return _parse_all(records, parse, skip_bad, errors, source)
