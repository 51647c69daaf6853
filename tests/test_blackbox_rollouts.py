"""Black-box scaffold sessions as training and eval data.

`envs.scaffolds.sessions` against hand-made gateway records (calls that do not extend each
other, malformed records, expert ids in both encodings), checked against the records
themselves and against `rl.tree.build_tree`'s trie; the scaffold mix of `trainer.blackbox`
(parsing, the per-task draw, config validation); and, with a tiny random-weight model, an eval
and a 1-step RL run whose tasks draw react or mini-swe-agent (run in bwrap through the run's
own gateway): every black-box episode's session becomes a trajectory, the eval reports pass@k
per scaffold, and the RL step trains on both scaffolds' trajectories. The shell tasks use the
bare environment, so the mini-swe-agent build is the one tests/test_scaffolds.py uses (cached by
content).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from envs.chat import make_chat
from envs.chat.tokenizer import HFTokenizer
from envs.environments import Environment
from envs.policy import encode_expert_ids
from envs.scaffolds.sessions import map_termination, session_tree, trajectory_from_session
from envs.tasks import Task
from envs.trajectory import TERMINATIONS, Trajectory
from rl.tree import build_tree, from_trajectory
from tests.test_chat import _tiny_bpe
from trainer import blackbox

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIX = "react:0.5,mini-swe-agent:0.5"
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bwrap")


def record(input_ids, output_ids, version=0, **extra):
  return {"input_ids": list(input_ids), "output_ids": list(output_ids),
          "logprobs": [-0.5 - 0.1 * i for i in range(len(output_ids))],
          "token_versions": [version] * len(output_ids), "policy_version": version,
          "finish_reason": "stop", "params": {"temperature": 1.0}, "time": 1.0,
          "protocol": "chat_completions", **extra}


# A session whose third call is a compacted history: it restarts from the system prompt
# [1, 2, 3] with a summary instead of extending the second call.
SESSION = [record([1, 2, 3, 10], [11, 12]),
           record([1, 2, 3, 10, 11, 12, 13], [14], version=1),
           record([1, 2, 3, 20, 21], [22, 23, 24], version=1)]


# ----------------------------------------------------------------------------- sessions


def test_session_becomes_a_trajectory_of_exactly_its_calls():
  t = trajectory_from_session(SESSION, reward=1.0, task_id="t", group_id="t/0",
                              termination="exited", metadata={"scaffold": "x"})
  assert (t.reward, t.task_id, t.group_id, t.termination) == (1.0, "t", "t/0", "exited")
  assert t.metadata == {"scaffold": "x"} and t.policy_version == 0
  assert len(t.calls) == len(SESSION)
  for c, r in zip(t.calls, SESSION):
    assert c.input_ids == r["input_ids"] and c.output_ids == r["output_ids"]
    assert c.output_logprobs == r["logprobs"] and c.token_versions == r["token_versions"]
    assert c.policy_version == r["policy_version"] and c.expert_ids is None
    assert c.expert_start == 0
    assert c.meta == {"protocol": "chat_completions", "finish_reason": "stop"}
  assert Trajectory.from_bytes(t.to_bytes()).calls == t.calls  # crosses the queue unchanged


def test_the_trie_of_a_session_shares_its_common_prefix():
  t = trajectory_from_session(SESSION, reward=0.0, task_id="t", group_id="t/0",
                              termination="exit_error")
  tree = build_tree([from_trajectory(t)])
  seqs = [r["input_ids"] + r["output_ids"] for r in SESSION]
  prefixes = {tuple(s[:n]) for s in seqs for n in range(1, len(s) + 1)}
  assert len(tree.tokens) == len(prefixes) == 13  # [1,2,3] is stored once, call 1 extends 0
  assert tree.tokens[:3].tolist() == [1, 2, 3] and tree.end[0] == len(tree.tokens)
  sampled = sum(len(r["output_ids"]) for r in SESSION)
  assert len(tree.seqs[0].index) == sampled  # every sampled token trained once
  np.testing.assert_allclose(tree.seqs[0].fields["logprobs"],
                             [lp for r in SESSION for lp in r["logprobs"]], rtol=1e-6)
  info = session_tree(SESSION)
  assert info["nodes"] == len(prefixes) and info["roots"] == 1
  assert info["shared_tokens"] == sum(map(len, seqs)) - len(prefixes)
  assert info["branch_points"] == [{"depth": 3, "children": 2, "calls": [0, 1, 2]}]
  assert [c["extends_previous"] for c in info["calls"]] == [False, True, False]
  assert [c["shared_tokens"] for c in info["calls"]] == [0, 6, 3]


DROP = object()  # a field left out of the record


@pytest.mark.parametrize("bad, message", [
    ({"input_ids": DROP}, "records[1].input_ids is missing"),
    ({"input_ids": [1, "x"]}, "records[1].input_ids[1]='x'"),
    ({"input_ids": []}, "records[1].input_ids is empty"),
    ({"output_ids": [5, 6.5], "logprobs": [0.0, 0.0]}, "records[1].output_ids[1]=6.5"),
    ({"logprobs": [-1.0, -2.0]}, "records[1].logprobs has 2 entries for 1 output_ids"),
    ({"token_versions": [0, 0]}, "records[1].token_versions has 2 entries"),
    ({"policy_version": "1"}, "records[1].policy_version='1'"),
    ({"expert_ids": np.zeros((3, 1, 2), np.int32)}, "records[1].expert_ids has shape (3, 1, 2)"),
    ({"expert_ids": {"shape": [1]}}, "records[1].expert_ids: not expert ids"),
])
def test_malformed_records_name_the_field(bad, message):
  good = record([1, 2], [3])
  broken = {k: v for k, v in {**good, **bad}.items() if v is not DROP}
  with pytest.raises(ValueError, match=re.escape(message)):
    trajectory_from_session([good, broken], reward=0.0, task_id="t", group_id="g",
                            termination="exited")
  with pytest.raises(ValueError, match="records: expected a list"):
    trajectory_from_session({"calls": []}, reward=0.0, task_id="t", group_id="g",
                            termination="exited")


def test_expert_ids_round_trip_from_either_encoding():
  rng = np.random.default_rng(0)
  a, b = rng.integers(0, 8, (4, 2, 2)), rng.integers(0, 8, (4, 2, 2))
  records = [record([1, 2, 3], [4, 5], expert_ids=encode_expert_ids(a)),  # the server's JSON
             record([1, 2, 3], [6, 7], expert_ids=a[::-1].copy()),  # an in-process array
             record([1, 2], [8, 9, 10], expert_ids=b)]
  t = trajectory_from_session(records, reward=0.0, task_id="t", group_id="g",
                              termination="timeout")
  np.testing.assert_array_equal(t.calls[0].expert_ids, a)
  np.testing.assert_array_equal(t.calls[1].expert_ids, a[::-1])
  np.testing.assert_array_equal(t.calls[2].expert_ids, b)
  back = Trajectory.from_bytes(t.to_bytes())
  for c, d in zip(t.calls, back.calls):
    np.testing.assert_array_equal(c.expert_ids, d.expert_ids)
  tree = build_tree([from_trajectory(t)])
  assert tree.experts is not None


def test_terminations_map_onto_trajectory_terminations():
  assert {r: map_termination(r) for r in ("exited", "exit_error", "timeout", "sandbox_error")} \
      == {"exited": "exited", "exit_error": "scaffold_error", "timeout": "timeout",
          "sandbox_error": "sandbox_error"}
  assert all(map_termination(t) == t for t in TERMINATIONS)
  with pytest.raises(ValueError, match="termination='crashed'"):
    map_termination("crashed")


def test_show_prints_a_session_file(tmp_path):
  path = tmp_path / "session.json"
  path.write_text(json.dumps({"session_id": "episode-1", "calls": SESSION}))
  out = subprocess.run([sys.executable, "-m", "envs.scaffolds", "show", str(path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert lines[0].startswith("session episode-1: 3 calls, 22 tokens, trie 13 nodes")
  assert "branch at depth 3: 2 children (calls 0, 1, 2)" in out.stdout
  assert len([ln for ln in lines if "chat_completions" in ln]) == 3
  out = subprocess.run([sys.executable, "-m", "envs.scaffolds", "show", str(path), "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert json.loads(out.stdout) == session_tree(SESSION)


# ----------------------------------------------------------------------------- scaffold mixes


def shell_task(name: str, **metadata) -> Task:
  return Task(instance_id=name, kind="shell", problem_statements=("Create done.txt.",),
              check_script="test -f /workspace/done.txt", check_parser="exit_code",
              environment=Environment.create(), agent_timeout=120, metadata=metadata)


def test_scaffold_mix_parses_draws_per_task_and_validates():
  assert blackbox.parse_scaffold_mix("react") == (("react", 1.0),)
  assert blackbox.parse_scaffold_mix("react:1, mini-swe-agent:3", "eval.scaffold") == (
      ("react", 0.25), ("mini-swe-agent", 0.75))
  for spec, message in [("nope", "unknown scaffold 'nope'"), ("react:0", "weight of 'react'"),
                        ("react:-1,codex", "weight of 'react'"), ("react:inf", "weight"),
                        ("react,react", "named twice"), ("", "expected a scaffold name")]:
    with pytest.raises(ValueError, match=f"config.rl.scaffold={spec!r}.*{message}"):
      blackbox.parse_scaffold_mix(spec, "rl.scaffold")
  mix = blackbox.parse_scaffold_mix(MIX)
  tasks = [shell_task(f"task-{i}") for i in range(200)]
  draws = [blackbox.draw_scaffold(mix, t, seed=0) for t in tasks]
  assert draws == [blackbox.draw_scaffold(mix, t, seed=0) for t in reversed(tasks)][::-1]
  assert 70 < draws.count("react") < 130  # about half
  assert draws != [blackbox.draw_scaffold(mix, t, seed=1) for t in tasks]  # the seed matters
  assert blackbox.draw_scaffold(mix, shell_task("x", scaffold="codex"), 0) == "codex"

  from configs.base import base_config
  from trainer import config as config_lib
  for field, value, other, message in [
      ("rl.scaffold", "claude", {}, "unknown scaffold 'claude'"),
      ("rl.scaffold", MIX, {"rl.sandbox": "local"}, "config.rl.sandbox='local'"),
      ("rl.scaffold", MIX, {"rl.rollout_workers": "queue", "rl.queue_url": "memory"},
       "config.rl.rollout_workers='queue'"),
      ("rl.scaffold", MIX, {"rl.rollout": "branching"}, "config.rl.rollout='branching'"),
      ("eval.scaffold", "mini-swe-agent:2", {"eval.selection": "majority_vote",
                                             "eval.samples": 2}, "eval.selection"),
      ("eval.scaffold", "react:x", {}, "weight of 'react'")]:
    c = base_config()
    c.mode, c.loss.name = "rl", "grpo"
    for key, v in {field: value, **other}.items():
      section, name = key.split(".")
      c[section][name] = v
    with pytest.raises(config_lib.ConfigError, match=rf"config\.{field}=.*{message}"):
      config_lib.validate(c, files=False)


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def chat():
  return make_chat("qwen2.5", HFTokenizer(_tiny_bpe(), eos_token="<|im_end|>"))


@pytest.fixture(scope="module")
def tasks():
  """Three shell tasks; with seed 0 the mix gives task 1 mini-swe-agent, the others react."""
  ts = [shell_task(f"bb-{i}") for i in range(3)]
  mix = blackbox.parse_scaffold_mix(MIX)
  assert [blackbox.draw_scaffold(mix, t, 0) for t in ts] == ["react", "mini-swe-agent", "react"]
  return ts


CONTEXT = 4096  # mini-swe-agent's prompt is ~2,500 tokens of the tiny tokenizer


@needs_bwrap
def test_eval_reports_pass_at_k_per_scaffold(chat, tasks):
  from envs.scaffold import ScaffoldConfig
  from models import transformer
  from models.engine import EngineConfig
  from models.presets import get_preset
  from trainer import evaluate as ev

  cfg = get_preset("tiny-moe-mla").replace(vocab_size=512)
  out = ev.evaluate(transformer.init(cfg, seed=0), cfg, chat, tasks,
                    engine_cfg=EngineConfig(slots=2, max_seq_len=CONTEXT, prefix_cache_rows=2,
                                            prefill_chunk=512, return_expert_ids=True),
                    scaffold=ScaffoldConfig(max_turns=1, max_new_tokens=8,
                                            max_context_tokens=CONTEXT),
                    concurrency=2, keep_trajectories=True, progress=False, scaffolds=MIX)
  assert out["errors"] == 0 and out["episodes"] == 3
  assert out["task_scaffolds"] == ["react", "mini-swe-agent", "react"]
  assert set(out["scaffolds"]) == {"react", "mini-swe-agent", "all"}
  assert out["scaffolds"]["react"]["tasks"] == 2 and out["scaffolds"]["mini-swe-agent"]["tasks"] == 1
  for r in out["scaffolds"].values():  # a random model solves nothing
    assert r["pass@k"] == 0.0 and r["interval"] == "wilson" and 0.0 == r["low"] < r["high"]
  json.dumps({k: v for k, v in out.items() if k != "trajectories"}, allow_nan=False)
  for task, (t,) in zip(tasks, out["trajectories"]):
    assert isinstance(t, Trajectory) and t.task_id == task.instance_id and t.calls
    assert t.metadata["scaffold"] == out["task_scaffolds"][tasks.index(task)]
  (mini,) = out["trajectories"][1]
  assert mini.termination in ("exited", "scaffold_error") and mini.metadata["session_id"]
  for c in mini.calls:  # the session's records: the gateway's protocol, the run's token cap
    assert c.meta["protocol"] == "chat_completions" and 1 <= len(c.output_ids) <= 8
    assert len(c.output_logprobs) == len(c.output_ids) and c.token_versions is not None
    # routing replay: the gateway's encoded experts of every position the engine fed
    assert c.expert_ids.shape == (len(c.input_ids) + len(c.output_ids) - 1,
                                  cfg.num_layers - cfg.first_k_dense_replace, cfg.experts_per_token)
  assert "Create done.txt." in chat.tokenizer.decode(mini.calls[0].input_ids)


RL_CONFIG = dict(prompts_per_step=2, group_size=2, max_new_tokens=8, max_turns=1,
                 max_context_tokens=CONTEXT, concurrency=4, drop_constant_groups=False,
                 scaffold=MIX)


@needs_bwrap
def test_rl_step_trains_on_both_scaffolds(tmp_path, tasks, monkeypatch):
  from configs.base import base_config
  from trainer import config as config_lib
  from trainer import rl
  from trainer.metrics import read_jsonl

  tok = tmp_path / "tokenizer"
  tok.mkdir()
  _tiny_bpe().save(str(tok / "tokenizer.json"))
  (tok / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
  c = base_config()
  c.mode, c.seed, c.loss.name = "rl", 0, "grpo"
  c.model.init, c.model.preset = "random", "tiny-moe-mla"
  c.model.overrides.num_layers = 2
  c.model.overrides.vocab_size = 512
  c.model.overrides.attention_impl = "xla"
  c.tokenizer.path, c.tokenizer.chat_format = str(tok), "qwen2.5"
  for key, value in RL_CONFIG.items():
    c.rl[key] = value
  c.data.row_len = CONTEXT  # a group's tree: the shared prompt once, then its episodes' tokens
  c.train.steps = 1
  c.train.checkpoint_every = 1
  c.checkpoint.async_save = False
  c.metrics.report = False
  c.metrics.tensorboard = False
  c.metrics.progress = False
  work = str(tmp_path / "work")
  config_lib.validate(c, work)

  class StepTasks:  # step s draws tasks 0 and 1 (react and mini-swe-agent under seed 0)
    def __init__(self, config, workdir):
      del config, workdir

    def for_step(self, step):
      return tasks[:2]
  monkeypatch.setattr(rl, "TaskSource", StepTasks)
  rl.run(c, work)
  line = read_jsonl(os.path.join(work, "rl", "metrics.jsonl"))[1]
  assert line["groups_trained"] == 2 and line["episodes"] == 4 and line["sequences"] == 4
  assert line["pass_rate/react"] == 0.0 and line["pass_rate/mini-swe-agent"] == 0.0
  assert line["episodes/react"] == line["episodes/mini-swe-agent"] == 2
  assert line["trained_episodes/react"] == line["trained_episodes/mini-swe-agent"] == 2
  assert len(line["trajectory_ids"]) == 4 and np.isfinite(line["loss"])
  # every sampled token of both scaffolds' episodes is in the loss (8 per episode at most)
  assert line["loss_tokens"] == line["episodes"] * line["response_tokens"] > 0


def test_rollout_worker_refuses_tasks_naming_a_blackbox_scaffold(tmp_path, caplog):
  from envs import rollout_worker

  path = tmp_path / "tasks.jsonl"
  rows = [{"id": "a", "kind": "exact", "prompt": "1 + 1?", "answer": "2"},
          {"id": "b", "kind": "exact", "prompt": "2 + 2?", "answer": "4",
           "scaffold": "mini-swe-agent"}]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  assert rollout_worker.main(["--policy_url", "http://127.0.0.1:1", "--queue",
                              "redis://127.0.0.1:1", "--tasks", str(path), "--tokenizer",
                              "unused"]) == 2
  assert "task 'b' has scaffold='mini-swe-agent'" in caplog.text


@needs_bwrap
def test_teacher_rollouts_sample_a_scaffold_mix(chat, tasks, tmp_path, capsys):
  from envs import aio
  from envs.policy import CompletionsPolicy, SamplingParams
  from envs.scaffold import ScaffoldConfig
  from models import transformer
  from models.engine import Engine, EngineConfig
  from models.presets import get_preset
  from trainer import rejection
  from trainer.serve import EnginePolicy

  scaffold = ScaffoldConfig(max_turns=1, max_new_tokens=8, max_context_tokens=CONTEXT)
  with pytest.raises(ValueError, match="black-box scaffolds \\(mini-swe-agent\\).*no in-process"):
    rejection.sample(CompletionsPolicy("http://127.0.0.1:1/v1", "m"), chat, tasks,
                     scaffold=scaffold, scaffolds=MIX)
  cfg = get_preset("tiny-moe-mla").replace(vocab_size=512)  # the eval test's model and engine
  engine = Engine(transformer.init(cfg, seed=0),
                  EngineConfig(slots=2, max_seq_len=CONTEXT, prefix_cache_rows=2,
                               prefill_chunk=512, return_expert_ids=True),
                  detokenize=chat.tokenizer.decode)
  policy = EnginePolicy(engine)
  try:
    attempts = rejection.sample(policy, chat, tasks, scaffold=scaffold, attempts=1, seed=0,
                                concurrency=2, progress=False, scaffolds=MIX)
    # the gateway is closed, the teacher's engine still serves (e.g. a judge after sampling)
    assert aio.run(policy.generate([1, 2, 3], SamplingParams(max_tokens=1))).output_ids
  finally:
    engine.stop()
  assert [len(row) for row in attempts] == [1, 1, 1]
  for task, (t,), want in zip(tasks, attempts, ["react", "mini-swe-agent", "react"]):
    assert isinstance(t, Trajectory) and t.task_id == t.group_id == task.instance_id and t.calls
    assert t.metadata["scaffold"] == want and t.metadata["attempt"] == 0
    assert t.metadata["seed"] == rejection.attempt_seed(0, task.instance_id, 0)
  (mini,) = attempts[1]
  assert mini.metadata["session_id"] and mini.termination in ("exited", "scaffold_error")
  assert all(c.meta["protocol"] == "chat_completions" and 1 <= len(c.output_ids) <= 8
             for c in mini.calls)
  kept, stats = rejection.select(tasks, attempts, rejection.FilterConfig(threshold=0.0))
  assert stats["errors"] == 0 and stats["kept"] == 3 and stats["scaffolds"] == {
      "react": {"attempts": 2, "verified": 2, "kept": 2},
      "mini-swe-agent": {"attempts": 1, "verified": 1, "kept": 1}}
  path = str(tmp_path / "teacher.jsonl")
  assert rejection.write_sft(path, kept) == 3
  records = {r["task_id"]: r for r in map(json.loads, open(path))}
  assert [(c["input_ids"], c["output_ids"]) for c in records["bb-1"]["calls"]] == [
      (list(c.input_ids), list(c.output_ids)) for c in mini.calls]  # the session's exact ids
  assert rejection.sft_record(attempts[0][0], "chat")["group"] == "bb-0"
  with pytest.raises(ValueError, match="black-box scaffold 'mini-swe-agent'.*trajectory"):
    rejection.sft_record(mini, "chat")
  common = ["--tasks", "unused.jsonl", "--out", str(tmp_path / "x.jsonl"), "--scaffold", MIX]
  assert rejection.main(["--ckpt", "unused", "--format", "chat", *common]) == 2
  assert "--format chat" in capsys.readouterr().err
  assert rejection.main(["--url", "http://127.0.0.1:1/v1", "--model", "m", "--tokenizer", "t",
                         *common]) == 2
  err = capsys.readouterr().err
  assert "--scaffold=" in err and "--url=" in err and "mini-swe-agent" in err
