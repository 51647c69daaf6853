"""Optimizers: AdamW, Muon and MuonClip (Muon + QK-Clip) as optax transformations.

    opt = build(optimizer_config, model_cfg)            # routing comes from the model's axes
    print(format_table(opt.table))                      # path, shape, optimizer, dimension numbers
    params = nnx.as_pure(nnx.state(model, nnx.Param))   # optax works on the pure parameter tree
    state = opt.init(params)
    loss, grads, aux = accumulate_gradients(loss_and_grad, params, micro_batches)  # summed
    updates, state = opt.update(grads, state, params, max_logits=aux["max_logits"])
    params = optax.apply_updates(params, updates)

What `opt.tx` (an `optax.GradientTransformationExtraArgs`) does per update:

1. `clip_by_global_norm_with_stats`: clip the (already accumulated) gradient by its global
   norm, recording the pre-clip norm in the state (`grad_norm(state)`).
2. The base optimizer.
   - `adamw`: `optax.adamw` on every parameter.
   - `muon` / `muon_clip`: `optax.partition` into a Muon branch
     (`optax.contrib.scale_by_muon`: bias-corrected EMA momentum with Nesterov, 5 Newton–Schulz
     steps with (3.4445, −4.7750, 2.0315), with an explicit `MuonDimensionNumbers` per leaf;
     then the shape scale; decoupled weight decay λ·W; ×(−lr)) and an AdamW branch
     (embeddings, lm_head, norm gains, biases, router weights; β2 = `muon.adam_b2`).
     This is the chain `optax.contrib.muon` builds, composed here from its public pieces so
     that the AdamW branch is plain AdamW (optax.contrib.muon turns on Nesterov in its Adam
     branch and has no weight-decay mask there) and so that no leaf is routed by rank alone
     (optax.contrib.muon's default sends every 2-D leaf, embeddings included, to Muon).
3. `muon_clip` / `adamw_clip`: `qk_clip`, which takes this step's `max_logits` [layers, heads]
   (from the forward aux) as an extra argument and returns, as part of the update, the weight
   change that clips every head whose max logit exceeds τ (Kimi K2 QK-Clip; see `qk_clip`).

Leaves are routed by their logical axes (models/layers.py `param`) and, for projections, by
the input rank recorded in `models.layers.Dense.n_in`; a parameter no rule covers is a
start-up error. Layer stacks (`layers` axis) and MoE experts (`experts` axis) are Muon batch
axes: every layer's matrix, and every expert's matrix, is orthogonalised on its own. Attention
projections are orthogonalised as whole [in, heads·dim] matrices unless
`muon.per_head_attention`, which makes the head axis a batch axis too.

Gradient accumulation: the losses are masked sums normalised by global counts, so micro-batch
gradients are *summed* (`accumulate_gradients`), never averaged (optax.MultiSteps averages,
which would divide a second time), and clipping happens once, in `tx`, on the sum.

Optimizer state is kept in `state_dtype` (fp32 default; bf16 stores the moment trees in bf16
and computes in fp32) and sharded like the parameters (`Optimizer.state_shardings`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from models.config import ModelConfig

NAMES = ("adamw", "muon", "muon_clip", "adamw_clip")
SCHEDULES = ("constant", "cosine", "linear", "wsd")
WSD_DECAY_SHAPES = ("linear", "cosine")
STATE_DTYPES = ("float32", "bfloat16")
SCALE_RULES = ("moonlight", "keller")
NS_COEFFS = (3.4445, -4.7750, 2.0315)  # KellerJordan/Muon quintic (optax's default)
HEAD_AXES = ("heads", "kv_heads")


# ----------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------

def default_config() -> ml_collections.ConfigDict:
  """The optimizer section of an experiment config (`config.optimizer`), with defaults."""
  c = ml_collections.ConfigDict()
  c.name = "muon"  # "adamw" | "muon" | "muon_clip" (Muon+QK-Clip) | "adamw_clip" (AdamW+QK-Clip)
  c.learning_rate = 2e-4  # peak learning rate (Muon and AdamW share it under the moonlight rule)
  c.schedule = "cosine"  # "constant" | "cosine" | "linear" | "wsd" (warmup-stable-decay)
  c.warmup_steps = 0  # linear warmup steps: lr(step) = peak·(step+1)/warmup_steps
  c.total_steps = 1000  # schedule length (cosine/linear/wsd reach end_lr_ratio·peak here)
  c.end_lr_ratio = 0.1  # final learning rate as a fraction of the peak (cosine/linear/wsd)
  c.wsd_decay_fraction = 0.2  # wsd: fraction of total_steps spent in the final decay
  c.wsd_decay_shape = "linear"  # wsd: "linear" | "cosine" decay from the peak to the end value
  c.b1 = 0.9  # AdamW β1
  c.b2 = 0.95  # AdamW β2 (optimizer "adamw")
  c.eps = 1e-8  # AdamW ε
  c.weight_decay = 0.1  # decoupled weight decay λ (W ← W − lr·λ·W): matrices and embeddings
  c.weight_decay_norms = False  # also decay RMSNorm gains (Moonlight appendix D); never biases
  c.grad_clip_norm = 1.0  # clip the accumulated gradient to this global norm; 0 = no clipping
  c.accumulation_steps = 1  # micro-batches summed per optimizer step
  c.state_dtype = "float32"  # optimizer moments: "float32" | "bfloat16" (computed in fp32)
  c.muon = ml_collections.ConfigDict()
  c.muon.beta = 0.95  # Muon momentum (EMA, bias-corrected, as optax.contrib.scale_by_muon)
  c.muon.nesterov = True  # Nesterov momentum for the Muon branch
  c.muon.ns_steps = 5  # Newton–Schulz iterations
  c.muon.scale_rule = "moonlight"  # "moonlight" rms·√max(in, out) | "keller" √max(1, out/in)
  c.muon.rms = 0.2  # moonlight rule: target update RMS (0.2 matches AdamW, so lr and λ carry over)
  c.muon.adam_b2 = 0.95  # β2 of the AdamW branch (embeddings, lm_head, norms, biases, routers)
  # peak learning rate of the AdamW branch; None = learning_rate
  c.muon.adam_learning_rate = ml_collections.config_dict.placeholder(float)
  c.muon.per_head_attention = False  # orthogonalise attention projections per head, not whole
  c.qk_clip = ml_collections.ConfigDict()
  c.qk_clip.tau = 100.0  # clip heads whose max pre-softmax logit exceeds τ (Kimi K2: 100)
  c.qk_clip.alpha = 0.5  # balance: queries take γ^α, keys γ^(1−α) (MLA rotary query takes γ)
  return c


@dataclasses.dataclass(frozen=True)
class MuonConfig:
  beta: float = 0.95
  nesterov: bool = True
  ns_steps: int = 5
  scale_rule: str = "moonlight"
  rms: float = 0.2
  adam_b2: float = 0.95
  adam_learning_rate: Optional[float] = None
  per_head_attention: bool = False


@dataclasses.dataclass(frozen=True)
class QKClipConfig:
  tau: float = 100.0
  alpha: float = 0.5


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """Validated optimizer settings (fields as in `default_config`)."""

  name: str = "muon"
  learning_rate: float = 2e-4
  schedule: str = "cosine"
  warmup_steps: int = 0
  total_steps: int = 1000
  end_lr_ratio: float = 0.1
  wsd_decay_fraction: float = 0.2
  wsd_decay_shape: str = "linear"
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  weight_decay_norms: bool = False
  grad_clip_norm: float = 1.0
  accumulation_steps: int = 1
  state_dtype: str = "float32"
  muon: MuonConfig = MuonConfig()
  qk_clip: QKClipConfig = QKClipConfig()

  def __post_init__(self):
    def fail(field, value, why):
      raise ValueError(f"optimizer.{field}={value!r}: {why}")

    for field, choices in (("name", NAMES), ("schedule", SCHEDULES),
                           ("wsd_decay_shape", WSD_DECAY_SHAPES), ("state_dtype", STATE_DTYPES)):
      if getattr(self, field) not in choices:
        fail(field, getattr(self, field), f"expected one of {choices}")
    if self.muon.scale_rule not in SCALE_RULES:
      fail("muon.scale_rule", self.muon.scale_rule, f"expected one of {SCALE_RULES}")
    for field in ("learning_rate", "weight_decay", "grad_clip_norm", "warmup_steps", "eps"):
      if getattr(self, field) < 0:
        fail(field, getattr(self, field), "must be >= 0")
    for field, value in (("b1", self.b1), ("b2", self.b2), ("muon.beta", self.muon.beta),
                         ("muon.adam_b2", self.muon.adam_b2)):
      if not 0 <= value < 1:
        fail(field, value, "must be in [0, 1)")
    if self.schedule != "constant" and self.total_steps <= self.warmup_steps:
      fail("total_steps", self.total_steps,
           f"must exceed warmup_steps={self.warmup_steps} for schedule={self.schedule!r}")
    if not 0 <= self.end_lr_ratio <= 1:
      fail("end_lr_ratio", self.end_lr_ratio, "must be in [0, 1]")
    if not 0 < self.wsd_decay_fraction <= 1:
      fail("wsd_decay_fraction", self.wsd_decay_fraction, "must be in (0, 1]")
    if self.accumulation_steps < 1:
      fail("accumulation_steps", self.accumulation_steps, "must be >= 1")
    if self.muon.ns_steps < 1:
      fail("muon.ns_steps", self.muon.ns_steps, "must be >= 1")
    if self.muon.rms <= 0:
      fail("muon.rms", self.muon.rms, "must be positive")
    if self.muon.adam_learning_rate is not None and self.muon.adam_learning_rate < 0:
      fail("muon.adam_learning_rate", self.muon.adam_learning_rate, "must be >= 0 or None")
    if self.qk_clip.tau <= 0:
      fail("qk_clip.tau", self.qk_clip.tau, "must be positive")
    if not 0 <= self.qk_clip.alpha <= 1:
      fail("qk_clip.alpha", self.qk_clip.alpha, "must be in [0, 1]")

  @property
  def uses_muon(self) -> bool:
    return self.name in ("muon", "muon_clip")

  @property
  def uses_qk_clip(self) -> bool:
    return self.name in ("muon_clip", "adamw_clip")

  @classmethod
  def from_config(cls, config: Any) -> "OptimizerConfig":
    """From a ConfigDict (or mapping) shaped like `default_config()`; unknown keys fail."""
    if isinstance(config, OptimizerConfig):
      return config
    d = config.to_dict() if isinstance(config, ml_collections.ConfigDict) else dict(config)
    sub = {"muon": MuonConfig, "qk_clip": QKClipConfig}
    kwargs = {}
    known = {f.name for f in dataclasses.fields(cls)}
    for key, value in d.items():
      if key not in known:
        raise ValueError(f"optimizer.{key}: unknown field; valid fields: {sorted(known)}")
      if key in sub:
        fields = {f.name for f in dataclasses.fields(sub[key])}
        value = dict(value)
        unknown = sorted(set(value) - fields)
        if unknown:
          raise ValueError(f"optimizer.{key}: unknown fields {unknown}; valid: {sorted(fields)}")
        value = sub[key](**value)
      kwargs[key] = value
    return cls(**kwargs)


def schedule(cfg: OptimizerConfig, peak: Optional[float] = None) -> Callable[[Any], jax.Array]:
  """Learning rate as a function of the step (0-based): linear warmup to the peak, then
  constant, cosine or linear decay to end_lr_ratio·peak at total_steps, or WSD (constant, then
  a linear/cosine decay over the last wsd_decay_fraction of total_steps)."""
  peak = cfg.learning_rate if peak is None else peak
  w, total, end = cfg.warmup_steps, cfg.total_steps, cfg.end_lr_ratio

  def fn(step):
    step = jnp.asarray(step, jnp.float32)
    warm = jnp.minimum(1.0, (step + 1.0) / w) if w > 0 else jnp.float32(1.0)
    if cfg.schedule == "constant":
      factor = jnp.float32(1.0)
    elif cfg.schedule in ("cosine", "linear"):
      progress = jnp.clip((step - w) / (total - w), 0.0, 1.0)
      shape = (0.5 * (1 + jnp.cos(jnp.pi * progress)) if cfg.schedule == "cosine"
               else 1.0 - progress)
      factor = end + (1.0 - end) * shape
    else:  # wsd
      decay = max(1, int(round(cfg.wsd_decay_fraction * total)))
      progress = jnp.clip((step - (total - decay)) / decay, 0.0, 1.0)
      shape = (0.5 * (1 + jnp.cos(jnp.pi * progress)) if cfg.wsd_decay_shape == "cosine"
               else 1.0 - progress)
      factor = end + (1.0 - end) * shape
    return peak * warm * factor

  return fn


# ----------------------------------------------------------------------------------------
# Routing: which optimizer and which Muon dimension numbers each parameter gets
# ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Route:
  """One parameter leaf: the data behind the start-up table."""

  path: tuple[str, ...]  # keys in the parameter tree
  shape: tuple[int, ...]
  axes: tuple[str, ...]  # logical axis names
  role: str  # embedding | lm_head | norm | bias | router | attention | mlp | experts
  optimizer: str  # "muon" | "adamw"
  dims: Optional[MuonDimensionNumbers]  # Muon dimension numbers (None for AdamW)
  scale: Optional[float]  # Muon shape scale (None for AdamW)
  weight_decay: bool  # decoupled weight decay applies

  @property
  def name(self) -> str:
    return "/".join(self.path)

  @property
  def batch_axes(self) -> tuple[int, ...]:
    if self.dims is None:
      return ()
    used = set(_as_tuple(self.dims.reduction_axis)) | set(_as_tuple(self.dims.output_axis))
    return tuple(i for i in range(len(self.shape)) if i not in used)


def _as_tuple(x) -> tuple[int, ...]:
  return (x,) if isinstance(x, int) else tuple(x)


def path_names(path) -> tuple[str, ...]:
  """Tree key path -> tuple of key names (a Variable's trailing `.value` dropped)."""
  out = []
  for k in path:
    if isinstance(k, jax.tree_util.DictKey):
      out.append(str(k.key))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      if k.name != "value":
        out.append(k.name)
    elif isinstance(k, jax.tree_util.SequenceKey):
      out.append(str(k.idx))
    else:
      out.append(str(k))
  return tuple(out)


def param_suffix(path) -> tuple[str, ...]:
  """The trailing run of dict keys of a key path (a parameter's path inside a state tree)."""
  out = []
  for k in reversed(path):
    if isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value":
      continue
    if not isinstance(k, jax.tree_util.DictKey):
      break
    out.append(str(k.key))
  return tuple(reversed(out))


def model_param_info(model_cfg: ModelConfig
                     ) -> dict[tuple[str, ...], tuple[tuple, tuple, Optional[int]]]:
  """{path: (shape, logical axes, Dense input rank or None)} of every nnx.Param of the model."""
  from models.layers import Dense
  from models.transformer import abstract
  model = abstract(model_cfg)
  n_in = {tuple(str(p) for p in path): node.n_in for path, node in nnx.iter_graph(model)
          if isinstance(node, Dense)}
  info = {}
  state = nnx.state(model, nnx.Param)
  for path, var in jax.tree.leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
    names = path_names(path)
    dense_in = n_in.get(names[:-1]) if names[-1] == "kernel" else None
    info[names] = (tuple(var.shape), tuple(var.get_metadata()["axes"]), dense_in)
  return info


def route(cfg: Any, path: tuple[str, ...], shape: tuple[int, ...], axes: tuple[str, ...],
          dense_in: Optional[int] = None) -> Route:
  """The route of one leaf from its path, shape, logical axes and (for a `Dense` kernel) the
  number of input axes; raises for a parameter no rule covers."""
  cfg = OptimizerConfig.from_config(cfg)
  path, shape, axes = tuple(path), tuple(shape), tuple(axes)
  name = "/".join(path)
  lead = 0
  while lead < len(axes) and axes[lead] == "layers":
    lead += 1
  decay_matrix = cfg.weight_decay > 0
  if "vocab" in axes:
    role = "embedding" if path[-1] == "embed" else "lm_head"
    return Route(path, shape, axes, role, "adamw", None, None, decay_matrix)
  if "norm" in axes:
    return Route(path, shape, axes, "norm", "adamw", None, None,
                 decay_matrix and cfg.weight_decay_norms)
  if path[-1] == "bias":
    return Route(path, shape, axes, "bias", "adamw", None, None, False)
  if path[-1] == "router":
    return Route(path, shape, axes, "router", "adamw", None, None, decay_matrix)
  if dense_in is not None:
    role = "attention" if "attn" in path else "mlp"
    reduction = list(range(lead, lead + dense_in))
    output = list(range(lead + dense_in, len(shape)))
  elif "experts" in axes and "expert_mlp" in axes:
    role = "experts"
    rest = [i for i in range(lead, len(axes)) if axes[i] != "experts"]
    if len(rest) != 2:
      raise ValueError(f"optimizer routing: expert stack {name} with axes {axes} should have "
                       "one input and one output axis besides layers/experts")
    reduction, output = [rest[0]], [rest[1]]
  else:
    raise ValueError(f"optimizer routing: no rule for parameter {name} with shape {shape} and "
                     f"axes {axes} (add one to trainer/optimizers.py)")
  if not cfg.uses_muon:
    return Route(path, shape, axes, role, "adamw", None, None, decay_matrix)
  if role == "attention" and cfg.muon.per_head_attention:
    reduction = [i for i in reduction if axes[i] not in HEAD_AXES]
    output = [i for i in output if axes[i] not in HEAD_AXES]
  if not reduction or not output:
    raise ValueError(f"optimizer routing: {name} axes {axes} leave no matrix for Muon")
  dims = MuonDimensionNumbers(reduction_axis=tuple(reduction), output_axis=tuple(output))
  fan_in = math.prod(shape[i] for i in reduction)
  fan_out = math.prod(shape[i] for i in output)
  if cfg.muon.scale_rule == "moonlight":
    scale = cfg.muon.rms * math.sqrt(max(fan_in, fan_out))
  else:
    scale = math.sqrt(max(1.0, fan_out / fan_in))
  return Route(path, shape, axes, role, "muon", dims, scale, cfg.weight_decay > 0)


def routing_table(cfg: OptimizerConfig, model_cfg: ModelConfig) -> list[Route]:
  """One `Route` per parameter of the model, in tree order."""
  cfg = OptimizerConfig.from_config(cfg)
  return [route(cfg, path, shape, axes, dense_in)
          for path, (shape, axes, dense_in) in model_param_info(model_cfg).items()]


def format_table(rows: Sequence[Route]) -> str:
  """Fixed-width text table: path, shape, optimizer, dimension numbers, scale, decay."""
  def dims(r):
    if r.dims is None:
      return "-"
    return (f"red={_as_tuple(r.dims.reduction_axis)} out={_as_tuple(r.dims.output_axis)} "
            f"batch={r.batch_axes}")
  cells = [("parameter", "shape", "role", "optimizer", "dimension numbers", "scale", "decay")]
  for r in rows:
    cells.append((r.name, "x".join(map(str, r.shape)), r.role, r.optimizer, dims(r),
                  "-" if r.scale is None else f"{r.scale:.3f}", "yes" if r.weight_decay else "no"))
  widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
  lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
  lines.insert(1, "  ".join("-" * w for w in widths))
  n_muon = sum(math.prod(r.shape) for r in rows if r.optimizer == "muon")
  n_all = sum(math.prod(r.shape) for r in rows)
  lines.append(f"{n_muon:,} of {n_all:,} parameters ({100 * n_muon / max(n_all, 1):.1f}%) use Muon")
  return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# Transformations
# ----------------------------------------------------------------------------------------

class ClipState(NamedTuple):
  grad_norm: jax.Array  # global norm of the last gradient, before clipping


def clip_by_global_norm_with_stats(max_norm: float) -> optax.GradientTransformation:
  """optax.clip_by_global_norm that also records the pre-clip norm; max_norm <= 0: no clip."""

  def init(params):
    del params
    return ClipState(jnp.zeros([], jnp.float32))

  def update(updates, state, params=None):
    del params, state
    norm = optax.tree.norm(updates)
    if max_norm > 0:
      factor = jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-30))
      updates = jax.tree.map(lambda g: (g * factor).astype(g.dtype), updates)
    return updates, ClipState(norm.astype(jnp.float32))

  return optax.GradientTransformation(init, update)


