"""Metrics: JSONL + TensorBoard (+ Weights & Biases) per step, a progress bar, phase timers.

    writer = MetricsWriter(f"{workdir}/rl", total_steps=cfg.steps, start_step=step + 1)
    timer = Timer()
    for step in ...:
      with timer.phase("rollout", tokens=n_sampled): ...
      with timer.phase("train", tokens=n_trained): state = jax.block_until_ready(train(...))
      writer.write(step, {"loss": loss, "reward": {"mean": r.mean()}, **timer.flush()})
    writer.close()
    trainer.report.report(f"{workdir}/rl")        # report.png + report.html from metrics.jsonl

`write(step, metrics)` flattens nested dicts with "/" ("reward/mean") and writes:
- `<logdir>/metrics.jsonl`: one JSON object per call, `{"step": N, "wall_time": unix seconds, ...}`,
  flushed at once (a kill loses nothing written). Values are converted to plain Python (numpy
  and 0-d jax arrays become numbers, arrays become lists); non-finite floats are written as
  Python's json writes them (NaN, Infinity). Lists and strings (e.g. the ids of the trajectories
  a step trained) go here only.
- `<logdir>/events.out.tfevents.*`: TensorBoard scalars (numbers only), written by a small
  encoder of the Event protobuf in TFRecord framing, so neither TensorFlow nor tensorboard is
  a dependency.
- Weights & Biases, when `wandb_project` is given and `wandb` is installed (never required; a
  missing package is a warning). The run id is kept in `<logdir>/wandb_run_id` so a resumed
  run continues the same W&B run. `WANDB_MODE=offline|disabled` work as usual.
- The progress bar (tqdm: rate and ETA; none when stderr is not a terminal) shows `bar_keys`
  that the metrics contain.

**Resuming.** A run restored from the checkpoint of step s passes `start_step=s + 1`: lines of
steps >= start_step already in metrics.jsonl (trained before a crash, lost with it), and a
last line a kill cut short, are moved to `metrics.superseded.jsonl`; the new event file starts
with a SessionLog START at start_step, on which TensorBoard drops the older events of those
steps. So metrics.jsonl always describes the lineage of the latest checkpoint, and e.g. "no
trajectory trained twice" can be asserted over the ids it logs. `start_step=0` (the default)
supersedes everything already there.

Only the primary process (`jax.process_index() == 0`) writes; on the others every method is a
no-op. `logdir` must be a local path (JSONL appends and event files are not possible on
object stores; copy the directory to gs:// at the end if needed).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import os
import socket
import struct
import sys
import time
from typing import Any, Iterator, Mapping, Optional, Sequence

import google_crc32c
import jax
import numpy as np
import tqdm

log = logging.getLogger(__name__)

JSONL = "metrics.jsonl"
SUPERSEDED = "metrics.superseded.jsonl"
DEFAULT_BAR_KEYS = ("loss", "reward/mean", "pass_rate", "kl", "tokens_per_s")


def flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """Flattens nested metrics with "/": {"a": {"b": 1}} -> {"a/b": 1}.

  Args:
    metrics: name -> value or nested mapping.
    prefix: prepended to every name.

  Returns:
    The flat dict, values converted to plain Python (`to_python`).
  """
  out = {}
  for key, value in metrics.items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping):
      out.update(flatten(value, name + "/"))
    else:
      out[name] = to_python(value)
  return out


def to_python(value: Any) -> Any:
  """numpy / jax scalars -> int/float/bool, arrays -> (nested) lists; others unchanged."""
  if hasattr(value, "__array__") and not isinstance(value, (str, bytes)):
    array = np.asarray(value)
    return array.item() if array.ndim == 0 else array.tolist()
  if isinstance(value, (list, tuple)):
    return [to_python(v) for v in value]
  return value


def is_scalar(value: Any) -> bool:
  """Whether a `to_python` value is a number (what TensorBoard and W&B receive)."""
  return isinstance(value, (int, float))  # bool is an int


def _step_of(line: str) -> Optional[int]:
  """The step of a JSONL line, or None for a line a kill cut short."""
  try:
    return int(json.loads(line)["step"])
  except (ValueError, KeyError, TypeError):
    return None


def read_jsonl(path: str | os.PathLike) -> dict[int, dict[str, Any]]:
  """Reads a metrics.jsonl file.

  A malformed line (the last one, cut short by a kill) is skipped with a warning.

  Args:
    path: the metrics.jsonl file.

  Returns:
    {step: merged metrics} in step order; later lines of a step update earlier ones.
  """
  steps: dict[int, dict[str, Any]] = collections.defaultdict(dict)
  with open(path) as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
        steps[int(record["step"])].update(record)
      except (ValueError, KeyError, TypeError):
        log.warning("metrics: skipping malformed line %d of %s", n, path)
  return dict(sorted(steps.items()))


# ---- TensorBoard event files, hand-encoded ----
# Event (tensorflow/core/util/event.proto): wall_time = 1 (double), step = 2 (int64),
# oneof {file_version = 3 (string), summary = 5 (Summary), session_log = 7 (SessionLog)}
# (6 is the deprecated LogMessage).
# Summary: value = 1 (repeated Value); Value: tag = 1 (string), simple_value = 2 (float).
# SessionLog: status = 1 (enum; START = 1).


def _varint(n: int) -> bytes:
  n &= (1 << 64) - 1  # negative int64s are 10-byte two's complement varints
  out = bytearray()
  while True:
    byte, n = n & 0x7F, n >> 7
    out.append(byte | (0x80 if n else 0))
    if not n:
      return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
  """A length-delimited field (wire type 2)."""
  return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(step: int, wall_time: float, *, file_version: str = "",
           scalars: Optional[Mapping[str, float]] = None, session_start: bool = False) -> bytes:
  out = _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3) + _varint(step)
  if file_version:
    out += _field(3, file_version.encode())
  if scalars:
    values = b"".join(
        _field(1, _field(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", value))
        for tag, value in scalars.items())
    out += _field(5, values)
  if session_start:
    out += _field(7, _varint(1 << 3) + _varint(1))
  return out


def _masked_crc(data: bytes) -> bytes:
  crc = google_crc32c.value(data)
  return struct.pack("<I", ((crc >> 15 | crc << 17) + 0xA282EAD8) & 0xFFFFFFFF)


def tfrecord(data: bytes) -> bytes:
  """TFRecord framing: length, masked crc32c of the length, data, masked crc32c of the data."""
  length = struct.pack("<Q", len(data))
  return length + _masked_crc(length) + data + _masked_crc(data)


class EventFile:
  """An append-only TensorBoard event file of scalar summaries, flushed after each write.

  Args:
    logdir: the directory the new file is created in.
    start_step: when set, a SessionLog START at this step makes TensorBoard drop the older
      events of steps >= start_step.
  """

  def __init__(self, logdir: str | os.PathLike, start_step: Optional[int] = None):
    name = f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}.{os.getpid()}"
    self.path = os.path.join(logdir, name)
    self._file = open(self.path, "ab")
    self._append(_event(0, time.time(), file_version="brain.Event:2"))
    if start_step is not None:  # TensorBoard drops earlier events of steps >= start_step
      self._append(_event(start_step, time.time(), session_start=True))

  def _append(self, event: bytes) -> None:
    self._file.write(tfrecord(event))
    self._file.flush()

  def scalars(self, step: int, scalars: Mapping[str, float], wall_time: float) -> None:
    """Appends one event with the scalars (none: nothing is written).

    Args:
      step: the step.
      scalars: tag -> value (stored as float32).
      wall_time: unix seconds.
    """
    if scalars:
      self._append(_event(step, wall_time, scalars=scalars))

  def close(self) -> None:
    """Closes the file."""
    self._file.close()


class MetricsWriter:
  """Per-step metrics to JSONL, TensorBoard, W&B and a progress bar (see the module doc).

  Args:
    logdir: local directory (created) for metrics.jsonl and event files.
    total_steps: the progress bar's total (None: no bar total).
    start_step: the first step this run will write; see "Resuming" in the module doc.
    bar_keys: metrics shown on the progress bar when present.
    tensorboard: write event files.
    progress: show the progress bar.
    wandb_project: W&B project (None: no W&B).
    wandb_config: logged as the W&B run's config.
    primary: whether this process writes (default: `jax.process_index() == 0`).

  Raises:
    ValueError: logdir is not a local path.
  """

  def __init__(self, logdir: str | os.PathLike, *, total_steps: Optional[int] = None,
               start_step: int = 0, bar_keys: Sequence[str] = DEFAULT_BAR_KEYS,
               tensorboard: bool = True, progress: bool = True,
               wandb_project: Optional[str] = None, wandb_config: Optional[dict] = None,
               primary: Optional[bool] = None):
    if "://" in str(logdir):
      raise ValueError(f"MetricsWriter: logdir must be a local path, got {str(logdir)!r}")
    if primary is None:
      primary = jax.process_index() == 0
    self.primary = primary
    self.logdir = str(logdir)
    self.bar_keys = tuple(bar_keys)
    self._jsonl = self._events = self._bar = self._wandb = None
    if not primary:
      return
    os.makedirs(self.logdir, exist_ok=True)
    self._supersede(start_step)
    self._jsonl = open(os.path.join(self.logdir, JSONL), "a")
    if tensorboard:
      self._events = EventFile(self.logdir, start_step)
    if progress:
      # steps before start_step are done: the bar starts at their count
      self._bar = tqdm.tqdm(total=total_steps, initial=max(start_step - 1, 0), unit="step",
                            dynamic_ncols=True)
    if wandb_project:
      self._wandb = self._start_wandb(wandb_project, wandb_config)

  def _supersede(self, start_step: int) -> None:
    """Moves lines of steps >= start_step (and a line cut short by a kill) from metrics.jsonl
    to metrics.superseded.jsonl."""
    path = os.path.join(self.logdir, JSONL)
    if not os.path.exists(path):
      return
    with open(path) as f:
      lines = [line.rstrip("\n") + "\n" for line in f if line.strip()]
    keep, moved = [], []
    for line in lines:
      step = _step_of(line)
      (keep if step is not None and step < start_step else moved).append(line)
    if not moved:
      return
    with open(os.path.join(self.logdir, SUPERSEDED), "a") as f:
      f.writelines(moved)
    with open(path + ".tmp", "w") as f:
      f.writelines(keep)
    os.replace(path + ".tmp", path)  # atomic: a kill here leaves the old or the new file
    log.info("metrics: moved %d lines of steps >= %d to %s", len(moved), start_step,
             SUPERSEDED)

  def _start_wandb(self, project: str, config: Optional[dict]):
    try:
      import wandb
    except ImportError:
      log.warning("metrics: wandb_project=%r but wandb is not installed; W&B logging is off",
                  project)
      return None
    id_path = os.path.join(self.logdir, "wandb_run_id")
    run_id = open(id_path).read().strip() if os.path.exists(id_path) else None
    run = wandb.init(project=project, config=config, dir=self.logdir, id=run_id,
                     resume="allow")
    if run is not None and getattr(run, "id", None) and run_id is None:
      with open(id_path, "w") as f:
        f.write(run.id)
    return wandb

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    """Records the step's metrics everywhere (see the module doc).

    Args:
      step: the step.
      metrics: name -> value or nested mapping (flattened with "/"); numbers also go to
        TensorBoard, W&B and the bar, lists and strings to metrics.jsonl only.
    """
    if not self.primary:
      return
    step = int(step)
    flat = flatten(metrics)
    now = time.time()
    self._jsonl.write(json.dumps({"step": step, "wall_time": now, **flat}) + "\n")
    self._jsonl.flush()
    scalars = {k: float(v) for k, v in flat.items() if is_scalar(v)}
    if self._events is not None:
      self._events.scalars(step, scalars, now)
    if self._wandb is not None:
      self._wandb.log(scalars, step=step)
    if self._bar is not None:
      shown = {k: f"{scalars[k]:.4g}" for k in self.bar_keys if k in scalars}
      self._bar.set_postfix(shown, refresh=False)
      self._bar.update(max(0, step - self._bar.n))  # steps count from 1; redraws <= 10/s

  def close(self) -> None:
    """Closes every output (the W&B run finishes); later writes are not allowed."""
    if self._jsonl is not None:
      self._jsonl.close()
    if self._events is not None:
      self._events.close()
    if self._bar is not None:
      self._bar.close()
    if self._wandb is not None:
      self._wandb.finish()
    self._jsonl = self._events = self._bar = self._wandb = None

  def __enter__(self) -> "MetricsWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def writer_for(config, logdir: str, start_step: int, bar_keys: Sequence[str]) -> MetricsWriter:
  """The MetricsWriter of a trainer run.

  Args:
    config: the run's config (`config.train.steps` steps, `config.metrics` outputs; the whole
      config is W&B's run config).
    logdir: the run's metrics directory.
    start_step: the first step this run writes (see "Resuming" in the module doc).
    bar_keys: the metrics shown on the progress bar (shown only on a terminal).

  Returns:
    The writer (primary process: open; others: no-op).
  """
  m = config.metrics
  return MetricsWriter(logdir, total_steps=config.train.steps, start_step=start_step,
                       bar_keys=bar_keys, tensorboard=m.tensorboard,
                       progress=m.progress and sys.stderr.isatty(),  # no bar in logs
                       wandb_project=m.wandb_project or None, wandb_config=config.to_dict())


class Timer:
  """Wall time per phase of a step, and tokens per second.

  `with timer.phase(name, tokens=n)` adds the block's wall time (and n tokens) to `name`;
  a phase may run several times per step. JAX dispatch is asynchronous: block on the phase's
  outputs inside the block (`jax.block_until_ready`), or its time lands in a later phase.
  `flush()` returns {"time/<phase>": s, "time/step": s since the last flush,
  "tokens_per_s": tokens of all phases / step time, "tokens_per_s/<phase>": phase tokens /
  phase time (phases given tokens only)} and starts the next step.
  """

  def __init__(self):
    self._start = time.perf_counter()
    self._seconds: dict[str, float] = collections.defaultdict(float)
    self._tokens: dict[str, int] = collections.defaultdict(int)

  @contextlib.contextmanager
  def phase(self, name: str, tokens: int = 0) -> Iterator[None]:
    """Adds the block's wall time, and `tokens`, to phase `name`.

    Args:
      name: the phase (reported as "time/<name>").
      tokens: tokens the block processed (0: the phase has no throughput).
    """
    start = time.perf_counter()
    try:
      yield
    finally:
      self._seconds[name] += time.perf_counter() - start
      self._tokens[name] += int(tokens)

  def flush(self) -> dict[str, float]:
    """The step's times and throughputs (the class doc); starts the next step."""
    now = time.perf_counter()
    step_time = now - self._start
    out = {f"time/{name}": s for name, s in self._seconds.items()}
    out["time/step"] = step_time
    total = sum(self._tokens.values())
    if total:
      out["tokens_per_s"] = total / step_time if step_time > 0 else math.inf
    for name, n in self._tokens.items():
      if n and self._seconds[name] > 0:
        out[f"tokens_per_s/{name}"] = n / self._seconds[name]
    self._start = now
    self._seconds.clear()
    self._tokens.clear()
    return out


def say(who: str, message: str) -> None:
  """Prints a progress line `who: message` on stdout, from the primary process only.

  The line is written around any progress bar on the terminal.

  Args:
    who: the line's prefix, e.g. the mode.
    message: the text.
  """
  if jax.process_index() == 0:
    tqdm.tqdm.write(f"{who}: {message}", file=sys.stdout)
    sys.stdout.flush()
