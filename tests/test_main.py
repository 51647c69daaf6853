"""trainer.main start-up and trainer.config validation: bad values fail in seconds, naming the
field, the value and the valid choices; the shipped configs validate."""

import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

from trainer import config as config_lib
from trainer import main as main_lib
from configs.base import base_config
from trainer.config import ConfigError, validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args, env=None):
  """(returncode, stdout, stderr, seconds) of `python -m trainer.main ARGS`."""
  start = time.perf_counter()
  out = subprocess.run([sys.executable, "-m", "trainer.main", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, **(env or {})})
  return out.returncode, out.stdout, out.stderr, time.perf_counter() - start


def load(name, arg=None):
  import importlib
  module = importlib.import_module(f"configs.{name}")
  return module.get_config(arg) if arg is not None else module.get_config()


@pytest.fixture
def sft_config(tmp_path):
  """A valid SFT config on a file that exists (a demo tokenizer trained by the run)."""
  data = tmp_path / "train.jsonl"
  data.write_text('{"messages": [{"role": "user", "content": "hi"}, '
                  '{"role": "assistant", "content": "hello"}]}\n')
  c = base_config()
  c.data.sources = (str(data),)
  c.tokenizer.train_vocab_size = 256
  validate(c, str(tmp_path / "work"))
  return c


# ----------------------------------------------------------------------------- the real start-up


def test_bad_loss_fails_in_seconds_through_the_entry_point(tmp_path):
  rc, out, err, seconds = cli("--config=configs/sft_demo.py", "--config.loss.name=bogus",
                              f"--workdir={tmp_path / 'w'}")
  assert rc == 2, out + err
  # The goal (< 10 s) is measured, not asserted: about 3 s on an idle 2-core machine, more on a
  # loaded one. This bound only catches a start-up that goes on to build or train the model.
  assert seconds < 60, seconds
  line = err.strip().splitlines()[-1]
  assert line.startswith("config error: config.loss.name='bogus': expected one of")
  assert "'sft'" in line and "'cispo'" in line
  assert not (tmp_path / "w").exists()  # nothing was started


def test_unknown_override_key_names_the_fields_there(tmp_path):
  rc, out, err, seconds = cli("--config=configs/sft_demo.py", "--config.train.stepz=3",
                              f"--workdir={tmp_path}")
  assert rc == 2 and seconds < 60, out + err  # a hang guard; the < 10 s goal is measured
  assert "--config.train.stepz: config.train has no field 'stepz'" in err
  assert "'steps'" in err and "Traceback" not in err


def test_mesh_that_does_not_fit_the_devices_fails_after_device_discovery(tmp_path):
  # valid on its own (validate passes); only the device count (1 CPU device) rules it out
  rc, out, err, seconds = cli("--config=configs/sft_demo.py", "--config.mesh.fsdp=3",
                              f"--workdir={tmp_path / 'w'}")
  assert rc == 2 and seconds < 60, out + err  # a hang guard; the < 10 s goal is measured
  assert ("config error: config.mesh={'data': 1, 'fsdp': 3, 'tensor': 1, 'expert': 1, "
          "'sequence': 1}") in err
  assert "have 1" in err and "device count" in err


def test_multi_host_environment_is_checked():
  assert main_lib.initialize_distributed({}) == 1
  assert main_lib.initialize_distributed({"ARBOR_NUM_PROCESSES": "1"}) == 1
  with pytest.raises(ConfigError, match="ARBOR_NUM_PROCESSES='two'"):
    main_lib.initialize_distributed({"ARBOR_NUM_PROCESSES": "two"})
  with pytest.raises(ConfigError, match="JAX_COORDINATOR_ADDRESS is unset"):
    main_lib.initialize_distributed({"ARBOR_NUM_PROCESSES": "2", "ARBOR_PROCESS_ID": "0"})
  with pytest.raises(ConfigError, match=r"ARBOR_PROCESS_ID='2': expected an integer in \[0, 2\)"):
    main_lib.initialize_distributed({"ARBOR_NUM_PROCESSES": "2", "ARBOR_PROCESS_ID": "2",
                                     "JAX_COORDINATOR_ADDRESS": "10.0.0.2:8476"})


# ----------------------------------------------------------------------------- validation


