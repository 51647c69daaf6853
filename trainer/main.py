"""Arbor entry point.

    python -m trainer.main --config=configs/NAME.py[:ARG] --config.key=value --workdir=DIR

Start-up, in order (so a bad config fails in seconds, before any device is touched):
  1. `--config.KEY` overrides are checked against the config's fields (a typo names the
     fields that exist there), then absl / ml_collections parse the flags;
  2. `trainer.config.validate`: every field, with the field, the value and the valid choices;
  3. multi-host: `jax.distributed.initialize` from the launcher's contract (docs/design.md §2.3:
     JAX_COORDINATOR_ADDRESS, ARBOR_NUM_PROCESSES, ARBOR_PROCESS_ID) when ARBOR_NUM_PROCESSES > 1,
     with gloo CPU collectives (trainer/distributed.py);
  4. the mesh from `config.mesh` over all devices;
  5. the mode: "sft" (trainer/sft.py), "rl" and "distill" (trainer/rl.py), "eval"
     (trainer/evaluate.py), "serve" (trainer/serve.py's policy server on the config's model),
     "demo" (trainer/demo.py: tokenizer -> SFT -> RL -> held-out eval, per seed; configs/demo.py),
     "reward_model" (trainer/reward_model.py: train and evaluate a reward model;
     configs/reward_model.py) or "smoke" (build the model, one forward/backward, a short greedy decode; configs/smoke.py).
A config error exits with status 2 and one line on stderr naming the field.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from flax import nnx
from ml_collections import config_flags

from models import decode, sharding, transformer
from models.logprobs import token_logprobs
from trainer import config as config_lib
from trainer import demo, distributed, evaluate, reward_model, rl, serve, sft

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (local path or gs://).")


def smoke(config, workdir: str) -> dict:
  """Mode "smoke": builds the model, one forward/backward on random tokens, a short greedy decode.

  Args:
    config: the smoke config (configs/smoke.py: model.preset, batch, seq, decode_tokens).
    workdir: where smoke.json (the summary) is written.

  Returns:
    {"preset", "params", "loss", "grad_norm", "decoded" (the new tokens per prompt)}.
  """
  cfg = config_lib.model_config(config)
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


# ----------------------------------------------------------------------------- start-up


# one start-up path for every mode and for tests (trainer/distributed.py)
initialize_distributed = distributed.initialize


def make_mesh(config):
  """The device mesh of `config.mesh` over all devices.

  Args:
    config: the experiment config (mode "demo": its SFT stage's mesh, shared by the stages).

  Returns:
    The Mesh, one axis per `models.sharding.MESH_AXES`.

  Raises:
    ConfigError: the axes' product does not match the devices, data.rows_per_batch is not
      a multiple of data x fsdp x expert, or data.row_len not a multiple of sequence
      (`trainer.config.mesh_shape`).
  """
  if config.mode == "demo":  # the stages share one mesh: the SFT stage's
    config = config.sft
  shape = config_lib.mesh_shape(config, jax.device_count())
  return sharding.make_mesh(sharding.MeshConfig(**dict(zip(sharding.MESH_AXES, shape))))


def run(config, workdir: str) -> dict:
  """Validates the config, initialises JAX (distributed, compile cache, mesh), runs the mode.

  Args:
    config: the experiment config, overrides applied.
    workdir: the run's --workdir (local path or gs://).

  Returns:
    The mode's summary dict.

  Raises:
    ConfigError: a bad config field, launcher variable or mesh.
  """
  config_lib.validate(config, workdir)
  if config.mode == "smoke":
    return smoke(config, workdir)
  initialize_distributed()
  cache_dir = (config.sft if config.mode == "demo" else config).compile_cache_dir
  if config.mode == "demo" and not cache_dir:
    # the seeds compile the same programs: later seeds (and a resumed demo) load them
    cache_dir = os.path.join(workdir, "xla_cache")
  if cache_dir:
    jax.config.update("jax_compilation_cache_dir", cache_dir)
  mesh = make_mesh(config)
  logging.info("mesh %s on %d devices (%s)", dict(mesh.shape), mesh.size,
               jax.devices()[0].platform)
  # one device: no mesh, so parameters are drawn on the host (no RNG compile) and nothing is
  # placed; the math is the same
  mesh = mesh if mesh.size > 1 else None
  if config.mode == "sft":
    return sft.run(config, workdir, mesh)
  if config.mode in ("rl", "distill"):
    return rl.run(config, workdir, mesh)
  if config.mode == "eval":
    return evaluate.run(config, workdir, mesh)
  if config.mode == "demo":
    return demo.run(config, workdir, mesh)
  if config.mode == "reward_model":
    return reward_model.run(config, workdir, mesh)
  return serve.run(config, workdir)


def _override_keys(argv) -> list[str]:
  return [a[len("--config."):].split("=", 1)[0] for a in argv if a.startswith("--config.")]


def _config_spec(argv) -> str | None:
  """The value of --config in `argv` (None: not given)."""
  spec = None
  for i, a in enumerate(argv):
    if a.startswith("--config="):
      spec = a[len("--config="):]
    elif a == "--config" and i + 1 < len(argv):
      spec = argv[i + 1]
  return spec


def check_config_file(argv) -> None:
  """Checks that --config names an existing file (absl would fail later, less readably).

  Args:
    argv: the command-line arguments, without the program name.

  Raises:
    ConfigError: the file does not exist.
  """
  spec = _config_spec(argv)
  if spec and not os.path.isfile(spec.partition(":")[0]):
    raise config_lib.ConfigError(f"--config={spec}: no such file "
                                 f"{os.path.abspath(spec.partition(':')[0])!r}")


def _load_config_file(argv):
  """The config that --config names (loaded as config_flags will), or None if it cannot be."""
  spec = _config_spec(argv)
  if not spec:
    return None
  path, sep, arg = spec.partition(":")
  if not os.path.isfile(path):
    return None
  module_spec = importlib.util.spec_from_file_location("_arbor_config_precheck", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if sep else module.get_config()


def check_overrides(argv) -> None:
  """Checks that the --config.KEY=VALUE overrides name existing fields.

  Runs before absl parses them: ml_collections would raise an AttributeError with a traceback.

  Args:
    argv: the command-line arguments, without the program name.

  Raises:
    ConfigError: a key names no field of the config file's config.
  """
  keys = _override_keys(argv)
  if keys:
    config = _load_config_file(argv)
    if config is not None:
      config_lib.check_override_keys(config, keys)


def main(argv):
  """The absl main: runs the flags' config; a ConfigError exits with status 2.

  Args:
    argv: the arguments absl left (not used: everything comes in flags).
  """
  del argv
  if not flags.FLAGS["verbosity"].present:  # orbax logs every save at INFO: keep stderr readable
    logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  if config is None:
    raise app.UsageError("--config is required, e.g. --config=configs/sft_demo.py")
  if _WORKDIR.value is None:
    raise app.UsageError("--workdir is required")
  try:
    run(config, _WORKDIR.value)
  except config_lib.ConfigError as e:
    print(f"config error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)


def entry_point() -> None:
  """`python -m trainer.main`: the pre-absl checks of the command line, then `main`."""
  try:
    check_config_file(sys.argv[1:])
    check_overrides(sys.argv[1:])
  except config_lib.ConfigError as e:
    print(f"config error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  app.run(main)


if __name__ == "__main__":
  entry_point()
