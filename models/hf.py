"""Hugging Face checkpoints <-> Arbor models: config translation, weight import/export, CLI.

Supported families (transformers class, `model_type`):
  Qwen2      `Qwen2ForCausalLM`       qwen2          GQA with q/k/v bias
  Qwen3      `Qwen3ForCausalLM`       qwen3          GQA with per-head q/k RMSNorm
  Qwen3-MoE  `Qwen3MoeForCausalLM`    qwen3_moe      Qwen3 attention, softmax top-k experts
  DeepSeek-V3 `DeepseekV3ForCausalLM` deepseek_v3 | kimi_k2   MLA, sigmoid group-limited router

Python:
    model = load(hf_dir)  # config.json + safetensors (sharded; fp32, bf16 or FP8) -> Transformer
    save(model, out_dir, dtype="bfloat16")  # -> config.json + safetensors for transformers

CLI:
    python -m models.hf import --hf_dir IN --out OUT   # HF dir -> orbax state + model_config.json
    python -m models.hf export --ckpt IN --out OUT     # that checkpoint -> HF dir

Tensor names are mapped by one table per family (`layer_entries`), used in both directions, so
import and export cannot drift apart. HF `nn.Linear` weights are [out, in]; Arbor kernels are
[in..., out...] with heads split out (e.g. q_proj [hidden, heads, head_dim]) and per-layer
tensors stacked along a leading layer axis (`dense_layers`, then `moe_layers`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import re
import shutil
import sys
import time
from typing import Any, Iterator, Optional

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from models.config import ModelConfig, yarn_get_mscale
from models.safetensors_io import SafetensorsDir, is_scale_name, save_dir
from models.transformer import Transformer, abstract

logger = logging.getLogger(__name__)

# architecture class -> family; model_type -> family.
ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
MODEL_TYPES = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
               "deepseek_v3": "deepseek_v3", "kimi_k2": "deepseek_v3"}
SUPPORTED = ("Qwen2ForCausalLM (qwen2), Qwen3ForCausalLM (qwen3), Qwen3MoeForCausalLM (qwen3_moe), "
             "DeepseekV3ForCausalLM (deepseek_v3, kimi_k2)")
_FAMILY_ARCH = {family: arch for arch, family in ARCHITECTURES.items()}
_ROPE_TYPES = ("default", "linear", "yarn")
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# Tensors HF checkpoints may carry that are not weights (older transformers saved rotary buffers).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
  """A checkpoint does not match its config: missing, misshapen or unexpected tensors."""


# ----------------------------------------------------------------------------- configs


def family_of(hf_config: dict) -> str:
  """The family of an HF config, from `architectures` (else `model_type`); ValueError if none."""
  archs = hf_config.get("architectures") or []
  model_type = hf_config.get("model_type")
  if archs:
    known = [a for a in archs if a in ARCHITECTURES]
    if not known:
      raise ValueError(f"unsupported architecture {archs} (model_type={model_type!r}); "
                       f"supported families: {SUPPORTED}")
    family = ARCHITECTURES[known[0]]
    if model_type is not None and MODEL_TYPES.get(model_type) != family:
      raise ValueError(f"architecture {known[0]} with model_type={model_type!r} is not supported; "
                       f"supported families: {SUPPORTED}")
    return family
  if model_type in MODEL_TYPES:
    return MODEL_TYPES[model_type]
  raise ValueError(f"unsupported model_type={model_type!r} (no architectures given); "
                   f"supported families: {SUPPORTED}")


def _unsupported(arch: str, field: str, value: Any, why: str) -> ValueError:
  return ValueError(f"{arch}: {field}={value!r} is not supported ({why}); "
                    f"supported families: {SUPPORTED}")


def _rope_from_hf(hf: dict, arch: str) -> dict:
  """ModelConfig RoPE fields from transformers 4.x (`rope_theta` + `rope_scaling`) or 5.x
  (`rope_parameters`) keys. As in transformers 5.x, `rope_scaling` entries override
  `rope_parameters` ones."""
  params = dict(hf.get("rope_parameters") or {})
  if any(isinstance(v, dict) for v in params.values()):
    raise _unsupported(arch, "rope_parameters", params, "per-layer-type RoPE")
  params.update(hf.get("rope_scaling") or {})
  theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type not in _ROPE_TYPES:
    raise _unsupported(arch, "rope_type", rope_type, f"expected one of {_ROPE_TYPES}")
  partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if partial not in (None, 1, 1.0):
    raise _unsupported(arch, "partial_rotary_factor", partial, "only full rotary is modelled")
  out: dict[str, Any] = {"rope_theta": float(theta), "rope_type": rope_type}
  if rope_type == "default":
    return out
  original = params.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
  factor = params.get("factor")
  if factor is None:
    if rope_type != "yarn":
      raise _unsupported(arch, "rope_parameters.factor", None, "required for linear RoPE")
    factor = hf["max_position_embeddings"] / original  # HF's YaRN default
  out["rope_factor"] = float(factor)
  if rope_type == "linear":
    if params.get("mscale_all_dim") and arch == "DeepseekV3ForCausalLM":
      raise _unsupported(arch, "rope_parameters.mscale_all_dim", params["mscale_all_dim"],
                         "the softmax mscale is modelled for YaRN only")
    return out
  attention_factor = params.get("attention_factor")
  out.update(rope_original_max_position=int(original),
             yarn_beta_fast=float(params.get("beta_fast") or 32.0),
             yarn_beta_slow=float(params.get("beta_slow") or 1.0),
             yarn_mscale=float(params.get("mscale") or 0.0),
             yarn_mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
             yarn_truncate=bool(params.get("truncate", True)),
             yarn_attention_factor=None if attention_factor is None else float(attention_factor))
  return out


def _get(hf: dict, *names: str, **kw) -> Any:
  """The first of `names` present in `hf` (transformers 5.x saves some fields under aliases,
  e.g. Qwen3-MoE `num_experts` as `num_local_experts`); `default` if given, else KeyError."""
  for name in names:
    if name in hf:
      return hf[name]
  if "default" in kw:
    return kw["default"]
  raise KeyError(f"config.json has none of {names}")


def _check_silu(hf: dict, arch: str) -> None:
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise _unsupported(arch, "hidden_act", act, "the MLPs are SwiGLU")


def _check_full_attention(hf: dict, arch: str) -> None:
  if hf.get("use_sliding_window"):
    raise _unsupported(arch, "use_sliding_window", True, "sliding-window attention")
  kinds = set(hf.get("layer_types") or ["full_attention"])
  if kinds != {"full_attention"}:
    raise _unsupported(arch, "layer_types", sorted(kinds), "only full attention")


def config_from_hf(hf_config: dict) -> ModelConfig:
  """A ModelConfig from an HF `config.json` dict (see the module docstring for the families).

  Raises ValueError naming the architecture and field for anything Arbor does not model
  (other architectures, sliding windows, unknown RoPE types, DeepSeek attention bias, ...).
  """
  hf = hf_config
  family = family_of(hf)
  arch = _FAMILY_ARCH[family]
  _check_silu(hf, arch)
  heads = hf["num_attention_heads"]
  common: dict[str, Any] = dict(
      vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
      num_layers=hf["num_hidden_layers"], num_heads=heads,
      intermediate_size=hf["intermediate_size"], rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      max_position_embeddings=hf.get("max_position_embeddings", 4096),
      initializer_range=float(hf.get("initializer_range", 0.02)))
  rope = _rope_from_hf(hf, arch)

  if family == "deepseek_v3":
    if hf.get("attention_bias"):
      raise _unsupported(arch, "attention_bias", True, "MLA projections have no bias")
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
      raise _unsupported(arch, "scoring_func", hf["scoring_func"], "DeepSeek-V3 uses sigmoid")
    if hf.get("moe_layer_freq", 1) != 1:
      raise _unsupported(arch, "moe_layer_freq", hf["moe_layer_freq"], "every layer after "
                         "first_k_dense_replace must be MoE")
    n_experts = _get(hf, "n_routed_experts", "num_local_experts", default=0) or 0
    moe = dict(
        num_experts=n_experts, num_shared_experts=hf.get("n_shared_experts") or 0,
        experts_per_token=hf["num_experts_per_tok"], n_group=hf.get("n_group") or 1,
        topk_group=hf.get("topk_group") or 1, score_func="sigmoid",
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        first_k_dense_replace=min(hf.get("first_k_dense_replace") or 0, hf["num_hidden_layers"]),
        moe_intermediate_size=hf["moe_intermediate_size"],
        router_bias=True) if n_experts else {}
    return ModelConfig(
        **common, **rope, **moe, attention="mla", num_kv_heads=heads,
        q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"], rope_interleave=bool(hf.get("rope_interleave", True)))

  # Qwen families: GQA. transformers applies the YaRN softmax mscale to DeepSeek only, so fold
  # mscale/mscale_all_dim into an explicit cos/sin factor (ModelConfig's mscale_all_dim would
  # also scale the softmax).
  _check_full_attention(hf, arch)
  if rope["rope_type"] == "yarn" and rope["yarn_mscale_all_dim"]:
    if rope["yarn_attention_factor"] is None:
      f = rope["rope_factor"]
      rope["yarn_attention_factor"] = (
          yarn_get_mscale(f, rope["yarn_mscale"]) / yarn_get_mscale(f, rope["yarn_mscale_all_dim"])
          if rope["yarn_mscale"] else yarn_get_mscale(f))
    rope.update(yarn_mscale=0.0, yarn_mscale_all_dim=0.0)
  common.update(num_kv_heads=hf.get("num_key_value_heads") or heads)
  if family == "qwen2":
    return ModelConfig(**common, **rope, head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                       qkv_bias=True)
  if hf.get("attention_bias"):
    raise _unsupported(arch, "attention_bias", True, "q/k/v/o projection biases with QK-norm")
  if family == "qwen3":
    return ModelConfig(**common, **rope, head_dim=hf.get("head_dim") or 128, qk_norm=True)
  # qwen3_moe
  if hf.get("decoder_sparse_step", 1) != 1:
    raise _unsupported(arch, "decoder_sparse_step", hf["decoder_sparse_step"],
                       "every layer must be MoE")
  if hf.get("mlp_only_layers"):
    raise _unsupported(arch, "mlp_only_layers", hf["mlp_only_layers"], "every layer must be MoE")
  return ModelConfig(
      **common, **rope, head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, qk_norm=True,
      num_experts=_get(hf, "num_experts", "num_local_experts"),
      experts_per_token=hf["num_experts_per_tok"],
      score_func="softmax", norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
      moe_intermediate_size=hf["moe_intermediate_size"])


def family_of_config(cfg: ModelConfig) -> str:
  """The HF family an Arbor config exports to; ValueError when none fits."""
  def bad(field, why):
    return ValueError(f"ModelConfig.{field}={getattr(cfg, field)!r}: {why}; "
                      f"supported families: {SUPPORTED}")
  if cfg.attention == "mla":
    if cfg.is_moe and (cfg.score_func != "sigmoid" or not cfg.router_bias):
      raise bad("score_func", "DeepSeek-V3 export needs sigmoid routing with router_bias=True")
    return "deepseek_v3"
  if cfg.is_moe:
    if cfg.score_func != "softmax" or cfg.num_shared_experts or cfg.router_bias \
        or cfg.n_group != 1 or cfg.routed_scaling_factor != 1.0 or cfg.first_k_dense_replace:
      raise bad("score_func", "a GQA MoE exports as Qwen3-MoE: softmax routing, no shared "
                "experts, bias, groups, scaling or dense layers")
    if not cfg.qk_norm or cfg.qkv_bias:
      raise bad("qk_norm", "Qwen3-MoE has q/k norm and no q/k/v bias")
    return "qwen3_moe"
  if cfg.qk_norm:
    if cfg.qkv_bias:
      raise bad("qkv_bias", "no HF family combines q/k/v bias with q/k norm")
    return "qwen3"
  if cfg.qkv_bias:
    return "qwen2"
  raise bad("qkv_bias", "a dense GQA model without q/k/v bias or q/k norm (Llama) is not exported")


def _rope_to_hf(cfg: ModelConfig) -> dict:
  params: dict[str, Any] = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
  if cfg.rope_type in ("linear", "yarn"):
    params["factor"] = cfg.rope_factor
  if cfg.rope_type == "yarn":
    params.update(original_max_position_embeddings=cfg.rope_original_max_position,
                  beta_fast=cfg.yarn_beta_fast, beta_slow=cfg.yarn_beta_slow)
    if cfg.yarn_mscale:
      params["mscale"] = cfg.yarn_mscale
    if cfg.yarn_mscale_all_dim:
      params["mscale_all_dim"] = cfg.yarn_mscale_all_dim
    if cfg.yarn_attention_factor is not None:
      params["attention_factor"] = cfg.yarn_attention_factor
    if not cfg.yarn_truncate:
      params["truncate"] = False
  return params


def config_to_hf(cfg: ModelConfig) -> dict:
  """The HF `config.json` dict of an Arbor config (inverse of `config_from_hf`).

  RoPE is written both ways: `rope_parameters` (transformers 5.x) and `rope_theta` +
  `rope_scaling` (4.x; `None` for default RoPE).
  """
  family = family_of_config(cfg)
  if cfg.yarn_mscale_all_dim and family != "deepseek_v3":
    raise ValueError(f"ModelConfig.yarn_mscale_all_dim={cfg.yarn_mscale_all_dim}: scales the "
                     f"softmax, which transformers does only for DeepSeek-V3; use "
                     f"yarn_attention_factor for {family}")
  rope = _rope_to_hf(cfg)
  scaling = None
  if cfg.rope_type != "default":
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    scaling["type"] = cfg.rope_type
  hf: dict[str, Any] = {
      "architectures": [_FAMILY_ARCH[family]],
      "model_type": family,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "hidden_act": "silu",
      "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
      "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.initializer_range,
      "attention_dropout": 0.0, "use_cache": True,
      "rope_theta": cfg.rope_theta, "rope_scaling": scaling, "rope_parameters": rope,
  }
  if family == "deepseek_v3":
    hf.update(num_key_value_heads=cfg.num_heads, q_lora_rank=cfg.q_lora_rank,
              kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
              qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
              rope_interleave=cfg.rope_interleave, attention_bias=False,
              num_nextn_predict_layers=0)
    if cfg.is_moe:
      hf.update(n_routed_experts=cfg.num_experts, n_shared_experts=cfg.num_shared_experts,
                num_experts_per_tok=cfg.experts_per_token, n_group=cfg.n_group,
                topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
                routed_scaling_factor=cfg.routed_scaling_factor,
                first_k_dense_replace=cfg.first_k_dense_replace,
                moe_intermediate_size=cfg.moe_intermediate_size,
                scoring_func="sigmoid", topk_method="noaux_tc")
    else:  # all layers dense
      hf.update(n_routed_experts=0, n_shared_experts=0, first_k_dense_replace=cfg.num_layers)
    return hf
  hf.update(num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, use_sliding_window=False,
            sliding_window=None)
  if family == "qwen2":
    hf.update(max_window_layers=cfg.num_layers)
  else:
    hf.update(attention_bias=False)
  if family == "qwen3":
    hf.update(max_window_layers=cfg.num_layers)
  if family == "qwen3_moe":
    hf.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
              norm_topk_prob=cfg.norm_topk_prob, moe_intermediate_size=cfg.moe_intermediate_size,
              decoder_sparse_step=1, mlp_only_layers=[])
  return hf


# ----------------------------------------------------------------------------- name tables


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
    if self.kind == "linear":
      return (math.prod(arbor_shape[self.n_in:]), math.prod(arbor_shape[:self.n_in]))
    if self.kind == "flat":
      return (math.prod(arbor_shape),)
    return tuple(arbor_shape)

  def to_arbor(self, w: np.ndarray, arbor_shape: tuple[int, ...]) -> np.ndarray:
    return (w.T if self.kind == "linear" else w).reshape(arbor_shape)

  def to_hf(self, a: np.ndarray) -> np.ndarray:
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
  """The entries of HF decoder layer `layer` for the family of `cfg` (both directions)."""
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


# ----------------------------------------------------------------------------- load / save


@dataclasses.dataclass
class LoadStats:
  tensors: int = 0  # HF tensors read into the model
  scales: int = 0  # FP8 block scales consumed
  skipped: int = 0  # multi-token-prediction tensors skipped
  params: int = 0  # scalar parameters of the model


def read_hf_config(path: str | os.PathLike) -> dict:
  cfg_path = os.path.join(os.fspath(path), "config.json")
  if not os.path.isfile(cfg_path):
    raise FileNotFoundError(f"no config.json in {path}")
  with open(cfg_path) as f:
    return json.load(f)


def load(path: str | os.PathLike, dtype: Optional[str] = None, **overrides) -> Transformer:
  """The Transformer of an HF checkpoint directory (config.json + safetensors).

  Args:
    path: a directory with `config.json` and `model.safetensors` or sharded files with
      `model.safetensors.index.json`. Weights may be fp32, bf16, fp16 or FP8 e4m3 with
      128x128 `weight_scale_inv` block scales; parameters are always fp32.
    dtype: compute dtype (`ModelConfig.dtype`); None keeps the default (float32).
    **overrides: further ModelConfig fields (e.g. `moe_impl="dense"`, `remat="full"`).
  """
  return load_with_stats(path, dtype, **overrides)[0]


def load_with_stats(path: str | os.PathLike, dtype: Optional[str] = None,
                    **overrides) -> tuple[Transformer, LoadStats]:
  """`load`, plus counts of what was read."""
  path = os.fspath(path)
  hf_config = read_hf_config(path)
  cfg = config_from_hf(hf_config)
  block = _fp8_block(hf_config)
  arch = _FAMILY_ARCH[family_of(hf_config)]
  if dtype is not None:
    overrides["dtype"] = dtype
  cfg = cfg.replace(**overrides)
  ckpt = SafetensorsDir(path)
  graphdef, state = nnx.split(abstract(cfg))
  variables = dict(nnx.to_flat_state(state))
  arrays = {p: np.zeros(v.shape, np.float32) for p, v in variables.items()}
  filled: dict[tuple[str, ...], np.ndarray] = {}  # which slices of each variable were read
  stats = LoadStats()
  consumed: set[str] = set()
  for entry in entries(cfg):
    target = arrays[entry.path][entry.index] if entry.index else arrays[entry.path]
    want = entry.hf_shape(target.shape)
    if entry.hf not in ckpt:
      raise CheckpointError(f"tensor {entry.hf!r} is missing from the checkpoint in {path} "
                            f"(expected shape {list(want)} for {arch})")
    found = ckpt.shape(entry.hf)
    if tuple(found) != want:
      raise CheckpointError(f"tensor {entry.hf!r} in {path} has shape {list(found)}; expected "
                            f"{list(want)} (from config.json)")
    target[...] = entry.to_arbor(ckpt.get_dequantized(entry.hf, np.float32, block),
                                 target.shape)
    mask = filled.setdefault(entry.path, np.zeros(variables[entry.path].shape[:len(entry.index)],
                                                  bool))
    if mask[entry.index]:
      raise RuntimeError(f"internal: {entry.hf} maps to a slice already read (name table)")
    mask[entry.index] = True
    consumed.add(entry.hf)
  for p in variables:  # the tables must cover every variable exactly once
    if p not in filled or not filled[p].all():
      raise RuntimeError(f"internal: no HF tensor maps to {'/'.join(p)} (name table incomplete)")
  stats.tensors = len(consumed)

  if cfg.tie_embeddings and "lm_head.weight" in ckpt:
    head = ckpt.get_dequantized("lm_head.weight", np.float32, block)
    if head.shape != arrays[("embed",)].shape or not np.array_equal(head, arrays[("embed",)]):
      raise CheckpointError(f"tie_word_embeddings=True but lm_head.weight in {path} differs from "
                            f"model.embed_tokens.weight")
    consumed.add("lm_head.weight")

  mtp, unexpected = [], []
  for name in ckpt.names():
    if name in consumed or _IGNORED.match(name):
      continue
    if is_scale_name(name) and name[:-len("_scale_inv")] in consumed:
      stats.scales += 1
      continue
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m and int(m.group(1)) >= cfg.num_layers and arch == "DeepseekV3ForCausalLM":
      mtp.append(name)
      continue
    unexpected.append(name)
  if unexpected:
    raise CheckpointError(f"{len(unexpected)} unexpected tensor(s) in {path} for "
                          f"{arch} with this config.json, e.g. "
                          f"{unexpected[:5]}")
  if mtp:
    layers = sorted({int(re.match(r"model\.layers\.(\d+)\.", n).group(1)) for n in mtp})
    logger.info("skipped %d tensors of multi-token-prediction layer(s) %s in %s",
                len(mtp), layers, path)
  stats.skipped = len(mtp)

  new_state = []
  for p, var in variables.items():
    new_state.append((p, var.replace(jnp.asarray(arrays.pop(p)))))
  stats.params = sum(int(np.prod(v.shape)) for _, v in new_state if isinstance(v, nnx.Param))
  return nnx.merge(graphdef, nnx.from_flat_state(new_state)), stats


def _fp8_block(hf_config: dict) -> int:
  """Block size of FP8 `weight_scale_inv` scales (`quantization_config.weight_block_size`,
  128 when absent); other quantisation methods are rejected."""
  qc = hf_config.get("quantization_config")
  if not qc:
    return 128
  arch = (hf_config.get("architectures") or [hf_config.get("model_type")])[0]
  if qc.get("quant_method") != "fp8":
    raise _unsupported(arch, "quantization_config.quant_method", qc.get("quant_method"),
                       "only FP8 with block scales (weight_scale_inv) is read")
  rows, cols = qc.get("weight_block_size") or (128, 128)
  if rows != cols:
    raise _unsupported(arch, "quantization_config.weight_block_size", [rows, cols],
                       "square blocks only")
  return int(rows)


def hf_tensors(model: Transformer, dtype: str = "float32") -> dict[str, np.ndarray]:
  """The HF-named tensors of `model` (in `dtype`; the router bias stays fp32)."""
  if dtype not in _DTYPES:
    raise ValueError(f"dtype={dtype!r}: expected one of {tuple(_DTYPES)}")
  arrays = {p: np.asarray(v[...], np.float32) for p, v in nnx.to_flat_state(nnx.state(model))}
  out = {}
  for entry in entries(model.cfg):
    a = arrays[entry.path][entry.index] if entry.index else arrays[entry.path]
    np_dtype = np.float32 if entry.hf.endswith("e_score_correction_bias") else _DTYPES[dtype]
    out[entry.hf] = np.ascontiguousarray(entry.to_hf(a)).astype(np_dtype)
  return out


def save(model: Transformer, path: str | os.PathLike, dtype: str = "float32",
         extra_config: Optional[dict] = None, max_shard_bytes: int = 5 * 2**30) -> int:
  """Writes `model` as an HF checkpoint: config.json and safetensors (sharded past 5 GB).

  Routed experts are written per expert (`mlp.experts.{e}.gate_proj.weight`, ...), the layout of
  the released checkpoints; transformers 5.x fuses them when loading. `extra_config` keys (e.g.
  token ids) are added to config.json. Returns the number of tensors written.
  """
  path = os.fspath(path)
  tensors = hf_tensors(model, dtype)
  hf = config_to_hf(model.cfg)
  hf.update(extra_config or {})
  hf.update(torch_dtype=dtype, dtype=dtype)
  os.makedirs(path, exist_ok=True)
  save_dir(tensors, path, max_shard_bytes=max_shard_bytes, metadata={"format": "pt"})
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f, indent=2, sort_keys=True)
  return len(tensors)


# ----------------------------------------------------------------------------- CLI

_CONFIG_FILE = "model_config.json"
_STATE_DIR = "state"
_EXTRA_DIR = "hf_extra"
# Files of an HF directory that are not weights but belong with them (tokenizer, generation).
_EXTRA_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json",
                "chat_template.jinja", "chat_template.json", "added_tokens.json")
_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def config_to_json(cfg: ModelConfig) -> dict:
  return dataclasses.asdict(cfg)


def config_from_json(d: dict) -> ModelConfig:
  d = dict(d)
  if "sharding_rules" in d:
    d["sharding_rules"] = tuple((name, None if axes is None else tuple(axes))
                                for name, axes in d["sharding_rules"])
  return ModelConfig(**d)


def import_hf(hf_dir: str, out: str, dtype: Optional[str] = None) -> dict:
  """HF directory -> `out/state` (orbax) + `out/model_config.json` (+ tokenizer files)."""
  import orbax.checkpoint as ocp
  t0 = time.time()
  model, stats = load_with_stats(hf_dir, dtype)
  t_load = time.time() - t0
  out = os.path.abspath(out)
  os.makedirs(out, exist_ok=True)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.join(out, _STATE_DIR), nnx.state(model))
  with open(os.path.join(out, _CONFIG_FILE), "w") as f:
    json.dump(config_to_json(model.cfg), f, indent=2)
  hf = read_hf_config(hf_dir)
  extra = {k: hf[k] for k in _TOKEN_KEYS if k in hf}
  os.makedirs(os.path.join(out, _EXTRA_DIR), exist_ok=True)
  with open(os.path.join(out, _EXTRA_DIR, "config_extra.json"), "w") as f:
    json.dump(extra, f)
  copied = [n for n in _EXTRA_FILES if os.path.isfile(os.path.join(hf_dir, n))]
  for n in copied:
    shutil.copy2(os.path.join(hf_dir, n), os.path.join(out, _EXTRA_DIR, n))
  return {"tensors": stats.tensors, "scales": stats.scales, "skipped_mtp": stats.skipped,
          "params": stats.params, "extra_files": len(copied), "load_s": round(t_load, 2),
          "total_s": round(time.time() - t0, 2)}


def restore(ckpt: str) -> Transformer:
  """The Transformer saved by `import_hf` (or any `state` + `model_config.json` pair)."""
  import orbax.checkpoint as ocp
  ckpt = os.path.abspath(ckpt)
  with open(os.path.join(ckpt, _CONFIG_FILE)) as f:
    cfg = config_from_json(json.load(f))
  graphdef, abstract_state = nnx.split(abstract(cfg))
  with ocp.StandardCheckpointer() as ckptr:
    state = ckptr.restore(os.path.join(ckpt, _STATE_DIR), abstract_state)
  return nnx.merge(graphdef, state)


def export_hf(ckpt: str, out: str, dtype: str = "float32") -> dict:
  """`import_hf` output -> HF directory loadable by `transformers.AutoModelForCausalLM`."""
  t0 = time.time()
  model = restore(ckpt)
  extra, copied = {}, []
  extra_dir = os.path.join(ckpt, _EXTRA_DIR)
  if os.path.isdir(extra_dir):
    extra_path = os.path.join(extra_dir, "config_extra.json")
    if os.path.isfile(extra_path):
      with open(extra_path) as f:
        extra = json.load(f)
    copied = [n for n in _EXTRA_FILES if os.path.isfile(os.path.join(extra_dir, n))]
  n = save(model, out, dtype, extra_config=extra)
  for name in copied:
    shutil.copy2(os.path.join(extra_dir, name), os.path.join(out, name))
  params = sum(int(np.prod(v.shape)) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
  return {"tensors": n, "params": params, "extra_files": len(copied),
          "total_s": round(time.time() - t0, 2)}


def main(argv: Optional[list[str]] = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m models.hf", description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="command", required=True)
  p_import = sub.add_parser("import", help="HF checkpoint directory -> Arbor orbax checkpoint")
  p_import.add_argument("--hf_dir", required=True, help="directory with config.json + safetensors")
  p_import.add_argument("--out", required=True, help="output directory (must not hold a state)")
  p_import.add_argument("--dtype", default=None, help="compute dtype recorded in the config")
  p_export = sub.add_parser("export", help="Arbor checkpoint (from `import`) -> HF directory")
  p_export.add_argument("--ckpt", required=True, help="directory written by `import`")
  p_export.add_argument("--out", required=True, help="output HF directory")
  p_export.add_argument("--dtype", default="float32", choices=tuple(_DTYPES),
                        help="dtype of the written weights")
  args = parser.parse_args(argv)
  if args.command == "import":
    info = import_hf(args.hf_dir, args.out, args.dtype)
    print(f"imported {args.hf_dir} -> {args.out}: {info['tensors']} tensors "
          f"({info['scales']} FP8 scales, {info['skipped_mtp']} MTP tensors skipped), "
          f"{info['params']:,} parameters, {info['extra_files']} tokenizer/generation files, "
          f"{info['total_s']:.1f}s (load {info['load_s']:.1f}s)")
  else:
    info = export_hf(args.ckpt, args.out, args.dtype)
    print(f"exported {args.ckpt} -> {args.out}: {info['tensors']} tensors ({args.dtype}), "
          f"{info['params']:,} parameters, {info['extra_files']} tokenizer/generation files, "
          f"{info['total_s']:.1f}s")
  return 0


if __name__ == "__main__":
  logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
  sys.exit(main())
