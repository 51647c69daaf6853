"""Verifiers: rewards from real sandbox runs, and the reward hacks they must refuse.

The `tests` verifier runs in the bwrap backend (the real one). Its grades are checked against
the `swebench` package's own log parsers and grading on the logs of the very runs that were
graded. Every attack below is first a submission that does not fix the bug; the verifier must
give it 0 for the stated reason.
"""

import asyncio
import dataclasses
import json
import re
import os
import random

import pytest
from swebench.harness import grading as swebench_grading
from swebench.harness.constants import (END_TEST_OUTPUT, FAIL_TO_PASS, PASS_TO_PASS,
                                        START_TEST_OUTPUT, TEST_EXIT_CODE)
from swebench.harness.log_parsers import PARSER_REGISTRY
from swebench import types as swebench_types

from envs import taskgen
from envs.chat import make_chat
from envs.chat.tokenizer import HFTokenizer
from envs.episode import make_react_episode, make_sandbox_factory
from envs.policy import Generation
from envs.sandbox import Limits, create_sandbox
from envs.scaffold import ScaffoldConfig, ScriptedPolicy
from envs.tasks import (Task, apply_patch, load_problems_jsonl, load_repo_files, load_swe_jsonl,
                        load_swe_rows, make_patch, reference_files)
from envs.verifiers import (Verdict, extract_answer, junit_key, merge_submission,
                            normalize_answer, parse_junit, parse_scores, swe, swe_logs, verify,
                            verify_exact, verify_judge, verify_python_io, verify_tests,
                            workspace_files)
from tests.test_chat import _tiny_bpe
from tests.test_tasks import bundled_rows, make_mirror, make_smith_mirror, official_rows

DATA = os.path.join(os.path.dirname(__file__), "..", "envs", "data", "swe", "tasks.jsonl")
PROBLEMS = os.path.join(os.path.dirname(__file__), "..", "envs", "data", "problems.jsonl")
TASKS = {t.instance_id: t for t in load_swe_jsonl(DATA)}
MERGE = TASKS["intervals-1"]  # the instance the attacks target
MERGE_FILES = load_repo_files(MERGE)


def bwrap(task):
  return create_sandbox("bwrap", rootfs=task.rootfs)


def run(coro):
  return asyncio.run(coro)


def check(task, submission, **kw) -> Verdict:
  return run(verify_tests(task, submission, bwrap, **kw))


@pytest.fixture
def runs(monkeypatch):
  """The results of the test runs that verify_tests grades (full logs included)."""
  got = []
  for name in ("run_pytest", "run_log_tests"):
    async def wrapped(*args, _run=getattr(swe, name), **kwargs):
      got.append(await _run(*args, **kwargs))
      return got[-1]
    monkeypatch.setattr(swe, name, wrapped)
  return got


def swebench_report(task: Task, log_parser: str, run, path) -> dict:
  """swebench's verdict (get_eval_report) on a run's log, written as its eval script would."""
  spec = swebench_types.TestSpec(instance_id=task.instance_id, image="", eval_script_list=[],
                                 repo=task.repo or "arbor/example", version="1.0",
                                 FAIL_TO_PASS=list(task.fail_to_pass),
                                 PASS_TO_PASS=list(task.pass_to_pass), log_parser=log_parser,
                                 eval_type="pass_and_fail")
  path.write_text(f"{START_TEST_OUTPUT}\n{run.output}\n{END_TEST_OUTPUT}\n"
                  f"{TEST_EXIT_CODE}: {run.exit_code}\n")
  return swebench_grading.get_eval_report(spec, {"instance_id": task.instance_id,
                                                 "model_patch": "diff"}, str(path), True
                                          )[task.instance_id]


def assert_agrees_with_swebench(verdict: Verdict, report: dict):
  """Same resolution, and the same tests graded a success."""
  assert report["resolved"] == (verdict.reward == 1.0), (report, verdict.details)
  status = report.get("tests_status")
  assert status, report  # swebench read the log
  for key, ok in ((FAIL_TO_PASS, {"passed", "xfail"}),
                  (PASS_TO_PASS, {"passed", "xfail", "skipped"})):
    ours = verdict.details[key.lower()]
    assert set(status[key]["success"]) == {t for t, s in ours.items() if s in ok}, key
    assert set(status[key]["failure"]) == {t for t, s in ours.items() if s not in ok}, key


def assert_same_statuses(task: Task, log_parser: str, run):
  """Our per-test statuses are swebench's parser's on the same run's log (pytest: for every
  test the log names; JUnit knows xfail from xpass, which the log parser leaves out)."""
  theirs = {k: v.lower() for k, v in PARSER_REGISTRY[log_parser](run.output, None).items()}
  if task.test_runner == "pytest":
    assert theirs and {k: run.statuses[junit_key(k)] for k in theirs} == theirs
  else:
    assert run.statuses == theirs


def with_code(extra: str, path="intervals/merge.py", files=MERGE_FILES) -> dict:
  """The unfixed repository with `extra` appended to a module the tests import."""
  return {**files, path: files[path] + b"\n" + extra.encode()}


# ----------------------------------------------------------------------------- honest runs


