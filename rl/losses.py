"""RL and fine-tuning losses on per-sequence arrays (`rl.batch.SeqBatch`), selected by name.

Every loss is `fn(batch: SeqBatch, cfg: LossConfig) -> (loss, metrics)`, pure and jittable. The
loss is a masked *sum* of per-token (or per-sequence) terms times scale factors computed from the
batch's global `Counts` (see `token_scale`, `seq_scale`), so micro-batches, data-parallel shards
and tree packing give the same gradient: sum the shards' losses, never average them.

Notation: r = exp(logprobs - old_logprobs) is the token ratio π_θ/π_old (old_logprobs = None
means on-policy: r = 1 with gradient r·∇log π_θ); A the per-token advantage; `weights` the
per-token correction weight from rl.corrections (a constant); sg = stop_gradient. Per-loss
defaults (eps, aggregation) follow the papers and are in `DEFAULTS`.

Size: the table below and one function per loss beside its paper's formula, kept in one module
so the table and the formulas read together; `value_loss` (a critic's loss, not a policy's on
a `SeqBatch`) is the one to move out if it grows.

  loss        per-element term (minimised)                                  default aggregation
  sft         -log π_θ                                                      token_mean
  ppo         -min(r·A, clip(r, 1-ε_l, 1+ε_h)·A)          ε 0.2/0.2         token_mean
  grpo        same, k3 KL when kl_coef > 0                ε 0.2/0.2         seq_mean_token_mean
  dr_grpo     same                                        ε 0.2/0.2         seq_mean_token_sum_norm
  dapo        same (clip-higher)                          ε 0.2/0.28        token_mean
  aepo        same, but -(1+ε_h)·A·r/sg(r) if A > 0 and  ε 0.2/0.28        token_mean
              r > 1+ε_h (value clipped, gradient kept); A·(1 + α·Ĥ) with entropy_adv_coef α
  gspo        per sequence, s_i = exp(mean_t log r)       ε 3e-4/4e-4       seq_mean
  gspo_token  per token, s_{i,t} = sg(s_i)·π_θ/sg(π_θ)    ε 3e-4/4e-4       seq_mean_token_mean
  turn_gspo   per turn k, r_k = Π_{t∈k} r_t, mean over turns   ε 0.2/0.2    seq_mean
  cispo       -sg(clip(r, 1-ε_l, 1+ε_h))·A·log π_θ        ε 1.0/4.0         token_mean
  kimi_pmd    (R_i - R̄_group - τ·Σ_t log r)²                               prompt_mean
  opd         -sg(log π_teacher - log π_θ)·r                                token_mean
  dpo         -log σ(β·[(Σ logπ_c - Σ logref_c) - (Σ logπ_r - Σ logref_r)])  prompt_mean
              (prompt_mean over pairs = the mean over pairs)

`entropy_adv_coef` (aepo only) first replaces A by the entropy-aware advantage
`rl.advantages.entropy_aware` (Ĥ = token entropy standardised over its group's loss tokens).

The critic's loss is outside `LOSSES` (it reads values and targets, not a SeqBatch alone):

  value_loss  ½·max((V - R)², (V_old + clip(V - V_old, -ε, ε) - R)²)       scale (token_scale)
              with R the GAE value targets (rl.advantages.gae)

Token-level aggregations are `AGGREGATIONS`; sequence-level losses (gspo, turn_gspo, kimi_pmd,
dpo) take `SEQ_AGGREGATIONS`. Every RL loss adds the KL penalty / entropy bonus (`_regularise`,
per token, not multiplied by the correction weights) and, except opd itself, `opd_coef`·OPD
(`_with_opd`); dpo takes the entropy bonus only (it rejects `kl_coef` and `opd_coef`). For a
sequence-level loss these token terms are aggregated with the token counterpart of its
aggregation (`_token_aggregation`: seq_mean -> seq_mean_token_mean).

Masked entries (mask = 0) of every per-token input may hold anything (padding, -inf, NaN): each
loss first replaces them by 0 (`_sanitise`), so they never reach a value or a gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from rl import advantages as rl_advantages
from rl.batch import Array, SeqBatch

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                "seq_mean_token_sum_norm", "prompt_mean")
SEQ_AGGREGATIONS = ("seq_mean", "prompt_mean", "token_mean")
KL_ESTIMATORS = ("k1", "k2", "k3", "k3_is")
TURN_RATIOS = ("product", "geometric_mean")


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Loss hyper-parameters, one field per knob (each explained beside it).

  A field left None takes the selected loss's paper default (`DEFAULTS`); read it with `get`.
  """

  name: str = "grpo"                    # a key of LOSSES
  aggregation: Optional[str] = None     # one of AGGREGATIONS (SEQ_AGGREGATIONS: sequence losses)
  eps_low: Optional[float] = None       # lower clip: ratio >= 1 - eps_low
  eps_high: Optional[float] = None      # upper clip: ratio <= 1 + eps_high
  dual_clip: Optional[float] = None     # PPO dual clip c > 1: for A < 0 the loss is at most -c·A
  max_len: int = 0                      # Dr.GRPO constant normaliser L (seq_mean_token_sum_norm)
  kl_coef: float = 0.0                  # β of the KL-to-reference penalty (needs ref_logprobs)
  kl_estimator: str = "k3"              # k1 | k2 | k3 | k3_is (k3 times sg(π_θ/π_old))
  entropy_coef: float = 0.0             # entropy bonus (needs entropy): loss -= coef · H
  behaviour_cap: Optional[float] = None  # decoupled PPO: cap on the weight π_old/μ (None: no cap)
  decoupled: bool = False               # decoupled PPO: weight each token by π_old/μ
  turn_ratio: str = "product"           # turn_gspo: "product" or "geometric_mean" of token ratios
  cispo_masked: bool = False            # CISPO unified form: PPO-style token mask M
  tau: float = 1.0                      # kimi_pmd regulariser τ
  opd_coef: float = 0.0                 # add coef · OPD loss to an RL loss (needs teacher_logprobs)
  dpo_beta: float = 0.1                 # DPO β
  mask_failed_turns: bool = False       # SFT: drop tokens of turns whose tool call failed
  entropy_adv_coef: Optional[float] = None  # aepo only: α of A·(1 + α·Ĥ) (needs entropy)

  def get(self, field: str):
    """The field's value, or the selected loss's default when it is None."""
    value = getattr(self, field)
    return DEFAULTS.get(self.name, {}).get(field) if value is None else value


