"""`Environment`: what a sandbox needs besides the task's files, independent of any backend.

An environment is a Debian suite (which fixes the Python version), Debian packages, pip
requirements, optional install commands run on the repository's files, environment
variables, and tools kept apart from the task's packages (agent scaffolds: npm packages, or pip
ones in their own virtual environment; see `TOOL`). Its `key` is the SHA-256 of its canonical
JSON (`to_dict`), so equal environments share one build and any change of a field gives another
build.

    env = Environment.create(python="3.10", pip=["attrs==23.2.0", "pytest==8.3.3"])
    env.suite, env.python, env.python_requested   # "bookworm", "3.11", "3.10"

Python versions map to suites (`suite_for_python`): Debian ships one python3 per suite
(bullseye 3.9, bookworm 3.11, trixie 3.13). A version no suite has is served by the nearest
one of the same major version (ties go to the older, whose standard library removed less),
and the version asked for is kept in `python_requested`, so the choice is part of the spec
and of its key; `python_policy="exact"` refuses instead.

`from_dict` reads a spec from JSON/TOML data (a row's `environment` field, a user's file) and
raises `SpecError` naming each bad field ("environment.pip[2]: ...").
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Mapping, Optional, Sequence

from envs.environments import cache
from envs.environments.debian import DEFAULT_SUITE, SUITES, check_packages

# One PEP 508 requirement: a distribution name, extras, then version specifiers and markers.
# Options ("-e", "--index-url"), paths and URLs are refused: they would let a spec reach past
# the package index.
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_CLAUSE = r"\s*(?:===|==|!=|~=|<=|>=|<|>)\s*[A-Za-z0-9.*+!_-]+"
_VERSIONS = rf"{_CLAUSE}(?:\s*,{_CLAUSE})*"
REQUIREMENT = re.compile(
    rf"^{_NAME}\s*(?:\[\s*{_NAME}(?:\s*,\s*{_NAME})*\s*\])?"
    rf"\s*(?:{_VERSIONS}|\(\s*{_VERSIONS}\s*\))?\s*(?:;[^@\\\n]+)?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_REPOSITORY = re.compile(r"^[\w.-]+/[\w.-]+@[0-9a-f]{7,64}$")
# A tool: "npm:NAME@VERSION" (a global npm install into /usr/local, exact version) or
# "pip:NAME==VERSION" (a pinned distribution in its own virtual environment,
# /usr/local/lib/arbor-tools/NAME). Nothing else: no ranges, tags, paths or URLs.
_NPM_NAME = r"(?:@[a-z0-9][a-z0-9._-]*/)?[a-z0-9][a-z0-9._-]*"
TOOL = re.compile(rf"^(?:npm:{_NPM_NAME}@\d+\.\d+\.\d+(?:-[0-9A-Za-z.-]+)?"
                  rf"|pip:{_NAME}==[A-Za-z0-9.+!_-]+)$")
TOOLS_DIR = "/usr/local/lib/arbor-tools"
# Variables a sandbox sets itself, or that would change what the interpreter imports.
_RESERVED_ENV = frozenset({"PATH", "HOME", "TMPDIR", "USER", "LOGNAME", "PYTHONPATH",
                           "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "LD_PRELOAD",
                           "LD_LIBRARY_PATH"})
PYTHON_POLICIES = ("nearest", "exact")
FIELDS = ("suite", "python", "python_requested", "system_packages", "pip", "install", "env",
          "repository", "tools")
MAX_ITEMS = 2000    # entries per list field
MAX_LEN = 4096      # characters per entry


class SpecError(ValueError):
  """A malformed environment spec; the message names each bad field and its value.

  Attributes:
    errors: the messages, one per bad field (joined with "; " in str()).
  """

  def __init__(self, message, errors=None):
    self.errors = list(errors) if errors else [str(message)]
    super().__init__("; ".join(self.errors) if errors else message)


def _version(v: str, field: str) -> tuple[int, int]:
  m = re.match(r"^(\d+)\.(\d+)(\.\d+)?$", str(v))
  if not m:
    raise SpecError(f"{field}={v!r}: expected a Python version 'MAJOR.MINOR'")
  return int(m.group(1)), int(m.group(2))


def suite_for_python(version: str, policy: str = "nearest",
                     field: str = "python") -> tuple[str, Optional[str]]:
  """The Debian suite serving Python `version`.

  Args:
    version: "3.10" (a patch level is ignored).
    policy: "nearest" (another minor version of the same major is accepted) or "exact".
    field: how errors name the value.

  Returns:
    (suite, requested): requested is None when the suite's python is `version`, else
    "MAJOR.MINOR" as asked (to be recorded in the spec).

  Raises:
    SpecError: naming `field`: a malformed version, no suite of that major version, or no
      exact match under policy "exact".
  """
  if policy not in PYTHON_POLICIES:
    raise SpecError(f"python_policy={policy!r}: expected one of {PYTHON_POLICIES}")
  want = _version(version, field)
  asked = f"{want[0]}.{want[1]}"
  have = {_version(py, "suite"): suite for suite, py in SUITES.items()}
  if want in have:
    return have[want], None
  same_major = sorted(v for v in have if v[0] == want[0])
  if policy == "exact" or not same_major:
    offered = ", ".join(f"{s} {p}" for s, p in SUITES.items())
    raise SpecError(f"{field}={version!r}: no Debian suite ships Python {asked} (suites: "
                    f"{offered})" + ("" if same_major else "; no suite of that major version"))
  best = min(same_major, key=lambda v: (abs(v[1] - want[1]), v[1]))  # ties: the older
  return have[best], asked


@dataclasses.dataclass(frozen=True)
class Environment:
  """A backend-independent environment. Build it with `envs.environments.build`.

  Fields (all part of the key):
    suite: Debian suite, one of `debian.SUITES`; fixes the Python version (`python`).
    python_requested: the Python version asked for when the suite ships another (see
      `suite_for_python`), else None.
    system_packages: sorted Debian package names ("git", "libxml2-dev=2.9.14+dfsg-1.3").
    pip: PEP 508 requirements, installed in this order in one pip run into /usr/local
      (the interpreter's default site-packages, seen by `python3 -I`); pins ("==") make a
      build reproducible, unpinned ones get what PyPI has at build time (the build's manifest
      records `pip freeze`).
    install: shell commands run after `pip`, in /workspace holding the repository's files,
      without network (e.g. "python -m pip install -e ."): what they put under /usr/local stays.
    env: sorted (NAME, VALUE) pairs set while building and in the Docker image.
    repository: "owner/name@commit" (or any "x/y@hex" naming the files) that `install` runs on;
      required with `install`, since the build depends on those files.
    tools: `TOOL` entries installed in this order after `pip`, in the same download step, apart
      from the task's packages: "npm:NAME@VERSION" globally into /usr/local (its commands in
      /usr/local/bin; the base gets Debian's npm), "pip:NAME==VERSION" into its own virtual
      environment `TOOLS_DIR`/NAME (its commands in its bin/; nothing of it on the task's
      sys.path). Part of the key only when set, so environments without tools keep their keys.
  """

  suite: str = DEFAULT_SUITE
  python_requested: Optional[str] = None
  system_packages: tuple[str, ...] = ()
  pip: tuple[str, ...] = ()
  install: tuple[str, ...] = ()
  env: tuple[tuple[str, str], ...] = ()
  repository: Optional[str] = None
  tools: tuple[str, ...] = ()

  def __post_init__(self):
    _validate(self)

  @classmethod
  def create(cls, *, python: Optional[str] = None, suite: Optional[str] = None,
             system_packages: Sequence[str] = (), pip: Sequence[str] = (),
             install: Sequence[str] = (), env: Optional[Mapping[str, str]] = None,
             repository: Optional[str] = None, python_policy: str = "nearest",
             tools: Sequence[str] = ()) -> "Environment":
    """An environment from loose arguments: `python` picks the suite (`suite_for_python`)
    unless `suite` is given (then `python`, if given, must be that suite's); packages are
    sorted and deduplicated, `env` sorted.

    Raises:
      SpecError: naming the bad field.
    """
    requested = None
    if suite is None:
      suite, requested = (suite_for_python(python, python_policy) if python is not None
                          else (DEFAULT_SUITE, None))
    elif python is not None and SUITES.get(suite) != ".".join(
        map(str, _version(python, "python"))):
      raise SpecError(f"python={python!r}: suite={suite!r} ships Python {SUITES.get(suite)}")
    try:
      packages = check_packages(tuple(system_packages), "system_packages")
    except ValueError as e:
      raise SpecError(str(e)) from None
    return cls(suite=suite, python_requested=requested, system_packages=packages,
               pip=tuple(pip), install=tuple(install),
               env=tuple(sorted((env or {}).items())), repository=repository,
               tools=tuple(tools))

  @property
  def python(self) -> str:
    """The Python version the environment's python3 has ("3.11")."""
    return SUITES[self.suite]

  def to_dict(self) -> dict:
    """The canonical JSON form (lists for tuples; `python` included for readers; `tools` only
    when set)."""
    d = {"suite": self.suite, "python": self.python, "python_requested": self.python_requested,
         "system_packages": list(self.system_packages), "pip": list(self.pip),
         "install": list(self.install), "env": dict(self.env), "repository": self.repository}
    if self.tools:
      d["tools"] = list(self.tools)
    return d

  @property
  def key(self) -> str:
    """64 hex digits: SHA-256 of the canonical JSON of `to_dict()`."""
    return cache.content_key({"kind": "environment", **self.to_dict()})

  @property
  def name(self) -> str:
    """A short name for logs and image tags: "env-" and the key's first 16 hex digits."""
    return "env-" + self.key[:16]

  def without_install(self) -> "Environment":
    """The same environment without `install` and `repository` (its dependencies layer)."""
    return dataclasses.replace(self, install=(), repository=None)


def _validate(e: Environment) -> None:
  """Raises SpecError naming every bad field (messages joined with "; ")."""
  errors: list[str] = []

  def bad(field, value, what):
    errors.append(f"{field}={value!r:.200}: expected {what}")

  if e.suite not in SUITES:
    bad("suite", e.suite, f"one of {sorted(SUITES)}")
  elif e.python_requested is not None:
    try:
      v = _version(e.python_requested, "python_requested")
      if f"{v[0]}.{v[1]}" != e.python_requested or e.python_requested == e.python:
        bad("python_requested", e.python_requested, "None or 'MAJOR.MINOR' other than the "
            "suite's python")
    except SpecError as err:
      errors.append(str(err))
  packages = e.system_packages
  if not isinstance(packages, tuple):
    bad("system_packages", packages, "a tuple of Debian package names")
  else:
    for i, p in enumerate(packages):
      try:
        check_packages([p], f"system_packages[{i}]")
      except ValueError as err:
        errors.append(str(err).replace(f"system_packages[{i}][0]", f"system_packages[{i}]"))
    if list(packages) != sorted(set(packages), key=str):
      bad("system_packages", packages, "a sorted tuple without duplicates "
          "(Environment.create sorts)")
  for field in ("pip", "install", "tools"):
    items = getattr(e, field)
    if not isinstance(items, tuple) or len(items) > MAX_ITEMS:
      bad(field, items, f"a tuple of at most {MAX_ITEMS} strings")
      continue
    for i, s in enumerate(items):
      if not isinstance(s, str) or not s.strip() or len(s) > MAX_LEN or "\x00" in s:
        bad(f"{field}[{i}]", s, f"a non-empty string of at most {MAX_LEN} characters")
      elif field == "pip" and not REQUIREMENT.match(s.strip()):
        bad(f"pip[{i}]", s, "a PEP 508 requirement ('name[extra]==1.2; marker'), not an "
            "option, path or URL")
      elif field == "tools" and not TOOL.match(s):
        bad(f"tools[{i}]", s, "'npm:NAME@X.Y.Z' or 'pip:NAME==VERSION' (exact versions)")
    if field == "tools" and len(set(items)) != len(items):
      bad("tools", items, "no duplicate entries")
  if not isinstance(e.env, tuple) or not all(
      isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, str) for x in p)
      for p in e.env):
    bad("env", e.env, "(NAME, VALUE) string pairs")
  else:
    if list(e.env) != sorted(set(e.env)):
      bad("env", e.env, "sorted (NAME, VALUE) pairs (Environment.create sorts)")
    for name, value in e.env:
      if not _ENV_NAME.match(name) or name in _RESERVED_ENV:
        bad(f"env.{name}", value, f"a variable name other than {sorted(_RESERVED_ENV)}")
      elif "\x00" in value or len(value) > MAX_LEN:
        bad(f"env.{name}", value, f"a value of at most {MAX_LEN} characters")
  if e.repository is not None and not (isinstance(e.repository, str)
                                       and _REPOSITORY.match(e.repository)):
    bad("repository", e.repository, "'owner/name@commit' (hex commit)")
  if e.install and e.repository is None:
    bad("repository", e.repository, "'owner/name@commit' naming the files `install` runs on")
  if errors:
    raise SpecError(None, errors)


