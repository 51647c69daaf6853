"""Shared benchmark plumbing: machine description, timing, and docs/benchmarks.md sections."""

from __future__ import annotations

import datetime
import os
import platform
import re
import statistics
import time

import jax

from models.config import ModelConfig

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                    "benchmarks.md")
PREAMBLE = """# Benchmarks

Scripts in `benchmarks/` measure throughput on the current JAX backend, print JSON and rewrite
their own section of this file (between `<!-- name:start -->` / `<!-- name:end -->` markers).
Each reports the median of several timed repeats after a separate compile, and every speed-up
is a ratio against a baseline run in the same process on the same machine. Numbers depend on
the machine and its load; they are never asserted in tests.
"""


# The ~10M-parameter MoE + MLA model of the benchmarks.
MOE_MLA = ModelConfig(
    vocab_size=8192, hidden_size=256, num_layers=4, num_heads=8, intermediate_size=768,
    attention="mla", q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=32, num_experts=16, num_shared_experts=1,
    experts_per_token=2, n_group=4, topk_group=2, score_func="sigmoid", routed_scaling_factor=2.5,
    first_k_dense_replace=1, moe_intermediate_size=128, router_bias=True, seq_balance_coef=1e-4)


def today() -> str:
  return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def machine() -> str:
  cpu = "unknown cpu"
  if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo") as f:
      cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
  dev = jax.devices()[0]
  return (f"{platform.node()}, {cpu}, {os.cpu_count()} cores, "
          f"{jax.default_backend()} {dev.device_kind}")


def median_time(fn, repeats: int) -> float:
  """Median wall time of `repeats` calls of fn() (its outputs are waited for)."""
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def write_section(name: str, markdown: str) -> None:
  """Replace (or append) the `name` section of docs/benchmarks.md."""
  start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
  section = f"{start}\n{markdown.strip()}\n{end}"
  text = open(DOCS).read() if os.path.exists(DOCS) else PREAMBLE
  if start in text and end in text:
    text = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: section, text, flags=re.S)
  else:
    text = text.rstrip("\n") + "\n\n" + section + "\n"
  with open(DOCS, "w") as f:
    f.write(text)
