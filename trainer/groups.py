"""From a step's rollout groups to what the train step takes: filters, advantages, micro-batches.

    metrics = episode_stats(groups)                                   # before filtering
    kept, dropped, counts = select_groups(groups, group_size=8, drop_constant=True)
    parts = micro_batches(kept, advantages_of(kept, "grpo"), shape, minibatches=1)
    metrics.update(batch_stats([mb for _, mb in parts]))

A group is the list of `envs.trajectory.Trajectory` sampled for one task draw. Each group's
LLM calls become one trajectory tree (`rl.tree.from_trajectory`, the one adapter from a
trajectory record to tokens: every sampled token trained, the sampler's log-probs as
"logprobs", also π_old until the trainer rescores it), packed into fixed-shape micro-batches
(`trainer.batches`).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional, Sequence

import numpy as np

from envs.branching import tree_stats
from rl import advantages, filters
from rl.tree import build_tree, call_segments, from_trajectory
from trainer import batches as batches_lib


def episode_stats(groups: list[list]) -> dict:
  """Rollout metrics of a step's groups (before filtering).

  Args:
    groups: the step's groups, each a list of `envs.trajectory.Trajectory`.

  Returns:
    {"episodes", "reward_mean", "reward_std", "pass_rate", "group_pass_rate" (share of groups
    with a passing episode), "response_tokens" (sampled per
    episode), "response_tokens_max", "episode_tokens" (the last call's context), "turns",
    "tool_errors", "tests_run" (share of rewards from tests run in a sandbox),
    "verdicts_shared" (share of rewards taken from an identical submission's test run,
    `envs.verifiers.cache`), "termination/<reason>" (shares)}, and for branching groups `envs.branching.tree_stats`.
  """
  trajs = [t for g in groups for t in g]
  if not trajs:
    return {"episodes": 0}
  rewards = np.array([t.reward for t in trajs], np.float64)
  sampled = np.array([sum(len(c.output_ids) for c in t.calls) for t in trajs], np.float64)
  context = np.array([len(t.calls[-1].input_ids) + len(t.calls[-1].output_ids) if t.calls else 0
                      for t in trajs], np.float64)
  out = {"episodes": len(trajs), "reward_mean": rewards.mean(), "reward_std": rewards.std(),
         "pass_rate": float((rewards >= 1.0).mean()),
         # pass@k of the groups: share of tasks with a passing episode
         "group_pass_rate": float(np.mean([any(t.reward >= 1.0 for t in g) for g in groups if g])),
         "response_tokens": sampled.mean(),
         "response_tokens_max": sampled.max(), "episode_tokens": context.mean(),
         "turns": float(np.mean([len(t.calls) for t in trajs])),
         "tool_errors": float(np.mean([t.metadata.get("tool_errors", 0) for t in trajs])),
         # episodes whose reward came from a test run in a sandbox (verdict with test counts)
         "tests_run": float(np.mean([isinstance(t.metadata.get("verdict"), dict) and
                                     "total" in t.metadata["verdict"] for t in trajs])),
         "verdicts_shared": float(np.mean([isinstance(t.metadata.get("verdict"), dict) and
                                           bool(t.metadata["verdict"].get("shared"))
                                           for t in trajs]))}
  for reason, n in collections.Counter(t.termination for t in trajs).items():
    out[f"termination/{reason}"] = n / len(trajs)
  out.update(tree_stats(groups))
  return out


def select_groups(groups: list[list], *, group_size: int, drop_constant: bool,
                  min_version: Optional[int] = None, consumed: frozenset = frozenset()
                  ) -> tuple[list[list], list[list], dict]:
  """The groups worth training on.

  Args:
    groups: the step's groups.
    group_size: G; a shorter group (an episode failed) is dropped.
    drop_constant: drop groups whose rewards are all equal (no signal).
    min_version: drop groups with a token sampled by an older policy version (None: keep).
    consumed: ids of trajectories already trained; a group holding one is dropped.

  Returns:
    (kept groups, dropped groups, counts {"dropped/<why>_groups": n}).
  """
  kept, out, counts = [], [], collections.Counter()
  for g in groups:
    if len(g) < group_size:
      counts["dropped/partial_groups"] += 1
    elif any(t.trajectory_id in consumed for t in g):
      counts["dropped/consumed_groups"] += 1
    elif min_version is not None and min(t.policy_version for t in g) < min_version:
      counts["dropped/stale_groups"] += 1
    else:
      kept.append(g)
      continue
    out.append(g)
  if drop_constant and kept:
    rewards = np.array([t.reward for g in kept for t in g], np.float64)
    group = np.repeat(np.arange(len(kept)), [len(g) for g in kept])
    _, constant = filters.drop_constant_groups(rewards, group)
    constant = set(constant.tolist())
    counts["dropped/constant_groups"] += len(constant)
    out += [g for i, g in enumerate(kept) if i in constant]
    kept = [g for i, g in enumerate(kept) if i not in constant]
  return kept, out, dict(counts)


def advantages_of(groups: list[list], name: str) -> list[np.ndarray]:
  """Per group, the advantages of its trajectories.

  Args:
    groups: the groups, each a list of trajectories with a reward.
    name: a key of `rl.advantages.ADVANTAGES` (`rl.advantages.compute(name, ...)`: one value
      per trajectory), "treerl" (`rl.advantages.tree_advantages` on the group's tree of
      calls, `rl.tree.call_segments`: one value per call that sampled tokens), or a key of
      `rl.advantages.CRITIC_ADVANTAGES` (zeros: the per-token "advantage" field the critic adds
      to the micro-batches, `trainer.critic.Critic.gae_fields`, is what the loss reads).

  Returns:
    Per group, [len(group)] f32 advantages, or for "treerl" [len(group), most calls] (0 past a
    trajectory's calls).
  """
  if name in advantages.CRITIC_ADVANTAGES:
    return [np.zeros(len(g), np.float32) for g in groups]
  if name == "treerl":
    out = []
    for g in groups:
      segment, parent = call_segments([from_trajectory(t, logprobs=False) for t in g])
      rewards = np.array([t.reward for t in g], np.float32)
      out.append(np.where(segment >= 0, np.asarray(advantages.tree_advantages(
          rewards, segment, parent)), 0.0).astype(np.float32))
    return out
  rewards = np.array([t.reward for g in groups for t in g], np.float32)
  group = np.repeat(np.arange(len(groups)), [len(g) for g in groups]).astype(np.int32)
  adv = np.asarray(advantages.compute(name, rewards, group))
  return np.split(adv, np.cumsum([len(g) for g in groups])[:-1])


def segment_stats(groups: list[list], group_advantages: Sequence[np.ndarray]) -> dict:
  """The spread of per-call advantages ("treerl"): how differently a tree credits its segments.

  Args:
    groups: the groups.
    group_advantages: their `advantages_of(groups, "treerl")`.

  Returns:
    {} for per-trajectory advantages; else "tree/segment_advantage_std" (the std of the
    distinct segments' advantages within a group, averaged over groups) and
    "tree/segments_per_task".
  """
  stds, counts = [], []
  for g, adv in zip(groups, group_advantages):
    if adv.ndim != 2:
      return {}
    segment, _ = call_segments([from_trajectory(t, logprobs=False) for t in g])
    values = {int(n): float(a) for n, a in zip(segment.ravel(), adv.ravel()) if n >= 0}
    stds.append(np.std(list(values.values())) if values else 0.0)
    counts.append(len(values))
  if not stds:
    return {}
  return {"tree/segment_advantage_std": float(np.mean(stds)),
          "tree/segments_per_task": float(np.mean(counts))}


def split_minibatches(items: list, n: int) -> list[list]:
  """Splits `items` into n contiguous, nearly equal parts.

  Args:
    items: the items, in order.
    n: the number of parts; fewer when there are fewer items, at least one.

  Returns:
    The parts.
  """
  n = max(1, min(n, len(items)))
  bounds = np.linspace(0, len(items), n + 1).round().astype(int)
  return [items[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def step_bounds(rl_cfg) -> dict:
  """The BatchShape `seqs`, `seq_len` and `micro_batches` of an RL step (`rl.fixed_batch_shape`).

  With fixed shapes, the bounds of any update's data: ceil(prompts_per_step / minibatches)
  groups, so at most that many micro-batches (a group lands whole in one) of at most that
  many x group_size trajectories, each sampling at most max_turns x max_new_tokens tokens.
  Padding micro-batches are skipped at run time (trainer.step), so the bounds cost memory for
  the inputs, not compute. Episodes outside these limits (e.g. remote workers with other
  flags) fail the step with the BatchShape error naming the field.

  Args:
    rl_cfg: `config.rl`.

  Returns:
    {"seqs", "seq_len", "micro_batches"}: ints, or all None (sized from each step's data,
    rounded up to powers of two) when `rl.fixed_batch_shape` is False.
  """
  if not rl_cfg.get("fixed_batch_shape", False):
    return {"seqs": None, "seq_len": None, "micro_batches": None}
  groups = -(-rl_cfg.prompts_per_step // rl_cfg.minibatches)
  return {"seqs": groups * rl_cfg.group_size, "seq_len": rl_cfg.max_turns * rl_cfg.max_new_tokens,
          "micro_batches": groups}


def micro_batches(groups: list[list], group_advantages: Sequence[np.ndarray],
                  shape: batches_lib.BatchShape, minibatches: int, replay: bool = False
                  ) -> list[tuple[list[list], batches_lib.MicroBatches]]:
  """The groups as `minibatches` optimizer updates' worth of packed micro-batches.

  Args:
    groups: the kept groups.
    group_advantages: per group, its trajectories' advantages (`advantages_of`): one per
      trajectory, or one per call ("treerl"), given to every token the call sampled.
    shape: the fixed BatchShape (row length, rows per micro-batch).
    minibatches: optimizer updates per pass (`rl.minibatches`).
    replay: routing replay: the calls' recorded experts (`LLMCall.expert_ids`) go into
      `MicroBatches.expert_ids`; positions without a recording route themselves.

  Returns:
    [(the groups of the update, their MicroBatches)]; fields "logprobs" (the sampler's) and
    "old_logprobs" (π_old: the sampler's until rescored), scalars "advantage" and "reward".
  """
  out = []
  for part in split_minibatches(list(zip(groups, group_advantages)), minibatches):
    trees = [[_with_advantage(t, a) for t, a in zip(g, adv)] for g, adv in part]
    experts = None
    if replay:
      built = [build_tree(g) for g in trees]
      recorded = [t.experts for t in built if t.experts is not None]
      if recorded:
        experts = [t.experts if t.experts is not None else
                   np.full((len(t),) + recorded[0].shape[1:], -1, np.int32) for t in built]
      trees = built
    mb = batches_lib.make_micro_batches(trees, shape, expert_ids=experts)
    out.append(([g for g, _ in part], mb.with_fields(old_logprobs=mb.fields["logprobs"])))
  return out


def _with_advantage(trajectory, adv: np.ndarray):
  """A trajectory's tokens with its advantage: the scalar, or per call a per-token field."""
  if np.ndim(adv) == 0:
    return from_trajectory(trajectory, scalars={"advantage": float(adv),
                                                "reward": float(trajectory.reward)},
                           mask_tool_errors=False)
  tokens = from_trajectory(trajectory, scalars={"reward": float(trajectory.reward)},
                           mask_tool_errors=False)
  calls = [dataclasses.replace(c, fields={**c.fields, "advantage": [float(a)] * len(c.output_ids)})
           for c, a in zip(tokens.calls, adv)]
  return dataclasses.replace(tokens, calls=calls)


def batch_stats(mbs: list[batches_lib.MicroBatches]) -> dict:
  """Packing counts summed over a step's micro-batches.

  Args:
    mbs: the step's MicroBatches.

  Returns:
    The sums of `batches.describe`'s counts (tree and logical (unpacked) tokens, ...) and
    their ratio "tree_token_ratio" (logical / tree tokens).
  """
  total = collections.Counter()
  for mb in mbs:
    total.update(batches_lib.describe(mb))
  out = dict(total)
  out["tree_token_ratio"] = out["logical_tokens"] / max(out["tree_tokens"], 1)
  return out


def mean_metrics(items: list[dict]) -> dict:
  """Train-step metrics averaged over a step's updates.

  Args:
    items: one metrics dict per update; the first one's keys are averaged.

  Returns:
    name -> mean over the updates holding it (keys containing "max": the max).
  """
  out = {}
  for k in items[0]:
    vals = [float(np.asarray(m[k])) for m in items if k in m]
    out[k] = max(vals) if "max" in k else float(np.mean(vals))
  return out
