"""Isolation of the hardened backends (bwrap, and remote = the sandbox server over loopback
backed by bwrap), run as root as our machines are.

Every check is phrased so that it fails if the protection is missing: the sandbox tries the
escape and the test asserts that it did not work (and, where it can, that the same action
works from the host, so a broken probe cannot pass by accident)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import glob
import os
import secrets
import socket
import stat
import threading
import time

import pytest

from envs.sandbox import Limits, PathError, SandboxError, create_sandbox
from envs.sandbox.bwrap import BASE_ENV, BwrapSandbox
from tests.test_sandbox import REPO, TEST_UIDS, pool_processes, start_server

if os.geteuid() != 0:  # the threat model is "the host runs as root"
  pytest.skip("isolation suite runs as root (bwrap backend needs it)", allow_module_level=True)

# Canaries the sandbox must not see: set before the server (a child) starts so it inherits them.
CANARY_ENV = "ARBOR_CANARY_" + secrets.token_hex(4).upper()
CANARY_VALUE = secrets.token_hex(12)
os.environ[CANARY_ENV] = CANARY_VALUE
SECRET = secrets.token_hex(16)
LIMITS = Limits(memory_mb=64, pids=32, cpus=0.25, disk_mb=4, output_bytes=4096,
                default_timeout=10)


@pytest.fixture(scope="module")
def canaries(tmp_path_factory):
  """A secret in our tmp dir, a 0600 root file visible in /etc, an inheritable open fd."""
  d = tmp_path_factory.mktemp("secrets")
  secret_file = d / "secret.txt"
  secret_file.write_text(SECRET)
  root_file = f"/etc/arbor-canary-{secrets.token_hex(4)}"
  with open(os.open(root_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
    f.write(SECRET)
  fd_name = f"fd-canary-{secrets.token_hex(4)}"
  fd = os.open(d / fd_name, os.O_RDWR | os.O_CREAT, 0o600)
  os.set_inheritable(fd, True)
  try:
    yield {"secret_file": str(secret_file), "root_file": root_file, "fd": fd, "fd_name": fd_name}
  finally:
    os.close(fd)
    os.unlink(root_file)


@pytest.fixture(scope="module")
def server(tmp_path_factory, canaries):
  s = start_server(str(tmp_path_factory.mktemp("iso-server")), "--max_sandboxes", "8",
                   pass_fds=[canaries["fd"]])
  yield s
  assert s.stop() == 0


@pytest.fixture(params=["bwrap", "remote"])
def make(request, canaries):
  if request.param == "remote":
    s = request.getfixturevalue("server")
    return lambda limits=LIMITS: create_sandbox("remote", limits=limits, url=s.url,
                                                token=s.token)
  return lambda limits=LIMITS: create_sandbox("bwrap", limits=limits, uids=TEST_UIDS)


def run(coro):
  return asyncio.run(coro)


@contextlib.contextmanager
def heartbeat():
  """A thread that sleeps 10 ms in a loop and records its worst lateness (seconds)."""
  state = {"max": 0.0, "beats": 0}
  stop = threading.Event()

  def beat():
    while not stop.is_set():
      t = time.perf_counter()
      time.sleep(0.01)
      state["max"] = max(state["max"], time.perf_counter() - t - 0.01)
      state["beats"] += 1

  th = threading.Thread(target=beat, daemon=True)
  th.start()
  try:
    yield state
  finally:
    stop.set()
    th.join(5)


def py(code: str) -> str:
  """A shell command running `code` with the sandbox's python3."""
  return "python3 - <<'EOF'\n" + code + "\nEOF"


# ---------------------------------------------------------------------------------------------

def test_no_network(make):
  listener = socket.socket()
  listener.bind(("0.0.0.0", 0))
  listener.listen(8)
  port = listener.getsockname()[1]
  probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
  probe.connect(("10.255.255.255", 1))  # no packet is sent: just picks the outgoing address
  host_ip = probe.getsockname()[0]
  probe.close()
  socket.create_connection(("127.0.0.1", port), timeout=2).close()  # reachable from the host

  async def go():
    async with await make() as sb:
      r = await sb.exec(py(f"""
import socket
for addr in [("127.0.0.1", {port}), ("{host_ip}", {port}), ("1.1.1.1", 53)]:
  try:
    socket.create_connection(addr, timeout=2).close()
    print("CONNECTED", addr)
  except OSError as e:
    print("refused", addr, e)
try:
  socket.getaddrinfo("pypi.org", 443)
  print("CONNECTED dns")
except OSError as e:
  print("no dns", e)
"""))
      assert r.exit_code == 0 and "refused" in r.stdout, r
      assert "CONNECTED" not in r.stdout, r.stdout
  try:
    run(go())
  finally:
    listener.close()