def scale_by_shape(scales_fn: Callable[[Any], Any]) -> optax.GradientTransformation:
  """Multiply every (Muon) leaf by its shape scale; scales_fn(tree) gives a float per leaf."""

  def update(updates, state, params=None):
    del params
    return jax.tree.map(lambda u, s: u * jnp.asarray(s, u.dtype), updates,
                        scales_fn(updates)), state

  return optax.GradientTransformation(optax.init_empty_state, update)


class QKClipState(NamedTuple):
  clipped_heads: jax.Array  # number of (layer, head) pairs clipped by the last update
  max_logit: jax.Array  # largest max logit seen by the last update


def qk_clip(model_cfg: ModelConfig, tau: float = 100.0, alpha: float = 0.5
            ) -> optax.GradientTransformationExtraArgs:
  """QK-Clip (Kimi K2, arXiv 2507.20534 Algorithm 1) as an optax transformation.

  `update(updates, state, params, *, max_logits)` with `max_logits` [num_layers, num_heads]:
  this step's per-layer per-head max pre-softmax logit over allowed pairs (softmax scale
  included), i.e. `aux["max_logits"]` of the forward pass (max over micro-batches when
  accumulating). It must be global over data-parallel shards: inside one jitted SPMD step the
  model's `jnp.max` over the batch is already global (GSPMD inserts the all-reduce); a
  multi-controller loop that computes it per host must all-reduce it (max) first.

  With W' = params + updates (the base optimizer's result), every head with S > τ gets
  γ = τ/S (others γ = 1) and the returned updates are W'' − params where
  - MLA: head h's no-RoPE query columns ×γ^α, its no-RoPE key columns of kv_b_proj ×γ^(1−α),
    its rotary query columns ×γ; the shared rotary key (kv_a_proj) and values untouched;
  - GQA/MHA: each key head (shared by a group of query heads) ×κ with
    κ = (min γ in the group)^(1−α), each query head ×γ_h/κ, q/k biases with their weights,
  so every head's logits scale by exactly its own γ: clipped heads land on τ, other heads
  keep their logits, and groups entirely under τ are left bit-identical. Rows of
  `max_logits` are in model layer order: `dense_layers` first, then `moe_layers`.
  The optimizer state (momentum) is not rescaled.
  """
  if model_cfg.attention == "gqa" and model_cfg.qk_norm:
    raise ValueError(
        "QK-Clip cannot be used with qk_norm=True: Qwen3-style q/k RMSNorm already bounds the "
        "attention logits, and its norm gains are shared across heads so logits cannot be "
        "rescaled per head by scaling weights. Use optimizer.name='muon' or 'adamw'.")
  L, H = model_cfg.num_layers, model_cfg.num_heads
  stacks = {"dense_layers": (0, model_cfg.num_dense_layers),
            "moe_layers": (model_cfg.num_dense_layers, model_cfg.num_moe_layers)}

  def leaf_scales(gamma):
    """{(leaf path inside a block): scale [layers, ...] broadcast to the leaf} for a stack."""
    if model_cfg.attention == "mla":
      nope, rope, v = (model_cfg.qk_nope_head_dim, model_cfg.qk_rope_head_dim,
                       model_cfg.v_head_dim)
      g = gamma[:, :, None]  # [l, h, 1]
      q = jnp.concatenate([jnp.broadcast_to(g ** alpha, g.shape[:2] + (nope,)),
                           jnp.broadcast_to(g, g.shape[:2] + (rope,))], -1)
      kv = jnp.concatenate([jnp.broadcast_to(g ** (1 - alpha), g.shape[:2] + (nope,)),
                            jnp.ones(g.shape[:2] + (v,), g.dtype)], -1)
      q_name = "q_proj" if model_cfg.q_lora_rank is None else "q_b_proj"
      return {("attn", q_name, "kernel"): q[:, None], ("attn", "kv_b_proj", "kernel"): kv[:, None]}
    kvh = model_cfg.num_kv_heads
    grouped = gamma.reshape(gamma.shape[0], kvh, H // kvh)
    kappa = jnp.min(grouped, axis=-1) ** (1 - alpha)  # [l, kvh]
    q = (grouped / kappa[..., None]).reshape(gamma.shape)  # [l, h]
    return {("attn", "q_proj", "kernel"): q[:, None, :, None],
            ("attn", "q_proj", "bias"): q[:, :, None],
            ("attn", "k_proj", "kernel"): kappa[:, None, :, None],
            ("attn", "k_proj", "bias"): kappa[:, :, None]}

  def init(params):
    del params
    return QKClipState(jnp.zeros([], jnp.int32), jnp.zeros([], jnp.float32))

  def update(updates, state, params=None, *, max_logits=None, **extra):
    del state, extra
    if params is None:
      raise ValueError("qk_clip needs params")
    if max_logits is None:
      raise ValueError("qk_clip needs this step's max_logits [num_layers, num_heads] "
                       "(aux['max_logits']) passed as update(..., max_logits=...)")
    s = jnp.asarray(max_logits, jnp.float32)
    if s.shape != (L, H):
      raise ValueError(f"qk_clip: max_logits has shape {s.shape}, expected [layers={L}, "
                       f"heads={H}]")
    over = s > tau
    gamma = jnp.where(over, tau / jnp.where(over, s, 1.0), 1.0)
    scales = {}
    for stack, (start, n) in stacks.items():
      if n:
        for leaf, scale in leaf_scales(gamma[start:start + n]).items():
          scales[(stack,) + leaf] = scale

    def one(path, u, p):
      scale = scales.get(path_names(path))
      if scale is None:
        return u
      # u + (p + u)(s − 1): p + result = (p + u)·s, and exactly u where s == 1.
      return (u + (p + u) * (scale - 1).astype(u.dtype)).astype(u.dtype)

    new = jax.tree_util.tree_map_with_path(one, updates, params)
    return new, QKClipState(over.sum().astype(jnp.int32), s.max())

  return optax.GradientTransformationExtraArgs(init, update)


def with_state_dtype(inner: optax.GradientTransformation, dtype
                     ) -> optax.GradientTransformationExtraArgs:
  """Store the state's parameter-shaped moment leaves in `dtype`, compute in fp32.

  At init, floating leaves whose path ends with a parameter's path and whose shape equals that
  parameter's are cast; at update, leaves arriving in `dtype` are upcast to fp32, the inner
  update runs, and the same leaves are cast back. Scalars (counts, norms) and the Newton–Schulz
  coefficients stay as they are.
  """
  dtype = jnp.dtype(dtype)
  inner = optax.with_extra_args_support(inner)
  if dtype == jnp.float32:
    return inner

  def init(params):
    state = inner.init(params)
    shapes = {path_names(p): tuple(x.shape) for p, x in jax.tree.leaves_with_path(params)}

    def cast(path, x):
      if (jnp.issubdtype(x.dtype, jnp.floating)
          and shapes.get(param_suffix(path)) == tuple(x.shape)):
        return x.astype(dtype)
      return x
    return jax.tree_util.tree_map_with_path(cast, state)

  def update(updates, state, params=None, **extra):
    low = jax.tree.map(lambda x: x.dtype == dtype, state)
    up = jax.tree.map(lambda x, m: x.astype(jnp.float32) if m else x, state, low)
    updates, new = inner.update(updates, up, params, **extra)
    new = jax.tree.map(lambda x, m: x.astype(dtype) if m else x, new, low)
    return updates, new

  return optax.GradientTransformationExtraArgs(init, update)


# ----------------------------------------------------------------------------------------
# The optimizer
# ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Optimizer:
  """What `build` returns: the optax transformation plus its routing and schedule."""

  config: OptimizerConfig
  model_cfg: ModelConfig
  tx: optax.GradientTransformationExtraArgs
  table: tuple[Route, ...]
  lr_schedule: Callable[[Any], jax.Array]

  def init(self, params):
    return self.tx.init(nnx.as_pure(params))

  def update(self, grads, state, params, max_logits=None):
    """(updates, new_state); the updates include the QK-Clip weight change when enabled."""
    extra = {} if max_logits is None else {"max_logits": max_logits}
    if self.config.uses_qk_clip and max_logits is None:
      raise ValueError(f"optimizer {self.config.name!r} needs max_logits (aux['max_logits'])")
    return self.tx.update(nnx.as_pure(grads), state, nnx.as_pure(params), **extra)

  def apply(self, grads, state, params, max_logits=None):
    """(new params, new state)."""
    params = nnx.as_pure(params)
    updates, state = self.update(grads, state, params, max_logits)
    return optax.apply_updates(params, updates), state

  def state_shardings(self, params, param_shardings):
    """Shardings for the optimizer state: a leaf that is a copy of a parameter (its trailing
    dict-key path and shape match) gets that parameter's sharding; the rest (step counts,
    norms, Newton–Schulz coefficients) is replicated."""
    params = nnx.as_pure(params)
    param_shardings = nnx.as_pure(param_shardings)
    by_path = {}
    for (path, x), sh in zip(jax.tree.leaves_with_path(params), jax.tree.leaves(
        param_shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))):
      by_path[path_names(path)] = (tuple(x.shape), sh)
    mesh = next(iter(by_path.values()))[1].mesh
    abstract_state = jax.eval_shape(self.tx.init, params)

    def one(path, x):
      hit = by_path.get(param_suffix(path))
      if hit is not None and hit[0] == tuple(x.shape):
        return hit[1]
      return NamedSharding(mesh, PartitionSpec())
    return jax.tree_util.tree_map_with_path(one, abstract_state)

  def init_sharded(self, params, param_shardings):
    """The initial state, created directly with `state_shardings`."""
    params = nnx.as_pure(params)
    shardings = self.state_shardings(params, param_shardings)
    return jax.jit(self.tx.init, out_shardings=shardings)(params)


