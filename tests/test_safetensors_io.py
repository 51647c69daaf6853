"""models/safetensors_io.py against the reference `safetensors` package (numpy and torch backends)."""

import json
import mmap
import os

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

from models.safetensors_io import SafetensorsDir, is_scale_name, save_dir, save_file

BF16, E4M3, E5M2 = ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def _rng():
  return np.random.default_rng(0)


def _write_raw(path, header: dict, data: bytes) -> None:
  """A safetensors file built by hand, so tests can declare anything (bad dtypes, huge shapes)."""
  blob = json.dumps(header).encode()
  with open(path, "wb") as f:
    f.write(len(blob).to_bytes(8, "little") + blob + data)


def _base_is_mmap(arr: np.ndarray) -> bool:
  while isinstance(arr, np.ndarray):
    arr = arr.base
  return isinstance(arr.obj if isinstance(arr, memoryview) else arr, mmap.mmap)


# ---------------------------------------------------------------- round trips vs reference library


def test_reads_reference_numpy_file(tmp_path):
  r = _rng()
  ref = {
      "a.weight": r.standard_normal((3, 5)).astype(np.float32),
      "b.ids": r.integers(-(2**40), 2**40, size=(7,)).astype(np.int64),
      "c.half": r.standard_normal((2, 3, 4)).astype(np.float16),
      "d.scalar": np.array(1.5, np.float32),
      "e.empty": np.zeros((0, 4), np.float32),
      "f.mask": np.array([True, False, True]),
  }
  safetensors.numpy.save_file(ref, str(tmp_path / "model.safetensors"), metadata={"format": "np"})
  ckpt = SafetensorsDir(tmp_path)
  assert ckpt.names() == sorted(ref)
  for name, want in ref.items():
    assert name in ckpt
    assert ckpt.shape(name) == want.shape
    got = ckpt.get(name)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
  assert ckpt.dtype("c.half") == "F16"
  assert ckpt.get("c.half", np.float32).dtype == np.float32
  assert "missing" not in ckpt


def test_reference_numpy_reads_our_file(tmp_path):
  r = _rng()
  ours = {
      "x": r.standard_normal((4, 6)).astype(np.float32),
      "y": r.integers(0, 1000, size=(5,)).astype(np.int64),
      "z": r.standard_normal((3,)).astype(np.float16),
      "i": np.arange(6, dtype=np.int32).reshape(2, 3),
      "m": np.array([[True, False]]),
      "t": np.asfortranarray(r.standard_normal((3, 4)).astype(np.float32)),  # non-C-contiguous
  }
  path = tmp_path / "out.safetensors"
  save_file(ours, path, metadata={"step": "7"})
  back = safetensors.numpy.load_file(str(path))
  assert sorted(back) == sorted(ours)
  for name, want in ours.items():
    assert back[name].dtype == want.dtype
    np.testing.assert_array_equal(back[name], want)
  with safetensors.safe_open(str(path), "np") as f:
    assert f.metadata() == {"step": "7"}
  # Header is space-padded to 8 bytes so the data buffer is aligned; tensors are in dict order.
  raw = path.read_bytes()
  n = int.from_bytes(raw[:8], "little")
  assert n % 8 == 0
  header = json.loads(raw[8 : 8 + n])
  assert [k for k in header if k != "__metadata__"] == list(ours)
  assert [h for h in os.listdir(tmp_path)] == ["out.safetensors"]  # no temp file left behind


def test_reference_torch_reads_our_bf16_fp8(tmp_path):
  r = _rng()
  w = r.standard_normal((8, 16)).astype(np.float32) * 3
  ours = {"bf": w.astype(BF16), "f8": np.clip(w, -448, 448).astype(E4M3), "f32": w}
  path = tmp_path / "model.safetensors"
  save_file(ours, path)
  back = safetensors.torch.load_file(str(path))
  assert back["bf"].dtype == torch.bfloat16 and back["f8"].dtype == torch.float8_e4m3fn
  np.testing.assert_array_equal(back["bf"].float().numpy(), ours["bf"].astype(np.float32))
  np.testing.assert_array_equal(back["f8"].float().numpy(), ours["f8"].astype(np.float32))
  np.testing.assert_array_equal(back["f32"].numpy(), w)
  # Bit-exact too (NaN payloads and signed zeros would slip through a float comparison).
  np.testing.assert_array_equal(back["bf"].view(torch.int16).numpy(), ours["bf"].view(np.int16))
  np.testing.assert_array_equal(back["f8"].view(torch.uint8).numpy(), ours["f8"].view(np.uint8))


