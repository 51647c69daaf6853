"""Tasks: JSONL loaders and their errors, repository snapshots, diffs, the task generator."""

import io
import json
import logging
import os
import random
import subprocess
import sys
import tarfile

import numpy as np
import pytest

from envs import taskgen
from envs.tasks import (Task, TaskFormatError, apply_patch, load_problems_jsonl,
                        load_repo_files, load_swe_jsonl, load_tasks, make_patch,
                        pytest_command, reference_files, task_to_swe_dict)

ROOT = os.path.join(os.path.dirname(__file__), "..")
DATA = os.path.join(ROOT, "envs", "data", "swe", "tasks.jsonl")
GOOD_SWE = {"instance_id": "t-1", "repo_path": "repo", "problem_statement": "Fix it.",
            "FAIL_TO_PASS": ["tests/test_a.py::test_x"], "PASS_TO_PASS": []}


def write_lines(path, lines):
  path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
  return str(path)


@pytest.fixture
def swe_dir(tmp_path):
  (tmp_path / "repo" / "tests").mkdir(parents=True)
  (tmp_path / "repo" / "a.py").write_text("X = 1\n")
  (tmp_path / "repo" / "tests" / "test_a.py").write_text("def test_x(): pass\n")
  return tmp_path


# ----------------------------------------------------------------------------- loaders


def test_bundled_instances_load():
  tasks = load_swe_jsonl(DATA)
  assert [t.instance_id for t in tasks] == ["intervals-1", "roman-1", "textstats-1"]
  for t in tasks:
    assert t.kind == "swe" and os.path.isdir(t.repo_path) and len(t.problem_statements) == 3
    assert t.fail_to_pass and t.pass_to_pass and t.patch
    assert t.pytest_command() == ("python3", ["-q", t.fail_to_pass[0].split("::")[0]])
    assert t.metadata["repo"].startswith("arbor-examples/")
    files = load_repo_files(t)
    assert reference_files(t) != files and set(reference_files(t)) == set(files)


def test_swe_records_round_trip(tmp_path):
  tasks = load_swe_jsonl(DATA)
  path = write_lines(tmp_path / "copy.jsonl", [task_to_swe_dict(t) for t in tasks])
  assert load_swe_jsonl(path) == tasks


def test_prompt_sampling_uses_the_given_rng():
  task = load_swe_jsonl(DATA)[0]
  draws = [task.prompt(random.Random(s)) for s in range(30)]
  assert draws == [task.prompt(random.Random(s)) for s in range(30)]  # deterministic
  assert set(draws) == set(task.problem_statements)                  # every phrasing used
  rng = np.random.default_rng(0)
  assert {task.prompt(rng) for _ in range(30)} == set(task.problem_statements)
  assert task.problem_statement == task.problem_statements[0]


def test_swe_bench_style_fields(swe_dir):
  # SWE-bench stores the test lists as JSON strings; the test command defaults to pytest on
  # the files of the test ids; unknown fields are kept as metadata.
  rec = {**GOOD_SWE, "FAIL_TO_PASS": json.dumps(["tests/test_a.py::test_x"]),
         "PASS_TO_PASS": "[]", "base_commit": "abc123", "problem_statements": ["Again."]}
  (task,) = load_swe_jsonl(write_lines(swe_dir / "t.jsonl", [rec]))
  assert task.fail_to_pass == ("tests/test_a.py::test_x",) and task.pass_to_pass == ()
  assert task.test_command == "python3 -m pytest -q tests/test_a.py"
  assert task.problem_statements == ("Fix it.", "Again.")
  assert task.metadata == {"base_commit": "abc123"}
  assert task.repo_path == str(swe_dir / "repo")


