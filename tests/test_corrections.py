"""rl.corrections against plain NumPy transcriptions of the formulas, hand-computed cases,
stop-gradient, jit and error messages."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl import corrections as C

S, T = 7, 10


def _inputs(seed=0, scale=0.8):
  """Random log-probs with k = π/μ on both sides of the IcePop band, ragged masks, one empty
  sequence, and garbage (NaN / -inf) at non-loss positions."""
  rng = np.random.default_rng(seed)
  sampler = -rng.uniform(0.05, 4.0, (S, T))
  noise = rng.normal(0.0, scale, (S, T))
  noise[0, 0], noise[1, 1], noise[2, 0] = math.log(0.2), math.log(8.0), math.log(0.45)
  noise[3, 0], noise[4, 0] = math.log(6.0), math.log(3.0)
  train = sampler + noise
  lengths = [10, 7, 5, 3, 9, 0, 1]
  mask = (np.arange(T)[None, :] < np.array(lengths)[:, None]).astype(np.float32)
  train[mask == 0] = np.nan
  sampler[mask == 0] = -np.inf
  adv = rng.normal(size=S)
  adv[[0, 2, 4]] = -np.abs(adv[[0, 2, 4]])  # A < 0: 2 is off-policy (OPSM drops), 0 and 4 not
  adv[6] = abs(adv[6])                        # far off-policy but A > 0: OPSM keeps it
  return train.astype(np.float32), sampler.astype(np.float32), mask, adv.astype(np.float32)


# ----- independent NumPy references (float64, loops over sequences) ---------------------------


def ref_log_k(train, sampler, mask):
  out = []
  for i in range(train.shape[0]):
    idx = np.nonzero(mask[i] > 0)[0]
    out.append((idx, train[i, idx].astype(np.float64) - sampler[i, idx].astype(np.float64)))
  return out


def ref_weights(kind, train, sampler, mask, adv=None, **p):
  w = np.ones(train.shape)
  for i, (idx, lk) in enumerate(ref_log_k(train, sampler, mask)):
    k = np.exp(lk)
    if kind == "tis_token":
      w[i, idx] = np.minimum(k, p.get("cap", 2.0))
    elif kind == "tis_sequence":
      w[i, idx] = min(math.exp(lk.sum()), p.get("cap", 5.0))
    elif kind == "icepop":
      a, b = p.get("alpha", 0.5), p.get("beta", 5.0)
      inside = (k >= a) & (k <= b)
      w[i, idx] = np.where(inside, k if p.get("weighted", True) else 1.0, 0.0)
    elif kind == "geo_mask":
      g = math.exp(lk.mean()) if len(idx) else 1.0
      w[i, idx] = 1.0 if p.get("lower", 0.99) <= g <= p.get("upper", 1.01) else 0.0
    elif kind == "opsm":
      d = (-lk).mean() if len(idx) else 0.0
      a = np.asarray(adv, np.float64)
      a_tok = a[i, idx] if a.ndim == 2 else np.full(len(idx), a[i])
      w[i, idx] = np.where((a_tok < 0) & (d > p.get("delta", 1e-4)), 0.0, 1.0)
  return w


def ref_metrics(train, sampler, mask, w):
  lks = ref_log_k(train, sampler, mask)
  lk = np.concatenate([x for _, x in lks])
  k = np.exp(lk)
  ws = np.concatenate([w[i, idx] for i, (idx, _) in enumerate(lks)])
  live = [i for i, (idx, _) in enumerate(lks) if len(idx)]
  dropped = [i for i in live if np.all(w[i, lks[i][0]] == 0)]
  return {
      "mismatch_kl_k3": np.mean(k - 1 - np.log(k)),
      "mismatch_kl_k1": np.mean(-lk),
      "mismatch_abs_log_ratio": np.mean(np.abs(lk)),
      "mismatch_max_ratio": k.max(),
      "mismatch_max_abs_log_ratio": np.abs(lk).max(),
      "masked_token_frac": np.mean(ws == 0),
      "masked_seq_frac": len(dropped) / len(live),
      "mean_weight": ws.mean(),
  }


CASES = [
    ("tis_token", {}, {}),
    ("tis_token", dict(token_cap=1.5), dict(cap=1.5)),
    ("tis_sequence", {}, {}),
    ("tis_sequence", dict(seq_cap=50.0), dict(cap=50.0)),
    ("icepop", {}, {}),
    ("icepop", dict(icepop_weighted=False), dict(weighted=False)),
    ("icepop", dict(icepop_alpha=0.8, icepop_beta=1.25), dict(alpha=0.8, beta=1.25)),
    ("geo_mask", dict(geo_lower=0.8, geo_upper=1.25), dict(lower=0.8, upper=1.25)),
    ("opsm", dict(opsm_delta=0.05), dict(delta=0.05)),
    ("opsm", {}, {}),
]


def _check_against_reference(kind, cfg_kw, ref_kw, train, sampler, mask, adv):
  cfg = C.CorrectionConfig(kind=kind, **cfg_kw)
  w, metrics = C.apply(cfg, train, sampler, mask, adv)
  want = ref_weights(kind, train, sampler, mask, adv, **ref_kw)
  assert w.dtype == jnp.float32 and w.shape == (S, T)
  np.testing.assert_allclose(np.asarray(w), want, rtol=2e-6, atol=1e-7)
  want_m = ref_metrics(train, sampler, mask, want)
  assert set(metrics) == set(want_m)
  for key, value in want_m.items():
    np.testing.assert_allclose(float(metrics[key]), value, rtol=2e-5, atol=1e-6, err_msg=key)
  return np.asarray(w)


@pytest.mark.parametrize("kind,cfg_kw,ref_kw", CASES)
def test_matches_numpy_reference(kind, cfg_kw, ref_kw):
  train, sampler, mask, adv = _inputs()
  w = _check_against_reference(kind, cfg_kw, ref_kw, train, sampler, mask, adv)
  assert np.all(np.isfinite(w)) and np.all(w[mask == 0] == 1.0)
  if kind == "icepop":  # the random inputs hit the band on both sides and inside it
    lk = np.where(mask > 0, train - sampler, 0.0)
    assert np.any((mask > 0) & (np.exp(lk) < ref_kw.get("alpha", 0.5)))
    assert np.any((mask > 0) & (np.exp(lk) > ref_kw.get("beta", 5.0)))
    assert np.any((mask > 0) & (w > 0)) and np.any((mask > 0) & (w == 0))
  if kind == "opsm":
    assert np.any(w == 0) and np.any((mask > 0) & (w == 1))


def test_reference_coverage_of_masks():
  """The random inputs exercise both outcomes of every sequence-level rule."""
  train, sampler, mask, adv = _inputs()
  w = ref_weights("opsm", train, sampler, mask, adv, delta=0.05)
  live = mask.sum(-1) > 0
  dropped = np.all((w == 0) | (mask == 0), -1) & live
  np.testing.assert_array_equal(dropped, [0, 0, 1, 0, 0, 0, 0])
  w = ref_weights("geo_mask", train, sampler, mask, lower=0.8, upper=1.25)
  dropped = np.all((w == 0) | (mask == 0), -1) & live
  assert dropped.any() and (live & ~dropped).any()


def test_geo_mask_default_band_on_small_drift():
  train, sampler, mask, adv = _inputs(seed=1, scale=0.012)
  w = _check_against_reference("geo_mask", {}, {}, train, sampler, mask, adv)
  live = mask.sum(-1) > 0
  dropped = np.all((w == 0) | (mask == 0), -1) & live
  assert dropped.any() and (live & ~dropped).any()


def test_opsm_per_token_advantages():
  train, sampler, mask, _ = _inputs(seed=2)
  rng = np.random.default_rng(3)
  adv = rng.normal(size=(S, T)).astype(np.float32)
  _check_against_reference("opsm", dict(opsm_delta=0.0), dict(delta=0.0), train, sampler, mask,
                           adv)


# ----- hand-computed cases ------------------------------------------------------------------


def _pad(train, sampler, mask, adv=None):
  """Embed a small hand case at the top-left of [S, T] arrays; the rest is non-loss garbage
  (so every test shares one shape, and the padding must not change any result)."""
  tr, sa = np.full((S, T), np.nan, np.float32), np.full((S, T), -np.inf, np.float32)
  m = np.zeros((S, T), np.float32)
  s, t = np.shape(train)
  tr[:s, :t], sa[:s, :t], m[:s, :t] = train, sampler, mask
  if adv is None:
    return tr, sa, m
  a = np.full(S, -1.0, np.float32)
  a[:s] = adv
  return tr, sa, m, a


def _crop(w, shape):
  w = np.asarray(w)
  s, t = shape
  pad = np.ones_like(w, bool)
  pad[:s, :t] = False
  assert np.all(w[pad] == 1.0)  # non-loss positions are never corrected
  return w[:s, :t]


def test_opsm_hand_case():
  sampler = np.full((4, 3), -1.0, np.float32)
  train = np.array([[-1.2, -1.2, 0.0],    # D = 0.2 > 0.1, A < 0 -> dropped
                    [-1.2, -1.2, 0.0],    # D = 0.2, A > 0 -> kept
                    [-1.05, -1.05, -1.05],  # D = 0.05 <= 0.1, A < 0 -> kept
                    [-0.5, -0.9, -1.0]],  # D < 0 (trainer more confident), A < 0 -> kept
                   np.float32)
  mask = np.array([[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1]], np.float32)
  adv = np.array([-1.0, 1.0, -1.0, -2.0], np.float32)
  cfg = C.CorrectionConfig(kind="opsm", opsm_delta=0.1)
  w, m = C.apply(cfg, *_pad(train, sampler, mask, adv))
  np.testing.assert_array_equal(_crop(w, (4, 3)), [[0, 0, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]])
  assert float(m["masked_seq_frac"]) == pytest.approx(0.25)
  assert float(m["masked_token_frac"]) == pytest.approx(2 / 10)
  # A = 0 is not negative: kept even when far off-policy.
  w, _ = C.apply(cfg, *_pad(train, sampler, mask, np.zeros(4, np.float32)))
  assert np.all(np.asarray(w) == 1)


def test_geo_mask_hand_case():
  sampler = np.zeros((4, 3), np.float32)
  train = np.array([[0.005, -0.003, 5.0],   # mean log k 0.001: g 1.001 kept (5.0: no loss)
                    [0.02, 0.02, 0.02],     # g = e^0.02 = 1.0202 > 1.01 -> dropped
                    [-0.02, 0.0, 0.0],      # mask [1,1,0]: mean -0.01 -> g 0.99005 kept
                    [-0.03, -0.01, 0.0]],   # mask [1,1,0]: mean -0.02 -> g 0.9802 dropped
                   np.float32)
  mask = np.array([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 0]], np.float32)
  w = C.geo_mask(*_pad(train, sampler, mask))
  np.testing.assert_array_equal(_crop(w, (4, 3)), [[1, 1, 1], [0, 0, 0], [1, 1, 1], [0, 0, 1]])


def test_tis_and_icepop_hand_case():
  lk = np.log(np.array([[0.25, 0.5, 1.0, 3.0, 5.0, 6.0]], np.float32))
  args = _pad(lk, np.zeros_like(lk), np.ones_like(lk))
  crop = lambda w: _crop(w, lk.shape)
  np.testing.assert_allclose(crop(C.tis_token(*args)), [[0.25, 0.5, 1.0, 2.0, 2.0, 2.0]],
                             rtol=1e-6)
  # Σ log k = log(0.25·0.5·3·5·6) = log 11.25 -> capped at 5; with a larger cap 11.25.
  np.testing.assert_allclose(crop(C.tis_sequence(*args)), np.full((1, 6), 5.0), rtol=1e-6)
  np.testing.assert_allclose(crop(C.tis_sequence(*args, cap=20.0)), np.full((1, 6), 11.25),
                             rtol=1e-5)
  # Band [0.5, 5] inclusive on both ends.
  np.testing.assert_allclose(crop(C.icepop(*args)), [[0.0, 0.5, 1.0, 3.0, 5.0, 0.0]], rtol=1e-6)
  np.testing.assert_array_equal(crop(C.icepop(*args, weighted=False)), [[0, 1, 1, 1, 1, 0]])


def test_metrics_hand_case():
  train = np.log(np.array([[2.0, 1.0, 0.5, 7.0]], np.float32))
  mask = np.array([[1, 1, 1, 0]], np.float32)
  args = _pad(train, np.zeros_like(train), mask)
  w = np.ones((S, T), np.float32)
  w[0, 1:3] = 0.0
  m = C.mismatch_metrics(*args, weights=w)
  l2 = math.log(2)
  assert float(m["mismatch_kl_k3"]) == pytest.approx(((1 - l2) + 0 + (-0.5 + l2)) / 3, rel=1e-5)
  assert float(m["mismatch_kl_k1"]) == pytest.approx(0.0, abs=1e-6)
  assert float(m["mismatch_abs_log_ratio"]) == pytest.approx(2 * l2 / 3, rel=1e-5)
  assert float(m["mismatch_max_ratio"]) == pytest.approx(2.0, rel=1e-6)  # 7.0 is not a loss token
  assert float(m["masked_token_frac"]) == pytest.approx(2 / 3)
  assert float(m["masked_seq_frac"]) == 0.0
  w[0, 0] = 0.0  # every loss token of the only live sequence: the sequence counts as dropped
  m = C.mismatch_metrics(*args, weights=w)
  assert float(m["masked_seq_frac"]) == 1.0 and float(m["masked_token_frac"]) == 1.0
  assert float(m["mean_weight"]) == 0.0
  assert set(C.mismatch_metrics(*args)) == {
      "mismatch_kl_k3", "mismatch_kl_k1", "mismatch_abs_log_ratio", "mismatch_max_ratio",
      "mismatch_max_abs_log_ratio"}


def test_none_kind():
  train, sampler, mask, adv = _inputs()
  w, m = C.apply(C.CorrectionConfig(), train, sampler, mask)
  assert np.all(np.asarray(w) == 1.0) and float(m["masked_token_frac"]) == 0.0
  w, m = C.apply(C.CorrectionConfig(), train, None, mask)
  assert np.all(np.asarray(w) == 1.0) and w.shape == (S, T) and m == {}


def test_large_ratios_do_not_overflow():
  train = np.array([[80.0, 80.0, 80.0]], np.float32)  # Σ log k = 240: exp overflows float32
  args = _pad(train, np.zeros_like(train), np.ones_like(train))
  np.testing.assert_allclose(_crop(C.tis_sequence(*args), (1, 3)), 5.0, rtol=1e-6)
  np.testing.assert_allclose(_crop(C.tis_token(*args), (1, 3)), 2.0, rtol=1e-6)


# ----- MCLA -----------------------------------------------------------------------------------


def test_mcla_average():
  rng = np.random.default_rng(4)
  passes = (-rng.uniform(0.1, 3.0, (1, S, T)) + rng.normal(0, 0.3, (3, S, T))).astype(np.float32)
  p64 = passes.astype(np.float64)
  np.testing.assert_allclose(np.asarray(C.mcla_average(passes)), p64.mean(0), rtol=1e-6)
  prob = np.asarray(C.mcla_average(passes, mode="prob"))
  np.testing.assert_allclose(prob, np.log(np.exp(p64).mean(0)), rtol=1e-5, atol=1e-6)
  assert np.all(prob >= np.asarray(C.mcla_average(passes)) - 1e-6)  # Jensen
  same = np.broadcast_to(passes[:1], passes.shape)
  for mode in C.MCLA_MODES:
    np.testing.assert_allclose(np.asarray(C.mcla_average(same, mode)), passes[0], rtol=1e-6,
                               atol=1e-6)
  ninf = passes.copy()
  ninf[:, 0, 0] = -np.inf  # a padding position that is -inf in every pass stays -inf, not NaN
  assert np.asarray(C.mcla_average(ninf, "prob"))[0, 0] == -np.inf
  # The combined stream feeds apply like any trainer log-probs.
  mask = _inputs()[2]
  w, _ = C.apply(C.CorrectionConfig(kind="tis_token"), C.mcla_average(passes), passes[0], mask)
  want = ref_weights("tis_token", p64.mean(0), passes[0], mask)
  np.testing.assert_allclose(np.asarray(w), want, rtol=1e-5)


# ----- stop-gradient and jit ----------------------------------------------------------------


@pytest.mark.parametrize("kind", C.KINDS)
def test_weights_and_metrics_are_stop_gradient(kind):
  train, sampler, mask, adv = _inputs()
  train = np.where(mask > 0, train, -1.0).astype(np.float32)
  sampler = np.where(mask > 0, sampler, -1.0).astype(np.float32)
  cfg = C.CorrectionConfig(kind=kind, geo_lower=0.8, geo_upper=1.25, opsm_delta=0.05)
  rng = np.random.default_rng(5)
  coef = jnp.asarray(rng.normal(size=(S, T)), jnp.float32)

  def f(tr, sa):
    w, m = C.apply(cfg, tr, sa, mask, adv)
    return (w * coef).sum() + sum(v for v in m.values())

  g_train, g_sampler = jax.grad(f, argnums=(0, 1))(jnp.asarray(train), jnp.asarray(sampler))
  assert np.all(np.asarray(g_train) == 0) and np.all(np.asarray(g_sampler) == 0)


@pytest.fixture(scope="module")
def jitted():
  """One jitted program (one compile: compiles dominate this file's runtime) holding every
  kind, both MCLA modes with their gradients, and traced IcePop parameters."""
  train, sampler, mask, adv = _inputs()
  cases = [("none", {}, {})] + [CASES[i] for i in (0, 2, 4, 5, 7, 8)]  # every kind
  cfgs = [C.CorrectionConfig(kind=kind, **cfg_kw) for kind, cfg_kw, _ in cases]
  passes = np.stack([train, train + 0.1, train - 0.3])
  passes = np.where(mask > 0, passes, -1.0).astype(np.float32)

  def everything(tr, sa, m, a, ps, alpha, beta):
    out = [C.apply(cfg, tr, sa, m, a) for cfg in cfgs]
    mcla = [C.mcla_average(ps, mode) for mode in C.MCLA_MODES]
    grads = [jax.grad(lambda x, mode=mode: C.mcla_average(x, mode).sum())(ps)
             for mode in C.MCLA_MODES]
    return out, mcla, grads, C.icepop(tr, sa, m, alpha, beta)

  got = jax.jit(everything)(train, sampler, mask, adv, passes, 0.5, 5.0)
  return (train, sampler, mask, adv, passes), cases, got


def test_everything_runs_under_jit(jitted):
  (train, sampler, mask, adv, passes), cases, (out, mcla, _, ice) = jitted
  for (kind, _, ref_kw), (w, metrics) in zip(cases, out):
    want = ref_weights(kind, train, sampler, mask, adv, **ref_kw)
    np.testing.assert_allclose(np.asarray(w), want, rtol=2e-6, atol=1e-7, err_msg=kind)
    for key, value in ref_metrics(train, sampler, mask, want).items():
      np.testing.assert_allclose(float(metrics[key]), value, rtol=2e-5, atol=1e-6, err_msg=key)
  p64 = passes.astype(np.float64)
  np.testing.assert_allclose(np.asarray(mcla[0]), p64.mean(0), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(mcla[1]), np.log(np.exp(p64).mean(0)), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(ice), ref_weights("icepop", train, sampler, mask),
                             rtol=2e-6, atol=1e-7)


def test_mcla_gradients(jitted):
  """MCLA is differentiable: "logprob" averages the passes' gradients (1/K each), "prob" weights
  them by the softmax over passes, π_k / Σ_j π_j."""
  (_, _, _, _, passes), _, (_, _, grads, _) = jitted
  np.testing.assert_allclose(np.asarray(grads[0]), 1 / 3, rtol=1e-6)
  p64 = passes.astype(np.float64)
  np.testing.assert_allclose(np.asarray(grads[1]), np.exp(p64) / np.exp(p64).sum(0), rtol=1e-5)


# ----- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,needle", [
    (dict(kind="tis"), "CorrectionConfig.kind='tis'"),
    (dict(token_cap=0.0), "CorrectionConfig.token_cap=0.0"),
    (dict(token_cap=float("nan")), "CorrectionConfig.token_cap=nan"),
    (dict(seq_cap=-1.0), "CorrectionConfig.seq_cap=-1.0"),
    (dict(icepop_alpha=6.0), "CorrectionConfig.icepop_alpha=6.0 > CorrectionConfig.icepop_beta"),
    (dict(icepop_alpha=-0.1), "CorrectionConfig.icepop_alpha=-0.1"),
    (dict(icepop_beta=float("inf")), "CorrectionConfig.icepop_beta=inf"),
    (dict(geo_lower=1.02), "CorrectionConfig.geo_lower=1.02 > CorrectionConfig.geo_upper"),
    (dict(opsm_delta=-1e-3), "CorrectionConfig.opsm_delta=-0.001"),
    (dict(token_cap="2"), "CorrectionConfig.token_cap='2'"),
    (dict(icepop_weighted=1), "CorrectionConfig.icepop_weighted=1"),
])
def test_config_errors(kw, needle):
  with pytest.raises(ValueError, match=needle.replace(".", r"\.").replace("[", r"\[")):
    C.CorrectionConfig(**kw)


def test_apply_and_function_errors():
  train, sampler, mask, adv = _inputs()
  with pytest.raises(ValueError, match="kind='opsm' needs advantages"):
    C.apply(C.CorrectionConfig(kind="opsm"), train, sampler, mask)
  with pytest.raises(ValueError, match="kind='icepop' needs sampler_logprobs"):
    C.apply(C.CorrectionConfig(kind="icepop"), train, None, mask)
  with pytest.raises(ValueError, match="must all be"):
    C.apply(C.CorrectionConfig(kind="tis_token"), train, sampler[:, :3], mask)
  with pytest.raises(ValueError, match="advantages must be"):
    C.opsm(train, sampler, mask, adv[:3])
  with pytest.raises(ValueError, match="cap=0"):
    C.tis_token(train, sampler, mask, cap=0)
  with pytest.raises(ValueError, match="alpha=2.0 > beta=1.0"):
    C.icepop(train, sampler, mask, alpha=2.0, beta=1.0)
  with pytest.raises(ValueError, match="lower=1.1 > upper=1.0"):
    C.geo_mask(train, sampler, mask, lower=1.1, upper=1.0)
  with pytest.raises(ValueError, match="delta=-1"):
    C.opsm(train, sampler, mask, adv, delta=-1)
  with pytest.raises(ValueError, match="mode='mean'"):
    C.mcla_average(np.stack([train, train]), mode="mean")
  with pytest.raises(ValueError, match=r"\[K, S, T\]"):
    C.mcla_average(train)
  with pytest.raises(ValueError, match="CorrectionConfig"):
    C.apply({"kind": "none"}, train, sampler, mask)
