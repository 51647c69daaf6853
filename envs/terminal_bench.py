"""Terminal-Bench-style shell tasks ("shell" kind): load a task directory.

A task directory keeps Terminal-Bench's layout and names:

  <task-id>/
    task.yaml      instruction, difficulty, max_agent_timeout_sec, max_test_timeout_sec,
                   parser_name ("pytest", Terminal-Bench's default, or ours "exit_code"),
                   and any other fields (author_email, category, tags ...: kept in metadata)
    setup.sh       the environment: run with bash in the sandbox's workspace before the agent
                   starts; what it leaves there is the agent's starting state
    run-tests.sh   the check, run with bash after the agent stops, in the agent's final
                   sandbox, with $TEST_DIR naming the directory the tests were copied to
    tests/         the test files (e.g. test_outputs.py), copied into that sandbox only then
    solution.sh    the reference solution (never shown to the agent; tests run it)

Terminal-Bench builds the environment from a Dockerfile (or docker-compose.yaml); there is no
container engine where Arbor's sandboxes run (bubblewrap on the host's read-only /usr), so a
task states its environment as a shell script, `setup.sh`, instead, and a Dockerfile in the
directory is ignored. As in Terminal-Bench, tests/ and run-tests.sh stay outside the agent's
view until the check: the agent's workspace starts with setup.sh's files only.

The check (`envs.verifiers.verify_shell`) copies run-tests.sh and tests/ into a fresh directory
outside the workspace (under the sandbox's /tmp), runs `bash $TEST_DIR/run-tests.sh` from the
workspace for at most max_test_timeout_sec, and grades it by parser_name: "pytest" - reward 1
iff pytest's `-rA` summary lists at least one test and none FAILED, ERROR or XPASS; "exit_code" -
reward 1 iff run-tests.sh exits 0. Without run-tests.sh the check is `DEFAULT_RUN_TESTS`
(pytest on $TEST_DIR/test_outputs.py, run from $TEST_DIR with the workspace as $APP_DIR).

Defaults (ours): max_agent_timeout_sec 360, max_test_timeout_sec 60, difficulty "unknown".

A task folder is untrusted data: its files are read with descriptors (`envs.dataset_paths`),
never through a symbolic link. A linked task folder, task.yaml, setup.sh, run-tests.sh,
solution.sh, tests/ or file under tests/ is an error naming the task and the file (a task
skipped with that reason under `skip_bad`).

    tasks = load_terminal_bench("envs/data/terminal_bench")    # a directory of task dirs
    task = load_terminal_bench_task("envs/data/terminal_bench/csv-total")
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import yaml

from envs import dataset_paths
from envs.tasks import Task, TaskFormatError

log = logging.getLogger(__name__)

DEFAULT_AGENT_TIMEOUT = 360.0  # seconds the agent may work
DEFAULT_TEST_TIMEOUT = 60.0    # seconds of the check run
PARSERS = ("pytest", "exit_code")
# The check of a task without run-tests.sh: the hidden pytest file, run from the tests'
# directory by an isolated python3 (-I: the workspace is not on sys.path) with no configuration
# or conftest.py from outside that directory (the agent can write /tmp, the directory's
# parent); tests find the agent's files under $APP_DIR.
DEFAULT_RUN_TESTS = """#!/bin/bash
export APP_DIR="$PWD"
cd "$TEST_DIR" && python3 -I -m pytest -c /dev/null --rootdir="$TEST_DIR" \\
  --confcutdir="$TEST_DIR" -p no:cacheprovider -rA test_outputs.py
