"""Pallas TPU tree-attention kernel (interpret mode on CPU) against the XLA reference.

Every comparison is against `models.kernels.attention.attention` or the brute-force mask of
tests/tree_cases.py, never against the kernel itself. Compilation dominates the runtime in
interpret mode, so cases that share shapes are stacked along the batch axis and each jitted
(forward + VJP) function is built once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental.pallas import tpu as pltpu

from models.kernels import tree_attention_tpu as tat
from models.kernels.attention import attention
from tests import tree_cases as tc

jax.config.update("jax_default_matmul_precision", "highest")

TOL = 2e-5  # fp32, absolute


_inputs = tc.random_qkv


@functools.lru_cache(maxsize=None)
def _kernel_fn(scale, block_q, block_k, interpret, debug):
  """jit: (q, k, v, end, ct) -> (out, max_logits, (dq, dk, dv)[, bitmap])."""

  def fn(q, k, v, end, ct):
    def f(q, k, v):
      res = tat.tree_attention(q, k, v, end, scale=scale, block_q=block_q, block_k=block_k,
                               interpret=interpret, debug_blocks=debug)
      return res[0], res[1:]

    out, vjp, aux = jax.vjp(f, q, k, v, has_aux=True)
    return (out, *aux, vjp(ct))

  return jax.jit(fn)


@functools.lru_cache(maxsize=None)
def _reference_fn(scale):
  def fn(q, k, v, end, ct):
    (out, mx), vjp = jax.vjp(lambda q, k, v: attention(q, k, v, end, scale=scale), q, k, v)
    return out, mx, vjp((ct, jnp.zeros_like(mx)))

  return jax.jit(fn)


def _max_err(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def _check_fp32(q, k, v, end, ct, *, scale, block_q=128, block_k=128, interpret=True,
                debug=False):
  got = _kernel_fn(scale, block_q, block_k, interpret, debug)(q, k, v, end, ct)
  want = _reference_fn(scale)(q, k, v, end, ct)
  errs = {
      "out": _max_err(got[0], want[0]),
      "max_logits": _max_err(got[1], want[1]),
      **{name: _max_err(g, w) for name, g, w in zip(("dq", "dk", "dv"), got[-1], want[2])},
  }
  assert got[0].shape == want[0].shape and got[0].dtype == want[0].dtype
  assert got[1].shape == want[1].shape and got[1].dtype == jnp.float32
  assert all(e <= TOL for e in errs.values()), errs
  return got, errs


def _expected_blocks(end_row, block_q, block_k):
  """Brute force: which (q block, k block) pairs hold at least one allowed pair."""
  length = len(end_row)
  step = np.lcm(block_q, block_k)
  lp = -(-length // step) * step
  padded = np.concatenate([end_row, np.arange(length, lp) + 1]).astype(np.int32)
  allow = tc.allowed(padded)
  return allow.reshape(lp // block_q, block_q, lp // block_k, block_k).any(axis=(1, 3))


def _packed_parts(rng, sizes, causal):
  parts = [tc.random_tree_end(rng, n, max_depth=8, max_branch=16)[0] for n in sizes]
  parts.append(np.full(causal, causal, np.int32))
  return parts


# ----------------------------------------------------------------------------- fp32 cases


@functools.lru_cache(maxsize=None)
def _mixed_rows():
  """4 different rows of L = 384: random trees, packed trees + causal + padding, causal."""
  rng = np.random.default_rng(0)
  length = 384
  return (
      tc.random_tree_end(rng, length, max_depth=8, max_branch=16)[0],
      tc.random_tree_end(rng, length, max_depth=3, max_branch=4)[0],
      tc.packed_row(_packed_parts(rng, [90, 60, 70], causal=100), length),  # 320 + padding
      tc.causal_end(length),
  )


def test_mixed_batch_gqa_matches_reference():
  """Batch of 4 different rows (random trees, packed trees + causal + padding, plain causal),
  GQA 4 heads over 2 kv heads, L = 384 with blocks of 128; plus the debug bitmap."""
  rows = _mixed_rows()
  end = jnp.asarray(np.stack(rows))
  q, k, v, ct = _inputs(1, 4, 384, 4, 2, 16, 16)
  got, errs = _check_fp32(q, k, v, end, ct, scale=0.3, debug=True)
  bitmap = np.asarray(got[2])
  assert bitmap.shape == (4, 3, 3) and bitmap.dtype == bool
  for b, row in enumerate(rows):
    np.testing.assert_array_equal(bitmap[b], _expected_blocks(row, 128, 128), err_msg=f"row {b}")
  print("mixed batch max errors:", errs)


def test_ragged_length_mqa_tpu_interpret_params():
  """L = 200 with blocks of 128 (padded to 256 inside), MQA (kv_heads = 1), run under TPU
  interpret mode (simulated VMEM/SMEM; uninitialised scratch is NaN-filled)."""
  rng = np.random.default_rng(1)
  length = 200
  end = jnp.asarray(tc.random_tree_end(rng, length, max_depth=8, max_branch=16)[0])[None]
  q, k, v, ct = _inputs(2, 1, length, 2, 1, 16, 16)
  # All logits negative, so max_logits would notice a padded query (logit 0) leaking in.
  q, k = -jnp.abs(q), jnp.abs(k)
  params = pltpu.InterpretParams(uninitialized_memory="nan")
  got, errs = _check_fp32(q, k, v, end, ct, scale=0.25, interpret=params, debug=True)
  np.testing.assert_array_equal(np.asarray(got[2])[0], _expected_blocks(np.asarray(end[0]), 128,
                                                                         128))
  print("ragged MQA max errors:", errs)


def test_mla_dims_gqa_matches_reference():
  """DeepSeek-V3 head dims: qk 192 != v 128, two query heads on one kv head, packed row."""
  rng = np.random.default_rng(2)
  length = 256
  end = jnp.asarray(tc.packed_row(_packed_parts(rng, [100], causal=120), length))[None]
  q, k, v, ct = _inputs(3, 1, length, 2, 1, 192, 128)
  _, errs = _check_fp32(q, k, v, end, ct, scale=192 ** -0.5)
  print("MLA 192/128 max errors:", errs)


def _edge_row(rng, length=384):
  """Packed row with block-boundary edge cases for blocks of 64: keys 0..64 end at 65 (k block 0
  has max end = q0 + 1 of q block 1), keys 65..254 end at 255 (k block [128, 192) has min end =
  q1 - 1 of q block [192, 256): it still needs the elementwise mask), then two random trees
  and padding."""
  parts = [np.full(65, 65, np.int32), np.full(190, 190, np.int32)]
  parts += [tc.random_tree_end(rng, n, max_depth=8, max_branch=16)[0] for n in (60, 50)]
  return tc.packed_row(parts, length)


def test_small_blocks_sparsity_and_bitmap():
  """Blocks of 64 over a packed row of several sequences and trees: the bitmap equals the
  brute-force set of non-empty block pairs, and fewer blocks than the causal triangle (and the
  dense grid) run."""
  rng = np.random.default_rng(4)
  length = 384
  row = _edge_row(rng, length)
  end = jnp.asarray(row)[None]
  q, k, v, ct = _inputs(5, 1, length, 2, 1, 16, 8)
  got, errs = _check_fp32(q, k, v, end, ct, scale=0.25, block_q=64, block_k=64, debug=True)
  bitmap = np.asarray(got[2])[0]
  np.testing.assert_array_equal(bitmap, _expected_blocks(row, 64, 64))
  n = length // 64
  assert bitmap.sum() < n * (n + 1) // 2 < n * n, bitmap.sum()
  print(f"blocks computed {bitmap.sum()} of {n * n} (causal {n * (n + 1) // 2}); errors:", errs)


def test_unequal_blocks_forward_bitmap():
  """block_q = 128, block_k = 64 (misaligned block grid): forward, max_logits and bitmap."""
  rng = np.random.default_rng(5)
  length = 256
  row = tc.packed_row(_packed_parts(rng, [50, 90], causal=60), length)
  end = jnp.asarray(row)[None]
  q, k, v, _ = _inputs(6, 1, length, 2, 2, 16, 16)
  fn = jax.jit(functools.partial(tat.tree_attention, scale=0.25, block_q=128, block_k=64,
                                 interpret=True, debug_blocks=True))
  out, mx, bitmap = fn(q, k, v, end)
  ref_out, ref_mx = attention(q, k, v, end, scale=0.25)
  assert _max_err(out, ref_out) <= TOL and _max_err(mx, ref_mx) <= TOL
  np.testing.assert_array_equal(np.asarray(bitmap)[0], _expected_blocks(row, 128, 64))


# ----------------------------------------------------------------------------- bf16


def test_bf16_close_to_fp32_reference():
  """bf16 inputs (fp32 accumulation inside) against the fp32 reference on the same values."""
  end = jnp.asarray(np.stack(_mixed_rows()))
  q, k, v, ct = _inputs(8, 4, 384, 4, 2, 16, 16, dtype=jnp.bfloat16)
  got = _kernel_fn(0.3, 128, 128, True, False)(q, k, v, end, ct)
  f32 = lambda x: x.astype(jnp.float32)
  want = _reference_fn(0.3)(f32(q), f32(k), f32(v), end, f32(ct))
  assert got[0].dtype == jnp.bfloat16
  errs = {"out": _max_err(got[0], want[0]), "max_logits": _max_err(got[1], want[1])}
  assert errs["out"] <= 3e-2, errs
  assert errs["max_logits"] <= 1e-5 * float(jnp.max(jnp.abs(want[1]))) + 1e-5, errs
  for name, g, w in zip(("dq", "dk", "dv"), got[-1], want[2]):
    assert g.dtype == jnp.bfloat16
    errs[name] = _max_err(g, w)
    assert errs[name] <= 1e-2 * max(1.0, float(jnp.max(jnp.abs(w)))), errs
  print("bf16 max errors vs fp32 reference:", errs)


# ----------------------------------------------------------------------------- TPU lowering


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_tpu(dtype):
  """Cross-lower forward + VJP (and the debug variant) for TPU on CPU: Pallas' Mosaic lowering
  checks the block shapes against TPU tiling. (Mosaic's own compilation needs a TPU.)"""
  b, length, heads, kv_heads, dqk, dv = 2, 1000, 4, 2, 192, 128
  args = (jax.ShapeDtypeStruct((b, length, heads, dqk), dtype),
          jax.ShapeDtypeStruct((b, length, kv_heads, dqk), dtype),
          jax.ShapeDtypeStruct((b, length, kv_heads, dv), dtype),
          jax.ShapeDtypeStruct((b, length), jnp.int32))

  def train(q, k, v, end):
    (out, mx), vjp = jax.vjp(lambda q, k, v: tat.tree_attention(q, k, v, end, scale=0.1), q, k, v)
    return out, mx, vjp((out, mx))

  def debug(q, k, v, end):
    return tat.tree_attention(q, k, v, end, scale=0.1, debug_blocks=True)

  for fn, kernels in ((train, 3), (debug, 1)):
    module = export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()
    assert module.count("tpu_custom_call") == kernels


def test_tpu_blocks_must_be_lane_multiples():
  x = jnp.zeros((1, 128, 1, 8))
  with pytest.raises(ValueError, match="multiple of 128"):
    tat.tree_attention(x, x, x, jnp.full((1, 128), 128), scale=1.0, block_q=64)


# ----------------------------------------------------------------------------- metadata


@pytest.mark.parametrize("block_q,block_k", [(128, 128), (64, 64), (128, 64), (64, 128)])
@pytest.mark.parametrize("row_kind", ["packed", "edges"])
def test_block_metadata_and_fetch_index_maps(block_q, block_k, row_kind):
  """Against the brute-force mask: the skip test is exact, 'unmasked' blocks are fully allowed,
  the forward / dQ k-block fetch index is the block itself when computed and otherwise the next
  computed k block (above the diagonal: the last computed one, already in the buffer), and the
  dK/dV q-block fetch index is qi when computed and otherwise inside the computed range."""
  rng = np.random.default_rng(7)
  length = 512
  if row_kind == "packed":
    row = tc.packed_row(_packed_parts(rng, [60, 30, 100, 45], causal=80) +
                        [tc.random_tree_end(rng, 120)[0]], length)
  else:
    row = np.concatenate([_edge_row(rng, 384), 385 + np.arange(128, dtype=np.int32)])
  allow = tc.allowed(row)
  nq, nk = length // block_q, length // block_k
  blocks = allow.reshape(nq, block_q, nk, block_k).transpose(0, 2, 1, 3)
  expected, full = blocks.any(axis=(2, 3)), blocks.all(axis=(2, 3))
  levels = max(1, (nk - 1).bit_length())
  kmin, ktab = tat.block_metadata(jnp.asarray(row)[None], block_k, levels)
  cfg = tat._Cfg(scale=1.0, bq=block_q, bk=block_k, seq_len=length, padded_len=length,
                 groups=1, levels=levels, interpret=True, debug=False)
  kmin, ktab = np.asarray(kmin).reshape(-1), np.asarray(ktab).reshape(-1)
  for qi in range(nq):
    for kj in range(nk):
      computed, unmasked = tat._block_tests(cfg, 0, qi, kj, kmin, ktab)
      assert bool(computed) == expected[qi, kj], (qi, kj)
      assert full[qi, kj] or not unmasked, (qi, kj)
      fetch = int(tat._next_k_block(cfg, 0, qi, kj, ktab))
      if expected[qi, kj]:
        want = kj
      elif kj * block_k >= (qi + 1) * block_q:  # above the diagonal
        want = max(c for c in range(nk) if expected[qi, c])
      else:  # a dead block below the diagonal
        want = min(c for c in range(kj, nk) if expected[qi, c])
      assert fetch == want, (qi, kj, fetch, want)
  for kj in range(nk):
    lo, hi = tat._q_block_range(cfg, 0, kj, ktab)
    np.testing.assert_array_equal(np.arange(nq)[expected[:, kj]], np.arange(int(lo), int(hi) + 1))
    for qi in range(nq):
      fetch = int(tat._dkv_q_block(cfg, 0, kj, qi, ktab))
      assert expected[fetch, kj] and (fetch == qi or not expected[qi, kj]), (kj, qi, fetch)
