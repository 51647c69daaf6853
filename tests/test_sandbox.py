"""Sandbox conformance: the same behaviour from every backend (bwrap, local, remote over
loopback backed by bwrap, docker on the local engine), plus the sandbox server's HTTP contract
(auth, capacity, request limits, malformed input, ttl, warm pool, shutdown).

The docker tests start the local engine when none answers (`docker_engine.ensure_engine`) and
fail when it cannot be started; ARBOR_SKIP_DOCKER=1 skips them instead, for machines that
cannot run Docker at all. Their image is `debian.docker_image` with pytest (built once, then
cached by tag).

One file on purpose: every backend runs the same conformance tests (one parametrized suite),
and its helpers (private uid ranges, the server, the docker image) are shared with
test_sandbox_isolation.py, test_sandbox_server.py and the other sandbox tests."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from envs.sandbox import Limits, PathError, SandboxError, SandboxFull, create_sandbox

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Private uid ranges (other processes on this machine may run sandboxes from the default
# pool): in-process bwrap sandboxes, and those of the servers the tests start.
# One of 16 slots (lock files stay behind per uid: keep their number bounded); the workers of
# one pytest-xdist run take consecutive slots from a run-wide offset, so none shares a range.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
_SLOT = (int(_RUN, 16) + _WORKER) % 16 if _RUN else random.randrange(16)
_BASE = 2_001_000_000 + _SLOT * 128
TEST_UIDS, SERVER_UIDS = range(_BASE, _BASE + 64), range(_BASE + 64, _BASE + 128)
# The docker sandboxes' user, private to this slot too (beyond the 16 slots' bwrap ranges).
DOCKER_UID = 2_001_000_000 + 16 * 128 + (_BASE - 2_001_000_000) // 128
LIMITS = Limits(memory_mb=256, pids=64, disk_mb=16, output_bytes=1000, file_bytes=1 << 20,
                default_timeout=20)


# ---------------------------------------------------------------------------------------------
# Helpers shared with test_sandbox_isolation.py

@dataclasses.dataclass
class Server:
  url: str
  token: str
  proc: subprocess.Popen
  log: str

  def request(self, method: str, path: str, body=None, token=None, raw: bytes = None,
              headers=None) -> tuple[int, dict]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    h = {"Authorization": f"Bearer {self.token if token is None else token}"}
    h.update(headers or {})
    req = urllib.request.Request(self.url + path, data=data, method=method, headers=h)
    try:
      with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
      return e.code, json.loads(e.read())

  def stop(self) -> int:
    self.proc.send_signal(signal.SIGTERM)
    return self.proc.wait(30)


def start_server(tmp_dir: str, *args: str, pass_fds=()) -> Server:
  """`python -m envs.sandbox_server` on a free loopback port (bwrap backend by default)."""
  token = secrets.token_hex(16)
  token_file, port_file = os.path.join(tmp_dir, "token"), os.path.join(tmp_dir, "port")
  with open(os.open(token_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
    f.write(token)
  log = os.path.join(tmp_dir, "server.log")
  proc = subprocess.Popen(
      [sys.executable, "-m", "envs.sandbox_server", "--port", "0", "--port_file", port_file,
       "--token-file", token_file, "--uid_base", str(SERVER_UIDS[0]),
       "--uid_count", str(len(SERVER_UIDS)), *args], cwd=REPO, stdout=open(log, "w"),
      stderr=subprocess.STDOUT, pass_fds=pass_fds)
  deadline = time.monotonic() + 30
  while not os.path.exists(port_file):
    if proc.poll() is not None or time.monotonic() > deadline:
      proc.kill()
      pytest.fail(f"sandbox server did not start: {open(log).read()[-2000:]}")
    time.sleep(0.05)
  return Server(f"http://127.0.0.1:{open(port_file).read()}", token, proc, log)


def pool_processes(uids=(TEST_UIDS, SERVER_UIDS, range(DOCKER_UID, DOCKER_UID + 1)),
                   zombies: bool = True) -> list[int]:
  """Host pids running as a uid of the tests' sandboxes: the bwrap pools and the docker user
  (left-overs of any sandbox).
  Zombies count too unless `zombies=False`: normal operation reaps every process it starts."""
  out = []
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        with open(f"/proc/{name}/status") as f:
          fields = dict(l.split(":", 1) for l in f if l.startswith(("State:", "Uid:")))
      except OSError:
        continue
      uid = int(fields.get("Uid", "-1 ").split()[0])
      if any(uid in r for r in uids) and (zombies or not fields["State"].split()[0] == "Z"):
        out.append(int(name))
  return out


@functools.lru_cache(maxsize=None)
def _docker_image() -> tuple[str, str]:
  """(image tag, "") or ("", why the engine or the image is not there)."""
  from envs.environments import debian
  from envs.sandbox import docker_engine
  try:
    docker_engine.ensure_engine()
    return debian.docker_image(packages=("python3-pytest",)), ""
  except Exception as e:
    return "", f"{type(e).__name__}: {e}"


def docker_kw() -> dict:
  """create_sandbox("docker", ...) arguments of the tests (image and user); fails the test when
  the engine cannot be started or the image built, skips it only under ARBOR_SKIP_DOCKER=1."""
  if os.environ.get("ARBOR_SKIP_DOCKER") == "1":
    pytest.skip("ARBOR_SKIP_DOCKER=1")
  image, why = _docker_image()
  if not image:
    pytest.fail(f"docker backend: no engine or no image ({why}); set ARBOR_SKIP_DOCKER=1 to "
                "skip the docker tests on a machine that cannot run Docker")
  return {"image": image, "user": f"{DOCKER_UID}:{DOCKER_UID}"}


# ---------------------------------------------------------------------------------------------
# Fixtures

@pytest.fixture(scope="module")
def server(tmp_path_factory):
  s = start_server(str(tmp_path_factory.mktemp("server")), "--max_sandboxes", "16",
                   "--warm", "1")
  yield s
  assert s.stop() == 0, open(s.log).read()[-2000:]


BACKENDS = ["bwrap", "local", "remote", "docker"]


@pytest.fixture(params=BACKENDS)
def make(request):
  """make(limits=LIMITS) -> coroutine creating a sandbox of the parametrised backend."""
  backend = request.param
  kw = {}
  if backend == "bwrap":
    kw = {"uids": TEST_UIDS}
  elif backend == "local":
    kw = {"allow_unsafe": True}
  elif backend == "remote":
    s = request.getfixturevalue("server")
    kw = {"url": s.url, "token": s.token}
  elif backend == "docker":
    kw = docker_kw()

  def make(limits: Limits = LIMITS):
    return create_sandbox(backend, limits=limits, **kw)

  make.backend = backend
  return make


def run(coro):
  return asyncio.run(coro)


# ---------------------------------------------------------------------------------------------
# Conformance (every backend)

def test_exec_exit_code_stdout_stderr(make):
  async def go():
    async with await make() as sb:
      r = await sb.exec("echo out; echo err >&2; exit 3")
      assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, "out\n", "err\n", False)
      assert not r.stdout_truncated and not r.stderr_truncated and 0 < r.duration < 10
      r = await sb.exec("sh -c 'kill -9 $$'; echo status=$?")
      assert r.stdout == "status=137\n"  # a signal-killed child, as the shell reports it
      r = await sb.exec("printf 'caf\\303\\251 \\377'")
      assert r.stdout == "café \ufffd"  # UTF-8 with replacement
  run(go())


def test_exec_stdin_env_and_persistent_workspace(make):
  async def go():
    async with await make() as sb:
      r = await sb.exec("cat; echo", stdin="hello\nworld")
      assert r.stdout == "hello\nworld\n"
      big = "x" * 300_000  # larger than a pipe buffer
      assert (await sb.exec("wc -c", stdin=big)).stdout.strip() == "300000"
      assert (await sb.exec("true", stdin=big)).exit_code == 0  # unread stdin is fine
      assert (await sb.exec("od -An -tx1", stdin=b"\x00\xff")).stdout.split() == ["00", "ff"]
      r = await sb.exec('echo "$FOO|$BAR"', env={"FOO": "a b", "BAR": "$HOME"})
      assert r.stdout == "a b|$HOME\n"
      assert (await sb.exec("echo one > f.txt")).exit_code == 0
      assert (await sb.exec("cat f.txt")).stdout == "one\n"  # cwd = workspace, persists
  run(go())


def test_timeout(make):
  async def go():
    async with await make() as sb:
      t0 = time.monotonic()
      r = await sb.exec("echo started; sleep 30", timeout=0.5)
      assert r.timed_out and r.exit_code == -1
      assert 0.5 <= r.duration < 5 and time.monotonic() - t0 < 8
      assert r.stdout == "started\n"  # output before the deadline is kept
      assert (await sb.exec("echo alive")).stdout == "alive\n"  # sandbox still usable
  run(go())


def test_output_truncation(make):
  async def go():
    async with await make() as sb:  # output_bytes=1000
      r = await sb.exec("head -c 5000 /dev/zero | tr '\\0' a; echo 'last line'; "
                        "head -c 3000 /dev/zero >&2")
      # the first and the last 500 bytes, the middle's length and the total between them
      assert r.exit_code == 0 and r.stdout_truncated and r.stdout_bytes == 5010
      assert r.stdout == "a" * 500 + "\n[... 4010 bytes left out of 5010 ...]\n" + \
          "a" * 490 + "last line\n"
      assert r.stderr_truncated and r.stderr_bytes == 3000
      assert r.stderr.count("\0") == 1000 and "2000 bytes left out of 3000" in r.stderr
      r = await sb.exec("head -c 1000 /dev/zero | tr '\\0' b")
      assert r.stdout == "b" * 1000 and not r.stdout_truncated  # exactly the cap
      assert r.stdout_bytes == 1000
      r = await sb.exec("kill -TERM $$")  # one convention for signal deaths: 128 + N
      assert r.exit_code == 128 + 15 and not r.timed_out
  run(go())


def test_exec_takes_an_argv_list_in_the_workspace_path(make):
  async def go():
    async with await make() as sb:
      r = await sb.exec("pwd")
      assert sb.workspace_path and r.stdout.strip() == sb.workspace_path
      r = await sb.exec(["printf", "%s|", "a b", "$HOME", "it's", "*"])
      assert r.exit_code == 0 and r.stdout == "a b|$HOME|it's|*|"  # no shell expansion
      for bad in ([], ["ok", 3], ["a\0b"]):
        with pytest.raises(ValueError, match="cmd="):
          await sb.exec(bad)
  run(go())


def test_write_read_list(make):
  async def go():
    async with await make() as sb:
      await sb.write_file("a.txt", "text")
      await sb.write_file("pkg/sub/b.bin", bytes(range(256)))
      await sb.write_file("./pkg//c.py", "print(1)\n")
      assert await sb.read_file("a.txt") == b"text"
      assert await sb.read_file("pkg/sub/b.bin") == bytes(range(256))
      assert await sb.list_files() == ["a.txt", "pkg/c.py", "pkg/sub/b.bin"]
      assert await sb.list_files("pkg") == ["pkg/c.py", "pkg/sub/b.bin"]
      assert await sb.list_files("a.txt") == ["a.txt"]
      r = await sb.exec("cat pkg/c.py; echo new > made.txt; mkdir -p d/e; echo z > d/e/f")
      assert r.stdout == "print(1)\n"
      assert await sb.read_file("made.txt") == b"new\n"
      assert await sb.list_files("d") == ["d/e/f"]
      await sb.write_file("a.txt", "replaced")  # overwrite, shorter
      assert (await sb.exec("cat a.txt")).stdout == "replaced"
      assert (await sb.exec("echo more >> a.txt")).exit_code == 0  # writable by the sandbox
      with pytest.raises(FileNotFoundError):
        await sb.read_file("missing.txt")
      with pytest.raises(FileNotFoundError):
        await sb.list_files("nodir")
      with pytest.raises(ValueError, match="file_bytes"):
        await sb.write_file("big", b"x" * ((1 << 20) + 1))
      assert (await sb.exec("head -c 1100000 /dev/zero > big2")).exit_code == 0
      with pytest.raises(ValueError, match="file_bytes"):
        await sb.read_file("big2")
  run(go())


def test_path_traversal_and_symlinks_rejected(make):
  async def go():
    async with await make() as sb:
      await sb.write_file("ok.txt", "ok")
      for bad in ["../x", "/etc/passwd", "a/../../x", "..", "", "a\x00b", "pkg/../../../etc"]:
        for op in (sb.read_file, lambda p: sb.write_file(p, "x"), sb.list_files):
          with pytest.raises(PathError):
            await op(bad)
      r = await sb.exec("ln -s /etc etc_link; ln -s /etc/passwd passwd_link; ln -s .. up; "
                        "ln -s ok.txt inner_link; mkdir d; ln -s / d/root")
      assert r.exit_code == 0
      for bad in ["etc_link/passwd", "passwd_link", "up/x", "inner_link", "d/root/etc/passwd"]:
        with pytest.raises(PathError):
          await sb.read_file(bad)
        with pytest.raises(PathError):
          await sb.write_file(bad, "pwned")
      for bad in ["etc_link", "up", "d/root"]:
        with pytest.raises(PathError):
          await sb.list_files(bad)
      assert await sb.list_files() == ["ok.txt"]  # symlinks are not listed
      assert (await sb.exec("cat ok.txt")).stdout == "ok"  # symlink target untouched
      with pytest.raises(PathError):
        await sb.write_file(".", "x")
  run(go())


def test_close_idempotent_and_context_manager(make):
  async def go():
    sb = await make()
    async with sb:
      assert (await sb.exec("echo in")).stdout == "in\n"
    with pytest.raises(SandboxError):
      await sb.exec("echo after")
    with pytest.raises(SandboxError):
      await sb.read_file("x")
    await sb.close()
    await sb.close()
  run(go())


def test_malformed_inputs(make):
  async def go():
    async with await make() as sb:
      for kwargs in [dict(cmd=""), dict(cmd=123), dict(cmd="true", timeout=-1),
                     dict(cmd="true", timeout="5"), dict(cmd="true", env={"BAD-NAME": "x"}),
                     dict(cmd="true", env={"X": 1}), dict(cmd="true", stdin=5),
                     dict(cmd="a\x00b")]:
        with pytest.raises(ValueError):
          await sb.exec(**kwargs)
      with pytest.raises(ValueError):
        await sb.write_file("x", 123)
      assert (await sb.exec("echo still ok")).stdout == "still ok\n"
  run(go())


def test_concurrent_execs(make):
  async def go():
    async with await make() as sb:
      rs = await asyncio.gather(*(sb.exec(f"sleep 0.2; echo {i}") for i in range(4)))
      assert [r.stdout for r in rs] == [f"{i}\n" for i in range(4)]
  run(go())


def test_docker_remote_engine_only_over_tls(monkeypatch):
  pytest.importorskip("docker", reason="docker-py not installed")
  from envs.sandbox.docker import docker_client
  for host in ["tcp://10.0.0.5:2375", "ssh://user@10.0.0.5", "http://10.0.0.5:2375"]:
    monkeypatch.setenv("DOCKER_HOST", host)
    monkeypatch.delenv("DOCKER_TLS_VERIFY", raising=False)
    with pytest.raises(SandboxError, match="TLS"):
      docker_client()


def test_docker_file_api_runs_as_the_sandbox_user():
  """Unlike bwrap's (root on the host), docker's file API runs inside the container as the
  sandbox user: what the sandbox made unreadable or read-only stays so for the API too."""
  async def go():
    async with await create_sandbox("docker", limits=LIMITS, **docker_kw()) as sb:
      r = await sb.exec("echo x > a && chmod 000 a && echo y > b && chmod 444 b && "
                        "mkdir -p d/e && echo z > d/e/f && chmod 000 d")
      assert r.exit_code == 0, r
      for op in (lambda: sb.read_file("a"), lambda: sb.write_file("b", "new"),
                 lambda: sb.read_file("d/e/f"), lambda: sb.write_file("d/g", "new"),
                 lambda: sb.list_files("d")):
        with pytest.raises(PermissionError):
          await op()
      assert (await sb.exec("chmod 700 d a b && cat a b d/e/f")).stdout == "x\ny\nz\n"
      await sb.write_file("b", "new")  # and once the modes allow it, the API can
      assert await sb.read_file("b") == b"new" and await sb.list_files("d") == ["d/e/f"]
  run(go())


def test_docker_engine_found_or_explained(tmp_path, monkeypatch):
  """ensure_engine: a client when the engine answers; otherwise each reason it cannot start one,
  on an engine address nothing listens at and a stand-in dockerd."""
  pytest.importorskip("docker", reason="docker-py not installed")
  from envs.sandbox import docker_engine
  if os.environ.get("ARBOR_SKIP_DOCKER") != "1":
    assert docker_engine.ensure_engine(start=False).ping()
  nowhere = f"unix://{tmp_path}/docker.sock"
  monkeypatch.setenv("DOCKER_HOST", nowhere)
  with pytest.raises(SandboxError, match="no Docker engine answers"):
    docker_engine.ensure_engine(start=False)
  with pytest.raises(SandboxError, match="python -m envs.sandbox.docker_engine"):
    run(create_sandbox("docker"))  # the backend names the way to start one
  with pytest.raises(SandboxError, match="only the local engine"):
    docker_engine.ensure_engine()
  monkeypatch.setattr(docker_engine, "_LOCAL", (nowhere,))
  monkeypatch.setattr(docker_engine, "LOG", str(tmp_path / "dockerd.log"))
  monkeypatch.setattr(docker_engine, "_LOCK", str(tmp_path / "lock"))
  monkeypatch.setenv("PATH", str(tmp_path))
  with pytest.raises(SandboxError, match="apt-get install docker.io"):
    docker_engine.ensure_engine()
  fake = tmp_path / "dockerd"
  fake.write_text("#!/bin/sh\necho \"starting with $*\"\necho 'failed to start: no luck'\n"
                  "exit 3\n")
  fake.chmod(0o755)
  monkeypatch.setattr(os, "geteuid", lambda: 1000)
  with pytest.raises(SandboxError, match="needs root"):
    docker_engine.ensure_engine()
  monkeypatch.undo()  # a real euid again; the same stand-ins
  monkeypatch.setenv("DOCKER_HOST", nowhere)
  monkeypatch.setattr(docker_engine, "_LOCAL", (nowhere,))
  monkeypatch.setattr(docker_engine, "LOG", str(tmp_path / "dockerd.log"))
  monkeypatch.setattr(docker_engine, "_LOCK", str(tmp_path / "lock"))
  monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
  if os.geteuid() == 0:
    with pytest.raises(SandboxError, match="(?s)exited with status 3.*no luck") as e:
      docker_engine.ensure_engine()
    assert "--bridge=none --iptables=false" in str(e.value)  # as the log shows it
    fake.write_text("#!/bin/sh\necho still starting\nexec sleep 30\n")
    with pytest.raises(SandboxError, match="(?s)did not answer within timeout=1.*still starting"
                       ) as e:
      docker_engine.ensure_engine(timeout=1)
    os.kill(int(str(e.value).split("(pid ")[1].split(")")[0]), signal.SIGKILL)  # left running


def test_factory_errors():
  with pytest.raises(ValueError, match="bwrap, local, docker, remote"):
    run(create_sandbox("chroot"))
  with pytest.raises(SandboxError, match="allow_unsafe"):
    run(create_sandbox("local"))


# ---------------------------------------------------------------------------------------------
# bwrap specifics: uid pool, crash recovery, extra binds, rootfs

def _uids(n: int) -> range:
  start = TEST_UIDS[-1] - 8 - n  # a corner of the private range the other tests rarely reach
  return range(start, start + n)


def test_bwrap_uid_pool_exhaustion_and_release():
  async def go():
    uids = _uids(2)
    a = await create_sandbox("bwrap", limits=LIMITS, uids=uids)
    b = await create_sandbox("bwrap", limits=LIMITS, uids=uids)
    assert {a.uid, b.uid} == set(uids)
    with pytest.raises(SandboxFull, match="uids"):
      await create_sandbox("bwrap", limits=LIMITS, uids=uids)
    await a.close()
    c = await create_sandbox("bwrap", limits=LIMITS, uids=uids)
    assert c.uid == a.uid and await c.list_files() == []  # a fresh workspace
    await b.close()
    await c.close()
  run(go())


def test_bwrap_recovers_a_crashed_holder(tmp_path):
  uids = _uids(1)
  code = (f"import asyncio, os, sys\n"
          f"from envs.sandbox import create_sandbox\n"
          f"async def main():\n"
          f"  sb = await create_sandbox('bwrap', uids=range({uids[0]}, {uids[0] + 1}))\n"
          f"  await sb.write_file('left.txt', 'x')\n"
          f"  print('ready', flush=True)\n"
          f"  await sb.exec('sleep 60')\n"
          f"asyncio.run(main())\n")
  proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                          text=True)
  assert proc.stdout.readline() == "ready\n"
  time.sleep(0.3)
  proc.kill()  # no close(): mounts, cgroups and the lock file's content are left behind
  proc.wait(10)

  async def go():
    sb = await create_sandbox("bwrap", limits=LIMITS, uids=uids)
    async with sb:
      assert await sb.list_files() == []
      assert (await sb.exec("echo fine")).stdout == "fine\n"
      mounts = [l for l in open("/proc/mounts") if sb.host_dir + "/" in l]
      assert len(mounts) == 3, mounts  # stale mounts were removed, not stacked
    # The crashed holder's bwrap and its pid 1 died with it (--die-with-parent) but, orphaned,
    # are the host init's zombies to reap: only live processes count here.
    assert pool_processes([uids], zombies=False) == []
  run(go())


def test_bwrap_extra_read_only_binds_and_rootfs_layout(tmp_path):
  data = f"/run/arbor-test-data-{os.getpid()}"
  os.makedirs(data, exist_ok=True)
  try:
    with open(os.path.join(data, "venv.txt"), "w") as f:
      f.write("shared")
    os.chmod(data, 0o755)

    async def go():
      async with await create_sandbox("bwrap", limits=LIMITS, uids=TEST_UIDS,
                                      ro_binds=[(data, "/opt/data")]) as sb:
        r = await sb.exec("cat /opt/data/venv.txt; touch /opt/data/x; echo rc=$?")
        assert r.stdout.startswith("shared") and "rc=0" not in r.stdout, r
    run(go())
  finally:
    shutil.rmtree(data)
  with pytest.raises(ValueError, match="ro_binds"):
    run(create_sandbox("bwrap", ro_binds=["relative/path"]))
  from envs.sandbox import rootfs as image
  root = tmp_path / "rootfs"
  for d in ("usr/bin", "etc", "proc", "tmp", "opt"):
    (root / d).mkdir(parents=True)
  (root / "bin").symlink_to("usr/bin")
  b = image.binds(str(root), {})
  try:  # directories are bound from descriptors, links made again inside
    assert [a for a in b.args if not a.isdigit()] == [
        "--symlink", "usr/bin", "/bin", "--ro-bind-fd", "/etc", "--ro-bind-fd", "/opt",
        "--ro-bind-fd", "/usr"]
    assert [os.readlink(f"/proc/self/fd/{fd}") for fd in b.fds] == [
        str(root / name) for name in ("etc", "opt", "usr")]
  finally:
    image.close_all(b.fds)


# ---------------------------------------------------------------------------------------------
# Sandbox server: HTTP contract

def test_server_auth_and_health(server):
  status, body = server.request("GET", "/health")
  assert status == 200 and body["ok"] and body["backend"] == "bwrap"
  for token in ["", "wrong" * 8, server.token[:-1], server.token + "x"]:
    assert server.request("GET", "/health", token=token)[0] == 401
    status, body = server.request("POST", "/sandboxes", {}, token=token)
    assert status == 401 and body["type"] == "AuthError"
  req = urllib.request.Request(server.url + "/health")  # no Authorization header at all
  with pytest.raises(urllib.error.HTTPError) as e:
    urllib.request.urlopen(req, timeout=10)
  assert e.value.code == 401
  status, body = server.request("GET", "/health", headers={"Authorization": "Basic abc"})
  assert status == 401


def test_server_malformed_requests_keep_it_going(server):
  status, body = server.request("POST", "/sandboxes", raw=b"{not json")
  assert status == 400 and "JSON" in body["error"]
  assert server.request("POST", "/sandboxes", raw=b"[1, 2]")[0] == 400
  assert server.request("POST", "/nowhere", {})[0] == 404
  assert server.request("PUT", "/sandboxes", {})[0] == 405
  assert server.request("POST", "/sandboxes/deadbeef/exec", {"cmd": "true"})[0] == 404
  status, body = server.request("POST", "/sandboxes", {"limits": {"memory_mb": 10 ** 9}})
  assert status == 400 and "memory_mb" in body["error"]
  status, body = server.request("POST", "/sandboxes", {"limits": {"nonsense": 1}})
  assert status == 400 and "nonsense" in body["error"]
  status, body = server.request("POST", "/sandboxes", {"limits": {"pids": 1.5}})
  assert status == 400 and "pids" in body["error"]
  status, body = server.request("POST", "/sandboxes", {"limits": {"disk_mb": 8}})
  assert status == 200 and body["limits"]["disk_mb"] == 8
  sid = body["id"]
  for bad in [{}, {"cmd": 5}, {"cmd": "true", "timeout": "x"}, {"cmd": "true", "timeout": 1e9},
              {"cmd": "true", "env": ["A"]}, {"cmd": "true", "stdin": 3}]:
    status, body = server.request("POST", f"/sandboxes/{sid}/exec", bad)
    assert status == 400, (bad, body)
  status, body = server.request("POST", f"/sandboxes/{sid}/write",
                                {"path": "x", "content_b64": "***"})
  assert status == 400 and "base64" in body["error"]
  status, body = server.request("POST", f"/sandboxes/{sid}/read", {"path": "../etc/passwd"})
  assert status == 400 and body["type"] == "PathError"
  status, body = server.request("POST", f"/sandboxes/{sid}/exec", {"cmd": "echo fine"})
  assert status == 200 and body["stdout"] == "fine\n"
  assert server.request("DELETE", f"/sandboxes/{sid}")[0] == 200
  assert server.request("DELETE", f"/sandboxes/{sid}")[0] == 404
  assert server.request("GET", "/health")[0] == 200


def test_server_request_size_limit(tmp_path):
  s = start_server(str(tmp_path), "--max_request_bytes", "4096", "--max_sandboxes", "2")
  try:
    status, body = s.request("POST", "/sandboxes", {"pad": "x" * 10_000})
    assert status == 413 and "max_request_bytes" in body["error"]
    status, body = s.request("POST", "/sandboxes", {})
    assert status == 200
    sid = body["id"]
    big = base64.b64encode(b"y" * 8000).decode()
    status, body = s.request("POST", f"/sandboxes/{sid}/write", {"path": "f", "content_b64": big})
    assert status == 413
    status, body = s.request("POST", f"/sandboxes/{sid}/exec", {"cmd": "echo ok"})
    assert status == 200 and body["stdout"] == "ok\n"  # still serving
  finally:
    assert s.stop() == 0


def test_server_capacity_ttl_warm_pool_and_shutdown(tmp_path):
  s = start_server(str(tmp_path), "--max_sandboxes", "2", "--warm", "2", "--ttl", "1.0")

  async def go():
    deadline = time.monotonic() + 20
    while s.request("GET", "/health")[1]["warm"] < 2:  # pre-created ahead of demand
      assert time.monotonic() < deadline, "warm pool never filled"
      await asyncio.sleep(0.05)
    a = await create_sandbox("remote", limits=LIMITS, url=s.url, token=s.token)
    b = await create_sandbox("remote", url=s.url, token=s.token)
    health = s.request("GET", "/health")[1]
    assert health["live"] == 2 and health["warm"] == 0
    with pytest.raises(SandboxFull):
      await create_sandbox("remote", url=s.url, token=s.token)
    assert (await a.exec("echo a")).stdout == "a\n"
    # an exec longer than the ttl keeps its sandbox; idle ones expire
    r = await b.exec("sleep 2; echo b")
    assert r.stdout == "b\n"
    await asyncio.sleep(2.5)
    with pytest.raises(SandboxError, match="unknown or closed"):
      await a.exec("echo a")
    await a.close()  # already gone: close stays quiet
    c = await create_sandbox("remote", url=s.url, token=s.token)
    running = asyncio.ensure_future(c.exec("sleep 30; echo never", timeout=60))
    await asyncio.sleep(0.5)
    t0 = time.monotonic()
    assert await asyncio.to_thread(s.stop) == 0  # SIGTERM with an exec in flight
    try:
      r = await running
      assert r.stdout == ""  # killed by the shutdown, not finished
    except SandboxError:
      pass  # or the connection went down with the server
    assert time.monotonic() - t0 < 20
    return c

  c = run(go())
  assert "every sandbox closed" in open(s.log).read()
  assert pool_processes() == []
  with pytest.raises(SandboxError, match="unreachable"):
    run(c.exec("true"))


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI absent (makes the cert)")
def test_server_over_tls(tmp_path):
  cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
  subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                  "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                  "-keyout", key, "-out", cert], check=True, capture_output=True, timeout=60)
  s = start_server(str(tmp_path), "--tls-cert", cert, "--tls-key", key, "--max_sandboxes", "2")
  url = s.url.replace("http://127.0.0.1", "https://localhost")
  try:
    async def go():
      async with await create_sandbox("remote", url=url, token=s.token, cafile=cert) as sb:
        assert (await sb.exec("echo tls")).stdout == "tls\n"
      with pytest.raises(SandboxError):  # an unverified server is refused
        await create_sandbox("remote", url=url, token=s.token)
      with pytest.raises(SandboxError):  # plain HTTP gets no answer from a TLS port
        await create_sandbox("remote", url=s.url, token=s.token)
    run(go())
  finally:
    assert s.stop() == 0


def test_server_refuses_non_loopback_without_tls(tmp_path):
  token = tmp_path / "token"
  token.write_text(secrets.token_hex(16))
  r = subprocess.run([sys.executable, "-m", "envs.sandbox_server", "--host", "0.0.0.0",
                      "--port", "0", "--token-file", str(token)], cwd=REPO,
                     capture_output=True, text=True, timeout=60)
  assert r.returncode != 0 and "TLS" in r.stderr
  short = tmp_path / "short"
  short.write_text("abc")
  r = subprocess.run([sys.executable, "-m", "envs.sandbox_server", "--port", "0",
                      "--token-file", str(short)], cwd=REPO, capture_output=True, text=True,
                     timeout=60)
  assert r.returncode != 0 and "16 characters" in r.stderr


def test_remote_client_turns_a_cut_off_response_into_sandbox_error():
  """A server that dies mid-response (shutdown with an exec in flight) gives SandboxError, not
  http.client.IncompleteRead."""
  import socket
  import threading
  from envs.sandbox.remote import _Client

  listener = socket.socket()
  listener.bind(("127.0.0.1", 0))
  listener.listen(1)

  def serve_half():
    conn, _ = listener.accept()
    request = b""
    while b"\r\n\r\n" not in request or not request.endswith(b"}"):  # all of it: no RST
      request += conn.recv(65536)
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 152\r\n\r\n{\"stdout\": \"")  # then the server is gone
    conn.close()
  threading.Thread(target=serve_half, daemon=True).start()
  client = _Client(f"http://127.0.0.1:{listener.getsockname()[1]}", "token")
  try:
    with pytest.raises(SandboxError, match="cut-off response"):
      client._request("POST", "/sandboxes/x/exec", {"cmd": "true"}, timeout=10)
  finally:
    listener.close()