def check_config(cfg: LossConfig) -> None:
  """Check a LossConfig; every loss calls it at trace time (plain Python: free under jit).

  Args:
    cfg: the config; `cfg.name` must be a key of `LOSSES`.

  Raises:
    ValueError: naming the LossConfig field: an unknown loss name, aggregation, KL estimator
      or turn ratio; max_len <= 0 with seq_mean_token_sum_norm; a negative eps or
      coefficient; dual_clip <= 1; behaviour_cap, tau or dpo_beta <= 0; entropy_adv_coef > 0
      with a loss other than aepo.
  """
  get_loss(cfg.name)
  agg = cfg.get("aggregation")
  allowed = SEQ_AGGREGATIONS + ("seq_mean_token_mean",) if cfg.name in SEQUENCE_LOSSES \
      else AGGREGATIONS
  if agg not in allowed:
    raise ValueError(f"LossConfig.aggregation={agg!r}: loss {cfg.name!r} takes one of {allowed}")
  if agg == "seq_mean_token_sum_norm" and cfg.max_len <= 0:
    raise ValueError(f"LossConfig.max_len={cfg.max_len}: seq_mean_token_sum_norm (Dr.GRPO) "
                     "needs the constant normaliser L > 0, e.g. the maximum generation length")
  if cfg.kl_estimator not in KL_ESTIMATORS:
    raise ValueError(f"LossConfig.kl_estimator={cfg.kl_estimator!r}: expected one of "
                     f"{KL_ESTIMATORS}")
  if cfg.turn_ratio not in TURN_RATIOS:
    raise ValueError(f"LossConfig.turn_ratio={cfg.turn_ratio!r}: expected one of {TURN_RATIOS}")
  for field in ("eps_low", "eps_high"):
    value = cfg.get(field)
    if value is not None and not value >= 0:
      raise ValueError(f"LossConfig.{field}={value!r}: must be >= 0")
  if cfg.dual_clip is not None and not cfg.dual_clip > 1:
    raise ValueError(f"LossConfig.dual_clip={cfg.dual_clip!r}: must be > 1 (or None)")
  if cfg.behaviour_cap is not None and not cfg.behaviour_cap > 0:
    raise ValueError(f"LossConfig.behaviour_cap={cfg.behaviour_cap!r}: must be > 0 (or None)")
  for field in ("kl_coef", "entropy_coef", "opd_coef"):
    if not getattr(cfg, field) >= 0:
      raise ValueError(f"LossConfig.{field}={getattr(cfg, field)!r}: must be >= 0")
  if not cfg.tau > 0:
    raise ValueError(f"LossConfig.tau={cfg.tau!r}: must be > 0")
  if not cfg.dpo_beta > 0:
    raise ValueError(f"LossConfig.dpo_beta={cfg.dpo_beta!r}: must be > 0")
  alpha = cfg.get("entropy_adv_coef")
  if alpha is not None and not alpha >= 0:
    raise ValueError(f"LossConfig.entropy_adv_coef={alpha!r}: must be >= 0")
  if alpha and cfg.name != "aepo":
    raise ValueError(f"LossConfig.entropy_adv_coef={alpha!r}: applies to 'aepo' only, not "
                     f"{cfg.name!r}")


# ----------------------------------------------------------------------------- aggregation


def token_scale(batch: SeqBatch, mode: str, max_len: int = 0) -> Array:
  """Per-token scale [S, T] such that sum(scale * l) is the `mode` aggregate of per-token l.

  token_mean               Σ l / N                   (N = global loss tokens)
  seq_mean_token_mean      (1/B) Σ_i (1/|y_i|) Σ_t l (B = global sequences)
  seq_mean_token_sum       (1/B) Σ_i Σ_t l
  seq_mean_token_sum_norm  Σ l / (B · max_len)       (Dr.GRPO)
  prompt_mean              (1/G) Σ_g (1/N_g) Σ_{i∈g,t} l  (G = global groups, N_g its tokens)
  |y_i| and N_g are local: a sequence, and a group, never straddles two micro-batches.

  Args:
    batch: reads `mask` and `counts` (global N, B, G), and `group` for prompt_mean.
    mode: one of `AGGREGATIONS`.
    max_len: Dr.GRPO's constant normaliser L > 0 (read by seq_mean_token_sum_norm only).

  Returns:
    [S, T] f32 scale, 0 where mask = 0.

  Raises:
    ValueError: for an unknown mode, max_len <= 0 with seq_mean_token_sum_norm, or
      prompt_mean on a batch without `group`.
  """
  mask, c = batch.mask, batch.counts
  if mode == "token_mean":
    return mask / jnp.maximum(c.num_tokens, 1.0)
  if mode == "seq_mean_token_mean":
    return mask / (jnp.maximum(mask.sum(-1, keepdims=True), 1.0) * jnp.maximum(c.num_seqs, 1.0))
  if mode == "seq_mean_token_sum":
    return mask / jnp.maximum(c.num_seqs, 1.0)
  if mode == "seq_mean_token_sum_norm":
    if max_len <= 0:
      raise ValueError(f"LossConfig.max_len={max_len}: seq_mean_token_sum_norm (Dr.GRPO) needs "
                       "the constant normaliser L > 0, e.g. the maximum generation length")
    return mask / (jnp.maximum(c.num_seqs, 1.0) * max_len)
  if mode == "prompt_mean":
    group_tokens = same_group(batch) @ mask.sum(-1)
    return mask / (jnp.maximum(group_tokens, 1.0)[:, None] * jnp.maximum(c.num_groups, 1.0))
  raise ValueError(f"LossConfig.aggregation={mode!r}: expected one of {AGGREGATIONS}")


def seq_scale(batch: SeqBatch, mode: str) -> Array:
  """Per-sequence scale [S] for sequence-level losses (GSPO, turn GSPO, Kimi PMD, DPO).

  seq_mean     1/B for every live sequence (the mean over sequences); "seq_mean_token_mean"
               is accepted as an alias
  prompt_mean  1/(K_g · G): the mean over the K_g live samples of a prompt, then over prompts
  token_mean   |y_i| / N: sequences weighted by their loss tokens
  A sequence is live when it has at least one loss token; dead sequences get scale 0.

  Args:
    batch: reads `mask` and `counts`, and `group` for prompt_mean.
    mode: one of `SEQ_AGGREGATIONS` (or the alias above).

  Returns:
    [S] f32 scale.

  Raises:
    ValueError: for an unknown mode, or prompt_mean on a batch without `group`.
  """
  c = batch.counts
  live = (batch.mask.sum(-1) > 0).astype(jnp.float32)
  if mode in ("seq_mean", "seq_mean_token_mean"):
    return live / jnp.maximum(c.num_seqs, 1.0)
  if mode == "prompt_mean":
    k = same_group(batch) @ live
    return live / (jnp.maximum(k, 1.0) * jnp.maximum(c.num_groups, 1.0))
  if mode == "token_mean":
    return batch.mask.sum(-1) / jnp.maximum(c.num_tokens, 1.0)
  raise ValueError(f"LossConfig.aggregation={mode!r}: a sequence-level loss takes seq_mean, "
                   "prompt_mean or token_mean")


def same_group(batch: SeqBatch) -> Array:
  """Same-group matrix [S, S] f32: 1 where two sequences share a group id.

  Raises:
    ValueError: if `batch.group` is None.
  """
  if batch.group is None:
    raise ValueError("this loss/aggregation needs SeqBatch.group (group ids)")
  return (batch.group[:, None] == batch.group[None, :]).astype(jnp.float32)


# ----------------------------------------------------------------------------- shared terms


def log_ratio(batch: SeqBatch) -> Array:
  """log(π_θ/π_old) per token [S, T]; zero-valued with gradient ∇log π_θ when on-policy."""
  old = batch.old_logprobs if batch.old_logprobs is not None else batch.logprobs
  return batch.logprobs - jax.lax.stop_gradient(old)