def _route_fn(routes: dict, value: Callable[[Route], Any]) -> Callable[[Any], Any]:
  """tree -> same-structure tree of value(route) per leaf (looked up by the leaf's path)."""
  def fn(tree):
    def one(path, _):
      key = path_names(path)
      if key not in routes:
        raise ValueError(f"optimizer: parameter {'/'.join(key)} is not in the routing table "
                         "(was the optimizer built for another model config?)")
      return value(routes[key])
    return jax.tree_util.tree_map_with_path(one, tree)
  return fn


def build(cfg: Any, model_cfg: ModelConfig, params: Any = None) -> Optimizer:
  """Build the optimizer described by `cfg` (ConfigDict or OptimizerConfig) for `model_cfg`.

  `params` (concrete, abstract, nnx.State or pure) is optional; when given, its paths and
  shapes are checked against the model's. Configuration errors fail here, at start-up.
  """
  cfg = OptimizerConfig.from_config(cfg)
  table = routing_table(cfg, model_cfg)
  if params is not None:
    got = {path_names(p): tuple(x.shape) for p, x in jax.tree.leaves_with_path(nnx.as_pure(params))}
    want = {r.path: r.shape for r in table}
    if got != want:
      diff = sorted(set(got.items()) ^ set(want.items()))[:6]
      raise ValueError(f"optimizer: params do not match model config; differing leaves {diff}")
  tx = make_tx(cfg, table, model_cfg)
  return Optimizer(cfg, model_cfg, tx, tuple(table), schedule(cfg))