def host_path(sb, name: str) -> str:
  """Where workspace file `name` of sandbox `sb` lives on the host (bwrap: its own tmpfs;
  remote: the server's, found by its unique name)."""
  if isinstance(sb, BwrapSandbox):
    return os.path.join(sb.workspace, name)
  found = glob.glob(f"/run/arbor-sandbox/*/workspace/{name}")
  assert len(found) == 1, found
  return found[0]


def test_no_capabilities_non_root_uid_and_host_ownership(make):
  async def go():
    async with await make() as sb:
      r = await sb.exec("cat /proc/self/status; id -u")
      fields = dict(l.split(":", 1) for l in r.stdout.splitlines() if ":" in l)
      for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(fields[cap], 16) == 0, (cap, fields[cap])
      ids = fields["Uid"].split() + fields["Gid"].split()
      assert len(ids) == 8 and "0" not in ids, (fields["Uid"], fields["Gid"])
      assert r.stdout.splitlines()[-1] != "0"
      assert "0" not in fields["Groups"].split()
      assert fields["NoNewPrivs"].strip() == "1"
      name = f"owned-{secrets.token_hex(4)}"
      assert (await sb.exec(f"echo x > {name}; mkdir {name}.d")).exit_code == 0
      await sb.write_file(name + ".api", "y")
      for n in (name, name + ".d", name + ".api"):
        st = os.lstat(host_path(sb, n))
        assert st.st_uid != 0 and st.st_gid != 0, (n, st.st_uid)
        assert not st.st_mode & (stat.S_ISUID | stat.S_ISGID)
      assert os.lstat(os.path.dirname(host_path(sb, name))).st_uid != 0  # the workspace too
  run(go())


def test_read_only_binds_and_proc_sys(make):
  async def go():
    async with await make() as sb:
      r = await sb.exec("mount -o remount,rw /usr 2>&1; echo rc=$?; "
                        "mount -o remount,rw / 2>&1; echo rc=$?; "
                        "mount --bind /workspace /usr 2>&1; echo rc=$?; "
                        "mount -t tmpfs none /usr 2>&1; echo rc=$?")
      assert r.stdout.count("rc=") == 4 and "rc=0" not in r.stdout, r.stdout
      assert (await sb.exec("touch /usr/bin/x /etc/x")).exit_code != 0
      # Open every /proc/sys entry (and sysrq-trigger) for writing; nothing is written.
      r = await sb.exec(py("""
import os
tried, opened = 0, []
paths = ["/proc/sysrq-trigger"]
for d, _, files in os.walk("/proc/sys"):
  paths += [os.path.join(d, f) for f in files]
for p in paths:
  try:
    fd = os.open(p, os.O_WRONLY)
  except OSError:
    tried += 1
    continue
  os.close(fd)
  opened.append(p)
print("tried", tried, "opened", opened)
"""))
      assert r.exit_code == 0, r
      tried = int(r.stdout.split()[1])
      assert tried > 100 and r.stdout.strip().endswith("opened []"), r.stdout[-500:]
  run(go())


def test_clean_environment_and_no_inherited_fds(make, canaries):
  host_pairs = {f"{k}={v}" for k, v in os.environ.items() if k not in BASE_ENV}
  assert f"{CANARY_ENV}={CANARY_VALUE}" in host_pairs

  async def go():
    async with await make() as sb:
      r = await sb.exec("env; echo ---; tr '\\0' '\\n' < /proc/1/environ")
      assert r.exit_code == 0 and "---" in r.stdout, r
      assert CANARY_VALUE not in r.stdout and CANARY_ENV not in r.stdout
      leaked = host_pairs & set(r.stdout.splitlines())
      assert not leaked, leaked
      r = await sb.exec(py("""
import os
print("self", sorted(os.listdir("/proc/self/fd"), key=int))
for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
  for fd in os.listdir(f"/proc/{pid}/fd"):
    try:
      print(pid, fd, os.readlink(f"/proc/{pid}/fd/{fd}"))
    except OSError:
      pass
"""))
      assert r.exit_code == 0, r
      assert r.stdout.splitlines()[0] == "self ['0', '1', '2', '3']", r.stdout  # 3: listdir
      assert canaries["fd_name"] not in r.stdout and "/proc/1/fd" not in r.stderr
  run(go())


