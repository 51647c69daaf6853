"""Verifiers: turn what an agent produced into a reward. Each returns a `Verdict(reward, details)`.

- `verify_tests` ("swe" tasks): the agent's changes to non-test files are applied to a clean
  copy of the task's repository in a FRESH sandbox, the task's pytest command runs with a JUnit
  XML report written outside the repository, and the reward comes from that report (never from
  stdout): 1 iff every FAIL_TO_PASS test passes and every PASS_TO_PASS test still passes.
- `verify_python_io` ("code"): function tests or stdin/stdout tests, in a sandbox.
- `verify_exact` ("exact"): normalised answer match.
- `verify_judge` ("judge"): a policy scores the response on a weighted rubric.
- `verify(task, submission, ...)` dispatches on `task.kind`.

Threat model of `verify_tests`. The agent controls the files it submits, and its code runs in
the same sandbox, and in the same Python process, as pytest. Defences:
1. What is applied: test files (those named by the task's test ids and test patch, and any path
   matching test patterns: test_*.py, *_test.py, tests/, test/, testing/) are restored from the
   original, new ones dropped; changes to conftest.py, pytest.ini/.pytest.ini/tox.ini/setup.cfg/
   pyproject.toml/setup.py, sitecustomize.py, usercustomize.py and *.pth are refused: reward 0
   with the reason. Byte-code caches (an unchecked-hash .pyc replaces its source) and package
   metadata (*.dist-info, *.egg-info: entry points can load pytest plugins) are dropped.
2. How pytest starts: a trusted runner arrives on stdin (`python3 -I -B -`), so neither argv
   nor the environment shows the nonce. It imports pytest and all its built-in plugins
   BEFORE the workspace joins sys.path (a `pytest.py` or `xml/` in the repo cannot shadow
   them), disables plugin auto-loading, and passes `--rootdir` so node ids are stable.
3. The report: pytest writes it to an anonymous in-memory file (memfd) of the runner: outside
   the repository, with no path on disk that other code could find or overwrite. Right after
   pytest returns, the runner hashes it, copies it into the workspace under a random name,
   prints one line "NONCE rc sha256 size" (the nonce is random per run) to a saved copy of its
   stdout (pytest's own output goes to a log), and leaves with `os._exit` (no atexit handler
   or thread of the agent's code runs after it). The verifier accepts exactly one such line
   and a copy with that hash: a report written or rewritten by anyone else (a fake XML
   anywhere, a "PASSED" line, an atexit handler, a surviving daemon) does not count, a run
   killed or exited early prints no line, and a test missing from the report fails.
4. After the run, the test modules, conftest and config files in the sandbox must still be
   byte-identical to what was written (code that rewrites tests on disk gets 0).
Residual risk: code under test runs inside the pytest process and could, by a targeted attack
on this runner (reading the nonce from the interpreter's memory, patching pytest objects), forge
a result; no in-process reporter can prevent that. Generated tests compare with exact types, so
objects whose __eq__ always answers True fail them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import inspect
import json
import logging
import math
import re
import secrets
import shlex
import xml.etree.ElementTree as ET
from fractions import Fraction
from typing import Any, Awaitable, Callable, Mapping, Optional, Sequence, Union

from envs.policy import Policy, SamplingParams
from envs.sandbox.base import Sandbox
from envs.tasks import Task, apply_patch, is_cache_path, load_repo_files

log = logging.getLogger(__name__)

SandboxFactory = Callable[[Task], Union[Sandbox, Awaitable[Sandbox]]]

# Basenames whose change is refused: they configure pytest or run code at interpreter start.
CONFIG_FILES = frozenset({"conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg",
                          "pyproject.toml", "setup.py", "sitecustomize.py", "usercustomize.py"})
TEST_DIRS = frozenset({"test", "tests", "testing"})
LOG_TAIL = 3000  # bytes of pytest's output kept in details (debugging only, never scored)


@dataclasses.dataclass
class Verdict:
  """A reward in [0, 1] and JSON-like details (why, per-test outcomes, ...)."""

  reward: float
  details: dict[str, Any] = dataclasses.field(default_factory=dict)


def _fail(reason: str, **details) -> Verdict:
  return Verdict(0.0, {"reason": reason, **details})


async def _make_sandbox(make_sandbox: SandboxFactory, task: Task) -> Sandbox:
  sb = make_sandbox(task)
  return await sb if inspect.isawaitable(sb) else sb


async def workspace_files(sandbox: Sandbox) -> dict[str, bytes]:
  """All regular files of an agent's workspace (caches left out), for `verify_tests`.

  A file the sandbox will not hand over (larger than its `limits.file_bytes`, or gone or turned
  into a symlink since the listing) is left out, as if deleted: that is the agent's doing.
  """
  files = {}
  for path in await sandbox.list_files():
    if not is_ignored_path(path):
      try:
        files[path] = await sandbox.read_file(path)
      except (OSError, ValueError) as e:  # PathError is a ValueError
        log.warning("workspace_files: %s left out: %s", path, e)
  return files


# ----------------------------------------------------------------------------- tests verifier


def task_test_files(task: Task) -> set[str]:
  """Files the task names as tests: modules of its test ids and files of its test patch."""
  files = {i.split("::", 1)[0] for i in task.fail_to_pass + task.pass_to_pass}
  for line in task.test_patch.splitlines():
    if line.startswith(("--- a/", "+++ b/")):
      files.add(line[6:].split("\t", 1)[0].strip())
  return files


def is_test_path(path: str, task_files: set[str] = frozenset()) -> bool:
  """A test file: named by the task, or matching test patterns (restored, never applied)."""
  parts = path.split("/")
  base = parts[-1]
  return (path in task_files or any(p in TEST_DIRS for p in parts[:-1])
          or base.startswith("test_") and base.endswith(".py") or base.endswith("_test.py")
          or base == "tests.py")


def refused_reason(path: str) -> Optional[str]:
  """Why a change to `path` is refused outright, or None."""
  parts = path.split("/")
  if parts[-1] in CONFIG_FILES:
    return f"{path}: changes to {parts[-1]} are refused (test configuration / start-up code)"
  if parts[-1].endswith(".pth"):
    return f"{path}: .pth files are refused (they run code at interpreter start)"
  return None


def is_ignored_path(path: str) -> bool:
  """Byte-code caches and package metadata: dropped from a submission, never applied (an
  unchecked-hash .pyc replaces its source; an entry point can name a pytest plugin)."""
  return is_cache_path(path) or any(p.endswith((".dist-info", ".egg-info", ".egg-link"))
                                    for p in path.split("/"))


class Refused(Exception):
  """The submission may not be tested (reason in args[0])."""


def _safe_path(path: str) -> str:
  parts = path.split("/") if isinstance(path, str) else []
  if (not parts or path.startswith("/") or ".." in parts or "\x00" in path
      or "" in parts or "." in parts):
    raise Refused(f"path {path!r} is not a clean workspace-relative path")
  return path


def merge_submission(task: Task, original: Mapping[str, bytes],
                     submission: Union[Mapping[str, Union[bytes, str]], str]
                     ) -> tuple[dict[str, bytes], dict[str, list[str]]]:
  """The files to test: `original` + the agent's non-test changes + the task's test patch.

  `submission` is the agent's final workspace {path: content} (an original file missing from
  it was deleted) or a unified diff against the original. Returns (files, {"applied",
  "restored", "ignored"}); raises Refused with the reason.
  """
  if isinstance(submission, str):
    try:
      final = apply_patch(original, submission)
    except (ValueError, UnicodeDecodeError) as e:
      raise Refused(f"the patch does not apply: {e}") from None
  else:
    final = {}
    for p, content in submission.items():
      final[_safe_path(p)] = content.encode() if isinstance(content, str) else content
      if not isinstance(final[p], bytes):
        raise Refused(f"content of {p!r}: expected bytes or str, got {type(content).__name__}")
  task_files = task_test_files(task)
  applied, restored, ignored = [], [], []
  for p in sorted(set(original) | set(final)):
    if original.get(p) == final.get(p):
      continue
    _safe_path(p)
    if is_ignored_path(p):
      ignored.append(p)
    elif (reason := refused_reason(p)) is not None:
      raise Refused(reason)
    elif is_test_path(p, task_files):
      restored.append(p)
    else:
      applied.append(p)
  files = dict(original)
  for p in applied:
    if p in final:
      files[p] = final[p]
    else:
      del files[p]
  if task.test_patch:
    files = apply_patch(files, task.test_patch)  # a broken test patch is the task's bug: raise
  return files, {"applied": applied, "restored": restored, "ignored": ignored}


def junit_key(node_id: str) -> tuple[str, str]:
  """(classname, name) that pytest's JUnit report gives the test `node_id`.

  "tests/test_a.py::TestX::test_y[1-2]" -> ("tests.test_a.TestX", "test_y[1-2]").
  """
  path, bracket, params = node_id.partition("[")
  names = path.split("::")
  names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
  names[-1] += bracket + params
  return ".".join(names[:-1]), names[-1]


def parse_junit(xml: bytes) -> dict[tuple[str, str], str]:
  """{(classname, name): status} with status passed | failed | error | skipped.

  A test reported more than once (e.g. a passing call and a failing teardown) takes the worst.
  """
  root = ET.fromstring(xml)
  if root.tag not in ("testsuites", "testsuite"):
    raise ValueError(f"not a JUnit report: root element <{root.tag}>")
  rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
  out: dict[tuple[str, str], str] = {}
  for case in root.iter("testcase"):
    tags = {child.tag for child in case}
    status = ("error" if "error" in tags else "failed" if "failure" in tags
              else "skipped" if "skipped" in tags else "passed")
    key = (case.get("classname", ""), case.get("name", ""))
    if rank[status] >= rank.get(out.get(key, "passed"), 0):
      out[key] = status
  return out


_PYTEST_RUNNER = r'''
import hashlib, importlib, os, sys
sys.dont_write_bytecode = True
for _k in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS"):
  os.environ.pop(_k, None)
os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
import pytest, _pytest.config
# Import pytest's own plugins now, while the workspace is not on sys.path yet.
for _name in _pytest.config.default_plugins:
  importlib.import_module("_pytest." + _name)
import xml.etree.ElementTree
WS = os.getcwd()
# The report goes to an anonymous in-memory file: outside the repository, with no path on disk.
_report = os.memfd_create("m")
_log = os.memfd_create("l")
_out = os.dup(1)
os.dup2(_log, 1)
os.dup2(_log, 2)
sys.path.insert(0, WS)
try:
  rc = int(pytest.main(ARGS + ["--rootdir", WS, "--junitxml", "/proc/self/fd/%d" % _report,
                               "-p", "no:cacheprovider"]))
except BaseException:
  rc = -1
data = os.pread(_report, os.fstat(_report).st_size, 0)
digest = hashlib.sha256(data).hexdigest() if data else "none"
if data:
  fd = os.open(os.path.join(WS, COPY), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
               0o600)
  os.write(fd, data)
  os.close(fd)
size = os.fstat(_log).st_size
tail = os.pread(_log, TAIL, max(0, size - TAIL))
os.write(_out, tail + ("\n%s %d %s %d\n" % (NONCE, rc, digest, len(data))).encode())
os._exit(0)
'''


@dataclasses.dataclass
class PytestRun:
  """One trusted pytest run: per-test statuses from the JUnit report, or why there are none."""

  statuses: dict[tuple[str, str], str]
  exit_code: Optional[int]
  log: str
  error: Optional[str] = None  # set when there is no trustworthy report


async def run_pytest(sandbox: Sandbox, args: Sequence[str], timeout: float,
                     python: str = "python3") -> PytestRun:
  """Run pytest with `args` under `python` in `sandbox`'s workspace and read its JUnit report
  (see the module docstring)."""
  nonce = secrets.token_hex(16)
  copy = f".arbor-result-{secrets.token_hex(16)}"  # no .xml: generic sprayers pass it by
  header = f"ARGS = {list(args)!r}\nCOPY = {copy!r}\nNONCE = {nonce!r}\nTAIL = {LOG_TAIL}\n"
  res = await sandbox.exec(f"{shlex.quote(python)} -I -B -", timeout=timeout,
                           stdin=header + _PYTEST_RUNNER)
  lines = re.findall(rf"^{nonce} (-?\d+) ([0-9a-f]{{64}}|none) (\d+)$", res.stdout, re.M)
  log = res.stdout.split(nonce)[0][-LOG_TAIL:] + res.stderr[-LOG_TAIL:]
  if res.timed_out:
    return PytestRun({}, None, log, f"the test run timed out after {timeout:g}s")
  if len(lines) != 1:
    return PytestRun({}, None, log, "the test run did not finish (no result line from the "
                     "runner: it crashed, exited early, or its output was flooded)")
  rc, digest, size = int(lines[0][0]), lines[0][1], int(lines[0][2])
  if digest == "none":
    return PytestRun({}, rc, log, "pytest wrote no JUnit report")
  try:
    data = await sandbox.read_file(copy)
  except (OSError, ValueError) as e:  # PathError is a ValueError
    return PytestRun({}, rc, log, f"the report copy could not be read: {e}")
  if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
    return PytestRun({}, rc, log, "the JUnit report was changed after pytest wrote it")
  try:
    statuses = parse_junit(data)
  except (ET.ParseError, ValueError) as e:
    return PytestRun({}, rc, log, f"the JUnit report does not parse: {e}")
  return PytestRun(statuses, rc, log)


async def verify_tests(task: Task, submission: Union[Mapping[str, Union[bytes, str]], str],
                       make_sandbox: SandboxFactory, *, partial: bool = False,
                       original: Optional[Mapping[str, bytes]] = None) -> Verdict:
  """Reward of an agent's changes to a "swe" task (see the module docstring).

  submission: the agent's final workspace {path: bytes} (see `workspace_files`) or a unified
  diff against the original repository. make_sandbox(task) gives a fresh sandbox (or an
  awaitable of one); this function closes it. partial: reward = fraction of FAIL_TO_PASS +
  PASS_TO_PASS tests passing instead of all-or-nothing. original: the repository files, if the
  caller already holds them (default: `load_repo_files(task)`).
  Raises SandboxError when the sandbox itself fails (infrastructure, not the agent's doing).
  """
  if task.kind != "swe":
    raise ValueError(f"verify_tests: task {task.instance_id!r} has kind={task.kind!r}, "
                     "expected 'swe'")
  original = load_repo_files(task) if original is None else original
  try:
    files, changes = merge_submission(task, original, submission)
  except Refused as e:
    return _fail(f"refused: {e.args[0]}")
  sandbox = await _make_sandbox(make_sandbox, task)
  try:
    for path, data in files.items():
      try:
        await sandbox.write_file(path, data)
      except (OSError, ValueError) as e:  # too large, or a file where a directory must be
        return _fail(f"cannot write {path!r} into the sandbox: {e}", **changes)
    python, args = task.pytest_command()
    run = await run_pytest(sandbox, args, task.timeout, python)
    # Tests and configuration must be exactly what we wrote, whatever the run did on disk.
    named = task_test_files(task)
    guarded = [p for p in sorted(files) if p in named or p.rsplit("/", 1)[-1] in CONFIG_FILES]
    for path in guarded:
      try:
        same = await sandbox.read_file(path) == files[path]
      except (OSError, ValueError):
        same = False
      if not same:
        return _fail(f"{path} was modified during the test run", **changes, log=run.log)
  finally:
    await sandbox.close()
  if run.error is not None:
    return _fail(run.error, exit_code=run.exit_code, log=run.log, **changes)

  def outcome(node_id):
    return run.statuses.get(junit_key(node_id), "missing")
  f2p = {i: outcome(i) for i in task.fail_to_pass}
  p2p = {i: outcome(i) for i in task.pass_to_pass}
  outcomes = list(f2p.values()) + list(p2p.values())
  n_pass = sum(s == "passed" for s in outcomes)
  solved = n_pass == len(outcomes)
  reward = 1.0 if solved else (n_pass / len(outcomes) if partial else 0.0)
  details = dict(fail_to_pass=f2p, pass_to_pass=p2p, passed=n_pass, total=len(outcomes),
                 solved=solved, exit_code=run.exit_code, log=run.log, **changes)
  if not solved:
    details["reason"] = "some FAIL_TO_PASS / PASS_TO_PASS tests do not pass"
  return Verdict(reward, details)


# ----------------------------------------------------------------------------- python_io


def extract_code(text: str) -> str:
  """The last ```python (or plain ```) fenced block of `text`, or `text` itself."""
  blocks = re.findall(r"```(?:python3?|py)?[ \t]*\n(.*?)```", text, re.S)
  return blocks[-1] if blocks else text


_FUNCTION_RUNNER = r'''
import json, os, sys
_out = os.dup(1)
os.dup2(2, 1)  # the solution's prints go to stderr, not into our result line
sys.path.insert(0, os.getcwd())

def enc(x, depth=0):
  # Exact builtin types only: an object posing as a value (custom __eq__) stays a repr.
  t = type(x)
  if x is None or t in (bool, int, str) or t is float and x == x and abs(x) != float("inf"):
    return x
  if t in (list, tuple) and depth < 50:
    return [enc(v, depth + 1) for v in x]
  if t is dict and depth < 50 and all(type(k) is str for k in x):
    return {k: enc(v, depth + 1) for k, v in x.items()}
  return {"__repr__": repr(x)[:200]}

results = []
try:
  import solution
  fn, err = getattr(solution, ENTRY), None
except BaseException as e:
  fn, err = None, "%s: %s" % (type(e).__name__, e)
for args in CASES:
  if fn is None:
    results.append({"error": err[:300]})
    continue
  try:
    results.append({"value": enc(fn(*args))})
  except BaseException as e:
    results.append({"error": ("%s: %s" % (type(e).__name__, e))[:300]})
os.write(_out, ("\n%s %s\n" % (NONCE, json.dumps(results))).encode())
os._exit(0)
'''


def values_equal(got: Any, want: Any, rel_tol: float = 1e-6) -> bool:
  """JSON values equal: exact types (bool is not int), numbers within rel_tol, tuples = lists."""
  if isinstance(want, bool) or isinstance(got, bool):
    return type(got) is type(want) and got == want
  if isinstance(want, (int, float)) and isinstance(got, (int, float)):
    return math.isclose(got, want, rel_tol=rel_tol, abs_tol=1e-9)
  if isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)):
    return len(got) == len(want) and all(values_equal(g, w, rel_tol) for g, w in zip(got, want))
  if isinstance(want, dict) and isinstance(got, dict):
    return got.keys() == want.keys() and all(values_equal(got[k], want[k], rel_tol) for k in want)
  return type(got) is type(want) and got == want


def normalize_output(text: str) -> str:
  """stdout as compared: CRLF -> LF, trailing spaces per line and trailing blank lines dropped."""
  lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
  while lines and not lines[-1]:
    lines.pop()
  return "\n".join(lines)


async def verify_python_io(task: Task, program: str, make_sandbox: SandboxFactory, *,
                           partial: bool = False) -> Verdict:
  """Reward of a program for a "code" task: run its tests in a fresh sandbox.

  `program` is the agent's answer (a fenced block is extracted). Function tests
  ({"args", "expected"}) call `task.entry_point` in one process; stdin/stdout tests ({"input",
  "output"}) run `python3 solution.py` once each; `task.timeout` bounds each process.
  reward: 1 iff every test passes (or the fraction passing with `partial`).
  """
  if task.kind != "code":
    raise ValueError(f"verify_python_io: task {task.instance_id!r} has kind={task.kind!r}, "
                     "expected 'code'")
  code = extract_code(program)
  fn_cases = [c for c in task.tests if "args" in c]
  io_cases = [c for c in task.tests if "args" not in c]
  results: list[dict] = []
  sandbox = await _make_sandbox(make_sandbox, task)
  try:
    try:
      await sandbox.write_file("solution.py", code)
    except (OSError, ValueError) as e:
      return _fail(f"cannot write the solution: {e}")
    if fn_cases:
      nonce = secrets.token_hex(16)
      header = (f"ENTRY = {task.entry_point!r}\nNONCE = {nonce!r}\n"
                f"CASES = {json.dumps([c['args'] for c in fn_cases])!r}\n"
                "CASES = __import__('json').loads(CASES)\n")
      res = await sandbox.exec("python3 -I -B -", stdin=header + _FUNCTION_RUNNER,
                               timeout=task.timeout)
      found = re.findall(rf"^{nonce} (.*)$", res.stdout, re.M)
      values = None
      if not res.timed_out and len(found) == 1:
        try:
          values = json.loads(found[0])
        except json.JSONDecodeError:
          pass
      for i, case in enumerate(fn_cases):
        if values is None or len(values) != len(fn_cases):
          why = "timed out" if res.timed_out else "no result (crashed or output too large)"
          results.append({"test": i, "passed": False, "error": why})
        elif "error" in values[i]:
          results.append({"test": i, "passed": False, "error": values[i]["error"]})
        else:
          ok = values_equal(values[i]["value"], case["expected"])
          results.append({"test": i, "passed": ok, "got": values[i]["value"]})
    for j, case in enumerate(io_cases, len(fn_cases)):
      res = await sandbox.exec("python3 -I -B solution.py", stdin=case["input"],
                               timeout=task.timeout)
      ok = (not res.timed_out and res.exit_code == 0 and not res.stdout_truncated
            and normalize_output(res.stdout) == normalize_output(case["output"]))
      results.append({"test": j, "passed": ok, "exit_code": res.exit_code,
                      "timed_out": res.timed_out, "stdout": res.stdout[:200],
                      "stderr": res.stderr[-300:]})
  finally:
    await sandbox.close()
  n_pass = sum(r["passed"] for r in results)
  solved = n_pass == len(results)
  reward = 1.0 if solved else (n_pass / len(results) if partial else 0.0)
  return Verdict(reward, {"tests": results, "passed": n_pass, "total": len(results),
                          "solved": solved})


# ----------------------------------------------------------------------------- exact


def extract_answer(response: str) -> str:
  """The final answer in a response: the last \\boxed{...}, else the last "answer: X" line,
  else the whole (stripped) response."""
  boxed = []
  for m in re.finditer(r"\\boxed\{", response):
    depth, i = 1, m.end()
    while i < len(response) and depth:
      depth += {"{": 1, "}": -1}.get(response[i], 0)
      i += 1
    if depth == 0:
      boxed.append(response[m.end():i - 1])
  if boxed:
    return boxed[-1]
  lines = re.findall(r"(?im)\banswer\s*(?:is)?\s*[:=]\s*(.+?)\s*$", response)
  return lines[-1] if lines else response.strip()


def normalize_answer(text: str) -> str:
  """Lower-case, no surrounding $ / quotes / final period, single spaces, no 1,000 separators."""
  s = text.strip()
  s = re.sub(r"^\$+|\$+$", "", s).strip()
  s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
  s = s.strip("`\"' ").rstrip(".").strip()
  s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)
  return re.sub(r"\s+", " ", s).lower()


def _number(s: str) -> Optional[Fraction]:
  try:
    return Fraction(s.replace(" ", ""))
  except (ValueError, ZeroDivisionError):
    return None


def verify_exact(task: Task, response: str) -> Verdict:
  """1 iff the response's final answer equals one of `task.answers` after normalisation
  (numbers compare by value: "0.50" == "1/2")."""
  if task.kind != "exact":
    raise ValueError(f"verify_exact: task {task.instance_id!r} has kind={task.kind!r}, "
                     "expected 'exact'")
  got = normalize_answer(extract_answer(response))
  for answer in task.answers:
    want = normalize_answer(answer)
    a, b = _number(got), _number(want)
    if got == want or (a is not None and a == b):
      return Verdict(1.0, {"answer": got, "matched": answer})
  return _fail("the answer matches none of the accepted answers", answer=got)


# ----------------------------------------------------------------------------- judge

JUDGE_PROMPT = """You are a strict grader. Score the response to the task below.

