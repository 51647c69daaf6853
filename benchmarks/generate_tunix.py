"""Benchmark worker: google/tunix's native sampler on the generate benchmark's config.

Runs in the separate venv made by benchmarks/setup_tunix.sh (tunix pins its own jax/flax), so it
imports nothing from Arbor. Protocol (one JSON object per line on stdout):
  start -> {"ready": true, "compile_s": ...}
  stdin "run SEED" -> {"tokens": N, "seconds": S}   (greedy, 16 prompts of 192 -> 64 new tokens)
  stdin "quit" or EOF -> exit
"""

import json
import sys
import time

import numpy as np
from flax import nnx
from tunix.generate import sampler as sampler_lib
from tunix.models.qwen3 import model as qwen3

BATCH, PROMPT, NEW, VOCAB = 16, 192, 64, 2048
NEVER = VOCAB + 1  # an "EOS" id the model cannot emit, so every row decodes NEW tokens


class IdTokenizer:
  """Text is space-separated token ids: tunix's sampler takes strings, the benchmark ids."""

  def encode(self, text, **kw):
    return [int(t) for t in text.split()]

  def decode(self, ids, **kw):
    return " ".join(map(str, ids))

  def bos_id(self):
    return 0  # falsy: tunix then prepends no BOS

  def eos_id(self):
    return NEVER

  def pad_id(self):
    return 0  # prompts use ids 1..VOCAB-1, so no prompt token is mistaken for padding


def prompts(seed: int) -> list[str]:
  ids = np.random.default_rng(seed).integers(1, VOCAB, (BATCH, PROMPT))
  return [" ".join(map(str, row)) for row in ids]


def main() -> None:
  cfg = qwen3.ModelConfig(num_layers=4, vocab_size=VOCAB, embed_dim=256, hidden_dim=1024,
                          num_heads=4, head_dim=64, num_kv_heads=2, rope_theta=1_000_000,
                          norm_eps=1e-6, use_tied_embedding=False)
  model = qwen3.Qwen3(cfg, rngs=nnx.Rngs(0))
  sampler = sampler_lib.Sampler(model, IdTokenizer(), sampler_lib.CacheConfig(
      cache_size=PROMPT + NEW, num_layers=4, num_kv_heads=2, head_dim=64))

  def run(seed):
    t = time.perf_counter()
    # max_prompt_length=PROMPT: no padding to the next power of two; log-probs on, as in RL
    out = sampler(prompts(seed), max_generation_steps=NEW, max_prompt_length=PROMPT,
                  temperature=0.0, eos_tokens=[NEVER], return_logprobs=True)
    return sum(len(t) for t in out.tokens), time.perf_counter() - t

  t0 = time.perf_counter()
  run(0)
  print(json.dumps({"ready": True, "compile_s": round(time.perf_counter() - t0, 2)}), flush=True)
  for line in sys.stdin:
    cmd = line.split()
    if not cmd or cmd[0] == "quit":
      break
    n, dt = run(int(cmd[1]))
    print(json.dumps({"tokens": n, "seconds": dt}), flush=True)


if __name__ == "__main__":
  main()