def make_tx(cfg: Any, table: Sequence[Route], model_cfg: Optional[ModelConfig] = None
            ) -> optax.GradientTransformationExtraArgs:
  """The optax transformation for parameters routed by `table` (any tree whose leaf paths are
  the routes' paths). `model_cfg` is needed only for QK-Clip."""
  cfg = OptimizerConfig.from_config(cfg)
  routes = {r.path: r for r in table}
  lr = schedule(cfg)
  decay_mask = _route_fn(routes, lambda r: r.weight_decay)
  if cfg.uses_muon:
    adam_lr = schedule(cfg, cfg.muon.adam_learning_rate)
    labels = _route_fn(routes, lambda r: r.optimizer)
    dims = _route_fn(routes, lambda r: r.dims)
    scales = _route_fn(routes, lambda r: r.scale)
    core = optax.partition({
        "muon": optax.chain(
            scale_by_muon(ns_coeffs=NS_COEFFS, ns_steps=cfg.muon.ns_steps, beta=cfg.muon.beta,
                          nesterov=cfg.muon.nesterov, weight_dimension_numbers=dims),
            scale_by_shape(scales),
            optax.add_decayed_weights(cfg.weight_decay),
            optax.scale_by_learning_rate(lr)),
        "adamw": optax.adamw(adam_lr, b1=cfg.b1, b2=cfg.muon.adam_b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, mask=decay_mask),
    }, labels)
  else:
    core = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                       mask=decay_mask)
  parts = [clip_by_global_norm_with_stats(cfg.grad_clip_norm), core]
  if cfg.uses_qk_clip:
    if model_cfg is None:
      raise ValueError(f"optimizer {cfg.name!r}: QK-Clip needs the model config")
    parts.append(qk_clip(model_cfg, cfg.qk_clip.tau, cfg.qk_clip.alpha))
  return with_state_dtype(optax.chain(*parts), cfg.state_dtype)


