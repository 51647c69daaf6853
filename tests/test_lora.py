"""LoRA / QLoRA through qwix (models/lora.py) and their training state.

References: the published LoRA formula W' = W + (alpha / rank) A B and symmetric absmax
quantization transcribed in NumPy, the unadapted model, the unpacked per-call training of
tests/test_step.py, and Hugging Face transformers for the merged export.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from models import hf, lora, transformer
from models.layers import Dense
from tests.conftest import TINY_DENSE, TINY_MOE_MLA
from tests.test_step import (LOSSES, SHAPE, Unpacked, assert_trees_close, make_groups,
                             reference_loss, with_fields)
from trainer import batches as B
from trainer import checkpoint
from trainer import optim as O
from trainer import state as S
from trainer import step as T

RANK, ALPHA = 4, 8.0
EXPERTS = ("attention", "mlp", "experts")
# base config, the adapters' settings
CONFIGS = {"dense": (TINY_DENSE, {}),
           "moe_experts": (TINY_MOE_MLA, dict(lora_modules=EXPERTS)),
           "moe_shared_experts": (TINY_MOE_MLA, dict(lora_modules=("experts",),
                                                     lora_experts="shared"))}
TOKENS = np.random.default_rng(0).integers(0, 128, (2, 12)).astype(np.int32)


# one jitted forward and decoding step for the module: models of the same structure (graphdef)
# share their compiled programs
_forward = nnx.jit(lambda m, t, p, e: m(t, p, e)[0])
_decode = nnx.jit(lambda m, t, c: m.decode_step(t, c, jnp.zeros((t.shape[0],), jnp.int32)))


def logits(model, tokens=TOKENS):
  positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
  end = np.full(tokens.shape, tokens.shape[1], np.int32)
  return np.asarray(_forward(model, tokens, positions, end))


def decode_logits(unstacked, tokens=TOKENS):
  """The first decoding step's logits of an unstacked model over `tokens` (empty cache)."""
  cache = unstacked.init_cache(tokens.shape[0], 16)
  return np.asarray(_decode(unstacked, tokens, cache)[0])


def randomize_adapters(model, seed=3, scale=0.1):
  """Non-zero B (B starts at zero, which would hide the adapters): every adapter drawn
  N(0, scale^2) on the host (no per-shape random program to compile)."""
  state = nnx.state(model, nnx.LoRAParam)
  leaves, treedef = jax.tree.flatten(state)
  rng = np.random.default_rng(seed)
  nnx.update(model, jax.tree.unflatten(treedef, [
      jnp.asarray(scale * rng.standard_normal(x.shape, np.float32), x.dtype) for x in leaves]))
  return model


def adapted_denses(model):
  """{path: Dense} of the Dense modules holding adapters."""
  return {p: d for p, d in nnx.iter_graph(model)
          if isinstance(d, Dense) and hasattr(d, "kernel_lora_a")}


def numpy_merged(dense) -> np.ndarray:
  """W + (alpha / rank) A B over the flattened in / out dimensions, [layers, in.., out..]."""
  w = np.asarray(dense.kernel[...], np.float64)
  a = np.asarray(dense.kernel_lora_a[...], np.float64)  # [layers, in, rank]
  b = np.asarray(dense.kernel_lora_b[...], np.float64)  # [layers, rank, out]
  return w + (ALPHA / RANK) * np.einsum("lir,lro->lio", a, b).reshape(w.shape)


def numpy_merged_experts(moe, name: str) -> np.ndarray:
  """W_e + (alpha / rank) A_e B_e per expert e, [layers, E, in, out]; a shared pair (A [layers,
  in, rank], B [layers, rank, out]) is every expert's A_e, B_e."""
  w = np.asarray(getattr(moe, name)[...], np.float64)
  a = np.asarray(getattr(moe, name + "_lora_a")[...], np.float64)
  b = np.asarray(getattr(moe, name + "_lora_b")[...], np.float64)
  if a.ndim == 3:
    a, b = (np.broadcast_to(x[:, None], (x.shape[0], w.shape[1]) + x.shape[1:]) for x in (a, b))
  return w + (ALPHA / RANK) * np.einsum("leir,lero->leio", a, b)


def adapted_experts(model):
  """{path: MoE} of the MoE modules whose routed experts hold adapters."""
  return {p: m for p, m in nnx.iter_graph(model) if hasattr(m, "gate_proj_lora_a")}


