"""Image profiles of the docker backend (`envs.sandbox.images`) on the local engine.

SWE-bench / SWE-smith's published images are not pulled here (no registry is reachable from
the test machines): `swe_layout_image()` builds a local image with their layout instead, the
facts taken from the swebench package: the conda environment's interpreter at
/opt/miniconda3/envs/testbed/bin/python (here a link to the image's python3), the repository
at /testbed (mode 777, owned by root) installed in editable mode (a path entry in
site-packages naming /testbed, as a develop install leaves), with a file the install built in
place that the repository's own sources do not hold.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import io
import tarfile

import pytest

from envs.sandbox import SandboxError, create_sandbox, images
from tests.test_sandbox import DOCKER_UID, LIMITS, docker_kw

BUILT = "VALUE = 'built in place'\n"
LAYOUT = {  # path in the image -> (content or None for a link, mode, link target)
    "opt/miniconda3/envs/testbed/bin/python": (None, 0o777, "/usr/bin/python3"),
    "testbed/swelayout/__init__.py": ("from swelayout._built import VALUE\n", 0o777, ""),
    "testbed/swelayout/_built.py": (BUILT, 0o777, ""),
    "testbed/tests/test_layout.py": ("import swelayout\n\ndef test_value():\n"
                                     "  assert swelayout.VALUE == 'built in place'\n",
                                     0o777, ""),
    "usr/lib/python3/dist-packages/__editable__.swelayout.pth": ("/testbed\n", 0o644, ""),
    "testbed/data/blob.txt": ("x" * (3 << 19), 0o777, ""),  # 1.5 MiB: over a 1 MiB workspace
}


def run(coro):
  return asyncio.run(coro)


@functools.lru_cache(maxsize=None)
def swe_layout_image() -> str:
  """The local SWE-layout image (FROM the docker tests' image; built once, tagged by content).
  Its name is the one the SWE-bench harness gives images it builds locally."""
  from envs.environments import debian
  base = docker_kw()["image"]
  key = hashlib.sha256(repr((base, sorted(LAYOUT.items()))).encode()).hexdigest()[:16]
  tag = f"sweb.eval.x86_64.arbor-layout:{key}"
  client = debian.docker_client()
  if debian.image_exists(client, tag):
    return tag
  buf = io.BytesIO()
  with tarfile.open(fileobj=buf, mode="w") as tar:
    def add(name, data=None, mode=0o777, link=""):
      info = tarfile.TarInfo(name)
      info.mode = mode
      if link:
        info.type, info.linkname = tarfile.SYMTYPE, link
      elif data is None:
        info.type = tarfile.DIRTYPE
      else:
        info.size = len(data)
      tar.addfile(info, None if data is None else io.BytesIO(data))
    dockerfile = (f"FROM {base}\nCOPY opt /opt/\nCOPY testbed /testbed/\n"
                  "COPY usr /usr/\n").encode()
    add("Dockerfile", dockerfile, 0o644)
    parts = [p.split("/")[:-1] for p in LAYOUT]
    dirs = sorted({"/".join(ps[:i]) for ps in parts for i in range(1, len(ps) + 1)})
    for d in dirs:  # 777 as the harness's `chmod -R 777 /testbed`; the rest as the system's
      add(d, None, 0o777 if d.startswith("testbed") else 0o755)
    for path, (content, mode, link) in LAYOUT.items():
      add(path, None if content is None else content.encode(), mode, link)
  buf.seek(0)
  client.images.build(fileobj=buf, custom_context=True, tag=tag, rm=True, forcerm=True,
                      pull=False, network_mode="none")
  return tag


def test_profiles_by_image_name():
  for name in ("swebench/sweb.eval.x86_64.django_1776_django-11099:latest",
               "docker.io/swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:v1",
               "xingyaoww/sweb.eval.x86_64.getmoto_s_moto-5752",
               "sweb.eval.arm64.sympy__sympy-20590:latest"):
    p = images.profile_for(name)
    assert (p.name, p.workspace, p.seed) == ("swebench", "/testbed", True), name
    assert dict(p.env)["PATH"].startswith("/opt/miniconda3/envs/testbed/bin:")
    assert dict(p.env)["CONDA_DEFAULT_ENV"] == "testbed"
  p = images.profile_for("jyangballin/swesmith.x86_64.pandas-dev_1776_pandas.95280573")
  assert (p.name, p.workspace, p.seed) == ("swesmith", "/testbed", True)
  for name in ("arbor-env:0123456789abcdef01234567", "arbor-debian:abc"):
    p = images.profile_for(name)
    assert (p.name, p.workspace, p.env, p.seed, p.pull) == ("arbor", "/workspace", (), False,
                                                           False), name
  assert images.profile_for("python:3.11-slim").pull  # not one of Arbor's: a registry's
  with pytest.raises(ValueError, match="workspace='/a b'"):
    images.ImageProfile("x", "", workspace="/a b")
  with pytest.raises(ValueError, match="workspace='/a/../b'"):
    images.ImageProfile("x", "", workspace="/a/../b")
  with pytest.raises(ValueError, match="user='0:0'"):
    images.ImageProfile("x", "", user="0:0")


def test_swe_layout_image_runs_as_the_harness_expects():
  """The workspace is /testbed seeded from the image (the built file included), owned by the
  sandbox user; python is the conda env's; imports of the repository resolve to the workspace
  (editable), so a file written there is importable from anywhere; the image's own tests pass;
  a fork copies the workspace as it is (no fresh seed)."""
  image = swe_layout_image()
  user = f"{DOCKER_UID}:{DOCKER_UID}"

  async def go():
    async with await create_sandbox("docker", limits=LIMITS, image=image, user=user) as sb:
      assert sb.workspace_path == "/testbed"
      r = await sb.exec("pwd; command -v python; echo $CONDA_DEFAULT_ENV $CONDA_PREFIX; "
                        "stat -c %u swelayout/_built.py; id -u")
      assert r.stdout.split() == ["/testbed", "/opt/miniconda3/envs/testbed/bin/python",
                                  "testbed", "/opt/miniconda3/envs/testbed", str(DOCKER_UID),
                                  str(DOCKER_UID)], r
      assert await sb.read_file("swelayout/_built.py") == BUILT.encode()
      await sb.write_file("swelayout/extra.py", "X = 42\n")
      r = await sb.exec("cd /tmp && python -c 'import swelayout, swelayout.extra; "
                        "print(swelayout.extra.X, swelayout.__file__, swelayout.VALUE)'")
      assert r.stdout == "42 /testbed/swelayout/__init__.py built in place\n", r
      r = await sb.exec("python -m pytest -q -p no:cacheprovider tests")
      assert r.exit_code == 0 and "1 passed" in r.stdout, r
      r = await sb.exec("touch /opt/miniconda3/x /testbed-not; echo rc=$?")
      assert "rc=1" in r.stdout, r  # only the workspace (and /tmp) can be written
      await sb.exec("rm swelayout/_built.py")
      async with await sb.fork() as fork:
        assert fork.workspace_path == "/testbed"
        assert [f for f in await fork.list_files(".") if "__pycache__" not in f] == [
            "data/blob.txt", "swelayout/__init__.py", "swelayout/extra.py",
            "tests/test_layout.py"]
  run(go())


def test_absent_image_names_the_image_and_the_fallbacks():
  docker_kw()  # the engine answers (or the test is skipped by ARBOR_SKIP_DOCKER)

  async def go():
    # a registry nothing answers at: the pull fails at once
    with pytest.raises(SandboxError, match=r"image='localhost:1/absent/img:x'.*no registry "
                       r"answers.*envs\.environments.*docker load"):
      await create_sandbox("docker", limits=LIMITS, image="localhost:1/absent/img:x")
    with pytest.raises(SandboxError, match=r"image='arbor-env:absent0000'.*never pulled"):
      await create_sandbox("docker", limits=LIMITS, image="arbor-env:absent0000")
  run(go())


def test_seed_larger_than_the_workspace_is_a_clear_error():
  image = swe_layout_image()

  async def go():
    with pytest.raises(SandboxError, match=r"seeding /testbed .*limits\.disk_mb=1"):
      await create_sandbox("docker", limits=dataclasses.replace(LIMITS, disk_mb=1),
                           image=image, user=f"{DOCKER_UID}:{DOCKER_UID}")
  run(go())
