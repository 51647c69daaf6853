"""Train/inference mismatch corrections: per-token weights and masks for `SeqBatch.weights`.

The sampler (inference engine) and the trainer compute log-probs of the same tokens with the same
weights but different kernels, precision, parallelism and (MoE) routing, so they disagree. These
functions turn the two log-prob streams into a per-token weight [S, T] that the losses in
`rl.losses` multiply into each per-token term as a constant (docs/design.md §3). Everything is
pure, jittable, and works on per-sequence arrays:

  train_logprobs    [S, T]  log π_train(y_t): the trainer's log-probs of the sampled tokens, either
                            π_old recomputed by the trainer before the update or the current π_θ
  sampler_logprobs  [S, T]  log μ(y_t): the sampler's (behaviour policy's) log-probs
  mask              [S, T]  float, 1 = loss token. Positions with mask 0 are ignored entirely:
                            their log-probs may hold anything (padding, -inf, NaN)
  advantages        [S] or [S, T]  (OPSM only)

  log k_t = mask_t · (train_t − sampler_t),   k_t = π_train(y_t) / μ(y_t)

Conventions of every weight function: the result is float32 [S, T], gradient-stopped (all inputs
pass through `jax.lax.stop_gradient`, so d weights / d train_logprobs = 0), equal to 1.0 at
positions with mask 0 ("not corrected"), and 0.0 where a token or sequence is masked out.

  kind          weight w_{i,t} on a loss token                                       defaults
  none          1
  tis_token     min(k_{i,t}, C)                                   (truncated IS)     C = 2.0
  tis_sequence  min(exp(Σ_t log k_{i,t}), C)  broadcast over the sequence            C = 5.0
  icepop        k_{i,t} if α <= k_{i,t} <= β else 0   (Ring-1T; 0/1 if not weighted)  α=0.5, β=5
  geo_mask      1 if L <= exp(mean_t log k_{i,t}) <= U else 0  (SkyRL geo_mask)      [0.99, 1.01]
  opsm          0 if A_{i,t} < 0 and mean_t (log μ − log π_train) > δ else 1         δ = 1e-4

`apply(cfg, ...)` selects one of these from a `CorrectionConfig` and adds mismatch metrics.
`mcla_average` combines K trainer forward passes (KAT-Coder-V2 MCLA) before any of the above.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp

Array = jax.Array

KINDS = ("none", "tis_token", "tis_sequence", "icepop", "geo_mask", "opsm")
MCLA_MODES = ("logprob", "prob")


# ----------------------------------------------------------------------------------------------
# Validation helpers (plain Python numbers only; traced values are not checked).


def _is_number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_positive(name: str, value) -> None:
  if _is_number(value) and not (value > 0 and math.isfinite(value)):
    raise ValueError(f"{name}={value!r}: must be a finite number > 0")


def _check_band(lo_name: str, lo, hi_name: str, hi) -> None:
  if _is_number(lo) and not (lo >= 0 and math.isfinite(lo)):
    raise ValueError(f"{lo_name}={lo!r}: must be a finite number >= 0")
  if _is_number(hi) and not (hi > 0 and math.isfinite(hi)):
    raise ValueError(f"{hi_name}={hi!r}: must be a finite number > 0")
  if _is_number(lo) and _is_number(hi) and lo > hi:
    raise ValueError(f"{lo_name}={lo!r} > {hi_name}={hi!r}: the band is empty, need "
                     f"{lo_name} <= {hi_name}")


def _check_shapes(train_logprobs, sampler_logprobs, mask) -> None:
  shapes = (jnp.shape(train_logprobs), jnp.shape(sampler_logprobs), jnp.shape(mask))
  if len(shapes[0]) != 2 or len(set(shapes)) != 1:
    raise ValueError(f"train_logprobs, sampler_logprobs and mask must all be [S, T]; got shapes "
                     f"{shapes[0]}, {shapes[1]}, {shapes[2]}")


# ----------------------------------------------------------------------------------------------
# Building blocks.


def log_ratio(train_logprobs: Array, sampler_logprobs: Array, mask: Array) -> Array:
  """log k = log π_train − log μ on loss tokens, 0 where mask == 0; no gradient.

  `jnp.where` (not a product) keeps garbage at masked positions (-inf, NaN) out of the result.

  Args:
    train_logprobs: [S, T] log π_train of the sampled tokens (see the module docstring).
    sampler_logprobs: [S, T] log μ from the sampler.
    mask: [S, T] float, 1 = loss token (log-probs elsewhere may hold anything).

  Returns:
    [S, T] f32, gradient-stopped.

  Raises:
    ValueError: unless the three inputs are [S, T] of one shape.
  """
  _check_shapes(train_logprobs, sampler_logprobs, mask)
  train = jax.lax.stop_gradient(jnp.asarray(train_logprobs, jnp.float32))
  sampler = jax.lax.stop_gradient(jnp.asarray(sampler_logprobs, jnp.float32))
  live = jax.lax.stop_gradient(jnp.asarray(mask)) > 0
  return jnp.where(live, train - sampler, 0.0)


def _live(mask: Array) -> Array:
  return jax.lax.stop_gradient(jnp.asarray(mask)) > 0


def _finish(weights: Array, mask: Array) -> Array:
  """1.0 at non-loss positions; float32; gradient stopped."""
  return jax.lax.stop_gradient(jnp.where(_live(mask), weights, 1.0).astype(jnp.float32))


def _seq_mean(x: Array, mask: Array) -> Array:
  """Masked mean over each sequence's loss tokens [S] (0 for a sequence without any)."""
  m = _live(mask).astype(jnp.float32)
  return (x * m).sum(-1) / jnp.maximum(m.sum(-1), 1.0)


