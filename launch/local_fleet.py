"""The sandbox fleet on this machine (`python -m launch.fleet --local`): redis-server, sandbox
servers and rollout workers as subprocesses, every one bound to 127.0.0.1.

Generated secrets (the Redis password, the sandbox token) live in 0600 files of a 0700
directory and never appear on a command line; `LocalFleet.info` names the files, never the
values. `LocalFleet.plan` lists the same command lines without starting anything or writing a
file (`--dry_run`). `launch.fleet` parses the flags; tests/test_cluster.py drives `LocalFleet`
directly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets as pysecrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Optional, Sequence

from launch import common
from launch.common import Command, LaunchError

# What `plan` shows where a real start fills in a value it only knows then.
PLAN_DIR = "/tmp/arbor-fleet-XXXXXXXX"  # mkdtemp's fresh 0700 directory
PLAN_REDIS_PORT = "REDIS_PORT"  # a free port
PLAN_SANDBOX_PORT = "SANDBOX_{}_PORT"  # the port sandbox server i picked (--port 0)


def free_port() -> int:
  """A TCP port on 127.0.0.1 that was free a moment ago."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def write_secret_file(path: str, value: str) -> str:
  """Writes a new file readable by its owner only (mode 0600; fails if it exists).

  Args:
    path: the file.
    value: its content.

  Returns:
    `path`.
  """
  with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as fh:
    fh.write(value)
  return path


def http_health(url: str, token_file: str, timeout: float = 5.0) -> dict:
  """GET URL/health with the bearer token from `token_file`.

  Args:
    url: the server's base URL.
    token_file: the file that holds the token.
    timeout: seconds to wait for the answer.

  Returns:
    The decoded JSON answer.

  Raises:
    OSError: the server is unreachable or refuses the token (urllib's HTTPError is one).
  """
  with open(token_file) as fh:
    token = fh.read().strip()
  req = urllib.request.Request(f"{url}/health", headers={"Authorization": f"Bearer {token}"})
  with urllib.request.urlopen(req, timeout=timeout) as r:
    return json.loads(r.read())


