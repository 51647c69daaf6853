"""The RL loop (and on-policy distillation): sample episodes in sandboxes, train on them as trees.

    summary = run(config, workdir, mesh)       # trainer.main mode "rl" / "distill"

One step:
  1. rollout   `rl.prompts_per_step` tasks x `rl.group_size` episodes in sandboxes of the
               scaffold `rl.scaffold` draws per task (react, or a black-box CLI through a
               loopback gateway: trainer.blackbox; metrics "pass_rate/<scaffold>")
               (trainer.rollout_sources: in-process engine + asyncio, or remote rollout
               workers through the queue), rewards from the tasks' verifiers; with
               `rl.rollout = "branching"` each task's group is one entropy-guided tree of
               `rl.group_size` leaves (envs.branching); with `rl.reward_model.path` a
               trained reward model (trainer.reward_scoring) scores every episode: reward =
               verifier reward + `rl.reward_model.weight` x its score ("orm"), or for a
               "prm" dense per-call advantages in step 3 (metrics "rm/*"; episode metrics
               such as pass_rate stay the verifier's); with `rl.judge_reward.weight` > 0 an
               LLM judge grades every episode on a rubric (trainer.judge_rewards): reward +=
               weight x its score (metrics "judge/*");
  2. filter    partial groups (an episode failed), stale groups (async: more than
               `rl.max_staleness` policy versions behind), constant-reward groups (no signal);
  3. pack      `rl.advantage` over each group's rewards (rl.advantages; "treerl": per call from
               the group's tree of calls); each group's LLM calls as one tree, trees packed
               into fixed-shape micro-batches (trainer.groups);
  4. score     per-token fields the loss needs beyond the sampler's log-probs ("logprobs",
               also π_old unless `rl.recompute_old`): reference log-probs when
               `loss.kl_coef` > 0, π_old rescored by the trainer (`rl.recompute_old`, MCLA),
               teacher log-probs for distillation (trainer.teachers);
  5. train     `rl.epochs` passes of `rl.minibatches` optimizer updates (trainer.step);
               with `rl.advantage = "gae"` a learned critic (a copy of the initial policy
               with a value head, trainer.critic, sharded like the policy) first adds per-token GAE
               advantages and value targets to the micro-batches and takes one update per
               micro-batch set per epoch (`rl.critic_epochs`, default `rl.epochs`; metrics
               "value_loss", "value_clip_fraction", "value_error"); the
               policy trains only after `rl.critic_warmup_steps` steps;
  6. sync      the new weights to the engine in memory (`Engine.update_params`, no recompile);
  7. checkpoint on schedule (trainer.harness): TrainState (with the policy version), the
               consumed trajectory ids, the queue's unacknowledged entries; the critic's
               state as the run's item "critic" (<workdir>/critic_checkpoints/).

Loops: "sync" samples step s with the weights of step s - 1. "async" keeps the next steps'
rollouts sampling while a step trains (`max(1, rl.max_staleness // rl.minibatches)` steps
ahead); a group with a token more than `rl.max_staleness` versions older than the weights it
would train is dropped.

Resuming is automatic (the latest checkpoint of the workdir): TrainState, the policy version,
the consumed ids; step s always draws the same tasks (trainer.tasks), so a resumed run
continues the task sequence. Trajectories of steps after the last checkpoint are sampled anew
(fresh ids). Every step's metrics line lists its `trajectory_ids`.

Mode "distill" is the same loop with `loss.opd_coef = distill.opd_coef` and teacher log-probs
from the checkpoint of each task's domain expert (`distill.teachers`, "domain=ckpt:<dir>").
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Any, Optional

import jax
import ml_collections
import numpy as np
import optax
from flax import nnx

from models import value_head
from models.engine import Engine
from rl import advantages, corrections
from trainer import batches as batches_lib
from trainer import blackbox
from trainer import config as config_lib
from trainer import critic as critic_lib
from trainer import groups as groups_lib
from trainer import harness, judge_rewards, rollouts
from trainer import reward_scoring
from trainer import state as state_lib
from trainer import step as step_lib
from trainer.rollout_sources import make_source
from trainer.tasks import TaskSource
from trainer.teachers import Teachers

log = logging.getLogger(__name__)

REPORT_KEYS = ("reward_mean", "pass_rate", "loss", "kl", "entropy", "clip_fraction",
               "mismatch_kl_k3", "mismatch_max_abs_log_ratio", "routing_flips", "grad_norm",
               "value_loss", "tree_token_ratio", "response_tokens", "time/*")
CRITIC_ITEM = "critic"  # the critic's checkpoint item (trainer.harness.Run.item)


def loss_config(config: ml_collections.ConfigDict):
  """The run's rl.losses.LossConfig; mode "distill" adds `distill.opd_coef` x OPD."""
  loss_cfg = config_lib.loss_config(config)
  if config.mode == "distill":
    loss_cfg = dataclasses.replace(loss_cfg, opd_coef=float(config.distill.opd_coef))
  return loss_cfg


