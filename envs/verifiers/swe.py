"""The `tests` verifier of "swe" tasks: the agent's changes to non-test files are applied to a
clean copy of the task's repository (with the task's test patch) in a FRESH sandbox, the task's
test command runs under a trusted runner, and the reward is SWE-bench's verdict on the per-test
statuses (`envs.verifiers.swe_logs.grade`): 1 iff every FAIL_TO_PASS test passes (or is an
expected failure) and no PASS_TO_PASS test fails.

Where the statuses come from depends on the task's `test_runner`:
- pytest: a JUnit XML report that pytest writes to a memfd of the runner (never stdout).
  `<skipped type="pytest.xfail">` is an expected failure ("xfail"); a non-strict xfail test
  that passes carries a property of the runner's and reads "xpass"; an xfail without an xfail
  marker (a `pytest.xfail()` call, which code under test could make) reads "xfail_unmarked".
  Tests are graded on the statuses SWE-bench's pytest log parser records (`swe_logs.RECORDED`):
  a skipped or xpassed test counts as missing, as it does in SWE-bench. pytest runs with "-rA",
  so its log (kept whole in `RunResult.output`) is one SWE-bench's parsers read; on an honest
  run they read from it the statuses the JUnit report gave, but only the report is trusted.
- django / sympy: the log of the repository's own runner (tests/runtests.py, bin/test), parsed
  as SWE-bench parses it (`swe_logs.parse_django_log`, `parse_sympy_log`).

`verify_tests` gives the reward; `grade_submission` the same verification with the run's log
and where it stopped (`Outcome`), for graders of predictions (`envs.evaluate`). A run that cannot
start because the sandbox has no interpreter or no pytest says so (`RunResult.cause`
"runner_missing"), rather than that the run did not finish.

Threat model of `verify_tests`. The agent controls the files it submits, and its code runs in
the same sandbox, and in the same Python process, as the test runner. Defences:
1. What is applied: test files (those named by the task's test ids and test patch, the runner's
   own files, and any path matching test patterns: test_*.py, *_test.py, tests.py, tests/,
   test/, testing/) are restored from the original, new ones dropped; changes to conftest.py,
   pytest.ini/.pytest.ini/tox.ini/setup.cfg/pyproject.toml/setup.py, sitecustomize.py,
   usercustomize.py and *.pth are refused: reward 0 with the reason. Byte-code caches (an
   unchecked-hash .pyc replaces its source) and package metadata (*.dist-info, *.egg-info:
   entry points can load pytest plugins) are dropped.
2. How the tests start: a trusted runner arrives on stdin (`python3 -I -B -`), so neither argv
   nor the environment shows its nonce. The pytest runner imports pytest and all its built-in
   plugins BEFORE the workspace joins sys.path (a `pytest.py` or `xml/` in the repo cannot
   shadow them), disables plugin auto-loading, and passes `--rootdir` so node ids are stable.
   The log runner makes itself non-dumpable (other processes of the sandbox's uid cannot read
   its memory or file descriptors) and starts the repository's runner as a child process whose
   stdout and stderr go to a memfd.
3. The results: right after the tests return, the runner hashes the report and the log, copies
   them into the workspace under random names, prints one line "NONCE rc sha256 size sha256
   size" (the nonce is random per run) to its saved stdout, and leaves with `os._exit` (no
   atexit handler or thread of the agent's code runs after it). The verifier accepts exactly
   one such line and copies with those hashes: a result written or rewritten by anyone else (a
   fake XML anywhere, a "PASSED" line on the sandbox's stdout, an atexit handler, a surviving
   daemon) does not count, a run killed or exited early prints no line, and a test missing from
   the results fails. As in SWE-bench, a run that exits non-zero while reporting no failure is
   not trusted.
4. After the run, the test modules, runner, conftest and config files in the sandbox must still
   be byte-identical to what was written (code that rewrites tests on disk gets 0).
Residual risk: code under test runs inside the test runner's process. With pytest it could, by
a targeted attack on this runner (reading the nonce from the interpreter's memory, patching
pytest objects), forge a result; no in-process reporter can prevent that. With the django and
sympy runners the risk is larger and simpler: the log is the runner's own output, which the
code under test shares, so code that prints fake "... ok" lines and then exits with status 0,
or that replaces sys.stdout to hide failures, is graded on what it printed (SWE-bench's
grading has the same weakness). Restored tests and runner files mean such code must sit in the
non-test files of the submission, where a reviewer of the diff sees it; prefer pytest tasks for
RL where the choice exists. Generated tests compare with exact types, so objects whose __eq__
always answers True fail them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import secrets
import shlex
import xml.etree.ElementTree as ET
from typing import Mapping, Optional, Sequence, Union

from envs.sandbox.base import Sandbox
from envs.tasks import Task, apply_patch, is_cache_path, load_repo_files, patch_files
from envs.verifiers import swe_logs
from envs.verifiers.base import SandboxFactory, Verdict, start_sandbox

log = logging.getLogger(__name__)

# Basenames whose change is refused: they configure pytest or run code at interpreter start.
CONFIG_FILES = frozenset({"conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg",
                          "pyproject.toml", "setup.py", "sitecustomize.py", "usercustomize.py"})
TEST_DIRS = frozenset({"test", "tests", "testing"})
# Runner code outside the test patterns, restored like tests (besides the command's script).
RUNNER_FILES = {"sympy": ("bin/test", "sympy/utilities/runtests.py")}
LOG_TAIL = 3000  # bytes of the tests' output kept in details (debugging only, never scored)


async def workspace_files(sandbox: Sandbox) -> dict[str, bytes]:
  """All regular files of an agent's workspace (caches left out), for `verify_tests`.

  A file the sandbox will not hand over (larger than its `limits.file_bytes`, or gone or turned
  into a symlink since the listing) is left out, as if deleted: that is the agent's doing.

  Args:
    sandbox: the agent's sandbox, still open.

  Returns:
    {workspace-relative path: content}.
  """
  files = {}
  for path in await sandbox.list_files():
    if not is_ignored_path(path):
      try:
        files[path] = await sandbox.read_file(path)
      except (OSError, ValueError) as e:  # PathError is a ValueError
        log.warning("workspace_files: %s left out: %s", path, e)
  return files


def task_test_files(task: Task) -> set[str]:
  """Files the task names as tests: modules of its pytest ids, files of its test patch, and the
  test runner's own files (Django's tests/runtests.py, sympy's bin/test and its runner module).

  Args:
    task: a "swe" task.

  Returns:
    Workspace-relative paths.
  """
  files = set(patch_files(task.test_patch))
  if task.test_runner == "pytest":
    files |= {i.split("::", 1)[0] for i in task.fail_to_pass + task.pass_to_pass}
  else:
    files.add(task.script_command()[2])
    files |= set(RUNNER_FILES.get(task.test_runner, ()))
  return files


def is_test_path(path: str, task_files: set[str] = frozenset()) -> bool:
  """Whether `path` is a test file (restored from the original, never applied).

  Args:
    path: a workspace-relative path.
    task_files: the files the task names as tests (`task_test_files`).

  Returns:
    True when the task names it, or it matches test_*.py, *_test.py, tests.py or sits under
    a tests/, test/ or testing/ directory.
  """
  parts = path.split("/")
  base = parts[-1]
  return (path in task_files or any(p in TEST_DIRS for p in parts[:-1])
          or base.startswith("test_") and base.endswith(".py") or base.endswith("_test.py")
          or base == "tests.py")


def refused_reason(path: str) -> Optional[str]:
  """Why a change to `path` is refused outright (test configuration or start-up code).

  Args:
    path: a workspace-relative path.

  Returns:
    The reason, or None when a change to it may be applied.
  """
  parts = path.split("/")
  if parts[-1] in CONFIG_FILES:
    return f"{path}: changes to {parts[-1]} are refused (test configuration / start-up code)"
  if parts[-1].endswith(".pth"):
    return f"{path}: .pth files are refused (they run code at interpreter start)"
  return None


def is_ignored_path(path: str) -> bool:
  """Whether `path` is dropped from a submission, never applied.

  Dropped are byte-code caches (an unchecked-hash .pyc replaces its source) and package
  metadata (an entry point can name a pytest plugin).

  Args:
    path: a workspace-relative path.

  Returns:
    True for caches and *.dist-info / *.egg-info / *.egg-link paths.
  """
  return is_cache_path(path) or any(p.endswith((".dist-info", ".egg-info", ".egg-link"))
                                    for p in path.split("/"))


class Refused(Exception):
  """The submission may not be tested (reason in args[0])."""


class PatchFailed(Refused):
  """The submission is a diff that does not apply to the repository (reason in args[0])."""


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

  Args:
    task: the "swe" task.
    original: the repository's files.
    submission: the agent's final workspace {path: content} (an original file missing from it
      was deleted) or a unified diff against the original.

  Returns:
    (files, {"applied", "restored", "ignored"}: the changed paths by what became of them).

  Raises:
    Refused: with the reason (a config file changed, an unsafe path); PatchFailed, a
      Refused, for a patch that does not apply.
    ValueError: the task's own test patch does not apply.
  """
  if isinstance(submission, str):
    try:
      final = apply_patch(original, submission)
    except (ValueError, UnicodeDecodeError) as e:
      raise PatchFailed(f"the patch does not apply: {e}") from None
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
  """The (classname, name) that pytest's JUnit report gives a test.

  "tests/test_a.py::TestX::test_y[1-2]" -> ("tests.test_a.TestX", "test_y[1-2]").

  Args:
    node_id: a pytest node id.

  Returns:
    (classname, name).
  """
  path, bracket, params = node_id.partition("[")
  names = path.split("::")
  names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
  names[-1] += bracket + params
  return ".".join(names[:-1]), names[-1]


