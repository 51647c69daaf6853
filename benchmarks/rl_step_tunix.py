"""Benchmark worker: google/tunix's GRPO train step on the rl_step workload.

    build/tunix-venv/bin/python benchmarks/rl_step_tunix.py WORKLOAD.npz

Runs in the separate venv made by benchmarks/setup_tunix.sh (tunix pins its own jax/flax), so it
imports nothing from Arbor. The workload (prompt ids, completion ids, advantages) comes from the
.npz that benchmarks/rl_step.py writes. What one timed step runs is what tunix's GRPOLearner runs
per training step after the rollout (tunix 0.1.7, tunix/rl/grpo/grpo_learner.py):
  1. the reference forward: `common.compute_per_token_logps(ref graphdef, ref state, ...)`, what
     `RLCluster.get_ref_per_token_logps` calls (stop_gradient, full-sequence logits);
  2. the actor trainer's jitted train step (`rl.trainer.Trainer.jit_train_and_eval_step`, as
     `PeftTrainer.train` builds it, cache_nnx_graph=True): `nnx.value_and_grad` of the registered
     "grpo" policy loss (`algo_core.grpo_loss_fn`: policy forward, clipped ratio, KL, entropy),
     then `nnx.Optimizer.update` with optax clip_by_global_norm + AdamW.
Settings as on every side of the benchmark: β = 0.04 with the k3 estimator ("low_var_kl"),
ε = 0.2, sequence-mean-token-mean, on-policy (num_iterations = 1: the ratio's denominator is
stop_gradient(log π_θ)), AdamW lr 1e-6, betas (0.9, 0.99), eps 1e-8, weight decay 0.1, clip 1.0.

Protocol (one JSON object per line on stdout, benchmarks/generate.py's Worker):
  start -> {"ready": true, "compile_s": ...}
  stdin "run SEED" -> {"seconds": S, "cpu_s": C, "ref_s": R, "loss": L, "kl": K}
  stdin "quit" or EOF -> exit
"""

import json
import sys
import time

import jax
import numpy as np
import optax
from flax import nnx
from tunix.models.qwen3 import model as qwen3
from tunix.rl import algo_core  # noqa: F401  (registers the "grpo" policy loss)
from tunix.rl import common
from tunix.rl import function_registry
from tunix.rl import trainer as rl_trainer
from tunix.rl.grpo import grpo_learner
from tunix.sft import peft_trainer

PAD, EOS = 0, -1  # token ids are 1..vocab-1: nothing is padding, no EOS
LR, B1, B2, EPS, WD, CLIP, BETA, EPSILON = 1e-6, 0.9, 0.99, 1e-8, 0.1, 1.0, 0.04, 0.2


def main() -> None:
  w = np.load(sys.argv[1])
  vocab = int(w["vocab"])
  # The generate benchmark's Qwen3-like config (benchmarks/generate_tunix.py), fp32.
  cfg = qwen3.ModelConfig(num_layers=4, vocab_size=vocab, embed_dim=256, hidden_dim=1024,
                          num_heads=4, head_dim=64, num_kv_heads=2, rope_theta=1_000_000,
                          norm_eps=1e-6, use_tied_embedding=False)
  model = qwen3.Qwen3(cfg, rngs=nnx.Rngs(0))
  ref_graphdef, ref_state = nnx.split(qwen3.Qwen3(cfg, rngs=nnx.Rngs(0)))  # frozen copy

  algo = grpo_learner.GRPOConfig(num_generations=int(w["group_size"]), num_iterations=1,
                                 beta=BETA, epsilon=EPSILON, kl_loss_mode="low_var_kl",
                                 loss_agg_mode="sequence-mean-token-mean")
  algo.temperature = 1.0  # GRPOLearner copies the rollout temperature here
  policy_loss = function_registry.get_policy_loss_fn(algo.policy_loss_fn)
  optimizer = optax.chain(optax.clip_by_global_norm(CLIP),
                          optax.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD))
  trainer = rl_trainer.Trainer(model, optimizer,
                               peft_trainer.TrainingConfig(eval_every_n_steps=1000),
                               custom_checkpoint_metadata_fn=lambda: {})
  # exactly how GRPOLearner wires its loss into the actor trainer
  trainer.with_loss_fn(lambda model, train_example, algo_config: policy_loss(
      model, train_example, algo_config=algo, pad_id=PAD, eos_id=EOS), has_aux=True)
  trainer.with_gen_model_input_fn(lambda x: {"train_example": x, "algo_config": algo})
  train_step, _ = trainer.jit_train_and_eval_step(cache_nnx_graph=True)

  prompt_ids = jax.numpy.asarray(np.repeat(w["prompts"], w["group_size"], 0), jax.numpy.int32)
  completion_ids = jax.numpy.asarray(w["completions"], jax.numpy.int32)
  advantages = jax.numpy.asarray(w["advantages"], jax.numpy.float32)

  def run(seed):
    del seed  # the same batch every step (the policy moves, the reference stays)
    t, c = time.perf_counter(), time.process_time()
    ref = common.compute_per_token_logps(ref_graphdef, ref_state, prompt_tokens=prompt_ids,
                                         completion_tokens=completion_ids, pad_id=PAD,
                                         eos_id=EOS, stop_gradient=True, return_logits=False,
                                         temperature=1.0)
    ref = jax.block_until_ready(ref)
    t_ref = time.perf_counter() - t
    example = grpo_learner.TrainExample(
        prompt_ids=prompt_ids, prompt_mask=prompt_ids != PAD, completion_ids=completion_ids,
        completion_mask=completion_ids != PAD, ref_per_token_logps=ref, advantages=advantages,
        old_per_token_logps=None)
    loss, aux, _ = train_step(example)
    loss = float(jax.block_until_ready(loss))
    return {"seconds": time.perf_counter() - t, "cpu_s": time.process_time() - c,
            "ref_s": t_ref, "loss": loss,
            "kl": float(aux["kl"])}

  t0 = time.perf_counter()
  first = run(0)
  print(json.dumps({"ready": True, "compile_s": round(time.perf_counter() - t0, 2),
                    "first_loss": first["loss"]}), flush=True)
  for line in sys.stdin:
    cmd = line.split()
    if not cmd or cmd[0] == "quit":
      break
    print(json.dumps(run(int(cmd[1]))), flush=True)


if __name__ == "__main__":
  main()
