"""The sandbox fleet: CPU VMs running `envs.sandbox_server` + `envs.rollout_worker`.

    python -m launch.fleet --workers 64 --machine_type e2-standard-8 --project P --zone Z \\
        --redis rediss://10.0.0.5:6378 --redis_password_secret arbor-redis \\
        --redis_ca_secret arbor-redis-ca --policy_url http://10.0.0.2:8000 \\
        --policy_token_secret arbor-policy --staging gs://B/fleet \\
        --tasks envs/data/swe/tasks.jsonl --tokenizer gs://B/tok/tokenizer.json [--dry_run]
    python -m launch.fleet --name arbor-fleet --project P --zone Z --teardown
    python -m launch.fleet --local --workers 2 --policy_url http://127.0.0.1:8000 \\
        --tokenizer tok.json [--policy_token_file F] [--dry_run]   # the same, on this machine

Cloud (one gcloud command per step; `--dry_run` prints them and the boot script):
1. the working tree as a tarball to `STAGING/code/arbor-src.tar.gz`;
2. an instance template: Debian 12, `--no-address` (private network only: no external IP;
   installs reach apt/PyPI through Cloud NAT), the boot script as startup-script metadata;
3. a managed instance group of `--workers` VMs from it (the group replaces VMs that die).
Each VM, at boot: installs bubblewrap and the code; fetches the Redis password, the policy
server's token and (when `--sandbox_token_secret` is given) the sandbox server's token from
Secret Manager into root-only files on tmpfs (/run/arbor/secrets; never in metadata, never on
a command line); without `--sandbox_token_secret` it generates the sandbox token itself (it is
only ever used over the VM's loopback); then starts two systemd units:
  arbor-sandbox  root (bwrap's uid pool and cgroups need it): the sandbox server on
                 127.0.0.1:8910, bearer token required;
  arbor-worker   the unprivileged user `arbor`: the rollout worker, talking to the sandbox
                 server over loopback, to Redis with AUTH (+TLS with rediss://) and to the
                 policy server with its token. The secrets reach it as systemd credentials
                 (LoadCredential: a private copy only this service can read).
With `--sandbox_backend docker` the VM also runs a Docker engine without bridge or iptables
and holds the `--image`s (bucket tarballs or registry pulls), which the sandbox server allows
(`launch/fleet_docker.py`).
SIGTERM (a VM stop or a group resize) stops the worker first: it delivers what it has
(envs/rollout_worker.py) and its leased draws go back to the queue.

Local (`--local`): redis-server (unless `--redis` is given), `--sandbox_servers` sandbox servers
(default: one per worker) and `--workers` rollout workers as subprocesses, every one bound to
127.0.0.1, with generated password and tokens in 0600 files of a 0700 directory. It prints the
Redis URL and the *files* that hold the secrets (a trainer on this machine reads them), and
stops everything cleanly on Ctrl-C / SIGTERM (workers first, Redis last). `--local --dry_run`
prints the command lines and starts nothing. Here `--tasks` and `--tokenizer` are files of
this machine (relative paths: to the repository root, where the processes run).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import subprocess
import sys
import tempfile
from typing import Optional, Sequence

from envs import task_environments
from envs.net import is_loopback
from launch import common, fleet_docker, local_fleet
from launch.common import Command, LaunchError
from launch.local_fleet import LocalFleet, run_local

SRC, VENV = "/opt/arbor/src", "/opt/arbor/venv"
SANDBOX_PORT = 8910
CHATS = ("chatml", "qwen2.5", "deepseek_v3", "plain")


# ---------------------------------------------------------------------------------------------
# Validation


def check_redis_url(flag: str, url: str, allow_plaintext: bool) -> str:
  """Checks a redis:// or rediss:// URL without credentials (an error never echoes them).

  Args:
    flag: the flag it came from.
    url: the queue's URL.
    allow_plaintext: let plaintext redis:// go to a non-loopback host (a trusted private
      network); otherwise only rediss:// may.

  Returns:
    `url`.

  Raises:
    LaunchError: a malformed URL, credentials in it, or plaintext to a non-loopback host.
  """
  parts = common.check_url(flag, url, ("redis", "rediss"),
                           "Secret Manager (--redis_password_secret) or a file "
                           "(--redis_password_file)")
  if parts.scheme == "redis" and not is_loopback(parts.hostname) and not allow_plaintext:
    raise LaunchError(f"{flag}={url!r}: a non-loopback Redis must use TLS (rediss://); "
                      "--allow_plaintext_redis overrides this on a trusted private network")
  return url


def check_http_url(flag: str, url: str) -> str:
  """Checks an http(s)://HOST:PORT URL without credentials.

  Args:
    flag: the flag it came from.
    url: the URL.

  Returns:
    The URL without trailing slashes.

  Raises:
    LaunchError: a malformed URL, another scheme, or credentials in it.
  """
  common.check_url(flag, url, ("http", "https"), "the token flags")
  return url.rstrip("/")


# ---------------------------------------------------------------------------------------------
# Cloud fleet


@dataclasses.dataclass(frozen=True)
class Fleet:
  """A cloud fleet: its group of VMs and what each VM's worker and sandbox server run."""

  name: str  # managed instance group; the template is NAME-tpl
  project: str
  zone: str
  workers: int
  machine_type: str
  redis: str
  policy_url: str
  staging: str  # gs://...: the code tarball (and nothing secret)
  tasks: str  # gs:// URL or a path inside the repository
  tokenizer: str  # gs:// URL or a path inside the repository
  redis_password_secret: str
  policy_token_secret: str
  sandbox_token_secret: str = ""
  redis_ca_secret: str = ""
  network: str = "default"
  subnet: str = ""
  service_account: str = ""
  spot: bool = False
  image_family: str = "debian-12"
  image_project: str = "debian-cloud"
  boot_disk_gb: int = 50
  chat: str = "chatml"
  group_size: int = 8
  concurrency: int = 16
  max_sandboxes: int = 32
  warm: int = 4
  queue_prefix: str = "arbor"
  grace: float = 60.0
  sandbox_backend: str = "bwrap"  # bwrap | docker (launch.fleet_docker)
  images: tuple[fleet_docker.FleetImage, ...] = ()  # docker: the servers' allow-list
  env_from: str = "none"  # the workers' --env_from (SWE rows without an environment)
  default_environment: str = ""  # the workers' --default_environment (other tasks)

  @property
  def template(self) -> str:
    """The instance template's name."""
    return f"{self.name[:59]}-tpl"

  @property
  def region(self) -> str:
    """The zone's region."""
    return self.zone.rsplit("-", 1)[0]

  @property
  def code_url(self) -> str:
    """Where the source tarball is shipped."""
    return f"{self.staging}/code/arbor-src.tar.gz"


