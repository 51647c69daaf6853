"""The train state: everything one training step reads and writes, as one pytree of arrays.

    opt = optim.build(config.optimizer, model_cfg)
    state = create(model_cfg, opt, seed=0, mesh=mesh)   # sharded by the model's logical axes
    model = state.model(model_cfg)                       # an nnx Transformer view (engine, eval)

The model's graph (module structure) is not part of the state: it is rebuilt from the
`ModelConfig` (`graphdef`), so the state holds only arrays and checkpoints as a plain pytree.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from models import lora, sharding, transformer
from models.config import ModelConfig
from trainer import distributed, optim


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["params", "model_state", "opt_state", "step", "rng", "policy_version"],
    meta_fields=[])
@dataclasses.dataclass
class TrainState:
  """Everything one training step reads and writes, as one pytree of arrays.

  Attributes:
    params: pure `nnx.Param` state of the Transformer (fp32); with `ModelConfig.lora_rank`, the
      LoRA adapters (`nnx.LoRAParam`) alone.
    model_state: pure non-Param variables (the MoE `RouterBias`; empty for dense models):
      updated by the step outside the gradient, never seen by the optimizer; with LoRA, also
      the frozen base (qwix-quantized with `ModelConfig.base_qtype`).
    opt_state: `Optimizer.init(params)`.
    step: int32 [], optimizer steps taken.
    rng: uint32 [2], raw key data (`jax.random.wrap_key_data` to use it); the step does not
      consume it: loops (and the train step's LoRA dropout) derive keys with
      `jax.random.fold_in(key, step)`.
    policy_version: int32 [], version of `params`: +1 per optimizer step; the engine stamps
      rollouts with it, and staleness is measured in it.
  """

  params: Any
  model_state: Any
  opt_state: Any
  step: jax.Array
  rng: jax.Array
  policy_version: jax.Array

  def replace(self, **kw) -> "TrainState":
    """A copy with the given fields replaced."""
    return dataclasses.replace(self, **kw)

  def model(self, model_cfg: ModelConfig) -> transformer.Transformer:
    """The parameters as an nnx Transformer (shares the arrays; no copy)."""
    return nnx.merge(graphdef(model_cfg), self.params, self.model_state)

  def key(self) -> jax.Array:
    """The typed PRNG key of `rng`."""
    return jax.random.wrap_key_data(self.rng)


@functools.lru_cache(maxsize=None)
def graphdef(model_cfg: ModelConfig) -> nnx.GraphDef:
  """The Transformer's graph for `model_cfg` (merge it with TrainState.params/model_state)."""
  return nnx.graphdef(transformer.abstract(model_cfg))


def split_model(model: transformer.Transformer, model_cfg: Optional[ModelConfig] = None
                ) -> tuple[Any, Any]:
  """(params, model_state) of an nnx Transformer, both pure states.

  With `lora_rank` (of `model_cfg`, default the model's config), params are the adapters
  (added to a plain model here) and model_state holds the frozen, possibly quantized, base.
  """
  model = transformer.with_adapters(model, model_cfg)
  _, params, rest = nnx.split(model, lora.trainable(model.cfg), ...)
  return nnx.as_pure(params), nnx.as_pure(rest)


def _build(optimizer: Union[optim.Optimizer, Any], model_cfg: ModelConfig
           ) -> optim.Optimizer:
  if isinstance(optimizer, optim.Optimizer):
    return optimizer
  return optim.build(optimizer, model_cfg)


def _scalars(seed: int) -> dict:
  return {"step": jnp.zeros([], jnp.int32), "policy_version": jnp.zeros([], jnp.int32),
          "rng": jax.random.key_data(jax.random.key(seed))}


def create(model_cfg: ModelConfig, optimizer: Union[optim.Optimizer, Any], seed: int = 0,
           mesh: Optional[jax.sharding.Mesh] = None,
           model: Optional[transformer.Transformer] = None) -> TrainState:
  """Creates a fresh train state.

  Args:
    model_cfg: the model's ModelConfig.
    optimizer: a built `trainer.optim.Optimizer`, or its config (built here).
    seed: the initialisation seed (also the state's `rng`).
    mesh: None = default device, parameters drawn on the host (`transformer.init`); a mesh =
      drawn directly sharded (`transformer.init_sharded`: other numbers for the same seed) and the
      optimizer state created with `Optimizer.state_shardings`.
    model: start from these weights (e.g. a Hugging Face import or an SFT checkpoint) instead
      of a random initialisation; placed on `mesh` when one is given.

  Returns:
    The TrainState at step 0, policy version 0.
  """
  opt = _build(optimizer, model_cfg)
  if model is None:
    model = (transformer.init(model_cfg, seed) if mesh is None
             else transformer.init_sharded(model_cfg, mesh, seed))
  params, model_state = split_model(model, model_cfg)
  if mesh is None:
    opt_state = jax.jit(opt.init)(params)
    return TrainState(params=params, model_state=model_state, opt_state=opt_state,
                      **_scalars(seed))
  sh = shardings(model_cfg, opt, mesh)
  # distributed.put: host weights (a `model` given on the host) reach every process's devices
  params, model_state = distributed.put((params, model_state), (sh.params, sh.model_state))
  opt_state = opt.init_sharded(params, sh.params)
  scalars = distributed.put(_scalars(seed), NamedSharding(mesh, PartitionSpec()))
  return TrainState(params=params, model_state=model_state, opt_state=opt_state, **scalars)


def shardings(model_cfg: ModelConfig, optimizer: Union[optim.Optimizer, Any],
              mesh: jax.sharding.Mesh) -> TrainState:
  """Builds the state's shardings on a mesh.

  Parameters and router bias by the model's logical axes and sharding rules, optimizer moments
  like their parameters (`Optimizer.state_shardings`), counters and the key replicated.

  Args:
    model_cfg: the model's ModelConfig.
    optimizer: a built `trainer.optim.Optimizer`, or its config.
    mesh: the device mesh.

  Returns:
    A TrainState of `NamedSharding`s.
  """
  opt = _build(optimizer, model_cfg)
  _, params, rest = nnx.split(transformer.abstract(model_cfg), lora.trainable(model_cfg), ...)
  param_sh = nnx.as_pure(sharding.state_shardings(params, model_cfg, mesh))
  rest_sh = nnx.as_pure(sharding.state_shardings(rest, model_cfg, mesh))
  replicated = NamedSharding(mesh, PartitionSpec())
  abstract_params = nnx.as_pure(params)
  return TrainState(params=param_sh, model_state=rest_sh,
                    opt_state=opt.state_shardings(abstract_params, param_sh),
                    step=replicated, rng=replicated, policy_version=replicated)


def abstract(model_cfg: ModelConfig, optimizer: Union[optim.Optimizer, Any],
             mesh: Optional[jax.sharding.Mesh] = None) -> TrainState:
  """The state's shapes and dtypes, allocating nothing: the target for restoring a checkpoint.

  Args:
    model_cfg: the model's ModelConfig.
    optimizer: a built `trainer.optim.Optimizer`, or its config.
    mesh: None: plain shapes; a mesh: each leaf carries its sharding (`shardings`).

  Returns:
    A TrainState of `jax.ShapeDtypeStruct`s.
  """
  opt = _build(optimizer, model_cfg)
  params, rest = split_model(transformer.abstract(model_cfg))
  shapes = TrainState(params=params, model_state=rest, opt_state=jax.eval_shape(opt.init, params),
                      **jax.eval_shape(lambda: _scalars(0)))
  if mesh is None:
    return shapes
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, shardings(model_cfg, opt, mesh))


