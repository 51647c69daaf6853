"""A training run's weights as a Hugging Face checkpoint directory.

    python -m trainer.export --ckpt WORKDIR --out DIR                 # the latest checkpoint
    python -m trainer.export --ckpt WORKDIR/checkpoints/N --out DIR   # step N
    python -m trainer.export --ckpt WORKDIR --out DIR --dtype bfloat16
    python -m trainer.export --ckpt WORKDIR --out DIR --format peft   # LoRA adapters only

Works for SFT, RL and distillation runs alike: the run's own config.json and
model_config.json rebuild its state (`harness.run_weights`), and `models.hf.save` writes
config.json and safetensors tensor by tensor. Beside them go the tokenizer, chat-template and
generation files of the run's tokenizer source (`config.tokenizer_source`: tokenizer.path, or
the checkpoint the run started from) and its token ids; a generation_config.json is written
from those ids when the source has none. A tokenizer Arbor trained itself (the demos'
sentencepiece model) is converted to a tokenizer.json with the same ids
(`tokenizer_train.hf_tokenizer`), so `AutoTokenizer` loads every exported run. A run that
rendered with a built-in chat format gets that format's Jinja template as chat_template.jinja
(envs/chat/templates), so `apply_chat_template` renders the ids the run trained on; a run with
chat_format "template" keeps the checkpoint's own. (`python -m
models.hf export` converts `models.hf import` directories.)

A LoRA run is exported merged (W + s A B in every adapted kernel) by default; `--format peft`
writes its adapters alone in Hugging Face PEFT's format instead (adapter_model.safetensors +
adapter_config.json, `models.peft_format`), for `peft.PeftModel.from_pretrained(base, DIR)` on
the base checkpoint the run started from (written as base_model_name_or_path: the model.init
directory of an "hf:DIR" run, or --base_model). Routed-expert adapters, and the MLP adapters
of MoE models, are refused there (`models.peft_format` says why).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Optional

import jax
import ml_collections
from flax import nnx

from envs.chat.formats import builtin_template
from models import hf, peft_format, transformer
from models.config import ModelConfig
from trainer import config as config_lib
from trainer import harness
from trainer import state as state_lib
from trainer.tokenizer_train import hf_tokenizer


def run_and_step(ckpt: str) -> tuple[str, Optional[int]]:
  """(workdir, step) of `ckpt`: a run's workdir (step None: the latest) or one of its
  checkpoints, WORKDIR/checkpoints/N.

  Raises:
    FileNotFoundError: `ckpt` is neither (no config.json and model_config.json found).
  """
  path = os.path.abspath(ckpt)
  parent = os.path.dirname(path)
  if os.path.basename(parent) == "checkpoints" and os.path.basename(path).isdigit():
    workdir, step = os.path.dirname(parent), int(os.path.basename(path))
  else:
    workdir, step = path, None
  missing = [n for n in ("config.json", "model_config.json")
             if not os.path.isfile(os.path.join(workdir, n))]
  if missing:
    raise FileNotFoundError(f"--ckpt {ckpt}: not an Arbor run's workdir or checkpoint "
                            f"({', '.join(missing)} missing in {workdir})")
  return workdir, step


def _run_configs(workdir: str) -> tuple[ml_collections.ConfigDict, ModelConfig]:
  """A run's experiment config and ModelConfig, as it saved them."""
  with open(os.path.join(workdir, "config.json")) as f:
    config = ml_collections.ConfigDict(json.load(f))
  with open(os.path.join(workdir, "model_config.json")) as f:
    return config, hf.config_from_json(json.load(f))


