"""envs.environments: spec keys, spec sources (swebench's table, repository metadata, files),
tasks naming an environment, and an end-to-end build: a real PyPI sdist (parse_type 0.6.6,
whose tests need `parse`, absent from the host's python3) passes its own tests in a bwrap
sandbox started from the environment built for it, and fails on the host's python.

The builds (a Debian base with pip, the dependency layer, the editable install) live in the
shared cache (`cache.root()`), so a second run only checks them. Network: PyPI (the sdist, a
swebench<5 wheel for the install table, the pip step) and the Debian archive (mmdebstrap).
"""

import asyncio
import hashlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request

import pytest

from envs import tasks as tasks_lib
from envs.environments import build, cache, debian, metadata, sources, spec
from envs.environments.spec import Environment, SpecError
from envs.sandbox import Limits, create_sandbox

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A small real package whose tests import a dependency (`parse`) the host does not have.
SDIST_URL = ("https://files.pythonhosted.org/packages/19/ea/42ba6ce0abba04ab6e0b997dcb9b528a"
             "4661b62af1fe1b0d498120d5ea78/parse_type-0.6.6.tar.gz")
SDIST_SHA256 = "513a3784104839770d690e04339a8b4d33439fcd5dd99f2e4580f9fc1097bfb2"
PARSE_PIN = "parse==1.20.2"
SWEBENCH_WHEEL = "swebench==4.1.0"  # the last releases with the per-repository install table
# A private uid range of one of 16 slots (other processes may run sandboxes from the default
# pool at the same time).
_BASE = 2_002_000_000 + random.randrange(16) * 32
UIDS = range(_BASE, _BASE + 32)
LIMITS = Limits(memory_mb=1024, pids=128, disk_mb=256, default_timeout=300)
WORK = os.path.join(cache.root(), "test-data")  # downloads shared by runs


def _bwrap_usable() -> bool:
  return os.geteuid() == 0 and shutil.which("bwrap") is not None


needs_build = pytest.mark.skipif(not (_bwrap_usable() and shutil.which("mmdebstrap")),
                                 reason="needs root, bwrap and mmdebstrap")


# ----------------------------------------------------------------------------- spec and key


def test_key_same_spec_same_key_any_order():
  a = Environment.create(python="3.11", system_packages=["git", "curl"], pip=["x==1", "y"],
                         env={"B": "2", "A": "1"})
  b = Environment.create(suite="bookworm", system_packages=["curl", "git", "git"],
                         pip=["x==1", "y"], env={"A": "1", "B": "2"})
  assert a == b and a.key == b.key and len(a.key) == 64
  assert spec.from_dict(json.loads(json.dumps(a.to_dict()))).key == a.key


@pytest.mark.parametrize("change", [
    dict(suite="trixie"), dict(system_packages=["git"]), dict(pip=["x==2", "y"]),
    dict(pip=["y", "x==1"]), dict(install=["python -m pip install -e ."],
                                  repository="o/r@abcdef0"),
    dict(env={"A": "2", "B": "2"}), dict(python_requested="3.10", suite="bullseye")])
def test_key_changes_with_every_field(change):
  base = dict(suite="bookworm", system_packages=(), pip=("x==1", "y"), install=(),
              env=(("A", "1"), ("B", "2")), repository=None, python_requested=None)
  changed = dict(base, **{k: tuple(v) if isinstance(v, list) else v for k, v in change.items()})
  if isinstance(changed["env"], dict):
    changed["env"] = tuple(sorted(changed["env"].items()))
  changed["system_packages"] = tuple(changed["system_packages"])
  assert Environment(**changed).key != Environment(**base).key


