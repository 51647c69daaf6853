"""Named model configurations and an analytic parameter count.

`PRESETS` maps a name to a `ModelConfig`. The published presets copy the Hugging Face `config.json`
of the named checkpoint (sizes, RoPE, routing); training-only knobs that a config.json does not
carry (`bias_update_rate`, `seq_balance_coef`) follow the DeepSeek-V3 paper. The `tiny-*` presets
are small enough to build and run in unit tests.

Long contexts. The Qwen checkpoints ship without YaRN (`config.json` has no `rope_scaling`); their
model cards enable 128K contexts with YaRN x4 over the 32,768 pre-training positions. The
`-128k` presets are those settings (`QWEN_YARN_128K`); for a checkpoint import the same fields go
in `model.overrides` (`configs/long_context.py`). DeepSeek-V3 and Kimi K2 ship with YaRN in their
config.json and their presets carry it. `LONG_CONTEXT` maps each long-context variant to the
preset it extends (the same weights).

`count_params(cfg)` counts the parameters of the model a config describes, from the config alone;
`count_active_params(cfg)` counts those one token passes through (top-k routed experts only).
"""

from __future__ import annotations

from models.config import ModelConfig

# --- families: shared fields, one `replace` per size below.

# Qwen2.5 / Qwen2.5-Coder: GQA with q/k/v bias. Vocabulary 151936 up to 3B, 152064 from 7B.
# max_position_embeddings is the config.json value (32768); 128K context needs YaRN factor 4.
_QWEN25 = ModelConfig(vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1e6,
                      max_position_embeddings=32768, qkv_bias=True, head_dim=128)

# The Qwen2.5-Coder (7B and up) and Qwen3 (4B and up) model cards' 128K setting: `rope_scaling`
# {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}; transformers'
# YaRN defaults give beta_fast 32, beta_slow 1 and a cos/sin factor 0.1 ln 4 + 1 (no softmax
# mscale for GQA). Usable as `ModelConfig.replace(**QWEN_YARN_128K)` or as model overrides.
QWEN_YARN_128K = dict(rope_type="yarn", rope_factor=4.0, rope_original_max_position=32768,
                      max_position_embeddings=131072)

# Qwen3 dense: GQA with per-head q/k RMSNorm, no bias, head_dim 128 at every size.
_QWEN3 = ModelConfig(vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1e6,
                     max_position_embeddings=40960, qk_norm=True, head_dim=128)

# DeepSeek-V3: MLA attention, sigmoid group-limited routing with aux-loss-free bias, YaRN x40.
_DEEPSEEK_V3 = ModelConfig(
    vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128, num_kv_heads=128,
    intermediate_size=18432, rms_norm_eps=1e-6, max_position_embeddings=163840,
    rope_theta=10000.0, rope_type="yarn", rope_factor=40.0, rope_original_max_position=4096,
    yarn_beta_fast=32.0, yarn_beta_slow=1.0, yarn_mscale=1.0, yarn_mscale_all_dim=1.0,
    attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128,
    num_experts=256, num_shared_experts=1, experts_per_token=8, n_group=8, topk_group=4,
    score_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
    first_k_dense_replace=3, moe_intermediate_size=2048, router_bias=True,
    bias_update_rate=1e-3, seq_balance_coef=1e-4)

# A DeepSeek-V3-shaped model for tests and the demo: MLA, sigmoid group-limited routing with the
# selection bias, 1 dense + 2 MoE layers of 8 routed experts + 1 shared.
_TINY_MOE_MLA = ModelConfig(
    vocab_size=256, hidden_size=64, num_layers=3, num_heads=4, intermediate_size=128,
    attention="mla", q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16,
    num_experts=8, num_shared_experts=1, experts_per_token=2, n_group=2, topk_group=1,
    score_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.0,
    first_k_dense_replace=1, moe_intermediate_size=32, router_bias=True,
    seq_balance_coef=1e-4)

