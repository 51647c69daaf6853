"""trainer/serve.py: the policy server over HTTP on 127.0.0.1, driven by its real clients.

- /generate: 36 concurrent requests from 6 client threads (envs.policy.HTTPPolicy): each reply's
  log-probs equal teacher-forced log-probs (with one entropy per token), greedy replies equal the
  engine run alone, and the requests were decoded together.
- The OpenAI endpoints through the official `openai` client: streamed replies assembled from
  their Server-Sent Events equal the non-streamed ones (content, tool calls, finish reasons,
  log-probs, usage) and leave while the engine is still generating; tool_choice in every form,
  n > 1, stop strings cut from the text as OpenAI does (the session log keeps the exact sampled
  ids), log-probs equal to teacher-forced ones, /v1/models, /v1/completions with every prompt
  form, multi-turn agent requests rendered as transformers renders Qwen2.5's published template.
- Errors are OpenAI error objects the client raises as BadRequestError, AuthenticationError,
  NotFoundError..., with message and param; the server keeps serving. A non-loopback bind
  without a token and a tokenizer larger than the model's vocabulary refuse to start.
"""

import asyncio
import concurrent.futures
import http.client
import json
import os
import re
import ssl
import subprocess
import sys
import threading
import types
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from envs.chat import load_chat, make_chat
from envs.chat.formats import Plain
from envs.chat.tokenizer import HFTokenizer
from envs.net import check_bind
from envs.policy import HTTPPolicy, SamplingParams
from models import transformer
from models.engine import Completion, Engine, EngineConfig
from tests.conftest import TINY_DENSE
from tests.test_chat import QWEN25_TEMPLATE, _tiny_bpe, hf_render
from tests import test_chat_templates as templates
from tests.test_engine import check_logprobs
from trainer.serve import (EnginePolicy, PolicyServer, ServerConfig, build, checkpoint_chat,
                           parse_args)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = EngineConfig(slots=8, max_seq_len=192, prefix_cache_rows=8, min_prefix=4,
                      prefill_chunk=32, prefill_bucket=32, prefill_rows=4, steps_per_call=8,
                      max_stop_token_ids=4, top_logprobs=3)
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}},
         {"type": "function", "function": {
             "name": "bash", "description": "Run a shell command.",
             "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                            "required": ["command"]}}}]
USER = [{"role": "system", "content": "Fix the bug."},
        {"role": "user", "content": "Hello world, run the tests."}]


@pytest.fixture(scope="module")
def tok():
  return HFTokenizer(_tiny_bpe(), eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("tok")
  _tiny_bpe().save(str(d / "tokenizer.json"))
  (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
  return str(d)


@pytest.fixture(scope="module")
def model(tok):
  return transformer.init(TINY_DENSE.replace(vocab_size=tok.vocab_size), seed=0)


@pytest.fixture(scope="module")
def server(model, tok):
  """A real engine behind the server; the chat format renders the Plain headers."""
  chat = make_chat("plain", tok)
  engine = Engine(model, CONFIG, detokenize=tok.decode)
  srv = PolicyServer(engine, ServerConfig(port=0, served_name="tiny", max_body_bytes=20_000,
                                          max_session_tokens=1_000), tokenizer=tok, chat=chat)
  url = srv.start_in_thread()
  yield srv, url
  srv.stop()


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0,
                       timeout=120)


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


def assemble(chunks):
  """Choices of a streamed chat reply, assembled as a client does."""
  got = {}
  for c in chunks:
    for ch in c.choices:
      g = got.setdefault(ch.index, {"role": None, "content": "", "calls": {}, "logprobs": [],
                                    "finish_reason": None, "content_chunks": 0,
                                    "reasoning_content": None})
      d = ch.delta
      g["role"] = g["role"] or d.role
      if getattr(d, "reasoning_content", None):
        g["reasoning_content"] = (g["reasoning_content"] or "") + d.reasoning_content
      if d.content:
        g["content"] += d.content
        g["content_chunks"] += 1
      for t in d.tool_calls or ():
        call = g["calls"].setdefault(t.index, {"id": None, "type": None, "name": "",
                                               "arguments": ""})
        call["id"] = call["id"] or t.id
        call["type"] = call["type"] or t.type
        call["name"] += (t.function.name or "") if t.function else ""
        call["arguments"] += (t.function.arguments or "") if t.function else ""
      if ch.logprobs and ch.logprobs.content:
        g["logprobs"] += ch.logprobs.content
      if ch.finish_reason:
        g["finish_reason"] = ch.finish_reason
  return [got[i] for i in sorted(got)]


# ----------------------------------------------------------------------------- /generate


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
  assert all(len(o.entropies) == len(o.output_ids) for o in outs)
  check_logprobs(model, [p for p, _ in jobs], outs)
  # decoded together: far fewer decode steps than tokens
  tokens = sum(len(o.output_ids) for o in outs)
  steps = after["decode_steps"] - before.get("decode_steps", 0)
  print(f"{tokens} tokens in {steps} decode steps")
  assert steps < tokens / 2
  # greedy replies equal the engine run alone on the same prompts
  alone = Engine(model, CONFIG).generate(
      [p for p, _ in jobs[::3]],
      [SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k)
       for _, p in jobs[::3]])
  assert [o.output_ids for o in outs[::3]] == [a.output_ids for a in alone]


def test_engine_policy_in_process(server):
  """The in-process envs.policy.Policy over the same engine answers like /generate."""
  srv, url = server
  params = SamplingParams(max_tokens=5, temperature=0.0)
  got = asyncio.run(EnginePolicy(srv.engine).generate([7, 8, 9], params))
  status, reply = request(url + "/generate", "POST", {"input_ids": [7, 8, 9], **params.to_dict()})
  assert status == 200 and got.output_ids == reply["output_ids"]
  np.testing.assert_allclose(got.logprobs, reply["logprobs"], atol=1e-6)
  np.testing.assert_allclose(got.entropies, reply["entropies"], atol=1e-6)
  assert got.finish_reason == "length" and got.token_versions == [0] * 5


def test_engine_progress_hook(server, tok):
  """Engine.submit(on_tokens=...) reports growing prefixes of the final output, never taking a
  token back, also when a stop string cuts the last call's tokens."""
  srv, _ = server
  prompt = tok.encode("Hello world, run the tests.")
  free = srv.engine.submit(prompt, SamplingParams(max_tokens=40, temperature=0.0)).result(60)
  text = tok.decode(free.output_ids)
  stop = text[len(text) // 2:len(text) // 2 + 2]
  for params in (SamplingParams(max_tokens=40, temperature=0.0),
                 SamplingParams(max_tokens=40, temperature=0.0, stop=(stop,))):
    calls = []
    out = srv.engine.submit(prompt, params, on_tokens=lambda *a: calls.append(a)).result(60)
    assert len(calls) > 1 and calls[-1][0] == out.output_ids, (len(calls), params)
    for (ids, lps, top), (later, _, _) in zip(calls, calls[1:]):
      assert later[:len(ids)] == ids and len(later) > len(ids)
      assert lps == out.logprobs[:len(ids)] and top == out.top_logprobs[:len(ids)]
  assert out.finish_reason == "stop" and stop in tok.decode(out.output_ids)


# ----------------------------------------------------------------------------- chat


def test_chat_stream_equals_reply(server, client, model, tok):
  """n = 2 seeded samples with log-probs: the stream, assembled, is the reply; log-probs and top
  log-probs equal the teacher-forced model's; the session log records the sampling params."""
  srv, url = server
  kw = dict(model="tiny", messages=USER, max_tokens=40, temperature=1.0, seed=11, n=2,
            logprobs=True, top_logprobs=2)
  reply = client.chat.completions.create(**kw, extra_body={"session_id": "stream-1"})
  chunks = list(client.chat.completions.create(**kw, stream=True,
                                               stream_options={"include_usage": True}))
  streamed = assemble(chunks)
  assert reply.model == "tiny" and reply.object == "chat.completion" and reply.created > 0
  assert len(reply.choices) == len(streamed) == 2
  for choice, got in zip(reply.choices, streamed):
    assert got["role"] == "assistant" and got["calls"] == {}
    assert got["content"] == (choice.message.content or "")
    assert got["finish_reason"] == choice.finish_reason
    assert [(x.token, x.logprob) for x in got["logprobs"]] == \
        [(x.token, x.logprob) for x in choice.logprobs.content]
    assert [[(t.token, t.logprob) for t in x.top_logprobs] for x in got["logprobs"]] == \
        [[(t.token, t.logprob) for t in x.top_logprobs] for x in choice.logprobs.content]
  assert streamed[0]["content_chunks"] > 1  # incremental, not one chunk at the end
  assert chunks[0].choices[0].delta.role == "assistant"
  assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == reply.usage.model_dump()
  assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
  # the log holds the exact ids; log-probs and top-2 equal the teacher-forced model's
  calls = request(url + "/v1/sessions/stream-1")[1]["calls"]
  assert [c["params"] for c in calls] == [
      {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": 40, "stop": [],
       "stop_token_ids": [tok.eos_id], "seed": 11 + i, "n": 2, "tool_choice": "none"}
      for i in range(2)]
  outs = [Completion(c["output_ids"], c["logprobs"], c["finish_reason"], c["token_versions"],
                     c["policy_version"], len(c["input_ids"]), 0) for c in calls]
  refs = check_logprobs(model, [c["input_ids"] for c in calls], outs)
  for call, choice, (logp, _) in zip(calls, reply.choices, refs):
    n = len(call["input_ids"])
    assert [x.token for x in choice.logprobs.content] == [tok.decode([t])
                                                          for t in call["output_ids"]]
    for k, x in enumerate(choice.logprobs.content):
      best = np.sort(logp[n - 1 + k])[::-1][:2]
      np.testing.assert_allclose([t.logprob for t in x.top_logprobs], best, atol=2e-4)
  assert reply.usage.completion_tokens == sum(len(c["output_ids"]) for c in calls)
  assert reply.usage.prompt_tokens == len(calls[0]["input_ids"])
  # on the wire: Server-Sent Events ending with [DONE]
  req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(
      {**kw, "stream": True}).encode(), {"Content-Type": "application/json"})
  with urllib.request.urlopen(req, timeout=60) as resp:
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = resp.read().decode().split("\n\n")
  assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: {") for e in events[:-2])


def test_stop_strings_are_cut_from_the_text(server, client, tok):
  """OpenAI returns "Value" for stop "Er" on "ValueError": the stop string and what follows is
  cut from the text, streamed or not, while the session log keeps the ids that were sampled.
  The stop string here starts inside a token and ends in the next decode call's first token,
  so the stream must hold back a possible stop string's start."""
  srv, url = server
  prompt = srv.chat.render(USER).ids
  sizes = []  # the greedy reply, and how many tokens each decode call had made
  ids = srv.engine.submit(prompt, SamplingParams(
      max_tokens=40, temperature=0.0, stop_token_ids=(tok.eos_id,)),
      on_tokens=lambda out, *_: sizes.append(len(out))).result(60).output_ids
  text = tok.decode(ids)

  def spanning(b):  # the stop string from inside token b - 1 to the end of token b's 1st char
    token, start = tok.decode([ids[b - 1]]), len(tok.decode(ids[:b]))
    stop = token[1:] + tok.decode([ids[b]])[:1]
    return stop if len(token) >= 2 and text.find(stop) == start - len(token) + 1 and \
        stop.isprintable() and stop.strip() == stop else None

  stop = next(filter(None, map(spanning, sizes[:-1])))
  want = text[:text.find(stop)].strip()  # chat content is stripped
  kw = dict(model="tiny", messages=USER, max_tokens=40, temperature=0.0,
            stop=[stop, "never-seen"])
  reply = client.chat.completions.create(**kw, extra_body={"session_id": "stops"})
  assert reply.choices[0].message.content == want and reply.choices[0].finish_reason == "stop"
  streamed = assemble(client.chat.completions.create(**kw, stream=True))
  assert streamed[0]["content"] == want and streamed[0]["finish_reason"] == "stop"
  call = request(url + "/v1/sessions/stops")[1]["calls"][0]
  out = call["output_ids"]
  assert out == ids[:len(out)] and stop in tok.decode(out) and stop not in tok.decode(out[:-1])
  assert call["params"]["stop"] == [stop, "never-seen"]
  # completions: the same cut, whitespace kept
  kw = dict(model="tiny", prompt=prompt, max_tokens=40, temperature=0, stop=stop)
  assert client.completions.create(**kw).choices[0].text == text[:text.find(stop)]
  chunks = client.completions.create(**kw, stream=True)
  assert "".join(c.choices[0].text for c in chunks) == text[:text.find(stop)]


def test_chat_session_log_and_prefix_reuse(server, client, tok):
  """The session log holds the ids served; the next turn's prompt extends them and reuses the
  cache; a call that could overflow the session's log is refused before it runs."""
  srv, url = server
  chat = srv.chat
  first = client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, seed=3,
                                         extra_body={"session_id": "episode-1"})
  log = request(url + "/v1/sessions/episode-1")[1]["calls"]
  want_input = chat.render(USER, add_generation_prompt=True).ids
  assert log[0]["input_ids"] == want_input
  turn = chat.parse_assistant(log[0]["output_ids"])
  assert first.choices[0].message.content == (turn.content or None)
  follow = USER + [{"role": "assistant", "content": first.choices[0].message.content or ""},
                   {"role": "user", "content": "Now fix it."}]
  before = srv.engine.counters["reused_tokens"]
  client.chat.completions.create(model="tiny", messages=follow, max_tokens=4, temperature=0,
                                 extra_headers={"X-Session-Id": "episode-1"})
  log = request(url + "/v1/sessions/episode-1")[1]["calls"]
  assert len(log) == 2 and log[1]["input_ids"][:len(want_input)] == want_input
  assert srv.engine.counters["reused_tokens"] - before >= len(want_input)
  with pytest.raises(openai.APIStatusError, match="session") as e:
    client.chat.completions.create(model="tiny", messages=USER, max_tokens=60, n=16,
                                   extra_body={"session_id": "episode-1"})
  assert e.value.status_code == 413 and e.value.param == "session_id"
  assert request(url + "/v1/sessions/episode-1", "DELETE")[0] == 200
  assert request(url + "/v1/sessions/episode-1")[0] == 404


# ----------------------------------------------------------------------------- completions


def test_completions_every_prompt_form(server, client, tok):
  """Text, texts, ids and lists of ids give the engine's greedy continuation (as /generate
  answers it) as text, with legacy log-probs; echo prepends the prompt; the stream assembles to
  the reply."""
  srv, url = server
  texts = ["Hello world", "def add(a, b):"]
  ids = [tok.encode(t) for t in texts]
  ref = [request(url + "/generate", "POST", {"input_ids": p, "max_tokens": 10, "temperature": 0,
                                             "stop_token_ids": [tok.eos_id]})[1] for p in ids]
  ref_text = [tok.decode([t for t in r["output_ids"] if t != tok.eos_id]) for r in ref]
  kw = dict(model="tiny", max_tokens=10, temperature=0)
  for prompt, which in ((texts[0], [0]), (texts, [0, 1]), (ids[1], [1]), (ids, [0, 1])):
    reply = client.completions.create(prompt=prompt, n=2, logprobs=2, **kw)
    assert reply.object == "text_completion" and len(reply.choices) == 2 * len(which)
    for choice, p in zip(reply.choices, [p for p in which for _ in range(2)]):
      assert choice.text == ref_text[p]
      lp = choice.logprobs
      assert lp.tokens == [tok.decode([t]) for t in ref[p]["output_ids"]]
      np.testing.assert_allclose(lp.token_logprobs, ref[p]["logprobs"], atol=1e-6)
      # the 2 best alternatives, and the sampled token (the greedy one: the best)
      assert all(t in d and len(d) <= 2 for d, t in zip(lp.top_logprobs, lp.tokens))
      np.testing.assert_allclose([max(d.values()) for d in lp.top_logprobs],
                                 [top[0][1] for top in ref[p]["top_logprobs"]], atol=1e-6)
      assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    assert reply.usage.prompt_tokens == sum(len(ids[p]) for p in which)
  echo = client.completions.create(prompt=texts, echo=True, **kw)
  assert [c.text for c in echo.choices] == [t + r for t, r in zip(texts, ref_text)]
  chunks = list(client.completions.create(prompt=ids, echo=True, stream=True,
                                          stream_options={"include_usage": True}, **kw))
  got = ["", ""]
  for c in chunks:
    for ch in c.choices:
      got[ch.index] += ch.text
  assert got == [t + r for t, r in zip(texts, ref_text)] and chunks[-1].usage.total_tokens == \
      echo.usage.total_tokens
  # streamed log-probs, assembled, are the reply's
  kw["max_tokens"] = 30
  reply = client.completions.create(prompt=ids, logprobs=2, **kw)
  got = [{"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
         for _ in ids]
  for c in client.completions.create(prompt=ids, logprobs=2, stream=True, **kw):
    for ch in c.choices:
      for key in (got[ch.index] if ch.logprobs else ()):
        got[ch.index][key] += getattr(ch.logprobs, key)
  assert got == [c.logprobs.model_dump() for c in reply.choices]
  with pytest.raises(openai.BadRequestError, match="echo") as e:
    client.completions.create(prompt="Hi", echo=True, logprobs=1, **kw)
  assert e.value.param == "echo"


def test_models(client):
  assert [m.id for m in client.models.list().data] == ["tiny"]
  assert client.models.retrieve("tiny").owned_by == "arbor"
  with pytest.raises(openai.NotFoundError, match="serves 'tiny'"):
    client.models.retrieve("gpt-4")
  with pytest.raises(openai.NotFoundError) as e:
    client.chat.completions.create(model="gpt-4", messages=USER)
  assert e.value.code == "model_not_found" and e.value.param == "model"


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kw, param, match", [
    (dict(messages=[]), "messages", "non-empty"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role", "wizard"),
    (dict(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]),
     "messages[0].content[0].type", "'image_url' is not supported"),
    (dict(messages=USER, n=99), "n", "n=99"),
    (dict(messages=USER, logprobs=True, top_logprobs=4), "top_logprobs", "at most 3"),
    (dict(messages=USER, top_p=2.0), "top_p", "top_p=2.0"),
    (dict(messages=USER, max_tokens=10**6), "max_tokens", "max_seq_len=192"),
    (dict(messages=USER, tools=TOOLS, tool_choice={"type": "function",
                                                   "function": {"name": "rm"}}),
     "tool_choice", "'rm', which is not in tools"),
    (dict(messages=USER, tool_choice="required"), "tool_choice", "needs tools"),
    (dict(messages=USER, presence_penalty=1.0), "presence_penalty", "not supported"),
    (dict(messages=USER, extra_body={"chat_template_kwargs": {"enable_thinking": False}}),
     "chat_template_kwargs", "takes no template kwargs"),
])
def test_chat_errors_are_openai_errors(client, kw, param, match):
  with pytest.raises(openai.BadRequestError, match=match.replace("(", r"\(").replace(
      ")", r"\)").replace("[", r"\[")) as e:
    client.chat.completions.create(model="tiny", **kw)
  assert e.value.param == param and e.value.type == "invalid_request_error"


@pytest.mark.parametrize("method, path, body, status, param, match", [
    ("POST", "/generate", b"{not json", 400, None, "malformed JSON"),
    ("POST", "/generate", b"", 400, None, "malformed JSON"),
    ("POST", "/generate", b"[1, 2]", 400, None, "object"),
    ("POST", "/generate", {"max_tokens": 4}, 400, "input_ids", "input_ids: required"),
    ("POST", "/generate", {"input_ids": [1, 99999]}, 400, "input_ids", "token id 99999"),
    ("POST", "/generate", {"input_ids": [1, "a"]}, 400, "input_ids", "input_ids"),
    ("POST", "/generate", {"input_ids": [1, 2], "max_tokens": -3}, 400, "max_tokens",
     "max_tokens=-3"),
    ("POST", "/generate", {"input_ids": [1, 2], "max_tokens": True}, 400, "max_tokens",
     "max_tokens"),
    ("POST", "/generate", {"input_ids": [1, 2], "temprature": 1.0}, 400, "temprature",
     "unknown fields"),
    ("POST", "/generate", {"input_ids": [1] * 9000}, 413, None, "bodies are limited to 20000"),
    ("POST", "/v1/completions", {"prompt": [[1, 2], "x", 3]}, 400, "prompt", "prompt="),
    ("POST", "/v1/completions", {"prompt": "x", "logprobs": 9}, 400, "logprobs", "at most 3"),
    ("GET", "/generate", None, 405, None, "use POST"),
    ("GET", "/nowhere", None, 404, None, "no endpoint"),
    ("GET", "/v1/sessions/nobody", None, 404, "session_id", "unknown session"),
])
def test_bad_requests_get_error_objects_and_server_keeps_serving(server, method, path, body,
                                                                 status, param, match):
  srv, url = server
  raw = body if isinstance(body, bytes) else None
  got, reply = request(url + path, method, None if raw else body, raw=raw)
  assert got == status and match in reply["error"]["message"], (got, reply)
  assert reply["error"]["param"] == param and set(reply["error"]) == {
      "message", "type", "param", "code"}
  assert request(url + "/health")[0] == 200
  ok, reply = request(url + "/generate", "POST", {"input_ids": [3, 4, 5], "max_tokens": 2})
  assert ok == 200 and len(reply["output_ids"]) == 2


def test_chunked_body_over_the_limit(server):
  """A chunked body (no Content-Length) is counted as it arrives."""
  srv, url = server
  conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
  body = [b'{"input_ids": [1'] + [b", 1"] * 9000 + [b"]}"]
  conn.request("POST", "/generate", body=iter(body), encode_chunked=True,
               headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
  resp = conn.getresponse()
  error = json.loads(resp.read())["error"]
  assert resp.status == 413 and "bodies are limited to 20000" in error["message"]
  conn.close()
  ok, reply = request(url + "/generate", "POST", {"input_ids": [3, 4, 5], "max_tokens": 2})
  assert ok == 200


# ----------------------------------------------------------------------------- tool calls


class ScriptedEngine:
  """Stands in for the engine: answers each request with the next scripted ids, reporting them
  to an `on_tokens` hook `step` at a time; with `gate` set, it holds the second half until the gate
  opens (from a thread, as the real engine does)."""

  def __init__(self, vocab_size, capacity=4096):
    self.replies, self.capacity, self.version = [], capacity, 7
    self.cfg = EngineConfig(top_logprobs=0)
    self.model_cfg = types.SimpleNamespace(vocab_size=vocab_size)
    self.counters, self.submitted, self.gate, self.step = {}, [], None, 3

  def submit(self, input_ids, params, on_tokens=None):
    self.submitted.append((list(input_ids), params))
    ids = list(self.replies.pop(0) if len(self.replies) > 1 else self.replies[0])
    lps = [-0.5] * len(ids)
    f = concurrent.futures.Future()

    def run():
      for k in range(self.step, len(ids), self.step):
        if on_tokens is not None:
          on_tokens(ids[:k], lps[:k], None)
        if self.gate is not None and k >= len(ids) // 2:
          self.gate.wait(30)
      f.set_result(Completion(ids, lps, "stop", [7] * len(ids), 7, len(input_ids), 0))

    if self.gate is None:
      run()
    else:
      threading.Thread(target=run, daemon=True).start()
    return f

  def pending(self):
    return 0

  def start(self):
    pass

  def stop(self):
    pass


@pytest.fixture(scope="module")
def scripted(tok):
  """A Qwen2.5-format server over a ScriptedEngine, with its openai client."""
  chat = make_chat("qwen2.5", tok)
  engine = ScriptedEngine(tok.vocab_size)
  srv = PolicyServer(engine, ServerConfig(port=0), tokenizer=tok, chat=chat)
  url = srv.start_in_thread()
  yield srv, url, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                timeout=60)
  srv.stop()


def said(chat, text):
  """The ids a model emits for an assistant turn's raw text."""
  return chat.assistant_ids(text)


CALL_TEXT = ('Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}'
             '\n</tool_call>\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}'
             '\n</tool_call>')


def test_tool_calls_stream_equals_reply(scripted):
  """Tool calls (auto): content, then the calls with unique ids; the stream sends content
  deltas, then per call its id, type and name, then argument fragments."""
  srv, url, client = scripted
  srv.engine.replies = [said(srv.chat, CALL_TEXT)]
  kw = dict(model="arbor", messages=USER, tools=TOOLS)
  reply = client.chat.completions.create(**kw)
  choice = reply.choices[0]
  assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
  calls = [(c.function.name, json.loads(c.function.arguments), c.type)
           for c in choice.message.tool_calls]
  assert calls == [("read_file", {"path": "a.py"}, "function"), ("bash", {"command": "ls"},
                                                                 "function")]
  chunks = list(client.chat.completions.create(**kw, stream=True))
  got = assemble(chunks)[0]
  assert got["content"] == "Let me look." and got["finish_reason"] == "tool_calls"
  assert [(c["name"], json.loads(c["arguments"]), c["type"]) for c in got["calls"].values()] \
      == calls
  for index, name in enumerate(["read_file", "bash"]):
    first, *more = [t for c in chunks for ch in c.choices for t in ch.delta.tool_calls or ()
                    if t.index == index]
    assert first.id and first.function.name == name and first.function.arguments == ""
    assert more and all(t.id is None and t.function.name is None for t in more)
  ids = [c.id for c in choice.message.tool_calls] + [c["id"] for c in got["calls"].values()]
  assert len(set(ids)) == 4 and all(i.startswith("call_") and len(i) > 12 for i in ids)
  assert srv.engine.submitted[-1][0] == srv.chat.render(USER, TOOLS).ids


def test_stream_leaves_while_the_engine_generates(scripted):
  """The first content delta reaches the client while the engine still holds the rest."""
  srv, url, client = scripted
  srv.engine.replies = [said(srv.chat, "Hello world, this is a test of the tokenizer.")]
  srv.engine.gate = threading.Event()
  try:
    stream = iter(client.chat.completions.create(model="arbor", messages=USER, stream=True))
    assert next(stream).choices[0].delta.role == "assistant"
    first = next(stream).choices[0].delta.content
    assert first and not srv.engine.gate.is_set()
    srv.engine.gate.set()
    rest = "".join(c.choices[0].delta.content or "" for c in stream)
    assert first + rest == "Hello world, this is a test of the tokenizer."
  finally:
    srv.engine.gate.set()
    srv.engine.gate = None


def test_stream_holds_back_what_may_change(scripted, tok):
  """Reported one token at a time, multi-byte characters and a tool-call opening spelled in
  pieces arrive in parts: the stream never sends half a character (U+FFFD) nor the start of the
  opening as content, and assembles to the reply."""
  srv, url, client = scripted
  text = "naïve café ✓ 中文 done"
  pieces = ["\n<", "tool", "_", "call", '>\n{"name": "bash", "arguments": {"command": "ls"}}',
            "\n</tool_call>"]
  srv.engine.replies = [tok.encode(text) + [i for p in pieces for i in tok.encode(p)]
                        + [srv.chat.end_id]]
  srv.engine.step = 1
  try:
    kw = dict(model="arbor", messages=USER, tools=TOOLS)
    reply = client.chat.completions.create(**kw).choices[0]
    got = assemble(client.chat.completions.create(**kw, stream=True))[0]
  finally:
    srv.engine.step = 3
  assert reply.message.content == got["content"] == text and got["content_chunks"] > 5
  assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == [
      (c.function.name, c.function.arguments) for c in reply.message.tool_calls]


def test_tool_choice_forms(scripted, tok):
  """none: no tools rendered, no calls parsed; required / named: the prompt ends with the
  call's opening (logged as input ids), and prefix + sampled ids parse to the call;
  parallel_tool_calls=false keeps the first call."""
  srv, url, client = scripted
  chat = srv.chat
  kw = dict(model="arbor", messages=USER, tools=TOOLS)

  srv.engine.replies = [said(chat, CALL_TEXT)]
  reply = client.chat.completions.create(**kw, tool_choice="none")
  assert reply.choices[0].message.tool_calls is None
  assert reply.choices[0].message.content == CALL_TEXT
  assert reply.choices[0].finish_reason == "stop"
  assert srv.engine.submitted[-1][0] == chat.render(USER).ids

  reply = client.chat.completions.create(**kw, parallel_tool_calls=False)
  assert [c.function.name for c in reply.choices[0].message.tool_calls] == ["read_file"]
  streamed = assemble(client.chat.completions.create(**kw, parallel_tool_calls=False,
                                                     stream=True))
  assert [c["name"] for c in streamed[0]["calls"].values()] == ["read_file"]

  for choice, name in (("required", None), ({"type": "function",
                                             "function": {"name": "bash"}}, "bash")):
    prefix = chat.tool_call_prefix_ids(name)
    said_by_prefix = tok.decode(prefix)
    rest = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -l"}}\n</tool_call>'
    assert rest.startswith(said_by_prefix)
    srv.engine.replies = [tok.encode(rest[len(said_by_prefix):]) + [chat.end_id]]
    for stream in (False, True):
      out = client.chat.completions.create(**kw, tool_choice=choice, stream=stream,
                                           extra_body={"session_id": f"forced-{name}"})
      if stream:
        got = assemble(out)[0]
        calls = [(c["name"], json.loads(c["arguments"])) for c in got["calls"].values()]
        content, reason = got["content"] or None, got["finish_reason"]
      else:
        calls = [(c.function.name, json.loads(c.function.arguments))
                 for c in out.choices[0].message.tool_calls]
        content, reason = out.choices[0].message.content, out.choices[0].finish_reason
      assert calls == [("bash", {"command": "ls -l"})] and content is None, (choice, stream)
      assert reason == "tool_calls"
      assert srv.engine.submitted[-1][0] == chat.render(USER, TOOLS).ids + prefix
    log = request(url + f"/v1/sessions/forced-{name}")[1]["calls"]
    assert log[0]["input_ids"] == chat.render(USER, TOOLS).ids + prefix
    assert log[0]["output_ids"] == srv.engine.replies[0]
    assert log[0]["params"]["tool_choice"] == choice


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
  """The independent reference: transformers over the same tokenizer.json."""
  return PreTrainedTokenizerFast(tokenizer_file=os.path.join(tok_dir, "tokenizer.json"),
                                 eos_token="<|im_end|>")


def test_multi_turn_agent_request(scripted, hf_tok):
  """An agent loop as clients write it: the SDK's own reply message appended (content None,
  tool_calls, refusal, ...), tool messages with tool_call_id, content as text parts and the
  developer role. The engine gets what transformers renders from Qwen2.5's published template
  for the same conversation in plain form."""
  srv, url, client = scripted
  chat = srv.chat
  srv.engine.replies = [said(chat, {"role": "assistant", "content": None, "tool_calls": [
      {"function": {"name": "read_file", "arguments": {"path": "a.py"}}}]}),
                        said(chat, "Fixed it.")]
  messages = [{"role": "developer", "content": [{"type": "text", "text": "Fix the bug."},
                                                {"type": "text", "text": "Be brief."}]},
              {"role": "user", "content": [{"type": "text", "text": "Tests fail."}],
               "name": "dev"}]
  first = client.chat.completions.create(model="arbor", messages=messages, tools=TOOLS)
  call = first.choices[0].message.tool_calls[0]
  messages += [first.choices[0].message,
               {"role": "tool", "tool_call_id": call.id, "content": "def add(a, b):"}]
  second = client.chat.completions.create(model="arbor", messages=messages, tools=TOOLS)
  assert second.choices[0].message.content == "Fixed it."
  plain = [{"role": "system", "content": "Fix the bug.\nBe brief."},
           {"role": "user", "content": "Tests fail."},
           {"role": "assistant", "content": None, "tool_calls": [
               {"type": "function", "function": {"name": "read_file",
                                                 "arguments": {"path": "a.py"}}}]},
           {"role": "tool", "content": "def add(a, b):"}]
  assert srv.engine.submitted[-1][0] == hf_render(hf_tok, QWEN25_TEMPLATE, plain, TOOLS)
  assert srv.engine.submitted[-2][0] == hf_render(hf_tok, QWEN25_TEMPLATE, plain[:2], TOOLS)


@pytest.mark.parametrize("name", ["qwen3", "kimi-k2-thinking"])
def test_checkpoint_templates_end_to_end(tmp_path, name):
  """A checkpoint's own Jinja template (envs.chat.load_chat) behind the server: reasoning,
  content and tool calls read back, streamed one token at a time and assembled to the reply
  (Kimi K2's own call ids kept); the next turn, sent as an agent sends it, reaches the engine as
  transformers' apply_chat_template renders it; template kwargs reach the forced opening."""
  d = templates.save_checkpoint(tmp_path, templates.template(name),
                                **templates.FIXTURES[name][0])
  chat, hf = load_chat(d), AutoTokenizer.from_pretrained(d)
  engine = ScriptedEngine(chat.tokenizer.vocab_size)
  # the reply as sampled one token at a time, its reasoning tags written in two pieces each
  ids = chat.assistant_ids(templates.REPLY)
  pieces = re.split("(</?think>)", chat.tokenizer.decode(ids[:-1]))
  engine.replies = [[i for p in pieces for part in ((p[:4], p[4:]) if "think>" in p else (p,))
                     for i in chat.tokenizer.encode(part)] + ids[-1:]]
  engine.step = 1
  srv = PolicyServer(engine, ServerConfig(port=0), tokenizer=chat.tokenizer, chat=chat)
  client = openai.OpenAI(base_url=srv.start_in_thread() + "/v1", api_key="-", max_retries=0)
  try:
    tools, messages = templates.TOOLS, templates.CONVERSATIONS["no_system"][:1]
    reply = client.chat.completions.create(model="arbor", messages=messages, tools=tools)
    got = assemble(client.chat.completions.create(model="arbor", messages=messages,
                                                  tools=tools, stream=True))[0]
    message = reply.choices[0].message
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    assert calls == [("read_file", {"path": "src/app.py", "start_line": 3}),
                     ("bash", {"command": "pytest -q"})]
    assert (message.reasoning_content, message.content) == ("Check the file.", "Let me look.")
    assert (got["reasoning_content"], got["content"]) == ("Check the file.", "Let me look.")
    assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"].values()] == calls
    if name == "kimi-k2-thinking":  # Kimi answers a call by its own id
      assert [c.id for c in message.tool_calls] == ["functions.read_file:0", "functions.bash:1"]
    follow = messages + [message] + [
        {"role": "tool", "tool_call_id": c.id, "name": c.function.name, "content": "ok"}
        for c in message.tool_calls]
    client.chat.completions.create(model="arbor", messages=follow, tools=tools)
    plain = messages + [{"role": "assistant", "content": "Let me look.",
                         "reasoning_content": "Check the file.",
                         "tool_calls": [{"id": c.id, "type": "function", "function": {
                             "name": c.function.name, "arguments": c.function.arguments}}
                                        for c in message.tool_calls]}] + [
        {"role": "tool", "tool_call_id": c.id, "name": c.function.name, "content": "ok"}
        for c in message.tool_calls]
    assert engine.submitted[-1][0] == templates.hf_ids(hf, plain, tools, True, {})
    if name == "qwen3":
      kwargs = {"enable_thinking": False}
      engine.replies = [chat.tokenizer.encode('{"command": "ls"}}\n</tool_call>')
                        + [chat.end_id]]
      forced = client.chat.completions.create(
          model="arbor", messages=messages, tools=tools,
          tool_choice={"type": "function", "function": {"name": "bash"}},
          extra_body={"chat_template_kwargs": kwargs}).choices[0].message
      assert [(c.function.name, json.loads(c.function.arguments))
              for c in forced.tool_calls] == [("bash", {"command": "ls"})]
      assert engine.submitted[-1][0] == templates.hf_ids(hf, messages, tools, True, kwargs) + \
          chat.tool_call_prefix_ids("bash", template_kwargs=kwargs)
  finally:
    srv.stop()


def test_chat_template_kwargs_reach_a_renderer_that_takes_them(tok):
  class KwargsPlain(Plain):
    seen = []

    def render(self, messages, tools=None, add_generation_prompt=True, template_kwargs=None):
      self.seen.append(template_kwargs)
      return super().render(messages, tools, add_generation_prompt)

  engine = ScriptedEngine(tok.vocab_size)
  engine.replies = [said(make_chat("plain", tok), "Hi.")]
  srv = PolicyServer(engine, ServerConfig(port=0), tokenizer=tok, chat=KwargsPlain(tok))
  url = srv.start_in_thread()
  try:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="arbor", messages=USER, extra_body={"chat_template_kwargs": {"think": False}})
    assert reply.choices[0].message.content == "Hi." and KwargsPlain.seen == [{"think": False}]
  finally:
    srv.stop()