def reference_model(config: ml_collections.ConfigDict, model_cfg, initial, state):
  """Loads the KL reference policy.

  Args:
    config: the run's config (reads `loss.kl_coef`, `rl.reference`).
    model_cfg: the trained model's ModelConfig.
    initial: the run's initial model, or None when it was not built (a resumed run).
    state: the TrainState; its model stands in for `initial` when that is None.

  Returns:
    None when `loss.kl_coef` is 0; else the run's initial weights (`rl.reference = "initial"`)
    or the model of a checkpoint (`rl.reference = "ckpt:<dir>"`).
  """
  if not config.loss.kl_coef:
    return None
  if config.rl.reference == "initial":
    return initial if initial is not None else state.model(model_cfg)
  sub = ml_collections.ConfigDict(config.to_dict())
  sub.model.init, sub.model.preset = config.rl.reference, ""
  return harness.initial_model(sub, model_cfg)


class Scorer:
  """Step 4: the per-token fields scored by a forward pass (see the module docstring).

  Args:
    config: the run's config.
    model_cfg: the trained model's ModelConfig.
    reference: the KL reference model, or None.
    teachers: the distillation teachers, or None.
    mesh: the device mesh.
    fuse_reference: the train step scores the reference itself (`train_epochs(..., ref=)`), in
      the program of the policy's forward; the scorer leaves it out.
  """

  def __init__(self, config: ml_collections.ConfigDict, model_cfg, reference,
               teachers: Optional[Teachers], mesh=None, fuse_reference: bool = False):
    self.rl, self.teachers = config.rl, teachers
    self.reference = None if fuse_reference else reference
    needed = self.reference is not None or self.rl.recompute_old or self.rl.mcla_passes
    self.score = step_lib.make_score_fn(model_cfg, mesh=mesh) if needed else None

  def __call__(self, state, part: list[list], mb: batches_lib.MicroBatches,
               step_tasks: list) -> batches_lib.MicroBatches:
    """`mb` (packing the groups `part`) with the scored fields added."""
    extra = {}
    if self.reference is not None:  # the reference routes itself: the sampler was the policy
      extra["ref_logprobs"] = np.asarray(jax.device_get(self.score(
          self.reference, mb.replace(expert_ids=None))))
    if self.rl.mcla_passes:
      extra["old_logprobs"] = np.asarray(jax.device_get(step_lib.mcla_logprobs(
          self.score, state, mb, self.rl.mcla_passes, self.rl.mcla_mode)))
    elif self.rl.recompute_old:
      extra["old_logprobs"] = np.asarray(jax.device_get(self.score(state, mb)))
    if self.teachers is not None:
      extra["teacher_logprobs"] = self.teachers.logprobs_of_groups(mb, part, step_tasks)
    return mb.with_fields(**extra) if extra else mb


