"""Sandbox.fork on every backend: the fork starts from a copy of the workspace (bytes, modes,
links, empty directories, files the sandbox's own uid made unreadable) and is independent of
its parent afterwards. bwrap, local and docker (the local engine) run for real; remote against
an in-process server on loopback."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil

import pytest

from envs.sandbox import SandboxError, SandboxFull, bwrap, create_sandbox
from envs.sandbox import docker as docker_backend
from envs.sandbox.remote import RemoteSandbox
from envs.sandbox_server import SandboxHTTP, SandboxService
from tests.test_sandbox import LIMITS, TEST_UIDS, docker_kw

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None or os.geteuid() != 0,
                                 reason="bwrap backend needs bwrap and root")
# What the parent holds at the branch point, made both through the file API and by commands
# (files owned by the sandbox's own uid, one of them unreadable: mode 000).
SETUP = ("chmod 755 run.sh && ln -s pkg/sub/data.bin link && mkdir -p empty/dir && "
         "echo made > made.txt && chmod 640 made.txt && echo hidden > locked && chmod 000 locked "
         "&& ln made.txt hard.txt && mkdir ro && echo r > ro/f && chmod 555 ro")
# The workspace as `ls`/`stat` see it: names, types, modes, owners, sizes, link targets.
SHOW = ("find . -mindepth 1 | sort | while read -r p; do "
        "stat -c '%n %F %a %U %s %h' \"$p\"; done; readlink link; ./run.sh")
DATA = bytes(range(256)) * 4


def run(coro):
  return asyncio.run(coro)


async def check_fork(sb) -> None:
  """The shared scenario: set up, fork, compare, diverge, close the parent; closes both."""
  fork = None
  try:
    await sb.write_file("pkg/sub/data.bin", DATA)
    await sb.write_file("run.sh", "#!/bin/sh\necho ran\n")
    r = await sb.exec(SETUP)
    assert r.exit_code == 0, r
    before = await sb.exec(SHOW)
    assert before.exit_code == 0 and "ran" in before.stdout, before
    fork = await sb.fork()
    assert fork.limits == sb.limits and fork.workspace_path
    seen = await fork.exec(SHOW)
    assert seen.stdout == before.stdout, (before.stdout, seen.stdout)
    assert await fork.read_file("pkg/sub/data.bin") == DATA
    assert await fork.list_files() == await sb.list_files()
    # Diverge: each side sees only its own changes.
    await sb.write_file("parent.txt", "p")
    assert (await sb.exec("rm made.txt && echo more >> pkg/sub/data.bin")).exit_code == 0
    await fork.write_file("pkg/fork.txt", "f")
    assert (await fork.exec("echo f > fork2.txt && rm run.sh && chmod 700 ro")).exit_code == 0
    p, f = set(await sb.list_files()), set(await fork.list_files())
    assert {"parent.txt", "run.sh"} <= p and not {"made.txt", "pkg/fork.txt", "fork2.txt"} & p
    assert {"made.txt", "pkg/fork.txt", "fork2.txt"} <= f and not {"parent.txt", "run.sh"} & f
    assert await fork.read_file("pkg/sub/data.bin") == DATA
    assert (await fork.read_file("hard.txt")) == b"made\n"
    assert (await sb.exec("stat -c %a ro")).stdout == "555\n"
    # Closing the parent leaves the fork usable; a closed sandbox cannot fork.
    await sb.close()
    with pytest.raises(SandboxError, match="closed"):
      await sb.fork()
    r = await fork.exec("cat fork2.txt made.txt")
    assert r.exit_code == 0 and r.stdout == "f\nmade\n", r
  finally:
    await sb.close()
    if fork is not None:
      await fork.close()


# ---------------------------------------------------------------------------------------------
# bwrap and local

@needs_bwrap
def test_bwrap_fork():
  async def go():
    await check_fork(await create_sandbox("bwrap", limits=LIMITS, uids=TEST_UIDS))
  run(go())


@needs_bwrap
def test_bwrap_fork_owned_by_its_uid_and_failed_copy_closes_it():
  async def go():
    pool = bwrap._pool(TEST_UIDS, bwrap.DEFAULT_ROOT)
    async with await create_sandbox("bwrap", limits=LIMITS, uids=TEST_UIDS) as sb:
      assert (await sb.exec("echo x > f && chmod 000 f")).exit_code == 0
      async with await sb.fork() as fork:
        assert fork.uid != sb.uid
        st = os.stat(os.path.join(fork.workspace, "f"))
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (fork.uid, fork.uid, 0)
        assert os.stat(os.path.join(sb.workspace, "f")).st_uid == sb.uid
        r = await fork.exec("id -u; stat -c %u f; chmod 600 f && cat f")
        assert r.stdout.split() == [str(fork.uid)] * 2 + ["x"], r
      held = set(pool._held)
      # A tree deeper than the copy walks: the fork fails and its half is closed.
      r = await sb.exec("python3 -c \"import os; os.makedirs('/'.join(['d'] * 300))\"")
      assert r.exit_code == 0, r
      with pytest.raises(SandboxError, match="max_depth"):
        await sb.fork()
      assert set(pool._held) == held
  run(go())


def test_local_fork():
  async def go():
    await check_fork(await create_sandbox("local", limits=LIMITS, allow_unsafe=True))
  run(go())


def test_local_failed_copy_closes_the_half_made_fork(tmp_path):
  async def go():
    async with await create_sandbox("local", limits=LIMITS, allow_unsafe=True,
                                    parent_dir=str(tmp_path)) as sb:
      os.makedirs(os.path.join(sb.root, *["d"] * 300))
      with pytest.raises(SandboxError, match="max_depth"):
        await sb.fork()
      assert os.listdir(tmp_path) == [os.path.basename(sb.root)]
  run(go())


# ---------------------------------------------------------------------------------------------
# remote: a server in this process, local backend, on loopback

@pytest.fixture
def server():
  service = SandboxService("local", max_sandboxes=2, limits=LIMITS,
                           backend_kw={"allow_unsafe": True})
  token = secrets.token_hex(16)
  http = SandboxHTTP(service, token, "127.0.0.1", 0)
  port = http.start()
  yield f"http://127.0.0.1:{port}", token, service
  http.stop_accepting()
  service.stop()
  http.join()


def test_remote_fork(server):
  url, token, _ = server

  async def go():
    await check_fork(await RemoteSandbox.create(url, token, limits=LIMITS))
  run(go())


def test_remote_fork_counts_against_capacity_and_needs_the_token(server):
  url, token, service = server

  async def go():
    sb = await RemoteSandbox.create(url, token, limits=LIMITS)
    fork = await sb.fork()
    assert len(service.live) == 2 and fork.id != sb.id
    with pytest.raises(SandboxFull):  # max_sandboxes=2
      await sb.fork()
    await fork.close()
    stranger = RemoteSandbox(type(sb._client)(url, "x" * 32), sb.id, sb.limits)
    with pytest.raises(SandboxError, match="token"):
      await stranger.fork()
    unknown = RemoteSandbox(sb._client, "0" * 16, sb.limits)
    with pytest.raises(SandboxError, match="unknown or closed"):
      await unknown.fork()
    await sb.close()
    assert service.live == {}
  run(go())


# ---------------------------------------------------------------------------------------------
# docker: the local engine

def _gone(container) -> bool:
  import docker
  try:
    container.reload()
  except docker.errors.NotFound:
    return True
  return False


def test_docker_fork():
  kw = docker_kw()

  async def go():
    sb = await create_sandbox("docker", limits=LIMITS, **kw)
    forks = []
    fork_of = docker_backend.DockerSandbox.fork

    async def record(self):
      forks.append(await fork_of(self))
      return forks[-1]
    docker_backend.DockerSandbox.fork = record
    try:
      await check_fork(sb)
    finally:
      docker_backend.DockerSandbox.fork = fork_of
    (fork,) = forks
    a, b = sb._container.attrs, fork._container.attrs  # the fork: same image, user, limits
    assert a["Config"]["Image"] == b["Config"]["Image"] == kw["image"]
    assert a["Config"]["User"] == b["Config"]["User"] == kw["user"]
    keys = ("Memory", "MemorySwap", "PidsLimit", "NanoCpus", "ReadonlyRootfs", "CapDrop",
            "SecurityOpt", "NetworkMode", "Tmpfs", "ShmSize", "Init")
    assert [a["HostConfig"][k] for k in keys] == [b["HostConfig"][k] for k in keys]
    assert _gone(sb._container) and _gone(fork._container)  # both removed
  run(go())


def test_docker_fork_restores_modes_and_failed_copy_removes_the_fork(monkeypatch):
  async def go():
    async with await create_sandbox("docker", limits=LIMITS, **docker_kw()) as sb:
      r = await sb.exec("mkdir -p shut/in && echo deep > shut/in/f && chmod 000 shut/in shut "
                        "&& echo x > f && chmod 200 f")
      assert r.exit_code == 0, r
      async with await sb.fork() as fork:
        r = await fork.exec("stat -c '%a %n' shut f; chmod 700 shut shut/in; cat shut/in/f")
        assert r.stdout == "0 shut\n200 f\ndeep\n", r
      # the parent's modes were restored after the copy read them
      assert (await sb.exec("stat -c '%a %n' shut f")).stdout == "0 shut\n200 f\n"
      # A copy that fails on the fork's side: the half-made fork is removed.
      created = []
      create = docker_backend.DockerSandbox.create

      async def record(*a, **k):
        created.append(await create(*a, **k))
        return created[-1]
      monkeypatch.setattr(docker_backend.DockerSandbox, "create", record)
      monkeypatch.setattr(docker_backend, "_UNPACK",
                          'head -c "$0" >/dev/null; echo broken >&2; exit 2')
      with pytest.raises(SandboxError, match="unpacking the fork's workspace failed.*broken"):
        await sb.fork()
      assert len(created) == 1 and _gone(created[0]._container)
      assert (await sb.exec("echo still")).stdout == "still\n"
  run(go())


def test_base_sandbox_without_fork_says_so():
  from envs.sandbox.base import Sandbox

  class NoFork(Sandbox):
    exec = write_file = read_file = list_files = close = None

  with pytest.raises(NotImplementedError, match="NoFork cannot fork"):
    run(NoFork().fork())
