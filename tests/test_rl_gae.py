"""`rl.advantage = "gae"` in the RL loop (trainer/rl.py): the learned critic trains every step, the
policy only after `rl.critic_warmup_steps`, and the critic's state is checkpointed so a resumed
run continues exactly; config validation of the critic's fields.

The runs use a tiny random-weight model and a rollout source of synthetic groups (random
tokens, random rewards, a fixed sequence per step), so the loop's training path runs without
sandboxes or sampling: the same steps, checkpoints and resume as a real run.
"""

from __future__ import annotations

import os
import shutil

import jax
import numpy as np
import pytest

from configs.base import base_config
from envs.trajectory import LLMCall, Trajectory
from tests.test_chat import _tiny_bpe
from trainer import checkpoint, harness, rl
from trainer import config as config_lib
from trainer import groups as groups_lib
from trainer import optim
from trainer import state as state_lib
from trainer.metrics import read_jsonl

WARMUP = 2  # the policy trains from step 3 on
EPOCHS = 2  # the policy makes two passes over a step's micro-batches
CRITIC_EPOCHS = 3  # and the critic three


class SyntheticGroups:
  """A rollout source: step s gives 2 groups of 2 one-call episodes (a shared prompt each),
  the same ones whenever step s is drawn, with rewards that differ within a group."""

  def __init__(self, *args, **kwargs):
    del args, kwargs

  def take(self, step: int, version: int) -> tuple[list[list], list, dict]:
    rng = np.random.default_rng(step)
    groups = []
    for g in range(2):
      prompt = rng.integers(1, 200, 10).tolist()
      group = []
      for t in range(2):
        out = rng.integers(1, 200, 6).tolist()
        call = LLMCall(prompt, out, (-rng.exponential(size=6)).tolist(), policy_version=version)
        group.append(Trajectory([call], reward=float(t + rng.normal(0, 0.1)),
                                task_id=f"task-{step}-{g}", group_id=f"{step}-{g}",
                                termination="submitted", trajectory_id=f"s{step}g{g}t{t}"))
      groups.append(group)
    return groups, [], {}

  def consumed(self, groups, dropped) -> None:
    del groups, dropped

  def checkpoint_extra(self) -> dict:
    return {}

  def close(self) -> None:
    pass


