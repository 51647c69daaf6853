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
- unittest (a test command `[NAME=VALUE ...] PYTHON -m unittest [ARGS]`): the log of
  `PYTHON -m unittest -v ARGS` ("-v" after a leading "discover"), parsed by SWE-bench's django
  parser (unittest's verbose lines are Django's: "test_x (pkg.tests.test_a.TestA.test_x) ... ok"
  on Python >= 3.11, "test_x (pkg.tests.test_a.TestA) ... ok" before). The test ids' modules
  are the task's test files.

`verify_tests` gives the reward; `grade_submission` the same verification with the run's log
and where it stopped (`Outcome`), for graders of predictions (`envs.evaluate`). A run that cannot
start because the sandbox has no interpreter or no pytest says so (`RunResult.cause`
"runner_missing"), rather than that the run did not finish.

Threat model of `verify_tests`. The agent controls the files it submits, and its code runs in
the same sandbox, and in the same Python process, as the test runner. Defences:
1. What is applied: test files (those named by the task's test ids and test patch, the runner's own
   files, and any path matching test patterns: test_*.py, *_test.py, tests.py, tests/, test/,
   testing/) are restored from the original, new ones dropped; changes to conftest.py,
   pytest.ini/.pytest.ini/tox.ini/setup.cfg/pyproject.toml/setup.py, sitecustomize.py,
   usercustomize.py and *.pth are refused: reward 0 with the reason. So are changes to a
   unittest.py, unittest/ or unittest extension module at the workspace root: `python -m unittest`
   (and test code importing unittest, which pytest consults) would import it in place of the
   standard library's unittest, since `-m` puts the working directory first on sys.path. Byte-code
   caches (an unchecked-hash .pyc replaces its source) and package metadata (*.dist-info,
   *.egg-info: entry points can load pytest plugins) are dropped.
