"""A config's values, checked before a launcher starts anything: what the run will read exists
where it runs, no placeholder is left, and on a TPU slice the mesh fits the chips.

    config = config_check.load("configs/rl.py", ["--config.rl.tasks=gs://b/tasks.jsonl"])
    config_check.check_local(config)                    # the trainer runs on this machine
    overrides, inputs = config_check.check_slice(...)   # the trainer runs on a TPU slice

Where a path may point depends on where the trainer runs, because it opens every input as a
local file (only its workdir may be gs://):
  this machine  a file or directory that exists here (relative paths: to the repository root,
                where the jobs run);
  a TPU slice   a path inside the repository, relative to its root (it ships with the code and
                the trainer runs in the unpacked tree), a gs://BUCKET/PATH URL (the boot script
                copies it onto every worker and the trainer gets the copy: `SliceInput`), or a
                file that `--secret` fetches (/run/arbor/secrets/NAME). Other paths of the
                laptop do not exist there.
Only the fields the config's mode reads are checked (`INPUTS`), so the placeholders of a
template's unused sections do not stand in the way. `trainer.config.validate` checks every
other value when the run starts; of its rules this module repeats only those that a slice
would meet first, once it is up: the mesh against the devices, data.rows_per_batch against
data x fsdp x expert, and a local metrics.dir beside the gs:// workdir. Like all of launch, it never
imports JAX.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Optional, Sequence

import ml_collections
from ml_collections.config_flags import tuple_parser

from launch import common
from launch.common import LaunchError

# Where a TPU slice's gs:// inputs are copied: INPUTS_DIR/<i>/<the URL's last name>.
INPUTS_DIR = "/opt/arbor/inputs"


@dataclasses.dataclass(frozen=True)
class Field:
  """How one config field names an input."""

  prefix: str = ""  # regex of what comes before the path, e.g. "hf:|ckpt:"
  keyword: str = ""  # a value that names no input, e.g. "random"
  schemes: tuple[str, ...] = ()  # a URL, of these schemes (not a path)
  when: tuple[str, str] = ("", "")  # (field, value): read only with this setting
  expected: str = "a path"  # the form, for error messages


FIELDS = {
    "model.init": Field("hf:|ckpt:", "random", expected="'random', 'hf:DIR' or 'ckpt:DIR'"),
    "tokenizer.path": Field(),
    "data.sources": Field(),
    "data.eval_sources": Field(),
    "rl.tasks": Field(),
    "rl.reference": Field("ckpt:", "initial", expected="'initial' or 'ckpt:DIR'"),
    "rl.queue_url": Field(keyword="memory", schemes=("redis", "rediss"),
                          when=("rl.rollout_workers", "queue")),
    "rl.queue_password_file": Field(when=("rl.rollout_workers", "queue")),
    "rl.sandbox_url": Field(schemes=("http", "https"), when=("rl.sandbox", "remote")),
    "rl.sandbox_token_file": Field(when=("rl.sandbox", "remote")),
    "eval.tasks": Field(),
    "eval.checkpoints": Field("ckpt:", expected="'ckpt:DIR' entries"),
    "distill.teachers": Field("[^=]+=ckpt:", expected="'domain=ckpt:DIR' entries"),
}
_RL = ("model.init", "tokenizer.path", "rl.tasks", "rl.reference", "rl.queue_url",
       "rl.queue_password_file", "rl.sandbox_url", "rl.sandbox_token_file")
# The fields each mode reads (trainer/main.py runs the mode; "demo" nests an "sft" and an "rl"
# stage config, "smoke" reads no file).
INPUTS = {
    "sft": ("model.init", "tokenizer.path", "data.sources", "data.eval_sources"),
    "rl": _RL,
    "distill": _RL + ("distill.teachers",),
    "eval": ("model.init", "tokenizer.path", "eval.tasks", "eval.checkpoints", "rl.sandbox_url",
             "rl.sandbox_token_file"),
    "serve": ("model.init", "tokenizer.path"),
}
DEMO_STAGES = ("sft", "rl")


@dataclasses.dataclass(frozen=True)
class SliceInput:
  """A gs:// input that the boot script copies onto every worker of a slice."""

  field: str  # the config field that names it
  url: str  # gs://BUCKET/PATH, a file or a directory
  dest: str  # the directory it is copied into; the copy is dest/<the URL's last name>

  @property
  def path(self) -> str:
    """The copy's path on the workers."""
    return f"{self.dest}/{self.url.rsplit('/', 1)[-1]}"


# ---------------------------------------------------------------------------------------------
# The config with its overrides


def _parse(flag: str, kind: type, text: str) -> Any:
  """An override's text as trainer.main's config flags read it for a field of type `kind`."""
  try:
    if kind is tuple:
      return tuple_parser.TupleParser().parse(text)
    if kind is bool:
      return {"true": True, "t": True, "1": True, "false": False, "f": False,
              "0": False}[text.lower()]
    return kind(text)
  except (KeyError, ValueError, SyntaxError):
    raise LaunchError(f"{flag}: expected a value of type {kind.__name__}") from None


