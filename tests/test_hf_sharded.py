"""models.hf loading straight into a sharding and saving tensor by tensor: a subprocess with 8
simulated CPU devices, then two processes of 4 (tests/hf_sharded_check.py does the work); and
the block reads and streaming writes of models/safetensors_io.py underneath."""

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from models.safetensors_io import (SafetensorsDir, TensorSpec, save_file, slice_bounds,
                                   write_dir, write_file)


def test_sharded_load_and_save_match_single_device(tmp_path):
  root = Path(__file__).resolve().parents[1]
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
  env["PYTHONPATH"] = str(root)
  proc = subprocess.run([sys.executable, "-m", "tests.hf_sharded_check", str(tmp_path)],
                        cwd=root, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
  print(proc.stdout)
  # two meshes loaded, a run's starting weights, reads, host memory, save, the two processes
  assert proc.stdout.count("ok ") == 8, proc.stdout


# ----------------------------------------------------------------------------- block reads


def test_block_reads_equal_slices_of_the_whole_tensor(tmp_path):
  """FP8 blocks (partial edge tiles, blocks cutting through tiles) and plain tensors."""
  rng = np.random.default_rng(0)
  w = rng.standard_normal((300, 200)).astype(np.float32)
  scale = (np.abs(rng.standard_normal((3, 2))) + 0.1).astype(np.float32)
  save_file({"a.weight": w.astype(ml_dtypes.float8_e4m3fn), "a.weight_scale_inv": scale,
             "b": w.astype(ml_dtypes.bfloat16)}, tmp_path / "model.safetensors")
  ckpt = SafetensorsDir(tmp_path)
  for name, itemsize in (("a.weight", 1), ("b", 2)):
    whole = ckpt.get_dequantized(name)
    for rows, cols in ((slice(0, 300), slice(0, 200)), (slice(100, 250), slice(64, 190)),
                       (slice(127, 129), slice(199, 200)), (slice(290, None), slice(None, 5))):
      before = ckpt.bytes_read
      got = ckpt.get_dequantized(name, index=(rows, cols))
      np.testing.assert_array_equal(got, whole[rows, cols])
      read = ckpt.bytes_read - before
      assert read >= got.size * itemsize and read <= got.size * itemsize + 6 * 4, read
  np.testing.assert_array_equal(ckpt.get("b", index=(slice(5, 7),)), w[5:7].astype(
      ml_dtypes.bfloat16))
  assert slice_bounds((slice(2, None),), (5, 3)) == ((2, 5), (0, 3))
  with pytest.raises(ValueError, match="step 1"):
    ckpt.get("b", index=(slice(0, 10, 2),))


def test_streaming_writer_fetches_each_tensor_once_in_order(tmp_path):
  tensors = {f"t{i}": np.full((4, 4), i, np.float32) for i in range(5)}
  fetched = []

  def fetch(name):
    fetched.append(name)
    return tensors[name]

  specs = {name: TensorSpec.of(a) for name, a in tensors.items()}
  write_dir(specs, fetch, tmp_path / "out", max_shard_bytes=2 * 64)
  assert fetched == list(tensors)
  ckpt = SafetensorsDir(tmp_path / "out")
  assert len([f for f in os.listdir(tmp_path / "out") if f.endswith(".safetensors")]) == 3
  for name, a in tensors.items():
    np.testing.assert_array_equal(ckpt.get(name), a)
  with pytest.raises(ValueError, match="'t1'.*float64.*declared float32"):
    write_file(specs, lambda name: tensors[name].astype(np.float64) if name == "t1"
               else tensors[name], tmp_path / "bad.safetensors")
  assert not [f for f in os.listdir(tmp_path) if f.startswith("bad")]  # no partial file
