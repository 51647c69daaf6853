"""The verdict cache: identical submissions of a task share one test run, with the verdict an
uncached run gives (real episodes and verifications in bwrap), and nothing else is shared."""

import asyncio
import dataclasses

import pytest

from envs.episode import make_react_episode, make_sandbox_factory
from envs.scaffold import ScaffoldConfig, ScriptedPolicy
from envs.tasks import Task, load_repo_files, reference_files
from envs.verifiers import Verdict
from envs.verifiers.cache import VerdictCache, submission_key
from trainer.groups import episode_stats
from tests.test_verifiers import MERGE, chat, tc  # noqa: F401  (chat is a fixture)

TASK = Task(instance_id="t", kind="swe", problem_statements=("fix it",), repo_path="/r",
            test_command="python3 -m pytest -q tests/test_a.py",
            fail_to_pass=("tests/test_a.py::f",))
FILES = {"a.py": b"x = 1\n", "tests/test_a.py": b"def f():\n  pass\n"}


def counting(reward=1.0, delay=0.01, error=None):
  """A grading function that counts its calls."""
  calls = []

  async def run():
    calls.append(1)
    await asyncio.sleep(delay)
    if error is not None:
      raise error
    return Verdict(reward, {"log": "ok", "per_test": {"f": "PASSED"}})
  return run, calls


def test_key_names_every_input():
  key = submission_key(TASK, FILES, False)
  assert key == submission_key(TASK, dict(reversed(list(FILES.items()))), False)
  others = [submission_key(TASK, {**FILES, "a.py": b"x = 2\n"}, False),
            submission_key(TASK, {**FILES, "b.py": b""}, False),
            submission_key(TASK, {"a.py": FILES["a.py"]}, False),
            submission_key(TASK, {"b.py": FILES["a.py"], "tests/test_a.py": FILES[
                "tests/test_a.py"]}, False),
            submission_key(TASK, FILES, True),
            submission_key(dataclasses.replace(TASK, test_command="python3 -m pytest -x"), FILES,
                           False),
            submission_key(dataclasses.replace(TASK, instance_id="u"), FILES, False),
            submission_key(dataclasses.replace(TASK, pass_to_pass=("tests/test_a.py::g",)), FILES,
                           False),
            submission_key(dataclasses.replace(TASK, test_patch="--- a\n"), FILES, False),
            submission_key(TASK, "x = 1\n", False)]
  assert len({key, *others}) == len(others) + 1
  # the length-prefixed parts cannot be re-split into another submission
  assert (submission_key(TASK, {"ab": b"c"}, False) != submission_key(TASK, {"a": b"bc"}, False))
  with pytest.raises(TypeError, match=r"submission\['a.py'\]"):
    submission_key(TASK, {"a.py": 1}, False)


def test_identical_submissions_run_once_concurrently_and_later():
  cache = VerdictCache()
  run, calls = counting()

  async def main():
    first = await asyncio.gather(*(cache.verdict(TASK, dict(FILES), False, run) for _ in range(8)))
    later = await cache.verdict(TASK, dict(FILES), False, run)
    other = await cache.verdict(TASK, {**FILES, "a.py": b"x = 3\n"}, False, run)
    return first, later, other
  first, later, other = asyncio.run(main())
  assert len(calls) == 2
  assert all(v.reward == 1.0 for v in first + [later, other])
  assert sum("shared" in v.details for v in first) == 7 and later.details["shared"] is True
  assert "shared" not in other.details
  first[0].details["per_test"]["f"] = "FAILED"  # each caller owns its details
  assert first[1].details["per_test"]["f"] == "PASSED" and later.details["per_test"] == {
      "f": "PASSED"}
  assert cache.stats() == {"hits": 8, "misses": 2, "entries": 2}


