"""The sandbox fleet: CPU VMs running `envs.sandbox_server` + `envs.rollout_worker`.

    python -m launch.fleet --workers 64 --machine_type e2-standard-8 --project P --zone Z \\
        --redis rediss://10.0.0.5:6378 --redis_password_secret arbor-redis \\
        --redis_ca_secret arbor-redis-ca --policy_url http://10.0.0.2:8000 \\
        --policy_token_secret arbor-policy --staging gs://B/fleet \\
        --tasks envs/data/swe/tasks.jsonl --tokenizer gs://B/tok/tokenizer.json [--dry_run]
    python -m launch.fleet --name arbor-fleet --project P --zone Z --teardown
    python -m launch.fleet --local --workers 2 --policy_url http://127.0.0.1:8000 \\
        --tokenizer tok.json [--policy_token_file F]          # same processes on this machine

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
SIGTERM (a VM stop or a group resize) stops the worker first: it delivers what it has
(envs/rollout_worker.py) and its leased draws go back to the queue.

Local (`--local`): redis-server (unless `--redis` is given), `--sandbox_servers` sandbox servers
(default: one per worker) and `--workers` rollout workers as subprocesses, every one bound to
127.0.0.1, with generated password and tokens in 0600 files of a 0700 directory. It prints the
Redis URL and the *files* that hold the secrets (a trainer on this machine reads them), and
stops everything cleanly on Ctrl-C / SIGTERM (workers first, Redis last).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os
import secrets as pysecrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from typing import Optional, Sequence

from launch import common
from launch.common import Command, LaunchError

SRC, VENV = "/opt/arbor/src", "/opt/arbor/venv"
SANDBOX_PORT = 8910
CHATS = ("chatml", "qwen2.5", "deepseek_v3", "plain")


# ---------------------------------------------------------------------------------------------
# Validation


def _is_loopback(host: str) -> bool:
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def check_redis_url(flag: str, url: str, allow_plaintext: bool) -> str:
  """redis:// or rediss://, no password in it (never echoed), TLS unless loopback or allowed."""
  try:
    parts = urllib.parse.urlsplit(url or "")
    parts.port  # raises ValueError on a malformed port
  except ValueError:
    raise LaunchError(f"{flag}: not a URL (expected redis://HOST:PORT or rediss://HOST:PORT)"
                      ) from None
  if parts.password is not None or parts.username:
    raise LaunchError(f"{flag}: the URL carries credentials; put the password in Secret "
                      "Manager (--redis_password_secret) or a file (--redis_password_file), "
                      "never in a URL (it would show in process lists and metadata)")
  if parts.scheme not in ("redis", "rediss") or not parts.hostname:
    raise LaunchError(f"{flag}={url!r}: expected redis://HOST:PORT or rediss://HOST:PORT")
  if parts.scheme == "redis" and not _is_loopback(parts.hostname) and not allow_plaintext:
    raise LaunchError(f"{flag}={url!r}: a non-loopback Redis must use TLS (rediss://); "
                      "--allow_plaintext_redis overrides this on a trusted private network")
  return url


def check_http_url(flag: str, url: str) -> str:
  parts = urllib.parse.urlsplit(url or "")
  if parts.scheme not in ("http", "https") or not parts.hostname:
    raise LaunchError(f"{flag}={url!r}: expected http(s)://HOST:PORT")
  if parts.password is not None or parts.username:
    raise LaunchError(f"{flag}: the URL carries credentials; use the token flags instead")
  return url.rstrip("/")


# ---------------------------------------------------------------------------------------------
# Cloud fleet


@dataclasses.dataclass(frozen=True)
class Fleet:
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

  @property
  def template(self) -> str:
    return f"{self.name[:59]}-tpl"

  @property
  def region(self) -> str:
    return self.zone.rsplit("-", 1)[0]

  @property
  def code_url(self) -> str:
    return f"{self.staging}/code/arbor-src.tar.gz"


def _data_path(value: str, dest: str, lines: list[str]) -> str:
  """Where a --tasks/--tokenizer value lives on the VM (gs:// is copied there at boot)."""
  if value.startswith("gs://"):
    lines.append(f"gcloud storage cp {shlex.quote(value)} {shlex.quote(dest)}")
    return dest
  return f"{SRC}/{value}"