def test_secrets_unreadable(make, canaries):
  paths = ["/etc/shadow", canaries["root_file"], canaries["secret_file"], "/root/.bashrc",
           os.path.join(REPO, "setup.py"), os.path.join(REPO, "envs/sandbox/base.py")]
  for p in paths:  # the host (root) can read them: a failed read below is the sandbox's doing
    assert os.path.exists(p) or p.startswith("/root"), p

  async def go():
    async with await make() as sb:
      for p in paths:
        r = await sb.exec(f"cat {p}")
        assert r.exit_code != 0 and r.stdout == "", (p, r)
      r = await sb.exec("ls /root; ls /work; ls /home")
      assert r.exit_code != 0 and r.stdout == "", r
      r = await sb.exec(f"ls -l {canaries['root_file']}")  # visible but owned by root, 0600
      assert r.exit_code == 0 and r.stdout.startswith("-rw-------"), r
      assert SECRET not in (await sb.exec("grep -rs arbor /etc 2>/dev/null | head")).stdout
      # Through the file API (root on the host!): symlinks and hard links to host files.
      r = await sb.exec(f"ln -s /etc/shadow s; ln -s {canaries['root_file']} c; ln -s / r; "
                        f"ln /etc/passwd hard 2>&1; echo rc=$?")
      assert "rc=0" not in r.stdout  # no hard link across file systems
      for bad in ["s", "c", "r/etc/shadow", "r/root/.bashrc"]:
        with pytest.raises(PathError):
          await sb.read_file(bad)
        with pytest.raises(PathError):
          await sb.write_file(bad, "pwned")
      assert open(canaries["root_file"]).read() == SECRET
  run(go())


def test_nothing_outside_workspace_writable(make):
  async def go():
    async with await make() as sb:
      r = await sb.exec(py("""
import os, stat
allowed = ("/workspace", "/tmp", "/dev/shm")
bad, dirs, files = [], 0, 0
for top, depth in [("/", 0), ("/etc", 3), ("/usr", 2), ("/dev", 2), ("/var", 2), ("/run", 2)]:
  if not os.path.isdir(top):
    continue
  for d, subdirs, names in os.walk(top):
    if d.startswith(allowed) or d.startswith(("/proc", "/sys")) or (
        d.count("/") - top.rstrip("/").count("/") >= depth):
      subdirs[:] = []
    if d.startswith(allowed) or d.startswith(("/proc", "/sys")):
      continue
    dirs += 1
    try:
      fd = os.open(os.path.join(d, ".probe"), os.O_WRONLY | os.O_CREAT, 0o600)
      os.close(fd)
      bad.append(d)
    except OSError:
      pass
    for n in names:
      p = os.path.join(d, n)
      try:
        if not stat.S_ISREG(os.lstat(p).st_mode):
          continue  # /dev/null and friends are devices, not storage
        files += 1
        os.close(os.open(p, os.O_WRONLY | os.O_APPEND))
        bad.append(p)
      except OSError:
        pass
for d in allowed:
  os.close(os.open(os.path.join(d, ".probe"), os.O_WRONLY | os.O_CREAT, 0o600))
print(dirs, files, bad)
"""))
      assert r.exit_code == 0, r
      dirs, files, bad = r.stdout.split(" ", 2)
      assert int(dirs) > 100 and int(files) > 100 and bad.strip() == "[]", r.stdout[-1000:]
  run(go())


def test_no_nested_user_namespace(make):
  async def go():
    async with await make() as sb:
      r = await sb.exec("unshare -U true; echo rc=$?; unshare -Ur id -u; echo rc=$?; "
                        "unshare -n true; echo rc=$?")
      assert r.stdout.count("rc=") == 3 and "rc=0" not in r.stdout, r
  run(go())


def test_disk_quota(make):
  async def go():
    async with await make() as sb:  # disk_mb=4 for each tmpfs
      for d in ("/workspace", "/tmp", "/dev/shm"):
        r = await sb.exec(f"dd if=/dev/zero of={d}/fill bs=1M count=16 2>&1; "
                          f"echo rc=$?; stat -c %s {d}/fill")
        assert "No space left" in r.stdout and "rc=0" not in r.stdout, r.stdout
        assert int(r.stdout.split()[-1]) <= 4 << 20
      with pytest.raises(OSError):  # the workspace is full: the file API says so too
        await sb.write_file("more.bin", b"z" * (1 << 20))
      await sb.exec("rm -f /workspace/fill")
      r = await sb.exec("i=0; while [ $i -lt 5000 ]; do true > f$i || break; i=$((i+1)); done; "
                        "echo made=$i")
      assert int(r.stdout.split("=")[-1]) < 5000, r.stdout  # inode quota
  run(go())


def assert_contained(hb, r=None):
  # A bomb that dies at once (no fork left for `sleep`) returns in milliseconds: keep measuring
  # for at least 20 beats, so leftovers that still hog the CPU would show in the latency.
  deadline = time.monotonic() + 5
  while hb["beats"] < 20 and time.monotonic() < deadline:
    time.sleep(0.01)
  # 0.5 s: a leftover process hogging the CPU stalls the loop for seconds; a loaded 2-core
  # machine alone (pytest -n 2 next to the sandboxes) stalls it for ~0.2 s now and then
  assert hb["beats"] >= 20 and hb["max"] < 0.5, hb
  assert pool_processes() == [], "sandbox processes outlived the exec"


