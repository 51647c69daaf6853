"""rl.filters: dynamic sampling, pass-rate bands, termination policies (hand-computed cases)."""

import numpy as np
import pytest

from rl import filters


def test_drop_constant_groups():
  # id 3: [1, 1] constant; id 1: [0, 1] kept; id 8: [0.5] alone (constant); id 4: [2, 2, 2].
  rewards = [1.0, 1.0, 0.0, 1.0, 0.5, 2.0, 2.0, 2.0]
  group = [3, 3, 1, 1, 8, 4, 4, 4]
  keep, dropped = filters.drop_constant_groups(rewards, group)
  np.testing.assert_array_equal(keep, [False, False, True, True, False, False, False, False])
  np.testing.assert_array_equal(dropped, [3, 4, 8])
  # interleaved ids, tolerance: |1.05 - 1.0| <= 0.1 counts as constant
  keep, dropped = filters.drop_constant_groups([1.0, 0.0, 1.05, 1.0], [0, 1, 0, 1], atol=0.1)
  np.testing.assert_array_equal(keep, [False, True, False, True])
  np.testing.assert_array_equal(dropped, [0])
  with pytest.raises(ValueError, match="NaN at index 1"):
    filters.drop_constant_groups([0.0, float("nan")], [0, 0])
  with pytest.raises(ValueError, match="group"):
    filters.drop_constant_groups([0.0, 1.0], [0])


def test_groups_needed():
  assert filters.groups_needed(5, 8) == 3
  assert filters.groups_needed(9, 8) == 0
  assert filters.groups_needed(8, 8) == 0
  # 3 missing, half the groups survive the filter: ceil(3 / 0.5) = 6; ceil(3 / 0.4) = 8
  assert filters.groups_needed(5, 8, keep_rate=0.5) == 6
  assert filters.groups_needed(5, 8, keep_rate=0.4) == 8
  with pytest.raises(ValueError, match="num_kept_groups"):
    filters.groups_needed(-1, 8)
  with pytest.raises(ValueError, match="keep_rate"):
    filters.groups_needed(1, 8, keep_rate=0.0)


def test_pass_rate_band():
  rates = [0.0, 0.25, 1.0, 0.5]
  np.testing.assert_array_equal(filters.pass_rate_band(rates), [False, True, False, True])
  np.testing.assert_array_equal(filters.pass_rate_band(rates, low_inclusive=True),
                                [True, True, False, True])
  np.testing.assert_array_equal(filters.pass_rate_band(rates, 0.25, 0.5, high_inclusive=True),
                                [False, False, False, True])
  # GLM stage 2: pass@8 == 0 and pass@512 > 0
  pass8, pass512 = [0.0, 0.0, 0.125], [0.0, 0.01, 0.5]
  hard = (filters.pass_rate_band(pass8, 0.0, 0.0, low_inclusive=True, high_inclusive=True)
          & filters.pass_rate_band(pass512, 0.0, 1.0, high_inclusive=True))
  np.testing.assert_array_equal(hard, [False, True, False])
  # per-sequence success: group rates id 0: 1/2, id 5: 0, id 2: 1 -> only id 0 survives
  success = [True, False, False, False, True, True]
  group = [0, 0, 5, 5, 2, 2]
  np.testing.assert_array_equal(filters.pass_rate_band(success, group=group),
                                [True, True, False, False, False, False])
  ids, r = filters.group_pass_rates(success, group)
  np.testing.assert_array_equal(ids, [0, 2, 5])
  np.testing.assert_allclose(r, [0.5, 1.0, 0.0])
  with pytest.raises(ValueError, match="low=0.6"):
    filters.pass_rate_band(rates, 0.6, 0.5)
  with pytest.raises(ValueError, match="rates"):
    filters.pass_rate_band([1.5])


def test_termination_filter():
  terms = ["submitted", "sandbox_error", "timeout", "max_turns", "token_budget"]
  keep, weight = filters.termination_filter(terms)
  np.testing.assert_array_equal(keep, [True, False, True, True, True])
  np.testing.assert_array_equal(weight, [1, 0, 1, 1, 1])
  assert weight.dtype == np.float32
  # DAPO overlong filtering: truncated runs stay for group statistics, no loss
  keep, weight = filters.termination_filter(terms, {"token_budget": "mask", "timeout": "drop"})
  np.testing.assert_array_equal(keep, [True, False, False, True, True])
  np.testing.assert_array_equal(weight, [1, 0, 0, 1, 0])
  with pytest.raises(ValueError, match="'crashed'"):
    filters.termination_filter(["submitted", "crashed"])
  with pytest.raises(ValueError, match="'crashed'"):
    filters.termination_filter(["submitted"], {"crashed": "drop"})
  with pytest.raises(ValueError, match="'ignore'"):
    filters.termination_filter(["submitted"], {"timeout": "ignore"})
