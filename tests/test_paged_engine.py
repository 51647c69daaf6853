"""The engine with a paged KV cache (models/engine/paged.py) against the contiguous engine.

- Same tokens, log-probs, top log-probs, entropies, stop-string cuts and MoE expert ids as the
  contiguous engine (and log-probs equal to a teacher-forced forward pass) for a dense GQA and
  a MoE + MLA model, greedy and seeded sampling, requests of different lengths and a group
  sharing a prompt.
- A group of G requests with one prompt prefills it once and shares its pages; the shared
  partial last page is copied on write.
- Branches of an episode's next turn take the previous turn's pages (also with few pages).
- With fewer pages than slots x max_seq_len positions, the engine admits by free pages,
  preempts (and recomputes) when pages run out, and finishes a workload with the tokens of an
  unconstrained run, running more requests at once than a contiguous pool of the same memory
  has rows.
- Weight updates with requests in flight ("resubmit", "restart") give the contiguous engine's
  tokens and versions.
- The stacked model's `decode_step` through page tables equals its contiguous decode step.
- Page bookkeeping: reference counts equal the pages the sequences list; copy-on-write and
  eviction free what they should.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from envs.policy import SamplingParams
from models import transformer
from models.engine import Engine, EngineConfig, PageAllocator, PagedPool
from tests.test_engine import check_logprobs, random_prompts

MAX_LEN = 96
PAGE = 8
CONFIG = EngineConfig(slots=4, max_seq_len=MAX_LEN, prefix_cache_rows=4, min_prefix=4,
                      prefill_chunk=32, prefill_bucket=32, prefill_rows=2, steps_per_call=8,
                      max_stop_token_ids=4, top_logprobs=2, page_size=PAGE)


@pytest.fixture(scope="module")
def models(dense_model, moe_mla_model):
  return {"dense": dense_model, "moe_mla": moe_mla_model}


def make_engine(model, **changes):
  cfg = dataclasses.replace(CONFIG, return_expert_ids=model.cfg.is_moe, **changes)
  return Engine(model, cfg, detokenize=lambda ids: "".join(f"<{i}>" for i in ids))


def workload(vocab, seed=0):
  """Prompts of mixed lengths plus a group of three sharing one; greedy and seeded params."""
  rng = np.random.default_rng(seed)
  prompts = random_prompts(rng, (5, 17, 40, 9, 23), vocab)
  prompts += [prompts[2]] * 3
  params = [SamplingParams(max_tokens=int(n), temperature=t, seed=i)
            for i, (n, t) in enumerate(zip((12, 20, 7, 16, 11, 9, 14, 10),
                                           (0, 0.9, 0, 1.0, 0.7, 1.0, 0, 0.8)))]
  params[1] = dataclasses.replace(params[1], stop=["1"])  # any token id with a digit 1
  return prompts, params


def assert_same(a, b):
  for x, y in zip(a, b):
    assert x.output_ids == y.output_ids
    assert x.finish_reason == y.finish_reason
    np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
    np.testing.assert_allclose(x.entropies, y.entropies, atol=1e-5)
    if x.top_logprobs is not None:
      assert [[i for i, _ in t] for t in x.top_logprobs] == [[i for i, _ in t]
                                                             for t in y.top_logprobs]
      np.testing.assert_allclose([[p for _, p in t] for t in x.top_logprobs],
                                 [[p for _, p in t] for t in y.top_logprobs], atol=1e-5)
    if x.expert_ids is not None:
      np.testing.assert_array_equal(x.expert_ids, y.expert_ids)


@pytest.mark.parametrize("which", ["dense", "moe_mla"])
def test_paged_equals_contiguous(which, models):
  model = models[which]
  prompts, params = workload(model.cfg.vocab_size)
  want = make_engine(model).generate(prompts, params)
  eng = make_engine(model, cache="paged")
  got = eng.generate(prompts, params)
  assert_same(want, got)
  check_logprobs(model, prompts, got)
  assert got[1].finish_reason == "stop" and "1" in "".join(f"<{i}>" for i in got[1].output_ids)
  c = eng.counters
  assert c["pages_shared"] > 0 and c["cache_hits"] >= 2
  if model.cfg.is_moe:
    assert got[0].expert_ids.shape[0] == len(prompts[0]) + len(got[0].output_ids) - 1


def test_group_shares_prompt_pages(models):
  """G = 4 samples of a 29-token prefix: prefilled once; the others share its 4 pages and copy
  the partial last one (29 = 3 * 8 + 5) before writing into it."""
  model = models["dense"]
  eng = make_engine(model, cache="paged")
  prompt = random_prompts(np.random.default_rng(1), [30], model.cfg.vocab_size)[0]
  outs = eng.generate([prompt] * 4, SamplingParams(max_tokens=5, temperature=1.0))
  c = eng.counters
  assert c["prefill_tokens"] == 29 and c["cache_hits"] == 3
  assert c["pages_shared"] == 3 * 4 and c["page_copies"] == 3
  # the 3 full prompt pages once + per request its own pages for positions 24..39 (the
  # prompt's partial page and the page the decode call writes into)
  assert c["pages_peak"] == 3 + 4 * 2
  check_logprobs(model, [prompt] * 4, outs)


def test_branched_turns_share_pages(models):
  """Two branches of each episode's second turn extend its first turn (prompt + output + new
  tokens): they take the first turn's pages (cached_tokens) and decode as the contiguous
  engine does, also when few pages force evictions and preemptions."""
  model = models["dense"]
  vocab = model.cfg.vocab_size
  rng = np.random.default_rng(6)
  prompts = random_prompts(rng, (12, 20, 9), vocab)
  first = SamplingParams(max_tokens=10, temperature=1.0, seed=1)
  results = {}
  for name, changes in [("contiguous", {}), ("paged", {"cache": "paged"}),
                        ("tight", {"cache": "paged", "num_pages": 16})]:
    eng = make_engine(model, **changes)
    turn1 = eng.generate(prompts, first)
    turn2 = [p + o.output_ids + random_prompts(np.random.default_rng(i), [3 + b], vocab)[0]
             for i, (p, o) in enumerate(zip(prompts, turn1)) for b in range(2)]
    outs = eng.generate(turn2, SamplingParams(max_tokens=12, temperature=1.0, seed=2))
    results[name] = (turn1 + outs, eng.counters, [o.cached_tokens for o in outs])
  want, _, cached = results["contiguous"]
  for name in ("paged", "tight"):
    got, counters, got_cached = results[name]
    assert_same(want, got)
    assert counters["pages_shared"] > 0
  assert results["paged"][2] == cached
  assert all(c >= len(prompts[i // 2]) + 9 for i, c in enumerate(cached))  # the first turn
  tight = results["tight"][1]
  assert tight["pages_peak"] <= 16 and tight["evictions"] > 0


def test_admission_by_pages_and_preemption(models):
  """16 pages (128 positions: one contiguous row of 96 and a bit) run 4 requests at once,
  preempt when their growth exhausts the pages, and still give the unconstrained tokens."""
  model = models["dense"]
  rng = np.random.default_rng(2)
  prompts = random_prompts(rng, (10, 25, 14, 30, 8, 19), model.cfg.vocab_size)
  params = [SamplingParams(max_tokens=n, temperature=t, seed=i)
            for i, (n, t) in enumerate(zip((40, 30, 50, 20, 45, 35), (0, 1, 0, 1, 1, 0)))]
  want = make_engine(model).generate(prompts, params)
  eng = make_engine(model, cache="paged", num_pages=16, prefix_cache_rows=0)
  got = eng.generate(prompts, params)
  assert_same(want, got)
  c = eng.counters
  assert c["preempted"] > 0
  assert c["running_peak"] == CONFIG.slots > (16 * PAGE) // MAX_LEN
  assert c["pages_peak"] <= 16 and c["pages_used"] == 0  # nothing retained


@pytest.mark.parametrize("on_update", ["resubmit", "restart"])
def test_weight_update_in_flight(on_update, models):
  """update_params while requests run: the paged engine drops nothing computed by the new
  weights from old pages and tags tokens as the contiguous engine does."""
  model = models["dense"]
  other = transformer.init(model.cfg, seed=1)
  prompts, params = workload(model.cfg.vocab_size, seed=3)
  outs, resubmitted = {}, {}
  for cache in ("contiguous", "paged"):
    eng = make_engine(model, cache=cache)
    futures = [eng.submit(x, p) for x, p in zip(prompts, params)]
    eng.step()
    eng.step()
    eng.update_params(other, version=1, on_update=on_update)
    while not all(f.done() for f in futures):
      eng.step()
    outs[cache] = [f.result() for f in futures]
    resubmitted[cache] = eng.counters["resubmitted"]
  assert resubmitted["paged"] == resubmitted["contiguous"] > 0
  assert_same(outs["contiguous"], outs["paged"])
  for a, b in zip(outs["contiguous"], outs["paged"]):
    assert a.token_versions == b.token_versions
  assert any(0 in o.token_versions and 1 in o.token_versions for o in outs["paged"]) == (
      on_update == "resubmit")


def test_bad_paged_config_names_the_field(models):
  model = models["dense"]
  for changes, field in [({"cache": "ring"}, "cache"), ({"page_size": 0}, "page_size"),
                         ({"num_pages": -1}, "num_pages"),
                         ({"cache": "paged", "num_pages": 11}, "num_pages")]:
    with pytest.raises(ValueError, match=f"EngineConfig.{field}="):
      make_engine(model, **changes)


def test_stacked_decode_step_paged_equals_contiguous(models):
  """`Transformer.decode_step` of the stacked model: a ragged prefill then one decode step
  through page tables (pages out of order, one shared by both rows' tables past their
  positions) give the logits of the contiguous cache."""
  model = models["dense"]  # the engine tests cover MLA's paged path
  rng = np.random.default_rng(4)
  tokens = jnp.asarray(rng.integers(1, model.cfg.vocab_size, (2, 11)), jnp.int32)
  nxt = jnp.asarray(rng.integers(1, model.cfg.vocab_size, (2, 1)), jnp.int32)
  lengths = jnp.asarray([11, 7], jnp.int32)
  table = jnp.asarray([[6, 2, 9], [0, 4, 9]], jnp.int32)  # page 9: past both (never written)
  step = nnx.jit(lambda m, t, c, i, pt: m.decode_step(t, c, i, page_table=pt))
  step_rows = nnx.jit(lambda m, t, c, i: m.decode_step(t, c, i))
  zeros = jnp.zeros(2, jnp.int32)
  want, cache = step_rows(model, tokens, model.init_cache(2, 24), zeros)
  got, pages = step(model, tokens, model.init_paged_cache(10, PAGE), zeros, table)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
  want, _ = step_rows(model, nxt, cache, lengths)
  got, _ = step(model, nxt, pages, lengths, table)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


# ----------------------------------------------------------------------------- bookkeeping


def check_refs(pool: PagedPool):
  """Each page's count = the sequences listing it; free pages = those nobody lists."""
  refs = np.zeros(pool.num_pages, np.int32)
  for s in pool.seqs.values():
    for p in s.pages:
      refs[p] += 1
  np.testing.assert_array_equal(pool.alloc.refs, refs)
  assert pool.pages_free == int((refs == 0).sum())


