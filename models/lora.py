"""LoRA / QLoRA adapters and weight-only quantization of a Transformer, all through qwix.

qwix (github.com/google/qwix) adapts and quantizes a Flax model by intercepting the matmuls
its method runs: while `Transformer.hidden` runs, each projection's `dot_general` on a matched
module's kernel becomes `x W + s (x A) B` (`qwix.LoraProvider`; A [in, rank]
drawn He-uniform, B [rank, out] zero, over the kernel's flattened in / out dimensions), and a
kernel replaced by a qwix array (`base_qtype`, or `quantize` for rollouts) is multiplied in its
quantized form. The scale s is alpha / rank, or alpha / sqrt(rank) with `lora_rslora`
(rank-stabilised LoRA; qwix scales by its rule's alpha / rank, so its rules get alpha sqrt(rank)).
Nothing of that is written here; this module fits qwix to the Transformer:

- qwix creates adapters and quantized kernels lazily, on a first call, as attributes of the
  modules it runs. Scanned layers are copies made inside `lax.scan`, so the first call runs on
  a template (one unstacked layer per stack, `nnx.eval_shape`); the adapters and quantized
  kernels it made are then built for every layer of the real model: a leading `layers` axis on
  a stacked model (`Transformer.stacked`), one per Block on an unstacked one.
- Adapters are `nnx.LoRAParam` (a Param subclass): `nnx.split(model, nnx.LoRAParam, ...)`
  separates them from the frozen base; they carry logical `axes` metadata like every
  parameter, so `models.sharding` places them.
- `merge` evaluates each adapted projection on the identity (through qwix again) to get
  W + s A B, for export to Hugging Face (adapters alone in PEFT's format: `models.peft_format`).
- `lora_dropout` is qwix's dropout on an adapter's input, drawn from the module's `qwix_rngs`:
  a training step gives its forward one stream per layer (`set_dropout_streams`); everywhere
  else the modules hold none and `Provider` turns the dropout off.

Which projections (`ModelConfig.lora_modules`): "attention" = q/k/v/o and MLA's q_proj,
q_a_proj, q_b_proj, kv_a_proj, o_proj (kv_b_proj is left out: decoding absorbs it into the
query and output, outside any projection call); "mlp" = dense SwiGLU MLPs and MoE shared
experts; "experts" = the routed experts' gate / up / down stacks [E, in, out].

Routed experts run grouped matmuls (`models.grouped_matmul`, `jax.lax.ragged_dot` over rows
sorted by expert), which qwix 0.1.8's LoRA and PTQ providers do not intercept. `Provider` and
`QuantProvider` are `qwix.LoraProvider` and `qwix.PtqProvider` with that one interception
added, in qwix's own terms: rules matched on the MoE module and the op "ragged_dot", the stack
found by `find_param`, quantized by qwix (`create_quantized_param`, absmax per expert and
output channel; multiplied dequantized) when the rule has a `weight_qtype`, adapters created by
qwix's LoRA parameter helper with an `ExpertLoraRule`: rows of expert g get
x W_g + s (x A_g) B_g, with A [E, in, rank], B [E, rank, out] per expert
(`lora_experts="per_expert"`) or A [in, rank], B [rank, out] shared by the layer's experts
("shared"). Adapters need the global dispatch (`moe_dispatch` "global" or "auto"; the
expert-parallel all-to-all runs the experts inside `shard_map`, where the stacks are no longer
the module's parameters; quantized stacks travel there as they are) and `moe_impl="ragged"`, as
quantized experts do.

    cfg = cfg.replace(lora_rank=16, lora_alpha=32.0)    # base_qtype="int8" for QLoRA
    model = lora.apply(base_model, cfg)                  # adapters A random, B zero
    _, adapters, frozen = nnx.split(model, nnx.LoRAParam, ...)

References:
  Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685.
  Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs", arXiv:2305.14314.
  Kalajdzievski, "A Rank Stabilization Scaling Factor for Fine-Tuning with LoRA",
    arXiv:2312.03732.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import qwix
from flax import nnx
from qwix._src.core import qarray
from qwix._src.providers import lora as qwix_lora
from qwix._src.providers import ptq
from qwix._src.utils import flax_util

from models import grouped_matmul as gmm
from models.config import ModelConfig
from models.layers import Dense
from models.moe import MoE

# qwix 0.1.8 calls flax APIs that flax 0.12 deprecates (`.value`, `iter_modules`,
# `VariableState`): not the user's to fix
warnings.filterwarnings("ignore", category=DeprecationWarning, module="qwix")

# module names (last path component) of the projections each `lora_modules` entry adapts
MODULES = {
    "attention": ("q_proj", "q_a_proj", "q_b_proj", "k_proj", "v_proj", "kv_a_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
# the MoE module (a Block's `mlp`), whose grouped matmuls "experts" adapts and quantization
# quantizes, and the op name its rules match
EXPERTS_MODULE = "mlp"
EXPERTS_OP = "ragged_dot"
EXPERT_STACKS = ("gate_proj", "up_proj", "down_proj")
# qwix intercepts `Transformer.hidden`: the forward pass, prefill and decoding all run it
METHOD = "hidden"


def _path_regex(names) -> str:
  return rf"(.*/)?({'|'.join(names)})"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertLoraRule(qwix.LoraRule):
  """A qwix LoRA rule for routed experts' grouped matmuls.

  Attributes:
    shared: one adapter pair A [in, rank], B [rank, out] for all of a layer's experts; False =
      one per expert, A [E, in, rank], B [E, rank, out].
  """

  shared: bool = False


def expert_delta(x: jax.Array, a: jax.Array, b: jax.Array, sizes: jax.Array,
                 scale: float) -> jax.Array:
  """The adapters' term of a grouped matmul: scale (x A_g) B_g for the rows of group g.

  Args:
    x: [rows, in] rows sorted by group; rows past the last group give zeros.
    a: [groups, in, rank] per group, or [in, rank] shared.
    b: [groups, rank, out] per group, or [rank, out] shared.
    sizes: [groups] int32 rows per group.
    scale: the adapters' scale (`scale`).

  Returns:
    [rows, out] in x's dtype.
  """
  a, b = a.astype(x.dtype), b.astype(x.dtype)
  if a.ndim == 2:
    valid = jnp.arange(x.shape[0]) < sizes.sum()
    return jnp.where(valid[:, None], (x @ a) @ b * scale, 0).astype(x.dtype)
  return gmm.grouped_matmul(gmm.grouped_matmul(x, a, sizes), b, sizes) * scale


class _GroupedMatmulInterception:
  """What `Provider` and `QuantProvider` add to qwix's providers: the routed experts' grouped
  matmul (`models.grouped_matmul.grouped_matmul`), quantized and / or adapted by the rule that
  matches the MoE module and the op "ragged_dot"."""

  def grouped_matmul(self, x: jax.Array, w, sizes: jax.Array) -> jax.Array:
    """x [rows, in] times w [E, in, out] by group (a qwix-quantized stack dequantized), plus
    the adapters of an `ExpertLoraRule`."""
    rule, _ = self._get_current_rule_and_op_id(EXPERTS_OP)
    if rule is None:
      return gmm.grouped_matmul(x, w, sizes)  # qwix runs a handler with its interceptions off
    name = _quantized_stack_name(w) if isinstance(w, ptq.WithAux) else flax_util.find_param(w)
    if rule.weight_qtype is not None and not isinstance(w, ptq.WithAux):
      if name is None:
        raise ValueError("lora: a routed-expert stack to quantize that is not a parameter of "
                         "the MoE module")
      how = qarray.HowToQuantize(qtype=rule.weight_qtype, channelwise_axes=(0, 2),
                                 calibration_method=rule.weight_calibration_method)
      w = ptq.create_quantized_param(name, w, how)  # absmax per expert and output channel
    if isinstance(w, ptq.WithAux):
      w = qwix.dequantize(w.array).astype(x.dtype)
    out = gmm.grouped_matmul(x, w, sizes)
    if not isinstance(rule, ExpertLoraRule):
      return out
    if name is None:
      raise ValueError("lora: a routed-expert grouped matmul whose weight is not a parameter of "
                       "the current module (expert adapters need the global dispatch, "
                       "ModelConfig.moe_dispatch 'global' or 'auto')")
    e, n_in, n_out = w.shape
    r = rule.rank
    shapes = (((n_in, r), (1, None), (r, n_out), (None, 2)) if rule.shared else
              ((e, n_in, r), (0, 1, None), (e, r, n_out), (0, None, 2)))
    a, b = qwix_lora._get_or_create_lora_params(  # pylint: disable=protected-access
        name=name, rule=rule, a_shape=shapes[0], a_sharding_transpose=shapes[1],
        b_shape=shapes[2], b_sharding_transpose=shapes[3])
    if rule.dropout > 0:  # as qwix's LoRA does for dot_general
      x = nnx.Dropout(rule.dropout, deterministic=False)(x, rngs=flax_util.make_rng("dropout"))
    return out + expert_delta(x, a, b, sizes, rule.alpha / r)

  def _get_current_rule_and_op_id(self, op_name: str, **kwargs):
    """qwix's rule lookup, with LoRA dropout off where the module holds no dropout streams:
    everywhere but a training step's forward (`set_dropout_streams`)."""
    rule, op_id = super()._get_current_rule_and_op_id(op_name, **kwargs)
    if isinstance(rule, qwix.LoraRule) and rule.dropout > 0 and not isinstance(
        getattr(flax_util.get_current_module(), "qwix_rngs", None), nnx.Rngs):
      rule = dataclasses.replace(rule, dropout=0.0)
    return rule, op_id

  def get_intercept_map(self):
    return super().get_intercept_map() | {
        "models.grouped_matmul.grouped_matmul": self.grouped_matmul}


