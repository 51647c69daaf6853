"""Learning-rate schedules: linear warmup, then constant, cosine, linear or warmup-stable-decay."""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from trainer.optim.config import OptimizerConfig


def schedule(cfg: OptimizerConfig, peak: Optional[float] = None
             ) -> Callable[[Any], jax.Array]:
  """The learning rate as a function of the (0-based) step.

  Linear warmup to the peak over `warmup_steps` (lr = peak·(step+1)/warmup_steps), then by
  `cfg.schedule`: constant; cosine or linear decay to end_lr_ratio·peak at `total_steps`; or
  WSD, constant until the last `wsd_decay_fraction` of `total_steps`, then a linear or cosine
  (`wsd_decay_shape`) decay to end_lr_ratio·peak.

  Args:
    cfg: the optimizer settings.
    peak: the peak learning rate; None = `cfg.learning_rate`.

  Returns:
    step -> learning rate (fp32 scalar), traceable.
  """
  peak = cfg.learning_rate if peak is None else peak
  w, total, end = cfg.warmup_steps, cfg.total_steps, cfg.end_lr_ratio

  def decay(progress, shape):
    """1 at progress 0, down to end_lr_ratio at progress 1."""
    curve = 0.5 * (1 + jnp.cos(jnp.pi * progress)) if shape == "cosine" else 1.0 - progress
    return end + (1.0 - end) * curve

  def fn(step):
    step = jnp.asarray(step, jnp.float32)
    warm = jnp.minimum(1.0, (step + 1.0) / w) if w > 0 else jnp.float32(1.0)
    if cfg.schedule == "constant":
      factor = jnp.float32(1.0)
    elif cfg.schedule in ("cosine", "linear"):
      factor = decay(jnp.clip((step - w) / (total - w), 0.0, 1.0), cfg.schedule)
    else:  # wsd: the decay takes the last wsd_decay_fraction of the steps
      n = max(1, int(round(cfg.wsd_decay_fraction * total)))
      factor = decay(jnp.clip((step - (total - n)) / n, 0.0, 1.0), cfg.wsd_decay_shape)
    return peak * warm * factor

  return fn
