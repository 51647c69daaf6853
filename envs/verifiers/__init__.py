"""Verifiers: turn what an agent produced into a reward, a `Verdict(reward, details)`.

- `verify_tests` ("swe" tasks, swe.py): the agent's non-test changes, applied to a clean copy of
  the repository in a fresh sandbox (the task's test patch applied there only), graded with
  SWE-bench's rules from a trusted pytest run's JUnit report, or for repositories with their
  own runner (Django's tests/runtests.py, sympy's bin/test) from the runner's hash-checked log
  read by the parsers of swe_logs.py.
- `verify_python_io` ("code", python_io.py): function tests or stdin/stdout tests, in a sandbox
  (LiveCodeBench's prelude, calls and comparisons for code_style "livecodebench").
- `verify_shell` ("shell", shell.py): a Terminal-Bench-style check run in the agent's final
  sandbox, its hidden test files copied in only then.
- `verify_exact` ("exact", exact.py): normalised answer match.
- `verify_judge` ("judge", judge.py): a policy scores the response on a weighted rubric.
- `verify(task, submission, ...)` dispatches on `task.kind`.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from envs.policy import Policy
from envs.tasks import Task
from envs.verifiers.base import SandboxFactory, Verdict, start_sandbox
from envs.verifiers.exact import extract_answer, normalize_answer, verify_exact
from envs.verifiers.judge import (JUDGE_PROMPT, judge_prompt, parse_scores, rubric_reward,
                                  verify_judge)
from envs.verifiers.python_io import (LCB_PRELUDE, extract_code, livecodebench_output_equal,
                                      normalize_output, values_equal, verify_python_io)
from envs.verifiers.shell import parse_pytest_summary, verify_shell
from envs.verifiers import swe_logs
from envs.verifiers.swe import (CONFIG_FILES, LOG_TAIL, RUNNER_FILES, TEST_DIRS, Outcome,
                                PatchFailed, PytestRun, Refused, RunResult, is_ignored_path,
                                is_test_path, junit_key, merge_submission, parse_junit,
                                refused_reason, run_log_tests, run_pytest, task_test_files,
                                grade_submission, verify_tests, workspace_files)

__all__ = ["CONFIG_FILES", "JUDGE_PROMPT", "LCB_PRELUDE", "LOG_TAIL", "RUNNER_FILES",
           "TEST_DIRS", "Outcome", "PatchFailed", "PytestRun", "Refused", "RunResult",
           "grade_submission", "run_log_tests", "swe_logs",
           "SandboxFactory", "Verdict", "extract_answer", "extract_code", "is_ignored_path",
           "is_test_path", "judge_prompt", "junit_key", "livecodebench_output_equal",
           "merge_submission", "normalize_answer", "normalize_output", "parse_junit",
           "parse_pytest_summary", "parse_scores", "refused_reason", "rubric_reward",
           "run_pytest", "start_sandbox", "task_test_files", "values_equal", "verify",
           "verify_exact", "verify_judge", "verify_python_io", "verify_shell", "verify_tests",
           "workspace_files"]


async def verify(task: Task, submission, *, make_sandbox: Optional[SandboxFactory] = None,
                 policy: Optional[Policy] = None,
                 render: Optional[Callable[[str], Sequence[int]]] = None,
                 decode: Optional[Callable[[Sequence[int]], str]] = None,
                 partial: bool = False) -> Verdict:
  """The verifier of `task.kind` applied to `submission`.

  Args:
    task: the task.
    submission: swe: the final workspace files {path: bytes} or a diff; code: the program
      text; exact and judge: the response text; shell: the agent's sandbox, after the agent
      stopped (the check runs in it).
    make_sandbox: fresh sandboxes (swe and code need it).
    policy: the judge (judge tasks).
    render: prompt text -> input ids (judge tasks).
    decode: output ids -> text (judge tasks).
    partial: reward the fraction of tests passing (swe, code, shell).

  Returns:
    The verdict.

  Raises:
    ValueError: a swe or code task without make_sandbox, or a judge task without policy,
      render and decode.
  """
  if task.kind in ("swe", "code") and make_sandbox is None:
    raise ValueError(f"verify: task kind {task.kind!r} needs make_sandbox")
  if task.kind == "swe":
    return await verify_tests(task, submission, make_sandbox, partial=partial)
  if task.kind == "code":
    return await verify_python_io(task, submission, make_sandbox, partial=partial)
  if task.kind == "shell":
    return await verify_shell(task, submission, partial=partial)
  if task.kind == "exact":
    return verify_exact(task, submission)
  if policy is None or render is None or decode is None:
    raise ValueError("verify: a judge task needs policy, render and decode")
  return await verify_judge(task, submission, policy, render, decode)