@pytest.mark.parametrize("line,field", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ({k: v for k, v in GOOD_SWE.items() if k != "FAIL_TO_PASS"}, "'FAIL_TO_PASS': missing"),
    ({**GOOD_SWE, "FAIL_TO_PASS": "tests/test_a.py::test_x"}, "'FAIL_TO_PASS'"),
    ({**GOOD_SWE, "FAIL_TO_PASS": []}, "'FAIL_TO_PASS': empty"),
    ({**GOOD_SWE, "FAIL_TO_PASS": ["test_x"]}, "'FAIL_TO_PASS': 'test_x' is not a pytest"),
    ({**GOOD_SWE, "PASS_TO_PASS": [3]}, "'PASS_TO_PASS'"),
    ({**GOOD_SWE, "instance_id": 7}, "'instance_id': expected str"),
    ({**GOOD_SWE, "repo_path": "nowhere"}, "'repo_path'"),
    ({**GOOD_SWE, "problem_statement": ""}, "'problem_statement'"),
    ({**GOOD_SWE, "test_command": "make test"}, "'test_command'"),
    ({**GOOD_SWE, "timeout": -1}, "'timeout'"),
    ({**GOOD_SWE, "timeout": True}, "'timeout'"),
    (GOOD_SWE, "'instance_id': 't-1' already used on line 1"),
])
def test_bad_swe_lines_name_file_line_and_field(swe_dir, line, field):
  path = write_lines(swe_dir / "t.jsonl", [GOOD_SWE, line])
  with pytest.raises(TaskFormatError) as e:
    load_swe_jsonl(path)
  assert str(e.value).startswith(f"{path}:2: ") and field in str(e.value), str(e.value)


def test_skip_bad_counts_and_logs(swe_dir, caplog):
  path = write_lines(swe_dir / "t.jsonl", [
      GOOD_SWE, "{oops", "", {**GOOD_SWE, "instance_id": "t-2", "FAIL_TO_PASS": []},
      {**GOOD_SWE, "instance_id": "t-3"}])
  errors = []
  with caplog.at_level(logging.WARNING, logger="envs.tasks"):
    tasks = load_swe_jsonl(path, skip_bad=True, errors=errors)
  assert [t.instance_id for t in tasks] == ["t-1", "t-3"]
  assert [str(e).split(": ")[0] for e in errors] == [f"{path}:2", f"{path}:4"]
  assert "skipped 2 bad line(s), loaded 2 task(s)" in caplog.text


def test_problem_lines(tmp_path):
  lines = [
      {"id": "c1", "prompt": "Add.", "entry_point": "add", "tests": [{"args": [1, 2],
                                                                       "expected": 3}]},
      {"id": "c2", "kind": "code", "prompt": "Echo.", "tests": [{"input": "a", "output": "a"}],
       "source": "mine"},
      {"id": "q1", "kind": "exact", "prompt": "6*7?", "answer": "42"},
      {"id": "q2", "kind": "exact", "prompt": "Colour?", "answers": ["blue", "azure"]},
      {"id": "j1", "kind": "judge", "prompt": "Write a haiku.",
       "rubric": [{"name": "form", "weight": 2}, {"name": "imagery"}]},
  ]
  tasks = load_problems_jsonl(write_lines(tmp_path / "p.jsonl", lines))
  assert [(t.instance_id, t.kind) for t in tasks] == [
      ("c1", "code"), ("c2", "code"), ("q1", "exact"), ("q2", "exact"), ("j1", "judge")]
  assert tasks[1].metadata == {"source": "mine"} and tasks[1].timeout == 10.0
  assert tasks[2].answers == ("42",) and tasks[3].answers == ("blue", "azure")
  assert tasks[4].rubric[0]["weight"] == 2


@pytest.mark.parametrize("line,field", [
    ({"id": "x", "kind": "essay", "prompt": "p"}, "'kind'"),
    ({"id": "x", "prompt": "p", "tests": [{"args": [1], "expected": 1}]}, "'entry_point'"),
    ({"id": "x", "prompt": "p", "entry_point": "f", "tests": []}, "'tests': empty"),
    ({"id": "x", "prompt": "p", "tests": [{"input": 1, "output": "1"}]}, "'tests[0]'"),
    ({"id": "x", "prompt": "p", "entry_point": "f", "tests": [{"args": 1, "expected": 1}]},
     "'tests[0].args'"),
    ({"id": "x", "kind": "exact", "prompt": "p"}, "'answer': missing"),
    ({"id": "x", "kind": "judge", "prompt": "p", "rubric": [{"weight": 1}]}, "'rubric[0]'"),
    ({"id": "x", "kind": "judge", "prompt": "p", "rubric": [{"name": "a", "weight": 0}]},
     "rubric[0].weight"),
    ({"kind": "exact", "prompt": "p", "answer": "1"}, "'instance_id': missing"),
])
def test_bad_problem_lines(tmp_path, line, field):
  path = write_lines(tmp_path / "p.jsonl", [line])
  with pytest.raises(TaskFormatError) as e:
    load_problems_jsonl(path)
  assert str(e.value).startswith(f"{path}:1: ") and field in str(e.value), str(e.value)


