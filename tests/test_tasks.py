"""Tasks: JSONL / Parquet / row loaders and their errors, checkouts from git mirrors,
repository snapshots, diffs, the task generator."""

import io
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tarfile
import threading
from dataclasses import replace as dataclasses_replace

import numpy as np
import pytest

from envs import taskgen
from envs.tasks import (Task, TaskFormatError, apply_patch, checkout, default_test_command,
                        load_problems_jsonl, load_repo_files, load_swe_jsonl, load_swe_parquet,
                        load_swe_rows, load_tasks, make_patch, pytest_command, reference_files,
                        reverse_patch, script_command, task_to_swe_dict)

ROOT = os.path.join(os.path.dirname(__file__), "..")
DATA = os.path.join(ROOT, "envs", "data", "swe", "tasks.jsonl")
BUNDLED = ["intervals-1", "roman-1", "textstats-1", "slugs-1", "units-1"]
# The official fields of a SWE-bench row (swebench.types.SWEbenchInstance).
OFFICIAL = {"repo", "instance_id", "base_commit", "patch", "test_patch", "problem_statement",
            "hints_text", "created_at", "version", "FAIL_TO_PASS", "PASS_TO_PASS",
            "environment_setup_commit"}
GOOD_SWE = {"instance_id": "t-1", "repo_path": "repo", "problem_statement": "Fix it.",
            "FAIL_TO_PASS": ["tests/test_a.py::test_x"], "PASS_TO_PASS": []}


# Every commit of the test mirrors has this author, committer and date, so a commit id depends
# only on the files, the message and the parent: the bundled rows' base_commit is the commit of
# their repository directory made by `commit_files`.
GIT_IDENT = b"Arbor Examples <examples@arbor.invalid> 1767225600 +0000"


def commit_files(git_dir, files, branch="main", message="Snapshot", parent=None) -> str:
  """Commits exactly `files` ({path: bytes}, mode 100644) to `branch` of a bare repository
  (made if missing) with git fast-import; returns the commit id."""
  if not os.path.isdir(git_dir):
    subprocess.run(["git", "init", "-q", "--bare", "--initial-branch=main", str(git_dir)],
                   check=True)
  data = lambda b: b"data %d\n%s\n" % (len(b), b)  # noqa: E731
  stream = [b"commit refs/heads/%s\n" % branch.encode(), b"author " + GIT_IDENT + b"\n",
            b"committer " + GIT_IDENT + b"\n", data(message.encode())]
  if parent:
    stream.append(b"from %s\n" % parent.encode())
  stream.append(b"deleteall\n")
  for path, content in sorted(files.items()):
    stream += [b"M 100644 inline %s\n" % path.encode(), data(content)]
  subprocess.run(["git", "--git-dir", str(git_dir), "fast-import", "--quiet"],
                 input=b"".join(stream), check=True, capture_output=True)
  return subprocess.run(["git", "--git-dir", str(git_dir), "rev-parse", f"refs/heads/{branch}"],
                        check=True, capture_output=True, text=True).stdout.strip()


def bundled_rows() -> list[dict]:
  with open(DATA) as f:
    return [json.loads(line) for line in f]


def official_rows() -> list[dict]:
  """The bundled rows as a SWE-bench dataset has them: no repo_path, no extra phrasings."""
  return [{k: v for k, v in row.items() if k not in ("repo_path", "problem_statements")}
          for row in bundled_rows()]


