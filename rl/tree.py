"""Trajectory trees: the LLM calls of a group in one token trie, flattened in pre-order.

A node is (parent, token): identical token sequences share nodes whatever their origin, because
logits depend only on the context. Each call's full sequence (input_ids + output_ids) is one
path from a root. Whether a token is trained, and with which per-token fields (sampler log-prob,
loss mask, turn, teacher log-prob …), belongs to a (trajectory, sampled token) pair and is kept
in the trajectory's `Seq`, never in the node.

Flattened arrays (docs/design.md §3), n = number of nodes:
  tokens [n]     token id of each node, depth-first pre-order
  positions [n]  depth (the position the token has in every path through it)
  end [n]        exclusive end of the node's subtree: query i sees key j iff j <= i < end[j]
  pred [n]       index of the node whose logits predict this token (its parent); -1 for roots
  seqs           one `Seq` per trajectory: the node index of every token it sampled, in order
                 (a token repeated as context by later calls is not repeated), with its fields
  experts [n, moe_layers, k]  (optional) the MoE experts the sampler routed each node through,
                 -1 where no call recorded them (routing replay; a node's first recording wins)

`call_segments` gives the coarser tree of a group's LLM calls (one node per call in its
history), the input of tree credit assignment (`rl.advantages.tree_advantages`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class CallTokens:
  """One LLM call as the engine saw it.

  Attributes:
    input_ids: the context token ids (at least one when the call samples tokens).
    output_ids: the sampled token ids.
    fields: per output token values (e.g. "logprobs", "loss_mask", "teacher_logprobs"), each
      of len(output_ids).
    expert_ids: optional [len(input_ids) + len(output_ids) - 1 - expert_start, moe_layers, k]
      int experts the engine routed positions expert_start, expert_start + 1, ... through
      (routing replay).
    expert_start: the first position `expert_ids` covers (earlier ones: an earlier call's).
  """

  input_ids: Sequence[int]
  output_ids: Sequence[int]
  fields: Mapping[str, Sequence[float]] = dataclasses.field(default_factory=dict)
  expert_ids: Optional[np.ndarray] = None
  expert_start: int = 0


@dataclasses.dataclass(frozen=True)
class TrajectoryTokens:
  """The calls of one episode in order, plus per-trajectory scalars (reward, advantage, …)."""

  calls: Sequence[CallTokens]
  scalars: Mapping[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Seq:
  """A trajectory's sampled tokens inside a tree.

  Attributes:
    index: [m] int32 node index of each sampled token, in sampling order.
    fields: name -> [m] float32, always including "loss_mask" (1 = trained) and "turn" (index
      of the call that sampled the token).
    scalars: the trajectory's scalars.
  """

  index: np.ndarray
  fields: dict[str, np.ndarray]
  scalars: dict[str, float]


@dataclasses.dataclass
class Tree:
  """One group's trie in pre-order (see module docstring)."""

  tokens: np.ndarray
  positions: np.ndarray
  end: np.ndarray
  pred: np.ndarray
  seqs: list[Seq]
  experts: Optional[np.ndarray] = None

  def __len__(self) -> int:
    return len(self.tokens)

  def path(self, node: int) -> list[int]:
    """Token ids from the root to `node` inclusive (the context that predicts its child)."""
    out = []
    while node >= 0:
      out.append(int(self.tokens[node]))
      node = int(self.pred[node])
    return out[::-1]


def _get(record: Any, name: str, default: Any = None) -> Any:
  """A field of a record that is either a mapping or an object with attributes."""
  if isinstance(record, Mapping):
    return record.get(name, default)
  return getattr(record, name, default)


def from_trajectory(trajectory: Any, *, scalars: Optional[Mapping[str, float]] = None,
                    logprobs: bool = True, mask_tool_errors: bool = True) -> TrajectoryTokens:
  """The one adapter from a trajectory record to `TrajectoryTokens`.

  Reads fields structurally (objects or dicts alike; rl never imports envs), so it takes an
  envs Trajectory, its `to_dict()`, or a JSON trajectory record. A call with no output_ids is
  skipped: it samples nothing to train.

  Args:
    trajectory: has `calls` (attribute or key); each call has `input_ids`, `output_ids`,
      `output_logprobs` (read when `logprobs`) and optionally `meta` (None counts as {}).
    scalars: the trajectory's scalars, e.g. {"advantage": a, "reward": r} (cast to float).
    logprobs: emit the sampler's log-probs (`output_logprobs`) as the field "logprobs".
    mask_tool_errors: error-masked training: a call whose meta["tool_error"] is set gets
      loss_mask 0 (it stays in the context of later calls).

  Returns:
    The calls with per output token fields "loss_mask" (0 when meta["train"] is False, or the
    call failed and `mask_tool_errors`; else 1), "failed" (1 when meta["tool_error"]) and, with
    `logprobs`, "logprobs"; and the scalars.
  """
  calls = []
  for i, c in enumerate(_get(trajectory, "calls")):
    output_ids = list(_get(c, "output_ids"))
    if not output_ids:
      continue
    meta = _get(c, "meta") or {}
    failed = bool(meta.get("tool_error", False))
    train = meta.get("train", True) is not False and not (mask_tool_errors and failed)
    n = len(output_ids)
    fields = {"loss_mask": [float(train)] * n, "failed": [float(failed)] * n}
    if logprobs:
      sampled = _get(c, "output_logprobs")
      if sampled is None:
        raise ValueError(f"calls[{i}] has no output_logprobs (pass logprobs=False to adapt a "
                         "record without them)")
      fields["logprobs"] = list(sampled)
    calls.append(CallTokens(list(_get(c, "input_ids")), output_ids, fields,
                            _expert_ids(_get(c, "expert_ids")), int(_get(c, "expert_start", 0))))
  return TrajectoryTokens(calls, {k: float(v) for k, v in (scalars or {}).items()})


def _expert_ids(ids: Any) -> Optional[np.ndarray]:
  """A call's expert ids: an array, or a record's {"shape", "int16"} bytes (envs.trajectory)."""
  if isinstance(ids, Mapping):
    return np.frombuffer(ids["int16"], "<i2").reshape(ids["shape"])
  return None if ids is None else np.asarray(ids)


def build_tree(trajectories: Sequence[TrajectoryTokens]) -> Tree:
  """Insert every call of `trajectories` (typically one group) into a trie and flatten it.

  Args:
    trajectories: the trajectories; trajectory t becomes `seqs[t]`.

  Returns:
    The `Tree` in pre-order. Each Seq has the fields "loss_mask" (1 unless a call gives it),
    "turn" (the call's index) and every field of its calls (0 for calls that lack it). When
    any call has expert_ids, `experts` holds every node's (-1 where no call recorded it).

  Raises:
    ValueError: for a call that samples tokens with empty input_ids, a field whose length
      differs from the call's output_ids, or expert_ids of the wrong shape.
  """
  parent: list[int] = []
  token: list[int] = []
  children: list[dict[int, int]] = []
  roots: dict[int, int] = {}

  def child(node: int, tok: int) -> int:
    table = roots if node < 0 else children[node]
    if tok not in table:
      table[tok] = len(token)
      parent.append(node)
      token.append(tok)
      children.append({})
    return table[tok]

  sampled: list[tuple[list[int], dict[str, np.ndarray]]] = []
  routed: dict[int, np.ndarray] = {}  # node -> its experts, first recording wins
  for t, traj in enumerate(trajectories):
    nodes: list[int] = []
    per_call: list[dict[str, np.ndarray]] = []
    for c, call in enumerate(traj.calls):
      m = len(call.output_ids)
      if len(call.input_ids) == 0 and m:
        raise ValueError(f"trajectory {t} call {c}: input_ids is empty, so its first sampled "
                         "token has no context to be predicted from (a root is never a loss "
                         "token); start every call with at least one prompt token")
      fields = {"loss_mask": np.ones(m, np.float32), "turn": np.full(m, c, np.float32)}
      for name, values in call.fields.items():
        if len(values) != m:
          raise ValueError(f"trajectory {t} call {c}: field {name!r} has {len(values)} values "
                           f"for {m} output tokens")
        fields[name] = np.asarray(values, np.float32)
      per_call.append(fields)
      node = -1
      ids = None if call.expert_ids is None else np.asarray(call.expert_ids)
      start = call.expert_start
      want = len(call.input_ids) + m - 1 - start
      if ids is not None and (ids.ndim != 3 or len(ids) != want):
        raise ValueError(f"trajectory {t} call {c}: expert_ids has shape {ids.shape}, expected "
                         f"[{want} (input + output tokens - 1 - expert_start={start}), "
                         "moe_layers, k]")
      for p, tok in enumerate(list(call.input_ids) + list(call.output_ids)):
        node = child(node, int(tok))
        nodes.append(node)
        if ids is not None and start <= p < start + len(ids):
          routed.setdefault(node, ids[p - start])
      del nodes[len(nodes) - len(call.output_ids) - len(call.input_ids):len(nodes) - m]
    names = sorted({"loss_mask", "turn"} | {name for fields in per_call for name in fields})
    # a field some calls lack is 0 for their tokens
    sampled.append((nodes, {name: np.concatenate(
        [f.get(name, np.zeros(len(f["turn"]), np.float32)) for f in per_call] or
        [np.zeros(0, np.float32)]) for name in names}))

  order, depth, end = _pre_order(parent, children, list(roots.values()))
  n = len(token)
  new = np.empty(n, np.int64)
  new[order] = np.arange(n)  # old node id -> pre-order index
  tokens = np.asarray(token, np.int32)[order]
  pred = np.asarray([new[p] if p >= 0 else -1 for p in np.asarray(parent)[order]], np.int32) \
      if n else np.zeros(0, np.int32)
  seqs = [Seq(index=new[np.asarray(nodes, np.int64)].astype(np.int32), fields=fields,
              scalars={k: float(v) for k, v in traj.scalars.items()})
          for (nodes, fields), traj in zip(sampled, trajectories)]
  experts = None
  if routed:
    shape = next(iter(routed.values())).shape
    if any(x.shape != shape for x in routed.values()):
      raise ValueError(f"expert_ids: calls disagree on [moe_layers, k] (first {shape})")
    experts = np.full((n,) + shape, -1, np.int32)
    for node, x in routed.items():
      experts[new[node]] = x
  return Tree(tokens=tokens, positions=depth, end=end, pred=pred, seqs=seqs, experts=experts)


def _pre_order(parent, children, roots):
  """(order: pre-order index -> node id, depth [n], end [n]) by an explicit-stack DFS (trees
  can be deeper than Python's recursion limit). A popped ("close", i) entry marks the end of
  pre-order index i's subtree."""
  n = len(parent)
  order = np.empty(n, np.int64)
  depth = np.empty(n, np.int32)
  end = np.empty(n, np.int32)
  stack: list[tuple[str, int, int]] = [("open", r, 0) for r in reversed(roots)]
  i = 0
  while stack:
    kind, x, d = stack.pop()
    if kind == "close":
      end[x] = i
      continue
    order[i], depth[i] = x, d
    stack.append(("close", i, d))
    i += 1
    stack.extend(("open", c, d + 1) for c in reversed(list(children[x].values())))
  return order, depth, end


def call_segments(trajectories: Sequence[TrajectoryTokens]) -> tuple[np.ndarray, np.ndarray]:
  """The tree of LLM calls ("segments") of one group, for tree credit assignment.

  A segment node is one call's sampled output in its context. Trajectories share the node of
  their call k iff their calls 0..k are identical (input_ids and output_ids): a branched
  episode repeats its ancestors' calls verbatim, so identical histories mean the same node.
  Calls differing only in a tool result (call k+1's input) share node k and split at k+1.
  Nodes are numbered in order of first appearance (trajectory by trajectory, call by call).

  Args:
    trajectories: the group's trajectories; trajectory s is row s, and call k indexes
      `TrajectoryTokens.calls` exactly as `build_tree` numbers the "turn" field (calls without
      output_ids included).

  Returns:
    (segment, parent): segment [S, K] int32, the node of trajectory s's call k (K = the most
    calls of a trajectory; -1 past a trajectory's last call); parent [N] int32, the node of
    call k-1 for a node of call k, -1 for call 0 (the group's root, the prompt).
  """
  ids: dict[tuple, int] = {}  # (parent node, input_ids, output_ids) -> node
  parent: list[int] = []
  num_calls = max((len(t.calls) for t in trajectories), default=0)
  segment = np.full((len(trajectories), num_calls), -1, np.int32)
  for s, traj in enumerate(trajectories):
    node = -1
    for k, call in enumerate(traj.calls):
      key = (node, tuple(int(x) for x in call.input_ids), tuple(int(x) for x in call.output_ids))
      if key not in ids:
        ids[key] = len(parent)
        parent.append(node)
      node = segment[s, k] = ids[key]
  return segment, np.asarray(parent, np.int32).reshape(-1)
