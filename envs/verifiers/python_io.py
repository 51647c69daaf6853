"""The `python_io` verifier of "code" tasks: function tests or stdin/stdout tests of the
agent's program, run in a fresh sandbox.

Only the program is written to the verifier's sandbox; the tests travel on the runner's stdin
(function tests) or as each process's stdin (stdin/stdout tests), so no test file is ever in a
sandbox the agent used. `task.memory_mb` (when set) caps each test process's address space
(RLIMIT_AS, `ulimit -v`).

Two styles (`task.code_style`):
- "plain": values compared by `values_equal` (exact types, numbers within 1e-6), output by
  `normalize_output`; `task.timeout` bounds each process (all function tests share one).
- "livecodebench": as LiveCodeBench grades: the program runs after its prelude of star imports
  (`LCB_PRELUDE`: typing, collections, math, ...), a method entry point "Solution.f" calls
  `Solution().f(*args)` (a program without a `Solution` class is called as the module-level
  function `f`), returned values compare with Python `==` (a tuple counts as a list), outputs
  with `livecodebench_output_equal`, and `task.timeout` is the limit of each test (a function
  call is interrupted by a timer; the whole function-test process gets one limit per test).

    verdict = await verify_python_io(task, "def add(a, b):\n  return a + b", make_sandbox)
"""

from __future__ import annotations

import decimal
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


# The imports LiveCodeBench's harness runs before every program (its `import_string`).
_LCB_MODULES = ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math",
                "random", "statistics", "itertools", "functools", "operator", "io", "sys",
                "json", "builtins", "typing")
LCB_PRELUDE = ("".join(f"from {m} import *\n" for m in _LCB_MODULES)
               + "".join(f"import {m}\n" for m in _LCB_MODULES if m not in ("builtins", "typing"))
               + "sys.setrecursionlimit(50000)\n")

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

class TimeLimit(BaseException):  # not an Exception: a solution's `except Exception` misses it
  pass

def on_alarm(signum, frame):
  raise TimeLimit()

def entry(module):
  owner, _, name = ENTRY.rpartition(".")
  if owner and hasattr(module, owner):
    return getattr(getattr(module, owner)(), name)
  return getattr(module, name)

results = []
try:
  import solution
  fn, err = entry(solution), None
except BaseException as e:
  fn, err = None, "%s: %s" % (type(e).__name__, e)
if PER_CALL:
  import signal
  signal.signal(signal.SIGALRM, on_alarm)
for args in CASES:
  if fn is None:
    results.append({"error": err[:300]})
    continue
  try:
    if PER_CALL:
      signal.setitimer(signal.ITIMER_REAL, PER_CALL)
    value = fn(*args)
    if PER_CALL:
      signal.setitimer(signal.ITIMER_REAL, 0)
    results.append({"value": enc(value)})
  except TimeLimit:
    results.append({"error": "time limit exceeded (%gs)" % PER_CALL, "timed_out": True})
  except BaseException as e:
    if PER_CALL:
      signal.setitimer(signal.ITIMER_REAL, 0)
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


def livecodebench_output_equal(got: str, want: str) -> bool:
  """Whether a program's output matches, as LiveCodeBench compares stdin/stdout tests.

  Both texts are stripped and split into lines, each line stripped; the line counts must be
  equal, and each line pair equal as text or, failing that, as lists of decimal numbers
  (whitespace-separated, compared exactly with `decimal.Decimal`).

  Args:
    got: the program's output.
    want: the expected output.

  Returns:
    True when they match.
  """
  a = [line.strip() for line in got.strip().split("\n")]
  b = [line.strip() for line in want.strip().split("\n")]
  if len(a) != len(b):
    return False
  for x, y in zip(a, b):
    if x == y:
      continue
    try:
      if [decimal.Decimal(v) for v in x.split()] != [decimal.Decimal(v) for v in y.split()]:
        return False
    except (decimal.InvalidOperation, ValueError):
      return False
  return True


def _with_memory_limit(command: str, memory_mb) -> str:
  """`command` under an address-space limit (RLIMIT_AS) of `memory_mb` MiB, if one is set.

  A sandbox whose hard limit is already lower keeps its lower one (ulimit cannot raise it)."""
  if not memory_mb:
    return command
  return f"ulimit -v {int(memory_mb) * 1024} 2>/dev/null; exec {command}"


