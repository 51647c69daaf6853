"""Eval formats: LiveCodeBench rows and Terminal-Bench-style shell tasks (loaders, the real
verifiers in bwrap, hidden tests kept from the agent, scripted end-to-end episodes), and the
per-format report of evaluate (pass@k against a NumPy transcription, intervals against scipy
and hand-computed values), plus the mixed eval set of `eval.tasks`."""

import asyncio
import base64
import dataclasses
import io
import json
import math
import os
import pickle
import zlib

import numpy as np
import pytest
from scipy import stats

from configs.base import base_config
from envs.chat import make_chat
from envs.chat.tokenizer import HFTokenizer
from envs.episode import load_task_file, make_react_episode, make_sandbox_factory, start_sandbox
from envs.livecodebench import (StrOnlyUnpickler, decode_test_cases, encode_test_cases,
                                load_livecodebench_jsonl, task_from_row, unpickle_str)
from envs.scaffold import ScaffoldConfig, ScriptedPolicy
from envs.tasks import Task, TaskFormatError, task_format
from envs.terminal_bench import DEFAULT_RUN_TESTS, load_terminal_bench, reference_solution
from envs.verifiers import livecodebench_output_equal, parse_pytest_summary, verify
from tests.test_chat import _tiny_bpe
from tests.test_evaluate import ScriptedEngine, tc
from trainer import config as config_lib
from trainer import evaluate as ev
from trainer.tasks import held_out_tasks

DATA = os.path.join(os.path.dirname(__file__), "..", "envs", "data")
LCB = os.path.join(DATA, "livecodebench", "problems.jsonl")
LCB_SOLUTIONS = os.path.join(DATA, "livecodebench", "solutions.jsonl")
TB = os.path.join(DATA, "terminal_bench")
make_sandbox = make_sandbox_factory("bwrap")


def run(coro):
  return asyncio.run(coro)


async def gather2(*coros):
  """Runs coroutines two at a time (the machine's cores), results in order."""
  limit = asyncio.Semaphore(2)

  async def one(c):
    async with limit:
      return await c
  return await asyncio.gather(*(one(c) for c in coros))


@pytest.fixture(scope="module")
def chat():
  return make_chat("qwen2.5", HFTokenizer(_tiny_bpe(), eos_token="<|im_end|>"))


@pytest.fixture(scope="module")
def lcb():
  tasks = {t.metadata["question_id"]: t for t in load_livecodebench_jsonl(LCB)}
  with open(LCB_SOLUTIONS) as f:
    solutions = {r["question_id"]: r["solution"] for r in map(json.loads, f)}
  with open(LCB) as f:
    rows = {r["question_id"]: r for r in map(json.loads, f)}
  return tasks, solutions, rows


@pytest.fixture(scope="module")
def tb():
  return {t.instance_id: t for t in load_terminal_bench(TB)}


# ----------------------------------------------------------------------------- LiveCodeBench


def official_decode(value):
  """LiveCodeBench's own decoding of a compressed field (trusted bytes made in these tests)."""
  return json.loads(pickle.loads(zlib.decompress(base64.b64decode(value.encode("utf-8")))))


def test_livecodebench_rows_load(lcb):
  tasks, solutions, rows = lcb
  assert len(tasks) == 6 and set(solutions) == set(tasks)
  compressed = [q for q, r in rows.items() if not r["private_test_cases"].startswith("[")]
  assert compressed == ["2101_B"]
  for q, task in tasks.items():
    row = rows[q]
    public = json.loads(row["public_test_cases"])
    private = (official_decode(row["private_test_cases"]) if q in compressed
               else json.loads(row["private_test_cases"]))
    assert decode_test_cases(row["private_test_cases"]) == private
    assert task.kind == "code" and task.code_style == "livecodebench"
    assert task_format(task) == "livecodebench" and task.instance_id == f"lcb-{q}"
    assert len(task.tests) == len(public) + len(private)
    functional = public[0]["testtype"] == "functional"
    func = json.loads(row["metadata"]).get("func_name")
    assert task.entry_point == (f"Solution.{func}" if functional else None)
    for case, t in zip(task.tests, public + private):
      if functional:
        assert case == {"args": [json.loads(x) for x in t["input"].split("\n")],
                        "expected": json.loads(t["output"])}
      else:
        assert case == {"input": t["input"], "output": t["output"]}
    prompt = task.problem_statement
    assert row["question_content"].strip() in prompt
    assert all(t["input"].rstrip() in prompt for t in public)
    assert not any(t["input"].rstrip() in prompt for t in private if len(t["input"]) > 12)
    assert (task.timeout, task.memory_mb) == ((row.get("time_limit", 6.0),
                                               row.get("memory_limit", 1024)))
  assert tasks["arb101_c"].timeout == 3.0 and tasks["arb101_c"].memory_mb == 256


