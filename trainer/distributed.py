"""Multi-host JAX (one process per host, SPMD): start-up from the launcher's environment, and
placing host data that every process holds in full onto a global mesh.

    n = distributed.initialize()          # before any other JAX call; 1 = single process
    mesh = sharding.make_mesh(...)        # over jax.devices(): all processes' devices
    x = distributed.put(host_tree, shardings)   # global jax.Arrays, each process fills its own

Launcher contract (docs/design.md §2.3): ARBOR_NUM_PROCESSES (default 1), and for more than one
process JAX_COORDINATOR_ADDRESS (host:port of process 0) and ARBOR_PROCESS_ID (0 .. n-1). On
CPU the cross-process collectives go through gloo over TCP (`jax_cpu_collectives_implementation`;
an explicit JAX_CPU_COLLECTIVES_IMPLEMENTATION in the environment wins), which is how tests run
two processes on one machine with a loopback coordinator.

Why `put` rather than `jax.device_put`: a sharding over several processes has devices this
process cannot address. `jax.device_put` of a host array to such a sharding first checks that
every process passed the same value (one cross-process broadcast and compare per array, on every
call); `jax.make_array_from_callback` instead copies to each addressable device the slice it
owns, with no communication. Both need the full array on every process, which is the contract
here: every host builds the same micro-batches (same data order, same seed).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from trainer.config import ConfigError


def initialize(environ: Mapping[str, str] = os.environ) -> int:
  """`jax.distributed.initialize` from the launcher's environment when ARBOR_NUM_PROCESSES > 1.

  With one process JAX is not touched. Call it before anything else uses JAX (the backend must
  not exist yet).

  Args:
    environ: the launcher's variables (the module doc).

  Returns:
    The number of processes.

  Raises:
    ConfigError: a missing or bad variable (named).
  """
  raw = environ.get("ARBOR_NUM_PROCESSES", "1")
  try:
    n = int(raw)
  except ValueError:
    n = 0
  if n < 1:
    raise ConfigError(f"ARBOR_NUM_PROCESSES={raw!r}: expected an integer >= 1")
  if n == 1:
    return 1
  address = environ.get("JAX_COORDINATOR_ADDRESS", "")
  raw_id = environ.get("ARBOR_PROCESS_ID", "")
  if not address:
    raise ConfigError("JAX_COORDINATOR_ADDRESS is unset: a multi-host run "
                      f"(ARBOR_NUM_PROCESSES={n}) needs the coordinator's host:port")
  if not raw_id.isdigit() or int(raw_id) >= n:
    raise ConfigError(f"ARBOR_PROCESS_ID={raw_id!r}: expected an integer in [0, {n})")
  import jax
  if not environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):
    # CPU collectives across processes (tests, CPU hosts); no effect on TPU/GPU backends.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=address, num_processes=n,
                             process_id=int(raw_id))
  return n


def global_array(x: Any, sharding) -> Any:
  """One host value that EVERY process holds in full, as a global jax.Array.

  Each process copies to its own devices the slices they own, with no communication. A
  jax.Array that already spans other processes is resharded with `jax.device_put` (a no-op
  when the sharding matches).

  Args:
    x: a NumPy array, a scalar, or a jax.Array (fully addressable, or already global).
    sharding: the result's sharding, possibly over several processes' devices.

  Returns:
    The global jax.Array.
  """
  import jax
  import numpy as np
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return jax.device_put(x, sharding)
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def put(tree: Any, shardings: Any) -> Any:
  """`jax.device_put(tree, shardings)` that also works across processes.

  With one process it IS `jax.device_put`; with several, every leaf goes through
  `global_array`, so every process must hold the whole tree and the values must be the same
  everywhere (this is not checked).

  Args:
    tree: a pytree of host values.
    shardings: one sharding for every leaf, or a tree of shardings matching `tree` (or a prefix
      of it: one sharding per subtree).

  Returns:
    The tree of global jax.Arrays.
  """
  import jax
  if jax.process_count() == 1:
    return jax.device_put(tree, shardings)
  is_sharding = lambda s: isinstance(s, jax.sharding.Sharding)
  if is_sharding(shardings):
    return jax.tree.map(lambda x: global_array(x, shardings), tree)
  # shardings may be a prefix of tree (as for jax.device_put): one sharding per subtree
  return jax.tree.map(lambda s, sub: jax.tree.map(lambda x: global_array(x, s), sub),
                      shardings, tree, is_leaf=is_sharding)
