"""Minimal safetensors reader/writer on numpy memory maps (no torch, no `safetensors` package).

File layout: u64 little-endian header length N, N bytes of JSON header
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`, then the
data buffer (offsets are relative to its start). Opening a checkpoint reads only the headers; a
tensor's bytes are touched when `get` is called, so 100 GB checkpoints open instantly.
Assumes a little-endian host (safetensors data is little-endian and is viewed without a copy).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import uuid
from typing import Callable, Optional

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_CODES: dict[np.dtype, str] = {v: k for k, v in DTYPES.items()}
INDEX_NAME = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"


def is_scale_name(name: str) -> bool:
  """True for FP8 block-scale tensors (`x.weight_scale_inv`), read together with their weight."""
  return name.endswith(SCALE_SUFFIX)


def _read_header(path: str) -> tuple[int, dict]:
  """Returns (data start offset in the file, header dict without `__metadata__`)."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    if size < 8:
      raise ValueError(f"{path}: file is {size} bytes, too short for a safetensors header")
    n = int.from_bytes(f.read(8), "little")
    if 8 + n > size:
      raise ValueError(f"{path}: header length {n} exceeds file size {size} (truncated?)")
    try:
      header = json.loads(f.read(n))
    except ValueError as e:
      raise ValueError(f"{path}: header is not valid JSON ({e})") from None
  header.pop("__metadata__", None)
  return 8 + n, header


