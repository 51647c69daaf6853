"""Run in a subprocess with 8 simulated CPU devices (tests/test_hf_sharded.py): `models.hf.load`
with a mesh places every variable in its rule-derived sharding with exactly the values of the
single-device load, reading each stored byte once in blocks (not whole tensors) and holding at
most a block or two plus one tensor's temporaries in host memory; `models.hf.save` of the
sharded model writes the same files as the single-device save, one tensor at a time. Then two
processes of 4 devices each (`jax.distributed` on loopback) load the same 8-device layout: each
reads only what its own devices hold, and their joint save writes the same files again.

The checkpoint is DeepSeek-V3-like (MLA, shared + routed experts, a dense first layer), split
over several safetensors files with an index, its layer matrices FP8 with 32x32 block scales;
hidden 240 and expert width 200 make shards that cut through scale blocks.
"""

import os
import sys

# python -m tests.hf_sharded_check DIR (DIR: an empty directory for the files), and itself
# starts the two processes: python -m tests.hf_sharded_check worker ID PORT DIR
WORKER = sys.argv[1:2] == ["worker"]
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={4 if WORKER else 8}")

import json  # noqa: E402
import math  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tracemalloc  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from configs import sft_demo  # noqa: E402
from models import hf, sharding, transformer  # noqa: E402
from models.config import DEFAULT_SHARDING_RULES, ModelConfig  # noqa: E402
from models.hf_config import config_to_hf  # noqa: E402
from models.safetensors_io import SafetensorsDir, save_dir  # noqa: E402
from trainer import config as config_lib  # noqa: E402
from trainer import harness  # noqa: E402

BLOCK = 32
CFG = ModelConfig(
    vocab_size=256, hidden_size=240, num_layers=3, num_heads=4, intermediate_size=320,
    attention="mla", q_lora_rank=48, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, num_experts=8, num_shared_experts=1, experts_per_token=2, n_group=2,
    topk_group=1, score_func="sigmoid", router_bias=True, routed_scaling_factor=2.0,
    first_k_dense_replace=1, moe_intermediate_size=200, initializer_range=0.1)
