"""Per-sequence arrays that every RL loss consumes, and the global counts that normalise them.

A *sequence* is one trajectory's sampled tokens in order (docs/design.md §3): on a tree-packed
batch they are gathered from the flat per-token log-probs with `TreeBatch.seq_index`, unpacked
they are just the trajectory's tokens. Losses only ever see `SeqBatch`, so they work on trees,
packed rows and plain sequences unchanged.

Losses are masked *sums* whose normalisation is a per-token scale computed from `Counts` of the
whole (global) batch. Split a batch into micro-batches or data-parallel shards, sum the shards'
losses and gradients, and the result equals the whole batch's - provided `Counts` are computed
once on the whole batch (`global_counts`) and a group never straddles two shards.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

Array = jax.Array


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["num_tokens", "num_seqs", "num_groups"], meta_fields=[])
@dataclasses.dataclass
class Counts:
  """Global counts of the whole batch (all micro-batches, all data-parallel shards).

  Attributes:
    num_tokens: loss tokens (the sum of `mask`), a 0-d f32.
    num_seqs: sequences with at least one loss token, a 0-d f32.
    num_groups: groups with at least one such sequence, a 0-d f32.
  """

  num_tokens: Array
  num_seqs: Array
  num_groups: Array


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["logprobs", "mask", "advantages", "old_logprobs", "sampler_logprobs",
                 "ref_logprobs", "teacher_logprobs", "entropy", "weights", "turn", "failed",
                 "reward", "group", "counts"],
    meta_fields=[])
@dataclasses.dataclass
class SeqBatch:
  """One (micro-)batch of sequences: [S, T] per token, [S] per sequence.

  Attributes:
    logprobs: [S, T] f32 log π_θ(token) under the policy being trained (differentiated).
    mask: [S, T] f32, 1 = token in the loss (valid entry and loss mask), else 0.
    advantages: [S, T] f32 per-token advantage (a sequence advantage broadcast over T).
    old_logprobs: [S, T] f32 log π_old, the trust-region policy (None: on-policy,
      sg(logprobs)).
    sampler_logprobs: [S, T] f32 log μ from the sampler (behaviour policy), or None.
    ref_logprobs: [S, T] f32 log π_ref for KL terms, or None.
    teacher_logprobs: [S, T] f32 teacher log-probs for on-policy distillation, or None.
    entropy: [S, T] f32 policy entropy at each token (entropy bonus), or None.
    weights: [S, T] f32 per-token correction weight/mask from rl.corrections (IS truncation,
      IcePop, ...); treated as a constant; None = 1.
    turn: [S, T] i32 index of the LLM call (turn) that sampled the token, or None.
    failed: [S, T] f32, 1 where the token's turn made a failed tool call (error-masked SFT),
      or None.
    reward: [S] f32 trajectory reward (None if unused).
    group: [S] i32 group id (the task's G samples; both sides of a DPO pair).
    counts: global counts (see `global_counts`).
  """

  logprobs: Array
  mask: Array
  advantages: Optional[Array] = None
  old_logprobs: Optional[Array] = None
  sampler_logprobs: Optional[Array] = None
  ref_logprobs: Optional[Array] = None
  teacher_logprobs: Optional[Array] = None
  entropy: Optional[Array] = None
  weights: Optional[Array] = None
  turn: Optional[Array] = None
  failed: Optional[Array] = None
  reward: Optional[Array] = None
  group: Optional[Array] = None
  counts: Optional[Counts] = None

  def replace(self, **kw) -> "SeqBatch":
    """A copy with the given fields replaced (`dataclasses.replace`)."""
    return dataclasses.replace(self, **kw)


def global_counts(mask, group) -> Counts:
  """Counts of a whole batch from its mask and group ids (jit-compatible).

  Call it on the whole batch, before splitting it into micro-batches or shards.

  Args:
    mask: [S, T] 0/1 loss mask.
    group: [S] int group ids.

  Returns:
    `Counts` of 0-d f32 scalars.
  """
  mask = jnp.asarray(mask, jnp.float32)
  group = jnp.asarray(group)
  live = (mask.sum(-1) > 0).astype(jnp.float32)
  same = (group[:, None] == group[None, :]).astype(jnp.float32)
  # each live sequence contributes 1/(live members of its group): the groups sum to 1 each
  groups = jnp.sum(live / jnp.maximum(same @ live, 1.0))
  return Counts(num_tokens=mask.sum(), num_seqs=live.sum(), num_groups=groups)


def from_tree_batch(batch, logprobs: Array, entropy: Optional[Array] = None, *,
                    counts: Optional[Counts] = None, advantage: str = "advantage",
                    sampler: str = "logprobs") -> SeqBatch:
  """A `SeqBatch` from a `rl.packing.TreeBatch` and the log-probs of its sampled tokens.

  Fields are read from the batch: `mask` = seq_valid * loss_mask; advantages from the scalar
  `advantage` (broadcast) or the per-token field of that name; sampler log-probs from the field
  `sampler`; "old_logprobs", "ref_logprobs", "teacher_logprobs", "failed" fields when present;
  `turn` from the "turn" field; reward/group from the scalars.

  Args:
    batch: a `rl.packing.TreeBatch`.
    logprobs: [S, T] f32 per-sequence log-probs of the sampled tokens, e.g.
      `models.logprobs.sequence_logprobs` or `gather(flat, batch.seq_index)`.
    entropy: [S, T] f32 policy entropy, or None.
    counts: the whole batch's `Counts`; None: this batch's own counts (correct only when it
      is the whole batch).
    advantage: the name of the per-token field, or else per-sequence scalar, holding the
      advantages (neither: advantages None).
    sampler: the name of the per-token field holding the sampler's log-probs.

  Returns:
    The `SeqBatch` (`weights` None).
  """
  f, s = batch.fields, batch.scalars
  mask = jnp.asarray(batch.seq_valid, jnp.float32) * jnp.asarray(f["loss_mask"])
  get = lambda name: jnp.asarray(f[name]) if name in f else None
  if advantage in f:
    adv = jnp.asarray(f[advantage])
  elif advantage in s:
    adv = jnp.broadcast_to(jnp.asarray(s[advantage])[:, None], mask.shape)
  else:
    adv = None
  group = jnp.asarray(s["group"]).astype(jnp.int32)
  return SeqBatch(
      logprobs=logprobs, mask=mask, advantages=adv, old_logprobs=get("old_logprobs"),
      sampler_logprobs=get(sampler), ref_logprobs=get("ref_logprobs"),
      teacher_logprobs=get("teacher_logprobs"), entropy=entropy, weights=None,
      turn=jnp.asarray(f["turn"]).astype(jnp.int32), failed=get("failed"),
      reward=jnp.asarray(s["reward"]) if "reward" in s else None, group=group,
      counts=counts if counts is not None else global_counts(mask, group))


def gather(flat: Array, seq_index: Array) -> Array:
  """Per-sequence values [S, T] from per-position values of a TreeBatch.

  The backward pass scatter-adds, summing shared positions over sequences.

  Args:
    flat: per-position values, [rows, row_len] or flat.
    seq_index: [S, T] int flat indices (`TreeBatch.seq_index`).

  Returns:
    [S, T] values of `flat`'s dtype.
  """
  return jnp.take(flat.reshape(-1), seq_index)
