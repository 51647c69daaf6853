"""Ahead-of-time compilation of the generation engine's programs (trainer/aot_engine.py).

The engine's prefill and decode calls for the tiny MoE + MLA model compile in bf16 for a v5p
slice with the real XLA TPU compiler, over the latent cache pool, with the engine's own
graphdef and static arguments (recording experts, as the run's MoE policy replays its routing)
and the token-mask inputs it passes to every decode call; the dense GQA model compiles with
its key/value heads split over `tensor`. Nothing is allocated on the slice.
"""

import dataclasses

import jax
import pytest
from flax import nnx

from configs import sft_demo
from models import presets, sharding, transformer
from models.engine import constraint
from models.kernels import attention
from trainer import aot, aot_engine, rollouts
from trainer import config as config_lib

SLOTS, CONTEXT, CHUNK = 4, 256, 64


def tiny_config(preset=None):
  c = sft_demo.get_config()
  if preset:
    c.model.preset = preset
  c.model.overrides.attention_impl = "pallas_tpu"
  c.model.overrides.dtype = "bfloat16"  # as TPU runs generate
  c.rl.concurrency = SLOTS
  c.rl.max_context_tokens = CONTEXT
  return c


def compile_engine(config, topology, mesh_cfg=None):
  """(model config, engine config, mesh, programs) of a run's engine on a slice."""
  _, devices = aot.topology_devices(topology)
  if mesh_cfg is None:  # the config's mesh (fsdp=-1: all the slice's chips)
    mesh_cfg = sharding.MeshConfig(**{a: config.mesh[a] for a in sharding.MESH_AXES})
  mesh = sharding.make_mesh(mesh_cfg, devices)
  model_cfg = config_lib.model_config(config)
  # the run's own engine (an MoE policy records its experts: rl.routing_replay)
  engine_cfg = dataclasses.replace(rollouts.engine_config(config, model_cfg),
                                   prefill_chunk=CHUNK)
  # conftest sets "highest" for the CPU references; Mosaic takes no fp32 contraction of bf16
  with attention.compile_for("tpu"), jax.default_matmul_precision("default"):
    programs = aot_engine.engine_programs(config, model_cfg, mesh, engine_cfg)
  return model_cfg, engine_cfg, mesh, programs


@pytest.fixture(scope="module")
def mla():
  return compile_engine(tiny_config(), "v5p:2x2x1")


def hbm_total(compiled):
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
          + m.generated_code_size_in_bytes - m.alias_size_in_bytes)


def bytes_accessed(compiled):
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost["bytes accessed"])


