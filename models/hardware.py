"""Published per-chip figures of the TPU generations Arbor sizes and compiles for.

Sources: cloud.google.com/tpu/docs/v5p ("Peak compute per chip (bf16) 459 TFLOPs; HBM2e
capacity and bandwidth 95GB, 2765 GBps; Interchip Interconnect BW 4800 Gbps") and
cloud.google.com/tpu/docs/v6e ("918 TFLOPs; HBM capacity per chip 32 GB; HBM bandwidth per
chip 1640 GBps; ICI bandwidth 3584 Gbps"), checked 2026-11. Used by the sizing arithmetic
(benchmarks/sizing.py, docs/scaling.md) and the ahead-of-time compile reports (trainer/aot.py).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

GB = 1e9  # TPU documentation states HBM in GB (1e9 bytes)


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation's per-chip figures.

  Attributes:
    name: the generation ("v5p", "v6e").
    peak_flops: bf16 FLOP/s per chip.
    hbm_bytes: HBM capacity per chip.
    hbm_bw: HBM bytes/s per chip.
    ici_bw: inter-chip interconnect bytes/s per chip (the documented Gbps / 8).
    cores_per_chip: TensorCores per chip (accelerator type vN-K counts K = chips x this).
  """

  name: str
  peak_flops: float
  hbm_bytes: float
  hbm_bw: float
  ici_bw: float
  cores_per_chip: int


CHIPS = {
    "v5p": Chip("v5p", 459e12, 95 * GB, 2765 * GB, 4800e9 / 8, 2),
    "v6e": Chip("v6e", 918e12, 32 * GB, 1640 * GB, 3584e9 / 8, 1),
}


def slice_chips(topology: str) -> tuple[Chip, int]:
  """(the generation's Chip, chips in the slice) of a topology "GEN:AxB[xC]" (e.g. "v5p:2x2x4":
  v5p, 16), without libtpu; KeyError for an unknown generation."""
  gen, _, shape = topology.partition(":")
  return CHIPS[gen], math.prod(int(n) for n in shape.split("x"))


def storage_bits(dtype) -> int:
  """Bits one element takes in HBM: 4 for int4 (TPUs pack two per byte; numpy says 1 byte)."""
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.integer):
    return jnp.iinfo(dtype).bits
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.finfo(dtype).bits
  return 8 * dtype.itemsize
