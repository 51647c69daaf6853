"""Black-box scaffold episodes in the trainer: a CLI agent in a sandbox, its calls through a gateway.

    mix = parse_scaffold_mix("react:0.5,mini-swe-agent:0.5", "rl.scaffold")
    draw_scaffold(mix, task, seed=0)          # "react" or "mini-swe-agent", fixed per task
    gateway = Gateway(engine, chat, served_name="arbor", max_new_tokens=512, temperature=1.0)
    episode = blackbox_episode(gateway, "mini-swe-agent", scaffold_cfg, backend="bwrap")
    trajectory = await episode(task, 0, seed, group_id=f"{task.instance_id}/0")
    gateway.close()

Scaffold mixes (`rl.scaffold`, `eval.scaffold`): a registry name (`envs.scaffolds.REGISTRY`)
or weighted names "react:0.5,mini-swe-agent:0.5" (weights > 0, normalised). Each task draws its
scaffold once, from a hash of (task id, seed): every episode of a task's group runs the same
scaffold, and the draw does not depend on the policy, the step or the order of tasks, so the
scaffold is an independent variable of the data. A task row's own "scaffold" field (kept in
`Task.metadata`) wins over the draw.

A black-box episode (`blackbox_episode`) is `envs.scaffolds.run_blackbox_episode` against
`Gateway`: a `trainer.serving.PolicyServer` over the run's engine in this process (loopback, a
random token, the run's served model name), whose session of the episode becomes the
episode's `Trajectory` (`envs.scaffolds.sessions.trajectory_from_session`: exact ids, the
sampler's log-probs, versions, expert ids) with the verifier's reward. The gateway imposes the
run's sampling where a scaffold would choose its own: every call samples at most
`max_new_tokens` tokens (a larger or missing max_tokens / max_output_tokens becomes that) at
the run's temperature; top_p, top_k and stops are the scaffold's. The CLI's turn limit is the
run's `max_turns`, its wall clock the episode timeout (or the task's `agent_timeout`, when
shorter). A black-box episode needs a task of kind "swe" or "shell" with an `environment`
(e.g. `rl.default_environment`) and a bwrap or docker sandbox; the CLI's own sampling seed is
not controlled, so black-box episodes are reproducible only at temperature 0. A CLI without a
turn limit of its own (Codex) can make more than `max_turns` calls: with
`rl.fixed_batch_shape` such an episode fails its step with the batch shape's error.

`mixed_episode` turns a mix into one `envs.episode.EpisodeFn`: per task, a registry lookup of
the drawn scaffold's episode function (the react loop for the host-side entry, a black-box
episode for the others), with metadata["scaffold"] set on the trajectory. `scaffold_stats`
gives per-scaffold step metrics.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import secrets
import uuid
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from envs.episode import EpisodeFn, episode_metadata
from envs.scaffold import ScaffoldConfig
from envs.scaffolds import registry
from envs.scaffolds.runner import run_blackbox_episode
from envs.scaffolds.sessions import trajectory_from_session
from envs.tasks import Task
from envs.trajectory import Trajectory
from envs.verifiers.cache import VerdictCache
from trainer.serving.server import PolicyServer, ServerConfig
from trainer.serving.validate import HTTPError

DEFAULT = "react"
BLACKBOX_BACKENDS = ("bwrap", "docker")  # sandboxes a black-box episode runs in
# Per protocol path, the fields bounding a call's sampled tokens; the first is set when none is.
_MAX_TOKEN_FIELDS = {"/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
                     "/v1/completions": ("max_tokens",), "/v1/responses": ("max_output_tokens",),
                     "/v1/messages": ("max_tokens",), "/generate": ("max_tokens",)}

Mix = tuple[tuple[str, float], ...]


def parse_scaffold_mix(spec: str, field: str = "rl.scaffold") -> Mix:
  """Parses a scaffold mix (see the module docstring).

  Args:
    spec: "NAME" or "NAME:WEIGHT,NAME:WEIGHT,..." (a name without weight weighs 1).
    field: the config field, for error messages.

  Returns:
    ((name, probability), ...) in the order given, probabilities summing to 1.

  Raises:
    ValueError: naming the field and value: not a string, empty, an unknown scaffold, a name
      given twice, or a weight that is not a finite number > 0.
  """
  if not isinstance(spec, str) or not spec.strip():
    raise ValueError(f"config.{field}={spec!r}: expected a scaffold name or weighted names "
                     f"'react:0.5,mini-swe-agent:0.5' (scaffolds: {', '.join(registry.REGISTRY)})")
  entries = []
  for part in spec.split(","):
    name, sep, weight = part.strip().partition(":")
    name = name.strip()
    if name not in registry.REGISTRY:
      raise ValueError(f"config.{field}={spec!r}: unknown scaffold {name!r}; registered: "
                       f"{', '.join(registry.REGISTRY)}")
    try:
      w = float(weight) if sep else 1.0
    except ValueError:
      w = math.nan
    if not (math.isfinite(w) and w > 0):
      raise ValueError(f"config.{field}={spec!r}: the weight of {name!r} is {weight.strip()!r}; "
                       "expected a finite number > 0")
    if name in dict(entries):
      raise ValueError(f"config.{field}={spec!r}: scaffold {name!r} is named twice")
    entries.append((name, w))
  total = sum(w for _, w in entries)
  return tuple((n, w / total) for n, w in entries)


def check_scaffold_mix(spec: str, field: str, *, sandbox: str, rollout: str = "independent",
                       rollout_workers: str = "inprocess", selection: str = "none") -> Mix:
  """`parse_scaffold_mix` plus what a mix with black-box scaffolds needs from the run.

  Args:
    spec: the mix.
    field: its config field ("rl.scaffold" | "eval.scaffold").
    sandbox: `rl.sandbox` (black-box scaffolds run in "bwrap" or "docker").
    rollout: `rl.rollout` (branching trees are react episodes).
    rollout_workers: `rl.rollout_workers` (black-box episodes run in the trainer's process).
    selection: `eval.selection` (majority_vote / self_play need submissions black-box episodes
      do not record).

  Returns:
    The parsed mix.

  Raises:
    ValueError: naming the field, its value and the conflicting setting.
  """
  mix = parse_scaffold_mix(spec, field)
  boxed = [n for n, _ in mix if not registry.get(n).host_side]
  if not boxed:
    return mix
  conflicts = [("rl.sandbox", sandbox, sandbox not in BLACKBOX_BACKENDS,
                f"black-box scaffolds run in one of {BLACKBOX_BACKENDS}"),
               ("rl.rollout", rollout, rollout != "independent",
                "branching trees are sampled with the react scaffold"),
               ("rl.rollout_workers", rollout_workers, rollout_workers != "inprocess",
                "black-box episodes run in the trainer's process (its gateway); remote rollout "
                "workers run react episodes"),
               ("eval.selection", selection, selection in ("majority_vote", "self_play"),
                "black-box episodes do not record the submission this selection compares")]
  for other, value, bad, why in conflicts:
    if bad:
      raise ValueError(f"config.{field}={spec!r} runs black-box scaffolds ({', '.join(boxed)}) "
                       f"but config.{other}={value!r}: {why}")
  return mix


def draw_scaffold(mix: Mix, task: Task, seed: int) -> str:
  """The scaffold of `task`'s episodes: its row's "scaffold" field, else a draw from `mix`.

  Args:
    mix: the parsed mix.
    task: the task (its instance_id and metadata).
    seed: the run's (or eval's) seed.

  Returns:
    A registry name.
  """
  own = (task.metadata or {}).get("scaffold")
  if own:
    return str(own)
  if len(mix) == 1:
    return mix[0][0]
  digest = hashlib.sha256(f"arbor-scaffold/{seed}/{task.instance_id}".encode()).digest()
  u = int.from_bytes(digest[:8], "little") / 2.0 ** 64
  acc = 0.0
  for name, p in mix:
    acc += p
    if u < acc:
      return name
  return mix[-1][0]


class Gateway:
  """The run's engine behind a loopback `PolicyServer` for black-box scaffolds.

  Started on first use (`start`); sessions are read and freed with `take`.

  Args:
    engine: the run's generation engine (the server starts it if needed; `close` stops it).
    chat: the chat format the protocols render with.
    served_name: the model name scaffolds are told.
    max_new_tokens: the most tokens one call samples.
    temperature: the sampling temperature every call uses (None: the scaffold's own).
  """

  def __init__(self, engine, chat, *, served_name: str = "arbor", max_new_tokens: int = 512,
               temperature: Optional[float] = None):
    self.engine, self.chat, self.model = engine, chat, served_name
    self.max_new_tokens, self.temperature = int(max_new_tokens), temperature
    self.token = secrets.token_hex(16)
    self.server = None
    self.url = ""
    self._lock: Optional[asyncio.Lock] = None

  def _make_server(self):
    cap, temperature = self.max_new_tokens, self.temperature

    class RunSampling(PolicyServer):
      """The PolicyServer with the run's token cap and temperature imposed on every call."""

      async def _body(self, request):
        body = await super()._body(request)
        fields = _MAX_TOKEN_FIELDS.get(request.url.path)
        if fields is None:
          return body
        present = [f for f in fields if f in body]
        for f in present:
          if isinstance(body[f], int) and not isinstance(body[f], bool) and body[f] > cap:
            body[f] = cap
        if not present:
          body[fields[0]] = cap
        if temperature is not None:
          body["temperature"] = float(temperature)
        return body

    return RunSampling(self.engine, ServerConfig(host="127.0.0.1", port=0, token=self.token,
                                                 served_name=self.model),
                       tokenizer=self.chat.tokenizer, chat=self.chat)

  async def start(self) -> str:
    """Starts serving (once; concurrent callers wait for the first); returns the URL."""
    if self._lock is None:
      self._lock = asyncio.Lock()
    async with self._lock:
      if self.server is None:
        server = self._make_server()
        self.url = await asyncio.to_thread(server.start_in_thread)
        self.server = server
    return self.url

  def take(self, session: str) -> list[dict]:
    """The session's call records, freed from the log ([] when it made no call)."""
    try:
      records = self.server.sessions.get(session)
    except HTTPError:
      return []
    self.server.sessions.delete(session)
    return records

  def close(self) -> None:
    """Stops the server (and with it the engine), if it was started."""
    if self.server is not None:
      self.server.stop()
      self.server = None


def blackbox_episode(gateway: Gateway, scaffold: str, config: ScaffoldConfig, *,
                     backend: str = "bwrap", cache_dir: Optional[str] = None,
                     sandbox_kw: Optional[Mapping[str, Any]] = None,
                     verdict_cache: Optional[VerdictCache] = None) -> EpisodeFn:
  """The episode function of one black-box scaffold (see the module docstring).

  Args:
    gateway: the run's gateway (started on the first episode).
    scaffold: a sandboxed registry entry.
    config: the run's episode limits (`max_turns`, `timeout_s`).
    backend: "bwrap" or "docker".
    cache_dir: the environment build cache (None: the default).
    sandbox_kw: more `create_sandbox` arguments of the agent's sandbox.
    verdict_cache: grade each distinct final workspace once (`envs.verifiers.cache`); None:
      every one.

  Returns:
    `async (task, index, seed, *, group_id, metadata) -> Trajectory`: the session's calls, the
    verifier's reward, the termination mapped by `envs.scaffolds.sessions.map_termination`,
    metadata {"verdict", "prompt", "scaffold", "session_id", "exit_code", "seconds", ...the
    caller's}.

  Raises:
    ValueError: an unknown or host-side scaffold.
  """
  sc = registry.get(scaffold)
  if sc.host_side:
    raise ValueError(f"scaffold={sc.name!r} runs host-side: not a black-box scaffold")

  async def episode(task: Task, index: int, seed: int, *, group_id: str = "",
                    metadata: Optional[Mapping[str, Any]] = None) -> Trajectory:
    del index
    url = await gateway.start()
    prompt = task.prompt(np.random.default_rng(seed))
    limit = config.timeout_s if task.agent_timeout is None else min(config.timeout_s,
                                                                    task.agent_timeout)
    session = f"episode-{uuid.uuid4().hex}"
    try:
      result = await run_blackbox_episode(
          task, sc, url, model=gateway.model, token=gateway.token, session_id=session,
          backend=backend, max_turns=config.max_turns, timeout=limit, prompt=prompt,
          cache_dir=cache_dir, sandbox_kw=dict(sandbox_kw or {}), verdict_cache=verdict_cache)
    finally:
      records = gateway.take(session)
    if result.termination == "sandbox_error" and not records:
      # as a react episode whose sandbox cannot start: left out of its group, not a 0 reward
      raise RuntimeError(f"{sc.name} episode of {task.instance_id}: sandbox error before any "
                         f"model call: {result.stderr[-500:]}")
    meta = {**episode_metadata(result.details, prompt, metadata), "scaffold": sc.name,
            "session_id": session, "exit_code": result.exit_code, "seconds": result.seconds}
    return trajectory_from_session(records, reward=result.reward, task_id=task.instance_id,
                                   group_id=group_id, termination=result.termination,
                                   metadata=meta)
  return episode


def mixed_episode(mix: Mix, seed: int, make: Callable[[str], EpisodeFn]) -> EpisodeFn:
  """One EpisodeFn over a scaffold mix: each task's drawn scaffold's episode.

  Args:
    mix: the parsed mix.
    seed: the run's seed (the draw's).
    make: name -> that scaffold's EpisodeFn (called once per name, on first use).

  Returns:
    The EpisodeFn; its trajectories carry metadata["scaffold"].
  """
  episodes: dict[str, EpisodeFn] = {}

  async def episode(task: Task, index: int, seed_: int, *, group_id: str = "",
                    metadata: Optional[Mapping[str, Any]] = None) -> Trajectory:
    name = draw_scaffold(mix, task, seed)
    if name not in episodes:
      episodes[name] = make(registry.get(name).name)  # ValueError for an unknown row value
    trajectory = await episodes[name](task, index, seed_, group_id=group_id, metadata=metadata)
    trajectory.metadata["scaffold"] = name
    return trajectory
  return episode


def scaffold_of(trajectory: Any) -> Optional[str]:
  """The scaffold a trajectory was sampled with (None: not recorded, or not a trajectory)."""
  return getattr(trajectory, "metadata", {}).get("scaffold") if isinstance(
      trajectory, Trajectory) else None


def scaffold_stats(groups: Sequence[Sequence[Trajectory]],
                   trained: Sequence[Sequence[Trajectory]] = ()) -> dict:
  """Per-scaffold step metrics of the scaffolds present.

  Args:
    groups: the step's groups (before filtering).
    trained: the groups kept for training.

  Returns:
    {"pass_rate/<scaffold>" (share of its episodes with reward >= 1), "episodes/<scaffold>",
    "trained_episodes/<scaffold>"} for every scaffold recorded in the trajectories' metadata.
  """
  out: dict[str, float] = {}
  by: dict[str, list[float]] = {}
  for g in groups:
    for t in g:
      name = scaffold_of(t)
      if name is not None:
        by.setdefault(name, []).append(float(t.reward))
  for name, rewards in by.items():
    out[f"pass_rate/{name}"] = float(np.mean(np.asarray(rewards) >= 1.0))
    out[f"episodes/{name}"] = len(rewards)
    out[f"trained_episodes/{name}"] = sum(scaffold_of(t) == name for g in trained for t in g)
  return out

