"""The engine (models/engine/: the loop, its programs and sampling) against independent
references.

- Log-probs returned for sampled tokens equal teacher-forced log-probs of the finished sequences
  (a full forward pass of the stacked model, no cache) for a dense and a MoE + MLA model, with
  continuous batching, G-sample prefix copies and prefix hits on; per-token entropies equal the
  entropies of the forward pass's next-token distributions, also after a stop-string cut.
- Greedy decoding equals Hugging Face transformers' greedy `generate` (PyTorch CPU) token for
  token for tiny Qwen2 and DeepSeek-V3 models built with transformers and imported.
- Weight updates tag tokens with versions whose log-probs match the weights that sampled them.
- Multi-turn reuse prefills only the new tokens (engine counters).
- Sampling: the sampler's distribution against a NumPy computation of temperature/top-k/top-p.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from envs.policy import SamplingParams
from models import hf, transformer
from models.engine import Engine, EngineConfig, programs, sampling
from tests.conftest import TINY_DENSE

MAX_LEN = 96
CONFIG = EngineConfig(slots=4, max_seq_len=MAX_LEN, prefix_cache_rows=8, min_prefix=4,
                      prefill_chunk=32, prefill_bucket=32, prefill_rows=2, steps_per_call=8,
                      max_stop_token_ids=4, top_logprobs=3)
ATOL = 1e-5


@nnx.jit
def _logits(model, tokens):
  n = tokens.shape[1]
  positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), tokens.shape)
  end = jnp.full(tokens.shape, n, jnp.int32)  # causal rows; right padding never seen
  logits, aux = model(tokens, positions, end)
  return jax.nn.log_softmax(logits, -1), aux.get("expert_ids")


def teacher(model, seqs):
  """Per sequence: log-probs [len, vocab] of every next token and (MoE) expert ids
  [moe_layers, len, k], from one full forward pass over right-padded rows."""
  width = max(MAX_LEN, -(-max(map(len, seqs)) // 32) * 32)  # few shapes, few compiles
  tokens = np.zeros((len(seqs), width), np.int32)
  for i, s in enumerate(seqs):
    tokens[i, :len(s)] = s
  logp, experts = _logits(model, jnp.asarray(tokens))
  logp = np.asarray(logp)
  experts = None if experts is None else np.asarray(experts)
  return [(logp[i, :len(s)], None if experts is None else experts[:, i, :len(s)])
          for i, s in enumerate(seqs)]


def check_logprobs(model, inputs, outs, atol=ATOL):
  """Engine log-probs of each output token == teacher-forced log p(token | prefix)."""
  refs = teacher(model, [list(x) + o.output_ids for x, o in zip(inputs, outs)])
  worst = 0.0
  for x, o, (logp, _) in zip(inputs, outs, refs):
    n = len(x)
    want = logp[np.arange(n - 1, n - 1 + len(o.output_ids)), o.output_ids]
    worst = max(worst, float(np.abs(want - np.asarray(o.logprobs)).max()))
  print(f"max |engine - teacher| log-prob: {worst:.2e}")
  assert worst <= atol
  return refs


@pytest.fixture(scope="module")
def models(dense_model, moe_mla_model):
  return {"dense": dense_model, "moe_mla": moe_mla_model}


def make_engine(model, **changes):
  cfg = dataclasses.replace(CONFIG, **changes)
  if model.cfg.is_moe:
    cfg = dataclasses.replace(cfg, return_expert_ids=True)
  return Engine(model, cfg, detokenize=lambda ids: "".join(f"<{i}>" for i in ids))


def random_prompts(rng, lengths, vocab):
  return [rng.integers(1, vocab, n).tolist() for n in lengths]


# ----------------------------------------------------------------------------- consistency


@pytest.mark.parametrize("which", ["dense", "moe_mla"])
def test_logprobs_equal_teacher_forcing(which, models):
  """11 requests through 4 slots (continuous batching), 3 samples of one prompt (prefilled once,
  copied), one prompt extending another (prefix hit), mixed greedy / temperature / top-k /
  top-p: every returned log-prob equals the full forward pass's; top-3 log-probs and (MoE)
  expert ids equal the forward pass's too."""
  model = models[which]
  eng = make_engine(model)
  rng = np.random.default_rng(0)
  vocab = model.cfg.vocab_size
  prompts = random_prompts(rng, (5, 9, 17, 30, 12, 3), vocab)
  shared = rng.integers(1, vocab, 20).tolist()
  prompts += [shared] * 3 + [shared + rng.integers(1, vocab, 6).tolist(), prompts[3][:25]]
  params = [SamplingParams(max_tokens=int(m), temperature=t, top_k=k, top_p=p, seed=i)
            for i, (m, t, k, p) in enumerate(zip(
                [8, 20, 12, 16, 9, 14, 18, 18, 18, 10, 6],
                [1.0, 0.0, 1.0, 0.7, 1.0, 1.3, 1.0, 1.0, 1.0, 0.0, 1.0],
                [0, 0, 5, 0, 0, 3, 0, 0, 0, 0, 0],
                [1.0, 1.0, 1.0, 0.8, 1.0, 1.0, 0.9, 0.9, 0.9, 1.0, 1.0]))]
  traces = programs.TRACES["decode"]
  outs = eng.generate(prompts, params)
  counters = eng.counters
  print(counters)
  assert [len(o.output_ids) for o in outs] == [p.max_tokens for p in params]
  assert all(o.finish_reason == "length" for o in outs)
  assert counters["cache_hits"] >= 4 and counters["row_copies"] >= 2
  assert counters["decode_calls"] >= 4 and counters["finished"] == len(prompts)
  # the three samples of `shared`: one prefill of its 19 cached tokens, two copies
  assert outs[6].cached_tokens == 0 and outs[7].cached_tokens == outs[8].cached_tokens == 19
  assert outs[9].cached_tokens >= 19 and outs[10].cached_tokens == 24
  assert len({tuple(o.output_ids) for o in outs[6:9]}) == 3  # different seeds, different samples
  refs = check_logprobs(model, prompts, outs)
  for x, o, (logp, experts) in zip(prompts, outs, refs):
    pred = np.arange(len(x) - 1, len(x) - 1 + len(o.output_ids))  # predicting positions
    top = np.argsort(-logp[pred], axis=-1)[:, :3]
    assert [[i for i, _ in t] for t in o.top_logprobs] == top.tolist()
    np.testing.assert_allclose([[v for _, v in t] for t in o.top_logprobs],
                               np.take_along_axis(logp[pred], top, -1), atol=ATOL)
    if experts is not None:  # every position fed to the model: prefilled, copied or decoded
      fed = len(x) + len(o.output_ids) - 1
      np.testing.assert_array_equal(o.expert_ids, np.moveaxis(experts[:, :fed], 1, 0))
  # engines of one config share compiled code: at most one decode compile per model config
  assert programs.TRACES["decode"] - traces <= 1


