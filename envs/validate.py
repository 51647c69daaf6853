"""Validation of SWE-format instances: the gold patch fixes them, the unfixed tree fails them,
and repeated runs agree. Works on any task set `envs.tasks` loads (SWE-bench rows, SWE-smith
rows, `envs.synth` output, the bundled envs/data/swe set).

    report = validate(load_swe_jsonl("tasks.jsonl"), make_sandbox_factory("bwrap"), runs=2)
    print(summary(report)); accepted = report["accepted"]

    python -m envs.validate --tasks FILE.jsonl --report R.json --out accepted.jsonl

Each instance runs `runs` times through the verifier (`envs.verifiers.verify_tests`, each run
in a fresh sandbox) with two submissions:
- the gold patch (`Task.patch`): every FAIL_TO_PASS and PASS_TO_PASS test must pass (reward 1);
- the empty patch (the tree as given): every FAIL_TO_PASS test must fail (`strict`, the default:
  a FAIL_TO_PASS test that passes without the fix is mislabelled; `strict=False` asks only that
  some fail) and every PASS_TO_PASS test must pass.
The per-test statuses of each submission must be the same in every run. The first broken rule
is the instance's rejection reason.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from typing import Any, Mapping, Optional, Sequence

from envs import aio, dataset_paths
from envs.episode import make_sandbox_factory
from envs.sandbox import SandboxError
from envs.tasks import Task, jsonl_records, load_repo_files, load_swe_jsonl
from envs.verifiers import SandboxFactory, Verdict, verify_tests
from envs.verifiers import swe_logs

log = logging.getLogger(__name__)

_PASSING = (swe_logs.PASSED, swe_logs.XFAIL)  # SWE-bench's successes of a FAIL_TO_PASS test


def _p2p_ok(task: Task) -> tuple[str, ...]:
  """SWE-bench's successes of a PASS_TO_PASS test: a skip counts only where the runner's log
  records skips (its pytest parser never does: a skipped test is missing)."""
  skipped = swe_logs.SKIPPED in swe_logs.RECORDED[task.test_runner]
  return _PASSING + ((swe_logs.SKIPPED,) if skipped else ())


def _statuses(verdict: Verdict) -> dict[str, str]:
  """{test: status} of a verdict's FAIL_TO_PASS and PASS_TO_PASS tests ({} without a run)."""
  return {**verdict.details.get("fail_to_pass", {}), **verdict.details.get("pass_to_pass", {})}


def _listed(tests: Sequence[str], statuses: Mapping[str, str]) -> str:
  shown = ", ".join(f"{t} ({statuses.get(t, swe_logs.MISSING)})" for t in tests[:5])
  return shown + (f" and {len(tests) - 5} more" if len(tests) > 5 else "")


def judge(task: Task, gold: Sequence[Verdict], empty: Sequence[Verdict],
          strict: bool = True) -> Optional[str]:
  """Why an instance is rejected, given its verdicts; None when it is accepted.

  Args:
    task: the instance.
    gold: the verdicts of the gold patch, one per run.
    empty: the verdicts of the empty patch, one per run.
    strict: every FAIL_TO_PASS test must fail without the fix (else: at least one).

  Returns:
    The reason, or None.
  """
  for i, v in enumerate(gold):
    if v.reward != 1.0:
      st = _statuses(v)
      bad = [t for t in task.fail_to_pass if st.get(t) not in _PASSING] + [
          t for t in task.pass_to_pass if st.get(t) not in _p2p_ok(task)]
      what = f": {_listed(bad, st)}" if bad else ""
      return f"gold patch fails (run {i + 1}): {v.details.get('reason', 'reward 0')}{what}"
  for i, v in enumerate(empty):
    st = _statuses(v)
    if not st:  # no test results at all: the run itself failed
      return f"empty patch: no test results (run {i + 1}): {v.details.get('reason')}"
    passing = [t for t in task.fail_to_pass if st.get(t) in _PASSING]
    if strict and passing:
      return (f"FAIL_TO_PASS tests pass without the fix (run {i + 1}): "
              f"{_listed(passing, st)}")
    if len(passing) == len(task.fail_to_pass):
      return f"every FAIL_TO_PASS test passes without the fix (run {i + 1})"
    broken = [t for t in task.pass_to_pass if st.get(t) not in _p2p_ok(task)]
    if broken:
      return (f"PASS_TO_PASS tests fail without the fix (run {i + 1}): "
              f"{_listed(broken, st)}")
  for name, verdicts in (("gold", gold), ("empty", empty)):
    first = _statuses(verdicts[0])
    for i, v in enumerate(verdicts[1:], 2):
      other = _statuses(v)
      differ = sorted(t for t in set(first) | set(other) if first.get(t) != other.get(t))
      if differ:
        t = differ[0]
        return (f"runs disagree ({name} patch, run 1 vs {i}): {t} {first.get(t)} vs "
                f"{other.get(t)}" + (f" and {len(differ) - 1} more" if len(differ) > 1 else ""))
  return None


