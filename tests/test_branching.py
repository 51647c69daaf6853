"""Tree rollouts (envs.branching): entropy-guided branching groups on generated tasks.

A seeded test policy runs shell commands whose outputs show what each path's sandbox holds, so
the transcripts prove that a branch sees the parent's files at the branch point and only its own
afterwards; a real engine shows the branches' re-sampled calls reuse the shared prefix from its
cache; and a branched group trains exactly like its trajectories one by one.
"""

import argparse
import asyncio
import math
import re

import numpy as np
import pytest

from envs import taskgen
from envs.branching import (BranchConfig, add_branch_flags, arpo_step_entropy,
                            branch_config_from_flags, branch_probability, global_samples,
                            make_branching_group, step_entropy, tree_stats)
from envs.chat import make_chat
from envs.chat.tokenizer import HFTokenizer
from envs.episode import episode_seed, make_sandbox_factory
from envs.policy import Generation
from envs.scaffold import ScaffoldConfig
from tests.test_chat import _tiny_bpe


@pytest.fixture(scope="module")
def chat():
  return make_chat("qwen2.5", HFTokenizer(_tiny_bpe(), eos_token="<|im_end|>"))


@pytest.fixture(scope="module")
def task(tmp_path_factory):
  return taskgen.write_tasks(str(tmp_path_factory.mktemp("tasks")), 1, 0, 0)[0]


def _bash(command):
  return {"role": "assistant", "content": None,
          "tool_calls": [{"function": {"name": "bash", "arguments": {"command": command}}}]}


class ShellPolicy:
  """Turn t of a path runs `script[t]` (formatted with the call's seed) as a bash tool call; the
  reported entropy of every token is `entropy[t]`."""

  def __init__(self, chat, script, entropy):
    self.chat, self.script, self.entropy = chat, script, entropy
    self.log = []  # (path seed, turn) of every call, in the order they were sampled

  async def generate(self, input_ids, params):
    turn = self.chat.tokenizer.decode(list(input_ids)).count("<|im_start|>assistant") - 1
    self.log.append((params.seed - turn, turn))  # call i of a path samples with its seed + i
    text = self.script[min(turn, len(self.script) - 1)]
    if text == "submit":
      msg = {"role": "assistant", "content": None,
             "tool_calls": [{"function": {"name": "submit", "arguments": {}}}]}
    else:
      msg = _bash(text.format(seed=params.seed))
    ids = self.chat.assistant_ids(msg)
    return Generation(ids, [-0.5] * len(ids), "stop", 0,
                      entropies=[self.entropy[min(turn, len(self.entropy) - 1)]] * len(ids))


def _tool_outputs(trajectory):
  return [m["content"] for m in trajectory.metadata.get("messages", [])] or None


def test_branch_rule_and_config():
  assert global_samples(8, 1.0, 1.0, 1.0) == 4
  assert global_samples(8, 3.0, 0.0, 5.0) == 8 and global_samples(8, 0.0, 3.0, 5.0) == 1
  assert math.isclose(global_samples(10, 2.0, 1.0, 1.0), round(10 / (1 + math.exp(-1))))
  cfg = BranchConfig(base_prob=0.5, entropy_weight=0.2, consecutive_penalty=0.5)
  assert math.isclose(branch_probability(2.0, 1.0, 0, cfg), 0.7)
  assert math.isclose(branch_probability(2.0, 1.0, 2, cfg), 0.7 * 0.25)
  assert branch_probability(-10.0, 1.0, 0, cfg) == 0.0
  assert branch_probability(10.0, 0.0, 0, cfg) == 1.0
  gen = Generation([1, 2, 3], [-1.0, -2.0, -3.0], "stop")
  assert step_entropy(gen, 2) == 1.5
  assert step_entropy(Generation([1, 2], [-1.0, -1.0], "stop", entropies=[0.25, 0.75]), 5) == 0.5
  for bad in ({"width": 1}, {"base_prob": 1.5}, {"entropy_weight": -1.0},
              {"global_fraction": 0.0}, {"entropy_tokens": 0}, {"entropy_measure": "bits"},
              {"entropy_top_k": 0}, {"reset_root": 1}, {"premonitor": "no"}):
    with pytest.raises(ValueError, match="BranchConfig." + next(iter(bad))):
      BranchConfig(**bad)
  parser = argparse.ArgumentParser()
  add_branch_flags(parser)
  assert branch_config_from_flags(parser.parse_args([])) == BranchConfig()
  cfg = branch_config_from_flags(parser.parse_args(
      ["--branch_entropy_measure", "arpo", "--branch_entropy_top_k", "5", "--branch_reset_root",
       "true", "--branch_premonitor", "false", "--branch_global_fraction", "0.25"]))
  assert cfg == BranchConfig(entropy_measure="arpo", entropy_top_k=5, reset_root=True,
                             premonitor=False, global_fraction=0.25)


