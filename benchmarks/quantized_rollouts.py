"""Quantized rollouts: engine throughput and sampler/trainer mismatch per engine weight type.

    python -m benchmarks.quantized_rollouts [--repeats=3] [--update_docs] [--out=x.json]

The engine (models/engine/) samples with the policy's own weights (fp32, or fp32 weights with
bf16 compute) or with a weight-only qwix-quantized copy (`EngineConfig.weight_qtype`: int8,
float8_e4m3fn), or fp8 weights and activations (`EngineConfig.act_qtype`); the trainer stays
fp32. Model: the demo's SFT checkpoint (`--ckpt`, an Arbor
run directory: tiny-moe-mla-x2, vocab 2048) when it exists, else random tiny-moe-mla-x2 weights
(vocab 2048, initializer_range 0.1). Prompts: the first `--prompts` conversations of the run's
eval split rendered with its chat format (system + user turn, tool schemas, generation
prompt), or random tokens without a checkpoint.

Per engine: tokens/s (new tokens / wall time of one whole `generate` of `--prompts` requests x
`--new` tokens at temperature 1, seeded, after a warm-up call that compiles; median of
`--repeats`), the bytes of the weights the engine holds, the seconds of one `update_params`
(with a weight_qtype: the jitted re-quantization of the fp32 weights; median of `--repeats`
after a warm-up), and against the fp32 trainer's teacher-forced full pass over the same tokens
(replaying the engine's experts, as RL's routing replay does): with d = log p_trainer -
log p_sampler per sampled token, KL k3 = mean(exp(d) - 1 - d), k1 = mean(-d), mean and max
|d|; the share of (token, MoE layer) pairs whose experts differ between engine and trainer
(routing flips), and k3 with the trainer's own routing. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from benchmarks.common import machine, today, write_section
from envs.policy import SamplingParams
from models import transformer
from models.engine import Engine, EngineConfig
from models.presets import PRESETS

flags.DEFINE_string("ckpt", "/tmp/arbor_sft_demo", "Arbor run directory of the model (random "
                    "tiny-moe-mla-x2 weights when it does not exist)")
flags.DEFINE_integer("prompts", 16, "requests (= engine slots)")
flags.DEFINE_integer("new", 64, "tokens sampled per request")
flags.DEFINE_integer("repeats", 3, "timed runs per engine (the median is reported)")
flags.DEFINE_bool("update_docs", False, "rewrite the quantized_rollouts section of "
                  "docs/benchmarks.md")
flags.DEFINE_string("out", None, "also write the JSON result to this path")
FLAGS = flags.FLAGS

# name -> (compute dtype, weight_qtype, act_qtype)
ENGINES = {
    "fp32": ("float32", None, None),
    "bf16 compute": ("bfloat16", None, None),
    "int8": ("float32", "int8", None),
    "fp8 (e4m3)": ("float32", "float8_e4m3fn", None),
    "fp8 (e4m3) weights + activations": ("float32", "float8_e4m3fn", "float8_e4m3fn"),
    "int8, bf16 compute": ("bfloat16", "int8", None),
}


def load(ckpt: str, n: int, seed: int = 0):
  """(fp32 model, prompts [[ids]], description of the weights and prompts)."""
  if os.path.isfile(os.path.join(ckpt, "config.json")):
    from trainer import rejection  # the run's own tokenizer, chat format and weights
    model, _, chat, _ = rejection.load_checkpoint(ckpt)
    prompts = []
    with open(os.path.join(ckpt, "data", "eval.jsonl")) as f:
      for line in f:
        record = json.loads(line)
        prompts.append(chat.render(record["messages"][:2], tools=record.get("tools")).ids)
        if len(prompts) == n:
          break
    return model, prompts, (f"the demo SFT checkpoint ({ckpt}), prompts: the first {n} "
                            "conversations of its eval split (system + user turn, tools)")
  cfg = PRESETS["tiny-moe-mla-x2"].replace(vocab_size=2048, initializer_range=0.1)
  model = transformer.init(cfg, seed)
  rng = np.random.default_rng(seed)
  return model, rng.integers(1, cfg.vocab_size, (n, 256)).tolist(), (
      "random tiny-moe-mla-x2 weights (vocab 2048, initializer_range 0.1), prompts: "
      f"{n} x 256 random tokens")


def with_dtype(model, dtype: str):
  """The same weights with another compute dtype."""
  cfg = model.cfg.replace(dtype=dtype)
  return nnx.merge(nnx.graphdef(transformer.abstract(cfg)), nnx.state(model))


def make_scorer(length: int):
  @nnx.jit
  def score(model, tokens, expert_ids):
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), tokens.shape)
    logits, aux = model(tokens, positions, jnp.full(tokens.shape, length, jnp.int32),
                        expert_ids=expert_ids)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    chosen = jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], -1)[..., 0]
    return chosen, aux.get("expert_ids", jnp.zeros((0,), jnp.int32))
  return score


def mismatch(model, prompts, outs) -> dict:
  """The fp32 trainer's log-probs of the engine's tokens against the engine's."""
  seqs = [p + o.output_ids for p, o in zip(prompts, outs)]
  length = -(-max(map(len, seqs)) // 64) * 64
  tokens = np.zeros((len(seqs), length), np.int32)
  for i, s in enumerate(seqs):
    tokens[i, :len(s)] = s
  score = make_scorer(length)
  own_logp, own = score(model, jnp.asarray(tokens), None)
  result = {}
  if model.cfg.is_moe:
    own = np.asarray(own)  # [moe_layers, rows, length, k]
    ids, flips, pairs = own.copy(), 0, 0
    for i, (s, o) in enumerate(zip(seqs, outs)):
      fed = len(s) - 1  # the engine reports positions 0 .. len - 2
      engine_ids = np.transpose(o.expert_ids, (1, 0, 2))  # [moe_layers, fed, k]
      ids[:, i, :fed] = engine_ids
      diff = np.any(np.sort(engine_ids, -1) != np.sort(own[:, i, :fed], -1), -1)
      flips, pairs = flips + int(diff.sum()), pairs + diff.size
    result["routing_flips"] = flips / pairs
    logp, _ = score(model, jnp.asarray(tokens), jnp.asarray(ids))
  else:
    logp = own_logp

  def stats(logp):
    logp = np.asarray(logp, np.float64)
    d = np.concatenate([logp[i, len(p) - 1:len(p) - 1 + len(o.output_ids)]
                        - np.asarray(o.logprobs, np.float64)
                        for i, (p, o) in enumerate(zip(prompts, outs))])
    return d, float(np.mean(np.expm1(d) - d))

  d, result["kl_k3"] = stats(logp)
  result.update(kl_k1=float(np.mean(-d)), mean_abs_logprob_diff=float(np.mean(np.abs(d))),
                max_abs_logprob_diff=float(np.abs(d).max()), tokens=int(d.size))
  if model.cfg.is_moe:
    result["kl_k3_own_routing"] = stats(own_logp)[1]
  return result


def run_engine(model, dtype, qtype, act_qtype, prompts, params, repeats) -> dict:
  sampler_model = with_dtype(model, dtype)
  max_len = -(-(max(map(len, prompts)) + FLAGS.new) // 128) * 128
  cfg = EngineConfig(slots=len(prompts), max_seq_len=max_len, prefix_cache_rows=0,
                     prefill_chunk=512, prefill_bucket=64, steps_per_call=16,
                     return_expert_ids=model.cfg.is_moe, weight_qtype=qtype,
                     act_qtype=act_qtype)
  Engine(sampler_model, cfg).generate(prompts, params)  # compile every shape the run takes
  times, outs = [], None
  for _ in range(repeats):
    engine = Engine(sampler_model, cfg)  # a fresh, empty cache each run
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    times.append(time.perf_counter() - start)
  syncs = []
  for version in range(repeats + 1):  # the first compiles the re-quantization
    start = time.perf_counter()
    engine.update_params(sampler_model, version=version + 1)
    engine.step()  # no request runs: the new weights are swapped in
    jax.block_until_ready(engine.weights)
    syncs.append(time.perf_counter() - start)
  new = sum(len(o.output_ids) for o in outs)
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.weights))
  return {"compute_dtype": dtype, "weight_qtype": qtype, "act_qtype": act_qtype,
          "tokens_per_s": round(new / statistics.median(times), 1),
          "seconds": round(statistics.median(times), 3), "new_tokens": new,
          "weight_mb": round(weight_bytes / 2**20, 3),
          "sync_s": round(statistics.median(syncs[1:]), 4),
          **mismatch(model, prompts, outs)}