def test_reads_reference_torch_bf16_fp8(tmp_path):
  t = torch.randn(5, 7, generator=torch.Generator().manual_seed(0)) * 4
  ref = {
      "bf": t.to(torch.bfloat16),
      "e4m3": t.to(torch.float8_e4m3fn),
      "e5m2": t.to(torch.float8_e5m2),
      "h": t.to(torch.float16),
  }
  safetensors.torch.save_file(ref, str(tmp_path / "weights.safetensors"))
  ckpt = SafetensorsDir(tmp_path)  # any single *.safetensors file, not only model.safetensors
  assert [ckpt.dtype(k) for k in ("bf", "e4m3", "e5m2")] == ["BF16", "F8_E4M3", "F8_E5M2"]
  assert ckpt.get("bf").dtype == BF16
  assert ckpt.get("e4m3").dtype == E4M3 and ckpt.get("e5m2").dtype == E5M2
  for name, want in ref.items():
    np.testing.assert_array_equal(ckpt.get(name, np.float32), want.float().numpy())
  np.testing.assert_array_equal(ckpt.get("bf").view(np.int16), ref["bf"].view(torch.int16).numpy())


# ---------------------------------------------------------------- sharded directories


def test_save_dir_shards_and_reads_back(tmp_path):
  r = _rng()
  tensors = {f"layers.{i}.w": r.standard_normal((16, 16)).astype(np.float32) for i in range(5)}
  tensors["embed"] = r.standard_normal((4, 16)).astype(BF16)
  out = tmp_path / "ckpt"  # created by save_dir
  save_dir(tensors, out, max_shard_bytes=2 * 16 * 16 * 4, metadata={"format": "pt"})
  files = sorted(os.listdir(out))
  assert files == [
      "model-00001-of-00003.safetensors",
      "model-00002-of-00003.safetensors",
      "model-00003-of-00003.safetensors",
      "model.safetensors.index.json",
  ]
  index = json.loads((out / "model.safetensors.index.json").read_text())
  assert index["metadata"]["total_size"] == sum(a.nbytes for a in tensors.values())
  assert set(index["weight_map"]) == set(tensors)
  for fname in set(index["weight_map"].values()):  # each shard respects the limit
    assert sum(tensors[k].nbytes for k, v in index["weight_map"].items() if v == fname) <= 2048
  ckpt = SafetensorsDir(out)
  assert ckpt.names() == sorted(tensors)
  for name, want in tensors.items():
    got = ckpt.get(name)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)

  # Rewriting the same directory as a single file must drop the stale index.
  save_dir({"only": np.ones(3, np.float32)}, out)
  assert not (out / "model.safetensors.index.json").exists()
  assert SafetensorsDir(out).names() == ["only"]


def test_oversized_tensor_gets_own_shard(tmp_path):
  tensors = {"small": np.zeros(2, np.float32), "big": np.zeros(100, np.float32)}
  save_dir(tensors, tmp_path, max_shard_bytes=64)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  assert index["weight_map"] == {
      "small": "model-00001-of-00002.safetensors",
      "big": "model-00002-of-00002.safetensors",
  }
  np.testing.assert_array_equal(SafetensorsDir(tmp_path).get("big"), tensors["big"])