def test_failures_are_not_stored_and_reach_every_waiter():
  cache = VerdictCache()
  run, calls = counting(error=OSError("sandbox died"))

  async def main():
    return await asyncio.gather(*(cache.verdict(TASK, FILES, False, run) for _ in range(3)),
                                return_exceptions=True)
  results = asyncio.run(main())
  assert len(calls) == 1 and all(isinstance(r, OSError) for r in results)
  good, good_calls = counting()
  assert asyncio.run(cache.verdict(TASK, FILES, False, good)).reward == 1.0
  assert len(good_calls) == 1


def test_a_cancelled_run_leaves_the_waiters_to_run_it():
  cache = VerdictCache()
  slow, slow_calls = counting(delay=10)
  fast, fast_calls = counting(reward=0.0)

  async def main():
    runner = asyncio.ensure_future(cache.verdict(TASK, FILES, False, slow))
    await asyncio.sleep(0)
    waiters = [asyncio.ensure_future(cache.verdict(TASK, FILES, False, fast)) for _ in range(2)]
    await asyncio.sleep(0.01)
    runner.cancel()
    return await asyncio.gather(*waiters), runner
  (a, b), runner = asyncio.run(main())
  assert runner.cancelled() and len(slow_calls) == 1 and len(fast_calls) == 1
  assert a.reward == b.reward == 0.0


def test_bounded_and_only_for_test_graded_kinds():
  cache = VerdictCache(max_entries=2)
  run, calls = counting()

  async def main():
    for content in (b"1", b"2", b"1", b"3", b"2"):  # 2 is dropped when 3 arrives
      await cache.verdict(TASK, {"a.py": content}, False, run)
    exact = Task(instance_id="q", kind="exact", problem_statements=("6 x 7?",), answers=("42",))
    for _ in range(2):
      await cache.verdict(exact, "42", False, run)
  asyncio.run(main())
  assert len(calls) == 4 + 2
  with pytest.raises(ValueError, match="max_entries=0"):
    VerdictCache(max_entries=0)


def test_episodes_share_the_runs_of_identical_workspaces(chat):  # noqa: F811
  """A group of real episodes in bwrap: 3 submit the repository unchanged, 2 write the gold
  fix, 1 breaks the file. With the cache the verifier runs 3 times (one per distinct
  workspace), and every reward and per-test verdict is the one of the uncached episodes."""
  original = load_repo_files(MERGE)
  gold = [tc("write_file", path=p, content=d.decode())
          for p, d in reference_files(MERGE).items() if original.get(p) != d]
  path = sorted(p for p in original if p.endswith(".py") and "test" not in p)[0]
  scripts = ([[tc("submit")]] * 3 + [gold + [tc("submit")]] * 2
             + [[tc("write_file", path=path, content="raise SystemExit(3)\n"), tc("submit")]])
  factory = make_sandbox_factory("bwrap")
  config = ScaffoldConfig(max_turns=4, max_new_tokens=4096)

  def group(cache):
    made = []

    async def make(task):
      made.append(1)
      return await factory(task)

    async def main():
      return await asyncio.gather(*(
          make_react_episode(ScriptedPolicy(chat, s), chat, make, config, verdict_cache=cache)(
              MERGE, i, i) for i, s in enumerate(scripts)))
    return asyncio.run(main()), len(made)
  cache = VerdictCache()
  cached, made_cached = group(cache)
  plain, made_plain = group(None)
  assert made_plain == 2 * len(scripts) and made_cached == len(scripts) + 3
  assert cache.stats() == {"hits": 3, "misses": 3, "entries": 3}
  assert [t.reward for t in plain] == [t.reward for t in cached] == [0, 0, 0, 1, 1, 0]
  for a, b in zip(plain, cached):
    va, vb = a.metadata["verdict"], dict(b.metadata["verdict"])
    vb.pop("shared", None)
    assert {k: va.get(k) for k in ("fail_to_pass", "pass_to_pass", "solved", "reason")} == {
        k: vb.get(k) for k in ("fail_to_pass", "pass_to_pass", "solved", "reason")}
  assert episode_stats([cached])["verdicts_shared"] == pytest.approx(3 / 6)
  assert episode_stats([plain])["verdicts_shared"] == 0.0
