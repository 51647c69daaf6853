"""The RL loop (and on-policy distillation): sample episodes in sandboxes, train on them as trees.

    summary = run(config, workdir, mesh)       # trainer.main --config=configs/demo.py (mode "rl")

One step:
  1. rollout  `rl.prompts_per_step` tasks x `rl.group_size` react episodes in sandboxes
              (trainer.rollouts: in-process engine + asyncio), rewards from the tasks' verifiers;
  2. filter   partial groups (an episode failed), stale groups (async: more than
              `rl.max_staleness` policy versions behind), constant-reward groups (no signal);
  3. advantage `rl.advantage` over each group's rewards (rl.advantages);
  4. pack     each group's LLM calls as one tree, trees packed into fixed-shape micro-batches
              (trainer.batches); per-token fields: the sampler's log-probs ("logprobs", also
              π_old unless `rl.recompute_old`), reference log-probs when `loss.kl_coef` > 0,
              teacher log-probs for distillation;
  5. train    `rl.epochs` passes of `rl.minibatches` optimizer updates (trainer.step);
  6. sync     the new weights to the engine in memory (`Engine.update_params`, no recompile);
  7. checkpoint on schedule: TrainState (with the policy version) + the consumed trajectory ids.

Loops: "sync" samples step s with the weights of step s - 1. "async" keeps the next steps'
rollouts sampling while a step trains (`max(1, rl.max_staleness)` steps ahead); a group with a
token more than `rl.max_staleness` versions older than the weights it would train is dropped.

Resuming is automatic (the latest checkpoint of the workdir): TrainState, the policy version,
the consumed ids; step s always draws the same tasks (positions (s-1)·P .. of the taskgen
"train" split of rl.task_seed), so a
resumed run continues the task sequence. Trajectories of steps after the last checkpoint are
sampled anew (fresh ids). Every step's metrics line lists its `trajectory_ids`.

Mode "distill" is the same loop with `loss.opd_coef = distill.opd_coef` and teacher log-probs
from the checkpoint of each task's domain expert (`distill.teachers`, "domain=ckpt:<dir>").
"""

from __future__ import annotations

import collections
import logging
import os
import tempfile
import time
import warnings
from typing import Any, Optional

import jax
import ml_collections
import numpy as np

from trainer import config as config_lib

log = logging.getLogger(__name__)

REPORT_KEYS = ("reward_mean", "pass_rate", "loss", "kl", "entropy", "clip_fraction",
               "mismatch_kl_k3", "grad_norm", "tree_token_ratio", "response_tokens",
               "time/*")


def _say(message: str) -> None:
  if jax.process_index() == 0:
    print(f"rl: {message}", flush=True)


# ----------------------------------------------------------------------------- tasks


class TaskSource:
  """The tasks of step s: generated (envs.taskgen, level/seed from config.rl) or a task file,
  taken in order, `prompts_per_step` per step (cycling through a file)."""

  def __init__(self, config, workdir: str):
    self.rl = config.rl
    self.per_step = config.rl.prompts_per_step
    self._file: Optional[list] = None
    self._dir = os.path.join(workdir, "tasks") if not config_lib.is_remote(workdir) else (
        tempfile.mkdtemp(prefix="arbor-rl-tasks-"))
    if config.rl.tasks:
      from envs.rollout_worker import load_task_file
      self._file = load_task_file(config.rl.tasks)[0]
      if not self._file:
        raise config_lib.ConfigError(f"config.rl.tasks={config.rl.tasks!r}: no tasks")

  def for_step(self, step: int) -> list:
    start = (step - 1) * self.per_step
    if self._file is not None:
      return [self._file[(start + j) % len(self._file)] for j in range(self.per_step)]
    from envs.taskgen import write_tasks
    out = os.path.join(self._dir, f"step_{step}")
    return write_tasks(out, self.per_step, self.rl.task_level, self.rl.task_seed, start,
                       split="train")


