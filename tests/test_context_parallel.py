"""Context parallelism: rows sharded over the `sequence` mesh axis give the single-device
results (tree attention kernel, forward log-probs, gradients, QK-Clip max logits).

The checks run in one subprocess with 8 simulated CPU devices (`python -m
tests.test_context_parallel`); the test asserts each printed its "ok" line.
"""

import os
import random
import sys

if __name__ == "__main__":  # before JAX initialises its backend
  # run_check passes the suite's light CPU backend flags: compiling dominates the run time
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from models import sharding, transformer  # noqa: E402
from models.kernels import attention as attention_lib  # noqa: E402
from models.kernels import context_parallel  # noqa: E402
from models.logprobs import sequence_logprobs  # noqa: E402
from rl.packing import pack, pack_sequences, shard_pairs  # noqa: E402
from rl.tree import CallTokens, TrajectoryTokens, build_tree  # noqa: E402
from tests import tree_cases  # noqa: E402
from tests.conftest import TINY_DENSE, TINY_MOE_MLA, run_check  # noqa: E402

ROW = 128
ROWS = 4
# (sequence, fsdp) meshes of the 8 devices
MESHES = ((2, 4), (4, 2), (8, 1))
CHECKS = ["kernel ring 8", "kernel all_gather 2", "counts", "model dense ring 2",
          "model moe_mla auto 4"]


def test_mesh_rejects_row_not_divisible_by_sequence():
  q = jnp.zeros((1, 12, 2, 4))
  with pytest.raises(ValueError, match="needs a mesh"):
    context_parallel.tree_attention(q, q, q, jnp.ones((1, 12), jnp.int32), scale=1.0,
                                    axis="sequence")


def test_expected_block_counts_of_a_causal_row():
  # one causal row of 16 in 4 shards of 4, blocks of 2: shard r sees blocks 0 .. 2r + 1
  counts = context_parallel.expected_block_counts(np.full((1, 16), 16), 4, block=2)
  np.testing.assert_array_equal(counts, [[2, 4, 6, 8]])
  # padding only (end = j + 1): each shard sees its own blocks
  counts = context_parallel.expected_block_counts(np.arange(1, 17)[None], 4, block=2)
  np.testing.assert_array_equal(counts, [[2, 2, 2, 2]])


def test_shard_pairs_against_the_mask():
  rng = np.random.default_rng(0)
  end = _tree_ends(rng, 2, ROW)
  i, j = np.arange(ROW)[:, None], np.arange(ROW)[None, :]
  for r in range(2):
    pairs = ((j <= i) & (i < end[r][None, :])).sum(1)  # [query] visible keys
    np.testing.assert_array_equal(shard_pairs(end[r:r + 1], 4)[0], pairs.reshape(4, -1).sum(1))


def test_pack_balances_visible_pairs_over_shards():
  """A deep group and shallow ones in a row: ordering the parts evens out the pairs per
  shard, and every context stays exact (the packing checks of tests/test_packing.py)."""
  from tests.test_packing import check, random_group  # noqa: PLC0415 (hypothesis-based module)
  rng = np.random.default_rng(0)
  toks = lambda n: rng.integers(1, 100, n).tolist()
  deep = [[TrajectoryTokens([CallTokens(toks(30), toks(60))])]]
  shallow = [[TrajectoryTokens([CallTokens(toks(4), toks(6))])] for _ in range(3)]
  groups = deep + shallow
  trees = [build_tree(g) for g in groups]
  plain, balanced = pack(trees, ROW), pack(trees, ROW, shards=4)
  check(groups, trees, balanced, ROW, None)
  before, after = shard_pairs(plain[0].end, 4), shard_pairs(balanced[0].end, 4)
  assert before.sum() == after.sum()  # the same work, spread differently
  assert after.max() < before.max(), (before, after)  # [528 1552 2036 152] -> [.. 1892]
  # random groups and SFT rows of many sequences: valid, and never worse than packing order
  rnd, ran = random.Random(0), 0
  for _ in range(4):
    groups = [random_group(rnd) for _ in range(3)]
    trees = [build_tree(g) for g in groups]
    if max(len(c.input_ids) + len(c.output_ids) for g in groups for t in g for c in t.calls) > 256:
      continue
    plain, balanced = pack(trees, 256, 2), pack(trees, 256, 2, shards=8)
    check(groups, trees, balanced, 256, 2)
    ran += 1
    for a, b in zip(plain, balanced):
      assert shard_pairs(b.end, 8).max(1).tolist() <= shard_pairs(a.end, 8).max(1).tolist()
  seqs = [(toks(int(rng.integers(2, 9))), toks(int(rng.integers(1, 20)))) for _ in range(12)]
  plain, balanced = pack_sequences(seqs, ROW), pack_sequences(seqs, ROW, shards=2)
  assert (shard_pairs(balanced[0].end, 2).max(1) <= shard_pairs(plain[0].end, 2).max(1)).all()
  assert ran >= 2, ran
  with pytest.raises(ValueError, match="shards=3 must be a positive divisor of row_len=128"):
    pack(trees, ROW, shards=3)


