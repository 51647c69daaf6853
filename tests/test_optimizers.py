"""trainer/optim: Muon against a NumPy reference, parameter routing, schedules, configuration
errors, the bf16 state, and (in a subprocess) sharded optimizer state. QK-Clip:
tests/test_qk_clip.py."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.base import base_config
from models import transformer
from tests.conftest import TINY_DENSE, TINY_MOE_MLA, run_check
from trainer import optim


def opt_config(**changes):
  cfg = base_config().optimizer
  cfg.schedule = "constant"
  for key, value in changes.items():
    node = cfg
    *head, last = key.split(".")
    for h in head:
      node = node[h]
    node[last] = value
  return optim.OptimizerConfig.from_config(cfg)


# ----------------------------------------------------------------------------- 1. Muon math

NS = (3.4445, -4.7750, 2.0315)


def newton_schulz_np(x):
  """KellerJordan's quintic iteration on one [fan_in, fan_out] matrix (float64)."""
  a, b, c = NS
  transposed = x.shape[0] > x.shape[1]
  if transposed:
    x = x.T
  x = x / (np.linalg.norm(x) + 1e-8)
  for _ in range(5):
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x.T if transposed else x


class MuonNumpy:
  """optax's documented Muon momentum: EMA m ← βm + (1−β)g, bias-corrected, Nesterov
  m̂ = β·m/(1−β^(t+1)) + (1−β)·g/(1−β^t); update = −lr·(scale·NS(m̂) + λ·W)."""

  def __init__(self, shape, beta, lr, wd, scale, to_matrices, from_matrices):
    self.m = np.zeros(shape)
    self.t = 0
    self.beta, self.lr, self.wd, self.scale = beta, lr, wd, scale
    self.to_matrices, self.from_matrices = to_matrices, from_matrices

  def update(self, g, w):
    b = self.beta
    self.t += 1
    self.m = b * self.m + (1 - b) * g
    m_hat = b * self.m / (1 - b ** (self.t + 1)) + (1 - b) * g / (1 - b ** self.t)
    o = self.from_matrices(np.stack([newton_schulz_np(x) for x in self.to_matrices(m_hat)]))
    return -self.lr * (self.scale * o + self.wd * w)


class AdamWNumpy:
  def __init__(self, shape, b1, b2, eps, lr, wd):
    self.m, self.v, self.t = np.zeros(shape), np.zeros(shape), 0
    self.b1, self.b2, self.eps, self.lr, self.wd = b1, b2, eps, lr, wd

  def update(self, g, w):
    self.t += 1
    self.m = self.b1 * self.m + (1 - self.b1) * g
    self.v = self.b2 * self.v + (1 - self.b2) * g * g
    m_hat = self.m / (1 - self.b1 ** self.t)
    v_hat = self.v / (1 - self.b2 ** self.t)
    return -self.lr * (m_hat / (np.sqrt(v_hat) + self.eps) + self.wd * w)


@pytest.mark.parametrize("scale_rule", ["moonlight", "keller"])
def test_muon_matches_numpy(scale_rule):
  """A 2-D hidden matrix [24, 40] and a per-expert stack [3 experts, 40 in, 24 out] against
  NumPy over 3 steps (momentum, bias correction, Nesterov, NS, scale, decoupled decay), plus
  the AdamW leaf (embedding, β2 = 0.95)."""
  cfg = opt_config(name="muon", learning_rate=0.05, weight_decay=0.1, grad_clip_norm=0.0,
                   **{"muon.scale_rule": scale_rule})
  routes = [optim.route(cfg, ("w",), (24, 40), ("embed", "mlp"), dense_in=1),
            optim.route(cfg, ("experts",), (3, 40, 24), ("experts", "expert_mlp", "embed")),
            optim.route(cfg, ("embed",), (10, 24), ("vocab", "embed"))]
  assert [r.optimizer for r in routes] == ["muon", "muon", "adamw"]
  assert routes[1].batch_axes == (0,)
  tx = optim.make_tx(cfg, routes)
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(24, 40)), "experts": rng.normal(size=(3, 40, 24)),
            "embed": rng.normal(size=(10, 24))}
  if scale_rule == "moonlight":
    scales = {"w": 0.2 * math.sqrt(40), "experts": 0.2 * math.sqrt(40)}
  else:  # sqrt(max(1, fan_out / fan_in))
    scales = {"w": math.sqrt(40 / 24), "experts": 1.0}
  assert routes[0].scale == pytest.approx(scales["w"])
  assert routes[1].scale == pytest.approx(scales["experts"])
  refs = {
      "w": MuonNumpy((24, 40), 0.95, 0.05, 0.1, scales["w"], lambda x: x[None], lambda x: x[0]),
      "experts": MuonNumpy((3, 40, 24), 0.95, 0.05, 0.1, scales["experts"], list, np.asarray),
      "embed": AdamWNumpy((10, 24), 0.9, 0.95, 1e-8, 0.05, 0.1)}
  p32 = {k: np.asarray(v, np.float32) for k, v in params.items()}
  state = jax.jit(tx.init)(p32)
  step = jax.jit(tx.update)
  for _ in range(3):
    grads = {k: rng.normal(size=v.shape) for k, v in params.items()}
    updates, state = step({k: g.astype(np.float32) for k, g in grads.items()}, state, p32)
    for k in params:
      want = refs[k].update(grads[k], p32[k].astype(np.float64))
      got = np.asarray(updates[k], np.float64)
      err = np.abs(got - want).max() / np.abs(want).max()
      assert err <= 1e-5, (k, err)
    p32 = {k: p32[k] + np.asarray(updates[k]) for k in p32}


