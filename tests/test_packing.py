"""rl.packing: packed rows reproduce every tree node and every sampled token's exact context."""

import random
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rl.packing import pack, pack_sequences
from rl.tree import CallTokens, TrajectoryTokens, build_tree


def random_group(rnd: random.Random) -> list[TrajectoryTokens]:
  """A group with shared prompts, multi-turn calls, compaction/sub-agent branches, identical
  sampled spans, calls that are prefixes of others and branch points inside sampled spans."""
  vocab = rnd.choice([3, 50])  # tiny vocabulary: many accidental shared nodes
  fast = random.Random(rnd.getrandbits(32))  # token values (rnd: structure, cheap to shrink)
  tok = lambda n: [fast.randint(1, vocab) for _ in range(n)]
  prompt = tok(rnd.randint(1, 40))
  earlier, group = [], []  # earlier: (input, output) of every call so far
  for _ in range(rnd.randint(1, 6)):
    context, calls = prompt[:rnd.randint(1, len(prompt))] if rnd.random() < 0.3 else prompt, []
    for _ in range(rnd.randint(1, 4)):
      kind = rnd.random()
      if earlier and kind < 0.2:  # same input as an earlier call, output a prefix of it (+ more)
        inp, out = rnd.choice(earlier)
        out = out[:rnd.randint(0, len(out))] + (tok(rnd.randint(1, 5)) if rnd.random() < .5 else [])
      elif earlier and kind < 0.4:  # input a strict prefix of an earlier call's full sequence
        full = sum(rnd.choice(earlier), [])
        inp, out = full[:rnd.randint(1, max(1, len(full) - 1))], tok(rnd.randint(1, 20))
      else:
        inp, out = context, tok(rnd.randint(0, 20) if rnd.random() < 0.9 else rnd.randint(20, 90))
      fields = {"logprobs": [fast.uniform(-5, 0) for _ in out]}
      if rnd.random() < 0.3:
        fields["loss_mask"] = [float(fast.random() < 0.5) for _ in out]
      calls.append(CallTokens(list(inp), list(out), fields))
      earlier.append((list(inp), list(out)))
      r = rnd.random()
      if r < 0.6:  # next turn extends the full sequence with an observation
        context = inp + out + tok(rnd.randint(0, 8))
      elif r < 0.8:  # compaction / sub-agent: a truncated, altered context
        context = context[:rnd.randint(1, len(context))] + tok(rnd.randint(0, 8))
      else:  # restart from a summary
        context = prompt + tok(rnd.randint(1, 8))
    group.append(TrajectoryTokens(calls, {"reward": rnd.random()}))
  return group


