"""The learned critic of GAE (`rl.advantages.CRITIC_ADVANTAGES`): state, values, targets, update.

    critic = Critic(model_cfg, optax.adam(1e-5), value_clip=0.2)   # mesh=... to shard it
    cstate = critic.init(value_head.init(model_cfg, seed))   # or value_head.Critic(nnx.clone(policy))
    mb = critic.gae_fields(cstate, mb, gamma=1.0, lam=0.95)  # "advantage", "returns", "old_values"
    cstate, metrics = critic.step(cstate, mb)                # one update of the value loss
    state, metrics = train_step(state, mb)                   # the policy reads the "advantage" field

The critic (`models.value_head.Critic`: a Transformer trunk with a value head) runs on the same
tree-packed micro-batches as the policy. `gae_fields` scores every position once, gathers each
sampled token's state value at its predicting position and runs `rl.advantages.gae` along each
trajectory, so the per-token advantages and value targets are those of the unpacked
trajectories (see `rl.advantages.tree_gae` for why shared prefixes need no merging).
`step` minimises `rl.losses.value_loss` (token mean over every sampled token of all
micro-batches, clipped around the values the targets were computed with), summing the
micro-batches' gradients like the policy's train step. Critic warm-up (train the critic only
for the first steps, so the policy's first advantages come from a fitted critic) is the
caller's choice of which step to run.

On a mesh (`mesh=`) the critic's parameters and Adam moments are sharded by the model's
logical axes and rules like the policy's (`trainer.state.shardings`), the micro-batches' rows
go over the batch axes (`trainer.step.batch_shardings`), and the values come back replicated,
so the GAE fields are host arrays like every other field of the micro-batches. `abstract` and
`compile` give the two programs ahead of time (`trainer.aot`'s "critic" programs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from models import sharding, value_head
from models.config import ModelConfig
from rl import advantages, losses
from rl.batch import gather
from trainer import distributed, optim
from trainer import step as step_lib
from trainer.batches import MicroBatches


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["params", "rest", "opt_state", "step"], meta_fields=[])
@dataclasses.dataclass
class CriticState:
  """The critic's trained parameters, its other variables (e.g. a MoE router bias), the
  optimizer state and the number of updates done."""

  params: Any
  rest: Any
  opt_state: Any
  step: jax.Array


MOMENTS = ("v", "r", "rr", "e", "ee")  # sums over valid tokens: V, R, R², R - V, (R - V)²


def _moments(values: jax.Array, returns: jax.Array, valid: jax.Array) -> dict:
  """The sums `MOMENTS` of one micro-batch's valid tokens (constants: metrics only)."""
  live = valid > 0
  v = jnp.where(live, values, 0.0)
  r = jnp.where(live, returns, 0.0)
  e = r - v
  return jax.lax.stop_gradient({"v": v.sum(), "r": r.sum(), "rr": (r * r).sum(),
                                "e": e.sum(), "ee": (e * e).sum()})


def _fit_metrics(m: dict, n: jax.Array) -> dict:
  """"value_mean", "returns_mean" and "value_explained_variance" 1 - Var(R - V) / Var(R) over
  the valid tokens of all micro-batches (the values before the update: those the targets were
  computed with); 0 where the targets do not vary."""
  var_r = m["rr"] / n - jnp.square(m["r"] / n)
  var_e = m["ee"] / n - jnp.square(m["e"] / n)
  ev = jnp.where(var_r > 1e-8, 1.0 - var_e / jnp.maximum(var_r, 1e-8), 0.0)
  return {"value_mean": m["v"] / n, "returns_mean": m["r"] / n, "value_explained_variance": ev}


