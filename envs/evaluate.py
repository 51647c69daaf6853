"""Grading model predictions on SWE rows, with the swebench harness's interface and reports.

    python -m envs.evaluate --dataset ROWS.jsonl --predictions PREDS.jsonl --report REPORT.json \
        [--run_id ID] [--backend bwrap|docker] [--max_workers N] [--instance_ids A B ...] \
        [--timeout S] [--log_dir DIR] [--env_from none|swebench|repository]

Inputs. The dataset is SWE rows (JSONL or Parquet) read by `envs.tasks`' loaders, their
repositories from `repo_path` or a mirror (ARBOR_SWE_MIRROR), as for training; a row's
`environment` (or one from --env_from) is what its sandboxes start from. Predictions are
swebench's: objects with `instance_id`, `model_name_or_path` and `model_patch` (a unified diff,
"" or null for none), as a JSON list, a JSON object {instance_id: prediction} (SWE-agent's) or
JSONL; `--predictions gold` grades each row's reference patch as model "gold" (the rows of
--instance_ids only, when given, as swebench takes them). A malformed
prediction, a repeated instance_id, or one that is not in the dataset stops the run before
anything is graded, with an error naming the file, line and field.

Each prediction with a patch is applied to the row's repository at its base commit as swebench
applies it, exactly or else with GNU patch's fuzz 5 (`envs.grading.patch`), and graded by
`envs.verifiers.swe.grade_submission` in a fresh sandbox of the chosen backend, from the
factory of `envs.episode` (which starts a task from its root filesystem, image or
environment). An empty patch is not run. Grading is SWE-bench's (`envs.verifiers.swe_logs`),
on statuses read from pytest's JUnit report or the repository runner's hash-checked log.

Outputs, laid out as swebench's `logs/run_evaluation` (LOG_DIR/RUN_ID/MODEL/INSTANCE_ID/, MODEL
with "/" written "__"):
- patch.diff: the model patch;
- test_output.txt: the tests' output between swebench's ">>>>> Start Test Output" and
  ">>>>> End Test Output" markers, then ">>>>> Test Exit Code: N". A pytest run's output is
  pytest's with "-rA", so swebench's log parsers and `get_logs_eval` read the same per-test
  statuses from it as the JUnit report gave here. A run whose results are not trusted (none,
  or tests rewritten during the run) is written with ">>>>> Tests Errored: REASON" in place of
  the end marker or after it, which makes swebench read no results, as it is graded here.
- report.json: swebench's per-instance report (`get_eval_report` with its tests_status);
- run_instance.log: what happened, and the reason of an error.
An instance is an error, with no report.json (as in swebench, where the harness raised), when
its patch does not apply (">>>>> Patch Apply Failed"), the submission is refused (a change to
test configuration, see `envs.verifiers.swe`), the sandbox fails, the tests time out, or the
environment has no test runner. A finished instance's report.json is reused when the same run
is started again; errors are retried.

The run's report (--report) has the keys and meaning of swebench 5's `make_run_report`,
computed from the report.json files on disk: total_instances (dataset rows, after
--instance_ids), submitted_instances (all predictions), completed_instances (a report.json
exists), resolved / unresolved (among completed), empty_patch_instances, error_instances
(submitted with a patch, no report.json), infra_failure_instances / ambiguous_failure_instances
(unresolved or error instances whose logs match one of swebench's failure signatures, of the
"environment" or the "ambiguous" tier), their *_ids lists, failure_reasons {instance_id:
signature} and schema_version 2.

Where the verdict can differ from swebench's on the same patch: the submission's changes to test files are dropped and changes to test configuration refused (see
`envs.verifiers.swe`); statuses come from the JUnit report, so tests printed as passing by code
under test do not count; git's binary patches and renames without hunks are not applied.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import re
import sys
import tempfile
import traceback
from typing import Any, Callable, Mapping, Optional, Sequence

from envs import tasks as tasks_lib
from envs.episode import make_sandbox_factory
from envs.sandbox import Limits, SandboxError
from envs.grading.patch import apply_prediction
from envs.grading.predictions import PredictionError, load_predictions  # noqa: F401 (API)
from envs.tasks import Task
from envs.verifiers import swe, swe_logs
from envs.verifiers.base import SandboxFactory

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2  # of swebench's run report
LOG_DIR = os.path.join("logs", "run_evaluation")
LOG_REPORT, LOG_TEST_OUTPUT = "report.json", "test_output.txt"
LOG_INSTANCE, LOG_PATCH = "run_instance.log", "patch.diff"
# swebench's log markers (harness.constants).
APPLY_PATCH_FAIL, APPLY_PATCH_PASS = ">>>>> Patch Apply Failed", ">>>>> Applied Patch"
START_TEST_OUTPUT, END_TEST_OUTPUT = ">>>>> Start Test Output", ">>>>> End Test Output"
TEST_EXIT_CODE, TESTS_ERROR = ">>>>> Test Exit Code", ">>>>> Tests Errored"
# Run failures that are the environment's, not the patch's: the instance is an error.
_ENVIRONMENT_CAUSES = ("timeout", "runner_missing")

# swebench's signatures of infrastructure failures in an instance's logs, (reason, tier,
# pattern), the first match wins. "environment": a patch cannot cause it; "ambiguous": either.
INFRA_SIGNATURES = (
    ("browser_launch_failed", "environment", r"Failed to launch|Failed to connect to the bus"),
    ("display_unavailable", "environment",
     r"cannot open display|Missing X server|unable to open X display"),
    ("out_of_memory", "environment", r"Cannot allocate memory|OutOfMemoryError|^Killed$"),
    ("container_unavailable", "environment",
     r"Error response from daemon|Cannot connect to the Docker daemon"),
    ("network_unreachable", "environment",
     r"Could not resolve host|Temporary failure in name resolution"),
    ("missing_module", "ambiguous", r"Cannot find module|MODULE_NOT_FOUND|ModuleNotFoundError"),
    ("no_tests_collected", "ambiguous", r"no tests ran|collected 0 items"),
    ("tests_timed_out", "ambiguous", r"Timeout error: \d+ seconds exceeded"),
)
_INFRA = [(r, t, re.compile(p, re.M)) for r, t, p in INFRA_SIGNATURES]


def classify_failure(text: str) -> Optional[tuple[str, str]]:
  """(reason, tier) of the first infrastructure signature in `text`, or None."""
  for reason, tier, pattern in _INFRA:
    if pattern.search(text):
      return reason, tier
  return None


# ----------------------------------------------------------------------------- one instance


def _component(value: str, field: str) -> str:
  if (not value or value in (".", "..") or "/" in value or "\x00" in value
      or value != value.strip()):
    raise ValueError(f"field {field!r}: {value!r} cannot name a log directory")
  return value


def instance_dir(log_dir: str, run_id: str, prediction: Mapping[str, Any]) -> str:
  """LOG_DIR/RUN_ID/MODEL/INSTANCE_ID of a prediction, MODEL with "/" written "__".

  Raises:
    ValueError: naming the field whose value is not a plain directory name.
  """
  model = str(prediction["model_name_or_path"]).replace("/", "__")
  return os.path.join(log_dir, _component(run_id, "run_id"),
                      _component(model, "model_name_or_path"),
                      _component(prediction["instance_id"], "instance_id"))


def _write(path: str, text: str) -> None:
  """Writes atomically: a report.json that exists is complete (reruns trust it)."""
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
  # errors="replace": a prediction's JSON may hold lone surrogates, which UTF-8 cannot encode.
  with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as f:
    f.write(text)
  os.replace(tmp, path)


def read_report(path: str, instance_id: str) -> Optional[dict]:
  """A report.json's entry for `instance_id`, or None when it is missing or unreadable."""
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)[instance_id]
  except (OSError, ValueError, KeyError, TypeError):
    return None