def print_table(opt: Optimizer) -> str:
  """Print and log (absl) the routing table; returns the text."""
  from absl import logging
  text = (f"optimizer {opt.config.name} (scale rule {opt.config.muon.scale_rule}, "
          f"per-head attention {opt.config.muon.per_head_attention}):\n" + format_table(opt.table))
  print(text, flush=True)
  logging.info("%s", text)
  return text


def _find(state, kind):
  for leaf in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kind)):
    if isinstance(leaf, kind):
      return leaf
  return None


def metrics(opt: Optimizer, state) -> dict:
  """Scalars for logging from a state after an update: grad_norm (pre-clip), lr, and for
  QK-Clip the number of clipped heads and the largest max logit of the step."""
  out = {}
  clip = _find(state, ClipState)
  if clip is not None:
    out["grad_norm"] = clip.grad_norm
  counts = [x for x in jax.tree.leaves(_find(state, optax.ScaleByScheduleState) or ())]
  if counts:
    out["lr"] = opt.lr_schedule(counts[0] - 1)
  qk = _find(state, QKClipState)
  if qk is not None:
    out["qk_clipped_heads"] = qk.clipped_heads
    out["max_logit"] = qk.max_logit
  return out


# ----------------------------------------------------------------------------------------
# Gradient accumulation
# ----------------------------------------------------------------------------------------