def test_moe_mla_engine_compiles_for_v5p_and_fits(mla):
  model_cfg, engine_cfg, mesh, programs = mla
  assert model_cfg.attention == "mla" and model_cfg.is_moe
  assert dict(mesh.shape)["fsdp"] == 4 and mesh.devices.size == 4
  assert engine_cfg.slots == SLOTS and engine_cfg.max_seq_len == CONTEXT
  assert set(programs) == {"prefill", "decode"}
  for name, (compiled, seconds, min_bytes) in programs.items():
    assert 0 < hbm_total(compiled) < 95e9, name
    assert seconds > 0 and min_bytes > 0, name
    assert "tpu_custom_call" in compiled.as_text(), name  # compiled for the TPU (Mosaic calls)
  # the loop body is counted once: about one decode step, at least its floor's order
  decode, _, decode_floor = programs["decode"]
  assert bytes_accessed(decode) >= 0.5 * decode_floor
  assert bytes_accessed(programs["prefill"][0]) > 0
  # the pool is donated and comes back with the layout it came in (no resharding between calls)
  for name, (compiled, _, _) in programs.items():
    args, _ = compiled.input_shardings  # the non-static arguments: state, pool, ...
    outs = compiled.output_shardings[0]  # the pool (prefill: and the experts; decode: ...)
    for a, b in zip(jax.tree.leaves(args[1]), jax.tree.leaves(outs), strict=True):
      assert a.spec[0] == "fsdp" and a.is_equivalent_to(b, 3), name
    assert all(a.donated for a in jax.tree.leaves(compiled.args_info[0][1])), name
  # the engine's outputs for its static arguments: steps_per_call steps of the slots
  pool, steps, tokens, *_, out = decode.out_info
  k, layers, per_token = engine_cfg.steps_per_call, model_cfg.num_moe_layers, \
      model_cfg.experts_per_token
  assert engine_cfg.return_expert_ids  # the run's MoE policy replays its routing
  assert out["tokens"].shape == (k, SLOTS)
  assert set(out) == {"tokens", "logprobs", "entropy", "expert_ids"}  # top_logprobs 0
  assert out["expert_ids"].shape == (k, layers, SLOTS, per_token)
  assert tokens.shape == (SLOTS,) and steps.shape == ()
  _, experts = programs["prefill"][0].out_info  # prefill records the prompt's experts too
  assert experts.shape == (layers, SLOTS, CHUNK, per_token)
  # the masking inputs the engine passes to every decode call (models.engine.constraint.Controls)
  real = constraint.controls([None] * SLOTS, model_cfg.vocab_size).kwargs()
  assert {k: (v.shape, v.dtype) for k, v in decode.args_info[1].items()} == {
      k: (v.shape, v.dtype) for k, v in real.items()}
  assert real["mask"].shape == (SLOTS, -(-model_cfg.vocab_size // 32))


def test_min_bytes_are_weights_plus_cache(mla):
  model_cfg, engine_cfg, _, programs = mla
  chips, layers = 4, model_cfg.num_layers
  per_token = (model_cfg.kv_lora_rank + model_cfg.qk_rope_head_dim) * 2  # bf16 latent + rope key
  decode_cache = SLOTS * CONTEXT * layers * per_token / chips
  prefill_cache = SLOTS * CHUNK * layers * per_token / chips
  weights = programs["decode"][2] - decode_cache
  assert programs["prefill"][2] - prefill_cache == pytest.approx(weights)
  params = presets.count_params(model_cfg)
  assert 2 * params / chips <= weights <= 2 * params  # bf16 shards; small vectors replicated


def test_mla_pool_is_the_latent_cache(mla):
  model_cfg, engine_cfg, mesh, _ = mla
  pool = aot_engine.abstract_pool(model_cfg, engine_cfg, mesh)
  rows = engine_cfg.slots + engine_cfg.prefix_cache_rows
  layers = pool["dense"] + pool["moe"]
  assert len(layers) == model_cfg.num_layers
  for layer in layers:  # no per-head keys or values
    assert set(layer) == {"c_kv", "k_rope"}
    assert layer["c_kv"].shape == (rows, CONTEXT, model_cfg.kv_lora_rank)
    assert layer["k_rope"].shape == (rows, CONTEXT, model_cfg.qk_rope_head_dim)
    for leaf in layer.values():
      assert leaf.dtype == jax.numpy.bfloat16
      assert leaf.sharding.spec == jax.sharding.PartitionSpec("fsdp", None, None)


def test_programs_are_the_engines():
  model_cfg = config_lib.model_config(tiny_config())
  graphdef, state = aot_engine.abstract_model(model_cfg, sharding.make_mesh(
      sharding.MeshConfig(fsdp=1), jax.devices()[:1]))
  # the graphdef Engine splits off its unstacked model: the jit cache key of its calls
  engine_graphdef, engine_state = nnx.split(transformer.unstack(transformer.init(model_cfg)))
  assert graphdef == engine_graphdef
  shapes = lambda s: [(x.shape, x.dtype) for x in jax.tree.leaves(s)]
  assert shapes(state) == shapes(engine_state)


def test_dense_gqa_engine_compiles_with_heads_over_tensor():
  model_cfg, engine_cfg, mesh, programs = compile_engine(
      tiny_config("tiny-dense"), "v5p:2x2x1", sharding.MeshConfig(fsdp=2, tensor=2))
  assert model_cfg.attention == "gqa" and model_cfg.num_kv_heads == 2
  pool = aot_engine.abstract_pool(model_cfg, engine_cfg, mesh)
  for layer in pool["dense"]:
    rows = engine_cfg.slots + engine_cfg.prefix_cache_rows
    assert layer["k"].shape == (rows, 2, CONTEXT, model_cfg.head_dim)
    assert layer["v"].shape == (rows, 2, model_cfg.head_dim, CONTEXT)
    for leaf in layer.values():
      assert leaf.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None, None)
  for name, (compiled, _, min_bytes) in programs.items():
    assert 0 < hbm_total(compiled) < 95e9 and min_bytes > 0, name
  # the same weights; the cache read by a decode step less the prefill chunk's entries: k and v
  # of kv_heads * head_dim bf16 per token and layer, rows over fsdp and heads over tensor
  per_token = model_cfg.num_layers * 2 * model_cfg.num_kv_heads * model_cfg.head_dim * 2
  assert programs["decode"][2] - programs["prefill"][2] == pytest.approx(
      SLOTS * (CONTEXT - CHUNK) * per_token / 4)


def test_cache_sharding_rows_where_divisible_and_unknown_layouts(mla):
  _, _, mesh, _ = mla
  model_cfg = config_lib.model_config(tiny_config("tiny-dense"))
  P = jax.sharding.PartitionSpec
  assert aot_engine.cache_sharding("other", (8, 3), model_cfg, mesh).spec == P("fsdp", None)
  assert aot_engine.cache_sharding("other", (6, 3), model_cfg, mesh).spec == P(None, None)
  with pytest.raises(ValueError, match="num_kv_heads=2"):  # a layout CACHE_AXES does not describe
    aot_engine.cache_sharding("k", (8, 256, 2, 16), model_cfg, mesh)
