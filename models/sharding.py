"""Meshes and logical-axis sharding: parameters and activations carry logical axis names
(`embed`, `heads`, `experts`, ...); the config's rules table maps them to mesh axes
(`data`, `fsdp`, `tensor`, `expert`, `sequence`). `jax.jit` with the resulting shardings is the
whole parallelism story, except attention over a token-sharded row, which passes key/value chunks
between the `sequence` shards (models/kernels/context_parallel.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from models.config import ModelConfig

MESH_AXES = ("data", "fsdp", "tensor", "expert", "sequence")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh shape; one axis of size -1 absorbs the remaining devices."""

  data: int = 1  # pure data parallelism (replicated parameters)
  fsdp: int = -1  # data parallelism with parameters sharded over it (ZeRO-3)
  tensor: int = 1  # tensor (model) parallelism over heads / MLP width / vocabulary
  expert: int = 1  # expert parallelism over MoE experts
  sequence: int = 1  # context parallelism: each row's tokens split into contiguous chunks

  @classmethod
  def parse(cls, text: str) -> "MeshConfig":
    """A MeshConfig from "tensor=4,expert=2" (the named axes' sizes; the others default, fsdp
    absorbing the remaining devices). ValueError names the part that is not `axis=size`."""
    sizes = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
      axis, _, size = part.partition("=")
      if axis.strip() not in MESH_AXES or not size.strip().lstrip("-").isdigit():
        raise ValueError(f"{part!r}: expected axis=size with an axis of {MESH_AXES}")
      sizes[axis.strip()] = int(size)
    return cls(**sizes)

  def shape(self, num_devices: int) -> tuple[int, ...]:
    """Mesh sizes (data, fsdp, tensor, expert, sequence) for `num_devices`; ValueError if they
    don't fit."""
    sizes = [self.data, self.fsdp, self.tensor, self.expert, self.sequence]
    if sizes.count(-1) > 1:
      raise ValueError(f"MeshConfig{tuple(sizes)}: at most one axis may be -1")
    for name, size in zip(MESH_AXES, sizes):
      if size == 0 or size < -1:
        raise ValueError(f"MeshConfig.{name}={size}: must be positive or -1")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
      if num_devices % known:
        raise ValueError(f"MeshConfig{tuple(sizes)}: {num_devices} devices are not divisible "
                         f"by the fixed axes' product {known}")
      sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
      raise ValueError(f"MeshConfig{tuple(sizes)}: needs {math.prod(sizes)} devices, "
                       f"have {num_devices}")
    return tuple(sizes)


def make_mesh(mesh_cfg: MeshConfig, devices: Optional[Sequence[jax.Device]] = None
              ) -> jax.sharding.Mesh:
  """A device mesh with axes (data, fsdp, tensor, expert, sequence).

  `sequence` is the last (fastest-varying) axis, so the neighbours of the key/value ring of
  context-parallel attention are adjacent devices.

  Args:
    mesh_cfg: the axis sizes.
    devices: the devices to lay out (default: all).

  Returns:
    The jax.sharding.Mesh.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_cfg.shape(len(devices))
  return jax.sharding.Mesh(np.array(devices).reshape(shape), MESH_AXES)


def logical_to_spec(axes: Sequence[Optional[str]], rules, mesh) -> PartitionSpec:
  """The PartitionSpec of logical axes.

  Mesh axes of size 1 or absent from the mesh are dropped, and a mesh axis is used at most once
  (the first dimension wins).

  Args:
    axes: one logical axis name (or None) per dimension.
    rules: (logical name, mesh axes or None) pairs (`ModelConfig.sharding_rules`).
    mesh: the (abstract or concrete) mesh.

  Returns:
    The PartitionSpec.

  Raises:
    KeyError: a logical axis has no rule.
  """
  table = dict(rules)
  used: set[str] = set()
  spec = []
  for name in axes:
    mesh_axes = table.get(name) if name is not None else None
    if name is not None and name not in table:
      raise KeyError(f"logical axis {name!r} has no sharding rule; known: {sorted(table)}")
    picked = tuple(a for a in (mesh_axes or ()) if a in mesh.shape and mesh.shape[a] > 1
                   and a not in used)
    used.update(picked)
    spec.append(None if not picked else picked[0] if len(picked) == 1 else picked)
  return PartitionSpec(*spec)


def replace_rules(rules, changes: dict) -> tuple:
  """Sharding rules with some logical axes mapped anew.

  Args:
    rules: (logical name, mesh axes or None) pairs (`ModelConfig.sharding_rules`).
    changes: {logical name: mesh axes}, each a tuple of `MESH_AXES` names, one name, a
      comma-separated string ("fsdp,expert"), or "" / () for replicated.

  Returns:
    The rules in their order, the named ones replaced.

  Raises:
    ValueError: a logical name the rules do not have, or an unknown mesh axis.
  """
  known = dict(rules)
  parsed = {}
  for name, axes in changes.items():
    if name not in known:
      raise ValueError(f"sharding_rules.{name}: no such logical axis; known: {sorted(known)}")
    names = tuple(a.strip() for a in axes.split(",") if a.strip()) if isinstance(axes, str) \
        else tuple(axes or ())
    bad = [a for a in names if a not in MESH_AXES]
    if bad:
      raise ValueError(f"sharding_rules.{name}={axes!r}: mesh axes are {MESH_AXES}, not {bad}")
    parsed[name] = names or None
  return tuple((name, parsed.get(name, axes)) for name, axes in rules)


def constrain(x: jax.Array, axes: tuple[str | None, ...], cfg: ModelConfig) -> jax.Array:
  """Constrain an activation's sharding by its logical axes; a no-op outside a mesh context.

  Args:
    x: an activation array.
    axes: one logical axis name (or None) per dimension of x, e.g. ("batch", "seq", "act_embed").
    cfg: the model config whose `sharding_rules` map logical axes to mesh axes.

  Returns:
    x, with a sharding constraint under the current abstract mesh.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(axes, cfg.sharding_rules, mesh))


