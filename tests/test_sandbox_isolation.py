"""Isolation of the hardened backends (bwrap, remote = the sandbox server over loopback backed
by bwrap, and docker on the local engine), run as root as our machines are.

Every check is phrased so that it fails if the protection is missing: the sandbox tries the
escape and the test asserts that it did not work (and, where it can, that the same action
works from the host, so a broken probe cannot pass by accident)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import errno
import glob
import os
import secrets
import platform
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest

from envs.sandbox import Limits, PathError, SandboxError, create_sandbox, seccomp
from envs.sandbox.bwrap import BASE_ENV, BwrapSandbox
from envs.sandbox.docker import DockerSandbox
from tests.test_sandbox import REPO, TEST_UIDS, docker_kw, pool_processes, start_server

if os.geteuid() != 0:  # the threat model is "the host runs as root"
  pytest.skip("isolation suite runs as root (bwrap backend needs it)", allow_module_level=True)

# Canaries the sandbox must not see: set before the server (a child) starts so it inherits them.
CANARY_ENV = "ARBOR_CANARY_" + secrets.token_hex(4).upper()
CANARY_VALUE = secrets.token_hex(12)
os.environ[CANARY_ENV] = CANARY_VALUE
SECRET = secrets.token_hex(16)
KEY_DESC = "arbor-canary-key-" + secrets.token_hex(4)
_libc = ctypes.CDLL(None, use_errno=True)
KEY_SPEC_SESSION_KEYRING, KEYCTL_SEARCH, KEYCTL_INVALIDATE = -3, 10, 21
LIMITS = Limits(memory_mb=64, pids=32, cpus=0.25, disk_mb=4, output_bytes=4096,
                default_timeout=10)


def add_session_key(desc: str, payload: bytes) -> int:
  """add_key("user", desc, payload, @s) through libc's syscall(2) (x86_64 number 248)."""
  nr = {"x86_64": 248, "aarch64": 217}[platform.machine()]
  key = _libc.syscall(nr, b"user", desc.encode(), payload, len(payload),
                      KEY_SPEC_SESSION_KEYRING)
  assert key > 0, os.strerror(ctypes.get_errno())
  return key


# Looks up KEY_DESC from the caller's session keyring; prints the key id, or the errno name.
FIND_KEY = f"""
import ctypes, errno, os, platform
libc = ctypes.CDLL(None, use_errno=True)
nr = {{"x86_64": 250, "aarch64": 219}}[platform.machine()]  # keyctl
key = libc.syscall(nr, {KEYCTL_SEARCH}, {KEY_SPEC_SESSION_KEYRING}, b"user", b"{KEY_DESC}", 0)
print("found", key) if key > 0 else print(errno.errorcode[ctypes.get_errno()])
"""


@pytest.fixture(scope="module")
def canaries(tmp_path_factory):
  """A secret in our tmp dir, a 0600 root file in /etc, an inheritable open fd, and a key in
  this process's session keyring (before the server starts, so that it inherits it too)."""
  if platform.machine() not in ("x86_64", "aarch64"):
    pytest.skip(f"syscall numbers of {platform.machine()} not in the tests")
  key = add_session_key(KEY_DESC, SECRET.encode())
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
    _libc.syscall({"x86_64": 250, "aarch64": 219}[platform.machine()], KEYCTL_INVALIDATE, key)


@pytest.fixture(scope="module")
def server(tmp_path_factory, canaries):
  s = start_server(str(tmp_path_factory.mktemp("iso-server")), "--max_sandboxes", "8",
                   pass_fds=[canaries["fd"]])
  yield s
  assert s.stop() == 0


@pytest.fixture(params=["bwrap", "remote", "docker"])
def make(request, canaries):
  if request.param == "docker":
    kw = docker_kw()

    async def make_docker(limits=LIMITS):
      sb = await create_sandbox("docker", limits=limits, **kw)
      sb.resident = docker_resident(sb)
      return sb
    return make_docker
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


def docker_resident(sb) -> set[int]:
  """Host pids of a new docker sandbox's own processes: Docker's init and its one child, the
  container's main process (the only processes a docker sandbox keeps between commands)."""
  sb._container.reload()
  init = sb._container.attrs["State"]["Pid"]
  deadline = time.monotonic() + 10
  while not (children := open(f"/proc/{init}/task/{init}/children").read().split()):
    assert time.monotonic() < deadline, "the container's main process never started"
    time.sleep(0.01)
  assert len(children) == 1, children
  return {init, int(children[0])}