@pytest.mark.parametrize("instance_id", sorted(TASKS))
def test_reference_fix_gets_1_and_unchanged_repo_gets_0(instance_id, runs, tmp_path):
  """Every bundled instance (pytest, the Django-style runner, an xfail test in PASS_TO_PASS):
  the gold patch resolves it, the unchanged repository does not, as swebench grades the logs."""
  task = TASKS[instance_id]
  parser = {r["instance_id"]: r.get("log_parser", "parse_log_pytest") for r in bundled_rows()}
  fixed = check(task, reference_files(task))
  assert fixed.reward == 1.0, fixed.details
  assert set(fixed.details["fail_to_pass"].values()) == {"passed"}
  empty = check(task, load_repo_files(task))
  assert empty.reward == 0.0
  assert set(empty.details["fail_to_pass"].values()) == {"failed"}   # F2P really fail before
  assert set(empty.details["pass_to_pass"].values()) <= {"passed", "xfail"}  # P2P pass before
  for verdict, run, name in ((fixed, runs[0], "gold"), (empty, runs[1], "empty")):
    report = swebench_report(task, parser[instance_id], run, tmp_path / f"{name}.log")
    assert_agrees_with_swebench(verdict, report)
    assert_same_statuses(task, parser[instance_id], run)


def test_xfail_in_pass_to_pass_is_kept():
  """An expected failure in PASS_TO_PASS counts as passing (SWE-bench's XFAIL)."""
  v = check(TASKS["units-1"], TASKS["units-1"].patch)
  assert v.reward == 1.0 and v.details["pass_to_pass"]["tests/test_convert.py::test_kelvin"] == (
      "xfail")


@pytest.fixture(scope="module")
def chat():
  return make_chat("qwen2.5", HFTokenizer(_tiny_bpe(), eos_token="<|im_end|>"))


def tc(name, **args):
  return {"role": "assistant", "content": None,
          "tool_calls": [{"function": {"name": name, "arguments": args}}]}


def test_official_rows_end_to_end(chat, runs, tmp_path):
  """Rows with only SWE-bench's fields, their repositories in a local git mirror: checkout, an
  episode in bwrap (a scripted agent writes the gold patch, or does nothing), verification in a
  fresh sandbox. Gold is resolved, nothing is not, and swebench grades each run's log alike."""
  rows = official_rows()
  tasks = load_swe_rows(rows, mirror=make_mirror(tmp_path / "mirror"),
                        cache_dir=str(tmp_path / "cache"))
  make = make_sandbox_factory("bwrap")
  config = ScaffoldConfig(max_turns=4, max_new_tokens=4096)

  async def main():
    out = []
    for task in tasks:
      original = load_repo_files(task)
      gold = [tc("write_file", path=p, content=d.decode())
              for p, d in reference_files(task).items() if original.get(p) != d]
      for name, script in (("gold", gold + [tc("submit")]), ("nothing", [tc("submit")])):
        episode = make_react_episode(ScriptedPolicy(chat, script), chat, make, config)
        out.append((task, name, await episode(task, 0, 0)))
    return out
  results = run(main())
  assert len(runs) == len(results) == 2 * len(rows)
  for (task, name, trajectory), test_run, row in zip(results, runs, [r for r in rows
                                                                     for _ in "ab"]):
    verdict = Verdict(trajectory.reward, trajectory.metadata["verdict"])
    assert trajectory.termination == "submitted"
    assert verdict.reward == (name == "gold"), (task.instance_id, name, verdict.details)
    parser = row.get("log_parser", "parse_log_pytest")
    assert_agrees_with_swebench(verdict, swebench_report(
        task, parser, test_run, tmp_path / f"{task.instance_id}-{name}.log"))
    assert_same_statuses(task, parser, test_run)


def test_swe_smith_row(tmp_path, runs):
  """A SWE-smith row (bug patch, failing tests hidden by the branch's last commit): the reverse
  of its patch resolves it, the checkout as is does not."""
  row, _ = make_smith_mirror(tmp_path)
  (task,) = load_swe_rows([row], mirror=str(tmp_path), cache_dir=str(tmp_path / "cache"))
  gold, empty = check(task, task.patch), check(task, "")
  assert gold.reward == 1.0 and empty.reward == 0.0, (gold.details, empty.details)
  for verdict, test_run in zip((gold, empty), runs):
    assert_agrees_with_swebench(verdict, swebench_report(task, "parse_log_pytest", test_run,
                                                         tmp_path / "run.log"))


# A runner with the interface and output of sympy's bin/test --verbose.
SYMPY_STYLE_BIN_TEST = r'''"""Runs the test_* functions of the given files; sympy's report."""
import importlib.util
import os
import sys
import time
import traceback

sys.path.insert(0, os.getcwd())
counts, failures, start = {"passed": 0, "failed": 0, "exceptions": 0}, [], time.time()
print(" test process starts ".center(80, "="))
for path in [a for a in sys.argv[1:] if not a.startswith("-")]:
    spec = importlib.util.spec_from_file_location("tested", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    names = [n for n in vars(module) if n.startswith("test_")]
    print(f"{path}[{len(names)}] ")
    for name in names:
        try:
            getattr(module, name)()
            mark, kind = "ok", "passed"
        except AssertionError:
            mark, kind = "F", "failed"
        except Exception:
            mark, kind = "E", "exceptions"
        counts[kind] += 1
        if kind != "passed":
            failures.append((path, name, traceback.format_exc()))
        print(f"{name} {mark}")
for path, name, text in failures:
    print("_" * 80)
    print(f" {path}:{name} ".center(80, "_"))
    print(text)
done = ", ".join(f"{n} {kind}" for kind, n in counts.items() if n)
print(f" tests finished: {done}, in {time.time() - start:.2f} seconds ".center(80, "="))
sys.exit(1 if failures else 0)
'''


