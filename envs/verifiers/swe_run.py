"""The trusted test runners of the `tests` verifier (`envs.verifiers.swe`, whose module
docstring is their threat model): a pytest runner that writes a JUnit report, and a log runner
that starts a repository's runner script or `python -m unittest -v` as a child, both fed to the
sandbox's interpreter on stdin and reporting under a per-run nonce. `envs.verifiers.swe`
re-exports these names.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import secrets
import shlex
import xml.etree.ElementTree as ET
from typing import Mapping, Optional, Sequence

from envs.sandbox.base import Sandbox
from envs.verifiers import swe_logs

LOG_TAIL = 3000  # bytes of the tests' output kept in details (debugging only, never scored)


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

def _installed_plugins():
  """The pytest11 entry points of the interpreter's installed distributions (the environment's,
  read-only in the sandbox), loaded now, before the workspace joins sys.path: pytest's own
  auto-loading would also read package metadata found through the workspace."""
  try:
    import importlib.metadata as md
    eps = md.entry_points()
    eps = eps.select(group="pytest11") if hasattr(eps, "select") else eps.get("pytest11", ())
  except Exception:  # Python < 3.8, or unreadable metadata: pytest's own plugins only
    return []
  out, seen = [], set()
  for ep in eps:
    if ep.name in seen:
      continue
    seen.add(ep.name)
    try:
      out.append((ep.name, ep.load()))
    except Exception:  # a broken plugin fails pytest's auto-loading too; here it is left out
      pass
  return out

_PLUGINS = _installed_plugins()

class _Register:
  """Registers the installed plugins under their entry point names (as auto-loading does, so
  `-p no:NAME` still disables one) before pytest reads its ini file's addopts."""

  @pytest.hookimpl(tryfirst=True)
  def pytest_load_initial_conftests(self, early_config):
    pm = early_config.pluginmanager
    for name, plugin in _PLUGINS:
      if not pm.is_blocked(name) and not pm.is_registered(plugin) and pm.get_plugin(name) is None:
        pm.register(plugin, name)

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
                               "-p", "no:cacheprovider"], plugins=[_Outcomes(), _Register()]))
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
  rc = subprocess.Popen([PYTHON] + ARGV, cwd=WS, stdin=subprocess.DEVNULL, stdout=_log,
                        stderr=_log, env=env).wait()
except OSError as e:
  os.write(_log, ("cannot run %s: %s\n" % (" ".join(ARGV), e)).encode())
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
  """Runs a repository's own test runner script, or `python -m unittest -v`, and parses its
  log (module docstring).

  Args:
    sandbox: holds the files to test.
    runner: "django", "sympy" or "unittest": which log format to parse (and, for
      "unittest", the child `python -m unittest -v ARGS` instead of a script).
    script: the runner script, workspace-relative (tests/runtests.py, bin/test); "" for
      "unittest".
    args: its arguments (unittest's, for "unittest": "-v" goes first, or after "discover").
    timeout: seconds for the whole run.
    python: the interpreter in the sandbox.
    env: variables set for the runner (e.g. PYTHONWARNINGS).

  Returns:
    The statuses {test name: status}, or the reason there are none in `error` (and its kind
    in `cause`).
  """
  parse = swe_logs.LOG_PARSERS[runner]
  args = list(args)
  if runner == "unittest":  # unittest.main reads "discover" only as its first argument
    at = 1 if args[:1] and args[0].lower() == "discover" else 0
    argv = ["-m", "unittest", *args[:at], "-v", *args[at:]]
  else:
    argv = [script, *args]
  # The log runner itself needs only the standard library: a missing interpreter is all that
  # `_missing_runner` can find here ("python" never names a module).
  rc, output, _, tail, failure = await _run(sandbox, python, _LOG_RUNNER, timeout, "python",
                                            PYTHON=python, ARGV=argv, ENV=dict(env or {}))
  if failure is not None:
    return RunResult({}, rc, tail, failure[1], output, failure[0])
  return RunResult(parse(output), rc, tail, None, output)