def _quantized_stack_name(w: ptq.WithAux) -> str | None:
  """The current module's parameter holding the quantized stack `w` (by its values' identity:
  gate and up stacks have one shape, and qwix's `find_param` tells them apart only by shape
  once they are quantized)."""
  for name, node in vars(flax_util.get_current_module()).items():
    value = node.get_value() if isinstance(node, nnx.Variable) else node
    if isinstance(value, ptq.WithAux) and value.array.qvalue is w.array.qvalue:
      return name
  return None


class Provider(_GroupedMatmulInterception, qwix.LoraProvider):
  """`qwix.LoraProvider` that also adapts (and quantizes) the routed experts' grouped matmuls."""


class QuantProvider(_GroupedMatmulInterception, qwix.PtqProvider):
  """`qwix.PtqProvider` that also quantizes the routed experts' grouped matmuls."""


def scale(cfg: ModelConfig) -> float:
  """The adapters' output scale: alpha / rank, or alpha / sqrt(rank) with `lora_rslora`."""
  if cfg.lora_rslora:
    return cfg.lora_alpha / math.sqrt(cfg.lora_rank)
  return cfg.lora_alpha / cfg.lora_rank


def _qwix_alpha(cfg: ModelConfig) -> float:
  """The alpha of a qwix rule, which scales by alpha / rank: the one giving `scale(cfg)`."""
  return cfg.lora_alpha * math.sqrt(cfg.lora_rank) if cfg.lora_rslora else cfg.lora_alpha


