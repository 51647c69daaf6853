"""Tree credit assignment: rl.tree.call_segments, rl.advantages.tree_advantages (TreeRL),
rl.advantages.entropy_aware and the aepo loss (AEPO), against hand-written expectations and
float64 NumPy references written here independently (loops over nodes, leaves and groups)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl import advantages as adv
from rl import batch as rb
from rl import losses
from rl.losses import LossConfig
from rl.tree import CallTokens, TrajectoryTokens, build_tree, call_segments


def _traj(*calls) -> TrajectoryTokens:
  return TrajectoryTokens([CallTokens(list(i), list(o)) for i, o in calls])


P = [1, 2]  # the prompt
A = (P, [10, 11])                   # call 0
B = (P + [10, 11, 50], [12])        # call 1 after tool result 50
B2 = (P + [10, 11, 51], [12])       # call 1 after another tool result (same output)
C = (P + [10, 11, 50, 12, 60], [13])
C2 = (P + [10, 11, 50, 12, 60], [14])  # call 2 resampled (another output)
D = (P, [20])                       # another first call


# ----------------------------------------------------------------------------- call_segments


def test_call_segments_branched_three_levels():
  group = [_traj(A, B, C), _traj(A, B, C2), _traj(A, B2), _traj(D)]
  segment, parent = call_segments(group)
  np.testing.assert_array_equal(segment, [[0, 1, 2], [0, 1, 3], [0, 4, -1], [5, -1, -1]])
  np.testing.assert_array_equal(parent, [-1, 0, 1, 1, 0, -1])
  assert segment.dtype == np.int32 and parent.dtype == np.int32


def test_call_segments_independent_episodes():
  group = [_traj(A, B), _traj(D, (P + [20, 70], [21])), _traj((P, [30]))]
  segment, parent = call_segments(group)
  np.testing.assert_array_equal(segment, [[0, 1], [2, 3], [4, -1]])
  np.testing.assert_array_equal(parent, [-1, 0, -1, 2, -1])


def test_call_segments_tool_result_branch():
  """Calls 0 and 1 identical, call 2's input differs only in the tool result after call 1: the
  trajectories share nodes 0 and 1 and split at call 2 (same output, other context)."""
  c2a = (P + [10, 11, 50, 12, 60], [13])
  c2b = (P + [10, 11, 50, 12, 61], [13])
  segment, parent = call_segments([_traj(A, B, c2a), _traj(A, B, c2b)])
  np.testing.assert_array_equal(segment, [[0, 1, 2], [0, 1, 3]])
  np.testing.assert_array_equal(parent, [-1, 0, 1, 1])


def test_call_segments_duplicate_and_prefix_trajectories():
  group = [_traj(A, B, C), _traj(A, B, C), _traj(A, B), _traj()]
  segment, parent = call_segments(group)
  np.testing.assert_array_equal(segment, [[0, 1, 2], [0, 1, 2], [0, 1, -1], [-1, -1, -1]])
  np.testing.assert_array_equal(parent, [-1, 0, 1])
  segment, parent = call_segments([])
  assert segment.shape == (0, 0) and parent.shape == (0,)


def test_call_segments_index_calls_like_build_tree_turns():
  """A call without output_ids is still call k (build_tree's "turn" counts it)."""
  empty = (P + [10, 11, 50], [])
  group = [_traj(A, empty, C), _traj(A, empty, C2)]
  segment, parent = call_segments(group)
  np.testing.assert_array_equal(segment, [[0, 1, 2], [0, 1, 3]])
  turns = build_tree(group).seqs[1].fields["turn"]
  np.testing.assert_array_equal(turns, [0, 0, 2])  # tokens of calls 0 and 2
  assert set(segment[1, turns.astype(int)]) == {0, 3}


# ----------------------------------------------------------------------------- tree_advantages


def ref_tree_advantages(rewards, segment, parent, valid=None):
  """TreeRL, transcribed with loops: V(n) over the valid leaves through n, the local term
  against the nearest ancestor with another leaf set (the segment's branch point) or the root."""
  rewards = np.asarray(rewards, np.float64)
  segment = np.asarray(segment)
  S, K = segment.shape
  valid = np.ones(S, bool) if valid is None else np.asarray(valid, bool)
  live = [s for s in range(S) if valid[s]]
  out = np.zeros((S, K))
  if len(live) <= 1 or len({rewards[s] for s in live}) == 1:
    return out
  leaves = {n: {s for s in live if n in segment[s]} for n in range(len(parent))}
  value = {n: np.mean([rewards[s] for s in ls]) if ls else 0.0 for n, ls in leaves.items()}
  root = np.mean([rewards[s] for s in live])
  for s in live:
    for k in range(K):
      n = int(segment[s, k])
      if n < 0:
        continue
      p = int(parent[n])
      while p >= 0 and leaves[p] == leaves[n]:
        p = int(parent[p])
      vp = root if p < 0 else value[p]
      out[s, k] = ((value[n] - root) + (value[n] - vp)) / np.sqrt(len(leaves[n]))
  return out


def _random_group(rng, size):
  """Trajectories that copy a random prefix of calls of an earlier one, then diverge."""
  group = []
  for t in range(size):
    calls = []
    if group and rng.random() < 0.8:
      src = group[int(rng.integers(len(group)))].calls
      calls = list(src[:int(rng.integers(0, len(src) + 1))])
    for _ in range(int(rng.integers(0 if calls else 1, 4))):
      ctx = [1] if not calls else list(calls[-1].input_ids) + list(calls[-1].output_ids) + [9]
      calls.append(CallTokens(ctx, rng.integers(10, 14, 2).tolist()))
    group.append(TrajectoryTokens(calls))
  return group


def test_tree_advantages_hand_values():
  """Nodes: 0 = A (leaves 0, 1, 2), 1 = B (0, 1), 2 = C, 3 = C2, 4 = B2, 5 = D. Rewards 1, 0,
  1, 0: root 0.5; V = 2/3, 1/2, 1, 0, 1, 0."""
  segment, parent = call_segments([_traj(A, B, C), _traj(A, B, C2), _traj(A, B2), _traj(D)])
  out = np.asarray(adv.tree_advantages([1.0, 0.0, 1.0, 0.0], segment, parent))
  a = ((2 / 3 - 0.5) + (2 / 3 - 0.5)) / np.sqrt(3)  # parent: the root
  b = ((0.5 - 0.5) + (0.5 - 2 / 3)) / np.sqrt(2)
  expected = [[a, b, 0.5 + 0.5], [a, b, -0.5 - 0.5], [a, 0.5 + 1 / 3, 0], [-0.5 - 0.5, 0, 0]]
  np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(out, ref_tree_advantages([1, 0, 1, 0], segment, parent), atol=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_tree_advantages_match_reference(seed):
  rng = np.random.default_rng(seed)
  group = _random_group(rng, 7)
  segment, parent = call_segments(group)
  rewards = rng.integers(0, 3, len(group)) * 0.5
  valid = rng.random(len(group)) < 0.8
  for v in (None, valid):
    out = adv.tree_advantages(rewards, segment, parent, v)
    np.testing.assert_allclose(out, ref_tree_advantages(rewards, segment, parent, v),
                               rtol=1e-5, atol=1e-6)
  out = np.asarray(adv.tree_advantages(rewards, segment, parent, valid))
  assert np.all(out[~valid] == 0.0) and np.all(out[segment < 0] == 0.0)


def test_tree_advantages_invalid_and_unbranched_runs():
  """Trajectory 2 is invalid: node B2 has no valid leaf and B's run above C/C2 is unbranched
  once 2 is gone, so A and B share one segment (same advantage); padding stays 0."""
  segment, parent = call_segments([_traj(A, B, C), _traj(A, B, C2), _traj(A, B2), _traj(D)])
  rewards = [1.0, 0.0, 7.0, 0.0]
  valid = [True, True, False, True]
  out = np.asarray(adv.tree_advantages(rewards, segment, parent, valid))
  np.testing.assert_allclose(out, ref_tree_advantages(rewards, segment, parent, valid), atol=1e-6)
  assert out[0, 0] == out[0, 1] and np.all(out[2] == 0.0)


def test_tree_advantages_degenerate_group_is_exactly_zero():
  segment, parent = call_segments([_traj(A, B, C), _traj(A, B, C2), _traj(A, B2)])
  assert np.all(np.asarray(adv.tree_advantages([0.1] * 3, segment, parent)) == 0.0)
  one_valid = adv.tree_advantages([1.0, 0.0, 2.0], segment, parent, [False, True, False])
  assert np.all(np.asarray(one_valid) == 0.0)
  assert adv.tree_advantages([], np.zeros((0, 0), np.int32), np.zeros(0, np.int32)).shape == (0, 0)


def test_tree_advantages_independent_episodes_are_twice_centred_rewards():
  group = [_traj(A, B, C), _traj(D, (P + [20, 70], [21])), _traj((P, [30]))]
  segment, parent = call_segments(group)
  r = np.array([1.0, 0.0, 0.5])
  out = np.asarray(adv.tree_advantages(r, segment, parent))
  expected = np.where(segment >= 0, 2 * (r - r.mean())[:, None], 0.0)
  np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-7)


def test_tree_advantages_jit_and_errors():
  segment, parent = call_segments([_traj(A, B, C), _traj(A, B, C2), _traj(A, B2)])
  r = jnp.asarray([1.0, 0.0, 0.5])
  out = jax.jit(adv.tree_advantages)(r, jnp.asarray(segment), jnp.asarray(parent))
  np.testing.assert_allclose(out, adv.tree_advantages(r, segment, parent), rtol=1e-6)
  with pytest.raises(ValueError, match="segment"):
    adv.tree_advantages(r, segment[:2], parent)
  with pytest.raises(ValueError, match="integer"):
    adv.tree_advantages(r, segment.astype(np.float32), parent)
  with pytest.raises(ValueError, match=r"node ids in \[-1, 4\)"):
    adv.tree_advantages(r, segment, parent[:-1])


# ----------------------------------------------------------------------------- entropy_aware


def ref_entropy_aware(a, h, m, group, alpha, eps=1e-6):
  a, h, m = (np.asarray(x, np.float64) for x in (a, h, m))
  out = np.zeros_like(a)
  for g in set(np.asarray(group).tolist()):
    rows = [s for s in range(len(group)) if group[s] == g]
    vals = [h[s, t] for s in rows for t in range(h.shape[1]) if m[s, t]]
    if not vals:
      continue
    mean, std = np.mean(vals), np.std(vals)
    for s in rows:
      for t in range(h.shape[1]):
        if m[s, t]:
          z = 0.0 if max(vals) == min(vals) else (h[s, t] - mean) / (std + eps)
          out[s, t] = a[s, t] * (1 + alpha * z)
  return out


def _entropy_case(seed=0):
  rng = np.random.default_rng(seed)
  S, T = 6, 5
  a = rng.normal(size=(S, T)).astype(np.float32)
  h = rng.uniform(0, 3, (S, T)).astype(np.float32)
  m = (rng.random((S, T)) < 0.8).astype(np.float32)
  m[3] = 0.0                                   # a sequence without loss tokens
  group = np.array([4, 9, 4, 9, 2, 2])         # non-contiguous ids
  h[4], h[5] = 1.5, 1.5                        # group 2: constant entropy
  h[m == 0] = np.nan                           # masked entries may hold anything
  a[m == 0] = np.nan
  return a, h, m, group


def test_entropy_aware_matches_reference():
  a, h, m, group = _entropy_case()
  for alpha in (0.0, 0.3, 2.0):
    out = np.asarray(adv.entropy_aware(a, h, m, group, alpha))
    np.testing.assert_allclose(out, ref_entropy_aware(a, h, m, group, alpha), rtol=1e-5,
                               atol=1e-6)
    assert np.all(out[m == 0] == 0.0)
  out = np.asarray(adv.entropy_aware(a, h, m, group, 0.7))
  live = m[4:] > 0
  assert np.all(out[4:][live] == a[4:][live])  # constant-entropy group: factor 1 exactly


def test_entropy_aware_no_entropy_gradient_and_group_local():
  a, h, m, group = _entropy_case(1)
  h = np.nan_to_num(h)
  a = np.nan_to_num(a)
  g = jax.grad(lambda x: adv.entropy_aware(a, x, m, group, 0.5).sum())(jnp.asarray(h))
  assert np.all(np.asarray(g) == 0.0)
  whole = np.asarray(adv.entropy_aware(a, h, m, group, 0.5))
  for g_id in (4, 9, 2):  # one group at a time (a micro-batch holding only that group)
    rows = group == g_id
    part = adv.entropy_aware(a[rows], h[rows], m[rows], group[rows], 0.5)
    np.testing.assert_allclose(part, whole[rows], rtol=1e-6, atol=1e-7)
  with pytest.raises(ValueError, match="alpha"):
    adv.entropy_aware(a, h, m, group, -1.0)
  with pytest.raises(ValueError, match="entropy"):
    adv.entropy_aware(a, h[:, :2], m, group, 0.5)


# ----------------------------------------------------------------------------- aepo


def _aepo_case():
  """Two groups; tokens in every region: in range, clipped above/below with and against A."""
  r = np.array([[1.05, 1.5, 0.5, 1.5, 0.5, 0.95], [8.0, 8.0, 1.1, 0.7, 1.29, 1.27]])
  a = np.array([[1.0, 1.0, -1.0, -1.0, 1.0, -1.0], [0.5, -2.0, 0.3, 0.8, 1.0, -0.4]])
  m = np.ones_like(r)
  m[1, 5] = 0.0
  h = np.array([[0.1, 2.0, 0.5, 1.0, 0.3, 0.7], [1.5, 0.2, 0.9, 0.4, 2.5, 9.0]])
  lp = np.full(r.shape, -1.0)
  group = np.array([0, 1])
  batch = rb.SeqBatch(
      logprobs=jnp.asarray(lp, jnp.float32), mask=jnp.asarray(m, jnp.float32),
      advantages=jnp.asarray(a, jnp.float32),
      old_logprobs=jnp.asarray(lp - np.log(r), jnp.float32),
      entropy=jnp.asarray(h, jnp.float32), group=jnp.asarray(group, jnp.int32),
      counts=rb.global_counts(m, group))
  r = np.exp(lp - np.asarray(batch.old_logprobs, np.float64))  # the f32 ratios JAX sees
  return batch, r, a, m, h, group


def ref_aepo(r, a, m, el=0.2, eh=0.28):
  """Per-token value and d/dlog π of ℓ = -A·F, token_mean: F' = r (unclipped), 0 (clipped),
  1+ε_h (preserved)."""
  n = m.sum()
  preserved = (a > 0) & (r > 1 + eh)
  ppo = -np.minimum(r * a, np.clip(r, 1 - el, 1 + eh) * a)
  unclipped = ppo == -r * a
  value = np.where(preserved, -a * (1 + eh), ppo)
  dF = np.where(preserved, 1 + eh, np.where(unclipped, r, 0.0))
  return (value * m).sum() / n, -a * dF * m / n, preserved


def _aepo_grad(batch, cfg):
  fn = lambda lp: losses.compute(batch.replace(logprobs=lp), cfg)
  (v, metrics), g = jax.value_and_grad(fn, has_aux=True)(batch.logprobs)
  return float(v), np.asarray(g), metrics


def test_aepo_value_and_gradient():
  batch, r, a, m, _, _ = _aepo_case()
  v, g, metrics = _aepo_grad(batch, LossConfig(name="aepo"))
  v_ref, g_ref, preserved = ref_aepo(r, a, m)
  np.testing.assert_allclose(v, v_ref, rtol=1e-6)
  np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-8)
  assert preserved[m > 0].sum() == 3 and np.all(g[preserved] != 0.0)
  live = m > 0
  assert float(metrics["preserved_fraction"]) == pytest.approx(preserved[live].mean())
  # gradient cut by the clip: only (r 0.5, A -1); (r 0.5, A 1) and (r 0.7, A 0.8) keep r·A
  assert float(metrics["clip_fraction"]) == pytest.approx(1 / live.sum())
  # dapo: the same value, gradient 0 where aepo keeps it
  v_dapo, g_dapo, _ = _aepo_grad(batch, LossConfig(name="dapo"))
  np.testing.assert_allclose(v, v_dapo, rtol=1e-6)
  assert np.all(g_dapo[preserved] == 0.0)
  np.testing.assert_allclose(g[~preserved], g_dapo[~preserved], rtol=1e-6)


