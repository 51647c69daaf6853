"""Datasets are untrusted: loading one must not run its programs or read host files.

- a git mirror or source repository whose own configuration names a program (signature checks,
  fsmonitor, pager, external diff, textconv and filter drivers ...) and whose head commit is
  signed: loading its rows, synthesising from it and reading its commits run nothing; a
  repository owned by another user, linked into the mirror folder, or borrowing objects from
  outside it is refused;
- row paths (`repo_path`, `rootfs`) stay inside the dataset's folder: no absolute path, "..",
  "~" or symbolic link;
- a Terminal-Bench-style task folder with a linked file or folder is refused, and no content of
  the link's target reaches a task;
- a task-file line nested thousands deep is a bad line (skipped with its reason), not a
  RecursionError that ends the load.
"""

import json
import os
import re
import shutil
import subprocess

import pytest

from envs import safe_git
from envs.mutate import commit_reverts
from envs.synth import load_source
from envs.episode import load_task_file
from envs.tasks import TaskFormatError, load_repo_files, load_swe_jsonl, load_swe_rows, \
    load_tasks
from envs.terminal_bench import load_terminal_bench, reference_solution

ENV = {"PATH": os.environ["PATH"], "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1",
       "GIT_CONFIG_GLOBAL": os.devnull, "GIT_AUTHOR_NAME": "A", "GIT_AUTHOR_EMAIL": "a@example.com",
       "GIT_COMMITTER_NAME": "A", "GIT_COMMITTER_EMAIL": "a@example.com"}
IID = "me__calc.abc123.func_pm__x1"
ROW = {"instance_id": IID, "repo": "swesmith/me__calc.abc123", "problem_statement": "Fix add.",
       "FAIL_TO_PASS": ["tests/test_calc.py::test_add"], "PASS_TO_PASS": []}
SECRET = "TOP-SECRET-HOST-DATA"


def git(*args, cwd=None, stdin=None) -> str:
  res = subprocess.run(["git", *args], cwd=cwd, input=stdin, capture_output=True, text=True,
                       env=ENV)
  assert res.returncode == 0, res.stderr
  return res.stdout.strip()


def signed_commit(git_dir, tree, parent, message) -> str:
  """A commit object with a (made-up) PGP signature header, written by hand."""
  body = (f"tree {tree}\nparent {parent}\n"
          "author A <a@example.com> 1767225600 +0000\n"
          "committer A <a@example.com> 1767225600 +0000\n"
          "gpgsig -----BEGIN PGP SIGNATURE-----\n \n iQEzBAABCAAdFiEE\n =abcd\n"
          " -----END PGP SIGNATURE-----\n\n" + message + "\n")
  return git("--git-dir", str(git_dir), "hash-object", "-t", "commit", "-w", "--stdin",
             stdin=body)


def make_hostile(git_dir, evil) -> None:
  """Configuration (and attributes) of `git_dir` that name `evil` wherever git allows."""
  for key, value in (("log.showSignature", "true"), ("gpg.program", evil),
                     ("gpg.ssh.program", evil), ("gpg.x509.program", evil),
                     ("core.fsmonitor", evil), ("core.pager", evil), ("pager.log", evil),
                     ("diff.external", evil), ("diff.evil.textconv", evil),
                     ("diff.evil.command", evil), ("filter.evil.smudge", evil),
                     ("filter.evil.clean", evil), ("core.sshCommand", evil),
                     ("core.askPass", evil), ("credential.helper", "!" + evil),
                     ("core.alternateRefsCommand", evil), ("core.editor", evil),
                     ("uploadpack.packObjectsHook", evil)):
    git("--git-dir", str(git_dir), "config", key, value)
  hooks = os.path.join(git_dir, "evil-hooks")
  os.makedirs(hooks, exist_ok=True)
  for hook in ("post-checkout", "reference-transaction", "pre-auto-gc", "post-index-change"):
    os.symlink(evil, os.path.join(hooks, hook))
  git("--git-dir", str(git_dir), "config", "core.hooksPath", hooks)
  os.makedirs(os.path.join(git_dir, "info"), exist_ok=True)
  with open(os.path.join(git_dir, "info", "attributes"), "w") as f:
    f.write("* diff=evil filter=evil\n")


