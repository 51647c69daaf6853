"""Launch `trainer.main` on a Cloud TPU slice through a queued resource.

    python -m launch.tpu --config=configs/X.py[:ARG] --tpu=v5p-128 --zone=us-east5-a \\
        --project=P --workdir=gs://BUCKET/run [--spot] [--config.key=value ...] [--dry_run]
    python -m launch.tpu --tpu=v5p-128 --zone=us-east5-a --project=P --name=NAME --teardown

Before anything is created (and under `--dry_run`) the flags and the config's values are
checked (`launch/config_check.py`): the accelerator type, zone, project and gs:// workdir are
well-formed, the config's mesh fits the slice's chips, and every input the run reads is a path
inside the repository (it ships with the code), a gs:// URL or a `--secret` file, with no
placeholder left. A bad value is one line naming the flag or field and the value (exit 2).

What it does, in order (each step is one gcloud command; `--dry_run` prints them all and the
boot script instead of running them):

1. Packs the working tree (git-tracked and untracked-but-not-ignored files) into a tarball and
   copies it to `WORKDIR/code/arbor-src.tar.gz` (or, with `--git_url`, the VMs clone instead).
2. Creates a queued resource (spot with `--spot`, on-demand otherwise) whose TPU VMs carry the
   boot script as `startup-script` metadata. The script runs on every worker at every boot: it
   fetches the code and the config's gs:// inputs (into /opt/arbor/inputs; the trainer is
   given the copies, since it opens inputs as local files), installs the code (uv, Python
   3.11, `.[tpu]` constrained by requirements-lock.txt), fetches `--secret`s from Secret
   Manager into root-only files under /run/arbor/secrets, and starts the `arbor-train` unit.
3. Waits for the queued resource to be ACTIVE, then runs the same script on every worker over
   `gcloud compute tpus tpu-vm ssh --worker=all` (a no-op where boot already started the unit).
4. Streams worker 0's log until its trainer exits. If the slice was lost meanwhile (spot
   preemption: the queued resource is SUSPENDED or FAILED), deletes it and creates it again, up
   to `--max_requeues` times; the new workers boot, install and start the trainer, which
   restores the latest checkpoint in the same workdir.

Multi-host environment. On a TPU VM `jax.distributed.initialize()` needs no arguments: JAX reads
the worker number (`agent-worker-number`) and the worker list (`worker-network-endpoints`) from
the metadata server, and worker 0 is the coordinator. The wrapper still exports them so the
trainer, logs and tests see one explicit contract:
  JAX_COORDINATOR_ADDRESS  worker 0's address, port 8476 (JAX reads this variable itself)
  ARBOR_NUM_PROCESSES      hosts in the slice (from the accelerator table below; the wrapper
                           checks the metadata lists as many workers)
  ARBOR_PROCESS_ID         this worker's number
  JAX_PLATFORMS=tpu        fail instead of silently falling back to CPU
  LIBTPU_INIT_ARGS         XLA/TPU flags (`--libtpu_init_args`), when given
The trainer calls `jax.distributed.initialize()` when ARBOR_NUM_PROCESSES > 1.

Preemption. The trainer checkpoints on SIGTERM (trainer/checkpoint.py `PreemptionGuard`; on
several hosts JAX's preemption sync point picks one step for all). The trainer runs as the main
process of a systemd unit (`exec`, no shell in between, `KillMode=mixed`), so the SIGTERM that
systemd sends at shutdown (which is how a spot preemption reaches processes) goes to Python
itself; the unit is ordered after network-online.target, so the network is still up while the
checkpoint is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

from launch import common, config_check
from launch.common import Command, LaunchError

# ---------------------------------------------------------------------------------------------
# Accelerator types -> hosts.
#
# Sources (checked 2026-11): cloud.google.com/tpu/docs/v4, /v5p, /v5e, /v6e (configuration
# tables: chips, TensorCores, hosts/VMs per slice shape) and /tpu/docs/runtimes (software
# versions for JAX). The number in an accelerator type counts TensorCores on v4 and v5p (two
# per chip: v5p-128 = 64 chips) and chips on v5e and v6e (one TensorCore per chip). Multi-host
# slices have 4 chips per TPU VM (worker) on every generation; v5e/v6e slices of up to 8 chips
# are a single VM. So v5p-128 = 64 chips = 16 workers of 4 chips; v6e-256 = 64 workers.


@dataclasses.dataclass(frozen=True)
class Generation:
  """What one TPU generation's accelerator types mean in chips and hosts."""

  prefix: str  # accelerator type prefix, e.g. "v5p" in "v5p-128"
  cores_per_chip: int  # what the type's number counts per chip (TensorCores or chips)
  chips_per_host: int  # chips per TPU VM in multi-host slices
  max_single_host_chips: int  # slices of at most this many chips are one VM
  max_chips: int  # largest single slice
  valid_chips: Optional[tuple[int, ...]]  # allowed slice sizes (None: multiples of a host)
  runtime_version: str  # TPU software version for JAX


