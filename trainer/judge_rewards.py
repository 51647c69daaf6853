"""Generative rewards: an LLM judge grades every RL episode on a rubric (`rl.judge_reward`).

    judge = from_config(config, chat, engine, workdir)     # None when rl.judge_reward.weight = 0
    groups, metrics = judge.rewards(groups, step_tasks)    # reward = verifier + w x judge score
    scores = judge.score([(task_text, response_text), ...])  # [score in [0, 1] or None]
    evaluate_judge(judge, trajectories, tasks)             # offline: agreement with the verifier

The judge is any `envs.policy.Policy`, by `rl.judge_reward.source` (the `SOURCES` registry):
"policy" (the RL engine grades its own episodes), "ckpt:<dir>" (a checkpoint in its own
engine) or an OpenAI-compatible completions URL (`envs.policy.CompletionsPolicy`). It sees the
task's statement (the decoded first prompt when the task is not known, e.g. remote workers) and
the episode's transcript (`envs.verifiers.judge.transcript`), in `judge_prompt`'s form; its
reply is read by `reply_reward` (the weighted mean of score / max over the rubric). An engine
judge's prompt must leave room for its reply in the engine's rows: a longer transcript shows
its tail only (`JudgeReward.max_prompt_tokens`; an http judge's context is not known).

Batching: one step's episodes are asked concurrently (the engine batches them), at most
`concurrency` requests in flight. Caching: a score is keyed by a content hash of (judge,
prompt) (the prompt holds rubric, task and response), kept in an LRU and appended to a JSONL
file read back on resume; identical episodes of a step are asked once. Failures: an
unparseable, failed or timed-out reply is re-asked up to `max_retries` times, then the episode
falls back (`fallback`: "skip" keeps the verifier's reward, "group_mean" adds its group's mean
judge score) and is counted in "judge/failures"; a step never fails for the judge. A self-judge
("policy") is cached per weights version (the engine's): its scores go stale as it trains.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json
import logging
import math
import os
from typing import Any, Callable, Optional, Sequence

import ml_collections
import numpy as np

from envs.policy import CompletionsPolicy, Policy, SamplingParams
from envs.tasks import Task
from envs.trajectory import Trajectory
from envs.verifiers.judge import judge_prompt, parse_rubric, reply_reward, transcript
from trainer import config as config_lib
from trainer import harness
from trainer.rejection import engine_teacher
from trainer.serve import EnginePolicy

log = logging.getLogger(__name__)

PASS = 1.0  # a verifier reward >= PASS is a pass (as trainer.groups' pass_rate)


class ScoreCache:
  """Judge scores by content hash: an LRU of `size` entries, and optionally a JSONL file of
  {"key", "score"} lines (read at start, appended to) so a resumed run does not re-ask.

  Args:
    size: entries kept in memory (0: no cache at all).
    path: the JSONL file ("": memory only); unreadable lines are skipped.
  """

  def __init__(self, size: int, path: str = ""):
    self.size, self.path = size, path if size else ""
    self._scores: collections.OrderedDict[str, float] = collections.OrderedDict()
    if self.path and os.path.isfile(self.path):
      with open(self.path) as f:
        for line in f:
          try:
            row = json.loads(line)
            self._remember(str(row["key"]), float(row["score"]))
          except (ValueError, KeyError, TypeError):
            continue

  def _remember(self, key: str, score: float) -> None:
    self._scores[key] = score
    self._scores.move_to_end(key)
    while len(self._scores) > self.size:
      self._scores.popitem(last=False)

  def get(self, key: str) -> Optional[float]:
    """The cached score of `key`, or None."""
    score = self._scores.get(key)
    if score is not None:
      self._scores.move_to_end(key)
    return score

  def put(self, key: str, score: float) -> None:
    """Caches a score (and appends it to the file)."""
    if not self.size:
      return
    self._remember(key, score)
    if self.path:
      os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
      with open(self.path, "a") as f:
        f.write(json.dumps({"key": key, "score": score}) + "\n")


def cache_key(judge_id: str, prompt: str) -> str:
  """The content hash (sha256 hex) of a judge's identity and its full prompt."""
  return hashlib.sha256(f"{judge_id}\0{prompt}".encode()).hexdigest()