def test_python_versions_map_to_suites():
  assert spec.suite_for_python("3.11") == ("bookworm", None)
  assert spec.suite_for_python("3.9.7") == ("bullseye", None)
  assert spec.suite_for_python("3.6") == ("bullseye", "3.6")      # nearest, recorded
  assert spec.suite_for_python("3.12") == ("bookworm", "3.12")    # tie: the older
  assert spec.suite_for_python("3.14") == ("trixie", "3.14")
  env = Environment.create(python="3.10")
  assert (env.suite, env.python, env.python_requested) == ("bullseye", "3.9", "3.10")
  with pytest.raises(SpecError, match=r"python='2.7'.*no suite of that major"):
    spec.suite_for_python("2.7")
  with pytest.raises(SpecError, match=r"python='3.10': no Debian suite ships Python 3.10"):
    spec.suite_for_python("3.10", policy="exact")


@pytest.mark.parametrize("bad, message", [
    ({"pip": ["-e ."]}, r"environment.pip\[0\]='-e \.'"),
    ({"pip": ["x @ https://evil/x.whl"]}, r"environment.pip\[0\]"),
    ({"suite": "sid"}, r"environment.suite='sid'"),
    ({"python": "3.11", "suite": "trixie"}, r"environment.python='3.11'"),
    ({"system_packages": ["--allow-unauthenticated"]}, r"system_packages\[0\]"),
    ({"env": {"LD_PRELOAD": "x"}}, r"environment.env.LD_PRELOAD"),
    ({"install": "make"}, r"environment.repository=None"),
    ({"pip": "pytest"}, r"environment.pip='pytest': expected a list"),
    ({"pyhton": "3.11"}, r"environment.pyhton: unknown field"),
])
def test_spec_errors_name_the_field(bad, message):
  with pytest.raises(SpecError, match=message):
    spec.from_dict(bad)


def test_spec_errors_name_every_bad_field():
  with pytest.raises(SpecError) as e:
    spec.from_dict({"pip": ["ok", "-e .", "--index-url=x"], "suite": "sid", "typo": 1,
                    "env": {"PATH": "/x"}})
  fields = [m.split("=")[0].split(":")[0] for m in e.value.errors]
  assert fields == ["environment.typo", "environment.suite", "environment.pip[1]",
                    "environment.pip[2]", "environment.env.PATH"], e.value.errors
  assert str(e.value) == "; ".join(e.value.errors)


def test_build_many_builds_each_environment_once(monkeypatch):
  """Equal environments are built once, a failure is reported without stopping the others,
  and the progress bar counts them."""
  seen = []

  def fake_rootfs(env, repo, cache_dir, say):
    seen.append(env.key)
    if "broken" in env.pip:
      raise build.BuildError(f"{env.name}: pip install failed")
    return f"/built/{env.name}"
  monkeypatch.setattr(build, "rootfs", fake_rootfs)
  a, b = Environment.create(pip=["a"]), Environment.create(pip=["broken"])
  out = io.StringIO()
  results = build.build_many([(a, None), (b, None), (Environment.create(pip=["a"]), None)],
                             workers=2, out=out)
  assert sorted(seen) == sorted([a.key, b.key])
  assert [r["name"] for r in results] == [a.name, b.name]
  assert results[0]["rootfs"] == f"/built/{a.name}" and "error" not in results[0]
  assert "pip install failed" in results[1]["error"]
  assert "2/2 (1 failed)" in out.getvalue()
  with pytest.raises(ValueError, match="backend='podman'"):
    build.build_many([], backend="podman")


def test_spec_files(tmp_path):
  (tmp_path / "env.toml").write_text('[environment]\npython = "3.13"\npip = ["attrs==23.2.0"]\n'
                                     '[environment.env]\nTZ = "UTC"\n')
  env = sources.from_file(str(tmp_path / "env.toml"))
  assert (env.suite, env.pip, env.env) == ("trixie", ("attrs==23.2.0",), (("TZ", "UTC"),))
  (tmp_path / "env.json").write_text(json.dumps(env.to_dict()))
  assert sources.from_file(str(tmp_path / "env.json")).key == env.key
  (tmp_path / "bad.toml").write_text('pip = ["ok", 3]\n')
  with pytest.raises(SpecError, match=r"bad.toml: environment.pip=.*expected a list of strings"):
    spec.load_file(str(tmp_path / "bad.toml"))
  (tmp_path / "broken.json").write_text("{")
  with pytest.raises(SpecError, match=r"broken.json: not valid JSON"):
    spec.load_file(str(tmp_path / "broken.json"))