def _data_path(value: str, dest: str, lines: list[str]) -> str:
  """Where a --tasks/--tokenizer value lives on the VM (gs:// is copied there at boot)."""
  if value.startswith("gs://"):
    lines.append(f"gcloud storage cp {shlex.quote(value)} {shlex.quote(dest)}")
    return dest
  return f"{SRC}/{value}"


def worker_argv(f: Fleet, tasks: str, tokenizer: str) -> list[str]:
  """The rollout worker's command line on a VM; %d is systemd's credentials directory.

  Args:
    f: the fleet.
    tasks: the task file's path on the VM.
    tokenizer: the tokenizer file's path on the VM.

  Returns:
    The argv (secrets as credential files, never values).
  """
  argv = [f"{VENV}/bin/python", "-m", "envs.rollout_worker", f"--policy_url={f.policy_url}",
          "--policy_token_file=%d/policy.token", f"--queue={f.redis}",
          "--queue_password_file=%d/redis.password", f"--queue_prefix={f.queue_prefix}",
          f"--tasks={tasks}", f"--tokenizer={tokenizer}", f"--chat={f.chat}",
          f"--group_size={f.group_size}", f"--concurrency={f.concurrency}",
          "--sandbox=remote", f"--sandbox_url=http://127.0.0.1:{SANDBOX_PORT}",
          "--token_file=%d/sandbox.token", f"--grace={f.grace}", "--worker_id=%H"]
  if f.redis_ca_secret:
    argv.append("--queue_ca_file=%d/redis-ca.pem")
  if f.env_from != "none":  # tasks' environments: their images on a docker fleet's servers
    argv.append(f"--env_from={f.env_from}")
  if f.default_environment:
    argv.append(f"--default_environment={f.default_environment}")
  return argv


