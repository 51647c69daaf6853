"""Tree-packed vs linearized training step (forward + backward) on the same trajectories.

    python -m benchmarks.tree_speedup [--repeats=2 --workloads=prompt_group,agent_group]

Workloads (docs/benchmarks.md):
  prompt_group  8 responses of 128 tokens sharing a 1024-token prompt.
  agent_group   4 agent trajectories, each: a shared 1024-token system prompt + task; 6 turns of
                96 sampled + 160 observation tokens; 2 sub-agents forking after turn 2 with 3
                turns of their own; after turn 4 the context is compacted and turns 5-6 continue
                from a 256-token summary. (`agent_group_partitioned`: the same group in
                shorter rows, so the tree is cut into parts.)
The linearized baseline trains every LLM call as its own sequence (ordinary sequence packing:
each call its own tree); the tree step trains each group's trie. Both use the same packer,
rows, micro-batch shape, model and loss (token-mean NLL of the sampled tokens), and run in the
same process. Per workload one JSON line: `bound` = linearized tokens / tree tokens,
`speedup` = linearized step time / tree step time, and both steps' temporary memory from
`compiled.memory_analysis()`.
"""

from __future__ import annotations

import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from benchmarks.common import MOE_MLA, machine, median_time, today, write_section
from models import transformer
from models.logprobs import sequence_logprobs
from rl.packing import pack
from rl.tree import CallTokens, TrajectoryTokens, build_tree

flags.DEFINE_integer("repeats", 2, "timed steps per variant (median reported)")
flags.DEFINE_list("workloads", ["prompt_group", "agent_group"], "workloads to run")
flags.DEFINE_bool("update_docs", False,
                  "also rewrite the tree_speedup section of docs/benchmarks.md")
FLAGS = flags.FLAGS

flags.DEFINE_enum("attention_impl", "xla_flash", ["xla", "xla_flash", "auto"],
                  "attention for both variants: xla_flash skips fully masked blocks (what the "
                  "Pallas kernels do on accelerators); xla is dense per row")

# Remat keeps one layer's activations at a time (rows are long).
CFG = MOE_MLA.replace(remat="full", seq_balance_coef=0.0)


def prompt_group(rng) -> list[TrajectoryTokens]:
  prompt = rng.integers(0, CFG.vocab_size, 1024).tolist()
  return [TrajectoryTokens([CallTokens(prompt, rng.integers(0, CFG.vocab_size, 128).tolist())])
          for _ in range(8)]


def agent_group(rng) -> list[TrajectoryTokens]:
  t = lambda n: rng.integers(0, CFG.vocab_size, n).tolist()
  prompt = t(1024)
  group = []
  for _ in range(4):
    calls, context = [], prompt
    for turn in range(1, 5):  # main agent, turns 1-4
      out = t(96)
      calls.append(CallTokens(context, out))
      if turn == 2:
        fork = context + out + t(160)
      context = context + out + t(160)
    for _ in range(2):  # sub-agents fork after turn 2, 3 turns each
      sub = fork
      for _ in range(3):
        out = t(96)
        calls.append(CallTokens(sub, out))
        sub = sub + out + t(160)
    context = prompt + t(256)  # compaction: turns 5-6 continue from a summary
    for _ in range(2):
      out = t(96)
      calls.append(CallTokens(context, out))
      context = context + out + t(160)
    group.append(TrajectoryTokens(calls))
  return group


# Row length (multiple of 128) and rows per micro-batch, the same for both variants. Rows hold a
# whole group's tree (12416 tokens for agent_group), so it is not cut into parts; with blocked
# attention a long row costs what its mask allows, not L². `agent_group_partitioned` cuts the
# same tree into rows of 3968 (carrying each part's ancestors) to show what partitioning costs.
WORKLOADS = {"prompt_group": (prompt_group, 2304, 1), "agent_group": (agent_group, 12544, 1),
             "agent_group_partitioned": (agent_group, 3968, 4)}


def loss_fn(params, graphdef, rest, batch, n_tokens):
  model = nnx.merge(graphdef, params, rest)
  hidden, _, _ = model.hidden(batch["tokens"], batch["positions"], batch["end"])
  lp, _ = sequence_logprobs(hidden, model.lm_head_weight(), batch["seq_pred"],
                            batch["seq_tokens"], CFG.logits_chunk)
  return -(lp * batch["weight"]).sum() / n_tokens


