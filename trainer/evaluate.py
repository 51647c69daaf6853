"""Held-out evaluation: pass@k on a task set, with sandboxes and verifiers; test-time selection.

    summary = run(config, workdir, mesh)         # trainer.main mode "eval"
    out = evaluate(model, model_cfg, chat, tasks, samples=4, k=1, temperature=0.8,
                   selection="majority_vote", engine_cfg=engine_config(config),
                   scaffold=DEMO_SCAFFOLD)
    out["pass@k"], out["per_task"], out["selected"]["reward"]

Every episode is a real one (`trainer.rollouts.Rollouts`: the react scaffold in a fresh sandbox
with the task's repository, the task's verifier in another fresh sandbox); reward 1.0 means the
hidden tests pass. n = `samples` episodes per task, c = how many of them score 1.0, and the
task's pass@k is the unbiased estimator of Chen et al. 2021 (`pass_at_k`). Greedy decoding with
samples = 1 is the default pass@1. Episode j of task i samples with `sample_seed(seed, i, j)`
(its prompt phrasing and every call's sampling seed follow from it): an eval is reproducible.

Test-time selection (`selection`) picks ONE of the n samples per task without the hidden tests,
and reports the selected sample's verifier reward ("selected", "pass@1/selected"):
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
                 to majority_vote, counted in "selected"["fallback"]).
  Caveat for the generated tasks (envs.taskgen): their tests live in the repository and the
  statement points at them, so the visible pool holds the FAIL_TO_PASS tests and self_play
  there is close to an oracle; on SWE-style tasks with a test_patch it is not.

majority_vote and self_play need each episode's submission, which the trajectory metadata of
`make_react_episode` does not hold: they run the same episodes through a Rollouts subclass that
overrides its private `_with` hook with `recording_episode` (metadata["submission"]).

An episode that raised (e.g. its sandbox could not be created) counts as a failure (reward 0,
termination "error") and is counted in "errors".

Statistics for reports: `paired_bootstrap` (one seed) and `paired_bootstrap_seeds` (several
seeds): percentile intervals of the difference of mean per-task scores between two checkpoints
on the same tasks.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import json
import logging
import math
import os
import re
import tempfile
import time
from typing import Any, Hashable, Optional, Sequence

import numpy as np

log = logging.getLogger(__name__)

SELECTIONS = ("none", "best_of_n", "majority_vote", "self_play")
SELF_PLAY_DIR = "arbor_selfplay"  # where the samples' own tests go in a self-play run


def _say(message: str) -> None:
  print(f"eval: {message}", flush=True)


# ----------------------------------------------------------------------------- statistics


def pass_at_k(n, c, k) -> np.ndarray:
  """Unbiased pass@k estimate 1 - C(n-c, k) / C(n, k) (Chen et al. 2021), elementwise.

  n: samples per task, c: correct samples, k: the budget (arrays broadcast together, e.g. n, c
  [T] and k a scalar). Numerically stable product form: C(n-c, k)/C(n, k) =
  prod_{i=n-c+1}^{n} (1 - k/i), summed in log space; 1.0 where n - c < k. Returns float64 with
  the broadcast shape. ValueError unless 0 <= c <= n and 1 <= k <= n.
  """
  n, c, k = np.broadcast_arrays(np.asarray(n), np.asarray(c), np.asarray(k))
  if n.size and not (np.issubdtype(n.dtype, np.integer) or np.all(n == np.round(n))):
    raise ValueError("pass_at_k: n must hold integers")
  n, c, k = n.astype(np.int64), c.astype(np.int64), k.astype(np.int64)
  if np.any(c < 0) or np.any(c > n):
    raise ValueError(f"pass_at_k: expected 0 <= c <= n, got n={n.tolist()}, c={c.tolist()}")
  if np.any(k < 1) or np.any(k > n):
    raise ValueError(f"pass_at_k: expected 1 <= k <= n, got n={n.tolist()}, k={k.tolist()}")
  out = np.ones(n.shape, np.float64)
  some = n - c >= k  # otherwise every k-subset holds a correct sample
  if np.any(some):
    nn, cc, kk = n[some], c[some], k[some]
    width = int(cc.max()) if cc.size else 0
    j = np.arange(width)[None, :]
    i = (nn - cc + 1)[:, None] + j               # n-c+1 .. n, masked beyond c terms
    valid = j < cc[:, None]
    terms = np.log1p(-kk[:, None] / np.where(valid, i, np.inf))  # masked: log1p(0) = 0
    out[some] = 0.0 - np.expm1(terms.sum(axis=1))
  return out


def paired_bootstrap(a, b, *, samples: int = 10_000, seed: int = 0, level: float = 0.95
                     ) -> dict:
  """Paired bootstrap of mean(b) - mean(a) over per-task scores of the SAME tasks.

  a, b: [T] per-task scores (e.g. pass@1 of the SFT and of the RL checkpoint). Each of
  `samples` replicates draws T task indices with replacement (`np.random.default_rng(seed)
  .integers(0, T, size=(samples, T))`, one draw for all replicates) and takes mean(b[idx]) -
  mean(a[idx]); the interval is the (1-level)/2 and (1+level)/2 percentiles of the replicates
  (NumPy's default linear interpolation). Returns {mean_a, mean_b, diff = mean_b - mean_a,
  low, high} (floats).
  """
  return paired_bootstrap_seeds([a], [b], samples=samples, seed=seed, level=level)


def paired_bootstrap_seeds(list_a: Sequence, list_b: Sequence, *, samples: int = 10_000,
                           seed: int = 0, level: float = 0.95) -> dict:
  """`paired_bootstrap` over several training seeds: the statistic is the mean over seeds of
  mean(b_s) - mean(a_s); a replicate resamples the tasks within each seed (independently; seed
  s's indices are drawn after those of seeds < s, `integers(0, T_s, size=(samples, T_s))` from
  one `default_rng(seed)`) and averages the per-seed differences. Tasks may differ between
  seeds; a_s and b_s must be paired. Returns {mean_a, mean_b (means over seeds), diff, low,
  high, per_seed: [diff_s], seeds: S}."""
  if len(list_a) != len(list_b) or not list_a:
    raise ValueError(f"paired_bootstrap_seeds: {len(list_a)} a-lists and {len(list_b)} "
                     "b-lists; expected the same number, at least one")
  if not 0.0 < level < 1.0:
    raise ValueError(f"level={level!r}: expected a probability in (0, 1)")
  if samples < 1:
    raise ValueError(f"samples={samples!r}: expected >= 1")
  rng = np.random.default_rng(seed)
  replicates = np.zeros(samples, np.float64)
  per_seed, means_a, means_b = [], [], []
  for s, (a, b) in enumerate(zip(list_a, list_b)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.ndim != 1 or a.shape != b.shape or a.size == 0:
      raise ValueError(f"paired_bootstrap: seed {s}: a {a.shape} and b {b.shape} must be "
                       "equal-length non-empty 1-D arrays (per-task scores of the same tasks)")
    idx = rng.integers(0, a.size, size=(samples, a.size))
    replicates += (b[idx].mean(axis=1) - a[idx].mean(axis=1))
    means_a.append(a.mean())
    means_b.append(b.mean())
    per_seed.append(float(b.mean() - a.mean()))
  replicates /= len(list_a)
  low, high = np.percentile(replicates, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
  return {"mean_a": float(np.mean(means_a)), "mean_b": float(np.mean(means_b)),
          "diff": float(np.mean(per_seed)), "low": float(low), "high": float(high),
          "per_seed": per_seed, "seeds": len(list_a)}


# ----------------------------------------------------------------------------- selection


def sample_seed(seed: int, task_index: int, sample_index: int) -> int:
  """The episode seed of sample j of task i of an eval with `seed`."""
  digest = hashlib.sha256(f"arbor-eval/{seed}/{task_index}/{sample_index}".encode()).digest()
  return int.from_bytes(digest[:4], "little")


def mean_logprob(trajectory) -> float:
  """Mean log-prob of every token the policy sampled in the episode (NaN if none)."""
  lps = [lp for call in trajectory.calls for lp in call.output_logprobs]
  return float(np.mean(lps)) if lps else float("nan")


def best_of_n_scores(trajectories: Sequence) -> np.ndarray:
  """[N] best_of_n scores: mean sampled-token log-prob, NaN (never selected) for an episode
  that failed or, when at least one episode submitted, for those that did not."""
  ok = [t is not None and not isinstance(t, BaseException) for t in trajectories]
  scores = np.array([mean_logprob(t) if o else np.nan for t, o in zip(trajectories, ok)])
  submitted = np.array([o and t.termination == "submitted" for t, o in zip(trajectories, ok)])
  if submitted.any():
    scores = np.where(submitted, scores, np.nan)
  return scores


def select_best_of_n(trajectories: Sequence) -> int:
  """Index of the sample `best_of_n_scores` ranks first (0 when no score exists)."""
  from rl import selection
  scores = best_of_n_scores(trajectories)
  return 0 if np.all(np.isnan(scores)) else selection.best_of_n(scores)


def _norm_text(data: bytes) -> bytes:
  """Content as compared between submissions: trailing whitespace and blank lines dropped."""
  return b"\n".join(line.rstrip() for line in data.replace(b"\r\n", b"\n").split(b"\n")).rstrip()


def split_changes(task, changes: dict) -> tuple[dict, dict, Optional[str]]:
  """An swe submission's changes {path: bytes | None (deleted)} relative to the repository, as
  (code changes, test files, refusal): as the verifier sees them, caches and package metadata
  are dropped, test paths are not code, and a change to a configuration / start-up file makes
  the whole submission refused (the verifier gives it 0)."""
  from envs.verifiers import is_ignored_path, is_test_path, refused_reason, task_test_files
  named = task_test_files(task)
  code, tests, refused = {}, {}, None
  for path in sorted(changes):
    if is_ignored_path(path):
      continue
    reason = refused_reason(path)
    if reason is not None:
      refused = refused or reason
    elif is_test_path(path, named):
      tests[path] = changes[path]
    else:
      code[path] = changes[path]
  return code, tests, refused


def submission_key(task, submission) -> tuple[str, Hashable]:
  """(class, key) of a submission for majority voting: class "empty" (no change / no answer),
  "refused", "failed" (the episode produced none) or "ok"; equal keys = the same submission."""
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
    from envs.verifiers import extract_answer, normalize_answer
    key = normalize_answer(extract_answer(text))
  elif task.kind == "code":
    from envs.verifiers import extract_code
    key = _norm_text(extract_code(text).encode()).decode()
  else:
    key = re.sub(r"\s+", " ", text).strip()
  return ("ok", key) if key else ("empty", "")


def select_majority(task, submissions: Sequence) -> int:
  """Index of the first member of the largest class of identical submissions (see
  `submission_key`); empty, refused and failed ones vote only when no sample has a real one."""
  from rl import selection
  keys = [submission_key(task, s) for s in submissions]
  eligible = [i for i, (kind, _) in enumerate(keys) if kind == "ok"]
  if not eligible:
    return 0
  return eligible[selection.majority_vote([keys[i] for i in eligible])]


async def self_play_scores(task, submissions: Sequence, make_sandbox, *,
                           concurrency: int = 8, limiter: Optional[asyncio.Semaphore] = None,
                           original: Optional[dict] = None) -> dict:
  """Kimi-Dev self-play scores of an swe task's n submissions (see the module docstring).

  submissions: per sample its changes {path: bytes | None} relative to the repository, or None
  (the episode failed). At most `concurrency` sandboxes at once (or `limiter`'s, shared between
  tasks). Returns {"scores": [N] (NaN: failed or refused, never selected),
  "tests": M, "visible": the visible test arguments, "generated": the samples' test files,
  "runs": distinct test runs}. Each run: a fresh sandbox with the repository + the candidate's
  code changes + every sample's test files (under arbor_selfplay/, renamed apart), the trusted
  pytest runner of envs.verifiers; a test that a run does not report counts as failing.
  """
  from envs.sandbox.base import SandboxError
  from envs.tasks import load_repo_files
  from envs.verifiers import run_pytest
  from rl import selection

  if task.kind != "swe":
    raise ValueError(f"self_play_scores: task {task.instance_id!r} has kind={task.kind!r}, "
                     "expected 'swe'")
  original = load_repo_files(task) if original is None else original
  python, args = task.pytest_command()

  def is_target(a: str) -> bool:  # a test path / node id (not an option or an option's value)
    return not a.startswith("-") and ("/" in a or "::" in a or a.endswith(".py"))

  def exists(a: str) -> bool:
    path = a.split("::", 1)[0].rstrip("/")
    return path in ("", ".") or path in original or any(p.startswith(path + "/")
                                                       for p in original)
  targets = [a for a in args if is_target(a)]
  visible = [a for a in args if not is_target(a) or exists(a)]
  generated: dict[str, bytes] = {}
  split = []
  for j, sub in enumerate(submissions):
    if sub is None:
      split.append(None)
      continue
    code, tests, refused = split_changes(task, sub)
    split.append(None if refused else code)
    for path, data in tests.items():
      base = path.rsplit("/", 1)[-1]
      if data is None or not (base.startswith("test_") and base.endswith(".py")
                              or base.endswith("_test.py")):
        continue
      if original.get(path) == data:
        continue
      name = f"{SELF_PLAY_DIR}/test_sp{j}_{path.replace('/', '__')}"
      generated[name] = data
  # no target in the command: pytest collects the whole repository, arbor_selfplay/ included
  test_args = visible + (sorted(generated) if any(map(is_target, visible)) else [])
  runnable = not targets or any(map(is_target, test_args))

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

  async def run(code: dict) -> dict:
    files = dict(original)
    for p, v in code.items():
      if v is None:
        files.pop(p, None)
      else:
        files[p] = v
    files.update(generated)
    async with limiter:
      try:
        box = await make_sandbox(task)
      except SandboxError as e:  # no run: every test counts as failing for this variant
        log.warning("%s: self-play sandbox failed: %s", task.instance_id, e)
        return {}
      try:
        for p, v in files.items():
          try:
            await box.write_file(p, v)
          except (OSError, ValueError) as e:  # the candidate's file cannot be written: fails
            log.info("%s: self-play cannot write %r: %s", task.instance_id, p, e)
            return {}
        result = await run_pytest(box, test_args, task.timeout, python)
      except SandboxError as e:
        log.warning("%s: self-play run failed: %s", task.instance_id, e)
        return {}
      finally:
        await box.close()
    return dict(result.statuses)

  keys = list(variants)
  outcomes = dict(zip(keys, await asyncio.gather(*(run(variants[k]) for k in keys))
                      )) if runnable else {k: {} for k in keys}
  tests = sorted({t for o in outcomes.values() for t in o})
  passed = {k: np.array([o.get(t) == "passed" for t in tests], bool) for k, o in outcomes.items()}
  scores = np.full(len(submissions), np.nan)
  ok = [j for j, k in enumerate(key_of) if k is not None]
  if ok and tests:
    patched = np.stack([passed[key_of[j]] for j in ok])
    scores[ok] = selection.self_play_scores(passed[()], patched)
  elif ok:
    scores[ok] = 0.0
  return {"scores": scores, "tests": len(tests), "visible": visible,
          "generated": sorted(generated), "runs": len(keys)}


# ----------------------------------------------------------------------------- episodes


def recording_episode(policy, chat, make_sandbox, scaffold):
  """`envs.rollout_worker.make_react_episode`, unchanged, except that the trajectory's
  metadata["submission"] keeps what the agent submitted: for "swe" tasks its final workspace's
  changes {path: bytes | None (deleted)} relative to the repository (read from the agent's
  sandbox when the episode closes it, after the verifier ran in its own), else the submit
  answer or the last reply's text. None when it could not be read."""
  from envs.rollout_worker import make_react_episode
  from envs.tasks import load_repo_files
  from envs.verifiers import workspace_files

  originals: dict[str, dict] = {}

  async def episode(task, index: int, seed: int):
    record: dict[str, Any] = {}

    async def make(t):
      box = await make_sandbox(t)
      if "box" not in record and task.kind == "swe":  # the first one is the agent's
        record["box"] = box
        close = box.close

        async def close_after_reading():
          try:
            record["files"] = await workspace_files(box)
          except Exception as e:  # the sandbox died: no submission
            log.warning("%s: cannot read the final workspace: %r", task.instance_id, e)
          await close()
        box.close = close_after_reading
      return box

    trajectory = await make_react_episode(policy, chat, make, scaffold)(task, index, seed)
    if task.kind == "swe":
      submission = None
      if "files" in record:
        if task.instance_id not in originals:
          originals[task.instance_id] = await asyncio.to_thread(load_repo_files, task)
        original, final = originals[task.instance_id], record["files"]
        submission = {p: final.get(p) for p in sorted(set(original) | set(final))
                      if original.get(p) != final.get(p)}
    elif trajectory.metadata.get("answer") is not None:
      submission = trajectory.metadata["answer"]
    else:
      last = [c for c in trajectory.calls if not c.meta.get("summary")][-1:]
      submission = chat.parse_assistant(last[0].output_ids).text if last else ""
    trajectory.metadata["submission"] = submission
    return trajectory
  return episode


