"""Host memory and time of loading an HF checkpoint onto a device mesh.

    python -m benchmarks.load_memory [--repeats=3 --devices=8 --dir=DIR --out=x.json]

Two ways to the same sharded model:
  sharded            `models.hf.load(path, mesh=mesh)`: each variable read block by block
                     straight into its sharding;
  one_device_shard   `models.hf.load(path)` onto one device, then `sharding.shard_model`
                     (the only way before `mesh=`): the whole model passes through one device.

The checkpoint is a random DeepSeek-V3-like model with a tiny vocabulary and wide layers, stored
bf16 in several safetensors files with an index (written once to --dir, or a temporary
directory). Every load runs in a fresh process with --devices simulated CPU devices on a mesh
(fsdp = devices / 2, expert = 2); reported per variant, median over --repeats: the peak resident
memory during the load above the process's resident memory before it (the kernel's high-water
mark, reset just before), the part of it beyond the loaded arrays' device buffers (on CPU the
devices' memory is host memory too), and the wall time. Prints one JSON object and (with
--update_docs) rewrites the load_memory section of docs/benchmarks.md.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
from absl import app, flags
from flax import nnx

from benchmarks.common import machine, today, write_section
from models import hf, sharding, transformer
from models.config import ModelConfig
from models.presets import count_params

flags.DEFINE_integer("repeats", 3, "fresh-process loads per variant (the median is reported)")
flags.DEFINE_integer("devices", 8, "simulated CPU devices of the mesh (even)")
flags.DEFINE_string("dir", None, "checkpoint directory (written if it has no config.json)")
flags.DEFINE_bool("update_docs", False,
                  "also rewrite the load_memory section of docs/benchmarks.md")
flags.DEFINE_string("out", None, "also write the JSON result to this path")
flags.DEFINE_string("measure", None, "internal: load once with this variant and print JSON")
FLAGS = flags.FLAGS

VARIANTS = ("sharded", "one_device_shard")
MIB = 2**20
WIDE = ModelConfig(
    vocab_size=1024, hidden_size=1024, num_layers=3, num_heads=8, intermediate_size=2816,
    attention="mla", q_lora_rank=256, kv_lora_rank=256, qk_nope_head_dim=64,
    qk_rope_head_dim=32, v_head_dim=64, num_experts=32, num_shared_experts=1,
    experts_per_token=4, n_group=4, topk_group=2, score_func="sigmoid", router_bias=True,
    routed_scaling_factor=2.5, first_k_dense_replace=1, moe_intermediate_size=512)


def write_checkpoint(path: str) -> None:
  """A random WIDE model saved as bf16 shards of at most 64 MiB with an index."""
  hf.save(transformer.init(WIDE, seed=0), path, dtype="bfloat16", max_shard_bytes=64 * MIB)


def _status_kib(field: str) -> int:
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def measure(variant: str, path: str) -> dict:
  """One load in this process: peak and device memory (MiB) and wall time (s)."""
  devices = jax.device_count()
  mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=devices // 2, expert=2))
  before = _status_kib("VmRSS")
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the high-water mark VmHWM to the current resident size
  t0 = time.perf_counter()
  if variant == "sharded":
    model = hf.load(path, mesh=mesh)
  else:
    model = sharding.shard_model(hf.load(path), mesh)
  arrays = [v[...] for _, v in nnx.to_flat_state(nnx.state(model))]
  jax.block_until_ready(arrays)
  load_s = time.perf_counter() - t0
  peak = (_status_kib("VmHWM") - before) * 1024
  device = sum(s.data.nbytes for a in arrays for s in a.addressable_shards)
  return {"peak_mib": peak / MIB, "device_mib": device / MIB,
          "beyond_devices_mib": (peak - device) / MIB, "load_s": load_s}


def run_once(variant: str, path: str, devices: int) -> dict:
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-m", "benchmarks.load_memory", f"--measure={variant}",
                        f"--dir={path}"], env=env, capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def update_docs(result: dict, command: str) -> None:
  rows = [f"| {today()} | {result['machine']} | {name} | {r['peak_mib']:.0f} | "
          f"{r['beyond_devices_mib']:.0f} | {r['device_mib']:.0f} | {r['load_s']:.2f} |"
          for name, r in result["variants"].items()]
  write_section("load_memory", "\n".join([
      "## load_memory: host memory of loading an HF checkpoint onto a mesh",
      "",
      f"Random DeepSeek-V3-like model (`benchmarks/load_memory.py` WIDE: hidden 1024, "
      f"{WIDE.num_experts} experts of width {WIDE.moe_intermediate_size}, vocabulary "
      f"{WIDE.vocab_size}), {result['params']:,} parameters: "
      f"{result['model_bytes'] / MIB:.0f} MiB in fp32, {result['checkpoint_bytes'] / MIB:.0f} "
      f"MiB on disk (bf16, {result['files']} files with an index). "
      f"{result['devices']} simulated CPU devices, mesh {result['mesh']}; each load in a fresh "
      f"process, median of {result['repeats']}. Peak = resident high-water mark during the load "
      "above the resident size before it; on CPU it includes the devices' buffers (the device "
      "column), so \"beyond devices\" is the loader's own host memory. `sharded` is "
      "`hf.load(path, mesh=mesh)`; `one_device_shard` is `hf.load(path)` followed by "
      "`sharding.shard_model`.",
      "",
      "| date | machine | variant | peak (MiB) | beyond devices (MiB) | device (MiB) | load (s) |",
      "|---|---|---|---|---|---|---|",
      *rows,
      "",
      "```",
      command,
      "```",
  ]))


def main(argv):
  del argv
  if FLAGS.measure:
    print(json.dumps(measure(FLAGS.measure, FLAGS.dir)))
    return
  if FLAGS.devices % 2:
    raise app.UsageError(f"--devices={FLAGS.devices}: must be even (the mesh has expert=2)")
  with tempfile.TemporaryDirectory() as tmp:
    path = FLAGS.dir or os.path.join(tmp, "ckpt")
    if not os.path.isfile(os.path.join(path, "config.json")):
      write_checkpoint(path)
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    runs = {name: [] for name in VARIANTS}
    for _ in range(FLAGS.repeats):  # interleaved, so drift in the machine's load hits both
      for name in VARIANTS:
        runs[name].append(run_once(name, path, FLAGS.devices))
    checkpoint_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in files)
  params = count_params(WIDE)
  result = {
      "date": today(), "machine": machine(), "params": params,
      "model_bytes": 4 * sum(math.prod(v.shape) for _, v in
                             nnx.to_flat_state(nnx.state(transformer.abstract(WIDE)))),
      "checkpoint_bytes": checkpoint_bytes, "files": len(files), "devices": FLAGS.devices,
      "mesh": f"fsdp={FLAGS.devices // 2}, expert=2", "repeats": FLAGS.repeats,
      "variants": {name: {key: round(statistics.median(r[key] for r in rs), 3)
                          for key in rs[0]} for name, rs in runs.items()},
  }
  print(json.dumps(result, indent=2))
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(result, f, indent=2)
  if FLAGS.update_docs:
    update_docs(result, f"python -m benchmarks.load_memory --update_docs "
                        f"--repeats={FLAGS.repeats} --devices={FLAGS.devices}")


if __name__ == "__main__":
  app.run(main)
