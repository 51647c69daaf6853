"""rl.selection: best-of-N, majority vote, Kimi-Dev self-play scores (hand-computed cases)."""

import numpy as np
import pytest

from rl import selection


def test_best_of_n():
  assert selection.best_of_n([0.2, 0.9, 0.9, 0.1]) == 1  # tie -> lowest index
  assert selection.best_of_n([float("nan"), 0.1, -3.0]) == 1  # NaN never wins
  assert selection.best_of_n([-1.0]) == 0
  with pytest.raises(ValueError, match="NaN"):
    selection.best_of_n([float("nan")] * 2)
  with pytest.raises(ValueError, match="scores"):
    selection.best_of_n([])


def test_majority_vote():
  assert selection.majority_vote(["a", "b", "b", "a", "c", "b"]) == 1  # b x3, first at 1
  assert selection.majority_vote(["x", "y", "y", "x"]) == 0  # 2 vs 2: x's first member first
  # equivalence by key: 1.0 x2 (first at 0), 2.0 x3 (first at 2)
  assert selection.majority_vote(["1.0", "1", " 2", "2", "2.0"], key=float) == 2
  with pytest.raises(ValueError, match="items"):
    selection.majority_vote([])


def test_self_play_scores():
  # Tests 0, 1 fail on the original (ΣF = 2); tests 2, 3, 4 pass (ΣP = 3).
  original = [False, False, True, True, True]
  patched = [[True, False, True, True, False],   # FP 1/2 + PP 2/3 = 7/6
             [True, True, True, True, True],     # 2/2 + 3/3 = 2
             [False, False, False, False, False],  # 0
             [True, True, False, False, False]]  # 1 + 0 = 1
  np.testing.assert_allclose(selection.self_play_scores(original, patched), [7 / 6, 2, 0, 1])
  assert selection.self_play_select(original, patched) == 1


def test_self_play_zero_denominators_and_ties():
  # No test fails on the original: the FP term is 0; PP = [1/2, 0].
  np.testing.assert_allclose(
      selection.self_play_scores([True, True], [[True, False], [False, False]]), [0.5, 0.0])
  # No test passes on the original: the PP term is 0; FP = [2/2, 1/2].
  np.testing.assert_allclose(
      selection.self_play_scores([False, False], [[True, True], [True, False]]), [1.0, 0.5])
  # No tests at all: every score 0, selection falls to patch 0.
  assert selection.self_play_scores(np.zeros(0, bool), np.zeros((3, 0), bool)).tolist() == [0] * 3
  assert selection.self_play_select([True], [[False], [True], [True]]) == 1  # tie 1 vs 2
  with pytest.raises(ValueError, match="patched_pass"):
    selection.self_play_scores([True, False], [[True]])