def test_load_tasks_mixes_formats(swe_dir):
  path = write_lines(swe_dir / "mixed.jsonl", [
      GOOD_SWE, {"id": "q", "kind": "exact", "prompt": "?", "answer": "1"}])
  assert [t.kind for t in load_tasks(path)] == ["swe", "exact"]


def test_test_commands():
  assert pytest_command("pytest -x 'a b.py'") == ("python3", ["-x", "a b.py"])
  assert pytest_command("/opt/venv/bin/python3.11 -m pytest") == ("/opt/venv/bin/python3.11", [])
  for bad in ("make test", "python -m unittest", "sh -c 'python3 -m pytest'", "python3 'x",
              "python3; rm -rf / -m pytest"):
    with pytest.raises(ValueError, match="test_command="):
      pytest_command(bad)


def test_task_validation_names_the_field():
  with pytest.raises(ValueError, match="kind='essay'"):
    Task("x", "essay", ("p",))
  with pytest.raises(ValueError, match="problem_statements"):
    Task("x", "exact", (), answers=("1",))
  with pytest.raises(ValueError, match="fail_to_pass"):
    Task("x", "swe", ("p",), repo_path="/r", test_command="pytest")
  with pytest.raises(ValueError, match="test_command='tox'"):
    Task("x", "swe", ("p",), repo_path="/r", fail_to_pass=("a.py::t",), test_command="tox")


# ----------------------------------------------------------------------------- snapshots