def test_fork_bomb(make):
  async def go():
    async with await make() as sb:
      with heartbeat() as hb:
        r = await sb.exec("bomb() { bomb | bomb & }; bomb; sleep 1.5; echo survived", timeout=3)
        assert_contained(hb)
      assert (await sb.exec("echo usable")).stdout == "usable\n"
  run(go())


def test_memory_bombs(make):
  async def go():
    async with await make() as sb:  # memory_mb=64
      with heartbeat() as hb:
        r = await sb.exec("python3 -c \"s = 'x' * (512 << 20); print('survived')\"", timeout=8)
        assert "survived" not in r.stdout and r.exit_code != 0, r
        r = await sb.exec(
            "for i in 1 2 3 4 5 6; do python3 -c \"s = 'x' * (40 << 20); import time; "
            "time.sleep(1); print('held')\" & done; wait", timeout=8)
        assert r.stdout.count("held") <= 1, r  # 6 x 40 MiB never fit in 64 MiB together
        assert_contained(hb)
  run(go())


def test_cpu_quota_and_infinite_loop(make):
  async def go():
    async with await make(dataclasses.replace(LIMITS, cpus=0.1)) as sb:
      with heartbeat() as hb:
        # Two busy processes for 1 s of wall time: ~0.1 s of CPU under the quota, ~2 s on an
        # idle 2-core host and still > 0.5 s on a heavily loaded one.
        r = await sb.exec(py("""
import os, time
t = time.time()
for _ in range(2):
  if os.fork() == 0:
    while time.time() - t < 1.0:
      pass
    os._exit(0)
os.wait(); os.wait()
c = os.times()
print(c.children_user + c.children_system)
"""))
        assert r.exit_code == 0 and float(r.stdout) < 0.35, r
        r = await sb.exec("while :; do :; done", timeout=1)
        assert r.timed_out and r.duration < 4
        assert_contained(hb)
  run(go())


def test_setsid_daemon_and_unbounded_output(make):
  async def go():
    sb = await make()
    async with sb:
      with heartbeat() as hb:
        r = await sb.exec("setsid sh -c 'sleep 30' >/dev/null 2>&1 & "
                          "(nohup sleep 30 >/dev/null 2>&1 &); echo started", timeout=10)
        assert r.stdout == "started\n" and r.duration < 5, r
        assert pool_processes() == []  # gone with the exec, not only after close
        r = await sb.exec("yes", timeout=1.5)
        assert r.timed_out and r.stdout_truncated and len(r.stdout) == 4096, r.exit_code
        assert_contained(hb)
      running = asyncio.ensure_future(sb.exec("sleep 30 & sleep 30", timeout=60))
      deadline = time.monotonic() + 10
      while len(pool_processes()) < 3:  # wait until it really runs (a loaded host is slow)
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    await asyncio.wait_for(running, 10)  # close() ended the exec in flight
    assert pool_processes() == []
    if isinstance(sb, BwrapSandbox):  # and released its mounts and cgroups
      assert sb.host_dir not in open("/proc/mounts").read()
      assert all(not os.path.exists(d) for d in (sb.cgroup.dirs.values() if sb.cgroup else ()))
  run(go())


def test_rlimit_fallback_without_cgroups():
  """cgroups=False: RLIMIT_NPROC on the dedicated uid still stops a fork bomb and RLIMIT_AS a
  single memory bomb (a forked memory bomb is the documented gap)."""
  async def go():
    async with await BwrapSandbox.create(LIMITS, cgroups=False, uids=TEST_UIDS) as sb:
      assert sb.cgroup is None
      with heartbeat() as hb:
        r = await sb.exec("bomb() { bomb | bomb & }; bomb; sleep 1; echo survived", timeout=3)
        r = await sb.exec("python3 -c \"s = 'x' * (512 << 20); print('survived')\"")
        assert "survived" not in r.stdout and r.exit_code != 0, r
        assert_contained(hb)
  run(go())


def test_requests_without_token_refused(server):
  live = server.request("GET", "/health")[1]["live"]
  for token in ["", "x" * 32, server.token.upper() if server.token.upper() != server.token
                else server.token + "0"]:
    status, body = server.request("POST", "/sandboxes", {}, token=token)
    assert status == 401, body
  assert server.request("GET", "/health")[1]["live"] == live

  async def go():
    with pytest.raises(SandboxError, match="token"):
      await create_sandbox("remote", url=server.url, token="not-the-token-0123456789")
    sb = await create_sandbox("remote", url=server.url, token=server.token)
    sb._client.token = "stolen-id-but-no-token-000000"  # knowing a sandbox id is not enough
    with pytest.raises(SandboxError, match="token"):
      await sb.exec("echo hi")
    sb._client.token = server.token
    await sb.close()
  run(go())
