"""rl.tree: trie construction and pre-order flattening against brute-force definitions."""

import numpy as np
import pytest

from rl.tree import CallTokens, TrajectoryTokens, build_tree, from_trajectory
from tests.tree_cases import allowed


def random_group(rng, n_traj=5):
  prompt = rng.integers(0, 6, 12).tolist()  # tiny vocabulary: many accidental shared nodes
  group = []
  for _ in range(n_traj):
    context, calls = prompt[:rng.integers(1, 13)], []
    for _ in range(rng.integers(1, 4)):
      out = rng.integers(0, 6, rng.integers(1, 8)).tolist()
      calls.append(CallTokens(context, out, {"logprobs": rng.normal(size=len(out)).tolist()}))
      if rng.random() < 0.7:  # next turn extends the context; else compaction restarts it
        context = context + out + rng.integers(0, 6, 3).tolist()
      else:
        context = prompt[:4] + rng.integers(0, 6, 2).tolist()
    group.append(TrajectoryTokens(calls, {"reward": float(rng.random())}))
  return group


@pytest.mark.parametrize("seed", range(20))
def test_tree_matches_brute_force(seed):
  rng = np.random.default_rng(seed)
  group = random_group(rng)
  tree = build_tree(group)
  n = len(tree)
  # every distinct prefix of every call's full sequence is exactly one node
  prefixes = {tuple(seq[:k + 1]) for t in group for c in t.calls
              for seq in [list(c.input_ids) + list(c.output_ids)] for k in range(len(seq))}
  assert n == len(prefixes)
  assert {tuple(tree.path(i)) for i in range(n)} == prefixes
  # pre-order arrays: ancestors by the end rule = root path; positions = depth; pred = parent
  mask = allowed(tree.end)
  for i in range(n):
    ancestors = np.flatnonzero(mask[i])
    assert len(ancestors) == tree.positions[i] + 1
    assert ancestors[-1] == i
    assert tree.pred[i] == (ancestors[-2] if len(ancestors) > 1 else -1)
    assert (tree.tokens[ancestors] == tree.path(i)).all()
  # sequences: each sampled token, in order, with its context and fields
  for traj, seq in zip(group, tree.seqs):
    k = 0
    for c, call in enumerate(traj.calls):
      for j, tok in enumerate(call.output_ids):
        node = seq.index[k]
        assert tree.path(node) == list(call.input_ids) + list(call.output_ids[:j + 1])
        assert seq.fields["turn"][k] == c and seq.fields["loss_mask"][k] == 1
        np.testing.assert_allclose(seq.fields["logprobs"][k], call.fields["logprobs"][j],
                                   rtol=1e-6)
        k += 1
    assert k == len(seq.index)
    assert seq.scalars == dict(traj.scalars)


def test_fields_and_errors():
  tree = build_tree([TrajectoryTokens([CallTokens([1, 2], [3], {"loss_mask": [0.0]}),
                                       CallTokens([1, 2, 3, 4], [5])])])
  np.testing.assert_array_equal(tree.seqs[0].fields["loss_mask"], [0.0, 1.0])
  with pytest.raises(ValueError, match="input_ids is empty"):
    build_tree([TrajectoryTokens([CallTokens([], [1, 2])])])
  with pytest.raises(ValueError, match="field 'logprobs' has 1 values for 2 output tokens"):
    build_tree([TrajectoryTokens([CallTokens([1], [1, 2], {"logprobs": [0.0]})])])


def test_from_trajectory_duck_typing():
  class Call:
    def __init__(self, i, o, lp):
      self.input_ids, self.output_ids, self.output_logprobs = i, o, lp

  class Traj:
    calls = [Call([1, 2], [3, 4], [-0.5, -0.25])]
    reward = 1.0

  t = from_trajectory(Traj(), scalars={"reward": Traj.reward})
  assert t.calls[0].fields["logprobs"] == [-0.5, -0.25] and t.scalars == {"reward": 1.0}


class _Call:
  def __init__(self, input_ids, output_ids, output_logprobs, meta):
    self.input_ids, self.output_ids = input_ids, output_ids
    self.output_logprobs, self.meta = output_logprobs, meta


def _calls(as_dicts):
  """A trained call, a failed one, a call with no output, a call marked not to train."""
  specs = [([1, 2], [3, 4], [-0.5, -0.25], {"tool_error": False}),
           ([1, 2, 3, 4, 9], [5], [-1.0], {"tool_error": True}),
           ([1, 2, 3, 4, 9, 5, 9], [], [], {}),
           ([7], [8, 9], [-0.1, -0.2], None),
           ([7, 8, 9, 6], [6], [-0.3], {"train": False})]
  return [dict(input_ids=i, output_ids=o, output_logprobs=lp, meta=m) if as_dicts
          else _Call(i, o, lp, m) for i, o, lp, m in specs]


@pytest.mark.parametrize("as_dicts", [False, True])
def test_from_trajectory_fields(as_dicts):
  record = {"calls": _calls(True)} if as_dicts else type("Traj", (), {"calls": _calls(False)})
  t = from_trajectory(record, scalars={"advantage": 0.5, "reward": 1})
  assert [list(c.input_ids) for c in t.calls] == [[1, 2], [1, 2, 3, 4, 9], [7], [7, 8, 9, 6]]
  assert [list(c.output_ids) for c in t.calls] == [[3, 4], [5], [8, 9], [6]]  # empty skipped
  assert [c.fields for c in t.calls] == [
      {"loss_mask": [1.0, 1.0], "failed": [0.0, 0.0], "logprobs": [-0.5, -0.25]},
      {"loss_mask": [0.0], "failed": [1.0], "logprobs": [-1.0]},
      {"loss_mask": [1.0, 1.0], "failed": [0.0, 0.0], "logprobs": [-0.1, -0.2]},
      {"loss_mask": [0.0], "failed": [0.0], "logprobs": [-0.3]}]
  assert t.scalars == {"advantage": 0.5, "reward": 1.0}
  assert all(isinstance(v, float) for v in t.scalars.values())
  # RL: failed calls are trained (their advantage says how good the turn was)
  rl_tokens = from_trajectory(record, scalars={"advantage": -1.0}, mask_tool_errors=False)
  assert [c.fields["loss_mask"] for c in rl_tokens.calls] == [[1.0, 1.0], [1.0], [1.0, 1.0],
                                                              [0.0]]
  assert [c.fields["failed"] for c in rl_tokens.calls] == [[0.0, 0.0], [1.0], [0.0, 0.0], [0.0]]
  # SFT: no sampler log-probs needed
  sft_tokens = from_trajectory(record, logprobs=False)
  assert all(set(c.fields) == {"loss_mask", "failed"} for c in sft_tokens.calls)
  assert sft_tokens.scalars == {}


def test_from_trajectory_needs_logprobs_unless_told_not_to():
  record = {"calls": [{"input_ids": [1], "output_ids": [2]}]}
  with pytest.raises(ValueError, match="no output_logprobs"):
    from_trajectory(record)
  assert from_trajectory(record, logprobs=False).calls[0].fields == {"loss_mask": [1.0],
                                                                     "failed": [0.0]}
