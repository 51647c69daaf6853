"""The layout search of `trainer.aot --search` (trainer/aot_search.py) without compiling: the
candidates of a MoE and a dense config, their ranking, and the compile loop's pruning, stops
and choice of the best plan over a stand-in compiler. (tests/test_aot.py runs the loop with the
real XLA TPU compiler on a tiny model.)"""

import math

import pytest

from configs import rl
from configs import sft_demo
from models.hardware import CHIPS
from models.sharding import MESH_AXES
from trainer import aot_search
from trainer import config as config_lib
from trainer.aot_search import Layout


def qwen3_moe(rows_per_batch=16):
  """Qwen3-30B-A3B RL (128 experts, 4 key/value heads) with one 32,768-token row per chip."""
  c = rl.get_config("qwen3")
  c.model.preset, c.model.init = "qwen3-30b-a3b", "random"
  c.data.rows_per_batch = rows_per_batch
  return c


def qwen_dense():
  c = rl.get_config("qwen2.5-coder")
  c.model.preset, c.model.init = "qwen2.5-coder-7b", "random"
  return c


def sizes(layout):
  return dict(zip(MESH_AXES, layout.mesh))


def test_moe_candidates_include_expert_parallel_splits_and_are_all_valid():
  c = qwen3_moe()
  layouts = aot_search.candidates(c, 16)
  meshes = {(s["fsdp"], s["tensor"], s["expert"], s["sequence"])
            for s in map(sizes, layouts)}
  # fsdp x expert over the 16 chips, expert parallelism dividing the 128 experts
  assert {(16, 1, 1, 1), (8, 1, 2, 1), (4, 1, 4, 1), (2, 1, 8, 1), (1, 1, 16, 1)} <= meshes
  assert Layout((1, 2, 1, 8, 1), 16, 1, 8, "full", False, 1024, 4096) in layouts
  assert {m[1] for m in meshes} == {1, 2, 4}  # tensor divides the 4 key/value heads
  assert {m[3] for m in meshes} == {1, 2, 4, 8, 16}  # sequence divides the 32,768-token rows
  cfg = config_lib.model_config(c)
  for layout in layouts:
    s = sizes(layout)
    assert math.prod(layout.mesh) == 16 and s["data"] == 1
    assert cfg.num_experts % s["expert"] == 0 and cfg.num_kv_heads % s["tensor"] == 0
    assert layout.rows_per_batch % layout.batch_shards == 0
    assert layout.rows_per_batch * layout.microbatches == 16  # the step's rows
    assert layout.remat == "full" and layout.logits_chunk in (1024, 512, 256)
    assert not layout.split_residual or s["tensor"] > 1
    assert layout.dispatch_chunk in (4096, 1024)
  # the config a layout gives passes the run's own checks and resolves to that layout
  for layout in layouts[::7]:
    applied = aot_search.apply(c, layout)
    config_lib.validate(applied, None, files=False)
    assert aot_search.config_layout(applied, 16) == layout


def test_dense_config_has_no_expert_candidates():
  c = qwen_dense()  # 28 heads, 4 key/value heads, 8 rows per micro-batch
  c.model.overrides.remat = "none"
  layouts = aot_search.candidates(c, 8)
  assert layouts and all(sizes(x)["expert"] == 1 for x in layouts)
  assert {sizes(x)["tensor"] for x in layouts} == {1, 2, 4}
  assert {x.remat for x in layouts} == {"none", "save_dots", "full"}  # only stronger remat
  assert {x.dispatch_chunk for x in layouts} == {4096}  # no dispatch to size
  # fewer rows per micro-batch: more micro-batches, the same rows and sequences per step
  assert {(x.rows_per_batch, x.microbatches) for x in layouts} >= {(8, 1), (4, 2), (2, 4), (1, 8)}
  assert all(x.max_seqs * x.microbatches >= 8 for x in layouts)


