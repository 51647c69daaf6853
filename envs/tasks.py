"""Tasks: what an episode asks of the agent, and what its verifier checks.

One `Task` type covers four kinds:
- "swe": a repository snapshot (directory or tarball) with a bug; the `tests` verifier runs the
  task's pytest command in a fresh sandbox and checks FAIL_TO_PASS / PASS_TO_PASS test ids.
- "code": a code problem (prompt + function or stdin/stdout tests), verifier `python_io`.
- "exact": a question with a short answer, verifier `exact`.
- "judge": an open-ended task scored by a policy against a weighted rubric, verifier `judge`.

"One commit, many prompts": a task carries several phrasings of its instruction (expert to
colloquial) and `Task.prompt(rng)` samples one per episode from an explicit rng.

Loaders read JSONL: `load_swe_jsonl` (SWE-bench format plus a few fields of ours, below),
`load_problems_jsonl` (code / exact / judge problems) and `load_tasks` (either, per line). A bad
line raises `TaskFormatError` naming the file, the line and the field; with `skip_bad=True` it
is logged and counted instead.

SWE-format line (SWE-bench's fields; `repo_path`, `problem_statements`, `test_command`,
`rootfs`, `timeout` are ours):
  {"instance_id": "calc-1", "repo_path": "repos/calc-1",          # dir or .tar/.tar.gz/.tgz,
   "problem_statement": "...", "problem_statements": ["...", ...],  # relative to the JSONL
   "FAIL_TO_PASS": ["tests/test_calc.py::test_add"],               # list or JSON string
   "PASS_TO_PASS": [...], "test_command": "python3 -m pytest -q tests/test_calc.py",
   "patch": "<reference fix, unified diff>", "test_patch": "<applied before the tests>"}
Problem line:
  {"id": "p1", "kind": "code", "prompt": "...", "entry_point": "add",
   "tests": [{"args": [1, 2], "expected": 3}]}     # or [{"input": "...", "output": "..."}]
  {"id": "q1", "kind": "exact", "prompt": "...", "answer": "42"}   # or "answers": [...]
  {"id": "j1", "kind": "judge", "prompt": "...",
   "rubric": [{"name": "correctness", "weight": 2, "description": "..."}]}
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import re
import shlex
import tarfile
from typing import Any, Iterable, Mapping, Optional

log = logging.getLogger(__name__)

KINDS = ("swe", "code", "exact", "judge")
DEFAULT_TIMEOUT = 120.0  # seconds for one test run
CODE_TIMEOUT = 10.0      # seconds for each test process of a code problem

# A test command is "PYTHON -m pytest ARGS" (PYTHON: python, python3, python3.11 or a path to
# one, e.g. a task's virtualenv) or "pytest ARGS"; the verifier runs pytest itself with ARGS.
_PYTHON = re.compile(r"^(?:[\w.+-]*/)*python[\d.]*$")


class TaskFormatError(ValueError):
  """A task file line (or a Task field) is malformed. The message names file:line and field."""


@dataclasses.dataclass(frozen=True)
class Task:
  """One task. Which fields matter depends on `kind` (see the module docstring)."""

  instance_id: str
  kind: str
  problem_statements: tuple[str, ...]           # phrasings of the instruction, >= 1
  # swe
  repo_path: Optional[str] = None               # absolute path of a directory or tarball
  fail_to_pass: tuple[str, ...] = ()            # pytest node ids that must go from fail to pass
  pass_to_pass: tuple[str, ...] = ()            # pytest node ids that must keep passing
  test_command: str = ""                        # "python3 -m pytest ARGS" (sandbox's python)
  patch: str = ""                               # reference fix (unified diff), may be empty
  test_patch: str = ""                          # applied to the clean copy before the tests
  rootfs: Optional[str] = None                  # root filesystem for the sandbox, if not host's
  timeout: float = DEFAULT_TIMEOUT              # seconds for the test run (code: per process)
  # code
  tests: tuple[Mapping[str, Any], ...] = ()     # {"args", "expected"} or {"input", "output"}
  entry_point: Optional[str] = None             # function name for {"args", "expected"} tests
  # exact
  answers: tuple[str, ...] = ()                 # acceptable answers
  # judge
  rubric: tuple[Mapping[str, Any], ...] = ()    # {"name", "weight", "description", "max"}
  metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    _validate(self)

  @property
  def problem_statement(self) -> str:
    """The first (canonical) phrasing."""
    return self.problem_statements[0]

  def prompt(self, rng) -> str:
    """One phrasing, drawn with `rng` (a `random.Random` or a `numpy.random.Generator`)."""
    n = len(self.problem_statements)
    i = int(rng.integers(n)) if hasattr(rng, "integers") else rng.randrange(n)
    return self.problem_statements[i]

  def pytest_command(self) -> tuple[str, list[str]]:
    """(python interpreter, pytest arguments) of `test_command`."""
    return pytest_command(self.test_command)


def pytest_command(test_command: str) -> tuple[str, list[str]]:
  """Returns (python, args) of "PYTHON -m pytest ARGS" or "pytest ARGS" (python3).

  Raises:
    ValueError: naming the value, for any other command.
  """
  try:
    words = shlex.split(test_command)
  except ValueError as e:
    raise ValueError(f"test_command={test_command!r}: {e}") from None
  if words[:1] in (["pytest"], ["py.test"]):
    return "python3", words[1:]
  if len(words) >= 3 and _PYTHON.match(words[0]) and words[1:3] == ["-m", "pytest"]:
    return words[0], words[3:]
  raise ValueError(f"test_command={test_command!r}: expected 'python3 -m pytest ARGS' (or "
                   "'pytest ARGS'); the verifier runs pytest itself to write a JUnit report")


def _validate(t: Task) -> None:
  """Raise ValueError naming the first bad field."""
  def need(ok, field, value, what):
    if not ok:
      raise ValueError(f"Task {t.instance_id!r}: {field}={value!r:.200}: expected {what}")

  need(isinstance(t.instance_id, str) and t.instance_id.strip(), "instance_id", t.instance_id,
       "a non-empty string")
  need(t.kind in KINDS, "kind", t.kind, f"one of {KINDS}")
  need(isinstance(t.problem_statements, tuple) and t.problem_statements and all(
      isinstance(s, str) and s.strip() for s in t.problem_statements), "problem_statements",
       t.problem_statements, "a non-empty tuple of non-empty strings")
  need(isinstance(t.timeout, (int, float)) and not isinstance(t.timeout, bool)
       and 0 < t.timeout <= 3600, "timeout", t.timeout, "seconds in (0, 3600]")
  if t.kind == "swe":
    need(isinstance(t.repo_path, str) and t.repo_path, "repo_path", t.repo_path,
         "a directory or tarball path")
    for field in ("fail_to_pass", "pass_to_pass"):
      ids = getattr(t, field)
      need(isinstance(ids, tuple) and all(isinstance(i, str) and "::" in i for i in ids), field,
           ids, "a tuple of pytest node ids 'path.py::name'")
    need(t.fail_to_pass, "fail_to_pass", t.fail_to_pass, "at least one test id")
    pytest_command(t.test_command)  # raises naming test_command
  elif t.kind == "code":
    need(t.tests and all(isinstance(c, Mapping) for c in t.tests), "tests", t.tests,
         "a non-empty list of test objects")
    for i, c in enumerate(t.tests):
      if {"args", "expected"} <= set(c):
        need(isinstance(c["args"], (list, tuple)), f"tests[{i}].args", c["args"], "a list")
        need(isinstance(t.entry_point, str) and t.entry_point.isidentifier(), "entry_point",
             t.entry_point, "a function name (function tests need one)")
      else:
        need({"input", "output"} <= set(c) and isinstance(c["input"], str)
             and isinstance(c["output"], str), f"tests[{i}]", c,
             "{'args': [...], 'expected': ...} or {'input': str, 'output': str}")
  elif t.kind == "exact":
    need(t.answers and all(isinstance(a, str) for a in t.answers), "answers", t.answers,
         "a non-empty tuple of strings")
  elif t.kind == "judge":
    need(t.rubric, "rubric", t.rubric, "a non-empty list of dimensions")
    for i, d in enumerate(t.rubric):
      need(isinstance(d, Mapping) and isinstance(d.get("name"), str) and d["name"].strip(),
           f"rubric[{i}].name", d, "a dimension with a non-empty 'name'")
      w = d.get("weight", 1.0)
      need(isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0,
           f"rubric[{i}].weight", w, "a positive number")
      m = d.get("max", 10)
      need(isinstance(m, (int, float)) and not isinstance(m, bool) and m > 0,
           f"rubric[{i}].max", m, "a positive number")


# ----------------------------------------------------------------------------- JSONL loading


def _str_list(d: Mapping, field: str, default=None) -> tuple[str, ...]:
  """A list of strings, also accepted JSON-encoded in a string (as SWE-bench stores them)."""
  if field not in d and default is None:
    raise ValueError(f"field {field!r}: missing")
  v = d.get(field, default)
  if isinstance(v, str):
    try:
      v = json.loads(v)
    except json.JSONDecodeError:
      raise ValueError(f"field {field!r}: a string that is not a JSON list: {v!r:.100}") from None
  if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
    raise ValueError(f"field {field!r}: expected a list of strings, got {v!r:.100}")
  return tuple(v)


def _get(d: Mapping, field: str, types, default=dataclasses.MISSING):
  if field not in d or d[field] is None:
    if default is dataclasses.MISSING:
      raise ValueError(f"field {field!r}: missing")
    return default
  v = d[field]
  if not isinstance(v, types) or isinstance(v, bool) and bool not in (
      types if isinstance(types, tuple) else (types,)):
    raise ValueError(f"field {field!r}: expected {getattr(types, '__name__', types)}, "
                     f"got {v!r:.100}")
  return v


def _statements(d: Mapping, main_field: str) -> tuple[str, ...]:
  """`problem_statements` (list) if present, else the single `main_field`; deduplicated."""
  many = _str_list(d, "problem_statements", []) if "problem_statements" in d else ()
  one = _get(d, main_field, str, None)
  out = list(many) or ([one] if one is not None else [])
  if one is not None and one not in out:
    out.insert(0, one)
  if not out or not all(s.strip() for s in out):
    raise ValueError(f"field {main_field!r}: missing or empty (or 'problem_statements' empty)")
  return tuple(dict.fromkeys(out))


def default_test_command(test_ids: Iterable[str]) -> str:
  """`python3 -m pytest -q FILES` over the files named by the test ids."""
  files = sorted({i.split("::", 1)[0] for i in test_ids})
  return "python3 -m pytest -q " + " ".join(shlex.quote(f) for f in files)


def swe_task_from_dict(d: Mapping, base_dir: str = ".") -> Task:
  """Returns the "swe" Task of one SWE-format record (see the module docstring).

  Args:
    d: the record; fields that are not Task fields go to the task's `metadata`.
    base_dir: what relative `repo_path` and `rootfs` are resolved against.

  Raises:
    ValueError: naming the field that is missing or malformed.
  """
  if not isinstance(d, Mapping):
    raise ValueError(f"expected a JSON object, got {type(d).__name__}")
  instance_id = _get(d, "instance_id", str)
  repo_path = _get(d, "repo_path", str)
  repo_path = os.path.normpath(os.path.join(base_dir, os.path.expanduser(repo_path)))
  if not os.path.exists(repo_path):
    raise ValueError(f"field 'repo_path': {repo_path!r} does not exist")
  f2p = _str_list(d, "FAIL_TO_PASS")
  p2p = _str_list(d, "PASS_TO_PASS", [])
  for field, ids in (("FAIL_TO_PASS", f2p), ("PASS_TO_PASS", p2p)):
    for i in ids:
      if "::" not in i:
        raise ValueError(f"field {field!r}: {i!r} is not a pytest node id 'path.py::name'")
  if not f2p:
    raise ValueError("field 'FAIL_TO_PASS': empty (a task needs at least one failing test)")
  test_command = _get(d, "test_command", str, None) or default_test_command(f2p + p2p)
  try:
    pytest_command(test_command)
  except ValueError as e:
    raise ValueError(f"field 'test_command': {e}") from None
  rootfs = _get(d, "rootfs", str, None)
  if rootfs is not None:
    rootfs = os.path.normpath(os.path.join(base_dir, rootfs))
  timeout = _get(d, "timeout", (int, float), DEFAULT_TIMEOUT)
  if not 0 < timeout <= 3600:
    raise ValueError(f"field 'timeout': {timeout!r}: expected seconds in (0, 3600]")
  known = {"instance_id", "repo_path", "problem_statement", "problem_statements", "FAIL_TO_PASS",
           "PASS_TO_PASS", "test_command", "patch", "test_patch", "rootfs", "timeout"}
  return Task(instance_id=instance_id, kind="swe",
              problem_statements=_statements(d, "problem_statement"), repo_path=repo_path,
              fail_to_pass=f2p, pass_to_pass=p2p, test_command=test_command,
              patch=_get(d, "patch", str, ""), test_patch=_get(d, "test_patch", str, ""),
              rootfs=rootfs, timeout=float(timeout),
              metadata={k: v for k, v in d.items() if k not in known})


def problem_task_from_dict(d: Mapping) -> Task:
  """Returns the "code" / "exact" / "judge" Task of one problem record.

  Raises:
    ValueError: naming the field that is missing or malformed.
  """
  if not isinstance(d, Mapping):
    raise ValueError(f"expected a JSON object, got {type(d).__name__}")
  instance_id = _get(d, "id", str, None) or _get(d, "instance_id", str)
  kind = _get(d, "kind", str, "code")
  if kind not in ("code", "exact", "judge"):
    raise ValueError(f"field 'kind': {kind!r}: expected 'code', 'exact' or 'judge'")
  kw: dict[str, Any] = {}
  if kind == "code":
    tests = _get(d, "tests", list)
    for i, c in enumerate(tests):
      if not isinstance(c, dict):
        raise ValueError(f"field 'tests[{i}]': expected an object, got {c!r:.100}")
      if {"args", "expected"} <= set(c):
        if not isinstance(c["args"], list):
          raise ValueError(f"field 'tests[{i}].args': expected a list, got {c['args']!r:.100}")
        if not isinstance(d.get("entry_point"), str):
          raise ValueError("field 'entry_point': function tests ({'args', 'expected'}) need "
                           "the name of the function")
      elif not ({"input", "output"} <= set(c) and isinstance(c["input"], str)
                and isinstance(c["output"], str)):
        raise ValueError(f"field 'tests[{i}]': expected {{'args', 'expected'}} or "
                         f"{{'input': str, 'output': str}}, got {c!r:.100}")
    if not tests:
      raise ValueError("field 'tests': empty")
    kw.update(tests=tuple(tests), entry_point=_get(d, "entry_point", str, None))
  elif kind == "exact":
    answers = _str_list(d, "answers") if "answers" in d else (_get(d, "answer", str),)
    if not answers:
      raise ValueError("field 'answers': empty")
    kw.update(answers=answers)
  else:
    rubric = _get(d, "rubric", list)
    for i, dim in enumerate(rubric):
      if not isinstance(dim, dict) or not isinstance(dim.get("name"), str):
        raise ValueError(f"field 'rubric[{i}]': expected an object with a 'name', "
                         f"got {dim!r:.100}")
    kw.update(rubric=tuple(rubric))
  timeout = _get(d, "timeout", (int, float),
                 CODE_TIMEOUT if kind == "code" else DEFAULT_TIMEOUT)
  if not 0 < timeout <= 3600:
    raise ValueError(f"field 'timeout': {timeout!r}: expected seconds in (0, 3600]")
  known = {"id", "instance_id", "kind", "prompt", "problem_statements", "tests", "entry_point",
           "answer", "answers", "rubric", "timeout"}
  return Task(instance_id=instance_id, kind=kind, problem_statements=_statements(d, "prompt"),
              timeout=float(timeout), metadata={k: v for k, v in d.items() if k not in known},
              **kw)


def _load(path: str, parse, skip_bad: bool, errors: Optional[list]) -> list[Task]:
  tasks, bad, seen = [], 0, {}
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        try:
          d = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"invalid JSON ({e.msg} at column {e.colno})") from None
        task = parse(d)
        if task.instance_id in seen:
          raise ValueError(f"field 'instance_id': {task.instance_id!r} already used on line "
                           f"{seen[task.instance_id]}")
        seen[task.instance_id] = lineno
        tasks.append(task)
      except ValueError as e:
        err = TaskFormatError(f"{path}:{lineno}: {e}")
        if not skip_bad:
          raise err from None
        bad += 1
        log.warning("skipping bad task line: %s", err)
        if errors is not None:
          errors.append(err)
  if bad:
    log.warning("%s: skipped %d bad line(s), loaded %d task(s)", path, bad, len(tasks))
  return tasks


def load_swe_jsonl(path: str, skip_bad: bool = False,
                   errors: Optional[list] = None) -> list[Task]:
  """Returns the tasks of a SWE-format JSONL file, in file order.

  Args:
    path: the file; relative `repo_path`s are resolved against its directory.
    skip_bad: log and skip a bad line instead of raising.
    errors: when given, the skipped lines' errors are appended to it.

  Raises:
    TaskFormatError: "FILE:LINE: field 'NAME': ..." for a bad line or a repeated instance_id
      (unless skip_bad).
  """
  base = os.path.dirname(os.path.abspath(path))
  return _load(path, lambda d: swe_task_from_dict(d, base), skip_bad, errors)


def load_problems_jsonl(path: str, skip_bad: bool = False,
                        errors: Optional[list] = None) -> list[Task]:
  """Returns the tasks of a problem JSONL file (code / exact / judge), in file order.

  Args:
    path: the file.
    skip_bad: log and skip a bad line instead of raising TaskFormatError (`load_swe_jsonl`).
    errors: when given, the skipped lines' errors are appended to it.
  """
  return _load(path, problem_task_from_dict, skip_bad, errors)


def load_tasks(path: str, skip_bad: bool = False, errors: Optional[list] = None) -> list[Task]:
  """Returns the tasks of a JSONL file of either format: a line with FAIL_TO_PASS is SWE.

  Args:
    path: the file; relative `repo_path`s are resolved against its directory.
    skip_bad: log and skip a bad line instead of raising TaskFormatError (`load_swe_jsonl`).
    errors: when given, the skipped lines' errors are appended to it.
  """
  base = os.path.dirname(os.path.abspath(path))

  def parse(d):
    if isinstance(d, dict) and "FAIL_TO_PASS" in d:
      return swe_task_from_dict(d, base)
    return problem_task_from_dict(d)
  return _load(path, parse, skip_bad, errors)


def task_to_swe_dict(task: Task, repo_path: Optional[str] = None) -> dict:
  """Returns the SWE-format record of a "swe" task (inverse of `swe_task_from_dict`).

  Args:
    task: the task; its metadata fields are written back as record fields.
    repo_path: the record's repo_path; None: the task's.
  """
  d = dict(task.metadata)
  d.update(instance_id=task.instance_id, repo_path=repo_path or task.repo_path,
           problem_statement=task.problem_statement,
           problem_statements=list(task.problem_statements),
           FAIL_TO_PASS=list(task.fail_to_pass), PASS_TO_PASS=list(task.pass_to_pass),
           test_command=task.test_command, patch=task.patch, test_patch=task.test_patch,
           timeout=task.timeout)
  if task.rootfs:
    d["rootfs"] = task.rootfs
  return d


# ----------------------------------------------------------------------------- repositories

_SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".hg", ".svn"}


def is_cache_path(path: str) -> bool:
  """Byte-code and tool caches: never part of a task or of an agent's change."""
  parts = path.split("/")
  return any(p in _SKIP_DIRS for p in parts[:-1]) or parts[-1].endswith((".pyc", ".pyo"))


