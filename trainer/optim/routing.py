"""Routing: which optimizer (Muon or AdamW), which Muon dimension numbers and which shape scale
each parameter gets, decided from its logical axes (models/layers.py `param`) and, for
projections, the input rank recorded in `models.layers.Dense.n_in`.

Embeddings, lm_head, norm gains, biases and router weights go to AdamW; every other matrix to
Muon (under `muon` / `muon_clip`), LoRA adapters included (A [in, rank] and B [rank, out] each
orthogonalised as a matrix of its own). Layer stacks (`layers` axis) and MoE experts (`experts`
axis) are Muon batch axes: every layer's matrix, and every expert's matrix, is orthogonalised on
its own. Attention projections are orthogonalised as whole [in, heads·dim] matrices unless
`muon.per_head_attention`, which makes the head axis a batch axis too. A parameter no rule
covers is a start-up error.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import jax
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from models import lora
from models.config import ModelConfig
from models.layers import Dense
from models.transformer import abstract
from trainer.optim.config import OptimizerConfig

HEAD_AXES = ("heads", "kv_heads")


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
    """The path joined with "/", e.g. "moe_layers/attn/q_b_proj/kernel"."""
    return "/".join(self.path)

  @property
  def batch_axes(self) -> tuple[int, ...]:
    """The axes Muon orthogonalises over independently (neither reduction nor output)."""
    if self.dims is None:
      return ()
    used = set(_as_tuple(self.dims.reduction_axis)) | set(_as_tuple(self.dims.output_axis))
    return tuple(i for i in range(len(self.shape)) if i not in used)


def _as_tuple(x) -> tuple[int, ...]:
  return (x,) if isinstance(x, int) else tuple(x)


def path_names(path) -> tuple[str, ...]:
  """The key names of a tree key path, a Variable's trailing `.value` dropped.

  Args:
    path: a key path from `jax.tree_util` (dict, attribute and sequence keys).

  Returns:
    The names as strings, e.g. ("moe_layers", "mlp", "gate_proj").
  """
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
  """The trailing run of dict keys of a key path.

  Inside an optimizer state tree this is the path of the parameter a moment leaf copies (the
  state's own NamedTuple fields and sequence indices come before it).

  Args:
    path: a key path from `jax.tree_util`.

  Returns:
    The dict key names after the last non-dict key, a Variable's `.value` skipped.
  """
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
  """What routing needs of every trained parameter of the model (every `nnx.Param`, or the LoRA
  adapters alone), read from its abstract instance.

  Args:
    model_cfg: the model.

  Returns:
    {path: (shape, logical axes, Dense input rank or None)} in tree order.
  """
  model = abstract(model_cfg)
  n_in = {tuple(str(p) for p in path): node.n_in for path, node in nnx.iter_graph(model)
          if isinstance(node, Dense)}
  info = {}
  state = nnx.state(model, lora.trainable(model_cfg))
  for path, var in jax.tree.leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
    names = path_names(path)
    dense_in = n_in.get(names[:-1]) if names[-1] == "kernel" else None
    info[names] = (tuple(var.shape), tuple(var.get_metadata()["axes"]), dense_in)
  return info


def route(cfg: Any, path: tuple[str, ...], shape: tuple[int, ...], axes: tuple[str, ...],
          dense_in: Optional[int] = None) -> Route:
  """The route of one parameter leaf.

  A Muon matrix gets the shape scale of `muon.scale_rule`: "moonlight" rms·√max(fan_in,
  fan_out), which gives every matrix the update RMS of AdamW, or "keller" √max(1,
  fan_out/fan_in), fan_in and fan_out being the products of the reduction and output axes.

  Args:
    cfg: the optimizer settings (`OptimizerConfig` or the `config.optimizer` section).
    path: the leaf's keys in the parameter tree.
    shape: the leaf's shape.
    axes: the leaf's logical axis names.
    dense_in: for a `Dense` kernel, its number of input axes (after any `layers` axes).

  Returns:
    The leaf's `Route`.

  Raises:
    ValueError: for a parameter no rule covers, or one that leaves Muon no matrix.

  References:
    Keller Jordan, "Muon: An optimizer for hidden layers in neural networks", 2024.
    Liu et al., "Muon is Scalable for LLM Training" (Moonlight), arXiv 2502.16982, 2025.
  """
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
  if path[-1].endswith(("_lora_a", "_lora_b")):
    # [layers.., (experts,) in, rank] / [layers.., (experts,) rank, out]: one matrix per expert
    role = "lora"
    rest = [i for i in range(lead, len(axes)) if axes[i] != "experts"]
    reduction, output = [rest[0]], [rest[1]]
  elif dense_in is not None:
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
                     f"axes {axes} (add one to trainer/optim/routing.py)")
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


def routing_table(cfg: Any, model_cfg: ModelConfig) -> list[Route]:
  """The route of every parameter of the model.

  Args:
    cfg: the optimizer settings (`OptimizerConfig` or the `config.optimizer` section).
    model_cfg: the model.

  Returns:
    One `Route` per parameter, in tree order.
  """
  cfg = OptimizerConfig.from_config(cfg)
  return [route(cfg, path, shape, axes, dense_in)
          for path, (shape, axes, dense_in) in model_param_info(model_cfg).items()]


def format_table(rows: Sequence[Route]) -> str:
  """The routing table as fixed-width text.

  Args:
    rows: the routes, e.g. `Optimizer.table`.

  Returns:
    One line per parameter (path, shape, role, optimizer, dimension numbers, scale, decay)
    under a header, and a last line with the fraction of parameters that use Muon.
  """
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
