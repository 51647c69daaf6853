"""Grammar-constrained decoding (models/engine/constraint.py, models/engine/sampling.py,
trainer/serving/constrain.py) and the sampler's min_p / min_tokens / ignore_eos, on a
random-weight tiny model. One file so the engines and the server are built once (module
fixtures); the HTTP tests are the part to move beside tests/test_serving_protocols.py.

- At temperature 1 over several seeds, json_schema replies parse and validate, json_object
  replies parse, tool_choice "required" / named replies parse (with the chat format's own
  parser) into calls of known tools with schema-valid arguments; contiguous and paged engines.
- Every sampled token is allowed by a replayed matcher, and the log-probs and entropies are
  those of the model's teacher-forced distribution renormalised over the allowed tokens.
- A constrained and an unconstrained request share one compiled decode call (no retrace), and
  the unconstrained one samples what it samples alone.
- min_p / min_tokens / ignore_eos against NumPy references; neutral values (all-allowed mask,
  min_p 0, min_tokens 0) give bit-identical tokens and log-probs to the unmasked program.
- A constraint survives preemption (paged) and starts again on a "restart" weight update.
- The vocabulary mapping reads real token bytes (sentencepiece byte fallback too); refusals.
- Over the policy server (a random-weight MoE engine that records experts), with the official
  clients: Chat Completions response_format json_schema content validates and tool_choice
  "required" / named give parsed calls with valid arguments; the same for Responses
  (text.format, tool_choice) and Anthropic Messages (tool_choice any / tool), streamed and not;
  a strict schema the grammar cannot express is a 400 naming the field; session records carry
  the protocol, whether the reply was constrained, and the expert ids.
"""

import dataclasses
import io
import json
import os
import urllib.error
import urllib.request

import anthropic
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from flax import nnx

from envs.chat.formats import DeepSeekV3, make_chat
from envs.chat.jinja_format import KIMI_TOKENS, JinjaChat
from envs.chat.tokenizer import HFTokenizer, SentencePieceTokenizer
from envs.policy import SamplingParams, decode_expert_ids
from models import transformer
from models.engine import CachePool, Engine, EngineConfig, programs, sampling
from models.engine import constraint as constraints
from tests.test_engine import teacher
from trainer.serve import PolicyServer, ServerConfig
from trainer.serving import constrain

jsonschema = pytest.importorskip("jsonschema")

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789{}[]\":,<>/_-.+E `\n\\"
MERGES = [('"', ':'), ('"', ','), ('"', '}'), ('"', ']')]  # JSON-ish merges of a real BPE
CONFIG = EngineConfig(slots=4, max_seq_len=256, prefix_cache_rows=4, min_prefix=4,
                      prefill_chunk=64, prefill_bucket=32, steps_per_call=8,
                      max_stop_token_ids=4, top_logprobs=2)
SEEDS = (0, 1, 2, 3)
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 6},
    "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["city", "n", "ok"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "sum", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get", "parameters": {
        "type": "object", "properties": {"key": {"type": "string", "maxLength": 5},
                                         "flag": {"enum": ["on", "off"]}},
        "required": ["key"], "additionalProperties": False}}}]


def _byte_spelling() -> dict[int, str]:
  """GPT-2's byte-level spelling of each byte (what a byte-level BPE vocabulary stores)."""
  bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
  cs, n = bs[:], 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


