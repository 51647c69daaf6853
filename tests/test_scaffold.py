"""envs.scaffold: the react loop driven by a scripted policy against a local sandbox (and fakes
for failures): tool calls run, observations are appended, every call's input extends the
previous call's full sequence (or, with a template that rewrites history, is the template's
rendering of the context), each termination reason, errors as observations, ReSum."""

import asyncio
import dataclasses

import numpy as np
import pytest

from envs.chat import load_chat, make_chat
from envs.chat.tokenizer import HFTokenizer
from envs.policy import SamplingParams
from envs.sandbox.base import ExecResult, Sandbox, SandboxError
from envs.sandbox.local import LocalSandbox
from envs.scaffold import (CUT_OFF, NO_TOOL_CALL, ScaffoldConfig, ScriptedPolicy, run_episode)
from envs.tools import default_tools
from envs.trajectory import Trajectory
from rl.tree import build_tree, from_trajectory
from tests.test_chat import _tiny_bpe

CALC = "def add(a, b):\n    return a - b\n"
TEST = "from calc import add\nassert add(2, 2) == 4, add(2, 2)\nprint('1 passed')\n"
TASK = "The tests fail: add(2, 2) is not 4. Fix calc.py."


@pytest.fixture(scope="module")
def tok():
  return HFTokenizer(_tiny_bpe(), eos_token="<|im_end|>", bos_token="<｜begin▁of▁sentence｜>")


@pytest.fixture(params=["qwen2.5", "deepseek_v3"])
def chat(request, tok):
  return make_chat(request.param, tok)


def tc(name, **args):
  return {"function": {"name": name, "arguments": args}}


def say(content=None, *calls):
  return {"role": "assistant", "content": content, "tool_calls": list(calls)}


FIX_SCRIPT = [
    say("Let me find the function.", tc("search", pattern="def add")),
    say(None, tc("read_file", path="calc.py")),
    say("The sign is wrong.", tc("str_replace", path="calc.py", old_str="return a - b",
                                 new_str="return a + b")),
    say(None, tc("run_tests")),
    say("Done.", tc("submit")),
]


def episode(chat, script, config=None, sandbox=None, policy=None, tools=None):
  """Run one episode; returns (result, policy, sandbox files after the episode)."""
  policy = policy or ScriptedPolicy(chat, script, policy_version=3)
  tools = tools or default_tools(test_command="python3 test_calc.py", timeout=5.0)

  async def main():
    if sandbox is not None:
      return await run_episode(policy, sandbox, TASK, tools, chat, config), {}
    async with LocalSandbox(allow_unsafe=True) as sb:
      await sb.write_file("calc.py", CALC)
      await sb.write_file("test_calc.py", TEST)
      result = await run_episode(policy, sb, TASK, tools, chat, config)
      files = [p for p in await sb.list_files() if p.endswith(".py")]
      return result, {p: (await sb.read_file(p)).decode() for p in files}
  result, files = asyncio.run(main())
  return result, policy, files


def observations(messages):
  """Per assistant turn of a transcript, the messages after it up to the next assistant turn."""
  out = []
  for m in messages:
    if m["role"] == "assistant":
      out.append([])
    elif out:
      out[-1].append(m)
  return out


def check_extension(chat, result):
  """Every call's input is the previous call's input + its sampled ids + the continuation of
  the observations in between (except across a ReSum restart, a branch)."""
  obs = observations(result.messages)
  for k in range(1, len(result.calls)):
    prev, cur = result.calls[k - 1], result.calls[k]
    if cur.meta["context"] != prev.meta["context"] or prev.meta["summary"]:
      continue
    assert cur.input_ids == prev.input_ids + prev.output_ids + chat.continuation(
        obs[k - 1], prev.output_ids), k