def kl_penalty(batch: SeqBatch, estimator: str) -> Array:
  """Per-token estimate [S, T] of KL(π_θ ‖ π_ref) (Schulman 2020).

  With ρ = π_ref/π_θ: k1 = -log ρ, k2 = ½(log ρ)², k3 = ρ - 1 - log ρ, k3_is = sg(π_θ/π_old)·k3
  (off-policy samples; DeepSeek-V3.2). π_ref is a constant; the gradient flows through π_θ only.

  Args:
    batch: needs `ref_logprobs`; k3_is also reads `old_logprobs` (None: on-policy, weight 1).
    estimator: one of `KL_ESTIMATORS`.

  Returns:
    [S, T] f32 estimates, not masked (a loss masks them when it aggregates).

  Raises:
    ValueError: for an unknown estimator, or a batch without `ref_logprobs`.

  References:
    Schulman 2020, "Approximating KL Divergence" (k1, k2, k3); DeepSeek-V3.2 (k3_is).
  """
  if estimator not in KL_ESTIMATORS:
    raise ValueError(f"LossConfig.kl_estimator={estimator!r}: expected one of {KL_ESTIMATORS}")
  if batch.ref_logprobs is None:
    raise ValueError("LossConfig.kl_coef > 0 needs SeqBatch.ref_logprobs (reference log-probs)")
  log_rho = jax.lax.stop_gradient(batch.ref_logprobs) - batch.logprobs
  if estimator == "k1":
    return -log_rho
  if estimator == "k2":
    return 0.5 * jnp.square(log_rho)
  k3 = jnp.exp(log_rho) - 1.0 - log_rho
  if estimator == "k3":
    return k3
  return jax.lax.stop_gradient(jnp.exp(log_ratio(batch))) * k3


def _weights(batch: SeqBatch) -> Array:
  """Per-token correction weights [S, T] (a constant), or the scalar 1.0 when absent."""
  return 1.0 if batch.weights is None else jax.lax.stop_gradient(batch.weights)


def _seq_weights(batch: SeqBatch) -> Array:
  """Per-sequence correction weight [S]: the masked mean of the token weights over the sequence's
  loss tokens (equal to the weight of a sequence-level correction broadcast over T), or 1.0."""
  if batch.weights is None:
    return 1.0
  return _seq_mean(jax.lax.stop_gradient(batch.weights), batch.mask)


def _seq_sum(x: Array, mask: Array) -> Array:
  """Σ_t mask·x per sequence [S]."""
  return (mask * x).sum(-1)


def _seq_mean(x: Array, mask: Array) -> Array:
  """Masked mean over each sequence's loss tokens [S] (0 for a sequence without loss tokens)."""
  return _seq_sum(x, mask) / jnp.maximum(mask.sum(-1), 1.0)


def _advantages(batch: SeqBatch, name: str) -> Array:
  if batch.advantages is None:
    raise ValueError(f"LossConfig.name={name!r} needs SeqBatch.advantages")
  return jax.lax.stop_gradient(batch.advantages)


def _regularise(per_token: Array, batch: SeqBatch, cfg: LossConfig, metrics: dict) -> Array:
  """Add the KL penalty and entropy bonus to a per-token loss (before aggregation):
  per_token + kl_coef·KL_t - entropy_coef·H_t. `entropy` is an input array (its gradient, if
  any, is the caller's business: it is not differentiated with respect to `logprobs`)."""
  if cfg.kl_coef:
    kl = kl_penalty(batch, cfg.kl_estimator)
    metrics["kl"] = _masked_mean(kl, batch.mask)
    per_token = per_token + cfg.kl_coef * kl
  if cfg.entropy_coef:
    if batch.entropy is None:
      raise ValueError("LossConfig.entropy_coef > 0 needs SeqBatch.entropy")
    metrics["entropy"] = _masked_mean(batch.entropy, batch.mask)
    per_token = per_token - cfg.entropy_coef * batch.entropy
  return per_token


def _token_aggregation(cfg: LossConfig) -> str:
  """The token-level aggregation matching the loss's aggregation (for KL, entropy and OPD terms
  of sequence-level losses): seq_mean -> seq_mean_token_mean, others unchanged."""
  agg = cfg.get("aggregation")
  return "seq_mean_token_mean" if agg == "seq_mean" else agg


def _regulariser_loss(batch: SeqBatch, cfg: LossConfig, metrics: dict) -> Array:
  """The aggregated KL/entropy terms alone (for sequence-level losses): a scalar."""
  if not (cfg.kl_coef or cfg.entropy_coef):
    return jnp.float32(0.0)
  per_token = _regularise(jnp.zeros_like(batch.logprobs), batch, cfg, metrics)
  return (token_scale(batch, _token_aggregation(cfg), cfg.max_len) * per_token).sum()


def _masked_mean(x: Array, mask: Array) -> Array:
  """Local masked mean, for metrics only (never in a loss: it is not micro-batch invariant)."""
  return jax.lax.stop_gradient((x * mask).sum() / jnp.maximum(mask.sum(), 1.0))


def _sanitise(batch: SeqBatch) -> SeqBatch:
  """Zero every per-token float input where mask = 0, so padding (-inf, NaN, garbage) never
  reaches a value or a gradient (where's gradient is exactly 0 at masked entries)."""
  live = batch.mask > 0
  fields = ("logprobs", "advantages", "old_logprobs", "sampler_logprobs", "ref_logprobs",
            "teacher_logprobs", "entropy", "weights", "failed")
  return batch.replace(**{f: jnp.where(live, getattr(batch, f), 0.0) for f in fields
                          if getattr(batch, f) is not None})


def _prepare(batch: SeqBatch, cfg: LossConfig, name: str) -> tuple[SeqBatch, LossConfig]:
  """Bind the config to the loss `name` (so its DEFAULTS apply when the function is called
  directly), validate it and sanitise the batch."""
  if cfg.name != name:
    cfg = dataclasses.replace(cfg, name=name)
  check_config(cfg)
  if batch.counts is None:
    raise ValueError("SeqBatch.counts is None: build it with rl.batch.global_counts on the whole "
                     "batch")
  return _sanitise(batch), cfg


def clipped_surrogate(ratio: Array, adv: Array, eps_low: float, eps_high: float,
                      dual_clip: Optional[float] = None) -> tuple[Array, Array]:
  """PPO clipped surrogate per element, and which elements the clip changed.

  ℓ = -min(r·A, clip(r, 1-eps_low, 1+eps_high)·A); with dual clip c, ℓ = min(ℓ, -c·A) for A < 0.

  Args:
    ratio: importance ratio r, any shape ([S, T] per token, [S] per sequence, [S, T] per turn).
    adv: advantage A, broadcastable against `ratio`.
    eps_low: lower clip: r >= 1 - eps_low.
    eps_high: upper clip: r <= 1 + eps_high.
    dual_clip: c > 1, or None for no dual clip.

  Returns:
    (loss, clipped): the per-element loss, and an f32 mask (no gradient), 1 where the loss
    differs from the unclipped -r·A.

  References:
    Schulman et al. 2017, "Proximal Policy Optimization Algorithms".
  """
  unclipped = -ratio * adv
  clipped = -jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
  loss = jnp.maximum(unclipped, clipped)
  if dual_clip is not None:
    loss = jnp.where(adv < 0, jnp.minimum(loss, -dual_clip * adv), loss)
  return loss, (loss != unclipped).astype(jnp.float32)


# ----------------------------------------------------------------------------- losses