def test_context_parallel_matches_single_device():
  stdout = run_check("test_context_parallel")
  for name in CHECKS:
    assert f"ok {name}:" in stdout, stdout


def _mesh(seq):
  return sharding.make_mesh(sharding.MeshConfig(fsdp=dict(MESHES)[seq], sequence=seq))


def _tree_ends(rng, rows, length):
  """[rows, length] `end` rows of packed random trees, each longer than a shard's chunk."""
  out = []
  for _ in range(rows):
    a, _ = tree_cases.random_tree_end(rng, 40)
    b, _ = tree_cases.random_tree_end(rng, 70)
    out.append(tree_cases.packed_row([a, b], length))
  return np.stack(out)


def check_kernel(method, seq):
  """Forward, max logits and gradients equal the "xla" reference on random tree rows."""
  rng = np.random.default_rng(seq)
  b, h, kvh, d, dv = 2, 4, 2, 8, 6
  q, k, v = (jnp.asarray(rng.normal(size=(b, ROW, n, e)), jnp.float32)
             for n, e in ((h, d), (kvh, d), (kvh, dv)))
  end = jnp.asarray(_tree_ends(rng, b, ROW))
  w = jnp.asarray(rng.normal(size=(b, ROW, h, dv)), jnp.float32)

  def loss(attend):
    def f(q, k, v):
      out, max_logits = attend(q, k, v)
      return jnp.sum(out * w), (out, max_logits)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))

  (_, (ref, ref_max)), ref_grad = loss(
      lambda q, k, v: attention_lib.attention(q, k, v, end, scale=0.3))(q, k, v)
  with jax.set_mesh(_mesh(seq)):
    (_, (out, max_logits)), grad = loss(lambda q, k, v: context_parallel.tree_attention(
        q, k, v, end, scale=0.3, axis="sequence", batch="fsdp", block=4, method=method))(q, k, v)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(max_logits, ref_max, rtol=1e-6)
  for name, a, r in zip("qkv", grad, ref_grad):
    err, norm = float(jnp.linalg.norm(a - r)), float(jnp.linalg.norm(r))
    assert err <= 1e-5 * norm, (name, err, norm)
  print(f"ok kernel {method} {seq}: max|Δout|={float(jnp.abs(out - ref).max()):.1e}")


def check_counts():
  """Each shard computes exactly the key blocks the NumPy rule expects, fewer than all."""
  seq, block = 8, 4
  trees = [build_tree(g) for g in _groups()]
  batch = pack(trees, ROW, ROWS)[0]
  end = jnp.asarray(batch.end)
  q = jnp.asarray(np.random.default_rng(0).normal(size=(ROWS, ROW, 2, 8)), jnp.float32)
  with jax.set_mesh(_mesh(seq)):
    _, _, counts = jax.jit(lambda q, end: context_parallel.tree_attention(
        q, q, q, end, scale=1.0, axis="sequence", block=block, return_counts=True))(q, end)
  want = context_parallel.expected_block_counts(batch.end, seq, block)
  np.testing.assert_array_equal(counts, want)
  causal = context_parallel.expected_block_counts(np.full((ROWS, ROW), ROW), seq, block)
  assert want.sum() < causal.sum(), (want.sum(), causal.sum())  # tree skipping beats causal
  print(f"ok counts: {int(want.sum())} of {causal.sum()} causal / {ROWS * seq * ROW // block} "
        "all blocks")


def _groups():
  """Groups whose tries span several 16-token chunks: shared prompts, branches, a two-call
  trajectory that repeats its first call as context, and a compaction branch."""
  rng = np.random.default_rng(1)
  toks = lambda n: rng.integers(1, 128, n).tolist()
  p, a0, obs, a1, summary = toks(24), toks(10), toks(6), toks(9), toks(5)
  group_a = [TrajectoryTokens([CallTokens(p, a0), CallTokens(p + a0 + obs, a1)]),
             TrajectoryTokens([CallTokens(p, a0[:4] + toks(12))]),
             TrajectoryTokens([CallTokens(p + a0, toks(7)), CallTokens(p + summary, toks(8))])]
  q = toks(30)
  group_b = [TrajectoryTokens([CallTokens(q, toks(n))]) for n in (20, 14, 17)]
  r = toks(50)
  group_c = [TrajectoryTokens([CallTokens(r, toks(n))]) for n in (25, 30)]
  group_d = [TrajectoryTokens([CallTokens(toks(40), toks(60))])]
  return [group_a, group_b, group_c, group_d]