def leftovers(sb=None) -> list[int]:
  """`pool_processes()` but the ones a docker sandbox `sb` keeps between commands."""
  return [p for p in pool_processes() if p not in getattr(sb, "resident", ())]


def host_path(sb, name: str) -> str:
  """Where workspace file `name` of sandbox `sb` lives on the host (bwrap: its own tmpfs;
  docker: the container's, seen through its init's root; remote: the server's, found by its
  unique name)."""
  if isinstance(sb, BwrapSandbox):
    return os.path.join(sb.workspace, name)
  if isinstance(sb, DockerSandbox):
    return f"/proc/{sb._container.attrs['State']['Pid']}/root/workspace/{name}"
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
      for d in ("/root", "/work"):
        r = await sb.exec(f"ls -A {d}")
        assert r.exit_code != 0 and r.stdout == "", r
      r = await sb.exec("ls -A /home")  # bwrap: none; docker: the image's, empty
      assert r.stdout == "" and (r.exit_code == 0) == isinstance(sb, DockerSandbox), r
      r = await sb.exec(f"ls -l {canaries['root_file']}")  # the host's /etc is not in view
      assert r.exit_code != 0 and r.stdout == "", r
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


def assert_contained(hb, sb=None):
  # A bomb that dies at once (no fork left for `sleep`) returns in milliseconds: keep measuring
  # for at least 20 beats, so leftovers that still hog the CPU would show in the latency.
  deadline = time.monotonic() + 5
  while hb["beats"] < 20 and time.monotonic() < deadline:
    time.sleep(0.01)
  # 0.5 s: a leftover process hogging the CPU stalls the loop for seconds; a loaded 2-core
  # machine alone (pytest -n 2 next to the sandboxes) stalls it for ~0.2 s now and then
  assert hb["beats"] >= 20 and hb["max"] < 0.5, hb
  assert leftovers(sb) == [], "sandbox processes outlived the exec"


def test_fork_bomb(make):
  async def go():
    async with await make() as sb:
      with heartbeat() as hb:
        r = await sb.exec("bomb() { bomb | bomb & }; bomb; sleep 1.5; echo survived", timeout=3)
        assert_contained(hb, sb)
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
        assert_contained(hb, sb)
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
        assert_contained(hb, sb)
  run(go())


def test_setsid_daemon_and_unbounded_output(make):
  async def go():
    sb = await make()
    async with sb:
      with heartbeat() as hb:
        r = await sb.exec("setsid sh -c 'sleep 30' >/dev/null 2>&1 & "
                          "(nohup sleep 30 >/dev/null 2>&1 &); echo started", timeout=10)
        assert r.stdout == "started\n" and r.duration < 5, r
        assert leftovers(sb) == []  # gone with the exec, not only after close
        r = await sb.exec("yes", timeout=1.5)
        assert r.timed_out and r.stdout_truncated and r.stdout_bytes > 4096, r.exit_code
        assert r.stdout.startswith("y\n" * 1024) and r.stdout.endswith("y\n")
        assert_contained(hb, sb)
      running = asyncio.ensure_future(sb.exec("sleep 30 & sleep 30", timeout=60))
      deadline = time.monotonic() + 10
      while len(leftovers(sb)) < 3:  # wait until it really runs (a loaded host is slow)
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
  single memory bomb (a forked memory bomb is the documented gap). bwrap only: a Docker
  container always has its cgroup limits."""
  async def go():
    async with await BwrapSandbox.create(LIMITS, cgroups=False, uids=TEST_UIDS) as sb:
      assert sb.cgroup is None
      with heartbeat() as hb:
        r = await sb.exec("bomb() { bomb | bomb & }; bomb; sleep 1; echo survived", timeout=3)
        r = await sb.exec("python3 -c \"s = 'x' * (512 << 20); print('survived')\"")
        assert "survived" not in r.stdout and r.exit_code != 0, r
        assert_contained(hb, sb)
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


# --- kernel keyring, seccomp, /etc ----------------------------------------------------------

def test_keyring_of_the_starter_not_reachable(make, canaries):
  host = subprocess.run([sys.executable, "-c", FIND_KEY], capture_output=True, text=True)
  assert host.stdout.startswith("found"), host  # a child of ours finds the planted key

  async def go():
    async with await make() as sb:
      r = await sb.exec(py(FIND_KEY) + "\ncat /proc/keys")
      assert r.stdout.startswith("EPERM"), r  # seccomp: keyctl is denied
      assert KEY_DESC not in r.stdout and SECRET not in r.stdout, r.stdout
  run(go())


def test_fresh_session_keyring_per_exec_without_seccomp(canaries):
  """The keyring layer on its own (filter off): the planted key is out of reach, and a key that
  one exec adds is gone for the next exec and for another sandbox. bwrap only: its per-exec
  keyring launcher; Docker gives each container its own session keyring."""
  add = f"""
