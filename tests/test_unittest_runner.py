"""The "unittest" test runner of SWE tasks (`python3 -m unittest`), in bwrap sandboxes.

A tiny repository whose tests are plain unittest: its row is graded by the verifier from the
verbose log, and the per-test statuses and the verdicts are swebench's (its django parser and
grading on the same runs' logs). The log format of other Python versions is checked on real
logs of the interpreters that are installed. A synthesized unittest row goes end to end.
"""

import asyncio
import json
import os
import shutil
import subprocess

import pytest
from swebench.harness.log_parsers import PARSER_REGISTRY

from envs import synth
from envs.sandbox import create_sandbox
from envs.swe_mirror import dataset_mirror
from envs.tasks import (TaskFormatError, is_unittest_command, load_repo_files, load_swe_jsonl,
                        load_swe_rows, make_patch, task_to_swe_dict, unittest_command)
from envs.verifiers import refused_reason, swe_logs, task_test_files
from envs.verifiers.swe import run_log_tests, unittest_test_files
from tests.test_synth import GEO, GEO_TESTS, check_against_swebench, git, ids
from tests.test_verifiers import (assert_agrees_with_swebench, assert_same_statuses, check,
                                  runs, swebench_report)  # noqa: F401  (runs: a fixture)

PARSER = "parse_log_django"
OPS = "def double(x):\n    return x + x\n\n\ndef square(x):\n    return x * 2\n"
# A passing test that prints (its "ok" on the next line), a docstring (its first line is the
# name in the log), a skip and an expected failure, beside the tests the row names.
TESTS = '''\
import sys
import unittest

from calc.ops import double


class TestOps(unittest.TestCase):

    def test_double(self):
        print("checking double", file=sys.stderr)
        self.assertEqual(double(3), 6)

    def test_documented(self):
        """Doubling zero gives zero."""
        self.assertEqual(double(0), 0)

    @unittest.skip("not today")
    def test_skipped(self):
        pass

    @unittest.expectedFailure
    def test_known_bug(self):
        self.assertEqual(double(1), 3)
'''
NEW_TESTS = '''

class TestSquare(unittest.TestCase):

    def test_square(self):
        from calc.ops import square
        self.assertEqual(square(3), 9)
'''
COMMAND = "python3 -m unittest tests.test_ops"


def _write(root, files):
  for path, text in files.items():
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_text(text)


def _name(test, cls, new_format):
  """unittest's verbose name of a test of tests/test_ops.py (Python >= 3.11 adds the method)."""
  return f"{test} (tests.test_ops.{cls}.{test})" if new_format else f"{test} (tests.test_ops.{cls})"


@pytest.fixture(scope="module")
def new_format():
  """Whether the sandbox's python3 names tests as Python >= 3.11 does."""
  async def ask():
    sb = await create_sandbox("bwrap")
    try:
      res = await sb.exec("python3 -c 'import sys; print(sys.version_info >= (3, 11))'")
    finally:
      await sb.close()
    return res.stdout.strip() == "True"
  return asyncio.run(ask())


def _calc_row(tmp_path, new_format):
  _write(tmp_path / "repo", {"calc/__init__.py": "", "calc/ops.py": OPS, "tests/__init__.py": "",
                             "tests/test_ops.py": TESTS})
  original = load_repo_files(str(tmp_path / "repo"))
  fixed = {**original, "calc/ops.py": OPS.replace("x * 2", "x * x").encode()}
  tested = {**original, "tests/test_ops.py": (TESTS + NEW_TESTS).encode()}
  return original, {
      "instance_id": "calc-1", "repo": "arbor-examples/calc", "repo_path": "repo",
      "problem_statement": "square(3) is 6", "test_command": COMMAND,
      "FAIL_TO_PASS": json.dumps([_name("test_square", "TestSquare", new_format)]),
      "PASS_TO_PASS": json.dumps([_name("test_double", "TestOps", new_format),
                                  "Doubling zero gives zero.",
                                  _name("test_skipped", "TestOps", new_format)]),
      "patch": make_patch(original, fixed), "test_patch": make_patch(original, tested)}


