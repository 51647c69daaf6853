"""Hugging Face checkpoints <-> Arbor models: weight import/export and the checkpoint CLI.

Python:
    model = load(hf_dir)  # config.json + safetensors (sharded; fp32, bf16 or FP8) -> Transformer
    save(model, out_dir, dtype="bfloat16")  # -> config.json + safetensors for transformers

CLI:
    python -m models.hf import --hf_dir IN --out OUT   # HF dir -> orbax state + model_config.json
    python -m models.hf export --ckpt IN --out OUT     # that checkpoint -> HF dir

The supported families and the config translation are in models/hf_config.py; the tensor
name tables, used in both directions, in models/hf_names.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import shutil
import sys
import time
from typing import Optional

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from models.config import ModelConfig
from models.hf_config import (FAMILY_ARCHITECTURES, config_from_hf, config_to_hf, family_of,
                              fp8_block_size, read_hf_config)
from models.hf_names import entries
from models.safetensors_io import SafetensorsDir, is_scale_name, save_dir
from models.transformer import Transformer, abstract

logger = logging.getLogger(__name__)

_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# Tensors HF checkpoints may carry that are not weights (older transformers saved rotary buffers).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
  """A checkpoint does not match its config: missing, misshapen or unexpected tensors."""


@dataclasses.dataclass
class LoadStats:
  """What `load_with_stats` read."""

  tensors: int = 0  # HF tensors read into the model
  scales: int = 0  # FP8 block scales consumed
  skipped: int = 0  # multi-token-prediction tensors skipped
  params: int = 0  # scalar parameters of the model


def load(path: str | os.PathLike, dtype: Optional[str] = None, **overrides) -> Transformer:
  """The Transformer of an HF checkpoint directory (config.json + safetensors).

  Args:
    path: a directory with `config.json` and `model.safetensors` or sharded files with
      `model.safetensors.index.json`. Weights may be fp32, bf16, fp16 or FP8 e4m3 with
      128x128 `weight_scale_inv` block scales; parameters are always fp32.
    dtype: compute dtype (`ModelConfig.dtype`); None keeps the default (float32).
    **overrides: further ModelConfig fields (e.g. `moe_impl="dense"`, `remat="full"`).

  Returns:
    The model on the default device.

  Raises:
    CheckpointError: a tensor is missing, misshapen or unexpected for the config.
    ValueError: the config describes something Arbor does not model.
  """
  return load_with_stats(path, dtype, **overrides)[0]


def load_with_stats(path: str | os.PathLike, dtype: Optional[str] = None,
                    **overrides) -> tuple[Transformer, LoadStats]:
  """Runs `load`, also returning counts of what was read.

  Args:
    path: the HF checkpoint directory (see `load`).
    dtype: compute dtype (`ModelConfig.dtype`); None keeps the default (float32).
    **overrides: further ModelConfig fields.

  Returns:
    (the model, its `LoadStats`).

  Raises:
    CheckpointError: a tensor is missing, misshapen or unexpected for the config.
    ValueError: the config describes something Arbor does not model.
  """
  path = os.fspath(path)
  hf_config = read_hf_config(path)
  cfg = config_from_hf(hf_config)
  block = fp8_block_size(hf_config)
  arch = FAMILY_ARCHITECTURES[family_of(hf_config)]
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


def hf_tensors(model: Transformer, dtype: str = "float32") -> dict[str, np.ndarray]:
  """The HF-named tensors of `model`.

  Args:
    model: the Transformer (stacked).
    dtype: "float32", "bfloat16" or "float16"; the router bias stays fp32.

  Returns:
    {HF tensor name: array in the HF layout}.
  """
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
  """Writes `model` as an HF checkpoint: config.json and safetensors.

  Routed experts are written per expert (`mlp.experts.{e}.gate_proj.weight`, ...), the layout of
  the released checkpoints; transformers 5.x fuses them when loading.

  Args:
    model: the Transformer (stacked).
    path: output directory (created).
    dtype: dtype of the written weights ("float32", "bfloat16" or "float16").
    extra_config: keys added to config.json (e.g. token ids).
    max_shard_bytes: safetensors files are split past this size.

  Returns:
    The number of tensors written.
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
  """The JSON-able dict of an Arbor config (`model_config.json` beside a checkpoint)."""
  return dataclasses.asdict(cfg)


def config_from_json(d: dict) -> ModelConfig:
  """The ModelConfig of a `config_to_json` dict (JSON lists back to tuples)."""
  d = dict(d)
  if "sharding_rules" in d:
    d["sharding_rules"] = tuple((name, None if axes is None else tuple(axes))
                                for name, axes in d["sharding_rules"])
  return ModelConfig(**d)


def import_hf(hf_dir: str, out: str, dtype: Optional[str] = None) -> dict:
  """Converts an HF directory to an Arbor checkpoint: `out/state` (orbax) + `out/model_config.json`.

  The tokenizer files and the config's token ids go to `out/hf_extra/`, for `export_hf` and the
  tokenizer loaders.

  Args:
    hf_dir: the HF checkpoint directory (see `load`).
    out: the output directory (created; must not hold a state already).
    dtype: compute dtype recorded in the config; None keeps the default.

  Returns:
    {"tensors", "scales", "skipped_mtp", "params", "extra_files", "load_s", "total_s"}.

  Raises:
    CheckpointError: a tensor is missing, misshapen or unexpected for the config.
  """
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
  ckpt = os.path.abspath(ckpt)
  with open(os.path.join(ckpt, _CONFIG_FILE)) as f:
    cfg = config_from_json(json.load(f))
  graphdef, abstract_state = nnx.split(abstract(cfg))
  with ocp.StandardCheckpointer() as ckptr:
    state = ckptr.restore(os.path.join(ckpt, _STATE_DIR), abstract_state)
  return nnx.merge(graphdef, state)


def export_hf(ckpt: str, out: str, dtype: str = "float32") -> dict:
  """Converts an `import_hf` output to an HF directory loadable by `AutoModelForCausalLM`.

  Args:
    ckpt: the directory written by `import_hf`; its hf_extra/ files are copied along.
    out: the output HF directory.
    dtype: the stored weights' dtype ("float32", "bfloat16", ...).

  Returns:
    {"tensors", "params", "extra_files", "total_s"}.
  """
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
  """The `python -m models.hf` CLI (module docstring); returns the exit status."""
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