import ctypes, errno, os, platform
libc = ctypes.CDLL(None, use_errno=True)
nr = {{"x86_64": 248, "aarch64": 217}}[platform.machine()]  # add_key
key = libc.syscall(nr, b"user", b"{KEY_DESC}", b"from-a", 6, {KEY_SPEC_SESSION_KEYRING})
print("added", key) if key > 0 else print(errno.errorcode[ctypes.get_errno()])
"""

  async def go():
    kw = dict(uids=TEST_UIDS, seccomp_filter=False)
    async with await BwrapSandbox.create(LIMITS, **kw) as a, \
        await BwrapSandbox.create(LIMITS, **kw) as b:
      r = await a.exec(py(FIND_KEY))
      assert r.stdout.startswith("ENOKEY"), r  # keyctl works, the key is not there
      r = await a.exec(py(add) + "\n" + py(FIND_KEY))
      assert r.stdout.startswith("added") and "found" in r.stdout, r  # the probe can succeed
      assert (await a.exec(py(FIND_KEY))).stdout.startswith("ENOKEY")  # next exec: fresh
      assert (await b.exec(py(FIND_KEY))).stdout.startswith("ENOKEY")  # other sandbox
  run(go())


# x86_64 numbers, written out here so that a wrong table in the code under test cannot hide.
X86_64 = {"add_key": 248, "request_key": 249, "keyctl": 250, "io_uring_setup": 425,
          "io_uring_enter": 426, "io_uring_register": 427, "bpf": 321, "userfaultfd": 323,
          "perf_event_open": 298, "ptrace": 101, "process_vm_readv": 310,
          "process_vm_writev": 311, "init_module": 175, "finit_module": 313,
          "delete_module": 176, "kexec_load": 246, "kexec_file_load": 320, "reboot": 169,
          "swapon": 167, "swapoff": 168, "acct": 163, "clock_settime": 227,
          "clock_adjtime": 305, "settimeofday": 164, "adjtimex": 159, "mount": 165,
          "umount2": 166, "pivot_root": 155, "move_mount": 429, "open_tree": 428, "fsopen": 430,
          "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
          "open_by_handle_at": 304, "name_to_handle_at": 303, "kcmp": 312, "pidfd_getfd": 438,
          "memfd_secret": 447}
# Harmless arguments that fail (or do nothing) without the filter, for an unprivileged caller.
ARGS = {"keyctl": (0, KEY_SPEC_SESSION_KEYRING, 0), "userfaultfd": (1,), "io_uring_setup": (1, 0),
        "io_uring_enter": (-1, 0, 0, 0, 0, 0), "io_uring_register": (-1, 0, 0, 0),
        "ptrace": (3, 999999, 0, 0), "process_vm_readv": (999999, 0, 0, 0, 0, 0),
        "process_vm_writev": (999999, 0, 0, 0, 0, 0), "perf_event_open": (0, 0, -1, -1, 0)}
# Where the kernel itself answers something other than EPERM to the call above: with the
# filter on, EPERM there can only come from the filter.
NOT_EPERM_UNFILTERED = {"add_key", "request_key", "keyctl", "io_uring_setup", "io_uring_enter",
                        "io_uring_register", "userfaultfd", "perf_event_open", "ptrace",
                        "process_vm_readv", "process_vm_writev", "clock_settime",
                        "clock_adjtime", "adjtimex", "socket:AF_NETLINK",
                        "socket:AF_INET"}
FAMILIES = {"AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16, "AF_PACKET": 17, "AF_VSOCK": 40,
            "AF_ALG": 38, "AF_UNIX": 1}
PROBE = f"""
import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
out = {{}}
for name, nr in {X86_64!r}.items():
  args = {ARGS!r}.get(name, (0, 0, 0, 0, 0))
  rc = libc.syscall(nr, *[ctypes.c_long(a) for a in args])
  out[name] = errno.errorcode.get(ctypes.get_errno(), "?") if rc < 0 else "ok"