def output_log(outcome: swe.Outcome, timeout: float) -> str:
  """test_output.txt of a run: the log between swebench's markers (module docstring)."""
  run = outcome.run
  if run.error is not None:
    text = f"{START_TEST_OUTPUT}\n{run.log}\n"
    if run.cause == "timeout":  # swebench's own words, which its failure signatures know
      text += f"\n\nTimeout error: {round(timeout)} seconds exceeded.\n"
    return text + f"{TESTS_ERROR}: {run.error}\n"
  text = (f"{START_TEST_OUTPUT}\n{run.output.rstrip(chr(10))}\n{END_TEST_OUTPUT}\n"
          f"{TEST_EXIT_CODE}: {run.exit_code}\n")
  if outcome.stage == "tampered":
    text += f"{TESTS_ERROR}: {outcome.verdict.details['reason']}\n"
  return text


def instance_report(instance_id: str, outcome: swe.Outcome, output: str) -> dict:
  """swebench's per-instance report (`get_eval_report(..., include_tests_status=True)`).

  The patch counts as applied, and tests_status is given, when the run recorded statuses
  that swebench's log parser reads and they are trusted, as `get_logs_eval` finds them.
  """
  recorded = any(s in outcome.recorded for s in outcome.run.statuses.values())
  applied = outcome.stage == "graded" and recorded
  entry: dict[str, Any] = {"patch_is_None": False, "patch_exists": True,
                           "patch_successfully_applied": applied,
                           "resolved": applied and outcome.grade.resolved,
                           "infra_failure": False}
  if not applied:
    found = classify_failure(output)
    if found:
      entry["infra_failure"] = found[1] == "environment"
      entry["infra_failure_reason"] = found[0]
    return {instance_id: entry}
  empty = {"success": [], "failure": []}
  entry["tests_status"] = {**swe_logs.successes(outcome.grade, outcome.recorded),
                           "FAIL_TO_FAIL": dict(empty), "PASS_TO_FAIL": dict(empty)}
  return {instance_id: entry}


