"""Forward+backward training-step throughput of ~10M-parameter MoE+MLA and dense GQA models.

    python -m benchmarks.model_step [--repeats=5 --batch=4 --seq=128 --out=x.json]

Prints one JSON object and (with --update_docs) rewrites the model_step section of
docs/benchmarks.md. The MoE config runs twice: `moe_impl="ragged"` and the all-experts
`moe_impl="dense"` reference, which is the in-process baseline of the reported ratio.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from benchmarks.common import MOE_MLA, machine, median_time, today, write_section
from models import transformer
from models.config import ModelConfig
from models.logprobs import token_logprobs
from models.presets import count_params

flags.DEFINE_integer("repeats", 5, "timed steps per config (the median is reported)")
flags.DEFINE_integer("batch", 4, "rows per step")
flags.DEFINE_integer("seq", 128, "tokens per row")
flags.DEFINE_bool("update_docs", False,
                  "also rewrite the model_step section of docs/benchmarks.md")
flags.DEFINE_string("out", None, "also write the JSON result to this path")
FLAGS = flags.FLAGS

DENSE_GQA = ModelConfig(
    vocab_size=8192, hidden_size=256, num_layers=7, num_heads=8, num_kv_heads=4, head_dim=32,
    intermediate_size=768)
CONFIGS = {"moe-mla-ragged": MOE_MLA, "moe-mla-dense": MOE_MLA.replace(moe_impl="dense"),
           "dense-gqa": DENSE_GQA}


def bench(name: str, cfg: ModelConfig, state: nnx.State, batch: int, seq: int,
          repeats: int) -> dict:
  model = nnx.merge(nnx.graphdef(transformer.abstract(cfg)), state)  # cfg may change moe_impl
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0, cfg.vocab_size, jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
  end = jnp.full((batch, seq), seq, jnp.int32)  # causal rows

  def loss_fn(params, tokens):
    model = nnx.merge(graphdef, params, rest)
    hidden, aux, _ = model.hidden(tokens, positions, end)
    logp, _ = token_logprobs(hidden[:, :-1], model.lm_head_weight(), tokens[:, 1:],
                             cfg.logits_chunk)
    return -logp.mean() + aux.get("balance_loss", 0.0)

  t0 = time.perf_counter()
  step = jax.jit(jax.value_and_grad(loss_fn)).lower(params, tokens).compile()
  compile_s = time.perf_counter() - t0
  median = median_time(lambda: step(params, tokens), repeats)
  return {"name": name, "params": count_params(cfg), "compile_s": round(compile_s, 3),
          "median_step_s": round(median, 4), "tokens_per_s": round(batch * seq / median, 1)}


def update_docs(result: dict, command: str) -> None:
  rows = ["| date | machine | config | params | median step (s) | tokens/s | ratio |",
          "|---|---|---|---|---|---|---|"]
  ratio = result["ratios"]["moe_ragged_over_dense"]
  for r in result["results"]:
    cell = {"moe-mla-ragged": f"{ratio:.2f}x vs moe-mla-dense",
            "moe-mla-dense": "1.00 (baseline)"}.get(r["name"], "-")
    rows.append(f"| {result['date']} | {result['machine']} | {r['name']} | {r['params']:,} "
                f"| {r['median_step_s']} | {r['tokens_per_s']:,.0f} | {cell} |")
  write_section("model_step", "\n".join([
      "## model_step: forward+backward training step", "",
      "Loss = mean next-token NLL (`token_logprobs`) + MoE balance loss; `jax.grad` w.r.t. the "
      f"`nnx.Param` state; batch {result['batch']}, seq {result['seq']}, median of "
      f"{result['repeats']} steps after compile. Ratio = ragged / dense (all-experts) MoE "
      "tokens/s, same process.", "", *rows, "", "```", command, "```"]))


def main(argv):
  del argv
  for name, cfg in CONFIGS.items():
    print(f"{name}: {count_params(cfg):,} params", flush=True)
  states = {}  # the two MoE runs share one initialisation (same weights, one init compile)
  results = []
  for name, cfg in CONFIGS.items():
    key = cfg.replace(moe_impl="ragged")
    if key not in states:
      states[key] = nnx.state(transformer.init(key, seed=0))
    results.append(bench(name, cfg, states[key], FLAGS.batch, FLAGS.seq, FLAGS.repeats))
  tps = {r["name"]: r["tokens_per_s"] for r in results}
  result = {
      "date": today(),
      "machine": machine(), "jax_version": jax.__version__, "batch": FLAGS.batch,
      "seq": FLAGS.seq, "repeats": FLAGS.repeats, "results": results,
      "ratios": {"moe_ragged_over_dense": round(tps["moe-mla-ragged"] / tps["moe-mla-dense"], 3)}}
  print(json.dumps(result, indent=2))
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(result, f, indent=2)
  if FLAGS.update_docs:
    update_docs(result, f"python -m benchmarks.model_step --update_docs --repeats={FLAGS.repeats} "
                        f"--batch={FLAGS.batch} --seq={FLAGS.seq}")


if __name__ == "__main__":
  app.run(main)
