"""The engine on a device mesh (models/engine/layout.py) equals the one-device engine.

One subprocess with 8 simulated CPU devices (`python -m tests.test_engine_mesh`, compiled once
for every case) runs, for dense GQA and MoE + MLA models, contiguous and paged caches, both
engines through the same requests: greedy and seeded sampling, multi-turn prompts sharing
prefixes (prefix hits on both), and a weight update mid-run with `on_update="resubmit"` (the
requests straddle it). Deployments: colocated (the trainer's fsdp 8 devices laid out for the
engine as fsdp 2 x tensor 2 x expert 2, `rl.engine_mesh_shape`; the new weights FSDP-sharded
over the 8) and disaggregated (engine on devices 4-7,
tensor 2 x expert 2; the trainer's weights FSDP-sharded on devices 0-3). Compared: tokens,
log-probs and entropies (fp32, <= 1e-5), top log-probs, expert ids, versions, cached tokens.
Also: the weights and caches carry the decode layout's shardings after the update, the update
makes no implicit transfer (`jax.transfer_guard("disallow")`), a quantized engine's update
likewise, the MoE decode takes the expert-parallel all-to-all, the compiled decode call
all-gathers no whole cache pool, the paged pool's pages are split over the batch shards with
prefixes copied across shards (each shard decodes its own slots over its own pages), and the
mesh's validation errors.
"""

import json
import os
import sys

from tests.conftest import run_check


def test_mesh_engine_matches_one_device_engine():
  stdout = run_check("test_engine_mesh")
  results = json.loads(stdout.strip().splitlines()[-1])
  assert sorted(results["cases"]) == sorted(
      ["dense/contiguous/colocated", "moe/paged/colocated", "moe/contiguous/disaggregated",
       "dense/paged/disaggregated"]), results
  for name, case in results["cases"].items():
    assert case["logprob_diff"] <= 1e-5, (name, case)
    assert case["entropy_diff"] <= 1e-4, (name, case)
  assert results["errors"] == 4, results


def test_rl_engine_mesh_field():
  import ml_collections
  import pytest

  from trainer import rollouts

  def config(kind):
    return ml_collections.ConfigDict({"rl": {"engine_mesh": kind}})
  assert rollouts.engine_mesh(ml_collections.ConfigDict({"rl": {}}), mesh="m") is None
  assert rollouts.engine_mesh(config("none"), mesh="m") is None
  assert rollouts.engine_mesh(config("colocated"), mesh="m") == "m"
  with pytest.raises(ValueError, match="rl.engine_mesh='colocated': the run has no"):
    rollouts.engine_mesh(config("colocated"))
  with pytest.raises(ValueError, match="rl.engine_mesh='remote'"):
    rollouts.engine_mesh(config("remote"), mesh="m")

  from configs.base import base_config
  from trainer import config as config_lib
  c = base_config()
  c.mode, c.loss.name, c.rl.engine_mesh = "rl", "grpo", "remote"
  with pytest.raises(config_lib.ConfigError, match=r"config\.rl\.engine_mesh='remote'"):
    config_lib.validate(c, files=False)
  c.rl.engine_mesh, c.rl.engine_mesh_shape = "colocated", "tensor=two"
  with pytest.raises(config_lib.ConfigError, match=r"rl\.engine_mesh_shape='tensor=two'"):
    config_lib.validate(c, files=False)
  # the trainer's devices laid out anew must cover them all
  import jax
  from models import sharding
  one = sharding.make_mesh(sharding.MeshConfig(), jax.devices()[:1])
  shaped = ml_collections.ConfigDict({"rl": {"engine_mesh": "colocated",
                                             "engine_mesh_shape": "tensor=2"}})
  with pytest.raises(ValueError, match="rl.engine_mesh_shape='tensor=2': .*1 devices are not"):
    rollouts.engine_mesh(shaped, one)
  shaped.rl.engine_mesh_shape = "tensor=1"
  assert dict(rollouts.engine_mesh(shaped, one).shape) == dict(one.shape)


# ---------------------------------------------------------------------------- the subprocess