def test_react_fixes_the_bug(chat):
  tools = default_tools(test_command="python3 test_calc.py", timeout=5.0)
  result, policy, files = episode(chat, FIX_SCRIPT, tools=tools)
  assert result.termination == "submitted" and result.submitted and result.answer is None
  assert files["calc.py"] == CALC.replace("a - b", "a + b")
  assert result.num_turns == len(result.calls) == 5 and result.tool_errors == 0
  # The first input is the system prompt, the tools and the task, as the chat format renders.
  first = chat.render([{"role": "system", "content": ScaffoldConfig().system_prompt},
                       {"role": "user", "content": TASK}], tools).ids
  assert result.calls[0].input_ids == first
  check_extension(chat, result)
  # Recorded exactly what the policy saw and sampled.
  for k, (call, (seen, params)) in enumerate(zip(result.calls, policy.requests)):
    assert call.input_ids == seen
    assert call.output_ids == chat.assistant_ids(FIX_SCRIPT[k])
    assert len(call.output_logprobs) == len(call.output_ids) and call.policy_version == 3
    assert call.meta == {"tool_error": False, "summary": False, "context": 0}
    assert params.stop_token_ids == chat.stop_token_ids
    assert params.max_tokens == min(2048, 32768 - len(seen))
  # The observations the model got.
  obs = observations(result.messages)
  assert obs[0][0]["content"] == "calc.py:1:def add(a, b):"
  assert obs[1][0]["content"] == "     1\tdef add(a, b):\n     2\t    return a - b"
  assert obs[3][0]["content"] == "1 passed\n[exit code 0]"
  assert [m["role"] for m in obs[0]] == ["tool"]
  # The record crosses the queue intact.
  traj = result.to_trajectory(1.0, "calc-1", "calc-1/0", {"phrasing": 2})
  back = Trajectory.from_bytes(traj.to_bytes())
  assert back.calls == result.calls and back.termination == "submitted" and back.reward == 1.0
  assert back.metadata["num_turns"] == 5 and back.metadata["phrasing"] == 2


MISTAKES = [
    '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"\n</tool_call>',      # bad JSON
    '<tool_call>\n{"name": "delete_repo", "arguments": {}}\n</tool_call>',            # unknown
    '<tool_call>\n{"name": "read_file", "arguments": {}}\n</tool_call>',              # missing
    '<tool_call>\n{"name": "read_file", "arguments": {"path": 3}}\n</tool_call>',     # type
    "I think the bug is in calc.py.",                                                 # no call
    say(None, tc("read_file", path="nope.py")),                                       # tool fails
    say(None, tc("bash", command="echo ok"), tc("submit", answer="4"), tc("bash", command="x")),
]


def test_malformed_calls_are_observations_and_the_episode_goes_on(tok):
  chat = make_chat("qwen2.5", tok)
  result, _, _ = episode(chat, MISTAKES)
  assert result.termination == "submitted" and result.answer == "4"
  assert [c.meta["tool_error"] for c in result.calls] == [True] * 6 + [False]
  assert result.tool_errors == 6
  check_extension(chat, result)
  texts = [[m["content"] for m in o] for o in observations(result.messages)]
  assert texts[0][0].startswith("error: tool call 1: invalid JSON")
  assert texts[1][0].startswith("error: unknown tool 'delete_repo'; available tools: bash")
  assert texts[2][0] == "error: tool 'read_file': arguments: missing required 'path'"
  assert "arguments.path must be string, got int" in texts[3][0]
  assert texts[4] == [NO_TOOL_CALL] and observations(result.messages)[4][0]["role"] == "user"
  assert texts[5][0].startswith("error: read_file failed:") and "no such file" in texts[5][0]
  assert texts[6] == ["ok\n[exit code 0]", "submitted"]  # the call after submit never ran


def test_max_turns(tok):
  chat = make_chat("qwen2.5", tok)
  script = [say(None, tc("bash", command=f"echo {i}")) for i in range(5)]
  result, policy, _ = episode(chat, script, ScaffoldConfig(max_turns=3))
  assert result.termination == "max_turns" and len(result.calls) == 3 == len(policy.requests)
  assert not result.submitted
  check_extension(chat, result)


def test_token_budget_context_and_total(tok):
  chat = make_chat("qwen2.5", tok)
  script = [say(None, tc("bash", command="python3 -c \"print('x' * 400)\""))] * 20
  first = len(chat.render([{"role": "system", "content": ScaffoldConfig().system_prompt},
                           {"role": "user", "content": TASK}],
                          default_tools("python3 test_calc.py", timeout=5.0)).ids)
  limit = first + 400
  result, policy, _ = episode(chat, script, ScaffoldConfig(max_context_tokens=limit))
  assert result.termination == "token_budget"
  assert 1 <= len(result.calls) < 20
  for call, (_, params) in zip(result.calls, policy.requests):
    assert params.max_tokens == min(2048, limit - len(call.input_ids))
    assert len(call.input_ids) + len(call.output_ids) <= limit
  check_extension(chat, result)
  # The episode's sampling budget ends it too, and the last call gets only what is left.
  per_turn = len(chat.assistant_ids(script[0]))
  result, policy, _ = episode(chat, script, ScaffoldConfig(max_total_tokens=2 * per_turn + 5))
  assert result.termination == "token_budget" and len(result.calls) == 3
  assert policy.requests[2][1].max_tokens == 5 and len(result.calls[2].output_ids) == 5