for fam, v in {FAMILIES!r}.items():
  rc = libc.syscall(41, v, 2 if fam not in ("AF_NETLINK", "AF_PACKET") else 3, 0)
  out["socket:" + fam] = errno.errorcode.get(ctypes.get_errno(), "?") if rc < 0 else "ok"
print(json.dumps(out))
"""


def probe(r) -> dict:
  assert r.exit_code == 0, r
  return __import__("json").loads(r.stdout)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="syscall numbers are x86_64's")
def test_seccomp_denies_each_call_with_eperm(make, monkeypatch):
  assert set(X86_64) == set(seccomp.denied_syscalls())  # the probe covers the whole list

  async def go():
    async with await make() as sb:
      got = probe(await sb.exec(py(PROBE)))
    denied = {k: v for k, v in got.items() if k != "socket:AF_UNIX" and k != "socket:AF_INET"
              and k != "socket:AF_INET6"}
    assert all(v == "EPERM" for v in denied.values()), denied
    assert got["socket:AF_UNIX"] == "ok" and got["socket:AF_INET"] == "ok", got  # loopback
    async with await make() as sb:  # the x32 ABI's keyctl (x86_64 + 0x40000000): killed
      r = await sb.exec("python3 -c 'import ctypes; ctypes.CDLL(None).syscall(0x40000000 | 250, "
                        "0, -3, 0); print(\"survived\")'; echo rc=$?")
      assert "survived" not in r.stdout and "rc=159" in r.stdout, r  # 128 + SIGSYS
    free = None
    if isinstance(sb, BwrapSandbox):  # control: the same probe without the filter
      async with await BwrapSandbox.create(LIMITS, uids=TEST_UIDS, seccomp_filter=False) as c:
        free = probe(await c.exec(py(PROBE)))
    elif isinstance(sb, DockerSandbox):  # control: the same container with no profile at all
      monkeypatch.setattr(seccomp, "docker_security_opt",
                          lambda inet: ["no-new-privileges", "seccomp=unconfined"])
      async with await make() as c:
        free = probe(await c.exec(py(PROBE)))
    if free is not None:
      differs = {k for k, v in free.items() if v != "EPERM"}
      expect = set(NOT_EPERM_UNFILTERED)
      with contextlib.suppress(OSError):  # a host that disables io_uring answers EPERM itself
        if open("/proc/sys/kernel/io_uring_disabled").read().strip() != "0":
          expect -= {"io_uring_setup", "io_uring_enter", "io_uring_register"}
      assert expect <= differs, free
  run(go())


@pytest.mark.skipif(platform.machine() != "x86_64", reason="syscall numbers are x86_64's")
def test_seccomp_network_none_denies_inet():
  """bwrap only: its network="none" policy (docker sandboxes keep their own loopback)."""
  async def go():
    async with await BwrapSandbox.create(LIMITS, uids=TEST_UIDS, network="none") as sb:
      got = probe(await sb.exec(py(PROBE)))
      assert got["socket:AF_INET"] == got["socket:AF_INET6"] == "EPERM", got
      assert got["socket:AF_UNIX"] == "ok", got
      r = await sb.exec(py("import socket; a, b = socket.socketpair(); a.send(b'x'); "
                           "print(b.recv(1))"))  # what asyncio and multiprocessing use
      assert r.stdout == "b'x'\n", r
    with pytest.raises(ValueError, match="network='wifi'"):
      await BwrapSandbox.create(LIMITS, uids=TEST_UIDS, network="wifi")
  run(go())


def test_minimal_etc(make, canaries):
  token = f"/etc/arbor-token-{secrets.token_hex(4)}"  # world-readable, as in a careless setup
  with open(token, "w") as f:
    f.write(SECRET)
  os.chmod(token, 0o644)
  host_etc = set(os.listdir("/etc"))

  async def go():
    async with await make() as sb:
      if isinstance(sb, DockerSandbox):
        await docker_etc(sb, canaries["root_file"], token)
        return
      r = await sb.exec("ls -A /etc; echo ---; id -un; id -gn; getent passwd $(id -u); "
                        "cat /etc/hosts; ls /etc/ssl; hostname")
      assert r.exit_code == 0, r
      listing, rest = r.stdout.split("---\n")
      names = set(listing.split())
      assert "passwd" in names and "ld.so.cache" in names, names
      for gone in ("shadow", "gshadow", "sudoers", "machine-id", "ssh", "apt", "environment",
                   "resolv.conf", "ca-certificates", os.path.basename(canaries["root_file"]),
                   os.path.basename(token)):
        assert gone not in names, gone
      assert len(names) < len(host_etc) / 2, names
      user, group, pw, *hosts = rest.splitlines()
      assert user == group == "sandbox", rest
      assert pw.split(":")[0] == "sandbox" and pw.split(":")[5] == "/tmp", pw
      assert not any(l.startswith("127.0.0.1") and "sandbox" not in l and "localhost" not in l
                     for l in hosts), hosts  # not the host's own names
      assert "openssl.cnf" in hosts and "private" not in hosts and "certs" not in hosts, hosts
      r = await sb.exec(py("import ssl, sqlite3, pytest, locale, getpass, pwd, os, time\n"
                           "print(getpass.getuser(), pwd.getpwuid(os.getuid()).pw_name, "
                           "time.tzname[0] != '')"))
      assert r.exit_code == 0 and r.stdout == "sandbox sandbox True\n", r
      r = await sb.exec(f"cat {token}; for d in /*; do case $d in /usr|/proc|/sys|/dev|/bin|"
                        f"/sbin|/lib*) ;; *) grep -rs {SECRET} $d;; esac; done 2>/dev/null")
      assert SECRET not in r.stdout, r
  try:
    run(go())
  finally:
    os.unlink(token)


async def docker_etc(sb, root_file: str, token: str) -> None:
  """Docker's version of the /etc contract: the image's /etc, plus only the few files Docker
  adds (hosts, hostname, resolv.conf, the mtab link), none of them the host's."""
  from envs.environments import debian
  image_etc = set(os.listdir(os.path.join(debian.rootfs(packages=("python3-pytest",)), "etc")))
  r = await sb.exec("ls -A /etc; echo ---; cat /etc/hosts /etc/resolv.conf")
  assert r.exit_code == 0, r
  listing, rest = r.stdout.split("---\n")
  names = set(listing.split())
  assert names - image_etc <= {"hosts", "hostname", "resolv.conf", "mtab"}, names - image_etc
  assert image_etc <= names and "passwd" in names
  assert os.path.basename(root_file) not in names and os.path.basename(token) not in names
  hosts = rest.splitlines()
  assert not any(l.startswith("127.0.0.1") and "localhost" not in l for l in hosts), hosts
  host_dns = [l for l in open("/etc/resolv.conf") if l.startswith("nameserver")]
  assert "nameserver 127.0.0.1" in hosts and not set(host_dns) & set(hosts), hosts
  assert (await sb.exec("cat /etc/shadow")).exit_code != 0  # the image's, root's only
  r = await sb.exec(py("import ssl, sqlite3, pytest, locale, os, time\n"
                       "print(os.getuid() != 0, time.tzname[0] != '')"))
  assert r.exit_code == 0 and r.stdout == "True True\n", r
  r = await sb.exec(f"cat {token}; for d in /*; do case $d in /usr|/proc|/sys|/dev|/bin|"
                    f"/sbin|/lib*) ;; *) grep -rs {SECRET} $d;; esac; done 2>/dev/null")
  assert SECRET not in r.stdout, r


