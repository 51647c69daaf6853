"""Loss contracts of docs/design.md §3, for every loss in `rl.losses.LOSSES`:

1. Tree contract: a loss computed on a TreeBatch (flat per-position log-probs gathered with
   `seq_index`) equals the same loss on the trajectories unpacked (each trajectory's sampled
   tokens as its own sequence, built here without the packer), in value and in the gradient
   with respect to the flat per-position log-probs.
2. Invariance: one batch, the same batch as 4 micro-batches with summed gradients, and the same
   batch over 2 simulated data-parallel devices (subprocess, shard_map) give the same gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl import batch as rb
from rl import losses
from rl.packing import pack
from rl.tree import CallTokens, TrajectoryTokens, build_tree
from tests.conftest import run_check

VOCAB = 4  # tiny vocabulary: sampled tokens of different trajectories often coincide (shared nodes)
FIELDS = ("logprobs", "old_logprobs", "ref_logprobs", "teacher_logprobs", "failed", "loss_mask")


def loss_configs() -> list[losses.LossConfig]:
  """Every registered loss with its default aggregation, plus every valid aggregation of a
  token-level (ppo) and a sequence-level (gspo) loss, and the optional terms."""
  cfgs = [losses.LossConfig(name=n, max_len=16) for n in sorted(losses.LOSSES)]
  cfgs += [losses.LossConfig(name="ppo", aggregation=a, max_len=16) for a in losses.AGGREGATIONS]
  if "gspo" in losses.LOSSES:
    cfgs += [losses.LossConfig(name="gspo", aggregation=a)
             for a in ("seq_mean", "prompt_mean", "token_mean")]
  cfgs += [losses.LossConfig(name="ppo", kl_coef=0.1, kl_estimator=k, entropy_coef=0.01)
           for k in losses.KL_ESTIMATORS]
  cfgs += [losses.LossConfig(name="sft", mask_failed_turns=True)]
  if "aepo" in losses.LOSSES:  # entropy-aware advantages: group statistics over loss tokens
    cfgs += [losses.LossConfig(name="aepo", entropy_adv_coef=0.5)]
  if "opd" in losses.LOSSES:
    cfgs += [losses.LossConfig(name="ppo", opd_coef=0.5, decoupled=True, behaviour_cap=2.0)]
  return cfgs


def _ids(cfg):
  return f"{cfg.name}-{cfg.aggregation or 'default'}" + (
      f"-{cfg.kl_estimator}" if cfg.kl_coef else "") + ("-opd" if cfg.opd_coef else "") + (
      "-failed" if cfg.mask_failed_turns else "") + (
      "-entropy_adv" if cfg.entropy_adv_coef else "")


# ----------------------------------------------------------------------------- tree contract


def _call(rng, inp, out_len):
  out = rng.integers(0, VOCAB, out_len).tolist()
  fields = {"logprobs": -rng.exponential(size=out_len), "old_logprobs": -rng.exponential(size=out_len),
            "ref_logprobs": -rng.exponential(size=out_len),
            "teacher_logprobs": -rng.exponential(size=out_len),
            "failed": np.full(out_len, float(rng.random() < 0.3)),
            "loss_mask": (rng.random(out_len) < 0.85).astype(float)}
  return CallTokens(list(inp), out, {k: v.tolist() for k, v in fields.items()})


def _group(rng, size: int) -> list[TrajectoryTokens]:
  """`size` trajectories sharing a prompt: multi-call episodes whose later calls repeat earlier
  sampled tokens as context, a second trajectory branching inside the first one's sampled span,
  a call that is a prefix of another, and a compaction call that restarts from a summary."""
  prompt = rng.integers(0, VOCAB, 5).tolist()
  group, first_out = [], None
  for t in range(size):
    calls = []
    out1 = _call(rng, prompt, 6)
    if first_out is not None and t % 2:  # branch inside the first trajectory's sampled span
      shared = first_out[:3]
      out1 = CallTokens(prompt, shared + out1.output_ids[3:], out1.fields)
    first_out = first_out or out1.output_ids
    calls.append(out1)
    ctx = prompt + out1.output_ids + rng.integers(0, VOCAB, 2).tolist()
    for _ in range(int(rng.integers(1, 3))):  # each call's sequence is a prefix of the next
      c = _call(rng, ctx, int(rng.integers(2, 5)))
      calls.append(c)
      ctx = ctx + c.output_ids + rng.integers(0, VOCAB, 2).tolist()
    if rng.random() < 0.5:  # context compaction: continue from a short summary
      calls.append(_call(rng, prompt + rng.integers(0, VOCAB, 2).tolist(), 4))
    reward = float(rng.integers(0, 2)) + 0.1 * t  # distinct within a group (DPO picks a side)
    group.append(TrajectoryTokens(calls, {"reward": reward, "advantage": float(rng.normal())}))
  return group


def _value(table, rng, key):
  if key not in table:
    table[key] = float(-rng.exponential())
  return table[key]


def _unpacked(groups, table, rng):
  """SeqBatch built straight from the trajectories, and each entry's (group, context) key."""
  rows, keys = [], []
  ent = lambda key: _value(table, rng, ("entropy",) + key[:1] + (key[1][:-1],))
  for g, group in enumerate(groups):
    for traj in group:
      entry = {k: [] for k in FIELDS + ("turn", "key", "advantage")}
      for c, call in enumerate(traj.calls):
        for k, tok in enumerate(call.output_ids):
          key = (g, tuple(call.input_ids) + tuple(call.output_ids[:k + 1]))
          entry["key"].append(key)
          entry["turn"].append(c)
          entry["advantage"].append(traj.scalars["advantage"])
          for f in FIELDS:
            entry[f].append(call.fields[f][k])
      rows.append((g, traj.scalars["reward"], entry))
  T = max(len(e["key"]) for _, _, e in rows)
  S = len(rows)
  arr = lambda f: np.array([e[f] + [0.0] * (T - len(e[f])) for _, _, e in rows], np.float32)
  lp = np.zeros((S, T), np.float32)
  entropy = np.zeros((S, T), np.float32)
  for s, (_, _, e) in enumerate(rows):
    for t, key in enumerate(e["key"]):
      lp[s, t] = _value(table, rng, key)
      entropy[s, t] = -ent(key)
      keys.append(((s, t), key))
  mask = arr("loss_mask")
  group = np.array([g for g, _, _ in rows], np.int32)
  batch = rb.SeqBatch(
      logprobs=jnp.asarray(lp), mask=jnp.asarray(mask), advantages=jnp.asarray(arr("advantage")),
      old_logprobs=jnp.asarray(arr("old_logprobs")), sampler_logprobs=jnp.asarray(arr("logprobs")),
      ref_logprobs=jnp.asarray(arr("ref_logprobs")),
      teacher_logprobs=jnp.asarray(arr("teacher_logprobs")), entropy=jnp.asarray(entropy),
      weights=None,
      turn=jnp.asarray(arr("turn").astype(np.int32)), failed=jnp.asarray(arr("failed")),
      reward=jnp.asarray([r for _, r, _ in rows], jnp.float32), group=jnp.asarray(group),
      counts=rb.global_counts(mask, group))
  return batch, keys


