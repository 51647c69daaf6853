"""LoRA adapters in Hugging Face PEFT's format: `adapter_model.safetensors` + `adapter_config.json`.

    save_adapter(model, out_dir, base_model_name_or_path="Qwen/Qwen2.5-7B")  # adapters only
    model = load_adapter(base_model, adapter_dir)  # a LoRA model with the directory's adapters

What `peft.PeftModel.from_pretrained(transformers_model, adapter_dir)` loads: one LoRA pair per
adapted `nn.Linear`, named after the transformers module under PeftModel's own root,
`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight` [r, in] and `....lora_B.weight`
[out, r], applied as W x + s B (A x) with s = lora_alpha / r, or lora_alpha / sqrt(r) with
`use_rslora`. Arbor's adapters are A [in, r], B [r, out] over a kernel's flattened input and
output dimensions (`models.lora`) with the same s, so PEFT's lora_A is A transposed and its
lora_B is B transposed; the flattening is the C order the Hugging Face weight names use
(`models.hf_names`, whose tables give every name here). Stacked layers are written per layer.

The projections: attention ("attention" in `ModelConfig.lora_modules`: q/k/v/o, MLA's q_proj,
q_a_proj, q_b_proj, kv_a_proj_with_mqa, o_proj) and the MLPs of dense models ("mlp");
`target_modules` lists their last name components. On a MoE model (Qwen3-MoE, DeepSeek-V3)
only attention adapters are written: peft, on transformers 5, reads the targets gate_proj /
up_proj / down_proj of these families as the routed experts' fused parameters (its conversion
of transformers 4 per-expert adapters) and no longer as modules, so adapters of dense-layer
MLPs and shared experts would not load.

Routed-expert adapters ("experts") are not written (`AdapterError`). transformers 5 holds a
layer's experts as fused 3-D parameters (gate_up_proj, down_proj), which peft adapts through
`target_parameters` (one adapter per expert for the fused gate_up_proj, no dropout); it also
converts transformers-4-style per-expert adapters (`mlp.experts.E.gate_proj.lora_A.weight`, ...)
into that form, fusing gate and up into rank 2r with alpha doubled, which keeps alpha / r but
not rsLoRA's alpha / sqrt(r). Writing that per-expert form is not done here.

A quantized frozen base (QLoRA, `base_qtype`) is not part of an adapter: the adapters apply to
whatever base they are loaded on, e.g. the full-precision checkpoint the run started from.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterator, Optional

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from models import lora
from models.config import ModelConfig
from models.hf_names import entries
from models.layers import Dense
from models.safetensors_io import SafetensorsDir, save_file
from models.transformer import Transformer, with_adapters

WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"
# PeftModel wraps the transformers model as `base_model.model`; the latter's root is `model.`
PREFIX = "base_model.model."
GROUPS = ("attention", "mlp")  # the `lora_modules` entries PEFT's format expresses
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# adapter_config.json fields Arbor's adapters have no counterpart for, with the values that
# mean "not used" (PEFT writes these defaults)
_UNUSED = {"use_dora": (False, None), "rank_pattern": ({}, None), "alpha_pattern": ({}, None),
           "bias": ("none", None), "lora_bias": (False, None), "fan_in_fan_out": (False, None),
           "layers_to_transform": (None, []), "layers_pattern": (None, []),
           "modules_to_save": (None, []), "target_parameters": (None, []),
           "exclude_modules": (None, []), "trainable_token_indices": (None, [], {})}


# peft on transformers 5 reads the targets gate_proj / up_proj / down_proj of a Qwen3-MoE or
# DeepSeek-V3 model as its routed experts' fused parameters (the transformers 4 per-expert
# modules) and drops them as module targets, so the MLP adapters of dense layers and shared
# experts would not load
_MOE_MLP = ("{field}={value!r}: PEFT cannot hold the 'mlp' adapters (dense MLPs, shared experts) "
            "of a MoE model: it retargets gate_proj / up_proj / down_proj to the routed experts "
            "of Qwen3-MoE and DeepSeek-V3 models; use lora_modules=('attention',) or export the "
            "merged model (trainer.export --format=hf)")


class AdapterError(ValueError):
  """An adapter that PEFT's format cannot hold, or a PEFT adapter directory Arbor cannot read
  (a config field or a tensor is named in the message)."""


@dataclasses.dataclass(frozen=True)
class Site:
  """One adapted projection of one layer.

  name:  the transformers module, e.g. "model.layers.3.self_attn.q_proj".
  dense: the Arbor Dense holding `kernel_lora_a` [(layers,) in, r] and `kernel_lora_b`
         [(layers,) r, out].
  layer: its index in a stacked Dense's leading axis; None for an unstacked Block's own.
  """
  name: str
  dense: Dense
  layer: Optional[int]

  def arrays(self) -> tuple[np.ndarray, np.ndarray]:
    """(A [in, r], B [r, out]) of this layer, fp32 on the host."""
    a, b = (np.asarray(v[...] if self.layer is None else v[self.layer], np.float32)
            for v in (self.dense.kernel_lora_a, self.dense.kernel_lora_b))
    return a, b


def sites(model: Transformer) -> Iterator[Site]:
  """The adapted projections of a LoRA model (stacked or unstacked), layer by layer, in the
  Hugging Face checkpoint's order."""
  for entry in entries(model.cfg):
    if entry.kind != "linear" or entry.path[-1] != "kernel":
      continue  # the router and the output head are never adapted
    stack, sub, i = entry.path[0], entry.path[1:-1], entry.index[0]
    blocks = getattr(model, stack)
    if isinstance(blocks, nnx.List):
      dense, layer = lora.module_at(blocks[i], sub), None
    else:
      dense, layer = lora.module_at(blocks, sub), i
    if hasattr(dense, "kernel_lora_a"):
      yield Site(entry.hf.removesuffix(".weight"), dense, layer)