"""


def _read(task_dir: str, name: str, optional: bool = False) -> Optional[str]:
  """The text of file `name` of a task folder (never through a link); None when optional and
  missing."""
  try:
    data = dataset_paths.read_file(task_dir, name, task_dir)
  except dataset_paths.MissingPath:
    if optional:
      return None
    raise
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"{task_dir}: {name!r}: not UTF-8 text ({e.reason})") from None


def _seconds(spec: dict, field: str, default: float) -> float:
  value = spec.get(field, default)
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86400:
    raise ValueError(f"field {field!r}: {value!r}: expected seconds in (0, 86400]")
  return float(value)


def load_terminal_bench_task(task_dir: str) -> Task:
  """The "shell" task of one Terminal-Bench-style task directory (module docstring).

  Args:
    task_dir: the directory holding task.yaml.

  Returns:
    The task: id = the directory's name, problem statement = the instruction, setup_script,
    check_script (run-tests.sh), check_files (the files of tests/, {path under tests/: bytes}),
    check_parser, timeout = max_test_timeout_sec, agent_timeout =
    max_agent_timeout_sec; metadata {"format": "terminal-bench", "task_dir", "difficulty",
    "solution_path" (solution.sh, when present), the other task.yaml fields}.

  Raises:
    ValueError: "DIR/task.yaml: field 'NAME': ..." for a missing or malformed field or file;
      "DIR: 'FILE' is a symbolic link ..." for a linked file or folder.
  """
  task_dir = os.path.abspath(task_dir)
  where = os.path.join(task_dir, "task.yaml")
  text = _read(task_dir, "task.yaml")
  try:
    spec = yaml.safe_load(text)
    if not isinstance(spec, dict):
      raise ValueError(f"expected a mapping, got {spec!r:.100}")
    instruction = spec.get("instruction")
    if not isinstance(instruction, str) or not instruction.strip():
      raise ValueError(f"field 'instruction': {instruction!r:.100}: expected a non-empty string")
    parser = spec.get("parser_name", "pytest")
    if parser not in PARSERS:
      raise ValueError(f"field 'parser_name': {parser!r}: expected one of {PARSERS}")
    difficulty = spec.get("difficulty", "unknown")
    if not isinstance(difficulty, str):
      raise ValueError(f"field 'difficulty': {difficulty!r}: expected a string")
    agent_timeout = _seconds(spec, "max_agent_timeout_sec", DEFAULT_AGENT_TIMEOUT)
    test_timeout = _seconds(spec, "max_test_timeout_sec", DEFAULT_TEST_TIMEOUT)
  except (yaml.YAMLError, ValueError) as e:
    raise ValueError(f"{where}: {e}") from None
  setup = _read(task_dir, "setup.sh", optional=True) or ""
  check_script = _read(task_dir, "run-tests.sh", optional=True)
  if check_script is None:
    check_script = DEFAULT_RUN_TESTS
  try:
    files = dataset_paths.read_tree(task_dir, "tests", task_dir, links="error",
                                    skip_dirs=("__pycache__", ".pytest_cache"),
                                    keep=lambda rel: not rel.endswith((".pyc", ".pyo")))
  except dataset_paths.MissingPath:
    files = {}
  if parser == "pytest" and not files:
    raise ValueError(f"{task_dir}: parser_name 'pytest' needs test files in tests/")
  try:
    solution = dataset_paths.resolve(task_dir, "solution.sh", task_dir, kind="file")
  except dataset_paths.MissingPath:
    solution = None
  if os.path.isfile(os.path.join(task_dir, "Dockerfile")):
    log.info("%s: Dockerfile ignored (the environment is setup.sh)", task_dir)
  known = {"instruction", "difficulty", "max_agent_timeout_sec", "max_test_timeout_sec",
           "parser_name"}
  return Task(
      instance_id=os.path.basename(task_dir), kind="shell", problem_statements=(
          instruction.strip(),), setup_script=setup,
      check_script=check_script, check_files=files, check_parser=parser,
      timeout=test_timeout, agent_timeout=agent_timeout,
      metadata={"format": "terminal-bench", "task_dir": task_dir, "difficulty": difficulty,
                **({"solution_path": solution} if solution else {}),
                **{k: v for k, v in spec.items() if k not in known}})


def is_terminal_bench_dir(path: str) -> bool:
  """Whether `path` is a task directory (holds task.yaml) or a directory of them."""
  if not os.path.isdir(path):
    return False
  if os.path.isfile(os.path.join(path, "task.yaml")):
    return True
  return any(os.path.isfile(os.path.join(path, d, "task.yaml")) for d in os.listdir(path))


def load_terminal_bench(path: str, skip_bad: bool = False,
                        errors: Optional[list] = None) -> list[Task]:
  """The tasks of a task directory, or of every task directory (sorted by name) under `path`.

  Args:
    path: a directory holding task.yaml, or a directory of such directories.
    skip_bad: log and skip a bad task instead of raising.
    errors: when given, the skipped tasks' errors are appended to it.

  Returns:
    The tasks.

  Raises:
    TaskFormatError: naming the task's task.yaml and the field (unless skip_bad), or `path`
      holds no task.
  """
  if os.path.lexists(os.path.join(path, "task.yaml")):
    dirs = [path]
  else:
    dirs = [os.path.join(path, d) for d in sorted(os.listdir(path))
            if os.path.lexists(os.path.join(path, d, "task.yaml"))]
  if not dirs:
    raise TaskFormatError(f"{path}: no task.yaml in it or in its subdirectories")
  tasks = []
  for d in dirs:
    try:
      if d != path and os.path.islink(d):  # a task folder is the folder itself, not a link
        raise ValueError(f"{path}: {os.path.basename(d)!r} is a symbolic link; task folders "
                         "must be real folders")
      tasks.append(load_terminal_bench_task(d))
    except ValueError as e:
      if not skip_bad:
        raise TaskFormatError(str(e)) from None
      log.warning("skipping bad task: %s", e)
      if errors is not None:
        errors.append(TaskFormatError(str(e)))
  return tasks


def reference_solution(task: Task) -> str:
  """The task's solution.sh (tests run it as the agent would).

  Raises:
    ValueError: the task has no solution.sh.
  """
  path = task.metadata.get("solution_path")
  if not path:
    raise ValueError(f"Task {task.instance_id!r}: no solution.sh")
  return _read(os.path.dirname(path), os.path.basename(path))
