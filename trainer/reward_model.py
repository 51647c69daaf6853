"""Reward models: trained on verified episodes, served as a dense reward in the RL loop.

    episodes = [episode(t, max_len=1024) for t in trajectories]   # tokens, steps, labels
    pairs = make_pairs(episodes)                                   # [P, 2] (chosen, rejected)
    rm = RewardModel(model_cfg, optax.adamw(1e-3), pairwise_coef=1.0, orm_coef=1.0)
    state = rm.init(value_head.init(model_cfg, seed))              # a Transformer + scalar head
    state, metrics = rm.step(state, pair_batch(episodes, pairs[:8], 1024))
    result = evaluate(rm, state, held_out, held_out_pairs, 1024)   # pairwise / ORM accuracy, AUC
    summary = run(config, workdir)                                 # mode "reward_model"

The model is `models.value_head.Critic`: the policy's architecture (a `models.transformer`
trunk) with a scalar head. A trajectory is read as one causal sequence, its last call's context
(input + output: the react scaffold's calls extend each other); its reward is the head's value
at the sequence's last token, and a step's score (a PRM's) the value at the last token of that
step's call (an assistant turn: one LLM call, i.e. one tool call or the final answer). A call
whose tokens are not a prefix of the last call's context (context management dropped them) has
no step score. Sequences longer than `max_len` keep their last `max_len` tokens (positions
from 0: RoPE sees the same relative positions); steps before that window have no score.

Batches are plain padded rows (one trajectory per row, [rows, L] with L the longest sequence
rounded up to a multiple of 256, or to a power of two when short), not tree-packed: simpler,
and exact under the tree attention rule with `end` = the sequence's length (padding attends
only to itself). The cost is the prompt shared by
a pair's two episodes, computed twice.

Labels, all from the verifier (`Trajectory.reward`; a pass is reward >= PASS):
  pairs     every (passed, failed) pair of episodes of the same task (`task_id`): the
            verified episode is chosen over the failed one;
  ORM       each episode's outcome: 1 if it passed, else 0;
  PRM       per step, the episode's outcome (a Monte-Carlo estimate of the step's value from
            one continuation, Math-Shepherd's hard estimate), except that a step whose tool call
            failed (`LLMCall.meta["tool_error"]`) is labelled 0 whatever the outcome.
Training takes `batch_pairs` pairs per step (2 x batch_pairs rows: the chosen rows, then the
rejected ones) and minimises pairwise_coef x `rl.reward_losses.bradley_terry` + orm_coef x
`outcome_bce` (on every row) + prm_coef x `process_bce` (every scored step). Episodes of tasks
whose episodes all passed or all failed enter no pair: they are used by the ORM/PRM evaluation
only.

Mode "reward_model" (`run`, configs/reward_model.py) trains on trajectory files
(`reward_model.episodes`, `reward_model.eval_episodes`: JSONL of `Trajectory.to_dict` records)
or on the scripted demo solver's episodes (`reward_model.demo_tasks`, `demo_eval_tasks`): per
generated task one episode that makes the fix and one that submits without it (the noisy
demonstrator of `trainer.demo_data`), both graded by the tasks' tests in sandboxes. Checkpoints
(`rm_checkpoints/`, resumable), metrics.jsonl and the held-out evaluation (`reward_model.json`)
go to the workdir.

Serving a trained model in the RL loop (`rl.reward_model`): trainer/reward_scoring.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from envs.trajectory import Trajectory
from models import value_head
from models.config import ModelConfig
from rl import reward_losses
from trainer import checkpoint, harness, metrics
from trainer import config as config_lib
from trainer.demo_data import demo_trajectories
from trainer.sft import prepare_demo

PASS = 1.0  # a verifier reward >= PASS is a pass (as trainer.groups' pass_rate)
CHECKPOINTS = "rm_checkpoints"  # the reward model's checkpoints under its workdir
RESULT = "reward_model.json"  # the held-out evaluation of the last step
KINDS = ("orm", "prm")  # how RL reads a reward model (rl.reward_model.kind)
BUCKET = 256  # padded row lengths are multiples of this (few shapes, few compiles)


# ----------------------------------------------------------------------------- data


@dataclasses.dataclass
class Episode:
  """One trajectory as a reward-model row.

  Attributes:
    tokens: [n] int32, the trajectory's sequence (its last `max_len` tokens).
    steps: [k] int32, per call that sampled tokens (the calls of `rl.tree.from_trajectory`),
      the position of its last token in `tokens`; -1 when it has none (see the module doc).
    step_labels: [k] f32 PRM targets.
    label: the ORM target, 1.0 if the verifier passed the episode, else 0.0.
    task_id: the task, which pairs episodes.
  """

  tokens: np.ndarray
  steps: np.ndarray
  step_labels: np.ndarray
  label: float
  task_id: str


def episode(trajectory: Trajectory, max_len: int) -> Episode:
  """The reward-model row of a trajectory (see the module docstring for steps and labels).

  Args:
    trajectory: an episode with its verifier reward.
    max_len: the most tokens kept (the last ones).

  Returns:
    The Episode.

  Raises:
    ValueError: the trajectory sampled no token.
  """
  calls = [c for c in trajectory.calls if len(c.output_ids)]
  if not calls:
    raise ValueError(f"trajectory {trajectory.trajectory_id!r} sampled no token")
  final = list(calls[-1].input_ids) + list(calls[-1].output_ids)
  offset = max(0, len(final) - max_len)
  passed = float(trajectory.reward >= PASS)
  steps, labels = [], []
  for c in calls:
    n = len(c.input_ids) + len(c.output_ids)
    on_final = n <= len(final) and final[:n] == list(c.input_ids) + list(c.output_ids)
    steps.append(n - 1 - offset if on_final and n - 1 >= offset else -1)
    labels.append(0.0 if c.meta.get("tool_error") else passed)
  return Episode(np.asarray(final[offset:], np.int32), np.asarray(steps, np.int32),
                 np.asarray(labels, np.float32), passed, trajectory.task_id)


def make_pairs(episodes: Sequence[Episode]) -> np.ndarray:
  """Every (passed, failed) pair of episodes of the same task.

  Args:
    episodes: the episodes.

  Returns:
    [P, 2] int64 indices into `episodes`: (chosen, rejected), in task order of appearance.
  """
  by_task: dict[str, list[int]] = {}
  for i, e in enumerate(episodes):
    by_task.setdefault(e.task_id, []).append(i)
  pairs = [(c, r) for idx in by_task.values() for c in idx if episodes[c].label
           for r in idx if not episodes[r].label]
  return np.asarray(pairs, np.int64).reshape(-1, 2)


def rows(episodes: Sequence[Episode], index: Sequence[int], max_steps: int = 0) -> dict:
  """Padded causal rows of the episodes `index` (-1: an empty padding row).

  Args:
    episodes: the episodes.
    index: [N] episode indices, -1 for padding rows.
    max_steps: the step axis' size S (0: the most steps of these episodes).

  Returns:
    numpy arrays: "tokens", "positions", "end" [N, L] int32 (L: the longest row rounded up to
    a multiple of BUCKET, or below BUCKET / 2 to a power of two >= 16; `end` by the tree rule: a row's tokens see its prefix, padding only itself),
    "last" [N] int32 (each row's last token), "valid" [N] f32, "labels" [N] f32, "steps"
    [N, S] int32 (0 where unscored), "step_labels" [N, S] f32, "step_mask" [N, S] f32.
  """
  chosen = [episodes[i] if i >= 0 else None for i in index]
  longest = max([len(e.tokens) for e in chosen if e is not None] + [1])
  length = (-(-longest // BUCKET) * BUCKET if longest > BUCKET // 2
            else max(16, 1 << (longest - 1).bit_length()))
  s = max_steps or max([len(e.steps) for e in chosen if e is not None] + [1])
  n = len(chosen)
  ar = np.arange(length, dtype=np.int32)
  out = {"tokens": np.zeros((n, length), np.int32),
         "positions": np.broadcast_to(ar, (n, length)).copy(),
         "end": np.broadcast_to(ar + 1, (n, length)).copy(),
         "last": np.zeros(n, np.int32), "valid": np.zeros(n, np.float32),
         "labels": np.zeros(n, np.float32), "steps": np.zeros((n, s), np.int32),
         "step_labels": np.zeros((n, s), np.float32), "step_mask": np.zeros((n, s), np.float32)}
  for r, e in enumerate(chosen):
    if e is None:
      continue
    k = len(e.tokens)
    out["tokens"][r, :k] = e.tokens
    out["end"][r, :k] = k
    out["last"][r], out["valid"][r], out["labels"][r] = k - 1, 1.0, e.label
    scored = e.steps[:s] >= 0
    out["steps"][r, :len(scored)] = np.where(scored, e.steps[:s], 0)
    out["step_labels"][r, :len(scored)] = e.step_labels[:s]
    out["step_mask"][r, :len(scored)] = scored
  return out


def pair_batch(episodes: Sequence[Episode], pairs: np.ndarray, batch_pairs: int,
               max_steps: int = 0) -> dict:
  """A training batch: `rows` of the chosen episodes, then of the rejected ones, plus
  "pair_mask" [batch_pairs] f32; fewer pairs than `batch_pairs` are padded."""
  pad = batch_pairs - len(pairs)
  chosen = list(pairs[:, 0]) + [-1] * pad
  rejected = list(pairs[:, 1]) + [-1] * pad
  out = rows(episodes, chosen + rejected, max_steps)
  out["pair_mask"] = np.asarray([1.0] * len(pairs) + [0.0] * pad, np.float32)
  return out


# ----------------------------------------------------------------------------- the model


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["params", "rest", "opt_state", "step"], meta_fields=[])
@dataclasses.dataclass
class RewardState:
  """The reward model's trained parameters, its other variables, optimizer state, updates."""

  params: Any
  rest: Any
  opt_state: Any
  step: jax.Array


class RewardModel:
  """Training and scoring of a `models.value_head.Critic` as a reward model.

  Args:
    model_cfg: the trunk's ModelConfig.
    optimizer: an optax transformation of the parameters.
    pairwise_coef: weight of the Bradley-Terry loss.
    orm_coef: weight of the outcome BCE (every real row).
    prm_coef: weight of the per-step BCE.
    margin: the Bradley-Terry margin.
  """

  def __init__(self, model_cfg: ModelConfig, optimizer: optax.GradientTransformation,
               pairwise_coef: float = 1.0, orm_coef: float = 0.0, prm_coef: float = 0.0,
               margin: float = 0.0):
    self.model_cfg, self.optimizer = model_cfg, optimizer
    self.coefs = (float(pairwise_coef), float(orm_coef), float(prm_coef))
    self.margin = float(margin)
    self.graphdef = None
    self._step = jax.jit(self._update)
    self._scores = jax.jit(self._all_scores)

  def init(self, model: value_head.Critic) -> RewardState:
    """The state of `model` with a fresh optimizer state (fixes this model's graph)."""
    self.graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return RewardState(params=params, rest=rest, opt_state=self.optimizer.init(params),
                       step=jnp.zeros((), jnp.int32))

  def _all_scores(self, params, rest, batch: dict) -> tuple[jax.Array, jax.Array]:
    """([N] logits at each row's last token, [N, S] logits at its steps' last tokens)."""
    model = nnx.merge(self.graphdef, params, rest)
    values, _ = model(batch["tokens"], batch["positions"], batch["end"],
                      token_weights=batch["end"] > batch["positions"])  # padding: no MoE load
    last = jnp.take_along_axis(values, batch["last"][:, None], axis=1)[:, 0]
    return last, jnp.take_along_axis(values, batch["steps"], axis=1)

  def _losses(self, params, rest, batch: dict) -> tuple[jax.Array, dict]:
    last, steps = self._all_scores(params, rest, batch)
    p = batch["pair_mask"].shape[0]
    pairwise = reward_losses.bradley_terry(last[:p], last[p:], batch["pair_mask"], self.margin)
    orm = reward_losses.outcome_bce(last, batch["labels"], batch["valid"])
    prm = reward_losses.process_bce(steps, batch["step_labels"], batch["step_mask"])
    a, b, c = self.coefs
    return a * pairwise + b * orm + c * prm, {"pairwise_loss": pairwise, "orm_loss": orm,
                                              "prm_loss": prm}

  def _update(self, state: RewardState, batch: dict):
    (loss, parts), grads = jax.value_and_grad(self._losses, has_aux=True)(
        state.params, state.rest, batch)
    updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return (dataclasses.replace(state, params=params, opt_state=opt_state, step=state.step + 1),
            {"loss": loss, "grad_norm": optax.tree.norm(grads), **parts})

  def step(self, state: RewardState, batch: dict) -> tuple[RewardState, dict]:
    """One optimizer update on a `pair_batch`; metrics "loss", "grad_norm", the three parts."""
    return self._step(state, batch)

  def scores(self, state: RewardState, batch: dict) -> tuple[np.ndarray, np.ndarray]:
    """The logits of a `rows` batch: ([N] at the last tokens, [N, S] at the steps)."""
    last, steps = self._scores(state.params, state.rest, batch)
    return np.asarray(last), np.asarray(steps)


def score_episodes(rm: RewardModel, state: RewardState, episodes: Sequence[Episode],
                   batch_rows: int = 8) -> tuple[np.ndarray, list[np.ndarray]]:
  """Logits of every episode, `batch_rows` rows at a time.

  Returns:
    ([E] logits at the episodes' last tokens, per episode [k] logits at its steps, NaN where
    a step has no score).
  """
  finals, steps = [], []
  for start in range(0, len(episodes), batch_rows):
    index = list(range(start, min(start + batch_rows, len(episodes))))
    batch = rows(episodes, index + [-1] * (batch_rows - len(index)))
    last, at_steps = rm.scores(state, batch)
    for r, i in enumerate(index):
      e = episodes[i]
      finals.append(last[r])
      steps.append(np.where(e.steps >= 0, at_steps[r, :len(e.steps)], np.nan))
  return np.asarray(finals, np.float32), steps


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
  """ROC AUC: P(score of a positive > score of a negative), ties counting 1/2 (NaN without
  both classes). [N] scores, [N] 0/1 labels."""
  pos, neg = scores[labels > 0.5], scores[labels <= 0.5]
  if not len(pos) or not len(neg):
    return float("nan")
  d = pos[:, None] - neg[None, :]
  return float(np.mean((d > 0) + 0.5 * (d == 0)))


def evaluate(rm: RewardModel, state: RewardState, episodes: Sequence[Episode],
             pairs: np.ndarray, batch_rows: int = 8) -> dict:
  """Held-out metrics of the reward model.

  Args:
    rm: the model.
    state: its state.
    episodes: held-out episodes.
    pairs: their `make_pairs`.
    batch_rows: rows per forward pass.

  Returns:
    {"pairwise_accuracy" (share of pairs with r_chosen > r_rejected, ties 1/2), "orm_accuracy"
    (σ(r) > 0.5 against the outcome), "orm_auc", "prm_step_accuracy" (scored steps), "pairs",
    "episodes", "pass_rate"}.
  """
  finals, steps = score_episodes(rm, state, episodes, batch_rows)
  labels = np.asarray([e.label for e in episodes], np.float32)
  d = finals[pairs[:, 0]] - finals[pairs[:, 1]] if len(pairs) else np.zeros(0)
  step_scores = np.concatenate([s for s in steps]) if steps else np.zeros(0)
  step_labels = np.concatenate([e.step_labels for e in episodes]) if steps else np.zeros(0)
  scored = ~np.isnan(step_scores)
  nan = float("nan")
  return {"pairwise_accuracy": float(np.mean((d > 0) + 0.5 * (d == 0))) if len(d) else nan,
          "orm_accuracy": float(np.mean((finals > 0) == (labels > 0.5))) if len(labels) else nan,
          "orm_auc": auc(finals, labels),
          "prm_step_accuracy": float(np.mean((step_scores[scored] > 0) ==
                                             (step_labels[scored] > 0.5))) if scored.any() else nan,
          "pairs": int(len(pairs)), "episodes": len(episodes),
          "pass_rate": float(labels.mean()) if len(labels) else nan}


def optimizer(rm_cfg) -> optax.GradientTransformation:
  """AdamW at `reward_model.learning_rate` (weight decay `weight_decay`), global-norm clip 1."""
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(rm_cfg.learning_rate, weight_decay=rm_cfg.weight_decay))


def make_model(config: ml_collections.ConfigDict, model_cfg: ModelConfig) -> RewardModel:
  """The RewardModel of a run's `reward_model` section."""
  r = config.reward_model
  return RewardModel(model_cfg, optimizer(r), r.pairwise_coef, r.orm_coef, r.prm_coef, r.margin)


def train(rm: RewardModel, state: RewardState, episodes: Sequence[Episode], pairs: np.ndarray,
          steps: int, batch_pairs: int, seed: int = 0, start: int = 0, on_step=None
          ) -> RewardState:
  """Steps start + 1 .. `steps` of `batch_pairs` pairs each, drawn by epochs over a shuffle.

  Args:
    rm: the model.
    state: its state after `start` steps.
    episodes: the training episodes.
    pairs: their `make_pairs` (at least one).
    steps: the last step.
    batch_pairs: pairs per step.
    seed: the shuffle's seed (step s always draws the same pairs: resuming continues exactly).
    start: steps already done.
    on_step: optional `(step, state, metrics) -> bool`; True stops after that step.

  Returns:
    The final state.

  Raises:
    ValueError: no pairs.
  """
  if not len(pairs):
    raise ValueError("reward model training: no (passed, failed) pair of the same task")
  max_steps = max(len(e.steps) for e in episodes)
  per_epoch = max(1, len(pairs) // batch_pairs)
  for step in range(start + 1, steps + 1):
    epoch, k = divmod(step - 1, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(len(pairs))
    take = pairs[order[k * batch_pairs:(k + 1) * batch_pairs]]
    state, m = rm.step(state, pair_batch(episodes, take, batch_pairs, max_steps))
    if on_step is not None and on_step(step, state, jax.device_get(m)):
      break
  return state


# ----------------------------------------------------------------------------- mode


def _read(path: str) -> list[Trajectory]:
  with open(path) as f:
    return [Trajectory.from_dict(json.loads(line)) for line in f if line.strip()]


def demo_episodes(config: ml_collections.ConfigDict, chat, n: int, split: str) -> list:
  """Per generated task (taskgen `split`, data.demo level / seed / error_rate / sandbox /
  environment) the scripted solver's episode with the fix and one submitting without it, each
  rewarded by the task's tests (the verifier) in a sandbox."""
  d = config.data.demo
  return [t for rate in (0.0, 1.0) for t in demo_trajectories(
      chat, n, level=d.level, seed=d.seed, split=split, error_rate=d.error_rate,
      early_submit_rate=rate, sandbox=d.sandbox, verify=True, environment=d.environment)]


def load_episodes(config: ml_collections.ConfigDict, workdir: str, chat) -> tuple[list, list]:
  """The training and held-out trajectories: `reward_model.episodes` / `eval_episodes`, or
  demo episodes recorded once into <workdir>/data/rm_{train,eval}.jsonl."""
  r = config.reward_model
  out = []
  for field, count, split in (("episodes", r.demo_tasks, "train"),
                              ("eval_episodes", r.demo_eval_tasks, "eval")):
    if r[field]:
      out.append(_read(r[field]))
      continue
    path = os.path.join(workdir, "data", f"rm_{split}.jsonl")
    if not os.path.isfile(path):
      trajectories = demo_episodes(config, chat, count, split) if count else []
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(path + ".tmp", "w") as f:
        for t in trajectories:
          small = dataclasses.replace(t, metadata={"verified": t.metadata.get("verified")})
          f.write(json.dumps(small.to_dict()) + "\n")
      os.replace(path + ".tmp", path)
      metrics.say("reward_model", f"recorded {len(trajectories)} verified demo episodes "
                  f"({split}) in {path}")
    out.append(_read(path))
  return out[0], out[1]


def run(config: ml_collections.ConfigDict, workdir: str, mesh=None) -> dict:
  """Mode "reward_model": train (or resume) a reward model, then evaluate it on held-out data.

  Args:
    config: a validated mode "reward_model" config.
    workdir: the run's directory (local).
    mesh: not used (one device).

  Returns:
    {"steps", "train_pairs", "train_episodes", "train_pass_rate", "eval" (`evaluate` on the
    held-out episodes, {} without them), "seconds"}; also written to <workdir>/reward_model.json.
  """
  del mesh
  t0 = time.perf_counter()
  r, train_cfg = config.reward_model, config.train
  model_cfg = config_lib.model_config(config)
  prepare_demo(config, workdir)  # a demo tokenizer (tokenizer.train_vocab_size), if any
  chat = config_lib.make_chat_format(config, config_lib.tokenizer_source(config, workdir))
  train_t, eval_t = load_episodes(config, workdir, chat)
  train_eps = [episode(t, r.max_len) for t in train_t]
  eval_eps = [episode(t, r.max_len) for t in eval_t]
  pairs, eval_pairs = make_pairs(train_eps), make_pairs(eval_eps)
  say = lambda m: metrics.say("reward_model", m)
  say(f"{len(train_eps)} training episodes (pass rate "
      f"{np.mean([e.label for e in train_eps]):.2f}), {len(pairs)} pairs; {len(eval_eps)} "
      f"held-out episodes, {len(eval_pairs)} pairs")
  harness.write_run_files(config, model_cfg, workdir)
  rm = make_model(config, model_cfg)
  initial = harness.initial_model(config, model_cfg)
  state = rm.init(value_head.Critic(initial) if initial is not None
                  else value_head.init(model_cfg, config.seed))
  logdir = config.metrics.dir or os.path.join(workdir, "reward_model")
  os.makedirs(logdir, exist_ok=True)
  result: dict[str, Any] = {}
  with checkpoint.Checkpointer(os.path.join(workdir, CHECKPOINTS), keep=config.checkpoint.keep,
                               async_save=config.checkpoint.async_save) as ckpt, \
      open(os.path.join(logdir, "metrics.jsonl"), "a") as log_file:
    restored = ckpt.restore_latest(state)
    start = 0
    if restored is not None:
      state, start = restored.state, restored.step
      say(f"resumed from step {start}")
    guard = checkpoint.PreemptionGuard()

    def on_step(step, state, m) -> bool:
      line = {"step": step, **{k: float(v) for k, v in m.items()}}
      last = step == train_cfg.steps
      if eval_eps and (last or (train_cfg.eval_every and step % train_cfg.eval_every == 0)):
        line.update({f"eval/{k}": v for k, v in evaluate(rm, state, eval_eps, eval_pairs,
                                                         r.batch_pairs * 2).items()})
        result.update(line)
      log_file.write(json.dumps(line) + "\n")
      log_file.flush()
      if step % train_cfg.log_every == 0 or last:
        say(f"step {step}: loss {line['loss']:.4f}" + "".join(
            f", {k} {line[k]:.3f}" for k in ("eval/pairwise_accuracy", "eval/orm_accuracy")
            if k in line))
      stop = guard.should_stop(step)
      if last or stop or (train_cfg.checkpoint_every and step % train_cfg.checkpoint_every == 0):
        ckpt.save(step, state, {"step": step}, force=True)
      return stop
    try:
      state = train(rm, state, train_eps, pairs, train_cfg.steps, r.batch_pairs, config.seed,
                    start, on_step)
    finally:
      guard.close()
    if start >= train_cfg.steps and eval_eps:  # a finished run: evaluate its last state
      result.update({f"eval/{k}": v for k, v in evaluate(rm, state, eval_eps, eval_pairs,
                                                        r.batch_pairs * 2).items()})
  summary = {"steps": int(state.step), "train_pairs": int(len(pairs)),
             "train_episodes": len(train_eps),
             "train_pass_rate": float(np.mean([e.label for e in train_eps])),
             "eval": {k[5:]: v for k, v in result.items() if k.startswith("eval/")},
             "seconds": time.perf_counter() - t0}
  with open(os.path.join(workdir, RESULT), "w") as f:
    json.dump(summary, f, indent=1)
  say(f"done: {json.dumps(summary['eval'])}")
  return summary