def _loss(model, batch, cfg):
  h, aux, _ = model.hidden(batch["tokens"], batch["positions"], batch["end"])
  lp, _ = sequence_logprobs(h, model.lm_head_weight(), batch["seq_pred"], batch["seq_tokens"],
                            chunk=64, cfg=cfg)
  loss = -(lp * batch["weight"]).sum() / batch["weight"].sum()
  return loss, (lp, aux["max_logits"])


def check_model(name, cfg, seqs, method="auto"):
  """Tree-packed log-probs, loss, gradients and max logits on each mesh equal one device's.

  The model's attention picks its method by K/V size ("auto": all-gather at these sizes);
  method "ring" makes it take the ring.
  """
  trees = [build_tree(g) for g in _groups()]
  tb = pack(trees, ROW, ROWS)
  assert len(tb) == 1, len(tb)
  tb = tb[0]
  batch = {f: jnp.asarray(getattr(tb, f)) for f in ("tokens", "positions", "end", "seq_pred",
                                                    "seq_tokens")}
  batch["weight"] = jnp.asarray(tb.seq_valid * tb.fields["loss_mask"], jnp.float32)
  pad = -len(batch["weight"]) % ROWS  # sequences are sharded over the batch axes too
  for f in ("seq_pred", "seq_tokens", "weight"):
    batch[f] = jnp.pad(batch[f], ((0, pad), (0, 0)))
  model = transformer.init(cfg, seed=0)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def step(params, rest, batch, cfg):
    return jax.value_and_grad(lambda p: _loss(nnx.merge(graphdef, p, rest), batch, cfg),
                              has_aux=True)(params)

  (ref_loss, (ref_lp, ref_max)), ref_grad = jax.jit(step, static_argnums=3)(params, rest, batch,
                                                                            None)
  valid = np.asarray(batch["weight"]) > 0
  limit = context_parallel.ALL_GATHER_MAX_BYTES
  for seq in seqs:
    mesh = _mesh(seq)
    with jax.set_mesh(mesh):
      _, p, r = nnx.split(sharding.shard_model(model, mesh), nnx.Param, ...)
      bs = {k: jax.device_put(a, sharding.batch_sharding(cfg, mesh, a.ndim))
            for k, a in batch.items()}
      try:
        context_parallel.ALL_GATHER_MAX_BYTES = 0 if method == "ring" else limit
        (loss, (lp, max_logits)), grad = jax.jit(step, static_argnums=3)(p, r, bs, cfg)
      finally:
        context_parallel.ALL_GATHER_MAX_BYTES = limit
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(lp)[valid], np.asarray(ref_lp)[valid], rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(max_logits, ref_max, rtol=1e-6, atol=1e-6)
    flat = jax.tree_util.tree_flatten_with_path(grad)[0]
    for (path, a), b in zip(flat, jax.tree.leaves(ref_grad)):
      err, norm = float(jnp.linalg.norm(a - b)), float(jnp.linalg.norm(b))
      assert err <= 1e-5 * norm + 1e-7, (jax.tree_util.keystr(path), err, norm)
    print(f"ok model {name} {method} {seq}: |Δloss|={abs(float(loss - ref_loss)):.1e}")


def main():
  """The checks of CHECKS; with the argument "all", every kernel method and model on every
  mesh of MESHES (slower)."""
  assert len(jax.devices()) == 8
  every = sys.argv[1:] == ["all"]
  seqs = tuple(s for s, _ in MESHES)
  for method, seq in ([(m, s) for m in ("ring", "all_gather") for s in seqs] if every
                      else [("ring", 8), ("all_gather", 2)]):
    check_kernel(method, seq)
  check_counts()
  for method in ("ring", "auto") if every else ("ring",):
    check_model("dense", TINY_DENSE, seqs if every else (2,), method)
  for method in ("ring", "auto") if every else ("auto",):
    check_model("moe_mla", TINY_MOE_MLA, seqs if every else (4,), method)
  sys.stdout.flush()


if __name__ == "__main__":
  main()
