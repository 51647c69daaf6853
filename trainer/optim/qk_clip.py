"""QK-Clip: after the base optimizer's step, rescale the query and key weights of every attention
head whose largest pre-softmax logit of the step exceeded τ, so that it lands on τ."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from models.config import ModelConfig
from trainer.optim.routing import path_names


class QKClipState(NamedTuple):
  """The state of `qk_clip`: what the last update did (logged by `trainer.optim.metrics`)."""

  clipped_heads: jax.Array  # number of (layer, head) pairs clipped by the last update
  max_logit: jax.Array  # largest max logit seen by the last update


def qk_clip(model_cfg: ModelConfig, tau: float = 100.0, alpha: float = 0.5
            ) -> optax.GradientTransformationExtraArgs:
  """QK-Clip as an optax transformation that takes this step's max logits as an extra argument.

  `update(updates, state, params, *, max_logits)`, with `max_logits` [num_layers, num_heads]
  this step's per-layer per-head max pre-softmax logit S over allowed pairs (softmax scale
  included): `aux["max_logits"]` of the forward pass, the max over micro-batches when
  accumulating. It must be global over data-parallel shards: inside one jitted SPMD step the
  model's `jnp.max` over the batch is already global (GSPMD inserts the all-reduce); a
  multi-controller loop that computes it per host must all-reduce it (max) first. Rows are in
  model layer order: `dense_layers` first, then `moe_layers`.

  With W' = params + updates (the base optimizer's result), every head with S > τ gets
  γ = τ/S (others γ = 1), and the returned updates are W'' − params, where W'' is W' with
  - MLA: head h's no-RoPE query columns ×γ^α, its no-RoPE key columns of kv_b_proj ×γ^(1−α),
    its rotary query columns ×γ; the shared rotary key (kv_a_proj) and the values untouched;
  - GQA/MHA: each key head (shared by a group of query heads) ×κ with
    κ = (min γ in the group)^(1−α), each query head ×γ_h/κ, q/k biases with their weights;
  so every head's logits scale by exactly its own γ: clipped heads land on τ, other heads keep
  their logits, and groups entirely under τ are left bit-identical. The optimizer state
  (momentum) is not rescaled.

  Args:
    model_cfg: the model whose attention weights are clipped.
    tau: the logit threshold τ (Kimi K2: 100).
    alpha: the balance α between the query and key sides.

  Returns:
    The transformation; its state is a `QKClipState` (heads clipped and the largest max logit
    of the last update).

  Raises:
    ValueError: for a GQA model with q/k RMSNorm (`qk_norm`), whose shared norm gains make
      per-head rescaling impossible; at update, for missing `params` or `max_logits`, or
      `max_logits` of the wrong shape.

  References:
    Kimi Team, "Kimi K2: Open Agentic Intelligence", arXiv 2507.20534, 2025 (§2.1, MuonClip,
    Algorithm 1).
  """
  if model_cfg.attention == "gqa" and model_cfg.qk_norm:
    raise ValueError(
        "QK-Clip cannot be used with qk_norm=True: Qwen3-style q/k RMSNorm already bounds the "
        "attention logits, and its norm gains are shared across heads so logits cannot be "
        "rescaled per head by scaling weights. Use optimizer.name='muon' or 'adamw'.")

  def init(params):
    del params
    return QKClipState(jnp.zeros([], jnp.int32), jnp.zeros([], jnp.float32))

  def update(updates, state, params=None, *, max_logits=None, **extra):
    del state, extra
    if params is None:
      raise ValueError("qk_clip needs params")
    s = _checked_max_logits(max_logits, model_cfg)
    over = s > tau
    gamma = jnp.where(over, tau / jnp.where(over, s, 1.0), 1.0)
    scales = _weight_scales(model_cfg, gamma, alpha)

    def one(path, u, p):
      scale = scales.get(path_names(path))
      if scale is None:
        return u
      # u + (p + u)(s − 1): p + result = (p + u)·s, and exactly u where s == 1.
      return (u + (p + u) * (scale - 1).astype(u.dtype)).astype(u.dtype)

    new = jax.tree_util.tree_map_with_path(one, updates, params)
    return new, QKClipState(over.sum().astype(jnp.int32), s.max())

  return optax.GradientTransformationExtraArgs(init, update)


def _checked_max_logits(max_logits, model_cfg: ModelConfig) -> jax.Array:
  """`max_logits` as fp32 [layers, heads]; raises if it is missing or of another shape."""
  if max_logits is None:
    raise ValueError("qk_clip needs this step's max_logits [num_layers, num_heads] "
                     "(aux['max_logits']) passed as update(..., max_logits=...)")
  s = jnp.asarray(max_logits, jnp.float32)
  want = (model_cfg.num_layers, model_cfg.num_heads)
  if s.shape != want:
    raise ValueError(f"qk_clip: max_logits has shape {s.shape}, expected [layers={want[0]}, "
                     f"heads={want[1]}]")
  return s


def _weight_scales(model_cfg: ModelConfig, gamma: jax.Array, alpha: float
                   ) -> dict[tuple[str, ...], jax.Array]:
  """{parameter path: factor broadcastable to the parameter} from γ [layers, heads]."""
  stacks = {"dense_layers": (0, model_cfg.num_dense_layers),
            "moe_layers": (model_cfg.num_dense_layers, model_cfg.num_moe_layers)}
  per_stack = _mla_scales if model_cfg.attention == "mla" else _gqa_scales
  scales = {}
  for stack, (start, n) in stacks.items():
    if n:
      for leaf, scale in per_stack(model_cfg, gamma[start:start + n], alpha).items():
        scales[(stack,) + leaf] = scale
  return scales


def _mla_scales(model_cfg: ModelConfig, gamma: jax.Array, alpha: float
                ) -> dict[tuple[str, ...], jax.Array]:
  """MLA: {path inside a block: factor} for one stack's γ [layers, heads]: the query's no-RoPE
  columns γ^α and rotary columns γ, kv_b_proj's no-RoPE key columns γ^(1−α), values 1."""
  nope, rope, v = model_cfg.qk_nope_head_dim, model_cfg.qk_rope_head_dim, model_cfg.v_head_dim
  g = gamma[:, :, None]  # [l, h, 1]
  q = jnp.concatenate([jnp.broadcast_to(g ** alpha, g.shape[:2] + (nope,)),
                       jnp.broadcast_to(g, g.shape[:2] + (rope,))], -1)
  kv = jnp.concatenate([jnp.broadcast_to(g ** (1 - alpha), g.shape[:2] + (nope,)),
                        jnp.ones(g.shape[:2] + (v,), g.dtype)], -1)
  q_name = "q_proj" if model_cfg.q_lora_rank is None else "q_b_proj"
  return {("attn", q_name, "kernel"): q[:, None], ("attn", "kv_b_proj", "kernel"): kv[:, None]}


def _gqa_scales(model_cfg: ModelConfig, gamma: jax.Array, alpha: float
                ) -> dict[tuple[str, ...], jax.Array]:
  """GQA/MHA: {path inside a block: factor} for one stack's γ [layers, heads]: key head κ =
  (min γ of its group)^(1−α), query head γ/κ, biases with their kernels."""
  kvh = model_cfg.num_kv_heads
  grouped = gamma.reshape(gamma.shape[0], kvh, model_cfg.num_heads // kvh)
  kappa = jnp.min(grouped, axis=-1) ** (1 - alpha)  # [l, kvh]
  q = (grouped / kappa[..., None]).reshape(gamma.shape)  # [l, h]
  return {("attn", "q_proj", "kernel"): q[:, None, :, None],
          ("attn", "q_proj", "bias"): q[:, :, None],
          ("attn", "k_proj", "kernel"): kappa[:, None, :, None],
          ("attn", "k_proj", "bias"): kappa[:, :, None]}
