"""What an optimized TPU HLO module moves: its collectives, and the HBM bytes it reads and writes.

XLA's `cost_analysis` gives one "bytes accessed" per program. On TPU it is not HBM traffic: it
counts every operand and result of every instruction wherever the compiler placed them, so a
weight the compiler prefetches into VMEM before its matmul counts three times (read from HBM,
written to VMEM, read from VMEM), and it counts a while loop's body once beside the code around
the loop. `hbm_bytes` reads the compiled module instead: each array's memory space is in its
layout (`S(1)` is VMEM, `S(2)` and up the scalar memories, none HBM), so it counts what
crosses HBM only, instruction by instruction, and separates one iteration of the program's loop
from the code that runs once per call around it.

    from trainer import aot_hlo
    text = compiled.as_text()
    aot_hlo.collectives(text)   # {"all-gather": {"count": 5, "bytes": ...}, ...}
    aot_hlo.hbm_bytes(text)     # {"loop": bytes per iteration, "outside": bytes per call}
"""

from __future__ import annotations

import math
import re

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
                "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
                "s4": 0.5, "u4": 0.5}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
# No data moves (views, control flow whose callees are counted themselves, the second half of an
# async pair whose first half is counted).
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
         "partition-id", "replica-id", "while", "conditional", "call", "copy-done", "slice-done",
         "all-gather-done", "all-reduce-done", "collective-permute-done", "async-done",
         "send-done", "recv-done", "opt-barrier", "add-dependency"}