async def check_task(task: Task, make_sandbox: SandboxFactory, runs: int = 2,
                     strict: bool = True) -> dict:
  """Validates one instance (module docstring).

  Args:
    task: a "swe" task.
    make_sandbox: fresh sandboxes for the verifier.
    runs: runs of each submission.
    strict: see `judge`.

  Returns:
    {"instance_id", "accepted", "reason" (None when accepted), "gold" and "empty": the per-test
    statuses of each run}.
  """
  out = {"instance_id": task.instance_id, "accepted": False, "reason": None, "gold": [],
         "empty": []}
  if not task.patch.strip():
    out["reason"] = "the row has no gold patch"
    return out
  try:
    original = load_repo_files(task)
    gold, empty = [], []
    for _ in range(runs):
      gold.append(await verify_tests(task, task.patch, make_sandbox, original=original))
      empty.append(await verify_tests(task, "", make_sandbox, original=original))
  except (SandboxError, OSError, ValueError) as e:
    out["reason"] = f"{type(e).__name__}: {e}"
    return out
  out["gold"] = [_statuses(v) for v in gold]
  out["empty"] = [_statuses(v) for v in empty]
  out["reason"] = judge(task, gold, empty, strict)
  out["accepted"] = out["reason"] is None
  return out


async def validate_async(tasks: Sequence[Task], make_sandbox: SandboxFactory, *, runs: int = 2,
                         workers: int = 2, strict: bool = True) -> dict:
  """Validates instances, `workers` at a time.

  Args:
    tasks: "swe" tasks.
    make_sandbox: make_sandbox(task) -> a fresh sandbox (or an awaitable of one).
    runs: runs of each submission (gold and empty patch) per instance.
    workers: instances checked at once.
    strict: every FAIL_TO_PASS test must fail without the fix (else: at least one).

  Returns:
    {"checked", "accepted": [ids], "rejected": {id: reason}, "runs", "seconds",
    "instances": {id: `check_task`'s result}}.

  Raises:
    ValueError: runs or workers < 1, or a task that is not "swe".
  """
  for name, value in (("runs", runs), ("workers", workers)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"{name}={value!r}: expected an integer >= 1")
  for t in tasks:
    if t.kind != "swe":
      raise ValueError(f"task {t.instance_id!r}: kind={t.kind!r}, expected 'swe'")
  start = time.monotonic()
  limit = asyncio.Semaphore(workers)

  async def one(task):
    async with limit:
      result = await check_task(task, make_sandbox, runs, strict)
    log.info("validate: %s %s%s", task.instance_id,
             "accepted" if result["accepted"] else "rejected",
             "" if result["accepted"] else f": {result['reason']}")
    return result
  results = await asyncio.gather(*(one(t) for t in tasks))
  return {"checked": len(results), "runs": runs,
          "accepted": [r["instance_id"] for r in results if r["accepted"]],
          "rejected": {r["instance_id"]: r["reason"] for r in results if not r["accepted"]},
          "seconds": round(time.monotonic() - start, 1),
          "instances": {r["instance_id"]: r for r in results}}


def validate(tasks: Sequence[Task], make_sandbox: Optional[SandboxFactory] = None, *,
             runs: int = 2, workers: int = 2, strict: bool = True) -> dict:
  """`validate_async` from synchronous code; make_sandbox defaults to bwrap sandboxes."""
  return aio.run(validate_async(tasks, make_sandbox or make_sandbox_factory("bwrap"),
                                runs=runs, workers=workers, strict=strict))


