"""Reward models (rl/reward_losses.py, trainer/reward_model.py, trainer/reward_scoring.py): the losses against float64
NumPy formulas, rows and labels of trajectories, a tiny model learning a separable preference,
mode "reward_model" end to end, and the RL loop with a PRM's dense reward for a step.

The RL run reuses tests/test_rl_gae.py's pattern: a tiny random-weight policy and a rollout
source of synthetic groups, so the loop runs without sandboxes or sampling.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs.base import base_config
from envs.trajectory import LLMCall, Trajectory
from models import value_head
from models.config import ModelConfig
from rl import reward_losses
from tests.test_chat import _tiny_bpe
from tests.test_rl_gae import SyntheticGroups, gae_config
from trainer import config as config_lib
from trainer import reward_model as R
from trainer import reward_scoring as S
from trainer import rl
from trainer.metrics import read_jsonl


def _np_log_sigmoid(x):
  return -np.logaddexp(0.0, -x)


# ----------------------------------------------------------------------------- losses


def test_bradley_terry_matches_numpy():
  rng = np.random.default_rng(0)
  c, r = rng.normal(size=7) * 3, rng.normal(size=7) * 3
  w = rng.integers(0, 2, 7).astype(np.float64)
  m = np.abs(rng.normal(size=7))
  want = np.sum(w * -_np_log_sigmoid(c - r - m)) / w.sum()
  got = reward_losses.bradley_terry(jnp.asarray(c, jnp.float32), jnp.asarray(r, jnp.float32),
                                    jnp.asarray(w), jnp.asarray(m, jnp.float32))
  np.testing.assert_allclose(float(got), want, rtol=1e-5)
  plain = reward_losses.bradley_terry(jnp.asarray(c, jnp.float32), jnp.asarray(r, jnp.float32))
  np.testing.assert_allclose(float(plain), np.mean(np.log1p(np.exp(-(c - r)))), rtol=1e-5)
  # no overflow at large logit gaps: -log σ(-100) = 100
  big = reward_losses.bradley_terry(jnp.asarray([-50.0]), jnp.asarray([50.0]))
  np.testing.assert_allclose(float(big), 100.0, rtol=1e-6)


def test_outcome_and_process_bce_match_numpy():
  rng = np.random.default_rng(1)
  s, y = rng.normal(size=9) * 4, rng.uniform(size=9)
  w = rng.uniform(size=9)
  p = 1 / (1 + np.exp(-s))
  bce = -(y * np.log(p) + (1 - y) * np.log(1 - p))
  got = reward_losses.outcome_bce(jnp.asarray(s, jnp.float32), jnp.asarray(y), jnp.asarray(w))
  np.testing.assert_allclose(float(got), np.sum(w * bce) / w.sum(), rtol=1e-5)
  s2, y2 = rng.normal(size=(3, 4)) * 2, rng.integers(0, 2, (3, 4)).astype(np.float64)
  mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], np.float64)
  p2 = 1 / (1 + np.exp(-s2))
  bce2 = -(y2 * np.log(p2) + (1 - y2) * np.log(1 - p2))
  got2 = reward_losses.process_bce(jnp.asarray(s2, jnp.float32), jnp.asarray(y2),
                                   jnp.asarray(mask))
  np.testing.assert_allclose(float(got2), np.sum(mask * bce2) / mask.sum(), rtol=1e-5)
  assert float(reward_losses.process_bce(jnp.ones((2, 2)), jnp.ones((2, 2)),
                                         jnp.zeros((2, 2)))) == 0.0


# ----------------------------------------------------------------------------- data


def _trajectory(prompt, outs, reward, task="t", errors=()):
  """Calls extending each other: call k's input = previous input + output + an observation."""
  calls, context = [], list(prompt)
  for k, out in enumerate(outs):
    calls.append(LLMCall(list(context), list(out), [0.0] * len(out),
                         meta={"tool_error": True} if k in errors else {}))
    context = context + list(out) + [3, 3]
  return Trajectory(calls, reward=reward, task_id=task, group_id=task, termination="submitted")


def test_episode_rows_steps_and_labels():
  t = _trajectory([1, 2, 3], [[4, 5], [6], [7, 8, 9]], 1.0, errors=(1,))
  e = R.episode(t, max_len=100)
  np.testing.assert_array_equal(e.tokens, [1, 2, 3, 4, 5, 3, 3, 6, 3, 3, 7, 8, 9])
  np.testing.assert_array_equal(e.steps, [4, 7, 12])  # each call's last sampled token
  np.testing.assert_array_equal(e.step_labels, [1.0, 0.0, 1.0])  # the failed tool call: 0
  assert e.label == 1.0
  short = R.episode(t, max_len=6)  # the last 6 tokens: the first two steps fall outside
  np.testing.assert_array_equal(short.tokens, [6, 3, 3, 7, 8, 9])
  np.testing.assert_array_equal(short.steps, [-1, 0, 5])
  failed = R.episode(_trajectory([1], [[2]], 0.3), 100)
  assert failed.label == 0.0 and failed.step_labels.tolist() == [0.0]
  b = R.rows([e, failed], [0, 1, -1])
  assert b["tokens"].shape == (3, 16) and b["steps"].shape == (3, 3)  # short: a power of two
  np.testing.assert_array_equal(b["end"][0, :13], 13)
  np.testing.assert_array_equal(b["end"][0, 13:], [14, 15, 16])  # padding: itself only
  np.testing.assert_array_equal(b["last"], [12, 1, 0])
  np.testing.assert_array_equal(b["step_mask"], [[1, 1, 1], [1, 0, 0], [0, 0, 0]])


