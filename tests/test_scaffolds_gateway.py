"""Real scaffold CLIs against the real policy server, a scripted policy, and training on the result.

One environment holds Claude Code, Codex and mini-swe-agent (`scaffolds_environment`: built
once and cached; `python -m envs.scaffolds build claude-code codex mini-swe-agent` builds it
ahead of time). A tiny Python repository with a failing unittest is the task (a shell task:
its check runs the tests). Each CLI runs in a bwrap sandbox of that environment and reaches
`trainer.serving.PolicyServer` (Anthropic Messages, Responses, Chat Completions) only through
the episode's channel. The server renders every request through the Qwen2.5 chat format of a
tiny byte-level BPE to token ids; behind it, `envs.scaffolds.scripted.ScriptedPolicy` reads
the rendered prompt back, finds the tools the CLI offered and how many tool results came
back, and answers with the exact ids of Hermes tool calls: read the file, fix it, run the
tests, finish. So the server's rendering of each protocol's request and its tool-call
parsing of sampled ids carry the whole episode.

Checked per CLI: the verifier's reward is 1.0; every model call went to the CLI's protocol
endpoint and is in the session of the episode's id, with the ids the policy sampled; the
session is a `Trajectory` (`trajectory_from_session`) whose tree stores shared prefixes once
and every sampled token once; and (mini-swe-agent in the suite, every CLI with TRAINED =
SCAFFOLDS) its calls train: the tree-packed SFT step's loss and gradients equal those of its
calls trained unpacked, each alone as its own sequence, on a random-weight model with the
tokenizer's vocabulary (the tolerances of tests/test_step.py). Claude Code's and Codex's
prompts are ~35k and ~20k tokens of this tokenizer, so the model is one layer with one
attention head and uses the blocked attention (`attention_impl="auto"`).
"""

from __future__ import annotations

import asyncio
import json
import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from envs.chat import make_chat
from envs.chat.tokenizer import HFTokenizer
from envs.scaffolds import get, run_blackbox_episode
from envs.scaffolds.registry import scaffolds_environment
from envs.scaffolds.scripted import SUBMIT, BugFix, ScriptedPolicy
from envs.scaffolds.sessions import trajectory_from_session
from envs.tasks import Task
from models import transformer
from models.engine import Completion
from models.logprobs import token_logprobs
from rl import losses
from rl.tree import build_tree, from_trajectory
from tests.conftest import TINY_DENSE
from tests.test_chat import _tiny_bpe
from tests.test_sandbox import TEST_UIDS
from tests.test_step import assert_trees_close, optimizer
from trainer import batches as B
from trainer import state as S
from trainer import step as T
from trainer.serve import PolicyServer, ServerConfig

SCAFFOLDS = ("claude-code", "codex", "mini-swe-agent")
ENVIRONMENT = scaffolds_environment(SCAFFOLDS)
TOKEN = secrets.token_hex(16)
FIX = BugFix("calc.py", "a - b", "a + b", "python3 -m unittest -v test_calc")
SETUP = ("printf 'def add(a, b):\\n    return a - b\\n' > calc.py && printf 'import unittest\\n"
         "from calc import add\\n\\n\\nclass AddTest(unittest.TestCase):\\n    def test_add(self)"
         ":\\n        self.assertEqual(add(2, 3), 5)\\n' > test_calc.py")
TASK = Task(instance_id="calc-add", kind="shell",
            problem_statements=("add() in calc.py subtracts instead of adding, so test_calc.py "
                                "fails. Fix the bug.",),
            setup_script=SETUP, check_script="cd /workspace && python3 -m unittest test_calc",
            check_parser="exit_code", environment=ENVIRONMENT, agent_timeout=300)
