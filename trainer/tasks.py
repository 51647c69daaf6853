"""The tasks a run samples on: each RL step's tasks, and the held-out tasks of an eval.

    source = TaskSource(config, workdir)
    tasks = source.for_step(step)           # rl.prompts_per_step tasks, the same on a rerun
    held_out = held_out_tasks(config, directory)   # eval.num_tasks tasks no training task shares

Generated tasks come from envs.taskgen (level `rl.task_level`, seed `rl.task_seed`): RL steps
take the "train" split in order, evals the "eval" split (programs that no generated training
task, SFT demo or RL, ever has). A task file or directory (`rl.tasks`, `eval.tasks`) is read
with `envs.episode.load_task_file`; `eval.tasks` may list several, comma-separated, "generated"
among them (a mixed eval set).

Every task gets the environment its sandboxes start from (`with_environments`): SWE rows
without an `environment` field one from `rl.env_from`, every other task without one (the
generated tasks among them) `rl.default_environment` (`envs.task_environments`).
"""

from __future__ import annotations

import os
import tempfile
from typing import Optional

import ml_collections

from envs import task_environments, taskgen
from envs.episode import load_task_file
from envs.tasks import Task
from trainer import config as config_lib


class TaskSource:
  """The tasks of RL step s: positions (s-1)·P .. s·P-1 of the generated "train" split, or of
  the task file `rl.tasks` (cycling through it), P = `rl.prompts_per_step`. Step s always
  draws the same tasks, so a resumed run continues the task sequence.

  Args:
    config: the run's config (its `rl` section).
    workdir: generated tasks are written under <workdir>/tasks (a temporary directory when
      the workdir is remote).

  Raises:
    ConfigError: the task file holds no task.
  """

  def __init__(self, config: ml_collections.ConfigDict, workdir: str):
    self.rl = config.rl
    self.per_step = config.rl.prompts_per_step
    self._file: Optional[list[Task]] = None
    self._dir = (tempfile.mkdtemp(prefix="arbor-rl-tasks-") if config_lib.is_remote(workdir)
                 else os.path.join(workdir, "tasks"))
    self._config = config
    if config.rl.tasks:
      self._file = with_environments(config,
                                     load_task_file(config.rl.tasks, **swe_sources(config))[0])
      if not self._file:
        raise config_lib.ConfigError(f"config.rl.tasks={config.rl.tasks!r}: no tasks")

  def for_step(self, step: int) -> list[Task]:
    """The `rl.prompts_per_step` tasks of `step` (steps count from 1)."""
    start = (step - 1) * self.per_step
    if self._file is not None:
      return [self._file[(start + j) % len(self._file)] for j in range(self.per_step)]
    out = os.path.join(self._dir, f"step_{step}")
    return with_environments(self._config, taskgen.write_tasks(
        out, self.per_step, self.rl.task_level, self.rl.task_seed, start, split="train"))


def swe_sources(config: ml_collections.ConfigDict) -> dict:
  """{"mirror", "cache_dir"} of SWE rows from config.rl (None where unset: the environment's)."""
  return {"mirror": config.rl.get("swe_mirror") or None,
          "cache_dir": config.rl.get("swe_cache") or None}


def with_environments(config: ml_collections.ConfigDict, tasks: list[Task]) -> list[Task]:
  """`tasks`, each with the environment of `rl.env_from` / `rl.default_environment`
  (`envs.task_environments.with_environments`; a task's own `environment` is kept).

  Raises:
    ConfigError: naming rl.env_from or rl.default_environment when a task's environment
      cannot be derived or the default cannot be read.
  """
  env_from = config.rl.get("env_from", "none")
  try:
    default = task_environments.default_environment(config.rl.get("default_environment", ""),
                                                    "rl.default_environment")
  except ValueError as e:
    raise config_lib.ConfigError(f"config.{e}") from None
  try:
    return task_environments.with_environments(tasks, env_from, default)
  except ValueError as e:
    raise config_lib.ConfigError(f"config.rl.env_from={env_from!r}: {e}") from None


def build_environments(config: ml_collections.ConfigDict, tasks: list[Task],
                       progress=None) -> list[str]:
  """Builds the distinct environments of `tasks` for `rl.sandbox` now (each once, cached by
  content), so that a run's first episodes do not wait for mmdebstrap or pip; returns the
  root filesystems / image tags (`envs.task_environments.build_all`)."""
  return task_environments.build_all(tasks, config.rl.sandbox, progress)


GENERATED = "generated"  # the entry of eval.tasks that stands for generated tasks


def held_out_tasks(config: ml_collections.ConfigDict, directory: str) -> list[Task]:
  """The eval tasks.

  `eval.tasks` is "" (generated tasks only) or a comma-separated list of entries, each a task
  file or directory (`envs.episode.load_task_file`: a directory of Terminal-Bench-style tasks,
  a LiveCodeBench JSONL, a SWE JSONL or Parquet file, a problems JSONL) or "generated"; every
  entry gives its first `eval.num_tasks` tasks, in the order of the list. "generated" is
  `eval.num_tasks` tasks with distinct programs from the "eval" split of envs.taskgen, level
  `rl.task_level`, seed `rl.task_seed`.

  Args:
    config: the run's config.
    directory: where generated tasks are written.

  Returns:
    The tasks.

  Raises:
    ConfigError: naming eval.tasks, for an entry that holds no task or an instance_id that
      two entries share.
  """
  entries = [e.strip() for e in config.eval.tasks.split(",") if e.strip()] or [GENERATED]
  tasks: list[Task] = []
  seen: dict[str, str] = {}
  for entry in entries:
    if entry == GENERATED:
      part = taskgen.write_tasks(directory, config.eval.num_tasks, config.rl.task_level,
                                 config.rl.task_seed, split="eval", unique=True)
    else:
      part = load_task_file(entry, **swe_sources(config))[0][:config.eval.num_tasks]
    if not part:
      raise config_lib.ConfigError(f"config.eval.tasks={config.eval.tasks!r}: {entry!r} "
                                   "holds no task")
    for t in part:
      if t.instance_id in seen:
        raise config_lib.ConfigError(
            f"config.eval.tasks={config.eval.tasks!r}: instance_id {t.instance_id!r} is in "
            f"both {seen[t.instance_id]!r} and {entry!r}")
      seen[t.instance_id] = entry
    tasks += part
  return with_environments(config, tasks)
