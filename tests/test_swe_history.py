"""SWE-bench rows made from a real repository's own history, graded as swebench grades them.

tests/data/parse_type-2020-09.bundle is a shallow git bundle of the public repository
https://github.com/jenisys/parse_type (branch main, its four commits from
b8a41ee4e2abf4b8cf60b4477b776d0384ed4738, 2019-12-15, the shallow boundary, to
a858873620d00766102cceb00e618722db579e18, 2020-09-10; every tree keeps the project's LICENSE
file, BSD at these commits, MIT since 2023). Two upstream changes become rows the way
SWE-bench makes them: base_commit the commit's parent, patch its non-test diff, test_patch its
test diff, FAIL_TO_PASS / PASS_TO_PASS found by running the tests
before and after the fix in the environment, which `envs.environments.sources.from_repository`
derives from the repository at environment_setup_commit (the v0.5.4 commit). The tests need
`parse`, pytest-html and pytest-metadata, none of which the host's /usr/bin/python3 has.

Predictions gold, empty and wrong (a plausible fix that is not one) are graded by
`python -m envs.evaluate` on --backend bwrap and --backend docker: swebench 5's
`make_run_report`, `get_eval_report` and pytest log parser read the same verdicts and statuses
from the logs it writes. Network: PyPI (the environment's pip step, once; cached by content).

Environment notes. The repository's setup.py of 2020 sets use_2to3, which setuptools >= 58
refuses, and an older setuptools' `setup.py develop` targets /usr/lib/python3.X/site-packages
under Debian's python: the environment holds the dependencies only (install=False) and the
tests import parse_type from the checkout (pytest's rootdir on sys.path). Its pytest.ini
addopts use pytest-html's and pytest-metadata's options (--html, --metadata): the grader's
pytest loads the plugins installed in the environment, as pytest -rA does under swebench.
The latest releases of the dependencies pass the tests, so none is pinned.
"""

import asyncio
import json
import os
import random
import shutil
import subprocess
import time

import pytest
from swebench.harness.constants import END_TEST_OUTPUT, START_TEST_OUTPUT
from swebench.harness.grading import get_eval_report
from swebench.harness.log_parsers import PARSER_REGISTRY

from envs import evaluate
from envs import tasks as tasks_lib
from envs.environments import build, sources
from envs.sandbox import Limits, create_sandbox
from envs.verifiers import swe
from envs.verifiers.swe import junit_key
from tests.test_predictions import spec, swebench_run_report

BUNDLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                      "parse_type-2020-09.bundle")
SHALLOW = "b8a41ee4e2abf4b8cf60b4477b776d0384ed4738"  # the bundle's boundary commit
REPO = "jenisys/parse_type"
SETUP_COMMIT = "2fbff325330a47f7157ce6db4f4186262d3b2b20"  # BUMP-VERSION: v0.5.4
FIXES = {  # instance_id -> the upstream commit
    # "MERGE pull-request #122 that fixes issue #121 in parse: int_convert memory effect."
    "jenisys__parse_type-a858873": "a858873620d00766102cceb00e618722db579e18",
    # "UPDATE: parse v1.17.0" (the bundled parse module and its tests)
    "jenisys__parse_type-25c4608": "25c4608a059139ef586b1dc8b62962d13a8aa3d8",
}
# The develop extra's pytest-html (pytest.ini's addopts use its options; pytest-metadata with it).
PYTEST_HTML = "pytest-html >= 1.19.0"
PARSER = PARSER_REGISTRY["parse_log_pytest"]
_BASE = 2_002_600_000 + random.randrange(16) * 32
UIDS = range(_BASE, _BASE + 32)
LIMITS = Limits(memory_mb=1024, pids=128, disk_mb=256, default_timeout=300)
BACKENDS = ["bwrap"] + ([] if os.environ.get("ARBOR_SKIP_DOCKER") == "1" else ["docker"])

