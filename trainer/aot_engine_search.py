"""Searching the engine's layout of a slice (`python -m trainer.aot --search`, its decode part).

The engine decodes on its own layout of the trainer's devices, `rl.engine_mesh_shape`
(`trainer.rollouts.decode_mesh`: "tensor=4" keeps those axes' sizes, fsdp the rest; "" is the
trainer's mesh itself). Which layout decodes best is a trade the compiler decides: more
tensor (or expert) parallelism holds fewer weights per chip and reads fewer bytes a step, but
adds all-reduces (all-to-alls) to every layer.

  candidates  the engine meshes over the slice's n chips: tensor T and, for MoE models, expert
              E, fsdp n / (T x E); T splits the heads, key/value heads, vocabulary and MLP
              widths and E the experts (the train step's rules, `trainer.aot_search`); the
              engine must split its slots over the batch shards (`Layout.check`). The
              config's own layout is one of them.
  estimate    per chip, nothing compiled, from the abstract engine (`trainer.aot_engine`): the
              decode layout's weights in the compute dtype (`weight_bytes_per_chip`) plus the
              pool's shard, which is also about what one decode step must read.
  rank        estimated to fit in `aot_search.FIT_FRACTION` of HBM first, then the fewer
              bytes per chip, then the smaller T x E (fewer collectives), then fsdp-first.
  search      compiles the decode call (`aot.compile_run`, programs ("decode",)) in rank
              order, `budget` compiles at most, until `enough` layouts fit under the line.

The best layout is, among the compiled ones that fit under the line (all that fit when none
does), the one with the fastest compiled roofline step; of those within `aot_search.TIE` of
it, the lowest bytes ratio (compiled bytes over the step's minimum,
`aot_engine.engine_programs`), then the least HBM, then the earliest tried. Put it in the
config as `--config.rl.engine_mesh_shape=...`.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Optional

import jax

from models import sharding
from models.engine.layout import Layout
from models.hardware import GB, Chip
from trainer import aot_engine, aot_search, rollouts
from trainer import config as config_lib

BUDGET = 4  # decode compiles at most (the config's own, compiled before, not counted)
ENOUGH = 2  # stop once this many layouts fit under the line (the config's own included)


def shape_text(mesh_shape: dict) -> str:
  """The `rl.engine_mesh_shape` of an engine mesh: its tensor and expert sizes above 1."""
  return ",".join(f"{a}={mesh_shape[a]}" for a in ("tensor", "expert")
                  if mesh_shape.get(a, 1) > 1) or "tensor=1"


def candidates(config, num_devices: int) -> list[str]:
  """The `rl.engine_mesh_shape` values a config's engine may take on `num_devices` chips
  (the config's own first, then by tensor, expert), without checking the engine's slots."""
  cfg = config_lib.model_config(config)
  own = config.rl.get("engine_mesh_shape", "")
  out = [own]
  for tensor, expert in itertools.product(aot_search.divisors(num_devices), repeat=2):
    if num_devices % (tensor * expert) or not aot_search.tensor_divides(cfg, tensor):
      continue
    if expert > 1 and not (cfg.is_moe and cfg.num_experts % expert == 0):
      continue
    text = shape_text({"tensor": tensor, "expert": expert})
    if text not in out:
      out.append(text)
  return out


def estimate(config, shape: str, devices: list) -> dict:
  """A candidate's engine mesh and per-chip estimate (nothing compiled).

  Returns:
    {"engine_mesh_shape", "mesh", "weights_gb", "cache_gb", "estimate_gb"}.

  Raises:
    ValueError: the engine does not fit the mesh (`Layout.check`: slots over the shards).
  """
  model_cfg = config_lib.model_config(config)
  trainer_mesh = sharding.make_mesh(sharding.MeshConfig(
      **dict(zip(sharding.MESH_AXES, config_lib.mesh_shape(config, len(devices))))), devices)
  probe = with_shape(config, shape)
  mesh = rollouts.decode_mesh(probe, trainer_mesh)
  engine_cfg = rollouts.engine_config(probe, model_cfg)
  Layout(mesh, model_cfg).check(engine_cfg)
  _, state = aot_engine.abstract_model(model_cfg, mesh)
  pool, _ = aot_engine.abstract_pool(model_cfg, engine_cfg, mesh)
  weights = aot_engine.weight_bytes_per_chip(state, model_cfg) / GB
  cache = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
              for x in jax.tree.leaves(pool)) / GB
  return {"engine_mesh_shape": shape, "mesh": {k: v for k, v in mesh.shape.items() if v > 1},
          "weights_gb": round(weights, 6), "cache_gb": round(cache, 6),
          "estimate_gb": round(weights + cache, 6)}


def with_shape(config, shape: str):
  """A copy of the config whose engine takes the layout `shape`."""
  c = config.copy_and_resolve_references()
  c.rl.engine_mesh_shape = shape
  return c


def rank(estimates: list[dict], chip: Chip) -> list[dict]:
  """Estimated to fit under the line first, then fewer bytes, then less parallelism."""
  line = aot_search.FIT_FRACTION * chip.hbm_bytes / GB
  parallel = lambda e: e["mesh"].get("tensor", 1) * e["mesh"].get("expert", 1)
  return sorted(estimates, key=lambda e: (e["estimate_gb"] > line, round(e["estimate_gb"], 1),
                                          parallel(e)))


def outcome(program: dict, capacity: float) -> dict:
  """A compiled decode program's fit, HBM, roofline step, bytes ratio and compile time."""
  hbm = program["hbm_gb"]
  total = hbm.get("total", hbm.get("temporaries", 0.0))
  if "error" in program:
    return {"fits": False, "planned": False, "hbm_gb": round(total, 2), "step_s": None,
            "bytes_ratio": None, "compile_s": program["compile_s"],
            "verdict": f"refused by the compiler: needs more than {total:.1f} GB"}
  planned = hbm["fits"] and total <= aot_search.FIT_FRACTION * capacity
  verdict = (f"fits: {total:.1f} GB, {capacity - total:.1f} GB headroom, "
             f"{program['bytes_ratio']:.2f}x the minimum bytes"
             + ("" if planned else f", above {aot_search.FIT_FRACTION:.0%} of HBM")
             if hbm["fits"] else f"does not fit: {total:.1f} GB of {capacity:.0f} GB")
  return {"fits": hbm["fits"], "planned": planned, "hbm_gb": round(total, 2),
          "step_s": program["roofline_s"]["step"], "bytes_ratio": program["bytes_ratio"],
          "compile_s": program["compile_s"], "verdict": verdict}


def best(entries: list[dict]) -> Optional[dict]:
  """Of the compiled layouts that fit under the line (all that fit when none is): the fastest
  roofline step; of those within `aot_search.TIE` of it, the lowest bytes ratio, then the
  least HBM, then the earliest tried (the config's own first)."""
  fit = [e for e in entries if e.get("fits")]
  fit = [e for e in fit if e["planned"]] or fit
  if not fit:
    return None
  fastest = min(e["step_s"] for e in fit)
  near = [e for e in fit if e["step_s"] <= fastest * (1 + aot_search.TIE)]
  return min(near, key=lambda e: (e["bytes_ratio"], e["hbm_gb"]))


def search(config, topology: str, report: dict, *, compile_fn: Callable,
           topology_devices: Callable, budget: int = BUDGET, enough: int = ENOUGH,
           log: Callable[[str], None] = lambda line: print(line, flush=True)) -> dict:
  """Searches the engine's layout of a slice by compiling the decode call.

  Args:
    config: the run's RL config.
    topology: the slice (`aot.topology_devices`).
    report: the config's own report (`aot.compile_run`; its "decode" program, if compiled,
      counts as the config's layout tried).
    compile_fn: `aot.compile_run` (passed in: this module is imported by it).
    topology_devices: `aot.topology_devices` (the slice's Chip and devices).
    budget: decode compiles at most, besides the config's own.
    enough: stop once this many layouts fit under the line.
    log: where a line per tried layout goes.

  Returns:
    {"tried": [estimate + outcome per compiled layout, or + "failed"], "skipped": [estimate +
    "why" per candidate the engine does not fit], "best": its `rl.engine_mesh_shape` or
    None}.
  """
  chip, devices = topology_devices(topology)
  capacity = chip.hbm_bytes / GB
  estimates, skipped = [], []
  for shape in candidates(config, len(devices)):
    try:
      e = estimate(config, shape, devices)
    except ValueError as err:
      skipped.append({"engine_mesh_shape": shape, "why": str(err)})
      continue
    if all(e["mesh"] != other["mesh"] for other in estimates):  # "" may be "tensor=1"
      estimates.append(e)
  own_shape = config.rl.get("engine_mesh_shape", "")
  tried = []
  if "decode" in report.get("programs", {}):
    own = next((e for e in estimates if e["engine_mesh_shape"] == own_shape), None)
    if own is not None:
      tried.append({**own, **outcome(report["programs"]["decode"], capacity)})
  for e in rank([e for e in estimates if not any(
      t["engine_mesh_shape"] == e["engine_mesh_shape"] for t in tried)], chip):
    if sum(t.get("planned", False) for t in tried) >= enough or budget <= 0:
      break
    budget -= 1
    try:
      r = compile_fn(with_shape(config, e["engine_mesh_shape"]), topology, ("decode",))
      entry = {**e, **outcome(r["programs"]["decode"], capacity)}
    except (config_lib.ConfigError, ValueError) as err:
      entry = {**e, "failed": str(err), "fits": False, "verdict": f"failed: {err}"}
    tried.append(entry)
    log(f"engine search: {entry['engine_mesh_shape']} ({entry['mesh']}): estimated "
        f"{e['estimate_gb']:.2f} GB; {entry['verdict']}")
  chosen = best(tried)
  for t in tried:
    t["best"] = t is chosen
  return {"tried": tried, "skipped": skipped,
          "best": None if chosen is None else chosen["engine_mesh_shape"]}


def summary_lines(result: dict) -> list[str]:
  """The search's outcome: a line per compiled layout and the one to use."""
  lines = [f"engine search: {len(result['tried'])} decode layouts compiled"]
  for t in result["tried"]:
    mark = "*" if t.get("best") else " "
    step = "" if t.get("step_s") is None else f", roofline step {1e3 * t['step_s']:.2f} ms"
    lines.append(f" {mark} {t['engine_mesh_shape'] or '(the trainer mesh)'} {t['mesh']}: "
                 f"{t['verdict']}{step}")
  lines.append(f"engine search: use --config.rl.engine_mesh_shape={result['best']}"
               if result["best"] is not None else "engine search: no layout fits")
  return lines