def test_reply_cut_by_max_new_tokens_is_closed_and_reported(tok):
  chat = make_chat("qwen2.5", tok)
  long = "I will now explain at length. " * 20
  script = [long, say(None, tc("submit"))]
  assert len(chat.assistant_ids(long)) > 40 > len(chat.assistant_ids(script[1]))
  result, _, _ = episode(chat, script, ScaffoldConfig(max_new_tokens=40))
  assert result.termination == "submitted"
  cut = result.calls[0]
  assert len(cut.output_ids) == 40 and cut.output_ids[-1] != chat.end_id
  rest = result.calls[1].input_ids[len(cut.input_ids) + 40:]
  assert rest[0] == chat.end_id  # the cut turn is closed as context
  assert observations(result.messages)[0][0]["content"] == \
      CUT_OFF.format(n=40) + " " + NO_TOOL_CALL
  check_extension(chat, result)


class SlowPolicy(ScriptedPolicy):
  async def generate(self, input_ids, params):
    if self.requests:
      await asyncio.sleep(30)
    return await super().generate(input_ids, params)


class FakeSandbox(Sandbox):
  """exec: `sleep` sleeps, `die` raises SandboxError, anything else echoes."""

  async def exec(self, cmd, timeout=None, stdin=None, env=None):
    if cmd.startswith("sleep"):
      await asyncio.sleep(30)
    if cmd == "die":
      raise SandboxError("sandbox VM unreachable")
    return ExecResult(0, cmd + "\n", "")

  async def write_file(self, path, content):
    raise SandboxError("sandbox VM unreachable")

  async def read_file(self, path):
    return b"x\n"

  async def list_files(self, path="."):
    return []

  async def close(self):
    pass


def test_timeout_in_policy_or_tool_keeps_finished_calls(tok):
  chat = make_chat("qwen2.5", tok)
  script = [say(None, tc("bash", command="echo 1"))] * 3
  cfg = ScaffoldConfig(timeout_s=0.3)
  result, _, _ = episode(chat, script, cfg, sandbox=FakeSandbox(),
                         policy=SlowPolicy(chat, script))
  assert result.termination == "timeout" and len(result.calls) == 1
  assert 0.3 <= result.elapsed_s < 5
  script = [say(None, tc("bash", command="echo 1")), say(None, tc("bash", command="sleep 9"))]
  result, _, _ = episode(chat, script, cfg, sandbox=FakeSandbox())
  assert result.termination == "timeout" and len(result.calls) == 2


def test_sandbox_failure_ends_with_sandbox_error(tok):
  chat = make_chat("qwen2.5", tok)
  for bad in (tc("bash", command="die"), tc("write_file", path="a", content="b")):
    script = [say(None, tc("bash", command="echo 1")), say(None, bad)]
    result, _, _ = episode(chat, script, sandbox=FakeSandbox())
    assert result.termination == "sandbox_error" and len(result.calls) == 2
    assert result.error == "SandboxError: sandbox VM unreachable"
    assert result.to_trajectory(0.0, "t", "g").metadata["error"] == result.error


def test_tool_output_truncated_to_budget(tok):
  chat = make_chat("qwen2.5", tok)
  script = [say(None, tc("bash", command="python3 -c \"print('ab' * 2000)\"")),
            say(None, tc("submit"))]
  result, _, _ = episode(chat, script, ScaffoldConfig(max_output=100))
  shown = observations(result.messages)[0][0]["content"]
  assert "characters truncated ...]" in shown and len(shown) < 150
  check_extension(chat, result)  # the truncated text is what the next input holds
  result, _, _ = episode(chat, script, ScaffoldConfig(max_output=30, output_unit="tokens"))
  shown = observations(result.messages)[0][0]["content"]
  assert "tokens truncated ...]" in shown
  head = shown.split("\n[...")[0]
  assert len(tok.encode(head)) <= 15


class RoutedPolicy(ScriptedPolicy):
  """A ScriptedPolicy that also reports MoE experts, each position's own index (one layer,
  k = 1), as an engine with `return_expert_ids` reports every position it fed."""

  async def generate(self, input_ids, params):
    gen = await super().generate(input_ids, params)
    n = len(input_ids) + len(gen.output_ids) - 1
    return dataclasses.replace(gen, expert_ids=np.arange(n, dtype=np.int16)[:, None, None])