def gae_config(tokenizer: str, steps: int):
  c = base_config()
  c.mode, c.seed, c.loss.name = "rl", 0, "ppo"
  c.model.init, c.model.preset = "random", "tiny-dense"
  c.model.overrides.num_layers = 1
  c.model.overrides.vocab_size = 512
  c.model.overrides.attention_impl = "xla"
  c.tokenizer.path, c.tokenizer.chat_format = tokenizer, "qwen2.5"
  c.rl.prompts_per_step, c.rl.group_size = 2, 2
  c.rl.max_new_tokens, c.rl.max_turns, c.rl.max_context_tokens = 8, 1, 128
  c.rl.concurrency = 2
  c.rl.advantage = "gae"
  c.rl.critic_lr = 1e-3
  c.rl.critic_warmup_steps = WARMUP
  c.rl.epochs = EPOCHS
  c.rl.critic_epochs = CRITIC_EPOCHS
  c.data.row_len = 128
  c.optimizer.learning_rate = 1e-3
  c.train.steps = steps
  c.train.checkpoint_every = 1
  c.checkpoint.async_save = False
  for field in ("report", "tensorboard", "progress"):
    c.metrics[field] = False
  return c


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """A 3-step run, and a 2-step run resumed for its third step."""
  d = tmp_path_factory.mktemp("rl_gae")
  (d / "tokenizer").mkdir()
  _tiny_bpe().save(str(d / "tokenizer" / "tokenizer.json"))
  (d / "tokenizer" / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
  mp = pytest.MonkeyPatch()
  mp.setattr(rl, "make_source", SyntheticGroups)
  mp.setattr(rl, "TaskSource", lambda config, workdir: None)
  out = {}
  try:
    for name, steps in (("straight", 3), ("resumed", 2), ("resumed", 3)):
      c = gae_config(str(d / "tokenizer"), steps)
      work = str(d / name)
      config_lib.validate(c, work)
      rl.run(c, work)
      out[name] = work
      if steps == 2:  # the policy before its first update
        out["after_warmup"] = harness.run_weights(work)[0]
  finally:
    mp.undo()
  out["config"] = c
  return out


def _lines(work: str) -> dict[int, dict]:
  return read_jsonl(os.path.join(work, "rl", "metrics.jsonl"))


def _critic(work: str, step: int):
  with checkpoint.Checkpointer(os.path.join(work, "critic_checkpoints")) as ckpt:
    return ckpt.restore(step).state


def test_critic_trains_every_step_and_the_policy_after_warmup(runs):
  lines = _lines(runs["straight"])
  assert sorted(lines) == [1, 2, 3]
  for step, line in lines.items():
    assert np.isfinite(line["value_loss"]) and line["value_loss"] > 0, line
    assert 0 <= line["value_clip_fraction"] <= 1 and np.isfinite(line["value_error"])
    assert ("loss" in line) == (step > WARMUP), (step, sorted(line))
  assert lines[3]["policy_version"] == EPOCHS  # the policy's updates, all at step 3
  # the critic: a zero value head at the start (value_head.ValueHead), fitted since
  first, last = _critic(runs["straight"], 1), _critic(runs["straight"], 3)
  head = np.asarray(last["params"]["head"]["weight"]["value"])
  # one update per critic epoch (rl.critic_epochs), whatever the policy makes
  assert np.abs(head).max() > 0 and int(np.asarray(last["step"])) == 3 * CRITIC_EPOCHS
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(first["params"]),
                                                       jax.tree.leaves(last["params"])))
  # the policy: untouched through the warm-up (compared with the seed's initial weights)
  model_cfg = config_lib.model_config(runs["config"])
  initial = state_lib.create(model_cfg, optim.build(runs["config"].optimizer, model_cfg), seed=0)
  for a, b in zip(jax.tree.leaves(initial.params), jax.tree.leaves(runs["after_warmup"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  trained = harness.run_weights(runs["straight"])[0]
  assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
      jax.tree.leaves(initial.params), jax.tree.leaves(trained)))


def test_a_resumed_run_continues_exactly(runs):
  got, want = _lines(runs["resumed"]), _lines(runs["straight"])
  for key in ("value_loss", "value_error", "loss", "reward_mean"):
    np.testing.assert_allclose(got[3][key], want[3][key], rtol=1e-5, err_msg=key)
  for a, b in zip(jax.tree.leaves(_critic(runs["resumed"], 3)),
                  jax.tree.leaves(_critic(runs["straight"], 3))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
  for a, b in zip(jax.tree.leaves(harness.run_weights(runs["resumed"])[0]),
                  jax.tree.leaves(harness.run_weights(runs["straight"])[0])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_resume_without_the_critic_state_fails_clearly(runs, tmp_path, monkeypatch):
  work = tmp_path / "copy"
  shutil.copytree(runs["straight"], work)
  shutil.rmtree(work / "critic_checkpoints" / "3")
  c = gae_config(runs["config"].tokenizer.path, 4)
  monkeypatch.setattr(rl, "make_source", SyntheticGroups)
  monkeypatch.setattr(rl, "TaskSource", lambda config, workdir: None)
  with pytest.raises(FileNotFoundError, match="step 3 has no 'critic' state"):
    rl.run(c, str(work))


def test_per_trajectory_advantages_are_placeholders():
  groups, _, _ = SyntheticGroups().take(1, 0)
  for adv in groups_lib.advantages_of(groups, "gae"):
    np.testing.assert_array_equal(adv, np.zeros(2, np.float32))


@pytest.mark.parametrize("field, value, message", [
    ("gae_gamma", 1.5, r"a number in \[0.0, 1.0\]"),
    ("gae_lambda", -0.1, r"a number in \[0.0, 1.0\]"),
    ("value_clip", -0.2, r"a number in \[0.0, inf\]"),
    ("critic_lr", 0.0, r"a number in \(0.0, inf\]"),
    ("critic_warmup_steps", -1, "an integer >= 0"),
    ("critic_epochs", -1, "an integer >= 0"),
])
def test_critic_fields_are_range_checked(field, value, message):
  c = gae_config("", 2)
  c.rl[field] = value
  with pytest.raises(config_lib.ConfigError, match=rf"config\.rl\.{field}={value!r}: .*{message}"):
    config_lib.validate(c, files=False)


def test_gae_takes_a_mesh_and_refuses_lora():
  c = gae_config("", 2)
  c.mesh.data = 2
  config_lib.validate(c, files=False)  # the critic is sharded like the policy
  c = gae_config("", 2)
  c.model.lora.rank = 4
  with pytest.raises(config_lib.ConfigError, match=r"rl\.advantage='gae'.*LoRA"):
    config_lib.validate(c, files=False)