def test_reads_hand_made_hf_sharded_dir(tmp_path):
  r = _rng()
  s1 = {"model.embed_tokens.weight": r.standard_normal((10, 4)).astype(np.float32)}
  s2 = {
      "model.layers.0.mlp.up_proj.weight": r.standard_normal((8, 4)).astype(np.float16),
      "lm_head.weight": r.standard_normal((10, 4)).astype(np.float32),
  }
  names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
  safetensors.numpy.save_file(s1, str(tmp_path / names[0]), metadata={"format": "pt"})
  safetensors.numpy.save_file(s2, str(tmp_path / names[1]), metadata={"format": "pt"})
  weight_map = {**dict.fromkeys(s1, names[0]), **dict.fromkeys(s2, names[1])}
  (tmp_path / "model.safetensors.index.json").write_text(
      json.dumps({"metadata": {"total_size": 123}, "weight_map": weight_map})
  )
  (tmp_path / "config.json").write_text("{}")
  ckpt = SafetensorsDir(tmp_path)
  assert ckpt.names() == sorted(weight_map)
  for name, want in {**s1, **s2}.items():
    assert ckpt.shape(name) == want.shape
    np.testing.assert_array_equal(ckpt.get(name), want)


# ---------------------------------------------------------------- FP8 block dequantisation


