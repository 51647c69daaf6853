"""Hugging Face checkpoints <-> Arbor models: weight import/export and the checkpoint CLI.

Python:
    model = load(hf_dir)  # config.json + safetensors (sharded; fp32, bf16 or FP8) -> Transformer
    model = load(hf_dir, mesh=mesh)  # each host reads only the slices its devices hold
    save(model, out_dir, dtype="bfloat16")  # -> config.json + safetensors, tensor by tensor

CLI:
    python -m models.hf import --hf_dir IN --out OUT   # HF dir -> orbax state + model_config.json
    python -m models.hf export --ckpt IN --out OUT     # that checkpoint -> HF dir
    (a training run's checkpoints: python -m trainer.export)

The supported families and the config translation are in models/hf_config.py; the tensor
name tables, used in both directions, in models/hf_names.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import logging
import math
import os
import re
import shutil
import sys
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from models.config import ModelConfig
from models.hf_config import (FAMILY_ARCHITECTURES, config_from_hf, config_to_hf, family_of,
                              fp8_block_size, read_hf_config)
from models.hf_names import Entry, entries
from models.safetensors_io import (SafetensorsDir, TensorSpec, is_scale_name, slice_bounds,
                                   write_dir)
from models.sharding import state_shardings
from models import lora
from models.transformer import Transformer, abstract

logger = logging.getLogger(__name__)

_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# Tensors HF checkpoints may carry that are not weights (older transformers saved rotary buffers).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_COMPARE_ROWS = 4096  # rows of lm_head and the embedding compared at a time (tied embeddings)

_Bounds = tuple[tuple[int, int], ...]  # (start, stop) per dimension of a block of an array
_Sources = dict[tuple[int, ...], Entry]  # leading (layer, expert) index -> the HF tensor there


class CheckpointError(ValueError):
  """A checkpoint does not match its config: missing, misshapen or unexpected tensors."""


@dataclasses.dataclass
class LoadStats:
  """What `load_with_stats` read."""

  tensors: int = 0  # HF tensors read into the model
  scales: int = 0  # FP8 block scales consumed
  skipped: int = 0  # multi-token-prediction tensors skipped
  params: int = 0  # scalar parameters of the model
  bytes_read: int = 0  # stored bytes read from the safetensors files by this process


def load(path: str | os.PathLike, dtype: Optional[str] = None, *,
         mesh: Optional[jax.sharding.Mesh] = None, **overrides) -> Transformer:
  """The Transformer of an HF checkpoint directory (config.json + safetensors).

  Variables are built one at a time from memory-mapped reads, so the host holds at most one
  variable (or, on a mesh, one device's block of one) beside what the devices hold.

  Args:
    path: a directory with `config.json` and `model.safetensors` or sharded files with
      `model.safetensors.index.json`. Weights may be fp32, bf16, fp16 or FP8 e4m3 with
      128x128 `weight_scale_inv` block scales; parameters are always fp32.
    dtype: compute dtype (`ModelConfig.dtype`); None keeps the default (float32).
    mesh: a `jax.sharding.Mesh`: every variable is placed directly in its sharding by the
      config's rules (`sharding.state_shardings`), each process reading only the blocks of the
      HF tensors its own devices hold (a replicated block once). None: the default device.
    **overrides: further ModelConfig fields (e.g. `moe_impl="dense"`, `remat="full"`).

  Returns:
    The model, on `mesh` or on the default device; the values are the same either way.

  Raises:
    CheckpointError: a tensor is missing, misshapen or unexpected for the config.
    ValueError: the config describes something Arbor does not model.
  """
  return load_with_stats(path, dtype, mesh=mesh, **overrides)[0]


def load_with_stats(path: str | os.PathLike, dtype: Optional[str] = None, *,
                    mesh: Optional[jax.sharding.Mesh] = None,
                    **overrides) -> tuple[Transformer, LoadStats]:
  """Runs `load`, also returning counts of what was read.

  Args:
    path: the HF checkpoint directory (see `load`).
    dtype: compute dtype (`ModelConfig.dtype`); None keeps the default (float32).
    mesh: the device mesh to shard onto (see `load`); None: the default device.
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
  cfg = lora.base_config(cfg.replace(**overrides))  # adapters come later (with_adapters)
  ckpt = SafetensorsDir(path)
  graphdef, state = nnx.split(abstract(cfg))
  variables = dict(nnx.to_flat_state(state))
  sources = _sources(cfg, ckpt, variables, arch)
  stats = _check_other_tensors(cfg, ckpt, sources, block, arch)
  shardings = {}
  if mesh is not None:
    shardings = {p: v.get_value()
                 for p, v in nnx.to_flat_state(state_shardings(state, cfg, mesh))}
  new_state = []
  for p, var in variables.items():
    value = _read_variable(ckpt, sources[p], var.shape, shardings.get(p), block)
    new_state.append((p, var.replace(value)))
  stats.params = sum(int(np.prod(v.shape)) for _, v in new_state if isinstance(v, nnx.Param))
  stats.bytes_read = ckpt.bytes_read
  return nnx.merge(graphdef, nnx.from_flat_state(new_state)), stats


def _sources(cfg: ModelConfig, ckpt: SafetensorsDir, variables: dict, arch: str
             ) -> dict[tuple[str, ...], _Sources]:
  """The HF tensor of every slice of every variable, checked against the headers only."""
  sources: dict[tuple[str, ...], _Sources] = {p: {} for p in variables}
  for entry in entries(cfg):
    want = entry.hf_shape(variables[entry.path].shape[len(entry.index):])
    if entry.hf not in ckpt:
      raise CheckpointError(f"tensor {entry.hf!r} is missing from the checkpoint in "
                            f"{ckpt.directory} (expected shape {list(want)} for {arch})")
    found = ckpt.shape(entry.hf)
    if tuple(found) != want:
      raise CheckpointError(f"tensor {entry.hf!r} in {ckpt.directory} has shape {list(found)}; "
                            f"expected {list(want)} (from config.json)")
    if entry.index in sources[entry.path]:
      raise RuntimeError(f"internal: {entry.hf} maps to a slice already read (name table)")
    sources[entry.path][entry.index] = entry
  for p, var in variables.items():  # the tables must cover every variable exactly once
    stack = var.shape[:len(next(iter(sources[p]), ()))]
    if not sources[p] or len(sources[p]) != math.prod(stack) or not all(
        0 <= i < n for index in sources[p] for i, n in zip(index, stack)):
      raise RuntimeError(f"internal: no HF tensor maps to {'/'.join(p)} (name table incomplete)")
  return sources


def _check_other_tensors(cfg: ModelConfig, ckpt: SafetensorsDir,
                         sources: dict[tuple[str, ...], _Sources], block: int,
                         arch: str) -> LoadStats:
  """Accounts for the tensors no variable reads: a tied lm_head (must equal the embedding),
  FP8 scales, multi-token-prediction layers (skipped); anything else is an error."""
  consumed = {entry.hf for source in sources.values() for entry in source.values()}
  stats = LoadStats(tensors=len(consumed))
  if cfg.tie_embeddings and "lm_head.weight" in ckpt:
    if not _same_values(ckpt, "lm_head.weight", "model.embed_tokens.weight", block):
      raise CheckpointError(f"tie_word_embeddings=True but lm_head.weight in {ckpt.directory} "
                            f"differs from model.embed_tokens.weight")
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
    raise CheckpointError(f"{len(unexpected)} unexpected tensor(s) in {ckpt.directory} for "
                          f"{arch} with this config.json, e.g. "
                          f"{unexpected[:5]}")
  if mtp:
    layers = sorted({int(re.match(r"model\.layers\.(\d+)\.", n).group(1)) for n in mtp})
    logger.info("skipped %d tensors of multi-token-prediction layer(s) %s in %s",
                len(mtp), layers, ckpt.directory)
  stats.skipped = len(mtp)
  return stats


def _same_values(ckpt: SafetensorsDir, a: str, b: str, block: int) -> bool:
  """Whether two 2-D tensors hold the same (dequantised) values, compared a few rows at a time."""
  if ckpt.shape(a) != ckpt.shape(b):
    return False
  rows = ckpt.shape(a)[0]
  return all(np.array_equal(ckpt.get_dequantized(a, np.float32, block, (part,)),
                            ckpt.get_dequantized(b, np.float32, block, (part,)))
             for part in (slice(i, i + _COMPARE_ROWS) for i in range(0, rows, _COMPARE_ROWS)))


def _read_variable(ckpt: SafetensorsDir, source: _Sources, shape: tuple[int, ...],
                   sharding: Optional[NamedSharding], block: int) -> jax.Array:
  """One variable: whole on the default device (no sharding), else this process's shards.

  Each distinct block is read once, copied to the devices that hold it and dropped before the
  next is read; the copies are waited for, since a transfer holds its host block until it is
  done (a CPU device may keep the block itself as its buffer).
  """
  if sharding is None:
    return jnp.asarray(_read_block(ckpt, source, shape, slice_bounds(None, shape), block))
  devices_of: dict[_Bounds, list[jax.Device]] = {}
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    devices_of.setdefault(slice_bounds(index, shape), []).append(device)
  shards = []
  for bounds, devices in devices_of.items():
    host = _read_block(ckpt, source, shape, bounds, block)
    shards += jax.block_until_ready([jax.device_put(host, device) for device in devices])
    del host  # before the next block is read
  return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def _read_block(ckpt: SafetensorsDir, source: _Sources, shape: tuple[int, ...], bounds: _Bounds,
                block: int) -> np.ndarray:
  """The block `bounds` of a variable, fp32, assembled from the HF tensors it overlaps.

  The leading dimensions of a stacked variable (layer, then expert) pick HF tensors, each of
  which gives the part of it inside the remaining bounds.
  """
  stack = len(next(iter(source)))
  out = np.empty([stop - start for start, stop in bounds], np.float32)
  for index in itertools.product(*(range(start, stop) for start, stop in bounds[:stack])):
    local = tuple(i - start for i, (start, _) in zip(index, bounds))
    out[local] = _read_part(ckpt, source[index], shape[stack:], bounds[stack:], block)
  return out


def _read_part(ckpt: SafetensorsDir, entry: Entry, shape: tuple[int, ...], bounds: _Bounds,
               block: int) -> np.ndarray:
  """The block `bounds` of the Arbor slice [`shape`] that HF tensor `entry.hf` fills.

  An HF dimension merges a run of Arbor dimensions in C order ("linear": the output ones, then
  the input ones; "flat": all; "same": one each). The HF range read for a run covers the block's
  range of its first dimension and all of the others, so it is contiguous; the block's part of
  the others is cut out after reshaping (a no-op unless a rule shards a non-leading dimension
  of a run, e.g. `kv` in q_proj [embed, heads, kv]).
  """
  n = len(shape)
  if entry.kind == "linear":
    runs = [range(entry.n_in, n), range(entry.n_in)]
  elif entry.kind == "flat":
    runs = [range(n)]
  else:
    runs = [range(d, d + 1) for d in range(n)]
  hf_index, covered, crop = [], list(shape), [slice(None)] * n
  for run in runs:
    (start, stop), inner = bounds[run[0]], math.prod(shape[d] for d in run[1:])
    hf_index.append(slice(start * inner, stop * inner))
    covered[run[0]] = stop - start
    for d in run[1:]:
      crop[d] = slice(*bounds[d])
  w = ckpt.get_dequantized(entry.hf, np.float32, block, tuple(hf_index))
  return entry.to_arbor(w, tuple(covered))[tuple(crop)]


def _export(model: Transformer, dtype: str) -> tuple[dict[str, TensorSpec], Callable]:
  """The specs of the HF tensors of `model` and a function that fetches one to the host.

  A fetch gathers one tensor's slice of its variable (on a multi-host mesh, a collective every
  process must join, in the same order).
  """
  if dtype not in _DTYPES:
    raise ValueError(f"dtype={dtype!r}: expected one of {tuple(_DTYPES)}")
  arrays = {p: v[...] for p, v in nnx.to_flat_state(nnx.state(model))}
  table = {entry.hf: entry for entry in entries(model.cfg)}

  def stored_dtype(name: str) -> np.dtype:
    return np.dtype(np.float32 if name.endswith("e_score_correction_bias") else _DTYPES[dtype])

  def fetch(name: str) -> np.ndarray:
    entry = table[name]
    a = _host_slice(arrays[entry.path], entry.index)
    return np.ascontiguousarray(entry.to_hf(a), stored_dtype(name))

  specs = {name: TensorSpec(entry.hf_shape(arrays[entry.path].shape[len(entry.index):]),
                            stored_dtype(name)) for name, entry in table.items()}
  return specs, fetch


def _host_slice(value: jax.Array, index: tuple[int, ...]) -> np.ndarray:
  """`value[index]` on this host, fp32, without gathering the rest of `value`.

  An array spanning several processes (a NamedSharding) is sliced and replicated by a jitted
  program every process runs.
  """
  if value.is_fully_addressable:
    return np.asarray(value[index] if index else value, np.float32)
  replicated = NamedSharding(value.sharding.mesh, PartitionSpec())
  part = _replicated_slice(value, jnp.asarray(index, jnp.int32), replicated)
  return np.asarray(part.addressable_data(0), np.float32)


@functools.partial(jax.jit, static_argnums=2)
def _replicated_slice(value: jax.Array, index: jax.Array, sharding: NamedSharding) -> jax.Array:
  return jax.lax.with_sharding_constraint(value[tuple(index)], sharding)


def hf_tensors(model: Transformer, dtype: str = "float32") -> dict[str, np.ndarray]:
  """The HF-named tensors of `model` (all in memory at once; `save` writes them one by one).

  Args:
    model: the Transformer (stacked).
    dtype: "float32", "bfloat16" or "float16"; the router bias stays fp32.

  Returns:
    {HF tensor name: array in the HF layout}.
  """
  specs, fetch = _export(model, dtype)
  return {name: fetch(name) for name in specs}


def save(model: Transformer, path: str | os.PathLike, dtype: str = "float32",
         extra_config: Optional[dict] = None, max_shard_bytes: int = 5 * 2**30) -> int:
  """Writes `model` as an HF checkpoint: config.json and safetensors.

  Routed experts are written per expert (`mlp.experts.{e}.gate_proj.weight`, ...), the layout of
  the released checkpoints; transformers 5.x fuses them when loading. Tensors are fetched,
  written and released one at a time, so a sharded model is never gathered whole on a host; on
  several hosts every process must call `save` (the fetches are collectives) and process 0
  writes.

  Args:
    model: the Transformer (stacked), on one device or sharded.
    path: output directory (created).
    dtype: dtype of the written weights ("float32", "bfloat16" or "float16").
    extra_config: keys added to config.json (e.g. token ids).
    max_shard_bytes: safetensors files are split past this size (with an index).

  Returns:
    The number of tensors written.

  Raises:
    ValueError: an unknown dtype, or a config no HF family expresses (nothing is written).
  """
  path = os.fspath(path)
  specs, fetch = _export(model, dtype)
  hf = config_to_hf(model.cfg)
  hf.update(extra_config or {})
  hf.update(torch_dtype=dtype, dtype=dtype)
  if jax.process_index() != 0:
    for name in specs:  # join the gathers process 0 makes while writing, in its order
      fetch(name)
    return len(specs)
  os.makedirs(path, exist_ok=True)
  write_dir(specs, fetch, path, max_shard_bytes=max_shard_bytes, metadata={"format": "pt"})
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f, indent=2, sort_keys=True)
  return len(specs)


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
  if "lora_modules" in d:
    d["lora_modules"] = tuple(d["lora_modules"])
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


