"""rl.losses against independent NumPy transcriptions of the published formulas.

For every loss in `LOSSES` (and extra configurations) the value and the gradient with respect to
`logprobs` equal a float64 NumPy reference written here from the papers' formulas; the reference
gradient is a central finite difference. Stop-gradients are transcribed by freezing the
stopped quantity at the base point `lp0`. The references deliberately use no rl.losses helper:
aggregations are written as loops over sequences and groups.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl import batch as rb
from rl import losses
from rl.losses import LossConfig

S, T = 6, 7
MAX_LEN = 10
FD_STEP = 1e-6
KINK_GAP = 1e-5  # log-space distance every ratio keeps from a clip kink (>> FD_STEP)

# ----------------------------------------------------------------------------- inputs


def make_case(seed: int = 0) -> dict:
  """S=6 sequences in 3 pairs (groups), ragged masks with holes, per-token advantages of both
  signs, log-ratios in [-2, 2] (sequence 0 is nearly on-policy: |log r| <= 1e-4, inside every
  clip range), turn ids that are LLM-call indices >= T with a fully masked turn, failed turns.
  float32 values (what JAX sees) stored as float64 (what the reference sees)."""
  rng = np.random.default_rng(seed)
  lengths = np.array([7, 5, 6, 3, 7, 4])
  mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float64)
  mask[0, 2] = mask[1, 1] = mask[2, 4] = mask[4, 1] = 0.0  # holes (mask[1, 1]: inside a turn)
  turn = np.zeros((S, T), np.int64)
  for s in range(S):
    ids = 3 + np.cumsum(rng.random(T) < 0.4) * rng.integers(1, 5)
    turn[s] = ids * 2  # call indices, not 0..n-1
  turn[4, :2] = 1  # call 1 of sequence 4 has no loss token (both its tokens are masked)
  mask[4, 0] = 0.0
  f32 = lambda x: np.asarray(x, np.float32).astype(np.float64)
  lp = f32(-rng.exponential(size=(S, T)) - 0.05)
  lr = rng.uniform(-2, 2, (S, T))
  lr[0] = rng.uniform(-1e-4, 1e-4, T)
  adv = np.repeat(rng.normal(size=(S, 1)), T, 1) + 0.3 * rng.normal(size=(S, T))
  adv[1] = -np.abs(adv[1])
  adv[2] = np.abs(adv[2])
  failed_turns = {int(turn[s, t]) for s, t in [(0, 6), (3, 0)]}
  return {
      "logprobs": lp, "mask": mask, "advantages": f32(adv), "old_logprobs": f32(lp - lr),
      "sampler_logprobs": f32(lp - lr + rng.normal(0, 0.5, (S, T))),
      "ref_logprobs": f32(lp + rng.normal(0, 0.7, (S, T))),
      "teacher_logprobs": f32(lp + rng.normal(0, 0.7, (S, T))),
      "entropy": f32(rng.uniform(0, 2, (S, T))), "weights": f32(rng.uniform(0.5, 1.5, (S, T))),
      "turn": turn, "failed": np.isin(turn, list(failed_turns)).astype(np.float64),
      "reward": f32(rng.integers(0, 2, S) + 0.1 * np.arange(S)),
      "group": np.repeat(np.arange(S // 2), 2),
  }


def to_batch(d: dict, counts_mask=None) -> rb.SeqBatch:
  """The case as a SeqBatch (float32); a None entry of d stays None."""
  get = lambda k, dt=jnp.float32: None if d.get(k) is None else jnp.asarray(d[k], dt)
  cm = d["mask"] if counts_mask is None else counts_mask
  return rb.SeqBatch(
      logprobs=get("logprobs"), mask=get("mask"), advantages=get("advantages"),
      old_logprobs=get("old_logprobs"), sampler_logprobs=get("sampler_logprobs"),
      ref_logprobs=get("ref_logprobs"), teacher_logprobs=get("teacher_logprobs"),
      entropy=get("entropy"), weights=get("weights"), turn=get("turn", jnp.int32),
      failed=get("failed"), reward=get("reward"), group=get("group", jnp.int32),
      counts=rb.global_counts(cm, d["group"]))


# ----------------------------------------------------------------------------- NumPy reference


def _live(d):
  return [i for i in range(len(d["mask"])) if d["mask"][i].sum() > 0]


def agg_tokens(l, d, mode, mask=None):
  """Aggregate a per-token loss l [S, T] over loss tokens (peers survey §4.9)."""
  m = d["mask"] if mask is None else mask
  live = [i for i in range(len(m)) if m[i].sum() > 0]
  if mode == "token_mean":
    return (l * m).sum() / max(m.sum(), 1)
  if mode == "seq_mean_token_mean":
    return sum((l[i] * m[i]).sum() / m[i].sum() for i in live) / max(len(live), 1)
  if mode == "seq_mean_token_sum":
    return sum((l[i] * m[i]).sum() for i in live) / max(len(live), 1)
  if mode == "seq_mean_token_sum_norm":
    return (l * m).sum() / (max(len(live), 1) * MAX_LEN)
  if mode == "prompt_mean":
    groups = sorted({d["group"][i] for i in live})
    per_group = []
    for g in groups:
      members = [i for i in live if d["group"][i] == g]
      per_group.append(sum((l[i] * m[i]).sum() for i in members)
                       / sum(m[i].sum() for i in members))
    return sum(per_group) / max(len(groups), 1)
  raise AssertionError(mode)


def agg_seqs(l, d, mode):
  """Aggregate a per-sequence loss l [S] over live sequences."""
  live = _live(d)
  if mode == "seq_mean":
    return sum(l[i] for i in live) / max(len(live), 1)
  if mode == "prompt_mean":
    groups = sorted({d["group"][i] for i in live})
    return sum(np.mean([l[i] for i in live if d["group"][i] == g]) for g in groups) / max(
        len(groups), 1)
  if mode == "token_mean":
    return sum(l[i] * d["mask"][i].sum() for i in live) / d["mask"].sum()
  raise AssertionError(mode)


def _old(d, lp0):
  return lp0 if d.get("old_logprobs") is None else d["old_logprobs"]


def _far_from(log_x, bounds):
  """The FD reference needs inputs away from clip kinks (the loss is not differentiable there)."""
  for b in bounds:
    if b > 0:
      gap = np.min(np.abs(np.asarray(log_x) - np.log(b)))
      assert gap > KINK_GAP, f"test input within {gap:g} of a kink at {b}; change the seed"


def ppo_clip(r, a, el, eh, dual=None):
  """-min(r A, clip(r, 1-el, 1+eh) A), dual clip: for A < 0 at most -c A (Ye et al. 2020)."""
  l = -np.minimum(r * a, np.clip(r, 1 - el, 1 + eh) * a)
  if dual is not None:
    l = np.where(a < 0, np.minimum(l, -dual * a), l)
  return l


def check_clip_inputs(r, m, el, eh, dual=None):
  _far_from(np.log(r[m > 0]), [1 - el, 1 + eh] + ([dual] if dual else []))


def ref_kl(lp, d, lp0, est):
  """Schulman's estimators of KL(π_θ ‖ π_ref), ρ = π_ref/π_θ."""
  log_rho = d["ref_logprobs"] - lp
  if est == "k1":
    return -log_rho
  if est == "k2":
    return 0.5 * log_rho ** 2
  k3 = np.exp(log_rho) - 1 - log_rho
  if est == "k3":
    return k3
  return np.exp(lp0 - _old(d, lp0)) * k3  # k3_is: sg(π_θ/π_old) k3