2. How the tests start: a trusted runner arrives on stdin (`python3 -I -B -`), so neither argv
   nor the environment shows its nonce. The pytest runner imports pytest and all its built-in
   plugins BEFORE the workspace joins sys.path (a `pytest.py` or `xml/` in the repo cannot
   shadow them), loads the pytest plugins installed in the interpreter's own site-packages
   (the environment's: read-only in the sandbox; registered under their entry point names, so
   `-p no:NAME` in the repository's ini still applies) at the same point, disables pytest's
   auto-loading (which would also read package metadata found through the workspace), and
   passes `--rootdir` so node ids are stable.
   The log runner makes itself non-dumpable (other processes of the sandbox's uid cannot read
   its memory or file descriptors) and starts the repository's runner (or `python -m unittest
   -v`) as a child process whose stdout and stderr go to a memfd. The unittest child runs
   without -P (Python >= 3.11 only), which would keep the working directory off sys.path and
   so leave the test modules that a command names unimportable: the refusal in 1. is what
   keeps the standard library's unittest the runner.
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
Residual risk: code under test runs inside the test runner's process. With pytest it could, by a
targeted attack on this runner (reading the nonce from the interpreter's memory, patching pytest
objects), forge a result; no in-process reporter can prevent that. With the django, sympy and
unittest runners the risk is larger and simpler: the log is the runner's own output, which the code
under test shares, so code that prints fake "... ok" lines and then exits with status 0, or that
replaces sys.stdout to hide failures, is graded on what it printed (SWE-bench's grading has the
same weakness). Likewise a top-level module of the workspace named like a standard-library module
that unittest imports after the working directory joins sys.path (difflib, say) loads in its place:
code of the submission running in the runner's process, no more than code under test can do.
Restored tests and runner files mean such code must sit in the non-test files of the submission,
where a reviewer of the diff sees it; prefer pytest tasks for RL where the choice exists. Generated
tests compare with exact types, so objects whose __eq__ always answers True fail them.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Collection, Mapping, Optional, Sequence, Union

from envs.sandbox.base import Sandbox
from envs.tasks import Task, apply_patch, is_cache_path, load_repo_files, patch_files
from envs.verifiers import swe_logs
from envs.verifiers.base import SandboxFactory, Verdict, start_sandbox
# The runners live in swe_run; their names stay importable from here.
from envs.verifiers.swe_run import (LOG_TAIL, RUN_FAILURES, PytestRun, RunResult,  # noqa: F401
                                    junit_key, parse_junit, run_log_tests, run_pytest)

log = logging.getLogger(__name__)

# Basenames whose change is refused: they configure pytest or run code at interpreter start.
CONFIG_FILES = frozenset({"conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg",
                          "pyproject.toml", "setup.py", "sitecustomize.py", "usercustomize.py"})
TEST_DIRS = frozenset({"test", "tests", "testing"})
# Runner code outside the test patterns, restored like tests (besides the command's script).
RUNNER_FILES = {"sympy": ("bin/test", "sympy/utilities/runtests.py")}
# What `python -m unittest` would import from the workspace root instead of the standard
# library's unittest: a module, a package or an extension module (.pyc caches are dropped).
_UNITTEST_SHADOW = re.compile(r"unittest(/.+|\.pyc?|(\.[\w-]+)?\.so)")
_UNITTEST_ID = re.compile(r"\(([\w.]+)\)$")  # "test_x (pkg.tests.test_a.TestA[.test_x])"


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


def unittest_test_files(test_ids: Sequence[str],
                        paths: Optional[Collection[str]] = None) -> set[str]:
  """The modules of unittest's verbose test names ("test_x (pkg.tests.test_a.TestA.test_x)" or
  "test_x (pkg.tests.test_a.TestA)"; a docstring line names no module).

  Args:
    test_ids: the names.
    paths: the repository's files: each name's module is the longest dotted prefix that is
      one of them (pkg/tests/test_a.py or pkg/tests/test_a/__init__.py). None: every
      prefix's .py path (a superset).

  Returns:
    Workspace-relative paths.
  """
  out = set()
  for test in test_ids:
    m = _UNITTEST_ID.search(test)
    parts = m.group(1).split(".") if m else []
    for i in range(len(parts), 0, -1):
      base = "/".join(parts[:i])
      found = [f for f in (f"{base}.py", f"{base}/__init__.py") if paths is None or f in paths]
      out.update(found[:1])
      if found and paths is not None:
        break
  return out


def task_test_files(task: Task, paths: Optional[Collection[str]] = None) -> set[str]:
  """Files the task names as tests: modules of its pytest ids or unittest names, files of its
  test patch, and the test runner's own files (Django's tests/runtests.py, sympy's bin/test and
  its runner module; `python -m unittest` has none in the repository).

  Args:
    task: a "swe" task.
    paths: the repository's files, which tell a unittest name's module exactly
      (`unittest_test_files`; None: every candidate).

  Returns:
    Workspace-relative paths.
  """
  files = set(patch_files(task.test_patch))
  tests = task.fail_to_pass + task.pass_to_pass
  if task.test_runner == "pytest":
    files |= {i.split("::", 1)[0] for i in tests}
  elif task.test_runner == "unittest":
    files |= unittest_test_files(tests, paths)
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
    The reason, or None when a change to it may be applied (refused: the CONFIG_FILES, *.pth,
    and unittest.py, unittest/ or a unittest extension module at the workspace root).
  """
  parts = path.split("/")
  if parts[-1] in CONFIG_FILES:
    return f"{path}: changes to {parts[-1]} are refused (test configuration / start-up code)"
  if parts[-1].endswith(".pth"):
    return f"{path}: .pth files are refused (they run code at interpreter start)"
  if _UNITTEST_SHADOW.fullmatch(path):
    return (f"{path}: a unittest module or package at the workspace root is refused (it would "
            "replace the standard library's unittest, the test runner)")
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
  task_files = task_test_files(task, original)
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
    named = task_test_files(task, files)
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

  Args: as `grade_submission`'s.

  Returns:
    The verdict; its details name the per-test statuses, or the reason for reward 0.

  Raises:
    ValueError: the task is not a "swe" task.
    SandboxError: the sandbox itself failed (infrastructure, not the agent's doing).
  """
  outcome = await grade_submission(task, submission, make_sandbox, partial=partial,
                                   original=original)
  return outcome.verdict