# Per CLI: the endpoint its calls go to and the tool called at each of the four steps
# (None: a final text reply).
EXPECTED = {
    "claude-code": ("/v1/messages", ["Read", "Edit", "Bash", None]),
    "codex": ("/v1/responses", ["exec_command", "exec_command", "exec_command", None]),
    "mini-swe-agent": ("/v1/chat/completions", ["bash", "bash", "bash", "bash"]),
}
PROTOCOL = {"/v1/messages": "anthropic_messages", "/v1/responses": "responses",
            "/v1/chat/completions": "chat_completions"}
# The sessions trained against their unpacked calls in the suite: mini-swe-agent's calls are
# ~3k tokens of this tokenizer; Claude Code's (~35k) and Codex's (~20k) pass the same check
# (TRAINED = SCAFFOLDS) in minutes, not seconds, so the suite checks their trees' shape only.
TRAINED = ("mini-swe-agent",)
# The trained model: TINY_DENSE cut to one layer and one head (long rows on a CPU).
SMALL = dict(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, hidden_size=16,
             intermediate_size=32, attention_impl="auto")


@pytest.fixture(scope="module")
def gateway():
  """(server, url, policy): the policy server over the scripted policy, token auth."""
  tok = HFTokenizer(_tiny_bpe(), eos_token="<|im_end|>")
  chat = make_chat("qwen2.5", tok)
  policy = ScriptedPolicy(chat, FIX, completion=Completion)
  srv = PolicyServer(policy, ServerConfig(port=0, token=TOKEN, max_session_tokens=1 << 24),
                     tokenizer=tok, chat=chat)
  url = srv.start_in_thread()
  yield srv, url, policy
  srv.stop()


def _episode(gateway, name: str):
  """(BlackboxResult, the policy's decisions during the episode, the session's records)."""
  srv, url, policy = gateway
  first = len(policy.calls)
  result = asyncio.run(run_blackbox_episode(
      TASK, name, url, model="arbor", token=TOKEN, session_id=f"episode-{name}", max_turns=10,
      sandbox_kw={"uids": TEST_UIDS}))
  return result, policy.calls[first:], srv.sessions.get(result.session_id)


def _lcp(a: list, b: list) -> int:
  n = 0
  while n < min(len(a), len(b)) and a[n] == b[n]:
    n += 1
  return n


def _tree_nodes(trajectory) -> int:
  """The packed tree's size: each call adds what it does not share with an earlier one
  (Claude Code re-sends a tool call's input with defaults added: a branch)."""
  seqs = [list(c.input_ids) + list(c.output_ids) for c in trajectory.calls]
  return sum(len(q) - max((_lcp(q, p) for p in seqs[:i]), default=0)
             for i, q in enumerate(seqs))