def ref_regular(lp, d, lp0, c):
  out = np.zeros_like(lp)
  if c.kl_coef:
    out = out + c.kl_coef * ref_kl(lp, d, lp0, c.kl_estimator)
  if c.entropy_coef:
    out = out - c.entropy_coef * d["entropy"]
  return out


def ref_opd_tokens(lp, d, lp0):
  """OPD: a_t = sg(log π_T - log π_θ), ℓ_t = -a_t r_t (weighted)."""
  a = d["teacher_logprobs"] - lp0
  return -a * np.exp(lp - _old(d, lp0)) * _w(d)


def _w(d):
  return 1.0 if d.get("weights") is None else d["weights"]


def _token_agg(c):
  agg = c.get("aggregation")
  return "seq_mean_token_mean" if agg == "seq_mean" else agg


def ref_extras(lp, d, lp0, c):
  """KL/entropy and OPD token terms of an RL loss, aggregated like the host loss."""
  out = agg_tokens(ref_regular(lp, d, lp0, c), d, _token_agg(c))
  if c.opd_coef:
    out += c.opd_coef * agg_tokens(ref_opd_tokens(lp, d, lp0), d, _token_agg(c))
  return out


def ref_ppo(lp, d, lp0, c, check=False):
  r = np.exp(lp - _old(d, lp0))
  el, eh = c.get("eps_low"), c.get("eps_high")
  if check:
    check_clip_inputs(r, d["mask"], el, eh, c.dual_clip)
  l = ppo_clip(r, d["advantages"], el, eh, c.dual_clip)
  if c.decoupled:
    bw = np.exp(d["old_logprobs"] - d["sampler_logprobs"])
    l = l * (bw if c.behaviour_cap is None else np.minimum(bw, c.behaviour_cap))
  l = l * _w(d) + ref_regular(lp, d, lp0, c)
  out = agg_tokens(l, d, c.get("aggregation"))
  if c.opd_coef:
    out += c.opd_coef * agg_tokens(ref_opd_tokens(lp, d, lp0), d, c.get("aggregation"))
  return out