PRESETS: dict[str, ModelConfig] = {
    # Qwen/Qwen2.5-Coder-{0.5B,1.5B,7B,14B,32B}
    "qwen2.5-coder-0.5b": _QWEN25.replace(
        hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
        intermediate_size=4864, tie_embeddings=True),
    "qwen2.5-coder-1.5b": _QWEN25.replace(
        hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
        intermediate_size=8960, tie_embeddings=True),
    "qwen2.5-coder-7b": _QWEN25.replace(
        vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
        intermediate_size=18944),
    "qwen2.5-coder-14b": _QWEN25.replace(
        vocab_size=152064, hidden_size=5120, num_layers=48, num_heads=40, num_kv_heads=8,
        intermediate_size=13824),
    "qwen2.5-coder-32b": _QWEN25.replace(
        vocab_size=152064, hidden_size=5120, num_layers=64, num_heads=40, num_kv_heads=8,
        intermediate_size=27648),
    # Qwen/Qwen3-{0.6B,1.7B,4B,8B,14B,32B}
    "qwen3-0.6b": _QWEN3.replace(
        hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, intermediate_size=3072,
        tie_embeddings=True),
    "qwen3-1.7b": _QWEN3.replace(
        hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8, intermediate_size=6144,
        tie_embeddings=True),
    "qwen3-4b": _QWEN3.replace(
        hidden_size=2560, num_layers=36, num_heads=32, num_kv_heads=8, intermediate_size=9728,
        tie_embeddings=True),
    "qwen3-8b": _QWEN3.replace(
        hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8, intermediate_size=12288),
    "qwen3-14b": _QWEN3.replace(
        hidden_size=5120, num_layers=40, num_heads=40, num_kv_heads=8, intermediate_size=17408),
    "qwen3-32b": _QWEN3.replace(
        hidden_size=5120, num_layers=64, num_heads=64, num_kv_heads=8, intermediate_size=25600),
    # Qwen/Qwen3-30B-A3B: every layer MoE, softmax top-8 of 128, no shared expert.
    # (intermediate_size 6144 is in the config.json but unused: there is no dense layer.)
    "qwen3-30b-a3b": _QWEN3.replace(
        hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, intermediate_size=6144,
        num_experts=128, experts_per_token=8, score_func="softmax", norm_topk_prob=True,
        moe_intermediate_size=768),
    # deepseek-ai/DeepSeek-V3 (main model; the multi-token-prediction layer is not modelled).
    "deepseek-v3": _DEEPSEEK_V3,
    # moonshotai/Kimi-K2-Instruct (July 2025 release; the -0905 update has a 256K context and
    # YaRN x64): DeepSeek-V3 architecture, 64 heads, 384 experts, no expert groups.
    "kimi-k2": _DEEPSEEK_V3.replace(
        vocab_size=163840, num_heads=64, num_kv_heads=64, max_position_embeddings=131072,
        rope_theta=50000.0, rope_factor=32.0, yarn_beta_fast=1.0, yarn_beta_slow=1.0,
        num_experts=384, n_group=1, topk_group=1, routed_scaling_factor=2.827,
        first_k_dense_replace=1),
    # moonshotai/Moonlight-16B-A3B: DeepSeek-V3 architecture, direct q projection, no YaRN.
    "moonlight-16b-a3b": _DEEPSEEK_V3.replace(
        vocab_size=163840, hidden_size=2048, num_layers=27, num_heads=16, num_kv_heads=16,
        intermediate_size=11264, rms_norm_eps=1e-5, max_position_embeddings=8192,
        rope_theta=50000.0, rope_type="default", rope_factor=1.0, yarn_mscale_all_dim=0.0,
        q_lora_rank=None, num_experts=64, num_shared_experts=2, experts_per_token=6, n_group=1,
        topk_group=1, routed_scaling_factor=2.446, first_k_dense_replace=1,
        moe_intermediate_size=1408),
    # moonshotai/Kimi-K2-Instruct-0905: the same weights layout, 256K context (YaRN x64).
    "kimi-k2-0905": _DEEPSEEK_V3.replace(
        vocab_size=163840, num_heads=64, num_kv_heads=64, max_position_embeddings=262144,
        rope_theta=50000.0, rope_factor=64.0, yarn_beta_fast=1.0, yarn_beta_slow=1.0,
        num_experts=384, n_group=1, topk_group=1, routed_scaling_factor=2.827,
        first_k_dense_replace=1),
    # --- tiny presets for tests
    "tiny-dense": ModelConfig(
        vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, qkv_bias=True),
    "tiny-qwen3": ModelConfig(
        vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, qk_norm=True, tie_embeddings=True),
    "tiny-moe-mla": _TINY_MOE_MLA,
    # The demo's model (configs/sft_demo.py): tiny-moe-mla at twice the width. At hidden 64 the
    # demo's SFT model copied the file path from the search output only about half the time.
    "tiny-moe-mla-x2": _TINY_MOE_MLA.replace(
        hidden_size=128, intermediate_size=256, q_lora_rank=64, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, moe_intermediate_size=64),
    "tiny-qwen3-moe": ModelConfig(
        vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, qk_norm=True,
        num_experts=8, experts_per_token=2, score_func="softmax", norm_topk_prob=True,
        moe_intermediate_size=32),
    # Long-context test models: tiny-dense (Qwen2 layout) with the Qwen 128K YaRN recipe, and
    # tiny-moe-mla with DeepSeek-V3's YaRN (x40 over 4,096 positions, softmax mscale^2).
    "tiny-dense-yarn": ModelConfig(
        vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, qkv_bias=True, rope_theta=1e6, **QWEN_YARN_128K),
    "tiny-moe-mla-yarn": _TINY_MOE_MLA.replace(
        max_position_embeddings=163840, rope_theta=10000.0, rope_type="yarn", rope_factor=40.0,
        rope_original_max_position=4096, yarn_beta_fast=32.0, yarn_beta_slow=1.0,
        yarn_mscale=1.0, yarn_mscale_all_dim=1.0),
}