@dataclasses.dataclass
class InstanceResult:
  """What became of one prediction."""

  instance_id: str
  status: str                    # "resolved" | "unresolved" | "error" | "empty_patch"
  error: Optional[str] = None    # why, for an error
  reused: bool = False           # its report.json came from an earlier run


async def grade_prediction(task: Task, prediction: Mapping[str, Any],
                           make_sandbox: SandboxFactory, out_dir: str) -> InstanceResult:
  """Grades one prediction and writes its logs and report.json into `out_dir`.

  Args:
    task: the dataset row's task.
    prediction: {"instance_id", "model_name_or_path", "model_patch"} with a non-empty patch.
    make_sandbox: the verifier's fresh sandboxes.
    out_dir: the instance's log directory (`instance_dir`), created if missing.

  Returns:
    The result; an error's reason is also the last line of run_instance.log.
  """
  iid = task.instance_id
  os.makedirs(out_dir, exist_ok=True)
  try:  # an earlier attempt's log must not describe this one (the run report reads it)
    os.remove(os.path.join(out_dir, LOG_TEST_OUTPUT))
  except FileNotFoundError:
    pass
  lines = [f"Grading {iid} ({prediction['model_name_or_path']}), repository "
           f"{task.repo or task.repo_path} at {task.base_commit or 'its snapshot'}"]
  _write(os.path.join(out_dir, LOG_PATCH), prediction["model_patch"])

  def error(reason: str) -> InstanceResult:
    lines.append(f"Error: {reason}")
    _write(os.path.join(out_dir, LOG_INSTANCE), "\n".join(lines) + "\n")
    return InstanceResult(iid, "error", reason)

  if not tasks_lib.patch_files(prediction["model_patch"]):
    # Text without a file header would apply as no change here; git apply rejects it.
    lines.append(f"{APPLY_PATCH_FAIL}:\nthe patch names no file (no diff headers)")
    return error("patch apply failed: the patch names no file (no diff headers)")
  try:
    original = await asyncio.to_thread(tasks_lib.load_repo_files, task)
    try:
      patched, how = apply_prediction(original, prediction["model_patch"])
    except ValueError as e:
      lines.append(f"{APPLY_PATCH_FAIL}:\n{e}")
      return error(f"patch apply failed: {e}")
    lines.append(f"{APPLY_PATCH_PASS} ({how})")
    outcome = await swe.grade_submission(task, patched, make_sandbox, original=original)
  except SandboxError as e:
    return error(f"the sandbox failed: {e}")
  except (OSError, ValueError, tasks_lib.GitError) as e:  # the repository, or its test patch
    return error(f"{type(e).__name__}: {e}")
  except Exception as e:  # one instance's failure must not end the others' grading
    lines.append(traceback.format_exc().rstrip())
    return error(f"unexpected {type(e).__name__} while grading: {e}")
  reason = outcome.verdict.details.get("reason", "")
  if outcome.stage == "refused":  # a change to test configuration, or an unsafe path
    return error(reason)
  lines.append(f"Changed: {', '.join(outcome.verdict.details.get('applied', [])) or 'nothing'}"
               f"; test files left as the task has them: "
               f"{', '.join(outcome.verdict.details.get('restored', [])) or 'none'}")
  if outcome.stage == "not_written":
    return error(reason)
  output = output_log(outcome, task.timeout)
  _write(os.path.join(out_dir, LOG_TEST_OUTPUT), output)
  if outcome.run.cause in _ENVIRONMENT_CAUSES:
    return error(reason)
  report = instance_report(iid, outcome, output)
  if outcome.stage != "graded":
    lines.append(f"No trusted test results: {reason}")
  lines.append(f"Result for {iid}: resolved: {report[iid]['resolved']}")
  _write(os.path.join(out_dir, LOG_INSTANCE), "\n".join(lines) + "\n")
  _write(os.path.join(out_dir, LOG_REPORT), json.dumps(report, indent=4))
  return InstanceResult(iid, "resolved" if report[iid]["resolved"] else "unresolved")