def _seq_tokens(d, i):
  return np.nonzero(d["mask"][i])[0]


def ref_entropy_adv(d, alpha, eps=1e-6):
  """AEPO: A·(1 + α·(H - mean_g)/(std_g + eps)) over the loss tokens of each group."""
  out = np.zeros_like(d["advantages"])
  for g in np.unique(d["group"]):
    rows = np.nonzero(d["group"] == g)[0]
    h = np.concatenate([d["entropy"][i][d["mask"][i] > 0] for i in rows])
    for i in rows:
      z = (d["entropy"][i] - h.mean()) / (h.std() + eps) if len(h) else 0.0
      out[i] = d["advantages"][i] * (1 + alpha * z)
  return out


def ref_aepo(lp, d, lp0, c, check=False):
  """AEPO: the PPO clip, except -A·(1+ε_h)·r/sg(r) where A > 0 and r > 1+ε_h."""
  el, eh = c.get("eps_low"), c.get("eps_high")
  r0 = np.exp(lp0 - _old(d, lp0))
  if check:
    check_clip_inputs(r0, d["mask"], el, eh, c.dual_clip)
  a = ref_entropy_adv(d, c.get("entropy_adv_coef")) if c.get("entropy_adv_coef") else \
      d["advantages"]
  r = np.exp(lp - _old(d, lp0))
  l = np.where((a > 0) & (r0 > 1 + eh), -a * (1 + eh) * np.exp(lp - lp0),
               ppo_clip(r, a, el, eh, c.dual_clip))
  l = l * _w(d) + ref_regular(lp, d, lp0, c)
  out = agg_tokens(l, d, c.get("aggregation"))
  if c.opd_coef:
    out += c.opd_coef * agg_tokens(ref_opd_tokens(lp, d, lp0), d, c.get("aggregation"))
  return out


def ref_gspo(lp, d, lp0, c, check=False):
  """(1/G) Σ_i min(s_i A_i, clip(s_i) A_i), s_i = (Π_t r_t)^(1/|y_i|)."""
  el, eh = c.get("eps_low"), c.get("eps_high")
  r = np.exp(lp - _old(d, lp0))
  l = np.zeros(len(lp))
  for i in _live(d):
    idx = _seq_tokens(d, i)
    s = np.prod(r[i, idx]) ** (1.0 / len(idx))
    a = d["advantages"][i, idx].mean()
    w = 1.0 if d.get("weights") is None else d["weights"][i, idx].mean()
    if check:
      _far_from([np.log(s)], [1 - el, 1 + eh] + ([c.dual_clip] if c.dual_clip else []))
    l[i] = w * ppo_clip(s, a, el, eh, c.dual_clip)
  return agg_seqs(l, d, c.get("aggregation")) + ref_extras(lp, d, lp0, c)