def sandbox_argv(f: Fleet) -> list[str]:
  """The sandbox server's command line on a VM: loopback only, token required."""
  backend = (fleet_docker.server_flags(f.images) if f.sandbox_backend == "docker"
             else ["--backend=bwrap"])
  return [f"{VENV}/bin/python", "-m", "envs.sandbox_server", "--host=127.0.0.1",
          f"--port={SANDBOX_PORT}", *backend, f"--max_sandboxes={f.max_sandboxes}",
          f"--warm={f.warm}", "--token-file=/run/arbor/secrets/sandbox.token"]


def boot_script(f: Fleet) -> str:
  """The startup-script metadata of every fleet VM: code, install, secrets, two units.

  It names Secret Manager secrets and never holds a value.

  Args:
    f: the fleet.

  Returns:
    The bash script.
  """
  sec = common.SECRETS_DIR
  data: list[str] = []
  tasks = _data_path(f.tasks, "/opt/arbor/data/tasks.jsonl", data)
  tokenizer = _data_path(f.tokenizer, "/opt/arbor/data/" + os.path.basename(f.tokenizer), data)
  fetch = {"policy.token": f.policy_token_secret, "redis.password": f.redis_password_secret}
  if f.sandbox_token_secret:
    fetch["sandbox.token"] = f.sandbox_token_secret
  if f.redis_ca_secret:
    fetch["redis-ca.pem"] = f.redis_ca_secret
  creds = [f"LoadCredential={n}:{sec}/{n}" for n in sorted(set(fetch) | {"sandbox.token"})]
  worker_unit = "\n".join([
      "[Unit]", "Description=Arbor rollout worker", "Wants=network-online.target",
      "After=network-online.target arbor-sandbox.service", "[Service]", "User=arbor",
      *creds, f"WorkingDirectory={SRC}",
      "ExecStart=" + shlex.join(worker_argv(f, tasks, tokenizer)),
      "KillMode=mixed", "KillSignal=SIGTERM", f"TimeoutStopSec={int(f.grace) + 30}",
      "Restart=always", "RestartSec=5", "NoNewPrivileges=yes", "PrivateTmp=yes",
      "[Install]", "WantedBy=multi-user.target"])
  engine = ([f"Requires={fleet_docker.UNIT}", f"After={fleet_docker.UNIT}"]
            if f.sandbox_backend == "docker" else [])
  sandbox_unit = "\n".join([
      "[Unit]", "Description=Arbor sandbox server (loopback only)", *engine, "[Service]",
      f"WorkingDirectory={SRC}", "ExecStart=" + shlex.join(sandbox_argv(f)),
      "KillMode=mixed", "KillSignal=SIGTERM", "TimeoutStopSec=60", "Restart=always",
      # the server makes its sandboxes' cgroups under its own: the unit's limits bound them all
      "Delegate=yes",
      "RestartSec=5", "[Install]", "WantedBy=multi-user.target"])
  lines = [
      "#!/bin/bash",
      f"# Arbor launch.fleet boot script ({f.name}): sandbox server + rollout worker.",
      "# Runs at every boot; it names Secret Manager secrets and never holds a value.",
      "set -euo pipefail",
      "exec 9>/var/lock/arbor-fleet.lock",
      "flock 9",
      "export DEBIAN_FRONTEND=noninteractive",
      "apt-get -qq update",
      "apt-get -qq install -y bubblewrap python3-venv python3-pytest ca-certificates curl",
      "id arbor >/dev/null 2>&1 || useradd --system --create-home --home-dir /var/lib/arbor "
      "--shell /usr/sbin/nologin arbor",
      "mkdir -p /opt/arbor/data",
      "# 1. code and data",
      f"rm -rf {SRC} && mkdir -p {SRC}",
      f"gcloud storage cp {shlex.quote(f.code_url)} /opt/arbor/src.tar.gz",
      f"tar -xzf /opt/arbor/src.tar.gz -C {SRC}",
      *data,
      "# 2. install",
      *common.install_lines(SRC, VENV, ""),
      "# 3. secrets: root-only files on tmpfs",
      *common.secret_fetch_lines(fetch, f.project),
  ]
  if not f.sandbox_token_secret:
    lines += [f"# the sandbox token never leaves this VM (loopback only): generate it",
              f"install -d -m 0700 {sec}",
              f"[ -s {sec}/sandbox.token ] || ( umask 077; python3 -c "
              f"'import secrets; print(secrets.token_hex(32))' > {sec}/sandbox.token )"]
  if f.sandbox_backend == "docker":
    lines += ["# 3b. the Docker engine and the sandboxes' images (launch.fleet_docker)",
              *fleet_docker.boot_lines(f.images)]
  lines += [
      "# 4. services",
      "cat > /etc/systemd/system/arbor-sandbox.service <<'ARBOR_EOF'", sandbox_unit, "ARBOR_EOF",
      "cat > /etc/systemd/system/arbor-worker.service <<'ARBOR_EOF'", worker_unit, "ARBOR_EOF",
      "systemctl daemon-reload",
      "systemctl enable --now arbor-sandbox.service",
      "systemctl restart arbor-worker.service",
      "systemctl enable arbor-worker.service",
  ]
  return "\n".join(lines) + "\n"


