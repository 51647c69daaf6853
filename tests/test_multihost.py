"""Multi-host on one machine (docs/design.md §2.3): two CPU processes joined by
`jax.distributed.initialize` (coordinator on loopback, CPU collectives over gloo) run the
sharded train step together on a 4-device mesh, and the result equals the same step run by one
process with 4 devices (tests/multihost_worker.py does the work in each process)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import FAST_COMPILE_FLAGS
from trainer import distributed
from trainer.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 240


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start(out: Path, devices: int, **env_extra) -> subprocess.Popen:
  """A worker writing OUT (JSON, .npz and .log beside it) with `devices` simulated CPUs."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("ARBOR_", "JAX_", "XLA_"))}
  env.update(PYTHONPATH=str(ROOT),
             XLA_FLAGS=f"{FAST_COMPILE_FLAGS} --xla_force_host_platform_device_count={devices}",
             JAX_PLATFORMS="cpu", **env_extra)
  with open(out.with_suffix(".log"), "w") as log:
    return subprocess.Popen([sys.executable, "-m", "tests.multihost_worker", str(out)],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def start_pair(outs: list[Path]) -> list[subprocess.Popen]:
  """Two processes of one distributed run; the coordinator (process 0) on a free loopback port
  (bound to loopback only, not jax's default of all interfaces)."""
  port = free_port()
  return [start(out, 2, ARBOR_NUM_PROCESSES="2", ARBOR_PROCESS_ID=str(i),
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}")
          for i, out in enumerate(outs)]


def port_taken(log: Path) -> bool:
  """The coordinator lost the race for its port (taken between free_port and its bind): gRPC
  logs this line, then jax raises "Failed to start RPC server" (or the process segfaults)."""
  return "Failed to add port to server" in log.read_text()


def kill(procs) -> None:
  for p in procs:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGKILL)
      p.wait()


def test_initialize_checks_the_environment():
  assert distributed.initialize({}) == 1
  assert distributed.initialize({"ARBOR_NUM_PROCESSES": "1"}) == 1
  with pytest.raises(ConfigError, match="ARBOR_NUM_PROCESSES='0'"):
    distributed.initialize({"ARBOR_NUM_PROCESSES": "0"})
  with pytest.raises(ConfigError, match="JAX_COORDINATOR_ADDRESS is unset"):
    distributed.initialize({"ARBOR_NUM_PROCESSES": "2", "ARBOR_PROCESS_ID": "1"})
  with pytest.raises(ConfigError, match=r"ARBOR_PROCESS_ID='': expected an integer in \[0, 2\)"):
    distributed.initialize({"ARBOR_NUM_PROCESSES": "2", "JAX_COORDINATOR_ADDRESS": "x:1"})


def test_put_is_device_put_in_one_process():
  import jax
  from jax.sharding import NamedSharding, PartitionSpec
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
  tree = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": None}
  out = distributed.put(tree, {"a": NamedSharding(mesh, PartitionSpec("fsdp")), "b": None})
  assert isinstance(out["a"], jax.Array) and out["b"] is None
  np.testing.assert_array_equal(np.asarray(out["a"]), tree["a"])
  x = distributed.global_array(tree["a"], NamedSharding(mesh, PartitionSpec(None, "fsdp")))
  np.testing.assert_array_equal(np.asarray(x), tree["a"])


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
  outs = {n: tmp_path / f"{n}.json" for n in ("single", "p0", "p1")}
  logs = {n: o.with_suffix(".log") for n, o in outs.items()}
  t0 = time.monotonic()
  deadline = t0 + TIMEOUT_S
  one = start(outs["single"], 4)
  pair = start_pair([outs["p0"], outs["p1"]])
  tries = 1
  try:
    while True:
      procs = {"single": one, "p0": pair[0], "p1": pair[1]}
      codes = {n: p.poll() for n, p in procs.items()}
      if codes["p0"] not in (None, 0) and port_taken(logs["p0"]) and tries < 3:
        kill(pair)  # another program took the port: a new port, a new pair
        pair, tries = start_pair([outs["p0"], outs["p1"]]), tries + 1
        continue
      failed = [n for n, c in codes.items() if c not in (None, 0)]
      if failed or time.monotonic() > deadline:
        why = f"{failed} failed" if failed else f"timed out after {TIMEOUT_S}s"
        pytest.fail(f"worker {why}\n" + "\n".join(
            f"--- {n}:\n{logs[n].read_text()[-3000:]}" for n in procs))
      if all(c == 0 for c in codes.values()):
        break
      time.sleep(0.2)
  finally:
    kill([one, *pair])
  seconds = time.monotonic() - t0
  res = {n: json.loads(o.read_text()) for n, o in outs.items()}
  params = {n: np.load(o.with_suffix(".npz")) for n, o in outs.items()}
  single = res["single"]
  assert single["process_count"] == 1 and single["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1,
                                                              "expert": 1, "sequence": 1}
  assert [res["p0"]["process_index"], res["p1"]["process_index"]] == [0, 1]
  assert single["step"] == single["policy_version"] == 2
  loss = [m["loss"] for m in single["metrics"]]
  assert all(np.isfinite(loss)) and loss[0] != loss[1]
  # both processes saw the same replicated metrics and gathered the same parameters
  assert res["p0"]["metrics"] == res["p1"]["metrics"]
  assert res["p0"]["checksums"] == res["p1"]["checksums"]
  for k in params["p0"].files:
    np.testing.assert_array_equal(params["p0"][k], params["p1"][k])
  # ... and equal the single process's step. Same HLO, same per-device shards: only the
  # order of cross-device sums can differ (in-process vs gloo all-reduce), i.e. fp32 rounding.
  multi = res["p0"]
  assert multi["step"] == multi["policy_version"] == 2
  for s_m, m_m in zip(single["metrics"], multi["metrics"]):
    assert s_m.keys() == m_m.keys()
    for k in s_m:
      np.testing.assert_allclose(m_m[k], s_m[k], rtol=1e-5, atol=1e-6, err_msg=k)
  # per-leaf sums (float64 of up to 8k fp32 entries, each within ~1e-8): atol covers sums ≈ 0
  for k, (total, total_abs) in single["checksums"].items():
    np.testing.assert_allclose(multi["checksums"][k], [total, total_abs], rtol=1e-5, atol=1e-4,
                               err_msg=k)
  assert params["single"].files == params["p0"].files
  for k in params["single"].files:
    a, b = params["p0"][k], params["single"][k]
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=k)
  print(f"2 processes == 1 process; {seconds:.1f}s wall, workers "
        f"{ {n: round(r['seconds'], 1) for n, r in res.items()} }")