def test_compressed_tests_decode_and_other_pickles_are_refused(tmp_path):
  tests = [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]
  packed = encode_test_cases(tests, compress=True)
  assert official_decode(packed) == tests == decode_test_cases(packed)
  assert unpickle_str(pickle.dumps("abc", protocol=0)) == "abc"

  def pack(obj):
    return base64.b64encode(zlib.compress(pickle.dumps(obj))).decode()
  with pytest.raises(ValueError, match="private_test_cases.*more than a string"):
    decode_test_cases(pack([1, 2]))
  marker = tmp_path / "made-by-pickle"

  class Evil:
    def __reduce__(self):
      return (os.mkdir, (str(marker),))
  with pytest.raises(ValueError, match="refused"):
    decode_test_cases(pack(Evil()))
  with pytest.raises(pickle.UnpicklingError, match="refused"):  # alone, it resolves no global
    StrOnlyUnpickler(io.BytesIO(pickle.dumps(Evil()))).load()
  assert not marker.exists()
  with pytest.raises(ValueError, match="public_test_cases.*neither JSON"):
    decode_test_cases("not json!", "public_test_cases")
  with pytest.raises(ValueError, match=r"private_test_cases\[0\]"):
    decode_test_cases('[{"input": "1", "output": 2, "testtype": "stdin"}]')


def test_livecodebench_bad_rows_name_the_field(lcb):
  _, _, rows = lcb
  row = rows["3901"]
  for change, field in (({"platform": "hackerrank"}, "'platform'"),
                        ({"metadata": "{}"}, "func_name"),
                        ({"time_limit": 0}, "'time_limit'"),
                        ({"private_test_cases": "[]", "public_test_cases": "[]"}, "no test")):
    with pytest.raises(ValueError, match=field):
      task_from_row({**row, **change})


def test_livecodebench_comparison_rules():
  assert livecodebench_output_equal("3\n", "3")
  assert livecodebench_output_equal("  a b  \n", "a b\n\n")
  assert livecodebench_output_equal("1 2\n", "1  2")     # numbers compare as decimals
  assert livecodebench_output_equal("2.50", "2.5")
  assert not livecodebench_output_equal("0.1", "0.10000001")
  assert not livecodebench_output_equal("1\n2", "1")
  assert not livecodebench_output_equal("abc", "abd")


def test_livecodebench_solutions_pass_wrong_ones_fail(lcb):
  tasks, solutions, _ = lcb
  trailing = tasks["3902"]
  as_tuple = ("class Solution:\n    def trailingMax(self, nums, k):\n"
              "        return tuple(max(nums[max(0, i - k + 1):i + 1]) for i in range(len(nums)))")

  async def main():
    good = [verify(t, f"```python\n{solutions[q]}```", make_sandbox=make_sandbox)
            for q, t in tasks.items()]
    bad = [verify(t, "print(0)", make_sandbox=make_sandbox) for t in tasks.values()]
    return await gather2(*good, *bad, verify(trailing, as_tuple, make_sandbox=make_sandbox))
  out = run(main())
  good, bad, tup = out[:6], out[6:12], out[12]
  assert [v.reward for v in good] == [1.0] * 6, [v.details for v in good if v.reward < 1]
  assert [v.reward for v in bad] == [0.0] * 6
  assert tup.reward == 1.0  # a tuple counts as a list, as in LiveCodeBench