def redis_ping(port: int, password_file: str, timeout: float = 2.0) -> bool:
  """AUTH + PING over a raw socket (RESP), so launch needs no Redis client.

  Args:
    port: the Redis port on 127.0.0.1.
    password_file: the file that holds the password.
    timeout: seconds to wait for the connection and each answer.

  Returns:
    Whether Redis accepted the password and answered PONG.
  """
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
    self.dir = ""  # made by start_services: mode 0700, the logs and the secret files
    self.procs: list[tuple[str, subprocess.Popen]] = []
    self.redis_url = self.redis
    self.password_file = self.redis_password_file
    self.sandbox_token_file = ""
    self.sandbox_urls: list[str] = []

  # The command lines (secrets only as file names)

  def redis_conf(self, port: int | str, password: str) -> str:
    """redis-server's config: loopback only, AUTH with `password`, append-only file in `dir`.

    Args:
      port: the port (a number, or the PLAN_* placeholder of `plan`).
      password: the AUTH password (written to a 0600 file only).

    Returns:
      The config file's text.
    """
    return "\n".join(["bind 127.0.0.1", f"port {port}", "protected-mode yes",
                      f"requirepass {password}", f"dir {self.dir or PLAN_DIR}",
                      "appendonly yes", 'save ""', "daemonize no", ""])

  def sandbox_argv(self, i: int, port_file: str, token_file: str) -> list[str]:
    """Sandbox server i's command line: loopback, a free port, its own uid range.

    Args:
      i: the server's number (picks its uid range).
      port_file: where the server writes the port it bound.
      token_file: the file holding the token clients must send.

    Returns:
      The argv (the token only as a file name).
    """
    argv = [self.python, "-m", "envs.sandbox_server", "--host", "127.0.0.1", "--port", "0",
            "--port_file", port_file, "--token-file", token_file,
            "--backend", self.sandbox_backend, "--max_sandboxes", str(self.max_sandboxes),
            "--uid_base", str(2_000_000_000 + 4096 * i), "--uid_count", "256"]
    if self.sandbox_backend == "local":
      argv.append("--allow_unsafe_local")
    return argv

  def worker_argv(self, i: int, redis_url: str, password_file: str, sandbox_url: str,
                  token_file: str) -> list[str]:
    """Rollout worker `local-<i>`'s command line, on the sandbox server at `sandbox_url`.

    Args:
      i: the worker's number.
      redis_url: the queue's redis:// URL.
      password_file: the file holding the Redis password.
      sandbox_url: the worker's sandbox server.
      token_file: the file holding the sandbox server's token.

    Returns:
      The argv (secrets only as file names).
    """
    argv = [self.python, "-m", "envs.rollout_worker", "--policy_url", self.policy_url,
            "--queue", redis_url, "--queue_password_file", password_file,
            "--queue_prefix", self.queue_prefix, "--tasks", self.tasks,
            "--tokenizer", self.tokenizer, "--chat", self.chat,
            "--group_size", str(self.group_size), "--concurrency", str(self.concurrency),
            "--sandbox", "remote", "--sandbox_url", sandbox_url,
            "--token_file", token_file, "--grace", str(self.grace),
            "--lease_ttl", str(self.lease_ttl), "--max_backlog", str(self.max_backlog),
            "--epochs", str(self.epochs), "--max_turns", str(self.max_turns),
            "--max_new_tokens", str(self.max_new_tokens),
            "--max_context_tokens", str(self.max_context_tokens), "--worker_id", f"local-{i}"]
    if self.policy_token_file:
      argv += ["--policy_token_file", self.policy_token_file]
    return argv

  def plan(self) -> list[Command]:
    """What `start` runs, in order, with PLAN_* where it fills in a directory or a port.

    Starts nothing and writes nothing (`--dry_run`).
    """
    cmds = []
    redis_url, password_file = self.redis, self.redis_password_file
    if not self.redis:
      redis_url = f"redis://127.0.0.1:{PLAN_REDIS_PORT}"
      password_file = f"{PLAN_DIR}/redis.password"
      cmds.append(Command(("redis-server", f"{PLAN_DIR}/redis.conf"),
                          f"Redis on {redis_url}; the password is generated into "
                          f"{password_file} (0600) and the config"))
    token_file = f"{PLAN_DIR}/sandbox.token"
    urls = [f"http://127.0.0.1:{PLAN_SANDBOX_PORT.format(i)}"
            for i in range(self.sandbox_servers)]
    for i, url in enumerate(urls):
      cmds.append(Command(tuple(self.sandbox_argv(i, f"{PLAN_DIR}/sandbox-{i}.port",
                                                  token_file)),
                          f"sandbox server {i} on {url}; its token is generated into "
                          f"{token_file} (0600)"))
    for i in range(self.workers):
      cmds.append(Command(tuple(self.worker_argv(i, redis_url, password_file,
                                                 urls[i % len(urls)], token_file)),
                          f"rollout worker local-{i} (log: {PLAN_DIR}/worker-{i}.log)"))
    return cmds

  def _spawn(self, name: str, argv: Sequence[str]) -> subprocess.Popen:
    """Starts a process in the repository, its output in <dir>/<name>.log."""
    log = open(os.path.join(self.dir, f"{name}.log"), "wb")
    proc = subprocess.Popen(list(argv), cwd=common.REPO_ROOT, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    self.procs.append((name, proc))
    return proc

  def _wait(self, what: str, proc: subprocess.Popen, ready, timeout: float = 30.0):
    """Polls `ready()` until it returns a true value, and returns that value.

    Raises:
      RuntimeError: `proc` exited first, or `timeout` seconds passed.
    """
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
    """Starts Redis, the sandbox servers, then the rollout workers.

    Returns:
      `info()`.
    """
    self.start_services()
    for i in range(self.workers):
      self.start_worker(i)
    return self.info()

  def start_services(self) -> dict:
    """Starts Redis (unless given) and the sandbox servers, each healthy before this returns.

    Returns:
      `info()`.

    Raises:
      LaunchError: redis-server is not installed and no --redis was given.
      RuntimeError: a process exited or was not ready in time (its log is in `dir`).
    """
    if not self.redis and not shutil.which("redis-server"):
      raise LaunchError("--local: redis-server is not installed (apt-get install "
                        "redis-server), or pass --redis and --redis_password_file")
    d = self.dir = tempfile.mkdtemp(prefix="arbor-fleet-")  # mode 0700
    if not self.redis:
      port = free_port()
      password = pysecrets.token_hex(32)  # in 0600 files only, never in an argv
      self.password_file = write_secret_file(os.path.join(d, "redis.password"), password)
      conf = write_secret_file(os.path.join(d, "redis.conf"), self.redis_conf(port, password))
      proc = self._spawn("redis", ["redis-server", conf])
      self._wait("redis-server", proc, lambda: redis_ping(port, self.password_file))
      self.redis_url = f"redis://127.0.0.1:{port}"
    self.sandbox_token_file = write_secret_file(os.path.join(d, "sandbox.token"),
                                                pysecrets.token_hex(32))
    for i in range(self.sandbox_servers):
      port_file = os.path.join(d, f"sandbox-{i}.port")
      proc = self._spawn(f"sandbox-{i}", self.sandbox_argv(i, port_file, self.sandbox_token_file))

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
    """Starts rollout worker `local-<i>` on sandbox server i mod n (log: <dir>/worker-<i>.log).

    Args:
      i: the worker's number.

    Returns:
      Its process.
    """
    return self._spawn(f"worker-{i}", self.worker_argv(
        i, self.redis_url, self.password_file, self.sandbox_urls[i % len(self.sandbox_urls)],
        self.sandbox_token_file))

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
    """Stops every process, in reverse start order (workers, sandbox servers, Redis).

    SIGTERM first, then SIGKILL for whatever outlives its grace.

    Args:
      keep_dir: keep the directory with the logs and secret files.
    """
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
    if self.dir and not keep_dir:
      shutil.rmtree(self.dir, ignore_errors=True)


def run_local(fleet: LocalFleet, ready_file: str = "", keep_dir: bool = False) -> int:
  """Starts the fleet, prints its info and runs it until SIGTERM/SIGINT or a process exits.

  Args:
    fleet: the fleet, not started.
    ready_file: where to write the info JSON once everything is up ("" for nowhere).
    keep_dir: keep logs and secret files on exit (they are kept anyway after a failure).

  Returns:
    0 after a signal, 1 after a process exited on its own.
  """
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