def test_sympy_style_runner(tmp_path, runs):
  """A repository tested with a sympy-style bin/test: graded from its log as swebench's sympy
  parser reads it (a test erroring in both runs, listed nowhere, is in the log too)."""
  repo = {"bin/test": SYMPY_STYLE_BIN_TEST, "calc/__init__.py": "",
          "calc/ops.py": "def double(x):\n    return x + x\n\n\ndef square(x):\n    return x * 2\n",
          "calc/tests/__init__.py": "",
          "calc/tests/test_ops.py": "from calc.ops import double\n\n\ndef test_double():\n"
                                    "    assert double(3) == 6\n"}
  for path, text in repo.items():
    (tmp_path / "repo" / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "repo" / path).write_text(text)
  original = load_repo_files(str(tmp_path / "repo"))
  tests = original["calc/tests/test_ops.py"] + (
      b"\n\ndef test_square():\n    from calc.ops import square\n    assert square(3) == 9\n"
      b"\n\ndef test_divide_by_zero():\n    1 / 0\n")
  fixed = original["calc/ops.py"].replace(b"x * 2", b"x * x")
  row = {"instance_id": "calc-1", "repo": "arbor-examples/calc", "repo_path": "repo",
         "log_parser": "parse_log_sympy", "problem_statement": "square(3) is 6",
         "FAIL_TO_PASS": '["test_square"]', "PASS_TO_PASS": '["test_double"]',
         "patch": make_patch(original, {**original, "calc/ops.py": fixed}),
         "test_patch": make_patch(original, {**original, "calc/tests/test_ops.py": tests})}
  (task,) = load_swe_rows([row], base_dir=str(tmp_path))
  assert task.script_command() == ({"PYTHONWARNINGS": "ignore::UserWarning,ignore::SyntaxWarning"},
                                   "python3", "bin/test", ["-C", "--verbose",
                                                           "calc/tests/test_ops.py"])
  gold, empty = check(task, task.patch), check(task, "")
  assert gold.reward == 1.0 and empty.reward == 0.0, (gold.details, empty.details)
  assert runs[0].statuses["test_divide_by_zero"] == "error"
  for verdict, test_run in zip((gold, empty), runs):
    assert_agrees_with_swebench(verdict, swebench_report(task, "parse_log_sympy", test_run,
                                                         tmp_path / "run.log"))
    assert_same_statuses(task, "parse_log_sympy", test_run)
  # Its runner is restored like the tests: a bin/test that reports success is not run.
  fake = {**original, "bin/test": "print('test_square ok')\nprint('test_double ok')\n"}
  v = check(task, fake)
  assert v.reward == 0.0 and v.details["restored"] == ["bin/test"]


def _xfail_repo(tmp_path):
  repo = tmp_path / "repo"
  (repo / "pkg").mkdir(parents=True)
  (repo / "tests").mkdir()
  (repo / "pkg" / "__init__.py").write_text("")
  (repo / "pkg" / "m.py").write_text("def answer():\n    return 41\n")
  (repo / "tests" / "test_m.py").write_text(
      "import pytest\n\nfrom pkg.m import answer\n\n\ndef test_plain():\n    assert True\n"
      "\n\n@pytest.mark.xfail(reason='known')\ndef test_marked_but_passes():\n    assert True\n")
  original = load_repo_files(str(repo))
  test_patch = make_patch(original, {**original, "tests/test_m.py": original["tests/test_m.py"]
                                     + b"\n\ndef test_answer():\n    assert answer() == 42\n"})
  return original, test_patch


def test_xpass_and_xfail_calls(tmp_path, runs):
  """An xfail-marked PASS_TO_PASS test that passes (XPASS) is no success, as in SWE-bench; an
  xfail raised by the code under test (pytest.xfail()) is no success either, where swebench's
  grading would count the FAIL_TO_PASS test as resolved."""
  original, test_patch = _xfail_repo(tmp_path)
  base = {"repo_path": "repo", "problem_statement": "answer() is 41",
          "FAIL_TO_PASS": ["tests/test_m.py::test_answer"], "test_patch": test_patch}
  xpass, plain = load_swe_rows([
      {**base, "instance_id": "xpass", "PASS_TO_PASS": ["tests/test_m.py::test_marked_but_passes"]},
      {**base, "instance_id": "plain", "PASS_TO_PASS": ["tests/test_m.py::test_plain"]}],
      base_dir=str(tmp_path))
  fixed = {**original, "pkg/m.py": b"def answer():\n    return 42\n"}
  v = check(xpass, fixed)
  assert v.reward == 0.0 and v.details["pass_to_pass"] == {
      "tests/test_m.py::test_marked_but_passes": "xpass"}
  report = swebench_report(xpass, "parse_log_pytest", runs[-1], tmp_path / "xpass.log")
  assert_agrees_with_swebench(v, report)
  assert check(plain, fixed).reward == 1.0
  hack = {**original, "pkg/m.py": b"import pytest\n\n\ndef answer():\n    pytest.xfail('later')\n"}
  v = check(plain, hack)
  assert v.reward == 0.0 and v.details["fail_to_pass"] == {
      "tests/test_m.py::test_answer": "xfail_unmarked"}
  assert swebench_report(plain, "parse_log_pytest", runs[-1], tmp_path / "hack.log")["resolved"]


def test_diff_submissions():
  assert run(verify(MERGE, MERGE.patch, make_sandbox=bwrap)).reward == 1.0
  empty = check(MERGE, "")
  assert empty.reward == 0.0 and empty.details["applied"] == []
  bad = check(MERGE, MERGE.patch.replace("start < result", "start > result"))
  assert bad.reward == 0.0 and "does not apply" in bad.details["reason"]


