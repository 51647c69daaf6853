"""Checkpoints: a small layer over orbax's `CheckpointManager` (docs/design.md §5).

    ckpt = Checkpointer(f"{workdir}/checkpoints", keep=3, save_every=50)
    ckpt.on_saved(lambda step, extra: queue.ack(extra["unacked_entry_ids"]))  # once durable
    restored = ckpt.restore_latest(abstract_state)          # None on a fresh workdir
    if restored:
      step, state, extra = restored                         # extra["consumed_ids"]: sorted list
    guard = PreemptionGuard()                               # SIGTERM, Ctrl-C: a flag, no exception
    for step in range(step + 1, total + 1):
      state = train_step(state, batch)
      stop = guard.should_stop(step)
      if stop or ckpt.should_save(step):                    # build `extra` only when saving
        extra = {"data": iterator.get_state(), "policy_version": v,
                 "consumed_ids": seen, "unacked_entry_ids": to_ack}
        ckpt.save(step, state, extra, force=stop)
      if stop:                                              # preempted: finish the save, exit 0
        ckpt.close()
        sys.exit(0)
    ckpt.close()

One checkpoint step is a directory `<directory>/<step>/` with three orbax items:
`state` (the train-state pytree, `StandardSave`: any nest of jax/numpy arrays, typed PRNG keys
and flax `nnx.State` included), `extra` (`JsonSave`: data-iterator state, engine policy
version, host RNG state, anything JSON) and `ids` (the consumed trajectory ids, see below).

**Atomicity.** Orbax writes a step into `<step>.orbax-checkpoint-tmp-<n>/`, writes
`commit_success.txt` last and renames the directory to `<step>/` (on GCS, where there is no
rename, the commit file alone marks a finished step). A process killed mid-save leaves only a
tmp directory, which step listings ignore and the next `Checkpointer` deletes (in the
background, before its first save); a step directory is never partially written. Deleting old
steps (keep-N) happens only after a newer step is committed, so a kill during a deletion can
leave an *older* step partially deleted (orbax then logs "Metadata file does not exist"; the
next save deletes it again) but never touches the latest one, which `restore_latest` uses.

**Durability notice.** `save` returns once orbax has copied the arrays to host memory (its
async contract: the next step may donate them); the write goes on in a background thread. Callbacks
registered with `on_saved(fn)` are called as `fn(step, extra)` (on a notifier thread, in step
order) only after the step is committed, so the trainer can acknowledge rollout-queue entries
then and not before (envs/queue.py). `extra` there is the saved JSON (deep copy), without
`consumed_ids`. Orbax's own `AsyncOptions.post_finalization_callback` is not used for this: it
runs *before* the rename that commits the step. `wait()` blocks until every save so far is
committed and its callbacks have run; a failed save or callback re-raises at the next `save`,
`wait` or `close`.

**Consumed trajectory ids** (`extra["consumed_ids"]`, any iterable of str) are stored as a
compact array rather than JSON: uuid4 hex ids (what `envs.trajectory` makes) as 16 raw bytes
each, other ids as zero-padded UTF-8 rows. Growth: 16 bytes per trajectory per checkpoint
(1M trajectories = 16 MB; a JSON list would be ~35 MB). The queue never re-delivers an acked
entry, so the trainer may prune the set to the ids of the last few checkpoints to bound it.

**Workdirs.** Paths go through `etils.epath`, so `gs://bucket/dir` is handled by orbax's GCS
path (commit file instead of rename) where `gcsfs` is installed: epath needs it for directory
operations, arrays go through tensorstore's own GCS driver. Without gcsfs a gs:// directory
fails at construction with an ImportError naming it. (Not exercised in tests: no network.)

**Multi-host.** Every process calls `save`/`restore` (orbax coordinates; the primary host
writes metadata). `PreemptionGuard` then uses JAX's preemption sync point (all hosts agree on
the step to save at) instead of a local signal handler.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import threading
from typing import Any, Callable, Iterable, NamedTuple, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)

IDS_KEY = "consumed_ids"  # the `extra` key stored as a compact array instead of JSON
_HEX_DIGITS = "0123456789abcdef"


class Restored(NamedTuple):
  """What `restore` returns: unpacks as `step, state, extra = restored`."""

  step: int
  state: Any
  extra: dict


def _all_hex(ids: list[str]) -> bool:
  """Whether every id is 32 lowercase hex digits (uuid4().hex); one C-level pass."""
  return all(len(i) == 32 for i in ids) and not "".join(ids).strip(_HEX_DIGITS)


def encode_ids(ids: Iterable[str]) -> dict[str, np.ndarray]:
  """Packs trajectory ids into compact arrays for a checkpoint's `ids` item.

  32-char lowercase hex ids (uuid4().hex) are packed to 16 bytes; any other id is stored as
  zero-padded UTF-8. Empty parts are left out (orbax cannot save zero-size arrays). Rows are
  in no particular order (sorting a million ids would cost seconds per save).

  Args:
    ids: str ids; duplicates are dropped.

  Returns:
    {"count": int64 [1] (the number n of unique ids), "hex": uint8 [k, 16],
    "text": uint8 [m, width]}, k + m = n.

  Raises:
    TypeError: an id is not a str.
    ValueError: an id ends with a NUL byte (the padding of "text" rows).
  """
  ids = list(set(ids))
  try:
    fast = _all_hex(ids)  # the usual case: one pass, no per-id Python work beyond len()
  except TypeError:
    fast = False
  if fast:
    hex_ids, text_ids = ids, []
  else:
    for i in ids:
      if not isinstance(i, str):
        raise TypeError(f"extra[{IDS_KEY!r}]: ids must be str, got {type(i).__name__} {i!r}")
    hex_ids = [i for i in ids if _all_hex([i])]
    text_ids = [i for i in ids if not _all_hex([i])]
  out = {"count": np.array([len(ids)], np.int64)}
  if hex_ids:
    out["hex"] = np.frombuffer(bytes.fromhex("".join(hex_ids)), np.uint8).reshape(-1, 16)
  if text_ids:
    raw = [i.encode() for i in text_ids]
    if any(r.endswith(b"\0") for r in raw):
      raise ValueError(f"extra[{IDS_KEY!r}]: an id ends with a NUL byte (it is the padding)")
    width = max(1, *(len(r) for r in raw))
    out["text"] = np.frombuffer(b"".join(r.ljust(width, b"\0") for r in raw),
                                np.uint8).reshape(-1, width)
  return out


def decode_ids(arrays: dict[str, Any]) -> list[str]:
  """Inverse of `encode_ids`.

  Args:
    arrays: `encode_ids`' output ("hex" and "text" may be missing).

  Returns:
    The ids, sorted.

  Raises:
    ValueError: the number of decoded ids differs from "count".
  """
  packed = np.asarray(arrays.get("hex", np.zeros((0, 16), np.uint8))).tobytes().hex()
  ids = [packed[k:k + 32] for k in range(0, len(packed), 32)]
  ids += [bytes(row).rstrip(b"\0").decode()
          for row in np.asarray(arrays.get("text", np.zeros((0, 1), np.uint8)))]
  count = int(np.asarray(arrays["count"])[0])
  if len(ids) != count:
    raise ValueError(f"checkpoint ids: decoded {len(ids)} ids, the checkpoint says {count}")
  return sorted(ids)


def _check_json(extra: dict) -> dict:
  """A deep copy of `extra` through JSON; errors name the offending key."""
  if not isinstance(extra, dict):
    raise TypeError(f"Checkpointer.save: extra must be a dict, got {type(extra).__name__}")
  try:
    return json.loads(json.dumps(extra))
  except (TypeError, ValueError):
    for key, value in extra.items():
      try:
        json.dumps(value)
      except (TypeError, ValueError) as e:
        raise TypeError(f"Checkpointer.save: extra[{key!r}] is not JSON-serialisable "
                        f"({type(value).__name__}: {e}); bytes must be decoded first, e.g. "
                        "a grain iterator state `.decode()`") from None
    raise


def _abstract(tree: Any) -> Any:
  """Shape/dtype/sharding leaves: restoring onto these places arrays on those shardings."""
  def leaf(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      return x
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
      return ocp.utils.to_shape_dtype_struct(x)
    return x  # python scalars and the like: orbax restores them as saved
  return jax.tree.map(leaf, tree)


class Checkpointer:
  """Atomic, async, keep-N checkpoints of (train state pytree, JSON extra) in `directory`.

  Args:
    directory: local path or `gs://...`; created if missing.
    keep: how many of the latest steps to keep (older ones are deleted after each save).
    save_every: `save(step)` writes only when `step % save_every == 0` (or `force=True`).
    best_metric: if set, also keep the `keep_best` steps with the best `metrics[best_metric]`
      (pass `metrics=` to `save`); `best_step()` names the best one.
    best_mode: "max" or "min" for `best_metric`.
    keep_best: how many best steps to keep besides the latest `keep`.
    async_save: write in a background thread (False: `save` returns when committed).

  Raises:
    ValueError: keep, save_every or keep_best < 1, or best_mode not "max"/"min".
  """

  def __init__(self, directory: str | os.PathLike, *, keep: int = 3, save_every: int = 1,
               best_metric: Optional[str] = None, best_mode: str = "max", keep_best: int = 1,
               async_save: bool = True):
    if keep < 1:
      raise ValueError(f"Checkpointer: keep must be >= 1, got {keep}")
    if save_every < 1:
      raise ValueError(f"Checkpointer: save_every must be >= 1, got {save_every}")
    if best_mode not in ("max", "min"):
      raise ValueError(f"Checkpointer: best_mode must be 'max' or 'min', got {best_mode!r}")
    if best_metric is not None and keep_best < 1:
      raise ValueError(f"Checkpointer: keep_best must be >= 1, got {keep_best}")
    self.directory = epath.Path(directory)
    policies = ocp.checkpoint_managers
    preserve = policies.LatestN(n=keep)
    best_fn = None
    if best_metric is not None:
      best_fn = lambda metrics: float(metrics[best_metric])
      # BestN keeps the last n after an ascending sort: reverse the sort for "min".
      preserve = policies.AnyPreservationPolicy([preserve, policies.BestN(
          get_metric_fn=best_fn, reverse=best_mode == "min", n=keep_best,
          keep_checkpoints_without_metrics=False)])
    self._best_metric = best_metric
    self._mngr = ocp.CheckpointManager(
        self.directory, item_names=("state", "extra", "ids"),
        options=ocp.CheckpointManagerOptions(
            save_interval_steps=save_every, preservation_policy=preserve,
            best_fn=best_fn, best_mode=best_mode,  # best_fn also makes orbax store metrics
            cleanup_tmp_directories=True,  # the debris of a save killed half-way
            enable_async_checkpointing=async_save))
    self._callbacks: list[Callable[[int, dict], None]] = []
    self._pending: queue.Queue = queue.Queue()
    self._error: Optional[BaseException] = None
    self._notifier = threading.Thread(target=self._notify_loop, name="checkpoint-notifier",
                                      daemon=True)
    self._notifier.start()

  # ---- saving ----

  def save(self, step: int, state: Any, extra: Optional[dict] = None, *,
           metrics: Optional[dict[str, float]] = None, force: bool = False) -> bool:
    """Starts saving `state` and `extra` as `step`.

    Blocks only while the previous save finishes and the arrays are copied to host memory.

    Args:
      step: the step number (the checkpoint's directory name).
      state: the train-state pytree (jax/numpy arrays, typed PRNG keys, `nnx.State`).
      extra: JSON-serialisable dict; `extra[IDS_KEY]` (an iterable of str) is stored compactly.
      metrics: name -> value for the `best_metric` preservation policy (required when the
        Checkpointer has a `best_metric`).
      force: save even when the step is not a multiple of `save_every`.

    Returns:
      Whether a save was started: False when the step is not a multiple of `save_every`
      (unless `force`) or is already saved (e.g. a preemption save right after a scheduled one).

    Raises:
      ValueError: `best_metric` missing from `metrics`.
      TypeError: `extra` is not a dict or a value is not JSON-serialisable (named).
      RuntimeError: an earlier save or `on_saved` callback failed.
    """
    self._raise_error()
    step = int(step)
    if not force and not self.should_save(step):
      return False  # before any work on `extra`: this runs every step
    if step in self._mngr.all_steps():
      log.info("checkpoint: step %d is already saved; skipping", step)
      return False
    if self._best_metric is not None and (metrics is None or self._best_metric not in metrics):
      raise ValueError(f"Checkpointer.save: best_metric {self._best_metric!r} missing from "
                       f"metrics {sorted(metrics or {})}")
    extra = dict(extra or {})
    ids = encode_ids(extra.pop(IDS_KEY, ()))
    extra = _check_json(extra)
    self._mngr.save(step, force=True, metrics=metrics, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave(extra),
        ids=ocp.args.StandardSave(ids)))
    self._pending.put((step, extra))
    return True

  def should_save(self, step: int) -> bool:
    """Whether `save(step)` would write: a multiple of `save_every`, later than the latest step.

    Lets the loop skip building an expensive `extra` on other steps.
    """
    return self._mngr.should_save(int(step))

  def on_saved(self, fn: Callable[[int, dict], None]) -> None:
    """Calls `fn(step, extra)` after each later save is committed (see the module doc)."""
    self._callbacks.append(fn)

  def _notify_loop(self) -> None:
    while True:
      item = self._pending.get()
      try:
        if item is None:
          return
        step, extra = item
        if self._error is None:
          try:
            self._mngr.wait_until_finished()  # joins orbax's finalize thread: step committed
            if not (self.directory / str(step)).exists():
              raise RuntimeError(f"checkpoint step {step} is not in {self.directory} after "
                                 "its save finished")
            for fn in self._callbacks:
              fn(step, extra)
          except BaseException as e:  # pylint: disable=broad-except
            log.exception("checkpoint: save or on_saved callback of step %d failed", step)
            self._error = e  # later saves are not announced: the caller must see this first
      finally:
        self._pending.task_done()

  def _raise_error(self) -> None:
    if self._error is not None:
      error, self._error = self._error, None
      raise RuntimeError(f"an earlier checkpoint save failed: {error!r}") from error

  def wait(self) -> None:
    """Blocks until every save so far is committed and its `on_saved` callbacks have run."""
    self._mngr.wait_until_finished()
    self._pending.join()
    self._raise_error()

  def close(self) -> None:
    """`wait()`, then release orbax's threads. Call before the process exits."""
    try:
      self.wait()
    finally:
      self._pending.put(None)
      self._notifier.join()
      self._mngr.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ---- restoring ----

  def all_steps(self) -> list[int]:
    """The committed steps, ascending."""
    return sorted(self._mngr.all_steps())

  def latest_step(self) -> Optional[int]:
    """The latest committed step, or None when there is none."""
    return self._mngr.latest_step()

  def best_step(self) -> Optional[int]:
    """The step with the best `best_metric` (the latest step if no metric is tracked)."""
    return self._mngr.best_step()

  def restore(self, step: int, abstract_state: Any = None) -> Restored:
    """Restores a saved step.

    Args:
      step: a committed step.
      abstract_state: a pytree like the saved state whose leaves are `jax.ShapeDtypeStruct`s
        (with `.sharding`: arrays are placed there, whatever sharding they were saved with) or
        concrete arrays (their shape/dtype/sharding are used); None restores as saved.

    Returns:
      Restored(step, state, extra); `extra[IDS_KEY]` comes back as a sorted list.

    Raises:
      FileNotFoundError: `step` is not saved in the directory.
    """
    if step not in self._mngr.all_steps():
      raise FileNotFoundError(f"Checkpointer.restore: step {step} is not in {self.directory}; "
                              f"saved steps: {self.all_steps()}")
    target = None if abstract_state is None else _abstract(abstract_state)
    out = self._mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), extra=ocp.args.JsonRestore(),
        ids=ocp.args.StandardRestore()))
    extra = dict(out.extra)
    extra[IDS_KEY] = decode_ids(out.ids)
    return Restored(int(step), out.state, extra)

  def restore_latest(self, abstract_state: Any = None) -> Optional[Restored]:
    """`restore` of the latest committed step, or None when there is none (a fresh run).

    Args:
      abstract_state: as for `restore`.
    """
    self._mngr.reload()  # another process may have written since construction
    step = self._mngr.latest_step()
    return None if step is None else self.restore(step, abstract_state)


