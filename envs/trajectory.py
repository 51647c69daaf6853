"""The trajectory record (docs/design.md §3): what an episode sent to and got from the policy.

Text is never re-tokenized for training: each `LLMCall` holds the exact token ids the engine
saw and sampled. Records serialise to msgpack (never pickle), so they cross the rollout queue
between machines without trusting the sender with code execution.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Optional

import msgpack
import numpy as np

# Why an episode ended. Arbor's react loop: "submitted", "max_turns", "token_budget"; any
# episode: "timeout", "sandbox_error"; a black-box scaffold's CLI (envs.scaffolds): "exited"
# (it exited 0: finished, or stopped at its own turn limit) or "scaffold_error" (it exited
# non-zero).
TERMINATIONS = ("submitted", "max_turns", "token_budget", "timeout", "sandbox_error", "exited",
                "scaffold_error")


@dataclasses.dataclass
class LLMCall:
  """One request to the policy, exactly as the engine saw it.

  Attributes:
    input_ids: [n_in] the rendered context.
    output_ids: [n_out] the sampled tokens.
    output_logprobs: [n_out] the sampler's log-probs of them.
    policy_version: the version that produced the first sampled token (the oldest one: an
      in-flight weight update can only make later tokens newer).
    token_versions: optional [n_out] version of every sampled token.
    meta: JSON-like extras, e.g. {"tool_error": True} when the call's tool call failed
      (error-masked SFT).
    expert_ids: optional [n_in + n_out - 1 - expert_start, moe_layers, k] int MoE experts of
      the positions from `expert_start` on that the engine fed to the model (routing replay;
      the last sampled token was never fed).
    expert_start: the first position `expert_ids` covers: a call whose context extends an
      earlier call of the episode leaves that call's positions to its record (the trie keeps a
      node's first recording), so a record grows with the new tokens only.

  Raises:
    ValueError: output_logprobs or token_versions do not have n_out entries.
  """

  input_ids: list[int]
  output_ids: list[int]
  output_logprobs: list[float]
  policy_version: int = 0
  token_versions: Optional[list[int]] = None
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)
  expert_ids: Optional[np.ndarray] = None
  expert_start: int = 0

  def __post_init__(self):
    if self.expert_ids is not None:
      self.expert_ids = np.asarray(self.expert_ids)
      want = len(self.input_ids) + len(self.output_ids) - 1 - self.expert_start
      if self.expert_ids.ndim != 3 or len(self.expert_ids) != want:
        raise ValueError(f"LLMCall.expert_ids has shape {self.expert_ids.shape}; expected "
                         f"[{want} (input + output tokens - 1 - expert_start="
                         f"{self.expert_start}), moe_layers, k]")
    if len(self.output_logprobs) != len(self.output_ids):
      raise ValueError(f"LLMCall.output_logprobs has {len(self.output_logprobs)} entries for "
                       f"{len(self.output_ids)} output_ids")
    if self.token_versions is not None and len(self.token_versions) != len(self.output_ids):
      raise ValueError(f"LLMCall.token_versions has {len(self.token_versions)} entries for "
                       f"{len(self.output_ids)} output_ids")


@dataclasses.dataclass
class Trajectory:
  """The calls of one episode in order, its reward and why it ended.

  `trajectory_id` is unique per episode (the trainer records consumed ids in its checkpoint so
  a re-delivered trajectory is never trained twice); `group_id` names the G episodes sampled
  for one task (normally `f"{task_id}/{draw}"`).

  Raises:
    ValueError: termination is not one of TERMINATIONS.
  """

  calls: list[LLMCall]
  reward: float
  task_id: str
  group_id: str
  termination: str
  metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
  trajectory_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)

  def __post_init__(self):
    if self.termination not in TERMINATIONS:
      raise ValueError(f"Trajectory.termination={self.termination!r}: expected one of "
                       f"{TERMINATIONS}")

  @property
  def policy_version(self) -> int:
    """The oldest policy version that produced any of its tokens (for staleness control)."""
    return min((c.policy_version for c in self.calls), default=0)

  def to_dict(self) -> dict:
    """The record as plain dicts and lists (calls included); a call's expert_ids becomes
    {"shape": [...], "int16": bytes} (compact: one number per position, layer and choice)."""
    d = dataclasses.asdict(dataclasses.replace(self, calls=[]))
    d["calls"] = []
    for c in self.calls:
      call = dataclasses.asdict(dataclasses.replace(c, expert_ids=None))
      if c.expert_ids is not None:
        call["expert_ids"] = {"shape": list(c.expert_ids.shape),
                              "int16": c.expert_ids.astype("<i2").tobytes()}
      d["calls"].append(call)
    return d

  @classmethod
  def from_dict(cls, d: dict) -> "Trajectory":
    """Inverse of `to_dict`."""
    calls = []
    for c in d["calls"]:
      ids = c.get("expert_ids")
      if isinstance(ids, dict):
        ids = np.frombuffer(ids["int16"], "<i2").reshape(ids["shape"])
      calls.append(LLMCall(**{**c, "expert_ids": ids}))
    return cls(**{**d, "calls": calls})

  def to_bytes(self) -> bytes:
    """The record serialised with msgpack."""
    return msgpack.packb(self.to_dict(), use_bin_type=True)

  @classmethod
  def from_bytes(cls, data: bytes) -> "Trajectory":
    """Inverse of `to_bytes`.

    Raises:
      ValueError: the bytes are not a trajectory record.
    """
    try:
      d = msgpack.unpackb(data, raw=False, strict_map_key=True)
      return cls.from_dict(d)
    except (msgpack.UnpackException, ValueError, TypeError, KeyError) as e:
      raise ValueError(f"not a serialised Trajectory: {e}") from e
