"""HBM per chip of full fine-tuning, LoRA and QLoRA RL train steps on one TPU host (compiled).

    python -m benchmarks.aot_lora                                   # every plan, JSON per plan
    python -m benchmarks.aot_lora --plans=qwen7b-v5p-2x2x1-lora,qwen7b-v5p-2x2x1-qlora-int8
    python -m benchmarks.aot_lora --out_dir=docs/aot --update_docs  # also the docs block
    python -m benchmarks.aot_lora --docs_only --out_dir=docs/aot --update_docs

Each plan is the RL template (configs/rl.py, its AdamW with fp32 moments) for Qwen2.5-Coder-7B
or -32B on one host: v5p "2x2x1" (4 chips, 95 GB each) or v6e "2x4" (8 chips, 32 GB each),
FSDP over the host's chips, bf16 compute, full remat, the Pallas TPU tree kernel, one row of
`ROW_LEN` tokens per chip per micro-batch. The fine-tuning modes:

  full        every parameter trained (fp32 parameters, gradients and AdamW moments);
  lora        rank-16 adapters (alpha 32) on attention and MLP projections, trained alone; the
              frozen base kept in the parameter dtype (fp32) in TrainState.model_state;
  qlora-int8  the same adapters over an int8 base (qwix weight-only quantization);
  qlora-int4  over an int4 base.

The "-8k" plans rerun on v6e what does not fit there at 16,384 tokens (7B full fine-tuning,
32B LoRA and QLoRA) with rows of 8,192 tokens and twice the micro-batches.

The train step (the accumulation over micro-batches and the optimizer update, `trainer.aot`)
is compiled by the XLA TPU compiler on this machine (no TPU). Per chip each report holds the
state's bytes by part (the abstract TrainState's shardings: trained parameters, the frozen
base, the optimizer moments), the compiled programs' memory analysis (arguments, temporaries,
total), the step's peak with the resident optimizer state and whether it fits, and the
compiled roofline. A plan whose resident state alone exceeds the chip's HBM (32B full
fine-tuning on one host) is reported from the state's bytes and not compiled. `--update_docs`
rewrites the block of docs/scaling.md between
`<!-- aot-lora:start -->` and `<!-- aot-lora:end -->` from every plan with a JSON in --out_dir.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from typing import NamedTuple, Optional

from benchmarks import aot_plans, common
from configs import rl as rl_config
from models import sharding
from models.hardware import CHIPS, GB
from trainer import aot
from trainer import config as config_lib
from trainer import optim
from trainer import state as state_lib

ROW_LEN, SEQ_LEN = 16384, 4096  # one trajectory's trie per row; sampled tokens per sequence
MICRO_BATCHES = 4  # accumulation steps at ROW_LEN (the scan: memory does not grow with them)
SHORT_ROW = 8192  # the "-8k" plans: half the row, twice the micro-batches (same tokens per step)
LORA_RANK, LORA_ALPHA, LORA_MODULES = 16, 32.0, "attention,mlp"
HOSTS = {"v5p": "v5p:2x2x1", "v6e": "v6e:2x4"}  # one host each: 4 and 8 chips
MODELS = {"qwen7b": "qwen2.5-coder-7b", "qwen32b": "qwen2.5-coder-32b"}
MODES = {"full": None, "lora": None, "qlora-int8": "int8", "qlora-int4": "int4"}


class Plan(NamedTuple):
  """One compiled plan: model, host, fine-tuning mode."""
  preset: str  # models/presets.py name
  topology: str  # libtpu topology of one host
  mode: str  # a key of MODES
  row_len: int = ROW_LEN  # tokens per row (one row per chip per micro-batch)


# 7B first, then 32B (the compiles of the larger model take longer)
PLANS = {f"{m}-{HOSTS[h].replace(':', '-')}-{mode}": Plan(MODELS[m], HOSTS[h], mode)
         for m in MODELS for h in HOSTS for mode in MODES}
# what does not fit at ROW_LEN on v6e's 32 GB, with 8,192-token rows
PLANS.update({f"{name}-8k": plan._replace(row_len=SHORT_ROW) for name, plan in PLANS.items()
              if plan.topology == HOSTS["v6e"] and (plan.preset, plan.mode) in (
                  (MODELS["qwen7b"], "full"), (MODELS["qwen32b"], "lora"),
                  (MODELS["qwen32b"], "qlora-int8"), (MODELS["qwen32b"], "qlora-int4"))})


def plan_config(name: str):
  """The RL config of plan `name` (no files needed: model.init stays random).

  Args:
    name: a key of PLANS.

  Returns:
    The config: FSDP over the host's chips, one row of the plan's row_len tokens per chip per
    micro-batch, MICRO_BATCHES x ROW_LEN / row_len micro-batches (the same tokens per step),
    bf16 compute, full remat; LoRA fields per mode.
  """
  plan = PLANS[name]
  chips = len(aot.topology_devices(plan.topology)[1])
  c = rl_config.get_config("qwen2.5-coder")
  c.model.preset, c.model.init = plan.preset, "random"
  c.model.overrides.dtype = "bfloat16"
  c.model.overrides.remat = "full"
  c.model.overrides.attention_impl = "pallas_tpu"
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor, c.mesh.expert = 1, chips, 1, 1
  c.data.row_len, c.data.seq_len = plan.row_len, SEQ_LEN
  c.rl.max_context_tokens = max(c.rl.max_context_tokens, plan.row_len)
  c.data.rows_per_batch = c.data.max_seqs = chips  # one row per chip
  c.data.microbatches = MICRO_BATCHES * ROW_LEN // plan.row_len
  if plan.mode != "full":
    c.model.lora.rank, c.model.lora.alpha = LORA_RANK, LORA_ALPHA
    c.model.lora.modules = LORA_MODULES
    c.model.lora.base_qtype = MODES[plan.mode]
  return c


def state_bytes(config, topology: str) -> dict:
  """Per-chip GB of the TrainState's parts on the plan's mesh (its real shardings).

  Args:
    config: the plan's config.
    topology: the host's topology.

  Returns:
    {"trained": params (fp32: all weights, or the adapters), "frozen": model_state (the LoRA
    base, quantized for QLoRA), "optimizer": opt_state, "total"}, GB per chip.
  """
  _, devices = aot.topology_devices(topology)
  shape = config_lib.mesh_shape(config, len(devices))
  mesh = sharding.make_mesh(sharding.MeshConfig(**dict(zip(sharding.MESH_AXES, shape))), devices)
  model_cfg = config_lib.model_config(config)
  state = state_lib.abstract(model_cfg, optim.build(config.optimizer, model_cfg), mesh)
  parts = {"trained": aot.per_chip_bytes(state.params),
           "frozen": aot.per_chip_bytes(state.model_state),
           "optimizer": aot.per_chip_bytes(state.opt_state)}
  parts["total"] = sum(parts.values())
  return {k: round(v / GB, 3) for k, v in parts.items()}


def run(name: str) -> dict:
  """Compiles plan `name`'s train step; the aot report with the plan, its state bytes per
  chip and the compile date. A plan whose state alone exceeds the chip's HBM is not compiled
  ("skipped" says so); a compile that fails leaves "error" and its traceback."""
  t0 = time.perf_counter()
  plan = PLANS[name]
  config = plan_config(name)
  report: dict = {"plan": name, "preset": plan.preset, "mode": plan.mode,
                  "lora": ({"rank": LORA_RANK, "alpha": LORA_ALPHA, "modules": LORA_MODULES,
                            "base_qtype": MODES[plan.mode]} if plan.mode != "full" else None),
                  "optimizer": config.optimizer.name,
                  "compiled": {"date": common.today(), "machine": common.machine()}}
  try:
    report["state_gb"] = state_bytes(config, plan.topology)
    capacity = _capacity(plan.topology)
    if report["state_gb"]["total"] > capacity:
      # the resident state alone overflows the chip: the compiler could only refuse it
      report.update(topology=plan.topology, chips=len(aot.topology_devices(plan.topology)[1]),
                    skipped=f"state {report['state_gb']['total']:.1f} GB per chip > "
                            f"{capacity:.0f} GB HBM: not compiled")
    else:
      report.update(aot.compile_run(config, plan.topology, ("train",)))
  except Exception as e:  # a failing mode is a result: the table says which and why
    report["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:500]}"
    report["traceback"] = traceback.format_exc()[-4000:]
    report["topology"] = plan.topology
  report["wall_s"] = round(time.perf_counter() - t0, 1)
  return report


def _capacity(topology: str) -> float:
  """HBM GB per chip of the topology's generation."""
  return CHIPS[topology.partition(":")[0]].hbm_bytes / GB


