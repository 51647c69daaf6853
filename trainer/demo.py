"""The demo pipeline (mode "demo", configs/demo.py): per seed SFT -> eval -> RL -> eval, then the
report with both pass@1 values per seed and a paired bootstrap interval of the improvement.

    summary = run(config, workdir, mesh)

Layout: <workdir>/seed_<s>/{sft,rl}/ (each a normal workdir of its mode, so a rerun resumes
every stage where it stopped), <workdir>/seed_<s>/eval_{sft,rl}.json (per-task held-out
rewards; an existing file is reused), <workdir>/seed_<s>/result.json (a finished seed, with
the minutes it took: a rerun reuses it), <workdir>/demo_results.json and demo_report.html.
SIGTERM or Ctrl-C saves the running stage's checkpoint and stops the demo.
"""

from __future__ import annotations

import json
import os
import time

import ml_collections

from trainer import config as config_lib
from trainer import evaluate, harness, rl, rollouts, sft
from trainer.metrics import JSONL, read_jsonl, say
from envs.tasks import Task
from trainer.tasks import build_environments, held_out_tasks, with_environments

STAGES = ("sft", "rl")


def stage_configs(config, seed: int, seed_dir: str) -> tuple:
  """The SFT and RL stage configs of one seed.

  Args:
    config: the demo config (configs/demo.py).
    seed: the seed (config.seed and config.data.seed of both stages).
    seed_dir: <workdir>/seed_<seed>; the SFT stage's workdir is its sft/.

  Returns:
    (SFT config, RL config): copies of config.sft / config.rl with the seed and the
    optimizer's total_steps set, the RL stage starting from the SFT stage's checkpoint and
    tokenizer.
  """
  sft_cfg = ml_collections.ConfigDict(config.sft.to_dict())
  sft_cfg.seed = seed
  sft_cfg.data.seed = seed
  sft_cfg.optimizer.total_steps = sft_cfg.train.steps
  rl_cfg = ml_collections.ConfigDict(config.rl.to_dict())
  rl_cfg.seed = seed
  rl_cfg.data.seed = seed
  rl_cfg.optimizer.total_steps = rl_cfg.train.steps
  sft_dir = os.path.join(seed_dir, "sft")
  rl_cfg.model.init, rl_cfg.model.preset = f"ckpt:{sft_dir}", ""
  rl_cfg.tokenizer.path = os.path.join(sft_dir, "tokenizer")
  rl_cfg.tokenizer.train_vocab_size = 0
  return sft_cfg, rl_cfg


def held_out_eval(rl_cfg, run_dir: str, out: str, mesh) -> dict:
  """Greedy pass@1 of the latest checkpoint of a run on the held-out tasks (cached).

  Args:
    rl_cfg: the RL stage config (its tokenizer, eval, engine and sandbox settings).
    run_dir: the workdir of the run whose latest checkpoint is evaluated.
    out: the result's JSON file; when it exists, it is returned without evaluating.
    mesh: not used.

  Returns:
    {"checkpoint", "pass@1" (pass@eval.k; eval.k = 1 and temperature 0 give greedy pass@1),
    "per_task" (rewards), "terminations", "time_s"}.
  """
  if os.path.isfile(out):
    with open(out) as f:
      return json.load(f)
  cfg = ml_collections.ConfigDict(rl_cfg.to_dict())
  cfg.model.init, cfg.model.preset = f"ckpt:{run_dir}", ""
  model_cfg = config_lib.model_config(cfg)
  model = harness.initial_model(cfg, model_cfg)
  chat = config_lib.make_chat_format(cfg, cfg.tokenizer.path)
  tasks = held_out_tasks(cfg, os.path.join(os.path.dirname(out), "eval_tasks"))
  scaffold = rollouts.scaffold_config(cfg, temperature=cfg.eval.temperature)
  t0 = time.perf_counter()
  result = evaluate.evaluate(model, model_cfg, chat, tasks, samples=cfg.eval.samples,
                             k=cfg.eval.k, temperature=cfg.eval.temperature, seed=cfg.seed,
                             engine_cfg=rollouts.engine_config(cfg), scaffold=scaffold,
                             sandbox=cfg.rl.sandbox, concurrency=cfg.rl.concurrency)
  result = {"checkpoint": run_dir, "pass@1": float(result[f"pass@{cfg.eval.k}"]),
            "per_task": [float(x) for x in result["per_task"]],
            "terminations": result.get("terminations", {}),
            "time_s": time.perf_counter() - t0}
  with open(out + ".tmp", "w") as f:
    json.dump(result, f)
  os.replace(out + ".tmp", out)
  return result


