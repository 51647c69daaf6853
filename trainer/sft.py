"""The SFT loop: supervised fine-tuning on chat records / recorded trajectories as trees.

    summary = run(config, workdir, mesh)         # trainer.main --config=configs/sft_demo.py

One step = the next packed batch of the grain pipeline (trainer.data: records -> trajectory
trees -> fixed-shape micro-batches) -> the jitted train step (trainer.step) with the "sft" loss.
Error-masked SFT comes with the data: a turn whose tool call failed has loss_mask 0 (stays in
context, out of the loss); `loss.mask_failed_turns` also drops turns flagged `failed`.

Workdir layout (`--workdir`):
  config.json, model_config.json   the run's config and resolved ModelConfig (ckpt:<workdir>
                                   of a later run reads them)
  checkpoints/<step>/              TrainState + {"data": iterator state, "policy_version"}
  tokenizer/, data/                the demo's trained tokenizer and generated episodes
  sft/                             metrics.jsonl, TensorBoard events, report.png/html
                                   (`metrics.dir` moves it)

Resuming is automatic: a workdir with a checkpoint continues from its latest step (TrainState
with the RNG key, and the data iterator exactly where it was), metrics.jsonl keeps the lineage
of that checkpoint (trainer.metrics), and the run ends at `train.steps` as an uninterrupted one
would. SIGTERM saves a checkpoint at the end of the current step and returns (exit code 0).

Metrics per step: loss, grad_norm, lr, param_norm, max_logit (+ moe_max_load, balance_loss);
trajectories, trees, row_tokens (row positions holding a token), loss_tokens, linear_tokens
(what training every LLM call unpacked would process), tree_token_ratio = linear_tokens /
row_tokens; tokens_per_s (row tokens / step time), tokens_per_s/linear (linear tokens / step
time), time/<phase> (data, train, eval, checkpoint: the save started after the previous step's
metrics line) and time/step; eval/loss and eval/tokens on eval steps; trajectory_ids: one id per
trained trajectory, a hash of its sampled tokens and loss mask (JSONL only), so a test can check
that no trajectory is trained twice across a kill and a resume.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import time
import warnings
from typing import Any

import jax
import ml_collections
import numpy as np
from etils import epath

from trainer import config as config_lib

log = logging.getLogger(__name__)

TRAIN_FILE, EVAL_FILE = "train.jsonl", "eval.jsonl"  # demo episodes under <workdir>/data
REPORT_KEYS = ("loss", "eval/loss", "grad_norm", "lr", "tree_token_ratio", "tokens_per_s*",
               "time/*")


# ----------------------------------------------------------------------------- inputs


def prepare_demo(config: ml_collections.ConfigDict, workdir: str) -> None:
  """The demo's inputs, made once per workdir (a resumed run reuses them, so its data and its
  iterator state still match): a sentencepiece tokenizer trained on scripted-episode text
  (tokenizer.train_vocab_size), then scripted episodes on generated tasks (data.demo) as chat
  records in <workdir>/data/{train,eval}.jsonl."""
  from envs.chat import load_tokenizer, make_chat
  from trainer.demo_data import chat_record, demo_corpus, demo_trajectories
  from trainer.sft_data import write_jsonl
  from trainer.tokenizer_train import train_tokenizer

  tok = config.tokenizer
  fmt = tok.chat_format
  if tok.train_vocab_size and not os.path.isfile(os.path.join(workdir, "tokenizer",
                                                               "tokenizer.model")):
    t0 = time.perf_counter()
    train_tokenizer(demo_corpus(fmt, tok.train_episodes), tok.train_vocab_size,
                    os.path.join(workdir, "tokenizer"), chat_format=fmt)
    _say(f"trained a {tok.train_vocab_size}-token sentencepiece tokenizer "
         f"({time.perf_counter() - t0:.1f}s)")
  demo = config.data.demo
  # training episodes on the "train" programs of envs.taskgen, held-out ones on "eval" programs
  # (which no training task of the SFT or the RL stage ever shares)
  todo = [(TRAIN_FILE, demo.episodes, "train"), (EVAL_FILE, demo.eval_episodes, "eval")]
  todo = [t for t in todo if t[1] and not os.path.isfile(os.path.join(workdir, "data", t[0]))]
  if not todo:
    return
  chat = make_chat(fmt, load_tokenizer(config_lib.tokenizer_source(config, workdir)))
  os.makedirs(os.path.join(workdir, "data"), exist_ok=True)
  for name, n, split in todo:
    t0 = time.perf_counter()
    trajectories = demo_trajectories(chat, n, level=demo.level, seed=demo.seed, split=split,
                                     error_rate=demo.error_rate,
                                     early_submit_rate=demo.early_submit_rate,
                                     sandbox=demo.sandbox)
    write_jsonl(os.path.join(workdir, "data", name), [chat_record(t) for t in trajectories])
    _say(f"recorded {n} demo episodes in {os.path.join(workdir, 'data', name)} "
         f"({time.perf_counter() - t0:.1f}s)")


def data_sources(config, workdir: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(training files, held-out files): the configured ones plus the generated demo episodes."""
  train, held_out = tuple(config.data.sources), tuple(config.data.eval_sources)
  if config.data.demo.episodes:
    train += (os.path.join(workdir, "data", TRAIN_FILE),)
  if config.data.demo.eval_episodes:
    held_out += (os.path.join(workdir, "data", EVAL_FILE),)
  return train, held_out


