"""benchmarks/lora_sft.py: run configs, trainable-parameter counts, checkpoint sizes."""

import os

import pytest

from benchmarks import lora_sft
from configs import sft_demo


def _tiny_dense(rank: int, modules: str = "attention,mlp", qtype=None):
  cfg = sft_demo.get_config()
  cfg.model.init, cfg.model.preset = "random", "tiny-dense"
  cfg.model.overrides.vocab_size = 256
  cfg.model.lora.rank, cfg.model.lora.alpha = rank, 2.0 * rank
  cfg.model.lora.modules, cfg.model.lora.base_qtype = modules, qtype
  return cfg


@pytest.mark.parametrize("rank,modules,qtype", [(4, "attention,mlp", None),
                                                (8, "attention", None),
                                                (4, "attention,mlp", "int8")])
def test_trainable_params_counts_adapters(rank, modules, qtype):
  # tiny-dense: hidden 64, q 4x16, k/v 2x16, MLP 128, 2 layers. An adapter of a projection
  # [in, out] holds A [in, r] and B [r, out]: r (in + out) parameters.
  attention = (64 + 64) + (64 + 32) + (64 + 32) + (64 + 64)  # q, k, v, o
  mlp = 3 * (64 + 128)  # gate, up, down
  per_rank = attention + (mlp if "mlp" in modules else 0)
  assert lora_sft.trainable_params(_tiny_dense(rank, modules, qtype)) == 2 * rank * per_rank


def test_trainable_params_full_fine_tuning_exceeds_adapters():
  full = lora_sft.trainable_params(_tiny_dense(0))
  # Every weight: at least the embeddings (256 x 64) and the 7 projections of both layers.
  assert full >= 256 * 64 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128)


def test_run_config_sets_the_run_settings(tmp_path):
  base = sft_demo.get_config()
  full = lora_sft.run_config(base, str(tmp_path), "data.jsonl", 24,
                             lora_sft._spec("full", 0, 3e-3, "muon"))
  assert (full.model.lora.rank, full.optimizer.name, full.optimizer.learning_rate) == (
      0, "muon", 3e-3)
  assert full.train.steps == full.optimizer.total_steps == 24
  assert full.model.init == f"ckpt:{tmp_path}" and full.data.sources == ("data.jsonl",)
  q = lora_sft.run_config(base, str(tmp_path), "data.jsonl", 24,
                          lora_sft._spec("q", 8, 1e-2, "adamw", "int8"))
  assert (q.model.lora.rank, q.model.lora.alpha, q.model.lora.base_qtype) == (8, 16.0, "int8")
  assert (q.optimizer.name, q.optimizer.learning_rate) == ("adamw", 1e-2)
  assert q.model.lora.modules == "attention,mlp"
  e = lora_sft.run_config(base, str(tmp_path), "data.jsonl", 24,
                          dict(lora_sft._spec("e", 8, 1e-2, "muon"),
                               modules="attention,mlp,experts", experts="shared"))
  assert (e.model.lora.modules, e.model.lora.experts) == ("attention,mlp,experts", "shared")
  assert base.model.lora.rank == 0  # the base config is not changed


def test_checkpoint_bytes_of_the_latest_step(tmp_path):
  sizes = {"2/state/a": 100, "10/state/a": 7, "10/state/d/b": 30, "10/extra/m": 5}
  for rel, n in sizes.items():
    path = tmp_path / "checkpoints" / rel
    os.makedirs(path.parent, exist_ok=True)
    path.write_bytes(b"x" * n)
  # 10 is the latest step (numeric, not lexicographic order).
  assert lora_sft.checkpoint_bytes(str(tmp_path)) == (10, 7 + 30 + 5)