def sft(batch: SeqBatch, cfg: LossConfig):
  """Token NLL: Σ scale·w·(-log π_θ) (w = correction weights, 1 when absent).

  With `mask_failed_turns` (error-masked SFT, KAT-Coder) tokens whose turn's tool call failed
  (`failed` = 1) leave the loss but stay in the context. The sequence-local normalisers use the
  reduced mask; the global `Counts` are the caller's: to normalise by the tokens actually
  trained, build them with `global_counts(mask * (1 - failed), group)`. kl_coef, entropy_coef
  and opd_coef are not applied.

  Args:
    batch: the sequences; needs `failed` with `mask_failed_turns`.
    cfg: reads aggregation, max_len and mask_failed_turns; its `name` is ignored.

  Returns:
    (loss, metrics): the scalar loss and {"nll": local mean NLL over the trained tokens}.

  Raises:
    ValueError: for a bad config (`check_config`), or `mask_failed_turns` without `failed`.
  """
  batch, cfg = _prepare(batch, cfg, "sft")
  mask = batch.mask
  if cfg.mask_failed_turns:
    if batch.failed is None:
      raise ValueError("LossConfig.mask_failed_turns=True needs SeqBatch.failed")
    mask = mask * (1.0 - batch.failed)
  b = batch.replace(mask=mask)
  scale = token_scale(b, cfg.get("aggregation"), cfg.max_len)
  metrics = {"nll": _masked_mean(-batch.logprobs, mask)}
  return -(scale * _weights(batch) * batch.logprobs).sum(), metrics


def _ppo_family(batch: SeqBatch, cfg: LossConfig, name: str, keep_high: bool = False):
  """Shared body of ppo, grpo, dr_grpo, dapo (they differ only in DEFAULTS) and aepo
  (`keep_high`: the upper clip of positive advantages keeps a rescaled gradient)."""
  batch, cfg = _prepare(batch, cfg, name)
  lr = log_ratio(batch)
  ratio = jnp.exp(lr)
  adv = _advantages(batch, name)
  alpha = cfg.get("entropy_adv_coef")
  if alpha:
    if batch.entropy is None:
      raise ValueError("LossConfig.entropy_adv_coef > 0 needs SeqBatch.entropy")
    if batch.group is None:
      raise ValueError("LossConfig.entropy_adv_coef > 0 needs SeqBatch.group (group ids)")
    adv = rl_advantages.entropy_aware(adv, batch.entropy, batch.mask, batch.group, alpha)
  eps_high = cfg.get("eps_high")
  per_token, clipped = clipped_surrogate(ratio, adv, cfg.get("eps_low"), eps_high, cfg.dual_clip)
  metrics = {"ratio": _masked_mean(ratio, batch.mask)}
  if keep_high:
    # value (1+ε_h)·A as clipped, gradient (1+ε_h)·A·∇log π: r/sg(r) = exp(lr - sg(lr)), which
    # cannot overflow however large r is.
    preserved = (adv > 0) & (jax.lax.stop_gradient(ratio) > 1.0 + eps_high)
    kept = -adv * (1.0 + eps_high) * jnp.exp(lr - jax.lax.stop_gradient(lr))
    per_token = jnp.where(preserved, kept, per_token)
    clipped = clipped * (1.0 - preserved)
    metrics["preserved_fraction"] = _masked_mean(preserved.astype(jnp.float32), batch.mask)
  metrics["clip_fraction"] = _masked_mean(clipped, batch.mask)
  if cfg.decoupled:
    if batch.sampler_logprobs is None or batch.old_logprobs is None:
      raise ValueError("LossConfig.decoupled=True needs old_logprobs (π_old) and "
                       "sampler_logprobs (μ)")
    w = jnp.exp(batch.old_logprobs - batch.sampler_logprobs)
    if cfg.behaviour_cap is not None:
      w = jnp.minimum(w, cfg.behaviour_cap)
    per_token = jax.lax.stop_gradient(w) * per_token
    metrics["behaviour_weight"] = _masked_mean(w, batch.mask)
  per_token = _regularise(per_token * _weights(batch), batch, cfg, metrics)
  scale = token_scale(batch, cfg.get("aggregation"), cfg.max_len)
  return _with_opd((scale * per_token).sum(), batch, cfg, metrics)


def ppo(batch: SeqBatch, cfg: LossConfig):
  """PPO clip loss per token (Schulman 2017).

  ℓ = w·max(-r·A, -clip(r, 1-ε_l, 1+ε_h)·A) [+ kl_coef·KL - entropy_coef·H], aggregated with
  `aggregation` (default token_mean).

  dual_clip c: for A < 0, ℓ = min(ℓ, -c·A). With `decoupled` (AReaL's decoupled PPO for
  asynchronous training) the clipped term is multiplied by sg(min(π_old/μ, behaviour_cap)),
  the proximal policy over the behaviour policy. Metrics: clip_fraction, ratio,
  behaviour_weight, kl, entropy.

  Args:
    batch: the sequences; needs `advantages`; with `decoupled` also `old_logprobs` and
      `sampler_logprobs`.
    cfg: the hyper-parameters; its `name` is ignored (ppo's `DEFAULTS` apply).

  Returns:
    (loss, metrics): the scalar loss and a dict of scalar metrics.

  Raises:
    ValueError: for a bad config (`check_config`) or a batch lacking a field the config needs.

  References:
    Schulman et al. 2017, "Proximal Policy Optimization Algorithms"; AReaL (decoupled PPO).
  """
  return _ppo_family(batch, cfg, "ppo")


def grpo(batch: SeqBatch, cfg: LossConfig):
  """GRPO (DeepSeekMath): the PPO clip surrogate averaged per sequence, then over sequences.

  J = (1/B) Σ_i (1/|y_i|) Σ_t [min(r A, clip(r) A) - β KL_t] with ε = 0.2 and aggregation
  seq_mean_token_mean, the k3 KL to π_ref added when kl_coef = β > 0. The group-normalised
  advantage comes from rl.advantages. Same options as `ppo`.

  Args:
    batch: the sequences; needs `advantages`.
    cfg: the hyper-parameters; its `name` is ignored (grpo's `DEFAULTS` apply).

  Returns:
    (loss, metrics): the scalar loss and a dict of scalar metrics.

  Raises:
    ValueError: for a bad config (`check_config`) or a batch lacking a field the config needs.

  References:
    DeepSeekMath (GRPO).
  """
  return _ppo_family(batch, cfg, "grpo")


def dr_grpo(batch: SeqBatch, cfg: LossConfig):
  """Dr. GRPO: the PPO clip surrogate (ε = 0.2) with a constant normaliser.

  J = (1/(B·L)) Σ_i Σ_t min(r A, clip(r) A), L = `max_len` (must be set). Same options as
  `ppo`.

  Args:
    batch: the sequences; needs `advantages`.
    cfg: the hyper-parameters; its `name` is ignored (dr_grpo's `DEFAULTS` apply);
      `max_len` = L must be > 0.

  Returns:
    (loss, metrics): the scalar loss and a dict of scalar metrics.

  Raises:
    ValueError: for a bad config (`check_config`) or a batch lacking a field the config needs.

  References:
    Dr. GRPO.
  """
  return _ppo_family(batch, cfg, "dr_grpo")