# ----------------------------------------------------------------------------- a run


def run_report(predictions: Mapping[str, Mapping[str, Any]], tasks: Sequence[Task], run_id: str,
               log_dir: str = LOG_DIR) -> dict:
  """The run's report, as swebench's `make_run_report` computes it from the logs on disk.

  Args:
    predictions: all predictions, by instance_id.
    tasks: the dataset's tasks (after --instance_ids).
    run_id: the run.
    log_dir: the root of the instance logs.

  Returns:
    The report's dict (module docstring).
  """
  ids = {k: set() for k in ("completed", "resolved", "unresolved", "error", "incomplete",
                            "empty_patch", "infra_failure", "ambiguous_failure")}
  dirs = {}
  for task in tasks:
    iid = task.instance_id
    pred = predictions.get(iid)
    if pred is None:
      ids["incomplete"].add(iid)
    elif pred.get("model_patch") in ("", None):
      ids["empty_patch"].add(iid)
    else:
      dirs[iid] = instance_dir(log_dir, run_id, pred)
      path = os.path.join(dirs[iid], LOG_REPORT)
      if not os.path.exists(path):
        ids["error"].add(iid)
        continue
      ids["completed"].add(iid)
      entry = read_report(path, iid)
      if entry is None or "resolved" not in entry:
        ids["error"].add(iid)
      else:
        ids["resolved" if entry["resolved"] else "unresolved"].add(iid)
  reasons = {}
  for iid in ids["unresolved"] | ids["error"]:
    text = []
    for name in (LOG_TEST_OUTPUT, LOG_INSTANCE):
      try:
        with open(os.path.join(dirs[iid], name), encoding="utf-8", errors="replace") as f:
          text.append(f.read())
      except OSError:
        pass
    found = classify_failure("\n".join(text))
    if found:
      reasons[iid] = found[0]
      ids["infra_failure" if found[1] == "environment" else "ambiguous_failure"].add(iid)
  out: dict[str, Any] = {"total_instances": len(tasks), "submitted_instances": len(predictions)}
  for k in ("completed", "resolved", "unresolved", "infra_failure", "ambiguous_failure",
            "empty_patch", "error"):
    out[f"{k}_instances"] = len(ids[k])
  for k in ("completed", "incomplete", "empty_patch"):
    out[f"{k}_ids"] = sorted(ids[k])
  out["submitted_ids"] = sorted(predictions)
  for k in ("resolved", "unresolved", "infra_failure", "ambiguous_failure"):
    out[f"{k}_ids"] = sorted(ids[k])
  out["failure_reasons"] = dict(sorted(reasons.items()))
  out["error_ids"] = sorted(ids["error"])
  out["schema_version"] = SCHEMA_VERSION
  return out