def numpy_quantized(w: np.ndarray, n_in: int, qtype: str,
                    first: int = 1) -> tuple[np.ndarray, np.ndarray]:
  """Symmetric absmax quantization per output channel (scale over the contracted input axes
  `first`, ..., `first + n_in - 1`; per expert too for an expert stack, first = 2):
  int8 rounds w / s with s = max|w| / 127.5 (the bound qwix documents: qmax + 1/2), clipped to
  [-128, 127]; float8_e4m3fn casts w / s with s = max|w| / 448.

  Returns:
    (dequantized w, the step s broadcast to w's shape where w / s is a rounding tie: the
    channel's absmax lands on ±127.5, which fp32 division on another backend may put on
    either side; 0 elsewhere).
  """
  w = w.astype(np.float32)  # fp32 arithmetic, as the kernels are stored
  axes = tuple(range(first, first + n_in))  # after the layers (and experts) axes
  amax = np.abs(w).max(axis=axes, keepdims=True)
  if qtype == "int8":
    s = amax / np.float32(127.5)
    q = w / s
    tie = np.abs(np.abs(q) - 127.5) < 1e-3
    return np.clip(np.round(q), -128, 127) * s, np.where(tie, s, 0.0)
  s = amax / np.float32(448.0)
  return ((w / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s,
          np.zeros_like(w))


@pytest.fixture(scope="module")
def models():
  """Per config: the plain model and its LoRA model (same base, random adapters)."""
  out, bases = {}, {}
  for name, (cfg, settings) in CONFIGS.items():
    base = bases.setdefault(cfg, transformer.init(cfg, seed=0))
    adapted = randomize_adapters(transformer.with_adapters(
        base, cfg.replace(lora_rank=RANK, lora_alpha=ALPHA, **settings)))
    out[name] = (base, adapted)
  return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_adapters_follow_the_lora_formula(name, models):
  """Which projections get adapters, and the adapted forward equals the plain model with every
  adapted kernel (routed experts: every expert's stack) replaced by the NumPy W + (alpha/r) A B;
  `merge_adapters` gives those weights."""
  base, adapted = models[name]
  cfg, settings = CONFIGS[name]
  modules = settings.get("lora_modules", ("attention", "mlp"))
  got = {p[-1] for p in adapted_denses(adapted)}
  attention = ({"q_proj", "k_proj", "v_proj", "o_proj"} if name == "dense" else
               {"q_a_proj", "q_b_proj", "kv_a_proj", "o_proj"})
  want = (attention if "attention" in modules else set()) | \
         ({"gate_proj", "up_proj", "down_proj"} if "mlp" in modules else set())
  assert got == want
  assert not any(p[-1] == "kv_b_proj" for p in adapted_denses(adapted))
  experts = adapted_experts(adapted)
  assert set(experts) == ({("moe_layers", "mlp")} if "experts" in modules else set())
  for moe in experts.values():  # per expert: [layers, E, in, rank]; shared: [layers, in, rank]
    assert moe.gate_proj_lora_a.shape == ((2, 8, 64, RANK) if "lora_experts" not in settings
                                          else (2, 64, RANK))
  assert lora.adapter_count(adapted) > 0 and not lora.is_quantized(adapted)
  adapted_cfg = cfg.replace(lora_rank=RANK, lora_alpha=ALPHA, **settings)
  assert all(m.cfg == adapted_cfg for _, m in nnx.iter_graph(adapted) if hasattr(m, "cfg"))

  plain = transformer.init(cfg, seed=0)
  merged_weights = {}
  for path, dense in adapted_denses(adapted).items():
    merged_weights[path + ("kernel",)] = numpy_merged(dense)
  for path, moe in experts.items():
    for stack in ("gate_proj", "up_proj", "down_proj"):
      merged_weights[path + (stack,)] = numpy_merged_experts(moe, stack)
  for path, w in merged_weights.items():
    getattr(lora.module_at(plain, path[:-1]), path[-1])[...] = jnp.asarray(w, jnp.float32)
  want_logits = logits(plain)
  np.testing.assert_allclose(logits(adapted), want_logits, atol=2e-5, rtol=0)
  assert np.abs(logits(base) - want_logits).max() > 1e-2  # the adapters matter

  merged = transformer.merge_adapters(adapted)
  assert not lora.has_adapters(merged)
  for path, w in merged_weights.items():
    got = getattr(lora.module_at(merged, path[:-1]), path[-1])[...]
    np.testing.assert_allclose(np.asarray(got), w, atol=1e-6, rtol=0)
  np.testing.assert_allclose(logits(merged), want_logits, atol=2e-5, rtol=0)
  if experts:  # the engine's path: unstacked layers, decoding from a cache
    np.testing.assert_allclose(decode_logits(transformer.unstack(adapted)), want_logits,
                               atol=2e-5)


def test_zero_b_is_the_base_model_and_config_errors(models):
  base, _ = models["dense"]
  fresh = transformer.with_adapters(base, TINY_DENSE.replace(lora_rank=RANK))
  np.testing.assert_array_equal(logits(fresh), logits(base))
  for changes, field in ((dict(lora_rank=4, lora_dropout=1.0), "lora_dropout"),
                         (dict(lora_rank=4, lora_modules=("experts",)), "lora_modules"),
                         (dict(base_qtype="int8"), "base_qtype"),
                         (dict(lora_rank=4, base_qtype="int9"), "base_qtype"),
                         (dict(lora_rank=-1), "lora_rank")):
    with pytest.raises(ValueError, match=f"ModelConfig.{field}="):
      TINY_DENSE.replace(**changes)
  experts = dict(lora_rank=4, lora_modules=EXPERTS)
  for changes, field in ((dict(experts, lora_experts="per_layer"), "lora_experts"),
                         (dict(experts, moe_impl="dense"), "moe_impl"),
                         (dict(experts, moe_dispatch="all_to_all"), "moe_dispatch"),
                         (dict(lora_rank=4, base_qtype="int8", moe_impl="dense"), "base_qtype")):
    with pytest.raises(ValueError, match=f"ModelConfig.{field}="):
      TINY_MOE_MLA.replace(**changes)
  with pytest.raises(ValueError, match="QK-Clip"):
    O.build({"name": "muon_clip"}, TINY_DENSE.replace(lora_rank=4))


@pytest.mark.parametrize("qtype", ["int8", "float8_e4m3fn"])
def test_qlora_base_is_absmax_quantized(qtype, models):
  """A QLoRA base holds qwix's 1-byte kernels and expert stacks; their effective weights are the
  NumPy absmax quantization of the base's (per output channel, and per expert); adapters add
  to them; the unstacked and decoding paths agree."""
  cfg = TINY_MOE_MLA.replace(lora_rank=RANK, lora_alpha=ALPHA, base_qtype=qtype,
                             lora_modules=EXPERTS)
  base, _ = models["moe_experts"]  # the plain TINY_MOE_MLA of seed 0
  model = transformer.with_adapters(base, cfg)
  assert lora.is_quantized(model)
  dtypes = {str(x.dtype) for x in jax.tree.leaves(nnx.state(model, lora.QuantizedKernel))}
  assert qtype in dtypes
  merged = transformer.merge_adapters(model)  # B = 0: the dequantized base
  for path, dense in nnx.iter_graph(base):
    if isinstance(dense, Dense) and isinstance(lora.module_at(model, path).kernel,
                                               lora.QuantizedKernel):
      want, tie = numpy_quantized(np.asarray(dense.kernel[...]), dense.n_in, qtype)
      got = np.asarray(lora.module_at(merged, path).kernel[...])
      assert np.all(np.abs(got - want) <= 1e-6 * np.abs(want) + 1e-7 + 1.0001 * tie), path
  for name in ("gate_proj", "up_proj", "down_proj"):
    assert isinstance(getattr(model.moe_layers.mlp, name), lora.QuantizedKernel)
    want, tie = numpy_quantized(np.asarray(getattr(base.moe_layers.mlp, name)[...]), 1, qtype,
                                first=2)
    got = np.asarray(getattr(merged.moe_layers.mlp, name)[...])
    assert np.all(np.abs(got - want) <= 1e-6 * np.abs(want) + 1e-7 + 1.0001 * tie), name
  randomize_adapters(model)
  want = logits(model)
  np.testing.assert_allclose(logits(transformer.merge_adapters(model)), want, atol=2e-5)
  unstacked = transformer.unstack(model)
  np.testing.assert_allclose(logits(unstacked), want, atol=2e-5)
  np.testing.assert_allclose(decode_logits(unstacked), want, atol=2e-5)


def test_train_step_trains_adapters_only_like_unpacked_training(models):
  """The tree-packed, micro-batched GRPO step's loss and adapter gradients (routed experts'
  per-expert adapters included) equal the unpacked per-call reference's (design §3
  tolerances); an optimizer step changes the adapters and nothing of the frozen base; the
  optimizer state holds the adapters' moments alone."""
  cfg = TINY_MOE_MLA.replace(lora_rank=RANK, lora_alpha=ALPHA, lora_modules=EXPERTS)
  base, _ = models["moe_experts"]
  opt = O.build({"name": "muon", "learning_rate": 1e-2, "schedule": "constant"}, cfg)
  assert {r.role for r in opt.table} == {"lora"}
  for r in opt.table:  # one matrix per layer (and per expert)
    assert r.optimizer == "muon" and r.batch_axes == ((0, 1) if "experts" in r.axes else (0,))
  assert any("experts" in r.axes for r in opt.table)
  state = S.create(cfg, opt, model=base)
  trained = randomize_adapters(state.model(cfg))  # B != 0: A's gradients are not zero
  state = state.replace(params=nnx.as_pure(nnx.state(trained, nnx.LoRAParam)))
  names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state.params)}
  assert names and all(n.endswith(("_lora_a']", "_lora_b']")) for n in names)
  n_adapters = sum(x.size for x in jax.tree.leaves(state.params))
  assert sum(x.size for x in jax.tree.leaves(state.opt_state)) < 3 * n_adapters

  groups = make_groups()
  ref = Unpacked(groups)
  ref_fn = ref.fn(S.graphdef(cfg))
  zeros = jnp.zeros(ref.mask.shape, jnp.float32)
  (_, (lp, ent, *_)), _ = ref_fn(state.params, state.model_state, zeros, zeros)
  lp, ent = np.asarray(lp), np.asarray(ent)
  rng = np.random.default_rng(1)
  noise = lambda: rng.uniform(-0.3, 0.3, lp.shape).astype(np.float32) * ref.mask
  fields = {"logprobs": lp + noise(), "old_logprobs": lp + noise(), "ref_logprobs": lp + noise()}
  scalars = {"advantage": rng.normal(size=len(ref.trajectories)).astype(np.float32),
             "reward": rng.integers(0, 2, len(ref.trajectories)).astype(np.float32)}
  mb = B.make_micro_batches(with_fields(groups, fields, scalars), SHAPE)
  s = dict(ref=ref, lp=lp, ent=ent, fields=fields, scalars=scalars)
  loss_cfg, correction = LOSSES["grpo"]
  step = T.make_train_step(cfg, loss_cfg, opt, correction_cfg=correction, donate=False)
  value, grads, _ = step.gradients(state, mb)
  ref_value, d_lp, d_ent, _ = reference_loss(s, "grpo")
  (_, _), ref_grads = ref_fn(state.params, state.model_state, d_lp, d_ent)
  assert abs(float(value) - ref_value) <= 1e-6 * abs(ref_value)
  assert_trees_close(grads, ref_grads)

  new, _ = step(state, mb)
  changed = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))),
                         new.params, state.params)
  assert all(jax.tree.leaves(changed))
  frozen = S.frozen_paths(cfg)
  old_base = dict(nnx.to_flat_state(nnx.State(state.model_state)))
  assert frozen and set(old_base) - frozen == {("moe_layers", "mlp", "router_bias")}
  for path, value in nnx.to_flat_state(nnx.State(new.model_state)):
    if path in frozen:
      np.testing.assert_array_equal(value, old_base[path])


