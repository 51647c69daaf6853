"""The `react` scaffold: the agent loop that turns a task into an episode of policy calls.

    prompt = task.prompt(rng)                  # one phrasing of the task's instruction
    result = await run_episode(policy, sandbox, prompt, default_tools(task.test_command),
                               chat, ScaffoldConfig(max_turns=30))
    trajectory = result.to_trajectory(reward, task.instance_id, group_id)

Each turn samples one assistant reply, runs its tool calls in the sandbox and shows the results.
Every policy call is recorded as an `LLMCall` with the exact ids the policy saw and sampled, and
sampled text is never re-tokenized: the next call's input is the previous input + the sampled
ids + `chat.continuation(observations)`. Malformed calls, unknown tools and tool failures are
shown to the model as observations and the episode goes on.

A chat template that rewrites earlier turns (`chat.extends_history` is False, e.g. Qwen3 drops
the reasoning of turns before the last user query) has no continuation: each call's input is
then `chat.render` of the whole context (the parsed assistant turns and the observations), as
the template shows it. Such a call's input need not extend the previous call's sequence: that is
a branch of the trajectory tree, and each call's sampled ids (reasoning included) are trained in
the call that sampled them.

Episodes end with `submitted` (the `submit` tool), `max_turns`, `token_budget` (the context or
the episode's sampling budget is spent), `timeout` (wall clock) or `sandbox_error` (the sandbox
itself failed).

Context management (ReSum): with `summary_at_tokens` set, when the next input would pass it the
policy is asked for a summary of its progress, and the episode restarts from the system prompt
and the task plus that summary. The new context is a branch (later calls' inputs no longer
extend the earlier ones); summary calls are marked with meta["summary"] = True.

Branching (tree rollouts, envs/branching.py): `on_call(state, generation, call)` is awaited after
each agent call is sampled and before its tool calls run; `state` (an `EpisodeState`) is where
the episode stood just before that call. `run_episode(..., start=state)` in a fork of the sandbox
resumes from there and samples the call afresh: a branch that shares every earlier call.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import time
from typing import Any, Awaitable, Callable, Optional, Sequence, Union

from envs.chat.formats import ChatFormat
from envs.chat.toolcalls import ParsedTurn
from envs.policy import Generation, Policy, SamplingParams
from envs.sandbox.base import Sandbox, SandboxError
from envs.tools import UNITS, Tool, call_tool
from envs.trajectory import LLMCall, Trajectory

DEFAULT_SYSTEM_PROMPT = (
    "You are a software engineering agent working in a repository. Use the tools to read the "
    "code, make changes and run the tests; call at least one tool in every reply. When the task "
    "is done, call submit.")
NO_TOOL_CALL = ("Your reply contained no tool call. Use the tools to make progress, and call "
                "submit when the task is done.")
CUT_OFF = "Your reply was cut off at {n} tokens (the limit of one reply)."
SUMMARY_PROMPT = (
    "Your context is almost full. Summarise your progress for a fresh start: what you found "
    "(files, functions, the cause), what you changed, what remains to do and how. Write only the "
    "summary, no tool calls.")
RESUME_TEMPLATE = "{task}\n\nYou have already worked on this task. Your summary so far:\n{summary}"


@dataclasses.dataclass(frozen=True)
class ScaffoldConfig:
  """Settings of the react scaffold, validated at construction.

  Raises:
    ValueError: naming the field whose value is out of range.
  """

  system_prompt: str = DEFAULT_SYSTEM_PROMPT  # system message; the chat format adds the tools
  max_turns: int = 30                 # agent turns (policy calls other than summaries)
  max_context_tokens: int = 32768     # one call's input + output at most ("token_budget")
  max_new_tokens: int = 2048          # tokens sampled per call at most
  max_total_tokens: Optional[int] = None  # tokens sampled over the episode at most (None: no cap)
  timeout_s: float = 1800.0           # wall-clock limit of the whole episode ("timeout")
  temperature: float = 1.0            # sampling temperature (0 = greedy)
  top_p: float = 1.0                  # nucleus mass (1 = off)
  top_k: int = 0                      # top-k (0 = off)
  seed: Optional[int] = None          # call i samples with seed + i (None: the engine's stream)
  max_output: Optional[int] = 8000    # budget of one tool result shown to the model (None: all)
  output_unit: str = "chars"          # unit of max_output: "chars" or "tokens" (chat tokenizer)
  summary_at_tokens: Optional[int] = None  # ReSum: summarise past this many context tokens
  max_summaries: int = 3              # ReSum restarts per episode at most
  summary_prompt: str = SUMMARY_PROMPT    # user message asking for the summary
  resume_template: str = RESUME_TEMPLATE  # first user message after a restart ({task}, {summary})
  no_tool_call_message: str = NO_TOOL_CALL  # observation after a reply without tool calls

  def __post_init__(self):
    for name in ("max_turns", "max_context_tokens", "max_new_tokens", "max_summaries"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < (0 if name == "max_summaries" else 1):
        raise ValueError(f"ScaffoldConfig.{name}={value!r}: expected a positive integer")
    for name in ("max_total_tokens", "max_output"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"ScaffoldConfig.{name}={value!r}: expected None or an integer >= 1")
    if not self.timeout_s > 0:
      raise ValueError(f"ScaffoldConfig.timeout_s={self.timeout_s!r}: expected > 0")
    if self.output_unit not in UNITS:
      raise ValueError(f"ScaffoldConfig.output_unit={self.output_unit!r}: expected one of {UNITS}")
    s = self.summary_at_tokens
    if s is not None and not (isinstance(s, int) and 0 < s < self.max_context_tokens):
      raise ValueError(f"ScaffoldConfig.summary_at_tokens={s!r}: expected None or an integer "
                       f"in (0, max_context_tokens={self.max_context_tokens})")
    if "{task}" not in self.resume_template or "{summary}" not in self.resume_template:
      raise ValueError(f"ScaffoldConfig.resume_template={self.resume_template!r}: must contain "
                       "{task} and {summary}")


# The settings a launcher sets on a command line: (flag, ScaffoldConfig field, help).
_FLAGS = (("max_turns", "max_turns", "agent turns per episode"),
          ("max_new_tokens", "max_new_tokens", "tokens sampled per policy call"),
          ("max_context_tokens", "max_context_tokens", "input + output of one call"),
          ("episode_timeout", "timeout_s", "wall-clock seconds per episode"),
          ("temperature", "temperature", "sampling temperature"))


def add_scaffold_flags(parser: argparse.ArgumentParser) -> None:
  """Declares the scaffold's command-line flags, with `ScaffoldConfig`'s defaults.

  Args:
    parser: gets --max_turns, --max_new_tokens, --max_context_tokens, --episode_timeout
      (seconds) and --temperature.
  """
  defaults = ScaffoldConfig()
  for flag, field, help_ in _FLAGS:
    value = getattr(defaults, field)
    parser.add_argument(f"--{flag}", type=type(value), default=value, help=help_)


def scaffold_config_from_flags(args: argparse.Namespace) -> ScaffoldConfig:
  """The `ScaffoldConfig` of the flags declared by `add_scaffold_flags`.

  Args:
    args: the parsed command line.

  Returns:
    The config (other fields at their defaults).
  """
  return ScaffoldConfig(**{field: getattr(args, flag) for flag, field, _ in _FLAGS})


@dataclasses.dataclass(frozen=True)
class EpisodeState:
  """Where an episode stands before one of its policy calls (a branch point).

  Attributes:
    ids: the next call's input ids.
    calls: the calls recorded so far.
    messages: the readable transcript so far.
    context: the messages of the current context (re-rendering templates).
    turns: agent turns taken.
    summaries: ReSum restarts taken.
    sampled: tokens sampled so far.
    elapsed_s: wall-clock seconds the episode has run (a branch gets the rest of the timeout).
  """

  ids: tuple[int, ...]
  calls: tuple[LLMCall, ...]
  messages: tuple[dict, ...]
  context: tuple[dict, ...]
  turns: int
  summaries: int
  sampled: int
  elapsed_s: float


OnCall = Callable[[EpisodeState, Generation, LLMCall], Awaitable[None]]


@dataclasses.dataclass
class EpisodeResult:
  """What an episode did.

  `messages` is a readable transcript of every context (assistant turns as parsed, tool
  results as shown); `calls` is the exact record for training.
  """

  calls: list[LLMCall]
  termination: str                      # one of envs.trajectory.TERMINATIONS
  submitted: bool = False
  answer: Optional[str] = None          # submit's answer argument, if any
  messages: list[dict] = dataclasses.field(default_factory=list)
  num_turns: int = 0                    # agent turns (summary calls excluded)
  num_summaries: int = 0
  tool_errors: int = 0                  # turns with meta["tool_error"]
  elapsed_s: float = 0.0
  error: Optional[str] = None           # the SandboxError's message for "sandbox_error"

  def to_trajectory(self, reward: float, task_id: str, group_id: str,
                    metadata: Optional[dict] = None) -> Trajectory:
    """The episode as a trajectory record, with its final ids.

    Args:
      reward: the verifier's reward.
      task_id: the task's `instance_id`.
      group_id: the group the episode belongs to ("" outside a group).
      metadata: extra metadata (e.g. the verdict), added to the episode's own (num_turns,
        num_summaries, tool_errors, submitted, elapsed_s, and answer / error when set).

    Returns:
      The trajectory.
    """
    meta = {"num_turns": self.num_turns, "num_summaries": self.num_summaries,
            "tool_errors": self.tool_errors, "submitted": self.submitted,
            "elapsed_s": self.elapsed_s, **(metadata or {})}
    if self.answer is not None:
      meta["answer"] = self.answer
    if self.error is not None:
      meta["error"] = self.error
    return Trajectory(calls=self.calls, reward=reward, task_id=task_id, group_id=group_id,
                      termination=self.termination, metadata=meta)


class _Episode:
  """The mutable state of one run_episode call (kept outside the loop so that a timeout, which
  cancels the loop, still leaves every finished call recorded)."""

  def __init__(self, policy, sandbox, task_prompt, tools, chat, config, on_call=None):
    self.policy, self.sandbox, self.chat, self.config = policy, sandbox, chat, config
    self.on_call = on_call
    self.started = time.monotonic()
    self.task_prompt = task_prompt
    self.tools = {t.name: t for t in tools}
    self.schemas = [t.schema() for t in tools]
    self.calls: list[LLMCall] = []
    self.messages: list[dict] = []
    self.context: list[dict] = []  # the messages of the current context, for re-rendering
    self.turns = self.summaries = self.sampled = 0
    self.submitted, self.answer = False, None
    self.resume_ids: Optional[list[int]] = None

  def state(self, ids: list[int], elapsed_before: float = 0.0) -> EpisodeState:
    """The episode as it stands before sampling from `ids`."""
    return EpisodeState(tuple(ids), tuple(self.calls), tuple(self.messages), tuple(self.context),
                        self.turns, self.summaries, self.sampled,
                        elapsed_before + time.monotonic() - self.started)

  def restore(self, state: EpisodeState) -> None:
    """Continue from `state` (a branch): its calls and transcript become this episode's."""
    self.calls, self.messages = list(state.calls), list(state.messages)
    self.context = list(state.context)
    self.turns, self.summaries, self.sampled = state.turns, state.summaries, state.sampled
    self.resume_ids = list(state.ids)

  def _start(self, user: str) -> list[int]:
    """A fresh context: system prompt, tools, the first user message, the generation prompt."""
    msgs = [{"role": "system", "content": self.config.system_prompt},
            {"role": "user", "content": user}]
    self.messages += msgs
    self.context = list(msgs)
    return self.chat.render(msgs, self.schemas, add_generation_prompt=True).ids

  def _extend(self, ids: list[int], out: list[int], new: list[dict]) -> list[int]:
    """The next input: appended ids, or (a template that rewrites history) the re-rendered
    context, which must already hold `new`."""
    if self.chat.extends_history:
      return ids + out + self.chat.continuation(new, out)
    return self.chat.render(self.context, self.schemas, add_generation_prompt=True).ids

  async def _sample(self, ids: list[int], max_tokens: int, meta: dict) -> tuple[Generation,
                                                                                LLMCall]:
    c = self.config
    params = SamplingParams(max_tokens=max_tokens, temperature=c.temperature, top_p=c.top_p,
                            top_k=c.top_k, stop_token_ids=tuple(self.chat.stop_token_ids),
                            seed=None if c.seed is None else c.seed + len(self.calls))
    gen = await self.policy.generate(list(ids), params)
    experts, start = gen.expert_ids, 0
    if experts is not None and self.calls:  # positions the previous call recorded stay there
      prev = self.calls[-1]
      start = min(len(os.path.commonprefix([prev.input_ids + prev.output_ids, list(ids)])),
                  len(prev.input_ids) + len(prev.output_ids) - 1)
      experts = experts[start:]
    call = LLMCall(input_ids=list(ids), output_ids=list(gen.output_ids),
                   output_logprobs=list(gen.logprobs), policy_version=gen.policy_version,
                   token_versions=gen.token_versions, meta=meta, expert_ids=experts,
                   expert_start=start)
    self.calls.append(call)
    self.sampled += len(call.output_ids)
    return gen, call

  def _room(self, ids: list[int]) -> int:
    """Tokens the next call may sample."""
    c = self.config
    room = min(c.max_new_tokens, c.max_context_tokens - len(ids))
    if c.max_total_tokens is not None:
      room = min(room, c.max_total_tokens - self.sampled)
    return room

  async def _act(self, turn: ParsedTurn, n_sampled: int) -> tuple[list[dict], bool]:
    """Run the turn's tool calls in order (stopping at submit); (observations, tool_error)."""
    c = self.config
    if not turn.tool_calls:
      text = c.no_tool_call_message
      if not turn.finished:
        text = CUT_OFF.format(n=n_sampled) + " " + text
      return [{"role": "user", "content": text}], True
    observations, failed = [], False
    for call in turn.tool_calls:
      if call.error:
        out, err = call.error, True
      else:
        r = await call_tool(self.tools, self.sandbox, call.name, call.arguments,
                            max_output=c.max_output, unit=c.output_unit,
                            tokenizer=self.chat.tokenizer)
        out, err = r.output, r.error
        if r.submitted:
          self.submitted, self.answer = True, r.answer
      failed |= err
      observations.append({"role": "tool", "name": call.name or "?", "tool_call_id": call.id,
                           "content": f"error: {out}" if err else out})
      if self.submitted:
        break
    return observations, failed

  async def _summarize(self, ids: list[int], out: list[int],
                       observations: list[dict]) -> Optional[list[int]]:
    """ReSum: ask for a summary after this turn's observations; the restarted context, or
    None if the request does not fit the context."""
    c = self.config
    request = {"role": "user", "content": c.summary_prompt}
    self.context.append(request)
    sum_ids = self._extend(ids, out, observations + [request])
    room = self._room(sum_ids)
    if room < 1:
      self.context.pop()
      return None
    self.messages.append(request)
    gen, _ = await self._sample(sum_ids, room, {"tool_error": False, "summary": True,
                                                "context": self.summaries})
    summary = self.chat.parse_assistant(gen.output_ids).text.strip()
    self.messages.append({"role": "assistant", "content": summary, "summary": True})
    self.summaries += 1
    return self._start(c.resume_template.format(task=self.task_prompt, summary=summary))

  async def run(self, elapsed_before: float = 0.0) -> str:
    c = self.config
    ids = self.resume_ids if self.resume_ids is not None else self._start(self.task_prompt)
    while True:
      if self.turns >= c.max_turns:
        return "max_turns"
      room = self._room(ids)
      if room < 1:
        return "token_budget"
      before = self.state(ids, elapsed_before) if self.on_call is not None else None
      gen, call = await self._sample(ids, room, {"tool_error": False, "summary": False,
                                                 "context": self.summaries})
      if before is not None:
        await self.on_call(before, gen, call)
      self.turns += 1
      out = call.output_ids
      turn = self.chat.parse_assistant(out, self.schemas)
      self.messages.append({**turn.to_message(), "text": turn.text})
      observations, failed = await self._act(turn, len(out))
      call.meta["tool_error"] = failed
      self.messages += observations
      # Content "" rather than None: some templates (Qwen3's first revision) need a string.
      self.context += [{**turn.to_message(), "content": turn.content}] + observations
      if self.submitted:
        return "submitted"
      nxt = self._extend(ids, out, observations)
      if (c.summary_at_tokens is not None and len(nxt) > c.summary_at_tokens
          and self.summaries < c.max_summaries):
        restarted = await self._summarize(ids, out, observations)
        nxt = restarted if restarted is not None else nxt
      ids = nxt


