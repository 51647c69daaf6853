"""The SFT loop (trainer/sft.py) through the real entry point, `python -m trainer.main`.

Every training run is a subprocess with the same config file: an uninterrupted reference run,
and a run killed with SIGKILL after its first checkpoint, rerun with the same command and
stopped with SIGTERM (preemption) after a later one, rerun and stopped with Ctrl-C (SIGINT), and
rerun again to the end.
The references are independent of the loop: the initial weights drawn by `transformer.init`
with the config's seed, the uninterrupted run for the resumed one, and the metrics lines
(trajectory ids) of each step. The runs share a persistent XLA compilation cache, so only the
first one compiles.
"""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from envs.chat import load_tokenizer, make_chat
from trainer import config as config_lib
from trainer.metrics import read_jsonl
from trainer.tokenizer_train import train_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 10
CHECKPOINT_EVERY = 2
EVAL_EVERY = 5
VOCAB = 320
NOT_DETERMINISTIC = ("wall_time", "time/", "tokens_per_s")  # clocks


def call(name, **args):
  return {"role": "assistant", "content": None,
          "tool_calls": [{"function": {"name": name, "arguments": args}}]}


def record(i):
  """A short agent conversation, unique per i; every fourth one starts with a failed tool call
  (error-masked: in context, out of the loss)."""
  msgs = [{"role": "system", "content": "You fix bugs in small Python files."},
          {"role": "user", "content": f"Task {i}: f{i} in m{i}.py returns {i} - 1; it should "
                                      f"return {i} + 1."}]
  if i % 4 == 1:
    msgs += [{**call("read_file", path=f"src/m{i}.py"), "tool_error": True},
             {"role": "tool", "content": "error: no such file"}]
  msgs += [call("read_file", path=f"m{i}.py"),
           {"role": "tool", "content": f"def f{i}():\n    return {i} - 1\n"},
           {"role": "assistant", "content": f"Fixed: f{i} now returns {i} + 1."}]
  return {"messages": msgs}


CONFIG = '''
from configs.base import base_config


def get_config(arg=None):
  c = base_config()
  c.mode = "sft"
  c.seed = 3
  c.compile_cache_dir = {cache!r}
  c.model.preset = "tiny-moe-mla"
  c.model.overrides.vocab_size = {vocab}
  c.model.overrides.num_layers = 2
  c.model.overrides.attention_impl = "xla"
  c.tokenizer.path = {tok!r}
  c.data.sources = ({train!r},)
  c.data.eval_sources = ({eval!r},)
  c.data.row_len = 512
  c.data.rows_per_batch = 2
  c.data.max_seqs = 4
  c.data.seq_len = 256
  c.data.max_group_size = 3
  c.optimizer.learning_rate = 3e-3
  c.train.steps = {steps}
  c.train.eval_every = {eval_every}
  c.train.checkpoint_every = {checkpoint_every}
  c.train.log_every = 1
  c.checkpoint.keep = 2
  c.metrics.progress = False
  return c
'''


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
  """A tokenizer, 48 training and 8 held-out conversations, and the config file (its runs
  share a persistent compilation cache in the same directory)."""
  from trainer.sft_data import write_jsonl

  d = tmp_path_factory.mktemp("sft_assets")
  train = [record(i) for i in range(48)]
  held_out = [record(i) for i in range(48, 56)]
  texts = [m["content"] for r in train + held_out for m in r["messages"] if m["content"]]
  texts += [json.dumps(m["tool_calls"]) for r in train for m in r["messages"]
            if m.get("tool_calls")]
  train_tokenizer(texts, VOCAB, str(d / "tok"))
  write_jsonl(str(d / "train.jsonl"), train)
  write_jsonl(str(d / "eval.jsonl"), held_out)
  path = d / "sft_test_config.py"
  path.write_text(CONFIG.format(cache=str(d / "xla_cache"), vocab=VOCAB, tok=str(d / "tok"),
                                train=str(d / "train.jsonl"), eval=str(d / "eval.jsonl"),
                                steps=STEPS, eval_every=EVAL_EVERY,
                                checkpoint_every=CHECKPOINT_EVERY))
  return {"dir": d, "config": str(path)}