def test_ranking_puts_expert_parallelism_before_the_global_dispatch():
  c = qwen3_moe()
  chip = CHIPS["v5p"]
  ranked = aot_search.rank(c, aot_search.candidates(c, 16), chip)
  usable = aot_search.FIT_FRACTION * 95
  keys = [(e.hbm_gb > usable, e.step_s) for _, e in ranked]
  assert keys == sorted(keys)
  # the config's own layout (fsdp 16: every chip sorts the micro-batch's token copies) is
  # estimated not to fit; the most promising layout splits the experts
  base = aot_search.config_layout(c, 16)
  est = dict(ranked)
  assert est[base].hbm_gb > 95 and sizes(ranked[0][0])["expert"] > 1
  ep8 = Layout((1, 2, 1, 8, 1), 16, 1, 8, "full", False, 1024, 4096)
  assert est[ep8].hbm_gb < usable and est[ep8].step_s < est[base].step_s
  # the same mesh with fewer rows per micro-batch: less memory, a slower step
  whole = Layout((1, 2, 2, 4, 1), 16, 1, 8, "full", False, 1024, 4096)
  half = Layout((1, 2, 2, 4, 1), 8, 2, 4, "full", False, 1024, 4096)  # gathers twice
  assert est[half].hbm_gb < est[whole].hbm_gb and est[half].step_s > est[whole].step_s
  # a weaker remat keeps more, runs one forward pass less
  d = qwen_dense()
  d.model.overrides.remat = "none"
  dense = {x.remat: aot_search.estimate(d, x, chip) for x in aot_search.candidates(d, 8)
           if sizes(x)["fsdp"] == 8 and x.rows_per_batch == 8 and x.logits_chunk == 1024}
  assert dense["full"].hbm_gb < dense["save_dots"].hbm_gb
  assert dense["full"].step_s > dense["save_dots"].step_s


def tiny():
  c = sft_demo.get_config()
  c.data.rows_per_batch, c.data.row_len = 4, 1024
  c.model.overrides.remat = "save_dots"
  return c


def fake_report(fits, hbm, step, collective_gb, compile_s=1.0):
  """A train-step report as `aot.compile_run` gives it, with the figures that matter here."""
  program = {"hbm_gb": {"total": hbm, "fits": fits}, "roofline_s": {"step": step / 2},
             "collectives": {"all-gather": {"count": 1, "bytes": collective_gb * 1e9 / 2}},
             "compile_s": compile_s / 2}
  return {"mesh": {}, "programs": {"train/gradients": program, "train/update": program},
          "train_peak_gb": {"total": hbm, "fits": fits}}


def test_search_compiles_in_rank_order_prunes_decided_layouts_and_picks_the_best():
  c = tiny()
  compiled = []

  def compile_fn(config, topology, programs):
    assert programs == ("train",)
    layout = aot_search.config_layout(config, 4)
    compiled.append(layout)
    s = sizes(layout)
    # expert parallelism fits; a tensor axis is slower; more sequence shards move fewer bytes
    fits = s["expert"] > 1
    return fake_report(fits, 80.0 if fits else 120.0, 1.0 + s["tensor"], 10.0 / s["sequence"])

  base = fake_report(False, 130.0, 1.0, 5.0, compile_s=3.0)
  result = aot_search.search(c, "v5p:2x2x1", base, budget=20, enough=3,
                             compile_fn=compile_fn, log=lambda line: None)
  tried = result["tried"]
  assert tried[0]["layout"] == aot_search.config_layout(c, 4).describe()
  assert tried[0]["verdict"] == "does not fit: 130.0 GB of 95 GB" and tried[0]["why"] == []
  assert len(compiled) == len(tried) - 1 <= 20
  assert sum(e["fits"] for e in tried) == 3  # stopped at `enough`
  assert result["candidates"] == len(aot_search.candidates(c, 4))
  # compiled in rank order; never a layout an earlier compile decided
  ranked = [x for x, _ in aot_search.rank(c, aot_search.candidates(c, 4), CHIPS["v5p"])]
  assert compiled == sorted(compiled, key=ranked.index)
  outcomes = [(aot_search.config_layout(c, 4), False)] + [
      (x, sizes(x)["expert"] > 1) for x in compiled]
  for i, (later, _) in enumerate(outcomes):
    for earlier, fit in outcomes[:i]:
      assert not (fit and later.lighter_or_equal(earlier))
      assert not (not fit and earlier.lighter_or_equal(later))
  assert all(s["verdict"].startswith("not compiled: as ") for s in result["skipped"])
  # each compiled layout says why it was proposed
  assert all(e["why"] for e in tried[1:])
  # the best: the fastest step of those that fit; within TIE, the fewest collective bytes
  fit = [(x, e) for x, e in zip([None] + compiled, tried) if e["fits"]]
  fastest = min(e["step_s"] for _, e in fit)
  chosen = [e for e in tried if e["best"]]
  assert len(chosen) == 1 and chosen[0]["layout"] == result["best"]
  assert chosen[0]["step_s"] <= fastest * (1 + aot_search.TIE)
  assert chosen[0]["collective_gb"] == min(e["collective_gb"] for _, e in fit
                                           if e["step_s"] <= fastest * (1 + aot_search.TIE))
  lines = aot_search.summary_lines(result)
  assert lines[-1] == f"search: best plan: {result['best']}"
  assert any("why: expert 2" in line for line in lines)


