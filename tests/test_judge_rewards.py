"""Generative rewards (trainer/judge_rewards.py): batching, caching, failure handling and
calibration of an LLM judge as an RL reward source, with a scripted judge `Policy` (the real
`envs.verifiers.judge` prompt and parser, canned replies); config validation of
`rl.judge_reward`; one RL step with a self-judge on synthetic groups (tests/test_rl_gae.py);
the real sources ("policy", an http URL of Arbor's own server, "ckpt:<dir>") with a random tiny
model.
"""

from __future__ import annotations

import asyncio
import itertools
import os

import numpy as np
import pytest

from envs.policy import Generation, PolicyError
from envs.tasks import Task
from envs.trajectory import LLMCall, Trajectory
from envs.verifiers.judge import judge_prompt, parse_rubric, transcript
from models.engine import Engine
from tests.test_chat import _tiny_bpe
from tests.test_rl_gae import SyntheticGroups, gae_config
from trainer import checkpoint, harness, optim, rl, rollouts
from trainer import config as config_lib
from trainer import judge_rewards as J
from trainer import state as state_lib
from trainer.metrics import read_jsonl
from trainer.serve import PolicyServer, ServerConfig

RUBRIC = parse_rubric(("correctness:2:works", "style:1:clean"))
encode = lambda text: list(text.encode())
decode = lambda ids: bytes(ids).decode()


class ScriptedJudge:
  """A judge Policy over byte "tokens": the reply to a response is the next of its canned
  replies (the last one repeats); "SLOW" never answers in time, "DOWN" raises."""

  def __init__(self, replies: dict):
    self.replies = {k: itertools.chain(v, itertools.repeat(v[-1])) for k, v in replies.items()}
    self.asked: list[str] = []
    self.prompts: list[str] = []
    self.in_flight = self.most_in_flight = 0

  async def generate(self, input_ids, params):
    self.prompts.append(decode(input_ids))
    response = self.prompts[-1].split("## Response\n")[1].split("\n\n## Rubric")[0]
    self.asked.append(response)
    self.in_flight += 1
    self.most_in_flight = max(self.most_in_flight, self.in_flight)
    try:
      await asyncio.sleep(5.0 if response == "SLOW" else 0.01)
      if response == "DOWN":
        raise PolicyError("judge unreachable")
      return Generation(encode(next(self.replies[response])), [], "stop")
    finally:
      self.in_flight -= 1


def judge(policy, **kw) -> J.JudgeReward:
  return J.JudgeReward(policy=policy, render=encode, decode=decode, rubric=RUBRIC, **kw)


def episode(response: str, reward: float, task_id: str = "t1") -> Trajectory:
  prompt = encode("fix the bug\n")
  return Trajectory([LLMCall(prompt, encode(response), [0.0] * len(response))], reward=reward,
                    task_id=task_id, group_id=task_id, termination="submitted")


GOOD, OK, GARBAGE = "correctness: 9\nstyle: 6", "Correctness = 4/10, style: 10", "looks fine"


def test_scores_are_the_rubric_reward_and_repeats_are_asked_once():
  p = ScriptedJudge({"a": [GOOD], "b": [OK]})
  j = judge(p, cache=J.ScoreCache(100))
  got = j.score([("task", "a"), ("task", "b"), ("task", "a")])
  assert got == pytest.approx([(2 * 0.9 + 0.6) / 3, (2 * 0.4 + 1.0) / 3, (2 * 0.9 + 0.6) / 3])
  assert sorted(p.asked) == ["a", "b"] and j.counters["judge/cache_hits"] == 1
  assert j.score([("task", "a"), ("task", "b")]) == got[:2]  # cached: nothing asked
  assert len(p.asked) == 2 and j.counters["judge/cache_hits"] == 2
  assert j.counters["judge/requests"] == 0
  j.score([("another task", "a")])  # the task is part of the key
  assert len(p.asked) == 3


def test_a_long_transcript_is_cut_at_its_head_to_fit_the_judge():
  # byte tokens: one character, one token; the budget leaves 40 characters of the response
  short = judge(ScriptedJudge({}))._prompt(J.Task(instance_id="judge", kind="judge",
                                                   problem_statements=("fix",),
                                                   rubric=RUBRIC), "")[1]
  response = "".join(f"line {i}\n" for i in range(200)) + "correctness: 9"
  p = ScriptedJudge({response[-40:]: [GOOD]})
  j = judge(p, max_prompt_tokens=len(short) + 40, cache=J.ScoreCache(10))
  scores = j.score([("fix", response)])
  assert len(p.prompts) == 1 and len(p.prompts[0]) <= len(short) + 40
  shown = p.asked[0]
  assert shown == response[-40:]  # the tail, where the episode ends
  # the same prompt keys the cache: asked again, it is served without a request
  assert j.score([("fix", response)]) == scores and j.counters["judge/cache_hits"] == 1
  # no budget: the whole transcript
  p = ScriptedJudge({})
  judge(p, max_retries=0).score([("fix", response)])
  assert p.asked == [response]


