"""The `judge` verifier of "judge" tasks: a policy scores the response on the task's weighted
rubric. The same prompt and parser grade any episode for a generative reward
(`trainer.judge_rewards`): `parse_rubric` reads a rubric written as text, `transcript` an
episode's work as text, `reply_reward` a reply's score or None when it is unparseable."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, Callable, Mapping, Optional, Sequence

from envs.policy import Policy, SamplingParams
from envs.tasks import Task
from envs.trajectory import Trajectory
from envs.verifiers.base import Verdict


JUDGE_PROMPT = """You are a strict grader. Score the response to the task below.

## Task
{task}

## Response
{response}

## Rubric
{dimensions}

Reply with one line per dimension, in this form and nothing else:
{form}"""


def judge_prompt(task: Task, response: str) -> str:
  """The grading prompt for a "judge" task (rendered to tokens by the caller).

  Args:
    task: the "judge" task (its statement and rubric).
    response: the response to grade.

  Returns:
    The prompt text.
  """
  dims = "\n".join(f"- {d['name']} (0-{d.get('max', 10):g}): {d.get('description', '')}".rstrip()
                   for d in task.rubric)
  form = "\n".join(f"{d['name']}: <score>" for d in task.rubric)
  return JUDGE_PROMPT.format(task=task.problem_statement, response=response, dimensions=dims,
                             form=form)


def _name_pattern(name: str) -> str:
  """Regex for a dimension name: case-insensitive words joined by spaces, _ or -."""
  return r"[\s_\-]+".join(re.escape(w) for w in re.split(r"[\s_\-]+", name.strip()))


def _key(name: str) -> str:
  return re.sub(r"[\s_\-]+", " ", name.strip().lower())


def parse_scores(text: str, rubric: Sequence[Mapping[str, Any]]) -> dict[str, Optional[float]]:
  """The scores a judge's reply gives each rubric dimension.

  Accepts a JSON object ({"correctness": 8}), or lines such as "Correctness: 8",
  "**correctness** (0-10) = 8/10", "correctness - 4 out of 5" (a denominator rescales to the
  dimension's max); the last mention wins; scores are clamped to [0, max].

  Args:
    text: the judge's reply.
    rubric: the dimensions ({"name", "max"?, ...}).

  Returns:
    {dimension name: score in [0, max], or None when the reply gives none}.
  """
  found: dict[str, Optional[float]] = {d["name"]: None for d in rubric}
  by_key = {_key(d["name"]): d for d in rubric}
  for m in re.finditer(r"\{[^{}]*\}", text):  # JSON objects, last one wins per dimension
    try:
      obj = json.loads(m.group(0))
    except json.JSONDecodeError:
      continue
    for k, v in obj.items() if isinstance(obj, dict) else ():
      d = by_key.get(_key(str(k)))
      if d is not None and isinstance(v, (int, float)) and not isinstance(v, bool):
        found[d["name"]] = float(v)
  number = r"(-?\d+(?:\.\d+)?)"
  for d in rubric:
    pattern = (rf"(?i){_name_pattern(d['name'])}[\s*_]*(?:\([^)\n]*\)|\[[^\]\n]*\])?[\s*_]*"
               rf"(?:[:=\-\u2013\u2014]|\bis\b)?[\s*_]*{number}(?:\s*(?:/|out of)\s*{number})?")
    matches = list(re.finditer(pattern, text))
    if matches:
      m = matches[-1]
      score = float(m.group(1))
      if m.group(2) is not None and float(m.group(2)) > 0:
        score = score / float(m.group(2)) * d.get("max", 10)
      found[d["name"]] = score
  return {name: None if s is None else min(max(s, 0.0), float(next(
      d.get("max", 10) for d in rubric if d["name"] == name))) for name, s in found.items()}


def rubric_reward(scores: Mapping[str, Optional[float]],
                  rubric: Sequence[Mapping[str, Any]]) -> float:
  """The weighted mean of score/max over the dimensions; a missing score counts as 0.

  Args:
    scores: {dimension name: score or None}.
    rubric: the dimensions ({"name", "weight"?, "max"?}).

  Returns:
    A reward in [0, 1].
  """
  total = sum(float(d.get("weight", 1.0)) for d in rubric)
  got = sum(float(d.get("weight", 1.0)) * (scores.get(d["name"]) or 0.0) / float(d.get("max", 10))
            for d in rubric)
  return got / total


def reply_reward(text: str, rubric: Sequence[Mapping[str, Any]]) -> Optional[float]:
  """`rubric_reward` of a reply that scores every dimension.

  Args:
    text: the judge's reply.
    rubric: the dimensions.

  Returns:
    A reward in [0, 1], or None when the reply gives some dimension no score (unparseable).
  """
  scores = parse_scores(text, rubric)
  if any(s is None for s in scores.values()):
    return None
  return rubric_reward(scores, rubric)


def parse_rubric(entries: Sequence[str]) -> tuple[dict, ...]:
  """A rubric written as text, one "name:weight:description" per dimension (scored 0-10).

  Args:
    entries: e.g. ("correctness:2:the change does what the task asks", "minimal_edit:1:...").

  Returns:
    The dimensions ({"name", "weight", "description"}), as `Task.rubric` holds them.

  Raises:
    ValueError: no entry, an entry without a name, a weight that is not a positive number, or
      a name given twice.
  """
  dims = []
  for entry in entries:
    name, _, rest = str(entry).partition(":")
    weight, _, description = rest.partition(":")
    try:
      w = float(weight)
    except ValueError:
      w = float("nan")
    if not name.strip() or not w > 0 or w == float("inf"):
      raise ValueError(f"rubric entry {entry!r}: expected 'name:weight:description' with a "
                       "non-empty name and a positive weight")
    dims.append({"name": name.strip(), "weight": w, "description": description.strip()})
  names = [_key(d["name"]) for d in dims]
  if not dims or len(set(names)) != len(names):
    raise ValueError(f"rubric {tuple(entries)!r}: expected at least one dimension, each name "
                     "once")
  return tuple(dims)


def transcript(trajectory: Trajectory, decode: Callable[[Sequence[int]], str],
               max_chars: int = 6000) -> str:
  """An episode's work as text: what its last call's context and output add to its first
  prompt (assistant turns and tool outputs), decoded, its last `max_chars` characters.

  Args:
    trajectory: the episode (>= 1 call).
    decode: token ids -> text.
    max_chars: the tail kept.

  Returns:
    The text; a last call that does not extend the first prompt (a summarised context) is
    shown whole.
  """
  first, last = trajectory.calls[0], trajectory.calls[-1]
  ids = list(last.input_ids)
  start = len(first.input_ids) if ids[:len(first.input_ids)] == list(first.input_ids) else 0
  return decode(ids[start:] + list(last.output_ids))[-max_chars:]


async def verify_judge(task: Task, response: str, policy: Policy,
                       render: Callable[[str], Sequence[int]],
                       decode: Callable[[Sequence[int]], str], *,
                       params: SamplingParams = SamplingParams(max_tokens=256, temperature=0.0),
                       samples: int = 1) -> Verdict:
  """Has a policy grade a response on the task's rubric.

  A reply that names no dimension scores 0 for it (listed under details["missing"]).

  Args:
    task: the "judge" task.
    response: the response to grade.
    policy: the judge.
    render: prompt text -> input ids (the caller applies its chat template).
    decode: output ids -> text.
    params: the judge's sampling.
    samples: judge replies to average.

  Returns:
    Reward = mean over the replies of the weighted, normalised rubric score; details hold each
    reply's scores.

  Raises:
    ValueError: the task is not a "judge" task, or samples < 1.
  """
  if task.kind != "judge":
    raise ValueError(f"verify_judge: task {task.instance_id!r} has kind={task.kind!r}, "
                     "expected 'judge'")
  if samples < 1:
    raise ValueError(f"samples={samples!r}: expected >= 1")
  ids = list(render(judge_prompt(task, response)))
  replies = await asyncio.gather(*(policy.generate(ids, params) for _ in range(samples)))
  rewards, per_sample, missing = [], [], set()
  for gen in replies:
    text = decode(gen.output_ids)
    scores = parse_scores(text, task.rubric)
    missing.update(n for n, s in scores.items() if s is None)
    rewards.append(rubric_reward(scores, task.rubric))
    per_sample.append({"scores": scores, "reply": text[:1000]})
  details: dict[str, Any] = {"samples": per_sample, "missing": sorted(missing)}
  return Verdict(sum(rewards) / len(rewards), details)
