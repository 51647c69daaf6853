"""Host-side group and trajectory filters, applied to a batch before advantages and packing.

Plain NumPy on per-sequence arrays (lists are accepted): `rewards` [S], `group` [S] integer
group ids (not necessarily contiguous or sorted), `terminations` [S] strings. The filters return
masks (`groups_needed` a count, `group_pass_rates` per-group rates); the trainer decides what
to drop, what to re-sample and what to keep for statistics only.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

import numpy as np

TERMINATIONS = ("submitted", "max_turns", "token_budget", "timeout", "sandbox_error")
ACTIONS = ("keep", "drop", "mask")

# Why: sandbox_error is an infrastructure failure, so its reward says nothing about the policy
# and would teach it that its (possibly correct) actions were bad: drop it. timeout, max_turns
# and token_budget are the policy's own doing (it looped, dawdled or rambled); their reward
# (usually a failure) is a true signal against that behaviour, so keep them. Use "mask" instead
# for DAPO-style overlong filtering (truncated runs stay in the group statistics, no loss).
DEFAULT_TERMINATION_POLICY = {
    "submitted": "keep",
    "max_turns": "keep",
    "token_budget": "keep",
    "timeout": "keep",
    "sandbox_error": "drop",
}


def _seq_arrays(rewards, group) -> tuple[np.ndarray, np.ndarray]:
  """Validated (rewards float64 [S], group int [S])."""
  rewards = np.asarray(rewards, dtype=np.float64)
  group = np.asarray(group)
  if rewards.ndim != 1:
    raise ValueError(f"rewards must be 1-D [S], got shape {rewards.shape}")
  if group.shape != rewards.shape:
    raise ValueError(f"group must have the shape of rewards {rewards.shape}, got {group.shape}")
  if group.size and not np.issubdtype(group.dtype, np.integer):
    raise ValueError(f"group must hold integer ids, got dtype {group.dtype}")
  bad = np.flatnonzero(np.isnan(rewards))
  if bad.size:
    raise ValueError(f"rewards must not be NaN, got NaN at index {int(bad[0])}")
  return rewards, group


def drop_constant_groups(rewards, group, atol: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
  """DAPO dynamic sampling: drop groups whose rewards are all equal (zero advantage, no signal).

  Args:
    rewards: [S] float, no NaN.
    group: [S] int group ids.
    atol: >= 0; a group is constant if max - min <= atol (a group of one is constant).

  Returns:
    (keep, dropped): keep [S] bool, and the dropped group ids [D], sorted ascending.

  Raises:
    ValueError: for atol < 0, mismatched shapes, non-integer group ids or a NaN reward.

  References:
    DAPO (dynamic sampling).
  """
  if atol < 0:
    raise ValueError(f"atol must be >= 0, got {atol!r}")
  rewards, group = _seq_arrays(rewards, group)
  ids, inverse = np.unique(group, return_inverse=True)
  gmax = np.full(ids.shape, -np.inf)
  gmin = np.full(ids.shape, np.inf)
  np.maximum.at(gmax, inverse, rewards)
  np.minimum.at(gmin, inverse, rewards)
  constant = gmax - gmin <= atol
  return ~constant[inverse], ids[constant]


def groups_needed(num_kept_groups: int, target_groups: int,
                  keep_rate: Optional[float] = None) -> int:
  """How many more groups to sample to fill a batch of target_groups (>= 0).

  Without keep_rate: target - kept (0 if the batch is full). With keep_rate, over-sample:
  ceil(missing / keep_rate).

  Args:
    num_kept_groups: integer >= 0, groups already kept.
    target_groups: integer >= 0, groups wanted in the batch.
    keep_rate: in (0, 1], the observed fraction of groups that survive filtering, or None.

  Returns:
    The number of groups to sample, >= 0.

  Raises:
    ValueError: for a count that is not an integer >= 0, or keep_rate outside (0, 1].
  """
  if int(num_kept_groups) != num_kept_groups or num_kept_groups < 0:
    raise ValueError(f"num_kept_groups must be an integer >= 0, got {num_kept_groups!r}")
  if int(target_groups) != target_groups or target_groups < 0:
    raise ValueError(f"target_groups must be an integer >= 0, got {target_groups!r}")
  missing = max(0, int(target_groups) - int(num_kept_groups))
  if keep_rate is None:
    return missing
  if not 0 < keep_rate <= 1:
    raise ValueError(f"keep_rate must be in (0, 1], got {keep_rate!r}")
  return math.ceil(missing / keep_rate)


def group_pass_rates(success, group) -> tuple[np.ndarray, np.ndarray]:
  """Per-group pass rate from per-sequence success.

  Args:
    success: [S] bool or numbers in [0, 1].
    group: [S] int group ids.

  Returns:
    (ids, rates): group ids [G] sorted ascending, and the mean success per group [G] float64.

  Raises:
    ValueError: for success outside [0, 1] or NaN, mismatched shapes or non-integer group ids.
  """
  success, group = _seq_arrays(np.asarray(success, dtype=np.float64), group)
  if np.any((success < 0) | (success > 1)):
    raise ValueError(f"success must lie in [0, 1], got values {np.unique(success)}")
  ids, inverse = np.unique(group, return_inverse=True)
  counts = np.bincount(inverse, minlength=ids.size)
  sums = np.bincount(inverse, weights=success, minlength=ids.size)
  return ids, sums / np.maximum(counts, 1)


def pass_rate_band(rates, low: float = 0.0, high: float = 1.0, *, low_inclusive: bool = False,
                   high_inclusive: bool = False, group=None) -> np.ndarray:
  """Keep groups whose pass rate lies in the band (low, high); flags make either end inclusive.

  The default keeps 0 < rate < 1: groups with at least one success and one failure.
  Curricula are bands on precomputed pass rates, combined with &. GLM's second stage trains on
  extremely hard tasks, unsolved at pass@8 but solvable at pass@512:
    hard = (pass_rate_band(pass8, 0.0, 0.0, low_inclusive=True, high_inclusive=True)
            & pass_rate_band(pass512, 0.0, 1.0, high_inclusive=True))
  i.e. pass@8 == 0 and pass@512 > 0 (rates [G] estimated offline, e.g. with a reference model).

  Args:
    rates: [G] per-group pass rates when group is None; else [S] per-sequence success (the
      rates are computed with `group_pass_rates`).
    low: lower end of the band, 0 <= low <= high.
    high: upper end of the band, <= 1.
    low_inclusive: keep rate == low.
    high_inclusive: keep rate == high.
    group: [S] int group ids, or None.

  Returns:
    keep [G] bool when group is None; else keep [S] bool, each sequence with its group's
    verdict.

  Raises:
    ValueError: for a bad band, or rates that are not 1-D or outside [0, 1].
  """
  if not 0.0 <= low <= high <= 1.0:
    raise ValueError(f"need 0 <= low <= high <= 1, got low={low!r}, high={high!r}")
  if group is not None:
    ids, per_group = group_pass_rates(rates, group)
    keep = pass_rate_band(per_group, low, high, low_inclusive=low_inclusive,
                          high_inclusive=high_inclusive)
    return keep[np.searchsorted(ids, np.asarray(group))]
  rates = np.asarray(rates, dtype=np.float64)
  if rates.ndim != 1:
    raise ValueError(f"rates must be 1-D [G], got shape {rates.shape}")
  if np.any(np.isnan(rates) | (rates < 0) | (rates > 1)):
    raise ValueError(f"rates must lie in [0, 1], got {rates}")
  above = rates >= low if low_inclusive else rates > low
  below = rates <= high if high_inclusive else rates < high
  return above & below


def termination_filter(terminations,
                       policy: Optional[Mapping[str, str]] = None
                       ) -> tuple[np.ndarray, np.ndarray]:
  """Apply a per-termination policy: "keep", "drop" or "mask".

    keep: in the batch, in the loss;
    mask: in the batch (it still counts in its group's reward statistics) with loss weight 0;
    drop: removed from the batch.

  Args:
    terminations: [S] strings from TERMINATIONS.
    policy: termination -> action; overrides DEFAULT_TERMINATION_POLICY entry by entry (see
      its comment for why the defaults), or None.

  Returns:
    (keep, loss_weight): keep [S] bool = not dropped, and loss_weight [S] float32 = 1 for
    keep, 0 for mask or drop.

  Raises:
    ValueError: for an unknown termination or action.
  """
  full = dict(DEFAULT_TERMINATION_POLICY)
  for name, action in (policy or {}).items():
    if name not in TERMINATIONS:
      raise ValueError(f"policy names unknown termination {name!r}; valid: {TERMINATIONS}")
    if action not in ACTIONS:
      raise ValueError(f"policy[{name!r}] = {action!r} is not an action; valid: {ACTIONS}")
    full[name] = action
  terminations = list(terminations)
  for t in terminations:
    if t not in full:
      raise ValueError(f"unknown termination {t!r}; valid: {TERMINATIONS}")
  actions = [full[t] for t in terminations]
  keep = np.array([a != "drop" for a in actions], dtype=bool)
  loss_weight = np.array([1.0 if a == "keep" else 0.0 for a in actions], dtype=np.float32)
  return keep, loss_weight