def test_a_self_judge_is_cached_per_weights_version():
  p, version = ScriptedJudge({"a": [GOOD]}), [0]
  j = judge(p, cache=J.ScoreCache(10), version=lambda: version[0])
  j.score([("t", "a")])
  j.score([("t", "a")])  # the same weights: served from the cache
  assert p.asked == ["a"] and j.counters["judge/cache_hits"] == 1
  version[0] = 1  # the policy was updated: its judgement may differ
  j.score([("t", "a")])
  assert p.asked == ["a", "a"] and j.counters["judge/cache_hits"] == 0


def test_the_lru_evicts_the_oldest_and_size_0_caches_nothing():
  cache = J.ScoreCache(2)
  for k in "abc":
    cache.put(k, 0.5)
  assert cache.get("a") is None and cache.get("c") == 0.5
  p = ScriptedJudge({"a": [GOOD]})
  j = judge(p)  # the default: no cache
  j.score([("t", "a")])
  j.score([("t", "a")])
  assert p.asked == ["a", "a"]


def test_the_disk_cache_survives_a_new_instance(tmp_path):
  path = str(tmp_path / "cache" / "judge.jsonl")
  first = judge(ScriptedJudge({"a": [GOOD], "b": [GARBAGE]}), cache=J.ScoreCache(10, path),
                max_retries=0)
  scores = first.score([("t", "a"), ("t", "b")])
  assert scores[1] is None
  with open(path, "a") as f:
    f.write("not json\n")  # a torn line is skipped
  p = ScriptedJudge({"a": [OK], "b": [GOOD]})
  again = judge(p, cache=J.ScoreCache(10, path))
  assert again.score([("t", "a")]) == scores[:1] and p.asked == []
  assert again.score([("t", "b")]) == [pytest.approx(0.8)]  # failures are not cached
  other = judge(ScriptedJudge({"a": [OK]}), cache=J.ScoreCache(10, path), judge_id="ckpt:x")
  assert other.score([("t", "a")]) == [pytest.approx(0.6)]  # another judge: asked anew


def test_retries_then_fallback_and_the_step_survives():
  p = ScriptedJudge({"flaky": [GARBAGE, GOOD], "bad": [GARBAGE], "DOWN": [GOOD],
                     "SLOW": [GOOD], "ok": [OK]})
  j = judge(p, max_retries=2, timeout_s=1.0, weight=0.5)  # > a GC pause (~0.2 s)
  groups = [[episode("flaky", 1.0), episode("bad", 0.0)], [episode("DOWN", 1.0),
                                                           episode("SLOW", 0.0),
                                                           episode("ok", 0.0)]]
  out, m = j.rewards(groups, [])
  assert p.asked.count("flaky") == 2 and p.asked.count("bad") == 3
  assert p.asked.count("DOWN") == 3 and p.asked.count("SLOW") == 3
  assert m["judge/failures"] == 3 and m["judge/retries"] == 1 + 2 * 3
  rewards = [t.reward for g in out for t in g]
  assert rewards == pytest.approx([1.0 + 0.5 * 0.8, 0.0, 1.0, 0.0, 0.5 * 0.6])
  assert [t.metadata["judge_score"] for t in out[0]] == [pytest.approx(0.8), None]
  assert [t.metadata["verifier_reward"] for g in out for t in g] == [1.0, 0.0, 1.0, 0.0, 0.0]
  assert [t.trajectory_id for g in out for t in g] == [t.trajectory_id for g in groups for t in g]
  assert [t.reward for g in groups for t in g] == [1.0, 0.0, 1.0, 0.0, 0.0]  # copies
  # group_mean: a failed episode gets its group's mean judge score
  mean = J.combine(groups, [[0.8, None], [None, None, 0.6]], 0.5, "group_mean")
  assert [t.reward for g in mean for t in g] == pytest.approx([1.4, 0.4, 1.3, 0.3, 0.3])


def test_requests_in_flight_never_exceed_the_concurrency():
  p = ScriptedJudge({str(i): [GOOD] for i in range(12)})
  j = judge(p, concurrency=3)
  assert len(j.score([("t", str(i)) for i in range(12)])) == 12
  assert p.most_in_flight == 3 and len(p.asked) == 12


