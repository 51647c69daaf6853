"""Synthesis runs: the options, the baseline, each candidate judged and journaled, the rows and
the report (the pipeline is described in `envs.synth`'s docstring)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import logging
import os
import re
import sys
import time
from typing import Any, Mapping, Optional, Sequence

from envs import aio, safe_git
from envs.environments import build
from envs.mutate import KINDS, Mutation
from envs.sandbox import Limits, SandboxError, create_sandbox
from envs.synth.candidates import REVERT, candidate_key, difficulty, draw_candidates
from envs.synth.rows import buggy_file, clean_commit, environment, slug, swe_row, write_base, \
    write_mirror, write_tree
from envs.synth.runs import PYTEST_PARSER, SandboxMaker, TestCommand, parse_test_command, \
    run_suite, test_file
from envs.synth.source import Source, SynthError, digest, load_source
from envs.synth.statements import Teacher, failure_messages, problem_statements
from envs.tasks import LOG_PARSERS, make_patch
from envs.verifiers import swe_logs
from envs.verifiers.swe import RunResult

log = logging.getLogger("envs.synth")

DESCRIPTION = "Synthesis of SWE-style bug-fixing instances from a repository and its tests."
STATEMENTS = ("template", "teacher")
ENVIRONMENTS = ("none", "repository")  # where the rows' environment comes from
DIFFICULTIES = ("easy", "medium", "hard")
_FAILING = (swe_logs.FAILED, swe_logs.ERROR, None)  # None: the test did not run at all


@dataclasses.dataclass(frozen=True)
class SynthConfig:
  """How candidates are drawn and judged.

  Attributes:
    name: the rows' `repo` ("owner/name"); default "local/<package>".
    version: the rows' `version`; default: the source's (PKG-INFO, pyproject.toml, git).
    kinds: mutation kinds (of `envs.mutate.KINDS`, and "revert" for `commits`).
    max_per_kind: at most this many candidates per kind (a seeded sample); None: all.
    max_instances: stop once this many instances are validated; None: no limit.
    runs: baseline runs of the whole suite (flaky tests are those that differ).
    workers: candidates evaluated at once (each in its own sandbox).
    commits: git revisions whose changed functions are reverted into candidates.
    statements: "template" or "teacher".
    teacher: the endpoint for statements="teacher".
    seed: the sampling seed.
    max_fail_fraction: reject a candidate failing more than this share of the candidate tests.
    timeout: seconds per suite run; None: max(60, 10 x the slowest baseline run).
    backend: sandbox backend ("bwrap", "docker", "remote"; see `envs.sandbox`).
    limits: the sandboxes' limits.
    log_parser: the swebench log parser of the test command's output (`envs.synth.runs`);
      "": "parse_log_pytest" for a pytest command.
    hide_tests: the bug commits also remove the files of the FAIL_TO_PASS tests, which come
      back in `test_patch` (what SWE-smith's "Remove F2P Tests" commit does); False: the
      agent's tree keeps every test and `test_patch` is "".
    trees: also write each instance's tree to OUT/repos/<instance_id> and give rows a
      `repo_path` (they then load without the mirror, as rows of earlier versions did).
    environment: "none": the sandboxes are the backend's own (the host's python3 under
      bwrap) and rows name no environment; "repository": the spec `envs.environments` reads
      from the repository's metadata is built (bwrap root filesystem or docker image, cached)
      and every test run of the synthesis starts from it, and the rows carry it as their
      `environment`, so they are graded where they were validated. A caller's `make_sandbox`
      must then start from that environment itself.
  """

  name: str = ""
  version: str = ""
  kinds: tuple[str, ...] = KINDS
  max_per_kind: Optional[int] = None
  max_instances: Optional[int] = None
  runs: int = 3
  workers: int = 2
  commits: tuple[str, ...] = ()
  statements: str = "template"
  teacher: Optional[Teacher] = None
  seed: int = 0
  max_fail_fraction: float = 0.5
  timeout: Optional[float] = None
  backend: str = "bwrap"
  limits: Limits = Limits()
  log_parser: str = ""
  hide_tests: bool = False
  trees: bool = True
  environment: str = "none"

  def __post_init__(self):
    def need(ok, field, what):
      if not ok:
        raise ValueError(f"SynthConfig.{field}={getattr(self, field)!r}: expected {what}")
    need(not self.name or re.match(r"^[\w.-]+/[\w.-]+$", self.name), "name", "'owner/name'")
    need(isinstance(self.version, str), "version", "a string")
    need(self.kinds and all(k in KINDS or k == REVERT for k in self.kinds), "kinds",
         f"a non-empty subset of {KINDS + (REVERT,)}")
    for field in ("max_per_kind", "max_instances"):
      v = getattr(self, field)
      need(v is None or isinstance(v, int) and v >= 1, field, "None or an integer >= 1")
    need(isinstance(self.runs, int) and self.runs >= 1, "runs", "an integer >= 1")
    need(isinstance(self.workers, int) and self.workers >= 1, "workers", "an integer >= 1")
    need(self.statements in STATEMENTS, "statements", f"one of {STATEMENTS}")
    need(self.statements != "teacher" or self.teacher is not None, "teacher",
         "a Teacher when statements='teacher'")
    need(0 < self.max_fail_fraction <= 1, "max_fail_fraction", "a share in (0, 1]")
    need(self.timeout is None or 0 < self.timeout <= 3600, "timeout", "seconds in (0, 3600]")
    need(not self.log_parser or self.log_parser in LOG_PARSERS, "log_parser",
         f"'' or one of {sorted(LOG_PARSERS)}")
    for field in ("hide_tests", "trees"):
      need(isinstance(getattr(self, field), bool), field, "True or False")
    need(self.environment in ENVIRONMENTS, "environment", f"one of {ENVIRONMENTS}")



def _ends_without_newline(path: str) -> bool:
  if not os.path.getsize(path):
    return False
  with open(path, "rb") as f:
    f.seek(-1, os.SEEK_END)
    return f.read(1) != b"\n"


def _read_journal(path: str) -> dict[str, dict]:
  out = {}
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      for line in f:
        try:
          entry = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill: that candidate reruns
          continue
        out[entry["key"]] = entry
  return out


class _Synth:
  """One synthesis run: the baseline, then every candidate, journaled as it finishes."""

  def __init__(self, source: Source, test_command: str, command: TestCommand, out: str,
               config: SynthConfig, make_sandbox: SandboxMaker):
    self.source, self.out, self.config = source, out, config
    self.test_command = test_command  # as given (the journal's fingerprint)
    self.command = command            # as the rows carry it
    self.make_sandbox = make_sandbox
    self.repo = config.name or f"local/{slug(source.package)}"
    self.sandbox_runs = 0
    self.sandbox_errors = 0  # candidates left unevaluated because a sandbox failed
    self.paths = sorted(source.files)
    self.environment = None  # the envs.environments spec the runs start from, if any

  async def run(self, files: Mapping[str, bytes], timeout: float
                ) -> tuple[RunResult, dict[str, str], float]:
    self.sandbox_runs += 1
    return await run_suite(self.make_sandbox, files, self.command, timeout)

  async def baseline(self) -> dict:
    """The baseline (read back from OUT/baseline.json when this source's is there)."""
    path = os.path.join(self.out, "baseline.json")
    # The command as given (and a parser other than pytest's): journals of earlier versions,
    # whose runs asked for the same statuses, still resume.
    what = self.test_command
    if self.command.log_parser != PYTEST_PARSER:
      what += f"\0{self.command.log_parser}"
    if self.environment is not None:  # runs in another environment are other runs
      what += f"\0environment={self.environment.key}"
    fingerprint = digest(self.source.files, what)
    if os.path.exists(path):
      with open(path) as f:
        base = json.load(f)
      if base["digest"] != fingerprint:
        raise SynthError(f"out={self.out!r} holds a run of another source or test command; "
                         "use a new output directory")
      return base
    runs, seconds = [], []
    for i in range(self.config.runs):
      run, statuses, secs = await self.run(self.source.files, self.config.timeout or 3600)
      if run.error:
        raise SynthError(f"baseline run {i + 1}: {run.error}\n{run.log[-2000:]}")
      runs.append(statuses)
      seconds.append(secs)
      log.info("synth: baseline run %d/%d: %d tests, %.1fs", i + 1, self.config.runs,
               len(runs[-1]), secs)
    tests = sorted(set().union(*runs))
    flaky = [t for t in tests if len({r.get(t) for r in runs}) > 1]
    passing = [t for t in tests if all(r.get(t) == swe_logs.PASSED for r in runs)]
    if not passing:
      raise SynthError(f"no test passes at the baseline ({len(tests)} tests ran); is the test "
                       f"command {self.test_command!r} right?")
    base = {"digest": fingerprint, "test_command": self.test_command, "runs": self.config.runs,
            "tests": len(tests), "candidate_tests": passing, "flaky": flaky,
            "ignored": [t for t in tests if t not in passing and t not in flaky],
            "timeout": self.config.timeout or round(min(3600.0, max(60.0, 10 * max(seconds))),
                                                    1),
            "seconds": seconds,
            "created_at": self.source.created_at or datetime.datetime.now(
                datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    os.makedirs(self.out, exist_ok=True)
    with open(path + ".tmp", "w") as f:
      json.dump(base, f, indent=1)
    os.replace(path + ".tmp", path)
    return base

  def classify(self, run: RunResult, statuses: Mapping[str, str], candidates: Sequence[str],
               path: str) -> tuple[Optional[str], list[str], list[str]]:
    """(rejection reason or None, FAIL_TO_PASS, PASS_TO_PASS) of one candidate run."""
    if run.error:
      return ("timeout" if "timed out" in run.error else "crashed"), [], []
    failing = [t for t in candidates if statuses.get(t) in _FAILING]
    others = [t for t in candidates if t not in failing]
    if not failing:
      return "no_failures", [], []
    if len(failing) > self.config.max_fail_fraction * len(candidates):
      return "too_many_failures", failing, []
    if any(statuses.get(t) != swe_logs.PASSED for t in others):
      return "other_tests_changed", failing, []
    if path in {test_file(t, self.command.runner, self.paths) for t in candidates}:
      return "mutated_test_module", failing, []
    return None, failing, others

  async def evaluate(self, m: Mutation, base: dict, timeout: float) -> dict:
    """The journal entry of one candidate: accepted (with its row) or rejected (why)."""
    key = candidate_key(m)
    entry = {"key": key, "kind": m.kind, "path": m.path, "function": m.function,
             "lineno": m.lineno}
    files = {**self.source.files, m.path: m.source.encode("utf-8")}
    run, statuses, _ = await self.run(files, timeout)
    reason, f2p, p2p = self.classify(run, statuses, base["candidate_tests"], m.path)
    detail = run.error or ""
    if reason is None:
      again, statuses2, _ = await self.run(files, timeout)
      reason2, f2p2, _ = self.classify(again, statuses2, base["candidate_tests"], m.path)
      if reason2 is not None or f2p2 != f2p:
        reason = "unstable"
        detail = (f"second run: {reason2 or 'kept'}, {len(set(f2p) ^ set(f2p2))} of "
                  f"{len(set(f2p) | set(f2p2))} failing tests differ")
    if reason is not None:
      return {**entry, "status": "rejected", "reason": reason, "fail_to_pass": len(f2p),
              "detail": detail}
    fix = make_patch({m.path: files[m.path]}, {m.path: self.source.files[m.path]})
    messages = failure_messages(run.output, f2p)
    statements, how = await self.statements(m, fix, messages)
    iid = f"{slug(self.repo.replace('/', '__'))}.{m.kind}__{key[:8]}"
    # The repository fields (base_commit, test_patch, ...) are the mirror's, written at the end.
    row = {"instance_id": iid, "repo": self.repo, "patch": fix,
           "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p, "problem_statement": statements[0],
           "problem_statements": statements, "version": self.source.version,
           "created_at": base["created_at"], "hints_text": "", "timeout": timeout,
           "mutation": {"kind": m.kind, "description": m.description, "path": m.path,
                        "function": m.function, "lineno": m.lineno},
           "difficulty": difficulty(fix, len(f2p)),
           "source": {"package": self.source.package, "version": self.source.version},
           "statement_source": how}
    if self.source.base_commit:
      row["source"]["commit"] = self.source.base_commit
    return {**entry, "status": "accepted", "row": row}

  async def statements(self, m: Mutation, fix: str, messages: Mapping[str, Sequence[str]]
                       ) -> tuple[list[str], dict]:
    teacher = self.config.teacher if self.config.statements == "teacher" else None
    statements, how = await asyncio.to_thread(problem_statements, messages, fix, m.path,
                                              m.source, m.lineno, teacher)
    if how.get("teacher_rejected"):
      log.info("synth: %s:%d: teacher statement(s) rejected: %s", m.path, m.lineno,
               "; ".join(how["teacher_rejected"]))
    return statements, how


async def synthesize_async(repo: str, test_command: str, out: str,
                           config: Optional[SynthConfig] = None, *,
                           make_sandbox: Optional[SandboxMaker] = None, **options) -> dict:
  """Synthesizes validated SWE instances from a repository (see the module docstring).

  Args:
    repo: a git work tree, a source directory, or a .tar.gz of one (an sdist).
    test_command: run in the tree's root: "python3 -m pytest ARGS", or a runner script of
      the repository with `log_parser` naming its log's parser (`envs.synth.runs`).
    out: the output directory (created; a rerun resumes from its journal).
    config: the synthesis options; or give them as keywords (`options`).
    make_sandbox: make_sandbox() -> a fresh sandbox (or an awaitable of one); default: a
      `config.backend` sandbox with `config.limits`.
    **options: `SynthConfig` fields (name=, max_per_kind=, workers=, ...) when no config.

  Returns:
    The report (also written to OUT/report.json); the instances are in OUT/tasks.jsonl, their
    commits in the mirror `envs.synth.mirror_dir(OUT, repo)`.

  Raises:
    ValueError: a bad repo, test_command, log_parser or option, naming it.
    TypeError: both config and options, or an unknown option.
    SynthError: the baseline cannot be run or has no passing test, OUT holds another
      source's run, or its mirror is refused or cannot be written.
  """
  if config is not None and options:
    raise TypeError(f"synthesize: give config or options ({sorted(options)}), not both")
  if isinstance(options.get("kinds"), (list, str)):
    kinds = options["kinds"]
    options["kinds"] = tuple(kinds.split(",") if isinstance(kinds, str) else kinds)
  if isinstance(options.get("commits"), (list, str)):
    commits = options["commits"]
    options["commits"] = tuple(commits.split(",") if isinstance(commits, str) else commits)
  config = config or SynthConfig(**options)
  command = parse_test_command(test_command, config.log_parser)
  start = time.monotonic()
  out = os.path.abspath(out)
  os.makedirs(out, exist_ok=True)
  source = load_source(repo, out)
  source.version = config.version or source.version
  synth = _Synth(source, test_command, command, out, config, make_sandbox or (
      lambda: create_sandbox(config.backend, limits=config.limits)))
  if config.environment == "repository":
    synth.environment = _repository_environment(out, synth)
    if make_sandbox is None:
      synth.make_sandbox = await _environment_sandboxes(out, synth)
  base = await synth.baseline()
  candidates, dropped = draw_candidates(source, config, command.runner_files)
  journal_path = os.path.join(out, "journal.jsonl")
  done = _read_journal(journal_path)
  pending = [m for m in candidates if candidate_key(m) not in done]
  accepted = sum(done.get(candidate_key(m), {}).get("status") == "accepted" for m in candidates)
  log.info("synth: %d candidates (%d finished before), %d candidate tests, %d flaky",
           len(candidates), len(candidates) - len(pending), len(base["candidate_tests"]),
           len(base["flaky"]))
  limit = asyncio.Semaphore(config.workers)
  finished = [len(candidates) - len(pending)]

  async def one(m: Mutation, journal) -> None:
    nonlocal accepted
    async with limit:
      if config.max_instances is not None and accepted >= config.max_instances:
        return
      try:
        entry = await synth.evaluate(m, base, base["timeout"])
      except (SandboxError, OSError) as e:  # the infrastructure's failure: retried on a rerun
        log.warning("synth: %s %s:%s not evaluated: %s", m.kind, m.path, m.lineno, e)
        synth.sandbox_errors += 1
        return
    accepted += entry["status"] == "accepted"
    done[entry["key"]] = entry
    journal.write(json.dumps(entry) + "\n")
    journal.flush()
    finished[0] += 1
    log.info("synth: [%d/%d] %s %s %s:%s %s", finished[0], len(candidates), entry["status"],
             m.kind, m.path, m.lineno, entry.get("reason", entry.get("row", {}).get(
                 "instance_id", "")))

  with open(journal_path, "a", encoding="utf-8") as journal:
    if _ends_without_newline(journal_path):
      journal.write("\n")  # a line cut short by a kill stays alone on its line (and is skipped)
    await asyncio.gather(*(one(m, journal) for m in pending))
  rows = [done[k]["row"] for k in map(candidate_key, candidates)
           if done.get(k, {}).get("status") == "accepted"][:config.max_instances]
  rows = _write_rows(out, synth, rows)
  report = _report(synth, base, candidates, done, dropped, rows, time.monotonic() - start)
  with open(os.path.join(out, "report.json"), "w") as f:
    json.dump(report, f, indent=1)
  return report


def _repository_environment(out: str, synth: _Synth):
  """The spec of the repository's metadata, named after the mirror's clean commit."""
  try:
    clean = clean_commit(out, synth.repo, synth.source)
    env = environment(synth.source.files, f"{synth.repo}@{clean}")
  except safe_git.RepositoryError as e:
    raise SynthError(f"out={out!r}: its mirror is refused: {e}") from None
  except safe_git.GitError as e:
    raise SynthError(str(e)) from None
  except ValueError as e:
    raise SynthError(f"environment='repository': the repository's metadata gives no "
                     f"environment: {e}") from None
  if env is None:
    raise SynthError("environment='repository': envs.environments offers no from_repository")
  return env


async def _environment_sandboxes(out: str, synth: _Synth) -> SandboxMaker:
  """Sandboxes of the config's backend that start from the synthesis' environment (built now,
  or found in the environments' cache)."""
  backend, limits = synth.config.backend, synth.config.limits
  if backend not in ("bwrap", "docker"):
    raise ValueError(f"backend={backend!r}: environment='repository' needs 'bwrap' or 'docker'")
  make = build.rootfs if backend == "bwrap" else build.docker_image
  made = await asyncio.to_thread(make, synth.environment, write_base(out, synth.source.files))
  option = {"rootfs": made} if backend == "bwrap" else {"image": made}
  return lambda: create_sandbox(backend, limits=limits, **option)


def _write_rows(out: str, synth: _Synth, rows: Sequence[dict]) -> list[dict]:
  """The mirror, the trees (`config.trees`) and OUT/tasks.jsonl of the accepted rows."""
  source, config = synth.source, synth.config
  try:
    fields = write_mirror(out, synth.repo, source, rows, synth.command, config.hide_tests)
  except safe_git.RepositoryError as e:
    raise SynthError(f"out={out!r}: its mirror is refused: {e}") from None
  except safe_git.GitError as e:
    raise SynthError(str(e)) from None
  base_dir = write_base(out, source.files) if config.trees else ""
  env = synth.environment.to_dict() if synth.environment is not None else None
  if config.trees:
    for row in rows:
      path = row["mutation"]["path"]
      write_tree(out, base_dir, source.files, {path: buggy_file(source, row)},
                 fields[row["instance_id"]]["hidden_tests"], row["instance_id"])
  final = [swe_row(row, fields[row["instance_id"]], synth.command, config.trees, env)
           for row in rows]
  with open(os.path.join(out, "tasks.jsonl.tmp"), "w", encoding="utf-8") as f:
    for row in final:
      f.write(json.dumps(row) + "\n")
  os.replace(os.path.join(out, "tasks.jsonl.tmp"), os.path.join(out, "tasks.jsonl"))
  return final


def _report(synth: _Synth, base: dict, candidates: Sequence[Mutation], done: Mapping[str, dict],
            dropped: dict, rows: Sequence[dict], seconds: float) -> dict:
  per_kind: dict[str, dict] = {}
  reasons: dict[str, int] = {}
  unevaluated = 0
  for m in candidates:
    k = per_kind.setdefault(m.kind, {"candidates": 0, "evaluated": 0, "validated": 0})
    k["candidates"] += 1
    entry = done.get(candidate_key(m))
    if entry is None:
      unevaluated += 1
      continue
    k["evaluated"] += 1
    if entry["status"] == "accepted":
      k["validated"] += 1
    else:
      reasons[entry["reason"]] = reasons.get(entry["reason"], 0) + 1
  for k in per_kind.values():
    k["yield"] = round(k["validated"] / k["evaluated"], 4) if k["evaluated"] else 0.0
  evaluated = sum(k["evaluated"] for k in per_kind.values())
  validated = sum(k["validated"] for k in per_kind.values())
  difficulties = {d: sum(r["difficulty"] == d for r in rows) for d in DIFFICULTIES}
  return {"repo": synth.repo, "package": synth.source.package, "version": synth.source.version,
          "base_commit": synth.source.base_commit, "test_command": synth.command.command,
          "log_parser": synth.command.log_parser,
          "tests": base["tests"], "candidate_tests": len(base["candidate_tests"]),
          "flaky_tests": base["flaky"], "ignored_tests": len(base["ignored"]),
          "candidates": len(candidates), "evaluated": evaluated, "unevaluated": unevaluated,
          "validated": validated, "yield": round(validated / evaluated, 4) if evaluated else 0.0,
          "instances": len(rows), "per_kind": per_kind, "rejections": reasons,
          "dropped_before_running": dropped, "difficulty": difficulties,
          "sandbox_runs": synth.sandbox_runs, "sandbox_errors": synth.sandbox_errors,
          "seconds": round(seconds, 1)}


def synthesize(repo: str, test_command: str, out: str, config: Optional[SynthConfig] = None, *,
               make_sandbox: Optional[SandboxMaker] = None, **options) -> dict:
  """`synthesize_async` from synchronous code (a notebook's running loop included)."""
  return aio.run(synthesize_async(repo, test_command, out, config, make_sandbox=make_sandbox,
                                  **options))


def summary(report: Mapping[str, Any]) -> str:
  """A few lines of text: yield per kind, rejection reasons, flaky tests, time."""
  package = f"{report['package']} {report['version']}".strip()
  lines = [f"{report['repo']} ({package}): "
           f"{report['validated']}/{report['evaluated']} candidates validated "
           f"(yield {report['yield']:.0%}), {report['instances']} instances, "
           f"{report['sandbox_runs']} sandbox runs, {report['seconds']:.0f}s"]
  for kind, k in sorted(report["per_kind"].items()):
    lines.append(f"  {kind:<24} {k['validated']:>4}/{k['evaluated']:<4} yield {k['yield']:.0%}"
                 f" ({k['candidates']} candidates)")
  if report["rejections"]:
    lines.append("  rejected: " + ", ".join(f"{r} {n}" for r, n in sorted(
        report["rejections"].items(), key=lambda x: -x[1])))
  lines.append(f"  tests: {report['tests']}, candidate tests {report['candidate_tests']}, "
               f"flaky dropped {len(report['flaky_tests'])}"
               + (f": {', '.join(report['flaky_tests'][:5])}" if report["flaky_tests"] else ""))
  return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Command line (module docstring). Prints the summary; returns 0."""
  p = argparse.ArgumentParser(prog="python -m envs.synth", description=DESCRIPTION)
  p.add_argument("--repo", required=True, help="git repository, source directory or .tar.gz")
  p.add_argument("--test_command", required=True, help='e.g. "python3 -m pytest -q tests"')
  p.add_argument("--out", required=True, help="output directory (resumable)")
  p.add_argument("--name", default="", help="the rows' repo, owner/name")
  p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated mutation kinds")
  p.add_argument("--max_per_kind", type=int, default=None)
  p.add_argument("--max_instances", type=int, default=None)
  p.add_argument("--runs", type=int, default=3, help="baseline runs (flaky test detection)")
  p.add_argument("--workers", type=int, default=2, help="sandboxes at once")
  p.add_argument("--commits", default="", help="comma-separated revisions to revert")
  p.add_argument("--statements", default="template", choices=STATEMENTS)
  p.add_argument("--teacher_url", default="", help="OpenAI-compatible API root (…/v1)")
  p.add_argument("--teacher_model", default="")
  p.add_argument("--teacher_key_env", default="OPENAI_API_KEY",
                 help="environment variable holding the API key")
  p.add_argument("--timeout", type=float, default=None, help="seconds per suite run")
  p.add_argument("--backend", default="bwrap", help="sandbox backend")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--log_parser", default="",
                 help="swebench log parser of the test output (default: parse_log_pytest)")
  p.add_argument("--hide_tests", action="store_true",
                 help="the agent's tree lacks the FAIL_TO_PASS tests' files (test_patch has them)")
  p.add_argument("--no_trees", action="store_true",
                 help="rows from the mirror only (no OUT/repos, no repo_path)")
  p.add_argument("--environment", default="none", choices=ENVIRONMENTS,
                 help="repository: build the environment of the repository's metadata, run "
                      "every test in it and name it in the rows")
  args = p.parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
  commits = tuple(c for c in args.commits.split(",") if c)
  kinds = tuple(k for k in args.kinds.split(",") if k)
  if commits and REVERT not in kinds:
    kinds += (REVERT,)
  teacher = None
  if args.statements == "teacher":
    if not (args.teacher_url and args.teacher_model):
      p.error("--statements teacher needs --teacher_url and --teacher_model")
    teacher = Teacher(args.teacher_url, args.teacher_model, args.teacher_key_env)
  config = SynthConfig(name=args.name, kinds=kinds, max_per_kind=args.max_per_kind,
                       max_instances=args.max_instances, runs=args.runs, workers=args.workers,
                       commits=commits, statements=args.statements, teacher=teacher,
                       seed=args.seed, timeout=args.timeout, backend=args.backend,
                       log_parser=args.log_parser, hide_tests=args.hide_tests,
                       trees=not args.no_trees, environment=args.environment)
  report = synthesize(args.repo, args.test_command, args.out, config)
  print(summary(report))
  print(f"instances: {os.path.join(args.out, 'tasks.jsonl')}; report: "
        f"{os.path.join(args.out, 'report.json')}")
  return 0