def test_livecodebench_time_and_memory_limits(lcb):
  tasks, solutions, _ = lcb
  grid, plateau = tasks["arb101_c"], tasks["3901"]   # stdin (256 MiB), functional
  hog = "x = bytearray(300 * 2**20)\n"

  async def main():
    return await gather2(
        verify(dataclasses.replace(grid, timeout=1.0), "while True: pass",
               make_sandbox=make_sandbox),
        verify(dataclasses.replace(plateau, timeout=1.0), "class Solution:\n  def "
               "longestPlateau(self, nums):\n    while True: pass", make_sandbox=make_sandbox),
        verify(grid, hog + solutions["arb101_c"], make_sandbox=make_sandbox),
        verify(dataclasses.replace(grid, memory_mb=1024, timeout=20.0), hog + solutions["arb101_c"],
               make_sandbox=make_sandbox),
        verify(plateau, "class Solution:\n  def longestPlateau(self, nums):\n"
               "    return len(bytearray(2000 * 2**20))", make_sandbox=make_sandbox))
  slow_io, slow_fn, hog_io, roomy, hog_fn = run(main())
  for v in (slow_io, slow_fn):
    first = v.details["tests"][0]
    assert v.reward == 0.0 and first["timed_out"] and "time limit exceeded" in first["error"]
  assert hog_io.reward == 0.0 and "memory limit exceeded" in hog_io.details["tests"][0]["error"]
  assert roomy.reward == 1.0, roomy.details  # the same program under a larger limit
  assert hog_fn.reward == 0.0 and "MemoryError" in hog_fn.details["tests"][0]["error"]


def test_livecodebench_episode_agent_never_sees_hidden_tests(chat, lcb):
  """A scripted agent searches its sandbox for a private test, then submits the reference."""
  tasks, solutions, rows = lcb
  task = tasks["arb101_a"]
  secret = json.loads(rows["arb101_a"]["private_test_cases"])[-1]["input"].strip()
  seen = {}

  def submit_after_looking(input_ids):
    seen["context"] = chat.tokenizer.decode(input_ids)
    return tc("submit", answer=solutions["arb101_a"])
  policy = ScriptedPolicy(chat, [
      tc("bash", command=f"ls -A . /tmp /dev/shm; grep -rl {secret} . /tmp /dev/shm; echo end"),
      submit_after_looking])
  episode = make_react_episode(policy, chat, make_sandbox,
                               ScaffoldConfig(max_turns=3, max_context_tokens=8192))
  traj = run(episode(task, 0, seed=1))
  assert traj.reward == 1.0 and traj.termination == "submitted"
  assert traj.metadata["verdict"]["total"] == len(task.tests)
  observation = seen["context"].rsplit("<|im_start|>user", 1)[-1]
  assert "end" in observation and secret not in observation.replace(f"-rl {secret}", "")


# ----------------------------------------------------------------------------- Terminal-Bench


def test_terminal_bench_tasks_load(tb):
  assert sorted(tb) == ["checksum-file", "csv-region-totals", "fix-line-counter",
                        "hello-executable", "log-level-summary"]
  for name, task in tb.items():
    assert task.kind == "shell" and task_format(task) == "terminal-bench"
    assert task.problem_statement.strip() and task.metadata["difficulty"] in ("easy", "medium")
    assert task.agent_timeout == 300.0 and os.path.isfile(task.metadata["solution_path"])
    parser = "exit_code" if name == "hello-executable" else "pytest"
    assert task.check_parser == parser
    assert set(task.check_files) == (set() if parser == "exit_code" else {"test_outputs.py"})
  assert tb["hello-executable"].timeout == 30.0 and tb["csv-region-totals"].timeout == 60.0
  assert tb["csv-region-totals"].metadata["tags"] == ["csv", "awk"]
  (loaded,), bad = load_task_file(TB + "/csv-region-totals")
  assert loaded.instance_id == "csv-region-totals" and bad == 0