def worker_argv(f: Fleet, tasks: str, tokenizer: str) -> list[str]:
  """The rollout worker's command line on a VM; %d is systemd's credentials directory."""
  argv = [f"{VENV}/bin/python", "-m", "envs.rollout_worker", f"--policy_url={f.policy_url}",
          "--policy_token_file=%d/policy.token", f"--queue={f.redis}",
          "--queue_password_file=%d/redis.password", f"--queue_prefix={f.queue_prefix}",
          f"--tasks={tasks}", f"--tokenizer={tokenizer}", f"--chat={f.chat}",
          f"--group_size={f.group_size}", f"--concurrency={f.concurrency}",
          "--sandbox=remote", f"--sandbox_url=http://127.0.0.1:{SANDBOX_PORT}",
          "--token_file=%d/sandbox.token", f"--grace={f.grace}", "--worker_id=%H"]
  if f.redis_ca_secret:
    argv.append("--queue_ca_file=%d/redis-ca.pem")
  return argv


def sandbox_argv(f: Fleet) -> list[str]:
  return [f"{VENV}/bin/python", "-m", "envs.sandbox_server", "--host=127.0.0.1",
          f"--port={SANDBOX_PORT}", "--backend=bwrap", f"--max_sandboxes={f.max_sandboxes}",
          f"--warm={f.warm}", "--token-file=/run/arbor/secrets/sandbox.token"]


