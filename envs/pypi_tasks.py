"""Bug-fixing tasks from the real PyPI packages bundled in envs/data/pypi/.

This module owns the bundled packages (`bundled_packages`: packages.json, checked against the
tarballs' sha256) and the one-off step that turns them into SWE-bench-shaped tasks: each
package's sdist goes to `envs.synth` as it is (synth unpacks it; bugs injected by
`envs.mutate` are kept only when some of the package's own tests fail and the others pass, in
sandboxes) with the package's test command. The tasks of every package are also gathered into
one eval file (`combine`), and a chosen few rows can be packed into a small self-contained set
(`export`: each buggy tree as one .tar.gz). Check a set with `python -m envs.validate`.

Every row carries the package's environment (`package_environment`: what
`envs.environments.from_repository` reads from the sdist's metadata, pytest from the Debian
suite), and every test run of the synthesis starts from it, so rows are graded where they
were validated.

    python -m envs.pypi_tasks --out pypi_tasks --max_instances 60
    # -> pypi_tasks/<name>/tasks.jsonl (+ report.json, buggy trees) per package,
    #    pypi_tasks/tasks.jsonl: every package's rows, repo_path relative to pypi_tasks/
    python -m envs.validate --tasks pypi_tasks/tasks.jsonl --out pypi_tasks/accepted.jsonl
    python -m trainer.main --config=configs/rl.py --workdir=/tmp/run \\
        --config.eval.tasks=pypi_tasks/accepted.jsonl

    packages = bundled_packages()                 # [Package(name="cachetools", ...), ...]
    report = synthesize("inflection", "out/inflection", max_instances=20, workers=2)
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import sys
import tarfile
import time
from typing import Any, Optional, Sequence

from envs import dataset_paths, synth
from envs.environments import build, sources
from envs.environments import spec as env_spec
from envs.sandbox import create_sandbox

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "pypi")
COMBINED = "tasks.jsonl"  # the eval file of every package, in the output directory
_FIELDS = ("name", "version", "licence", "licence_file", "repo", "url", "sha256", "source",
           "root", "test_command", "trimmed")


@dataclasses.dataclass(frozen=True)
class Package:
  """One bundled source distribution (an entry of packages.json)."""

  name: str            # the PyPI project name
  version: str         # the released version
  licence: str         # SPDX identifier of its licence
  licence_file: str    # the licence text, relative to `root`
  repo: str            # "owner/name" of the project's repository (the tasks' `repo`)
  url: str             # the sdist on PyPI
  sha256: str          # of the sdist as PyPI publishes it (and of `source`, nothing trimmed)
  source: str          # absolute path of the bundled tarball
  root: str            # top directory inside the tarball
  test_command: str    # how the suite runs from `root` ("python3 -m pytest ARGS")
  trimmed: tuple[str, ...] = ()  # files left out of the sdist before bundling


def sha256_file(path: str) -> str:
  """The hex sha256 of a file's bytes."""
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def bundled_packages(data_dir: str = DATA_DIR, check: bool = True) -> list[Package]:
  """The packages of `data_dir`/packages.json.

  Args:
    data_dir: the directory holding packages.json and the tarballs it names.
    check: verify each tarball's sha256 (only an untrimmed tarball is the PyPI file).

  Returns:
    The packages, in file order.

  Raises:
    ValueError: a malformed entry (naming its index and field), a duplicate name, a missing
      tarball, or a tarball whose sha256 is not the recorded one.
  """
  path = os.path.join(data_dir, "packages.json")
  with open(path, encoding="utf-8") as f:
    entries = json.load(f)
  if not isinstance(entries, list):
    raise ValueError(f"{path}: expected a list of packages, got {type(entries).__name__}")
  out, seen = [], set()
  for i, e in enumerate(entries):
    if not isinstance(e, dict):
      raise ValueError(f"{path}[{i}]: expected an object, got {type(e).__name__}")
    for field in _FIELDS:
      value = e.get(field)
      if field == "trimmed" and not isinstance(value, list):
        raise ValueError(f"{path}[{i}].trimmed={value!r}: expected a list of paths")
      if field != "trimmed" and not (isinstance(value, str) and value):
        raise ValueError(f"{path}[{i}].{field}={value!r}: expected a non-empty string")
    if e["name"] in seen:
      raise ValueError(f"{path}[{i}].name={e['name']!r}: duplicate")
    seen.add(e["name"])
    source = os.path.join(data_dir, e["source"])
    if not os.path.isfile(source):
      raise ValueError(f"{path}[{i}].source={e['source']!r}: no such file in {data_dir}")
    if check and not e["trimmed"] and sha256_file(source) != e["sha256"]:
      raise ValueError(f"{path}[{i}].sha256={e['sha256']!r}: {source} has sha256 "
                       f"{sha256_file(source)}")
    out.append(Package(**{**{k: e[k] for k in _FIELDS}, "source": source,
                          "trimmed": tuple(e["trimmed"])}))
  return out