async def run_episode(policy: Policy, sandbox: Sandbox, task_prompt: str, tools: Sequence[Tool],
                      chat: ChatFormat, config: Optional[ScaffoldConfig] = None, *,
                      on_call: Optional[OnCall] = None,
                      start: Optional[EpisodeState] = None) -> EpisodeResult:
  """Runs the react scaffold on one task until it ends (see the module docstring).

  The sandbox is left open (the verifier reads the agent's changes from it). Policy errors
  propagate; a sandbox failure ends the episode with "sandbox_error".

  Args:
    policy: samples the agent's turns.
    sandbox: where the tools run.
    task_prompt: the task's instruction (one phrasing).
    tools: the tools the agent may call (distinct names).
    chat: renders messages to ids and parses the replies.
    config: the scaffold's settings (default `ScaffoldConfig()`).
    on_call: awaited after each agent call is sampled, before its tool calls run, with the
      state before the call, the generation and the recorded call (branching rollouts).
    start: resume from this state (a branch point; `sandbox` must hold the workspace as it was
      there, e.g. a `Sandbox.fork()` taken then): its calls and transcript are kept, the
      next call is sampled from `start.ids`, and the timeout counts from `start.elapsed_s`.

  Returns:
    What the episode did: the calls, the termination and a readable transcript.

  Raises:
    ValueError: two tools share a name.
  """
  config = config or ScaffoldConfig()
  names = [t.name for t in tools]
  if len(set(names)) != len(names):
    raise ValueError(f"tools: duplicate names in {names}")
  ep = _Episode(policy, sandbox, task_prompt, tools, chat, config, on_call)
  elapsed_before = 0.0
  if start is not None:
    ep.restore(start)
    elapsed_before = start.elapsed_s
  error = None
  try:
    termination = await asyncio.wait_for(ep.run(elapsed_before),
                                         max(config.timeout_s - elapsed_before, 1e-3))
  except asyncio.TimeoutError:
    termination = "timeout"
  except SandboxError as e:
    termination, error = "sandbox_error", f"{type(e).__name__}: {e}"
  return EpisodeResult(
      calls=ep.calls, termination=termination, submitted=ep.submitted, answer=ep.answer,
      messages=ep.messages, num_turns=ep.turns, num_summaries=ep.summaries,
      tool_errors=sum(bool(c.meta.get("tool_error")) for c in ep.calls),
      elapsed_s=elapsed_before + time.monotonic() - ep.started, error=error)


