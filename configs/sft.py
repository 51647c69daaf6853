"""SFT template for imported Hugging Face models, on your JSONL / Parquet / msgpack files.

    python -m trainer.main --config=configs/sft.py:qwen2.5-coder \\
        --config.model.init=hf:/ckpt/Qwen2.5-Coder-7B-Instruct \\
        --config.data.sources="('/data/train.jsonl',)" \\
        --config.data.eval_sources="('/data/heldout.jsonl',)" \\
        --config.metrics.dir=/tmp/sft7b_metrics --workdir=gs://BUCKET/runs/sft7b

ARG picks the family (default qwen2.5-coder):
  qwen2.5-coder  Qwen2.5-Coder-{0.5,1.5,7,14,32}B(-Instruct): dense GQA, "qwen2.5" chat format
  qwen3          Qwen3-{0.6..32}B and Qwen3-30B-A3B: GQA with q/k norm, "chatml" chat format
  deepseek-v3    DeepSeek-V3 / Kimi-K2 / Moonlight (MLA + MoE): "deepseek_v3" chat format
The architecture comes from the checkpoint's config.json (`model.preset` stays ""), and so does
the tokenizer (tokenizer.json in the same directory) unless `tokenizer.path` is set. The data:
chat records {"messages", "tools"?, "group"?, "branches"?} or recorded trajectories
(trainer/sft_data.py); a failed tool call stays in context out of the loss (error-masked SFT).
The paths below are placeholders: the run refuses to start until they point at real files.
Sizes are for a TPU slice (bf16 compute, full remat); on a small machine lower data.row_len and
data.rows_per_batch (a multiple of mesh data x fsdp x expert).
"""

import ml_collections

from configs import base
from configs.base import FAMILIES  # family -> (chat format, example checkpoint)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = base.for_family(arg, "sft")  # model, tokenizer and mesh of the HF family (configs/base.py)
  c.optimizer.name = "adamw"  # these families were pre-trained with AdamW (Kimi/Moonlight: muon)
  c.optimizer.learning_rate = 1e-5  # peak learning rate for full fine-tuning
  c.optimizer.warmup_steps = 100  # linear warmup
  c.optimizer.schedule = "cosine"  # to end_lr_ratio x peak at train.steps
  c.optimizer.weight_decay = 0.1  # decoupled weight decay
  c.optimizer.state_dtype = "float32"  # "bfloat16" halves the optimizer memory
  c.data.sources = ("/path/to/train.jsonl",)  # training files (placeholder)
  c.data.eval_sources = ("/path/to/heldout.jsonl",)  # held-out files (placeholder)
  c.data.row_len = 16384  # tokens per packed row: the longest LLM call must fit
  c.data.rows_per_batch = 8  # rows per micro-batch (a multiple of mesh data x fsdp x expert)
  c.data.microbatches = 4  # micro-batches summed per step: 4 x 8 x 16k tokens per update
  c.data.max_seqs = 64  # trajectories per micro-batch at most
  c.data.seq_len = 8192  # trained tokens per trajectory at most
  c.data.num_epochs = 2  # passes over the data (the run also stops at train.steps)
  c.data.group_by = "system"  # records sharing the agent prompt and tools share one tree
  c.data.max_group_size = 8  # records per tree
  c.data.num_threads = 8  # rendering threads per host
  c.train.steps = 2000  # optimizer steps
  c.train.eval_every = 200  # held-out loss interval
  c.train.eval_batches = 16  # held-out batches per eval
  c.train.checkpoint_every = 200  # checkpoint interval (and on SIGTERM: TPU preemption)
  c.train.log_every = 10  # log line interval
  c.checkpoint.keep = 3  # checkpoints kept
  c.metrics.dir = ""  # local metrics directory; "" = <workdir>/sft (set it for a gs:// workdir)
  return c
