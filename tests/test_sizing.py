"""benchmarks/sizing.py: docs/scaling.md shows exactly what the script computes, and the
script's arithmetic agrees with hand-computed values and with models.presets / launch.tpu."""

from __future__ import annotations

import pytest

from benchmarks import sizing
from launch import tpu
from models.presets import count_params, get_preset

MODELS = ("qwen2.5-coder-7b", "qwen2.5-coder-32b", "deepseek-v3")


def test_doc_block_equals_script_output():
  block = sizing.doc_block()
  assert block is not None, "docs/scaling.md lost its <!-- sizing:start/end --> markers"
  assert block == sizing.render(), (
      "docs/scaling.md is stale: run `python -m benchmarks.sizing --write`")


def test_parameter_counts_by_hand():
  # Qwen2.5-Coder-7B: embedding + lm_head, 28 x (q,o 3584^2; k,v 3584x512; q/k/v biases;
  # SwiGLU 3 x 3584 x 18944; two norms), final norm. The model card says 7.61B.
  per_layer = 2 * 3584 * 3584 + 2 * 3584 * 512 + (3584 + 2 * 512) + 3 * 3584 * 18944 + 2 * 3584
  assert 2 * 152064 * 3584 + 28 * per_layer + 3584 == 7_615_616_512
  # DeepSeek-V3: MLA (q_a 7168x1536 + norm, q_b 1536x128x192, kv_a 7168x576, norm 512,
  # kv_b 512x128x256, o 128x128x7168), 3 dense layers (18432), 58 MoE layers (router 7168x256,
  # 256 routed + 1 shared expert of 3 x 7168 x 2048). The model card's 671B (without MTP).
  attn = (7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256
          + 128 * 128 * 7168)
  moe = 7168 * 256 + 257 * 3 * 7168 * 2048
  total = 2 * 129280 * 7168 + 7168 + 61 * (attn + 2 * 7168) + 3 * 3 * 7168 * 18432 + 58 * moe
  assert total == 671_026_404_352
  expected = {"qwen2.5-coder-7b": 7_615_616_512, "qwen2.5-coder-32b": 32_763_876_352,
              "deepseek-v3": 671_026_404_352}
  for model in MODELS:
    cfg = get_preset(model)
    assert sizing.total_params(cfg) == count_params(cfg) == expected[model]


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "kimi-k2", "moonlight-16b-a3b", "qwen3-8b",
                                  "qwen2.5-coder-0.5b"])
def test_leaves_cover_every_parameter_of_other_presets(name):
  cfg = get_preset(name)
  assert sizing.total_params(cfg) == count_params(cfg)


def test_episode_tokens_by_hand():
  e = sizing.TOY
  assert e.tree_tokens == 2000 + 20 * 400 + 19 * 1000 == 29_000
  # call i (0-based) sees prompt + i x (400 + 1000) tokens and samples 400
  assert e.linear_tokens == 20 * 2000 + 1400 * sum(range(20)) + 20 * 400 == 314_000
  assert e.prefill_tokens == 2000 + 19 * 1000
  assert e.mean_call_context == 2000 + 1400 * 9.5


def test_memory_and_kv_by_hand():
  cfg = get_preset("qwen2.5-coder-7b")
  mesh = sizing.Mesh(fsdp=32, tensor=1, expert=1)
  mem = sizing.memory_per_chip(cfg, mesh, "full", "adamw")
  # Norm gains and q/k/v biases (heads -> tensor = 1) are not sharded over fsdp: whole on
  # every chip.
  whole = 3584 + 28 * 2 * 3584 + 28 * (3584 + 2 * 512)
  sharded = 7_615_616_512 - whole
  assert mem["params"] == pytest.approx((sharded / 32 + whole) * 4 / 1e9)
  assert mem["optimizer"] == pytest.approx(2 * mem["params"])  # AdamW: two fp32 moments
  assert mem["activations"] == pytest.approx(28 * 32768 * 3584 * 2 / 1e9)  # layer inputs, bf16
  muon = sizing.memory_per_chip(cfg, mesh, "full", "muon")["optimizer"]
  assert mem["params"] < muon < mem["optimizer"]  # one momentum for matrices, two elsewhere
  assert sizing.kv_bytes_per_token(cfg) == 2 * 4 * 128 * 2 * 28  # K+V, 4 kv heads, bf16
  ds = get_preset("deepseek-v3")
  assert sizing.kv_bytes_per_token(ds) == (512 + 64) * 2 * 61  # MLA latent + rotary key


def test_compute_matches_six_n_d():
  """Dense step compute is 2 x N x tokens per pass plus attention: within the 6ND rule's
  neighbourhood (attention and the sampled-only lm_head move it)."""
  cfg = get_preset("qwen2.5-coder-7b")
  chip, mesh = sizing.CHIPS["v5p"], sizing.Mesh(fsdp=32, tensor=1, expert=1)
  st = sizing.step_time(cfg, chip, mesh, "save_dots", "adamw")
  tokens = st["micro_batches"] * 32 * 32768
  six_nd = 6 * 7.6e9 * tokens / (32 * chip.peak_flops)
  assert 1.0 < st["micro_batches"] * st["compute"] / six_nd < 1.6


def test_slices_agree_with_launch_tpu_and_docs():
  assert (sizing.CHIPS["v5p"].peak_flops, sizing.CHIPS["v5p"].hbm_bw) == (459e12, 2765e9)
  assert (sizing.CHIPS["v6e"].peak_flops, sizing.CHIPS["v6e"].hbm_bw) == (918e12, 1640e9)
  for _, tpu_type in sizing.CASES:
    _, chips = sizing.slice_chips(tpu_type)
    assert tpu.parse_accelerator(tpu_type).chips == chips


def test_plans_fit_or_say_so():
  for model, tpu_type in sizing.CASES:
    p = sizing.plan(model, tpu_type)
    chip, _ = sizing.slice_chips(tpu_type)
    total = sum(p.memory.values())
    assert p.fits == (total <= sizing.HBM_USABLE * chip.hbm_bytes / 1e9)
    assert p.mesh.chips == p.chips
  assert not sizing.plan("deepseek-v3", "v6e-256").fits
  assert sizing.plan("deepseek-v3", "v5p-1024").fits
