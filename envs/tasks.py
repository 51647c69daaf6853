"""Tasks: what an episode asks of the agent, and what its verifier checks.

One `Task` type covers five kinds:
- "swe": a repository snapshot with a bug; the `tests` verifier runs the task's test command in
  a fresh sandbox and grades its FAIL_TO_PASS / PASS_TO_PASS tests as SWE-bench does.
- "code": a code problem (prompt + function or stdin/stdout tests), verifier `python_io`;
  `code_style` "livecodebench" runs and compares programs as LiveCodeBench does
  (envs/livecodebench.py loads its rows).
- "exact": a question with a short answer, verifier `exact`.
- "judge": an open-ended task scored by a policy against a weighted rubric, verifier `judge`.
- "shell": a Terminal-Bench-style task (envs/terminal_bench.py): a set-up script makes the
  agent's starting workspace, a check script with hidden test files runs in the agent's final
  sandbox, verifier `shell`.

`task_format(task)` names the benchmark family a task belongs to (swe, swe-synth, generated,
livecodebench, terminal-bench, code, exact, judge): evaluation reports are grouped by it.

"One commit, many prompts": a task carries several phrasings of its instruction (expert to
colloquial) and `Task.prompt(rng)` samples one per episode from an explicit rng.

Loaders: `load_swe_jsonl` (SWE rows, below), `load_swe_parquet` and `load_swe_rows` (the same
rows from a Parquet file or a Hugging Face `datasets` split / any list of dicts),
`load_problems_jsonl` (code / exact / judge problems) and `load_tasks` (either, per line; a
.parquet file is SWE rows). A bad row raises `TaskFormatError` naming the file and line (or
row) and the field; with `skip_bad=True` it is logged and counted instead.

SWE rows use the official fields of SWE-bench, SWE-bench Verified, SWE-Gym and SWE-smith:
  instance_id, repo ("owner/name"), base_commit, problem_statement, patch (the reference fix;
  SWE-smith's `patch` introduces the bug and is reversed), test_patch (applied only in the
  verifier's copy, never in the agent's workspace), FAIL_TO_PASS / PASS_TO_PASS (lists, or JSON
  strings as SWE-bench stores them), version, environment_setup_commit, created_at, hints_text,
  image_name (SWE-smith: the prepared container image, kept for the docker backend), log_parser
  (swebench >= 5: which log format the tests print). Other fields are kept in `metadata`.
Where the repository comes from:
  - `repo_path` (ours): a directory or .tar/.tar.gz/.tgz snapshot inside the file's folder;
  - otherwise `repo` + `base_commit` in a local mirror of git repositories (`mirror=DIR`, else the
    ARBOR_SWE_MIRROR environment variable, else, for a file's rows, the `mirror/` folder beside the
    file, as `envs.synth` writes it; `envs.swe_mirror`): DIR/<owner>__<name>.git,
    DIR/<owner>__<name>, DIR/<owner>/<name>.git or DIR/<owner>/<name>, bare or not, read only
    through `envs.safe_git` (none of the repository's configured programs runs; a repository of
    another user, or one linked into DIR, is refused). The commit is checked out once into a cache
    directory keyed by (repo, commit) (`cache_dir=`, ARBOR_SWE_CACHE, default ~/.cache/arbor/swe)
    when the repository is first read. A SWE-smith row (repo "swesmith/...") without base_commit
    starts from the branch named after its instance_id; when that branch's head is SWE-smith's
    "Remove F2P Tests" commit, its parent's test files become the test patch.
How the tests run (`test_runner`, chosen per repository like swebench's specs, or by `log_parser`):
"pytest" (the default: `python3 -m pytest -rA FILES`, FILES from the test patch), "django"
(django/django: `python3 tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1
LABELS`) or "sympy" (sympy/sympy: `bin/test -C --verbose FILES`). A `test_command` field (ours)
overrides the command; one of the form `[NAME=VALUE ...] python3 -m unittest [ARGS]` selects
"unittest" (run as `python3 -m unittest -v ARGS`, its log read by swebench's "parse_log_django",
the only `log_parser` such a row may name). Ours also: `problem_statements` (more phrasings),
`rootfs` (the sandbox's root filesystem, a directory inside the file's folder), `timeout` (seconds
for the test run), `environment` (an `envs.environments` spec object: the sandbox starts from its
build, bwrap from its root filesystem and docker from its image). A row without one gets one from a
spec source when the loader is asked (`env_from="swebench"`: swebench's table for the row's repo
and version; `"repository"`: the repository's own metadata; default "none").
A dataset is untrusted: `repo_path` and `rootfs` are resolved by `envs.dataset_paths` inside the
folder of the file (`base_dir` for rows given as dicts): an absolute path, "..", "~" or a
symbolic link anywhere on the way is an error naming the field.

  {"instance_id": "calc-1", "repo": "me/calc", "base_commit": "1f2e...",
   "problem_statement": "...", "patch": "<fix>", "test_patch": "<adds the failing tests>",
   "FAIL_TO_PASS": "[\\"tests/test_calc.py::test_add\\"]", "PASS_TO_PASS": "[]", "version": "1.0"}
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
import stat
import tarfile
from typing import Any, Iterable, Mapping, Optional

from envs import dataset_paths
from envs.environments import spec as env_spec
from envs.untrusted import decode
from envs.safe_git import GitError  # noqa: F401  (re-exported: git failed on a mirror)
# Mirror helpers live in envs.swe_mirror; their names stay importable from here.
from envs.swe_mirror import (DEFAULT_CACHE, check_rel as _check_rel, checkout,  # noqa: F401
                             dataset_mirror, find_mirror, resolve_commit,
                             smith_test_patch as _smith_test_patch)
# A task's repository as files lives in envs.repo_files; its names stay importable from here.
from envs.repo_files import is_cache_path, load_repo_files, repo_dir  # noqa: F401
from envs.environments import sources as env_sources

log = logging.getLogger(__name__)

KINDS = ("swe", "code", "exact", "judge", "shell")
CODE_STYLES = ("plain", "livecodebench")  # how "code" programs are run and compared
CHECK_PARSERS = ("pytest", "exit_code")     # how a "shell" task's check is graded
FORMATS = ("swe", "swe-synth", "generated", "livecodebench", "terminal-bench", "code", "exact",
           "judge")
DEFAULT_TIMEOUT = 120.0  # seconds for one test run
CODE_TIMEOUT = 10.0      # seconds for each test process of a code problem

# A test command is "PYTHON -m pytest ARGS" (PYTHON: python, python3, python3.11 or a path to
# one, e.g. a task's virtualenv) or "pytest ARGS"; the verifier runs pytest itself with ARGS.
_PYTHON = re.compile(r"^(?:[\w.+-]*/)*python[\d.]*$")

# How a repository's tests run and print their results: pytest (JUnit report), or the log
# formats of Django's tests/runtests.py, sympy's bin/test and `python -m unittest -v`, parsed as
# SWE-bench parses them.
TEST_RUNNERS = ("pytest", "django", "sympy", "unittest")
REPO_RUNNERS = {"django/django": "django", "sympy/sympy": "sympy"}  # others: pytest
# swebench's log_parser names (PARSER_REGISTRY) of Python repositories -> our runner.
LOG_PARSERS = {"parse_log_django": "django", "parse_log_sympy": "sympy", **{
    f"parse_log_{n}": "pytest" for n in (
        "pytest", "pytest_options", "pytest_v2", "astroid", "astropy", "flask", "marshmallow",
        "matplotlib", "pvlib", "pydicom", "pylint", "pyvista", "requests", "scikit", "seaborn",
        "sphinx", "sqlfluff", "xarray")}}
UNITTEST_PARSER = "parse_log_django"  # swebench's reader of unittest's verbose log
# SWE-bench's test commands (constants/python.py), run with the sandbox's python3.
DJANGO_COMMAND = "python3 tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1"
DJANGO_COMMAND_1_9 = "python3 tests/runtests.py --verbosity 2"  # Django 1.9 has neither option
SYMPY_COMMAND = ("PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' "
                 "python3 bin/test -C --verbose")
# Files a test patch may touch that are data, not tests (SWE-bench's NON_TEST_EXTS).
_NON_TEST_EXTS = (".json", ".png", "csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml",
                  ".yaml", ".toml")


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
  fail_to_pass: tuple[str, ...] = ()            # tests that must go from fail to pass
  pass_to_pass: tuple[str, ...] = ()            # tests that must keep passing
  test_command: str = ""                        # shell command running the tests (see runner)
  patch: str = ""                               # reference fix (unified diff), may be empty
  test_patch: str = ""                          # applied to the verifier's copy before tests
  rootfs: Optional[str] = None                  # root filesystem for the sandbox, if not host's
  timeout: float = DEFAULT_TIMEOUT              # seconds for the test run (code: per process)
  repo: str = ""                                # "owner/name" of the repository, if known
  base_commit: str = ""                         # the commit the task starts from, if known
  mirror: Optional[str] = None                  # git directory holding base_commit
  cache_dir: Optional[str] = None               # where checkouts of mirrored commits are kept
  image_name: Optional[str] = None              # prepared container image (docker backend)
  environment: Optional[env_spec.Environment] = None  # what the sandbox starts from, if set
  test_runner: str = "pytest"                   # one of TEST_RUNNERS
  # code
  tests: tuple[Mapping[str, Any], ...] = ()     # {"args", "expected"} or {"input", "output"}
  entry_point: Optional[str] = None             # function ("f") or method ("Solution.f") name
  code_style: str = "plain"                     # one of CODE_STYLES
  memory_mb: Optional[int] = None               # address-space limit of each test process (MiB)
  # shell (timeout: the check's seconds)
  setup_script: str = ""                        # bash, run in the workspace before the agent
  check_script: str = ""                        # bash, run after the agent (run-tests.sh)
  check_files: Mapping[str, bytes] = dataclasses.field(default_factory=dict)  # tests/, hidden
  check_parser: str = "pytest"                  # one of CHECK_PARSERS
  agent_timeout: Optional[float] = None         # seconds the agent may work, if bounded
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
    """(python interpreter, pytest arguments) of `test_command` (pytest tasks)."""
    return pytest_command(self.test_command)

  def script_command(self) -> tuple[dict[str, str], str, str, list[str]]:
    """(environment, python, script, arguments) of `test_command` (django / sympy tasks; for
    unittest tasks the script is "" and the arguments are unittest's, see `unittest_command`)."""
    if self.test_runner == "unittest":
      env, python, args = unittest_command(self.test_command)
      return env, python, "", args
    return script_command(self.test_command)


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


def script_command(test_command: str) -> tuple[dict[str, str], str, str, list[str]]:
  """Returns (env, python, script, args) of "[NAME=VALUE ...] [PYTHON] SCRIPT ARGS".

  SCRIPT is a repository-relative Python script (Django's tests/runtests.py, sympy's bin/test);
  without PYTHON it runs with python3.

  Raises:
    ValueError: naming the value, for any other command.
  """
  env, words = _env_words(test_command)
  python = words.pop(0) if words and _PYTHON.match(words[0]) else "python3"
  script = words[0].removeprefix("./") if words else ""
  if (not script or script.startswith(("-", "/")) or ".." in script.split("/")
      or "\x00" in script):
    raise ValueError(f"test_command={test_command!r}: expected '[NAME=VALUE ...] [python3] "
                     "SCRIPT ARGS' with SCRIPT a path inside the repository")
  return env, python, script, words[1:]


def _env_words(test_command: str) -> tuple[dict[str, str], list[str]]:
  """({NAME: VALUE} of the leading assignments, the remaining words) of a test command."""
  try:
    words = shlex.split(test_command)
  except ValueError as e:
    raise ValueError(f"test_command={test_command!r}: {e}") from None
  env = {}
  while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
    name, value = words.pop(0).split("=", 1)
    env[name] = value
  return env, words


def unittest_command(test_command: str) -> tuple[dict[str, str], str, list[str]]:
  """Returns (env, python, args) of "[NAME=VALUE ...] PYTHON -m unittest [ARGS]".

  The verifier runs `PYTHON -m unittest -v ARGS` (-v after a leading "discover"), whose
  verbose log SWE-bench's django parser reads (`UNITTEST_PARSER`).

  Raises:
    ValueError: naming the value, for any other command, or one with -q / --quiet (it would
      hide the per-test lines that the log parser reads).
  """
  env, words = _env_words(test_command)
  if not (len(words) >= 3 and _PYTHON.match(words[0]) and words[1:3] == ["-m", "unittest"]):
    raise ValueError(f"test_command={test_command!r}: expected '[NAME=VALUE ...] python3 -m "
                     "unittest [ARGS]'")
  if {"-q", "--quiet"} & set(words[3:]):
    raise ValueError(f"test_command={test_command!r}: -q / --quiet hides the per-test lines "
                     "that the log parser reads; leave it out")
  return env, words[0], words[3:]


def is_unittest_command(test_command: str) -> bool:
  """Whether `test_command` runs "PYTHON -m unittest" (well formed or not)."""
  try:
    words = _env_words(test_command)[1]
  except ValueError:
    return False
  return len(words) >= 3 and bool(_PYTHON.match(words[0])) and words[1:3] == ["-m", "unittest"]


def task_format(task: Task) -> str:
  """The benchmark family of a task, from its kind and metadata (evaluation reports group by it).

  - "shell" -> "terminal-bench";
  - "code" with code_style "livecodebench" (or metadata format "livecodebench") ->
    "livecodebench", other "code" -> "code";
  - "swe" with metadata "mutation" (a synthesised bug) -> "swe-synth"; with a metadata
    "generator" of envs.taskgen ("arbor.taskgen/...") -> "generated"; other "swe" -> "swe";
  - "exact" and "judge" -> themselves.

  Args:
    task: the task.

  Returns:
    One of FORMATS.
  """
  meta = task.metadata or {}
  if task.kind == "shell":
    return "terminal-bench"
  if task.kind == "code":
    lcb = task.code_style == "livecodebench" or meta.get("format") == "livecodebench"
    return "livecodebench" if lcb else "code"
  if task.kind == "swe":
    if meta.get("mutation"):
      return "swe-synth"
    if str(meta.get("generator", "")).startswith("arbor.taskgen"):
      return "generated"
    return "swe"
  return task.kind


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
    need(isinstance(t.repo_path, str) and t.repo_path or t.mirror and t.base_commit,
         "repo_path", t.repo_path, "a directory or tarball path (or mirror and base_commit)")
    need(t.test_runner in TEST_RUNNERS, "test_runner", t.test_runner, f"one of {TEST_RUNNERS}")
    for field in ("fail_to_pass", "pass_to_pass"):
      ids = getattr(t, field)
      need(isinstance(ids, tuple) and all(isinstance(i, str) and i for i in ids), field, ids,
           "a tuple of non-empty test ids")
      need(t.test_runner != "pytest" or all("::" in i for i in ids), field, ids,
           "pytest node ids 'path.py::name'")
    need(t.fail_to_pass, "fail_to_pass", t.fail_to_pass, "at least one test id")
    if t.test_runner == "pytest":
      pytest_command(t.test_command)  # raises naming test_command
    else:
      t.script_command()
  elif t.kind == "code":
    need(t.tests and all(isinstance(c, Mapping) for c in t.tests), "tests", t.tests,
         "a non-empty list of test objects")
    need(t.code_style in CODE_STYLES, "code_style", t.code_style, f"one of {CODE_STYLES}")
    need(t.memory_mb is None or isinstance(t.memory_mb, int) and not isinstance(
        t.memory_mb, bool) and 16 <= t.memory_mb <= 65536, "memory_mb", t.memory_mb,
         "None or MiB in [16, 65536]")
    for i, c in enumerate(t.tests):
      if {"args", "expected"} <= set(c):
        need(isinstance(c["args"], (list, tuple)), f"tests[{i}].args", c["args"], "a list")
        need(isinstance(t.entry_point, str) and 1 <= len(t.entry_point.split(".")) <= 2
             and all(p.isidentifier() for p in t.entry_point.split(".")), "entry_point",
             t.entry_point, "a function name 'f' or a method 'Class.f' (function tests need one)")
      else:
        need({"input", "output"} <= set(c) and isinstance(c["input"], str)
             and isinstance(c["output"], str), f"tests[{i}]", c,
             "{'args': [...], 'expected': ...} or {'input': str, 'output': str}")
  elif t.kind == "exact":
    need(t.answers and all(isinstance(a, str) for a in t.answers), "answers", t.answers,
         "a non-empty tuple of strings")
  elif t.kind == "shell":
    need(isinstance(t.check_script, str) and t.check_script.strip(), "check_script",
         t.check_script, "a non-empty bash script")
    need(isinstance(t.setup_script, str), "setup_script", t.setup_script, "a bash script")
    need(t.check_parser in CHECK_PARSERS, "check_parser", t.check_parser,
         f"one of {CHECK_PARSERS}")
    need(isinstance(t.check_files, Mapping) and all(
        isinstance(p, str) and isinstance(b, bytes) for p, b in t.check_files.items()),
         "check_files", t.check_files, "a mapping {relative path: bytes}")
    for p in t.check_files:
      _check_rel(p, f"Task {t.instance_id!r}: check_files")
    need(t.agent_timeout is None or isinstance(t.agent_timeout, (int, float))
         and not isinstance(t.agent_timeout, bool) and t.agent_timeout > 0, "agent_timeout",
         t.agent_timeout, "None or seconds > 0")
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


# ----------------------------------------------------------------------------- row fields


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
  if hasattr(v, "tolist"):  # a numpy array, as pandas gives Parquet list columns
    v = v.tolist()
  if isinstance(v, tuple):
    v = list(v)
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


def patch_files(patch: str) -> list[str]:
  """The files a unified diff touches.

  Args:
    patch: the diff ("diff --git a/X b/Y", "--- a/X" and "+++ b/Y" lines name files).

  Returns:
    The paths in order of appearance, without duplicates.
  """
  out = []
  for line in patch.splitlines():
    m = re.match(r"^diff --git a/.* b/(.*)$", line)
    name = m.group(1) if m else None
    if line.startswith(("--- a/", "+++ b/")):
      name = line[6:].split("\t", 1)[0].strip()
    if name and name not in out:
      out.append(name)
  return out


def patch_directives(test_patch: str, runner: str = "pytest") -> list[str]:
  """What SWE-bench passes to the test command.

  The test patch's files, data files left out; for Django, its test modules as labels
  relative to tests/ ("tests/a/tests.py" -> "a.tests").

  Args:
    test_patch: the task's test patch.
    runner: one of TEST_RUNNERS.

  Returns:
    The arguments, in order.
  """
  found = re.findall(r"^diff --git a/.* b/(.*)$", test_patch, re.M) or patch_files(test_patch)
  files = [f for f in dict.fromkeys(found) if not f.endswith(_NON_TEST_EXTS)]
  if runner != "django":
    return files
  labels = []
  for f in files:
    base = f.rsplit("/", 1)[-1]
    if not (base == "tests.py" or base.startswith("test_") or "/tests/" in f or "/test_" in f):
      continue
    f = f.removesuffix(".py").removeprefix("tests/")
    labels.append(f.replace("/", "."))
  return labels


def default_test_command(test_ids: Iterable[str], runner: str = "pytest", test_patch: str = "",
                         version: str = "") -> str:
  """The test command SWE-bench would run for a task.

  Args:
    test_ids: the task's FAIL_TO_PASS + PASS_TO_PASS ids (pytest: their files are run when the
      test patch names no test file).
    runner: one of TEST_RUNNERS.
    test_patch: the task's test patch (its files are what runs).
    version: the row's `version` (Django 1.9 runs without --settings / --parallel).

  Returns:
    The shell command; its words are shell-quoted.
  """
  args = patch_directives(test_patch, runner)
  if runner == "django":
    head = DJANGO_COMMAND_1_9 if version == "1.9" else DJANGO_COMMAND
  elif runner == "sympy":
    head = SYMPY_COMMAND
  else:
    head = "python3 -m pytest -rA"
    args = args or sorted({i.split("::", 1)[0] for i in test_ids})
  return " ".join([head] + [shlex.quote(a) for a in args])


def _runner(d: Mapping, repo: str) -> str:
  parser = _get(d, "log_parser", str, None)
  command = _get(d, "test_command", str, None)
  if command and is_unittest_command(command):  # the command names its runner
    if parser not in (None, UNITTEST_PARSER):
      raise ValueError(f"field 'log_parser': {parser!r}: test_command {command!r} runs unittest, "
                       f"whose log {UNITTEST_PARSER!r} reads")
    return "unittest"
  if parser is None:
    return REPO_RUNNERS.get(repo, "pytest")
  if parser not in LOG_PARSERS:
    raise ValueError(f"field 'log_parser': {parser!r}: not supported; expected one of "
                     f"{sorted(LOG_PARSERS)}")
  return LOG_PARSERS[parser]


def swe_task_from_dict(d: Mapping, base_dir: str = ".", mirror: Optional[str] = None,
                       cache_dir: Optional[str] = None, env_from: str = "none",
                       swebench_specs: Any = None) -> Task:
  """Returns the "swe" Task of one SWE row (see the module docstring).

  Args:
    d: the row; fields that are not Task fields go to the task's `metadata`.
    base_dir: the dataset's folder: `repo_path` and `rootfs` are paths inside it
      (`envs.dataset_paths`).
    mirror: the directory of git mirrors, for rows without `repo_path` (default: the
      ARBOR_SWE_MIRROR environment variable).
    cache_dir: where checkouts of mirrored commits go (default: ARBOR_SWE_CACHE, else
      ~/.cache/arbor/swe).
    env_from: where a row without an `environment` field gets one: "none" (it has none),
      "swebench" or "repository" (`envs.environments.sources.SOURCES`).
    swebench_specs: swebench's install table for env_from="swebench"
      (`envs.environments.sources.load_swebench_specs`'s source).

  Raises:
    ValueError: naming the field that is missing or malformed (a mirror or commit that is not
      there names 'repo' / 'base_commit', a bad spec 'environment.KEY').
  """
  if not isinstance(d, Mapping):
    raise ValueError(f"expected a JSON object, got {type(d).__name__}")
  instance_id = _get(d, "instance_id", str)
  repo = _get(d, "repo", str, "")
  runner = _runner(d, repo)
  f2p = _str_list(d, "FAIL_TO_PASS")
  p2p = _str_list(d, "PASS_TO_PASS", [])
  for field, ids in (("FAIL_TO_PASS", f2p), ("PASS_TO_PASS", p2p)):
    for i in ids:
      if runner == "pytest" and "::" not in i or not i:
        raise ValueError(f"field {field!r}: {i!r} is not a pytest node id 'path.py::name' "
                         "(other test runners: see 'log_parser')")
  if not f2p:
    raise ValueError("field 'FAIL_TO_PASS': empty (a task needs at least one failing test)")
  smith = repo.startswith("swesmith/")
  patch = _get(d, "patch", str, "")
  if smith:  # SWE-smith's patch introduces the bug; its reverse is the fix
    patch = reverse_patch(patch)
  test_patch = _get(d, "test_patch", str, None)
  repo_path = _get(d, "repo_path", str, None)
  base_commit = _get(d, "base_commit", str, "")
  git_dir = None
  if repo_path is not None:
    repo_path = dataset_paths.resolve(base_dir, repo_path, "field 'repo_path'")
  else:
    if not repo:
      raise ValueError("field 'repo_path': missing (or 'repo' and 'base_commit' with a mirror)")
    mirror = mirror or os.environ.get("ARBOR_SWE_MIRROR")
    if not mirror:
      raise ValueError(f"field 'repo': {repo!r} needs a mirror of git repositories (mirror=DIR "
                       "or ARBOR_SWE_MIRROR=DIR), or give 'repo_path'")
    git_dir = find_mirror(mirror, repo)
    ref = base_commit or (instance_id if smith else "")
    if not ref:
      raise ValueError("field 'base_commit': missing")
    base_commit = resolve_commit(git_dir, ref)
    if smith and test_patch is None:
      test_patch = _smith_test_patch(git_dir, base_commit)
    cache_dir = os.path.abspath(os.path.expanduser(
        cache_dir or os.environ.get("ARBOR_SWE_CACHE") or DEFAULT_CACHE))
  test_patch = test_patch or ""
  version = _get(d, "version", (str, int, float), "")
  test_command = _get(d, "test_command", str, None) or default_test_command(
      f2p + p2p, runner, test_patch, str(version))
  try:
    {"pytest": pytest_command, "unittest": unittest_command}.get(runner, script_command)(
        test_command)
  except ValueError as e:
    raise ValueError(f"field 'test_command': {e}") from None
  rootfs = _get(d, "rootfs", str, None)
  if rootfs is not None:
    rootfs = dataset_paths.resolve(base_dir, rootfs, "field 'rootfs'", kind="dir")
  timeout = _get(d, "timeout", (int, float), DEFAULT_TIMEOUT)
  if not 0 < timeout <= 3600:
    raise ValueError(f"field 'timeout': {timeout!r}: expected seconds in (0, 3600]")
  environment = _environment(d, env_from, swebench_specs, repo_path, git_dir, base_commit)
  known = {"instance_id", "repo_path", "problem_statement", "problem_statements", "FAIL_TO_PASS",
           "PASS_TO_PASS", "test_command", "patch", "test_patch", "rootfs", "timeout", "repo",
           "base_commit", "image_name", "log_parser", "environment"}
  return Task(instance_id=instance_id, kind="swe",
              problem_statements=_statements(d, "problem_statement"), repo_path=repo_path,
              fail_to_pass=f2p, pass_to_pass=p2p, test_command=test_command, patch=patch,
              test_patch=test_patch, rootfs=rootfs, timeout=float(timeout), repo=repo,
              base_commit=base_commit, mirror=git_dir, cache_dir=cache_dir if git_dir else None,
              image_name=_get(d, "image_name", str, None), test_runner=runner,
              environment=environment, metadata={k: v for k, v in d.items() if k not in known})


def _environment(d: Mapping, env_from: str, specs: Any, repo_path: Optional[str],
                 git_dir: Optional[str], base_commit: str) -> Optional[env_spec.Environment]:
  """A row's environment: its `environment` field, else one from source `env_from`."""
  if d.get("environment") is not None:
    return env_spec.from_dict(d["environment"], "field 'environment'")
  if env_from == "none":
    return None
  if env_from not in env_sources.SOURCES:
    raise ValueError(f"env_from={env_from!r}: expected one of {env_sources.ENV_FROM}")
  files = load_repo_files(repo_path) if repo_path is not None else None
  return env_sources.SOURCES[env_from](dict(d, base_commit=base_commit), files=files,
                                   git_dir=git_dir, specs=specs)


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


# ----------------------------------------------------------------------------- loading


def _parse_all(records: Iterable, parse, skip_bad: bool, errors: Optional[list],
               source: str) -> list[Task]:
  """Tasks of (where, name of the place, record or the ValueError reading it) triples."""
  tasks, bad, seen = [], 0, {}
  for where, place, record in records:
    try:
      if isinstance(record, ValueError):
        raise record
      task = parse(record)
      if task.instance_id in seen:
        raise ValueError(f"field 'instance_id': {task.instance_id!r} already used on "
                         f"{seen[task.instance_id]}")
      seen[task.instance_id] = place
      tasks.append(task)
    except ValueError as e:
      err = TaskFormatError(f"{where}: {e}")
      if not skip_bad:
        raise err from None
      bad += 1
      log.warning("skipping bad task line: %s", err)
      if errors is not None:
        errors.append(err)
  if bad:
    log.warning("%s: skipped %d bad line(s), loaded %d task(s)", source, bad, len(tasks))
  return tasks


def jsonl_records(path: str):
  """(where "file:line", "line N", record) per non-blank line of a JSONL file; a line that is not
  JSON, or nests deeper than `envs.untrusted.decode.MAX_JSON_DEPTH`, yields a ValueError as its
  record (the caller decides whether to skip it)."""
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = decode.loads(line, what=f"line {lineno}")
      except json.JSONDecodeError as e:
        record = ValueError(f"invalid JSON ({e.msg} at column {e.colno})")
      except ValueError as e:  # nested too deep, or an over-long integer literal
        record = e
      yield f"{path}:{lineno}", f"line {lineno}", record


def _file_mirror(path: str, mirror: Optional[str]) -> Optional[str]:
  """The mirror for a dataset file's rows: `mirror`, else ARBOR_SWE_MIRROR, else the `mirror/`
  folder beside the file (`envs.swe_mirror.dataset_mirror`), else None."""
  return (mirror or os.environ.get("ARBOR_SWE_MIRROR")
          or dataset_mirror(os.path.dirname(os.path.abspath(path))))


def _swe_parser(base_dir: str, mirror: Optional[str], cache_dir: Optional[str],
                env_from: str = "none", swebench_specs: Any = None):
  return lambda d: swe_task_from_dict(d, base_dir, mirror, cache_dir, env_from, swebench_specs)


def load_swe_jsonl(path: str, skip_bad: bool = False, errors: Optional[list] = None, *,
                   mirror: Optional[str] = None, cache_dir: Optional[str] = None,
                   env_from: str = "none", swebench_specs: Any = None) -> list[Task]:
  """Returns the tasks of a SWE-format JSONL file, in file order.

  Args:
    path: the file; relative `repo_path`s are resolved against its directory.
    skip_bad: log and skip a bad line instead of raising.
    errors: when given, the skipped lines' errors are appended to it.
    mirror: the directory of git mirrors for rows without `repo_path` (module docstring;
      default ARBOR_SWE_MIRROR, else the `mirror/` folder beside the file if there is one).
    cache_dir: where checkouts of mirrored commits go.
    env_from, swebench_specs: where rows without an `environment` get one
      (`swe_task_from_dict`).

  Raises:
    TaskFormatError: "FILE:LINE: field 'NAME': ..." for a bad line or a repeated instance_id
      (unless skip_bad).
  """
  base = os.path.dirname(os.path.abspath(path))
  parse = _swe_parser(base, _file_mirror(path, mirror), cache_dir, env_from, swebench_specs)
  return _parse_all(jsonl_records(path), parse, skip_bad, errors, path)


def load_swe_rows(rows: Iterable[Mapping], skip_bad: bool = False,
                  errors: Optional[list] = None, *, source: str = "rows", base_dir: str = ".",
                  mirror: Optional[str] = None, cache_dir: Optional[str] = None,
                  env_from: str = "none", swebench_specs: Any = None) -> list[Task]:
  """Returns the tasks of SWE rows given as dicts: a Hugging Face `datasets` split, the rows
  of a Parquet file or a DataFrame's `to_dict("records")`.

  Args:
    rows: the rows, in order.
    skip_bad: log and skip a bad row instead of raising.
    errors: when given, the skipped rows' errors are appended to it.
    source: how errors name the rows ("SOURCE[INDEX]: field ...").
    base_dir: the dataset's folder, holding the rows' `repo_path` and `rootfs`.
    mirror: the directory of git mirrors for rows without `repo_path` (module docstring).
    cache_dir: where checkouts of mirrored commits go.
    env_from, swebench_specs: where rows without an `environment` get one
      (`swe_task_from_dict`).

  Raises:
    TaskFormatError: "SOURCE[INDEX]: field 'NAME': ..." for a bad row (unless skip_bad).
  """
  records = ((f"{source}[{i}]", f"{source}[{i}]", r) for i, r in enumerate(rows))
  return _parse_all(records, _swe_parser(base_dir, mirror, cache_dir, env_from,
                                             swebench_specs), skip_bad, errors,
                    source)


def load_swe_parquet(path: str, skip_bad: bool = False, errors: Optional[list] = None, *,
                     mirror: Optional[str] = None, cache_dir: Optional[str] = None,
                     env_from: str = "none", swebench_specs: Any = None
                     ) -> list[Task]:
  """Returns the tasks of a Parquet file of SWE rows (e.g. a SWE-bench split as published).

  Args:
    path: the file; relative `repo_path`s are resolved against its directory.
    skip_bad: log and skip a bad row instead of raising.
    errors: when given, the skipped rows' errors are appended to it.
    mirror: the directory of git mirrors for rows without `repo_path` (module docstring;
      default ARBOR_SWE_MIRROR, else the `mirror/` folder beside the file if there is one).
    cache_dir: where checkouts of mirrored commits go.
    env_from, swebench_specs: where rows without an `environment` get one
      (`swe_task_from_dict`).

  Raises:
    TaskFormatError: "FILE[ROW]: field 'NAME': ..." for a bad row (unless skip_bad).
  """
  import pyarrow.parquet as pq  # only Parquet readers need it
  return load_swe_rows(pq.read_table(path).to_pylist(), skip_bad, errors, source=path,
                       base_dir=os.path.dirname(os.path.abspath(path)),
                       mirror=_file_mirror(path, mirror),
                       cache_dir=cache_dir, env_from=env_from, swebench_specs=swebench_specs)


def load_problems_jsonl(path: str, skip_bad: bool = False,
                        errors: Optional[list] = None) -> list[Task]:
  """Returns the tasks of a problem JSONL file (code / exact / judge), in file order.

  Args:
    path: the file.
    skip_bad: log and skip a bad line instead of raising TaskFormatError (`load_swe_jsonl`).
    errors: when given, the skipped lines' errors are appended to it.
  """
  return _parse_all(jsonl_records(path), problem_task_from_dict, skip_bad, errors, path)


def load_tasks(path: str, skip_bad: bool = False, errors: Optional[list] = None, *,
               mirror: Optional[str] = None, cache_dir: Optional[str] = None,
               env_from: str = "none", swebench_specs: Any = None) -> list[Task]:
  """Returns the tasks of a JSONL file of either format (a line with FAIL_TO_PASS is SWE), or
  of a Parquet file of SWE rows.

  Args:
    path: the file; relative `repo_path`s are resolved against its directory.
    skip_bad: log and skip a bad line instead of raising TaskFormatError (`load_swe_jsonl`).
    errors: when given, the skipped lines' errors are appended to it.
    mirror: the directory of git mirrors for SWE rows without `repo_path` (default as
      `load_swe_jsonl`'s).
    cache_dir: where checkouts of mirrored commits go.
    env_from, swebench_specs: where rows without an `environment` get one
      (`swe_task_from_dict`).
  """
  if path.endswith(".parquet"):
    return load_swe_parquet(path, skip_bad, errors, mirror=mirror, cache_dir=cache_dir,
                            env_from=env_from, swebench_specs=swebench_specs)
  swe = _swe_parser(os.path.dirname(os.path.abspath(path)), _file_mirror(path, mirror),
                    cache_dir, env_from, swebench_specs)

  def parse(d):
    if isinstance(d, dict) and "FAIL_TO_PASS" in d:
      return swe(d)
    return problem_task_from_dict(d)
  return _parse_all(jsonl_records(path), parse, skip_bad, errors, path)


def task_to_swe_dict(task: Task, repo_path: Optional[str] = None) -> dict:
  """Returns the SWE row of a "swe" task (inverse of `swe_task_from_dict`).

  Args:
    task: the task; its metadata fields are written back as row fields.
    repo_path: the row's repo_path; None: the task's (a mirrored task has none: reading the
      row back needs the mirror again). A row in a file names a path inside the file's
      folder: pass it relative to that folder (the task's own is absolute).
  """
  d = dict(task.metadata)
  d.update(instance_id=task.instance_id, problem_statement=task.problem_statement,
           problem_statements=list(task.problem_statements),
           FAIL_TO_PASS=list(task.fail_to_pass), PASS_TO_PASS=list(task.pass_to_pass),
           test_command=task.test_command, test_patch=task.test_patch, timeout=task.timeout,
           log_parser=(UNITTEST_PARSER if task.test_runner == "unittest"
                       else f"parse_log_{task.test_runner}"),
           patch=reverse_patch(task.patch) if task.repo.startswith("swesmith/") else task.patch)
  for field, value in (("repo_path", repo_path or task.repo_path), ("rootfs", task.rootfs),
                       ("repo", task.repo), ("base_commit", task.base_commit),
                       ("image_name", task.image_name)):
    if value:
      d[field] = value
  if task.environment is not None:
    d["environment"] = task.environment.to_dict()
  return d


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


def reverse_patch(patch: str) -> str:
  """The unified diff that undoes `patch` (old and new sides swapped).

  Args:
    patch: a unified diff (git-style headers allowed).

  Returns:
    The reversed diff: `apply_patch(apply_patch(f, patch), reverse_patch(patch)) == f`.
  """
  out, lines, i = [], patch.splitlines(keepends=True), 0
  changed: list[list[str]] = []  # a run of changed lines, each with its "\ No newline" mark

  def flush():  # removed lines first, as diff tools write them
    out.extend(l for group in sorted(changed, key=lambda g: g[0][0] == "+") for l in group)
    changed.clear()
  while i < len(lines):
    line = lines[i]
    if line[:1] in "+-" and not line.startswith(("+++ ", "--- ")):
      changed.append([("-" if line[0] == "+" else "+") + line[1:]])
      i += 1
      continue
    if line.startswith("\\") and changed:
      changed[-1].append(line)
      i += 1
      continue
    flush()
    if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
      old, new = line[4:], lines[i + 1][4:]
      out += ["--- " + re.sub(r"^b/", "a/", new), "+++ " + re.sub(r"^a/", "b/", old)]
      i += 2
      continue
    m = _HUNK.match(line)
    if m:
      old_range = m.group(1) + ("" if m.group(2) is None else "," + m.group(2))
      new_range = m.group(3) + ("" if m.group(4) is None else "," + m.group(4))
      line = f"@@ -{new_range} +{old_range} @@" + line[m.end():]
    elif line.startswith(("new file mode ", "deleted file mode ")):
      line = ("deleted" if line.startswith("new") else "new") + line[line.index(" file mode"):]
    elif m := re.match(r"^index (\w+)\.\.(\w+)", line):
      line = f"index {m.group(2)}..{m.group(1)}" + line[m.end():]
    out.append(line)
    i += 1
  flush()
  return "".join(out)


def reference_files(task: Task) -> dict[str, bytes]:
  """The repository with the task's reference fix (`task.patch`) applied."""
  return apply_patch(load_repo_files(task), task.patch)
