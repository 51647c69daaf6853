"""Teacher rollouts and rejection sampling: a teacher's verified agent episodes as SFT data, and
rejection-sampling fine-tuning (RFT) rounds.

Size: sampling, selection, SFT records, RFT rounds and the command line share this module;
they are the four modules of its split.

    python -m trainer.rejection --ckpt /runs/sft --generated 150 --attempts 4 \\
        --temperature 1.0 --out /data/teacher.jsonl
    python -m trainer.rejection --ckpt /runs/sft --generated 64 --rounds 2 \\
        --sft_config configs/sft_demo.py --out /runs/rft            # RFT, 64 tasks a round
    python -m trainer.rejection --url http://127.0.0.1:8000/v1 --model qwen \\
        --tokenizer /ckpt/Qwen2.5-Coder-7B-Instruct/hf_extra --chat_format qwen2.5 \\
        --tasks tasks.jsonl --attempts 8 --out /data/teacher.jsonl --format chat
    python -m trainer.rejection --ckpt /runs/sft --generated 150 --attempts 4 \\
        --scaffold react:0.5,mini-swe-agent:0.5 --sandbox bwrap --out /data/teacher.jsonl

    attempts = sample(policy, chat, tasks, scaffold=ScaffoldConfig(...), attempts=4, seed=0,
                      scaffolds="react:0.5,mini-swe-agent:0.5")   # an engine teacher's policy
    kept, stats = select(tasks, attempts, FilterConfig(threshold=1.0, max_per_task=2))
    write_sft("teacher.jsonl", kept)          # configs/sft.py: data.sources=("teacher.jsonl",)

Sampling. Every attempt is a real episode (`envs.episode.make_react_episode`'s setup: the react
scaffold with the default tools in a fresh sandbox holding the task's repository, then the
task's verifier in another fresh sandbox gives the reward). Attempt j of a task samples with
`attempt_seed(seed, task_id, j)`, so a rerun draws the same prompts and sampling seeds (an
engine teacher then reproduces its episodes; a remote server does when it honours `seed`).
The teacher is any `envs.policy.Policy`: an Arbor checkpoint through the in-process engine
(`engine_teacher`), or an OpenAI-compatible server through `envs.policy.CompletionsPolicy`.

Scaffolds (`scaffolds`, command line --scaffold MIX: "react", a black-box CLI of
`envs.scaffolds`, or a weighted mix "react:0.5,mini-swe-agent:0.5"): each task's attempts run
the scaffold drawn for it exactly as `trainer.rollouts.Rollouts` draws it
(`trainer.blackbox.draw_scaffold` with the run's seed; a task row's own "scaffold" wins).
React attempts are the episodes above; black-box attempts are
`trainer.blackbox.blackbox_episode`s whose CLI calls the teacher through a loopback
`trainer.blackbox.Gateway` over the teacher's engine (started on the first such attempt; the
session's exact ids are the trajectory). Every attempt records metadata["scaffold"]. Black-box
scaffolds need an engine teacher (--ckpt, or --rounds RFT): an external --url server is refused
(its ids do not come back through our gateway); they need a bwrap or docker sandbox; and they
write "trajectory" records only: a CLI's session is several calls that need not extend one
another, not one renderable transcript, so --format chat is refused. Black-box attempts are
reproducible only at temperature 0 (the CLI's own sampling seed is not controlled).

Filtering (`select`, `FilterConfig`). An attempt is verified when its reward >= `threshold`
(and, with an LLM judge, when the judge's rubric score >= `judge_threshold`, `judge`).
Verified attempts whose tool calls failed on the way (calls with meta["tool_error"]) are kept
with those turns in context and out of the loss (error-masked SFT, trainer.sft_data), or
dropped with `tool_errors="drop"`. Deduplication: attempts of a task whose assistant token
sequences (every call's output ids) are identical are one; then at most `max_per_task` are kept
per task, the shortest first (fewest agent turns, then fewest sampled tokens, then attempt
order): shorter solutions are the cleaner demonstrations and keep a task from dominating.

Output (`write_sft`). "trajectory" records (`Trajectory.to_dict()`, trained on the teacher's
own token ids, never re-tokenized) when the teacher's tokenizer is the student's; "chat"
records (OpenAI-style messages with tool_error flags, rendered by the student's chat format)
otherwise. A chat record re-renders the transcript, so a sampled turn that is not the chat
format's own rendering of its parsed message (a malformed tool call, a reply cut at
max_new_tokens) comes back as other tokens: on the demo teacher at temperature 1, 18 of 20
episodes rendered back to exactly their sampled ids. Files: .jsonl, or .parquet (calls /
messages as JSON-string columns); `configs/sft.py`'s `data.sources` reads both. Stats
(`select`): tasks, attempts, errors, verified share, per-task pass rate, kept before and after
deduplication, kept tokens, and per scaffold ("scaffolds") its attempts, verified and kept.

RFT (`rft`): rounds of sample (the current checkpoint as teacher, fresh tasks each round) ->
select -> SFT (`trainer.sft.run` on the round's kept data, data.num_epochs passes: one by
default, so no kept trajectory is trained twice within a round) -> the next round samples from
that round's checkpoint. Command line: --rounds R --sft_config FILE[:ARG] (e.g.
configs/sft_demo.py); --out is then the RFT run's directory.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import importlib.util
import json
import logging
import math
import os
import sys
import time
from typing import Any, Optional, Sequence

import ml_collections
import numpy as np

from envs import aio, taskgen
from envs.chat import load_chat, load_tokenizer, make_chat
from envs.chat.formats import ChatFormat
from envs.episode import (episode_metadata, load_task_file, make_sandbox_factory, make_verifier,
                          start_sandbox)
from envs.policy import CompletionsPolicy, Policy
from envs.scaffold import ScaffoldConfig, run_episode
from envs.scaffolds import registry as scaffold_registry
from envs.tasks import Task
from envs.tools import default_tools
from envs.trajectory import Trajectory
from envs.verifiers.judge import transcript, verify_judge
from envs.verifiers.cache import VerdictCache
from models.engine import Engine, EngineConfig
from trainer import blackbox
from trainer import config as config_lib
from trainer import harness, metrics, sft
from trainer.data import make_sft_dataset
from trainer.demo_data import chat_record
from trainer.serve import EnginePolicy
from trainer.sft_data import as_dict, write_jsonl

log = logging.getLogger(__name__)

FORMATS = ("trajectory", "chat")
TOOL_ERRORS = ("keep", "drop")
# The judge's rubric for agent transcripts (envs.verifiers.judge scores it 0-10 per dimension).
DEFAULT_RUBRIC = (
    {"name": "correctness", "weight": 2.0,
     "description": "the agent's changes fix what the task asks, nothing else is broken"},
    {"name": "process", "weight": 1.0,
     "description": "each step is purposeful: no needless, repeated or wrong actions"})


# ----------------------------------------------------------------------------- sampling


def attempt_seed(seed: int, task_id: str, attempt: int) -> int:
  """The episode seed of attempt `attempt` of task `task_id` (a hash: independent of the rest).

  Args:
    seed: the run's seed.
    task_id: the task's instance_id.
    attempt: the attempt's index.

  Returns:
    A seed in [0, 2**32).
  """
  digest = hashlib.sha256(f"arbor-rejection/{seed}/{task_id}/{attempt}".encode()).digest()
  return int.from_bytes(digest[:4], "little")


def teacher_episode(policy: Policy, chat: ChatFormat, make_sandbox, scaffold: ScaffoldConfig,
                    verdict_cache: Optional[VerdictCache] = None):
  """`envs.episode.make_react_episode`'s episode, also keeping the transcript for chat records.

  Args:
    policy: the teacher.
    chat: renders the episodes.
    make_sandbox: the sandboxes (`envs.episode.make_sandbox_factory`).
    scaffold: the episodes' limits and sampling.
    verdict_cache: grade each distinct submission once (`envs.verifiers.cache`); None: every
      one.

  Returns:
    `async episode(task, seed, attempt) -> Trajectory` with metadata "verdict", "prompt",
    "attempt", "messages" and "tools" (the transcript and tool schemas, as
    `trainer.demo_data.chat_record` reads them).
  """
  score = make_verifier(chat, make_sandbox, policy, verdict_cache=verdict_cache)

  async def episode(task: Task, seed: int, attempt: int) -> Trajectory:
    prompt = task.prompt(np.random.default_rng(seed))
    tools = default_tools(task.test_command or None)
    sandbox = await start_sandbox(task, make_sandbox)
    try:
      result = await run_episode(policy, sandbox, prompt, tools, chat,
                                 dataclasses.replace(scaffold, seed=seed))
      reward, details = await score(task, sandbox, result)
    finally:
      await sandbox.close()
    meta = episode_metadata(details, prompt, {
        "attempt": attempt, "seed": seed, "messages": result.messages,
        "tools": [t.schema() for t in tools]})
    return result.to_trajectory(reward, task.instance_id, task.instance_id, metadata=meta)
  return episode


def blackbox_scaffolds(scaffolds: str, tasks: Sequence[Task] = (), seed: int = 0,
                       field: str = "scaffolds") -> list[str]:
  """The black-box scaffolds a run's tasks draw (the mix's, or only the drawn ones with tasks).

  Args:
    scaffolds: the mix (`trainer.blackbox.parse_scaffold_mix`).
    tasks: the tasks (empty: every black-box scaffold the mix names).
    seed: the run's seed (the draw's).
    field: the option, for error messages.

  Returns:
    The black-box registry names, in order, each once.

  Raises:
    ValueError: a bad mix, or a task row naming an unknown scaffold.
  """
  mix = blackbox.parse_scaffold_mix(scaffolds, field)
  names = ([blackbox.draw_scaffold(mix, t, seed) for t in tasks] if tasks else
           [n for n, _ in mix])
  return list(dict.fromkeys(scaffold_registry.get(n).name for n in names
                            if not scaffold_registry.get(n).host_side))


def sample(policy: Policy, chat: ChatFormat, tasks: Sequence[Task], *,
           scaffold: ScaffoldConfig, attempts: int = 4, seed: int = 0, sandbox: str = "bwrap",
           concurrency: int = 8, limits=None, progress: bool = True, scaffolds: str = "react",
           engine=None, served_name: str = "arbor") -> list[list[Any]]:
  """Runs `attempts` verified episodes of the teacher on each task (see the module docstring).

  Args:
    policy: the teacher (`engine_teacher`, `envs.policy.CompletionsPolicy`, ...).
    chat: the teacher's chat format.
    tasks: the tasks [T].
    scaffold: the episodes' limits and sampling (temperature included).
    attempts: episodes per task (>= 1).
    seed: the run's seed (`attempt_seed`).
    sandbox: the sandbox backend (envs.sandbox.BACKENDS; "local" only for scripted tests).
    concurrency: episodes at once (>= 1).
    limits: the sandboxes' resource limits (None: the backend's defaults).
    progress: a log line per tenth of the episodes.
    scaffolds: the scaffold mix, drawn per task with `seed` (see the module docstring).
    engine: the teacher's generation engine, behind the black-box scaffolds' gateway (None:
      `policy.engine` when the policy has one, e.g. `engine_teacher`'s); left running.
    served_name: the model name black-box scaffolds are told.

  Returns:
    [T][attempts]: each attempt's Trajectory (metadata["scaffold"] set), or the exception its
    episode raised.

  Raises:
    ValueError: attempts or concurrency < 1, no tasks, a bad mix, or a task drawing a black-box
      scaffold without an engine or with a sandbox other than bwrap / docker.
  """
  if attempts < 1:
    raise ValueError(f"attempts={attempts!r}: expected an integer >= 1")
  if concurrency < 1:
    raise ValueError(f"concurrency={concurrency!r}: expected an integer >= 1")
  if not tasks:
    raise ValueError("tasks: no task to sample")
  boxed = blackbox_scaffolds(scaffolds, tasks, seed)
  engine = engine if engine is not None else getattr(policy, "engine", None)
  if boxed and engine is None:
    raise ValueError(f"scaffolds={scaffolds!r}: tasks draw black-box scaffolds "
                     f"({', '.join(boxed)}) but the teacher has no in-process engine: their "
                     "calls go through Arbor's gateway over it (an external server, --url, "
                     "runs react only)")
  if boxed and sandbox not in blackbox.BLACKBOX_BACKENDS:
    raise ValueError(f"scaffolds={scaffolds!r}: tasks draw black-box scaffolds "
                     f"({', '.join(boxed)}) but sandbox={sandbox!r}: they run in one of "
                     f"{blackbox.BLACKBOX_BACKENDS}")
  make_sandbox = make_sandbox_factory(sandbox, limits=limits, allow_unsafe=sandbox == "local")
  verdicts = VerdictCache()  # a task's attempts that end alike share one test run
  teacher = teacher_episode(policy, chat, make_sandbox, scaffold, verdict_cache=verdicts)
  gateway = (blackbox.Gateway(engine, chat, served_name=served_name,
                              max_new_tokens=scaffold.max_new_tokens,
                              temperature=scaffold.temperature) if boxed else None)

  async def react(task: Task, index: int, seed_: int, *, group_id: str = "",
                  metadata=None) -> Trajectory:
    del group_id, metadata  # the teacher's episode: group_id = task id, its own metadata
    return await teacher(task, seed_, index)

  def episode_of(name: str):  # per registry entry, as trainer.rollouts.Rollouts
    if scaffold_registry.get(name).host_side:
      return react
    return blackbox.blackbox_episode(gateway, name, scaffold, backend=sandbox,
                                     verdict_cache=verdicts)
  episode = blackbox.mixed_episode(blackbox.parse_scaffold_mix(scaffolds, "scaffolds"), seed,
                                   episode_of)
  total, start = len(tasks) * attempts, time.monotonic()

  async def run_all():
    limiter = asyncio.Semaphore(concurrency)
    done = [0]

    async def one(task: Task, j: int):
      async with limiter:
        try:
          s = attempt_seed(seed, task.instance_id, j)
          return await episode(task, j, s, group_id=task.instance_id,
                               metadata={"attempt": j, "seed": s})
        except Exception as e:  # a failed episode is counted, not fatal
          log.warning("attempt %d of %s failed: %r", j, task.instance_id, e)
          return e
        finally:
          done[0] += 1
          if progress and done[0] % max(total // 10, 1) == 0:
            log.info("sampled %d/%d episodes (%.0fs)", done[0], total, time.monotonic() - start)
    flat = await asyncio.gather(*(one(t, j) for t in tasks for j in range(attempts)))
    return [list(flat[i * attempts:(i + 1) * attempts]) for i in range(len(tasks))]
  try:
    return aio.run(run_all())
  finally:
    if gateway is not None and gateway.server is not None:
      gateway.close()  # stops the server and the engine: the caller's engine runs on
      engine.start()


def engine_teacher(model, chat: ChatFormat, *, concurrency: int = 8, max_context_tokens: int = 4096,
                   seed: int = 0):
  """An Arbor model as a teacher: the in-process generation engine behind a Policy.

  Args:
    model: the model (e.g. `trainer.harness.initial_model` of a ckpt: config).
    chat: its chat format (the engine detokenizes stop strings with its tokenizer).
    concurrency: engine slots (= episodes decoded together).
    max_context_tokens: the longest episode (rows are rounded up to a multiple of 128).
    seed: the engine's seed (per-call seeds come from the episodes).

  Returns:
    A started `trainer.serve.EnginePolicy`; call `.engine.stop()` when done.
  """
  engine = Engine(model, EngineConfig(slots=concurrency, prefix_cache_rows=concurrency,
                                      max_seq_len=-(-max_context_tokens // 128) * 128,
                                      prefill_chunk=512, seed=seed),
                  detokenize=chat.tokenizer.decode)
  return EnginePolicy(engine)


# ----------------------------------------------------------------------------- judging


def judge(tasks: Sequence[Task], attempts: Sequence[Sequence[Any]], policy: Policy,
          chat: ChatFormat, rubric: Sequence[dict] = DEFAULT_RUBRIC, *,
          min_reward: float = 1.0, max_chars: int = 6000) -> None:
  """Scores the transcripts of the passing attempts on a rubric with an LLM judge.

  The judge sees the task's statement and the episode after its prompt (assistant turns and
  tool outputs, decoded, the last `max_chars` characters), graded by `envs.verifiers.judge`;
  the score (weighted mean of score / max, in [0, 1]) goes to metadata["judge_score"], the
  judge's replies to metadata["judge"].

  Args:
    tasks: the tasks [T].
    attempts: [T][n] trajectories (or exceptions, skipped), changed in place.
    policy: the judge (e.g. the teacher itself).
    chat: renders the judge's prompt and decodes its reply.
    rubric: the dimensions ({"name", "weight"?, "max"?, "description"?}).
    min_reward: only attempts with reward >= min_reward are judged (the others are rejected
      anyway).
    max_chars: the transcript's tail shown to the judge.
  """
  def render(text: str) -> list[int]:
    return chat.render([{"role": "user", "content": text}], add_generation_prompt=True).ids

  async def one(task: Task, t: Trajectory):
    graded = Task(instance_id=task.instance_id, kind="judge",
                  problem_statements=(task.problem_statement,), rubric=tuple(rubric))
    verdict = await verify_judge(graded, transcript(t, chat.tokenizer.decode, max_chars),
                                 policy, render, chat.tokenizer.decode)
    t.metadata["judge_score"] = float(verdict.reward)
    t.metadata["judge"] = verdict.details

  async def run_all():
    await asyncio.gather(*(one(task, t) for task, row in zip(tasks, attempts) for t in row
                           if isinstance(t, Trajectory) and t.reward >= min_reward))
  aio.run(run_all())


# ----------------------------------------------------------------------------- selection


@dataclasses.dataclass(frozen=True)
class FilterConfig:
  """Which attempts become SFT data (see the module docstring).

  Raises:
    ValueError: a bad field (named).
  """

  threshold: float = 1.0                  # verified: reward >= threshold
  judge_threshold: Optional[float] = None  # and metadata["judge_score"] >= this (None: no judge)
  tool_errors: str = "keep"               # verified attempts with failed tool calls: keep | drop
  max_per_task: int = 2                   # kept per task after deduplication (shortest first)

  def __post_init__(self):
    if not math.isfinite(self.threshold):
      raise ValueError(f"FilterConfig.threshold={self.threshold!r}: expected a finite number")
    if self.judge_threshold is not None and not 0.0 <= self.judge_threshold <= 1.0:
      raise ValueError(f"FilterConfig.judge_threshold={self.judge_threshold!r}: expected None "
                       "or a score in [0, 1]")
    if self.tool_errors not in TOOL_ERRORS:
      raise ValueError(f"FilterConfig.tool_errors={self.tool_errors!r}: expected one of "
                       f"{TOOL_ERRORS}")
    if not isinstance(self.max_per_task, int) or self.max_per_task < 1:
      raise ValueError(f"FilterConfig.max_per_task={self.max_per_task!r}: expected an integer "
                       ">= 1")


def verified(t: Any, cfg: FilterConfig) -> bool:
  """Whether an attempt passes the filter (before deduplication).

  Args:
    t: a Trajectory (anything else, e.g. an exception, fails).
    cfg: the filter.

  Returns:
    reward >= threshold, and the judge's score >= judge_threshold when set (an unjudged attempt
    fails then), and no failed tool call when tool_errors is "drop".

  Raises:
    ValueError: judge_threshold is set and a passing attempt carries no judge_score.
  """
  if not isinstance(t, Trajectory) or not t.calls or t.reward < cfg.threshold:
    return False
  if cfg.judge_threshold is not None:
    if "judge_score" not in t.metadata:
      raise ValueError(f"FilterConfig.judge_threshold={cfg.judge_threshold}: attempt of "
                       f"{t.task_id} was not judged (run `judge` first)")
    if t.metadata["judge_score"] < cfg.judge_threshold:
      return False
  return not (cfg.tool_errors == "drop" and any(c.meta.get("tool_error") for c in t.calls))


def dedup_key(t: Trajectory) -> str:
  """sha256 of the attempt's assistant token sequences (every call's output ids, in order)."""
  return hashlib.sha256(json.dumps([list(map(int, c.output_ids)) for c in t.calls]).encode()
                        ).hexdigest()


def sampled_tokens(t: Trajectory) -> int:
  """Tokens the attempt sampled (summed over its calls)."""
  return sum(len(c.output_ids) for c in t.calls)


def _turns(t: Trajectory) -> int:
  return int(t.metadata.get("num_turns", len(t.calls)))


def select(tasks: Sequence[Task], attempts: Sequence[Sequence[Any]], cfg: FilterConfig
           ) -> tuple[list[Trajectory], dict]:
  """Filters, deduplicates and caps the attempts of each task (see the module docstring).

  Args:
    tasks: the tasks [T].
    attempts: [T][n] Trajectory or exception (as `sample` returns).
    cfg: the filter.

  Returns:
    (kept trajectories, in task order, the shortest first within a task; stats {"tasks",
    "attempts", "errors", "verified", "verified_share", "tasks_with_verified",
    "pass_rate_per_task" {task_id: share}, "kept_before_dedup", "kept_after_dedup", "kept",
    "kept_tokens" (sampled), "kept_context_tokens" (each kept episode's final context),
    "mean_reward", "scaffolds" {scaffold: {"attempts", "verified", "kept"}} over the
    trajectories recording metadata["scaffold"]}).

  Raises:
    ValueError: tasks and attempts differ in length.
  """
  if len(tasks) != len(attempts):
    raise ValueError(f"select: {len(tasks)} tasks but {len(attempts)} attempt lists")
  kept: list[Trajectory] = []
  per_task: dict[str, float] = {}
  n = errors = passed = before = unique = 0
  rewards = []
  for task, row in zip(tasks, attempts):
    n += len(row)
    errors += sum(not isinstance(t, Trajectory) for t in row)
    rewards += [t.reward if isinstance(t, Trajectory) else 0.0 for t in row]
    ok = [t for t in row if verified(t, cfg)]
    per_task[task.instance_id] = sum(isinstance(t, Trajectory) and t.reward >= cfg.threshold
                                     for t in row) / max(len(row), 1)
    passed += sum(isinstance(t, Trajectory) and t.reward >= cfg.threshold for t in row)
    before += len(ok)
    ok.sort(key=lambda t: (_turns(t), sampled_tokens(t), t.metadata.get("attempt", 0)))
    seen, distinct = set(), []
    for t in ok:
      key = dedup_key(t)
      if key not in seen:
        seen.add(key)
        distinct.append(t)
    unique += len(distinct)
    kept += distinct[:cfg.max_per_task]
  by_scaffold: dict[str, dict[str, int]] = {}
  for row in attempts:
    for t in row:
      name = blackbox.scaffold_of(t)
      if name is not None:
        counts = by_scaffold.setdefault(name, {"attempts": 0, "verified": 0, "kept": 0})
        counts["attempts"] += 1
        counts["verified"] += int(t.reward >= cfg.threshold)
  for t in kept:
    name = blackbox.scaffold_of(t)
    if name is not None:
      by_scaffold[name]["kept"] += 1
  stats = {"tasks": len(tasks), "attempts": n, "errors": errors, "verified": passed,
           "verified_share": passed / max(n, 1),
           "tasks_with_verified": sum(v > 0 for v in per_task.values()),
           "pass_rate_per_task": per_task, "kept_before_dedup": before,
           "kept_after_dedup": unique, "kept": len(kept),
           "kept_tokens": sum(sampled_tokens(t) for t in kept),
           "kept_context_tokens": sum(len(t.calls[-1].input_ids) + len(t.calls[-1].output_ids)
                                      for t in kept),
           "mean_reward": float(np.mean(rewards)) if rewards else 0.0,
           "scaffolds": by_scaffold}
  return kept, stats


# ----------------------------------------------------------------------------- output


def sft_record(t: Trajectory, fmt: str = "trajectory") -> dict:
  """One kept attempt as an SFT record (trainer.sft_data).

  Args:
    t: the attempt (from `sample`: metadata "messages" and "tools" for chat records).
    fmt: "trajectory" (the teacher's token ids) or "chat" (messages, for another tokenizer).

  Returns:
    The record; a trajectory record drops the transcript from its metadata (the ids are the
    record) and the calls' expert ids (routing replay is RL's; SFT routes afresh), and keeps
    task_id as group_id; a chat record has "group" = the task id.

  Raises:
    ValueError: an unknown format, or a chat record of an attempt without a transcript, with
      context-management calls (their turns do not map one to one onto messages) or of a
      black-box scaffold (its session is not one transcript).
  """
  if fmt == "trajectory":
    d = as_dict(t)
    d["metadata"] = {k: v for k, v in d["metadata"].items() if k not in ("messages", "tools")}
    d["calls"] = [{**c, "expert_ids": None} for c in d["calls"]]
    return d
  if fmt != "chat":
    raise ValueError(f"format={fmt!r}: expected one of {FORMATS}")
  name = blackbox.scaffold_of(t)
  if name is not None and not scaffold_registry.get(name).host_side:
    raise ValueError(f"attempt of {t.task_id} ran the black-box scaffold {name!r}: its session "
                     "is not one renderable transcript; write format='trajectory' records")
  if "messages" not in t.metadata or any(c.meta.get("summary") for c in t.calls):
    raise ValueError(f"attempt of {t.task_id}: a chat record needs the episode's transcript "
                     "and no summary calls")
  record = chat_record(t)
  record["group"] = t.task_id
  return record


def write_sft(path: str, kept: Sequence[Trajectory], fmt: str = "trajectory") -> int:
  """Writes the kept attempts as an SFT file (`configs/sft.py` data.sources reads it).

  Args:
    path: a .jsonl or .parquet file (written atomically).
    kept: the attempts.
    fmt: "trajectory" or "chat" (`sft_record`).

  Returns:
    The number of records written.

  Raises:
    ValueError: an unknown extension or format.
  """
  records = [sft_record(t, fmt) for t in kept]
  if path.endswith(".jsonl"):
    write_jsonl(path, records)
  elif path.endswith(".parquet"):
    import pyarrow as pa
    import pyarrow.parquet as pq
    nested = ("calls", "messages", "tools", "metadata")  # JSON strings keep their text exact
    columns = sorted({k for r in records for k in r})
    table = pa.table({k: [json.dumps(r.get(k)) if k in nested else r.get(k) for r in records]
                      for k in columns})
    pq.write_table(table, path + ".tmp")
    os.replace(path + ".tmp", path)
  else:
    raise ValueError(f"out={path!r}: expected a .jsonl or .parquet file")
  return len(records)


def summary_line(stats: dict) -> str:
  """One human line of `select`'s stats."""
  return (f"{stats['tasks']} tasks x attempts = {stats['attempts']} episodes "
          f"({stats['errors']} errors); verified {stats['verified']} "
          f"({stats['verified_share']:.1%}), {stats['tasks_with_verified']} tasks with one; "
          f"kept {stats['kept_before_dedup']} -> {stats['kept_after_dedup']} after dedup -> "
          f"{stats['kept']} (max per task); {stats['kept_tokens']} sampled tokens kept")


# ----------------------------------------------------------------------------- checkpoints


def load_checkpoint(ckpt_dir: str):
  """An Arbor run's latest checkpoint with its chat format.

  Args:
    ckpt_dir: the run's workdir (config.json, model_config.json, checkpoints/, tokenizer/).

  Returns:
    (model, model_cfg, chat, config): the run's config with model.init = "ckpt:<dir>" and its
    own tokenizer (tokenizer/ of the run when it trained one).

  Raises:
    ValueError: the directory has no config.json.
  """
  path = os.path.join(ckpt_dir, "config.json")
  if not os.path.isfile(path):
    raise ValueError(f"ckpt={ckpt_dir!r}: no config.json (expected an Arbor run's workdir)")
  with open(path) as f:
    cfg = ml_collections.ConfigDict(json.load(f))
  cfg.model.init, cfg.model.preset = f"ckpt:{ckpt_dir}", ""
  own = os.path.join(ckpt_dir, "tokenizer")
  if os.path.isdir(own):
    cfg.tokenizer.path, cfg.tokenizer.train_vocab_size = own, 0
  model_cfg = config_lib.model_config(cfg)
  model = harness.initial_model(cfg, model_cfg)
  chat = config_lib.make_chat_format(cfg, config_lib.tokenizer_source(cfg, ckpt_dir))
  return model, model_cfg, chat, cfg


def run_checkpoint(ckpt_dir: str, tasks: Sequence[Task], *, scaffold: ScaffoldConfig,
                   attempts: int, seed: int, filter_cfg: FilterConfig, out: str,
                   fmt: str = "trajectory", sandbox: str = "bwrap", concurrency: int = 8,
                   judge_rubric: Optional[Sequence[dict]] = None, scaffolds: str = "react"
                   ) -> dict:
  """Rejection sampling with an Arbor checkpoint as the teacher, written to `out`.

  Args:
    ckpt_dir: the teacher's run directory (`load_checkpoint`).
    tasks: the tasks.
    scaffold: the episodes (temperature included).
    attempts: episodes per task.
    seed: the run's seed.
    filter_cfg: the filter.
    out: the SFT file (.jsonl / .parquet); its stats go to `out` + ".stats.json".
    fmt: "trajectory" or "chat".
    sandbox: the sandbox backend.
    concurrency: episodes at once.
    judge_rubric: with filter_cfg.judge_threshold, the judge's rubric (the teacher judges).
    scaffolds: the scaffold mix (black-box scaffolds through a gateway over the teacher's
      engine; format "trajectory" only).

  Returns:
    The stats (`select`) with "time_s", "teacher", "out" and "scaffold_mix".
  """
  _check_format(scaffolds, tasks, seed, fmt)
  model, _, chat, _ = load_checkpoint(ckpt_dir)
  policy = engine_teacher(model, chat, concurrency=concurrency,
                          max_context_tokens=scaffold.max_context_tokens, seed=seed)
  try:
    return _sample_select_write(policy, chat, tasks, scaffold=scaffold, attempts=attempts,
                                seed=seed, filter_cfg=filter_cfg, out=out, fmt=fmt,
                                sandbox=sandbox, concurrency=concurrency,
                                judge_rubric=judge_rubric, teacher=f"ckpt:{ckpt_dir}",
                                scaffolds=scaffolds)
  finally:
    policy.engine.stop()


def _check_format(scaffolds: str, tasks: Sequence[Task], seed: int, fmt: str) -> None:
  """ValueError when chat records are asked of tasks that draw black-box scaffolds."""
  boxed = blackbox_scaffolds(scaffolds, tasks, seed)
  if fmt == "chat" and boxed:
    raise ValueError(f"format='chat' (--format chat) with scaffolds={scaffolds!r}: tasks draw "
                     f"black-box scaffolds ({', '.join(boxed)}), whose sessions are not one "
                     "renderable transcript; use --format trajectory")


def _sample_select_write(policy, chat, tasks, *, scaffold, attempts, seed, filter_cfg, out, fmt,
                         sandbox, concurrency, judge_rubric, teacher, scaffolds="react") -> dict:
  _check_format(scaffolds, tasks, seed, fmt)
  t0 = time.monotonic()
  results = sample(policy, chat, tasks, scaffold=scaffold, attempts=attempts, seed=seed,
                   sandbox=sandbox, concurrency=concurrency, scaffolds=scaffolds)
  if filter_cfg.judge_threshold is not None:
    judge(tasks, results, policy, chat, judge_rubric or DEFAULT_RUBRIC,
          min_reward=filter_cfg.threshold)
  kept, stats = select(tasks, results, filter_cfg)
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  write_sft(out, kept, fmt)
  stats.update(time_s=time.monotonic() - t0, teacher=teacher, out=out, format=fmt,
               temperature=scaffold.temperature, seed=seed, scaffold_mix=scaffolds)
  with open(out + ".stats.json", "w") as f:
    json.dump(stats, f, indent=1)
  return stats


# ----------------------------------------------------------------------------- RFT


def latest_step(run_dir: str) -> Optional[int]:
  """The latest checkpoint step of an Arbor run (checkpoints/<step>/), None without one."""
  path = os.path.join(run_dir, "checkpoints")
  steps = [int(d) for d in os.listdir(path) if d.isdigit()] if os.path.isdir(path) else []
  return max(steps, default=None)


def sft_steps(config: ml_collections.ConfigDict, source: str, chat: ChatFormat) -> int:
  """The training steps of an SFT run on `source` (every record rendered and packed once).

  Args:
    config: the SFT config (its packing and data.num_epochs).
    source: the SFT file.
    chat: renders the records.

  Returns:
    The number of batches data.num_epochs passes give.
  """
  return sum(1 for _ in make_sft_dataset(config_lib.data_config(config, sources=(source,)),
                                         chat))


def round_sft_config(config: ml_collections.ConfigDict, init_dir: str, source: str,
                     steps: int) -> ml_collections.ConfigDict:
  """The SFT run of one round: `config` from `init_dir`'s checkpoint on `source`.

  Args:
    config: an SFT config (e.g. configs/sft_demo.py's); its optimizer and packing are kept.
    init_dir: the run whose latest checkpoint (and tokenizer/, when it has one) it starts from.
    source: the round's SFT file.
    steps: train.steps = optimizer.total_steps (warmup at most half of them).

  Returns:
    The config: no demo data, no held-out data, one epoch unless the config says more.
  """
  c = ml_collections.ConfigDict(config.to_dict())
  c.mode = "sft"
  c.model.init, c.model.preset = f"ckpt:{init_dir}", ""
  own = os.path.join(init_dir, "tokenizer")
  if os.path.isdir(own):
    c.tokenizer.path = own
  c.tokenizer.train_vocab_size = 0
  c.data.sources, c.data.eval_sources = (source,), ()
  c.data.demo.episodes = c.data.demo.eval_episodes = 0
  c.data.num_epochs = c.data.num_epochs or 1
  c.train.steps = c.optimizer.total_steps = steps
  c.optimizer.warmup_steps = min(c.optimizer.warmup_steps, steps // 2)
  c.train.checkpoint_every = steps
  c.train.eval_every = 0
  c.metrics.progress = False
  c.metrics.report = False
  return c


def rft(config: ml_collections.ConfigDict, workdir: str, *, init_dir: str, rounds: int,
        tasks_per_round: int, attempts: int = 4, scaffold: ScaffoldConfig,
        filter_cfg: FilterConfig = FilterConfig(), task_level: int = 0, task_seed: int = 1,
        task_start: int = 0, seed: int = 0, sandbox: str = "bwrap", concurrency: int = 8,
        scaffolds: str = "react") -> list[dict]:
  """Rejection-sampling fine-tuning: `rounds` rounds of sample -> select -> SFT.

  Round r (1-based) samples `attempts` episodes on each of `tasks_per_round` fresh generated
  tasks (envs.taskgen "train" split, positions task_start + (r-1)·T ...) with the latest
  checkpoint of round r-1 (round 1: `init_dir`) as teacher, keeps the verified ones
  (`select`), and runs `trainer.sft.run` from that checkpoint on them (`round_sft_config`:
  `config`'s optimizer and packing, data.num_epochs passes; steps = the batches of that many
  passes). Layout: <workdir>/round_<r>/{tasks/, data.jsonl, data.jsonl.stats.json, sft/,
  round.json}; a finished round (round.json) is reused. A round that keeps nothing trains
  nothing and the next round samples from the same checkpoint.

  Args:
    config: the SFT config of every round (e.g. configs/sft_demo.py).
    workdir: the RFT run's directory.
    init_dir: the first teacher's run directory.
    rounds: the number of rounds (>= 1).
    tasks_per_round: fresh tasks per round (>= 1).
    attempts: episodes per task.
    scaffold: the episodes (temperature included).
    filter_cfg: the filter.
    task_level: taskgen level.
    task_seed: taskgen seed (the demo's RL tasks: 1).
    task_start: the first round's first task position in the "train" split.
    seed: the run's seed (each round samples with seed + r).
    sandbox: the sandbox backend.
    concurrency: episodes at once.
    scaffolds: the scaffold mix of every round's sampling (drawn per task with the round's
      seed; see the module docstring).

  Returns:
    One dict per round: the stats, "teacher" (the sampled run dir), "teacher_step" (its
    checkpoint step), "sft_dir" (None when nothing was kept), "steps", "trajectory_ids" (per
    step, the trained trajectories' ids, from the SFT metrics).

  Raises:
    ValueError: rounds or tasks_per_round < 1.
  """
  if rounds < 1 or tasks_per_round < 1:
    raise ValueError(f"rounds={rounds!r}, tasks_per_round={tasks_per_round!r}: expected >= 1")
  teacher, out = init_dir, []
  for r in range(1, rounds + 1):
    rdir = os.path.join(workdir, f"round_{r}")
    done = os.path.join(rdir, "round.json")
    if os.path.isfile(done):
      with open(done) as f:
        info = json.load(f)
    else:
      os.makedirs(rdir, exist_ok=True)
      tasks = taskgen.write_tasks(os.path.join(rdir, "tasks"), tasks_per_round, task_level,
                                  task_seed, task_start + (r - 1) * tasks_per_round,
                                  split="train")
      data = os.path.join(rdir, "data.jsonl")
      info = run_checkpoint(teacher, tasks, scaffold=scaffold, attempts=attempts, seed=seed + r,
                            filter_cfg=filter_cfg, out=data, sandbox=sandbox,
                            concurrency=concurrency, scaffolds=scaffolds)
      info.update(round=r, teacher=teacher, teacher_step=latest_step(teacher),
                  sft_dir=None, steps=0, trajectory_ids=[])
      metrics.say("rft", f"round {r}: teacher {teacher} (step {info['teacher_step']}): "
                  + summary_line(info))
      if info["kept"]:
        _, _, chat, _ = load_checkpoint(teacher)
        probe = round_sft_config(config, teacher, data, 1)
        steps = sft_steps(probe, data, chat)
        sft_dir = os.path.join(rdir, "sft")
        sft.run(round_sft_config(config, teacher, data, steps), sft_dir)
        lines = metrics.read_jsonl(os.path.join(sft_dir, "sft", metrics.JSONL))
        info.update(sft_dir=sft_dir, steps=steps,
                    trajectory_ids=[lines[s].get("trajectory_ids", []) for s in sorted(lines)])
      with open(done + ".tmp", "w") as f:
        json.dump(info, f, indent=1)
      os.replace(done + ".tmp", done)
    if info["sft_dir"]:
      teacher = info["sft_dir"]
    out.append(info)
  return out


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  """The command line of `python -m trainer.rejection` (None: sys.argv)."""
  p = argparse.ArgumentParser(prog="python -m trainer.rejection",
                              description=__doc__.split("\n")[0])
  teacher = p.add_mutually_exclusive_group(required=True)
  teacher.add_argument("--ckpt", help="an Arbor run directory: its latest checkpoint teaches")
  teacher.add_argument("--url", help="an OpenAI-compatible API root (e.g. http://host:8000/v1)")
  p.add_argument("--model", default="", help="the served model's name (with --url)")
  p.add_argument("--api_key_env", default="", help="environment variable holding the API key")
  p.add_argument("--tokenizer", default="", help="the teacher's tokenizer (with --url)")
  p.add_argument("--chat_format", default="", help="an envs.chat format (with --url; default: "
                 "the tokenizer's own chat template)")
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--tasks", help="a task file (JSONL / Parquet, envs.episode.load_task_file)")
  src.add_argument("--generated", type=int, help="N generated tasks (envs.taskgen train split)")
  p.add_argument("--task_level", type=int, default=0, help="taskgen level (--generated)")
  p.add_argument("--task_seed", type=int, default=1, help="taskgen seed (--generated)")
  p.add_argument("--task_start", type=int, default=0, help="first train-split position")
  p.add_argument("--attempts", type=int, default=4, help="episodes per task")
  p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
  p.add_argument("--top_p", type=float, default=1.0, help="nucleus mass")
  p.add_argument("--seed", type=int, default=0, help="the run's seed (attempt seeds)")
  p.add_argument("--max_turns", type=int, default=6, help="agent turns per episode")
  p.add_argument("--max_new_tokens", type=int, default=256, help="tokens per reply")
  p.add_argument("--max_context_tokens", type=int, default=2048, help="tokens per episode")
  p.add_argument("--timeout_s", type=float, default=120.0, help="seconds per episode")
  p.add_argument("--threshold", type=float, default=1.0, help="verified: reward >= this")
  p.add_argument("--judge_threshold", type=float, default=None,
                 help="also require the teacher-as-judge rubric score >= this (0-1)")
  p.add_argument("--tool_errors", default="keep", choices=TOOL_ERRORS,
                 help="verified attempts with failed tool calls: keep (masked) or drop")
  p.add_argument("--max_per_task", type=int, default=2, help="kept per task after dedup")
  p.add_argument("--format", default="trajectory", choices=FORMATS,
                 help="trajectory (same tokenizer as the student) or chat records")
  p.add_argument("--sandbox", default="bwrap", help="sandbox backend")
  p.add_argument("--scaffold", default=blackbox.DEFAULT,
                 help="the scaffold mix drawn per task: react, a black-box CLI (e.g. "
                 "mini-swe-agent) or react:0.5,mini-swe-agent:0.5 (black-box: --ckpt only, "
                 "bwrap / docker, --format trajectory)")
  p.add_argument("--concurrency", type=int, default=8, help="episodes at once")
  p.add_argument("--out", required=True, help="the SFT file (.jsonl or .parquet); with "
                 "--rounds: the RFT run's directory")
  p.add_argument("--rounds", type=int, default=0,
                 help="RFT: rounds of sample -> select -> SFT from --ckpt (0: sample once)")
  p.add_argument("--sft_config", default="configs/sft_demo.py",
                 help="RFT: the SFT config file[:ARG] of every round")
  return p.parse_args(argv)


def load_config_file(spec: str) -> ml_collections.ConfigDict:
  """`get_config(ARG)` of a config file "PATH[:ARG]" (ValueError naming a missing file)."""
  path, sep, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise ValueError(f"--sft_config={spec!r}: no such file {os.path.abspath(path)!r}")
  module_spec = importlib.util.spec_from_file_location("_arbor_rft_sft_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if sep else module.get_config()


def check_scaffold_args(args: argparse.Namespace) -> None:
  """ValueError naming --scaffold when its mix conflicts with the other options.

  Black-box scaffolds need the in-process engine of a --ckpt teacher (an external --url server's
  exact ids do not come back through Arbor's gateway), a bwrap or docker --sandbox, and
  --format trajectory (a session is not one renderable transcript).
  """
  try:
    boxed = blackbox_scaffolds(args.scaffold, field="scaffold")
  except ValueError as e:
    raise ValueError(f"--scaffold={args.scaffold!r}: {str(e).partition(': ')[2]}") from None
  if not boxed:
    return
  head = f"--scaffold={args.scaffold!r} runs black-box scaffolds ({', '.join(boxed)})"
  if args.url:
    raise ValueError(f"{head} but the teacher is --url={args.url!r}: black-box CLIs call the "
                     "teacher through Arbor's gateway over the in-process engine (exact token "
                     "ids); an external server runs --scaffold react only; use --ckpt")
  if args.format == "chat":
    raise ValueError(f"{head} with --format chat: a session is not one renderable transcript; "
                     "use --format trajectory")
  if args.sandbox not in blackbox.BLACKBOX_BACKENDS:
    raise ValueError(f"{head} with --sandbox={args.sandbox!r}: they run in one of "
                     f"{blackbox.BLACKBOX_BACKENDS}")


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs rejection sampling from the command line; prints the stats as JSON."""
  logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
  args = parse_args(argv)
  try:
    filter_cfg = FilterConfig(threshold=args.threshold, judge_threshold=args.judge_threshold,
                              tool_errors=args.tool_errors, max_per_task=args.max_per_task)
    if args.url and not (args.model and args.tokenizer):
      raise ValueError(f"--url={args.url!r} needs --model and --tokenizer (the teacher's)")
    if args.rounds < 0 or (args.rounds and not (args.ckpt and args.generated)):
      raise ValueError(f"--rounds={args.rounds}: RFT needs rounds >= 1, --ckpt (the first "
                       "teacher) and --generated (fresh tasks per round)")
    if not args.rounds and not (args.out.endswith(".jsonl") or args.out.endswith(".parquet")):
      raise ValueError(f"--out={args.out!r}: expected a .jsonl or .parquet file")
    check_scaffold_args(args)
    sft_config = load_config_file(args.sft_config) if args.rounds else None
  except ValueError as e:
    print(f"trainer.rejection: {e}", file=sys.stderr)
    return 2
  scaffold = ScaffoldConfig(max_turns=args.max_turns, max_new_tokens=args.max_new_tokens,
                            max_context_tokens=args.max_context_tokens, timeout_s=args.timeout_s,
                            temperature=args.temperature, top_p=args.top_p)
  if args.rounds:
    info = rft(sft_config, args.out, init_dir=args.ckpt, rounds=args.rounds,
               tasks_per_round=args.generated, attempts=args.attempts, scaffold=scaffold,
               filter_cfg=filter_cfg, task_level=args.task_level, task_seed=args.task_seed,
               task_start=args.task_start, seed=args.seed, sandbox=args.sandbox,
               concurrency=args.concurrency, scaffolds=args.scaffold)
    print(json.dumps([{k: v for k, v in i.items() if k not in ("pass_rate_per_task",
                                                                "trajectory_ids")}
                      for i in info], indent=1))
    return 0
  if args.tasks:
    tasks = load_task_file(args.tasks)[0]
  else:
      tasks = taskgen.write_tasks(args.out + ".tasks", args.generated, args.task_level,
                                args.task_seed, args.task_start, split="train")
  try:  # tasks whose rows name a black-box scaffold of their own
    boxed = blackbox_scaffolds(args.scaffold, tasks, args.seed)
    if boxed and args.url:
      raise ValueError(f"tasks name black-box scaffolds ({', '.join(boxed)}) but the teacher is "
                       f"--url={args.url!r}: only --scaffold react runs with an external server")
    _check_format(args.scaffold, tasks, args.seed, args.format)
  except ValueError as e:
    print(f"trainer.rejection: {e}", file=sys.stderr)
    return 2
  common = dict(scaffold=scaffold, attempts=args.attempts, seed=args.seed,
                filter_cfg=filter_cfg, out=args.out, fmt=args.format, sandbox=args.sandbox,
                concurrency=args.concurrency, scaffolds=args.scaffold)
  if args.ckpt:
    stats = run_checkpoint(args.ckpt, tasks, **common)
  else:
    tok = load_tokenizer(args.tokenizer)
    chat = (make_chat(args.chat_format, tok) if args.chat_format else
            load_chat(args.tokenizer, tok))
    key = os.environ.get(args.api_key_env) if args.api_key_env else None
    policy = CompletionsPolicy(args.url, args.model, api_key=key)
    stats = _sample_select_write(policy, chat, tasks, judge_rubric=None, teacher=args.url,
                                 **common)
  print(summary_line(stats), file=sys.stderr)
  print(json.dumps({k: v for k, v in stats.items() if k != "pass_rate_per_task"}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
