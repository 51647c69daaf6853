"""SFT demo: a tiny MoE + MLA model learns scripted agentic-coding episodes (no downloads).

    python -m trainer.main --config=configs/sft_demo.py --workdir=/tmp/arbor_sft_demo
    python -m trainer.main --config=configs/sft_demo.py --config.train.steps=800 --workdir=...

What it does: trains a 2048-token sentencepiece tokenizer on the text of 512 scripted demo
episodes (taskgen "train" programs only); records 1024 training and 64 held-out episodes of a
scripted solver on generated bug-fixing tasks (envs.taskgen level 0; tool calls run in bwrap
sandboxes): list the functions with `search("def ")`, read the file the fix is in, str_replace
the few characters around the bug (`trainer.demo_data.minimal_edit`: `min` -> `max`, `!=` ->
`==`), submit. A quarter of the episodes carry a failed str_replace first, which error-masked
SFT keeps in context but out of the loss. Half of the episodes (`data.demo.early_submit_rate`)
come from a noisy demonstrator that submits right after reading the file, without the fix: no
tool fails, so SFT imitates it, and only the tests' reward tells the endings apart (the demo's
RL stage, configs/demo.py, learns from that). Then SFTs the model on trees of 4 episodes sharing
the agent prompt (~620 prompt tokens + ~260 per episode), with Muon, and writes the eval loss
on the held-out episodes and a report (sft/report.html).

Measured 2026-11-23 on a 2-core Xeon VM, this config (seed 0): 6.7 min for the SFT stage
(tokenizer and 1024 bwrap episodes ~30 s, 450 steps at ~0.8 s plus held-out evals; on the
2-core AMD EPYC VM of 2026-12-06: 12.7 min, ~1.4 s a step, and 0.040 / 0.110 for seeds 0 / 1
through `make demo`, see configs/demo.py); training
loss 7.6 -> 0.02, held-out loss 0.089 / 0.079 / 0.073 / 0.077 at steps 300 / 350 / 400 / 450
(plateaued). Greedy held-out pass@1 0.025 on the demo's 200 tasks: the model nearly always
submits unfixed after the read (half of its demonstrations do, and error masking keeps a
quarter of the other half's first str_replace out of the loss). At temperature 0.7 it edits
in 28% of the episodes (9/32 RL tasks) and passes 9%. Without the noisy episodes (same model,
step 300 of a 600-step run): greedy pass@1 0.55; what it then gets wrong is mostly an old_str
that is not in the file.
The model is `tiny-moe-mla-x2` (hidden 128). At hidden 64 (`tiny-moe-mla`, 600 steps, faithful
demonstrator) greedy pass@1 was 0.17: about half of the episodes read or edit a file other than
the one `search` listed (the model does not copy the path). Earlier, before the short edits,
every run was 0/48 held-out (the model learnt the format but did not copy the function name,
path and whole buggy line): the solver searching `def <name>` and replacing the whole line, with
a 1024- or 2048-token tokenizer, 256 or 1024 episodes, and a 4-layer hidden-192 model.
"""

import ml_collections

from configs.base import base_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  del arg
  c = base_config()
  c.mode = "sft"
  c.seed = 0
  c.model.init = "random"
  c.model.preset = "tiny-moe-mla-x2"  # 3 layers (1 dense + 2 MoE), MLA, hidden 128, 8+1 experts
  c.model.overrides.vocab_size = 2048  # = tokenizer.train_vocab_size
  c.model.overrides.attention_impl = "auto"  # CPU: blocked XLA attention for 2048-token rows
  c.tokenizer.train_vocab_size = 2048  # sentencepiece BPE trained on demo text, no download
  c.tokenizer.train_episodes = 512  # episodes of tokenizer training text
  c.tokenizer.chat_format = "chatml"  # ChatML turns, Hermes <tool_call> blocks
  c.data.demo.episodes = 1024  # training episodes (taskgen "train" programs, seed data.demo.seed)
  c.data.demo.eval_episodes = 64  # held-out episodes ("eval" programs: none shared with training)
  c.data.demo.level = 0  # taskgen level: one planted bug, small repositories
  c.data.demo.error_rate = 0.25  # episodes with a failed tool call first (error-masked)
  c.data.demo.early_submit_rate = 0.5  # noisy demonstrator: episodes that submit unfixed
  c.data.demo.environment = "bookworm-pytest"  # sandboxes: bookworm python3 + python3-pytest
  c.data.row_len = 2048  # a tree of 4 episodes (~1.7k tokens; one episode ~0.9k) fits a row
  c.data.rows_per_batch = 2  # rows per micro-batch
  c.data.max_seqs = 8  # trajectories per micro-batch at most
  c.data.seq_len = 512  # trained tokens per episode at most (the solver's turns: ~100-200)
  c.data.group_by = "system"  # episodes share the agent prompt and tools: one tree of up to 4
  c.data.max_group_size = 4  # episodes per tree
  c.optimizer.name = "muon"  # Muon on matrices, AdamW on embeddings / norms / router
  c.optimizer.learning_rate = 3e-3  # peak learning rate (tiny model, short run)
  c.optimizer.warmup_steps = 20  # linear warmup
  c.optimizer.schedule = "cosine"  # to end_lr_ratio x peak at train.steps
  c.optimizer.weight_decay = 0.0  # short run: no decay
  c.train.steps = 450  # the budget (6.7 min on the 2-core Xeon VM, 12.7 on the AMD one)
  c.train.eval_every = 50  # held-out loss every 50 steps (and at the end)
  c.train.checkpoint_every = 50  # checkpoints every 50 steps (and at the end, and on SIGTERM)
  c.train.log_every = 25  # log line interval
  return c