def make_mirror(root) -> str:
  """A directory of git mirrors of the bundled repositories (each directory committed by
  `commit_files`); slugs is a normal clone under owner/name, the others bare owner__name.git."""
  root = str(root)
  for row in bundled_rows():
    owner, name = row["repo"].split("/")
    files = load_repo_files(os.path.join(os.path.dirname(DATA), row["repo_path"]))
    bare = os.path.join(root, f"{owner}__{name}.git")
    assert commit_files(bare, files) == row["base_commit"], row["instance_id"]
    if name == "slugs":
      subprocess.run(["git", "clone", "-q", bare, os.path.join(root, owner, name)], check=True)
      shutil.rmtree(bare)
  return root


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
  return make_mirror(tmp_path_factory.mktemp("mirror"))


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
  assert [t.instance_id for t in tasks] == BUNDLED
  for row, t in zip(bundled_rows(), tasks):
    assert OFFICIAL <= set(row) and isinstance(row["FAIL_TO_PASS"], str)  # as SWE-bench has it
    assert t.kind == "swe" and os.path.isdir(t.repo_path) and len(t.problem_statements) == 3
    assert t.fail_to_pass and t.pass_to_pass and t.patch and t.test_patch
    assert t.repo.startswith("arbor-examples/") and len(t.base_commit) == 40
    assert t.metadata["environment_setup_commit"] == t.base_commit
    files = load_repo_files(t)
    assert reference_files(t) != files and set(reference_files(t)) == set(files)
    # The failing tests come with the test patch: the agent's checkout does not have them.
    with_tests = apply_patch(files, t.test_patch)
    for test in t.fail_to_pass:
      name = test.split("::")[-1].split(" ")[0].encode()
      assert not any(name in data for data in files.values()), test
      assert any(name in data for data in with_tests.values()), test
  runners = {t.instance_id: (t.test_runner, t.test_command) for t in tasks}
  assert runners["intervals-1"] == ("pytest", "python3 -m pytest -rA tests/test_merge.py")
  # SWE-bench's Django command, with the test patch's module as a label relative to tests/.
  assert runners["slugs-1"] == ("django", "python3 tests/runtests.py --verbosity 2 "
                                "--settings=test_sqlite --parallel 1 slugs_tests.tests")
  units = tasks[BUNDLED.index("units-1")]
  assert "@pytest.mark.xfail" in load_repo_files(units)["tests/test_convert.py"].decode()
  assert "tests/test_convert.py::test_kelvin" in units.pass_to_pass


def test_swe_records_round_trip(tmp_path):
  # A copy of the bundled set: a row's repo_path lies inside the folder of its file.
  shutil.copytree(os.path.dirname(DATA), tmp_path / "swe")
  tasks = load_swe_jsonl(str(tmp_path / "swe" / "tasks.jsonl"))
  rows = [task_to_swe_dict(t, os.path.relpath(t.repo_path, tmp_path)) for t in tasks]
  assert load_swe_jsonl(write_lines(tmp_path / "copy.jsonl", rows)) == tasks


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
         "PASS_TO_PASS": "[]", "base_commit": "abc123", "problem_statements": ["Again."],
         "hints_text": "", "version": "0.1", "image_name": "img:1"}
  (task,) = load_swe_jsonl(write_lines(swe_dir / "t.jsonl", [rec]))
  assert task.fail_to_pass == ("tests/test_a.py::test_x",) and task.pass_to_pass == ()
  assert task.test_command == "python3 -m pytest -rA tests/test_a.py"
  assert task.problem_statements == ("Fix it.", "Again.")
  assert (task.base_commit, task.image_name) == ("abc123", "img:1")
  assert task.metadata == {"hints_text": "", "version": "0.1"}
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
    ({**GOOD_SWE, "log_parser": "parse_log_gotest"}, "'log_parser': 'parse_log_gotest'"),
    ({**GOOD_SWE, "log_parser": "parse_log_django", "test_command": "python3 -m pytest"},
     "'test_command'"),
    ({k: v for k, v in GOOD_SWE.items() if k != "repo_path"}, "'repo_path': missing"),
    ({k: v for k, v in GOOD_SWE.items() if k != "repo_path"} | {"repo": "a/b"},
     "'repo': 'a/b' needs a mirror"),
])
def test_bad_swe_lines_name_file_line_and_field(swe_dir, monkeypatch, line, field):
  monkeypatch.delenv("ARBOR_SWE_MIRROR", raising=False)
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
  assert script_command("PYTHONWARNINGS='ignore::UserWarning' bin/test -C a.py") == (
      {"PYTHONWARNINGS": "ignore::UserWarning"}, "python3", "bin/test", ["-C", "a.py"])
  assert script_command("/venv/bin/python ./tests/runtests.py --verbosity 2") == (
      {}, "/venv/bin/python", "tests/runtests.py", ["--verbosity", "2"])
  for bad in ("python3 -m pytest", "python3 ../x.py", "/abs/runtests.py", "A=1", "python3"):
    with pytest.raises(ValueError, match="test_command="):
      script_command(bad)


def _touching(*paths):
  return "".join(f"diff --git a/{p} b/{p}\n--- a/{p}\n+++ b/{p}\n@@ -1 +1 @@\n-a\n+b\n"
                 for p in paths)