def test_calls_record_the_experts_of_new_positions_only(tok):
  """A call whose context extends the previous call's sequence records experts from where the
  previous record stopped (a restart after a summary records everything); the trie still gets
  every fed position's experts."""
  chat = make_chat("qwen2.5", tok)
  big = say(None, tc("bash", command="python3 -c \"print('y' * 300)\""))
  script = [big, big, "Summary: printed y's.", say(None, tc("read_file", path="calc.py")),
            say("Done.", tc("submit"))]
  dry, _, _ = episode(chat, script[:2], ScaffoldConfig(max_turns=2))
  cfg = ScaffoldConfig(summary_at_tokens=len(dry.calls[1].input_ids), max_summaries=1)
  result, _, _ = episode(chat, script, cfg, policy=RoutedPolicy(chat, script))
  starts = []
  for c in result.calls:
    n = len(c.input_ids) + len(c.output_ids) - 1
    np.testing.assert_array_equal(c.expert_ids[:, 0, 0], np.arange(c.expert_start, n))
    starts.append(c.expert_start)
  assert starts[0] == 0
  for p, c, start in zip(result.calls, result.calls[1:], starts[1:]):
    seq = p.input_ids + p.output_ids
    if c.meta["context"] == p.meta["context"]:  # an extension: everything p fed is p's
      assert start == len(seq) - 1
    else:  # the restart shares the system prompt and tools only
      shared = next(i for i, (a, b) in enumerate(zip(seq, c.input_ids)) if a != b)
      assert start == shared < len(p.input_ids)
  tree = build_tree([from_trajectory(result.to_trajectory(1.0, "t", "g"))])
  fed = tree.experts[:, 0, 0] >= 0
  np.testing.assert_array_equal(tree.experts[fed, 0, 0], tree.positions[fed])
  assert (~fed).sum() == 2  # the last token of each context's final call was never fed


def test_resum_summarises_and_restarts_as_a_branch(tok):
  chat = make_chat("qwen2.5", tok)
  big = say(None, tc("bash", command="python3 -c \"print('y' * 300)\""))
  summary = "I ran a command that printed y's. Next: fix calc.py."
  script = [big, big, summary, say(None, tc("read_file", path="calc.py")),
            say("Done.", tc("submit"))]
  # Without ReSum: the context after the first turn; the threshold lies just above it.
  dry, _, _ = episode(chat, script[:2], ScaffoldConfig(max_turns=2))
  after_one = len(dry.calls[1].input_ids)
  cfg = ScaffoldConfig(summary_at_tokens=after_one, max_summaries=1)
  result, _, _ = episode(chat, script, cfg)
  assert result.termination == "submitted" and result.num_summaries == 1
  assert result.num_turns == 4 and len(result.calls) == 5
  metas = [(c.meta["summary"], c.meta["context"]) for c in result.calls]
  assert metas == [(False, 0), (False, 0), (True, 0), (False, 1), (False, 1)]
  check_extension(chat, result)
  # The summary call extends the context with the observations and the summary request.
  s = result.calls[2]
  assert s.input_ids[:len(result.calls[1].input_ids)] == result.calls[1].input_ids
  assert s.input_ids[-len(chat.continuation([{"role": "user", "content": cfg.summary_prompt}])):] \
      == chat.continuation([{"role": "user", "content": cfg.summary_prompt}])
  # The next call starts over (a branch): system prompt, tools, task + summary.
  restart = chat.render([{"role": "system", "content": cfg.system_prompt},
                         {"role": "user", "content": cfg.resume_template.format(
                             task=TASK, summary=summary)}],
                        default_tools("python3 test_calc.py", timeout=5.0)).ids
  assert result.calls[3].input_ids == restart
  assert result.calls[3].input_ids[:len(s.input_ids)] != s.input_ids


def test_config_validation_names_the_field():
  for kw, field in [({"max_turns": 0}, "max_turns"), ({"max_new_tokens": -1}, "max_new_tokens"),
                    ({"timeout_s": 0}, "timeout_s"), ({"output_unit": "lines"}, "output_unit"),
                    ({"max_output": 0}, "max_output"),
                    ({"summary_at_tokens": 40000}, "summary_at_tokens"),
                    ({"resume_template": "{task}"}, "resume_template")]:
    with pytest.raises(ValueError, match=f"ScaffoldConfig.{field}="):
      ScaffoldConfig(**kw)


def test_scripted_policy_respects_max_tokens_and_script_end(tok):
  chat = make_chat("qwen2.5", tok)
  policy = ScriptedPolicy(chat, ["hello there", lambda ids: f"saw {len(ids)} ids"])
  g = asyncio.run(policy.generate([1, 2], SamplingParams(max_tokens=2)))
  assert g.finish_reason == "length" and len(g.output_ids) == 2 == len(g.logprobs)
  g = asyncio.run(policy.generate([1, 2, 3], SamplingParams()))
  assert g.finish_reason == "stop" and chat.parse_assistant(g.output_ids).content == "saw 3 ids"
  with pytest.raises(IndexError, match="script has 2 turns"):
    asyncio.run(policy.generate([1], SamplingParams()))