def get_package(name: str, data_dir: str = DATA_DIR) -> Package:
  """The bundled package called `name`.

  Raises:
    ValueError: no such package (naming the bundled ones).
  """
  packages = bundled_packages(data_dir)
  for p in packages:
    if p.name == name:
      return p
  raise ValueError(f"package={name!r}: expected one of {', '.join(p.name for p in packages)}")


def package_files(package: Package) -> dict[str, bytes]:
  """The regular files of the package's sdist, relative to its top directory."""
  files = {}
  with tarfile.open(package.source) as tar:
    for member in tar.getmembers():
      if member.isfile() and member.name.startswith(package.root + "/"):
        files[member.name[len(package.root) + 1:]] = tar.extractfile(member).read()
  return files


def package_environment(package: Package) -> env_spec.Environment:
  """The environment the package's tasks run in: `envs.environments.from_repository` of the
  sdist's metadata (its Python, dependencies and test extras; no install step, since every
  task's sandbox holds the package's files and the suites import them from there), with
  pytest taken from the Debian suite's python3-pytest instead of PyPI. Debian's package is
  the pytest of that suite (bookworm: 7.2.1) on every build, where an unpinned PyPI pytest
  would follow PyPI; a package that needs nothing else so gets the `bookworm-pytest`
  environment (`envs.task_environments.PRESETS`), one build shared with the other bundled rows.

  Raises:
    SpecError: the metadata gives no valid environment.
  """
  env = sources.from_repository(package_files(package), install=False)
  pip = tuple(r for r in env.pip if sources._dist(r) != "pytest")
  return dataclasses.replace(
      env, system_packages=tuple(sorted(set(env.system_packages) | {"python3-pytest"})),
      pip=pip)


def synthesize(name: str, out_dir: str, *, data_dir: str = DATA_DIR,
               **synth_options: Any) -> dict:
  """Synthesizes the tasks of one bundled package into `out_dir` with `envs.synth`.

  Args:
    name: the package (see `bundled_packages`).
    out_dir: where the rows (tasks.jsonl), the report and the buggy trees go; a rerun resumes.
    data_dir: the bundled packages' directory.
    **synth_options: passed to `envs.synth.synthesize` (e.g. workers, runs, max_instances,
      max_per_kind, kinds, seed, backend).

  Returns:
    The synthesizer's report; the rows of `out_dir`/tasks.jsonl carry the package's
    environment (`package_environment`), in whose sandboxes (backend bwrap or docker) every
    test run of the synthesis ran.

  Raises:
    ValueError: an unknown package or a bad bundled file.
    BuildError / RuntimeError: the environment's build failed.
  """
  package = get_package(name, data_dir)
  env = package_environment(package)
  config = synth.SynthConfig(name=package.repo, version=package.version, **synth_options)
  make_sandbox = None
  if config.backend in ("bwrap", "docker"):
    made = (build.rootfs if config.backend == "bwrap" else build.docker_image)(env)
    option = {"rootfs": made} if config.backend == "bwrap" else {"image": made}
    make_sandbox = lambda: create_sandbox(config.backend, limits=config.limits, **option)
  # The sdist itself is the source: synth reads it (its one top folder stripped) in memory.
  report = synth.synthesize(package.source, package.test_command, out_dir, config,
                            make_sandbox=make_sandbox)
  if make_sandbox is not None:
    add_environment(os.path.join(out_dir, "tasks.jsonl"), env)
  return report


def add_environment(tasks_file: str, env: env_spec.Environment) -> int:
  """Gives every row of `tasks_file` without an `environment` field `env` (rewritten in
  place, atomically); returns the number of rows changed (0 when the file is absent)."""
  if not os.path.exists(tasks_file):
    return 0
  with open(tasks_file, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  changed = 0
  for row in rows:
    if row.get("environment") is None:
      row["environment"] = environment_field(env)
      changed += 1
  with open(tasks_file + ".tmp", "w", encoding="utf-8") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)
  os.replace(tasks_file + ".tmp", tasks_file)
  return changed


def environment_field(env: env_spec.Environment) -> dict:
  """A row's `environment` field for `env`: only the fields that differ from a default
  Environment, plus the suite (`env_spec.from_dict` reads it back to the same key)."""
  full, blank = env.to_dict(), env_spec.Environment().to_dict()
  out = {"suite": full["suite"]}
  out.update({k: v for k, v in full.items() if v != blank[k] and k not in ("python", "suite")})
  return out


def combine(out_dir: str, names: Sequence[str]) -> int:
  """Writes `out_dir`/tasks.jsonl: the rows of `out_dir`/<name>/tasks.jsonl for each name.

  A row's `repo_path` (relative to its package's directory) is made relative to `out_dir`, so
  the combined file loads from where it lies.

  Returns:
    The number of rows written.

  Raises:
    ValueError: two rows share an instance_id.
  """
  seen, n = set(), 0
  tmp = os.path.join(out_dir, COMBINED + ".tmp")
  with open(tmp, "w", encoding="utf-8") as f:
    for name in names:
      path = os.path.join(out_dir, name, "tasks.jsonl")
      if not os.path.exists(path):
        continue
      with open(path, encoding="utf-8") as rows:
        for line in rows:
          if not line.strip():
            continue
          row = json.loads(line)
          if row["instance_id"] in seen:
            raise ValueError(f"{path}: instance_id={row['instance_id']!r} appears twice")
          seen.add(row["instance_id"])
          if row.get("repo_path") and not os.path.isabs(row["repo_path"]):
            row["repo_path"] = os.path.join(name, row["repo_path"])
          f.write(json.dumps(row) + "\n")
          n += 1
  os.replace(tmp, os.path.join(out_dir, COMBINED))
  return n


