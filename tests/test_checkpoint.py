"""trainer/checkpoint.py: round trips, keep-N, best-N, durability notices, kills and SIGTERM."""

import os
import random
import signal
import subprocess
import sys
import time
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tests import checkpoint_worker as worker
from tests.conftest import FAST_COMPILE_FLAGS
from trainer.checkpoint import IDS_KEY, Checkpointer, decode_ids, encode_ids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "checkpoint_worker.py")


def assert_trees_equal(a, b):
  leaves_a, tree_a = jax.tree.flatten(a)
  leaves_b, tree_b = jax.tree.flatten(b)
  assert tree_a == tree_b
  for x, y in zip(leaves_a, leaves_b):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      assert y.dtype == x.dtype
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    assert np.asarray(x).dtype == np.asarray(y).dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def make_state(seed=0):
  model = nnx.Linear(3, 4, rngs=nnx.Rngs(seed))
  params = {"w": jnp.arange(12.0).reshape(3, 4) + seed, "b": jnp.ones(4, jnp.bfloat16)}
  return {"params": params, "model": nnx.state(model),
          "opt": optax.adamw(1e-3).init(params),
          "step": jnp.int32(7), "rng": jax.random.key(seed)}


def test_round_trip(tmp_path):
  state = make_state()
  ids = {uuid.uuid4().hex for _ in range(1000)} | {"episode-7", "ünïcode"}
  extra = {"data": {"next_index": 12, "grain": '{"version": 2}'}, "policy_version": 3,
           "np_rng": np.random.default_rng(0).bit_generator.state,  # 128-bit ints
           "unacked_entry_ids": ["1-0", "1-1"], IDS_KEY: ids}
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.restore_latest(state) is None
    assert ckpt.save(7, state, extra)
  with Checkpointer(tmp_path) as ckpt:
    abstract = jax.eval_shape(lambda: make_state(1))  # ShapeDtypeStruct leaves
    step, restored, got = ckpt.restore_latest(abstract)
    assert step == 7
    assert_trees_equal(restored, state)
    assert isinstance(restored["model"], nnx.State)
    assert got == {**extra, IDS_KEY: sorted(ids)}
    assert_trees_equal(ckpt.restore(7, make_state(1)).state, state)  # concrete template
    assert ckpt.restore(7).state["params"]["w"].shape == (3, 4)      # no template


def test_ids_encoding():
  hex_ids = [uuid.uuid4().hex for _ in range(5000)]
  ids = hex_ids + ["a", "", "x" * 40, "ü", hex_ids[0].upper()]
  arrays = encode_ids(ids + hex_ids[:10])  # duplicates collapse
  assert arrays["hex"].shape == (5000, 16) and arrays["hex"].dtype == np.uint8  # 16 B each
  assert arrays["text"].shape[0] == 5
  assert decode_ids(arrays) == sorted(set(ids))
  assert decode_ids(encode_ids([])) == []
  with pytest.raises(TypeError, match="consumed_ids"):
    encode_ids([3])


def test_keep_n_latest_and_save_every(tmp_path):
  with Checkpointer(tmp_path, keep=2) as ckpt:
    for step in range(6):
      assert ckpt.save(step, {"x": jnp.full(3, step)}, {"step": step})
    assert not ckpt.save(5, {"x": jnp.zeros(3)}, force=True)  # already saved: skipped
  assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["4", "5"]
  with Checkpointer(tmp_path, keep=2, save_every=3) as ckpt:
    assert ckpt.all_steps() == [4, 5]
    step, state, extra = ckpt.restore_latest({"x": jnp.zeros(3, jnp.int32)})
    assert step == 5 and extra["step"] == 5 and state["x"].tolist() == [5, 5, 5]
    assert not ckpt.save(7, {"x": jnp.zeros(3)})            # 7 % 3 != 0
    assert ckpt.save(7, {"x": jnp.zeros(3)}, force=True)
    assert ckpt.save(9, {"x": jnp.zeros(3)})
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.latest_step() == 9 and ckpt.all_steps() == [7, 9]


@pytest.mark.parametrize("mode", ["max", "min"])
def test_best_metric_is_kept(tmp_path, mode):
  scores = [0.1, 0.9, 0.3, 0.05, 0.2]
  with Checkpointer(tmp_path, keep=1, best_metric="pass_rate", best_mode=mode) as ckpt:
    for step, score in enumerate(scores):
      ckpt.save(step, {"x": jnp.zeros(2)}, metrics={"pass_rate": score})
    ckpt.wait()
    best = int(np.argmax(scores) if mode == "max" else np.argmin(scores))
    assert ckpt.all_steps() == sorted({best, len(scores) - 1})
    assert ckpt.best_step() == best
    with pytest.raises(ValueError, match="pass_rate"):
      ckpt.save(10, {"x": jnp.zeros(2)}, metrics={"loss": 1.0})


def test_bad_arguments_name_the_field(tmp_path):
  with pytest.raises(ValueError, match="keep"):
    Checkpointer(tmp_path, keep=0)
  with pytest.raises(ValueError, match="best_mode"):
    Checkpointer(tmp_path, best_mode="up")
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(TypeError, match=r"extra\['data'\].*decode"):
      ckpt.save(0, {"x": jnp.zeros(2)}, {"data": b"grain state bytes"})
    with pytest.raises(FileNotFoundError, match="step 3"):
      ckpt.restore(3)