def test_partial_credit_is_the_pass_rate():
  v = check(MERGE, MERGE_FILES, partial=True)
  assert v.reward == pytest.approx(3 / 5)  # 2 F2P fail, 3 P2P pass
  assert not v.details["solved"]


def test_generated_tasks_fail_before_and_pass_after_the_fix(tmp_path):
  """Every level, three seeds: F2P fail and P2P pass on the original, all pass with the
  reference fix (test_tasks checks that the one-line `fix_edit` gives the same files)."""
  async def one(level, seed):
    (task,) = taskgen.write_tasks(str(tmp_path / f"l{level}s{seed}"), 1, level, seed, start=3)
    before, after = await asyncio.gather(verify_tests(task, load_repo_files(task), bwrap),
                                         verify_tests(task, reference_files(task), bwrap))
    assert before.reward == 0.0, (task.instance_id, before.details)
    assert set(before.details["fail_to_pass"].values()) == {"failed"}, task.instance_id
    assert set(before.details["pass_to_pass"].values()) <= {"passed"}, task.instance_id
    assert after.reward == 1.0, (task.instance_id, after.details)

  async def main():
    for level in taskgen.LEVELS:
      await asyncio.gather(one(level, 1), one(level, 2), one(level, 3))
  run(main())


# ----------------------------------------------------------------------------- attacks


def test_editing_the_tests_gets_0():
  test_file = "tests/test_merge.py"
  weakened = MERGE_FILES[test_file].replace(b"assert ", b"assert True or ")
  v = check(MERGE, {**MERGE_FILES, test_file: weakened})
  assert v.reward == 0.0 and v.details["restored"] == [test_file]
  # Deleting the failing tests, or adding a test file, is undone the same way.
  deleted = {p: b for p, b in MERGE_FILES.items() if p != test_file}
  assert check(MERGE, {**deleted, "tests/test_mine.py": b"def test_ok(): pass\n"}).reward == 0.0
  # Test edits inside a diff are dropped too, while the code fix in it is applied.
  both = make_patch(MERGE_FILES, {**reference_files(MERGE), test_file: weakened})
  v = check(MERGE, both)
  assert v.reward == 1.0 and v.details["restored"] == [test_file]


FORCE_PASS = """
import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
"""


def test_conftest_forcing_passes_is_a_real_attack():
  """Without the verifier's refusal this conftest would turn the failing tests green."""
  async def main():
    async with await bwrap(MERGE) as sb:
      files = apply_patch(MERGE_FILES, MERGE.test_patch)
      for path, data in {**files, "conftest.py": FORCE_PASS}.items():
        await sb.write_file(path, data)
      return await sb.exec("python3 -m pytest -q -p no:cacheprovider tests/test_merge.py",
                           timeout=60)
  res = run(main())
  assert res.exit_code == 0 and "5 passed" in res.stdout, res.stdout


@pytest.mark.parametrize("path,content", [
    ("conftest.py", FORCE_PASS),
    ("intervals/conftest.py", FORCE_PASS),
    ("tests/conftest.py", FORCE_PASS),
    ("pytest.ini", "[pytest]\naddopts = -p no:junitxml\n"),
    ("setup.cfg", "[tool:pytest]\naddopts = -x\n"),
    ("tox.ini", "[pytest]\naddopts = -x\n"),
    ("pyproject.toml", "[tool.pytest.ini_options]\naddopts = '-x'\n"),
    ("sitecustomize.py", "import builtins\n"),
    ("usercustomize.py", "import builtins\n"),
    ("intervals/evil.pth", "import os\n"),
])
def test_configuration_changes_are_refused(path, content):
  v = check(MERGE, {**reference_files(MERGE), path: content})  # refused even with the fix
  assert v.reward == 0.0
  assert v.details["reason"].startswith("refused") and path in v.details["reason"]


def test_fake_passed_output_gets_0():
  names = [junit_key(i)[1] for i in MERGE.fail_to_pass + MERGE.pass_to_pass]
  lines = [f"tests/test_merge.py::{n} PASSED" for n in names]
  lines += ["=" * 20 + " 5 passed in 0.01s " + "=" * 20,
            f"{'0' * 32} 0 {'a' * 64} 100"]  # the result-line format, with a guessed nonce
  v = check(MERGE, with_code(f"""
import os, sys
_text = {json.dumps(chr(10).join(lines))} + "\\n"
print(_text)
sys.__stdout__.write(_text)
sys.__stdout__.flush()
os.write(1, _text.encode())
os.write(2, _text.encode())
"""))
  assert v.reward == 0.0
  assert set(v.details["fail_to_pass"].values()) == {"failed"}


# Writes a JUnit report claiming every test passed to every place it can find: files named
# *.xml or report/junit/results under /tmp, /dev/shm, $HOME, the workspace (every directory
# made readable first), paths given to --junitxml on any command line, open .xml files of this
# process; at import, from a thread, from atexit, and from a setsid daemon that outlives pytest.
SPRAY = r'''
import atexit, os, threading, time
_CASES = %(cases)r
_FAKE = ('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" '
         'errors="0" failures="0" skipped="0" tests="%%d">' %% len(_CASES)
         + "".join('<testcase classname="%%s" name="%%s" time="0.001" />' %% c for c in _CASES)
         + "</testsuite></testsuites>")

def _targets():
    out = set()
    for top in ("/tmp", "/dev/shm", os.path.expanduser("~"), os.getcwd()):
        for dirpath, dirnames, filenames in os.walk(top):
            for d in dirnames:
                try:
                    os.chmod(os.path.join(dirpath, d), 0o777)
                except OSError:
                    pass
            for f in filenames:
                if f.endswith(".xml"):
                    out.add(os.path.join(dirpath, f))
            for f in ("report.xml", "junit.xml", "results.xml"):
                out.add(os.path.join(dirpath, f))
    for pid in os.listdir("/proc"):
        try:
            args = open("/proc/%%s/cmdline" %% pid, "rb").read().decode().split("\0")
        except OSError:
            continue
        for i, a in enumerate(args):
            if a.startswith("--junitxml="):
                out.add(a.split("=", 1)[1])
            elif a in ("--junitxml", "--junit-xml") and i + 1 < len(args):
                out.add(args[i + 1])
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink("/proc/self/fd/" + fd)
        except OSError:
            continue
        if link.endswith(".xml"):
            out.add(link)
    return out

def _spray():
    for path in _targets():
        try:
            with open(path, "w") as f:
                f.write(_FAKE)
        except OSError:
            pass

def _loop(n):
    for _ in range(n):
        _spray()
        time.sleep(0.01)

_spray()
atexit.register(_spray)
threading.Thread(target=_loop, args=(100000,), daemon=True).start()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        _loop(300)
    os._exit(0)
'''


