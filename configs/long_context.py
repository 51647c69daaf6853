"""RL at 128K-token contexts: configs/rl.py with YaRN and rows of 131,072 tokens.

    python -m trainer.main --config=configs/long_context.py:qwen2.5-coder \\
        --config.model.init=hf:/ckpt/Qwen2.5-Coder-32B-Instruct ...the flags of configs/rl.py...

ARG picks the family, as configs/rl.py (default qwen2.5-coder). The Qwen checkpoints ship
without YaRN; their model cards extend them to 131,072 tokens with YaRN x4 over the 32,768
pre-training positions, which `model.overrides` applies here (the same fields as
`models.presets.QWEN_YARN_128K`, the `-128k` presets). DeepSeek-V3 and Kimi K2 carry YaRN in
their config.json, so the import already has it.

Each row holds one trajectory of up to 131,072 tokens and is split over `mesh.sequence` chips
(context parallelism): a chip holds 32,768 of the row's positions, as in the 32K plans of
docs/scaling.md ("Long contexts" has the compiled plans). The engine's slots hold 131,072-token
contexts, so fewer episodes run at once.
"""

import ml_collections

from configs import rl
from configs.base import FAMILIES  # family -> (chat format, example checkpoint)

# The Qwen model cards' `rope_scaling` for 128K: {"type": "yarn", "factor": 4.0,
# "original_max_position_embeddings": 32768} (models.presets.QWEN_YARN_128K).
QWEN_YARN_128K = dict(rope_type="yarn", rope_factor=4.0, rope_original_max_position=32768,
                      max_position_embeddings=131072)
ROW_LEN = 131072  # tokens per packed row (one trajectory)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  family = arg or "qwen2.5-coder"
  if family not in FAMILIES:
    raise ValueError(f"configs/long_context.py:{family}: expected one of {sorted(FAMILIES)}")
  c = rl.get_config(family)
  if family.startswith("qwen"):
    c.model.overrides.update(QWEN_YARN_128K)  # YaRN x4: 131,072 positions
  c.data.row_len = ROW_LEN  # one trajectory of up to 128K tokens per row
  c.mesh.sequence = 4  # context parallelism: each row split over 4 chips (32,768 tokens each)
  c.rl.max_context_tokens = ROW_LEN  # one call's input + output at most
  c.rl.concurrency = 16  # engine slots of 128K tokens (the KV cache of 64 rows of 32K)
  return c
