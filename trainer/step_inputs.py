"""Inputs of the train step: what a loss and correction need in a micro-batch, and the checks
run (plain Python, static shapes) before the jitted step sees a batch."""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from models.config import ModelConfig
from rl import corrections, losses
from trainer.batches import MicroBatches

# Losses whose per-token terms need advantages ("advantage", as a per-trajectory scalar or a
# per-token field).
_NO_ADVANTAGE = ("sft", "opd", "dpo", "kimi_pmd")


def required_inputs(loss_cfg: losses.LossConfig,
                    correction_cfg: Optional[corrections.CorrectionConfig] = None
                    ) -> list[tuple[str, str, str]]:
  """Lists every micro-batch input a loss and correction configuration needs.

  Args:
    loss_cfg: the loss.
    correction_cfg: the mismatch correction (None or kind "none": no sampler log-probs needed).

  Returns:
    [(where, name, why)]: where is "fields" (per token), "scalars" (per sequence) or "either"
    (advantage: a scalar or a field); why is the message for a missing input.
  """
  need = []
  c = loss_cfg
  if c.name not in _NO_ADVANTAGE:
    need.append(("either", "advantage", f"LossConfig.name={c.name!r} needs advantages"))
  if c.name in ("kimi_pmd", "dpo"):
    need.append(("scalars", "reward", f"LossConfig.name={c.name!r} needs rewards"))
  if c.kl_coef or c.name == "dpo":
    why = (f"LossConfig.kl_coef={c.kl_coef}" if c.kl_coef else "LossConfig.name='dpo'")
    need.append(("fields", "ref_logprobs", f"{why} needs reference log-probs (score the batch "
                 "with the reference policy: mb.with_fields(ref_logprobs=score(ref, mb)))"))
  if c.name == "opd" or c.opd_coef:
    need.append(("fields", "teacher_logprobs", "on-policy distillation needs teacher log-probs "
                 "(mb.with_fields(teacher_logprobs=make_score_fn(teacher_cfg)(teacher, mb)))"))
  if c.decoupled:
    need.append(("fields", "old_logprobs", "LossConfig.decoupled=True needs π_old"))
    need.append(("fields", "logprobs", "LossConfig.decoupled=True needs the sampler's log-probs"))
  if c.mask_failed_turns:
    need.append(("fields", "failed", "LossConfig.mask_failed_turns=True needs per-token "
                 "failed-turn flags"))
  if correction_cfg is not None and correction_cfg.kind != "none":
    need.append(("fields", "logprobs", f"CorrectionConfig.kind={correction_cfg.kind!r} needs "
                 "the sampler's log-probs"))
  return need


def check_micro_batches(mb: MicroBatches, model_cfg: ModelConfig,
                        loss_cfg: Optional[losses.LossConfig] = None,
                        correction_cfg: Optional[corrections.CorrectionConfig] = None,
                        computed: tuple[str, ...] = ()) -> None:
  """Checks a MicroBatches' shapes and inputs before the jitted step (plain Python, static shapes).

  Args:
    mb: the micro-batches: rows [M, R, L], per-sequence arrays [M, S, T], scalars [M, S].
    model_cfg: the model (checks `expert_ids` [M, moe_layers, R, L, k] for routing replay).
    loss_cfg: the loss whose inputs must be present (None: shapes only).
    correction_cfg: the mismatch correction whose inputs must be present.
    computed: inputs the step computes itself (e.g. "ref_logprobs" given a reference).

  Raises:
    ValueError: naming the micro-batch field for a missing input or a shape mismatch.
  """
  if not isinstance(mb, MicroBatches):
    raise ValueError(f"micro_batches: expected trainer.batches.MicroBatches, got "
                     f"{type(mb).__name__}")
  shape = lambda x: tuple(jnp.shape(x))
  rows = shape(mb.tokens)
  if len(rows) != 3:
    raise ValueError(f"micro_batches.tokens: shape {rows}, expected [M, R, L]")
  for name in ("positions", "end", "token_weights"):
    if shape(getattr(mb, name)) != rows:
      raise ValueError(f"micro_batches.{name}: shape {shape(getattr(mb, name))}, expected "
                       f"tokens' {rows}")
  seqs = shape(mb.seq_valid)
  if len(seqs) != 3 or seqs[0] != rows[0]:
    raise ValueError(f"micro_batches.seq_valid: shape {seqs}, expected [M={rows[0]}, S, T]")
  for name in ("seq_pred", "seq_tokens"):
    if shape(getattr(mb, name)) != seqs:
      raise ValueError(f"micro_batches.{name}: shape {shape(getattr(mb, name))}, expected "
                       f"seq_valid's {seqs}")
  for name, x in mb.fields.items():
    if shape(x) != seqs:
      raise ValueError(f"micro_batches.fields[{name!r}]: shape {shape(x)}, expected [M, S, T] = "
                       f"{seqs}")
  per_seq = [(f"scalars[{k!r}]", x) for k, x in mb.scalars.items()] + [("seq_id", mb.seq_id)]
  for where, x in per_seq:
    if shape(x) != seqs[:2]:
      raise ValueError(f"micro_batches.{where}: shape {shape(x)}, expected [M, S] = {seqs[:2]}")
  for where, name in (("fields", "loss_mask"), ("fields", "turn"), ("scalars", "group")):
    if name not in getattr(mb, where):
      raise ValueError(f"micro_batches.{where}[{name!r}] is missing (make_micro_batches sets it)")
  if mb.expert_ids is not None:
    if not model_cfg.is_moe:
      raise ValueError("micro_batches.expert_ids: routing replay given for a dense model")
    want = (rows[0], model_cfg.num_moe_layers, rows[1], rows[2], model_cfg.experts_per_token)
    if shape(mb.expert_ids) != want:
      raise ValueError(f"micro_batches.expert_ids: shape {shape(mb.expert_ids)}, expected "
                       f"[M, moe_layers, R, L, k] = {want}")
  if loss_cfg is None:
    return
  for where, name, why in required_inputs(loss_cfg, correction_cfg):
    if name in computed:
      continue
    present = (name in mb.fields or name in mb.scalars) if where == "either" else \
        name in getattr(mb, where)
    if not present:
      place = "fields or scalars" if where == "either" else where
      raise ValueError(f"micro_batches.{place}[{name!r}] is missing: {why}; present: fields "
                       f"{sorted(mb.fields)}, scalars {sorted(mb.scalars)}")
