"""Teacher rollouts and rejection sampling (trainer/rejection.py) and the OpenAI completions
teacher (envs.policy.CompletionsPolicy).

A scripted teacher plays the demo's solver (`trainer.demo_data.scripted_turns`: fix, fix after a
failed tool call, or submit unfixed) on generated tasks; every attempt runs in a bwrap sandbox and
the tasks' hidden tests (the real verifier, a second bwrap sandbox) give the reward. Checked:
rewards follow the scripts, kept = the reward-1 attempts less exact duplicates, the written files
load with trainer.sft_data and render to the recorded tokens, and CompletionsPolicy returns the
engine's own ids and log-probs through the real trainer.serve server.
"""

import asyncio
import json
import random

import numpy as np
import pytest

from envs.chat import make_chat
from envs.chat.tokenizer import HFTokenizer
from envs.policy import CompletionsPolicy, Generation, HTTPPolicy, PolicyError, SamplingParams
from envs.scaffold import ScaffoldConfig
from envs.taskgen import write_tasks
from envs.trajectory import LLMCall, Trajectory
from tests.test_chat import _tiny_bpe
from trainer import rejection
from trainer.demo_data import scripted_turns
from trainer.sft_data import JsonlReader, ParquetReader, record_trajectories

SCAFFOLD = ScaffoldConfig(max_turns=6, max_new_tokens=256, max_context_tokens=8192,
                          timeout_s=120.0, temperature=1.0)
# per task, the script of each of its 3 attempts
PLANS = (("fix", "fix", "fix"),            # 3 verified, identical: 1 after dedup
         ("early", "early", "error_fix"),  # 1 verified, its failed str_replace error-masked
         ("fix", "error_fix", "early"))    # 2 verified, distinct: the shorter first


@pytest.fixture(scope="module")
def chat():
  return make_chat("qwen2.5", HFTokenizer(_tiny_bpe(), eos_token="<|im_end|>"))


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
  return write_tasks(str(tmp_path_factory.mktemp("tasks")), 3, 0, 1, 0, split="train")


class PlannedTeacher:
  """Plays, per task, its planned scripts in turn (one episode at a time): an episode starts
  when a call's input does not extend the previous call's input + output."""

  def __init__(self, chat, tasks, plans):
    self.chat, self.prev = chat, None
    self.queues = {t.instance_id: [self._script(t, p) for p in plan]
                   for t, plan in zip(tasks, plans)}
    self.statements = {s: t.instance_id for t in tasks for s in t.problem_statements}
    self.played: list[tuple[str, int]] = []  # (task, plan index) per episode

  @staticmethod
  def _script(task, plan):
    return scripted_turns(task, random.Random(0), error_rate=float(plan == "error_fix"),
                          early_submit_rate=float(plan == "early"))

  async def generate(self, input_ids, params):
    ids = list(input_ids)
    if self.prev is None or ids[:len(self.prev)] != self.prev:  # a new episode
      text = self.chat.tokenizer.decode(ids)
      task = next(t for s, t in self.statements.items() if s in text)
      self.script, self.turn = self.queues[task].pop(0), 0
    out = self.chat.assistant_ids(self.script[self.turn])
    self.turn += 1
    self.prev = ids + out
    return Generation(output_ids=out, logprobs=[-0.25] * len(out), finish_reason="stop")


@pytest.fixture(scope="module")
def attempts(chat, tasks):
  teacher = PlannedTeacher(chat, tasks, PLANS)
  return rejection.sample(teacher, chat, tasks, scaffold=SCAFFOLD, attempts=3, seed=7,
                          sandbox="bwrap", concurrency=1)


