"""Reward-model losses: pairwise preference (Bradley-Terry), outcome (ORM) and process (PRM).

    loss = bradley_terry(r_chosen, r_rejected, margin=0.0)       # [P], [P] -> scalar
    loss = outcome_bce(scores, labels)                           # [N], [N] -> scalar
    loss = process_bce(step_scores, step_labels, step_mask)      # [N, S] x 3 -> scalar

Every input score is a raw head output (a logit: `models.value_head.ValueHead`'s value at the
scored token); labels are in [0, 1]; the losses are computed in f32 with log-sigmoids (no
overflow for large logits) and are weighted means, so they do not depend on the batch size.
A set of all-zero weights gives a loss of 0. `trainer.reward_model` trains with them.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

Array = jax.Array


def _weighted_mean(values: Array, weights: Optional[Array]) -> Array:
  values = values.astype(jnp.float32)
  if weights is None:
    return jnp.mean(values)
  weights = jnp.asarray(weights, jnp.float32)
  return jnp.sum(values * weights) / jnp.maximum(jnp.sum(weights), 1e-12)


def bradley_terry(chosen: Array, rejected: Array, weights: Optional[Array] = None,
                  margin: Array | float = 0.0) -> Array:
  """Pairwise preference loss of a reward model (Bradley-Terry; InstructGPT's RM loss).

      loss = Σ_i w_i · -log σ(r_chosen,i - r_rejected,i - m_i) / Σ_i w_i

  With a margin m > 0 the loss keeps pushing until the chosen reward leads by m (Llama 2's
  margin term).

  Args:
    chosen: [P] f32 rewards (logits) of the preferred sequences.
    rejected: [P] f32 rewards of the dispreferred ones.
    weights: optional [P] pair weights (e.g. a 0/1 validity mask); None = all 1.
    margin: a scalar or [P] margins m_i >= 0.

  Returns:
    The scalar f32 loss.
  """
  diff = chosen.astype(jnp.float32) - rejected.astype(jnp.float32) - margin
  return _weighted_mean(-jax.nn.log_sigmoid(diff), weights)


def _bce(logits: Array, labels: Array) -> Array:
  """Elementwise -[y log σ(s) + (1 - y) log(1 - σ(s))], via log σ(-s) = log(1 - σ(s))."""
  logits = logits.astype(jnp.float32)
  labels = jnp.asarray(labels, jnp.float32)
  return -(labels * jax.nn.log_sigmoid(logits) + (1.0 - labels) * jax.nn.log_sigmoid(-logits))


def outcome_bce(scores: Array, labels: Array, weights: Optional[Array] = None) -> Array:
  """Outcome reward model (ORM) loss: binary cross-entropy on each trajectory's final score.

      loss = Σ_i w_i · -[y_i log σ(s_i) + (1 - y_i) log(1 - σ(s_i))] / Σ_i w_i

  Args:
    scores: [N] f32 logits, the head's value at each trajectory's last token.
    labels: [N] targets in [0, 1] (the verifier's outcome: 1 = passed).
    weights: optional [N] weights; None = all 1.

  Returns:
    The scalar f32 loss.
  """
  return _weighted_mean(_bce(scores, labels), weights)


def process_bce(step_scores: Array, step_labels: Array, step_mask: Array) -> Array:
  """Process reward model (PRM) loss: binary cross-entropy per step, mean over all real steps.

      loss = Σ_{i,k} m_ik · -[y_ik log σ(s_ik) + (1 - y_ik) log(1 - σ(s_ik))] / Σ_{i,k} m_ik

  A step is one assistant turn (one LLM call) of a trajectory; its score is the head's value at
  the step's last token.

  Args:
    step_scores: [N, S] f32 logits per step (S: the most steps of a trajectory).
    step_labels: [N, S] targets in [0, 1].
    step_mask: [N, S] 1 for real steps, 0 for padding (or unlabelled steps).

  Returns:
    The scalar f32 loss (a token-free mean over all real steps of the batch).
  """
  return _weighted_mean(_bce(step_scores, step_labels), step_mask)
