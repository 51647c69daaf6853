"""One RL step: Arbor's GRPO train step tree-packed and linearized against google/tunix and
transformers+torch, and the phases of a whole RL step on the demo model.

    bash benchmarks/setup_tunix.sh        # once: the tunix virtualenv
    python -m benchmarks.rl_step [--part=all|step|demo --repeats=5 --update_docs --out=x.json]

Part "step": the GRPO train step on the reference workload. Model: the generate
benchmark's Qwen3-like config (vocab 2048, hidden 256, 4 layers, 4 heads, 2 KV heads,
head_dim 64, MLP 1024, fp32, random weights). Workload (`workload`): 2 prompts × G = 8 samples,
each sample = its prompt's 192 tokens + 64 sampled tokens (random ids, fixed seed), rewards
random 0/1, GRPO advantages. One timed step = the reference model's forward (log-probs of the
sampled tokens, for the KL term) + the policy forward + backward + global-norm clipping (1.0) +
AdamW (lr 1e-6, betas 0.9/0.99, eps 1e-8, weight decay 0.1), with the same loss everywhere:
GRPO clipped ratio (ε = 0.2, on-policy: the ratio's denominator is the detached current
log-prob), k3 KL to the reference with β = 0.04, sequence-mean-token-mean (= token mean here:
every sample has 64 loss tokens). Sides:
  arbor_tree    trainer.step.make_score_fn + make_train_step on trainer.batches micro-batches
                where the 8 samples of a prompt are one tree (192 + 8 × 64 = 704 nodes), one
                tree per row (2 rows of --tree_row_len);
  arbor_linear  the same step on the linearized batch: every sample its own row (16 × 256);
  tunix         google-tunix 0.1.7's GRPO train step (benchmarks/rl_step_tunix.py, its own venv);
  torch         transformers Qwen3ForCausalLM (sdpa, 2 threads) with a hand-written GRPO loss and
                torch.optim.AdamW, full-sequence logits as model(ids).logits computes them;
  torch_keep    the same with logits_to_keep = 65 (logits of the predicting positions only).
tokens/s = 16 × 256 linearized tokens / step time, for every side. Each side compiles (or warms
up) with one step, then the sides run interleaved, round after round, so machine load hits them
alike; medians are reported. The workers are separate processes (benchmarks/generate.py's
Worker protocol); the workload reaches them as an .npz.

Part "demo": one RL step composed from the pieces, without sandboxes, on the demo model
(configs/sft_demo.py: tiny MoE + MLA): generate G = 8 samples for --demo_prompts
prompts with models.engine.Engine (temperature 1), random 0/1 rewards, GRPO advantages
(rl.advantages.grpo), reference log-probs (make_score_fn), pack (tree or linearized), train step,
`engine.update_params`. Seconds per phase and tokens/s; the tree and the linearized pipeline
(each its own engine and train state, the same prompts and sampling seeds) alternate steps.

Prints one JSON line and rewrites the `rl_step` section of docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

# The generate benchmark's config, worker protocol and tunix venv set-up are reused; it defines
# --repeats/--update_docs/--out too, which are redefined here (allow_override) with this help.
from benchmarks import generate

flags.DEFINE_enum("part", "all", ["all", "step", "demo"], "what to measure")
flags.DEFINE_integer("repeats", 5, "interleaved rounds (medians are reported)",
                     allow_override=True)
flags.DEFINE_bool("update_docs", False,
                  "also rewrite the rl_step section of docs/benchmarks.md",
                  allow_override=True)
flags.DEFINE_string("out", None, "also write the JSON result to this path", allow_override=True)
flags.DEFINE_list("sides", ["arbor_tree", "arbor_linear", "tunix", "torch", "torch_keep"],
                  "sides of the step benchmark")
flags.DEFINE_integer("tree_row_len", 768, "row length of the tree-packed batch (one tree a row)")
flags.DEFINE_string("tree_attention_impl", "xla_flash",
                    "ModelConfig.attention_impl of the tree-packed step: xla_flash skips the "
                    "key blocks the tree rule masks (one 704-node tree a 768-token row)")
flags.DEFINE_string("linear_attention_impl", "auto",
                    "ModelConfig.attention_impl of the linearized step (auto: dense on CPU "
                    "below 768 keys)")
flags.DEFINE_bool("fused_ref", True,
                  "Arbor sides: the reference scored inside the train step's program "
                  "(step(state, mb, ref=...)); False: a separate scoring pass first")
flags.DEFINE_bool("scan_layers", False,
                  "ModelConfig.scan_layers of both Arbor steps (False: a Python loop over the "
                  "layers, no stacked backward residuals: +17% linearized, +9% tree on CPU)")
flags.DEFINE_integer("demo_prompts", 4, "prompts per demo RL step (G = 8 samples each)")
flags.DEFINE_list("demo_attention_impls", ["config", "xla_flash"],
                  "attention_impl of the demo model, one demo measurement each ('config': "
                  "configs/sft_demo.py's own, auto = dense on CPU below 768 keys)")
flags.DEFINE_enum("role", None, ["torch", "torch_keep"], "internal: run as a torch worker")
flags.DEFINE_string("workload", None, "internal: the workload .npz of a worker")
FLAGS = flags.FLAGS

PROMPTS, G, PROMPT, COMPLETION, VOCAB = 2, 8, 192, 64, generate.VOCAB
LINEAR_TOKENS = PROMPTS * G * (PROMPT + COMPLETION)  # 4,096: what tokens/s counts on every side
LR, B1, B2, EPS, WD, CLIP, BETA, EPSILON = 1e-6, 0.9, 0.99, 1e-8, 0.1, 1.0, 0.04, 0.2
SIDES = ("arbor_tree", "arbor_linear", "tunix", "torch", "torch_keep")


# ----------------------------------------------------------------------------- workload


def workload(seed: int = 0, prompts: int = PROMPTS, group: int = G, prompt_len: int = PROMPT,
             completion_len: int = COMPLETION, vocab: int = VOCAB) -> dict:
  """The reference workload as NumPy arrays: prompts [P, prompt_len], completions
  [P·G, completion_len] (sample i belongs to prompt i // G), rewards and GRPO advantages
  [P·G]. Ids are 1..vocab-1 (0 stays free as tunix's pad id); the G completions of a prompt
  start with distinct tokens, so a prompt's tree has exactly prompt_len + G·completion_len
  nodes."""
  rng = np.random.default_rng(seed)
  p = rng.integers(1, vocab, (prompts, prompt_len))
  c = rng.integers(1, vocab, (prompts * group, completion_len))
  for i in range(prompts):
    c[i * group:(i + 1) * group, 0] = rng.choice(np.arange(1, vocab), group, replace=False)
  rewards = rng.integers(0, 2, prompts * group).astype(np.float32)
  r = rewards.reshape(prompts, group)  # GRPO: (R - mean_g) / (std_g + 1e-6), 0 if constant
  std = r.std(1, keepdims=True)
  adv = np.where(std > 0, (r - r.mean(1, keepdims=True)) / (std + 1e-6), 0.0)
  return {"prompts": p, "completions": c, "rewards": rewards,
          "advantages": adv.reshape(-1).astype(np.float32), "vocab": vocab, "group_size": group}


def groups(w: dict) -> list:
  """The workload's trajectories (rl.tree.TrajectoryTokens, one call each) by prompt."""
  from rl.tree import CallTokens, TrajectoryTokens
  g = int(w["group_size"])
  return [[TrajectoryTokens([CallTokens(w["prompts"][i].tolist(),
                                        w["completions"][i * g + j].tolist())])
           for j in range(g)] for i in range(len(w["prompts"]))]


def micro_batches(w: dict, layout: str, row_len: int = 768, splits: int = 1):
  """The workload as trainer.batches micro-batches with the advantages attached.
  layout "tree": a prompt's G samples are one tree, as many whole trees a row of `row_len` as
  fit; "linear": every sample its own group and row of prompt_len + completion_len (rounded up
  to a multiple of 128). The rows are split into `splits` micro-batches (one step, gradients
  summed: the same update)."""
  from trainer.batches import BatchShape, make_micro_batches
  gs = groups(w)
  n = sum(len(x) for x in gs)
  length = w["prompts"].shape[1] + w["completions"].shape[1]
  if layout == "tree":
    tree = w["prompts"].shape[1] + len(gs[0]) * w["completions"].shape[1]  # nodes of a tree
    rows = -(-len(gs) // max(1, row_len // tree))
  elif layout == "linear":
    gs = [[t] for x in gs for t in x]
    row_len, rows = -(-length // 128) * 128, n
  else:
    raise ValueError(f"layout={layout!r}: expected 'tree' or 'linear'")
  shape = BatchShape(row_len=row_len, rows=-(-rows // splits), seqs=-(-n // splits),
                     seq_len=w["completions"].shape[1], micro_batches=splits)
  mb = make_micro_batches(gs, shape)
  return mb.with_scalars(advantage=w["advantages"])


def loss_config():
  from rl.losses import LossConfig
  return LossConfig(name="grpo", kl_coef=BETA, kl_estimator="k3", eps_low=EPSILON,
                    eps_high=EPSILON, aggregation="seq_mean_token_mean")


def optimizer_config():
  from trainer.optim import OptimizerConfig
  return OptimizerConfig(name="adamw", learning_rate=LR, schedule="constant", b1=B1, b2=B2,
                         eps=EPS, weight_decay=WD, grad_clip_norm=CLIP)


# ----------------------------------------------------------------------------- arbor


class ArborStep:
  """Arbor's step on one layout: `run(seed)` -> {"seconds", "ref_s", "loss", "kl"}."""

  def __init__(self, w: dict, layout: str, row_len: int, model_cfg, splits: int = 1,
               fused_ref: bool = False):
    import jax
    from models import transformer
    from trainer import optim, state as state_lib
    from trainer.step import make_score_fn, make_train_step
    t0 = time.perf_counter()
    mb = micro_batches(w, layout, row_len, splits)
    self.pack_s = time.perf_counter() - t0
    from trainer.batches import describe
    self.describe = dict(describe(mb), row_len=int(mb.tokens.shape[2]),
                         rows_total=int(mb.tokens.shape[1]))
    self.mb = jax.device_put(mb)
    opt = optim.build(optimizer_config(), model_cfg)
    self.state = state_lib.create(model_cfg, opt, seed=0)
    self.ref = state_lib.split_model(transformer.init(model_cfg, seed=0))
    self.score = make_score_fn(model_cfg)
    self.step = make_train_step(model_cfg, loss_config(), opt)
    self.fused_ref = fused_ref
    t0 = time.perf_counter()
    first = self.run(0)
    self.ready = {"ready": True, "compile_s": round(time.perf_counter() - t0, 2),
                  "first_loss": first["loss"]}

  def run(self, seed: int) -> dict:
    import jax
    del seed
    t, c = time.perf_counter(), time.process_time()
    if self.fused_ref:  # the reference scored inside the train step's program
      t_ref = None
      self.state, metrics = self.step(self.state, self.mb, ref=self.ref)
    else:
      ref = jax.block_until_ready(self.score(self.ref, self.mb))
      t_ref = time.perf_counter() - t
      self.state, metrics = self.step(self.state, self.mb.with_fields(ref_logprobs=ref))
    loss = float(metrics["loss"])
    return {"seconds": time.perf_counter() - t, "cpu_s": time.process_time() - c,
            "ref_s": t_ref, "loss": loss, "kl": float(metrics["kl"])}


# ----------------------------------------------------------------------------- torch


def torch_worker(path: str, keep: bool) -> None:
  """transformers + torch GRPO step; benchmarks/generate.py's worker protocol."""
  import copy

  import torch
  from transformers import AutoModelForCausalLM, Qwen3Config
  torch.set_num_threads(2)
  torch.manual_seed(0)
  w = np.load(path)
  config = Qwen3Config(vocab_size=int(w["vocab"]), hidden_size=256, intermediate_size=1024,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, rope_theta=1e6, max_position_embeddings=512,
                       tie_word_embeddings=False, eos_token_id=None, bos_token_id=None)
  model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
  ref = copy.deepcopy(model).eval().requires_grad_(False)
  opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
  prompts = torch.from_numpy(np.repeat(w["prompts"], int(w["group_size"]), 0)).long()
  completions = torch.from_numpy(w["completions"]).long()
  ids = torch.cat([prompts, completions], 1)
  adv = torch.from_numpy(w["advantages"]).float()[:, None]
  n = completions.shape[1]

  def logprobs(m):
    logits = m(ids, logits_to_keep=n + 1 if keep else 0).logits[:, -n - 1:-1].float()
    return logits.gather(-1, completions[..., None])[..., 0] - torch.logsumexp(logits, -1)

  def run(seed):
    del seed
    t, c = time.perf_counter(), time.process_time()
    with torch.no_grad():
      ref_lp = logprobs(ref)
    t_ref = time.perf_counter() - t
    lp = logprobs(model)
    ratio = torch.exp(lp - lp.detach())
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - EPSILON, 1 + EPSILON))
    d = ref_lp - lp
    kl = torch.exp(d) - d - 1
    loss = (pg + BETA * kl).mean(-1).mean()  # sequence-mean-token-mean
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    return {"seconds": time.perf_counter() - t, "cpu_s": time.process_time() - c,
            "ref_s": t_ref, "loss": loss.item(), "kl": kl.mean().item()}

  t0 = time.perf_counter()
  first = run(0)
  print(json.dumps({"ready": True, "compile_s": round(time.perf_counter() - t0, 2),
                    "first_loss": first["loss"]}), flush=True)
  for line in sys.stdin:
    cmd = line.split()
    if not cmd or cmd[0] == "quit":
      break
    print(json.dumps(run(int(cmd[1]))), flush=True)


# ----------------------------------------------------------------------------- step part


def step_part(repeats: int, sides) -> dict:
  w = workload(0)
  workers, runs, ready, arbor = {}, {s: [] for s in sides}, {}, {}
  tmp = tempfile.mkdtemp(prefix="rl_step_")
  path = os.path.join(tmp, "workload.npz")
  np.savez(path, **w)
  load = [round(os.getloadavg()[0], 2)]
  try:
    if "tunix" in sides:
      generate.setup_tunix()
      workers["tunix"] = generate.Worker("tunix", [
          os.path.join(generate.TUNIX_VENV, "bin", "python"),
          os.path.join(generate.ROOT, "benchmarks", "rl_step_tunix.py"), path])
    for role in ("torch", "torch_keep"):
      if role in sides:
        workers[role] = generate.Worker(role, [sys.executable, "-m", "benchmarks.rl_step",
                                               f"--role={role}", f"--workload={path}"])
    for s, layout, row_len, impl in (
        ("arbor_tree", "tree", FLAGS.tree_row_len, FLAGS.tree_attention_impl),
        ("arbor_linear", "linear", 0, FLAGS.linear_attention_impl)):
      if s in sides:
        arbor[s] = ArborStep(w, layout, row_len, generate.qwen3_like().replace(
            attention_impl=impl, scan_layers=FLAGS.scan_layers), fused_ref=FLAGS.fused_ref)
    ready = {**{k: v.ready for k, v in arbor.items()}, **{k: v.ready for k, v in workers.items()}}
    for r in range(repeats):
      for s in sides:
        runs[s].append((arbor.get(s) or workers[s]).run(r + 1))
      load.append(round(os.getloadavg()[0], 2))
      print(json.dumps({s: round(LINEAR_TOKENS / v[-1]["seconds"]) for s, v in runs.items()}),
            file=sys.stderr, flush=True)
  finally:
    for wk in workers.values():
      wk.close()
    shutil.rmtree(tmp, ignore_errors=True)
  med = {s: statistics.median(x["seconds"] for x in v) for s, v in runs.items()}
  tps = {s: LINEAR_TOKENS / t for s, t in med.items()}
  result = {f"{s}_tokens_per_s": round(v, 1) for s, v in tps.items()}
  result.update({
      "step_s": {s: round(t, 4) for s, t in med.items()},
      "ref_s": {s: None if v[0]["ref_s"] is None else  # None: scored inside the train step
                round(statistics.median(x["ref_s"] for x in v), 4) for s, v in runs.items()},
      "cpu_s": {s: round(statistics.median(x["cpu_s"] for x in v), 4) for s, v in runs.items()},
      "runs_tokens_per_s": {s: [round(LINEAR_TOKENS / x["seconds"], 1) for x in v]
                            for s, v in runs.items()},
      "loss": {s: [x["loss"] for x in v] for s, v in runs.items()},
      "kl": {s: [x["kl"] for x in v] for s, v in runs.items()},
      "first_loss": {s: round(v["first_loss"], 6) for s, v in ready.items()},
      "expected_first_loss": round(-float(np.mean(w["advantages"])), 6),
      "compile_s": {s: v["compile_s"] for s, v in ready.items()},
      "linearized_tokens": LINEAR_TOKENS,
      "scan_layers": FLAGS.scan_layers,
      "fused_ref": FLAGS.fused_ref,
      "attention": {"arbor_tree": FLAGS.tree_attention_impl,
                    "arbor_linear": FLAGS.linear_attention_impl},
      "load_avg_1min": load,
  })
  for s, a in arbor.items():
    result.setdefault("arbor_batches", {})[s] = dict(a.describe, pack_s=round(a.pack_s, 4))
  ratios = {"tree_vs_tunix": ("arbor_tree", "tunix"), "linear_vs_torch": ("arbor_linear", "torch"),
            "linear_vs_torch_keep": ("arbor_linear", "torch_keep"),
            "tree_vs_linear": ("arbor_tree", "arbor_linear"),
            "tree_vs_torch": ("arbor_tree", "torch"), "linear_vs_tunix": ("arbor_linear", "tunix")}
  for name, (a, b) in ratios.items():
    if a in tps and b in tps:
      result[name] = round(tps[a] / tps[b], 3)
  if "tree_vs_tunix" in result:
    result["goal_tree_vs_tunix_4x"] = result["tree_vs_tunix"] >= 4.0
  if "linear_vs_torch" in result:
    result["goal_linear_vs_torch_1x"] = result["linear_vs_torch"] >= 1.0
  if "arbor_tree" in arbor and "arbor_linear" in arbor:  # the tree contract, step after step
    for a, b in zip(runs["arbor_tree"], runs["arbor_linear"]):
      assert abs(a["loss"] - b["loss"]) <= 1e-6 + 1e-4 * abs(b["loss"]), (a, b)
  return result


# ----------------------------------------------------------------------------- demo part


class DemoPipeline:
  """One RL step on the demo model: generate, score_ref, pack, train, sync."""

  PHASES = ("generate", "score_ref", "pack", "train", "sync")

  def __init__(self, layout: str, prompts: int, prompt_len: int = PROMPT,
               new: int = COMPLETION, attention_impl: str = ""):
    import configs.sft_demo
    from models import transformer
    from models.engine import Engine, EngineConfig
    from trainer import config as config_lib, optim, state as state_lib
    from trainer.step import make_score_fn, make_train_step
    self.cfg = config_lib.model_config(configs.sft_demo.get_config())
    if attention_impl and attention_impl != "config":
      self.cfg = self.cfg.replace(attention_impl=attention_impl)
    self.layout, self.prompts, self.prompt_len, self.new = layout, prompts, prompt_len, new
    opt = optim.build(optimizer_config(), self.cfg)
    self.state = state_lib.create(self.cfg, opt, seed=0)
    self.ref = state_lib.split_model(transformer.init(self.cfg, seed=0))
    self.engine = Engine(self.state.model(self.cfg), EngineConfig(
        slots=prompts * G, max_seq_len=prompt_len + new, prefix_cache_rows=0,
        prefill_chunk=prompt_len, prefill_bucket=64, steps_per_call=new))
    self.score = make_score_fn(self.cfg)
    self.step = make_train_step(self.cfg, loss_config(), opt)
    self.version = 0
    t0 = time.perf_counter()
    self.run(0)
    self.compile_s = round(time.perf_counter() - t0, 2)

  def run(self, seed: int) -> dict:
    import jax
    from flax import nnx
    from models import transformer
    from envs.policy import SamplingParams
    from rl.advantages import grpo
    from rl.tree import CallTokens, TrajectoryTokens
    from trainer.batches import BatchShape, make_micro_batches
    vocab = self.cfg.vocab_size
    rng = np.random.default_rng(1000 + seed)
    prompts = rng.integers(1, vocab, (self.prompts, self.prompt_len)).tolist()
    t, times = time.perf_counter(), {}

    def lap(name):
      nonlocal t
      now = time.perf_counter()
      times[name], t = now - t, now

    inputs = [p for p in prompts for _ in range(G)]
    outs = self.engine.generate(inputs, [SamplingParams(max_tokens=self.new, temperature=1.0,
                                                        seed=seed * 100_000 + i)
                                         for i in range(len(inputs))])
    lap("generate")
    rewards = rng.integers(0, 2, len(inputs)).astype(np.float32)
    adv = np.asarray(grpo(rewards, np.repeat(np.arange(self.prompts), G)))
    trajs = [TrajectoryTokens([CallTokens(x, o.output_ids, {"logprobs": o.logprobs})])
             for x, o in zip(inputs, outs)]
    n_seq = len(trajs)
    if self.layout == "tree":
      gs = [trajs[i * G:(i + 1) * G] for i in range(self.prompts)]
      shape = BatchShape(row_len=-(-(self.prompt_len + G * self.new) // 128) * 128,
                         rows=self.prompts, seqs=n_seq, seq_len=self.new, micro_batches=1)
    else:
      gs = [[x] for x in trajs]
      shape = BatchShape(row_len=-(-(self.prompt_len + self.new) // 128) * 128, rows=n_seq,
                         seqs=n_seq, seq_len=self.new, micro_batches=1)
    mb = jax.device_put(make_micro_batches(gs, shape).with_scalars(advantage=adv))
    lap("pack")
    ref = jax.block_until_ready(self.score(self.ref, mb))
    lap("score_ref")
    self.state, metrics = self.step(self.state, mb.with_fields(ref_logprobs=ref))
    loss = float(metrics["loss"])
    lap("train")
    self.version += 1
    model = transformer.unstack(self.state.model(self.cfg))  # the engine's layout
    jax.block_until_ready(nnx.state(model))
    self.engine.update_params(model, self.version)
    lap("sync")
    tokens = sum(len(x) + len(o.output_ids) for x, o in zip(inputs, outs))
    return {"phases": times, "seconds": sum(times.values()), "tokens": tokens,
            "new_tokens": sum(len(o.output_ids) for o in outs), "loss": loss,
            "mismatch_kl_k3": float(metrics.get("mismatch_kl_k3", float("nan")))}


def demo_part(repeats: int, prompts: int, attention_impl: str = "") -> dict:
  pipes = {layout: DemoPipeline(layout, prompts, attention_impl=attention_impl)
           for layout in ("tree", "linear")}
  runs = {k: [] for k in pipes}
  load = [round(os.getloadavg()[0], 2)]
  for r in range(repeats):
    for k, p in pipes.items():
      runs[k].append(p.run(r + 1))
    load.append(round(os.getloadavg()[0], 2))
    print(json.dumps({k: round(v[-1]["seconds"], 3) for k, v in runs.items()}), file=sys.stderr,
          flush=True)
  out = {"prompts": prompts, "group": G, "prompt_len": PROMPT, "new_tokens": COMPLETION,
         "attention_impl": pipes["tree"].cfg.attention_impl, "load_avg_1min": load,
         "model": f"hidden {pipes['tree'].cfg.hidden_size}, vocab {pipes['tree'].cfg.vocab_size}"}
  for k, v in runs.items():
    med = {ph: round(statistics.median(x["phases"][ph] for x in v), 4)
           for ph in DemoPipeline.PHASES}
    total = statistics.median(x["seconds"] for x in v)
    train = med["score_ref"] + med["train"]
    tokens = v[0]["tokens"]
    out[k] = {"phases_s": med, "step_s": round(total, 4), "tokens": tokens,
              "tokens_per_s": round(tokens / total, 1),
              "train_tokens_per_s": round(tokens / train, 1),
              "compile_s": pipes[k].compile_s, "loss": [round(x["loss"], 6) for x in v],
              "mismatch_kl_k3": [x["mismatch_kl_k3"] for x in v]}
  out["tree_vs_linear_step"] = round(out["linear"]["step_s"] / out["tree"]["step_s"], 3)
  out["tree_vs_linear_train"] = round(
      (out["linear"]["phases_s"]["score_ref"] + out["linear"]["phases_s"]["train"]) /
      (out["tree"]["phases_s"]["score_ref"] + out["tree"]["phases_s"]["train"]), 3)
  return out


# ----------------------------------------------------------------------------- main


SIDE_TEXT = {
    "arbor_tree": "Arbor, tree-packed (2 trees of 704 nodes, rows of {row}, `{tree_impl}`{layers})",
    "arbor_linear": "Arbor, linearized (16 rows of 256, `{linear_impl}`{layers})",
    "tunix": "tunix 0.1.7 GRPO step (its model returns all 4,096 positions' logits)",
    "torch": "transformers {transformers} + torch {torch} (full-sequence logits)",
    "torch_keep": "transformers + torch, `logits_to_keep=65`",
}

from benchmarks.rl_step_notes import NOTES  # noqa: E402 (profiling notes, static text)


def markdown(r: dict) -> str:
  """The rl_step section of docs/benchmarks.md (NOTES are static: a profile by hand)."""
  lines = ["## rl_step: one RL step, tree-packed vs linearized, against tunix and torch", ""]
  if "step_s" in r:
    lo, hi = min(r["load_avg_1min"]), max(r["load_avg_1min"])
    lines += [
        f"{r['date']}, {r['machine']}, jax {r['jax']}. GRPO train step on the reference "
        "workload: Qwen3-like model (vocab 2048, hidden 256, 4 layers, 4 heads, 2 KV heads, "
        "head_dim 64, MLP 1024, fp32, random weights), 2 prompts × 8 samples, each 192 prompt "
        "+ 64 sampled tokens (random ids, fixed seed), random 0/1 rewards, GRPO advantages. "
        "One step = the reference model's forward (log-probs for the KL) + policy forward + "
        "backward + clip to global norm 1.0 + AdamW (lr 1e-6, betas 0.9/0.99, weight decay "
        "0.1), the same loss on every side: clipped ratio ε = 0.2 (on-policy), k3 KL to the "
        "reference with β = 0.04, sequence-mean-token-mean. tokens/s = 16 × 256 = 4,096 "
        "linearized tokens / step time on every side. One warm-up (compiling) step each, then "
        f"{r['repeats']} interleaved rounds; medians. Each non-Arbor side is its own process "
        "(tunix in its own venv, torch with 2 threads). 1-minute load average during the run: "
        f"{lo}–{hi} (2 cores)."
        + (" Arbor scores the reference inside its train step's program (`step(state, mb, "
           "ref=...)`, per micro-batch)." if r.get("fused_ref") else ""), "",
        "| side | step s | ref forward s | CPU s | tokens/s | runs (tokens/s) | warm-up s |",
        "|---|---|---|---|---|---|---|"]
    fmt = dict(row=r["arbor_batches"].get("arbor_tree", {}).get("row_len", "-"),
               tree_impl=r["attention"]["arbor_tree"], linear_impl=r["attention"]["arbor_linear"],
               transformers=r["transformers"], torch=r.get("torch", "?"),
               layers="" if r["scan_layers"] else ", layer loop")
    for s, t in r["step_s"].items():
      runs = ", ".join(f"{x:,.0f}" for x in r["runs_tokens_per_s"][s])
      ref = "in step" if r["ref_s"][s] is None else f"{r['ref_s'][s]:.3f}"
      lines.append(f"| {SIDE_TEXT[s].format(**fmt)} | {t:.3f} | {ref} | "
                   f"{r['cpu_s'][s]:.2f} | **{r[s + '_tokens_per_s']:,.0f}** | {runs} | "
                   f"{r['compile_s'][s]} |")
    goal = lambda x, g: f"{x:.2f}× (goal ≥ {g}: {'met' if x >= g else 'not met'})"
    lines += [""]
    parts = []
    if "tree_vs_tunix" in r:
      parts.append(f"tree-packed / tunix **{goal(r['tree_vs_tunix'], 4)}**")
    if "linear_vs_torch" in r:
      parts.append(f"linearized / torch **{goal(r['linear_vs_torch'], 1.0)}**")
    for k, text in (("linear_vs_torch_keep", "linearized / torch with logits_to_keep"),
                    ("tree_vs_linear", "tree / linearized"), ("linear_vs_tunix",
                                                               "linearized / tunix")):
      if k in r:
        parts.append(f"{text} {r[k]:.2f}×")
    lines += ["Ratios of tokens/s: " + "; ".join(parts) + ".", ""]
    if "arbor_tree" in r["first_loss"] and "arbor_linear" in r["first_loss"]:
      last = {s: r["loss"][s][-1] for s in r["loss"]}
      lines += ["Check: tree-packed and linearized losses agree step after step (asserted; "
                f"last round {last['arbor_tree']:.4g} vs {last['arbor_linear']:.4g}). The first "
                "step's loss is -mean(A) = 0 on every side (on-policy ratio 1, KL 0); after "
                "it only the KL term moves it: every side's KL grows from 0 as its policy "
                "leaves its reference (per-round losses and KLs are in the JSON).", ""]
  for d in r.get("demo", []):
    lines += [
        f"**One RL step on the demo model** (configs/sft_demo.py: tiny MoE + MLA, "
        f"{d['model']}; "
        f"attention `{d['attention_impl']}`), no sandboxes: {d['prompts']} prompts × G = "
        f"{d['group']} samples of {d['new_tokens']} tokens after {d['prompt_len']} random "
        "prompt tokens (`Engine.generate`, temperature 1), random 0/1 rewards, GRPO "
        "advantages, reference log-probs, pack, train step (same loss and optimizer as "
        "above), `engine.update_params`. The tree and the linearized pipeline (own engine, "
        f"own state, same prompts and seeds) alternate for {r['repeats']} rounds after a "
        "compiling one; medians in seconds. tokens/s = "
        f"{d['tree']['tokens']:,} prompt+sampled tokens / step; train tokens/s counts "
        "score_ref + train.", "",
        "| layout | generate | score_ref | pack | train | sync | step | tokens/s | "
        "train tokens/s |", "|---|---|---|---|---|---|---|---|---|"]
    for k in ("tree", "linear"):
      p = d[k]["phases_s"]
      lines.append(f"| {k} | {p['generate']:.3f} | {p['score_ref']:.3f} | {p['pack']:.3f} | "
                   f"{p['train']:.3f} | {p['sync']:.3f} | {d[k]['step_s']:.3f} | "
                   f"{d[k]['tokens_per_s']:,.0f} | {d[k]['train_tokens_per_s']:,.0f} |")
    lines += ["", f"Tree / linearized: whole step {d['tree_vs_linear_step']:.2f}×, score_ref + "
              f"train {d['tree_vs_linear_train']:.2f}×.", ""]
  lines += [NOTES, "```", "bash benchmarks/setup_tunix.sh   # once: the tunix virtualenv",
            f"python -m benchmarks.rl_step --update_docs --repeats={r['repeats']}", "```"]
  return "\n".join(lines)


def main(argv) -> None:
  del argv
  if FLAGS.role:
    torch_worker(FLAGS.workload, keep=FLAGS.role == "torch_keep")
    return
  from benchmarks.common import machine, today
  import jax
  import torch
  import transformers
  result = {"date": today(), "machine": machine(), "repeats": FLAGS.repeats,
            "jax": jax.__version__, "transformers": transformers.__version__,
            "torch": torch.__version__.split("+")[0]}
  if FLAGS.part in ("all", "step"):
    sides = [s for s in SIDES if s in FLAGS.sides]
    result.update(step_part(FLAGS.repeats, sides))
  if FLAGS.part in ("all", "demo"):
    result["demo"] = [demo_part(FLAGS.repeats, FLAGS.demo_prompts, impl)
                      for impl in FLAGS.demo_attention_impls]
  print(json.dumps(result))
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(result, f, indent=2)
  if FLAGS.update_docs:
    from benchmarks import check, history
    from benchmarks.common import write_section
    write_section("rl_step", markdown(result))
    if FLAGS.part in ("all", "step"):  # the headline figures join their history
      history.record("rl_step", check.rl_step_figures(result), better=check.RL_STEP_FIGURES)


if __name__ == "__main__":
  app.run(main)