# ----------------------------------------------------------------------------- start-up, auth


def test_token_protected_server_over_tls(tok, tmp_path):
  """Bearer token on every endpoint but /health (401 is the client's AuthenticationError);
  TLS from a certificate and key file."""
  cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
  subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                  "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
                  "-keyout", key, "-out", cert], check=True, capture_output=True)
  engine = ScriptedEngine(tok.vocab_size)
  engine.replies = [[5, 6]]
  srv = PolicyServer(engine, ServerConfig(port=0, token="s3cret", ssl_certfile=cert,
                                          ssl_keyfile=key), tokenizer=tok)
  url = srv.start_in_thread()
  try:
    assert url.startswith("https://")
    http = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=cert))
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0, http_client=http)
    with pytest.raises(openai.AuthenticationError, match="bearer token") as e:
      bad.models.list()
    assert e.value.code == "invalid_api_key"
    assert http.post(url + "/generate", json={"input_ids": [1]}).status_code == 401
    good = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0,
                         http_client=http)
    assert [m.id for m in good.models.list().data] == ["arbor"]
    reply = good.completions.create(model="arbor", prompt=[1, 2], max_tokens=2)
    assert reply.choices[0].text == tok.decode([5, 6])
    with pytest.raises(openai.BadRequestError, match="no tokenizer/chat format"):
      good.chat.completions.create(model="arbor", messages=USER)
    health = http.get(url + "/health")  # no token needed
    assert health.status_code == 200 and health.json()["policy_version"] == 7
    http.close()
  finally:
    srv.stop()


