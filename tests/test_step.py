"""trainer.step / trainer.state / trainer.batches against unpacked training (design §3).

The reference runs every LLM call as its own causal row, gathers each trajectory's sampled
tokens (its calls' outputs, in order) into a sequence, and computes the loss on those plain
sequences (SFT: the NumPy formula; GRPO: rl.losses with counts and correction weights built
here), its gradient by a VJP of the row forward. The step instead packs groups into trees,
splits them into 2 real micro-batches (+ 1 padding micro-batch) and sums. One reference
compile per model serves both losses (the loss enters only through the cotangent of the
per-token log-probs and entropies).
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.logprobs import token_logprobs
from rl import corrections, losses
from rl.batch import Counts, SeqBatch
from rl.packing import shard_pairs
from rl.tree import CallTokens, TrajectoryTokens
from tests.conftest import TINY_DENSE, TINY_MOE_MLA, run_check
from tests.test_tree_training import groups as tree_groups
from trainer import batches as B
from trainer import optim as O
from trainer import state as S
from trainer import step as T

ROW = 128
# rows=4: divisible by the 8-device test's data x fsdp = 4; the groups need 5 rows -> 2 real
# micro-batches, plus one padding micro-batch that the step must skip.
SHAPE = B.BatchShape(row_len=ROW, rows=4, seqs=8, seq_len=32, micro_batches=3)
CONFIGS = {"dense": TINY_DENSE, "moe_mla": TINY_MOE_MLA}
LOSSES = {
    "sft": (losses.LossConfig(name="sft"), None),
    "grpo": (losses.LossConfig(name="grpo", kl_coef=0.04, entropy_coef=0.01),
             corrections.CorrectionConfig(kind="tis_token", token_cap=1.1)),
}


def make_groups() -> list[list[TrajectoryTokens]]:
  """The tree-training trajectories (shared prompts, a multi-call trajectory repeating its own
  samples as context, branches inside sampled spans, a prefix call, compaction, a group cut
  into two rows) plus a second partitioned group."""
  rng = np.random.default_rng(5)
  big = rng.integers(1, 128, 40).tolist()
  group_d = [TrajectoryTokens([CallTokens(big, rng.integers(1, 128, 30).tolist())])
             for _ in range(4)]
  return tree_groups() + [group_d]


# ----------------------------------------------------------------------------- the reference


class Unpacked:
  """Every call as its own causal row; per-trajectory sequences of the sampled tokens."""

  def __init__(self, groups):
    self.trajectories = [t for g in groups for t in g]
    self.group = np.asarray([i for i, g in enumerate(groups) for _ in g], np.int32)
    calls = [(i, c) for i, t in enumerate(self.trajectories) for c in t.calls]
    n, length = len(self.trajectories), max(sum(len(c.output_ids) for c in t.calls)
                                            for t in self.trajectories)
    self.tokens = np.zeros((len(calls), ROW), np.int32)
    self.end = np.tile(np.arange(1, ROW + 1, dtype=np.int32), (len(calls), 1))  # padding j+1
    self.weights = np.zeros((len(calls), ROW), np.float32)
    self.row = np.zeros((n, length), np.int32)  # where token t of trajectory i is predicted
    self.col = np.zeros((n, length), np.int32)
    self.mask = np.zeros((n, length), np.float32)
    fill = np.zeros(n, np.int32)
    for r, (i, c) in enumerate(calls):
      seq = list(c.input_ids) + list(c.output_ids)
      self.tokens[r, :len(seq)], self.end[r, :len(seq)] = seq, len(seq)
      self.weights[r, :len(seq)] = 1.0
      k, f = len(c.output_ids), fill[i]
      self.row[i, f:f + k] = r
      self.col[i, f:f + k] = len(c.input_ids) - 1 + np.arange(k)  # position t predicts t + 1
      self.mask[i, f:f + k] = 1.0
      fill[i] += k

  def fn(self, graphdef):
    """(params, rest, ct_lp, ct_ent) -> ((Σ ct·(lp, ent), (lp, ent, max_logits, load,
    expert_ids)), grads) with lp, ent [trajectories, T] of the sampled tokens; one compiled
    program per graph and shape (the rows are its arguments)."""
    rows = (self.tokens, self.end, self.weights, self.row, self.col)
    return lambda params, rest, ct_lp, ct_ent: _unpacked_value_and_grad(
        graphdef, params, rest, ct_lp, ct_ent, rows)


@functools.partial(jax.jit, static_argnums=0)
def _unpacked_value_and_grad(graphdef, params, rest, ct_lp, ct_ent, rows):
  tokens, end, weights, row, col = rows

  def f(params):
    model = nnx.merge(graphdef, params, rest)
    positions = jnp.broadcast_to(jnp.arange(ROW, dtype=jnp.int32), tokens.shape)
    h, aux, _ = model.hidden(tokens, positions, end, token_weights=weights)
    lp, ent = token_logprobs(h[:, :-1], model.lm_head_weight(), tokens[:, 1:], chunk=64)
    lp, ent = lp[row, col], ent[row, col]
    return (ct_lp * lp + ct_ent * ent).sum(), (lp, ent, aux["max_logits"], aux.get("moe_load"),
                                               aux.get("expert_ids"))
  return jax.value_and_grad(f, has_aux=True)(params)


def numpy_counts(mask, group) -> Counts:
  live = mask.sum(-1) > 0
  return Counts(num_tokens=jnp.float32(mask.sum()), num_seqs=jnp.float32(live.sum()),
                num_groups=jnp.float32(len(set(group[live].tolist()))))


def with_fields(groups, per_trajectory: dict, scalars: dict):
  """The groups with per-token fields ([trajectories, T] split back into calls) and scalars."""
  out, i = [], 0
  for g in groups:
    new = []
    for traj in g:
      calls, f = [], 0
      for c in traj.calls:
        k = len(c.output_ids)
        fields = {name: v[i, f:f + k].tolist() for name, v in per_trajectory.items()}
        calls.append(CallTokens(c.input_ids, c.output_ids, fields))
        f += k
      new.append(TrajectoryTokens(calls, {name: float(v[i]) for name, v in scalars.items()}))
      i += 1
    out.append(new)
  return out


_SETUPS: dict = {}


def setup(request, name: str) -> dict:
  """Per model (built once): the session fixture's weights, the unpacked reference forward, the
  micro-batches with sampler/old/reference log-probs near the model's own, and an AdamW +
  QK-Clip optimizer whose τ lies below this batch's largest attention logit (QK-Clip acts)."""
  if name not in _SETUPS:
    _SETUPS[name] = _setup(name, request.getfixturevalue(f"{name}_model"))
  return _SETUPS[name]


