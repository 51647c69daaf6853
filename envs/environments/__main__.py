"""Builds environments from the command line.

    python -m envs.environments build --tasks ROWS.jsonl [--backend bwrap|docker|both]
        [--workers N] [--env_from none|swebench|repository] [--mirror DIR] [--specs PATH]
    python -m envs.environments build --spec env.toml [--repo DIR]
    python -m envs.environments show --spec env.toml     # canonical JSON and key
    python -m envs.environments base [--suite bookworm] [--packages P,...] [--backend ...]

Every row with an environment (its `environment` field, or one from --env_from) is built once
per distinct environment, `--workers` at a time, with a progress bar; a JSON line per
environment goes to stdout ({"name", "key", "rootfs" / "image", "seconds", "error"}). The exit
status is 1 when any build failed. `base` builds one Debian base (python3 + --packages) ahead
of time: what a machine's set-up does so that later builds and sandboxes find it cached.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from envs import tasks as tasks_lib
from envs.environments import build, debian, sources, spec


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m envs.environments", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("command", choices=("build", "show", "base"))
  p.add_argument("--tasks", help="task file (JSONL / Parquet of SWE rows)")
  p.add_argument("--spec", help="an environment spec file (.json / .toml)")
  p.add_argument("--repo", help="the repository directory a --spec's install runs on")
  p.add_argument("--backend", default="bwrap", choices=build.BACKENDS)
  p.add_argument("--workers", type=int, default=2)
  p.add_argument("--env_from", default="none", choices=sources.ENV_FROM,
                 help="where rows without an `environment` field get one")
  p.add_argument("--mirror", help="directory of git mirrors (default $ARBOR_SWE_MIRROR)")
  p.add_argument("--specs", help="swebench's install table (sources.load_swebench_specs)")
  p.add_argument("--cache_dir", help="build cache (default $ARBOR_ENV_CACHE)")
  p.add_argument("--suite", default=debian.DEFAULT_SUITE, help="base: the Debian suite")
  p.add_argument("--packages", default="", help="base: Debian packages, comma-separated")
  p.add_argument("-v", "--verbose", action="store_true", help="print every build's log")
  a = p.parse_args(argv)
  logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING)
  if a.command == "base":
    return _base(a)
  if bool(a.tasks) == bool(a.spec):
    p.error("give exactly one of --tasks and --spec")
  try:
    if a.spec:
      items = [(spec.load_file(a.spec), a.repo)]
    else:
      loaded = tasks_lib.load_tasks(a.tasks, mirror=a.mirror, env_from=a.env_from,
                                    swebench_specs=a.specs)
      items = [(t.environment, t) for t in loaded if t.environment is not None]
      print(f"{len(items)} of {len(loaded)} task(s) name an environment", file=sys.stderr)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if a.command == "show":
    for env, _ in items:
      print(json.dumps({"name": env.name, "key": env.key, "spec": env.to_dict()}))
    return 0
  # a task's repository is materialized by `for_task`; a --spec's is the --repo directory
  results = build.build_many(
      [(env, repo) for env, repo in items], backend=a.backend, workers=a.workers,
      cache_dir=a.cache_dir, verbose=a.verbose)
  for r in results:
    print(json.dumps(r))
  return 1 if any("error" in r for r in results) else 0


def _base(a) -> int:
  """Builds the Debian base of `--suite` / `--packages` for `--backend`; prints its paths."""
  packages = tuple(p for p in a.packages.split(",") if p)
  try:
    out = {"suite": a.suite, "packages": list(packages)}
    if a.backend in ("bwrap", "both"):
      out["rootfs"] = debian.rootfs(a.suite, packages, a.cache_dir)
    if a.backend in ("docker", "both"):
      out["image"] = debian.docker_image(a.suite, packages, a.cache_dir)
  except (ValueError, RuntimeError) as e:  # a bad suite or package name; a failed build
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(json.dumps(out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