def check(groups, trees, batches, row_len, rows_per_batch):
  """Every tree node is an owner exactly once; in every row the end-rule root path of each real
  column has positions + 1 elements, ends in its pred chain, and is the node's true root path;
  padding is end = j + 1, pred = -1, zeros, at the row's tail and never in a sequence; each
  trajectory's sequence reconstructs every call (input + output[:k + 1] for its k-th sampled
  token) with its fields and scalars; all of a group lands in one TreeBatch."""
  owners, seq_batch = {}, {}
  for b, batch in enumerate(batches):
    rows = batch.tokens.shape[0]
    assert batch.tokens.shape == (rows_per_batch or batch.num_real_rows, row_len)
    for r in range(rows):
      real = batch.node[r] >= 0
      pad = np.flatnonzero(~real)
      # padding: end = j + 1, pred = -1, zeros; real columns form a prefix of the row
      assert (batch.end[r, pad] == pad + 1).all() and (batch.pred[r, pad] == -1).all()
      assert (batch.tokens[r, pad] == 0).all() and (batch.positions[r, pad] == 0).all()
      assert not batch.owner[r, pad].any() and (batch.group[r, pad] == -1).all()
      assert (np.diff(real.astype(int)) <= 0).all()
      assert (r < batch.num_real_rows) == real.any()
      i, j = np.arange(row_len)[:, None], np.arange(row_len)[None, :]
      mask = (j <= i) & (i < batch.end[r][None, :])  # mask[i, j]: j on the root path of i
      c = np.flatnonzero(real)
      # the end-rule path of c has positions[c] + 1 elements, ends at c, and pred[c] is the one
      # before it; pred's path is c's path minus c, so the pred chain is the end-rule path
      assert (mask[c].sum(1) == batch.positions[r, c] + 1).all() and mask[c, c].all()
      p = batch.pred[r, c]
      np.testing.assert_array_equal(p, np.where(mask[c] & (j < c[:, None]), j, -1).max(1))
      np.testing.assert_array_equal(mask[p[p >= 0]], mask[c[p >= 0]] & (j != c[p >= 0, None]))
      # the path is the tree's root path of the node: same group, parent = tree parent, roots
      # are tree roots (with the checks above, by induction: the true, full context)
      g, n = batch.group[r, c], batch.node[r, c]
      for gi in set(g.tolist()):
        tree, mine = trees[gi], g == gi
        assert (batch.group[r, p[mine & (p >= 0)]] == gi).all()
        np.testing.assert_array_equal(batch.tokens[r, c[mine]], tree.tokens[n[mine]])
        np.testing.assert_array_equal(batch.positions[r, c[mine]], tree.positions[n[mine]])
        parent = np.where(p[mine] >= 0, batch.node[r, np.maximum(p[mine], 0)], -1)
        np.testing.assert_array_equal(parent, tree.pred[n[mine]])
      for col in c[batch.owner[r, c]]:
        key = (int(batch.group[r, col]), int(batch.node[r, col]))
        assert key not in owners
        owners[key] = (b, r * row_len + col)
    # sequences
    tok, pred = batch.tokens.reshape(-1), batch.pred.reshape(-1)
    for k in range(len(batch.seq_trajectory)):
      g, t = int(batch.scalars["group"][k]), int(batch.seq_trajectory[k])
      assert (g, t) not in seq_batch
      seq_batch[g, t] = b
      traj, m = groups[g][t], 0
      for c, call in enumerate(traj.calls):
        for j_out, token in enumerate(call.output_ids):
          idx = batch.seq_index[k, m]
          row, col = divmod(int(idx), row_len)
          assert batch.seq_valid[k, m] and batch.owner[row, col] and batch.group[row, col] == g
          assert batch.node[row, col] == trees[g].seqs[t].index[m]
          assert batch.seq_pred[k, m] == row * row_len + pred[idx] and pred[idx] >= 0
          assert batch.seq_tokens[k, m] == token == tok[idx]
          path = np.flatnonzero((np.arange(row_len) <= col) & (col < batch.end[row]))
          assert list(batch.tokens[row, path]) == list(call.input_ids) + list(
              call.output_ids[:j_out + 1])
          assert batch.fields["turn"][k, m] == c
          assert batch.fields["loss_mask"][k, m] == call.fields.get("loss_mask", [1.0] * (
              j_out + 1))[j_out]
          for name, values in call.fields.items():  # e.g. logprobs equal the input values
            assert batch.fields[name][k, m] == np.float32(values[j_out])
          m += 1
      assert not batch.seq_valid[k, m:].any()
      for a in [batch.seq_index, batch.seq_pred, batch.seq_tokens, *batch.fields.values()]:
        assert (a[k, m:] == 0).all()
      for name, value in traj.scalars.items():
        assert batch.scalars[name][k] == np.float32(value)
  # every node exactly once as an owner; every trajectory once; a group in one micro-batch
  assert set(owners) == {(g, n) for g, tree in enumerate(trees) for n in range(len(tree))}
  assert set(seq_batch) == {(g, t) for g, group in enumerate(groups) for t in range(len(group))}
  for (g, n), (b, _) in owners.items():
    assert seq_batch[g, 0] == b


def longest_call(groups):
  return max(len(c.input_ids) + len(c.output_ids) for grp in groups for t in grp for c in t.calls)


def run_case(rnd: random.Random):
  """Pack random groups and check them: the number of carried copies (None: an error case)."""
  row_len = rnd.choice([128, 256])
  rows_per_batch = rnd.choice([None, 1, 2, 4, 8])
  groups = [random_group(rnd) for _ in range(rnd.randint(1, 4))]
  trees = [build_tree(group) for group in groups]
  if longest_call(groups) > row_len:  # an oversize call is named with its length
    with pytest.raises(ValueError, match=rf" (\d+) .*exceeds row_len {row_len}") as e:
      pack(trees, row_len, rows_per_batch)
    named = re.match(r"group (\d+) trajectory (\d+) call (\d+): the call's length (\d+) ",
                     str(e.value))
    if named:
      g, t, c, n = map(int, named.groups())
      call = groups[g][t].calls[c]
      assert n == len(call.input_ids) + len(call.output_ids) > row_len
    else:  # only a call without sampled tokens is too long: its context path is named
      g, n = map(int, re.match(r"group (\d+): a context path of (\d+) tokens", str(e.value)
                               ).groups())
      calls = [c for t in groups[g] for c in t.calls]
      assert n == max(len(c.input_ids) + len(c.output_ids) for c in calls) > row_len
      assert all(len(c.input_ids) + len(c.output_ids) <= row_len for c in calls if c.output_ids)
    return None
  try:
    batches = pack(trees, row_len, rows_per_batch)
  except ValueError as e:  # a group needing more rows than a micro-batch has
    g, need = map(int, re.fullmatch(r"group (\d+) needs (\d+) rows .*", str(e)).groups())
    assert need > rows_per_batch
    assert pack([trees[g]], row_len)[0].num_real_rows == need
    return None
  check(groups, trees, batches, row_len, rows_per_batch)
  return sum(int(((b.node >= 0) & ~b.owner).sum()) for b in batches)  # carried copies


@settings(max_examples=50, deadline=None)
@given(st.randoms(use_true_random=False))
def test_pack_random_groups(rnd):
  run_case(rnd)


