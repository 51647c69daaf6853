"""The policy server's OpenAI Responses and Anthropic Messages endpoints, driven by the official
`openai` and `anthropic` clients.

- Responses: text and function calls, created and streamed (the client's own assembly of the
  event stream equals the non-streamed response), a tool-result round trip and multi-turn input
  items rendered exactly as the same conversation through /v1/chat/completions, reasoning items,
  incomplete on the token limit, errors the client raises as BadRequestError naming the field.
- Messages: system prompts, tools, tool_use -> tool_result round trips (is_error included),
  thinking blocks, stop sequences, streamed == non-streamed (`get_final_message`),
  count_tokens equal to the prompt the engine is given, X-Api-Key auth, Anthropic error objects
  the client raises as its typed errors.
- Forced tool calls (Responses' named function, Anthropic's "tool" / "any") append the format's
  opening as chat completions does and reach the engine with a grammar constraint (sampled
  replies: tests/test_constrained_decoding.py); a stream that fails midway ends with the
  protocol's error event.
- One session id gathers the exact ids of calls from all three chat protocols.
- Chat completions and completions: vLLM's fields the server does not implement are refused
  unless neutral, min_p / min_tokens / ignore_eos reach the engine, top_k=-1 is off, and
  log-prob entries carry the token's UTF-8 bytes.
"""

import json
import os
import urllib.error
import urllib.request

import anthropic
import openai
import pytest

from envs.chat import load_chat, make_chat
from envs.chat.tokenizer import HFTokenizer
from models import transformer
from models.engine import Engine
from tests import test_chat_templates as templates
from tests.conftest import TINY_DENSE
from tests.test_chat import _tiny_bpe
from tests.test_serve import CONFIG, TOOLS, USER, ScriptedEngine
from trainer.serve import PolicyServer, ServerConfig

TOKEN = "secret-token"
CALL_TEXT = ('Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}'
             '\n</tool_call>\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}'
             '\n</tool_call>')
CALLS = [("read_file", {"path": "a.py"}), ("bash", {"command": "ls"})]
# the same tools in Responses' flat shape and in Anthropic's
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


def clients(url):
  """The official openai and anthropic clients of a server (token auth)."""
  return (openai.OpenAI(base_url=url + "/v1", api_key=TOKEN, max_retries=0, timeout=60),
          anthropic.Anthropic(base_url=url, api_key=TOKEN, max_retries=0, timeout=60))


def serve(engine, tok, chat, **config):
  srv = PolicyServer(engine, ServerConfig(port=0, token=TOKEN, **config), tokenizer=tok,
                     chat=chat)
  url = srv.start_in_thread()
  return srv, url, *clients(url)


