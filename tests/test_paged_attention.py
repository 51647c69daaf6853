"""Paged attention: the XLA reference (models/kernels/paged_attention.py) against NumPy
attention over each sequence's contiguous keys, the Pallas TPU kernel
(models/kernels/paged_attention_tpu.py) in interpret mode against the reference, the page
writes of models/attention.py, and the kernel and the engine's paged decode program compiled
for TPU by libtpu's compiler."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import attention as layers
from models import transformer
from models.engine import programs
from models.kernels import attention as kernels
from models.kernels import paged_attention as ref
from models.kernels import paged_attention_tpu as tpu
from tests.conftest import TINY_DENSE, TINY_MOE_MLA
from trainer import aot


def make_case(rng, *, b, s, h, kvh, d, dv, ps, n, starts, rope=0, dtype=jnp.float32):
  """Random pages and a page table of distinct pages per sequence (some ids past the pool
  where no query looks), plus the contiguous keys/values [b, n * ps, kvh, dim] they hold."""
  num_pages = b * n + 3
  perm = rng.permutation(num_pages)[:b * n].reshape(b, n)
  k = rng.normal(size=(b, n * ps, kvh, d)).astype(np.float32)
  v = rng.normal(size=(b, n * ps, kvh, dv)).astype(np.float32)
  kr = rng.normal(size=(b, n * ps, kvh, rope)).astype(np.float32)

  def pages(x):
    out = rng.normal(size=(kvh, num_pages, ps, x.shape[-1])).astype(np.float32)  # stale data
    for i in range(b):
      for j in range(n):
        out[:, perm[i, j]] = x[i, j * ps:(j + 1) * ps].transpose(1, 0, 2)
    return jnp.asarray(out, dtype)

  table = perm.copy()
  for i, st in enumerate(starts):  # pages past the last query's page: any id
    table[i, (st + s - 1) // ps + 1:] = num_pages + 5
  args = dict(q=jnp.asarray(rng.normal(size=(b, s, h, d)), dtype), k_pages=pages(k),
              v_pages=pages(v), page_table=jnp.asarray(table, jnp.int32),
              q_start=jnp.asarray(starts, jnp.int32))
  if rope:
    args["q_rope"] = jnp.asarray(rng.normal(size=(b, s, h, rope)), dtype)
    args["k_rope_pages"] = pages(kr)
  return args, (k, v, kr)


def numpy_attention(args, contiguous, scale):
  """Causal attention of each query over its sequence's contiguous keys, in float64."""
  k, v, kr = contiguous
  q = np.asarray(args["q"], np.float64)
  qr = np.asarray(args["q_rope"], np.float64) if "q_rope" in args else None
  b, s, h, _ = q.shape
  group = h // k.shape[2]
  out = np.zeros((b, s, h, v.shape[-1]))
  for i in range(b):
    for t in range(s):
      pos = int(args["q_start"][i]) + t
      for hh in range(h):
        kk = k[i, :pos + 1, hh // group]
        logits = kk @ q[i, t, hh]
        if qr is not None:
          logits = logits + kr[i, :pos + 1, hh // group] @ qr[i, t, hh]
        p = np.exp(scale * logits - np.max(scale * logits))
        out[i, t, hh] = (p / p.sum()) @ v[i, :pos + 1, hh // group]
  return out


CASES = {
    "decode_gqa": dict(b=3, s=1, h=4, kvh=2, d=16, dv=16, ps=8, n=4, starts=[0, 13, 31]),
    "prefill_gqa": dict(b=2, s=5, h=4, kvh=1, d=8, dv=12, ps=4, n=5, starts=[3, 15]),
    "mla": dict(b=2, s=2, h=4, kvh=1, d=32, dv=32, ps=8, n=3, starts=[6, 17], rope=8),
}


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_numpy_and_kernel_matches_reference(name):
  case = dict(CASES[name])
  args, contiguous = make_case(np.random.default_rng(len(name)), **case)
  if name == "mla":  # MLA: the values are the latent keys
    args["v_pages"] = args["k_pages"]
    contiguous = (contiguous[0], contiguous[0], contiguous[2])
  want = numpy_attention(args, contiguous, scale=0.3)
  got = ref.paged_attention(**args, scale=0.3)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
  for per_block in (1, 2, 8):  # one page per grid step, blocks not dividing the table, one block
    kernel = tpu.paged_attention(**args, scale=0.3, pages_per_block=per_block, interpret=True)
    np.testing.assert_allclose(np.asarray(kernel), np.asarray(got), atol=2e-5)


def test_kernel_bf16_and_tpu_interpret_params():
  """bf16 pages through the kernel simulated with TPU semantics stay close to the fp32
  reference."""
  args, _ = make_case(np.random.default_rng(9), dtype=jnp.bfloat16, **CASES["decode_gqa"])
  want = ref.paged_attention(**{k: v.astype(jnp.float32) if v.dtype == jnp.bfloat16 else v
                                for k, v in args.items()}, scale=0.25)
  got = tpu.paged_attention(**args, scale=0.25, interpret=tpu.pltpu.InterpretParams())
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=3e-2)


def test_write_pages_matches_contiguous_write():
  """Entries written through a page table read back (gather_pages) as `write_cache` writes a
  contiguous row; positions past a sequence's pages are dropped."""
  rng = np.random.default_rng(3)
  b, s, kvh, d, ps, n, num_pages = 2, 6, 2, 4, 4, 3, 8
  table = jnp.asarray([[5, 1, 8], [2, 7, 0]], jnp.int32)  # id 8: no page (dropped)
  index = jnp.asarray([5, 1], jnp.int32)
  new = jnp.asarray(rng.normal(size=(b, s, kvh, d)), jnp.float32)
  pages = layers.write_pages(jnp.zeros((kvh, num_pages, ps, d)), new, table, index)
  row = layers.write_cache(jnp.zeros((b, n * ps, kvh, d)), new, index)
  got = ref.gather_pages(pages, table)
  np.testing.assert_array_equal(np.asarray(got[0, :8]), np.asarray(row[0, :8]))
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(row[1]))
  assert float(jnp.abs(pages[:, 8:]).sum()) == 0 and float(jnp.abs(got[0, 8:]).sum()) == 0


def test_shape_errors_name_the_argument():
  args, _ = make_case(np.random.default_rng(4), **CASES["decode_gqa"])
  with pytest.raises(ValueError, match="q_start"):
    ref.paged_attention(**{**args, "q_start": args["q_start"][:2]}, scale=1.0)
  with pytest.raises(ValueError, match="q_rope and k_rope_pages"):
    tpu.paged_attention(**args, q_rope=args["q"], scale=1.0, interpret=True)
  with pytest.raises(ValueError, match="pages_per_block=0"):
    tpu.paged_attention(**args, scale=1.0, pages_per_block=0, interpret=True)


@pytest.mark.parametrize("rope", [0, 64])
def test_kernel_compiles_for_tpu(rope):
  """libtpu's compiler (Mosaic included) compiles the kernel for a v5p chip: GQA decode with
  bf16 pages of 16 positions, and MLA's 512 + 64 latent over 4 queries per sequence."""
  _, devices = aot.topology_devices("v5p:2x2x1")
  sharding = jax.sharding.SingleDeviceSharding(devices[0])
  spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  b, h, ps, num_pages, n = 8, 16, 16, 64, 20  # 3 grid steps of 8 pages
  if rope:
    s, kvh, d = 4, 1, 512
    fn = lambda q, k, table, start, qr, kr: tpu.paged_attention(
        q, k, k, table, start, scale=0.1, q_rope=qr, k_rope_pages=kr)
    args = (spec((b, s, h, d)), spec((kvh, num_pages, ps, d)), spec((b, n), jnp.int32),
            spec((b,), jnp.int32), spec((b, s, h, rope)), spec((kvh, num_pages, ps, rope)))
  else:
    s, kvh, d = 1, 2, 128
    fn = functools.partial(tpu.paged_attention, scale=0.1)
    args = (spec((b, s, h, d)), spec((kvh, num_pages, ps, d)), spec((kvh, num_pages, ps, d)),
            spec((b, n), jnp.int32), spec((b,), jnp.int32))
  compiled = jax.jit(fn).lower(*args).compile()
  assert "tpu_custom_call" in compiled.as_text()


def kernel_calls(compiled) -> int:
  """Calls of the paged attention kernel in a compiled program (its Mosaic custom calls)."""
  return len(re.findall(r"^\s*%paged_attention[.\d]* = .*custom-call\(", compiled.as_text(),
                        re.MULTILINE))


@pytest.mark.parametrize("cfg", [TINY_DENSE, TINY_MOE_MLA], ids=["gqa", "moe_mla"])
def test_engine_paged_decode_compiles_for_tpu(cfg):
  """The engine's paged decode call (`programs.decode_paged`, bf16 tiny model) traced for TPU
  takes the Pallas kernel in every layer and compiles; its prefill call compiles too."""
  _, devices = aot.topology_devices("v5p:2x2x1")
  sharding = jax.sharding.SingleDeviceSharding(devices[0])
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  model = nnx.eval_shape(lambda: transformer.unstack(transformer.Transformer(
      cfg.replace(dtype="bfloat16"))))
  graphdef, state = nnx.split(model)
  state = jax.tree.map(lambda x: spec(x.shape, x.dtype), state)
  pages = jax.tree.map(lambda x: spec(x.shape, x.dtype),
                       jax.eval_shape(lambda: model.init_paged_cache(64, 16)))
  slots, n = 4, 8
  i32, f32 = (lambda *shape: spec(shape, jnp.int32)), (lambda *shape: spec(shape, jnp.float32))
  args = (state, pages, i32(slots, n), i32(slots), i32(slots), spec((slots,), jnp.bool_),
          i32(slots), i32(slots), f32(slots), i32(slots), f32(slots),
          spec((slots,), jnp.uint32), i32(slots, 4), i32(), spec((), jnp.bool_))
  # conftest sets "highest" for the CPU references; Mosaic takes no fp32 contraction of bf16
  with kernels.compile_for("tpu"), jax.default_matmul_precision("default"):
    compiled = programs.decode_paged.lower(graphdef, 8, 0, False, *args).compile()
  assert kernel_calls(compiled) == cfg.num_layers
  # prefill chunks take the XLA reference (their query rows would not fit the kernel's blocks)
  with kernels.compile_for("tpu"), jax.default_matmul_precision("default"):
    compiled = programs.prefill_paged.lower(graphdef, state, pages, i32(2, n), i32(2, 64),
                                           i32(2)).compile()
  assert kernel_calls(compiled) == 0