@dataclasses.dataclass
class JudgeReward:
  """An LLM judge scoring episodes on a rubric (see the module docstring).

  Attributes:
    policy: the judge.
    render: prompt text -> the judge's input ids (its chat template applied).
    decode: output ids -> text.
    rubric: the dimensions ({"name", "weight", "description", "max"?}).
    judge_id: the judge's identity in cache keys (its source).
    version: the judge's weights version in cache keys (a self-judge's: the engine's, which
      changes with every policy update), or None (fixed weights).
    weight: w of reward = verifier reward + w x score.
    max_retries: re-asks after a failed reply.
    fallback: "skip" | "group_mean" (config.JUDGE_FALLBACKS).
    concurrency: requests in flight at most (>= 1).
    timeout_s: seconds one reply may take.
    max_chars: the transcript's tail shown to the judge.
    max_prompt_tokens: the judge's input budget (its engine's rows less the reply's tokens),
      or None (unknown: an http judge); a longer prompt shows less of the transcript's head.
    params: the judge's sampling (greedy).
    cache: the score cache.
    close_fn: stops what the judge owns (its own engine), or None.
  """

  policy: Policy
  render: Callable[[str], Sequence[int]]
  decode: Callable[[Sequence[int]], str]
  rubric: tuple
  judge_id: str = "policy"
  version: Optional[Callable[[], int]] = None
  weight: float = 1.0
  max_retries: int = 2
  fallback: str = "skip"
  concurrency: int = 16
  timeout_s: float = 120.0
  max_chars: int = 6000
  max_prompt_tokens: Optional[int] = None
  params: SamplingParams = SamplingParams(max_tokens=256, temperature=0.0)
  cache: ScoreCache = dataclasses.field(default_factory=lambda: ScoreCache(0))
  close_fn: Optional[Callable[[], None]] = None
  counters: dict = dataclasses.field(default_factory=dict)  # of the last `score`

  async def _ask(self, ids: list[int], limit: asyncio.Semaphore) -> Optional[float]:
    """One episode's score: up to 1 + max_retries replies; None when none parses."""
    for attempt in range(1 + self.max_retries):
      self.counters["judge/requests"] += 1
      self.counters["judge/retries"] += attempt > 0
      try:
        async with limit:
          gen = await asyncio.wait_for(self.policy.generate(ids, self.params), self.timeout_s)
      except Exception as e:  # noqa: BLE001 - a failed judge reply never fails the step
        log.warning("judge reply failed (%s: %s)", type(e).__name__, e)
        continue
      score = reply_reward(self.decode(gen.output_ids), self.rubric)
      if score is not None:
        return score
    return None

  def score(self, episodes: Sequence[tuple[str, str]]) -> list[Optional[float]]:
    """Scores episodes concurrently, each (task statement, response text) asked at most once.

    Args:
      episodes: [(task text, response text)].

    Returns:
      Per episode its score in [0, 1], or None when the judge failed; `counters` holds
      "judge/requests", "judge/retries", "judge/cache_hits" and "judge/failures" of this call.
    """
    self.counters = dict.fromkeys(("judge/requests", "judge/retries", "judge/cache_hits",
                                   "judge/failures"), 0)
    graded = [Task(instance_id="judge", kind="judge", problem_statements=(task or "-",),
                   rubric=self.rubric) for task, _ in episodes]
    prompts = [self._prompt(g, response) for g, (_, response) in zip(graded, episodes)]
    judge_id = (self.judge_id if self.version is None
                else f"{self.judge_id}@{self.version()}")
    keys = [cache_key(judge_id, p) for p, _ in prompts]
    known = {k: self.cache.get(k) for k in set(keys)}
    todo = {k: ids for k, (_, ids) in zip(keys, prompts) if known[k] is None}

    async def ask_all() -> list[Optional[float]]:
      limit = asyncio.Semaphore(self.concurrency)
      return await asyncio.gather(*(self._ask(ids, limit) for ids in todo.values()))
    for k, s in zip(todo, asyncio.run(ask_all()) if todo else []):
      known[k] = s
      if s is not None:
        self.cache.put(k, s)
    seen: set[str] = set()
    for k in keys:  # served without a request of its own: cached, or a repeat of this call's
      self.counters["judge/cache_hits"] += k in seen or k not in todo
      seen.add(k)
    self.counters["judge/failures"] = sum(known[k] is None for k in keys)
    return [known[k] for k in keys]

  def _prompt(self, graded: Task, response: str) -> tuple[str, list[int]]:
    """The judge's prompt text and input ids: the transcript's head cut (its tail, where the
    episode ends, kept) until the ids fit `max_prompt_tokens`. A prompt whose task and rubric
    alone overflow stays as it is (the engine refuses it: a counted failure)."""
    prompt = judge_prompt(graded, response)
    ids = list(self.render(prompt))
    for _ in range(8):
      over = len(ids) - self.max_prompt_tokens if self.max_prompt_tokens else 0
      if over <= 0 or not response:
        break
      # the excess at this prompt's characters per token (again while it does not fit)
      response = response[max(1, math.ceil(over * len(prompt) / len(ids))):]
      prompt = judge_prompt(graded, response)
      ids = list(self.render(prompt))
    return prompt, ids

  def episode(self, t: Trajectory, tasks: dict[str, Task]) -> tuple[str, str]:
    """(task text, response text) of an episode: the task's statement, else its decoded first
    prompt (the tail of `max_chars`), and its transcript."""
    task = tasks.get(t.task_id)
    text = (task.problem_statement if task is not None
            else self.decode(list(t.calls[0].input_ids))[-self.max_chars:])
    return text, transcript(t, self.decode, self.max_chars)

  def rewards(self, groups: list[list[Trajectory]], tasks: Sequence[Task] = ()
              ) -> tuple[list[list[Trajectory]], dict]:
    """The groups with the judge's term added, and the step's "judge/*" metrics.

    Args:
      groups: the step's groups (rewards may already hold other sources' terms: the verifier's
        reward is metadata "verifier_reward" when set).
      tasks: the step's tasks (by instance_id = a trajectory's task_id); others are judged by
        their first prompt.

    Returns:
      (`combine` of the groups and their scores, `calibration` of the scores against the
      verifier plus this step's counters).
    """
    by_id = {t.instance_id: t for t in tasks}
    flat = self.score([self.episode(t, by_id) for g in groups for t in g if t.calls])
    it = iter(flat)
    scores = [[next(it) if t.calls else None for t in g] for g in groups]
    out = combine(groups, scores, self.weight, self.fallback)
    judged = [(t.metadata["judge_score"], t.metadata["verifier_reward"] >= PASS)
              for g in out for t in g if t.metadata["judge_score"] is not None]
    metrics = calibration([s for s, _ in judged], [p for _, p in judged])
    return out, {**{f"judge/{k}": v for k, v in metrics.items()}, **self.counters}

  def close(self) -> None:
    """Stops the judge's own engine (a "ckpt:" source)."""
    if self.close_fn is not None:
      self.close_fn()


