"""Tree rollouts: a task's group sampled as entropy-guided branching episodes (ARPO / AEPO).

    group_fn = make_branching_group(policy, chat, make_sandbox, scaffold, BranchConfig())
    trajectories = await group_fn(task, 8, draw=3, seed=0)   # 8 leaves of one tree

Independent sampling spends a group's budget of k episodes on k full trajectories that share
only the prompt. A branching group spends it where the policy is unsure: it starts m global
samples and, at tool-call steps whose first sampled tokens have high entropy, forks the episode
(the sandbox with `Sandbox.fork`, the token context as it was) into more paths that re-sample
that call, until the group has k leaves. Every leaf is an ordinary `Trajectory` whose calls
repeat its ancestors' calls verbatim, so the trainer's trajectory tree stores and trains the
shared calls once per tree (their gradient is summed over the paths through them) and the
engine's prefix cache serves the shared context instead of prefilling it again.

The rule (ARPO, Dong et al. arXiv 2507.19849, and its public rollout code; AEPO, arXiv
2510.14545 §4.1, which adds pre-monitoring and the consecutive-branch penalty):
  step entropy   H_t = the entropy of the call sampled after tool step t, over its first n =
                 `entropy_tokens` tokens; H_root = the same for the path's first call (the
                 question alone). `entropy_measure` picks how:
                   "nats"  the mean over the n tokens of the full next-token entropy in nats (the
                           engine's exact entropies; else the sampled tokens' -log p);
                   "arpo"  ARPO's: Σ_{j<n} -Σ_{i∈S_j} p_i·ln p_i / ln|V|, S_j = the k =
                           `entropy_top_k` most likely tokens at position j plus the sampled one
                           (an inference server's "logprobs=k" answer), |V| = the tokenizer's
                           vocabulary; a sum over the tokens, not a mean, as ARPO's code has it,
                           so H is in [0, n·ln(k+1)/ln|V|]. It needs the policy's top log-probs
                           (`Generation.top_logprobs`, EngineConfig.top_logprobs >= k).
  pre-monitoring m = round(k · σ(β · (H_root - mean_t H_t))) global samples, measured on the
                 first global sample (which runs alone and never branches), clipped to [1, k]
                 (AEPO); `premonitor=False` or a `global_fraction` instead starts m =
                 round(k · fraction) global samples at once (ARPO's initial rollouts; fraction
                 0.5 by default, ARPO's 8 of 16).
  branching      at each later tool step a path branches with probability
                 P_t = clip((α + γ · (H_t - H_root)) · (1 - penalty)^l, 0, 1), l = the branches
                 the path made at its immediately preceding steps (the consecutive-branch
                 penalty 1 - P̂(l) of AEPO, here geometric; penalty 0 is ARPO's rule); a branch
                 adds min(width - 1, budget left) paths that re-sample the step's call with their
                 own seeds. A new path keeps its parent's H_root, or with `reset_root` takes its
                 own first (re-sampled) call's entropy as H_root, as ARPO's code does.
  filling        a group that ends with budget left starts more global samples (which may
                 branch), so every group has exactly k leaves unless episodes fail.
α, γ and width default to ARPO's published values (0.5, 0.2, 2).

Where this departs from ARPO's / AEPO's code, and why:
  - The branch point. ARPO's code measures the entropy of the call that ends in a tool call
    and, when it branches, re-samples the call after that tool's result (the high-entropy call
    is shared by the branches). Here H_t is measured on the call sampled after tool result t
    and a branch re-samples that very call, as the paper describes it: the uncertain tokens
    are the ones explored again.
  - H_root per path. ARPO's code keeps the initial entropy per rollout slot index and never
    clears it between batches, so a slot compares later questions against the first question
    it ever saw; here each path of each group has its own.
  - One draw per branch point. ARPO's code draws once per extra branch (at most width - 1);
    here one draw adds width - 1 paths. The two agree at width 2, ARPO's default.
  - Budget order. ARPO's code hands a question's branch budget to its active paths in index
    order each round and adds one new global sample per round when none is active; here paths
    run concurrently, take the budget as they reach their branch points and the leftover
    budget starts global samples when every path has finished.
  - AEPO's consecutive-branch penalty P̂(l) and its pre-monitoring's exact inputs were not
    available offline: the geometric penalty and pre-monitoring on the first sample alone are
    ours (config fields; penalty 0 and premonitor=False give ARPO's rule).
  - The "nats" measure (the default: see below) is not ARPO's: it is the untruncated entropy,
    a mean per token and not normalised, so γ is in probability per nat; on the same logits it
    differs from the "arpo" value by a factor that depends on n, k and |V|.

The default measure is "nats". On the demo model (docs/benchmarks.md, "Entropy guidance")
neither measure guides branching: the mean entropy at branch points is 1.01x the mean over all
tool steps with "nats", 0.91x with "arpo" and 0.90x with ARPO's whole rule, because the step
entropies are so small (0.04 nats; 0.07 in ARPO's units) that γ·ΔH moves the branch probability
by about 0.01 either way and both measures grow almost the same trees. With no measure better,
"nats" stays: every policy that reports entropies (the engine always does) supports it, while
"arpo" needs the policy to return k top log-probs per token.

What a fork carries: the workspace files (see `Sandbox.fork`) and the episode's token context,
transcript and counters; not processes or shell state, which no tool relies on (each tool call
is a fresh process). Budget races between concurrent paths make the tree's shape depend on
timing; each path's sampling is reproducible from (seed, draw, path index).

Each trajectory's metadata["tree"] = {"parent": path it forked from (-1: a global sample),
"fork_turn": the turn it re-sampled (0 for a global sample), "depth": forks above it,
"branch_turns": turns at which it spawned branches, "global_samples": m, "h_root": its root
entropy}; every agent call's meta["entropy"] is its step entropy.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
from typing import Any, Optional

import numpy as np

from envs.chat.formats import ChatFormat
from envs.episode import (GroupFn, SandboxMaker, episode_metadata, episode_seed, make_verifier,
                          start_sandbox)
from envs.policy import Generation, Policy
from envs.sandbox import Sandbox, SandboxError
from envs.scaffold import EpisodeState, ScaffoldConfig, run_episode
from envs.tasks import Task
from envs.tools import default_tools
from envs.trajectory import LLMCall, Trajectory
from envs.verifiers.cache import VerdictCache

log = logging.getLogger(__name__)


ENTROPY_MEASURES = ("nats", "arpo")


@dataclasses.dataclass(frozen=True)
class BranchConfig:
  """Settings of entropy-guided branching, validated at construction.

  Raises:
    ValueError: naming the field whose value is out of range.
  """

  width: int = 2                 # Z: paths leaving a branch point (the path + width - 1 new)
  base_prob: float = 0.5         # α: branch probability of a step as uncertain as the root
  entropy_weight: float = 0.2    # γ: probability added per unit of step entropy above the root's
  consecutive_penalty: float = 0.5  # each consecutive branch scales the probability by 1 - this
  premonitor_beta: float = 1.0   # β: m = k·σ(β·(H_root - mean H_tool)) global samples
  global_fraction: Optional[float] = None  # fixed m = round(k·fraction) (None: pre-monitoring,
                                           # or 0.5 with premonitor off)
  entropy_tokens: int = 20       # a step's entropy: over the first tokens of its call
  # "nats": mean full entropy (nats) per token; "arpo": ARPO's, the sum over those tokens of
  # the entropy of their top-k log-probs (and the sampled token's) over ln(vocabulary size)
  entropy_measure: str = "nats"
  entropy_top_k: int = 10        # "arpo": log-probs per token (ARPO samples with logprobs=10)
  reset_root: bool = False       # a branch's H_root = its own first call's entropy (ARPO)
  premonitor: bool = True        # AEPO: the first global sample runs alone to set m; False:
                                 # the m global samples start at once (ARPO)

  def __post_init__(self):
    if not isinstance(self.width, int) or self.width < 2:
      raise ValueError(f"BranchConfig.width={self.width!r}: expected an integer >= 2")
    for name in ("entropy_tokens", "entropy_top_k"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"BranchConfig.{name}={value!r}: expected an integer >= 1")
    for name in ("base_prob", "consecutive_penalty"):
      if not 0.0 <= getattr(self, name) <= 1.0:
        raise ValueError(f"BranchConfig.{name}={getattr(self, name)!r}: expected a value in "
                         "[0, 1]")
    for name in ("entropy_weight", "premonitor_beta"):
      if not getattr(self, name) >= 0.0:
        raise ValueError(f"BranchConfig.{name}={getattr(self, name)!r}: expected >= 0")
    f = self.global_fraction
    if f is not None and not 0.0 < f <= 1.0:
      raise ValueError(f"BranchConfig.global_fraction={f!r}: expected None or a value in (0, 1]")
    if self.entropy_measure not in ENTROPY_MEASURES:
      raise ValueError(f"BranchConfig.entropy_measure={self.entropy_measure!r}: expected one of "
                       f"{ENTROPY_MEASURES}")
    for name in ("reset_root", "premonitor"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"BranchConfig.{name}={getattr(self, name)!r}: expected a bool")


# The settings a launcher sets on a command line: (flag, BranchConfig field, help).
_FLAGS = (("branch_width", "width", "paths leaving a branch point"),
          ("branch_base_prob", "base_prob", "branch probability of a step as uncertain as the "
           "root"),
          ("branch_entropy_weight", "entropy_weight", "probability added per unit of step "
           "entropy above the root's"),
          ("branch_consecutive_penalty", "consecutive_penalty", "each consecutive branch scales "
           "the probability by 1 - this"),
          ("branch_premonitor_beta", "premonitor_beta", "sensitivity of the global/branch split"),
          ("branch_global_fraction", "global_fraction", "fixed share of global samples (default: "
           "entropy pre-monitoring)"),
          ("branch_entropy_tokens", "entropy_tokens", "tokens whose entropy is a step's"),
          ("branch_entropy_measure", "entropy_measure", f"step entropy: one of {ENTROPY_MEASURES}"),
          ("branch_entropy_top_k", "entropy_top_k", "top log-probs per token of the 'arpo' "
           "entropy (the policy must report at least as many)"),
          ("branch_reset_root", "reset_root", "a branch measures its root entropy at its first "
           "call (true/false)"),
          ("branch_premonitor", "premonitor", "AEPO pre-monitoring: the first sample runs alone "
           "(true/false)"))


def _bool(text: str) -> bool:
  """A command-line boolean: true/false, 1/0, yes/no."""
  if text.lower() in ("true", "1", "yes"):
    return True
  if text.lower() in ("false", "0", "no"):
    return False
  raise argparse.ArgumentTypeError(f"{text!r}: expected true or false")


def add_branch_flags(parser: argparse.ArgumentParser) -> None:
  """Declares --branch_* flags for `BranchConfig`'s fields, with its defaults.

  Args:
    parser: gets one flag per entry of `_FLAGS` (--branch_width, --branch_base_prob, ...,
      --branch_entropy_measure, --branch_reset_root, --branch_premonitor).
  """
  defaults = BranchConfig()
  for flag, field, help_ in _FLAGS:
    value = getattr(defaults, field)
    kind = float if value is None else _bool if isinstance(value, bool) else type(value)
    parser.add_argument(f"--{flag}", type=kind, default=value, help=help_)


def branch_config_from_flags(args: argparse.Namespace) -> BranchConfig:
  """The `BranchConfig` of the flags declared by `add_branch_flags`."""
  return BranchConfig(**{field: getattr(args, flag) for flag, field, _ in _FLAGS})


def step_entropy(gen: Generation, n: int) -> float:
  """The "nats" entropy of a call's first `n` sampled tokens (nats, mean per token).

  Args:
    gen: the call's generation; its `entropies` when the policy reports them, else the sampled
      tokens' -log p (an unbiased estimate of the same mean).
    n: tokens averaged.

  Returns:
    The mean, 0.0 for an empty generation.
  """
  values = gen.entropies if gen.entropies else [-x for x in gen.logprobs]
  values = list(values)[:n]
  return float(np.mean(values)) if values else 0.0


def arpo_step_entropy(gen: Generation, n: int, k: int, vocab_size: int) -> float:
  """ARPO's step entropy of a call: Σ_{j<n} -Σ_{i∈S_j} p_i·ln p_i / ln|V|.

  S_j = the k most likely tokens at output position j plus the sampled one (what an inference
  server returns for "logprobs=k"); the sum runs over the call's first n tokens (fewer in a
  shorter call), as ARPO's rollout code sums them, not a mean.

  Args:
    gen: the call's generation, with `top_logprobs` (at least k pairs per token).
    n: tokens summed.
    k: top log-probs per token.
    vocab_size: |V|, the tokenizer's vocabulary (ARPO's normaliser).

  Returns:
    The normalised entropy, 0.0 for an empty generation.

  Raises:
    ValueError: the generation has no top log-probs, or fewer than k per token.
  """
  if gen.top_logprobs is None or len(gen.top_logprobs) < min(n, len(gen.output_ids)):
    raise ValueError("BranchConfig.entropy_measure='arpo' needs the policy's top log-probs per "
                     f"token (an engine with EngineConfig.top_logprobs >= {k})")
  total = 0.0
  for token, logprob, top in zip(gen.output_ids[:n], gen.logprobs, gen.top_logprobs):
    if len(top) < k:
      raise ValueError(f"BranchConfig.entropy_top_k={k}: the policy reports {len(top)} top "
                       "log-probs per token")
    chosen = dict(top[:k])
    chosen.setdefault(token, logprob)
    total -= sum(math.exp(x) * x for x in chosen.values() if x > -math.inf)  # p = 0 adds 0
  return total / math.log(vocab_size)


def global_samples(k: int, h_root: float, h_tool: float, beta: float) -> int:
  """AEPO's entropy pre-monitoring: global samples out of a budget of k.

  Args:
    k: the group's budget of trajectories.
    h_root: the entropy of the first call (the question alone).
    h_tool: the mean entropy of the calls after tool results.
    beta: sensitivity β.

  Returns:
    m = round(k · σ(β · (h_root - h_tool))) clipped to [1, k]: a question more uncertain than
    the tool results gets more independent samples, the opposite more branches.
  """
  m = k / (1.0 + math.exp(-beta * (h_root - h_tool)))
  return int(min(max(round(m), 1), k))


def branch_probability(h_step: float, h_root: float, consecutive: int,
                       config: BranchConfig) -> float:
  """The probability that a path branches at a tool step (see the module docstring).

  Args:
    h_step: the step's entropy H_t.
    h_root: the path's root entropy H_root.
    consecutive: branches the path made at its immediately preceding steps (l).
    config: α, γ and the penalty.

  Returns:
    clip((α + γ·(H_t - H_root)) · (1 - penalty)^l, 0, 1).
  """
  p = (config.base_prob + config.entropy_weight * (h_step - h_root)) * (
      (1.0 - config.consecutive_penalty) ** consecutive)
  return float(min(max(p, 0.0), 1.0))


@dataclasses.dataclass
class _Path:
  """One path of the tree while it runs."""

  index: int
  parent: int
  fork_turn: int
  depth: int
  prompt: str
  seed: int
  h_root: Optional[float] = None
  consecutive: int = 0
  branch_turns: list = dataclasses.field(default_factory=list)
  tool_entropies: list = dataclasses.field(default_factory=list)


class _Group:
  """The state of one branching group (see `make_branching_group`)."""

  def __init__(self, task, k, draw, seed, group_id, limiter, counters, env):
    self.task, self.k, self.draw, self.seed, self.group_id = task, k, draw, seed, group_id
    self.limiter, self.counters, self.env = limiter, counters, env
    self.used = 0             # budget in use: paths started or reserved
    self.next_index = 0       # path indices in order of creation
    self.branching = False    # pre-monitoring done: paths may branch
    self.m = k
    self.runs: list[asyncio.Future] = []
    self.wake = asyncio.Event()

  def count(self, name: str, n: int = 1) -> None:
    self.counters[name] = self.counters.get(name, 0) + n

  def new_path(self, parent: Optional[_Path], fork_turn: int) -> _Path:
    """A new path, counted against the budget."""
    index = self.next_index
    self.next_index += 1
    self.used += 1
    seed = episode_seed(self.seed, self.draw, index)
    if parent is None:
      prompt = self.task.prompt(np.random.default_rng(seed))
      return _Path(index, -1, 0, 0, prompt, seed)
    # the branch point is on the new path too: its consecutive branches continue the parent's
    return _Path(index, parent.index, fork_turn, parent.depth + 1, parent.prompt, seed,
                 h_root=parent.h_root, consecutive=parent.consecutive)

  def launch(self, path: _Path, sandbox: Optional[Sandbox] = None,
             start: Optional[EpisodeState] = None) -> None:
    run = asyncio.ensure_future(self.run_path(path, sandbox, start))
    run.add_done_callback(lambda _: self.wake.set())
    self.runs.append(run)

  async def run_path(self, path: _Path, sandbox: Optional[Sandbox],
                     start: Optional[EpisodeState]) -> Trajectory:
    if self.limiter is None:
      return await self._run_path(path, sandbox, start)
    try:
      async with self.limiter:
        return await self._run_path(path, sandbox, start)
    except asyncio.CancelledError:
      if sandbox is not None:  # cancelled while waiting for a slot: the fork is still open
        await sandbox.close()
      raise

  async def _run_path(self, path: _Path, sandbox: Optional[Sandbox],
                      start: Optional[EpisodeState]) -> Trajectory:
    env = self.env
    if sandbox is None:
      sandbox = await start_sandbox(self.task, env["make_sandbox"])

    cfg = env["branch"]

    async def on_call(state: EpisodeState, gen: Generation, call: LLMCall) -> None:
      if cfg.entropy_measure == "arpo":
        h = arpo_step_entropy(gen, cfg.entropy_tokens, cfg.entropy_top_k, env["vocab_size"])
      else:
        h = step_entropy(gen, cfg.entropy_tokens)
      call.meta["entropy"] = h
      if state.turns == 0:
        path.h_root = h
        return
      if cfg.reset_root and path.parent >= 0 and state.turns == path.fork_turn:
        path.h_root = h  # the branch's own first call (ARPO): its ΔH here is 0
      path.tool_entropies.append(h)
      if self.branching:
        await self.maybe_branch(path, sandbox, state, h)

    try:
      result = await run_episode(env["policy"], sandbox, path.prompt,
                                 default_tools(self.task.test_command or None), env["chat"],
                                 dataclasses.replace(env["scaffold"], seed=path.seed),
                                 on_call=on_call, start=start)
      reward, details = await env["score"](self.task, sandbox, result)
    finally:
      await sandbox.close()
    tree = {"parent": path.parent, "fork_turn": path.fork_turn, "depth": path.depth,
            "branch_turns": list(path.branch_turns), "global_samples": self.m,
            "h_root": path.h_root}
    meta = {"group_size": self.k, "draw": self.draw, "index": path.index, "tree": tree}
    return result.to_trajectory(reward, self.task.instance_id, self.group_id,
                                metadata=episode_metadata(details, path.prompt, meta))

  async def maybe_branch(self, path: _Path, sandbox: Sandbox, state: EpisodeState,
                         h: float) -> None:
    """At a tool step: draw the branch decision, fork the sandbox and start the new paths."""
    cfg = self.env["branch"]
    left = self.k - self.used
    p = branch_probability(h, path.h_root if path.h_root is not None else h, path.consecutive,
                           cfg)
    rng = np.random.default_rng([path.seed, state.turns])
    if left < 1 or rng.random() >= p:
      path.consecutive = 0
      return
    path.consecutive += 1
    path.branch_turns.append(state.turns)
    n = min(cfg.width - 1, left)
    self.used += n  # reserved now: other paths branch while the forks are made
    for _ in range(n):
      try:
        fork = await sandbox.fork()
      except SandboxError as e:
        self.used -= 1  # the budget goes back to the group
        self.count("branch_fork_failed")
        log.warning("task %s: sandbox fork failed: %s", self.task.instance_id, e)
        continue
      self.used -= 1  # new_path counts it again
      self.count("branches")
      self.launch(self.new_path(path, state.turns), fork, state)


def make_branching_group(policy: Policy, chat: ChatFormat, make_sandbox: SandboxMaker,
                         scaffold: Optional[ScaffoldConfig] = None,
                         branch: Optional[BranchConfig] = None, *, partial_credit: bool = False,
                         judge_policy: Optional[Policy] = None,
                         verdict_cache: Optional[VerdictCache] = None) -> GroupFn:
  """A group function that samples each task's group as one entropy-guided tree.

  Drop-in for `envs.episode.independent_groups(make_react_episode(...))`: the same episodes
  (react scaffold, default tools, the task's verifier for each leaf), group ids, metadata
  {group_size, draw, index} and failure handling, plus metadata["tree"].

  Args:
    policy: samples the agent's turns (its `Generation.entropies`, or its `top_logprobs` for
      the "arpo" entropy, drive the branching).
    chat: renders messages to token ids and parses tool calls.
    make_sandbox: the sandboxes (`envs.episode.make_sandbox_factory`); forks come from
      `Sandbox.fork`.
    scaffold: the episodes' settings (default `ScaffoldConfig()`); each path samples with its
      own seed.
    branch: the branching rule (default `BranchConfig()`).
    partial_credit: reward = fraction of tests passing instead of all-or-nothing.
    judge_policy: grades "judge" tasks (default `policy`).
    verdict_cache: grade each distinct leaf's submission once (`envs.verifiers.cache`); None:
      every one.

  Returns:
    `async group(task, group_size, *, draw, seed, limiter, abort, counters) -> trajectories`
    (see `envs.episode.GroupFn`): group_size leaves in path order, fewer if episodes failed
    ("episodes_failed") or the group was aborted ("episodes_cancelled"); counters also get
    "branches" (paths started by a fork) and "branch_fork_failed".
  """
  env = {"policy": policy, "chat": chat, "make_sandbox": make_sandbox,
         "scaffold": scaffold or ScaffoldConfig(), "branch": branch or BranchConfig(),
         "vocab_size": chat.tokenizer.vocab_size,  # |V| of the "arpo" entropy, as ARPO's
         "score": make_verifier(chat, make_sandbox, judge_policy or policy,
                                partial_credit=partial_credit, verdict_cache=verdict_cache)}

  async def group(task: Task, group_size: int, *, draw: int = 0, seed: int = 0,
                  limiter: Optional[asyncio.Semaphore] = None,
                  abort: Optional[asyncio.Event] = None,
                  counters: Optional[dict] = None) -> list[Trajectory]:
    if group_size < 1:
      raise ValueError(f"group_size={group_size}: must be >= 1")
    g = _Group(task, group_size, draw, seed, f"{task.instance_id}/{draw}", limiter,
               counters if counters is not None else {}, env)
    cfg = env["branch"]
    try:
      if cfg.premonitor and cfg.global_fraction is None:  # the first global sample runs alone
        first = g.new_path(None, 0)
        g.launch(first)
        await _wait(g, abort, lambda: g.runs[0].done())
        if g.runs[0].done() and not g.runs[0].cancelled() and first.h_root is not None:
          h_tool = (float(np.mean(first.tool_entropies)) if first.tool_entropies
                    else first.h_root)
          g.m = global_samples(group_size, first.h_root, h_tool, cfg.premonitor_beta)
        else:
          g.m = max(1, round(group_size / 2))
      else:  # ARPO: the global samples start at once
        fraction = 0.5 if cfg.global_fraction is None else cfg.global_fraction
        g.m = int(min(max(round(group_size * fraction), 1), group_size))
      g.branching = True
      for _ in range(g.m - g.used):
        g.launch(g.new_path(None, 0))
      # paths spawn branches while they run; budget left at the end goes to new global samples
      while not (abort is not None and abort.is_set()):
        await _wait(g, abort, lambda: all(r.done() for r in g.runs))
        if abort is not None and abort.is_set():
          break
        if g.used >= group_size:
          break
        for _ in range(group_size - g.used):
          g.launch(g.new_path(None, 0))
    finally:
      for run in g.runs:
        run.cancel()  # no-op for finished ones
      while True:  # a path cancelled mid-fork may have launched one more run
        pending = [r for r in g.runs if not r.done()]
        if not pending:
          break
        await asyncio.gather(*pending, return_exceptions=True)
    return _collect(g)

  return group


async def _wait(g: _Group, abort: Optional[asyncio.Event], done) -> None:
  """Waits until `done()` holds or `abort` is set (runs signal `g.wake` as they finish)."""
  while not done() and not (abort is not None and abort.is_set()):
    g.wake.clear()
    waiters = [asyncio.ensure_future(g.wake.wait())]
    if abort is not None:
      waiters.append(asyncio.ensure_future(abort.wait()))
    try:
      await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
      for w in waiters:
        w.cancel()


def _collect(g: _Group) -> list[Trajectory]:
  """The finished leaves in path order; failures and cancellations counted and logged."""
  out = []
  for run in sorted(g.runs, key=lambda r: _index_of(r)):
    if run.cancelled():
      g.count("episodes_cancelled")
      continue
    if run.exception() is not None:
      g.count("episodes_failed")
      log.warning("a path of task %s (draw %d) failed: %r", g.task.instance_id, g.draw,
                  run.exception())
      continue
    t = run.result()
    t.metadata["tree"]["global_samples"] = g.m  # the first path finished before m was known
    out.append(t)
  return out


def _index_of(run: asyncio.Future) -> int:
  if run.cancelled() or run.exception() is not None:
    return 1 << 30
  return run.result().metadata["index"]


def tree_stats(groups: list[list[Any]]) -> dict[str, float]:
  """Rollout metrics of branching groups (their trajectories' metadata["tree"]).

  Args:
    groups: the step's groups of trajectories; groups without tree metadata are skipped.

  Returns:
    {} when no group branched; else "tree/branches_per_task" (paths started by a fork),
    "tree/global_samples" (mean m), "tree/depth_<d>" (share of leaves at fork depth d),
    "tree/tokens_sampled" and "tree/tokens_trained" (per task: distinct calls' output tokens
    vs every leaf's, shared calls counted once per leaf), "tree/shared_fraction" (1 - sampled /
    trained) and "tree/branch_entropy" / "tree/step_entropy" (mean step entropy at branch points
    / at all tool steps).
  """
  trees = [g for g in groups if g and all("tree" in t.metadata for t in g)]
  if not trees:
    return {}
  branches, m, depths, sampled, trained, at_branch, steps = [], [], [], [], [], [], []
  for g in trees:
    branches.append(sum(t.metadata["tree"]["parent"] >= 0 for t in g))
    m.append(g[0].metadata["tree"]["global_samples"])
    depths += [t.metadata["tree"]["depth"] for t in g]
    branch_calls = set()  # the calls at which a path spawned branches
    for t in g:
      agent = [c for c in t.calls if not c.meta.get("summary")]
      branch_calls |= {_key(agent[turn]) for turn in t.metadata["tree"]["branch_turns"]
                       if turn < len(agent)}
    seen: set = set()
    n_sampled = n_trained = 0
    for t in g:
      for turn, c in enumerate(x for x in t.calls if not x.meta.get("summary")):
        n_trained += len(c.output_ids)
        if _key(c) in seen:
          continue
        seen.add(_key(c))
        n_sampled += len(c.output_ids)
        if turn > 0 and "entropy" in c.meta:
          steps.append(c.meta["entropy"])
          if _key(c) in branch_calls:
            at_branch.append(c.meta["entropy"])
    sampled.append(n_sampled)
    trained.append(n_trained)
  out = {"tree/branches_per_task": float(np.mean(branches)),
         "tree/global_samples": float(np.mean(m)),
         "tree/tokens_sampled": float(np.mean(sampled)),
         "tree/tokens_trained": float(np.mean(trained)),
         "tree/shared_fraction": 1.0 - sum(sampled) / max(sum(trained), 1)}
  for d, n in zip(*np.unique(depths, return_counts=True)):
    out[f"tree/depth_{int(d)}"] = n / len(depths)
  if steps:
    out["tree/step_entropy"] = float(np.mean(steps))
  if at_branch:
    out["tree/branch_entropy"] = float(np.mean(at_branch))
  return out


def _key(call: LLMCall) -> tuple:
  """A call's identity in its tree: its context and what it sampled."""
  return tuple(call.input_ids), tuple(call.output_ids)
