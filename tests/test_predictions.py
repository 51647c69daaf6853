"""`python -m envs.evaluate` graded against swebench 5's own harness: the bundled SWE rows (four
pytest repositories, one with Django's log format, an xfail test in PASS_TO_PASS) and copies of
them under new ids, with gold, wrong, fuzz-applying, non-applying, skip-forcing, empty, no-diff
and missing predictions, graded in bwrap. swebench's `get_eval_report` on each instance's
test_output.txt gives exactly our report.json, its log parsers read our statuses from the same
logs, and its `make_run_report` on our log directory gives exactly our run report. A rerun
reuses finished instances. A sandbox without pytest, and a run that times out, are errors that
say so. Gold predictions of mirrored Parquet rows resolve; --backend docker grades alike.
Patches that need fuzz apply as GNU patch applies them."""

import asyncio
import json
import os
import re
import shutil

import pytest
from swebench.harness.constants import END_TEST_OUTPUT, START_TEST_OUTPUT
from swebench.harness.grading import get_eval_report
from swebench.harness.log_parsers import PARSER_REGISTRY
from swebench.harness.reporting import make_run_report
from swebench import types as swebench_types

from envs import evaluate
from envs.sandbox import ExecResult
from envs.tasks import load_repo_files, load_swe_jsonl, make_patch
from envs.verifiers import swe
from envs.verifiers.swe import junit_key

DATA = os.path.join(os.path.dirname(__file__), "..", "envs", "data", "swe")
with open(os.path.join(DATA, "tasks.jsonl")) as _f:
  ROWS = {r["instance_id"]: r for r in map(json.loads, _f)}
MODEL = "org/model-v1"  # a "/" in the name: its log directory is org__model-v1


def edited(row: dict, path: str, *changes: str) -> str:
  """A patch making the replacements (old, new, old, new, ...) in one file of the row's
  repository."""
  files = load_repo_files(os.path.join(DATA, row["repo_path"]))
  text = files[path].decode()
  for old, new in zip(changes[::2], changes[1::2]):
    assert old in text
    text = text.replace(old, new)
  return make_patch(files, {**files, path: text.encode()})