def _setup(name: str, model) -> dict:
  cfg = CONFIGS[name]
  groups = make_groups()
  ref = Unpacked(groups)
  params, rest = S.split_model(model)
  ref_fn = ref.fn(S.graphdef(cfg))
  zeros = jnp.zeros(ref.mask.shape, jnp.float32)
  (_, (lp, ent, max_logits, load, expert_ids)), _ = ref_fn(params, rest, zeros, zeros)
  lp, ent = np.asarray(lp), np.asarray(ent)
  rng = np.random.default_rng(1)
  noise = lambda: rng.uniform(-0.3, 0.3, lp.shape).astype(np.float32) * ref.mask
  fields = {"logprobs": lp + noise(), "old_logprobs": lp + noise(), "ref_logprobs": lp + noise()}
  n = len(ref.trajectories)
  scalars = {"advantage": rng.normal(size=n).astype(np.float32),
             "reward": rng.integers(0, 2, n).astype(np.float32)}
  mb = B.make_micro_batches(with_fields(groups, fields, scalars), SHAPE)
  opt = optimizer(cfg, tau=0.9 * float(np.max(max_logits)))
  state = S.create(cfg, opt, model=model)
  return dict(cfg=cfg, ref=ref, ref_fn=ref_fn, params=params, rest=rest, lp=lp, ent=ent,
              max_logits=np.asarray(max_logits), load=None if load is None else np.asarray(load),
              expert_ids=None if expert_ids is None else np.asarray(expert_ids), groups=groups,
              fields=fields, scalars=scalars, mb=mb, opt=opt, state=state, steps={})


def optimizer(cfg, tau: float) -> O.Optimizer:
  """AdamW + QK-Clip (MuonClip compiles ~3.5x slower on CPU and is tested on its own, sharded
  too, in tests/test_optimizers.py). ε is 1e-3, not 1e-8: a first AdamW step is g/(|g| + ε),
  so with a tiny ε the fp32 reduction-order noise of near-zero gradient entries (sharded vs
  single device) flips whole learning-rate-sized updates."""
  return O.build(O.OptimizerConfig.from_config(dict(
      name="adamw_clip", learning_rate=1e-2, schedule="constant", weight_decay=0.1, eps=1e-3,
      grad_clip_norm=1.0, qk_clip={"tau": tau})), cfg)


