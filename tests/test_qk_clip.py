"""trainer/optim/qk_clip.py: the QK-Clip transformation on its own (state, identity under τ, the
rule on params + updates, jit, chaining with its extra argument, errors), then through the
optimizer on MLA and GQA models, where a forward pass checks that clipped heads land on τ."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models import transformer
from tests.conftest import TINY_DENSE, TINY_MOE_MLA
from tests.test_optimizers import opt_config
from trainer import optim
from trainer.optim.qk_clip import QKClipState, qk_clip


def pure_params(model):
  return nnx.as_pure(nnx.state(model, nnx.Param))


def random_params(cfg, seed):
  """Random fp32 pure parameters shaped like `cfg`'s (no model is initialised)."""
  shapes = pure_params(transformer.abstract(cfg))
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape), jnp.float32), shapes)


# ----------------------------------------------------------------------------- 1. transformation

def test_qk_clip_transformation():
  """GQA (4 query heads in 2 groups, q/k biases): an update with every head under τ is the
  identity; one head over τ gets W'' = (params + updates)·factor on its query head and its
  group's key head, every other leaf keeps its update bit for bit."""
  cfg, tau = TINY_DENSE, 10.0
  tx = qk_clip(cfg, tau=tau, alpha=0.5)
  params, updates = random_params(cfg, 0), random_params(cfg, 1)
  state = tx.init(params)
  assert isinstance(state, QKClipState)
  assert state.clipped_heads.dtype == jnp.int32 and int(state.clipped_heads) == 0
  assert state.max_logit.dtype == jnp.float32 and float(state.max_logit) == 0.0

  update = jax.jit(tx.update)
  under = np.full((cfg.num_layers, cfg.num_heads), 0.5 * tau, np.float32)
  new, state = update(updates, state, params, max_logits=under)
  assert all(same(a, b) for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(updates)))
  assert int(state.clipped_heads) == 0 and float(state.max_logit) == 0.5 * tau

  over = under.copy()
  over[1, 3] = 4 * tau  # layer 1, query head 3: group 1 = query heads {2, 3}, key head 1
  new, state = update(updates, state, params, max_logits=over)
  assert int(state.clipped_heads) == 1 and float(state.max_logit) == 4 * tau
  g = tau / over[1, 3]
  kappa = g ** 0.5  # (min γ of the group)^(1 − α)
  want = {("q_proj", 3): g / kappa, ("q_proj", 2): 1 / kappa, ("k_proj", 1): kappa}
  for path, u in jax.tree.leaves_with_path(updates):
    names = optim.path_names(path)
    u, got = np.asarray(u), np.asarray(_get(new, names))
    if len(names) < 2 or names[-2] not in ("q_proj", "k_proj"):  # v, o, MLP, norms, embed
      assert same(got, u), names
      continue
    p = np.asarray(_get(params, names))
    for head in range(u.shape[-2]):
      factor = want.get((names[-2], head))
      if factor is None:  # the other group: its updates unchanged
        assert same(got[..., head, :], u[..., head, :]), (names, head)
        continue
      assert same(got[0, ..., head, :], u[0, ..., head, :]), (names, head)  # layer 0
      np.testing.assert_allclose(p[1, ..., head, :] + got[1, ..., head, :],
                                 (p[1, ..., head, :] + u[1, ..., head, :]) * factor,
                                 rtol=1e-6, atol=1e-5)

  # an optax.chain passes the extra argument through
  chained = optax.chain(optax.identity(), qk_clip(cfg, tau=tau, alpha=0.5))
  new_chained, _ = jax.jit(chained.update)(updates, chained.init(params), params,
                                           max_logits=over)
  assert all(same(a, b) for a, b in zip(jax.tree.leaves(new_chained), jax.tree.leaves(new)))

  with pytest.raises(ValueError, match="needs params"):
    tx.update(updates, state, None, max_logits=under)
  with pytest.raises(ValueError, match="needs this step's max_logits"):
    tx.update(updates, state, params)
  with pytest.raises(ValueError, match=r"max_logits has shape \(1, 4\)"):
    tx.update(updates, state, params, max_logits=under[:1])


