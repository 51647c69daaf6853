"""models/hf.py, hf_config.py and hf_names.py against Hugging Face transformers (PyTorch CPU).

Tiny random models of each family are built from transformers config classes (no downloads),
saved with `save_pretrained`, imported with `models.hf.load` and compared on logits; the import
is then exported with `models.hf.save` and loaded back by transformers, which must give the
original logits. FP8 block-scaled weights are checked against a dequantisation written here.
"""

import json
import logging
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.torch
import torch
from flax import nnx
from transformers import (AutoModelForCausalLM, DeepseekV3Config, Qwen2Config, Qwen3Config,
                          Qwen3MoeConfig)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from models import hf, hf_config
from models.rope import inv_freq_and_factor

BATCH, LENGTH, ATOL = 2, 64, 1e-4
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=128, initializer_range=0.2)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
            mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1)
DEEPSEEK = dict(COMMON, num_hidden_layers=3, num_key_value_heads=4, moe_intermediate_size=32,
                n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
                first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
                qk_nope_head_dim=16, routed_scaling_factor=2.5)

CASES = {
    "qwen2": (Qwen2Config, dict(COMMON, num_key_value_heads=2)),
    "qwen2_tied": (Qwen2Config, dict(COMMON, num_key_value_heads=2, tie_word_embeddings=True,
                                     rope_parameters=dict(rope_type="linear", rope_theta=1e4,
                                                          factor=2.0))),
    "qwen3": (Qwen3Config, dict(COMMON, num_key_value_heads=2, head_dim=32,
                                rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0,
                                                     original_max_position_embeddings=32))),
    "qwen3_moe_norm": (Qwen3MoeConfig, dict(COMMON, num_key_value_heads=2, head_dim=16,
                                            num_experts=8, num_experts_per_tok=2,
                                            moe_intermediate_size=32, norm_topk_prob=True)),
    "qwen3_moe_nonorm": (Qwen3MoeConfig, dict(COMMON, num_key_value_heads=2, head_dim=16,
                                              num_experts=8, num_experts_per_tok=2,
                                              moe_intermediate_size=32, norm_topk_prob=False)),
    "deepseek_v3": (DeepseekV3Config, dict(DEEPSEEK, q_lora_rank=24, n_group=4, topk_group=2,
                                           rope_parameters=YARN)),
    "deepseek_v3_direct_q": (DeepseekV3Config, dict(DEEPSEEK, q_lora_rank=None, n_group=1,
                                                    topk_group=1, rope_interleave=False)),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
  """Make every 1-D tensor informative: norm gains 1 + noise, biases and router bias noise."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
      if name.endswith("e_score_correction_bias"):
        p.copy_(0.5 * torch.randn(p.shape, generator=g))
      elif p.ndim == 1 and "norm" in name:
        p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
      elif name.endswith(".bias"):
        p.copy_(0.3 * torch.randn(p.shape, generator=g))


def hf_logits(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(tokens).long()).logits.float().numpy()


@nnx.jit
def _forward(model, tokens, positions, end):
  return model(tokens, positions, end)[0]


def arbor_logits(model, tokens: np.ndarray) -> np.ndarray:
  positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
  end = np.full(tokens.shape, tokens.shape[1], np.int32)
  return np.asarray(_forward(model, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions),
                             jnp.asarray(end)))


class Case:
  """A tiny transformers model saved to disk, with reference logits on random tokens."""

  def __init__(self, name, directory):
    config_cls, kwargs = CASES[name]
    torch.manual_seed(0)
    self.name, self.dir = name, str(directory)
    self.torch_model = AutoModelForCausalLM.from_config(config_cls(**kwargs),
                                                        attn_implementation="eager").eval()
    randomize(self.torch_model, seed=1)
    self.torch_model.save_pretrained(self.dir)
    rng = np.random.default_rng(0)
    self.tokens = rng.integers(0, kwargs["vocab_size"], (BATCH, LENGTH)).astype(np.int32)
    self.logits = hf_logits(self.torch_model, self.tokens)
    assert self.logits.std() > 0.5, f"{name}: logits nearly constant ({self.logits.std():.3g})"


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
  built = {}

  def get(name):
    if name not in built:
      built[name] = Case(name, tmp_path_factory.mktemp(name))
    return built[name]

  return get


def load_torch(path):
  model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True,
                                                     attn_implementation="eager")
  problems = {k: v for k, v in info.items() if v and k != "error_msgs"}
  assert not problems and not info.get("error_msgs"), problems
  return model.eval()


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers_and_round_trip(name, cases, tmp_path):
  case = cases(name)
  model = hf.load(case.dir)
  got = arbor_logits(model, case.tokens)
  err = np.abs(got - case.logits).max()
  print(f"{name}: import max abs err {err:.2e} (logits std {case.logits.std():.2f})")
  np.testing.assert_allclose(got, case.logits, atol=ATOL, rtol=0)

  # Export, load with transformers (no missing / unexpected keys), same logits.
  n = hf.save(model, tmp_path / "out")
  on_disk = safetensors.torch.load_file(str(tmp_path / "out" / "model.safetensors"))
  original = safetensors.torch.load_file(os.path.join(case.dir, "model.safetensors"))
  assert sorted(on_disk) == sorted(original) and n == len(original)
  back = load_torch(tmp_path / "out")
  err = np.abs(hf_logits(back, case.tokens) - case.logits).max()
  print(f"{name}: round trip max abs err {err:.2e}")
  np.testing.assert_allclose(hf_logits(back, case.tokens), case.logits, atol=ATOL, rtol=0)
  with open(tmp_path / "out" / "config.json") as f:
    assert hf_config.config_from_hf(json.load(f)) == model.cfg


def test_bf16_sharded_export(cases, tmp_path):
  """bf16 weights in several shards with an index: transformers loads them, and re-importing
  gives the logits transformers computes from the same (bf16-rounded) weights."""
  case = cases("qwen2")
  hf.save(hf.load(case.dir), tmp_path / "bf16", dtype="bfloat16", max_shard_bytes=40_000)
  files = os.listdir(tmp_path / "bf16")
  assert "model.safetensors.index.json" in files and len([f for f in files if
                                                          f.endswith(".safetensors")]) > 1
  back = load_torch(tmp_path / "bf16")
  assert back.dtype == torch.bfloat16
  want = hf_logits(back.float(), case.tokens)
  got = arbor_logits(hf.load(tmp_path / "bf16"), case.tokens)
  print(f"bf16 sharded: max abs err {np.abs(got - want).max():.2e}")
  np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("config_cls, kwargs", [
    (Qwen3Config, dict(COMMON, num_key_value_heads=2, head_dim=32, rope_parameters=dict(
        rope_type="yarn", rope_theta=1e6, factor=8.0, original_max_position_embeddings=32,
        mscale=1.0, mscale_all_dim=0.5, beta_fast=16, beta_slow=2))),
    (Qwen3Config, dict(COMMON, num_key_value_heads=2, head_dim=32, rope_parameters=dict(
        rope_type="yarn", rope_theta=1e6, factor=8.0, original_max_position_embeddings=32,
        attention_factor=1.3, truncate=False))),
    (DeepseekV3Config, dict(DEEPSEEK, q_lora_rank=24, n_group=4, topk_group=2,
                            rope_parameters=dict(YARN, mscale=0.8, factor=40.0))),
])
def test_rope_frequencies_and_scales_match_transformers(config_cls, kwargs):
  config = config_cls(**kwargs)
  cfg = hf_config.config_from_hf(config.to_dict())
  inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
  got_inv_freq, got_factor = inv_freq_and_factor(cfg)
  np.testing.assert_allclose(got_inv_freq, inv_freq.numpy(), rtol=1e-6)
  assert got_factor == pytest.approx(factor, rel=1e-6)
  model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  assert cfg.softmax_scale == pytest.approx(model.model.layers[0].self_attn.scaling, rel=1e-6)


def test_config_tables_match_transformers_configs(cases):
  """Key fields of config_from_hf, and the experts' layout on disk, checked against the
  transformers objects (not our own output)."""
  ds = cases("deepseek_v3")
  cfg = hf_config.config_from_hf(ds.torch_model.config.to_dict())
  assert (cfg.attention, cfg.router_bias, cfg.score_func, cfg.num_dense_layers,
          cfg.num_moe_layers, cfg.rope_type, cfg.rope_factor, cfg.n_group) == \
      ("mla", True, "sigmoid", 1, 2, "yarn", 4.0, 4)
  assert cfg.softmax_scale == pytest.approx(ds.torch_model.model.layers[0].self_attn.scaling)
  moe = hf_config.config_from_hf(cases("qwen3_moe_norm").torch_model.config.to_dict())
  assert (moe.score_func, moe.qk_norm, moe.norm_topk_prob, moe.num_dense_layers) == \
      ("softmax", True, True, 0)


# ----------------------------------------------------------------------------- FP8 and MTP


def quantize_blocks(w: torch.Tensor, block: int = 128):
  """Per-block e4m3 quantisation: returns (fp8 weight, scale_inv [ceil(out/b), ceil(in/b)])."""
  rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
  q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
  scale = torch.empty(rows, cols)
  for i in range(rows):
    for j in range(cols):
      tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
      s = tile.abs().max().clamp(min=1e-12) / 448.0
      scale[i, j] = s
      q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / s).to(torch.float8_e4m3fn)
  return q, scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
  out = q.to(torch.float32)
  for i in range(scale.shape[0]):
    for j in range(scale.shape[1]):
      out[i * block:(i + 1) * block, j * block:(j + 1) * block] *= scale[i, j]
  return out


def test_fp8_block_scales_and_mtp_skipped(tmp_path, caplog):
  kwargs = dict(DEEPSEEK, hidden_size=160, intermediate_size=192, num_hidden_layers=2,
                q_lora_rank=136, n_group=2, topk_group=1, rope_parameters=YARN)
  torch.manual_seed(0)
  model = AutoModelForCausalLM.from_config(DeepseekV3Config(**kwargs))
  model.save_pretrained(tmp_path / "fp32")
  weights = safetensors.torch.load_file(str(tmp_path / "fp32" / "model.safetensors"))
  stored, reference = {}, {}
  for name, w in weights.items():
    fp8 = (w.ndim == 2 and name.startswith("model.layers.") and "mlp.gate.weight" not in name)
    if fp8:
      q, s = quantize_blocks(w)
      stored[name], stored[name + "_scale_inv"] = q, s
      reference[name] = dequantize_blocks(q, s)
    else:
      stored[name] = reference[name] = w
  assert any(w.shape[0] > 128 and w.shape[0] % 128 for w in reference.values())  # edge blocks
  assert any(w.shape[1] > 128 for w in reference.values())
  n = kwargs["num_hidden_layers"]  # fake multi-token-prediction layer, FP8 included
  mtp = {f"model.layers.{n}.eh_proj.weight": torch.randn(160, 320),
         f"model.layers.{n}.enorm.weight": torch.ones(160),
         f"model.layers.{n}.self_attn.q_a_proj.weight": q.clone(),
         f"model.layers.{n}.self_attn.q_a_proj.weight_scale_inv": s.clone()}
  stored.update(mtp)
  # Two shards with an index, as released checkpoints are stored.
  out = tmp_path / "fp8"
  out.mkdir()
  names = sorted(stored)
  weight_map = {}
  for i, part in enumerate((names[:len(names) // 2], names[len(names) // 2:])):
    fname = f"model-0000{i + 1}-of-00002.safetensors"
    safetensors.torch.save_file({k: stored[k].contiguous() for k in part}, str(out / fname),
                                metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(part, fname))
  (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  config = json.loads((tmp_path / "fp32" / "config.json").read_text())
  config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                   "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
  (out / "config.json").write_text(json.dumps(config))
  assert any(v.dtype == torch.float8_e4m3fn for v in stored.values())

  with caplog.at_level(logging.INFO, logger="models.hf"):
    imported, stats = hf.load_with_stats(out)
  mtp_lines = [r for r in caplog.records if "multi-token" in r.getMessage()]
  assert len(mtp_lines) == 1 and f"[{n}]" in mtp_lines[0].getMessage()
  n_scales = sum(k.endswith("_scale_inv") for k in stored)
  assert stats.skipped == len(mtp) and stats.scales == n_scales - 1  # the MTP scale is skipped
  got = hf.hf_tensors(imported)
  assert sorted(got) == sorted(reference)
  for name, want in reference.items():
    np.testing.assert_array_equal(got[name], want.numpy(), err_msg=name)
  # The dequantised values differ from the fp32 originals (the test is not vacuous).
  assert not np.array_equal(got["model.layers.0.mlp.up_proj.weight"],
                            weights["model.layers.0.mlp.up_proj.weight"].numpy())


# ----------------------------------------------------------------------------- bad inputs


def _copy_with(case, directory, edit):
  """Copy a case's checkpoint to `directory`, rewriting its tensors with `edit(dict)`."""
  shutil.copytree(case.dir, directory)
  path = str(directory / "model.safetensors")
  tensors = safetensors.torch.load_file(path)
  edit(tensors)
  safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
  return directory