def _rules(cfg: ModelConfig, weight_qtype: str | None, act_qtype: str | None = None) -> list:
  """qwix rules: adapters (and the base's quantization) on the adapted projections, adapters on
  the routed experts, and the base's quantization alone on the other projections (with their
  inputs quantized too with `act_qtype`)."""
  rules = []
  if cfg.lora_rank:
    names = [n for m in cfg.lora_modules if m in MODULES for n in MODULES[m]]
    if names:
      rules.append(qwix.LoraRule(module_path=_path_regex(names), rank=cfg.lora_rank,
                                 alpha=_qwix_alpha(cfg), dropout=cfg.lora_dropout,
                                 weight_qtype=weight_qtype))
    if cfg.lora_experts_on:
      rules.append(ExpertLoraRule(module_path=_path_regex([EXPERTS_MODULE]),
                                  op_names=(EXPERTS_OP,), rank=cfg.lora_rank,
                                  alpha=_qwix_alpha(cfg), dropout=cfg.lora_dropout,
                                  weight_qtype=weight_qtype,
                                  shared=cfg.lora_experts == "shared"))
  if weight_qtype is not None:
    rules.append(qwix.QuantizationRule(
        module_path=_path_regex([n for names in MODULES.values() for n in names]),
        weight_qtype=weight_qtype, act_qtype=act_qtype))
    if cfg.num_experts:  # weight-only: the experts' inputs keep their dtype
      rules.append(qwix.QuantizationRule(module_path=_path_regex([EXPERTS_MODULE]),
                                         op_names=(EXPERTS_OP,), weight_qtype=weight_qtype))
  return rules


