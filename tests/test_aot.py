"""Ahead-of-time compilation for TPU slices (trainer/aot.py) with the real XLA TPU compiler.

The tiny MoE + MLA model's train step (accumulation and update) and scoring pass compile in
bf16 for a v5p slice and, from the command line, the train step for a v6e slice, with the
Pallas TPU tree-attention kernel: the programs fit, the kernel is a Mosaic call per shard (not
the interpreter), and the report's numbers are consistent with what the compiler says; an RL
run's learned critic compiles beside the policy, each side's peak counting the other's state. The
layout search compiles one other layout of the tiny step (tests/test_aot_search.py covers the
search without compiling).
"""

import json
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import pytest

from configs import sft_demo
from trainer import aot
from trainer import aot_engine_search
from trainer import aot_search
from trainer.config import ConfigError


def tiny_config(**data):
  c = sft_demo.get_config()
  c.model.overrides.attention_impl = "pallas_tpu"
  c.model.overrides.dtype = "bfloat16"  # as TPU runs train
  c.data.rows_per_batch = 4  # a multiple of the 4 chips the batch is sharded over
  c.model.overrides.num_layers = 2  # one dense and one MoE layer
  c.data.row_len = 1024
  c.data.update(data)
  return c


@pytest.fixture(scope="module")
def v5p_report():
  # as a run compiles (conftest sets "highest" for the CPU references; Mosaic takes no fp32
  # contraction of bf16 operands)
  with jax.default_matmul_precision("default"):
    return aot.compile_run(tiny_config(), "v5p:2x2x1")


def test_tiny_steps_compile_for_v5p_with_the_mosaic_kernel(v5p_report):
  r = v5p_report
  assert r["chips"] == 4 and r["mesh"]["fsdp"] == 4
  assert set(r["programs"]) == {"train/gradients", "train/update", "score", "prefill", "decode",
                                "weight_sync"}
  for name, p in r["programs"].items():
    hbm = p["hbm_gb"]
    assert hbm["fits"] and 0 < hbm["total"] < hbm["capacity"] == 95.0, name
    parts = hbm["arguments"] + hbm["outputs"] + hbm["temporaries"] + hbm["code"]
    assert hbm["total"] == pytest.approx(parts - hbm["aliased"], abs=2e-3), name
    assert p["flops"] > 0 and p["bytes_accessed"] > 0
    roof = p["roofline_s"]
    assert roof["step"] == max(roof["compute"], roof["hbm"], roof["ici"]) > 0
    assert p["collectives"], name  # parameters are sharded over fsdp: gathers at least
  # the tree-attention kernel is a Mosaic call (per shard, inside shard_map), forward and
  # backward: not the interpreter, which would show as loops and no call
  kernels = r["programs"]["train/gradients"]["mosaic_kernels"]
  assert {"tree_attention_fwd", "tree_attention_dq", "tree_attention_dkv"} <= set(kernels)
  assert set(r["programs"]["score"]["mosaic_kernels"]) >= {"tree_attention_fwd"}
  assert "tree_attention_dq" not in r["programs"]["score"]["mosaic_kernels"]
  assert not r["programs"]["train/update"]["mosaic_kernels"]
  # the accumulation does 3 passes of 2 N T FLOPs, the scoring pass 1: the compiled FLOPs
  # include the attention and the lm_head, and so exceed the matmul estimate
  grads, score = r["programs"]["train/gradients"], r["programs"]["score"]
  assert grads["flops"] > score["flops"]
  assert 0 < grads["mfu"] <= 1 and 0 < score["mfu"] <= 1
  # the step's peak: the accumulation with the optimizer state resident beside it
  peak, grads_hbm = r["train_peak_gb"], r["programs"]["train/gradients"]["hbm_gb"]
  assert peak["fits"] and peak["optimizer_state"] > 0
  assert peak["total"] >= grads_hbm["total"] + 0.99 * peak["optimizer_state"] - 1e-3
  assert peak["total"] + peak["headroom"] == pytest.approx(95.0, abs=2e-3)
  # the engine's calls: at least the weights and the cache are read (the floor); the HBM
  # traffic per step (decode: a loop iteration plus the code around it over the call's steps)
  # is above it and below XLA's count, which adds the VMEM staging
  for name in ("prefill", "decode"):
    p = r["programs"][name]
    hbm = p["hbm_bytes"]
    steps = 16 if name == "decode" else 1  # the engine's steps_per_call
    assert p["steps"] == steps and p["slots"] == tiny_config().rl.concurrency, name
    assert hbm["per_step"] == pytest.approx(hbm["loop"] + hbm["outside"] / steps), name
    assert p["min_bytes"] > 0 and p["bytes_ratio"] == pytest.approx(
        hbm["per_step"] / p["min_bytes"], rel=1e-2) and p["bytes_ratio"] > 1, name
    assert p["xla_bytes_ratio"] > p["bytes_ratio"], name
    assert p["roofline_s"]["hbm"] == pytest.approx(hbm["per_step"] / aot.CHIPS["v5p"].hbm_bw,
                                                   abs=1e-6), name
  assert r["programs"]["decode"]["hbm_bytes"]["loop"] > 0