def get_step(request, name: str, loss: str) -> T.TrainStep:
  s = setup(request, name)
  if loss not in s["steps"]:
    loss_cfg, correction = LOSSES[loss]
    s["steps"][loss] = T.make_train_step(s["cfg"], loss_cfg, s["opt"], correction_cfg=correction,
                                         entropy=loss != "sft", donate=False)
  return s["steps"][loss]


def get_score(request, name: str):
  """The model's make_score_fn, one per model (its compiled programs shared by the tests)."""
  s = setup(request, name)
  if "score" not in s:
    s["score"] = T.make_score_fn(s["cfg"])
  return s["score"]


def reference_loss(s, loss: str):
  """(loss, ∂loss/∂lp, ∂loss/∂ent, metrics) of the unpacked sequences."""
  ref, mask = s["ref"], s["ref"].mask
  if loss == "sft":  # token mean NLL, by formula
    n = mask.sum()
    return -(mask * s["lp"]).sum() / n, -mask / n, np.zeros_like(mask), {}
  loss_cfg, correction = LOSSES[loss]
  f = {k: jnp.asarray(v) for k, v in s["fields"].items()}
  adv = jnp.asarray(np.broadcast_to(s["scalars"]["advantage"][:, None], mask.shape))
  weights, mismatch = corrections.apply(correction, f["old_logprobs"], f["logprobs"],
                                        jnp.asarray(mask), adv)

  def fn(lp, ent):
    batch = SeqBatch(logprobs=lp, mask=jnp.asarray(mask), advantages=adv,
                     old_logprobs=f["old_logprobs"], sampler_logprobs=f["logprobs"],
                     ref_logprobs=f["ref_logprobs"], entropy=ent, weights=weights,
                     group=jnp.asarray(ref.group), counts=numpy_counts(mask, ref.group))
    return losses.compute(batch, loss_cfg)

  (value, metrics), (d_lp, d_ent) = jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))(
      jnp.asarray(s["lp"]), jnp.asarray(s["ent"]))
  live = mask > 0
  metrics = dict(metrics, **mismatch, entropy=s["ent"][live].mean())
  return float(value), d_lp, d_ent, metrics


def assert_trees_close(got, want, rel=1e-5, abs_=1e-7):
  """Per leaf ‖Δ‖ ≤ rel·‖want‖ + abs (design §3 gradient tolerance)."""
  got_leaves = jax.tree_util.tree_flatten_with_path(got)[0]
  want_leaves = jax.tree.leaves(want)
  assert len(got_leaves) == len(want_leaves)
  for (path, a), b in zip(got_leaves, want_leaves):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err, norm = float(np.linalg.norm(a - b)), float(np.linalg.norm(b))
    assert err <= rel * norm + abs_, (jax.tree_util.keystr(path), err, norm)


# ----------------------------------------------------------------------------- 1. contract


def test_micro_batches_layout():
  """Builder invariants (no compile): 2 real micro-batches + 1 padding one, groups whole,
  seq_id maps back to the input trajectories, token weights count logical tokens."""
  groups = make_groups()
  mb = B.make_micro_batches(groups, SHAPE)
  info = B.describe(mb)
  assert mb.tokens.shape == (3, 4, ROW) and mb.seq_valid.shape == (3, 8, 32)
  assert info["micro_batches"] == 2 and info["rows"] == 5
  assert not mb.seq_valid[2].any() and (mb.token_weights[2] == 0).all()  # padding micro-batch
  calls = [c for g in groups for t in g for c in t.calls]
  # a token shared by n calls counts n times: the weights sum to the unpacked token count
  assert info["logical_tokens"] == sum(len(c.input_ids) + len(c.output_ids) for c in calls)
  assert info["tree_tokens"] < info["logical_tokens"]
  trajectories = [t for g in groups for t in g]
  ids = mb.seq_id[mb.seq_id >= 0]
  assert sorted(ids.tolist()) == list(range(len(trajectories)))
  for m, s in zip(*np.nonzero(mb.seq_id >= 0)):
    t = trajectories[mb.seq_id[m, s]]
    sampled = [x for c in t.calls for x in c.output_ids]
    assert mb.seq_tokens[m, s, :len(sampled)].tolist() == sampled
    assert mb.seq_valid[m, s].sum() == len(sampled)
  # a group lives in one micro-batch
  group = mb.scalars["group"]
  for g in range(len(groups)):
    assert len(set(np.nonzero(group == g)[0].tolist())) == 1
  adv = np.arange(len(trajectories), dtype=np.float32) + 1
  with_adv = mb.with_scalars(advantage=adv)
  np.testing.assert_array_equal(with_adv.scalars["advantage"],
                                np.where(mb.seq_id >= 0, adv[np.maximum(mb.seq_id, 0)], 0))


