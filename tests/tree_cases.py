"""`end` arrays for attention tests: random trees, packed rows, causal rows, padding.

The rule (docs/design.md §3): query i may attend to key j iff j <= i < end[j], with `end[j]`
the exclusive end of j's subtree in depth-first pre-order.
"""

from __future__ import annotations

import numpy as np


def random_tree_end(rng: np.random.Generator, n: int, max_depth: int = 8,
                    max_branch: int = 16) -> tuple[np.ndarray, np.ndarray]:
  """(end, depth) of a random tree of exactly n nodes in pre-order, built as a trie of chains:
  nodes hang under a random earlier node whose depth < max_depth and whose child count <
  max_branch; chains (runs of single children) make it look like token sequences."""
  parent = np.full(n, -1)
  depth = np.zeros(n, np.int64)
  children = np.zeros(n, np.int64)
  for i in range(1, n):
    if rng.random() < 0.8 and depth[i - 1] < max_depth and children[i - 1] < max_branch:
      p = i - 1  # extend the current chain
    else:
      ok = np.flatnonzero((depth[:i] < max_depth) & (children[:i] < max_branch))
      p = int(rng.choice(ok)) if len(ok) else -1
    parent[i] = p
    if p >= 0:
      depth[i] = depth[p] + 1
      children[p] += 1
  return pre_order(parent)


def pre_order(parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Relabel a forest given by parent pointers into depth-first pre-order: (end, depth)."""
  n = len(parent)
  kids: list[list[int]] = [[] for _ in range(n)]
  roots = []
  for i, p in enumerate(parent):
    (kids[p] if p >= 0 else roots).append(i)
  end = np.zeros(n, np.int32)
  depth = np.zeros(n, np.int32)
  order = 0
  stack = [(r, 0, False) for r in reversed(roots)]
  start = {}
  while stack:
    node, d, done = stack.pop()
    if done:
      end[start[node]] = order
      continue
    start[node] = order
    depth[order] = d
    order += 1
    stack.append((node, d, True))
    stack.extend((c, d + 1, False) for c in reversed(kids[node]))
  return end, depth


def packed_row(parts: list[np.ndarray], length: int) -> np.ndarray:
  """Concatenate per-segment `end` arrays (each relative to its own start) into one row of
  `length`, padding the tail with end = j + 1."""
  out = np.arange(1, length + 1, dtype=np.int32)
  start = 0
  for e in parts:
    out[start:start + len(e)] = e + start
    start += len(e)
  assert start <= length
  return out


def causal_end(n: int, length: int | None = None) -> np.ndarray:
  """A single causal sequence of n tokens (end = n), padded to `length` with end = j + 1."""
  return packed_row([np.full(n, n, np.int32)], length or n)


def allowed(end: np.ndarray) -> np.ndarray:
  """Brute-force boolean mask [L, L]: allowed[i, j] = j <= i < end[j]."""
  i = np.arange(len(end))[:, None]
  j = np.arange(len(end))[None, :]
  return (j <= i) & (i < end[None, :])


def random_qkv(seed: int, batch: int, length: int, heads: int, kv_heads: int, qk_dim: int,
               v_dim: int, dtype=np.float32):
  """Random q [b, L, heads, qk_dim], k [b, L, kv_heads, qk_dim], v [b, L, kv_heads, v_dim] and
  an output cotangent [b, L, heads, v_dim] as jax arrays (numpy randoms: no per-shape compile)."""
  import jax.numpy as jnp
  rng = np.random.default_rng(seed)
  shapes = [(batch, length, heads, qk_dim), (batch, length, kv_heads, qk_dim),
            (batch, length, kv_heads, v_dim), (batch, length, heads, v_dim)]
  return tuple(jnp.asarray(rng.standard_normal(s, np.float32)).astype(dtype) for s in shapes)