class Critic:
  """Values, GAE fields and the value-loss update of a `models.value_head.Critic`.

  Args:
    model_cfg: the critic trunk's ModelConfig (the policy's architecture).
    optimizer: an optax transformation for the critic's parameters.
    value_clip: ε of the clipped value loss, or None (plain squared error).
    mesh: shard the critic (parameters and moments by the model's rules, rows over the batch
      axes); None: one device.
    donate: `step` reuses its input state's buffers for the new state (the input state is
      then deleted); `init` copies the weights it is given, so donating never frees a
      policy's parameters the critic started from.
  """

  def __init__(self, model_cfg: ModelConfig, optimizer: optax.GradientTransformation,
               value_clip: Optional[float] = 0.2, mesh=None, donate: bool = True):
    self.model_cfg, self.optimizer, self.value_clip, self.mesh = (model_cfg, optimizer,
                                                                  value_clip, mesh)
    self.graphdef, params, rest = nnx.split(value_head.abstract(model_cfg), nnx.Param, ...)
    self._shapes = CriticState(params=params, rest=rest,
                               opt_state=jax.eval_shape(optimizer.init, params),
                               step=jax.ShapeDtypeStruct((), jnp.int32))
    self._shardings = None if mesh is None else self._state_shardings(params, rest)
    replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())
    self._values = jax.jit(self._all_values, out_shardings=replicated)
    self._step = jax.jit(self._update, donate_argnums=(0,) if donate else (),
                         out_shardings=None if mesh is None else (self._shardings, replicated))

  def _state_shardings(self, params, rest) -> CriticState:
    """Parameters and the model's other variables by the logical axes, moments like their
    parameters, the step count replicated."""
    param_sh = sharding.state_shardings(params, self.model_cfg, self.mesh)
    # the same leaves in the state's own tree (its moments are nnx.States like the params)
    opt_sh = jax.tree.unflatten(jax.tree.structure(self._shapes.opt_state), jax.tree.leaves(
        optim.tx_state_shardings(self.optimizer, params, param_sh)))
    return CriticState(
        params=param_sh, rest=sharding.state_shardings(rest, self.model_cfg, self.mesh),
        opt_state=opt_sh, step=NamedSharding(self.mesh, PartitionSpec()))

  def init(self, model: value_head.Critic) -> CriticState:
    """The state of a copy of `model`'s weights (placed on the mesh, if any) with a fresh
    optimizer state. `model` must have this critic's architecture."""
    _, params, rest = nnx.split(model, nnx.Param, ...)
    fresh = (params, rest, jnp.zeros((), jnp.int32))
    out = (None if self.mesh is None
           else (self._shardings.params, self._shardings.rest, self._shardings.step))
    with self._placed():
      params, rest, step = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=out)(fresh)
      opt_state = jax.jit(self.optimizer.init, out_shardings=None if self.mesh is None
                          else self._shardings.opt_state)(params)
    return CriticState(params=params, rest=rest, opt_state=opt_state, step=step)

  def abstract(self) -> CriticState:
    """The state's ShapeDtypeStructs (carrying their shardings on a mesh): nothing allocated;
    the template for restoring a checkpoint or compiling ahead of time."""
    if self.mesh is None:
      return self._shapes
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        self._shapes, self._shardings)

  def _placed(self):
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  def _put(self, mb: MicroBatches) -> MicroBatches:
    """The micro-batches with their rows over the mesh's batch axes (as the policy's step)."""
    if self.mesh is None:
      return mb
    return distributed.put(mb, step_lib.batch_shardings(self.model_cfg, self.mesh, mb))

  # --- traced pieces

  def _forward(self, params, rest, mb: MicroBatches) -> jax.Array:
    """[R, L] f32 values of one micro-batch's positions (the critic routes its own experts)."""
    model = nnx.merge(self.graphdef, params, rest)
    values, _ = model(mb.tokens, mb.positions, mb.end, token_weights=mb.token_weights)
    return values

  def _all_values(self, params, rest, mb: MicroBatches) -> jax.Array:
    return jax.lax.map(lambda mb_i: self._forward(params, rest, mb_i), mb)

  def _update(self, state: CriticState, mb: MicroBatches):
    valid = jnp.asarray(mb.seq_valid, jnp.float32)
    # Every sampled token's state is trained (the GAE recursion reads them all), token mean
    # over all micro-batches: the micro-batches' losses and gradients then simply add up.
    total = jnp.maximum(valid.sum(), 1.0)

    def loss_fn(params, mb_i, valid_i):
      values = gather(self._forward(params, state.rest, mb_i), mb_i.seq_pred)
      loss, metrics = losses.value_loss(values, mb_i.fields["returns"], valid_i / total,
                                        mb_i.fields["old_values"], self.value_clip)
      return loss, (metrics, _moments(values, mb_i.fields["returns"], valid_i))

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def body(carry, xs):
      mb_i, valid_i = xs
      (loss, (metrics, moments)), grads = grad_fn(state.params, mb_i, valid_i)
      weight = valid_i.sum()
      loss_sum, grad_sum, metric_sum, moment_sum = carry
      return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads),
              {k: metric_sum[k] + weight * v for k, v in metrics.items()},
              jax.tree.map(jnp.add, moment_sum, moments)), None

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    init = (jnp.zeros((), jnp.float32), zeros,
            {"value_clip_fraction": jnp.zeros(()), "value_error": jnp.zeros(())},
            {k: jnp.zeros(()) for k in MOMENTS})
    (loss, grads, metrics, moments), _ = jax.lax.scan(body, init, (mb, valid))
    updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {k: v / total for k, v in metrics.items()}
    metrics.update(value_loss=loss, value_grad_norm=optax.tree.norm(grads),
                   **_fit_metrics(moments, total))
    return dataclasses.replace(state, params=params, opt_state=opt_state,
                               step=state.step + 1), metrics

  # --- the API

  def values(self, state: CriticState, mb: MicroBatches) -> jax.Array:
    """[M, R, L] f32: the critic's value of every packed position (the state after it);
    replicated on a mesh."""
    with self._placed():
      return self._values(state.params, state.rest, self._put(mb))

  def gae_fields(self, state: CriticState, mb: MicroBatches, gamma: float = 1.0,
                 lam: float = 1.0) -> MicroBatches:
    """`mb` with the per-token fields "advantage" (GAE), "returns" (value targets) and
    "old_values" (the values they were computed with), from the critic's current values and
    the trajectories' "reward" scalars (given at each trajectory's last sampled token).
    On a mesh the fields are host arrays (every process holds them whole).

    Raises:
      ValueError: gamma or lam outside [0, 1] (`rl.advantages.gae`).
    """
    flat = self.values(state, mb)
    if self.mesh is not None:  # replicated: this process's copy is the whole array
      flat = jnp.asarray(np.asarray(flat.addressable_data(0)))
    adv, ret = jax.vmap(advantages.tree_gae, in_axes=(0, 0, 0, 0, None, None))(
        jnp.asarray(mb.scalars["reward"]), flat, jnp.asarray(mb.seq_pred),
        jnp.asarray(mb.seq_valid), gamma, lam)
    old = jnp.where(jnp.asarray(mb.seq_valid), jax.vmap(gather)(flat, jnp.asarray(mb.seq_pred)),
                    0.0)
    return mb.with_fields(advantage=adv, returns=ret, old_values=old)

  def step(self, state: CriticState, mb: MicroBatches) -> tuple[CriticState, dict]:
    """One optimizer update of the value loss on all micro-batches of `mb` (which carries
    `gae_fields`' "returns" and "old_values").

    Returns:
      (the new state, metrics "value_loss", "value_clip_fraction", "value_error",
      "value_grad_norm", and of the values before the update "value_mean", "returns_mean",
      "value_explained_variance").
    """
    with self._placed():
      return self._step(state, self._put(mb))

  def compile(self, state: CriticState, mb: MicroBatches) -> dict[str, tuple[Any, float]]:
    """Compiles the critic's two programs without running them (ahead-of-time compilation).

    Args:
      state: the CriticState or `abstract()`, possibly on a TPU topology's devices.
      mb: MicroBatches, or their ShapeDtypeStructs carrying `trainer.step.batch_shardings`,
        with the fields "returns" and "old_values".

    Returns:
      {"values": (compiled, seconds), "update": (compiled, seconds)}: the scoring pass of
      `gae_fields` and the update of `step`; a program the compiler refuses is given as
      (the `jax.errors.JaxRuntimeError`, seconds).
    """
    out = {}
    with self._placed():
      for name, fn, args in (("values", self._values, (state.params, state.rest, mb)),
                             ("update", self._step, (state, mb))):
        t0 = time.perf_counter()
        try:
          out[name] = (fn.lower(*args).compile(), time.perf_counter() - t0)
        except jax.errors.JaxRuntimeError as e:
          out[name] = (e, time.perf_counter() - t0)
    return out
