"""Synthesis of SWE-style bug-fixing instances from a repository and its tests (SWE-smith style).

    report = synthesize("path/to/repo_or_sdist.tar.gz", "python3 -m pytest -q tests", "out/",
                        name="me/calc", max_per_kind=20, workers=2)   # or a SynthConfig
    print(summary(report))                                 # rows in out/tasks.jsonl

    python -m envs.synth --repo DIR_OR_TGZ --test_command "python3 -m pytest -q tests" \\
        --out DIR [--name owner/name --kinds K,... --max_per_kind N --max_instances N --runs 3 \\
        --workers 2 --commits REV,... --statements template|teacher --teacher_url URL \\
        --teacher_model M --seed 0]

The source is a local git repository (its HEAD commit), or a directory or .tar.gz of an
unpacked source distribution with its tests. Every test run happens in a FRESH sandbox (bwrap by
default) under the trusted pytest runner of `envs.verifiers.swe.run_pytest`:
1. Baseline: the whole suite runs `runs` times. Tests that pass in every run are the candidate
   tests; tests whose outcome differs between runs are flaky (dropped and listed in the report);
   tests that always fail or skip are ignored.
2. Candidates: `envs.mutate.mutations` over the non-test .py files (per kind, a seeded sample of
   at most `max_per_kind`), plus `envs.mutate.commit_reverts` of chosen commits of a git
   repository (kind "revert": one instance per changed function of a commit, used when the
   file at that commit is still HEAD's).
3. Each candidate's suite runs with the mutated file. It is kept when at least one candidate
   test fails or errors (FAIL_TO_PASS), every other candidate test still passes (PASS_TO_PASS),
   no more than `max_fail_fraction` of the candidate tests fail (more is an import error, not a
   bug), and a second run gives the same FAIL_TO_PASS set. Each rejection records its reason:
   no_failures (the suite does not notice the change), too_many_failures, other_tests_changed
   (a candidate test skipped or xfailed), mutated_test_module (a failing test lives in the
   mutated file), crashed (the run gave no trustworthy result), timeout, unstable (the second
   run disagrees). A sandbox that fails to start leaves the candidate for the next run.
4. Instances are SWE-bench rows (`OUT/tasks.jsonl`, official field names; loadable with
   `envs.tasks.load_swe_jsonl`): `patch` is the FIX (mutated -> original), `test_patch` is ""
   (the tests are in the repository), `repo_path` is the buggy tree `OUT/repos/<instance_id>`.
   Trees hard-link every unchanged file to one pristine copy (`OUT/base`), so an instance costs
   one file of disk (a copy where hard links are not possible); the trees are read-only data:
   sandboxes get copies, never the trees themselves.
5. Problem statements never show the patch. "template": the failing tests' names and their
   failure messages (pytest's `E` lines, truncated, any line holding a line of the patch left
   out) and the module under test, in three phrasings. "teacher": an OpenAI-compatible chat
   completions endpoint is shown the failing tests' output and the buggy function (never the
   fix); a reply holding a changed line of the fix, or an identifier found only in the fix, is
   rejected and the template is used in its place.
6. `OUT/report.json`: candidates, validated instances and yield per mutation kind, rejection
   reasons, flaky tests, sandbox runs and time.

Resumable: `OUT/baseline.json` keeps the baseline and `OUT/journal.jsonl` one line per finished
candidate; a rerun with the same source reuses both and runs only unfinished candidates.

Difficulty (`difficulty`), from the fix's changed lines L (added + removed) and the number F of
FAIL_TO_PASS tests: "easy" when L <= 2 and F >= 3 (a small fix that many tests point at),
"hard" when L >= 6, or F == 1 and L >= 3 (a larger fix with little signal), else "medium".
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import dataclasses
import datetime
import hashlib
import inspect
import json
import keyword
import logging
import os
import random
import re
import shutil
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from typing import Any, Awaitable, Callable, Mapping, Optional, Sequence, Union

from envs import aio, safe_git
from envs.mutate import KINDS, Mutation, commit_reverts, is_test_file, mutations
from envs.sandbox import Limits, Sandbox, SandboxError, create_sandbox
from envs.tasks import apply_patch, checkout, load_repo_files, make_patch, pytest_command, \
    reverse_patch
from envs.verifiers import swe_logs
from envs.verifiers.swe import RunResult, is_test_path, junit_key, refused_reason, run_pytest

log = logging.getLogger(__name__)

REVERT = "revert"  # the kind of commit_reverts' candidates
STATEMENTS = ("template", "teacher")
DIFFICULTIES = ("easy", "medium", "hard")
# Top-level folders whose code the test suite does not exercise as the package.
_SKIP_TOP = {"docs", "doc", "examples", "example", "benchmarks", "bench", "scripts", "tools",
             "build", "dist", ".tox", ".nox", ".venv", "venv"}
_FAILING = (swe_logs.FAILED, swe_logs.ERROR, None)  # None: the test did not run at all
_MESSAGE_LINES = 4    # failure message lines kept per test in a statement
_MESSAGE_WIDTH = 160  # characters kept per message line
_LISTED_TESTS = 5     # failing tests listed in a statement
_MIN_GUARD = 6        # patch lines shorter than this (")", "else:") are not leak evidence

# make_sandbox() -> a fresh sandbox, or an awaitable of one.
SandboxMaker = Callable[[], Union[Sandbox, Awaitable[Sandbox]]]


class SynthError(RuntimeError):
  """The source cannot be synthesized from (no passing tests, a broken baseline run, an output
  directory holding another source's run)."""


@dataclasses.dataclass(frozen=True)
class Teacher:
  """An OpenAI-compatible chat completions endpoint that writes problem statements.

  Attributes:
    base_url: the API root, e.g. "http://localhost:8000/v1" (POST {base_url}/chat/completions).
    model: the model name sent in the request.
    api_key_env: the environment variable holding the API key (no Authorization header when
      it is unset, as local servers expect).
    temperature: sampling temperature.
    timeout: seconds per request.
  """

  base_url: str
  model: str
  api_key_env: str = "OPENAI_API_KEY"
  temperature: float = 0.7
  timeout: float = 60.0


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


# ----------------------------------------------------------------------------- the source


@dataclasses.dataclass
class Source:
  """The files to synthesize from, and what the rows say about them."""

  files: dict[str, bytes]
  package: str
  version: str
  base_commit: str = ""       # the HEAD commit of a git repository
  repo_dir: Optional[str] = None  # the git work tree (commit reverts need it)
  created_at: str = ""        # the commit's date (git), else ""


def _strip_top(files: dict[str, bytes]) -> dict[str, bytes]:
  """An sdist's files without its one top-level folder ("pkg-1.0/setup.py" -> "setup.py")."""
  tops = {p.split("/", 1)[0] for p in files}
  if len(tops) == 1 and all("/" in p for p in files):
    return {p.split("/", 1)[1]: data for p, data in files.items()}
  return files


def _metadata(files: Mapping[str, bytes], fallback: str) -> tuple[str, str]:
  """(package name, version) from PKG-INFO or pyproject.toml; (fallback, "") otherwise."""
  if "PKG-INFO" in files:
    text = files["PKG-INFO"].decode("utf-8", "replace")
    name = re.search(r"^Name:\s*(.+)$", text, re.M)
    version = re.search(r"^Version:\s*(.+)$", text, re.M)
    if name:
      return name.group(1).strip(), version.group(1).strip() if version else ""
  if "pyproject.toml" in files:
    try:
      project = tomllib.loads(files["pyproject.toml"].decode("utf-8")).get("project", {})
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
      project = {}
    if isinstance(project.get("name"), str):
      return project["name"], str(project.get("version", ""))
  return fallback, ""


def load_source(path: str, work_dir: str) -> Source:
  """The files of a git repository's HEAD, or of a directory or tarball of a source tree.

  The path is the caller's; what the repository holds is not trusted: git reads it through
  `envs.safe_git` (none of its configured programs runs, a repository of another user is
  refused) and a directory's files are read without following links.

  Args:
    path: a git work tree, a directory, or a .tar / .tar.gz / .tgz archive (an sdist's single
      top-level folder is stripped).
    work_dir: where a git commit's files are checked out (a cache).

  Returns:
    The source.

  Raises:
    ValueError: naming `repo` when the path is none of these, or a repository that
      `envs.safe_git.check_repository` refuses.
    SynthError: git failed.
  """
  path = os.path.abspath(os.path.expanduser(path))
  if not os.path.exists(path):
    raise ValueError(f"repo={path!r}: does not exist")
  base = os.path.basename(path.rstrip("/"))
  fallback = re.sub(r"(\.tar\.gz|\.tgz|\.tar)$", "", base)
  if os.path.isdir(path) and os.path.lexists(os.path.join(path, ".git")):
    try:
      git_dir = safe_git.check_repository(safe_git.find_git_dir(path))
      commit = safe_git.rev_parse(git_dir, "HEAD")
      if commit is None:
        raise SynthError(f"{path}: HEAD names no commit")
      tree = checkout(git_dir, commit, os.path.join(work_dir, "checkout"), f"local/{fallback}")
      files = load_repo_files(tree)
      name, version = _metadata(files, fallback)
      date = safe_git.commit_header(git_dir, commit)[1]
      version = version or safe_git.git(git_dir, "describe", "--tags", "--always",
                                        commit).decode().strip()
    except safe_git.RepositoryError as e:
      raise ValueError(f"repo={path!r}: {e}") from None
    except safe_git.GitError as e:
      raise SynthError(str(e)) from None
    created = datetime.datetime.fromtimestamp(date, datetime.timezone.utc)
    return Source(files, name, version, commit, path, created.strftime("%Y-%m-%dT%H:%M:%SZ"))
  try:
    files = load_repo_files(path)
  except ValueError as e:
    raise ValueError(f"repo={path!r}: {e}") from None
  if not os.path.isdir(path):
    files = _strip_top(files)
  name, version = _metadata(files, fallback)
  return Source(files, name, version)


def digest(files: Mapping[str, bytes], test_command: str) -> str:
  """A fingerprint of a source and its test command (a journal belongs to exactly one)."""
  h = hashlib.sha256(test_command.encode())
  for path in sorted(files):
    h.update(f"\0{path}\0{len(files[path])}\0".encode())
    h.update(files[path])
  return h.hexdigest()


# ----------------------------------------------------------------------------- test runs


def node_statuses(statuses: Mapping[tuple[str, str], str],
                  paths: Sequence[str]) -> dict[str, str]:
  """pytest node ids of a JUnit report's tests, as `junit_key` maps them back.

  Args:
    statuses: {(classname, name): status} of `run_pytest`.
    paths: the tree's files (a classname is the longest dotted .py path it starts with).

  Returns:
    {node id: status}; tests whose id cannot be rebuilt exactly (a collection error's entry)
    are left out.
  """
  modules = {p[:-3].replace("/", "."): p for p in paths if p.endswith(".py")}
  out = {}
  for (classname, name), status in statuses.items():
    parts = classname.split(".") if classname else []
    for i in range(len(parts), 0, -1):
      module = ".".join(parts[:i])
      if module in modules:
        node = "::".join([modules[module], *parts[i:], name])
        if junit_key(node) == (classname, name):
          out[node] = status
        break
  return out


async def _sandbox(make_sandbox: SandboxMaker) -> Sandbox:
  sb = make_sandbox()
  return await sb if inspect.isawaitable(sb) else sb


async def run_suite(make_sandbox: SandboxMaker, files: Mapping[str, bytes], test_command: str,
                    timeout: float) -> tuple[RunResult, float]:
  """Runs the test command on `files` in a fresh sandbox (closed afterwards).

  pytest's short summary of failures and errors (-rfE) is asked for first, so that the
  command's own -r option, if any, wins.

  Args:
    make_sandbox: fresh sandboxes.
    files: the tree.
    test_command: "python3 -m pytest ARGS".
    timeout: seconds for the run.

  Returns:
    (the run, its seconds).
  """
  python, args = pytest_command(test_command)
  start = time.monotonic()
  sb = await _sandbox(make_sandbox)
  try:
    for path, data in files.items():
      await sb.write_file(path, data)
    run = await run_pytest(sb, ["-rfE", *args], timeout, python)
  finally:
    await sb.close()
  return run, time.monotonic() - start


# ----------------------------------------------------------------------------- statements


def failure_messages(output: str, tests: Sequence[str]) -> dict[str, list[str]]:
  """The `E` lines (exception and assertion messages) pytest printed for each failing test.

  Args:
    output: the run's whole output.
    tests: node ids.

  Returns:
    {node id: message lines}; a test without a section gets its short-summary line's message.
  """
  sections: dict[str, list[str]] = {}
  title = None
  for line in output.splitlines():
    # A section title is "___ NAME ___" (one "_" a side when NAME is long); a traceback's
    # frames are parted by "_ _ _ _" lines, which are no title.
    m = re.match(r"^_+ (.+?) _+$", line)
    if m and m.group(1).strip("_ "):
      title = re.sub(r"^ERROR at (?:setup|teardown|call) of ", "", m.group(1))
      sections.setdefault(title, [])
    elif re.match(r"^={3,}", line):
      title = None
    elif title is not None and line.startswith("E ") and line[1:].strip() not in sections[title]:
      sections[title].append(line[1:].strip())
  summary = dict(re.findall(r"^(?:FAILED|ERROR) (\S+) - (.*)$", output, re.M))
  out = {}
  for test in tests:
    tail = test.split("::", 1)[-1].replace("::", ".")
    lines = [l for l in sections.get(tail, []) if l]
    out[test] = lines or ([summary[test]] if test in summary else [])
  return out


def patch_lines(patch: str, context: bool = True) -> list[str]:
  """The stripped code lines of a diff (changed lines, and context lines when `context`)."""
  out = []
  for line in patch.splitlines():
    if line.startswith(("+++", "---", "@@", "diff ", "index ", "\\")):
      continue
    if line[:1] in "+-" or context and line[:1] == " ":
      body = line[1:].strip()
      if len(body) >= _MIN_GUARD:
        out.append(body)
  return out


def _squash(text: str) -> str:
  return re.sub(r"\s+", " ", text).strip()


def leak_reason(statement: str, fix: str, buggy_source: str) -> Optional[str]:
  """Why a problem statement gives the fix away, or None when it does not.

  Args:
    statement: the statement.
    fix: the fix (unified diff, buggy -> original).
    buggy_source: the buggy file's text.

  Returns:
    The reason: the statement holds a changed line of the fix, or an identifier that appears
    in the fix's added lines but nowhere in the buggy file.
  """
  flat = _squash(statement)
  for line in patch_lines(fix, context=False):
    if _squash(line) in flat:
      return f"holds a changed line of the fix: {line[:80]!r}"
  ident = re.compile(r"[A-Za-z_]\w*")
  added = {w for l in fix.splitlines() if l.startswith("+") and not l.startswith("+++")
           for w in ident.findall(l[1:])}
  only_fix = {w for w in added - set(ident.findall(buggy_source))
              if len(w) >= 3 and not keyword.iskeyword(w)}
  words = set(ident.findall(statement))
  if only_fix & words:
    return f"names an identifier only the fix has: {sorted(only_fix & words)[0]!r}"
  return None


def module_name(path: str) -> str:
  """The dotted module of a file ("src/pkg/a.py" -> "pkg.a"); the path when not importable."""
  parts = path.removesuffix(".py").split("/")
  if parts[0] == "src" and len(parts) > 1:
    parts = parts[1:]
  if parts[-1] == "__init__" and len(parts) > 1:
    parts = parts[:-1]
  return ".".join(parts) if all(p.isidentifier() for p in parts) else path


def template_statements(module: str, messages: Mapping[str, Sequence[str]],
                        fix: str) -> list[str]:
  """Three phrasings (expert, short, colloquial) from the failing tests and their messages.

  A message line holding any line of the fix (changed or context, `patch_lines`) is left out.

  Args:
    module: the module under test.
    messages: {failing node id: message lines} (`failure_messages`).
    fix: the fix, only to keep its lines out.

  Returns:
    The statements.
  """
  guard = [_squash(l) for l in patch_lines(fix)]
  clean = {}
  for test, lines in messages.items():
    kept = [l[:_MESSAGE_WIDTH] + ("..." if len(l) > _MESSAGE_WIDTH else "") for l in lines
            if not any(g in _squash(l) for g in guard)]
    clean[test] = kept[:_MESSAGE_LINES]
  tests = sorted(clean)
  listed = []
  for test in tests[:_LISTED_TESTS]:
    body = "".join(f"\n      {l}" for l in clean[test])
    listed.append(f"  - `{test}`" + (f":{body}" if body else ""))
  more = (f"\n  ... and {len(tests) - _LISTED_TESTS} more" if len(tests) > _LISTED_TESTS
          else "")
  expert = (f"Tests of `{module}` fail:\n\n" + "\n".join(listed) + more
            + f"\n\nThe tests are correct. Fix the code of `{module}` so that they pass, "
              "without breaking the other tests.")
  first = tests[0]
  why = f" with `{clean[first][0]}`" if clean[first] else ""
  name = first.rsplit("::", 1)[-1]
  more = len(tests) - 1
  others = f" ({more} more test{'s' if more > 1 else ''} fail{'' if more > 1 else 's'} too)"
  others = others if more else ""
  short = f"`{first}` fails{why}{others}. The bug is in `{module}`; the tests are right."
  casual = (f"hey, {name} started failing{why}{others}. pretty sure something in {module} is "
            "off, can you take a look and fix it? don't touch the tests")
  return [expert, short, casual]


_TEACHER_SYSTEM = (
    "You write bug reports for a Python project, as a user or maintainer would file them on "
    "its issue tracker. Describe the wrong behaviour that the failing tests show (inputs, "
    "expected and actual results). Never say which line is wrong, never propose a fix, and "
    "never include code from the fix. Reply with the report only.")
_TEACHER_STYLES = (
    "Write a precise report, as an experienced maintainer would.",
    "Write a short report: a title line and two or three sentences.",
    "Write a casual, colloquial message from a user who hit the problem.")


def teacher_reply(teacher: Teacher, messages: Sequence[Mapping[str, str]]) -> str:
  """One chat completion: POST {base_url}/chat/completions, choices[0].message.content.

  Args:
    teacher: the endpoint.
    messages: the chat ([{"role", "content"}]).

  Returns:
    The reply's text.

  Raises:
    OSError: the request failed (urllib.error.URLError is one).
    ValueError: the reply is not a chat completion.
  """
  body = json.dumps({"model": teacher.model, "messages": list(messages),
                     "temperature": teacher.temperature}).encode()
  headers = {"Content-Type": "application/json"}
  key = os.environ.get(teacher.api_key_env)
  if key:
    headers["Authorization"] = f"Bearer {key}"
  req = urllib.request.Request(teacher.base_url.rstrip("/") + "/chat/completions", data=body,
                               headers=headers, method="POST")
  with urllib.request.urlopen(req, timeout=teacher.timeout) as resp:
    data = json.loads(resp.read().decode("utf-8"))
  try:
    content = data["choices"][0]["message"]["content"]
  except (KeyError, IndexError, TypeError):
    raise ValueError(f"not a chat completion: {json.dumps(data)[:200]}") from None
  if not isinstance(content, str) or not content.strip():
    raise ValueError("the chat completion's content is empty")
  return content.strip()


def teacher_statements(teacher: Teacher, messages: Mapping[str, Sequence[str]], fix: str,
                       buggy_source: str, function_source: str,
                       styles: Sequence[str] = _TEACHER_STYLES
                       ) -> tuple[list[str], list[str]]:
  """Statements written by a teacher model, each checked by `leak_reason`.

  The teacher sees the failing tests with their messages (lines of the fix left out, as in
  the template) and the buggy function, never the fix.

  Args:
    teacher: the endpoint.
    messages: {failing node id: message lines}.
    fix: the fix (only to check the replies).
    buggy_source: the buggy file's text (identifiers already there are no leak).
    function_source: the buggy function's source ("" when unknown).
    styles: one request per style.

  Returns:
    (accepted statements, reasons the others were rejected).
  """
  guard = [_squash(l) for l in patch_lines(fix)]
  shown = "\n".join(f"{test}\n" + "".join(f"    {l}\n" for l in lines[:_MESSAGE_LINES]
                                          if not any(g in _squash(l) for g in guard))
                    for test, lines in sorted(messages.items())[:_LISTED_TESTS])
  user = f"Failing tests and their messages:\n{shown}"
  if function_source:
    user += f"\nThe function the tests exercise:\n```python\n{function_source}\n```\n"
  accepted, rejected = [], []
  for style in styles:
    try:
      reply = teacher_reply(teacher, [{"role": "system", "content": _TEACHER_SYSTEM},
                                      {"role": "user", "content": f"{user}\n{style}"}])
    except (OSError, ValueError) as e:
      rejected.append(f"request failed: {e}")
      continue
    reason = leak_reason(reply, fix, buggy_source)
    if reason:
      rejected.append(reason)
    else:
      accepted.append(reply)
  return accepted, rejected


def problem_statements(messages: Mapping[str, Sequence[str]], fix: str, path: str,
                       buggy_source: str, lineno: int, teacher: Optional[Teacher] = None
                       ) -> tuple[list[str], dict]:
  """An instance's phrasings: the teacher's accepted ones, else the template's.

  Args:
    messages: {failing node id: message lines} (`failure_messages`).
    fix: the fix (never shown; only to keep its lines out).
    path: the buggy file.
    buggy_source: its text.
    lineno: a line of the buggy function (the teacher is shown that function).
    teacher: the endpoint; None: template statements.

  Returns:
    (statements, {"method": "teacher" | "template", "teacher_rejected": [reasons]}).
  """
  template = template_statements(module_name(path), messages, fix)
  if teacher is None:
    return template, {"method": "template"}
  accepted, rejected = teacher_statements(teacher, messages, fix, buggy_source,
                                          function_source(buggy_source, lineno))
  how = {"method": "teacher" if accepted else "template", "teacher_rejected": rejected}
  return accepted or template, how


def function_source(source: str, lineno: int) -> str:
  """The source of the innermost function (or class) holding line `lineno`; "" when none."""
  try:
    tree = ast.parse(source)
  except SyntaxError:
    return ""
  best = None
  for node in ast.walk(tree):
    if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.lineno <= lineno <= (node.end_lineno or node.lineno)):
      if best is None or node.lineno >= best.lineno:
        best = node
  return (ast.get_source_segment(source, best) or "") if best else ""


