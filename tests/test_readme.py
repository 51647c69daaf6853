"""Every command and snippet in README.md, as a new user would run it from a fresh clone.

Each fenced command is listed in COMMANDS with how it is checked: run as written where that is
cheap, its config validated where the run itself is long (the trainer's start-up checks are
what a user meets first), or the test that runs it. A README command missing from COMMANDS
fails `test_every_readme_command_is_covered`.
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# command prefix -> how it is checked
COMMANDS = {
    "make test": "CI: .ci/run runs it on a clean clone",
    "make demo": "validate configs/demo.py (below); tests/test_rl.py runs a shortened demo",
    "python -m trainer.main --config=configs/NAME.py[:ARG]": "the syntax line",
    "python -m trainer.main --config=configs/sft_demo.py --config.mode=eval": "tests/"
        "test_eval_formats.py runs mode eval on generated, LiveCodeBench and Terminal-Bench tasks",
    "python -m trainer.main --config=configs/sft_demo.py": "run its start-up checks (below)",
    "python -m trainer.main --config=configs/sft.py:qwen3": "a template: fails naming the "
                                                            "placeholder (below)",
    "python -m launch.": "tests/test_launch.py runs every README launch command",
    "python -m models.hf import": "a template (IN, OUT): tests/test_hf.py::test_cli_import_export",
    "python -m models.hf export": "a template (IN, OUT): tests/test_hf.py::test_cli_import_export",
    "python -m trainer.export": "a template (WORKDIR, OUT): tests/test_sft.py::"
                                "test_start_from_an_hf_checkpoint_then_from_the_run",
    "python -m trainer.aot": "tests/test_aot.py compiles from the command line (v6e) and "
                             "runs the search",
    "git clone --mirror": "a template (a mirror of a SWE-bench repository): tests/test_tasks.py::"
                          "test_official_rows_check_out_from_a_mirror makes and reads one",
    "export ARBOR_SWE_MIRROR=": "the mirror and checkout folders: tests/test_tasks.py::"
                                "test_official_rows_check_out_from_a_mirror",
    "python -m trainer.main --config=configs/rl.py --config.rl.tasks=": "a template (a SWE-bench "
        "Parquet file): tests/test_tasks.py loads official rows, tests/test_rl.py runs RL",
    "python -m envs.synth": "tests/test_synth.py::test_command_line_resumes",
    "python -m envs.environments build --tasks /data/rows.jsonl --env_from repository": "a "
        "template: tests/test_task_environments.py::test_a_folder_of_rows_becomes_tasks_with_"
        "environments runs it on the bundled rows",
    "python -m trainer.main --config=configs/rl.py:qwen2.5-coder --config.model.init=hf:HF_DIR "
    "--config.rl.tasks=": "a template (HF_DIR): tests/test_task_environments.py::test_a_folder_"
                          "of_rows_becomes_tasks_with_environments loads the rows with it",
    "python -m envs.environments build": "a template (a SWE table and mirrors): tests/"
                                         "test_environments.py::"
                                         "test_task_environment_starts_the_sandbox",
    "sudo .venv/bin/python -m envs.sandbox.docker_engine": "make test runs it; tests/"
                                                           "test_sandbox.py::"
                                                           "test_docker_engine_found_or_explained",
    "python -m envs.validate": "tests/test_synth.py::test_validate_rejects_hand_broken_rows",
    "python -m envs.pypi_tasks": "minutes: docs/benchmarks.md records its run; tests/"
                                 "test_pypi_tasks.py synthesizes from a bundled package",
    "python -m trainer.rejection": "tests/test_rejection.py: the command line with a completions "
                                   "teacher; RFT rounds",
    "python -m envs.scaffolds": "tests/test_scaffolds.py runs list and check; tests/"
                                "test_blackbox_rollouts.py::test_show_prints_a_session_file",
    "python -m envs.decontam": "tests/test_decontam.py::test_command_line_writes_the_clean_records",
    "python -m benchmarks.sizing": "run (below)",
    "python -m benchmarks.": "minutes each: docs/benchmarks.md records their runs",
}


def readme_blocks(language: str) -> list[str]:
  with open(os.path.join(ROOT, "README.md")) as f:
    text = f.read()
  return [m.group(1) for m in re.finditer(rf"```{language}\n(.*?)```", text, re.S)]


def readme_commands() -> list[str]:
  """The README's shell commands, continuation lines joined, comments (whole lines or
  trailing) dropped."""
  out = []
  for block in readme_blocks("sh"):
    for command in block.replace("\\\n", " ").splitlines():
      command = re.sub(r"(^|\s+)#.*$", "", command).strip()
      if command:
        out.append(re.sub(r"\s+", " ", command))
  return out


def check_of(command: str) -> str:
  for prefix, how in COMMANDS.items():
    if command.startswith(prefix):
      return how
  raise AssertionError(f"README command not covered by tests/test_readme.py: {command}")


def run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
  return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_every_readme_command_is_covered():
  commands = readme_commands()
  assert len(commands) >= 10
  for command in commands:
    check_of(command)


def test_the_readme_python_snippet_runs():
  (snippet,) = readme_blocks("python")
  out = run([sys.executable, "-c", snippet + "\nprint(logits.shape, len(new_tokens[0]))"])
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split()[-1] == "8"


@pytest.mark.parametrize("config", ["configs/demo.py", "configs/sft_demo.py"])
def test_the_demo_commands_pass_their_start_up_checks(config, tmp_path):
  """What `make demo` and the SFT demo command check before any device is touched."""
  code = ("import sys; from trainer import config as c, main as m; "
          f"c.validate(m._load_config_file(['--config={config}']), sys.argv[1]); print('ok')")
  out = run([sys.executable, "-c", code, str(tmp_path / "work")])
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_the_sft_template_names_its_placeholder(tmp_path):
  """The template command as written (HF_DIR is a placeholder): a one-line config error naming
  the field, exit status 2, in seconds."""
  (command,) = [c for c in readme_commands() if "configs/sft.py:qwen3" in c]
  args = command.split()[1:]
  args = [a.replace("DIR", str(tmp_path / "work")) if a.startswith("--workdir") else a
          for a in args]
  args = [re.sub(r"=\"(.*)\"$", r"=\1", a) for a in args]  # the shell's quotes
  out = run([sys.executable, *args], timeout=120)
  assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
  assert out.stderr.strip().startswith("config error: config.model.init='hf:HF_DIR'")


def test_the_sizing_command_runs():
  out = run([sys.executable, "-m", "benchmarks.sizing"], timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.strip()