# ----------------------------------------------------------------------------- repository


def test_repository_metadata():
  files = {
      "pyproject.toml": b'[build-system]\nrequires = ["hatchling"]\n[project]\nname = "p"\n'
                        b'requires-python = ">=3.12"\ndependencies = ["attrs>=22", "bad dep!"]\n'
                        b'[project.optional-dependencies]\ntest = ["hypothesis"]\n'
                        b'docs = ["sphinx"]\n',
      "setup.cfg": b"[options]\ninstall_requires =\n    six\n    attrs>=22\n"
                   b"[options.extras_require]\ntesting = pytest-mock  # comment\n",
      "setup.py": b"import os\nREQ = ['click>=8']\nextra = {'tests': ['coverage']}\n"
                  b"setup(install_requires=REQ, extras_require=extra,\n"
                  b"      tests_require=[os.environ['X']])\n",
      "requirements.txt": b"-r requirements-dev.txt\n--index-url https://x\n-e .\n"
                          b"requests==2.31.0\n",
      "requirements-dev.txt": b"# dev\nblack ; python_version >= '3.8'\n",
  }
  meta = metadata.read(files)
  assert meta.dependencies == ["attrs>=22", "six", "click>=8"]
  assert meta.extras["test"] == ["hypothesis"] and meta.extras["testing"] == ["pytest-mock"]
  assert meta.extras["tests"] == ["coverage"] and "tests_require" not in meta.extras
  assert meta.requirements == ["black ; python_version >= '3.8'", "requests==2.31.0"]
  assert meta.build_requires == ["hatchling"] and meta.requires_python == ">=3.12"
  assert any("bad dep!" in s for s in meta.skipped)
  assert any("--index-url" in s for s in meta.skipped)
  env = sources.from_repository(files, repository="o/p@abc1234")
  assert env.suite == "trixie"  # requires-python >=3.12 rules bookworm's 3.11 out
  assert env.pip == ("attrs>=22", "six", "click>=8", "hypothesis", "coverage", "pytest-mock",
                     "black ; python_version >= '3.8'", "requests==2.31.0", "hatchling",
                     "pytest")
  assert env.install == ("python -m pip install --no-deps -e .",)
  assert env.repository == "o/p@abc1234"


# ----------------------------------------------------------------------------- swebench


@pytest.fixture(scope="module")
def swebench_table():
  """swebench's install table, from a swebench<5 wheel (swebench 5 dropped it)."""
  where = os.path.join(WORK, "swebench-wheel")
  os.makedirs(where, exist_ok=True)
  wheels = [f for f in os.listdir(where) if f.endswith(".whl")]
  if not wheels:  # a wheel: pip runs no code of it to download it
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "-d", where, SWEBENCH_WHEEL], check=True, capture_output=True, timeout=300)
    wheels = [f for f in os.listdir(where) if f.endswith(".whl")]
  return sources.load_swebench_specs(os.path.join(where, wheels[0]))


def _git(cwd, *args):
  env = dict(os.environ, GIT_AUTHOR_NAME="a", GIT_AUTHOR_EMAIL="a@b", GIT_COMMITTER_NAME="a",
             GIT_COMMITTER_EMAIL="a@b")
  return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True,
                        text=True).stdout.strip()