def test_unittest_row_is_graded_as_swebench_grades(tmp_path, runs, new_format):
  """Gold resolves, no change and a wrong fix do not; the statuses are swebench's parser's on
  the same log, and the verdicts its grading's."""
  original, row = _calc_row(tmp_path, new_format)
  (task,) = load_swe_rows([row], base_dir=str(tmp_path))
  assert (task.test_runner, task.script_command()) == ("unittest",
                                                       ({}, "python3", "", ["tests.test_ops"]))
  assert task_to_swe_dict(task)["log_parser"] == PARSER
  assert task_test_files(task, original) == {"tests/test_ops.py"}
  wrong = {**original, "calc/ops.py": OPS.replace("x * 2", "x + x").encode()}
  verdicts = [check(task, task.patch), check(task, ""), check(task, wrong)]
  assert [v.reward for v in verdicts] == [1.0, 0.0, 0.0], [v.details for v in verdicts]
  assert set(verdicts[1].details["fail_to_pass"].values()) == {"failed"}
  p2p = verdicts[0].details["pass_to_pass"]
  assert list(p2p.values()) == ["passed", "passed", "skipped"], p2p
  for verdict, run, name in zip(verdicts, runs, ("gold", "empty", "wrong")):
    assert run.output.count(" ... ") >= 5 and "expected failure" in run.output
    assert_same_statuses(task, PARSER, run)
    assert_agrees_with_swebench(verdict, swebench_report(task, PARSER, run,
                                                         tmp_path / f"{name}.log"))
  # The tests are restored: a submission that rewrites them is graded on the originals.
  v = check(task, {**original, "tests/test_ops.py": "import unittest\n"})
  assert v.reward == 0.0 and v.details["restored"] == ["tests/test_ops.py"]


SHADOW = ('import sys\nfor n in ("test_square (tests.test_ops.TestSquare.test_square)",\n'
          '          "test_square (tests.test_ops.TestSquare)"):\n'
          '    print(n + " ... ok", file=sys.stderr)\n')


def test_a_workspace_unittest_module_is_refused(tmp_path, new_format):
  """`python -m unittest` imports unittest.py from the working directory first: such a
  submission is refused (and without the refusal it would decide the statuses)."""
  original, row = _calc_row(tmp_path, new_format)
  (task,) = load_swe_rows([row], base_dir=str(tmp_path))
  for path in ("unittest.py", "unittest/__init__.py", "unittest/__main__.py"):
    v = check(task, {**original, path: SHADOW})
    assert v.reward == 0.0 and "reason" in v.details and "refused" in v.details["reason"], v
  for path in ("unittest.py", "unittest/x.py", "unittest.cpython-311-x86_64-linux-gnu.so",
               "unittest.abi3.so", "unittest.so"):
    assert refused_reason(path) and "unittest" in refused_reason(path), path
  for path in ("calc/unittest.py", "unittest_helpers.py", "unittests/x.py", "unittest.txt"):
    assert refused_reason(path) is None, path

  async def shadowed_run():  # the attack the refusal stops, run as the verifier would run it
    sb = await create_sandbox("bwrap")
    try:
      for path, data in {**original, "unittest/__init__.py": SHADOW,
                         "unittest/__main__.py": ""}.items():
        await sb.write_file(path, data)
      return await run_log_tests(sb, "unittest", "", ["tests.test_ops"], 60)
    finally:
      await sb.close()
  run = asyncio.run(shadowed_run())
  assert run.error is None and set(run.statuses.values()) == {"passed"}, run.output
  assert _name("test_square", "TestSquare", new_format) in run.statuses


def test_unittest_commands():
  assert unittest_command("PYTHONHASHSEED=0 /venv/bin/python3.9 -m unittest discover -s t") == (
      {"PYTHONHASHSEED": "0"}, "/venv/bin/python3.9", ["discover", "-s", "t"])
  assert unittest_command("python3 -m unittest") == ({}, "python3", [])
  assert is_unittest_command("A=1 python -m unittest x") and not is_unittest_command(
      "python3 -m pytest") and not is_unittest_command("python3 'x")
  for bad, match in (("python3 -m pytest", "expected"), ("python3 -m unittest -q x", "-q"),
                     ("unittest x", "expected")):
    with pytest.raises(ValueError, match=match):
      unittest_command(bad)
  base = {"instance_id": "u-1", "repo_path": ".", "problem_statement": "p",
          "FAIL_TO_PASS": '["test_a (t.T.test_a)"]', "test_command": COMMAND}
  tasks = load_swe_rows([base, {**base, "instance_id": "u-2", "log_parser": PARSER}])
  assert [t.test_runner for t in tasks] == ["unittest", "unittest"]
  with pytest.raises(ValueError, match="field 'log_parser': 'parse_log_pytest'"):
    load_swe_rows([{**base, "log_parser": "parse_log_pytest"}])
  with pytest.raises(ValueError, match="field 'test_command'.*--quiet"):
    load_swe_rows([{**base, "test_command": "python3 -m unittest --quiet"}])
  c = synth.parse_test_command("python3 -m unittest discover -s tests")
  assert (c.log_parser, c.runner, c.script, c.args, c.runner_files) == (
      PARSER, "unittest", "", ("discover", "-s", "tests"), ())
  with pytest.raises(ValueError, match="python3 -m unittest' only"):
    synth.parse_test_command("python3 -m nose2", PARSER)
  paths = {"pkg/__init__.py", "pkg/tests/__init__.py", "pkg/tests/test_a.py", "test_b.py"}
  names = ["test_x (pkg.tests.test_a.TestA.test_x)", "test_y (pkg.tests.test_a.TestA)",
           "test_z (test_b.TestB)", "A docstring line."]
  assert unittest_test_files(names, paths) == {"pkg/tests/test_a.py", "test_b.py"}
  assert {"pkg/tests/test_a.py", "test_b.py"} <= unittest_test_files(names)


