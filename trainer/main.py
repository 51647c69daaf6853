"""Arbor entry point: `python -m trainer.main --config=configs/NAME.py[:ARG] --workdir=DIR`.

Until the training loops land, the only mode is `smoke`: build the configured model, run one
forward/backward pass and a short greedy decode, print what happened, and write a summary JSON
to the workdir.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from absl import app, flags, logging
from ml_collections import config_flags

MODES = ("smoke",)

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (local path).")


def model_config(model_cfg):
  """ModelConfig from `config.model`: a preset name plus field overrides (checked by name)."""
  from models.config import ModelConfig
  from models.presets import get_preset
  overrides = dict(model_cfg.get("overrides", {}))
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"config.model.overrides: unknown ModelConfig fields {unknown}; "
                     f"valid fields: {sorted(fields)}")
  return get_preset(model_cfg.preset).replace(**overrides)


def smoke(config, workdir: str) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from models import decode, transformer
  from models.logprobs import token_logprobs

  cfg = model_config(config.model)
  t0 = time.perf_counter()
  model = transformer.init(cfg, seed=config.seed)
  params, rest = nnx.state(model, nnx.Param), nnx.state(model, nnx.Not(nnx.Param))
  n_params = sum(x.size for x in jax.tree.leaves(params))
  print(f"model {config.model.preset}: {cfg.attention} attention, "
        f"{cfg.num_experts or 'no'} experts, {cfg.num_layers} layers, {n_params:,} parameters "
        f"({time.perf_counter() - t0:.1f}s to build)")

  rng = np.random.default_rng(config.seed)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (config.batch, config.seq)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(config.seq, dtype=jnp.int32), tokens.shape)
  end = jnp.full(tokens.shape, config.seq, jnp.int32)
  graphdef = nnx.graphdef(model)

  @jax.jit
  def loss_and_grad(params):
    def loss_fn(params):
      m = nnx.merge(graphdef, params, rest)
      h, aux, _ = m.hidden(tokens, positions, end)
      lp, _ = token_logprobs(h[:, :-1], m.lm_head_weight(), tokens[:, 1:], cfg.logits_chunk)
      return -lp.mean() + aux.get("balance_loss", 0.0), aux
    return jax.value_and_grad(loss_fn, has_aux=True)(params)

  t0 = time.perf_counter()
  (loss, aux), grads = jax.block_until_ready(loss_and_grad(params))
  step_s = time.perf_counter() - t0
  grad_norm = float(jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads))))
  print(f"forward/backward on [{config.batch}, {config.seq}] tokens: loss {float(loss):.4f} "
        f"(uniform would be {np.log(cfg.vocab_size):.4f}), grad norm {grad_norm:.4f}, "
        f"max attention logit {float(aux['max_logits'].max()):.3f} ({step_s:.1f}s incl. compile)")
  if "moe_load" in aux:
    print(f"expert load per MoE layer (fractions): {np.round(np.asarray(aux['moe_load']), 3)}")

  t0 = time.perf_counter()
  prompts = [tokens[0, :8].tolist(), tokens[1 % config.batch, :5].tolist()]
  new, logps = decode.generate(model, prompts, max_new_tokens=config.decode_tokens)
  print(f"greedy decode of {config.decode_tokens} tokens for prompts of length "
        f"{[len(p) for p in prompts]} ({time.perf_counter() - t0:.1f}s incl. compile):")
  for p, n, lp in zip(prompts, new, logps):
    print(f"  {p} -> {n}  (mean log-prob {np.mean(lp):.3f})")
  summary = {"preset": config.model.preset, "params": int(n_params), "loss": float(loss),
             "grad_norm": grad_norm, "decoded": new}
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "smoke.json"), "w") as f:
    json.dump(summary, f, indent=1)
  print(f"wrote {os.path.join(workdir, 'smoke.json')}")
  return summary


def main(argv):
  del argv
  config = _CONFIG.value
  if config is None:
    raise app.UsageError("--config is required, e.g. --config=configs/smoke.py")
  if _WORKDIR.value is None:
    raise app.UsageError("--workdir is required")
  if config.mode not in MODES:
    raise ValueError(f"config.mode={config.mode!r}: expected one of {MODES}")
  logging.info("config:\n%s", config)
  smoke(config, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