def dapo(batch: SeqBatch, cfg: LossConfig):
  """DAPO: clip-higher (ε_low 0.2, ε_high 0.28) and a global token mean.

  J = (1/Σ_i |y_i|) Σ_{i,t} min(r A, clip(r, 1-ε_l, 1+ε_h) A). No KL by default; overlong
  shaping and dynamic sampling live outside the loss. Same options as `ppo`.

  Args:
    batch: the sequences; needs `advantages`.
    cfg: the hyper-parameters; its `name` is ignored (dapo's `DEFAULTS` apply).

  Returns:
    (loss, metrics): the scalar loss and a dict of scalar metrics.

  Raises:
    ValueError: for a bad config (`check_config`) or a batch lacking a field the config needs.

  References:
    DAPO.
  """
  return _ppo_family(batch, cfg, "dapo")


def aepo(batch: SeqBatch, cfg: LossConfig):
  """AEPO entropy-balanced clipping: the PPO clip loss, keeping the gradient of tokens clipped
  above (r > 1+ε_h with A > 0: the high-entropy exploratory tokens clip-higher silences).

  Per token ℓ = -A·F with
    F = (1+ε_h)·r/sg(r)                         if A > 0 and r > 1+ε_h
    F = the PPO choice: min(r·A, clip(r, 1-ε_l, 1+ε_h)·A)/A   otherwise
  so a preserved token has the clipped value -(1+ε_h)·A and the gradient -(1+ε_h)·A·∇log π
  (PPO: 0). The lower side stays an ordinary clip (A < 0, r < 1-ε_l: value -(1-ε_l)·A, no
  gradient). ε 0.2/0.28, token_mean. With entropy_adv_coef = α > 0 the advantages are first
  replaced by `rl.advantages.entropy_aware(A, entropy, mask, group, α)`, A·(1 + α·Ĥ) with Ĥ
  the token entropy standardised over its group's loss tokens (needs `entropy`); α defaults to
  0 (off). Other options as `ppo` (dual_clip, decoupled, KL, entropy bonus, opd_coef).
  Metrics: clip_fraction (value clipped and gradient cut), preserved_fraction (gradient kept
  above the clip), ratio.

  Args:
    batch: the sequences; needs `advantages`; with entropy_adv_coef > 0 also `entropy` and
      `group`.
    cfg: the hyper-parameters; its `name` is ignored (aepo's `DEFAULTS` apply).

  Returns:
    (loss, metrics): the scalar loss and a dict of scalar metrics.

  Raises:
    ValueError: for a bad config (`check_config`) or a batch lacking a field the config needs.

  References:
    Dong et al., "Agentic Entropy-Balanced Policy Optimization", arXiv 2510.14545
    (entropy-balanced policy optimization); GPPO / CE-GPPO (Kuaishou, arXiv 2509.20712):
    gradient-preserving clipping.
  """
  return _ppo_family(batch, cfg, "aepo", keep_high=True)


def gspo(batch: SeqBatch, cfg: LossConfig):
  """GSPO (arXiv 2507.18071), sequence level.

  s_i = exp((1/|y_i|) Σ_t log r_{i,t}) = (π_θ(y_i)/π_old(y_i))^(1/|y_i|) over loss tokens,
  A_i = masked mean of the per-token advantages (= A_i when broadcast), w_i = masked mean of the
  correction weights, ℓ_i = w_i·max(-s_i A_i, -clip(s_i, 1-ε_l, 1+ε_h) A_i) (ε 3e-4/4e-4),
  loss = Σ_i seq_scale_i·ℓ_i (default seq_mean: (1/B) Σ_i ℓ_i) [+ KL/entropy/OPD token terms].
  Metrics: clip_fraction (of sequences), seq_ratio.

  Args:
    batch: the sequences; needs `advantages`.
    cfg: the hyper-parameters; its `name` is ignored (gspo's `DEFAULTS` apply).

  Returns:
    (loss, metrics): the scalar loss and a dict of scalar metrics.

  Raises:
    ValueError: for a bad config (`check_config`) or a batch lacking a field the config needs.

  References:
    GSPO, arXiv 2507.18071.
  """
  batch, cfg = _prepare(batch, cfg, "gspo")
  mask = batch.mask
  live = (mask.sum(-1) > 0).astype(jnp.float32)
  s = jnp.exp(_seq_mean(log_ratio(batch), mask))
  adv = _seq_mean(_advantages(batch, "gspo"), mask)
  per_seq, clipped = clipped_surrogate(s, adv, cfg.get("eps_low"), cfg.get("eps_high"),
                                       cfg.dual_clip)
  metrics = {"clip_fraction": _live_mean(clipped, live), "seq_ratio": _live_mean(s, live)}
  loss = (seq_scale(batch, cfg.get("aggregation")) * _seq_weights(batch) * per_seq).sum()
  return _with_opd(loss + _regulariser_loss(batch, cfg, metrics), batch, cfg, metrics)


def gspo_token(batch: SeqBatch, cfg: LossConfig):
  """GSPO-token (arXiv 2507.18071 §4.3): the sequence ratio with a per-token gradient.

  s_{i,t} = sg(s_i)·π_θ(y_t)/sg(π_θ(y_t)) (value s_i, gradient s_i·∇log π_θ(y_t)), per-token
  advantages A_{i,t}, per-token ℓ = w·max(-s_{i,t} A_{i,t}, -clip(s_{i,t}, 1-ε_l, 1+ε_h) A_{i,t})
  (ε 3e-4/4e-4), aggregated with `aggregation` (default seq_mean_token_mean); equals gspo when A
  is a sequence advantage broadcast. Metrics: clip_fraction (of tokens), seq_ratio.

  Args:
    batch: the sequences; needs `advantages`.
    cfg: the hyper-parameters; its `name` is ignored (gspo_token's `DEFAULTS` apply).

  Returns:
    (loss, metrics): the scalar loss and a dict of scalar metrics.

  Raises:
    ValueError: for a bad config (`check_config`) or a batch lacking a field the config needs.

  References:
    GSPO, arXiv 2507.18071, §4.3.
  """
  batch, cfg = _prepare(batch, cfg, "gspo_token")
  mask = batch.mask
  s_seq = jax.lax.stop_gradient(jnp.exp(_seq_mean(log_ratio(batch), mask)))
  lp = batch.logprobs
  s = s_seq[:, None] * jnp.exp(lp - jax.lax.stop_gradient(lp))
  per_token, clipped = clipped_surrogate(s, _advantages(batch, "gspo_token"), cfg.get("eps_low"),
                                         cfg.get("eps_high"), cfg.dual_clip)
  live = (mask.sum(-1) > 0).astype(jnp.float32)
  metrics = {"clip_fraction": _masked_mean(clipped, mask), "seq_ratio": _live_mean(s_seq, live)}
  per_token = _regularise(per_token * _weights(batch), batch, cfg, metrics)
  scale = token_scale(batch, cfg.get("aggregation"), cfg.max_len)
  return _with_opd((scale * per_token).sum(), batch, cfg, metrics)