def select(tasks: Sequence[Task], predictions: Mapping[str, Any],
           instance_ids: Optional[Sequence[str]] = None) -> list[Task]:
  """The dataset's tasks to report on, in dataset order.

  Raises:
    ValueError: a prediction, or one of `instance_ids`, names no row of the dataset.
  """
  known = {t.instance_id for t in tasks}
  for what, names in (("predictions", predictions), ("--instance_ids", instance_ids or ())):
    unknown = sorted(set(names) - known)
    if unknown:
      raise ValueError(f"{what}: {len(unknown)} instance_id(s) not in the dataset: "
                       f"{', '.join(unknown[:20])}")
  wanted = set(instance_ids or known)
  return [t for t in tasks if t.instance_id in wanted]


async def evaluate(tasks: Sequence[Task], predictions: Mapping[str, Mapping[str, Any]], *,
                   run_id: str, make_sandbox: SandboxFactory, log_dir: str = LOG_DIR,
                   max_workers: int = 4, instance_ids: Optional[Sequence[str]] = None,
                   timeout: Optional[float] = None, progress: bool = True
                   ) -> tuple[dict, list[InstanceResult]]:
  """Grades predictions on the dataset's tasks (module docstring).

  Args:
    tasks: all rows of the dataset, as tasks.
    predictions: {instance_id: prediction} (`load_predictions`).
    run_id: names the run's log directory; a report.json already in it is reused.
    make_sandbox: the verifier's fresh sandboxes (`envs.episode.make_sandbox_factory`).
    log_dir: the root of the instance logs.
    max_workers: instances graded at once.
    instance_ids: grade and report only these rows (default: all).
    timeout: seconds for each test run (default: each task's `timeout`).
    progress: show a progress bar (tqdm, on stderr).

  Returns:
    (the run's report `run_report`, each graded or empty prediction's result).

  Raises:
    ValueError: a prediction or instance id not in the dataset, a bad timeout or max_workers,
      a run_id / model name / instance_id that cannot name a directory.
  """
  if max_workers < 1:
    raise ValueError(f"--max_workers={max_workers}: expected >= 1")
  if timeout is not None and not 0 < timeout <= 3600:
    raise ValueError(f"--timeout={timeout!r}: expected seconds in (0, 3600]")
  chosen = select(tasks, predictions, instance_ids)
  results: list[InstanceResult] = []
  todo = []
  for task in chosen:
    pred = predictions.get(task.instance_id)
    if pred is None:
      continue
    if pred["model_patch"] in ("", None):
      results.append(InstanceResult(task.instance_id, "empty_patch"))
      continue
    out = instance_dir(log_dir, run_id, pred)
    entry = read_report(os.path.join(out, LOG_REPORT), task.instance_id)
    if entry is not None and "resolved" in entry:
      results.append(InstanceResult(task.instance_id,
                                    "resolved" if entry["resolved"] else "unresolved",
                                    reused=True))
      continue
    if timeout is not None:
      task = dataclasses.replace(task, timeout=float(timeout))
    todo.append((task, pred, out))
  bar = None
  counts = {"resolved": sum(r.status == "resolved" for r in results), "error": 0}
  total = len(todo) + sum(r.reused for r in results)  # the patches, graded now or before
  if progress and todo:
    from tqdm import tqdm  # only the CLI's runs draw a bar
    bar = tqdm(total=total, initial=total - len(todo), desc="grading", unit="instance",
               smoothing=0)

  async def one(task, pred, out) -> InstanceResult:
    async with gate:
      result = await grade_prediction(task, pred, make_sandbox, out)
    if result.status in counts:
      counts[result.status] += 1
    if result.status == "error":
      log.info("%s: %s", result.instance_id, result.error)
    if bar is not None:
      bar.update(1)
      bar.set_postfix_str(f"resolved {counts['resolved']}/{total}, errors {counts['error']}")
    return result
  gate = asyncio.Semaphore(max_workers)
  try:
    results += await asyncio.gather(*(one(*item) for item in todo))
  finally:
    if bar is not None:
      bar.close()
  return run_report(predictions, chosen, run_id, log_dir), results


# ----------------------------------------------------------------------------- command line