def target_names(cfg: ModelConfig, groups: tuple[str, ...]) -> set[str]:
  """The transformers module names (last component) `lora_modules` groups adapt in `cfg`'s
  family, e.g. {"q_proj", "k_proj", "v_proj", "o_proj"} for ("attention",) on Qwen2."""
  arbor = {name for g in groups for name in lora.MODULES[g]}
  return {e.hf.removesuffix(".weight").rsplit(".", 1)[1] for e in entries(cfg)
          if e.kind == "linear" and e.path[-1] == "kernel" and e.path[-2] in arbor}


def adapter_config(cfg: ModelConfig, base_model_name_or_path: Optional[str] = None) -> dict:
  """The adapter_config.json of a LoRA config (PEFT's LoraConfig fields).

  Raises:
    AdapterError: no adapters (lora_rank 0), or routed-expert adapters.
  """
  _check_exportable(cfg)
  groups = tuple(g for g in GROUPS if g in cfg.lora_modules)
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM",
          "base_model_name_or_path": base_model_name_or_path,
          "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "use_rslora": cfg.lora_rslora,
          "lora_dropout": cfg.lora_dropout,
          "target_modules": sorted(target_names(cfg, groups)),
          "bias": "none", "fan_in_fan_out": False, "use_dora": False, "lora_bias": False,
          "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
          "layers_to_transform": None, "layers_pattern": None,
          "rank_pattern": {}, "alpha_pattern": {}}


def _check_exportable(cfg: ModelConfig) -> None:
  if not cfg.lora_rank:
    raise AdapterError("ModelConfig.lora_rank=0: the model has no LoRA adapters to write")
  if cfg.is_moe and "mlp" in cfg.lora_modules:
    raise AdapterError(_MOE_MLP.format(field="ModelConfig.lora_modules", value=cfg.lora_modules))
  if cfg.lora_experts_on:
    raise AdapterError(
        f"ModelConfig.lora_modules={cfg.lora_modules!r}: routed-expert adapters ('experts', "
        f"lora_experts={cfg.lora_experts!r}) are not written in PEFT's format (peft adapts "
        "transformers' fused gate_up_proj / down_proj expert parameters); export the merged "
        "model instead (trainer.export --format=hf)")


def adapter_tensors(model: Transformer, dtype: str = "float32") -> dict[str, np.ndarray]:
  """{PEFT tensor name: array} of a LoRA model's adapters: lora_A [r, in], lora_B [out, r].

  Raises:
    AdapterError: see `adapter_config`; or a dtype not in float32 / bfloat16 / float16.
  """
  _check_exportable(model.cfg)
  if dtype not in _DTYPES:
    raise AdapterError(f"dtype={dtype!r}: expected one of {tuple(_DTYPES)}")
  out = {}
  for site in sites(model):
    a, b = site.arrays()
    out[f"{PREFIX}{site.name}.lora_A.weight"] = np.ascontiguousarray(a.T, _DTYPES[dtype])
    out[f"{PREFIX}{site.name}.lora_B.weight"] = np.ascontiguousarray(b.T, _DTYPES[dtype])
  return out


