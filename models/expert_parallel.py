"""Expert parallelism: tokens travel to their experts' devices and back by all-to-all.

With the mesh's `experts` axes (the `experts` sharding rule, mesh axis `expert`) of size
ep > 1, each device holds E / ep experts and its own tokens (the `batch` rule includes
`expert`). Inside `jax.shard_map`, per device with t tokens and top-k routing:

  1. sort the t·k token copies by expert; copies for device j go to row block j of a
     [ep, t·k, hidden] send buffer (with each copy's local expert id);
  2. `all_to_all` over the expert axes: block i of the result holds what device i sent;
  3. sort the received copies by local expert, SwiGLU experts with `jax.lax.ragged_dot`;
  4. `all_to_all` back, weight by the gates and sum each token's copies.

Every block has room for all t·k copies, so nothing is ever dropped whatever the routing
(replayed choices included); the price is buffers of ep·t·k rows per device. Weights stay
where they are: the shard_map sees E / ep experts per device (gathered over FSDP like any
weight, never over `expert`), with their `expert_mlp` dimension kept tensor-sharded (the
partial outputs are summed over those axes). `jax.lax.ragged_all_to_all` would send only the
filled rows, but XLA:CPU does not implement it.

Routing runs on each device's own tokens too (`token_local`); the load statistics and the
shared experts stay outside, on global arrays, so they equal those of the single-device path.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from models.config import ModelConfig
from models.sharding import logical_to_spec


def grouped_ffn(xs: jax.Array, sizes: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                w_down: jax.Array) -> jax.Array:
  """SwiGLU experts on rows sorted by expert: down(silu(gate(x)) · up(x)).

  Args:
    xs: [rows, hidden] rows grouped by expert (expert 0's rows first); rows after the last
      group give zeros.
    sizes: [experts] int32 rows per expert.
    w_gate: [experts, hidden, expert_mlp].
    w_up: [experts, hidden, expert_mlp].
    w_down: [experts, expert_mlp, hidden].

  Returns:
    [rows, hidden].
  """
  h = jax.nn.silu(jax.lax.ragged_dot(xs, w_gate, sizes)) * jax.lax.ragged_dot(xs, w_up, sizes)
  return jax.lax.ragged_dot(h, w_down, sizes)


class Layout(NamedTuple):
  """How tokens and expert weights are split over the current mesh.

  Attributes:
    mesh: the abstract mesh.
    expert_axes: mesh axes the experts are split over (size > 1 each).
    token_axes: mesh axes the tokens are split over (the batch axes, then any expert axis
      the `batch` rule leaves out).
    mlp_axes: mesh axes of the experts' `expert_mlp` dimension (summed over at the end).
  """

  mesh: jax.sharding.AbstractMesh
  expert_axes: tuple[str, ...]
  token_axes: tuple[str, ...]
  mlp_axes: tuple[str, ...]

  def size(self, axes: tuple[str, ...]) -> int:
    """The number of devices along `axes`."""
    return math.prod(self.mesh.shape[a] for a in axes)


def _axes(cfg: ModelConfig, logical: str, mesh) -> tuple[str, ...]:
  """The mesh axes (size > 1) a logical axis maps to."""
  spec = logical_to_spec((logical,), cfg.sharding_rules, mesh)[0]
  return () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)


def plan(cfg: ModelConfig) -> Layout | None:
  """The expert-parallel layout under the current mesh, or None for the global dispatch.

  `moe_dispatch="auto"` takes the all-to-all dispatch when a mesh is set (`jax.set_mesh`),
  its `experts` axes have size > 1 and divide `num_experts`; "all_to_all" requires it;
  "global" (and `moe_impl="dense"`) never takes it.

  Args:
    cfg: the model config (`moe_dispatch`, `moe_impl`, `num_experts`,
      `moe_intermediate_size`, `sharding_rules`).

  Returns:
    The Layout, or None.

  Raises:
    ValueError: "all_to_all" without a mesh whose experts axes have size > 1 and divide
      `num_experts`.
  """
  if cfg.moe_dispatch == "global" or cfg.moe_impl == "dense":
    return None
  mesh = jax.sharding.get_abstract_mesh()
  expert_axes = () if mesh.empty else _axes(cfg, "experts", mesh)
  ep = math.prod(mesh.shape[a] for a in expert_axes)
  if not expert_axes or cfg.num_experts % ep:
    if cfg.moe_dispatch == "all_to_all":
      raise ValueError(f"ModelConfig.moe_dispatch='all_to_all': needs a mesh (jax.set_mesh) "
                       f"whose experts axes {expert_axes or '(none of size > 1)'} divide "
                       f"num_experts={cfg.num_experts}")
    return None
  batch_axes = _axes(cfg, "batch", mesh)
  token_axes = batch_axes + tuple(a for a in expert_axes if a not in batch_axes)
  mlp_axes = tuple(a for a in _axes(cfg, "expert_mlp", mesh)
                   if a not in token_axes and a not in expert_axes)
  if cfg.moe_intermediate_size % math.prod(mesh.shape[a] for a in mlp_axes):
    mlp_axes = ()  # the weights' expert_mlp dimension is then replicated (models.sharding)
  return Layout(mesh, expert_axes, token_axes, mlp_axes)


def token_local(cfg: ModelConfig, fn: Callable, per_token: tuple, shared: tuple = ()):
  """fn(*per_token, *shared), each device running it on its own tokens.

  For per-token work such as routing: XLA's partitioner does not split `jax.lax.top_k` along
  the batch and would gather every token to every device. Without a mesh, or when the batch
  axes do not divide the token count, fn runs as is.

  Args:
    cfg: the model config (its `batch` sharding rule).
    fn: a function of the arrays whose outputs all have a leading token dimension.
    per_token: arrays (or None) with a leading token dimension.
    shared: arrays (or None) every device reads whole.

  Returns:
    fn's outputs.
  """
  mesh = jax.sharding.get_abstract_mesh()
  axes = () if mesh.empty else _axes(cfg, "batch", mesh)
  if not axes or per_token[0].shape[0] % math.prod(mesh.shape[a] for a in axes):
    return fn(*per_token, *shared)
  tokens = PartitionSpec(axes)
  run = jax.shard_map(fn, mesh=mesh, out_specs=tokens,
                      in_specs=(tokens,) * len(per_token) + (PartitionSpec(),) * len(shared))
  return run(*per_token, *shared)


def all_to_all_experts(layout: Layout, x: jax.Array, ids: jax.Array, gates: jax.Array,
                       w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
  """Routed experts with expert parallelism: Σ_j gates_j · expert_{ids_j}(x) per token.

  Equals `grouped_ffn` over all tokens sorted by expert (the global dispatch in
  models/moe.py), computed where the experts live (module docstring).

  Args:
    layout: the mesh layout from `plan`.
    x: [tokens, hidden] in the compute dtype.
    ids: [tokens, k] int32 expert of each copy (distinct or not).
    gates: [tokens, k] gate weight of each copy, in the compute dtype.
    w_gate: [experts, hidden, expert_mlp].
    w_up: [experts, hidden, expert_mlp].
    w_down: [experts, expert_mlp, hidden].

  Returns:
    [tokens, hidden].
  """
  n = x.shape[0]
  pad = -n % layout.size(layout.token_axes)
  if pad:  # padding tokens go to expert 0 with gate 0
    x, ids, gates = (jnp.pad(a, ((0, pad), (0, 0))) for a in (x, ids, gates))
  tokens = PartitionSpec(layout.token_axes or None, None)
  mlp = layout.mlp_axes or None
  w_in = PartitionSpec(layout.expert_axes, None, mlp)
  w_out = PartitionSpec(layout.expert_axes, mlp, None)
  run = jax.shard_map(functools.partial(_exchange, layout), mesh=layout.mesh,
                      in_specs=(tokens, tokens, tokens, w_in, w_in, w_out), out_specs=tokens)
  return run(x, ids, gates, w_gate, w_up, w_down)[:n]


def _exchange(layout: Layout, x, ids, gates, w_gate, w_up, w_down):
  """One device's part of `all_to_all_experts`: x [t, hidden], ids and gates [t, k], the
  weights of its E / ep experts; returns [t, hidden]."""
  t, k = ids.shape
  ep, local = layout.size(layout.expert_axes), w_gate.shape[0]
  flat = ids.reshape(-1)
  order = jnp.argsort(flat, stable=True)  # copies by expert, hence by destination device
  token = order // k
  dest = flat[order] // local
  counts = jnp.bincount(dest, length=ep)
  slot = jnp.arange(t * k) - (jnp.cumsum(counts) - counts)[dest]  # row in dest's block
  send = jnp.zeros((ep, t * k, x.shape[1]), x.dtype).at[dest, slot].set(x[token])
  send_ids = jnp.full((ep, t * k), local, jnp.int32).at[dest, slot].set(flat[order] % local)
  exchange = functools.partial(jax.lax.all_to_all, axis_name=layout.expert_axes,
                               split_axis=0, concat_axis=0)
  recv, recv_ids = exchange(send).reshape(ep * t * k, -1), exchange(send_ids).reshape(-1)
  # empty rows carry id `local`: sorted last, in no group, computed as zeros
  by_expert = jnp.argsort(recv_ids, stable=True)
  sizes = jnp.bincount(recv_ids, length=local).astype(jnp.int32)
  out = grouped_ffn(recv[by_expert], sizes, w_gate, w_up, w_down)
  out = jnp.zeros_like(out).at[by_expert].set(out).reshape(ep, t * k, -1)
  ys = exchange(out)[dest, slot] * gates.reshape(-1)[order][:, None]
  y = jnp.zeros_like(x).at[token].add(ys)
  return jax.lax.psum(y, layout.mlp_axes) if layout.mlp_axes else y