def _check_rel(path: str, where: str) -> str:
  parts = path.split("/")
  if path.startswith("/") or ".." in parts or "\x00" in path or not path:
    raise ValueError(f"{where}: unsafe path {path!r} (absolute, '..' or empty)")
  return "/".join(p for p in parts if p not in ("", "."))


def load_repo_files(task_or_path) -> dict[str, bytes]:
  """The snapshot's regular files as {relative path: bytes} (caches and .git left out).

  Symlinks and special files are skipped: the sandbox file API writes regular files only.

  Args:
    task_or_path: a Task, or a path to a directory or a .tar / .tar.gz / .tgz archive.

  Raises:
    ValueError: the task has no repository, the path is neither a directory nor a tar archive,
      or an archive member has an unsafe path.
  """
  path = task_or_path.repo_path if isinstance(task_or_path, Task) else task_or_path
  if path is None:
    raise ValueError("repo_path=None: this task has no repository")
  files: dict[str, bytes] = {}
  if os.path.isdir(path):
    for dirpath, dirnames, filenames in os.walk(path):
      dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
      for name in sorted(filenames):
        full = os.path.join(dirpath, name)
        rel = os.path.relpath(full, path).replace(os.sep, "/")
        if os.path.islink(full) or not os.path.isfile(full) or is_cache_path(rel):
          continue
        with open(full, "rb") as f:
          files[rel] = f.read()
  elif os.path.isfile(path) and tarfile.is_tarfile(path):
    with tarfile.open(path) as tar:
      for m in tar:
        if not m.isfile():
          continue
        rel = _check_rel(m.name, f"repo_path={path!r}")
        if not is_cache_path(rel):
          files[rel] = tar.extractfile(m).read()
  else:
    raise ValueError(f"repo_path={path!r}: not a directory or tar archive")
  return files