_XPASS_MESSAGE = "xfail-marked test passes unexpectedly"  # older pytest's xpass element
_RANK = {swe_logs.PASSED: 0, swe_logs.XFAIL: 1, swe_logs.XPASS: 1, swe_logs.SKIPPED: 1,
         swe_logs.XFAIL_UNMARKED: 2, swe_logs.FAILED: 2, swe_logs.ERROR: 3}


def parse_junit(xml: bytes) -> dict[tuple[str, str], str]:
  """The per-test statuses of a JUnit XML report (pytest's, with the runner's properties).

  A test reported more than once (e.g. a passing call and a failing teardown) takes the worst.

  Args:
    xml: the report.

  Returns:
    {(classname, name): status}, status one of passed | failed | error | skipped | xfail |
    xpass | xfail_unmarked (see `envs.verifiers.swe_logs`).

  Raises:
    ValueError: the root element is not testsuites / testsuite.
  """
  root = ET.fromstring(xml)
  if root.tag not in ("testsuites", "testsuite"):
    raise ValueError(f"not a JUnit report: root element <{root.tag}>")
  out: dict[tuple[str, str], str] = {}
  for case in root.iter("testcase"):
    children = {child.tag: child for child in case}
    outcome = {p.get("name"): p.get("value") for p in case.iter("property")}.get(
        "arbor_outcome")
    skipped = children.get("skipped")
    if "error" in children:
      status = swe_logs.ERROR
    elif "failure" in children:
      status = swe_logs.FAILED
    elif skipped is not None and skipped.get("message") == _XPASS_MESSAGE:
      status = swe_logs.XPASS
    elif skipped is not None and skipped.get("type") == "pytest.xfail":
      status = swe_logs.XFAIL_UNMARKED if outcome == "xfail_unmarked" else swe_logs.XFAIL
    elif skipped is not None:
      status = swe_logs.SKIPPED
    else:
      status = swe_logs.XPASS if outcome == "xpass" else swe_logs.PASSED
    key = (case.get("classname", ""), case.get("name", ""))
    if _RANK[status] >= _RANK[out.get(key, swe_logs.PASSED)]:
      out[key] = status
  return out


