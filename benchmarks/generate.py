"""Generation throughput of the engine (models/engine/) against transformers and google/tunix,
and prefill sharing. (The sampler/trainer log-prob mismatch is benchmarks/mismatch.py's.)

    python -m benchmarks.generate [--repeats=5 --update_docs --out=x.json]

Workload: 16 prompts × 192 random tokens → 64 new tokens each, greedy, no EOS, on a
Qwen3-like config (vocab 2048, hidden 256, 4 layers, 4 heads, 2 KV heads, head_dim 64, MLP 1024,
fp32, random weights). Each system decodes all 1,024 tokens; tokens/s = 1,024 / wall time of
one whole call (prefill included), after a warm-up call that compiles:
- arbor: `Engine.generate` (16 slots, log-probs computed on device for every token);
- transformers: `model.generate` (PyTorch CPU, 2 threads, sdpa attention) in a worker process;
- tunix: `tunix.generate.sampler.Sampler` (google-tunix 0.1.7, log-probs on) in a worker process
  running in its own virtualenv (benchmarks/setup_tunix.sh makes it: tunix pins jax/flax).
The three run interleaved, round after round, so machine load hits them alike; medians are
reported. Prints one JSON line and rewrites the `generate` section of docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

from benchmarks.common import machine, today, write_section
from envs.policy import SamplingParams
from models import transformer
from models.config import ModelConfig
from models.engine import Engine, EngineConfig

flags.DEFINE_integer("repeats", 5, "interleaved rounds (medians are reported)")
flags.DEFINE_bool("update_docs", False,
                  "also rewrite the generate section of docs/benchmarks.md")
flags.DEFINE_string("out", None, "also write the JSON result to this path")
flags.DEFINE_string("worker", None, "internal: run as the 'transformers' worker process")
FLAGS = flags.FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUNIX_VENV = os.environ.get("TUNIX_VENV", os.path.join(ROOT, "build", "tunix-venv"))
BATCH, PROMPT, NEW, VOCAB = 16, 192, 64, 2048
G = 8  # samples per prompt in the prefill-sharing measurement


def prompts(seed: int) -> np.ndarray:
  """The benchmark's prompts [16, 192] (ids 1..2047; the tunix worker draws the same)."""
  return np.random.default_rng(seed).integers(1, VOCAB, (BATCH, PROMPT))


def qwen3_like():
  return ModelConfig(vocab_size=VOCAB, hidden_size=256, num_layers=4, num_heads=4,
                     num_kv_heads=2, head_dim=64, intermediate_size=1024, qk_norm=True,
                     rope_theta=1e6, max_position_embeddings=512)


# ----------------------------------------------------------------------------- workers


def transformers_worker() -> None:
  """Worker protocol of benchmarks/generate_tunix.py, for transformers' generate."""
  import torch
  from transformers import AutoModelForCausalLM, Qwen3Config
  torch.set_num_threads(2)
  torch.manual_seed(0)
  config = Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=1024,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, rope_theta=1e6, max_position_embeddings=512,
                       tie_word_embeddings=False, eos_token_id=None, bos_token_id=None)
  model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()

  def run(seed):
    x = torch.from_numpy(prompts(seed)).long()
    t = time.perf_counter()
    with torch.no_grad():
      out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW,
                           min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return (out.shape[1] - PROMPT) * BATCH, time.perf_counter() - t

  t0 = time.perf_counter()
  run(0)
  print(json.dumps({"ready": True, "compile_s": round(time.perf_counter() - t0, 2)}), flush=True)
  for line in sys.stdin:
    cmd = line.split()
    if not cmd or cmd[0] == "quit":
      break
    n, dt = run(int(cmd[1]))
    print(json.dumps({"tokens": n, "seconds": dt}), flush=True)


