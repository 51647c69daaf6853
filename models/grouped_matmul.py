"""Grouped (ragged) matmul of rows sorted by group, differentiable under `jax.vmap`.

`jax.lax.ragged_dot` has no batching rule unless every operand, the group sizes included, is
batched along axis 0 ("ragged_dot vmap over any dim but 0 - NYI"). That breaks `jax.vmap` of a
MoE forward over examples (weights shared) and, more quietly, every vmapped backward pass:
`jax.jacrev`, per-example gradients and `vmap(vjp)` batch only the cotangents, so the weight
gradient's ragged product sees a batched cotangent beside unbatched activations and sizes.

`grouped_matmul` is `ragged_dot` with its own reverse-mode rule (`jax.custom_vjp`) whose
forward and backward products are `jax.custom_batching.custom_vmap` functions: under `vmap`
they loop over the batch (`jax.lax.map`), each iteration the unbatched product, so a vmapped
result equals the per-example results bit for bit and no operand is broadcast to the batch.
Without `vmap` the products are the plain `ragged_dot` and its transposes: the same
computation as JAX's own rule. Forward-mode (`jax.jvp`) through it is not supported
(a `custom_vjp` restriction); nothing in training uses it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _looped(fn):
  """`fn` as a custom_vmap function whose batching rule maps the unbatched `fn` over the batch."""
  wrapped = jax.custom_batching.custom_vmap(fn)

  @wrapped.def_vmap
  def _rule(axis_size, in_batched, *args):
    full = [a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)
            for a, b in zip(args, in_batched)]
    # Only the batched operands are sliced; the others are closed over unchanged.
    batched = [a for a, b in zip(full, in_batched) if b]

    def one(xs):
      it = iter(xs)
      return wrapped(*[next(it) if b else a for a, b in zip(args, in_batched)])

    return jax.lax.map(one, batched), True

  return wrapped


@_looped
def _product(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
  """x [m, k] · w[group] [k, n] -> [m, n]."""
  return jax.lax.ragged_dot(x, w, sizes)


@_looped
def _weight_grad(x: jax.Array, w: jax.Array, g: jax.Array, sizes: jax.Array) -> jax.Array:
  """Σ over each group's rows of x_r^T g_r -> [groups, k, n] (the transpose of `_product` in w).

  `w` is only read for its type (the product is linear in it; XLA drops the forward), so the
  result carries w's varying mesh axes inside shard_map.
  """
  _, pull = jax.vjp(lambda w: jax.lax.ragged_dot(x, w, sizes), w)
  return pull(g)[0]


def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
  """Rows of `x` grouped by `sizes`, each group times its own weight matrix.

  Args:
    x: [rows, k] rows sorted by group (group 0's rows first); rows past the last group give
      zeros.
    w: [groups, k, n] one matrix per group.
    sizes: [groups] int32 rows per group.

  Returns:
    [rows, n] in the operands' dtype, as `jax.lax.ragged_dot`.
  """
  # Inside shard_map a custom VJP must return each cotangent with its input's varying mesh
  # axes: give all operands the union first (autodiff of the cast sums the cotangents back).
  varying = lambda a: set(jax.typeof(a).mat.varying)
  axes = set().union(*map(varying, (x, w, sizes)))
  x, w, sizes = (jax.lax.pcast(a, tuple(sorted(axes - varying(a))), to="varying")
                 for a in (x, w, sizes))
  return _grouped_matmul(x, w, sizes)


@jax.custom_vjp
def _grouped_matmul(x, w, sizes):
  return _product(x, w, sizes)


def _fwd(x, w, sizes):
  return _product(x, w, sizes), (x, w, sizes)


def _bwd(res, g):
  x, w, sizes = res
  dx = _product(g, jnp.swapaxes(w, 1, 2), sizes).astype(x.dtype)
  dw = _weight_grad(x.astype(g.dtype), w.astype(g.dtype), g, sizes).astype(w.dtype)
  return dx, dw, None


_grouped_matmul.defvjp(_fwd, _bwd)