def test_default_commands_are_swebench_s():
  """The commands of SWE-bench's evaluation scripts (django__django-11848 runs
  `./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 utils_tests.test_http`,
  sympy__sympy-20590 `PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C
  --verbose sympy/core/tests/test_basic.py`), with the sandbox's python3 named."""
  django = _touching("django/utils/http.py", "tests/utils_tests/test_http.py",
                     "docs/releases/3.1.txt")
  assert default_test_command([], "django", django) == (
      "python3 tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 "
      "utils_tests.test_http")
  assert default_test_command([], "django", django, "1.9") == (
      "python3 tests/runtests.py --verbosity 2 utils_tests.test_http")
  assert default_test_command([], "sympy", _touching("sympy/core/tests/test_basic.py")) == (
      "PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' python3 bin/test -C "
      "--verbose sympy/core/tests/test_basic.py")
  # pytest: the test patch's files (data files left out), else the files of the test ids
  assert default_test_command(["a/test_x.py::t"], "pytest", _touching(
      "tests/test_io.py", "tests/data/x.json")) == "python3 -m pytest -rA tests/test_io.py"
  assert default_test_command(["a/test_x.py::t", "b c.py::u"]) == (
      "python3 -m pytest -rA a/test_x.py 'b c.py'")


def test_task_validation_names_the_field():
  with pytest.raises(ValueError, match="kind='essay'"):
    Task("x", "essay", ("p",))
  with pytest.raises(ValueError, match="problem_statements"):
    Task("x", "exact", (), answers=("1",))
  with pytest.raises(ValueError, match="fail_to_pass"):
    Task("x", "swe", ("p",), repo_path="/r", test_command="pytest")
  with pytest.raises(ValueError, match="test_command='tox'"):
    Task("x", "swe", ("p",), repo_path="/r", fail_to_pass=("a.py::t",), test_command="tox")
  with pytest.raises(ValueError, match="repo_path=None"):
    Task("x", "swe", ("p",), mirror="/m", fail_to_pass=("a.py::t",), test_command="pytest")
  with pytest.raises(ValueError, match="test_runner='nose'"):
    Task("x", "swe", ("p",), repo_path="/r", fail_to_pass=("a.py::t",), test_command="pytest",
         test_runner="nose")
  with pytest.raises(ValueError, match="pytest node ids"):
    Task("x", "swe", ("p",), repo_path="/r", fail_to_pass=("test_a (m.C)",),
         test_command="pytest")
  django = Task("x", "swe", ("p",), repo_path="/r", fail_to_pass=("test_a (m.C)",),
                test_command="python3 tests/runtests.py", test_runner="django")
  assert django.script_command() == ({}, "python3", "tests/runtests.py", [])


# ----------------------------------------------------------------------------- mirrors


def test_official_rows_check_out_from_a_mirror(mirror, tmp_path):
  """Rows as SWE-bench publishes them (no repo_path) read from a git mirror give the same tasks
  as the bundled directories, from JSONL, from dicts and from Parquet (list-typed columns)."""
  cache = tmp_path / "cache"
  rows = official_rows()
  tasks = load_swe_jsonl(write_lines(tmp_path / "rows.jsonl", rows), mirror=mirror,
                         cache_dir=str(cache))
  fields = ("fail_to_pass", "pass_to_pass", "test_command", "test_runner", "patch",
            "test_patch", "base_commit", "repo")
  for task, bundled in zip(tasks, load_swe_jsonl(DATA)):
    assert task.repo_path is None and task.mirror.startswith(mirror)
    assert [getattr(task, f) for f in fields] == [getattr(bundled, f) for f in fields]
    assert load_repo_files(task) == load_repo_files(bundled)
    assert reference_files(task) == reference_files(bundled)
  # One checkout per (repo, commit), renamed into place: no temporary directory is left.
  assert sorted(os.listdir(cache)) == sorted(r["repo"].replace("/", "__") for r in rows)
  for row in rows:
    assert os.listdir(cache / row["repo"].replace("/", "__")) == [row["base_commit"]]
  # Reused, not redone: a file added to the cached checkout shows up.
  (cache / "arbor-examples__roman" / rows[1]["base_commit"] / "marker.txt").write_text("m")
  assert "marker.txt" in load_repo_files(tasks[1])
  assert load_swe_rows(rows, mirror=mirror, cache_dir=str(cache)) == tasks
  # Parquet / Hugging Face datasets rows: test lists as list columns (SWE-Gym, SWE-smith).
  import pyarrow as pa
  import pyarrow.parquet as pq
  columns = sorted(set().union(*rows))  # a row without a column reads None: not given
  listed = [{**{k: r.get(k) for k in columns}, "FAIL_TO_PASS": json.loads(r["FAIL_TO_PASS"]),
             "PASS_TO_PASS": json.loads(r["PASS_TO_PASS"])} for r in rows]
  pq.write_table(pa.Table.from_pylist(listed), tmp_path / "rows.parquet")
  from_parquet = load_tasks(str(tmp_path / "rows.parquet"), mirror=mirror, cache_dir=str(cache))
  assert from_parquet == load_swe_parquet(str(tmp_path / "rows.parquet"), mirror=mirror,
                                          cache_dir=str(cache))
  strip = lambda t: dataclasses_replace(t, metadata={})  # noqa: E731
  assert [strip(t) for t in from_parquet] == [strip(t) for t in tasks]
  numpy_lists = [{**r, "FAIL_TO_PASS": np.array(r["FAIL_TO_PASS"])} for r in listed]
  assert [t.fail_to_pass for t in load_swe_rows(numpy_lists, mirror=mirror,
                                                cache_dir=str(cache))] == [
      t.fail_to_pass for t in tasks]