def ref_gspo_token(lp, d, lp0, c, check=False):
  """s_{i,t} = sg(s_i) π_θ(y_t)/sg(π_θ(y_t)), per-token clipped surrogate."""
  el, eh = c.get("eps_low"), c.get("eps_high")
  r0 = np.exp(lp0 - _old(d, lp0))
  l = np.zeros_like(lp)
  for i in _live(d):
    idx = _seq_tokens(d, i)
    s0 = np.prod(r0[i, idx]) ** (1.0 / len(idx))
    s = s0 * np.exp(lp[i, idx] - lp0[i, idx])
    if check:
      _far_from([np.log(s0)], [1 - el, 1 + eh])
    l[i, idx] = ppo_clip(s, d["advantages"][i, idx], el, eh, c.dual_clip)
  l = l * _w(d) + ref_regular(lp, d, lp0, c)
  out = agg_tokens(l, d, c.get("aggregation"))
  if c.opd_coef:
    out += c.opd_coef * agg_tokens(ref_opd_tokens(lp, d, lp0), d, c.get("aggregation"))
  return out


def ref_turn_gspo(lp, d, lp0, c, check=False):
  """KAT-Coder-V2 eqs. 6-7: per turn k, ρ_k = Π_{t∈k} r_t (or its geometric mean), A_k the
  turn's mean advantage; per trajectory the mean over its turns of the clipped surrogate."""
  el, eh = c.get("eps_low"), c.get("eps_high")
  r = np.exp(lp - _old(d, lp0))
  l = np.zeros(len(lp))
  for i in _live(d):
    turns = {}
    for t in _seq_tokens(d, i):
      turns.setdefault(int(d["turn"][i, t]), []).append(t)
    per_turn = []
    for idx in turns.values():
      rho = np.prod(r[i, idx])
      if c.turn_ratio == "geometric_mean":
        rho = rho ** (1.0 / len(idx))
      if check:
        _far_from([np.log(rho)], [1 - el, 1 + eh])
      w = 1.0 if d.get("weights") is None else d["weights"][i, idx].mean()
      per_turn.append(w * ppo_clip(rho, d["advantages"][i, idx].mean(), el, eh, c.dual_clip))
    l[i] = np.mean(per_turn)
  return agg_seqs(l, d, c.get("aggregation")) + ref_extras(lp, d, lp0, c)


def ref_cispo(lp, d, lp0, c, check=False):
  """MiniMax-M1: -sg(clip(r, 1-el, 1+eh)) A log π_θ (token mean); masked form with M."""
  el, eh = c.get("eps_low"), c.get("eps_high")
  r0 = np.exp(lp0 - _old(d, lp0))
  if check:
    check_clip_inputs(r0, d["mask"], el, eh)
  a = d["advantages"]
  l = -np.clip(r0, 1 - el, 1 + eh) * a * lp
  if c.cispo_masked:
    keep = ~(((a > 0) & (r0 > 1 + eh)) | ((a < 0) & (r0 < 1 - el)))
    l = l * keep
  l = l * _w(d) + ref_regular(lp, d, lp0, c)
  out = agg_tokens(l, d, c.get("aggregation"))
  if c.opd_coef:
    out += c.opd_coef * agg_tokens(ref_opd_tokens(lp, d, lp0), d, c.get("aggregation"))
  return out


def ref_kimi(lp, d, lp0, c, check=False):
  """(R_i - mean_{j∈group} R_j - τ Σ_t log(π_θ/π_old))², averaged over K samples then prompts."""
  live = _live(d)
  lr = (lp - _old(d, lp0)) * d["mask"]
  l = np.zeros(len(lp))
  for i in live:
    peers = [j for j in live if d["group"][j] == d["group"][i]]
    rbar = np.mean([d["reward"][j] for j in peers])
    w = 1.0 if d.get("weights") is None else d["weights"][i, _seq_tokens(d, i)].mean()
    l[i] = w * (d["reward"][i] - rbar - c.tau * lr[i].sum()) ** 2
  return agg_seqs(l, d, c.get("aggregation")) + ref_extras(lp, d, lp0, c)


