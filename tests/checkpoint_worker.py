"""Subprocess for tests/test_checkpoint.py (kill, SIGTERM and sharding tests).

    python tests/checkpoint_worker.py loop DIR STEPS SAVE_EVERY
      A toy training loop: resumes from DIR, then for each step builds a state whose every
      leaf equals the step, saves it (async) and polls a PreemptionGuard. Prints
      "resumed S", "step N" after each step's save was started, "durable N" from on_saved,
      and "preempted N" after a SIGTERM save, then exits 0.
    python tests/checkpoint_worker.py shard DIR
      On 2 CPU devices: saves an array sharded over both, restores it replicated and sharded
      along the other axis; prints "ok".
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def state_for(step: int):
  """Every leaf is a function of `step` alone, so a mixed (partial) restore is detectable."""
  import jax
  import jax.numpy as jnp
  return {"params": {"w": jnp.full((64, 64), step, jnp.float32),
                     "b": jnp.full((8,), step, jnp.bfloat16)},
          "opt": ({"mu": jnp.full((64, 64), -step, jnp.float32)}, jnp.int32(step)),
          "step": jnp.int32(step), "rng": jax.random.key(step)}


def extra_for(step: int) -> dict:
  return {"step": step, "data": {"next_index": 3 * step}, "policy_version": step // 2,
          "consumed_ids": [f"{k:032x}" for k in range(4 * (step + 1))] + [f"t-{step}"]}


def loop(directory: str, steps: int, save_every: int) -> None:
  from trainer.checkpoint import Checkpointer, PreemptionGuard

  def say(*words):
    print(*words, flush=True)

  ckpt = Checkpointer(directory, keep=2, save_every=save_every)
  ckpt.on_saved(lambda step, extra: say("durable", step))
  guard = PreemptionGuard()
  restored = ckpt.restore_latest(state_for(0))
  start = restored.step + 1 if restored else 0
  say("resumed", restored.step if restored else -1)
  for step in range(start, start + steps):
    state, extra = state_for(step), extra_for(step)
    if guard.should_stop(step):
      ckpt.save(step, state, extra, force=True)
      ckpt.close()
      say("preempted", step)
      sys.exit(0)
    ckpt.save(step, state, extra)
    say("step", step)
  ckpt.close()
  say("done")


def shard(directory: str) -> None:
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  from trainer.checkpoint import Checkpointer

  assert jax.device_count() == 2, jax.devices()
  mesh = jax.make_mesh((2,), ("x",))
  value = np.arange(32, dtype=np.float32).reshape(8, 4)
  saved = jax.device_put(value, NamedSharding(mesh, P("x", None)))
  with Checkpointer(directory) as ckpt:
    ckpt.save(1, {"w": saved}, {"note": "sharded"})
  for spec in (P(), P(None, "x")):
    target = {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=NamedSharding(mesh, spec))}
    with Checkpointer(directory) as ckpt:
      step, state, extra = ckpt.restore_latest(target)
    assert state["w"].sharding == target["w"].sharding, (state["w"].sharding, spec)
    np.testing.assert_array_equal(np.asarray(state["w"]), value)
    assert extra["note"] == "sharded" and step == 1
  print("ok", flush=True)


if __name__ == "__main__":
  mode = sys.argv[1]
  if mode == "loop":
    loop(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
  elif mode == "shard":
    shard(sys.argv[2])
  else:
    raise SystemExit(f"unknown mode {mode!r}")
