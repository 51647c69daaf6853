"""The eval mode (trainer/evaluate.py): pass@k, paired bootstrap, evaluate() end to end
with bwrap sandboxes and the tests verifier (a tiny random model, and a scripted engine whose
fixes score 1), the test-time selection modes, and mode "eval"'s plumbing (run)."""

import concurrent.futures
import itertools
import json
import math
import os
import types
from fractions import Fraction

import numpy as np
import pytest

from envs.chat import make_chat
from envs.chat.tokenizer import HFTokenizer
from envs.tasks import load_repo_files
from envs.taskgen import write_tasks
from envs.trajectory import LLMCall, Trajectory
from models.engine import Completion, EngineConfig
from envs.scaffold import ScaffoldConfig
from tests.test_chat import _tiny_bpe
from trainer import evaluate as ev
from trainer import selection


@pytest.fixture(scope="module")
def chat():
  return make_chat("qwen2.5", HFTokenizer(_tiny_bpe(), eos_token="<|im_end|>"))


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
  return write_tasks(str(tmp_path_factory.mktemp("tasks")), 2, 0, 1, 0)


# ----------------------------------------------------------------------------- pass@k


def brute_pass_at_k(n, c, k):
  """Fraction of the k-subsets of n samples (c correct) holding a correct one."""
  correct = [1] * c + [0] * (n - c)
  subsets = list(itertools.combinations(range(n), k))
  return sum(any(correct[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_enumeration_over_subsets():
  cases = [(n, c, k) for n in range(1, 8) for c in range(n + 1) for k in range(1, n + 1)]
  n, c, k = (np.array(x) for x in zip(*cases))
  got = ev.pass_at_k(n, c, k)  # vectorised over all cases at once
  want = np.array([brute_pass_at_k(*x) for x in cases])
  np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
  # a task vector with a scalar k; pass@1 = c / n
  np.testing.assert_allclose(ev.pass_at_k([4, 4, 4], [0, 1, 4], 1), [0, 0.25, 1])


def test_pass_at_k_is_stable_for_large_n():
  for n, c, k in ((1000, 1, 1), (500, 3, 100), (2000, 1990, 5), (300, 0, 7)):
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert ev.pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("n, c, k", [(3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
  with pytest.raises(ValueError, match="pass_at_k"):
    ev.pass_at_k(n, c, k)


# ----------------------------------------------------------------------------- bootstrap


def reference_bootstrap(pairs, samples, seed, level):
  rng = np.random.default_rng(seed)
  reps = np.zeros(samples)
  for a, b in pairs:
    a, b = np.asarray(a, float), np.asarray(b, float)
    idx = rng.integers(0, len(a), size=(samples, len(a)))
    reps += np.array([b[i].mean() - a[i].mean() for i in idx])
  reps /= len(pairs)
  return np.percentile(reps, [50 * (1 - level), 50 * (1 + level)])


def test_paired_bootstrap_matches_a_direct_numpy_reference():
  rng = np.random.default_rng(3)
  a, b = rng.random(40) < 0.3, rng.random(40) < 0.5
  got = ev.paired_bootstrap(a, b, samples=2000, seed=11, level=0.9)
  low, high = reference_bootstrap([(a, b)], 2000, 11, 0.9)
  assert got["low"] == pytest.approx(low) and got["high"] == pytest.approx(high)
  assert got["mean_a"] == pytest.approx(a.mean()) and got["mean_b"] == pytest.approx(b.mean())
  assert got["diff"] == pytest.approx(b.mean() - a.mean())
  assert got["low"] <= got["diff"] <= got["high"]
  # several seeds: tasks resampled within each seed, per-seed differences averaged
  pairs = [(rng.random(30), rng.random(30)), (rng.random(25), rng.random(25) + 0.2)]
  got = ev.paired_bootstrap_seeds([p[0] for p in pairs], [p[1] for p in pairs], samples=1500,
                                  seed=5)
  low, high = reference_bootstrap(pairs, 1500, 5, 0.95)
  assert (got["low"], got["high"]) == (pytest.approx(low), pytest.approx(high))
  assert got["diff"] == pytest.approx(np.mean([b.mean() - a.mean() for a, b in pairs]))
  assert got["seeds"] == 2 and len(got["per_seed"]) == 2


def test_paired_bootstrap_sanity():
  a = np.random.default_rng(0).random(50)
  same = ev.paired_bootstrap(a, a, samples=500)
  assert same["diff"] == 0 and same["low"] <= 0 <= same["high"]
  plus = ev.paired_bootstrap(a, a + 1, samples=500)
  assert plus["diff"] == pytest.approx(1) and plus["low"] == pytest.approx(1)
  assert plus["high"] == pytest.approx(1)
  with pytest.raises(ValueError, match="same tasks"):
    ev.paired_bootstrap(a, a[:-1])


# ----------------------------------------------------------------------------- selection


def traj(logprobs, termination="submitted", reward=0.0):
  calls = [LLMCall([1, 2], [3] * len(lp), list(lp)) for lp in logprobs]
  return Trajectory(calls, reward, "t", "t/0", termination)


def test_best_of_n_uses_the_policys_mean_logprob_among_submitted_episodes():
  trajs = [traj([[-1.0, -1.0]]), traj([[-0.2], [-0.4]]), traj([[-0.01]], "max_turns"),
           RuntimeError("sandbox")]
  assert selection.mean_logprob(trajs[1]) == pytest.approx(-0.3)
  assert selection.select_best_of_n(trajs) == 1  # the unsubmitted -0.01 and the failure never win
  assert selection.select_best_of_n([traj([[-2.0]], "max_turns"), traj([[-1.0]], "timeout")]) == 1
  assert selection.select_best_of_n([RuntimeError("x"), traj([], "max_turns")]) == 0  # no score


def test_majority_vote_over_final_patches(tasks):
  task = tasks[0]
  fix = task.metadata["fix_edit"]
  original = load_repo_files(task)[fix["path"]]
  fixed = original.replace(fix["old"].encode(), fix["new"].encode())
  other = original.replace(fix["old"].encode(), b"    return None")
  test_file = task.fail_to_pass[0].split("::")[0]
  subs = [
      {},                                              # no change
      {fix["path"]: other},                           # a wrong patch
      {fix["path"]: fixed.replace(b"\n", b"  \n")},    # the fix, trailing spaces: same class
      {fix["path"]: fixed, test_file: b"x = 1\n"},     # the fix (+ a test edit: not code)
      None,                                            # the episode failed
  ]
  assert selection.submission_key(task, subs[2]) == selection.submission_key(task, subs[3])
  assert selection.submission_key(task, {test_file: b""})[0] == "empty"
  assert selection.submission_key(task, {"conftest.py": b"", fix["path"]: fixed})[0] == "refused"
  assert selection.select_majority(task, subs) == 2
  assert selection.select_majority(task, [{}, {fix["path"]: other}, {fix["path"]: fixed}]) == 1  # tie
  assert selection.select_majority(task, [{}, None, {"conftest.py": b""}]) == 0  # nothing to vote on
  exact = types.SimpleNamespace(kind="exact")
  assert selection.select_majority(exact, ["The answer is 4", "\\boxed{5}", "answer: 5.", ""]) == 1


def test_self_play_scores_patches_against_visible_and_generated_tests(tasks):
  from envs.episode import make_sandbox_factory
  import asyncio
  task = tasks[0]
  fix = task.metadata["fix_edit"]
  files = load_repo_files(task)
  fixed = files[fix["path"]].replace(fix["old"].encode(), fix["new"].encode())
  broken = files[fix["path"]].replace(fix["old"].encode(), b"    return None")
  test_file = task.fail_to_pass[0].split("::")[0]
  subs = [None, {}, {fix["path"]: fixed}, {fix["path"]: broken},
          {fix["path"]: fixed, "tests/test_repro.py": files[test_file]},  # + its own test
          {"conftest.py": b"", fix["path"]: fixed}]                      # refused
  out = asyncio.run(selection.self_play_scores(task, subs, make_sandbox_factory("bwrap")))
  visible = len(task.fail_to_pass) + len(task.pass_to_pass)
  assert out["generated"] == ["arbor_selfplay/test_sp4_tests__test_repro.py"]
  assert out["tests"] == 2 * visible  # the visible suite and the sample's copy of it
  assert out["runs"] == 3  # original, fix, broken (identical patches run once)
  s = out["scores"]
  assert np.isnan(s[0]) and np.isnan(s[5])
  assert s[2] == s[4] == pytest.approx(2.0)  # fixes every failing test, keeps every passing one
  assert s[1] == pytest.approx(1.0)  # no change: keeps what passed, fixes nothing
  assert s[3] < 1.0


# ----------------------------------------------------------------------------- end to end


class ScriptedEngine:
  """Stands in for the engine: each episode (found by its sampling seed) plays a script."""

  def __init__(self, chat, scripts):
    self.chat, self.scripts, self.counters = chat, scripts, {}
    self.stopped = False

  def start(self):
    pass

  def stop(self):
    self.stopped = True

  def submit(self, input_ids, params):
    text = self.chat.tokenizer.decode(list(input_ids))
    turn = text.count("<|im_start|>assistant") - 1
    turns, logprob = self.scripts[params.seed - turn]
    ids = self.chat.assistant_ids(turns[turn])
    f = concurrent.futures.Future()
    f.set_result(Completion(ids, [logprob] * len(ids), "stop", [0] * len(ids), 0,
                            len(input_ids), 0))
    return f


def tc(name, **args):
  return {"role": "assistant", "content": None,
          "tool_calls": [{"function": {"name": name, "arguments": args}}]}


def test_evaluate_scripted_fixes_score_1_and_selection_modes(chat, tasks):
  """2 tasks x 3 samples: rewards are the tests verifier's; self_play picks the fix."""
  def script(task, kind):
    fix = task.metadata["fix_edit"]
    if kind == "nothing":
      return [tc("submit")], -0.1
    new = fix["new"] if kind == "fix" else "    return None"
    return [tc("str_replace", path=fix["path"], old_str=fix["old"], new_str=new),
            tc("submit")], -1.0 if kind == "fix" else -0.5
  plan = [["nothing", "wrong", "fix"], ["fix", "fix", "nothing"]]
  scripts = {ev.sample_seed(7, i, j): script(tasks[i], kind)
             for i, row in enumerate(plan) for j, kind in enumerate(row)}
  engine = ScriptedEngine(chat, scripts)
  out = ev.evaluate(None, None, chat, tasks, samples=3, k=2, selection="self_play", seed=7,
                    scaffold=ScaffoldConfig(max_turns=3, max_context_tokens=8192), engine=engine,
                    concurrency=6, keep_trajectories=True)
  assert engine.stopped
  assert out["per_task_rewards"] == [[0, 0, 1], [1, 1, 0]]
  assert out["pass@1"] == pytest.approx(0.5)
  assert out["per_task"] == pytest.approx([2 / 3, 1.0]) and out["pass@k"] == pytest.approx(5 / 6)
  assert out["pass@2"] == out["pass@k"]
  assert out["terminations"] == {"submitted": 6} and out["errors"] == 0 and out["episodes"] == 6
  assert out["selected"]["index"] == [2, 0] and out["pass@1/selected"] == 1.0
  trajs = out["trajectories"]
  for task, row in zip(tasks, trajs):
    for t in row:  # the tests verifier ran pytest
      assert t.metadata["verdict"]["total"] == len(task.fail_to_pass + task.pass_to_pass)
  fix0 = tasks[0].metadata["fix_edit"]
  assert list(trajs[0][2].metadata["submission"]) == [fix0["path"]]
  assert trajs[0][0].metadata["submission"] == {}
  subs = [[t.metadata["submission"] for t in row] for row in trajs]
  assert [selection.select_majority(t, s) for t, s in zip(tasks, subs)] == [1, 0]  # tie -> first
  assert [selection.select_best_of_n(row) for row in trajs] == [0, 2]  # "nothing" is most likely
  json.dumps({k: v for k, v in out.items() if k != "trajectories"}, allow_nan=False)  # JSON


def test_evaluate_a_tiny_random_model_in_bwrap(chat, tasks, monkeypatch):
  """The default greedy pass@1 with a real engine: every episode ran in a bwrap sandbox and
  was scored by the tests verifier in a second one; a random model solves nothing."""
  from models import transformer
  from models.presets import get_preset
  import trainer.rollouts

  made = []
  factory = trainer.rollouts.make_sandbox_factory

  def counting_factory(backend, **kw):
    make = factory(backend, **kw)

    async def wrapped(task):
      box = await make(task)
      made.append(type(box).__name__)
      return box
    return wrapped
  monkeypatch.setattr(trainer.rollouts, "make_sandbox_factory", counting_factory)
  cfg = get_preset("tiny-moe-mla").replace(vocab_size=512)
  assert cfg.vocab_size >= chat.tokenizer.vocab_size
  model = transformer.init(cfg, seed=0)
  out = ev.evaluate(model, cfg, chat, tasks, engine_cfg=EngineConfig(
      slots=2, max_seq_len=2560, prefix_cache_rows=2, prefill_chunk=512),
      scaffold=ScaffoldConfig(max_turns=1, max_new_tokens=8, max_context_tokens=2560),
      concurrency=2, keep_trajectories=True)
  assert out["pass@k"] == 0.0 and out["per_task_rewards"] == [[0.0], [0.0]]
  assert out["k"] == 1 and out["samples"] == 1 and out["episodes"] == 2 and out["errors"] == 0
  assert "selected" not in out and sum(out["terminations"].values()) == 2
  assert made == ["BwrapSandbox"] * 4  # per episode: the agent's and the verifier's
  for task, (t,) in zip(tasks, out["trajectories"]):
    verdict = t.metadata["verdict"]
    assert set(verdict["fail_to_pass"]) == set(task.fail_to_pass)
    assert set(verdict["fail_to_pass"].values()) == {"failed"}  # pytest really ran
    assert set(verdict["pass_to_pass"]) == set(task.pass_to_pass)
    assert set(verdict["pass_to_pass"].values()) <= {"passed"}
    assert t.calls and len(t.calls[0].output_ids) <= 8


# ----------------------------------------------------------------------------- mode "eval"


def test_run_evaluates_each_checkpoint_and_writes_results(tmp_path, monkeypatch):
  from models.hf import config_to_json
  from models.presets import get_preset
  from configs.base import base_config
  from trainer import harness

  runs = {}
  for name in ("sft", "rl"):
    d = tmp_path / name
    (d / "tokenizer").mkdir(parents=True)
    _tiny_bpe().save(str(d / "tokenizer" / "tokenizer.json"))
    (d / "tokenizer" / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    cfg = get_preset("tiny-qwen3").replace(vocab_size=512 + (name == "rl"))
    (d / "model_config.json").write_text(json.dumps(config_to_json(cfg)))
    runs[name] = str(d)
  calls = []

  def fake_initial_model(config, model_cfg):
    return ("weights", config.model.init, model_cfg.vocab_size)

  def fake_evaluate(model, model_cfg, chat, tasks, **kw):
    calls.append((model, kw, [t.instance_id for t in tasks]))
    per = [float(model[2] == 513)] * len(tasks)
    out = {"pass@k": np.mean(per), "pass@1": np.mean(per), "per_task": per, "errors": 0,
           "time_s": 0.1}
    if kw["selection"] != "none":
      out["pass@1/selected"] = 0.5
    return out
  monkeypatch.setattr(harness, "initial_model", fake_initial_model)
  monkeypatch.setattr(ev, "evaluate", fake_evaluate)
  config = base_config()
  config.mode = "eval"
  config.eval.num_tasks, config.eval.samples, config.eval.selection = 2, 2, "best_of_n"
  config.eval.checkpoints = (f"ckpt:{runs['sft']}", f"ckpt:{runs['rl']}")
  config.rl.episode_timeout_s, config.rl.max_turns, config.rl.max_new_tokens = 123.0, 3, 77
  config.rl.max_context_tokens, config.rl.top_p, config.eval.temperature = 1000, 0.9, 0.5
  work = str(tmp_path / "work")
  summary = ev.run(config, work)
  # every episode limit comes from the config (the eval's temperature, the RL section's rest)
  scaffold = calls[0][1]["scaffold"]
  assert (scaffold.timeout_s, scaffold.max_turns, scaffold.max_new_tokens,
          scaffold.max_context_tokens, scaffold.top_p, scaffold.temperature) == (
              123.0, 3, 77, 1000, 0.9, 0.5)
  assert calls[0][1]["engine_cfg"].max_seq_len == 1024
  assert [c[0][1] for c in calls] == list(config.eval.checkpoints)
  assert calls[0][2] == calls[1][2] and len(calls[0][2]) == 2  # the same held-out tasks
  assert calls[0][1]["samples"] == 2 and calls[0][1]["sandbox"] == config.rl.sandbox
  with open(os.path.join(work, "eval", "results.json")) as f:
    results = json.load(f)
  assert results["checkpoints"][f"ckpt:{runs['rl']}"]["per_task"] == [1.0, 1.0]
  assert summary["checkpoints"][f"ckpt:{runs['sft']}"] == {
      "pass@k": 0.0, "pass@1": 0.0, "pass@1/selected": 0.5}
  assert os.path.isfile(os.path.join(work, "eval_tasks", "tasks.jsonl"))
  # () = this workdir's own latest checkpoint
  config.eval.checkpoints = ()
  calls.clear()
  ev.run(config, runs["rl"])
  assert [c[0][1] for c in calls] == [f"ckpt:{runs['rl']}"]
