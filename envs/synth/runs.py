"""Test commands and suite runs of a synthesis: what a row's `test_command` and `log_parser`
are, and one trusted run of the suite in a fresh sandbox.

A test command is one that `envs.verifiers.swe` grades, named with a log parser of swebench's
table (`envs.tasks.LOG_PARSERS`):
- pytest ("python3 -m pytest ARGS" or "pytest ARGS", log parser "parse_log_pytest" by
  default, or another pytest parser of the table). The rows' command gets "-rA" when it has
  no -r option, so the log that the command prints holds the short summary lines ("PASSED
  ID", "FAILED ID - ...") that swebench's pytest parsers read; a command whose last -r option
  leaves passing tests out is refused. Statuses come from the verifier's JUnit report, node
  ids rebuilt by `node_statuses`.
- a repository's own runner script ("[NAME=VALUE ...] [python3] SCRIPT ARGS", SCRIPT inside
  the repository) whose log a named parser reads: "parse_log_django" for unittest's verbose
  format (Django's tests/runtests.py, or any script running unittest with verbosity 2),
  "parse_log_sympy" for sympy's bin/test. Statuses and test ids are the parser's.
- unittest ("[NAME=VALUE ...] python3 -m unittest [ARGS]", log parser "parse_log_django" by
  default and the only one it takes): the verifier runs `python3 -m unittest -v ARGS`.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import shlex
import time
from typing import Awaitable, Callable, Mapping, Optional, Sequence, Union

from envs.sandbox import Sandbox
from envs.tasks import (LOG_PARSERS, UNITTEST_PARSER, is_unittest_command, pytest_command,
                        script_command, unittest_command)
from envs.verifiers.swe import RUNNER_FILES, RunResult, junit_key, run_log_tests, run_pytest

# make_sandbox() -> a fresh sandbox, or an awaitable of one.
SandboxMaker = Callable[[], Union[Sandbox, Awaitable[Sandbox]]]
PYTEST_PARSER = "parse_log_pytest"


@dataclasses.dataclass(frozen=True)
class TestCommand:
  """A test command as rows carry it and as the verifier runs it.

  Attributes:
    command: the rows' `test_command` (pytest: with "-rA").
    log_parser: the rows' `log_parser` (a name of swebench's PARSER_REGISTRY).
    runner: the verifier's runner for it (`envs.tasks.TEST_RUNNERS`).
    python: the interpreter in the sandbox.
    args: pytest's arguments, or the script's.
    script: the runner script (log runners), "" for pytest.
    env: variables set for the script (log runners).
  """

  __test__ = False  # not a pytest test class, whatever its name

  command: str
  log_parser: str
  runner: str
  python: str
  args: tuple[str, ...]
  script: str = ""
  env: Mapping[str, str] = dataclasses.field(default_factory=dict)

  @property
  def runner_files(self) -> tuple[str, ...]:
    """Files of the runner itself (never mutated; the verifier restores them like tests)."""
    if self.runner in ("pytest", "unittest"):  # unittest's runner is the standard library's
      return ()
    return (self.script, *RUNNER_FILES.get(self.runner, ()))


def _report_chars(args: Sequence[str]) -> Optional[str]:
  """The characters of pytest's last -r option in `args`, or None when there is none."""
  chars = None
  for i, a in enumerate(args):
    if a == "-r" and i + 1 < len(args):
      chars = args[i + 1]
    elif a.startswith("-r") and len(a) > 2:
      chars = a[2:]
    elif a.startswith("--report-chars="):  # never abbreviated by the rows synthesis writes
      chars = a.split("=", 1)[1]
  return chars