@pytest.fixture
def hostile(tmp_path):
  """(work tree, mirror folder, canary file, evil program): a repository whose head commit
  ("Remove F2P Tests", signed) removes a test and changes a function, its configuration naming
  the evil program; and a bare mirror of it (swesmith style) configured the same way."""
  canary = tmp_path / "canary"
  evil = tmp_path / "evil.sh"
  evil.write_text(f'#!/bin/sh\necho "$0 $*" >> {canary}\ncat >/dev/null\nexit 1\n')
  evil.chmod(0o755)
  src = tmp_path / "src"
  (src / "calc").mkdir(parents=True)
  (src / "tests").mkdir()
  (src / "calc" / "__init__.py").write_text("def add(a, b):\n  return a + b\n")
  (src / "tests" / "test_calc.py").write_text(
      "from calc import add\n\ndef test_add():\n  assert add(1, 2) == 3\n")
  git("init", "-q", "--initial-branch=main", cwd=src)
  git("add", "-A", cwd=src)
  git("commit", "-q", "-m", "Bug Patch", cwd=src)
  (src / "tests" / "test_calc.py").unlink()
  (src / "calc" / "__init__.py").write_text("def add(a, b):\n  return a - b\n")
  git("add", "-A", cwd=src)
  tree = git("write-tree", cwd=src)
  head = signed_commit(src / ".git", tree, git("rev-parse", "HEAD", cwd=src), "Remove F2P Tests")
  git("update-ref", "refs/heads/main", head, cwd=src)
  mirror = tmp_path / "mirror"
  mirror.mkdir()
  bare = mirror / "swesmith__me__calc.abc123.git"
  git("clone", "-q", "--bare", str(src), str(bare))
  git("--git-dir", str(bare), "branch", IID, head)
  make_hostile(src / ".git", str(evil))
  make_hostile(bare, str(evil))
  return src, mirror, canary, str(evil)


def test_fixture_runs_its_program_under_plain_git(hostile):
  src, mirror, canary, _ = hostile
  bare = str(mirror / "swesmith__me__calc.abc123.git")
  subprocess.run(["git", "-c", "safe.directory=*", "--git-dir", bare, "log", "-1", IID],
                 capture_output=True, env=ENV)
  assert canary.exists() and "--verify" in canary.read_text()
  canary.unlink()
  subprocess.run(["git", "-C", str(src), "status"], capture_output=True, env=ENV)  # fsmonitor
  assert canary.exists()


def test_rows_synth_and_reverts_on_a_hostile_repository_run_nothing(hostile, tmp_path):
  src, mirror, canary, _ = hostile
  (task,) = load_swe_rows([ROW], mirror=str(mirror), cache_dir=str(tmp_path / "cache"))
  assert "tests/test_calc.py" in task.test_patch            # the parent's test file
  assert load_repo_files(task) == {"calc/__init__.py": b"def add(a, b):\n  return a - b\n"}
  source = load_source(str(src), str(tmp_path / "work"))
  assert source.files == load_repo_files(task) and source.created_at == "2026-01-01T00:00:00Z"
  (revert,) = commit_reverts(str(src))
  assert revert.function == "add" and "a + b" in revert.source
  assert safe_git.read_blob(safe_git.find_git_dir(str(src)), "HEAD~1", "tests/test_calc.py")
  assert not canary.exists(), canary.read_text()


