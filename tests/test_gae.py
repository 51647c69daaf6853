"""GAE on tree-packed batches and the PPO value loss, against independent references.

1. `rl.advantages.tree_gae` on packed random trees equals a float64 NumPy transcription of the
   GAE formula (Schulman et al. 2016) applied to every unpacked trajectory, its values looked up
   by context (not through the packer's indices).
2. The packed PPO + clipped value loss has the gradient of the same losses on the unpacked
   trajectories, with respect to per-node "model" parameters (log-probs and values that depend
   only on the context, as a model's do).
3. `rl.losses.value_loss` equals its NumPy formula in value and gradient.
4. `models.value_head`: the critic's values on a packed tree equal those of the unpacked
   contexts (its training: tests/test_critic.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import value_head
from models.config import ModelConfig
from rl import advantages as adv_lib
from rl import batch as rb
from rl import losses
from rl.packing import pack
from rl.tree import CallTokens, TrajectoryTokens, build_tree

VOCAB = 3  # tiny vocabulary: different trajectories' tokens often coincide (shared nodes)


def reference_gae(rewards: np.ndarray, values: np.ndarray, gamma: float, lam: float):
  """GAE of one path, float64, straight from the published sums (no recursion).

  δ_t = r_t + γ V_{t+1} - V_t (V after the last step = 0), A_t = Σ_l (γλ)^l δ_{t+l},
  target_t = A_t + V_t.
  """
  r, v = np.asarray(rewards, np.float64), np.asarray(values, np.float64)
  n = len(r)
  v_next = np.append(v[1:], 0.0)
  delta = r + gamma * v_next - v
  adv = np.array([sum((gamma * lam) ** l * delta[t + l] for l in range(n - t)) for t in range(n)])
  return adv, adv + v


# ----------------------------------------------------------------------------- random trees


def _call(rng, inp, out):
  n = len(out)
  return CallTokens(list(inp), list(out), {
      "old_logprobs": (-rng.exponential(size=n)).tolist(),
      "loss_mask": (rng.random(n) < 0.85).astype(float).tolist()})


def _tokens(rng, n):
  return rng.integers(0, VOCAB, int(n)).tolist()


def _group(rng, size: int, max_calls: int, max_out: int) -> list[TrajectoryTokens]:
  """`size` episodes of one prompt: later ones branch off an earlier one (its first k calls
  repeated verbatim, call k sharing a prefix of its sampled tokens), multi-call episodes whose
  calls extend the previous call with observation tokens, and sometimes a compaction call that
  restarts from a short summary."""
  prompt = _tokens(rng, rng.integers(2, 6))
  group: list[TrajectoryTokens] = []
  for _ in range(size):
    calls: list[CallTokens] = []
    ctx = prompt
    if group and rng.random() < 0.8:
      base = group[int(rng.integers(len(group)))].calls
      k = int(rng.integers(len(base)))
      calls = list(base[:k])
      shared = base[k].output_ids[:int(rng.integers(len(base[k].output_ids) + 1))]
      out = shared + _tokens(rng, rng.integers(1, max_out))
      calls.append(_call(rng, base[k].input_ids, out))
      ctx = list(base[k].input_ids) + out
    while len(calls) < rng.integers(1, max_calls + 1) or not calls:
      if calls:
        ctx = ctx + _tokens(rng, rng.integers(1, 4))  # the tool's observation
      out = _tokens(rng, rng.integers(1, max_out))
      calls.append(_call(rng, ctx, out))
      ctx = ctx + out
    if rng.random() < 0.2:  # context compaction: the next call does not extend the last one
      calls.append(_call(rng, prompt + _tokens(rng, 2), _tokens(rng, rng.integers(1, max_out))))
    group.append(TrajectoryTokens(calls, {"reward": float(rng.normal())}))
  return group


def _case(seed: int, groups: int, size: int, max_calls: int, max_out: int):
  """Groups, their trees, one packed TreeBatch, a node lookup by context, and random per-node
  parameters (log-prob, value, old value) in one flat vector per kind."""
  rng = np.random.default_rng(seed)
  trajs = [_group(rng, size, max_calls, max_out) for _ in range(groups)]
  trees = [build_tree(g) for g in trajs]
  (batch,) = pack(trees, row_len=128)
  offset = np.cumsum([0] + [len(t) for t in trees])
  node_of = {(g, tuple(tree.path(n))): offset[g] + n
             for g, tree in enumerate(trees) for n in range(len(tree))}
  total = int(offset[-1])
  params = {k: rng.normal(size=total).astype(np.float32) for k in ("logp", "value", "old_value")}
  params["logp"] = -np.abs(params["logp"])
  return trajs, trees, batch, offset, node_of, params


def _unpacked(trajs, node_of):
  """Per trajectory (group order): the parameter index of each sampled token's node and of
  its state (the context before it), its fields, looked up by context."""
  out = []
  for g, group in enumerate(trajs):
    for traj in group:
      token, state, old_lp, mask = [], [], [], []
      for call in traj.calls:
        for k in range(len(call.output_ids)):
          ctx = tuple(call.input_ids) + tuple(call.output_ids[:k])
          state.append(node_of[(g, ctx)])
          token.append(node_of[(g, ctx + (call.output_ids[k],))])
          old_lp.append(call.fields["old_logprobs"][k])
          mask.append(call.fields["loss_mask"][k])
      out.append(dict(g=g, reward=traj.scalars["reward"], token=np.array(token),
                      state=np.array(state), old_logprobs=np.array(old_lp, np.float32),
                      loss_mask=np.array(mask, np.float32)))
  return out


def _flat_index(batch, offset):
  """[rows, row_len] parameter index of each packed position (a copy reads its node's), and
  whether the position is real."""
  real = batch.group >= 0
  return np.where(real, offset[np.maximum(batch.group, 0)] + batch.node, 0), real


def _packed_order(batch, trajs):
  """The unpacked trajectory (flat, group order) of each packed sequence."""
  first = np.cumsum([0] + [len(g) for g in trajs])
  return first[batch.scalars["group"].astype(int)] + batch.seq_trajectory


SHAPES = [  # (seed, groups, group size, max calls, max sampled tokens per call)
    (10, 1, 1, 1, 12),     # one plain sequence
    (1, 2, 4, 3, 10),      # branched multi-call groups in one row
    (2, 3, 6, 4, 24),      # trees larger than a row: parts with carried context copies
    (3, 1, 8, 2, 40),      # wide and deep
]
GAMMA_LAM = [(1.0, 1.0), (1.0, 0.95), (0.99, 1.0), (0.9, 0.5), (0.8, 0.0)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"seed{s[0]}")
def test_tree_gae_matches_unpacked_paths(shape):
  trajs, trees, batch, offset, node_of, params = _case(*shape)
  index, real = _flat_index(batch, offset)
  flat_values = np.where(real, params["value"][index], np.nan)  # padding never read
  order = _packed_order(batch, trajs)
  paths = _unpacked(trajs, node_of)
  rewards = batch.scalars["reward"]
  for gamma, lam in GAMMA_LAM:
    adv, ret = adv_lib.tree_gae(rewards, flat_values, batch.seq_pred, batch.seq_valid, gamma, lam)
    adv, ret = np.asarray(adv), np.asarray(ret)
    for i, p in enumerate(order):
      path = paths[p]
      n = len(path["token"])
      r = np.zeros(n)
      r[-1] = path["reward"]
      want_adv, want_ret = reference_gae(r, params["value"][path["state"]], gamma, lam)
      np.testing.assert_allclose(adv[i, :n], want_adv, rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(ret[i, :n], want_ret, rtol=1e-5, atol=1e-5)
      assert not adv[i, n:].any() and not ret[i, n:].any()
  # shared nodes exist in these trees: the check covered tokens on several paths
  if shape[2] > 1:
    tokens = np.concatenate([p["token"] for p in paths])
    assert len(np.unique(tokens)) < len(tokens)


def test_gae_per_token_rewards_and_holes():
  rng = np.random.default_rng(5)
  S, T = 4, 9
  rewards = rng.normal(size=(S, T)).astype(np.float32)
  values = rng.normal(size=(S, T)).astype(np.float32)
  valid = rng.random((S, T)) < 0.7
  valid[0] = False  # a row with no step
  for gamma, lam in GAMMA_LAM:
    adv, ret = adv_lib.gae(rewards, values, valid, gamma, lam)
    for s in range(S):
      (t,) = np.nonzero(valid[s])
      if len(t):
        want_adv, want_ret = reference_gae(rewards[s, t], values[s, t], gamma, lam)
        np.testing.assert_allclose(np.asarray(adv)[s, t], want_adv, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(ret)[s, t], want_ret, rtol=1e-5, atol=1e-5)
      assert not np.asarray(adv)[s, ~valid[s]].any()
      assert not np.asarray(ret)[s, ~valid[s]].any()


def test_gae_lambda_one_is_discounted_return_minus_value():
  rewards = np.array([[0.0, 1.0, 0.0, 2.0]], np.float32)
  values = np.array([[0.3, -0.2, 0.5, 0.1]], np.float32)
  valid = np.ones((1, 4), bool)
  adv, ret = adv_lib.gae(rewards, values, valid, gamma=0.5, lam=1.0)
  mc = np.array([0.5 + 0.125 * 2, 1.0 + 0.25 * 2, 0.5 * 2, 2.0])  # Σ γ^l r_{t+l}
  np.testing.assert_allclose(np.asarray(ret)[0], mc, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(adv)[0], mc - values[0], rtol=1e-6)
  # λ = 0: the one-step TD error
  adv0, _ = adv_lib.gae(rewards, values, valid, gamma=0.5, lam=0.0)
  td = rewards[0] + 0.5 * np.append(values[0, 1:], 0.0) - values[0]
  np.testing.assert_allclose(np.asarray(adv0)[0], td, rtol=1e-6)


def test_gae_no_gradient_into_targets_and_jittable():
  values = jnp.array([[0.3, -0.2, 0.5]])
  valid = jnp.ones((1, 3), bool)
  grad = jax.grad(lambda v: adv_lib.gae(jnp.array([1.0]), v, valid, 0.9, 0.9)[1].sum())(values)
  assert not np.asarray(grad).any()
  jitted = jax.jit(adv_lib.gae)(jnp.array([1.0]), values, valid, 0.9, 0.9)
  np.testing.assert_allclose(jitted[0], adv_lib.gae(np.array([1.0]), values, valid, 0.9, 0.9)[0])


def test_gae_errors():
  v, valid = np.zeros((2, 3), np.float32), np.ones((2, 3), bool)
  with pytest.raises(ValueError, match="gamma"):
    adv_lib.gae(np.zeros(2), v, valid, gamma=1.5)
  with pytest.raises(ValueError, match="lam"):
    adv_lib.gae(np.zeros(2), v, valid, lam=-0.1)
  with pytest.raises(ValueError, match="rewards"):
    adv_lib.gae(np.zeros(3), v, valid)
  with pytest.raises(ValueError, match="values"):
    adv_lib.gae(np.zeros(2), np.zeros(2), valid)
  with pytest.raises(ValueError, match="seq_pred"):
    adv_lib.tree_gae(np.zeros(2), np.zeros(8), np.zeros((2, 4), np.int32), valid)
  assert adv_lib.CRITIC_ADVANTAGES["gae"] is adv_lib.tree_gae


# ----------------------------------------------------------------------------- gradients


GRAD_CFG = losses.LossConfig(name="ppo", eps_low=0.2, eps_high=0.2)
VALUE_CLIP = 0.2


def _loss(logprobs, values, old_values, old_logprobs, adv, ret, mask, group):
  """PPO clip loss + clipped value loss on per-sequence arrays (token mean)."""
  seq = rb.SeqBatch(logprobs=logprobs, mask=mask, advantages=adv, old_logprobs=old_logprobs,
                    group=group, counts=rb.global_counts(mask, group))
  policy, _ = losses.ppo(seq, GRAD_CFG)
  value, _ = losses.value_loss(values, ret, losses.token_scale(seq, "token_mean"), old_values,
                               VALUE_CLIP)
  return policy + value


@pytest.mark.parametrize("shape", SHAPES[2:3], ids=lambda s: f"seed{s[0]}")
def test_packed_ppo_and_value_gradient_equals_unpacked(shape):
  trajs, trees, batch, offset, node_of, params = _case(*shape)
  gamma, lam = 0.95, 0.9
  theta = {k: jnp.asarray(params[k]) for k in ("logp", "value")}
  # Old log-probs near the current ones, so some ratios clip and some do not.
  index, real = _flat_index(batch, offset)
  mask = jnp.asarray(batch.seq_valid * batch.fields["loss_mask"])
  group = jnp.asarray(batch.scalars["group"].astype(np.int32))
  old_values = np.where(real, params["old_value"][index], 0.0)
  adv, ret = adv_lib.tree_gae(batch.scalars["reward"], old_values, batch.seq_pred,
                              batch.seq_valid, gamma, lam)

  def packed(theta):
    flat_lp = jnp.where(real, theta["logp"][index], 0.0)
    flat_v = jnp.where(real, theta["value"][index], 0.0)
    return _loss(rb.gather(flat_lp, batch.seq_index), rb.gather(flat_v, batch.seq_pred),
                 rb.gather(jnp.asarray(old_values), batch.seq_pred),
                 jnp.asarray(batch.fields["old_logprobs"]), adv, ret, mask, group)

  paths = _unpacked(trajs, node_of)
  S, T = len(paths), max(len(p["token"]) for p in paths)
  tok, state = np.zeros((S, T), int), np.zeros((S, T), int)
  u_mask, u_old, u_adv, u_ret = (np.zeros((S, T), np.float32) for _ in range(4))
  for s, p in enumerate(paths):
    n = len(p["token"])
    tok[s, :n], state[s, :n], u_mask[s, :n], u_old[s, :n] = (p["token"], p["state"],
                                                             p["loss_mask"], p["old_logprobs"])
    r = np.zeros(n)
    r[-1] = p["reward"]
    u_adv[s, :n], u_ret[s, :n] = reference_gae(r, params["old_value"][p["state"]], gamma, lam)
  u_group = jnp.asarray([p["g"] for p in paths], jnp.int32)

  def unpacked(theta):
    return _loss(theta["logp"][tok], theta["value"][state],
                 jnp.asarray(params["old_value"][state]), jnp.asarray(u_old), jnp.asarray(u_adv),
                 jnp.asarray(u_ret), jnp.asarray(u_mask), u_group)

  value_p, grad_p = jax.jit(jax.value_and_grad(packed))(theta)
  value_u, grad_u = jax.jit(jax.value_and_grad(unpacked))(theta)
  np.testing.assert_allclose(value_p, value_u, rtol=1e-6)
  for k in theta:
    g_p, g_u = np.asarray(grad_p[k]), np.asarray(grad_u[k])
    assert np.linalg.norm(g_p - g_u) <= 1e-5 * np.linalg.norm(g_u) + 1e-7, k
    assert np.linalg.norm(g_u) > 0, k
  # The fixture is not trivial: shared tokens, clipped ratios and clipped values occur.
  tokens = np.concatenate([p["token"] for p in paths])
  assert len(np.unique(tokens)) < len(tokens)
  seq = rb.SeqBatch(logprobs=jnp.asarray(params["logp"][tok]), mask=jnp.asarray(u_mask),
                    advantages=jnp.asarray(u_adv), old_logprobs=jnp.asarray(u_old),
                    group=u_group, counts=rb.global_counts(u_mask, u_group))
  _, metrics = losses.value_loss(jnp.asarray(params["value"][state]), jnp.asarray(u_ret),
                                 losses.token_scale(seq, "token_mean"),
                                 jnp.asarray(params["old_value"][state]), VALUE_CLIP)
  assert 0 < float(metrics["value_clip_fraction"]) < 1
  assert 0 < float(losses.ppo(seq, GRAD_CFG)[1]["clip_fraction"])


# ----------------------------------------------------------------------------- value loss


def reference_value_loss(v, v_old, ret, mask, clip):
  """float64: Σ mask · ½·max((V-R)², (V_old + clip(V-V_old, ±ε) - R)²) / Σ mask, and its
  gradient in V (the branch that attains the max; the clipped branch is flat outside ±ε)."""
  v, v_old, ret, mask = (np.asarray(x, np.float64) for x in (v, v_old, ret, mask))
  n = mask.sum()
  plain = (v - ret) ** 2
  if clip is None:
    return (mask * 0.5 * plain).sum() / n, mask * (v - ret) / n
  near = v_old + np.clip(v - v_old, -clip, clip)
  clipped = (near - ret) ** 2
  inside = np.abs(v - v_old) < clip
  grad = np.where(clipped > plain, np.where(inside, near - ret, 0.0), v - ret)
  return (mask * 0.5 * np.maximum(plain, clipped)).sum() / n, mask * grad / n


@pytest.mark.parametrize("clip", [None, 0.0, 0.1, 0.5])
def test_value_loss_matches_numpy(clip):
  rng = np.random.default_rng(7)
  S, T = 3, 6
  v, v_old, ret = (rng.normal(size=(S, T)).astype(np.float32) for _ in range(3))
  mask = (rng.random((S, T)) < 0.8).astype(np.float32)
  v_garbage = np.where(mask > 0, v, np.nan).astype(np.float32)  # padding never reaches a value
  scale = mask / mask.sum()
  loss_fn = lambda x: losses.value_loss(x, jnp.asarray(ret), jnp.asarray(scale),
                                        jnp.asarray(v_old), clip)[0]
  value, grad = jax.value_and_grad(loss_fn)(jnp.asarray(v_garbage))
  want, want_grad = reference_value_loss(v, v_old, ret, mask, clip)
  np.testing.assert_allclose(value, want, rtol=1e-5)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
  _, metrics = losses.value_loss(jnp.asarray(v), jnp.asarray(ret), jnp.asarray(scale),
                                 jnp.asarray(v_old), clip)
  live = mask > 0
  np.testing.assert_allclose(metrics["value_error"], np.abs(v - ret)[live].mean(), rtol=1e-5)
  if clip is not None:
    near = v_old + np.clip(v - v_old, -clip, clip)
    frac = ((np.abs(v - v_old) > clip) & ((near - ret) ** 2 > (v - ret) ** 2))[live].mean()
    np.testing.assert_allclose(metrics["value_clip_fraction"], frac, rtol=1e-6)


def test_value_loss_errors():
  with pytest.raises(ValueError, match="clip"):
    losses.value_loss(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1, 2)), jnp.zeros((1, 2)),
                      -0.1)


# ----------------------------------------------------------------------------- critic

CRITIC_CFG = ModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=16, intermediate_size=48,
                         initializer_range=0.2)


@pytest.fixture(scope="module")
def critic():
  """A tiny critic whose head is random (a zero head would make the check trivial), as
  (params, jitted values(params, tokens, positions, end))."""
  model = value_head.init(CRITIC_CFG, 0)
  rng = np.random.default_rng(0)
  model.head.weight[...] = jnp.asarray(rng.normal(size=CRITIC_CFG.hidden_size), jnp.float32)
  graphdef, params = nnx.split(model)
  values = jax.jit(lambda params, *rows: nnx.merge(graphdef, params)(*rows)[0])
  return params, values


def _rows(batch):
  return tuple(jnp.asarray(x) for x in (batch.tokens, batch.positions, batch.end))


def test_value_head_starts_at_zero_and_is_linear_in_hidden_states():
  head = value_head.ValueHead(8)
  hidden = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 8)), jnp.bfloat16)
  values = head(hidden)
  assert values.shape == (2, 3) and values.dtype == jnp.float32 and not np.asarray(values).any()
  head.weight[...] = jnp.arange(8.0)
  head.bias[...] = jnp.asarray(0.5)
  np.testing.assert_allclose(head(hidden), np.asarray(hidden, np.float32) @ np.arange(8.0) + 0.5,
                             rtol=1e-6)
  assert value_head.init(CRITIC_CFG, 0).head.weight[...].shape == (CRITIC_CFG.hidden_size,)


def test_critic_on_tree_equals_unpacked_contexts(critic):
  """The critic's value of each sampled token's state, gathered from the packed tree at its
  `seq_pred`, equals the critic's value at the end of that context run unpacked."""
  params, values_fn = critic
  trajs, trees, batch, offset, node_of, _ = _case(1, 2, 3, 2, 6)
  packed = np.asarray(rb.gather(values_fn(params, *_rows(batch)), jnp.asarray(batch.seq_pred)))
  order = _packed_order(batch, trajs)
  contexts = [(i, t, ctx) for i, p in enumerate(order)
              for t, ctx in enumerate(_contexts(trajs, p))]
  longest = max(len(c) for _, _, c in contexts)
  tokens = np.zeros((len(contexts), longest), np.int32)
  for k, (_, _, ctx) in enumerate(contexts):
    tokens[k, :len(ctx)] = ctx
  values = values_fn(params, jnp.asarray(tokens),
                     jnp.broadcast_to(jnp.arange(longest, dtype=jnp.int32), tokens.shape),
                     jnp.full(tokens.shape, longest, jnp.int32))
  for k, (i, t, ctx) in enumerate(contexts):
    np.testing.assert_allclose(packed[i, t], values[k, len(ctx) - 1], rtol=1e-4, atol=1e-5)


def _contexts(trajs, p):
  """The context before each sampled token of flat trajectory p (group order)."""
  flat = [traj for group in trajs for traj in group]
  return [list(call.input_ids) + list(call.output_ids[:k])
          for call in flat[p].calls for k in range(len(call.output_ids))]