def test_the_best_plan_fits_in_90_percent_of_hbm_then_is_fastest_then_moves_fewest_bytes():
  def entry(hbm, step, collective_gb):
    return {"fits": True, "planned": hbm <= 0.9 * 95, "hbm_gb": hbm, "step_s": step,
            "collective_gb": collective_gb}
  crowded = entry(88.0, 1.0, 100.0)  # fits, above the 90% line: chosen only when alone
  slower, fastest, slowest = entry(60.0, 1.04, 300.0), entry(70.0, 1.03, 200.0), entry(
      50.0, 1.5, 10.0)
  assert aot_search.best([crowded, slower, fastest, slowest]) is fastest
  # within TIE of the fastest step, the fewest collective bytes win
  lighter = entry(65.0, 1.05, 150.0)
  assert aot_search.best([crowded, slower, fastest, lighter]) is lighter
  assert aot_search.best([crowded]) is crowded
  assert aot_search.best([dict(crowded, fits=False, planned=False)]) is None


def test_search_stops_at_the_budget_and_only_when_asked_past_a_fit():
  c = tiny()
  calls = []

  def refuse(config, topology, programs):
    calls.append(config)
    return fake_report(False, 200.0, 1.0, 1.0)

  base = fake_report(False, 130.0, 1.0, 5.0)
  result = aot_search.search(c, "v5p:2x2x1", base, budget=3, compile_fn=refuse,
                             log=lambda line: None)
  assert len(calls) == 3 and result["best"] is None
  assert result["not_compiled"] > 0
  assert aot_search.summary_lines(result)[-1].startswith("search: no layout tried fits")
  fits = fake_report(True, 50.0, 1.0, 5.0)
  assert aot_search.search(c, "v5p:2x2x1", fits, compile_fn=refuse) == {}
  explored = aot_search.search(c, "v5p:2x2x1", fits, budget=1, explore=True,
                               compile_fn=refuse, log=lambda line: None)
  assert explored["best"] == explored["tried"][0]["layout"]  # the config's own


def test_a_layout_the_compiler_cannot_build_is_reported_and_the_search_goes_on():
  c = tiny()

  def flaky(config, topology, programs):
    if config.mesh.sequence > 1:
      raise ValueError("no kernel for this\nsecond line")
    return fake_report(False, 200.0, 1.0, 1.0)

  result = aot_search.search(c, "v5p:2x2x1", fake_report(False, 130.0, 1.0, 5.0), budget=40,
                             compile_fn=flaky, log=lambda line: None)
  failed = [e for e in result["tried"] if e.get("failed")]
  assert failed and all(e["verdict"] == "failed: no kernel for this" for e in failed)
  assert len(result["tried"]) > len(failed) + 1