def test_mirror_errors_name_the_field(mirror, tmp_path, monkeypatch):
  monkeypatch.delenv("ARBOR_SWE_MIRROR", raising=False)
  row = official_rows()[0]
  kw = dict(mirror=mirror, cache_dir=str(tmp_path))
  for bad, kwargs, message in [
      (row, {}, "field 'repo': 'arbor-examples/intervals' needs a mirror"),
      ({**row, "repo": "arbor-examples/nowhere"}, kw,
       "field 'repo': 'arbor-examples/nowhere': no git mirror of it"),
      ({**row, "repo": "../etc"}, kw, "field 'repo': '../etc': expected 'owner/name'"),
      ({**row, "base_commit": "0" * 40}, kw, f"field 'base_commit': '{'0' * 40}': no such"),
      ({**row, "base_commit": "--output=/tmp/x"}, kw, "field 'base_commit': '--output"),
      ({k: v for k, v in row.items() if k != "base_commit"}, kw, "field 'base_commit': missing")]:
    with pytest.raises(TaskFormatError) as e:
      load_swe_rows([bad], source="split", **kwargs)
    assert str(e.value).startswith("split[0]: ") and message in str(e.value), str(e.value)
  # The environment names the mirror and the cache when the loader is not told.
  monkeypatch.setenv("ARBOR_SWE_MIRROR", mirror)
  monkeypatch.setenv("ARBOR_SWE_CACHE", str(tmp_path / "env-cache"))
  (task,) = load_swe_rows([row])
  assert task.cache_dir == str(tmp_path / "env-cache") and load_repo_files(task)