# ----------------------------------------------------------------------------- 2. routing

def test_routing_moe_mla(capsys):
  opt = optim.build(opt_config(name="muon"), TINY_MOE_MLA)
  rows = opt.table  # the data behind the start-up table
  by = {r.name: r for r in rows}
  abstract = nnx.as_pure(nnx.state(transformer.abstract(TINY_MOE_MLA), nnx.Param))
  leaves = {"/".join(optim.path_names(p)) for p, _ in jax.tree.leaves_with_path(abstract)}
  assert set(by) == leaves and len(rows) == len(leaves)
  adamw = {n for n, r in by.items() if r.optimizer == "adamw"}
  muon = {n for n, r in by.items() if r.optimizer == "muon"}
  # embeddings, lm_head, norm gains, router weights -> AdamW; nothing else
  assert by["embed"].role == "embedding" and by["lm_head"].role == "lm_head"
  norms = {n for n in by if n.endswith("/scale")}
  assert norms and all(by[n].role == "norm" for n in norms)
  assert adamw == {"embed", "lm_head", "moe_layers/mlp/router"} | norms
  # hidden matrices and expert stacks -> Muon with explicit dimension numbers
  for n in muon:
    assert by[n].dims is not None and by[n].scale == pytest.approx(
        0.2 * math.sqrt(max(math.prod(by[n].shape[i] for i in by[n].dims.reduction_axis),
                            math.prod(by[n].shape[i] for i in by[n].dims.output_axis))))
  def dims(name):
    r = by[name]
    return tuple(r.dims.reduction_axis), tuple(r.dims.output_axis), r.batch_axes
  for e in ("gate_proj", "up_proj", "down_proj"):  # per expert (and per layer)
    assert by[f"moe_layers/mlp/{e}"].role == "experts"
    assert dims(f"moe_layers/mlp/{e}") == ((2,), (3,), (0, 1))
  assert dims("moe_layers/mlp/shared/down_proj/kernel") == ((1,), (2,), (0,))
  assert dims("dense_layers/mlp/gate_proj/kernel") == ((1,), (2,), (0,))
  # attention projections as whole matrices by default
  assert dims("moe_layers/attn/q_b_proj/kernel") == ((1,), (2, 3), (0,))
  assert dims("moe_layers/attn/kv_b_proj/kernel") == ((1,), (2, 3), (0,))
  assert dims("moe_layers/attn/o_proj/kernel") == ((1, 2), (3,), (0,))
  assert dims("moe_layers/attn/kv_a_proj/kernel") == ((1,), (2,), (0,))
  assert muon == set(by) - adamw
  assert not by["moe_layers/attn_norm/scale"].weight_decay
  assert by["embed"].weight_decay and not by["final_norm/scale"].weight_decay
  text = optim.print_table(opt)
  assert text in capsys.readouterr().out
  assert all(n in text for n in by) and "use Muon" in text

  # per-head option: heads become batch axes; routing otherwise the same
  per_head = {r.name: r for r in optim.routing_table(
      opt_config(name="muon", **{"muon.per_head_attention": True}), TINY_MOE_MLA)}
  r = per_head["moe_layers/attn/q_b_proj/kernel"]
  assert (tuple(r.dims.reduction_axis), tuple(r.dims.output_axis), r.batch_axes) == \
      ((1,), (3,), (0, 2))
  r = per_head["moe_layers/attn/o_proj/kernel"]
  assert (tuple(r.dims.reduction_axis), tuple(r.dims.output_axis), r.batch_axes) == \
      ((2,), (3,), (0, 1))
  assert r.scale == pytest.approx(0.2 * math.sqrt(64))  # per-head [16, 64] matrix
  # norm-gain decay (Moonlight) is an option
  decayed = {r.name: r.weight_decay for r in optim.routing_table(
      opt_config(name="muon", weight_decay_norms=True), TINY_MOE_MLA)}
  assert decayed["final_norm/scale"] and decayed["moe_layers/attn/q_a_norm/scale"]


