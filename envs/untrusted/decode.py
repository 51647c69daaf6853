"""Decoding untrusted bytes within bounds: JSON of bounded nesting, zlib of bounded size.

Python's JSON decoder recurses once per nested array or object, so a document nested a few
thousand deep raises RecursionError (not a ValueError) from deep inside the parser; and
`zlib.decompress` inflates whatever it is given, about 1000 bytes out per byte in for a run of
one byte value. Here the nesting is measured before parsing (`nesting_bound`, linear time, no
recursion) and inflation stops at a byte cap (`inflate`). Both raise ValueError subclasses that
name what was being read, so loaders that skip bad rows on ValueError skip these too.

    value = loads(text, max_depth=64, what="field 'metadata'")
    data = inflate(blob, max_bytes=64 << 20, what="field 'private_test_cases'")
"""

from __future__ import annotations

import json
import re
import zlib
from typing import Any, Union

MAX_JSON_DEPTH = 100              # nesting of arrays/objects accepted by default
INFLATE_CHUNK = 1 << 20           # bytes inflated per step
_ESCAPE = re.compile(r"\\.", re.S)
_STRING = re.compile(r'"[^"]*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_SCAN_CHUNK = 1 << 20


class TooDeep(ValueError):
  """A document nested deeper than the limit."""


class TooLarge(ValueError):
  """Data that would inflate beyond the limit."""


def nesting_bound(text: str) -> int:
  """An upper bound on how deep `json.loads(text)` nests arrays and objects, found without
  parsing and without recursion; exact for valid JSON.

  Escapes are removed, then strings (which then hold no quote), then all but brackets; the
  deepest running count of open brackets is the bound. Where `text` is not valid JSON the
  decoder stops at the first error, and up to that point this count matches its own.

  Args:
    text: the document.

  Returns:
    The bound (0 for a scalar).
  """
  brackets = _NOT_BRACKET.sub("", _STRING.sub("", _ESCAPE.sub("", text)))
  depth = deepest = 0
  if len(brackets) <= 256:
    for c in brackets:
      depth += 1 if c in "[{" else -1
      deepest = max(deepest, depth)
    return deepest
  import numpy as np  # long bracket runs: running sums in C, a chunk at a time
  codes = np.frombuffer(brackets.encode("ascii"), np.uint8)
  for i in range(0, len(codes), _SCAN_CHUNK):
    # "[" 0x5b and "{" 0x7b have bit 1 set, "]" 0x5d and "}" 0x7d do not
    running = np.cumsum((codes[i:i + _SCAN_CHUNK] & 2).astype(np.int32) - 1) + depth
    deepest, depth = max(deepest, int(running.max())), int(running[-1])
  return deepest


def decode_text(data: Union[bytes, bytearray, str]) -> str:
  """JSON bytes as text, detecting UTF-8/16/32 as `json.loads` does (UnicodeDecodeError, a
  ValueError, when they are not)."""
  if isinstance(data, str):
    return data
  return bytes(data).decode(json.detect_encoding(data), "surrogatepass")


def loads(data: Union[bytes, bytearray, str], max_depth: int = MAX_JSON_DEPTH,
          what: str = "JSON") -> Any:
  """`json.loads` of a document nested at most `max_depth` deep.

  Args:
    data: the document (bytes in UTF-8/16/32, or text).
    max_depth: the deepest nesting of arrays/objects accepted (well below the interpreter's
      recursion limit).
    what: names the document in errors (e.g. "field 'metadata'").

  Returns:
    The value.

  Raises:
    TooDeep: nested deeper than `max_depth`.
    ValueError: not JSON (json.JSONDecodeError, UnicodeDecodeError, or an integer literal
      longer than the interpreter converts).
  """
  text = decode_text(data)
  depth = nesting_bound(text)
  if depth > max_depth:
    raise TooDeep(f"{what}: nested {depth} deep, more than max_json_depth={max_depth}")
  return json.loads(text)


def check_depth(value: Any, max_depth: int = MAX_JSON_DEPTH, what: str = "value") -> None:
  """Refuses an already-decoded value (dicts, lists, tuples) nested deeper than `max_depth`.

  Iterative: a value nested far deeper than the recursion limit is measured without recursing.

  Args:
    value: the value.
    max_depth: the deepest nesting of containers accepted.
    what: names the value in errors.

  Raises:
    TooDeep: nested deeper than `max_depth`.
  """
  stack = [(value, 1)]
  while stack:
    v, d = stack.pop()
    if isinstance(v, (dict, list, tuple)):
      if d > max_depth:
        raise TooDeep(f"{what}: nested deeper than max_json_depth={max_depth}")
      stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))


def inflate(data: bytes, max_bytes: int, what: str = "data", wbits: int = zlib.MAX_WBITS
            ) -> bytes:
  """`zlib.decompress`, stopping once the output would exceed `max_bytes`.

  The stream is inflated `INFLATE_CHUNK` bytes at a time, so no more than `max_bytes` + one
  chunk is ever held, however far the data would inflate.

  Args:
    data: the compressed bytes.
    max_bytes: the largest output accepted.
    what: names the data in errors.
    wbits: as `zlib.decompressobj` takes it (default: a zlib stream).

  Returns:
    The inflated bytes.

  Raises:
    TooLarge: the output would exceed `max_bytes`.
    ValueError: the data is not a complete stream (zlib.error's message).
  """
  d = zlib.decompressobj(wbits)
  parts, size, pending = [], 0, data
  try:
    while not d.eof:
      part = d.decompress(pending, min(INFLATE_CHUNK, max_bytes - size + 1))
      size += len(part)
      if size > max_bytes:
        raise TooLarge(f"{what}: inflates to more than {max_bytes} bytes "
                       "(max_decompressed_bytes)")
      parts.append(part)
      pending = d.unconsumed_tail
      if not part and not pending and not d.eof:
        raise ValueError(f"{what}: incomplete or truncated zlib stream")
  except zlib.error as e:
    raise ValueError(f"{what}: {e}") from None
  return b"".join(parts)
