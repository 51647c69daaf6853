"""Shared benchmark plumbing: machine description, timing, and docs/benchmarks.md sections."""

from __future__ import annotations

import datetime
import os
import platform
import re
import statistics
import time

import jax

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                    "benchmarks.md")
PREAMBLE = """# Benchmarks

Scripts in `benchmarks/` measure throughput on the current JAX backend, print JSON and rewrite
their own section of this file (between `<!-- name:start -->` / `<!-- name:end -->` markers).
Each reports the median of several timed repeats after a separate compile, and every speed-up
is a ratio against a baseline run in the same process on the same machine. Numbers depend on
the machine and its load; they are never asserted in tests.
"""


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