def command(assets, workdir, *overrides, config=None):
  return [sys.executable, "-m", "trainer.main", f"--config={config or assets['config']}",
          f"--workdir={workdir}", *overrides]


def run(assets, workdir, *overrides, config=None, timeout=300):
  out = subprocess.run(command(assets, workdir, *overrides, config=config), cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return out


def load_config(assets):
  import importlib.util
  spec = importlib.util.spec_from_file_location("sft_test_config", assets["config"])
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


@pytest.fixture(scope="module")
def reference(assets):
  """The uninterrupted run: {step: metrics}, workdir, stdout."""
  workdir = assets["dir"] / "reference"
  out = run(assets, workdir)
  return {"metrics": read_jsonl(workdir / "sft" / "metrics.jsonl"), "workdir": workdir,
          "stdout": out.stdout}


def interrupt(assets, workdir, step, sig):
  """Start the run, send `sig` once the checkpoint of `step` is committed (its directory is
  renamed into place), wait; (returncode, output)."""
  proc = subprocess.Popen(command(assets, workdir), cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  committed = workdir / "checkpoints" / str(step)
  deadline = time.time() + 240
  while not committed.exists() and proc.poll() is None and time.time() < deadline:
    time.sleep(0.01)
  proc.send_signal(sig)
  output = proc.communicate()[0]
  return proc.returncode, output


def checkpoint_steps(workdir):
  return sorted(int(s.name) for s in (workdir / "checkpoints").iterdir() if s.name.isdigit())


@pytest.fixture(scope="module")
def killed_and_resumed(assets, reference):
  """The same command four times in one workdir: SIGKILLed once the checkpoint of step 2 is
  committed, rerun and SIGTERMed (preemption) once that of step 4 is, rerun and interrupted with
  Ctrl-C (SIGINT) once that of step 6 is, rerun to the end.
  {"before": metrics.jsonl right after the kill, "after": after the last run, ...}."""
  del reference  # run after it: the compilation cache is warm, the kill lands mid-run
  workdir = assets["dir"] / "killed"
  metrics_path = workdir / "sft" / "metrics.jsonl"
  rc, output = interrupt(assets, workdir, CHECKPOINT_EVERY, signal.SIGKILL)
  assert rc == -signal.SIGKILL, f"the run ended before the kill:\n{output[-3000:]}"
  before, at_kill = read_jsonl(metrics_path), checkpoint_steps(workdir)
  rc, preempted = interrupt(assets, workdir, 2 * CHECKPOINT_EVERY, signal.SIGTERM)
  assert rc == 0, preempted[-3000:]
  at_term = checkpoint_steps(workdir)
  rc, ctrl_c = interrupt(assets, workdir, 3 * CHECKPOINT_EVERY, signal.SIGINT)
  assert rc == 0, ctrl_c[-3000:]
  at_int = checkpoint_steps(workdir)
  out = run(assets, workdir)
  return {"before": before, "after": read_jsonl(metrics_path), "workdir": workdir,
          "checkpoints_at_kill": at_kill, "preempted": preempted,
          "checkpoints_at_term": at_term, "ctrl_c": ctrl_c, "checkpoints_at_int": at_int,
          "stdout": out.stdout}


def comparable(metrics):
  return {k: v for k, v in metrics.items() if not any(k.startswith(p) for p in NOT_DETERMINISTIC)}


def test_sft_reduces_the_loss_and_changes_the_parameters(assets, reference):
  from models import transformer
  from trainer import checkpoint, optim
  from trainer import state as state_lib

  m = reference["metrics"]
  assert sorted(m) == list(range(1, STEPS + 1))
  losses = [m[s]["loss"] for s in m]
  assert np.mean(losses[-3:]) < losses[0] - 0.5, losses
  evals = [m[s]["eval/loss"] for s in m if "eval/loss" in m[s]]
  assert len(evals) == STEPS // EVAL_EVERY and evals[-1] < evals[0] < np.log(VOCAB), evals
  for s in m:  # the step's bookkeeping
    assert m[s]["row_tokens"] <= 2 * 512 and m[s]["loss_tokens"] == m[s]["num_tokens"]
    assert m[s]["tree_token_ratio"] == pytest.approx(m[s]["linear_tokens"] / m[s]["row_tokens"])
    assert m[s]["tree_token_ratio"] > 1  # three conversations share their system prompt
    assert len(m[s]["trajectory_ids"]) == m[s]["trajectories"] == m[s]["num_seqs"]
    assert {"lr", "grad_norm", "time/train", "time/data", "tokens_per_s"} <= set(m[s])
  workdir = reference["workdir"]
  assert (workdir / "sft" / "report.html").exists() and (workdir / "sft" / "report.png").exists()
  assert json.loads((workdir / "config.json").read_text())["train"]["steps"] == STEPS

  # The final checkpoint holds other weights than the initial ones, every parameter moved.
  config = load_config(assets)
  model_cfg = config_lib.model_config(config)
  opt = optim.build(config.optimizer, model_cfg)
  with checkpoint.Checkpointer(workdir / "checkpoints") as ckpt:
    assert ckpt.all_steps() == [STEPS - CHECKPOINT_EVERY, STEPS]  # keep = 2
    step, state, extra = ckpt.restore_latest(state_lib.abstract(model_cfg, opt))
  assert step == STEPS and int(state.step) == STEPS and int(state.policy_version) == STEPS
  assert extra["data"]["trajectories"] == sum(m[s]["trajectories"] for s in m)
  initial, _ = state_lib.split_model(transformer.init(model_cfg, seed=config.seed))
  moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))),
                       initial, state.params)
  assert all(jax.tree.leaves(moved)), moved


