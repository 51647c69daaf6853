"""Run in a subprocess with 8 simulated CPU devices (tests/test_optimizers.py): Newton–Schulz in
a leaf's own layout equals optax's on one device for layouts that split the matrices, the batch
dimensions, both, or one dimension over two mesh axes; the MuonClip optimizer state of a tiny
MoE + MLA model is created with the parameters' shardings, and two sharded optimizer steps
equal the same steps on one device, moving matrices with all-to-alls, never gathering a stack."""

import os
import re

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from models import sharding, transformer  # noqa: E402
from tests.conftest import TINY_MOE_MLA  # noqa: E402
from trainer import optim  # noqa: E402
from optax.contrib import MuonDimensionNumbers  # noqa: E402
from optax.contrib._muon import orthogonalize_via_newton_schulz  # noqa: E402
from trainer.optim.optimizer import NS_COEFFS  # noqa: E402
from trainer.optim.transforms import orthogonalize_in_layout  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
P = jax.sharding.PartitionSpec


def check_layouts():
  """orthogonalize_in_layout == optax's Newton–Schulz on one device, for each layout."""
  mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=2, tensor=2, expert=2))
  rng = np.random.default_rng(1)
  coeffs = np.asarray([NS_COEFFS], np.float32)
  cases = [  # shape, Muon dims, layout
      ((3, 4, 16, 8), MuonDimensionNumbers(2, 3), P(None, "expert", "fsdp", "tensor")),
      ((5, 12, 8), MuonDimensionNumbers(1, 2), P(None, "fsdp", "tensor")),  # 5 -> 8 padded
      ((16, 8), MuonDimensionNumbers(0, 1), P(("fsdp", "expert"), "tensor")),  # one matrix
      ((8, 4, 6), MuonDimensionNumbers(0, (1, 2)), P("fsdp", "tensor", None)),  # m x (h, d)
      ((4, 6, 10), MuonDimensionNumbers(1, 2), P(("expert", "fsdp"), None, None)),  # batch only
  ]
  with jax.set_mesh(mesh):
    for shape, dims, spec in cases:
      x = rng.normal(size=shape).astype(np.float32)
      want = jax.jit(lambda a: orthogonalize_via_newton_schulz(a, coeffs, 5, dimension_numbers=dims)
                     )(x)
      sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
      got = jax.jit(lambda a: orthogonalize_in_layout(a, dims, spec, mesh, coeffs, 5))(sharded)
      assert got.sharding.spec == spec, (got.sharding, spec)
      err = float(np.abs(np.asarray(got) - np.asarray(want)).max())
      assert err < 1e-5, (shape, spec, err)
  print(f"ok Newton-Schulz in {len(cases)} layouts == optax on one device")


