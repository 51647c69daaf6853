"""Model configuration: one frozen dataclass for dense GQA and MoE + MLA transformers.

Every field has a one-line comment. `ModelConfig.__post_init__` validates the values and raises
a `ValueError` naming the field and the value, so a bad config fails at construction time.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

ATTENTION_TYPES = ("gqa", "mla")
ROPE_TYPES = ("default", "linear", "yarn")
SCORE_FUNCS = ("softmax", "sigmoid")
MOE_IMPLS = ("ragged", "dense")
MOE_DISPATCHES = ("auto", "global", "all_to_all")
REMAT_POLICIES = ("none", "full", "save_dots", "offload")
ATTENTION_IMPLS = ("xla", "xla_flash", "pallas_tpu", "pallas_gpu", "auto")
DTYPES = ("float32", "bfloat16", "float16")

# Logical axis name -> mesh axes. Parameters and activations are annotated with logical names
# (models/sharding.py resolves them). `None` means replicated.
DEFAULT_SHARDING_RULES: tuple[tuple[str, Optional[tuple[str, ...]]], ...] = (
    ("batch", ("data", "fsdp", "expert")),  # activation batch dimension (tokens)
    ("seq", ("sequence",)),        # activation sequence dimension (context parallelism)
    ("act_embed", None),           # activation hidden dimension
    ("act_heads", ("tensor",)),    # activation head dimension
    ("act_mlp", ("tensor",)),      # activation MLP dimension
    ("act_vocab", ("tensor",)),    # activation vocabulary dimension (logits)
    ("vocab", ("tensor",)),        # embedding / lm_head vocabulary dimension
    ("embed", ("fsdp", "sequence")),  # parameter hidden dimension (FSDP over fsdp x sequence)
    ("heads", ("tensor",)),        # attention heads (query, and key/value in GQA)
    ("kv", None),                  # per-head feature dimension
    ("kv_heads", ("tensor",)),     # key/value heads
    ("q_lora", None),              # MLA query low rank dimension
    ("kv_lora", None),             # MLA key/value latent dimension
    ("mlp", ("tensor",)),          # MLP intermediate dimension
    ("experts", ("expert",)),      # MoE expert dimension (expert parallelism)
    ("expert_mlp", ("tensor",)),   # MoE expert intermediate dimension
    ("layers", None),              # stacked-layer dimension (scanned)
    ("norm", None),                # norm gains
)


# what LoRA adapts (models/lora.py): attention projections, dense MLPs (and shared experts),
# routed experts; MLA's kv_b_proj is absorbed into the query and output for decoding, so never
LORA_MODULES = ("attention", "mlp", "experts")
LORA_EXPERTS = ("per_expert", "shared")
BASE_QTYPES = ("int8", "int4", "float8_e4m3fn", "float8_e5m2")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture and numerics of a decoder-only transformer.

  Dense models (Qwen2.5, Qwen3) use `attention="gqa"` and `num_experts=0`. DeepSeek-V3 style
  models use `attention="mla"` and `num_experts>0`; layers below `first_k_dense_replace` stay
  dense. Qwen3-MoE uses GQA attention with softmax routing and no shared experts.
  """

  # --- sizes
  vocab_size: int = 256  # vocabulary size (embedding rows, logits width)
  hidden_size: int = 64  # model width
  num_layers: int = 2  # number of transformer blocks
  num_heads: int = 4  # query heads
  num_kv_heads: int = 2  # key/value heads (GQA); ignored by MLA (each head has its own key)
  head_dim: int = 16  # per-head width for GQA
  intermediate_size: int = 128  # dense SwiGLU width
  rms_norm_eps: float = 1e-6  # RMSNorm epsilon
  tie_embeddings: bool = False  # lm_head shares the embedding matrix
  max_position_embeddings: int = 4096  # longest position the model is configured for
  # --- rotary embeddings
  rope_theta: float = 10000.0  # RoPE base
  rope_type: str = "default"  # "default" | "linear" | "yarn"
  rope_factor: float = 1.0  # context extension factor (linear and yarn)
  rope_original_max_position: int = 4096  # pre-extension context length (yarn)
  yarn_beta_fast: float = 32.0  # YaRN extrapolation boundary (rotations)
  yarn_beta_slow: float = 1.0  # YaRN interpolation boundary (rotations)
  yarn_mscale: float = 0.0  # YaRN mscale; 0 = unset (cos/sin factor then 0.1·ln(factor)+1)
  # YaRN mscale_all_dim: 0 = none; > 0 also scales the MLA softmax by mscale^2
  yarn_mscale_all_dim: float = 0.0
  yarn_truncate: bool = True  # round the YaRN correction range to integers (HF default)
  # explicit cos/sin factor; None = derived from mscale
  yarn_attention_factor: Optional[float] = None
  # --- GQA options
  qkv_bias: bool = False  # Qwen2: bias on q/k/v projections
  qk_norm: bool = False  # Qwen3: per-head RMSNorm on queries and keys before RoPE
  # --- attention type and MLA
  attention: str = "gqa"  # "gqa" | "mla"
  q_lora_rank: Optional[int] = None  # MLA query compression rank; None = direct q projection
  kv_lora_rank: int = 32  # MLA latent width (cached at decode)
  qk_nope_head_dim: int = 16  # MLA per-head query/key width without RoPE
  qk_rope_head_dim: int = 8  # MLA per-head rotary width (the rotary key is shared by all heads)
  v_head_dim: int = 16  # MLA per-head value width
  # MLA: rotate interleaved pairs (x0,x1),(x2,x3)... as DeepSeek weights
  rope_interleave: bool = True
  # MLA: the full forward pass attends in latent space like the decode path (W_UK absorbed into
  # the query, W_UV applied after the weighted sum), so a bf16 sampler and trainer compute the
  # same products; costs r/d_nope (QK) and r/d_v (PV) times the attention FLOPs (docs/numerics.md)
  mla_absorbed_training: bool = False
  # --- mixture of experts
  num_experts: int = 0  # routed experts; 0 = dense model
  # always-active shared experts (one MLP of width n * moe_intermediate_size)
  num_shared_experts: int = 0
  experts_per_token: int = 2  # top-k
  n_group: int = 1  # expert groups for group-limited routing
  topk_group: int = 1  # groups kept per token
  score_func: str = "softmax"  # router scores: "softmax" (Qwen3-MoE) | "sigmoid" (DeepSeek-V3)
  norm_topk_prob: bool = True  # renormalise the chosen gate weights to sum to 1
  routed_scaling_factor: float = 1.0  # multiply the gate weights (DeepSeek-V3: 2.5)
  first_k_dense_replace: int = 0  # the first k layers use a dense MLP
  moe_intermediate_size: int = 32  # per-expert SwiGLU width
  router_bias: bool = False  # aux-loss-free selection bias (DeepSeek `e_score_correction_bias`)
  bias_update_rate: float = 1e-3  # aux-loss-free bias step: b += rate * sign(mean_load - load)
  seq_balance_coef: float = 0.0  # sequence-wise balance loss coefficient (DeepSeek-V3: 1e-4)
  # "ragged" (dropless, sorted + ragged_dot) | "dense" (reference, all experts)
  moe_impl: str = "ragged"
  # tokens to experts: "all_to_all" (expert parallelism) | "global" (one sort of all tokens,
  # partitioned by XLA) | "auto" (all_to_all when the mesh's expert axis is > 1)
  moe_dispatch: str = "auto"
  # all_to_all dispatch: at most this many tokens per device per exchange round (a round's
  # buffers hold expert-parallel size · chunk · experts_per_token rows); 0 = all in one round
  moe_dispatch_chunk: int = 4096
  # --- numerics and memory
  dtype: str = "float32"  # compute dtype; params stay fp32, logits and losses fp32
  remat: str = "none"  # "none" | "full" | "save_dots" | "offload" rematerialisation per block
  # "xla" reference | "xla_flash" (blocked, skips masked blocks) | "pallas_tpu" | "pallas_gpu"
  # | "auto" (by backend)
  attention_impl: str = "xla"
  scan_layers: bool = True  # lax.scan over the stacked layers; False: a Python loop over them
  logits_chunk: int = 1024  # tokens per vocabulary-projection chunk in log-prob helpers
  initializer_range: float = 0.02  # stddev of the normal initialiser
  sharding_rules: tuple = DEFAULT_SHARDING_RULES  # logical axis -> mesh axes table
  # --- LoRA / QLoRA (models/lora.py, through qwix): the base frozen, adapters trained
  lora_rank: int = 0  # adapter rank; 0 = no adapters (full fine-tuning)
  lora_alpha: float = 16.0  # adapter output scale alpha / rank
  lora_rslora: bool = False  # rank-stabilised LoRA: output scale alpha / sqrt(rank) instead
  lora_dropout: float = 0.0  # dropout on the adapters' input, in training steps only
  lora_modules: tuple = ("attention", "mlp")  # projections with adapters (LORA_MODULES)
  # routed experts' adapters ("experts" in lora_modules): "per_expert" (A [E, in, r], B [E, r,
  # out] per layer) | "shared" (one A [in, r], B [r, out] per layer, added to every expert)
  lora_experts: str = "per_expert"
  # the frozen base's storage: None (the parameter dtype) or a qwix type, e.g. "int8",
  # "int4", "float8_e4m3fn" (QLoRA); needs lora_rank > 0
  base_qtype: Optional[str] = None

  def __post_init__(self):
    def fail(field, value, why):
      raise ValueError(f"ModelConfig.{field}={value!r}: {why}")

    for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                  "logits_chunk"):
      if getattr(self, field) <= 0:
        fail(field, getattr(self, field), "must be positive")
    for field, choices in (("attention", ATTENTION_TYPES), ("rope_type", ROPE_TYPES),
                           ("score_func", SCORE_FUNCS), ("moe_impl", MOE_IMPLS),
                           ("moe_dispatch", MOE_DISPATCHES),
                           ("remat", REMAT_POLICIES), ("dtype", DTYPES),
                           ("attention_impl", ATTENTION_IMPLS)):
      if getattr(self, field) not in choices:
        fail(field, getattr(self, field), f"expected one of {choices}")
    if self.attention == "gqa":
      if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
        fail("num_kv_heads", self.num_kv_heads,
             f"must divide num_heads={self.num_heads}")
      if self.head_dim <= 0 or self.head_dim % 2:
        fail("head_dim", self.head_dim, "must be positive and even (RoPE rotates pairs)")
      if self.mla_absorbed_training:
        fail("mla_absorbed_training", True, "False for attention='gqa' (an MLA option)")
    else:
      if self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2:
        fail("qk_rope_head_dim", self.qk_rope_head_dim, "must be positive and even")
      for field in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        if getattr(self, field) <= 0:
          fail(field, getattr(self, field), "must be positive for MLA")
      if self.q_lora_rank is not None and self.q_lora_rank <= 0:
        fail("q_lora_rank", self.q_lora_rank, "must be positive or None")
    if self.rope_type != "default" and self.rope_factor <= 0:
      fail("rope_factor", self.rope_factor, "must be positive")
    if self.num_experts < 0:
      fail("num_experts", self.num_experts, "must be >= 0")
    if self.moe_dispatch_chunk < 0:
      fail("moe_dispatch_chunk", self.moe_dispatch_chunk,
           "must be >= 0 (tokens per device per exchange round; 0 = all in one round)")
    if self.num_experts:
      if not 0 < self.experts_per_token <= self.num_experts:
        fail("experts_per_token", self.experts_per_token,
             f"must be in [1, num_experts={self.num_experts}]")
      if self.n_group <= 0 or self.num_experts % self.n_group:
        fail("n_group", self.n_group, f"must divide num_experts={self.num_experts}")
      if not 0 < self.topk_group <= self.n_group:
        fail("topk_group", self.topk_group, f"must be in [1, n_group={self.n_group}]")
      if self.n_group > 1 and self.num_experts // self.n_group < 2:
        fail("n_group", self.n_group, "group-limited routing needs >= 2 experts per group")
      if self.topk_group * self.num_experts // self.n_group < self.experts_per_token:
        fail("topk_group", self.topk_group,
             f"keeps fewer experts than experts_per_token={self.experts_per_token}")
      if not 0 <= self.first_k_dense_replace <= self.num_layers:
        fail("first_k_dense_replace", self.first_k_dense_replace,
             f"must be in [0, num_layers={self.num_layers}]")
      if self.moe_intermediate_size <= 0:
        fail("moe_intermediate_size", self.moe_intermediate_size, "must be positive")
      if self.moe_impl == "dense" and self.moe_dispatch == "all_to_all":
        fail("moe_dispatch", self.moe_dispatch, "needs moe_impl='ragged'")
    for name, _ in self.sharding_rules:
      if not isinstance(name, str):
        fail("sharding_rules", name, "logical axis names must be strings")
    if self.lora_rank < 0:
      fail("lora_rank", self.lora_rank, "must be >= 0 (0 = no adapters)")
    if self.lora_rank:
      if self.lora_alpha <= 0:
        fail("lora_alpha", self.lora_alpha, "must be positive")
      if not isinstance(self.lora_rslora, bool):
        fail("lora_rslora", self.lora_rslora, "must be True or False")
      if not 0.0 <= self.lora_dropout < 1.0:
        fail("lora_dropout", self.lora_dropout, "must be in [0, 1)")
      if not self.lora_modules or set(self.lora_modules) - set(LORA_MODULES):
        fail("lora_modules", self.lora_modules, f"expected a non-empty subset of {LORA_MODULES}")
      if set(self.lora_modules) == {"experts"} and not self.num_experts:
        fail("lora_modules", self.lora_modules, "a model without routed experts has no "
             "'experts' to adapt")
      if self.lora_experts not in LORA_EXPERTS:
        fail("lora_experts", self.lora_experts, f"expected one of {LORA_EXPERTS}")
      if self.lora_experts_on:
        # the adapters join the routed experts' grouped matmuls, which the all-experts
        # reference and the expert-parallel shard_map do not run under qwix's interception
        if self.moe_impl != "ragged":
          fail("moe_impl", self.moe_impl, "routed-expert adapters (lora_modules with 'experts') "
               "need moe_impl='ragged'")
        if self.moe_dispatch == "all_to_all":
          fail("moe_dispatch", self.moe_dispatch, "routed-expert adapters (lora_modules with "
               "'experts') run with the global dispatch ('global' or 'auto')")
    if self.base_qtype is not None:
      if self.num_experts and self.moe_impl != "ragged":
        fail("base_qtype", self.base_qtype, "quantized routed experts need moe_impl='ragged'")
      if not self.lora_rank:
        fail("base_qtype", self.base_qtype, "a quantized frozen base needs lora_rank > 0")
      if self.base_qtype not in BASE_QTYPES:
        fail("base_qtype", self.base_qtype, f"expected None or one of {BASE_QTYPES}")

  # --- derived sizes
  @property
  def is_moe(self) -> bool:
    """Whether the model has routed experts."""
    return self.num_experts > 0

  @property
  def lora_experts_on(self) -> bool:
    """Whether the routed experts carry LoRA adapters."""
    return bool(self.lora_rank and self.num_experts and "experts" in self.lora_modules)

  @property
  def num_dense_layers(self) -> int:
    """Leading layers with a dense MLP (all layers of a dense model)."""
    return self.first_k_dense_replace if self.is_moe else self.num_layers

  @property
  def num_moe_layers(self) -> int:
    """Layers with a MoE MLP (after the dense ones)."""
    return self.num_layers - self.num_dense_layers

  @property
  def qk_head_dim(self) -> int:
    """Width of the query/key dot product per head."""
    if self.attention == "mla":
      return self.qk_nope_head_dim + self.qk_rope_head_dim
    return self.head_dim

  @property
  def value_head_dim(self) -> int:
    """Width of a value vector per head."""
    return self.v_head_dim if self.attention == "mla" else self.head_dim

  @property
  def rope_dim(self) -> int:
    """Number of rotated features per head."""
    return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

  @property
  def softmax_scale(self) -> float:
    """1/sqrt(qk width), times YaRN mscale^2 when `yarn_mscale_all_dim` is set (DeepSeek)."""
    scale = self.qk_head_dim ** -0.5
    if self.rope_type == "yarn" and self.yarn_mscale_all_dim:
      m = yarn_get_mscale(self.rope_factor, self.yarn_mscale_all_dim)
      scale *= m * m
    return scale

  def replace(self, **changes) -> "ModelConfig":
    """A copy with `changes` applied (validated again)."""
    return dataclasses.replace(self, **changes)


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN magnitude correction 0.1·mscale·ln(factor) + 1 (1 when factor <= 1).

  Args:
    factor: the context extension factor.
    mscale: the coefficient.

  Returns:
    The correction factor.

  References:
    Peng et al., "YaRN: Efficient Context Window Extension of Large Language Models",
    arXiv:2309.00071.
  """
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
