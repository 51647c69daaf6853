"""Where environment specs come from: a small registry of sources.

    env = SOURCES["swebench"](row, git_dir=..., specs=...)   # swebench's per-repo table
    env = SOURCES["repository"](row, files=...)              # the repository's own metadata
    env = from_file("env.toml")                               # a user's file (spec.load_file)

- "swebench" (`from_swebench`): the install table of SWE-bench's harness for the row's `repo`
  and `version` (python, packages, pip_packages, pre_install, install). As SWE-bench does, a
  `packages` of "requirements.txt" or "environment.yml" means the repository's own file at the
  row's `environment_setup_commit`, read here from the git mirror (`envs.safe_git`), never
  fetched. swebench 5 no longer ships the table: it is loaded from `specs` (a dict, a .json
  file, a swebench<5 wheel or its harness/constants/python.py) or $ARBOR_SWEBENCH_SPECS, or
  from an installed swebench that still has it (`load_swebench_specs`).
- "repository" (`from_repository`): `metadata.read` of the files (pyproject, setup.cfg,
  setup.py via ast, requirements*.txt), their test extras, pytest, and an editable install.

Builds install the repository offline (`build`), so every source lists in `pip` what the
install step would otherwise download: the repository's dependencies and the extras its
install command names.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import hashlib
import json
import os
import re
import shlex
import zipfile
from typing import Any, Callable, Mapping, Optional

from envs import repo_files, safe_git
from envs.environments import metadata
from envs.environments.debian import SUITES
from envs.environments.spec import (REQUIREMENT, Environment, load_file,
                                    suite_for_python)

SPECS_ENV_VAR = "ARBOR_SWEBENCH_SPECS"
_CONSTANTS = "swebench/harness/constants/python.py"  # where swebench<5 keeps the table
# Requirements SWE-bench's harness rewrites (a package yanked from PyPI -> its replacement).
_REPLACED = {"types-pkg_resources": "types-setuptools"}
# conda names whose pip distribution is called otherwise, and conda-only names to leave out.
_CONDA_TO_PIP = {"pytables": "tables", "pytorch": "torch", "matplotlib-base": "matplotlib"}
_CONDA_ONLY = frozenset({"python", "pip", "conda", "nodejs", "cxx-compiler", "c-compiler",
                         "compilers", "make", "cmake", "pkg-config", "ffmpeg", "graphviz"})
# pre_install shell steps and what replaces them: apt-get runs as root in SWE-bench's images;
# here Debian packages go into the base, and locales come prebuilt.
_APT = re.compile(r"^(?:[A-Z_]+=\S*\s+)*apt-get\s+(?:-\S+\s+)*install\s+(.*)$")
_DROPPED = (re.compile(r"^apt-get\s+(?:-\S+\s+)*(update|upgrade)\b"),
            re.compile(r"^echo .*> */etc/locale\.gen$"), re.compile(r"^locale-gen\b"))
_LOCALES = re.compile(r"^(locale-gen\b|echo .*/etc/locale\.gen$)")


@dataclasses.dataclass(frozen=True)
class SweSpecs:
  """swebench's install table: {repo: {version: spec}}, and where each repo keeps its
  requirements / environment files (candidate paths, first present wins)."""
  specs: Mapping[str, Mapping[str, Mapping[str, Any]]]
  reqs_paths: Mapping[str, list[str]]
  env_yml_paths: Mapping[str, list[str]]


def load_swebench_specs(source: Any = None) -> SweSpecs:
  """swebench's per-repository install table.

  Args:
    source: a SweSpecs; a dict {repo: {version: spec}} (or {"specs": ..., "reqs_paths": ...,
      "env_yml_paths": ...}); a path to such a .json file, to a swebench<5 wheel, or to its
      harness/constants/python.py (a data module of dict literals, evaluated in an empty
      namespace); None: $ARBOR_SWEBENCH_SPECS, else the installed swebench's table.

  Raises:
    ValueError: no table found (swebench >= 5 has none), or the source holds none.
  """
  if isinstance(source, SweSpecs):
    return source
  source = source if source is not None else os.environ.get(SPECS_ENV_VAR)
  ns: dict[str, Any]
  if source is None:
    try:
      from swebench.harness import constants as c
    except ImportError:
      c = None
    ns = vars(c) if c is not None else {}
    if not any(k in ns for k in ("MAP_REPO_VERSION_TO_SPECS_PY", "MAP_REPO_VERSION_TO_SPECS")):
      raise ValueError("env_from='swebench': the installed swebench has no per-repository "
                       "install table (swebench >= 5 dropped it); pass specs= (a swebench<5 "
                       f"wheel, its {_CONSTANTS}, or a JSON table) or set {SPECS_ENV_VAR}")
  elif isinstance(source, Mapping):
    ns = dict(source) if "specs" in source else {"specs": source}
  else:
    path = str(source)
    if path.endswith(".json"):
      with open(path, encoding="utf-8") as f:
        data = json.load(f)
      ns = data if "specs" in data else {"specs": data}
    else:
      if path.endswith(".whl"):
        with zipfile.ZipFile(path) as z:
          text = z.read(_CONSTANTS).decode("utf-8")
      else:
        with open(path, encoding="utf-8") as f:
          text = f.read()
      ns = {}
      exec(compile(text, path, "exec"), ns)  # swebench's own constants: literals, no imports
  specs = (ns.get("specs") or ns.get("MAP_REPO_VERSION_TO_SPECS_PY")
           or ns.get("MAP_REPO_VERSION_TO_SPECS"))
  if not isinstance(specs, Mapping) or not specs:
    raise ValueError(f"specs={source!r}: holds no swebench install table")
  return SweSpecs(specs, ns.get("reqs_paths") or ns.get("MAP_REPO_TO_REQS_PATHS") or {},
                  ns.get("env_yml_paths") or ns.get("MAP_REPO_TO_ENV_YML_PATHS") or {})


class GitFiles(collections.abc.Mapping):
  """The files of one commit of a mirror, read on demand ({path: bytes}, Mapping): a
  requirements file or setup.py is read without checking the whole tree out. Any path can be
  looked up; iteration lists the top level only (what `metadata.read` looks at)."""

  def __init__(self, git_dir: str, commit: str):
    self.git_dir, self.commit, self._cache = git_dir, commit, {}

  def __getitem__(self, path: str) -> bytes:
    if path not in self._cache:
      try:
        self._cache[path] = safe_git.read_blob(self.git_dir, self.commit, path)
      except Exception:  # GitError / ValueError: no such file at that commit
        self._cache[path] = None
    if self._cache[path] is None:
      raise KeyError(path)
    return self._cache[path]

  def __iter__(self):
    names = safe_git.git(self.git_dir, "ls-tree", "--name-only", self.commit).decode(
        "utf-8", errors="replace").split("\n")
    return iter([n for n in names if n])

  def __len__(self):
    return sum(1 for _ in self)


def _conda_to_pip(dep: str) -> Optional[str]:
  """A conda package spec ("numpy=1.19", "scipy>=1.5") as a pip requirement, or None."""
  dep = dep.strip().split("::")[-1]
  m = re.match(r"^([A-Za-z0-9_.-]+)\s*(.*)$", dep)
  if not m or m.group(1).lower() in _CONDA_ONLY:
    return None
  name, ver = _CONDA_TO_PIP.get(m.group(1).lower(), m.group(1)), m.group(2).strip()
  if re.match(r"^=?[0-9]", ver):  # conda's "=1.2" (a prefix) and "==1.2"
    ver = "==" + ver.lstrip("=").rstrip(".*")
  return name + ver


def _environment_yml(text: str) -> list[str]:
  import yaml
  data = yaml.safe_load(text[:metadata.MAX_FILE_BYTES]) or {}
  out = []
  for dep in data.get("dependencies", []) if isinstance(data, dict) else []:
    if isinstance(dep, str):
      r = _conda_to_pip(dep)
      out += [r] if r else []
    elif isinstance(dep, dict) and isinstance(dep.get("pip"), list):
      out += [p for p in dep["pip"] if isinstance(p, str)]
  return out


def _install_extras(command: str) -> list[str]:
  """The extras an install command names: "pip install -e .[test,dev]" -> ["test", "dev"]."""
  out = []
  for word in shlex.split(command) if command else []:
    m = re.match(r"^\.\[([\w,. -]+)\]$", word)
    if m:
      out += [e.strip() for e in m.group(1).split(",") if e.strip()]
  return out


def _declared(files: Mapping[str, bytes], extras) -> list[str]:
  """The repository's dependencies and those of `extras` (what an install would fetch)."""
  meta = metadata.read(files)
  out = list(meta.dependencies)
  for extra in extras:
    out += meta.extras.get(extra, [])
  return out


