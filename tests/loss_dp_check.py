"""Run as a subprocess by test_loss_contracts: every loss over 2 simulated data-parallel devices
(shard_map: each device sums its shard's loss, psum) equals the single-device loss and gradient.
Prints "ok N" with the number of configurations checked."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from rl import losses  # noqa: E402
from tests.test_loss_contracts import loss_configs, random_batch  # noqa: E402


def main():
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
  batch = random_batch()
  specs = jax.tree.map(lambda x: P("data") if x.ndim else P(), batch)
  n = 0
  for cfg in loss_configs():
    def local(lp, b):
      return jax.lax.psum(losses.compute(b.replace(logprobs=lp), cfg)[0], "data")

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P("data"), specs), out_specs=P())
    v_dp, g_dp = jax.jit(jax.value_and_grad(sharded))(batch.logprobs, batch)
    v, g = jax.jit(jax.value_and_grad(
        lambda lp: losses.compute(batch.replace(logprobs=lp), cfg)[0]))(batch.logprobs)
    np.testing.assert_allclose(v_dp, v, rtol=1e-6, atol=1e-7, err_msg=cfg.name)
    np.testing.assert_allclose(g_dp, g, rtol=1e-6, atol=1e-7, err_msg=cfg.name)
    assert float(jnp.abs(g).max()) > 0, cfg
    n += 1
  print(f"ok {n}")


if __name__ == "__main__":
  main()
