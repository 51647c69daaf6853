"""Per-token log-probabilities and entropies from hidden states, in vocabulary-projection chunks.

A [tokens, vocab] fp32 logits array for a long row is large (32k tokens × 152k vocab = 19 GiB).
`token_logprobs` projects `chunk` tokens at a time inside a rematerialised scan, so neither the
forward nor the backward pass ever holds more than [chunk, vocab] logits.

Under a mesh (given the model config) the leading dimension stays sharded over the batch axes:
the scan walks the second dimension, each step projecting every sequence's next slice, so each
device projects only its own sequences (`chunk` counts a device's tokens) and the vocabulary
stays split over the `tensor` axis.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.sharding import axis_size, constrain


def _chunk_stats(h: jax.Array, w: jax.Array, targets: jax.Array, cfg: Optional[ModelConfig],
                 entropy: bool = True) -> tuple[jax.Array, Optional[jax.Array]]:
  """h [B, c, hidden], targets [B, c] -> (log p(targets), entropy or None), each [B, c] fp32."""
  logits = jnp.dot(h.astype(jnp.float32), w.astype(jnp.float32))
  if cfg is not None:
    logits = constrain(logits, ("batch", None, "act_vocab"), cfg)
  logp = jax.nn.log_softmax(logits, axis=-1)
  chosen = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  if not entropy:  # a [c, vocab] pass fewer, forward and rematerialised backward
    return chosen, None
  return chosen, -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def token_logprobs(hidden: jax.Array, lm_head: jax.Array, targets: jax.Array,
                   chunk: int = 1024, cfg: Optional[ModelConfig] = None, entropy: bool = True
                   ) -> tuple[jax.Array, Optional[jax.Array]]:
  """log p(targets) and the entropy of the predictive distribution, per position.

  Args:
    hidden: [batch, seq, hidden] (or [seq, hidden]) final-normed hidden states of the
      predicting positions.
    lm_head: [hidden, vocab] output projection.
    targets: [batch, seq] (or [seq]) int token ids to score.
    chunk: tokens projected at once (per device under a mesh).
    cfg: the model config; given, `batch` stays sharded over the mesh's batch axes and the
      logits' vocabulary over `tensor` (its sharding rules). None: no sharding constraints.
    entropy: compute the entropy; False returns None for it and saves its pass over the
      logits (the log-probs are the same to the bit).

  Returns:
    (logprobs, entropy), each shaped like `targets`, fp32 (entropy None without `entropy`).
    Entropy is returned for monitoring; its gradient flows too, like the log-probs'.
  """
  lead = targets.shape
  rows = lead[0] if len(lead) > 1 else 1
  h = hidden.reshape(rows, -1, hidden.shape[-1])
  t = targets.reshape(rows, -1).astype(jnp.int32)
  n = t.shape[1]
  shards = axis_size("batch", cfg) if cfg is not None else 1
  local_rows = rows // shards if rows % shards == 0 else rows
  step = max(1, min(chunk // max(local_rows, 1), n))  # positions per row per chunk
  pad = (-n) % step
  h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
  t = jnp.pad(t, ((0, 0), (0, pad)))
  k = (n + pad) // step
  # recompute logits in the backward
  stats = jax.checkpoint(_chunk_stats, static_argnums=(3, 4))

  def body(_, xs):
    h_i, t_i = xs
    if cfg is not None:
      h_i = constrain(h_i, ("batch", None, "act_embed"), cfg)
    return None, stats(h_i, lm_head, t_i, cfg, entropy)

  xs = (h.reshape(rows, k, step, -1).swapaxes(0, 1), t.reshape(rows, k, step).swapaxes(0, 1))
  _, (lp, ent) = jax.lax.scan(body, None, xs)  # [k, rows, step]
  unchunk = lambda a: a.swapaxes(0, 1).reshape(rows, -1)[:, :n].reshape(lead)
  return unchunk(lp), None if ent is None else unchunk(ent)


def sequence_logprobs(hidden: jax.Array, lm_head: jax.Array, seq_pred: jax.Array,
                      seq_tokens: jax.Array, chunk: int = 1024,
                      cfg: Optional[ModelConfig] = None, entropy: bool = True
                      ) -> tuple[jax.Array, Optional[jax.Array]]:
  """Per-sequence log-probs and entropies of sampled tokens on a tree-packed batch.

  Each sampled token c is scored from the logits of its predicting position pred[c] (its
  parent in the tree), so a branching position scores the first token of every child. The
  gather's backward is a scatter-add: gradients of shared positions sum over the sequences
  that use them, exactly as if each path were trained alone (docs/design.md §3).

  Args:
    hidden: [rows, row_len, hidden] final-normed hidden states of a TreeBatch.
    lm_head: [hidden, vocab].
    seq_pred: [num_seqs, seq_len] flat index (row * row_len + col) of each token's predictor.
    seq_tokens: [num_seqs, seq_len] the sampled token ids.
    chunk: tokens projected at once (per device under a mesh).
    cfg: the model config: given, the gathered states are sharded by sequence over the batch
      axes (each device scores its own sequences; see `token_logprobs`).
    entropy: compute the entropy (False: None, one pass over the logits fewer).

  Returns:
    (logprobs, entropy), each [num_seqs, seq_len] fp32; padding entries hold garbage values
    and must be masked by the batch's `seq_valid`.
  """
  flat = hidden.reshape(-1, hidden.shape[-1])
  gathered = jnp.take(flat, seq_pred, axis=0)  # [num_seqs, seq_len, hidden]
  if cfg is not None:
    gathered = constrain(gathered, ("batch", None, "act_embed"), cfg)
  return token_logprobs(gathered, lm_head, seq_tokens, chunk, cfg, entropy)