# ----------------------------------------------------------------------------- candidates


def mutable_paths(files: Mapping[str, bytes]) -> list[str]:
  """The .py files that candidates may change: not tests (by `envs.mutate.is_test_file` and the
  verifier's rules, which would restore them), not configuration the verifier refuses to
  change, not docs / examples / build folders."""
  return [p for p in sorted(files) if p.endswith(".py") and not is_test_file(p)
          and not is_test_path(p) and refused_reason(p) is None
          and p.split("/", 1)[0] not in _SKIP_TOP]


def difficulty(fix: str, n_fail_to_pass: int) -> str:
  """"easy" | "medium" | "hard" from the fix's changed lines and the FAIL_TO_PASS count (the
  rule is in the module docstring)."""
  changed = sum(1 for l in fix.splitlines()
                if l[:1] in "+-" and not l.startswith(("+++", "---")))
  if changed <= 2 and n_fail_to_pass >= 3:
    return "easy"
  if changed >= 6 or n_fail_to_pass == 1 and changed >= 3:
    return "hard"
  return "medium"


def candidate_key(m: Mutation) -> str:
  """A stable id of a candidate: its kind, file and mutated text."""
  return hashlib.sha256(f"{m.kind}\0{m.path}\0{m.source}".encode()).hexdigest()[:16]