def test_swebench_table_for_real_repositories(swebench_table, tmp_path):
  """pallets/flask 2.3: requirements at environment_setup_commit (not base_commit), pip
  pins, install; scikit-learn 0.20: Python 3.6 served by bullseye's 3.9, the choice recorded;
  matplotlib 3.5: its environment.yml (conda) as pip requirements, apt-get pre_install steps
  as Debian packages."""
  mirror = tmp_path / "mirrors"
  work = tmp_path / "flask"
  work.mkdir()
  _git(work, "init", "-q")
  (work / "requirements").mkdir()
  (work / "requirements" / "dev.txt").write_text("-r tests.txt\npre-commit\n")
  (work / "requirements" / "tests.txt").write_text("pytest==7.3.1\nasgiref\n")
  (work / "setup.py").write_text("from setuptools import setup\nsetup(name='flask', "
                                 "install_requires=['blinker>=1.6.2'])\n")
  (work / "tests").mkdir()
  (work / "tests" / "test_x.py").write_text("def test_x():\n  pass\n")
  _git(work, "add", "-A")
  _git(work, "commit", "-q", "-m", "setup")
  setup_commit = _git(work, "rev-parse", "HEAD")
  (work / "requirements" / "tests.txt").write_text("pytest==8.0.0\n")
  _git(work, "commit", "-q", "-am", "later")
  base_commit = _git(work, "rev-parse", "HEAD")
  mirror.mkdir()
  _git(tmp_path, "clone", "-q", "--bare", str(work), str(mirror / "pallets__flask.git"))
  row = {"instance_id": "pallets__flask-1", "repo": "pallets/flask", "version": "2.3",
         "base_commit": base_commit, "environment_setup_commit": setup_commit,
         "problem_statement": "p", "FAIL_TO_PASS": ["tests/test_x.py::test_x"]}
  task = tasks_lib.swe_task_from_dict(row, mirror=str(mirror), cache_dir=str(tmp_path / "c"),
                                      env_from="swebench", swebench_specs=swebench_table)
  env = task.environment
  assert env.suite == "bookworm" and env.python_requested is None
  assert env.pip[:3] == ("pytest==7.3.1", "asgiref", "pre-commit")  # the setup commit's
  assert "Werkzeug==2.3.7" in env.pip and "blinker>=1.6.2" in env.pip
  assert env.install == ("python -m pip install -e .",)
  assert env.repository == f"pallets/flask@{base_commit}"
  # the row keeps its environment through a round trip
  again = tasks_lib.swe_task_from_dict(tasks_lib.task_to_swe_dict(task), mirror=str(mirror),
                                       cache_dir=str(tmp_path / "c"))
  assert again.environment == env
  # the repository's own metadata, read at environment_setup_commit from the mirror (whose top
  # level holds directories too), installed on base_commit
  own = tasks_lib.swe_task_from_dict(row, mirror=str(mirror), cache_dir=str(tmp_path / "c"),
                                     env_from="repository").environment
  assert "blinker>=1.6.2" in own.pip and "pytest" in own.pip
  assert own.repository == f"pallets/flask@{base_commit}"

  sk = sources.from_swebench({"repo": "scikit-learn/scikit-learn", "version": "0.20",
                              "base_commit": "abcdef0"}, specs=swebench_table, files={})
  assert (sk.suite, sk.python_requested) == ("bullseye", "3.6")
  assert "numpy==1.19.2" in sk.pip and "cython" in sk.pip and "pytest" in sk.pip
  mpl = sources.from_swebench(
      {"repo": "matplotlib/matplotlib", "version": "3.5", "base_commit": "abcdef0"},
      specs=swebench_table, files={"environment.yml": b"dependencies:\n  - python=3.8\n"
                                   b"  - numpy>=1.19\n  - pip:\n    - pytest-rerunfailures\n"})
  assert {"imagemagick", "ffmpeg", "texlive", "dvipng"} <= set(mpl.system_packages)
  assert "numpy>=1.19" in mpl.pip and "pytest-rerunfailures" in mpl.pip
  assert not any("apt-get" in c for c in mpl.install)
  with pytest.raises(ValueError, match=r"field 'version': '9.9'.*pallets/flask"):
    sources.from_swebench({"repo": "pallets/flask", "version": "9.9"}, specs=swebench_table,
                          files={})


