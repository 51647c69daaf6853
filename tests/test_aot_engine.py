"""Ahead-of-time compilation of the generation engine's programs (trainer/aot_engine.py).

The engine's prefill and decode calls for the tiny MoE + MLA model compile in bf16 for a v5p
slice with the real XLA TPU compiler, in the mesh engine's decode layout, over the latent
cache pool, with the engine's own graphdef and static arguments (recording experts, as the
run's MoE policy replays its routing, and the pool's specs) and the token-mask inputs it passes
to every decode call; the dense GQA model compiles with its key/value heads split over
`tensor`. The decode program gathers no weight (the same program with the weights in the
training layout does). Nothing is allocated on the slice.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from configs import sft_demo
from models import presets, sharding, transformer
from models.engine import Engine, EngineConfig, constraint, programs as engine_programs
from models.kernels import attention
from trainer import aot, aot_engine, aot_hlo, rollouts
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
  # the pool is donated and comes back with the layout it came in (no resharding between
  # calls): rows replicated over the batch shards, as the engine's pool places them
  for name, (compiled, _, _) in programs.items():
    args, _ = compiled.input_shardings  # the non-static arguments: state, pool, ...
    outs = compiled.output_shardings[0]  # the pool (prefill: and the experts; decode: ...)
    for a, b in zip(jax.tree.leaves(args[1]), jax.tree.leaves(outs), strict=True):
      assert a.is_fully_replicated and a.is_equivalent_to(b, 3), name
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


def weight_shaped_collectives(compiled, state) -> list[str]:
  """The all-gathers and all-reduces of a compiled program whose result has the shape of a
  (2-d or larger) variable of `state`: weights gathered (on a torus an all-gather may be
  compiled as an all-reduce; a decode program reduces no weight)."""
  weights = {tuple(x.shape) for x in jax.tree.leaves(state) if x.ndim >= 2}
  found = []
  for line in compiled.as_text().splitlines():
    m = re.search(r"=\s*(.*?)\s(all-gather|all-reduce)(-start)?\(", line)
    if m and any(tuple(int(d) for d in dims.split(",")) in weights
                 for dims in re.findall(r"\w+\[([\d,]+)\]", m.group(1))):
      found.append(line.strip())
  return found


def training_layout_decode(model_cfg, engine_cfg, mesh):
  """The engine's decode program with the state in the training layout (the model's own rules:
  parameters over fsdp), the pool and every other input as in `aot_engine.engine_programs`."""
  model = nnx.eval_shape(lambda: transformer.with_adapters(
      transformer.Transformer(model_cfg, stacked=False)))
  graphdef, state = nnx.split(model)
  state = jax.tree.map(lambda v, sh: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh),
                       state, sharding.state_shardings(state, model_cfg, mesh))
  pool, _ = aot_engine.abstract_pool(model_cfg, engine_cfg, mesh)
  s, i32, f32 = engine_cfg.slots, jax.numpy.int32, jax.numpy.float32
  arr = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
  slot = lambda dtype: arr((s,), dtype)  # noqa: E731
  words = constraint.words(model_cfg.vocab_size)
  with attention.compile_for("tpu"), jax.default_matmul_precision("default"), \
       jax.set_mesh(mesh):
    return state, engine_programs.decode.lower(
        graphdef, engine_cfg.steps_per_call, engine_cfg.top_logprobs,
        engine_cfg.return_expert_ids, state, pool, slot(i32), slot(i32), slot(i32),
        slot(jax.numpy.bool_), slot(i32), slot(i32), slot(f32), slot(i32), slot(f32),
        slot(jax.numpy.uint32), arr((s, max(engine_cfg.max_stop_token_ids, 1)), i32),
        arr((), i32), arr((), jax.numpy.bool_), mask=arr((s, words), jax.numpy.uint32),
        min_p=slot(f32), min_tokens=slot(i32)).compile()


def test_decode_gathers_no_weight(mla):
  model_cfg, engine_cfg, mesh, programs = mla
  decode = programs["decode"][0]
  _, state = aot_engine.abstract_model(model_cfg, mesh)
  assert weight_shaped_collectives(decode, state) == []
  # the same program with the weights over fsdp gathers them (what the check would see). At
  # this size its bytes accessed are not more: the decode layout reads every chip's whole
  # (replicated) weights, the training layout a quarter of them plus the bf16 gathers.
  train_state, trained = training_layout_decode(model_cfg, engine_cfg, mesh)
  assert weight_shaped_collectives(trained, train_state)
  # every collective of the decode layout's call: the slots' rows gathered for the pool's
  # scatter (4 slots x CONTEXT entries of the latent and the rope key, per layer), no weight
  # (the contiguous pool: rows replicated over the batch shards)
  gathers = aot_hlo.collectives(decode.as_text())["all-gather"]
  per_token = (model_cfg.kv_lora_rank + model_cfg.qk_rope_head_dim) * 2
  assert gathers["bytes"] <= SLOTS * CONTEXT * model_cfg.num_layers * per_token


def test_min_bytes_are_weights_plus_cache(mla):
  model_cfg, engine_cfg, _, programs = mla
  chips, layers = 4, model_cfg.num_layers
  per_token = (model_cfg.kv_lora_rank + model_cfg.qk_rope_head_dim) * 2  # bf16 latent + rope key
  # the slots' rows split over the 4 batch shards (fsdp)
  decode_cache = SLOTS * CONTEXT * layers * per_token / chips
  prefill_cache = SLOTS * CHUNK * layers * per_token / chips
  weights = programs["decode"][2] - decode_cache
  # bf16, whole (no tensor or expert axis); of the untied embedding table the rows a call looks
  # up on a chip: one slot's token a decode step, a prefill chunk's positions
  hidden = model_cfg.hidden_size
  assert programs["prefill"][2] - prefill_cache == pytest.approx(
      weights + 2 * (CHUNK - 1) * hidden)
  table = model_cfg.vocab_size * hidden
  params = presets.count_params(model_cfg)
  assert weights == pytest.approx(2 * (params - table + hidden), rel=0.05)


def test_mla_pool_is_the_latent_cache(mla):
  model_cfg, engine_cfg, mesh, _ = mla
  pool, _ = aot_engine.abstract_pool(model_cfg, engine_cfg, mesh)
  rows = engine_cfg.slots + engine_cfg.prefix_cache_rows
  layers = pool["dense"] + pool["moe"]
  assert len(layers) == model_cfg.num_layers
  for layer in layers:  # no per-head keys or values
    assert set(layer) == {"c_kv", "k_rope"}
    assert layer["c_kv"].shape == (rows, CONTEXT, model_cfg.kv_lora_rank)
    assert layer["k_rope"].shape == (rows, CONTEXT, model_cfg.qk_rope_head_dim)
    for leaf in layer.values():
      assert leaf.dtype == jax.numpy.bfloat16
      assert leaf.sharding.is_fully_replicated  # no head axis; rows over no batch shard


def test_programs_are_the_engines():
  model_cfg = config_lib.model_config(tiny_config())
  mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
  engine_cfg = EngineConfig(slots=2, max_seq_len=32)
  graphdef, state = aot_engine.abstract_model(model_cfg, mesh)
  pool, specs = aot_engine.abstract_pool(model_cfg, engine_cfg, mesh)
  # what a mesh engine holds: the graphdef of its decode model (the jit cache key of its
  # calls), its placed state, and its pool's caches and specs
  engine = Engine(transformer.init(model_cfg), engine_cfg, mesh=mesh)
  assert graphdef == engine._graphdef
  placed = lambda t: [(x.shape, x.dtype, x.sharding.spec) for x in jax.tree.leaves(t)]
  assert placed(state) == placed(engine._state)
  assert placed(pool) == placed(engine._pool.caches)
  assert specs == engine._pool._specs


def test_tpu_programs_read_a_one_token_matmuls_weight_once():
  # decode at one slot per shard: a [1, heads x head_dim] row times o_proj's kernel
  # [heads, head_dim, hidden] as `layers.Dense` computes it (reshaped to 2-D, fp32 accumulation)
  def steps(x, kernels):
    def body(h, _):
      for w in kernels:
        y = jnp.dot(h.reshape(1, -1), w.reshape(h.size, -1), preferred_element_type=jnp.float32)
        h = h + y[:, :h.size].reshape(h.shape).astype(h.dtype)
      return h, None
    return jax.lax.scan(body, x, None, length=4)[0]

  _, devices = aot.topology_devices("v5p:2x2x1")
  one = jax.sharding.SingleDeviceSharding(devices[0])
  x = jax.ShapeDtypeStruct((1, 8, 128), jnp.bfloat16, sharding=one)
  kernels = [jax.ShapeDtypeStruct((8, 128, 7168), jnp.bfloat16, sharding=one)] * 2
  weight_bytes = 2 * 8 * 128 * 7168 * 2
  per_step = lambda jitted: aot_hlo.hbm_bytes(jitted.lower(x, kernels).compile().as_text())["loop"]
  with attention.compile_for("tpu"):
    engine_step = per_step(engine_programs._Program(steps))
  # the engine's options: each kernel read once per step, in bf16; XLA:TPU's defaults rewrite the
  # product as an fp32 multiply-reduce and convert each kernel to fp32 in HBM first
  assert weight_bytes <= engine_step < 1.02 * weight_bytes
  assert per_step(jax.jit(steps)) > 3 * weight_bytes


def test_dense_gqa_engine_compiles_with_heads_over_tensor():
  model_cfg, engine_cfg, mesh, programs = compile_engine(
      tiny_config("tiny-dense"), "v5p:2x2x1", sharding.MeshConfig(fsdp=2, tensor=2))
  assert model_cfg.attention == "gqa" and model_cfg.num_kv_heads == 2
  pool, _ = aot_engine.abstract_pool(model_cfg, engine_cfg, mesh)
  for layer in pool["dense"]:
    rows = engine_cfg.slots + engine_cfg.prefix_cache_rows
    assert layer["k"].shape == (rows, 2, CONTEXT, model_cfg.head_dim)
    assert layer["v"].shape == (rows, 2, model_cfg.head_dim, CONTEXT)
    for leaf in layer.values():  # rows replicated over the batch shards
      assert tuple(leaf.sharding.spec)[:2] == (None, "tensor")
  for name, (compiled, _, min_bytes) in programs.items():
    assert 0 < hbm_total(compiled) < 95e9 and min_bytes > 0, name
  # the same weights but for the embedding rows looked up (a chip's slots in a decode step,
  # their prefill chunks' positions); the cache read by a decode step less the prefill chunk's
  # entries: k and v of kv_heads * head_dim bf16 per token and layer, slots over fsdp and
  # heads over tensor
  per_token = model_cfg.num_layers * 2 * model_cfg.num_kv_heads * model_cfg.head_dim * 2
  assert programs["decode"][2] - programs["prefill"][2] == pytest.approx(
      SLOTS * (CONTEXT - CHUNK) * per_token / 4
      - 2 * (SLOTS // 2) * (CHUNK - 1) * model_cfg.hidden_size)  # a chip's 2 of the slots


def test_paged_engine_compiles_with_pages_split_over_the_batch_shards(mla):
  config = tiny_config()
  config.rl.kv_cache, config.rl.kv_page_size = "paged", 16
  model_cfg, engine_cfg, mesh, programs = compile_engine(config, "v5p:2x2x1")
  pool, specs = aot_engine.abstract_pool(model_cfg, engine_cfg, mesh)
  num_pages = (SLOTS + engine_cfg.prefix_cache_rows) * CONTEXT // 16
  for layer in pool["dense"] + pool["moe"]:  # one latent head; pages over the 4 fsdp shards
    assert layer["c_kv"].shape == (1, num_pages, 16, model_cfg.kv_lora_rank)
    assert layer["c_kv"].sharding.shard_shape(layer["c_kv"].shape)[1] == num_pages // 4
  decode = programs["decode"][0]
  # the Pallas paged-attention kernel runs on each shard's own pages: no cache moves; its pages
  # are pinned to HBM (the compiler would otherwise stage a pool that fits into VMEM whole)
  kernels = [line for line in decode.as_text().splitlines()
             if "paged_attention/pallas_call" in line and "custom-call(" in line]
  assert kernels and all('"input_memory_space_colors":[]' not in line for line in kernels)
  cache = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(pool)) / 4
  gathered = aot_hlo.collectives(decode.as_text()).get("all-gather", {"bytes": 0})["bytes"]
  assert gathered < 0.01 * cache, gathered
  for name, (compiled, _, _) in programs.items():  # donated, and back in the same layout
    args, _ = compiled.input_shardings
    for a, b in zip(jax.tree.leaves(args[1]), jax.tree.leaves(compiled.output_shardings[0]),
                    strict=True):
      assert not a.is_fully_replicated and a.is_equivalent_to(b, 4), name
    assert all(a.donated for a in jax.tree.leaves(compiled.args_info[0][1])), name
  # the same floors as the contiguous pool's (the same positions per chip), fewer bytes
  _, _, _, contiguous = mla
  for name in ("prefill", "decode"):
    assert programs[name][2] == pytest.approx(contiguous[name][2]), name
  assert bytes_accessed(decode) < bytes_accessed(contiguous["decode"][0])