def export(tasks_file: str, out_dir: str, instance_ids: Optional[Sequence[str]] = None) -> int:
  """A self-contained copy of synthesized rows: each buggy tree packed as one .tar.gz.

  `out_dir`/tasks.jsonl holds the rows with `repo_path` = "repos/<instance_id>.tar.gz" (a
  tarball is a repository snapshot as good as a directory for `envs.tasks`), so the set
  travels as a handful of small files.

  Args:
    tasks_file: a tasks.jsonl written by `envs.synth` (repo_path relative to it).
    out_dir: where the copy goes (created).
    instance_ids: the rows to copy, in this order; None: all.

  Returns:
    The number of rows written.

  Raises:
    ValueError: an instance id that is not in `tasks_file`, or a `repo_path` that is not a
      folder inside the tasks file's folder (absolute, "..", "~" or a symbolic link).
  """
  rows = {}
  with open(tasks_file, encoding="utf-8") as f:
    for line in f:
      if line.strip():
        row = json.loads(line)
        rows[row["instance_id"]] = row
  ids = list(rows) if instance_ids is None else list(instance_ids)
  for i in ids:
    if i not in rows:
      raise ValueError(f"instance_id={i!r}: not in {tasks_file}")
  os.makedirs(os.path.join(out_dir, "repos"), exist_ok=True)
  with open(os.path.join(out_dir, "tasks.jsonl"), "w", encoding="utf-8") as out:
    for i in ids:
      row = dict(rows[i])
      tree = dataset_paths.resolve(os.path.dirname(os.path.abspath(tasks_file)), row["repo_path"],
                                   f"instance_id={i!r} field 'repo_path'", "dir")
      row["repo_path"] = f"repos/{i}.tar.gz"
      with tarfile.open(os.path.join(out_dir, row["repo_path"]), "w:gz") as tar:
        for name in sorted(os.listdir(tree)):
          tar.add(os.path.join(tree, name), arcname=name, filter=_plain)
      out.write(json.dumps(row) + "\n")
  return len(ids)


def _plain(info: tarfile.TarInfo) -> tarfile.TarInfo:
  """A tar member without the local owner and a fixed time (the archive says nothing of
  where or when it was made)."""
  info.uid = info.gid = 0
  info.uname = info.gname = ""
  info.mtime = 0
  return info


def main(argv: Optional[list[str]] = None) -> int:
  """Command line: synthesize the bundled packages' tasks, one package after another.

  Returns:
    0; a summary per package is printed as it finishes.
  """
  p = argparse.ArgumentParser(prog="python -m envs.pypi_tasks", description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, help="output directory")
  p.add_argument("--packages", default="", help="comma-separated names (default: all bundled)")
  p.add_argument("--max_instances", type=int, default=None, help="validated tasks per package")
  p.add_argument("--max_per_kind", type=int, default=None,
                 help="candidate mutations sampled per kind and package")
  p.add_argument("--kinds", default="", help="comma-separated mutation kinds (default: all)")
  p.add_argument("--workers", type=int, default=2, help="sandbox runs in parallel")
  p.add_argument("--runs", type=int, default=3, help="baseline runs (flaky-test detection)")
  p.add_argument("--seed", type=int, default=0, help="mutation sampling seed")
  p.add_argument("--backend", default="bwrap", help="sandbox backend")
  args = p.parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
  available = [pkg.name for pkg in bundled_packages()]
  names = [n for n in args.packages.split(",") if n] or available
  for n in names:
    if n not in available:
      p.error(f"--packages: {n!r} is not bundled (bundled: {', '.join(available)})")
  options = dict(workers=args.workers, runs=args.runs, seed=args.seed, backend=args.backend,
                 max_instances=args.max_instances, max_per_kind=args.max_per_kind)
  if args.kinds:
    options["kinds"] = tuple(args.kinds.split(","))
  os.makedirs(args.out, exist_ok=True)
  for i, name in enumerate(names, 1):
    print(f"[{i}/{len(names)}] {name}: synthesizing into {os.path.join(args.out, name)}",
          flush=True)
    start = time.time()
    report = synthesize(name, os.path.join(args.out, name), **options)
    print(synth.summary(report), flush=True)
    print(f"[{i}/{len(names)}] {name}: {report['instances']} tasks in "
          f"{time.time() - start:.0f} s", flush=True)
  n = combine(args.out, names)
  print(f"{n} tasks in {os.path.join(args.out, COMBINED)}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