def test_micro_batches_balance_sequence_shards():
  """BatchShape.shards orders each row's parts for the sequence axis: the same trajectories,
  the busiest shard's visible (query, key) pairs no higher; a shard count must divide rows."""
  groups = make_groups()
  plain = B.make_micro_batches(groups, SHAPE)
  balanced = B.make_micro_batches(groups, dataclasses.replace(SHAPE, shards=4))
  assert sorted(balanced.seq_id[balanced.seq_id >= 0]) == sorted(plain.seq_id[plain.seq_id >= 0])
  assert B.describe(balanced)["logical_tokens"] == B.describe(plain)["logical_tokens"]
  busiest = lambda mb: max(shard_pairs(e, 4).max() for e in mb.end)
  assert busiest(balanced) <= busiest(plain)
  with pytest.raises(ValueError, match="BatchShape.shards=3"):
    dataclasses.replace(SHAPE, shards=3)


# The loss enters only after the forward (through the cotangents of the per-token log-probs and
# entropies), so SFT on the dense model and GRPO on both cover the pairs: the MoE-specific parts
# (routing, expert and router gradients, load, max logits) do not depend on the loss.
@pytest.mark.parametrize("name,loss", [("dense", "sft"), ("dense", "grpo"), ("moe_mla", "grpo")])
def test_step_gradients_equal_unpacked(name, loss, request):
  """Loss, gradient and token-mean metrics of the tree-packed, micro-batched step equal the
  unpacked per-call training (design §3 tolerances). GRPO runs with a KL term, an entropy
  bonus and token-level truncated IS from the sampler log-probs."""
  s = setup(request, name)
  step = get_step(request, name, loss)
  value, grads, metrics = step.gradients(s["state"], s["mb"])
  ref_value, d_lp, d_ent, ref_metrics = reference_loss(s, loss)
  (_, _), ref_grads = s["ref_fn"](s["params"], s["rest"], d_lp, d_ent)
  assert abs(float(value) - ref_value) <= 1e-6 * abs(ref_value), (float(value), ref_value)
  assert float(metrics["num_tokens"]) == s["ref"].mask.sum()
  assert_trees_close(grads, ref_grads)
  for key, want in ref_metrics.items():  # token means over all micro-batches
    np.testing.assert_allclose(float(metrics[key]), float(want), rtol=1e-5, atol=1e-6,
                               err_msg=key)
  np.testing.assert_allclose(float(metrics["max_logit"]), s["max_logits"].max(), rtol=1e-5)


def test_reference_scored_inside_the_step_equals_scored_before(request):
  """A reference given to the step (`step(state, mb, ref=...)`) is scored in the step's own
  program: the same metrics and update as its log-probs scored first (make_score_fn, itself
  checked against teacher forcing above) and passed as mb.fields['ref_logprobs']."""
  s = setup(request, "dense")
  step = get_step(request, "dense", "grpo")
  rng = np.random.default_rng(3)
  ref = (jax.tree.map(lambda p: p + 0.02 * rng.standard_normal(p.shape).astype(p.dtype),
                      s["params"]), s["rest"])
  scored = get_score(request, "dense")(ref, s["mb"])
  without = s["mb"].replace(fields={k: v for k, v in s["mb"].fields.items()
                                    if k != "ref_logprobs"})
  before, m_before = step(s["state"], without.with_fields(ref_logprobs=scored))
  fused, m_fused = step(s["state"], without, ref=ref)
  for key in ("loss", "kl", "grad_norm"):
    np.testing.assert_allclose(float(m_fused[key]), float(m_before[key]), rtol=1e-6, err_msg=key)
  assert float(m_fused["kl"]) > 0
  assert_trees_close(fused.params, before.params)
  with pytest.raises(ValueError, match="is missing"):  # neither a field nor a reference
    step(s["state"], without)