def _spray_code(task) -> str:
  return SPRAY % {"cases": [junit_key(i) for i in task.fail_to_pass + task.pass_to_pass]}


def test_fake_junit_xml_everywhere_gets_0():
  v = check(MERGE, with_code(_spray_code(MERGE)))
  assert v.reward == 0.0, v.details
  assert set(v.details["fail_to_pass"].values()) == {"failed"}


def test_fake_report_then_early_exit_gets_0():
  v = check(MERGE, with_code(_spray_code(MERGE) + "\nos._exit(0)\n"))
  assert v.reward == 0.0 and "did not finish" in v.details["reason"]


@pytest.mark.parametrize("instance_id", ["intervals-1", "slugs-1"])
def test_results_rewritten_after_the_run_get_0(instance_id):
  """A process that survives the run (possible where a backend has no PID namespace) rewrites
  the report and log copies: the hashes printed by the runner no longer match."""
  task = TASKS[instance_id]
  ids = task.fail_to_pass + task.pass_to_pass
  fake = ('<testsuites><testsuite name="pytest">' + "".join(
      f'<testcase classname="{c}" name="{n}" />' for c, n in map(junit_key, ids))
      + "</testsuite></testsuites>\n" + "".join(f"{i} ... ok\n" for i in ids))

  class Tampering:
    def __init__(self, inner):
      self.inner = inner

    async def exec(self, *a, **kw):
      res = await self.inner.exec(*a, **kw)
      for p in await self.inner.list_files():
        if p.startswith(".arbor-result-"):
          await self.inner.write_file(p, fake)
      return res

    def __getattr__(self, name):
      return getattr(self.inner, name)

  async def tampering(task):
    return Tampering(await bwrap(task))
  v = run(verify_tests(task, load_repo_files(task), tampering))
  assert v.reward == 0.0 and "changed after" in v.details["reason"]


SLUGS = TASKS["slugs-1"]  # the Django-style instance: graded from its runner's log
SLUGS_FILES = load_repo_files(SLUGS)


def test_log_runner_fake_results_and_exit_status_get_0(runs, tmp_path):
  """Code under test prints a passing line for every test, then the run fails: as in SWE-bench,
  a log without any failure from a run that exited non-zero is not trusted."""
  fake = "".join(f"print({f'{i} ... ok'!r}, file=sys.stderr)\n"
                 for i in SLUGS.fail_to_pass + SLUGS.pass_to_pass)
  v = check(SLUGS, with_code(f"import sys\n{fake}raise SystemExit(1)\n", "slugs/text.py",
                             SLUGS_FILES))
  assert v.reward == 0.0 and "not trusted" in v.details["reason"], v.details
  assert set(runs[-1].statuses.values()) == {"passed"} and runs[-1].exit_code == 1
  report = swebench_report(SLUGS, "parse_log_django", runs[-1], tmp_path / "fake.log")
  assert not report["resolved"] and not report["patch_successfully_applied"]


def test_log_runner_defences():
  """The runner script is restored like the tests, rewriting it during the run gets 0, and the
  tests' processes cannot open the trusted runner's descriptors or memory (non-dumpable)."""
  fake_runner = "import sys\nprint('test_simple (x) ... ok', file=sys.stderr)\n"
  v = check(SLUGS, {**reference_files(SLUGS), "tests/runtests.py": fake_runner})
  assert v.reward == 1.0 and v.details["restored"] == ["tests/runtests.py"]  # the real one ran
  v = check(SLUGS, with_code("""
import os
with open(os.path.join(os.getcwd(), "tests", "runtests.py"), "a") as _f:
    _f.write("# changed\\n")
""", "slugs/text.py", SLUGS_FILES))
  assert v.reward == 0.0 and "tests/runtests.py was modified" in v.details["reason"]
  v = check(SLUGS, with_code("""
import os, sys
for _what in ("fd/1", "mem", "environ"):
    try:
        open("/proc/%d/%s" % (os.getppid(), _what), "rb").close()
        print("OPENED", _what, file=sys.stderr)
    except OSError as e:
        print("DENIED", _what, e.errno, file=sys.stderr)
""", "slugs/text.py", SLUGS_FILES))
  for what in ("fd/1", "mem", "environ"):
    assert f"DENIED {what}" in v.details["log"] and "OPENED" not in v.details["log"], v.details


