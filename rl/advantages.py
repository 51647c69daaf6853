"""Advantage estimators and reward shaping on per-sequence arrays (docs/design.md §3).

A *sequence* is one trajectory (`TreeBatch.seqs`). Inputs are per-sequence arrays of the whole
batch: `rewards` [S] float, `group` [S] integer group ids (the G samples of one task share an
id; ids need not be contiguous or sorted) and an optional `valid` [S] bool mask (padding
sequences or sequences dropped by a filter). Invalid sequences take no part in any statistic and
get advantage 0.

Group statistics use an [S, S] same-group matrix (row i = the valid members of i's group) and
element-wise masked reductions, so every function is jittable with no Python loop over groups.
Reductions are element-wise sums, never matmuls: an f32 matmul on TPU runs in bf16 passes by
default and would perturb means and variances. Memory is O(S^2); S is the number of
trajectories in the batch (thousands at most), not tokens.

Degenerate groups. A group whose valid rewards are all equal (this includes a group of one)
carries no learning signal: its advantage is exactly 0 in every estimator here. The test is
exact (group max == group min) rather than `std == 0`, because the float mean of equal values
can be off by an ulp, and an ulp divided by `std + eps` is not small.

The estimators return float32 advantages (`same_group` a bool matrix).

Tree rollouts. `tree_advantages` credits each LLM call of one group's tree of calls
(`rl.tree.call_segments`) with TreeRL's segment advantage, [S, K] per (trajectory, call);
`turn_broadcast` turns it into per-token advantages. `entropy_aware` reweights per-token
advantages by the group-standardised token entropy (AEPO); the `aepo` loss applies it in-loss.

Learned critic. `gae` (and `tree_gae` on a tree-packed batch) computes per-token GAE
advantages and value targets from a critic's values, one per (trajectory, sampled token) entry;
`CRITIC_ADVANTAGES` names the estimators that need a critic.

Size: one public function per estimator, each beside its jitted core and its formula; the
critic's estimators (`gae`, `tree_gae`) are the part to move into a module of their own next.
"""

from __future__ import annotations

import numbers
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
f32 = jnp.float32


# --------------------------------------------------------------------------------------------
# Input checks (static: shapes, dtypes and Python-number hyper-parameters; safe under jit).


def _check_number(name: str, value, low: Optional[float] = None, high: Optional[float] = None,
                  low_open: bool = False):
  """ValueError unless a Python number lies in [low, high] (low exclusive if low_open).

  Traced values (a hyper-parameter passed through jit) cannot be checked and are accepted.
  """
  if not isinstance(value, numbers.Real):
    return
  if (low is not None and (value < low or (low_open and value == low))) or (
      high is not None and value > high):
    lo = "(" if low_open else "["
    raise ValueError(f"{name} must be in {lo}{low}, {high}], got {value!r}")


def _as(x, dtype=None):
  """x as an array of dtype, without running device ops on host data.

  Host data (lists, NumPy) is converted by NumPy and handed to the jitted core as is; a
  jax.Array (or tracer) is cast on device only if its dtype differs. Eager JAX conversions
  would each compile a tiny XLA program per shape.
  """
  if isinstance(x, jax.Array):
    return x if dtype is None or x.dtype == dtype else x.astype(dtype)
  if any(isinstance(leaf, jax.Array) for leaf in jax.tree_util.tree_leaves(x)):
    return jnp.asarray(x, dtype)  # e.g. a list of tracers (a list argument under jit)
  return np.asarray(x, dtype)


def _seq_inputs(rewards, group, valid) -> tuple[Array, Array, Array]:
  """Validated (rewards f32 [S], group int [S], valid bool [S])."""
  rewards = _as(rewards, f32)
  group = _as(group)
  if rewards.ndim != 1:
    raise ValueError(f"rewards must be 1-D [S], got shape {rewards.shape}")
  if group.shape != rewards.shape:
    raise ValueError(f"group must have the shape of rewards {rewards.shape}, got {group.shape}")
  if not jnp.issubdtype(group.dtype, jnp.integer):
    raise ValueError(f"group must hold integer ids, got dtype {group.dtype}")
  valid = _valid(valid, rewards.shape)
  return rewards, group, valid


def _valid(valid, shape) -> Array:
  if valid is None:
    return np.ones(shape, bool)
  valid = _as(valid)
  if valid.shape != tuple(shape):
    raise ValueError(f"valid must have shape {tuple(shape)}, got {valid.shape}")
  return _as(valid, bool)


# --------------------------------------------------------------------------------------------
# Group statistics.


def same_group(group: Array, valid: Array) -> Array:
  """Same-group matrix [S, S] bool: sequences i and j share a group and j is valid.

  Row i selects the members that define i's group statistics (i itself only if valid).

  Args:
    group: [S] int group ids.
    valid: [S] bool.

  Returns:
    [S, S] bool.
  """
  return (group[:, None] == group[None, :]) & valid[None, :]


def _row_sum(same: Array, x: Array) -> Array:
  """[S]: sum of x [S] over the True entries of each row of same [S, S]."""
  return jnp.sum(jnp.where(same, x[None, :], 0.0), axis=1)


