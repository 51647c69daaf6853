"""Tasks with environments: the bundled rows name one, the loaders of a run give the others
one (`envs.task_environments`, config.rl.env_from / rl.default_environment), and their
verifier's sandboxes start from its build, not from the host's Python.

Every bundled row and the demo share one environment, the "bookworm-pytest" preset (Debian
bookworm's python3 + python3-pytest): one cached mmdebstrap build, made once per machine
(about two minutes) and found at once afterwards.
"""

import asyncio
import dataclasses
import json
import os

import pytest

from envs import pypi_tasks, task_environments
from envs.environments import build, spec
from envs.episode import make_sandbox_factory
from envs.tasks import Task, load_swe_jsonl, reference_files
from envs.verifiers.swe import verify_tests

ROOT = os.path.join(os.path.dirname(__file__), "..")
SWE = os.path.join(ROOT, "envs", "data", "swe", "tasks.jsonl")
PYPI_SAMPLE = os.path.join(ROOT, "envs", "data", "pypi", "sample", "tasks.jsonl")
# What Debian bookworm ships (and a bookworm host with python3-pytest runs): the demo's figures
# were measured with these.
BOOKWORM_PYTHON, BOOKWORM_PYTEST = "3.11.2", "7.2.1"


@pytest.fixture(scope="session")
def bookworm_pytest():
  """(the preset's Environment, its root filesystem), built once (cached across sessions)."""
  env = task_environments.preset("bookworm-pytest")
  return env, build.rootfs(env)


def versions(task) -> str:
  """python3's version and `python3 -m pytest --version` in a sandbox of the task."""
  async def go():
    box = await make_sandbox_factory("bwrap")(task)
    try:
      r = await box.exec("python3 -c 'import platform; print(platform.python_version())'; "
                         "python3 -m pytest --version 2>&1", timeout=60)
      return r.stdout + r.stderr
    finally:
      await box.close()
  return asyncio.run(go())


def test_bundled_rows_name_the_shared_environment():
  env = task_environments.preset("bookworm-pytest")
  for path in (SWE, PYPI_SAMPLE):
    tasks = load_swe_jsonl(path)
    assert tasks and all(t.environment == env for t in tasks), path
  # The PyPI packages' metadata asks for pytest alone: the same environment, for every package.
  for package in pypi_tasks.bundled_packages():
    assert pypi_tasks.package_environment(package) == env, package.name


def test_a_bundled_row_is_graded_in_its_environment(bookworm_pytest, monkeypatch):
  env, rootfs = bookworm_pytest
  task = load_swe_jsonl(SWE)[0]
  seen = []
  import envs.episode as episode
  real = episode.create_sandbox

  async def recording(backend, **kw):
    seen.append(kw.get("rootfs"))
    return await real(backend, **kw)
  monkeypatch.setattr(episode, "create_sandbox", recording)
  gold = asyncio.run(verify_tests(task, reference_files(task), make_sandbox_factory("bwrap")))
  assert gold.reward == 1.0, gold.details
  assert seen == [rootfs]  # the verifier's sandbox: the environment's root, not the host's
  out = versions(task)
  assert BOOKWORM_PYTHON in out and f"pytest {BOOKWORM_PYTEST}" in out, out
  # The same row in an environment without pytest is not resolved: the tests really run there.
  bare = dataclasses.replace(task, environment=spec.Environment())
  assert "No module named pytest" in versions(bare)
  verdict = asyncio.run(verify_tests(bare, reference_files(task), make_sandbox_factory("bwrap")))
  assert verdict.reward == 0.0


def test_with_environments_gives_each_task_its_environment(tmp_path):
  preset = task_environments.preset("bookworm-pytest")
  swe = load_swe_jsonl(SWE)[0]
  bare = dataclasses.replace(swe, environment=None)
  rooted = dataclasses.replace(swe, environment=None, rootfs=str(tmp_path))
  problem = Task(instance_id="p", kind="code", problem_statements=("-",),
                 tests=({"input": "", "output": ""},))
  out = task_environments.with_environments([swe, bare, rooted, problem], "none", preset)
  assert [t.environment for t in out] == [swe.environment, preset, None, preset]
  # env_from="repository": the repository's metadata (no packaging files here: pytest alone)
  derived = task_environments.with_environments([bare], "repository")[0].environment
  assert derived.pip == ("pytest",) and not derived.install
  with pytest.raises(ValueError, match=r"env_from='conda'"):
    task_environments.with_environments([bare], "conda")


def test_default_environment_names_a_preset_or_a_spec_file(tmp_path):
  assert task_environments.default_environment("") is None
  path = tmp_path / "env.json"
  path.write_text(json.dumps({"python": "3.11", "pip": ["attrs==23.2.0"]}))
  assert task_environments.default_environment(str(path)).pip == ("attrs==23.2.0",)
  with pytest.raises(ValueError, match=r"^rl.default_environment='bookworm': expected"):
    task_environments.default_environment("bookworm", "rl.default_environment")
  with pytest.raises(ValueError, match=r"default_environment='/nope.toml': no such spec file"):
    task_environments.default_environment("/nope.toml")
  path.write_text(json.dumps({"pip": ["-e ."]}))
  with pytest.raises(ValueError, match=r"env.json: environment.pip\[0\]"):
    task_environments.default_environment(str(path))