def turn_segments(batch: SeqBatch) -> Array:
  """Segment id [S, T] int32 of each token's turn: s·T + k, k the turn's ordinal in sequence s.

  k counts (0, 1, ...) only the sequence's turns that have loss tokens. A turn is a maximal run
  of loss tokens with the same `turn` id (ids are LLM-call indices, unbounded, so they are
  remapped): a new turn starts at a loss token whose id differs from the previous loss token's.
  Tokens with mask 0 (which never contribute) get a valid id too. No [T, T] array: a running
  max of the last loss-token index and a cumsum of turn starts.

  Raises:
    ValueError: if `batch.turn` is None.
  """
  if batch.turn is None:
    raise ValueError("LossConfig.name='turn_gspo' needs SeqBatch.turn (turn/LLM-call ids)")
  S, T = batch.mask.shape
  valid = batch.mask > 0
  idx = jnp.where(valid, jnp.arange(T, dtype=jnp.int32)[None], -1)
  last = jax.lax.cummax(idx, axis=1)                       # last loss token at or before t
  prev = jnp.concatenate([jnp.full((S, 1), -1, jnp.int32), last[:, :-1]], axis=1)
  prev_turn = jnp.take_along_axis(batch.turn, jnp.maximum(prev, 0), axis=1)
  start = valid & ((prev < 0) | (batch.turn != prev_turn))
  ordinal = jnp.clip(jnp.cumsum(start.astype(jnp.int32), axis=1) - 1, 0, T - 1)
  return jnp.arange(S, dtype=jnp.int32)[:, None] * T + ordinal


def turn_gspo(batch: SeqBatch, cfg: LossConfig):
  """Turn-level GSPO (KAT-Coder-V2 eqs. 6-7): one importance ratio per interaction turn.

  For sequence i and turn k (the loss tokens sampled by one LLM call, see `turn_segments`):
    log ρ_{i,k} = Σ_{t∈k} log r_{i,t}          (turn_ratio="product": ρ = Π_t r_t)
                = (1/|k|) Σ_{t∈k} log r_{i,t}  (turn_ratio="geometric_mean")
    A_{i,k} = masked mean of A_{i,t} over the turn, w_{i,k} likewise for the correction weights,
    ℓ_{i,k} = w_{i,k}·max(-ρ A, -clip(ρ, 1-ε_l, 1+ε_h) A)   (ε 0.2/0.2)
    ℓ_i = (1/K_i) Σ_k ℓ_{i,k} over the K_i turns with at least one loss token,
  loss = Σ_i seq_scale_i·ℓ_i (default seq_mean) [+ KL/entropy/OPD token terms].
  Shapes: turn sums are segment sums over S·T segments (s·T + turn ordinal), kept as [S, T].
  Note: the product ratio of a long turn can overflow fp32 (exp of a large log-ratio sum); use
  geometric_mean or dual_clip for long turns. Metrics: clip_fraction (of turns), turn_ratio,
  turns (mean per live sequence).

  Args:
    batch: the sequences; needs `advantages` and `turn`.
    cfg: the hyper-parameters; its `name` is ignored (turn_gspo's `DEFAULTS` apply).

  Returns:
    (loss, metrics): the scalar loss and a dict of scalar metrics.

  Raises:
    ValueError: for a bad config (`check_config`) or a batch lacking a field the config needs.

  References:
    KAT-Coder-V2 (arXiv 2603.27703), eqs. 6-7.
  """
  batch, cfg = _prepare(batch, cfg, "turn_gspo")
  mask = batch.mask
  S, T = mask.shape
  seg = turn_segments(batch).reshape(-1)
  segsum = lambda x: jax.ops.segment_sum(x.reshape(-1), seg, num_segments=S * T).reshape(S, T)
  tokens = segsum(mask)                                  # [S, T]: loss tokens of turn k of seq s
  turn_live = (tokens > 0).astype(jnp.float32)
  log_rho = segsum(mask * log_ratio(batch))
  if cfg.turn_ratio == "geometric_mean":
    log_rho = log_rho / jnp.maximum(tokens, 1.0)
  rho = jnp.exp(log_rho)
  adv = segsum(mask * _advantages(batch, "turn_gspo")) / jnp.maximum(tokens, 1.0)
  w = 1.0 if batch.weights is None else segsum(mask * _weights(batch)) / jnp.maximum(tokens, 1.0)
  per_turn, clipped = clipped_surrogate(rho, adv, cfg.get("eps_low"), cfg.get("eps_high"),
                                        cfg.dual_clip)
  n_turns = turn_live.sum(-1)
  per_seq = (turn_live * w * per_turn).sum(-1) / jnp.maximum(n_turns, 1.0)
  live = (n_turns > 0).astype(jnp.float32)
  metrics = {"clip_fraction": _masked_mean(clipped, turn_live),
             "turn_ratio": _masked_mean(rho, turn_live), "turns": _live_mean(n_turns, live)}
  loss = (seq_scale(batch, cfg.get("aggregation")) * per_seq).sum()
  return _with_opd(loss + _regulariser_loss(batch, cfg, metrics), batch, cfg, metrics)


def cispo(batch: SeqBatch, cfg: LossConfig):
  """CISPO (MiniMax-M1, arXiv 2506.13585): a clipped, constant IS weight on each token's log-prob.

  ℓ = -w·M·sg(clip(r, 1-ε_l, 1+ε_h))·A·log π_θ   (ε 1.0/4.0: weight in [0, 5]), token_mean.
  The clipped IS weight is a constant, so every token keeps the gradient -w·M·r̂·A·∇log π_θ.
  M = 1, or with `cispo_masked` (M1's unified form) M = 0 where (A > 0 and r > 1+ε_h) or
  (A < 0 and r < 1-ε_l). Metrics: clip_fraction (weight clipped), ratio, masked_fraction.

  Args:
    batch: the sequences; needs `advantages`.
    cfg: the hyper-parameters; its `name` is ignored (cispo's `DEFAULTS` apply).

  Returns:
    (loss, metrics): the scalar loss and a dict of scalar metrics.

  Raises:
    ValueError: for a bad config (`check_config`) or a batch lacking a field the config needs.

  References:
    MiniMax-M1, arXiv 2506.13585.
  """
  batch, cfg = _prepare(batch, cfg, "cispo")
  eps_low, eps_high = cfg.get("eps_low"), cfg.get("eps_high")
  adv = _advantages(batch, "cispo")
  ratio = jax.lax.stop_gradient(jnp.exp(log_ratio(batch)))
  r_hat = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  per_token = -r_hat * adv * batch.logprobs
  metrics = {"clip_fraction": _masked_mean((r_hat != ratio).astype(jnp.float32), batch.mask),
             "ratio": _masked_mean(ratio, batch.mask)}
  if cfg.cispo_masked:
    dropped = ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - eps_low))
    per_token = jnp.where(dropped, 0.0, per_token)
    metrics["masked_fraction"] = _masked_mean(dropped.astype(jnp.float32), batch.mask)
  per_token = _regularise(per_token * _weights(batch), batch, cfg, metrics)
  scale = token_scale(batch, cfg.get("aggregation"), cfg.max_len)
  return _with_opd((scale * per_token).sum(), batch, cfg, metrics)