def test_mismatch_metrics_compare_the_sampler_with_the_trained_policy(request):
  """Without a correction the mismatch metrics compare the sampler's log-probs with the
  trainer's own π_θ (NumPy k3 over the unpacked model's log-probs), whether π_old is absent
  or the sampler's own copy (an RL step without rl.recompute_old)."""
  s = setup(request, "dense")
  loss_cfg, _ = LOSSES["grpo"]
  sampler, ref_lp = s["fields"]["logprobs"], s["fields"]["ref_logprobs"]
  step = T.make_train_step(s["cfg"], loss_cfg, s["opt"], entropy=True, donate=False)
  live = s["ref"].mask > 0
  d = s["lp"][live].astype(np.float64) - sampler[live]  # log π_θ - log μ
  for fields in ({"logprobs": sampler, "ref_logprobs": ref_lp},
                 {"logprobs": sampler, "old_logprobs": sampler, "ref_logprobs": ref_lp}):
    mb = B.make_micro_batches(with_fields(s["groups"], fields, s["scalars"]), SHAPE)
    _, _, metrics = step.gradients(s["state"], mb)
    np.testing.assert_allclose(float(metrics["mismatch_kl_k3"]), np.mean(np.exp(d) - 1 - d),
                               rtol=1e-4)
    np.testing.assert_allclose(float(metrics["mismatch_max_abs_log_ratio"]), np.abs(d).max(),
                               rtol=1e-4)


# ----------------------------------------------------------------------------- 2. update


def test_step_update_equals_optimizer_by_hand(request):
  """MoE + MLA (the GQA clip is covered by tests/test_qk_clip.py): new params =
  trainer.optim applied by hand to the summed gradient with the max logits of the
  unpacked forward (QK-Clip clips at least one head); the router bias takes the aux-loss-free
  step from the unpacked load; counters advance."""
  s = setup(request, "moe_mla")
  step = get_step(request, "moe_mla", "grpo")
  state = s["state"]
  shapes = S.abstract(s["cfg"], s["opt"])  # the restore target matches the created state
  assert jax.tree.structure(shapes) == jax.tree.structure(state)
  assert all(a.shape == b.shape and a.dtype == b.dtype
             for a, b in zip(jax.tree.leaves(shapes), jax.tree.leaves(state)))
  _, grads, _ = step.gradients(state, s["mb"])
  new, metrics = step(state, s["mb"])
  opt = s["opt"]
  want_params, want_opt = jax.jit(opt.apply)(grads, state.opt_state, state.params,
                                             jnp.asarray(s["max_logits"]))
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(new.params)[0],
                          jax.tree.leaves(want_params)):
    a, b = np.asarray(a), np.asarray(b)
    assert np.abs(a - b).max() <= 1e-6 * max(1.0, np.abs(b).max()), jax.tree_util.keystr(path)
  assert_trees_close(new.opt_state, want_opt, rel=1e-6)
  # clipped once, on the sum: the recorded pre-clip norm is the summed gradient's
  norm = np.sqrt(sum(float((np.asarray(g, np.float64) ** 2).sum()) for g in jax.tree.leaves(grads)))
  np.testing.assert_allclose(float(metrics["grad_norm"]), norm, rtol=1e-6)
  assert int(metrics["qk_clipped_heads"]) == int((s["max_logits"] > opt.config.qk_clip.tau).sum())
  assert int(metrics["qk_clipped_heads"]) >= 1
  assert int(new.step) == 1 and int(new.policy_version) == 1
  changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(new.params),
                                                       jax.tree.leaves(state.params))]
  assert all(changed)
  old_bias = np.asarray(state.model_state["moe_layers"]["mlp"]["router_bias"])
  new_bias = np.asarray(new.model_state["moe_layers"]["mlp"]["router_bias"])
  load = s["load"]  # [moe_layers, experts] of the unpacked rows (every call its own row)
  gap = load.mean(-1, keepdims=True) - load
  clear = np.abs(gap) > 1e-6  # the sign is fragile only where a load equals the mean
  assert clear.sum() >= load.size // 2
  np.testing.assert_allclose((new_bias - old_bias)[clear],
                             TINY_MOE_MLA.bias_update_rate * np.sign(gap)[clear], rtol=1e-4)