def from_dict(d: Any, field: str = "environment") -> Environment:
  """An Environment from spec data (JSON object / TOML table).

  Keys: `python` or `suite` (or both, agreeing), `system_packages`, `pip`, `install` (a list
  of commands, or one string), `env` (an object of strings), `repository`, `tools`,
  `python_policy`
  ("nearest" | "exact"), `python_requested` (as `to_dict` writes it: kept when it is what
  `python` maps from). Unknown keys are refused, so a typo is not silently ignored.

  Raises:
    SpecError: "FIELD.KEY=VALUE: expected ..." for every bad field, joined with "; ".
  """
  if not isinstance(d, Mapping):
    raise SpecError(f"{field}={d!r:.200}: expected an object of environment fields")
  allowed = set(FIELDS) | {"python_policy"}
  errors = [f"{field}.{k}: unknown field (expected some of {sorted(allowed)})"
            for k in sorted(set(d) - allowed, key=str)]
  lists = {}
  for key in ("system_packages", "pip", "install", "tools"):
    v = d.get(key, [])
    v = [v] if key == "install" and isinstance(v, str) else v
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
      errors.append(f"{field}.{key}={v!r:.200}: expected a list of strings")
    else:
      lists[key] = tuple(v)
  env = d.get("env", {})
  if not isinstance(env, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in env.items()):
    errors.append(f"{field}.env={env!r:.200}: expected an object of string values")
    env = {}
  text = {}
  for key in ("python", "suite", "repository", "python_policy", "python_requested"):
    if d.get(key) is not None and not isinstance(d[key], str):
      errors.append(f"{field}.{key}={d[key]!r:.200}: expected a string")
    else:
      text[key] = d.get(key)
  requested = text.get("python_requested")
  python = requested or text.get("python")  # to_dict's output maps back to itself
  suite = text.get("suite")
  if requested is not None and suite is not None:
    python = None  # the recorded choice: the suite is authoritative
  try:
    suite_given = Environment.create(python=python, suite=suite,
                                     python_policy=text.get("python_policy") or "nearest")
  except SpecError as e:  # the other fields are still checked below
    errors += [f"{field}.{m}" for m in e.errors]
    suite_given = Environment()
  try:
    packages = tuple(sorted(set(lists.get("system_packages", ()))))
    env_obj = Environment(suite=suite_given.suite, python_requested=
                          suite_given.python_requested or requested, system_packages=packages,
                          pip=lists.get("pip", ()), install=lists.get("install", ()),
                          env=tuple(sorted(env.items())), repository=text.get("repository"),
                          tools=lists.get("tools", ()))
  except SpecError as e:
    errors += [f"{field}.{m}" for m in e.errors]
  if errors:
    raise SpecError(None, errors)
  return env_obj


def load_file(path: str) -> Environment:
  """An Environment from a user's spec file: JSON (.json) or TOML (.toml; the spec at top
  level or under an [environment] table).

  Raises:
    SpecError: "PATH: environment.KEY=...: ..." naming the file and the bad field, or the
      parse error's position.
  """
  with open(path, "rb") as f:
    data = f.read(1 << 20)
  try:
    if path.endswith(".toml"):
      import tomllib
      obj = tomllib.loads(data.decode("utf-8"))
      obj = obj.get("environment", obj)
    elif path.endswith(".json"):
      obj = json.loads(data)
    else:
      raise SpecError(f"{path}: expected a .json or .toml environment file")
  except (ValueError, UnicodeDecodeError) as e:
    if isinstance(e, SpecError):
      raise
    raise SpecError(f"{path}: not valid {os.path.splitext(path)[1][1:].upper()}: {e}") from None
  try:
    return from_dict(obj)
  except SpecError as e:
    raise SpecError(None, [f"{path}: {m}" for m in e.errors]) from None
