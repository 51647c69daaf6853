"""Model smoke run: build a tiny MoE + MLA model, one forward/backward, a short greedy decode.

    python -m trainer.main --config=configs/smoke.py --workdir=/tmp/arbor_smoke
    python -m trainer.main --config=configs/smoke.py:tiny-dense --config.decode_tokens=16
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.mode = "smoke"  # trainer.main mode (other modes start from configs.base.base_config)
  config.seed = 0  # initialisation and sampling seed
  config.model = ml_collections.ConfigDict()
  config.model.preset = arg or "tiny-moe-mla"  # models/presets.py name (`:ARG` picks another)
  config.model.overrides = ml_collections.ConfigDict()  # ModelConfig fields to change, e.g. dtype
  config.batch = 2  # rows in the forward/backward batch
  config.seq = 64  # tokens per row
  config.decode_tokens = 8  # greedy tokens decoded after the step
  return config
