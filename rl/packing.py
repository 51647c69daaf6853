"""Packing trajectory trees into fixed-length rows and micro-batches (docs/design.md §3).

Each tree (one group) is cut into *parts* that fit a row, parts are placed first-fit decreasing
into rows, and rows are grouped into micro-batches (`TreeBatch`) so that a group never spans two
micro-batches. A row holds several parts back to back; within a part the nodes keep their tree's
pre-order, so `end`/`pred` are the tree's arrays renumbered and shifted by the part's start column.

Partition of a tree larger than a row. A *part* is an ancestor-closed set of the tree's nodes
(every node comes with its root path) kept in pre-order; nodes it does not own are context-only
*copies*. Copies keep their true depth as position, their `end` covers the part's nodes under
them, and every owner's `pred` (its parent or the parent's copy) lies in the same row, so every
sampled token is predicted from its full, true context. Two greedy steps:
  1. Items: walk the tree depth-first from the roots. A node whose subtree fits a row together
     with its root path (depth + subtree size <= row_len) is an item: its root path (copies)
     plus its whole subtree (owned). Any other node is a *spine* node: descend into its
     children; a spine node is carried by every item under it and owned by the first of them.
  2. Parts: items first-fit decreasing into parts, where an item costs only the nodes its part
     does not already hold (siblings share their carried root path, e.g. the prompt).
Every node is owned by exactly one part, and sequence entries point to owners. Cutting at
subtree boundaries keeps carried paths short (a cut inside a long trajectory would carry it
whole). A node deeper than a row (depth + 1 > row_len) - one LLM call longer than a row -
cannot be packed exactly and raises ValueError; every leaf fits, so step 1 always terminates.

Plain SFT packing is the degenerate case: one single-call tree per sequence (`pack_sequences`),
each a chain whose `end` is its own end.

Context parallelism splits a row into equal chunks over devices; a query's attention work is
its depth + 1 (its root path), so `pack(..., shards=n)` orders each row's parts to even out
the visible (query, key) pairs per chunk (`shard_pairs`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence

import numpy as np

from rl.tree import CallTokens, TrajectoryTokens, Tree, build_tree


@dataclasses.dataclass
class TreeBatch:
  """One micro-batch of fixed shapes (numpy; the trainer moves them to devices).

  Per-position arrays are [rows, row_len]; per-sequence arrays are [num_seqs, seq_len], one
  sequence per trajectory of every group in the batch.

  Attributes:
    tokens: [rows, row_len] int32 token id (padding 0).
    positions: [rows, row_len] int32 depth of the node in its tree (padding 0).
    end: [rows, row_len] int32 exclusive end column of the node's subtree in this row; query i
      attends to key j iff j <= i < end[j]; padding end = j + 1.
    pred: [rows, row_len] int32 column (same row) whose logits predict this token; -1 for
      roots and padding.
    group: [rows, row_len] int32 index of the tree (group) in pack's input list; -1 for
      padding.
    node: [rows, row_len] int32 node index within that tree; -1 for padding.
    owner: [rows, row_len] bool, a real position that is not a context-only copy (each node is
      an owner once).
    seq_index: [num_seqs, seq_len] int32 flat index row * row_len + col of each sampled
      token's owner (padding 0).
    seq_pred: [num_seqs, seq_len] int32 flat index of its predicting position, in the same row
      (padding 0).
    seq_tokens: [num_seqs, seq_len] int32 the sampled token id (padding 0).
    seq_valid: [num_seqs, seq_len] bool, real entries.
    fields: name -> [num_seqs, seq_len] float32: the Seq fields ("loss_mask", "turn",
      "logprobs", ...), 0 at padding and where a trajectory lacks the field.
    scalars: name -> [num_seqs] float32: the Seq scalars (0 where absent), plus "group".
    seq_trajectory: [num_seqs] int32 index of the trajectory within its group (tree.seqs).
    num_real_rows: int, the rows holding at least one token (the rest are all padding).
  """

  tokens: np.ndarray
  positions: np.ndarray
  end: np.ndarray
  pred: np.ndarray
  group: np.ndarray
  node: np.ndarray
  owner: np.ndarray
  seq_index: np.ndarray
  seq_pred: np.ndarray
  seq_tokens: np.ndarray
  seq_valid: np.ndarray
  fields: dict[str, np.ndarray]
  scalars: dict[str, np.ndarray]
  seq_trajectory: np.ndarray
  num_real_rows: int


@dataclasses.dataclass
class _Part:
  group: int
  nodes: np.ndarray  # [k] sorted node indices of the tree (ancestor-closed)
  owner: np.ndarray  # [k] bool, False for carried copies


def _check_depth(tree: Tree, row_len: int, group: int) -> None:
  """Raise ValueError naming the call (trajectory, turn, length) if a path exceeds a row."""
  deep = tree.positions + 1 > row_len
  if not deep.any():
    return
  for t, seq in enumerate(tree.seqs):
    too = deep[seq.index]
    if too.any():
      turn = seq.fields["turn"][too][0]
      length = int(tree.positions[seq.index[seq.fields["turn"] == turn]].max()) + 1
      raise ValueError(f"group {group} trajectory {t} call {int(turn)}: the call's length "
                       f"{length} (input + output tokens) exceeds row_len {row_len}; a call "
                       "longer than a row cannot be packed exactly")
  raise ValueError(f"group {group}: a context path of {int(tree.positions.max()) + 1} tokens "
                   f"exceeds row_len {row_len}")


def _siblings(end: np.ndarray, first: int, stop: int) -> list[int]:
  """The consecutive sibling subtrees starting at pre-order index `first`, up to `stop`."""
  out = []
  while first < stop:
    out.append(first)
    first = int(end[first])
  return out


def partition(tree: Tree, row_len: int, group: int = 0) -> list[_Part]:
  """Cut `tree` into ancestor-closed parts of at most row_len nodes (see the module docstring).

  Args:
    tree: one group's tree.
    row_len: the row length in tokens.
    group: the tree's group index, recorded in each part.

  Returns:
    The parts (sorted node indices of the tree, and which of them the part owns); one part
    for a tree that fits a row, none for an empty tree.

  Raises:
    ValueError: naming the call, if a call (input + output tokens) is longer than a row.
  """
  n, end, depth = len(tree), tree.end, tree.positions
  if n <= row_len:
    return [_Part(group, np.arange(n), np.ones(n, bool))] if n else []
  _check_depth(tree, row_len, group)
  # 1. items: maximal subtrees that fit a row with their root path (pre-order DFS over spines)
  items, path, pending = [], [], []  # item: (root, ancestors, owned spine nodes)
  stack = _siblings(end, 0, n)[::-1]
  while stack:
    v = stack.pop()
    del path[depth[v]:]  # now exactly v's ancestors (all spine nodes)
    if depth[v] + end[v] - v <= row_len:
      items.append((v, np.asarray(path, np.int64), np.asarray(pending, np.int64)))
      pending = []
    else:  # a spine node: carried by every item under it, owned by the first one
      pending.append(v)
      path.append(v)
      stack.extend(_siblings(end, v + 1, end[v])[::-1])  # its children
  # 2. first-fit decreasing of items into parts; an item costs its nodes not yet in the part
  parts = []  # [member [n] bool, owner [n] bool, size]
  for v, ancestors, owned in sorted(items, key=lambda it: -(len(it[1]) + end[it[0]] - it[0])):
    size = int(end[v] - v) + len(ancestors)
    part = next((p for p in parts if p[2] + size - p[0][ancestors].sum() <= row_len), None)
    if part is None:
      part = [np.zeros(n, bool), np.zeros(n, bool), 0]
      parts.append(part)
    part[2] += size - int(part[0][ancestors].sum())
    part[0][ancestors] = part[0][v:end[v]] = True
    part[1][owned] = part[1][v:end[v]] = True
  return [_Part(group, np.flatnonzero(m), o[m]) for m, o, _ in parts]


def _place(parts: list[_Part], free: list[int], max_rows: float, row_len: int):
  """First-fit of `parts` into rows with `free` space, opening rows up to max_rows: the row of
  each part, or None if they do not fit."""
  free, where = list(free), []
  for p in parts:
    r = next((r for r, f in enumerate(free) if f >= len(p.nodes)), len(free))
    if r == len(free):
      if r >= max_rows:
        return None
      free.append(row_len)
    free[r] -= len(p.nodes)
    where.append(r)
  return where


def pack(trees: list[Tree], row_len: int, rows_per_batch: int | None = None,
         seq_len: int | None = None, shards: int = 1) -> list[TreeBatch]:
  """Pack trees (one per group) into TreeBatches of [rows, row_len].

  Groups are taken largest first; each goes first-fit into the first micro-batch that can hold
  all its parts (each part first-fit into a row), else into a new one.

  With `shards` > 1 (rows split into that many equal chunks over the `sequence` mesh axis),
  the parts of each row are put in the order that minimises the largest chunk's number of
  visible (query, key) pairs (`shard_pairs`), so that context-parallel attention keeps the
  shards evenly busy; padding stays at the row's tail.

  Args:
    trees: one `Tree` per group; a tree's group index is its position in the list.
    row_len: the row length, a positive multiple of 128.
    rows_per_batch: None: one micro-batch with as many rows as needed; else every TreeBatch
      has exactly rows_per_batch rows (a group needing more raises ValueError).
    seq_len: padded sequence length; None: the longest sequence of the micro-batch rounded up
      to a multiple of 8 (at least 8).
    shards: sequence shards per row (divides row_len); 1 keeps the packing order.

  Returns:
    The micro-batches; each group's sequences are all in one of them.

  Raises:
    ValueError: for a bad row_len or rows_per_batch, a call longer than a row, a group that
      needs more than rows_per_batch rows, a seq_len shorter than a sequence, a sampled token
      at a root, or a trajectory scalar named "group".
  """
  if not isinstance(row_len, (int, np.integer)) or row_len <= 0 or row_len % 128:
    raise ValueError(f"row_len={row_len!r} must be a positive multiple of 128")
  if rows_per_batch is not None and rows_per_batch < 1:
    raise ValueError(f"rows_per_batch={rows_per_batch!r} must be >= 1 (or None)")
  if not isinstance(shards, (int, np.integer)) or shards < 1 or row_len % shards:
    raise ValueError(f"shards={shards!r} must be a positive divisor of row_len={row_len}")
  parts = [partition(tree, row_len, g) for g, tree in enumerate(trees)]
  max_rows = rows_per_batch or math.inf
  free: list[list[int]] = []  # micro-batch -> free columns of each row
  rows: list[list[list[_Part]]] = []  # micro-batch -> row -> parts
  members: list[list[int]] = []  # micro-batch -> groups
  for g in sorted(range(len(trees)), key=lambda g: -sum(len(p.nodes) for p in parts[g])):
    mine = sorted(parts[g], key=lambda p: -len(p.nodes))
    for b in range(len(rows)):
      where = _place(mine, free[b], max_rows, row_len)
      if where is not None:
        break
    else:
      where = _place(mine, [], max_rows, row_len)
      if where is None:
        need = max(_place(mine, [], math.inf, row_len)) + 1
        raise ValueError(f"group {g} needs {need} rows of row_len {row_len} but "
                         f"rows_per_batch={rows_per_batch}; a group must fit one micro-batch")
      b = len(rows)
      free.append([])
      rows.append([])
      members.append([])
    for p, r in zip(mine, where):
      if r == len(rows[b]):
        rows[b].append([])
        free[b].append(row_len)
      rows[b][r].append(p)
      free[b][r] -= len(p.nodes)
    members[b].append(g)
  if shards > 1:
    rows = [[_balance(row, trees, row_len, shards) for row in batch] for batch in rows]
  field_names = sorted({k for t in trees for s in t.seqs for k in s.fields})
  scalar_names = sorted({k for t in trees for s in t.seqs for k in s.scalars} | {"group"})
  if any("group" in s.scalars for t in trees for s in t.seqs):
    raise ValueError('a trajectory scalar is named "group", which pack sets to the group index')
  return [_batch(trees, rows[b], sorted(members[b]), row_len, rows_per_batch or len(rows[b]),
                 seq_len, field_names, scalar_names) for b in range(len(rows))]


def shard_pairs(end: np.ndarray, shards: int) -> np.ndarray:
  """Visible (query, key) pairs of each sequence shard of each row under the tree rule.

  Query i sees the keys j <= i with end[j] > i (its root path in the tree), so a shard's
  attention work is the sum of these counts over its contiguous chunk of columns.

  Args:
    end: [rows, row_len] int, a TreeBatch's `end`.
    shards: the number of equal chunks of a row (divides row_len).

  Returns:
    [rows, shards] int64 pair counts.
  """
  end = np.asarray(end)
  rows, length = end.shape
  opened = np.zeros((rows, length + 1), np.int64)
  opened[:, :length] += 1  # key j opens at column j ...
  np.add.at(opened, (np.arange(rows)[:, None], end), -1)  # ... and closes at end[j]
  return np.cumsum(opened, 1)[:, :length].reshape(rows, shards, length // shards).sum(-1)


# Orders tried per row: exhaustively up to this many parts, else a few heuristic and seeded
# random ones.
_EXHAUSTIVE_PARTS = 5
_RANDOM_ORDERS = 16


def _balance(row: list[_Part], trees: list[Tree], row_len: int, shards: int) -> list[_Part]:
  """The order of a row's parts with the smallest maximum of visible pairs per shard.

  A part's column costs are its nodes' depths + 1 (the keys each query sees: its root path,
  which the part carries), padding costs 1; the first order of the candidates wins ties, so an
  already balanced row keeps its order.
  """
  if len(row) < 2:
    return row
  costs = [trees[p.group].positions[p.nodes].astype(np.int64) + 1 for p in row]
  pad = np.ones(row_len - sum(len(c) for c in costs), np.int64)

  def worst(order):
    return np.concatenate([costs[i] for i in order] + [pad]).reshape(shards, -1).sum(1).max()

  n = len(row)
  if n <= _EXHAUSTIVE_PARTS:
    orders = list(itertools.permutations(range(n)))
  else:
    total = [c.sum() for c in costs]
    light = sorted(range(n), key=lambda i: total[i])
    zigzag = [light[k // 2] if k % 2 == 0 else light[-1 - k // 2] for k in range(n)]
    rng = np.random.default_rng(0)
    orders = [tuple(range(n)), tuple(light), tuple(light[::-1]), tuple(zigzag)] + [
        tuple(rng.permutation(n)) for _ in range(_RANDOM_ORDERS)]
  best = min(orders, key=worst)  # min keeps the first of equals
  return [row[i] for i in best]


def _batch(trees, rows, groups, row_len, num_rows, seq_len, field_names, scalar_names):
  """Fill the arrays of one TreeBatch from its rows of parts and its groups' seqs."""
  shape = (num_rows, row_len)
  tokens, positions = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
  end = np.tile(np.arange(1, row_len + 1, dtype=np.int32), (num_rows, 1))
  pred, group, node = (np.full(shape, -1, np.int32) for _ in range(3))
  owner = np.zeros(shape, bool)
  flat = {g: np.full(len(trees[g]), -1, np.int64) for g in groups}  # node -> owner flat index
  for r, row in enumerate(rows):
    col = 0
    for p in row:
      tree, k, cols = trees[p.group], len(p.nodes), slice(col, col + len(p.nodes))
      tokens[r, cols], positions[r, cols] = tree.tokens[p.nodes], tree.positions[p.nodes]
      end[r, cols] = np.searchsorted(p.nodes, tree.end[p.nodes]) + col
      parent = tree.pred[p.nodes]
      pred[r, cols] = np.where(parent >= 0, np.searchsorted(p.nodes, parent) + col, -1)
      group[r, cols], node[r, cols], owner[r, cols] = p.group, p.nodes, p.owner
      flat[p.group][p.nodes[p.owner]] = r * row_len + col + np.flatnonzero(p.owner)
      col += k
  seqs = [(g, t, s) for g in groups for t, s in enumerate(trees[g].seqs)]
  longest = max([len(s.index) for _, _, s in seqs], default=0)
  if seq_len is None:
    seq_len = max(8, -(-longest // 8) * 8)
  elif seq_len < longest:
    raise ValueError(f"seq_len={seq_len} is smaller than the longest sequence ({longest} sampled "
                     f"tokens) of a micro-batch holding groups {groups}")
  m = len(seqs)
  seq_index, seq_pred, seq_tokens = (np.zeros((m, seq_len), np.int32) for _ in range(3))
  seq_valid = np.zeros((m, seq_len), bool)
  fields = {k: np.zeros((m, seq_len), np.float32) for k in field_names}
  scalars = {k: np.zeros(m, np.float32) for k in scalar_names}
  for i, (g, t, s) in enumerate(seqs):
    idx, n = flat[g][s.index], len(s.index)
    if (roots := trees[g].pred[s.index] < 0).any():
      raise ValueError(f"group {g} trajectory {t}: sampled token {int(np.argmax(roots))} "
                       "is a root, so no position predicts it")
    seq_index[i, :n], seq_tokens[i, :n], seq_valid[i, :n] = idx, trees[g].tokens[s.index], True
    seq_pred[i, :n] = idx - idx % row_len + pred.reshape(-1)[idx]
    for k, v in s.fields.items():
      fields[k][i, :n] = v
    for k, v in s.scalars.items():
      scalars[k][i] = v
    scalars["group"][i] = g
  return TreeBatch(tokens=tokens, positions=positions, end=end, pred=pred, group=group, node=node,
                   owner=owner, seq_index=seq_index, seq_pred=seq_pred, seq_tokens=seq_tokens,
                   seq_valid=seq_valid, fields=fields, scalars=scalars,
                   seq_trajectory=np.asarray([t for _, t, _ in seqs], np.int32).reshape(m),
                   num_real_rows=len(rows))


def pack_sequences(sequences: Sequence[CallTokens | tuple[Sequence[int], Sequence[int]]],
                   row_len: int, rows_per_batch: int | None = None,
                   seq_len: int | None = None, shards: int = 1) -> list[TreeBatch]:
  """Ordinary sequence packing (SFT): each sequence becomes its own single-call tree.

  Each (prompt_ids, response_ids) pair, or a CallTokens with per-token fields such as
  "loss_mask", becomes tree i (group i) and is packed with `pack`; each packed sequence has
  `end` = its own end.

  Args:
    sequences: (prompt_ids, response_ids) pairs or `CallTokens`.
    row_len: as in `pack`.
    rows_per_batch: as in `pack`.
    seq_len: as in `pack`.
    shards: as in `pack`.

  Returns:
    The micro-batches, as `pack`.

  Raises:
    ValueError: as `pack`, and for a sequence with an empty prompt.
  """
  calls = [s if isinstance(s, CallTokens) else CallTokens(list(s[0]), list(s[1]))
           for s in sequences]
  return pack([build_tree([TrajectoryTokens([c])]) for c in calls], row_len, rows_per_batch,
              seq_len, shards)