# The end of both runners: copy the report (pytest's JUnit XML, or None) and the log into the
# workspace under random names and print their hashes under the nonce on the saved stdout.
_FINISH = r'''
def _copy(name, data):
  fd = os.open(os.path.join(WS, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
               0o600)
  view = memoryview(data)
  while view:
    view = view[os.write(fd, view):]
  os.close(fd)
  return "%s %d" % (hashlib.sha256(data).hexdigest(), len(data))

def _finish(rc, report, log_fd):
  import sys
  for stream in (sys.stdout, sys.stderr):  # what the tests printed is still in their buffers
    try:
      stream.flush()
    except Exception:
      pass
  out = os.pread(log_fd, os.fstat(log_fd).st_size, 0)
  report = _copy(COPY + "r", report) if report else "none 0"
  line = "%s %d %s %s" % (NONCE, rc, report, _copy(COPY + "l", out))
  os.write(OUT, out[-TAIL:] + ("\n" + line + "\n").encode())
  os._exit(0)
'''

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

class _Outcomes:
  """Marks in the JUnit report what its elements cannot tell: an xfail test that passed, and
  an xfail without an xfail marker (a pytest.xfail() call, which code under test can make)."""

  @pytest.hookimpl(hookwrapper=True, tryfirst=True)
  def pytest_runtest_makereport(self, item, call):
    rep = (yield).get_result()
    if not hasattr(rep, "wasxfail"):
      return
    if rep.when == "call" and rep.passed:
      item.user_properties.append(("arbor_outcome", "xpass"))
    elif rep.skipped and not (any(item.iter_markers("xfail")) if hasattr(item, "iter_markers")
                              else item.get_marker("xfail")):  # pytest < 3.6
      item.user_properties.append(("arbor_outcome", "xfail_unmarked"))