# ----------------------------------------------------------------------------------------------
# Corrections.


def tis_token(train_logprobs: Array, sampler_logprobs: Array, mask: Array,
              cap: float = 2.0) -> Array:
  """Token-level truncated importance sampling (Yao et al.; verl/slime/SkyRL default C = 2).

  w_{i,t} = min(k_{i,t}, cap),  k = exp(train − sampler).

  Args:
    train_logprobs: [S, T] log π_train of the sampled tokens (see the module docstring).
    sampler_logprobs: [S, T] log μ from the sampler.
    mask: [S, T] float, 1 = loss token (log-probs elsewhere may hold anything).
    cap: C, a finite number > 0.

  Returns:
    [S, T] f32 weights, gradient-stopped, 1.0 where mask = 0.

  Raises:
    ValueError: for a bad cap or mismatched shapes.

  References:
    Yao et al. (truncated importance sampling).
  """
  _check_positive("cap", cap)
  lk = log_ratio(train_logprobs, sampler_logprobs, mask)
  # exp(min(log k, log cap)) == min(k, cap) without overflowing to inf.
  return _finish(jnp.exp(jnp.minimum(lk, jnp.log(jnp.float32(cap)))), mask)


def tis_sequence(train_logprobs: Array, sampler_logprobs: Array, mask: Array,
                 cap: float = 5.0) -> Array:
  """Sequence-level truncated IS (SkyRL sequence default C = 5).

  w_i = min(exp(Σ_t mask_{i,t} · log k_{i,t}), cap), broadcast over the sequence's tokens.
  A sequence without loss tokens gets weight 1.

  Args:
    train_logprobs: [S, T] log π_train of the sampled tokens (see the module docstring).
    sampler_logprobs: [S, T] log μ from the sampler.
    mask: [S, T] float, 1 = loss token (log-probs elsewhere may hold anything).
    cap: C, a finite number > 0.

  Returns:
    [S, T] f32 weights, gradient-stopped, 1.0 where mask = 0.

  Raises:
    ValueError: for a bad cap or mismatched shapes.
  """
  _check_positive("cap", cap)
  lk = log_ratio(train_logprobs, sampler_logprobs, mask)
  w = jnp.exp(jnp.minimum(lk.sum(-1), jnp.log(jnp.float32(cap))))
  return _finish(jnp.broadcast_to(w[:, None], lk.shape), mask)


