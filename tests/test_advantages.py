"""rl.advantages: hand-computed values, degenerate groups, NumPy loop references, jit."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl import advantages as adv

# One batch, four groups with non-contiguous ids:
#   id 7: [1, 0, 0, 1]   mean 0.5, population std 0.5
#   id 2: [0.1]*3        constant (0.1 is inexact in binary: the float mean need not equal 0.1)
#   id 5: [2.0]          a group of one
#   id 9: [3, 0, 0]      mean 1, var (4 + 1 + 1)/3 = 2, std sqrt(2)
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.1, 0.1, 0.1, 2.0, 3.0, 0.0, 0.0]
GROUP = [7, 7, 7, 7, 2, 2, 2, 5, 9, 9, 9]
R2 = math.sqrt(2.0)


def close(a, b, tol=1e-6):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b, dtype=np.float64), rtol=tol, atol=tol)


def test_grpo_hand_values():
  # id 7: ±0.5/0.5 = ±1; id 9: 2/√2 = √2, -1/√2; ids 2, 5: 0 (std 0).
  expected = [1, -1, -1, 1, 0, 0, 0, 0, R2, -1 / R2, -1 / R2]
  out = adv.grpo(REWARDS, GROUP, eps=0.0)
  close(out, expected)
  assert np.all(np.asarray(out)[4:8] == 0.0)  # exactly 0, not rounding / eps
  # default eps = 1e-6: 0.5 / (0.5 + 1e-6) = 0.999998
  close(adv.grpo(REWARDS, GROUP)[0], 0.5 / (0.5 + 1e-6), tol=1e-7)


def test_group_mean():
  close(adv.group_mean(REWARDS, GROUP), [.5] * 4 + [0.1] * 3 + [2.0, 1.0, 1.0, 1.0])
  # id 7 without its last member: (1 + 0 + 0)/3; an all-invalid group: 0
  valid = [True] * 3 + [False] + [True] * 4 + [False] * 3
  close(adv.group_mean(REWARDS, GROUP, valid), [1 / 3] * 4 + [0.1] * 3 + [2.0, 0, 0, 0])


def test_dr_grpo_and_rloo_hand_values():
  # Dr. GRPO: R - mean.
  close(adv.dr_grpo(REWARDS, GROUP), [.5, -.5, -.5, .5, 0, 0, 0, 0, 2, -1, -1])
  # RLOO id 7: 1 - (0+0+1)/3 = 2/3, 0 - (1+0+1)/3 = -2/3; id 9: 3 - 0 = 3, 0 - (3+0)/2 = -1.5.
  a = 2 / 3
  close(adv.rloo(REWARDS, GROUP), [a, -a, -a, a, 0, 0, 0, 0, 3, -1.5, -1.5])


def test_reinforce_pp_baseline_hand_values():
  # Group-centred c = [.5,-.5,-.5,.5, 0,0,0, 0, 2,-1,-1]; batch mean 0,
  # variance (4·0.25 + 4 + 1 + 1)/11 = 7/11.
  c = np.array([.5, -.5, -.5, .5, 0, 0, 0, 0, 2, -1, -1])
  close(adv.reinforce_pp_baseline(REWARDS, GROUP, eps=0.0), c / math.sqrt(7 / 11))
  # Weights (e.g. token counts) enter the whitening statistics only: with weight 2 on the
  # first four, m = (0)/15 = 0, var = (4·2·0.25 + 6)/15 = 8/15.
  w = [2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1]
  close(adv.reinforce_pp_baseline(REWARDS, GROUP, eps=0.0, weights=w), c / math.sqrt(8 / 15))


def test_valid_mask():
  valid = np.ones(11, bool)
  valid[3] = False  # id 7 becomes [1, 0, 0]: mean 1/3, var (4/9 + 2/9)/3 = 2/9, std √2/3
  valid[8] = False  # id 9 becomes [0, 0]: constant
  # grpo: (2/3)/(√2/3) = √2, (-1/3)/(√2/3) = -1/√2; invalid sequences get 0.
  close(adv.grpo(REWARDS, GROUP, valid, eps=0.0), [R2, -1 / R2, -1 / R2, 0, 0, 0, 0, 0, 0, 0, 0])
  # rloo: 1 - 0 = 1, 0 - (1 + 0)/2 = -0.5
  close(adv.rloo(REWARDS, GROUP, valid), [1, -.5, -.5, 0, 0, 0, 0, 0, 0, 0, 0])
  # everything invalid: all zero, no NaN
  for name in adv.ADVANTAGES:
    out = np.asarray(adv.compute(name, REWARDS, GROUP, np.zeros(11, bool)))
    assert np.all(out == 0.0), name


@pytest.mark.parametrize("name", sorted(adv.ADVANTAGES))
def test_degenerate_batches_give_zero_not_nan(name):
  # all-equal rewards across the batch, and a batch of singletons (size 11: one compile)
  for rewards, group in [([0.3] * 11, GROUP), (REWARDS, np.arange(11))]:
    out = np.asarray(adv.compute(name, rewards, group))
    assert np.all(out == 0.0), (name, out)


def test_compute_registry_and_errors():
  close(adv.compute("grpo", REWARDS, GROUP, eps=0.0), adv.grpo(REWARDS, GROUP, eps=0.0))
  with pytest.raises(ValueError, match=r"ppo.*dr_grpo.*grpo.*reinforce_pp_baseline.*rloo"):
    adv.compute("ppo", REWARDS, GROUP)
  with pytest.raises(ValueError, match="group"):
    adv.grpo([1.0, 2.0], [0, 0, 1])
  with pytest.raises(ValueError, match="group.*integer"):
    adv.grpo([1.0, 2.0], [0.0, 1.0])
  with pytest.raises(ValueError, match="eps"):
    adv.grpo([1.0, 2.0], [0, 0], eps=-1.0)
  with pytest.raises(ValueError, match="valid"):
    adv.grpo([1.0, 2.0], [0, 0], [True])


# --- NumPy loop transcriptions of the formulas (the references) -------------------------------


def ref_group_relative(name, rewards, group, valid, eps=1e-6):
  out = np.zeros(len(rewards))
  for i in range(len(rewards)):
    if not valid[i]:
      continue
    members = [rewards[j] for j in range(len(rewards)) if valid[j] and group[j] == group[i]]
    if len(set(members)) == 1:
      continue
    mean = sum(members) / len(members)
    if name == "grpo":
      std = math.sqrt(sum((m - mean) ** 2 for m in members) / len(members))
      out[i] = (rewards[i] - mean) / (std + eps)
    elif name in ("dr_grpo", "reinforce_pp_baseline"):
      out[i] = rewards[i] - mean
    elif name == "rloo":
      out[i] = rewards[i] - (sum(members) - rewards[i]) / (len(members) - 1)
  if name == "reinforce_pp_baseline":
    c = [out[i] for i in range(len(rewards)) if valid[i]]
    m = sum(c) / len(c)
    s = math.sqrt(sum((x - m) ** 2 for x in c) / len(c))
    for i in range(len(rewards)):
      const = out[i] == 0 and len({rewards[j] for j in range(len(rewards))
                                   if valid[j] and group[j] == group[i]}) == 1
      out[i] = (out[i] - m) / (s + eps) if valid[i] and not const else 0.0
  return out


def random_batch(seed, size=11):  # the size of REWARDS: the jitted cores compile once
  rng = np.random.default_rng(seed)
  group = rng.integers(0, 4, size) * 3 + 100  # sparse ids, random order, some singletons
  rewards = rng.choice([0.0, 0.25, 1.0, 0.7], size)  # coarse values: some constant groups
  valid = rng.random(size) < 0.85
  return rewards, group, valid


@pytest.mark.parametrize("name", sorted(adv.ADVANTAGES))
def test_estimators_match_numpy_loop(name):
  for seed in range(3):
    rewards, group, valid = random_batch(seed)
    close(adv.compute(name, rewards, group, valid), ref_group_relative(name, rewards, group, valid),
          tol=2e-5)


def test_kat_rescale_hand_values():
  # group 0: success [1,0,0,0] -> D = 0.75; group 1: success [1,0] -> D = 0.5.
  # Mean over groups (each once) = 0.625 (per-sequence mean would be 0.667).
  # λ = 2: group factors 1 + 2·0.125 = 1.25 and 1 - 2·0.125 = 0.75.
  # Entropy group 0 [1,2,3,2], mean 2, μ = 0.5: 1 + 0.5·[-1,0,1,0] = [.5, 1, 1.5, 1];
  # group 1 [0.4, 0.0], mean 0.2: 1 + 0.5·[0.2, -0.2] = [1.1, 0.9].
  group = [0, 0, 0, 0, 1, 1]
  success = [True, False, False, False, True, False]
  entropy = [1.0, 2.0, 3.0, 2.0, 0.4, 0.0]
  a = [1.0, 1.0, 1.0, 1.0, 1.0, -2.0]
  expected = [1.25 * .5, 1.25, 1.25 * 1.5, 1.25, .75 * 1.1, -2 * .75 * .9]
  out = adv.kat_rescale(a, group, entropy, difficulty_coef=2.0, entropy_coef=0.5,
                        success=success)
  close(out, expected)
  # success from rewards > threshold gives the same
  rewards = [1.0, 0.2, 0.0, 0.5, 0.9, 0.1]
  close(adv.kat_rescale(a, group, entropy, difficulty_coef=2.0, entropy_coef=0.5,
                        rewards=rewards, threshold=0.5), expected)
  # clamping: λ = 10 gives group 1 factor 1 - 1.25 < 0 -> 0; μ = 2 gives trajectory 0 factor
  # 1 + 2·(-1) = -1 -> 0. Group 0 factor 1 + 10·0.125 = 2.25; entropy [0, 1, 3, 1].
  out = adv.kat_rescale(a, group, entropy, difficulty_coef=10.0, entropy_coef=2.0,
                        success=success)
  close(out, [0, 2.25, 2.25 * 3, 2.25, 0, 0])
  with pytest.raises(ValueError, match="exactly one"):
    adv.kat_rescale(a, group, entropy, difficulty_coef=1.0, entropy_coef=1.0)
  with pytest.raises(ValueError, match="difficulty_coef"):
    adv.kat_rescale(a, group, entropy, difficulty_coef=-1.0, entropy_coef=1.0, success=success)


def test_kat_rescale_matches_numpy_loop():
  lam, mu = 0.8, 1.5
  for seed in range(3):
    rewards, group, valid = random_batch(seed)
    rng = np.random.default_rng(seed + 10)
    a, entropy = rng.normal(size=rewards.size), rng.random(rewards.size)
    ids = sorted({g for g, v in zip(group, valid) if v})
    rate = {g: np.mean([rewards[j] > 0.5 for j in range(rewards.size)
                        if valid[j] and group[j] == g]) for g in ids}
    mean_d = np.mean([1 - rate[g] for g in ids])
    expected = np.zeros(rewards.size)
    for i in range(rewards.size):
      if valid[i]:
        h = np.mean([entropy[j] for j in range(rewards.size) if valid[j] and group[j] == group[i]])
        expected[i] = (a[i] * max(0, 1 + lam * (1 - rate[group[i]] - mean_d))
                       * max(0, 1 + mu * (entropy[i] - h)))
    close(adv.kat_rescale(a, group, entropy, difficulty_coef=lam, entropy_coef=mu,
                          rewards=rewards, threshold=0.5, valid=valid), expected, tol=2e-5)


def test_resum_broadcast():
  close(adv.resum_broadcast([10.0, 20.0, 30.0], [2, 0, 0, 1, 2, 5]), [30, 10, 10, 20, 30, 0])
  close(adv.resum_broadcast([10.0, 20.0, 30.0], [300, 100, 999], traj_ids=[100, 200, 300]),
        [30, 10, 0])


def test_returns_to_go_and_turn_broadcast():
  # γ = 0.5: G2 = 2, G1 = 0 + 0.5·2 = 1, G0 = 1 + 0.5·1 = 1.5;  γ = 1: [3, 2, 2].
  r = [[1.0, 0.0, 2.0], [0.0, 0.0, 1.0]]
  close(adv.returns_to_go(r, gamma=0.5), [[1.5, 1.0, 2.0], [0.25, 0.5, 1.0]])
  close(adv.returns_to_go(r), [[3, 2, 2], [1, 1, 1]])
  close(adv.returns_to_go(r, turn_valid=[[1, 1, 0], [1, 1, 1]]), [[1, 0, 0], [1, 1, 1]])
  # tokens: turn ids, -1 = padding, 3 out of range -> 0
  turn_id = [[0, 0, 1, 2, 2, -1], [0, 1, 1, 2, 3, 0]]
  mask = [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0]]
  close(adv.per_turn_advantages(r, turn_id, gamma=0.5, mask=mask),
        [[1.5, 1.5, 1.0, 2.0, 2.0, 0], [.25, .5, .5, 1.0, 0, 0]])
  with pytest.raises(ValueError, match="gamma"):
    adv.returns_to_go(r, gamma=1.5)


def test_overlong_penalty():
  # L_max 20480, L_c 4096: zone starts at 16384; 18432 is halfway -> -0.5.
  lengths = [0, 16384, 16385, 18432, 20480, 20481, 50000]
  close(adv.overlong_penalty(lengths), [0, 0, -1 / 4096, -0.5, -1, -1, -1])
  close(adv.overlong_penalty([5, 8, 9, 10, 11], max_len=10, cache_len=4), [0, -.5, -.75, -1, -1])
  with pytest.raises(ValueError, match="cache_len"):
    adv.overlong_penalty([1], max_len=10, cache_len=11)
  with pytest.raises(ValueError, match="cache_len"):
    adv.overlong_penalty([1], max_len=10, cache_len=0)


def test_dense_step_rewards():
  # cap = 0.5 · 1: sums 0.4 (kept), 0.7 (-> 0.5), -0.8 (-> -0.5).
  terminal = [1.0, 0.0, 1.0]
  steps = [[0.2, 0.2], [0.3, 0.4], [-1.0, 0.2]]
  close(adv.dense_step_rewards(terminal, steps, terminal_scale=1.0), [1.4, 0.5, 0.5])
  close(adv.cap_step_rewards(steps, 0.5)[1], [0.3 * 5 / 7, 0.4 * 5 / 7])
  close(adv.cap_step_rewards(steps, 0.5)[2], [-1.0 * 5 / 8, 0.2 * 5 / 8])
  # padded steps are ignored: [0.2, (9.0 padding)] -> 0.2
  close(adv.dense_step_rewards([0.0], [[0.2, 9.0]], 1.0, step_valid=[[1, 0]]), [0.2])
  # zero scale: no shaping at all
  close(adv.dense_step_rewards(terminal, steps, terminal_scale=0.0), terminal)
  with pytest.raises(ValueError, match="fraction"):
    adv.dense_step_rewards(terminal, steps, 1.0, fraction=2.0)


def test_broadcast():
  close(adv.broadcast([2.0, -1.0], [[1, 1, 0], [1, 0, 0]]), [[2, 2, 0], [-1, 0, 0]])
  with pytest.raises(ValueError, match="mask"):
    adv.broadcast([2.0, -1.0], [[1, 1, 0]])


def test_everything_runs_under_jit():
  # One outer jit over every function (one compile), all inputs traced, including the
  # hyper-parameters, which are checked only when they are Python numbers.
  rewards, group, valid = random_batch(0)

  @jax.jit
  def everything(rewards, group, valid, eps, gamma, scale):
    out = {name: fn(rewards, group, valid) for name, fn in adv.ADVANTAGES.items()}
    out["grpo_eps"] = adv.grpo(rewards, group, valid, eps=eps)
    out["kat"] = adv.kat_rescale(rewards, group, rewards, difficulty_coef=eps,
                                 entropy_coef=eps, rewards=rewards, valid=valid)
    out["resum"] = adv.resum_broadcast(rewards[:2], group[:3] * 0 + jnp.array([1, 0, 7]))
    out["turns"] = adv.per_turn_advantages(rewards[None, :2], jnp.array([[0, 1, 1]]), gamma)
    out["overlong"] = adv.overlong_penalty(group[:1] * 0 + 9, 10, 4)
    out["dense"] = adv.dense_step_rewards(rewards[:1] * 0 + 1.0, rewards[None, :1] * 0 + 0.7,
                                          scale)
    out["broadcast"] = adv.broadcast(rewards[:1] * 0 + 3.0, jnp.array([[1, 0]]))
    return out

  out = everything(rewards, group, valid, 1.0, 1.0, 1.0)
  for name, fn in adv.ADVANTAGES.items():
    close(out[name], fn(rewards, group, valid))
  close(out["grpo_eps"], adv.grpo(rewards, group, valid, eps=1.0))
  close(out["kat"], adv.kat_rescale(rewards, group, rewards, difficulty_coef=1.0,
                                    entropy_coef=1.0, rewards=rewards, valid=valid))
  close(out["resum"], [rewards[1], rewards[0], 0])
  close(out["turns"], [[rewards[0] + rewards[1], rewards[1], rewards[1]]])
  close(out["overlong"], [-0.75])
  close(out["dense"], [1.5])
  close(out["broadcast"], [[3, 0]])