def test_terminal_bench_bad_task_names_the_field(tmp_path):
  d = tmp_path / "t"
  d.mkdir()
  (d / "run-tests.sh").write_text("exit 0\n")
  for text, field in (("difficulty: easy\n", "'instruction'"),
                      ("instruction: x\nparser_name: tap\n", "'parser_name'"),
                      ("instruction: x\nmax_test_timeout_sec: -1\n", "'max_test_timeout_sec'"),
                      ("instruction: x\n", "needs test files")):
    (d / "task.yaml").write_text(text)
    with pytest.raises(TaskFormatError, match=field):
      load_terminal_bench(str(tmp_path))
  (d / "run-tests.sh").unlink()
  (d / "tests").mkdir()
  (d / "tests" / "test_outputs.py").write_text("def test_x():\n  pass\n")
  (task,) = load_terminal_bench(str(tmp_path))
  assert task.check_script == DEFAULT_RUN_TESTS and task.agent_timeout == 360.0
  assert task.timeout == 60.0
  assert task.check_files == {"test_outputs.py": b"def test_x():\n  pass\n"}


def test_pytest_summary_parser():
  out = ("... lots ...\n=== short test summary info ===\nPASSED t.py::a\nFAILED t.py::b - "
         "assert 1 == 2\nSKIPPED [1] t.py:3: why\nXFAIL t.py::c\n=== 1 failed ===\n")
  assert parse_pytest_summary(out) == {"t.py::a": "PASSED", "t.py::b": "FAILED",
                                       "t.py:3": "SKIPPED", "t.py::c": "XFAIL"}
  assert parse_pytest_summary("PASSED t.py::a\n") == {}


def test_terminal_bench_solutions_pass_untouched_fails_tests_hidden(tb):
  async def one(task, solve):
    box = await start_sandbox(task, make_sandbox)
    try:
      before = await box.list_files()
      look = await box.exec("ls -A /; find . /tmp /dev/shm -name 'test_*'")
      if solve:
        res = await box.exec(["bash", "-c", reference_solution(task)], timeout=60)
        assert res.exit_code == 0, res
      return await verify(task, box), before, look.stdout
    finally:
      await box.close()

  async def main():
    return await gather2(*(one(t, s) for t in tb.values() for s in (True, False)))
  out = run(main())
  for i, task in enumerate(tb.values()):
    (good, files, look), (bad, _, _) = out[2 * i], out[2 * i + 1]
    assert good.reward == 1.0, (task.instance_id, good.details)
    assert bad.reward == 0.0, (task.instance_id, bad.details)
    assert "test_outputs" not in look and "tests" not in look.split()  # hidden until the check
    assert not any(f.endswith((".sh", ".py")) and "test" in f for f in files)
  assert tb["fix-line-counter"].setup_script and "count_lines.sh" in out[
      2 * list(tb).index("fix-line-counter")][1]


FORCE_PASS = """
import pytest
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  outcome.get_result().outcome = "passed"
"""


def test_terminal_bench_check_ignores_planted_pytest_configuration(tb):
  """conftest.py / pytest.ini planted where the agent can write (workspace, /tmp, /dev/shm)
  would mark every test passed if pytest read them; the check reads none of them."""
  task = tb["csv-region-totals"]

  async def main():
    box = await start_sandbox(task, make_sandbox)
    try:
      for d in (".", "/tmp", "/dev/shm"):
        res = await box.exec(["python3", "-c", f"open('{d}/conftest.py', 'w').write("
                              f"{FORCE_PASS!r}); open('{d}/pytest.ini', 'w').write('[pytest]')"])
        assert res.exit_code == 0, res
      return await verify(task, box)
    finally:
      await box.close()
  v = run(main())
  assert v.reward == 0.0 and v.details["tests"] == {"test_outputs.py::test_totals": "FAILED"}


def test_terminal_bench_episode_end_to_end(chat, tb):
  """A scripted agent lists its sandbox, runs the reference commands, submits: reward 1."""
  task = tb["csv-region-totals"]
  seen = {}

  def solve_after_looking(input_ids):
    seen["context"] = chat.tokenizer.decode(input_ids)
    return tc("bash", command=reference_solution(task))
  policy = ScriptedPolicy(chat, [
      tc("bash", command="ls -A . /; find / -name 'test_outputs*' -not -path '/proc/*' "
         "-not -path '/usr/*' 2>/dev/null; echo listed"),
      solve_after_looking, tc("submit")])
  episode = make_react_episode(policy, chat, make_sandbox,
                               ScaffoldConfig(max_turns=4, max_context_tokens=8192))
  traj = run(episode(task, 0, seed=2))
  assert traj.reward == 1.0 and traj.termination == "submitted", traj.metadata["verdict"]
  observation = seen["context"].rsplit("<|im_start|>user", 1)[-1]
  assert "sales.csv" in observation and "listed" in observation
  assert "test_outputs" not in observation.replace("'test_outputs*'", "")
  assert traj.metadata["verdict"]["tests"] == {"test_outputs.py::test_totals": "PASSED"}


