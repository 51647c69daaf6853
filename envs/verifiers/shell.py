"""The `shell` verifier of "shell" (Terminal-Bench-style) tasks: the task's check, run in the
agent's final sandbox after the agent stopped, with the hidden test files copied in only then.

    verdict = await verify_shell(task, agent_sandbox)

Steps: a fresh directory is made under the sandbox's temporary directory (outside the
workspace) by an isolated `python3 -I` (the workspace is not on its path), the task's test
files and run-tests.sh are written there, and `bash $TEST_DIR/run-tests.sh` runs from the
workspace with TEST_DIR set, for at most `task.timeout` seconds. Grading by
`task.check_parser`:
- "pytest": pytest's `-rA` short summary ("PASSED path::test", "FAILED ...") is read; reward 1
  iff it lists at least one test and none FAILED, ERROR or XPASS (SKIPPED and XFAIL do not
  count against it); with `partial`, reward = passed / listed.
- "exit_code": reward 1 iff run-tests.sh exits 0.
"""

from __future__ import annotations

import base64
import json
import re

from envs.sandbox.base import Sandbox
from envs.tasks import Task
from envs.verifiers.base import Verdict

# "PASSED path::test", "FAILED path::test - msg", "SKIPPED [1] path:3: reason".
_OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (?:\[\d+\] )?(\S+?):?(?:\s|$)",
                      re.M)
_BAD = ("FAILED", "ERROR", "XPASS")
# Reads {path: base64} from stdin, writes the files into a fresh private directory under
# $TMPDIR (or /tmp) and prints the directory.
_COPY_TESTS = r"""
import base64, json, os, sys, tempfile
files = json.load(sys.stdin)
root = tempfile.mkdtemp(prefix="tests-")
for rel, data in files.items():
  path = os.path.join(root, rel)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "wb") as f:
    f.write(base64.b64decode(data))
print(root)
"""


def parse_pytest_summary(output: str) -> dict[str, str]:
  """The outcome of each test in pytest's `-rA` short test summary.

  Args:
    output: pytest's output.

  Returns:
    {test id: "PASSED" | "FAILED" | "ERROR" | "SKIPPED" | "XFAIL" | "XPASS"}, the last outcome
    of each id (a skip is keyed "path:line"); {} without a summary.
  """
  at = output.rfind("short test summary info")
  if at < 0:
    return {}
  return {test: outcome for outcome, test in _OUTCOME.findall(output[at:])}


async def verify_shell(task: Task, sandbox: Sandbox, *, partial: bool = False) -> Verdict:
  """Reward of the agent's final sandbox for a "shell" task (module docstring).

  Args:
    task: the "shell" task.
    sandbox: the agent's sandbox, after the agent stopped (its workspace is what is checked).
    partial: reward the fraction of listed tests that passed ("pytest" parser).

  Returns:
    The verdict; details hold the parser, exit code, per-test outcomes and the output's tail.

  Raises:
    ValueError: the task is not a "shell" task, or `sandbox` is not a sandbox.
  """
  if task.kind != "shell":
    raise ValueError(f"verify_shell: task {task.instance_id!r} has kind={task.kind!r}, "
                     "expected 'shell'")
  if not isinstance(sandbox, Sandbox):
    raise ValueError(f"verify_shell: expected the agent's sandbox, got {type(sandbox).__name__}")
  files = {**task.check_files, "run-tests.sh": task.check_script.encode()}
  copy = await sandbox.exec(["python3", "-I", "-c", _COPY_TESTS], timeout=60, stdin=json.dumps(
      {p: base64.b64encode(b).decode("ascii") for p, b in files.items()}))
  test_dir = copy.stdout.strip()
  if copy.exit_code != 0 or not test_dir.startswith("/"):
    return Verdict.fail("cannot copy the tests into the sandbox", exit_code=copy.exit_code,
                        stderr=copy.stderr[-500:])
  res = await sandbox.exec(["bash", f"{test_dir}/run-tests.sh"], timeout=task.timeout,
                           env={"TEST_DIR": test_dir})
  details = {"parser": task.check_parser, "exit_code": res.exit_code,
             "timed_out": res.timed_out, "output": res.stdout[-2000:],
             "stderr": res.stderr[-1000:]}
  if task.check_parser == "exit_code":
    ok = res.exit_code == 0 and not res.timed_out
    return Verdict(1.0 if ok else 0.0, {**details, "solved": ok})
  tests = parse_pytest_summary(res.stdout)
  passed = sum(v == "PASSED" for v in tests.values())
  ok = (not res.timed_out and passed > 0
        and not any(v in _BAD for v in tests.values()))
  counted = [v for v in tests.values() if v not in ("SKIPPED", "XFAIL")]
  reward = 1.0 if ok else (passed / len(counted) if partial and counted else 0.0)
  return Verdict(reward, {**details, "tests": tests, "passed": passed, "total": len(counted),
                          "solved": ok})
