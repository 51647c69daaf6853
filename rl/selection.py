"""Test-time selection among N candidate outputs (NumPy, host side).

Every selector returns an index into the candidates. Ties always go to the lowest index, so a
selection is deterministic and reproducible from the candidates' order.
"""

from __future__ import annotations

from typing import Callable, Hashable, Optional, Sequence

import numpy as np


def best_of_n(scores) -> int:
  """Index of the highest verifier score; ties -> lowest index.

  NaN scores (a verifier that failed) never win.

  Args:
    scores: [N] float, N >= 1.

  Returns:
    The index of the selected candidate.

  Raises:
    ValueError: for scores that are not a non-empty 1-D array, or all NaN.
  """
  scores = np.asarray(scores, dtype=np.float64)
  if scores.ndim != 1 or scores.size == 0:
    raise ValueError(f"scores must be a non-empty 1-D array [N], got shape {scores.shape}")
  if np.all(np.isnan(scores)):
    raise ValueError("scores are all NaN: nothing to select")
  # np.argmax returns the first maximum; NaN would win it, so map NaN below everything.
  return int(np.argmax(np.where(np.isnan(scores), -np.inf, scores)))


def majority_vote(items: Sequence, key: Optional[Callable[[object], Hashable]] = None) -> int:
  """Index of the first member of the largest equivalence class.

  Ties between classes of equal size -> the class whose first member comes first (lowest
  index).

  Args:
    items: [N] the outputs, N >= 1.
    key: maps an output to a hashable equivalence key (e.g. normalised answer, or test-output
      signature); None: items are precomputed keys.

  Returns:
    The index of the selected candidate.

  Raises:
    ValueError: for no items.
  """
  items = list(items)
  if not items:
    raise ValueError("items must be non-empty, got 0 items")
  counts: dict = {}
  first: dict = {}
  for i, item in enumerate(items):
    k = item if key is None else key(item)
    counts[k] = counts.get(k, 0) + 1
    first.setdefault(k, i)
  largest = max(counts.values())
  return min(first[k] for k in counts if counts[k] == largest)


def self_play_scores(original_pass, patched_pass) -> np.ndarray:
  """Kimi-Dev self-play score of N patches against M generated tests.

    S_i = sum_j FP(i,j) / sum_j F(j) + sum_j PP(i,j) / sum_j P(j)
  F(j) / P(j): test j fails / passes on the original; FP(i,j): fails on the original and passes
  with patch i (the patch fixes what the test reproduces); PP(i,j): passes on both (the patch
  breaks nothing). A term whose denominator is 0 is 0.

  Args:
    original_pass: [M] bool, test j passes on the original code.
    patched_pass: [N, M] bool, test j passes with patch i applied.

  Returns:
    [N] float64 scores in [0, 2].

  Raises:
    ValueError: unless original_pass is [M] and patched_pass [N, M].

  References:
    Kimi-Dev.
  """
  original = np.asarray(original_pass)
  patched = np.asarray(patched_pass)
  if original.ndim != 1:
    raise ValueError(f"original_pass must be 1-D [M], got shape {original.shape}")
  if patched.ndim != 2 or patched.shape[1] != original.shape[0]:
    raise ValueError(f"patched_pass must be [N, M] with M = {original.shape[0]}, "
                     f"got shape {patched.shape}")
  original = original.astype(bool)
  patched = patched.astype(bool)
  fails, passes = ~original, original
  fixed = np.sum(patched & fails[None, :], axis=1)
  kept = np.sum(patched & passes[None, :], axis=1)
  num_fail, num_pass = int(fails.sum()), int(passes.sum())
  fix_term = fixed / num_fail if num_fail else np.zeros(patched.shape[0])
  keep_term = kept / num_pass if num_pass else np.zeros(patched.shape[0])
  return (fix_term + keep_term).astype(np.float64)


def self_play_select(original_pass, patched_pass) -> int:
  """Index of the patch with the highest `self_play_scores`; ties -> lowest index.

  Args:
    original_pass: [M] bool, test j passes on the original code.
    patched_pass: [N, M] bool, test j passes with patch i applied (N >= 1).

  Returns:
    The index of the selected patch.

  Raises:
    ValueError: for bad shapes, or no patch.
  """
  return best_of_n(self_play_scores(original_pass, patched_pass))