async def verify_python_io(task: Task, program: str, make_sandbox: SandboxFactory, *,
                           partial: bool = False) -> Verdict:
  """Reward of a program for a "code" task, its tests run in a fresh sandbox.

  Function tests ({"args", "expected"}) call `task.entry_point` in one process; stdin/stdout
  tests ({"input", "output"}) run `python3 solution.py` once each. Time: `task.timeout` bounds
  each process ("plain") or each test ("livecodebench", module docstring); memory:
  `task.memory_mb` caps each process's address space.

  Args:
    task: the "code" task.
    program: the agent's answer (a fenced block is extracted).
    make_sandbox: gives the fresh sandbox (closed here).
    partial: reward = fraction of tests passing instead of all-or-nothing.

  Returns:
    The verdict; details hold per-test results (a test over its time limit has
    "timed_out": True and an "error" saying so).

  Raises:
    ValueError: the task is not a "code" task.
  """
  if task.kind != "code":
    raise ValueError(f"verify_python_io: task {task.instance_id!r} has kind={task.kind!r}, "
                     "expected 'code'")
  lcb = task.code_style == "livecodebench"
  code = (LCB_PRELUDE if lcb else "") + extract_code(program)
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
                f"PER_CALL = {task.timeout if lcb else None!r}\n"
                f"CASES = {json.dumps([c['args'] for c in fn_cases])!r}\n"
                "CASES = __import__('json').loads(CASES)\n")
      # LiveCodeBench: a limit per call (the timer), plus start-up slack for the process.
      limit = task.timeout * len(fn_cases) + 5.0 if lcb else task.timeout
      res = await sandbox.exec(_with_memory_limit("python3 -I -B -", task.memory_mb),
                               stdin=header + _FUNCTION_RUNNER, timeout=limit)
      found = re.findall(rf"^{nonce} (.*)$", res.stdout, re.M)
      values = None
      if not res.timed_out and len(found) == 1:
        try:
          values = json.loads(found[0])
        except json.JSONDecodeError:
          pass
      for i, case in enumerate(fn_cases):
        if values is None or len(values) != len(fn_cases):
          why = (f"timed out after {limit:g}s" if res.timed_out else
                 "no result (crashed, out of memory or output too large)")
          results.append({"test": i, "passed": False, "error": why,
                          "timed_out": res.timed_out, "stderr": res.stderr[-300:]})
        elif "error" in values[i]:
          results.append({"test": i, "passed": False, "error": values[i]["error"],
                          "timed_out": bool(values[i].get("timed_out"))})
        else:
          got = values[i]["value"]
          ok = got == case["expected"] if lcb else values_equal(got, case["expected"])
          results.append({"test": i, "passed": ok, "got": got})
    for j, case in enumerate(io_cases, len(fn_cases)):
      res = await sandbox.exec(_with_memory_limit("python3 -I -B solution.py", task.memory_mb),
                               stdin=case["input"], timeout=task.timeout)
      same = (livecodebench_output_equal if lcb else
              lambda a, b: normalize_output(a) == normalize_output(b))
      ok = (not res.timed_out and res.exit_code == 0 and not res.stdout_truncated
            and same(res.stdout, case["output"]))
      result = {"test": j, "passed": ok, "exit_code": res.exit_code,
                "timed_out": res.timed_out, "stdout": res.stdout[:200],
                "stderr": res.stderr[-300:]}
      if res.timed_out:
        result["error"] = f"time limit exceeded ({task.timeout:g}s)"
      elif "MemoryError" in res.stderr:
        result["error"] = f"memory limit exceeded ({task.memory_mb} MiB)"
      results.append(result)
  finally:
    await sandbox.close()
  n_pass = sum(r["passed"] for r in results)
  solved = n_pass == len(results)
  reward = 1.0 if solved else (n_pass / len(results) if partial else 0.0)
  return Verdict(reward, {"tests": results, "passed": n_pass, "total": len(results),
                          "solved": solved})