def test_pairs_are_passed_over_failed_within_a_task():
  eps = [R.episode(_trajectory([1], [[2]], r, task), 10)
         for r, task in ((1.0, "a"), (0.0, "a"), (0.0, "a"), (1.0, "b"), (1.0, "b"), (0.0, "c"))]
  assert R.make_pairs(eps).tolist() == [[0, 1], [0, 2]]
  assert R.auc(np.array([0.1, 0.9, 0.5, 0.5]), np.array([0, 1, 1, 0])) == pytest.approx(
      (1 + 1 + 1 + 0.5) / 4)


def test_process_advantages_add_the_centred_return_of_step_scores():
  g = [_trajectory([1], [[2], [3]], 1.0), _trajectory([1], [[4]], 0.0)]
  scored = S.outcome_rewards([g], [[np.array([0.9, 0.7]), np.array([0.2])]], 0.5, dense=True)
  assert [t.reward for t in scored[0]] == [1.0, 0.0]  # dense: the verifier's reward
  adv = S.process_advantages(scored, [np.array([1.0, -1.0], np.float32)], 0.5)[0]
  b = (0.9 + 0.7 + 0.2) / 3
  want = [[1 + 0.5 * ((0.9 - b) + (0.7 - b)), 1 + 0.5 * (0.7 - b)], [-1 + 0.5 * (0.2 - b), 0]]
  np.testing.assert_allclose(adv, want, rtol=1e-6)
  orm = S.outcome_rewards([g], [[np.array([0.9, 0.7]), np.array([0.2])]], 0.5)
  np.testing.assert_allclose([t.reward for t in orm[0]], [1.35, 0.1])
  assert orm[0][0].metadata["verifier_reward"] == 1.0
  assert orm[0][0].trajectory_id == g[0].trajectory_id


# ----------------------------------------------------------------------------- training

CFG = ModelConfig(vocab_size=32, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=16, intermediate_size=64, initializer_range=0.2,
                  attention_impl="xla")
GOOD, BAD = 30, 31  # the token that makes an episode pass, and its failing counterpart