@pytest.fixture(scope="module")
def qwen3_chat(tmp_path_factory):
  """Qwen3's own template, which drops the reasoning of turns before the last user query."""
  from tests.test_chat_templates import QWEN, save_checkpoint, template
  return load_chat(save_checkpoint(tmp_path_factory.mktemp("qwen3"), template("qwen3"), **QWEN))


def test_history_rewriting_template_rerenders_and_trains_each_call_on_its_own(qwen3_chat):
  chat = qwen3_chat
  assert not chat.extends_history
  script = [
      {"role": "assistant", "content": "The bug is in calc.py.",
       "reasoning_content": "The sign looks wrong."},           # no call: a user message follows
      # content "": Qwen3's template needs a string
      {**say("", tc("read_file", path="calc.py")), "reasoning_content": "Read it first."},
      say("Done.", tc("submit")),
  ]
  result, policy, _ = episode(chat, script)
  assert result.termination == "submitted" and len(result.calls) == 3
  dec = chat.tokenizer.decode
  first, second, third = result.calls
  assert "<think>\nThe sign looks wrong.\n</think>" in dec(first.output_ids)
  # The next input is the template's rendering of the context: the first turn is now before
  # the last user query, so its reasoning is gone, its answer kept; it is a branch.
  context = [{"role": "system", "content": ScaffoldConfig().system_prompt},
             {"role": "user", "content": TASK},
             {"role": "assistant", "content": "The bug is in calc.py."},
             {"role": "user", "content": NO_TOOL_CALL}]
  tools = default_tools(test_command="python3 test_calc.py", timeout=5.0)
  assert second.input_ids == chat.render(context, tools).ids
  assert "The sign looks wrong." not in dec(second.input_ids)
  assert "The bug is in calc.py." in dec(second.input_ids)
  full = list(first.input_ids) + list(first.output_ids)
  assert second.input_ids[:len(full)] != full
  # Within one query the template keeps reasoning: that call extends the previous one.
  assert third.input_ids[:len(second.input_ids) + len(second.output_ids)] == \
      list(second.input_ids) + list(second.output_ids)
  assert "Read it first." in dec(third.input_ids)
  # Training: every sampled token, reasoning included, is trained in the call that sampled it.
  # (mask_tool_errors=False: error-masked training would skip the first, call-less turn.)
  tree = build_tree([from_trajectory(result.to_trajectory(1.0, "t", "g"),
                                     mask_tool_errors=False)])
  seq = tree.seqs[0]
  for k, c in enumerate(result.calls):
    own = seq.fields["turn"] == k
    assert tree.tokens[seq.index[own]].tolist() == list(c.output_ids)
    assert (seq.fields["loss_mask"][own] == 1).all()
  think = chat.tokenizer.token_to_id("<think>")
  assert think in tree.tokens[seq.index[seq.fields["turn"] == 0]].tolist()
  # The second call's path in the tree (its input) holds the first answer, not its reasoning.
  node, path = int(seq.index[seq.fields["turn"] == 1][0]), []
  while node >= 0:
    path.append(int(tree.tokens[node]))
    node = int(tree.pred[node])
  assert path[::-1] == list(second.input_ids) + [second.output_ids[0]]


def test_resum_with_a_history_rewriting_template(qwen3_chat):
  chat = qwen3_chat
  big = say("", tc("bash", command="python3 -c \"print('y' * 300)\""))
  script = [big, big, "Summary: printed y's.", say("Done.", tc("submit"))]
  dry, _, _ = episode(chat, script[:2], ScaffoldConfig(max_turns=2))
  cfg = ScaffoldConfig(summary_at_tokens=len(dry.calls[1].input_ids), max_summaries=1)
  result, _, _ = episode(chat, script, cfg)
  assert result.termination == "submitted" and result.num_summaries == 1
  # The summary request is rendered with the whole context, as the template shows it.
  upto = next(i for i, m in enumerate(result.messages) if m.get("summary"))
  context = [{**m, "content": m["content"] or ""} if m["role"] == "assistant" else m
             for m in result.messages[:upto]]
  tools = default_tools(test_command="python3 test_calc.py", timeout=5.0)
  assert context[-1] == {"role": "user", "content": cfg.summary_prompt}
  assert result.calls[2].input_ids == chat.render(context, tools).ids
