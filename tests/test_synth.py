"""envs.synth and envs.validate on tiny packages with real test suites, in bwrap sandboxes.

The main package is a git repository of two commits (the second fixes two functions, so
reverting it gives "revert" candidates) with eight pytest tests. One test is deliberately
flaky: it reads a run counter that the sandbox factory writes into every fresh sandbox and
passes on even runs only, so its outcome flips from one baseline run to the next. A second
package runs unittest through its own runtests.py, graded from the log by a named parser.
References are independent of the code under test: the packages' own files as written here
(the fix must turn each buggy tree back into them), raw pytest node ids, the patch's raw text,
git's own porcelain on the mirror, and swebench's log parsers and grading on the runs' logs.
"""

import asyncio
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading

import pytest
from swebench.harness import grading
from swebench.harness.constants import END_TEST_OUTPUT, START_TEST_OUTPUT, TEST_EXIT_CODE, \
    ResolvedStatus
from swebench.harness.log_parsers import PARSER_REGISTRY
from swebench import types as swebench_types

from envs import synth, validate
from envs.episode import make_sandbox_factory
from envs.sandbox import create_sandbox
from envs.tasks import apply_patch, load_repo_files, load_swe_jsonl, patch_files
from envs.verifiers import junit_key
from envs.verifiers.swe import merge_submission, run_log_tests, run_pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLED = os.path.join(ROOT, "envs", "data", "swe", "tasks.jsonl")
TEST_COMMAND = "python3 -m pytest -q tests"
FLAKY = "tests/test_core.py::test_flaky"
OPTIONS = dict(name="me/calc", kinds=("operator", "comparison", "off_by_one", "early_return",
                                      "revert"),
               max_per_kind=2, commits=("HEAD",), runs=3, workers=2, seed=0)

CORE = '''\
"""Small arithmetic helpers."""


def add(a, b):
    return a + b


def scale(values, factor):
    return [v * factor for v in values]


def clamp(x, low, high):
    if x < low:
        return low
    if x > high:
        return high
    return x


def mean(values):
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)


def first_index(values, target):
    for i in range(len(values)):
        if values[i] == target:
            return i
    return -1
'''
# The first commit's clamp and mean, which the second commit fixes.
OLD_CLAMP = CORE.replace("    if x > high:\n        return high\n", "")
OLD = OLD_CLAMP.replace("return sum(values) / len(values)", "return sum(values) // len(values)")
TESTS = '''\
import pytest
from calc.core import add, clamp, first_index, mean, scale


def test_add():
    assert add(2, 3) == 5


def test_scale():
    assert scale([1, 2], 3) == [3, 6]


def test_clamp_low():
    assert clamp(-5, 0, 10) == 0


def test_clamp_high():
    assert clamp(50, 0, 10) == 10


def test_mean():
    assert mean([1, 2, 3, 4]) == 2.5


def test_mean_empty():
    with pytest.raises(ValueError):
        mean([])


def test_first_index():
    assert first_index([4, 5, 6], 6) == 2
    assert first_index([4, 5, 6], 7) == -1


def test_flaky():
    with open("run_counter.txt") as f:
        assert int(f.read()) % 2 == 0
'''


def git(repo, *args):
  subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com",
                  *args], check=True, capture_output=True)


class CountingSandboxes:
  """Fresh bwrap sandboxes, counted; each gets run_counter.txt = how many came before it."""

  def __init__(self):
    self.made = 0

  async def __call__(self, task=None):
    sb = await create_sandbox("bwrap")
    await sb.write_file("run_counter.txt", str(self.made))
    self.made += 1
    return sb


@pytest.fixture(scope="module")
def package(tmp_path_factory):
  repo = tmp_path_factory.mktemp("calc")
  (repo / "calc").mkdir()
  (repo / "tests").mkdir()
  (repo / "calc" / "__init__.py").write_text("")
  (repo / "calc" / "core.py").write_text(OLD)
  (repo / "tests" / "test_core.py").write_text(TESTS)
  git(repo, "init", "-q")
  git(repo, "add", ".")
  git(repo, "commit", "-q", "-m", "calc")
  (repo / "calc" / "core.py").write_text(CORE)
  git(repo, "commit", "-q", "-am", "clamp: upper bound; mean: true division")
  return repo


@pytest.fixture(scope="module")
def synthesized(package, tmp_path_factory):
  out = tmp_path_factory.mktemp("out")
  sandboxes = CountingSandboxes()
  report = synth.synthesize(str(package), TEST_COMMAND, str(out), make_sandbox=sandboxes,
                            **OPTIONS)
  tasks = load_swe_jsonl(str(out / "tasks.jsonl"))
  rows = [json.loads(l) for l in (out / "tasks.jsonl").read_text().splitlines()]
  return out, report, sandboxes.made, tasks, rows


def ids(row, field):
  """A row's FAIL_TO_PASS / PASS_TO_PASS: a JSON string, as SWE-bench stores them."""
  assert isinstance(row[field], str)
  return json.loads(row[field])


def git_out(git_dir, *args):
  """git's own porcelain on the mirror (an independent reader of what synthesis wrote)."""
  return subprocess.run(["git", "--git-dir", str(git_dir), *args], capture_output=True,
                        text=True, check=True).stdout.strip()