# ----------------------------------------------------------------------------- unified diffs


def make_patch(old: Mapping[str, bytes], new: Mapping[str, bytes]) -> str:
  """Returns a unified diff (git-style a/ b/ paths) turning the `old` files into the `new` ones.

  Files that are not UTF-8 text are left out (with a warning): diffs carry text only. No
  change gives "".

  Args:
    old: {relative path: content} before.
    new: {relative path: content} after.
  """
  out = []
  for path in sorted(set(old) | set(new)):
    a, b = old.get(path), new.get(path)
    if a == b:
      continue
    try:
      a_text = None if a is None else a.decode("utf-8")
      b_text = None if b is None else b.decode("utf-8")
    except UnicodeDecodeError:
      log.warning("make_patch: %s is not UTF-8 text, left out of the diff", path)
      continue
    a_lines = [] if a_text is None else a_text.splitlines(keepends=True)
    b_lines = [] if b_text is None else b_text.splitlines(keepends=True)
    from_file = "/dev/null" if a is None else f"a/{path}"
    to_file = "/dev/null" if b is None else f"b/{path}"
    out.append(f"diff --git a/{path} b/{path}\n")
    lines = list(difflib.unified_diff(a_lines, b_lines, from_file, to_file))
    if not lines:  # a new or deleted empty file: headers only
      lines = [f"--- {from_file}\n", f"+++ {to_file}\n"]
    for line in lines:
      # difflib leaves a last line without "\n" as is; git marks it explicitly.
      out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
  return "".join(out)


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _diff_path(header: str) -> Optional[str]:
  name = header[4:].split("\t", 1)[0].strip()
  if name == "/dev/null":
    return None
  if name.startswith(("a/", "b/")):
    name = name[2:]
  return _check_rel(name, "patch")