def summary(report: Mapping[str, Any]) -> str:
  """A few lines of text: accepted count and each rejection with its reason."""
  lines = [f"{len(report['accepted'])}/{report['checked']} instances accepted "
           f"({report['runs']} runs each, {report['seconds']:.0f}s)"]
  lines += [f"  rejected {i}: {reason}" for i, reason in report["rejected"].items()]
  lines += [f"  does not load: {e}" for e in report.get("unloadable", [])]
  return "\n".join(lines)


def moved_rows(rows: Sequence[dict], source: str, path: str) -> list[dict]:
  """The rows of `source` as a file at `path` must hold them: `repo_path` and `rootfs` made
  relative to the new file's folder.

  A dataset's paths lie inside its own folder (`envs.dataset_paths`), so the new file must be
  in the folder of `source` or a folder above it.

  Args:
    rows: the rows as read from `source`.
    source: the file they came from (its folder holds their paths).
    path: the new file.

  Returns:
    New row dicts.

  Raises:
    ValueError: a row's path is not one a dataset may name, or it would be outside the new
      file's folder.
  """
  old_dir = os.path.dirname(os.path.abspath(source))
  new_dir = os.path.dirname(os.path.abspath(path))
  out = []
  for row in rows:
    row = dict(row)
    for field in ("repo_path", "rootfs"):
      value = row.get(field)
      if isinstance(value, str):
        comps = dataset_paths.parts(old_dir, value, f"field {field!r}")
        moved = os.path.relpath(os.path.join(old_dir, *comps), new_dir)
        if moved.split(os.sep)[0] == "..":
          raise ValueError(f"{path}: field {field!r}: {value!r} would be {moved!r}, outside "
                           f"the new file's folder; write it in {old_dir} or a folder above")
        row[field] = moved.replace(os.sep, "/")
    out.append(row)
  return out


def write_rows(path: str, rows: Sequence[dict], source: str) -> None:
  """Writes rows to a JSONL file, their `repo_path`s (and `rootfs`) rewritten to be relative
  to the new file's folder (`moved_rows`).

  Args:
    path: the new file (in the folder of `source` or a folder above it).
    rows: the rows as read from `source`.
    source: the file they came from (its folder is what their paths are relative to).

  Raises:
    ValueError: see `moved_rows` (nothing is written then).
  """
  rows = moved_rows(rows, source, path)
  with open(path, "w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Command line (module docstring). Prints the summary; returns 0."""
  p = argparse.ArgumentParser(prog="python -m envs.validate", description=__doc__.split("\n")[0])
  p.add_argument("--tasks", required=True, help="SWE-format JSONL file")
  p.add_argument("--report", help="write the full report (JSON) here")
  p.add_argument("--out", help="write the accepted rows here (JSONL)")
  p.add_argument("--runs", type=int, default=2, help="runs of each submission")
  p.add_argument("--workers", type=int, default=2, help="instances at once")
  p.add_argument("--loose", action="store_true",
                 help="accept when some (not every) FAIL_TO_PASS test fails without the fix")
  p.add_argument("--backend", default="bwrap", help="sandbox backend")
  p.add_argument("--mirror", default=None, help="git mirrors for rows without repo_path")
  args = p.parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
  if args.out:  # rows whose paths could not be written there: say so before any run
    old_dir, new_dir = (os.path.dirname(os.path.abspath(f)) for f in (args.tasks, args.out))
    if os.path.relpath(old_dir, new_dir).split(os.sep)[0] == ".." and any(
        isinstance(r, dict) and (r.get("repo_path") or r.get("rootfs"))
        for _, _, r in jsonl_records(args.tasks)):
      p.error(f"--out={args.out!r}: the rows name paths inside {old_dir}; write the accepted "
              "rows in that folder or a folder above it")
  errors: list = []
  tasks = load_swe_jsonl(args.tasks, skip_bad=True, errors=errors, mirror=args.mirror)
  report = validate(tasks, make_sandbox_factory(args.backend), runs=args.runs,
                    workers=args.workers, strict=not args.loose)
  report["unloadable"] = [str(e) for e in errors]
  if args.report:
    with open(args.report, "w") as f:
      json.dump(report, f, indent=1)
  if args.out:
    accepted = set(report["accepted"])
    rows = [r for _, _, r in jsonl_records(args.tasks)
            if isinstance(r, dict) and r.get("instance_id") in accepted]
    write_rows(args.out, rows, args.tasks)
  print(summary(report))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
