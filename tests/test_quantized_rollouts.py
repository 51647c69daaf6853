"""Quantized rollouts and LoRA weight sync in the engine (models/engine/weights.py), against
independent references.

- An engine with `weight_qtype` ("int8", "float8_e4m3fn") samples from the qwix-quantized
  model: its log-probs equal a teacher-forced forward pass of `lora.quantize`'s copy, and differ
  from the full-precision model's by a small, nonzero amount (rl.corrections.mismatch_metrics).
- `update_params` re-quantizes new full-precision weights: the engine then samples exactly as a
  freshly built quantized engine on them, and holds int8 kernels within half a quantization
  step of the new weights (NumPy absmax per output channel; per expert for the routed
  experts' stacks).
- A LoRA engine (QLoRA: int8 base) takes the trainer's adapters alone (a stacked pure state, or
  unstacked Variables): the same tokens and log-probs as a full update, its frozen base arrays
  untouched, log-probs equal to a teacher-forced pass of the trained model.
- With `act_qtype` the projections' inputs are quantized too: each quantized projection's
  output is its input rounded by the absmax rule per token (NumPy) times its dequantized kernel.
- Config errors name the field; `trainer.rollouts.engine_config` reads `rl.rollout_qtype` and
  `rl.rollout_act_qtype`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from configs.base import base_config
from envs.policy import SamplingParams
from models import lora, transformer
from models.engine import Engine, EngineConfig
from models.layers import Dense
from models.presets import PRESETS
from rl.corrections import mismatch_metrics
from trainer.rollouts import engine_config

# initializer_range 0.1: next-token distributions far from uniform, so quantization shows
DENSE = PRESETS["tiny-dense"].replace(initializer_range=0.1)
MOE_MLA = PRESETS["tiny-moe-mla"].replace(initializer_range=0.1)
CONFIG = EngineConfig(slots=4, max_seq_len=64, prefix_cache_rows=4, min_prefix=4,
                      prefill_chunk=32, prefill_bucket=16, steps_per_call=8)
NEW = 12
PARAMS = [SamplingParams(max_tokens=NEW, temperature=1.0, seed=i) for i in range(4)]
ATOL = 1e-4  # engine (prefill + cached decode) vs one full forward pass of the same weights


def prompts(vocab: int) -> list[list[int]]:
  rng = np.random.default_rng(0)
  return [rng.integers(1, vocab, n).tolist() for n in (5, 9, 12, 16)]  # one prefill shape


@nnx.jit
def _logp(model, tokens):
  n = tokens.shape[1]
  positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), tokens.shape)
  logits, _ = model(tokens, positions, jnp.full(tokens.shape, n, jnp.int32))
  return jax.nn.log_softmax(logits.astype(jnp.float32), -1)


def teacher(model, inputs, outs) -> np.ndarray:
  """[requests, NEW] teacher-forced log p of each sampled token (every request runs NEW
  tokens: no stop tokens), one full forward pass without a cache."""
  seqs = [list(x) + o.output_ids for x, o in zip(inputs, outs)]
  width = 64
  tokens = np.zeros((len(seqs), width), np.int32)
  for i, s in enumerate(seqs):
    tokens[i, :len(s)] = s
  logp = np.asarray(_logp(model, jnp.asarray(tokens)))
  return np.stack([logp[i, np.arange(len(x) - 1, len(x) - 1 + NEW), o.output_ids]
                   for i, (x, o) in enumerate(zip(inputs, outs))])


def sampled(outs) -> np.ndarray:
  return np.array([o.logprobs for o in outs], np.float32)


def engine(model, **changes) -> Engine:
  return Engine(model, dataclasses.replace(CONFIG, **changes))


@pytest.fixture(scope="module")
def dense():
  return transformer.init(DENSE, seed=0)


@pytest.mark.parametrize("qtype,act_qtype", [("int8", None), ("float8_e4m3fn", None),
                                             ("float8_e4m3fn", "float8_e4m3fn")])
def test_quantized_engine_samples_from_the_quantized_model(dense, qtype, act_qtype):
  inputs = prompts(DENSE.vocab_size)
  outs = engine(dense, weight_qtype=qtype, act_qtype=act_qtype).generate(inputs, PARAMS)
  assert all(len(o.output_ids) == NEW for o in outs)
  got = sampled(outs)
  # the sampler's log-probs are those of the quantized model ...
  quantized = lora.quantize(dense, DENSE, qtype, transformer.Transformer, act_qtype)
  np.testing.assert_allclose(got, teacher(quantized, inputs, outs), atol=ATOL)
  if act_qtype:  # ... whose activations are quantized too
    weight_only = lora.quantize(dense, DENSE, qtype, transformer.Transformer)
    assert np.abs(teacher(weight_only, inputs, outs) - got).max() > 10 * ATOL
  # ... which differ from the full-precision trainer's by a small, nonzero amount
  full = teacher(dense, inputs, outs)
  m = {k: float(v) for k, v in mismatch_metrics(jnp.asarray(full), jnp.asarray(got),
                                                jnp.ones(got.shape)).items()}
  print(qtype, m)
  assert m["mismatch_max_abs_log_ratio"] > 10 * ATOL
  assert 0 < m["mismatch_kl_k3"] < 1e-2
  # int8 keeps 8 bits per channel, e4m3 4 significant bits: int8 is the closer one
  assert m["mismatch_max_abs_log_ratio"] < (0.1 if qtype == "int8" else 0.3)


def numpy_act_quantized(x: np.ndarray, n_in: int, qtype: str) -> tuple[np.ndarray, np.ndarray]:
  """Symmetric absmax per token over the contracted (last n_in) axes: int8 rounds x / s with
  s = max|x| / 127.5, clipped to [-128, 127]; e4m3 casts x / s with s = max|x| / 448.

  Returns:
    (the rounded x, the step s where x / s is a rounding tie (a token's absmax lands on
    ±127.5, which XLA puts on either side), 0 elsewhere).
  """
  axes = tuple(range(x.ndim - n_in, x.ndim))
  amax = np.abs(x).max(axis=axes, keepdims=True)
  if qtype == "int8":
    s = amax / np.float32(127.5)
    tie = np.abs(np.abs(x / s) - 127.5) < 1e-3
    return np.clip(np.round(x / s), -128, 127) * s, np.where(tie, s, 0.0)
  s = amax / np.float32(448.0)
  return (x / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s, np.zeros_like(x)


@pytest.mark.parametrize("qtype", ["int8", "float8_e4m3fn"])
def test_activation_quantization_follows_the_absmax_rule(dense, qtype, monkeypatch):
  """Weights and activations quantized: every quantized projection's output is its input
  rounded by the absmax rule per token (NumPy) times its dequantized kernel (values x scales),
  plus its bias. (Checked per projection: a whole-model comparison would hinge on rounding
  ties that 1e-7 differences between two exact-enough matmuls move.)"""
  calls = []
  plain_call = Dense.__call__

  def recording_call(self, x):
    y = plain_call(self, x)
    kernel = self.kernel.get_value() if isinstance(self.kernel, nnx.Variable) else self.kernel
    if isinstance(self.kernel, lora.QuantizedKernel):
      bias = jnp.zeros(y.shape[-1:]) if self.bias is None else self.bias[...]
      jax.debug.callback(lambda *a: calls.append((self.n_in,) + tuple(map(np.asarray, a))),
                         x, y, kernel.array.qvalue.astype(jnp.float32), kernel.array.scale, bias)
    return y

  monkeypatch.setattr(Dense, "__call__", recording_call)
  model = lora.quantize(dense, DENSE, qtype, transformer.Transformer, qtype)
  tokens = jnp.asarray(np.stack(prompts(DENSE.vocab_size)[3:] * 2))
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  end = jnp.full(tokens.shape, tokens.shape[1], jnp.int32)
  jax.block_until_ready(nnx.jit(lambda m, *a: m(*a)[0])(model, tokens, positions, end))
  assert len(calls) == 7 * DENSE.num_layers  # q, k, v, o, gate, up, down per layer
  for n_in, x, y, q, scale, bias in calls:
    xq, tie = numpy_act_quantized(x.astype(np.float32), n_in, qtype)
    w = q * scale
    want = np.tensordot(xq, w, n_in) + bias
    slack = np.tensordot(tie, np.abs(w), n_in)  # a tie's rounding either way
    assert np.all(np.abs(y - want) <= 1.0001 * slack + 2e-6 * np.abs(want).max())
  # the rounding is there: against unrounded inputs the outputs move by far more
  n_in, x, y, q, scale, bias = calls[0]
  assert np.abs(y - np.tensordot(x, q * scale, n_in) - bias).max() > 1e-3 * np.abs(y).max()


def test_update_params_requantizes(dense):
  model_cfg = MOE_MLA
  old, new = transformer.init(model_cfg, seed=0), transformer.init(model_cfg, seed=1)
  inputs = prompts(model_cfg.vocab_size)
  e = engine(old, weight_qtype="int8")
  before = e.generate(inputs, PARAMS)
  e.update_params(new, version=1)  # a stacked Transformer, full precision
  after = e.generate(inputs, PARAMS)
  fresh = engine(new, weight_qtype="int8").generate(inputs, PARAMS)
  assert [o.output_ids for o in after] == [o.output_ids for o in fresh]
  np.testing.assert_array_equal(sampled(after), sampled(fresh))
  assert not np.array_equal(sampled(before), sampled(after))
  assert all(o.token_versions == [1] * NEW for o in after)
  e.update_params(nnx.state(new), version=2)  # a stacked state
  np.testing.assert_array_equal(sampled(e.generate(inputs, PARAMS)), sampled(fresh))

  # the engine holds int8 kernels of the new weights: per output channel, scale = absmax / 127.5
  # (qwix extends the int8 bound to qmax + 0.5) and the dequantized kernel within half a step
  held = nnx.to_pure_dict(e.weights)["dense_layers"][0]["mlp"]["gate_proj"]["kernel"].array
  q, scale = np.asarray(held.qvalue), np.asarray(held.scale)
  assert q.dtype == np.int8
  w = np.asarray(new.dense_layers.mlp.gate_proj.kernel[...])[0]  # [hidden, intermediate]
  np.testing.assert_allclose(scale[0], np.abs(w).max(0) / 127.5, rtol=1e-6)
  assert np.all(np.abs(q * scale - w) <= scale / 2 + 1e-7)
  w_old = np.asarray(old.dense_layers.mlp.gate_proj.kernel[...])[0]
  assert np.abs(q * scale - w_old).max() > scale.max()
  # and the routed experts' stacks, per expert and output channel
  held = nnx.to_pure_dict(e.weights)["moe_layers"][0]["mlp"]["up_proj"].array
  q, scale = np.asarray(held.qvalue), np.asarray(held.scale)
  w = np.asarray(new.moe_layers.mlp.up_proj[...])[0]  # [experts, hidden, expert width]
  assert q.dtype == np.int8 and scale.shape == (w.shape[0], 1, w.shape[2])
  np.testing.assert_allclose(scale, np.abs(w).max(1, keepdims=True) / 127.5, rtol=1e-6)
  assert np.all(np.abs(q * scale - w) <= scale / 2 + 1e-7)


def trained(model):
  """(params, model): the trainer's params of a LoRA model (`lora.trainable`: the adapters,
  as the pure state TrainState.params holds) moved, B included (zero at init), and the model
  they make with the frozen base."""
  graphdef, params, frozen = nnx.split(model, lora.trainable(model.cfg), ...)
  leaves, tree = jax.tree.flatten(nnx.as_pure(params))
  keys = jax.random.split(jax.random.key(3), len(leaves))
  params = jax.tree.unflatten(tree, [a + 0.3 * jax.random.normal(k, a.shape, a.dtype)
                                     for a, k in zip(leaves, keys)])
  return params, nnx.merge(graphdef, params, frozen)


def test_lora_engine_takes_adapters_alone():
  """QLoRA policy (int8 base): the weight sync of a LoRA run sends the trainer's adapters
  (stacked, pure), not the frozen base."""
  model_cfg = DENSE.replace(lora_rank=4, lora_alpha=8.0, base_qtype="int8")
  base = transformer.init(model_cfg, seed=0)
  adapters, after = trained(base)
  inputs = prompts(model_cfg.vocab_size)
  full, alone = engine(base), engine(base)
  untouched = {k: v for k, v in nnx.traversals.flatten_mapping(
      nnx.to_pure_dict(alone.weights)).items() if not k[-1].startswith("kernel_lora")}
  before = sampled(alone.generate(inputs, PARAMS))

  full.update_params(after, version=1)
  alone.update_params(adapters, version=1)
  want = full.generate(inputs, PARAMS)
  got = alone.generate(inputs, PARAMS)
  assert [o.output_ids for o in got] == [o.output_ids for o in want]
  np.testing.assert_array_equal(sampled(got), sampled(want))
  np.testing.assert_allclose(sampled(got), teacher(after, inputs, got), atol=ATOL)
  assert np.abs(sampled(got) - before).max() > 10 * ATOL  # the adapters changed the policy
  # the frozen base stayed: the same arrays (int8 values and scales), not copies
  state = nnx.traversals.flatten_mapping(nnx.to_pure_dict(alone.weights))
  assert all(x is y for k, v in untouched.items()
             for x, y in zip(jax.tree.leaves(state[k]), jax.tree.leaves(v)))

  # unstacked nnx.Variable states, after other weights
  alone.update_params(base, version=2)
  alone.update_params(nnx.state(transformer.unstack(after), nnx.LoRAParam), version=3)
  np.testing.assert_array_equal(sampled(alone.generate(inputs, PARAMS)), sampled(want))

  partial = nnx.state(after, nnx.LoRAParam)["dense_layers"]["mlp"]
  with pytest.raises(ValueError, match="not the engine model's: adapters missing"):
    alone.update_params(nnx.State({"dense_layers": {"mlp": partial}}), version=4)
  with pytest.raises(ValueError, match="EngineConfig.weight_qtype='int8': the model has LoRA"):
    engine(base, weight_qtype="int8")


def test_config_errors(dense):
  with pytest.raises(ValueError, match=r"EngineConfig.weight_qtype='int3': expected None or "):
    engine(dense, weight_qtype="int3")
  with pytest.raises(ValueError, match=r"EngineConfig.act_qtype='int4': expected None or "):
    engine(dense, weight_qtype="int8", act_qtype="int4")
  with pytest.raises(ValueError, match=r"EngineConfig.act_qtype='float8_e4m3fn': quantized "):
    engine(dense, act_qtype="float8_e4m3fn")
  adapters = nnx.state(transformer.init(DENSE.replace(lora_rank=2), seed=0), nnx.LoRAParam)
  with pytest.raises(ValueError, match="got LoRA adapters alone, but the engine's model has"):
    engine(dense).update_params(adapters, version=1)
  dense_moe = MOE_MLA.replace(moe_impl="dense")
  with pytest.raises(ValueError, match="ModelConfig.moe_impl='dense'; quantized routed"):
    lora.quantize(transformer.abstract(dense_moe), dense_moe, "int8", transformer.Transformer)
  with pytest.raises(ValueError, match="quantized already"):
    engine(lora.quantize(dense, DENSE, "int8", transformer.Transformer), weight_qtype="int8")


def test_engine_config_reads_rollout_qtype():
  config = base_config()
  assert engine_config(config, DENSE).weight_qtype is None
  with config.unlocked():
    config.rl.rollout_qtype = "float8_e4m3fn"
  assert engine_config(config, DENSE).weight_qtype == "float8_e4m3fn"
  assert engine_config(config, DENSE).act_qtype is None
  with config.unlocked():
    config.rl.rollout_act_qtype = "float8_e4m3fn"
  assert engine_config(config, DENSE).act_qtype == "float8_e4m3fn"
  with pytest.raises(ValueError, match="rl.rollout_qtype='float8_e4m3fn': the policy has LoRA"):
    engine_config(config, DENSE.replace(lora_rank=4))