@pytest.fixture(scope="module")
def tok():
  return HFTokenizer(_tiny_bpe(), eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def scripted(tok):
  """A Qwen2.5-format server over a ScriptedEngine (chosen replies), with both clients."""
  srv, url, oa, an = serve(ScriptedEngine(tok.vocab_size), tok, make_chat("qwen2.5", tok))
  yield srv, url, oa, an
  srv.stop()


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
  """A server with Qwen3's own (thinking) template over a ScriptedEngine."""
  d = templates.save_checkpoint(tmp_path_factory.mktemp("qwen3"), templates.template("qwen3"),
                                **templates.FIXTURES["qwen3"][0])
  chat = load_chat(d)
  srv, url, oa, an = serve(ScriptedEngine(chat.tokenizer.vocab_size), chat.tokenizer, chat)
  yield srv, url, oa, an
  srv.stop()


@pytest.fixture(scope="module")
def real(tok):
  """A real engine with random weights behind the server (Plain chat format)."""
  model = transformer.init(TINY_DENSE.replace(vocab_size=tok.vocab_size), seed=0)
  engine = Engine(model, CONFIG, detokenize=tok.decode)
  srv, url, oa, an = serve(engine, tok, make_chat("plain", tok))
  yield srv, url, oa, an
  srv.stop()


def request(url, path, body, headers=None):
  """(status, JSON) of a POST with the server's token as X-Api-Key."""
  req = urllib.request.Request(url + path, json.dumps(body).encode(), method="POST", headers={
      "Content-Type": "application/json", "x-api-key": TOKEN, **(headers or {})})
  try:
    with urllib.request.urlopen(req, timeout=60) as resp:
      return resp.status, json.loads(resp.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def session(url, sid):
  req = urllib.request.Request(f"{url}/v1/sessions/{sid}",
                               headers={"Authorization": f"Bearer {TOKEN}"})
  with urllib.request.urlopen(req, timeout=60) as resp:
    return json.loads(resp.read())["calls"]


def without_ids(dump: dict, items: str) -> dict:
  """A dumped response / message without its random ids (the response's, its items', calls'),
  its time and session id, and the prompt tokens the engine's cache happened to hold."""
  out = {k: v for k, v in dump.items() if k not in ("id", "created_at", "session_id")}
  if "input_tokens_details" in out.get("usage", {}):
    out["usage"] = {**out["usage"], "input_tokens_details": None}
  out[items] = [{k: v for k, v in item.items() if k not in ("id", "call_id")}
                for item in dump[items]]
  return out


def same_response(reply, final):
  a, b = (without_ids(r.model_dump(exclude_none=True), "output") for r in (reply, final))
  assert a == b


def same_message(reply, final):
  a, b = (without_ids(m.model_dump(exclude_none=True), "content") for m in (reply, final))
  assert a == b


def responses_stream(oa, **kw):
  """(event types, final response) of a streamed Responses call, as the client assembles it."""
  with oa.responses.stream(**kw) as stream:
    kinds = [e.type for e in stream]
    return kinds, stream.get_final_response()


def messages_stream(an, **kw):
  with an.messages.stream(**kw) as stream:
    kinds = [e.type for e in stream]
    return kinds, stream.get_final_message()


# ----------------------------------------------------------------------------- Responses


def test_responses_text_create_and_stream(scripted):
  """Text in, text out: instructions are the system prompt, the streamed events assemble to the
  reply, with deltas sent as the engine produces them."""
  srv, url, oa, _ = scripted
  chat = srv.chat
  srv.engine.replies = [chat.assistant_ids("Hello world, this is a test of the tokenizer.")]
  kw = dict(model="arbor", input="Run the tests.", instructions="Fix the bug.")
  reply = oa.responses.create(**kw)
  prompt = chat.render([{"role": "system", "content": "Fix the bug."},
                        {"role": "user", "content": "Run the tests."}]).ids
  assert srv.engine.submitted[-1][0] == prompt
  assert reply.output_text == "Hello world, this is a test of the tokenizer."
  assert reply.status == "completed" and [o.type for o in reply.output] == ["message"]
  assert reply.usage.input_tokens == len(prompt)
  assert reply.usage.output_tokens == len(srv.engine.replies[0])
  kinds, final = responses_stream(oa, **kw)
  same_response(reply, final)
  assert kinds[:4] == ["response.created", "response.in_progress",
                       "response.output_item.added", "response.content_part.added"]
  assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                        "response.output_item.done", "response.completed"]
  assert kinds.count("response.output_text.delta") > 1
  # create(stream=True): the same events, numbered in order
  events = list(oa.responses.create(**kw, stream=True))
  assert [e.type for e in events] == kinds
  assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_function_calls_round_trip(scripted):
  """Function calls come back as function_call items (streamed the same); the next turn, sent
  as agents send it (the output items, then function_call_output items), reaches the engine
  exactly as the same conversation through /v1/chat/completions."""
  srv, url, oa, _ = scripted
  chat = srv.chat
  srv.engine.replies = [chat.assistant_ids(CALL_TEXT)]
  kw = dict(model="arbor", instructions="Fix the bug.", tools=FLAT_TOOLS,
            input=[{"role": "user", "content": "Hello world, run the tests."}])
  reply = oa.responses.create(**kw)
  assert [o.type for o in reply.output] == ["message", "function_call", "function_call"]
  assert reply.output[0].content[0].text == "Let me look."
  calls = reply.output[1:]
  assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
  assert len({c.call_id for c in calls}) == 2 and all(c.status == "completed" for c in calls)
  assert srv.engine.submitted[-1][0] == chat.render(USER, TOOLS).ids
  kinds, final = responses_stream(oa, **kw)
  same_response(reply, final)
  assert kinds.count("response.function_call_arguments.done") == 2
  # the next turn
  srv.engine.replies = [chat.assistant_ids("Fixed it.")]
  follow = kw["input"] + list(reply.output) + [
      {"type": "function_call_output", "call_id": c.call_id, "output": f"out {i}"}
      for i, c in enumerate(calls)] + [{"role": "user", "content": [
          {"type": "input_text", "text": "And now?"}]}]
  second = oa.responses.create(**{**kw, "input": follow})
  assert second.output_text == "Fixed it."
  via_responses = srv.engine.submitted[-1][0]
  oa.chat.completions.create(model="arbor", tools=TOOLS, messages=USER + [
      {"role": "assistant", "content": "Let me look.", "tool_calls": [
          {"id": c.call_id, "type": "function",
           "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}] + [
      {"role": "tool", "tool_call_id": c.call_id, "content": f"out {i}"}
      for i, c in enumerate(calls)] + [{"role": "user", "content": "And now?"}])
  assert via_responses == srv.engine.submitted[-1][0]


def test_responses_reasoning_items(thinking):
  """A thinking template's reasoning is a reasoning item (its tokens counted); sent back in the
  next turn's input, it is the assistant's reasoning_content as chat completions renders it."""
  srv, url, oa, _ = thinking
  chat = srv.chat
  srv.engine.replies = [chat.assistant_ids({"role": "assistant", "content": "Let me look.",
                                            "reasoning_content": "Check the file."})]
  srv.engine.step = 1
  kw = dict(model="arbor", input="Hello world")
  reply = oa.responses.create(**kw)
  assert [o.type for o in reply.output] == ["reasoning", "message"]
  assert reply.output[0].content[0].text == "Check the file."
  assert reply.output_text == "Let me look."
  details = reply.usage.output_tokens_details
  assert 0 < details.reasoning_tokens < reply.usage.output_tokens
  kinds, final = responses_stream(oa, **kw)
  same_response(reply, final)
  assert "response.reasoning_text.delta" in kinds
  oa.responses.create(model="arbor", input=[
      {"role": "user", "content": "Hello world"}, *reply.output,
      {"role": "user", "content": "Thanks."}])
  via_responses = srv.engine.submitted[-1][0]
  oa.chat.completions.create(model="arbor", messages=[
      {"role": "user", "content": "Hello world"},
      {"role": "assistant", "content": "Let me look.", "reasoning_content": "Check the file."},
      {"role": "user", "content": "Thanks."}])
  assert via_responses == srv.engine.submitted[-1][0]


@pytest.mark.parametrize("kw, param, match", [
    (dict(input="Hi", previous_response_id="resp_1"), "previous_response_id", "stores nothing"),
    (dict(input="Hi", tools=[{"type": "web_search"}]), "tools[0]", "only function tools"),
    (dict(input=[{"type": "item_reference", "id": "x"}]), "input[0].type", "item_reference"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
     "input[0].content[0].type", "input_image"),
    (dict(input="Hi", max_output_tokens=10**6), "max_output_tokens", "max_output_tokens="),
    (dict(input="Hi", tool_choice={"type": "function", "name": "rm"}, tools=FLAT_TOOLS),
     "tool_choice", "'rm'"),
    (dict(input="Hi", text={"format": {"type": "json_schema", "name": "x"}}), "text.format",
     "json_schema"),
    (dict(input="Hi", include=["message.output_text.logprobs"]), "include", "logprobs"),
])
def test_responses_errors(scripted, kw, param, match):
  _, _, oa, _ = scripted
  with pytest.raises(openai.BadRequestError, match=match) as e:
    oa.responses.create(model="arbor", **kw)
  assert e.value.param == param


# ----------------------------------------------------------------------------- Messages


def test_messages_tools_round_trip(scripted):
  """tool_use blocks (input objects), streamed the same; the tool_result turn (an error result
  included) reaches the engine as the same conversation through chat completions, and
  count_tokens is the length of that prompt."""
  srv, url, _, an = scripted
  chat = srv.chat
  srv.engine.replies = [chat.assistant_ids(CALL_TEXT)]
  kw = dict(model="arbor", max_tokens=100, system="Fix the bug.", tools=ANTHROPIC_TOOLS,
            messages=[{"role": "user", "content": "Hello world, run the tests."}])
  reply = an.messages.create(**kw)
  assert [b.type for b in reply.content] == ["text", "tool_use", "tool_use"]
  assert reply.content[0].text == "Let me look." and reply.stop_reason == "tool_use"
  uses = reply.content[1:]
  assert [(b.name, b.input) for b in uses] == CALLS and len({b.id for b in uses}) == 2
  assert srv.engine.submitted[-1][0] == chat.render(USER, TOOLS).ids
  assert reply.usage.input_tokens == len(chat.render(USER, TOOLS).ids)
  assert reply.usage.output_tokens == len(srv.engine.replies[0])
  kinds, final = messages_stream(an, **kw)
  same_message(reply, final)
  assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
  assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 3
  # the results
  srv.engine.replies = [chat.assistant_ids("Fixed it.")]
  follow = {**kw, "messages": kw["messages"] + [
      {"role": "assistant", "content": reply.content},
      {"role": "user", "content": [
          {"type": "tool_result", "tool_use_id": uses[0].id, "content": "def add(a, b):"},
          {"type": "tool_result", "tool_use_id": uses[1].id, "is_error": True,
           "content": [{"type": "text", "text": "ls: denied"}]},
          {"type": "text", "text": "Go on."}]}]}
  second = an.messages.create(**follow)
  assert second.content[0].text == "Fixed it." and second.stop_reason == "end_turn"
  via_messages = srv.engine.submitted[-1][0]
  count = an.messages.count_tokens(**{k: v for k, v in follow.items() if k != "max_tokens"})
  assert count.input_tokens == len(via_messages)
  srv.engine.replies = [chat.assistant_ids("Fixed it.")]
  oa = openai.OpenAI(base_url=url + "/v1", api_key=TOKEN, max_retries=0)
  oa.chat.completions.create(model="arbor", tools=TOOLS, messages=USER + [
      {"role": "assistant", "content": "Let me look.", "tool_calls": [
          {"id": b.id, "type": "function",
           "function": {"name": b.name, "arguments": json.dumps(b.input)}} for b in uses]},
      {"role": "tool", "tool_call_id": uses[0].id, "content": "def add(a, b):"},
      {"role": "tool", "tool_call_id": uses[1].id, "content": "Error: ls: denied"},
      {"role": "user", "content": "Go on."}])
  assert via_messages == srv.engine.submitted[-1][0]


def test_messages_stop_sequences_and_system_blocks(scripted, tok):
  """A stop sequence ends the reply (stop_reason stop_sequence, the text cut before it); a
  system prompt given as text blocks is the system message."""
  srv, url, _, an = scripted
  srv.engine.replies = [tok.encode("Hello world, this is")]  # stopped by the engine at "this"
  kw = dict(model="arbor", max_tokens=50, stop_sequences=["never", "this"],
            system=[{"type": "text", "text": "Fix the bug."}],
            messages=[{"role": "user", "content": [{"type": "text", "text": "Hello world, run "
                                                    "the tests."}]}])
  reply = an.messages.create(**kw)
  assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", "this")
  assert reply.content[0].text == "Hello world, "  # as written up to the stop sequence
  assert srv.engine.submitted[-1][0] == srv.chat.render(USER).ids
  assert srv.engine.submitted[-1][1].stop == ("never", "this")
  _, final = messages_stream(an, **kw)
  same_message(reply, final)


def test_messages_thinking(thinking):
  """With a thinking template: thinking blocks carry the reasoning; `thinking` sets the
  template's enable_thinking; earlier thinking blocks are rendered as reasoning_content."""
  srv, url, _, an = thinking
  chat = srv.chat
  srv.engine.replies = [chat.assistant_ids({"role": "assistant", "content": "Let me look.",
                                            "reasoning_content": "Check the file."})]
  user = [{"role": "user", "content": "Hello world"}]
  kw = dict(model="arbor", max_tokens=2000, messages=user,
            thinking={"type": "enabled", "budget_tokens": 1024})
  reply = an.messages.create(**kw)
  assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
          for b in reply.content] == [("thinking", "Check the file."), ("text", "Let me look.")]
  assert srv.engine.submitted[-1][0] == chat.render(
      user, template_kwargs={"enable_thinking": True}).ids
  _, final = messages_stream(an, **kw)
  same_message(reply, final)
  an.messages.create(**{**kw, "thinking": {"type": "disabled"}})
  assert srv.engine.submitted[-1][0] == chat.render(
      user, template_kwargs={"enable_thinking": False}).ids
  an.messages.create(model="arbor", max_tokens=50, messages=user + [
      {"role": "assistant", "content": reply.content}, {"role": "user", "content": "Thanks."}])
  assert srv.engine.submitted[-1][0] == chat.render(user + [
      {"role": "assistant", "content": "Let me look.", "reasoning_content": "Check the file."},
      {"role": "user", "content": "Thanks."}]).ids
  with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
    an.messages.create(**{**kw, "thinking": {"type": "enabled", "budget_tokens": 10}})


@pytest.mark.parametrize("kw, error, match", [
    (dict(thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=2000),
     anthropic.BadRequestError, "thinking=.*writes no reasoning"),
    (dict(tool_choice={"type": "tool", "name": "rm"}, tools=ANTHROPIC_TOOLS),
     anthropic.BadRequestError, "'rm', which is not in tools"),
    (dict(tool_choice={"type": "sometimes"}), anthropic.BadRequestError, "tool_choice="),
    (dict(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/a.png"}}]}]),
     anthropic.BadRequestError, r"messages\[0\].content\[0\]: block type 'image'"),
    (dict(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The"}]),
     anthropic.BadRequestError, "prefill"),
    (dict(max_tokens=10**6), anthropic.BadRequestError, "max_tokens=1000000"),
    (dict(stop_sequences=[""]), anthropic.BadRequestError, "stop_sequences="),
    (dict(model="claude-x"), anthropic.NotFoundError, "serves 'arbor'"),
])
def test_messages_errors(scripted, kw, error, match):
  """Anthropic error objects, raised by the client as its typed errors naming the field."""
  _, _, _, an = scripted
  kw = {"model": "arbor", "max_tokens": 20, "messages": [{"role": "user", "content": "Hi"}],
        **kw}
  with pytest.raises(error, match=match) as e:
    an.messages.create(**kw)
  assert e.value.body["type"] == "error" and set(e.value.body["error"]) == {"type", "message"}


def test_messages_auth_and_error_shapes(scripted):
  srv, url, _, _ = scripted
  status, body = request(url, "/v1/messages", {"model": "arbor", "messages": [
      {"role": "user", "content": "Hi"}]})
  assert status == 400 and body == {"type": "error", "error": {
      "type": "invalid_request_error", "message": "max_tokens: required"}}
  bad = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0)
  with pytest.raises(anthropic.AuthenticationError, match="bearer token"):
    bad.messages.create(model="arbor", max_tokens=5, messages=[{"role": "user", "content": "x"}])
  # a bearer token works too (Anthropic clients' auth_token)
  srv.engine.replies = [srv.chat.assistant_ids("Hello")]
  bearer = anthropic.Anthropic(base_url=url, auth_token=TOKEN, max_retries=0)
  assert bearer.messages.create(model="arbor", max_tokens=5, messages=[
      {"role": "user", "content": "x"}]).content[0].text == "Hello"
  status, body = request(url, "/v1/messages/nowhere", {})
  assert status == 404 and body["error"]["type"] == "not_found_error"


# ----------------------------------------------------------------------------- all protocols


def test_one_session_across_protocols_and_streams_on_a_real_engine(real, tok):
  """Seeded samples from the engine: streamed == non-streamed for Responses and Messages, the
  token limit reported as each protocol says it, and one session id gathering the exact ids of
  chat completions, Responses and Messages calls (body field or X-Session-Id header)."""
  srv, url, oa, an = real
  chat = srv.chat
  prompt = chat.render(USER).ids
  seed = {"seed": 5}
  r_kw = dict(model="arbor", input=USER[1]["content"], instructions=USER[0]["content"],
              max_output_tokens=12, temperature=1.0)
  reply = oa.responses.create(**r_kw, extra_body={**seed, "session_id": "mixed"})
  same_response(reply, responses_stream(oa, **r_kw, extra_body=seed)[1])
  m_kw = dict(model="arbor", system=USER[0]["content"], max_tokens=12,
              messages=[{"role": "user", "content": USER[1]["content"]}])
  sampling = {**seed, "temperature": 1.0, "top_k": 0}  # fields newer clients no longer take
  message = an.messages.create(**m_kw, extra_body=sampling,
                               extra_headers={"x-session-id": "mixed"})
  same_message(message, messages_stream(an, **m_kw, extra_body=sampling)[1])
  completion = oa.chat.completions.create(model="arbor", messages=USER, max_tokens=12, seed=5,
                                          extra_body={"session_id": "mixed"})
  calls = session(url, "mixed")
  assert len(calls) == 3 and all(c["input_ids"] == prompt for c in calls)
  # the same seed and prompt: the same ids, read back by each protocol
  assert calls[0]["output_ids"] == calls[1]["output_ids"] == calls[2]["output_ids"]
  ids = calls[0]["output_ids"]
  assert [c["finish_reason"] for c in calls] == ["length"] * 3 and len(ids) == 12
  text = chat.parse_assistant(ids).content
  assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
  assert reply.output_text == text and reply.usage.output_tokens == 12
  assert message.stop_reason == "max_tokens" and message.content[0].text == text
  assert completion.choices[0].message.content == text
  assert calls[1]["params"] == {**calls[0]["params"], "tool_choice": "none"}


def test_log_prob_bytes(real):
  """Chat log-prob entries (and their alternatives) carry the token's UTF-8 bytes."""
  _, _, oa, _ = real
  reply = oa.chat.completions.create(model="arbor", messages=USER, max_tokens=8, logprobs=True,
                                     top_logprobs=2)
  entries = reply.choices[0].logprobs.content
  assert len(entries) == 8
  for e in entries:
    assert e.bytes == list(e.token.encode("utf-8"))
    assert len(e.top_logprobs) == 2 and all(t.bytes == list(t.token.encode("utf-8"))
                                            for t in e.top_logprobs)


@pytest.mark.parametrize("field, value", [
    ("repetition_penalty", 1.1), ("add_generation_prompt", False),
    ("continue_final_message", True), ("presence_penalty", 0.5)])
def test_fields_without_effect_are_refused(scripted, field, value):
  """vLLM's fields the server does not implement: a 400 naming the field, in chat completions
  and completions; their neutral values are accepted."""
  srv, _, oa, _ = scripted
  srv.engine.replies = [srv.chat.assistant_ids("Hello")]
  for create, kw in ((oa.chat.completions.create, {"messages": USER}),
                     (oa.completions.create, {"prompt": "Hello"})):
    with pytest.raises(openai.BadRequestError, match=f"{field}={value}") as e:
      create(model="arbor", max_tokens=4, **kw, extra_body={field: value})
    assert e.value.param == field
  neutral = {"repetition_penalty": 1.0, "add_generation_prompt": True,
             "continue_final_message": False, "presence_penalty": 0}[field]
  oa.chat.completions.create(model="arbor", messages=USER, extra_body={field: neutral})


def test_sampler_fields_reach_the_engine(scripted):
  """min_p, min_tokens and ignore_eos reach the engine's SamplingParams; top_k=-1 is off."""
  srv, _, oa, _ = scripted
  srv.engine.replies = [srv.chat.assistant_ids("Hello")]
  oa.chat.completions.create(model="arbor", messages=USER, max_tokens=9, extra_body={
      "min_p": 0.1, "min_tokens": 2, "ignore_eos": True, "top_k": -1})
  params = srv.engine.submitted[-1][1]
  assert (params.min_p, params.min_tokens, params.ignore_eos, params.top_k) == (0.1, 2, True, 0)
  oa.completions.create(model="arbor", prompt="Hello", max_tokens=4, extra_body={"top_k": -1})
  assert srv.engine.submitted[-1][1].top_k == 0
  for extra, param in (({"min_tokens": 10}, "min_tokens"), ({"min_p": 2}, "min_p"),
                       ({"top_k": -2}, "top_k")):
    with pytest.raises(openai.BadRequestError) as e:
      oa.chat.completions.create(model="arbor", messages=USER, max_tokens=9, extra_body=extra)
    assert e.value.param == param


def test_forced_tool_choice_in_both_protocols(scripted, tok):
  """Responses' named function and Anthropic's "tool" / "any" force a call as chat completions
  does (the format's opening appended to the prompt, read back with it); count_tokens counts
  the opening too."""
  srv, url, oa, an = scripted
  chat = srv.chat
  srv.engine.replies = [tok.encode('{"command": "ls"}}\n</tool_call>') + [chat.end_id]]
  reply = oa.responses.create(model="arbor", instructions="Fix the bug.", tools=FLAT_TOOLS,
                              input=USER[1]["content"],
                              tool_choice={"type": "function", "name": "bash"})
  prompt = chat.render(USER, TOOLS).ids + chat.tool_call_prefix_ids("bash")
  assert srv.engine.submitted[-1][0] == prompt
  assert srv.engine.submitted[-1][1].constraint is not None  # the rest sampled under a grammar
  assert [(o.type, o.name, json.loads(o.arguments)) for o in reply.output] == [
      ("function_call", "bash", {"command": "ls"})]
  kw = dict(model="arbor", max_tokens=20, system="Fix the bug.", tools=ANTHROPIC_TOOLS,
            messages=[{"role": "user", "content": USER[1]["content"]}],
            tool_choice={"type": "tool", "name": "bash"})
  message = an.messages.create(**kw)
  assert srv.engine.submitted[-1][0] == prompt
  assert [(b.type, b.name, b.input) for b in message.content] == [
      ("tool_use", "bash", {"command": "ls"})] and message.stop_reason == "tool_use"
  count = an.messages.count_tokens(**{k: v for k, v in kw.items() if k != "max_tokens"})
  assert count.input_tokens == len(prompt)
  srv.engine.replies = [tok.encode('read_file", "arguments": {"path": "a.py"}}\n</tool_call>')
                        + [chat.end_id]]
  message = an.messages.create(**{**kw, "tool_choice": {"type": "any"}})
  assert srv.engine.submitted[-1][0] == chat.render(USER, TOOLS).ids + \
      chat.tool_call_prefix_ids(None)
  assert srv.engine.submitted[-1][1].constraint is not None
  an.messages.create(**{**kw, "tool_choice": {"type": "auto"}})  # not forced: unconstrained
  assert srv.engine.submitted[-1][1].constraint is None
  assert [(b.name, b.input) for b in message.content] == [("read_file", {"path": "a.py"})]


def test_stream_errors_are_protocol_events(scripted, tok, monkeypatch):
  """A stream that fails after its status line was sent ends with the protocol's error event
  (here: the engine reports text that its final sample does not extend)."""
  srv, url, oa, an = scripted
  srv.engine.replies = [srv.chat.assistant_ids("Hello world, this is a test.")]
  submit = srv.engine.submit

  def diverging(input_ids, params, on_tokens=None):
    def report(ids, lps, top):  # progress that the final sample contradicts
      on_tokens(tok.encode("Something else entirely"), lps, top)
    return submit(input_ids, params, report if on_tokens else None)

  monkeypatch.setattr(srv.engine, "submit", diverging)
  events = list(oa.responses.create(model="arbor", input="Hi", stream=True))
  assert events[-1].type == "error" and "changed" in events[-1].message
  assert "response.completed" not in [e.type for e in events]
  with pytest.raises(anthropic.APIStatusError, match="changed"):
    list(an.messages.create(model="arbor", max_tokens=20, stream=True,
                            messages=[{"role": "user", "content": "Hi"}]))
