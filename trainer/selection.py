"""Test-time selection: pick ONE of the n samples of a task without its hidden tests.

    index = select_best_of_n(trajectories)                   # by the policy's own log-probs
    index = select_majority(task, submissions)               # the largest class of equal ones
    scores = await self_play_scores(task, submissions, make_sandbox)   # Kimi-Dev self-play
    out = select(tasks, results, rewards, "majority_vote", "bwrap", concurrency=8)

Selections (`SELECTIONS`; trainer.evaluate reports the selected sample's verifier reward):
  best_of_n      the sample with the highest mean log-prob of its sampled tokens under the
                 policy (the engine's log-probs are the model's own, temperature 1), among the
                 episodes that called submit (all episodes when none did);
  majority_vote  the largest class of identical submissions: for "swe" tasks the final
                 workspace's changes to non-test files (what the verifier applies; trailing
                 whitespace ignored), for other kinds the normalised answer / program; empty and
                 refused submissions vote only when every sample is one; ties -> lowest index;
  self_play      Kimi-Dev's score (`rl.selection.self_play_scores`) of each candidate's code
                 changes against a test pool run in fresh sandboxes: the repository's VISIBLE
                 tests (the task's test command on the original repository, without the task's
                 hidden test_patch; arguments naming files the repository lacks are dropped) plus
                 the test files the n samples themselves wrote (each sample's reproduction tests
                 are run against every sample's patch: the self-play). Tests are run on the
                 original code and with each distinct patch. "swe" tasks only (others fall back
                 to majority_vote, counted in "fallback").
  Caveat for the generated tasks (envs.taskgen): their tests live in the repository and the
  statement points at them, so the visible pool holds the FAIL_TO_PASS tests and self_play
  there is close to an oracle; on SWE-style tasks with a test_patch it is not.

majority_vote and self_play need each episode's submission, which the trajectory metadata of
`make_react_episode` does not hold: they run the same episodes with
`trainer.rollouts.Rollouts(..., record_submissions=True)` (metadata["submission"]).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import re
from typing import Hashable, Optional, Sequence

import numpy as np

from envs import aio, verifiers
from envs.episode import make_sandbox_factory
from envs.sandbox.base import SandboxError
from envs.tasks import load_repo_files
from rl import selection as selectors

log = logging.getLogger(__name__)

SELECTIONS = ("none", "best_of_n", "majority_vote", "self_play")
SELF_PLAY_DIR = "arbor_selfplay"  # where the samples' own tests go in a self-play run


# ----------------------------------------------------------------------------- selectors


def mean_logprob(trajectory) -> float:
  """Mean log-prob of every token the policy sampled in the episode (NaN if none)."""
  lps = [lp for call in trajectory.calls for lp in call.output_logprobs]
  return float(np.mean(lps)) if lps else float("nan")


def best_of_n_scores(trajectories: Sequence) -> np.ndarray:
  """Scores each sample for best_of_n: its mean sampled-token log-prob.

  Args:
    trajectories: the task's n episodes (Trajectory, or None / the exception when it failed).

  Returns:
    [N] f64 scores; NaN (never selected) for an episode that failed or, when at least one
    episode submitted, for those that did not.
  """
  ok = [t is not None and not isinstance(t, BaseException) for t in trajectories]
  scores = np.array([mean_logprob(t) if o else np.nan for t, o in zip(trajectories, ok)])
  submitted = np.array([o and t.termination == "submitted" for t, o in zip(trajectories, ok)])
  if submitted.any():
    scores = np.where(submitted, scores, np.nan)
  return scores


def select_best_of_n(trajectories: Sequence) -> int:
  """Index of the sample `best_of_n_scores` ranks first (0 when no score exists)."""
  scores = best_of_n_scores(trajectories)
  return 0 if np.all(np.isnan(scores)) else selectors.best_of_n(scores)


def _norm_text(data: bytes) -> bytes:
  """Content as compared between submissions: trailing whitespace and blank lines dropped."""
  return b"\n".join(line.rstrip() for line in data.replace(b"\r\n", b"\n").split(b"\n")).rstrip()


def split_changes(task, changes: dict) -> tuple[dict, dict, Optional[str]]:
  """Splits an swe submission's changes as the verifier sees them.

  Caches and package metadata are dropped, test paths are not code, and a change to a
  configuration / start-up file makes the whole submission refused (the verifier gives it 0).

  Args:
    task: the "swe" task (names its test files).
    changes: {path: bytes | None (deleted)} relative to the repository.

  Returns:
    (code changes, test files, refusal): the two dicts like `changes`; the refusal is the
    first refused change's reason, or None.
  """
  named = verifiers.task_test_files(task)
  code, tests, refused = {}, {}, None
  for path in sorted(changes):
    if verifiers.is_ignored_path(path):
      continue
    reason = verifiers.refused_reason(path)
    if reason is not None:
      refused = refused or reason
    elif verifiers.is_test_path(path, named):
      tests[path] = changes[path]
    else:
      code[path] = changes[path]
  return code, tests, refused


def submission_key(task, submission) -> tuple[str, Hashable]:
  """Classifies a submission and keys it for majority voting (equal keys = the same submission).

  Args:
    task: the task; its kind picks the comparison ("swe": the hashed code changes, normalised
      by trailing whitespace; "exact": the normalised answer; "code": the extracted program).
    submission: metadata["submission"] of the episode, or None (the episode produced none).

  Returns:
    (class, key): class "empty" (no change / no answer), "refused", "failed" or "ok".
  """
  if submission is None:
    return "failed", None
  if task.kind == "swe":
    code, _, refused = split_changes(task, submission)
    if refused:
      return "refused", refused
    if not code:
      return "empty", ()
    return "ok", tuple((p, None if v is None else hashlib.sha256(_norm_text(v)).hexdigest())
                       for p, v in sorted(code.items()))
  text = str(submission)
  if task.kind == "exact":
    key = verifiers.normalize_answer(verifiers.extract_answer(text))
  elif task.kind == "code":
    key = _norm_text(verifiers.extract_code(text).encode()).decode()
  else:
    key = re.sub(r"\s+", " ", text).strip()
  return ("ok", key) if key else ("empty", "")


def select_majority(task, submissions: Sequence) -> int:
  """Index of the first member of the largest class of identical submissions.

  Empty, refused and failed ones (see `submission_key`) vote only when no sample has a real one.

  Args:
    task: the task the samples solve.
    submissions: per sample its metadata["submission"] (None: the episode failed).

  Returns:
    The selected index; 0 when no submission is "ok".
  """
  keys = [submission_key(task, s) for s in submissions]
  eligible = [i for i, (kind, _) in enumerate(keys) if kind == "ok"]
  if not eligible:
    return 0
  return eligible[selectors.majority_vote([keys[i] for i in eligible])]


def _is_target(arg: str) -> bool:
  """Whether a pytest argument names tests (a path / node id, not an option or its value)."""
  return not arg.startswith("-") and ("/" in arg or "::" in arg or arg.endswith(".py"))


def _test_pool(args: Sequence[str], sample_tests: Sequence[dict], original: dict
               ) -> tuple[list[str], dict[str, bytes], list[str], bool]:
  """The self-play test pool: (visible test arguments, the samples' own test files renamed
  under SELF_PLAY_DIR, pytest's arguments, whether the pool names any test to run).

  args: the task's pytest arguments; sample_tests: per sample the test files it changed
  {path: bytes | None}."""

  def exists(a: str) -> bool:
    path = a.split("::", 1)[0].rstrip("/")
    return path in ("", ".") or path in original or any(p.startswith(path + "/")
                                                       for p in original)
  targets = [a for a in args if _is_target(a)]
  visible = [a for a in args if not _is_target(a) or exists(a)]
  generated: dict[str, bytes] = {}
  for j, tests in enumerate(sample_tests):
    for path, data in tests.items():
      base = path.rsplit("/", 1)[-1]
      if data is None or not (base.startswith("test_") and base.endswith(".py")
                              or base.endswith("_test.py")):
        continue
      if original.get(path) == data:
        continue
      generated[f"{SELF_PLAY_DIR}/test_sp{j}_{path.replace('/', '__')}"] = data
  # no target in the command: pytest collects the whole repository, arbor_selfplay/ included
  test_args = visible + (sorted(generated) if any(map(_is_target, visible)) else [])
  runnable = not targets or any(map(_is_target, test_args))
  return visible, generated, test_args, runnable


async def _run_variant(task, files: dict, test_args: list[str], python: str, make_sandbox,
                       limiter: asyncio.Semaphore) -> dict:
  """{test: status} of one self-play run on `files` in a fresh sandbox ({}: no run, so every
  test counts as failing)."""
  async with limiter:
    try:
      box = await make_sandbox(task)
    except SandboxError as e:
      log.warning("%s: self-play sandbox failed: %s", task.instance_id, e)
      return {}
    try:
      for p, v in files.items():
        try:
          await box.write_file(p, v)
        except (OSError, ValueError) as e:  # the candidate's file cannot be written: fails
          log.info("%s: self-play cannot write %r: %s", task.instance_id, p, e)
          return {}
      result = await verifiers.run_pytest(box, test_args, task.timeout, python)
    except SandboxError as e:
      log.warning("%s: self-play run failed: %s", task.instance_id, e)
      return {}
    finally:
      await box.close()
  return dict(result.statuses)


async def self_play_scores(task, submissions: Sequence, make_sandbox, *,
                           concurrency: int = 8, limiter: Optional[asyncio.Semaphore] = None,
                           original: Optional[dict] = None) -> dict:
  """Kimi-Dev self-play scores of an swe task's n submissions (see the module docstring).

  Each run: a fresh sandbox with the repository + the candidate's code changes + every
  sample's test files (under arbor_selfplay/, renamed apart), the trusted pytest runner of
  envs.verifiers; a test that a run does not report counts as failing. One run per distinct
  code change, and one on the original code.

  Args:
    task: an "swe" task.
    submissions: per sample its changes {path: bytes | None} relative to the repository, or
      None (the episode failed).
    make_sandbox: async task -> a started sandbox.
    concurrency: sandboxes at once (or `limiter`'s, shared between tasks).
    limiter: a semaphore shared between tasks.
    original: the repository's files (read from the task when None).

  Returns:
    {"scores": [N] (NaN: failed or refused, never selected), "tests": M, "visible": the
    visible test arguments, "generated": the samples' test files, "runs": distinct runs}.

  Raises:
    ValueError: the task's kind is not "swe", or its tests do not run with pytest.

  References:
    Kimi-Dev: Agentless training as skill prior for SWE-agents (Moonshot AI, 2025).
  """
  if task.kind != "swe":
    raise ValueError(f"self_play_scores: task {task.instance_id!r} has kind={task.kind!r}, "
                     "expected 'swe'")
  if task.test_runner != "pytest":  # generated tests are pytest files
    raise ValueError(f"self_play_scores: task {task.instance_id!r} runs its tests with "
                     f"{task.test_runner!r}; self-play selection needs a pytest task")
  original = load_repo_files(task) if original is None else original
  split, sample_tests = [], []  # per sample: code changes (None: failed or refused), tests
  for sub in submissions:
    code, tests, refused = split_changes(task, sub) if sub is not None else (None, {}, True)
    split.append(None if refused else code)
    sample_tests.append(tests)
  python, args = task.pytest_command()
  visible, generated, test_args, runnable = _test_pool(args, sample_tests, original)
  # one run per distinct code change (and the original)
  variants: dict[Hashable, dict] = {(): {}}
  key_of = []
  for code in split:
    if code is None:
      key_of.append(None)
      continue
    key = tuple((p, None if v is None else hashlib.sha256(v).hexdigest())
                for p, v in sorted(code.items()))
    variants.setdefault(key, code)
    key_of.append(key)
  limiter = limiter or asyncio.Semaphore(max(1, concurrency))

  def files_of(code: dict) -> dict:
    files = dict(original)
    for p, v in code.items():
      if v is None:
        files.pop(p, None)
      else:
        files[p] = v
    return {**files, **generated}

  keys = list(variants)
  outcomes = dict(zip(keys, await asyncio.gather(*(
      _run_variant(task, files_of(variants[k]), test_args, python, make_sandbox, limiter)
      for k in keys)))) if runnable else {k: {} for k in keys}
  tests = sorted({t for o in outcomes.values() for t in o})
  passed = {k: np.array([o.get(t) == "passed" for t in tests], bool) for k, o in outcomes.items()}
  scores = np.full(len(submissions), np.nan)
  ok = [j for j, k in enumerate(key_of) if k is not None]
  if ok and tests:
    patched = np.stack([passed[key_of[j]] for j in ok])
    scores[ok] = selectors.self_play_scores(passed[()], patched)
  elif ok:
    scores[ok] = 0.0
  return {"scores": scores, "tests": len(tests), "visible": visible,
          "generated": sorted(generated), "runs": len(keys)}


# ----------------------------------------------------------------------------- selection


def select(tasks, results, rewards, selection: str, sandbox: str, concurrency: int) -> dict:
  """Per task, the selected sample's index and verifier reward (see the module docstring).

  Args:
    tasks: the tasks [T].
    results: per task its n episodes (Trajectory, or the exception an episode raised).
    rewards: [T, n] the episodes' verifier rewards.
    selection: "best_of_n" | "majority_vote" | "self_play".
    sandbox: the sandbox backend of self-play's test runs.
    concurrency: self-play sandboxes at once, over all tasks.

  Returns:
    {"mode", "index" [T], "reward" [T], ...}: "score" (best_of_n, self_play), "distinct"
    (majority_vote), "tests" and "fallback" (self_play).
  """
  def submission(r):
    return None if isinstance(r, BaseException) or r is None else r.metadata.get("submission")

  index, extra = [], {}
  if selection == "best_of_n":
    index = [select_best_of_n(row) for row in results]
    extra["score"] = [_finite(best_of_n_scores(row)[i]) for row, i in zip(results, index)]
  elif selection == "majority_vote":
    index = [select_majority(t, [submission(r) for r in row]) for t, row in zip(tasks, results)]
    extra["distinct"] = [len({submission_key(t, submission(r)) for r in row})
                         for t, row in zip(tasks, results)]
  else:  # self_play
    make_sandbox = make_sandbox_factory(sandbox, allow_unsafe=sandbox == "local")
    swe = [i for i, t in enumerate(tasks) if t.kind == "swe"]

    async def all_scores():
      limiter = asyncio.Semaphore(max(1, concurrency))  # sandboxes at once, over all tasks
      return await asyncio.gather(*(self_play_scores(
          tasks[i], [submission(r) for r in results[i]], make_sandbox, limiter=limiter)
          for i in swe))
    scored = dict(zip(swe, aio.run(all_scores()))) if swe else {}
    extra.update(tests=[], score=[], fallback=0)
    for i, t in enumerate(tasks):
      if i in scored:
        s = scored[i]["scores"]
        index.append(0 if np.all(np.isnan(s)) else int(np.argmax(np.where(np.isnan(s), -np.inf,
                                                                          s))))
        extra["tests"].append(scored[i]["tests"])
        extra["score"].append(_finite(s[index[-1]]))
      else:
        index.append(select_majority(t, [submission(r) for r in results[i]]))
        extra["tests"].append(0)
        extra["score"].append(None)
        extra["fallback"] += 1
  reward = [float(rewards[i, j]) for i, j in enumerate(index)]
  return {"mode": selection, "index": index, "reward": reward, **extra}


def _finite(x) -> Optional[float]:
  """A float for JSON: NaN / inf -> None."""
  x = float(x)
  return x if math.isfinite(x) else None
