"""A task root filesystem is untrusted content, and the seccomp filter's argument rules.

Every hostile root filesystem here is built so that a bind that followed one of its links on
the host would show the host to the sandbox: a canary file in the host's /tmp, a host process
with a unique argument, a host UNIX socket that listens. Each test asserts that the sandbox
reaches none of them, or that the root filesystem is refused before bwrap runs.

The fixtures live in a world-traversable directory under /tmp (not pytest's private tmp_path):
a bind by path from a directory the sandbox uid cannot traverse fails for lack of permission,
which would hide what a link does.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import os
import platform
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from envs.sandbox import create_sandbox, seccomp
from envs.sandbox.bwrap import BwrapSandbox
from tests.test_sandbox import LIMITS, TEST_UIDS

if os.geteuid() != 0:
  pytest.skip("the bwrap backend runs as root", allow_module_level=True)

SECRET = secrets.token_hex(16)


def run(coro):
  return asyncio.run(coro)


def py(code: str) -> str:
  """A shell command running `code` with the sandbox's python3."""
  return "python3 - <<'EOF'\n" + code + "\nEOF"


@pytest.fixture
def world():
  """A directory under /tmp that every uid may traverse, removed afterwards."""
  d = tempfile.mkdtemp(prefix="arbor-rootfs-test-", dir="/tmp")
  os.chmod(d, 0o755)
  try:
    yield d
  finally:
    shutil.rmtree(d, ignore_errors=True)


def make_rootfs(path: str, **links: str) -> str:
  """A merged-/usr root filesystem at `path` whose `usr` is an empty directory (the tests
  bind the host's /usr over it) plus the top-level links `links` (name -> target)."""
  os.makedirs(os.path.join(path, "usr"), mode=0o755)
  for name in ("bin", "sbin", "lib", "lib64"):
    os.symlink(f"usr/{name}", os.path.join(path, name))
  for name, target in links.items():
    os.symlink(target, os.path.join(path, name))
  return path