@functools.lru_cache(maxsize=None)
def frozen_paths(model_cfg: ModelConfig) -> frozenset:
  """Paths in `TrainState.model_state` of the frozen base (LoRA runs; empty otherwise).

  A LoRA checkpoint leaves them out: the base is rebuilt from the run's `model.init` on
  resume, so a checkpoint holds the adapters, their optimizer state and the router bias.
  """
  if not model_cfg.lora_rank:
    return frozenset()
  _, _, frozen, _ = nnx.split(transformer.abstract(model_cfg), lora.trainable(model_cfg),
                              nnx.Param, ...)
  return frozenset(path for path, _ in nnx.to_flat_state(frozen))


def without_base(state: TrainState, model_cfg: ModelConfig) -> TrainState:
  """The state a checkpoint holds: a LoRA run's TrainState without the frozen base."""
  frozen = frozen_paths(model_cfg)
  if not frozen:
    return state
  kept = [(p, v) for p, v in nnx.to_flat_state(nnx.State(state.model_state)) if p not in frozen]
  return state.replace(model_state=nnx.from_flat_state(kept))


def with_base(state: TrainState, base_state: Any, model_cfg: ModelConfig) -> TrainState:
  """A checkpoint's state (`without_base`) completed with the frozen base of `base_state`.

  Args:
    state: the restored state.
    base_state: the model_state of a fresh state of the same run (`create`).
    model_cfg: the run's ModelConfig.

  Returns:
    The full TrainState.
  """
  frozen = frozen_paths(model_cfg)
  if not frozen:
    return state
  base = [(p, v) for p, v in nnx.to_flat_state(nnx.State(base_state)) if p in frozen]
  return state.replace(model_state=nnx.from_flat_state(
      list(nnx.to_flat_state(nnx.State(state.model_state))) + base))