# Long-context variants -> the preset whose weights they use.
LONG_CONTEXT: dict[str, str] = {"kimi-k2-0905": "kimi-k2"}
for _name in ("qwen2.5-coder-7b", "qwen2.5-coder-14b", "qwen2.5-coder-32b", "qwen3-4b",
              "qwen3-8b", "qwen3-14b", "qwen3-32b", "qwen3-30b-a3b"):
  PRESETS[f"{_name}-128k"] = PRESETS[_name].replace(**QWEN_YARN_128K)
  LONG_CONTEXT[f"{_name}-128k"] = _name


def get_preset(name: str) -> ModelConfig:
  """The ModelConfig of a named preset.

  Args:
    name: a key of `PRESETS`.

  Returns:
    The preset's config.

  Raises:
    KeyError: no preset has that name (the message lists the valid names).
  """
  try:
    return PRESETS[name]
  except KeyError:
    raise KeyError(f"unknown preset {name!r}; valid presets: "
                   f"{', '.join(sorted(PRESETS))}") from None


def _attention_params(cfg: ModelConfig) -> int:
  """Parameters of one attention block (projections, their biases, inner norms)."""
  h, n = cfg.hidden_size, cfg.num_heads
  if cfg.attention == "gqa":
    q, kv = n * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    count = h * q + 2 * h * kv + q * h                # q_proj, k_proj, v_proj, o_proj
    if cfg.qkv_bias:
      count += q + 2 * kv                             # q/k/v biases
    if cfg.qk_norm:
      count += 2 * cfg.head_dim                       # q_norm, k_norm gains (shared by heads)
    return count
  qk = n * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
  if cfg.q_lora_rank is None:
    count = h * qk                                    # q_proj
  else:
    count = h * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * qk  # q_a, q_a_norm, q_b
  count += h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)  # kv_a_proj_with_mqa
  count += cfg.kv_lora_rank                               # kv_a_layernorm
  count += cfg.kv_lora_rank * n * (cfg.qk_nope_head_dim + cfg.v_head_dim)  # kv_b_proj
  count += n * cfg.v_head_dim * h                         # o_proj
  return count