def _recording_rollouts_class():
  from trainer.rollouts import Rollouts

  class RecordingRollouts(Rollouts):
    """Rollouts whose episodes keep the agent's submission (`recording_episode`)."""

    def _with(self, scaffold=None):
      scaffold = scaffold or self.scaffold
      cached = getattr(self, "_recording", None)
      if cached is None or cached[0] != scaffold:
        cached = (scaffold, recording_episode(self.policy, self._chat, self._make_sandbox,
                                              scaffold))
        self._recording = cached
      return cached[1]
  return RecordingRollouts


# ----------------------------------------------------------------------------- evaluate


def evaluate(model, model_cfg, chat, tasks: Sequence, *, samples: int = 1, k: int = 1,
             temperature: float = 0.0, selection: str = "none", seed: int = 0, engine_cfg=None,
             scaffold=None, sandbox: str = "bwrap", concurrency: int = 8, engine=None,
             progress: bool = True, name: str = "", keep_trajectories: bool = False,
             sandbox_url: str = "", sandbox_token_file: str = "") -> dict:
  """pass@k of `model` on `tasks` (see the module docstring).

  engine_cfg: the EngineConfig (`trainer.rl.engine_config(config)`; None: a slot per
  concurrent episode and the scaffold's max_context_tokens); scaffold: the
  ScaffoldConfig (its temperature is replaced by `temperature`); engine: an already built
  engine (started and stopped here; `model` is then unused). Returns {"pass@k" (also under
  f"pass@{k}"), "k", "samples", "pass@1" (mean c/n), "per_task" [T] pass@k, "per_task_rewards" [T][n], "task_ids",
  "terminations" {reason: count}, "errors", "episodes", "time_s", "selection"} and, when
  selection != "none", "selected" {"index" [T], "reward" [T], ...} and "pass@1/selected";
  with keep_trajectories, "trajectories" [T][n] (Trajectory or the exception; not JSON; with
  metadata["submission"] when the selection records submissions). Progress: a line per ~10%.
  """
  from envs.rollout_worker import task_id_of
  from trainer.rollouts import Rollouts, scaffold_config

  if selection not in SELECTIONS:
    raise ValueError(f"selection={selection!r}: expected one of {SELECTIONS}")
  if not (isinstance(samples, int) and isinstance(k, int) and 1 <= k <= samples):
    raise ValueError(f"samples={samples!r}, k={k!r}: expected integers 1 <= k <= samples")
  if not tasks:
    raise ValueError("tasks: nothing to evaluate")
  if scaffold is None:
    from trainer.demo_data import DEMO_SCAFFOLD
    scaffold = DEMO_SCAFFOLD
  scaffold = scaffold_config(scaffold, temperature=float(temperature))
  if engine is None:
    from models.engine import Engine, EngineConfig
    vocab = getattr(chat.tokenizer, "vocab_size", None)
    if vocab is not None and model_cfg.vocab_size < vocab:
      raise ValueError(f"model vocab_size={model_cfg.vocab_size} < the tokenizer's {vocab}")
    if engine_cfg is None:  # a slot per concurrent episode, rows for the scaffold's context
      engine_cfg = EngineConfig(slots=concurrency, prefix_cache_rows=concurrency,
                                max_seq_len=-(-scaffold.max_context_tokens // 128) * 128)
    engine = Engine(model, engine_cfg, detokenize=chat.tokenizer.decode)
  record = selection in ("majority_vote", "self_play")
  cls = _recording_rollouts_class() if record else Rollouts
  start = time.monotonic()
  rollouts = cls(engine, chat, scaffold, sandbox=sandbox, concurrency=concurrency,
                 sandbox_url=sandbox_url, sandbox_token_file=sandbox_token_file)
  runs = [(i, j) for i in range(len(tasks)) for j in range(samples)]
  results: list[list[Any]] = [[None] * samples for _ in tasks]
  label = f"{name}: " if name else ""
  try:
    futures = {rollouts.episodes([(tasks[i], sample_seed(seed, i, j))]): (i, j)
               for i, j in runs}
    done, reported = 0, 0
    for future in concurrent.futures.as_completed(futures):
      i, j = futures[future]
      (results[i][j],) = future.result()
      done += 1
      if progress and (10 * done // len(runs) > reported or done == len(runs)):
        reported = 10 * done // len(runs)  # a line per tenth of the episodes
        solved = sum(getattr(r, "reward", 0.0) >= 1.0 for row in results for r in row)
        _say(f"{label}{done}/{len(runs)} episodes ({100 * done / len(runs):.0f}%), "
             f"{solved} solved, {time.monotonic() - start:.0f}s")
  finally:
    rollouts.close()

  rewards = np.zeros((len(tasks), samples), np.float64)
  terminations: collections.Counter = collections.Counter()
  errors = 0
  for i, row in enumerate(results):
    for j, r in enumerate(row):
      if isinstance(r, BaseException) or r is None:
        errors += 1
        terminations["error"] += 1
        log.warning("episode %d of task %s failed: %r", j, task_id_of(tasks[i]), r)
        continue
      rewards[i, j] = float(r.reward)
      terminations[r.termination] += 1
  correct = (rewards >= 1.0).sum(axis=1)
  per_task = pass_at_k(np.full(len(tasks), samples), correct, k)
  out: dict[str, Any] = {
      "pass@k": float(per_task.mean()), "k": k, "samples": samples,
      "pass@1": float((correct / samples).mean()), f"pass@{k}": float(per_task.mean()),
      "per_task": per_task.tolist(),
      "per_task_rewards": rewards.tolist(), "task_ids": [task_id_of(t) for t in tasks],
      "terminations": dict(terminations), "errors": errors, "episodes": len(runs),
      "selection": selection, "temperature": float(temperature), "seed": seed}

  if selection != "none":
    out["selected"] = _select(tasks, results, rewards, selection, sandbox, concurrency)
    out["pass@1/selected"] = float(np.mean(out["selected"]["reward"]))
  if keep_trajectories:
    out["trajectories"] = results
  out["time_s"] = time.monotonic() - start
  return out


def _select(tasks, results, rewards, selection: str, sandbox: str, concurrency: int) -> dict:
  """Per task, the selected sample's index and verifier reward (see the module docstring)."""
  from envs.rollout_worker import make_sandbox_factory

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
    scored = dict(zip(swe, asyncio.run(all_scores()))) if swe else {}
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


# ----------------------------------------------------------------------------- mode "eval"


def _tokenizer_for(config, sub, workdir: str) -> str:
  """The checkpoint's own tokenizer (its hf_extra/ or tokenizer/ dir) unless tokenizer.path is
  set; else the run's (`config_lib.tokenizer_source`)."""
  from trainer import config as config_lib
  if not config.tokenizer.path:
    try:
      own = _copy_config(sub)
      own.tokenizer.train_vocab_size = 0
      return config_lib.tokenizer_source(own, workdir)
    except config_lib.ConfigError:
      pass
  return config_lib.tokenizer_source(config, workdir)


def _copy_config(config):
  import ml_collections
  return ml_collections.ConfigDict(config.to_dict())


def run(config, workdir: str, mesh=None) -> dict:
  """Mode "eval": every checkpoint of `config.eval.checkpoints` ("ckpt:<dir>"; () = this
  workdir's own latest checkpoint) on the held-out tasks (`trainer.rl.held_out_tasks`, written
  under <workdir>/eval_tasks), with the RL loop's engine, scaffold limits, sandbox and
  concurrency and the eval section's k / samples / selection / temperature. Writes
  <workdir>/eval/results.json and returns {"results": its path, "checkpoints": {ckpt:
  {"pass@k", "pass@1", "pass@1/selected"?}}}. Weights load unsharded (`trainer.sft
  .initial_model`); `mesh` is unused."""
  from etils import epath

  from envs.chat import load_tokenizer, make_chat
  from trainer import config as config_lib
  from trainer import sft
  from trainer.demo_data import DEMO_SCAFFOLD
  from trainer.rl import engine_config, held_out_tasks
  from trainer.rollouts import scaffold_config

  ev, rl_cfg = config.eval, config.rl
  remote = config_lib.is_remote(workdir)
  task_dir = tempfile.mkdtemp(prefix="arbor-eval-tasks-") if remote else os.path.join(
      workdir, "eval_tasks")
  tasks = held_out_tasks(config, task_dir)
  checkpoints = list(ev.checkpoints) or [f"ckpt:{workdir}"]
  scaffold = scaffold_config(
      DEMO_SCAFFOLD, max_turns=rl_cfg.max_turns, max_new_tokens=rl_cfg.max_new_tokens,
      max_context_tokens=rl_cfg.max_context_tokens, top_p=rl_cfg.top_p, top_k=rl_cfg.top_k)
  _say(f"{len(tasks)} tasks x {ev.samples} samples, pass@{ev.k}, selection {ev.selection}, "
       f"temperature {ev.temperature:g}; {len(checkpoints)} checkpoint(s)")
  out: dict[str, Any] = {"tasks": len(tasks), "k": ev.k, "samples": ev.samples,
                         "selection": ev.selection, "temperature": float(ev.temperature),
                         "seed": config.seed, "checkpoints": {}}
  summary: dict[str, Any] = {}
  results_dir = epath.Path(workdir) / "eval"
  results_dir.mkdir(parents=True, exist_ok=True)
  path = results_dir / "results.json"
  for ckpt in checkpoints:
    sub = _copy_config(config)
    sub.model.init, sub.model.preset = ckpt, ""
    model_cfg = config_lib.model_config(sub)
    model = sft.initial_model(sub, model_cfg)
    chat = make_chat(config.tokenizer.chat_format,
                     load_tokenizer(_tokenizer_for(config, sub, workdir)))
    result = evaluate(model, model_cfg, chat, tasks, samples=ev.samples, k=ev.k,
                      temperature=ev.temperature, selection=ev.selection, seed=config.seed,
                      engine_cfg=engine_config(config), scaffold=scaffold,
                      sandbox=rl_cfg.sandbox, concurrency=rl_cfg.concurrency, name=ckpt,
                      sandbox_url=rl_cfg.sandbox_url,
                      sandbox_token_file=rl_cfg.sandbox_token_file)
    out["checkpoints"][ckpt] = result
    line = {"pass@k": result["pass@k"], "pass@1": result["pass@1"]}
    if "pass@1/selected" in result:
      line["pass@1/selected"] = result["pass@1/selected"]
    summary[ckpt] = line
    _say(f"{ckpt}: pass@{ev.k} {result['pass@k']:.3f}, pass@1 {result['pass@1']:.3f}"
         + (f", {ev.selection} {result['pass@1/selected']:.3f}" if "pass@1/selected" in result
            else "") + f" ({len(tasks)} tasks, {result['errors']} errors, "
         f"{result['time_s']:.0f}s)")
    path.write_text(json.dumps(out, indent=1))  # after each checkpoint: partial results stay
  _say(f"results in {path}")
  return {"results": str(path), "checkpoints": summary}
