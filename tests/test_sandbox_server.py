"""Sandbox server front: idle, slow and flooding clients, request parsing limits, flag names.

The HTTP contract itself (auth, capacity, ttl, warm pool, TLS) is in tests/test_sandbox.py."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import random
import shutil
import socket
import ssl
import subprocess
import sys
import time

import pytest

from envs.environments import build
from envs.environments.spec import Environment
from envs.episode import make_sandbox_factory
from envs.sandbox import Limits, create_sandbox
from envs.tasks import Task
from envs.sandbox_server import MAX_JSON_DEPTH, HTTPError, parse_body
from tests.test_sandbox import REPO, docker_kw, pool_processes, start_server


def run(coro):
  return asyncio.run(coro)


def closed_by_server(sock: socket.socket, within: float) -> bool:
  """Whether the server closes `sock` (EOF or reset) within `within` seconds."""
  sock.settimeout(within)
  try:
    while True:
      data = sock.recv(65536)
      if not data:
        return True
  except (ConnectionResetError, ssl.SSLError):
    return True
  except socket.timeout:
    return False


def health(sock: socket.socket, token: str) -> int:
  """Sends GET /health on an open connection and reads the whole reply; its status."""
  sock.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n"
               .encode())
  data = b""
  while b"\r\n\r\n" not in data:
    data += sock.recv(65536)
  head, _, body = data.partition(b"\r\n\r\n")
  length = int(next(l.split(b":")[1] for l in head.split(b"\r\n")
                    if l.lower().startswith(b"content-length:")))
  while len(body) < length:
    body += sock.recv(65536)
  return int(head.split(b" ")[1])


def connect(url: str) -> socket.socket:
  host, port = url.rsplit("/", 1)[1].split(":")
  return socket.create_connection((host, int(port)), timeout=10)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  s = start_server(str(tmp_path_factory.mktemp("front")), "--max_sandboxes", "2",
                   "--max_connections", "24", "--header_timeout", "1", "--body_timeout", "1",
                   "--keep_alive", "30", "--max_request_bytes", "1000000")
  yield s
  assert s.stop() == 0


def test_parse_body_depth_limit():
  def nested(depth: int) -> bytes:  # `depth` containers, alternating objects and arrays
    v = 0
    for i in range(depth - 1):
      v = {"k": v} if i % 2 else [v]
    return json.dumps({"x": v}).encode()
  assert parse_body(nested(MAX_JSON_DEPTH))["x"] is not None
  for depth in (MAX_JSON_DEPTH + 1, 5000):
    with pytest.raises(HTTPError, match=f"max_json_depth={MAX_JSON_DEPTH}") as e:
      parse_body(nested(depth) if depth < 1000 else b"[" * 100_000 + b"]" * 100_000)
    assert e.value.status == 400
  assert parse_body(b"") == {}
  with pytest.raises(HTTPError, match="JSON object"):
    parse_body(b"[1]")


def test_deep_json_body_is_a_400(server):
  for raw in (b'{"limits": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
              b'{"a": ' + b'{"a": ' * 40 + b"1" + b"}" * 41):
    status, body = server.request("POST", "/sandboxes", raw=raw)
    assert status == 400 and "max_json_depth" in body["error"], body
  assert server.request("GET", "/health")[0] == 200


def test_silent_and_slow_header_connections_are_closed(server):
  silent = connect(server.url)
  slow = connect(server.url)
  slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the rest
  t0 = time.monotonic()
  assert closed_by_server(silent, 5) and closed_by_server(slow, 5)
  assert 0.5 < time.monotonic() - t0 < 5  # --header_timeout 1, not at once, not never
  # a keep-alive connection that sent a complete request gets the same deadline for the next
  ka = connect(server.url)
  assert health(ka, server.token) == 200
  ka.sendall(b"GET /health HTTP/1.1\r\n")
  assert closed_by_server(ka, 5)


def test_slow_body_gets_408(server):
  sock = connect(server.url)
  sock.sendall(f"POST /sandboxes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.token}\r\n"
               f"Content-Length: 100\r\n\r\n{{\"limits\"".encode())
  sock.settimeout(5)
  reply = b""
  while chunk := sock.recv(65536):  # the server closes the connection after the reply
    reply += chunk
  assert b" 408 " in reply.split(b"\r\n")[0] and b"body_timeout=1.0" in reply


def test_flood_of_idle_connections_does_not_starve_clients(server):
  """60 idle tokenless sockets against --max_connections 24: the oldest idle ones are closed,
  an authenticated keep-alive connection outlives the tokenless ones, real calls go through."""
  keep = connect(server.url)
  assert health(keep, server.token) == 200
  flood = [connect(server.url) for _ in range(60)]
  time.sleep(0.3)
  closed = sum(closed_by_server(s, 0.01) for s in flood)
  assert closed >= 60 - 24  # at most max_connections stay open

  async def go():
    async with await create_sandbox("remote", url=server.url, token=server.token) as sb:
      assert (await sb.exec("echo through")).stdout == "through\n"
  run(go())
  assert health(keep, server.token) == 200  # the authenticated one survived
  for s in flood + [keep]:
    s.close()


def test_old_flag_spellings_still_work(tmp_path):
  s = start_server(str(tmp_path), "--max-sandboxes", "1", "--max-connections", "8",
                   "--header-timeout", "2")
  try:
    status, body = s.request("GET", "/health")
    assert status == 200 and body["max_sandboxes"] == 1
  finally:
    assert s.stop() == 0


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI absent (makes the cert)")
def test_tls_handshake_deadline(tmp_path):
  cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
  subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                  "-subj", "/CN=localhost", "-keyout", key, "-out", cert], check=True,
                 capture_output=True, timeout=60)
  s = start_server(str(tmp_path), "--tls_cert", cert, "--tls_key", key, "--max_sandboxes", "1",
                   "--handshake_timeout", "1")
  try:
    stalled = connect(s.url)  # TCP only: never starts the handshake
    half = connect(s.url)
    half.sendall(b"\x16\x03\x01\x00\x05")  # a ClientHello record header, then nothing
    t0 = time.monotonic()
    assert closed_by_server(stalled, 6) and closed_by_server(half, 6)
    assert 0.5 < time.monotonic() - t0 < 6
  finally:
    assert s.stop() == 0


_CRASH_BASE = 2_003_000_000 + random.randrange(64) * 16  # apart from tests/test_sandbox.py's
CRASH_UIDS = range(_CRASH_BASE, _CRASH_BASE + 8)


def mounts_under(prefix: str) -> list[str]:
  with open("/proc/self/mountinfo") as f:
    return [l.split()[4] for l in f if l.split()[4].startswith(prefix)]


def cgroup_dirs(name: str) -> list[str]:
  return [d for d in glob.glob(f"/sys/fs/cgroup/**/{name}", recursive=True) if os.path.isdir(d)]


def own_cgroup(pid, controller: str) -> str:
  with open(f"/proc/{pid}/cgroup") as f:
    for line in f:
      _, names, path = line.rstrip("\n").split(":", 2)
      if controller in names.split(",") or (controller == "" and names == ""):
        return path
  raise AssertionError(f"no {controller!r} line in /proc/{pid}/cgroup")


def test_sandbox_cgroups_nest_under_the_servers_own(tmp_path):
  s = start_server(str(tmp_path), "--max_sandboxes", "1", "--uid_base", str(CRASH_UIDS[0]),
                   "--uid_count", str(len(CRASH_UIDS)))
  try:
    async def go():
      async with await create_sandbox("remote", url=s.url, token=s.token) as sb:
        uid = int((await sb.exec("id -u")).stdout)
        running = asyncio.ensure_future(sb.exec("sleep 3"))
        deadline = time.monotonic() + 3
        while not (pids := pool_processes([CRASH_UIDS], zombies=False)):
          assert time.monotonic() < deadline, "the exec never showed up"
          await asyncio.sleep(0.02)
        v2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
        controller = "" if v2 else "memory"
        server = own_cgroup(s.proc.pid, controller).rstrip("/")
        service = server.rsplit("/", 1)[0] if v2 and server.endswith("/service") else server
        assert service, "the server runs in the root cgroup: nesting is not visible here"
        for pid in pids:
          assert own_cgroup(pid, controller) == f"{service}/arbor-sandbox/{uid}", (
              own_cgroup(pid, controller), server)
        root = "/sys/fs/cgroup" + ("" if v2 else "/memory")
        assert not os.path.exists(f"{root}/arbor-sandbox/{uid}")  # not at the top
        running.cancel()
    run(go())
  finally:
    assert s.stop() == 0


def test_restart_after_a_crash_reclaims_everything(tmp_path):
  """SIGKILL the server with live sandboxes (workspace data), start it again: their mounts,
  cgroups and uid locks are gone before it serves."""
  from envs.sandbox.bwrap import DEFAULT_ROOT, LOCK_DIR
  args = ("--max_sandboxes", "2", "--uid_base", str(CRASH_UIDS[0]), "--uid_count",
          str(len(CRASH_UIDS)))
  (tmp_path / "a").mkdir()
  s = start_server(str(tmp_path / "a"), *args)

  async def fill():
    uids = []
    for _ in range(2):
      sb = await create_sandbox("remote", url=s.url, token=s.token)
      await sb.write_file("data.txt", "workspace data")
      uids.append(int((await sb.exec("id -u")).stdout))
    return uids
  uids = run(fill())
  s.proc.kill()
  s.proc.wait(10)
  time.sleep(0.2)
  left = [(uid, os.path.join(DEFAULT_ROOT, str(uid))) for uid in uids]
  # the crash did leave things behind (else this test proves nothing); processes do not
  # outlive an exec (its own PID namespace), so there are none to leave
  assert all(mounts_under(d + "/") for _, d in left)
  assert all(cgroup_dirs(str(uid)) for uid in uids)
  assert all(open(os.path.join(LOCK_DIR, f"{uid}.lock")).read() for uid in uids)
  (tmp_path / "b").mkdir()
  s2 = start_server(str(tmp_path / "b"), *args)
  try:
    assert pool_processes([CRASH_UIDS], zombies=False) == []
    for uid, d in left:
      assert mounts_under(d + "/") == [], uid
      assert cgroup_dirs(str(uid)) == [], uid
      assert open(os.path.join(LOCK_DIR, f"{uid}.lock")).read() == ""
    assert "reclaimed" in open(s2.log).read()
    status, body = s2.request("POST", "/sandboxes", {})  # and it serves
    assert status == 200
  finally:
    assert s2.stop() == 0


def test_client_limits_negotiated_with_the_servers_caps(tmp_path):
  s = start_server(str(tmp_path), "--max_sandboxes", "2", "--memory_mb", "512", "--pids", "64")
  try:
    async def go():
      async with await create_sandbox("remote", url=s.url, token=s.token) as sb:
        assert (sb.limits.memory_mb, sb.limits.pids) == (512, 64)  # the server's caps
        assert sb.limits.disk_mb == Limits().disk_mb
      async with await create_sandbox("remote", limits=Limits(memory_mb=256, cpus=0.5),
                                      url=s.url, token=s.token) as sb:
        assert (sb.limits.memory_mb, sb.limits.cpus, sb.limits.pids) == (256, 0.5, 64)
      with pytest.raises(ValueError, match=r"limits\.memory_mb=4096 .*cap memory_mb=512"):
        await create_sandbox("remote", limits=Limits(memory_mb=4096), url=s.url, token=s.token)
    run(go())
  finally:
    assert s.stop() == 0


def test_read_only_binds_rootfs_allow_list_and_workspace_path(tmp_path):
  """--ro_bind shows a host folder read-only in every sandbox; a request picks a root
  filesystem only by a name of --rootfs; the reply says where the workspace is."""
  base = f"/run/arbor-test-server-{os.getpid()}"  # sandbox uids must traverse it
  data, root = os.path.join(base, "data"), os.path.join(base, "rootfs")
  # /opt/data exists in the image: a read-only image cannot get new mount points
  for d in (data, os.path.join(root, "usr"), os.path.join(root, "opt", "data"),
            os.path.join(root, "etc")):
    os.makedirs(d, exist_ok=True)
  os.chmod(base, 0o755)
  with open(os.path.join(data, "shared.txt"), "w") as f:
    f.write("shared")
  with open(os.path.join(root, "opt", "marker"), "w") as f:
    f.write("from the image")
  for name in ("bin", "lib", "lib64", "sbin"):  # a merged-/usr image
    os.symlink(f"usr/{name}", os.path.join(root, name))
  subprocess.run(["mount", "--bind", "-o", "ro", "/usr", os.path.join(root, "usr")], check=True)
  s = None
  try:
    s = start_server(str(tmp_path), "--max_sandboxes", "2", "--ro_bind", f"{data}:/opt/data",
                     "--rootfs", f"image={root}")

    async def go():
      async with await create_sandbox("remote", url=s.url, token=s.token) as sb:
        r = await sb.exec("cat /opt/data/shared.txt; touch /opt/data/x; echo rc=$?; pwd")
        assert r.stdout.startswith("shared") and "rc=0" not in r.stdout, r
        assert r.stdout.splitlines()[-1] == sb.workspace_path == "/workspace", (r, sb.workspace_path)
        assert (await sb.exec("cat /opt/marker")).exit_code != 0  # the host's system view
      async with await create_sandbox("remote", url=s.url, token=s.token,
                                      rootfs="image") as sb:
        r = await sb.exec("cat /opt/marker; cat /opt/data/shared.txt")
        assert r.stdout == "from the imageshared", r
      with pytest.raises(ValueError, match=r"rootfs='/'.*\['image'\]"):
        await create_sandbox("remote", url=s.url, token=s.token, rootfs="/")
    run(go())
  finally:
    if s is not None:
      assert s.stop() == 0
    subprocess.run(["umount", os.path.join(root, "usr")], check=True)
    shutil.rmtree(base)


def test_exec_argv_and_deep_directory_tree(server):
  async def go():
    async with await create_sandbox("remote", url=server.url, token=server.token) as sb:
      tricky = ["printf", "%s|", "a b", "$HOME", "'q'", ";echo no"]
      r = await sb.exec(tricky)
      assert r.stdout == "a b|$HOME|'q'|;echo no|", r  # each argument as given, no shell
      with pytest.raises(ValueError, match="cmd"):
        await sb.exec([])
      r = await sb.exec("python3 -c \"import os\nfor _ in range(1500): os.mkdir('d'); "
                        "os.chdir('d')\nopen('f', 'w').close()\"")
      assert r.exit_code == 0, r
      try:  # a listing either works or is refused as too deep: never a server failure
        files = await sb.list_files(".")
        assert files == ["/".join(["d"] * 1500 + ["f"])]
      except ValueError as e:
        assert "deep" in str(e)
      assert (await sb.exec("echo alive")).stdout == "alive\n"
  run(go())
  for bad in ([1, 2], [], {"a": 1}):
    status, body = server.request("POST", "/sandboxes", {})
    sid = body["id"]
    status, body = server.request("POST", f"/sandboxes/{sid}/exec", {"cmd": bad})
    assert status == 400 and "cmd" in body["error"], body
    server.request("DELETE", f"/sandboxes/{sid}")


def _task(**kw) -> Task:
  return Task(instance_id="t", kind="exact", problem_statements=("-",), answers=("x",), **kw)


def test_docker_backend_round_trip_and_image_allow_list(tmp_path):
  """--backend docker: a sandbox from an allowed image (the SWE-layout one: its workspace is
  /testbed, seeded, with the conda env's python) does exec and file write/read through the
  server; the first --image is the default; an image off the allow-list is a 400 naming it;
  an absent image stops the server at start-up, named."""
  from tests.test_sandbox_images import swe_layout_image
  swe, plain = swe_layout_image(), docker_kw()["image"]
  s = start_server(str(tmp_path), "--backend", "docker", "--image", plain, "--image", swe,
                   "--max_sandboxes", "2")
  try:
    async def go():
      async with await create_sandbox("remote", url=s.url, token=s.token, image=swe) as sb:
        assert sb.workspace_path == "/testbed"
        await sb.write_file("swelayout/extra.py", "X = 7\n")
        r = await sb.exec("command -v python; python -c 'import swelayout.extra as e; "
                          "print(e.X, e.__file__)'")
        assert r.stdout == ("/opt/miniconda3/envs/testbed/bin/python\n"
                            "7 /testbed/swelayout/extra.py\n"), r
        assert await sb.read_file("swelayout/extra.py") == b"X = 7\n"
      async with await create_sandbox("remote", url=s.url, token=s.token) as sb:
        assert sb.workspace_path == "/workspace"  # the default: the first --image
        assert (await sb.exec("cat /testbed/swelayout/_built.py")).exit_code != 0
      with pytest.raises(ValueError, match=r"image='arbor-other:x': not one this server "
                         r"offers \(its --image: \["):
        await create_sandbox("remote", url=s.url, token=s.token, image="arbor-other:x")
      # episodes' sandboxes: a row's image_name, or its environment's image by its tag
      token_file = tmp_path / "client-token"
      token_file.write_text(s.token)
      make = make_sandbox_factory("remote", url=s.url, token_file=str(token_file))
      env = Environment.create(suite="bookworm", system_packages=["python3-pytest"])
      assert build.image_tag(env) == plain  # the tests' image is that environment's
      for task, workspace in ((_task(image_name=swe), "/testbed"),
                              (_task(environment=env), "/workspace")):
        async with await make(task) as sb:
          assert sb.workspace_path == workspace
          assert (await sb.exec("python3 -c 'import pytest'")).exit_code == 0
    run(go())
  finally:
    assert s.stop() == 0, open(s.log).read()[-2000:]
  token = tmp_path / "token"
  r = subprocess.run([sys.executable, "-m", "envs.sandbox_server", "--token_file", str(token),
                      "--backend", "docker", "--image", "arbor-env:absent0000"],
                     capture_output=True, text=True, timeout=60, cwd=REPO)
  assert r.returncode == 2 and "--image='arbor-env:absent0000'" in r.stderr, r.stderr
