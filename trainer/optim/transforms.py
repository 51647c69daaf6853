"""Small optax transformations the optimizer chain is built from: global-norm clipping that
records the norm, the per-leaf Muon shape scale, the layout of Muon's matrices on a mesh, and
the storage dtype of the state."""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec
from optax.contrib import MuonDimensionNumbers, MuonState, scale_by_muon
# (not exported by optax.contrib; the version is pinned in requirements-lock.txt)
from optax.contrib._muon import orthogonalize_via_newton_schulz

from trainer.optim.routing import param_suffix, path_names


class ClipState(NamedTuple):
  """The state of `clip_by_global_norm_with_stats`: the last pre-clip norm (logged as grad_norm)."""

  grad_norm: jax.Array  # global norm of the last gradient, before clipping


def clip_by_global_norm_with_stats(max_norm: float) -> optax.GradientTransformation:
  """`optax.clip_by_global_norm` that also records the pre-clip norm in its state.

  Args:
    max_norm: the largest global norm let through; <= 0 disables clipping (the norm is still
      recorded).

  Returns:
    The transformation; its state is a `ClipState`.
  """

  def init(params):
    del params
    return ClipState(jnp.zeros([], jnp.float32))

  def update(updates, state, params=None):
    del params, state
    norm = optax.tree.norm(updates)
    if max_norm > 0:
      factor = jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-30))
      updates = jax.tree.map(lambda g: (g * factor).astype(g.dtype), updates)
    return updates, ClipState(norm.astype(jnp.float32))

  return optax.GradientTransformation(init, update)


def scale_by_shape(scales_fn: Callable[[Any], Any]) -> optax.GradientTransformation:
  """Multiplies every leaf by its own constant (the Muon shape scale of its route).

  Args:
    scales_fn: tree -> same-structure tree of one float per leaf.

  Returns:
    A stateless transformation.
  """

  def update(updates, state, params=None):
    del params
    return jax.tree.map(lambda u, s: u * jnp.asarray(s, u.dtype), updates,
                        scales_fn(updates)), state

  return optax.GradientTransformation(optax.init_empty_state, update)


def scale_by_muon_whole_matrices(ns_coeffs, ns_steps: int, beta: float, nesterov: bool,
                                 dims_fn: Callable[[Any], Any],
                                 specs_fn: Callable[[Any, Any], Any] | None = None
                                 ) -> optax.GradientTransformation:
  """`optax.contrib.scale_by_muon` that, on a mesh, orthogonalizes each matrix where it lies whole.

  Newton–Schulz needs whole m x n matrices, and under FSDP / tensor parallelism a leaf's
  matrices are split along m and n: left to itself the compiler gathers every stack onto every
  device (a 32B model's update then needs 128 GB per chip; resharding DeepSeek-V3's expert
  stacks to another layout, over 700 GB). Here, under a mesh (`jax.set_mesh`) and with the
  leaves' layouts known (`specs_fn`), each leaf is handled inside `jax.shard_map` in its own
  layout: the device's block is viewed as [local matrices, m / shards, n / shards]; all-to-alls
  over the mesh axes that split m and n trade matrix pieces for whole matrices, so each device
  of such a group holds 1 / group of its block's matrices whole (the local count zero-padded
  to a multiple of the group: zero matrices stay zero); Newton–Schulz runs on them; the
  inverse all-to-alls put the result back in the leaf's layout. No device ever holds more than
  its share plus its block. Without a mesh or `specs_fn`, optax's own path. The values are
  optax's: the same momentum, bias corrections and iteration, the same state (`MuonState`), so
  checkpoints do not depend on the mesh.

  Args:
    ns_coeffs: the Newton–Schulz coefficients (as `scale_by_muon`).
    ns_steps: Newton–Schulz iterations.
    beta: the momentum decay.
    nesterov: use Nesterov momentum.
    dims_fn: updates tree -> tree of MuonDimensionNumbers (the routes' `dims`).
    specs_fn: (updates tree, mesh) -> tree of the leaves' PartitionSpecs on that mesh (the
      parameters' layouts, which the gradients and the momentum share).

  Returns:
    The transformation.

  References:
    Keller Jordan, "Muon: An optimizer for hidden layers in neural networks", 2024.
    Liu et al., "Muon is Scalable for LLM Training" (Moonlight), arXiv 2502.16982, 2025
    (distributed Muon: whole matrices per device).
  """
  inner = scale_by_muon(ns_coeffs=ns_coeffs, ns_steps=ns_steps, beta=beta, nesterov=nesterov,
                        weight_dimension_numbers=dims_fn)

  def update(updates, state, params=None):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or specs_fn is None:
      return inner.update(updates, state, params)
    # scale_by_muon's update (optax 0.2.8), with the orthogonalization placed per leaf
    mu = optax.tree.update_moment(updates, state.mu, beta, 1)
    count = optax.safe_increment(state.count)
    if nesterov:
      mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                            optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                            optax.tree.bias_correction(updates, beta, count))
    else:
      mu_hat = optax.tree.bias_correction(mu, beta, count)
    out = jax.tree.map(
        lambda x, dims, spec: orthogonalize_in_layout(x, dims, spec, mesh, state.ns_coeffs,
                                                      ns_steps),
        mu_hat, dims_fn(updates), specs_fn(updates, mesh),
        is_leaf=lambda d: isinstance(d, MuonDimensionNumbers))
    return out, MuonState(count=count, mu=mu, ns_coeffs=state.ns_coeffs)

  return optax.GradientTransformation(inner.init, update)


