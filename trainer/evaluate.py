"""Held-out evaluation: pass@k of checkpoints on a task set, with sandboxes and verifiers.

    summary = run(config, workdir, mesh)         # trainer.main mode "eval"
    out = evaluate(model, model_cfg, chat, tasks, samples=4, k=1, temperature=0.8,
                   selection="majority_vote", engine_cfg=rollouts.engine_config(config),
                   scaffold=rollouts.scaffold_config(config))
    out["pass@k"], out["per_task"], out["selected"]["reward"]

Every episode is a real one (`trainer.rollouts.Rollouts`: the react scaffold in a fresh sandbox
with the task's repository, the task's verifier in another fresh sandbox); reward 1.0 means the
hidden tests pass. n = `samples` episodes per task, c = how many of them score 1.0, and the
task's pass@k is the unbiased estimator of Chen et al. 2021 (`pass_at_k`). Greedy decoding with
samples = 1 is the default pass@1. Episode j of task i samples with `sample_seed(seed, i, j)`
(its prompt phrasing and every call's sampling seed follow from it): an eval is reproducible.
The episode limits are the run's (`trainer.rollouts.scaffold_config`: rl.max_turns,
rl.max_new_tokens, rl.max_context_tokens, rl.episode_timeout_s), the temperature the eval's.

Test-time selection (`selection`, trainer.selection) picks ONE of the n samples per task
without the hidden tests and reports the selected sample's verifier reward ("selected",
"pass@1/selected"): best_of_n, majority_vote, self_play.

An episode that raised (e.g. its sandbox could not be created) counts as a failure (reward 0,
termination "error") and is counted in "errors".

Per-format report ("formats" in the result, results.json and the printed summary): tasks are
grouped by `envs.tasks.task_format` (swe, swe-synth, generated, livecodebench, terminal-bench,
code, exact, judge), and each group (and "all") gets its pass@k, the mean over its tasks of the
unbiased per-task estimate, with a 95% interval (`format_report`): with n = 1 sample per task,
the Wilson score interval of (solved tasks, tasks); with n > 1, the percentile bootstrap over
the group's tasks (10,000 resamples of its per-task pass@k, seeded by the eval's seed).

Per-scaffold report ("scaffolds", likewise): with `scaffolds` (`eval.scaffold`: "react", a
black-box CLI of `envs.scaffolds`, or a weighted mix drawn per task, `trainer.blackbox`), each
task's episodes run its drawn scaffold, and each scaffold present (and "all") gets its pass@k
with the same interval; black-box episodes' trajectories are their gateway sessions.

Statistics for reports: `paired_bootstrap` (one seed) and `paired_bootstrap_seeds` (several
seeds): percentile intervals of the difference of mean per-task scores between two checkpoints
on the same tasks.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import statistics
import tempfile
import time
from typing import Any, Optional, Sequence

import ml_collections
import numpy as np
import tqdm
from etils import epath

from envs.scaffold import ScaffoldConfig
from envs.tasks import task_format
from models.engine import Engine, EngineConfig
from trainer import config as config_lib
from trainer import harness, metrics
from trainer import rollouts as rollouts_lib
from trainer import selection as selection_lib
from trainer.tasks import held_out_tasks

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- statistics


def pass_at_k(n, c, k) -> np.ndarray:
  """Unbiased pass@k estimate 1 - C(n-c, k) / C(n, k), elementwise.

  Numerically stable product form: C(n-c, k)/C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i), summed
  in log space; 1.0 where n - c < k. The arguments broadcast together (e.g. n, c [T] and k a
  scalar).

  Args:
    n: samples per task (integers).
    c: correct samples per task.
    k: the budget.

  Returns:
    f64 pass@k estimates with the broadcast shape.

  Raises:
    ValueError: n holds non-integers, or not 0 <= c <= n and 1 <= k <= n.

  References:
    Chen et al. 2021 (the unbiased pass@k estimator).
  """
  n, c, k = np.broadcast_arrays(np.asarray(n), np.asarray(c), np.asarray(k))
  if n.size and not (np.issubdtype(n.dtype, np.integer) or np.all(n == np.round(n))):
    raise ValueError("pass_at_k: n must hold integers")
  n, c, k = n.astype(np.int64), c.astype(np.int64), k.astype(np.int64)
  if np.any(c < 0) or np.any(c > n):
    raise ValueError(f"pass_at_k: expected 0 <= c <= n, got n={n.tolist()}, c={c.tolist()}")
  if np.any(k < 1) or np.any(k > n):
    raise ValueError(f"pass_at_k: expected 1 <= k <= n, got n={n.tolist()}, k={k.tolist()}")
  out = np.ones(n.shape, np.float64)
  some = n - c >= k  # otherwise every k-subset holds a correct sample
  if np.any(some):
    nn, cc, kk = n[some], c[some], k[some]
    width = int(cc.max()) if cc.size else 0
    j = np.arange(width)[None, :]
    i = (nn - cc + 1)[:, None] + j               # n-c+1 .. n, masked beyond c terms
    valid = j < cc[:, None]
    terms = np.log1p(-kk[:, None] / np.where(valid, i, np.inf))  # masked: log1p(0) = 0
    out[some] = 0.0 - np.expm1(terms.sum(axis=1))
  return out


def paired_bootstrap(a, b, *, samples: int = 10_000, seed: int = 0, level: float = 0.95
                     ) -> dict:
  """Paired bootstrap of mean(b) - mean(a) over per-task scores of the SAME tasks.

  Each of `samples` replicates draws T task indices with replacement
  (`np.random.default_rng(seed).integers(0, T, size=(samples, T))`, one draw for all
  replicates) and takes mean(b[idx]) - mean(a[idx]); the interval is the (1-level)/2 and
  (1+level)/2 percentiles of the replicates (NumPy's default linear interpolation).

  Args:
    a: [T] per-task scores of the baseline (e.g. pass@1 of the SFT checkpoint).
    b: [T] per-task scores of the other checkpoint on the same tasks (e.g. the RL one).
    samples: the number of bootstrap replicates.
    seed: the NumPy seed of the draws.
    level: the interval's coverage, in (0, 1).

  Returns:
    {mean_a, mean_b, diff = mean_b - mean_a, low, high} (floats), plus `paired_bootstrap_seeds`'
    per_seed [diff] and seeds = 1.

  Raises:
    ValueError: a and b are not equal-length non-empty 1-D arrays, or a bad samples / level.
  """
  return paired_bootstrap_seeds([a], [b], samples=samples, seed=seed, level=level)


def paired_bootstrap_seeds(list_a: Sequence, list_b: Sequence, *, samples: int = 10_000,
                           seed: int = 0, level: float = 0.95) -> dict:
  """`paired_bootstrap` over several training seeds.

  The statistic is the mean over seeds of mean(b_s) - mean(a_s); a replicate resamples the
  tasks within each seed (independently; seed s's indices are drawn after those of seeds < s,
  `integers(0, T_s, size=(samples, T_s))` from one `default_rng(seed)`) and averages the
  per-seed differences. Tasks may differ between seeds; a_s and b_s must be paired.

  Args:
    list_a: per training seed s, [T_s] per-task scores of the baseline.
    list_b: per training seed s, [T_s] per-task scores of the other checkpoint, same tasks.
    samples: the number of bootstrap replicates.
    seed: the NumPy seed of the draws.
    level: the interval's coverage, in (0, 1).

  Returns:
    {mean_a, mean_b (means over seeds), diff, low, high, per_seed: [diff_s], seeds: S}.

  Raises:
    ValueError: the lists differ in length or are empty, a pair is not two equal-length
      non-empty 1-D arrays, or a bad samples / level.
  """
  if len(list_a) != len(list_b) or not list_a:
    raise ValueError(f"paired_bootstrap_seeds: {len(list_a)} a-lists and {len(list_b)} "
                     "b-lists; expected the same number, at least one")
  if not 0.0 < level < 1.0:
    raise ValueError(f"level={level!r}: expected a probability in (0, 1)")
  if samples < 1:
    raise ValueError(f"samples={samples!r}: expected >= 1")
  rng = np.random.default_rng(seed)
  replicates = np.zeros(samples, np.float64)
  per_seed, means_a, means_b = [], [], []
  for s, (a, b) in enumerate(zip(list_a, list_b)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.ndim != 1 or a.shape != b.shape or a.size == 0:
      raise ValueError(f"paired_bootstrap: seed {s}: a {a.shape} and b {b.shape} must be "
                       "equal-length non-empty 1-D arrays (per-task scores of the same tasks)")
    idx = rng.integers(0, a.size, size=(samples, a.size))
    replicates += (b[idx].mean(axis=1) - a[idx].mean(axis=1))
    means_a.append(a.mean())
    means_b.append(b.mean())
    per_seed.append(float(b.mean() - a.mean()))
  replicates /= len(list_a)
  low, high = np.percentile(replicates, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
  return {"mean_a": float(np.mean(means_a)), "mean_b": float(np.mean(means_b)),
          "diff": float(np.mean(per_seed)), "low": float(low), "high": float(high),
          "per_seed": per_seed, "seeds": len(list_a)}


def wilson_interval(successes: int, total: int, level: float = 0.95) -> tuple[float, float]:
  """The Wilson score interval of a binomial proportion.

  (p + z²/2N ± z·sqrt(p(1-p)/N + z²/4N²)) / (1 + z²/N), p = successes / N, z the standard
  normal quantile of (1 + level) / 2.

  Args:
    successes: successes (e.g. solved tasks).
    total: N, the trials (> 0).
    level: the interval's coverage, in (0, 1).

  Returns:
    (low, high), within [0, 1].

  Raises:
    ValueError: not 0 <= successes <= total, total < 1, or a bad level.

  References:
    Wilson 1927, "Probable inference, the law of succession, and statistical inference".
  """
  if not 0.0 < level < 1.0:
    raise ValueError(f"level={level!r}: expected a probability in (0, 1)")
  if total < 1 or not 0 <= successes <= total:
    raise ValueError(f"wilson_interval: expected 0 <= successes <= total, total >= 1; got "
                     f"successes={successes!r}, total={total!r}")
  z = statistics.NormalDist().inv_cdf((1 + level) / 2)
  p, zz = successes / total, z * z / total
  center = (p + zz / 2) / (1 + zz)
  half = z / (1 + zz) * np.sqrt(p * (1 - p) / total + zz / (4 * total))
  return max(0.0, float(center - half)), min(1.0, float(center + half))


def bootstrap_interval(values, *, samples: int = 10_000, seed: int = 0, level: float = 0.95
                       ) -> tuple[float, float]:
  """Percentile bootstrap interval of the mean of per-task values.

  Draws `np.random.default_rng(seed).integers(0, T, size=(samples, T))` (one draw for all
  replicates), takes each replicate's mean, and returns its (1-level)/2 and (1+level)/2
  percentiles (NumPy's default linear interpolation).

  Args:
    values: [T] per-task values (e.g. pass@k), T >= 1.
    samples: the number of replicates.
    seed: the NumPy seed of the draws.
    level: the interval's coverage, in (0, 1).

  Returns:
    (low, high).

  Raises:
    ValueError: an empty or non-1-D `values`, samples < 1 or a bad level.
  """
  values = np.asarray(values, np.float64)
  if values.ndim != 1 or values.size == 0:
    raise ValueError(f"bootstrap_interval: expected a non-empty 1-D array, got {values.shape}")
  if not 0.0 < level < 1.0:
    raise ValueError(f"level={level!r}: expected a probability in (0, 1)")
  if samples < 1:
    raise ValueError(f"samples={samples!r}: expected >= 1")
  idx = np.random.default_rng(seed).integers(0, values.size, size=(samples, values.size))
  low, high = np.percentile(values[idx].mean(axis=1), [100 * (1 - level) / 2,
                                                        100 * (1 + level) / 2])
  return float(low), float(high)


def format_report(formats: Sequence[str], correct, samples: int, k: int, *,
                  bootstrap_samples: int = 10_000, seed: int = 0, level: float = 0.95
                  ) -> dict[str, dict]:
  """pass@k per task format, with an interval (see the module docstring).

  Args:
    formats: [T] each task's format (`envs.tasks.task_format`).
    correct: [T] correct samples of each task (c of n).
    samples: n, samples per task.
    k: the k of pass@k (1 <= k <= n).
    bootstrap_samples: bootstrap replicates (n > 1).
    seed: the bootstrap's seed (each format draws with it).
    level: the interval's coverage.

  Returns:
    {format: {"tasks", "pass@k", "pass@1", "low", "high", "interval": "wilson" |
    "bootstrap"}} for each format present, in order of first appearance, then "all".

  Raises:
    ValueError: formats and correct differ in length or are empty, or a bad k / samples.
  """
  correct = np.asarray(correct, np.int64)
  if len(formats) != correct.size or correct.ndim != 1 or correct.size == 0:
    raise ValueError(f"format_report: {len(formats)} formats and {correct.shape} counts; "
                     "expected the same number, at least one")
  per_task = pass_at_k(np.full(correct.size, samples), correct, k)
  groups: dict[str, list[int]] = {}
  for i, f in enumerate(formats):
    groups.setdefault(f, []).append(i)
  groups["all"] = list(range(correct.size))
  out = {}
  for f, idx in groups.items():
    values, c = per_task[idx], correct[idx]
    if samples == 1:
      low, high = wilson_interval(int(c.sum()), len(idx), level)
    else:
      low, high = bootstrap_interval(values, samples=bootstrap_samples, seed=seed, level=level)
    out[f] = {"tasks": len(idx), "pass@k": float(values.mean()),
              "pass@1": float((c / samples).mean()), "low": low, "high": high,
              "interval": "wilson" if samples == 1 else "bootstrap"}
  return out


# ----------------------------------------------------------------------------- episodes


def sample_seed(seed: int, task_index: int, sample_index: int) -> int:
  """The episode seed of one sample of one task of an eval (a hash: independent of the others).

  Args:
    seed: the eval's seed.
    task_index: i, the task's index in the task list.
    sample_index: j, the sample's index among the task's n samples.

  Returns:
    A seed in [0, 2**32).
  """
  digest = hashlib.sha256(f"arbor-eval/{seed}/{task_index}/{sample_index}".encode()).digest()
  return int.from_bytes(digest[:4], "little")


# ----------------------------------------------------------------------------- evaluate


def evaluate(model, model_cfg, chat, tasks: Sequence, *, scaffold: ScaffoldConfig,
             samples: int = 1, k: int = 1, temperature: float = 0.0, selection: str = "none",
             seed: int = 0, engine_cfg: Optional[EngineConfig] = None, sandbox: str = "bwrap",
             concurrency: int = 8, engine: Optional[Engine] = None, progress: bool = True,
             name: str = "", keep_trajectories: bool = False, sandbox_url: str = "",
             sandbox_token_file: str = "", scaffolds: str = "react",
             served_name: str = "arbor") -> dict:
  """pass@k of `model` on `tasks` (see the module docstring).

  Args:
    model: the policy (unused when `engine` is given).
    model_cfg: its ModelConfig.
    chat: the chat format episodes render with.
    tasks: the tasks [T].
    scaffold: the episodes (`trainer.rollouts.scaffold_config`); its temperature is replaced
      by `temperature`.
    samples: n, episodes per task.
    k: the k of pass@k (1 <= k <= n).
    temperature: the sampling temperature (0: greedy).
    selection: one of trainer.selection.SELECTIONS ("none": no test-time selection).
    seed: the eval's seed (episode j of task i samples with `sample_seed(seed, i, j)`).
    engine_cfg: the EngineConfig (`trainer.rollouts.engine_config(config)`; None: a slot per
      concurrent episode and the scaffold's max_context_tokens).
    sandbox: the sandbox backend episodes and verifiers run in (envs.sandbox.BACKENDS).
    concurrency: episodes run at once.
    engine: an already built engine (started and stopped here).
    progress: a bar on a terminal, else a line per ~10% of the episodes.
    name: the label of those lines.
    keep_trajectories: also return the episodes.
    sandbox_url: the sandbox server's http(s)://host:port (sandbox "remote").
    sandbox_token_file: the file holding that server's token.
    scaffolds: the episodes' scaffold or weighted mix (`trainer.blackbox.parse_scaffold_mix`;
      each task draws one with `seed`).
    served_name: the model name black-box scaffolds are told.

  Returns:
    {"pass@k" (also under f"pass@{k}"), "k", "samples", "pass@1" (mean c/n), "per_task" [T]
    pass@k, "per_task_rewards" [T][n], "task_ids", "terminations" {reason: count}, "errors",
    "episodes", "time_s", "selection", "formats" (`format_report`: per-format pass@k with a
    95% interval), "scaffolds" (the same per scaffold), "task_scaffolds" [T]} and, when selection != "none", "selected" {"index" [T],
    "reward" [T], ...} and "pass@1/selected"; with keep_trajectories, "trajectories" [T][n]
    (Trajectory or the exception; not JSON; with metadata["submission"] when the selection
    records submissions).

  Raises:
    ValueError: an unknown selection, not 1 <= k <= samples, no tasks, or a model vocabulary
      smaller than the tokenizer's.
  """
  if selection not in selection_lib.SELECTIONS:
    raise ValueError(f"selection={selection!r}: expected one of {selection_lib.SELECTIONS}")
  if not (isinstance(samples, int) and isinstance(k, int) and 1 <= k <= samples):
    raise ValueError(f"samples={samples!r}, k={k!r}: expected integers 1 <= k <= samples")
  if not tasks:
    raise ValueError("tasks: nothing to evaluate")
  scaffold = dataclasses.replace(scaffold, temperature=float(temperature))
  if engine is None:
    engine = _engine(model, model_cfg, chat, engine_cfg, concurrency, scaffold)
  start = time.monotonic()
  episodes = rollouts_lib.Rollouts(
      engine, chat, scaffold, sandbox=sandbox, concurrency=concurrency, sandbox_url=sandbox_url,
      sandbox_token_file=sandbox_token_file,
      record_submissions=selection in ("majority_vote", "self_play"), scaffolds=scaffolds,
      scaffold_seed=seed, served_name=served_name)
  task_scaffolds = [episodes.scaffold_of(t) for t in tasks]
  try:
    results = _run_episodes(episodes, tasks, samples, seed, f"{name}: " if name else "",
                            progress, start)
  finally:
    episodes.close()

  rewards = np.zeros((len(tasks), samples), np.float64)
  terminations: collections.Counter = collections.Counter()
  errors = 0
  for i, row in enumerate(results):
    for j, r in enumerate(row):
      if isinstance(r, BaseException) or r is None:
        errors += 1
        terminations["error"] += 1
        log.warning("episode %d of task %s failed: %r", j, tasks[i].instance_id, r)
        continue
      rewards[i, j] = float(r.reward)
      terminations[r.termination] += 1
  correct = (rewards >= 1.0).sum(axis=1)
  per_task = pass_at_k(np.full(len(tasks), samples), correct, k)
  out: dict[str, Any] = {
      "pass@k": float(per_task.mean()), "k": k, "samples": samples,
      "pass@1": float((correct / samples).mean()), f"pass@{k}": float(per_task.mean()),
      "per_task": per_task.tolist(),
      "per_task_rewards": rewards.tolist(), "task_ids": [t.instance_id for t in tasks],
      "terminations": dict(terminations), "errors": errors, "episodes": rewards.size,
      "selection": selection, "temperature": float(temperature), "seed": seed,
      "formats": format_report([task_format(t) for t in tasks], correct, samples, k,
                               seed=seed),
      "scaffolds": format_report(task_scaffolds, correct, samples, k, seed=seed),
      "task_scaffolds": task_scaffolds}

  if selection != "none":
    out["selected"] = selection_lib.select(tasks, results, rewards, selection, sandbox,
                                           concurrency)
    out["pass@1/selected"] = float(np.mean(out["selected"]["reward"]))
  if keep_trajectories:
    out["trajectories"] = results
  out["time_s"] = time.monotonic() - start
  return out


def _engine(model, model_cfg, chat, engine_cfg: Optional[EngineConfig], concurrency: int,
            scaffold: ScaffoldConfig) -> Engine:
  """An engine for `model` (default config: a slot per concurrent episode, rows for the
  scaffold's context)."""
  vocab = getattr(chat.tokenizer, "vocab_size", None)
  if vocab is not None and model_cfg.vocab_size < vocab:
    raise ValueError(f"model vocab_size={model_cfg.vocab_size} < the tokenizer's {vocab}")
  if engine_cfg is None:
    engine_cfg = EngineConfig(slots=concurrency, prefix_cache_rows=concurrency,
                              max_seq_len=-(-scaffold.max_context_tokens // 128) * 128)
  return Engine(model, engine_cfg, detokenize=chat.tokenizer.decode)


def _run_episodes(episodes: rollouts_lib.Rollouts, tasks: Sequence, samples: int, seed: int,
                  label: str, progress: bool, start: float) -> list[list[Any]]:
  """[T][n] the episodes' trajectories (or the exceptions they raised). Progress: a bar (rate,
  ETA, solved) on a terminal, else a line per tenth of the episodes."""
  runs = [(i, j) for i in range(len(tasks)) for j in range(samples)]
  results: list[list[Any]] = [[None] * samples for _ in tasks]
  futures = {episodes.episodes([(tasks[i], sample_seed(seed, i, j))]): (i, j) for i, j in runs}
  done, reported, solved = 0, 0, 0
  with tqdm.tqdm(total=len(runs), unit="episode", desc=label.rstrip(": ") or "eval",
                 dynamic_ncols=True, disable=None if progress else True) as bar:
    for future in concurrent.futures.as_completed(futures):
      i, j = futures[future]
      (results[i][j],) = future.result()
      done += 1
      solved += getattr(results[i][j], "reward", 0.0) >= 1.0
      bar.set_postfix(solved=solved, refresh=False)
      bar.update()
      if progress and bar.disable and (10 * done // len(runs) > reported or done == len(runs)):
        reported = 10 * done // len(runs)
        metrics.say("eval", f"{label}{done}/{len(runs)} episodes ({100 * done / len(runs):.0f}%)"
                    f", {solved} solved, {time.monotonic() - start:.0f}s")
  return results


# ----------------------------------------------------------------------------- mode "eval"


def _tokenizer_for(config, sub, workdir: str) -> str:
  """The checkpoint's own tokenizer (its hf_extra/ or tokenizer/ dir) unless tokenizer.path is
  set; else the run's (`config_lib.tokenizer_source`)."""
  if not config.tokenizer.path:
    try:
      own = _copy_config(sub)
      own.tokenizer.train_vocab_size = 0
      return config_lib.tokenizer_source(own, workdir)
    except config_lib.ConfigError:
      pass
  return config_lib.tokenizer_source(config, workdir)


def _copy_config(config):
  return ml_collections.ConfigDict(config.to_dict())


def run(config, workdir: str, mesh=None) -> dict:
  """Mode "eval": pass@k of checkpoints on the held-out tasks.

  Every checkpoint of `config.eval.checkpoints` is evaluated on the held-out tasks
  (`trainer.tasks.held_out_tasks`, written under <workdir>/eval_tasks) with the RL loop's
  engine, scaffold limits, sandbox and concurrency and the eval section's k / samples /
  selection / temperature. Weights load unsharded (`trainer.harness.initial_model`).

  Args:
    config: the experiment config (mode "eval"); config.eval.checkpoints holds "ckpt:<dir>"
      entries, () = this workdir's own latest checkpoint.
    workdir: the run's workdir; <workdir>/eval/results.json receives every checkpoint's full
      result (rewritten after each checkpoint).
    mesh: not used.

  Returns:
    {"results": the results file's path, "checkpoints": {ckpt: {"pass@k", "pass@1",
    "pass@1/selected"?, "formats" {format: {"tasks", "pass@k", "low", "high"}}}}}.
  """
  ev, rl_cfg = config.eval, config.rl
  remote = config_lib.is_remote(workdir)
  task_dir = tempfile.mkdtemp(prefix="arbor-eval-tasks-") if remote else os.path.join(
      workdir, "eval_tasks")
  tasks = held_out_tasks(config, task_dir)
  checkpoints = list(ev.checkpoints) or [f"ckpt:{workdir}"]
  scaffold = rollouts_lib.scaffold_config(config, temperature=ev.temperature)
  metrics.say("eval", f"{len(tasks)} tasks x {ev.samples} samples, pass@{ev.k}, selection "
              f"{ev.selection}, temperature {ev.temperature:g}; {len(checkpoints)} checkpoint(s)")
  out: dict[str, Any] = {"tasks": len(tasks), "k": ev.k, "samples": ev.samples,
                         "selection": ev.selection, "temperature": float(ev.temperature),
                         "seed": config.seed, "checkpoints": {}}
  summary: dict[str, Any] = {}
  results_dir = epath.Path(workdir) / "eval"
  results_dir.mkdir(parents=True, exist_ok=True)
  path = results_dir / "results.json"
  for ckpt in checkpoints:
    sub = _copy_config(config)
    sub.model.init, sub.model.preset = ckpt, ""
    model_cfg = config_lib.model_config(sub)
    model = harness.initial_model(sub, model_cfg)
    chat = config_lib.make_chat_format(config, _tokenizer_for(config, sub, workdir))
    result = evaluate(model, model_cfg, chat, tasks, samples=ev.samples, k=ev.k,
                      temperature=ev.temperature, selection=ev.selection, seed=config.seed,
                      engine_cfg=rollouts_lib.engine_config(config), scaffold=scaffold,
                      sandbox=rl_cfg.sandbox, concurrency=rl_cfg.concurrency, name=ckpt,
                      sandbox_url=rl_cfg.sandbox_url,
                      sandbox_token_file=rl_cfg.sandbox_token_file,
                      scaffolds=ev.get("scaffold", "react"),
                      served_name=config.serve.served_name)
    out["checkpoints"][ckpt] = result
    line = {"pass@k": result["pass@k"], "pass@1": result["pass@1"]}
    if "pass@1/selected" in result:
      line["pass@1/selected"] = result["pass@1/selected"]
    for section in ("formats", "scaffolds"):
      if section in result:
        line[section] = {f: {key: r[key] for key in ("tasks", "pass@k", "low", "high")}
                         for f, r in result[section].items()}
    summary[ckpt] = line
    metrics.say("eval", f"{ckpt}: pass@{ev.k} {result['pass@k']:.3f}, pass@1 {result['pass@1']:.3f}"
         + (f", {ev.selection} {result['pass@1/selected']:.3f}" if "pass@1/selected" in result
            else "") + f" ({len(tasks)} tasks, {result['errors']} errors, "
         f"{result['time_s']:.0f}s)")
    scaffolds = result.get("scaffolds", {})
    for f, r in [*result.get("formats", {}).items(),
                 *(((f"scaffold {n}", r) for n, r in scaffolds.items() if n != "all")
                   if len(scaffolds) > 2 else ())]:
      metrics.say("eval", f"  {f:<15} pass@{ev.k} {r['pass@k']:.3f} [{r['low']:.3f}, "
                  f"{r['high']:.3f}] ({r['tasks']} tasks, 95% {r['interval']})")
    path.write_text(json.dumps(out, indent=1))  # after each checkpoint: partial results stay
  metrics.say("eval", f"results in {path}")
  return {"results": str(path), "checkpoints": summary}