# ----------------------------------------------------------------------------- 2. in the optimizer

def max_logits_fn(model):
  """Jitted (pure params, tokens) -> aux["max_logits"] [layers, heads] of a causal forward."""
  graphdef, _, rest = nnx.split(model, nnx.Param, ...)

  @jax.jit
  def fn(params, tokens):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    end = jnp.full(tokens.shape, tokens.shape[1], jnp.int32)
    _, aux = nnx.merge(graphdef, params, rest)(tokens, positions, end)
    return aux["max_logits"]
  return fn


def force_heads(params, cfg, layer, heads, factors):
  """Scale the chosen heads' query weights (and biases) so their logits scale by `factors`."""
  stack, i = ("dense_layers", layer) if layer < cfg.num_dense_layers else \
      ("moe_layers", layer - cfg.num_dense_layers)
  name = "q_proj" if cfg.attention == "gqa" or cfg.q_lora_rank is None else "q_b_proj"
  params = jax.tree.map(lambda x: x, params)  # a copy of the tree structure
  attn = params[stack]["attn"][name]
  for part in ("kernel", "bias"):
    if part in attn:
      x = np.array(attn[part])
      for h, f in zip(heads, factors):
        x[i, ..., h, :] *= np.float32(f)
      attn[part] = jnp.asarray(x)
  return params


def clip_step(cfg, model, layer, heads, tau_over, name):
  """Force `heads` of `layer` to tau_over·τ, take one step of optimizer `name` (muon_clip or
  adamw_clip) with learning rate 0, so that only the clip changes weights; return
  (params before, params after, max logits before / after, τ, the optimizer state)."""
  fn = max_logits_fn(model)
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 24)), jnp.int32)
  params = pure_params(model)
  base = np.asarray(fn(params, tokens))
  tau = 1.5 * float(base.max())
  assert (base[layer, list(heads)] > 0).all()
  params = force_heads(params, cfg, layer, heads,
                       [t * tau / base[layer, h] for h, t in zip(heads, tau_over)])
  before = np.asarray(fn(params, tokens))
  assert (before[layer, list(heads)] > 1.9 * tau).all()
  opt = optim.build(opt_config(name=name, learning_rate=0.0, grad_clip_norm=0.0,
                               **{"qk_clip.tau": tau}), cfg, params)
  state = jax.jit(opt.init)(params)
  grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
  new_params, state = jax.jit(opt.apply)(grads, state, params, jnp.asarray(before))
  after = np.asarray(fn(new_params, tokens))
  return params, new_params, before, after, tau, opt, state


def check_logits(before, after, tau, layer, heads):
  chosen = np.zeros_like(before, bool)
  chosen[layer, list(heads)] = True
  assert (after[chosen] <= tau * (1 + 1e-3)).all(), (after[chosen], tau)
  assert (after[chosen] >= tau * (1 - 1e-3)).all(), (after[chosen], tau)  # clipped to τ, no more
  rel = np.abs(after[~chosen] - before[~chosen]) / np.abs(before[~chosen])
  assert rel.max() <= 1e-5, rel.max()


def same(a, b):
  return np.array_equal(np.asarray(a), np.asarray(b))