def _provider(cfg: ModelConfig, weight_qtype: str | None, act_qtype: str | None = None):
  rules = _rules(cfg, weight_qtype, act_qtype)
  return Provider(rules) if cfg.lora_rank else QuantProvider(rules)


def _template_config(cfg: ModelConfig) -> ModelConfig:
  """One layer per stack the model has (dense first)."""
  n_dense, n_moe = min(cfg.num_dense_layers, 1), min(cfg.num_moe_layers, 1)
  return cfg.replace(num_layers=n_dense + n_moe,
                     first_k_dense_replace=n_dense if cfg.num_experts else 0)


def _inputs():
  tokens = jnp.zeros((1, 2), jnp.int32)
  return tokens, jnp.arange(2, dtype=jnp.int32)[None], jnp.full((1, 2), 2, jnp.int32)


class QuantizedKernel(nnx.Param):
  """A frozen kernel stored as qwix quantized (`WithAux` of a `QArray`: integer or float8
  values and their scales), held in a Variable so that nnx states, shardings, abstract shapes
  and checkpoints treat its arrays like any parameter's. A Param subclass: qwix looks a
  matmul's weight up among the module's Params."""


@functools.lru_cache(maxsize=16)
def _template(cfg: ModelConfig, weight_qtype: str | None, act_qtype: str | None,
              make: Callable[..., nnx.Module]):
  """The abstract template after qwix's first call: {stack name: its one Block} (cached: it
  holds shapes only, and re-quantizing at every weight sync reuses it)."""
  tcfg = _template_config(cfg)

  def run():
    model = qwix.quantize_model(make(tcfg, stacked=False), _provider(cfg, weight_qtype, act_qtype),
                                *_inputs(), methods=(METHOD,), rngs=nnx.Rngs(0))
    # a second call: on the first, qwix replaces a kernel by its quantized form before its LoRA
    # step looks the kernel up, and creates that kernel's adapters only on the next call
    model.set_attributes(qwix_rngs=nnx.Rngs(0))
    model.hidden(*_inputs())
    return model

  template = nnx.eval_shape(run)
  return {name: getattr(template, name)[0] for name in ("dense_layers", "moe_layers")
          if getattr(template, name) is not None}


def module_at(root: nnx.Module, path: tuple) -> nnx.Module:
  """The submodule of `root` at `path` (a path of `nnx.iter_graph`: attribute names, layer
  indices)."""
  for key in path:
    root = root[key] if isinstance(key, int) else getattr(root, key)
  return root


def _adapted(module: nnx.Module, adapter_name: str):
  """The parameter an adapter ("<name>_lora_a" / "<name>_lora_b") belongs to."""
  return getattr(module, adapter_name.removesuffix("_lora_a").removesuffix("_lora_b"))


def _layer_count(stack: nnx.Module) -> int:
  """Layers of a stacked Block (the leading axis of its parameters)."""
  return jax.tree.leaves(nnx.state(stack, nnx.Param))[0].shape[0]


def _adapter_axes(module: nnx.Module, name: str, ndim: int) -> tuple:
  """Logical axes of an adapter matrix: A [in, rank] keeps the input's axis, B [rank, out] the
  output's, when the flattened dimension is a single one (else unsharded); a per-expert
  adapter [E, ...] keeps the experts axis first."""
  base = _adapted(module, name)
  axes = base.get_metadata()["axes"]
  axes = axes[1:] if axes[0] == "layers" else axes
  lead = ()
  if not isinstance(module, Dense):  # a routed-expert stack [E, in, out]
    lead, axes = (axes[:1] if ndim == 3 else ()), axes[1:]
  n_in = module.n_in if isinstance(module, Dense) else 1
  in_axes, out_axes = axes[:n_in], axes[n_in:]
  one = lambda a: a[0] if len(a) == 1 else None
  return lead + ((one(in_axes), None) if name.endswith("_lora_a") else (None, one(out_axes)))