def _separable(n_tasks: int, seed: int) -> list[Trajectory]:
  """Per task a shared random prompt; one episode's second call holds GOOD (verifier reward 1)
  among random tokens, the other's BAD (reward 0)."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n_tasks):
    prompt = rng.integers(1, 28, 12).tolist()
    first = rng.integers(1, 28, 4).tolist()
    for mark, reward in ((GOOD, 1.0), (BAD, 0.0)):
      tail = rng.integers(1, 28, 6).tolist()
      tail.insert(int(rng.integers(0, 6)), mark)
      out.append(_trajectory(prompt, [first, tail], reward, task=f"{seed}-{i}"))
  return out


def test_a_tiny_reward_model_learns_a_separable_preference():
  train = [R.episode(t, 64) for t in _separable(64, 0)]
  held = [R.episode(t, 64) for t in _separable(32, 1)]
  rm = R.RewardModel(CFG, optax.adam(1e-2), pairwise_coef=1.0, orm_coef=1.0)
  state = rm.init(value_head.init(CFG, 0))
  before = R.evaluate(rm, state, held, R.make_pairs(held), 16)
  assert before["pairwise_accuracy"] == 0.5  # a zero head: every score ties
  seen = []
  state = R.train(rm, state, train, R.make_pairs(train), steps=80, batch_pairs=8,
                  on_step=lambda s, st, m: seen.append(float(m["loss"])) and False)
  after = R.evaluate(rm, state, held, R.make_pairs(held), 16)
  assert after["pairs"] == 32 and after["episodes"] == 64
  assert after["pairwise_accuracy"] >= 0.9, after
  assert after["orm_accuracy"] >= 0.8 and after["orm_auc"] >= 0.9, after  # before: 0.5
  assert np.mean(seen[-5:]) < 0.5 * np.mean(seen[:3]), seen


# ----------------------------------------------------------------------------- mode + RL


def _write(path, trajectories):
  with open(path, "w") as f:
    for t in trajectories:
      f.write(json.dumps(t.to_dict()) + "\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """A mode "reward_model" run on synthetic groups, then an RL step with it as a dense PRM."""
  d = tmp_path_factory.mktemp("rm")
  (d / "tokenizer").mkdir()
  _tiny_bpe().save(str(d / "tokenizer" / "tokenizer.json"))
  (d / "tokenizer" / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
  source = SyntheticGroups()
  data = [t for s in range(10, 22) for g in source.take(s, 0)[0] for t in g]
  _write(d / "train.jsonl", data[:32])
  _write(d / "eval.jsonl", data[32:])
  c = base_config()
  c.mode, c.seed = "reward_model", 0
  c.model.init, c.model.preset = "random", "tiny-dense"
  c.model.overrides.num_layers = 1
  c.model.overrides.vocab_size = 512
  c.model.overrides.attention_impl = "xla"
  c.tokenizer.path, c.tokenizer.chat_format = str(d / "tokenizer"), "qwen2.5"
  r = c.reward_model
  r.episodes, r.eval_episodes = str(d / "train.jsonl"), str(d / "eval.jsonl")
  r.prm_coef, r.max_len, r.batch_pairs, r.learning_rate = 1.0, 64, 2, 1e-3
  c.train.steps, c.train.checkpoint_every, c.train.log_every = 2, 1, 1
  c.checkpoint.async_save = False
  for field in ("report", "tensorboard", "progress"):
    c.metrics[field] = False
  config_lib.validate(c, str(d / "rm"))
  summary = R.run(c, str(d / "rm"))
  rl_cfg = gae_config(str(d / "tokenizer"), 1)
  rl_cfg.loss.name, rl_cfg.rl.advantage, rl_cfg.rl.epochs = "cispo", "grpo", 1
  rl_cfg.rl.reward_model.path, rl_cfg.rl.reward_model.kind = str(d / "rm"), "prm"
  rl_cfg.rl.drop_constant_groups = False
  mp = pytest.MonkeyPatch()
  mp.setattr(rl, "make_source", SyntheticGroups)
  mp.setattr(rl, "TaskSource", lambda config, workdir: None)
  try:
    config_lib.validate(rl_cfg, str(d / "rl"))
    rl.run(rl_cfg, str(d / "rl"))
  finally:
    mp.undo()
  return {"dir": d, "summary": summary, "rl": str(d / "rl")}


def test_mode_reward_model_trains_checkpoints_and_evaluates(runs):
  s = runs["summary"]
  assert s["steps"] == 2 and s["train_pairs"] > 0
  for key in ("pairwise_accuracy", "orm_accuracy", "orm_auc", "prm_step_accuracy"):
    assert 0.0 <= s["eval"][key] <= 1.0, s
  lines = read_jsonl(str(runs["dir"] / "rm" / "reward_model" / "metrics.jsonl"))
  assert sorted(lines) == [1, 2] and "eval/pairwise_accuracy" in lines[2]
  scorer = S.Scorer(str(runs["dir"] / "rm"))
  assert scorer.step == 2
  groups, _, _ = SyntheticGroups().take(1, 0)
  scores = scorer.groups(groups)
  assert [len(g) for g in scores] == [2, 2]
  assert all(s.shape == (1,) and 0 < s[0] < 1 for g in scores for s in g)


def test_rl_with_a_dense_prm_reward_runs(runs):
  lines = read_jsonl(os.path.join(runs["rl"], "rl", "metrics.jsonl"))
  assert sorted(lines) == [1]
  line = lines[1]
  assert 0 < line["rm/score_mean"] < 1 and np.isfinite(line["loss"]), line
  assert line["groups_trained"] == 2 and "time/reward_model" in line
  assert line["policy_version"] == 1


@pytest.mark.parametrize("field, value, message", [
    ("rl.reward_model.kind", "dense", r"one of \('orm', 'prm'\)"),
    ("rl.reward_model.weight", -1.0, r"a number in \[0.0, inf\]"),
    ("reward_model.batch_pairs", 0, "an integer >= 1"),
    ("reward_model.learning_rate", 0.0, r"a number in \(0.0, inf\]"),
])
def test_reward_model_fields_are_checked(field, value, message):
  c = gae_config("", 2)
  node = c
  for part in field.split(".")[:-1]:
    node = node[part]
  node[field.split(".")[-1]] = value
  with pytest.raises(config_lib.ConfigError, match=rf"config\.{field}={value!r}: .*{message}"):
    config_lib.validate(c, files=False)


def test_rl_refuses_a_path_that_is_no_reward_model(tmp_path):
  c = gae_config(str(tmp_path), 2)
  c.rl.reward_model.path = str(tmp_path)
  with pytest.raises(config_lib.ConfigError, match=r"config\.rl\.reward_model\.path=.*"
                     "mode 'reward_model' workdir"):
    config_lib.validate(c, files=True)