def test_missing_tensor_names_it(cases, tmp_path):
  name = "model.layers.1.self_attn.k_proj.weight"
  d = _copy_with(cases("qwen2"), tmp_path / "ckpt", lambda t: t.pop(name))
  with pytest.raises(hf.CheckpointError, match=f"{name}.*missing.*{tmp_path / 'ckpt'}"):
    hf.load(d)


def test_shape_mismatch_names_tensor_and_shapes(cases, tmp_path):
  name = "model.layers.0.mlp.up_proj.weight"
  d = _copy_with(cases("qwen2"), tmp_path / "ckpt",
                 lambda t: t.update({name: t[name].T.contiguous()}))
  with pytest.raises(hf.CheckpointError, match=rf"{name}.*\[64, 96\].*expected \[96, 64\]"):
    hf.load(d)


def test_unexpected_tensor_is_an_error(cases, tmp_path):
  d = _copy_with(cases("qwen2"), tmp_path / "ckpt",
                 lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(3)}))
  with pytest.raises(hf.CheckpointError, match="unexpected.*model.layers.0.mlp.extra.weight"):
    hf.load(d)


def test_tied_lm_head_must_equal_embedding(cases, tmp_path):
  case = cases("qwen2_tied")
  d = _copy_with(case, tmp_path / "same", lambda t: t.update(
      {"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
  assert hf.load(d).lm_head is None
  d = _copy_with(case, tmp_path / "differs", lambda t: t.update(
      {"lm_head.weight": torch.zeros_like(t["model.embed_tokens.weight"])}))
  with pytest.raises(hf.CheckpointError, match="lm_head.weight"):
    hf.load(d)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "GPT2LMHeadModel"])
def test_unsupported_architecture(cases, tmp_path, arch):
  d = tmp_path / "ckpt"
  shutil.copytree(cases("qwen2").dir, d)
  config = json.loads((d / "config.json").read_text())
  config.update(architectures=[arch], model_type="llama")
  (d / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=f"{arch}.*supported families.*Qwen2ForCausalLM.*"
                                       "DeepseekV3ForCausalLM"):
    hf.load(d)


def test_other_quantization_rejected(cases, tmp_path):
  d = tmp_path / "ckpt"
  shutil.copytree(cases("qwen2").dir, d)
  config = json.loads((d / "config.json").read_text())
  config["quantization_config"] = {"quant_method": "compressed-tensors"}
  (d / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="quant_method.*compressed-tensors"):
    hf.load(d)


def _qwen3_dict(**changes):
  d = Qwen3Config(**dict(COMMON, num_key_value_heads=2)).to_dict()
  d.update(changes)
  return d


@pytest.mark.parametrize("changes, field", [
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)), "rope_type"),
    (dict(rope_parameters=None, rope_theta=1e4, rope_scaling=dict(type="longrope")), "rope_type"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4,
          num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=2),
     "decoder_sparse_step"),
    (dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4,
          num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[0]),
     "mlp_only_layers"),
])
def test_unsupported_config_fields(changes, field):
  with pytest.raises(ValueError, match=f"{field}.*supported families"):
    hf_config.config_from_hf(_qwen3_dict(**changes))


