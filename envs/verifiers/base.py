"""What every verifier shares: the `Verdict` it returns and how it gets its fresh sandbox."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Awaitable, Callable, Union

from envs.sandbox.base import Sandbox
from envs.tasks import Task

# make_sandbox(task) -> a fresh sandbox for the verifier, or an awaitable of one.
SandboxFactory = Callable[[Task], Union[Sandbox, Awaitable[Sandbox]]]


@dataclasses.dataclass
class Verdict:
  """A reward in [0, 1] and JSON-like details (why, per-test outcomes, ...)."""

  reward: float
  details: dict[str, Any] = dataclasses.field(default_factory=dict)

  @classmethod
  def fail(cls, reason: str, **details) -> "Verdict":
    """A verdict of reward 0 whose details hold `reason` and `details`."""
    return cls(0.0, {"reason": reason, **details})


async def start_sandbox(make_sandbox: SandboxFactory, task: Task) -> Sandbox:
  """Starts the fresh sandbox a verifier runs in.

  Args:
    make_sandbox: the factory; it may return a sandbox or an awaitable of one.
    task: the task the sandbox is for.

  Returns:
    The started sandbox.
  """
  sb = make_sandbox(task)
  return await sb if inspect.isawaitable(sb) else sb