class SafetensorsDir:
  """Read-only view of a checkpoint directory: one `*.safetensors` file or an HF sharded index.

  Args:
    directory: the checkpoint directory.

  Raises:
    FileNotFoundError: no directory, no (or several) safetensors files and no index, or a
      shard the index names is missing.
  """

  def __init__(self, directory: str | os.PathLike):
    self.directory = d = os.fspath(directory)
    if not os.path.isdir(d):
      raise FileNotFoundError(f"checkpoint directory not found: {d}")
    self._files: dict[str, tuple[int, dict]] = {}   # path -> header, parsed on first use
    self._maps: dict[str, mmap.mmap] = {}           # path -> mmap, opened on first `get`
    index = os.path.join(d, INDEX_NAME)
    if os.path.exists(index):
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
      for fname in sorted(set(weight_map.values())):
        if not os.path.isfile(os.path.join(d, fname)):
          raise FileNotFoundError(f"{index} names shard {fname!r}, missing from {d}")
      self._where = {k: os.path.join(d, v) for k, v in weight_map.items()}
      return
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    if "model.safetensors" in files:
      files = ["model.safetensors"]
    if len(files) != 1:
      what = f"several ({', '.join(files)}) and no {INDEX_NAME}" if files else "none"
      raise FileNotFoundError(f"need one *.safetensors file or an index in {d}; found {what}")
    path = os.path.join(d, files[0])
    self._where = {k: path for k in self._header(path)[1]}

  def _header(self, path: str) -> tuple[int, dict]:
    if path not in self._files:
      self._files[path] = _read_header(path)
    return self._files[path]

  def _info(self, name: str) -> tuple[str, int, dict]:
    if name not in self._where:
      raise KeyError(f"tensor {name!r} not found in {self.directory}")
    path = self._where[name]
    start, header = self._header(path)
    if name not in header:
      raise KeyError(f"tensor {name!r} is mapped to {path} but that file does not hold it")
    return path, start, header[name]

  def names(self) -> list[str]:
    """Every tensor name, sorted."""
    return sorted(self._where)

  def __contains__(self, name: str) -> bool:
    return name in self._where

  def shape(self, name: str) -> tuple[int, ...]:
    """The stored shape of tensor `name` (read from the header only)."""
    return tuple(self._info(name)[2]["shape"])

  def dtype(self, name: str) -> str:
    """The stored dtype code, e.g. "BF16" or "F8_E4M3"."""
    return self._info(name)[2]["dtype"]

  def get(self, name: str, dtype: Optional[np.dtype] = None) -> np.ndarray:
    """Tensor `name` with its stored shape.

    Args:
      name: the tensor name.
      dtype: cast to this dtype (a copy); None returns a read-only zero-copy view of the
        memory-mapped file.

    Returns:
      The array.

    Raises:
      KeyError: no such tensor.
      ValueError: an unknown dtype, or offsets that do not match the shape or the file.
    """
    path, start, info = self._info(name)
    code, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
    if code not in DTYPES:
      raise ValueError(f"tensor {name!r} in {path} has unknown dtype {code!r}")
    dt = DTYPES[code]
    count = math.prod(shape)
    if end - begin != count * dt.itemsize:
      raise ValueError(f"tensor {name!r} in {path}: data_offsets [{begin}, {end}] do not "
                       f"match shape {list(shape)} of {code}")
    size = os.path.getsize(path)
    if start + end > size:
      raise ValueError(f"tensor {name!r} in {path}: data_offsets [{begin}, {end}] run past "
                       f"the end of the file ({size} bytes); file truncated?")
    if path not in self._maps:
      with open(path, "rb") as f:
        self._maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    arr = np.frombuffer(self._maps[path], dt, count, start + begin).reshape(shape)
    return arr if dtype is None else arr.astype(dtype)

  def get_dequantized(self, name: str, dtype: np.dtype = np.float32, block: int = 128
                      ) -> np.ndarray:
    """Like `get`, with FP8 block-scaled weights dequantised.

    An FP8 `x.weight` [out, in] with a sibling `x.weight_scale_inv` [ceil(out/block),
    ceil(in/block)] (DeepSeek-V3 / Kimi K2 layout) is returned as weight * scale_inv, each scale
    covering its block x block tile (cropped at the edges).

    Args:
      name: the tensor name.
      dtype: the returned dtype.
      block: the scales' block size.

    Returns:
      The (dequantised) array.
    """
    scale_name = name + SCALE_SUFFIX
    if not (name.endswith(".weight") and scale_name in self):
      return self.get(name, dtype)
    w, s = self.get(name, np.float32), self.get(scale_name, np.float32)
    want = tuple(-(-n // block) for n in w.shape)
    if w.ndim != 2 or s.shape != want:
      raise ValueError(f"{scale_name} has shape {s.shape}; expected {want} for {name} "
                       f"of shape {w.shape} with block {block}")
    s = np.repeat(np.repeat(s, block, axis=0), block, axis=1)[: w.shape[0], : w.shape[1]]
    return (w * s).astype(dtype)


def save_file(tensors: dict[str, np.ndarray], path: str | os.PathLike,
              metadata: Optional[dict[str, str]] = None) -> None:
  """Writes tensors to one safetensors file, contiguously in dict order, atomically.

  Args:
    tensors: {name: array} (any safetensors dtype).
    path: the file to write.
    metadata: str -> str pairs stored as `__metadata__`.

  Raises:
    TypeError: metadata is not str -> str.
    ValueError: a dtype without a safetensors code, or a tensor named `__metadata__`.
  """
  path = os.fspath(path)
  header: dict = {}
  if metadata:
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
      raise TypeError(f"safetensors metadata must map str to str, got {metadata!r}")
    header["__metadata__"] = dict(metadata)
  arrays, offset = [], 0
  for name, arr in tensors.items():
    arr = np.ascontiguousarray(arr)
    if not arr.dtype.isnative:
      arr = arr.astype(arr.dtype.newbyteorder("="))
    if arr.dtype not in _CODES:
      raise ValueError(f"tensor {name!r}: dtype {arr.dtype} has no safetensors code")
    if name == "__metadata__":
      raise ValueError(f"{path}: '__metadata__' is reserved and cannot name a tensor")
    header[name] = {"dtype": _CODES[arr.dtype], "shape": list(arr.shape),
                    "data_offsets": [offset, offset + arr.nbytes]}
    arrays.append(arr)
    offset += arr.nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # keeps the data buffer 8-byte aligned

  def write(f) -> None:
    f.write(len(blob).to_bytes(8, "little") + blob)
    for arr in arrays:
      f.write(memoryview(arr.reshape(-1).view(np.uint8)))

  _atomic_write(path, write)


def _atomic_write(path: str, write: Callable) -> None:
  """Readers never see a half-written file: write a sibling temp file, then rename over `path`."""
  tmp = f"{path}.{uuid.uuid4().hex}.tmp"
  try:
    with open(tmp, "xb") as f:
      write(f)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def save_dir(tensors: dict[str, np.ndarray], directory: str | os.PathLike,
             max_shard_bytes: int = 5 * 2**30, metadata: Optional[dict[str, str]] = None) -> None:
  """Writes tensors as `model.safetensors`, or as HF-style shards past a size.

  Past `max_shard_bytes` the tensors go to `model-0000i-of-0000N.safetensors` shards plus
  `model.safetensors.index.json`; a tensor larger than `max_shard_bytes` gets a shard of its own.

  Args:
    tensors: {name: array}.
    directory: the output directory (created).
    max_shard_bytes: the most bytes per shard.
    metadata: str -> str pairs stored in every file (and the index).
  """
  directory = os.fspath(directory)
  os.makedirs(directory, exist_ok=True)
  shards: list[dict[str, np.ndarray]] = [{}]
  used = 0
  for name, arr in tensors.items():
    if shards[-1] and used + arr.nbytes > max_shard_bytes:
      shards.append({})
      used = 0
    shards[-1][name] = arr
    used += arr.nbytes
  index_path = os.path.join(directory, INDEX_NAME)
  if len(shards) == 1:
    save_file(shards[0], os.path.join(directory, "model.safetensors"), metadata)
    if os.path.exists(index_path):  # a stale index would take precedence when reading
      os.remove(index_path)
    return
  weight_map = {}
  for i, shard in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, os.path.join(directory, fname), metadata)
    weight_map.update(dict.fromkeys(shard, fname))
  total = sum(a.nbytes for a in tensors.values())
  index = {"metadata": {**(metadata or {}), "total_size": total}, "weight_map": weight_map}
  _atomic_write(index_path, lambda f: f.write(json.dumps(index, indent=2).encode()))