def _group_stats(rewards: Array, same: Array):
  """Per sequence, stats of its group's valid members: (n, mean, population std, degenerate).

  n [S] f32 member count; mean, std [S] f32 (0 where n = 0); degenerate [S] bool = all member
  rewards equal (exact max == min; true for n <= 1).
  """
  n = jnp.sum(same, axis=1).astype(f32)
  safe_n = jnp.maximum(n, 1.0)
  mean = _row_sum(same, rewards) / safe_n
  # Two-pass variance: no catastrophic cancellation of E[x^2] - E[x]^2.
  var = jnp.sum(jnp.where(same, (rewards[None, :] - mean[:, None]) ** 2, 0.0), axis=1) / safe_n
  gmax = jnp.max(jnp.where(same, rewards[None, :], -jnp.inf), axis=1)
  gmin = jnp.min(jnp.where(same, rewards[None, :], jnp.inf), axis=1)
  degenerate = (n <= 1) | (gmax == gmin)
  return n, mean, jnp.sqrt(var), degenerate


def group_mean(values, group, valid=None) -> Array:
  """Mean of `values` over the valid members of each sequence's group.

  Args:
    values: [S] float.
    group: [S] int group ids.
    valid: [S] bool, or None (all valid).

  Returns:
    [S] f32, 0 for a sequence whose group has no valid member.

  Raises:
    ValueError: for mismatched shapes or non-integer group ids.
  """
  return _group_mean(*_seq_inputs(values, group, valid))


@jax.jit
def _group_mean(values, group, valid):
  return _group_stats(values, same_group(group, valid))[1]


# --------------------------------------------------------------------------------------------
# Group-relative estimators (registry `ADVANTAGES`).


def grpo(rewards, group, valid=None, eps: float = 1e-6) -> Array:
  """GRPO advantage: A_i = (R_i - mean_g) / (std_g + eps).

  mean_g and the population std_g are over the valid members of i's group.
  Decision: a group with std 0 (all rewards equal, or a single member) gets A = 0 exactly,
  not (R - mean)/eps, which would amplify float rounding of the mean to O(1e-2).

  Args:
    rewards: [S] float.
    group: [S] int group ids.
    valid: [S] bool, or None (all valid); invalid sequences get 0.
    eps: >= 0, added to the std.

  Returns:
    [S] f32 advantages.

  Raises:
    ValueError: for mismatched shapes, non-integer group ids or eps < 0.

  References:
    DeepSeekMath (GRPO).
  """
  _check_number("eps", eps, low=0.0)
  return _grpo(*_seq_inputs(rewards, group, valid), eps)


@jax.jit
def _grpo(rewards, group, valid, eps):
  _, mean, std, degenerate = _group_stats(rewards, same_group(group, valid))
  adv = (rewards - mean) / (std + eps)
  return jnp.where(valid & ~degenerate, adv, 0.0)


def dr_grpo(rewards, group, valid=None) -> Array:
  """Dr. GRPO advantage (mean-only baseline): A_i = R_i - mean_g.

  No std division (it up-weights near-constant groups). Constant groups give exactly 0.

  Args:
    rewards: [S] float.
    group: [S] int group ids.
    valid: [S] bool, or None (all valid); invalid sequences get 0.

  Returns:
    [S] f32 advantages.

  Raises:
    ValueError: for mismatched shapes or non-integer group ids.

  References:
    Dr. GRPO.
  """
  return _dr_grpo(*_seq_inputs(rewards, group, valid))


@jax.jit
def _dr_grpo(rewards, group, valid):
  _, mean, _, degenerate = _group_stats(rewards, same_group(group, valid))
  return jnp.where(valid & ~degenerate, rewards - mean, 0.0)


def rloo(rewards, group, valid=None) -> Array:
  """RLOO advantage: A_i = R_i - (1/(n-1)) sum_{j != i} R_j over the group's valid members.

  A group of one has no "others": A = 0 (as for constant groups).

  Args:
    rewards: [S] float.
    group: [S] int group ids.
    valid: [S] bool, or None (all valid); invalid sequences get 0.

  Returns:
    [S] f32 advantages.

  Raises:
    ValueError: for mismatched shapes or non-integer group ids.
  """
  return _rloo(*_seq_inputs(rewards, group, valid))


@jax.jit
def _rloo(rewards, group, valid):
  same = same_group(group, valid)
  n, _, _, degenerate = _group_stats(rewards, same)
  others = (_row_sum(same, rewards) - rewards) / jnp.maximum(n - 1.0, 1.0)
  return jnp.where(valid & ~degenerate, rewards - others, 0.0)


def reinforce_pp_baseline(rewards, group, valid=None, eps: float = 1e-6,
                          weights=None) -> Array:
  """REINFORCE++-baseline: group-centre the rewards, then whiten over the whole batch.

  c_i = R_i - mean_g;  A_i = (c_i - m) / (s + eps), with m, s the (weighted) mean and
  population std of c over all valid sequences of the batch.
  Decision: sequences of constant groups keep A = 0 (with unit weights m = 0, so this only
  removes rounding; with other weights it keeps "no signal from a zero-variance group").

  Args:
    rewards: [S] float.
    group: [S] int group ids.
    valid: [S] bool, or None (all valid); invalid sequences get 0.
    eps: >= 0, added to s.
    weights: [S] weight of each sequence in m and s, or None (1 each); pass token counts to
      reproduce OpenRLHF, which whitens over tokens, i.e. length-weighted.

  Returns:
    [S] f32 advantages.

  Raises:
    ValueError: for mismatched shapes, non-integer group ids or eps < 0.
  """
  _check_number("eps", eps, low=0.0)
  rewards, group, valid = _seq_inputs(rewards, group, valid)
  if weights is None:
    weights = np.ones(rewards.shape, np.float32)
  weights = _as(weights, f32)
  if weights.shape != rewards.shape:
    raise ValueError(f"weights must have shape {rewards.shape}, got {weights.shape}")
  return _reinforce_pp_baseline(rewards, group, valid, eps, weights)


