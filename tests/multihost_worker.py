"""One process of tests/test_multihost.py: two GRPO train steps of a tiny model on a 4-device
mesh, the results written to a JSON file (and the updated parameters to an .npz beside it).

    python -m tests.multihost_worker OUT.json [dense|moe_mla]

Single process: XLA_FLAGS=--xla_force_host_platform_device_count=4. Two processes: each with
2 simulated devices, ARBOR_NUM_PROCESSES=2, ARBOR_PROCESS_ID=0/1 and JAX_COORDINATOR_ADDRESS
(loopback), started through `trainer.distributed.initialize` as trainer.main does. Every
process builds the same model, optimizer and micro-batches from fixed seeds; the state is
created directly sharded on the mesh (parameters split across both processes with fsdp=4).
The test uses the dense model; moe_mla (router bias, expert load) passes too but compiles about
2x longer.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from trainer import distributed

MESH = dict(data=1, fsdp=4)


def make_groups():
  """Two groups of four trajectories (a shared prompt per group, a two-call trajectory whose
  second call extends the first) with sampler log-probs and advantages."""
  from rl.tree import CallTokens, TrajectoryTokens
  rng = np.random.default_rng(3)
  groups = []
  for g in range(2):
    prompt = rng.integers(1, 128, 12 + 4 * g).tolist()
    group = []
    for i in range(4):
      out = rng.integers(1, 128, 6 + i).tolist()
      lp = (-4.85 + rng.uniform(-0.3, 0.3, len(out))).tolist()  # ≈ the model's ln(1/128)
      calls = [CallTokens(prompt, out, {"logprobs": lp})]
      if i == 3:  # a second turn: context = first call + an observation
        obs = rng.integers(1, 128, 5).tolist()
        out2 = rng.integers(1, 128, 4).tolist()
        calls.append(CallTokens(prompt + out + obs, out2,
                                {"logprobs": (-4.85 + rng.uniform(-0.3, 0.3, 4)).tolist()}))
      group.append(TrajectoryTokens(calls, {"advantage": float(rng.normal())}))
    groups.append(group)
  return groups


def main(out_path: str, model: str = "dense") -> None:
  t0 = time.perf_counter()
  processes = distributed.initialize()  # before any other JAX call
  import jax
  from jax.experimental import multihost_utils

  from models import sharding, transformer
  from rl import corrections, losses
  from tests.conftest import TINY_DENSE, TINY_MOE_MLA
  from trainer import batches as B
  from trainer import optim as O
  from trainer import state as S
  from trainer import step as T

  assert jax.process_count() == processes, (jax.process_count(), processes)
  assert jax.device_count() == 4 and jax.local_device_count() == 4 // processes
  cfg = {"dense": TINY_DENSE, "moe_mla": TINY_MOE_MLA}[model]
  mesh = sharding.make_mesh(sharding.MeshConfig(**MESH))
  # AdamW + QK-Clip as in tests/test_step.py (ε = 1e-3 there for the same reason: a first
  # AdamW step is g / (|g| + ε), which amplifies reduction-order noise of tiny gradients)
  opt = O.build(O.OptimizerConfig.from_config(dict(
      name="adamw_clip", learning_rate=1e-2, schedule="constant", weight_decay=0.1, eps=1e-3,
      grad_clip_norm=1.0, qk_clip={"tau": 0.5})), cfg)
  state = S.create(cfg, opt, seed=0, mesh=mesh)
  assert len(state.params["embed"].sharding.device_set) == 4
  mb = B.make_micro_batches(make_groups(), B.BatchShape(row_len=128, rows=4, seqs=8,
                                                         seq_len=16, micro_batches=2))
  loss_cfg = losses.LossConfig(name="grpo", entropy_coef=0.01)
  step = T.make_train_step(cfg, loss_cfg, opt, mesh=mesh, entropy=True,
                           correction_cfg=corrections.CorrectionConfig(kind="tis_token",
                                                                       token_cap=1.1))
  history = []
  for _ in range(2):
    state, metrics = step(state, mb)
    history.append({k: float(v) for k, v in metrics.items()})  # replicated: readable anywhere
  # a state from given host weights (the HF import / SFT checkpoint path) is placed too
  host = transformer.init(cfg, seed=1)
  start = S.create(cfg, opt, seed=0, mesh=mesh, model=host)
  gather = lambda tree: {
      jax.tree_util.keystr(p): np.asarray(multihost_utils.process_allgather(x, tiled=True))
      for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
  full, placed = gather(state.params), gather(start.params)
  want = {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(S.split_model(host)[0])[0]}
  assert all(np.array_equal(placed[k], want[k]) for k in want), "create(model=...) changed them"
  assert len(start.params["embed"].sharding.device_set) == 4
  result = {
      "process_index": jax.process_index(), "process_count": jax.process_count(),
      "mesh": {k: int(v) for k, v in mesh.shape.items()},
      "step": int(state.step), "policy_version": int(state.policy_version),
      "metrics": history,
      "checksums": {k: [float(np.sum(v, dtype=np.float64)),
                        float(np.sum(np.abs(v), dtype=np.float64))] for k, v in full.items()},
      "seconds": time.perf_counter() - t0,
  }
  np.savez(out_path[:-len(".json")] + ".npz", **full)
  with open(out_path, "w") as f:
    json.dump(result, f, indent=1)
  print(f"ok process {jax.process_index()}/{jax.process_count()}: loss "
        f"{history[-1]['loss']:.6f} in {result['seconds']:.1f}s", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