def test_calibration_matches_a_hand_computation_with_ties():
  scores = [0.9, 0.5, 0.5, 0.2, 0.5, 0.7, 0.1]
  passed = [True, True, False, False, True, False, False]
  pos = [s for s, p in zip(scores, passed) if p]
  neg = [s for s, p in zip(scores, passed) if not p]
  pairs = [1.0 if a > b else 0.5 if a == b else 0.0 for a in pos for b in neg]
  c = J.calibration(scores, passed, threshold=0.5)
  assert c["auc"] == pytest.approx(sum(pairs) / len(pairs)) == pytest.approx(9 / 12)
  assert c["accuracy"] == pytest.approx(5 / 7)  # >= 0.5 predicts a pass
  assert c["pearson"] == pytest.approx(np.corrcoef(scores, np.array(passed, float))[0, 1])
  assert c["score_passed"] == pytest.approx(np.mean(pos))
  assert c["score_failed"] == pytest.approx(np.mean(neg)) and c["judged"] == 7
  assert J.auc([0.3, 0.3], [True, False]) == 0.5
  one_class = J.calibration([0.2, 0.4], [True, True])
  assert np.isnan(one_class["auc"]) and np.isnan(one_class["pearson"])
  assert np.isnan(one_class["score_failed"]) and one_class["accuracy"] == 0.0
  assert np.isnan(J.calibration([], [])["score_mean"])


def test_step_metrics_and_the_offline_evaluation():
  p = ScriptedJudge({"fixed": [GOOD], "broken": [OK], "garbled": [GARBAGE]})
  j = judge(p, max_retries=0, weight=1.0)
  groups = [[episode("fixed", 1.0), episode("broken", 0.0), episode("garbled", 0.0)]]
  _, m = j.rewards(groups, [Task(instance_id="t1", kind="exact",
                                 problem_statements=("say hi",), answers=("hi",))])
  assert all("## Task\nsay hi\n" in prompt for prompt in p.prompts)  # the task's statement
  assert m["judge/auc"] == 1.0 and m["judge/score_passed"] == pytest.approx(0.8)
  assert m["judge/score_failed"] == pytest.approx(0.6) and m["judge/failures"] == 1
  assert m["judge/cache_hits"] == 0 and m["judge/judged"] == 2
  ev = J.evaluate_judge(judge(ScriptedJudge({"fixed": [GOOD], "broken": [OK]})),
                        groups[0][:2], threshold=0.7)
  assert ev["auc"] == 1.0 and ev["accuracy"] == 1.0 and ev["failures"] == 0


def test_reward_model_and_judge_terms_both_add():
  t = episode("x", 1.0)
  after_rm = Trajectory(t.calls, 1.25, "t1", "t1", "submitted",
                        metadata={"verifier_reward": 1.0, "rm_score": 0.5})
  out = J.combine([[after_rm]], [[0.5]], 0.4)[0][0]
  assert out.reward == pytest.approx(1.25 + 0.2)
  assert out.metadata["verifier_reward"] == 1.0 and out.metadata["rm_score"] == 0.5
  with pytest.raises(ValueError, match="fallback='zero'"):
    J.combine([[t]], [[None]], 0.4, "zero")


def test_transcript_is_what_follows_the_first_prompt():
  first = LLMCall(encode("PROMPT"), encode("A1"), [0.0, 0.0])
  second = LLMCall(encode("PROMPTA1OBS"), encode("A2"), [0.0, 0.0])
  t = Trajectory([first, second], 0.0, "t", "t", "submitted")
  assert transcript(t, decode) == "A1OBSA2" and transcript(t, decode, 3) == "SA2"
  summarised = Trajectory([first, LLMCall(encode("SUMMARY"), encode("A2"), [0.0, 0.0])], 0.0,
                          "t", "t", "submitted")
  assert transcript(summarised, decode) == "SUMMARYA2"