def save_adapter(model: Transformer, path: str | os.PathLike,
                 base_model_name_or_path: Optional[str] = None, dtype: str = "float32") -> dict:
  """Writes a LoRA model's adapters as a PEFT adapter directory.

  Args:
    model: a Transformer with adapters (stacked or unstacked; `models.lora.apply`).
    path: the output directory (created).
    base_model_name_or_path: the base checkpoint the adapters belong to (a hub id or a
      directory), written to adapter_config.json; None leaves it unset.
    dtype: dtype of the written adapters ("float32", "bfloat16" or "float16").

  Returns:
    {"tensors": count, "params": adapter parameters, "target_modules": [...]}.

  Raises:
    AdapterError: no adapters, routed-expert adapters, or an unknown dtype.
  """
  config = adapter_config(model.cfg, base_model_name_or_path)
  tensors = adapter_tensors(model, dtype)
  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  save_file(tensors, os.path.join(path, WEIGHTS_NAME), metadata={"format": "pt"})
  with open(os.path.join(path, CONFIG_NAME), "w") as f:
    json.dump(config, f, indent=2, sort_keys=True)
  return {"tensors": len(tensors), "params": sum(int(t.size) for t in tensors.values()),
          "target_modules": config["target_modules"]}


def read_adapter_config(path: str | os.PathLike) -> dict[str, Any]:
  """The adapter_config.json of a PEFT adapter directory.

  Raises:
    AdapterError: no such file, or not a JSON object.
  """
  file = os.path.join(os.fspath(path), CONFIG_NAME)
  if not os.path.isfile(file):
    raise AdapterError(f"{file} not found: not a PEFT adapter directory")
  with open(file) as f:
    config = json.load(f)
  if not isinstance(config, dict):
    raise AdapterError(f"{file}: expected a JSON object")
  return config