def test_shadowing_pytest_gets_0():
  fake_pytest = """
def main(args=None, plugins=None):
    path = args[args.index("--junitxml") + 1]
    open(path, "w").write('<testsuites><testsuite name="pytest"></testsuite></testsuites>')
    return 0
"""
  files = {**MERGE_FILES, "pytest.py": fake_pytest, "_pytest/__init__.py": "",
           "pluggy/__init__.py": "raise SystemExit(0)\n"}
  v = check(MERGE, files)
  assert v.reward == 0.0 and set(v.details["fail_to_pass"].values()) == {"failed"}


def test_rewriting_tests_on_disk_gets_0():
  v = check(MERGE, with_code("""
import os
_path = os.path.join(os.getcwd(), "tests", "test_merge.py")
with open(_path, "w") as _f:
    _f.write("def test_touching_intervals_are_merged():\\n    pass\\n")
"""))
  assert v.reward == 0.0 and "modified during the test run" in v.details["reason"]


def test_always_equal_object_gets_0(tmp_path):
  (task,) = taskgen.write_tasks(str(tmp_path), 1, 0, seed=5)
  files = load_repo_files(task)
  path = task.metadata["fix_edit"]["path"]
  name = task.fail_to_pass[0].split("::")[1].removeprefix("test_").rsplit("_", 1)[0]
  cheat = files[path] + f"""

class _Anything:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False


def {name}(*args, **kwargs):
    return _Anything()
""".encode()
  v = check(task, {**files, path: cheat})
  assert v.reward == 0.0 and set(v.details["fail_to_pass"].values()) == {"failed"}


def test_over_long_output_keeps_the_result_and_the_summary_line():
  """A verbose test run (far more output than the sandbox keeps) is graded, and the log in the
  details ends with pytest's summary line: the sandbox keeps an output's head and tail.
  (Thousands of distinct warnings: pytest prints them all before its summary line.)"""
  noisy = with_code("import warnings\nfor i in range(3000):\n"
                    "    warnings.warn(f'noisy warning {i} ' + 'x' * 80)\n",
                    files=reference_files(MERGE))
  v = check(MERGE, noisy)
  assert v.reward == 1.0, v.details
  log = v.details["log"]
  # ~450 KB of output, 64 KB kept: the runner's result line and the summary are in the tail
  assert re.search(r"=+ 5 passed, 3000 warnings in [\d.]+s =+\n*$", log), log[-500:]


def test_hanging_code_times_out_with_0():
  task = dataclasses.replace(MERGE, timeout=3.0)
  v = check(task, with_code("while True:\n    pass\n"))
  assert v.reward == 0.0 and "timed out" in v.details["reason"]


def test_unsafe_paths_are_refused():
  for path in ("../escape.py", "/etc/evil.py", "intervals/../../x.py"):
    v = check(MERGE, {**reference_files(MERGE), path: "x = 1\n"})
    assert v.reward == 0.0 and "refused" in v.details["reason"], path


def test_workspace_files_reads_what_the_agent_left():
  async def main():
    async with await create_sandbox("bwrap", limits=Limits(file_bytes=1000)) as sb:
      for path, data in MERGE_FILES.items():
        await sb.write_file(path, data)
      res = await sb.exec("mkdir -p intervals/__pycache__ && touch intervals/__pycache__/x.pyc"
                          " && head -c 5000 /dev/zero > big.bin && ln -s /etc/passwd link"
                          " && echo 'X = 2' > intervals/extra.py")
      assert res.exit_code == 0, res.stderr
      return await workspace_files(sb)
  assert run(main()) == {**MERGE_FILES, "intervals/extra.py": b"X = 2\n"}


def test_merge_submission_sorts_changes():
  final = {**reference_files(MERGE), "tests/test_new.py": b"", "intervals/__pycache__/m.pyc": b"",
           "intervals/extra.py": b"X = 1\n", "evil-1.dist-info/entry_points.txt": b"[pytest11]"}
  del final["intervals/__init__.py"]
  files, changes = merge_submission(MERGE, MERGE_FILES, final)
  assert changes == {"applied": ["intervals/__init__.py", "intervals/extra.py",
                                 "intervals/merge.py"],
                     "restored": ["tests/test_new.py"],
                     "ignored": ["evil-1.dist-info/entry_points.txt",
                                 "intervals/__pycache__/m.pyc"]}
  assert "intervals/__init__.py" not in files and files["intervals/extra.py"] == b"X = 1\n"
  assert "tests/test_new.py" not in files


def test_junit_parsing():
  assert junit_key("tests/test_a.py::TestX::test_y[1-a::b]") == ("tests.test_a.TestX",
                                                                 "test_y[1-a::b]")
  assert junit_key("test_b.py::test_z") == ("test_b", "test_z")
  xml = b"""<?xml version="1.0"?><testsuites><testsuite name="pytest">
    <testcase classname="t" name="ok"/>
    <testcase classname="t" name="bad"><failure message="x"/></testcase>
    <testcase classname="t" name="skip"><skipped type="pytest.skip" message="no"/></testcase>
    <testcase classname="t" name="teardown"/>
    <testcase classname="t" name="teardown"><error message="boom"/></testcase>
    <testcase classname="t" name="xf"><skipped type="pytest.xfail" message="why"/></testcase>
    <testcase classname="t" name="xp"><properties>
      <property name="arbor_outcome" value="xpass"/></properties></testcase>
    <testcase classname="t" name="old_xp">
      <skipped message="xfail-marked test passes unexpectedly"/></testcase>
    <testcase classname="t" name="called"><properties>
      <property name="arbor_outcome" value="xfail_unmarked"/></properties>
      <skipped type="pytest.xfail" message=""/></testcase>
  </testsuite></testsuites>"""
  assert parse_junit(xml) == {("t", "ok"): "passed", ("t", "bad"): "failed",
                              ("t", "skip"): "skipped", ("t", "teardown"): "error",
                              ("t", "xf"): "xfail", ("t", "xp"): "xpass",
                              ("t", "old_xp"): "xpass", ("t", "called"): "xfail_unmarked"}
  with pytest.raises(ValueError):
    parse_junit(b"<html/>")


