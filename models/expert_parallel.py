"""Expert parallelism: tokens travel to their experts' devices and back by all-to-all.

With the mesh's `experts` axes (the `experts` sharding rule, mesh axis `expert`) of size
ep > 1, each device holds E / ep experts and its own tokens (the `batch` rule includes
`expert`). Inside `jax.shard_map`, each device takes its t tokens (top-k routing) in rounds of
c <= `moe_dispatch_chunk` tokens (one round when that is 0 or >= t), and per round:

  1. sorts the round's c·k token copies by expert: the copies for device j form the j-th
     contiguous segment of a [c·k, hidden] send buffer. The per-expert counts of every device
     are all-gathered ([ep, E] int32), from which each device computes every segment's place;
  2. a ragged all-to-all over the expert axes (`_ragged_exchange`) moves just those segments,
     c·k rows per device at most (padding copies stay home): device j receives device i's
     segment after those of devices < i. Each segment being sorted by expert, the received
     rows are ep·(E / ep) back-to-back (device, expert) groups;
  3. sorts the received rows by local expert, SwiGLU experts with `grouped_matmul`
     (`jax.lax.ragged_dot`, differentiable under vmap);
  4. the reverse ragged all-to-all brings each result back to its copy's row; the gates weight
     them and each token's copies are summed.

Nothing is ever dropped whatever the routing (replayed choices included): the receive buffer
has room for ep·c·k rows, the case of every device sending all its copies to one device. A
round's buffers are hence ep·c·k rows per device (c·k on the sending side), and each round
(exchanges, experts, combine) runs under `jax.checkpoint` inside a `jax.lax.map` over the
rounds, so the backward pass holds one round's buffers, not all of them; the price is the
round's recomputation (its two exchanges run again). The rounds are of equal size
(ceil(t / ceil(t / chunk)) tokens), the last padded with tokens that choose no expert: sent
nowhere, with gate 0, they change no result.

`_ragged_exchange` is `jax.lax.ragged_all_to_all` when compiling for TPU or GPU
(`models.kernels.attention.target_platform`, so that ahead-of-time compilation for a TPU on a
CPU host emits it too); XLA:CPU does not implement it, and there an emulation with the same
semantics runs: a dense `all_to_all` of blocks padded to the send buffer's size (ep times the
traffic and memory), then each block's rows written at their offsets.

Weights stay where they are: the shard_map sees E / ep experts per device (gathered over FSDP
like any weight, never over `expert`), with their `expert_mlp` dimension kept tensor-sharded
(the partial outputs are summed over those axes).

Routing runs on each device's own tokens too (`token_local`); the load statistics and the
shared experts stay outside, on global arrays, so they equal those of the single-device path.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from models.config import ModelConfig
from models.grouped_matmul import grouped_matmul
from models.kernels.attention import target_platform
from models.sharding import logical_to_spec

# Platforms whose XLA backend implements the ragged-all-to-all collective.
RAGGED_ALL_TO_ALL_PLATFORMS = ("tpu", "gpu")


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
  h = jax.nn.silu(grouped_matmul(xs, w_gate, sizes)) * grouped_matmul(xs, w_up, sizes)
  return grouped_matmul(h, w_down, sizes)


class Layout(NamedTuple):
  """How tokens and expert weights are split over the current mesh.

  Attributes:
    mesh: the abstract mesh.
    expert_axes: mesh axes the experts are split over (size > 1 each).
    token_axes: mesh axes the tokens are split over (the batch axes, then any expert axis
      the `batch` rule leaves out).
    mlp_axes: mesh axes of the experts' `expert_mlp` dimension (summed over at the end).
    chunk: at most this many tokens per device per exchange round; 0 = all in one round
      (`moe_dispatch_chunk`).
  """

  mesh: jax.sharding.AbstractMesh
  expert_axes: tuple[str, ...]
  token_axes: tuple[str, ...]
  mlp_axes: tuple[str, ...]
  chunk: int = 0

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
  "global" (and `moe_impl="dense"`, and routed-expert LoRA adapters, which join the global
  dispatch's grouped matmuls) never takes it.

  Args:
    cfg: the model config (`moe_dispatch`, `moe_dispatch_chunk`, `moe_impl`, `num_experts`,
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
  if cfg.lora_experts_on:
    if expert_axes:
      warnings.warn(f"routed-expert LoRA adapters run the global MoE dispatch, not the "
                    f"all-to-all over the mesh's experts axes {expert_axes}: tokens and expert "
                    "weights are gathered across them", stacklevel=2)
    return None
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
  return Layout(mesh, expert_axes, token_axes, mlp_axes, cfg.moe_dispatch_chunk)


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
  x, ids, gates = _pad_tokens(x, ids, gates, pad, no_expert=w_gate.shape[0])
  tokens = PartitionSpec(layout.token_axes or None, None)
  mlp = layout.mlp_axes or None
  w_in = PartitionSpec(layout.expert_axes, None, mlp)
  w_out = PartitionSpec(layout.expert_axes, mlp, None)
  run = jax.shard_map(functools.partial(_exchange, layout), mesh=layout.mesh,
                      in_specs=(tokens, tokens, tokens, w_in, w_in, w_out), out_specs=tokens)
  return run(x, ids, gates, w_gate, w_up, w_down)[:n]


def _pad_tokens(x, ids, gates, pad: int, no_expert: int):
  """x, ids, gates with `pad` more tokens that choose expert id `no_expert` (none) with gate 0."""
  if not pad:
    return x, ids, gates
  rows = ((0, pad), (0, 0))
  return (jnp.pad(x, rows), jnp.pad(ids, rows, constant_values=no_expert),
          jnp.pad(gates, rows))


def _exchange(layout: Layout, x, ids, gates, w_gate, w_up, w_down):
  """One device's part of `all_to_all_experts`: x [t, hidden], ids and gates [t, k], the
  weights of its E / ep experts; returns [t, hidden], in rounds of at most `layout.chunk`
  tokens."""
  t = x.shape[0]
  if layout.mlp_axes:
    # the tokens vary over the mlp axes from here on: the backward pass then sums their
    # partial gradients over those axes once, here ([t, hidden]), not the receive buffers
    # (ep·c·k rows per round) where they would first meet the mlp-split weights
    x = jax.lax.pcast(x, layout.mlp_axes, to="varying")
  rounds = -(-t // layout.chunk) if layout.chunk else 1
  if rounds == 1:
    y = _round(layout, x, ids, gates, w_gate, w_up, w_down)
  else:
    c = -(-t // rounds)  # equal rounds: at most one round's worth of padding, often less
    no_expert = layout.size(layout.expert_axes) * w_gate.shape[0]
    x, ids, gates = (a.reshape(rounds, c, -1) for a in
                     _pad_tokens(x, ids, gates, rounds * c - t, no_expert))
    # the backward pass then keeps one round's inputs per round and recomputes its buffers
    # (prevent_cse=False: inside a loop, XLA cannot move the recomputation forward anyway)
    one = jax.checkpoint(lambda a: _round(layout, *a, w_gate, w_up, w_down), prevent_cse=False)
    y = jax.lax.map(one, (x, ids, gates)).reshape(rounds * c, -1)[:t]
  return jax.lax.psum(y, layout.mlp_axes) if layout.mlp_axes else y


def _round(layout: Layout, x, ids, gates, w_gate, w_up, w_down):
  """One exchange round of one device: x [c, hidden], ids and gates [c, k] (id E: no expert),
  the weights of its E / ep experts; returns [c, hidden] (partial over the mlp axes)."""
  c, k = ids.shape
  n, d = c * k, x.shape[1]
  axes = layout.expert_axes
  ep, local = layout.size(axes), w_gate.shape[0]
  flat = ids.reshape(-1)
  order = jnp.argsort(flat, stable=True)  # by expert, hence by device; no-expert copies last
  token = order // k
  # counts[i, j, l]: copies device i sends to device j's local expert l
  counts = jax.lax.all_gather(jnp.bincount(flat, length=ep * local), axes)
  counts = counts.reshape(ep, ep, local).astype(jnp.int32)
  me = jax.lax.axis_index(axes)
  sizes = counts.sum(-1)  # [sender, receiver] segment sizes
  # segment (i, j) starts at row Σ_{j' < j} sizes[i, j'] of i's send buffer and at row
  # Σ_{i' < i} sizes[i', j] of j's receive buffer
  send_at, recv_at = jnp.cumsum(sizes, 1) - sizes, jnp.cumsum(sizes, 0) - sizes
  # the exchanges' empty buffers take their operand's device-variance (zeros_like): a plain
  # jnp.zeros would be cast to it, and that cast's transpose all-reduces the buffer's
  # cotangent over the token axes in every round of the backward pass
  send = x[token]
  recv = _ragged_exchange(send, jnp.zeros_like(send, shape=(ep * n, d)), send_at[me],
                          sizes[me], recv_at[me], sizes[:, me], axis_name=axes)
  # received rows: groups (sender i, local expert l) back to back, i-major; rows past the last
  # group are unused, get id `local`: sorted last, in no group, computed as zeros
  group = jnp.searchsorted(jnp.cumsum(counts[:, me].reshape(-1)), jnp.arange(ep * n),
                           side="right")
  recv_ids = jnp.where(group < ep * local, group % local, local)
  by_expert = jnp.argsort(recv_ids, stable=True)
  out = grouped_ffn(recv[by_expert], counts[:, me].sum(0), w_gate, w_up, w_down)
  out = jnp.zeros_like(out).at[by_expert].set(out)
  # the way back: segment (i, me) returns from row recv_at[i, me] to row send_at[i, me] of i
  back = _ragged_exchange(out, jnp.zeros_like(out, shape=(n, d)), recv_at[:, me],
                          sizes[:, me], send_at[:, me], sizes[me], axis_name=axes)
  ys = back * gates.reshape(-1)[order][:, None]  # no-expert copies: rows of zeros, gate 0
  return jnp.zeros_like(x).at[token].add(ys)


def _ragged_exchange(operand: jax.Array, output: jax.Array, input_offsets: jax.Array,
                     send_sizes: jax.Array, output_offsets: jax.Array, recv_sizes: jax.Array,
                     *, axis_name: tuple[str, ...]) -> jax.Array:
  """`jax.lax.ragged_all_to_all` where the target platform has it, else an emulation.

  The semantics of `jax.lax.ragged_all_to_all`, inside `jax.shard_map`, with a = the size of
  `axis_name` and K = len(input_offsets) a multiple of a, s = K / a: slice q of this device,
  operand[input_offsets[q] : input_offsets[q] + send_sizes[q]], goes to device q // s, where
  it is written from row output_offsets[q] of the result (offsets in the receiver's buffer).
  The result is `output` with the received slices written: entry i of recv_sizes is the size
  of the slice received from device i // s (that device's slice (this device)·s + i % s), so
  `send_sizes` must equal all_to_all(recv_sizes). Rows no slice lands on keep `output`'s values.

  Args:
    operand: [n, ...] rows to send.
    output: [m, ...] the result's value where nothing is received.
    input_offsets: [K] int32 first row of each slice in `operand`.
    send_sizes: [K] int32 rows of each slice sent.
    output_offsets: [K] int32 first row of each sent slice in its receiver's result.
    recv_sizes: [K] int32 rows of each slice received.
    axis_name: the mesh axes exchanged over.

  Returns:
    [m, ...] in output's dtype.
  """
  if target_platform() in RAGGED_ALL_TO_ALL_PLATFORMS:
    return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                     recv_sizes, axis_name=axis_name)
  return _emulated_ragged_all_to_all(operand, output, input_offsets, output_offsets,
                                     recv_sizes, axis_name=axis_name)


def _emulated_ragged_all_to_all(operand, output, input_offsets, output_offsets, recv_sizes, *,
                                axis_name):
  """`jax.lax.ragged_all_to_all` from dense collectives (`_ragged_exchange`'s arguments; the
  receiver's `recv_sizes` say how many rows of each slice count, as for the real one)."""
  n, m = operand.shape[0], output.shape[0]
  rows = jnp.arange(n)
  # each slice as a block of n rows (room for any slice); rows past the operand read zeros
  blocks = jnp.take(operand, input_offsets[:, None] + rows, axis=0, mode="fill", fill_value=0)
  a2a = functools.partial(jax.lax.all_to_all, axis_name=axis_name, split_axis=0, concat_axis=0,
                          tiled=True)
  blocks, offsets = a2a(blocks), a2a(output_offsets)  # entry i: from device i // s
  # row p of block i lands at offsets[i] + p when p < recv_sizes[i]; index m is dropped
  dest = jnp.where(rows < recv_sizes[:, None], offsets[:, None] + rows, m)
  return output.at[dest.reshape(-1)].set(blocks.reshape(-1, *operand.shape[1:]), mode="drop")