def markdown(report: dict) -> str:
  rows = report["engines"]
  fp32 = rows["fp32"]["tokens_per_s"]
  moe = "routing_flips" in rows["fp32"]
  lines = [
      "## quantized_rollouts: engines sampling from int8 / fp8 copies of the policy",
      "",
      f"{report['date']}, {report['machine']} (1-minute load average "
      f"{report['load_avg'][0]} at the start, {report['load_avg'][1]} at the end); "
      f"`python -m benchmarks.quantized_rollouts --repeats={report['repeats']}` (median of "
      f"{report['repeats']}). Model: "
      f"{report['model']}. {report['requests']} requests of {report['new']} new tokens "
      "(temperature 1, seeded) in one `generate` of a 16-slot engine; tokens/s after a warm-up "
      "call that compiles. The trainer is the fp32 model's teacher-forced full pass over the "
      "same tokens, replaying the engine's experts (RL's routing replay); d = log p_trainer - "
      "log p_sampler per sampled token, KL(sampler ‖ trainer) by k3 and k1. Weights: the bytes "
      "the engine holds (the embeddings, norms, output head, routers and MLA's "
      "kv_b_proj stay fp32; see models/lora.py). Sync: one `update_params` of the fp32 policy "
      "(the jitted re-quantization with a weight type).",
      "",
      "| engine | weights MB | tokens/s | ratio | sync s | KL k3 | KL k1 | mean abs d | "
      "max abs d |" + (" routing flips | KL k3, own routing |" if moe else ""),
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if moe else ""),
  ]
  for name, r in rows.items():
    line = (f"| {name} | {r['weight_mb']:.2f} | {r['tokens_per_s']:.0f} | "
            f"{r['tokens_per_s'] / fp32:.2f} | {r['sync_s']:.4f} | {r['kl_k3']:.2e} | "
            f"{r['kl_k1']:.2e} | {r['mean_abs_logprob_diff']:.2e} | "
            f"{r['max_abs_logprob_diff']:.2e} |")
    if moe:
      line += f" {100 * r['routing_flips']:.2f}% | {r['kl_k3_own_routing']:.2e} |"
    lines.append(line)
  lines += [
      "",
      "Weight-only quantization stores the projections in 8 bits; with fp32 or bf16 "
      "activations qwix dequantizes a kernel inside the matmul's fusion and multiplies in "
      "floating point, so what it saves is weight memory and, where decoding is bound by "
      "reading the weights (accelerators at small batch), bandwidth, which tokens/s on a CPU do "
      "not show. With fp8 activations too, qwix also rounds every projection's input to "
      "e4m3 per token (scale max|x| / 448) at each call, and the error adds to the weights'. "
      "Routing flips come from the quantized "
      "projections feeding the (unquantized) routers; replay makes the trainer follow the "
      "engine's experts.",
      "", "```", "python -m benchmarks.quantized_rollouts --update_docs", "```"]
  return "\n".join(lines)


def main(_):
  load_start = os.getloadavg()[0]
  model, prompts, description = load(FLAGS.ckpt, FLAGS.prompts)
  params = [SamplingParams(max_tokens=FLAGS.new, temperature=1.0, seed=i)
            for i in range(len(prompts))]
  engines = {}
  for name, (dtype, qtype, act_qtype) in ENGINES.items():
    engines[name] = run_engine(model, dtype, qtype, act_qtype, prompts, params, FLAGS.repeats)
    print(name, engines[name], flush=True)
  report = {"benchmark": "quantized_rollouts", "date": today(), "machine": machine(),
            "model": description, "requests": len(prompts), "new": FLAGS.new,
            "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
            "repeats": FLAGS.repeats,
            # 1-minute load averages: the tokens/s of a shared machine depend on them
            "load_avg": [round(load_start, 1), round(os.getloadavg()[0], 1)],
            "engines": engines}
  line = json.dumps(report)
  print(line)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      f.write(line + "\n")
  if FLAGS.update_docs:
    write_section("quantized_rollouts", markdown(report))


if __name__ == "__main__":
  app.run(main)