def test_the_gae_critic_compiles_beside_the_policy():
  # an RL run with a learned critic: its forward pass and its value-loss update compile on
  # the same mesh with the tree-attention kernel, and each side's peak counts the other's state
  c = tiny_config()
  c.mode, c.loss.name, c.rl.advantage = "rl", "ppo", "gae"
  with jax.default_matmul_precision("default"):
    r = aot.compile_run(c, "v5p:2x2x1", programs=("critic",))
  values, update = r["programs"]["critic/values"], r["programs"]["critic/update"]
  assert set(r["programs"]) == {"critic/values", "critic/update"}
  assert {"tree_attention_fwd", "tree_attention_dq", "tree_attention_dkv"} <= set(
      update["mosaic_kernels"])
  assert "tree_attention_dq" not in values["mosaic_kernels"]
  assert update["flops"] > values["flops"] > 0 and 0 < update["mfu"] <= 1
  assert "all-gather" in update["collectives"]  # the critic is FSDP-sharded like the policy
  # fp32 weights and two Adam moments: about 12 bytes per parameter, over 4 chips
  peak, params = r["critic_peak_gb"], r["model"]["params"]
  assert 0.9 * 12 * params / 4 <= peak["critic_state"] * 1e9 <= 1.2 * 12 * params / 4
  assert peak["total"] >= update["hbm_gb"]["total"] + peak["resident"] - 1e-3
  assert peak["resident"] > 0 and peak["fits"]
  assert any(line.startswith("  critic peak") for line in aot.summary_lines(r))


def test_train_peak_counts_what_stays_resident():
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  state = types.SimpleNamespace(opt_state=[jax.ShapeDtypeStruct((1000, 1000), jnp.float32,
                                                                sharding=one)])  # 0.004 GB
  programs = {"train/gradients": {"hbm_gb": {"total": 10.0, "fits": True}},
              "train/update": {"hbm_gb": {"total": 12.0, "fits": True}}}
  chip = aot.CHIPS["v5p"]
  plain = aot.train_peak(programs, state, chip)
  assert plain["total"] == 12.0 and "resident" not in plain and plain["fits"]
  beside = aot.train_peak(programs, state, chip, resident_gb=3.0)
  assert beside["total"] == 15.0 and beside["resident"] == 3.0
  assert beside["headroom"] == pytest.approx(80.0)
  assert not aot.train_peak(programs, state, chip, resident_gb=90.0)["fits"]
  critic = aot.resident_peak(programs, ("train/update",), 2.0, chip)
  assert critic["total"] == 14.0 and critic["fits"]


def test_weight_sync_gathers_the_fsdp_shards_into_the_engine_layout(v5p_report):
  # the engine's decode layout on fsdp 4 x tensor 1 holds every weight whole: each chip
  # all-gathers the other chips' shards of what the step trained (the norms, replicated in
  # training too, move nothing), and the transfer's time is its collectives'
  sync = v5p_report["programs"]["weight_sync"]
  held = sync["engine_bytes"]
  assert set(sync["collectives"]) == {"all-gather"}
  assert 0.9 * held <= sync["collectives"]["all-gather"]["bytes"] <= held
  assert sync["roofline_s"]["ici"] > 0 and not sync["mosaic_kernels"]
  # whole on every chip, projections in bf16, the rest (embeddings, norms, router) fp32
  params = v5p_report["model"]["params"]
  assert 2 * params < held < 4 * params