def test_attempts_are_verified_by_the_tasks_tests(tasks, attempts):
  """The real verifier in bwrap: a fix passes, an unfixed submit fails; seeds are per attempt."""
  for task, row, plan in zip(tasks, attempts, PLANS):
    assert all(isinstance(t, Trajectory) for t in row), row
    rewards = sorted(t.reward for t in row)
    assert rewards == sorted(0.0 if p == "early" else 1.0 for p in plan)
    for j, t in enumerate(row):
      assert t.task_id == task.instance_id and t.metadata["attempt"] == j
      assert t.metadata["seed"] == rejection.attempt_seed(7, task.instance_id, j)
      assert t.termination == "submitted"
      verdict = t.metadata["verdict"]
      want = "passed" if t.reward == 1.0 else "failed"
      assert set(verdict["fail_to_pass"].values()) == {want}  # pytest really ran
  assert rejection.attempt_seed(7, "a", 0) != rejection.attempt_seed(7, "a", 1)
  assert rejection.attempt_seed(7, "a", 0) == rejection.attempt_seed(7, "a", 0)


def test_kept_are_the_reward_1_attempts_less_duplicates(tasks, attempts):
  kept, stats = rejection.select(tasks, attempts, rejection.FilterConfig(max_per_task=5))
  passing = [t for row in attempts for t in row if t.reward == 1.0]
  assert {rejection.dedup_key(t) for t in kept} == {rejection.dedup_key(t) for t in passing}
  assert len({rejection.dedup_key(t) for t in kept}) == len(kept) == 4  # 1 + 1 + 2
  assert stats["verified"] == stats["kept_before_dedup"] == 6
  assert stats["kept_after_dedup"] == stats["kept"] == 4
  assert stats["attempts"] == 9 and stats["errors"] == 0
  assert stats["verified_share"] == pytest.approx(6 / 9)
  assert stats["pass_rate_per_task"] == {t.instance_id: pytest.approx(r) for t, r in
                                         zip(tasks, (1.0, 1 / 3, 2 / 3))}
  assert stats["kept_tokens"] == sum(len(c.output_ids) for t in kept for c in t.calls)
  # within a task the shortest first; the cap keeps the shortest
  third = [t for t in kept if t.task_id == tasks[2].instance_id]
  assert [len(t.calls) for t in third] == [4, 5]
  capped, cs = rejection.select(tasks, attempts, rejection.FilterConfig(max_per_task=1))
  assert cs["kept"] == 3 and [len(t.calls) for t in capped] == [4, 5, 4]
  # tool_errors="drop": the attempts with a failed str_replace go
  clean, _ = rejection.select(tasks, attempts, rejection.FilterConfig(tool_errors="drop"))
  assert len(clean) == 2 and not any(c.meta.get("tool_error") for t in clean for c in t.calls)


def test_dedup_removes_planted_duplicates(tasks, attempts):
  row = attempts[2]
  fix = next(t for t in row if t.reward == 1.0 and len(t.calls) == 4)
  copy = Trajectory.from_dict(json.loads(json.dumps(fix.to_dict())))
  copy.metadata["attempt"] = 9  # same assistant tokens, another attempt
  other = Trajectory.from_dict(json.loads(json.dumps(fix.to_dict())))
  other.calls[-1] = LLMCall(**{**other.calls[-1].__dict__,
                               "output_ids": list(other.calls[-1].output_ids) + [5],
                               "output_logprobs": list(other.calls[-1].output_logprobs) + [0.0]})
  planted = [list(r) for r in attempts]
  planted[2] = row + [copy, copy, other]
  kept, stats = rejection.select(tasks, planted, rejection.FilterConfig(max_per_task=10))
  assert stats["kept_before_dedup"] == 6 + 3 and stats["kept_after_dedup"] == 4 + 1
  third = [t for t in kept if t.task_id == tasks[2].instance_id]
  assert len(third) == 3 and third[0] is fix and other in third and copy not in third


def test_judge_threshold_needs_and_uses_judge_scores(tasks, attempts, chat):
  cfg = rejection.FilterConfig(judge_threshold=0.5)
  with pytest.raises(ValueError, match="judge_threshold=0.5.*not judged"):
    rejection.select(tasks, attempts, cfg)

  class Grader:  # the rubric's prompt in, 9/10 on each dimension out
    async def generate(self, input_ids, params):
      text = chat.tokenizer.decode(list(input_ids))
      assert "## Rubric" in text and "correctness" in text and "process" in text
      return Generation(chat.tokenizer.encode("correctness: 9\nprocess: 9"), [0.0], "stop")
  judged = [[Trajectory.from_dict(json.loads(json.dumps(t.to_dict()))) for t in row]
            for row in attempts]
  rejection.judge(tasks, judged, Grader(), chat)
  scores = [t.metadata.get("judge_score") for row in judged for t in row]
  assert {s for s in scores if s is not None} == {0.9}
  assert sum(s is not None for s in scores) == 6  # only the passing attempts are judged
  for row in judged:
    for t in row:
      if t.reward == 1.0 and t.metadata["attempt"] == 1:
        t.metadata["judge_score"] = 0.1
  kept, _ = rejection.select(tasks, judged, rejection.FilterConfig(judge_threshold=0.5,
                                                                    max_per_task=5))
  assert all(t.metadata["attempt"] != 1 for t in kept) and len(kept) == 3


