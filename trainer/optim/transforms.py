"""Small optax transformations the optimizer chain is built from: global-norm clipping that
records the norm, the per-leaf Muon shape scale, the layout of Muon's matrices on a mesh, and
the storage dtype of the state."""

from __future__ import annotations

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


def whole_matrix_spec(shape: tuple[int, ...], dims: MuonDimensionNumbers,
                      mesh) -> PartitionSpec | None:
  """A layout in which each matrix Muon orthogonalizes lies whole on one device.

  The leaf's batch dimensions (those outside `dims`: stacked layers, experts) take the mesh's
  axes, each the first batch dimension it divides; the matrix dimensions stay unsplit.

  Args:
    shape: the leaf's shape.
    dims: its Muon dimension numbers (reduction and output axes).
    mesh: the (abstract) mesh.

  Returns:
    The PartitionSpec, or None when the batch dimensions cannot take every device (then some
    devices would hold copies; the compiler's own layout is kept).
  """
  matrix = {a % len(shape) for a in (
      (dims.reduction_axis,) if isinstance(dims.reduction_axis, int) else dims.reduction_axis)}
  matrix |= {a % len(shape) for a in (
      (dims.output_axis,) if isinstance(dims.output_axis, int) else dims.output_axis)}
  left = {i: n for i, n in enumerate(shape) if i not in matrix}
  spec: list = [()] * len(shape)
  used = 1
  for axis, size in mesh.shape.items():
    if size == 1:
      continue
    for i in left:
      if left[i] % size == 0:
        spec[i], left[i], used = spec[i] + (axis,), left[i] // size, used * size
        break
  if used != mesh.size:
    return None
  return PartitionSpec(*(None if not a else a[0] if len(a) == 1 else a for a in spec))


def scale_by_muon_whole_matrices(ns_coeffs, ns_steps: int, beta: float, nesterov: bool,
                                 dims_fn: Callable[[Any], Any]) -> optax.GradientTransformation:
  """`optax.contrib.scale_by_muon` that, on a mesh, orthogonalizes each matrix where it lies whole.

  Under FSDP a stacked weight [layers, m, n] is split along m, and Newton–Schulz needs whole
  m x n matrices: left to itself the compiler gathers every stack onto every device (a 32B
  model's update then needs 128 GB per chip). Here, under a mesh (`jax.set_mesh`), each leaf
  whose batch dimensions (stacked layers, experts) can take every device
  (`whole_matrix_spec`) is moved so that each device holds whole matrices of its share, and
  Newton–Schulz runs on them inside `jax.shard_map`: each device orthogonalizes 1 / devices of
  the matrices and holds that share only. Other leaves, and every leaf without a mesh, take
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
      run = lambda x, c: orthogonalize_via_newton_schulz(x, c, ns_steps, dimension_numbers=dims)
      spec = whole_matrix_spec(tuple(x.shape), dims, mesh)
      if spec is None:
        return run(x, state.ns_coeffs)
      return jax.shard_map(run, mesh=mesh, in_specs=(spec, PartitionSpec()),
                           out_specs=spec)(x, state.ns_coeffs)

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
