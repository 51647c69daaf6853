"""envs.synth and envs.validate on a tiny package with a real test suite, in bwrap sandboxes.

The package is a git repository of two commits (the second fixes two functions, so reverting
it gives "revert" candidates) with eight tests. One test is deliberately flaky: it reads a run
counter that the sandbox factory writes into every fresh sandbox and passes on even runs only,
so its outcome flips from one baseline run to the next. References are independent of the code
under test: the package's own files as written here (the fix must turn each buggy tree back
into them), raw pytest node ids, and the patch's raw text.
"""

import http.server
import json
import os
import shutil
import subprocess
import sys
import threading

import pytest

from envs import synth, validate
from envs.episode import make_sandbox_factory
from envs.sandbox import create_sandbox
from envs.tasks import apply_patch, load_repo_files, load_swe_jsonl
from envs.verifiers import junit_key

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
  for task, row in zip(tasks, rows):
    for field in ("instance_id", "repo", "base_commit", "patch", "test_patch", "FAIL_TO_PASS",
                  "PASS_TO_PASS", "problem_statement", "version", "created_at", "hints_text"):
      assert field in row, field
    assert row["test_patch"] == "" and row["base_commit"] == head and row["repo"] == "me/calc"
    assert row["difficulty"] in ("easy", "medium", "hard")
    assert row["source"] == {"package": package.name, "version": row["version"]}
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
  assert reverts["clamp"]["FAIL_TO_PASS"] == ["tests/test_core.py::test_clamp_high"]
  assert reverts["mean"]["FAIL_TO_PASS"] == ["tests/test_core.py::test_mean"]
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
      assert any(t.split("::")[-1] in statement for t in row["FAIL_TO_PASS"])


def test_failure_messages_come_from_the_run(synthesized):
  for row in synthesized[4]:  # every failing test here prints an assertion or exception
    for test in row["FAIL_TO_PASS"]:
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
  messages = {t: ["assert 1 == 2"] for t in row["FAIL_TO_PASS"]}
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
  row = next(r for r in rows if r["PASS_TO_PASS"])
  mislabelled = dict(row, instance_id="mislabelled",
                     FAIL_TO_PASS=row["FAIL_TO_PASS"] + row["PASS_TO_PASS"][:1],
                     PASS_TO_PASS=row["PASS_TO_PASS"][1:])
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
  assert "pass without the fix" in reason and row["PASS_TO_PASS"][0] in reason
  assert report["rejected"]["no_fix"].startswith("gold patch fails")
  accepted = load_swe_jsonl(str(accepted_path))  # repo_path rewritten for the new folder
  assert [t.instance_id for t in accepted] == [row["instance_id"]]
  assert json.loads(accepted_path.read_text())["repo_path"] == "data/repos/tree"
  res = subprocess.run([sys.executable, "-m", "envs.validate", "--tasks", str(path), "--out",
                        str(tmp_path / "data" / "sub" / "accepted.jsonl")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
  assert res.returncode == 2 and "write the accepted rows in that folder" in res.stderr
  assert load_repo_files(accepted[0]) == load_repo_files(load_swe_jsonl(str(path))[0])


def test_validate_bundled_set():
  tasks = load_swe_jsonl(BUNDLED)
  report = validate.validate(tasks, make_sandbox_factory("bwrap"), runs=1, workers=2)
  assert report["accepted"] == [t.instance_id for t in tasks], report["rejected"]