# The report goes to an anonymous in-memory file: outside the repository, with no path on disk.
_report = os.memfd_create("m")
_log = os.memfd_create("l")
OUT = os.dup(1)
os.dup2(_log, 1)
os.dup2(_log, 2)
sys.path.insert(0, WS)
try:
  rc = int(pytest.main(ARGS + ["--rootdir", WS, "--junitxml", "/proc/self/fd/%d" % _report,
                               "-p", "no:cacheprovider"], plugins=[_Outcomes()]))
except BaseException:
  rc = -1
_finish(rc, os.pread(_report, os.fstat(_report).st_size, 0), _log)
'''

_LOG_RUNNER = r'''
import ctypes, hashlib, os, subprocess
try:  # PR_SET_DUMPABLE 0: the tests' processes cannot read this one's memory or descriptors
  ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)
except Exception:
  pass
WS = os.getcwd()
OUT = 1
_log = os.memfd_create("l")
env = {**os.environ, **ENV, "PYTHONDONTWRITEBYTECODE": "1"}
try:
  rc = subprocess.Popen([PYTHON, SCRIPT] + ARGS, cwd=WS, stdin=subprocess.DEVNULL, stdout=_log,
                        stderr=_log, env=env).wait()
except OSError as e:
  os.write(_log, ("cannot run %s: %s\n" % (SCRIPT, e)).encode())
  rc = -1