def draw_candidates(source: Source, config: SynthConfig) -> tuple[list[Mutation], dict]:
  """The candidates to evaluate, in evaluation order (kinds interleaved).

  Args:
    source: the source.
    config: kinds, max_per_kind, commits and seed.

  Returns:
    (candidates, {"no_change", "syntax_error", "duplicate", "skipped_files"}: counts of
    mutations dropped before any test run).
  """
  dropped = {"no_change": 0, "syntax_error": 0, "duplicate": 0, "skipped_files": 0,
             "revert_of_changed_file": 0}
  kinds = tuple(k for k in config.kinds if k != REVERT)
  pool: dict[str, list[Mutation]] = {k: [] for k in config.kinds}
  texts = {}
  for path in mutable_paths(source.files):
    try:
      texts[path] = source.files[path].decode("utf-8")
      found = mutations(texts[path], path, kinds, seed=config.seed) if kinds else []
    except (UnicodeDecodeError, SyntaxError, ValueError) as e:
      log.warning("synth: %s skipped: %s", path, e)
      dropped["skipped_files"] += 1
      continue
    for m in found:
      pool.setdefault(m.kind, []).append(m)
  if config.commits:
    if not source.repo_dir:
      raise ValueError(f"commits={list(config.commits)!r}: only a git repository has commits")
    git_dir = safe_git.find_git_dir(source.repo_dir)
    for rev in config.commits:
      for m in commit_reverts(source.repo_dir, rev):
        # The mutated text is the file at `rev`: it fits HEAD's tree only if HEAD has that file.
        if m.path in texts and safe_git.read_blob(git_dir, rev, m.path).decode(
            "utf-8", "replace").strip() == texts[m.path].strip():
          pool.setdefault(REVERT, []).append(m)
        else:
          dropped["revert_of_changed_file"] += 1
  seen = set()
  per_kind = []
  for kind, found in pool.items():
    kept = []
    for m in found:
      key = candidate_key(m)
      if m.source == texts.get(m.path):
        dropped["no_change"] += 1
      elif key in seen:
        dropped["duplicate"] += 1
      else:
        try:
          compile(m.source, m.path, "exec", dont_inherit=True)
        except (SyntaxError, ValueError):
          dropped["syntax_error"] += 1
          continue
        seen.add(key)
        kept.append(m)
    if config.max_per_kind is not None and len(kept) > config.max_per_kind:
      rng = random.Random(f"{config.seed}/{kind}")
      kept = [kept[i] for i in sorted(rng.sample(range(len(kept)), config.max_per_kind))]
    per_kind.append(kept)
  order = [m for round_ in _zip_longest(per_kind) for m in round_]
  return order, dropped


