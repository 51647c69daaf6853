"""Attention under the tree rule: one function, four implementations.

The rule (docs/design.md §3): query at row index `i` may attend to key `j` iff
`j <= i < end[j]`. One O(length) array `end` describes causal rows (`end = len`), packed
independent sequences (`end` = their own end), trees in depth-first pre-order (`end` = the
exclusive end of the key's subtree) and padding (`end = j + 1`).

For decoding against a cache, `q_index` gives each query's row index in the key array
(its cache slot); by default queries and keys are the same rows.

`impl` picks the implementation: "xla" (this file's reference, materialises [q, kv] logits),
"pallas_tpu" (models/kernels/tree_attention_tpu.py) or "pallas_gpu"
(models/kernels/tree_attention_gpu.py), flash kernels that read `end` directly and skip fully
masked blocks; "auto" takes the kernel of the running backend and the reference elsewhere. A
Pallas kernel asked for on another backend runs in interpret mode (slow; for tests). Decoding
(`q_index` given) always uses the reference.

A row whose tokens are sharded over the mesh (the `sequence` axis: `partition` names sequence
axes) runs the context-parallel kernel (models/kernels/context_parallel.py) whatever `impl`
says: no single-device kernel sees a whole row there.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Iterator

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from models.kernels import context_parallel, tree_attention_gpu, tree_attention_tpu, \
    tree_attention_xla
from models.kernels.mask import MASK_VALUE, allowed

# Below this many keys the dense reference beats the blocked loop on CPU (one fused einsum);
# from 768 keys on, block skipping wins on tree rows (docs/benchmarks.md, rl_step).
FLASH_MIN_LENGTH = 768
IMPLS = ("xla", "xla_flash", "pallas_tpu", "pallas_gpu")
# Pallas kernel -> (function, the backend it compiles for).
_PALLAS = {"pallas_tpu": (tree_attention_tpu.tree_attention, "tpu"),
           "pallas_gpu": (tree_attention_gpu.tree_attention, "gpu")}


def attention(q: jax.Array, k: jax.Array, v: jax.Array, end: jax.Array, *, scale: float,
              q_index: jax.Array | None = None, impl: str = "xla",
              partition: tuple[Any, Any] | None = None) -> tuple[jax.Array, jax.Array]:
  """Multi-head attention with grouped key/value heads under the tree rule.

  Args:
    q: [batch, q_len, heads, qk_dim] queries.
    k: [batch, kv_len, kv_heads, qk_dim] keys; `heads` must be a multiple of `kv_heads`.
    v: [batch, kv_len, kv_heads, v_dim] values.
    end: [batch, kv_len] int, exclusive end of each key's subtree.
    scale: softmax scale applied to q·k.
    q_index: [batch, q_len] int row index of each query; default `arange(q_len)`.
    impl: "xla" | "xla_flash" | "pallas_tpu" | "pallas_gpu" | "auto" (see module docstring).
    partition: (batch mesh axes, head mesh axes[, sequence mesh axes]) of the activations
      under the current mesh (`jax.set_mesh`); a Pallas kernel then runs on each shard inside
      `jax.shard_map`, since XLA cannot partition a Mosaic / Triton call. Sequence axes
      (queries are the row itself) select context-parallel attention. None, or no mesh set:
      one call.

  Returns:
    out: [batch, q_len, heads, v_dim] in q's dtype.
    max_logits: [heads] fp32, the largest scaled logit over allowed pairs of the whole batch
      (what QK-Clip needs).

  Raises:
    ValueError: an unknown `impl`, or heads not a multiple of kv_heads.
  """
  if impl == "auto":
    fallback = "xla_flash" if k.shape[1] >= FLASH_MIN_LENGTH else "xla"
    impl = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(target_platform(), fallback)
  if impl not in IMPLS:
    raise ValueError(f"attention impl={impl!r}: expected one of {IMPLS} or 'auto'")
  meshed = partition is not None and not jax.sharding.get_abstract_mesh().empty
  if meshed and q_index is None and len(partition) > 2 and partition[2] is not None:
    batch, heads, seq = partition
    return context_parallel.tree_attention(q, k, v, end, scale=scale, axis=seq, batch=batch,
                                           heads=heads)
  if impl != "xla" and q_index is None:
    kernel = functools.partial(_kernel(impl, target_platform()), scale=scale)
    if impl in _PALLAS and meshed:
      return _per_shard(kernel, q, k, v, end, *partition[:2])
    return kernel(q, k, v, end)
  b, lq, h, _ = q.shape
  kvh = k.shape[2]
  if h % kvh:
    raise ValueError(f"heads={h} is not a multiple of kv_heads={kvh}")
  if q_index is None:
    q_index = jnp.broadcast_to(jnp.arange(lq, dtype=jnp.int32), (b, lq))
  qg = q.reshape(b, lq, kvh, h // kvh, q.shape[-1])
  logits = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32) * scale
  mask = allowed(end, q_index)[:, None, None]  # [b, 1, 1, q, s]
  logits = jnp.where(mask, logits, MASK_VALUE)
  max_logits = jnp.max(logits, axis=(0, 3, 4)).reshape(h)
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v, preferred_element_type=jnp.float32)
  return out.reshape(b, lq, h, v.shape[-1]).astype(q.dtype), jax.lax.stop_gradient(max_logits)


def _per_shard(kernel, q, k, v, end, batch, heads) -> tuple[jax.Array, jax.Array]:
  """`kernel` on each (batch, head) shard; the max logits are reduced over the batch shards.

  Heads are split only where the mesh axes divide the key/value heads (a GQA group stays on
  one shard); otherwise every shard holds all heads of its batch rows.
  """
  mesh = jax.sharding.get_abstract_mesh()
  names = lambda axes: (axes,) if isinstance(axes, str) else tuple(axes or ())
  if heads is not None and k.shape[2] % math.prod(mesh.shape[a] for a in names(heads)):
    heads = None
  rows, head = PartitionSpec(batch, None, heads, None), PartitionSpec(heads)

  def local(q, k, v, end):
    out, max_logits = kernel(q, k, v, end)
    return out, (jax.lax.pmax(max_logits, names(batch)) if batch is not None else max_logits)

  run = jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, PartitionSpec(batch, None)),
                      out_specs=(rows, head), check_vma=False)  # pallas_call outputs carry no vma
  return run(q, k, v, end)


_TARGETS: list[str] = []


@contextlib.contextmanager
def compile_for(platform: str) -> Iterator[None]:
  """Chooses kernels for `platform` instead of the running backend while tracing.

  Ahead-of-time compilation for a TPU on a CPU host (trainer/aot.py) traces under
  `compile_for("tpu")`, so "auto" takes the TPU kernel and the Pallas TPU kernel lowers to
  Mosaic rather than to the interpreter.

  Args:
    platform: "tpu", "gpu" or "cpu".
  """
  _TARGETS.append(platform)
  try:
    yield
  finally:
    _TARGETS.pop()


def target_platform() -> str:
  """The platform kernels are chosen for: `compile_for`'s, else the running backend."""
  return _TARGETS[-1] if _TARGETS else jax.default_backend()


@functools.cache
def _kernel(impl: str, platform: str):
  """The kernel for `impl`; a Pallas kernel runs in interpret mode off its own platform."""
  if impl == "xla_flash":
    return tree_attention_xla.tree_attention
  kernel, native = _PALLAS[impl]
  return functools.partial(kernel, interpret=platform != native)