def _arpo_numpy(logits, tokens, n, k):
  """ARPO's step entropy transcribed: per position j < n, the entropy terms of the k most
  likely tokens and the sampled one (vLLM's logprobs=k answer), summed over the positions, over
  ln(vocabulary size)."""
  shifted = logits - logits.max(-1, keepdims=True)
  logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  total = 0.0
  for j in range(min(n, len(tokens))):
    kept = set(np.argsort(-logp[j])[:k].tolist()) | {int(tokens[j])}
    total += -sum(np.exp(logp[j, i]) * logp[j, i] for i in kept)
  return total / np.log(logits.shape[-1])


@pytest.mark.parametrize("length", [25, 7])
def test_arpo_entropy_matches_the_formula(length):
  # known logits of a 50-token vocabulary, peaked enough that some sampled tokens fall outside
  # the top 10; the policy reports 12 top log-probs per token (more than k: the first k count)
  rng = np.random.default_rng(length)
  vocab, top_n = 50, 12
  logits = rng.normal(0, 3, (length, vocab))
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  tokens = rng.integers(0, vocab, length)
  assert any(t not in np.argsort(-logp[j])[:10] for j, t in enumerate(tokens))
  top = [[(int(i), float(logp[j, i])) for i in np.argsort(-logp[j])[:top_n]]
         for j in range(length)]
  gen = Generation(tokens.tolist(), [float(logp[j, t]) for j, t in enumerate(tokens)], "stop",
                   top_logprobs=top)
  got = arpo_step_entropy(gen, 20, 10, vocab)
  assert got == pytest.approx(_arpo_numpy(logits, tokens, 20, 10), rel=1e-12)
  # the full entropy bounds the truncated one, token by token
  full = -(np.exp(logp) * logp).sum(-1)[:20].sum() / np.log(vocab)
  assert 0 < got <= full
  with pytest.raises(ValueError, match="top log-probs"):
    arpo_step_entropy(Generation(gen.output_ids, gen.logprobs, "stop"), 20, 10, vocab)
  with pytest.raises(ValueError, match="entropy_top_k=13"):
    arpo_step_entropy(gen, 20, 13, vocab)


def _run_group(policy, chat, task, k, branch, sandbox="bwrap", seed=0, max_turns=4):
  group = make_branching_group(policy, chat, make_sandbox_factory(sandbox, allow_unsafe=True),
                               ScaffoldConfig(max_turns=max_turns, max_new_tokens=256,
                                              max_context_tokens=4096), branch)
  counters = {}
  out = asyncio.run(group(task, k, draw=0, seed=seed, counters=counters))
  return out, counters


def _observations(chat, trajectory):
  """The tool results each call saw (decoded from the next call's input)."""
  calls = trajectory.calls
  out = []
  for prev, nxt in zip(calls, calls[1:]):
    start = len(prev.input_ids) + len(prev.output_ids)
    out.append(chat.tokenizer.decode(nxt.input_ids[start:]))
  return out