pytestmark = pytest.mark.skipif(
    not (os.geteuid() == 0 and shutil.which("bwrap") and shutil.which("mmdebstrap")),
    reason="needs root, bwrap and mmdebstrap")


def _git(git_dir, *args) -> str:
  return subprocess.run(["git", "--git-dir", git_dir, "-c", "core.quotePath=false", *args],
                        check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
  """The bundle unpacked as a mirror directory (MIRROR/jenisys__parse_type.git)."""
  root = tmp_path_factory.mktemp("mirrors")
  git_dir = str(root / "jenisys__parse_type.git")
  subprocess.run(["git", "bundle", "verify", BUNDLE], check=True, capture_output=True)
  subprocess.run(["git", "init", "-q", "--bare", git_dir], check=True)
  with open(os.path.join(git_dir, "shallow"), "w") as f:  # history before it is not bundled
    f.write(SHALLOW + "\n")
  _git(git_dir, "fetch", "-q", BUNDLE, "refs/heads/*:refs/heads/*")
  assert tasks_lib.find_mirror(str(root), REPO) == os.path.realpath(git_dir)
  return str(root), git_dir


@pytest.fixture(scope="module")
def environment(mirror):
  """(environment, root filesystem, {what: seconds}) from the repository's metadata at the
  environment_setup_commit; built once into the shared cache."""
  _, git_dir = mirror
  env = sources.from_repository(sources.GitFiles(git_dir, SETUP_COMMIT), install=False,
                                pins=[PYTEST_HTML])
  seconds = {}
  start = time.monotonic()
  path = build.rootfs(env, progress=lambda line: None)
  seconds["rootfs"] = time.monotonic() - start
  if "docker" in BACKENDS:
    start = time.monotonic()
    build.docker_image(env, progress=lambda line: None)
    seconds["image"] = time.monotonic() - start
  return env, path, seconds


def _split(git_dir: str, fix: str) -> tuple[str, str]:
  """(patch, test_patch): the diff from the fix's parent of its code files, of its test files."""
  paths = _git(git_dir, "diff", "--name-only", f"{fix}~1", fix).split()
  tests = [p for p in paths if p.split("/")[0] in ("tests", "test", "testing")
           or os.path.basename(p).startswith("test_")]
  code = [p for p in paths if p not in tests]
  diff = lambda names: _git(git_dir, "diff", "--no-color", "--no-ext-diff", f"{fix}~1", fix,
                            "--", *names)
  return diff(code), diff(tests)


async def _run_tests(files: dict, rootfs: str, test_command: str) -> dict:
  """swebench's pytest parser's statuses of one run of `test_command` in the environment."""
  _, args = tasks_lib.pytest_command(test_command)
  sb = await create_sandbox("bwrap", limits=LIMITS, uids=UIDS, rootfs=rootfs)
  async with sb:
    for path, data in files.items():
      await sb.write_file(path, data)
    run = await swe.run_pytest(sb, args, timeout=300)
  assert run.error is None, run.log[-3000:]
  return PARSER(run.output, None)


@pytest.fixture(scope="module")
def rows(mirror, environment):
  """The SWE-bench rows, FAIL_TO_PASS / PASS_TO_PASS from runs before and after each fix
  (base_commit with the test patch, then with the patch too), and the runs' statuses."""
  _, git_dir = mirror
  env, rootfs, _ = environment
  out, runs = [], {}
  for iid, fix in FIXES.items():
    base = _git(git_dir, "rev-parse", f"{fix}~1").strip()
    patch, test_patch = _split(git_dir, fix)
    command = " ".join(["python3 -m pytest -rA",
                        *tasks_lib.patch_directives(test_patch)])
    files = tasks_lib.load_repo_files(tasks_lib.checkout(
        git_dir, base, os.path.join(os.path.dirname(git_dir), "checkouts"), REPO))
    before_files = tasks_lib.apply_patch(files, test_patch)

    async def both():
      return await asyncio.gather(
          _run_tests(before_files, rootfs, command),
          _run_tests(tasks_lib.apply_patch(before_files, patch), rootfs, command))
    before, after = asyncio.run(both())
    runs[iid] = before, after
    f2p = sorted(t for t, s in after.items() if s == "PASSED" and before.get(t) != "PASSED")
    p2p = sorted(t for t, s in after.items() if s == "PASSED" and before.get(t) == "PASSED")
    out.append({
        "instance_id": iid, "repo": REPO, "base_commit": base, "patch": patch,
        "test_patch": test_patch, "problem_statement": _git(git_dir, "log", "-1", "--format=%B",
                                                            fix).strip(),
        "hints_text": "", "created_at": _git(git_dir, "log", "-1", "--format=%aI", fix).strip(),
        "version": "0.5", "environment_setup_commit": SETUP_COMMIT,
        "FAIL_TO_PASS": json.dumps(f2p), "PASS_TO_PASS": json.dumps(p2p),
        "test_command": command, "environment": env.to_dict()})
  return out, runs


def _edited(files: dict, path: str, old: str, new: str) -> str:
  text = files[path].decode()
  assert text.count(old) == 1, (path, old)
  return tasks_lib.make_patch(files, {**files, path: text.replace(old, new).encode()})


def _without_hunk(patch: str, header: str) -> str:
  head, sep, rest = patch.partition(header)
  assert sep and header not in rest
  return head + rest[rest.index("\n@@ ") + 1:]


def wrong_patches(git_dir: str, rows: list) -> dict:
  """Plausible fixes that are not ones, by instance_id."""
  by_id = {r["instance_id"]: r for r in rows}
  files = lambda iid: tasks_lib.load_repo_files(tasks_lib.checkout(
      git_dir, by_id[iid]["base_commit"], os.path.join(os.path.dirname(git_dir), "checkouts"),
      REPO))
  return {
      # Detects the base again only while it is still the default: after "0x12" it stays 16.
      "jenisys__parse_type-a858873": _edited(
          files("jenisys__parse_type-a858873"), "parse_type/parse.py",
          "        if self.base is None:\n", "        if self.base is None or self.base == 10:\n"),
      # The update without its pickling change (int_convert stays a closure).
      "jenisys__parse_type-25c4608": _without_hunk(
          by_id["jenisys__parse_type-25c4608"]["patch"], "@@ -467,57 +510,84 @@"),
  }


def _evaluate(rows: list, preds: dict, run_id: str, backend: str, workdir):
  """One `python -m envs.evaluate` run in `workdir`: (our report, swebench's run report)."""
  (workdir / f"{run_id}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in preds.values()))
  argv = ["--dataset", str(workdir / "rows.jsonl"), "--predictions",
          str(workdir / f"{run_id}.jsonl"), "--report", str(workdir / f"{run_id}.json"),
          "--run_id", run_id, "--backend", backend, "--max_workers", "2", "--no_progress"]
  assert evaluate.main(argv) == 0
  ours = json.loads((workdir / f"{run_id}.json").read_text())
  return ours, swebench_run_report(preds, rows, run_id, workdir / f"sb-{run_id}")


@pytest.fixture(scope="module")
def graded(mirror, environment, rows, tmp_path_factory):
  """{backend: {run: (our report, swebench's, predictions, outcomes, log dir, seconds)}} of the
  gold, empty and wrong predictions, each backend graded in a folder of its own."""
  root, git_dir = mirror
  rows, _ = rows
  wrong = wrong_patches(git_dir, rows)
  runs = {"gold": {r["instance_id"]: r["patch"] for r in rows},
          "empty": {r["instance_id"]: "" for r in rows}, "wrong": wrong}
  result = {}
  for backend in BACKENDS:
    workdir = tmp_path_factory.mktemp(backend)
    (workdir / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result[backend] = {}
    with pytest.MonkeyPatch.context() as mp:
      mp.setenv("ARBOR_SWE_MIRROR", root)
      mp.setenv("ARBOR_SWE_CACHE", str(workdir / "cache"))
      mp.chdir(workdir)  # swebench reads logs/run_evaluation of the working directory
      outcomes = {}
      real = swe.grade_submission

      async def spy(task, *args, **kwargs):
        outcomes[task.instance_id] = await real(task, *args, **kwargs)
        return outcomes[task.instance_id]
      mp.setattr(swe, "grade_submission", spy)
      for run_id, patches in runs.items():
        preds = {i: {"instance_id": i, "model_name_or_path": f"m-{run_id}", "model_patch": p}
                 for i, p in patches.items()}
        outcomes.clear()
        start = time.monotonic()
        ours, theirs = _evaluate(rows, preds, run_id, backend, workdir)
        result[backend][run_id] = (ours, theirs, preds, dict(outcomes),
                                   workdir / "logs" / "run_evaluation" / run_id / f"m-{run_id}",
                                   time.monotonic() - start)
  return result



def test_rows_from_history(mirror, environment, rows):
  """The rows' fields, and FAIL_TO_PASS / PASS_TO_PASS as the runs before and after found
  them: each FAIL_TO_PASS test failed before the fix (with the test patch) and passes after."""
  root, git_dir = mirror
  env, rootfs, seconds = environment
  rows, runs = rows
  print(f"environment {env.name}: " + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()))
  assert PYTEST_HTML in env.pip and "pytest" in env.pip and "parse >= 1.9.1" in env.pip
  assert not env.install and rootfs.endswith("/rootfs")
  by_id = {r["instance_id"]: r for r in rows}
  f2p = {i: json.loads(r["FAIL_TO_PASS"]) for i, r in by_id.items()}
  p2p = {i: json.loads(r["PASS_TO_PASS"]) for i, r in by_id.items()}
  assert f2p["jenisys__parse_type-a858873"] == [
      "tests/test_parse.py::TestParse::test_parse_number_twice"]
  assert f2p["jenisys__parse_type-25c4608"] == [
      "tests/test_parse.py::TestBugs::test_pickling_bug_110",
      "tests/test_parse.py::TestBugs::test_search_centered_bug_112",
      "tests/test_parse.py::TestBugs::test_search_left_align_bug_112",
      "tests/test_parse.py::TestBugs::test_tz_compare_to_None",
      "tests/test_parse.py::TestFindall::test_case_sensitivity",
      "tests/test_parse.py::TestParse::test_numbers",
      "tests/test_parse.py::TestParse::test_precision"]
  for iid, fix in FIXES.items():
    row, (before, after) = by_id[iid], runs[iid]
    print(iid, fix[:7], f"FAIL_TO_PASS {len(f2p[iid])}, PASS_TO_PASS {len(p2p[iid])}")
    assert row["base_commit"] == _git(git_dir, "rev-parse", fix + "~1").strip()
    assert tasks_lib.patch_files(row["patch"]) == ["parse_type/parse.py"]
    assert set(tasks_lib.patch_files(row["test_patch"])) <= {"tests/test_parse.py",
                                                             "tests/test_parse_number.py"}
    assert row["created_at"].startswith("2020-09-10T")
    assert all(before[t] == "FAILED" and after[t] == "PASSED" for t in f2p[iid])
    assert len(p2p[iid]) > 70 and all(before[t] == after[t] == "PASSED" for t in p2p[iid])
    assert set(f2p[iid]).isdisjoint(p2p[iid])
  # The number test of the installed parse (fixed upstream since 1.18.0) passes on both sides.
  assert "tests/test_parse_number.py::test_parse_number_twice[0x12-18-12-12]" in \
      p2p["jenisys__parse_type-a858873"]
  # The rows load from the mirror as they are, their environment with them.
  path = os.path.join(os.path.dirname(git_dir), "rows.jsonl")
  with open(path, "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in rows))
  tasks = tasks_lib.load_swe_jsonl(path, mirror=root,
                                   cache_dir=os.path.join(os.path.dirname(git_dir), "checkouts"))
  assert [t.environment for t in tasks] == [env, env]
  assert [t.fail_to_pass for t in tasks] == [tuple(f2p[i]) for i in by_id]
  assert build.for_task(tasks[0], "bwrap") == rootfs
  # The host's python3 lacks the environment's dependency.
  probe = subprocess.run(["/usr/bin/python3", "-c", "import parse"], capture_output=True,
                         text=True)
  assert probe.returncode != 0 and "No module named 'parse'" in probe.stderr


@pytest.mark.parametrize("backend", ["bwrap", "docker"])
def test_predictions_graded_as_swebench_grades_them(rows, graded, backend):
  """Gold resolves, empty and wrong do not; the run reports, each report.json and each
  test's status are what swebench 5 reads from the same logs."""
  if backend not in graded:
    pytest.skip("ARBOR_SKIP_DOCKER=1 (as the docker sandbox tests)")
  rows, _ = rows
  by_id = {r["instance_id"]: r for r in rows}
  ids = sorted(by_id)
  for run_id, (ours, theirs, preds, outcomes, logs, seconds) in graded[backend].items():
    print(f"{backend} {run_id}: {seconds:.1f} s")
    assert ours == theirs, run_id
    assert ours["total_instances"] == ours["submitted_instances"] == 2
    assert ours["error_ids"] == [] and ours["incomplete_ids"] == []
    expected = {"gold": ("resolved_ids", ids), "wrong": ("unresolved_ids", ids),
                "empty": ("empty_patch_ids", ids)}[run_id]
    assert ours[expected[0]] == expected[1], (run_id, ours)
    assert ours["resolved_ids"] == (ids if run_id == "gold" else [])
    assert sorted(outcomes) == ([] if run_id == "empty" else ids)
    for iid in ours["completed_ids"]:
      out = logs / iid
      row, pred = by_id[iid], preds[iid]
      assert (out / "patch.diff").read_text() == pred["model_patch"]
      report = json.loads((out / "report.json").read_text())
      assert report == get_eval_report(spec(row), pred, str(out / "test_output.txt"), True)
      status = report[iid]["tests_status"]
      f2p, p2p = json.loads(row["FAIL_TO_PASS"]), json.loads(row["PASS_TO_PASS"])
      if run_id == "gold":
        assert status["FAIL_TO_PASS"] == {"success": f2p, "failure": []}
        assert status["PASS_TO_PASS"] == {"success": p2p, "failure": []}
      else:  # the wrong fixes fail FAIL_TO_PASS tests (the partial update breaks others too)
        assert status["FAIL_TO_PASS"]["failure"]
        assert bool(status["PASS_TO_PASS"]["failure"]) == (
            iid == "jenisys__parse_type-25c4608")
      # swebench's parser reads from the log the statuses our JUnit report gave.
      log = (out / "test_output.txt").read_text()
      parsed = PARSER(log.split(START_TEST_OUTPUT)[1].split(END_TEST_OUTPUT)[0], None)
      parsed = {k: v.lower() for k, v in parsed.items()}
      run = outcomes[iid].run
      assert len(parsed) == len(run.statuses) > 80
      assert {k: run.statuses.get(junit_key(k)) for k in parsed} == parsed, iid
    if run_id == "wrong":
      failed = lambda iid: json.loads((logs / iid / "report.json").read_text())[iid][
          "tests_status"]["FAIL_TO_PASS"]["failure"]
      assert failed("jenisys__parse_type-a858873") == [
          "tests/test_parse.py::TestParse::test_parse_number_twice"]
      assert "tests/test_parse.py::TestBugs::test_pickling_bug_110" in failed(
          "jenisys__parse_type-25c4608")
