"""The `exact` verifier of "exact" tasks: the response's final answer against the accepted
answers, after normalisation."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

from envs.tasks import Task
from envs.verifiers.base import Verdict


def extract_answer(response: str) -> str:
  """The final answer in a response.

  It is the last \\boxed{...}, else the last "answer: X" line, else the whole (stripped)
  response.

  Args:
    response: the agent's text.

  Returns:
    The answer text.
  """
  boxed = []
  for m in re.finditer(r"\\boxed\{", response):
    depth, i = 1, m.end()
    while i < len(response) and depth:
      depth += {"{": 1, "}": -1}.get(response[i], 0)
      i += 1
    if depth == 0:
      boxed.append(response[m.end():i - 1])
  if boxed:
    return boxed[-1]
  lines = re.findall(r"(?im)\banswer\s*(?:is)?\s*[:=]\s*(.+?)\s*$", response)
  return lines[-1] if lines else response.strip()


def normalize_answer(text: str) -> str:
  """An answer as compared.

  Lower-case, single spaces, no surrounding $ / quotes / final period, no \\text{}, no 1,000
  separators.

  Args:
    text: an answer.

  Returns:
    The normalised answer.
  """
  s = text.strip()
  s = re.sub(r"^\$+|\$+$", "", s).strip()
  s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
  s = s.strip("`\"' ").rstrip(".").strip()
  s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)
  return re.sub(r"\s+", " ", s).lower()


def _number(s: str) -> Optional[Fraction]:
  try:
    return Fraction(s.replace(" ", ""))
  except (ValueError, ZeroDivisionError):
    return None


def verify_exact(task: Task, response: str) -> Verdict:
  """Reward of a response to an "exact" task.

  Args:
    task: the "exact" task.
    response: the agent's text.

  Returns:
    Reward 1 iff the response's final answer equals one of `task.answers` after normalisation
    (numbers compare by value: "0.50" == "1/2"), else 0.

  Raises:
    ValueError: the task is not an "exact" task.
  """
  if task.kind != "exact":
    raise ValueError(f"verify_exact: task {task.instance_id!r} has kind={task.kind!r}, "
                     "expected 'exact'")
  got = normalize_answer(extract_answer(response))
  for answer in task.answers:
    want = normalize_answer(answer)
    a, b = _number(got), _number(want)
    if got == want or (a is not None and a == b):
      return Verdict(1.0, {"answer": got, "matched": answer})
  return Verdict.fail("the answer matches none of the accepted answers", answer=got)