# ----------------------------------------------------------------------------- 3. score


@pytest.mark.parametrize("name", ["dense", "moe_mla"])
def test_score_equals_teacher_forced_logprobs(name, request):
  s = setup(request, name)
  score = get_score(request, name)
  lp = np.asarray(score(s["state"], s["mb"]))
  mb = s["mb"]
  assert lp.shape == mb.seq_valid.shape
  assert (lp[~mb.seq_valid] == 0).all()
  for m, i in zip(*np.nonzero(mb.seq_id >= 0)):
    t = mb.seq_id[m, i]
    n = int(s["ref"].mask[t].sum())
    np.testing.assert_allclose(lp[m, i, :n], s["lp"][t, :n], atol=1e-5, rtol=0)
  # MCLA over passes of the same deterministic forward is that forward (no recompile)
  np.testing.assert_allclose(T.mcla_logprobs(score, s["state"], mb, passes=2), lp, atol=1e-6)


def node_expert_ids(groups, ref: Unpacked, expert_ids: np.ndarray) -> list[np.ndarray]:
  """Per group, [nodes, moe_layers, k]: the experts the unpacked rows chose at each trie node
  (each call's tokens walked down its group's tree)."""
  from rl.tree import build_tree
  out, row = [], 0
  for g in groups:
    tree = build_tree(g)
    child = {(int(p), int(t)): v for v, (p, t) in enumerate(zip(tree.pred, tree.tokens))}
    ids = np.zeros((len(tree), expert_ids.shape[0], expert_ids.shape[-1]), np.int32)
    for traj in g:
      for c in traj.calls:
        node = -1
        for p, tok in enumerate(list(c.input_ids) + list(c.output_ids)):
          node = child[(node, tok)]
          ids[node] = expert_ids[:, row, p]
        row += 1
    out.append(ids)
  return out


def test_routing_replay(request):
  """Replaying the experts the unpacked forward chose (laid out per tree node by the builder)
  reproduces the routed log-probs; replaying other experts changes them."""
  s = setup(request, "moe_mla")
  score = get_score(request, "moe_mla")
  ids = node_expert_ids(s["groups"], s["ref"], s["expert_ids"])
  fields = {k: v for k, v in s["mb"].fields.items()}
  replay = B.make_micro_batches(s["groups"], SHAPE, expert_ids=ids).with_fields(**fields)
  np.testing.assert_array_equal(replay.tokens, s["mb"].tokens)
  lp = np.asarray(score(s["state"], replay))
  np.testing.assert_allclose(lp, np.asarray(score(s["state"], s["mb"])), atol=1e-5)
  other = replay.replace(expert_ids=(replay.expert_ids + 1) % TINY_MOE_MLA.num_experts)
  assert np.abs(np.asarray(score(s["state"], other)) - lp).max() > 1e-3


# ----------------------------------------------------------------------------- 4. sharded


def save_tree(path, tree):
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  np.savez(path, **{jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves})


def test_sharded_step_equals_single_device(request):
  """A subprocess with 8 simulated devices runs the dense GRPO step on a data=2 x fsdp=2 x
  tensor=2 mesh; its gradient, loss and updated state equal this process's single-device
  step."""
  s = setup(request, "dense")
  step = get_step(request, "dense", "grpo")
  loss, grads, metrics = step.gradients(s["state"], s["mb"])
  new, _ = step(s["state"], s["mb"])
  with tempfile.TemporaryDirectory() as tmp:
    save_tree(f"{tmp}/mb.npz", s["mb"])
    np.savez(f"{tmp}/config.npz", tau=s["opt"].config.qk_clip.tau)
    stdout = run_check("step_sharding_check", tmp)
    assert "ok sharded" in stdout, stdout
    out = {k: np.load(f"{tmp}/{k}.npz") for k in ("grads", "params", "metrics")}
  np.testing.assert_allclose(out["metrics"]["loss"], float(loss), rtol=1e-5)
  for which, tree in (("grads", grads), ("params", new.params)):
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
      a, b = out[which][jax.tree_util.keystr(path)], np.asarray(x)
      err = np.abs(a - b).max() / max(1.0 if which == "params" else 0.0, np.abs(b).max())
      assert err <= 1e-5, (which, jax.tree_util.keystr(path), err)