_SLICING = {"dynamic-slice", "slice", "gather"}  # read what they return, not their operand


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
  """The HLO module's computations, name -> body lines, and the entry computation's name."""
  comps: dict[str, list[str]] = {}
  entry, current = "", None
  for line in hlo_text.splitlines():
    head = re.match(r"(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if head and not line.startswith(" "):
      current = head.group(2)
      comps[current] = []
      entry = current if head.group(1) else entry
    elif line.startswith("}"):
      current = None
    elif current is not None:
      comps[current].append(line)
  return comps, entry


def _multipliers(comps: dict[str, list[str]], entry: str) -> dict[str, int]:
  """How many times each computation runs per call of the program.

  A while loop's body and condition run its trip count times (the constant its condition
  compares the counter with over the constant step the body adds to it, as `lax.scan`, a
  static `fori_loop` and XLA's windowed einsums lower; 1 for a data-dependent bound); every
  other callee (fusions, calls, branches, reductions) as often as its caller. XLA's cost
  analysis counts a loop body once, so this is what scales the collectives.
  """
  def trip(cond: str, body: str) -> int:
    defs, root = _definitions(comps.get(cond, ()))
    if not root or root[2] != "compare" or "direction=LT" not in root[4] or len(root[3]) != 2:
      return 1
    counter, bound = (defs.get(o) for o in root[3])
    if not bound or bound[0][2] != "constant" or not re.match(r"[su]\d+\[\]", bound[0][1]):
      return 1  # a data-dependent bound: counted once, like XLA's cost analysis
    # the counter starts at 0 and steps by the constant the body adds to it (1 for scans,
    # 2 for XLA's bidirectional windowed einsums)
    step, index = 1, re.search(r"index=(\d+)", counter[1]) if counter else None
    body_defs, body_root = _definitions(comps.get(body, ()))
    if index and body_root and body_root[2] == "tuple" and int(index[1]) < len(body_root[3]):
      after = body_defs.get(body_root[3][int(index[1])])
      if after and after[0][2] == "add":
        steps = [_constant(body_defs[o][1]) for o in after[0][3]
                 if o in body_defs and body_defs[o][0][2] == "constant"]
        step = max(1, steps[0]) if steps else 1
    return -(-_constant(bound[1]) // step)

  mult: dict[str, int] = {}
  stack = [(entry, 1)]
  while stack:
    name, m = stack.pop()
    if mult.get(name, 0) >= m:
      continue
    mult[name] = m
    for line in comps.get(name, ()):
      loop = re.search(r"condition=%?([\w.\-]+), body=%?([\w.\-]+)", line)
      if loop:
        n = trip(loop.group(1), loop.group(2))
        stack += [(loop.group(1), m * n), (loop.group(2), m * n)]
        continue
      for callees in _callees(line):
        stack += [(c, m) for c in re.findall(r"%?([\w.\-]+)", callees)]
  return mult


def _definitions(lines) -> tuple[dict[str, tuple], tuple | None]:
  """A computation's instructions by name, (`_split` parts, line), and its root's parts."""
  defs = {parts[0]: (parts, line) for line in lines if (parts := _split(line))}
  root = next((p for p, line in defs.values() if line.lstrip().startswith("ROOT")), None)
  return defs, root


def _constant(line: str) -> int:
  return int(re.search(r"constant\((-?\d+)\)", line).group(1))


def _callees(line: str) -> list[str]:
  return re.findall(r"(?:calls|to_apply|branch_computations|true_computation|"
                    r"false_computation)=(\{[^}]*\}|%?[\w.\-]+)", line)


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
  """Counts the collectives an optimized HLO module runs per call, and their result bytes.

  Args:
    hlo_text: `compiled.as_text()`.

  Returns:
    {kind: {"count": executions, "bytes": result bytes per chip}} for each kind of
    `COLLECTIVES` present: ops inside loops count once per iteration (`_multipliers`); async
    "-start" ops count under their kind ("-done" halves not again). A ragged all-to-all moves
    only its filled rows, which the program does not fix: it counts the smaller of its send
    and receive buffers (what travels when the rows are spread evenly; the receive buffer is
    the worst case).
  """
  comps, entry = _computations(hlo_text)
  mult = _multipliers(comps, entry) if entry else {}
  kinds = "|".join(sorted(COLLECTIVES, key=len, reverse=True))
  op = re.compile(rf"\s({kinds})(-start)?\(")
  size = lambda shapes: sum(_DTYPE_BYTES.get(dt, 4) * math.prod(
      int(x) for x in dims.split(",") if x) for dt, dims in shapes)
  results = {}  # instruction -> its result's shapes (operands are printed without types)
  for lines in comps.values():
    for line in lines:
      head = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+)", line)
      if head:
        results[head.group(1)] = re.findall(r"([a-z][a-z0-9]*)\[([0-9,]*)\]", head.group(2))
  out: dict[str, dict[str, int]] = {}
  for name, lines in comps.items():
    for line in lines:
      found = op.search(line)
      if not found or " = " not in line[:found.start()]:
        continue
      shapes = re.findall(r"([a-z][a-z0-9]*)\[([0-9,]*)\]",
                          line[line.index(" = ") + 3:found.start()])
      if found.group(2) and len(shapes) > 1:
        shapes = shapes[len(shapes) // 2:]  # an async start's (operands, results)
      nbytes = size(shapes)
      if found.group(1) == "ragged-all-to-all":  # the filled rows of the smaller buffer
        first = re.match(r"\s*%?([\w.\-]+)", line[found.end():])
        if first and first.group(1) in results:
          nbytes = min(nbytes, size(results[first.group(1)]))
      times = mult.get(name, 1)
      entry_ = out.setdefault(found.group(1), {"count": 0, "bytes": 0})
      entry_["count"] += times
      entry_["bytes"] += times * nbytes
  return out


def _arrays(type_text: str) -> list[tuple[float, bool]]:
  """(bytes, in HBM) of each array of an HLO type, "(bf16[8,128]{1,0:T(8,128)S(1)}, s32[])"."""
  out = []
  for dtype, dims, layout in _ARRAY.findall(type_text):
    space = re.search(r"S\((\d+)\)", layout or "")
    n = math.prod(int(x) for x in dims.split(",") if x)
    out.append((_DTYPE_BYTES.get(dtype, 4) * n, space is None or space.group(1) == "0"))
  return out


def _hbm(arrays) -> float:
  return sum(n for n, in_hbm in arrays if in_hbm)


def _split(line: str):
  """(name, result type, opcode, operand names, the rest) of an instruction line, or None."""
  head = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
  if not head:
    return None
  rest, depth, i = line[head.end():], 0, 0
  while i < len(rest) and (depth or rest[i] != " "):  # the type, parenthesised if a tuple
    depth += {"(": 1, ")": -1}.get(rest[i], 0)
    i += 1
  type_text, rest = rest[:i], rest[i + 1:]
  op = re.match(r"([\w\-]+)\(", rest)
  if not op:
    return None
  depth, j = 1, op.end()
  while j < len(rest) and depth:
    depth += {"(": 1, ")": -1}.get(rest[j], 0)
    j += 1
  operands = re.findall(r"%([\w.\-]+)", rest[op.end():j - 1])
  return head.group(1), type_text, op.group(1), operands, rest[j:]


def _fusion_reads(comp: list[tuple], table: dict) -> tuple[dict[int, float], float | None]:
  """For a fused computation (its (`_split` parts, line) pairs): {parameter number: bytes
  read} for parameters read only through slices, and the update's bytes when its root updates
  a parameter in place (dynamic-update-slice), else None.

  A slice reads what it returns; behind a pad, the unpadded operand's share of it; behind a
  bitcast or inside a nested fusion, what the nested slices read. `table`: every
  computation's pairs, for the nested fusions."""
  params, users, types, root = {}, {}, {}, None
  for (name, type_text, op, operands, _), line in comp:
    types[name] = type_text
    if op == "parameter":
      params[name] = int(re.search(r"parameter\((\d+)\)", line).group(1))
    for k, o in enumerate(operands):
      users.setdefault(o, []).append((op, k, name, line))
    if line.lstrip().startswith("ROOT"):
      root = (op, operands)
  size = lambda name: sum(n for n, _ in _arrays(types.get(name, "")))  # noqa: E731

  def through_slices(name: str) -> float | None:
    total = 0.0
    for op, k, user, line in users.get(name) or [("", -1, "", "")]:
      if op in _SLICING and k == 0:
        total += size(user)
      elif op in ("pad", "bitcast") and k == 0 and (inner := through_slices(user)) is not None:
        total += inner * min(1.0, size(name) / max(size(user), 1.0))
      elif op == "fusion" and (called := re.search(r"calls=%?([\w.\-]+)", line)) and (
          inner := _fusion_reads(table.get(called.group(1), []), table)[0].get(k)) is not None:
        total += inner
      else:
        return None
    return total

  sliced = {number: b for name, number in params.items()
            if (b := through_slices(name)) is not None}
  update = None
  if root and root[0] == "dynamic-update-slice" and root[1][0] in params:
    update = size(root[1][1])
    sliced[params[root[1][0]]] = 0.0  # updated in place: not read
  return sliced, update


def hbm_bytes(hlo_text: str) -> dict[str, float]:
  """HBM bytes an optimized TPU HLO module reads and writes: per iteration of its loop, and
  per call around it.

  Each instruction of the entry computation, of loop bodies and of branches counts its operands
  and results that live in HBM (a layout without a memory space, or `S(0)`; VMEM and the scalar
  memories are on chip): slicing ops (dynamic-slice, slice, gather, inside a fusion too) read
  what they return; an in-place dynamic-update-slice writes its update; a Mosaic kernel counts
  the bytes it declares (`pl.CostEstimate`: it DMAs what it needs, not its operands whole); an
  asynchronous copy or slice reads its source and writes its destination once; views, tuples
  and the "-done" halves of async pairs count nothing. Ops in loops with a static trip count
  count once per trip.

  Args:
    hlo_text: `compiled.as_text()` of a program compiled for TPU.

  Returns:
    {"loop": the bytes of one iteration of the entry computation's while loops (the decode
    steps of an engine call; 0.0 without a loop), "outside": the bytes of the rest of a call
    (the code before and after the loop)}.
  """
  comps, entry = _computations(hlo_text)
  mult = _multipliers(comps, entry) if entry else {}
  table = {name: [(parts, line) for line in lines if (parts := _split(line))]
           for name, lines in comps.items()}
  types = {parts[0]: parts[1] for instrs in table.values() for parts, _ in instrs}
  fused = {c for instrs in table.values() for parts, line in instrs if parts[2] != "call"
           for cs in re.findall(r"(?:calls|to_apply)=(\{[^}]*\}|%?[\w.\-]+)", line)
           for c in re.findall(r"%?([\w.\-]+)", cs)}  # fusions, reductions' scalar code
  loop_mult, inside = 1, set()
  for line in comps.get(entry, ()):
    loop = re.search(r"condition=%?([\w.\-]+), body=%?([\w.\-]+)", line)
    if loop:
      loop_mult = mult.get(loop.group(2), 1)
      stack = [loop.group(1), loop.group(2)]
      while stack:
        name = stack.pop()
        if name not in inside:
          inside.add(name)
          for l in comps.get(name, ()):
            stack += re.findall(r"(?:condition|body)=%?([\w.\-]+)", l)
            stack += [c for cs in _callees(l) for c in re.findall(r"%?([\w.\-]+)", cs)]
  total = {"loop": 0.0, "outside": 0.0}
  for comp, instrs in table.items():
    if comp in fused or comp not in mult:
      continue
    for parts, line in instrs:
      if parts[2] in _FREE:
        continue
      nbytes = _instruction_bytes(parts, line, types, table)
      if comp in inside:
        total["loop"] += nbytes * mult[comp] / loop_mult
      else:
        total["outside"] += nbytes * mult[comp]
  return total


def _instruction_bytes(parts, line: str, types: dict[str, str], table) -> float:
  """HBM bytes one execution of an instruction moves (the rules of `hbm_bytes`; `table`:
  each computation's (`_split` parts, line) pairs)."""
  name, type_text, op, operands, rest = parts
  out = _arrays(type_text)
  operand_arrays = {o: _arrays(types.get(o, "")) for o in dict.fromkeys(operands)}
  read = lambda o: _hbm(operand_arrays.get(o, []))  # noqa: E731
  if op == "custom-call":
    declared = re.search(r'"cost_estimate":\{[^}]*"bytes_accessed":"(\d+)"', line)
    if declared:
      return float(declared.group(1))
    if 'custom_call_target="ConcatBitcast"' in line:
      return 0.0
  if op == "copy-start":  # (destination, source, context)
    return sum(read(o) for o in operand_arrays) + _hbm(out[:1])
  if op == "slice-start":  # ((source), destination, context): the slice read, then written
    dest = out[-2:-1]
    source_in_hbm = any(h for _, h in operand_arrays.get(operands[0], [])) if operands else False
    return (sum(n for n, _ in dest) if source_in_hbm else 0.0) + _hbm(dest)
  if op.endswith("-start"):  # async collectives: (operands, results)
    return _hbm(out)
  if op in _SLICING:
    first = operand_arrays.get(operands[0], []) if operands else []
    return (sum(n for n, _ in out) if any(h for _, h in first) else 0.0) + _hbm(out)
  if op == "dynamic-update-slice":
    update = _arrays(types.get(operands[1], "")) if len(operands) > 1 else []
    return 2 * _hbm(update)
  if op == "fusion":
    called = re.search(r"calls=%?([\w.\-]+)", line)
    sliced, update = (_fusion_reads(table.get(called.group(1), []), table) if called
                      else ({}, None))
    reads = 0.0
    for k, o in enumerate(operands):
      if operands.index(o) != k:
        continue  # the same buffer passed twice is read once
      full = read(o)
      reads += min(full, sliced[k]) if k in sliced and full else full
    return reads + (update if update is not None and _hbm(out) else _hbm(out))
  return sum(read(o) for o in operand_arrays) + _hbm(out)
