"""The optimizer's settings: `OptimizerConfig`, validated when it is built, and its choice lists.

The defaults and a comment on every field live in configs/base.py (`config.optimizer`);
`OptimizerConfig.from_config` reads that section.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import ml_collections

NAMES = ("adamw", "muon", "muon_clip", "adamw_clip")
SCHEDULES = ("constant", "cosine", "linear", "wsd")
WSD_DECAY_SHAPES = ("linear", "cosine")
STATE_DTYPES = ("float32", "bfloat16")
SCALE_RULES = ("moonlight", "keller")


@dataclasses.dataclass(frozen=True)
class MuonConfig:
  """The Muon branch (`config.optimizer.muon`) and the AdamW branch beside it.

  Momentum, Newton–Schulz steps, update scale, and the AdamW branch that takes the parameters
  Muon does not. The fields' meanings are commented in configs/base.py.
  """

  beta: float = 0.95
  nesterov: bool = True
  ns_steps: int = 5
  scale_rule: str = "moonlight"
  rms: float = 0.2
  adam_b2: float = 0.95
  adam_learning_rate: Optional[float] = None
  per_head_attention: bool = False


@dataclasses.dataclass(frozen=True)
class QKClipConfig:
  """QK-Clip (`config.optimizer.qk_clip`): the logit threshold τ and the query/key balance α."""

  tau: float = 100.0
  alpha: float = 0.5


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """Validated optimizer settings (the fields of `config.optimizer`, configs/base.py).

  Raises:
    ValueError: at construction, naming the first field with an invalid value.
  """

  name: str = "muon"
  learning_rate: float = 2e-4
  schedule: str = "cosine"
  warmup_steps: int = 0
  total_steps: int = 1000
  end_lr_ratio: float = 0.1
  wsd_decay_fraction: float = 0.2
  wsd_decay_shape: str = "linear"
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  weight_decay_norms: bool = False
  grad_clip_norm: float = 1.0
  state_dtype: str = "float32"
  muon: MuonConfig = MuonConfig()
  qk_clip: QKClipConfig = QKClipConfig()

  def __post_init__(self):
    def fail(field, value, why):
      raise ValueError(f"optimizer.{field}={value!r}: {why}")

    for field, choices in (("name", NAMES), ("schedule", SCHEDULES),
                           ("wsd_decay_shape", WSD_DECAY_SHAPES), ("state_dtype", STATE_DTYPES)):
      if getattr(self, field) not in choices:
        fail(field, getattr(self, field), f"expected one of {choices}")
    if self.muon.scale_rule not in SCALE_RULES:
      fail("muon.scale_rule", self.muon.scale_rule, f"expected one of {SCALE_RULES}")
    for field in ("learning_rate", "weight_decay", "grad_clip_norm", "warmup_steps", "eps"):
      if getattr(self, field) < 0:
        fail(field, getattr(self, field), "must be >= 0")
    for field, value in (("b1", self.b1), ("b2", self.b2), ("muon.beta", self.muon.beta),
                         ("muon.adam_b2", self.muon.adam_b2)):
      if not 0 <= value < 1:
        fail(field, value, "must be in [0, 1)")
    if self.schedule != "constant" and self.total_steps <= self.warmup_steps:
      fail("total_steps", self.total_steps,
           f"must exceed warmup_steps={self.warmup_steps} for schedule={self.schedule!r}")
    if not 0 <= self.end_lr_ratio <= 1:
      fail("end_lr_ratio", self.end_lr_ratio, "must be in [0, 1]")
    if not 0 < self.wsd_decay_fraction <= 1:
      fail("wsd_decay_fraction", self.wsd_decay_fraction, "must be in (0, 1]")
    if self.muon.ns_steps < 1:
      fail("muon.ns_steps", self.muon.ns_steps, "must be >= 1")
    if self.muon.rms <= 0:
      fail("muon.rms", self.muon.rms, "must be positive")
    if self.muon.adam_learning_rate is not None and self.muon.adam_learning_rate < 0:
      fail("muon.adam_learning_rate", self.muon.adam_learning_rate, "must be >= 0 or None")
    if self.qk_clip.tau <= 0:
      fail("qk_clip.tau", self.qk_clip.tau, "must be positive")
    if not 0 <= self.qk_clip.alpha <= 1:
      fail("qk_clip.alpha", self.qk_clip.alpha, "must be in [0, 1]")

  @property
  def uses_muon(self) -> bool:
    """Whether hidden matrices go to Muon (`muon`, `muon_clip`); otherwise all go to AdamW."""
    return self.name in ("muon", "muon_clip")

  @property
  def uses_qk_clip(self) -> bool:
    """Whether QK-Clip follows the base optimizer (`muon_clip`, `adamw_clip`)."""
    return self.name in ("muon_clip", "adamw_clip")

  @classmethod
  def from_config(cls, config: Any) -> OptimizerConfig:
    """Reads the `config.optimizer` section.

    Args:
      config: an `OptimizerConfig` (returned as is), or a ConfigDict or mapping with its fields
        (`muon` and `qk_clip` as nested mappings); missing fields take the defaults.

    Returns:
      The validated `OptimizerConfig`.

    Raises:
      ValueError: for an unknown field or an invalid value.
    """
    if isinstance(config, OptimizerConfig):
      return config
    d = config.to_dict() if isinstance(config, ml_collections.ConfigDict) else dict(config)
    sub = {"muon": MuonConfig, "qk_clip": QKClipConfig}
    kwargs = {}
    known = {f.name for f in dataclasses.fields(cls)}
    for key, value in d.items():
      if key not in known:
        raise ValueError(f"optimizer.{key}: unknown field; valid fields: {sorted(known)}")
      if key in sub:
        fields = {f.name for f in dataclasses.fields(sub[key])}
        value = dict(value)
        unknown = sorted(set(value) - fields)
        if unknown:
          raise ValueError(f"optimizer.{key}: unknown fields {unknown}; valid: {sorted(fields)}")
        value = sub[key](**value)
      kwargs[key] = value
    return cls(**kwargs)