def test_kill_9_and_sigterm_then_rerun_resume_exactly(killed_and_resumed, reference):
  run_ = killed_and_resumed
  killed_at = max(run_["checkpoints_at_kill"])
  assert CHECKPOINT_EVERY <= killed_at < STEPS
  assert f"resumed from the checkpoint of step {killed_at}" in run_["preempted"]
  # SIGTERM: a checkpoint at the end of the step it arrived in, exit status 0
  terminated_at = max(run_["checkpoints_at_term"])
  assert 2 * CHECKPOINT_EVERY <= terminated_at < STEPS
  assert f"steps {killed_at + 1}..{terminated_at} done" in run_["preempted"]
  assert "(preempted)" in run_["preempted"]
  # Ctrl-C (SIGINT) behaves as SIGTERM: a checkpoint at the end of its step, exit status 0
  interrupted_at = max(run_["checkpoints_at_int"])
  assert 3 * CHECKPOINT_EVERY <= interrupted_at < STEPS
  assert f"resumed from the checkpoint of step {terminated_at}" in run_["ctrl_c"]
  assert f"steps {terminated_at + 1}..{interrupted_at} done" in run_["ctrl_c"]
  assert "(preempted)" in run_["ctrl_c"] and "Traceback" not in run_["ctrl_c"]
  resumed_from = interrupted_at
  assert f"resumed from the checkpoint of step {resumed_from}" in run_["stdout"]
  after, ref = run_["after"], reference["metrics"]
  # metrics.jsonl is the lineage of the final checkpoint: every step once, the same total
  assert sorted(after) == list(range(1, STEPS + 1))
  with open(run_["workdir"] / "sft" / "metrics.jsonl") as f:
    assert [json.loads(line)["step"] for line in f] == list(range(1, STEPS + 1))
  # the data iterator continued exactly: the same trajectories at every step as without the
  # kill, and none trained twice
  for s in range(1, STEPS + 1):
    assert after[s]["trajectory_ids"] == ref[s]["trajectory_ids"], s
  ids = [i for s in after for i in after[s]["trajectory_ids"]]
  assert len(ids) == len(set(ids))
  # ... and the restored state continued exactly (same weights, optimizer state, schedule)
  for s in range(resumed_from + 1, STEPS + 1):
    assert comparable(after[s]) == comparable(ref[s]), s
  with checkpoint_dir(run_["workdir"]) as ckpt:
    assert ckpt.latest_step() == STEPS