def kimi_pmd(batch: SeqBatch, cfg: LossConfig):
  """Kimi k1.5/K2 policy mirror descent (arXiv 2501.12599 §2.3.2), a squared loss per trajectory.

    ℓ_i = w_i·(R_i - R̄_i - τ·Σ_t log(π_θ(y_{i,t})/π_old(y_{i,t})))²   (sum over loss tokens)

  transcribed as written: no factor 1/2, τ multiplies only the log-ratio (R̄ stands for τ·log Z,
  so its gradient is -2τ·(R_i - R̄_i - τ L_i)·∇L_i). R = `reward`, R̄_i = mean reward of the
  live sequences (≥ 1 loss token) of i's group, computed in-loss with the [S, S] same-group
  matrix (a group never straddles micro-batches); w_i = masked mean correction weight.
  loss = Σ_i seq_scale_i·ℓ_i, default prompt_mean = (1/G) Σ_g (1/K_g) Σ_{i∈g} ℓ_i
  [+ KL/entropy/OPD token terms]. Metrics: residual (mean of the bracket), seq_log_ratio.

  Args:
    batch: the sequences; needs `reward` [S] and `group` [S].
    cfg: the hyper-parameters (tau = τ); its `name` is ignored (kimi_pmd's `DEFAULTS` apply).

  Returns:
    (loss, metrics): the scalar loss and a dict of scalar metrics.

  Raises:
    ValueError: for a bad config (`check_config`) or a batch lacking a field the config needs.

  References:
    Kimi k1.5, arXiv 2501.12599, §2.3.2.
  """
  batch, cfg = _prepare(batch, cfg, "kimi_pmd")
  if batch.reward is None:
    raise ValueError("LossConfig.name='kimi_pmd' needs SeqBatch.reward")
  mask = batch.mask
  live = (mask.sum(-1) > 0).astype(jnp.float32)
  reward = jax.lax.stop_gradient(batch.reward.astype(jnp.float32))
  peers = same_group(batch) * live[None, :]
  baseline = (peers @ reward) / jnp.maximum(peers.sum(-1), 1.0)
  seq_log_ratio = _seq_sum(log_ratio(batch), mask)
  residual = reward - baseline - cfg.tau * seq_log_ratio
  per_seq = _seq_weights(batch) * jnp.square(residual)
  metrics = {"residual": _live_mean(residual, live),
             "seq_log_ratio": _live_mean(seq_log_ratio, live)}
  loss = (seq_scale(batch, cfg.get("aggregation")) * per_seq).sum()
  return _with_opd(loss + _regulariser_loss(batch, cfg, metrics), batch, cfg, metrics)


def _opd_terms(batch: SeqBatch, cfg: LossConfig) -> tuple[Array, dict]:
  """Per-token OPD loss [S, T] (weighted, not aggregated) and its metrics."""
  if batch.teacher_logprobs is None:
    raise ValueError(f"LossConfig.name={cfg.name!r} with opd (or opd_coef > 0) needs "
                     "SeqBatch.teacher_logprobs")
  adv = jax.lax.stop_gradient(batch.teacher_logprobs - batch.logprobs)
  per_token = -adv * jnp.exp(log_ratio(batch)) * _weights(batch)
  return per_token, {"reverse_kl": _masked_mean(-adv, batch.mask)}


def opd(batch: SeqBatch, cfg: LossConfig):
  """On-policy distillation: the policy gradient of the reverse KL to a teacher, per token.

  On the student's own samples:
    a_t = sg(log π_teacher(y_t) - log π_θ(y_t)),  ℓ_t = -w·a_t·r_t,  r_t = exp(log π_θ - log π_old)
  (r = 1 on-policy, so the gradient is -a_t·∇log π_θ: the policy gradient of the reverse KL
  KL(π_θ ‖ π_teacher) with per-token reward -(log π_θ - log π_teacher)); default token_mean
  [+ KL/entropy]. Added to any RL loss with `opd_coef` (see `_with_opd`).
  Metric: reverse_kl = mean over loss tokens of log π_θ - log π_teacher.

  Args:
    batch: the sequences; needs `teacher_logprobs` (`advantages` is not read).
    cfg: the hyper-parameters; its `name` is ignored (opd's `DEFAULTS` apply).

  Returns:
    (loss, metrics): the scalar loss and a dict of scalar metrics.

  Raises:
    ValueError: for a bad config (`check_config`) or a batch lacking a field the config needs.

  References:
    KAT-Coder-V2 (arXiv 2603.27703); Thinking Machines, "On-Policy Distillation".
  """
  batch, cfg = _prepare(batch, cfg, "opd")
  per_token, metrics = _opd_terms(batch, cfg)
  per_token = _regularise(per_token, batch, cfg, metrics)
  scale = token_scale(batch, cfg.get("aggregation"), cfg.max_len)
  return (scale * per_token).sum(), metrics


def _with_opd(loss: Array, batch: SeqBatch, cfg: LossConfig, metrics: dict):
  """loss + opd_coef · OPD, the OPD term aggregated like the host loss (`_token_aggregation`).
  `batch` and `cfg` must already be prepared (`_prepare`)."""
  if cfg.opd_coef:
    per_token, m = _opd_terms(batch, cfg)
    metrics.update({f"opd_{k}": v for k, v in m.items()})
    scale = token_scale(batch, _token_aggregation(cfg), cfg.max_len)
    loss = loss + cfg.opd_coef * (scale * per_token).sum()
  return loss, metrics


def dpo(batch: SeqBatch, cfg: LossConfig):
  """DPO (Rafailov et al. 2023) on pairs of sequences that share a group id.

  In a pair the sequence with the higher `reward` is chosen (c), the other rejected (r). With
  h_i = Σ_t (log π_θ - log π_ref) over the sequence's loss tokens, each pair's loss is
    ℓ = -log σ(β·(h_c - h_r)) = softplus(-β·(h_c - h_r)),  β = dpo_beta,
  assigned to both sequences of the pair, and loss = Σ_i seq_scale_i·ℓ_i; the default
  prompt_mean is the mean over pairs, (1/G) Σ_pairs ℓ (G = global groups). A group that is not
  exactly two sequences, or a pair with equal rewards (no preference), contributes 0 (metric
  `unpaired`). Correction weights are not applied; kl_coef and opd_coef are rejected (β already
  ties π_θ to π_ref; samples are off-policy). Metrics: accuracy (h_c > h_r), margin
  (β·(h_c - h_r)), unpaired.

  Args:
    batch: the sequences; needs `ref_logprobs`, `reward` [S] and `group` [S].
    cfg: the hyper-parameters; its `name` is ignored (dpo's `DEFAULTS` apply).

  Returns:
    (loss, metrics): the scalar loss and a dict of scalar metrics.

  Raises:
    ValueError: for a bad config (`check_config`), kl_coef or opd_coef > 0, or a batch lacking
      `ref_logprobs`, `reward` or `group`.

  References:
    Rafailov et al. 2023, "Direct Preference Optimization".
  """
  batch, cfg = _prepare(batch, cfg, "dpo")
  if batch.ref_logprobs is None:
    raise ValueError("LossConfig.name='dpo' needs SeqBatch.ref_logprobs (reference log-probs)")
  if batch.reward is None:
    raise ValueError("LossConfig.name='dpo' needs SeqBatch.reward (higher reward = chosen)")
  for field in ("kl_coef", "opd_coef"):
    if getattr(cfg, field):
      raise ValueError(f"LossConfig.{field}={getattr(cfg, field)!r}: not supported by 'dpo'")
  S = batch.mask.shape[0]
  h = _seq_sum(batch.logprobs - jax.lax.stop_gradient(batch.ref_logprobs), batch.mask)
  other = same_group(batch) - jnp.eye(S, dtype=jnp.float32)
  reward = jax.lax.stop_gradient(batch.reward.astype(jnp.float32))
  sign = jnp.sign(reward - other @ reward)               # +1 chosen, -1 rejected, 0 tie
  paired = (other.sum(-1) == 1) & (sign != 0)
  margin = cfg.dpo_beta * sign * (h - other @ h)         # β(h_c - h_r), on both sides of a pair
  per_seq = jnp.where(paired, jax.nn.softplus(-margin), 0.0)
  live = (batch.mask.sum(-1) > 0).astype(jnp.float32)
  counted = live * paired
  metrics = {"accuracy": _live_mean((margin > 0).astype(jnp.float32), counted),
             "margin": _live_mean(margin, counted), "unpaired": jax.lax.stop_gradient(
                 (live * (1.0 - paired)).sum())}
  loss = (seq_scale(batch, cfg.get("aggregation")) * per_seq).sum()
  return loss + _regulariser_loss(batch, cfg, metrics), metrics