def train_epochs(train_step, state, mbs: list, epochs: int, ref=None) -> tuple[Any, dict]:
  """Runs `epochs` passes of one optimizer update per micro-batch set.

  Args:
    train_step: `(state, mb) -> (state, metrics)`, as trainer.step.make_train_step returns.
    state: the TrainState to update.
    mbs: the step's MicroBatches, one optimizer update each.
    epochs: passes over `mbs`.
    ref: the KL reference the train step scores itself (None: `mbs` carry ref_logprobs, or
      the loss has no KL term).

  Returns:
    (new state, the updates' metrics averaged).
  """
  step_metrics = []
  for _ in range(epochs):
    for mb in mbs:
      state, m = train_step(state, mb) if ref is None else train_step(state, mb, ref=ref)
      step_metrics.append(jax.device_get(m))
  return state, groups_lib.mean_metrics(step_metrics)


def engine_weights(state, model_cfg):
  """What the engine's weight sync takes (`Engine.update_params`).

  Args:
    state: the TrainState.
    model_cfg: the run's ModelConfig.

  Returns:
    The policy as a Transformer; for a LoRA policy an nnx.State of the variables training
    changes (the adapters and a MoE router's bias): the frozen base is not copied.
  """
  if not model_cfg.lora_rank:
    return state.model(model_cfg)
  light = state_lib.without_base(state, model_cfg)
  return nnx.from_flat_state([*nnx.to_flat_state(nnx.State(light.params)),
                              *nnx.to_flat_state(nnx.State(light.model_state))])


class CriticRun:
  """The learned critic of `rl.advantage` "gae" in the loop: a copy of the initial policy with a
  value head (trainer.critic), its GAE fields on each step's micro-batches and its updates.

  Args:
    config: the run's config (`rl.gae_gamma`, `rl.gae_lambda`, `rl.value_clip`,
      `rl.critic_lr`).
    run: the run's harness; the critic's state is checkpointed as its item `CRITIC_ITEM`.
    state: the run's TrainState as resumed or created (a fresh run's initial policy).

  Raises:
    FileNotFoundError: a resumed checkpoint without the critic's state.
  """

  def __init__(self, config: ml_collections.ConfigDict, run: harness.Run, state):
    self.rl = config.rl
    self.critic = critic_lib.Critic(run.model_cfg, optax.adam(self.rl.critic_lr),
                                    self.rl.value_clip or None, mesh=run.mesh)
    # a fresh run's critic starts from the initial policy's weights (on resume only the shapes
    # matter: the saved state replaces it)
    self.state = self.critic.init(value_head.Critic(nnx.clone(state.model(run.model_cfg))))
    restored = run.item(CRITIC_ITEM, self.state)
    if restored is not None:
      self.state = restored

  def fields(self, mbs: list) -> list:
    """The micro-batches with the per-token "advantage", "returns" and "old_values" of the
    critic's current values (all from the same critic, before this step's updates)."""
    return [self.critic.gae_fields(self.state, mb, self.rl.gae_gamma, self.rl.gae_lambda)
            for mb in mbs]

  def train(self, mbs: list, epochs: int) -> dict:
    """`epochs` passes of one critic update per micro-batch set (each carrying `fields`), as
    the policy makes (PPO fits both on the same batch; the clip stays around the values the
    targets came from); the metrics averaged."""
    step_metrics = []
    for _ in range(epochs):
      for mb in mbs:
        self.state, m = self.critic.step(self.state, mb)
        step_metrics.append(jax.device_get(m))
    return groups_lib.mean_metrics(step_metrics)


def _summary_line(line: dict) -> str:
  nan = float("nan")
  return (f"reward {line.get('reward_mean', nan):.3f}, pass {line.get('pass_rate', nan):.2f}, "
          f"{line['groups_trained']} groups trained"
          + (f", loss {line['loss']:.4f}" if "loss" in line else "")
          + f" (rollout {line.get('time/rollout', 0):.1f}s, train "
          f"{line.get('time/train', 0):.1f}s)")