@pytest.fixture(scope="module")
def tree_case():
  rng = np.random.default_rng(0)
  groups = [_group(rng, 2) for _ in range(3)]
  trees = [build_tree(g) for g in groups]
  (tb,) = pack(trees, row_len=128)
  table = {}
  flat = np.zeros(tb.tokens.size, np.float32)
  flat_entropy = np.zeros(tb.tokens.size, np.float32)  # entropy of the predicted distribution
  flat_keys = {}
  for p, (g, n) in enumerate(zip(tb.group.reshape(-1), tb.node.reshape(-1))):
    if g >= 0:
      key = (int(g), tuple(trees[g].path(int(n))))
      flat[p] = _value(table, rng, key)
      flat_entropy[p] = -_value(table, rng, ("entropy", key[0], key[1][:-1]))
      if tb.owner.reshape(-1)[p]:
        flat_keys[p] = key
  unpacked, keys = _unpacked(groups, table, rng)
  entropy = rb.gather(jnp.asarray(flat_entropy), jnp.asarray(tb.seq_index))
  return tb, jnp.asarray(flat), entropy, flat_keys, unpacked, keys


@pytest.mark.parametrize("cfg", loss_configs(), ids=_ids)
def test_tree_equals_unpacked(tree_case, cfg):
  tb, flat, entropy, flat_keys, unpacked, keys = tree_case

  def tree_loss(flat):
    b = rb.from_tree_batch(tb, rb.gather(flat, jnp.asarray(tb.seq_index)), entropy)
    return losses.compute(b, cfg)[0]

  def unpacked_loss(lp):
    return losses.compute(unpacked.replace(logprobs=lp), cfg)[0]

  v_tree, g_tree = jax.jit(jax.value_and_grad(tree_loss))(flat)
  v_unp, g_unp = jax.jit(jax.value_and_grad(unpacked_loss))(unpacked.logprobs)
  np.testing.assert_allclose(v_tree, v_unp, rtol=1e-6, atol=1e-7)
  assert float(jnp.abs(v_unp)) > 0  # the case exercises the loss
  by_key = {}
  for (s, t), key in keys:
    by_key[key] = by_key.get(key, 0.0) + float(g_unp[s, t])
  g_tree = np.asarray(g_tree)
  tree_by_key = {key: float(g_tree[p]) for p, key in flat_keys.items()}
  assert set(by_key) <= set(tree_by_key)
  ref = np.array([by_key.get(k, 0.0) for k in tree_by_key])
  got = np.array(list(tree_by_key.values()))
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7 + 1e-5 * np.abs(ref).max())
  # positions that are not sequence owners get no gradient
  others = np.setdiff1d(np.arange(g_tree.size), list(flat_keys))
  assert not np.any(g_tree[others])