def test_aepo_entropy_aware_advantages():
  batch, r, a, m, h, group = _aepo_case()
  alpha = 0.4
  v, g, _ = _aepo_grad(batch, LossConfig(name="aepo", entropy_adv_coef=alpha))
  a_hat = ref_entropy_aware(a, h, m, group, alpha)
  v_ref, g_ref, _ = ref_aepo(r, a_hat, m)
  np.testing.assert_allclose(v, v_ref, rtol=1e-5)
  np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-7)
  assert not np.allclose(a_hat, a * m)  # the reweighting did something


def test_aepo_errors():
  batch, *_ = _aepo_case()
  with pytest.raises(ValueError, match=r"entropy_adv_coef > 0 needs SeqBatch\.entropy"):
    losses.compute(batch.replace(entropy=None), LossConfig(name="aepo", entropy_adv_coef=0.1))
  with pytest.raises(ValueError, match=r"LossConfig\.entropy_adv_coef=0\.1: applies to 'aepo'"):
    losses.compute(batch, LossConfig(name="dapo", entropy_adv_coef=0.1))
  with pytest.raises(ValueError, match=r"LossConfig\.entropy_adv_coef=-1"):
    losses.check_config(LossConfig(name="aepo", entropy_adv_coef=-1.0))
  losses.compute(batch.replace(entropy=None), LossConfig(name="aepo"))  # α = 0: no entropy