def test_pool_sharing_copy_on_write_and_eviction(dense_model):
  counts = {}
  count = lambda **d: [counts.__setitem__(k, counts.get(k, 0) + v) for k, v in d.items()]
  pool = PagedPool(dense_model, num_pages=8, page_size=4, capacity=16, count=count, retain=1)
  tokens = np.arange(1, 11, dtype=np.int32)
  a = pool.claim("a", None, 0, version=0)
  assert pool.reserve(a, 10) and len(pool.seqs[a].pages) == 3
  pool.record(a, np.append(tokens, 0))  # holds tokens[:10]
  src, m = pool.longest_prefix(np.concatenate([tokens[:6], [99, 98]]), 0, min_prefix=4)
  assert (src, m) == (a, 6)
  b = pool.claim("b", src, m, version=0)
  assert pool.seqs[b].pages == pool.seqs[a].pages[:2]
  check_refs(pool)
  assert pool.reserve(b, 8)  # position 6 lies in the shared second page: copied
  assert pool.seqs[b].pages[0] == pool.seqs[a].pages[0]
  assert pool.seqs[b].pages[1] != pool.seqs[a].pages[1]
  assert pool._copies == {pool.seqs[b].pages[1]: pool.seqs[a].pages[1]}
  assert counts["page_copies"] == 1
  check_refs(pool)
  # a third sequence shares b's copy before it ran: its own copy reads a's page
  c = pool.claim("c", b, 5, version=0)
  assert pool.seqs[c].pages == pool.seqs[b].pages[:2] and pool.reserve(c, 6)
  assert pool._copies[pool.seqs[c].pages[1]] == pool.seqs[a].pages[1]
  pool.free(c)  # its page falls free: no copy into it any more
  assert len(pool._copies) == 1
  check_refs(pool)
  rng = np.random.default_rng(0)
  pool.caches = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype),
                             pool.caches)
  before = jax.tree.map(np.asarray, pool.caches)
  pool.flush()
  src_page, dst_page = pool.seqs[a].pages[1], pool.seqs[b].pages[1]
  for old, new in zip(jax.tree.leaves(before), jax.tree.leaves(pool.caches)):
    np.testing.assert_array_equal(np.asarray(new)[..., dst_page, :, :], old[..., src_page, :, :])
    others = [p for p in range(8) if p != dst_page]
    np.testing.assert_array_equal(np.asarray(new)[..., others, :, :], old[..., others, :, :])
  assert not pool._copies
  assert pool.longest_prefix(tokens, 1, min_prefix=4) == (None, 0)  # another weights version
  pool.release(a)
  pool.release(b)  # retain=1: a (least recently used) is evicted
  assert list(pool.seqs) == [b] and counts["evictions"] == 1
  check_refs(pool)
  c = pool.claim("c", None, 0, version=0)
  assert pool.reserve(c, 16) and pool.pages_free == 8 - 2 - 4
  d = pool.claim("d", None, 0, version=0)
  assert pool.reserve(d, 16 + 5)  # capped at capacity: 4 pages, found by evicting idle b
  assert list(pool.seqs) == [c, d] and pool.pages_free == 0
  e = pool.claim("e", None, 0, version=0)
  assert not pool.reserve(e, 1)  # running sequences are never evicted
  assert pool.seqs[e].pages == []
  check_refs(pool)
  with pytest.raises(ValueError, match="num_pages=3"):
    PagedPool(dense_model, num_pages=3, page_size=4, capacity=16, count=count)