@jax.jit
def _reinforce_pp_baseline(rewards, group, valid, eps, weights):
  _, mean, _, degenerate = _group_stats(rewards, same_group(group, valid))
  centred = jnp.where(valid, rewards - mean, 0.0)
  w = jnp.where(valid, weights, 0.0)
  total = jnp.maximum(jnp.sum(w), 1e-30)
  m = jnp.sum(w * centred) / total
  s = jnp.sqrt(jnp.sum(w * (centred - m) ** 2) / total)
  return jnp.where(valid & ~degenerate, (centred - m) / (s + eps), 0.0)


ADVANTAGES: dict[str, Callable[..., Array]] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp_baseline": reinforce_pp_baseline,
}


def compute(name: str, rewards, group, valid=None, **kwargs) -> Array:
  """The `name` estimator of `ADVANTAGES` on per-sequence rewards.

  Args:
    name: a key of `ADVANTAGES`.
    rewards: [S] float.
    group: [S] int group ids.
    valid: [S] bool, or None (all valid); invalid sequences get 0.
    **kwargs: the estimator's options (e.g. eps for grpo).

  Returns:
    [S] f32 advantages.

  Raises:
    ValueError: for an unknown name, or the estimator's own input checks.
  """
  if name not in ADVANTAGES:
    raise ValueError(f"unknown advantage estimator name={name!r}; valid names: "
                     f"{sorted(ADVANTAGES)}")
  return ADVANTAGES[name](rewards, group, valid, **kwargs)


# --------------------------------------------------------------------------------------------
# Rescaling and broadcasting.


def kat_rescale(advantages, group, entropy, *, difficulty_coef: float, entropy_coef: float,
                rewards=None, success=None, threshold: float = 0.0, valid=None) -> Array:
  """KAT-Coder difficulty- and entropy-aware rescaling of sequence advantages.

  A'_ij = A_ij * max(0, 1 + λ (D_g - mean_g' D_g')) * max(0, 1 + μ (H_ij - mean_j H_ij))
  with D_g = 1 - success rate of group g (harder groups weigh more), the mean over groups
  counting each group once (not each sequence), H_ij the trajectory's mean token entropy and
  mean_j the mean over its group (more exploratory trajectories weigh more). Both factors are
  clamped at 0 so a large coefficient can never flip an advantage's sign.

  Args:
    advantages: [S] f32, e.g. from `grpo`.
    group: [S] int group ids.
    entropy: [S] f32, each trajectory's mean token entropy H_ij.
    difficulty_coef: λ >= 0 (the report gives no values: choose them).
    entropy_coef: μ >= 0.
    rewards: [S] float; success is rewards > threshold. Pass exactly one of rewards and
      success.
    success: [S] bool or 0/1.
    threshold: the success threshold on `rewards`.
    valid: [S] bool, or None (all valid); invalid sequences are excluded from all means and
      get 0.

  Returns:
    [S] f32 rescaled advantages.

  Raises:
    ValueError: for a negative coefficient, mismatched shapes, or not exactly one of rewards
      and success.
  """
  _check_number("difficulty_coef", difficulty_coef, low=0.0)
  _check_number("entropy_coef", entropy_coef, low=0.0)
  advantages, group, valid = _seq_inputs(advantages, group, valid)
  entropy = _as(entropy, f32)
  if entropy.shape != advantages.shape:
    raise ValueError(f"entropy must have shape {advantages.shape}, got {entropy.shape}")
  if (rewards is None) == (success is None):
    raise ValueError("pass exactly one of rewards (with threshold) or success, got "
                     f"rewards={'None' if rewards is None else 'array'}, "
                     f"success={'None' if success is None else 'array'}")
  if success is None:
    rewards = _as(rewards, f32)
    if rewards.shape != advantages.shape:
      raise ValueError(f"rewards must have shape {advantages.shape}, got {rewards.shape}")
    success = rewards > threshold
  success = _as(success)
  if success.shape != advantages.shape:
    raise ValueError(f"success must have shape {advantages.shape}, got {success.shape}")
  return _kat_rescale(advantages, group, entropy, _as(success, f32), valid, difficulty_coef,
                      entropy_coef)


@jax.jit
def _kat_rescale(advantages, group, entropy, success, valid, difficulty_coef, entropy_coef):
  same = same_group(group, valid)
  n, rate, _, _ = _group_stats(success, same)
  _, mean_entropy, _, _ = _group_stats(entropy, same)
  difficulty = 1.0 - rate
  # Each valid sequence weighted 1/n_g: every group then contributes weight 1 in total.
  per_group = jnp.where(valid, 1.0 / jnp.maximum(n, 1.0), 0.0)
  mean_difficulty = jnp.sum(per_group * difficulty) / jnp.maximum(jnp.sum(per_group), 1e-30)
  group_factor = jnp.maximum(0.0, 1.0 + difficulty_coef * (difficulty - mean_difficulty))
  sample_factor = jnp.maximum(0.0, 1.0 + entropy_coef * (entropy - mean_entropy))
  return jnp.where(valid, advantages * group_factor * sample_factor, 0.0)