def _check_rendered(rendered, t):
  """Every call renders to the recorded ids; failed turns are out of the loss."""
  assert len(rendered.calls) == len(t.calls)
  for got, call in zip(rendered.calls, t.calls):
    assert list(got.input_ids) == list(call.input_ids)
    assert list(got.output_ids) == list(call.output_ids)
    want = 0.0 if call.meta.get("tool_error") else 1.0
    assert set(got.fields["loss_mask"]) == {want}


@pytest.mark.parametrize("fmt,ext", [("trajectory", "jsonl"), ("chat", "jsonl"),
                                     ("trajectory", "parquet"), ("chat", "parquet")])
def test_written_file_loads_and_renders_to_the_recorded_tokens(tmp_path, tasks, attempts,
                                                               chat, fmt, ext):
  kept, _ = rejection.select(tasks, attempts, rejection.FilterConfig(max_per_task=5))
  assert any(c.meta.get("tool_error") for t in kept for c in t.calls)  # a masked turn is in
  path = str(tmp_path / f"kept.{ext}")
  assert rejection.write_sft(path, kept, fmt) == len(kept)
  reader = JsonlReader(path) if ext == "jsonl" else ParquetReader(path)
  records = [r for _, _, r in reader.scan()]
  assert len(records) == len(kept)
  for record, t in zip(records, kept):
    (rendered,) = record_trajectories(record, chat)
    _check_rendered(rendered, t)
    if fmt == "chat":
      assert record["group"] == t.task_id
    else:
      assert "messages" not in record["metadata"] and record["reward"] == 1.0


def test_bad_filter_fields_are_named():
  with pytest.raises(ValueError, match="max_per_task=0"):
    rejection.FilterConfig(max_per_task=0)
  with pytest.raises(ValueError, match="tool_errors='mask'"):
    rejection.FilterConfig(tool_errors="mask")
  with pytest.raises(ValueError, match="judge_threshold=2"):
    rejection.FilterConfig(judge_threshold=2)
  with pytest.raises(ValueError, match="format='text'"):
    rejection.sft_record(Trajectory([], 1.0, "t", "t", "submitted"), "text")
  with pytest.raises(ValueError, match="attempts=0"):
    rejection.sample(None, None, [object()], scaffold=SCAFFOLD, attempts=0)


# ----------------------------------------------------------------------------- completions


@pytest.fixture(scope="module")
def server():
  from models import transformer
  from models.engine import Engine, EngineConfig
  from tests.conftest import TINY_DENSE
  from trainer.serve import PolicyServer, ServerConfig
  tok = HFTokenizer(_tiny_bpe(), eos_token="<|im_end|>")
  model = transformer.init(TINY_DENSE.replace(vocab_size=tok.vocab_size), seed=0)
  engine = Engine(model, EngineConfig(slots=4, max_seq_len=4096, prefix_cache_rows=4,
                                      prefill_chunk=512, steps_per_call=8),
                  detokenize=tok.decode)
  srv = PolicyServer(engine, ServerConfig(port=0, served_name="tiny"), tokenizer=tok,
                     chat=make_chat("plain", tok))
  url = srv.start_in_thread()
  yield srv, url
  srv.stop()


