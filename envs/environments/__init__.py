"""Environments: what a sandbox starts from, described once and built for every backend.

This package owns
- `spec`: `Environment` (Debian suite / Python version, Debian packages, pip requirements,
  install commands, variables) and its content key; spec files (JSON / TOML);
- `sources`: where specs come from (a registry: swebench's install table, the repository's
  own metadata; plus user files);
- `metadata`: a repository's declared dependencies, parsed without running any of it;
- `debian`: cached Debian root filesystems (mmdebstrap) and their Docker images;
- `build`: an environment's layers, as a root filesystem (bwrap) and an image (Docker), one
  or many at a time;
- `cache`: the content-addressed, atomic build cache they share (ARBOR_ENV_CACHE);
- `__main__`: `python -m envs.environments build --tasks ROWS.jsonl`.
Tasks name an environment (`envs.tasks.Task.environment`); `envs.episode` starts their
sandboxes from its build.
"""

from envs.environments.build import build_many, for_task
from envs.environments.sources import (SOURCES, from_file, from_repository, from_swebench,
                                       load_swebench_specs)
from envs.environments.spec import Environment, SpecError, from_dict, load_file

__all__ = ["Environment", "SOURCES", "SpecError", "build_many", "for_task", "from_dict",
           "from_file", "from_repository", "from_swebench", "load_file", "load_swebench_specs"]