def resum_broadcast(traj_values, segment_traj, traj_ids=None) -> Array:
  """ReSum: give every summary segment its trajectory's value (reward or advantage).

  With context summarisation one trajectory is trained as several segments (sequences). Compute
  rewards/advantages once per *trajectory* (so a trajectory with more segments does not weigh
  more in its group's statistics), then broadcast them here.

  Args:
    traj_values: [N] f32, one value per trajectory.
    segment_traj: [S] int trajectory id of each segment.
    traj_ids: [N] int ids of traj_values, or None (positions 0..N-1); ids should be unique,
      else the first match wins.

  Returns:
    [S] f32; 0 for a segment whose id matches no trajectory.

  Raises:
    ValueError: for inputs that are not 1-D, or traj_ids of another shape than traj_values.
  """
  traj_values = _as(traj_values, f32)
  segment_traj = _as(segment_traj)
  if traj_values.ndim != 1:
    raise ValueError(f"traj_values must be 1-D [N], got shape {traj_values.shape}")
  if segment_traj.ndim != 1:
    raise ValueError(f"segment_traj must be 1-D [S], got shape {segment_traj.shape}")
  if traj_ids is None:
    traj_ids = np.arange(traj_values.shape[0])
  traj_ids = _as(traj_ids)
  if traj_ids.shape != traj_values.shape:
    raise ValueError(f"traj_ids must have shape {traj_values.shape}, got {traj_ids.shape}")
  if traj_values.shape[0] == 0:  # nothing to match (argmax over an empty axis is undefined)
    return jnp.zeros(segment_traj.shape, f32)
  return _resum_broadcast(traj_values, segment_traj, traj_ids)


@jax.jit
def _resum_broadcast(traj_values, segment_traj, traj_ids):
  # Match matrix, not traj_values[segment_traj]: a JAX gather clamps bad ids silently.
  match = segment_traj[:, None] == traj_ids[None, :]  # [S, N]
  first = jnp.argmax(match, axis=1)
  return jnp.where(jnp.any(match, axis=1), traj_values[first], 0.0)


def returns_to_go(turn_rewards, gamma: float = 1.0, turn_valid=None) -> Array:
  """Discounted return-to-go per turn: G_k = sum_{k' >= k} γ^(k'-k) r_k'.

  Args:
    turn_rewards: [S, K] f32 per-turn (or per-step) rewards; put a terminal reward on the last
      real turn.
    gamma: the discount γ in [0, 1].
    turn_valid: [S, K] bool, or None (all valid); padding turns: reward ignored, return 0.

  Returns:
    [S, K] f32 returns.

  Raises:
    ValueError: for gamma outside [0, 1], turn_rewards not [S, K], or turn_valid of another
      shape.
  """
  _check_number("gamma", gamma, low=0.0, high=1.0)
  turn_rewards = _as(turn_rewards, f32)
  if turn_rewards.ndim != 2:
    raise ValueError(f"turn_rewards must be 2-D [S, K], got shape {turn_rewards.shape}")
  return _returns_to_go(turn_rewards, gamma, _valid(turn_valid, turn_rewards.shape))


@jax.jit
def _returns_to_go(turn_rewards, gamma, turn_valid):
  r = jnp.where(turn_valid, turn_rewards, 0.0)

  def step(carry, r_k):
    g = r_k + gamma * carry
    return g, g

  _, out = jax.lax.scan(step, jnp.zeros(r.shape[:1], f32), r.T, reverse=True)
  return jnp.where(turn_valid, out.T, 0.0)


def turn_broadcast(turn_values, turn_id, mask=None) -> Array:
  """Per-token values from per-turn values: out[s, t] = turn_values[s, turn_id[s, t]].

  Args:
    turn_values: [S, K] f32.
    turn_id: [S, T] int (or float, as `SeqBatch.turn`), the call that produced each token.
    mask: [S, T], nonzero = real token, or None (all real).

  Returns:
    [S, T] f32; 0 where masked or where turn_id is outside [0, K).

  Raises:
    ValueError: for turn_values not [S, K], or turn_id or mask not [S, T].
  """
  turn_values = _as(turn_values, f32)
  turn_id = _as(turn_id)
  if turn_values.ndim != 2:
    raise ValueError(f"turn_values must be 2-D [S, K], got shape {turn_values.shape}")
  if turn_id.ndim != 2 or turn_id.shape[0] != turn_values.shape[0]:
    raise ValueError(f"turn_id must be [S, T] with S = {turn_values.shape[0]}, "
                     f"got shape {turn_id.shape}")
  mask = np.ones(turn_id.shape, bool) if mask is None else _valid(mask, turn_id.shape)
  return _turn_broadcast(turn_values, turn_id, mask)


@jax.jit
def _turn_broadcast(turn_values, turn_id, mask):
  ids = turn_id.astype(jnp.int32)
  num_turns = turn_values.shape[1]
  in_range = (ids >= 0) & (ids < num_turns)
  gathered = jnp.take_along_axis(turn_values, jnp.clip(ids, 0, num_turns - 1), axis=1)
  return jnp.where(in_range & mask, gathered, 0.0)


def per_turn_advantages(turn_rewards, turn_id, gamma: float = 1.0, mask=None,
                        turn_valid=None) -> Array:
  """Per-token advantage = return-to-go of the token's turn (no baseline subtracted).

  See `returns_to_go` and `turn_broadcast`; subtract a baseline (e.g. a group mean of the
  per-turn returns) before calling if one is wanted.

  Args:
    turn_rewards: [S, K] f32 per-turn rewards.
    turn_id: [S, T] int, the turn of each token.
    gamma: the discount in [0, 1].
    mask: [S, T], nonzero = real token, or None.
    turn_valid: [S, K] bool, or None (all turns real).

  Returns:
    [S, T] f32 advantages.

  Raises:
    ValueError: as `returns_to_go` and `turn_broadcast`.
  """
  return turn_broadcast(returns_to_go(turn_rewards, gamma, turn_valid), turn_id, mask)


