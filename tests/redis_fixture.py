"""A throwaway redis-server for tests: loopback only, password, append-only file in a temp dir.

Shared by the queue and rollout-worker tests (one server per test session; tests keep apart by
key prefix).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from typing import Optional

import portpicker
import redis


@dataclasses.dataclass
class RedisServer:
  proc: subprocess.Popen
  port: int
  password: str
  dir: str
  tls_port: Optional[int] = None
  ca_file: Optional[str] = None

  @property
  def url(self) -> str:
    return f"redis://127.0.0.1:{self.port}"

  @property
  def tls_url(self) -> str:
    return f"rediss://127.0.0.1:{self.tls_port}"

  def prefix(self) -> str:
    """A fresh key prefix: each test gets its own streams and task keys."""
    return f"t{uuid.uuid4().hex[:10]}"

  def stop(self, keep_data: bool = False) -> None:
    """SIGTERM: Redis writes its append-only file out before it exits."""
    self.proc.terminate()
    try:
      self.proc.wait(10)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait(10)
    if not keep_data:
      shutil.rmtree(self.dir, ignore_errors=True)


def _self_signed(dir: str) -> tuple[str, str]:
  """(cert, key) for CN/IP 127.0.0.1, made with the openssl CLI."""
  cert, key = os.path.join(dir, "cert.pem"), os.path.join(dir, "key.pem")
  subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                  "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                  "-keyout", key, "-out", cert], check=True, capture_output=True, timeout=60)
  return cert, key


def start_redis(tls: bool = False, restart: Optional[RedisServer] = None) -> RedisServer:
  """Start redis-server on a free loopback port; with `tls`, also a TLS port. `restart`: a
  stopped server's port, password and directory (its append-only file is loaded again)."""
  if restart is not None:
    tmp, port, password = restart.dir, restart.port, restart.password
  else:
    tmp = tempfile.mkdtemp(prefix="arbor-redis-")
    port, password = portpicker.pick_unused_port(), uuid.uuid4().hex
  args = ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--requirepass", password,
          "--appendonly", "yes", "--save", "", "--dir", tmp, "--protected-mode", "yes"]
  tls_port = ca = None
  if tls:
    cert, key = _self_signed(tmp)
    tls_port, ca = portpicker.pick_unused_port(), cert
    args += ["--tls-port", str(tls_port), "--tls-cert-file", cert, "--tls-key-file", key,
             "--tls-ca-cert-file", cert, "--tls-auth-clients", "no"]
  proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  client = redis.Redis(host="127.0.0.1", port=port, password=password)
  deadline = time.monotonic() + 20
  while True:
    try:
      client.ping()
      break
    except redis.ConnectionError:
      if proc.poll() is not None or time.monotonic() > deadline:
        proc.kill()
        raise RuntimeError(f"redis-server did not start (exit {proc.poll()})")
      time.sleep(0.05)
  client.close()
  return RedisServer(proc, port, password, tmp, tls_port, ca)
