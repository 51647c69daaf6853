"""Training on tree-packed batches equals training every LLM call unpacked (design §3 contract).

The trajectories cover: G responses sharing a prompt, a multi-call trajectory whose later call
repeats its earlier sampled tokens as context, a branch point inside another trajectory's
sampled span, a call that is a prefix of another, a context-compaction branch, and a group too
large for one row (partitioned with carried ancestors).
"""

import dataclasses
import functools

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


def unpacked_rows(calls):
  """Every call as its own causal row (tokens [calls, ROW]) and the mask of its sampled tokens
  as predicted (position t predicts token t + 1)."""
  tokens = np.zeros((len(calls), ROW), np.int32)
  mask = np.zeros((len(calls), ROW - 1), np.float32)
  for r, call in enumerate(calls):
    seq = list(call.input_ids) + list(call.output_ids)
    tokens[r, :len(seq)] = seq
    mask[r, len(call.input_ids) - 1:len(seq) - 1] = 1  # position t predicts token t + 1
  return tokens, mask


def unpacked_loss(model, tokens, mask, n_tokens):
  """The rows of `unpacked_rows`, causal; only the sampled tokens in the loss (token-mean)."""
  positions = jnp.broadcast_to(jnp.arange(ROW), tokens.shape)
  end = jnp.full(tokens.shape, ROW, jnp.int32)
  h, _, _ = model.hidden(tokens, positions, end)
  lp, _ = token_logprobs(h[:, :-1], model.lm_head_weight(), tokens[:, 1:], chunk=64)
  return -(lp * mask).sum() / n_tokens


@functools.partial(jax.jit, static_argnums=0)
def unpacked_value_and_grad(graphdef, params, rest, tokens, mask, n_tokens):
  return jax.value_and_grad(
      lambda p: unpacked_loss(nnx.merge(graphdef, p, rest), tokens, mask, n_tokens))(params)


def tree_loss(model, batch, n_tokens):
  h, _, _ = model.hidden(*(jnp.asarray(getattr(batch, f)) for f in ("tokens", "positions", "end")))
  lp, _ = sequence_logprobs(h, model.lm_head_weight(), jnp.asarray(batch.seq_pred),
                            jnp.asarray(batch.seq_tokens), chunk=64)
  weight = jnp.asarray(batch.seq_valid * batch.fields["loss_mask"])
  return -(lp * weight).sum() / n_tokens


@functools.partial(jax.jit, static_argnums=0)
def tree_value_and_grad(graphdef, params, rest, batch, n_tokens):
  """(tree loss, its gradient) of one packed batch; one compile per graph and batch shape."""
  return jax.value_and_grad(lambda p: tree_loss(nnx.merge(graphdef, p, rest), batch, n_tokens))(
      params)


@dataclasses.dataclass
class Batch:
  """The TreeBatch arrays `tree_loss` reads, as a pytree (a jit argument)."""
  tokens: np.ndarray
  positions: np.ndarray
  end: np.ndarray
  seq_pred: np.ndarray
  seq_tokens: np.ndarray
  seq_valid: np.ndarray
  fields: dict


jax.tree_util.register_dataclass(Batch, data_fields=[f.name for f in dataclasses.fields(Batch)],
                                 meta_fields=[])


def batch_arrays(batch):
  return Batch(tokens=batch.tokens, positions=batch.positions, end=batch.end,
               seq_pred=batch.seq_pred, seq_tokens=batch.seq_tokens, seq_valid=batch.seq_valid,
               fields={"loss_mask": batch.fields["loss_mask"]})


_PACKED: dict = {}


def packed(which, request):
  """Per model (once): the groups packed into tree batches, their token count, and the summed
  tree loss and gradient under the XLA attention (also the kernels' reference below)."""
  if which not in _PACKED:
    model = request.getfixturevalue(f"{which}_model")
    gs = groups()
    calls = [call for group in gs for traj in group for call in traj.calls]
    n_tokens = np.float32(sum(len(call.output_ids) for call in calls))
    trees = [build_tree(group) for group in gs]
    batches = [batch_arrays(b) for b in pack(trees, row_len=ROW)]
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss, grad = 0.0, jax.tree.map(jnp.zeros_like, params)
    for batch in batches:  # micro-batches: losses are sums normalised by global counts
      l, g = tree_value_and_grad(graphdef, params, rest, batch, n_tokens)
      loss, grad = loss + l, jax.tree.map(jnp.add, grad, g)
    _PACKED[which] = dict(gs=gs, calls=calls, n_tokens=n_tokens, trees=trees, batches=batches,
                          params=params, rest=rest, graphdef=graphdef, loss=loss, grad=grad)
  return _PACKED[which]


@pytest.mark.parametrize("which", ["dense", "moe_mla"])
def test_tree_gradients_equal_unpacked(which, request):
  s = packed(which, request)
  calls, trees = s["calls"], s["trees"]
  assert sum(len(t) for t in trees) < sum(len(c.input_ids) + len(c.output_ids) for c in calls)
  assert sum(b.tokens.shape[0] for b in s["batches"]) >= 2  # the big group is partitioned

  ref_loss, ref_grad = unpacked_value_and_grad(s["graphdef"], s["params"], s["rest"],
                                               *unpacked_rows(calls), s["n_tokens"])
  loss, grad = s["loss"], s["grad"]
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  flat = jax.tree_util.tree_flatten_with_path(grad)[0]
  assert len(flat) == len(jax.tree.leaves(ref_grad))
  for (path, a), b in zip(flat, jax.tree.leaves(ref_grad)):
    err, norm = float(jnp.linalg.norm(a - b)), float(jnp.linalg.norm(b))
    assert err <= 1e-5 * norm + 1e-7, (jax.tree_util.keystr(path), err, norm)


@pytest.mark.parametrize("impl", ["xla_flash", "pallas_tpu", "pallas_gpu"])
def test_transformer_with_kernel_matches_xla(impl, request):
  """`attention_impl` routes the Transformer through a kernel (Pallas ones in interpret mode):
  the tree loss and its gradients equal the XLA reference on the packed tree batches (every
  group, the partitioned one with its carried ancestors included)."""
  from models import transformer
  from tests.conftest import TINY_MOE_MLA
  s = packed("moe_mla", request)
  kernel_graphdef = nnx.graphdef(transformer.abstract(TINY_MOE_MLA.replace(attention_impl=impl)))
  loss, grad = 0.0, jax.tree.map(jnp.zeros_like, s["params"])
  for batch in s["batches"]:
    l, g = tree_value_and_grad(kernel_graphdef, s["params"], s["rest"], batch, s["n_tokens"])
    loss, grad = loss + l, jax.tree.map(jnp.add, grad, g)
  np.testing.assert_allclose(loss, s["loss"], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(s["grad"])):
    err, norm = float(jnp.linalg.norm(a - b)), float(jnp.linalg.norm(b))
    assert err <= 1e-4 * norm + 1e-7, (err, norm)