def broadcast(seq_values, mask) -> Array:
  """Per-token values from per-sequence values: seq_values[s] where mask[s, t] != 0, else 0.

  Args:
    seq_values: [S] f32.
    mask: [S, T].

  Returns:
    [S, T] f32.

  Raises:
    ValueError: unless seq_values is [S] and mask [S, T].
  """
  seq_values = _as(seq_values, f32)
  mask = _as(mask)
  if seq_values.ndim != 1 or mask.ndim != 2 or mask.shape[0] != seq_values.shape[0]:
    raise ValueError(f"need seq_values [S] and mask [S, T], got seq_values shape "
                     f"{seq_values.shape}, mask shape {mask.shape}")
  return _broadcast(seq_values, mask)


@jax.jit
def _broadcast(seq_values, mask):
  return jnp.where(mask != 0, seq_values[:, None], 0.0)


# --------------------------------------------------------------------------------------------
# Learned-critic advantages: GAE on (tree-packed) sequences.


def gae(rewards, values, valid, gamma: float = 1.0, lam: float = 1.0) -> tuple[Array, Array]:
  """Generalized advantage estimation over each sequence's tokens, and the value targets.

  Token t of sequence s is one action; V_t = values[s, t] the critic's value of the state it is
  sampled from (the context before it). Over the valid entries of a row, in order:

    δ_t = r_t + γ·V_{t+1} - V_t,   A_t = Σ_{l>=0} (γλ)^l δ_{t+l},   R_t = A_t + V_t,

  with V = 0 after the last valid entry (the episode ends there). Invalid entries (padding,
  holes) are skipped: they get 0 and the recursion passes over them. λ = 1 gives the discounted
  return minus V_t (Monte Carlo); λ = 0 the one-step TD error.

  Args:
    rewards: [S] f32 terminal rewards, given to each row's last valid token, or [S, T] f32
      per-token rewards r_t (read at valid entries only).
    values: [S, T] f32 V_t (treated as constants: no gradient flows into the targets).
    valid: [S, T] bool, the real entries of each row.
    gamma: the discount γ in [0, 1].
    lam: the GAE λ in [0, 1].

  Returns:
    (advantages, returns): [S, T] f32 each, 0 at invalid entries.

  Raises:
    ValueError: for gamma or lam outside [0, 1], values not [S, T], or rewards or valid of
      another shape.

  References:
    Schulman et al., "High-Dimensional Continuous Control Using Generalized Advantage
    Estimation", ICLR 2016, §3 (the GAE(γ, λ) estimator).
  """
  _check_number("gamma", gamma, low=0.0, high=1.0)
  _check_number("lam", lam, low=0.0, high=1.0)
  values = _as(values, f32)
  if values.ndim != 2:
    raise ValueError(f"values must be 2-D [S, T], got shape {values.shape}")
  valid = _valid(valid, values.shape)
  rewards = _as(rewards, f32)
  if rewards.shape == values.shape[:1]:
    rewards = _terminal(rewards, valid)
  elif rewards.shape != values.shape:
    raise ValueError(f"rewards must be [S] {values.shape[:1]} or [S, T] {values.shape}, got "
                     f"shape {rewards.shape}")
  return _gae(rewards, values, valid, gamma, lam)


@jax.jit
def _terminal(rewards, valid):
  """[S, T]: each row's reward at its last valid entry, 0 elsewhere."""
  t = jnp.arange(valid.shape[1])
  last = jnp.max(jnp.where(valid, t[None, :], -1), axis=1)
  return jnp.where(t[None, :] == last[:, None], rewards[:, None], 0.0)


@jax.jit
def _gae(rewards, values, valid, gamma, lam):
  values = jax.lax.stop_gradient(values)
  r = jnp.where(valid, rewards, 0.0)
  v = jnp.where(valid, values, 0.0)

  def step(carry, xs):
    next_value, next_adv = carry
    r_t, v_t, ok = xs
    adv = r_t + gamma * next_value - v_t + gamma * lam * next_adv
    # An invalid entry is no step: it outputs 0 and hands the carry on unchanged.
    carry = (jnp.where(ok, v_t, next_value), jnp.where(ok, adv, next_adv))
    return carry, jnp.where(ok, adv, 0.0)

  zeros = jnp.zeros(values.shape[:1], f32)
  _, adv = jax.lax.scan(step, (zeros, zeros), (r.T, v.T, valid.T), reverse=True)
  adv = adv.T
  return adv, jnp.where(valid, adv + v, 0.0)


