"""The tree attention rule as a mask, and the logit value every implementation masks with."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite, so a fully masked row (never produced by the rule: a query always sees itself)
# cannot yield NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def allowed(end: jax.Array, q_index: jax.Array) -> jax.Array:
  """The tree rule `j <= q_index[i] < end[j]` as a mask.

  Args:
    end: [batch, kv_len] int, exclusive end of each key's subtree.
    q_index: [batch, q_len] int, row index of each query in the key array.

  Returns:
    [batch, q_len, kv_len] bool, True where query i may attend to key j.
  """
  j = jnp.arange(end.shape[-1])
  i = q_index[:, :, None]
  return (j[None, None, :] <= i) & (i < end[:, None, :])
