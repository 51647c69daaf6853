"""The optimizer: `build` composes the optax chain for a model (package docstring) and returns it
as an `Optimizer` with its routing table and schedule; `metrics` reads the logged scalars."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax
import optax
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from models import sharding
from models.config import ModelConfig
from trainer.optim.config import OptimizerConfig
from trainer.optim.qk_clip import QKClipState, qk_clip
from trainer.optim.routing import Route, format_table, param_suffix, path_names, routing_table
from trainer.optim.schedules import schedule
from trainer.optim.transforms import (ClipState, clip_by_global_norm_with_stats,
                                      scale_by_muon_whole_matrices, scale_by_shape,
                                      with_state_dtype)

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # KellerJordan/Muon quintic (optax's default)


@dataclasses.dataclass(frozen=True)
class Optimizer:
  """What `build` returns: the optax transformation plus its routing and schedule.

  Attributes:
    config: the validated settings.
    model_cfg: the model it was built for.
    tx: the optax transformation (package docstring); `max_logits` is its extra argument.
    table: one `Route` per parameter, in tree order.
    lr_schedule: step -> learning rate (of the Muon branch, or of AdamW).
  """

  config: OptimizerConfig
  model_cfg: ModelConfig
  tx: optax.GradientTransformationExtraArgs
  table: tuple[Route, ...]
  lr_schedule: Callable[[Any], jax.Array]

  def init(self, params):
    """The initial optimizer state for `params` (nnx.State or pure tree)."""
    return self.tx.init(nnx.as_pure(params))

  def update(self, grads, state, params, max_logits=None):
    """One update.

    Args:
      grads: the gradient, summed over micro-batches.
      state: the optimizer state.
      params: the current parameters.
      max_logits: [layers, heads] this step's max attention logits; required with QK-Clip.

    Returns:
      (updates, new state); the updates include the QK-Clip weight change when enabled.

    Raises:
      ValueError: QK-Clip is enabled and `max_logits` is None.
    """
    extra = {} if max_logits is None else {"max_logits": max_logits}
    if self.config.uses_qk_clip and max_logits is None:
      raise ValueError(f"optimizer {self.config.name!r} needs max_logits (aux['max_logits'])")
    return self.tx.update(nnx.as_pure(grads), state, nnx.as_pure(params), **extra)

  def apply(self, grads, state, params, max_logits=None):
    """Runs `update`, then applies the updates.

    Args:
      grads: the gradient, summed over micro-batches.
      state: the optimizer state.
      params: the current parameters (nnx.State or pure tree).
      max_logits: [layers, heads] this step's max attention logits; required with QK-Clip.

    Returns:
      (new params, new state).

    Raises:
      ValueError: QK-Clip is enabled and `max_logits` is None.
    """
    params = nnx.as_pure(params)
    updates, state = self.update(grads, state, params, max_logits)
    return optax.apply_updates(params, updates), state

  def state_shardings(self, params, param_shardings):
    """Shardings for the optimizer state (`tx_state_shardings` of this optimizer's chain)."""
    return tx_state_shardings(self.tx, params, param_shardings)

  def init_sharded(self, params, param_shardings):
    """Creates the initial state directly with `state_shardings` (no unsharded copy).

    Args:
      params: the parameters, already sharded.
      param_shardings: their tree of `jax.sharding.Sharding`.

    Returns:
      The optimizer state, each leaf placed by `state_shardings`.
    """
    params = nnx.as_pure(params)
    shardings = self.state_shardings(params, param_shardings)
    return jax.jit(self.tx.init, out_shardings=shardings)(params)


def tx_state_shardings(tx: optax.GradientTransformation, params, param_shardings):
  """Shardings for the state of any optax transformation of `params`.

  A leaf that is a copy of a parameter (its trailing dict-key path and shape match) gets that
  parameter's sharding; the rest (step counts, norms, Newton–Schulz coefficients) is
  replicated.

  Args:
    tx: the transformation (its `init` is traced for the state's shapes, nothing allocated).
    params: the parameters (concrete or abstract, nnx.State or pure tree).
    param_shardings: the same tree of `jax.sharding.Sharding`.

  Returns:
    A tree of shardings shaped like the state.
  """
  params = nnx.as_pure(params)
  param_shardings = nnx.as_pure(param_shardings)
  by_path = {}
  for (path, x), sh in zip(jax.tree.leaves_with_path(params), jax.tree.leaves(
      param_shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))):
    by_path[path_names(path)] = (tuple(x.shape), sh)
  mesh = next(iter(by_path.values()))[1].mesh
  abstract_state = jax.eval_shape(tx.init, params)

  def one(path, x):
    hit = by_path.get(param_suffix(path))
    if hit is not None and hit[0] == tuple(x.shape):
      return hit[1]
    return NamedSharding(mesh, PartitionSpec())
  return jax.tree_util.tree_map_with_path(one, abstract_state)


def build(cfg: Any, model_cfg: ModelConfig, params: Any = None) -> Optimizer:
  """Builds the optimizer described by `cfg` for `model_cfg`; configuration errors fail here.

  Args:
    cfg: an `OptimizerConfig` or the `config.optimizer` section.
    model_cfg: the model; its parameters' logical axes decide the routing.
    params: optional (concrete, abstract, nnx.State or pure); when given, its paths and shapes
      are checked against the model's.

  Returns:
    The `Optimizer`.

  Raises:
    ValueError: for invalid settings, a parameter no routing rule covers, or `params` that do
      not match the model.
  """
  cfg = OptimizerConfig.from_config(cfg)
  if cfg.uses_qk_clip and model_cfg.lora_rank:
    raise ValueError(f"optimizer.name={cfg.name!r}: QK-Clip rescales the query/key kernels, "
                     "which LoRA freezes (ModelConfig.lora_rank="
                     f"{model_cfg.lora_rank}); use 'muon' or 'adamw'")
  table = routing_table(cfg, model_cfg)
  if params is not None:
    got = {path_names(p): tuple(x.shape) for p, x in jax.tree.leaves_with_path(nnx.as_pure(params))}
    want = {r.path: r.shape for r in table}
    if got != want:
      diff = sorted(set(got.items()) ^ set(want.items()))[:6]
      raise ValueError(f"optimizer: params do not match model config; differing leaves {diff}")
  tx = make_tx(cfg, table, model_cfg)
  return Optimizer(cfg, model_cfg, tx, tuple(table), schedule(cfg))