# ----------------------------------------------------------------------------- 5. errors


def test_bad_inputs_name_the_field():
  cfg = TINY_DENSE
  groups = make_groups()
  opt = O.build(O.OptimizerConfig.from_config(dict(name="adamw", schedule="constant")), cfg)
  mb = B.make_micro_batches(groups, SHAPE)  # no sampler/ref log-probs, no advantages
  state = None  # checks run before the state is touched

  def fails(loss_cfg, batch, match, correction=None):
    step = T.make_train_step(cfg, loss_cfg, opt, correction_cfg=correction, donate=False)
    with pytest.raises(ValueError, match=match):
      step(state, batch)

  fails(losses.LossConfig(name="cispo"), mb, r"\['advantage'\] is missing.*'cispo'")
  with_adv = mb.with_scalars(advantage=np.ones(int(mb.seq_id.max()) + 1))
  fails(losses.LossConfig(name="grpo", kl_coef=0.1), with_adv,
        r"fields\['ref_logprobs'\] is missing: LossConfig.kl_coef=0.1")
  fails(losses.LossConfig(name="grpo"), with_adv, r"fields\['logprobs'\] is missing.*tis_token",
        corrections.CorrectionConfig(kind="tis_token"))
  fails(losses.LossConfig(name="sft", mask_failed_turns=True), mb, r"fields\['failed'\]")
  fails(losses.LossConfig(name="opd"), mb, r"fields\['teacher_logprobs'\]")
  fails(losses.LossConfig(name="sft"), mb.replace(seq_pred=mb.seq_pred[:, :4]),
        r"micro_batches.seq_pred: shape \(3, 4, 32\)")
  fails(losses.LossConfig(name="sft"), mb.replace(end=mb.end[:2]), r"micro_batches.end")
  fails(losses.LossConfig(name="sft"), mb.replace(expert_ids=np.zeros((3, 1, 4, ROW, 2))),
        "expert_ids: routing replay given for a dense model")
  with pytest.raises(ValueError, match=r"field 'ref_logprobs' has shape \(3, 8\)"):
    mb.with_fields(ref_logprobs=np.zeros((3, 8)))
  with pytest.raises(ValueError, match="LossConfig.name='nope'"):
    T.make_train_step(cfg, losses.LossConfig(name="nope"), opt)
  # shapes too small for the data name the BatchShape field
  with pytest.raises(ValueError, match=r"BatchShape.seq_len=8: .* needs 30"):
    B.make_micro_batches(groups, B.BatchShape(row_len=ROW, rows=4, seq_len=8))
  with pytest.raises(ValueError, match=r"BatchShape.micro_batches=1: .* needs 2"):
    B.make_micro_batches(groups, B.BatchShape(row_len=ROW, rows=4, micro_batches=1))
  with pytest.raises(ValueError, match=r"BatchShape.seqs=2"):
    B.make_micro_batches(groups, B.BatchShape(row_len=ROW, rows=4, seqs=2))
  with pytest.raises(ValueError, match=r"BatchShape\(row_len=128, rows=1\): group \d needs 2 rows"):
    B.make_micro_batches(groups, B.BatchShape(row_len=ROW, rows=1))
  with pytest.raises(ValueError, match="BatchShape.row_len=100"):
    B.BatchShape(row_len=100)


# ----------------------------------------------------------------------------- 5. tree rollouts


def branched_groups():
  """Envs records of two groups as tree rollouts leave them: leaves repeat their ancestors' calls
  verbatim; one branch re-samples call 1 and shares its first tokens (branch point inside a
  response), one shares call 1 and saw a different tool result after it (branch point inside a
  tool result), one is an independent global sample; the second group is two plain episodes."""
  from envs.trajectory import LLMCall, Trajectory
  rng = np.random.default_rng(11)
  t = lambda n: rng.integers(1, 128, n).tolist()
  p, a0, obs0, a1, obs1, a2 = t(20), t(8), t(6), t(8), t(6), t(8)

  def traj(calls, reward, gid, tree):
    return Trajectory([LLMCall(i, o, [0.0] * len(o)) for i, o in calls], reward, "task", gid,
                      "submitted", metadata={"tree": tree})
  c0, c1 = (p, a0), (p + a0 + obs0, a1)
  group = [traj([c0, c1, (c1[0] + a1 + obs1, a2)], 1.0, "g/0", 0),
           traj([c0, (c1[0], a1[:3] + t(5)), (c1[0] + a1[:3] + t(11), t(8))], 0.0, "g/0", 1),
           traj([c0, c1, (c1[0] + a1 + obs1[:2] + t(4), t(8))], 1.0, "g/0", 2),
           traj([(p, t(8)), (p + t(14), t(8))], 0.0, "g/0", 3)]
  q = t(24)
  plain = [traj([(q, t(10))], r, "h/0", i) for i, r in enumerate((0.0, 1.0))]
  return [group, plain]


