"""Routing replay, from the engine to the training forward.

The engine records the experts of every position it fed to the model (`Completion.expert_ids`);
they travel with the call (`Generation` -> `LLMCall`, msgpack records, the policy server's JSON),
become each tree node's experts (`Tree.experts`, the first recording of a node wins, -1 where
nothing was recorded), are laid out per micro-batch position (`MicroBatches.expert_ids`) and
replayed by the MoE layers (a -1 position routes itself). The end-to-end test samples with a
bf16 MoE + MLA engine and checks that replay makes the trainer route exactly as the sampler did
and shrinks the sampler/trainer mismatch.
"""

from __future__ import annotations

import asyncio

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

from envs.policy import (Generation, HTTPPolicy, SamplingParams, decode_expert_ids,
                         encode_expert_ids)
from envs.trajectory import LLMCall, Trajectory
from models import transformer
from models.engine import Engine, EngineConfig
from rl.tree import CallTokens, TrajectoryTokens, build_tree, from_trajectory
from trainer import batches as B
from trainer import groups as groups_lib
from trainer import step as step_lib
from trainer.rl import Scorer
from trainer.serve import EnginePolicy, PolicyServer, ServerConfig
from trainer.teachers import Teachers


def _ids(rng, n, layers=2, k=2, experts=8):
  return rng.integers(0, experts, (n, layers, k)).astype(np.int16)


def test_tree_nodes_take_the_first_recording():
  rng = np.random.default_rng(0)
  prompt, out1, more, out2 = [1, 2, 3], [4, 5], [6], [7, 8]
  e1 = _ids(rng, len(prompt) + len(out1) - 1)
  e2 = _ids(rng, len(prompt + out1 + more) + len(out2) - 1)
  other = _ids(rng, len(prompt) + 1 - 1)
  trajs = [TrajectoryTokens([CallTokens(prompt, out1, expert_ids=e1),
                             CallTokens(prompt + out1 + more, out2, expert_ids=e2)]),
           TrajectoryTokens([CallTokens(prompt, [9], expert_ids=other)]),
           TrajectoryTokens([CallTokens([1, 2, 10], [11])])]  # nothing recorded
  tree = build_tree(trajs)
  node_of = {tuple(tree.path(n)): n for n in range(len(tree))}
  seq2 = prompt + out1 + more + out2
  for p in range(len(seq2)):
    got = tree.experts[node_of[tuple(seq2[:p + 1])]]
    if p < len(e1):  # call 1 recorded it first
      np.testing.assert_array_equal(got, e1[p])
    elif p < len(e2):
      np.testing.assert_array_equal(got, e2[p])
    else:  # the last sampled token was never fed to the model
      assert (got == -1).all()
  assert (tree.experts[node_of[(1, 2, 3, 9)]] == -1).all()  # call 1's experts, not `other`'s
  assert (tree.experts[node_of[(1, 2, 10)]] == -1).all()
  # the second call records only what the first did not (as the scaffold does): same tree
  short = [TrajectoryTokens([trajs[0].calls[0], CallTokens(
      prompt + out1 + more, out2, expert_ids=e2[len(e1):], expert_start=len(e1))])] + trajs[1:]
  np.testing.assert_array_equal(build_tree(short).experts, tree.experts)
  with pytest.raises(ValueError, match=r"expert_ids has shape \(4, 2, 2\), expected \[5"):
    build_tree([TrajectoryTokens([CallTokens(prompt, [4, 5, 6], expert_ids=e1[:4])])])


def test_records_carry_expert_ids():
  rng = np.random.default_rng(1)
  ids = _ids(rng, 3 + 2 - 1)
  call = LLMCall([1, 2, 3], [4, 5], [-0.5, -0.25], expert_ids=ids)
  later = LLMCall([1, 2, 3, 4, 5, 6], [7], [-1.0], expert_ids=_ids(rng, 2), expert_start=4)
  traj = Trajectory([call, later], reward=1.0, task_id="t", group_id="g",
                    termination="submitted")
  back = Trajectory.from_bytes(traj.to_bytes())
  np.testing.assert_array_equal(back.calls[0].expert_ids, ids)
  for record in (back, traj.to_dict()):  # objects and raw dict records alike
    c, d = from_trajectory(record).calls
    np.testing.assert_array_equal(c.expert_ids, ids)
    np.testing.assert_array_equal(d.expert_ids, later.expert_ids)
    assert (c.expert_start, d.expert_start) == (0, 4)
  np.testing.assert_array_equal(decode_expert_ids(encode_expert_ids(ids)), ids)
  assert decode_expert_ids(encode_expert_ids(None)) is None
  with pytest.raises(ValueError, match=r"LLMCall.expert_ids has shape \(3, 2, 2\)"):
    LLMCall([1, 2, 3], [4, 5], [-0.5, -0.25], expert_ids=ids[:3])