def predictions() -> dict:
  """instance_id -> model_patch (None: no prediction at all)."""
  ts = ROWS["textstats-1"]["patch"]
  return {
      "intervals-1": ROWS["intervals-1"]["patch"],                              # gold
      "units-1": ROWS["units-1"]["patch"],                   # gold, xfail test in P2P
      "slugs-1": edited(ROWS["slugs-1"], "slugs/text.py", "text.lower()",       # half a fix
                        "text.lower().rstrip('!?. ')"),
      "roman-1": edited(ROWS["roman-1"], "roman.py", '(4, "IV"), ', ""),        # breaks P2P
      # Its second context line is not the repository's: applies with fuzz 2 (patch --fuzz=5).
      "textstats-1": ts.replace(ts.splitlines()[5], ts.splitlines()[5] + "x"),
      "textstats-2": ts.replace('-    for word in text.split(" "):', "-    for w in text:"),
      # Gold, and the code under test skips a PASS_TO_PASS test: a failure, as in swebench.
      "intervals-2": edited(ROWS["intervals-1"], "intervals/merge.py", "    result = []\n",
                            "    if not intervals:\n        import pytest\n"
                            "        pytest.skip('empty')\n    result = []\n",
                            "start < result", "start <= result"),
      "units-2": "",
      "roman-3": "I could not find the bug.\n",  # no diff at all
      "roman-2": None,
  }


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
  """The bundled rows and five copies under new ids, in a folder of their own (repo_path
  is resolved inside the dataset's folder)."""
  root = tmp_path_factory.mktemp("data")
  shutil.copytree(os.path.join(DATA, "repos"), root / "repos")
  copies = ("intervals-2", "units-2", "roman-2", "textstats-2", "roman-3")
  rows = list(ROWS.values()) + [dict(ROWS[i[:-2] + "-1"], instance_id=i) for i in copies]
  (root / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  return root / "tasks.jsonl", rows


def write_predictions(path, patches: dict) -> dict:
  preds = {i: {"instance_id": i, "model_name_or_path": MODEL, "model_patch": p}
           for i, p in patches.items() if p is not None}
  path.write_text("".join(json.dumps(p) + "\n" for p in preds.values()))
  return preds


@pytest.fixture
def outcomes(monkeypatch):
  """The verifications the grader ran, by instance_id."""
  got = {}
  real = swe.grade_submission

  async def spy(task, *args, **kwargs):
    got[task.instance_id] = await real(task, *args, **kwargs)
    return got[task.instance_id]
  monkeypatch.setattr(swe, "grade_submission", spy)
  return got


def spec(row: dict) -> swebench_types.TestSpec:
  """swebench's test spec of a row (no image: only grading reads it)."""
  return swebench_types.TestSpec(
      instance_id=row["instance_id"], image="", eval_script_list=[], repo=row["repo"],
      version=row["version"], FAIL_TO_PASS=json.loads(row["FAIL_TO_PASS"]),
      PASS_TO_PASS=json.loads(row["PASS_TO_PASS"]),
      log_parser=row.get("log_parser", "parse_log_pytest"), eval_type="pass_and_fail")


def swebench_run_report(preds: dict, rows: list, run_id: str, out) -> dict:
  """swebench's make_run_report over the logs in the current directory."""
  path = make_run_report(preds, [{"instance_id": r["instance_id"]} for r in rows], run_id,
                         None, str(out))
  return json.loads(path.read_text())


def test_predictions_graded_as_swebench_grades_them(dataset, tmp_path, monkeypatch, outcomes,
                                                    capsys):
  path, rows = dataset
  monkeypatch.chdir(tmp_path)  # swebench reads logs/run_evaluation of the working directory
  preds = write_predictions(tmp_path / "preds.jsonl", predictions())
  argv = ["--dataset", str(path), "--predictions", str(tmp_path / "preds.jsonl"), "--report",
          str(tmp_path / "report.json"), "--run_id", "r1", "--max_workers", "2",
          "--no_progress"]
  assert evaluate.main(argv) == 0
  ours = json.loads((tmp_path / "report.json").read_text())
  assert ours == swebench_run_report(preds, rows, "r1", tmp_path / "sb")
  assert (ours["resolved_ids"], ours["unresolved_ids"]) == (
      ["intervals-1", "textstats-1", "units-1"], ["intervals-2", "roman-1", "slugs-1"])
  assert (ours["error_ids"], ours["empty_patch_ids"], ours["incomplete_ids"]) == (
      ["roman-3", "textstats-2"], ["units-2"], ["roman-2"])
  assert ours["submitted_instances"] == 9 and ours["total_instances"] == 10
  err = capsys.readouterr().err
  assert ("textstats-2: error: patch apply failed: patch: hunk #1 (line 4) of "
          "'textstats/tokenize.py' does not apply: its removed and context lines are not in the "
          "file, even with up to 3 context lines ignored at each end") in err
  assert "roman-3: error: patch apply failed: the patch names no file" in err

  by_id = {r["instance_id"]: r for r in rows}
  for iid in ours["completed_ids"]:
    out = tmp_path / "logs" / "run_evaluation" / "r1" / "org__model-v1" / iid
    assert (out / "patch.diff").read_text() == preds[iid]["model_patch"]
    # swebench's verdict on our log is our report.json, key for key.
    theirs = get_eval_report(spec(by_id[iid]), preds[iid], str(out / "test_output.txt"), True)
    assert json.loads((out / "report.json").read_text()) == theirs, iid
    assert theirs[iid]["resolved"] == (outcomes[iid].verdict.reward == 1.0), iid
    # Its parser reads our statuses from the log: every test it names has our status; a test
    # it does not name is one pytest's summary does not name (skipped, xpass) or absent.
    log = (out / "test_output.txt").read_text()
    parsed = PARSER_REGISTRY[spec(by_id[iid]).log_parser](
        log.split(START_TEST_OUTPUT)[1].split(END_TEST_OUTPUT)[0], None)
    parsed = {k: v.lower() for k, v in parsed.items()}
    run = outcomes[iid].run
    if by_id[iid].get("log_parser") == "parse_log_django":
      assert run.statuses == parsed and len(parsed) >= 5
    else:
      ours_by_id = {k: run.statuses.get(junit_key(k)) for k in parsed}
      assert parsed and ours_by_id == parsed, iid
      for t in by_id[iid]["FAIL_TO_PASS"] + by_id[iid]["PASS_TO_PASS"]:
        assert t in parsed or run.statuses.get(junit_key(t)) in (None, "skipped", "xpass")
  # The cases the verdicts turn on.
  f2p = outcomes["slugs-1"].grade.fail_to_pass
  assert sorted(f2p.values()) == ["failed", "passed"]
  assert outcomes["roman-1"].grade.pass_to_pass["tests/test_roman.py::test_to_roman_small[4-IV]"]\
      == "failed"
  assert outcomes["intervals-2"].grade.pass_to_pass["tests/test_merge.py::test_empty"] == (
      "skipped")
  assert outcomes["units-1"].grade.pass_to_pass["tests/test_convert.py::test_kelvin"] == "xfail"
  logs = tmp_path / "logs" / "run_evaluation" / "r1" / "org__model-v1"
  assert "Applied Patch (fuzz 2)" in (logs / "textstats-1" / "run_instance.log").read_text()
  failed = logs / "textstats-2"
  assert evaluate.APPLY_PATCH_FAIL in (failed / "run_instance.log").read_text()
  assert not (failed / "report.json").exists()

  # A rerun reuses every finished instance and retries the error.
  outcomes.clear()
  assert evaluate.main(argv) == 0
  assert outcomes == {}  # the errors failed to apply: retried, before any verification
  assert json.loads((tmp_path / "report.json").read_text()) == ours


class NoPytestSandbox:
  """A sandbox whose python3 has no pytest (or whose tests never end)."""

  def __init__(self, timed_out=False):
    self.files, self.timed_out = {}, timed_out

  async def write_file(self, path, data):
    self.files[path] = data if isinstance(data, bytes) else data.encode()

  async def read_file(self, path):
    return self.files[path]

  async def exec(self, cmd, timeout=None, stdin=None):
    if self.timed_out:
      return ExecResult(-1, "collected 5 items\n", "", timed_out=True)
    return ExecResult(1, "", "Traceback (most recent call last):\n  File \"<stdin>\", line 33, in "
                      "<module>\nModuleNotFoundError: No module named 'pytest'\n")

  async def close(self):
    pass


@pytest.mark.parametrize("timed_out", [False, True])
def test_environment_failures_are_errors_that_say_why(dataset, tmp_path, monkeypatch, timed_out):
  path, rows = dataset
  monkeypatch.chdir(tmp_path)
  tasks = load_swe_jsonl(str(path))[:1]
  preds = {"intervals-1": {"instance_id": "intervals-1", "model_name_or_path": "m",
                           "model_patch": ROWS["intervals-1"]["patch"]}}
  report, results = asyncio.run(evaluate.evaluate(
      tasks, preds, run_id="r2", make_sandbox=lambda task: NoPytestSandbox(timed_out),
      progress=False, timeout=7))
  assert [r.status for r in results] == ["error"]
  if timed_out:
    assert results[0].error == "the test run timed out after 7s"
  else:
    assert "test runner is missing" in results[0].error
    assert "python3 cannot import pytest (No module named 'pytest')" in results[0].error
  assert report["error_ids"] == ["intervals-1"]
  assert report["failure_reasons"] == {
      "intervals-1": "tests_timed_out" if timed_out else "missing_module"}
  assert report == swebench_run_report(preds, [ROWS["intervals-1"]], "r2", tmp_path / "sb")


def test_bad_predictions_are_named(dataset, tmp_path, capsys):
  path, _ = dataset
  good = {"instance_id": "roman-1", "model_name_or_path": "m", "model_patch": ""}
  cases = [
      ('{"instance_id": "roman-1"}\n', ":1: field 'model_name_or_path': expected a non-empty"),
      ('{"instance_id": "a", "model_name_or_path": "m"}\n', ":1: field 'model_patch': missing"),
      (json.dumps(good) + "\n{oops\n", ":2: invalid JSON"),
      (json.dumps(good) + "\n\n" + json.dumps(good) + "\n",
       ":3: field 'instance_id': 'roman-1' already given at "),
      (json.dumps(dict(good, model_patch=3)) + "\n", "field 'model_patch': expected a string"),
  ]
  for text, message in cases:
    (tmp_path / "p.jsonl").write_text(text)
    with pytest.raises(evaluate.PredictionError, match=re.escape(message)):
      evaluate.load_predictions(str(tmp_path / "p.jsonl"))
  (tmp_path / "p.json").write_text(json.dumps([good, 7]))
  with pytest.raises(evaluate.PredictionError, match=r"p\.json\[1\]: expected a JSON object"):
    evaluate.load_predictions(str(tmp_path / "p.json"))
  (tmp_path / "p.json").write_text(json.dumps({"roman-1": good}))  # SWE-agent's layout
  assert evaluate.load_predictions(str(tmp_path / "p.json")) == {"roman-1": good}
  with pytest.raises(ValueError, match="field 'model_name_or_path': '..' cannot name"):
    evaluate.instance_dir("logs", "r", dict(good, model_name_or_path=".."))
  # A prediction for a row the dataset lacks stops the run before anything is graded.
  (tmp_path / "p.jsonl").write_text(json.dumps(dict(good, instance_id="nope-1")) + "\n")
  assert evaluate.main(["--dataset", str(path), "--predictions", str(tmp_path / "p.jsonl"),
                        "--report", str(tmp_path / "r.json"), "--no_progress"]) == 2
  assert "predictions: 1 instance_id(s) not in the dataset: nope-1" in capsys.readouterr().err
  assert not (tmp_path / "r.json").exists()


def test_gold_on_mirrored_parquet_rows(tmp_path, monkeypatch):
  """Rows with only SWE-bench's fields in Parquet, their repositories in a git mirror named by
  ARBOR_SWE_MIRROR: the gold predictions of --instance_ids resolve, and the run report is
  swebench's (which also takes gold predictions of the chosen rows only)."""
  import pyarrow
  import pyarrow.parquet
  from tests.test_tasks import make_mirror, official_rows
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("ARBOR_SWE_MIRROR", make_mirror(tmp_path / "mirror"))
  monkeypatch.setenv("ARBOR_SWE_CACHE", str(tmp_path / "cache"))
  rows = official_rows()
  columns = {k: [r.get(k) for r in rows] for r in rows for k in r}  # every row's fields
  pyarrow.parquet.write_table(pyarrow.Table.from_pydict(columns), str(tmp_path / "rows.parquet"))
  chosen = ["slugs-1", "roman-1"]
  assert evaluate.main(["--dataset", str(tmp_path / "rows.parquet"), "--predictions", "gold",
                        "--report", str(tmp_path / "gold.json"), "--instance_ids", *chosen,
                        "--no_progress"]) == 0
  ours = json.loads((tmp_path / "gold.json").read_text())
  assert ours["resolved_ids"] == sorted(chosen) and ours["submitted_instances"] == 2
  preds = {r["instance_id"]: {"instance_id": r["instance_id"], "model_name_or_path": "gold",
                              "model_patch": r["patch"]} for r in rows
           if r["instance_id"] in chosen}
  assert ours == swebench_run_report(preds, [r for r in rows if r["instance_id"] in chosen],
                                     "gold", tmp_path / "sb")
  for iid in chosen:
    out = tmp_path / "logs" / "run_evaluation" / "gold" / "gold" / iid
    row = next(r for r in rows if r["instance_id"] == iid)
    assert json.loads((out / "report.json").read_text()) == get_eval_report(
        spec(row), preds[iid], str(out / "test_output.txt"), True)


def _lines(rng, n):
  return [f"{rng.choice('abcdefgh')}{rng.randint(0, 5)}\n" for _ in range(n)]


def _mutated(rng, lines, edits):
  lines = list(lines)
  for _ in range(edits):
    op, at = rng.random(), rng.randint(0, len(lines))
    if op < 0.4:
      lines.insert(at, _lines(rng, 1)[0])
    elif at < len(lines):
      if op < 0.7:
        del lines[at]
      else:
        lines[at] = _lines(rng, 1)[0]
  return lines


@pytest.mark.skipif(shutil.which("patch") is None, reason="needs GNU patch, the reference")
def test_fuzzy_patches_apply_as_gnu_patch_applies_them(tmp_path):
  """Random diffs (1 to 3 context lines, several hunks, repeated lines) applied to files that
  have drifted from the diff's base: apply_fuzzy gives the file `patch --batch --forward
  --fuzz=5 -p1` writes, or fails where it fails (as swebench's last attempt does)."""
  import difflib
  import random
  import subprocess
  from envs.grading.patch import apply_fuzzy
  rng = random.Random(0)
  counts = {"applied": 0, "failed": 0, "fuzz": 0}
  for case in range(300):
    base = _lines(rng, rng.randint(1, 30))
    diff = "".join(difflib.unified_diff(base, _mutated(rng, base, rng.randint(1, 4)), "a/f.txt",
                                        "b/f.txt", n=rng.choice([1, 2, 3, 3])))
    if not diff:
      continue
    target = "".join(_mutated(rng, base, rng.randint(0, 3)))
    for name in os.listdir(tmp_path):
      os.remove(tmp_path / name)
    (tmp_path / "f.txt").write_text(target)
    (tmp_path / "p.diff").write_text(diff)
    gnu = subprocess.run(["patch", "--batch", "--forward", "--fuzz=5", "-p1", "-i", "p.diff"],
                         cwd=tmp_path, capture_output=True, text=True)
    if "Reversed (or previously applied)" in gnu.stdout:
      continue  # swebench then asks git whether the patch is already applied
    try:
      ours, used = apply_fuzzy({"f.txt": target.encode()}, diff)
    except ValueError:
      ours = used = None
    expected = (tmp_path / "f.txt").read_text() if gnu.returncode == 0 else None
    assert (ours and ours["f.txt"].decode()) == expected, (case, diff, target, gnu.stdout)
    counts["applied" if ours else "failed"] += 1
    counts["fuzz"] += bool(used)
  assert min(counts.values()) >= 30, counts


def test_docker_backend_grades_as_swebench_grades(dataset, tmp_path, monkeypatch):
  """--backend docker: each row's image_name is its container's image (the docker tests' image,
  Debian's python3 with pytest). A gold and a wrong prediction, one with pytest and one with
  Django's log format, graded as swebench grades their logs. Skipped with the other docker
  tests under ARBOR_SKIP_DOCKER=1."""
  from tests.test_sandbox import docker_kw
  image = docker_kw()["image"]
  path, rows = dataset
  monkeypatch.chdir(tmp_path)
  rows = [dict(r, image_name=image) for r in rows if r["instance_id"] in ("roman-1", "slugs-1")]
  shutil.copytree(path.parent / "repos", tmp_path / "repos")
  (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  patches = predictions()
  preds = write_predictions(tmp_path / "preds.jsonl", {"roman-1": ROWS["roman-1"]["patch"],
                                                       "slugs-1": patches["slugs-1"]})
  assert evaluate.main(["--dataset", str(tmp_path / "rows.jsonl"), "--predictions",
                        str(tmp_path / "preds.jsonl"), "--report", str(tmp_path / "r.json"),
                        "--backend", "docker", "--run_id", "dk", "--no_progress"]) == 0
  ours = json.loads((tmp_path / "r.json").read_text())
  assert (ours["resolved_ids"], ours["unresolved_ids"]) == (["roman-1"], ["slugs-1"])
  assert ours == swebench_run_report(preds, rows, "dk", tmp_path / "sb")
  for row in rows:
    iid = row["instance_id"]
    out = tmp_path / "logs" / "run_evaluation" / "dk" / "org__model-v1" / iid
    assert json.loads((out / "report.json").read_text()) == get_eval_report(
        spec(row), preds[iid], str(out / "test_output.txt"), True)
