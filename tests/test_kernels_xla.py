"""Blocked XLA tree attention (`xla_flash`) against the dense XLA reference and brute force.

Every comparison is against `models.kernels.attention.attention` or the brute-force mask of
tests/tree_cases.py. Cases that share shapes are stacked along the batch axis so each jitted
(forward + VJP) function compiles once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.kernels import tree_attention_xla as txa
from models.kernels.attention import attention
from tests import tree_cases as tc

jax.config.update("jax_default_matmul_precision", "highest")

TOL = 2e-5  # fp32, absolute


_inputs = tc.random_qkv


def _with_vjp(fn):
  def run(q, k, v, end, ct):
    res = fn(q, k, v, end)
    (out, mx), vjp = jax.vjp(lambda q, k, v: fn(q, k, v, end)[:2], q, k, v)
    return out, mx, vjp((ct, jnp.zeros_like(mx))), res[2:]
  return jax.jit(run)


@functools.lru_cache(maxsize=None)
def _flash_fn(scale, block_q, block_k):
  return _with_vjp(functools.partial(txa.tree_attention, scale=scale, block_q=block_q,
                                     block_k=block_k, debug_blocks=True))


@functools.lru_cache(maxsize=None)
def _reference_fn(scale):
  return _with_vjp(functools.partial(attention, scale=scale))


def _expected_blocks(end_row, block_q, block_k):
  """Brute force: which (q block, k block) pairs hold at least one allowed pair."""
  step = np.lcm(block_q, block_k)
  lp = -(-len(end_row) // step) * step
  padded = np.concatenate([end_row, np.arange(len(end_row), lp) + 1]).astype(np.int32)
  return tc.allowed(padded).reshape(lp // block_q, block_q, lp // block_k, block_k).any((1, 3))


def _check(rows, inputs, scale, block_q, block_k, tol=TOL):
  end = jnp.asarray(np.stack(rows))
  q, k, v, ct = inputs
  out, mx, grads, (bitmap,) = _flash_fn(scale, block_q, block_k)(q, k, v, end, ct)
  f32 = lambda x: x.astype(jnp.float32)
  r_out, r_mx, r_grads, _ = _reference_fn(scale)(f32(q), f32(k), f32(v), end, f32(ct))
  assert out.dtype == q.dtype and mx.dtype == jnp.float32 and mx.shape == r_mx.shape
  # Absolute error over max(1, max |reference|): dV sums ~L products of O(1) terms.
  errs = {name: float(jnp.max(jnp.abs(f32(a) - b)) / max(1.0, float(jnp.max(jnp.abs(b)))))
          for name, a, b in zip(("out", "max_logits", "dq", "dk", "dv"), (out, mx, *grads),
                                (r_out, r_mx, *r_grads))}
  assert all(e <= tol for e in errs.values()), str(errs)
  for b, row in enumerate(rows):
    np.testing.assert_array_equal(np.asarray(bitmap[b]), _expected_blocks(row, block_q, block_k),
                                  err_msg=f"row {b}")
  return np.asarray(bitmap)


@pytest.mark.parametrize("block_q,block_k", [(128, 128), (64, 128), (128, 64)])
def test_trees_packed_causal_gqa(block_q, block_k):
  """Random trees (depth 8 / branching 16, and bushy), a packed row of trees + a causal
  sequence + padding, and a plain causal row; GQA 4 heads over 2; L = 384."""
  rng = np.random.default_rng(0)
  length = 384
  parts = [tc.random_tree_end(rng, n)[0] for n in (90, 60, 70)] + [np.full(100, 100, np.int32)]
  rows = [tc.random_tree_end(rng, length, max_depth=8, max_branch=16)[0],
          tc.random_tree_end(rng, length, max_depth=3, max_branch=4)[0],
          tc.packed_row(parts, length), tc.causal_end(length)]
  bitmap = _check(rows, _inputs(1, 4, length, 4, 2, 16, 16), 0.3, block_q, block_k)
  # The packed row skips blocks that even the causal triangle would compute.
  assert bitmap[2].sum() < bitmap[3].sum()


def test_ragged_length_mla_dims_mqa():
  """L = 200 (not a block multiple), MLA head dims (qk 192, v 128) with MQA; all logits
  negative, so a padded query (logit 0) leaking into max_logits would show."""
  rng = np.random.default_rng(1)
  rows = [tc.random_tree_end(rng, 200)[0], tc.causal_end(150, 200)]
  q, k, v, ct = _inputs(2, 2, 200, 2, 1, 192, 128)
  _check(rows, (-jnp.abs(q), jnp.abs(k), v, ct), 192 ** -0.5, 64, 64)


def test_bf16_close_to_fp32_reference():
  rng = np.random.default_rng(3)
  rows = [tc.random_tree_end(rng, 256)[0]]
  inputs = _inputs(4, 1, 256, 4, 2, 16, 16, dtype=jnp.bfloat16)
  _check(rows, inputs, 0.3, 128, 128, tol=5e-2)


def test_dispatch_and_auto():
  """`impl="xla_flash"` and "auto" on CPU for long rows route here; bad names fail clearly."""
  q, k, v, _ = _inputs(5, 1, 64, 2, 2, 8, 8)
  end = jnp.full((1, 64), 64)
  ref = attention(q, k, v, end, scale=0.5)
  for impl in ("xla_flash", "auto"):
    got = attention(q, k, v, end, scale=0.5, impl=impl)
    assert float(jnp.max(jnp.abs(got[0] - ref[0]))) <= TOL
  with pytest.raises(ValueError, match="impl='flash'"):
    attention(q, k, v, end, scale=0.5, impl="flash")
