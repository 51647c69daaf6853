"""Parameter sweeps of `trainer.main`: one job per point, locally or on TPU slices.

    python -m launch.xm --config=configs/X.py[:ARG] --workdir=/tmp/sweep \\
        --sweep='optimizer.learning_rate=1e-4,3e-4;rl.loss=grpo,cispo' [--dry_run]
    python -m launch.xm --config=configs/X.py --workdir=gs://B/sweep --executor=tpu \\
        --tpu=v5p-64 --zone=Z --project=P --spot --sweep='seed=0,1,2'

The sweep is given on the command line (one convention, chosen over a `get_sweep()` in the
config so that any config can be swept without editing it): `;` separates axes, each axis is
`KEY=V1,V2,...`, and the jobs are the Cartesian product of the axes (2 x 2 = 4 jobs above).
KEY is a dotted config field, checked against the config before anything starts; values are
passed verbatim as `--config.KEY=VALUE` (so `1e-4` stays `1e-4`; a value cannot contain `,` or
`;`). Extra `--config.KEY=VALUE` arguments apply to every job. Job i writes to
`WORKDIR/i_KEY=VALUE_...`.

Executors:
  local       XManager's local executor (the `xmanager` package): one experiment, one work
              unit per job, run as local processes.
  subprocess  the same jobs one after another as plain subprocesses (no xmanager needed).
  tpu         one queued-resource TPU slice per job, through launch.tpu's helpers (detached:
              each job's slice runs and checkpoints on its own; no xmanager needed).
`--dry_run` prints each job's command (or, for tpu, its gcloud commands and boot script) and
works without xmanager. Before any job starts (and under `--dry_run`) each job's config values
are checked (`launch/config_check.py`): on this machine every input it reads must exist here;
on TPU slices as `launch.tpu` checks them (the mesh against the chips, inputs that ship with
the code or are gs:// URLs).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import re
import shlex
import subprocess
import sys
import tempfile
from typing import Optional, Sequence

from launch import common, config_check
from launch import tpu as tpu_launch
from launch.common import LaunchError

EXECUTORS = ("local", "subprocess", "tpu")
XMANAGER_PIN = "xmanager==0.8.5.post1"


@dataclasses.dataclass(frozen=True)
class SweepJob:
  """One point of a sweep: its overrides and its own workdir."""

  index: int
  point: tuple[tuple[str, str], ...]  # (config key, value text) of this job
  overrides: tuple[str, ...]  # every --config.KEY=VALUE of the job (shared ones first)
  workdir: str

  @property
  def label(self) -> str:
    """KEY=VALUE,... of the point ("base" for a sweep without axes)."""
    return ",".join(f"{k}={v}" for k, v in self.point) or "base"


def parse_sweep(spec: str) -> list[tuple[str, list[str]]]:
  """Parses a --sweep value: 'a=1,2;b=x' -> [('a', ['1', '2']), ('b', ['x'])].

  Args:
    spec: axes separated by ';', each KEY=V1,V2,... with KEY a dotted config field.

  Returns:
    The axes in order, values as text.

  Raises:
    LaunchError: a malformed axis, an empty or repeated value, or a key in two axes; the
      message names --sweep and the part.
  """
  axes: list[tuple[str, list[str]]] = []
  for part in (p.strip() for p in (spec or "").split(";")):
    if not part:
      continue
    key, sep, values = part.partition("=")
    key = key.strip()
    vals = [v.strip() for v in values.split(",")]
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", key):
      raise LaunchError(f"--sweep: {part!r}: expected KEY=V1,V2,... with KEY a dotted config "
                        "field (axes separated by ';')")
    if not all(vals):
      raise LaunchError(f"--sweep: {part!r}: empty value (values are separated by ',')")
    if key in (k for k, _ in axes):
      raise LaunchError(f"--sweep: key {key!r} appears in two axes")
    if len(set(vals)) != len(vals):
      raise LaunchError(f"--sweep: {part!r}: repeated value")
    axes.append((key, vals))
  return axes


def _slug(point: Sequence[tuple[str, str]]) -> str:
  text = "_".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in point) or "base"
  return re.sub(r"[^A-Za-z0-9=._-]+", "-", text)[:80]


def expand(axes: Sequence[tuple[str, Sequence[str]]], shared: Sequence[str],
           workdir: str) -> list[SweepJob]:
  """The jobs of a sweep: the Cartesian product of the axes (the last axis varies fastest).

  Args:
    axes: (config key, values) per axis, as `parse_sweep` returns them.
    shared: `--config.KEY=VALUE` overrides for every job (they come first).
    workdir: the parent of the jobs' workdirs.

  Returns:
    One SweepJob per point, numbered from 0; job i writes to WORKDIR/i_KEY=VALUE_...
  """
  keys = [k for k, _ in axes]
  jobs = []
  for i, values in enumerate(itertools.product(*[v for _, v in axes])):
    point = tuple(zip(keys, values))
    overrides = tuple(shared) + tuple(f"--config.{k}={v}" for k, v in point)
    jobs.append(SweepJob(i, point, overrides, f"{workdir.rstrip('/')}/{i}_{_slug(point)}"))
  return jobs


def job_argv(config: str, job: SweepJob, python: str = sys.executable) -> list[str]:
  """The trainer's command line for one job.

  Args:
    config: configs/NAME.py[:ARG].
    job: the sweep job (its overrides and workdir).
    python: the interpreter that runs trainer.main.

  Returns:
    The argv.
  """
  return [python, "-m", "trainer.main", f"--config={config}", *job.overrides,
          f"--workdir={job.workdir}"]


# ---------------------------------------------------------------------------------------------
# Executors


def import_xmanager():
  """(xm, xm_local), or a LaunchError that says how to get them."""
  try:
    from xmanager import xm, xm_local  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise LaunchError(f"--executor=local needs the xmanager package, which is not installed "
                      f"({e}); `pip install {XMANAGER_PIN}` (note: it pins protobuf<7 and pulls "
                      "in Vertex AI and Kubernetes clients), or use --executor=subprocess or "
                      "--dry_run") from None
  return xm, xm_local


def run_xmanager_local(config: str, jobs: Sequence[SweepJob], title: str) -> int:
  """Runs the jobs as one XManager experiment, each a work unit of trainer.main run locally.

  Args:
    config: configs/NAME.py[:ARG].
    jobs: the jobs.
    title: the experiment's title.

  Returns:
    0 (XManager reports the work units' outcomes itself).

  Raises:
    LaunchError: xmanager is not installed.
  """
  xm, xm_local = import_xmanager()
  os.chdir(common.REPO_ROOT)  # local jobs inherit it: `python -m trainer.main` resolves here
  with xm_local.create_experiment(experiment_title=title) as experiment:
    [executable] = experiment.package([xm.binary(
        path=sys.executable, executor_spec=xm_local.LocalSpec())])
    for job in jobs:
      args = job_argv(config, job)[1:]  # the binary is the interpreter
      experiment.add(xm.Job(executable=executable, executor=xm_local.Local(), args=args))
  return 0


def run_subprocesses(config: str, jobs: Sequence[SweepJob]) -> int:
  """Runs the jobs one after another as subprocesses.

  Args:
    config: configs/NAME.py[:ARG].
    jobs: the jobs.

  Returns:
    0 if every job succeeded, else 1 (after running them all).
  """
  failed = []
  for job in jobs:
    argv = job_argv(config, job)
    print(f"# job {job.index}: {job.label}\n{shlex.join(argv)}", flush=True)
    if subprocess.run(argv, cwd=common.REPO_ROOT).returncode:
      failed.append(job.index)
  if failed:
    print(f"launch.xm: jobs {failed} failed", file=sys.stderr)
  return 1 if failed else 0


def tpu_job(args: argparse.Namespace, config: str, job: SweepJob) -> tpu_launch.Job:
  """The launch.tpu Job of one sweep job: its own slice, named PREFIX-INDEX.

  Args:
    args: the parsed flags (--tpu, --zone, --project, --name, --spot, --secret).
    config: configs/NAME.py[:ARG].
    job: the sweep job.

  Returns:
    The TPU job, its config's values checked for the slice.

  Raises:
    LaunchError: a bad flag or config value; the message names it.
  """
  sl = tpu_launch.parse_accelerator(args.tpu)
  base = args.name or tpu_launch.default_name(config, args.tpu)
  name = common.check_name("--name", f"{base[:63 - 1 - len(str(job.index))]}-{job.index}")
  secrets = common.parse_secrets("--secret", args.secret)
  overrides, inputs = config_check.check_slice(
      config_check.load(config, job.overrides), job.overrides, sl.chips, f"--tpu={args.tpu}",
      tuple(secrets))
  return tpu_launch.Job(name=name, slice=sl, zone=args.zone, project=args.project,
                        config=config, overrides=overrides, workdir=job.workdir,
                        spot=args.spot, secrets=tuple(sorted(secrets.items())), inputs=inputs)


def run_on_tpu(args: argparse.Namespace, jobs: Sequence[SweepJob],
               tpu_jobs: Sequence[tpu_launch.Job]) -> int:
  """Starts one detached TPU slice per job (no requeues), or prints them with --dry_run.

  Args:
    args: the parsed flags.
    jobs: the jobs.
    tpu_jobs: their TPU jobs (`tpu_job`).

  Returns:
    0 once every slice is started (or printed).

  Raises:
    subprocess.CalledProcessError: a gcloud command failed.
  """
  for job, tj in zip(jobs, tpu_jobs):
    print(f"# ==== job {job.index}: {job.label} -> {tj.name}")
    tmp = os.path.join(tempfile.gettempdir(), f"arbor-launch-{tj.name}")
    if args.dry_run:
      script = os.path.join(tmp, "startup.sh")
      common.print_script("boot script", script, tpu_launch.boot_script(tj))
      common.run(tpu_launch.launch_commands(tj, script, os.path.join(tmp, "arbor-src.tar.gz")),
                 dry_run=True)
    else:
      os.makedirs(tmp, exist_ok=True)
      script = common.write_script(tmp, "startup.sh", tpu_launch.boot_script(tj))
      tarball = common.make_tarball(os.path.join(tmp, "arbor-src.tar.gz"))
      tpu_launch.execute(tj, script, tarball, max_requeues=0, detach=True, logs_worker="0")
  return 0


# ---------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
  """The command-line flags (`--config.KEY=VALUE` overrides are parsed by `parse`)."""
  p = argparse.ArgumentParser(
      prog="python -m launch.xm", description=__doc__, allow_abbrev=False,
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="Extra --config.KEY=VALUE arguments apply to every job.")
  a = p.add_argument
  a("--config", required=True, help="configs/NAME.py[:ARG]")
  a("--sweep", default="", help="'KEY=V1,V2;KEY2=V3,V4': Cartesian product of the axes")
  a("--workdir", required=True, help="parent of the jobs' workdirs (gs:// for --executor=tpu)")
  a("--executor", default="local", choices=EXECUTORS, help="where the jobs run")
  a("--title", default="", help="experiment title (default: config name + sweep)")
  a("--tpu", default="", help="--executor=tpu: accelerator type, e.g. v5p-64")
  common.add_cloud_flags(p, {
      "zone": "--executor=tpu: zone",
      "project": "--executor=tpu: project",
      "name": "--executor=tpu: queued resource name prefix (job index added)",
      "spot": "--executor=tpu: spot capacity",
      "secret": "--executor=tpu: Secret Manager secret into /run/arbor/secrets/NAME",
      "dry_run": "print the jobs; run nothing",
  })
  return p


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, str, list[SweepJob]]:
  """Parses and checks the command line (`tpu_job` checks the config values of TPU jobs).

  Args:
    argv: the arguments, without the program name.

  Returns:
    (the parsed flags, the config relative to the repository root, the jobs).

  Raises:
    LaunchError: a bad flag, sweep or override; a key that is not a field of the config; a
      bad config value of a job on this machine.
  """
  args, extra = build_parser().parse_known_args(list(argv))
  shared = common.split_overrides(extra, "launch.xm passes only --config.KEY=VALUE on")
  config = common.check_config_path("--config", args.config)
  axes = parse_sweep(args.sweep)
  keys = common.override_keys(shared)
  for k, _ in axes:
    if k in keys:
      raise LaunchError(f"--sweep: {k!r} is also given as --config.{k}=...; pick one")
  common.check_override_keys(config, keys + [k for k, _ in axes], "--sweep/--config.KEY")
  if args.executor == "tpu":
    for flag in ("tpu", "zone", "project"):
      if not getattr(args, flag):
        raise LaunchError(f"--executor=tpu needs --{flag}")
    tpu_launch.parse_accelerator(args.tpu)
    common.check_zone("--zone", args.zone)
    common.check_project("--project", args.project)
  workdir = config_check.check_workdir("--workdir", args.workdir, remote=args.executor == "tpu")
  jobs = expand(axes, shared, workdir)
  if args.executor != "tpu":
    for job in jobs:
      config_check.check_local(config_check.load(config, job.overrides))
  return args, config, jobs


def main(argv: Optional[Sequence[str]] = None) -> int:
  """The command line: run the sweep on the chosen executor, or print it with `--dry_run`.

  Args:
    argv: the arguments, without the program name (default: sys.argv[1:]).

  Returns:
    The exit status: 0 done, 1 a subprocess job failed, 2 bad flags.
  """
  argv = sys.argv[1:] if argv is None else argv
  try:
    args, config, jobs = parse(argv)
    tpu_jobs = [tpu_job(args, config, j) for j in jobs] if args.executor == "tpu" else []
    title = args.title or f"{os.path.basename(config.split(':')[0])} {args.sweep}".strip()
    print(f"# launch.xm: {len(jobs)} job(s), executor {args.executor}: {title}")
    if args.executor == "tpu":
      return run_on_tpu(args, jobs, tpu_jobs)
    if args.dry_run:
      for job in jobs:
        print(f"# job {job.index}: {job.label}\n{shlex.join(job_argv(config, job))}")
      return 0
    if args.executor == "local":
      return run_xmanager_local(config, jobs, title)
    return run_subprocesses(config, jobs)
  except LaunchError as e:
    print(f"launch.xm: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