def icepop(train_logprobs: Array, sampler_logprobs: Array, mask: Array, alpha: float = 0.5,
           beta: float = 5.0, weighted: bool = True) -> Array:
  """IcePop (Ring-1T, arXiv 2510.18855): masked token-level IS with a two-sided band.

  M(k) = k if alpha <= k <= beta else 0 (bounds inclusive); `weighted=False` gives the plain
  0/1 mask 1[alpha <= k <= beta]. Defaults alpha = 0.5, beta = 5 (TRL tests, OpenRLHF docs).
  Tokens outside the band get no gradient.

  Args:
    train_logprobs: [S, T] log π_train of the sampled tokens (see the module docstring).
    sampler_logprobs: [S, T] log μ from the sampler.
    mask: [S, T] float, 1 = loss token (log-probs elsewhere may hold anything).
    alpha: lower bound of the band, finite, >= 0.
    beta: upper bound of the band, finite, > 0 and >= alpha.
    weighted: weight k inside the band (True) or 1 (False).

  Returns:
    [S, T] f32 weights, gradient-stopped, 1.0 where mask = 0.

  Raises:
    ValueError: for a bad or empty band, or mismatched shapes.

  References:
    Ring-1T, arXiv 2510.18855.
  """
  _check_band("alpha", alpha, "beta", beta)
  k = jnp.exp(log_ratio(train_logprobs, sampler_logprobs, mask))
  keep = (k >= alpha) & (k <= beta)
  w = jnp.where(keep, k if weighted else 1.0, 0.0)
  return _finish(w, mask)


def geo_mask(train_logprobs: Array, sampler_logprobs: Array, mask: Array, lower: float = 0.99,
             upper: float = 1.01) -> Array:
  """Geometric-mean sequence mask (SkyRL `geo_mask`, verl geometric RS, TRL sequence_mask).

  g_i = exp( Σ_t mask·log k / Σ_t mask )  (the geometric mean of the token ratios k over the
  sequence's loss tokens); keep sequence i (weight 1) iff lower <= g_i <= upper, else 0 on all
  its tokens. Default band [0.99, 1.01] = SkyRL's geo_mask default: a mean |log k| drift of about
  1% per token drops the sequence. A sequence without loss tokens has g = 1 (kept).

  Args:
    train_logprobs: [S, T] log π_train of the sampled tokens (see the module docstring).
    sampler_logprobs: [S, T] log μ from the sampler.
    mask: [S, T] float, 1 = loss token (log-probs elsewhere may hold anything).
    lower: lower bound of g, finite, >= 0.
    upper: upper bound of g, finite, > 0 and >= lower.

  Returns:
    [S, T] f32 weights, gradient-stopped, 1.0 where mask = 0.

  Raises:
    ValueError: for a bad or empty band, or mismatched shapes.
  """
  _check_band("lower", lower, "upper", upper)
  lk = log_ratio(train_logprobs, sampler_logprobs, mask)
  g = jnp.exp(_seq_mean(lk, mask))
  keep = ((g >= lower) & (g <= upper)).astype(jnp.float32)
  return _finish(jnp.broadcast_to(keep[:, None], lk.shape), mask)