# ----------------------------------------------------------------------------- report


def numpy_pass_at_k(n, c, k):
  """1 - C(n-c, k) / C(n, k) (Chen et al. 2021), term by term."""
  return np.array([1.0 - math.comb(n - ci, k) / math.comb(n, k) for ci in c])


def test_task_format():
  swe = dict(repo_path="/x", fail_to_pass=("t.py::a",), test_command="pytest")
  assert task_format(Task("a", "swe", ("p",), **swe)) == "swe"
  assert task_format(Task("a", "swe", ("p",), metadata={"mutation": "op"}, **swe)) == "swe-synth"
  assert task_format(Task("a", "swe", ("p",), metadata={"generator": "arbor.taskgen/1"},
                          **swe)) == "generated"
  assert task_format(Task("a", "code", ("p",), tests=({"input": "", "output": ""},))) == "code"
  assert task_format(Task("a", "exact", ("p",), answers=("1",))) == "exact"


def test_format_report_against_references():
  formats = ["swe", "livecodebench", "swe", "terminal-bench", "livecodebench", "swe"]
  correct = [5, 0, 3, 2, 1, 5]
  n, k = 5, 2
  rep = ev.format_report(formats, correct, n, k, seed=3)
  assert list(rep) == ["swe", "livecodebench", "terminal-bench", "all"]
  per = numpy_pass_at_k(n, correct, k)
  for f in ("swe", "livecodebench", "terminal-bench"):
    idx = [i for i, g in enumerate(formats) if g == f]
    assert rep[f]["tasks"] == len(idx) and rep[f]["interval"] == "bootstrap"
    assert rep[f]["pass@k"] == pytest.approx(per[idx].mean(), abs=1e-12)
    assert rep[f]["pass@1"] == pytest.approx(np.mean(np.array(correct)[idx] / n), abs=1e-12)
    draws = np.random.default_rng(3).integers(0, len(idx), size=(10_000, len(idx)))
    low, high = np.percentile(per[idx][draws].mean(axis=1), [2.5, 97.5])
    assert (rep[f]["low"], rep[f]["high"]) == pytest.approx((low, high), abs=1e-12)
  # hand-computed: one terminal-bench task with c = 2 of 5 -> 1 - C(3,2)/C(5,2) = 0.7, and a
  # bootstrap of one task is that value
  assert rep["terminal-bench"]["pass@k"] == rep["terminal-bench"]["low"] == pytest.approx(0.7)
  assert rep["all"]["pass@k"] == pytest.approx(per.mean())
  # n = 1: the Wilson interval of (solved, tasks); 3 of 4 by hand: (0.3006418, 0.9544127)
  rep1 = ev.format_report(["code"] * 4, [1, 1, 0, 1], 1, 1)
  assert rep1["code"]["interval"] == "wilson" and rep1["code"]["pass@k"] == 0.75
  assert (rep1["code"]["low"], rep1["code"]["high"]) == pytest.approx((0.3006418, 0.9544127),
                                                                      abs=1e-6)
  for s, t in ((0, 7), (3, 4), (10, 10), (37, 120)):
    ci = stats.binomtest(s, t).proportion_ci(confidence_level=0.95, method="wilson")
    assert ev.wilson_interval(s, t) == pytest.approx((ci.low, ci.high), abs=1e-9)
  with pytest.raises(ValueError, match="successes"):
    ev.wilson_interval(5, 4)


