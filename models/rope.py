"""Rotary position embeddings: default, linear and YaRN frequencies; half-split or interleaved.

Frequencies follow the Hugging Face definitions (`modeling_rope_utils`) so imported weights give
identical logits.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig, yarn_get_mscale
from models.layers import round_to


def inv_freq_and_factor(cfg: ModelConfig) -> tuple[np.ndarray, float]:
  """RoPE inverse frequencies and the cos/sin attention factor of a config.

  Args:
    cfg: the model config (`rope_type`, `rope_theta`, `rope_factor`, YaRN fields).

  Returns:
    (inv_freq [rope_dim // 2] fp32, attention factor).

  References:
    Peng et al., "YaRN: Efficient Context Window Extension of Large Language Models",
    arXiv:2309.00071.
  """
  dim = cfg.rope_dim
  base = cfg.rope_theta
  pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
  inv_freq = (1.0 / pos_freqs).astype(np.float32)
  if cfg.rope_type == "default":
    return inv_freq, 1.0
  factor = cfg.rope_factor
  if cfg.rope_type == "linear":
    return (inv_freq / factor).astype(np.float32), 1.0
  # YaRN: blend interpolated and extrapolated frequencies with a linear ramp over dimensions.
  attention_factor = cfg.yarn_attention_factor
  if attention_factor is None:
    if cfg.yarn_mscale and cfg.yarn_mscale_all_dim:
      attention_factor = (yarn_get_mscale(factor, cfg.yarn_mscale)
                          / yarn_get_mscale(factor, cfg.yarn_mscale_all_dim))
    else:
      attention_factor = yarn_get_mscale(factor)

  def correction_dim(rotations):
    return (dim * math.log(cfg.rope_original_max_position / (rotations * 2 * math.pi))
            / (2 * math.log(base)))

  low, high = correction_dim(cfg.yarn_beta_fast), correction_dim(cfg.yarn_beta_slow)
  if cfg.yarn_truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # avoid a zero-width ramp
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrapolation = (1 - ramp).astype(np.float32)
  inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
  return inv_freq.astype(np.float32), float(attention_factor)


def cos_sin(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Rotary tables of positions.

  Args:
    cfg: the model config.
    positions: [batch, seq] integer positions.

  Returns:
    (cos, sin), each [batch, seq, rope_dim // 2] fp32, times the attention factor.
  """
  inv_freq, factor = inv_freq_and_factor(cfg)
  freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  return jnp.cos(freqs) * factor, jnp.sin(freqs) * factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool) -> jax.Array:
  """Rotate x by position.

  Args:
    x: [batch, seq, heads, dim].
    cos: [batch, seq, dim // 2] from `cos_sin`.
    sin: [batch, seq, dim // 2] from `cos_sin`.
    interleaved: False rotates (x[i], x[i + dim/2]) pairs (Qwen / Llama layout); True rotates
      (x[2i], x[2i+1]) pairs (DeepSeek weights).

  Returns:
    The rotated x, in x's dtype.

  References:
    Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding",
    arXiv:2104.09864.
  """
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  xf = x.astype(jnp.float32)
  if interleaved:
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)
  else:
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return round_to(out, x.dtype)