def test_entropies_equal_teacher_forcing(models):
  """Each output token's entropy is that of softmax(logits) of the full forward pass at the
  position that predicts it, whatever the sampling settings; a stop-string cut drops the
  entropies of the tokens it drops."""
  model = models["dense"]
  eng = make_engine(model)
  rng = np.random.default_rng(8)
  prompts = random_prompts(rng, (6, 14, 25), model.cfg.vocab_size)
  params = [SamplingParams(max_tokens=10, temperature=t, top_k=k, top_p=p, seed=i)
            for i, (t, k, p) in enumerate([(1.0, 0, 1.0), (0.0, 0, 1.0), (0.7, 5, 0.9)])]
  outs = eng.generate(prompts, params)
  # the first request again, same seed (same sample), cut by a stop string on its 4th-5th tokens
  ids = outs[0].output_ids
  stop = f"<{ids[3]}><{ids[4]}>"
  cut, = eng.generate([prompts[0]], dataclasses.replace(params[0], stop=(stop,)))
  n = next(t for t in range(1, 11) if stop in "".join(f"<{i}>" for i in ids[:t]))
  assert cut.output_ids == ids[:n] and cut.finish_reason == "stop"
  assert cut.entropies == outs[0].entropies[:n]
  outs.append(cut)
  prompts.append(prompts[0])
  refs = teacher(model, [list(x) + o.output_ids for x, o in zip(prompts, outs)])
  for x, o, (logp, _) in zip(prompts, outs, refs):
    assert len(o.entropies) == len(o.logprobs) == len(o.output_ids)
    pred = logp[len(x) - 1:len(x) - 1 + len(o.output_ids)].astype(np.float64)
    want = -np.sum(np.exp(pred) * pred, axis=-1)
    np.testing.assert_allclose(o.entropies, want, rtol=1e-4)