# Rules that also shard a non-leading dimension of a merged HF dimension (`kv`) and the layer
# stack, so blocks cut HF tensors in every way the reader supports.
ODD_RULES = tuple((name, {"kv": ("expert",), "layers": ("fsdp",)}.get(name, axes))
                  for name, axes in DEFAULT_SHARDING_RULES)


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Per-block e4m3: (fp8 weight, scale_inv [ceil(out/BLOCK), ceil(in/BLOCK)])."""
  rows, cols = -(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK)
  q = np.empty(w.shape, ml_dtypes.float8_e4m3fn)
  scale = np.empty((rows, cols), np.float32)
  for i in range(rows):
    for j in range(cols):
      tile = (slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK))
      scale[i, j] = max(float(np.abs(w[tile]).max()), 1e-12) / 448.0
      q[tile] = (w[tile] / scale[i, j]).astype(ml_dtypes.float8_e4m3fn)
  return q, scale


def write_checkpoint(directory: Path) -> dict[str, int]:
  """An FP8 multi-file checkpoint of a random CFG model; returns {tensor name: stored bytes}."""
  model = transformer.init(CFG, seed=0)
  bias = model.moe_layers.mlp.router_bias
  bias[...] = 0.1 * np.random.default_rng(1).standard_normal(bias[...].shape)
  tensors = {}
  for name, w in hf.hf_tensors(model).items():
    if w.ndim == 2 and name.startswith("model.layers.") and not name.endswith("mlp.gate.weight"):
      tensors[name], tensors[name + "_scale_inv"] = quantize(w)
    elif name == "model.embed_tokens.weight":
      tensors[name] = w.astype(ml_dtypes.bfloat16)
    else:
      tensors[name] = w
  save_dir(tensors, directory, max_shard_bytes=400_000, metadata={"format": "pt"})
  config = config_to_hf(CFG)
  config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                   "activation_scheme": "dynamic",
                                   "weight_block_size": [BLOCK, BLOCK]}
  (directory / "config.json").write_text(json.dumps(config))
  files = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
  assert len(files) > 3 and (directory / "model.safetensors.index.json").exists(), files
  return {name: a.nbytes for name, a in tensors.items()}


class ReadLog:
  """Records the stored bytes of every `SafetensorsDir.get` call, per tensor."""

  def __init__(self):
    self.calls: dict[str, list[int]] = {}
    get = SafetensorsDir.get

    def logged(reader, name, dtype=None, index=None):
      before = reader.bytes_read
      out = get(reader, name, dtype, index)
      self.calls.setdefault(name, []).append(reader.bytes_read - before)
      return out

    SafetensorsDir.get = logged


def flat(model) -> dict:
  return {p: v[...] for p, v in nnx.to_flat_state(nnx.state(model))}


def load(path: Path, mesh_cfg: sharding.MeshConfig, rules) -> tuple[object, int]:
  """The model loaded onto the mesh, and the most host memory the load held beyond its result.

  Host memory is what tracemalloc sees numpy allocate. A CPU device may keep an aligned host
  block as its buffer instead of copying it, so what is still allocated when the load returns
  is device memory; the rest of the peak is the loader's own.
  """
  tracemalloc.start()
  model = hf.load(path, mesh=sharding.make_mesh(mesh_cfg), sharding_rules=rules)
  held, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  return model, peak - held


def check_model(model, reference: dict, mesh_cfg: sharding.MeshConfig, rules) -> None:
  """Every array has the rules' sharding and the reference's values."""
  mesh = sharding.make_mesh(mesh_cfg)
  cfg = CFG.replace(sharding_rules=rules)
  want = {p: v.get_value() for p, v in nnx.to_flat_state(
      sharding.state_shardings(nnx.state(transformer.abstract(cfg)), cfg, mesh))}
  arrays = flat(model)
  assert sorted(arrays) == sorted(reference)
  sharded = 0
  for p, a in arrays.items():
    assert a.sharding == want[p], (p, a.sharding, want[p])
    assert a.dtype == reference[p].dtype and a.shape == reference[p].shape, p
    np.testing.assert_array_equal(np.asarray(a), np.asarray(reference[p]), err_msg=str(p))
    sharded += not a.sharding.is_fully_replicated
  assert sharded > len(arrays) // 2, sharded
  print(f"ok load {mesh_cfg} {'odd rules' if rules is ODD_RULES else 'default rules'}: "
        f"{len(arrays)} arrays ({sharded} sharded) equal the single-device load")


def block_bytes(model) -> int:
  """The largest block of one variable on one device, fp32."""
  return max(s.data.nbytes for a in flat(model).values() for s in a.addressable_shards)


def main(tmp: Path) -> None:
  assert len(jax.devices()) == 8
  stored = write_checkpoint(tmp / "ckpt")
  single = hf.load(tmp / "ckpt")
  reference = flat(single)
  model_bytes = sum(a.nbytes for a in reference.values())
  tensor_bytes = 4 * max(math.prod(SafetensorsDir(tmp / "ckpt").shape(n)) for n in stored)
  mesh_cfg = sharding.MeshConfig(fsdp=2, tensor=2, expert=2)
  check_model(load(tmp / "ckpt", mesh_cfg, ODD_RULES)[0], reference, mesh_cfg, ODD_RULES)

  # A run whose config.model.init names the checkpoint reads it straight onto the run's mesh.
  config = sft_demo.get_config()
  config.model.init = f"hf:{tmp / 'ckpt'}"
  config.model.overrides = {"sharding_rules": {"act_embed": "tensor"}}  # activations only
  mesh_cfg = sharding.MeshConfig(fsdp=4, tensor=2)
  start = harness.initial_model(config, config_lib.model_config(config),
                                sharding.make_mesh(mesh_cfg))
  assert dict(start.cfg.sharding_rules)["act_embed"] == ("tensor",)
  check_model(start, reference, mesh_cfg, DEFAULT_SHARDING_RULES)

  # Reads: each stored byte once, in blocks, though 8 devices hold 2 replicas of the model.
  mesh_cfg = sharding.MeshConfig(data=2, fsdp=2, tensor=2)
  log = ReadLog()
  model, peak = load(tmp / "ckpt", mesh_cfg, DEFAULT_SHARDING_RULES)
  check_model(model, reference, mesh_cfg, DEFAULT_SHARDING_RULES)
  weights = [n for n in stored if not n.endswith("_scale_inv")]
  for name in weights:
    assert sum(log.calls[name]) == stored[name], (name, log.calls[name], stored[name])
  expert = "model.layers.1.mlp.experts.3.up_proj.weight"  # [expert_mlp, embed] over tensor, fsdp
  assert log.calls[expert] == [stored[expert] // 4] * 4, log.calls[expert]
  embed = "model.embed_tokens.weight"  # [vocab, embed] over tensor, fsdp
  assert log.calls[embed] == [stored[embed] // 4] * 4, log.calls[embed]
  print(f"ok reads: {len(weights)} weights, each byte once, in blocks "
        f"({sum(map(len, log.calls.values()))} reads)")

  # Host memory beyond the devices' buffers: the block being read, the previous one (its
  # release may lag its copy) and one tensor's temporaries (fp32 copy, expanded scales,
  # product), never the model.
  bound = 2 * block_bytes(model) + 3 * tensor_bytes + 2**20
  assert bound < model_bytes / 3, (bound, model_bytes)
  assert peak <= bound, (peak, bound)
  print(f"ok host memory: load peak beyond the devices' buffers {peak / 2**20:.2f} MiB <= "
        f"{bound / 2**20:.2f} MiB (model {model_bytes / 2**20:.2f} MiB)")

  # Save: the sharded model writes the single-device model's files, one tensor at a time.
  hf.save(single, tmp / "out_single", max_shard_bytes=1_000_000)
  tracemalloc.start()
  hf.save(model, tmp / "out_sharded", max_shard_bytes=1_000_000)
  peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  files = sorted(os.listdir(tmp / "out_single"))
  assert files == sorted(os.listdir(tmp / "out_sharded")) and len(files) > 3, files
  for f in files:
    assert (tmp / "out_single" / f).read_bytes() == (tmp / "out_sharded" / f).read_bytes(), f
  bound = 3 * tensor_bytes + 2**20
  assert peak <= bound < model_bytes / 3, (peak, bound, model_bytes)
  print(f"ok save: {len(files)} files equal the single-device save; host peak "
        f"{peak / 2**20:.2f} MiB <= {bound / 2**20:.2f} MiB")
  run_workers(tmp)


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_workers(tmp: Path) -> None:
  """Two worker processes of one distributed run; retried once if the port was taken."""
  for attempt in range(2):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.hf_sharded_check", "worker", str(i),
                               str(port), str(tmp)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
      outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
    if all(p.returncode == 0 for p in procs):
      for out in outs:
        print(next(line for line in out.splitlines() if line.startswith("ok ")))
      return
    if attempt or not any("Failed to add port" in out for out in outs):
      raise AssertionError("\n".join(out[-3000:] for out in outs))


def worker(process_id: int, port: int, tmp: Path) -> None:
  """One of two processes: loads onto the 8-device mesh they share, checks, saves jointly."""
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                             coordinator_bind_address=f"127.0.0.1:{port}")
  assert jax.device_count() == 8 and jax.local_device_count() == 4
  mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=2, tensor=2, expert=2))  # fsdp: processes
  model, stats = hf.load_with_stats(tmp / "ckpt", mesh=mesh)
  single, single_stats = hf.load_with_stats(tmp / "ckpt")  # this process's first device
  reference = {p: np.asarray(a) for p, a in flat(single).items()}
  for p, a in flat(model).items():
    for shard in a.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), reference[p][shard.index],
                                    err_msg=str(p))
  share = stats.bytes_read / single_stats.bytes_read
  assert 0.4 < share < 0.6, share  # the embed dimension's halves are the processes'
  hf.save(model, tmp / "out_processes", max_shard_bytes=1_000_000)
  if process_id == 0:
    files = sorted(os.listdir(tmp / "out_single"))
    assert files == sorted(os.listdir(tmp / "out_processes")), files
    for f in files:
      assert (tmp / "out_single" / f).read_bytes() == (tmp / "out_processes" / f).read_bytes(), f
  print(f"ok process {process_id} of 2: local shards equal the single-device load, "
        f"{share:.0%} of its bytes read" + (", joint save equals it" if process_id == 0 else ""))


if __name__ == "__main__":
  if WORKER:
    worker(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
  else:
    main(Path(sys.argv[1]))
