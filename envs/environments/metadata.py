"""A Python repository's declared dependencies, read from its files without running any of it.

Parsers with limits (a repository is untrusted; nothing of it is imported or executed):
- pyproject.toml: [project] dependencies, optional-dependencies, requires-python;
  [build-system] requires (`tomllib`);
- setup.cfg: [options] install_requires, python_requires, [options.extras_require]
  (`configparser`, no interpolation);
- setup.py: the keyword arguments of its `setup(...)` call, parsed with `ast`: a literal, or a
  module-level name bound once to a literal, is read; anything computed is left out;
- requirements files (`parse_requirements`): one requirement per line, `-r FILE` followed
  inside the repository (depth REQUIREMENTS_DEPTH); options, paths, URLs and editable lines
  are left out.
Files over MAX_FILE_BYTES are ignored. Requirements that are not plain PEP 508 (the spec's
rule) are dropped, each noted in `RepoMetadata.skipped`.
"""

from __future__ import annotations

import ast
import configparser
import dataclasses
import posixpath
import re
from typing import Mapping, Optional

from envs.environments.spec import REQUIREMENT

MAX_FILE_BYTES = 1 << 20
REQUIREMENTS_DEPTH = 3
TEST_EXTRAS = ("test", "tests", "testing")  # extras holding a package's test dependencies


@dataclasses.dataclass
class RepoMetadata:
  """What a repository declares. Lists keep the files' order, without duplicates."""
  dependencies: list[str] = dataclasses.field(default_factory=list)
  extras: dict[str, list[str]] = dataclasses.field(default_factory=dict)
  requires_python: Optional[str] = None
  build_requires: list[str] = dataclasses.field(default_factory=list)
  requirements: list[str] = dataclasses.field(default_factory=list)  # from requirements*.txt
  sources: list[str] = dataclasses.field(default_factory=list)        # files that were read
  skipped: list[str] = dataclasses.field(default_factory=list)        # "file: entry" dropped


def _text(files: Mapping[str, bytes], path: str) -> Optional[str]:
  data = files.get(path)
  if data is None or len(data) > MAX_FILE_BYTES:
    return None
  return data.decode("utf-8", errors="replace")


def _add(out: list[str], reqs, meta: RepoMetadata, where: str) -> None:
  for r in reqs:
    r = r.strip() if isinstance(r, str) else r
    if not isinstance(r, str) or not r:
      continue
    if not REQUIREMENT.match(r):
      meta.skipped.append(f"{where}: {r[:200]}")
    elif r not in out:
      out.append(r)


def _lines(value: str) -> list[str]:
  """setup.cfg's dangling lists: one entry per line (or ';'-free comma lists), comments cut."""
  out = []
  for line in value.splitlines():
    line = line.split(" #", 1)[0].strip()
    if line and not line.startswith("#"):
      out.append(line)
  return out


def _pyproject(files, meta: RepoMetadata) -> None:
  text = _text(files, "pyproject.toml")
  if text is None:
    return
  import tomllib
  try:
    data = tomllib.loads(text)
  except tomllib.TOMLDecodeError as e:
    meta.skipped.append(f"pyproject.toml: not TOML ({e})")
    return
  meta.sources.append("pyproject.toml")
  project = data.get("project") if isinstance(data.get("project"), dict) else {}
  deps = project.get("dependencies", [])
  _add(meta.dependencies, deps if isinstance(deps, list) else [], meta, "pyproject.toml")
  optional = project.get("optional-dependencies", {})
  for name, reqs in (optional.items() if isinstance(optional, dict) else ()):
    _add(meta.extras.setdefault(str(name), []), reqs if isinstance(reqs, list) else [], meta,
         f"pyproject.toml [{name}]")
  if isinstance(project.get("requires-python"), str):
    meta.requires_python = project["requires-python"]
  build = data.get("build-system") if isinstance(data.get("build-system"), dict) else {}
  requires = build.get("requires", [])
  _add(meta.build_requires, requires if isinstance(requires, list) else [], meta,
       "pyproject.toml [build-system]")


