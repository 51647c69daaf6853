"""The `tests` verifier of "swe" tasks: the agent's changes to non-test files are applied to a
clean copy of the task's repository in a FRESH sandbox, the task's pytest command runs with a
JUnit XML report written outside the repository, and the reward comes from that report (never
from stdout): 1 iff every FAIL_TO_PASS test passes and every PASS_TO_PASS test still passes.

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

import dataclasses
import hashlib
import logging
import re
import secrets
import shlex
import xml.etree.ElementTree as ET
from typing import Mapping, Optional, Sequence, Union

from envs.sandbox.base import Sandbox
from envs.tasks import Task, apply_patch, is_cache_path, load_repo_files
from envs.verifiers.base import SandboxFactory, Verdict, start_sandbox

log = logging.getLogger(__name__)

# Basenames whose change is refused: they configure pytest or run code at interpreter start.
CONFIG_FILES = frozenset({"conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg",
                          "pyproject.toml", "setup.py", "sitecustomize.py", "usercustomize.py"})
TEST_DIRS = frozenset({"test", "tests", "testing"})
LOG_TAIL = 3000  # bytes of pytest's output kept in details (debugging only, never scored)


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
  """Files the task names as tests: modules of its test ids and files of its test patch.

  Args:
    task: a "swe" task.

  Returns:
    Workspace-relative paths.
  """
  files = {i.split("::", 1)[0] for i in task.fail_to_pass + task.pass_to_pass}
  for line in task.test_patch.splitlines():
    if line.startswith(("--- a/", "+++ b/")):
      files.add(line[6:].split("\t", 1)[0].strip())
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
    Refused: with the reason (a config file changed, an unsafe path, a patch that does not
      apply).
    ValueError: the task's own test patch does not apply.
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


def parse_junit(xml: bytes) -> dict[tuple[str, str], str]:
  """The per-test statuses of a JUnit XML report.

  A test reported more than once (e.g. a passing call and a failing teardown) takes the worst.

  Args:
    xml: the report.

  Returns:
    {(classname, name): status}, status one of passed | failed | error | skipped.

  Raises:
    ValueError: the root element is not testsuites / testsuite.
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
  """Runs pytest in a sandbox's workspace and reads its JUnit report (see the module docstring).

  Args:
    sandbox: holds the files to test.
    args: pytest's arguments (the task's test command without the interpreter).
    timeout: seconds for the whole run.
    python: the interpreter in the sandbox.

  Returns:
    The statuses, or the reason there is no trustworthy report in `error`.
  """
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

  Args:
    task: the "swe" task.
    submission: the agent's final workspace {path: bytes} (see `workspace_files`) or a
      unified diff against the original repository.
    make_sandbox: make_sandbox(task) gives a fresh sandbox (or an awaitable of one); this
      function closes it.
    partial: reward = fraction of FAIL_TO_PASS + PASS_TO_PASS tests passing instead of
      all-or-nothing.
    original: the repository files, if the caller already holds them (default:
      `load_repo_files(task)`).

  Returns:
    The verdict; its details name the per-test outcomes, or the reason for reward 0.

  Raises:
    ValueError: the task is not a "swe" task.
    SandboxError: the sandbox itself failed (infrastructure, not the agent's doing).
  """
  if task.kind != "swe":
    raise ValueError(f"verify_tests: task {task.instance_id!r} has kind={task.kind!r}, "
                     "expected 'swe'")
  original = load_repo_files(task) if original is None else original
  try:
    files, changes = merge_submission(task, original, submission)
  except Refused as e:
    return Verdict.fail(f"refused: {e.args[0]}")
  sandbox = await start_sandbox(make_sandbox, task)
  try:
    for path, data in files.items():
      try:
        await sandbox.write_file(path, data)
      except (OSError, ValueError) as e:  # too large, or a file where a directory must be
        return Verdict.fail(f"cannot write {path!r} into the sandbox: {e}", **changes)
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
        return Verdict.fail(f"{path} was modified during the test run", **changes, log=run.log)
  finally:
    await sandbox.close()
  if run.error is not None:
    return Verdict.fail(run.error, exit_code=run.exit_code, log=run.log, **changes)

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