def test_flaky_test_is_found_and_dropped(synthesized):
  _, report, _, tasks, _ = synthesized
  assert report["flaky_tests"] == [FLAKY]
  assert report["tests"] == 8 and report["candidate_tests"] == 7
  for t in tasks:
    assert FLAKY not in t.fail_to_pass + t.pass_to_pass
    assert len(t.fail_to_pass) + len(t.pass_to_pass) == 7


def test_validated_instances_of_several_kinds(synthesized, package):
  out, report, _, tasks, rows = synthesized
  kinds = {r["mutation"]["kind"] for r in rows}
  assert len(kinds) >= 4 and "revert" in kinds, kinds
  assert report["validated"] == len(rows) == report["instances"] >= 6
  assert sum(k["validated"] for k in report["per_kind"].values()) == len(rows)
  assert report["evaluated"] == report["candidates"]
  assert sum(report["rejections"].values()) == report["evaluated"] - report["validated"]
  original = {"calc/__init__.py": b"", "calc/core.py": CORE.encode(),
              "tests/test_core.py": TESTS.encode()}
  head = subprocess.run(["git", "-C", str(package), "rev-parse", "HEAD"], capture_output=True,
                        text=True, check=True).stdout.strip()
  mirror = out / "mirror" / "me__calc.git"
  clean = git_out(mirror, "rev-parse", "main")
  for task, row in zip(tasks, rows):
    for field in ("instance_id", "repo", "base_commit", "patch", "test_patch", "FAIL_TO_PASS",
                  "PASS_TO_PASS", "problem_statement", "version", "created_at", "hints_text",
                  "environment_setup_commit", "test_command", "log_parser"):
      assert field in row, field
    assert row["test_patch"] == "" and row["repo"] == "me/calc"
    assert row["test_command"] == "python3 -m pytest -rA -q tests"
    assert row["log_parser"] == "parse_log_pytest"
    # The bug is committed on the instance's branch; its parent is the clean source.
    assert row["base_commit"] == git_out(mirror, "rev-parse", row["instance_id"])
    assert git_out(mirror, "rev-parse", f"{row['base_commit']}^") == clean
    assert row["environment_setup_commit"] == clean and task.base_commit == row["base_commit"]
    assert git_out(mirror, "diff", "--name-only", clean, row["base_commit"]) == \
        row["mutation"]["path"]
    assert row["difficulty"] in ("easy", "medium", "hard")
    assert row["source"] == {"package": package.name, "version": row["version"],
                             "commit": head}
    assert "environment" not in row and task.environment is None  # the host's sandboxes
    assert set(row["mutation"]) == {"kind", "description", "path", "function", "lineno"}
    buggy = load_repo_files(task)
    assert buggy != original and set(buggy) == set(original)
    assert [p for p in original if buggy[p] != original[p]] == [row["mutation"]["path"]]
    assert apply_patch(buggy, task.patch) == original  # the patch is the fix
    assert task.fail_to_pass and set(task.fail_to_pass).isdisjoint(task.pass_to_pass)
    for test in task.fail_to_pass + task.pass_to_pass:  # real pytest node ids of the suite
      name = test.split("::")[1]
      assert test.startswith("tests/test_core.py::") and f"def {name}(" in TESTS
  # Unchanged files are hard links to one pristine copy.
  first = out / rows[0]["repo_path"] / "tests" / "test_core.py"
  assert os.stat(first).st_nlink == len(rows) + 1


def test_revert_candidates_bring_back_the_old_functions(synthesized):
  rows = synthesized[4]
  reverts = {r["mutation"]["function"]: r for r in rows if r["mutation"]["kind"] == "revert"}
  assert set(reverts) == {"clamp", "mean"}
  assert ids(reverts["clamp"], "FAIL_TO_PASS") == ["tests/test_core.py::test_clamp_high"]
  assert ids(reverts["mean"], "FAIL_TO_PASS") == ["tests/test_core.py::test_mean"]
  assert "+    return sum(values) / len(values)" in reverts["mean"]["patch"]


def test_validate_gold_passes_and_empty_fails(synthesized):
  tasks = synthesized[3][:3]
  report = validate.validate(tasks, make_sandbox_factory("bwrap"), runs=2, workers=2)
  assert report["accepted"] == [t.instance_id for t in tasks] and not report["rejected"]
  for t in tasks:
    result = report["instances"][t.instance_id]
    for gold in result["gold"]:
      assert all(gold[x] == "passed" for x in t.fail_to_pass + t.pass_to_pass)
    for empty in result["empty"]:
      assert all(empty[x] in ("failed", "error") for x in t.fail_to_pass)
      assert all(empty[x] == "passed" for x in t.pass_to_pass)


def test_resume_runs_nothing_and_gives_the_same_rows(synthesized, package):
  out, report, made, _, _ = synthesized
  before = (out / "tasks.jsonl").read_bytes()
  sandboxes = CountingSandboxes()
  again = synth.synthesize(str(package), TEST_COMMAND, str(out), make_sandbox=sandboxes,
                           **OPTIONS)
  assert sandboxes.made == 0 and again["sandbox_runs"] == 0
  assert report["sandbox_runs"] == made
  assert (out / "tasks.jsonl").read_bytes() == before
  assert {k: again[k] for k in ("validated", "rejections", "per_kind", "flaky_tests")} == {
      k: report[k] for k in ("validated", "rejections", "per_kind", "flaky_tests")}


