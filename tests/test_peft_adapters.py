"""LoRA adapters in PEFT's format (models/peft_format.py) and rsLoRA scaling, against the real
`peft` package on a tiny random Qwen2 model (transformers, PyTorch CPU, built from its config
class: no downloads).

References: PEFT's own forward and merge of the written adapters on the transformers model, the
merged Hugging Face export loaded by transformers, and the LoRA formula W + s A B transcribed in
NumPy with s = alpha / r or alpha / sqrt(r).
"""

from __future__ import annotations

import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
from flax import nnx
from peft import PeftModel
from transformers import AutoModelForCausalLM, DeepseekV3Config, Qwen2Config

from configs import sft_demo
from models import hf, peft_format, transformer
from tests.conftest import TINY_MOE_MLA
from trainer import checkpoint, export, harness
from trainer import config as config_lib
from trainer import optim as O
from trainer import state as S

# alpha / r = 2 and alpha / sqrt(r) = 4: a wrong scale doubles or halves the adapters' term
RANK, ALPHA = 4, 8.0
QWEN2 = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             initializer_range=0.2)
# DeepSeek-V3: MLA attention; one dense layer (the experts need not run for attention adapters)
DEEPSEEK = dict(QWEN2, num_hidden_layers=1, num_key_value_heads=4, moe_intermediate_size=32,
                n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
                first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
                qk_nope_head_dim=16, q_lora_rank=24, n_group=1, topk_group=1)
TOKENS = np.random.default_rng(0).integers(0, 128, (2, 12)).astype(np.int32)
ATOL, RTOL = 1e-5, 1e-5  # fp32, two frameworks
TARGETS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]

_forward = nnx.jit(lambda m, t, p, e: m(t, p, e)[0])


def arbor_logits(model) -> np.ndarray:
  positions = np.broadcast_to(np.arange(TOKENS.shape[1], dtype=np.int32), TOKENS.shape)
  end = np.full(TOKENS.shape, TOKENS.shape[1], np.int32)
  return np.asarray(_forward(model, TOKENS, positions, end))


def torch_logits(model) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(TOKENS).long()).logits.float().numpy()


def load_torch(path) -> torch.nn.Module:
  return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
  """A tiny random Qwen2 checkpoint (non-zero q/k/v biases) saved by transformers."""
  torch.manual_seed(0)
  model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN2), attn_implementation="eager")
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith(".bias"):
        p.copy_(0.3 * torch.randn(p.shape))
  path = tmp_path_factory.mktemp("qwen2")
  model.save_pretrained(path)
  return path


@pytest.fixture(scope="module")
def base(base_dir):
  return hf.load(base_dir)


def with_random_adapters(base, rslora: bool, seed: int = 3,
                         modules: tuple[str, ...] = ("attention", "mlp")):
  """The LoRA model of `base` with every A and B drawn N(0, 0.1^2) (B is zero after
  `with_adapters`, which would hide the adapters)."""
  model = transformer.with_adapters(base, base.cfg.replace(
      lora_rank=RANK, lora_alpha=ALPHA, lora_rslora=rslora, lora_modules=modules))
  leaves, treedef = jax.tree.flatten(nnx.state(model, nnx.LoRAParam))
  rng = np.random.default_rng(seed)
  nnx.update(model, jax.tree.unflatten(treedef, [
      jnp.asarray(0.1 * rng.standard_normal(x.shape, np.float32)) for x in leaves]))
  return model


@pytest.fixture(scope="module")
def adapted(base):
  """{rslora: the LoRA model of `base` with random adapters}, one A and B draw for both."""
  return {rslora: with_random_adapters(base, rslora) for rslora in (False, True)}


@pytest.fixture(scope="module")
def adapter_dir(adapted, tmp_path_factory):
  """The PEFT directory of adapted[False] (copied by the tests that edit it)."""
  path = tmp_path_factory.mktemp("adapter")
  peft_format.save_adapter(adapted[False], path)
  return path