def test_routing_dense_biases_and_adamw():
  rows = {r.name: r for r in optim.routing_table(opt_config(name="muon"), TINY_DENSE)}
  biases = [n for n in rows if n.endswith("/bias")]
  assert len(biases) == 3
  assert all(rows[n].optimizer == "adamw" and rows[n].role == "bias"
             and not rows[n].weight_decay for n in biases)
  assert rows["dense_layers/attn/k_proj/kernel"].optimizer == "muon"
  assert rows["dense_layers/attn/k_proj/kernel"].dims.output_axis == (2, 3)
  # keller: sqrt(max(1, fan_out / fan_in)); q_proj [64 -> 4*16] = 1, gate [64 -> 96]
  keller = {r.name: r for r in optim.routing_table(
      opt_config(name="muon", **{"muon.scale_rule": "keller"}), TINY_DENSE)}
  assert keller["dense_layers/mlp/gate_proj/kernel"].scale == pytest.approx(math.sqrt(96 / 64))
  assert keller["dense_layers/mlp/down_proj/kernel"].scale == pytest.approx(1.0)
  assert all(r.optimizer == "adamw" for r in optim.routing_table(opt_config(name="adamw"),
                                                                 TINY_DENSE))
  with pytest.raises(ValueError, match="no rule for parameter foo"):
    optim.route(opt_config(), ("foo",), (3, 4), ("embed", "mlp"))


def test_config_errors_and_schedules():
  with pytest.raises(ValueError, match=r"optimizer.name='sgd'"):
    opt_config(name="sgd")
  with pytest.raises(ValueError, match=r"optimizer.muon.scale_rule"):
    opt_config(**{"muon.scale_rule": "x"})
  with pytest.raises(ValueError, match="unknown field"):
    optim.OptimizerConfig.from_config({"nme": "adamw"})
  with pytest.raises(ValueError, match="total_steps"):
    opt_config(schedule="cosine", warmup_steps=10, total_steps=10)
  with pytest.raises(ValueError, match="qk_clip.tau"):
    opt_config(**{"qk_clip.tau": 0.0})
  # QK-Clip on a q/k-norm model fails at start-up and says why
  with pytest.raises(ValueError, match="qk_norm"):
    optim.build(opt_config(name="muon_clip"), TINY_DENSE.replace(qk_norm=True))
  optim.build(opt_config(name="muon"), TINY_DENSE.replace(qk_norm=True))  # fine without the clip

  def lr(**kw):
    cfg = opt_config(learning_rate=1.0, warmup_steps=10, total_steps=110, end_lr_ratio=0.1, **kw)
    f = optim.schedule(cfg)
    return [float(f(s)) for s in (0, 9, 10, 60, 109, 200)]
  np.testing.assert_allclose(lr(schedule="constant"), [0.1, 1, 1, 1, 1, 1], rtol=1e-6)
  np.testing.assert_allclose(lr(schedule="linear"), [0.1, 1, 1, 0.55, 0.109, 0.1], rtol=1e-5)
  cos = lr(schedule="cosine")
  np.testing.assert_allclose(cos[:4] + cos[5:], [0.1, 1, 1, 0.55, 0.1], rtol=1e-5)
  # wsd: stable until the last 20% (88 of 110 steps), then linear to 0.1
  np.testing.assert_allclose(lr(schedule="wsd", wsd_decay_fraction=0.2),
                             [0.1, 1, 1, 1, 1 - 0.9 * 21 / 22, 0.1], rtol=1e-5)


# ----------------------------------------------------------------------------- 3. state dtype

def test_bf16_state():
  cfg = opt_config(name="muon", state_dtype="bfloat16")
  routes = [optim.route(cfg, ("w",), (8, 12), ("embed", "mlp"), dense_in=1),
            optim.route(cfg, ("embed",), (10, 8), ("vocab", "embed"))]
  tx = optim.make_tx(cfg, routes)
  params = {"w": np.ones((8, 12), np.float32), "embed": np.ones((10, 8), np.float32)}
  state = jax.jit(tx.init)(params)
  dtypes = {str(x.dtype) for x in jax.tree.leaves(state) if x.ndim >= 2}
  assert dtypes == {"bfloat16"}
  assert any(x.dtype == jnp.float32 and x.shape == (3,) for x in jax.tree.leaves(state))  # NS


# ----------------------------------------------------------------------------- 4. sharding

def test_sharded_optimizer_state_and_step():
  stdout = run_check("optimizer_sharding_check", timeout=900)
  assert stdout.count("ok ") == 3, stdout