def test_rows_name_environments(tmp_path):
  (tmp_path / "repo").mkdir()
  (tmp_path / "repo" / "test_a.py").write_text("def test_a():\n  pass\n")
  row = {"instance_id": "r1", "repo_path": "repo", "problem_statement": "p",
         "FAIL_TO_PASS": ["test_a.py::test_a"],
         "environment": {"python": "3.9", "pip": ["pytest==8.3.3"]}}
  task = tasks_lib.swe_task_from_dict(row, base_dir=str(tmp_path))
  assert task.environment == Environment.create(suite="bullseye", pip=["pytest==8.3.3"])
  (tmp_path / "rows.jsonl").write_text(json.dumps(dict(row, environment={"pip": ["-r x"]})))
  with pytest.raises(tasks_lib.TaskFormatError, match=r"rows.jsonl:1: field 'environment'.pip"):
    tasks_lib.load_tasks(str(tmp_path / "rows.jsonl"))
  del row["environment"]
  task = tasks_lib.swe_task_from_dict(row, base_dir=str(tmp_path), env_from="repository")
  assert task.environment.pip == ("pytest",) and not task.environment.install
  assert tasks_lib.swe_task_from_dict(row, base_dir=str(tmp_path)).environment is None


# ----------------------------------------------------------------------------- a real repository


@pytest.fixture(scope="module")
def sdist_dir():
  """parse_type 0.6.6's sdist (checked against PyPI's sha256), unpacked once."""
  target = os.path.join(WORK, "parse_type-0.6.6")
  if not os.path.isdir(target):
    data = urllib.request.urlopen(SDIST_URL, timeout=120).read()
    assert hashlib.sha256(data).hexdigest() == SDIST_SHA256
    tmp = target + f".tmp{os.getpid()}"
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
      tar.extractall(tmp, filter="data")
    os.rename(os.path.join(tmp, "parse_type-0.6.6"), target)
    os.rmdir(tmp)
  return target


@pytest.fixture(scope="module")
def built(sdist_dir):
  """(environment, its root filesystem, build seconds) of the sdist's own metadata."""
  # `parse` pinned to the release parse_type 0.6.6 was tested against: a later parse changed
  # a pattern one of its tests spells out.
  env = sources.from_repository(sdist_dir, pins=[PARSE_PIN])
  start = time.monotonic()
  path = build.rootfs(env, sdist_dir, progress=lambda line: None)
  return env, path, time.monotonic() - start


async def _run_tests(files, rootfs, command):
  sb = await create_sandbox("bwrap", limits=LIMITS, uids=UIDS, rootfs=rootfs)
  async with sb:
    for path, data in files.items():
      await sb.write_file(path, data)
    return await sb.exec(command, timeout=300)


@needs_build
def test_real_repository_passes_in_its_environment_and_fails_on_host(sdist_dir, built):
  env, path, seconds = built
  print(f"environment {env.name} ready in {seconds:.1f} s")
  assert PARSE_PIN in env.pip and not any(r.startswith("parse >") for r in env.pip)
  assert "pytest-html >= 1.19.0" in env.pip  # the "testing" extra: its pytest.ini needs it
  assert env.install and env.repository.startswith("local/files@")
  manifest = cache.read_manifest(os.path.dirname(path))
  assert manifest["key"] == env.key and PARSE_PIN in manifest["installed"]
  files = tasks_lib.load_repo_files(sdist_dir)
  ok = asyncio.run(_run_tests(files, path, "python3 -m pytest -q -p no:cacheprovider"))
  assert ok.exit_code == 0, ok.stdout[-3000:] + ok.stderr[-2000:]
  assert " passed" in ok.stdout and "failed" not in ok.stdout
  # The host's python3 (the same sandbox, the host's /usr) lacks the dependency.
  host = asyncio.run(_run_tests(files, None, "python3 -m pytest -q -p no:cacheprovider "
                                             "-o addopts='' tests"))
  assert host.exit_code != 0
  assert "ModuleNotFoundError: No module named 'parse'" in host.stdout + host.stderr
  probe = subprocess.run(["/usr/bin/python3", "-c", "import parse"], capture_output=True,
                         text=True)
  assert "ModuleNotFoundError" in probe.stderr


