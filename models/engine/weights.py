"""The weights an engine samples with: the unstacked decode model (a qwix-quantized copy with
`EngineConfig.weight_qtype`) and the conversion of the weights `Engine.update_params` brings
into its state.

Decoding runs the unstacked model (`transformer.unstack`): every layer reads its own weight and
cache buffers. Weights are a jit argument of the programs, so a new state of the same tree
structure, shapes and dtypes swaps in without recompiling; `_rebuild` takes only the values of
the weights it is given, in the engine's own structure (variable metadata is part of a state's
tree structure, and a different one would retrace).

Quantized rollouts: with a `weight_qtype` the engine samples from a weight-only quantized copy
of the policy (`models.lora.quantize`: projections and routed-expert stacks; with an
`act_qtype` the projections' inputs are quantized at every call too). The model is quantized at
construction and the full-precision weights of each update are quantized again (one jitted
call); only the quantized copy is kept, and the trainer keeps its own precision. Log-probs are
the quantized model's, so the trainer's mismatch corrections (rl.corrections) see the
quantization error.

Compute-dtype projections: every projection kernel and routed-expert stack is cast to the
compute dtype at every use (`models.layers.Dense`, `models.moe`), so the engine keeps them in
that dtype (bf16 models: half the bytes held, and each decode step reads them once instead of
reading fp32 and casting); a bf16 update is cast once, on its devices, as it arrives. What is
computed is unchanged. Norm gains, biases, the embedding, the LM head and the routers, which
are read in fp32, keep the model's fp32. (Not for quantized or LoRA engines: those keep their
own layouts.)

LoRA: an engine whose model has `nnx.LoRAParam` adapters takes the adapters alone in an update
(`nnx.state(model, nnx.LoRAParam)` or the trainer's pure `TrainState.params`, stacked or
unstacked; with a MoE router's bias beside them when it trains): its frozen base stays where it
is and only those variables move.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from models import lora, transformer


def _is_unstacked(model) -> bool:
  """Whether the model keeps each layer as a Block of its own (`transformer.unstack`)."""
  return any(isinstance(s, nnx.List) for s in (model.dense_layers, model.moe_layers))


def _is_stacked_state(state: nnx.State) -> bool:
  """Whether a model state has layer stacks (an unstacked one has per-layer entries 0, 1, ...)."""
  values = nnx.to_pure_dict(state)
  return any(name in values and not all(isinstance(k, int) for k in values[name])
             for name in ("dense_layers", "moe_layers"))


def _is_adapter_state(state: Any) -> bool:
  """Whether `state` holds LoRA adapters alone (`nnx.state(model, nnx.LoRAParam)`)."""
  if not isinstance(state, nnx.State):
    return False
  variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return bool(variables) and all(isinstance(v, nnx.LoRAParam) for v in variables)


def unstack_values(values: dict) -> dict:
  """A pure-dict state with each layer stack [layers, ...] split into per-layer entries
  {0: ..., 1: ...}, as `transformer.unstack` lays them out."""
  out = dict(values)
  for name in ("dense_layers", "moe_layers"):
    if name in out and not all(isinstance(k, int) for k in out[name]):
      n = jax.tree.leaves(out[name])[0].shape[0]
      out[name] = {i: jax.tree.map(lambda a, i=i: a[i], out[name]) for i in range(n)}
  return out


# the same, as one jitted call: layer slices of device arrays stay on their devices, without a
# host-to-device index per layer
_unstack = jax.jit(unstack_values)

# variables every forward casts to the compute dtype before reading them: Dense kernels and the
# routed-expert stacks
_PROJECTIONS = ("kernel", "gate_proj", "up_proj", "down_proj")


@functools.partial(jax.jit, static_argnums=(1,))
def projections_to(values, dtype):
  """A state (or its pure dict) with the projection kernels and routed-expert stacks in
  `dtype` (the compute dtype; module docstring); every other variable as it is."""
  def cast(path, a):
    if isinstance(path[-1], jax.tree_util.GetAttrKey) and len(path) > 1:  # Variable.value
      path = path[:-1]
    key = getattr(path[-1], "key", None)
    floating = jnp.issubdtype(a.dtype, jnp.floating)
    return a.astype(dtype) if key in _PROJECTIONS and floating else a
  return jax.tree_util.tree_map_with_path(cast, values)


def compute_dtype(model) -> Optional[jnp.dtype]:
  """The dtype an engine keeps `model`'s projections in: its compute dtype when that is
  narrower than fp32 and the model has no adapters nor quantized weights; else None (as
  given)."""
  dt = jnp.dtype(model.cfg.dtype)
  plain = not (model.cfg.lora_rank or lora.has_adapters(model) or lora.is_quantized(model))
  return dt if plain and dt.itemsize < 4 else None


def _abstract(state: nnx.State) -> nnx.State:
  """The state with ShapeDtypeStruct values: its structure, shapes and dtypes, no arrays."""
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)


def _rebuild(reference: nnx.State, params: nnx.State) -> nnx.State:
  """`params`' values in `reference`'s tree structure (a structure, shape or dtype that differs
  raises).

  Only values are taken: variable metadata (e.g. an initialiser's std) is part of a state's tree
  structure, and a different structure would retrace the engine's jitted calls.

  Args:
    reference: the state (or abstract state) whose structure the result has.
    params: a state with the same variables, or its pure dict (`nnx.to_pure_dict`).

  Returns:
    A state of `reference`'s structure holding `params`' arrays.

  Raises:
    ValueError: other variables, or a variable of another shape or dtype.
  """
  new_values = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
  old_values = nnx.to_pure_dict(reference)
  if jax.tree.structure(new_values) != jax.tree.structure(old_values):
    raise ValueError("update_params: the new weights do not have the engine model's "
                     "structure (other layers or parameters)")
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree.leaves_with_path(old_values)]
  new_leaves, old_leaves = jax.tree.leaves(new_values), jax.tree.leaves(old_values)
  for path, a, b in zip(paths, old_leaves, new_leaves):
    if a.shape != b.shape or a.dtype != b.dtype:
      raise ValueError(f"update_params: {path} is {b.dtype}{list(b.shape)}, expected "
                       f"{a.dtype}{list(a.shape)}")
  return jax.tree.unflatten(jax.tree.structure(reference), [jnp.asarray(b) for b in new_leaves])


@functools.lru_cache(maxsize=16)
def _quantizer(graphdef: nnx.GraphDef, stacked: bool, qtype: str, act_qtype: Optional[str]
               ) -> Callable[[nnx.State], nnx.State]:
  """The jitted full-precision state -> qwix-quantized unstacked state, for a stacked or an
  unstacked model's graphdef (cached: engines and weight syncs of one model share it)."""

  def quantize(state: nnx.State) -> nnx.State:
    model = nnx.merge(graphdef, state)
    model = transformer.unstack(model) if stacked else model
    return nnx.state(lora.quantize(model, model.cfg, qtype, transformer.Transformer, act_qtype))
  return jax.jit(quantize)


_QUANTIZED_GRAPHDEFS: dict[tuple, nnx.GraphDef] = {}  # (graphdef, qtypes) -> quantized one's


def _quantized_graphdef(graphdef: nnx.GraphDef, qtype: str, act_qtype: Optional[str],
                        state: nnx.State) -> nnx.GraphDef:
  """The graphdef of an unstacked model's quantized copy.

  qwix gives every quantized copy a class of its own, so the graphdefs of two copies never
  compare equal and two engines would compile their calls twice: engines quantizing the same
  model structure to the same type share the first one's graphdef, and its compiled calls.

  Args:
    graphdef: the full-precision unstacked model's graphdef.
    qtype: the qwix weight type.
    act_qtype: the qwix activation type, or None.
    state: that model's state (only shapes are read).

  Returns:
    The quantized copy's graphdef.
  """
  key = (graphdef, qtype, act_qtype)
  if key not in _QUANTIZED_GRAPHDEFS:
    if len(_QUANTIZED_GRAPHDEFS) >= 16:
      _QUANTIZED_GRAPHDEFS.pop(next(iter(_QUANTIZED_GRAPHDEFS)))
    def quantize(s):
      model = nnx.merge(graphdef, s)
      return lora.quantize(model, model.cfg, qtype, transformer.Transformer, act_qtype)
    _QUANTIZED_GRAPHDEFS[key] = nnx.graphdef(nnx.eval_shape(quantize, state))
  return _QUANTIZED_GRAPHDEFS[key]


def prepare(model, weight_qtype: Optional[str] = None, act_qtype: Optional[str] = None
            ) -> tuple[Any, "Weights"]:
  """The model an engine decodes with, and the `Weights` that convert its updates.

  Args:
    model: the Transformer (stacked or unstacked) the engine is built from.
    weight_qtype: None, or the qwix weight type to sample with (`EngineConfig.weight_qtype`).
    act_qtype: None, or the qwix activation type (`EngineConfig.act_qtype`).

  Returns:
    (the unstacked model, quantized with `weight_qtype`; its Weights). The Weights keep no
    array of the model.

  Raises:
    ValueError: a quantized engine of a model with LoRA adapters or of a quantized model.
  """
  if weight_qtype is not None and (model.cfg.lora_rank or lora.has_adapters(model)):
    raise ValueError(
        f"EngineConfig.weight_qtype={weight_qtype!r}: the model has LoRA adapters "
        f"(ModelConfig.lora_rank={model.cfg.lora_rank}); sample from its merged weights "
        "(models.lora.merge) or quantize the frozen base with ModelConfig.base_qtype")
  if weight_qtype is not None and lora.is_quantized(model):
    raise ValueError(f"EngineConfig.weight_qtype={weight_qtype!r}: the model is quantized "
                     "already; pass its full-precision weights")
  stacked_graphdef = None if _is_unstacked(model) else nnx.graphdef(model)
  # weight_qtype: {stacked: (graphdef, abstract state)} of the full-precision models that
  # updates quantize (no full-precision array is kept)
  full: dict[bool, tuple[Any, nnx.State]] = {}
  if weight_qtype is not None and stacked_graphdef is not None:
    full[True] = (stacked_graphdef, _abstract(nnx.state(model)))
  model = model if _is_unstacked(model) else transformer.unstack(model)
  narrow = None if weight_qtype is not None else compute_dtype(model)
  if narrow is not None:
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, projections_to(state, narrow))
  if weight_qtype is not None:
    graphdef, state = nnx.split(model)
    full[False] = (graphdef, _abstract(state))
    model = nnx.merge(_quantized_graphdef(graphdef, weight_qtype, act_qtype, state),
                      _quantizer(graphdef, False, weight_qtype, act_qtype)(state))
    del state  # the engine holds the quantized copy only
  return model, Weights(model, stacked_graphdef, full, weight_qtype, act_qtype, narrow)