def test_repository_of_another_user_is_refused(hostile, tmp_path):
  if os.geteuid() != 0:
    pytest.skip("changing a file's owner needs root")
  src, mirror, canary, _ = hostile
  for dirpath, _, filenames in os.walk(mirror):
    for name in [dirpath] + [os.path.join(dirpath, f) for f in filenames]:
      os.chown(name, 12345, 12345, follow_symlinks=False)
  with pytest.raises(TaskFormatError, match=r"field 'repo'.*owned by uid 12345"):
    load_swe_rows([ROW], mirror=str(mirror), cache_dir=str(tmp_path / "cache"))
  errors = []
  assert load_swe_rows([ROW], skip_bad=True, errors=errors, mirror=str(mirror),
                       cache_dir=str(tmp_path / "cache")) == []
  assert "owned by uid 12345" in str(errors[0]) and "swesmith__me__calc" in str(errors[0])
  os.chown(src / ".git" / "config", 12345, 12345)  # a source repository's configuration
  with pytest.raises(ValueError, match="owned by uid 12345"):
    load_source(str(src), str(tmp_path / "work"))
  with pytest.raises(ValueError, match="owned by uid 12345"):
    commit_reverts(str(src))
  assert not canary.exists()


def test_mirror_links_and_outside_alternates_are_refused(hostile, tmp_path):
  _, mirror, canary, _ = hostile
  bare = mirror / "swesmith__me__calc.abc123.git"
  elsewhere = tmp_path / "elsewhere.git"
  bare.rename(elsewhere)
  bare.symlink_to(elsewhere)                         # the mirror entry is a link
  with pytest.raises(TaskFormatError, match=r"field 'repo'.*symbolic link"):
    load_swe_rows([ROW], mirror=str(mirror), cache_dir=str(tmp_path / "cache"))
  bare.unlink()
  shutil.copytree(elsewhere, bare, symlinks=True)    # a real copy ...
  (bare / "config").unlink()
  (bare / "config").symlink_to(elsewhere / "config")  # ... whose config is a link
  with pytest.raises(TaskFormatError, match=r"config: a symbolic link"):
    load_swe_rows([ROW], mirror=str(mirror), cache_dir=str(tmp_path / "cache"))
  (bare / "config").unlink()
  shutil.copy(elsewhere / "config", bare / "config")
  (bare / "objects" / "info" / "alternates").write_text(str(elsewhere / "objects") + "\n")
  with pytest.raises(TaskFormatError, match=r"alternate .* lies outside"):
    load_swe_rows([ROW], mirror=str(mirror), cache_dir=str(tmp_path / "cache"))
  for repo in ("../mirror", "/abs/x", "a/../../b"):
    with pytest.raises(TaskFormatError, match=r"field 'repo'"):
      load_swe_rows([dict(ROW, repo=repo)], mirror=str(mirror))
  assert not canary.exists()


# ----------------------------------------------------------------------------- row paths

GOOD = {"instance_id": "t-1", "repo_path": "repo", "problem_statement": "Fix it.",
        "FAIL_TO_PASS": ["tests/test_a.py::test_x"], "PASS_TO_PASS": []}


@pytest.fixture
def dataset(tmp_path):
  """(dataset folder, host folder outside it holding a secret): a repo, links out, a rootfs."""
  data, outside = tmp_path / "data", tmp_path / "host"
  (data / "repo").mkdir(parents=True)
  (data / "repo" / "a.py").write_text("A = 1\n")
  (data / "image").mkdir()
  outside.mkdir()
  (outside / "secret.py").write_text(f"KEY = {SECRET!r}\n")
  (data / "link").symlink_to(outside)
  (data / "sub").mkdir()
  (data / "sub" / "inner").symlink_to(outside)
  (data / "repo.tar").symlink_to(outside / "secret.py")
  return data, outside


