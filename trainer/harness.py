"""The run harness: what every training loop (SFT, RL, distillation) does around its steps.

    run = harness.Run(config, workdir, mesh)     # run files, optimizer, checkpointer, restore
    state = run.resume_or(lambda: initial_model(config, run.model_cfg, run.mesh))
    with run.loop(bar_keys=("loss",)):           # metrics writer, SIGTERM guard, phase timer
      for step in run.steps():                   # start + 1 .. train.steps
        ...                                      # the loop's own work, timed by run.timer
        if run.end_step(step, metrics, state, extra=lambda: {...}):
          break                                  # saved after SIGTERM: stop
    summary = run.finish(REPORT_KEYS, title)     # the end-of-run report

A loop keeps only its own steps; the harness owns the rest:
  - the workdir's run files (`config.json`, `model_config.json`; a later run's `ckpt:<workdir>`
    reads them), the optimizer, the checkpointer and the latest checkpoint (resuming is
    automatic: `run.restored` holds the step, the state and the loop's `extra`);
  - per step, `end_step`: the metrics line (it goes out before the save starts, so a checkpoint
    never covers a step whose line is missing), then a checkpoint on schedule
    (`train.checkpoint_every`), at the last step, or after SIGTERM (`checkpoint.PreemptionGuard`);
  - a loop's second state (e.g. RL's learned critic), `run.item(name, template)`: saved beside
    the TrainState at the same steps (`end_step(..., items={name: state})`) and restored with it;
  - on exit, the guard, the writer and the checkpointers are closed (the last save committed);
    `finish` draws the report (`metrics.report`) and returns the summary: "start_step",
    "steps", "preempted", "checkpoint" (last saved step), "metrics" (metrics.jsonl), "report".

`initial_model` is where a run's weights come from: random (`state.create` draws them), a
Hugging Face checkpoint, a `models.hf import` directory, or an Arbor run's workdir (whose
latest weights `run_weights` reads, e.g. to compare two runs).
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
import os
import warnings
from typing import Any, Callable, Iterator, Optional, Sequence

import jax
import ml_collections
from etils import epath
from flax import nnx

from configs import base
from models import hf, lora, transformer
from trainer import checkpoint, metrics, optim, report
from trainer import config as config_lib
from trainer import state as state_lib

log = logging.getLogger(__name__)


def initial_model(config: ml_collections.ConfigDict, model_cfg, mesh=None):
  """The weights a run starts from, as `config.model.init` says.

  Args:
    config: the run's config (`model.init`: "random" | "hf:<dir>" | "ckpt:<dir>").
    model_cfg: the run's ModelConfig (overrides change numerics, never shapes).
    mesh: the run's mesh: an HF checkpoint is read straight into its shardings, each process
      reading only the slices its devices hold (`models.hf.load`); None: the default device.

  Returns:
    None for "random" (`state.create` draws the weights), else a Transformer: an HF
    checkpoint, a `models.hf import` directory (its state/), or the latest checkpoint of an
    Arbor run's workdir (its TrainState rebuilt from the run's own config files).

  Raises:
    ConfigError: an Arbor workdir without a checkpoint.
  """
  kind, path = config_lib.init_kind(config.model.init)
  if kind == "random":
    return None
  if kind == "hf":
    over = config_lib.overrides(config)
    if "sharding_rules" in over:  # the changed rules, resolved against the checkpoint's
      over["sharding_rules"] = model_cfg.sharding_rules
    return hf.load(path, mesh=mesh, **over)
  if os.path.isdir(os.path.join(path, "state")):  # models.hf import output
    params, rest = state_lib.split_model(hf.restore(path))
  else:
    try:
      params, rest, step = run_weights(path)
    except FileNotFoundError as e:
      raise config_lib.ConfigError(f"config.model.init={config.model.init!r}: {e}") from None
    metrics.say(config.mode, f"starting from the weights of step {step} of {path}")
  # A plain source (full fine-tuning, an import) is the base: a LoRA run adds its adapters at
  # state.create. A LoRA source continues as it is when this run's adapter settings are its
  # own, else it is merged into a plain model first.
  adapted = any(jax.tree_util.keystr(path).endswith("_lora_a']")
                for path, _ in jax.tree_util.tree_leaves_with_path(params))
  if not adapted:
    return nnx.merge(state_lib.graphdef(lora.base_config(model_cfg)), params, rest)
  with open(os.path.join(path, "model_config.json")) as f:
    source_cfg = hf.config_from_json(json.load(f))
  model = nnx.merge(state_lib.graphdef(source_cfg), params, rest)
  same = lora.describe(source_cfg) == lora.describe(model_cfg)
  return model if same else transformer.merge_adapters(model)


def run_weights(workdir: str, step: Optional[int] = None) -> tuple[Any, Any, int]:
  """The model weights of a checkpoint of an Arbor run (the latest by default).

  The run's state shapes are rebuilt from its own config.json and model_config.json, so no
  config of the caller is needed (e.g. to compare the weights of two runs in a notebook).

  Args:
    workdir: the run's workdir (config.json, model_config.json, checkpoints/).
    step: the checkpoint's step; None: the latest.

  Returns:
    (params, model_state, step): the trainable parameters, the rest of the model's state
    (`state_lib.split_model`'s halves) and the checkpoint's step.

  Raises:
    FileNotFoundError: the workdir has no checkpoint (or not `step`).
  """
  with open(os.path.join(workdir, "config.json")) as f:
    source = ml_collections.ConfigDict(json.load(f))
  with open(os.path.join(workdir, "model_config.json")) as f:
    source_cfg = hf.config_from_json(json.load(f))
  opt = optim.build(source.optimizer, source_cfg)
  with checkpoint.Checkpointer(os.path.join(workdir, "checkpoints")) as ckpt:
    target = state_lib.without_base(state_lib.abstract(source_cfg, opt), source_cfg)
    restored = ckpt.restore_latest(target) if step is None else ckpt.restore(step, target)
  if restored is None:
    raise FileNotFoundError(f"no checkpoint in {os.path.join(workdir, 'checkpoints')}")
  state = restored.state
  if state_lib.frozen_paths(source_cfg):  # a LoRA run: its base from its own model.init
    _, base_state = state_lib.split_model(
        initial_model(source, source_cfg) or transformer.init(source_cfg, source.seed), source_cfg)
    state = state_lib.with_base(state, base_state, source_cfg)
  return state.params, state.model_state, restored.step


def write_run_files(config: ml_collections.ConfigDict, model_cfg, workdir: str) -> None:
  """Writes config.json and model_config.json into `workdir` (primary process only).

  A later run's `ckpt:<workdir>` (`initial_model`, `run_weights`) reads them.

  Args:
    config: the run's config.
    model_cfg: the run's ModelConfig.
    workdir: the run's workdir (local or gs://; created if missing).
  """
  if jax.process_index() != 0:
    return
  root = epath.Path(workdir)
  root.mkdir(parents=True, exist_ok=True)
  (root / "config.json").write_text(config.to_json_best_effort(indent=1))
  (root / "model_config.json").write_text(json.dumps(hf.config_to_json(model_cfg), indent=1))


# Fields a resumed run may change: the step budget, intervals, where and how outputs are
# written, throughput and implementation knobs that leave the numbers as they are.
RESUMABLE_FIELDS = ("train.steps", "optimizer.total_steps", "train.log_every",
                    "train.eval_every", "train.eval_batches", "train.checkpoint_every",
                    "checkpoint.*", "metrics.*", "compile_cache_dir", "mesh.*", "data.num_threads",
                    "data.prefetch", "rl.concurrency", "rl.cache_verdicts", "eval.*", "serve.*",
                    "model.overrides.attention_impl", "model.overrides.remat",
                    "model.overrides.logits_chunk", "model.overrides.moe_dispatch_chunk",
                    "model.overrides.sharding_rules.act_embed", "allow_config_change")


_MISSING = object()


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def config_changes(config: ml_collections.ConfigDict, workdir: str) -> list[tuple[str, Any, Any]]:
  """The fields outside RESUMABLE_FIELDS that differ from the workdir's config.json.

  Args:
    config: the config of the run about to resume.
    workdir: the workdir whose config.json the run was started with.

  Returns:
    [(dotted field, value the workdir's run was started with, value now)], sorted by field
    (None for a field only one side has); [] when the workdir has no config.json. A field the
    workdir's config.json lacks (added to Arbor since) is no change at its configs/base.py
    default.
  """
  path = epath.Path(workdir) / "config.json"
  if not path.exists():
    return []
  before = _flat(json.loads(path.read_text()))
  now = _flat(json.loads(config.to_json_best_effort()))
  defaults = _flat(json.loads(base.base_config().to_json_best_effort()))

  def new_at_default(k: str) -> bool:
    # a field added to Arbor after the workdir's run started, left at its default: the run
    # computes what it did (a demo's stage fields are "sft.<field>" / "rl.<field>")
    stage_free = k.split(".", 1)[-1]
    default = defaults.get(k, defaults.get(stage_free, _MISSING))
    return k not in before and now[k] == default

  return [(k, before.get(k), now.get(k)) for k in sorted(set(before) | set(now))
          if before.get(k) != now.get(k) and not new_at_default(k)
          and not any(fnmatch.fnmatchcase(k, p) for p in RESUMABLE_FIELDS)]


def check_resume_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Refuses to resume a workdir's checkpoint with a config that changes what the run computes.

  Args:
    config: the config of the run about to resume.
    workdir: the workdir holding the checkpoint and config.json.

  Raises:
    ConfigError: naming each changed field, unless `config.allow_config_change`.
  """
  changes = config_changes(config, workdir)
  if not changes or config.get("allow_config_change", False):
    return
  listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changes)
  raise config_lib.ConfigError(
      f"--workdir={workdir} holds a checkpoint of a run started with another config ({listed}). "
      "Use a new workdir, or resume with the change: --config.allow_config_change=True (fields "
      f"that may change on resume: {', '.join(RESUMABLE_FIELDS[:-1])})")


class Run:
  """One training run in a workdir: its state, checkpoints, metrics and preemption.

  Constructing it writes the run files and restores the latest checkpoint.

  Args:
    config: the run's validated config.
    workdir: the run's workdir (local or gs://).
    mesh: the device mesh the state is placed on (None: the default device).

  Raises:
    ConfigError: the workdir holds a checkpoint of a run with another config
      (`check_resume_config`).

  Attributes:
    config: as given.
    workdir: as given.
    mesh: as given.
    model_cfg: the run's ModelConfig (`config_lib.model_config`).
    optimizer: `optim.build(config.optimizer, model_cfg)`.
    checkpointer: the workdir's `checkpoints/` (keep-N, schedule, async saves).
    restored: the latest checkpoint (`checkpoint.Restored`), or None for a fresh run.
    start: the step resumed from (0: fresh).
    logdir: metrics.jsonl, TensorBoard events, the report (`metrics.dir` or <workdir>/<mode>).
    timer: the step's phase timer (inside `loop`).
    summary: the run's summary so far.
  """

  def __init__(self, config: ml_collections.ConfigDict, workdir: str, mesh=None):
    # CPU has no buffer donation: the warning says nothing the user can act on.
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    self.config, self.workdir, self.mesh = config, workdir, mesh
    self.model_cfg = config_lib.model_config(config)
    self.logdir = config.metrics.dir or os.path.join(workdir, config.mode)
    if not config_lib.is_remote(workdir):
      os.makedirs(workdir, exist_ok=True)
    train = config.train
    self.optimizer = optim.build(config.optimizer, self.model_cfg)
    self.checkpointer = checkpoint.Checkpointer(
        os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep,
        save_every=train.checkpoint_every or train.steps, async_save=config.checkpoint.async_save)
    if self.checkpointer.latest_step() is not None:
      try:
        check_resume_config(config, workdir)
      except config_lib.ConfigError:
        self.checkpointer.close()  # its background work ends before the process does
        raise
    write_run_files(config, self.model_cfg, workdir)
    self.restored = self.checkpointer.restore_latest(state_lib.without_base(
        state_lib.abstract(self.model_cfg, self.optimizer, mesh), self.model_cfg))
    self.start = self.restored.step if self.restored is not None else 0
    self.summary: dict[str, Any] = {"start_step": self.start, "steps": self.start,
                                    "preempted": False,
                                    "checkpoint": self.start if self.restored is not None else None}
    self.timer: Optional[metrics.Timer] = None
    self._writer: Optional[metrics.MetricsWriter] = None
    self._guard: Optional[checkpoint.PreemptionGuard] = None
    self._items: dict[str, checkpoint.Checkpointer] = {}

  def say(self, message: str) -> None:
    """A progress line `<mode>: message` (primary process)."""
    metrics.say(self.config.mode, message)

  def resume_or(self, initial: Callable[[], Any]) -> state_lib.TrainState:
    """The restored TrainState, or a fresh one.

    Args:
      initial: called only for a fresh run; returns the starting model, or None for random
        weights (e.g. `lambda: initial_model(config, run.model_cfg)`).
    """
    if self.restored is not None:
      self.say(f"resumed from the checkpoint of step {self.start} in {self.workdir}")
      if not state_lib.frozen_paths(self.model_cfg):
        return self.restored.state
      # a LoRA checkpoint holds no base: rebuilt from model.init as the run started
      fresh = state_lib.create(self.model_cfg, self.optimizer, seed=self.config.seed,
                               mesh=self.mesh, model=initial())
      return state_lib.with_base(self.restored.state, fresh.model_state, self.model_cfg)
    return state_lib.create(self.model_cfg, self.optimizer, seed=self.config.seed,
                            mesh=self.mesh, model=initial())

  def item(self, name: str, template: Any) -> Any:
    """Checkpoints a second state beside the TrainState (e.g. a learned critic's), at the same
    steps, in `<workdir>/<name>_checkpoints/`; `end_step` and `save` take it as `items[name]`.

    An item is saved synchronously before the TrainState, so every committed TrainState step
    has its item. Item steps after the resumed one (a save killed between the two) are
    deleted: the run samples those steps anew.

    Args:
      name: the item's name.
      template: a pytree like the item's state (concrete arrays or ShapeDtypeStructs), the
        shapes and placement the restored state takes.

    Returns:
      The item's state at the resumed step, or None for a fresh run.

    Raises:
      FileNotFoundError: the resumed step has no saved state of the item.
    """
    directory = epath.Path(self.workdir) / f"{name}_checkpoints"
    if directory.exists() and jax.process_index() == 0:
      for path in directory.iterdir():
        if path.name.isdigit() and int(path.name) > self.start:
          path.rmtree()
    ckpt = checkpoint.Checkpointer(directory, keep=self.config.checkpoint.keep, async_save=False)
    self._items[name] = ckpt
    if self.restored is None:
      return None
    saved = ckpt.all_steps()
    if self.start not in saved:
      ckpt.close()  # their background work ends before the process does
      self.checkpointer.close()
      raise FileNotFoundError(f"--workdir={self.workdir}: the checkpoint of step {self.start} "
                              f"has no {name!r} state in {directory} (saved steps: {saved}); "
                              "resume from a new workdir")
    return ckpt.restore(self.start, template).state

  @contextlib.contextmanager
  def loop(self, bar_keys: Sequence[str]) -> Iterator["Run"]:
    """Opens what the loop's steps need; on exit closes it and the checkpointer.

    The metrics writer (lines from `start + 1` on), the SIGTERM guard and the phase timer
    (`self.timer`) are open inside; leaving waits for the last save.

    Args:
      bar_keys: the metrics shown on the progress bar.

    Yields:
      The Run itself.
    """
    try:
      self._writer = metrics.writer_for(self.config, self.logdir, self.start + 1, bar_keys)
      self._guard = checkpoint.PreemptionGuard()
      self.timer = metrics.Timer()
      yield self
    finally:
      if self._guard is not None:
        self._guard.close()
      if self._writer is not None:
        self._writer.close()
      for ckpt in self._items.values():
        ckpt.close()
      self.checkpointer.close()

  def steps(self) -> range:
    """The steps left: start + 1 .. train.steps."""
    return range(self.start + 1, self.config.train.steps + 1)

  def should_log(self, step: int) -> bool:
    """Whether `step` gets a log line (every `train.log_every` steps and the last)."""
    return step % self.config.train.log_every == 0 or step == self.config.train.steps

  def end_step(self, step: int, line: dict, state, extra: Callable[[], dict],
               items: Optional[dict[str, Any]] = None) -> bool:
    """Writes the step's metrics line, then checkpoints on schedule, at the last step or after
    SIGTERM.

    Args:
      step: the step just done.
      line: the step's metrics, name -> value.
      state: the TrainState after the step.
      extra: returns the loop's resume data (JSON, see `checkpoint.Checkpointer.save`); called
        only when saving.
      items: the states of the items opened with `item`, by name.

    Returns:
      True when the run was preempted: the state is saved and the loop must stop.
    """
    self._writer.write(step, line)
    self.summary["steps"] = step
    train = self.config.train
    stop = self._guard.should_stop(step)
    if stop or step == train.steps or (train.checkpoint_every
                                       and step % train.checkpoint_every == 0):
      with self.timer.phase("checkpoint"):
        self.save(step, state, extra(), items)
    if stop:
      self.summary["preempted"] = True
      log.warning("preempted: saved step %d and stopping", step)
    return stop

  def save(self, step: int, state, extra: dict, items: Optional[dict[str, Any]] = None
           ) -> None:
    """Checkpoints the state now, whatever the schedule.

    Args:
      step: the checkpoint's step.
      state: the TrainState.
      extra: the loop's resume data (JSON, see `checkpoint.Checkpointer.save`).
      items: the states of the items opened with `item`, by name (all of them).

    Raises:
      ValueError: `items` does not name exactly the opened items.
    """
    items = items or {}
    if set(items) != set(self._items):
      raise ValueError(f"Run.save: items {sorted(items)}; the run checkpoints "
                       f"{sorted(self._items)}")
    for name, item_state in items.items():  # committed before the TrainState's save starts
      self._items[name].save(step, item_state, force=True)
    if self.model_cfg.lora_rank:  # adapters only; the base is this reference
      extra = {**extra, "lora_base": self.config.model.get("init", "random")}
    if self.checkpointer.save(step, state_lib.without_base(state, self.model_cfg), extra,
                              force=True):
      self.summary["checkpoint"] = step

  def finish(self, report_keys: Sequence[str], title: str) -> dict:
    """The run's summary, with the metrics path and the end-of-run report (if drawn).

    Args:
      report_keys: the report's panels: metric names or patterns (those not logged are left
        out).
      title: the report's title.

    Returns:
      The summary: "start_step", "steps", "preempted", "checkpoint" (last saved step),
      "metrics" (metrics.jsonl) and, when drawn, "report" ({"png", "html"} paths).
    """
    self.summary["metrics"] = os.path.join(self.logdir, metrics.JSONL)
    drawn = report.end_of_run_report(self.config, self.logdir, report_keys, title)
    if drawn:
      self.summary["report"] = drawn
    return self.summary