def ref_opd(lp, d, lp0, c, check=False):
  l = ref_opd_tokens(lp, d, lp0) + ref_regular(lp, d, lp0, c)
  return agg_tokens(l, d, c.get("aggregation"))


def ref_dpo(lp, d, lp0, c, check=False):
  """Mean over pairs of -log σ(β[(Σ logπ_c - Σ logref_c) - (Σ logπ_r - Σ logref_r)])."""
  h = ((lp - d["ref_logprobs"]) * d["mask"]).sum(-1)
  out = []
  for g in np.unique(d["group"]):
    i, j = np.nonzero(d["group"] == g)[0]
    chosen, rejected = (i, j) if d["reward"][i] > d["reward"][j] else (j, i)
    z = c.dpo_beta * (h[chosen] - h[rejected])
    out.append(np.log1p(np.exp(-z)))
  return np.mean(out) + agg_tokens(ref_regular(lp, d, lp0, c), d, c.get("aggregation"))


def ref_sft(lp, d, lp0, c, check=False):
  m = d["mask"] * (1 - d["failed"]) if c.mask_failed_turns else d["mask"]
  return agg_tokens(-lp * _w(d), d, c.get("aggregation"), mask=m)


REFERENCES = {
    "sft": ref_sft, "ppo": ref_ppo, "grpo": ref_ppo, "dr_grpo": ref_ppo, "dapo": ref_ppo,
    "aepo": ref_aepo,
    "gspo": ref_gspo, "gspo_token": ref_gspo_token, "turn_gspo": ref_turn_gspo,
    "cispo": ref_cispo, "kimi_pmd": ref_kimi, "opd": ref_opd, "dpo": ref_dpo,
}


def reference(d, cfg):
  """Reference value and central-difference gradient w.r.t. logprobs (loss tokens only)."""
  fn = REFERENCES[cfg.name]
  lp0 = d["logprobs"]
  value = fn(lp0, d, lp0, cfg, check=True)
  grad = np.zeros_like(lp0)
  for s, t in zip(*np.nonzero(d["mask"])):
    e = np.zeros_like(lp0)
    e[s, t] = FD_STEP
    grad[s, t] = (fn(lp0 + e, d, lp0, cfg) - fn(lp0 - e, d, lp0, cfg)) / (2 * FD_STEP)
  return value, grad


# ----------------------------------------------------------------------------- cases


def _case_id(case):
  cfg, opts = case
  diff = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
          if f.name not in ("name", "max_len") and getattr(cfg, f.name) != f.default}
  return "-".join([cfg.name] + [f"{k}={v}" for k, v in diff.items()] + sorted(opts))