def test_completions_policy_against_the_real_server(server):
  """The token-id prompt goes in, the engine's exact ids and log-probs come out (the same as
  the server's native /generate with the same seed), and the session log is freed."""
  srv, url = server
  policy = CompletionsPolicy(url + "/v1", "tiny")
  prompt = [5, 17, 42, 99, 3, 250]
  params = SamplingParams(max_tokens=12, temperature=1.0, seed=11)

  async def both():
    return await asyncio.gather(policy.generate(prompt, params),
                                HTTPPolicy(url).generate(prompt, params))
  got, ref = asyncio.run(both())
  assert len(got.output_ids) == len(got.logprobs) == 12 and got.finish_reason == "length"
  assert got.output_ids == ref.output_ids
  np.testing.assert_allclose(got.logprobs, ref.logprobs, rtol=1e-5, atol=1e-6)
  assert not srv.sessions._sessions  # read and deleted
  greedy = asyncio.run(policy.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0)))
  assert greedy.output_ids == asyncio.run(HTTPPolicy(url).generate(
      prompt, SamplingParams(max_tokens=6, temperature=0.0))).output_ids
  with pytest.raises(PolicyError, match="404"):
    asyncio.run(CompletionsPolicy(url + "/v1", "other").generate(prompt, params))
  with pytest.raises(ValueError, match="model=''"):
    CompletionsPolicy(url + "/v1", "")