def _build_layer_variables(block: nnx.Module, template_block: nnx.Module, layers: int | None,
                           rules: list, key: jax.Array) -> None:
  """Give `block` the adapters and quantized kernels qwix made on `template_block`.

  Args:
    block: a Block of the real model (a stacked one when `layers` is given).
    template_block: the template's Block after qwix's first call.
    layers: the stacked Block's layer count, or None for a single layer.
    rules: the qwix rules.
    key: PRNG key for the adapters' A matrices.
  """
  # adapters first: their axes come from the real kernel before it is quantized
  made = [(path, node) for path, node in nnx.iter_graph(template_block)
          if isinstance(node, nnx.LoRAParam)]
  made += [(path, node) for path, node in nnx.iter_graph(template_block)
           if type(node).__name__ == "WithAux"]
  for i, (path, node) in enumerate(made):
    module, name = module_at(block, path[:-1]), path[-1]
    if isinstance(node, nnx.LoRAParam):
      rule = next(r for r in rules if isinstance(r, qwix.LoraRule))
      init = rule.lora_a_initializer if name.endswith("_lora_a") else rule.lora_b_initializer
      base = _adapted(module, name)
      dtype = base.dtype if isinstance(base, nnx.Variable) else jnp.float32
      draw = lambda k: init(k, node.shape, dtype)
      k = jax.random.fold_in(key, i)
      value = draw(k) if layers is None else jax.vmap(draw)(jax.random.split(k, layers))
      axes = _adapter_axes(module, name, len(node.shape))
      setattr(module, name, nnx.LoRAParam(value, axes=(("layers",) if layers else ()) + axes))
    else:  # a kernel qwix quantized: quantize the real one the same way, layer by layer
      quantize = lambda w: qwix.quantize_params({name: w}, {name: node})[name]
      var = getattr(module, name)
      weight = var[...]
      value = quantize(weight) if layers is None else jax.vmap(quantize)(weight)
      setattr(module, name, QuantizedKernel(value, **var.get_metadata()))


def _transform(model: nnx.Module, cfg: ModelConfig, weight_qtype: str | None, seed: int,
               make: Callable[..., nnx.Module], act_qtype: str | None = None) -> nnx.Module:
  model = nnx.clone(model)  # the variables are added in place; the arrays stay shared
  # the template gives shapes and paths only: configs that differ in the adapters' scale alone
  # share one
  shapes_cfg = cfg.replace(lora_alpha=1.0, lora_rslora=False) if cfg.lora_rank else cfg
  templates = _template(shapes_cfg, weight_qtype, act_qtype, make)
  rules = _rules(cfg, weight_qtype, act_qtype)
  key = jax.random.key(seed)
  for s, name in enumerate(templates):
    stack = getattr(model, name)
    if isinstance(stack, nnx.List):
      for i, block in enumerate(stack):
        _build_layer_variables(block, templates[name], None, rules,
                               jax.random.fold_in(key, 1000 * s + i))
    else:
      n = _layer_count(stack)
      _build_layer_variables(stack, templates[name], n, rules, jax.random.fold_in(key, s))
  # qwix's class swap (its interception of `hidden`) and module paths, with no first call:
  # everything it would create exists already
  model = qwix.quantize_model(model, _provider(cfg, weight_qtype, act_qtype), *_inputs(),
                              methods=(METHOD,), skip_nnx_init=True)
  for _, module in nnx.iter_graph(model):  # every module as `make(cfg)` would have built it
    if isinstance(module, nnx.Module) and isinstance(getattr(module, "cfg", None), ModelConfig):
      module.cfg = cfg
  return model


def apply(model: nnx.Module, cfg: ModelConfig, make: Callable[..., nnx.Module],
          seed: int = 0) -> nnx.Module:
  """The model with LoRA adapters (and a quantized frozen base with `cfg.base_qtype`).

  Args:
    model: a Transformer (stacked or unstacked) without adapters, with `cfg`'s architecture.
    cfg: the model config; `lora_rank` > 0.
    make: the Transformer constructor, `make(cfg, stacked=...)` (builds the template).
    seed: seed of the adapters' A matrices (B starts at zero, so the model is unchanged).

  Returns:
    A new model sharing the base's arrays (quantized copies with `base_qtype`).

  Raises:
    ValueError: cfg.lora_rank is 0, or the model has adapters already.
  """
  if not cfg.lora_rank:
    raise ValueError("lora.apply: ModelConfig.lora_rank=0 (no adapters to add)")
  if has_adapters(model):
    raise ValueError("lora.apply: the model has adapters already")
  return _transform(model, cfg, cfg.base_qtype, seed, make)


