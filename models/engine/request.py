"""A request as the engine's loop tracks it (`Request`), and the checks of what a client
submits (`check`)."""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Optional, Sequence

import numpy as np

from models.engine import constraint as constraints
from models.engine.config import EngineConfig


class Request:
  """Host-side state of one request: what it asked for, what it sampled so far, where it is."""

  def __init__(self, input_ids: np.ndarray, params: Any, seed: int):
    self.input_ids = input_ids
    self.params = params
    self.seed = seed
    self.on_tokens: Optional[Callable] = None  # progress hook (see Engine.submit)
    self.future: concurrent.futures.Future = concurrent.futures.Future()
    self.output: list[int] = []
    self.logprobs: list[float] = []
    self.entropies: list[float] = []
    self.versions: list[int] = []
    self.top: list[list[tuple[int, float]]] = []
    self.cached = 0
    self.started = False  # its Future is running
    self.checked = 0  # output tokens already searched for stop strings
    self.sid = -1  # its sequence in the pool while running
    self.constraint = constraints.start(params)  # its TokenConstraint state, or None
    self.admission = 0  # order of its latest admission

  def seq(self) -> np.ndarray:
    return np.concatenate([self.input_ids, np.asarray(self.output, np.int32)])


def check(input_ids: Sequence[int], params: Any, config: EngineConfig, vocab: int,
          can_detokenize: bool) -> np.ndarray:
  """Checks a request for an engine.

  Args:
    input_ids: the prompt's token ids.
    params: its sampling parameters (the fields of `envs.policy.SamplingParams`).
    config: the engine's config (max_seq_len, max_stop_token_ids).
    vocab: the model's vocabulary size.
    can_detokenize: whether the engine has a detokenize callback (stop strings need one).

  Returns:
    [n] int32 the input ids.

  Raises:
    ValueError: naming the bad field and its value.
  """
  ids = np.asarray(list(input_ids), np.int64)
  if ids.ndim != 1 or len(ids) == 0:
    raise ValueError("input_ids: expected a non-empty list of token ids")
  bad = ids[(ids < 0) | (ids >= vocab)]
  if len(bad):
    raise ValueError(f"input_ids: token id {int(bad[0])} is outside the vocabulary "
                     f"[0, {vocab})")
  p = params
  if not isinstance(p.max_tokens, int) or p.max_tokens < 1:
    raise ValueError(f"max_tokens={p.max_tokens!r}: must be a positive integer")
  if len(ids) + p.max_tokens > config.max_seq_len:
    raise ValueError(f"max_tokens={p.max_tokens}: {len(ids)} input tokens + max_tokens exceed "
                     f"max_seq_len={config.max_seq_len}")
  if not p.temperature >= 0:
    raise ValueError(f"temperature={p.temperature!r}: must be >= 0")
  if not 0 < p.top_p <= 1:
    raise ValueError(f"top_p={p.top_p!r}: must be in (0, 1]")
  if p.top_k < 0:
    raise ValueError(f"top_k={p.top_k!r}: must be >= 0")
  if len(p.stop_token_ids) > config.max_stop_token_ids:
    raise ValueError(f"stop_token_ids: {len(p.stop_token_ids)} ids, at most "
                     f"{config.max_stop_token_ids} (EngineConfig.max_stop_token_ids)")
  if any(not 0 <= t < vocab for t in p.stop_token_ids):
    raise ValueError(f"stop_token_ids={list(p.stop_token_ids)}: ids must be in [0, {vocab})")
  if p.stop and not can_detokenize:
    raise ValueError(f"stop={list(p.stop)}: stop strings need an engine with a detokenize "
                     "callback")
  if any(not isinstance(s, str) or not s for s in p.stop):
    raise ValueError(f"stop={list(p.stop)!r}: stop strings must be non-empty strings")
  constraints.check(p)
  return ids.astype(np.int32)