def test_dropout_in_training_steps_only(models):
  """LoRA dropout (here on the routed experts' adapters, through `lora.Provider`) draws the
  same masks for the same step and new ones for the next (without dropout the loss does not
  depend on the step count); evaluation and sampling (no dropout streams) equal the
  dropout-free model, every adapted module included."""
  base, _ = models["moe_experts"]
  groups = make_groups()
  ref = Unpacked(groups)
  rng = np.random.default_rng(1)
  zeros = np.zeros(ref.mask.shape, np.float32)
  fields = {"logprobs": zeros, "old_logprobs": zeros, "ref_logprobs": zeros}
  scalars = {"advantage": rng.normal(size=len(ref.trajectories)).astype(np.float32),
             "reward": np.ones(len(ref.trajectories), np.float32)}
  mb = B.make_micro_batches(with_fields(groups, fields, scalars), SHAPE)
  loss_cfg, correction = LOSSES["grpo"]

  def losses(cfg, steps=(0,)):
    """The step's loss at each optimizer step count (one compiled step)."""
    opt = O.build({"name": "adamw"}, cfg)
    state = S.create(cfg, opt, model=base)
    trained = randomize_adapters(state.model(cfg))  # B != 0: the adapters act
    state = state.replace(params=nnx.as_pure(nnx.state(trained, nnx.LoRAParam)))
    train_step = T.make_train_step(cfg, loss_cfg, opt, correction_cfg=correction, donate=False)
    return [float(train_step.gradients(state.replace(step=jnp.asarray(s, jnp.int32)), mb)[0])
            for s in steps]

  cfg = TINY_MOE_MLA.replace(lora_rank=RANK, lora_alpha=ALPHA, lora_modules=("experts",),
                             lora_dropout=0.5)
  dropped, again, next_step = losses(cfg, (0, 0, 1))
  assert dropped == again and dropped != next_step

  cfg = TINY_MOE_MLA.replace(lora_rank=RANK, lora_alpha=ALPHA, lora_modules=EXPERTS)
  with_dropout = randomize_adapters(transformer.with_adapters(base, cfg.replace(
      lora_dropout=0.5)))
  _, without = models["moe_experts"]  # the same adapters (seed 3), lora_dropout 0
  assert without.cfg == cfg
  np.testing.assert_array_equal(logits(with_dropout), logits(without))