def run_seed(config, seed: int, seed_dir: str, mesh) -> dict | None:
  """One seed's SFT -> eval -> RL -> eval; each stage resumes or is reused.

  The result, with the minutes of the run that completed the seed, is kept in
  <seed_dir>/result.json, so a rerun of a finished seed reports what was measured.

  Args:
    config: the demo config.
    seed: the seed.
    seed_dir: the seed's directory (<workdir>/seed_<seed>).
    mesh: the device mesh the stages train on.

  Returns:
    {"seed", "sft_pass@1", "rl_pass@1", "sft", "rl" (per-task rewards), "minutes"}, or None
    when a stage was interrupted (its checkpoint is saved).
  """
  path = os.path.join(seed_dir, "result.json")
  if os.path.isfile(path):
    with open(path) as f:
      return json.load(f)
  t0 = time.perf_counter()
  sft_cfg, rl_cfg = stage_configs(config, seed, seed_dir)
  say("demo", f"seed {seed}: SFT ({sft_cfg.train.steps} steps) in {seed_dir}/sft")
  if sft.run(sft_cfg, os.path.join(seed_dir, "sft"), mesh)["preempted"]:
    return None
  t_sft = time.perf_counter() - t0
  before = held_out_eval(rl_cfg, os.path.join(seed_dir, "sft"),
                         os.path.join(seed_dir, "eval_sft.json"), mesh)
  say("demo", f"seed {seed}: SFT held-out pass@1 {before['pass@1']:.3f} "
      f"({len(before['per_task'])} tasks)")
  say("demo", f"seed {seed}: RL ({rl_cfg.train.steps} steps, {rl_cfg.loss.name}) in "
      f"{seed_dir}/rl")
  if rl.run(rl_cfg, os.path.join(seed_dir, "rl"), mesh)["preempted"]:
    return None
  after = held_out_eval(rl_cfg, os.path.join(seed_dir, "rl"),
                        os.path.join(seed_dir, "eval_rl.json"), mesh)
  minutes = (time.perf_counter() - t0) / 60
  say("demo", f"seed {seed}: pass@1 SFT {before['pass@1']:.3f} -> RL {after['pass@1']:.3f} "
      f"({minutes:.1f} min, SFT stage {t_sft / 60:.1f} min)")
  result = {"seed": seed, "sft_pass@1": before["pass@1"], "rl_pass@1": after["pass@1"],
            "sft": before["per_task"], "rl": after["per_task"], "minutes": minutes}
  with open(path + ".tmp", "w") as f:
    json.dump(result, f)
  os.replace(path + ".tmp", path)
  return result


def prepare_environment(config) -> list[str]:
  """Builds the environment the RL stage's and the evals' sandboxes start from
  (`rl.default_environment`) before the first stage, with its progress on stderr; a cached
  build is found at once.

  Returns:
    Its root filesystem (bwrap) or image tag (docker); [] without one, or for a sandbox
    backend that builds nothing here.

  Raises:
    ConfigError: naming rl.default_environment when it cannot be read.
    BuildError / RuntimeError: the build failed.
  """
  probe = with_environments(config.rl, [Task(instance_id="demo-environment", kind="code",
                                             problem_statements=("-",),
                                             tests=({"input": "", "output": ""},))])
  if probe[0].environment is None:
    return []
  say("demo", f"environment {config.rl.rl.default_environment!r}: building, or found in the "
      "cache")
  t0 = time.perf_counter()
  made = build_environments(config.rl, probe, progress=lambda line: say("demo", line))
  say("demo", f"environment ready in {time.perf_counter() - t0:.1f} s")
  return made


