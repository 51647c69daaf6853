"""Transformer behaviour against independent references: unpacked sequences for the tree rule,
teacher forcing for the decode caches, the dense expert path for dropless dispatch, full logits
for chunked log-probs, and no-remat gradients for remat policies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import decode, transformer
from models.config import ModelConfig
from models.logprobs import token_logprobs
from models.moe import route, update_router_bias
from tests.conftest import TINY_DENSE, TINY_MOE_MLA

ROW = 64


BATCH = 4  # every forward runs at [BATCH, ROW] so each model compiles once


@nnx.jit
def _forward(model, tokens, positions, end):
  return model(tokens, positions, end)


def forward(model, tokens, positions, end):
  """Logits for up to BATCH rows, padding the batch with copies of the first row."""
  n = tokens.shape[0]
  pad = lambda a: jnp.concatenate([a, jnp.repeat(a[:1], BATCH - n, 0)], 0)
  logits, aux = _forward(model, pad(tokens), pad(positions), pad(end))
  return logits[:n], aux


def assert_grad_close(a, b):
  """The design's gradient tolerance per leaf: ‖Δg‖ ≤ 1e-5·‖g‖ + 1e-7 (fp32 sums may be
  reassociated by chunking or recomputation)."""
  err, norm = float(jnp.linalg.norm(a - b)), float(jnp.linalg.norm(b))
  assert err <= 1e-5 * norm + 1e-7, (err, norm)


def causal_batch(seqs, length=ROW):
  """Unpacked reference rows: each sequence alone, right-padded (causal, so padding is inert)."""
  tokens = np.zeros((len(seqs), length), np.int32)
  for i, s in enumerate(seqs):
    tokens[i, :len(s)] = s
  positions = np.broadcast_to(np.arange(length), tokens.shape)
  return tokens, positions, np.full(tokens.shape, length, np.int32)


def trie_row(paths, length=ROW):
  """Flatten paths into a trie in depth-first pre-order: tokens, positions (depth), end, and
  for each path the row index of each of its tokens. Written independently of rl/tree.py."""
  children: dict = {}
  for path in paths:
    node = children
    for tok in path:
      node = node.setdefault(tok, {})
  tokens, depth, end, index_of = [], [], [], {}

  def visit(node, prefix):
    for tok, sub in node.items():
      i = len(tokens)
      tokens.append(tok)
      depth.append(len(prefix))
      end.append(None)
      index_of[prefix + (tok,)] = i
      visit(sub, prefix + (tok,))
      end[i] = len(tokens)

  visit(children, ())
  n = len(tokens)
  assert n <= length
  pad = length - n
  row_tokens = np.array(tokens + [0] * pad, np.int32)[None]
  row_pos = np.array(depth + [0] * pad, np.int32)[None]
  row_end = np.array(end + list(range(n + 1, length + 1)), np.int32)[None]
  rows = [[index_of[tuple(p[:k + 1])] for k in range(len(p))] for p in paths]
  return row_tokens, row_pos, row_end, rows


@pytest.mark.parametrize("which", ["dense", "moe_mla"])
def test_packed_and_tree_rows_equal_unpacked(which, request):
  model = request.getfixturevalue(f"{which}_model")
  rng = np.random.default_rng(0)
  vocab = model.cfg.vocab_size
  # --- three independent sequences packed in one row, then padding
  seqs = [rng.integers(1, vocab, n).tolist() for n in (20, 13, 25)]
  alone, _ = forward(model, *map(jnp.asarray, causal_batch(seqs)))
  tokens, positions, end = np.zeros((1, ROW), np.int32), np.zeros((1, ROW), np.int32), \
      np.arange(1, ROW + 1, dtype=np.int32)[None].copy()  # padding: end = j + 1
  start = 0
  for s in seqs:
    tokens[0, start:start + len(s)] = s
    positions[0, start:start + len(s)] = np.arange(len(s))
    end[0, start:start + len(s)] = start + len(s)
    start += len(s)
  packed, _ = forward(model, *map(jnp.asarray, (tokens, positions, end)))
  start = 0
  for i, s in enumerate(seqs):
    np.testing.assert_allclose(packed[0, start:start + len(s)], alone[i, :len(s)], atol=1e-5)
    start += len(s)
  # --- a trie of four paths sharing prefixes (one path is a prefix of another)
  base = rng.integers(1, vocab, 12).tolist()
  paths = [base + rng.integers(1, vocab, 9).tolist(), base[:7] + rng.integers(1, vocab, 6).tolist(),
           base + rng.integers(1, vocab, 4).tolist(), base[:10]]
  row_tokens, row_pos, row_end, rows = trie_row(paths)
  assert row_tokens.shape[1] >= sum(map(len, paths)) - 2 * 12 - 7  # prefixes really shared
  tree, _ = forward(model, *map(jnp.asarray, (row_tokens, row_pos, row_end)))
  alone, _ = forward(model, *map(jnp.asarray, causal_batch(paths)))
  for i, p in enumerate(paths):
    np.testing.assert_allclose(tree[0, rows[i]], alone[i, :len(p)], atol=1e-5)


def test_max_logits_cover_allowed_pairs_only(dense_model):
  """aux['max_logits'] equals the max of scaled q·k over allowed pairs, from an explicit mask."""
  cfg = TINY_DENSE
  rng = np.random.default_rng(1)
  seqs = [rng.integers(1, cfg.vocab_size, 30).tolist(), rng.integers(1, cfg.vocab_size, 20).tolist()]
  rows = causal_batch(seqs)
  _, aux = forward(dense_model, *map(jnp.asarray, rows))
  assert aux["max_logits"].shape == (cfg.num_layers, cfg.num_heads)
  # Reference for layer 0: recompute q, k by hand from the parameters.
  x = np.asarray(dense_model.embed[...])[rows[0]]
  layer = jax.tree.map(lambda a: a[0], nnx.state(dense_model.dense_layers, nnx.Param))
  p = lambda *path: np.asarray(layer[path[0]][path[1]][path[2]][...]) if len(path) == 3 \
      else np.asarray(layer[path[0]][path[1]][...])
  h = x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps) * p("attn_norm", "scale")
  q = np.einsum("bsd,dhk->bshk", h, p("attn", "q_proj", "kernel")) + p("attn", "q_proj", "bias")
  k = np.einsum("bsd,dhk->bshk", h, p("attn", "k_proj", "kernel")) + p("attn", "k_proj", "bias")
  inv = 1.0 / cfg.rope_theta ** (np.arange(0, 16, 2) / 16)
  ang = rows[1][..., None] * inv
  cos, sin = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
  rot = lambda t: np.concatenate([t[..., :8] * cos - t[..., 8:] * sin,
                                  t[..., 8:] * cos + t[..., :8] * sin], -1)
  q, k = rot(q), rot(np.repeat(k, 2, axis=2))
  s = np.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
  causal = np.tril(np.ones((ROW, ROW), bool))
  want = np.where(causal, s, -np.inf).max(axis=(0, 2, 3))
  np.testing.assert_allclose(aux["max_logits"][0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["dense", "moe_mla"])
def test_decode_matches_teacher_forcing(which, request):
  """Prefill + one-token steps with the cache (GQA K/V; absorbed MLA latent) reproduce the
  teacher-forced logits at every step, for ragged prompts in one batch."""
  model = request.getfixturevalue(f"{which}_model")
  rng = np.random.default_rng(2)
  prompts = [rng.integers(1, model.cfg.vocab_size, n).tolist() for n in (9, 5)]
  new, _ = decode.generate(model, prompts, max_new_tokens=12)
  full = [p + n for p, n in zip(prompts, new)]
  ref, _ = forward(model, *map(jnp.asarray, causal_batch(full)))
  step = nnx.jit(lambda m, t, c, i: m.decode_step(t, c, i))
  for row, seq in enumerate(full):
    cache = model.init_cache(1, 32)
    logits = []
    for t, tok in enumerate(seq):  # one token at a time, from an empty cache
      out, cache = step(model, jnp.array([[tok]]), cache, jnp.array([t], jnp.int32))
      logits.append(out[0, 0])
    np.testing.assert_allclose(np.stack(logits), ref[row, :len(seq)], atol=1e-4)
    # greedy continuation = argmax of teacher-forced logits
    want = np.argmax(ref[row, len(prompts[row]) - 1:len(seq) - 1], -1)
    assert new[row] == want.tolist()


def test_ragged_dispatch_equals_dense_experts(moe_mla_model):
  rng = np.random.default_rng(3)
  rows = causal_batch([rng.integers(1, 128, n).tolist() for n in (40, 64, 64, 20)])
  ragged, aux = forward(moe_mla_model, *map(jnp.asarray, rows))
  dense_model = nnx.merge(nnx.graphdef(transformer.abstract(TINY_MOE_MLA.replace(moe_impl="dense"))),
                          nnx.state(moe_mla_model))
  dense, aux_dense = forward(dense_model, *map(jnp.asarray, rows))
  np.testing.assert_allclose(ragged, dense, atol=1e-5)
  np.testing.assert_array_equal(aux["expert_ids"], aux_dense["expert_ids"])
  assert aux["moe_load"].shape == (2, 8)  # (moe layers, experts)
  np.testing.assert_allclose(aux["moe_load"].sum(-1), 1.0, rtol=1e-6)
  # Routing replay: given choices reproduce the forward; other choices change it.
  replay = nnx.jit(lambda m, t, p, e, ids: m(t, p, e, expert_ids=ids)[0])
  args = tuple(map(jnp.asarray, rows))
  np.testing.assert_allclose(replay(moe_mla_model, *args, aux["expert_ids"]), ragged, atol=1e-6)
  shifted = (aux["expert_ids"] + 1) % TINY_MOE_MLA.num_experts
  assert np.abs(replay(moe_mla_model, *args, shifted) - ragged).max() > 1e-3


def test_router_matches_numpy_transcription(moe_mla_model):
  """DeepSeek-V3 routing (sigmoid, bias for selection, group-limited top-k, renormalise, scale)
  against a direct NumPy transcription of the published procedure."""
  cfg = TINY_MOE_MLA
  rng = np.random.default_rng(4)
  logits = rng.normal(size=(50, cfg.num_experts)).astype(np.float32)
  bias = rng.normal(scale=0.3, size=cfg.num_experts).astype(np.float32)
  ids, gates, _ = route(cfg, jnp.asarray(logits), jnp.asarray(bias))
  s = 1 / (1 + np.exp(-logits))
  choice = s + bias
  per = cfg.num_experts // cfg.n_group
  for t in range(50):
    groups = choice[t].reshape(cfg.n_group, per)
    gscore = np.sort(groups, -1)[:, -2:].sum(-1)
    keep = np.argsort(-gscore)[:cfg.topk_group]
    masked = np.full(cfg.num_experts, -np.inf)
    for g in keep:
      masked[g * per:(g + 1) * per] = choice[t, g * per:(g + 1) * per]
    top = np.argsort(-masked)[:cfg.experts_per_token]
    w = s[t, top] / s[t, top].sum() * cfg.routed_scaling_factor
    assert sorted(np.asarray(ids[t]).tolist()) == sorted(top.tolist())
    order = np.argsort(np.asarray(ids[t]))
    np.testing.assert_allclose(np.asarray(gates[t])[order], w[np.argsort(top)], rtol=1e-5)


def test_router_bias_update_rule():
  load = jnp.array([[0.5, 0.25, 0.125, 0.125], [0.25, 0.25, 0.25, 0.25]])
  new = update_router_bias(jnp.zeros((2, 4)), load, rate=0.01)
  np.testing.assert_allclose(new, [[-0.01, 0.0, 0.01, 0.01], [0, 0, 0, 0]])
  model = transformer.init(TINY_MOE_MLA)
  moe_load = jnp.asarray(np.random.default_rng(0).dirichlet(np.ones(8), 2), jnp.float32)
  model.update_router_bias(moe_load)
  want = TINY_MOE_MLA.bias_update_rate * np.sign(moe_load.mean(-1, keepdims=True) - moe_load)
  np.testing.assert_allclose(model.moe_layers.mlp.router_bias[...], want)
  assert not isinstance(model.moe_layers.mlp.router_bias, nnx.Param)  # never trained
  with pytest.raises(ValueError, match="no router bias"):
    transformer.init(TINY_DENSE).update_router_bias(moe_load)


def test_chunked_logprobs_equal_full_log_softmax():
  """Chunked log-probs/entropy equal a full log_softmax, values and gradients."""
  rng = np.random.default_rng(5)
  hidden = jnp.asarray(rng.normal(size=(3, 37, 64)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(64, 128)) * 0.3, jnp.float32)
  targets = jnp.asarray(rng.integers(0, 128, (3, 37)))

  def full(hidden, w):
    logp = jax.nn.log_softmax(hidden @ w, -1)
    return jnp.take_along_axis(logp, targets[..., None], -1)[..., 0], -(jnp.exp(logp) * logp).sum(-1)

  lp, ent = token_logprobs(hidden, w, targets, chunk=16)
  lp_ref, ent_ref = full(hidden, w)
  np.testing.assert_allclose(lp, lp_ref, atol=1e-5)
  np.testing.assert_allclose(ent, ent_ref, atol=1e-5)
  loss = lambda f: lambda h, w: (f(h, w)[0] * jnp.arange(37)).sum() + f(h, w)[1].sum()
  g = jax.grad(loss(lambda h, w: token_logprobs(h, w, targets, chunk=16)), (0, 1))(hidden, w)
  g_ref = jax.grad(loss(full), (0, 1))(hidden, w)
  for a, b in zip(g, g_ref):
    assert_grad_close(a, b)



def test_remat_policies_leave_gradients_unchanged(dense_model):
  """Rematerialisation only trades memory for recomputation: gradients stay the same."""
  rng = np.random.default_rng(6)
  rows = tuple(map(jnp.asarray, causal_batch([rng.integers(1, 128, 64).tolist()] * 2)))
  params, rest = nnx.state(dense_model, nnx.Param), nnx.state(dense_model, nnx.Not(nnx.Param))

  def grads(remat):
    graphdef = nnx.graphdef(transformer.abstract(TINY_DENSE.replace(remat=remat)))

    def loss_fn(params):
      model = nnx.merge(graphdef, params, rest)
      h, _, _ = model.hidden(*rows)
      lp, _ = token_logprobs(h[:, :-1], model.lm_head_weight(), rows[0][:, 1:], chunk=32)
      return -lp.mean()
    return jax.jit(jax.grad(loss_fn))(params)

  base = grads("none")
  assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(base)) > 0
  for remat in ("full", "save_dots", "offload"):
    for a, b in zip(jax.tree.leaves(grads(remat)), jax.tree.leaves(base)):
      assert_grad_close(a, b)


def test_layer_loop_equals_layer_scan(moe_mla_model):
  """scan_layers=False (a Python loop over layer slices) computes what the lax.scan computes:
  loss, MoE aux and gradients, with and without remat."""
  rng = np.random.default_rng(7)
  rows = tuple(map(jnp.asarray, causal_batch([rng.integers(1, 128, 64).tolist()] * 2)))
  params = nnx.state(moe_mla_model, nnx.Param)
  rest = nnx.state(moe_mla_model, nnx.Not(nnx.Param))

  def run(**changes):
    graphdef = nnx.graphdef(transformer.abstract(TINY_MOE_MLA.replace(**changes)))

    def loss_fn(params):
      model = nnx.merge(graphdef, params, rest)
      h, aux, _ = model.hidden(*rows)
      lp, _ = token_logprobs(h[:, :-1], model.lm_head_weight(), rows[0][:, 1:], chunk=32)
      return -lp.mean() + aux["balance_loss"], aux
    return jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)

  (loss, aux), grads = run()
  for remat in ("none", "full"):
    (loss2, aux2), grads2 = run(scan_layers=False, remat=remat)
    np.testing.assert_allclose(loss2, loss, rtol=1e-6)
    np.testing.assert_array_equal(aux2["moe_load"], aux["moe_load"])
    for a, b in zip(jax.tree.leaves(grads2), jax.tree.leaves(grads)):
      assert_grad_close(a, b)


def test_config_errors_name_the_field():
  cases = [dict(num_kv_heads=3), dict(attention="mqa"), dict(num_experts=8, n_group=3),
           dict(num_experts=8, experts_per_token=9), dict(remat="some"), dict(rope_type="ntk")]
  fields = ["num_kv_heads", "attention", "n_group", "experts_per_token", "remat", "rope_type"]
  for kwargs, field in zip(cases, fields):
    with pytest.raises(ValueError, match=f"ModelConfig.{field}="):
      ModelConfig(**kwargs)