## Task
{task}

## Response
{response}

## Rubric
{dimensions}

Reply with one line per dimension, in this form and nothing else:
{form}"""


def judge_prompt(task: Task, response: str) -> str:
  """The grading prompt for a "judge" task (rendered to tokens by the caller)."""
  dims = "\n".join(f"- {d['name']} (0-{d.get('max', 10):g}): {d.get('description', '')}".rstrip()
                   for d in task.rubric)
  form = "\n".join(f"{d['name']}: <score>" for d in task.rubric)
  return JUDGE_PROMPT.format(task=task.problem_statement, response=response, dimensions=dims,
                             form=form)


def _name_pattern(name: str) -> str:
  """Regex for a dimension name: case-insensitive words joined by spaces, _ or -."""
  return r"[\s_\-]+".join(re.escape(w) for w in re.split(r"[\s_\-]+", name.strip()))


def _key(name: str) -> str:
  return re.sub(r"[\s_\-]+", " ", name.strip().lower())


def parse_scores(text: str, rubric: Sequence[Mapping[str, Any]]) -> dict[str, Optional[float]]:
  """{dimension name: score in [0, max]} parsed from a judge's reply; None if absent.

  Accepts a JSON object ({"correctness": 8}), or lines such as "Correctness: 8",
  "**correctness** (0-10) = 8/10", "correctness - 4 out of 5" (a denominator rescales to the
  dimension's max); the last mention wins; scores are clamped to [0, max].
  """
  found: dict[str, Optional[float]] = {d["name"]: None for d in rubric}
  by_key = {_key(d["name"]): d for d in rubric}
  for m in re.finditer(r"\{[^{}]*\}", text):  # JSON objects, last one wins per dimension
    try:
      obj = json.loads(m.group(0))
    except json.JSONDecodeError:
      continue
    for k, v in obj.items() if isinstance(obj, dict) else ():
      d = by_key.get(_key(str(k)))
      if d is not None and isinstance(v, (int, float)) and not isinstance(v, bool):
        found[d["name"]] = float(v)
  number = r"(-?\d+(?:\.\d+)?)"
  for d in rubric:
    pattern = (rf"(?i){_name_pattern(d['name'])}[\s*_]*(?:\([^)\n]*\)|\[[^\]\n]*\])?[\s*_]*"
               rf"(?:[:=\-\u2013\u2014]|\bis\b)?[\s*_]*{number}(?:\s*(?:/|out of)\s*{number})?")
    matches = list(re.finditer(pattern, text))
    if matches:
      m = matches[-1]
      score = float(m.group(1))
      if m.group(2) is not None and float(m.group(2)) > 0:
        score = score / float(m.group(2)) * d.get("max", 10)
      found[d["name"]] = score
  return {name: None if s is None else min(max(s, 0.0), float(next(
      d.get("max", 10) for d in rubric if d["name"] == name))) for name, s in found.items()}


def rubric_reward(scores: Mapping[str, Optional[float]],
                  rubric: Sequence[Mapping[str, Any]]) -> float:
  """Weighted mean of score/max over the dimensions; a missing score counts as 0."""
  total = sum(float(d.get("weight", 1.0)) for d in rubric)
  got = sum(float(d.get("weight", 1.0)) * (scores.get(d["name"]) or 0.0) / float(d.get("max", 10))
            for d in rubric)
  return got / total


async def verify_judge(task: Task, response: str, policy: Policy,
                       render: Callable[[str], Sequence[int]],
                       decode: Callable[[Sequence[int]], str], *,
                       params: SamplingParams = SamplingParams(max_tokens=256, temperature=0.0),
                       samples: int = 1) -> Verdict:
  """A policy grades `response` on `task.rubric`; reward = mean over `samples` judge replies
  of the weighted, normalised rubric score.

  render(prompt text) -> input ids (the caller applies its chat template); decode(ids) -> text.
  A reply that names no dimension scores 0 for it (listed under details["missing"]).
  """
  if task.kind != "judge":
    raise ValueError(f"verify_judge: task {task.instance_id!r} has kind={task.kind!r}, "
                     "expected 'judge'")
  if samples < 1:
    raise ValueError(f"samples={samples!r}: expected >= 1")
  ids = list(render(judge_prompt(task, response)))
  replies = await asyncio.gather(*(policy.generate(ids, params) for _ in range(samples)))
  rewards, per_sample, missing = [], [], set()
  for gen in replies:
    text = decode(gen.output_ids)
    scores = parse_scores(text, task.rubric)
    missing.update(n for n, s in scores.items() if s is None)
    rewards.append(rubric_reward(scores, task.rubric))
    per_sample.append({"scores": scores, "reply": text[:1000]})
  details: dict[str, Any] = {"samples": per_sample, "missing": sorted(missing)}
  return Verdict(sum(rewards) / len(rewards), details)


# ----------------------------------------------------------------------------- dispatch


async def verify(task: Task, submission, *, make_sandbox: Optional[SandboxFactory] = None,
                 policy: Optional[Policy] = None,
                 render: Optional[Callable[[str], Sequence[int]]] = None,
                 decode: Optional[Callable[[Sequence[int]], str]] = None,
                 partial: bool = False) -> Verdict:
  """The verifier of `task.kind` applied to `submission`:
  swe: final workspace files {path: bytes} or a diff; code: program text; exact and judge:
  the response text. Sandboxed kinds need `make_sandbox`; judge needs policy/render/decode."""
  if task.kind in ("swe", "code") and make_sandbox is None:
    raise ValueError(f"verify: task kind {task.kind!r} needs make_sandbox")
  if task.kind == "swe":
    return await verify_tests(task, submission, make_sandbox, partial=partial)
  if task.kind == "code":
    return await verify_python_io(task, submission, make_sandbox, partial=partial)
  if task.kind == "exact":
    return verify_exact(task, submission)
  if policy is None or render is None or decode is None:
    raise ValueError("verify: a judge task needs policy, render and decode")
  return await verify_judge(task, submission, policy, render, decode)