def load_dataset(path: str, env_from: str = "none") -> list[Task]:
  """The SWE rows of a .jsonl or .parquet file, as tasks (`envs.tasks` loaders).

  Args:
    path: the file.
    env_from: where a row without an `environment` gets one (`envs.tasks.swe_task_from_dict`):
      "none", "swebench" (swebench's install table) or "repository" (its own metadata).
  """
  if path.endswith(".parquet"):
    return tasks_lib.load_swe_parquet(path, env_from=env_from)
  return tasks_lib.load_swe_jsonl(path, env_from=env_from)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m envs.evaluate", description=(
      "Grade model predictions on SWE rows in sandboxes; write swebench's reports."))
  p.add_argument("--dataset", required=True, help="SWE rows, .jsonl or .parquet")
  p.add_argument("--predictions", required=True,
                 help="swebench predictions, .json or .jsonl, or 'gold' (reference patches)")
  p.add_argument("--report", required=True, help="where the run's report (JSON) goes")
  p.add_argument("--run_id", default=None,
                 help="names the run's logs (default: the predictions file's name)")
  p.add_argument("--backend", default="bwrap", choices=("bwrap", "docker"),
                 help="sandbox of each test run")
  p.add_argument("--max_workers", type=int, default=4, help="instances graded at once")
  p.add_argument("--instance_ids", nargs="+", default=None, help="grade only these rows")
  p.add_argument("--timeout", type=float, default=None,
                 help="seconds for each test run (default: the row's, else 120)")
  p.add_argument("--log_dir", default=LOG_DIR, help="root of the per-instance logs")
  p.add_argument("--env_from", default="none", choices=("none", "swebench", "repository"),
                 help="where rows without an 'environment' get the one their sandboxes start "
                      "from: swebench's install table, or the repository's metadata")
  p.add_argument("--memory_mb", type=int, default=Limits.memory_mb,
                 help="memory of each sandbox (MiB)")
  p.add_argument("--disk_mb", type=int, default=Limits.disk_mb,
                 help="size of each sandbox's workspace and /tmp (MiB)")
  p.add_argument("--no_progress", action="store_true", help="no progress bar")
  return p


def main(argv: Optional[Sequence[str]] = None,
         make_sandbox: Optional[Callable[[Task], Any]] = None) -> int:
  """The command line (module docstring). Returns the exit status: 0 when the report is
  written, 2 for bad arguments or inputs (the message on stderr)."""
  args = _parser().parse_args(argv)
  for flag in ("memory_mb", "disk_mb"):
    if getattr(args, flag) < 1:
      print(f"error: --{flag}={getattr(args, flag)}: expected a positive number of MiB",
            file=sys.stderr)
      return 2
  try:
    tasks = load_dataset(args.dataset, args.env_from)
    # As swebench's: the gold predictions of --instance_ids are those rows' only.
    gold_of = [t for t in tasks if t.instance_id in args.instance_ids] if args.instance_ids \
        else tasks
    predictions = load_predictions(args.predictions, gold_of)
    run_id = args.run_id or os.path.splitext(os.path.basename(args.predictions))[0]
    make = make_sandbox or make_sandbox_factory(
        args.backend, limits=Limits(memory_mb=args.memory_mb, disk_mb=args.disk_mb))
    report, results = asyncio.run(evaluate(
        tasks, predictions, run_id=run_id, make_sandbox=make, log_dir=args.log_dir,
        max_workers=args.max_workers, instance_ids=args.instance_ids, timeout=args.timeout,
        progress=not args.no_progress))
  except (ValueError, OSError) as e:  # TaskFormatError and PredictionError are ValueErrors
    print(f"error: {e}", file=sys.stderr)
    return 2
  os.makedirs(os.path.dirname(os.path.abspath(args.report)), exist_ok=True)
  with open(args.report, "w", encoding="utf-8") as f:
    f.write(json.dumps(report, indent=4) + "\n")
  for r in results:
    if r.status == "error":
      print(f"{r.instance_id}: error: {r.error}", file=sys.stderr)
  print(f"resolved {report['resolved_instances']}/{report['total_instances']} "
        f"(completed {report['completed_instances']}, errors {report['error_instances']}, "
        f"empty patches {report['empty_patch_instances']}, incomplete "
        f"{len(report['incomplete_ids'])}); report: {args.report}")
  return 0


if __name__ == "__main__":
  logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
  sys.exit(main())
