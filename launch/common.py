"""Pieces the launchers share: commands run or printed, cloud flags, configs, names, secrets.

A launcher builds a list of `Command`s (argv lists, never shell strings) and hands it to `run`,
which prints them under `--dry_run` and runs them otherwise. Secrets never appear in a command
or a script: scripts name Secret Manager secrets and fetch them on the machine into root-only
files (`secret_fetch_lines`), and a value that must be fed to gcloud (a generated token) goes
through the command's stdin, which is never printed.

The `check_*` functions take the flag (or config field) a value came from and raise
`LaunchError` naming it and the value; they refuse placeholders (`/path/to/...`, `gs://BUCKET`,
`REDIS_HOST`) so that a copied example fails here, not once the machines are up.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import ipaddress
import os
import re
import shlex
import subprocess
import sys
import tarfile
import urllib.parse
from typing import Any, Iterable, Mapping, Optional, Sequence, TextIO

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# GCE / TPU resource names: RFC 1035 labels (lower case, digits, dashes; start with a letter).
_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
# Secret Manager secret ids: letters, digits, dashes and underscores, at most 255.
_SECRET_RE = re.compile(r"^[A-Za-z0-9_-]{1,255}$")
# File names under /run/arbor/secrets (a config refers to them by this name).
_FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# Cloud Storage bucket names: lower case, digits, dashes, underscores and dots, 3-222 characters
# (63 without dots), starting and ending with a letter or digit.
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")
# Project ids: 6-30 lower-case letters, digits and dashes, starting with a letter (an optional
# "domain:" prefix for the older domain-scoped projects).
_PROJECT_RE = re.compile(r"^([a-z0-9.-]+:)?[a-z][a-z0-9-]{4,28}[a-z0-9]$")
# Zones: REGION-LETTER, e.g. us-east5-a, europe-west4-b, northamerica-northeast1-c.
_ZONE_RE = re.compile(r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")
# Host names: dot-separated labels of lower-case letters, digits and inner dashes.
_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
_HOST_RE = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")
# What the examples in docs and configs write where a real value belongs.
PLACEHOLDER = "/path/to/"

# Where scripts on the VMs put fetched secrets: /run is a tmpfs, so they never reach a disk.
SECRETS_DIR = "/run/arbor/secrets"
# Pinned so every VM bootstraps the same installer (PyPI `uv`).
UV_VERSION = "0.13.8"


class LaunchError(ValueError):
  """A bad flag or value; the message names the flag and the value."""


@dataclasses.dataclass(frozen=True)
class Command:
  """One program invocation. `stdin` (e.g. a generated token) is fed to it and never printed."""

  argv: tuple[str, ...]
  why: str = ""  # one line printed above the command in --dry_run output
  stdin: Optional[bytes] = dataclasses.field(default=None, repr=False)
  stdin_note: str = ""  # what the stdin holds, for the dry-run listing (never the value)

  def __str__(self) -> str:
    return shlex.join(self.argv)


def print_commands(commands: Iterable[Command], out: Optional[TextIO] = None) -> None:
  """Prints each command as a shell line, its `why` above it; stdin is named, never shown.

  Args:
    commands: the commands, in order.
    out: where to print (default: sys.stdout).
  """
  out = out or sys.stdout  # looked up per call: tests redirect it
  for c in commands:
    if c.why:
      print(f"# {c.why}", file=out)
    line = str(c)
    if c.stdin is not None:
      line += f"  # stdin: {c.stdin_note or 'data'} (not shown)"
    print(line, file=out)


def run(commands: Sequence[Command], dry_run: bool, out: Optional[TextIO] = None) -> None:
  """Prints the commands (dry run) or runs them in order, stopping at the first failure.

  Args:
    commands: the commands, in order.
    dry_run: print only.
    out: where to print (default: sys.stdout).

  Raises:
    subprocess.CalledProcessError: a command exited with a non-zero status.
  """
  out = out or sys.stdout
  if dry_run:
    print_commands(commands, out)
    return
  for c in commands:
    print_commands([c], out)
    out.flush()
    subprocess.run(c.argv, input=c.stdin, check=True)


def capture(argv: Sequence[str]) -> str:
  """Runs a command and returns its stdout (for polling, e.g. a queued resource's state).

  Args:
    argv: the program and its arguments.

  Returns:
    stdout with surrounding whitespace removed.
  """
  return subprocess.run(list(argv), check=True, capture_output=True, text=True).stdout.strip()


def print_script(title: str, path: str, script: str, out: Optional[TextIO] = None) -> None:
  """Prints a script between `# ---- TITLE (PATH) ----` and `# ---- end of TITLE ----` lines.

  Args:
    title: what the script is, e.g. "boot script".
    path: where a real run writes it.
    script: its text.
    out: where to print (default: sys.stdout).
  """
  out = out or sys.stdout
  print(f"# ---- {title} ({path}) ----", file=out)
  print(script.rstrip("\n"), file=out)
  print(f"# ---- end of {title} ----", file=out)


def write_script(directory: str, name: str, script: str) -> str:
  """Writes a script, mode 0700 (it names secrets, never holds them).

  Args:
    directory: an existing directory.
    name: the file name.
    script: its text.

  Returns:
    The script's path.
  """
  path = os.path.join(directory, name)
  with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o700), "w") as f:
    f.write(script)
  return path


# ---------------------------------------------------------------------------------------------
# Validation


def check_name(flag: str, value: str) -> str:
  """Checks a GCE/TPU resource name (an RFC 1035 label).

  Args:
    flag: the flag or config field it came from.
    value: the name: lower-case letters, digits and dashes, starting with a letter, at most 63
      characters.

  Returns:
    `value`.

  Raises:
    LaunchError: not a resource name.
  """
  if not _NAME_RE.match(value or ""):
    raise LaunchError(f"{flag}={value!r}: expected a resource name of lower-case letters, digits "
                      "and dashes, starting with a letter, at most 63 characters")
  return value


def check_not_placeholder(flag: str, value: str) -> str:
  """Checks that a value does not hold the examples' `/path/to/` (a value still to be filled in).

  Args:
    flag: the flag or config field it came from.
    value: the value (None counts as "").

  Returns:
    `value`.

  Raises:
    LaunchError: `value` contains PLACEHOLDER.
  """
  if PLACEHOLDER in (value or ""):
    how = f" (--{flag}=...)" if flag.startswith("config.") else ""
    raise LaunchError(f"{flag}={value!r}: a placeholder; give the real path{how}")
  return value


def is_gcs(value: str) -> bool:
  """Whether `value` is meant as a Cloud Storage URL (`check_gcs` says if it is one)."""
  return value.startswith("gs:")


def check_gcs(flag: str, value: str) -> str:
  """Checks a gs://BUCKET/PATH URL (VMs cannot see this machine's disk).

  Args:
    flag: the flag or config field it came from.
    value: the URL: a valid bucket name and a non-empty path, no whitespace, no placeholder.

  Returns:
    The URL without trailing slashes.

  Raises:
    LaunchError: not such a URL.
  """
  check_not_placeholder(flag, value)
  bucket, _, path = (value or "").removeprefix("gs://").partition("/")
  if (not (value or "").startswith("gs://") or not _BUCKET_RE.match(bucket)
      or ("." not in bucket and len(bucket) > 63) or not path.strip("/")
      or re.search(r"\s", value)):
    raise LaunchError(f"{flag}={value!r}: expected a gs://BUCKET/PATH URL, BUCKET a bucket name "
                      "(3-63 lower-case letters, digits, dashes, dots); TPU and fleet VMs cannot "
                      "see this machine's disk")
  return value.rstrip("/")


def check_project(flag: str, value: str) -> str:
  """Checks a Google Cloud project id (e.g. my-project-123).

  Args:
    flag: the flag or config field it came from.
    value: the project id (an optional "domain:" prefix allowed).

  Returns:
    `value`.

  Raises:
    LaunchError: not a project id.
  """
  if not _PROJECT_RE.match(value or ""):
    raise LaunchError(f"{flag}={value!r}: expected a project id (6-30 lower-case letters, "
                      "digits and dashes, starting with a letter)")
  return value


def check_zone(flag: str, value: str) -> str:
  """Checks a Compute Engine zone (e.g. us-east5-a).

  Args:
    flag: the flag or config field it came from.
    value: the zone, REGION-LETTER.

  Returns:
    `value`.

  Raises:
    LaunchError: not a zone.
  """
  if not _ZONE_RE.match(value or ""):
    raise LaunchError(f"{flag}={value!r}: expected a zone such as us-east5-a")
  return value


def check_url(flag: str, url: str, schemes: Sequence[str],
              secrets_go: str = "a file or a secret") -> urllib.parse.SplitResult:
  """Checks a SCHEME://HOST:PORT URL without credentials; an error never echoes a password.

  Args:
    flag: the flag or config field it came from.
    url: the URL.
    schemes: the schemes it may have, e.g. ("redis", "rediss").
    secrets_go: where credentials belong instead, for the error message.

  Returns:
    The URL's parts.

  Raises:
    LaunchError: a malformed URL, another scheme, credentials in it, or a host that is not a
      lower-case host name or an IP address (REDIS_HOST and the like are placeholders).
  """
  expected = " or ".join(f"{s}://HOST:PORT" for s in schemes)
  try:
    parts = urllib.parse.urlsplit(url or "")
    parts.port  # raises ValueError on a malformed port
  except ValueError:
    raise LaunchError(f"{flag}: not a URL (expected {expected})") from None
  if parts.password is not None or parts.username:
    raise LaunchError(f"{flag}: the URL carries credentials; put them in {secrets_go}, never "
                      "in a URL (it would show in process lists and metadata)")
  if parts.scheme not in schemes or not parts.hostname:
    raise LaunchError(f"{flag}={url!r}: expected {expected}")
  # parts.hostname is lower-cased; the placeholder test needs the host as written
  host = parts.hostname if parts.netloc.startswith("[") else parts.netloc.split(":", 1)[0]
  try:
    ipaddress.ip_address(host)
  except ValueError:
    if not _HOST_RE.match(host):
      raise LaunchError(f"{flag}={url!r}: {host!r} is not a lower-case host name or an IP "
                        "address (a placeholder?)") from None
  return parts


def parse_secrets(flag: str, values: Sequence[str]) -> dict[str, str]:
  """Parses `NAME=SECRET_ID` pairs.

  Args:
    flag: the flag they came from, for the error message.
    values: the pairs; NAME is a file name under SECRETS_DIR, SECRET_ID a Secret Manager id.

  Returns:
    {file name: Secret Manager secret id}.

  Raises:
    LaunchError: a malformed pair, or a file name given twice.
  """
  out: dict[str, str] = {}
  for v in values or ():
    name, sep, secret = v.partition("=")
    if not sep or not _FILE_RE.match(name) or not _SECRET_RE.match(secret):
      raise LaunchError(f"{flag}={v!r}: expected NAME=SECRET_ID (NAME a file name under "
                        f"{SECRETS_DIR}, SECRET_ID a Secret Manager secret id; the value itself "
                        "never goes on a command line)")
    if name in out:
      raise LaunchError(f"{flag}: file name {name!r} given twice")
    out[name] = secret
  return out


def secret_fetch_lines(secrets: dict[str, str], project: str,
                       directory: str = SECRETS_DIR) -> list[str]:
  """Bash lines that fetch each secret's latest version into `directory/NAME`, mode 0600, root.

  The VM's service account needs roles/secretmanager.secretAccessor on each secret.

  Args:
    secrets: {file name: Secret Manager secret id}.
    project: the project that holds the secrets.
    directory: where the files go (a tmpfs).

  Returns:
    The lines (none without secrets).
  """
  if not secrets:
    return []
  lines = [f"install -d -m 0700 -o root -g root {shlex.quote(directory)}",
           "( umask 077"]
  for name, secret in sorted(secrets.items()):
    path = shlex.quote(f"{directory}/{name}")
    lines.append(f"  gcloud secrets versions access latest --secret={shlex.quote(secret)} "
                 f"--project={shlex.quote(project)} --out-file={path}")
  lines.append(")")
  return lines


# ---------------------------------------------------------------------------------------------
# Flags

# The cloud flags that mean the same to every launcher offering them (`add_cloud_flags`), as
# argparse keywords; each launcher words the help for its own resources.
CLOUD_FLAGS: dict[str, dict[str, Any]] = {
    "project": {"default": ""},
    "zone": {"default": ""},
    "name": {"default": ""},
    "spot": {"action": "store_true"},
    "service_account": {"default": ""},
    "network": {"default": ""},
    "secret": {"action": "append", "default": [], "metavar": "NAME=SECRET_ID"},
    "teardown": {"action": "store_true"},
    "dry_run": {"action": "store_true"},
}


def add_cloud_flags(parser: argparse.ArgumentParser, helps: Mapping[str, str], *,
                    required: Iterable[str] = (),
                    defaults: Optional[Mapping[str, Any]] = None) -> None:
  """Adds the `CLOUD_FLAGS` a launcher offers, in the order of `helps`.

  Args:
    parser: the launcher's parser.
    helps: flag (a key of CLOUD_FLAGS) -> its help text in this launcher.
    required: flags that must be given (they have no default).
    defaults: flag -> this launcher's default, where it is not CLOUD_FLAGS's.
  """
  required, defaults = set(required), defaults or {}
  for flag, text in helps.items():
    kwargs = copy.deepcopy(CLOUD_FLAGS[flag])  # a fresh default list per parser
    if flag in required:
      del kwargs["default"]
      kwargs["required"] = True
    elif flag in defaults:
      kwargs["default"] = defaults[flag]
    parser.add_argument(f"--{flag}", help=text, **kwargs)


# ---------------------------------------------------------------------------------------------
# Configs and overrides


def split_config_arg(config: str) -> tuple[str, Optional[str]]:
  """Splits a config argument: 'configs/X.py:ARG' -> ('configs/X.py', 'ARG').

  Args:
    config: the config file, optionally followed by `:ARG` for its `get_config`.

  Returns:
    (path, ARG or None without a colon).
  """
  path, sep, arg = config.partition(":")
  return path, (arg if sep else None)


def check_shipped(flag: str, value: str, *, file_only: bool = False) -> str:
  """Checks a path inside the repository, relative to its root (it ships with the code).

  Remote machines run the code in the unpacked source tree, so a relative path means the same
  file there as here; a file git ignores does not ship.

  Args:
    flag: the flag or config field it came from.
    value: the path, relative to the repository root.
    file_only: a directory is refused.

  Returns:
    The path, normalised, relative to the repository root.

  Raises:
    LaunchError: a path outside the repository, missing, or ignored by git.
  """
  check_not_placeholder(flag, value)
  full = os.path.abspath(os.path.join(REPO_ROOT, value or ""))
  exists = os.path.isfile(full) if file_only else os.path.exists(full)
  if not value or os.path.isabs(value) or not full.startswith(REPO_ROOT + os.sep) or not exists:
    raise LaunchError(f"{flag}={value!r}: expected gs://BUCKET/PATH or a "
                      f"{'file' if file_only else 'path'} inside the repository, relative to its "
                      "root (it ships with the code; this machine's other paths do not exist "
                      "there)")
  relative = os.path.relpath(full, REPO_ROOT)
  try:  # a read-only query; exit status 0: ignored
    ignored = subprocess.run(["git", "check-ignore", "-q", relative], cwd=REPO_ROOT,
                             capture_output=True).returncode == 0
  except OSError:  # no git: nothing to go by
    ignored = False
  if ignored:
    raise LaunchError(f"{flag}={value!r}: git ignores it, so it does not ship with the code; "
                      "copy it to gs:// or stop ignoring it")
  return relative


def check_config_path(flag: str, config: str) -> str:
  """Checks a config argument configs/NAME.py[:ARG] whose file is inside the repository.

  The config must live in the repository because it ships with the code.

  Args:
    flag: the flag it came from.
    config: the config file, relative to the repository root (or absolute, inside it),
      optionally followed by `:ARG`.

  Returns:
    The config argument with its path relative to the repository root.

  Raises:
    LaunchError: not a .py file, outside the repository, or missing.
  """
  path, _ = split_config_arg(config or "")
  if not path.endswith(".py"):
    raise LaunchError(f"{flag}={config!r}: expected configs/NAME.py[:ARG]")
  full = os.path.abspath(os.path.join(REPO_ROOT, path))
  if not full.startswith(REPO_ROOT + os.sep):
    raise LaunchError(f"{flag}={config!r}: the config must live inside the repository "
                      f"({REPO_ROOT}) so that it ships with the code")
  if not os.path.isfile(full):
    raise LaunchError(f"{flag}={config!r}: no such file {full}")
  _, arg = split_config_arg(config)
  return os.path.relpath(full, REPO_ROOT) + ("" if arg is None else f":{arg}")


def load_config(config: str):
  """Loads a config file and calls its `get_config`.

  Args:
    config: configs/NAME.py[:ARG], relative to the repository root.

  Returns:
    `get_config(ARG)`, or `get_config()` without ARG (an ml_collections.ConfigDict).
  """
  path, arg = split_config_arg(config)
  full = os.path.join(REPO_ROOT, path)
  spec = importlib.util.spec_from_file_location(f"_arbor_config_{abs(hash(full))}", full)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg) if arg is not None else module.get_config()


def check_override_keys(config: str, keys: Iterable[str], flag: str) -> None:
  """Checks that every dotted key names a field of the config (typos fail here, not on a pod).

  Args:
    config: configs/NAME.py[:ARG].
    keys: dotted field names, e.g. "optimizer.learning_rate".
    flag: the flag(s) they came from, for the error message.

  Raises:
    LaunchError: a key that is not a field; the message lists the fields where it stops.
  """
  cfg = load_config(config)
  for key in keys:
    node = cfg
    for i, part in enumerate(key.split(".")):
      try:
        node = node[part]
      except (KeyError, TypeError, AttributeError):
        where = ".".join(key.split(".")[:i]) or "the top level"
        fields = sorted(node.keys()) if hasattr(node, "keys") else []
        raise LaunchError(f"{flag}: {key!r} is not a field of {config} (no {part!r} at {where}; "
                          f"fields there: {fields})") from None


def split_overrides(extra: Sequence[str], flag_help: str) -> list[str]:
  """Checks that the arguments argparse left over are all `--config.KEY=VALUE` overrides.

  Args:
    extra: the unparsed arguments.
    flag_help: what the launcher accepts, for the error message.

  Returns:
    The overrides, in order.

  Raises:
    LaunchError: any other argument.
  """
  out = []
  for a in extra:
    if not (a.startswith("--config.") and "=" in a):
      raise LaunchError(f"unknown argument {a!r}: {flag_help}")
    out.append(a)
  return out


def override_keys(overrides: Sequence[str]) -> list[str]:
  """The KEYs of `--config.KEY=VALUE` overrides, in order."""
  return [a[len("--config."):].split("=", 1)[0] for a in overrides]


# ---------------------------------------------------------------------------------------------
# Source tarball


def source_files(root: str = REPO_ROOT) -> list[str]:
  """Files git tracks plus untracked files it does not ignore (so uncommitted work ships).

  Args:
    root: the repository.

  Returns:
    Sorted paths relative to `root`, regular files only.
  """
  out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       cwd=root, check=True, capture_output=True).stdout
  names = sorted({n for n in out.decode().split("\0") if n})
  return [n for n in names if os.path.isfile(os.path.join(root, n))]


def make_tarball(path: str, root: str = REPO_ROOT) -> str:
  """Writes a gzipped tarball of `source_files`, paths relative to the repository root.

  Args:
    path: the tarball to write.
    root: the repository.

  Returns:
    `path`.
  """
  with tarfile.open(path, "w:gz") as tar:
    for name in source_files(root):
      tar.add(os.path.join(root, name), arcname=name, recursive=False)
  return path


def install_lines(src: str, venv: str, extra: str) -> list[str]:
  """Bash lines that install the code at `src` into a Python 3.11 venv at `venv`.

  uv provides Python 3.11 where the image has an older one (TPU images run Ubuntu 22.04's
  3.10; numpy 2.4 needs 3.11) and installs with requirements-lock.txt as constraints, so VMs
  run the versions the tests ran.

  Args:
    src: the unpacked source tree on the VM.
    venv: the virtual environment to (re)create.
    extra: the setup.py extra to install, e.g. "tpu" ("" for none).

  Returns:
    The lines.
  """
  q = shlex.quote
  return [
      "if ! python3 -c 'import ensurepip' 2>/dev/null; then  # Debian/Ubuntu split venv out",
      "  apt-get -qq update && DEBIAN_FRONTEND=noninteractive apt-get -qq install -y python3-venv",
      "fi",
      "python3 -m venv /opt/arbor/bootstrap",
      f"/opt/arbor/bootstrap/bin/pip install -q uv=={UV_VERSION}",
      f"rm -rf {q(venv)}",  # fresh each boot, like the code it installs
      f"/opt/arbor/bootstrap/bin/uv venv --python 3.11 {q(venv)}",
      f"/opt/arbor/bootstrap/bin/uv pip install --python {q(venv)}/bin/python "
      f"-c {q(src)}/requirements-lock.txt -e {q(f'{src}[{extra}]' if extra else src)}",
  ]
