"""trainer/serve.py: the policy server over HTTP on 127.0.0.1.

- 36 concurrent /generate requests from 6 client threads (envs.policy.HTTPPolicy): each reply's
  log-probs equal teacher-forced log-probs, greedy replies equal the engine run alone, and the
  requests were decoded together.
- Bad requests get 4xx with a message and the server keeps serving; a token-protected server
  answers 401 without it; a non-loopback bind without a token refuses to start.
- /v1/chat/completions renders with envs.chat, parses tool calls, and its session log holds the
  exact ids it served (the rendered prompt, the sampled ids) with their log-probs.
"""

import asyncio
import concurrent.futures
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest

from envs.chat import make_chat
from envs.chat.tokenizer import HFTokenizer
from envs.policy import HTTPPolicy, SamplingParams
from models import transformer
from models.engine import Completion, Engine, EngineConfig
from tests.conftest import TINY_DENSE
from tests.test_chat import _tiny_bpe
from tests.test_engine import check_logprobs
from envs.net import check_bind
from trainer.serve import EnginePolicy, PolicyServer, ServerConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = EngineConfig(slots=8, max_seq_len=192, prefix_cache_rows=8, min_prefix=4,
                      prefill_chunk=32, prefill_bucket=32, prefill_rows=4, steps_per_call=8,
                      max_stop_token_ids=4, top_logprobs=3)
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]


@pytest.fixture(scope="module")
def tok():
  return HFTokenizer(_tiny_bpe(), eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def model(tok):
  return transformer.init(TINY_DENSE.replace(vocab_size=tok.vocab_size), seed=0)


@pytest.fixture(scope="module")
def server(model, tok):
  """A real engine behind the server; the chat format renders the Plain headers."""
  chat = make_chat("plain", tok)
  engine = Engine(model, CONFIG, detokenize=tok.decode)
  srv = PolicyServer(engine, ServerConfig(port=0, max_body_bytes=20_000,
                                          max_session_tokens=1_000), tokenizer=tok, chat=chat)
  url = srv.start_in_thread()
  yield srv, url
  srv.stop()


def request(url, method="GET", body=None, headers=None, raw=None, timeout=60):
  """(status, parsed JSON) of one HTTP request."""
  data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
  req = urllib.request.Request(url, data=data, method=method, headers={
      "Content-Type": "application/json", **(headers or {})})
  try:
    with urllib.request.urlopen(req, timeout=timeout) as resp:
      return resp.status, json.loads(resp.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def test_concurrent_generate_requests(server, model):
  srv, url = server
  rng = np.random.default_rng(0)
  vocab = model.cfg.vocab_size
  jobs = []
  for i in range(36):
    prompt = rng.integers(1, vocab, int(rng.integers(3, 30))).tolist()
    greedy = i % 3 == 0
    params = SamplingParams(max_tokens=int(rng.integers(4, 16)),
                            temperature=0.0 if greedy else 1.0, top_k=0 if greedy else 20,
                            seed=None if greedy else i)
    jobs.append((prompt, params))
  before = srv.engine.counters
  policy = HTTPPolicy(url, timeout=120)
  with concurrent.futures.ThreadPoolExecutor(6) as pool:
    outs = list(pool.map(lambda job: asyncio.run(policy.generate(*job)), jobs))
  after = srv.engine.counters
  assert all(len(o.output_ids) == p.max_tokens and o.finish_reason == "length"
             for o, (_, p) in zip(outs, jobs))
  assert all(o.token_versions == [0] * len(o.output_ids) for o in outs)
  check_logprobs(model, [p for p, _ in jobs], outs)
  # decoded together: far fewer decode steps than tokens
  tokens = sum(len(o.output_ids) for o in outs)
  steps = after["decode_steps"] - before.get("decode_steps", 0)
  print(f"{tokens} tokens in {steps} decode steps")
  assert steps < tokens / 2
  # greedy replies equal the engine run alone on the same prompts
  alone = Engine(model, CONFIG).generate(
      [p for p, _ in jobs[::3]],
      [engine_params(p) for _, p in jobs[::3]])
  assert [o.output_ids for o in outs[::3]] == [a.output_ids for a in alone]


def engine_params(p: SamplingParams) -> SamplingParams:
  return SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k)


@pytest.mark.parametrize("method, path, body, status, match", [
    ("POST", "/generate", b"{not json", 400, "malformed JSON"),
    ("POST", "/generate", b"[1, 2]", 400, "object"),
    ("POST", "/generate", {"max_tokens": 4}, 400, "input_ids: required"),
    ("POST", "/generate", {"input_ids": [1, 99999]}, 400, "token id 99999"),
    ("POST", "/generate", {"input_ids": [1, "a"]}, 400, "input_ids"),
    ("POST", "/generate", {"input_ids": [1, 2], "max_tokens": -3}, 400, "max_tokens=-3"),
    ("POST", "/generate", {"input_ids": [1, 2], "max_tokens": 10**9}, 400, "max_seq_len=192"),
    ("POST", "/generate", {"input_ids": [1, 2], "max_tokens": True}, 400, "max_tokens"),
    ("POST", "/generate", {"input_ids": [1, 2], "temprature": 1.0}, 400, "unknown fields"),
    ("POST", "/generate", {"input_ids": [1, 2], "top_p": 2.0}, 400, "top_p"),
    ("POST", "/generate", {"input_ids": [1] * 9000}, 413, "bodies are limited"),
    ("GET", "/generate", None, 405, "use POST"),
    ("GET", "/nowhere", None, 404, "no endpoint"),
    ("GET", "/v1/sessions/nobody", None, 404, "unknown session"),
    ("POST", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "role"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 99},
     400, "n=99"),
])
def test_bad_requests_get_4xx_and_server_keeps_serving(server, method, path, body, status,
                                                       match):
  srv, url = server
  raw = body if isinstance(body, bytes) else None
  got, reply = request(url + path, method, None if raw else body, raw=raw)
  assert got == status and match in reply["error"], (got, reply)
  assert request(url + "/health")[0] == 200
  ok, reply = request(url + "/generate", "POST", {"input_ids": [3, 4, 5], "max_tokens": 2})
  assert ok == 200 and len(reply["output_ids"]) == 2