def test_some_trees_are_partitioned():
  outcomes = [run_case(random.Random(seed)) for seed in range(30)]
  assert sum(bool(o) for o in outcomes) >= 5, outcomes  # partitioned trees stay exact
  assert sum(o is None for o in outcomes) >= 1, outcomes  # and error cases are exercised


def test_oversize_call_error():
  group = [TrajectoryTokens([CallTokens([1] * 100, [2] * 20),
                             CallTokens([1] * 100 + [2] * 20 + [3] * 5, [4] * 10)])]
  tree = build_tree(group)
  with pytest.raises(ValueError, match=r"group 0 trajectory 0 call 1: the call's length 135 "
                                       r"\(input \+ output tokens\) exceeds row_len 128"):
    pack([tree], 128)
  assert pack([tree], 256)[0].num_real_rows == 1
  with pytest.raises(ValueError, match="group 1: a context path of 300 tokens exceeds row_len 256"):
    pack([tree, build_tree([TrajectoryTokens([CallTokens([1] * 300, [])])])], 256)


def test_partition_cuts_at_subtree_boundaries():
  prompt = list(range(1000, 1064))
  group = [TrajectoryTokens([CallTokens(prompt, list(range(100 * i, 100 * i + 90)))])
           for i in range(6)]  # 64 + 6 x 90 nodes; a row holds the prompt and two responses
  trees = [build_tree(group)]
  (batch,) = pack(trees, 256)
  assert batch.num_real_rows == 3 and ((batch.node >= 0) & ~batch.owner).sum() == 2 * 64
  check([group], trees, [batch], 256, None)


def test_argument_errors():
  tree = build_tree([TrajectoryTokens([CallTokens([1, 2], [3, 4])])])
  with pytest.raises(ValueError, match="row_len=100 must be a positive multiple of 128"):
    pack([tree], 100)
  with pytest.raises(ValueError, match=r"seq_len=1 is smaller than the longest sequence \(2"):
    pack([tree], 128, seq_len=1)
  assert pack([tree], 128, seq_len=16)[0].seq_index.shape == (1, 16)
  big = build_tree([TrajectoryTokens([CallTokens([5] * 10, list(range(i * 100, i * 100 + 100)))])
                    for i in range(3)])  # 310 nodes: 3 rows of 128
  with pytest.raises(ValueError, match=r"group 1 needs 3 rows of row_len 128 but rows_per_batch=2"):
    pack([tree, big], 128, rows_per_batch=2)


def test_micro_batches_keep_groups_together():
  groups = [[TrajectoryTokens([CallTokens([g] * 10, list(range(100 * i, 100 * i + n)))])
             for i, n in enumerate((30, 50, 40))] for g in range(6)]  # groups of 10 + 120 nodes
  trees = [build_tree(grp) for grp in groups]
  batches = pack(trees, 128, rows_per_batch=2)
  assert all(b.tokens.shape == (2, 128) for b in batches) and len(batches) == 6
  for b in batches:  # each group's 130 nodes need 2 rows (one carried copy path)
    assert len(set(b.scalars["group"].tolist())) == 1 and b.num_real_rows == 2
  check(groups, trees, batches, 128, 2)
  one = pack(trees[:2], 256, rows_per_batch=1)  # two groups of 130 cannot share a 256 row
  assert len(one) == 2 and all(b.num_real_rows == 1 for b in one)


def test_sft_sequences_pack_like_sequence_packing():
  lengths = [100, 60, 50, 30, 20]
  seqs = [([7] * 4, list(range(1, n - 3))) for n in lengths]  # full lengths as listed
  (batch,) = pack_sequences(seqs, 128)
  # first-fit decreasing: 100 | 60 50 | 30, then 20 joins the first row
  layout = [[(0, 100), (4, 20)], [(1, 60), (2, 50)], [(3, 30)]]
  assert batch.num_real_rows == 3 and batch.tokens.shape == (3, 128)
  for r, row in enumerate(layout):
    end, pred = np.arange(1, 129), np.full(128, -1)
    positions, tokens, col = np.zeros(128), np.zeros(128), 0
    for s, n in row:
      end[col:col + n] = col + n  # each sequence's own end
      pred[col + 1:col + n] = np.arange(col, col + n - 1)
      positions[col:col + n] = np.arange(n)
      tokens[col:col + n] = seqs[s][0] + seqs[s][1]
      col += n
    np.testing.assert_array_equal(batch.end[r], end)
    np.testing.assert_array_equal(batch.pred[r], pred)
    np.testing.assert_array_equal(batch.positions[r], positions)
    np.testing.assert_array_equal(batch.tokens[r], tokens)
    assert batch.owner[r, :col].all()
  # sequence 4 (response of 16 tokens) sits in row 0 after sequence 0, its prompt first
  k = list(batch.scalars["group"]).index(4)
  assert batch.seq_valid[k].sum() == 16 and batch.seq_index.shape[1] == 96  # 96 = roundup8(96)
  np.testing.assert_array_equal(batch.seq_index[k, :16], 100 + 4 + np.arange(16))
  np.testing.assert_array_equal(batch.seq_pred[k, :16], 100 + 3 + np.arange(16))