def _interpreters():
  """Installed interpreters whose unittest log formats differ: the host's python3, and
  pyenv's 3.9 and 3.13 where they are installed."""
  found = [("host", shutil.which("python3"))]
  for version in ("3.9", "3.13"):
    root = os.path.expanduser("~/.pyenv/versions")
    for d in sorted(os.listdir(root)) if os.path.isdir(root) else ():
      if d.startswith(version + "."):
        found.append((version, os.path.join(root, d, "bin", f"python{version}")))
  return [pytest.param(path, id=name) for name, path in found if path and os.access(path,
                                                                                   os.X_OK)]


@pytest.mark.parametrize("python", _interpreters())
def test_unittest_logs_of_each_python_parse_as_swebench(python, tmp_path):
  """Real `python -m unittest -v` logs (names with or without the method, by version): our
  parser reads what swebench's does, and the names' module is the test file."""
  _write(tmp_path, {"calc/__init__.py": "", "calc/ops.py": OPS, "tests/__init__.py": "",
                    "tests/test_ops.py": TESTS + NEW_TESTS})
  res = subprocess.run([python, "-m", "unittest", "-v", "tests.test_ops"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin"})
  version = subprocess.run([python, "-c", "import sys; print(sys.version_info >= (3, 11))"],
                           capture_output=True, text=True).stdout.strip() == "True"
  log = res.stdout + res.stderr
  theirs = {k: v.lower() for k, v in PARSER_REGISTRY[PARSER](log, None).items()}
  ours = swe_logs.LOG_PARSERS["unittest"](log)
  assert ours == theirs and res.returncode == 1, log
  assert ours[_name("test_square", "TestSquare", version)] == "failed"
  assert ours[_name("test_double", "TestOps", version)] == "passed"
  assert ours[_name("test_skipped", "TestOps", version)] == "skipped"
  assert ours["Doubling zero gives zero."] == "passed"
  assert unittest_test_files(list(ours), ["tests/test_ops.py"]) == {"tests/test_ops.py"}


def test_synthesized_unittest_rows_load_from_their_mirror_and_resolve(tmp_path, monkeypatch):
  """`envs.synth` with a `python3 -m unittest` command (no log parser named): rows without
  trees load from the mirror beside them with no setting, and grade as swebench grades."""
  repo = tmp_path / "geo"
  _write(repo, {"geo/__init__.py": "", "geo/shapes.py": GEO, "tests/__init__.py": "",
                "tests/test_shapes.py": GEO_TESTS})
  git(repo, "init", "-q")
  git(repo, "add", ".")
  git(repo, "commit", "-q", "-m", "geo")
  out = tmp_path / "out"
  command = "python3 -m unittest discover -s tests -t ."
  report = synth.synthesize(str(repo), command, str(out), name="me/geo",
                            kinds=("operator", "comparison"), max_per_kind=2, max_instances=2,
                            runs=1, workers=2, trees=False,
                            make_sandbox=lambda: create_sandbox("bwrap"))
  rows = [json.loads(line) for line in (out / "tasks.jsonl").read_text().splitlines()]
  assert report["candidate_tests"] == 4 and len(rows) == 2, report
  for row in rows:
    assert (row["test_command"], row["log_parser"]) == (command, PARSER)
    assert "repo_path" not in row
    for test in ids(row, "FAIL_TO_PASS") + ids(row, "PASS_TO_PASS"):
      assert test.startswith(test.split(" ", 1)[0] + " (tests.test_shapes.TestShapes"), test
  monkeypatch.delenv("ARBOR_SWE_MIRROR", raising=False)
  monkeypatch.setenv("ARBOR_SWE_CACHE", str(tmp_path / "cache"))
  tasks = load_swe_jsonl(str(out / "tasks.jsonl"))  # the mirror: out/mirror, found beside it
  assert {t.test_runner for t in tasks} == {"unittest"}
  assert all(t.mirror == str(out / "mirror" / "me__geo.git") for t in tasks)
  check_against_swebench(rows, tasks, tmp_path)
  # An argument or ARBOR_SWE_MIRROR comes first; a `mirror` that is a symbolic link is no mirror.
  with pytest.raises(TaskFormatError, match="no git mirror"):
    load_swe_jsonl(str(out / "tasks.jsonl"), mirror=str(tmp_path))
  (tmp_path / "linked").mkdir()
  (tmp_path / "linked" / "mirror").symlink_to(out / "mirror")
  shutil.copy(out / "tasks.jsonl", tmp_path / "linked" / "tasks.jsonl")
  assert dataset_mirror(str(tmp_path / "linked")) is None
  with pytest.raises(TaskFormatError, match="needs a mirror"):
    load_swe_jsonl(str(tmp_path / "linked" / "tasks.jsonl"))