def quantize(model: nnx.Module, cfg: ModelConfig, qtype: str,
             make: Callable[..., nnx.Module], act_qtype: str | None = None) -> nnx.Module:
  """A quantized copy of a model without adapters (e.g. a rollout engine's): weight-only, or
  weights and activations.

  Every projection `lora.MODULES` names gets a qwix `qtype` kernel (absmax, per output
  channel), every routed-expert stack too (per expert and output channel); embeddings, norms,
  the output head, routers and MLA's kv_b_proj keep their dtype. With `act_qtype`, qwix also
  quantizes the projections' inputs at every call (absmax per token over the contracted
  dimensions) and multiplies the quantized operands; the experts' inputs keep their dtype.

  Args:
    model: a Transformer (stacked or unstacked) without adapters.
    cfg: its config (lora_rank 0).
    qtype: a qwix type name, e.g. "int8", "float8_e4m3fn".
    make: the Transformer constructor.
    act_qtype: None (weight-only) or the qwix type of the projections' inputs.

  Returns:
    The quantized model (new arrays for the quantized kernels, the rest shared).
  """
  if cfg.lora_rank or has_adapters(model):
    raise ValueError("lora.quantize: the model has adapters; quantize its merged copy "
                     "(lora.merge) or train with ModelConfig.base_qtype")
  if cfg.num_experts and cfg.moe_impl != "ragged":
    raise ValueError(f"lora.quantize: ModelConfig.moe_impl={cfg.moe_impl!r}; quantized routed "
                     "experts run the grouped matmuls of moe_impl='ragged'")
  return _transform(model, cfg, qtype, 0, make, act_qtype)


def set_dropout_streams(model: nnx.Module, key: jax.Array) -> None:
  """Turn LoRA dropout on for one forward pass of `model` (a training step's).

  qwix draws an adapter's dropout mask from the `qwix_rngs` of the module it runs in; a module
  without one runs its adapters without dropout (`Provider`), which is how evaluation, scoring
  and sampling run. This gives every module of a layer stack one dropout stream per layer (its
  keys split from `key`, stacked over `layers` so that the scan slices them), so each layer and
  each adapted matmul within it draws its own mask; call it on a model merged inside the step.

  Args:
    model: a Transformer with adapters (`cfg.lora_dropout` > 0), changed in place.
    key: PRNG key of this forward (e.g. folded with the step and micro-batch).
  """
  for s, name in enumerate(("dense_layers", "moe_layers")):
    stack = getattr(model, name, None)
    if stack is None:
      continue
    k = jax.random.fold_in(key, s)
    if isinstance(stack, nnx.List):
      for i, block in enumerate(stack):
        block.set_attributes(qwix_rngs=nnx.data(nnx.Rngs(dropout=jax.random.fold_in(k, i))))
    else:
      n = _layer_count(stack)
      rngs = nnx.vmap(lambda k: nnx.Rngs(dropout=k))(jax.random.split(k, n))
      stack.set_attributes(qwix_rngs=nnx.data(rngs))


def base_config(cfg: ModelConfig) -> ModelConfig:
  """The config of the plain base model: no adapters, no quantization."""
  return cfg.replace(lora_rank=0, base_qtype=None)


def trainable(cfg: ModelConfig):
  """The nnx filter of the variables training updates: the adapters (`nnx.LoRAParam`) when
  `cfg.lora_rank` > 0, else every `nnx.Param`."""
  return nnx.LoRAParam if cfg.lora_rank else nnx.Param


def has_adapters(model: nnx.Module) -> bool:
  """Whether the model holds LoRA adapters."""
  return any(isinstance(v, nnx.LoRAParam) for _, v in nnx.iter_graph(model))


def is_quantized(model: nnx.Module) -> bool:
  """Whether some kernel of the model is quantized."""
  return any(isinstance(v, QuantizedKernel) for _, v in nnx.iter_graph(model))