def test_docker_profile_and_options():
  prof = seccomp.docker_profile(inet=True)
  assert prof["defaultAction"] == "SCMP_ACT_ALLOW"
  names = {n for rule in prof["syscalls"] if "args" not in rule for n in rule["names"]}
  assert set(X86_64) <= names and {"unshare", "setns"} <= names
  assert all(rule["action"] == "SCMP_ACT_ERRNO" and rule["errnoRet"] == errno.EPERM
             for rule in prof["syscalls"])
  fams = {a["value"]: a["op"] for rule in prof["syscalls"] if "args" in rule
          for a in rule["args"]}
  for name, v in FAMILIES.items():
    denied = fams.get(v) == "SCMP_CMP_EQ" or v >= min(
        k for k, op in fams.items() if op == "SCMP_CMP_GE")
    assert denied == (name not in ("AF_UNIX", "AF_INET", "AF_INET6")), (name, fams)
  none = {a["value"] for rule in seccomp.docker_profile(inet=False)["syscalls"]
          if "args" in rule for a in rule["args"]}
  assert {2, 10} <= none
  opts = seccomp.docker_security_opt(inet=True)
  assert opts[0] == "no-new-privileges" and opts[1].startswith("seccomp={")


def test_docker_container_gets_profile():
  """The container's options as the engine recorded them."""
  async def go():
    async with await create_sandbox("docker", limits=LIMITS, **docker_kw()) as sb:
      sb._container.reload()
      host, config = sb._container.attrs["HostConfig"], sb._container.attrs["Config"]
    opts = host["SecurityOpt"]
    assert "no-new-privileges" in opts and host["CapDrop"] == ["ALL"], host
    prof = __import__("json").loads(next(o for o in opts if o.startswith("seccomp="))[8:])
    assert prof == seccomp.docker_profile(inet=True)
    assert host["NetworkMode"] == "none" and host["ReadonlyRootfs"] and not host["Privileged"]
    assert config["User"].split(":")[0] not in ("", "0", "root"), config["User"]
    assert (host["Memory"], host["MemorySwap"], host["PidsLimit"], host["NanoCpus"]) == (
        LIMITS.memory_mb << 20, LIMITS.memory_mb << 20, LIMITS.pids, int(LIMITS.cpus * 1e9))
    assert "size=4m" in host["Tmpfs"]["/workspace"] and "ro" in host["Tmpfs"]["/dev/mqueue"]
  run(go())