class Worker:
  """A benchmark worker process: `run(seed)` -> {"tokens", "seconds"}."""

  def __init__(self, name: str, cmd: list[str]):
    self.name = name
    self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, env={**os.environ, "PYTHONPATH": ROOT})
    self.ready = self._reply()

  def _reply(self) -> dict:
    while True:
      line = self.proc.stdout.readline()
      if not line:
        raise RuntimeError(f"{self.name} worker exited with {self.proc.wait()}")
      if line.startswith("{"):
        return json.loads(line)

  def run(self, seed: int) -> dict:
    self.proc.stdin.write(f"run {seed}\n")
    self.proc.stdin.flush()
    return self._reply()

  def close(self) -> None:
    try:
      self.proc.stdin.write("quit\n")
      self.proc.stdin.close()
    except (BrokenPipeError, OSError):
      pass
    self.proc.wait(60)


def setup_tunix() -> None:
  subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "setup_tunix.sh")], check=True,
                 env={**os.environ, "TUNIX_VENV": TUNIX_VENV})


# ----------------------------------------------------------------------------- arbor


class ArborRunner:
  def __init__(self):
    self.model = transformer.init(qwen3_like(), seed=0)
    self.engine = Engine(self.model, EngineConfig(
        slots=BATCH, max_seq_len=PROMPT + NEW, prefix_cache_rows=0, prefill_chunk=PROMPT,
        prefill_bucket=64, steps_per_call=NEW))
    t0 = time.perf_counter()
    self.run(0)
    self.ready = {"ready": True, "compile_s": round(time.perf_counter() - t0, 2)}

  def run(self, seed: int, max_tokens: int = NEW, inputs=None) -> dict:
    inputs = prompts(seed).tolist() if inputs is None else inputs
    t = time.perf_counter()
    outs = self.engine.generate(inputs, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return {"tokens": sum(len(o.output_ids) for o in outs), "seconds": time.perf_counter() - t}

  def prefill_sharing(self, repeats: int) -> dict:
    """Time to the first token of 16 requests: 16 distinct prompts vs 16 / G prompts × G
    samples (each shared prompt is prefilled once and its cache row copied)."""
    unshared, shared, tokens = [], [], {}
    for r in range(repeats):
      distinct = prompts(1000 + r).tolist()
      grouped = [p for p in distinct[:BATCH // G] for _ in range(G)]
      for name, inputs, times in (("unshared", distinct, unshared), ("shared", grouped, shared)):
        before = self.engine.counters.get("prefill_tokens", 0)
        times.append(self.run(0, max_tokens=1, inputs=inputs)["seconds"])
        tokens[name] = self.engine.counters["prefill_tokens"] - before
    return {"unshared_s": statistics.median(unshared), "shared_s": statistics.median(shared),
            "ratio": statistics.median(shared) / statistics.median(unshared),
            "prefill_tokens_unshared": tokens["unshared"],
            "prefill_tokens_shared": tokens["shared"]}


# ----------------------------------------------------------------------------- main


def markdown(result: dict, machine_name: str) -> str:
  r = result
  runs = lambda k: ", ".join(f"{x:,.0f}" for x in r["runs"][k])
  lines = [
      "## generate: engine throughput, prefill sharing", "",
      f"{r['date']}, {machine_name}. 16 prompts × 192 random tokens → 64 new tokens each "
      "(greedy, no EOS), Qwen3-like config (vocab 2048, hidden 256, 4 layers, 4 heads, 2 KV "
      "heads, head_dim 64, MLP 1024, fp32, random weights); tokens/s = 1,024 / wall time of a "
      "whole call, prefill included, after a compiling warm-up. The three systems run "
      f"interleaved for {r['repeats']} rounds; medians. 1-minute load average "
      f"{r['load_avg_1min'][0]} before, {r['load_avg_1min'][1]} after, on 2 cores"
      + (": the machine was shared, absolute numbers are depressed and PyTorch's OpenMP "
         "threads suffer most from oversubscription, so the ratio to transformers is "
         "inflated; the ratio to tunix (XLA too) is the fairer one."
         if max(r["load_avg_1min"]) > 1.5 else " (quiet)."), "",
      "| system | new tokens/s (median) | runs | compile + first call (s) |",
      "|---|---|---|---|",
      f"| arbor `Engine.generate` (16 slots, log-probs on) | {r['arbor_tokens_per_s']:,.0f} | "
      f"{runs('arbor')} | {r['compile_s']['arbor']} |",
      f"| transformers {r['versions']['transformers']} `generate` (torch CPU, 2 threads, sdpa) "
      f"| {r['transformers_tokens_per_s']:,.0f} | {runs('transformers')} | "
      f"{r['compile_s']['transformers']} |",
      f"| tunix 0.1.7 `Sampler` (log-probs on) | {r['tunix_tokens_per_s']:,.0f} | "
      f"{runs('tunix')} | {r['compile_s']['tunix']} |", "",
      f"Speed-up: **{r['speedup_vs_transformers']:.2f}× transformers** (goal ≥ 2), "
      f"**{r['speedup_vs_tunix']:.2f}× tunix** (goal ≥ 1.5).", ""]
  p = r["prefill_sharing"]
  lines += [
      f"**Prefill sharing** (time to the first token of 16 requests, median of "
      f"{r['repeats']}): 16 distinct prompts {p['unshared_s']:.3f} s "
      f"({p['prefill_tokens_unshared']:,} tokens prefilled) vs 2 prompts × G = {G} samples "
      f"{p['shared_s']:.3f} s ({p['prefill_tokens_shared']:,} tokens prefilled, the rest "
      f"copied): ratio {p['ratio']:.3f} (goal ≈ 1/{G} = {1 / G:.3f}; both include the "
      "first decode step, the shared one also the row copies).", ""]
  lines += ["The sampler/trainer log-prob mismatch is measured by benchmarks/mismatch.py "
            "(section `mismatch` below).", ""]
  lines += ["```", "bash benchmarks/setup_tunix.sh   # once: the tunix virtualenv",
            f"python -m benchmarks.generate --update_docs --repeats={r['repeats']}", "```"]
  return "\n".join(lines)


def main(argv) -> None:
  del argv
  if FLAGS.worker == "transformers":
    transformers_worker()
    return
  setup_tunix()
  workers = {"transformers": Worker("transformers", [sys.executable, "-m", "benchmarks.generate",
                                                     "--worker=transformers"]),
             "tunix": Worker("tunix", [os.path.join(TUNIX_VENV, "bin", "python"),
                                       os.path.join(ROOT, "benchmarks", "generate_tunix.py")])}
  load_before = os.getloadavg()[0]
  arbor = ArborRunner()
  runs = {"arbor": [], "transformers": [], "tunix": []}
  try:
    for r in range(FLAGS.repeats):
      seed = r + 1
      runs["arbor"].append(arbor.run(seed))
      for name, w in workers.items():
        runs[name].append(w.run(seed))
      print(json.dumps({k: round(v[-1]["tokens"] / v[-1]["seconds"]) for k, v in runs.items()}),
            file=sys.stderr, flush=True)
    compile_s = {"arbor": arbor.ready["compile_s"],
                 **{k: w.ready["compile_s"] for k, w in workers.items()}}
  finally:
    for w in workers.values():
      w.close()
  assert all(x["tokens"] == BATCH * NEW for v in runs.values() for x in v), runs
  tps = {k: [x["tokens"] / x["seconds"] for x in v] for k, v in runs.items()}
  med = {k: statistics.median(v) for k, v in tps.items()}
  import transformers
  result = {
      "arbor_tokens_per_s": round(med["arbor"], 1),
      "transformers_tokens_per_s": round(med["transformers"], 1),
      "tunix_tokens_per_s": round(med["tunix"], 1),
      "speedup_vs_transformers": round(med["arbor"] / med["transformers"], 3),
      "speedup_vs_tunix": round(med["arbor"] / med["tunix"], 3),
      "runs": {k: [round(x, 1) for x in v] for k, v in tps.items()},
      "compile_s": compile_s, "repeats": FLAGS.repeats, "date": today(),
      "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
      "versions": {"transformers": transformers.__version__},
      "prefill_sharing": arbor.prefill_sharing(FLAGS.repeats),
  }
  print(json.dumps(result))
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(result, f, indent=2)
  if FLAGS.update_docs:
    write_section("generate", markdown(result, machine()))


if __name__ == "__main__":
  app.run(main)
