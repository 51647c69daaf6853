"""Pallas GPU (Triton backend) tree-attention kernel in interpret mode on CPU, against the
pure-XLA reference `models.kernels.attention.attention` (forward, max logits, dQ/dK/dV) and
against the brute-force mask for the set of tiles the forward kernel computes.

The GPU interpreter is slow to compile, so every test of a given shape family reuses one
jitted function per configuration (jit caches on shapes and static arguments)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.kernels.attention import attention
from models.kernels.tree_attention_gpu import tree_attention
from tests import tree_cases as tc

TOL = 2e-5  # fp32, absolute


# ----------------------------------------------------------------------------- helpers


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k"))
def _kernel_vjp(q, k, v, end, ct, *, scale, block_q, block_k):
  fn = lambda q, k, v: tree_attention(q, k, v, end, scale=scale, block_q=block_q,
                                      block_k=block_k, interpret=True)
  (out, ml), vjp = jax.vjp(fn, q, k, v)
  return out, ml, vjp((ct, jnp.zeros_like(ml)))


@functools.partial(jax.jit, static_argnames=("scale",))
def _reference_vjp(q, k, v, end, ct, *, scale):
  fn = lambda q, k, v: attention(q, k, v, end, scale=scale)
  (out, ml), vjp = jax.vjp(fn, q, k, v)
  return out, ml, vjp((ct, jnp.zeros_like(ml)))


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k"))
def _kernel_blocks(q, k, v, end, *, scale, block_q, block_k):
  return tree_attention(q, k, v, end, scale=scale, block_q=block_q, block_k=block_k,
                        interpret=True, debug_blocks=True)


_inputs = tc.random_qkv


def _tree(seed, n, **kw):
  return tc.random_tree_end(np.random.default_rng(seed), n, **kw)[0]


def _packed(seed, length):
  """Several trees + a causal sequence + padding in one row."""
  rng = np.random.default_rng(seed)
  a, b, c = (int(x) for x in rng.integers(length // 8, length // 4, size=3))
  parts = [tc.random_tree_end(rng, a)[0], tc.random_tree_end(rng, b, max_depth=3)[0],
           np.full(c, c, np.int32)]
  return tc.packed_row(parts, length)


def _edges(length):
  """Segments ending one past, at and one before block boundaries (multiples of 32): key
  blocks seen by exactly one query of a later block (max_end = q0 + 1), or by all but the last
  query of one (min_end = q1 - 1), where an off-by-one in the skip or full-tile test shows."""
  parts, used = [], 0
  for n in (33, 31, 1, 30, 1, 32, 2):
    if used + n > length:
      break
    parts.append(np.full(n, n, np.int32) if n != 30 else _tree(9, n))
    used += n
  return tc.packed_row(parts, length)


# end arrays [batch, L] by name, for a given L (rows of a batch differ).
ENDS = {
    "trees": lambda n: [_tree(1, n), _tree(2, n)],
    "bushy_trees": lambda n: [_tree(3, n, max_depth=3, max_branch=4),
                              _tree(4, n, max_depth=8, max_branch=16)],
    "packed": lambda n: [_packed(5, n), _packed(6, n)],
    "causal": lambda n: [tc.causal_end(n), tc.causal_end(n - 7, n)],
    "tree_and_packed": lambda n: [_tree(7, n), _packed(8, n)],
    # Row 2: ends 63 (= q1 - 1 of block [32, 64): not a full tile), 65 (= q0 + 1), 95.
    "edges": lambda n: [_edges(n), tc.packed_row(
        [np.full(63, 63, np.int32), np.full(2, 2, np.int32), np.full(30, 30, np.int32)], n)],
}

# (name, L, heads, kv_heads, qk_dim, v_dim, block_q, block_k, end kinds)
CONFIGS = [
    ("base", 128, 2, 2, 16, 16, 32, 32, ["trees", "bushy_trees", "packed", "causal", "edges"]),
    ("ragged", 150, 2, 2, 16, 16, 64, 32, ["tree_and_packed", "causal", "edges"]),
    ("gqa_mla", 96, 4, 2, 24, 16, 32, 64, ["tree_and_packed"]),
    ("mqa_mla_ragged", 83, 4, 1, 24, 16, 32, 32, ["tree_and_packed", "causal"]),
]
CASES = [pytest.param(c, kind, id=f"{c[0]}-{kind}") for c in CONFIGS for kind in c[-1]]


def _run(config, kind, seed=0, dtype=jnp.float32):
  _, length, heads, kv_heads, qk_dim, v_dim, bq, bk, _ = config
  end = jnp.asarray(np.stack(ENDS[kind](length)), jnp.int32)
  q, k, v, ct = _inputs(seed, 2, length, heads, kv_heads, qk_dim, v_dim, dtype)
  scale = qk_dim ** -0.5
  got = _kernel_vjp(q, k, v, end, ct, scale=scale, block_q=bq, block_k=bk)
  f32 = lambda x: x.astype(jnp.float32)
  want = _reference_vjp(f32(q), f32(k), f32(v), end, f32(ct), scale=scale)
  return got, want


def _max_err(a, b):
  return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("config,kind", CASES)
def test_matches_reference_fp32(config, kind):
  (out, ml, (dq, dk, dv)), (r_out, r_ml, (r_dq, r_dk, r_dv)) = _run(config, kind)
  assert out.shape == r_out.shape and out.dtype == jnp.float32
  assert ml.shape == r_ml.shape == (config[2],)
  errors = {name: _max_err(a, b) for name, a, b in [
      ("out", out, r_out), ("max_logits", ml, r_ml), ("dq", dq, r_dq), ("dk", dk, r_dk),
      ("dv", dv, r_dv)]}
  assert all(e <= TOL for e in errors.values()), errors
  # The cotangents are random, so zero gradients would mean the test checks nothing.
  assert float(jnp.max(jnp.abs(r_dk))) > 0.1 and float(jnp.max(jnp.abs(r_dv))) > 0.1


def test_bf16_close_to_fp32_reference():
  config = CONFIGS[0]
  for kind in ("trees", "packed"):
    (out, ml, grads), (r_out, r_ml, r_grads) = _run(config, kind, dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16 and ml.dtype == jnp.float32
    assert _max_err(out, r_out) <= 2e-2, _max_err(out, r_out)
    assert _max_err(ml, r_ml) <= 2e-2 * float(jnp.max(jnp.abs(r_ml))) + 1e-2
    for g, r in zip(grads, r_grads):
      rel = float(jnp.linalg.norm(g.astype(jnp.float32) - r) / jnp.linalg.norm(r))
      assert rel <= 2e-2, rel


def _expected_blocks(end_rows, length, bq, bk):
  """Tiles that contain at least one allowed pair of the brute-force mask, over the padded
  length the kernel uses (padding rows have end = j + 1)."""
  lp = -(-length // max(bq, bk)) * max(bq, bk)
  out = []
  for e in end_rows:
    padded = np.concatenate([e, np.arange(length + 1, lp + 1)]).astype(np.int32)
    allowed = tc.allowed(padded)
    out.append(allowed.reshape(lp // bq, bq, lp // bk, bk).any(axis=(1, 3)))
  return np.stack(out).astype(np.int32)


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[1]], ids=lambda c: c[0])
def test_debug_blocks_equal_brute_force(config):
  _, length, heads, kv_heads, qk_dim, v_dim, bq, bk, _ = config
  q, k, v, _ = _inputs(0, 2, length, heads, kv_heads, qk_dim, v_dim)
  for kind in ("trees", "packed", "causal", "tree_and_packed", "edges"):
    rows = ENDS[kind](length)
    end = jnp.asarray(np.stack(rows), jnp.int32)
    out, ml, blocks = _kernel_blocks(q, k, v, end, scale=qk_dim ** -0.5, block_q=bq,
                                     block_k=bk)
    np.testing.assert_array_equal(np.asarray(blocks), _expected_blocks(rows, length, bq, bk),
                                  err_msg=kind)
    r_out, _ = attention(q, k, v, end, scale=qk_dim ** -0.5)
    assert _max_err(out, r_out) <= TOL


def test_sparse_packed_row_skips_blocks():
  config = CONFIGS[0]
  _, length, heads, kv_heads, qk_dim, v_dim, bq, bk, _ = config
  nb = length // bq
  # Four independent 32-token sequences (one per block) and a row of short segments.
  four = tc.packed_row([np.full(32, 32, np.int32)] * 4, length)
  short = tc.packed_row([np.full(8, 8, np.int32)] * 12, length)
  end = jnp.asarray(np.stack([four, short]), jnp.int32)
  q, k, v, _ = _inputs(1, 2, length, heads, kv_heads, qk_dim, v_dim)
  out, _, blocks = _kernel_blocks(q, k, v, end, scale=qk_dim ** -0.5, block_q=bq, block_k=bk)
  blocks = np.asarray(blocks)
  dense = nb * (nb + 1) // 2  # what a causal-only kernel computes
  np.testing.assert_array_equal(blocks[0], np.eye(nb, dtype=np.int32))
  np.testing.assert_array_equal(blocks, _expected_blocks([four, short], length, bq, bk))
  assert blocks[0].sum() == nb < dense and blocks[1].sum() == nb < dense
  r_out, _ = attention(q, k, v, end, scale=qk_dim ** -0.5)
  assert _max_err(out, r_out) <= TOL


def test_max_logits_ignore_padded_rows():
  """All real logits negative: the zero logits of the kernel's internal padding rows (zero
  queries and keys, L=150 padded to 192) must not leak into max_logits."""
  _, length, heads, kv_heads, qk_dim, v_dim, bq, bk, _ = CONFIGS[1]
  u = jnp.asarray(np.random.default_rng(2).standard_normal(qk_dim), jnp.float32)
  k = jnp.broadcast_to(u, (2, length, kv_heads, qk_dim))
  q = -jnp.broadcast_to(u, (2, length, heads, qk_dim))
  _, _, v, _ = _inputs(2, 2, length, heads, kv_heads, qk_dim, v_dim)
  end = jnp.asarray(np.stack(ENDS["tree_and_packed"](length)), jnp.int32)
  scale = qk_dim ** -0.5
  _, ml, _ = _kernel_blocks(q, k, v, end, scale=scale, block_q=bq, block_k=bk)
  _, r_ml = attention(q, k, v, end, scale=scale)
  assert float(jnp.max(r_ml)) < -1.0
  assert _max_err(ml, r_ml) <= TOL * float(jnp.max(jnp.abs(r_ml)))


def test_rejects_bad_blocks_and_heads():
  q = jnp.zeros((1, 8, 3, 16))
  k = jnp.zeros((1, 8, 2, 16))
  end = jnp.full((1, 8), 8, jnp.int32)
  with pytest.raises(ValueError, match="multiple"):
    tree_attention(q, k, k, end, scale=1.0, interpret=True)
  with pytest.raises(ValueError, match="power of two"):
    tree_attention(q[:, :, :2], k, k, end, scale=1.0, block_q=48, interpret=True)
