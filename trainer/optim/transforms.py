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
from optax.contrib._muon import _compute_muon_reshape, orthogonalize_via_newton_schulz

from trainer.optim.routing import param_suffix, path_names

MATRICES = MuonDimensionNumbers(reduction_axis=(1,), output_axis=(2,))  # [matrices, m, n]


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


def whole_matrix_axes(matrices: int, mesh) -> tuple[str, ...] | None:
  """The mesh axes to split `matrices` whole matrices over, one share per device.

  Args:
    matrices: how many matrices a leaf holds (the product of its batch dimensions: stacked
      layers, experts, heads).
    mesh: the (abstract) mesh.

  Returns:
    Every mesh axis of size > 1 when their product divides `matrices`, else None (some
    devices would hold copies; the compiler's own layout is kept).
  """
  axes = tuple(a for a, n in mesh.shape.items() if n > 1)
  size = math.prod(mesh.shape[a] for a in axes)
  return axes if axes and matrices % size == 0 else None


def scale_by_muon_whole_matrices(ns_coeffs, ns_steps: int, beta: float, nesterov: bool,
                                 dims_fn: Callable[[Any], Any]) -> optax.GradientTransformation:
  """`optax.contrib.scale_by_muon` that, on a mesh, orthogonalizes each matrix where it lies whole.

  Under FSDP a stacked weight [layers, m, n] is split along m, and Newton–Schulz needs whole
  m x n matrices: left to itself the compiler gathers every stack onto every device (a 32B
  model's update then needs 128 GB per chip). Here, under a mesh (`jax.set_mesh`), each leaf
  is viewed as optax does, [matrices, m, n] (stacked layers x experts x heads flattened), and
  when the mesh divides the number of matrices (`whole_matrix_axes`) the matrices are split
  over every device and Newton–Schulz runs on them inside `jax.shard_map`: each device
  orthogonalizes 1 / devices of the matrices and holds that share only. Other leaves, and every leaf without a mesh, take
  optax's own path. The values are optax's: the same momentum, bias corrections and
  iteration, the same state (`MuonState`), so checkpoints do not depend on the mesh.

  Args:
    ns_coeffs: the Newton–Schulz coefficients (as `scale_by_muon`).
    ns_steps: Newton–Schulz iterations.
    beta: the momentum decay.
    nesterov: use Nesterov momentum.
    dims_fn: updates tree -> tree of MuonDimensionNumbers (the routes' `dims`).

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
    if mesh.empty:
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

    def orthogonalize(x, dims):
      # optax's own [matrices, m, n] view of the leaf (batch dimensions flattened)
      to_matrices, from_matrices = _compute_muon_reshape(x, dims)
      xs = to_matrices(x)
      axes = whole_matrix_axes(xs.shape[0], mesh)
      if axes is None:
        return orthogonalize_via_newton_schulz(x, state.ns_coeffs, ns_steps,
                                               dimension_numbers=dims)
      run = lambda a, c: orthogonalize_via_newton_schulz(a, c, ns_steps,
                                                         dimension_numbers=MATRICES)
      spec = PartitionSpec(axes, None, None)
      return from_matrices(jax.shard_map(run, mesh=mesh, in_specs=(spec, PartitionSpec()),
                                         out_specs=spec)(xs, state.ns_coeffs))

    out = jax.tree.map(orthogonalize, mu_hat, dims_fn(updates),
                       is_leaf=lambda d: isinstance(d, MuonDimensionNumbers))
    return out, MuonState(count=count, mu=mu, ns_coeffs=state.ns_coeffs)

  return optax.GradientTransformation(inner.init, update)


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
