"""Verdicts of identical submissions computed once.

    cache = VerdictCache()
    verdict = await cache.verdict(task, submission, partial, lambda: verify(task, submission, ...))

The episodes of a group attempt the same task, and many end in the same state: at the start of
RL most submit the repository unchanged (or leave it so after edits that failed), later most
make the same fix. A "swe" verdict is a function of the task, the final workspace and the
grading rule, a "code" verdict of the task and the program, so each distinct submission runs
its tests once: the first caller runs them, callers that arrive while they run wait for that
run, later ones get the stored verdict. Tests whose outcome is not a function of the files
(flaky tests, a timeout on a loaded machine) so get one draw for all identical submissions,
as they would if the submissions had been one. A run that raises is not stored: every waiter
gets its exception, and the next caller runs the tests again.

The key is a SHA-256 of the task's grading fields (`TASK_FIELDS`), `partial` and the
submission (every path and content of a workspace, or the text). Other kinds ("exact",
"judge", "shell") are never cached (`CACHED_KINDS`): cheap, graded by a changing policy, or
graded in the agent's own sandbox. Verdicts are kept in memory, least recently used dropped
beyond `max_entries`; each caller gets its own copy of the details, marked "shared": True
when the tests ran for another submission.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import hashlib
from typing import Any, Awaitable, Callable, Mapping, Union

from envs.tasks import Task
from envs.verifiers.base import Verdict

CACHED_KINDS = ("swe", "code")
# What a "swe" or "code" verdict depends on, beyond the submission.
TASK_FIELDS = ("instance_id", "kind", "repo_path", "repo", "base_commit", "fail_to_pass",
               "pass_to_pass", "test_command", "test_patch", "rootfs", "timeout", "image_name",
               "environment", "test_runner", "tests", "entry_point", "code_style", "memory_mb")

Submission = Union[Mapping[str, Union[bytes, str]], str]


def submission_key(task: Task, submission: Submission, partial: bool) -> str:
  """The cache key of `submission` to `task` graded with `partial` (hex SHA-256).

  Raises:
    TypeError: a submission that is neither text nor a {path: bytes | str} mapping.
  """
  h = hashlib.sha256()

  def part(tag: str, data: Union[bytes, str]) -> None:
    data = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    h.update(f"{tag}:{len(data)}:".encode())
    h.update(data)

  for name in TASK_FIELDS:
    part(name, repr(getattr(task, name)))
  part("partial", repr(bool(partial)))
  if isinstance(submission, str):
    part("text", submission)
  elif isinstance(submission, Mapping):
    for path in sorted(submission):
      content = submission[path]
      if not isinstance(content, (bytes, str)):
        raise TypeError(f"submission[{path!r}]: expected bytes or str, got "
                        f"{type(content).__name__}")
      part("path", path)
      part("bytes" if isinstance(content, bytes) else "str", content)
  else:
    raise TypeError(f"submission: expected a str or a mapping, got {type(submission).__name__}")
  return h.hexdigest()


class VerdictCache:
  """Verdicts by `submission_key`, with the runs in flight shared (see the module docstring).

  One cache serves one event loop (the episodes of one rollout loop); it is not thread-safe.

  Args:
    max_entries: verdicts kept (least recently used dropped first); >= 1.

  Attributes:
    hits: verdicts served without running the tests (stored or in flight).
    misses: verdicts that ran the tests.

  Raises:
    ValueError: max_entries < 1.
  """

  def __init__(self, max_entries: int = 4096):
    if max_entries < 1:
      raise ValueError(f"max_entries={max_entries!r}: expected an integer >= 1")
    self.max_entries = max_entries
    self._done: collections.OrderedDict[str, Verdict] = collections.OrderedDict()
    self._running: dict[str, asyncio.Future] = {}
    self.hits = 0
    self.misses = 0

  async def verdict(self, task: Task, submission: Submission, partial: bool,
                    run: Callable[[], Awaitable[Verdict]]) -> Verdict:
    """`run()`'s verdict for this submission, run once per distinct key.

    Args:
      task: the task graded.
      submission: what is graded (a workspace {path: content} or text).
      partial: the grading rule (fraction of tests instead of all-or-nothing).
      run: grades the submission (called at most once per key while its verdict is stored).

    Returns:
      A verdict whose details are the caller's own copy (with "shared": True unless this call
      ran the tests).
    """
    if task.kind not in CACHED_KINDS:
      return await run()
    key = submission_key(task, submission, partial)
    while key in self._running:  # the same submission is being graded: wait for it
      shared = await asyncio.shield(self._running[key])
      if shared is not None:
        self.hits += 1
        return _copy(shared, shared=True)
      # its run was cancelled: the first waiter to get here runs the tests itself
    if key in self._done:
      self._done.move_to_end(key)
      self.hits += 1
      return _copy(self._done[key], shared=True)
    self.misses += 1
    future = asyncio.get_running_loop().create_future()
    self._running[key] = future
    try:
      result = await run()
    except asyncio.CancelledError:
      future.set_result(None)
      raise
    except BaseException as e:
      future.set_exception(e)
      future.exception()  # retrieved: no "never retrieved" warning when nobody waits
      raise
    else:
      future.set_result(result)
      self._done[key] = result
      while len(self._done) > self.max_entries:
        self._done.popitem(last=False)
      return _copy(result)
    finally:
      del self._running[key]

  def stats(self) -> dict[str, Any]:
    """{"hits", "misses", "entries"}."""
    return {"hits": self.hits, "misses": self.misses, "entries": len(self._done)}


def _copy(verdict: Verdict, shared: bool = False) -> Verdict:
  details = copy.deepcopy(verdict.details)
  if shared:
    details["shared"] = True
  return Verdict(verdict.reward, details)