def make_tx(cfg: Any, table: Sequence[Route], model_cfg: Optional[ModelConfig] = None
            ) -> optax.GradientTransformationExtraArgs:
  """The optax transformation for parameters routed by `table` (package docstring).

  Args:
    cfg: an `OptimizerConfig` or the `config.optimizer` section.
    table: the routes; the transformation accepts any tree whose leaf paths are theirs.
    model_cfg: the model; needed for QK-Clip, and for Muon's whole-matrix layout on a mesh
      (the parameters' sharding rules).

  Returns:
    clip, then AdamW or Muon + AdamW, then (with `*_clip`) QK-Clip, with the state stored in
    `state_dtype`.

  Raises:
    ValueError: QK-Clip is enabled without `model_cfg`.

  References:
    Keller Jordan, "Muon: An optimizer for hidden layers in neural networks", 2024.
    Liu et al., "Muon is Scalable for LLM Training" (Moonlight), arXiv 2502.16982, 2025.
    Kimi Team, "Kimi K2: Open Agentic Intelligence", arXiv 2507.20534, 2025 (MuonClip).
  """
  cfg = OptimizerConfig.from_config(cfg)
  routes = {r.path: r for r in table}
  lr = schedule(cfg)
  decay_mask = _route_fn(routes, lambda r: r.weight_decay)
  if cfg.uses_muon:
    adam_lr = schedule(cfg, cfg.muon.adam_learning_rate)
    labels = _route_fn(routes, lambda r: r.optimizer)
    dims = _route_fn(routes, lambda r: r.dims)
    scales = _route_fn(routes, lambda r: r.scale)
    specs = None if model_cfg is None else lambda tree, mesh: _route_fn(
        routes, lambda r: sharding.param_spec(r.axes, r.shape, model_cfg.sharding_rules, mesh)
    )(tree)
    core = optax.partition({
        "muon": optax.chain(
            scale_by_muon_whole_matrices(NS_COEFFS, cfg.muon.ns_steps, cfg.muon.beta,
                                         cfg.muon.nesterov, dims, specs),
            scale_by_shape(scales),
            optax.add_decayed_weights(cfg.weight_decay),
            optax.scale_by_learning_rate(lr)),
        "adamw": optax.adamw(adam_lr, b1=cfg.b1, b2=cfg.muon.adam_b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, mask=decay_mask),
    }, labels)
  else:
    core = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                       mask=decay_mask)
  parts = [clip_by_global_norm_with_stats(cfg.grad_clip_norm), core]
  if cfg.uses_qk_clip:
    if model_cfg is None:
      raise ValueError(f"optimizer {cfg.name!r}: QK-Clip needs the model config")
    parts.append(qk_clip(model_cfg, cfg.qk_clip.tau, cfg.qk_clip.alpha))
  return with_state_dtype(optax.chain(*parts), cfg.state_dtype)


def _route_fn(routes: dict, value: Callable[[Route], Any]) -> Callable[[Any], Any]:
  """tree -> same-structure tree of value(route) per leaf (looked up by the leaf's path)."""
  def fn(tree):
    def one(path, _):
      key = path_names(path)
      if key not in routes:
        raise ValueError(f"optimizer: parameter {'/'.join(key)} is not in the routing table "
                         "(was the optimizer built for another model config?)")
      return value(routes[key])
    return jax.tree_util.tree_map_with_path(one, tree)
  return fn


def print_table(opt: Optimizer) -> str:
  """Prints and logs (absl) the routing table.

  Args:
    opt: the built optimizer.

  Returns:
    The printed text: a line naming the optimizer, then `format_table(opt.table)`.
  """
  text = (f"optimizer {opt.config.name} (scale rule {opt.config.muon.scale_rule}, "
          f"per-head attention {opt.config.muon.per_head_attention}):\n" + format_table(opt.table))
  print(text, flush=True)
  logging.info("%s", text)
  return text


def metrics(opt: Optimizer, state) -> dict:
  """Scalars for logging, read from the state after an update.

  Args:
    opt: the optimizer that produced `state`.
    state: the optimizer state.

  Returns:
    {"grad_norm": the pre-clip global norm, "lr": the learning rate the update used}, plus with
    QK-Clip {"qk_clipped_heads": heads clipped, "max_logit": the step's largest max logit}.
  """
  out = {}
  clip = _find(state, ClipState)
  if clip is not None:
    out["grad_norm"] = clip.grad_norm
  counts = [x for x in jax.tree.leaves(_find(state, optax.ScaleByScheduleState) or ())]
  if counts:
    out["lr"] = opt.lr_schedule(counts[0] - 1)
  qk = _find(state, QKClipState)
  if qk is not None:
    out["qk_clipped_heads"] = qk.clipped_heads
    out["max_logit"] = qk.max_logit
  return out


def _find(state, kind):
  """The first node of type `kind` in the state tree, or None."""
  for leaf in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kind)):
    if isinstance(leaf, kind):
      return leaf
  return None