def cases():
  """(cfg, options): every registered loss with its defaults, plus extra configurations.
  options: "on_policy" (old_logprobs = None), "no_weights", "failed_counts" (Counts of the
  error-masked SFT mask)."""
  c = lambda name, *opts, **kw: (LossConfig(name=name, max_len=MAX_LEN, **kw), set(opts))
  out = [c(n) for n in sorted(losses.LOSSES)]
  out += [c("ppo", aggregation=a) for a in losses.AGGREGATIONS]
  out += [c("ppo", dual_clip=3.0), c("ppo", decoupled=True, behaviour_cap=1.5),
          c("ppo", decoupled=True), c("ppo", entropy_coef=0.05), c("ppo", "on_policy")]
  out += [c("ppo", kl_coef=0.2, kl_estimator=k) for k in losses.KL_ESTIMATORS]
  out += [c("grpo", kl_coef=0.1), c("grpo", opd_coef=0.5), c("dr_grpo", dual_clip=2.5),
          c("dapo", "on_policy", kl_coef=0.1, kl_estimator="k3_is")]
  out += [c("aepo", entropy_adv_coef=0.5), c("aepo", "on_policy", entropy_adv_coef=0.2),
          c("aepo", dual_clip=3.0, kl_coef=0.1, opd_coef=0.3)]
  out += [c("gspo", aggregation=a) for a in ("prompt_mean", "token_mean")]
  out += [c("gspo", eps_low=0.2, eps_high=0.2, kl_coef=0.1, entropy_coef=0.05, opd_coef=0.3),
          c("gspo", "on_policy"), c("gspo_token", eps_low=0.2, eps_high=0.28),
          c("gspo_token", "on_policy")]
  out += [c("turn_gspo", turn_ratio="geometric_mean"), c("turn_gspo", dual_clip=3.0),
          c("turn_gspo", "no_weights", aggregation="prompt_mean", kl_coef=0.1)]
  out += [c("cispo", cispo_masked=True), c("cispo", cispo_masked=True, eps_low=0.5, eps_high=0.5),
          c("cispo", "on_policy", opd_coef=0.5), c("cispo", eps_low=0.2, eps_high=0.28)]
  out += [c("kimi_pmd", tau=0.3), c("kimi_pmd", "on_policy", aggregation="seq_mean"),
          c("kimi_pmd", opd_coef=0.5, kl_coef=0.1)]
  out += [c("opd", "on_policy"), c("opd", aggregation="prompt_mean", kl_coef=0.1),
          c("dpo", dpo_beta=0.5, entropy_coef=0.05)]
  out += [c("sft", "failed_counts", mask_failed_turns=True),
          c("sft", aggregation="seq_mean_token_mean")]
  return out


def _data(opts):
  d = make_case()
  if "on_policy" in opts:
    d["old_logprobs"] = None
  if "no_weights" in opts:
    d["weights"] = None
  return d


def _value_and_grad(batch, cfg):
  fn = lambda lp: losses.compute(batch.replace(logprobs=lp), cfg)
  (v, metrics), g = jax.value_and_grad(fn, has_aux=True)(batch.logprobs)
  return float(v), np.asarray(g), metrics


@pytest.mark.parametrize("case", cases(), ids=_case_id)
def test_matches_numpy_reference(case):
  cfg, opts = case
  d = _data(opts)
  counts_mask = d["mask"] * (1 - d["failed"]) if "failed_counts" in opts else None
  v, g, metrics = _value_and_grad(to_batch(d, counts_mask), cfg)
  v_ref, g_ref = reference(d, cfg)
  np.testing.assert_allclose(v, v_ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-6)
  assert np.abs(g_ref).max() > 1e-3  # the case exercises the loss
  assert all(np.isfinite(float(x)) for x in metrics.values())