def test_branched_groups_train_like_their_trajectories(request):
  """A branched group through the trainer's path (per-call TreeRL advantages, the AEPO loss
  with its entropy-aware advantage, routing and tree packing by trainer.groups) has the loss and
  gradient of its trajectories trained one call at a time (design §3 tolerances)."""
  from rl import advantages as A
  from rl.tree import call_segments, from_trajectory
  from trainer import groups as G
  model = request.getfixturevalue("dense_model")
  cfg = CONFIGS["dense"]
  groups = branched_groups()
  tokens = [[from_trajectory(x, logprobs=False) for x in g] for g in groups]
  ref = Unpacked(tokens)
  params, rest = S.split_model(model)
  ref_fn = ref.fn(S.graphdef(cfg))
  zeros = jnp.zeros(ref.mask.shape, jnp.float32)
  (_, (lp, ent, *_)), _ = ref_fn(params, rest, zeros, zeros)
  lp, ent = np.asarray(lp), np.asarray(ent)
  sampler = lp + np.random.default_rng(2).uniform(-0.4, 0.4, lp.shape).astype(np.float32)
  i = 0
  for g in groups:  # the records carry the sampler's log-probs
    for x in g:
      f = 0
      for c in x.calls:
        c.output_logprobs = sampler[i, f:f + len(c.output_ids)].tolist()
        f += len(c.output_ids)
      i += 1
  group_adv = G.advantages_of(groups, "treerl")
  assert group_adv[0].shape == (4, 3) and len(set(np.round(group_adv[0].ravel(), 6))) > 3
  (_, mb), = G.micro_batches(groups, group_adv, B.BatchShape(row_len=ROW, rows=2, seqs=None,
                                                             seq_len=None, micro_batches=None), 1)
  loss_cfg = losses.LossConfig(name="aepo", entropy_adv_coef=0.5)
  opt = optimizer(cfg, tau=1e9)
  step = T.make_train_step(cfg, loss_cfg, opt, donate=False)
  state = S.create(cfg, opt, model=model)
  value, grads, metrics = step.gradients(state, mb)

  # the reference: per-token advantages of each trajectory's calls, the same loss unpacked
  adv = np.zeros_like(lp)
  i = 0
  for g, gt in zip(groups, tokens):
    seg, parent = call_segments(gt)
    per_call = np.asarray(A.tree_advantages(np.array([x.reward for x in g], np.float32), seg,
                                            parent))
    for s, x in enumerate(gt):
      f = 0
      for k, c in enumerate(x.calls):
        adv[i, f:f + len(c.output_ids)] = per_call[s, k]
        f += len(c.output_ids)
      i += 1
  mask = ref.mask

  def fn(lp_, ent_):
    batch = SeqBatch(logprobs=lp_, mask=jnp.asarray(mask), advantages=jnp.asarray(adv),
                     old_logprobs=jnp.asarray(sampler), sampler_logprobs=jnp.asarray(sampler),
                     entropy=ent_, group=jnp.asarray(ref.group),
                     counts=numpy_counts(mask, ref.group))
    return losses.compute(batch, loss_cfg)
  (ref_value, ref_metrics), (d_lp, d_ent) = jax.jit(jax.value_and_grad(
      fn, argnums=(0, 1), has_aux=True))(jnp.asarray(lp), jnp.asarray(ent))
  (_, _), ref_grads = ref_fn(params, rest, d_lp, d_ent)
  # the loss sums per-token terms of both signs (advantages centre on zero), so its fp32
  # rounding is relative to the terms (~1), not to their small sum: an absolute 1e-6 too
  np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-6, atol=1e-6)
  assert float(ref_metrics["preserved_fraction"]) > 0  # the gradient-kept branch is exercised
  assert_trees_close(grads, ref_grads)