def _train_equals_unpacked(trajectory, cfg) -> None:
  """The SFT step on the tree-packed trajectory has the loss and gradients of its calls
  trained unpacked (each alone, causal, in its own row)."""
  model = transformer.init(cfg, seed=0)
  calls = trajectory.calls
  seqs = [list(c.input_ids) + list(c.output_ids) for c in calls]
  longest = max(len(q) for q in seqs)
  row = -(-_tree_nodes(trajectory) // 128) * 128
  tokens = from_trajectory(trajectory, scalars={"advantage": 1.0, "reward": trajectory.reward})
  mb = B.make_micro_batches([[tokens]], B.BatchShape(row_len=row, rows=1, seqs=None,
                                                    seq_len=None, micro_batches=None))
  opt = optimizer(cfg, tau=1e9)
  step = T.make_train_step(cfg, losses.LossConfig(name="sft"), opt, donate=False)
  value, grads, metrics = step.gradients(S.create(cfg, opt, model=model), mb)

  n = sum(len(c.output_ids) for c in calls)
  row = -(-longest // 128) * 128  # the unpacked rows: the longest call
  ids = np.zeros((len(calls), row), np.int32)
  end = np.tile(np.arange(1, row + 1, dtype=np.int32), (len(calls), 1))  # padding: itself
  ct = np.zeros((len(calls), row - 1), np.float32)  # ∂loss/∂lp of the token-mean NLL
  for r, (c, seq) in enumerate(zip(calls, seqs)):
    ids[r, :len(seq)], end[r, :len(seq)] = seq, len(seq)
    ct[r, len(c.input_ids) - 1:len(seq) - 1] = -1.0 / n
  params, rest = S.split_model(model)
  graphdef = S.graphdef(cfg)

  def loss(params):
    m = nnx.merge(graphdef, params, rest)
    positions = jnp.broadcast_to(jnp.arange(row, dtype=jnp.int32), ids.shape)
    h, _, _ = m.hidden(jnp.asarray(ids), positions, jnp.asarray(end))
    lp, _ = token_logprobs(h[:, :-1], m.lm_head_weight(), jnp.asarray(ids)[:, 1:], chunk=64)
    return (jnp.asarray(ct) * lp).sum()
  ref_value, ref_grads = jax.jit(jax.value_and_grad(loss))(params)
  assert float(metrics["num_tokens"]) == n
  assert abs(float(value) - float(ref_value)) <= 1e-6 * abs(float(ref_value)), (
      float(value), float(ref_value))
  assert_trees_close(grads, ref_grads)


@pytest.mark.slow
@pytest.mark.parametrize("name", SCAFFOLDS)
def test_cli_fixes_the_bug_through_the_gateway_and_trains(gateway, name):
  """The CLI reads, edits, tests and finishes through the real server; reward 1.0; the
  session holds every call; its trajectory trains like its calls unpacked."""
  path, tools = EXPECTED[name]
  assert get(name).protocol == PROTOCOL[path]
  result, calls, records = _episode(gateway, name)
  assert result.termination == "exited" and result.reward == 1.0, (
      result.termination, result.details, result.stdout[-3000:], result.stderr[-3000:])
  # every model call: the CLI's protocol endpoint, answered, in the episode's session
  assert result.requests and all(r == ("POST", path, 200) for r in result.requests), \
      result.requests
  assert len(records) == len(calls) == len(result.requests) == 4
  assert [c["step"] for c in calls] == [0, 1, 2, 3]
  got = [(c["reply"].get("tool_calls") or [{}])[0].get("name") for c in calls]
  assert got == tools, got
  if name == "mini-swe-agent":
    assert calls[-1]["reply"]["tool_calls"][0]["arguments"]["command"] == SUBMIT
  assert [r["output_ids"] for r in records] == [c["output_ids"] for c in calls]
  policy = gateway[2]
  assert [policy.tokenizer.decode(r["input_ids"]) for r in records] == [
      c["prompt"] for c in calls]
  # the tool results came back: the file's text after the read, the tests' OK after the run
  assert FIX.old in calls[1]["prompt"].rsplit("<tool_response>", 1)[1]
  assert "OK" in calls[3]["prompt"].rsplit("<tool_response>", 1)[1]

  trajectory = trajectory_from_session(
      records, reward=result.reward, task_id=TASK.instance_id, group_id=f"{TASK.instance_id}/0",
      termination=result.termination, metadata={"scaffold": name,
                                                "session_id": result.session_id})
  assert trajectory.reward == 1.0 and len(trajectory.calls) == 4
  assert [c.output_ids for c in trajectory.calls] == [r["output_ids"] for r in records]
  assert all(c.output_logprobs == [policy.logprob] * len(c.output_ids)
             for c in trajectory.calls)
  # each call's prompt starts with the previous one's: the tree shares those tokens
  for a, b in zip(trajectory.calls, trajectory.calls[1:]):
    assert b.input_ids[:len(a.input_ids)] == a.input_ids
  json.dumps(trajectory.to_dict())
  tree = build_tree([from_trajectory(trajectory)])
  assert len(tree.tokens) == _tree_nodes(trajectory)  # shared prefixes stored once
  assert sum(len(c.output_ids) for c in trajectory.calls) == len(tree.seqs[0].index)
  if name in TRAINED:
    _train_equals_unpacked(trajectory, TINY_DENSE.replace(
        vocab_size=policy.tokenizer.vocab_size, **SMALL))