def held_out_tasks(config, directory: str) -> list:
  """The eval tasks: the first `eval.num_tasks` of config.eval.tasks, or that many generated
  tasks with distinct programs from the "eval" split of envs.taskgen (level rl.task_level,
  seed rl.task_seed): programs that no generated training task (SFT demo or RL) has."""
  if config.eval.tasks:
    from envs.rollout_worker import load_task_file
    return load_task_file(config.eval.tasks)[0][:config.eval.num_tasks]
  from envs.taskgen import write_tasks
  return write_tasks(directory, config.eval.num_tasks, config.rl.task_level,
                     config.rl.task_seed, split="eval", unique=True)


# ----------------------------------------------------------------------------- rollouts -> batch


def episode_stats(groups: list[list]) -> dict:
  """Rollout metrics of a step's groups (before filtering)."""
  trajs = [t for g in groups for t in g]
  if not trajs:
    return {"episodes": 0}
  rewards = np.array([t.reward for t in trajs], np.float64)
  sampled = np.array([sum(len(c.output_ids) for c in t.calls) for t in trajs], np.float64)
  context = np.array([len(t.calls[-1].input_ids) + len(t.calls[-1].output_ids) if t.calls else 0
                      for t in trajs], np.float64)
  out = {"episodes": len(trajs), "reward_mean": rewards.mean(), "reward_std": rewards.std(),
         "pass_rate": float((rewards >= 1.0).mean()), "response_tokens": sampled.mean(),
         "response_tokens_max": sampled.max(), "episode_tokens": context.mean(),
         "turns": float(np.mean([len(t.calls) for t in trajs])),
         "tool_errors": float(np.mean([t.metadata.get("tool_errors", 0) for t in trajs])),
         # episodes whose reward came from a test run in a sandbox (verdict with test counts)
         "tests_run": float(np.mean([isinstance(t.metadata.get("verdict"), dict) and
                                     "total" in t.metadata["verdict"] for t in trajs]))}
  for reason, n in collections.Counter(t.termination for t in trajs).items():
    out[f"termination/{reason}"] = n / len(trajs)
  return out


def to_tokens(trajectory, advantage: float):
  """An envs Trajectory as rl.tree.TrajectoryTokens: every sampled token trained, the sampler's
  log-probs as "logprobs", the advantage and reward as scalars."""
  from rl.tree import CallTokens, TrajectoryTokens
  calls = [CallTokens(list(c.input_ids), list(c.output_ids),
                      {"logprobs": list(c.output_logprobs)}) for c in trajectory.calls
           if c.output_ids]
  return TrajectoryTokens(calls, {"advantage": float(advantage),
                                  "reward": float(trajectory.reward)})


def select_groups(groups: list[list], *, group_size: int, drop_constant: bool,
                  min_version: Optional[int] = None, consumed: frozenset = frozenset()
                  ) -> tuple[list[list], list[list], dict]:
  """(kept groups, dropped groups, dropped counts): partial groups, groups with a trajectory
  already trained (`consumed` ids), groups with a token older than `min_version`, and
  (drop_constant) groups whose rewards are all equal are dropped."""
  from rl import filters

  kept, out, counts = [], [], collections.Counter()
  for g in groups:
    if len(g) < group_size:
      counts["dropped/partial_groups"] += 1
    elif any(t.trajectory_id in consumed for t in g):
      counts["dropped/consumed_groups"] += 1
    elif min_version is not None and min(t.policy_version for t in g) < min_version:
      counts["dropped/stale_groups"] += 1
    else:
      kept.append(g)
      continue
    out.append(g)
  if drop_constant and kept:
    rewards = np.array([t.reward for g in kept for t in g], np.float64)
    group = np.repeat(np.arange(len(kept)), [len(g) for g in kept])
    _, constant = filters.drop_constant_groups(rewards, group)
    constant = set(constant.tolist())
    counts["dropped/constant_groups"] += len(constant)
    out += [g for i, g in enumerate(kept) if i in constant]
    kept = [g for i, g in enumerate(kept) if i not in constant]
  return kept, out, dict(counts)


def advantages_of(groups: list[list], name: str) -> list[np.ndarray]:
  """Per group, the advantages of its trajectories (`rl.advantages.compute(name, ...)`)."""
  from rl import advantages
  rewards = np.array([t.reward for g in groups for t in g], np.float32)
  group = np.repeat(np.arange(len(groups)), [len(g) for g in groups]).astype(np.int32)
  adv = np.asarray(advantages.compute(name, rewards, group))
  return np.split(adv, np.cumsum([len(g) for g in groups])[:-1])


