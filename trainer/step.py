"""The jitted train step and the forward-only scoring pass on tree-packed micro-batches.

    opt = optim.build(config.optimizer, model_cfg)
    state = state_lib.create(model_cfg, opt, seed, mesh)
    step = make_train_step(model_cfg, LossConfig(name="cispo"), opt, mesh=mesh)
    score = make_score_fn(model_cfg, mesh=mesh)
    mb = batches.make_micro_batches(groups, shape)
    mb = mb.with_fields(ref_logprobs=score(ref_state, mb))     # when a KL term is configured
    state, metrics = step(state, mb)

One step = one optimizer update on M micro-batches (docs/design.md §3):
  1. global `Counts` over all micro-batches (rl.batch.global_counts), so the masked-sum losses
     of the micro-batches add up to the loss of the whole batch;
  2. `lax.scan` over the micro-batches, each: Transformer.hidden on the tree rows (with the
     logical token counts for MoE load, optional routing replay), sampled-token log-probs
     (models.logprobs.sequence_logprobs: prompt/observation positions never reach the vocab
     projection), `from_tree_batch`, correction weights from the sampler log-probs
     (rl.corrections), `rl.losses.compute`, value_and_grad; gradients and losses SUMMED;
     an all-padding micro-batch is skipped by `lax.cond`;
  3. `optimizer.update(sum of gradients, max_logits = max over micro-batches)` (clipping once,
     QK-Clip), then the aux-loss-free router bias step from the load of all micro-batches,
     weighted by logical token counts.
Steps 1-2 are one jitted function (`TrainStep.gradients`), step 3 another
(`TrainStep.apply_gradients`); the summed gradient stays on device between them (donated to
the update). Why `lax.scan` over micro-batches inside one jit rather than a Python loop over a
compiled micro-step: one compile for all micro-batches (the body is compiled once), no host
round trip per micro-batch, and memory is one micro-batch's activations plus one gradient
accumulator. The price is a fixed micro-batch count per compile, which
`BatchShape.micro_batches` and the skip of padding micro-batches make cheap. Why two jits
rather than one: the update compiles without the model (seconds, not tens of seconds on CPU),
and the gradients can be inspected with no second compile; fusing the last accumulation into
the update would save one pass over a gradient-sized buffer.

Metrics (scalars): loss; the loss's own metrics (clip_fraction, ratio, kl, ...) and the
mismatch metrics (mismatch_kl_k3, ..., when the batch has the sampler's "logprobs") averaged
over micro-batches weighted by their loss tokens (exact for token means; names containing
"max" take the max); num_tokens/num_seqs/num_groups (global counts); max_logit (attention,
over layers and heads); grad_norm (before clipping), lr, qk_clipped_heads (QK-Clip);
param_norm; moe_max_load (largest expert load over the mean, 1 = balanced) and balance_loss
for MoE models; entropy when asked for.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from models import lora, sharding, transformer
from models.config import ModelConfig
from models.logprobs import sequence_logprobs
from rl import corrections, losses
from rl.batch import Counts, global_counts, from_tree_batch
from trainer import distributed, optim
from trainer import state as state_lib
from trainer.batches import MicroBatches
from trainer.state import TrainState

# the micro-batch input checks (trainer/step_inputs.py) are part of this module's API
from trainer.step_inputs import check_micro_batches, required_inputs  # noqa: F401


def _batch_axes(model_cfg: ModelConfig, mesh) -> tuple[Any, int]:
  """The mesh axes of the logical `batch` axis and their total size."""
  spec = sharding.logical_to_spec(("batch",), model_cfg.sharding_rules, mesh)[0]
  names = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
  return spec, math.prod(mesh.shape[a] for a in names)


def batch_shardings(model_cfg: ModelConfig, mesh, mb: MicroBatches) -> MicroBatches:
  """Builds the shardings of a MicroBatches on a mesh.

  Rows [M, R, L] (and expert_ids' R) go over the mesh's batch axes (data, fsdp); per-sequence
  arrays over them too when S divides, else replicated.

  Args:
    model_cfg: the model (its sharding rules name the batch axes).
    mesh: the device mesh.
    mb: the micro-batches (read for shapes and field names).

  Returns:
    A MicroBatches of `NamedSharding`s.

  Raises:
    ValueError: R is not divisible by the size of the batch axes.
  """
  spec, size = _batch_axes(model_cfg, mesh)
  rows = mb.tokens.shape[1]
  if rows % size:
    raise ValueError(f"micro_batches: {rows} rows per micro-batch are not divisible by the "
                     f"mesh's batch axes {spec} of size {size} (BatchShape.rows)")
  on = lambda *s: NamedSharding(mesh, PartitionSpec(*s))
  seq = spec if mb.seq_valid.shape[1] % size == 0 else None
  return MicroBatches(
      tokens=on(None, spec), positions=on(None, spec), end=on(None, spec),
      token_weights=on(None, spec), seq_pred=on(None, seq), seq_tokens=on(None, seq),
      seq_valid=on(None, seq), seq_id=on(None, seq),
      fields={k: on(None, seq) for k in mb.fields}, scalars={k: on(None, seq) for k in mb.scalars},
      expert_ids=None if mb.expert_ids is None else on(None, None, spec))


# ----------------------------------------------------------------------------- forward


def _forward(graphdef, model_cfg: ModelConfig, params, model_state, mb: MicroBatches,
             dropout_key: Optional[jax.Array] = None, entropy: bool = True):
  """One micro-batch: (log-probs [S, T], entropy [S, T] or None without `entropy`, aux) of the
  sampled tokens; with a `dropout_key`, LoRA dropout on (`ModelConfig.lora_dropout`: training
  only)."""
  model = nnx.merge(graphdef, params, model_state)
  if dropout_key is not None:
    lora.set_dropout_streams(model, dropout_key)
  hidden, aux, _ = model.hidden(mb.tokens, mb.positions, mb.end, token_weights=mb.token_weights,
                                expert_ids=mb.expert_ids)
  lp, ent = sequence_logprobs(hidden, model.lm_head_weight(), mb.seq_pred, mb.seq_tokens,
                              model_cfg.logits_chunk, model_cfg, entropy)
  return lp, ent, aux


def _is_real(mb: MicroBatches) -> jax.Array:
  """[M] bool: micro-batches with a valid sequence entry or a real token (others are padding)."""
  return jnp.asarray(mb.seq_valid).any((1, 2)) | (jnp.asarray(mb.token_weights).sum((1, 2)) > 0)


def _scan_real(fn: Callable, mb: MicroBatches, init, combine, out_shape):
  """Fold `combine(carry, fn(mb_i, i), real_i)` over micro-batches i; on padding micro-batches
  fn is skipped and its output is zeros of `out_shape` (a tree of ShapeDtypeStructs)."""
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)

  def body(carry, xs):
    mb_i, real_i, i = xs
    out = jax.lax.cond(real_i, fn, lambda *_: zeros, mb_i, i)
    return combine(carry, out, real_i), None

  real = _is_real(mb)
  return jax.lax.scan(body, init, (mb, real, jnp.arange(real.shape[0])))[0]


def _source(source) -> tuple[Any, Any]:
  """(params, model_state) of a TrainState, an nnx Transformer or a (params, model_state) pair."""
  if isinstance(source, TrainState):
    return source.params, source.model_state
  if isinstance(source, transformer.Transformer):
    return state_lib.split_model(source)
  params, model_state = source
  return params, model_state


def _placed(mesh, fn: Callable) -> Callable:
  """fn run with `mesh` set (activation sharding constraints), or as is without a mesh."""
  def run(*args):
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
      return fn(*args)
  return run


# ----------------------------------------------------------------------------- score


def make_score_fn(model_cfg: ModelConfig, *, mesh=None, entropy: bool = False) -> Callable:
  """Builds a jitted forward-only pass over micro-batches.

  Uses: the reference policy's log-probs (KL), π_old recomputed by the trainer (instead of
  trusting the sampler's), teacher log-probs (distillation), and MCLA (`mcla_logprobs`). The
  routing replay in `expert_ids`, if any, is used.

  Args:
    model_cfg: the scored model's ModelConfig (a teacher with another config gets its own score
      function).
    mesh: shard the pass (rows over the batch axes); None: one device.
    entropy: also return the policy entropy.

  Returns:
    score(source, micro_batches) -> log-probs [M, S, T] f32 of every sampled token (0 at padding
    entries), or (log-probs, entropy [M, S, T]) with `entropy`. source: a TrainState, an nnx
    Transformer or a (params, model_state) pair with `model_cfg`. `score.lower(source,
    micro_batches)` lowers the same pass without running it (abstract inputs accepted).
  """
  graphdef = state_lib.graphdef(model_cfg)

  def one(params, model_state, mb):
    lp, ent, _ = _forward(graphdef, model_cfg, params, model_state, mb, entropy=entropy)
    valid = jnp.asarray(mb.seq_valid)
    return jnp.where(valid, lp, 0.0), None if ent is None else jnp.where(valid, ent, 0.0)

  @jax.jit
  def score_all(params, model_state, mb):
    # lax.map over micro-batches; padding micro-batches are skipped (zeros)
    real = _is_real(mb)
    first = jax.tree.map(lambda x: x[0], mb)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                         jax.eval_shape(one, params, model_state, first))
    return jax.lax.map(lambda xs: jax.lax.cond(
        xs[1], lambda m: one(params, model_state, m), lambda m: zeros, xs[0]), (mb, real))

  def score(source, mb: MicroBatches):
    check_micro_batches(mb, model_cfg)
    params, model_state = _source(source)
    if mesh is not None:
      mb = distributed.put(mb, batch_shardings(model_cfg, mesh, mb))
    lp, ent = _placed(mesh, score_all)(params, model_state, mb)
    return (lp, ent) if entropy else lp

  def lower(source, mb: MicroBatches):
    """The pass lowered without running it, for (possibly abstract) source and micro-batches."""
    check_micro_batches(mb, model_cfg)
    params, model_state = _source(source)
    return _placed(mesh, score_all.lower)(params, model_state, mb)

  score.lower = lower
  return score


def mcla_logprobs(score: Callable, source, mb: MicroBatches, passes: int,
                  mode: str = "logprob") -> jax.Array:
  """MCLA: `passes` scoring passes combined by `rl.corrections.mcla_average`.

  The passes differ only where the backend is nondeterministic (kernels, reduction order, MoE
  routing near ties); on a deterministic backend they are identical.

  Args:
    score: a score function of `make_score_fn`.
    source: the scored model (TrainState, nnx Transformer or (params, model_state)).
    mb: the micro-batches.
    passes: K >= 1 scoring passes.
    mode: how `mcla_average` combines the passes: "logprob" (mean of log-probs) or "prob"
      (log of the mean probability).

  Returns:
    [M, S, T] f32 combined log-probs.

  Raises:
    ValueError: `passes` < 1.

  References:
    KAT-Coder-V2, arXiv 2603.27703 (MCLA).
  """
  if passes < 1:
    raise ValueError(f"mcla passes={passes!r}: must be >= 1")
  runs = jnp.stack([score(source, mb) for _ in range(passes)])   # [K, M, S, T]
  k, m, s, t = runs.shape
  return corrections.mcla_average(runs.reshape(k, m * s, t), mode).reshape(m, s, t)


# ----------------------------------------------------------------------------- train step


def _counts(mb: MicroBatches, loss_cfg: losses.LossConfig) -> Counts:
  """Global counts over all micro-batches (sequences of all of them as one batch)."""
  mask = jnp.asarray(mb.seq_valid, jnp.float32) * mb.fields["loss_mask"]
  if loss_cfg.mask_failed_turns:  # error-masked SFT normalises by the tokens actually trained
    mask = mask * (1.0 - mb.fields["failed"])
  m, s, t = mask.shape
  return global_counts(mask.reshape(m * s, t), mb.scalars["group"].reshape(m * s))


def _combine_metrics(total: dict, new: dict, weight: jax.Array, real: jax.Array) -> dict:
  out = {}
  for k, v in new.items():
    if "max" in k:
      out[k] = jnp.maximum(total[k], jnp.where(real, v, -jnp.inf))
    else:
      out[k] = total[k] + weight * v
  return out


class TrainStep:
  """What `make_train_step` returns: `step(state, micro_batches) -> (state, metrics)`.

  `gradients(state, micro_batches) -> (loss, grads, metrics)` runs the same accumulation
  without the update (tests, debugging, gradient-noise measurements).

  Args:
    model_cfg: the trained model's ModelConfig.
    loss_cfg: the loss (checked here).
    optimizer: a built `trainer.optim.Optimizer` (or its config, built here).
    correction_cfg: the mismatch correction, or None (see `make_train_step`).
    mesh: the device mesh, or None for one device.
    entropy: compute the policy entropy metric.
    donate: reuse the input state's buffers for the output.

  Raises:
    ValueError: a bad LossConfig or a correction_cfg that is not a CorrectionConfig.
  """

  def __init__(self, model_cfg: ModelConfig, loss_cfg: losses.LossConfig,
               optimizer: optim.Optimizer, *,
               correction_cfg: Optional[corrections.CorrectionConfig] = None, mesh=None,
               entropy: bool = False, donate: bool = True):
    losses.check_config(loss_cfg)
    if correction_cfg is not None and not isinstance(correction_cfg,
                                                     corrections.CorrectionConfig):
      raise ValueError(f"correction_cfg: expected rl.corrections.CorrectionConfig, got "
                       f"{type(correction_cfg).__name__}")
    if not isinstance(optimizer, optim.Optimizer):
      optimizer = optim.build(optimizer, model_cfg)
    self.model_cfg, self.loss_cfg, self.optimizer = model_cfg, loss_cfg, optimizer
    self.correction_cfg, self.mesh, self.entropy = correction_cfg, mesh, entropy
    self.graphdef = state_lib.graphdef(model_cfg)
    self._state_shardings = None if mesh is None else state_lib.shardings(model_cfg, optimizer,
                                                                         mesh)
    self._gradients = jax.jit(self._accumulate)
    out = None if mesh is None else (self._state_shardings, None)
    self._apply = jax.jit(self._update, donate_argnums=(0, 1) if donate else (),
                          out_shardings=out)

  # --- the pieces (traced)

  def _micro_loss(self, params, model_state, mb: MicroBatches, counts: Counts,
                  row_scale: jax.Array, dropout_key: Optional[jax.Array]):
    """Loss of one micro-batch (a masked sum normalised by the global counts) and its aux."""
    cfg, loss_cfg = self.model_cfg, self.loss_cfg
    # the entropy bonus and AEPO's entropy-aware advantage read the policy's token entropy
    use_entropy = (self.entropy or loss_cfg.entropy_coef > 0
                   or (loss_cfg.get("entropy_adv_coef") or 0) > 0)
    lp, ent, aux = _forward(self.graphdef, cfg, params, model_state, mb, dropout_key,
                            entropy=use_entropy)
    seq = from_tree_batch(mb, lp, ent, counts=counts)
    metrics = {}
    if seq.sampler_logprobs is not None:
      if self.correction_cfg is not None and self.correction_cfg.kind != "none":
        # the correction weighs the trainer's π_old (rescored), else the current π_θ
        train = seq.old_logprobs if seq.old_logprobs is not None else jax.lax.stop_gradient(lp)
        weights, m = corrections.apply(self.correction_cfg, train, seq.sampler_logprobs,
                                       seq.mask, seq.advantages)
        seq = seq.replace(weights=weights)
      else:  # the sampler against the policy trained (π_old may be the sampler's own copy)
        m = corrections.mismatch_metrics(jax.lax.stop_gradient(lp), seq.sampler_logprobs,
                                         seq.mask)
      metrics.update(m)
    if "replay_flips" in aux:  # share of replayed (token, MoE layer) pairs routed differently
      flips = aux["replay_flips"]
      metrics["routing_flips"] = flips[..., 0].sum() / jnp.maximum(flips[..., 1].sum(), 1.0)
    loss, loss_metrics = losses.compute(seq, loss_cfg)
    metrics.update(loss_metrics)
    if self.entropy:
      live = seq.mask > 0
      metrics["entropy"] = jax.lax.stop_gradient(
          jnp.where(live, ent, 0.0).sum() / jnp.maximum(live.sum(), 1))
    if cfg.is_moe and cfg.seq_balance_coef > 0:  # outside the tree contract (design §3)
      balance = aux["balance_loss"] * row_scale
      loss = loss + balance
      metrics["balance_loss"] = jax.lax.stop_gradient(balance)
    return loss, (metrics, aux)

  def _accumulate(self, params, model_state, mb: MicroBatches, rng: jax.Array, step: jax.Array,
                  ref=None):
    """(loss, summed gradients, metrics, max_logits [layers, heads], load [moe_layers, E]);
    `rng` / `step` (the TrainState's) seed LoRA dropout, per step and micro-batch; `ref`, a
    (params, model_state) pair of the policy's graph, scores each micro-batch's
    `ref_logprobs` in the same program (its forward is independent of the policy's, so the
    compiler may overlap the two)."""
    key = (jax.random.fold_in(jax.random.wrap_key_data(rng), step)
           if self.model_cfg.lora_rank and self.model_cfg.lora_dropout > 0 else None)
    counts = _counts(mb, self.loss_cfg)
    rows_real = (jnp.asarray(mb.token_weights).sum(-1) > 0).sum()
    # the per-row balance loss: a mean over the real rows of all micro-batches
    row_scale = mb.tokens.shape[1] / jnp.maximum(rows_real, 1).astype(jnp.float32)
    grad_fn = jax.value_and_grad(self._micro_loss, has_aux=True)

    def one(mb_i, i):
      key_i = None if key is None else jax.random.fold_in(key, i)
      if ref is not None:  # the reference routes itself: the sampler was the policy
        ref_lp, _, _ = _forward(self.graphdef, self.model_cfg, *ref, mb_i.replace(expert_ids=None),
                                entropy=False)
        ref_lp = jnp.where(jnp.asarray(mb_i.seq_valid), jax.lax.stop_gradient(ref_lp), 0.0)
        mb_i = mb_i.replace(fields={**mb_i.fields, "ref_logprobs": ref_lp})
      (loss, (metrics, aux)), grads = grad_fn(params, model_state, mb_i, counts, row_scale,
                                              key_i)
      if self._state_shardings is not None:  # reduce-scattered to the FSDP shards, not summed
        grads = jax.lax.with_sharding_constraint(grads, self._state_shardings.params)
      weight = (jnp.asarray(mb_i.seq_valid) * mb_i.fields["loss_mask"]).sum()
      out = {"loss": loss, "grads": grads, "metrics": metrics, "weight": weight,
             "max_logits": aux["max_logits"]}
      if "moe_load" in aux:  # shares -> logical assignment counts (÷ k), summed below
        out["load"] = aux["moe_load"] * jnp.asarray(mb_i.token_weights).sum()
        out["load_weight"] = jnp.asarray(mb_i.token_weights).sum()
      return out

    first = jax.eval_shape(one, jax.tree.map(lambda x: x[0], mb), 0)
    init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), first)
    if self._state_shardings is not None:
      init["grads"] = jax.lax.with_sharding_constraint(init["grads"], self._state_shardings.params)
    init["max_logits"] = jnp.full(first["max_logits"].shape, -jnp.inf, jnp.float32)
    init["metrics"] = {k: jnp.full(s.shape, -jnp.inf if "max" in k else 0.0, s.dtype)
                       for k, s in first["metrics"].items()}

    def combine(total, out, real):
      new = {k: total[k] + out[k] for k in ("loss", "weight") + (
          ("load", "load_weight") if "load" in out else ())}
      new["grads"] = jax.tree.map(jnp.add, total["grads"], out["grads"])
      new["max_logits"] = jnp.maximum(total["max_logits"],
                                      jnp.where(real, out["max_logits"], -jnp.inf))
      new["metrics"] = _combine_metrics(total["metrics"], out["metrics"], out["weight"], real)
      return new

    total = _scan_real(one, mb, init, combine, first)
    metrics = {k: v if "max" in k else v / jnp.maximum(total["weight"], 1.0)
               for k, v in total["metrics"].items()}
    metrics.update(loss=total["loss"], num_tokens=counts.num_tokens, num_seqs=counts.num_seqs,
                   num_groups=counts.num_groups, max_logit=total["max_logits"].max())
    load = None
    if "load" in total:
      load = total["load"] / jnp.maximum(total["load_weight"], 1e-9)
      metrics["moe_max_load"] = (load.max(-1) / jnp.maximum(load.mean(-1), 1e-9)).max()
    return total["loss"], total["grads"], metrics, total["max_logits"], load

  def _update(self, state: TrainState, grads, max_logits: jax.Array,
              load: Optional[jax.Array]):
    """The optimizer step on the summed gradient, then the router bias step."""
    cfg, opt = self.model_cfg, self.optimizer
    updates, opt_state = opt.update(grads, state.opt_state, state.params,
                                    max_logits if opt.config.uses_qk_clip else None)
    params = optax.apply_updates(state.params, updates)
    model_state = state.model_state
    if load is not None and cfg.router_bias:  # aux-loss-free balancing, outside the gradient
      model = nnx.merge(self.graphdef, params, model_state)
      model.update_router_bias(load)
      model_state = state_lib.split_model(model)[1]
    metrics = optim.metrics(opt, opt_state)
    metrics["param_norm"] = optax.tree.norm(params)
    new = state.replace(params=params, model_state=model_state, opt_state=opt_state,
                        step=state.step + 1, policy_version=state.policy_version + 1)
    return new, metrics

  # --- the calls

  def _prepare(self, state: TrainState, mb: MicroBatches, ref=None):
    check_micro_batches(mb, self.model_cfg, self.loss_cfg, self.correction_cfg,
                        computed=("ref_logprobs",) if ref is not None else ())
    if ref is not None:
      ref = _source(ref)
      if ref[0] is not None and jax.tree.structure(ref[0]) != jax.tree.structure(state.params):
        raise ValueError("ref: the reference must have the policy's architecture (score a "
                         "different model with make_score_fn into mb.fields['ref_logprobs'])")
    if self.mesh is not None:  # every process holds the whole batch (distributed.put)
      mb = distributed.put(mb, batch_shardings(self.model_cfg, self.mesh, mb))
      state = distributed.put(state, self._state_shardings)
      if ref is not None:
        ref = distributed.put(ref, (self._state_shardings.params,
                                    self._state_shardings.model_state))
    else:  # committed to the device, as the step's outputs are: one compile serves every step
      state, ref = sharding.commit((state, ref), jax.devices()[0])
    return state, mb, ref

  def __call__(self, state: TrainState, micro_batches: MicroBatches, ref=None
               ) -> tuple[TrainState, dict]:
    """One optimizer step on the micro-batches.

    Args:
      state: the TrainState (donated when the step donates).
      micro_batches: the step's MicroBatches.
      ref: the KL reference (a TrainState, an nnx Transformer or a (params, model_state) pair
        with the policy's architecture): its log-probs are computed inside the step instead of
        read from `micro_batches.fields["ref_logprobs"]`. None: the field is used.

    Returns:
      (new state, metrics).
    """
    state, mb, ref = self._prepare(state, micro_batches, ref)
    _, grads, metrics, max_logits, load = _placed(self.mesh, self._gradients)(
        state.params, state.model_state, mb, state.rng, state.step, ref)
    state, opt_metrics = _placed(self.mesh, self._apply)(state, grads, max_logits, load)
    # QK-Clip's own max_logit equals ours: the max of max_logits over micro-batches
    return state, {**metrics, **opt_metrics}

  def compile(self, state: TrainState, micro_batches: MicroBatches
              ) -> dict[str, tuple[Any, float]]:
    """Compiles the step's two programs without running them (ahead-of-time compilation).

    Args:
      state: the TrainState, or its `jax.ShapeDtypeStruct`s (`state.abstract(..., mesh)`),
        possibly on the devices of a TPU topology this machine does not have.
      micro_batches: MicroBatches, or their ShapeDtypeStructs carrying `batch_shardings`.

    Returns:
      {"gradients": (compiled, seconds), "update": (compiled, seconds)}: the accumulation and
      the optimizer update as `__call__` runs them (`jax.stages.Compiled`, compile time); the
      update's gradient inputs take the shardings the compiled accumulation gives them. A
      program the compiler refuses (`jax.errors.JaxRuntimeError`, e.g. out of memory) is
      given as (the error, seconds), and the programs after it are not compiled.
    """
    check_micro_batches(micro_batches, self.model_cfg, self.loss_cfg, self.correction_cfg)
    out = {}
    with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
      t0 = time.perf_counter()
      try:
        grads_fn = self._gradients.lower(state.params, state.model_state, micro_batches,
                                         state.rng, state.step, None).compile()
      except jax.errors.JaxRuntimeError as e:
        return {"gradients": (e, time.perf_counter() - t0)}
      out["gradients"] = (grads_fn, time.perf_counter() - t0)
      _, grads, _, max_logits, load = jax.eval_shape(
          self._gradients, state.params, state.model_state, micro_batches, state.rng,
          state.step, None)
      if self.mesh is not None:
        shardings = grads_fn.output_shardings
        grads, max_logits, load = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            (grads, max_logits, load), (shardings[1], shardings[3], shardings[4]))
      t0 = time.perf_counter()
      try:
        out["update"] = (self._apply.lower(state, grads, max_logits, load).compile(),
                         time.perf_counter() - t0)
      except jax.errors.JaxRuntimeError as e:
        out["update"] = (e, time.perf_counter() - t0)
    return out

  def gradients(self, state: TrainState, micro_batches: MicroBatches
                ) -> tuple[jax.Array, Any, dict]:
    """Runs the step's accumulation without the update.

    Args:
      state: the TrainState.
      micro_batches: the step's MicroBatches (checked first).

    Returns:
      (loss, gradients summed over micro-batches (a params pytree), metrics).
    """
    state, mb, _ = self._prepare(state, micro_batches)
    # the same arguments as __call__ without a reference: one compiled program for both
    loss, grads, metrics, _, _ = _placed(self.mesh, self._gradients)(
        state.params, state.model_state, mb, state.rng, state.step, None)
    return loss, grads, metrics

  def apply_gradients(self, state: TrainState, grads, max_logits: jax.Array,
                      load: Optional[jax.Array] = None) -> tuple[TrainState, dict]:
    """Runs the update half of the step.

    The optimizer on `grads`, then the router bias step from `load`.

    Args:
      state: the TrainState (donated when the step donates).
      grads: the gradients summed over micro-batches, as `gradients` returns them.
      max_logits: [layers, heads] f32 max attention logits, for QK-Clip.
      load: [moe_layers, experts] expert shares of the logical tokens (None: no router bias step).

    Returns:
      (new state, optimizer metrics: grad_norm, lr, qk_clipped_heads, param_norm, ...).
    """
    if self.mesh is not None:
      state = distributed.put(state, self._state_shardings)
      grads = distributed.put(grads, self._state_shardings.params)
    return _placed(self.mesh, self._apply)(state, grads, max_logits, load)


def make_train_step(model_cfg: ModelConfig, loss_cfg: losses.LossConfig,
                    optimizer: Union[optim.Optimizer, Any], *,
                    correction_cfg: Optional[corrections.CorrectionConfig] = None,
                    mesh=None, entropy: bool = False, donate: bool = True) -> TrainStep:
  """Builds the jitted train step `step(state, micro_batches) -> (new state, metrics)`.

  See the module docstring. Compiles on the first call and once per distinct micro-batch
  shape/field set. Inputs are checked before tracing; errors name the missing or misshapen field.

  Args:
    model_cfg: the trained model's ModelConfig.
    loss_cfg: the loss (checked here).
    optimizer: a built `trainer.optim.Optimizer` (or its config).
    correction_cfg: the mismatch correction whose weights multiply the loss terms (needs the
      sampler's "logprobs"); None: none.
    mesh: shard the step (state by the logical axes, rows over the data axes); None: one device.
    entropy: compute the policy entropy metric (the entropy bonus, `entropy_coef`, turns it on
      anyway).
    donate: reuse the input state's buffers for the output (the input state is invalid
      afterwards).

  Returns:
    The TrainStep.

  Raises:
    ValueError: a bad LossConfig or correction_cfg.
  """
  return TrainStep(model_cfg, loss_cfg, optimizer, correction_cfg=correction_cfg, mesh=mesh,
                   entropy=entropy, donate=donate)
