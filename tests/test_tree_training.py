"""Training on tree-packed batches equals training every LLM call unpacked (design §3 contract).

The trajectories cover: G responses sharing a prompt, a multi-call trajectory whose later call
repeats its earlier sampled tokens as context, a branch point inside another trajectory's
sampled span, a call that is a prefix of another, a context-compaction branch, and a group too
large for one row (partitioned with carried ancestors).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.logprobs import sequence_logprobs, token_logprobs
from rl.packing import pack
from rl.tree import CallTokens, TrajectoryTokens, build_tree

ROW = 128


def toks(rng, n):
  return rng.integers(1, 128, n).tolist()


def groups():
  rng = np.random.default_rng(0)
  p, a0, obs, a1 = toks(rng, 20), toks(rng, 8), toks(rng, 6), toks(rng, 8)
  summary, c = toks(rng, 5), toks(rng, 6)
  group_a = [
      # two calls: the second repeats the first call's sampled tokens as context
      TrajectoryTokens([CallTokens(p, a0), CallTokens(p + a0 + obs, a1)]),
      # branches inside t0's sampled span (shares a0[:3], then differs)
      TrajectoryTokens([CallTokens(p, a0[:3] + toks(rng, 5))]),
      # samples what others have as prompt: its full sequence is a prefix of t0's first call
      TrajectoryTokens([CallTokens(p[:12], p[12:])]),
      # continues t0's context, then compacts: a later call restarts from a summary
      TrajectoryTokens([CallTokens(p + a0, toks(rng, 6)), CallTokens(p + summary, c)]),
  ]
  q = toks(rng, 30)
  group_b = [TrajectoryTokens([CallTokens(q, toks(rng, 10))]) for _ in range(2)]
  big = toks(rng, 40)  # 40 + 4 x 30 nodes > ROW: partitioned across rows
  group_c = [TrajectoryTokens([CallTokens(big, toks(rng, 30))]) for _ in range(4)]
  return [group_a, group_b, group_c]


def unpacked_loss(model, calls, n_tokens):
  """Every call as its own causal row; only its sampled tokens in the loss (token-mean)."""
  tokens = np.zeros((len(calls), ROW), np.int32)
  mask = np.zeros((len(calls), ROW - 1), np.float32)
  for r, call in enumerate(calls):
    seq = list(call.input_ids) + list(call.output_ids)
    tokens[r, :len(seq)] = seq
    mask[r, len(call.input_ids) - 1:len(seq) - 1] = 1  # position t predicts token t + 1
  tokens = jnp.asarray(tokens)
  positions = jnp.broadcast_to(jnp.arange(ROW), tokens.shape)
  end = jnp.full(tokens.shape, ROW, jnp.int32)
  h, _, _ = model.hidden(tokens, positions, end)
  lp, _ = token_logprobs(h[:, :-1], model.lm_head_weight(), tokens[:, 1:], chunk=64)
  return -(lp * mask).sum() / n_tokens


def tree_loss(model, batch, n_tokens):
  h, _, _ = model.hidden(*(jnp.asarray(getattr(batch, f)) for f in ("tokens", "positions", "end")))
  lp, _ = sequence_logprobs(h, model.lm_head_weight(), jnp.asarray(batch.seq_pred),
                            jnp.asarray(batch.seq_tokens), chunk=64)
  weight = jnp.asarray(batch.seq_valid * batch.fields["loss_mask"])
  return -(lp * weight).sum() / n_tokens


@pytest.mark.parametrize("which", ["dense", "moe_mla"])
def test_tree_gradients_equal_unpacked(which, request):
  model = request.getfixturevalue(f"{which}_model")
  gs = groups()
  calls = [call for group in gs for traj in group for call in traj.calls]
  n_tokens = sum(len(call.output_ids) for call in calls)
  trees = [build_tree(group) for group in gs]
  batches = pack(trees, row_len=ROW)
  assert sum(len(t) for t in trees) < sum(len(c.input_ids) + len(c.output_ids) for c in calls)
  assert sum(b.tokens.shape[0] for b in batches) >= 2  # the big group is partitioned

  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def value_and_grad(loss_fn):
    return jax.jit(jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest))))(params)

  ref_loss, ref_grad = value_and_grad(lambda m: unpacked_loss(m, calls, n_tokens))
  loss, grad = 0.0, jax.tree.map(jnp.zeros_like, params)
  for batch in batches:  # micro-batches: losses are sums normalised by global counts
    l, g = value_and_grad(lambda m: tree_loss(m, batch, n_tokens))
    loss, grad = loss + l, jax.tree.map(jnp.add, grad, g)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  flat = jax.tree_util.tree_flatten_with_path(grad)[0]
  assert len(flat) == len(jax.tree.leaves(ref_grad))
  for (path, a), b in zip(flat, jax.tree.leaves(ref_grad)):
    err, norm = float(jnp.linalg.norm(a - b)), float(jnp.linalg.norm(b))
    assert err <= 1e-5 * norm + 1e-7, (jax.tree_util.keystr(path), err, norm)


@pytest.mark.parametrize("impl", ["xla_flash", "pallas_tpu", "pallas_gpu"])
def test_transformer_with_kernel_matches_xla(impl, moe_mla_model):
  """`attention_impl` routes the Transformer through a kernel (Pallas ones in interpret mode):
  logits and the tree loss's gradients equal the XLA reference on a packed tree batch."""
  from models import transformer
  from tests.conftest import TINY_MOE_MLA
  batch = pack([build_tree(groups()[0])], row_len=ROW)[0]
  n_tokens = int(batch.seq_valid.sum())
  graphdef, params, rest = nnx.split(moe_mla_model, nnx.Param, ...)
  kernel_graphdef = nnx.graphdef(transformer.abstract(TINY_MOE_MLA.replace(attention_impl=impl)))

  def run(gd):
    f = lambda p: tree_loss(nnx.merge(gd, p, rest), batch, n_tokens)
    return jax.jit(jax.value_and_grad(f))(params)

  (loss, grad), (ref_loss, ref_grad) = run(kernel_graphdef), run(graphdef)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(ref_grad)):
    err, norm = float(jnp.linalg.norm(a - b)), float(jnp.linalg.norm(b))
    assert err <= 1e-4 * norm + 1e-7, (err, norm)