def _live_mean(x: Array, live: Array) -> Array:
  """Mean of a per-sequence metric over live sequences (metrics only)."""
  return jax.lax.stop_gradient((x * live).sum() / jnp.maximum(live.sum(), 1.0))


# ----------------------------------------------------------------------------- critic


def value_loss(values: Array, returns: Array, scale: Array, old_values: Optional[Array] = None,
               clip: Optional[float] = None) -> tuple[Array, dict]:
  """PPO value loss with clipping: Σ scale · ½·max((V - R)², (V_clip - R)²).

  V_clip = V_old + clip(V - V_old, -ε, ε) keeps the new value within ε of the value the
  targets were computed with; the max makes the clipped branch a pessimistic bound, as the
  policy's clipped surrogate. Without `old_values` or `clip` it is the plain ½·(V - R)².
  `scale` carries the aggregation (`token_scale(batch, mode)`: the mask and the global counts),
  so micro-batches, shards and tree packing sum to the whole batch's loss, as for the policy
  losses. The targets R and V_old are constants.

  Args:
    values: [S, T] f32 V_θ at each sampled token's state (differentiated), e.g. the critic's
      per-position values gathered with `TreeBatch.seq_pred`.
    returns: [S, T] f32 value targets R (`rl.advantages.gae`'s returns).
    scale: [S, T] f32 per-token scale, 0 where masked (`token_scale`).
    old_values: [S, T] f32 V_old (the values R was computed with), or None (no clipping).
    clip: ε >= 0, or None (no clipping).

  Returns:
    (loss, metrics): the scalar loss; "value_clip_fraction" (tokens outside V_old ± ε whose
    clipped branch is the larger) and "value_error" (mean |V - R|), local means over scale > 0 (metrics only).

  Raises:
    ValueError: for clip < 0.

  References:
    Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. (9) (L^VF, the
    squared-error value loss); the clipped form as in OpenAI Baselines' PPO2, studied in
    Engstrom et al. 2020, "Implementation Matters in Deep Policy Gradients" (value clipping).
  """
  if clip is not None and not clip >= 0:
    raise ValueError(f"value loss clip={clip!r}: must be >= 0 (or None)")
  live = scale != 0
  # Padding may hold anything (NaN, garbage): zero it so it reaches neither value nor gradient.
  values = jnp.where(live, values, 0.0)
  returns = jax.lax.stop_gradient(jnp.where(live, returns, 0.0))
  error = jnp.square(values - returns)
  if old_values is None or clip is None:
    per_token, clipped = error, jnp.zeros_like(error)
  else:
    old = jax.lax.stop_gradient(jnp.where(live, old_values, 0.0))
    near = old + jnp.clip(values - old, -clip, clip)
    error_clipped = jnp.square(near - returns)
    per_token = jnp.maximum(error, error_clipped)
    # Inside ±ε the two branches are the same value up to rounding: not a clip.
    clipped = ((jnp.abs(values - old) > clip) & (error_clipped > error)).astype(jnp.float32)
  mask = live.astype(jnp.float32)
  metrics = {"value_clip_fraction": _masked_mean(clipped, mask),
             "value_error": _masked_mean(jnp.abs(values - returns), mask)}
  return (scale * 0.5 * per_token).sum(), metrics


LossFn = Callable[[SeqBatch, LossConfig], tuple[Array, dict]]

# Paper defaults per loss (LossConfig fields left None take these).
DEFAULTS: dict[str, dict] = {
    "sft": {"aggregation": "token_mean"},
    "ppo": {"aggregation": "token_mean", "eps_low": 0.2, "eps_high": 0.2},
    "grpo": {"aggregation": "seq_mean_token_mean", "eps_low": 0.2, "eps_high": 0.2},
    "dr_grpo": {"aggregation": "seq_mean_token_sum_norm", "eps_low": 0.2, "eps_high": 0.2},
    "dapo": {"aggregation": "token_mean", "eps_low": 0.2, "eps_high": 0.28},
    "aepo": {"aggregation": "token_mean", "eps_low": 0.2, "eps_high": 0.28,
             "entropy_adv_coef": 0.0},
    "gspo": {"aggregation": "seq_mean", "eps_low": 3e-4, "eps_high": 4e-4},
    "gspo_token": {"aggregation": "seq_mean_token_mean", "eps_low": 3e-4, "eps_high": 4e-4},
    "turn_gspo": {"aggregation": "seq_mean", "eps_low": 0.2, "eps_high": 0.2},
    "cispo": {"aggregation": "token_mean", "eps_low": 1.0, "eps_high": 4.0},
    "kimi_pmd": {"aggregation": "prompt_mean"},
    "opd": {"aggregation": "token_mean"},
    "dpo": {"aggregation": "prompt_mean"},
}

LOSSES: dict[str, LossFn] = {
    "sft": sft, "ppo": ppo, "grpo": grpo, "dr_grpo": dr_grpo, "dapo": dapo, "aepo": aepo,
    "gspo": gspo, "gspo_token": gspo_token, "turn_gspo": turn_gspo, "cispo": cispo,
    "kimi_pmd": kimi_pmd, "opd": opd, "dpo": dpo,
}

# Losses whose terms are per sequence (or per turn): they take SEQ_AGGREGATIONS.
SEQUENCE_LOSSES = frozenset({"gspo", "turn_gspo", "kimi_pmd", "dpo"})


def get_loss(name: str) -> LossFn:
  """The loss function registered as `name` in `LOSSES`.

  Raises:
    ValueError: for an unknown name.
  """
  if name not in LOSSES:
    raise ValueError(f"LossConfig.name={name!r}: expected one of {sorted(LOSSES)}")
  return LOSSES[name]


def compute(batch: SeqBatch, cfg: LossConfig):
  """The configured loss: `LOSSES[cfg.name](batch, cfg)`.

  Args:
    batch: the sequences (`rl.batch.SeqBatch` with global `counts`).
    cfg: the hyper-parameters; `cfg.name` selects the loss.

  Returns:
    (loss, metrics) of the selected loss.

  Raises:
    ValueError: for an unknown loss name, a bad config or a batch lacking a field it needs.
  """
  return get_loss(cfg.name)(batch, cfg)