def test_resume_after_a_kill_reruns_only_the_cut_candidate(synthesized, package, tmp_path):
  out = tmp_path / "out"
  shutil.copytree(synthesized[0], out)
  lines = (out / "journal.jsonl").read_text().splitlines(keepends=True)
  last = json.loads(lines[-1])
  (out / "journal.jsonl").write_text("".join(lines[:-1]) + lines[-1][:len(lines[-1]) // 2])
  sandboxes = CountingSandboxes()
  again = synth.synthesize(str(package), TEST_COMMAND, str(out), make_sandbox=sandboxes,
                           **OPTIONS)
  assert sandboxes.made == again["sandbox_runs"] == (2 if last["status"] == "accepted" else 1)
  assert (out / "tasks.jsonl").read_bytes() == (synthesized[0] / "tasks.jsonl").read_bytes()
  entries = [json.loads(l) for l in (out / "journal.jsonl").read_text().splitlines()[-1:]]
  assert entries[0]["key"] == last["key"]


def test_command_line_resumes(synthesized, package):
  out = synthesized[0]
  before = (out / "tasks.jsonl").read_bytes()
  res = subprocess.run(
      [sys.executable, "-m", "envs.synth", "--repo", str(package), "--test_command",
       TEST_COMMAND, "--out", str(out), "--name", "me/calc", "--kinds",
       "operator,comparison,off_by_one,early_return", "--max_per_kind", "2", "--commits",
       "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert res.returncode == 0, res.stderr
  assert "0 sandbox runs" in res.stdout and f"flaky dropped 1: {FLAKY}" in res.stdout
  assert (out / "tasks.jsonl").read_bytes() == before


def _patch_code_lines(patch):
  """Code lines of a diff as a reader sees them: changed and context lines, stripped."""
  return [l[1:].strip() for l in patch.splitlines()
          if l[:1] in "+- " and not l.startswith(("+++", "---")) and len(l[1:].strip()) >= 6]


def test_template_statements_do_not_leak_the_patch(synthesized):
  for row in synthesized[4]:
    assert len(row["problem_statements"]) == 3
    assert row["problem_statement"] == row["problem_statements"][0]
    for statement in row["problem_statements"]:
      for line in _patch_code_lines(row["patch"]):
        assert line not in statement, (row["instance_id"], line)
      assert row["mutation"]["description"] not in statement
      assert "calc.core" in statement or "calc/core.py" in statement
      assert any(t.split("::")[-1] in statement for t in ids(row, "FAIL_TO_PASS"))


def test_failure_messages_come_from_the_run(synthesized):
  for row in synthesized[4]:  # every failing test here prints an assertion or exception
    for test in ids(row, "FAIL_TO_PASS"):
      assert f"`{test}`:\n      " in row["problem_statement"], (test, row["problem_statement"])


DEFAULT_REPLY = "Some results of calc.core are wrong; see the failing tests."


@pytest.fixture
def teacher_server(monkeypatch):
  """A local chat-completions endpoint answering canned replies in turn; records requests."""
  replies, requests = [], []

  class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
      body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
      requests.append({"path": self.path, "auth": self.headers.get("Authorization"),
                       "body": body})
      data = json.dumps({"id": "c1", "object": "chat.completion", "model": body["model"],
                         "choices": [{"index": 0, "finish_reason": "stop", "message": {
                             "role": "assistant",
                             "content": replies.pop(0) if replies else DEFAULT_REPLY}}]}).encode()
      self.send_response(200)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      self.wfile.write(data)

    def log_message(self, *args):
      pass

  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
  thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
  thread.start()
  monkeypatch.setenv("SYNTH_TEST_KEY", "k123")
  teacher = synth.Teacher(f"http://127.0.0.1:{server.server_address[1]}/v1", "teacher-1",
                          api_key_env="SYNTH_TEST_KEY")
  yield teacher, replies, requests
  server.shutdown()
  server.server_close()


def test_teacher_statements_leak_guard(synthesized, teacher_server):
  teacher, replies, requests = teacher_server
  row = next(r for r in synthesized[4] if r["mutation"]["kind"] == "operator")
  path, lineno = row["mutation"]["path"], row["mutation"]["lineno"]
  buggy = (synthesized[0] / row["repo_path"] / path).read_text()
  fixed_line = next(l[1:].strip() for l in row["patch"].splitlines()
                    if l.startswith("+") and not l.startswith("+++"))
  messages = {t: ["assert 1 == 2"] for t in ids(row, "FAIL_TO_PASS")}
  styles = len(synth._TEACHER_STYLES)

  replies.extend([f"The function should do `{fixed_line}` instead."] * styles)
  statements, how = synth.problem_statements(messages, row["patch"], path, buggy, lineno,
                                             teacher)
  assert how["method"] == "template" and len(how["teacher_rejected"]) == styles
  assert statements == synth.template_statements("calc.core", messages, row["patch"])

  clean = "add(2, 3) returns -1 instead of 5; see tests/test_core.py::test_add."
  replies.extend([clean] + [f"fix: {fixed_line}"] * (styles - 1))
  statements, how = synth.problem_statements(messages, row["patch"], path, buggy, lineno,
                                             teacher)
  assert statements == [clean] and how["method"] == "teacher"
  assert len(how["teacher_rejected"]) == styles - 1
  assert len(requests) == 2 * styles
  for r in requests:
    assert r["path"] == "/v1/chat/completions" and r["auth"] == "Bearer k123"
    assert r["body"]["model"] == "teacher-1"
    prompt = json.dumps(r["body"]["messages"])
    assert json.dumps(fixed_line)[1:-1] not in prompt  # the fix is never shown
    assert "def " in prompt  # the buggy function is


def test_synthesize_with_teacher_statements(package, teacher_server, tmp_path):
  teacher, replies, requests = teacher_server
  replies.extend(["Report one.", "Report two.", "Report three."])
  sandboxes = CountingSandboxes()
  report = synth.synthesize(str(package), TEST_COMMAND, str(tmp_path), make_sandbox=sandboxes,
                            kinds=("operator", "comparison"), max_instances=1, workers=1,
                            statements="teacher", teacher=teacher)
  rows = [json.loads(l) for l in (tmp_path / "tasks.jsonl").read_text().splitlines()]
  assert report["instances"] == report["validated"] == len(rows) == 1
  assert report["unevaluated"] == report["candidates"] - report["evaluated"] > 0
  assert rows[0]["problem_statements"] == ["Report one.", "Report two.", "Report three."]
  assert rows[0]["statement_source"] == {"method": "teacher", "teacher_rejected": []}
  assert len(requests) == 3


def test_leak_reason_identifiers_only_in_the_fix():
  fix = ("--- a/m.py\n+++ b/m.py\n@@ -1,2 +1,2 @@\n def f(xs):\n-    return xs\n"
         "+    return sorted(xs)\n")
  buggy = "def f(xs):\n    return xs\n"
  assert "sorted" in synth.leak_reason("f should return the list sorted", fix, buggy)
  assert synth.leak_reason("f returns its input unchanged", fix, buggy) is None
  assert "line" in synth.leak_reason("use return sorted(xs) there", fix, buggy)


def test_node_statuses_inverts_junit_key():
  paths = ["tests/test_a.py", "tests/sub/test_b.py", "pkg/mod.py"]
  ids = ["tests/test_a.py::test_x", "tests/test_a.py::TestK::test_y[1-a.b]",
         "tests/sub/test_b.py::TestK::TestInner::test_z", "pkg/mod.py::pkg.mod.f"]
  statuses = {junit_key(i): s for i, s in zip(ids, ["passed", "failed", "error", "skipped"])}
  statuses[("", "tests.test_c")] = "error"  # a collection error names no test
  assert synth.node_statuses(statuses, paths) == dict(zip(ids, ["passed", "failed", "error",
                                                                "skipped"]))


def test_difficulty_rule():
  def fix(n):
    return "--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n" + "-a\n" * n + "+b\n" * n
  assert synth.difficulty(fix(1), 3) == "easy"
  assert synth.difficulty(fix(1), 1) == "medium"
  assert synth.difficulty(fix(2), 1) == "hard"
  assert synth.difficulty(fix(3), 5) == "hard"


def test_bad_inputs_name_the_field(package, tmp_path):
  with pytest.raises(ValueError, match="kinds"):
    synth.SynthConfig(kinds=("nope",))
  with pytest.raises(ValueError, match="max_per_kind"):
    synth.SynthConfig(max_per_kind=0)
  with pytest.raises(ValueError, match="test_command"):
    synth.synthesize(str(package), "make test", str(tmp_path))
  with pytest.raises(ValueError, match="repo="):
    synth.synthesize(str(tmp_path / "missing"), TEST_COMMAND, str(tmp_path))


def test_validate_rejects_hand_broken_rows(synthesized, tmp_path):
  out, _, _, _, rows = synthesized
  row = next(r for r in rows if ids(r, "PASS_TO_PASS"))
  f2p, p2p = ids(row, "FAIL_TO_PASS"), ids(row, "PASS_TO_PASS")
  mislabelled = dict(row, instance_id="mislabelled", FAIL_TO_PASS=f2p + p2p[:1],
                     PASS_TO_PASS=p2p[1:])
  no_fix = dict(row, instance_id="no_fix", patch=rows[-1]["patch"] if rows[-1] is not row
                else rows[0]["patch"])
  # The rows in a dataset folder of their own; the accepted ones written in the folder above.
  shutil.copytree(out / row["repo_path"], tmp_path / "data" / "repos" / "tree")
  path = tmp_path / "data" / "broken.jsonl"
  path.write_text("".join(json.dumps(dict(r, repo_path="repos/tree")) + "\n"
                          for r in (row, mislabelled, no_fix)))
  report_path, accepted_path = tmp_path / "r.json", tmp_path / "accepted.jsonl"
  res = subprocess.run([sys.executable, "-m", "envs.validate", "--tasks", str(path), "--report",
                        str(report_path), "--out", str(accepted_path), "--runs", "1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
  assert res.returncode == 0, res.stderr
  report = json.loads(report_path.read_text())
  assert report["accepted"] == [row["instance_id"]]
  reason = report["rejected"]["mislabelled"]
  assert "pass without the fix" in reason and p2p[0] in reason
  assert report["rejected"]["no_fix"].startswith("gold patch fails")
  accepted = load_swe_jsonl(str(accepted_path))  # repo_path rewritten for the new folder
  assert [t.instance_id for t in accepted] == [row["instance_id"]]
  assert json.loads(accepted_path.read_text())["repo_path"] == "data/repos/tree"
  res = subprocess.run([sys.executable, "-m", "envs.validate", "--tasks", str(path), "--out",
                        str(tmp_path / "data" / "sub" / "accepted.jsonl")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
  assert res.returncode == 2 and "write the accepted rows in that folder" in res.stderr
  assert load_repo_files(accepted[0]) == load_repo_files(load_swe_jsonl(str(path))[0])


def test_validate_lists_a_skipped_pass_to_pass_test_as_failing_under_pytest():
  """A gold run whose PASS_TO_PASS test skipped: swebench's pytest parser never records a
  skip, so the rejection names it; a log runner's recorded skip is a success."""
  from envs.tasks import Task
  from envs.verifiers import Verdict
  gold = Verdict(0.0, {"reason": "PASS_TO_PASS failed", "fail_to_pass": {"t::f": "passed"},
                       "pass_to_pass": {"t::p": "skipped", "t::q": "passed"}})
  task = Task(instance_id="x", kind="swe", problem_statements=("-",), repo_path="r",
              fail_to_pass=("t::f",), pass_to_pass=("t::p", "t::q"),
              test_command="python3 -m pytest -rA t.py")
  assert validate.judge(task, [gold], []).endswith(": t::p (skipped)")
  django = Task(instance_id="x", kind="swe", problem_statements=("-",), repo_path="r",
                fail_to_pass=("t::f",), pass_to_pass=("t::p", "t::q"), test_runner="django",
                test_command="tests/runtests.py t")
  assert validate.judge(django, [gold], []).endswith("PASS_TO_PASS failed")


def test_validate_bundled_set():
  tasks = load_swe_jsonl(BUNDLED)
  report = validate.validate(tasks, make_sandbox_factory("bwrap"), runs=1, workers=2)
  assert report["accepted"] == [t.instance_id for t in tasks], report["rejected"]


# ----------------------------------------------------------------------------- portable rows


async def _run_task(task, submission):
  """One run of a task's tests on `submission` as the verifier prepares it: (run, statuses by
  test id as the verifier reads them)."""
  original = load_repo_files(task)
  files, _ = merge_submission(task, original, submission)
  sb = await create_sandbox("bwrap")
  try:
    for path, data in files.items():
      await sb.write_file(path, data)
    if task.test_runner == "pytest":
      python, args = task.pytest_command()
      run = await run_pytest(sb, args, task.timeout, python)
      return run, synth.node_statuses(run.statuses, sorted(files))
    env, python, script, args = task.script_command()
    run = await run_log_tests(sb, task.test_runner, script, args, task.timeout, python, env)
    return run, run.statuses
  finally:
    await sb.close()


def swebench_grade(row, run, tmp_path):
  """swebench's own reading of a run's log: the row's parser from PARSER_REGISTRY on the log
  between the eval markers, then its grading rules. Returns (status map, resolution)."""
  spec = swebench_types.TestSpec(
      instance_id=row["instance_id"], image="", eval_script_list=[], repo=row["repo"],
      version=row["version"], FAIL_TO_PASS=ids(row, "FAIL_TO_PASS"),
      PASS_TO_PASS=ids(row, "PASS_TO_PASS"), log_parser=row["log_parser"])
  path = tmp_path / f"{row['instance_id']}.log"
  path.write_text(f"{START_TEST_OUTPUT}\n{run.output}\n{END_TEST_OUTPUT}\n"
                  f"{TEST_EXIT_CODE}: {run.exit_code}\n")
  status_map, ok = grading.get_logs_eval(spec, str(path))
  assert ok, run.output[-2000:]
  report = grading.get_eval_tests_report(status_map, {
      "FAIL_TO_PASS": spec.FAIL_TO_PASS, "PASS_TO_PASS": spec.PASS_TO_PASS})
  return status_map, grading.get_resolution_status(report)


def check_against_swebench(rows, tasks, tmp_path):
  """Gold resolves and no change does not, by the verifier's statuses and by swebench's
  parser on the same run's log, which agree test by test."""
  assert row_parser_is_swebench(rows)
  for row, task in zip(rows, tasks):
    tests = ids(row, "FAIL_TO_PASS") + ids(row, "PASS_TO_PASS")
    for submission, resolved in ((task.patch, True), (load_repo_files(task), False)):
      run, ours = asyncio.run(_run_task(task, submission))
      theirs, resolution = swebench_grade(row, run, tmp_path)
      assert {t: ours.get(t) for t in tests} == {t: theirs.get(t, "").lower() for t in tests}
      assert (resolution == ResolvedStatus.FULL.value) == resolved, (row["instance_id"], theirs)
      if resolved:
        assert all(theirs[t] == "PASSED" for t in tests)


def row_parser_is_swebench(rows):
  return all(row["log_parser"] in PARSER_REGISTRY for row in rows)


def mirror_rows(out, tmp_path, rows):
  """The rows without repo_path, in a file of their own: loadable only through the mirror."""
  path = tmp_path / "portable" / "tasks.jsonl"
  path.parent.mkdir(exist_ok=True)
  path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "repo_path"}) + "\n"
                          for r in rows))
  return load_swe_jsonl(str(path), mirror=str(out / "mirror"), cache_dir=str(tmp_path / "cache"))


def test_rows_load_from_the_mirror_and_grade_as_swebench_grades(synthesized, tmp_path):
  out, _, _, tasks, rows = synthesized
  portable = mirror_rows(out, tmp_path, rows)
  for local, task in zip(tasks, portable):
    assert task.repo_path is None and task.base_commit == local.base_commit
    assert load_repo_files(task) == load_repo_files(local)  # the mirror's tree is the tree
    assert (task.patch, task.test_command, task.test_runner) == (
        local.patch, local.test_command, "pytest")
  report = validate.validate(portable[:2], make_sandbox_factory("bwrap"), runs=1, workers=2)
  assert report["accepted"] == [t.instance_id for t in portable[:2]], report["rejected"]
  check_against_swebench(rows[:2], portable[:2], tmp_path)


def test_mirror_is_plain_git_written_reproducibly(synthesized, package, tmp_path):
  out, _, _, _, rows = synthesized
  mirror = out / "mirror" / "me__calc.git"
  assert not os.path.exists(mirror / "hooks") or not os.listdir(mirror / "hooks")
  git_out(mirror, "fsck", "--strict", "--no-dangling")
  assert git_out(mirror, "symbolic-ref", "HEAD") == "refs/heads/main"
  date = git_out(package / ".git", "log", "-1", "--format=%ct")
  assert git_out(mirror, "log", "--format=%an <%ae> %cn <%ce> %at %ct", rows[0]["instance_id"]
                 ).splitlines() == [f"Arbor Synth <synth@arbor.invalid> Arbor Synth "
                                    f"<synth@arbor.invalid> {date} {date}"] * 2
  branches = git_out(mirror, "for-each-ref", "--format=%(refname:short)", "refs/heads")
  assert sorted(branches.split()) == sorted(["main"] + [r["instance_id"] for r in rows])
  # A fresh output folder with the same journal writes the same commits (no test runs).
  fresh = tmp_path / "fresh"
  fresh.mkdir()
  for name in ("baseline.json", "journal.jsonl"):
    shutil.copy(out / name, fresh / name)
  sandboxes = CountingSandboxes()
  synth.synthesize(str(package), TEST_COMMAND, str(fresh), make_sandbox=sandboxes, **OPTIONS)
  assert sandboxes.made == 0
  assert (fresh / "tasks.jsonl").read_bytes() == (out / "tasks.jsonl").read_bytes()


def test_hidden_tests_come_back_in_the_test_patch(synthesized, package, tmp_path):
  out, _, _, _, rows = synthesized
  hidden = tmp_path / "hidden"
  hidden.mkdir()
  for name in ("baseline.json", "journal.jsonl"):  # the same candidates: no test runs
    shutil.copy(out / name, hidden / name)
  sandboxes = CountingSandboxes()
  synth.synthesize(str(package), TEST_COMMAND, str(hidden), make_sandbox=sandboxes,
                   hide_tests=True, trees=False, **OPTIONS)
  assert sandboxes.made == 0 and not (hidden / "repos").exists()
  hidden_rows = [json.loads(l) for l in (hidden / "tasks.jsonl").read_text().splitlines()]
  assert [r["instance_id"] for r in hidden_rows] == [r["instance_id"] for r in rows]
  mirror = hidden / "mirror" / "me__calc.git"
  for row in hidden_rows:
    assert "repo_path" not in row and patch_files(row["test_patch"]) == ["tests/test_core.py"]
    assert "new file mode 100644" in row["test_patch"] and "+def test_add():" in row["test_patch"]
    assert git_out(mirror, "ls-tree", "-r", "--name-only", row["base_commit"]).split() == [
        "calc/__init__.py", "calc/core.py"]
    # patch + test_patch is the whole way back to the clean commit.
    assert sorted(git_out(mirror, "diff", "--name-only", row["base_commit"],
                          row["environment_setup_commit"]).split()) == sorted(
        patch_files(row["patch"]) + patch_files(row["test_patch"]))
  # As SWE-bench's harness does: `git apply` both patches on a clone at base_commit.
  row, clone = hidden_rows[0], tmp_path / "clone"
  subprocess.run(["git", "clone", "-q", "--no-checkout", str(mirror), str(clone)], check=True)
  git(clone, "checkout", "-q", row["base_commit"])
  for name in ("patch", "test_patch"):
    (tmp_path / f"{name}.diff").write_text(row[name])
    git(clone, "apply", str(tmp_path / f"{name}.diff"))
  git(clone, "add", "-A")
  git(clone, "diff", "--cached", "--quiet", row["environment_setup_commit"])
  tasks = load_swe_jsonl(str(hidden / "tasks.jsonl"), mirror=str(hidden / "mirror"),
                         cache_dir=str(tmp_path / "cache"))
  assert "tests/test_core.py" not in load_repo_files(tasks[0])
  report = validate.validate(tasks[:2], make_sandbox_factory("bwrap"), runs=1, workers=2)
  assert report["accepted"] == [t.instance_id for t in tasks[:2]], report["rejected"]
  check_against_swebench(hidden_rows[:1], tasks[:1], tmp_path)


def test_old_working_tree_rows_still_load(synthesized, tmp_path):
  """Rows as earlier versions wrote them: lists of ids, repo_path, no log_parser, no -rA."""
  out, _, _, tasks, rows = synthesized
  old = {k: v for k, v in rows[0].items() if k not in (
      "log_parser", "environment_setup_commit", "base_commit")}
  old.update(FAIL_TO_PASS=ids(rows[0], "FAIL_TO_PASS"), PASS_TO_PASS=ids(rows[0], "PASS_TO_PASS"),
             test_command=TEST_COMMAND, repo_path=f"{out.name}/{rows[0]['repo_path']}")
  path = out.parent / f"old-{out.name}.jsonl"
  path.write_text(json.dumps(old) + "\n")
  (task,) = load_swe_jsonl(str(path))
  assert task.fail_to_pass == tasks[0].fail_to_pass and task.test_command == TEST_COMMAND
  assert load_repo_files(task) == load_repo_files(tasks[0])


def test_test_commands_and_log_parsers():
  c = synth.parse_test_command("python3 -m pytest -q tests")
  assert (c.command, c.log_parser, c.runner, c.args) == (
      "python3 -m pytest -rA -q tests", "parse_log_pytest", "pytest", ("-rA", "-q", "tests"))
  assert synth.parse_test_command("pytest -rA x").command == "pytest -rA x"
  c = synth.parse_test_command("python3 -m pytest tests", "parse_log_pytest_v2")
  assert (c.log_parser, c.runner) == ("parse_log_pytest_v2", "pytest")
  with pytest.raises(ValueError, match=r"test_command=.*-r option 'fE'"):
    synth.parse_test_command("python3 -m pytest -rfE tests")
  with pytest.raises(ValueError, match=r"log_parser='': test_command='make test'"):
    synth.parse_test_command("make test")
  with pytest.raises(ValueError, match=r"log_parser='parse_log_jest'"):
    synth.parse_test_command("python3 runtests.py", "parse_log_jest")
  with pytest.raises(ValueError, match=r"test_command: .*python -m MODULE"):
    synth.parse_test_command("python3 -m nose2 -v", "parse_log_django")
  with pytest.raises(ValueError, match=r"test_command: .*reads pytest logs"):
    synth.parse_test_command("python3 runtests.py", "parse_log_pytest")
  c = synth.parse_test_command("PYTHONHASHSEED=0 python3 runtests.py -v", "parse_log_django")
  assert (c.runner, c.script, c.args, c.env, c.runner_files) == (
      "django", "runtests.py", ("-v",), {"PYTHONHASHSEED": "0"}, ("runtests.py",))
  with pytest.raises(ValueError, match="log_parser"):
    synth.SynthConfig(log_parser="parse_log_nope")
  with pytest.raises(ValueError, match=r"SynthConfig.environment='debian'"):
    synth.SynthConfig(environment="debian")
  paths = ["pkg/a.py", "tests/test_a.py", "tests/views/tests.py"]
  assert synth.test_file("tests/test_a.py::test_x", "pytest", paths) == "tests/test_a.py"
  assert synth.test_file("test_x (tests.test_a.TestA.test_x)", "django", paths) == \
      "tests/test_a.py"
  assert synth.test_file("test_x (views.tests.ViewTests)", "django", paths) == \
      "tests/views/tests.py"
  assert synth.test_file("test_x", "sympy", paths) is None


GEO = '''\
def area(w, h):
    return w * h


def perimeter(w, h):
    return 2 * (w + h)


def is_square(w, h):
    return w == h


def widest(sizes):
    best = 0
    for w in sizes:
        if w > best:
            best = w
    return best
'''
GEO_TESTS = '''\
import unittest

from geo.shapes import area, is_square, perimeter, widest


class TestShapes(unittest.TestCase):

    def test_area(self):
        self.assertEqual(area(2, 3), 6)

    def test_perimeter(self):
        self.assertEqual(perimeter(2, 3), 10)

    def test_is_square(self):
        self.assertTrue(is_square(4, 4))
        self.assertFalse(is_square(4, 5))

    def test_widest(self):
        self.assertEqual(widest([3, 9, 4]), 9)
'''
RUNTESTS = '''\
import sys
import unittest

suite = unittest.defaultTestLoader.discover("tests", top_level_dir=".")
result = unittest.TextTestRunner(verbosity=2).run(suite)
sys.exit(0 if result.wasSuccessful() else 1)
'''


def test_unittest_runner_script_with_a_named_log_parser(tmp_path):
  """A repository whose tests run through its own unittest script, graded from the log."""
  repo = tmp_path / "geo"
  for path, text in {"geo/__init__.py": "", "geo/shapes.py": GEO, "tests/__init__.py": "",
                     "tests/test_shapes.py": GEO_TESTS, "runtests.py": RUNTESTS}.items():
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text(text)
  git(repo, "init", "-q")
  git(repo, "add", ".")
  git(repo, "commit", "-q", "-m", "geo")
  out = tmp_path / "out"
  # The rows name the environment of the repository's metadata (no package metadata here:
  # the default suite's python with pytest); the runs' sandboxes are given, so nothing builds.
  report = synth.synthesize(str(repo), "python3 runtests.py", str(out), name="me/geo",
                            log_parser="parse_log_django", kinds=("operator", "comparison"),
                            max_per_kind=2, runs=1, workers=2, trees=False,
                            environment="repository", make_sandbox=lambda: create_sandbox("bwrap"))
  rows = [json.loads(l) for l in (out / "tasks.jsonl").read_text().splitlines()]
  assert report["tests"] == report["candidate_tests"] == 4 and len(rows) >= 2, report
  assert rows[0]["environment"]["pip"] == ["pytest"] and not rows[0]["environment"]["install"]
  assert all(r["environment"] == rows[0]["environment"] for r in rows)
  for row in rows:
    assert (row["test_command"], row["log_parser"]) == ("python3 runtests.py",
                                                        "parse_log_django")
    assert patch_files(row["patch"]) == ["geo/shapes.py"]
    for test in ids(row, "FAIL_TO_PASS") + ids(row, "PASS_TO_PASS"):
      name = test.split(" ", 1)[0]
      assert test.startswith(f"{name} (tests.test_shapes.TestShapes") and f"def {name}(" in \
          GEO_TESTS
    for test in ids(row, "FAIL_TO_PASS"):  # the traceback's last line, e.g. "AssertionError"
      assert f"`{test}`:\n      AssertionError" in row["problem_statement"], row
  tasks = load_swe_jsonl(str(out / "tasks.jsonl"), mirror=str(out / "mirror"),
                         cache_dir=str(tmp_path / "cache"))
  assert {t.test_runner for t in tasks} == {"django"}
  assert {t.environment.key for t in tasks} == {tasks[0].environment.key}
  check_against_swebench(rows[:2], tasks[:2], tmp_path)


def test_swebench_format_grader_on_mirror_rows_gold_resolved_empty_not(synthesized, tmp_path):
  """`python -m envs.evaluate` on the rows, their repository the mirror: the fix of the first
  row resolves it, an empty prediction for the second is an empty-patch instance."""
  out, _, _, _, rows = synthesized
  portable = tmp_path / "rows.jsonl"
  portable.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "repo_path"})
                             + "\n" for r in rows[:2]))
  predictions = tmp_path / "preds.jsonl"
  predictions.write_text("".join(
      json.dumps({"instance_id": r["instance_id"], "model_name_or_path": "m",
                  "model_patch": patch}) + "\n"
      for r, patch in ((rows[0], rows[0]["patch"]), (rows[1], ""))))
  env = dict(os.environ, ARBOR_SWE_MIRROR=str(out / "mirror"),
             ARBOR_SWE_CACHE=str(tmp_path / "cache"))
  res = subprocess.run([sys.executable, "-m", "envs.evaluate", "--dataset", str(portable),
                        "--predictions", str(predictions), "--report",
                        str(tmp_path / "report.json"),
                        "--log_dir", str(tmp_path / "logs"), "--max_workers", "2",
                        "--no_progress"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
  assert res.returncode == 0, res.stderr[-3000:]
  report = json.loads((tmp_path / "report.json").read_text())
  assert report["resolved_ids"] == [rows[0]["instance_id"]], report
  assert report["empty_patch_ids"] == [rows[1]["instance_id"]], report


def test_mirror_writes_run_no_program_of_the_repository(synthesized, package, tmp_path):
  """A mirror already in OUT whose hooks and configuration name programs: writing into it
  (update-ref runs the reference-transaction hook, commit-tree may sign) runs none of them."""
  out = tmp_path / "out"
  out.mkdir()
  for name in ("baseline.json", "journal.jsonl"):
    shutil.copy(synthesized[0] / name, out / name)
  mirror = out / "mirror" / "me__calc.git"
  subprocess.run(["git", "init", "-q", "--bare", str(mirror)], check=True)
  marker = tmp_path / "ran"
  hook = mirror / "hooks" / "reference-transaction"
  hook.write_text(f"#!/bin/sh\ntouch {marker}\n")
  hook.chmod(0o755)
  with open(mirror / "config", "a") as f:
    f.write(f"[core]\n\thooksPath = {mirror / 'hooks'}\n\tfsmonitor = touch {marker}\n"
            f"[commit]\n\tgpgSign = true\n[gpg]\n\tprogram = touch {marker}\n")
  sandboxes = CountingSandboxes()
  synth.synthesize(str(package), TEST_COMMAND, str(out), make_sandbox=sandboxes, **OPTIONS)
  assert sandboxes.made == 0 and not marker.exists()
  assert (out / "tasks.jsonl").read_bytes() == (synthesized[0] / "tasks.jsonl").read_bytes()
