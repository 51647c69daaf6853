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

  t = from_trajectory(Traj())
  assert t.calls[0].fields["logprobs"] == [-0.5, -0.25] and t.scalars == {"reward": 1.0}
