"""The paged KV cache write kernel (models/kernels/paged_write_tpu.py): in the Pallas
interpreter against XLA's scatter, and compiled for TPU by libtpu's compiler inside a decode-like
loop that carries the pages."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from models.kernels import paged_write_tpu as pw
from trainer import aot


def reference(pages, values, page, offset):
  """XLA's scatter: pages[:, page[i], offset[i]] = values[:, i]; pages past the pool drop."""
  kvh = pages.shape[0]
  return pages.at[jnp.arange(kvh)[:, None], page[None], offset[None]].set(values, mode="drop")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_matches_scatter(dtype):
  """Random entries written over stale pages: rows past the pool (num_pages, and more) write
  nothing; rows sharing a page at different offsets, the two halves of one bf16 word
  included (offsets 4 and 5 of page 1), all land."""
  rng = np.random.default_rng(0)
  kvh, num_pages, ps, d = 2, 6, 8, 128
  page = jnp.array([1, 6, 3, 1, 9, 1], jnp.int32)
  offset = jnp.array([4, 2, 7, 5, 0, 0], jnp.int32)
  pages = jnp.asarray(rng.normal(size=(kvh, num_pages, ps, d)), dtype)
  values = jnp.asarray(rng.normal(size=(kvh, len(page), d)), dtype)
  want = reference(pages, values, page, offset)
  # the TPU interpreter models the DMAs and their semaphores
  got = jax.jit(pw.write_entries, static_argnames="interpret")(
      pages, values, page, offset, interpret=pltpu.InterpretParams())
  assert got.dtype == dtype
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  # everything but the written entries is untouched
  assert int((np.asarray(got, np.float32) != np.asarray(pages, np.float32)).any(-1).sum()) == 8


def test_rejects_bad_shapes():
  pages = jnp.zeros((2, 4, 7, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="even page_size"):
    pw.write_entries(pages, jnp.zeros((2, 3, 128), jnp.bfloat16), jnp.zeros(3, jnp.int32),
                     jnp.zeros(3, jnp.int32))
  with pytest.raises(ValueError, match="do not match"):
    pw.write_entries(pages, jnp.zeros((1, 3, 128), jnp.bfloat16), jnp.zeros(3, jnp.int32),
                     jnp.zeros(3, jnp.int32))


def test_compiles_in_place_in_a_loop_for_tpu():
  """Compiled for a v5p chip inside a while loop that carries bf16 pages (written, then read
  each step, as in decode), the pages are updated in place: no copy of the whole pages, and the
  bytes accessed are those of the written and read entries, not the pages'."""
  _, devices = aot.topology_devices("v5p:2x2x1")
  sharding = jax.sharding.SingleDeviceSharding(devices[0])
  spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  kvh, num_pages, ps, d, b = 2, 16384, 16, 128, 4

  def decode(pages, values, page, offset):
    def body(carry):
      t, pages, acc = carry
      pages = pw.write_entries(pages, values + acc[:, :, None].astype(values.dtype), page,
                               (offset + t) % ps)
      acc = acc + pages[:, page].astype(jnp.float32).sum(axis=(2, 3))  # reads the pages
      return t + 1, pages, acc
    init = (0, pages, jnp.zeros((kvh, b), jnp.float32))
    return jax.lax.while_loop(lambda c: c[0] < 8, body, init)[1:]

  compiled = jax.jit(decode, donate_argnums=0).lower(
      spec((kvh, num_pages, ps, d)), spec((kvh, b, d)), spec((b,), jnp.int32),
      spec((b,), jnp.int32)).compile()
  text = compiled.as_text()
  assert "tpu_custom_call" in text
  assert not re.search(rf"= bf16\[{kvh},{num_pages},{ps},{d}\]\S* copy(-start)?\(", text)
  pages_bytes = kvh * num_pages * ps * d * 2
  assert compiled.cost_analysis()["bytes accessed"] < pages_bytes / 100
