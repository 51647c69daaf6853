"""Gradients under `jax.vmap`: a batched backward pass equals the per-output gradients.

Per-example gradients, influence functions and gradient-noise estimates take several gradients
in one call by vmapping a VJP over cotangents (`jax.jacrev` does exactly that). These tests take
the gradients of several RL losses at once, through every loss (on the tree-packed and on the
unpacked batch) and through the model's forward paths (xla, xla_flash, and the Pallas TPU and
GPU kernels in interpret mode, each with its custom VJP; the chunked, rematerialised log-prob
scan; dense GQA and MoE + MLA), and compare them with one `jax.grad` / VJP per output, and
`jax.grad` with a central finite difference along one random direction.

What broke: `jax.lax.ragged_dot`, the MoE experts' grouped matmul, has no batching rule unless
every operand, the group sizes included, is batched on axis 0. A vmapped MoE backward batches
only the cotangent, so `jax.jacrev` or `vmap(vjp)` through a MoE model raised
NotImplementedError ("ragged_dot vmap over any dim but 0 - NYI"), as did a vmap of the forward
over examples. `models.grouped_matmul` gives the product a custom VJP whose forward and
backward products loop over a vmapped batch (`custom_vmap` + `lax.map`), so a batched
gradient is the per-example computation itself.

Everything else already batched correctly: the dense disagreement once seen between `jacrev`
and `grad` for the clipped losses (grpo, gspo) does not reproduce with any path here (vmapped
and per-output gradients agree to float32 rounding, ~1e-6 relative per leaf; `grad` agrees
with finite differences). A reason to keep these tests: a batching rule that mixes the batch
members, or a custom VJP whose residuals are not batched, shows up only here.

Finite differences check the gradient of the loss *value*, so they use an off-policy GRPO batch
with ratios inside the clip range: for on-policy ratios (exp(lp - sg(lp))) and for CISPO's
stop-gradient weight the training gradient is by design not the derivative of the value.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import transformer
from models.logprobs import sequence_logprobs
from rl import batch as rb
from rl import losses
from tests.conftest import TINY_DENSE, TINY_MOE_MLA
from tests.test_loss_contracts import _ids, loss_configs, tree_case  # noqa: F401 (fixture)

CFGS = loss_configs()
PATHS = [("dense", "xla"), ("dense", "xla_flash"), ("dense", "pallas_tpu"),
         ("dense", "pallas_gpu"), ("moe_mla", "pallas_tpu")]  # moe_mla-xla: the jacrev test


def _close_leaves(got, want, rtol: float) -> None:
  """Every leaf of `got` within rtol (relative to the leaf's norm) of `want`'s."""
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30)
    assert err <= rtol, f"{jax.tree_util.keystr(path)}: relative error {err:.2e}"


def _batched_vs_single(f, x, cotangents: jax.Array, rtol: float) -> None:
  """vmap of f's VJP over `cotangents` [n, *out] equals one VJP per cotangent.

  The forward and its residuals are traced inside each jit (no eager forward, no residuals
  baked in as constants); the batched VJP vmaps the pullback alone, over the cotangents.
  """
  batched = jax.jit(lambda x, cts: jax.vmap(jax.vjp(f, x)[1])(cts))(x, cotangents)
  single = jax.jit(lambda x, ct: jax.vjp(f, x)[1](ct))
  for i in range(cotangents.shape[0]):
    _close_leaves(jax.tree.map(lambda a: a[i], batched), single(x, cotangents[i]), rtol)


# ----------------------------------------------------------------------------- losses


def test_every_loss_jacrev_equals_grad(tree_case):
  """All losses stacked: each row of the Jacobian (vmapped backward) is that loss's gradient,
  with respect to the flat per-position log-probs (tree) and the per-sequence ones (unpacked)."""
  tb, flat, entropy, _, unpacked, _ = tree_case

  def tree_losses(flat):
    b = rb.from_tree_batch(tb, rb.gather(flat, jnp.asarray(tb.seq_index)), entropy)
    return jnp.stack([losses.compute(b, c)[0] for c in CFGS])

  def unpacked_losses(lp):
    return jnp.stack([losses.compute(unpacked.replace(logprobs=lp), c)[0] for c in CFGS])

  for f, x in ((tree_losses, flat), (unpacked_losses, unpacked.logprobs)):
    jac = jax.jit(jax.jacrev(f))(x)
    _, pull = jax.vjp(f, x)
    pull = jax.jit(pull)
    eye = jnp.eye(len(CFGS), dtype=jnp.float32)
    for i, cfg in enumerate(CFGS):
      (g,) = pull(eye[i])
      assert float(jnp.abs(g).max()) > 0, _ids(cfg)
      np.testing.assert_allclose(jac[i], g, rtol=1e-6, atol=1e-7 * float(jnp.abs(g).max()),
                                 err_msg=_ids(cfg))


# ----------------------------------------------------------------------------- model


@functools.cache
def _model(family: str, impl: str):
  cfg = {"dense": TINY_DENSE, "moe_mla": TINY_MOE_MLA}[family].replace(attention_impl=impl)
  return nnx.split(transformer.init(cfg, seed=0), nnx.Param, ...)


def _logprobs_fn(tb, family: str, impl: str):
  """params -> [num_seqs, seq_len] log-probs of the batch's sampled tokens."""
  graphdef, params, rest = _model(family, impl)
  arrays = [jnp.asarray(getattr(tb, f)) for f in ("tokens", "positions", "end", "seq_pred",
                                                   "seq_tokens")]

  def logprobs(p):
    m = nnx.merge(graphdef, p, rest)
    tokens, positions, end, seq_pred, seq_tokens = arrays
    h, _, _ = m.hidden(tokens, positions, end)
    return sequence_logprobs(h, m.lm_head_weight(), seq_pred, seq_tokens, chunk=32)[0]

  return logprobs, params


def _loss_of_logprobs(tb, cfg):
  return lambda lp: losses.compute(rb.from_tree_batch(tb, lp), cfg)[0]


@pytest.mark.parametrize("family,impl", PATHS, ids=[f"{f}-{i}" for f, i in PATHS])
def test_model_vmapped_vjp_equals_per_output_vjp(tree_case, family, impl):
  """vmap of the model's VJP over the log-prob gradients of grpo, gspo and cispo (and a random
  cotangent) equals one VJP each."""
  tb = tree_case[0]
  logprobs, params = _logprobs_fn(tb, family, impl)
  lp = jax.jit(logprobs)(params)
  cts = [jax.jit(jax.grad(_loss_of_logprobs(tb, losses.LossConfig(name=n))))(lp)
         for n in ("grpo", "gspo", "cispo")]
  rand = jax.random.normal(jax.random.key(1), lp.shape) * jnp.asarray(tb.seq_valid)
  _batched_vs_single(logprobs, params, jnp.stack(cts + [rand]), rtol=2e-5)


@pytest.mark.parametrize("family", ["dense", "moe_mla"])
def test_jacrev_through_model_equals_grad_and_finite_difference(tree_case, family):
  """f(p, k) = loss_k(model(p)) for k = cispo, grpo: row 1 of jax.jacrev of [f(p, 0), f(p, 1)]
  equals jax.grad of f(p, 1) alone, which matches a central difference along one direction."""
  tb = tree_case[0]
  logprobs, params = _logprobs_fn(tb, family, "xla")
  forward = jax.jit(logprobs)  # compiled once: the old log-probs and the finite difference's
  lp0 = np.asarray(forward(params))
  # off-policy with ratios in [0.95, 1.05]: inside the clip range, the loss is smooth there
  noise = np.random.default_rng(3).uniform(-0.05, 0.05, lp0.shape)
  tb = tb.__class__(**{**tb.__dict__, "fields": {**tb.fields, "old_logprobs": np.where(
      tb.seq_valid, lp0 + noise, 0.0).astype(np.float32)}})
  cfgs = [losses.LossConfig(name="cispo"), losses.LossConfig(name="grpo")]
  f = lambda p, k: _loss_of_logprobs(tb, cfgs[k])(logprobs(p))
  jac = jax.jit(jax.jacrev(lambda p: jnp.stack([f(p, 0), f(p, 1)])))(params)
  grad = jax.jit(jax.grad(lambda p: f(p, 1)))(params)
  _close_leaves(jax.tree.map(lambda a: a[1], jac), grad, rtol=2e-5)

  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(0), len(leaves))
  v = jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])
  norm = jnp.sqrt(sum(jnp.vdot(x, x) for x in jax.tree.leaves(v)))
  v = jax.tree.map(lambda x: x / norm, v)
  eps = 1e-3
  loss = jax.jit(_loss_of_logprobs(tb, cfgs[1]))
  value = lambda p: loss(forward(p))  # f(p, 1)
  step = lambda s: jax.tree.map(lambda a, d: a + s * eps * d, params, v)
  fd = (float(value(step(1.0))) - float(value(step(-1.0)))) / (2 * eps)
  directional = float(sum(jnp.vdot(g, d) for g, d in zip(jax.tree.leaves(grad),
                                                          jax.tree.leaves(v))))
  assert abs(directional) > 1e-3
  np.testing.assert_allclose(fd, directional, rtol=1e-2)