def opsm(train_logprobs: Array, sampler_logprobs: Array, mask: Array, advantages: Array,
         delta: float = 1e-4) -> Array:
  """Off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556).

  The paper drops sequence i when A_i < 0 and (1/|y_i|) Σ_t log(π_old/π_θ)(y_{i,t}) > δ, where
  π_old is the policy that *sampled* the rollout and π_θ the policy being trained. Here:
    π_old  <- sampler_logprobs  (μ, the behaviour policy's log-probs recorded by the sampler)
    π_θ    <- train_logprobs    (the trainer's log-probs: current π_θ inside the loss, or π_old
                                 recomputed by the trainer; gradient stopped either way)
  so the statistic D_i = mean_t (sampler − train) = −mean_t log k is the k1 estimate of
  KL(μ ‖ π_train) on the sequence's loss tokens, and
    w_{i,t} = 0 if A_{i,t} < 0 and D_i > delta else 1.

  Args:
    train_logprobs: [S, T] log π_train of the sampled tokens (see the module docstring).
    sampler_logprobs: [S, T] log μ from the sampler.
    mask: [S, T] float, 1 = loss token (log-probs elsewhere may hold anything).
    advantages: [S] (A_i) or [S, T] (per token, as in SeqBatch: a sequence advantage broadcast
      over T gives exactly the paper's rule; per-token advantages are tested token by token, as
      slime does).
    delta: δ, a finite number >= 0. Default 1e-4 (slime `--opsm-delta`; the paper does not
      publish one).

  Returns:
    [S, T] f32 weights, gradient-stopped, 1.0 where mask = 0.

  Raises:
    ValueError: for a bad delta, advantages not [S] or [S, T], or mismatched shapes.

  References:
    DeepSeek-V3.2, arXiv 2512.02556.
  """
  if _is_number(delta) and not (delta >= 0 and math.isfinite(delta)):
    raise ValueError(f"delta={delta!r}: must be a finite number >= 0")
  lk = log_ratio(train_logprobs, sampler_logprobs, mask)
  adv = jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32))
  if adv.ndim == 1:
    adv = adv[:, None]
  if adv.ndim != 2 or adv.shape[0] != lk.shape[0] or adv.shape[1] not in (1, lk.shape[1]):
    raise ValueError(f"advantages must be [S] or [S, T] with S, T = {lk.shape}; got shape "
                     f"{jnp.shape(advantages)}")
  d = -_seq_mean(lk, mask)
  drop = (adv < 0) & (d > delta)[:, None]
  return _finish(jnp.broadcast_to(jnp.where(drop, 0.0, 1.0), lk.shape), mask)


def mcla_average(pass_logprobs: Array, mode: str = "logprob") -> Array:
  """MCLA (KAT-Coder-V2, arXiv 2603.27703): combine K trainer forward passes into one stream.

  The passes differ through nondeterministic kernels and reduction order, and MoE routing near
  ties; averaging reduces the noise in π_train before it meets μ.
    mode="logprob" (default):  (1/K) Σ_k log π_k       (log of the geometric mean of the probs)
    mode="prob":               log( (1/K) Σ_k π_k )    = logsumexp_k(log π_k) − log K
  By Jensen "prob" >= "logprob" elementwise; they agree when the passes agree. The default is the
  mean of log-probs; which of the two the report uses was not verified from its text.

  Args:
    pass_logprobs: [K, S, T], the trainer log-probs of the same tokens from K forward passes
      (the trainer supplies them).
    mode: "logprob" or "prob" (`MCLA_MODES`).

  Returns:
    [S, T] f32. Differentiable (the mean of the passes' gradients for "logprob"); wrap in
    `jax.lax.stop_gradient` when the result is used as π_old.

  Raises:
    ValueError: for pass_logprobs not [K, S, T] or an unknown mode.

  References:
    KAT-Coder-V2, arXiv 2603.27703.
  """
  x = jnp.asarray(pass_logprobs, jnp.float32)
  if x.ndim != 3:
    raise ValueError(f"pass_logprobs must be [K, S, T]; got shape {x.shape}")
  if mode == "logprob":
    return x.mean(0)
  if mode == "prob":
    # log-mean-exp, shifted by the (gradient-free) max for stability; all -inf stays -inf.
    top = jax.lax.stop_gradient(x.max(0))
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    return top + jnp.log(jnp.exp(x - top).mean(0))
  raise ValueError(f"mode={mode!r}: expected one of {MCLA_MODES}")


# ----------------------------------------------------------------------------------------------
# Metrics.