def test_engine_policy_in_process(server):
  """The in-process envs.policy.Policy over the same engine answers like /generate."""
  srv, url = server
  params = SamplingParams(max_tokens=5, temperature=0.0)
  got = asyncio.run(EnginePolicy(srv.engine).generate([7, 8, 9], params))
  status, reply = request(url + "/generate", "POST", {"input_ids": [7, 8, 9], **params.to_dict()})
  assert status == 200 and got.output_ids == reply["output_ids"]
  np.testing.assert_allclose(got.logprobs, reply["logprobs"], atol=1e-6)
  assert got.finish_reason == "length" and got.token_versions == [0] * 5


def test_missing_content_length(server):
  import http.client
  srv, url = server
  conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
  conn.putrequest("POST", "/generate")
  conn.endheaders()
  resp = conn.getresponse()
  assert resp.status == 400 and b"Content-Length" in resp.read()


def test_chat_completions_and_session_log(server, model, tok):
  srv, url = server
  chat = srv.chat
  messages = [{"role": "system", "content": "Fix the bug."},
              {"role": "user", "content": "Hello world, run the tests."}]
  body = {"messages": messages, "max_tokens": 12, "temperature": 1.0, "seed": 3, "n": 2,
          "session_id": "episode-1", "logprobs": True, "top_logprobs": 2}
  status, reply = request(url + "/v1/chat/completions", "POST", body)
  assert status == 200, reply
  assert reply["object"] == "chat.completion" and len(reply["choices"]) == 2
  status, log = request(url + "/v1/sessions/episode-1")
  assert status == 200 and len(log["calls"]) == 2
  want_input = chat.render(messages, add_generation_prompt=True).ids
  for call, choice in zip(log["calls"], reply["choices"]):
    assert call["input_ids"] == want_input
    turn = chat.parse_assistant(call["output_ids"])
    assert choice["message"]["content"] == (turn.content or None)
    assert [c["logprob"] for c in choice["logprobs"]["content"]] == call["logprobs"]
    assert [c["token"] for c in choice["logprobs"]["content"]] == \
        [tok.decode([t]) for t in call["output_ids"]]
    assert all(len(c["top_logprobs"]) == 2 for c in choice["logprobs"]["content"])
  outs = [Completion(c["output_ids"], c["logprobs"], c["finish_reason"], c["token_versions"],
                     c["policy_version"], len(c["input_ids"]), 0) for c in log["calls"]]
  check_logprobs(model, [c["input_ids"] for c in log["calls"]], outs)
  assert reply["usage"]["prompt_tokens"] == len(want_input)

  # the next turn, sent by header: its prompt extends the first call's ids, which are reused
  first = log["calls"][0]
  follow = messages + [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]
                        or ""}, {"role": "user", "content": "Now fix it."}]
  before = srv.engine.counters["reused_tokens"]
  status, reply2 = request(url + "/v1/chat/completions", "POST",
                           {"messages": follow, "max_tokens": 4, "temperature": 0.0},
                           headers={"X-Session-Id": "episode-1"})
  assert status == 200, reply2
  status, log = request(url + "/v1/sessions/episode-1")
  assert len(log["calls"]) == 3 and log["calls"][2]["input_ids"][:len(want_input)] == want_input
  assert srv.engine.counters["reused_tokens"] - before >= len(want_input)
  assert first["output_ids"]  # the log is what was served, not re-rendered text

  # bounded: a call that could overflow the session's log is refused before it runs
  status, reply = request(url + "/v1/chat/completions", "POST",
                          {"messages": messages, "max_tokens": 60, "n": 16,
                           "session_id": "episode-1"})
  assert status == 413 and "session" in reply["error"]
  assert request(url + "/v1/sessions/episode-1", "DELETE")[0] == 200
  assert request(url + "/v1/sessions/episode-1")[0] == 404


