"""Run in a subprocess with 8 simulated CPU devices (tests/test_step.py): the dense GRPO train
step of tests/test_step.py on a data=2 x fsdp=2 x tensor=2 mesh (its gradient also with the
residual stream split over tensor, the act_embed rule). Reads the micro-batches and
QK-Clip τ from DIR/mb.npz and DIR/config.npz, writes the summed gradient, the updated
parameters and the metrics to DIR/{grads,params,metrics}.npz for the parent to compare with
its single-device step."""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from models import sharding, transformer  # noqa: E402
from tests.conftest import TINY_DENSE  # noqa: E402
from tests.test_step import LOSSES, optimizer, save_tree  # noqa: E402
from trainer import batches as B  # noqa: E402
from trainer import state as S  # noqa: E402
from trainer import step as T  # noqa: E402

P = jax.sharding.PartitionSpec


def load_micro_batches(path: str) -> B.MicroBatches:
  data = np.load(path)
  top, fields, scalars = {}, {}, {}
  for key in data.files:  # keys are jax.tree_util.keystr paths: .tokens, .fields['turn'], ...
    if key.startswith(".fields["):
      fields[key[len(".fields['"):-2]] = data[key]
    elif key.startswith(".scalars["):
      scalars[key[len(".scalars['"):-2]] = data[key]
    else:
      top[key[1:]] = data[key]
  return B.MicroBatches(fields=fields, scalars=scalars, **top)


def main(tmp: str):
  assert len(jax.devices()) == 8
  cfg = TINY_DENSE
  mb = load_micro_batches(f"{tmp}/mb.npz")
  tau = float(np.load(f"{tmp}/config.npz")["tau"])
  opt = optimizer(cfg, tau)
  mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))
  state = S.create(cfg, opt, mesh=mesh, model=transformer.init(cfg, seed=0))
  assert state.params["embed"].sharding.spec == P("tensor", "fsdp")
  loss_cfg, correction = LOSSES["grpo"]
  step = T.make_train_step(cfg, loss_cfg, opt, correction_cfg=correction, mesh=mesh,
                           entropy=True, donate=False)
  placed = jax.device_put(mb, T.batch_shardings(cfg, mesh, mb))
  assert placed.tokens.sharding.spec == P(None, ("data", "fsdp"))
  loss, grads, metrics = step.gradients(state, mb)
  new, step_metrics = step(state, mb)
  for path, leaf in jax.tree_util.tree_flatten_with_path(new)[0]:  # shardings are kept
    want = jax.tree_util.tree_flatten_with_path(state)[0]
    assert leaf.sharding.is_equivalent_to(dict(want)[path].sharding, leaf.ndim), path
  assert len(new.params["embed"].sharding.device_set) == 8
  # the residual stream split over tensor (act_embed rule): the same gradient
  sp_cfg = cfg.replace(sharding_rules=sharding.replace_rules(cfg.sharding_rules,
                                                             {"act_embed": "tensor"}))
  sp_loss, sp_grads, _ = T.make_train_step(sp_cfg, loss_cfg, opt, correction_cfg=correction,
                                           mesh=mesh, entropy=True, donate=False
                                           ).gradients(state, mb)
  np.testing.assert_allclose(float(sp_loss), float(loss), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(sp_grads), jax.tree.leaves(grads)):
    a, b = np.asarray(a), np.asarray(b)
    assert np.abs(a - b).max() <= 1e-5 * max(1e-3, np.abs(b).max()), np.abs(a - b).max()
  save_tree(f"{tmp}/grads.npz", grads)
  save_tree(f"{tmp}/params.npz", new.params)
  np.savez(f"{tmp}/metrics.npz", **{k: np.asarray(v) for k, v in step_metrics.items()})
  print(f"ok sharded step on {dict(mesh.shape)}: loss {float(loss):.6f}, "
        f"{int(step_metrics['qk_clipped_heads'])} heads clipped; the same gradient with the "
        "residual stream split over tensor")


if __name__ == "__main__":
  main(sys.argv[1])