def load(config: str, overrides: Sequence[str]) -> ml_collections.ConfigDict:
  """The config with its `--config.KEY=VALUE` overrides applied.

  Args:
    config: configs/NAME.py[:ARG], relative to the repository root.
    overrides: the overrides, in order (a KEY the config lacks is left to the trainer).

  Returns:
    The ConfigDict the trainer will see.

  Raises:
    LaunchError: a value that does not parse as its field's type; the message names the flag.
  """
  cfg = common.load_config(config)
  for flag in overrides:
    key, text = flag[len("--config."):].split("=", 1)
    parent, _, leaf = key.rpartition(".")
    node = _get(cfg, parent) if parent else cfg
    if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
      continue
    kind = node.get_type(leaf)
    if kind not in (str, int, float, bool, tuple):
      continue  # sections and lists: the trainer's flags report them
    try:
      node[leaf] = _parse(flag, kind, text)
    except TypeError as e:
      raise LaunchError(f"{flag}: {e}") from None
  return cfg


def _get(cfg: ml_collections.ConfigDict, key: str) -> Any:
  """The value at dotted `key`, or None where the config lacks it."""
  node = cfg
  for part in key.split("."):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      return None
    node = node[part]
  return node


def _stages(cfg: ml_collections.ConfigDict) -> list[tuple[str, ml_collections.ConfigDict]]:
  """(field prefix, config) of each run the config describes: itself, or a demo's stages."""
  if cfg.get("mode") == "demo":
    return [(f"{s}.", cfg[s]) for s in DEMO_STAGES
            if isinstance(cfg.get(s), ml_collections.ConfigDict)]
  return [("", cfg)]


def _inputs(cfg: ml_collections.ConfigDict):
  """(field name, Field, entry) of every input the config's runs read; entries are strings."""
  for prefix, stage in _stages(cfg):
    for key in INPUTS.get(stage.get("mode"), ()):
      spec, value = FIELDS[key], _get(stage, key)
      when_key, when_value = spec.when
      if value is None or (when_key and _get(stage, when_key) != when_value):
        continue
      for entry in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(entry, str) and entry and entry != spec.keyword:
          yield prefix + key, spec, entry


def _paths(cfg: ml_collections.ConfigDict):
  """(field name, entry, the text before the path, the path) of each path the runs read, e.g.
  ("model.init", "hf:/ckpt/qwen", "hf:", "/ckpt/qwen"); URLs and placeholders checked on the way.

  Raises:
    LaunchError: a placeholder, a bad URL, or an entry not of its field's form.
  """
  for name, spec, entry in _inputs(cfg):
    field = f"config.{name}"
    common.check_not_placeholder(field, entry)
    if spec.schemes:
      common.check_url(field, entry, spec.schemes)
      continue
    m = re.fullmatch(f"({spec.prefix})(.+)", entry, re.S)
    if not m:
      raise LaunchError(f"{field}={entry!r}: expected {spec.expected}")
    yield name, entry, m.group(1), m.group(2)


# ---------------------------------------------------------------------------------------------
# Checks


def check_local(cfg: ml_collections.ConfigDict) -> None:
  """Checks the inputs of a run on this machine: each exists here, no placeholder.

  Args:
    cfg: the config, overrides applied (`load`).

  Raises:
    LaunchError: the first bad value; the message names the field and the value.
  """
  for name, entry, _, path in _paths(cfg):
    if common.is_gcs(path):
      raise LaunchError(f"config.{name}={entry!r}: the trainer opens it as a local file; copy "
                        "it to this machine (launch.tpu copies gs:// inputs onto a TPU slice)")
    if not os.path.exists(os.path.join(common.REPO_ROOT, path)):
      raise LaunchError(f"config.{name}={entry!r}: no such file or directory (relative paths "
                        f"are read from the repository root, {common.REPO_ROOT})")