@pytest.fixture
def host(world):
  """What a sandbox must not reach on the host: a canary file in /tmp, a process whose argv
  holds a unique mark, and a listening UNIX socket any uid may connect to."""
  mark = "arbor-host-process-" + secrets.token_hex(6)
  canary = f"/tmp/arbor-canary-{secrets.token_hex(6)}"
  with open(os.open(canary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "w") as f:
    f.write(SECRET)
  os.chmod(canary, 0o644)
  sock_path = os.path.join(world, "host.sock")
  srv = socket.socket(socket.AF_UNIX)
  srv.bind(sock_path)
  os.chmod(sock_path, 0o777)
  srv.listen(8)
  proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", mark])
  try:
    probe = socket.socket(socket.AF_UNIX)  # control: reachable from the host
    probe.connect(sock_path)
    probe.close()
    deadline = time.monotonic() + 10  # control: the process shows its mark (once exec'd)
    while mark.encode() not in open(f"/proc/{proc.pid}/cmdline", "rb").read():
      assert time.monotonic() < deadline, "the host process never showed its mark"
      time.sleep(0.01)
    yield {"mark": mark, "canary": canary, "sock": sock_path}
  finally:
    proc.kill()
    proc.wait()
    srv.close()
    os.unlink(canary)


# Run inside the sandbox: looks for the host's canary, process and socket from the sandbox's
# root and from /etc (where a bind that followed `etc -> /` would put the host's root).
REACH = """
import json, os, socket
env = os.environ
out = {"canary": [], "procs": [], "socket": [], "etc": None}
if os.path.islink("/etc"):
  out["etc"] = os.readlink("/etc")
for root in ("", "/etc"):
  path = root + env["CANARY"]
  try:
    out["canary"].append(path + ": " + open(path).read())
  except OSError:
    pass
  try:
    pids = [p for p in os.listdir(root + "/proc") if p.isdigit()]
  except OSError:
    pids = []
  for pid in pids:
    try:
      if env["MARK"].encode() in open(f"{root}/proc/{pid}/cmdline", "rb").read():
        out["procs"].append(f"{root}/proc/{pid}")
    except OSError:
      pass
  s = socket.socket(socket.AF_UNIX)
  try:
    s.connect(root + env["SOCK"])
    out["socket"].append(root + env["SOCK"])
  except OSError:
    pass
  s.close()
# Open descriptors (the listing's own is closed again by the time they are checked).
out["fds"] = sorted(n for n in os.listdir("/proc/self/fd") if os.path.exists("/proc/self/fd/" + n))
print(json.dumps(out))
"""


@pytest.mark.parametrize("target", ["/", "/oldroot", "../../../../../../../.."])
def test_etc_linked_to_the_host_root_shows_nothing_of_the_host(world, host, target):
  """`etc` of the image points at the root (absolute, at bwrap's view of the host root while
  it sets up, or relative climbing out of the image): inside, the link is the sandbox's own
  and leads to the sandbox's own root, so no host file, process or socket is in reach."""
  root = make_rootfs(os.path.join(world, "rootfs"), etc=target)

  async def go():
    async with await create_sandbox("bwrap", limits=LIMITS, uids=TEST_UIDS, rootfs=root,
                                    ro_binds=[("/usr", "/usr")]) as sb:
      env = {"MARK": host["mark"], "CANARY": host["canary"], "SOCK": host["sock"]}
      r = await sb.exec(py(REACH), env=env)
      assert r.exit_code == 0, r
      return json.loads(r.stdout)

  got = run(go())
  assert got["canary"] == [] and got["procs"] == [] and got["socket"] == [], got
  assert got["etc"] == target, got  # the image's link, made again inside
  assert got["fds"] == ["0", "1", "2"], got  # no descriptor of the image's directories left


@pytest.mark.parametrize("where", [("opt",), ("usr", "local")])
def test_bind_destination_through_a_link_of_the_image_is_refused(world, where):
  """An extra bind whose sandbox path crosses a link of the image (at the top or in a bound
  directory) is refused: bwrap would follow the link while making the mount point, in a view
  where the host's root is still reachable, and create directories on the host."""
  root = os.path.join(world, "rootfs")
  os.makedirs(os.path.join(root, *where[:-1]), mode=0o755, exist_ok=True)
  os.symlink("/oldroot/tmp", os.path.join(root, *where))
  data = os.path.join(world, "data")
  os.mkdir(data, 0o755)
  name = "arbor-made-" + secrets.token_hex(6)
  made = os.path.join("/tmp", name)

  async def go():
    sb = await create_sandbox("bwrap", limits=LIMITS, uids=TEST_UIDS, rootfs=root,
                              ro_binds=[(data, "/" + "/".join(where) + "/" + name)])
    async with sb:
      await sb.exec("true")

  try:
    with pytest.raises(ValueError, match="link"):
      run(go())
    assert not os.path.lexists(made)
  finally:
    if os.path.isdir(made):
      os.rmdir(made)


def test_root_filesystem_reached_through_a_link_is_refused(world):
  """The root filesystem's path names a real directory: neither it nor any directory on the
  way to it may be a link."""
  real = make_rootfs(os.path.join(world, "real", "rootfs"))
  os.symlink(real, os.path.join(world, "image"))
  os.symlink(os.path.join(world, "real"), os.path.join(world, "images"))
  for path in (os.path.join(world, "image"), os.path.join(world, "images", "rootfs")):
    async def go():
      async with await create_sandbox("bwrap", limits=LIMITS, uids=TEST_UIDS, rootfs=path,
                                      ro_binds=[("/usr", "/usr")]) as sb:
        await sb.exec("true")
    with pytest.raises(ValueError, match="link"):
      run(go())
  async def works():  # control: the same image by its real path
    async with await create_sandbox("bwrap", limits=LIMITS, uids=TEST_UIDS, rootfs=real,
                                    ro_binds=[("/usr", "/usr")]) as sb:
      return await sb.exec("echo fine")
  r = run(works())
  assert r.stdout == "fine\n", r


def test_server_allow_list_refuses_a_root_filesystem_behind_a_link(world, capsys):
  """--rootfs DIR must be DIR itself, at start-up and at every request: a link at or above
  it (made before start-up, or swapped in later) is refused."""
  from envs import sandbox_server
  real = make_rootfs(os.path.join(world, "rootfs"))
  link = os.path.join(world, "image")
  os.symlink(real, link)
  with pytest.raises(SystemExit):
    sandbox_server.main(["--token_file", os.path.join(world, "no-token"),
                         "--rootfs", f"img={link}", "--uid_base", str(TEST_UIDS[0])])
  err = capsys.readouterr().err
  assert "--rootfs" in err and "link" in err, err
  with pytest.raises(ValueError, match="link"):
    sandbox_server.SandboxService("bwrap", max_sandboxes=1, limits=LIMITS,
                                  rootfs={"img": link})
  svc = sandbox_server.SandboxService("bwrap", max_sandboxes=1, limits=LIMITS,
                                      rootfs={"img": real})
  try:
    assert svc.check_rootfs("img") == "img"
    os.rename(real, real + ".moved")  # the allowed directory becomes a link to the host root
    os.symlink("/", real)
    with pytest.raises(sandbox_server.HTTPError, match="link") as e:
      svc.check_rootfs("img")
    assert e.value.status == 400
  finally:
    svc.stop()


# ---------------------------------------------------------------------------------------------
# seccomp: calls added to the deny list, and personality(2) limited to the default persona

NUMBERS = {  # written out here so that a wrong table in the code under test cannot hide
    "x86_64": {"memfd_secret": 447, "kcmp": 312, "pidfd_getfd": 438, "name_to_handle_at": 303,
               "open_by_handle_at": 304, "personality": 135},
    "aarch64": {"memfd_secret": 447, "kcmp": 272, "pidfd_getfd": 438, "name_to_handle_at": 264,
                "open_by_handle_at": 265, "personality": 92},
}
PER_LINUX32, ADDR_NO_RANDOMIZE, QUERY = 0x0008, 0x0040000, 0xFFFFFFFF
PERSONAS = {"PER_LINUX32": PER_LINUX32, "ADDR_NO_RANDOMIZE": ADDR_NO_RANDOMIZE,
            "high_bits+ADDR_NO_RANDOMIZE": (1 << 32) | ADDR_NO_RANDOMIZE,
            "high_bits": 1 << 32, "0xfffffffe": 0xFFFFFFFE}
# Each call with arguments the kernel itself answers without EPERM for an unprivileged caller
# (memfd_secret creates a descriptor or is not built in; kcmp compares the caller with itself;
# pidfd_getfd gets a bad descriptor; name_to_handle_at gets a zero-sized handle buffer).
SYSCALL_PROBE = """
import ctypes, errno, json, os
nr = {numbers!r}
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(name, *args):
  rc = libc.syscall(nr[name], *[ctypes.c_ulong(a) if isinstance(a, int) else a for a in args])
  return errno.errorcode.get(ctypes.get_errno(), "?") if rc < 0 else rc
handle = ctypes.create_string_buffer(64)  # struct file_handle with handle_bytes = 0
mount_id = ctypes.c_int()
out = {{
  "memfd_secret": call("memfd_secret", 0),
  "kcmp": call("kcmp", os.getpid(), os.getpid(), 1, 0, 0),
  "pidfd_getfd": call("pidfd_getfd", 2**32 - 1, 0, 0),
  "name_to_handle_at": call("name_to_handle_at", 2**64 - 100, ctypes.c_char_p(b"/"), handle,
                            ctypes.byref(mount_id), 0),
  "open_by_handle_at": call("open_by_handle_at", 2**64 - 100, handle, 0),
  "query_before": call("personality", {query}),
  "set_default": call("personality", 0),
}}
for label, value in {personas!r}.items():
  out["personality:" + label] = call("personality", value)
out["query_after"] = call("personality", {query})
print(json.dumps(out))
"""


def syscall_probe() -> str:
  machine = platform.machine()
  if machine not in NUMBERS:
    pytest.skip(f"syscall numbers of {machine} are not in this test")
  return py(SYSCALL_PROBE.format(numbers=NUMBERS[machine], query=QUERY, personas=PERSONAS))


def test_seccomp_denies_handle_and_process_comparison_calls():
  """memfd_secret, kcmp, pidfd_getfd, name_to_handle_at and open_by_handle_at fail with EPERM
  under the filter; without it the kernel answers otherwise (so EPERM comes from the filter)."""
  calls = ("memfd_secret", "kcmp", "pidfd_getfd", "name_to_handle_at", "open_by_handle_at")

  async def go(flt: bool) -> dict:
    async with await BwrapSandbox.create(LIMITS, uids=TEST_UIDS, seccomp_filter=flt) as sb:
      r = await sb.exec(syscall_probe())
      assert r.exit_code == 0, r
      return json.loads(r.stdout)

  got = run(go(True))
  assert {c: got[c] for c in calls} == {c: "EPERM" for c in calls}, got
  free = run(go(False))
  assert all(free[c] != "EPERM" for c in calls if c != "open_by_handle_at"), free
  assert set(calls) - {"personality"} <= set(seccomp.denied_syscalls())


def test_persona_rules_deny_every_value_but_the_allowed_two():
  """The deny rules on personality's argument, evaluated as the kernel filter does (any rule
  that matches denies), match every 64-bit value except 0 and 0xffffffff."""
  rules = seccomp.persona_rules()
  ops = {5: lambda v, a, b: v >= a, 7: lambda v, a, b: v & a == b}  # SCMP_CMP_GE, MASKED_EQ

  def denied(v: int) -> bool:
    return any(ops[op](v, a, b) for _arg, op, a, b in rules)

  values = {0, 1, 2, 8, 0x20000, 0x40000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF,
            1 << 32, (1 << 32) | 0x40000, (1 << 64) - 1, 0xFFFFFFFF_00000000}
  values |= {1 << i for i in range(64)} | {0xFFFFFFFF ^ (1 << i) for i in range(32)}
  values |= {secrets.randbits(bits) for bits in (8, 16, 32, 64) for _ in range(2000)}
  wrong = sorted(v for v in values if denied(v) != (v not in (0, 0xFFFFFFFF)))
  assert wrong == [], [hex(v) for v in wrong[:10]]
  assert all(arg == 0 for arg, *_ in rules)


def test_seccomp_keeps_the_default_persona_only():
  """personality(2) answers the query (0xffffffff) and sets the default persona (0); every
  other value, including ones whose upper 32 bits the kernel would drop, fails with EPERM
  and leaves the persona as it was."""
  async def go() -> dict:
    async with await BwrapSandbox.create(LIMITS, uids=TEST_UIDS) as sb:
      r = await sb.exec(syscall_probe())
      assert r.exit_code == 0, r
      return json.loads(r.stdout)

  got = run(go())
  assert got["query_before"] == 0 and got["set_default"] == 0, got
  assert {k: v for k, v in got.items() if k.startswith("personality:")} == {
      "personality:" + label: "EPERM" for label in PERSONAS}, got
  assert got["query_after"] == 0, got
  prof = seccomp.docker_profile(inet=True)  # the Docker profile carries the same rule
  assert any(rule["names"] == ["personality"] for rule in prof["syscalls"]), prof