# ----------------------------------------------------------------------------- HF parity


@pytest.mark.parametrize("name", ["qwen2", "deepseek_v3"])
def test_greedy_equals_transformers_generate(name, tmp_path):
  """32 greedy tokens per prompt, token for token, against transformers' `generate` on the
  same tiny random checkpoint (built and saved by transformers, imported by models.hf)."""
  import torch
  from transformers import AutoModelForCausalLM

  from tests.test_hf import CASES, randomize
  config_cls, kwargs = CASES[name]
  torch.manual_seed(0)
  hf_model = AutoModelForCausalLM.from_config(config_cls(**kwargs),
                                              attn_implementation="eager").eval()
  randomize(hf_model, seed=1)
  hf_model.save_pretrained(tmp_path)
  model = hf.load(tmp_path)
  eng = Engine(model, EngineConfig(slots=2, max_seq_len=64, prefix_cache_rows=0,
                                   prefill_chunk=32, prefill_bucket=32, steps_per_call=16))
  rng = np.random.default_rng(1)
  prompts = random_prompts(rng, (7, 19, 12), kwargs["vocab_size"])
  outs = eng.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))
  for prompt, out in zip(prompts, outs):
    with torch.no_grad():
      ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32,
                              do_sample=False, output_logits=True, return_dict_in_generate=True,
                              pad_token_id=0)
    want = ref.sequences[0, len(prompt):].tolist()
    assert out.output_ids == want
    # raw logits: `scores` are processed (min_new_tokens masks the EOS id)
    hf_logp = torch.log_softmax(torch.stack(ref.logits)[:, 0].float(), -1).numpy()
    np.testing.assert_allclose(out.logprobs, hf_logp[np.arange(32), want], atol=1e-4)


# ----------------------------------------------------------------------------- weight updates


def test_weight_update_tags_versions(models):
  """finish: in-flight requests end on the old weights, later ones use the new; resubmit:
  in-flight requests keep their tokens and continue on the new weights. Each token's log-prob
  equals the teacher-forced log-prob under the weights of its version; nothing recompiles."""
  old = models["dense"]
  new = transformer.init(TINY_DENSE.replace(initializer_range=0.12), seed=5)
  eng = make_engine(old)
  rng = np.random.default_rng(3)
  prompts = random_prompts(rng, (11, 6, 14), old.cfg.vocab_size)
  params = SamplingParams(max_tokens=20, temperature=1.0)
  eng.generate(prompts[:1], SamplingParams(max_tokens=2))  # compile before counting traces
  traces = dict(programs.TRACES)

  first = [eng.submit(p, params) for p in prompts[:2]]
  eng.step()  # admit + one decode call (8 of 20 tokens)
  eng.update_params(new, version=1, on_update="finish")
  later = eng.submit(prompts[2], params)
  while not later.done():
    eng.step()
  outs = [f.result() for f in first]
  assert all(o.token_versions == [0] * 20 for o in outs)
  check_logprobs(old, prompts[:2], outs)
  assert later.result().token_versions == [1] * 20
  check_logprobs(new, prompts[2:], [later.result()])

  futures = [eng.submit(p, params) for p in prompts[:2]]
  eng.step()
  eng.update_params(old, version=2, on_update="resubmit")
  while not all(f.done() for f in futures):
    eng.step()
  for prompt, f in zip(prompts, futures):
    o = f.result()
    assert o.token_versions == [1] * 8 + [2] * 12, o.token_versions
    seq = prompt + o.output_ids
    (logp_new, _), = teacher(new, [seq])
    (logp_old, _), = teacher(old, [seq])
    n = len(prompt)
    pred = np.arange(n - 1, n - 1 + 20)
    want = np.where(np.array(o.token_versions) == 1, logp_new[pred, o.output_ids],
                    logp_old[pred, o.output_ids])
    np.testing.assert_allclose(o.logprobs, want, atol=ATOL)
  assert eng.counters["updates"] == 2 and eng.counters["resubmitted"] == 2
  # no program compiled before the updates traced again (prefill lengths vary; a prefix copy
  # may compile here for the first time)
  again = {k for k, n in traces.items() if k != "prefill" and programs.TRACES[k] != n}
  assert not again, again


