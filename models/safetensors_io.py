"""Minimal safetensors reader/writer on numpy memory maps (no torch, no `safetensors` package).

File layout: u64 little-endian header length N, N bytes of JSON header
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`, then the
data buffer (offsets are relative to its start). Opening a checkpoint reads only the headers; a
tensor's bytes are touched when `get` is called, and `get` may ask for a slice only, so 100 GB
checkpoints open instantly and a host reads just the parts it holds. Writers take each tensor
from a callback as they reach it, so a whole checkpoint never needs to be in memory at once.
Assumes a little-endian host (safetensors data is little-endian and is viewed without a copy).
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import uuid
from typing import Callable, Optional, Sequence

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


Index = Optional[Sequence[slice]]  # one slice (step 1) per leading dimension; None: everything


def slice_bounds(index: Index, shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
  """The (start, stop) of every dimension of `shape` that `index` selects.

  Args:
    index: slices of the leading dimensions (missing ones are whole); None selects everything.
    shape: the array's shape.

  Returns:
    One (start, stop) pair per dimension.

  Raises:
    ValueError: a slice with a step other than 1, or more slices than dimensions.
  """
  index = tuple(index or ())
  if len(index) > len(shape):
    raise ValueError(f"index {index} has more entries than shape {tuple(shape)} has dimensions")
  out = []
  for i, n in enumerate(shape):
    start, stop, step = (index[i] if i < len(index) else slice(None)).indices(n)
    if step != 1:
      raise ValueError(f"index {index}: only slices with step 1 are read")
    out.append((start, max(start, stop)))
  return tuple(out)


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
    self.bytes_read = 0  # stored bytes of every tensor or block `get` returned
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

  def get(self, name: str, dtype: Optional[np.dtype] = None, index: Index = None) -> np.ndarray:
    """Tensor `name`, or the block of it that `index` selects.

    Args:
      name: the tensor name.
      dtype: cast to this dtype (a copy, after which the tensor's pages of the memory map are
        released); None returns a read-only zero-copy view of the memory-mapped file.
      index: slices (step 1) of the leading dimensions; None: the whole tensor.

    Returns:
      The array (the block's shape when `index` is given). Its stored bytes are added to
      `bytes_read`.

    Raises:
      KeyError: no such tensor.
      ValueError: an unknown dtype, offsets that do not match the shape or the file, or an
        index with steps.
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
    if index is not None:
      arr = arr[tuple(slice(a, b) for a, b in slice_bounds(index, shape))]
    self.bytes_read += arr.nbytes
    if dtype is None:
      return arr
    out = arr.astype(dtype)
    self._release(path, start + begin, end - begin)
    return out

  def _release(self, path: str, offset: int, length: int) -> None:
    """Drops the mapped pages of a copied-out tensor from this process's resident memory.

    Otherwise every page ever read stays mapped, and reading a checkpoint through the map
    would leave all of it resident; the OS keeps the pages in its file cache.
    """
    if length and hasattr(mmap, "MADV_DONTNEED"):
      first = offset - offset % mmap.PAGESIZE
      self._maps[path].madvise(mmap.MADV_DONTNEED, first, offset + length - first)

  def get_dequantized(self, name: str, dtype: np.dtype = np.float32, block: int = 128,
                      index: Index = None) -> np.ndarray:
    """Like `get`, with FP8 block-scaled weights dequantised.

    An FP8 `x.weight` [out, in] with a sibling `x.weight_scale_inv` [ceil(out/block),
    ceil(in/block)] (DeepSeek-V3 / Kimi K2 layout) is returned as weight * scale_inv, each scale
    covering its block x block tile (cropped at the edges). With `index`, only the selected
    block of the weight and the scales that cover it are read; every element gets the same
    value as in the whole tensor.

    Args:
      name: the tensor name.
      dtype: the returned dtype.
      block: the scales' block size.
      index: slices (step 1) of the leading dimensions; None: the whole tensor.

    Returns:
      The (dequantised) array or block.

    Raises:
      ValueError: the scales' shape does not match the weight's for `block`.
    """
    scale_name = name + SCALE_SUFFIX
    if not (name.endswith(".weight") and scale_name in self):
      return self.get(name, dtype, index)
    shape, scale_shape = self.shape(name), self.shape(scale_name)
    want = tuple(-(-n // block) for n in shape)
    if len(shape) != 2 or scale_shape != want:
      raise ValueError(f"{scale_name} has shape {scale_shape}; expected {want} for {name} "
                       f"of shape {shape} with block {block}")
    (r0, r1), (c0, c1) = slice_bounds(index, shape)
    w = self.get(name, np.float32, (slice(r0, r1), slice(c0, c1)))
    s = self.get(scale_name, np.float32, (slice(r0 // block, -(-r1 // block)),
                                          slice(c0 // block, -(-c1 // block))))
    s = np.repeat(np.repeat(s, block, axis=0), block, axis=1)
    s = s[r0 % block: r0 % block + r1 - r0, c0 % block: c0 % block + c1 - c0]
    return (w * s).astype(dtype)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """The shape and (native-order) dtype of a tensor to write, known before its values."""

  shape: tuple[int, ...]
  dtype: np.dtype

  @classmethod
  def of(cls, arr: np.ndarray) -> TensorSpec:
    """The spec of an existing array."""
    dt = np.dtype(arr.dtype)
    return cls(tuple(arr.shape), dt if dt.isnative else dt.newbyteorder("="))

  @property
  def nbytes(self) -> int:
    """Bytes of the stored tensor."""
    return math.prod(self.shape) * self.dtype.itemsize


Fetch = Callable[[str], np.ndarray]  # tensor name -> its values, asked for once, in write order


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
  write_file({name: TensorSpec.of(a) for name, a in tensors.items()}, tensors.__getitem__, path,
             metadata)


def write_file(specs: dict[str, TensorSpec], fetch: Fetch, path: str | os.PathLike,
               metadata: Optional[dict[str, str]] = None) -> None:
  """Writes one safetensors file tensor by tensor: each is fetched, written and let go.

  Args:
    specs: {name: TensorSpec}, in the order the tensors are stored (and fetched).
    fetch: returns the values of a tensor named in `specs`, of its shape and dtype.
    path: the file to write (atomically: readers never see a partial file).
    metadata: str -> str pairs stored as `__metadata__`.

  Raises:
    TypeError: metadata is not str -> str.
    ValueError: a dtype without a safetensors code, a tensor named `__metadata__` (both before
      anything is written), or a fetched tensor unlike its spec.
  """
  path = os.fspath(path)
  header: dict = {}
  if metadata:
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
      raise TypeError(f"safetensors metadata must map str to str, got {metadata!r}")
    header["__metadata__"] = dict(metadata)
  offset = 0
  for name, spec in specs.items():
    if spec.dtype not in _CODES:
      raise ValueError(f"tensor {name!r}: dtype {spec.dtype} has no safetensors code")
    if name == "__metadata__":
      raise ValueError(f"{path}: '__metadata__' is reserved and cannot name a tensor")
    header[name] = {"dtype": _CODES[spec.dtype], "shape": list(spec.shape),
                    "data_offsets": [offset, offset + spec.nbytes]}
    offset += spec.nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # keeps the data buffer 8-byte aligned

  def write(f) -> None:
    f.write(len(blob).to_bytes(8, "little") + blob)
    for name, spec in specs.items():
      f.write(_stored_bytes(name, np.asarray(fetch(name)), spec))

  _atomic_write(path, write)


def _stored_bytes(name: str, arr: np.ndarray, spec: TensorSpec) -> memoryview:
  """The bytes of `arr` as stored (C order, little-endian); ValueError unless it fits `spec`."""
  if TensorSpec.of(arr) != spec:
    raise ValueError(f"tensor {name!r}: fetched {arr.dtype} {list(arr.shape)}, declared "
                     f"{spec.dtype} {list(spec.shape)}")
  arr = np.ascontiguousarray(arr.astype(spec.dtype, copy=False))
  return memoryview(arr.reshape(-1).view(np.uint8))


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
  """Writes tensors as `model.safetensors`, or as HF-style shards past a size (see `write_dir`).

  Args:
    tensors: {name: array}.
    directory: the output directory (created).
    max_shard_bytes: the most bytes per shard.
    metadata: str -> str pairs stored in every file (and the index).
  """
  write_dir({name: TensorSpec.of(a) for name, a in tensors.items()}, tensors.__getitem__,
            directory, max_shard_bytes, metadata)


def write_dir(specs: dict[str, TensorSpec], fetch: Fetch, directory: str | os.PathLike,
              max_shard_bytes: int = 5 * 2**30, metadata: Optional[dict[str, str]] = None
              ) -> None:
  """Writes `model.safetensors`, or HF-style shards past a size, tensor by tensor.

  Past `max_shard_bytes` the tensors go to `model-0000i-of-0000N.safetensors` shards plus
  `model.safetensors.index.json`; a tensor larger than `max_shard_bytes` gets a shard of its own.
  Tensors are fetched once each, in the order of `specs`.

  Args:
    specs: {name: TensorSpec}, in storage order.
    fetch: returns the values of a tensor named in `specs`.
    directory: the output directory (created).
    max_shard_bytes: the most bytes per shard.
    metadata: str -> str pairs stored in every file (and the index).
  """
  directory = os.fspath(directory)
  os.makedirs(directory, exist_ok=True)
  shards: list[dict[str, TensorSpec]] = [{}]
  used = 0
  for name, spec in specs.items():
    if shards[-1] and used + spec.nbytes > max_shard_bytes:
      shards.append({})
      used = 0
    shards[-1][name] = spec
    used += spec.nbytes
  index_path = os.path.join(directory, INDEX_NAME)
  if len(shards) == 1:
    write_file(shards[0], fetch, os.path.join(directory, "model.safetensors"), metadata)
    if os.path.exists(index_path):  # a stale index would take precedence when reading
      os.remove(index_path)
    return
  weight_map = {}
  for i, shard in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    write_file(shard, fetch, os.path.join(directory, fname), metadata)
    weight_map.update(dict.fromkeys(shard, fname))
  total = sum(spec.nbytes for spec in specs.values())
  index = {"metadata": {**(metadata or {}), "total_size": total}, "weight_map": weight_map}
  _atomic_write(index_path, lambda f: f.write(json.dumps(index, indent=2).encode()))