def export_run(ckpt: str, out: str, dtype: str = "float32") -> dict:
  """Writes a run's checkpoint as an HF directory.

  Args:
    ckpt: the run's workdir (its latest checkpoint) or WORKDIR/checkpoints/N.
    out: the output directory (created).
    dtype: dtype of the written weights ("float32", "bfloat16" or "float16").

  Returns:
    {"step", "tensors", "params", "files" (names copied or written beside the weights),
    "tokenizer" (the tokenizer source, or None when it has no HF files), "total_s"}.

  Raises:
    FileNotFoundError: `ckpt` is not a run, or has no such checkpoint.
  """
  t0 = time.time()
  workdir, step = run_and_step(ckpt)
  config, model_cfg = _run_configs(workdir)
  params, rest, step = harness.run_weights(workdir, step)
  model = nnx.merge(state_lib.graphdef(model_cfg), params, rest)
  if model_cfg.lora_rank:  # adapters merged into their kernels (a quantized base dequantized)
    model = transformer.merge_adapters(model)
  ids, files, source = _companions(config, workdir)
  spm_model = _arbor_sentencepiece(source, files)
  if spm_model:  # converted below; the sentencepiece file itself is not for transformers
    files = [f for f in files if os.path.basename(f) != "tokenizer.model"]
    ids = {**_sentencepiece_ids(spm_model), **ids}
  tensors = hf.save(model, out, dtype, extra_config=ids)
  names = []
  for path in files:
    shutil.copy2(path, os.path.join(out, os.path.basename(path)))
    names.append(os.path.basename(path))
  if spm_model:
    names += _write_hf_tokenizer(spm_model, out)
  if _write_chat_template(config.tokenizer.get("chat_format", "template"), out):
    names.append("chat_template.jinja")
  if "generation_config.json" not in names and ids:
    generation = dict(ids)
    stops = _stop_token_ids(config, source)
    if stops:  # generation ends with the chat format's end of turn, as the run's sampler did
      generation["eos_token_id"] = stops if len(stops) > 1 else stops[0]
    with open(os.path.join(out, "generation_config.json"), "w") as f:
      json.dump(generation, f, indent=2)
    names.append("generation_config.json")
  params_count = sum(int(v.size) for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
  has_tokenizer = any(n in ("tokenizer.json", "tokenizer.model", "vocab.json") for n in names)
  return {"step": step, "tensors": tensors, "params": params_count, "files": sorted(set(names)),
          "tokenizer": source if has_tokenizer else None,
          "total_s": round(time.time() - t0, 2)}


def export_adapter(ckpt: str, out: str, dtype: str = "float32",
                   base_model: Optional[str] = None) -> dict:
  """Writes a LoRA run's adapters as a PEFT adapter directory (`models.peft_format`).

  Args:
    ckpt: the run's workdir (its latest checkpoint) or WORKDIR/checkpoints/N.
    out: the output directory (created).
    dtype: dtype of the written adapters ("float32", "bfloat16" or "float16").
    base_model: base_model_name_or_path of adapter_config.json (a hub id or a directory);
      None: the run's model.init directory when it started from an HF checkpoint, else unset.

  Returns:
    {"step", "tensors", "params" (adapter parameters), "target_modules", "base_model",
    "total_s"}.

  Raises:
    FileNotFoundError: `ckpt` is not a run, or has no such checkpoint.
    peft_format.AdapterError: the run has no adapters, or routed-expert adapters.
  """
  t0 = time.time()
  workdir, step = run_and_step(ckpt)
  config, model_cfg = _run_configs(workdir)
  peft_format.adapter_config(model_cfg)  # fails before the checkpoint is read
  if base_model is None:
    kind, path = config_lib.init_kind(config.model.get("init", "random"))
    base_model = path if kind == "hf" else None
  params, rest, step = harness.run_weights(workdir, step)
  model = nnx.merge(state_lib.graphdef(model_cfg), params, rest)
  info = peft_format.save_adapter(model, out, base_model, dtype)
  return {"step": step, "tensors": info["tensors"], "params": info["params"],
          "target_modules": info["target_modules"], "base_model": base_model,
          "total_s": round(time.time() - t0, 2)}


def _arbor_sentencepiece(source: Optional[str], files: list[str]) -> Optional[str]:
  """The tokenizer.model of a tokenizer Arbor trained (`trainer.tokenizer_train`), when the
  run's tokenizer is one and has no Hugging Face tokenizer beside it; else None."""
  if not source or not os.path.isdir(source):
    return None
  names = {os.path.basename(f) for f in files}
  model = os.path.join(source, "tokenizer.model")
  trained_here = os.path.isfile(os.path.join(source, "tokenizer_info.json"))
  if not trained_here or not os.path.isfile(model) or names & {"tokenizer.json", "vocab.json"}:
    return None
  return model


def _sentencepiece_ids(model_path: str) -> dict:
  """{"bos_token_id", "eos_token_id", "pad_token_id"} of a sentencepiece model."""
  import sentencepiece as spm
  sp = spm.SentencePieceProcessor(model_file=model_path)
  return {k: v for k, v in (("bos_token_id", sp.bos_id()), ("eos_token_id", sp.eos_id()),
                            ("pad_token_id", sp.pad_id())) if v >= 0}


def _write_hf_tokenizer(model_path: str, out: str) -> list[str]:
  """Writes tokenizer.json and tokenizer_config.json for an Arbor-trained sentencepiece model
  (same ids, `tokenizer_train.hf_tokenizer`); returns the names written."""
  import sentencepiece as spm
  sp = spm.SentencePieceProcessor(model_file=model_path)
  hf_tokenizer(model_path).save(os.path.join(out, "tokenizer.json"))
  special = {name: sp.id_to_piece(i) for name, i in (
      ("unk_token", sp.unk_id()), ("bos_token", sp.bos_id()), ("eos_token", sp.eos_id()),
      ("pad_token", sp.pad_id())) if i >= 0}
  tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast",
                      "clean_up_tokenization_spaces": False, **special}
  with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
    json.dump(tokenizer_config, f, indent=2, ensure_ascii=False)
  return ["tokenizer.json", "tokenizer_config.json"]