def parse_test_command(command: str, log_parser: str = "") -> TestCommand:
  """The test command of a synthesis (module docstring).

  Args:
    command: the user's command, run in the repository's root.
    log_parser: a swebench log parser name; "" infers "parse_log_pytest" for a pytest command
      and "parse_log_django" for a `python3 -m unittest` one.

  Returns:
    The command (for pytest, with "-rA" added after "pytest" when it has no -r option).

  Raises:
    ValueError: naming `log_parser` (unknown, or missing for a command that is neither pytest
      nor unittest) or `test_command` (one the verifier cannot run with that parser, or whose
      -r option hides passing tests from the log).
  """
  try:
    words = shlex.split(command)
  except ValueError as e:
    raise ValueError(f"test_command={command!r}: {e}") from None
  is_pytest = words[:1] in (["pytest"], ["py.test"]) or words[1:3] == ["-m", "pytest"]
  unittest = is_unittest_command(command)
  if not log_parser and unittest:
    log_parser = UNITTEST_PARSER
  if not log_parser:
    if not is_pytest:
      raise ValueError(f"log_parser='': test_command={command!r} is not a pytest command; name "
                       f"the swebench log parser that reads its output, one of "
                       f"{sorted(LOG_PARSERS)}")
    log_parser = PYTEST_PARSER
  if log_parser not in LOG_PARSERS:
    raise ValueError(f"log_parser={log_parser!r}: expected one of {sorted(LOG_PARSERS)} (the "
                     "Python parsers of swebench's table that the verifier can grade)")
  runner = LOG_PARSERS[log_parser]
  if unittest and log_parser == UNITTEST_PARSER:
    env, python, args = unittest_command(command)
    return TestCommand(command, log_parser, "unittest", python, tuple(args), "", env)
  if runner == "pytest":
    try:
      python, args = pytest_command(command)
    except ValueError as e:
      raise ValueError(f"test_command: log_parser={log_parser!r} reads pytest logs: {e}") from None
    chars = _report_chars(args)
    if chars is None:
      at = 1 if words[0] in ("pytest", "py.test") else 3
      words = words[:at] + ["-rA"] + words[at:]
      command = shlex.join(words)
      args = ["-rA", *args]
    elif "A" not in chars:
      raise ValueError(f"test_command={command!r}: its -r option {chars!r} leaves passing tests "
                       "out of the short summary that swebench's pytest parsers read; use -rA "
                       "or leave -r out")
    return TestCommand(command, log_parser, runner, python, tuple(args))
  try:
    env, python, script, args = script_command(command)
  except ValueError as e:
    module = " (of 'python -m MODULE' commands the verifier runs 'python3 -m unittest' only, " \
             f"read by {UNITTEST_PARSER!r})" if "-m" in words else ""
    raise ValueError(f"test_command: log_parser={log_parser!r} reads the log of a runner script "
                     f"of the repository{module}: {e}") from None
  return TestCommand(command, log_parser, runner, python, tuple(args), script, env)


def node_statuses(statuses: Mapping[tuple[str, str], str],
                  paths: Sequence[str]) -> dict[str, str]:
  """pytest node ids of a JUnit report's tests, as `junit_key` maps them back.

  Args:
    statuses: {(classname, name): status} of `run_pytest`.
    paths: the tree's files (a classname is the longest dotted .py path it starts with).

  Returns:
    {node id: status}; tests whose id cannot be rebuilt exactly (a collection error's entry)
    are left out.
  """
  modules = {p[:-3].replace("/", "."): p for p in paths if p.endswith(".py")}
  out = {}
  for (classname, name), status in statuses.items():
    parts = classname.split(".") if classname else []
    for i in range(len(parts), 0, -1):
      module = ".".join(parts[:i])
      if module in modules:
        node = "::".join([modules[module], *parts[i:], name])
        if junit_key(node) == (classname, name):
          out[node] = status
        break
  return out


def test_file(test: str, runner: str, paths: Sequence[str]) -> Optional[str]:
  """The file holding a test, from its id; None when the id does not say.

  pytest: the node id's path. unittest's verbose names ("test_x (pkg.tests.test_a.TestA)",
  "test_x (pkg.tests.test_a.TestA.test_x)"): the longest dotted prefix inside the parentheses
  that is a module of `paths`, looked for also under tests/ (Django's labels are relative to
  it). Other ids (sympy's bare function names): None.
  """
  if runner == "pytest":
    return test.split("::", 1)[0]
  m = re.search(r"\(([\w.]+)\)$", test)
  if not m:
    return None
  parts = m.group(1).split(".")
  files = set(paths)
  for i in range(len(parts), 0, -1):
    base = "/".join(parts[:i])
    for candidate in (f"{base}.py", f"{base}/__init__.py", f"tests/{base}.py"):
      if candidate in files:
        return candidate
  return None


test_file.__test__ = False  # a library function, not a pytest test


async def _sandbox(make_sandbox: SandboxMaker) -> Sandbox:
  sb = make_sandbox()
  return await sb if inspect.isawaitable(sb) else sb


async def run_suite(make_sandbox: SandboxMaker, files: Mapping[str, bytes], command: TestCommand,
                    timeout: float) -> tuple[RunResult, dict[str, str], float]:
  """Runs the test command on `files` in a fresh sandbox (closed afterwards).

  Args:
    make_sandbox: fresh sandboxes.
    files: the tree.
    command: the test command.
    timeout: seconds for the run.

  Returns:
    (the run, {test id: status}: pytest node ids or the log parser's names, its seconds).
  """
  start = time.monotonic()
  sb = await _sandbox(make_sandbox)
  try:
    for path, data in files.items():
      await sb.write_file(path, data)
    if command.runner == "pytest":
      run = await run_pytest(sb, list(command.args), timeout, command.python)
    else:
      run = await run_log_tests(sb, command.runner, command.script, list(command.args), timeout,
                                command.python, command.env)
  finally:
    await sb.close()
  if command.runner == "pytest":
    statuses = node_statuses(run.statuses, sorted(files))
  else:
    statuses = dict(run.statuses)
  return run, statuses, time.monotonic() - start
