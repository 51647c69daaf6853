"""What an engine is asked for and what it answers: `EngineConfig` (sizes and behaviour,
checked against the model when an `Engine` is built) and `Completion` (one finished request).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from models.config import BASE_QTYPES

ON_UPDATE = ("finish", "resubmit", "restart")  # what in-flight requests do at update_params
WEIGHT_QTYPES = BASE_QTYPES  # qwix weight types an engine may sample with
ACT_QTYPES = ("int8", "float8_e4m3fn", "float8_e5m2")  # and activation types


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Sizes and behaviour of an Engine. Every field is checked by `Engine`."""

  slots: int = 8                  # sequences decoded together (the decode batch)
  max_seq_len: int = 2048         # longest sequence (input + output) a cache row holds
  prefix_cache_rows: int = 8      # cache rows beyond `slots`, kept for prefix reuse (LRU);
                                  # paged: most idle sequences kept for prefix reuse
  min_prefix: int = 8             # shortest cached prefix worth reusing (shorter: prefill)
  prefill_chunk: int = 512        # most tokens per row in one prefill call
  prefill_bucket: int = 64        # prefill lengths are padded to a multiple of this
  prefill_rows: int = 0           # most rows per prefill call (0 = slots)
  steps_per_call: int = 16        # decode steps per jitted call (one host round trip each)
  max_stop_token_ids: int = 8     # stop token ids a request may give
  top_logprobs: int = 0           # top-n log-probs returned per token (0 = none)
  return_expert_ids: bool = False  # MoE: return the experts of every position (routing replay)
  on_update: str = "finish"       # in-flight requests at update_params: "finish" (drain on old
                                  # weights) | "resubmit" (keep tokens, continue on new weights)
                                  # | "restart" (drop tokens, start again on new weights)
  seed: int = 0                   # seeds requests that give none
  cache: str = "contiguous"       # the KV-cache pool (loop.POOLS): "contiguous": a row of
                                  # max_seq_len positions per sequence | "paged": pages of
                                  # page_size positions, shared by common prefixes
  page_size: int = 16             # paged: positions per page
  num_pages: int = 0              # paged: pages in the pool (0 = the contiguous pool's memory,
                                  # (slots + prefix_cache_rows) * ceil(max_seq_len / page_size))
  weight_qtype: Optional[str] = None  # None: sample with the model's own weights | a qwix type
                                  # (WEIGHT_QTYPES, e.g. "int8", "float8_e4m3fn"): sample with
                                  # a weight-only quantized copy, re-quantized at update_params
  act_qtype: Optional[str] = None  # with weight_qtype: also quantize the projections' inputs
                                  # (ACT_QTYPES; qwix's dynamic per-token absmax)

  def check(self, model_cfg, pools: tuple[str, ...]) -> None:
    """Raises ValueError naming the field that is out of range for the model.

    Args:
      model_cfg: the engine model's ModelConfig.
      pools: the registered pool names (`loop.POOLS`).
    """
    c, m = self, model_cfg

    def fail(field, why):
      raise ValueError(f"EngineConfig.{field}={getattr(c, field)!r}: {why}")

    for field in ("slots", "max_seq_len", "prefill_chunk", "prefill_bucket", "steps_per_call",
                  "min_prefix"):
      if getattr(c, field) <= 0:
        fail(field, "must be positive")
    for field in ("prefix_cache_rows", "prefill_rows", "max_stop_token_ids", "top_logprobs"):
      if getattr(c, field) < 0:
        fail(field, "must be >= 0")
    if c.top_logprobs > m.vocab_size:
      fail("top_logprobs", f"exceeds vocab_size={m.vocab_size}")
    if c.on_update not in ON_UPDATE:
      fail("on_update", f"expected one of {ON_UPDATE}")
    if c.return_expert_ids and not m.is_moe:
      fail("return_expert_ids", "the model has no MoE layers")
    if c.cache not in pools:
      fail("cache", f"expected one of {pools}")
    if c.page_size <= 0:
      fail("page_size", "must be positive")
    if c.num_pages < 0:
      fail("num_pages", "must be >= 0")
    if c.num_pages and c.num_pages * c.page_size < c.max_seq_len:
      fail("num_pages", f"x page_size={c.page_size} cannot hold one sequence of max_seq_len="
                        f"{c.max_seq_len} positions")
    if c.weight_qtype is not None and c.weight_qtype not in WEIGHT_QTYPES:
      fail("weight_qtype", f"expected None or one of {WEIGHT_QTYPES}")
    if c.act_qtype is not None and c.act_qtype not in ACT_QTYPES:
      fail("act_qtype", f"expected None or one of {ACT_QTYPES}")
    if c.act_qtype is not None and c.weight_qtype is None:
      fail("act_qtype", "quantized activations need quantized weights (weight_qtype)")


@dataclasses.dataclass
class Completion:
  """One finished request. logprobs[i] = log p(output_ids[i]) under token_versions[i]'s weights;
  entropies[i] = the entropy (nats) of that whole next-token distribution p, which sampled
  output_ids[i]."""

  output_ids: list[int]
  logprobs: list[float]
  finish_reason: str              # "stop" (stop token or string) | "length"
  token_versions: list[int]       # policy version that sampled each token
  policy_version: int             # version of the first token
  prompt_tokens: int              # len(input_ids)
  cached_tokens: int              # prefix tokens reused from the cache (last admission)
  # per token: (id, log-prob) pairs, best first
  top_logprobs: Optional[list[list[tuple[int, float]]]] = None
  # MoE routing replay: [len(input_ids) + len(output_ids) - 1, moe_layers, k] int16, the
  # experts that position p went through (prefilled, copied from a reused prefix, or decoded);
  # the last output token was never fed to the model.
  expert_ids: Optional[np.ndarray] = None
  # per output token (aligned with logprobs, cut with them at a stop string): the entropy in
  # nats of the model's next-token distribution (temperature 1, untruncated) it was drawn from
  entropies: list[float] = dataclasses.field(default_factory=list)