def _setup_cfg(files, meta: RepoMetadata) -> None:
  text = _text(files, "setup.cfg")
  if text is None:
    return
  parser = configparser.ConfigParser(interpolation=None, strict=False)
  try:
    parser.read_string(text)
  except configparser.Error as e:
    meta.skipped.append(f"setup.cfg: unreadable ({type(e).__name__})")
    return
  meta.sources.append("setup.cfg")
  if parser.has_option("options", "install_requires"):
    _add(meta.dependencies, _lines(parser.get("options", "install_requires")), meta,
         "setup.cfg")
  if parser.has_option("options", "python_requires") and not meta.requires_python:
    meta.requires_python = parser.get("options", "python_requires").strip()
  if parser.has_section("options.extras_require"):
    for name, value in parser.items("options.extras_require"):
      _add(meta.extras.setdefault(name, []), _lines(value), meta, f"setup.cfg [{name}]")


def _literal(node: ast.AST, names: Mapping[str, ast.AST]):
  """The value of a literal node, or of a name bound once to one; else None."""
  if isinstance(node, ast.Name) and node.id in names:
    node = names[node.id]
  try:
    return ast.literal_eval(node)
  except (ValueError, TypeError, SyntaxError, RecursionError):
    return None


def _setup_py(files, meta: RepoMetadata) -> None:
  text = _text(files, "setup.py")
  if text is None:
    return
  try:
    tree = ast.parse(text, "setup.py")
  except (SyntaxError, ValueError, RecursionError):
    meta.skipped.append("setup.py: not parseable")
    return
  meta.sources.append("setup.py")
  bound: dict[str, list[ast.AST]] = {}
  for stmt in tree.body:  # module-level NAME = literal (bound more than once: not trusted)
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(
        stmt.targets[0], ast.Name):
      bound.setdefault(stmt.targets[0].id, []).append(stmt.value)
  names = {k: v[0] for k, v in bound.items() if len(v) == 1}
  for node in ast.walk(tree):
    if not isinstance(node, ast.Call):
      continue
    func = node.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    if name != "setup":
      continue
    for kw in node.keywords:
      value = _literal(kw.value, names) if kw.arg else None
      if kw.arg in ("install_requires", "tests_require") and isinstance(value, (list, tuple)):
        target = meta.dependencies if kw.arg == "install_requires" else meta.extras.setdefault(
            "tests_require", [])
        _add(target, value, meta, f"setup.py {kw.arg}")
      elif kw.arg == "extras_require" and isinstance(value, dict):
        for extra, reqs in value.items():
          if isinstance(reqs, str):
            reqs = [reqs]
          if isinstance(reqs, (list, tuple)):
            _add(meta.extras.setdefault(str(extra), []), reqs, meta, f"setup.py [{extra}]")
      elif kw.arg == "python_requires" and isinstance(value, str) and not meta.requires_python:
        meta.requires_python = value


def parse_requirements(files: Mapping[str, bytes], path: str, meta: Optional[RepoMetadata]
                       = None, depth: int = 0) -> list[str]:
  """The requirements of a requirements file of the repository, `-r` includes followed.

  Args:
    files: the repository's files {relative path: bytes}.
    path: the file's relative path.
    meta: where skipped entries are noted (optional).
    depth: include depth so far (at most REQUIREMENTS_DEPTH).

  Returns:
    PEP 508 requirement strings, in order (environment markers kept).
  """
  meta = meta if meta is not None else RepoMetadata()
  text = _text(files, path)
  out: list[str] = []
  if text is None:
    return out
  meta.sources.append(path)
  for raw in text.splitlines():
    line = re.sub(r"(^|\s)#.*$", "", raw).strip()
    if not line:
      continue
    m = re.match(r"^(-r|--requirement)\s*=?\s*(\S+)$", line)
    if m:
      inc = posixpath.normpath(posixpath.join(posixpath.dirname(path), m.group(2)))
      if depth < REQUIREMENTS_DEPTH and not inc.startswith(("../", "/")):
        for r in parse_requirements(files, inc, meta, depth + 1):
          if r not in out:
            out.append(r)
      continue
    if line.startswith("-") or line.startswith(".") or "://" in line:
      meta.skipped.append(f"{path}: {line[:200]}")
      continue
    _add(out, [line], meta, path)
  return out


def read(files: Mapping[str, bytes]) -> RepoMetadata:
  """The metadata of a repository from its files (top-level pyproject.toml, setup.cfg,
  setup.py and requirements*.txt / *-requirements.txt files)."""
  meta = RepoMetadata()
  _pyproject(files, meta)
  _setup_cfg(files, meta)
  _setup_py(files, meta)
  for path in sorted(p for p in files if "/" not in p and p.endswith(".txt")
                     and "requirements" in p):
    for r in parse_requirements(files, path, meta):
      if r not in meta.requirements:
        meta.requirements.append(r)
  return meta
