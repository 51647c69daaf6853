"""Sampler/trainer mismatch: the engine's log-probs of its sampled tokens against a teacher-forced
full forward pass of the same weights, per model family, dtype pair and routing replay.

    python -m benchmarks.mismatch [--update_docs] [--bisect] [--out=x.json]

The engine (models/engine/) prefills each prompt but its last token, then decodes one token
at a time against its KV cache, sampling at temperature 1 and recording log p of each token.
The trainer side is `Transformer.__call__` on the finished sequences (no cache; MLA without
the absorbed projections). With d = log p_trainer - log p_sampler per sampled token,
k1 = mean(-d) and k3 = mean(exp(d) - 1 - d) (Schulman's KL(sampler || trainer) estimators).

`--bisect` also measures the dense GQA bf16 row with one operation changed at a time (each in
a fresh process: the changes patch the model code before anything is compiled); see
docs/numerics.md. Prints one JSON line per row and rewrites the `mismatch` section of
docs/benchmarks.md with `--update_docs`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from benchmarks.common import MOE_MLA, machine, today, write_section
from envs.policy import SamplingParams
from models import attention, layers, rope, transformer
from models.config import ModelConfig
from models.engine import Engine, EngineConfig

flags.DEFINE_bool("update_docs", False, "also rewrite the mismatch section of docs/benchmarks.md")
flags.DEFINE_bool("bisect", False, "also measure the op-by-op variants of the dense GQA bf16 row")
flags.DEFINE_string("variant", None, "internal: measure the dense GQA bf16 row with this change")
flags.DEFINE_integer("prompts", 16, "prompts (= engine slots, the decode batch)")
flags.DEFINE_integer("prompt_len", 64, "tokens per prompt")
flags.DEFINE_integer("new", 64, "tokens sampled per prompt")
flags.DEFINE_string("out", None, "also write the JSON result to this path")
FLAGS = flags.FLAGS

F32, BF16 = "float32", "bfloat16"


def families() -> dict:
  """The measured configs; initializer_range 0.1 makes next-token distributions far from
  uniform (their mean entropy is reported)."""
  moe_mla = MOE_MLA.replace(initializer_range=0.1)
  # benchmarks/generate.py's Qwen3-like config
  dense = ModelConfig(vocab_size=2048, hidden_size=256, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=64, intermediate_size=1024, qk_norm=True,
                      rope_theta=1e6, max_position_embeddings=512, initializer_range=0.1)
  mla = moe_mla.replace(num_experts=0, first_k_dense_replace=0)
  return {"dense GQA": dense,
          "dense MLA (absorbed decode)": mla,
          "MoE + MLA (absorbed decode)": moe_mla,
          "dense MLA (absorbed decode and training)": mla.replace(mla_absorbed_training=True),
          "MoE + MLA (absorbed decode and training)": moe_mla.replace(
              mla_absorbed_training=True)}


def replay_ids(own: np.ndarray, reported: np.ndarray) -> np.ndarray:
  """The trainer's expert_ids for one sequence with the engine's choices where it reports them.

  The engine reports the experts of the last P positions of the sequence but its final token
  (the positions it fed through the model, newest last); earlier positions keep the trainer's
  own routing. Those form a prefix, which causal attention keeps independent of what is
  replayed after it, so one routing pass gives them exactly.

  Args:
    own: [moe_layers, length, k] the trainer's own routing of the sequence.
    reported: [P, moe_layers, k] the engine's `Completion.expert_ids`.

  Returns:
    [moe_layers, length, k] expert ids to replay.
  """
  out = own.copy()
  stop = own.shape[1] - 1
  out[:, stop - len(reported):stop] = np.transpose(reported, (1, 0, 2))
  return out


def measure(cfg, trainer_dtype: str, replay: bool = False, n: int = 16, prompt_len: int = 64,
            new: int = 64) -> dict:
  """One row: n prompts of random tokens, `new` tokens sampled by the engine, then scored.

  Args:
    cfg: the model config; its dtype is the sampler's.
    trainer_dtype: the trainer's compute dtype (same weights).
    replay: MoE: the trainer replays the engine's expert choices where it reports them.
    n: prompts (and engine slots).
    prompt_len: tokens per prompt.
    new: tokens sampled per prompt.

  Returns:
    The row's numbers (see `markdown`).
  """
  model = transformer.init(cfg, seed=0)
  engine = Engine(model, EngineConfig(slots=n, max_seq_len=prompt_len + new, prefix_cache_rows=0,
                                      prefill_chunk=prompt_len, prefill_bucket=prompt_len,
                                      steps_per_call=new, return_expert_ids=cfg.is_moe))
  inputs = np.random.default_rng(7).integers(1, cfg.vocab_size, (n, prompt_len)).tolist()
  outs = engine.generate(inputs, [SamplingParams(max_tokens=new, temperature=1.0, seed=i)
                                  for i in range(n)])
  trainer = nnx.merge(nnx.graphdef(transformer.abstract(cfg.replace(dtype=trainer_dtype))),
                      nnx.state(model))
  seqs = np.array([x + o.output_ids for x, o in zip(inputs, outs)], np.int32)
  length = seqs.shape[1]

  @nnx.jit
  def score(m, tokens, expert_ids):
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), tokens.shape)
    logits, aux = m(tokens, positions, jnp.full(tokens.shape, length, jnp.int32),
                    expert_ids=expert_ids)
    logp = jax.nn.log_softmax(logits[:, prompt_len - 1:-1], -1)
    entropy = -(jnp.exp(logp) * logp).sum(-1)
    chosen = jnp.take_along_axis(logp, tokens[:, prompt_len:, None], -1)[..., 0]
    return chosen, entropy, aux.get("expert_ids", jnp.zeros((0,), jnp.int32))

  tokens = jnp.asarray(seqs)
  train, entropy, own = score(trainer, tokens, None)
  flips, replayed = None, None
  if cfg.is_moe:
    own = np.asarray(own)  # [moe_layers, n, length, k]
    reported = [o.expert_ids for o in outs]
    span = (length - 1 - len(reported[0]), length - 1)
    engine_ids = np.stack([np.transpose(r, (1, 0, 2)) for r in reported], 1)
    trainer_ids = own[:, :, span[0]:span[1]]
    flips = float(np.mean(np.any(np.sort(engine_ids, -1) != np.sort(trainer_ids, -1), -1)))
    replayed = f"{span[0]}..{span[1] - 1}" if replay else None
    if replay:
      ids = np.stack([replay_ids(own[:, i], r) for i, r in enumerate(reported)], 1)
      train, entropy, _ = score(trainer, tokens, jnp.asarray(ids))
  train, entropy = np.asarray(train, np.float64), np.asarray(entropy, np.float64)
  d = train - np.array([o.logprobs for o in outs], np.float64)
  return {"sampler_dtype": cfg.dtype, "trainer_dtype": trainer_dtype, "replay": replay,
          "replayed_positions": replayed, "tokens": int(d.size),
          "kl_k3": float(np.mean(np.expm1(d) - d)), "kl_k1": float(np.mean(-d)),
          "max_abs_logprob_diff": float(np.abs(d).max()), "mean_entropy": float(entropy.mean()),
          "routing_flips": flips}


def table(n: int, prompt_len: int, new: int) -> list[dict]:
  """Every row: family × (sampler, trainer) dtypes × routing replay (MoE)."""
  rows = []
  for name, cfg in families().items():
    mixed = not cfg.is_moe and not cfg.mla_absorbed_training
    pairs = [(F32, F32), (BF16, BF16)] + ([(BF16, F32)] if mixed else [])
    for sampler, trainer in pairs:
      for replay in ((False, True) if cfg.is_moe else (False,)):
        row = {"model": name, **measure(cfg.replace(dtype=sampler), trainer, replay, n,
                                        prompt_len, new)}
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
  return rows


# ----------------------------------------------------------------------------- replay cost


def _median_time(fn, repeats: int) -> float:
  """Median wall seconds of fn() (which blocks on its result) after one warm-up call."""
  fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def replay_cost(n: int, prompt_len: int, new: int, repeats: int = 5) -> dict:
  """What routing replay costs on the bf16 MoE + MLA config: the engine recording every
  position's experts (`return_expert_ids`) vs not, and the trainer's forward + backward with
  replayed expert ids vs its own routing (the same sequences), and with replay and
  `mla_absorbed_training` on; medians of `repeats`."""
  cfg = families()["MoE + MLA (absorbed decode)"].replace(dtype=BF16)
  model = transformer.init(cfg, seed=0)
  inputs = np.random.default_rng(7).integers(1, cfg.vocab_size, (n, prompt_len)).tolist()
  params = [SamplingParams(max_tokens=new, temperature=1.0, seed=i) for i in range(n)]
  out, outs = {}, None
  for record in (False, True):
    engine = Engine(model, EngineConfig(slots=n, max_seq_len=prompt_len + new,
                                        prefix_cache_rows=0, prefill_chunk=prompt_len,
                                        prefill_bucket=prompt_len, steps_per_call=new,
                                        return_expert_ids=record))
    box = []
    out[f"engine_s_{'record' if record else 'plain'}"] = _median_time(
        lambda: box.append(engine.generate(inputs, params)), repeats)
    outs = box[-1] if record else outs
  length = prompt_len + new
  tokens = jnp.asarray([x + o.output_ids for x, o in zip(inputs, outs)], jnp.int32)
  ids = jnp.asarray(np.stack([np.concatenate([np.transpose(o.expert_ids, (1, 0, 2)), np.full(
      (cfg.num_moe_layers, 1, cfg.experts_per_token), -1, np.int16)], 1) for o in outs], 1))
  graphdef, state = nnx.split(model)
  absorbed = nnx.graphdef(transformer.abstract(cfg.replace(mla_absorbed_training=True)))

  @functools.partial(jax.jit, static_argnums=0)
  def step(graphdef, state, expert_ids):
    def loss(state):
      m = nnx.merge(graphdef, state)
      positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), tokens.shape)
      logits, _ = m(tokens, positions, jnp.full(tokens.shape, length, jnp.int32),
                    expert_ids=expert_ids)
      logp = jax.nn.log_softmax(logits[:, prompt_len - 1:-1], -1)
      return -jnp.take_along_axis(logp, tokens[:, prompt_len:, None], -1).mean()
    return jax.grad(loss)(state)

  for name, g, expert_ids in (("own", graphdef, None), ("replay", graphdef, ids),
                              ("absorbed", absorbed, ids)):
    out[f"train_s_{name}"] = _median_time(
        lambda: jax.block_until_ready(step(g, state, expert_ids)), repeats)
  out["engine_ratio"] = out["engine_s_record"] / out["engine_s_plain"]
  out["train_ratio"] = out["train_s_replay"] / out["train_s_own"]
  out["absorbed_ratio"] = out["train_s_absorbed"] / out["train_s_replay"]
  return out


# ----------------------------------------------------------------------------- bisection
# Each variant changes one operation of the model code, on both the engine's and the trainer's
# path, to measure its share of the dense bf16 mismatch (docs/numerics.md).


def _plain_cast(x, dtype):
  """A cast XLA may skip inside a fusion (the code before `layers.round_to`)."""
  return x.astype(dtype)


def _dense_bf16_dot(self, x):
  """Dense with a bf16-output dot (accumulation left to the backend)."""
  w = self.kernel[...].astype(self.dtype)
  lead, out_shape = x.shape[:x.ndim - self.n_in], w.shape[self.n_in:]
  size_in = math.prod(w.shape[:self.n_in])
  y = jnp.dot(x.astype(self.dtype).reshape(-1, size_in), w.reshape(size_in, -1))
  y = y.reshape(lead + out_shape)
  if self.bias is not None:
    y = y + self.bias[...].astype(self.dtype)
  return layers.round_to(y, self.dtype)


def _dense_plain_cast(self, x):
  """Dense accumulating in fp32, its result cast by a plain `astype`."""
  w = self.kernel[...].astype(self.dtype)
  lead, out_shape = x.shape[:x.ndim - self.n_in], w.shape[self.n_in:]
  size_in = math.prod(w.shape[:self.n_in])
  y = jnp.dot(x.astype(self.dtype).reshape(-1, size_in), w.reshape(size_in, -1),
              preferred_element_type=jnp.float32)
  y = y.reshape(lead + out_shape)
  if self.bias is not None:
    y = y + self.bias[...]
  return y.astype(self.dtype)


def _norm_plain_cast(self, x):
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
  return (self.scale[...] * xf.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)


def _norm_matvec(self, x):
  """RMSNorm whose mean square is a matrix-vector product (an order independent of rows)."""
  xf = x.astype(jnp.float32)
  d = xf.shape[-1]
  ms = jnp.dot(xf * xf, jnp.full((d, 1), 1 / d, jnp.float32),
               precision=jax.lax.Precision.HIGHEST)
  xf = xf * jax.lax.rsqrt(ms + self.eps)
  return layers.round_to(self.scale[...] * layers.round_to(xf, x.dtype).astype(jnp.float32),
                         x.dtype)


def _patch(obj, name, value):
  setattr(obj, name, value)


_ATTENTION = attention.attention
VARIANTS = {
    # name: (what changes, patch)
    "aligned": ("the code as it is", lambda: None),
    "dense_bf16_dot": ("Dense: bf16-output dot instead of fp32 accumulation",
                       lambda: _patch(layers.Dense, "__call__", _dense_bf16_dot)),
    "dense_plain_cast": ("Dense: fp32 accumulation, result cast by a plain astype",
                         lambda: _patch(layers.Dense, "__call__", _dense_plain_cast)),
    "norm_plain_cast": ("RMSNorm: both casts plain astype",
                        lambda: _patch(layers.RMSNorm, "__call__", _norm_plain_cast)),
    "residual_plain_cast": ("residual sums: plain bf16 add",
                            lambda: _patch(transformer, "round_to", _plain_cast)),
    "rope_plain_cast": ("rotary output: plain astype",
                        lambda: _patch(rope, "round_to", _plain_cast)),
    "probs_fp32": ("attention: fp32 probabilities and values for P·V",
                   lambda: _patch(attention, "attention", lambda q, k, v, *a, **kw: _ATTENTION(
                       q, k, v.astype(jnp.float32), *a, **kw))),
    "kv_cache_fp32": ("decode cache in fp32 (keys/values are bf16-rounded before it)",
                      lambda: _patch(attention, "dtype_of", lambda cfg: jnp.dtype(F32))),
    "residual_fp32": ("residual stream in fp32 (norm inputs and sums)",
                      lambda: _patch(transformer, "dtype_of", lambda cfg: jnp.dtype(F32))),
    "norm_matvec": ("RMSNorm mean square as a matvec (row-count independent order)",
                    lambda: _patch(layers.RMSNorm, "__call__", _norm_matvec)),
    "no_excess_precision": ("XLA_FLAGS=--xla_allow_excess_precision=false", lambda: None),
}
ENV = {"no_excess_precision": {"XLA_FLAGS": "--xla_allow_excess_precision=false"}}


def bisect(n: int, prompt_len: int, new: int) -> list[dict]:
  """The dense GQA bf16/bf16 row under each variant, each in its own process."""
  rows = []
  for name, (what, _) in VARIANTS.items():
    for slots in sorted({n, 8}):
      env = {**os.environ, **ENV.get(name, {})}
      cmd = [sys.executable, "-m", "benchmarks.mismatch", f"--variant={name}",
             f"--prompts={slots}", f"--prompt_len={prompt_len}", f"--new={new}"]
      out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
      row = {"variant": name, "change": what, "slots": slots,
             **json.loads(out.strip().splitlines()[-1])}
      print(json.dumps(row), file=sys.stderr, flush=True)
      rows.append(row)
  return rows


# ----------------------------------------------------------------------------- main


def _fmt(x, spec):
  return "-" if x is None else format(x, spec)


def markdown(result: dict, machine_name: str) -> str:
  r = result
  lines = [
      "## mismatch: sampler vs trainer log-probs", "",
      f"{r['date']}, {machine_name}. The engine (`Engine.generate`, {r['prompts']} slots) "
      f"samples {r['new']} tokens at temperature 1 after each of {r['prompts']} random "
      f"{r['prompt_len']}-token prompts and records their log-probs (prefill of the prompt but "
      "its last token, then one token at a time against the KV cache); the trainer scores the "
      "same tokens with a teacher-forced full forward pass of the same weights (no cache; MLA "
      "without the absorbed projections unless `mla_absorbed_training`). KL(sampler ‖ "
      "trainer) by the k3 and k1 estimators of the per-token differences; mean entropy of the trainer's next-token distributions. "
      "Dense GQA = benchmarks/generate.py's Qwen3-like config, MoE + MLA = "
      "benchmarks/common.py MOE_MLA, dense MLA = MOE_MLA without experts; initializer_range "
      "0.1; \"absorbed decode and training\": `mla_absorbed_training=True`, the full pass "
      "attends in latent space as the decode path does. Routing flips: share of (token, MoE layer) pairs whose expert set differs between "
      "the engine (`Completion.expert_ids`) and the trainer's own routing, over every position "
      f"the engine reports (positions {r['replayed_positions']} of each sequence here). Replay "
      "on: the trainer's forward takes the engine's expert ids at every position the engine "
      "reports and routes the positions it does not report (none here) "
      "itself. Why the rest differs, operation by operation: docs/numerics.md.", "",
      "| model | sampler | trainer | replay | KL k3 | KL k1 | max abs Δ log-prob | "
      "mean entropy | routing flips | tokens |", "|---|---|---|---|---|---|---|---|---|---|"]
  for m in r["rows"]:
    replay = ("on" if m["replay"] else "off") if m["routing_flips"] is not None else "-"
    lines.append(
        f"| {m['model']} | {m['sampler_dtype']} | {m['trainer_dtype']} | {replay} | "
        f"{m['kl_k3']:.2e} | {m['kl_k1']:.2e} | {m['max_abs_logprob_diff']:.2e} | "
        f"{m['mean_entropy']:.2f} | {_fmt(m['routing_flips'], '.2%')} | {m['tokens']:,} |")
  if r.get("replay_cost"):
    c = r["replay_cost"]
    lines += ["", f"**Cost of routing replay** (bf16 MoE + MLA, the same {r['prompts']} "
              f"prompts; medians of 5 after a warm-up): the engine recording every position's "
              f"experts {c['engine_s_record']:.3f} s vs {c['engine_s_plain']:.3f} s a "
              f"`generate` call ({c['engine_ratio']:.2f}×: the ids come back to the host after "
              f"each prefill and decode call); the trainer's forward + backward over the "
              f"sequences with replayed ids {c['train_s_replay']:.3f} s vs its own routing "
              f"{c['train_s_own']:.3f} s ({c['train_ratio']:.2f}×: replay still computes the "
              "router's own choice, for the `routing_flips` metric); with "
              f"`mla_absorbed_training` as well {c['train_s_absorbed']:.3f} s "
              f"({c['absorbed_ratio']:.2f}× the replayed step; this config's latent width "
              "r = 128 is 4× its d_nope and d_v, as DeepSeek-V3's 512 is 4× its 128: 3× the "
              "attention's QK and 4× its PV FLOPs)."]
  lines += ["", "```", "python -m benchmarks.mismatch --update_docs", "```"]
  return "\n".join(lines)


def main(argv) -> None:
  del argv
  if FLAGS.variant:
    VARIANTS[FLAGS.variant][1]()
    row = measure(families()["dense GQA"].replace(dtype=BF16), BF16, False, FLAGS.prompts,
                  FLAGS.prompt_len, FLAGS.new)
    print(json.dumps({k: row[k] for k in ("kl_k3", "kl_k1", "max_abs_logprob_diff", "tokens")}))
    return
  n, p, new = FLAGS.prompts, FLAGS.prompt_len, FLAGS.new
  rows = table(n, p, new)
  replayed = next((m["replayed_positions"] for m in rows if m["replayed_positions"]), "-")
  result = {"date": today(), "prompts": n, "prompt_len": p, "new": new, "rows": rows,
            "replayed_positions": replayed}
  result["replay_cost"] = replay_cost(n, p, new)
  print(json.dumps(result["replay_cost"]), file=sys.stderr, flush=True)
  if FLAGS.bisect:
    result["bisect"] = bisect(n, p, new)
  print(json.dumps(result))
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(result, f, indent=2)
  if FLAGS.update_docs:
    write_section("mismatch", markdown(result, machine()))


if __name__ == "__main__":
  app.run(main)