def _stop_token_ids(config, source: Optional[str]) -> list[int]:
  """The ids that end the run's sampling (its chat format's), or [] without a tokenizer."""
  if not source or not os.path.exists(source):
    return []
  try:
    return list(config_lib.make_chat_format(config, source).stop_token_ids)
  except (config_lib.ConfigError, ValueError, OSError):
    return []


def _write_chat_template(chat_format: str, out: str) -> bool:
  """Writes the run's built-in chat format as out/chat_template.jinja (replacing the starting
  checkpoint's template, which the run did not use); returns whether it did. A run with
  chat_format "template" keeps the checkpoint's own, copied with the tokenizer files."""
  template = builtin_template(chat_format)
  if template is None:
    return False
  with open(os.path.join(out, "chat_template.jinja"), "w", encoding="utf-8") as f:
    f.write(template)
  config_path = os.path.join(out, "tokenizer_config.json")
  if os.path.isfile(config_path):  # one template only: transformers would prefer either
    with open(config_path, encoding="utf-8") as f:
      tokenizer_config = json.load(f)
    if tokenizer_config.pop("chat_template", None) is not None:
      with open(config_path, "w", encoding="utf-8") as f:
        json.dump(tokenizer_config, f, indent=2, ensure_ascii=False)
  for stale in ("chat_template.json",):
    if os.path.isfile(os.path.join(out, stale)):
      os.remove(os.path.join(out, stale))
  return True


def _companions(config, workdir: str) -> tuple[dict, list[str], Optional[str]]:
  """The run's token ids (from the checkpoint it started from), tokenizer files and where
  they came from (the tokenizer source, else the starting checkpoint, else None)."""
  ids, files, origin = {}, [], None
  kind, path = config_lib.init_kind(config.model.get("init", "random"))
  if kind in ("hf", "ckpt") and os.path.isdir(path):
    ids, files = hf.companion_files(path)
    origin = path
  try:
    source = config_lib.tokenizer_source(config, workdir)
  except config_lib.ConfigError:
    return ids, files, origin
  if os.path.isdir(source):
    more_ids, files = hf.companion_files(source)
    ids = {**more_ids, **ids}
  elif os.path.isfile(source) and os.path.basename(source) == "tokenizer.json":
    files = [source]
  return ids, files, source


def main(argv: Optional[list[str]] = None) -> int:
  """The `python -m trainer.export` CLI (module docstring); returns the exit status."""
  parser = argparse.ArgumentParser(prog="python -m trainer.export",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--ckpt", required=True, help="a run's workdir or WORKDIR/checkpoints/N")
  parser.add_argument("--out", required=True, help="output HF directory")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                      help="dtype of the written weights")
  parser.add_argument("--format", default="hf", choices=("hf", "peft"),
                      help="hf: the whole model, LoRA adapters merged; peft: a LoRA run's "
                      "adapters alone, as a PEFT adapter directory")
  parser.add_argument("--base_model", default=None,
                      help="--format peft: base_model_name_or_path of adapter_config.json "
                      "(default: the run's model.init directory for an hf:DIR run)")
  args = parser.parse_args(argv)
  try:
    if args.format == "peft":
      info = export_adapter(args.ckpt, args.out, args.dtype, args.base_model)
    else:
      info = export_run(args.ckpt, args.out, args.dtype)
  except (FileNotFoundError, peft_format.AdapterError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.format == "peft":
    print(f"exported the adapters of step {info['step']} of {args.ckpt} -> {args.out}: "
          f"{info['tensors']} tensors ({args.dtype}), {info['params']:,} parameters, "
          f"target_modules {info['target_modules']}, base model "
          f"{info['base_model'] or '(unset)'}; {info['total_s']:.1f}s")
    return 0
  print(f"exported step {info['step']} of {args.ckpt} -> {args.out}: {info['tensors']} tensors "
        f"({args.dtype}), {info['params']:,} parameters, files: {', '.join(info['files'])}; "
        f"{info['total_s']:.1f}s")
  if info["tokenizer"] is None:
    print("note: the run's tokenizer has no Hugging Face files (e.g. a tiktoken file, or a "
          "sentencepiece model Arbor did not train): AutoTokenizer will not load the folder")
  return 0


if __name__ == "__main__":
  sys.exit(main())
