"""The RL loop (trainer/rl.py) and the demo pipeline (trainer/demo.py) through `trainer.main`.

One shortened demo (tokenizer -> SFT -> held-out eval -> RL -> eval, one seed) runs as a
subprocess; its SFT checkpoint then starts two LoRA RL runs of the same config file: an
uninterrupted reference, and a run SIGKILLed once its first checkpoint (adapters alone) is
committed and rerun with the same command (the frozen base rebuilt from the SFT checkpoint). References: the verifier's own test counts (rewards come from pytest
runs in bwrap sandboxes), the SFT weights (RL changed them), the reference run's metrics
(determinism: same seed, same first steps), the logged trajectory ids (none trained twice).
The helpers (filters, advantages, batching) are checked against NumPy transcriptions.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from envs.trajectory import LLMCall, Trajectory
from trainer import groups as groups_lib
from trainer.metrics import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RL_STEPS = 2
NOT_DETERMINISTIC = ("wall_time", "time/", "tokens_per_s", "trajectory_ids", "engine/")

# The demo config shrunk: 2-layer model, 4 SFT steps, 2 RL steps of 2 tasks x 2 episodes,
# 4 held-out tasks. No group is dropped for constant rewards and an entropy bonus is on, so the
# RL stage trains (and changes the weights) even when every episode fails.
DEMO = '''
from configs import demo


def get_config(arg=None):
  c = demo.get_config()
  c.seeds = (0,)
  s = c.sft
  s.compile_cache_dir = {cache!r}
  s.model.preset = "tiny-moe-mla"  # half the demo model's width
  s.model.overrides.num_layers = 2
  s.model.overrides.vocab_size = 512
  s.model.overrides.attention_impl = "xla"
  s.tokenizer.train_vocab_size = 512
  s.tokenizer.train_episodes = 8
  s.data.demo.episodes = 16
  s.data.demo.eval_episodes = 0
  s.data.max_group_size = 2
  s.train.steps = 4
  s.optimizer.warmup_steps = 2
  s.train.eval_every = 0
  s.train.checkpoint_every = 4
  s.train.log_every = 2
  r = c.rl
  r.compile_cache_dir = {cache!r}
  r.rl.prompts_per_step = 2
  r.rl.group_size = 2
  r.rl.max_new_tokens = 48
  r.rl.max_turns = 2
  r.rl.max_context_tokens = 2048
  r.rl.concurrency = 4
  r.rl.drop_constant_groups = False
  r.rl.fixed_batch_shape = True  # one compiled step for every step and every process
  r.loss.entropy_coef = 0.01
  r.data.row_len = 2048
  r.train.steps = {steps}
  r.train.checkpoint_every = 1
  r.checkpoint.async_save = False
  r.eval.num_tasks = 4
  return c
'''

# The demo's RL stage as its own config, starting from the demo run's SFT checkpoint, with
# LoRA adapters (rank 4) on the frozen SFT weights.
RL = '''
from tests_rl_demo_config import get_config as demo_config


def get_config(arg=None):
  demo = demo_config()
  c = demo.rl
  c.model.init, c.model.preset = "ckpt:{sft}", ""
  c.tokenizer.path = "{sft}/tokenizer"
  c.seed = 5
  c.model.lora.rank = 4
  c.metrics.report = False
  return c
'''


def run_main(config, workdir, *flags, timeout=600):
  out = subprocess.run([sys.executable, "-m", "trainer.main", f"--config={config}",
                        f"--workdir={workdir}", *flags], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout, env=_env(config))
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
  return out


def _env(config):
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(str(config)), ROOT,
                                       env.get("PYTHONPATH", "")])
  return env


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
  d = tmp_path_factory.mktemp("rl_demo")
  config = d / "tests_rl_demo_config.py"
  config.write_text(DEMO.format(cache=str(d / "xla_cache"), steps=RL_STEPS))
  out = run_main(config, d / "demo", timeout=900)
  rl_config = d / "rl_config.py"
  rl_config.write_text(RL.format(sft=d / "demo" / "seed_0" / "sft"))
  return {"dir": d, "workdir": d / "demo", "stdout": out.stdout, "rl_config": rl_config}


def _params(workdir):
  """The latest checkpoint's parameters of an Arbor run, as a flat list of arrays."""
  import jax
  import ml_collections
  from flax import nnx

  from trainer import config as config_lib
  from trainer import harness
  cfg = ml_collections.ConfigDict({"model": {"init": f"ckpt:{workdir}", "preset": "",
                                             "overrides": {}}, "mode": "rl"})
  model = harness.initial_model(cfg, config_lib.model_config(cfg))
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def test_demo_runs_every_stage_on_real_sandbox_rewards(demo_run):
  w = demo_run["workdir"]
  results = json.loads((w / "demo_results.json").read_text())
  seed = results["seeds"][0]
  assert results["tasks"] == 4 and 0.0 <= seed["sft_pass@1"] <= 1.0
  assert {"diff", "low", "high"} <= set(results["improvement"])
  assert (w / "demo_report.html").exists() and (w / "demo_report.png").exists()
  for stage in ("sft", "rl"):  # each stage's own curves (RL: no "kl" metric without a KL term)
    assert (w / "seed_0" / stage / stage / "report.html").exists(), stage
  for stage in ("sft", "rl"):
    per_task = json.loads((w / "seed_0" / f"eval_{stage}.json").read_text())["per_task"]
    assert len(per_task) == 4 and all(r in (0.0, 1.0) for r in per_task)
  m = read_jsonl(w / "seed_0" / "rl" / "rl" / "metrics.jsonl")
  assert sorted(m) == list(range(1, RL_STEPS + 1))
  for step in m.values():
    assert step["episodes"] == 4
    assert step["tests_run"] == 1.0  # every reward is a pytest verdict from a sandbox
    assert step["groups_trained"] == 2 and len(step["trajectory_ids"]) == 4
    assert {"loss", "reward_mean", "pass_rate", "response_tokens", "tree_token_ratio",
            "time/rollout", "time/train", "mismatch_kl_k3"} <= set(step)
    assert abs(step["mismatch_kl_k3"]) < 1e-4  # fp32 sampler = trainer
    # the MoE policy trains through the sampler's experts (routing replay, on by default)
    assert step["routing_flips"] == 0.0 and step["mismatch_max_abs_log_ratio"] < 1e-3
  before, after = _params(w / "seed_0" / "sft"), _params(w / "seed_0" / "rl")
  assert any(not np.array_equal(a, b) for a, b in zip(before, after)), "RL changed nothing"