def test_branches_fork_the_sandbox_at_the_branch_point(chat, task):
  # turn 0 writes a file every path shares; turn 1 (a tool step: it always branches) writes a
  # file named by the call's own seed and lists the workspace; turn 2 lists it again. A new
  # path never branches at the step it re-samples (the consecutive penalty is 1) nor at turn 2
  # (its entropy is below the root's: probability 0), so the tree has depth 1.
  script = ["echo base > shared.txt", "echo {seed} > own_{seed}.txt && ls", "ls && cat shared.txt",
            "submit"]
  policy = ShellPolicy(chat, script, entropy=[1.0, 3.0, 0.0, 0.0])
  out, counters = _run_group(policy, chat, task, 4,
                             BranchConfig(global_fraction=0.5, base_prob=1.0, width=2,
                                          entropy_weight=1.0, consecutive_penalty=1.0))
  assert len(out) == 4 and counters.get("branches") == 2
  by_index = {t.metadata["index"]: t for t in out}
  for t in out:
    tree = t.metadata["tree"]
    obs = _observations(chat, t)
    files = set(re.findall(r"own_\d+\.txt", obs[2]))
    # after the branch point each path holds exactly its own file
    assert len(files) == 1, obs[2]
    assert "shared.txt" in obs[1] and "base" in obs[2]
    if tree["parent"] >= 0:
      parent = by_index[tree["parent"]]
      assert tree["fork_turn"] == 1 and tree["depth"] == 1
      assert 1 in parent.metadata["tree"]["branch_turns"]
      # the shared call is recorded verbatim; the re-sampled one differs
      assert (t.calls[0].input_ids, t.calls[0].output_ids) == (parent.calls[0].input_ids,
                                                               parent.calls[0].output_ids)
      assert t.calls[1].input_ids == parent.calls[1].input_ids
      assert t.calls[1].output_ids != parent.calls[1].output_ids
      assert files != set(re.findall(r"own_\d+\.txt", _observations(chat, parent)[2]))
      assert t.calls[1].meta["entropy"] == 3.0
  stats = tree_stats([out])
  assert stats["tree/branches_per_task"] == 2 and stats["tree/global_samples"] == 2
  assert stats["tree/depth_0"] == 0.5 and stats["tree/depth_1"] == 0.5
  assert 0 < stats["tree/tokens_sampled"] < stats["tree/tokens_trained"]
  assert stats["tree/branch_entropy"] == 3.0


def test_premonitoring_allocates_globals_and_fills_the_budget(chat, task):
  # the root is far more uncertain than the tool steps: pre-monitoring keeps all samples global
  policy = ShellPolicy(chat, ["ls", "ls", "submit"], entropy=[5.0, 0.0, 0.0])
  out, counters = _run_group(policy, chat, task, 3, BranchConfig(premonitor_beta=4.0),
                             sandbox="local")
  assert [t.metadata["tree"]["parent"] for t in out] == [-1, -1, -1]
  assert out[0].metadata["tree"]["global_samples"] == 3 and not counters.get("branches")
  # no branching at all (probability 0): the group is filled with global samples
  policy = ShellPolicy(chat, ["ls", "ls", "submit"], entropy=[1.0, 1.0, 1.0])
  out, _ = _run_group(policy, chat, task, 3, BranchConfig(base_prob=0.0, global_fraction=0.34),
                      sandbox="local")
  assert len(out) == 3 and sorted(t.metadata["index"] for t in out) == [0, 1, 2]
  assert all(t.metadata["tree"]["parent"] == -1 for t in out)
  assert len({t.group_id for t in out}) == 1