def mismatch_metrics(train_logprobs: Array, sampler_logprobs: Array, mask: Array,
                     weights: Optional[Array] = None) -> dict:
  """Scalar diagnostics of the train/sampler mismatch over the loss tokens of these arrays.

  With log k = train − sampler on loss tokens (N = Σ mask; means are masked means over them):
    mismatch_kl_k3         mean(k − 1 − log k). Tokens are sampled from μ, so with ρ = k = π/μ
                           this is Schulman's k3, an unbiased, >= 0 estimate of KL(μ ‖ π_train)
                           (verl's `k3_kl`). (ρ = μ/π would be unbiased only for samples from π.)
    mismatch_kl_k1         mean(−log k): the k1 estimate of the same KL (can be negative)
    mismatch_abs_log_ratio mean |log k|
    mismatch_max_ratio     max k over loss tokens (0 if there are none)
    mismatch_max_abs_log_ratio  max |log k| = max |Δ log-prob| over loss tokens (0 if none)
  and, when `weights` is given:
    masked_token_frac      fraction of loss tokens with weight 0
    masked_seq_frac        fraction of live sequences (>= 1 loss token) whose every loss token
                           has weight 0
    mean_weight            mean weight over loss tokens
  Means are over this batch only (a micro-batch gives its own means).

  Args:
    train_logprobs: [S, T] log π_train of the sampled tokens (see the module docstring).
    sampler_logprobs: [S, T] log μ from the sampler.
    mask: [S, T] float, 1 = loss token (log-probs elsewhere may hold anything).
    weights: [S, T] correction weights (e.g. from `apply`), or None.

  Returns:
    Metric name -> 0-d f32 value, gradient-stopped.

  Raises:
    ValueError: for mismatched shapes.
  """
  lk = log_ratio(train_logprobs, sampler_logprobs, mask)
  live = _live(mask)
  m = live.astype(jnp.float32)
  n = jnp.maximum(m.sum(), 1.0)
  mean = lambda x: (x * m).sum() / n
  k = jnp.exp(lk)
  metrics = {
      "mismatch_kl_k3": mean(k - 1.0 - lk),
      "mismatch_kl_k1": mean(-lk),
      "mismatch_abs_log_ratio": mean(jnp.abs(lk)),
      "mismatch_max_ratio": jnp.max(jnp.where(live, k, 0.0)),
      "mismatch_max_abs_log_ratio": jnp.max(jnp.where(live, jnp.abs(lk), 0.0)),
  }
  if weights is not None:
    w = jax.lax.stop_gradient(jnp.asarray(weights, jnp.float32))
    zero = live & (w == 0)
    live_seq = live.any(-1)
    dropped = live_seq & (zero.sum(-1) == live.sum(-1))
    metrics.update(
        masked_token_frac=zero.sum() / n,
        masked_seq_frac=dropped.sum() / jnp.maximum(live_seq.sum(), 1),
        mean_weight=mean(jnp.where(live, w, 0.0)),
    )
  return {key: jax.lax.stop_gradient(jnp.asarray(v, jnp.float32)) for key, v in metrics.items()}


# ----------------------------------------------------------------------------------------------
# Config and dispatch.


@dataclasses.dataclass(frozen=True)
class CorrectionConfig:
  """Which mismatch correction produces `SeqBatch.weights`, and its parameters.

  All fields are validated at construction (ValueError naming the field), whatever the kind.
  """

  kind: str = "none"            # one of KINDS
  token_cap: float = 2.0        # tis_token: C in min(k, C)
  seq_cap: float = 5.0          # tis_sequence: C in min(exp(Σ log k), C)
  icepop_alpha: float = 0.5     # icepop: lower bound α of the kept band of k (inclusive)
  icepop_beta: float = 5.0      # icepop: upper bound β of the kept band of k (inclusive)
  icepop_weighted: bool = True  # icepop: weight k inside the band (True) or a plain 0/1 mask
  geo_lower: float = 0.99       # geo_mask: keep a sequence iff geo_lower <= exp(mean log k) ...
  geo_upper: float = 1.01       # ... <= geo_upper (SkyRL geo_mask defaults)
  opsm_delta: float = 1e-4      # opsm: drop A < 0 sequences with mean(log μ − log π) > δ

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"CorrectionConfig.kind={self.kind!r}: expected one of {KINDS}")
    p = "CorrectionConfig."
    for name in ("token_cap", "seq_cap", "icepop_alpha", "icepop_beta", "geo_lower", "geo_upper",
                 "opsm_delta"):
      value = getattr(self, name)
      if not _is_number(value):
        raise ValueError(f"{p}{name}={value!r}: must be a number")
    _check_positive(p + "token_cap", self.token_cap)
    _check_positive(p + "seq_cap", self.seq_cap)
    _check_band(p + "icepop_alpha", self.icepop_alpha, p + "icepop_beta", self.icepop_beta)
    _check_band(p + "geo_lower", self.geo_lower, p + "geo_upper", self.geo_upper)
    if not (self.opsm_delta >= 0 and math.isfinite(self.opsm_delta)):
      raise ValueError(f"{p}opsm_delta={self.opsm_delta!r}: must be a finite number >= 0")
    if not isinstance(self.icepop_weighted, bool):
      raise ValueError(f"{p}icepop_weighted={self.icepop_weighted!r}: must be True or False")