def _proj(f: Fleet) -> str:
  return f"--project={f.project}"


def upload_command(f: Fleet, tarball: str) -> Command:
  """Copies the source tarball to `f.code_url`.

  Args:
    f: the fleet.
    tarball: the local source tarball.

  Returns:
    The gcloud storage cp command.
  """
  return Command(("gcloud", "storage", "cp", tarball, f.code_url), "ship the working tree")


def template_command(f: Fleet, script_path: str) -> Command:
  """Creates the instance template: private VMs that boot with the script at `script_path`.

  Args:
    f: the fleet (machine type, image, network, service account, spot).
    script_path: the local boot script file (`boot_script`).

  Returns:
    The gcloud command.
  """
  argv = ["gcloud", "compute", "instance-templates", "create", f.template, _proj(f),
          f"--machine-type={f.machine_type}", f"--image-family={f.image_family}",
          f"--image-project={f.image_project}", f"--boot-disk-size={f.boot_disk_gb}GB",
          f"--network={f.network}", "--no-address",
          "--scopes=https://www.googleapis.com/auth/cloud-platform",
          f"--metadata-from-file=startup-script={script_path}",
          "--metadata=enable-oslogin=TRUE", "--tags=arbor-fleet", "--labels=arbor=fleet",
          "--shielded-secure-boot"]
  if f.subnet:
    argv += [f"--subnet={f.subnet}", f"--region={f.region}"]
  if f.service_account:
    argv.append(f"--service-account={f.service_account}")
  if f.spot:
    argv += ["--provisioning-model=SPOT", "--instance-termination-action=STOP"]
  return Command(tuple(argv), "instance template: private VMs (no external IP), boot script")


def group_command(f: Fleet) -> Command:
  """Creates the managed instance group of `f.workers` VMs from the template."""
  return Command(("gcloud", "compute", "instance-groups", "managed", "create", f.name, _proj(f),
                  f"--zone={f.zone}", f"--template={f.template}", f"--size={f.workers}",
                  f"--base-instance-name={f.name[:54]}"),
                 f"managed instance group of {f.workers} VMs")


def launch_commands(f: Fleet, script_path: str, tarball: str) -> list[Command]:
  """The commands of one launch, in order: upload, template, group.

  Args:
    f: the fleet.
    script_path: the local boot script file.
    tarball: the local source tarball.

  Returns:
    The three commands.
  """
  return [upload_command(f, tarball), template_command(f, script_path), group_command(f)]


def teardown_commands(name: str, project: str, zone: str) -> list[Command]:
  """Deletes the group NAME (its VMs get SIGTERM) and then its template.

  Args:
    name: the group's name.
    project: its project.
    zone: its zone.

  Returns:
    The two commands, in order.
  """
  template = f"{name[:59]}-tpl"
  return [Command(("gcloud", "compute", "instance-groups", "managed", "delete", name,
                   f"--project={project}", f"--zone={zone}", "--quiet"),
                  "delete the group (its VMs get SIGTERM: workers deliver and exit)"),
          Command(("gcloud", "compute", "instance-templates", "delete", template,
                   f"--project={project}", "--quiet"), "delete the template")]


