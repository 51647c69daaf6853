"""One hostile dataset folder through every entry point that reads task files.

The folder holds SWE rows naming host paths (absolute, "..", "~", a symbolic link out), a line
nested 50,000 deep, a LiveCodeBench row whose tests inflate to 256 MiB and a Terminal-Bench
task whose tests are a link to a host folder, each beside one good task. Every reader of task
files (the RL trainer's and the rollout worker's `load_task_file`, the eval mode's
`held_out_tasks`, `python -m envs.validate`, `python -m envs.rollout_worker`) skips each hostile
entry with a reason naming its field, keeps the good ones, and no byte of the host folder
reaches a task. (envs.synth, the sandbox server and the sandbox's root filesystems have their
own tests: tests/test_untrusted_datasets.py, tests/test_untrusted_rootfs.py.)
"""

import json
import logging

import ml_collections
import pytest

from envs import rollout_worker, validate
from envs.episode import load_task_file
from envs.tasks import load_repo_files
from tests.test_untrusted_datasets import make_tb_task
from tests.test_untrusted_inputs import bomb_field, lcb_rows
from trainer.tasks import held_out_tasks

SECRET = "HOST-ONLY-CONTENT-7f3a"
SWE_GOOD = {"instance_id": "good", "repo_path": "repo", "problem_statement": "Fix it.",
            "FAIL_TO_PASS": ["tests/test_a.py::test_x"], "PASS_TO_PASS": []}
# (row changes, what the skip reason names)
SWE_BAD = [({"repo_path": "/etc"}, "field 'repo_path'"),
           ({"repo_path": "../host"}, "field 'repo_path'"),
           ({"repo_path": "~/host"}, "field 'repo_path'"),
           ({"repo_path": "link"}, "field 'repo_path'"),
           ({"rootfs": "/"}, "field 'rootfs'"),
           ({"rootfs": "link"}, "field 'rootfs'")]


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
  root = tmp_path_factory.mktemp("hostile")
  host, data = root / "host", root / "data"
  (host / "tests").mkdir(parents=True)
  (host / "secret.py").write_text(f"KEY = {SECRET!r}\n")
  (host / "tests" / "test_outputs.py").write_text(f"# {SECRET}\n")
  (data / "repo" / "tests").mkdir(parents=True)
  (data / "repo" / "a.py").write_text("A = 1\n")
  (data / "link").symlink_to(host)
  swe = [SWE_GOOD] + [dict(SWE_GOOD, instance_id=f"bad-{i}", **change)
                      for i, (change, _) in enumerate(SWE_BAD)]
  lines = [json.dumps(r) for r in swe] + ["[" * 50_000 + "]" * 50_000]
  (data / "swe.jsonl").write_text("\n".join(lines) + "\n")
  rows = lcb_rows()
  bomb = dict(rows["arb101_a"], question_id="bomb", private_test_cases=bomb_field(256 << 20))
  (data / "lcb.jsonl").write_text(json.dumps(rows["arb101_a"]) + "\n" + json.dumps(bomb) + "\n")
  make_tb_task(data / "tb" / "good")
  make_tb_task(data / "tb" / "bad")
  bad_tests = data / "tb" / "bad" / "tests"
  for f in bad_tests.iterdir():
    f.unlink()
  bad_tests.rmdir()
  bad_tests.symlink_to(host / "tests")
  return data


def assert_no_host_bytes(tasks):
  for t in tasks:
    blob = repr(t) + (repr(load_repo_files(t)) if t.kind == "swe" else "")
    assert SECRET not in blob, t.instance_id


def test_trainer_and_worker_loader_skips_each_hostile_entry(hostile):
  swe, skipped = load_task_file(str(hostile / "swe.jsonl"))
  assert [t.instance_id for t in swe] == ["good"] and skipped == len(SWE_BAD) + 1
  lcb, skipped = load_task_file(str(hostile / "lcb.jsonl"))
  assert [t.instance_id for t in lcb] == ["lcb-arb101_a"] and skipped == 1
  tb, skipped = load_task_file(str(hostile / "tb"))
  assert [t.instance_id for t in tb] == ["good"] and skipped == 1
  assert_no_host_bytes(swe + lcb + tb)


def test_eval_mode_reads_only_the_good_tasks(hostile, caplog):
  config = ml_collections.ConfigDict({
      "eval": {"tasks": f"{hostile / 'swe.jsonl'},{hostile / 'lcb.jsonl'}", "num_tasks": 10},
      "rl": {"task_level": 0, "task_seed": 0}})
  with caplog.at_level(logging.WARNING):
    tasks = held_out_tasks(config, str(hostile / "generated"))
  assert [t.instance_id for t in tasks] == ["good", "lcb-arb101_a"]
  for _, reason in SWE_BAD:
    assert reason in caplog.text
  assert "max_json_depth" in caplog.text and "max_decompressed_bytes" in caplog.text
  config.eval.tasks = str(hostile / "tb")  # its good task is also "good": a run of its own
  assert [t.instance_id for t in held_out_tasks(config, str(hostile / "generated"))] == ["good"]
  assert_no_host_bytes(tasks)


def test_validate_reports_each_hostile_row_as_unloadable(hostile, tmp_path):
  path = hostile / "only_bad.jsonl"  # beside the rows' folders (their paths are relative)
  path.write_text("".join(line + "\n" for line in
                          (hostile / "swe.jsonl").read_text().splitlines()[1:]))
  report_file = tmp_path / "report.json"
  assert validate.main(["--tasks", str(path), "--report", str(report_file)]) == 0
  report = json.loads(report_file.read_text())
  assert not report["accepted"] and len(report["unloadable"]) == len(SWE_BAD) + 1
  for message, (_, reason) in zip(report["unloadable"], SWE_BAD):
    assert reason in message and SECRET not in message


def test_rollout_worker_refuses_a_file_of_hostile_rows(hostile, caplog):
  path = hostile / "only_bad.jsonl"
  path.write_text("".join(line + "\n" for line in
                          (hostile / "swe.jsonl").read_text().splitlines()[1:]))
  with caplog.at_level(logging.WARNING):
    code = rollout_worker.main(["--policy_url", "http://127.0.0.1:9", "--queue",
                                "redis://127.0.0.1:9", "--tasks", str(path),
                                "--tokenizer", str(hostile / "no-tokenizer")])
  assert code == 2 and "no valid task" in caplog.text
  for _, reason in SWE_BAD:
    assert reason in caplog.text