def combine(groups: list[list[Trajectory]], scores: list[list[Optional[float]]], weight: float,
            fallback: str = "skip") -> list[list[Trajectory]]:
  """reward = verifier reward + weight x judge score, on copies of the trajectories.

  Args:
    groups: the step's groups.
    scores: per trajectory its judge score in [0, 1], or None (the judge failed).
    weight: w.
    fallback: for a None score, "skip" (no judge term) or "group_mean" (the mean score of its
      group's judged episodes; no term when none was judged).

  Returns:
    Copies (same ids) whose metadata adds "judge_score" (None when failed) and keeps
    "verifier_reward" (set here when no other source set it).

  Raises:
    ValueError: an unknown fallback.
  """
  if fallback not in config_lib.JUDGE_FALLBACKS:
    raise ValueError(f"fallback={fallback!r}: expected one of {config_lib.JUDGE_FALLBACKS}")
  out = []
  for g, gs in zip(groups, scores):
    judged = [s for s in gs if s is not None]
    mean = float(np.mean(judged)) if judged and fallback == "group_mean" else 0.0
    new = []
    for t, s in zip(g, gs):
      meta = {**t.metadata, "verifier_reward": float(t.metadata.get("verifier_reward", t.reward)),
              "judge_score": None if s is None else float(s)}
      new.append(dataclasses.replace(t, reward=float(t.reward) + weight * (
          mean if s is None else float(s)), metadata=meta))
    out.append(new)
  return out