def test_micro_batches_lay_out_each_nodes_experts():
  rng = np.random.default_rng(2)
  group = [Trajectory([LLMCall([1, 2, 3], [4 + t, 5, 6], [-1.0] * 3, expert_ids=_ids(rng, 5))],
                      1.0, "t", "g", "submitted") for t in range(3)]
  shape = B.BatchShape(row_len=128, rows=1, seqs=None, seq_len=None, micro_batches=None)
  ((_, mb),) = groups_lib.micro_batches([group], [np.zeros(3)], shape, 1, replay=True)
  ((_, plain),) = groups_lib.micro_batches([group], [np.zeros(3)], shape, 1)
  assert plain.expert_ids is None and mb.expert_ids.shape == (1, 2, 1, 128, 2)
  tree = build_tree([from_trajectory(t) for t in group])
  want = B.make_micro_batches([tree], shape, expert_ids=[tree.experts]).expert_ids
  np.testing.assert_array_equal(mb.expert_ids, want)
  real = mb.token_weights[0] > 0
  unrecorded = (mb.expert_ids[0] < 0).all((0, -1))
  assert (real & unrecorded).sum() == 3  # each trajectory's last token was never fed
  assert unrecorded[~real].all()  # padding routes itself


def test_replay_makes_the_trainer_route_as_the_bf16_sampler(moe_mla_model):
  """bf16 MoE + MLA: with replay the trainer's routing equals the engine's on every recorded
  position (routing flips 0 by construction of the forward), and the sampler/trainer KL drops."""
  cfg = moe_mla_model.cfg.replace(dtype="bfloat16")
  model = nnx.merge(nnx.graphdef(transformer.abstract(cfg)), nnx.state(moe_mla_model))
  engine = Engine(model, EngineConfig(slots=8, max_seq_len=128, prefix_cache_rows=8,
                                      return_expert_ids=True, seed=0))
  policy = EnginePolicy(engine)
  rng = np.random.default_rng(3)
  prompt = rng.integers(1, cfg.vocab_size, 16).tolist()
  server = PolicyServer(engine, ServerConfig(port=0))
  try:
    gens = [asyncio.run(policy.generate(prompt, SamplingParams(max_tokens=64, seed=i)))
            for i in range(8)]
    # a remote rollout worker gets the same experts through the policy server's JSON
    remote = asyncio.run(HTTPPolicy(server.start_in_thread(), timeout=120).generate(
        prompt, SamplingParams(max_tokens=64, seed=0)))
  finally:
    server.stop()
    engine.stop()
  assert remote.output_ids == gens[0].output_ids
  np.testing.assert_array_equal(remote.expert_ids, gens[0].expert_ids)
  assert all(isinstance(g, Generation) and g.expert_ids.shape == (16 + 64 - 1, 2, 2)
             for g in gens)
  group = [Trajectory([LLMCall(prompt, g.output_ids, g.logprobs, expert_ids=g.expert_ids)],
                      1.0, "t", "g", "submitted") for g in gens]
  shape = B.BatchShape(row_len=128, rows=8, seqs=None, seq_len=None, micro_batches=None)
  score = step_lib.make_score_fn(cfg)
  out = {}
  for replay in (False, True):
    ((_, mb),) = groups_lib.micro_batches([group], [np.zeros(8)], shape, 1, replay=replay)
    lp = np.asarray(score(model, mb), np.float64)
    valid = np.asarray(mb.seq_valid)
    d = (lp - mb.fields["logprobs"])[valid]
    out[replay] = float(np.mean(np.expm1(d) - d))
    if replay:
      graphdef = nnx.graphdef(model)
      first = jax.tree.map(lambda x: x[0], mb)
      _, aux, _ = nnx.merge(graphdef, nnx.state(model)).hidden(
          first.tokens, first.positions, first.end, token_weights=first.token_weights,
          expert_ids=first.expert_ids)
      recorded = (mb.expert_ids[0] >= 0).all(-1)
      np.testing.assert_array_equal(np.asarray(aux["expert_ids"])[recorded],
                                    mb.expert_ids[0][recorded])
      flips = np.asarray(aux["replay_flips"])
      assert flips[:, 1].sum() > 0 and flips[:, 0].sum() > 0  # bf16 routes differently
  assert out[True] < out[False], out


def test_reference_and_teachers_route_themselves():
  """Replay is the policy's sampler routing: models scoring the same batch for other reasons
  (the KL reference, distillation teachers) route with their own routers."""
  rng = np.random.default_rng(4)
  group = [Trajectory([LLMCall([1, 2, 3], [4 + t, 5], [-1.0] * 2, expert_ids=_ids(rng, 4))],
                      1.0, "t", "g", "submitted") for t in range(2)]
  shape = B.BatchShape(row_len=128, rows=1, seqs=None, seq_len=None, micro_batches=None)
  ((_, mb),) = groups_lib.micro_batches([group], [np.zeros(2)], shape, 1, replay=True)
  assert mb.expert_ids is not None
  seen = []
  score = lambda model, batch: seen.append(batch.expert_ids) or np.zeros(
      np.shape(batch.seq_valid), np.float32)
  teachers = Teachers.__new__(Teachers)
  teachers.by_domain = {"swe": (score, None)}
  teachers.logprobs(mb, np.full(np.shape(mb.seq_valid)[:2], "swe"))
  scorer = Scorer.__new__(Scorer)
  scorer.rl, scorer.reference, scorer.teachers = ml_collections.ConfigDict(
      {"mcla_passes": 0, "recompute_old": False}), object(), None
  scorer.score = score
  scorer(None, [], mb, [])
  assert seen == [None, None]