def test_qk_clip_mla(moe_mla_model):
  # AdamW as the base here (Muon in the GQA test): QK-Clip composes with any base optimizer,
  # and lr 0 leaves only the clip. MuonClip on this model also runs sharded (test below).
  cfg = TINY_MOE_MLA
  layer, heads = 2, (1, 3)  # last layer (the second of the moe_layers stack)
  params, new, before, after, tau, opt, state = clip_step(cfg, moe_mla_model, layer, heads,
                                                          (2.0, 3.0), "adamw_clip")
  check_logits(before, after, tau, layer, heads)
  assert int(optim.metrics(opt, state)["qk_clipped_heads"]) == 2
  touched = {("moe_layers", "attn", "q_b_proj", "kernel"), ("moe_layers", "attn", "kv_b_proj",
                                                                       "kernel")}
  for path, x in jax.tree.leaves_with_path(params):
    names = optim.path_names(path)
    if names not in touched:  # the shared rotary key (kv_a_proj), norms, o_proj, ...
      assert same(x, _get(new, names)), names
  kv_a = ("moe_layers", "attn", "kv_a_proj", "kernel")  # holds the shared rotary key
  assert same(_get(params, kv_a), _get(new, kv_a))
  nope = cfg.qk_nope_head_dim
  q0, q1 = params["moe_layers"]["attn"]["q_b_proj"]["kernel"], \
      new["moe_layers"]["attn"]["q_b_proj"]["kernel"]
  kv0, kv1 = params["moe_layers"]["attn"]["kv_b_proj"]["kernel"], \
      new["moe_layers"]["attn"]["kv_b_proj"]["kernel"]
  i = layer - cfg.num_dense_layers
  assert same(q0[:i], q1[:i]) and same(kv0[:i], kv1[:i])  # other layer of the stack
  for h in range(cfg.num_heads):
    if h not in heads:  # heads under τ: bit-identical
      assert same(q0[i, :, h], q1[i, :, h]) and same(kv0[i, :, h], kv1[i, :, h])
      continue
    g = tau / before[layer, h]
    np.testing.assert_allclose(q1[i, :, h, :nope], q0[i, :, h, :nope] * math.sqrt(g), rtol=1e-6)
    np.testing.assert_allclose(q1[i, :, h, nope:], q0[i, :, h, nope:] * g, rtol=1e-6)
    np.testing.assert_allclose(kv1[i, :, h, :nope], kv0[i, :, h, :nope] * math.sqrt(g),
                               rtol=1e-6)
    assert same(kv0[i, :, h, nope:], kv1[i, :, h, nope:])  # values untouched


def _get(tree, names):
  for n in names:
    tree = tree[n]
  return tree


def test_qk_clip_gqa(dense_model):
  cfg = TINY_DENSE  # 4 query heads in 2 groups; q/k biases (Qwen2)
  layer, heads = 1, (0,)  # group 0 = heads {0, 1}: head 0 over τ, head 1 under; group 1 under
  params, new, before, after, tau, opt, state = clip_step(cfg, dense_model, layer, heads, (2.5,),
                                                          "muon_clip")
  check_logits(before, after, tau, layer, heads)
  assert int(optim.metrics(opt, state)["qk_clipped_heads"]) == 1
  for path, x in jax.tree.leaves_with_path(params):
    names = optim.path_names(path)
    if len(names) < 2 or names[-2] not in ("q_proj", "k_proj"):  # v, o, MLP, norms, embed
      assert same(x, _get(new, names)), names
  attn0, attn1 = params["dense_layers"]["attn"], new["dense_layers"]["attn"]
  for part in ("kernel", "bias"):
    q0, q1 = attn0["q_proj"][part], attn1["q_proj"][part]
    k0, k1 = attn0["k_proj"][part], attn1["k_proj"][part]
    assert same(q0[0], q1[0]) and same(k0[0], k1[0])  # layer 0: nothing over τ
    assert same(q0[1, ..., 2:, :], q1[1, ..., 2:, :])  # group 1 (query heads 2, 3) ...
    assert same(k0[1, ..., 1, :], k1[1, ..., 1, :])  # ... and its key head: bit-identical
    g = tau / before[layer, 0]
    kappa = g ** 0.5  # (min γ of the group)^(1 − α)
    np.testing.assert_allclose(q1[1, ..., 0, :], q0[1, ..., 0, :] * g / kappa, rtol=1e-6)
    np.testing.assert_allclose(q1[1, ..., 1, :], q0[1, ..., 1, :] / kappa, rtol=1e-6)
    np.testing.assert_allclose(k1[1, ..., 0, :], k0[1, ..., 0, :] * kappa, rtol=1e-6)