GENERATIONS: dict[str, Generation] = {
    "v4": Generation("v4", 2, 4, 4, 4096, None, "tpu-ubuntu2204-base"),
    "v5p": Generation("v5p", 2, 4, 4, 6144, None, "v2-alpha-tpuv5"),
    "v5litepod": Generation("v5litepod", 1, 4, 8, 256, (1, 4, 8, 16, 32, 64, 128, 256),
                            "v2-alpha-tpuv5-lite"),
    "v6e": Generation("v6e", 1, 4, 8, 256, (1, 4, 8, 16, 32, 64, 128, 256), "v2-alpha-tpuv6e"),
}


@dataclasses.dataclass(frozen=True)
class Slice:
  """One accelerator type resolved: its generation, chips and hosts (TPU VMs)."""

  accelerator_type: str
  generation: Generation
  chips: int
  hosts: int

  @property
  def chips_per_host(self) -> int:
    """Chips on each TPU VM."""
    return self.chips // self.hosts


def parse_accelerator(tpu: str) -> Slice:
  """Resolves an accelerator type: 'v5p-128' -> Slice(chips=64, hosts=16).

  Args:
    tpu: the --tpu value, TYPE-N.

  Returns:
    The slice.

  Raises:
    LaunchError: an unknown generation or a size the generation does not offer; the message
      names the flag, the value and the rule.
  """
  m = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", tpu or "")
  if not m or m.group(1) not in GENERATIONS:
    raise LaunchError(f"--tpu={tpu!r}: expected TYPE-N with TYPE one of "
                      f"{sorted(GENERATIONS)} (e.g. v5p-128, v6e-64)")
  gen, n = GENERATIONS[m.group(1)], int(m.group(2))
  if n % gen.cores_per_chip:
    raise LaunchError(f"--tpu={tpu!r}: {gen.prefix} counts {gen.cores_per_chip} TensorCores per "
                      f"chip, so N must be a multiple of {gen.cores_per_chip}")
  chips = n // gen.cores_per_chip
  if gen.valid_chips is not None and chips not in gen.valid_chips:
    sizes = ", ".join(f"{gen.prefix}-{c * gen.cores_per_chip}" for c in gen.valid_chips)
    raise LaunchError(f"--tpu={tpu!r}: not a {gen.prefix} slice size; valid: {sizes}")
  if chips > gen.max_chips:
    raise LaunchError(f"--tpu={tpu!r}: {chips} chips exceed the largest {gen.prefix} slice "
                      f"({gen.max_chips} chips)")
  if chips < 1 or (gen.valid_chips is None and chips % gen.chips_per_host):
    raise LaunchError(f"--tpu={tpu!r}: {chips} chips is not a whole number of "
                      f"{gen.chips_per_host}-chip hosts")
  if chips <= gen.max_single_host_chips:
    return Slice(tpu, gen, chips, 1)
  return Slice(tpu, gen, chips, chips // gen.chips_per_host)


# ---------------------------------------------------------------------------------------------
# The boot script

COORDINATOR_PORT = 8476  # JAX's default coordinator port
LOG = "/var/log/arbor/train.log"
UNIT = "arbor-train"
SRC, VENV = "/opt/arbor/src", "/opt/arbor/venv"
METADATA = "http://metadata.google.internal/computeMetadata/v1/instance/attributes"


@dataclasses.dataclass(frozen=True)
class Job:
  """Everything the boot script and the gcloud commands need."""

  name: str  # queued resource id = TPU node id
  slice: Slice
  zone: str
  project: str
  config: str  # configs/X.py[:ARG], relative to the repository root
  overrides: tuple[str, ...]  # --config.key=value
  workdir: str  # gs://...
  spot: bool = False
  runtime_version: str = ""
  git_url: str = ""  # clone this instead of shipping a tarball
  git_ref: str = "main"
  secrets: tuple[tuple[str, str], ...] = ()  # (file name, Secret Manager id)
  service_account: str = ""
  network: str = ""
  subnetwork: str = ""
  internal_ips: bool = False
  libtpu_init_args: str = ""
  inputs: tuple[config_check.SliceInput, ...] = ()  # gs:// inputs copied onto every worker

  @property
  def code_url(self) -> str:
    """Where the source tarball is shipped."""
    return f"{self.workdir}/code/arbor-src.tar.gz"


def trainer_argv(job: Job) -> list[str]:
  """The trainer's command line on every worker."""
  return [f"{VENV}/bin/python", "-m", "trainer.main", f"--config={job.config}",
          *job.overrides, f"--workdir={job.workdir}"]


def train_wrapper(job: Job) -> str:
  """/opt/arbor/train.sh: the multi-host environment, then `exec` of the trainer."""
  q, hosts = shlex.quote, job.slice.hosts
  lines = [
      "#!/bin/bash",
      "# Written by launch.tpu's boot script. exec: SIGTERM goes straight to Python.",
      "set -euo pipefail",
  ]
  if hosts == 1:
    lines += ["export ARBOR_NUM_PROCESSES=1 ARBOR_PROCESS_ID=0"]
  else:
    lines += _multihost_lines(job)
  lines += ["export JAX_PLATFORMS=tpu", "export PYTHONUNBUFFERED=1"]
  if job.libtpu_init_args:
    lines.append(f"export LIBTPU_INIT_ARGS={q(job.libtpu_init_args)}")
  lines.append(f"cd {SRC}")
  lines.append("exec " + shlex.join(trainer_argv(job)))
  return "\n".join(lines) + "\n"


def _multihost_lines(job: Job) -> list[str]:
  """Worker id and coordinator from the TPU metadata; checks the host count of the table."""
  hosts = job.slice.hosts
  return [
      f"md() {{ curl -sf -H 'Metadata-Flavor: Google' \"{METADATA}/$1\"; }}",
      'ARBOR_PROCESS_ID="$(md agent-worker-number)"',
      'ENDPOINTS="$(md worker-network-endpoints)"',
      "# Entries are host names or name:id:ip triples; worker 0 coordinates.",
      "n=\"$(echo \"$ENDPOINTS\" | tr ',' '\\n' | grep -c .)\"",
      f'if [ "$n" != {hosts} ]; then',
      f'  echo "launch.tpu: {job.slice.accelerator_type} should have {hosts} workers, the '
      'metadata lists $n" >&2',
      "  exit 1",
      "fi",
      'first="${ENDPOINTS%%,*}"',
      f'export JAX_COORDINATOR_ADDRESS="${{first##*:}}:{COORDINATOR_PORT}"',
      f"export ARBOR_NUM_PROCESSES={hosts}",
      "export ARBOR_PROCESS_ID",
      f'echo "launch.tpu: worker $ARBOR_PROCESS_ID of {hosts}, coordinator '
      '$JAX_COORDINATOR_ADDRESS"',
  ]


def unit_file(job: Job) -> str:
  """The systemd unit that runs the wrapper; its SIGTERM reaches Python (module docstring)."""
  return "\n".join([
      "[Unit]",
      f"Description=Arbor trainer ({job.name})",
      "Wants=network-online.target",
      "After=network-online.target",  # stopped before the network at shutdown: saves reach GCS
      "[Service]",
      "Type=exec",
      f"WorkingDirectory={SRC}",
      "ExecStart=/opt/arbor/train.sh",
      "KillMode=mixed",  # SIGTERM to the main process (Python) only, SIGKILL to all at timeout
      "KillSignal=SIGTERM",
      "TimeoutStopSec=600",
      "Restart=no",  # one host restarting alone would hang the others in a collective
      f"StandardOutput=append:{LOG}",
      "StandardError=inherit",
  ]) + "\n"


def boot_script(job: Job) -> str:
  """The startup-script metadata: code, install, secrets, wrapper, unit; idempotent.

  Every worker runs it at every boot; it names secrets and never holds one.

  Args:
    job: the job.

  Returns:
    The bash script.
  """
  q = shlex.quote
  if job.git_url:
    code = [f"git clone --quiet {q(job.git_url)} {SRC}",
            f"git -C {SRC} checkout --quiet {q(job.git_ref)}"]
  else:
    code = [f"gcloud storage cp {q(job.code_url)} /opt/arbor/src.tar.gz",
            f"tar -xzf /opt/arbor/src.tar.gz -C {SRC}"]
  lines = [
      "#!/bin/bash",
      f"# Arbor launch.tpu boot script for {job.name} ({job.slice.accelerator_type}: "
      f"{job.slice.hosts} workers x {job.slice.chips_per_host} chips).",
      "# Runs at every boot of every worker (startup-script metadata) and once more through",
      "# `tpu-vm ssh --worker=all`; the lock and the unit state make a second run a no-op.",
      "# It names secrets and never holds one: they are fetched from Secret Manager.",
      "set -euo pipefail",
      "exec 9>/var/lock/arbor-launch.lock",
      "flock 9",
      f"if systemctl is-active --quiet {UNIT}; then echo '{UNIT} is already running'; exit 0; fi",
      "mkdir -p /opt/arbor /var/log/arbor",
      "# 1. code and the config's gs:// inputs (the trainer is given these copies)",
      f"rm -rf {SRC} {config_check.INPUTS_DIR} && mkdir -p {SRC}",
      *code,
      *(f"mkdir -p {q(i.dest)} && gcloud storage cp -r {q(i.url)} {q(i.dest)}/"
        for i in job.inputs),
      "# 2. install (Python 3.11 venv; tested versions from requirements-lock.txt)",
      *common.install_lines(SRC, VENV, "tpu"),
      "# 3. secrets (root-only files on tmpfs)",
      *common.secret_fetch_lines(dict(job.secrets), job.project),
      "# 4. the trainer: wrapper + systemd unit",
      "cat > /opt/arbor/train.sh <<'ARBOR_EOF'",
      train_wrapper(job).rstrip("\n"),
      "ARBOR_EOF",
      "chmod 0755 /opt/arbor/train.sh",
      f"cat > /etc/systemd/system/{UNIT}.service <<'ARBOR_EOF'",
      unit_file(job).rstrip("\n"),
      "ARBOR_EOF",
      "systemctl daemon-reload",
      f"systemctl reset-failed {UNIT} 2>/dev/null || true",
      f"systemctl start {UNIT}",
      f"echo '{UNIT} started; log: {LOG}'",
  ]
  return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# gcloud commands


def _where(job: Job) -> list[str]:
  return [f"--zone={job.zone}", f"--project={job.project}"]


def upload_command(job: Job, tarball: str) -> Command:
  """Copies the source tarball to `job.code_url`.

  Args:
    job: the job.
    tarball: the local source tarball.

  Returns:
    The gcloud storage cp command.
  """
  return Command(("gcloud", "storage", "cp", tarball, job.code_url),
                 "ship the working tree (git-tracked + untracked, not ignored)")


def create_command(job: Job, script_path: str) -> Command:
  """Creates the queued resource whose VMs boot with the script at `script_path`.

  Args:
    job: the job (slice, runtime version, spot, service account, network).
    script_path: the local boot script file (`boot_script`).

  Returns:
    The gcloud command.
  """
  argv = ["gcloud", "compute", "tpus", "queued-resources", "create", job.name,
          f"--node-id={job.name}", f"--accelerator-type={job.slice.accelerator_type}",
          f"--runtime-version={job.runtime_version or job.slice.generation.runtime_version}",
          *_where(job), f"--metadata-from-file=startup-script={script_path}",
          "--scopes=https://www.googleapis.com/auth/cloud-platform"]
  if job.spot:
    argv.append("--spot")
  if job.service_account:
    argv.append(f"--service-account={job.service_account}")
  if job.network:
    argv.append(f"--network={job.network}")
  if job.subnetwork:
    argv.append(f"--subnetwork={job.subnetwork}")
  if job.internal_ips:
    argv.append("--internal-ips")
  kind = "spot" if job.spot else "on-demand"
  return Command(tuple(argv), f"queue a {kind} {job.slice.accelerator_type} "
                 f"({job.slice.chips} chips, {job.slice.hosts} hosts)")


def describe_command(job: Job) -> Command:
  """Prints the queued resource's state (ACTIVE, SUSPENDED, ...)."""
  return Command(("gcloud", "compute", "tpus", "queued-resources", "describe", job.name,
                  *_where(job), "--format=value(state.state)"),
                 "poll every 30 s until ACTIVE (SUSPENDED/FAILED: lost, requeue)")


def ssh_command(job: Job, worker: str, command: str, why: str) -> Command:
  """Runs a shell command on one TPU worker or on all of them.

  Args:
    job: the job.
    worker: "0", "1", ... or "all".
    command: the shell command run there.
    why: the command's description, printed with it.

  Returns:
    The gcloud ssh command.
  """
  return Command(("gcloud", "compute", "tpus", "tpu-vm", "ssh", job.name, *_where(job),
                  f"--worker={worker}", f"--command={command}"), why)


def start_command(job: Job) -> Command:
  """Runs the boot script once more on every worker (a no-op where it already started)."""
  fetch = (f"curl -sf -H 'Metadata-Flavor: Google' -o /tmp/arbor-boot.sh "
           f"{METADATA}/startup-script && sudo bash /tmp/arbor-boot.sh")
  return ssh_command(job, "all", fetch,
                     f"start trainer.main on all {job.slice.hosts} workers (boot script again)")


def logs_command(job: Job, worker: str = "0") -> Command:
  """Streams a worker's trainer log until the trainer exits, then its exit status.

  Args:
    job: the job.
    worker: the worker whose log is streamed ("all" for every one).

  Returns:
    The gcloud ssh command.
  """
  tail = (f"pid=$(systemctl show -p MainPID --value {UNIT}); "
          f"if [ \"$pid\" -gt 0 ]; then sudo tail -n +1 -F --pid=\"$pid\" {LOG}; "
          f"else sudo cat {LOG}; fi; "
          f"echo \"{UNIT}: $(systemctl show -p Result --value {UNIT}), "
          f"exit status $(systemctl show -p ExecMainStatus --value {UNIT})\"")
  return ssh_command(job, worker, tail, f"stream worker {worker}'s log until its trainer exits")


def delete_command(job: Job) -> Command:
  """Deletes the queued resource and its TPU VMs."""
  return Command(("gcloud", "compute", "tpus", "queued-resources", "delete", job.name,
                  *_where(job), "--force", "--quiet"),
                 "tear down: delete the queued resource and its TPU VMs")


def launch_commands(job: Job, script_path: str, tarball: str = "arbor-src.tar.gz"
                    ) -> list[Command]:
  """The commands of one launch, in order, as `--dry_run` lists them.

  Args:
    job: the job.
    script_path: the boot script's file.
    tarball: the source tarball's file (not shipped with `job.git_url`).

  Returns:
    Upload (unless git), create, describe (the polling), start, logs.
  """
  cmds = [] if job.git_url else [upload_command(job, tarball)]
  return cmds + [create_command(job, script_path), describe_command(job), start_command(job),
                 logs_command(job)]


# ---------------------------------------------------------------------------------------------
# Running (the polling and requeue loop; every gcloud call goes through `common`)

LOST_STATES = ("SUSPENDING", "SUSPENDED", "FAILED")


def state(job: Job) -> str:
  """The queued resource's state; FAILED where it cannot be described (deleted)."""
  try:
    return common.capture(describe_command(job).argv) or "UNKNOWN"
  except Exception as e:  # a deleted queued resource: describe fails
    print(f"launch.tpu: describe failed ({e}); treating the slice as lost", file=sys.stderr)
    return "FAILED"


def wait_active(job: Job, poll_s: float = 30.0) -> str:
  """Polls the queued resource's state until it is ACTIVE or lost.

  Args:
    job: the job.
    poll_s: seconds between polls.

  Returns:
    "ACTIVE", or the lost state (one of LOST_STATES).
  """
  while True:
    s = state(job)
    print(f"launch.tpu: {job.name} is {s}", flush=True)
    if s == "ACTIVE" or s in LOST_STATES:
      return s
    time.sleep(poll_s)


def execute(job: Job, script_path: str, tarball: Optional[str], max_requeues: int,
            detach: bool, logs_worker: str) -> int:
  """Runs a job: upload, create, wait, start, stream logs; requeues a lost slice.

  Args:
    job: the job.
    script_path: the boot script's file.
    tarball: the source tarball to upload (None: the VMs clone `job.git_url`).
    max_requeues: how often a lost (preempted) slice is deleted and created again.
    detach: return once the trainer is started, without streaming its log.
    logs_worker: the worker whose log is streamed.

  Returns:
    0 once the trainer exited on a slice that is still up (or was started, with `detach`);
    1 after `max_requeues` lost slices.

  Raises:
    subprocess.CalledProcessError: a gcloud command (other than the log stream) failed.
  """
  if tarball:
    common.run([upload_command(job, tarball)], dry_run=False)
  for attempt in range(max_requeues + 1):
    if attempt:
      print(f"launch.tpu: slice lost; requeue {attempt}/{max_requeues} (resumes from the "
            f"latest checkpoint in {job.workdir})", flush=True)
      common.run([delete_command(job)], dry_run=False)
    common.run([create_command(job, script_path)], dry_run=False)
    if wait_active(job) != "ACTIVE":
      continue
    common.run([start_command(job)], dry_run=False)
    if detach:
      return 0
    try:
      common.run([logs_command(job, logs_worker)], dry_run=False)
    except Exception as e:  # the ssh session dies with the VMs
      print(f"launch.tpu: log stream ended ({e})", file=sys.stderr)
    if state(job) not in LOST_STATES:
      print(f"launch.tpu: trainer on worker {logs_worker} exited; the slice is still up "
            f"(tear it down: --teardown --name={job.name})")
      return 0
  print(f"launch.tpu: gave up after {max_requeues} requeues", file=sys.stderr)
  return 1


# ---------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
  """The command-line flags (`--config.KEY=VALUE` overrides are parsed by `parse`)."""
  p = argparse.ArgumentParser(
      prog="python -m launch.tpu", description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="Extra arguments of the form --config.KEY=VALUE are passed to trainer.main.",
      allow_abbrev=False)
  a = p.add_argument
  a("--config", help="configs/NAME.py[:ARG] (inside the repository; ships with the code)")
  a("--tpu", required=True, help="accelerator type, e.g. v5p-128, v6e-64, v5litepod-16")
  common.add_cloud_flags(p, {
      "zone": "TPU zone, e.g. us-east5-a",
      "project": "Google Cloud project id",
      "name": "queued resource and TPU node name (default: arbor-<config>-<tpu>)",
      "spot": "spot capacity (preemptible; requeued on loss)",
      "secret": "fetch Secret Manager secret SECRET_ID into /run/arbor/secrets/NAME (repeatable)",
      "service_account": "TPU VM service account (needs GCS + secret access)",
      "network": "VPC network",
      "teardown": "delete the queued resource --name and exit",
      "dry_run": "print the gcloud commands and the boot script",
  }, required=("zone", "project"), defaults={"name": None})
  a("--subnetwork", default="", help="VPC subnetwork")
  a("--internal_ips", action="store_true", help="no external IPs (needs Cloud NAT for installs)")
  a("--workdir", help="gs://BUCKET/PATH: checkpoints, logs, the code tarball")
  a("--runtime_version", default="", help="TPU software version (default: per generation)")
  a("--git_url", default="", help="clone this repository on the VMs instead of a tarball")
  a("--git_ref", default="main", help="commit/branch/tag to check out with --git_url")
  a("--libtpu_init_args", default="", help="LIBTPU_INIT_ARGS for the trainer (XLA TPU flags)")
  a("--max_requeues", type=int, default=3, help="re-create a lost (preempted) slice this often")
  a("--detach", action="store_true", help="return after starting; do not stream logs")
  a("--logs_worker", default="0", help="worker whose log is streamed ('all' for every one)")
  a("--skip_config_check", action="store_true",
    help="do not load the config here: no check of its keys and values, no copy of its "
         "gs:// inputs")
  return p


def default_name(config: Optional[str], tpu: str) -> str:
  """Makes the default resource name arbor-<config file name>-<accelerator type>.

  Args:
    config: configs/NAME.py[:ARG], or None ("run").
    tpu: the accelerator type, e.g. v5p-128.

  Returns:
    A valid resource name (lower case, dashes, at most 63 characters).
  """
  base = os.path.splitext(os.path.basename(common.split_config_arg(config or "run")[0]))[0]
  name = re.sub(r"[^a-z0-9-]+", "-", f"arbor-{base}-{tpu}".lower()).strip("-")
  return name[:63].rstrip("-")


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, Job]:
  """Parses and checks the command line.

  Args:
    argv: the arguments, without the program name.

  Returns:
    (the parsed flags, the Job; with --teardown a Job that only names the resource).

  Raises:
    LaunchError: a bad flag or value; the message names the flag.
  """
  args, extra = build_parser().parse_known_args(list(argv))
  overrides = common.split_overrides(extra, "launch.tpu passes only --config.KEY=VALUE on")
  sl = parse_accelerator(args.tpu)
  name = common.check_name("--name", args.name or default_name(args.config, args.tpu))
  if args.max_requeues < 0:
    raise LaunchError(f"--max_requeues={args.max_requeues}: must be >= 0")
  zone = common.check_zone("--zone", args.zone)
  project = common.check_project("--project", args.project)
  if args.teardown:
    return args, Job(name, sl, zone, project, "", (), "")
  if not args.config:
    raise LaunchError("--config is required (configs/NAME.py[:ARG])")
  config = common.check_config_path("--config", args.config)
  workdir = config_check.check_workdir("--workdir", args.workdir, remote=True)
  secrets = common.parse_secrets("--secret", args.secret)
  overrides, inputs = tuple(overrides), ()
  if not args.skip_config_check:
    if overrides:
      common.check_override_keys(config, common.override_keys(overrides), "--config.KEY")
    overrides, inputs = config_check.check_slice(
        config_check.load(config, overrides), overrides, sl.chips, f"--tpu={args.tpu}",
        tuple(secrets))
  job = Job(name=name, slice=sl, zone=zone, project=project, config=config,
            overrides=overrides, workdir=workdir, spot=args.spot,
            runtime_version=args.runtime_version, git_url=args.git_url, git_ref=args.git_ref,
            secrets=tuple(sorted(secrets.items())), service_account=args.service_account,
            network=args.network, subnetwork=args.subnetwork, internal_ips=args.internal_ips,
            libtpu_init_args=args.libtpu_init_args, inputs=inputs)
  return args, job