def _moe_params(cfg: ModelConfig, experts: int, include_buffers: bool) -> int:
  """Parameters of one MoE block whose routed experts number `experts`."""
  h, m = cfg.hidden_size, cfg.moe_intermediate_size
  count = h * cfg.num_experts                       # router
  count += experts * 3 * h * m                      # routed experts (gate, up, down)
  count += cfg.num_shared_experts * 3 * h * m       # shared experts
  if include_buffers and cfg.router_bias:
    count += cfg.num_experts                        # e_score_correction_bias
  return count


def _count(cfg: ModelConfig, experts: int, include_buffers: bool) -> int:
  h, v = cfg.hidden_size, cfg.vocab_size
  count = v * h                                     # token embedding
  if not cfg.tie_embeddings:
    count += v * h                                  # lm_head
  count += h                                        # final norm
  count += cfg.num_layers * (_attention_params(cfg) + 2 * h)  # attention + two norms per layer
  count += cfg.num_dense_layers * 3 * h * cfg.intermediate_size  # dense SwiGLU (gate, up, down)
  count += cfg.num_moe_layers * _moe_params(cfg, experts, include_buffers)
  return count


def count_params(cfg: ModelConfig, include_buffers: bool = False) -> int:
  """Total parameters of the model `cfg` describes, computed from the config alone.

  Counted per block: embedding [vocab, hidden]; lm_head [hidden, vocab] unless tied; final norm
  [hidden]. Per layer: two RMSNorm gains [hidden]; attention —
    GQA: q [hidden, heads*head_dim], k and v [hidden, kv_heads*head_dim], o [heads*head_dim,
      hidden], biases on q/k/v if `qkv_bias`, q_norm and k_norm [head_dim] if `qk_norm`;
    MLA: q_proj [hidden, heads*(nope+rope)], or q_a_proj [hidden, q_lora] + q_a_layernorm
      [q_lora] + q_b_proj [q_lora, heads*(nope+rope)]; kv_a_proj_with_mqa [hidden, kv_lora+rope];
      kv_a_layernorm [kv_lora]; kv_b_proj [kv_lora, heads*(nope+v)]; o_proj [heads*v, hidden];
  then the MLP — dense layers 3*hidden*intermediate; MoE layers a router [hidden, experts], each
  routed expert 3*hidden*moe_intermediate and the shared experts 3*hidden*moe_intermediate each.
  No projection has a bias except the GQA q/k/v biases. RoPE tables are not counted.

  Args:
    cfg: the model config.
    include_buffers: also count the aux-loss-free router bias (`e_score_correction_bias`,
      [experts] per MoE layer), which is state, not a trained parameter. Checkpoints store it,
      so checkpoint tensor counts match `include_buffers=True`.

  Returns:
    The number of scalar parameters.
  """
  return _count(cfg, cfg.num_experts, include_buffers)


def count_active_params(cfg: ModelConfig, include_buffers: bool = False) -> int:
  """Parameters one token passes through.

  As `count_params`, with `experts_per_token` routed experts per MoE layer instead of all of
  them. Embedding and lm_head count in full, the convention behind the DeepSeek-V3 and Qwen3
  model cards' figures (the Moonlight report leaves embeddings out). Equal to `count_params` for
  dense models.

  Args:
    cfg: the model config.
    include_buffers: also count the router bias (see `count_params`).

  Returns:
    The number of scalar parameters.
  """
  return _count(cfg, cfg.experts_per_token if cfg.is_moe else 0, include_buffers)