Turn = Union[dict, str, Callable[[list[int]], Union[dict, str]]]


class ScriptedPolicy:
  """A Policy that plays pre-written assistant turns (tests, demos, scripted solvers).

  Each turn is an assistant message, its raw text, or a function of the input ids returning
  one (a solver that reacts to observations). The turn is tokenized with the chat format as a
  sampler would emit it, cut to `max_tokens` (finish "length"), with fake log-probs.
  `requests` keeps every (input_ids, params) received.

  Args:
    chat: tokenizes the turns.
    turns: the script, one entry per call.
    policy_version: reported with every generation.
  """

  def __init__(self, chat: ChatFormat, turns: Sequence[Turn], policy_version: int = 0):
    self.chat, self.turns, self.policy_version = chat, list(turns), policy_version
    self.requests: list[tuple[list[int], SamplingParams]] = []

  async def generate(self, input_ids: Sequence[int], params: SamplingParams) -> Generation:
    """The script's next turn as a sampler would emit it, cut to `params.max_tokens`.

    Args:
      input_ids: the context (kept in `requests`; passed to a callable turn).
      params: the sampling request (only max_tokens is honoured).

    Returns:
      The turn's ids with fake log-probs.

    Raises:
      IndexError: the script has no more turns.
    """
    i = len(self.requests)
    self.requests.append((list(input_ids), params))
    if i >= len(self.turns):
      raise IndexError(f"ScriptedPolicy: the script has {len(self.turns)} turns; call {i + 1} "
                       "asked for another")
    turn: Any = self.turns[i]
    if callable(turn):
      turn = turn(list(input_ids))
    ids = self.chat.assistant_ids(turn)
    finish = "stop"
    if len(ids) > params.max_tokens:
      ids, finish = ids[:params.max_tokens], "length"
    logprobs = [-0.1 * (1 + (i + j) % 7) for j in range(len(ids))]
    return Generation(ids, logprobs, finish, self.policy_version)