def test_on_saved_runs_only_after_commit(tmp_path):
  seen = []

  def on_saved(step, extra):
    final = tmp_path / str(step)
    tmp_dirs = [p.name for p in tmp_path.iterdir() if p.name.startswith(f"{step}.orbax")]
    seen.append((step, extra, final.is_dir() and (final / "commit_success.txt").exists(),
                 tmp_dirs))

  big = {"w": jnp.ones((256, 256))}  # big enough that the write outlives `save`'s return
  with Checkpointer(tmp_path, keep=10) as ckpt:
    ckpt.on_saved(on_saved)
    for step in range(4):
      ckpt.save(step, big, {"step": step, "unacked_entry_ids": [f"e{step}"],
                            IDS_KEY: [uuid.uuid4().hex]})
    ckpt.wait()  # returns after every callback ran
    assert [s for s, *_ in seen] == [0, 1, 2, 3]  # each once, in order
    for step, extra, committed, tmp_dirs in seen:
      assert committed and tmp_dirs == []
      assert extra == {"step": step, "unacked_entry_ids": [f"e{step}"]}  # ids left out


def test_failing_callback_surfaces(tmp_path):
  ckpt = Checkpointer(tmp_path)
  ckpt.on_saved(lambda step, extra: 1 / 0)
  ckpt.save(0, {"x": jnp.zeros(2)})
  with pytest.raises(RuntimeError, match="ZeroDivisionError"):
    ckpt.wait()
  ckpt.close()


# ---- subprocesses: kill -9, SIGTERM, shardings ----


class Worker:
  """tests/checkpoint_worker.py in a subprocess, its stdout in a file we poll."""

  def __init__(self, tmp_path, *args, env=None):
    self.out = tmp_path / f"out-{time.monotonic_ns()}.txt"
    with open(self.out, "w") as f:
      self.proc = subprocess.Popen(
          [sys.executable, WORKER, *map(str, args)], stdout=f, stderr=subprocess.STDOUT,
          cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})

  def lines(self):
    """The complete lines so far (the worker may be half-way through writing the last one)."""
    return self.out.read_text().split("\n")[:-1]

  def steps(self, word):
    return [int(line.split()[1]) for line in self.lines() if line.startswith(word + " ")]

  def wait_for(self, word, count=1, timeout=120):
    deadline = time.monotonic() + timeout
    try:
      while len(self.steps(word)) < count:
        if self.proc.poll() is not None or time.monotonic() > deadline:
          raise AssertionError(f"no {count} x {word!r} from the worker:\n" +
                               self.out.read_text())
        time.sleep(0.02)
    except BaseException:  # a failing test must not leave its worker looping
      self.proc.kill()
      raise

  def finish(self, timeout=120):
    try:
      return self.proc.wait(timeout)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      raise


def check_restored(directory, low, high):
  """The latest checkpoint is complete and consistent, with low <= step <= high."""
  with Checkpointer(directory) as ckpt:
    step, state, extra = ckpt.restore_latest(worker.state_for(0))
  assert low <= step <= high, (low, step, high)
  assert_trees_equal(state, worker.state_for(step))
  want = worker.extra_for(step)
  assert extra == {**want, IDS_KEY: sorted(want[IDS_KEY])}
  return step


def tmp_dirs(directory):
  return {p.name for p in directory.iterdir() if ".orbax-checkpoint-tmp" in p.name}


def test_kill_9_leaves_last_complete_checkpoint(tmp_path):
  rng = random.Random(0)
  directory = tmp_path / "ckpt"
  previous, debris, mid_save = -1, set(), 0
  for _ in range(3):
    w = Worker(tmp_path, "loop", directory, 10**6, 1)
    w.wait_for("resumed")
    assert w.steps("resumed") == [previous]  # resumes from the last check's step
    w.wait_for("durable", count=2)
    time.sleep(rng.uniform(0.0, 0.8))  # a random point, usually with a save in flight
    w.proc.send_signal(signal.SIGKILL)
    w.finish()
    assert not debris & tmp_dirs(directory)  # the last kill's half-written step: cleaned up
    debris = tmp_dirs(directory)
    mid_save += bool(debris)
    durable, started = w.steps("durable"), w.steps("step")
    # Every announced step is durable; a save started but not yet printed may be there too.
    previous = check_restored(directory, durable[-1], max(started, default=-1) + 1)
  print(f"{mid_save} of 3 kills interrupted a save")


def test_sigterm_saves_and_exits_0(tmp_path):
  w = Worker(tmp_path, "loop", tmp_path / "ckpt", 10**6, 10**6)  # scheduled save: step 0 only
  w.wait_for("step", count=4)
  w.proc.send_signal(signal.SIGTERM)
  assert w.finish() == 0
  (stopped,) = w.steps("preempted")
  assert stopped >= 4 and w.steps("durable")[-1] == stopped
  assert check_restored(tmp_path / "ckpt", stopped, stopped) == stopped


def test_restore_onto_other_shardings(tmp_path):
  w = Worker(tmp_path, "shard", tmp_path / "ckpt",
             env={"XLA_FLAGS": FAST_COMPILE_FLAGS + " --xla_force_host_platform_device_count=2"})
  assert w.finish() == 0, w.out.read_text()
  assert w.lines()[-1] == "ok"
