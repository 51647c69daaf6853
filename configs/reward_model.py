"""A reward model on the demo's verified episodes (mode "reward_model", trainer/reward_model.py).

    python -m trainer.main --config=configs/reward_model.py --workdir=/tmp/arbor_rm
    # then in RL: --config.rl.reward_model.path=/tmp/arbor_rm (the same tokenizer as the policy:
    # --config.tokenizer.path=<the policy's tokenizer dir> --config.tokenizer.train_vocab_size=0)

Data: per generated bug-fixing task (envs.taskgen level 0, as the demo) the scripted solver's
episode that makes the fix and the noisy demonstrator's episode that submits without it
(trainer.demo_data), tools and tests in bwrap sandboxes; every label comes from the task's tests
(the verifier), which pass the first kind and fail the second. Pairs are (passed, failed) of a
task; held-out pairs come from taskgen "eval" programs, which no training task shares.

The model: a small dense Transformer from scratch with a scalar head (`model.init=ckpt:<SFT
workdir>` starts from a policy's trunk instead), on the demo's 2048-token sentencepiece
tokenizer trained here. Measured figures: benchmarks/reward_model.py, docs/benchmarks.md.
"""

import ml_collections

from configs.base import base_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  del arg
  c = base_config()
  c.mode = "reward_model"
  c.seed = 0
  c.model.init = "random"
  c.model.preset = "tiny-dense"  # 2 layers, hidden 64 (the demo policy's is tiny-moe-mla-x2)
  c.model.overrides.vocab_size = 2048  # = tokenizer.train_vocab_size
  c.model.overrides.attention_impl = "auto"  # CPU: blocked XLA attention for 1k-token rows
  c.tokenizer.train_vocab_size = 2048  # the demo's sentencepiece tokenizer, trained here
  c.tokenizer.chat_format = "chatml"  # as the demo
  c.data.demo.level = 0  # taskgen level of the tasks
  c.data.demo.seed = 0  # taskgen seed (the SFT demo's tasks; RL draws seed 1)
  c.data.demo.error_rate = 0.25  # episodes with a failed str_replace first (PRM label 0)
  c.data.demo.sandbox = "bwrap"  # tools and tests in bubblewrap sandboxes
  c.data.demo.environment = "bookworm-pytest"  # as the demo (or "": the host's python3)
  r = c.reward_model
  r.demo_tasks = 160  # training tasks: 320 episodes
  r.demo_eval_tasks = 80  # held-out tasks: 160 episodes
  r.pairwise_coef = 1.0  # Bradley-Terry on (passed, failed) pairs
  r.orm_coef = 1.0  # outcome BCE
  r.prm_coef = 0.5  # per-step BCE (a "prm" for rl.reward_model.kind)
  r.batch_pairs = 4  # 8 rows of ~1k tokens per step
  r.max_len = 1280  # a demo episode is 0.8-1.1k tokens
  r.learning_rate = 1e-3  # AdamW, constant
  c.train.steps = 200  # optimizer steps
  c.train.eval_every = 50  # held-out metrics every 50 steps (and at the end)
  c.train.checkpoint_every = 50  # checkpoints (resume points)
  c.train.log_every = 10  # a progress line every 10 steps
  c.metrics.tensorboard = False  # metrics.jsonl only
  c.metrics.report = False  # no report page
  return c