def test_repo_snapshot_from_directory_and_tarball(tmp_path):
  task = load_swe_jsonl(DATA)[2]
  files = load_repo_files(task)
  assert sorted(files) == ["tests/test_stats.py", "textstats/__init__.py", "textstats/stats.py",
                           "textstats/tokenize.py"]
  tar_path = tmp_path / "repo.tar.gz"
  with tarfile.open(tar_path, "w:gz") as tar:
    tar.add(task.repo_path, arcname=".")
  assert load_repo_files(str(tar_path)) == files
  # Caches and symlinks of a directory snapshot are left out.
  repo = tmp_path / "repo"
  (repo / "__pycache__").mkdir(parents=True)
  (repo / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
  (repo / "a.py").write_text("A = 1\n")
  os.symlink("/etc/passwd", repo / "link")
  assert load_repo_files(str(repo)) == {"a.py": b"A = 1\n"}


def test_tarball_with_unsafe_member_is_rejected(tmp_path):
  path = tmp_path / "evil.tar"
  with tarfile.open(path, "w") as tar:
    info = tarfile.TarInfo("../escape.py")
    info.size = 1
    tar.addfile(info, io.BytesIO(b"x"))
  with pytest.raises(ValueError, match="unsafe path '../escape.py'"):
    load_repo_files(str(path))


# ----------------------------------------------------------------------------- diffs


def test_make_and_apply_patch_round_trip():
  old = {"a.py": b"1\n2\n3\n4\n5\n6\n7\n8\n9\n10\n", "gone.py": b"bye\n",
         "tail.txt": b"no newline", "same.py": b"same\n"}
  new = {"a.py": b"1\nTWO\n3\n4\n5\n6\n7\n8\nNINE\n10\n11\n", "new/file.py": b"hi\n",
         "tail.txt": b"no newline, still", "empty.txt": b"", "same.py": b"same\n"}
  patch = make_patch(old, new)
  assert "\\ No newline at end of file" in patch and "same.py" not in patch
  assert apply_patch(old, patch) == new
  assert apply_patch(old, "") == old


def test_apply_patch_hand_written_diff_with_offset():
  files = {"m.py": b"".join(b"line %d\n" % i for i in range(1, 21))}
  # The header says line 3, the text sits at line 12: applied at the nearest match.
  patch = ("diff --git a/m.py b/m.py\nindex 000..111 100644\n--- a/m.py\t2024-01-01\n"
           "+++ b/m.py\n@@ -3,3 +3,3 @@\n line 11\n-line 12\n+line twelve\n line 13\n")
  out = apply_patch(files, patch)["m.py"].decode().splitlines()
  assert out[10:13] == ["line 11", "line twelve", "line 13"]
  with pytest.raises(ValueError, match="does not apply"):
    apply_patch(files, patch.replace("-line 12", "-line 99"))
  with pytest.raises(ValueError, match="does not exist"):
    apply_patch({}, patch)
  with pytest.raises(ValueError, match="unsafe path"):
    apply_patch(files, patch.replace("b/m.py\n@@", "b/../m.py\n@@"))


# ----------------------------------------------------------------------------- generator


def test_generator_is_deterministic_and_seeded(tmp_path):
  a = taskgen.write_tasks(str(tmp_path / "a"), 5, 1, seed=3)
  b = taskgen.write_tasks(str(tmp_path / "b"), 5, 1, seed=3)
  text = lambda d: (tmp_path / d / "tasks.jsonl").read_bytes()  # noqa: E731
  assert text("a") == text("b")
  assert [load_repo_files(t) for t in a] == [load_repo_files(t) for t in b]
  c = taskgen.write_tasks(str(tmp_path / "c"), 5, 1, seed=4)
  assert [t.metadata["content_hash"] for t in c] != [t.metadata["content_hash"] for t in a]
  # A task depends only on (level, seed, index), not on how many were generated with it.
  assert taskgen.generate(1, 3, 4).files == taskgen.generate(1, 3, 4).files == \
      load_repo_files(a[4])


@pytest.mark.parametrize("level", taskgen.LEVELS)
def test_generated_task_structure(level):
  for index in range(40):
    g = taskgen.generate(level, 11, index)
    sources = [p for p in g.files if not p.startswith("tests/")]
    tests = [p for p in g.files if p.startswith("tests/")]
    defs = sum(g.files[p].count(b"\ndef ") + g.files[p].startswith(b"def ") for p in sources)
    if level == 0:
      assert len(sources) == 1 and defs == 1 and len(tests) == 1
    else:
      assert defs == (3, 4, 8)[level - 1] and len(g.pass_to_pass) >= 2
    assert 1 <= len(g.fail_to_pass) <= 2 and len(set(g.problem_statements)) >= 3
    # The one-line edit, the fixed files and the patch all agree.
    edit = g.fix_edit
    edited = g.files[edit["path"]].replace(edit["old"].encode(), edit["new"].encode())
    assert g.fixed == {edit["path"]: edited}
    record = g.record("repos/x")
    assert apply_patch(g.files, record["patch"]) == {**g.files, **g.fixed}
    assert edit["old"].strip() != edit["new"].strip() and "\n" not in edit["old"]
    if level == 0:  # a tiny model's task: a change of a few characters on one line
      assert abs(len(edit["old"]) - len(edit["new"])) <= 8


def test_level_0_names_the_bug_in_every_phrasing():
  g = taskgen.generate(0, 1, 0)
  func = g.fail_to_pass[0].split("::")[1].removeprefix("test_").rsplit("_", 1)[0]
  assert all(func in s for s in g.problem_statements)


def test_cli_writes_jsonl_and_repos(tmp_path):
  out = tmp_path / "gen"
  subprocess.run([sys.executable, "-m", "envs.taskgen", "--n", "3", "--level", "2", "--seed",
                  "1", "--out", str(out)], check=True, cwd=ROOT, capture_output=True)
  tasks = load_swe_jsonl(str(out / "tasks.jsonl"))
  assert [t.instance_id for t in tasks] == [f"gen-l2-s1-0000{i}" for i in range(3)]
  assert all(os.path.isdir(t.repo_path) and t.metadata["level"] == 2 for t in tasks)
  with pytest.raises(ValueError, match="level=7"):
    taskgen.generate(7, 0, 0)