def merge(model: nnx.Module, cfg: ModelConfig) -> dict:
  """Effective weights W + s A B (s = `scale(cfg)`) of the adapted or quantized projections and
  expert stacks.

  Each such Dense runs once, under qwix's interception, on the identity over its flattened
  input (fp32, bias left out): its output is exactly the kernel it applies. A quantized base
  gives its dequantized kernel (plus the adapters' product). A routed-expert stack, quantized
  or adapted, is dequantized and adds `expert_delta` (the term `Provider` adds) of each
  expert's identity rows when adapted.

  Args:
    model: a Transformer from `apply` or `quantize` (stacked or unstacked).
    cfg: its config.

  Returns:
    {parameter path (module path as `nnx.iter_graph` gives it, then "kernel" or the expert
    stack's name): fp32 weight [(layers,) in.., out..] or [(layers,) E, in, out]}.
  """
  out = {}
  for path, module in nnx.iter_graph(model):
    stacked = len(path) > 1 and not isinstance(path[1], int)
    adapted = hasattr(module, "kernel_lora_a")
    if isinstance(module, Dense) and (adapted or isinstance(module.kernel, QuantizedKernel)):
      provider = (qwix.LoraProvider(module_path=".*", rank=cfg.lora_rank,
                                    alpha=_qwix_alpha(cfg), weight_qtype=cfg.base_qtype)
                  if adapted else
                  qwix.PtqProvider([qwix.QuantizationRule(module_path=".*",
                                                          weight_qtype=cfg.base_qtype)]))
      out[path + ("kernel",)] = _effective_kernel(module, provider, stacked)
    elif isinstance(module, MoE) and (hasattr(module, EXPERT_STACKS[0] + "_lora_a") or
                              isinstance(getattr(module, EXPERT_STACKS[0]), QuantizedKernel)):
      for name in EXPERT_STACKS:
        out[path + (name,)] = _effective_experts(module, name, cfg, stacked)
  return out


def _effective_experts(moe: nnx.Module, name: str, cfg: ModelConfig, stacked: bool
                       ) -> jax.Array:
  """An expert stack [(layers,) E, in, out] as the grouped matmul applies it: dequantized, plus
  `expert_delta` of each expert's identity rows when adapted."""
  w = getattr(moe, name).get_value()
  w = qwix.dequantize(w.array) if isinstance(w, ptq.WithAux) else w
  w = w.astype(jnp.float32)
  if not hasattr(moe, name + "_lora_a"):
    return w
  factor = scale(cfg)

  def one(w, a, b):
    e, n_in, _ = w.shape
    eye = jnp.tile(jnp.eye(n_in, dtype=jnp.float32), (e, 1))  # expert g's rows: identity
    delta = expert_delta(eye, a, b, jnp.full((e,), n_in, jnp.int32), factor)
    return w + delta.reshape(w.shape)

  a, b = (getattr(moe, name + s)[...] for s in ("_lora_a", "_lora_b"))
  return jax.vmap(one)(w, a, b) if stacked else one(w, a, b)


def _effective_kernel(dense: Dense, provider, stacked: bool) -> jax.Array:
  graphdef, state = nnx.split(dense)

  def one(layer_state):
    d = nnx.merge(graphdef, layer_state)
    d.bias, d.dtype = None, jnp.float32
    in_shape = tuple(d.kernel.get_value().shape[:d.n_in])
    n = math.prod(in_shape)
    eye = jnp.eye(n, dtype=jnp.float32).reshape((n,) + in_shape)
    y = qwix.quantize_model(d, provider, eye, skip_nnx_init=True)(eye)  # [n, out..]
    return y.reshape(in_shape + y.shape[1:])

  return jax.vmap(one)(state) if stacked else one(state)


def adapter_count(model: nnx.Module) -> int:
  """Number of adapter parameters."""
  return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))


def describe(cfg: ModelConfig) -> dict[str, Any]:
  """The adapter settings of a config, for logs and checkpoints."""
  return {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha, "rslora": cfg.lora_rslora,
          "modules": list(cfg.lora_modules),
          "experts": cfg.lora_experts if cfg.lora_experts_on else None,
          "base_qtype": cfg.base_qtype}