def prepare(trees, row_len: int, rows_per_batch: int, model, n_tokens: int) -> dict:
  """Pack, compile (once per distinct micro-batch shape) and return the variant's step."""
  batches = pack(trees, row_len=row_len, rows_per_batch=rows_per_batch)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  arrays = [{"tokens": b.tokens, "positions": b.positions, "end": b.end, "seq_pred": b.seq_pred,
             "seq_tokens": b.seq_tokens, "weight": b.seq_valid * b.fields["loss_mask"]}
            for b in batches]
  grad_fn = jax.jit(jax.value_and_grad(loss_fn), static_argnums=(1,))
  compiled = {}
  for a in arrays:  # one compile per distinct shape (seq arrays may differ between batches)
    key = tuple(v.shape for v in a.values())
    if key not in compiled:
      compiled[key] = grad_fn.lower(params, graphdef, rest, a, n_tokens).compile()
  add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))
  result = {"rows": sum(b.tokens.shape[0] for b in batches), "micro_batches": len(batches),
            "temp_bytes": int(max(c.memory_analysis().temp_size_in_bytes
                                  for c in compiled.values())), "times": []}

  def step():
    total, grads = 0.0, None
    for a in arrays:
      loss, g = compiled[tuple(v.shape for v in a.values())](params, rest, a, n_tokens)
      total, grads = total + loss, g if grads is None else add(grads, g)
    result["loss"] = float(total)
    return total, grads

  result["step"] = step
  return result


def measure(variants: list[dict], repeats: int) -> None:
  """Time the variants' steps interleaved (lin, tree, lin, tree, ...) after one warm-up each,
  so a change in machine load hits both alike; record the median step time of each."""
  for v in variants:
    jax.block_until_ready(v["step"]())
  for _ in range(repeats):
    for v in variants:
      v["times"].append(median_time(v["step"], 1))
  for v in variants:
    v["step_s"] = round(statistics.median(v.pop("times")), 3)
    del v["step"]


def main(argv):
  del argv
  cfg = CFG.replace(attention_impl=FLAGS.attention_impl)
  model = transformer.init(cfg, seed=0)
  lines = []
  for name in FLAGS.workloads:
    make, row_len, rows_per_batch = WORKLOADS[name]
    group = make(np.random.default_rng(0))
    calls = [c for traj in group for c in traj.calls]
    tree = build_tree(group)
    linear = [build_tree([TrajectoryTokens([c])]) for c in calls]
    n_tokens = sum(len(c.output_ids) for c in calls)
    linear_tokens = sum(len(c.input_ids) + len(c.output_ids) for c in calls)
    print(f"{name}: {len(calls)} calls, {linear_tokens} linearized tokens, {len(tree)} tree "
          f"tokens, rows of {row_len}", flush=True)
    lin = prepare(linear, row_len, rows_per_batch, model, n_tokens)
    tre = prepare([tree], row_len, rows_per_batch, model, n_tokens)
    measure([lin, tre], FLAGS.repeats)
    assert abs(lin["loss"] - tre["loss"]) <= 1e-4 * abs(lin["loss"]), (lin["loss"], tre["loss"])
    line = {"workload": name, "date": today(), "machine": machine(), "repeats": FLAGS.repeats,
            "row_len": row_len, "rows_per_micro_batch": rows_per_batch,
            "linearized_tokens": linear_tokens, "tree_tokens": len(tree),
            "bound": round(linear_tokens / len(tree), 3),
            "speedup": round(lin["step_s"] / tre["step_s"], 3), "linearized": lin, "tree": tre}
    line["speedup_over_bound"] = round(line["speedup"] / line["bound"], 3)
    print(json.dumps(line), flush=True)
    lines.append(line)
  if FLAGS.update_docs:
    rows = ["| date | workload | row len x rows per micro-batch | linearized / tree tokens (bound) | rows lin / tree | step s lin / tree | speedup | speedup / bound | temp MiB lin / tree |",
            "|---|---|---|---|---|---|---|---|---|"]
    for l in lines:
      lin, tre = l["linearized"], l["tree"]
      rows.append(f"| {l['date']} | {l['workload']} | {l['row_len']} x "
                  f"{l['rows_per_micro_batch']} | {l['linearized_tokens']} / "
                  f"{l['tree_tokens']} ({l['bound']}) | {lin['rows']} / {tre['rows']} | "
                  f"{lin['step_s']} / {tre['step_s']} | {l['speedup']} | "
                  f"{l['speedup_over_bound']} | {lin['temp_bytes'] / 2**20:.0f} / "
                  f"{tre['temp_bytes'] / 2**20:.0f} |")
    write_section("tree_speedup", "\n".join([
        "## tree_speedup: tree-packed vs linearized train step", "",
        f"Machine: {lines[0]['machine'] if lines else ''}. ~10M-parameter MoE+MLA model "
        f"(benchmarks/common.py MOE_MLA, remat full), attention `{FLAGS.attention_impl}`, "
        f"fp32, median of {FLAGS.repeats} interleaved repeats after a warm-up; same process, packer, row length and micro-batch "
        "shape for both variants. Goal: speedup >= 0.8 x bound.", "", *rows, "",
        "Temporary memory is equal because both variants compile the same micro-batch shape; "
        "the tree step needs fewer micro-batches.", "", "```",
        f"python -m benchmarks.tree_speedup --update_docs --repeats={FLAGS.repeats} "
        f"--attention_impl={FLAGS.attention_impl} --workloads={','.join(FLAGS.workloads)}",
        "```"]))


if __name__ == "__main__":
  app.run(main)