def split_minibatches(items: list, n: int) -> list[list]:
  """`items` in n contiguous, nearly equal parts (fewer when there are fewer items)."""
  n = max(1, min(n, len(items)))
  bounds = np.linspace(0, len(items), n + 1).round().astype(int)
  return [items[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


# ----------------------------------------------------------------------------- rollout sources


class InProcessSource:
  """Groups sampled in this process (trainer.rollouts), `lookahead` steps ahead (async)."""

  def __init__(self, rollouts, tasks: TaskSource, group_size: int, seed: int, lookahead: int,
               last_step: int):
    self.rollouts, self.tasks, self.group_size, self.seed = rollouts, tasks, group_size, seed
    self.lookahead, self.last_step = lookahead, last_step
    self._pending: collections.deque = collections.deque()  # (step, tasks, future)

  def _submit(self, step: int) -> None:
    tasks = self.tasks.for_step(step)
    self._pending.append((step, tasks, self.rollouts.groups(
        [(t, step) for t in tasks], self.group_size, seed=self.seed)))

  def take(self, step: int, version: int) -> tuple[list[list], list, dict]:
    """(groups, their tasks, drop counts) of `step`: draw d = step of the step's tasks."""
    while not self._pending or self._pending[-1][0] < min(step + self.lookahead, self.last_step):
      self._submit(self._pending[-1][0] + 1 if self._pending else step)
    _, tasks, future = self._pending.popleft()
    return future.result(), tasks, {}

  def consumed(self, groups: list[list], dropped: list[list]) -> None:
    pass

  def checkpoint_extra(self) -> dict:
    return {}

  def close(self) -> None:
    self.rollouts.close()


class QueueSource:
  """Groups from the rollout queue, filled by rollout workers (`python -m envs.rollout_worker`)
  that sample from this trainer's policy server. Entries are acknowledged only after the
  checkpoint that covers their step (`Checkpointer.on_saved`); re-delivered trajectories the
  checkpoint already consumed are acked without training."""

  def __init__(self, queue, group_size: int, prompts: int, seen: set, max_staleness: int,
               deadline: float, unacked: list, server=None):
    from envs.queue import GroupAssembler
    self.queue, self.group_size, self.prompts, self.seen = queue, group_size, prompts, seen
    self.max_staleness, self.server = max_staleness, server
    self.assembler = GroupAssembler(group_size, deadline=deadline)
    self.unacked: list[str] = list(unacked)  # trained or dropped, waiting for a checkpoint
    self._entries: dict[str, str] = {}  # trajectory id -> entry id (taken, not yet consumed)
    self._ready: list[list] = []  # whole groups assembled beyond a step's need

  def take(self, step: int, version: int) -> tuple[list[list], list, dict]:
    """Exactly `prompts` groups (assembled beyond that wait for the next step)."""
    from envs.queue import drop_stale, filter_unseen
    ready, counts, waited = self._ready, collections.Counter(), time.monotonic()
    while len(ready) < self.prompts:
      # take only what this step lacks: the rest stays unread in the queue, where the workers'
      # backpressure (max_backlog) sees it
      need = (self.prompts - len(ready)) * self.group_size - self.assembler.waiting
      fresh, dup = filter_unseen(self.queue.get_batch(min(64, max(need, 1)), timeout=1.0),
                                 self.seen)
      self.unacked += [d.entry_id for d in dup]
      counts["dropped/duplicates"] += len(dup)
      self.assembler.add(fresh)
      groups, dropped = self.assembler.pop_ready()
      groups, stale = drop_stale(groups, version, self.max_staleness)
      for d in dropped + stale:
        self.seen.add(d.trajectory.trajectory_id)
        self.unacked.append(d.entry_id)
      counts["dropped/partial_trajectories"] += len(dropped)
      counts["dropped/stale_trajectories"] += len(stale)
      for g in groups:
        self._entries.update((d.trajectory.trajectory_id, d.entry_id) for d in g.deliveries)
      ready += [g.trajectories for g in groups]
      if time.monotonic() - waited > 60:
        _say(f"step {step}: waiting for rollout workers ({len(ready)}/{self.prompts} groups, "
             f"{self.assembler.waiting} trajectories in open groups)")
        waited = time.monotonic()
    ready, self._ready = ready[:self.prompts], ready[self.prompts:]
    return ready, [], dict(counts)

  def consumed(self, groups: list[list], dropped: list[list]) -> None:
    """The trajectories of trained and filtered groups: ack after the next checkpoint."""
    for g in groups + dropped:
      for t in g:
        self.unacked.append(self._entries.pop(t.trajectory_id))

  def checkpoint_extra(self) -> dict:
    extra = {"unacked_entry_ids": self.unacked}
    self.unacked = []
    return extra

  def close(self) -> None:
    if self.server is not None:
      self.server.stop()
    self.queue.close()


# ----------------------------------------------------------------------------- the loop


class _Teachers:
  """Distillation: per domain, a teacher's weights and score function."""

  def __init__(self, config, mesh):
    from trainer import sft
    from trainer import step as step_lib

    self.choose = config.distill.choose
    self.by_domain = {}
    for entry in config.distill.teachers:
      domain, _, ckpt = entry.partition("=")
      sub = ml_collections.ConfigDict(config.to_dict())
      sub.model.init, sub.model.preset = ckpt, ""
      cfg = config_lib.model_config(sub)
      model = sft.initial_model(sub, cfg)
      self.by_domain[domain] = (step_lib.make_score_fn(cfg, mesh=mesh), model)
    if not self.by_domain:
      raise config_lib.ConfigError("config.distill.teachers=(): mode 'distill' needs at least "
                                   "one teacher 'domain=ckpt:<dir>'")

  def domain_of(self, task) -> str:
    if self.choose == "single":
      return next(iter(self.by_domain))
    meta = getattr(task, "metadata", {}) or {}
    domain = meta.get("domain", getattr(task, "kind", ""))
    return domain if domain in self.by_domain else next(iter(self.by_domain))

  def logprobs(self, mb, domains_per_seq: np.ndarray) -> np.ndarray:
    """[M, S, T] teacher log-probs: each sequence scored by its domain's teacher."""
    out = np.zeros(np.shape(mb.seq_valid), np.float32)
    for domain, (score, model) in self.by_domain.items():
      here = domains_per_seq == domain
      if here.any():
        lp = np.asarray(jax.device_get(score(model, mb)), np.float32)
        out = np.where(here[..., None], lp, out)
    return out


def run(config: ml_collections.ConfigDict, workdir: str, mesh=None) -> dict:
  """Train (or resume) RL / distillation to `config.train.steps`; a summary dict with "steps",
  "start_step", "checkpoint", "metrics" (metrics.jsonl), "report", "reward_first/last"."""
  from envs.chat import load_tokenizer, make_chat
  from models.engine import Engine
  from rl import corrections
  from trainer import batches as batches_lib
  from trainer import checkpoint, optimizers, sft
  from trainer import metrics as metrics_lib
  from trainer import state as state_lib
  from trainer import step as step_lib
  from trainer.demo_data import DEMO_SCAFFOLD
  from trainer.rollouts import scaffold_config

  warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
  rl_cfg, train_cfg = config.rl, config.train
  distill = config.mode == "distill"
  model_cfg = config_lib.model_config(config)
  loss_cfg = config_lib.loss_config(config)
  if distill:
    import dataclasses
    loss_cfg = dataclasses.replace(loss_cfg, opd_coef=float(config.distill.opd_coef))
  logdir = config.metrics.dir or os.path.join(workdir, config.mode)
  if not config_lib.is_remote(workdir):
    os.makedirs(workdir, exist_ok=True)
  sft.write_run_files(config, model_cfg, workdir)
  chat = make_chat(config.tokenizer.chat_format,
                   load_tokenizer(config_lib.tokenizer_source(config, workdir)))
  tasks = TaskSource(config, workdir)

  # --- state: this workdir's latest checkpoint, or the initial weights
  opt = optimizers.build(config.optimizer, model_cfg)
  ckpt = checkpoint.Checkpointer(
      os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep,
      save_every=train_cfg.checkpoint_every or train_cfg.steps,
      async_save=config.checkpoint.async_save)
  restored = ckpt.restore_latest(state_lib.abstract(model_cfg, opt, mesh))
  initial = None
  if restored is None or (loss_cfg.kl_coef and rl_cfg.reference == "initial"):
    initial = sft.initial_model(config, model_cfg)
  consumed: set[str] = set()
  if restored is not None:
    start, state = restored.step, restored.state
    consumed = set(restored.extra.get("consumed_ids", ()))
    _say(f"resumed from the checkpoint of step {start} in {workdir}")
  else:
    start = 0
    state = state_lib.create(model_cfg, opt, seed=config.seed, mesh=mesh, model=initial)
  reference = None
  if loss_cfg.kl_coef:
    if rl_cfg.reference == "initial":
      reference = initial if initial is not None else state.model(model_cfg)
    else:
      sub = ml_collections.ConfigDict(config.to_dict())
      sub.model.init, sub.model.preset = rl_cfg.reference, ""
      reference = sft.initial_model(sub, model_cfg)
  teachers = _Teachers(config, mesh) if distill else None

  # --- engine and rollouts
  scaffold = scaffold_config(
      DEMO_SCAFFOLD, max_turns=rl_cfg.max_turns, max_new_tokens=rl_cfg.max_new_tokens,
      max_context_tokens=rl_cfg.max_context_tokens, temperature=rl_cfg.temperature,
      top_p=rl_cfg.top_p, top_k=rl_cfg.top_k, timeout_s=rl_cfg.episode_timeout_s)
  engine = Engine(state.model(model_cfg), engine_config(config),
                  detokenize=chat.tokenizer.decode)
  version = int(state.policy_version)
  engine.update_params(state.model(model_cfg), version)
  source = make_source(config, engine, chat, scaffold, tasks, consumed,
                       restored.extra if restored is not None else {}, ckpt)
  correction = corrections.CorrectionConfig(kind=rl_cfg.correction)
  train_step = step_lib.make_train_step(model_cfg, loss_cfg, opt, mesh=mesh,
                                        correction_cfg=correction, donate=False)
  score = step_lib.make_score_fn(model_cfg, mesh=mesh) if (
      reference is not None or rl_cfg.recompute_old or rl_cfg.mcla_passes) else None
  shape = batches_lib.BatchShape(row_len=config.data.row_len, rows=config.data.rows_per_batch,
                                 seqs=None, seq_len=None, micro_batches=None)
  writer = metrics_lib.writer_for(config, logdir, start + 1,
                                  bar_keys=("reward_mean", "pass_rate", "loss"))
  guard = checkpoint.PreemptionGuard()
  timer = metrics_lib.Timer()
  updates_per_step = rl_cfg.epochs * rl_cfg.minibatches
  summary: dict[str, Any] = {"start_step": start, "steps": start, "preempted": False,
                             "checkpoint": start if restored is not None else None}
  _say(f"{model_cfg.attention} attention, {model_cfg.num_experts or 'no'} experts; "
       f"{rl_cfg.prompts_per_step} tasks x {rl_cfg.group_size} episodes per step, loss "
       f"{loss_cfg.name}, {rl_cfg.loop} loop; steps {start + 1}..{train_cfg.steps}")
  try:
    for step in range(start + 1, train_cfg.steps + 1):
      with timer.phase("rollout"):
        groups, step_tasks, source_counts = source.take(step, version)
      metrics: dict[str, Any] = episode_stats(groups)
      metrics.update(source_counts)
      min_version = version - rl_cfg.max_staleness if (
          rl_cfg.loop == "async" or rl_cfg.rollout_workers == "queue") else None
      kept, dropped_groups, dropped = select_groups(
          groups, group_size=rl_cfg.group_size, drop_constant=rl_cfg.drop_constant_groups,
          min_version=min_version, consumed=frozenset(consumed))
      metrics.update(dropped)
      metrics["groups_trained"] = len(kept)
      ids = [t.trajectory_id for g in kept for t in g]
      metrics["trajectory_ids"] = ids
      if kept:
        with timer.phase("pack"):
          adv = advantages_of(kept, rl_cfg.advantage)
          domain_of = {id(g): teachers.domain_of(task_of(g, step_tasks)) for g in kept
                       } if teachers else {}
          mbs = []
          for part in split_minibatches(list(zip(kept, adv)), rl_cfg.minibatches):
            token_groups = [[to_tokens(t, a) for t, a in zip(g, g_adv)] for g, g_adv in part]
            part = [g for g, _ in part]
            mb = batches_lib.make_micro_batches(token_groups, shape)
            mb = mb.with_fields(old_logprobs=mb.fields["logprobs"])
            mbs.append((part, mb))
          metrics.update(batch_stats([mb for _, mb in mbs]))
        with timer.phase("score"):
          for i, (part, mb) in enumerate(mbs):
            extra = {}
            if reference is not None:
              extra["ref_logprobs"] = np.asarray(jax.device_get(score(reference, mb)))
            if rl_cfg.mcla_passes:
              extra["old_logprobs"] = np.asarray(jax.device_get(step_lib.mcla_logprobs(
                  score, state, mb, rl_cfg.mcla_passes, rl_cfg.mcla_mode)))
            elif rl_cfg.recompute_old:
              extra["old_logprobs"] = np.asarray(jax.device_get(score(state, mb)))
            if teachers is not None:
              seq_domain = np.full(np.shape(mb.seq_id), "", object)
              sid = np.asarray(mb.seq_id)
              flat = [domain_of[id(g)] for g in part for _ in g]
              seq_domain[sid >= 0] = [flat[k] for k in sid[sid >= 0]]
              extra["teacher_logprobs"] = teachers.logprobs(mb, seq_domain)
            if extra:
              mbs[i] = (part, mb.with_fields(**extra))
        with timer.phase("train", tokens=metrics.get("loss_tokens", 0)):
          step_metrics = []
          for _ in range(rl_cfg.epochs):
            for _, mb in mbs:
              state, m = train_step(state, mb)
              step_metrics.append(jax.device_get(m))
          metrics.update(mean_metrics(step_metrics))
      else:
        log.warning("step %d: no group left to train (%s)", step, dropped)
      consumed.update(t.trajectory_id for g in kept + dropped_groups for t in g)
      source.consumed(kept, dropped_groups)
      with timer.phase("sync"):
        version = int(state.policy_version)
        engine.update_params(state.model(model_cfg), version)
      metrics["policy_version"] = version
      metrics["engine/" + "prefill_tokens"] = engine.counters.get("prefill_tokens", 0)
      times = timer.flush()
      metrics.update(times)
      metrics["tokens_per_s/rollout"] = metrics.get("response_tokens", 0) * metrics.get(
          "episodes", 0) / max(times.get("time/rollout", 0.0), 1e-9)
      last = step == train_cfg.steps
      writer.write(step, metrics)
      summary.setdefault("reward_first", metrics.get("reward_mean"))
      summary["reward_last"] = metrics.get("reward_mean")
      summary["steps"] = step
      if step % train_cfg.log_every == 0 or last:
        _say(f"step {step}: reward {metrics.get('reward_mean', float('nan')):.3f}, pass "
             f"{metrics.get('pass_rate', float('nan')):.2f}, {len(kept)} groups trained"
             + (f", loss {metrics['loss']:.4f}" if "loss" in metrics else "")
             + f" (rollout {times.get('time/rollout', 0):.1f}s, train "
             f"{times.get('time/train', 0):.1f}s)")
      stop = guard.should_stop(step)
      if stop or last or (train_cfg.checkpoint_every and step % train_cfg.checkpoint_every == 0):
        with timer.phase("checkpoint"):
          extra = {"policy_version": version, "consumed_ids": sorted(consumed),
                   **source.checkpoint_extra()}
          if ckpt.save(step, state, extra, force=True):
            summary["checkpoint"] = step
      if stop:
        summary["preempted"] = True
        log.warning("preempted: saved step %d and stopping", step)
        break
  finally:
    guard.close()
    writer.close()
    try:
      ckpt.close()  # waits for the last save and its on_saved callbacks (queue acks)
    finally:
      source.close()
  summary["metrics"] = os.path.join(logdir, metrics_lib.JSONL)
  summary["updates_per_step"] = updates_per_step
  report = metrics_lib.end_of_run_report(config, logdir, REPORT_KEYS,
                                         f"{config.mode} {os.path.basename(workdir)}")
  if report:
    summary["report"] = report
  _say(f"steps {start + 1}..{summary['steps']} done; reward "
       f"{summary.get('reward_first') or 0:.3f} -> {summary.get('reward_last') or 0:.3f}; "
       f"metrics in {logdir}")
  return summary


def make_source(config, engine, chat, scaffold, tasks: TaskSource, consumed: set,
                restored_extra: dict, ckpt):
  """The rollout source of config.rl.rollout_workers: "inprocess" (trainer.rollouts on
  `engine`) or "queue" (this engine behind a policy server for remote rollout workers, groups
  from the queue, acks after each checkpoint)."""
  from trainer.rollouts import Rollouts
  rl = config.rl
  if rl.rollout_workers == "inprocess":
    lookahead = max(1, rl.max_staleness // max(1, rl.minibatches)) if rl.loop == "async" else 0
    return InProcessSource(Rollouts(engine, chat, scaffold, sandbox=rl.sandbox,
                                    concurrency=rl.concurrency, sandbox_url=rl.sandbox_url,
                                    sandbox_token_file=rl.sandbox_token_file),
                           tasks, rl.group_size, config.seed, lookahead, config.train.steps)
  from envs.queue import make_queue
  from trainer.serve import PolicyServer, ServerConfig
  queue = make_queue(rl.queue_url, password_file=rl.queue_password_file or None)
  queue.ack(restored_extra.get("unacked_entry_ids", ()))  # trained and checkpointed, not acked
  ckpt.on_saved(lambda step, extra: queue.ack(extra.get("unacked_entry_ids", ())))
  server = PolicyServer(engine, ServerConfig(
      host=config.serve.host, port=config.serve.port,
      token=os.environ.get("ARBOR_SERVE_TOKEN") or None), tokenizer=chat.tokenizer, chat=chat)
  url = server.start_in_thread()
  _say(f"policy server for rollout workers on {url}; queue {rl.queue_url}")
  # remote workers sample while the trainer trains, whatever rl.loop says: admission control by
  # rl.max_staleness (validated >= 1 for the queue)
  return QueueSource(queue, rl.group_size, rl.prompts_per_step, consumed, rl.max_staleness,
                     deadline=rl.group_deadline_s, unacked=[], server=server)


def task_of(group: list, tasks: list):
  """The task of a group (by its task_id)."""
  from envs.rollout_worker import task_id_of
  ids = {task_id_of(t): t for t in tasks}
  return ids.get(group[0].task_id, tasks[0])


def engine_config(config):
  """The engine of the RL loop / eval: a slot per concurrent episode, rows for prefix reuse."""
  from models.engine import EngineConfig
  rl = config.rl
  return EngineConfig(slots=rl.concurrency, max_seq_len=_round(rl.max_context_tokens, 128),
                      prefix_cache_rows=rl.concurrency, prefill_chunk=512,
                      seed=config.seed)


def _round(n: int, m: int) -> int:
  return -(-n // m) * m


def batch_stats(mbs: list) -> dict:
  """Packing counts summed over a step's minibatches: tree and logical (unpacked) tokens."""
  from trainer.batches import describe
  total = collections.Counter()
  for mb in mbs:
    total.update(describe(mb))
  out = dict(total)
  out["tree_token_ratio"] = out["logical_tokens"] / max(out["tree_tokens"], 1)
  return out


def mean_metrics(items: list[dict]) -> dict:
  """Train-step metrics averaged over a step's updates ("max" keys: the max)."""
  out = {}
  for k in items[0]:
    vals = [float(np.asarray(m[k])) for m in items if k in m]
    out[k] = max(vals) if "max" in k else float(np.mean(vals))
  return out