def test_all_losses_jit():
  """Every registered loss traces under jit (one compilation of their sum) and matches eager."""
  batch = to_batch(make_case(1))
  cfgs = [LossConfig(name=n, max_len=MAX_LEN) for n in sorted(losses.LOSSES)]
  total = lambda lp: sum(losses.compute(batch.replace(logprobs=lp), c)[0] for c in cfgs)
  v, g = jax.jit(jax.value_and_grad(total))(batch.logprobs)
  eager = [_value_and_grad(batch, c) for c in cfgs]
  np.testing.assert_allclose(v, sum(e[0] for e in eager), rtol=1e-6)
  np.testing.assert_allclose(g, sum(e[1] for e in eager), rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- clipping


def _clip_batch():
  """Tokens (r, A): in range, clipped with A (no PPO gradient), clipped against A (gradient),
  and ratios far above CISPO's cap; laid out on the two rows of one group of an [S, T] batch
  (the other rows have no loss token), returned flat in row-major order of the loss tokens."""
  r = np.array([1.05, 1.5, 0.5, 1.5, 0.5, 0.95, 8.0, 8.0])
  a = np.array([1.0, 1.0, -1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
  def put(x, fill=0.0):
    out = np.full(S * T, fill)
    out[:len(x)] = x
    return out.reshape(S, T)

  lp = np.full((S, T), -1.0)
  d = {"logprobs": lp, "old_logprobs": lp - np.log(put(r, 1.0)), "advantages": put(a),
       "mask": put(np.ones(len(r))), "group": np.repeat(np.arange(S // 2), 2)}
  return to_batch(d), r, a, d["mask"] > 0


def test_ppo_zero_gradient_exactly_where_clipped_with_advantage():
  batch, r, a, live = _clip_batch()
  for name in ("ppo", "grpo", "dapo", "dr_grpo"):
    _, g, _ = _value_and_grad(batch, LossConfig(name=name, max_len=MAX_LEN))
    assert np.all(g[~live] == 0.0)
    g = g[live]
    eps_high = losses.DEFAULTS[name]["eps_high"]
    clipped = ((a > 0) & (r > 1 + eps_high)) | ((a < 0) & (r < 0.8))
    assert np.all(g[clipped] == 0.0), name
    assert np.all(g[~clipped] != 0.0), name
    if name == "ppo":  # token_mean over the 8 loss tokens: d(-r A)/d log π = -r A
      np.testing.assert_allclose(g[~clipped], (-r * a / len(r))[~clipped], rtol=1e-5)


def test_cispo_keeps_gradient_of_clipped_tokens():
  batch, r, a, live = _clip_batch()
  _, g, m = _value_and_grad(batch, LossConfig(name="cispo"))
  g = g[live]
  assert np.all(g != 0.0)
  w = np.clip(r, 0.0, 5.0)  # weight capped at 1 + eps_high = 5
  np.testing.assert_allclose(g, -w * a / len(r), rtol=1e-5)
  assert float(m["clip_fraction"]) == pytest.approx(2 / len(r))
  _, g, _ = _value_and_grad(batch, LossConfig(name="cispo", cispo_masked=True, eps_low=0.2,
                                              eps_high=0.2))
  g = g[live]
  ppo_zero = ((a > 0) & (r > 1.2)) | ((a < 0) & (r < 0.8))
  assert np.all(g[ppo_zero] == 0.0) and np.all(g[~ppo_zero] != 0.0)


def test_gspo_token_equals_gspo_for_sequence_advantages():
  d = make_case(2)
  d["weights"] = None
  d["advantages"] = np.repeat(d["advantages"][:, :1], T, 1)
  batch = to_batch(d)
  for eps in (None, 0.2):
    v1, g1, _ = _value_and_grad(batch, LossConfig(name="gspo", eps_low=eps, eps_high=eps))
    v2, g2, _ = _value_and_grad(batch, LossConfig(name="gspo_token", eps_low=eps, eps_high=eps))
    np.testing.assert_allclose(v1, v2, rtol=1e-6)
    np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-8)


def test_turn_segments_remap_call_ids():
  turn = np.zeros((S, T), np.int32)
  mask = np.zeros((S, T), np.float32)
  turn[:2] = [[7, 7, 9, 9, 40, 40, 41], [2, 5, 5, 5, 5, 8, 8]]
  mask[:2] = [[1, 0, 1, 1, 0, 0, 1], [0, 0, 1, 1, 1, 1, 0]]
  b = rb.SeqBatch(logprobs=jnp.zeros(mask.shape), mask=jnp.asarray(mask), turn=jnp.asarray(turn))
  seg = np.asarray(losses.turn_segments(b))
  expected = np.zeros((S, T), np.int64)
  expected[:2] = [[0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 1, 1]]
  expected += T * np.arange(S)[:, None]
  np.testing.assert_array_equal(np.where(mask > 0, seg, -1), np.where(mask > 0, expected, -1))
  assert seg.min() >= 0 and seg.max() < mask.size


# ----------------------------------------------------------------------------- edge cases


def _kill(d, rows):
  """d with `rows` turned into sequences without loss tokens, each in its own group, holding
  NaN/-inf in every per-token field."""
  d = {k: (None if v is None else np.array(v)) for k, v in d.items()}
  for s in rows:
    for k, v in d.items():
      if v is None or k == "turn":
        continue
      if k == "mask":
        v[s] = 0.0
      elif k == "group":
        v[s] = 100 + s
      elif k == "reward":
        v[s] = 5.0
      else:
        v[s] = -np.inf if k == "old_logprobs" else np.nan
  return d


@pytest.mark.parametrize("name", sorted(losses.LOSSES))
def test_sequence_without_loss_tokens_contributes_nothing(name):
  """Sequences 4 and 5 have no loss token and garbage values: the loss and the other sequences'
  gradients equal the reference on sequences 0-3 alone; the dead rows get exactly 0."""
  cfg = LossConfig(name=name, max_len=MAX_LEN)
  d = make_case()
  v, g, metrics = _value_and_grad(to_batch(_kill(d, [4, 5])), cfg)
  assert np.isfinite(v) and np.all(np.isfinite(g))
  assert all(np.isfinite(float(x)) for x in metrics.values())
  v_ref, g_ref = reference({k: None if x is None else x[:4] for k, x in d.items()}, cfg)
  np.testing.assert_allclose(v, v_ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(g[:4], g_ref, rtol=1e-4, atol=1e-6)
  assert np.all(g[4:] == 0.0)


@pytest.mark.parametrize("name", sorted(losses.LOSSES))
def test_all_masked_batch_is_zero(name):
  d = make_case()
  d["mask"] = np.zeros((S, T))
  d["logprobs"] = np.full((S, T), np.nan)
  v, g, metrics = _value_and_grad(to_batch(d), LossConfig(name=name, max_len=MAX_LEN))
  assert v == 0.0 and np.all(g == 0.0)
  assert all(np.isfinite(float(x)) for x in metrics.values())


@pytest.mark.parametrize("cfg, drop, match", [
    (LossConfig(name="nope"), None, "LossConfig.name='nope'"),
    (LossConfig(name="ppo", aggregation="mean"), None, "LossConfig.aggregation='mean'"),
    (LossConfig(name="gspo", aggregation="seq_mean_token_sum"), None, "LossConfig.aggregation"),
    (LossConfig(name="grpo", aggregation="seq_mean"), None, "LossConfig.aggregation"),
    (LossConfig(name="dr_grpo"), None, "LossConfig.max_len=0"),
    (LossConfig(name="ppo", kl_coef=0.1, kl_estimator="k4"), None, "LossConfig.kl_estimator"),
    (LossConfig(name="ppo", kl_estimator="k4"), None, "LossConfig.kl_estimator"),
    (LossConfig(name="turn_gspo", turn_ratio="mean"), None, "LossConfig.turn_ratio"),
    (LossConfig(name="ppo", dual_clip=0.5), None, "LossConfig.dual_clip"),
    (LossConfig(name="ppo", eps_low=-0.1), None, "LossConfig.eps_low"),
    (LossConfig(name="kimi_pmd", tau=0.0), None, "LossConfig.tau"),
    (LossConfig(name="dpo", kl_coef=0.1), None, "LossConfig.kl_coef"),
    (LossConfig(name="dpo"), "ref_logprobs", "ref_logprobs"),
    (LossConfig(name="grpo", kl_coef=0.1), "ref_logprobs", "ref_logprobs"),
    (LossConfig(name="opd"), "teacher_logprobs", "teacher_logprobs"),
    (LossConfig(name="grpo", opd_coef=0.1), "teacher_logprobs", "teacher_logprobs"),
    (LossConfig(name="ppo", entropy_coef=0.1), "entropy", "entropy"),
    (LossConfig(name="aepo", entropy_adv_coef=0.1), "entropy", "SeqBatch.entropy"),
    (LossConfig(name="grpo", entropy_adv_coef=0.1), None, "LossConfig.entropy_adv_coef"),
    (LossConfig(name="kimi_pmd"), "reward", "reward"),
    (LossConfig(name="turn_gspo"), "turn", "turn"),
    (LossConfig(name="ppo", decoupled=True), "sampler_logprobs", "decoupled"),
    (LossConfig(name="sft", mask_failed_turns=True), "failed", "mask_failed_turns"),
    (LossConfig(name="cispo"), "advantages", "advantages"),
])
def test_bad_config_or_missing_input_raises(cfg, drop, match):
  d = make_case()
  if drop:
    d[drop] = None
  with pytest.raises(ValueError, match=match.replace(".", r"\.")):
    losses.compute(to_batch(d), cfg)