def test_vocabulary_mismatch_refuses_to_start(tok, tok_dir):
  with pytest.raises(ValueError, match=f"tokenizer has {tok.vocab_size} token ids but the "
                                       "model's vocab_size is 128"):
    PolicyServer(ScriptedEngine(128), ServerConfig(port=0), tokenizer=tok)
  with pytest.raises(ValueError, match=f"{tok.vocab_size} token ids but the model's "
                                       "vocab_size is 256"):  # the tiny-dense preset
    build(parse_args(["--preset", "tiny-dense", "--tokenizer", tok_dir, "--port", "0"]))


def test_non_loopback_bind_needs_a_token():
  for host in ("0.0.0.0", "10.1.2.3", "example.org"):
    with pytest.raises(ValueError, match="token"):
      check_bind(host, None)
  check_bind("0.0.0.0", "t")
  check_bind("127.0.0.1", None)
  check_bind("localhost", None)
  with pytest.raises(ValueError, match="refusing"):
    PolicyServer(ScriptedEngine(128), ServerConfig(host="0.0.0.0"))
  proc = subprocess.run([sys.executable, "-m", "trainer.serve", "--preset", "tiny-dense",
                         "--host", "0.0.0.0", "--port", "0"], capture_output=True, text=True,
                        timeout=120, cwd=ROOT, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ROOT})
  assert proc.returncode == 2 and "refusing to bind" in proc.stderr


