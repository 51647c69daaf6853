"""The engine's decode layout on a device mesh: where its weights, caches and slots live.

    engine = Engine(model, EngineConfig(slots=16), mesh=mesh)   # axes models.sharding.MESH_AXES

A mesh engine runs the same jitted programs as a one-device one, SPMD, under `jax.set_mesh`:
what changes is how the model's state and the pool's caches are placed, and the sharding rules
the model's activations are constrained with (`decode_rules`, set in the decode model's config):

- Weights are tensor-parallel only: heads, kv_heads, mlp, vocab and expert_mlp over `tensor`,
  the expert stacks' experts over `expert` (routers stay whole), nothing over data, fsdp or
  sequence, so no decode step all-gathers a weight. Dimensions the axes do not divide are
  replicated (`sharding.param_spec`).
- The slots (the activations' batch) are split over data, fsdp, expert and sequence (the
  batch shards, `Layout.batch_axes`); tokens sharded over `expert` are what the expert-parallel
  MoE dispatch (models/expert_parallel.py) exchanges. The sequence dimension is never split.
- Caches: key/value heads over `tensor` (MLA's latent has no head axis: replicated). The
  paged pool's pages are split over the batch shards (the logical axis `pages`, which only
  the decode rules map): each shard holds the sequences of its own slots, and every step
  writes and reads its pages on that shard (`models.attention.paged_step`, a `jax.shard_map`),
  the Pallas paged-attention kernel per shard on TPU. The contiguous pool's rows are
  replicated over the batch shards (a sequence may decode in any slot; each decode call's
  scatter of the slots' rows back into the pool is gathered across the shards): the paged
  pool is the one to decode at scale with.

Weights of an update arrive in any layout (the trainer's FSDP-sharded state on the same mesh,
or a state on other devices) and are placed by `Layout.place` (`jax.device_put`, device to
device).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from models import sharding
from models.config import ModelConfig

# mesh axes the slots are split over, in mesh order
BATCH_AXES = ("data", "fsdp", "expert", "sequence")
# mesh axes no weight is split over while decoding (no all-gather of weights per step)
_DATA_ONLY = ("data", "fsdp", "sequence")
_ACTIVATIONS = ("batch", "seq", "act_embed", "act_heads", "act_mlp", "act_vocab")


def decode_rules(rules) -> tuple:
  """The decode layout's sharding rules from a model's (training) rules.

  Args:
    rules: (logical name, mesh axes or None) pairs (`ModelConfig.sharding_rules`).

  Returns:
    The rules with `batch` over `BATCH_AXES`, `seq` replicated, every other logical axis
    (weights and the other activations) over its own mesh axes less data, fsdp and sequence
    (e.g. heads over tensor, experts over expert, embed replicated), and `pages` (the paged
    pool's pages) over `BATCH_AXES`.
  """
  out = []
  for name, axes in rules:
    if name == "pages":
      continue  # set below
    if name == "batch":
      axes = BATCH_AXES
    elif name == "seq":
      axes = None
    else:
      axes = tuple(a for a in (axes or ()) if a not in _DATA_ONLY) or None
    out.append((name, axes))
  return tuple(out) + (("pages", BATCH_AXES),)


def specs_of(tree) -> tuple:
  """The PartitionSpecs of a tree of NamedShardings, flat (a hashable static argument)."""
  return tuple(s.spec for s in jax.tree.leaves(tree))


def constrain(tree, specs: Optional[tuple]):
  """`tree` with each leaf constrained to its spec (`specs` flat, in leaf order; None: as is).
  Used inside the programs, under the engine's mesh."""
  if specs is None:
    return tree
  leaves, treedef = jax.tree.flatten(tree)
  return treedef.unflatten([jax.lax.with_sharding_constraint(a, s)
                            for a, s in zip(leaves, specs)])


class Layout:
  """The decode layout of an engine on `mesh` (module docstring).

  Args:
    mesh: a jax.sharding.Mesh with axes `models.sharding.MESH_AXES`.
    model_cfg: the model's config; its `sharding_rules` give the weights' axes.

  Attributes:
    mesh: the mesh.
    cfg: `model_cfg` with the decode rules (`decode_rules`).
    batch_axes: the mesh axes of size > 1 the slots are split over.
    shards: the number of batch shards (product of their sizes).

  Raises:
    ValueError: a mesh with other axes.
  """

  def __init__(self, mesh: jax.sharding.Mesh, model_cfg: ModelConfig):
    if tuple(mesh.axis_names) != sharding.MESH_AXES:
      raise ValueError(f"Engine(mesh=...): mesh axes {tuple(mesh.axis_names)}, expected "
                       f"{sharding.MESH_AXES} (models.sharding.make_mesh)")
    self.mesh = mesh
    self.cfg = dataclasses.replace(model_cfg,
                                   sharding_rules=decode_rules(model_cfg.sharding_rules))
    self._router_cfg = dataclasses.replace(self.cfg, sharding_rules=sharding.replace_rules(
        self.cfg.sharding_rules, {"experts": ()}))
    self.batch_axes = tuple(a for a in BATCH_AXES if mesh.shape[a] > 1)
    self.shards = math.prod(mesh.shape[a] for a in self.batch_axes)

  def check(self, config) -> None:
    """Raises ValueError naming the field that does not fit the mesh (prefill batches are
    padded to a multiple of the batch shards instead, `pad_rows`).

    Args:
      config: the engine's EngineConfig.
    """
    m, tensor, expert = self.cfg, self.mesh.shape["tensor"], self.mesh.shape["expert"]
    axes = "x".join(self.batch_axes) or "none"
    if config.slots % self.shards:
      raise ValueError(f"EngineConfig.slots={config.slots}: must be a multiple of the mesh's "
                       f"{self.shards} batch shards ({axes}) to split the slots over them")
    if m.num_heads % tensor:
      raise ValueError(f"ModelConfig.num_heads={m.num_heads}: not divisible by the mesh's "
                       f"tensor={tensor}")
    if m.is_moe and m.num_experts % expert:
      raise ValueError(f"ModelConfig.num_experts={m.num_experts}: not divisible by the mesh's "
                       f"expert={expert}")

  def context(self):
    """The context every program call of the engine runs in (`jax.set_mesh`)."""
    return jax.set_mesh(self.mesh)

  def decode_model(self, model):
    """The model with the decode rules in every module's config (activation constraints and
    the MoE dispatch read them); weights unchanged."""
    for _, module in nnx.iter_graph(model):
      if isinstance(module, nnx.Module) and isinstance(getattr(module, "cfg", None),
                                                       ModelConfig):
        module.cfg = self.cfg
    return model

  def shardings(self, state: nnx.State) -> nnx.State:
    """The decode layout's NamedSharding of every variable of a model state: by the decode
    rules, except the routers (and their biases), whose `experts` dimension stays whole:
    every device routes its own tokens over all experts without gathering them each step."""
    stacks = sharding.state_shardings(state, self.cfg, self.mesh)
    routers = sharding.state_shardings(state, self._router_cfg, self.mesh)
    def pick(var, stack, router):
      axes = var.get_metadata().get("axes") or ()
      return router if "experts" in axes and "expert_mlp" not in axes else stack
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    return jax.tree.map(pick, state, stacks, routers, is_leaf=is_var)

  def place(self, state: nnx.State) -> nnx.State:
    """The state on the mesh in the decode layout: `jax.device_put` from wherever it is
    (device to device; arrays already placed so stay as they are)."""
    return jax.device_put(state, self.shardings(state))

  def cache_shardings(self, shapes, heads_dim: Optional[int], rows_dim: Optional[int] = None
                      ) -> Any:
    """The NamedSharding of every cache leaf.

    Args:
      shapes: the caches' tree of ShapeDtypeStructs.
      heads_dim: the key/value heads dimension (over `tensor` when it divides), or None (no
        head dimension: MLA's latent).
      rows_dim: a dimension over the batch shards (rows gathered from a pool: the slots, or a
        padded prefill batch), or None (the pool itself: replicated over them).

    Returns:
      The tree of NamedShardings.
    """
    def one(leaf):
      axes: list = [None] * leaf.ndim
      if heads_dim is not None:
        axes[heads_dim] = "kv_heads"
      spec = list(sharding.param_spec(axes, leaf.shape, self.cfg.sharding_rules, self.mesh))
      spec += [None] * (leaf.ndim - len(spec))
      if rows_dim is not None:  # any number of rows: the callers' batches are divisible
        spec[rows_dim] = self.batch_axes or None
      return NamedSharding(self.mesh, PartitionSpec(*spec))
    return jax.tree.map(one, shapes)

  def zeros(self, shapes, shardings):
    """Zeroed caches created in place: each device allocates its shard only."""
    return jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
                   out_shardings=shardings)()

  def pad_rows(self, tokens: np.ndarray, starts: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """A prefill batch padded with empty rows to a multiple of the batch shards.

    Args:
      tokens: [b, p] int32.
      starts: [b] int32.

    Returns:
      (tokens [b', p], starts [b']), b' = b rounded up to a multiple of `shards`.
    """
    pad = -len(starts) % self.shards
    if not pad:
      return tokens, starts
    return (np.concatenate([tokens, np.zeros((pad, tokens.shape[1]), tokens.dtype)]),
            np.concatenate([starts, np.zeros(pad, starts.dtype)]))


def context(layout: Optional[Layout]):
  """`layout.context()`, or a no-op without a layout (one device)."""
  return layout.context() if layout is not None else contextlib.nullcontext()
