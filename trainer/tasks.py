"""The tasks a run samples on: each RL step's tasks, and the held-out tasks of an eval.

    source = TaskSource(config, workdir)
    tasks = source.for_step(step)           # rl.prompts_per_step tasks, the same on a rerun
    held_out = held_out_tasks(config, directory)   # eval.num_tasks tasks no training task shares

Generated tasks come from envs.taskgen (level `rl.task_level`, seed `rl.task_seed`): RL steps
take the "train" split in order, evals the "eval" split (programs that no generated training
task, SFT demo or RL, ever has). A task file (`rl.tasks`, `eval.tasks`) is read with
`envs.episode.load_task_file`.
"""

from __future__ import annotations

import os
import tempfile
from typing import Optional

import ml_collections

from envs import taskgen
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
    if config.rl.tasks:
      self._file = load_task_file(config.rl.tasks, **swe_sources(config))[0]
      if not self._file:
        raise config_lib.ConfigError(f"config.rl.tasks={config.rl.tasks!r}: no tasks")

  def for_step(self, step: int) -> list[Task]:
    """The `rl.prompts_per_step` tasks of `step` (steps count from 1)."""
    start = (step - 1) * self.per_step
    if self._file is not None:
      return [self._file[(start + j) % len(self._file)] for j in range(self.per_step)]
    out = os.path.join(self._dir, f"step_{step}")
    return taskgen.write_tasks(out, self.per_step, self.rl.task_level, self.rl.task_seed, start,
                               split="train")


def swe_sources(config: ml_collections.ConfigDict) -> dict:
  """{"mirror", "cache_dir"} of SWE rows from config.rl (None where unset: the environment's)."""
  return {"mirror": config.rl.get("swe_mirror") or None,
          "cache_dir": config.rl.get("swe_cache") or None}


def held_out_tasks(config: ml_collections.ConfigDict, directory: str) -> list[Task]:
  """The eval tasks.

  Args:
    config: `eval.tasks` (a task file: its first `eval.num_tasks` tasks) or "" (that many
      generated tasks with distinct programs from the "eval" split of envs.taskgen, level
      `rl.task_level`, seed `rl.task_seed`).
    directory: where generated tasks are written.
  """
  if config.eval.tasks:
    return load_task_file(config.eval.tasks, **swe_sources(config))[0][:config.eval.num_tasks]
  return taskgen.write_tasks(directory, config.eval.num_tasks, config.rl.task_level,
                             config.rl.task_seed, split="eval", unique=True)