def run(config, workdir: str, mesh=None) -> dict:
  """Every seed's pipeline, then the results (demo_results.json) and the report.

  Args:
    config: the demo config (config.seeds, config.sft, config.rl).
    workdir: the demo's directory (layout: the module doc).
    mesh: the device mesh the stages train on.

  Returns:
    The summary: per-seed pass@1 values and minutes, their means, the paired bootstrap
    "improvement" interval (`evaluate.paired_bootstrap_seeds`), the number of tasks and the
    report's path; {"preempted": True} when a seed was interrupted.
  """
  os.makedirs(workdir, exist_ok=True)
  prepare_environment(config)
  per_seed = []
  for seed in config.seeds:
    result = run_seed(config, seed, os.path.join(workdir, f"seed_{seed}"), mesh)
    if result is None:  # interrupted (SIGTERM / Ctrl-C): its stage saved a checkpoint
      say("demo", f"seed {seed}: interrupted; rerun the same command to resume")
      return {"preempted": True}
    per_seed.append(result)
  ci = evaluate.paired_bootstrap_seeds([s["sft"] for s in per_seed],
                                       [s["rl"] for s in per_seed])
  results = {"seeds": [{k: v for k, v in s.items() if k not in ("sft", "rl")}
                       for s in per_seed],
             "mean_sft_pass@1": sum(s["sft_pass@1"] for s in per_seed) / len(per_seed),
             "mean_rl_pass@1": sum(s["rl_pass@1"] for s in per_seed) / len(per_seed),
             "improvement": ci, "tasks": len(per_seed[0]["sft"])}
  with open(os.path.join(workdir, "demo_results.json"), "w") as f:
    json.dump(results, f, indent=1)
  results["report"] = write_report(workdir, config, results)
  say("demo", f"pass@1 SFT {results['mean_sft_pass@1']:.3f} -> RL {results['mean_rl_pass@1']:.3f}; "
       f"improvement {ci['diff']:+.3f} (95% CI {ci['low']:+.3f} .. {ci['high']:+.3f}); "
       f"report {results['report']}")
  return results


def write_report(workdir: str, config, results: dict) -> str:
  """Writes demo_report.html (+ .png) to `workdir`.

  The report shows the SFT loss and RL reward curves per seed, the pass@1 table and the
  interval.

  Args:
    workdir: the demo's directory (the stages' metrics are read from it).
    config: the demo config (not read).
    results: the summary `run` builds, before "report" is added.

  Returns:
    The path of demo_report.html.
  """
  # imported here, as trainer.report does: every trainer process imports this module, and
  # matplotlib costs about a second of start-up to the many that draw nothing
  from matplotlib.figure import Figure

  fig = Figure(figsize=(15, 4))  # the object API: no pyplot state, no display
  axes = fig.subplots(1, 3)
  for s in results["seeds"]:
    seed_dir = os.path.join(workdir, f"seed_{s['seed']}")
    for ax, stage, key in ((axes[0], "sft", "loss"), (axes[1], "rl", "reward_mean")):
      rows = read_jsonl(os.path.join(seed_dir, stage, stage, JSONL))
      xs = [step for step, r in sorted(rows.items()) if key in r]
      ax.plot(xs, [rows[step][key] for step in xs], label=f"seed {s['seed']}")
      ax.set_title(f"{stage}: {key}")
      ax.set_xlabel("step")
      ax.legend()
  names = [f"seed {s['seed']}" for s in results["seeds"]]
  x = range(len(names))
  axes[2].bar([i - 0.2 for i in x], [s["sft_pass@1"] for s in results["seeds"]], 0.4, label="SFT")
  axes[2].bar([i + 0.2 for i in x], [s["rl_pass@1"] for s in results["seeds"]], 0.4, label="RL")
  axes[2].set_xticks(list(x), names)
  axes[2].set_title(f"held-out pass@1 ({results['tasks']} tasks)")
  axes[2].legend()
  fig.tight_layout()
  png = os.path.join(workdir, "demo_report.png")
  fig.savefig(png, dpi=80)
  ci = results["improvement"]
  rows = "".join(f"<tr><td>{s['seed']}</td><td>{s['sft_pass@1']:.3f}</td>"
                 f"<td>{s['rl_pass@1']:.3f}</td><td>{s['minutes']:.1f}</td></tr>"
                 for s in results["seeds"])
  html = (f"<html><head><title>Arbor demo</title></head><body><h1>Arbor demo</h1>"
          f"<p>Held-out greedy pass@1 on {results['tasks']} generated tasks, SFT vs RL "
          f"checkpoint.</p><table border=1><tr><th>seed</th><th>SFT pass@1</th>"
          f"<th>RL pass@1</th><th>minutes</th></tr>{rows}</table>"
          f"<p>Mean improvement {ci['diff']:+.3f}, paired bootstrap 95% interval "
          f"[{ci['low']:+.3f}, {ci['high']:+.3f}] (tasks resampled within each seed).</p>"
          f"<img src='demo_report.png'></body></html>")
  path = os.path.join(workdir, "demo_report.html")
  with open(path, "w") as f:
    f.write(html)
  return path