def test_an_rl_run_exports_for_transformers(demo_run, tmp_path):
  """The RL stage's workdir as a Hugging Face directory: transformers' logits equal Arbor's."""
  import ml_collections
  import torch
  from transformers import AutoModelForCausalLM

  from tests.test_hf import arbor_logits
  from trainer import config as config_lib
  from trainer import export, harness
  w = demo_run["workdir"] / "seed_0" / "rl"
  info = export.export_run(str(w), str(tmp_path / "hf"))
  assert info["step"] == RL_STEPS and info["tensors"] > 0
  cfg = ml_collections.ConfigDict({"model": {"init": f"ckpt:{w}", "preset": "", "overrides": {
      "dtype": "float32"}}, "mode": "rl"})
  model_cfg = config_lib.model_config(cfg)
  ours = harness.initial_model(cfg, model_cfg)
  theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
  tokens = np.random.default_rng(0).integers(0, model_cfg.vocab_size, (2, 10))
  with torch.no_grad():
    want = theirs.eval()(torch.from_numpy(tokens).long()).logits.float().numpy()
  np.testing.assert_allclose(arbor_logits(ours, tokens), want, atol=1e-4, rtol=1e-4)
  # the run's own tokenizer (trained by the demo) and chat format, rendered by transformers
  from envs.chat import load_tokenizer, make_chat
  from tests.test_sft import assert_same_chat_rendering
  run_cfg = ml_collections.ConfigDict(json.loads((w / "config.json").read_text()))
  tok_dir = config_lib.tokenizer_source(run_cfg, str(w))
  assert "tokenizer.json" in info["files"] and "chat_template.jinja" in info["files"]
  chat = make_chat("chatml", load_tokenizer(tok_dir))
  assert_same_chat_rendering(tmp_path / "hf", chat)
  generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
  assert chat.end_id in np.atleast_1d(generation["eos_token_id"])  # stops at <|im_end|>