def initial_model(config, model_cfg):
  """The weights to start from: None (random init by state.create), an HF checkpoint, a
  `models.hf import` directory, or the latest checkpoint of an Arbor run's workdir."""
  from flax import nnx

  from models import hf
  from trainer import checkpoint, optimizers
  from trainer import state as state_lib

  kind, path = config_lib.init_kind(config.model.init)
  if kind == "random":
    return None
  if kind == "hf":
    return hf.load(path, **config_lib.overrides(config))
  if os.path.isdir(os.path.join(path, "state")):  # models.hf import output
    params, rest = state_lib.split_model(hf.restore(path))
  else:  # an Arbor run: rebuild its state's shapes from its own config, take the weights
    with open(os.path.join(path, "config.json")) as f:
      source = ml_collections.ConfigDict(json.load(f))
    with open(os.path.join(path, "model_config.json")) as f:
      source_cfg = hf.config_from_json(json.load(f))
    opt = optimizers.build(source.optimizer, source_cfg)
    ckpt = checkpoint.Checkpointer(os.path.join(path, "checkpoints"))
    try:
      restored = ckpt.restore_latest(state_lib.abstract(source_cfg, opt))
    finally:
      ckpt.close()
    if restored is None:
      raise config_lib.ConfigError(f"config.model.init={config.model.init!r}: no checkpoint "
                                   f"in {os.path.join(path, 'checkpoints')}")
    _say(f"starting from the weights of step {restored.step} of {path}")
    params, rest = restored.state.params, restored.state.model_state
  # the same arrays under this run's ModelConfig (overrides change numerics, not shapes)
  return nnx.merge(state_lib.graphdef(model_cfg), params, rest)


def write_run_files(config, model_cfg, workdir: str) -> None:
  """config.json and model_config.json in the workdir (primary process only)."""
  from models.hf import config_to_json

  if jax.process_index() != 0:
    return
  root = epath.Path(workdir)
  root.mkdir(parents=True, exist_ok=True)
  (root / "config.json").write_text(config.to_json_best_effort(indent=1))
  (root / "model_config.json").write_text(json.dumps(config_to_json(model_cfg), indent=1))


# ----------------------------------------------------------------------------- helpers


def trajectory_ids(mb) -> list[str]:
  """One id per trained trajectory of a step's MicroBatches, in batch order: the first 16 hex
  digits of sha256(sampled tokens, loss mask). Identical trajectories share an id."""
  valid = np.asarray(mb.seq_valid)
  tokens = np.asarray(mb.seq_tokens, np.int32)
  mask = np.asarray(mb.fields["loss_mask"], np.float32)
  out = []
  for m, s in zip(*np.nonzero(valid.any(-1))):
    v = valid[m, s]
    digest = hashlib.sha256(tokens[m, s][v].tobytes() + mask[m, s][v].tobytes())
    out.append(digest.hexdigest()[:16])
  return out