def apply_patch(files: Mapping[str, bytes], patch: str) -> dict[str, bytes]:
  """Returns `files` with a unified diff applied (a new dict; `files` is not modified).

  Strict: context and removed lines must match exactly; a hunk may sit at another line than
  its header says (as `patch` allows offsets) but there is no fuzz.

  Args:
    files: {relative path: content}.
    patch: the unified diff.

  Raises:
    ValueError: a malformed or unsafe patch, a hunk that does not match, a missing source file
      or a created file that already exists.
  """
  out = dict(files)
  lines = patch.splitlines(keepends=True)
  i = 0
  while i < len(lines):
    if not lines[i].startswith("--- "):
      i += 1
      continue
    if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
      raise ValueError(f"patch line {i + 1}: '---' header without '+++'")
    src, dst = _diff_path(lines[i]), _diff_path(lines[i + 1])
    i += 2
    if src is not None and src not in out:
      raise ValueError(f"patch: {src!r} does not exist")
    if src is None and dst is not None and dst in out:
      raise ValueError(f"patch: creates {dst!r}, which already exists")
    text = [] if src is None else out[src].decode("utf-8").splitlines(keepends=True)
    delta = 0  # how far earlier hunks (and their offsets) moved the lines below them
    while i < len(lines) and lines[i].startswith("@@"):
      m = _HUNK.match(lines[i])
      if not m:
        raise ValueError(f"patch line {i + 1}: bad hunk header {lines[i]!r}")
      n_old = 1 if m.group(2) is None else int(m.group(2))
      n_new = 1 if m.group(4) is None else int(m.group(4))
      i += 1
      old_part, new_part = [], []
      while (len(old_part) < n_old or len(new_part) < n_new) and i < len(lines):
        line = lines[i]
        tag, body = line[:1], line[1:]
        if i + 1 < len(lines) and lines[i + 1].startswith("\\"):
          body = body[:-1] if body.endswith("\n") else body  # "\ No newline at end of file"
        if tag in (" ", "\n"):  # some tools drop the space of an empty context line
          body = body if tag == " " else "\n"
          old_part.append(body)
          new_part.append(body)
        elif tag == "-":
          old_part.append(body)
        elif tag == "+":
          new_part.append(body)
        else:
          raise ValueError(f"patch line {i + 1}: unexpected {line!r:.80} inside a hunk")
        i += 2 if i + 1 < len(lines) and lines[i + 1].startswith("\\") else 1
      if len(old_part) != n_old or len(new_part) != n_new:
        raise ValueError(f"patch: hunk of {dst or src!r} is truncated")
      # "-k,0" inserts after line k; otherwise the hunk starts at line k (1-based).
      pos = (int(m.group(1)) - 1 if n_old else int(m.group(1))) + delta
      at = _find(text, old_part, pos)
      if at is None:
        raise ValueError(f"patch: hunk at line {m.group(1)} of {src or dst!r} does not apply")
      text[at:at + n_old] = new_part
      delta += at - pos + n_new - n_old
    if src is not None and src != dst:
      del out[src]
    if dst is not None:
      out[dst] = "".join(text).encode("utf-8")
  return out


def _find(text: list[str], part: list[str], start: int) -> Optional[int]:
  """Index nearest to `start` where `part` occurs in `text`."""
  n = len(part)
  start = min(max(start, 0), len(text))
  for d in range(len(text) + 1):
    for at in (start - d, start + d) if d else (start,):
      if 0 <= at <= len(text) - n and text[at:at + n] == part:
        return at
  return None


def reference_files(task: Task) -> dict[str, bytes]:
  """The repository with the task's reference fix (`task.patch`) applied."""
  return apply_patch(load_repo_files(task), task.patch)