def test_mixed_eval_set_and_evaluate_reports_per_format(tmp_path, chat):
  config = base_config()
  config.eval.num_tasks = 2
  config.eval.tasks = f"generated, {LCB}, {TB}"
  tasks = held_out_tasks(config, str(tmp_path / "gen"))
  assert [task_format(t) for t in tasks] == (["generated"] * 2 + ["livecodebench"] * 2
                                             + ["terminal-bench"] * 2)
  config.eval.tasks = f"{LCB},{LCB}"
  with pytest.raises(config_lib.ConfigError, match="instance_id 'lcb-arb101_a'"):
    held_out_tasks(config, str(tmp_path / "gen2"))

  lcb_task, tb_task = tasks[2], tasks[4]   # lcb-arb101_a, checksum-file
  with open(LCB_SOLUTIONS) as f:
    solution = json.loads(f.readline())["solution"]
  scripts = {
      ev.sample_seed(0, 0, 0): ([tc("submit", answer=solution)], -0.1),
      ev.sample_seed(0, 0, 1): ([tc("submit", answer="print(1)")], -0.1),
      ev.sample_seed(0, 1, 0): ([tc("bash", command=reference_solution(tb_task)),
                                 tc("submit")], -0.1),
      ev.sample_seed(0, 1, 1): ([tc("bash", command=reference_solution(tb_task)),
                                 tc("submit")], -0.1)}
  out = ev.evaluate(None, None, chat, [lcb_task, tb_task], samples=2, k=1,
                    scaffold=ScaffoldConfig(max_turns=3, max_context_tokens=8192),
                    engine=ScriptedEngine(chat, scripts), concurrency=4, progress=False)
  assert out["per_task_rewards"] == [[1.0, 0.0], [1.0, 1.0]]
  assert out["formats"]["livecodebench"]["pass@k"] == 0.5
  assert out["formats"]["terminal-bench"]["pass@k"] == 1.0
  assert out["formats"]["all"]["pass@k"] == 0.75
  json.dumps(out, allow_nan=False)


def test_run_writes_the_per_format_report(tmp_path, monkeypatch, capsys):
  """Mode "eval" on a mixed set: results.json and the printed summary carry every format."""
  from models.hf import config_to_json
  from models.presets import get_preset
  from trainer import harness

  ckpt = tmp_path / "ckpt"
  (ckpt / "tokenizer").mkdir(parents=True)
  _tiny_bpe().save(str(ckpt / "tokenizer" / "tokenizer.json"))
  (ckpt / "tokenizer" / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
  (ckpt / "model_config.json").write_text(json.dumps(config_to_json(get_preset("tiny-qwen3"))))

  def fake_evaluate(model, model_cfg, chat, tasks, **kw):  # every task solved but the first
    correct = [0] + [kw["samples"]] * (len(tasks) - 1)
    per = ev.pass_at_k(kw["samples"], np.array(correct), kw["k"])
    return {"pass@k": per.mean(), "pass@1": per.mean(), "per_task": per.tolist(), "errors": 0,
            "time_s": 0.1, "formats": ev.format_report([task_format(t) for t in tasks],
                                                       correct, kw["samples"], kw["k"])}
  monkeypatch.setattr(harness, "initial_model", lambda config, model_cfg: None)
  monkeypatch.setattr(ev, "evaluate", fake_evaluate)
  config = base_config()
  config.mode = "eval"
  config.eval.num_tasks, config.eval.samples = 2, 1
  config.eval.tasks = f"generated,{LCB},{TB}"
  config.eval.checkpoints = (f"ckpt:{ckpt}",)
  summary = ev.run(config, str(tmp_path / "work"))
  with open(tmp_path / "work" / "eval" / "results.json") as f:
    formats = json.load(f)["checkpoints"][f"ckpt:{ckpt}"]["formats"]
  assert list(formats) == ["generated", "livecodebench", "terminal-bench", "all"]
  assert formats["generated"]["pass@k"] == 0.5 and formats["livecodebench"]["pass@k"] == 1.0
  low, high = ev.wilson_interval(1, 2)
  assert (formats["generated"]["low"], formats["generated"]["high"]) == pytest.approx((low, high))
  assert summary["checkpoints"][f"ckpt:{ckpt}"]["formats"]["all"]["tasks"] == 6
  printed = capsys.readouterr().out
  assert f"generated       pass@1 0.500 [{low:.3f}, {high:.3f}] (2 tasks, 95% wilson)" in printed
  assert "terminal-bench  pass@1 1.000" in printed