def test_update_params_rejects_other_shapes(models):
  eng = make_engine(models["dense"])
  other = transformer.init(TINY_DENSE.replace(intermediate_size=64), seed=0)
  with pytest.raises(ValueError, match="update_params"):
    eng.update_params(other, version=1)
  with pytest.raises(ValueError, match="on_update"):
    eng.update_params(models["dense"], version=1, on_update="never")


# ----------------------------------------------------------------------------- prefix reuse


def test_multi_turn_prefills_only_new_tokens(models):
  """A 5-turn session, each call extending the last call's input + output by 4 tokens, with
  unrelated requests in between: every later turn prefills exactly its 4 new tokens."""
  model = models["dense"]
  eng = make_engine(model)
  rng = np.random.default_rng(4)
  vocab = model.cfg.vocab_size
  seq = rng.integers(1, vocab, 10).tolist()
  for turn in range(5):
    before = eng.counters
    out, = eng.generate([seq], SamplingParams(max_tokens=6, temperature=1.0, seed=turn))
    after = eng.counters
    prefilled = after.get("prefill_tokens", 0) - before.get("prefill_tokens", 0)
    if turn == 0:
      assert prefilled == len(seq) - 1  # the last input token is fed by the first decode step
    else:
      assert prefilled == 4, (turn, prefilled)
      assert out.cached_tokens == len(seq) - 5
    check_logprobs(model, [seq], [out])
    eng.generate(random_prompts(rng, (8, 13), vocab), SamplingParams(max_tokens=3))
    seq = seq + out.output_ids + rng.integers(1, vocab, 4).tolist()


def test_g_samples_prefill_once_and_lru_bound(models):
  """G = 4 samples of a 30-token prompt prefill it once (3 row copies); with 12 cache rows,
  12 later distinct prompts evict it (least recently used) and it is prefilled again."""
  model = models["dense"]
  eng = make_engine(model)
  rng = np.random.default_rng(5)
  prompt = rng.integers(1, model.cfg.vocab_size, 30).tolist()
  outs = eng.generate([prompt] * 4, SamplingParams(max_tokens=5))
  c = eng.counters
  assert c["prefill_tokens"] == 29 and c["row_copies"] == 3 and c["cache_hits"] == 3
  check_logprobs(model, [prompt] * 4, outs)
  eng.generate(random_prompts(rng, range(10, 22), model.cfg.vocab_size),
               SamplingParams(max_tokens=2))
  assert eng.counters["evictions"] >= 4
  before = eng.counters["prefill_tokens"]
  eng.generate([prompt], SamplingParams(max_tokens=3))
  assert eng.counters["prefill_tokens"] - before == 29  # evicted: prefilled again


# ----------------------------------------------------------------------------- sampling


def reference_probs(logits, temperature, top_k, top_p):
  """Sampling distribution of one row, written directly from the definitions."""
  if temperature == 0:
    p = np.zeros_like(logits)
    p[np.argmax(logits)] = 1
    return p
  x = logits / temperature
  order = np.argsort(-x)
  keep = np.zeros(len(x), bool)
  k = top_k if top_k > 0 else len(x)
  keep[order[:k]] = True
  p = np.where(keep, np.exp(x - x.max()), 0)
  p /= p.sum()
  mass = 0.0
  nucleus = np.zeros(len(x), bool)
  for i in order[:k]:
    nucleus[i] = True
    mass += p[i]
    if mass >= top_p:
      break
  p = np.where(nucleus, p, 0)
  return p / p.sum()


def test_sampler_distribution():
  rng = np.random.default_rng(6)
  logits = rng.normal(0, 2, (5, 40)).astype(np.float32)
  settings = [(1.0, 0, 1.0), (0.5, 5, 1.0), (1.0, 0, 0.7), (1.3, 8, 0.9), (0.0, 0, 1.0)]
  temperature, top_k, top_p = (np.array(v) for v in zip(*settings))
  n = 4000
  keys = jax.random.split(jax.random.key(0), n)
  draw = jax.jit(jax.vmap(lambda k: sampling.sample(
      jnp.asarray(logits), jnp.asarray(temperature, jnp.float32), jnp.asarray(top_k, jnp.int32),
      jnp.asarray(top_p, jnp.float32), jax.random.split(k, 5))))
  samples = np.asarray(draw(keys))  # [n, rows]
  for row, (t, k, p) in enumerate(settings):
    want = reference_probs(logits[row].astype(np.float64), t, k, p)
    got = np.bincount(samples[:, row], minlength=40) / n
    assert set(np.flatnonzero(got)) <= set(np.flatnonzero(want)), row  # never outside the set
    assert 0.5 * np.abs(got - want).sum() < 0.05, row  # total variation