def axis_size(name: str, cfg: ModelConfig) -> int:
  """How many shards the current abstract mesh splits logical axis `name` into (1 outside one).

  Args:
    name: a logical axis, e.g. "batch".
    cfg: the model config (its `sharding_rules`).

  Returns:
    The product of the sizes of the mesh axes the rules assign to `name`.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return 1
  spec = logical_to_spec((name,), cfg.sharding_rules, mesh)[0]
  names = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
  return math.prod(mesh.shape[a] for a in names)


def param_spec(axes: Sequence[Optional[str]], shape: Sequence[int], rules, mesh
               ) -> PartitionSpec:
  """The PartitionSpec of a parameter: its logical axes' (`logical_to_spec`), with dimensions
  the assigned mesh axes do not divide replicated.

  Args:
    axes: the parameter's logical axis names (its `axes` metadata).
    shape: its shape.
    rules: `ModelConfig.sharding_rules`.
    mesh: the (abstract or concrete) mesh.

  Returns:
    The PartitionSpec `state_shardings` gives the parameter.
  """
  return _divisible(logical_to_spec(axes, rules, mesh), shape, mesh)


def _divisible(spec: PartitionSpec, shape, mesh) -> PartitionSpec:
  """Replicate dimensions whose size the assigned mesh axes do not divide."""
  out = []
  for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    names = (axes,) if isinstance(axes, str) else (axes or ())
    size = math.prod(mesh.shape[a] for a in names)
    out.append(axes if size and dim % size == 0 else None)
  return PartitionSpec(*out)


def state_shardings(state: nnx.State, cfg: ModelConfig, mesh) -> nnx.State:
  """The NamedSharding of every variable of a model state.

  Args:
    state: a model state (abstract or concrete).
    cfg: the model config (its `sharding_rules`).
    mesh: the device mesh.

  Returns:
    The state with each variable's value replaced by its sharding, from its `axes` metadata
    (replicated without one; dimensions the mesh axes do not divide are replicated).
  """
  def one(var):
    axes = var.get_metadata().get("axes")
    value = var.get_value()
    if axes is None:
      return var.replace(jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), value))
    # a quantized kernel (`models.lora.QuantizedKernel`) holds values and scales: each by the
    # kernel's axes (a scale's size-1 dimensions replicated)
    return var.replace(jax.tree.map(
        lambda leaf: NamedSharding(mesh, param_spec(axes, leaf.shape, cfg.sharding_rules, mesh)),
        value))
  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model, mesh):
  """Place an existing model's variables on `mesh` by the rules (e.g. after a HF import).

  Args:
    model: a Transformer.
    mesh: the device mesh.

  Returns:
    The same model with its variables sharded on `mesh`.
  """
  graphdef, state = nnx.split(model)
  shardings = state_shardings(state, model.cfg, mesh)
  return nnx.merge(graphdef, jax.device_put(state, shardings))


def commit(tree, device: jax.Device):
  """`tree` with every array committed to `device`: arrays committed there already are kept
  (the same objects), others are placed with `jax.device_put`.

  A jitted call compiles per argument placement, and committed and uncommitted arrays count as
  different ones: a one-device program fed its own (committed) outputs would compile again at
  its second call unless its first inputs were committed too.
  """
  def one(a):
    if isinstance(a, jax.Array) and a.committed and a.devices() == {device}:
      return a
    return jax.device_put(a, device)
  return jax.tree.map(one, tree)


def batch_sharding(cfg: ModelConfig, mesh, ndim: int = 2) -> NamedSharding:
  """The sharding of a [batch, seq, ...] input array: batch over the rules' `batch` axes.

  Args:
    cfg: the model config (its `sharding_rules`).
    mesh: the device mesh.
    ndim: the array's rank.

  Returns:
    The NamedSharding.
  """
  spec = logical_to_spec(("batch",) + (None,) * (ndim - 1), cfg.sharding_rules, mesh)
  return NamedSharding(mesh, spec)
