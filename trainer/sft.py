"""The SFT loop: supervised fine-tuning on chat records / recorded trajectories as trees.

    summary = run(config, workdir, mesh)         # trainer.main --config=configs/sft_demo.py

One step = the next packed batch of the grain pipeline (trainer.data: records -> trajectory
trees -> fixed-shape micro-batches) -> the jitted train step (trainer.step) with the "sft" loss.
Error-masked SFT comes with the data: a turn whose tool call failed has loss_mask 0 (stays in
context, out of the loss); `loss.mask_failed_turns` also drops turns flagged `failed`.

Workdir layout (`--workdir`):
  config.json, model_config.json   the run's config and resolved ModelConfig (ckpt:<workdir>
                                   of a later run reads them; trainer.harness)
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
import logging
import os
import time

import jax
import ml_collections
import numpy as np

from trainer import config as config_lib
from trainer import harness, metrics
from trainer import step as step_lib
from trainer.data import make_sft_dataset
from trainer.demo_data import chat_record, demo_corpus, demo_trajectories
from trainer.sft_data import write_jsonl
from trainer.tokenizer_train import train_tokenizer

log = logging.getLogger(__name__)

TRAIN_FILE, EVAL_FILE = "train.jsonl", "eval.jsonl"  # demo episodes under <workdir>/data
REPORT_KEYS = ("loss", "eval/loss", "grad_norm", "lr", "tree_token_ratio", "tokens_per_s*",
               "time/*")


# ----------------------------------------------------------------------------- inputs


def prepare_demo(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Makes the demo's inputs, once per workdir.

  A resumed run reuses them, so its data and its iterator state still match: a sentencepiece
  tokenizer trained on scripted-episode text (tokenizer.train_vocab_size), then scripted episodes
  on generated tasks (data.demo) as chat records in <workdir>/data/{train,eval}.jsonl.

  Args:
    config: the run's config (reads `tokenizer` and `data.demo`).
    workdir: the run's directory; files already there are kept.
  """
  tok = config.tokenizer
  fmt = tok.chat_format
  if tok.train_vocab_size and not os.path.isfile(os.path.join(workdir, "tokenizer",
                                                               "tokenizer.model")):
    t0 = time.perf_counter()
    train_tokenizer(demo_corpus(fmt, tok.train_episodes), tok.train_vocab_size,
                    os.path.join(workdir, "tokenizer"), chat_format=fmt)
    metrics.say("sft", f"trained a {tok.train_vocab_size}-token sentencepiece tokenizer "
         f"({time.perf_counter() - t0:.1f}s)")
  demo = config.data.demo
  # training episodes on the "train" programs of envs.taskgen, held-out ones on "eval" programs
  # (which no training task of the SFT or the RL stage ever shares)
  todo = [(TRAIN_FILE, demo.episodes, "train"), (EVAL_FILE, demo.eval_episodes, "eval")]
  todo = [t for t in todo if t[1] and not os.path.isfile(os.path.join(workdir, "data", t[0]))]
  if not todo:
    return
  chat = config_lib.make_chat_format(config, config_lib.tokenizer_source(config, workdir))
  os.makedirs(os.path.join(workdir, "data"), exist_ok=True)
  for name, n, split in todo:
    t0 = time.perf_counter()
    trajectories = demo_trajectories(chat, n, level=demo.level, seed=demo.seed, split=split,
                                     error_rate=demo.error_rate,
                                     early_submit_rate=demo.early_submit_rate,
                                     sandbox=demo.sandbox,
                                     environment=demo.get("environment", ""))
    write_jsonl(os.path.join(workdir, "data", name), [chat_record(t) for t in trajectories])
    metrics.say("sft", f"recorded {n} demo episodes in {os.path.join(workdir, 'data', name)} "
         f"({time.perf_counter() - t0:.1f}s)")