class ScriptedEngine:
  """Stands in for the engine: answers every request with fixed ids."""

  def __init__(self, output_ids, capacity=4096):
    self.output_ids, self.capacity, self.version = output_ids, capacity, 7
    self.cfg = EngineConfig(top_logprobs=0)
    self.counters, self.submitted = {}, []

  def submit(self, input_ids, params):
    self.submitted.append((list(input_ids), params))
    f = concurrent.futures.Future()
    f.set_result(Completion(list(self.output_ids), [-0.5] * len(self.output_ids), "stop",
                            [7] * len(self.output_ids), 7, len(input_ids), 0))
    return f

  def pending(self):
    return 0

  def start(self):
    pass

  def stop(self):
    pass


def test_chat_tool_calls_are_parsed(tok):
  chat = make_chat("qwen2.5", tok)
  call = {"role": "assistant", "content": "Let me look.",
          "tool_calls": [{"function": {"name": "read_file", "arguments": {"path": "a.py"}}}]}
  engine = ScriptedEngine(chat.assistant_ids(call))
  srv = PolicyServer(engine, ServerConfig(port=0), tokenizer=tok, chat=chat)
  url = srv.start_in_thread()
  try:
    messages = [{"role": "user", "content": "Fix the bug in utils.py please."}]
    status, reply = request(url + "/v1/chat/completions", "POST",
                            {"messages": messages, "tools": TOOLS, "session_id": "s"})
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look."
    fn = choice["message"]["tool_calls"][0]["function"]
    assert fn["name"] == "read_file" and json.loads(fn["arguments"]) == {"path": "a.py"}
    # the engine got the template's ids with the tools, and the chat format's stop tokens
    input_ids, params = engine.submitted[0]
    assert input_ids == chat.render(messages, TOOLS).ids
    assert set(chat.stop_token_ids) <= set(params.stop_token_ids)
    log = request(url + "/v1/sessions/s")[1]["calls"]
    assert log[0]["input_ids"] == input_ids and log[0]["output_ids"] == engine.output_ids
    assert log[0]["policy_version"] == 7
  finally:
    srv.stop()


def test_token_protected_server(tok):
  engine = ScriptedEngine([5, 6])
  srv = PolicyServer(engine, ServerConfig(port=0, token="s3cret"))
  url = srv.start_in_thread()
  try:
    body = {"input_ids": [1, 2], "max_tokens": 2}
    assert request(url + "/generate", "POST", body)[0] == 401
    assert request(url + "/generate", "POST", body,
                   headers={"Authorization": "Bearer wrong"})[0] == 401
    status, reply = request(url + "/generate", "POST", body,
                            headers={"Authorization": "Bearer s3cret"})
    assert status == 200 and reply["output_ids"] == [5, 6] and reply["policy_version"] == 7
    assert request(url + "/health")[0] == 200  # health needs no token
    assert request(url + "/v1/chat/completions", "POST", {"messages": []},
                   headers={"Authorization": "Bearer s3cret"})[0] == 501  # no tokenizer
  finally:
    srv.stop()


def test_non_loopback_bind_needs_a_token():
  for host in ("0.0.0.0", "10.1.2.3", "example.org"):
    with pytest.raises(ValueError, match="token"):
      check_bind(host, None)
  check_bind("0.0.0.0", "t")
  check_bind("127.0.0.1", None)
  check_bind("localhost", None)
  with pytest.raises(ValueError, match="refusing"):
    PolicyServer(ScriptedEngine([1]), ServerConfig(host="0.0.0.0"))
  proc = subprocess.run([sys.executable, "-m", "trainer.serve", "--preset", "tiny-dense",
                         "--host", "0.0.0.0", "--port", "0"], capture_output=True, text=True,
                        timeout=120, cwd=ROOT, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ROOT})
  assert proc.returncode == 2 and "refusing to bind" in proc.stderr