def boot_script(f: Fleet) -> str:
  """startup-script metadata of every fleet VM. Names secrets; never holds one."""
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
      *creds, f"WorkingDirectory={SRC}", "ExecStart=" + shlex.join(worker_argv(f, tasks, tokenizer)),
      "KillMode=mixed", "KillSignal=SIGTERM", f"TimeoutStopSec={int(f.grace) + 30}",
      "Restart=always", "RestartSec=5", "NoNewPrivileges=yes", "PrivateTmp=yes",
      "[Install]", "WantedBy=multi-user.target"])
  sandbox_unit = "\n".join([
      "[Unit]", "Description=Arbor sandbox server (loopback only)", "[Service]",
      f"WorkingDirectory={SRC}", "ExecStart=" + shlex.join(sandbox_argv(f)),
      "KillMode=mixed", "KillSignal=SIGTERM", "TimeoutStopSec=60", "Restart=always",
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
  return Command(("gcloud", "storage", "cp", tarball, f.code_url), "ship the working tree")


def template_command(f: Fleet, script_path: str) -> Command:
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
  return Command(("gcloud", "compute", "instance-groups", "managed", "create", f.name, _proj(f),
                  f"--zone={f.zone}", f"--template={f.template}", f"--size={f.workers}",
                  f"--base-instance-name={f.name[:54]}"),
                 f"managed instance group of {f.workers} VMs")


def launch_commands(f: Fleet, script_path: str, tarball: str) -> list[Command]:
  return [upload_command(f, tarball), template_command(f, script_path), group_command(f)]


def teardown_commands(name: str, project: str, zone: str) -> list[Command]:
  template = f"{name[:59]}-tpl"
  return [Command(("gcloud", "compute", "instance-groups", "managed", "delete", name,
                   f"--project={project}", f"--zone={zone}", "--quiet"),
                  "delete the group (its VMs get SIGTERM: workers deliver and exit)"),
          Command(("gcloud", "compute", "instance-templates", "delete", template,
                   f"--project={project}", "--quiet"), "delete the template")]


# ---------------------------------------------------------------------------------------------
# Local fleet


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def write_secret_file(path: str, value: str) -> str:
  with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as fh:
    fh.write(value)
  return path


def http_health(url: str, token_file: str, timeout: float = 5.0) -> dict:
  """GET URL/health with the bearer token from `token_file`."""
  with open(token_file) as fh:
    token = fh.read().strip()
  req = urllib.request.Request(f"{url}/health", headers={"Authorization": f"Bearer {token}"})
  with urllib.request.urlopen(req, timeout=timeout) as r:
    return json.loads(r.read())


def redis_ping(port: int, password_file: str, timeout: float = 2.0) -> bool:
  """AUTH + PING over a raw socket (RESP), so launch needs no Redis client."""
  with open(password_file) as fh:
    password = fh.read().strip()
  def bulk(*words: str) -> bytes:
    out = f"*{len(words)}\r\n".encode()
    for w in words:
      b = w.encode()
      out += b"$%d\r\n%s\r\n" % (len(b), b)
    return out
  try:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
      s.sendall(bulk("AUTH", password) + bulk("PING"))
      data = b""
      while data.count(b"\r\n") < 2:
        chunk = s.recv(1024)
        if not chunk:
          break
        data += chunk
    return data.startswith(b"+OK\r\n") and b"+PONG" in data
  except OSError:
    return False


@dataclasses.dataclass
class LocalFleet:
  """redis-server + sandbox servers + rollout workers on this machine, loopback only."""

  workers: int
  sandbox_servers: int
  policy_url: str = ""
  policy_token_file: str = ""
  redis: str = ""  # an existing loopback Redis instead of starting one
  redis_password_file: str = ""
  tasks: str = "envs/data/swe/tasks.jsonl"
  tokenizer: str = ""
  chat: str = "chatml"
  group_size: int = 8
  concurrency: int = 4
  sandbox_backend: str = "bwrap"
  max_sandboxes: int = 8
  queue_prefix: str = "arbor"
  grace: float = 10.0
  lease_ttl: float = 120.0  # a killed worker's draws go to another worker after this
  max_backlog: int = 1024  # workers pause while the queue holds this many unacked trajectories
  epochs: int = 0  # passes over the tasks (0: until stopped)
  max_turns: int = 30  # agent turns per episode
  max_new_tokens: int = 2048  # tokens sampled per policy call
  max_context_tokens: int = 32768  # input + output of one call (at most the engine's length)
  python: str = sys.executable

  def __post_init__(self):
    self.dir = tempfile.mkdtemp(prefix="arbor-fleet-")  # mode 0700
    self.procs: list[tuple[str, subprocess.Popen]] = []
    self.redis_url = self.redis
    self.sandbox_urls: list[str] = []

  def _spawn(self, name: str, argv: Sequence[str]) -> subprocess.Popen:
    log = open(os.path.join(self.dir, f"{name}.log"), "wb")
    proc = subprocess.Popen(list(argv), cwd=common.REPO_ROOT, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    self.procs.append((name, proc))
    return proc

  def _wait(self, what: str, proc: subprocess.Popen, ready, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      value = ready()
      if value:
        return value
      if proc.poll() is not None:
        raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready; see "
                           f"{self.dir}")
      time.sleep(0.05)
    raise RuntimeError(f"{what} not ready after {timeout:.0f}s; see {self.dir}")

  def start(self) -> dict:
    """Redis, the sandbox servers, then the rollout workers; `info()`."""
    self.start_services()
    for i in range(self.workers):
      self.start_worker(i)
    return self.info()

  def start_services(self) -> dict:
    """Redis (unless given) and the sandbox servers, each healthy before this returns."""
    d = self.dir
    if self.redis:
      self.password_file = self.redis_password_file
    else:
      if not shutil.which("redis-server"):
        raise LaunchError("--local: redis-server is not installed (apt-get install "
                          "redis-server), or pass --redis and --redis_password_file")
      port = free_port()
      self.password_file = write_secret_file(os.path.join(d, "redis.password"),
                                             pysecrets.token_hex(32))
      conf = os.path.join(d, "redis.conf")
      with open(self.password_file) as fh:  # the password goes in a 0600 file, not argv
        pw = fh.read()
      write_secret_file(conf, "\n".join([
          "bind 127.0.0.1", f"port {port}", "protected-mode yes", f"requirepass {pw}",
          f"dir {d}", "appendonly yes", 'save ""', "daemonize no", ""]))
      proc = self._spawn("redis", ["redis-server", conf])
      self._wait("redis-server", proc, lambda: redis_ping(port, self.password_file))
      self.redis_url = f"redis://127.0.0.1:{port}"
    self.sandbox_token_file = write_secret_file(os.path.join(d, "sandbox.token"),
                                                pysecrets.token_hex(32))
    for i in range(self.sandbox_servers):
      port_file = os.path.join(d, f"sandbox-{i}.port")
      argv = [self.python, "-m", "envs.sandbox_server", "--host", "127.0.0.1", "--port", "0",
              "--port_file", port_file, "--token-file", self.sandbox_token_file,
              "--backend", self.sandbox_backend, "--max_sandboxes", str(self.max_sandboxes),
              "--uid_base", str(2_000_000_000 + 4096 * i), "--uid_count", "256"]
      if self.sandbox_backend == "local":
        argv.append("--allow_unsafe_local")
      proc = self._spawn(f"sandbox-{i}", argv)

      def port_ready(port_file=port_file):
        try:
          with open(port_file) as fh:
            return int(fh.read().strip() or 0)
        except (OSError, ValueError):
          return 0
      port = self._wait(f"sandbox server {i}", proc, port_ready)
      url = f"http://127.0.0.1:{port}"
      self._wait(f"sandbox server {i} health", proc,
                 lambda url=url: self._healthy(url))
      self.sandbox_urls.append(url)
    return self.info()

  def start_worker(self, i: int) -> subprocess.Popen:
    """Rollout worker `local-<i>` on sandbox server i mod n (its log: <dir>/worker-<i>.log)."""
    argv = [self.python, "-m", "envs.rollout_worker", "--policy_url", self.policy_url,
            "--queue", self.redis_url, "--queue_password_file", self.password_file,
            "--queue_prefix", self.queue_prefix, "--tasks", self.tasks,
            "--tokenizer", self.tokenizer, "--chat", self.chat,
            "--group_size", str(self.group_size), "--concurrency", str(self.concurrency),
            "--sandbox", "remote", "--sandbox_url",
            self.sandbox_urls[i % len(self.sandbox_urls)],
            "--token_file", self.sandbox_token_file, "--grace", str(self.grace),
            "--lease_ttl", str(self.lease_ttl), "--max_backlog", str(self.max_backlog),
            "--epochs", str(self.epochs), "--max_turns", str(self.max_turns),
            "--max_new_tokens", str(self.max_new_tokens),
            "--max_context_tokens", str(self.max_context_tokens), "--worker_id", f"local-{i}"]
    if self.policy_token_file:
      argv += ["--policy_token_file", self.policy_token_file]
    return self._spawn(f"worker-{i}", argv)

  def _healthy(self, url: str) -> bool:
    try:
      return bool(http_health(url, self.sandbox_token_file, timeout=1.0).get("ok"))
    except OSError:
      return False

  def info(self) -> dict:
    """What a trainer on this machine needs: URLs and the files holding secrets (no values)."""
    return {"dir": self.dir, "redis": self.redis_url, "redis_password_file": self.password_file,
            "sandbox_urls": self.sandbox_urls, "sandbox_token_file": self.sandbox_token_file,
            "queue_prefix": self.queue_prefix,
            "pids": {name: p.pid for name, p in self.procs}}

  def check(self) -> Optional[str]:
    """The first process that exited on its own, if any."""
    for name, p in self.procs:
      if p.poll() is not None:
        return f"{name} exited with {p.returncode} (log: {self.dir}/{name}.log)"
    return None

  def stop(self, keep_dir: bool = False) -> None:
    """SIGTERM in reverse start order (workers, sandbox servers, Redis), then wait; SIGKILL
    whatever outlives its grace."""
    for name, p in reversed(self.procs):
      if p.poll() is None:
        p.send_signal(signal.SIGTERM)
      grace = self.grace + 10 if name.startswith("worker") else 15
      try:
        p.wait(grace)
      except subprocess.TimeoutExpired:
        print(f"launch.fleet: {name} ignored SIGTERM for {grace:.0f}s; killing", file=sys.stderr)
        p.kill()
        p.wait()
    if not keep_dir:
      shutil.rmtree(self.dir, ignore_errors=True)


def run_local(fleet: LocalFleet, ready_file: str = "", keep_dir: bool = False) -> int:
  stop = {"signal": None}

  def on_signal(signum, _frame):
    stop["signal"] = signum
  signal.signal(signal.SIGTERM, on_signal)
  signal.signal(signal.SIGINT, on_signal)
  try:
    info = fleet.start()
  except BaseException:
    fleet.stop(keep_dir=True)
    raise
  text = json.dumps(info, indent=1)
  print(f"launch.fleet: local fleet up (secrets are in the files named here):\n{text}",
        flush=True)
  if ready_file:
    tmp = ready_file + ".tmp"
    with open(tmp, "w") as fh:
      fh.write(text)
    os.replace(tmp, ready_file)
  failure = None
  while stop["signal"] is None and failure is None:
    failure = fleet.check()
    time.sleep(0.2)
  if failure:
    print(f"launch.fleet: {failure}; stopping the rest", file=sys.stderr)
  else:
    print(f"launch.fleet: signal {stop['signal']}: stopping workers, sandbox servers, Redis",
          flush=True)
  fleet.stop(keep_dir=keep_dir or failure is not None)
  print("launch.fleet: stopped", flush=True)
  return 1 if failure else 0


# ---------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m launch.fleet", description=__doc__,
                              allow_abbrev=False,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  a = p.add_argument
  a("--workers", type=int, default=1, help="VMs (cloud) / rollout worker processes (local)")
  a("--machine_type", default="e2-standard-8", help="VM machine type")
  a("--redis", default="", help="rediss://HOST:PORT of the rollout queue (no password in it)")
  a("--policy_url", default="", help="the trainer's policy server, http(s)://HOST:PORT")
  a("--name", default="arbor-fleet", help="managed instance group name")
  a("--project", default="", help="Google Cloud project")
  a("--zone", default="", help="zone of the group")
  a("--network", default="default", help="VPC network")
  a("--subnet", default="", help="subnetwork (in the zone's region)")
  a("--service_account", default="", help="VM service account (GCS read, secret access)")
  a("--spot", action="store_true", help="spot VMs (the group recreates preempted ones)")
  a("--staging", default="", help="gs://BUCKET/PATH for the code tarball")
  a("--tasks", default="envs/data/swe/tasks.jsonl", help="task JSONL: gs:// or repo path")
  a("--tokenizer", default="", help="tokenizer file: gs:// or repo path")
  a("--chat", default="chatml", choices=CHATS, help="chat format of the policy")
  a("--group_size", type=int, default=8, help="episodes per task draw")
  a("--concurrency", type=int, default=16, help="episodes in flight per worker")
  a("--max_sandboxes", type=int, default=32, help="sandboxes per sandbox server")
  a("--warm", type=int, default=4, help="warm sandboxes per server (cloud)")
  a("--queue_prefix", default="arbor", help="key prefix of the run's queue")
  a("--grace", type=float, default=60.0, help="seconds a worker may finish groups on SIGTERM")
  a("--redis_password_secret", default="", help="Secret Manager id of the Redis password")
  a("--redis_ca_secret", default="", help="Secret Manager id of the Redis server CA (rediss)")
  a("--policy_token_secret", default="", help="Secret Manager id of the policy server token")
  a("--sandbox_token_secret", default="",
    help="Secret Manager id of the sandbox token (default: generated on each VM)")
  a("--allow_plaintext_redis", action="store_true", help="permit redis:// to a non-loopback host")
  a("--teardown", action="store_true", help="delete the group and its template")
  a("--dry_run", action="store_true", help="print the gcloud commands and the boot script")
  # local mode
  a("--local", action="store_true", help="run the fleet's processes on this machine")
  a("--sandbox_servers", type=int, default=-1, help="--local: sandbox servers (default --workers)")
  a("--sandbox_backend", default="bwrap", choices=("bwrap", "local"),
    help="--local: sandbox backend (local = no isolation, for trusted tests only)")
  a("--redis_password_file", default="", help="--local with --redis: file with its password")
  a("--policy_token_file", default="", help="--local: file with the policy server's token")
  a("--ready_file", default="", help="--local: write the fleet info JSON here once up")
  a("--keep_dir", action="store_true", help="--local: keep logs and secret files on exit")
  return p


def _repo_or_gcs(flag: str, value: str) -> str:
  if value.startswith("gs://"):
    return common.check_gcs(flag, value)
  full = os.path.abspath(os.path.join(common.REPO_ROOT, value))
  if not value or not full.startswith(common.REPO_ROOT + os.sep) or not os.path.isfile(full):
    raise LaunchError(f"{flag}={value!r}: expected gs://... or a file inside the repository "
                      "(it ships with the code)")
  return os.path.relpath(full, common.REPO_ROOT)


def parse_cloud(args: argparse.Namespace) -> Fleet:
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
  redis = check_redis_url("--redis", args.redis, args.allow_plaintext_redis)
  if args.redis_ca_secret and not redis.startswith("rediss://"):
    raise LaunchError("--redis_ca_secret needs a rediss:// --redis")
  return Fleet(
      name=common.check_name("--name", args.name), project=args.project, zone=args.zone,
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
      queue_prefix=args.queue_prefix, grace=args.grace)


def parse_local(args: argparse.Namespace) -> LocalFleet:
  if args.workers < 0:
    raise LaunchError(f"--workers={args.workers}: must be >= 0")
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
  argv = sys.argv[1:] if argv is None else argv
  args = build_parser().parse_args(list(argv))
  try:
    if args.local:
      fleet = parse_local(args)
    elif args.teardown:
      for flag in ("project", "zone"):
        if not getattr(args, flag):
          raise LaunchError(f"--teardown needs --{flag}")
      common.run(teardown_commands(common.check_name("--name", args.name), args.project,
                                   args.zone), args.dry_run)
      return 0
    else:
      cloud = parse_cloud(args)
  except LaunchError as e:
    print(f"launch.fleet: error: {e}", file=sys.stderr)
    return 2
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
