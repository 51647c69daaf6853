"""The Pallas GPU tree-attention kernel on a real GPU: correctness and timings.

    python3 -m benchmarks.gpu_kernels [--parts=env,correctness,timing,sweep] [--repeats=20]
    python3 -m benchmarks.gpu_kernels --parts=lower,triton_offline   # no GPU needed

Parts (each prints one JSON line per measurement, then a summary table):
  lower        lower fwd + VJP of every configuration below for CUDA (works without a GPU;
               since jax 0.11 under an abstract H100 device) and report the input precision
               of the kernels' fp32 dots (TF32 at the default matmul precision).
  triton_offline  compile the captured Triton IR for sm_90 with pip `triton` (shared memory,
               registers, spills, wgmma, cp.async); an approximation of XLA's own Triton.
  correctness  `tree_attention(..., interpret=False)` (models/kernels/tree_attention_gpu.py)
               against the XLA reference `models.kernels.attention.attention` on tree cases
               from tests/tree_cases.py (random trees, bushy trees, packed rows, causal rows,
               block-edge segments, a shared prefix + 8 branches; GQA, MQA, MLA head dims,
               ragged lengths): forward output, max logits and dQ/dK/dV through jax.vjp, as
               max abs and relative (||got - want|| / ||want||) errors. The reference always
               runs in fp32 at matmul precision "highest" (upcast inputs). fp32 kernel inputs
               run twice: at JAX's default matmul precision (the kernel's fp32 dots then lower
               to TF32 on the GPU) and traced under `jax.default_matmul_precision("highest")`
               (IEEE fp32 dots). bf16 kernel inputs are compared with the same fp32 reference,
               next to the XLA reference run in bf16 as a yardstick. The computed-tile bitmap
               (`debug_blocks=True`) is compared with the brute-force mask.
  timing       forward and forward+backward (grad of sum(out * ct) w.r.t. q, k, v) of the
               Pallas kernel vs the dense masked XLA reference and, for causal rows,
               `jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)`; bf16,
               head_dim 128, 16 query heads. Rows: causal; a tree (shared 2048-token prefix + 8
               branches); 4096-token groups (1024 prefix + 8 x 384) packed into one row; and the
               tree's linearized equivalent (8 causal sequences prefix + branch) as the
               baseline a tree replaces. Median of --repeats timed calls after warm-up, host
               timer around `block_until_ready` (dispatch included). Also the share of
               (q block, k block) tiles the kernel skips, and TFLOP/s over the allowed pairs
               only (fwd 4 * pairs * d * heads; fwd+bwd 3.5 x that, the FlashAttention-2
               convention).
  sweep        block_q / block_k / num_warps / num_stages variants on one causal and one tree
               row of 8192 tokens.

Runs on the current backend; meant for a CUDA GPU (interpret=False). With --out (default
$OUT if set) it also writes gpu_kernels.jsonl there.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax.experimental import pallas as pl

from models.kernels import tree_attention_gpu
from models.kernels.attention import attention
from models.kernels.tree_attention_gpu import tree_attention
from tests import tree_cases as tc

flags.DEFINE_list("parts", ["env", "correctness", "timing", "sweep"], "parts to run")
flags.DEFINE_integer("repeats", 20, "timed calls per measurement (median reported)")
flags.DEFINE_list("sizes", ["4096", "8192", "16384"], "row lengths of the timing part")
flags.DEFINE_float("deadline_s", 540.0, "skip remaining measurements after this many seconds")
flags.DEFINE_bool("interpret", False, "run the kernel in interpret mode (local smoke test only)")
flags.DEFINE_integer("max_correctness_len", 0, "skip correctness configs longer than this (0: none)")
flags.DEFINE_string("out", os.environ.get("OUT", ""), "folder for gpu_kernels.jsonl")
FLAGS = flags.FLAGS

T0 = time.time()
RECORDS: list[dict] = []


def emit(rec: dict) -> None:
  rec = {"t": round(time.time() - T0, 1), **rec}
  RECORDS.append(rec)
  line = json.dumps(rec)
  print(line, flush=True)
  if FLAGS.out:
    with open(os.path.join(FLAGS.out, "gpu_kernels.jsonl"), "a") as f:
      f.write(line + "\n")


def log_error(where: str, e: BaseException) -> str:
  tb = traceback.format_exc()
  if FLAGS.out:
    with open(os.path.join(FLAGS.out, "errors.log"), "a") as f:
      f.write(f"==== {where}\n{tb}\n")
  print(f"ERROR in {where}:\n{tb[-4000:]}", file=sys.stderr, flush=True)
  msg = f"{type(e).__name__}: {e}"
  return msg[:1500]


def late() -> bool:
  return time.time() - T0 > FLAGS.deadline_s


# ----------------------------------------------------------------------------- end rows


def prefix_branches(length: int, prefix: int, branches: int) -> np.ndarray:
  """One tree: a shared `prefix` then `branches` equal branches (the rest of the row)."""
  size = (length - prefix) // branches
  assert prefix + size * branches == length, (length, prefix, branches)
  end = np.full(length, length, np.int32)
  for b in range(branches):
    s = prefix + b * size
    end[s:s + size] = s + size
  return end


def packed_groups(length: int, group: int = 4096) -> np.ndarray:
  """Groups of `group` tokens (1024 prefix + 8 branches) packed into one row."""
  parts = [prefix_branches(group, 1024, 8)] * (length // group)
  return tc.packed_row(parts, length)


def random_tree(seed, n, **kw):
  return tc.random_tree_end(np.random.default_rng(seed), n, **kw)[0]


def packed_mix(seed, length):
  """Several random trees + a causal sequence + padding in one row (as in the tests)."""
  rng = np.random.default_rng(seed)
  a, b, c = (int(x) for x in rng.integers(length // 8, length // 4, size=3))
  parts = [tc.random_tree_end(rng, a)[0], tc.random_tree_end(rng, b, max_depth=3)[0],
           np.full(c, c, np.int32)]
  return tc.packed_row(parts, length)


def edges(length):
  """Segments ending one past, at and one before block boundaries (multiples of 32)."""
  parts, used = [], 0
  for n in (33, 31, 1, 30, 1, 32, 2):
    if used + n > length:
      break
    parts.append(np.full(n, n, np.int32) if n != 30 else random_tree(9, n))
    used += n
  return tc.packed_row(parts, length)


ENDS = {
    "trees": lambda n: [random_tree(1, n), random_tree(2, n)],
    "bushy_trees": lambda n: [random_tree(3, n, max_depth=3, max_branch=4),
                              random_tree(4, n, max_depth=8, max_branch=16)],
    "packed": lambda n: [packed_mix(5, n), packed_mix(6, n)],
    "causal": lambda n: [tc.causal_end(n), tc.causal_end(n - 7, n)],
    "tree_and_packed": lambda n: [random_tree(7, n), packed_mix(8, n)],
    "edges": lambda n: [edges(n), tc.packed_row(
        [np.full(63, 63, np.int32), np.full(2, 2, np.int32), np.full(30, 30, np.int32)], n)],
    "prefix8": lambda n: [prefix_branches(n, n // 4, 8), packed_mix(10, n)],
}


def tile_stats(end_rows, bq: int, bk: int) -> dict:
  """Skipped / full / masked shares of all (q block, k block) tiles of the padded rows, by the
  kernel's rule, and the allowed (i, j) pairs (sum over keys of end[j] - j)."""
  skip = full = total = 0
  pairs = 0
  for e in end_rows:
    e = np.asarray(e, np.int64)
    length = len(e)
    mult = max(bq, bk)
    lp = -(-length // mult) * mult
    ep = np.concatenate([np.minimum(e, length), np.arange(length + 1, lp + 1)])
    pairs += int(np.sum(np.minimum(e, length) - np.arange(length)))
    blocks = ep.reshape(lp // bk, bk)
    mn, mx = blocks.min(1), blocks.max(1)
    q0 = np.arange(lp // bq)[:, None] * bq
    k0 = np.arange(lp // bk)[None, :] * bk
    s = (k0 >= q0 + bq) | (mx[None, :] <= q0)
    f = ~s & (k0 + bk <= q0 + 1) & (mn[None, :] >= q0 + bq)
    skip += int(s.sum())
    full += int(f.sum())
    total += s.size
  return {"tiles": total, "skipped_share": round(skip / total, 4),
          "full_share": round(full / total, 4),
          "masked_share": round((total - skip - full) / total, 4), "allowed_pairs": pairs}


def brute_blocks(end_rows, bq, bk):
  """Tiles with at least one allowed pair of the brute-force mask (padded as the kernel)."""
  out = []
  for e in end_rows:
    length = len(e)
    lp = -(-length // max(bq, bk)) * max(bq, bk)
    padded = np.concatenate([e, np.arange(length + 1, lp + 1)]).astype(np.int32)
    allowed = tc.allowed(padded)
    out.append(allowed.reshape(lp // bq, bq, lp // bk, bk).any(axis=(1, 3)))
  return np.stack(out).astype(np.int32)


# ----------------------------------------------------------------------------- env


def part_env():
  dev = jax.devices()[0]
  rec = {"part": "env", "jax": jax.__version__, "jaxlib": jax.lib.__version__ if hasattr(
      jax.lib, "__version__") else None, "backend": jax.default_backend(),
      "device_kind": dev.device_kind, "devices": len(jax.devices()), "python": sys.version.split()[0]}
  try:
    import jaxlib
    rec["jaxlib"] = jaxlib.__version__
  except Exception:  # noqa: BLE001
    pass
  try:
    rec["compute_capability"] = getattr(dev, "compute_capability", None)
  except Exception:  # noqa: BLE001
    pass
  try:
    stats = dev.memory_stats() or {}
    rec["bytes_limit_gib"] = round(stats.get("bytes_limit", 0) / 2**30, 1)
  except Exception:  # noqa: BLE001
    pass
  emit(rec)


# ----------------------------------------------------------------------------- correctness


def _err(got, want):
  g = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
  w = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
  nan = int(np.sum(~np.isfinite(g)))
  abs_err = float(np.max(np.abs(g - w))) if g.size else 0.0
  rel = float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))
  return {"max_abs": float(f"{abs_err:.3g}"), "rel": float(f"{rel:.3g}"), "nonfinite": nan}


def _vjp_fn(kind, scale, bq=64, bk=64, precision=None):
  """Jitted (out, max_logits, (dq, dk, dv)) of the kernel ("pallas") or reference ("xla")."""
  def run(q, k, v, end, ct):
    if kind == "pallas":
      fn = lambda q, k, v: tree_attention(q, k, v, end, scale=scale, block_q=bq, block_k=bk,
                                          interpret=FLAGS.interpret)
    else:
      fn = lambda q, k, v: attention(q, k, v, end, scale=scale)
    (out, ml), vjp = jax.vjp(fn, q, k, v)
    return out, ml, vjp((ct, jnp.zeros_like(ml)))

  jitted = jax.jit(run)
  if precision is None:
    return jitted

  def call(*args):
    with jax.default_matmul_precision(precision):
      return jitted(*args)
  return call


# (name, batch, L, heads, kv_heads, qk_dim, v_dim, block_q, block_k, end kinds)
CORRECTNESS = [
    ("base", 2, 128, 2, 2, 16, 16, 32, 32, ["trees", "bushy_trees", "packed", "causal", "edges"]),
    ("ragged", 2, 150, 2, 2, 16, 16, 64, 32, ["tree_and_packed", "causal", "edges"]),
    ("gqa_mla", 2, 96, 4, 2, 24, 16, 32, 64, ["tree_and_packed"]),
    ("mqa_mla_ragged", 2, 83, 4, 1, 24, 16, 32, 32, ["tree_and_packed", "causal"]),
    ("mla_model", 1, 1024, 8, 8, 48, 32, 64, 64, ["tree_and_packed", "prefix8"]),
    ("gqa_d128", 2, 2048, 16, 4, 128, 128, 64, 64, ["trees", "packed", "causal", "prefix8"]),
    ("mha_d128_ragged", 1, 1000, 16, 16, 128, 128, 64, 64, ["tree_and_packed", "causal"]),
]


def part_correctness():
  for (name, batch, length, heads, kvh, dqk, dv, bq, bk, kinds) in CORRECTNESS:
    if FLAGS.max_correctness_len and length > FLAGS.max_correctness_len:
      continue
    scale = dqk ** -0.5
    ref = _vjp_fn("xla", scale, precision="highest")
    ref_bf16 = _vjp_fn("xla", scale)
    variants = [("fp32", jnp.float32, _vjp_fn("pallas", scale, bq, bk)),
                ("fp32_highest", jnp.float32, _vjp_fn("pallas", scale, bq, bk, "highest")),
                ("bf16", jnp.bfloat16, _vjp_fn("pallas", scale, bq, bk))]
    blocks_fn = jax.jit(lambda q, k, v, end: tree_attention(
        q, k, v, end, scale=scale, block_q=bq, block_k=bk, debug_blocks=True,
        interpret=FLAGS.interpret))
    for kind in kinds:
      if late():
        emit({"part": "correctness", "case": f"{name}-{kind}", "skipped": "deadline"})
        continue
      rows = ENDS[kind](length)[:batch]
      end = jnp.asarray(np.stack(rows), jnp.int32)
      q, k, v, ct = tc.random_qkv(zlib.crc32(f"{name}-{kind}".encode()), batch, length, heads, kvh, dqk,
                                  dv)
      want = ref(q, k, v, end, ct)
      base = {"part": "correctness", "case": f"{name}-{kind}", "batch": batch, "L": length,
              "heads": heads, "kv_heads": kvh, "qk_dim": dqk, "v_dim": dv, "block_q": bq,
              "block_k": bk, **{k_: v_ for k_, v_ in tile_stats(rows, bq, bk).items()
                                if k_ in ("skipped_share", "full_share")}}
      # Bitmap of computed tiles vs brute force (fp32 inputs).
      try:
        _, _, blocks = blocks_fn(q, k, v, end)
        base["blocks_match_brute_force"] = bool(np.array_equal(
            np.asarray(blocks), brute_blocks(rows, bq, bk)))
      except Exception as e:  # noqa: BLE001
        base["blocks_error"] = log_error(f"blocks {name}-{kind}", e)
      for vname, dtype, fn in variants:
        rec = dict(base, dtype=vname)
        try:
          t = time.time()
          got = fn(*(x.astype(dtype) for x in (q, k, v)), end, ct.astype(dtype))
          jax.block_until_ready(got)
          rec["first_call_s"] = round(time.time() - t, 2)
          out, ml, (dq, dk, dv_) = got
          r_out, r_ml, (r_dq, r_dk, r_dv) = want
          rec["err"] = {"out": _err(out, r_out), "max_logits": _err(ml, r_ml),
                        "dq": _err(dq, r_dq), "dk": _err(dk, r_dk), "dv": _err(dv_, r_dv)}
          if vname == "bf16":
            b16 = ref_bf16(*(x.astype(jnp.bfloat16) for x in (q, k, v)), end,
                           ct.astype(jnp.bfloat16))
            rec["xla_bf16_err"] = {"out": _err(b16[0], r_out), "max_logits": _err(b16[1], r_ml),
                                   "dq": _err(b16[2][0], r_dq), "dk": _err(b16[2][1], r_dk),
                                   "dv": _err(b16[2][2], r_dv)}
        except Exception as e:  # noqa: BLE001
          rec["error"] = log_error(f"correctness {name}-{kind} {vname}", e)
        emit(rec)


# ----------------------------------------------------------------------------- timing


def bench(fn, args, repeats):
  """(compile_s, median_s, min_s, max_s) of fn(*args): first call, 2 warm-ups, `repeats`."""
  t = time.perf_counter()
  jax.block_until_ready(fn(*args))
  compile_s = time.perf_counter() - t
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return compile_s, statistics.median(times), min(times), max(times)


def _impl_fns(impl, scale, causal_only=False, bq=64, bk=64, num_warps=None, num_stages=2):
  """(forward, forward+backward) jitted functions of (q, k, v, end, ct) for one impl."""
  if impl == "pallas":
    f = lambda q, k, v, end: tree_attention(q, k, v, end, scale=scale, block_q=bq, block_k=bk,
                                            num_warps=num_warps, num_stages=num_stages,
                                            interpret=FLAGS.interpret)[0]
  elif impl == "xla":
    f = lambda q, k, v, end: attention(q, k, v, end, scale=scale)[0]
  elif impl == "xla_flash":
    f = lambda q, k, v, end: attention(q, k, v, end, scale=scale, impl="xla_flash")[0]
  elif impl == "cudnn":
    f = lambda q, k, v, end: jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=True, implementation="cudnn")
  else:
    raise ValueError(impl)

  def fwd(q, k, v, end, ct):
    return f(q, k, v, end)

  def fwdbwd(q, k, v, end, ct):
    loss = lambda q, k, v: jnp.sum(f(q, k, v, end).astype(jnp.float32) * ct.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  return jax.jit(fwd), jax.jit(fwdbwd)


def time_row(label, row_kind, batch, heads, kvh, end_rows, impls, d=128, extra=None,
             **kernel_kw):
  """Time the impls on one configuration; one JSON line per (impl, pass)."""
  length = len(end_rows[0])
  scale = d ** -0.5
  end = jnp.asarray(np.stack(end_rows), jnp.int32)
  q, k, v, ct = tc.random_qkv(length + batch, batch, length, heads, kvh, d, d, jnp.bfloat16)
  bq, bk = kernel_kw.get("bq", 64), kernel_kw.get("bk", 64)
  stats = tile_stats(end_rows, bq, bk)
  fwd_flops = 4.0 * stats["allowed_pairs"] * d * heads
  base = {"part": "timing", "label": label, "row": row_kind, "batch": batch, "L": length,
          "heads": heads, "kv_heads": kvh, "head_dim": d, "dtype": "bf16", **stats,
          **(extra or {})}
  results = {}
  for impl in impls:
    logits_gib = batch * heads * length * length * 4 / 2**30
    for pass_name, flops in (("fwd", fwd_flops), ("fwd+bwd", 3.5 * fwd_flops)):
      rec = dict(base, impl=impl, passes=pass_name)
      if impl == "pallas":
        rec.update(block_q=bq, block_k=bk, num_warps=kernel_kw.get("num_warps"),
                   num_stages=kernel_kw.get("num_stages", 2))
      if late():
        rec["skipped"] = "deadline"
        emit(rec)
        continue
      if impl == "xla" and logits_gib > (24 if pass_name == "fwd" else 8):
        rec["skipped"] = f"memory: dense fp32 logits alone {logits_gib:.0f} GiB"
        emit(rec)
        continue
      try:
        fwd, fwdbwd = _impl_fns(impl, scale, **(kernel_kw if impl == "pallas" else {}))
        fn = fwd if pass_name == "fwd" else fwdbwd
        compile_s, med, lo, hi = bench(fn, (q, k, v, end, ct), FLAGS.repeats)
        rec.update(compile_s=round(compile_s, 2), median_ms=round(med * 1e3, 3),
                   min_ms=round(lo * 1e3, 3), max_ms=round(hi * 1e3, 3),
                   tflops_allowed=round(flops / med / 1e12, 1))
        results[(impl, pass_name)] = med
      except Exception as e:  # noqa: BLE001
        rec["error"] = log_error(f"timing {label} {impl} {pass_name}", e)
      emit(rec)
  return results


def part_timing():
  sizes = [int(s) for s in FLAGS.sizes]
  h = 16
  for length in sizes:
    # Causal rows.
    configs = [(1, 4)]
    if length == 4096:
      configs.append((4, 4))
    if length == 8192:
      configs.append((1, 16))
    for batch, kvh in configs:
      impls = ["pallas", "cudnn", "xla"] + (["xla_flash"] if length <= 8192 else [])
      time_row(f"causal L={length} b={batch} kvh={kvh}", "causal", batch, h, kvh,
               [tc.causal_end(length)] * batch, impls)
    # A tree: shared 2048 prefix + 8 branches; and its linearized equivalent.
    prefix, nb = 2048, 8
    branch = (length - prefix) // nb
    tree_row = prefix_branches(length, prefix, nb)
    impls = ["pallas", "xla"] + (["xla_flash"] if length <= 8192 else [])
    time_row(f"tree L={length} (2048 + 8x{branch})", "tree_prefix8", 1, h, 4, [tree_row], impls)
    lin = prefix + branch
    time_row(f"linearized 8 x {lin} causal (same tree)", "linearized", nb, h, 4,
             [tc.causal_end(lin)] * nb, ["pallas", "cudnn"],
             extra={"tree_L": length})
    if length == 16384:
      time_row(f"packed 4 groups x 4096 (1024 + 8x384) L={length}", "packed_groups", 1, h, 4,
               [packed_groups(length)], ["pallas", "xla"])


SWEEP = [(64, 64, None, 2), (64, 64, 4, 2), (64, 64, 8, 3), (128, 64, 8, 2), (64, 128, 8, 2),
         (128, 128, 8, 2), (128, 64, 8, 3), (32, 32, 4, 2)]


def part_sweep():
  length, h, kvh = 8192, 16, 4
  rows = {"causal": tc.causal_end(length), "tree_prefix8": prefix_branches(length, 2048, 8)}
  for row_kind, row in rows.items():
    for bq, bk, nw, ns in SWEEP:
      time_row(f"sweep {row_kind} L={length}", row_kind, 1, h, kvh, [row], ["pallas"],
               bq=bq, bk=bk, num_warps=nw, num_stages=ns)


# ----------------------------------------------------------------------------- lower


def _cuda_target():
  """Context for lowering to CUDA off a GPU: since jax 0.11 the Pallas Triton lowering asks for
  the GPU's compute capability and, with no GPU present, needs an abstract H100 device."""
  if jax.default_backend() == "gpu" or not hasattr(jax.sharding, "AbstractDevice"):
    return contextlib.nullcontext()
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                       platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


def _lower_cuda(fn, args):
  with _cuda_target():
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def _triton_ir(fn, args, precision=None):
  """Triton IR text of the Pallas kernels in fn(*args), lowered for CUDA (no GPU needed): the
  kernel module's `pl.pallas_call` is wrapped with debug=True, which prints the IR."""
  saved = tree_attention_gpu.pl
  tree_attention_gpu.pl = types.SimpleNamespace(**{n: getattr(pl, n) for n in dir(pl)
                                                   if not n.startswith("__")})
  tree_attention_gpu.pl.pallas_call = functools.partial(pl.pallas_call, debug=True)
  buf = io.StringIO()
  try:
    with contextlib.redirect_stdout(buf), (jax.default_matmul_precision(precision) if precision
                                           else contextlib.nullcontext()):
      _lower_cuda(fn, args)
  finally:
    tree_attention_gpu.pl = saved
  return buf.getvalue()


def part_lower():
  """Lower every kernel configuration of the other parts for CUDA on the current (any) backend:
  Pallas -> Triton IR lowering errors (unsupported primitives, non-power-of-two tensors) show
  here without a GPU; Triton -> PTX compilation (shared memory, registers) does not."""
  sds = jax.ShapeDtypeStruct
  configs = []
  for (name, batch, length, heads, kvh, dqk, dv, bq, bk, _) in CORRECTNESS:
    for dt in (jnp.float32, jnp.bfloat16):
      configs.append((name, batch, length, heads, kvh, dqk, dv, bq, bk, None, 2, dt))
  for length in (4096, 8192, 16384, 3840, 2816, 2304):
    configs.append((f"timing-{length}", 1, length, 16, 4, 128, 128, 64, 64, None, 2,
                    jnp.bfloat16))
  for bq, bk, nw, ns in SWEEP:
    configs.append((f"sweep-{bq}x{bk}-w{nw}-s{ns}", 1, 8192, 16, 4, 128, 128, bq, bk, nw, ns,
                    jnp.bfloat16))
  for (name, batch, length, heads, kvh, dqk, dv, bq, bk, nw, ns, dt) in configs:
    args = (sds((batch, length, heads, dqk), dt), sds((batch, length, kvh, dqk), dt),
            sds((batch, length, kvh, dv), dt), sds((batch, length), jnp.int32))
    f = lambda q, k, v, end: tree_attention(q, k, v, end, scale=dqk ** -0.5, block_q=bq,
                                            block_k=bk, num_warps=nw, num_stages=ns)[0]
    g = lambda q, k, v, end: jax.grad(
        lambda q, k, v: jnp.sum(f(q, k, v, end).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)
    rec = {"part": "lower", "case": name, "dtype": jnp.dtype(dt).name, "batch": batch,
           "L": length, "heads": heads, "kv_heads": kvh, "qk_dim": dqk, "v_dim": dv,
           "block_q": bq, "block_k": bk, "num_warps": nw, "num_stages": ns}
    try:
      text = _lower_cuda(g, args).as_text()
      rec["kernels"] = re.findall(
          r'name = "(tree_attention_\w+)", num_stages = (\d+) : i32, num_warps = (\d+)', text)
      rec["ok"] = True
    except Exception as e:  # noqa: BLE001
      rec["ok"] = False
      rec["error"] = log_error(f"lower {name}", e)
    emit(rec)
  # Which precision the fp32 dots get, at the default and at "highest" matmul precision.
  args = (jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.float32),) * 3 + (
      jax.ShapeDtypeStruct((1, 256), jnp.int32),)
  g = lambda q, k, v, end: jax.grad(lambda q, k, v: jnp.sum(tree_attention(
      q, k, v, end, scale=0.125)[0]), argnums=(0, 1, 2))(q, k, v)
  for precision in (None, "highest"):
    try:
      ir = _triton_ir(g, args, precision)
      dots = re.findall(r"tt\.dot [^\n]*", ir)
      modes = sorted({(re.search(r"inputPrecision = (\w+)", d) or [None, "ieee (default)"])[1]
                      for d in dots})
      emit({"part": "lower", "case": "fp32 dot precision", "matmul_precision": precision
            or "default", "tt_dot_lines": len(dots), "input_precision": modes})
    except Exception as e:  # noqa: BLE001
      emit({"part": "lower", "case": "fp32 dot precision", "error": log_error("precision", e)})


# ----------------------------------------------------------------------------- triton_offline

# (name, L, heads, kv_heads, qk_dim, v_dim, block_q, block_k, num_warps, num_stages, dtype)
OFFLINE = [(f"d128-{bq}x{bk}-w{nw}-s{ns}-bf16", 8192, 16, 4, 128, 128, bq, bk, nw, ns, "bfloat16")
           for bq, bk, nw, ns in SWEEP] + [
    ("d128-64x64-wNone-s2-fp32", 2048, 16, 4, 128, 128, 64, 64, None, 2, "float32"),
    ("mla48x32-64x64-fp32", 2304, 8, 8, 48, 32, 64, 64, None, 2, "float32"),
]


def part_triton_offline():
  """Compile the kernels' Triton IR for sm_90 with the pip `triton` package, no GPU needed:
  shared memory, registers and spills (ptxas -v), whether wgmma and asynchronous copies
  (software pipelining) appear. pip Triton stands in for the Triton inside XLA, so this is an
  approximation of what the GPU build does. The IR is captured by wrapping jax's (private)
  Pallas Triton lowering entry point."""
  import triton
  from jax._src.pallas.triton import lowering as tl
  from triton.backends.compiler import GPUTarget

  ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
  captured = []
  original = tl.lower_jaxpr_to_triton_module

  def capture(*args, **kwargs):
    result = original(*args, **kwargs)
    captured.append(result.module.operation.get_asm(enable_debug_info=False))
    return result

  for (name, length, heads, kvh, dqk, dv, bq, bk, nw, ns, dt) in OFFLINE:
    sds = jax.ShapeDtypeStruct
    args = (sds((1, length, heads, dqk), dt), sds((1, length, kvh, dqk), dt),
            sds((1, length, kvh, dv), dt), sds((1, length), jnp.int32))
    f = lambda q, k, v, end: tree_attention(q, k, v, end, scale=dqk ** -0.5, block_q=bq,
                                            block_k=bk, num_warps=nw, num_stages=ns)[0]
    g = lambda q, k, v, end: jax.grad(
        lambda q, k, v: jnp.sum(f(q, k, v, end).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)
    captured.clear()
    tl.lower_jaxpr_to_triton_module = capture
    try:
      text = _lower_cuda(g, args).as_text()
    except Exception as e:  # noqa: BLE001
      emit({"part": "triton_offline", "config": name, "error": log_error(f"offline {name}", e)})
      continue
    finally:
      tl.lower_jaxpr_to_triton_module = original
    launch = {k: (int(s_), int(w)) for k, s_, w in re.findall(
        r'name = "(tree_attention_\w+)", num_stages = (\d+) : i32, num_warps = (\d+)', text)}
    for module in captured:
      kernel = re.search(r"tt\.func public @(\w+)", module).group(1)
      stages, warps = launch[kernel]
      rec = {"part": "triton_offline", "config": name, "kernel": kernel, "num_warps": warps,
             "num_stages": stages, "triton": triton.__version__}
      try:
        with tempfile.TemporaryDirectory() as tmp:
          src = os.path.join(tmp, f"{kernel}.ttir")
          with open(src, "w") as fh:
            fh.write(module)
          compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": warps, "num_stages": stages})
          ptx = compiled.asm["ptx"]
          ptx_path = os.path.join(tmp, "k.ptx")
          with open(ptx_path, "w") as fh:
            fh.write(ptx)
          info = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx_path, "-o", os.devnull],
                                capture_output=True, text=True).stderr
        regs = re.findall(r"Used (\d+) registers", info)
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
        rec.update(shared_kib=compiled.metadata.shared / 1024,
                   registers=int(regs[0]) if regs else None,
                   spill_store_load_bytes=[int(x) for x in spills[0]] if spills else None,
                   wgmma="wgmma.mma_async" in ptx, cp_async="cp.async" in ptx)
      except Exception as e:  # noqa: BLE001
        rec["error"] = log_error(f"offline compile {name} {kernel}", e)
      emit(rec)


# ----------------------------------------------------------------------------- summary


def summary():
  print("\n==== summary", flush=True)
  corr = [r for r in RECORDS if r["part"] == "correctness" and "err" in r]
  if corr:
    print("correctness: case | dtype | rel err out / max_logits(abs) / dq / dk / dv | "
          "blocks ok")
    for r in corr:
      e = r["err"]
      print(f"  {r['case']:<28} {r['dtype']:<13} {e['out']['rel']:.2e} / "
            f"{e['max_logits']['max_abs']:.2e} / {e['dq']['rel']:.2e} / {e['dk']['rel']:.2e} / "
            f"{e['dv']['rel']:.2e} | {r.get('blocks_match_brute_force')}")
  errs = [r for r in RECORDS if "error" in r or "blocks_error" in r]
  for r in errs:
    print(f"  ERROR {r.get('case') or r.get('label')} {r.get('impl') or r.get('dtype')}: "
          f"{(r.get('error') or r.get('blocks_error'))[:300]}")
  tim = [r for r in RECORDS if r["part"] == "timing" and "median_ms" in r]
  if tim:
    print("timing: label | impl | pass | median ms | TFLOP/s (allowed) | skipped tiles")
    for r in tim:
      blk = f" b{r['block_q']}x{r['block_k']} w{r['num_warps']} s{r['num_stages']}" \
          if r["impl"] == "pallas" else ""
      print(f"  {r['label']:<44} {r['impl'] + blk:<22} {r['passes']:<8} "
            f"{r['median_ms']:>9.3f} {r['tflops_allowed']:>7.1f} {r['skipped_share']:.3f}")
  low = [r for r in RECORDS if r["part"] == "lower" and "ok" in r]
  if low:
    print(f"lowered for cuda: {sum(r['ok'] for r in low)} / {len(low)} configurations ok")
  for r in RECORDS:
    if r["part"] == "lower" and "input_precision" in r:
      print(f"  fp32 tt.dot input precision at matmul precision {r['matmul_precision']}: "
            f"{r['input_precision']}")
  off = [r for r in RECORDS if r["part"] == "triton_offline" and "registers" in r]
  if off:
    print("triton_offline (sm_90): config | kernel | warps/stages | shared KiB | regs | "
          "spill st/ld B | wgmma | cp.async")
    for r in off:
      print(f"  {r['config']:<26} {r['kernel']:<20} {r['num_warps']}/{r['num_stages']} "
            f"{r['shared_kib']:>6.0f} {r['registers']:>4} {r['spill_store_load_bytes']} "
            f"{r['wgmma']} {r['cp_async']}")
  print(f"total {time.time() - T0:.0f} s", flush=True)


def main(argv):
  del argv
  if FLAGS.out:
    os.makedirs(FLAGS.out, exist_ok=True)
  parts = {"env": part_env, "lower": part_lower, "triton_offline": part_triton_offline,
           "correctness": part_correctness, "timing": part_timing, "sweep": part_sweep}
  for p in FLAGS.parts:
    try:
      parts[p]()
    except Exception as e:  # noqa: BLE001
      emit({"part": p, "error": log_error(p, e)})
  summary()


if __name__ == "__main__":
  app.run(main)
