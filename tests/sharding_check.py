"""Run in a subprocess with 8 simulated CPU devices (tests/test_sharding.py): a jitted forward
with rule-derived shardings equals the single-device forward, and parameters are sharded."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from models import sharding, transformer  # noqa: E402
from tests.conftest import TINY_DENSE, TINY_MOE_MLA  # noqa: E402


def spec_of(model, *path):
  node = nnx.state(model)
  for key in path:
    node = node[key]
  return node[...].sharding.spec


def check(cfg, mesh_cfg, expect):
  assert len(jax.devices()) == 8
  mesh = sharding.make_mesh(mesh_cfg)
  model = transformer.init_sharded(cfg, mesh, seed=0)
  for path, want in expect:
    got = spec_of(model, *path)
    assert got == want, (path, got, want)
  # the same parameters gathered onto one device
  ref_model = nnx.merge(nnx.graphdef(model), jax.device_put(nnx.state(model), jax.devices()[0]))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (8, 32)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(32), tokens.shape)
  end = jnp.full(tokens.shape, 32, jnp.int32)
  ref, ref_aux = nnx.jit(lambda m, *a: m(*a))(ref_model, tokens, positions, end)
  with jax.set_mesh(mesh):
    bs = sharding.batch_sharding(cfg, mesh)
    args = [jax.device_put(a, bs) for a in (tokens, positions, end)]
    out, aux = nnx.jit(lambda m, *a: m(*a))(model, *args)
  assert len(out.sharding.device_set) == 8
  err = float(np.abs(np.asarray(out) - np.asarray(ref)).max())
  assert err <= 1e-5, err
  np.testing.assert_allclose(aux["max_logits"], ref_aux["max_logits"], rtol=1e-5, atol=1e-5)
  print(f"ok {mesh_cfg} max|Δlogits|={err:.2e}")


P = jax.sharding.PartitionSpec
check(TINY_DENSE, sharding.MeshConfig(data=2, fsdp=2, tensor=2),
      [(("embed",), P("tensor", "fsdp")),
       (("dense_layers", "attn", "q_proj", "kernel"), P(None, "fsdp", "tensor", None)),
       (("dense_layers", "mlp", "down_proj", "kernel"), P(None, "tensor", "fsdp")),
       (("lm_head",), P("fsdp", "tensor"))])
check(TINY_MOE_MLA, sharding.MeshConfig(data=2, fsdp=2, tensor=1, expert=2),
      [(("moe_layers", "mlp", "gate_proj"), P(None, "expert", "fsdp", None)),
       (("moe_layers", "mlp", "down_proj"), P(None, "expert", None, "fsdp")),
       (("moe_layers", "mlp", "router"), P(None, "fsdp", "expert")),
       (("moe_layers", "attn", "kv_b_proj", "kernel"), P(None, None, None, None))])