def _zip_longest(lists: Sequence[list]) -> list[list]:
  return [[l[i] for l in lists if i < len(l)] for i in range(max(map(len, lists), default=0))]


# ----------------------------------------------------------------------------- synthesis


def _slug(text: str) -> str:
  return re.sub(r"[^\w.-]+", "_", text).strip("_") or "repo"


def _write_tree(out: str, base: str, files: Mapping[str, bytes], changed: Mapping[str, bytes],
                name: str) -> str:
  """OUT/repos/NAME: the files, unchanged ones hard-linked to `base` (copied when linking
  fails); written to a temporary folder that is renamed into place."""
  final = os.path.join(out, "repos", name)
  if os.path.isdir(final):
    return final
  os.makedirs(os.path.dirname(final), exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(final))
  try:
    for path in files:
      target = os.path.join(tmp, path)
      os.makedirs(os.path.dirname(target), exist_ok=True)
      if path in changed:
        with open(target, "wb") as f:
          f.write(changed[path])
        continue
      try:
        os.link(os.path.join(base, path), target)
      except OSError:
        shutil.copyfile(os.path.join(base, path), target)
    os.rename(tmp, final)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return final


def _write_base(out: str, files: Mapping[str, bytes]) -> str:
  base = os.path.join(out, "base")
  if not os.path.isdir(base):
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=out)
    for path, data in files.items():
      os.makedirs(os.path.dirname(os.path.join(tmp, path)), exist_ok=True)
      with open(os.path.join(tmp, path), "wb") as f:
        f.write(data)
    os.rename(tmp, base)
  return base


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

  def __init__(self, source: Source, test_command: str, out: str, config: SynthConfig,
               make_sandbox: SandboxMaker):
    self.source, self.test_command, self.out, self.config = source, test_command, out, config
    self.make_sandbox = make_sandbox
    self.repo = config.name or f"local/{_slug(source.package)}"
    self.sandbox_runs = 0
    self.sandbox_errors = 0  # candidates left unevaluated because a sandbox failed
    self.paths = sorted(source.files)

  async def run(self, files: Mapping[str, bytes], timeout: float) -> tuple[RunResult, float]:
    self.sandbox_runs += 1
    return await run_suite(self.make_sandbox, files, self.test_command, timeout)

  async def baseline(self) -> dict:
    """The baseline (read back from OUT/baseline.json when this source's is there)."""
    path = os.path.join(self.out, "baseline.json")
    fingerprint = digest(self.source.files, self.test_command)
    if os.path.exists(path):
      with open(path) as f:
        base = json.load(f)
      if base["digest"] != fingerprint:
        raise SynthError(f"out={self.out!r} holds a run of another source or test command; "
                         "use a new output directory")
      return base
    runs, seconds = [], []
    for i in range(self.config.runs):
      run, secs = await self.run(self.source.files, self.config.timeout or 3600)
      if run.error:
        raise SynthError(f"baseline run {i + 1}: {run.error}\n{run.log[-2000:]}")
      runs.append(node_statuses(run.statuses, self.paths))
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

  def classify(self, run: RunResult, candidates: Sequence[str], path: str
               ) -> tuple[Optional[str], list[str], list[str]]:
    """(rejection reason or None, FAIL_TO_PASS, PASS_TO_PASS) of one candidate run."""
    if run.error:
      return ("timeout" if "timed out" in run.error else "crashed"), [], []
    statuses = node_statuses(run.statuses, self.paths)
    failing = [t for t in candidates if statuses.get(t) in _FAILING]
    others = [t for t in candidates if t not in failing]
    if not failing:
      return "no_failures", [], []
    if len(failing) > self.config.max_fail_fraction * len(candidates):
      return "too_many_failures", failing, []
    if any(statuses.get(t) != swe_logs.PASSED for t in others):
      return "other_tests_changed", failing, []
    if path in {t.split("::", 1)[0] for t in candidates}:
      return "mutated_test_module", failing, []
    return None, failing, others

  async def evaluate(self, m: Mutation, base: dict, timeout: float) -> dict:
    """The journal entry of one candidate: accepted (with its row) or rejected (why)."""
    key = candidate_key(m)
    entry = {"key": key, "kind": m.kind, "path": m.path, "function": m.function,
             "lineno": m.lineno}
    files = {**self.source.files, m.path: m.source.encode("utf-8")}
    run, _ = await self.run(files, timeout)
    reason, f2p, p2p = self.classify(run, base["candidate_tests"], m.path)
    detail = run.error or ""
    if reason is None:
      again, _ = await self.run(files, timeout)
      reason2, f2p2, _ = self.classify(again, base["candidate_tests"], m.path)
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
    iid = f"{_slug(self.repo.replace('/', '__'))}.{m.kind}__{key[:8]}"
    row = {"instance_id": iid, "repo": self.repo, "patch": fix, "test_patch": "",
           "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p, "problem_statement": statements[0],
           "problem_statements": statements, "version": self.source.version,
           "created_at": base["created_at"], "hints_text": "", "repo_path": f"repos/{iid}",
           "test_command": self.test_command, "timeout": timeout,
           "mutation": {"kind": m.kind, "description": m.description, "path": m.path,
                        "function": m.function, "lineno": m.lineno},
           "difficulty": difficulty(fix, len(f2p)),
           "source": {"package": self.source.package, "version": self.source.version},
           "statement_source": how}
    if self.source.base_commit:
      row["base_commit"] = self.source.base_commit
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
    test_command: "python3 -m pytest ARGS", run in the tree's root.
    out: the output directory (created; a rerun resumes from its journal).
    config: the synthesis options; or give them as keywords (`options`).
    make_sandbox: make_sandbox() -> a fresh sandbox (or an awaitable of one); default: a
      `config.backend` sandbox with `config.limits`.
    **options: `SynthConfig` fields (name=, max_per_kind=, workers=, ...) when no config.

  Returns:
    The report (also written to OUT/report.json); the instances are in OUT/tasks.jsonl.

  Raises:
    ValueError: a bad repo, test_command or option, naming it.
    TypeError: both config and options, or an unknown option.
    SynthError: the baseline cannot be run or has no passing test, or OUT holds another
      source's run.
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
  try:
    pytest_command(test_command)
  except ValueError as e:
    raise ValueError(f"test_command: {e}") from None
  start = time.monotonic()
  out = os.path.abspath(out)
  os.makedirs(out, exist_ok=True)
  source = load_source(repo, out)
  source.version = config.version or source.version
  make_sandbox = make_sandbox or (lambda: create_sandbox(config.backend, limits=config.limits))
  synth = _Synth(source, test_command, out, config, make_sandbox)
  base = await synth.baseline()
  candidates, dropped = draw_candidates(source, config)
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
  base_dir = _write_base(out, source.files)
  for row in rows:
    path = row["mutation"]["path"]
    buggy = apply_patch({path: source.files[path]}, reverse_patch(row["patch"]))[path]
    _write_tree(out, base_dir, source.files, {path: buggy}, row["instance_id"])
  with open(os.path.join(out, "tasks.jsonl.tmp"), "w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
  os.replace(os.path.join(out, "tasks.jsonl.tmp"), os.path.join(out, "tasks.jsonl"))
  report = _report(synth, base, candidates, done, dropped, rows, time.monotonic() - start)
  with open(os.path.join(out, "report.json"), "w") as f:
    json.dump(report, f, indent=1)
  return report


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
          "base_commit": synth.source.base_commit, "test_command": synth.test_command,
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
  p = argparse.ArgumentParser(prog="python -m envs.synth", description=__doc__.split("\n")[0])
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
                       seed=args.seed, timeout=args.timeout, backend=args.backend)
  report = synthesize(args.repo, args.test_command, args.out, config)
  print(summary(report))
  print(f"instances: {os.path.join(args.out, 'tasks.jsonl')}; report: "
        f"{os.path.join(args.out, 'report.json')}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
