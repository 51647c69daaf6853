"""benchmarks/rl_step.py's workload: the token counts every side is measured on (no timings)."""

import numpy as np

from benchmarks import rl_step


def test_workload_shapes_and_advantages():
  w = rl_step.workload(0)
  assert w["prompts"].shape == (2, 192) and w["completions"].shape == (16, 64)
  assert w["prompts"].min() >= 1 and w["completions"].min() >= 1  # 0 stays tunix's pad id
  assert w["prompts"].max() < 2048 and w["completions"].max() < 2048
  adv = w["advantages"].reshape(2, 8)
  np.testing.assert_allclose(adv.mean(1), 0.0, atol=1e-6)  # GRPO: zero mean per group
  for i in range(2):  # the first sampled tokens of a prompt differ: the tree has 704 nodes
    assert len(set(w["completions"][i * 8:(i + 1) * 8, 0])) == 8
  np.testing.assert_array_equal(rl_step.workload(0)["completions"], w["completions"])
  assert rl_step.LINEAR_TOKENS == 16 * 256


def test_micro_batches_token_counts():
  from trainer.batches import describe
  w = rl_step.workload(0)
  tree = rl_step.micro_batches(w, "tree", 768)
  linear = rl_step.micro_batches(w, "linear")
  assert tree.tokens.shape == (1, 2, 768) and linear.tokens.shape == (1, 16, 256)
  t, l = describe(tree), describe(linear)
  assert t["tree_tokens"] == 2 * (192 + 8 * 64) == 1408
  assert l["tree_tokens"] == t["logical_tokens"] == l["logical_tokens"] == 4096
  assert t["loss_tokens"] == l["loss_tokens"] == 16 * 64
  assert t["sequences"] == l["sequences"] == 16
  for mb in (tree, linear):  # advantages reach every trajectory in input order
    seq_id = np.asarray(mb.seq_id)
    np.testing.assert_array_equal(mb.scalars["advantage"][seq_id >= 0],
                                  w["advantages"][seq_id[seq_id >= 0]])
  one_row = rl_step.micro_batches(w, "tree", 1408)  # both trees in one row
  assert one_row.tokens.shape == (1, 1, 1408) and describe(one_row)["tree_tokens"] == 1408
  split = rl_step.micro_batches(w, "linear", splits=2)
  assert split.tokens.shape == (2, 8, 256) and describe(split)["loss_tokens"] == 1024