def test_bad_topology_and_program_are_config_errors():
  with pytest.raises(ConfigError, match="--topology='v9:2x2'"):
    aot.topology_devices("v9:2x2")
  with pytest.raises(ConfigError, match="--programs: 'backward'"):
    aot.compile_run(tiny_config(), "v5p:2x2x1", programs=("backward",))


def test_command_line_compiles_the_train_step_for_v6e(tmp_path):
  out = tmp_path / "aot.json"
  proc = subprocess.run(
      [sys.executable, "-m", "trainer.aot", "--config=configs/sft_demo.py",
       "--config.data.rows_per_batch=4", "--config.model.overrides.attention_impl=pallas_tpu",
       "--config.model.overrides.dtype=bfloat16",
       "--config.data.row_len=1024", "--topology=v6e:2x2", "--programs=train", "--search",
       f"--out={out}"],
      capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "train/gradients: HBM" in proc.stdout and "does NOT fit" not in proc.stdout
  assert "search: the train step fits" in proc.stdout  # nothing to search
  r = json.loads(out.read_text())
  assert r["chips"] == 4 and set(r["programs"]) == {"train/gradients", "train/update"}
  assert r["search"] == {}
  p = r["programs"]["train/gradients"]
  assert p["hbm_gb"]["capacity"] == 32.0 and p["hbm_gb"]["fits"]
  assert {"tree_attention_fwd", "tree_attention_dq", "tree_attention_dkv"} <= set(
      p["mosaic_kernels"])


def test_search_compiles_another_layout_of_the_tiny_step(v5p_report):
  # the config's train step fits; explored anyway, the search compiles the most promising
  # other layout for real (one compile) and names the better of the two
  with jax.default_matmul_precision("default"):
    result = aot_search.search(tiny_config(), "v5p:2x2x1", v5p_report, budget=1, explore=True,
                               compile_fn=aot.compile_run, log=lambda line: None)
  own, other = result["tried"]
  assert own["why"] == [] and own["fits"]
  assert own["hbm_gb"] == pytest.approx(v5p_report["train_peak_gb"]["total"], abs=0.01)
  assert other["fits"] and other["why"] and other["verdict"].startswith("fits: ")
  assert other["compile_s"] > 0 and other["step_s"] > 0 and other["collective_gb"] >= 0
  assert result["best"] in (own["layout"], other["layout"])
  assert [e["best"] for e in result["tried"]].count(True) == 1


def test_engine_search_compiles_other_decode_layouts(v5p_report):
  # the engine's layouts of 4 chips for the tiny MoE + MLA model (4 heads, 8 experts), then
  # one other layout's decode compiled beside the config's own (in the fixture's report)
  c = tiny_config()
  shapes = aot_engine_search.candidates(c, 4)
  assert shapes[0] == "" and {"tensor=2", "tensor=4", "expert=2", "expert=4",
                              "tensor=2,expert=2"} <= set(shapes)
  assert all(int(v) in (1, 2, 4) for s in shapes[1:] for v in re.findall(r"=(\d+)", s))
  chip, devices = aot.topology_devices("v5p:2x2x1")
  own, split = (aot_engine_search.estimate(c, s, devices) for s in ("", "tensor=4"))
  assert own["mesh"] == {"fsdp": 4} and split["mesh"] == {"tensor": 4}
  assert split["weights_gb"] < own["weights_gb"]  # projections split four ways
  lines = []
  with jax.default_matmul_precision("default"):
    result = aot_engine_search.search(c, "v5p:2x2x1", v5p_report, compile_fn=aot.compile_run,
                                      topology_devices=aot.topology_devices, budget=1,
                                      log=lines.append)
  first, other = result["tried"]
  assert first["engine_mesh_shape"] == "" and first["fits"] and first["planned"]
  assert first["bytes_ratio"] == v5p_report["programs"]["decode"]["bytes_ratio"]
  assert other["mesh"] != first["mesh"] and other["fits"] and other["step_s"] > 0
  assert len(lines) == 1 and other["engine_mesh_shape"] in lines[0]
  assert result["best"] in ("", other["engine_mesh_shape"])
  assert [t["best"] for t in result["tried"]].count(True) == 1
  summary = aot_engine_search.summary_lines(result)
  assert summary[-1].startswith("engine search: use --config.rl.engine_mesh_shape=")