def check_slice(cfg: ml_collections.ConfigDict, overrides: Sequence[str], chips: int,
                tpu_flag: str, secrets: Sequence[str] = ()
                ) -> tuple[tuple[str, ...], tuple[SliceInput, ...]]:
  """Checks a run on a TPU slice and says which gs:// inputs its workers copy.

  Args:
    cfg: the config, `overrides` applied (`load`).
    overrides: the job's `--config.KEY=VALUE` overrides.
    chips: the slice's chips (JAX devices).
    tpu_flag: the --tpu flag, e.g. "--tpu=v5p-128", for error messages.
    secrets: the file names `--secret` fetches into common.SECRETS_DIR.

  Returns:
    (the trainer's overrides: `overrides` with each gs:// input replaced by its copy, the
    inputs to copy).

  Raises:
    LaunchError: the first bad value; the message names the field and the value.
  """
  check_mesh(cfg, chips, tpu_flag)
  staged: dict[str, list] = {}  # field -> its value, gs:// entries replaced by their copies
  inputs: list[SliceInput] = []
  for name, entry, before, path in _paths(cfg):
    field = f"config.{name}"
    if common.is_gcs(path):
      url = common.check_gcs(field, path)
      inputs.append(SliceInput(name, url, f"{INPUTS_DIR}/{len(inputs)}"))
      staged.setdefault(name, []).append((entry, before + inputs[-1].path))
    elif path.startswith(common.SECRETS_DIR + "/"):
      if os.path.relpath(path, common.SECRETS_DIR) not in secrets:
        raise LaunchError(f"{field}={entry!r}: no --secret NAME=SECRET_ID fetches "
                          f"{os.path.basename(path)!r} into {common.SECRETS_DIR}")
    else:
      common.check_shipped(field, path)
  for prefix, stage in _stages(cfg):
    logdir = _get(stage, "metrics.dir")
    if logdir is not None and (not logdir or "://" in logdir):
      raise LaunchError(f"config.{prefix}metrics.dir={logdir!r}: set a directory on the TPU "
                        "VMs, e.g. /tmp/arbor_metrics (metrics are appended to local files and "
                        "the workdir is gs://)")
  return _replace(cfg, overrides, staged), tuple(inputs)


def _replace(cfg: ml_collections.ConfigDict, overrides: Sequence[str],
             staged: dict[str, list]) -> tuple[str, ...]:
  """`overrides` where each staged field is set (last) to its value with the copies' paths."""
  keys = set(staged)
  out = [o for o in overrides if o[len("--config."):].split("=", 1)[0] not in keys]
  for name, replacements in staged.items():
    value, swap = _get(cfg, name), dict(replacements)
    if isinstance(value, (tuple, list)):
      text = repr(tuple(swap.get(v, v) for v in value))
    else:
      text = swap[value]
    out.append(f"--config.{name}={text}")
  return tuple(out)


def check_mesh(cfg: ml_collections.ConfigDict, chips: int, tpu_flag: str) -> None:
  """Checks that each run's mesh fits `chips` devices and its rows split over the batch axes.

  `mesh` holds one size per axis (data, fsdp, tensor, expert), -1 for the remaining devices:
  the product of the fixed sizes must divide the devices (equal them without a -1).

  Args:
    cfg: the config with its overrides (a demo's stages are each checked).
    chips: the slice's chip count.
    tpu_flag: the flag naming the slice, for the error message.

  Raises:
    LaunchError: a mesh that does not fit, or `data.rows_per_batch` not a multiple of data x
      fsdp x expert (the batch axes); the message names the field, its values and the slice.
  """
  for prefix, stage in _stages(cfg):
    mesh = stage.get("mesh")
    if not isinstance(mesh, ml_collections.ConfigDict):
      continue
    sizes = mesh.to_dict()
    where = f"config.{prefix}mesh={sizes}"
    if any(not isinstance(v, int) or (v < 1 and v != -1) for v in sizes.values()):
      raise LaunchError(f"{where}: every axis must be a positive integer or -1")
    if list(sizes.values()).count(-1) > 1:
      raise LaunchError(f"{where}: at most one axis may be -1 (the remaining devices)")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    rest = -1 in sizes.values()
    if (chips % fixed) if rest else (fixed != chips):
      rule = "does not divide" if rest else "differs from"
      raise LaunchError(f"{where}: the product of the fixed axes, {fixed}, {rule} the "
                        f"{chips} chips of {tpu_flag} (-1 = the remaining devices)")
    data = [chips // fixed if sizes.get(a) == -1 else sizes.get(a, 1)
            for a in ("data", "fsdp", "expert")]
    rows = _get(stage, "data.rows_per_batch")
    if isinstance(rows, int) and rows % math.prod(data):
      raise LaunchError(f"config.{prefix}data.rows_per_batch={rows}: expected a multiple of "
                        f"mesh data x fsdp x expert = {math.prod(data)} on the {chips} chips of "
                        f"{tpu_flag}")


def check_workdir(flag: str, value: Optional[str], remote: bool) -> str:
  """Checks a run's workdir: gs://BUCKET/PATH, or (unless `remote`) a local directory.

  Args:
    flag: the flag it came from.
    value: the workdir; None or "" is refused.
    remote: the run is on remote machines, which can only reach gs://.

  Returns:
    The workdir (a gs:// URL without trailing slashes).

  Raises:
    LaunchError: missing, a placeholder, a malformed gs:// URL, a local path for a remote
      run, or a local path that is a file.
  """
  if not value:
    where = "gs://BUCKET/PATH" if remote else "a directory or gs://BUCKET/PATH"
    raise LaunchError(f"{flag} is required ({where}: checkpoints and logs)")
  if remote or common.is_gcs(value):
    return common.check_gcs(flag, value)
  common.check_not_placeholder(flag, value)
  if os.path.exists(value) and not os.path.isdir(value):
    raise LaunchError(f"{flag}={value!r}: a file, not a directory")
  return value