def make_evaluate(model_cfg, loss_cfg, batches: list, mesh):
  """evaluate(state) -> {"eval/loss": token-mean NLL of the trained tokens of `batches`
  (the SFT loss, without the MoE balance term), "eval/tokens": their count}."""
  from trainer import step as step_lib

  score = step_lib.make_score_fn(model_cfg, mesh=mesh)
  masks = []
  for b in batches:
    mask = np.asarray(b.seq_valid, np.float32) * np.asarray(b.fields["loss_mask"])
    if loss_cfg.mask_failed_turns:
      mask = mask * (1.0 - np.asarray(b.fields["failed"]))
    masks.append(mask)

  def evaluate(state) -> dict:
    nll, count = 0.0, 0.0
    for b, mask in zip(batches, masks):
      lp = np.asarray(jax.device_get(score(state, b)), np.float64)
      nll -= float((lp * mask).sum())
      count += float(mask.sum())
    return {"eval/loss": nll / max(count, 1.0), "eval/tokens": int(count)}

  return evaluate


def _say(message: str) -> None:
  """A progress line on stdout (primary process)."""
  if jax.process_index() == 0:
    print(f"sft: {message}", flush=True)


def _scalars(metrics: dict) -> dict:
  return {k: (v.item() if hasattr(v, "item") else v) for k, v in jax.device_get(metrics).items()}


# ----------------------------------------------------------------------------- the loop