def companion_files(source: str) -> tuple[dict, list[str]]:
  """What belongs beside the weights of a checkpoint: its token ids and tokenizer files.

  Args:
    source: an HF directory (config.json, tokenizer and generation files), a `models.hf
      import` directory (its hf_extra/), or a directory holding only tokenizer files.

  Returns:
    ({"bos_token_id", ...} present in its config, [paths of its tokenizer / generation /
    chat-template files]).
  """
  extra_dir = os.path.join(source, _EXTRA_DIR)
  if os.path.isdir(extra_dir):  # an import_hf output
    extra_path = os.path.join(extra_dir, "config_extra.json")
    extra = {}
    if os.path.isfile(extra_path):
      with open(extra_path) as f:
        extra = json.load(f)
    source = extra_dir
  else:
    config_path = os.path.join(source, "config.json")
    extra = {}
    if os.path.isfile(config_path):
      with open(config_path) as f:
        extra = {k: v for k, v in json.load(f).items() if k in _TOKEN_KEYS}
  files = [os.path.join(source, n) for n in _EXTRA_FILES
           if os.path.isfile(os.path.join(source, n))]
  return extra, files


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
  if not os.path.isfile(os.path.join(ckpt, _CONFIG_FILE)) or not os.path.isdir(
      os.path.join(ckpt, _STATE_DIR)):
    hint = (" (an Arbor run's workdir or checkpoint: python -m trainer.export)"
            if os.path.isfile(os.path.join(ckpt, "config.json")) or
            os.path.isdir(os.path.join(ckpt, "checkpoints")) or
            os.path.basename(os.path.dirname(os.path.abspath(ckpt))) == "checkpoints" else "")
    raise FileNotFoundError(f"export --ckpt {ckpt}: not a `models.hf import` directory "
                            f"({_STATE_DIR}/ and {_CONFIG_FILE}){hint}")
  model = restore(ckpt)
  extra, copied = companion_files(ckpt)
  n = save(model, out, dtype, extra_config=extra)
  for path in copied:
    shutil.copy2(path, os.path.join(out, os.path.basename(path)))
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
    try:
      info = export_hf(args.ckpt, args.out, args.dtype)
    except FileNotFoundError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    print(f"exported {args.ckpt} -> {args.out}: {info['tensors']} tensors ({args.dtype}), "
          f"{info['params']:,} parameters, {info['extra_files']} tokenizer/generation files, "
          f"{info['total_s']:.1f}s")
  return 0


if __name__ == "__main__":
  logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
  sys.exit(main())