def test_seeds_stops_and_lengths(models):
  model = models["dense"]
  eng = make_engine(model)
  rng = np.random.default_rng(7)
  prompt, *others = random_prompts(rng, (9, 12, 15, 4), model.cfg.vocab_size)
  params = SamplingParams(max_tokens=12, temperature=1.0, seed=123)
  alone, = eng.generate([prompt], params)
  # same seed, other company in the batch: same sample
  together = eng.generate(others + [prompt], [SamplingParams(max_tokens=5)] * 3 + [params])
  assert together[-1].output_ids == alone.output_ids
  assert eng.generate([prompt], dataclasses.replace(params, seed=124))[0].output_ids != \
      alone.output_ids
  greedy, = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))
  assert eng.generate([prompt], SamplingParams(max_tokens=12, top_k=1, seed=9))[0].output_ids == \
      greedy.output_ids
  # a stop token ends generation after its first occurrence (and is returned)
  stop_tok = greedy.output_ids[4]
  first = greedy.output_ids.index(stop_tok)
  out, = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0,
                                               stop_token_ids=(stop_tok,)))
  assert out.output_ids == greedy.output_ids[:first + 1] and out.finish_reason == "stop"
  # a stop string (on detokenised text) spanning two tokens
  stop = f"<{greedy.output_ids[2]}><{greedy.output_ids[3]}>"
  out, = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, stop=(stop,)))
  text = "".join(f"<{i}>" for i in greedy.output_ids)
  cut = next(t for t in range(1, 13) if stop in "".join(f"<{i}>" for i in greedy.output_ids[:t]))
  assert stop in text and out.output_ids == greedy.output_ids[:cut] and out.finish_reason == "stop"
  assert len(out.logprobs) == len(out.token_versions) == len(out.output_ids)
  assert greedy.finish_reason == "length"


@pytest.mark.parametrize("ids, params, match", [
    ([], SamplingParams(), "input_ids"),
    ([1, 500], SamplingParams(), "token id 500"),
    ([1, -1], SamplingParams(), "token id -1"),
    ([1, 2], SamplingParams(max_tokens=0), "max_tokens=0"),
    ([1, 2], SamplingParams(max_tokens=MAX_LEN), "max_tokens=96.*max_seq_len=96"),
    ([1, 2], SamplingParams(max_tokens=4, temperature=-1.0), "temperature"),
    ([1, 2], SamplingParams(max_tokens=4, top_p=0.0), "top_p"),
    ([1, 2], SamplingParams(max_tokens=4, top_k=-2), "top_k"),
    ([1, 2], SamplingParams(max_tokens=4, stop_token_ids=(1, 2, 3, 4, 5)), "stop_token_ids"),
    ([1, 2], SamplingParams(max_tokens=4, stop_token_ids=(999,)), "stop_token_ids"),
])
def test_bad_requests_name_the_field(ids, params, match, models):
  eng = make_engine(models["dense"])
  with pytest.raises(ValueError, match=match):
    eng.submit(ids, params)


def test_bad_config_and_no_detokenizer(models):
  with pytest.raises(ValueError, match="EngineConfig.slots=0"):
    Engine(models["dense"], dataclasses.replace(CONFIG, slots=0))
  with pytest.raises(ValueError, match="return_expert_ids"):
    Engine(models["dense"], dataclasses.replace(CONFIG, return_expert_ids=True))
  with pytest.raises(ValueError, match="on_update"):
    Engine(models["dense"], dataclasses.replace(CONFIG, on_update="later"))
  with pytest.raises(ValueError, match="detokenize"):
    Engine(models["dense"], CONFIG).submit([1, 2], SamplingParams(max_tokens=4, stop=("x",)))