@pytest.mark.parametrize("field,value,message", [
    ("weight", -0.5, r"a number in \[0.0, inf\]"),
    ("source", "judge-model", "'policy', 'ckpt:<dir>' or an http"),
    ("source", "ckpt:", "'policy', 'ckpt:<dir>'"),
    ("rubric", ("correctness",), "'name:weight:description'"),
    ("rubric", ("a:1:x", "A:2:y"), "each name once"),
    ("rubric", (), "at least one dimension"),
    ("fallback", "zero", r"one of \('skip', 'group_mean'\)"),
    ("concurrency", 0, "an integer >= 1"),
    ("max_retries", -1, "an integer >= 0"),
    ("timeout_s", 0.0, r"a number in \(0.0, inf\]"),
])
def test_judge_reward_fields_are_checked(field, value, message):
  c = gae_config("", 2)
  c.rl.judge_reward[field] = value
  with pytest.raises(config_lib.ConfigError, match=rf"config\.rl\.judge_reward\.{field}=.*"
                     + message):
    config_lib.validate(c, files=False)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
  d = tmp_path_factory.mktemp("judge") / "tokenizer"
  d.mkdir()
  _tiny_bpe().save(str(d / "tokenizer.json"))
  (d / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
  return str(d)


def test_an_http_source_needs_a_model_name_and_a_ckpt_source_a_directory(tokenizer, tmp_path):
  c = gae_config(tokenizer, 2)
  c.rl.judge_reward.source, c.rl.judge_reward.model = "http://127.0.0.1:9/v1", ""
  with pytest.raises(config_lib.ConfigError, match=r"judge_reward\.model=''"):
    config_lib.validate(c, files=False)
  c.rl.judge_reward.model = "judge"
  config_lib.validate(c, files=False)
  c.rl.judge_reward.source, c.rl.judge_reward.weight = f"ckpt:{tmp_path / 'none'}", 0.5
  c.rl.advantage = "grpo"
  with pytest.raises(config_lib.ConfigError, match="an existing checkpoint directory"):
    config_lib.validate(c, str(tmp_path / "work"))


def test_rl_step_with_a_self_judge(tokenizer, tmp_path):
  """rl.judge_reward.source = "policy" on synthetic groups: the judge is built from the run's
  engine and chat format (a scripted reply stands in for the engine's sampling); its term is in
  the rewards the advantages read. The optimizer update is stubbed (no compile: the training
  path is tests/test_rl_gae.py's)."""
  c = gae_config(tokenizer, 1)
  c.loss.name, c.rl.advantage = "cispo", "grpo"
  c.rl.judge_reward.weight = 0.5
  built, trained = {}, []

  def scripted(config, chat, engine, source):
    built.update(engine=engine, source=source)
    policy = ScriptedJudge({})
    policy.generate = lambda ids, params: asyncio.sleep(0, Generation(chat.tokenizer.encode(
        "correctness: 10\nminimal_edit: 5\nprocess: 5"), [], "stop"))
    return policy, None
  advantages_of = rl.groups_lib.advantages_of

  def spy(kept, kind):
    trained.extend((t.reward, t.metadata["verifier_reward"]) for g in kept for t in g)
    return advantages_of(kept, kind)
  mp = pytest.MonkeyPatch()
  mp.setattr(rl, "make_source", SyntheticGroups)
  mp.setattr(rl, "TaskSource", lambda config, workdir: None)
  mp.setitem(J.SOURCES, "policy", scripted)
  mp.setattr(rl.groups_lib, "advantages_of", spy)
  mp.setattr(rl, "train_epochs", lambda step, state, mbs, epochs, ref=None: (state, {}))
  try:
    config_lib.validate(c, str(tmp_path / "rl"))
    rl.run(c, str(tmp_path / "rl"))
  finally:
    mp.undo()
  assert built["source"] == "policy" and built["engine"] is not None
  line = read_jsonl(os.path.join(tmp_path, "rl", "rl", "metrics.jsonl"))[1]
  assert line["judge/score_mean"] == pytest.approx(0.75) and line["judge/failures"] == 0
  assert "time/judge" in line and line["groups_trained"] == 2
  assert len(trained) == 4 and all(r == pytest.approx(v + 0.5 * 0.75) for r, v in trained)
  assert os.path.isfile(tmp_path / "rl" / "judge_cache.jsonl")


def test_real_sources_reach_the_model_and_fall_back(tokenizer, tmp_path, caplog):
  """The judge through its real sources, one random tiny model behind each: the RL engine
  ("policy"), Arbor's OpenAI-compatible server over loopback HTTP (trainer.serve) and a
  checkpoint written by the run's checkpoint code ("ckpt:<dir>"). Every request reaches an
  engine with the rubric prompt and its reply comes back (the same greedy reply from each: the
  same weights); a random model's reply is no score, so each episode is re-asked once and falls
  back, and the step's rewards stay the verifier's. A prompt longer than the engine's rows is a
  counted failure too."""
  c = gae_config(tokenizer, 1)
  c.rl.max_context_tokens = 512  # rows for the rubric prompt (~400 tokens here) and the reply
  c.rl.judge_reward.update(weight=0.5, max_tokens=4, max_retries=1, concurrency=2,
                           fallback="group_mean", cache_file="", model="tiny")
  chat = config_lib.make_chat_format(c, config_lib.tokenizer_source(c, str(tmp_path)))
  model_cfg = config_lib.model_config(c)
  state = state_lib.create(model_cfg, optim.build(c.optimizer, model_cfg), c.seed)
  tasks = [Task(instance_id=f"t{i}", kind="exact", problem_statements=(f"say {w}",),
                answers=(w,)) for i, w in enumerate(("hi", "yo"))]
  render = lambda text: tuple(chat.render([{"role": "user", "content": text}],
                                          add_generation_prompt=True).ids)

  def episode_of(task, reply, reward):
    out = chat.tokenizer.encode(reply)
    return Trajectory([LLMCall(render(task.problem_statement), out, [0.0] * len(out))], reward,
                      task.instance_id, task.instance_id, "submitted")
  groups = [[episode_of(tasks[0], "hi", 1.0), episode_of(tasks[0], "ho", 0.0),
             episode_of(tasks[0], "hi", 1.0)], [episode_of(tasks[1], "yo", 1.0)]]
  rubric = parse_rubric(c.rl.judge_reward.rubric)
  want = {render(judge_prompt(Task(instance_id="judge", kind="judge", rubric=rubric,
                                   problem_statements=(t.problem_statement,)), reply))
          for t, reply in ((tasks[0], "hi"), (tasks[0], "ho"), (tasks[1], "yo"))}
  replies = {}
  failures = lambda: [r.getMessage() for r in caplog.records
                      if r.getMessage().startswith("judge reply failed")]

  def judged(source, rl_engine, served=None):
    """A step's judge term from `source`; `served`: the engine that answers (default: the
    judge's own)."""
    c.rl.judge_reward.source = source
    j = J.from_config(c, chat, rl_engine, str(tmp_path))
    served = served or j.policy.engine
    asked, submit = [], served.submit

    def spy(ids, params, **kw):  # what the engine was asked, and its reply
      asked.append((tuple(ids), submit(ids, params, **kw)))
      return asked[-1][1]
    served.submit = spy
    before = served.counters.get("finished", 0)
    caplog.clear()
    try:
      out, m = j.rewards(groups, tasks)
      finished = served.counters.get("finished", 0) - before
      failed = failures()
      too_long = j.score([("x" * 700, "y")]), dict(j.counters)
    finally:
      j.close()
    assert {ids for ids, _ in asked} == want and len(asked) == 2 * len(want)  # and re-asked
    assert finished == len(asked) and not failed, failed  # every reply came back
    replies[source] = {ids: f.result().output_ids for ids, f in asked}
    assert m["judge/requests"] == 6 and m["judge/retries"] == 3
    assert m["judge/failures"] == 4 and m["judge/cache_hits"] == 1
    assert m["judge/judged"] == 0 and np.isnan(m["judge/score_mean"])
    assert [t.reward for g in out for t in g] == [1.0, 0.0, 1.0, 1.0]  # no judge term
    assert all(t.metadata["judge_score"] is None for g in out for t in g)
    assert too_long == ([None], {"judge/requests": 2, "judge/retries": 1,
                                 "judge/cache_hits": 0, "judge/failures": 1})
    refused = failures()
    assert len(refused) == 2 and all("max_seq_len" in r for r in refused), refused

  rl_engine = Engine(state.model(model_cfg), rollouts.engine_config(c, model_cfg),
                     detokenize=chat.tokenizer.decode)
  try:
    judged("policy", rl_engine, rl_engine)
  finally:
    rl_engine.stop()
  srv = PolicyServer(Engine(state.model(model_cfg), rollouts.engine_config(c, model_cfg),
                            detokenize=chat.tokenizer.decode),
                     ServerConfig(port=0, served_name="tiny"), tokenizer=chat.tokenizer, chat=chat)
  url = srv.start_in_thread()
  try:
    judged(url + "/v1", rl_engine, srv.engine)
  finally:
    srv.stop()
  run = str(tmp_path / "judge_run")
  harness.write_run_files(c, model_cfg, run)
  with checkpoint.Checkpointer(os.path.join(run, "checkpoints"), async_save=False) as saver:
    saver.save(1, state, {}, force=True)
  judged(f"ckpt:{run}", rl_engine)
  assert replies["policy"] == replies[url + "/v1"] == replies[f"ckpt:{run}"]
