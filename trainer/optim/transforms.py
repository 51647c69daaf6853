"""Small optax transformations the optimizer chain is built from: global-norm clipping that
records the norm, the per-leaf Muon shape scale, and the storage dtype of the state."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

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