def test_deep_and_wide_trees_listed_or_refused(make):
  """A 1,500-level tree is refused with a clear error (not RecursionError, not a 500), a
  shallower one is listed exactly as the sandbox's own `find` sees it."""
  async def go():
    async with await make(dataclasses.replace(LIMITS, disk_mb=8)) as sb:  # 2,048 inodes
      r = await sb.exec(py("""
import os
os.makedirs("/".join(["d"] * 100))
open("/".join(["d"] * 100 + ["f.txt"]), "w").close()
open("top.txt", "w").close()
os.mkdir("deep"); os.chdir("deep")
for i in range(1500):  # relative steps: the whole path would pass PATH_MAX
  os.mkdir("a"); os.chdir("a")
open("bottom.txt", "w").close()
"""))
      assert r.exit_code == 0, r
      find = await sb.exec("find d top.txt -type f | sort")
      assert await sb.list_files("d") + await sb.list_files("top.txt") == \
          find.stdout.split(), find
      with pytest.raises(ValueError, match="max_depth=256"):
        await sb.list_files(".")
      assert len(await sb.list_files("d")) == 1  # the sandbox still works
  run(go())


def test_list_files_entry_cap(tmp_path):
  from envs.sandbox import hostfs
  for i in range(4):
    (tmp_path / f"s{i}").mkdir()
    (tmp_path / f"s{i}" / "f").write_text("x")
  assert hostfs.list_files(str(tmp_path)) == [f"s{i}/f" for i in range(4)]
  assert hostfs.list_files(str(tmp_path), max_entries=8) == [f"s{i}/f" for i in range(4)]
  with pytest.raises(ValueError, match="max_entries=7"):
    hostfs.list_files(str(tmp_path), max_entries=7)
  with pytest.raises(ValueError, match="max_depth=0"):
    hostfs.list_files(str(tmp_path), max_depth=0)
  before = len(os.listdir("/proc/self/fd"))
  for cap in (1, 3, 7, 100):
    with contextlib.suppress(ValueError):
      hostfs.list_files(str(tmp_path), max_entries=cap)
  assert len(os.listdir("/proc/self/fd")) == before