class Weights:
  """Turns the weights an update brings into a state of the engine's decode model.

  Built by `prepare`. Holds graphdefs and abstract states only.
  """

  def __init__(self, model, stacked_graphdef: Optional[nnx.GraphDef],
               full: dict[bool, tuple[Any, nnx.State]], weight_qtype: Optional[str],
               act_qtype: Optional[str], narrow: Optional[jnp.dtype] = None):
    self.weight_qtype, self.act_qtype = weight_qtype, act_qtype
    self._narrow = narrow  # the projections' dtype (`compute_dtype`), or None
    self._stacked_graphdef = stacked_graphdef  # None: the engine was built unstacked
    self._full = full
    self._reference = _abstract(nnx.state(model))  # the decode state's structure
    # paths of the LoRA adapters in the (unstacked) state: an update may bring these alone
    self._adapter_paths = frozenset(path for path, _ in
                                    nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)))

  def convert(self, params, current: nnx.State) -> nnx.State:
    """The decode model's state holding `params` (as `Engine.update_params` takes them).

    Args:
      params: a Transformer (stacked or not) or the full nnx.State of one, with the shapes and
        dtypes of the model the engine was built from (full precision with `weight_qtype`);
        for a model with LoRA adapters, any nnx.State holding all its adapters.
      current: the engine's latest state (of its pending update, if one waits): a LoRA
        engine keeps the variables `params` does not hold from it.

    Returns:
      The new state (quantized with `weight_qtype`).

    Raises:
      ValueError: weights of another structure, shape or dtype (adapters for an engine without
        them; a partial state missing adapters).
    """
    if isinstance(params, nnx.State) and self._adapter_paths:
      return self._with_leaves(params, current)
    if _is_adapter_state(params):
      raise ValueError("update_params: got LoRA adapters alone, but the engine's model has "
                       "none; pass the full weights")
    stacked = (_is_stacked_state(params) if isinstance(params, nnx.State)
               else not _is_unstacked(params))
    if isinstance(params, nnx.State) and stacked and self._stacked_graphdef is None:
      raise ValueError("update_params: got a stacked state for an engine built from an "
                       "unstacked model; pass a Transformer")
    if self.weight_qtype is not None:
      return self._quantized(params, stacked)
    values = nnx.to_pure_dict(params if isinstance(params, nnx.State) else nnx.state(params))
    values = _unstack(values) if stacked else values
    if self._narrow is not None:
      values = projections_to(values, self._narrow)
    return _rebuild(self._reference, values)

  def _quantized(self, params, stacked: bool) -> nnx.State:
    """The engine's quantized state of new full-precision weights (`weight_qtype`)."""
    if not isinstance(params, nnx.State):
      if lora.is_quantized(params):
        raise ValueError(f"update_params: EngineConfig.weight_qtype={self.weight_qtype!r} "
                         "quantizes the weights itself; pass the full-precision model")
      if stacked and True not in self._full:  # an engine built from an unstacked model
        params, stacked = transformer.unstack(params), False
      params = nnx.state(params)
    full = _rebuild(self._full[stacked][1], params)
    quantize = _quantizer(self._full[stacked][0], stacked, self.weight_qtype,
                          self.act_qtype)
    return _rebuild(self._reference, quantize(full))

  def _with_leaves(self, params: nnx.State, current: nnx.State) -> nnx.State:
    """A LoRA engine's state with the variables `params` holds replaced, the rest kept.

    Args:
      params: an nnx.State (of Variables or pure), stacked or unstacked, holding every LoRA
        adapter of the engine's model and any other of its variables (e.g. a MoE router's
        bias, which training updates beside the adapters).
      current: the engine's latest state, whose other variables are kept.

    Returns:
      The new state: `params`' arrays where it has them, the engine's own elsewhere.

    Raises:
      ValueError: an adapter missing, a variable the model does not have, or one of another
        shape or dtype.
    """
    values = nnx.to_pure_dict(params)
    if _is_stacked_state(params):
      values = _unstack(values)
    new = nnx.traversals.flatten_mapping(values)
    old = nnx.traversals.flatten_mapping(nnx.to_pure_dict(current))
    missing = sorted("/".join(map(str, p)) for p in self._adapter_paths - set(new))
    unknown = sorted("/".join(map(str, p)) for p in set(new) - set(old))
    if missing or unknown:
      raise ValueError(f"update_params: the weights are not the engine model's: adapters "
                       f"missing {missing[:3]} ({len(missing)}), unknown variables "
                       f"{unknown[:3]} ({len(unknown)})")
    for path, b in new.items():
      a = old[path]
      if jax.tree.structure(a) != jax.tree.structure(b) or any(
          x.shape != y.shape or x.dtype != y.dtype
          for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))):
        raise ValueError(f"update_params: {'/'.join(map(str, path))} is "
                         f"{jax.tree.map(lambda x: (x.dtype, x.shape), b)}, expected "
                         f"{jax.tree.map(lambda x: (x.dtype, x.shape), a)}")
      old[path] = b
    leaves = jax.tree.leaves(nnx.traversals.unflatten_mapping(old))
    return jax.tree.unflatten(jax.tree.structure(self._reference),
                              [jnp.asarray(b) for b in leaves])