def _program(report: dict, name: str) -> Optional[dict]:
  return report.get("programs", {}).get(name)


def markdown(reports: list[dict]) -> str:
  """The docs table: per plan and chip, state bytes, compiled HBM, fit and roofline step."""
  when = reports[0]["compiled"] if reports else {}
  lines = [
      f"Compiled {when.get('date', common.today())} on {when.get('machine', common.machine())} "
      "with libtpu (no TPU); `python -m benchmarks.aot_lora --out_dir=docs/aot --update_docs`. "
      f"RL train step, AdamW (fp32 moments), bf16 compute, full remat, FSDP over the host, "
      f"{MICRO_BATCHES} micro-batches of one {ROW_LEN:,}-token row per chip ("
      f"-8k plans: {MICRO_BATCHES * ROW_LEN // SHORT_ROW} of {SHORT_ROW:,}); LoRA rank "
      f"{LORA_RANK} (alpha {LORA_ALPHA:g}) on attention and MLP. GB per chip: **trained** = "
      "the fp32 parameters the optimizer updates (all weights, or the adapters), **frozen** = "
      "the LoRA base (fp32 for LoRA, qwix int8 / int4 for QLoRA), **optimizer** = the AdamW "
      "moments (from the state's shardings); **gradients args / temps** = the compiled "
      "accumulation program's arguments (state it reads and the batch) and temporaries; "
      "**peak** = the larger of the accumulation (plus the resident optimizer state) and the "
      "update program, against the chip's HBM; **step s** = compiled roofline of the "
      "accumulation plus the update (compute-bound terms use 8 N T model FLOPs under full "
      "remat, which LoRA's skipped weight gradients would lower).", "",
      "| plan | slice (chips) | mode | trained | frozen | optimizer | gradients args | "
      "gradients temps | peak GB / chip | fits? | step s (roofline) | compile s |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in reports:
    st = r.get("state_gb", {})
    fmt = lambda k: f"{st[k]:.2f}" if k in st else "-"
    chips = r.get("chips", "-")
    if "error" in r:
      lines.append(f"| {r['plan']} | {r['topology']} ({chips}) | {r['mode']} | {fmt('trained')} "
                   f"| {fmt('frozen')} | {fmt('optimizer')} | - | - | - | failed: "
                   f"{r['error'][:120]} | - | - |")
      continue
    if "skipped" in r:
      lines.append(f"| {r['plan']} | {r['topology']} ({chips}) | {r['mode']} | {fmt('trained')} "
                   f"| {fmt('frozen')} | {fmt('optimizer')} | - | - | > {st['total']:.1f} "
                   "(state alone) | no | - | - |")
      continue
    g, u = _program(r, "train/gradients"), _program(r, "train/update")
    peak = r.get("train_peak_gb", {})
    refused = g is None or u is None or "error" in g or "error" in u
    args = "-" if g is None or "error" in g else f"{g['hbm_gb']['arguments']:.2f}"
    temps = "-" if g is None else (f"> {g['hbm_gb']['temporaries']:.1f} (refused)" if "error" in g
                                   else f"{g['hbm_gb']['temporaries']:.2f}")
    total = (f"> {peak['total']:.1f} (refused)" if refused else f"{peak['total']:.2f}"
             ) if peak else "-"
    fits = "no" if refused or not peak.get("fits") else "yes"
    step = "-" if refused else f"{aot_plans._step_s(r):.1f}"
    compile_s = sum(p.get("compile_s", 0.0) for p in r["programs"].values())
    lines.append(f"| {r['plan']} | {r['topology']} ({chips}) | {r['mode']} | {fmt('trained')} | "
                 f"{fmt('frozen')} | {fmt('optimizer')} | {args} | {temps} | {total} / "
                 f"{_capacity(r['topology']):.0f} | {fits} | "
                 f"{step} | {compile_s:.0f} |")
  return "\n".join(lines)


def _peak(r: Optional[dict]) -> Optional[float]:
  """The plan's compiled train peak GB per chip (None: not compiled or refused)."""
  if r is None or "error" in r or not r.get("train_peak_gb"):
    return None
  if any("error" in p for p in r["programs"].values()):
    return None
  return r["train_peak_gb"]["total"]


def reading(reports: list[dict]) -> str:
  """Bullets that read the table: per model, host and row length, what each mode needs and
  whether it fits; what the temporaries and the all-gathers show."""
  groups: dict = {}  # (preset, topology, row_len) -> {mode: report}, in PLANS order
  for name, plan in PLANS.items():
    groups.setdefault((plan.preset, plan.topology, plan.row_len), {})[plan.mode] = next(
        (r for r in reports if r["plan"] == name), None)
  lines = ["Reading (per chip):", ""]
  for (preset, topology, row_len), rs in groups.items():
    if not any(rs.values()):
      continue
    parts = []
    for mode, r in rs.items():
      if r is None:
        parts.append(f"{mode} not compiled")
      elif "skipped" in r:
        parts.append(f"{mode} does not fit: its state alone is {r['state_gb']['total']:.1f} "
                     "GB (not compiled)")
      elif "error" in r:
        parts.append(f"{mode} failed to compile ({r['error'][:80]})")
      elif _peak(r) is None:
        parts.append(f"{mode} refused by the compiler (needs > "
                     f"{r['train_peak_gb']['total']:.1f} GB)")
      else:
        st, fits = r["state_gb"], r["train_peak_gb"]["fits"]
        parts.append(f"{mode} {_peak(r):.1f} GB ({'fits' if fits else 'does not fit'}; "
                     f"state {st['total']:.1f} GB: "
                     + (f"base {st['frozen']:.1f}, " if st["frozen"] else "")
                     + f"optimizer {st['optimizer']:.2f})")
    where = f"{topology} ({_capacity(topology):.0f} GB per chip), {row_len:,}-token rows"
    lines.append(f"- **{preset} on {where}**: " + "; ".join(parts) + ".")
  temps: dict = {}  # (preset, row_len) -> {"full" | "adapters": [GB]}
  for r in reports:
    if _peak(r) is not None:
      plan = PLANS[r["plan"]]
      temps.setdefault((plan.preset, plan.row_len), {}).setdefault(
          "full" if plan.mode == "full" else "adapters", []).append(
              r["programs"]["train/gradients"]["hbm_gb"]["temporaries"])
  span = lambda xs: f"{min(xs):.1f}" if min(xs) == max(xs) else f"{min(xs):.1f}-{max(xs):.1f}"
  if temps:
    lines.append("- The accumulation's temporaries (GB per chip): " + "; ".join(
        f"{preset}, {row_len:,}-token rows: " + ", ".join(
            f"{kind} {span(xs)}" for kind, xs in sorted(t.items(), reverse=True))
        for (preset, row_len), t in temps.items()) + ". Adapters drop the gradient buffers of "
        "the base weights, not the activations full remat saves for the rows nor one layer's "
        "working set (gathered weights, attention and MLP intermediates): once the state is "
        "small these bound the row length.")
  by = {r["plan"]: r for r in reports if _peak(r) is not None}
  casts = []  # (LoRA plan, its temporaries over QLoRA int8's, the base's bf16 bytes per chip)
  for name, r in by.items():
    q = by.get(name.replace("-lora", "-qlora-int8"))
    if PLANS[name].mode == "lora" and q is not None:
      temp = lambda x: x["programs"]["train/gradients"]["hbm_gb"]["temporaries"]
      casts.append((name, temp(r) - temp(q), r["state_gb"]["frozen"] / 2))
  if casts:
    lines.append("- LoRA's temporaries exceed QLoRA int8's by about the bf16 size of its base "
                 "shard (" + "; ".join(f"{n}: {d:.1f} GB more, base in bf16 {b:.1f} GB"
                                       for n, d, b in casts) + "): consistent with the fp32 "
                 "base cast to the compute dtype once per step, beside its fp32 copy.")
  gather = {r["plan"]: r["programs"]["train/gradients"]["collectives"].get(
      "all-gather", {}).get("bytes", 0) / GB for r in reports if _peak(r) is not None}
  pairs = []  # (QLoRA plan, its all-gather GB, LoRA's)
  for name, gb in gather.items():
    for mode in ("qlora-int8", "qlora-int4"):
      lora_name = name.replace(f"-{mode}", "-lora")
      if name.endswith(mode) and lora_name in gather:
        pairs.append((name, gb, gather[lora_name]))
  if pairs:
    equal = all(abs(q - l) <= 0.05 * l for _, q, l in pairs)
    lines.append("- FSDP all-gathers of the accumulation, QLoRA vs LoRA (GB per chip per step): "
                 + "; ".join(f"{n} {q:.0f} vs {l:.0f}" for n, q, l in pairs) + (
                     ". The same bytes: the quantized base is not what travels (the shards "
                     "are gathered at the compute width), so QLoRA saves HBM, not ICI traffic."
                     if equal else ": QLoRA gathers fewer bytes (the base travels quantized)."))
  lines.append("- Without quantization LoRA keeps the frozen base in the parameter dtype "
               "(fp32: 4 bytes per weight), which is most of its state; int8 stores 1 byte per "
               "projection weight (plus scales; the embeddings, lm_head and norms stay fp32) "
               "and int4 half a byte.")
  return "\n".join(lines)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated, of {list(PLANS)}")
  p.add_argument("--out_dir", default="", help="also write <plan>.json here")
  p.add_argument("--update_docs", action="store_true",
                 help="rewrite docs/scaling.md's aot-lora block from the JSONs in --out_dir")
  p.add_argument("--docs_only", action="store_true",
                 help="compile nothing: rewrite the block from the JSONs in --out_dir")
  args = p.parse_args()
  names = args.plans.split(",")
  for name in names:
    if name not in PLANS:
      p.error(f"--plans: {name!r} is not one of {list(PLANS)}")
  done = {}
  for name in [] if args.docs_only else names:
    report = run(name)
    print(json.dumps({k: v for k, v in report.items() if k != "traceback"}), flush=True)
    if "traceback" in report:
      print(report["traceback"], flush=True)
    if args.out_dir:
      os.makedirs(args.out_dir, exist_ok=True)
      with open(os.path.join(args.out_dir, f"{name}.json"), "w") as f:
        json.dump(report, f, indent=1)
    done[name] = report
  if args.update_docs:
    for name in PLANS if args.out_dir else ():
      path = os.path.join(args.out_dir, f"{name}.json")
      if name not in done and os.path.isfile(path):
        with open(path) as f:
          done[name] = json.load(f)
    reports = [done[n] for n in PLANS if n in done]
    block = markdown(reports) + "\n\n" + reading(reports)
    aot_plans.write_docs(block, "aot-lora")


if __name__ == "__main__":
  main()