def test_concurrent_checkouts_agree(mirror, tmp_path):
  (task,) = load_swe_rows([official_rows()[3]], mirror=mirror, cache_dir=str(tmp_path))
  got = []
  threads = [threading.Thread(target=lambda: got.append(
      checkout(task.mirror, task.base_commit, task.cache_dir, task.repo))) for _ in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(got) == 4 and len(set(got)) == 1
  assert os.listdir(tmp_path / "arbor-examples__slugs") == [task.base_commit]
  assert load_repo_files(got[0]) == load_repo_files(
      os.path.join(os.path.dirname(DATA), "repos", "slugs-1"))


def make_smith_mirror(root, removal: bool = True):
  """A SWE-smith style mirror of textstats: "main" is the fixed code; the branch named after the
  instance holds the "Bug Patch" commit and (with `removal`) "Remove F2P Tests", which deletes
  the test file. Returns (the row as SWE-smith publishes it, the files of each commit)."""
  bundled = load_swe_jsonl(DATA)[BUNDLED.index("textstats-1")]
  buggy = apply_patch(load_repo_files(bundled), bundled.test_patch)
  clean = apply_patch(buggy, bundled.patch)
  hidden = {p: d for p, d in buggy.items() if p != "tests/test_stats.py"}
  git_dir = os.path.join(str(root), "swesmith__arbor-examples__textstats.441e99b4.git")
  instance_id = "arbor-examples__textstats.441e99b4.func_pm_op_change__" + (
      "k2x9" if removal else "a0b1")
  clean_id = commit_files(git_dir, clean, "main", "Initial commit")
  head = commit_files(git_dir, buggy, instance_id, "Bug Patch", clean_id)
  if removal:
    head = commit_files(git_dir, hidden, instance_id, "Remove F2P Tests", head)
  row = {"instance_id": instance_id, "repo": "swesmith/arbor-examples__textstats.441e99b4",
         "patch": make_patch(clean, buggy), "FAIL_TO_PASS": list(bundled.fail_to_pass),
         "PASS_TO_PASS": list(bundled.pass_to_pass),
         "image_name": "jyangballin/swesmith.x86_64.arbor-examples_1776_textstats.441e99b4",
         "problem_statement": bundled.problem_statement}
  return row, dict(clean=clean, buggy=buggy, hidden=hidden, head=head)


def test_swe_smith_rows(tmp_path):
  """SWE-smith: no base_commit (the branch named after the instance), the row's patch brings
  the bug (its reverse is the fix), the failing tests come back from the parent commit."""
  row, c = make_smith_mirror(tmp_path)
  kw = dict(mirror=str(tmp_path), cache_dir=str(tmp_path / "cache"))
  (task,) = load_swe_rows([row], **kw)
  assert task.base_commit == c["head"] and task.image_name == row["image_name"]
  assert load_repo_files(task) == c["hidden"]                       # the agent's checkout
  assert apply_patch(c["hidden"], task.test_patch) == c["buggy"]    # the verifier's tests
  assert reference_files(task) == {p: d for p, d in c["clean"].items() if p in c["hidden"]}
  assert load_swe_rows([task_to_swe_dict(task)], **kw) == [task]    # written back, read again
  # A branch without the removal commit starts from the bug with its tests in place.
  row, c = make_smith_mirror(tmp_path, removal=False)
  (task,) = load_swe_rows([row], **kw)
  assert task.test_patch == "" and load_repo_files(task) == c["buggy"]


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


def test_reverse_patch_undoes():
  old = {"a.py": b"1\n2\n3\n4\n5\n", "gone.py": b"bye\n", "t.txt": b"no newline"}
  new = {"a.py": b"1\nTWO\n3\n4\n5\n6\n", "n/f.py": b"hi\n", "t.txt": b"no newline!"}
  patch = make_patch(old, new)
  assert apply_patch(new, reverse_patch(patch)) == old
  assert reverse_patch(reverse_patch(patch)) == patch
  # git's headers: a created file becomes a deleted one, the blob ids swap
  git_style = ("diff --git a/x.py b/x.py\nnew file mode 100644\nindex 0000000..7898192\n"
               "--- /dev/null\n+++ b/x.py\n@@ -0,0 +1 @@\n+a\n")
  assert reverse_patch(git_style) == (
      "diff --git a/x.py b/x.py\ndeleted file mode 100644\nindex 7898192..0000000\n"
      "--- a/x.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-a\n")
  assert apply_patch(apply_patch({}, git_style), reverse_patch(git_style)) == {}


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


def test_run_configs_name_the_mirror(mirror, tmp_path):
  """config.rl.swe_mirror / swe_cache reach the loader of rl.tasks and eval.tasks (a Parquet
  file of official rows here), as the rollout worker's --swe_mirror does."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  from configs.base import base_config
  from trainer.tasks import TaskSource, held_out_tasks
  path = str(tmp_path / "rows.parquet")
  pq.write_table(pa.Table.from_pylist(official_rows()), path)
  config = base_config()
  config.rl.tasks = config.eval.tasks = path
  config.rl.swe_mirror, config.rl.swe_cache = mirror, str(tmp_path / "cache")
  config.rl.prompts_per_step, config.eval.num_tasks = 2, 2
  tasks = TaskSource(config, str(tmp_path / "work")).for_step(1)
  assert [t.base_commit for t in tasks] == [r["base_commit"] for r in official_rows()[:2]]
  assert held_out_tasks(config, str(tmp_path)) == tasks
  assert load_repo_files(tasks[0])  # checked out (on first use) where the config says
  assert os.listdir(tmp_path / "cache") == [official_rows()[0]["repo"].replace("/", "__")]
