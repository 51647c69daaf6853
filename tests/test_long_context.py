"""Long-context RoPE: the presets' YaRN settings, and logits at positions far past the
pre-training context against Hugging Face transformers (PyTorch CPU).

The published presets' RoPE fields are checked against the checkpoints' config.json values and
the model cards' 128K recipe, and their frequencies, cos/sin factors and softmax scales against
what transformers computes from the exported config. The tiny YaRN presets (a Qwen2-layout GQA
model with the Qwen 128K recipe, a DeepSeek-V3-layout MLA model with DeepSeek's YaRN) are built
in transformers from config classes, saved with `save_pretrained`, imported with `models.hf` and
compared on logits of short sequences whose position ids jump to 8K-131K, so that query-key
distances span the extended range while the sequences stay cheap.
"""

import copy
import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from models import hf, hf_config
from models.config import yarn_get_mscale
from models.presets import PRESETS, QWEN_YARN_128K, get_preset
from models.rope import inv_freq_and_factor
from tests.test_hf import ATOL, _forward, randomize

ROPE_FIELDS = ("max_position_embeddings", "rope_theta", "rope_type", "rope_factor",
               "rope_original_max_position", "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale",
               "yarn_mscale_all_dim", "yarn_attention_factor")

# Published settings: (rope_theta, max_position_embeddings, factor, original length, beta_fast,
# beta_slow, mscale, mscale_all_dim); factor None = no YaRN.
QWEN_128K = (1e6, 131072, 4.0, 32768, 32.0, 1.0, 0.0, 0.0)
PUBLISHED = {
    # Qwen/Qwen2.5-Coder-*(-Instruct) config.json: rope_theta 1e6, max_position_embeddings
    # 32768, no rope_scaling. The 7B/14B/32B cards add {"type": "yarn", "factor": 4.0,
    # "original_max_position_embeddings": 32768} for 131,072 tokens.
    "qwen2.5-coder-7b": (1e6, 32768, None, None, None, None, None, None),
    "qwen2.5-coder-32b": (1e6, 32768, None, None, None, None, None, None),
    "qwen2.5-coder-7b-128k": QWEN_128K,
    "qwen2.5-coder-14b-128k": QWEN_128K,
    "qwen2.5-coder-32b-128k": QWEN_128K,
    # Qwen/Qwen3-* config.json: rope_theta 1e6, max_position_embeddings 40960; the 4B-and-up
    # cards (dense and 30B-A3B) give the same YaRN x4 recipe for 131,072 tokens.
    "qwen3-8b": (1e6, 40960, None, None, None, None, None, None),
    "qwen3-30b-a3b": (1e6, 40960, None, None, None, None, None, None),
    "qwen3-4b-128k": QWEN_128K,
    "qwen3-8b-128k": QWEN_128K,
    "qwen3-14b-128k": QWEN_128K,
    "qwen3-32b-128k": QWEN_128K,
    "qwen3-30b-a3b-128k": QWEN_128K,
    # deepseek-ai/DeepSeek-V3 config.json: rope_scaling {type yarn, factor 40,
    # original_max_position_embeddings 4096, beta_fast 32, beta_slow 1, mscale 1.0,
    # mscale_all_dim 1.0}, max_position_embeddings 163840, rope_theta 10000.
    "deepseek-v3": (1e4, 163840, 40.0, 4096, 32.0, 1.0, 1.0, 1.0),
    # moonshotai/Kimi-K2-Instruct: rope_theta 50000, YaRN x32 over 4096 with beta_fast =
    # beta_slow = 1 and mscale = mscale_all_dim = 1, max_position_embeddings 131072; the -0905
    # release: factor 64, 262144 positions.
    "kimi-k2": (5e4, 131072, 32.0, 4096, 1.0, 1.0, 1.0, 1.0),
    "kimi-k2-0905": (5e4, 262144, 64.0, 4096, 1.0, 1.0, 1.0, 1.0),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_carry_the_published_settings(name):
  cfg = get_preset(name)
  theta, max_pos, factor, original, fast, slow, mscale, mscale_all_dim = PUBLISHED[name]
  assert (cfg.rope_theta, cfg.max_position_embeddings) == (theta, max_pos)
  if factor is None:
    assert cfg.rope_type == "default"
    return
  assert (cfg.rope_type, cfg.rope_factor, cfg.rope_original_max_position, cfg.yarn_beta_fast,
          cfg.yarn_beta_slow, cfg.yarn_mscale, cfg.yarn_mscale_all_dim,
          cfg.yarn_attention_factor) == ("yarn", factor, original, fast, slow, mscale,
                                         mscale_all_dim, None)
  assert original * factor >= 131072  # 128K positions at least


def _hf_config(cfg, directory):
  """The transformers config object of an Arbor config, through a config.json on disk."""
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(hf_config.config_to_hf(cfg), f)
  return AutoConfig.from_pretrained(directory)


@pytest.mark.parametrize("name", ["qwen2.5-coder-7b-128k", "qwen2.5-coder-32b-128k",
                                  "qwen3-8b-128k", "qwen3-30b-a3b-128k", "deepseek-v3",
                                  "kimi-k2", "kimi-k2-0905"])
def test_published_rope_matches_transformers(name, tmp_path):
  """Frequencies, cos/sin factor and softmax scale of the full-size presets as transformers
  computes them from the exported config (attention modules built on the meta device)."""
  cfg = get_preset(name)
  config = _hf_config(cfg, tmp_path)
  back = hf_config.config_from_hf(config.to_dict())
  assert {f: getattr(back, f) for f in ROPE_FIELDS} == {f: getattr(cfg, f) for f in ROPE_FIELDS}
  inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
  got_inv_freq, got_factor = inv_freq_and_factor(cfg)
  np.testing.assert_allclose(got_inv_freq, inv_freq.numpy(), rtol=1e-6)
  assert got_factor == pytest.approx(factor, rel=1e-6)
  one_layer = copy.deepcopy(config)
  one_layer.num_hidden_layers = 1
  with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(one_layer)
  scaling = model.model.layers[0].self_attn.scaling
  assert cfg.softmax_scale == pytest.approx(scaling, rel=1e-6)
  if cfg.attention == "mla":  # DeepSeek: 1/sqrt(192) * (0.1 ln(factor) + 1)^2
    assert scaling == pytest.approx(192 ** -0.5 * yarn_get_mscale(cfg.rope_factor) ** 2)
    assert got_factor == 1.0  # mscale / mscale_all_dim
  else:  # Qwen: plain softmax; cos/sin times 0.1 ln 4 + 1
    assert scaling == pytest.approx(128 ** -0.5)
    assert got_factor == pytest.approx(0.1 * np.log(4.0) + 1)


def test_model_card_rope_scaling_imports_as_the_128k_preset():
  """The Qwen card's recipe, added to the published config.json, imports as the -128k preset
  (its max_position_embeddings stays the file's)."""
  d = hf_config.config_to_hf(get_preset("qwen2.5-coder-32b"))
  del d["rope_parameters"]
  d["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
  got = hf_config.config_from_hf(d)
  want = get_preset("qwen2.5-coder-32b-128k")
  assert got.max_position_embeddings == 32768
  assert got.replace(max_position_embeddings=131072) == want


# --- logits at far positions

# Each row: a short prompt near 0, then blocks of 4 tokens at far positions, so query-key
# distances span 8K..131K (beyond 4,096 and 32,768, the pre-training lengths).
POSITIONS = np.stack([
    np.r_[0:4, 8192:8196, 30000:30004, 65000:65004],
    np.r_[100:104, 20000:20004, 50000:50004, 131000:131004]]).astype(np.int32)

CASES = {
    "qwen2_yarn": ("tiny-dense-yarn", {}),
    "deepseek_yarn": ("tiny-moe-mla-yarn", {}),
    # mscale != mscale_all_dim: the cos/sin carry get_mscale(40, 1) / get_mscale(40, 0.5)
    "deepseek_yarn_mscale": ("tiny-moe-mla-yarn", dict(yarn_mscale_all_dim=0.5)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_far_positions_match_transformers(case, tmp_path):
  preset, changes = CASES[case]
  cfg = get_preset(preset).replace(initializer_range=0.2, **changes)
  config = _hf_config(cfg, tmp_path / "hf")
  torch.manual_seed(0)
  torch_model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
  randomize(torch_model, seed=1)
  torch_model.save_pretrained(tmp_path / "hf")
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, POSITIONS.shape).astype(np.int32)
  with torch.no_grad():
    want = torch_model(torch.from_numpy(tokens).long(),
                       position_ids=torch.from_numpy(POSITIONS).long()).logits.numpy()
  assert want.std() > 0.5, f"logits nearly constant ({want.std():.3g})"

  def logits(model, positions=POSITIONS):
    end = np.full(tokens.shape, tokens.shape[1], np.int32)
    return np.asarray(_forward(model, jnp.asarray(tokens), jnp.asarray(positions),
                               jnp.asarray(end)))

  model = hf.load(tmp_path / "hf")
  assert {f: getattr(model.cfg, f) for f in ROPE_FIELDS} == \
      {f: getattr(cfg, f) for f in ROPE_FIELDS}
  got = logits(model)
  err = np.abs(got - want).max()
  print(f"{case}: max abs err {err:.2e} (logits std {want.std():.2f})")
  np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
  # The comparison is sensitive to the settings: the same weights with plain RoPE, or with
  # the positions made contiguous, give clearly different logits.
  plain = logits(hf.load(tmp_path / "hf", rope_type="default"))
  contiguous = logits(model, np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32),
                                             tokens.shape))
  assert np.abs(plain - want).max() > 100 * ATOL
  assert np.abs(contiguous - want).max() > 100 * ATOL


def test_qwen_checkpoint_with_yarn_overrides(tmp_path):
  """A Qwen checkpoint as published (no rope_scaling) loaded with `QWEN_YARN_128K` as
  overrides gives the logits transformers computes with the card's rope_scaling."""
  base = dataclasses.replace(get_preset("tiny-dense"), rope_theta=1e6,
                             max_position_embeddings=32768, initializer_range=0.2)
  card = _hf_config(base, tmp_path / "card")
  card.rope_parameters = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                          "original_max_position_embeddings": 32768}
  torch.manual_seed(0)
  torch_model = AutoModelForCausalLM.from_config(card, attn_implementation="eager").eval()
  randomize(torch_model, seed=2)
  torch_model.save_pretrained(tmp_path / "card")
  # the published config.json beside the same weights
  os.makedirs(tmp_path / "published")
  with open(tmp_path / "published" / "config.json", "w") as f:
    json.dump(hf_config.config_to_hf(base), f)
  os.symlink(tmp_path / "card" / "model.safetensors", tmp_path / "published" / "model.safetensors")
  model = hf.load(tmp_path / "published", **QWEN_YARN_128K)
  assert model.cfg == PRESETS["tiny-dense-yarn"].replace(initializer_range=0.2)
  tokens = np.random.default_rng(1).integers(0, base.vocab_size, POSITIONS.shape)
  with torch.no_grad():
    want = torch_model(torch.from_numpy(tokens).long(),
                       position_ids=torch.from_numpy(POSITIONS).long()).logits.numpy()
  end = np.full(tokens.shape, tokens.shape[1], np.int32)
  got = np.asarray(_forward(model, jnp.asarray(tokens, jnp.int32), jnp.asarray(POSITIONS),
                            jnp.asarray(end)))
  np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_long_context_config_applies_the_yarn_recipe(tmp_path):
  """configs/long_context.py on a Qwen checkpoint as published gives the -128k preset's RoPE;
  on a DeepSeek-V3 checkpoint it keeps the checkpoint's own YaRN."""
  from configs import long_context
  from trainer import config as config_lib

  assert long_context.QWEN_YARN_128K == QWEN_YARN_128K
  for family, preset, want in (("qwen2.5-coder", "tiny-dense", "tiny-dense-yarn"),
                               ("deepseek-v3", "tiny-moe-mla-yarn", "tiny-moe-mla-yarn")):
    base = get_preset(preset)
    if family.startswith("qwen"):
      base = base.replace(rope_theta=1e6, max_position_embeddings=32768)
    _hf_config(base, tmp_path / family)
    c = long_context.get_config(family)
    c.model.init = f"hf:{tmp_path / family}"
    cfg = config_lib.model_config(c)
    assert {f: getattr(cfg, f) for f in ROPE_FIELDS} == \
        {f: getattr(PRESETS[want], f) for f in ROPE_FIELDS}
    assert cfg.max_position_embeddings >= c.data.row_len == long_context.ROW_LEN
    assert c.data.row_len % c.mesh.sequence == 0