def auc(scores: Sequence[float], passed: Sequence[bool]) -> float:
  """The ROC AUC of scores for pass/fail: P(score of a pass > score of a fail), ties 1/2
  (Mann-Whitney U over average ranks); NaN without both a pass and a fail."""
  s, p = np.asarray(scores, np.float64), np.asarray(passed, bool)
  n_pos, n_neg = int(p.sum()), int((~p).sum())
  if not n_pos or not n_neg:
    return float("nan")
  _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
  first = np.cumsum(counts) - counts  # 0-based rank of each distinct value's first copy
  ranks = (first + (counts + 1) / 2.0)[inverse]  # average 1-based ranks
  return float((ranks[p].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def calibration(scores: Sequence[float], passed: Sequence[bool], threshold: float = 0.5
                ) -> dict:
  """Agreement of judge scores with the verifier's pass/fail.

  Args:
    scores: [N] judge scores in [0, 1].
    passed: [N] the verifier's outcomes.
    threshold: a score >= threshold predicts a pass (for "accuracy").

  Returns:
    {"auc", "accuracy", "pearson" (score vs 0/1 outcome), "score_mean", "score_passed",
    "score_failed" (mean scores), "judged" (N)}; NaN where undefined (no episode, one class,
    constant scores).
  """
  s, p = np.asarray(scores, np.float64), np.asarray(passed, bool)
  mean = lambda x: float(x.mean()) if x.size else float("nan")
  pearson = (float(np.corrcoef(s, p.astype(np.float64))[0, 1])
             if s.size > 1 and s.std() > 0 and 0 < p.sum() < p.size else float("nan"))
  return {"auc": auc(s, p), "accuracy": mean((s >= threshold) == p), "pearson": pearson,
          "score_mean": mean(s), "score_passed": mean(s[p]), "score_failed": mean(s[~p]),
          "judged": int(s.size)}


def evaluate_judge(judge: JudgeReward, trajectories: Sequence[Trajectory],
                   tasks: Sequence[Task] = (), threshold: float = 0.5) -> dict:
  """Offline calibration of a judge against the verifier on verified episodes.

  Args:
    judge: the judge.
    trajectories: episodes with their verifier rewards.
    tasks: their tasks (by instance_id); others are judged by their first prompt.
    threshold: the pass threshold of "accuracy".

  Returns:
    `calibration` of the judged episodes, plus "failures" and "cache_hits".
  """
  by_id = {t.instance_id: t for t in tasks}
  scores = judge.score([judge.episode(t, by_id) for t in trajectories])
  pairs = [(s, t.reward >= PASS) for s, t in zip(scores, trajectories) if s is not None]
  out = calibration([s for s, _ in pairs], [p for _, p in pairs], threshold)
  return {**out, "failures": judge.counters["judge/failures"],
          "cache_hits": judge.counters["judge/cache_hits"]}


# The judge's policy by `rl.judge_reward.source` prefix:
# (config, chat, RL engine, source) -> (policy, close function or None).
def _policy_source(config, chat, engine, source):
  del config, chat, source
  return EnginePolicy(engine), None


def _ckpt_source(config, chat, engine, source):
  del engine
  sub = ml_collections.ConfigDict(config.to_dict())
  sub.model.init, sub.model.preset = source, ""
  model = harness.initial_model(sub, config_lib.model_config(sub))
  rl = config.rl
  policy = engine_teacher(model, chat, concurrency=rl.judge_reward.concurrency,
                          max_context_tokens=rl.max_context_tokens + rl.judge_reward.max_tokens,
                          seed=config.seed)
  return policy, policy.engine.stop


def _http_source(config, chat, engine, source):
  del chat, engine
  cfg = config.rl.judge_reward
  return CompletionsPolicy(source, cfg.model, timeout=cfg.timeout_s), None


SOURCES: dict[str, Callable[..., tuple[Policy, Any]]] = {
    "policy": _policy_source, "ckpt:": _ckpt_source, "http://": _http_source,
    "https://": _http_source}


def from_config(config: ml_collections.ConfigDict, chat, engine, workdir: str
                ) -> Optional[JudgeReward]:
  """The run's judge, or None when `rl.judge_reward.weight` is 0.

  Args:
    config: a validated RL config (`rl.judge_reward`).
    chat: the run's chat format: renders the judge's prompt, decodes episodes and replies.
    engine: the RL engine (the "policy" source's judge).
    workdir: the run's workdir (a relative `cache_file` lives there; a remote workdir keeps
      the cache in memory).
  """
  cfg = config.rl.judge_reward
  if not cfg.weight:
    return None
  make = next(fn for prefix, fn in SOURCES.items() if cfg.source.startswith(prefix))
  policy, close_fn = make(config, chat, engine, cfg.source)
  # an engine's rows hold the prompt and the reply (an http judge's context is not known)
  capacity = getattr(getattr(policy, "engine", None), "capacity", None)
  path = os.path.join(workdir, cfg.cache_file) if cfg.cache_file else ""
  if "://" in path:
    log.warning("rl.judge_reward.cache_file=%r: %r is not local; judge scores are cached in "
                "memory only", cfg.cache_file, path)
    path = ""
  return JudgeReward(
      policy=policy, decode=chat.tokenizer.decode, rubric=parse_rubric(cfg.rubric),
      render=lambda text: chat.render([{"role": "user", "content": text}],
                                      add_generation_prompt=True).ids,
      judge_id=cfg.source, weight=float(cfg.weight), max_retries=cfg.max_retries,
      version=(lambda: engine.version) if cfg.source == "policy" else None,
      fallback=cfg.fallback, concurrency=cfg.concurrency, timeout_s=float(cfg.timeout_s),
      max_chars=cfg.max_chars, cache=ScoreCache(cfg.cache_size, path), close_fn=close_fn,
      max_prompt_tokens=None if capacity is None else capacity - cfg.max_tokens,
      params=SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0,
                            stop_token_ids=tuple(chat.stop_token_ids)))