def test_cli_with_a_completions_teacher(server, tmp_path, capsys):
  """`python -m trainer.rejection --url`: real episodes (bwrap, the tests verifier) whose calls
  the server sampled; a random model solves nothing, so nothing is kept."""
  srv, url = server
  tok_dir = tmp_path / "tok"
  tok_dir.mkdir()
  _tiny_bpe().save(str(tok_dir / "tokenizer.json"))
  (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
  out = str(tmp_path / "teacher.jsonl")
  before = srv.engine.counters.get("finished", 0)
  assert rejection.main(["--url", url + "/v1", "--model", "tiny", "--tokenizer", str(tok_dir),
                         "--chat_format", "qwen2.5", "--generated", "1", "--attempts", "2",
                         "--max_turns", "1", "--max_new_tokens", "8",
                         "--max_context_tokens", "4096", "--out", out]) == 0
  stats = json.loads(capsys.readouterr().out)
  assert (stats["attempts"], stats["errors"], stats["verified"], stats["kept"]) == (2, 0, 0, 0)
  assert srv.engine.counters["finished"] - before == 2  # one call per one-turn episode
  assert json.load(open(out + ".stats.json"))["teacher"] == url + "/v1"
  assert open(out).read() == ""
  assert rejection.main(["--url", url + "/v1", "--generated", "1", "--out", out]) == 2


def test_completions_policy_reads_vllm_token_ids(monkeypatch):
  """vLLM's two reply shapes: choices[0].token_ids, and logprobs tokens as "token_id:N"."""
  policy = CompletionsPolicy("http://127.0.0.1:1/v1", "m")
  params = SamplingParams(max_tokens=3, top_k=5, stop_token_ids=(2,), seed=4)
  body = policy.body([1, 2], params, "s")
  assert body["prompt"] == [1, 2] and body["top_k"] == 5 and body["stop_token_ids"] == [2]
  assert body["return_tokens_as_token_ids"] and body["logprobs"] == 0 and body["seed"] == 4
  replies = [{"choices": [{"token_ids": [7, 8, 2], "finish_reason": "stop", "logprobs": {
      "tokens": ["a", "b", "</s>"], "token_logprobs": [-1.0, -2.0, -0.5]}}]},
             {"choices": [{"finish_reason": "length", "logprobs": {
                 "tokens": ["token_id:7", "token_id:8", "token_id:9"],
                 "token_logprobs": [-1.0, -2.0, -3.0]}}]},
             {"choices": [{"finish_reason": "stop", "logprobs": {
                 "tokens": ["a"], "token_logprobs": [-1.0]}}]}]
  monkeypatch.setattr(policy, "_request", lambda method, path, body=None: replies.pop(0))
  a = asyncio.run(policy.generate([1, 2], params))
  assert (a.output_ids, a.logprobs, a.finish_reason) == ([7, 8, 2], [-1.0, -2.0, -0.5], "stop")
  b = asyncio.run(policy.generate([1, 2], params))
  assert (b.output_ids, b.finish_reason) == ([7, 8, 9], "length")
  with pytest.raises(PolicyError, match="no token ids"):
    asyncio.run(policy.generate([1, 2], params))


# ----------------------------------------------------------------------------- RFT


def test_rft_two_rounds_sample_from_the_previous_round(tmp_path, chat, monkeypatch):
  """Round 2 samples from round 1's checkpoint (its weights), and within a round each kept
  trajectory is trained exactly once. The teacher's model is loaded from the round's checkpoint;
  the episodes are played by the scripted solver (a tiny model solves nothing)."""
  from configs.base import base_config
  from trainer import harness

  tok_dir = tmp_path / "tok"
  tok_dir.mkdir()
  _tiny_bpe().save(str(tok_dir / "tokenizer.json"))
  (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
  c = base_config()
  c.mode = "sft"
  c.compile_cache_dir = str(tmp_path / "xla_cache")
  c.model.preset = "tiny-dense"  # one small layer: each SFT run compiles its step
  c.model.overrides.vocab_size = 768
  c.model.overrides.num_layers = 1
  c.model.overrides.attention_impl = "auto"  # blocked attention: rows of 4096 tokens
  c.optimizer.name = "adamw"
  c.tokenizer.path, c.tokenizer.chat_format = str(tok_dir), "qwen2.5"
  # an episode of the scripted solver is ~3k tokens with the test tokenizer
  c.data.row_len, c.data.rows_per_batch, c.data.max_seqs, c.data.seq_len = 4096, 1, 4, 512
  c.data.num_epochs = 1
  c.metrics.progress = False
  c.metrics.report = False
  per_round = 2
  rounds_tasks = [write_tasks(str(tmp_path / f"t{r}"), per_round, 0, 1, r * per_round,
                              split="train") for r in range(2)]
  solve = {s: t for ts in rounds_tasks for t in ts for s in t.problem_statements}
  # the first teacher: a run directory holding the freshly initialised weights at step 0
  init = harness.Run(c, str(tmp_path / "init"))
  init.save(0, init.resume_or(lambda: None), {"data": {}, "policy_version": 0})
  init.checkpointer.close()
  loaded = []

  def fake_teacher(model, chat_, **kw):  # the checkpoint's model, the solver's episodes
    loaded.append(model)
    tasks = [solve[s] for s in solve]
    teacher = PlannedTeacher(chat_, tasks, [("fix", "fix")] * len(tasks))
    teacher.engine = type("NoEngine", (), {"stop": lambda self: None})()
    return teacher
  monkeypatch.setattr(rejection, "engine_teacher", fake_teacher)
  info = rejection.rft(c, str(tmp_path / "rft"), init_dir=str(tmp_path / "init"), rounds=2,
                       tasks_per_round=per_round, attempts=2, scaffold=SCAFFOLD, seed=0,
                       task_start=0, concurrency=1)
  assert [i["teacher"] for i in info] == [str(tmp_path / "init"), info[0]["sft_dir"]]
  assert info[0]["teacher_step"] == 0 and info[1]["teacher_step"] == info[0]["steps"] >= 1
  for i, tasks in zip(info, rounds_tasks):
    assert i["verified"] == 2 * per_round and i["kept"] == per_round  # identical pairs: dedup
    assert set(i["pass_rate_per_task"]) == {t.instance_id for t in tasks}  # fresh tasks
    ids = [x for step in i["trajectory_ids"] for x in step]
    assert len(ids) == len(set(ids)) == i["kept"]  # each kept trajectory trained once
  # round 2's teacher holds round 1's trained weights, not the first teacher's
  import jax
  from flax import nnx
  leaves = lambda tree: [np.asarray(x) for x in jax.tree.leaves(tree)]
  got = leaves(nnx.state(loaded[1], nnx.Param))
  r1 = leaves(harness.run_weights(info[0]["sft_dir"])[0])
  r0 = leaves(harness.run_weights(str(tmp_path / "init"))[0])
  assert len(got) == len(r1) == len(r0)
  assert all(np.array_equal(a, b) for a, b in zip(got, r1))
  assert not all(np.array_equal(a, b) for a, b in zip(got, r0))