def tree_gae(rewards, flat_values, seq_pred, seq_valid, gamma: float = 1.0,
             lam: float = 1.0) -> tuple[Array, Array]:
  """GAE on a tree-packed batch: per (trajectory, sampled token) advantages and value targets.

  The critic runs once on the packed rows, giving one value per position: the value of the
  state "context up to and including this position". The state a sampled token is drawn from
  is its predicting position (`TreeBatch.seq_pred`, the parent in the tree), so each
  trajectory's V_t is gathered from there and `gae` runs along the trajectory's own sampled
  tokens in order (its path; the tool and observation tokens between two calls are the
  environment's transition, not steps).

  Shared nodes. A token sampled by several trajectories (a shared prefix of branched episodes)
  is one position of the tree but one entry of each trajectory's sequence, so it gets one
  advantage and one target per path: nothing is averaged or merged per node. The packed loss is
  computed on these per-sequence arrays and reaches the shared position through the gather of
  `rl.batch.gather`, whose backward is a scatter-add: the position's gradient is the sum, over
  the paths through it, of each path's own gradient, which is exactly the gradient of training
  the unpacked paths (and the aggregation scales count every (path, token) entry, as the
  unpacked batch does). Proof sketch: with ℓ_p(x_p) a path's loss of its gathered inputs x_p =
  (log π, V at its entries) and x_p = G_p·y (G_p a 0/1 gather matrix from the flat positions
  y), ∂/∂y Σ_p ℓ_p = Σ_p G_pᵀ ∂ℓ_p/∂x_p; unpacked, each path reads the same values (logits and
  values depend only on the context), so its gradient is ∂ℓ_p/∂x_p and the parameters' chain
  rule through y is shared. Merging per node would be exact only for losses linear in A (Σ_p
  A_p) or the unclipped squared error (weight n, target mean R_p); PPO's clip and the clipped
  value loss act on each (A_p, R_p) separately, so the per-path layout is the only exact one.

  Args:
    rewards: [S] f32 terminal rewards (at each trajectory's last sampled token), or [S, T]
      per-token rewards aligned with the sequences.
    flat_values: [rows, row_len] (or flat) f32 critic values of every packed position.
    seq_pred: [S, T] int flat index of each sampled token's predicting position
      (`TreeBatch.seq_pred`).
    seq_valid: [S, T] bool real entries (`TreeBatch.seq_valid`).
    gamma: the discount γ in [0, 1].
    lam: the GAE λ in [0, 1].

  Returns:
    (advantages, returns): [S, T] f32, 0 at padding; store them as per-token fields (e.g.
    "advantage" and "returns") so `rl.batch.from_tree_batch` reads them.

  Raises:
    ValueError: as `gae`, or seq_pred of another shape than seq_valid.

  References:
    Schulman et al. 2016 (GAE); Kwai "Tree Training", arXiv 2511.00413 (gradients of shared
    prefixes as sums over paths).
  """
  seq_pred, seq_valid = _as(seq_pred), _as(seq_valid)
  if seq_pred.shape != seq_valid.shape or seq_pred.ndim != 2:
    raise ValueError(f"seq_pred and seq_valid must both be [S, T], got shapes {seq_pred.shape} "
                     f"and {seq_valid.shape}")
  values = _gather_values(_as(flat_values, f32), seq_pred)
  return gae(rewards, values, seq_valid, gamma, lam)


@jax.jit
def _gather_values(flat_values, seq_pred):
  return jnp.take(flat_values.reshape(-1), seq_pred)


# Estimators that need a learned critic's values (not per-sequence rewards alone, as the
# `ADVANTAGES` signature takes): the RL step runs the critic before computing them.
CRITIC_ADVANTAGES: dict[str, Callable[..., tuple[Array, Array]]] = {
    "gae": tree_gae,
}


# --------------------------------------------------------------------------------------------
# Tree credit assignment and entropy-aware token advantages.


def tree_advantages(rewards, segment, parent, valid=None) -> Array:
  """TreeRL segment advantages of one group's tree of LLM calls.

  Nodes are calls in their history (`rl.tree.call_segments`); the leaves under a node are the
  valid trajectories whose path passes through it. With V(n) the mean reward of the valid
  leaves under n and V(root) the mean reward of the group's valid trajectories:

    A(n) = (G(n) + L(n)) / sqrt(|L(n)|),  G(n) = V(n) - V(root),  L(n) = V(n) - V(p(n)),

  |L(n)| the number of valid leaves under n. p(n) is n's parent *segment* in TreeRL's sense:
  TreeRL splits a path into segments only where it branches, so a run of calls that no
  trajectory leaves is one segment. Here every call is a node, so p(n) is the nearest ancestor
  call whose valid leaves are more than n's (the branch point above n), or the root; plain
  parents would give the later calls of an unbranched run L = 0 and call 0 the whole local
  term. In the tree-packed loss a node's tokens get the gradient of each of its |L(n)| paths,
  which sum to sqrt(|L(n)|)·(G + L): the 1/sqrt(|L|) is TreeRL's reweighting of shared steps.
  Independent episodes (no shared call): every segment is a leaf, A = 2 (r - mean).
  A group whose valid rewards are all equal (or one valid trajectory) gives 0 everywhere,
  exactly. Rewards are used as given (TreeRL's V is the fraction of correct leaves: 0/1
  rewards).

  Args:
    rewards: [S] float, one per trajectory of the group.
    segment: [S, K] int, the node of trajectory s's call k, -1 for padding.
    parent: [N] int, each node's parent node, -1 for the root (the prompt).
    valid: [S] bool, or None (all valid); invalid trajectories are no leaf and get 0.

  Returns:
    [S, K] f32 advantage of each trajectory's calls (0 at padding and invalid rows).

  Raises:
    ValueError: for rewards not [S], segment not [S, K], parent not 1-D, non-integer node ids,
      host node ids outside [-1, N) or valid of another shape.

  References:
    Hou et al., "TreeRL: LLM Reinforcement Learning with On-Policy Tree Search",
    arXiv 2506.11902 (process supervision: global and local advantages).
  """
  rewards = _as(rewards, f32)
  segment, parent = _as(segment), _as(parent)
  if rewards.ndim != 1:
    raise ValueError(f"rewards must be 1-D [S], got shape {rewards.shape}")
  if segment.ndim != 2 or segment.shape[0] != rewards.shape[0]:
    raise ValueError(f"segment must be [S, K] with S = {rewards.shape[0]}, got shape "
                     f"{segment.shape}")
  if parent.ndim != 1:
    raise ValueError(f"parent must be 1-D [N], got shape {parent.shape}")
  num_nodes = parent.shape[0]
  for name, x in (("segment", segment), ("parent", parent)):
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{name} must hold integer node ids, got dtype {x.dtype}")
    # Host ids are checked: a JAX gather would clamp an out-of-range id silently.
    if isinstance(x, np.ndarray) and x.size and not (x.min() >= -1 and x.max() < num_nodes):
      raise ValueError(f"{name} must hold node ids in [-1, {num_nodes}), got values in "
                       f"[{x.min()}, {x.max()}]")
  return _tree_advantages(rewards, segment, parent, _valid(valid, rewards.shape))