# ---------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
  """The command-line flags, cloud and `--local`."""
  p = argparse.ArgumentParser(prog="python -m launch.fleet", description=__doc__,
                              allow_abbrev=False,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  a = p.add_argument
  common.add_cloud_flags(p, {
      "name": "managed instance group name",
      "project": "Google Cloud project",
      "zone": "zone of the group",
      "network": "VPC network",
      "service_account": "VM service account (GCS read, secret access)",
      "spot": "spot VMs (the group recreates preempted ones)",
      "teardown": "delete the group and its template",
      "dry_run": "print the gcloud commands and the boot script (--local: the processes' "
                 "command lines); start nothing",
  }, defaults={"name": "arbor-fleet", "network": "default"})
  a("--subnet", default="", help="subnetwork (in the zone's region)")
  a("--workers", type=int, default=1, help="VMs (cloud) / rollout worker processes (local)")
  a("--machine_type", default="e2-standard-8", help="VM machine type")
  a("--redis", default="", help="rediss://HOST:PORT of the rollout queue (no password in it)")
  a("--policy_url", default="", help="the trainer's policy server, http(s)://HOST:PORT")
  a("--staging", default="", help="gs://BUCKET/PATH for the code tarball")
  a("--tasks", default="envs/data/swe/tasks.jsonl",
    help="task JSONL: gs:// or a repository path (--local: a file here)")
  a("--tokenizer", default="",
    help="tokenizer file: gs:// or a repository path (--local: a file or directory here)")
  a("--chat", default="chatml", choices=CHATS, help="chat format of the policy")
  a("--group_size", type=int, default=8, help="episodes per task draw")
  a("--concurrency", type=int, default=16, help="episodes in flight per worker")
  a("--max_sandboxes", type=int, default=32, help="sandboxes per sandbox server")
  a("--warm", type=int, default=4, help="warm sandboxes per server (cloud)")
  a("--queue_prefix", default="arbor", help="key prefix of the run's queue")
  a("--grace", type=float, default=60.0, help="seconds a worker may finish groups on SIGTERM")
  a("--env_from", default="none", choices=task_environments.ENV_FROM,
    help="workers: where SWE rows without an `environment` get one (docker fleets: the "
    "environments' images must be in --image)")
  a("--default_environment", default="",
    help="workers: the environment of every other task (a preset such as bookworm-pytest)")
  a("--redis_password_secret", default="", help="Secret Manager id of the Redis password")
  a("--redis_ca_secret", default="", help="Secret Manager id of the Redis server CA (rediss)")
  a("--policy_token_secret", default="", help="Secret Manager id of the policy server token")
  a("--sandbox_token_secret", default="",
    help="Secret Manager id of the sandbox token (default: generated on each VM)")
  a("--allow_plaintext_redis", action="store_true", help="permit redis:// to a non-loopback host")
  # local mode
  a("--local", action="store_true", help="run the fleet's processes on this machine")
  a("--sandbox_servers", type=int, default=-1, help="--local: sandbox servers (default --workers)")
  a("--sandbox_backend", default="bwrap", choices=("bwrap", "docker", "local"),
    help="sandbox backend: bwrap or docker (cloud); bwrap or local (--local; local = no "
    "isolation, for trusted tests only)")
  a("--image", action="append", default=[], metavar="REF[=gs://B/P.tar.gz]",
    help="--sandbox_backend docker: an image of the sandbox servers' allow-list (the first "
    "the default): a `docker save | gzip` tarball loaded at boot, or REF pulled from its "
    "registry (repeatable; see launch/fleet_docker.py)")
  a("--redis_password_file", default="", help="--local with --redis: file with its password")
  a("--policy_token_file", default="", help="--local: file with the policy server's token")
  a("--ready_file", default="", help="--local: write the fleet info JSON here once up")
  a("--keep_dir", action="store_true", help="--local: keep logs and secret files on exit")
  return p


def _default_environment(value: str) -> str:
  """--default_environment: "", a preset, or a spec file inside the repository (it ships)."""
  if value and value not in task_environments.PRESETS:
    common.check_shipped("--default_environment", value, file_only=True)
  return value


def _repo_or_gcs(flag: str, value: str) -> str:
  """A gs:// URL, or a file inside the repository (relative to its root: it ships there)."""
  if common.is_gcs(value):
    return common.check_gcs(flag, value)
  return common.check_shipped(flag, value, file_only=True)


def _local_file(flag: str, value: str) -> str:
  """A file (or directory) of this machine; relative to the repository root, where it is read."""
  common.check_not_placeholder(flag, value)
  if not os.path.exists(os.path.join(common.REPO_ROOT, value)):
    raise LaunchError(f"{flag}={value!r}: no such file or directory (relative paths are read "
                      f"from the repository root, {common.REPO_ROOT})")
  return value


def parse_cloud(args: argparse.Namespace) -> Fleet:
  """Checks the flags of a cloud fleet.

  Args:
    args: the parsed flags.

  Returns:
    The fleet.

  Raises:
    LaunchError: a missing or bad flag; the message names it.
  """
  for flag in ("project", "zone", "redis", "policy_url", "staging", "tokenizer",
               "redis_password_secret", "policy_token_secret"):
    if not getattr(args, flag):
      raise LaunchError(f"--{flag} is required for a cloud fleet (or use --local)")
  if args.workers < 1:
    raise LaunchError(f"--workers={args.workers}: must be >= 1")
  for flag in ("concurrency", "group_size", "max_sandboxes"):
    if getattr(args, flag) < 1:
      raise LaunchError(f"--{flag}={getattr(args, flag)}: must be >= 1")
  for flag in ("redis_password_secret", "policy_token_secret", "sandbox_token_secret",
               "redis_ca_secret"):
    value = getattr(args, flag)
    if value:
      common.parse_secrets(f"--{flag}", [f"x={value}"])
  if args.sandbox_backend not in ("bwrap", "docker"):
    raise LaunchError(f"--sandbox_backend={args.sandbox_backend}: a cloud fleet runs bwrap or "
                      "docker")
  images = tuple(fleet_docker.parse_image("--image", v) for v in args.image)
  if args.sandbox_backend == "docker" and not images:
    raise LaunchError("--sandbox_backend docker needs --image (REF=gs://B/P.tar.gz or REF)")
  if images and args.sandbox_backend != "docker":
    raise LaunchError("--image: only --sandbox_backend docker starts from images")
  if (args.env_from != "none" or args.default_environment) and args.sandbox_backend != "docker":
    raise LaunchError("--env_from / --default_environment: tasks' environments reach the "
                      "sandbox servers as images: use --sandbox_backend docker")
  redis = check_redis_url("--redis", args.redis, args.allow_plaintext_redis)
  if args.redis_ca_secret and not redis.startswith("rediss://"):
    raise LaunchError("--redis_ca_secret needs a rediss:// --redis")
  return Fleet(
      name=common.check_name("--name", args.name),
      project=common.check_project("--project", args.project),
      zone=common.check_zone("--zone", args.zone),
      workers=args.workers, machine_type=args.machine_type, redis=redis,
      policy_url=check_http_url("--policy_url", args.policy_url),
      staging=common.check_gcs("--staging", args.staging),
      tasks=_repo_or_gcs("--tasks", args.tasks),
      tokenizer=_repo_or_gcs("--tokenizer", args.tokenizer),
      redis_password_secret=args.redis_password_secret,
      policy_token_secret=args.policy_token_secret,
      sandbox_token_secret=args.sandbox_token_secret, redis_ca_secret=args.redis_ca_secret,
      network=args.network, subnet=args.subnet, service_account=args.service_account,
      spot=args.spot, chat=args.chat, group_size=args.group_size,
      concurrency=args.concurrency, max_sandboxes=args.max_sandboxes, warm=args.warm,
      queue_prefix=args.queue_prefix, grace=args.grace, sandbox_backend=args.sandbox_backend,
      images=images, env_from=args.env_from,
      default_environment=_default_environment(args.default_environment))


def parse_local(args: argparse.Namespace) -> LocalFleet:
  """Checks the flags of a `--local` fleet.

  Args:
    args: the parsed flags.

  Returns:
    The local fleet, not started.

  Raises:
    LaunchError: a missing or bad flag; the message names it.
  """
  if args.workers < 0:
    raise LaunchError(f"--workers={args.workers}: must be >= 0")
  if args.sandbox_backend == "docker" or args.image:
    raise LaunchError("--local runs bwrap or local sandbox servers; --sandbox_backend docker "
                      "and --image are for a cloud fleet")
  if args.env_from != "none" or args.default_environment:
    raise LaunchError("--env_from / --default_environment: tasks' environments reach sandbox "
                      "servers as images, on a cloud fleet with --sandbox_backend docker")
  servers = args.workers if args.sandbox_servers < 0 else args.sandbox_servers
  if args.workers and servers < 1:
    raise LaunchError(f"--sandbox_servers={servers}: workers need at least one")
  if args.redis:
    url = check_redis_url("--redis", args.redis, args.allow_plaintext_redis)
    if not args.redis_password_file:
      raise LaunchError("--local --redis needs --redis_password_file")
  else:
    url = ""
  if args.workers:
    for flag in ("policy_url", "tokenizer"):
      if not getattr(args, flag):
        raise LaunchError(f"--local with --workers={args.workers} needs --{flag}")
    check_http_url("--policy_url", args.policy_url)
    for flag in ("tasks", "tokenizer"):
      _local_file(f"--{flag}", getattr(args, flag))
  for flag in ("policy_token_file", "redis_password_file"):
    path = getattr(args, flag)
    if path and not os.path.isfile(path):
      raise LaunchError(f"--{flag}={path!r}: no such file")
  return LocalFleet(workers=args.workers, sandbox_servers=servers, policy_url=args.policy_url,
                    policy_token_file=args.policy_token_file, redis=url,
                    redis_password_file=args.redis_password_file, tasks=args.tasks,
                    tokenizer=args.tokenizer, chat=args.chat, group_size=args.group_size,
                    concurrency=args.concurrency, sandbox_backend=args.sandbox_backend,
                    max_sandboxes=args.max_sandboxes, queue_prefix=args.queue_prefix,
                    grace=args.grace)


def main(argv: Optional[Sequence[str]] = None) -> int:
  """The command line: a cloud fleet (or `--dry_run`), `--teardown`, or `--local`.

  Args:
    argv: the arguments, without the program name (default: sys.argv[1:]).

  Returns:
    The exit status: 0 done (or stopped by a signal, `--local`), 1 a command or a local
    process failed, 2 bad flags.
  """
  argv = sys.argv[1:] if argv is None else argv
  args = build_parser().parse_args(list(argv))
  try:
    if args.local:
      fleet = parse_local(args)
    elif args.teardown:
      for flag in ("project", "zone"):
        if not getattr(args, flag):
          raise LaunchError(f"--teardown needs --{flag}")
      common.run(teardown_commands(common.check_name("--name", args.name),
                                   common.check_project("--project", args.project),
                                   common.check_zone("--zone", args.zone)), args.dry_run)
      return 0
    else:
      cloud = parse_cloud(args)
  except LaunchError as e:
    print(f"launch.fleet: error: {e}", file=sys.stderr)
    return 2
  if args.local and args.dry_run:
    print(f"# launch.fleet --local dry run: nothing is started. {local_fleet.PLAN_DIR} stands "
          f"for the fresh 0700 directory of the logs and the generated secrets, "
          f"{local_fleet.PLAN_REDIS_PORT} and {local_fleet.PLAN_SANDBOX_PORT.format('i')} for "
          "the free ports picked at start")
    common.print_commands(fleet.plan())
    return 0
  if args.local:
    return run_local(fleet, args.ready_file, args.keep_dir)
  if args.dry_run:
    tmp = os.path.join(tempfile.gettempdir(), f"arbor-fleet-{cloud.name}")
    script = os.path.join(tmp, "startup.sh")
    print(f"# launch.fleet dry run: {cloud.workers} x {cloud.machine_type} in {cloud.zone}")
    common.print_script("boot script = startup-script metadata", script, boot_script(cloud))
    common.run(launch_commands(cloud, script, os.path.join(tmp, "arbor-src.tar.gz")), True)
    print(f"# teardown: python -m launch.fleet --name={cloud.name} --project={cloud.project} "
          f"--zone={cloud.zone} --teardown")
    return 0
  tmp = tempfile.mkdtemp(prefix="arbor-fleet-")
  script = common.write_script(tmp, "startup.sh", boot_script(cloud))
  tarball = common.make_tarball(os.path.join(tmp, "arbor-src.tar.gz"))
  try:
    common.run(launch_commands(cloud, script, tarball), dry_run=False)
  except subprocess.CalledProcessError as e:
    print(f"launch.fleet: error: {shlex.join(e.cmd)} exited with {e.returncode}",
          file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