CASES = [  # (field path, value, substrings of the message)
    ("mode", "train", ["config.mode='train'", "'smoke', 'sft', 'rl', 'distill', 'eval', 'serve'"]),
    ("loss.name", "grpo", ["config.loss.name='grpo'", "('sft',) for mode 'sft'"]),
    ("loss.aggregation", "mean", ["config.loss.aggregation='mean'", "token_mean"]),
    ("loss.kl_estimator", "k5", ["config.loss.kl_estimator='k5'", "'k3'"]),
    ("mesh.fsdp", 0, ["config.mesh.fsdp=0", "a positive integer or -1"]),
    ("mesh.tensor", -1, ["config.mesh=", "at most one axis may be -1"]),
    ("model.preset", "gpt-5", ["config.model.preset='gpt-5'", "'tiny-moe-mla'", "'qwen3-8b'"]),
    ("model.init", "s3:/x", ["config.model.init='s3:/x'", "'random', 'hf:<dir>', 'ckpt:<dir>'"]),
    ("model.init", "hf:/no/such/dir", ["config.model.preset='tiny-moe-mla'", "must be ''"]),
    ("model.overrides.dtype", "fp8", ["config.model", "ModelConfig.dtype='fp8'"]),
    ("data.sources", ("/no/such.jsonl",), ["config.data.sources: '/no/such.jsonl': no such file"]),
    ("data.row_len", 1000, ["config.data.row_len=1000", "a multiple of 128"]),
    ("data.group_by", "task", ["config.data.group_by='task'", "'field', 'prompt', 'system'"]),
    ("data.demo.sandbox", "docker", ["config.data.demo.sandbox='docker'", "('bwrap', 'local')"]),
    ("tokenizer.path", "/no/tok", ["config.tokenizer.path='/no/tok'", "no such file"]),
    ("tokenizer.chat_format", "llama", ["config.tokenizer.chat_format='llama'", "'qwen2.5'"]),
    ("tokenizer.train_vocab_size", 4096, ["config.tokenizer.train_vocab_size=4096",
                                          "vocab_size=256"]),
    ("train.steps", 0, ["config.train.steps=0", "an integer >= 1"]),
    ("train.checkpoint_every", -5, ["config.train.checkpoint_every=-5", ">= 0"]),
    ("train.checkpoint_every", 500, ["config.train.checkpoint_every=500", "<= train.steps=100"]),
    ("train.eval_every", 10, ["config.train.eval_every=10", "held-out data",
                              "data.eval_sources"]),
    ("optimizer.name", "sgd", ["config.optimizer.name='sgd'", "'adamw', 'muon'"]),
    ("optimizer.beta1", 0.9, ["config.optimizer.beta1: unknown field", "'b1'"]),
    ("metrics.dir", "gs://b/m", ["config.metrics.dir='gs://b/m'", "local directory"]),
    ("rl.loop", "overlap", ["config.rl.loop='overlap'", "('sync', 'async')"]),
    ("rl.queue_url", "http://q", ["config.rl.queue_url='http://q'", "redis://"]),
    ("rl.group_size", 1, ["config.rl.group_size=1", ">= 2"]),
    ("rl.correction", "clip", ["config.rl.correction='clip'", "'icepop'"]),
    ("rl.correction", "icepop", ["config.rl.correction='icepop'", "rl.recompute_old=True"]),
    ("distill.teachers", ("/x",), ["config.distill.teachers=", "'domain=ckpt:<dir>'"]),
    ("eval.samples", 0, ["config.eval.samples=0", ">= 1"]),
]


def set_field(config, path, value):
  *parents, leaf = path.split(".")
  node = config
  for p in parents:
    node = node[p]
  node[leaf] = value


@pytest.mark.parametrize("path,value,expected", CASES, ids=[f"{p}={v}" for p, v, _ in CASES])
def test_bad_value_names_the_field_and_the_choices(sft_config, tmp_path, path, value, expected):
  set_field(sft_config, path, value)
  start = time.perf_counter()
  with pytest.raises(ConfigError) as e:
    validate(sft_config, str(tmp_path / "work"))
  assert time.perf_counter() - start < 60  # a hang guard (the goal, < 10 s, is measured)
  for s in expected:
    assert s in str(e.value), str(e.value)


def test_unknown_model_override_and_unknown_section(sft_config, tmp_path):
  sft_config.model.overrides.num_expert = 4
  with pytest.raises(ConfigError, match=r"config.model.overrides.num_expert: not a ModelConfig "
                                        r"field; valid fields: \[.*'num_experts'"):
    validate(sft_config, str(tmp_path))
  del sft_config.model.overrides["num_expert"]
  sft_config.trainer = 1
  with pytest.raises(ConfigError, match=r"config.trainer: unknown field; valid fields: "
                                        r"\[.*'train'"):
    validate(sft_config, str(tmp_path))