@pytest.mark.parametrize("rslora", [False, True])
def test_peft_loads_the_adapters_with_arbor_logits(rslora, base_dir, base, adapted, tmp_path):
  """adapter_config.json holds PEFT's fields; PEFT on the transformers model gives the Arbor
  LoRA model's logits; PEFT's merged weights are the NumPy W + s A B with the configured scale
  (the same A, B give different logits with and without rsLoRA); reading the directory back
  gives the same config and adapters."""
  model = adapted[rslora]
  info = peft_format.save_adapter(model, tmp_path / "adapter", str(base_dir))
  assert info["tensors"] == 2 * 7 * QWEN2["num_hidden_layers"]
  with open(tmp_path / "adapter" / peft_format.CONFIG_NAME) as f:
    config = json.load(f)
  assert (config["r"], config["lora_alpha"], config["use_rslora"], config["lora_dropout"],
          config["task_type"], config["base_model_name_or_path"], config["target_modules"]) == (
              RANK, ALPHA, rslora, 0.0, "CAUSAL_LM", str(base_dir), TARGETS)

  want = arbor_logits(model)
  peft_model = PeftModel.from_pretrained(load_torch(base_dir), tmp_path / "adapter").eval()
  got = torch_logits(peft_model)
  np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
  assert np.abs(got - torch_logits(load_torch(base_dir))).max() > 0.1  # adapters at work

  scale = ALPHA / (math.sqrt(RANK) if rslora else RANK)  # 4 with rsLoRA, else 2
  q = model.dense_layers.attn.q_proj  # kernel [layers, hidden, heads, head_dim]
  w, a, b = (np.asarray(v[...], np.float64) for v in (q.kernel, q.kernel_lora_a, q.kernel_lora_b))
  merged = peft_model.merge_and_unload().state_dict()
  for layer in range(QWEN2["num_hidden_layers"]):
    numpy_merged = w[layer].reshape(w.shape[1], -1) + scale * a[layer] @ b[layer]  # [in, out]
    got_w = merged[f"model.layers.{layer}.self_attn.q_proj.weight"].numpy().T
    np.testing.assert_allclose(got_w, numpy_merged, atol=1e-6, rtol=0)

  again = peft_format.load_adapter(base, tmp_path / "adapter")  # forward: the next test
  assert again.cfg == model.cfg
  jax.tree.map(np.testing.assert_array_equal, nnx.state(again, nnx.LoRAParam),
               nnx.state(model, nnx.LoRAParam))


def test_rslora_merged_export_and_peft_resave(base_dir, base, adapted, tmp_path):
  """With rsLoRA, the merged HF export loads in transformers with the LoRA model's logits and
  differs from the alpha / r model; PEFT's own save of the loaded adapters reads back into
  Arbor with the same forward."""
  model = adapted[True]
  want = arbor_logits(model)
  assert np.abs(want - arbor_logits(adapted[False])).max() > 0.1
  hf.save(transformer.merge_adapters(model), tmp_path / "merged")
  np.testing.assert_allclose(torch_logits(load_torch(tmp_path / "merged")), want, atol=ATOL,
                             rtol=RTOL)
  peft_format.save_adapter(model, tmp_path / "adapter")
  peft_model = PeftModel.from_pretrained(load_torch(base_dir), tmp_path / "adapter")
  peft_model.save_pretrained(tmp_path / "resaved")
  resaved = peft_format.load_adapter(base, tmp_path / "resaved", cfg=model.cfg)
  np.testing.assert_allclose(arbor_logits(resaved), want, atol=1e-6, rtol=0)


def test_mla_attention_adapters_load_in_peft(tmp_path):
  """DeepSeek-V3's attention adapters (q_a_proj, q_b_proj, kv_a_proj_with_mqa, o_proj; rsLoRA):
  PEFT on the transformers model gives the Arbor LoRA model's logits."""
  torch.manual_seed(0)
  AutoModelForCausalLM.from_config(DeepseekV3Config(**DEEPSEEK)).save_pretrained(tmp_path / "base")
  base = hf.load(tmp_path / "base")
  model = with_random_adapters(base, rslora=True, modules=("attention",))
  info = peft_format.save_adapter(model, tmp_path / "adapter")
  assert info["target_modules"] == ["kv_a_proj_with_mqa", "o_proj", "q_a_proj", "q_b_proj"]
  peft_model = PeftModel.from_pretrained(load_torch(tmp_path / "base"), tmp_path / "adapter")
  got = torch_logits(peft_model.eval())
  np.testing.assert_allclose(got, arbor_logits(model), atol=ATOL, rtol=RTOL)
  assert np.abs(got - torch_logits(load_torch(tmp_path / "base"))).max() > 0.1


def test_unstacked_model_writes_the_same_adapters(adapted):
  stacked = peft_format.adapter_tensors(adapted[False])
  unstacked = peft_format.adapter_tensors(transformer.unstack(adapted[False]))
  assert stacked.keys() == unstacked.keys()
  for name in stacked:
    np.testing.assert_array_equal(stacked[name], unstacked[name])
  a = stacked["base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"]
  b = stacked["base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight"]
  assert a.shape == (RANK, 64) and b.shape == (64, RANK)  # [r, heads * head_dim], [hidden, r]


def edited(adapter_dir, path, **changes):
  """A copy of `adapter_dir` at `path` with fields of its adapter_config.json changed."""
  shutil.copytree(adapter_dir, path, dirs_exist_ok=True)
  edit(path, **changes)
  return path


def edit(path, **changes):
  file = path / peft_format.CONFIG_NAME
  config = json.loads(file.read_text())
  config.update(changes)
  file.write_text(json.dumps(config))


