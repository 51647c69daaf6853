"""The GAE critic in the train step (trainer.critic): GAE fields on stacked tree-packed
micro-batches, one PPO policy step on them, and the critic's value loss falling over a few
updates on a fixed batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models import value_head
from models.config import ModelConfig
from rl import advantages as adv_lib
from rl import losses
from rl.tree import CallTokens, TrajectoryTokens
from tests.conftest import run_check
from trainer import batches as B
from trainer import critic as critic_lib
from trainer import optim as O
from trainer import state as S
from trainer import step as T

CFG = ModelConfig(vocab_size=16, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=16, intermediate_size=48, initializer_range=0.2)
# two real micro-batches of one group each, plus a padding micro-batch
SHAPE = B.BatchShape(row_len=128, rows=1, seqs=4, seq_len=32, micro_batches=3)


def _groups() -> list[list[TrajectoryTokens]]:
  """Two groups of 3 episodes: a shared prompt, a second episode branching inside the first
  one's sampled span, two-call episodes whose second call extends the first."""
  rng = np.random.default_rng(0)
  tok = lambda n: rng.integers(1, CFG.vocab_size, n).tolist()
  out = []
  for _ in range(2):
    prompt, first = tok(40), tok(6)  # a long prompt: one group per row
    group = []
    for t in range(3):
      out1 = first[:3] + tok(3) if t == 1 else (first if t == 0 else tok(5))
      obs, out2 = tok(2), tok(4)
      calls = [CallTokens(prompt, out1), CallTokens(prompt + out1 + obs, out2)]
      calls = [CallTokens(c.input_ids, c.output_ids,
                          {"logprobs": (-rng.exponential(size=len(c.output_ids))).tolist()})
               for c in calls]
      group.append(TrajectoryTokens(calls, {"reward": float(rng.normal()), "advantage": 0.0}))
    out.append(group)
  return out


@pytest.fixture(scope="module")
def setup():
  mb = B.make_micro_batches(_groups(), SHAPE)
  mb = mb.with_fields(old_logprobs=mb.fields["logprobs"])
  critic = critic_lib.Critic(CFG, optax.adam(3e-3), value_clip=10.0, donate=False)
  model = value_head.init(CFG, 1)
  # a random head: GAE then reads values that differ per position
  model.head.weight[...] = jnp.asarray(
      0.3 * np.random.default_rng(1).normal(size=CFG.hidden_size), jnp.float32)
  return mb, critic, critic.init(model)


def test_gae_fields_follow_the_trajectories(setup):
  mb, critic, cstate = setup
  gamma, lam = 0.99, 0.95
  out = critic.gae_fields(cstate, mb, gamma, lam)
  flat = np.asarray(critic.values(cstate, mb))
  valid = np.asarray(mb.seq_valid)
  adv, ret, old = (np.asarray(out.fields[k]) for k in ("advantage", "returns", "old_values"))
  assert adv.shape == valid.shape and not adv[~valid].any() and not ret[~valid].any()
  np.testing.assert_allclose(ret - old, adv, atol=1e-5)
  for m in range(mb.num_micro_batches):
    want_adv, want_ret = adv_lib.tree_gae(mb.scalars["reward"][m], flat[m], mb.seq_pred[m],
                                          valid[m], gamma, lam)
    np.testing.assert_allclose(adv[m], want_adv, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ret[m], want_ret, rtol=1e-6, atol=1e-6)
  assert np.abs(adv[valid]).max() > 0


def test_one_rl_step_with_gae_and_the_critic_loss_falls(setup):
  mb, critic, cstate = setup
  mb = critic.gae_fields(cstate, mb, 1.0, 0.95)
  # the policy: a PPO update reading the per-token GAE advantages
  opt = O.build(O.OptimizerConfig.from_config(dict(
      name="adamw", learning_rate=1e-3, schedule="constant", weight_decay=0.0)), CFG)
  state = S.create(CFG, opt, seed=0)
  step = T.make_train_step(CFG, losses.LossConfig(name="ppo"), opt, donate=False)
  state, metrics = step(state, mb)
  assert np.isfinite(float(metrics["loss"])) and float(metrics["num_tokens"]) > 0
  assert int(state.step) == 1
  # the critic: a few updates on the same fixed batch (fixed targets) lower its loss
  history = []
  for _ in range(6):
    cstate, m = critic.step(cstate, mb)
    history.append(float(m["value_loss"]))
  assert int(cstate.step) == 6
  assert history[-1] < 0.5 * history[0], history


def test_fit_metrics_are_those_of_the_values_before_the_update(setup):
  mb, critic, cstate = setup
  mb = critic.gae_fields(cstate, mb, 1.0, 1.0)
  _, m = critic.step(cstate, mb)
  valid = np.asarray(mb.seq_valid)
  ret, old = (np.asarray(mb.fields[k])[valid] for k in ("returns", "old_values"))
  np.testing.assert_allclose(float(m["value_mean"]), old.mean(), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(float(m["returns_mean"]), ret.mean(), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(float(m["value_explained_variance"]),
                             1.0 - (ret - old).var() / ret.var(), rtol=1e-3, atol=1e-4)


def test_sharded_critic_equals_one_device():
  # MoE + MLA on fsdp x expert x tensor (8 CPU devices)
  stdout = run_check("critic_sharding_check")
  assert stdout.count("ok critic on") == 1, stdout