def _dist(requirement: str) -> str:
  """The normalized distribution name of a requirement ("Foo_Bar>=1" -> "foo-bar")."""
  name = re.split(r"[\s\[<>=!~;(]", requirement.strip(), 1)[0]
  return re.sub(r"[-_.]+", "-", name).lower()


def _dedupe(reqs) -> list[str]:
  out = []
  for r in reqs:
    r = r.strip()
    name = re.split(r"[\s\[<>=!~;]", r, 1)[0]
    r = _REPLACED.get(name, "") + r[len(name):] if name in _REPLACED else r
    if r and REQUIREMENT.match(r) and r not in out:
      out.append(r)
  return out


def from_swebench(row: Mapping[str, Any], *, git_dir: Optional[str] = None,
                  specs: Any = None, files: Optional[Mapping[str, bytes]] = None
                  ) -> Environment:
  """The environment SWE-bench's harness builds for a row.

  Args:
    row: a SWE row: `repo`, `version`, `base_commit`, optionally `environment_setup_commit`.
    git_dir: the repository's mirror (`envs.tasks.find_mirror`): requirement files are read
      at environment_setup_commit (else base_commit) and the repository's declared
      dependencies at base_commit.
    specs: the table (`load_swebench_specs`'s source).
    files: the repository's files at base_commit instead of the mirror (then requirement
      files are read from them too).

  Returns:
    The environment: suite from the spec's python (nearest, recorded), Debian packages of
    its apt-get pre_install steps, pip = packages + pip_packages + the repository's declared
    dependencies (and the extras its install names), install = the other pre_install steps
    and the install command, repository = "repo@base_commit".

  Raises:
    ValueError: naming 'repo' / 'version' (no spec), or a requirements file that is absent.
    SpecError: the result is not a valid environment.
  """
  table = load_swebench_specs(specs)
  repo, version = row.get("repo"), str(row.get("version", ""))
  if repo not in table.specs:
    raise ValueError(f"field 'repo': {repo!r}: swebench's table has no such repository")
  if version not in table.specs[repo]:
    raise ValueError(f"field 'version': {version!r}: swebench has no spec for {repo} version "
                     f"{version!r} (versions: {', '.join(sorted(table.specs[repo]))})")
  s = table.specs[repo][version]
  base = row.get("base_commit") or ""
  setup_commit = row.get("environment_setup_commit") or base
  if files is None and git_dir is None:
    raise ValueError(f"field 'repo': {repo!r}: reading its files needs git_dir (a mirror) or "
                     "files")
  at_setup = files if files is not None else GitFiles(git_dir, setup_commit)
  at_base = files if files is not None else GitFiles(git_dir, base)
  suite, requested = suite_for_python(str(s.get("python", SUITES["bookworm"])),
                                      field=f"swebench[{repo}][{version}].python")
  pip: list[str] = []
  packages = s.get("packages", "") or ""
  if packages in ("requirements.txt", "environment.yml"):
    paths = (table.reqs_paths if packages == "requirements.txt" else table.env_yml_paths
             ).get(repo, [packages])
    found = next((p for p in paths if p in at_setup), None)
    if found is None:
      raise ValueError(f"field 'environment_setup_commit': {setup_commit!r}: {repo} has none "
                       f"of {paths} there")
    if packages == "requirements.txt":
      pip += metadata.parse_requirements(at_setup, found)
    else:
      pip += _environment_yml(at_setup[found].decode("utf-8", errors="replace"))
  else:
    pip += [r for r in map(_conda_to_pip, packages.split()) if r]
  pip += list(s.get("pip_packages", []) or [])
  system, install = set(), []
  for command in s.get("pre_install", []) or []:
    kept = []
    for part in (p.strip() for p in command.split("&&")):
      m = _APT.match(part)
      if m:
        system.update(w for w in m.group(1).split() if not w.startswith("-"))
      elif _LOCALES.match(part):
        system.add("locales-all")
      elif part and not any(d.match(part) for d in _DROPPED):
        kept.append(part)
    if kept:
      install.append(" && ".join(kept))
  if s.get("install"):
    pip += _declared(at_base, _install_extras(s["install"]))
    install.append(s["install"])
  env = Environment.create(suite=suite, system_packages=sorted(system), pip=_dedupe(pip),
                           install=install, repository=f"{repo}@{base}" if install else None)
  return dataclasses.replace(env, python_requested=requested) if requested else env