DJANGO_LOG = """Testing against Django installed in '/testbed/django'
Found 14 test(s).
System check identified no issues (0 silenced).
test_a (m.tests.T.test_a) ... ok
test_b (m.tests.T.test_b) ... FAIL
test_c (m.tests.T.test_c) ... ERROR
test_d (m.tests.T.test_d) ... skipped 'no database'
test_e (m.tests.T.test_e)
The first line of a docstring. ... ok
test_f (m.tests.T.test_f) ... expected failure
test_g (m.tests.T.test_g) ... unexpected success
test_h (m.tests.T) ... printed on the way
ok
test_i (m.tests.T) ... System check identified no issues (0 silenced)
ok
test_j (m.tests.T) ... Internal Server Error: /admin/x/
ok
Applying sites.0002_alter_domain_unique...test_no_migrations (m.tests.T) ... ok
test_k (m.tests.T) ...  OK
--version is equivalent to version

======================================================================
FAIL: test_b (m.tests.T.test_b)
----------------------------------------------------------------------
Traceback (most recent call last):
AssertionError: 1 != 2

======================================================================
ERROR: test_c (m.tests.T.test_c)
----------------------------------------------------------------------
Ran 14 tests in 0.010s

FAILED (failures=1, errors=1, skipped=1, expected failures=1, unexpected successes=1)
"""

SYMPY_LOG = """============================= test process starts ==============================
executable:         /usr/bin/python3  (3.11.2-final-0) [CPython]
sympy/core/tests/test_basic.py[5] 
test_a ok
test_b F
test_c E
test_d f
test_e s                                                                    [FAIL]

________________________________________________________________________________
___________________ sympy/core/tests/test_basic.py:test_b ______________________
Traceback (most recent call last):
AssertionError
________________________________________________________________________________
___________________ sympy/core/tests/test_basic.py:test_c ______________________
ZeroDivisionError: division by zero
= tests finished: 1 passed, 1 failed, 1 skipped, 1 expected to fail, 1 exceptions, in 0.1 seconds =
DO *NOT* COMMIT!
"""


@pytest.mark.parametrize("runner,log", [("django", DJANGO_LOG), ("sympy", SYMPY_LOG)])
def test_log_parsers_read_as_swebench(runner, log):
  theirs = PARSER_REGISTRY[f"parse_log_{runner}"](log, None)
  assert len(theirs) >= 5 and swe_logs.LOG_PARSERS[runner](log) == {
      k: v.lower() for k, v in theirs.items()}
  assert swe_logs.parse_django_log("FAIL:\n") == {}  # where swebench's parser raises


def test_grading_rules_are_swebench_s():
  """Random runs (every status, missing tests, ids truncated inside their parameters) graded
  by swe_logs.grade and by swebench's get_eval_tests_report / get_resolution_status."""
  rng = random.Random(0)
  names = ["t1", "t2", "t3", "p[a-1]", "p[a-2]", "q[log(x)]", "q[log(y)]", "r[1]"]
  ids = names + ["p[a", "q[log(", "r[", "s"]  # truncated, or never reported
  for _ in range(400):
    run = {n: rng.choice(["PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL"])
           for n in rng.sample(names, rng.randint(0, len(names)))}
    f2p, p2p = rng.sample(ids, rng.randint(1, 4)), rng.sample(ids, rng.randint(0, 4))
    report = swebench_grading.get_eval_tests_report(run, {FAIL_TO_PASS: f2p, PASS_TO_PASS: p2p})
    ours = swe_logs.grade(f2p, p2p, lambda t: swe_logs.find_status(
        t, {k: v.lower() for k, v in run.items()}))
    assert ours.resolved == (swebench_grading.get_resolution_status(report) == "RESOLVED_FULL")
    assert ours.successes == sum(len(report[k]["success"]) for k in (FAIL_TO_PASS, PASS_TO_PASS))
    assert ours.total == sum(len(report[k][o]) for k in (FAIL_TO_PASS, PASS_TO_PASS)
                             for o in ("success", "failure"))


# ----------------------------------------------------------------------------- python_io


def code_task(tests, entry_point="add", timeout=5.0):
  return Task("p", "code", ("Write add(a, b).",), tests=tuple(tests), entry_point=entry_point,
              timeout=timeout)


def test_python_io_function_tests():
  task = code_task([{"args": [1, 2], "expected": 3}, {"args": [-1, 1], "expected": 0},
                    {"args": [[1], [2]], "expected": [1, 2]}, {"args": [2, 2], "expected": 4}])

  async def main():
    good = await verify_python_io(task, "```python\ndef add(a, b):\n    print('hi')\n"
                                  "    return a + b\n```", bwrap)
    # Right on tests 1 and 4, wrong on 2, raises TypeError on 3 ([1] > 0).
    half = await verify_python_io(task, "def add(a, b):\n    return a + b if a > 0 else a - b",
                                  bwrap, partial=True)
    sneaky = await verify_python_io(task, "class A:\n  def __eq__(s, o): return True\n"
                                    "def add(a, b):\n  return A()\n", bwrap)
    broken = await verify_python_io(task, "def add(a, b) return", bwrap)
    return good, half, sneaky, broken
  good, half, sneaky, broken = run(main())
  assert good.reward == 1.0, good.details
  assert half.reward == pytest.approx(2 / 4), half.details
  assert [t["passed"] for t in half.details["tests"]] == [True, False, False, True]
  assert "TypeError" in half.details["tests"][2]["error"]
  assert sneaky.reward == 0.0 and broken.reward == 0.0
  assert "SyntaxError" in broken.details["tests"][0]["error"]