def test_rl_mode_checks_its_own_fields(sft_config, tmp_path):
  sft_config.mode = "rl"
  sft_config.loss.name = "cispo"
  validate(sft_config, str(tmp_path))
  for field, value, expected in (
      ("loss.name", "sft", "config.loss.name='sft': expected one of"),
      ("rl.max_staleness", -1, "config.rl.max_staleness=-1"),
      ("rl.advantage", "ppo", "config.rl.advantage='ppo': expected one of ('grpo'"),
      ("rl.rollout_workers", "queue", "config.rl.queue_url='': expected 'memory' or a redis"),
      ("rl.sandbox", "remote", "config.rl.sandbox_url='': expected the sandbox server's"),
      ("rl.max_new_tokens", 9000, "config.rl.max_new_tokens=9000: expected fewer than")):
    bad = sft_config.copy_and_resolve_references()
    section, name = field.split(".")
    bad[section][name] = value
    with pytest.raises(ConfigError, match=re.escape(expected)):
      validate(bad, str(tmp_path))
  sft_config.rl.loop, sft_config.rl.max_staleness = "async", 0
  with pytest.raises(ConfigError, match="config.rl.max_staleness=0: expected an integer >= 1 "
                                        "with rl.loop='async'"):
    validate(sft_config, str(tmp_path))
  sft_config.rl.loop, sft_config.rl.rollout_workers = "sync", "queue"
  sft_config.rl.queue_url = "redis://127.0.0.1:6379"
  with pytest.raises(ConfigError, match="config.rl.max_staleness=0: expected an integer >= 1 "
                                        "with rl.rollout_workers='queue'"):
    validate(sft_config, str(tmp_path))


def test_distill_needs_teachers_and_demo_validates_its_stages(sft_config, tmp_path):
  sft_config.mode, sft_config.loss.name = "distill", "cispo"
  with pytest.raises(ConfigError, match=r"config.distill.teachers=\(\): mode 'distill'"):
    validate(sft_config, str(tmp_path))
  from configs import demo
  c = demo.get_config()
  validate(c, str(tmp_path))
  c.rl.loss.name = "bogus"
  with pytest.raises(ConfigError, match="config.rl.loss.name='bogus'"):
    validate(c, str(tmp_path))


def test_remote_workdir_needs_local_metrics_and_no_demo(sft_config):
  with pytest.raises(ConfigError, match="config.metrics.dir='': set a local directory"):
    validate(sft_config, "gs://bucket/run")
  sft_config.metrics.dir = "/tmp/m"
  with pytest.raises(ConfigError, match="generated demo data and tokenizers"):
    validate(sft_config, "gs://bucket/run")


def test_shipped_configs_validate(tmp_path):
  from models import hf, presets, transformer

  validate(load("smoke"), str(tmp_path))
  validate(load("smoke", "tiny-dense"), str(tmp_path))
  validate(load("sft_demo"), str(tmp_path))
  c = load("sft_demo")
  assert c.optimizer.total_steps == c.train.steps  # the schedule follows the budget
  c.train.steps = 123
  assert c.optimizer.total_steps == 123
  with pytest.raises(ConfigError, match=r"config.model.init='hf:/path/to/Qwen3-8B': no "
                                        "config.json"):
    validate(load("sft", "qwen3"), str(tmp_path))  # placeholders until given real paths
  hf_dir = tmp_path / "hf"
  hf.save(transformer.init(presets.get_preset("tiny-qwen3"), seed=0), hf_dir)
  # the qwen3 family renders with the checkpoint's own template (chat_format "template")
  (hf_dir / "chat_template.jinja").write_text(
      (pathlib.Path(__file__).parent / "data" / "chat_templates" / "qwen3.jinja").read_text())
  data = tmp_path / "train.jsonl"
  data.write_text("")
  for family in ("qwen2.5-coder", "qwen3", "deepseek-v3"):
    c = load("sft", family)
    c.model.init = f"hf:{hf_dir}"
    c.data.sources = c.data.eval_sources = (str(data),)
    validate(c, str(tmp_path / family))
    assert config_lib.model_config(c).dtype == "bfloat16"
    assert config_lib.tokenizer_source(c, "w") == str(hf_dir)  # the checkpoint's tokenizer
  with pytest.raises(ValueError, match="configs/sft.py:llama: expected one of"):
    load("sft", "llama")


def test_mesh_shape_against_the_device_count(sft_config):
  sft_config.data.rows_per_batch = 8
  assert config_lib.mesh_shape(sft_config, 8) == (1, 8, 1, 1, 1)
  sft_config.mesh.tensor = 2
  assert config_lib.mesh_shape(sft_config, 8) == (1, 4, 2, 1, 1)
  sft_config.mesh.sequence = 2  # the batch divisor is data x fsdp x expert only
  assert config_lib.mesh_shape(sft_config, 8) == (1, 2, 2, 1, 2)
  sft_config.data.row_len = 256
  sft_config.mesh.sequence = 3
  sft_config.mesh.tensor = 1
  with pytest.raises(ConfigError, match=r"config.data.row_len=256: expected a multiple of "
                                        r"mesh.sequence = 3"):
    config_lib.mesh_shape(sft_config, 6)
  sft_config.mesh.sequence = 1
  sft_config.mesh.tensor = 2
  sft_config.data.rows_per_batch = 2
  with pytest.raises(ConfigError, match=r"config.data.rows_per_batch=2: expected a multiple of "
                                        r"mesh data x fsdp x expert = 4"):
    config_lib.mesh_shape(sft_config, 8)
  sft_config.mesh.fsdp = 3
  with pytest.raises(ConfigError, match=r"config.mesh=.*needs 6 devices, have 8"):
    config_lib.mesh_shape(sft_config, 8)