# ----------------------------------------------------------------------------- invariance

S, T = 8, 9


def random_batch(seed: int = 0) -> rb.SeqBatch:
  """8 sequences in 4 groups of 2 (contiguous, so 4 micro-batches and 2 shards keep groups
  whole), ragged masks, one sequence without loss tokens."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(3, T + 1, S)
  mask = (np.arange(T)[None] < lengths[:, None]) & (rng.random((S, T)) < 0.9)
  mask[5] = False
  mask = mask.astype(np.float32)
  group = np.repeat(np.arange(4), 2).astype(np.int32)
  turn = np.cumsum(rng.random((S, T)) < 0.3, axis=1).astype(np.int32)
  lp = lambda: -rng.exponential(size=(S, T)).astype(np.float32)
  reward = rng.integers(0, 2, S).astype(np.float32) + 0.1 * np.arange(S, dtype=np.float32)
  return rb.SeqBatch(
      logprobs=jnp.asarray(lp()), mask=jnp.asarray(mask),
      advantages=jnp.asarray(np.repeat(rng.normal(size=(S, 1)), T, 1).astype(np.float32)),
      old_logprobs=jnp.asarray(lp()), sampler_logprobs=jnp.asarray(lp()),
      ref_logprobs=jnp.asarray(lp()), teacher_logprobs=jnp.asarray(lp()),
      entropy=jnp.asarray(rng.random((S, T)).astype(np.float32)),
      weights=jnp.asarray(rng.uniform(0.5, 1.5, (S, T)).astype(np.float32)),
      turn=jnp.asarray(turn), failed=jnp.asarray((rng.random((S, T)) < 0.2).astype(np.float32)),
      reward=jnp.asarray(reward), group=jnp.asarray(group), counts=rb.global_counts(mask, group))


def split(batch: rb.SeqBatch, parts: int) -> list[rb.SeqBatch]:
  n = S // parts
  return [jax.tree.map(lambda x: x[i * n:(i + 1) * n] if x.ndim else x, batch)
          for i in range(parts)]


@pytest.mark.parametrize("cfg", loss_configs(), ids=_ids)
def test_micro_batches_sum_to_batch(cfg):
  batch = random_batch()
  grad = jax.jit(jax.value_and_grad(lambda lp, b: losses.compute(b.replace(logprobs=lp), cfg)[0]))
  v, g = grad(batch.logprobs, batch)
  parts = [grad(b.logprobs, b) for b in split(batch, 4)]
  np.testing.assert_allclose(sum(p[0] for p in parts), v, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(jnp.concatenate([p[1] for p in parts]), g, rtol=1e-6, atol=1e-7)
  assert float(jnp.abs(g).max()) > 0


def test_data_parallel_equals_single_device():
  stdout = run_check("loss_dp_check")
  assert f"ok {len(loss_configs())}" in stdout, stdout
