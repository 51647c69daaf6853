"""SWE-bench's grading rules, and the test logs of Django's, sympy's and unittest's runners.

Statuses are the lowercase names of swebench's `TestStatus`: passed, failed, skipped, error,
xfail. Two more come from JUnit reports (`envs.verifiers.swe.parse_junit`) and are graded as
if the test were missing from the log: "xpass" (a non-strict xfail test that passed, which
SWE-bench's pytest log parser does not record) and "xfail_unmarked" (an xfail raised by a
`pytest.xfail()` call in a test without an xfail marker: code under test could make that call
to turn a failing test into an expected failure).

`grade` applies the rules of `swebench.harness.grading` (swebench >= 5):
- FAIL_TO_PASS: a success iff passed or xfail; a failure iff failed, error, skipped or missing.
- PASS_TO_PASS: a success iff passed, xfail or skipped (a skip is no regression); a failure iff
  failed, error or missing.
- An id truncated inside its parameters (more "[" than "]", as 676 SWE-bench Verified ids
  are) matches the tests it prefixes when they agree on passing.
- Resolved iff every test of both lists is a success.
`log_is_consistent` is SWE-bench's check against forged logs: a run that exits non-zero while
its log reports no failing test is not trusted.

What a log parser can record depends on the runner. SWE-bench's pytest parsers read the "-rA"
short summary, whose lines name a test for PASSED, FAILED, ERROR and XFAIL only: a skipped
test's line names a file and line ("SKIPPED [1] tests/t.py:7: why") and an XPASS line is not
read, so for pytest tasks a skipped or xpassed test is missing to SWE-bench (a PASS_TO_PASS
test that a patch makes skip, for instance with a `pytest.skip()` call in code under test, is a
failure). `grade` and `find_status` take the recorded statuses (`RECORDED[runner]`) and grade
any other status as missing, keeping its name in the details.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Mapping, Optional, Sequence

PASSED, FAILED, SKIPPED, ERROR, XFAIL = "passed", "failed", "skipped", "error", "xfail"
XPASS, XFAIL_UNMARKED = "xpass", "xfail_unmarked"
MISSING = "missing"  # what the details say for a test absent from the run's results
SWEBENCH_STATUSES = frozenset({PASSED, FAILED, SKIPPED, ERROR, XFAIL})
# The statuses SWE-bench's parser of each runner's log records under a test's name.
PYTEST_RECORDED = frozenset({PASSED, FAILED, ERROR, XFAIL})
RECORDED = {"pytest": PYTEST_RECORDED, "django": SWEBENCH_STATUSES, "sympy": SWEBENCH_STATUSES,
            "unittest": SWEBENCH_STATUSES}
_PASSING = frozenset({PASSED, XFAIL})


# ----------------------------------------------------------------------------- Django


# Verbose unittest lines of Django's tests/runtests.py and of `python -m unittest -v` (the
# same TextTestRunner): "NAME ... ok" (NAME is
# "test_x (module.Class)", "test_x (module.Class.test_x)" on Python >= 3.11, or a docstring's
# first line), "... skipped 'why'", "... FAIL", "... ERROR", and the "FAIL: NAME" /
# "ERROR: NAME" headers of the tracebacks after the run.
_DJANGO_OK = (" ... ok", " ... OK", " ...  OK")
# Output printed between "NAME ..." and "ok" that SWE-bench recognises (the test passed).
_DJANGO_INTERRUPTED = (
    re.compile(r"^(.*?)\s\.\.\.\sTesting\ against\ Django\ installed\ in\ ((?s:.*?))\ silenced"
               r"\)\.\nok$", re.M),
    re.compile(r"^(.*?)\s\.\.\.\sInternal\ Server\ Error:\ \/(.*)\/\nok$", re.M),
    re.compile(r"^(.*?)\s\.\.\.\sSystem check identified no issues \(0 silenced\)\nok$", re.M),
)
_DJANGO_VERSION_TEST = "--version is equivalent to version"  # an id whose output spans lines
_DJANGO_7188_PREFIX = "Applying sites.0002_alter_domain_unique...test_no_migrations"


def parse_django_log(log: str) -> dict[str, str]:
  """Per-test statuses of a Django runtests.py or `python -m unittest -v` log, as SWE-bench's
  django parser reads it (an "expected failure" or "unexpected success" line is not recorded).

  Args:
    log: the runner's output (stdout and stderr together).

  Returns:
    {test name: status}; a later line about the same test overrides an earlier one.
  """
  out: dict[str, str] = {}
  last = None  # the test whose "NAME ..." line came last: a bare "ok" line is its result
  for line in (raw.strip() for raw in log.split("\n")):
    if _DJANGO_VERSION_TEST in line:
      out[_DJANGO_VERSION_TEST] = PASSED
    if " ... " in line:
      last = line.split(" ... ")[0]
    ok = next((s for s in _DJANGO_OK if line.endswith(s)), None)
    if ok:
      if line.startswith(_DJANGO_7188_PREFIX):  # a migration message glued to the name
        line = line.split("...", 1)[-1].strip()
      out[line.rsplit(ok, 1)[0]] = PASSED
    if " ... skipped" in line:
      out[line.split(" ... skipped")[0]] = SKIPPED
    for word, status in (("FAIL", FAILED), ("ERROR", ERROR)):
      if line.endswith(f" ... {word}"):
        out[line.split(f" ... {word}")[0]] = status
      if line.startswith(f"{word}:") and len(line.split()) > 1:
        out[line.split()[1]] = status
    if line.startswith("ok") and last is not None:
      out[last] = PASSED
  for pattern in _DJANGO_INTERRUPTED:
    for m in pattern.finditer(log):
      out[m.group(1)] = PASSED
  return out


# ----------------------------------------------------------------------------- sympy

# sympy's bin/test --verbose prints "test_name ok" / "test_name F" / "test_name E" per test and a
# "____ path.py:test_name ____" header above each failure's traceback.
_SYMPY_FAILURE = re.compile(r"(_*) (.*)\.py:(.*) (_*)")


def parse_sympy_log(log: str) -> dict[str, str]:
  """Per-test statuses of a sympy bin/test log, as SWE-bench's sympy parser reads it.

  Args:
    log: the runner's output.

  Returns:
    {test name: status} ("path.py:name" keys come from failure headers).
  """
  out = {f"{m[1]}.py:{m[2]}": FAILED for m in _SYMPY_FAILURE.findall(log)}
  for line in (raw.strip() for raw in log.split("\n")):
    if not line.startswith("test_"):
      continue
    for suffix, status in ((" E", ERROR), (" F", FAILED), (" ok", PASSED)):
      if line.endswith(suffix):
        out[line.split()[0]] = status
  return out


LOG_PARSERS: dict[str, Callable[[str], dict[str, str]]] = {
    "django": parse_django_log, "sympy": parse_sympy_log, "unittest": parse_django_log}


# ----------------------------------------------------------------------------- grading


def find_status(test: str, statuses: Mapping[str, str],
                recorded: frozenset = SWEBENCH_STATUSES) -> Optional[str]:
  """The status of `test` in a run, or None when the run did not report it.

  An id cut off inside its parameters (more "[" than "]") and absent from the run takes the
  status of the tests it prefixes when they agree on passing vs not (recorded statuses only:
  the ones SWE-bench's log parser would have read).

  Args:
    test: a FAIL_TO_PASS / PASS_TO_PASS id.
    statuses: {id: status} of the run.
    recorded: the statuses the runner's log parser records (`RECORDED`).
  """
  status = statuses.get(test)
  if status in recorded:
    return status
  if test.count("[") > test.count("]"):
    matches = [s for k, s in statuses.items() if s in recorded and k.startswith(test)]
    if matches and len({s in _PASSING for s in matches}) == 1:
      return matches[0]
  return status


@dataclasses.dataclass
class Grade:
  """A run graded against a task's tests."""

  fail_to_pass: dict[str, str]  # test -> status ("missing" when absent)
  pass_to_pass: dict[str, str]
  successes: int                # tests graded a success
  total: int                    # tests graded (all of both lists)
  resolved: bool                # every test a success


def grade(fail_to_pass: Sequence[str], pass_to_pass: Sequence[str],
          status: Callable[[str], Optional[str]],
          recorded: frozenset = SWEBENCH_STATUSES) -> Grade:
  """Grades a run with SWE-bench's rules (module docstring).

  Args:
    fail_to_pass: the task's FAIL_TO_PASS ids.
    pass_to_pass: the task's PASS_TO_PASS ids.
    status: test id -> its status in the run, or None when missing (`find_status`).
    recorded: the statuses the runner's log parser records (`RECORDED`); any other status
      (xpass, xfail_unmarked; skipped for pytest) grades as missing.

  Returns:
    The grade; its per-test dicts keep the statuses' names.
  """
  f2p = {t: status(t) or MISSING for t in fail_to_pass}
  p2p = {t: status(t) or MISSING for t in pass_to_pass}
  good = ([s in _PASSING & recorded for s in f2p.values()]
          + [s in (_PASSING | {SKIPPED}) & recorded for s in p2p.values()])
  return Grade(f2p, p2p, sum(good), len(good), all(good))


def successes(result: Grade, recorded: frozenset = SWEBENCH_STATUSES
              ) -> dict[str, dict[str, list[str]]]:
  """A grade as SWE-bench's report lists it: {"FAIL_TO_PASS": {"success": [...], "failure":
  [...]}, "PASS_TO_PASS": {...}}, each list in the task's order.

  Args:
    result: the grade.
    recorded: the statuses it was graded with (`grade`).
  """
  out = {}
  for key, tests, ok in (("FAIL_TO_PASS", result.fail_to_pass, _PASSING & recorded),
                         ("PASS_TO_PASS", result.pass_to_pass,
                          (_PASSING | {SKIPPED}) & recorded)):
    out[key] = {"success": [t for t, s in tests.items() if s in ok],
                "failure": [t for t, s in tests.items() if s not in ok]}
  return out


def log_is_consistent(exit_code: Optional[int], statuses: Mapping[str, str],
                      recorded: frozenset = SWEBENCH_STATUSES) -> bool:
  """False when the run exited non-zero yet its results show no failed or erroring test.

  Args:
    exit_code: the test command's exit status (None: unknown).
    statuses: {id: status} of the run.
    recorded: the statuses the runner's log parser records: SWE-bench checks the tests its
      parser read, so a run that recorded none is not judged here.
  """
  seen = [s for s in statuses.values() if s in recorded]
  return exit_code in (None, 0) or not seen or any(s in (FAILED, ERROR) for s in seen)