def test_bundled_problems():
  tasks = {t.instance_id: t for t in load_problems_jsonl(PROBLEMS)}

  async def main():
    return (await verify(tasks["code-add"], "def add(a, b):\n    return a + b\n",
                         make_sandbox=bwrap),
            await verify(tasks["code-reverse-words"], "print(' '.join(input().split()[::-1]))",
                         make_sandbox=bwrap))
  add, rev = run(main())
  assert add.reward == 1.0 and rev.reward == 1.0, (add.details, rev.details)
  assert verify_exact(tasks["exact-sum"], "... = \\boxed{5050}").reward == 1.0
  assert len(tasks["judge-explain-bug"].rubric) == 3


def test_python_io_stdin_stdout_tests():
  task = code_task([{"input": "1 2\n", "output": "3\n"}, {"input": "5 5", "output": "10"},
                    {"input": "0 0\n", "output": "0"}], entry_point=None, timeout=3.0)
  program = "a, b = map(int, input().split())\nprint(a + b, '  ')\nprint()\n"

  async def main():
    return (await verify_python_io(task, program, bwrap),
            await verify_python_io(task, "print(3)", bwrap, partial=True),
            await verify_python_io(dataclasses.replace(task, tests=task.tests[:1], timeout=2.0),
                                   "while True: pass", bwrap))
  good, one, hang = run(main())
  assert good.reward == 1.0, good.details
  assert one.reward == pytest.approx(1 / 3)
  assert hang.reward == 0.0 and all(t["timed_out"] for t in hang.details["tests"])


# ----------------------------------------------------------------------------- exact


@pytest.mark.parametrize("response,answers,reward", [
    ("So the result is \\boxed{42}.", ("42",), 1.0),
    ("Answer: 1,000.", ("1000",), 1.0),
    ("The final answer is: 0.50", ("1/2",), 1.0),
    ("answer = Paris", ("paris",), 1.0),
    ("\\boxed{\\frac{1}{2}} hmm no, \\boxed{3}", ("3",), 1.0),
    ("$ 7 $", ("7",), 1.0),
    ("Answer: 41", ("42", "forty-two"), 0.0),
    ("I think it is 42 or 43", ("42",), 0.0),
])
def test_exact(response, answers, reward):
  task = Task("q", "exact", ("What is it?",), answers=answers)
  assert verify_exact(task, response).reward == reward


def test_answer_normalisation():
  assert extract_answer("x\nFinal answer: \\text{blue} \n") == "\\text{blue}"
  assert normalize_answer(" \\text{Blue}. ") == "blue"
  assert normalize_answer("12,345,678 apples") == "12345678 apples"
  assert normalize_answer("1,23") == "1,23"


# ----------------------------------------------------------------------------- judge

RUBRIC = ({"name": "correctness", "weight": 2, "description": "Is it right?"},
          {"name": "code quality", "weight": 1, "max": 5})


class CannedPolicy:
  """Answers every request with the bytes of the next canned reply."""

  def __init__(self, replies):
    self.replies, self.prompts = list(replies), []

  async def generate(self, input_ids, params):
    self.prompts.append(bytes(input_ids).decode())
    ids = list(self.replies.pop(0).encode())
    return Generation(output_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop")


def test_judge_reward_is_the_weighted_rubric_score():
  task = Task("j", "judge", ("Explain recursion.",), rubric=RUBRIC)
  policy = CannedPolicy(["correctness: 8/10\nCode_Quality: 3", '{"correctness": 4, '
                         '"code quality": 5}'])

  async def main():
    return await verify_judge(task, "It calls itself.", policy, lambda s: list(s.encode()),
                              lambda ids: bytes(ids).decode(), samples=2)
  v = run(main())
  # (2 * 8/10 + 1 * 3/5) / 3 and (2 * 4/10 + 1 * 5/5) / 3, averaged.
  assert v.reward == pytest.approx(((1.6 + 0.6) / 3 + (0.8 + 1.0) / 3) / 2)
  assert "It calls itself." in policy.prompts[0] and "code quality (0-5)" in policy.prompts[0]
  assert v.details["missing"] == []


def test_parse_scores_is_robust():
  parse = lambda text: parse_scores(text, RUBRIC)  # noqa: E731
  assert parse("**Correctness** (0-10): 7\n**Code quality**: 4 out of 5") == {
      "correctness": 7.0, "code quality": 4.0}
  assert parse("correctness - 9.5 / 10; code-quality = 2") == {"correctness": 9.5,
                                                                "code quality": 2.0}
  # The last mention wins; scores are clamped to [0, max]; unknown text gives None.
  assert parse("correctness: 3 ... on reflection, correctness: 6\ncode quality: 11") == {
      "correctness": 6.0, "code quality": 5.0}
  assert parse("I liked it.") == {"correctness": None, "code quality": None}


def test_judge_missing_dimension_scores_0():
  task = Task("j", "judge", ("Explain recursion.",), rubric=RUBRIC)
  v = run(verify(task, "answer", policy=CannedPolicy(["correctness: 10"]),
                 render=lambda s: list(s.encode()), decode=lambda ids: bytes(ids).decode()))
  assert v.reward == pytest.approx(2 / 3) and v.details["missing"] == ["code quality"]