def main(argv: Optional[Sequence[str]] = None) -> int:
  """The command line: launch, `--dry_run` or `--teardown`.

  Args:
    argv: the arguments, without the program name (default: sys.argv[1:]).

  Returns:
    The exit status: 0 done, 1 a command failed or the slice was lost too often, 2 bad flags.
  """
  argv = sys.argv[1:] if argv is None else argv
  try:
    args, job = parse(argv)
  except LaunchError as e:
    print(f"launch.tpu: error: {e}", file=sys.stderr)
    return 2
  if args.teardown:
    try:
      common.run([delete_command(job)], args.dry_run)
    except subprocess.CalledProcessError as e:
      print(f"launch.tpu: error: {shlex.join(e.cmd)} exited with {e.returncode}",
            file=sys.stderr)
      return 1
    return 0
  if args.dry_run:  # writes nothing; the paths are where a real run puts its files
    tmp = os.path.join(tempfile.gettempdir(), f"arbor-launch-{job.name}")
    script = os.path.join(tmp, "startup.sh")
    print(f"# launch.tpu dry run: {job.slice.accelerator_type} = {job.slice.chips} chips = "
          f"{job.slice.hosts} hosts x {job.slice.chips_per_host} chips")
    common.print_script("boot script = startup-script metadata", script, boot_script(job))
    common.run(launch_commands(job, script, os.path.join(tmp, "arbor-src.tar.gz")), True)
    print(f"# on loss (spot preemption): {delete_command(job)} ; then create again "
          f"(at most {args.max_requeues} times)")
    print(f"# teardown: python -m launch.tpu --tpu={job.slice.accelerator_type} "
          f"--zone={job.zone} --project={job.project} --name={job.name} --teardown")
    return 0
  tmp = tempfile.mkdtemp(prefix="arbor-launch-")
  script = common.write_script(tmp, "startup.sh", boot_script(job))
  tarball = None if job.git_url else common.make_tarball(os.path.join(tmp, "arbor-src.tar.gz"))
  try:
    return execute(job, script, tarball, args.max_requeues, args.detach, args.logs_worker)
  except subprocess.CalledProcessError as e:
    print(f"launch.tpu: error: {shlex.join(e.cmd)} exited with {e.returncode}", file=sys.stderr)
    return 1


if __name__ == "__main__":
  sys.exit(main())