# --- ahead-of-time plans for long rows (benchmarks/aot_plans.py; compiled by hand, see
# docs/scaling.md "Long contexts")


@pytest.mark.parametrize("sequence", [1, 4])
def test_attention_flops_count_the_slowest_shards_causal_pairs(sequence):
  from benchmarks import aot_plans

  cfg, length = get_preset("tiny-moe-mla-yarn"), 4096
  chunk = length // sequence
  i = np.arange(length - chunk, length)  # the last shard's queries; query i sees i + 1 keys
  pairs = (i + 1).sum()
  per_pair = 2 * cfg.num_layers * cfg.num_heads * (cfg.qk_head_dim + cfg.value_head_dim)
  got = aot_plans.attention_flops(cfg, length, length, "full", sequence) / sequence
  assert got == pytest.approx(pairs * per_pair * 4, rel=2e-3)  # fwd, bwd (2x), remat fwd


def test_long_plans_configs():
  from benchmarks import aot_plans
  from trainer import config as config_lib

  assert {p.row_len for p in aot_plans.LONG_PLANS.values()} == {65536, 131072}
  for name, plan in aot_plans.LONG_PLANS.items():
    c = aot_plans.plan_config(name)
    chips = int(np.prod(list(plan.mesh.values())))
    shape = dict(zip(("data", "fsdp", "tensor", "expert", "sequence"),
                     config_lib.mesh_shape(c, chips)))
    assert shape["sequence"] == plan.mesh.get("sequence", 1) and c.data.row_len == plan.row_len
    # the same tokens per step as the 32,768-token plans: 256 rows
    assert c.data.microbatches * c.data.rows_per_batch * plan.row_len == 256 * 32768, name
    assert config_lib.model_config(c).max_position_embeddings >= plan.row_len
    est = aot_plans.long_estimate(name)
    assert 0 < est["attention_s"] < est["step_s"]
