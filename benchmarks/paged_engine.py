"""The engine's contiguous KV cache against its paged cache at equal cache memory.

    python -m benchmarks.paged_engine [--repeats=3 --out=x.json]

Workload: 8 prompts of mixed lengths (32..320 tokens), each sampled G = 4 times (a group, as
RL rollouts sample), 8..160 new tokens per request (temperature 1, seeded), max_seq_len 512,
on a small dense GQA model (vocab 512, hidden 128, 2 layers, 4 heads, 2 KV heads, fp32,
random weights). Both engines get cache memory for 4096 positions:
- contiguous: 4 slots + 4 prefix-cache rows of 512 positions (a row per sequence at the
  maximum context);
- paged: 256 pages of 16 positions, 16 slots (admission by free pages; group members share
  their prompt's pages; preemption by recompute when pages run out);
- paged_4_slots: the same pages with the contiguous engine's 4 slots (the cost of paging
  itself at an equal decode batch).
Reported per engine: sequences in flight (most decoding at once), tokens/s (new tokens / wall
time of one whole `generate`, after a warm-up call that compiles), decode calls, prefilled
tokens, and for the paged engine its page counters. Both engines must produce the same
tokens (checked). Prints one JSON line.
"""

from __future__ import annotations

import json
import time

import numpy as np
from absl import app, flags

from benchmarks.common import machine, today
from envs.policy import SamplingParams
from models import transformer
from models.config import ModelConfig
from models.engine import Engine, EngineConfig

flags.DEFINE_integer("repeats", 3, "timed runs per engine (the median is reported)")
flags.DEFINE_string("out", None, "also write the JSON result to this path")
FLAGS = flags.FLAGS

MAX_LEN, PAGE, MEMORY, G = 512, 16, 4096, 4
VOCAB = 512


def model_config() -> ModelConfig:
  return ModelConfig(vocab_size=VOCAB, hidden_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=32, intermediate_size=256,
                     max_position_embeddings=MAX_LEN)


def workload(seed: int = 0):
  """(prompts, sampling params): 8 prompt groups of G, mixed prompt and output lengths."""
  rng = np.random.default_rng(seed)
  lengths = [32, 320, 96, 200, 48, 256, 128, 64]
  prompts, params = [], []
  for i, n in enumerate(lengths):
    prompt = rng.integers(1, VOCAB, n).tolist()
    for g in range(G):
      prompts.append(prompt)
      params.append(SamplingParams(max_tokens=int(rng.integers(8, 161)), temperature=1.0,
                                   seed=i * G + g))
  return prompts, params


def engines(model):
  common = dict(max_seq_len=MAX_LEN, prefix_cache_rows=4, min_prefix=8, prefill_chunk=256,
                prefill_bucket=64, steps_per_call=16)
  rows = MEMORY // MAX_LEN
  return {
      "contiguous": EngineConfig(slots=rows - 4, **common),
      "paged": EngineConfig(slots=16, cache="paged", page_size=PAGE, num_pages=MEMORY // PAGE,
                            **common),
      # the contiguous engine's decode batch: what paging itself costs per token
      "paged_4_slots": EngineConfig(slots=rows - 4, cache="paged", page_size=PAGE,
                                    num_pages=MEMORY // PAGE, **common),
  }


def run(model, cfg: EngineConfig, prompts, params, repeats: int) -> tuple[dict, list]:
  Engine(model, cfg).generate(prompts, params)  # compile every shape the run takes
  times, outs, counters = [], None, None
  for _ in range(repeats):
    eng = Engine(model, cfg)  # a fresh, empty cache each run
    start = time.perf_counter()
    outs = eng.generate(prompts, params)
    times.append(time.perf_counter() - start)
    counters = eng.counters
  tokens = sum(len(o.output_ids) for o in outs)
  keep = ["decode_calls", "prefill_tokens", "cache_hits"]
  if cfg.cache == "paged":
    keep += ["pages_peak", "pages_allocated", "pages_shared", "page_copies", "preempted"]
  result = {"seconds": round(float(np.median(times)), 3),
            "tokens_per_s": round(tokens / float(np.median(times)), 1),
            "new_tokens": tokens, "sequences_in_flight": counters.get("running_peak", 0),
            **{k: counters.get(k, 0) for k in keep}}
  return result, outs


def main(_):
  model = transformer.init(model_config(), seed=0)
  prompts, params = workload()
  results, outputs = {}, {}
  for name, cfg in engines(model).items():
    results[name], outputs[name] = run(model, cfg, prompts, params, FLAGS.repeats)
  same = all(a.output_ids == b.output_ids == c.output_ids for a, b, c in zip(
      outputs["contiguous"], outputs["paged"], outputs["paged_4_slots"]))
  report = {"benchmark": "paged_engine", "date": today(), "machine": machine(),
            "cache_positions": MEMORY, "requests": len(prompts), "same_tokens": same,
            **results,
            "speedup": round(results["paged"]["tokens_per_s"]
                             / results["contiguous"]["tokens_per_s"], 2)}
  line = json.dumps(report)
  print(line)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      f.write(line + "\n")


if __name__ == "__main__":
  app.run(main)