def test_the_cli_serves_a_checkpoints_own_template(tmp_path, tok_dir):
  """Without --chat_format the checkpoint's template renders (as in transformers); a named
  built-in format overrides it; a tokenizer without a template gets the family's format."""
  d = templates.save_checkpoint(tmp_path, templates.template("qwen3"), **templates.QWEN)
  tok = load_chat(d).tokenizer
  chat = checkpoint_chat(d, tok, None, TINY_DENSE)
  msgs = [{"role": "user", "content": "Hello world"}]
  assert chat.render(msgs).ids == AutoTokenizer.from_pretrained(d).apply_chat_template(
      msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
  assert checkpoint_chat(d, tok, "chatml", TINY_DENSE).name == "chatml"
  by_file = checkpoint_chat(os.path.join(d, "tokenizer.json"), tok, None, TINY_DENSE)
  assert by_file.render(msgs).ids == chat.render(msgs).ids  # a tokenizer file names its folder
  plain_dir = str(tmp_path / "no_template")
  os.makedirs(plain_dir)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    with open(os.path.join(d, name)) as f:
      config = json.load(f)
    config.pop("chat_template", None)
    with open(os.path.join(plain_dir, name), "w") as f:
      json.dump(config, f)
  assert checkpoint_chat(plain_dir, tok, None, TINY_DENSE).name == "qwen2.5"  # dense: Qwen