def run(config: ml_collections.ConfigDict, workdir: str, mesh=None) -> dict:
  """Train (or resume training) to `config.train.steps`; returns a summary dict:
  {"steps": last step reached, "start_step": the step resumed from (0: fresh), "loss": the
  last step's loss, "first_loss", "eval_loss" (last, if any), "preempted", "data_exhausted",
  "checkpoint": last saved step, "report": paths, "metrics": metrics.jsonl path}.

  mesh: the device mesh (None: one device, parameters drawn on the host).
  """
  from envs.chat import load_tokenizer, make_chat
  from trainer import checkpoint, optimizers
  from trainer import metrics as metrics_lib
  from trainer import state as state_lib
  from trainer import step as step_lib
  from trainer.data import make_sft_dataset

  # CPU has no buffer donation: the warning says nothing the user can act on.
  warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
  train_cfg = config.train
  model_cfg = config_lib.model_config(config)
  loss_cfg = config_lib.loss_config(config)
  logdir = config.metrics.dir or os.path.join(workdir, "sft")

  # --- inputs
  if not config_lib.is_remote(workdir):
    os.makedirs(workdir, exist_ok=True)
  prepare_demo(config, workdir)
  write_run_files(config, model_cfg, workdir)
  chat = make_chat(config.tokenizer.chat_format,
                   load_tokenizer(config_lib.tokenizer_source(config, workdir)))
  if chat.tokenizer.vocab_size > model_cfg.vocab_size:
    raise config_lib.ConfigError(
        f"config.tokenizer: its vocabulary ({chat.tokenizer.vocab_size} tokens) is larger than "
        f"the model's vocab_size={model_cfg.vocab_size} (set model.overrides.vocab_size)")
  train_files, eval_files = data_sources(config, workdir)
  dataset = make_sft_dataset(config_lib.data_config(config, sources=train_files), chat)
  eval_batches = []
  if eval_files and train_cfg.eval_every:
    eval_ds = make_sft_dataset(config_lib.data_config(config, sources=eval_files, eval=True),
                               chat)
    eval_batches = [b["batch"] for b in itertools.islice(iter(eval_ds),
                                                         train_cfg.eval_batches or None)]

  # --- state: the latest checkpoint of this workdir, or a fresh one
  opt = optimizers.build(config.optimizer, model_cfg)
  ckpt = checkpoint.Checkpointer(
      os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep,
      save_every=train_cfg.checkpoint_every or train_cfg.steps,
      async_save=config.checkpoint.async_save)
  restored = ckpt.restore_latest(state_lib.abstract(model_cfg, opt, mesh))
  iterator = iter(dataset)
  if restored is not None:
    start, state = restored.step, restored.state
    iterator.set_state(restored.extra["data"])
    _say(f"resumed from the checkpoint of step {start} in {workdir}")
  else:
    start = 0
    state = state_lib.create(model_cfg, opt, seed=config.seed, mesh=mesh,
                             model=initial_model(config, model_cfg))
  _say(f"{model_cfg.attention} attention, {model_cfg.num_experts or 'no'} experts, "
       f"{model_cfg.num_layers} layers, vocab {model_cfg.vocab_size}; {dataset.num_groups} "
       f"trees per epoch; steps {start + 1}..{train_cfg.steps}")

  train_step = step_lib.make_train_step(model_cfg, loss_cfg, opt, mesh=mesh)
  evaluate = make_evaluate(model_cfg, loss_cfg, eval_batches, mesh) if eval_batches else None
  writer = metrics_lib.writer_for(config, logdir, start + 1,
                                  bar_keys=("loss", "eval/loss", "tokens_per_s"))
  guard = checkpoint.PreemptionGuard()
  timer = metrics_lib.Timer()
  summary = {"start_step": start, "steps": start, "preempted": False, "data_exhausted": False,
             "checkpoint": start if restored is not None else None}
  last_metrics: dict[str, Any] = {}
  try:
    for step in range(start + 1, train_cfg.steps + 1):
      with timer.phase("data"):
        try:
          item = next(iterator)
        except StopIteration:
          summary["data_exhausted"] = True
          log.warning("the data ended after step %d (data.num_epochs=%d)", step - 1,
                      config.data.num_epochs)
          break
      stats = item["stats"]
      with timer.phase("train", tokens=stats["row_tokens"]):
        state, step_metrics = train_step(state, item["batch"])
        step_metrics = _scalars(step_metrics)  # device_get: waits for the step
      metrics = {**step_metrics, **stats,
                 "tree_token_ratio": stats["linear_tokens"] / max(stats["row_tokens"], 1),
                 "trajectory_ids": trajectory_ids(item["batch"])}
      last = step == train_cfg.steps
      if evaluate is not None and (step % train_cfg.eval_every == 0 or last):
        with timer.phase("eval"):
          metrics.update(evaluate(state))
      times = timer.flush()
      metrics.update(times)
      metrics["tokens_per_s/linear"] = stats["linear_tokens"] / max(times["time/step"], 1e-9)
      # the line goes out before the save starts: a checkpoint never covers a step whose
      # metrics line is missing (resuming supersedes the lines after the checkpoint)
      writer.write(step, metrics)
      summary.setdefault("first_loss", metrics["loss"])
      summary["steps"], last_metrics = step, metrics
      if step % train_cfg.log_every == 0 or last:
        _say(f"step {step}: loss {metrics['loss']:.4f}"
             + (f", eval loss {metrics['eval/loss']:.4f}" if "eval/loss" in metrics else "")
             + f", {metrics.get('tokens_per_s', 0.0):.0f} tokens/s "
             f"({metrics['tokens_per_s/linear']:.0f} unpacked-equivalent)")
      stop = guard.should_stop(step)
      if stop or last or (train_cfg.checkpoint_every and step % train_cfg.checkpoint_every == 0):
        with timer.phase("checkpoint"):
          extra = {"data": iterator.get_state(), "policy_version": int(state.policy_version)}
          if ckpt.save(step, state, extra, force=True):
            summary["checkpoint"] = step
      if stop:
        summary["preempted"] = True
        log.warning("preempted: saved step %d and stopping", step)
        break
    if summary["steps"] > (summary["checkpoint"] or 0):  # data ended between checkpoints
      extra = {"data": iterator.get_state(), "policy_version": int(state.policy_version)}
      ckpt.save(summary["steps"], state, extra, force=True)
      summary["checkpoint"] = summary["steps"]
  finally:
    guard.close()
    writer.close()
    ckpt.close()  # waits until the last save is committed
  summary["loss"] = last_metrics.get("loss")
  summary["eval_loss"] = last_metrics.get("eval/loss")
  summary["metrics"] = os.path.join(logdir, metrics_lib.JSONL)
  report = metrics_lib.end_of_run_report(config, logdir, REPORT_KEYS,
                                         f"SFT {os.path.basename(workdir)}")
  if report:
    summary["report"] = report
  _say(f"steps {start + 1}..{summary['steps']} done, loss "
       f"{summary.get('first_loss', float('nan')):.4f} -> {summary['loss'] or float('nan'):.4f}"
       + (f", eval loss {summary['eval_loss']:.4f}" if summary["eval_loss"] is not None else "")
       + (" (preempted)" if summary["preempted"] else "") + f"; metrics in {logdir}")
  return summary