def test_adapter_checkpoint_holds_no_base(models, tmp_path):
  """A LoRA checkpoint leaves the frozen base out (a small fraction of a full one) and, with
  the base rebuilt, restores the exact state."""
  cfg = TINY_MOE_MLA.replace(lora_rank=RANK, lora_alpha=ALPHA, base_qtype="int8")
  base, _ = models["moe_experts"]
  opt = O.build({"name": "adamw"}, cfg)
  state = S.create(cfg, opt, model=base)
  trained = randomize_adapters(state.model(cfg))
  state = state.replace(params=nnx.as_pure(nnx.state(trained, nnx.LoRAParam)))
  full_opt = O.build({"name": "adamw"}, TINY_MOE_MLA)
  full = S.create(TINY_MOE_MLA, full_opt, model=base)
  sizes = {}
  for name, st, c in (("lora", S.without_base(state, cfg), cfg), ("full", full, TINY_MOE_MLA)):
    with checkpoint.Checkpointer(str(tmp_path / name), async_save=False) as ckpt:
      ckpt.save(1, st, {}, force=True)
    sizes[name] = sum(os.path.getsize(os.path.join(d, f))
                      for d, _, fs in os.walk(tmp_path / name) for f in fs)
  assert sizes["lora"] < 0.35 * sizes["full"], sizes
  target = S.without_base(S.abstract(cfg, opt), cfg)
  with checkpoint.Checkpointer(str(tmp_path / "lora")) as ckpt:
    restored = ckpt.restore_latest(target).state
  again = S.with_base(restored, S.create(cfg, opt, model=base).model_state, cfg)
  jax.tree.map(np.testing.assert_array_equal, again.params, state.params)
  jax.tree.map(np.testing.assert_array_equal, again.model_state, state.model_state)
  np.testing.assert_array_equal(logits(again.model(cfg)), logits(state.model(cfg)))


@pytest.mark.parametrize("name", ["dense", "moe_experts"])
def test_merged_export_loads_in_transformers(name, models, tmp_path):
  """The merged LoRA model (Qwen2; DeepSeek-V3 with per-expert adapters on its routed experts)
  written as an HF checkpoint loads in transformers with the LoRA model's logits (fp32)."""
  torch = pytest.importorskip("torch")
  from transformers import AutoModelForCausalLM
  _, adapted = models[name]
  hf.save(transformer.merge_adapters(adapted), tmp_path)
  model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
  with torch.no_grad():
    got = model(torch.from_numpy(TOKENS).long()).logits.float().numpy()
  np.testing.assert_allclose(got, logits(adapted), atol=1e-4, rtol=0)