def make_tokenizer(specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>")) -> HFTokenizer:
  """A byte-level BPE tokenizer.json over a small alphabet (fits the tiny model's 128 ids)."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers

  spell = lambda text: "".join(_byte_spelling()[b] for b in text.encode())
  vocab = {spell(c): i for i, c in enumerate(CHARS)}
  for a, b in MERGES:
    vocab[spell(a) + spell(b)] = len(vocab)
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab,
                                        merges=[(spell(a), spell(b)) for a, b in MERGES]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(list(specials))
  return HFTokenizer(tok, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def chat():
  return make_chat("chatml", make_tokenizer())


@pytest.fixture(scope="module")
def engines(dense_model):
  return {"contiguous": Engine(dense_model, CONFIG),
          "paged": Engine(dense_model, dataclasses.replace(CONFIG, cache="paged", page_size=16))}


def run(engine, chat, fields, seeds=SEEDS, max_tokens=160, prompt="go", **kw):
  """One request per seed, all in one batch; returns (prompt ids, completions)."""
  ids = chat.tokenizer.encode(prompt)
  futures = [engine.submit(ids, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=s,
                                               stop_token_ids=chat.stop_token_ids, **fields,
                                               **kw)) for s in seeds]
  while engine.pending():
    engine.step()
  return ids, [f.result() for f in futures]


def replay(fields, output_ids, vocab):
  """Per output token, the bool [vocab] mask a fresh matcher gave before it (asserting each
  token was allowed), and whether the matcher ended."""
  state = fields["constraint"].start()
  masks = []
  for t in output_ids:
    words = constraints.pack(state.allowed(), vocab)
    mask = ((words[np.arange(vocab) // 32] >> (np.arange(vocab) % 32).astype(np.uint32)) & 1
            ).astype(bool)
    assert mask[t], f"token {t} was not allowed"
    masks.append(mask)
    state.advance(t)
  return masks, state.is_done()


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_json_schema_and_object_replies_parse(engines, chat, kind):
  fields = constrain.sampling_fields(chat, response_format={
      "type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}})
  _, outs = run(engines[kind], chat, fields)
  for o in outs:
    assert o.finish_reason == "stop" and o.output_ids[-1] in chat.stop_token_ids
    text = chat.tokenizer.decode(o.output_ids[:-1])
    jsonschema.validate(json.loads(text), SCHEMA)
  assert len({tuple(o.output_ids) for o in outs}) > 1  # the seeds sample different replies
  # Any JSON object: nothing bounds its length, and a random model may not close it within
  # max_tokens; the replies it closes parse, the others are prefixes the grammar allowed.
  fields = constrain.sampling_fields(chat, response_format={"type": "json_object"})
  _, outs = run(engines[kind], chat, fields, max_tokens=200)
  for o in outs:
    if o.finish_reason == "stop":
      assert isinstance(json.loads(chat.tokenizer.decode(o.output_ids[:-1])), dict)
    else:
      replay(fields, o.output_ids, 128)
  assert sum(o.finish_reason == "stop" for o in outs) >= 2


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_tool_choice_replies_are_valid_calls(engines, chat, kind):
  names = {t["function"]["name"] for t in TOOLS}
  for choice, name in (("required", None), ("named", "get")):
    fields = constrain.sampling_fields(chat, tools=TOOLS, tool_choice=choice, tool_name=name,
                                       parallel_tool_calls=choice == "named")
    _, outs = run(engines[kind], chat, fields)
    for o in outs:
      assert o.finish_reason == "stop"
      turn = chat.parse_assistant(o.output_ids, TOOLS)
      assert turn.finished and not turn.errors and turn.tool_calls, turn
      assert turn.content == ""
      for call in turn.tool_calls:
        assert call.name == name if name else call.name in names
        schema = next(t["function"]["parameters"] for t in TOOLS
                      if t["function"]["name"] == call.name)
        jsonschema.validate(call.arguments, schema)


def test_checkpoint_template_with_marker_tokens(engines):
  """A Qwen3 checkpoint template (hermes family, thinking) over a tokenizer with `<tool_call>`
  as an added token, as Qwen's: the calls use the marker token and parse with the template's
  reader (the template's empty reasoning first)."""
  from tokenizers import AddedToken

  base = make_tokenizer()
  base._tok.add_tokens([AddedToken(t, special=False)
                        for t in ("<tool_call>", "</tool_call>", "<think>", "</think>")])
  tok = HFTokenizer(base._tok, eos_token="<|im_end|>")
  path = os.path.join(os.path.dirname(__file__), "data", "chat_templates", "qwen3.jinja")
  with open(path, encoding="utf-8") as f:
    chat = JinjaChat(tok, f.read(), name="qwen3")
  fields = constrain.sampling_fields(chat, tools=TOOLS, tool_choice="required",
                                     parallel_tool_calls=False)
  _, outs = run(engines["contiguous"], chat, fields, seeds=(1, 2))
  for o in outs:
    assert tok.token_to_id("<tool_call>") in o.output_ids
    turn = chat.parse_assistant(o.output_ids, TOOLS)
    assert turn.finished and len(turn.valid_calls) == 1 and not turn.errors, turn


@pytest.mark.parametrize("forced", [False, True])
def test_deepseek_tool_call_tokens(engines, forced):
  """DeepSeek-V3 writes calls with control tokens: the grammar writes those tokens, and the
  format's own parser reads the calls back (also after its forced opening in the prompt)."""
  chat = make_chat("deepseek_v3", make_tokenizer(("<|endoftext|>",) +
                                                 tuple(DeepSeekV3.TOKENS.values())))
  prefix = chat.tool_call_prefix_ids("get" if forced else None)
  fields = constrain.sampling_fields(chat, tools=TOOLS, tool_choice="named" if forced else
                                     "required", tool_name="get" if forced else None,
                                     prompt_prefix=prefix if forced else ())
  ids = chat.tokenizer.encode("go") + (prefix if forced else [])
  outs = engines["paged"].generate([ids] * 2, [
      SamplingParams(max_tokens=120, seed=s, stop_token_ids=chat.stop_token_ids, **fields)
      for s in (1, 2)][0])
  for o in outs:
    assert o.finish_reason == "stop"
    turn = chat.parse_assistant((prefix if forced else []) + o.output_ids, TOOLS)
    assert turn.valid_calls and not turn.errors and turn.content == "", turn
    assert not forced or all(c.name == "get" for c in turn.tool_calls)
    assert chat.t["calls_end"] in o.output_ids


def test_forced_opening_in_prompt(engines, chat):
  """With the format's tool-call opening already in the prompt (as the server forces
  tool_choice), the grammar covers the rest of the call."""
  for name in (None, "sum"):
    prefix = chat.tool_call_prefix_ids(name)
    fields = constrain.sampling_fields(chat, tools=TOOLS, tool_choice="named" if name else
                                       "required", tool_name=name, parallel_tool_calls=False,
                                       prompt_prefix=prefix)
    ids = chat.tokenizer.encode("go") + prefix
    outs = engines["contiguous"].generate(
        [ids] * 2, SamplingParams(max_tokens=120, seed=5, stop_token_ids=chat.stop_token_ids,
                                  **fields))
    for o in outs:
      turn = chat.parse_assistant(prefix + o.output_ids, TOOLS)
      assert len(turn.valid_calls) == 1 and not turn.errors, turn
      assert name is None or turn.valid_calls[0].name == name


def test_masks_and_logprobs_match_a_numpy_recomputation(engines, chat, dense_model):
  """Sampled tokens are allowed; log-probs, entropies and top log-probs are those of the
  teacher-forced distribution renormalised over the allowed tokens."""
  fields = constrain.sampling_fields(chat, tools=TOOLS, tool_choice="required",
                                     parallel_tool_calls=False)
  ids, outs = run(engines["contiguous"], chat, fields, seeds=(11, 12))
  refs = teacher(dense_model, [ids + o.output_ids for o in outs])
  vocab = dense_model.cfg.vocab_size
  for o, (logp, _) in zip(outs, refs):
    masks, done = replay(fields, o.output_ids, vocab)
    assert done
    rows = logp[len(ids) - 1:len(ids) - 1 + len(o.output_ids)].astype(np.float64)
    masked = np.where(np.array(masks), rows, -np.inf)
    masked -= np.log(np.exp(masked).sum(-1, keepdims=True))
    want = masked[np.arange(len(o.output_ids)), o.output_ids]
    np.testing.assert_allclose(o.logprobs, want, atol=1e-4)
    p = np.exp(masked)
    np.testing.assert_allclose(o.entropies, -(p * np.where(p > 0, masked, 0)).sum(-1),
                               atol=1e-4)
    forced = [t for t, m in enumerate(masks) if m.sum() == 1]
    assert forced and all(abs(o.logprobs[t]) < 1e-5 for t in forced)  # one choice: log 1
    for t, top in enumerate(o.top_logprobs):
      assert all(masks[t][i] for i, v in top if v > -np.inf)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_one_compiled_step_for_mixed_batches(engines, chat, kind):
  eng = engines[kind]
  name = "decode_paged" if kind == "paged" else "decode"
  ids = chat.tokenizer.encode("go")
  plain = SamplingParams(max_tokens=12, temperature=1.0, seed=3)
  alone = eng.generate([ids], plain)[0]  # warm-up, and the reference
  traces = programs.TRACES[name]
  fields = constrain.sampling_fields(chat, response_format={
      "type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}})
  both = [eng.submit(ids, dataclasses.replace(plain, seed=4, max_tokens=160,
                                              stop_token_ids=chat.stop_token_ids, **fields)),
          eng.submit(ids, plain)]
  while eng.pending():
    eng.step()
  assert programs.TRACES[name] == traces
  assert both[1].result().output_ids == alone.output_ids
  assert both[1].result().logprobs == alone.logprobs
  json.loads(chat.tokenizer.decode(both[0].result().output_ids[:-1]))


class EvenTokens:
  """A hand-written constraint: even ids only, done after `n` tokens; `empty` allows none."""

  def __init__(self, n, empty=False):
    self.n, self.empty = n, empty

  def start(self):
    return EvenTokens(self.n, self.empty)

  def allowed(self):
    a = np.arange(128) % 2 == 0
    return a & False if self.empty else a

  def advance(self, token_id):
    assert token_id % 2 == 0
    self.n -= 1

  def is_done(self):
    return self.n <= 0


def test_protocol_constraint_and_a_constraint_with_no_token(dense_model):
  eng = Engine(dense_model, CONFIG)
  good = eng.submit([1, 2, 3], SamplingParams(max_tokens=20, seed=1, constraint=EvenTokens(5)))
  bad = eng.submit([1, 2, 3], SamplingParams(max_tokens=20, seed=2,
                                             constraint=EvenTokens(5, empty=True)))
  other = eng.submit([4, 5], SamplingParams(max_tokens=6, seed=3))
  while eng.pending():
    eng.step()
  out = good.result()
  assert out.finish_reason == "stop" and len(out.output_ids) == 5
  assert all(t % 2 == 0 for t in out.output_ids)
  with pytest.raises(RuntimeError, match="no token"):
    bad.result()
  assert len(other.result().output_ids) == 6
  with pytest.raises(ValueError, match="constraint="):
    eng.submit([1], SamplingParams(max_tokens=8, constraint=object()))
  for field, value in (("min_p", 1.5), ("min_tokens", -1), ("min_tokens", 9),
                       ("ignore_eos", "yes")):
    with pytest.raises(ValueError, match=f"{field}="):
      eng.submit([1], SamplingParams(max_tokens=8, **{field: value}))
  with pytest.raises(ValueError, match="constraint"):
    SamplingParams(constraint=EvenTokens(1)).to_dict()


def test_restart_on_update_starts_the_constraint_again(dense_model):
  """on_update="restart" drops a request's tokens: its constraint starts from scratch."""
  eng = Engine(dense_model, dataclasses.replace(CONFIG, on_update="restart"))
  fut = eng.submit([1, 2, 3], SamplingParams(max_tokens=20, seed=1, constraint=EvenTokens(6)))
  for _ in range(3):
    eng.step()
  assert 0 < len(eng._slots[0].output) < 6
  eng.update_params(dense_model, version=1)
  while eng.pending():
    eng.step()
  out = fut.result()
  assert len(out.output_ids) == 6 and out.token_versions == [1] * 6
  assert all(t % 2 == 0 for t in out.output_ids) and out.finish_reason == "stop"


def test_preempted_requests_keep_their_constraint_state(dense_model):
  """A paged engine short of pages preempts running requests; their constraint states go on
  from the tokens they keep."""
  eng = Engine(dense_model, dataclasses.replace(CONFIG, cache="paged", page_size=4,
                                                num_pages=24, max_seq_len=64))
  futs = [eng.submit(list(range(1, 9)), SamplingParams(max_tokens=40, seed=s,
                                                       constraint=EvenTokens(30)))
          for s in range(4)]
  while eng.pending():
    eng.step()
  assert eng.counters["preempted"] > 0
  for f in futs:
    out = f.result()
    assert len(out.output_ids) == 30 and all(t % 2 == 0 for t in out.output_ids)


def test_min_p_against_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(0, 2, (4, 40)).astype(np.float32)
  temperature = np.array([1.0, 0.7, 1.3, 0.0], np.float32)
  min_p = np.array([0.1, 0.3, 0.05, 0.5], np.float32)
  zeros = np.zeros(4, np.int32)
  ones = np.ones(4, np.float32)
  keys = jax.random.split(jax.random.key(1), (300, 4))
  draw = jax.jit(jax.vmap(lambda k, m: sampling.sample(jnp.asarray(logits), temperature, zeros,
                                                      ones, k, m), in_axes=(0, None)))
  got = np.asarray(draw(keys, min_p))
  gumbel = np.asarray(jax.vmap(jax.vmap(lambda k: jax.random.gumbel(k, (40,), jnp.float32)))(
      keys))
  x = logits / np.where(temperature > 0, temperature, 1)[:, None]
  keep = x >= x.max(-1, keepdims=True) + np.log(min_p)[:, None]
  want = np.argmax(np.where(keep, x, -np.inf)[None] + gumbel, -1)
  want[:, 3] = np.argmax(logits[3])  # greedy row
  np.testing.assert_array_equal(got, want)
  assert len(set(got[:, 2])) > 3  # the draws vary
  # min_p 0 is bit-identical to no min_p
  np.testing.assert_array_equal(np.asarray(draw(keys, np.zeros(4, np.float32))), np.asarray(
      jax.jit(jax.vmap(lambda k: sampling.sample(jnp.asarray(logits), temperature, zeros, ones,
                                                k)))(keys)))


def test_min_p_in_the_engine(engines, dense_model):
  eng = engines["contiguous"]
  ids = [5, 9, 14, 3]
  out = eng.generate([ids], SamplingParams(max_tokens=10, seed=7, min_p=0.6))[0]
  (logp, _), = teacher(dense_model, [ids + out.output_ids])
  rows = logp[len(ids) - 1:len(ids) - 1 + len(out.output_ids)]
  chosen = rows[np.arange(len(out.output_ids)), out.output_ids]
  assert np.all(chosen >= rows.max(-1) + np.log(0.6) - 1e-6)
  np.testing.assert_allclose(out.logprobs, chosen, atol=1e-5)  # unmasked: the model's own


def test_min_tokens_and_ignore_eos(engines, dense_model):
  eng = engines["paged"]
  ids = [7, 3, 22, 8]
  greedy = SamplingParams(max_tokens=8, temperature=0.0)
  base = eng.generate([ids], greedy)[0]
  stop = base.output_ids[0]
  stopped = eng.generate([ids], dataclasses.replace(greedy, stop_token_ids=(stop,)))[0]
  assert stopped.output_ids == [stop] and stopped.finish_reason == "stop"
  # ignore_eos: the stop id never ends the sample
  ignored = eng.generate([ids], dataclasses.replace(greedy, stop_token_ids=(stop,),
                                                    ignore_eos=True))[0]
  assert ignored.output_ids == base.output_ids and ignored.finish_reason == "length"
  assert ignored.logprobs == base.logprobs
  # min_tokens: the stop id is masked for the first 3 tokens (greedy takes the runner-up)
  held = eng.generate([ids], dataclasses.replace(greedy, stop_token_ids=(stop,),
                                                 min_tokens=3))[0]
  (logp, _), = teacher(dense_model, [ids + held.output_ids])
  for t, tok in enumerate(held.output_ids):
    row = logp[len(ids) - 1 + t].astype(np.float64)
    if t < 3:
      row = np.where(np.arange(len(row)) == stop, -np.inf, row)
      row -= np.log(np.exp(row).sum())
    assert tok == int(np.argmax(row)), t
    assert abs(held.logprobs[t] - row[tok]) < 1e-4
  assert stop not in held.output_ids[:3]
  assert held.finish_reason == ("stop" if held.output_ids[-1] == stop else "length")


def test_neutral_controls_are_bit_identical(dense_model):
  """The decode call with all-allowed masks, min_p 0 and min_tokens 0 samples and reports
  exactly what the call without masks does (greedy and sampled rows)."""
  model = transformer.unstack(dense_model)
  graphdef, state = nnx.split(model)
  pool = CachePool(model, 4, 64, lambda **_: None)
  s, vocab = 4, dense_model.cfg.vocab_size
  prompts = np.array([[3, 5, 7, 9], [2, 4, 6, 8], [1, 1, 2, 3], [9, 8, 7, 6]], np.int32)
  caches = programs.prefill(graphdef, state, pool.caches, np.arange(s, dtype=np.int32),
                           prompts[:, :-1], np.zeros(s, np.int32))
  args = (prompts[:, -1], np.full(s, 3, np.int32), np.ones(s, bool), np.zeros(s, np.int32),
          np.full(s, 12, np.int32), np.array([0, 1, 0.7, 1.2], np.float32),
          np.array([0, 0, 5, 0], np.int32), np.array([1, 1, 1, 0.9], np.float32),
          np.arange(s, dtype=np.uint32), np.full((s, 2), -1, np.int32), np.int32(12),
          np.bool_(False))
  outs = []
  for kwargs in ({}, {"mask": np.full((s, constraints.words(vocab)), constraints.ALL_ALLOWED),
                      "min_p": np.zeros(s, np.float32), "min_tokens": np.zeros(s, np.int32)}):
    copy = jax.tree.map(jnp.copy, caches)
    out = programs.decode(graphdef, 12, 2, False, state, copy, np.arange(s, dtype=np.int32),
                         *args, **kwargs)[-1]
    outs.append(jax.device_get(out))
  for key in ("tokens", "logprobs", "entropy", "top_ids", "top_logprobs"):
    np.testing.assert_array_equal(outs[0][key], outs[1][key], err_msg=key)


def test_vocabulary_bytes_sentencepiece_byte_fallback():
  import sentencepiece

  text = ["hello world { } [ ] : , 0 1 2", "json object with keys and values"] * 20
  buf = io.BytesIO()
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(text), model_writer=buf, vocab_size=300, byte_fallback=True,
      model_type="bpe", add_dummy_prefix=False, normalization_rule_name="identity",
      remove_extra_whitespaces=False, minloglevel=2)
  tok = SentencePieceTokenizer(model_proto=buf.getvalue())
  sp = tok._sp
  got = constrain.token_bytes(tok)
  for i in range(tok.vocab_size):
    piece = sp.id_to_piece(i)
    if sp.is_byte(i):
      assert got[i] == bytes([int(piece[3:-1], 16)]), piece
    elif sp.is_control(i) or sp.is_unknown(i):
      assert got[i].startswith(b"\xff"), piece
    else:
      assert got[i] == piece.replace("\u2581", " ").encode(), piece
  # a json_object grammar over this vocabulary: "{" first; inside a string, a character no
  # piece spells ("~") only through its byte-fallback token
  chat = make_chat("plain", tok)
  fields = constrain.sampling_fields(chat, response_format={"type": "json_object"})
  state = fields["constraint"].start()
  allowed_ids = lambda: [i for i in range(tok.vocab_size) if (constraints.pack(
      state.allowed(), tok.vocab_size)[i // 32] >> (i % 32)) & 1]
  ids = allowed_ids()
  assert ids and all(got[i].lstrip(b" ").startswith(b"{") for i in ids), [got[i] for i in ids]
  for t in tok.encode('{"'):
    state.advance(t)
  assert sp.piece_to_id("<0x7E>") in allowed_ids()


def test_refusals(chat):
  kimi_tok = make_tokenizer(("<|endoftext|>", "<|im_end|>") + tuple(KIMI_TOKENS.values()))
  path = os.path.join(os.path.dirname(__file__), "data", "chat_templates",
                      "kimi-k2-thinking.jinja")
  with open(path, encoding="utf-8") as f:
    kimi = JinjaChat(kimi_tok, f.read(), name="kimi")
  with pytest.raises(ValueError, match="'kimi_k2' syntax"):
    constrain.sampling_fields(kimi, tools=TOOLS, tool_choice="required")
  assert constrain.sampling_fields(kimi, response_format={"type": "json_object"})
  assert constrain.sampling_fields(chat, tools=TOOLS, tool_choice="auto") == {}
  # "auto" with a response_format: the JSON reply or tool calls
  grammar, _ = constrain.grammar_for(chat, response_format={"type": "json_object"}, tools=TOOLS,
                                     tool_choice="auto")
  assert grammar.startswith("start: (response) | (") and "call_rest" in grammar
  state = constrain.sampling_fields(chat, response_format={"type": "json_object"}, tools=TOOLS,
                                    tool_choice="auto")["constraint"].start()
  first = constraints.pack(state.allowed(), 128)
  for text in ("{", "<"):
    t = chat.tokenizer.encode(text)[0]
    assert first[t // 32] >> (t % 32) & 1, text
  assert constrain.sampling_fields(chat, response_format={"type": "text"}) == {}
  with pytest.raises(ValueError, match="response_format="):
    constrain.sampling_fields(chat, response_format={"type": "yaml"})
  with pytest.raises(ValueError, match="tool_name='nope'"):
    constrain.sampling_fields(chat, tools=TOOLS, tool_choice="named", tool_name="nope")
  bad = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
  with pytest.raises(ValueError, match="response_format: cannot be compiled"):
    constrain.sampling_fields(chat, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": bad, "strict": True}})
  assert constrain.sampling_fields(chat, response_format={  # not strict: "not" is ignored
      "type": "json_schema", "json_schema": {"name": "x", "schema": bad}})
  # compiled grammars are cached: the same request reuses the compiled matcher
  f1 = constrain.sampling_fields(chat, tools=TOOLS, tool_choice="required")
  f2 = constrain.sampling_fields(chat, tools=TOOLS, tool_choice="required")
  assert f1["constraint"]._matcher is f2["constraint"]._matcher


def test_sampling_params_over_http():
  """The new fields travel as JSON (the policy server's /generate, vLLM's /completions); a
  constraint does not."""
  from envs.policy import CompletionsPolicy

  d = SamplingParams(min_p=0.1, min_tokens=2, ignore_eos=True, stop_token_ids=(5,)).to_dict()
  assert (d["min_p"], d["min_tokens"], d["ignore_eos"]) == (0.1, 2, True)
  assert "constraint" not in d and json.dumps(d)
  client = CompletionsPolicy("http://127.0.0.1:1/v1", "m")
  body = client.body([1, 2], SamplingParams(min_p=0.1, min_tokens=2, ignore_eos=True,
                                            stop_token_ids=(5,)), "s")
  assert (body["min_p"], body["min_tokens"], body["ignore_eos"]) == (0.1, 2, True)
  assert "stop_token_ids" not in body  # ignore_eos: they never end the sample
  plain = client.body([1, 2], SamplingParams(), "s")
  assert not {"min_p", "min_tokens", "ignore_eos"} & set(plain)
  with pytest.raises(ValueError, match="constraint"):
    client.body([1], SamplingParams(constraint=EvenTokens(1)), "s")


# ------------------------------------------------------------------ over the policy server

TOKEN = "secret-token"
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # Responses' shape
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                   for t in TOOLS]
USER = [{"role": "user", "content": "go"}]
JSON_SCHEMA = {"name": "r", "schema": SCHEMA, "strict": True}
STRICT_UNSUPPORTED = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}


@pytest.fixture(scope="module")
def served(moe_mla_model):
  """The policy server over a random-weight MoE engine that records experts (chatml), with the
  official openai and anthropic clients."""
  chat = make_chat("chatml", make_tokenizer())
  # a character-level tokenizer: a prompt with the tools' schemas is ~900 tokens
  engine = Engine(moe_mla_model, dataclasses.replace(CONFIG, max_seq_len=1280,
                                                     prefill_chunk=256, return_expert_ids=True),
                  detokenize=chat.tokenizer.decode)
  srv = PolicyServer(engine, ServerConfig(port=0, token=TOKEN), tokenizer=chat.tokenizer,
                     chat=chat)
  url = srv.start_in_thread()
  yield (srv, url, openai.OpenAI(base_url=url + "/v1", api_key=TOKEN, max_retries=0, timeout=120),
         anthropic.Anthropic(base_url=url, api_key=TOKEN, max_retries=0, timeout=120))
  srv.stop()


def valid_call(name: str, arguments, only: str = None) -> None:
  """A call of one of TOOLS (of `only` when given) whose arguments validate."""
  assert name == only if only else name in {t["function"]["name"] for t in TOOLS}
  args = json.loads(arguments) if isinstance(arguments, str) else arguments
  jsonschema.validate(args, next(t["function"]["parameters"] for t in TOOLS
                                 if t["function"]["name"] == name))


def test_chat_completions_response_format_and_forced_tools_over_http(served):
  """Chat Completions through the official client at temperature 1, several seeds (n):
  json_schema content validates (streamed too), tool_choice "required" and a named function
  always give a parsed call with schema-valid arguments (one: parallel_tool_calls false, so
  that a random model cannot write calls until max_tokens)."""
  _, _, oa, _ = served
  kw = dict(model="arbor", messages=USER, temperature=1.0, max_tokens=160, seed=3)
  reply = oa.chat.completions.create(**kw, n=3, response_format={
      "type": "json_schema", "json_schema": JSON_SCHEMA})
  for choice in reply.choices:
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
  text = "".join(c.choices[0].delta.content or "" for c in oa.chat.completions.create(
      **kw, stream=True, response_format={"type": "json_schema", "json_schema": JSON_SCHEMA}))
  jsonschema.validate(json.loads(text), SCHEMA)
  for choice_, only in (("required", None), ({"type": "function", "function": {"name": "get"}},
                                             "get")):
    reply = oa.chat.completions.create(**kw, n=3, tools=TOOLS, tool_choice=choice_,
                                       parallel_tool_calls=False)
    for choice in reply.choices:
      assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
      call = choice.message.tool_calls[0]
      valid_call(call.function.name, call.function.arguments, only)
  chunks = list(oa.chat.completions.create(**kw, stream=True, tools=TOOLS,
                                           tool_choice="required", parallel_tool_calls=False))
  deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
  assert chunks[-1].choices[0].finish_reason == "tool_calls"
  valid_call(deltas[0].function.name, "".join(d.function.arguments for d in deltas))


def test_responses_text_format_and_forced_tools_over_http(served):
  """Responses: text.format json_schema gives output_text that validates; tool_choice
  "required" / a named function give function_call items with valid arguments, streamed or
  not."""
  _, _, oa, _ = served
  kw = dict(model="arbor", input="go", temperature=1.0, max_output_tokens=160)
  fmt = {"format": {"type": "json_schema", **JSON_SCHEMA}}
  for seed in (1, 2):
    reply = oa.responses.create(**kw, text=fmt, extra_body={"seed": seed})
    assert reply.status == "completed"
    jsonschema.validate(json.loads(reply.output_text), SCHEMA)
  for seed, choice, only in ((1, "required", None), (2, "required", None),
                             (3, {"type": "function", "name": "sum"}, "sum")):
    reply = oa.responses.create(**kw, tools=FLAT_TOOLS, tool_choice=choice,
                                parallel_tool_calls=False, extra_body={"seed": seed})
    assert reply.status == "completed"
    [call] = [o for o in reply.output if o.type == "function_call"]
    valid_call(call.name, call.arguments, only)
  with oa.responses.stream(**kw, tools=FLAT_TOOLS, tool_choice="required",
                           parallel_tool_calls=False, extra_body={"seed": 4}) as stream:
    final = stream.get_final_response()
  [call] = [o for o in final.output if o.type == "function_call"]
  valid_call(call.name, call.arguments)


def test_messages_forced_tool_choice_over_http(served):
  """Anthropic Messages: tool_choice any / tool with disable_parallel_tool_use give one
  tool_use block with valid input, streamed or not."""
  _, _, _, an = served
  kw = dict(model="arbor", max_tokens=160, messages=USER, tools=ANTHROPIC_TOOLS)
  one = {"disable_parallel_tool_use": True}
  for seed, choice, only in ((1, {"type": "any", **one}, None), (2, {"type": "any", **one}, None),
                             (3, {"type": "tool", "name": "get", **one}, "get")):
    message = an.messages.create(**kw, tool_choice=choice,
                                 extra_body={"seed": seed, "temperature": 1.0})
    [use] = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use"
    valid_call(use.name, use.input, only)
  with an.messages.stream(**kw, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                          extra_body={"seed": 5, "temperature": 1.0}) as stream:
    final = stream.get_final_message()
  uses = [b for b in final.content if b.type == "tool_use"]
  assert final.stop_reason == "tool_use" and len(uses) == 1
  valid_call(uses[0].name, uses[0].input)


def test_unsupported_strict_schemas_are_400s(served):
  """A strict schema with a keyword the grammar does not implement: a 400 naming the field, in
  each protocol's error shape."""
  _, _, oa, an = served
  with pytest.raises(openai.BadRequestError, match="response_format: cannot be compiled") as e:
    oa.chat.completions.create(model="arbor", messages=USER, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": STRICT_UNSUPPORTED,
                                               "strict": True}})
  assert e.value.param == "response_format"
  with pytest.raises(openai.BadRequestError, match="text.format: cannot be compiled") as e:
    oa.responses.create(model="arbor", input="go", text={"format": {
        "type": "json_schema", "name": "x", "schema": STRICT_UNSUPPORTED, "strict": True}})
  assert e.value.param == "text.format"
  strict_tool = [{"type": "function", "function": {
      "name": "f", "strict": True, "parameters": STRICT_UNSUPPORTED}}]
  with pytest.raises(openai.BadRequestError, match="cannot be compiled") as e:
    oa.chat.completions.create(model="arbor", messages=USER, tools=strict_tool,
                               tool_choice="required")
  assert e.value.param == "tool_choice"
  with pytest.raises(anthropic.BadRequestError, match="json_object") as e:  # no response_format
    an.messages.create(model="arbor", max_tokens=8, messages=USER,
                       extra_body={"response_format": {"type": "json_object"}})
  assert e.value.body["type"] == "error"


def _http(url, path, body=None):
  """(status, JSON) of a POST of `body` (None: a GET) with the server's token."""
  data = None if body is None else json.dumps(body).encode()
  req = urllib.request.Request(url + path, data, method="GET" if body is None else "POST",
                               headers={"Content-Type": "application/json",
                                        "Authorization": f"Bearer {TOKEN}"})
  try:
    with urllib.request.urlopen(req, timeout=60) as resp:
      return resp.status, json.loads(resp.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def test_session_records_protocol_and_expert_ids(served):
  """Each protocol's call is logged with its protocol and, from an engine that records them,
  the MoE expert ids of every position it fed ([positions, moe_layers, k], JSON-encoded);
  constrained calls are marked."""
  srv, url, oa, an = served
  sid = {"session_id": "experts"}
  oa.chat.completions.create(model="arbor", messages=USER, max_tokens=6, extra_body=sid,
                             response_format={"type": "json_object"})
  oa.completions.create(model="arbor", prompt="go", max_tokens=6, extra_body=sid)
  oa.responses.create(model="arbor", input="go", max_output_tokens=6, extra_body=sid)
  an.messages.create(model="arbor", max_tokens=6, messages=USER, extra_body=sid)
  status, _ = _http(url, "/generate", {"input_ids": [1, 2, 3], "max_tokens": 6, **sid})
  assert status == 200
  status, log = _http(url, "/v1/sessions/experts")  # the records as JSON
  calls = log["calls"]
  assert status == 200 and calls == srv.sessions.get("experts")
  assert [c["protocol"] for c in calls] == ["chat_completions", "completions", "responses",
                                            "anthropic_messages", "generate"]
  assert [c["constrained"] for c in calls] == [True, False, False, False, False]
  mc = srv.engine.model_cfg
  for c in calls:
    experts = decode_expert_ids(c["expert_ids"])
    positions = len(c["input_ids"]) + len(c["output_ids"]) - 1
    assert experts.shape == (positions, mc.num_moe_layers, mc.experts_per_token)
    assert experts.min() >= 0 and experts.max() < mc.num_experts