def test_allocator_refcounts():
  alloc = PageAllocator(3)
  pages = [alloc.alloc() for _ in range(3)]
  assert sorted(pages) == [0, 1, 2] and alloc.free == 0
  with pytest.raises(RuntimeError, match="all 3 pages of shard 0"):
    alloc.alloc()
  alloc.share(pages[0])
  alloc.drop(pages[0])
  assert alloc.free == 0
  alloc.drop(pages[0])
  assert alloc.free == 1 and alloc.alloc() == pages[0]
  alloc.drop(pages[1])
  with pytest.raises(RuntimeError, match="is free"):
    alloc.drop(pages[1])


def test_allocator_hands_out_each_shards_own_pages():
  alloc = PageAllocator(6, shards=3)  # shard i owns pages 2i, 2i + 1
  assert [alloc.alloc(1), alloc.alloc(1)] == [2, 3]
  assert alloc.free_in(1) == 0 and alloc.free_in(0) == alloc.free_in(2) == 2
  assert alloc.free == 4 and [alloc.shard_of(p) for p in (0, 3, 5)] == [0, 1, 2]
  with pytest.raises(RuntimeError, match="all 2 pages of shard 1"):
    alloc.alloc(1)
  alloc.drop(3)
  assert alloc.free_in(1) == 1 and alloc.alloc(1) == 3 and alloc.alloc(2) == 4