@jax.jit
def _tree_advantages(rewards, segment, parent, valid):
  num_nodes = parent.shape[0]
  if num_nodes == 0:  # no calls: nothing to credit
    return jnp.zeros(segment.shape, f32)
  nodes = jnp.arange(num_nodes)
  # through[s, n]: node n is on trajectory s's path (a path visits a node at most once).
  through = jnp.any(segment[:, :, None] == nodes[None, None, :], axis=1) & valid[:, None]
  count = jnp.sum(through, axis=0).astype(f32)                                     # |L(n)|
  value = jnp.sum(jnp.where(through, rewards[:, None], 0.0), axis=0) / jnp.maximum(count, 1.0)
  n_valid = jnp.sum(valid).astype(f32)
  root = jnp.sum(jnp.where(valid, rewards, 0.0)) / jnp.maximum(n_valid, 1.0)
  # Segment parent: climb while the parent has the same valid leaves (ancestors hold a superset,
  # so equal counts mean equal sets); pointer doubling reaches the top of the run in log2(N).
  safe_parent = jnp.maximum(parent, 0)
  same = (parent >= 0) & (count[safe_parent] == count)
  top = jnp.where(same, safe_parent, nodes)
  for _ in range(max(1, int(np.ceil(np.log2(num_nodes + 1))))):
    top = top[top]
  seg_parent = parent[top]
  parent_value = jnp.where(seg_parent >= 0, value[jnp.maximum(seg_parent, 0)], root)
  adv = ((value - root) + (value - parent_value)) / jnp.sqrt(jnp.maximum(count, 1.0))
  gmax = jnp.max(jnp.where(valid, rewards, -jnp.inf))
  gmin = jnp.min(jnp.where(valid, rewards, jnp.inf))
  degenerate = (n_valid <= 1) | (gmax == gmin)
  out = adv[jnp.clip(segment, 0, num_nodes - 1)]
  return jnp.where((segment >= 0) & valid[:, None] & ~degenerate, out, 0.0)


def entropy_aware(advantages, entropy, mask, group, alpha, eps: float = 1e-6) -> Array:
  """AEPO entropy-aware advantage: A_t · (1 + α · Ĥ_t), Ĥ the group-standardised entropy.

  Ĥ_t = (H_t - mean_g) / (std_g + eps) with mean_g and the population std_g over the loss
  tokens (mask != 0) of every sequence of t's group, so tokens more uncertain than their group's
  average get a larger share of the advantage. A group never straddles micro-batches, so the
  statistics (and the result) are the same whatever the micro-batching. A group whose loss
  tokens all have the same entropy gets Ĥ = 0 exactly. The factor is not clamped: α·Ĥ < -1
  flips a token's advantage, as in the paper's formula. The entropy is a constant (no gradient).

  Args:
    advantages: [S, T] f32 per-token advantages.
    entropy: [S, T] f32 policy entropy at each token.
    mask: [S, T], nonzero = loss token.
    group: [S] int group ids.
    alpha: α >= 0.
    eps: >= 0, added to the std.

  Returns:
    [S, T] f32 advantages, 0 where mask = 0.

  Raises:
    ValueError: for mismatched shapes, non-integer group ids, alpha < 0 or eps < 0.

  References:
    Dong et al., "Agentic Entropy-Balanced Policy Optimization", arXiv 2510.14545
    (entropy-aware advantage estimation).
  """
  _check_number("alpha", alpha, low=0.0)
  _check_number("eps", eps, low=0.0)
  advantages, entropy = _as(advantages, f32), _as(entropy, f32)
  if advantages.ndim != 2:
    raise ValueError(f"advantages must be 2-D [S, T], got shape {advantages.shape}")
  for name, x in (("entropy", entropy), ("mask", _as(mask))):
    if x.shape != advantages.shape:
      raise ValueError(f"{name} must have shape {advantages.shape}, got {x.shape}")
  group = _as(group)
  if group.shape != advantages.shape[:1]:
    raise ValueError(f"group must have shape {advantages.shape[:1]}, got {group.shape}")
  if not jnp.issubdtype(group.dtype, jnp.integer):
    raise ValueError(f"group must hold integer ids, got dtype {group.dtype}")
  return _entropy_aware(advantages, entropy, _as(mask, bool), group, alpha, eps)


