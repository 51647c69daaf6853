"""LoRA's train step compiled for a TPU slice (trainer/aot.py) with the real XLA TPU compiler.

A tiny dense model's train step compiles for v5p with and without rank-4 adapters. The state's
bytes match the arithmetic of the config: full fine-tuning holds fp32 parameters and two fp32
AdamW moments per parameter; LoRA holds the moments of the adapters alone (rank x (in + out)
per adapted projection) and the frozen fp32 base beside them. The compiled update program
reads the smaller state, and the weight sync to a colocated engine moves the adapters alone.
"""

import jax
import pytest

from configs import sft_demo
from models import presets, sharding
from trainer import aot
from trainer import config as config_lib
from trainer import optim
from trainer import state as state_lib

RANK = 4
TOPOLOGY = "v5p:2x2x1"


def tiny_config(rank: int):
  c = sft_demo.get_config()
  c.model.preset = "tiny-dense"  # hidden 64, 2 layers, 4 heads / 2 KV heads of 16, MLP 128
  c.model.overrides.attention_impl = "pallas_tpu"
  c.model.overrides.dtype = "bfloat16"  # as TPU runs train
  c.optimizer.name = "adamw"
  c.data.rows_per_batch = 4  # a multiple of the 4 chips the batch is sharded over
  c.data.microbatches = 1
  if rank:
    c.model.lora.rank, c.model.lora.alpha, c.model.lora.modules = rank, 8.0, "attention,mlp"
  return c


def adapter_elements(cfg) -> int:
  """rank x (in + out) summed over the adapted projections of every layer (GQA + SwiGLU)."""
  h, q, kv, m = (cfg.hidden_size, cfg.num_heads * cfg.head_dim,
                 cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size)
  per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + m) + (m + h)
  return RANK * per_layer * cfg.num_layers


def state_nbytes(config) -> dict:
  _, devices = aot.topology_devices(TOPOLOGY)
  mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=len(devices)), devices)
  model_cfg = config_lib.model_config(config)
  state = state_lib.abstract(model_cfg, optim.build(config.optimizer, model_cfg), mesh)
  total = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
  return {"params": total(state.params), "model_state": total(state.model_state),
          "opt_state": total(state.opt_state), "per_chip_opt": aot.per_chip_bytes(state.opt_state)}


@pytest.fixture(scope="module")
def reports():
  # as a run compiles (conftest sets "highest" for the CPU references; Mosaic takes no fp32
  # contraction of bf16 operands)
  with jax.default_matmul_precision("default"):
    return {rank: aot.compile_run(tiny_config(rank), TOPOLOGY, ("train", "weight_sync"))
            for rank in (0, RANK)}


def test_lora_state_is_the_adapters_and_their_moments():
  full_cfg = config_lib.model_config(tiny_config(0))
  n = presets.count_params(full_cfg)
  full, lora = state_nbytes(tiny_config(0)), state_nbytes(tiny_config(RANK))
  slack = 64  # AdamW's step counters
  assert full["params"] == 4 * n and full["model_state"] == 0
  assert 8 * n <= full["opt_state"] <= 8 * n + slack
  a = adapter_elements(full_cfg)
  assert lora["params"] == 4 * a
  assert lora["model_state"] == 4 * n  # the frozen base in the parameter dtype
  assert 8 * a <= lora["opt_state"] <= 8 * a + slack
  assert lora["per_chip_opt"] < full["per_chip_opt"]


def test_lora_train_step_compiles_for_v5p_and_reads_less_state(reports):
  full, lora = reports[0], reports[RANK]
  for r in (full, lora):
    assert set(r["programs"]) == {"train/gradients", "train/update", "weight_sync"}
    assert r["train_peak_gb"]["fits"]
    assert {"tree_attention_fwd", "tree_attention_dkv"} <= set(
        r["programs"]["train/gradients"]["mosaic_kernels"])
  # the optimizer state resident beside the accumulation: AdamW's moments of every parameter
  # against the adapters' (GB per chip, rounded to 4 decimals: the adapters' round to 0)
  opt = lambda r: r["train_peak_gb"]["optimizer_state"]
  assert opt(lora) < opt(full)


def test_lora_weight_sync_moves_the_adapters_alone(reports):
  # the engine (one copy on every chip of fsdp 4) gets what the step trained: every fp32
  # parameter against, with LoRA, the fp32 adapters; the frozen base never moves
  n = presets.count_params(config_lib.model_config(tiny_config(0)))
  a = adapter_elements(config_lib.model_config(tiny_config(0)))
  full, lora = (reports[r]["programs"]["weight_sync"] for r in (0, RANK))
  assert lora["engine_bytes"] == 4 * a
  assert 2 * n < full["engine_bytes"] < 4 * n  # bf16 projections, fp32 embeddings and norms
  gathered = lambda p: sum(c["bytes"] for c in p["collectives"].values())
  assert gathered(lora) <= lora["engine_bytes"] < gathered(full) / 10
