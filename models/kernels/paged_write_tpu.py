"""Writes one decode step's new keys (or values) into a paged KV cache in place, as a Pallas
TPU kernel that touches only the written entries.

    pages[:, page[i], offset[i], :] = values[:, i, :]   for each row i with page[i] < num_pages

Why a kernel: the same write as an XLA scatter inside the decode loop may be costed, and laid
out, as an op on the whole pages array (its cost analysis and layout assignment see an operand
of the cache's size), so the loop's bytes and the roofline would count the cache per step, or a
layout change would copy it. Here the pages stay in HBM (memory space ANY), aliased to the
output, and the entries go there by DMA; the call declares the bytes it moves
(`pl.CostEstimate`), a few KiB.

Layout: pages [kv_heads, num_pages, page_size, dim] as the paged attention kernels read them;
values [kv_heads, b, dim] land in VMEM whole (a decode step's rows are few), as
[kv_heads, b, 1, dim], so that row i, all heads, is a [kv_heads, 1, dim] slice: the shape of
its destination pages[:, page[i], offset[i]:offset[i] + 1, :]. The page ids and offsets are
scalar-prefetched (SMEM). Rows whose page is num_pages or more (free slots) write nothing.

32-bit entries are DMA'd straight to their position. 16-bit ones cannot be: HBM packs positions
2k and 2k + 1 of a page into one 32-bit word, and Mosaic only takes a DMA of whole words (an
even offset and an even number of positions), so the kernel reads the pair holding the
position into VMEM, replaces the position's row and writes the pair back.

    CPU:  write_entries(..., interpret=pltpu.InterpretParams())   # TPU interpreter, for tests
    TPU:  write_entries(...)                                       # Mosaic
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from models.kernels.paged_attention_tpu import in_hbm


def _kernel(page_ref, offset_ref, values_ref, pages_in_ref, pages_ref, pair_ref, sems, *,
            b: int, num_pages: int, packed: bool):
  """page_ref, offset_ref [b] (SMEM); values_ref [kvh, b, 1, dim] (VMEM); pages_ref the pages
  (HBM, aliased to pages_in_ref); pair_ref [kvh, 2, dim] VMEM scratch; sems [b] DMA semaphores."""
  del pages_in_ref  # the same buffer as pages_ref
  if not packed:
    # Each row's [kvh, 1, dim] straight into its page; every row's copy starts before any is
    # waited on, so that they overlap (rows writing the same entry: one of them lands).
    copies = []
    for i in range(b):  # a decode batch: a few rows, unrolled
      page, offset = page_ref[i], offset_ref[i]
      dst = pages_ref.at[:, page, pl.ds(offset, 1), :]
      copies.append((page, pltpu.make_async_copy(values_ref.at[:, i], dst, sems.at[i])))
    for page, copy in copies:
      pl.when(page < num_pages)(copy.start)
    for page, copy in copies:
      pl.when(page < num_pages)(copy.wait)
    return

  # 16-bit entries: read-modify-write the pair of positions (one 32-bit word a lane) holding
  # the entry. Rows go one after another, so that two rows writing the two positions of one
  # pair both land.
  for i in range(b):
    page, offset = page_ref[i], offset_ref[i]

    @pl.when(page < num_pages)
    def _():
      # offset >= 0: lax.div/rem lower without floor division's sign fix-up.
      even = pl.multiple_of(jax.lax.div(offset, 2) * 2, 2)
      dst = pages_ref.at[:, page, pl.ds(even, 2), :]
      read = pltpu.make_async_copy(dst, pair_ref, sems.at[i])
      read.start()
      read.wait()
      row = jax.lax.broadcasted_iota(jnp.int32, pair_ref.shape, 1)
      pair_ref[...] = jnp.where(row == jax.lax.rem(offset, 2), values_ref[:, i], pair_ref[...])
      write = pltpu.make_async_copy(pair_ref, dst, sems.at[i])
      write.start()
      write.wait()


def write_entries(pages: jax.Array, values: jax.Array, page: jax.Array, offset: jax.Array,
                  *, interpret: Any = False) -> jax.Array:
  """pages[:, page[i], offset[i], :] = values[:, i, :] for every row i with page[i] < num_pages.

  Args:
    pages: [kv_heads, num_pages, page_size, dim], bf16 or fp32.
    values: [kv_heads, b, dim], pages' dtype.
    page: [b] int32, the page of each row; num_pages or more writes nothing.
    offset: [b] int32 in [0, page_size), the position within the page.
    interpret: False for Mosaic; True or a `pltpu.InterpretParams` for the Pallas interpreter.

  Returns:
    The updated pages, aliased to the input `pages`: under jit, donated or carried by a loop,
    they are updated in place.

  Raises:
    ValueError: mismatched shapes, or pages neither 32-bit nor 16-bit with an even page_size.
  """
  kvh, num_pages, page_size, dim = pages.shape
  if values.ndim != 3 or values.shape[0] != kvh or values.shape[2] != dim:
    raise ValueError(f"values {values.shape} do not match pages {pages.shape}: expected "
                     f"[{kvh}, b, {dim}]")
  b = values.shape[1]
  if page.shape != (b,) or offset.shape != (b,):
    raise ValueError(f"page {page.shape} and offset {offset.shape} must be [{b}]")
  itemsize = jnp.dtype(pages.dtype).itemsize
  if itemsize not in (2, 4) or (itemsize == 2 and page_size % 2):
    raise ValueError(f"pages {pages.dtype} of {page_size} positions: expected 32-bit entries, "
                     f"or 16-bit ones with an even page_size")
  packed = itemsize == 2
  values = values.astype(pages.dtype)[:, :, None, :]  # [kvh, b, 1, dim]
  kernel = functools.partial(_kernel, b=b, num_pages=num_pages, packed=packed)
  # HBM bytes moved: the values read, the entries written (16-bit: the pairs read and written,
  # twice the entries each way), the indices.
  entries = values.size * itemsize
  moved = entries + (4 if packed else 1) * entries + 2 * b * 4
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct(pages.shape, pages.dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(1,),
          in_specs=[pl.BlockSpec((kvh, b, 1, dim), lambda _, *__: (0, 0, 0, 0)),
                    pl.BlockSpec(memory_space=pl.ANY)],
          out_specs=pl.BlockSpec(memory_space=pl.ANY),
          scratch_shapes=[pltpu.VMEM((kvh, 2, dim), pages.dtype), pltpu.SemaphoreType.DMA((b,))]),
      input_output_aliases={3: 0},  # operands (page, offset, values, pages): pages is the output
      cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=moved),
      interpret=interpret,
  )(page.astype(jnp.int32), offset.astype(jnp.int32), values, in_hbm(pages, interpret))