def _files_of(source) -> Mapping[str, bytes]:
  if isinstance(source, Mapping):
    return source
  return repo_files.load_repo_files(str(source))  # a directory, read without following links


def _python_for(requires: Optional[str]) -> Optional[str]:
  """The python of the default suite if it satisfies `requires`, else of the newest suite
  that does; None when unknown (no constraint, or none satisfies it: the default is used)."""
  if not requires:
    return None
  try:
    from packaging.specifiers import SpecifierSet
    allowed = SpecifierSet(requires)
  except (ImportError, ValueError):
    return None
  fits = [py for py in SUITES.values() if allowed.contains(py + ".0")]
  if not fits or SUITES["bookworm"] in fits:
    return None
  return max(fits, key=lambda v: tuple(map(int, v.split("."))))


def from_repository(source, *, python: Optional[str] = None, extras=metadata.TEST_EXTRAS,
                    repository: Optional[str] = None, install: bool = True,
                    system_packages=(), pins=()) -> Environment:
  """An environment from a repository's own metadata (`metadata.read`).

  Args:
    source: the repository's files {path: bytes}, or a directory / tarball of them.
    python: the Python version; None: the default suite's if `requires-python` allows it.
    extras: the extras whose dependencies are installed too (those the repository has).
    repository: "owner/name@commit" naming the files; None: "local/files@<sha1 of the
      files>" (the install step's build depends on them).
    install: add "python -m pip install --no-deps -e ." when the repository is a package
      (setup.py, setup.cfg or a pyproject.toml [build-system]).
    system_packages: Debian packages.
    pins: requirements that replace all of the repository's own for the same distribution,
      in place (e.g. "parse==1.20.2": the versions the repository was released against; its
      metadata's lower bounds alone take whatever PyPI has at build time).

  Returns:
    pip = dependencies + the extras' + requirements*.txt + (build requirements when
    installing) + pytest (unless listed).
  """
  files = _files_of(source)
  meta = metadata.read(files)
  pip = list(meta.dependencies)
  for extra in extras:
    pip += meta.extras.get(extra, [])
  pip += meta.requirements
  package = any(p in files for p in ("setup.py", "setup.cfg")) or bool(meta.build_requires)
  commands = []
  if install and package:
    pip += meta.build_requires or ["setuptools", "wheel"]
    commands.append("python -m pip install --no-deps -e .")
    if repository is None:
      digest = hashlib.sha1()
      for path in sorted(files):
        digest.update(path.encode() + b"\0" + hashlib.sha1(files[path]).digest())
      repository = f"local/files@{digest.hexdigest()}"
  if not any(_dist(r) == "pytest" for r in pip):
    pip.append("pytest")
  pinned, out = {_dist(p): p for p in pins}, []
  for r in pip + list(pins):  # each pinned name: its pin where it first appears, once
    r = pinned.get(_dist(r), r)
    if r not in out:
      out.append(r)
  pip = out
  return Environment.create(python=python or _python_for(meta.requires_python),
                            system_packages=system_packages, pip=_dedupe(pip),
                            install=commands, repository=repository if commands else None)


