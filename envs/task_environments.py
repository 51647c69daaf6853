"""Giving loaded tasks their environments: the run-wide `env_from` and default environment.

    default = default_environment("bookworm-pytest")      # a preset, a spec file, or "" (None)
    tasks = with_environments(tasks, env_from="repository", default=default)
    build_all(tasks, "bwrap", progress=print)              # every distinct one, built once

A task keeps the `environment` it has (its row's field). A SWE task without one gets one from
source `env_from` ("swebench" | "repository": `envs.environments.sources.SOURCES`, read from
its repository's files or its mirror), as `envs.tasks.load_tasks(env_from=...)` does for the
rows it parses. Every other task without one (generated tasks, problems, SWE rows when
`env_from` is "none") that names no `rootfs` or `image_name` of its own gets `default`, so its
tests run with the environment's Python and pytest instead of the sandbox host's.

Presets (`PRESETS`): "bookworm-pytest" is Debian bookworm's python3 (3.11) with its
python3-pytest package (pytest 7.2.1): the interpreter and pytest a Debian bookworm host
installs with `apt-get install python3-pytest`, so a run that moves its tests from such a host
into this environment computes the same verdicts. It is a Debian base alone (no pip layer),
one cached mmdebstrap build shared by every task that names it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional, Sequence

from envs import repo_files
from envs.environments import build, sources
from envs.environments import spec as env_spec
from envs.environments.sources import ENV_FROM  # "none" + the sources

# name -> the spec data of a named environment (`env_spec.from_dict`).
PRESETS = {
    "bookworm-pytest": {"suite": "bookworm", "system_packages": ["python3-pytest"]},
}


def preset(name: str) -> env_spec.Environment:
  """The environment of preset `name`.

  Raises:
    ValueError: an unknown name (naming the presets).
  """
  if name not in PRESETS:
    raise ValueError(f"environment preset {name!r}: expected one of {sorted(PRESETS)}")
  return env_spec.from_dict(PRESETS[name])


def default_environment(value: str, field: str = "default_environment"
                        ) -> Optional[env_spec.Environment]:
  """The environment a setting names: "" -> None, a preset name (`PRESETS`), or the path of
  a spec file (.json / .toml, `envs.environments.spec.load_file`).

  Raises:
    ValueError: "FIELD=VALUE: ..." for a value that is none of these, a missing file, or a
      file whose spec is malformed (the file's error naming its bad field).
  """
  if not isinstance(value, str):
    raise ValueError(f"{field}={value!r}: expected a string")
  if not value:
    return None
  if value in PRESETS:
    return preset(value)
  if value.endswith((".json", ".toml")):
    if not os.path.isfile(value):
      raise ValueError(f"{field}={value!r}: no such spec file")
    try:
      return env_spec.load_file(value)
    except env_spec.SpecError as e:
      raise ValueError(f"{field}={value!r}: {e}") from None
  raise ValueError(f"{field}={value!r}: expected '' (none), a preset ({', '.join(PRESETS)}) "
                   "or a .json / .toml spec file")


def _from_source(task, env_from: str, swebench_specs: Any) -> env_spec.Environment:
  """The environment source `env_from` derives for a SWE task from its repository."""
  row = {**dict(task.metadata), "repo": task.repo, "base_commit": task.base_commit,
         "instance_id": task.instance_id}
  files = repo_files.load_repo_files(task.repo_path) if task.repo_path else None
  return sources.SOURCES[env_from](row, files=files, git_dir=task.mirror, specs=swebench_specs)


def with_environments(tasks: Sequence, env_from: str = "none",
                      default: Optional[env_spec.Environment] = None,
                      swebench_specs: Any = None) -> list:
  """The tasks, each with the environment its sandboxes start from (the module docstring).

  Args:
    tasks: `envs.tasks.Task`s; those with an `environment` are returned unchanged.
    env_from: "none" | "swebench" | "repository": where SWE tasks without one get one.
    default: the environment of every other task without one and without a `rootfs` /
      `image_name` (None: they keep the sandbox's default root).
    swebench_specs: swebench's install table for env_from="swebench"
      (`envs.environments.sources.load_swebench_specs`'s source; None: $ARBOR_SWEBENCH_SPECS).

  Returns:
    New Task objects where an environment was added (`dataclasses.replace`), in order.

  Raises:
    ValueError: an unknown `env_from`; "Task 'ID': ..." when a source cannot derive a task's
      environment (no table entry, unreadable repository, a malformed spec).
  """
  if env_from not in ENV_FROM:
    raise ValueError(f"env_from={env_from!r}: expected one of {ENV_FROM}")
  out = []
  for t in tasks:
    env = t.environment
    if env is None and t.kind == "swe" and env_from != "none":
      try:
        env = _from_source(t, env_from, swebench_specs)
      except ValueError as e:
        raise ValueError(f"Task {t.instance_id!r}: env_from={env_from!r}: {e}") from None
    if env is None and default is not None and not t.rootfs and not t.image_name:
      env = default
    out.append(t if env is t.environment else dataclasses.replace(t, environment=env))
  return out


def build_all(tasks: Sequence, backend: str = "bwrap",
              progress: Optional[Callable[[str], None]] = None) -> list[str]:
  """Builds (or finds in the cache) the environment of every task that has one, once each.

  Args:
    tasks: the tasks.
    backend: "bwrap" (root filesystems) or "docker" (images); other backends (remote, local)
      build nothing here and get [].
    progress: called with build log lines and one line per environment (default: nothing).

  Returns:
    The root filesystem paths or image tags, one per distinct environment, in first-seen
    order.

  Raises:
    BuildError / RuntimeError: a build failed (`envs.environments.build.for_task`).
  """
  if backend not in ("bwrap", "docker"):
    return []
  say = progress or (lambda line: None)
  seen, out = set(), []
  for t in tasks:
    env = t.environment
    if env is None or env.key in seen:
      continue
    seen.add(env.key)
    say(f"environment {env.name} ({env.suite}, python {env.python}, "
        f"{len(env.system_packages)} Debian package(s), {len(env.pip)} pip requirement(s))")
    made = build.for_task(t, backend, progress=say)
    say(f"environment {env.name}: {made}")
    out.append(made)
  return out