@needs_build
def test_task_environment_starts_the_sandbox(sdist_dir, built, tmp_path):
  """A row naming the environment: the episode's bwrap sandbox starts from its rootfs, and
  `python -m envs.environments build` finds it built."""
  from envs.episode import make_sandbox_factory, start_sandbox
  env, path, _ = built
  shutil.copytree(sdist_dir, tmp_path / "repo")
  row = {"instance_id": "pt-1", "repo_path": "repo", "problem_statement": "p",
         "FAIL_TO_PASS": ["tests/test_parse.py::test_x"], "environment": env.to_dict()}
  (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
  task = tasks_lib.load_tasks(str(tmp_path / "rows.jsonl"))[0]
  assert task.environment == env
  assert build.for_task(task, "bwrap") == path

  async def probe():
    sb = await start_sandbox(task, make_sandbox_factory("bwrap", limits=LIMITS))
    async with sb:  # parse_type through the editable install's hook into /workspace
      return await sb.exec("cd /tmp && python3 -I -c 'import parse, parse_type, sys; "
                           "print(sys.version, parse_type.__file__)'", timeout=60)
  res = asyncio.run(probe())
  assert res.exit_code == 0 and res.stdout.startswith(env.python), res.stderr
  assert "/workspace/parse_type/__init__.py" in res.stdout
  out = subprocess.run([sys.executable, "-m", "envs.environments", "build", "--tasks",
                        str(tmp_path / "rows.jsonl"), "--workers", "2"], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert result["rootfs"] == path and result["key"] == env.key
  assert "1/1" in out.stderr


@needs_build
def test_debian_rootfs_is_a_task_rootfs(built):
  assert debian.key("bookworm") == debian.key("bookworm", ["python3"])  # always included
  assert debian.key("bookworm", ["git", "curl"]) == debian.key("bookworm", ["curl", "git"])
  # the base the real repository's environment was built on (no build of its own)
  path = debian.rootfs("bookworm", build.PIP_HELPERS, progress=lambda line: None)
  assert cache.read_manifest(os.path.dirname(path))["spec"]["packages"] == [
      "python-is-python3", "python3", "python3-pip"]
  res = asyncio.run(_run_tests({}, path, "python3 -c 'import sys; print(sys.version)'; "
                                         "test ! -e /etc/resolv.conf"))
  assert res.exit_code == 0 and res.stdout.startswith("3.11"), res.stderr


@needs_build
@pytest.mark.skipif(os.environ.get("ARBOR_SKIP_DOCKER") == "1",
                    reason="ARBOR_SKIP_DOCKER=1 (as the docker sandbox tests)")
def test_docker_image_of_the_environment(sdist_dir, built):
  env, _, _ = built
  tag = build.docker_image(env, sdist_dir, progress=lambda line: None)
  assert tag == f"arbor-env:{env.key[:24]}"

  files = tasks_lib.load_repo_files(sdist_dir)

  async def run():
    sb = await create_sandbox("docker", limits=LIMITS, image=tag)
    async with sb:
      for path, data in files.items():
        await sb.write_file(path, data)
      return await sb.exec("python3 -m pytest -q -p no:cacheprovider", timeout=300)
  res = asyncio.run(run())
  assert res.exit_code == 0 and " passed" in res.stdout, res.stdout[-2000:] + res.stderr
