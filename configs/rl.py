"""RL template for imported Hugging Face models, on your task files (rewards from their tests).

    python -m trainer.main --config=configs/rl.py:qwen2.5-coder \\
        --config.model.init=ckpt:/ckpt/sft7b --config.tokenizer.path=/ckpt/Qwen2.5-Coder-7B \\
        --config.rl.tasks=/data/swe_tasks.jsonl --config.eval.tasks=/data/heldout_tasks.jsonl \\
        --config.rl.queue_url=redis://10.0.0.5:6379/0 \\
        --config.rl.queue_password_file=/secrets/redis.password \\
        --config.metrics.dir=/tmp/rl7b_metrics --workdir=gs://BUCKET/runs/rl7b
    # held-out pass@1 of the RL run's latest checkpoint (the eval section below):
    python -m trainer.main --config=configs/rl.py:qwen2.5-coder ...same flags... \\
        --config.mode=eval --workdir=gs://BUCKET/runs/rl7b

ARG picks the family (default qwen2.5-coder):
  qwen2.5-coder  Qwen2.5-Coder-{0.5,1.5,7,14,32}B(-Instruct): dense GQA, "qwen2.5" chat format
  qwen3          Qwen3-{0.6..32}B and Qwen3-30B-A3B: GQA with q/k norm, "chatml" chat format
  deepseek-v3    DeepSeek-V3 / Kimi-K2 / Moonlight (MLA + MoE): "deepseek_v3" chat format
Start from an SFT run (`ckpt:<its workdir>`, configs/sft.py; a local copy), a `python -m
models.hf import` directory (`ckpt:<dir>`) or the HF checkpoint itself (`hf:<dir>`); the
architecture comes from there (`model.preset` stays ""), and so does the tokenizer of an
hf:/import directory; from an SFT run's workdir set `tokenizer.path` to the HF checkpoint's.

One step (trainer/rl.py): `rl.prompts_per_step` tasks x `rl.group_size` react episodes in
sandboxes, rewards from the tasks' verifiers (envs.tasks: "swe" tasks run their FAIL_TO_PASS /
PASS_TO_PASS tests), group-normalised advantages, each group's LLM calls trained as one tree
with CISPO; async loop: the next step's rollouts sample while this one trains, at most one
policy version stale. Remote rollout workers for sandbox fleets: envs/rollout_worker.py and
launch/fleet.py, through the Redis queue `rl.queue_url`.
The /path/to/ values are placeholders: the run refuses to start until model.init and rl.tasks
point at real files (eval.tasks is read by mode "eval").
Sizes are for a TPU slice (bf16 compute, full remat, parameters sharded over all devices); on
a small machine lower rl.max_context_tokens, data.row_len and rl.concurrency.
"""

import ml_collections