_finish(rc, None, _log)
'''


@dataclasses.dataclass
class RunResult:
  """One trusted test run: per-test statuses, or why there are none."""

  statuses: dict  # pytest: {(classname, name): status}; log runners: {test name: status}
  exit_code: Optional[int]
  log: str                     # the output's tail (LOG_TAIL bytes)
  error: Optional[str] = None  # set when there is no trustworthy result
  output: str = ""             # the whole output (the log runners' statuses come from it)
  cause: Optional[str] = None  # with `error`: one of RUN_FAILURES


PytestRun = RunResult  # the name envs.verifiers exports

# Why a run has no trustworthy result (`RunResult.cause`). "timeout" and "runner_missing" are
# the environment's doing (no interpreter, or one without the test runner); the others may be
# the submission's (code under test that kills the runner, floods its output or rewrites its
# results).
RUN_FAILURES = ("timeout", "runner_missing", "no_result", "unreadable", "changed", "no_report",
                "bad_report")
_NO_MODULE = re.compile(r"No module named '?([\w.]+)'?")


def _missing_runner(python: str, exit_code: int, tail: str, runner: str) -> Optional[str]:
  """Why the runner could not start in the sandbox, or None when that is not what happened.

  The runner's own import comes first, before the workspace joins sys.path, so a missing
  module here is the environment's (the submission's code has not run yet).
  """
  m = _NO_MODULE.search(tail)
  if m and m.group(1).split(".")[0] in (runner, "_" + runner):
    return (f"the test runner is missing from the sandbox: {python} cannot import {runner} "
            f"(No module named {m.group(1)!r}); install it in the task's environment")
  if exit_code == 127 or re.search(rf"{re.escape(python)}: (command )?not found", tail):
    return (f"the sandbox has no {python!r} interpreter (exit status {exit_code}); the task's "
            "environment must provide it")
  return None


async def _run(sandbox: Sandbox, python: str, program: str, timeout: float, runner: str,
               **header) -> tuple[Optional[int], str, Optional[bytes], str,
                                  Optional[tuple[str, str]]]:
  """Runs a runner program fed on stdin; (rc, output, report, log tail, (cause, error))."""
  nonce = secrets.token_hex(16)
  copy = f".arbor-result-{secrets.token_hex(16)}"  # no .xml: generic sprayers pass it by
  header.update(COPY=copy, NONCE=nonce, TAIL=LOG_TAIL)
  code = "".join(f"{k} = {v!r}\n" for k, v in header.items()) + _FINISH + program
  res = await sandbox.exec(f"{shlex.quote(python)} -I -B -", timeout=timeout, stdin=code)
  lines = re.findall(rf"^{nonce} (-?\d+) ([0-9a-f]{{64}}|none) (\d+) ([0-9a-f]{{64}}) (\d+)$",
                     res.stdout, re.M)
  tail = res.stdout.split(nonce)[0][-LOG_TAIL:] + res.stderr[-LOG_TAIL:]
  if res.timed_out:
    return None, "", None, tail, ("timeout", f"the test run timed out after {timeout:g}s")
  if len(lines) != 1:
    missing = _missing_runner(python, res.exit_code, tail, runner) if not lines else None
    if missing:
      return res.exit_code, "", None, tail, ("runner_missing", missing)
    return None, "", None, tail, ("no_result", "the test run did not finish (no result line "
                                  "from the runner: it crashed, exited early, or its output was "
                                  "flooded)")
  rc, *hashes = lines[0]
  data = {}
  for suffix, digest, size in (("r", hashes[0], hashes[1]), ("l", hashes[2], hashes[3])):
    if digest == "none":
      data[suffix] = None
      continue
    try:
      data[suffix] = await sandbox.read_file(copy + suffix)
    except (OSError, ValueError) as e:  # PathError is a ValueError
      return int(rc), "", None, tail, ("unreadable", f"the run's results could not be read: {e}")
    if len(data[suffix]) != int(size) or hashlib.sha256(data[suffix]).hexdigest() != digest:
      return int(rc), "", None, tail, ("changed", "the run's results were changed after the "
                                       "run wrote them")
  return int(rc), data["l"].decode("utf-8", errors="replace"), data["r"], tail, None


async def run_pytest(sandbox: Sandbox, args: Sequence[str], timeout: float,
                     python: str = "python3") -> RunResult:
  """Runs pytest in a sandbox's workspace and reads its JUnit report (see the module docstring).

  The log (`output`) is pytest's terminal output with "-rA" added to the arguments (the last
  -r option wins), so its short summary names every passed, failed, erroring and xfail test as
  SWE-bench's pytest log parser reads it; the statuses come from the JUnit report only.

  Args:
    sandbox: holds the files to test.
    args: pytest's arguments (the task's test command without the interpreter).
    timeout: seconds for the whole run.
    python: the interpreter in the sandbox.

  Returns:
    The statuses {(classname, name): status}, or the reason there are none in `error` (and
    its kind in `cause`).
  """
  rc, output, report, tail, failure = await _run(sandbox, python, _PYTEST_RUNNER, timeout,
                                                 "pytest", ARGS=list(args) + ["-rA"])
  if failure is None and report is None:
    failure = ("no_report", "pytest wrote no JUnit report")
  if failure is not None:
    return RunResult({}, rc, tail, failure[1], output, failure[0])
  try:
    statuses = parse_junit(report)
  except (ET.ParseError, ValueError) as e:
    return RunResult({}, rc, tail, f"the JUnit report does not parse: {e}", output,
                     "bad_report")
  return RunResult(statuses, rc, tail, None, output)


async def run_log_tests(sandbox: Sandbox, runner: str, script: str, args: Sequence[str],
                        timeout: float, python: str = "python3",
                        env: Optional[Mapping[str, str]] = None) -> RunResult:
  """Runs a repository's own test runner script and parses its log (module docstring).

  Args:
    sandbox: holds the files to test.
    runner: "django" or "sympy": which log format to parse.
    script: the runner script, workspace-relative (tests/runtests.py, bin/test).
    args: its arguments.
    timeout: seconds for the whole run.
    python: the interpreter in the sandbox.
    env: variables set for the runner (e.g. PYTHONWARNINGS).

  Returns:
    The statuses {test name: status}, or the reason there are none in `error` (and its kind
    in `cause`).
  """
  parse = swe_logs.LOG_PARSERS[runner]
  # The log runner itself needs only the standard library: a missing interpreter is all that
  # `_missing_runner` can find here ("python" never names a module).
  rc, output, _, tail, failure = await _run(sandbox, python, _LOG_RUNNER, timeout, "python",
                                            PYTHON=python, SCRIPT=script, ARGS=list(args),
                                            ENV=dict(env or {}))
  if failure is not None:
    return RunResult({}, rc, tail, failure[1], output, failure[0])
  return RunResult(parse(output), rc, tail, None, output)


# How far `grade_submission` got (`Outcome.stage`).
STAGES = ("refused", "not_written", "tampered", "no_result", "inconsistent", "graded")


@dataclasses.dataclass
class Outcome:
  """Everything one verification learned: the verdict, and where it stopped.

  stage:
    "refused": the submission was not tested (`merge_submission` refused it; `patch_failed`
      when it was a diff that does not apply);
    "not_written": a file could not be written into the sandbox;
    "tampered": a test, runner or configuration file changed during the run;
    "no_result": the run gave no trustworthy result (`run.error`, `run.cause`);
    "inconsistent": the run exited non-zero yet recorded no failing test;
    "graded": `grade` holds SWE-bench's verdict on the run's statuses.
  """

  verdict: Verdict
  stage: str
  run: Optional[RunResult] = None         # the test run, when there was one
  grade: Optional[swe_logs.Grade] = None  # with stage "graded"
  recorded: frozenset = swe_logs.SWEBENCH_STATUSES  # statuses the runner's log parser records
  patch_failed: bool = False


async def grade_submission(task: Task, submission: Union[Mapping[str, Union[bytes, str]], str],
                           make_sandbox: SandboxFactory, *, partial: bool = False,
                           original: Optional[Mapping[str, bytes]] = None) -> Outcome:
  """Tests an agent's changes to a "swe" task and grades them (see the module docstring).

  `verify_tests` is this function's verdict; graders of predictions (`envs.evaluate`) also
  read the run's full log and where the verification stopped.

  Args:
    task: the "swe" task.
    submission: the agent's final workspace {path: bytes} (see `workspace_files`) or a
      unified diff against the original repository.
    make_sandbox: make_sandbox(task) gives a fresh sandbox (or an awaitable of one); this
      function closes it.
    partial: reward = fraction of FAIL_TO_PASS + PASS_TO_PASS tests graded a success instead
      of all-or-nothing.
    original: the repository files, if the caller already holds them (default:
      `load_repo_files(task)`).

  Returns:
    The outcome; its verdict's details name the per-test statuses, or the reason for reward 0.

  Raises:
    ValueError: the task is not a "swe" task.
    SandboxError: the sandbox itself failed (infrastructure, not the agent's doing).
  """
  if task.kind != "swe":
    raise ValueError(f"verify_tests: task {task.instance_id!r} has kind={task.kind!r}, "
                     "expected 'swe'")
  recorded = swe_logs.RECORDED[task.test_runner]
  original = load_repo_files(task) if original is None else original
  try:
    files, changes = merge_submission(task, original, submission)
  except Refused as e:
    return Outcome(Verdict.fail(f"refused: {e.args[0]}"), "refused", recorded=recorded,
                   patch_failed=isinstance(e, PatchFailed))
  sandbox = await start_sandbox(make_sandbox, task)
  try:
    for path, data in files.items():
      try:
        await sandbox.write_file(path, data)
      except (OSError, ValueError) as e:  # too large, or a file where a directory must be
        return Outcome(Verdict.fail(f"cannot write {path!r} into the sandbox: {e}", **changes),
                       "not_written", recorded=recorded)
    if task.test_runner == "pytest":
      python, args = task.pytest_command()
      run = await run_pytest(sandbox, args, task.timeout, python)
    else:
      env, python, script, args = task.script_command()
      run = await run_log_tests(sandbox, task.test_runner, script, args, task.timeout, python,
                                env)
    # Tests and configuration must be exactly what we wrote, whatever the run did on disk.
    named = task_test_files(task)
    guarded = [p for p in sorted(files) if p in named or p.rsplit("/", 1)[-1] in CONFIG_FILES]
    for path in guarded:
      try:
        same = await sandbox.read_file(path) == files[path]
      except (OSError, ValueError):
        same = False
      if not same:
        return Outcome(Verdict.fail(f"{path} was modified during the test run", **changes,
                                    log=run.log), "tampered", run, recorded=recorded)
  finally:
    await sandbox.close()
  if run.error is not None:
    return Outcome(Verdict.fail(run.error, exit_code=run.exit_code, log=run.log, **changes),
                   "no_result", run, recorded=recorded)
  if task.test_runner == "pytest":
    by_key = {f"{c}::{n}": s for (c, n), s in run.statuses.items()}
    result = swe_logs.grade(
        task.fail_to_pass, task.pass_to_pass,
        lambda t: swe_logs.find_status("::".join(junit_key(t)), by_key, recorded), recorded)
  else:
    result = swe_logs.grade(task.fail_to_pass, task.pass_to_pass,
                            lambda t: swe_logs.find_status(t, run.statuses, recorded), recorded)
  details = dict(fail_to_pass=result.fail_to_pass, pass_to_pass=result.pass_to_pass,
                 passed=result.successes, total=result.total, solved=result.resolved,
                 exit_code=run.exit_code, log=run.log, **changes)
  if not swe_logs.log_is_consistent(run.exit_code, run.statuses, recorded):
    details["solved"] = False
    return Outcome(Verdict.fail(f"the tests exited with status {run.exit_code} but reported "
                                "no failing test: the results are not trusted", **details),
                   "inconsistent", run, recorded=recorded)
  if result.resolved:
    return Outcome(Verdict(1.0, details), "graded", run, result, recorded)
  details["reason"] = "some FAIL_TO_PASS / PASS_TO_PASS tests do not pass"
  return Outcome(Verdict(result.successes / result.total if partial else 0.0, details),
                 "graded", run, result, recorded)


async def verify_tests(task: Task, submission: Union[Mapping[str, Union[bytes, str]], str],
                       make_sandbox: SandboxFactory, *, partial: bool = False,
                       original: Optional[Mapping[str, bytes]] = None) -> Verdict:
  """Reward of an agent's changes to a "swe" task: `grade_submission`'s verdict.

  Args:
    task: the "swe" task.
    submission: the agent's final workspace {path: bytes} (see `workspace_files`) or a
      unified diff against the original repository.
    make_sandbox: make_sandbox(task) gives a fresh sandbox (or an awaitable of one); this
      function closes it.
    partial: reward = fraction of FAIL_TO_PASS + PASS_TO_PASS tests graded a success instead
      of all-or-nothing.
    original: the repository files, if the caller already holds them (default:
      `load_repo_files(task)`).

  Returns:
    The verdict; its details name the per-test statuses, or the reason for reward 0.

  Raises:
    ValueError: the task is not a "swe" task.
    SandboxError: the sandbox itself failed (infrastructure, not the agent's doing).
  """
  outcome = await grade_submission(task, submission, make_sandbox, partial=partial,
                                   original=original)
  return outcome.verdict