def from_file(path: str) -> Environment:
  """A user's spec file (`spec.load_file`: JSON or TOML, errors naming each bad field)."""
  return load_file(path)


def _from_row_repository(row: Mapping[str, Any], *, files=None, git_dir=None,
                         **_) -> Environment:
  """`from_repository` of a row's files (given), or else of its `environment_setup_commit`
  (its base_commit when absent) in the mirror, as SWE-bench reads a row's dependencies at that
  commit; the install step runs on the row's base_commit, which `repository` names."""
  commit = row.get("environment_setup_commit") or row.get("base_commit")
  if files is None:
    if not (git_dir and commit):
      raise ValueError(f"env_from='repository': row {row.get('instance_id')!r} has neither "
                       "files ('repo_path') nor a mirrored commit")
    files = GitFiles(git_dir, commit)  # looked up on demand: directories are not files
  named = row.get("repo") and row.get("base_commit")
  return from_repository(files, repository=f"{row['repo']}@{row['base_commit']}"
                         if named else None)


# name -> function(row, *, files=None, git_dir=None, specs=None) -> Environment: the
# `env_from` options of the task loaders.
SOURCES: dict[str, Callable[..., Environment]] = {
    "swebench": from_swebench,
    "repository": _from_row_repository,
}
ENV_FROM = ("none",) + tuple(SOURCES)