def lora_settings(config: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  """The ModelConfig LoRA fields of an adapter_config.json, for a model of `cfg`'s family.

  Args:
    config: the adapter_config.json contents.
    cfg: the base model's config (its family names the projections).

  Returns:
    {"lora_rank", "lora_alpha", "lora_rslora", "lora_dropout", "lora_modules"}.

  Raises:
    AdapterError: a field with a value Arbor's adapters cannot express (named in the message).
  """
  def fail(field: str, why: str):
    raise AdapterError(f"{CONFIG_NAME}: {field}={config.get(field)!r}: {why}")

  if config.get("peft_type") != "LORA":
    fail("peft_type", "expected 'LORA'")
  if config.get("task_type") not in ("CAUSAL_LM", None):
    fail("task_type", "expected 'CAUSAL_LM'")
  r = config.get("r")
  if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
    fail("r", "expected a positive integer rank")
  alpha = config.get("lora_alpha")
  if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
    fail("lora_alpha", "expected a positive number")
  rslora = config.get("use_rslora", False)
  if not isinstance(rslora, bool):
    fail("use_rslora", "expected true or false")
  dropout = config.get("lora_dropout", 0.0)
  if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
    fail("lora_dropout", "expected a number in [0, 1)")
  for field, unused in _UNUSED.items():
    if field in config and config[field] not in unused:
      fail(field, f"not supported by Arbor's adapters (expected {unused[0]!r})")
  targets = config.get("target_modules")
  if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
    fail("target_modules", "expected a list of module names (a regular expression is not read)")
  by_group = {g: target_names(cfg, (g,)) for g in GROUPS}
  groups = tuple(g for g in GROUPS if by_group[g] and by_group[g] <= set(targets))
  if not targets or set(targets) != target_names(cfg, groups):
    options = ", ".join(f"{g} = {sorted(by_group[g])}" for g in GROUPS if by_group[g])
    fail("target_modules", "Arbor adapts whole groups of projections of this model, one or "
         f"both of: {options}")
  if cfg.is_moe and "mlp" in groups:
    raise AdapterError(_MOE_MLP.format(field=f"{CONFIG_NAME}: target_modules", value=targets))
  return {"lora_rank": r, "lora_alpha": float(alpha), "lora_rslora": rslora,
          "lora_dropout": float(dropout), "lora_modules": groups}


def load_adapter(base: Transformer, path: str | os.PathLike,
                 cfg: Optional[ModelConfig] = None) -> Transformer:
  """A LoRA model: `base` with the adapters of a PEFT adapter directory.

  Args:
    base: a Transformer without adapters (stacked or unstacked), e.g. `models.hf.load` of the
      adapters' base model.
    path: a directory with adapter_config.json and adapter_model.safetensors.
    cfg: the LoRA settings expected (e.g. a run's ModelConfig): its lora_rank, lora_alpha,
      lora_rslora and lora_modules must be the directory's, and its lora_dropout is kept;
      None takes the directory's own settings (with `base.cfg`'s other fields).

  Returns:
    A new model sharing the base's arrays, whose forward is the adapted one (what PEFT
    computes on the same base).

  Raises:
    AdapterError: the directory's config or tensors do not fit (the field or tensor named),
      the base has adapters already, or `cfg` disagrees with the directory.
  """
  if lora.has_adapters(base):
    raise AdapterError("load_adapter: the base model has adapters already")
  path = os.fspath(path)
  settings = lora_settings(read_adapter_config(path), base.cfg)
  if cfg is not None and cfg.lora_rank:
    for field in ("lora_rank", "lora_alpha", "lora_rslora", "lora_modules"):
      mine, theirs = getattr(cfg, field), settings[field]
      if (set(mine) != set(theirs)) if field == "lora_modules" else mine != theirs:
        raise AdapterError(f"{CONFIG_NAME} in {path} gives {field}={theirs!r}, but "
                           f"ModelConfig.{field}={mine!r}")
    settings["lora_dropout"] = cfg.lora_dropout  # a training setting: the caller's
  target = (cfg if cfg is not None and cfg.lora_rank else base.cfg).replace(**settings)
  file = os.path.join(path, WEIGHTS_NAME)
  if not os.path.isfile(file):
    raise AdapterError(f"{file} not found (adapters are read from safetensors only)")
  others = sorted(f for f in os.listdir(path) if f.endswith(".safetensors") and f != WEIGHTS_NAME)
  if others:  # SafetensorsDir reads a directory's one file
    raise AdapterError(f"{path} holds other safetensors files besides {WEIGHTS_NAME}: {others}")
  stored = SafetensorsDir(path)
  _check_names_and_ranks(stored, file, target)  # before the adapted model is built
  model = with_adapters(base, target)
  _read_tensors(model, stored, file)
  return model


def _check_names_and_ranks(stored: SafetensorsDir, file: str, cfg: ModelConfig) -> None:
  """The stored tensors are exactly the lora_A [r, in] and lora_B [out, r] of the projections
  `cfg` adapts, r its lora_rank."""
  arbor = {name for g in cfg.lora_modules for name in lora.MODULES[g]}
  want = {f"{PREFIX}{e.hf.removesuffix('.weight')}.lora_{kind}.weight": kind
          for e in entries(cfg) if e.kind == "linear" and e.path[-1] == "kernel"
          and e.path[-2] in arbor for kind in "AB"}
  names = set(stored.names())
  if names - set(want):
    raise AdapterError(f"{len(names - set(want))} tensor(s) in {file} belong to no adapted "
                       f"projection of this model (target_modules), e.g. "
                       f"{sorted(names - set(want))[:3]}")
  if set(want) - names:
    raise AdapterError(f"{len(set(want) - names)} tensor(s) missing from {file}, e.g. "
                       f"{sorted(set(want) - names)[:3]}")
  for name, kind in want.items():
    shape = stored.shape(name)
    if len(shape) != 2 or shape[0 if kind == "A" else 1] != cfg.lora_rank:
      raise AdapterError(f"tensor {name!r} in {file} has shape {list(shape)}: not rank "
                         f"r={cfg.lora_rank} of {CONFIG_NAME} (lora_A [r, in], lora_B [out, r])")


def _read_tensors(model: Transformer, stored: SafetensorsDir, file: str) -> None:
  """Sets every adapter of `model` from the stored tensors (checked by
  `_check_names_and_ranks`)."""
  # id(dense) -> (the Dense, {"a": {layer: A [in, r]}, "b": {layer: B [r, out]}}): a stacked
  # Dense is set once, from all of its layers
  values: dict[int, tuple[Dense, dict[str, dict]]] = {}
  for site in sites(model):
    a_var, b_var = site.dense.kernel_lora_a, site.dense.kernel_lora_b
    shape_a, shape_b = a_var.shape[-2:], b_var.shape[-2:]
    got = []
    for kind, want in (("A", (shape_a[1], shape_a[0])), ("B", (shape_b[1], shape_b[0]))):
      name = f"{PREFIX}{site.name}.lora_{kind}.weight"
      if tuple(stored.shape(name)) != want:  # another model's adapters
        raise AdapterError(f"tensor {name!r} in {file} has shape {list(stored.shape(name))}; "
                           f"expected {list(want)} for this base model")
      got.append(stored.get(name, np.float32).T)
    _, slot = values.setdefault(id(site.dense), (site.dense, {"a": {}, "b": {}}))
    slot["a"][site.layer], slot["b"][site.layer] = got
  for dense, slot in values.values():
    for name, per_layer in (("kernel_lora_a", slot["a"]), ("kernel_lora_b", slot["b"])):
      var = getattr(dense, name)
      if None in per_layer:
        value = per_layer[None]
      else:  # a stacked Dense: its layers in order
        value = np.stack([per_layer[i] for i in range(len(per_layer))])
      var.set_value(jnp.asarray(value, var.dtype).reshape(var.shape))