def main():
  assert len(jax.devices()) == 8
  check_layouts()
  # all layers MoE (one stack: half the leaves of TINY_MOE_MLA, half the compile time)
  cfg = TINY_MOE_MLA.replace(num_layers=2, first_k_dense_replace=0)
  mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=2, tensor=2, expert=2))
  model = transformer.init(cfg, seed=0)
  abstract = nnx.state(transformer.abstract(cfg), nnx.Param)
  param_shardings = nnx.as_pure(sharding.state_shardings(abstract, cfg, mesh))
  host_params = nnx.as_pure(nnx.state(model, nnx.Param))
  params = jax.device_put(host_params, param_shardings)

  opt = optim.build(optim.OptimizerConfig.from_config(dict(
      name="muon_clip", learning_rate=1e-2, schedule="constant", weight_decay=0.1,
      grad_clip_norm=1.0, qk_clip={"tau": 1.0})), cfg, params)
  state_shardings = opt.state_shardings(params, param_shardings)
  state = opt.init_sharded(params, param_shardings)

  # every parameter-shaped state leaf carries its parameter's sharding
  by_path = {optim.path_names(p): s for p, s in jax.tree.leaves_with_path(
      param_shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))}
  matched = 0
  for path, leaf in jax.tree.leaves_with_path(state):
    want = by_path.get(optim.param_suffix(path))
    if want is not None and leaf.ndim:
      assert leaf.sharding.spec == want.spec, (jax.tree_util.keystr(path), leaf.sharding, want)
      matched += 1
  expected = sum(1 if r.optimizer == "muon" else 2 for r in opt.table)  # mu | mu, nu
  assert matched == expected, (matched, expected)
  # explicit examples: Muon momentum of an expert stack, AdamW moments of the embedding
  mu = [leaf for path, leaf in jax.tree.leaves_with_path(state)
        if optim.param_suffix(path) == ("moe_layers", "mlp", "gate_proj")]
  assert mu and all(x.sharding.spec == P(None, "expert", "fsdp", "tensor") for x in mu), \
      [x.sharding.spec for x in mu]
  emb = [leaf for path, leaf in jax.tree.leaves_with_path(state)
         if optim.param_suffix(path) == ("embed",)]
  assert len(emb) == 2 and all(x.sharding.spec == P("tensor", "fsdp") for x in emb)
  print(f"ok state shardings: {matched} state leaves carry their parameter's sharding")

  rng = np.random.default_rng(0)
  grads = [jax.tree.map(lambda p: np.asarray(rng.normal(size=p.shape), np.float32),
                        host_params) for _ in range(2)]
  max_logits = [np.asarray(rng.uniform(0.2, 3.0, (cfg.num_layers, cfg.num_heads)), np.float32)
                for _ in range(2)]
  assert all((m > 1.0).any() and (m <= 1.0).any() for m in max_logits)

  def run(step, params, state, put_grads, put_logits):
    for g, m in zip(grads, max_logits):
      params, state = step(put_grads(g), state, params, put_logits(m))
    return params, state

  replicated = jax.sharding.NamedSharding(mesh, P())
  with jax.set_mesh(mesh):
    sharded_step = jax.jit(opt.apply, out_shardings=(param_shardings, state_shardings))
    hlo = sharded_step.lower(params, state, params, jax.ShapeDtypeStruct(
        (cfg.num_layers, cfg.num_heads), np.float32)).compile().as_text()
  # matrices move whole by all-to-all; no all-gather returns a whole expert stack
  assert "all-to-all" in hlo
  gate = next(r for r in opt.table if r.path == ("moe_layers", "mlp", "gate_proj"))
  whole = "[" + ",".join(map(str, gate.shape)) + "]"
  gathers = [line for line in hlo.splitlines() if re.search(r"= f32\[[\d,]+\]\S* all-gather", line)]
  assert not any(whole in line.split("all-gather")[0] for line in gathers), gathers[:3]
  with jax.set_mesh(mesh):
    p_sh, s_sh = run(sharded_step, params, state, lambda g: jax.device_put(g, param_shardings),
                     lambda m: jax.device_put(m, replicated))
  dev = jax.devices()[0]
  on_dev = lambda x: jax.device_put(x, dev)  # noqa: E731
  state_one = on_dev(jax.jit(opt.init)(host_params))  # committed, so step 2 reuses step 1's code
  p_one, s_one = run(jax.jit(opt.apply), on_dev(host_params), state_one, on_dev, on_dev)
  worst = 0.0
  for a, b in zip(jax.tree.leaves((p_sh, s_sh)), jax.tree.leaves((p_one, s_one))):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = float(np.abs(a - b).max()) / max(1.0, float(np.abs(b).max())) if a.size else 0.0
    worst = max(worst, err)
  assert worst <= 1e-5, worst
  for path, leaf in jax.tree.leaves_with_path(p_sh):
    assert leaf.sharding.spec == by_path[optim.path_names(path)].spec
  clipped = int(optim.metrics(opt, s_sh)["qk_clipped_heads"])
  assert clipped == int((max_logits[-1] > 1.0).sum()), clipped
  print(f"ok sharded step == single-device step (2 steps, max rel diff {worst:.1e}, "
        f"{clipped} heads clipped)")


if __name__ == "__main__":
  main()