@pytest.mark.parametrize("field, value, match", [
    ("r", 0, r"r=0: expected a positive integer"),
    ("lora_alpha", -1.0, r"lora_alpha=-1.0: expected a positive number"),
    ("use_rslora", "yes", r"use_rslora='yes'"),
    ("target_modules", ["q_proj", "v_proj"], r"target_modules=\['q_proj', 'v_proj'\]: Arbor "
     r"adapts whole groups.*attention = \['k_proj', 'o_proj', 'q_proj', 'v_proj'\]"),
    ("target_modules", "all-linear", r"target_modules='all-linear'"),
    ("use_dora", True, r"use_dora=True: not supported"),
    ("peft_type", "IA3", r"peft_type='IA3'"),
])
def test_bad_adapter_config_names_the_field(field, value, match, base, adapter_dir, tmp_path):
  path = edited(adapter_dir, tmp_path, **{field: value})
  with pytest.raises(peft_format.AdapterError, match=match):
    peft_format.load_adapter(base, path)


def test_adapter_mismatches_are_refused(base, adapted, adapter_dir, tmp_path):
  """A rank whose tensors disagree, settings unlike the expected config, tensors of projections
  not targeted, an adapted base, routed-expert adapters, MLP adapters of a MoE model."""
  edited(adapter_dir, tmp_path, r=8)
  with pytest.raises(peft_format.AdapterError, match=r"has shape \[4, 64\]: not rank r=8"):
    peft_format.load_adapter(base, tmp_path)
  edit(tmp_path, r=RANK, use_rslora=True)
  with pytest.raises(peft_format.AdapterError,
                     match=r"lora_rslora=True, but ModelConfig.lora_rslora=False"):
    peft_format.load_adapter(base, tmp_path, cfg=adapted[False].cfg)
  edit(tmp_path, use_rslora=False, target_modules=["k_proj", "o_proj", "q_proj", "v_proj"])
  with pytest.raises(peft_format.AdapterError, match=r"12 tensor\(s\) .* belong to no adapted"):
    peft_format.load_adapter(base, tmp_path)
  with pytest.raises(peft_format.AdapterError, match="has adapters already"):
    peft_format.load_adapter(adapted[False], tmp_path)
  experts = TINY_MOE_MLA.replace(lora_rank=RANK, lora_modules=("attention", "experts"))
  with pytest.raises(peft_format.AdapterError, match=r"routed-expert adapters .* not written"):
    peft_format.adapter_config(experts)
  # peft reads gate_proj / up_proj / down_proj of a MoE family as its routed experts
  moe_mlp = TINY_MOE_MLA.replace(lora_rank=RANK, lora_modules=("attention", "mlp"))
  with pytest.raises(peft_format.AdapterError, match=r"lora_modules=\('attention', 'mlp'\): "
                     r"PEFT cannot hold the 'mlp' adapters"):
    peft_format.adapter_config(moe_mlp)


def test_rslora_config_is_validated():
  with pytest.raises(ValueError, match=r"ModelConfig.lora_rslora='yes'"):
    TINY_MOE_MLA.replace(lora_rank=RANK, lora_rslora="yes")
  # a run's config.model.lora.rslora reaches the model's config
  c = sft_demo.get_config()
  c.model.lora.rank, c.model.lora.rslora = RANK, True
  assert config_lib.model_config(c).lora_rslora is True
  c.model.lora.rslora = False
  assert config_lib.model_config(c).lora_rslora is False


def test_cli_writes_a_runs_adapters(base_dir, base, adapted, tmp_path):
  """`python -m trainer.export --format peft` on a LoRA run's checkpoint (an hf:DIR run, rsLoRA)
  writes the checkpoint's adapters with the run's base as base_model_name_or_path; a run
  without adapters is refused."""
  model = adapted[True]
  config = sft_demo.get_config()
  config.model.init = f"hf:{base_dir}"
  config.model.overrides.vocab_size = None  # the checkpoint's
  config.model.lora.rank, config.model.lora.alpha, config.model.lora.rslora = RANK, ALPHA, True
  workdir = tmp_path / "run"
  harness.write_run_files(config, model.cfg, str(workdir))
  opt = O.build(config.optimizer, model.cfg)
  state = S.create(model.cfg, opt, model=base)
  state = state.replace(params=nnx.as_pure(nnx.state(model, nnx.LoRAParam)))
  with checkpoint.Checkpointer(str(workdir / "checkpoints"), async_save=False) as ckpt:
    ckpt.save(7, S.without_base(state, model.cfg), {}, force=True)
  out = tmp_path / "adapter"
  assert export.main(["--ckpt", str(workdir), "--out", str(out), "--format", "peft"]) == 0
  written = json.loads((out / peft_format.CONFIG_NAME).read_text())
  assert (written["base_model_name_or_path"], written["use_rslora"]) == (str(base_dir), True)
  want = peft_format.adapter_tensors(model)
  got = safetensors.numpy.load_file(out / peft_format.WEIGHTS_NAME)
  assert got.keys() == want.keys()
  for name in want:
    np.testing.assert_array_equal(got[name], want[name])
  full = tmp_path / "full"
  harness.write_run_files(sft_demo.get_config(), base.cfg, str(full))  # lora.rank 0
  assert export.main(["--ckpt", str(full), "--out", str(tmp_path / "x"), "--format", "peft"]) == 2