def apply(cfg: CorrectionConfig, train_logprobs: Array, sampler_logprobs: Optional[Array],
          mask: Array, advantages: Optional[Array] = None) -> tuple[Array, dict]:
  """Per-token weights [S, T] for `SeqBatch.weights` and metrics, for the correction `cfg.kind`.

  Weights are float32, gradient-stopped, 1.0 where nothing is corrected (kind "none", non-loss
  positions) and 0.0 on masked tokens/sequences. Jittable with `cfg` static (it is frozen and
  hashable), e.g. `jax.jit(apply, static_argnums=0)`.

  Args:
    cfg: the correction and its parameters.
    train_logprobs: [S, T] log π_train of the sampled tokens (see the module docstring).
    sampler_logprobs: [S, T] log μ from the sampler, or None (allowed with kind "none" only).
    mask: [S, T] float, 1 = loss token (log-probs elsewhere may hold anything).
    advantages: [S] or [S, T], needed by "opsm" only.

  Returns:
    (weights, metrics): [S, T] f32 weights, and `mismatch_metrics` with the weights (empty when
    kind == "none" and there are no sampler log-probs).

  Raises:
    ValueError: for a cfg that is not a CorrectionConfig, missing sampler_logprobs or (opsm)
      advantages, or mismatched shapes.
  """
  if not isinstance(cfg, CorrectionConfig):
    raise ValueError(f"cfg must be a CorrectionConfig; got {type(cfg).__name__}")
  if sampler_logprobs is None:
    if cfg.kind == "none":
      return jnp.ones(jnp.shape(mask), jnp.float32), {}
    raise ValueError(f"CorrectionConfig.kind={cfg.kind!r} needs sampler_logprobs (log μ)")
  args = (train_logprobs, sampler_logprobs, mask)
  if cfg.kind == "none":
    _check_shapes(*args)
    weights = jnp.ones(jnp.shape(mask), jnp.float32)
  elif cfg.kind == "tis_token":
    weights = tis_token(*args, cap=cfg.token_cap)
  elif cfg.kind == "tis_sequence":
    weights = tis_sequence(*args, cap=cfg.seq_cap)
  elif cfg.kind == "icepop":
    weights = icepop(*args, alpha=cfg.icepop_alpha, beta=cfg.icepop_beta,
                     weighted=cfg.icepop_weighted)
  elif cfg.kind == "geo_mask":
    weights = geo_mask(*args, lower=cfg.geo_lower, upper=cfg.geo_upper)
  elif cfg.kind == "opsm":
    if advantages is None:
      raise ValueError("CorrectionConfig.kind='opsm' needs advantages ([S] or [S, T])")
    weights = opsm(*args, advantages, delta=cfg.opsm_delta)
  else:  # unreachable: __post_init__ validated the kind
    raise ValueError(f"CorrectionConfig.kind={cfg.kind!r}: expected one of {KINDS}")
  return weights, mismatch_metrics(*args, weights=weights)
