"""Stacked micro-batches of tree-packed rows: what one compiled train step consumes.

    shape = BatchShape(row_len=1024, rows=8, seqs=64, seq_len=512, micro_batches=4)
    mb = make_micro_batches(groups, shape)       # groups: one list of TrajectoryTokens per task
    mb = mb.with_fields(ref_logprobs=score(ref_state, mb))   # [M, S, T], same layout
    state, metrics = step(state, mb)

`make_micro_batches` builds one trie per group (rl.tree), packs them (rl.packing.pack, which
keeps every group in one micro-batch) and pads everything to the fixed `BatchShape`, so the
step compiles once: M micro-batches of R rows of L tokens, S sequences of T sampled tokens
each. Padding micro-batches (all rows empty, no valid sequence) are skipped by the step at run
time, so a generous `micro_batches` bucket costs memory for the inputs only.

Per-token fields come from the calls' `fields` (the sampler's "logprobs", "failed", teacher or
reference log-probs when already known), per-trajectory scalars ("advantage", "reward", ...)
from `TrajectoryTokens.scalars`; both can be attached later by sequence (`with_fields`) or by
trajectory (`with_scalars`, through `seq_id`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping, Optional, Sequence, Union

import jax
import numpy as np

from rl.packing import TreeBatch, pack
from rl.tree import TrajectoryTokens, Tree, build_tree

Array = Union[jax.Array, np.ndarray]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["tokens", "positions", "end", "token_weights", "seq_pred", "seq_tokens",
                 "seq_valid", "seq_id", "fields", "scalars", "expert_ids"],
    meta_fields=[])
@dataclasses.dataclass
class MicroBatches:
  """M micro-batches of tree-packed rows stacked on a leading axis.

  Index one with `jax.tree.map(lambda x: x[i])`: the result is the same class with the leading
  axis removed, which `rl.batch.from_tree_batch` reads like a `TreeBatch`.

  Per position, [M, R, L] (R rows of L tokens; docs/design.md §3):
    tokens, positions, end  int32  the TreeBatch arrays; padding: 0, 0, j + 1
    token_weights           f32    logical count of the position for MoE load statistics: the
                                   number of LLM calls whose sequence contains the node (0 for
                                   padding and for context-only copies of a partitioned tree)
  Per sequence (one per trajectory), [M, S, T]:
    seq_pred, seq_tokens    int32  flat predictor index (row * L + col) and sampled token
    seq_valid               bool   real entries
    fields                  dict name -> f32 [M, S, T] ("loss_mask", "turn", "logprobs", ...)
  Per sequence, [M, S]:
    seq_id                  int32  index of the trajectory in make_micro_batches' input order
                                   (groups concatenated); -1 for padding sequences
    scalars                 dict name -> f32 [M, S] (always "group": the group's index in the
                                   input, -1 for padding; "advantage", "reward", ...)
  expert_ids  int32 [M, moe_layers, R, L, k] or None: routing to replay in the forward pass
                                   (-1: the position routes itself).
  """

  tokens: Array
  positions: Array
  end: Array
  token_weights: Array
  seq_pred: Array
  seq_tokens: Array
  seq_valid: Array
  seq_id: Array
  fields: dict
  scalars: dict
  expert_ids: Optional[Array] = None

  @property
  def num_micro_batches(self) -> int:
    """M, the length of the leading axis (padding micro-batches included)."""
    return self.tokens.shape[0]

  def replace(self, **kw) -> "MicroBatches":
    """A copy with the given fields replaced (`dataclasses.replace`)."""
    return dataclasses.replace(self, **kw)

  def with_fields(self, **arrays: Array) -> "MicroBatches":
    """A copy with per-token fields added or replaced.

    Args:
      **arrays: name -> [M, S, T] f32 per-token values in this batch's sequence layout (e.g.
        ref_logprobs from `score`).

    Returns:
      The new MicroBatches (the other fields are shared, not copied).

    Raises:
      ValueError: an array's shape is not [M, S, T].
    """
    shape = self.seq_valid.shape
    for name, x in arrays.items():
      if tuple(np.shape(x)) != tuple(shape):
        raise ValueError(f"with_fields: field {name!r} has shape {tuple(np.shape(x))}, expected "
                         f"[M, S, T] = {tuple(shape)}")
    return self.replace(fields={**self.fields, **arrays})

  def with_scalars(self, **per_trajectory: Array) -> "MicroBatches":
    """A copy with per-sequence scalars added or replaced, given per trajectory.

    Args:
      **per_trajectory: name -> [N] values, one per trajectory in make_micro_batches' input
        order (e.g. advantages from rl.advantages on the flat reward array); laid out through
        `seq_id` as f32 [M, S], padding sequences get 0.

    Returns:
      The new MicroBatches.

    Raises:
      ValueError: an array is not 1-D or has fewer values than there are trajectories.
    """
    seq_id = np.asarray(self.seq_id)
    n = int(seq_id.max()) + 1 if seq_id.size else 0
    new = {}
    for name, values in per_trajectory.items():
      values = np.asarray(values, np.float32)
      if values.ndim != 1 or len(values) < n:
        raise ValueError(f"with_scalars: scalar {name!r} has shape {values.shape}, expected one "
                         f"value per trajectory ([{n}] or more)")
      new[name] = np.where(seq_id >= 0, values[np.maximum(seq_id, 0)], 0.0).astype(np.float32)
    return self.replace(scalars={**self.scalars, **new})


@dataclasses.dataclass(frozen=True)
class BatchShape:
  """Fixed shapes of a step's micro-batches (one compile per distinct shape).

  A field left None is sized from the data and rounded up to a power of two, so varying data
  gives few distinct shapes; set every field for exactly one compile.

  Raises:
    ValueError: row_len is not a positive multiple of 128, or a count is not an int >= 1.
  """

  row_len: int = 1024                  # L: tokens per row, a multiple of 128
  rows: int = 8                        # R: rows per micro-batch (a multiple of the batch axes)
  seqs: Optional[int] = None           # S: sequences (trajectories) per micro-batch
  seq_len: Optional[int] = None        # T: sampled tokens per sequence (longest trajectory)
  micro_batches: Optional[int] = None  # M: micro-batches per step (padding ones are skipped)
  shards: int = 1                      # sequence-axis shards per row: balances their work

  def __post_init__(self):
    if not isinstance(self.row_len, int) or self.row_len <= 0 or self.row_len % 128:
      raise ValueError(f"BatchShape.row_len={self.row_len!r}: must be a positive multiple of 128")
    if not isinstance(self.shards, int) or self.shards < 1 or self.row_len % self.shards:
      raise ValueError(f"BatchShape.shards={self.shards!r}: must be an int >= 1 dividing "
                       f"row_len={self.row_len}")
    if not isinstance(self.rows, int) or self.rows < 1:
      raise ValueError(f"BatchShape.rows={self.rows!r}: must be an int >= 1")
    for name in ("seqs", "seq_len", "micro_batches"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"BatchShape.{name}={value!r}: must be an int >= 1 or None")


def _bucket(need: int, fixed: Optional[int], name: str, what: str, minimum: int = 1) -> int:
  if fixed is None:
    return 1 << (max(need, minimum, 1) - 1).bit_length()  # next power of two
  if need > fixed:
    raise ValueError(f"BatchShape.{name}={fixed}: {what} needs {need}")
  return fixed


def call_counts(tree: Tree) -> np.ndarray:
  """Per tree node, the number of LLM calls whose sequence (input + output) passes through it.

  This is the node's weight in unpacked training, where every call is its own row. A call's
  sequence ends at its last sampled token (the last entry of its turn in the trajectory's Seq),
  and a node lies on the paths of the calls ending in its subtree [v, end[v]). Calls without
  output tokens are not counted (they carry no loss either).

  Args:
    tree: one group's trie (`rl.tree.build_tree`); its seqs need the "turn" field.

  Returns:
    [n] f32 call counts, n = len(tree), in the tree's pre-order.
  """
  n = len(tree)
  ends = np.zeros(n, np.float64)
  for seq in tree.seqs:
    if len(seq.index):
      turn = seq.fields["turn"]
      last = np.flatnonzero(np.r_[turn[1:] != turn[:-1], True])
      np.add.at(ends, seq.index[last], 1.0)
  below = np.concatenate([[0.0], np.cumsum(ends)])
  return (below[tree.end] - below[np.arange(n)]).astype(np.float32)


def make_micro_batches(groups: Sequence[Union[Sequence[TrajectoryTokens], Tree]],
                       shape: BatchShape, *,
                       expert_ids: Optional[Sequence[np.ndarray]] = None) -> MicroBatches:
  """Packs the groups' trees into fixed-shape stacked micro-batches (host NumPy arrays).

  Args:
    groups: per group, a list of TrajectoryTokens (the G samples of one task) or an already
      built `Tree`; every group lands whole in one micro-batch.
    shape: the fixed shapes; a None field is sized from the data (next power of two).
    expert_ids: per group, [num_nodes, moe_layers, k] int expert choices of every tree node (in
      the tree's pre-order, e.g. `Tree.experts` from the engine's recorded routing; -1: the
      node routes itself), laid out for replay as `MicroBatches.expert_ids`; None: no routing
      replay.

  Returns:
    MicroBatches of shape [M, R, L] per position and [M, S, T] per sequence.

  Raises:
    ValueError: no groups, a BatchShape field too small for the data (the error names it), or
      expert_ids not matching the groups' trees.
  """
  trees = [g if isinstance(g, Tree) else build_tree(list(g)) for g in groups]
  if not trees:
    raise ValueError("make_micro_batches: no groups")
  if expert_ids is not None and len(expert_ids) != len(trees):
    raise ValueError(f"expert_ids: {len(expert_ids)} arrays for {len(trees)} groups")
  longest = max((len(s.index) for t in trees for s in t.seqs), default=0)
  T = _bucket(longest, shape.seq_len, "seq_len", "the longest trajectory (sampled tokens)", 8)
  try:
    batches = pack(trees, shape.row_len, shape.rows, T, shards=shape.shards)
  except ValueError as e:
    raise ValueError(f"BatchShape(row_len={shape.row_len}, rows={shape.rows}): {e}") from None
  S = _bucket(max(len(b.seq_valid) for b in batches), shape.seqs, "seqs",
              "a micro-batch (its groups' trajectories)")
  M = _bucket(len(batches), shape.micro_batches, "micro_batches",
              f"packing into micro-batches of {shape.rows} rows")
  R, L = shape.rows, shape.row_len
  offsets = np.cumsum([0] + [len(t.seqs) for t in trees])
  counts = [call_counts(t) for t in trees]

  def stack(get, fill, dtype, per_seq=False):
    first = (S, T) if per_seq else (R, L)
    out = np.full((M,) + first, fill, dtype)
    for i, b in enumerate(batches):
      x = get(b)
      out[(i,) + tuple(slice(0, d) for d in x.shape)] = x
    return out

  end = np.broadcast_to(np.arange(1, L + 1, dtype=np.int32), (M, R, L)).copy()
  for i, b in enumerate(batches):
    end[i] = b.end

  def weights(b: TreeBatch) -> np.ndarray:
    w = np.zeros(b.tokens.shape, np.float32)
    for g in np.unique(b.group[b.group >= 0]):
      owned = (b.group == g) & b.owner  # copies carry no weight: their owner counts the node
      w[owned] = counts[g][b.node[owned]]
    return w

  seq_id = np.full((M, S), -1, np.int32)
  scalars = {k: np.zeros((M, S), np.float32) for k in batches[0].scalars}
  scalars["group"][:] = -1
  for i, b in enumerate(batches):
    m = len(b.seq_valid)
    groups_of = b.scalars["group"].astype(np.int64)
    seq_id[i, :m] = offsets[groups_of] + b.seq_trajectory
    for k, v in b.scalars.items():
      scalars[k][i, :m] = v
  fields = {k: stack(lambda b: b.fields[k], 0.0, np.float32, True) for k in batches[0].fields}
  ids = None
  if expert_ids is not None:
    expert_ids = [np.asarray(x) for x in expert_ids]
    for g, x in enumerate(expert_ids):
      if x.ndim != 3 or len(x) != len(trees[g]) or x.shape[1:] != expert_ids[0].shape[1:]:
        raise ValueError(f"expert_ids[{g}]: shape {x.shape}, expected [num_nodes={len(trees[g])},"
                         f" moe_layers, k] like expert_ids[0] {expert_ids[0].shape}")
    layers, k = expert_ids[0].shape[1:]
    ids = np.full((M, layers, R, L, k), -1, np.int32)  # padding positions route themselves
    for i, b in enumerate(batches):
      for g in np.unique(b.group[b.group >= 0]):
        here = b.group == g  # copies too: they are forwarded like their owner
        ids[i][:, here] = expert_ids[g][b.node[here]].transpose(1, 0, 2)
  return MicroBatches(
      tokens=stack(lambda b: b.tokens, 0, np.int32),
      positions=stack(lambda b: b.positions, 0, np.int32),
      end=end,
      token_weights=stack(weights, 0.0, np.float32),
      seq_pred=stack(lambda b: b.seq_pred, 0, np.int32, True),
      seq_tokens=stack(lambda b: b.seq_tokens, 0, np.int32, True),
      seq_valid=stack(lambda b: b.seq_valid, False, bool, True),
      seq_id=seq_id, fields=fields, scalars=scalars, expert_ids=ids)


def describe(mb: MicroBatches) -> Mapping[str, int]:
  """Host-side counts of a batch's real contents, for logging.

  Args:
    mb: the batch (device or host arrays; read on the host).

  Returns:
    Counts of real micro-batches, rows, tree tokens, logical tokens (what unpacked training
    would process), sequences and loss tokens.
  """
  valid = np.asarray(mb.seq_valid)
  w = np.asarray(mb.token_weights)
  loss = valid * np.asarray(mb.fields["loss_mask"])
  return {"micro_batches": int((valid.any((1, 2)) | (w.sum((1, 2)) > 0)).sum()),
          "rows": int((w.sum(-1) > 0).sum()), "tree_tokens": int((w > 0).sum()),
          "logical_tokens": int(w.sum()), "sequences": int((np.asarray(mb.seq_id) >= 0).sum()),
          "loss_tokens": int(loss.sum())}
