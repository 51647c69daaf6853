"""Hugging Face `config.json` <-> ModelConfig for the supported families.

  Qwen2      `Qwen2ForCausalLM`       qwen2          GQA with q/k/v bias
  Qwen3      `Qwen3ForCausalLM`       qwen3          GQA with per-head q/k RMSNorm
  Qwen3-MoE  `Qwen3MoeForCausalLM`    qwen3_moe      Qwen3 attention, softmax top-k experts
  DeepSeek-V3 `DeepseekV3ForCausalLM` deepseek_v3 | kimi_k2   MLA, sigmoid group-limited router

Anything Arbor does not model (other architectures, sliding windows, unknown RoPE types, ...)
is rejected with a ValueError naming the architecture and the field.
"""

from __future__ import annotations

import json
import os
from typing import Any

from models.config import ModelConfig, yarn_get_mscale

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
FAMILY_ARCHITECTURES = {family: arch for arch, family in ARCHITECTURES.items()}
_ROPE_TYPES = ("default", "linear", "yarn")


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
  """Builds a ModelConfig from an HF `config.json` dict (see the module docstring for the families).

  Args:
    hf_config: the parsed config.json.

  Returns:
    The ModelConfig.

  Raises:
    ValueError: naming the architecture and field for anything Arbor does not model (other
      architectures, sliding windows, unknown RoPE types, DeepSeek attention bias, ...).
  """
  hf = hf_config
  family = family_of(hf)
  arch = FAMILY_ARCHITECTURES[family]
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

  Args:
    cfg: the model config.

  Returns:
    The config.json dict.

  Raises:
    ValueError: `cfg` has a setting no supported HF family can express.
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
      "architectures": [FAMILY_ARCHITECTURES[family]],
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


def read_hf_config(path: str | os.PathLike) -> dict:
  """The `config.json` dict of an HF checkpoint directory; FileNotFoundError when it has none."""
  cfg_path = os.path.join(os.fspath(path), "config.json")
  if not os.path.isfile(cfg_path):
    raise FileNotFoundError(f"no config.json in {path}")
  with open(cfg_path) as f:
    return json.load(f)


def fp8_block_size(hf_config: dict) -> int:
  """Block size of FP8 `weight_scale_inv` scales.

  Args:
    hf_config: the HF config.json dict (`quantization_config.weight_block_size`).

  Returns:
    The square block size; 128 when absent (also without a quantization_config).

  Raises:
    ValueError: a quantisation method other than FP8 with block scales, or non-square blocks.
  """
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
