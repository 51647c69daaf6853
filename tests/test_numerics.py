"""bf16 numerics: the engine's decode path and the trainer's full pass compute the same function
(docs/numerics.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from envs.policy import SamplingParams
from models import transformer
from models.engine import Engine, EngineConfig
from models.layers import Dense, RMSNorm, round_to
from tests.conftest import TINY_DENSE, TINY_MOE_MLA

BF16 = jnp.bfloat16


def _normal(shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def test_round_to_is_kept_inside_a_fusion():
  # A bf16 sum fused into an fp32 consumer: XLA keeps the sum in fp32 unless told to round
  # (with a plain astype about half the outputs differ from the materialised bf16 sum's).
  a, b = _normal((64, 256), 0).astype(BF16), _normal((64, 256), 1).astype(BF16)
  fused = jax.jit(lambda a, b: round_to(a + b, BF16).astype(jnp.float32) * 3)(a, b)
  summed = jax.jit(lambda a, b: round_to(a + b, BF16))(a, b)
  apart = jax.jit(lambda y: y.astype(jnp.float32) * 3)(summed)
  np.testing.assert_array_equal(np.asarray(fused), np.asarray(apart))


def test_round_to_adds_nothing_in_fp32():
  x = _normal((4, 8))
  jaxpr = jax.make_jaxpr(lambda x: round_to(x, jnp.float32))(x)
  assert "reduce_precision" not in str(jaxpr)
  np.testing.assert_array_equal(np.asarray(round_to(x, jnp.float32)), np.asarray(x))


def test_dense_row_is_independent_of_the_rows_beside_it():
  # One decode token and the same token in a full row give the same bf16 projection.
  dense = Dense((256,), (1024,), ("embed",), ("mlp",), TINY_DENSE.replace(dtype="bfloat16"),
                bias=True)
  dense.kernel[...] = 0.1 * _normal((256, 1024), 2)
  dense.bias[...] = _normal((1024,), 3)
  x = _normal((1024, 256), 4).astype(BF16)
  call = nnx.jit(lambda d, x: d(x))
  full = np.asarray(call(dense, x), np.float32)
  rows = np.concatenate([np.asarray(call(dense, x[i:i + 8]), np.float32)
                         for i in range(0, 1024, 8)])
  np.testing.assert_array_equal(rows, full)


def test_rmsnorm_rounds_where_hugging_face_does():
  # The normalised x and the scaled output are the two bf16 cast points; both must be roundings
  # XLA keeps (with plain casts the bf16 mismatch grows ~1000x, docs/numerics.md).
  norm = RMSNorm(64, 1e-6)
  norm.scale[...] = jnp.asarray(np.random.default_rng(5).uniform(0.5, 1.5, 64), jnp.float32)
  x = _normal((64, 64), 6).astype(BF16)
  jaxpr = str(jax.make_jaxpr(lambda x: norm(x))(x))
  assert jaxpr.count("reduce_precision") == 2
  xf = np.asarray(x, np.float32)
  normed = xf / np.sqrt(np.mean(xf * xf, -1, keepdims=True) + 1e-6)
  want = (np.asarray(norm.scale[...]) * normed.astype(BF16).astype(np.float32)).astype(BF16)
  got = np.asarray(nnx.jit(lambda n, x: n(x))(norm, x))
  assert np.mean(got != want) < 0.01  # equal but for fp32 reduction-order ties


def test_mla_absorbed_training_is_the_same_function_in_fp32(moe_mla_model):
  """The full pass in latent space (`mla_absorbed_training`) equals the standard one in fp32,
  in logits and in gradients."""
  cfg = TINY_MOE_MLA.replace(mla_absorbed_training=True)
  absorbed = nnx.merge(nnx.graphdef(transformer.abstract(cfg)), nnx.state(moe_mla_model))
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, 128, (2, 24)), jnp.int32)
  pos, end = jnp.broadcast_to(jnp.arange(24), tokens.shape), jnp.full(tokens.shape, 24)

  def loss(params, m):
    graphdef, rest = nnx.graphdef(m), nnx.state(m, nnx.Not(nnx.Param))
    logits, _ = nnx.merge(graphdef, params, rest)(tokens, pos, end)
    return jax.nn.log_softmax(logits).mean(), logits

  outs = [jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(
      nnx.state(m, nnx.Param), m) for m in (moe_mla_model, absorbed)]
  (_, ref_logits), ref_grads = outs[0]
  (_, logits), grads = outs[1]
  np.testing.assert_allclose(logits, ref_logits, atol=2e-5)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(a, b, atol=2e-6 + 1e-4 * float(jnp.abs(b).max()))
  with pytest.raises(ValueError, match="mla_absorbed_training"):
    TINY_DENSE.replace(mla_absorbed_training=True)


@pytest.mark.parametrize("family", ["dense", "moe_mla_absorbed"])
def test_bf16_engine_logprobs_match_the_trainer(request, family):
  """The engine's log-probs of its sampled tokens equal the trainer's, in bf16 (MLA: with the
  full pass in latent space, as the decode path attends).

  Both paths compute the same bf16 function, so their final hidden states are equal and only
  the fp32 log-softmax of the logits differs (an fp32 reduction over a different number of
  rows: ~1e-7 here, as in fp32). One bf16 rounding that differs anywhere upstream moves
  log-probs by ~1e-3 (a bf16 ulp is 2^-8 relative), hence the bound 1e-5.
  """
  if family == "dense":
    cfg, base = TINY_DENSE, request.getfixturevalue("dense_model")
  else:
    cfg, base = TINY_MOE_MLA.replace(mla_absorbed_training=True), \
        request.getfixturevalue("moe_mla_model")
  cfg = cfg.replace(dtype="bfloat16")
  model = nnx.merge(nnx.graphdef(transformer.abstract(cfg)), nnx.state(base))
  prompt, new, slots = 24, 24, 8
  engine = Engine(model, EngineConfig(slots=slots, max_seq_len=prompt + new, prefix_cache_rows=0,
                                      prefill_chunk=prompt, prefill_bucket=8,
                                      steps_per_call=new))
  inputs = np.random.default_rng(3).integers(1, cfg.vocab_size, (slots, prompt)).tolist()
  outs = engine.generate(inputs, [SamplingParams(max_tokens=new, temperature=1.0, seed=i)
                                  for i in range(slots)])
  seqs = jnp.asarray([x + o.output_ids for x, o in zip(inputs, outs)], jnp.int32)
  n = seqs.shape[1]
  logits, _ = nnx.jit(lambda m, t: m(t, jnp.broadcast_to(jnp.arange(n), t.shape),
                                     jnp.full(t.shape, n)))(model, seqs)
  logp = jax.nn.log_softmax(logits[:, prompt - 1:-1], -1)
  trainer = np.asarray(jnp.take_along_axis(logp, seqs[:, prompt:, None], -1)[..., 0])
  sampler = np.array([o.logprobs for o in outs])
  assert np.abs(trainer - sampler).max() < 1e-5
