"""End to end: a scripted (non-model) policy drives the react scaffold with tools in a bwrap
sandbox on a bundled SWE-format instance, and the `tests` verifier rewards the result in a fresh
bwrap sandbox (`envs.episode.make_react_episode` wires the pieces exactly as the rollout worker
does). The fix gets 1; doing nothing, editing the tests, adding a conftest.py that forces
passes, and making the code print fake PASSED lines all get 0."""

import asyncio
import os

import pytest

from envs.chat import make_chat
from envs.chat.tokenizer import HFTokenizer
from envs.episode import make_react_episode, make_sandbox_factory
from envs.scaffold import ScaffoldConfig, ScriptedPolicy
from envs.tasks import load_swe_jsonl
from tests.test_chat import _tiny_bpe

TASKS = os.path.join(os.path.dirname(__file__), "..", "envs", "data", "swe", "tasks.jsonl")
BUG, FIX = "if result and start < result[-1][1]:", "if result and start <= result[-1][1]:"
FAKE_PASS = ("import sys\nfor t in ('test_touching_intervals_are_merged', "
             "'test_total_length_with_touching'):\n"
             "    print(f'tests/test_merge.py::{t} PASSED')\n")
FORCE_PASS = ("import pytest\n@pytest.hookimpl(hookwrapper=True)\n"
              "def pytest_runtest_makereport(item, call):\n    outcome = yield\n"
              "    outcome.get_result().outcome = 'passed'\n")


def tc(name, **args):
  return {"role": "assistant", "content": None,
          "tool_calls": [{"function": {"name": name, "arguments": args}}]}


SCRIPTS = {
    "fix": [tc("search", pattern="def merge"), tc("read_file", path="intervals/merge.py"),
            tc("str_replace", path="intervals/merge.py", old_str=BUG, new_str=FIX),
            tc("run_tests"), tc("submit")],
    "nothing": [tc("submit")],
    "edit_tests": [tc("write_file", path="tests/test_merge.py",
                      content="def test_touching_intervals_are_merged():\n    pass\n\n"
                              "def test_total_length_with_touching():\n    pass\n"),
                   tc("submit")],
    "conftest": [tc("write_file", path="conftest.py", content=FORCE_PASS), tc("submit")],
    "fake_passed": [tc("bash", command=f"printf %s {FAKE_PASS!r} >> intervals/__init__.py"),
                    tc("submit")],
}
EXPECTED = {"fix": 1.0, "nothing": 0.0, "edit_tests": 0.0, "conftest": 0.0, "fake_passed": 0.0}


@pytest.fixture(scope="module")
def chat():
  return make_chat("qwen2.5", HFTokenizer(_tiny_bpe(), eos_token="<|im_end|>"))


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_scripted_policy_through_react_in_bwrap(chat, script):
  (task,) = [t for t in load_swe_jsonl(TASKS) if t.instance_id == "intervals-1"]
  policy = ScriptedPolicy(chat, SCRIPTS[script])
  episode = make_react_episode(policy, chat, make_sandbox_factory("bwrap"),
                               ScaffoldConfig(max_turns=8))
  trajectory = asyncio.run(episode(task, 0, 0, group_id="intervals-1/5", metadata={"draw": 5}))
  assert trajectory.termination == "submitted", trajectory.metadata
  assert (trajectory.task_id, trajectory.group_id) == ("intervals-1", "intervals-1/5")
  assert trajectory.metadata["draw"] == 5
  assert len(trajectory.calls) == len(SCRIPTS[script])
  for prev, call in zip(trajectory.calls, trajectory.calls[1:]):  # sampled ids never re-tokenized
    assert call.input_ids[:len(prev.input_ids) + len(prev.output_ids)] == (
        prev.input_ids + prev.output_ids)
  assert trajectory.reward == EXPECTED[script], trajectory.metadata["verdict"]
