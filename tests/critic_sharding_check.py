"""Run in a subprocess with 8 simulated CPU devices (tests/test_critic.py): the GAE critic
sharded like the policy equals the one-device critic.

MoE + MLA (a dense layer, then MoE layers with a shared expert) on fsdp 2 x expert 2 x
tensor 2, rows over the batch axes, from the same weights and tree-packed micro-batches: the values of every position, the GAE fields,
two Adam updates (the metrics, the moments, the new parameters), parameters and Adam moments sharded by the
model's rules and kept so, the values replicated.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from models import sharding, value_head  # noqa: E402
from tests.conftest import TINY_MOE_MLA  # noqa: E402
from tests.test_critic import _groups  # noqa: E402
from trainer import batches as B  # noqa: E402
from trainer import critic as critic_lib  # noqa: E402

P = jax.sharding.PartitionSpec
LR = 3e-3
SHAPE = B.BatchShape(row_len=128, rows=4, seqs=8, seq_len=16, micro_batches=2)
MESHES = ((TINY_MOE_MLA, dict(fsdp=2, expert=2, tensor=2)),)


def close(a, b, what: str, tol: float = 1e-5, scale: float = 1.0):
  """The largest difference relative to b's largest magnitude (at least `scale`)."""
  a, b = np.asarray(a), np.asarray(b)
  err = np.abs(a - b).max() / max(scale, np.abs(b).max(), 1e-30)
  assert err <= tol, (what, err)
  return err


def main():
  assert len(jax.devices()) == 8
  mb = B.make_micro_batches(_groups(), SHAPE)
  for cfg, axes in MESHES:
    mesh = sharding.make_mesh(sharding.MeshConfig(**axes))
    model = value_head.init(cfg, 1)
    model.head.weight[...] = 0.3 * np.random.default_rng(1).normal(size=cfg.hidden_size)
    one = critic_lib.Critic(cfg, optax.adam(LR), value_clip=0.5, donate=False)
    many = critic_lib.Critic(cfg, optax.adam(LR), value_clip=0.5, mesh=mesh)
    s1, sm = one.init(model), many.init(model)
    embed = jax.tree.leaves(sm.params["model"]["embed"])[0]
    assert len(embed.sharding.device_set) == 8 and embed.sharding.spec != P(), embed.sharding
    worst = close(many.values(sm, mb), one.values(s1, mb), "values")
    assert many.values(sm, mb).sharding.is_fully_replicated
    f1, fm = one.gae_fields(s1, mb, 0.99, 0.95), many.gae_fields(sm, mb, 0.99, 0.95)
    for k in ("advantage", "returns", "old_values"):
      assert isinstance(fm.fields[k], (np.ndarray, jax.Array)), k
      worst = max(worst, close(fm.fields[k], f1.fields[k], k))
    for _ in range(2):
      s1, m1 = one.step(s1, f1)
      sm, mm = many.step(sm, fm)
      for k in m1:
        worst = max(worst, close(mm[k], m1[k], k, 1e-4))
    want = dict(jax.tree_util.tree_flatten_with_path(s1)[0])
    shardings = dict(jax.tree_util.tree_flatten_with_path(many.abstract())[0])
    moved = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(sm)[0]:
      name = jax.tree_util.keystr(path)
      if name.startswith(".params"):
        # Adam moves a parameter by about LR whatever its gradient's size, so where a
        # gradient is tiny its last digits (summation order) show in the step: the gradients
        # themselves are checked exactly through the moments (mu: sums of gradients)
        moved = max(moved, np.abs(np.asarray(leaf) - np.asarray(want[path])).max() / LR)
        assert moved <= 0.05, (name, moved)
      else:
        worst = max(worst, close(leaf, want[path], name, scale=0.0))
      assert leaf.sharding.is_equivalent_to(shardings[path].sharding, leaf.ndim), path
    mu = jax.tree.leaves(sm.opt_state[0].mu["model"]["embed"])[0]
    assert mu.sharding.is_equivalent_to(embed.sharding, 2), mu.sharding
    print(f"ok critic on {axes}: max relative difference {worst:.2e}, parameters within "
          f"{moved:.1e} of a step")


if __name__ == "__main__":
  main()