def run(config: ml_collections.ConfigDict, workdir: str, mesh=None) -> dict:
  """Train (or resume) RL / distillation to `config.train.steps`.

  Args:
    config: a validated mode "rl" or "distill" config.
    workdir: the run's directory (local or gs://).
    mesh: the device mesh (None: one device).

  Returns:
    The harness summary (trainer.harness) plus "reward_first" / "reward_last" (the mean
    rewards of the first and the last step) and "updates_per_step".
  """
  rl_cfg, train = config.rl, config.train
  run = harness.Run(config, workdir, mesh)
  model_cfg = run.model_cfg
  loss_cfg = loss_config(config)
  chat = config_lib.make_chat_format(config, config_lib.tokenizer_source(config, workdir))

  # --- state (this workdir's latest checkpoint, or the initial weights), reference, teachers
  needs_initial = run.restored is None or (loss_cfg.kl_coef and rl_cfg.reference == "initial")
  initial = harness.initial_model(config, model_cfg, mesh) if needs_initial else None
  state = run.resume_or(lambda: initial)
  restored_extra = run.restored.extra if run.restored is not None else {}
  consumed: set[str] = set(restored_extra.get("consumed_ids", ()))
  reference = reference_model(config, model_cfg, initial, state)
  # One update per step: the train step scores the reference in its own program (an
  # independent forward the compiler may overlap with the policy's), instead of a pass before.
  ref_split = state_lib.split_model(reference) if reference is not None else None  # once
  fuse_reference = (reference is not None and rl_cfg.epochs == 1 and
                    jax.tree.structure(ref_split[0]) == jax.tree.structure(state.params))
  scorer = Scorer(config, model_cfg, reference,
                  Teachers(config, mesh) if config.mode == "distill" else None, mesh,
                  fuse_reference=fuse_reference)
  critic = (CriticRun(config, run, state) if rl_cfg.advantage in advantages.CRITIC_ADVANTAGES
            else None)
  rm_cfg = rl_cfg.reward_model
  scorer_rm = reward_scoring.Scorer(rm_cfg.path) if rm_cfg.path else None
  # a PRM's step scores enter the advantages, unless the critic's per-token GAE makes them
  dense_rm = rm_cfg.kind == "prm" and critic is None

  # --- the engine (the policy's weights, updated in memory) and where the groups come from
  version = int(state.policy_version)
  engine = Engine(state.model(model_cfg), rollouts.engine_config(config, model_cfg),
                  detokenize=chat.tokenizer.decode, version=version,
                  mesh=rollouts.engine_mesh(config, mesh))
  judge = judge_rewards.from_config(config, chat, engine, workdir)  # None: weight 0

  def rm_rewards(groups, tasks):
    del tasks
    scored = reward_scoring.outcome_rewards(groups, scorer_rm.groups(groups), rm_cfg.weight,
                                            dense=dense_rm)
    return scored, reward_scoring.score_stats(scored)
  # reward sources beside the verifier, in order: (timer phase, (groups, tasks) -> (groups with
  # the source's term added to each reward, metrics))
  reward_sources = [("reward_model", rm_rewards)] if scorer_rm is not None else []
  if judge is not None:
    reward_sources.append(("judge", judge.rewards))
  source = make_source(config, engine, chat, rollouts.scaffold_config(config),
                       TaskSource(config, workdir), consumed, restored_extra, run.checkpointer)
  train_step = step_lib.make_train_step(
      model_cfg, loss_cfg, run.optimizer, mesh=mesh,
      correction_cfg=corrections.CorrectionConfig(kind=rl_cfg.correction), donate=False)
  shape = batches_lib.BatchShape(row_len=config.data.row_len, rows=config.data.rows_per_batch,
                                 shards=mesh.shape.get("sequence", 1) if mesh else 1,
                                 **groups_lib.step_bounds(rl_cfg))
  # async loops and remote workers sample while the trainer trains: bound their staleness
  overlapped = rl_cfg.loop == "async" or rl_cfg.rollout_workers == "queue"
  replay = bool(rl_cfg.routing_replay and model_cfg.is_moe)  # train through the sampler's experts

  def resume_data() -> dict:
    return {"policy_version": version, "consumed_ids": sorted(consumed),
            **source.checkpoint_extra()}

  def items() -> dict:
    return {CRITIC_ITEM: critic.state} if critic is not None else {}

  run.say(f"{model_cfg.attention} attention, {model_cfg.num_experts or 'no'} experts; "
          f"{rl_cfg.prompts_per_step} tasks x {rl_cfg.group_size} episodes per step, loss "
          f"{loss_cfg.name}, {rl_cfg.loop} loop; steps {run.start + 1}..{train.steps}")
  summary = run.summary
  judge_open = contextlib.closing(judge) if judge is not None else contextlib.nullcontext()
  with contextlib.closing(source), judge_open, run.loop(
      bar_keys=("reward_mean", "pass_rate", "loss")):
    for step in run.steps():
      # 1-2. rollout and filter
      with run.timer.phase("rollout"):
        groups, step_tasks, source_counts = source.take(step, version)
      line: dict[str, Any] = {**groups_lib.episode_stats(groups), **source_counts}
      trained = groups
      for phase, add in reward_sources:
        with run.timer.phase(phase):
          trained, stats = add(trained, step_tasks)
          line.update(stats)
      kept, dropped_groups, dropped = groups_lib.select_groups(
          trained, group_size=rl_cfg.group_size, drop_constant=rl_cfg.drop_constant_groups,
          min_version=version - rl_cfg.max_staleness if overlapped else None,
          consumed=frozenset(consumed))
      line.update(dropped)
      line["groups_trained"] = len(kept)
      line["trajectory_ids"] = [t.trajectory_id for g in kept for t in g]
      line.update(blackbox.scaffold_stats(groups, kept))  # pass_rate/<scaffold>, ...
      if kept:
        # 3-5. pack, score, train
        with run.timer.phase("pack"):
          group_advantages = groups_lib.advantages_of(kept, rl_cfg.advantage)
          if scorer_rm is not None and dense_rm:
            group_advantages = reward_scoring.process_advantages(kept, group_advantages,
                                                                   rm_cfg.weight)
          line.update(groups_lib.segment_stats(kept, group_advantages))
          parts = groups_lib.micro_batches(kept, group_advantages, shape, rl_cfg.minibatches,
                                           replay=replay)
          line.update(groups_lib.batch_stats([mb for _, mb in parts]))
        with run.timer.phase("score"):
          mbs = [scorer(state, part, mb, step_tasks) for part, mb in parts]
        if critic is not None:
          with run.timer.phase("critic"):
            mbs = critic.fields(mbs)
            line.update(critic.train(mbs, rl_cfg.critic_epochs or rl_cfg.epochs))
        # critic warm-up: the policy's first updates read advantages of a fitted critic
        if critic is None or step > rl_cfg.critic_warmup_steps:
          with run.timer.phase("train", tokens=line.get("loss_tokens", 0)):
            state, step_metrics = train_epochs(train_step, state, mbs, rl_cfg.epochs,
                                               ref=ref_split if fuse_reference else None)
            line.update(step_metrics)
      else:
        log.warning("step %d: no group left to train (%s)", step, dropped)
      consumed.update(t.trajectory_id for g in kept + dropped_groups for t in g)
      source.consumed(kept, dropped_groups)
      # 6. sync the engine
      with run.timer.phase("sync"):
        version = int(state.policy_version)
        engine.update_params(engine_weights(state, model_cfg), version)
      line["policy_version"] = version
      line["engine/prefill_tokens"] = engine.counters.get("prefill_tokens", 0)
      times = run.timer.flush()
      line.update(times)
      line["tokens_per_s/rollout"] = line.get("response_tokens", 0) * line.get(
          "episodes", 0) / max(times.get("time/rollout", 0.0), 1e-9)
      summary.setdefault("reward_first", line.get("reward_mean"))
      summary["reward_last"] = line.get("reward_mean")
      if run.should_log(step):
        run.say(f"step {step}: {_summary_line(line)}")
      # 7. checkpoint
      if run.end_step(step, line, state, resume_data, items()):
        break

  summary["updates_per_step"] = rl_cfg.epochs * rl_cfg.minibatches
  run.finish(REPORT_KEYS, f"{config.mode} {os.path.basename(workdir)}")
  run.say(f"steps {run.start + 1}..{summary['steps']} done; reward "
          f"{summary.get('reward_first') or 0:.3f} -> {summary.get('reward_last') or 0:.3f}; "
          f"metrics in {run.logdir}")
  return summary
