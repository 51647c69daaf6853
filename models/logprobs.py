"""Per-token log-probabilities and entropies from hidden states, in vocabulary-projection chunks.

A [tokens, vocab] fp32 logits array for a long row is large (32k tokens × 152k vocab = 19 GiB).
`token_logprobs` projects `chunk` tokens at a time inside a rematerialised scan, so neither the
forward nor the backward pass ever holds more than [chunk, vocab] logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _chunk_stats(h: jax.Array, w: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
  logits = jnp.dot(h.astype(jnp.float32), w.astype(jnp.float32))
  logp = jax.nn.log_softmax(logits, axis=-1)
  chosen = jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
  entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
  return chosen, entropy


def token_logprobs(hidden: jax.Array, lm_head: jax.Array, targets: jax.Array,
                   chunk: int = 1024) -> tuple[jax.Array, jax.Array]:
  """log p(targets) and the entropy of the predictive distribution, per position.

  Args:
    hidden: [..., hidden] final-normed hidden states of the predicting positions.
    lm_head: [hidden, vocab] output projection.
    targets: [...] int token ids to score (same leading shape as hidden).
    chunk: tokens projected at once.

  Returns:
    (logprobs [...], entropy [...]) in fp32. Entropy is returned for monitoring; its gradient
    flows too, like the log-probs'.
  """
  lead = targets.shape
  h = hidden.reshape(-1, hidden.shape[-1])
  t = targets.reshape(-1).astype(jnp.int32)
  n = t.shape[0]
  chunk = max(1, min(chunk, n))
  pad = (-n) % chunk
  h = jnp.pad(h, ((0, pad), (0, 0)))
  t = jnp.pad(t, (0, pad))
  stats = jax.checkpoint(_chunk_stats)  # recompute a chunk's logits in the backward pass

  def body(_, xs):
    return None, stats(xs[0], lm_head, xs[1])

  _, (lp, ent) = jax.lax.scan(body, None, (h.reshape(-1, chunk, h.shape[-1]),
                                          t.reshape(-1, chunk)))
  return lp.reshape(-1)[:n].reshape(lead), ent.reshape(-1)[:n].reshape(lead)


def sequence_logprobs(hidden: jax.Array, lm_head: jax.Array, seq_pred: jax.Array,
                      seq_tokens: jax.Array, chunk: int = 1024) -> tuple[jax.Array, jax.Array]:
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
    chunk: tokens projected at once.

  Returns:
    (logprobs, entropy), each [num_seqs, seq_len] fp32; padding entries hold garbage values
    and must be masked by the batch's `seq_valid`.
  """
  flat = hidden.reshape(-1, hidden.shape[-1])
  return token_logprobs(jnp.take(flat, seq_pred, axis=0), lm_head, seq_tokens, chunk)
