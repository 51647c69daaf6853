"""Hugging Face tensor names <-> slices of Arbor variables, one table per family.

The same tables serve import and export, so the two cannot drift apart. HF `nn.Linear` weights
are [out, in]; Arbor kernels are [in..., out...] with heads split out (e.g. q_proj
[hidden, heads, head_dim]) and per-layer tensors stacked along a leading layer axis
(`dense_layers`, then `moe_layers`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator

import numpy as np

from models.config import ModelConfig
from models.hf_config import family_of_config


@dataclasses.dataclass(frozen=True)
class Entry:
  """One HF tensor <-> one slice of an Arbor variable.

  hf:    HF tensor name.
  path:  Arbor state path (as in `nnx.to_flat_state`).
  index: leading indices into the Arbor array (layer in its stack, then expert), () for globals.
  kind:  "linear": HF [out, in] <-> Arbor kernel [in..., out...] with `n_in` input dims;
         "flat":   HF 1-D <-> Arbor [...] (e.g. q/k/v bias [heads, head_dim]);
         "same":   identical shapes (embeddings, norm gains, router bias).
  """
  hf: str
  path: tuple[str, ...]
  index: tuple[int, ...] = ()
  kind: str = "linear"
  n_in: int = 1

  def hf_shape(self, arbor_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor's shape for an Arbor slice of `arbor_shape`."""
    if self.kind == "linear":
      return (math.prod(arbor_shape[self.n_in:]), math.prod(arbor_shape[:self.n_in]))
    if self.kind == "flat":
      return (math.prod(arbor_shape),)
    return tuple(arbor_shape)

  def to_arbor(self, w: np.ndarray, arbor_shape: tuple[int, ...]) -> np.ndarray:
    """Reshapes the HF tensor `w` into the Arbor layout.

    Args:
      w: the HF tensor ([out, in] for "linear", transposed here).
      arbor_shape: the shape of the Arbor slice.

    Returns:
      `w` as an array of `arbor_shape`.
    """
    return (w.T if self.kind == "linear" else w).reshape(arbor_shape)

  def to_hf(self, a: np.ndarray) -> np.ndarray:
    """The Arbor slice `a` in the HF layout."""
    if self.kind == "linear":
      return a.reshape(math.prod(a.shape[:self.n_in]), -1).T
    return a.reshape(self.hf_shape(a.shape))


# Per-layer tables: (HF suffix after `model.layers.N.`, Arbor path inside the block, kind, n_in).
_NORMS = (("input_layernorm.weight", ("attn_norm", "scale"), "same", 1),
          ("post_attention_layernorm.weight", ("mlp_norm", "scale"), "same", 1))
_GQA = (("self_attn.q_proj.weight", ("attn", "q_proj", "kernel"), "linear", 1),
        ("self_attn.k_proj.weight", ("attn", "k_proj", "kernel"), "linear", 1),
        ("self_attn.v_proj.weight", ("attn", "v_proj", "kernel"), "linear", 1),
        ("self_attn.o_proj.weight", ("attn", "o_proj", "kernel"), "linear", 2))
_QKV_BIAS = (("self_attn.q_proj.bias", ("attn", "q_proj", "bias"), "flat", 1),
             ("self_attn.k_proj.bias", ("attn", "k_proj", "bias"), "flat", 1),
             ("self_attn.v_proj.bias", ("attn", "v_proj", "bias"), "flat", 1))
_QK_NORM = (("self_attn.q_norm.weight", ("attn", "q_norm", "scale"), "same", 1),
            ("self_attn.k_norm.weight", ("attn", "k_norm", "scale"), "same", 1))
_MLA_Q_DIRECT = (("self_attn.q_proj.weight", ("attn", "q_proj", "kernel"), "linear", 1),)
_MLA_Q_LORA = (("self_attn.q_a_proj.weight", ("attn", "q_a_proj", "kernel"), "linear", 1),
               ("self_attn.q_a_layernorm.weight", ("attn", "q_a_norm", "scale"), "same", 1),
               ("self_attn.q_b_proj.weight", ("attn", "q_b_proj", "kernel"), "linear", 1))