def test_the_demos_tasks_start_from_the_environment(bookworm_pytest, tmp_path, monkeypatch):
  """configs/demo.py: the RL stage's generated tasks and the held-out eval's carry the
  environment, which the demo builds at start, and their verifier's sandboxes start from it."""
  from configs import demo
  from trainer import demo as demo_lib
  from trainer.tasks import TaskSource, held_out_tasks
  env, rootfs = bookworm_pytest
  config = demo.get_config()
  assert demo_lib.prepare_environment(config) == [rootfs]
  rl_cfg = config.rl
  rl_cfg.eval.num_tasks = 2
  rl_cfg.rl.prompts_per_step = 2
  tasks = TaskSource(rl_cfg, str(tmp_path)).for_step(1) + held_out_tasks(
      rl_cfg, str(tmp_path / "eval"))
  assert len(tasks) == 4 and all(t.environment == env for t in tasks)
  import envs.episode as episode
  real, seen = episode.create_sandbox, []

  async def recording(backend, **kw):
    seen.append(kw.get("rootfs"))
    return await real(backend, **kw)
  monkeypatch.setattr(episode, "create_sandbox", recording)
  task = tasks[0]
  gold = asyncio.run(verify_tests(task, reference_files(task), make_sandbox_factory("bwrap")))
  assert gold.reward == 1.0 and seen == [rootfs], gold.details


def test_a_folder_of_rows_becomes_tasks_with_environments(tmp_path):
  """The README's two commands on the bundled rows without their `environment` field: the
  build command builds the one environment their repositories' metadata gives (pytest from
  PyPI: no packaging files), and the RL config with rl.env_from="repository" loads the rows
  with it; gold is resolved in it."""
  import shutil
  import subprocess
  import sys
  from configs import rl as rl_config
  from envs.environments import from_repository
  from trainer.tasks import TaskSource
  shutil.copytree(os.path.dirname(SWE), tmp_path / "swe")
  rows = [json.loads(line) for line in open(SWE)]
  with open(tmp_path / "swe" / "rows.jsonl", "w") as f:
    f.writelines(json.dumps({k: v for k, v in r.items() if k != "environment"}) + "\n"
                 for r in rows)
  out = subprocess.run([sys.executable, "-m", "envs.environments", "build", "--tasks",
                        str(tmp_path / "swe" / "rows.jsonl"), "--env_from", "repository",
                        "--workers", "2"], cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  (built,) = [json.loads(line) for line in out.stdout.splitlines()]
  env = from_repository({"tests/test_a.py": b""})
  assert built["key"] == env.key and os.path.isdir(built["rootfs"])
  config = rl_config.get_config("qwen2.5-coder")
  config.rl.tasks, config.rl.env_from = str(tmp_path / "swe" / "rows.jsonl"), "repository"
  config.rl.prompts_per_step = len(rows)
  tasks = TaskSource(config, str(tmp_path / "work")).for_step(1)
  assert [t.environment for t in tasks] == [env] * len(rows)
  gold = asyncio.run(verify_tests(tasks[0], reference_files(tasks[0]),
                                  make_sandbox_factory("bwrap")))
  assert gold.reward == 1.0, gold.details
  assert f"pytest {BOOKWORM_PYTEST}" not in versions(tasks[0])  # PyPI's pytest, not Debian's


def test_the_demos_sft_episodes_start_from_the_environment(bookworm_pytest, monkeypatch):
  """configs/sft_demo.py (and the demo's SFT stage) records its scripted episodes with
  data.demo.environment: the tools' and the tests' sandboxes start from its build. The pinned
  losses of tests/test_sft.py::test_the_demo_sft_stage_computes_what_it_computed are those
  episodes' (unchanged: same Python, same pytest)."""
  from configs import sft_demo
  from envs.chat import make_chat
  from trainer import demo_data
  env, rootfs = bookworm_pytest
  assert sft_demo.get_config().data.demo.environment == "bookworm-pytest"
  import envs.episode as episode
  real, seen = episode.create_sandbox, []

  async def recording(backend, **kw):
    seen.append(kw.get("rootfs"))
    return await real(backend, **kw)
  monkeypatch.setattr(episode, "create_sandbox", recording)
  chat = make_chat("chatml", demo_data.ByteTokenizer(["<|im_start|>", "<|im_end|>"]))
  (t,) = demo_data.demo_trajectories(chat, 1, seed=3, verify=True, environment="bookworm-pytest")
  assert t.reward == 1.0 and seen == [rootfs, rootfs]  # the agent's sandbox, the verifier's
