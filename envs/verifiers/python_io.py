"""The `python_io` verifier of "code" tasks: function tests or stdin/stdout tests of the
agent's program, run in a fresh sandbox."""

from __future__ import annotations

import json
import math
import re
import secrets
from typing import Any

from envs.tasks import Task
from envs.verifiers.base import SandboxFactory, Verdict, start_sandbox


def extract_code(text: str) -> str:
  """The program in a response.

  It is the response's last ```python (or plain ```) fenced block, or the whole text.

  Args:
    text: the response.

  Returns:
    The code.
  """
  blocks = re.findall(r"```(?:python3?|py)?[ \t]*\n(.*?)```", text, re.S)
  return blocks[-1] if blocks else text


_FUNCTION_RUNNER = r'''
import json, os, sys
_out = os.dup(1)
os.dup2(2, 1)  # the solution's prints go to stderr, not into our result line
sys.path.insert(0, os.getcwd())

def enc(x, depth=0):
  # Exact builtin types only: an object posing as a value (custom __eq__) stays a repr.
  t = type(x)
  if x is None or t in (bool, int, str) or t is float and x == x and abs(x) != float("inf"):
    return x
  if t in (list, tuple) and depth < 50:
    return [enc(v, depth + 1) for v in x]
  if t is dict and depth < 50 and all(type(k) is str for k in x):
    return {k: enc(v, depth + 1) for k, v in x.items()}
  return {"__repr__": repr(x)[:200]}

results = []
try:
  import solution
  fn, err = getattr(solution, ENTRY), None
except BaseException as e:
  fn, err = None, "%s: %s" % (type(e).__name__, e)
for args in CASES:
  if fn is None:
    results.append({"error": err[:300]})
    continue
  try:
    results.append({"value": enc(fn(*args))})
  except BaseException as e:
    results.append({"error": ("%s: %s" % (type(e).__name__, e))[:300]})
os.write(_out, ("\n%s %s\n" % (NONCE, json.dumps(results))).encode())
os._exit(0)
'''


def values_equal(got: Any, want: Any, rel_tol: float = 1e-6) -> bool:
  """Whether two JSON values are equal.

  Types must match exactly (bool is not int), numbers within rel_tol, tuples equal lists.

  Args:
    got: the program's value.
    want: the expected value.
    rel_tol: relative tolerance for numbers.

  Returns:
    True when they match.
  """
  if isinstance(want, bool) or isinstance(got, bool):
    return type(got) is type(want) and got == want
  if isinstance(want, (int, float)) and isinstance(got, (int, float)):
    return math.isclose(got, want, rel_tol=rel_tol, abs_tol=1e-9)
  if isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)):
    return len(got) == len(want) and all(values_equal(g, w, rel_tol) for g, w in zip(got, want))
  if isinstance(want, dict) and isinstance(got, dict):
    return got.keys() == want.keys() and all(values_equal(got[k], want[k], rel_tol) for k in want)
  return type(got) is type(want) and got == want


def normalize_output(text: str) -> str:
  """Output as compared: CRLF -> LF, trailing spaces per line and trailing blank lines dropped.

  Args:
    text: a program's output.

  Returns:
    The normalised text.
  """
  lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
  while lines and not lines[-1]:
    lines.pop()
  return "\n".join(lines)


async def verify_python_io(task: Task, program: str, make_sandbox: SandboxFactory, *,
                           partial: bool = False) -> Verdict:
  """Reward of a program for a "code" task, its tests run in a fresh sandbox.

  Function tests ({"args", "expected"}) call `task.entry_point` in one process; stdin/stdout
  tests ({"input", "output"}) run `python3 solution.py` once each; `task.timeout` bounds each
  process.

  Args:
    task: the "code" task.
    program: the agent's answer (a fenced block is extracted).
    make_sandbox: gives the fresh sandbox (closed here).
    partial: reward = fraction of tests passing instead of all-or-nothing.

  Returns:
    The verdict; details hold per-test results.

  Raises:
    ValueError: the task is not a "code" task.
  """
  if task.kind != "code":
    raise ValueError(f"verify_python_io: task {task.instance_id!r} has kind={task.kind!r}, "
                     "expected 'code'")
  code = extract_code(program)
  fn_cases = [c for c in task.tests if "args" in c]
  io_cases = [c for c in task.tests if "args" not in c]
  results: list[dict] = []
  sandbox = await start_sandbox(make_sandbox, task)
  try:
    try:
      await sandbox.write_file("solution.py", code)
    except (OSError, ValueError) as e:
      return Verdict.fail(f"cannot write the solution: {e}")
    if fn_cases:
      nonce = secrets.token_hex(16)
      header = (f"ENTRY = {task.entry_point!r}\nNONCE = {nonce!r}\n"
                f"CASES = {json.dumps([c['args'] for c in fn_cases])!r}\n"
                "CASES = __import__('json').loads(CASES)\n")
      res = await sandbox.exec("python3 -I -B -", stdin=header + _FUNCTION_RUNNER,
                               timeout=task.timeout)
      found = re.findall(rf"^{nonce} (.*)$", res.stdout, re.M)
      values = None
      if not res.timed_out and len(found) == 1:
        try:
          values = json.loads(found[0])
        except json.JSONDecodeError:
          pass
      for i, case in enumerate(fn_cases):
        if values is None or len(values) != len(fn_cases):
          why = "timed out" if res.timed_out else "no result (crashed or output too large)"
          results.append({"test": i, "passed": False, "error": why})
        elif "error" in values[i]:
          results.append({"test": i, "passed": False, "error": values[i]["error"]})
        else:
          ok = values_equal(values[i]["value"], case["expected"])
          results.append({"test": i, "passed": ok, "got": values[i]["value"]})
    for j, case in enumerate(io_cases, len(fn_cases)):
      res = await sandbox.exec("python3 -I -B solution.py", stdin=case["input"],
                               timeout=task.timeout)
      ok = (not res.timed_out and res.exit_code == 0 and not res.stdout_truncated
            and normalize_output(res.stdout) == normalize_output(case["output"]))
      results.append({"test": j, "passed": ok, "exit_code": res.exit_code,
                      "timed_out": res.timed_out, "stdout": res.stdout[:200],
                      "stderr": res.stderr[-300:]})
  finally:
    await sandbox.close()
  n_pass = sum(r["passed"] for r in results)
  solved = n_pass == len(results)
  reward = 1.0 if solved else (n_pass / len(results) if partial else 0.0)
  return Verdict(reward, {"tests": results, "passed": n_pass, "total": len(results),
                          "solved": solved})