def comparable(metrics):
  return {k: v for k, v in metrics.items() if not any(k.startswith(p) for p in NOT_DETERMINISTIC)}


def assert_same_step(got, want):
  """Same metrics; floats to rounding: the sampler's log-probs may differ in the last bits with
  what the engine happened to prefill, decode and reuse together, which worker timing decides."""
  got, want = comparable(got), comparable(want)
  assert set(got) == set(want)
  for k, v in want.items():
    if isinstance(v, float):
      assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    else:
      assert got[k] == v, k


def test_rl_resumes_after_kill_and_is_deterministic(demo_run):
  d, config = demo_run["dir"], demo_run["rl_config"]
  run_main(config, d / "reference", "--config.train.steps=1")  # the step compared below
  reference = read_jsonl(d / "reference" / "rl" / "metrics.jsonl")
  workdir = d / "killed"
  proc = subprocess.Popen([sys.executable, "-m", "trainer.main", f"--config={config}",
                           f"--workdir={workdir}"], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=_env(config))
  committed, deadline = workdir / "checkpoints" / "1", time.time() + 600
  while not committed.exists() and proc.poll() is None and time.time() < deadline:
    time.sleep(0.01)
  proc.send_signal(signal.SIGKILL)
  output = proc.communicate()[0]
  assert proc.returncode == -signal.SIGKILL, f"the run ended before the kill:\n{output[-3000:]}"
  out = run_main(config, workdir)
  assert "resumed from the checkpoint of step" in out.stdout
  resumed = read_jsonl(workdir / "rl" / "metrics.jsonl")
  assert sorted(resumed) == list(range(1, RL_STEPS + 1))
  ids = [i for s in resumed.values() for i in s["trajectory_ids"]]
  assert len(ids) == len(set(ids)) == RL_STEPS * 4, "a trajectory was trained twice"
  # Determinism: the same seed gives the same first step (sampling seeds, weights, math).
  assert_same_step(resumed[1], reference[1])
  # After every sync the engine samples as the trainer's LoRA policy (it got the adapters);
  # the LoRA checkpoints leave the frozen base out.
  assert all(abs(m["mismatch_kl_k3"]) < 1e-4 for m in resumed.values())
  size = lambda d: sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
  sft = demo_run["workdir"] / "seed_0" / "sft" / "checkpoints"
  assert size(committed) < 0.5 * size(max((p for p in sft.iterdir() if p.name.isdigit()),
                                          key=lambda p: int(p.name)))


# ----------------------------------------------------------------------------- helpers


def _traj(reward, group, version=2, tid=None):
  call = LLMCall(input_ids=[1, 2, 3], output_ids=[4, 5], output_logprobs=[-0.5, -0.25],
                 policy_version=version)
  kw = {"trajectory_id": tid} if tid else {}
  return Trajectory(calls=[call], reward=reward, task_id=group, group_id=group,
                    termination="submitted", **kw)


def test_select_groups_drops_partial_consumed_stale_and_constant_groups():
  groups = [[_traj(1, "a"), _traj(0, "a")],             # kept
            [_traj(1, "b")],                             # partial
            [_traj(1, "c"), _traj(1, "c")],              # constant
            [_traj(1, "d", version=0), _traj(0, "d", version=3)],  # stale (oldest token v0)
            [_traj(0, "e", tid="seen"), _traj(1, "e")]]  # already trained
  kept, dropped, counts = groups_lib.select_groups(groups, group_size=2, drop_constant=True,
                                           min_version=1, consumed=frozenset({"seen"}))
  assert [g[0].group_id for g in kept] == ["a"]
  assert sorted(g[0].group_id for g in dropped) == ["b", "c", "d", "e"]
  assert counts == {"dropped/partial_groups": 1, "dropped/constant_groups": 1,
                    "dropped/stale_groups": 1, "dropped/consumed_groups": 1}