def _main() -> None:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")
  import re
  import time
  import types

  import jax
  import ml_collections
  import numpy as np
  from flax import nnx

  from envs.policy import SamplingParams
  from models import expert_parallel, sharding, transformer
  from models.engine import Engine, EngineConfig, programs
  from tests.conftest import TINY_DENSE, TINY_MOE_MLA
  from trainer import rollouts

  devices = jax.devices()
  assert len(devices) == 8
  # colocated: the trainer's fsdp 8 devices laid out anew for decoding (rl.engine_mesh_shape)
  trainer_8 = sharding.make_mesh(sharding.MeshConfig(fsdp=8))
  colocated = rollouts.decode_mesh(ml_collections.ConfigDict(
      {"rl": {"engine_mesh_shape": "tensor=2,expert=2"}}), trainer_8)
  assert dict(colocated.shape) == {"data": 1, "fsdp": 2, "tensor": 2, "expert": 2,
                                   "sequence": 1}
  assert list(colocated.devices.flat) == list(trainer_8.devices.flat)
  engine_mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1, tensor=2, expert=2),
                                   devices[4:])
  trainer_mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=4), devices[:4])

  def models(cfg):
    old, new = transformer.init(cfg, seed=0), transformer.init(cfg, seed=1)
    if cfg.is_moe:  # a non-zero selection bias
      for m, key in ((old, 7), (new, 8)):
        bias = m.moe_layers.mlp.router_bias
        bias[...] = 0.1 * jax.random.normal(jax.random.key(key), bias[...].shape)
    return old, new

  greedy = SamplingParams(max_tokens=6, temperature=0)
  def seeded(seed):
    return SamplingParams(max_tokens=6, temperature=1.0, top_k=20, seed=seed)

  def compare(ref, out, diffs):
    for a, b in zip(ref, out):
      assert a.output_ids == b.output_ids, (a.output_ids, b.output_ids)
      assert a.token_versions == b.token_versions and a.cached_tokens == b.cached_tokens
      assert a.finish_reason == b.finish_reason
      diffs["logprob_diff"] = max(diffs["logprob_diff"], float(np.abs(
          np.array(a.logprobs) - np.array(b.logprobs)).max()))
      diffs["entropy_diff"] = max(diffs["entropy_diff"], float(np.abs(
          np.array(a.entropies) - np.array(b.entropies)).max()))
      assert [[i for i, _ in t] for t in a.top_logprobs] == \
          [[i for i, _ in t] for t in b.top_logprobs]
      top = np.abs(np.array([[v for _, v in t] for t in a.top_logprobs]) -
                   np.array([[v for _, v in t] for t in b.top_logprobs])).max()
      assert top <= 1e-5, top
      if a.expert_ids is not None:
        assert np.array_equal(a.expert_ids, b.expert_ids)

  def run(engine, prompts, params, update=None):
    """Submits, steps once, applies `update` (a callable) and steps to the end."""
    futures = [engine.submit(x, p) for x, p in zip(prompts, params)]
    for i in range(10_000):
      if all(f.done() for f in futures):
        break
      if i == 1 and update is not None:
        update()
      engine.step()
    return [f.result() for f in futures]

  def spy(name, texts):
    """Captures the compiled HLO of the program's first call."""
    jitted = getattr(programs, name)
    def call(*args, **kwargs):
      if name not in texts:
        texts[name] = jitted.lower(*args, **kwargs).compile().as_text()
      return jitted(*args, **kwargs)
    return jitted, call

  def check_layout(engine):
    lay = engine.layout
    want = lay.shardings(engine.weights)
    for a, s in zip(jax.tree.leaves(engine.weights), jax.tree.leaves(want)):
      assert a.sharding.is_equivalent_to(s, a.ndim), (a.sharding, s)
    for a, s in zip(jax.tree.leaves(engine._pool.caches),
                    jax.tree.leaves(engine._pool._shardings)):
      assert a.sharding.is_equivalent_to(s, a.ndim), (a.sharding, s)

  cases = {}
  for cfg_name, cache, deploy in (("dense", "contiguous", "colocated"),
                                  ("moe", "paged", "colocated"),
                                  ("moe", "contiguous", "disaggregated"),
                                  ("dense", "paged", "disaggregated")):
    t0 = time.time()
    cfg = TINY_DENSE if cfg_name == "dense" else TINY_MOE_MLA
    old, new = models(cfg)
    ec = EngineConfig(slots=4, max_seq_len=48, prefix_cache_rows=4, steps_per_call=4,
                      prefill_chunk=16, prefill_bucket=16, top_logprobs=2, min_prefix=2,
                      return_expert_ids=cfg.is_moe, cache=cache, page_size=8,
                      on_update="resubmit")
    mesh = colocated if deploy == "colocated" else engine_mesh
    ref, eng = Engine(old, ec), Engine(old, ec, mesh=mesh)
    if cfg.is_moe:  # the decode layout's tokens take the expert-parallel dispatch
      with jax.set_mesh(mesh):
        plan = expert_parallel.plan(eng.layout.cfg)
      assert plan is not None and "expert" in plan.token_axes, plan
    diffs = {"logprob_diff": 0.0, "entropy_diff": 0.0}
    # turn 1: two prompts and their extensions, greedy and seeded
    a, b = list(range(1, 7)), [20, 21, 22, 23]
    prompts = [a, a + [7, 8], b, b + [24, 25, 26]]
    params = [greedy, seeded(1), seeded(2), greedy]
    texts = {}
    program = "decode" if cache == "contiguous" else "decode_paged"
    outs = [run(ref, prompts, params)]
    jitted, call = spy(program, texts)
    setattr(programs, program, call) if deploy == "colocated" else None
    try:
      outs.append(run(eng, prompts, params))
    finally:
      setattr(programs, program, jitted)
    compare(*outs, diffs)
    # turn 2: each conversation goes on (prefix hits)
    turn2 = [p + o.output_ids + [30, 31] for p, o in zip(prompts, outs[0])]
    compare(*[run(e, turn2, params) for e in (ref, eng)], diffs)
    for e in (ref, eng):
      assert e.counters["cache_hits"] >= 4, e.counters
    # a weight update mid-run, from the trainer's layout
    trainer = trainer_8 if deploy == "colocated" else trainer_mesh
    placed = sharding.shard_model(new, trainer)  # `new`'s values, FSDP-sharded
    assert any("fsdp" in str(v.sharding.spec) for v in jax.tree.leaves(nnx.state(placed)))
    def update_mesh():
      with jax.transfer_guard("disallow"):
        eng.update_params(placed if cache == "contiguous" else nnx.state(placed), version=1)
    outs = [run(ref, prompts, params, lambda: ref.update_params(new, version=1)),
            run(eng, prompts, params, update_mesh)]
    compare(*outs, diffs)
    assert any(len(set(o.token_versions)) == 2 for o in outs[1]), "no request straddled"
    assert eng.counters["resubmitted"] > 0
    check_layout(eng)
    if cache == "paged":  # the pages are split over the batch shards, prefixes copied across
      assert eng._pool.shards == eng.layout.shards > 1
      for a in jax.tree.leaves(eng._pool.caches):
        axes = a.sharding.spec[1]
        assert (axes if isinstance(axes, tuple) else (axes,)) == eng.layout.batch_axes, axes
      diffs["shard_copies"] = eng.counters["shard_copies"]
      if eng.layout.shards == ec.slots:  # one slot per shard: the samples of a prompt and
        assert eng.counters["shard_copies"] > 0, eng.counters  # its next turn spread out
    if texts:  # the compiled decode call keeps the pool where it is
      hlo = texts[program]
      pool = [a.shape for a in jax.tree.leaves(eng._pool.caches)]
      weights = {a.shape for a in jax.tree.leaves(eng.weights) if a.ndim >= 2}
      gathered = re.findall(r"= \w+\[([\d,]*)\][^\n]*? all-gather\(", hlo)
      for dims in gathered:
        shape = tuple(int(d) for d in dims.split(",") if d)
        assert shape not in pool, f"{program} all-gathers a whole cache pool {shape}"
        assert shape not in weights, f"{program} all-gathers a weight {shape}"
      if cfg.is_moe:
        assert "all-to-all" in hlo, "the MoE decode did not take the expert-parallel dispatch"
    diffs["seconds"] = round(time.time() - t0, 1)
    cases[f"{cfg_name}/{cache}/{deploy}"] = diffs
    print(cfg_name, cache, deploy, diffs, flush=True)

  # a quantized engine: the update is quantized on the trainer's devices, then placed
  old, new = models(TINY_DENSE)
  eng = Engine(old, EngineConfig(slots=4, max_seq_len=32, weight_qtype="int8"),
               mesh=engine_mesh)
  placed = sharding.shard_model(new, trainer_mesh)
  with jax.transfer_guard("disallow"):
    eng.update_params(placed, version=1)
  out = eng.generate([[1, 2, 3]], greedy)[0]
  assert out.token_versions == [1] * 6
  check_layout(eng)

  # validation errors name the field
  errors = 0
  tiny = types.SimpleNamespace(cfg=TINY_DENSE)
  for model, config, mesh, message in (
      (tiny, EngineConfig(slots=6), colocated, "EngineConfig.slots=6"),
      (tiny, EngineConfig(slots=8), sharding.make_mesh(sharding.MeshConfig(fsdp=1, tensor=8)),
       "ModelConfig.num_heads=4"),
      (tiny, EngineConfig(slots=8), jax.sharding.Mesh(np.array(devices), ("x",)),
       "Engine\\(mesh=...\\): mesh axes"),
  ):
    try:
      Engine(model, config, mesh=mesh)
    except ValueError as e:
      assert re.search(message, str(e)), e
      errors += 1
  moe6 = types.SimpleNamespace(cfg=TINY_MOE_MLA.replace(num_experts=6, n_group=2))
  try:
    Engine(moe6, EngineConfig(slots=8), mesh=colocated.__class__(
        np.array(devices[:4]).reshape(1, 1, 1, 4, 1), sharding.MESH_AXES))
  except ValueError as e:
    assert "ModelConfig.num_experts=6" in str(e), e
    errors += 1
  else:
    raise AssertionError("num_experts=6 over expert=4 accepted")
  print(json.dumps({"cases": cases, "errors": errors}))


if __name__ == "__main__":
  sys.exit(_main())