def test_deepseek_attention_bias_unsupported():
  d = DeepseekV3Config(**dict(DEEPSEEK, q_lora_rank=24, n_group=4, topk_group=2)).to_dict()
  d["attention_bias"] = True
  with pytest.raises(ValueError, match="DeepseekV3ForCausalLM.*attention_bias.*supported"):
    hf_config.config_from_hf(d)


def test_rope_settings_from_transformers_4_and_5_styles():
  v5 = DeepseekV3Config(**dict(DEEPSEEK, q_lora_rank=24, n_group=4, topk_group=2,
                               rope_parameters=dict(YARN))).to_dict()
  v4 = dict(v5)
  v4.pop("rope_parameters")
  v4.update(rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 4.0, "beta_fast": 32,
                                              "beta_slow": 1, "mscale": 1.0,
                                              "mscale_all_dim": 1.0,
                                              "original_max_position_embeddings": 32})
  a, b = hf_config.config_from_hf(v5), hf_config.config_from_hf(v4)
  assert a == b
  assert (a.rope_type, a.rope_factor, a.rope_original_max_position, a.yarn_mscale_all_dim,
          a.rope_theta) == ("yarn", 4.0, 32, 1.0, 10000.0)
  # kimi_k2 is the same family under another model_type.
  assert hf_config.config_from_hf(dict(v5, model_type="kimi_k2")) == a
  # transformers parses what config_to_hf writes to the same rotary settings.
  back = DeepseekV3Config(**{k: v for k, v in hf_config.config_to_hf(a).items()
                            if k not in ("architectures", "model_type")})
  assert back.rope_parameters["rope_type"] == "yarn" and back.rope_parameters["factor"] == 4.0
  assert hf_config.config_from_hf(back.to_dict()) == a


# ----------------------------------------------------------------------------- CLI


def test_cli_import_export(cases, tmp_path, capsys):
  case = cases("deepseek_v3")
  assert hf.main(["import", "--hf_dir", case.dir, "--out", str(tmp_path / "arbor")]) == 0
  assert hf.main(["export", "--ckpt", str(tmp_path / "arbor"), "--out",
                  str(tmp_path / "hf_out")]) == 0
  out = capsys.readouterr().out
  assert "imported" in out and "exported" in out and "parameters" in out
  saved = json.loads((tmp_path / "arbor" / "model_config.json").read_text())
  assert hf.config_from_json(saved) == hf_config.config_from_hf(
      json.loads((tmp_path / "hf_out" / "config.json").read_text()))
  got = hf_logits(load_torch(tmp_path / "hf_out"), case.tokens)
  print(f"cli import/export: max abs err {np.abs(got - case.logits).max():.2e}")
  np.testing.assert_allclose(got, case.logits, atol=ATOL, rtol=0)