@jax.jit
def _entropy_aware(advantages, entropy, mask, group, alpha, eps):
  entropy = jax.lax.stop_gradient(jnp.where(mask, entropy, 0.0))
  same = same_group(group, jnp.ones(group.shape, bool))
  n = _row_sum(same, jnp.sum(mask, axis=1).astype(f32))
  mean = _row_sum(same, jnp.sum(entropy, axis=1)) / jnp.maximum(n, 1.0)
  sq = jnp.sum(jnp.where(mask, (entropy - mean[:, None]) ** 2, 0.0), axis=1)
  std = jnp.sqrt(_row_sum(same, sq) / jnp.maximum(n, 1.0))
  # Exact "all equal" test per group (as for degenerate reward groups): no ulp / eps blow-up.
  row_max = jnp.max(jnp.where(mask, entropy, -jnp.inf), axis=1)
  row_min = jnp.min(jnp.where(mask, entropy, jnp.inf), axis=1)
  gmax = jnp.max(jnp.where(same, row_max[None, :], -jnp.inf), axis=1)
  gmin = jnp.min(jnp.where(same, row_min[None, :], jnp.inf), axis=1)
  h = jnp.where((gmax > gmin)[:, None], (entropy - mean[:, None]) / (std[:, None] + eps), 0.0)
  return jnp.where(mask, advantages * (1.0 + alpha * h), 0.0)


# --------------------------------------------------------------------------------------------
# Reward shaping.


def overlong_penalty(lengths, max_len: int = 20480, cache_len: int = 4096) -> Array:
  """DAPO soft overlong punishment R_len(L), added to the task reward.

  R_len = 0 if L <= L_max - L_c;  ((L_max - L_c) - L) / L_c if L_max - L_c < L <= L_max;
  -1 if L > L_max. Linear from 0 to -1 across the cache zone. Paper: L_max 20480, L_c 4096.

  Args:
    lengths: [S] int response lengths L in tokens.
    max_len: L_max > 0.
    cache_len: L_c, 0 < L_c <= max_len.

  Returns:
    [S] f32 penalties in [-1, 0].

  Raises:
    ValueError: for max_len <= 0 or cache_len outside (0, max_len].

  References:
    DAPO.
  """
  _check_number("max_len", max_len, low=0.0, low_open=True)
  _check_number("cache_len", cache_len, low=0.0, high=max_len if isinstance(
      max_len, numbers.Real) else None, low_open=True)
  return _overlong_penalty(_as(lengths, f32), max_len, cache_len)


@jax.jit
def _overlong_penalty(length, max_len, cache_len):
  start = max_len - cache_len
  ramp = (start - length) / cache_len
  return jnp.where(length <= start, 0.0, jnp.where(length <= max_len, ramp, -1.0))


def cap_step_rewards(step_rewards, cap, step_valid=None) -> Array:
  """Rescale each trajectory's step rewards so that |sum over steps| <= cap.

  A trajectory within the cap is unchanged; one above it is multiplied by cap / |sum|, which
  keeps the relative shape of its dense signal.

  Args:
    step_rewards: [S, K] f32.
    cap: scalar or [S], >= 0.
    step_valid: [S, K] bool, or None (all valid); padding steps become 0.

  Returns:
    [S, K] f32.

  Raises:
    ValueError: for step_rewards not [S, K], a negative scalar cap, or step_valid of another
      shape.
  """
  step_rewards = _as(step_rewards, f32)
  if step_rewards.ndim != 2:
    raise ValueError(f"step_rewards must be 2-D [S, K], got shape {step_rewards.shape}")
  _check_number("cap", cap, low=0.0)
  return _cap_step_rewards(step_rewards, _as(cap, f32),
                           _valid(step_valid, step_rewards.shape))


@jax.jit
def _cap_step_rewards(step_rewards, cap, step_valid):
  r = jnp.where(step_valid, step_rewards, 0.0)
  size = jnp.abs(jnp.sum(r, axis=1))
  cap = jnp.broadcast_to(cap, size.shape)
  scale = jnp.where(size > cap, cap / jnp.maximum(size, 1e-30), 1.0)
  return r * scale[:, None]


def dense_step_rewards(terminal_rewards, step_rewards, terminal_scale, fraction: float = 0.5,
                       step_valid=None) -> Array:
  """GLM-style shaping: terminal reward plus dense step rewards capped at a fraction of it.

  R_i = terminal_i + sum_k step'_ik, where step' = `cap_step_rewards(step, fraction *
  terminal_scale)`: the shaping can never outweigh the verifiable outcome (with fraction 0.5 a
  failed run cannot out-score a passing one by shaping alone).

  Args:
    terminal_rewards: [S] f32 verifiable rewards.
    step_rewards: [S, K] f32 dense step rewards.
    terminal_scale: scalar >= 0, the scale of the verifiable reward (e.g. max |terminal
      reward|, 1 for 0/1 rewards).
    fraction: in [0, 1], the step rewards' cap as a fraction of terminal_scale.
    step_valid: [S, K] bool, or None (all valid).

  Returns:
    [S] f32 shaped rewards.

  Raises:
    ValueError: for fraction or terminal_scale out of range, or mismatched shapes.
  """
  _check_number("fraction", fraction, low=0.0, high=1.0)
  _check_number("terminal_scale", terminal_scale, low=0.0)
  terminal_rewards = _as(terminal_rewards, f32)
  step_rewards = _as(step_rewards, f32)
  if terminal_rewards.ndim != 1 or step_rewards.shape[:1] != terminal_rewards.shape:
    raise ValueError(f"need terminal_rewards [S] and step_rewards [S, K], got shapes "
                     f"{terminal_rewards.shape} and {step_rewards.shape}")
  return _dense_step_rewards(terminal_rewards, step_rewards, _as(terminal_scale, f32),
                             fraction, _valid(step_valid, step_rewards.shape))


@jax.jit
def _dense_step_rewards(terminal_rewards, step_rewards, terminal_scale, fraction, step_valid):
  capped = _cap_step_rewards(step_rewards, fraction * terminal_scale, step_valid)
  return terminal_rewards + jnp.sum(capped, axis=1)