@pytest.mark.parametrize("field,value,reason", [
    ("repo_path", "/etc", "absolute paths are not allowed"),
    ("repo_path", "../host", "'..' is not allowed"),
    ("repo_path", "repo/../../host", "'..' is not allowed"),
    ("repo_path", "~", "'~' is not expanded"),
    ("repo_path", "~/x", "'~' is not expanded"),
    ("repo_path", "link", "symbolic link"),
    ("repo_path", "sub/inner", "symbolic link"),
    ("repo_path", "link/secret.py", "symbolic link"),
    ("repo_path", "repo.tar", "symbolic link"),
    ("rootfs", "/", "absolute paths are not allowed"),
    ("rootfs", "..", "'..' is not allowed"),
    ("rootfs", "~root", "'~' is not expanded"),
    ("rootfs", "sub/inner", "symbolic link"),
])
def test_row_paths_stay_inside_the_dataset_folder(dataset, field, value, reason):
  data, _ = dataset
  path = data / "tasks.jsonl"
  rows = [dict(GOOD, instance_id="bad", **{field: value}), dict(GOOD, rootfs="image")]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  with pytest.raises(TaskFormatError, match=f"field '{field}': '{value}'.*{reason}"):
    load_swe_jsonl(str(path))
  errors = []
  (task,) = load_swe_jsonl(str(path), skip_bad=True, errors=errors)
  assert task.repo_path == str(data / "repo") and task.rootfs == str(data / "image")
  assert len(errors) == 1 and f"field '{field}'" in str(errors[0]) and reason in str(errors[0])
  with pytest.raises(TaskFormatError, match=reason):  # rows from a split, same rule
    load_swe_rows([rows[0]], base_dir=str(data))


# ----------------------------------------------------------------------------- task folders


def make_tb_task(folder, tests=True):
  (folder / "tests").mkdir(parents=True)
  (folder / "task.yaml").write_text("instruction: Count the lines.\n")
  (folder / "setup.sh").write_text("echo hi > a.txt\n")
  (folder / "run-tests.sh").write_text("bash $TEST_DIR/check.sh\n")
  (folder / "solution.sh").write_text("wc -l a.txt\n")
  (folder / "tests" / "test_outputs.py").write_text("def test_x():\n  pass\n")


@pytest.mark.parametrize("linked", ["tests", "tests/test_outputs.py", "tests/data.txt",
                                    "setup.sh", "run-tests.sh", "task.yaml", "solution.sh",
                                    "<task folder>"])
def test_terminal_bench_links_are_refused(tmp_path, linked):
  host = tmp_path / "host"
  host.mkdir()
  (host / "secret.txt").write_text(f"instruction: {SECRET}\n")
  (host / "tests").mkdir()
  (host / "tests" / "test_outputs.py").write_text(f"# {SECRET}\n")
  tasks = tmp_path / "tasks"
  make_tb_task(tasks / "good")
  bad = tasks / "bad"
  if linked == "<task folder>":
    make_tb_task(host / "task")
    (host / "task" / "setup.sh").write_text(f"echo {SECRET}\n")
    bad.symlink_to(host / "task")
    shown = "bad"
  else:
    make_tb_task(bad)
    target = host / ("tests" if linked == "tests" else "secret.txt")
    if (bad / linked).is_dir():
      shutil.rmtree(bad / linked)
    elif (bad / linked).exists():
      (bad / linked).unlink()
    (bad / linked).symlink_to(target)
    shown = linked
  with pytest.raises(TaskFormatError, match=rf"{re.escape(str(tasks))}.*'{shown}'.*symbolic link"):
    load_terminal_bench(str(tasks))
  errors = []
  (good,) = load_terminal_bench(str(tasks), skip_bad=True, errors=errors)
  assert good.instance_id == "good" and len(errors) == 1 and "symbolic link" in str(errors[0])
  assert SECRET not in repr(good) and SECRET not in reference_solution(good)
  if linked != "<task folder>":
    with pytest.raises(ValueError, match="symbolic link"):
      load_terminal_bench(str(bad))  # the task folder given directly


def test_deeply_nested_task_lines_are_bad_lines(tmp_path):
  good = {"id": "hi", "kind": "exact", "prompt": "Say hi.", "answer": "hi"}
  path = tmp_path / "tasks.jsonl"
  for first in (True, False):  # the first line also decides which loader reads the file
    deep = "[" * 50_000 + "]" * 50_000
    lines = [deep, json.dumps(good)] if first else [json.dumps(good), deep]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TaskFormatError, match="max_json_depth"):
      load_tasks(str(path))
    errors = []
    assert [t.instance_id for t in load_tasks(str(path), skip_bad=True, errors=errors)] == ["hi"]
    assert len(errors) == 1 and "max_json_depth" in str(errors[0])
    tasks, skipped = load_task_file(str(path))
    assert [t.instance_id for t in tasks] == ["hi"] and skipped == 1