def split_micro_batches(batch: Any, n: int) -> Any:
  """[B, ...] leaves -> [n, B/n, ...] (micro-batch i = rows i·B/n .. (i+1)·B/n − 1)."""
  def one(x):
    if x.shape[0] % n:
      raise ValueError(f"batch of {x.shape[0]} rows is not divisible into {n} micro-batches")
    return x.reshape((n, x.shape[0] // n) + x.shape[1:])
  return jax.tree.map(one, batch)


def accumulate_gradients(loss_and_grad: Callable, params: Any, micro_batches: Any
                         ) -> tuple[jax.Array, Any, Any]:
  """Sum losses and gradients over micro-batches (leading axis of `micro_batches`).

  loss_and_grad(params, batch) -> ((loss, aux), grads), e.g. `jax.value_and_grad(f,
  has_aux=True)`. Losses are masked sums normalised by *global* counts, so the micro-batch
  gradients add up to the full-batch gradient: they are summed, never averaged, and the
  optimizer clips the sum once. Returns (loss sum, gradient sum, aux) with aux stacked over
  micro-batches except `aux["max_logits"]`, reduced by max (what QK-Clip needs).
  """
  first = jax.tree.map(lambda x: x[0], micro_batches)
  (loss_shape, _), grad_shape = jax.eval_shape(loss_and_grad, params, first)
  zeros = (jnp.zeros(loss_shape.shape, loss_shape.dtype),
           jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), grad_shape))

  def body(carry, batch):
    (loss, aux), grads = loss_and_grad(params, batch)
    return (carry[0] + loss, jax.tree.map(jnp.add, carry[1], grads)), aux

  (loss, grads), aux = jax.lax.scan(body, zeros, micro_batches)
  if isinstance(aux, dict) and "max_logits" in aux:
    aux = dict(aux, max_logits=aux["max_logits"].max(0))
  return loss, grads, aux