from configs import base
from configs.base import FAMILIES  # family -> (chat format, example checkpoint)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = base.for_family(arg, "rl")  # model, tokenizer and mesh of the HF family (configs/base.py)

  c.optimizer.name = "adamw"  # these families were pre-trained with AdamW (Kimi/Moonlight: muon)
  c.optimizer.learning_rate = 1e-6  # peak learning rate: RL updates are small
  c.optimizer.warmup_steps = 10  # linear warmup
  c.optimizer.schedule = "constant"  # RL runs are open-ended: no decay
  c.optimizer.weight_decay = 0.01  # decoupled weight decay
  c.optimizer.grad_clip_norm = 1.0  # global gradient norm clip
  c.optimizer.state_dtype = "float32"  # "bfloat16" halves the optimizer memory

  c.loss.name = "cispo"  # MiniMax-M1: clipped IS weight, stop-gradient, every token trained
  c.loss.aggregation = "token_mean"  # CISPO's: a mean over all loss tokens of the step
  c.loss.eps_low = 1.0  # IS weight >= 1 - eps_low = 0 (no lower clip, as in the paper)
  c.loss.eps_high = 4.0  # IS weight <= 1 + eps_high = 5 (rl.losses.DEFAULTS["cispo"])
  c.loss.kl_coef = 0.0  # no KL-to-reference penalty (as DAPO / M1); > 0 adds it (k3, below)
  c.loss.kl_estimator = "k3"  # KL estimator used when kl_coef > 0
  c.loss.entropy_coef = 0.0  # no entropy bonus

  c.rl.loop = "async"  # rollouts of step s+1 sample while step s trains
  c.rl.max_staleness = 1  # a group more than 1 policy version behind is dropped
  c.rl.prompts_per_step = 32  # tasks (groups) per optimizer step
  c.rl.group_size = 16  # episodes per task (G): 512 episodes per step
  c.rl.epochs = 1  # one pass over each step's rollouts
  c.rl.minibatches = 1  # one optimizer update per pass (on-policy up to the async staleness)
  c.rl.advantage = "grpo"  # group-normalised advantages (reward - mean) / std
  # tree rollouts (ARPO / AEPO, envs.branching): "branching" samples each task's group as one
  # entropy-guided tree of group_size leaves (fields c.rl.branch.*); in-process rollouts only,
  # remote workers take --rollout branching. Pair it with c.rl.advantage = "treerl" (per-call
  # credit from the tree) and c.loss.name = "aepo" (c.loss.entropy_adv_coef: its α).
  c.rl.rollout = "independent"  # G independent episodes per task
  c.rl.drop_constant_groups = True  # all-pass / all-fail groups carry no signal
  c.rl.reference = "initial"  # the KL reference when loss.kl_coef > 0: the starting weights
  c.rl.recompute_old = True  # π_old scored by the trainer (one forward); the correction needs it
  c.rl.correction = "tis_token"  # token weight min(π_old/μ, 2): sampler mismatch and staleness
  c.rl.mcla_passes = 0  # no MCLA averaging of π_old
  c.rl.routing_replay = True  # MoE: train through the experts the sampler used (dense: no-op)
  # MLA in bf16: c.model.overrides.mla_absorbed_training = True makes the trainer attend in
  # latent space as the sampler does (same function; 3-4x the attention FLOPs, docs/numerics.md)
  c.rl.temperature = 1.0  # sampling temperature of the rollouts
  c.rl.top_p = 1.0  # no nucleus truncation (keeps the sampler's log-probs the policy's)
  c.rl.top_k = 0  # no top-k truncation
  c.rl.max_new_tokens = 4096  # tokens sampled per LLM call at most
  c.rl.max_turns = 50  # agent turns per episode
  c.rl.max_context_tokens = 32768  # one call's input + output at most
  c.rl.concurrency = 64  # episodes at once: engine slots (KV cache: 2 x 64 rows of 32k tokens)
  c.rl.sandbox = "bwrap"  # bubblewrap sandboxes on the host; a task's `rootfs` is its image
  # remote rollout workers (envs/rollout_worker.py on the launch/fleet.py VMs) sample from the
  # trainer's policy server and deliver groups through the Redis queue
  c.rl.rollout_workers = "queue"
  c.rl.queue_url = "redis://REDIS_HOST:6379/0"  # the fleet's Redis (placeholder)
  c.rl.queue_password_file = ""  # file holding the Redis password ("" = no AUTH)
  c.rl.tasks = "/path/to/train_tasks.jsonl"  # task JSONL, envs.tasks format (placeholder)

  c.data.row_len = 32768  # tokens per packed row: the longest LLM call must fit
  c.data.rows_per_batch = 8  # rows per micro-batch (a multiple of mesh data x fsdp x expert)
  c.train.steps = 500  # RL steps
  c.train.checkpoint_every = 10  # checkpoint interval (and on SIGTERM: TPU preemption)
  c.train.log_every = 1  # a log line per step
  c.checkpoint.keep = 3  # checkpoints kept
  c.metrics.dir = ""  # local metrics directory; "" = <workdir>/rl (set it for a gs:// workdir)

  c.eval.tasks = "/path/to/heldout_tasks.jsonl"  # held-out task JSONL (placeholder)
  c.eval.num_tasks = 500  # held-out tasks evaluated (the first N of the file)
  c.eval.k = 1  # pass@1
  c.eval.samples = 1  # one sample per task
  c.eval.selection = "none"  # no test-time selection
  c.eval.temperature = 0.0  # greedy
  c.eval.checkpoints = ()  # () = the workdir's latest checkpoint
  return c