_MLA_KV = (("self_attn.kv_a_proj_with_mqa.weight", ("attn", "kv_a_proj", "kernel"), "linear", 1),
           ("self_attn.kv_a_layernorm.weight", ("attn", "kv_a_norm", "scale"), "same", 1),
           ("self_attn.kv_b_proj.weight", ("attn", "kv_b_proj", "kernel"), "linear", 1),
           ("self_attn.o_proj.weight", ("attn", "o_proj", "kernel"), "linear", 2))
_MLP = (("mlp.gate_proj.weight", ("mlp", "gate_proj", "kernel"), "linear", 1),
        ("mlp.up_proj.weight", ("mlp", "up_proj", "kernel"), "linear", 1),
        ("mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), "linear", 1))
_ROUTER = (("mlp.gate.weight", ("mlp", "router"), "linear", 1),)
_ROUTER_BIAS = (("mlp.gate.e_score_correction_bias", ("mlp", "router_bias"), "same", 1),)
_SHARED = (("mlp.shared_experts.gate_proj.weight", ("mlp", "shared", "gate_proj", "kernel"),
            "linear", 1),
           ("mlp.shared_experts.up_proj.weight", ("mlp", "shared", "up_proj", "kernel"),
            "linear", 1),
           ("mlp.shared_experts.down_proj.weight", ("mlp", "shared", "down_proj", "kernel"),
            "linear", 1))
# Routed expert e: `mlp.experts.{e}.NAME.weight` <-> slice e of the stacked [experts, ...] array.
_EXPERT = (("gate_proj", ("mlp", "gate_proj")), ("up_proj", ("mlp", "up_proj")),
           ("down_proj", ("mlp", "down_proj")))


def layer_entries(cfg: ModelConfig, layer: int) -> Iterator[Entry]:
  """Lists the entries of one HF decoder layer for the family of `cfg` (both directions).

  Args:
    cfg: the model config (its family, attention and MoE options pick the tables).
    layer: the HF layer number; layers >= `num_dense_layers` map into the MoE stack.

  Yields:
    One `Entry` per tensor, routed experts last (one per expert and projection).
  """
  moe = layer >= cfg.num_dense_layers
  stack, i = ("moe_layers", layer - cfg.num_dense_layers) if moe else ("dense_layers", layer)
  family = family_of_config(cfg)
  if family in ("qwen2", "qwen3", "qwen3_moe"):
    attn = _GQA + (_QKV_BIAS if cfg.qkv_bias else ()) + (_QK_NORM if cfg.qk_norm else ())
  else:
    attn = (_MLA_Q_DIRECT if cfg.q_lora_rank is None else _MLA_Q_LORA) + _MLA_KV
  if not moe:
    mlp = _MLP
  elif family == "qwen3_moe":
    mlp = _ROUTER
  else:  # deepseek_v3
    mlp = _ROUTER + (_ROUTER_BIAS if cfg.router_bias else ()) \
        + (_SHARED if cfg.num_shared_experts else ())
  prefix = f"model.layers.{layer}."
  for suffix, sub, kind, n_in in _NORMS + attn + mlp:
    yield Entry(prefix + suffix, (stack,) + sub, (i,), kind, n_in)
  if moe:
    for e in range(cfg.num_experts):
      for name, sub in _EXPERT:
        yield Entry(f"{prefix}mlp.experts.{e}.{name}.weight", (stack,) + sub, (i, e))


def entries(cfg: ModelConfig) -> Iterator[Entry]:
  """Every tensor of the HF checkpoint of `cfg`, in HF order (embeddings, layers, norm, head)."""
  yield Entry("model.embed_tokens.weight", ("embed",), kind="same")
  for layer in range(cfg.num_layers):
    yield from layer_entries(cfg, layer)
  yield Entry("model.norm.weight", ("final_norm", "scale"), kind="same")
  if not cfg.tie_embeddings:
    yield Entry("lm_head.weight", ("lm_head",))