def test_fp8_block_dequantisation(tmp_path):
  out_dim, in_dim, b = 300, 200, 128  # neither a multiple of 128: edge blocks are partial
  w = _rng().standard_normal((out_dim, in_dim)).astype(np.float32)
  w[:128, :128] *= 50  # blocks with very different ranges, so one global scale would not do
  nb_o, nb_i = -(-out_dim // b), -(-in_dim // b)
  scale = np.zeros((nb_o, nb_i), np.float32)
  q = np.zeros((out_dim, in_dim), E4M3)
  want = np.zeros((out_dim, in_dim), np.float32)
  for i in range(nb_o):
    for j in range(nb_i):
      rows, cols = slice(i * b, (i + 1) * b), slice(j * b, (j + 1) * b)
      scale[i, j] = np.abs(w[rows, cols]).max() / 448.0
      blk = torch.from_numpy(w[rows, cols] / scale[i, j]).to(torch.float8_e4m3fn)
      q[rows, cols] = blk.view(torch.uint8).numpy().view(E4M3)
      want[rows, cols] = q[rows, cols].astype(np.float32) * scale[i, j]
  tensors = {
      "mlp.down_proj.weight": q,
      "mlp.down_proj.weight_scale_inv": scale,
      "norm.weight": np.ones(4, BF16),
  }
  save_file(tensors, tmp_path / "model.safetensors")
  ckpt = SafetensorsDir(tmp_path)
  got = ckpt.get_dequantized("mlp.down_proj.weight")
  assert got.dtype == np.float32 and got.shape == (out_dim, in_dim)
  np.testing.assert_array_equal(got, want)
  rel = np.abs(got - w) / np.abs(w).clip(1e-3)
  assert np.median(rel) < 0.04 and np.linalg.norm(got - w) / np.linalg.norm(w) < 0.05
  # The raw FP8 is still available, and unscaled tensors pass straight through.
  assert ckpt.get("mlp.down_proj.weight").dtype == E4M3
  assert ckpt.get_dequantized("norm.weight").dtype == np.float32
  assert ckpt.get_dequantized("mlp.down_proj.weight", dtype=BF16).dtype == BF16
  assert [n for n in ckpt.names() if not is_scale_name(n)] == ["mlp.down_proj.weight", "norm.weight"]
  assert is_scale_name("mlp.down_proj.weight_scale_inv") and not is_scale_name("x.scale")


def test_fp8_scale_shape_mismatch(tmp_path):
  save_file({"a.weight": np.zeros((130, 10), E4M3), "a.weight_scale_inv": np.ones((1, 1), np.float32)},
            tmp_path / "model.safetensors")
  with pytest.raises(ValueError, match="a.weight_scale_inv"):
    SafetensorsDir(tmp_path).get_dequantized("a.weight")


# ---------------------------------------------------------------- memory mapping


def test_open_reads_headers_only(tmp_path):
  # Declares a 4 GiB tensor but stores 16 bytes: metadata queries and other tensors must work,
  # which they would not if opening (or reading `small`) touched the whole data region.
  huge_shape = [2**20, 2**10]
  header = {
      "small": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
      "huge": {"dtype": "F32", "shape": huge_shape, "data_offsets": [16, 16 + 4 * 2**30]},
  }
  _write_raw(tmp_path / "model.safetensors", header, np.arange(4, dtype=np.float32).tobytes())
  ckpt = SafetensorsDir(tmp_path)
  assert ckpt.names() == ["huge", "small"]
  assert ckpt.shape("huge") == tuple(huge_shape) and ckpt.dtype("huge") == "F32"
  small = ckpt.get("small")
  np.testing.assert_array_equal(small, np.arange(4, dtype=np.float32))
  with pytest.raises(ValueError, match="'huge'.*model.safetensors.*truncated"):
    ckpt.get("huge")


def test_get_is_zero_copy_view_of_mmap(tmp_path):
  w = np.arange(12, dtype=np.float32).reshape(3, 4)
  save_file({"w": w}, tmp_path / "model.safetensors")
  ckpt = SafetensorsDir(tmp_path)
  view = ckpt.get("w")
  assert _base_is_mmap(view) and not view.flags.writeable and not view.flags.owndata
  cast = ckpt.get("w", np.float16)
  assert cast.flags.owndata and not _base_is_mmap(cast)


# ---------------------------------------------------------------- errors name what is wrong


def test_missing_directory(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope"):
    SafetensorsDir(tmp_path / "nope")


def test_directory_without_safetensors(tmp_path):
  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(FileNotFoundError, match=str(tmp_path)):
    SafetensorsDir(tmp_path)


def test_ambiguous_files_without_index(tmp_path):
  for name in ("a.safetensors", "b.safetensors"):
    save_file({"x": np.zeros(1, np.float32)}, tmp_path / name)
  with pytest.raises(FileNotFoundError, match="a.safetensors, b.safetensors"):
    SafetensorsDir(tmp_path)


def test_index_names_missing_shard(tmp_path):
  save_file({"a": np.zeros(1, np.float32)}, tmp_path / "model-00001-of-00002.safetensors")
  weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
    SafetensorsDir(tmp_path)


def test_missing_tensor(tmp_path):
  save_file({"a": np.zeros(1, np.float32)}, tmp_path / "model.safetensors")
  with pytest.raises(KeyError) as e:
    SafetensorsDir(tmp_path).get("layers.0.missing")
  assert "layers.0.missing" in str(e.value) and str(tmp_path) in str(e.value)


def test_unknown_dtype(tmp_path):
  _write_raw(tmp_path / "model.safetensors",
             {"odd": {"dtype": "F4_E2M1", "shape": [2], "data_offsets": [0, 1]}}, b"\0")
  ckpt = SafetensorsDir(tmp_path)
  assert ckpt.dtype("odd") == "F4_E2M1"
  with pytest.raises(ValueError, match="'odd'.*F4_E2M1"):
    ckpt.get("odd")


def test_truncated_files(tmp_path):
  path = tmp_path / "model.safetensors"
  save_file({"a": np.zeros(4, np.float32), "b": np.ones(4, np.float32)}, path)
  raw = path.read_bytes()
  path.write_bytes(raw[:-4])  # cut into `b`
  ckpt = SafetensorsDir(tmp_path)
  np.testing.assert_array_equal(ckpt.get("a"), np.zeros(4, np.float32))
  with pytest.raises(ValueError, match="'b'.*model.safetensors"):
    ckpt.get("b")
  path.write_bytes(raw[:20])  # cut into the header
  with pytest.raises(ValueError, match="model.safetensors.*header"):
    SafetensorsDir(tmp_path)


def test_offsets_disagree_with_shape(tmp_path):
  _write_raw(tmp_path / "model.safetensors",
             {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}, bytes(24))
  with pytest.raises(ValueError, match="'w'.*\\[2, 3\\]"):
    SafetensorsDir(tmp_path).get("w")


def test_save_rejects_bad_input(tmp_path):
  with pytest.raises(ValueError, match="'c'.*complex64"):
    save_file({"c": np.zeros(2, np.complex64)}, tmp_path / "x.safetensors")
  with pytest.raises(TypeError, match="metadata"):
    save_file({"a": np.zeros(2, np.float32)}, tmp_path / "x.safetensors", metadata={"step": 7})
  assert os.listdir(tmp_path) == []