class PreemptionGuard:
  """Turns SIGTERM (TPU preemption, `kill`) and Ctrl-C (SIGINT) into a flag the loop polls.

  Single process: installs handlers for `signals` that only set a flag (so no save is ever
  interrupted half-way by an exception); `should_stop(step)` returns it. Multi-host: installs
  nothing and asks JAX's preemption sync point instead, which makes every host return True at
  the same step (a host-local flag would leave the others waiting in a collective). The
  handlers must be installed from the main thread; `close()` restores the previous ones. A
  second Ctrl-C raises KeyboardInterrupt at once (no save).

  Args:
    signals: the signals to turn into the flag (single process only).
  """

  def __init__(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT)):
    self._flag = threading.Event()
    self._multihost = jax.process_count() > 1
    self._previous: dict[int, Any] = {}
    if not self._multihost:
      for sig in signals:
        self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum: int, frame: Any) -> None:
    del frame
    if signum == signal.SIGINT and self._flag.is_set():
      raise KeyboardInterrupt
    name = signal.Signals(signum).name
    log.warning("%s: will checkpoint and exit at the end of this step%s", name,
                " (Ctrl-C again: stop now, unsaved)" if signum == signal.SIGINT else "")
    self._flag.set()

  def should_stop(self, step: int) -> bool:
    """True when the loop should save now and exit. Call once per step on every host.

    Args:
      step: the current step (multi-host: the hosts agree on the step to stop at).
    """
    if self._multihost:
      try:
        return multihost_utils.reached_preemption_sync_point(step)
      except RuntimeError:  # the preemption service is off (jax_enable_preemption_service)
        return False
    return self._flag.is_set()

  def close(self) -> None:
    """Restores the signal handlers that were in place before the guard."""
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}