def data_sources(config, workdir: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """Lists the run's SFT files: the configured ones plus the generated demo episodes.

  Args:
    config: the run's config (`data.sources`, `data.eval_sources`, `data.demo`).
    workdir: the run's directory (holding data/ of the demo).

  Returns:
    (training files, held-out files).
  """
  train, held_out = tuple(config.data.sources), tuple(config.data.eval_sources)
  if config.data.demo.episodes:
    train += (os.path.join(workdir, "data", TRAIN_FILE),)
  if config.data.demo.eval_episodes:
    held_out += (os.path.join(workdir, "data", EVAL_FILE),)
  return train, held_out



# ----------------------------------------------------------------------------- helpers


def trajectory_ids(mb) -> list[str]:
  """One id per trained trajectory of a step's MicroBatches, in batch order.

  An id is the first 16 hex digits of sha256(sampled tokens, loss mask); identical
  trajectories share an id.

  Args:
    mb: the step's MicroBatches (`seq_valid`, `seq_tokens`, the "loss_mask" field).

  Returns:
    The ids.
  """
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
  """Builds the held-out evaluation of an SFT run.

  Args:
    model_cfg: the trained model's ModelConfig.
    loss_cfg: the run's LossConfig (`mask_failed_turns` drops failed turns as in training).
    batches: the held-out MicroBatches, scored at every evaluation.
    mesh: the device mesh (None: one device).

  Returns:
    evaluate(state) -> {"eval/loss": token-mean NLL of the trained tokens of `batches` (the SFT
    loss, without the MoE balance term), "eval/tokens": their count}.
  """
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


def _scalars(metrics: dict) -> dict:
  return {k: (v.item() if hasattr(v, "item") else v) for k, v in jax.device_get(metrics).items()}


# ----------------------------------------------------------------------------- the loop


def run(config: ml_collections.ConfigDict, workdir: str, mesh=None) -> dict:
  """Train (or resume training) to `config.train.steps`.

  Args:
    config: a validated mode "sft" config.
    workdir: the run's directory (local or gs://); see the module docstring.
    mesh: the device mesh (None: one device, parameters drawn on the host).

  Returns:
    The harness summary ("start_step", "steps", "preempted", "checkpoint", "metrics",
    "report") plus "loss" (the last step's), "first_loss", "eval_loss" (the last, if any) and
    "data_exhausted".

  Raises:
    ConfigError: the tokenizer's vocabulary is larger than the model's vocab_size.
  """
  run = harness.Run(config, workdir, mesh)
  model_cfg, train = run.model_cfg, config.train
  loss_cfg = config_lib.loss_config(config)

  # --- inputs: the demo's generated data (if any), the tokenizer, the data pipelines
  prepare_demo(config, workdir)
  chat = config_lib.make_chat_format(config, config_lib.tokenizer_source(config, workdir))
  if chat.tokenizer.vocab_size > model_cfg.vocab_size:
    raise config_lib.ConfigError(
        f"config.tokenizer: its vocabulary ({chat.tokenizer.vocab_size} tokens) is larger than "
        f"the model's vocab_size={model_cfg.vocab_size} (set model.overrides.vocab_size)")
  train_files, eval_files = data_sources(config, workdir)
  dataset = make_sft_dataset(config_lib.data_config(config, sources=train_files), chat)
  eval_batches = []
  if eval_files and train.eval_every:
    eval_ds = make_sft_dataset(config_lib.data_config(config, sources=eval_files, eval=True),
                               chat)
    eval_batches = [b["batch"] for b in itertools.islice(iter(eval_ds),
                                                         train.eval_batches or None)]

  # --- state: the latest checkpoint of this workdir (data iterator included), or a fresh one
  state = run.resume_or(lambda: harness.initial_model(config, model_cfg, mesh))
  iterator = iter(dataset)
  if run.restored is not None:
    iterator.set_state(run.restored.extra["data"])
  run.say(f"{model_cfg.attention} attention, {model_cfg.num_experts or 'no'} experts, "
          f"{model_cfg.num_layers} layers, vocab {model_cfg.vocab_size}; {dataset.num_groups} "
          f"trees per epoch; steps {run.start + 1}..{train.steps}")
  train_step = step_lib.make_train_step(model_cfg, loss_cfg, run.optimizer, mesh=mesh)
  evaluate = make_evaluate(model_cfg, loss_cfg, eval_batches, mesh) if eval_batches else None

  def resume_data() -> dict:
    return {"data": iterator.get_state(), "policy_version": int(state.policy_version)}

  # --- the loop
  summary, last_line = run.summary, {}
  summary["data_exhausted"] = False
  with run.loop(bar_keys=("loss", "eval/loss", "tokens_per_s")):
    for step in run.steps():
      with run.timer.phase("data"):
        item = next(iterator, None)
      if item is None:
        summary["data_exhausted"] = True
        log.warning("the data ended after step %d (data.num_epochs=%d)", step - 1,
                    config.data.num_epochs)
        break
      stats = item["stats"]
      with run.timer.phase("train", tokens=stats["row_tokens"]):
        state, step_metrics = train_step(state, item["batch"])
        step_metrics = _scalars(step_metrics)  # device_get: waits for the step
      line = {**step_metrics, **stats,
              "tree_token_ratio": stats["linear_tokens"] / max(stats["row_tokens"], 1),
              "trajectory_ids": trajectory_ids(item["batch"])}
      if evaluate is not None and (step % train.eval_every == 0 or step == train.steps):
        with run.timer.phase("eval"):
          line.update(evaluate(state))
      times = run.timer.flush()
      line.update(times)
      line["tokens_per_s/linear"] = stats["linear_tokens"] / max(times["time/step"], 1e-9)
      summary.setdefault("first_loss", line["loss"])
      last_line = line
      if run.should_log(step):
        run.say(f"step {step}: loss {line['loss']:.4f}"
                + (f", eval loss {line['eval/loss']:.4f}" if "eval/loss" in line else "")
                + f", {line.get('tokens_per_s', 0.0):.0f} tokens/s "
                f"({line['tokens_per_s/linear']:.0f} unpacked-equivalent)")
      if run.end_step(step, line, state, resume_data):
        break
    if summary["steps"] > (summary["checkpoint"] or 0):  # the data ended between checkpoints
      run.save(summary["steps"], state, resume_data())

  # --- the end
  summary["loss"] = last_line.get("loss")
  summary["eval_loss"] = last_line.get("eval/loss")
  run.finish(REPORT_KEYS, f"SFT {os.path.basename(workdir)}")
  run.say(f"steps {run.start + 1}..{summary['steps']} done, loss "
          f"{summary.get('first_loss', float('nan')):.4f} -> {summary['loss'] or float('nan'):.4f}"
          + (f", eval loss {summary['eval_loss']:.4f}" if summary["eval_loss"] is not None
             else "") + (" (preempted)" if summary["preempted"] else "")
          + f"; metrics in {run.logdir}")
  return summary