def orthogonalize_in_layout(x: jax.Array, dims: MuonDimensionNumbers, spec: PartitionSpec,
                            mesh, ns_coeffs: jax.Array, ns_steps: int) -> jax.Array:
  """`orthogonalize_via_newton_schulz(x)` computed in x's layout `spec` on `mesh`.

  Args:
    x: a leaf of stacked matrices (any batch dimensions; `dims` names m and n).
    dims: its Muon dimension numbers.
    spec: its PartitionSpec on `mesh`.
    mesh: the (abstract) mesh.
    ns_coeffs: [ns_steps or 1, 3] Newton–Schulz coefficients.
    ns_steps: iterations.

  Returns:
    The orthogonalized leaf, laid out as `spec` (see `scale_by_muon_whole_matrices`).
  """
  rank = x.ndim
  reduction = tuple(a % rank for a in _as_tuple(dims.reduction_axis))
  output = tuple(a % rank for a in _as_tuple(dims.output_axis))
  matrix = sorted(reduction + output)
  batch = [a for a in range(rank) if a not in matrix]
  perm = batch + matrix  # block -> [batch..., matrix dims in order]
  spec = tuple(spec) + (None,) * (rank - len(spec))
  # (dimension of the [local matrices, *matrix dims] view, mesh axis), minor mesh axis first
  moves = [(1 + i, name) for i, a in enumerate(matrix)
           for name in reversed(_axis_names(spec[a])) if mesh.shape[name] > 1]
  group = math.prod(mesh.shape[name] for _, name in moves)
  local_dims = MuonDimensionNumbers(reduction_axis=tuple(1 + matrix.index(a) for a in reduction),
                                    output_axis=tuple(1 + matrix.index(a) for a in output))

  def run(block, coeffs):
    y = block.transpose(perm)
    batch_shape = y.shape[:len(batch)]
    y = y.reshape((-1,) + y.shape[len(batch):])
    count = y.shape[0]
    y = jnp.pad(y, [(0, -count % group)] + [(0, 0)] * (y.ndim - 1))
    for dim, name in moves:  # pieces of matrices -> whole matrices, group x fewer
      y = jax.lax.all_to_all(y, name, 0, dim, tiled=True)
    y = orthogonalize_via_newton_schulz(y, coeffs, ns_steps, dimension_numbers=local_dims)
    for dim, name in reversed(moves):
      y = jax.lax.all_to_all(y, name, dim, 0, tiled=True)
    y = y[:count].reshape(batch_shape + y.shape[1:])
    return y.transpose(_inverse(perm))

  spec = PartitionSpec(*spec)
  return jax.shard_map(run, mesh=mesh, in_specs=(spec, PartitionSpec()), out_specs=spec)(
      x, ns_coeffs)


def _as_tuple(axis) -> tuple[int, ...]:
  return (axis,) if isinstance(axis, int) else tuple(axis)


def _axis_names(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _inverse(perm: list[int]) -> list[int]:
  out = [0] * len(perm)
  for i, p in enumerate(perm):
    out[p] = i
  return out


def with_state_dtype(inner: optax.GradientTransformation, dtype: Any
                     ) -> optax.GradientTransformationExtraArgs:
  """Stores the state's parameter-shaped moment leaves in `dtype` and computes in fp32.

  At init, floating leaves whose path ends with a parameter's path and whose shape equals that
  parameter's are cast; at update, leaves arriving in `dtype` are upcast to fp32, the inner
  update runs, and the same leaves are cast back. Scalars (counts, norms) and the Newton–Schulz
  coefficients stay as they are.

  Args:
    inner: the transformation whose state is stored.
    dtype: the storage dtype of the moments; float32 returns `inner` unchanged (with extra
      arguments support).

  Returns:
    The wrapped transformation.
  """
  dtype = jnp.dtype(dtype)
  inner = optax.with_extra_args_support(inner)
  if dtype == jnp.float32:
    return inner

  def init(params):
    state = inner.init(params)
    shapes = {path_names(p): tuple(x.shape) for p, x in jax.tree.leaves_with_path(params)}

    def cast(path, x):
      if (jnp.issubdtype(x.dtype, jnp.floating)
          and shapes.get(param_suffix(path)) == tuple(x.shape)):
        return x.astype(dtype)
      return x
    return jax.tree_util.tree_map_with_path(cast, state)

  def update(updates, state, params=None, **extra):
    low = jax.tree.map(lambda x: x.dtype == dtype, state)
    up = jax.tree.map(lambda x, m: x.astype(jnp.float32) if m else x, state, low)
    updates, new = inner.update(updates, up, params, **extra)
    new = jax.tree.map(lambda x, m: x.astype(dtype) if m else x, new, low)
    return updates, new

  return optax.GradientTransformationExtraArgs(init, update)