def test_advantages_are_group_normalised_rewards():
  rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0]]
  groups = [[_traj(r, str(i)) for r in g] for i, g in enumerate(rewards)]
  for got, r in zip(groups_lib.advantages_of(groups, "grpo"), rewards):
    r = np.asarray(r)
    np.testing.assert_allclose(got, (r - r.mean()) / (r.std() + 1e-6), rtol=1e-5)


def test_fixed_batch_shape_holds_every_step():
  """rl.fixed_batch_shape: the bounds of any update, so steps with one group or several, short
  or long trajectories, pack into the same arrays (one compiled step)."""
  import ml_collections

  from trainer.batches import BatchShape
  cfg = ml_collections.ConfigDict({"fixed_batch_shape": True, "prompts_per_step": 3,
                                   "minibatches": 2, "group_size": 2, "max_turns": 2,
                                   "max_new_tokens": 4})
  bounds = groups_lib.step_bounds(cfg)
  assert bounds == {"seqs": 4, "seq_len": 8, "micro_batches": 2}
  shape = BatchShape(row_len=128, rows=1, **bounds)
  long_call = LLMCall(input_ids=[1, 2], output_ids=list(range(3, 11)), output_logprobs=[-0.1] * 8,
                      policy_version=2)
  long = Trajectory(calls=[long_call], reward=1.0, task_id="b", group_id="b",
                    termination="submitted")
  one = [[_traj(1.0, "a"), _traj(0.0, "a")]]
  two = one + [[long, _traj(0.0, "b")]]
  for groups in (one, two):
    (_, mb), = groups_lib.micro_batches(groups, [np.array([0.5, -0.5])] * len(groups), shape,
                                        minibatches=1)
    assert np.asarray(mb.seq_tokens).shape == (2, 4, 8)
    assert np.asarray(mb.fields["logprobs"]).shape == (2, 4, 8)
  cfg.fixed_batch_shape = False
  assert groups_lib.step_bounds(cfg) == {"seqs": None, "seq_len": None, "micro_batches": None}


def test_micro_batches_and_minibatches():
  """Every sampled token is trained with the sampler's log-probs as π_old; the advantage and
  the reward are the trajectory's scalars."""
  from trainer.batches import BatchShape
  groups = [[_traj(1.0, "a"), _traj(0.0, "a")]]
  (part, mb), = groups_lib.micro_batches(
      groups, [np.array([0.5, -0.5])], BatchShape(row_len=128, rows=1, seqs=None, seq_len=None,
                                                  micro_batches=None), minibatches=1)
  assert part == groups
  valid = np.asarray(mb.seq_valid)[0, 0]
  assert np.asarray(mb.seq_tokens)[0, 0][valid].tolist() == [4, 5]
  np.testing.assert_allclose(np.asarray(mb.fields["logprobs"])[0, 0][valid], [-0.5, -0.25])
  np.testing.assert_array_equal(mb.fields["old_logprobs"], mb.fields["logprobs"])
  np.testing.assert_array_equal(np.asarray(mb.fields["loss_mask"])[0, 0][valid], [1.0, 1.0])
  np.testing.assert_allclose(np.asarray(mb.scalars["advantage"])[0, :2], [0.5, -0.5])
  np.testing.assert_allclose(np.asarray(mb.scalars["reward"])[0, :2], [1.0, 0.0])
  parts = groups_lib.split_minibatches(list(range(7)), 3)
  assert [len(p) for p in parts] == [2, 3, 2] and sum(parts, []) == list(range(7))
  assert groups_lib.split_minibatches([1], 4) == [[1]]