def test_rerun_with_a_changed_config(assets, reference, tmp_path):
  """A finished workdir rerun: a larger step budget resumes; a changed learning rate, model and
  data seed stop it in seconds with one line naming each changed field; allow_config_change
  resumes."""
  import shutil
  workdir = tmp_path / "run"
  shutil.copytree(reference["workdir"], workdir)

  def rerun(*overrides):
    start = time.perf_counter()
    out = subprocess.run(command(assets, workdir, *overrides), cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    return out, time.perf_counter() - start

  out, _ = rerun(f"--config.train.steps={STEPS + 1}")
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"resumed from the checkpoint of step {STEPS}" in out.stdout
  assert sorted(read_jsonl(workdir / "sft" / "metrics.jsonl"))[-1] == STEPS + 1
  # one rerun for the three fields: the same check names each (a process start saved)
  out, seconds = rerun(f"--config.train.steps={STEPS + 1}", "--config.optimizer.learning_rate=0.001",
                       "--config.model.overrides.num_layers=3", "--config.data.seed=5")
  assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("config error:"), out.stderr[-2000:]
  named = ["optimizer.learning_rate: 0.003 -> 0.001", "model.overrides.num_layers: 2 -> 3",
           "data.seed: 3 -> 5"]
  assert all(n in lines[0] for n in named) and "allow_config_change" in lines[0], lines[0]
  assert seconds < 60  # a hang guard: it stops before restoring anything
  out, _ = rerun(f"--config.train.steps={STEPS + 2}", "--config.optimizer.learning_rate=0.001",
                 "--config.allow_config_change=True")
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"resumed from the checkpoint of step {STEPS + 1}" in out.stdout


def test_a_missing_config_file_is_one_line(tmp_path):
  out = subprocess.run([sys.executable, "-m", "trainer.main", "--config=configs/nope.py",
                        f"--workdir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 2
  path = os.path.join(ROOT, "configs", "nope.py")
  assert out.stderr.strip().splitlines() == [
      f"config error: --config=configs/nope.py: no such file {path!r}"]


EXPORT_CHAT = [
    {"role": "system", "content": "Fix the bug."},
    {"role": "user", "content": "The tests fail:\n  AssertionError: 3 != 4"},
    {"role": "assistant", "content": "Reading it.", "tool_calls": [
        {"type": "function", "function": {"name": "read_file", "arguments": {"path": "a.py"}}}]},
    {"role": "tool", "content": "def add(a, b):\n    return a - b\n"},
    {"role": "assistant", "content": "Replace `a - b` by `a + b`."},
    {"role": "user", "content": "Thanks! naïve ✓"},
]


def assert_same_chat_rendering(hf_dir, chat):
  """transformers' AutoTokenizer on an exported directory renders conversations (tools, calls,
  results, generation prompt) to the ids the run's chat format renders."""
  from transformers import AutoTokenizer
  hf_tok = AutoTokenizer.from_pretrained(str(hf_dir))
  tools = [{"type": "function", "function": {
      "name": "read_file", "description": "Read a file.", "parameters": {
          "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
  for end in range(1, len(EXPORT_CHAT) + 1):
    for generation in (True, False):
      for t in (None, tools):
        want = hf_tok.apply_chat_template(EXPORT_CHAT[:end], tools=t, tokenize=True,
                                          return_dict=False, add_generation_prompt=generation)
        assert chat.render(EXPORT_CHAT[:end], t, generation).ids == want, (end, generation, t)


def checkpoint_dir(workdir):
  from trainer.checkpoint import Checkpointer
  return Checkpointer(workdir / "checkpoints")


def test_same_config_and_seed_give_identical_metrics(killed_and_resumed, reference):
  before, ref = killed_and_resumed["before"], reference["metrics"]
  assert len(before) >= CHECKPOINT_EVERY
  for s in before:  # the killed run's own first steps, before any resume
    assert comparable(before[s]) == comparable(ref[s]), s


def small_demo_config():
  """configs/sft_demo.py (the demo's model, optimizer and data pipeline) on fewer episodes."""
  from configs import sft_demo
  config = sft_demo.get_config()
  config.tokenizer.train_episodes = 16  # (the demo's vocabulary, from less text)
  config.data.demo.episodes = 6
  config.data.demo.eval_episodes = 3
  config.data.demo.error_rate = 1.0  # every edit after a failed one (few episodes here)
  return config


def test_demo_inputs_are_generated_once(tmp_path):
  """configs/sft_demo.py's inputs (no training): the trained tokenizer, scripted episodes in
  bwrap, held-out tasks disjoint from the training tasks; a second call reuses them."""
  from trainer import sft
  from trainer.data import make_sft_dataset

  config = small_demo_config()
  workdir = str(tmp_path)
  config_lib.validate(config, workdir)
  sft.prepare_demo(config, workdir)
  train_file, eval_file = (tmp_path / "data" / "train.jsonl"), (tmp_path / "data" / "eval.jsonl")
  stamp = (train_file.stat().st_mtime_ns, eval_file.stat().st_mtime_ns)
  train = [json.loads(line) for line in train_file.read_text().splitlines()]
  held_out = [json.loads(line) for line in eval_file.read_text().splitlines()]
  assert len(train) == 6 and len(held_out) == 3
  task = lambda r: next(m["content"] for m in r["messages"] if m["role"] == "user")
  assert not {task(r) for r in train} & {task(r) for r in held_out}
  assert any(m.get("tool_error") for r in train + held_out for m in r["messages"])
  calls = lambda r: [m["tool_calls"][0]["function"]["name"] for m in r["messages"]
                     if m["role"] == "assistant"]
  assert ["search", "read_file", "submit"] in [calls(r) for r in train]  # the noisy endings
  sft.prepare_demo(config, workdir)  # a resumed run: nothing is regenerated
  assert (train_file.stat().st_mtime_ns, eval_file.stat().st_mtime_ns) == stamp

  chat = make_chat("chatml", load_tokenizer(config_lib.tokenizer_source(config, workdir)))
  assert chat.tokenizer.vocab_size == config.tokenizer.train_vocab_size
  train_files, eval_files = sft.data_sources(config, workdir)
  step = next(iter(make_sft_dataset(config_lib.data_config(config, sources=train_files), chat)))
  assert step["batch"].tokens.shape == (1, 2, 2048)
  # the 6 episodes share the agent prompt: trees of max_group_size=4 and 2, in one step
  assert step["stats"]["trees"] == 2 and step["stats"]["trajectories"] == 6
  assert step["stats"]["linear_tokens"] > 3 * step["stats"]["row_tokens"]


def test_start_from_an_hf_checkpoint_then_from_the_run(assets, tmp_path):
  """configs/sft.py on a tiny Qwen3-like HF checkpoint (init=hf:DIR), then the weights a later
  run starts from with init=ckpt:<that run's workdir> and ckpt:<a `models.hf import` dir>."""
  from configs import sft as sft_template
  from models import hf, presets, transformer
  from trainer import checkpoint, harness, optim
  from trainer import state as state_lib

  hf_dir = tmp_path / "hf"
  hf.save(transformer.init(presets.get_preset("tiny-qwen3").replace(vocab_size=VOCAB), seed=5),
          hf_dir)
  workdir = tmp_path / "run"
  d = assets["dir"]
  run(assets, workdir, f"--config.model.init=hf:{hf_dir}", f"--config.tokenizer.path={d / 'tok'}",
      f"--config.data.sources=('{d / 'train.jsonl'}',)", "--config.data.eval_sources=()",
      "--config.model.overrides.dtype=float32", "--config.model.overrides.remat=none",
      "--config.model.overrides.attention_impl=xla", "--config.data.row_len=512",
      "--config.data.rows_per_batch=2", "--config.data.microbatches=1",
      "--config.data.max_seqs=4", "--config.data.seq_len=256", "--config.data.max_group_size=3",
      "--config.data.num_threads=1", "--config.train.steps=2", "--config.train.eval_every=0",
      "--config.optimizer.warmup_steps=1", "--config.optimizer.learning_rate=1e-3",
      "--config.train.checkpoint_every=0", f"--config.compile_cache_dir={d / 'xla_cache'}",
      "--config.metrics.progress=False", "--config.metrics.report=False",
      "--config.tokenizer.chat_format=chatml",  # the test tokenizer has no template of its own
      config="configs/sft.py:qwen3")
  m = read_jsonl(workdir / "sft" / "metrics.jsonl")
  assert sorted(m) == [1, 2]

  config = sft_template.get_config("qwen3")
  config.model.init = f"ckpt:{workdir}"
  model_cfg = config_lib.model_config(config)  # from the run's model_config.json
  assert (model_cfg.num_layers, model_cfg.qk_norm, model_cfg.dtype) == (2, True, "bfloat16")
  assert config_lib.tokenizer_source(config, "elsewhere") == str(d / "tok")  # the run's
  start, _ = state_lib.split_model(harness.initial_model(config, model_cfg))
  with checkpoint.Checkpointer(workdir / "checkpoints") as ckpt:
    trained = ckpt.restore_latest(state_lib.abstract(
        model_cfg, optim.build(config.optimizer, model_cfg)))
  original, _ = state_lib.split_model(hf.load(hf_dir))
  jax.tree.map(np.testing.assert_array_equal, start, trained.state.params)
  assert not all(jax.tree.leaves(jax.tree.map(np.array_equal, start, original)))

  hf.import_hf(str(hf_dir), str(tmp_path / "imported"))
  config.model.init = f"ckpt:{tmp_path / 'imported'}"
  start, _ = state_lib.split_model(harness.initial_model(config, config_lib.model_config(config)))
  jax.tree.map(np.testing.assert_array_equal, start, original)

  # the run exported for Hugging Face: transformers' logits equal the trained model's
  import torch
  from flax import nnx
  from transformers import AutoModelForCausalLM

  from tests.test_hf import arbor_logits
  from trainer import export
  out = tmp_path / "exported"
  info = export.export_run(str(workdir / "checkpoints" / str(trained.step)), str(out))
  assert info["step"] == trained.step and (out / "config.json").is_file()
  assert export.main(["--ckpt", str(tmp_path / "hf"), "--out", str(tmp_path / "x")]) == 2
  assert hf.main(["export", "--ckpt", str(workdir), "--out", str(tmp_path / "x")]) == 2
  assert export.run_and_step(str(workdir)) == (str(workdir), None)
  ours = nnx.merge(state_lib.graphdef(model_cfg.replace(dtype="float32")), trained.state.params,
                   trained.state.model_state)
  theirs = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
  tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 12))
  with torch.no_grad():
    want = theirs(torch.from_numpy(tokens).long()).logits.float().numpy()
  np.testing.assert_allclose(arbor_logits(ours, tokens), want, atol=1e-4, rtol=1e-4)
  assert_same_chat_rendering(out, make_chat("chatml", load_tokenizer(str(d / "tok"))))


# The demo SFT stage's losses on small_demo_config() for seed 0, steps 1-3. The run is
# deterministic; these values change only when what the demo computes changes (its data, tokenizer,
# model, optimizer or their numerics). Such a change must be explained, its effect on `make demo`
# measured, and the values recorded anew (they are printed on failure).
PINNED_DEMO_LOSSES = [7.599224090576172, 7.085326671600342, 6.339372158050537]


def test_the_demo_sft_stage_computes_what_it_computed(tmp_path):
  """Three steps of the demo's SFT stage (its model, Muon, tree batches of scripted bwrap
  episodes) give the pinned losses, to float32 rounding (1e-5 relative)."""
  from trainer import sft

  config = small_demo_config()
  config.train.steps = 3
  config.optimizer.warmup_steps = 1  # (the schedule spans the 3 steps)
  config.train.eval_every = 0
  config.train.checkpoint_every = 0
  config.data.num_threads = 1
  workdir = str(tmp_path)
  config_lib.validate(config, workdir)
  sft.run(config, workdir)
  metrics = read_jsonl(tmp_path / "sft" / "metrics.jsonl")
  losses = [metrics[s]["loss"] for s in sorted(metrics)]
  print("demo SFT losses:", losses)
  assert len(losses) == 3
  np.testing.assert_allclose(losses, PINNED_DEMO_LOSSES, rtol=1e-5)