def test_branches_reset_their_root_entropy(chat, task):
  # one global sample (k = 3); P = clip(H_t - H_root) (α 0, γ 1, no penalty). The global path
  # branches at turn 1 (H 3 vs its root's 1). Keeping the parent's root, the branch's own turn 1
  # (H 3) is 2 above it and branches again (a grandchild); with the reset, its root is that
  # call's 3, it never branches and the budget left goes to a new global sample.
  for reset, parents, h_root in ((False, [-1, 0, 1], 1.0), (True, [-1, 0, -1], 3.0)):
    policy = ShellPolicy(chat, ["ls", "ls", "ls", "submit"], entropy=[1.0, 3.0, 0.0, 0.0])
    out, counters = _run_group(policy, chat, task, 3,
                               BranchConfig(global_fraction=0.34, base_prob=0.0,
                                            entropy_weight=1.0, consecutive_penalty=0.0,
                                            reset_root=reset), sandbox="local")
    assert [t.metadata["tree"]["parent"] for t in out] == parents, reset
    assert out[1].metadata["tree"]["h_root"] == h_root
    assert out[0].metadata["tree"]["h_root"] == 1.0
    assert counters["branches"] == (1 if reset else 2)


def test_without_premonitoring_the_global_samples_start_at_once(chat, task):
  # no branching (α = γ = 0): with pre-monitoring, path 0 runs alone to its end before path 1
  # samples; without, m = k / 2 global samples start together, then the budget left is filled
  for premonitor in (True, False):
    policy = ShellPolicy(chat, ["ls", "ls", "submit"], entropy=[1.0, 1.0, 1.0])
    out, counters = _run_group(policy, chat, task, 4,
                               BranchConfig(base_prob=0.0, entropy_weight=0.0,
                                            premonitor=premonitor), sandbox="local")
    assert [t.metadata["tree"]["parent"] for t in out] == [-1] * 4 and not counters
    first_of_1 = policy.log.index((episode_seed(0, 0, 1), 0))
    last_of_0 = max(i for i, (s, _) in enumerate(policy.log) if s == episode_seed(0, 0, 0))
    assert (first_of_1 > last_of_0) == premonitor, policy.log
    # equal entropies: m = round(4 · σ(0)) = 2 either way
    assert out[0].metadata["tree"]["global_samples"] == 2


class RecordingEnginePolicy:
  """The engine as a Policy, keeping every request's (input ids, Completion)."""

  def __init__(self, engine):
    self.engine, self.log = engine, []
    engine.start()

  async def generate(self, input_ids, params):
    out = await asyncio.wrap_future(self.engine.submit(list(input_ids), params))
    self.log.append((list(input_ids), out))
    return Generation(out.output_ids, out.logprobs, out.finish_reason, out.policy_version,
                      entropies=out.entropies, top_logprobs=out.top_logprobs)


@pytest.mark.parametrize("measure", ["nats", "arpo"])
def test_engine_reuses_the_shared_prefix_for_branches(chat, task, measure):
  """Real engine, random tiny model: every branch's re-sampled call is served from the cached
  prefix of the call it branched from (all but the last context token reused, nothing shared
  prefilled again), and the engine's entropies (or top log-probs, for ARPO's measure) are what
  the branching read."""
  from models import transformer
  from models.config import ModelConfig
  from models.engine import Engine, EngineConfig
  vocab = -(-chat.tokenizer.vocab_size // 128) * 128
  cfg = ModelConfig(vocab_size=vocab, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=16, intermediate_size=64, initializer_range=0.1)
  engine = Engine(transformer.init(cfg, seed=0),
                  EngineConfig(slots=4, max_seq_len=4096, prefix_cache_rows=8, min_prefix=4,
                               prefill_chunk=256, steps_per_call=8,
                               top_logprobs=10 if measure == "arpo" else 0),
                  detokenize=chat.tokenizer.decode)
  policy = RecordingEnginePolicy(engine)
  try:
    group = make_branching_group(
        policy, chat, make_sandbox_factory("local", allow_unsafe=True),
        ScaffoldConfig(max_turns=3, max_new_tokens=6, max_context_tokens=4096),
        BranchConfig(global_fraction=0.5, base_prob=1.0, consecutive_penalty=0.0,
                     entropy_measure=measure))
    out = asyncio.run(group(task, 4, seed=0))
  finally:
    engine.stop()
  assert len(out) == 4
  children = [t for t in out if t.metadata["tree"]["parent"] >= 0]
  assert children
  completions = {}
  for ids, completion in policy.log:
    completions.setdefault(tuple(ids), []).append(completion)
  for t in children:
    turn = t.metadata["tree"]["fork_turn"]
    ids = tuple(t.calls[turn].input_ids)
    # the parent sampled from this context first; the branch found it in the prefix cache
    assert len(completions[ids]) >= 2
    assert completions[ids][-1].cached_tokens == len(ids) - 1
    (mine,) = [c for c in completions[ids] if c.output_ids == t.calls[turn].output_ids]
    if measure == "nats":
      want = float(np.mean(mine.entropies[:20]))
    else:  # the formula on the engine's top 10 and sampled log-probs, |V| the tokenizer's
      want = sum(-sum(math.exp(x) * x for x in dict([*top, (tok, lp)]).values())
                 for tok, lp, top in zip(mine.output_ids[:20], mine.logprobs, mine.top_logprobs))
      want /= math.log(chat.tokenizer.vocab_size)
      # truncated: at most the full entropy (nats, summed) over ln|V|
      assert want <= sum(mine.entropies[:20]) / math.log(chat.tokenizer.vocab_size) + 1e-6
    assert t.calls[turn].meta["entropy"] == pytest.approx(want)


def test_branched_groups_cross_the_queue_and_the_trainers_filters(chat, task):
  """A rollout worker with the branching group function puts whole trees through the queue as
  msgpack records; the trainer's group rules see ordinary groups: whole, unseen ones kept, a
  constant-reward tree dropped, a tree sampled by an older policy dropped as stale, and the
  leaves' shared calls come back verbatim (one trie, calls shared across leaves)."""
  from envs.queue import InMemoryQueue
  from envs.rollout_worker import RolloutWorker, WorkerConfig
  from envs.trajectory import Trajectory
  from rl.tree import build_tree, from_trajectory
  from trainer import groups as G
  policy = ShellPolicy(chat, ["echo x > a.txt", "cat a.txt", "submit"], entropy=[1.0, 3.0, 0.0])
  branching = make_branching_group(
      policy, chat, make_sandbox_factory("local", allow_unsafe=True),
      ScaffoldConfig(max_turns=4, max_new_tokens=256, max_context_tokens=4096),
      BranchConfig(global_fraction=0.5, base_prob=1.0, consecutive_penalty=1.0))
  q = InMemoryQueue()
  cfg = WorkerConfig(group_size=4, concurrency=4, max_draws=2, poll=0.01)
  stats = asyncio.run(RolloutWorker(q, [task], None, cfg, group_fn=branching).run())
  assert stats["groups_done"] == 2 and stats["trajectories_put"] == 8
  got = q.get_batch(100, timeout=0.05)
  trajs = [Trajectory.from_bytes(d.trajectory.to_bytes()) for d in got]
  groups = [[t for t in trajs if t.group_id == g] for g in sorted({t.group_id for t in trajs})]
  assert [len(g) for g in groups] == [4, 4]
  for g in groups:
    assert sum(t.metadata["tree"]["parent"] >= 0 for t in g) == 2
    tree = build_tree([from_trajectory(t) for t in g])
    assert len(tree) < sum(len(c.input_ids) + len(c.output_ids) for t in g for c in t.calls)
  # every leaf failed the task's tests: constant reward, no signal
  kept, _, counts = G.select_groups(groups, group_size=4, drop_constant=True)
  assert not kept and counts == {"dropped/constant_groups": 2}
  groups[0][0].reward = 1.0
  kept, _, counts = G.select_groups(groups, group_size=4, drop_constant=True, min_version=0,
                                    consumed=frozenset({groups[1][3].trajectory_id}))
  assert kept == [groups[0]] and counts["dropped/consumed_groups"] == 1
  kept, _, counts = G.select_groups(groups, group_size=4, drop_constant=True, min_version=1)
  assert not kept and counts["dropped/stale_groups"] == 2
  adv = G.advantages_of([groups[0]], "treerl")[0]
  assert adv.shape[0] == 4 and np.abs(adv).sum() > 0
