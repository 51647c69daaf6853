"""In-process rollouts: react episodes in sandboxes, sampled by an in-process engine.

    engine = Engine(model, engine_config(config), detokenize=chat.tokenizer.decode)
    scaffold = scaffold_config(config)          # the episode limits and sampling of config.rl
    rollouts = Rollouts(engine, chat, scaffold, sandbox="bwrap", concurrency=8)
    groups = rollouts.groups([(task, draw), ...], group_size=8, seed=0).result()
    # tree rollouts: Rollouts(..., branch=BranchConfig()) samples each group as one tree
    # scaffolds: Rollouts(..., scaffolds="react:0.5,mini-swe-agent:0.5", scaffold_seed=seed)
    trajectories = rollouts.episodes([(task, seed), ...]).result()      # one episode each
    rollouts.close()

Episodes are `envs.episode.make_react_episode` (fresh sandbox with the task's repository,
the react scaffold with the default tools, the task's verifier for the reward), exactly what a
remote rollout worker runs, with `trainer.serve.EnginePolicy` as the policy. They run on an
asyncio loop in a background thread, at most `concurrency` at once, so the engine batches the
calls of concurrent episodes together; `groups` and `episodes` return concurrent Futures, so the
RL loop can train on one step's rollouts while the next step's are sampled (async mode).

Sampling is reproducible: episode i of (task, draw) samples with `episode_seed(seed, draw, i)`
(its prompt phrasing and every call's sampling seed follow from it).

Scaffolds (`scaffolds`, a mix as `rl.scaffold` / `eval.scaffold` write it, `trainer.blackbox`):
each task's episodes run the scaffold drawn for it (`trainer.blackbox.draw_scaffold`): the
react loop above, or a black-box CLI in a sandbox whose model calls go through a loopback
gateway over the same engine (`trainer.blackbox.blackbox_episode`, the gateway started on the
first such episode); every trajectory records its scaffold in metadata["scaffold"]. Branching
groups are react episodes only.

`scaffold_config` and `engine_config` are the one place where a run's config becomes episode
limits and an engine: the RL loop, mode "eval" and the demo's evals all take them from here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any, Optional, Sequence

import ml_collections

from envs.branching import BranchConfig, make_branching_group
from envs.episode import (EpisodeFn, independent_groups, make_react_episode,
                          make_sandbox_factory)
from envs.scaffold import ScaffoldConfig
from envs.tasks import Task, load_repo_files
from envs.trajectory import Trajectory
from envs.verifiers import workspace_files
from envs.verifiers.cache import VerdictCache
from envs.scaffolds import registry as scaffold_registry
from models import sharding
from models.engine import EngineConfig
from trainer import blackbox
from trainer.serve import EnginePolicy

log = logging.getLogger(__name__)


def recording_episode(policy, chat, make_sandbox, scaffold: ScaffoldConfig,
                      verdict_cache: Optional[VerdictCache] = None) -> EpisodeFn:
  """Makes `envs.episode.make_react_episode` episodes that also record the agent's submission.

  The trajectory's metadata["submission"] keeps what the agent submitted: for "swe" tasks its
  final workspace's changes {path: bytes | None (deleted)} relative to the repository (read from
  the agent's sandbox when the episode closes it, after the verifier ran in its own), else the
  submit answer or the last reply's text. None when it could not be read.

  Args:
    policy: the episodes' policy (e.g. `trainer.serve.EnginePolicy`).
    chat: the chat format episodes render with.
    make_sandbox: `async (task) -> sandbox`, as `envs.episode.make_sandbox_factory` returns.
    scaffold: the episodes' ScaffoldConfig.
    verdict_cache: grade each distinct submission once (`envs.verifiers.cache`); None: every
      one.

  Returns:
    The EpisodeFn `async (task, index, seed, **ids) -> Trajectory`, otherwise unchanged.
  """
  originals: dict[str, dict] = {}

  async def episode(task: Task, index: int, seed: int, **ids) -> Trajectory:
    record: dict[str, Any] = {}

    async def make(t):
      box = await make_sandbox(t)
      if "box" not in record and task.kind == "swe":  # the first one is the agent's
        record["box"] = box
        close = box.close

        async def close_after_reading():
          try:
            record["files"] = await workspace_files(box)
          except Exception as e:  # the sandbox died: no submission
            log.warning("%s: cannot read the final workspace: %r", task.instance_id, e)
          await close()
        box.close = close_after_reading
      return box

    trajectory = await make_react_episode(policy, chat, make, scaffold,
                                          verdict_cache=verdict_cache)(task, index, seed, **ids)
    if task.kind == "swe":
      submission = None
      if "files" in record:
        if task.instance_id not in originals:
          originals[task.instance_id] = await asyncio.to_thread(load_repo_files, task)
        original, final = originals[task.instance_id], record["files"]
        submission = {p: final.get(p) for p in sorted(set(original) | set(final))
                      if original.get(p) != final.get(p)}
    elif trajectory.metadata.get("answer") is not None:
      submission = trajectory.metadata["answer"]
    else:
      last = [c for c in trajectory.calls if not c.meta.get("summary")][-1:]
      submission = chat.parse_assistant(last[0].output_ids).text if last else ""
    trajectory.metadata["submission"] = submission
    return trajectory
  return episode


class Rollouts:
  """Runs episodes of `engine`'s policy (see the module docstring). Not picklable; one per run.

  Args:
    engine: the generation engine (started here, stopped by `close`).
    chat: the chat format episodes render with.
    scaffold: the episodes' ScaffoldConfig (`scaffold_config`).
    sandbox: the sandbox backend ("local" runs no isolation: only for scripted tests);
      "remote" is a sandbox server (envs.sandbox_server) at `sandbox_url`.
    concurrency: episodes at once (>= 1).
    limits: the sandboxes' resource limits (None: the backend's defaults).
    sandbox_url: the remote sandbox server ("" unless `sandbox` is "remote").
    sandbox_token_file: a file holding the remote sandbox server's token ("": none).
    record_submissions: keep each episode's submission in its metadata
      (`recording_episode`; test-time selection needs it).
    branch: sample each group as one entropy-guided tree (`envs.branching`); None: G
      independent episodes.
    scaffolds: the scaffold mix of the episodes ("react", or weighted registry names
      "react:0.5,mini-swe-agent:0.5"; `trainer.blackbox.parse_scaffold_mix`).
    scaffold_seed: the seed of each task's scaffold draw (the run's seed).
    served_name: the model name black-box scaffolds are told.
    cache_verdicts: grade each distinct submission once (`envs.verifiers.cache`: identical
      final workspaces of a task share one test run, whichever scaffold left them); the cache
      is `verdict_cache` (None when off).

  Raises:
    ValueError: `concurrency` < 1, or a bad scaffold mix.
  """

  def __init__(self, engine, chat, scaffold: ScaffoldConfig, *, sandbox: str = "bwrap",
               concurrency: int = 8, limits=None, sandbox_url: str = "",
               sandbox_token_file: str = "", record_submissions: bool = False,
               branch: Optional[BranchConfig] = None, scaffolds: str = blackbox.DEFAULT,
               scaffold_seed: int = 0, served_name: str = "arbor", cache_verdicts: bool = True):
    if concurrency < 1:
      raise ValueError(f"concurrency={concurrency!r}: expected an integer >= 1")
    self.engine = engine
    self.scaffold = scaffold
    self.mix = blackbox.parse_scaffold_mix(scaffolds, "scaffolds")
    self.scaffold_seed = scaffold_seed
    make_sandbox = make_sandbox_factory(sandbox, limits=limits, allow_unsafe=sandbox == "local",
                                        url=sandbox_url or None,
                                        token_file=sandbox_token_file or None)
    self.policy = EnginePolicy(engine)  # starts the engine's thread
    self.verdict_cache = VerdictCache() if cache_verdicts else None
    make_episode = recording_episode if record_submissions else make_react_episode
    react = make_episode(self.policy, chat, make_sandbox, scaffold,
                         verdict_cache=self.verdict_cache)
    self.gateway = blackbox.Gateway(engine, chat, served_name=served_name,
                                    max_new_tokens=scaffold.max_new_tokens,
                                    temperature=scaffold.temperature)

    def episode_of(name: str) -> EpisodeFn:  # per registry entry: host-side react or a CLI
      if scaffold_registry.get(name).host_side:
        return react
      return blackbox.blackbox_episode(self.gateway, name, scaffold, backend=sandbox,
                                       verdict_cache=self.verdict_cache)
    self._episode = blackbox.mixed_episode(self.mix, scaffold_seed, episode_of)
    self._group = (independent_groups(self._episode) if branch is None else
                   make_branching_group(self.policy, chat, make_sandbox, scaffold, branch,
                                        verdict_cache=self.verdict_cache))
    self._loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self._loop.run_forever, name="arbor-rollouts",
                                    daemon=True)
    self._thread.start()
    self._limiter = self._call(self._make_limiter(concurrency)).result()
    self.counters: dict[str, float] = {}

  @staticmethod
  async def _make_limiter(n: int) -> asyncio.Semaphore:
    return asyncio.Semaphore(n)  # created on the loop that uses it

  def _call(self, coroutine) -> concurrent.futures.Future:
    return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

  def groups(self, tasks: Sequence[tuple[Task, int]], group_size: int, seed: int = 0
             ) -> concurrent.futures.Future:
    """Samples `group_size` episodes (or tree leaves) of each (task, draw), concurrently.

    Args:
      tasks: [(task, draw)]; episode (path) i of a group samples with
        `episode_seed(seed, draw, i)`.
      group_size: episodes per task.
      seed: the run's seed.

    Returns:
      A Future of one list of trajectories per (task, draw), in order (an episode that raised is
      logged and left out, so a group may come back short).
    """
    async def run():
      return await asyncio.gather(*(self._group(
          task, group_size, draw=draw, seed=seed, limiter=self._limiter,
          counters=self.counters) for task, draw in tasks))
    return self._call(run())

  def episodes(self, runs: Sequence[tuple[Task, int]]) -> concurrent.futures.Future:
    """Samples one episode per (task, seed), concurrently.

    Args:
      runs: [(task, seed)].

    Returns:
      A Future of one trajectory (or the exception it raised) per (task, seed), in order.
    """
    async def one(task, seed):
      async with self._limiter:
        return await self._episode(task, 0, seed)

    async def run():
      return await asyncio.gather(*(one(t, s) for t, s in runs), return_exceptions=True)
    return self._call(run())

  def scaffold_of(self, task: Task) -> str:
    """The scaffold `task`'s episodes run (`trainer.blackbox.draw_scaffold`)."""
    return blackbox.draw_scaffold(self.mix, task, self.scaffold_seed)

  def close(self) -> None:
    """Cancels running episodes (their sandboxes are closed), stops the loop, the black-box
    gateway (if started) and the engine."""
    if self._thread.is_alive():
      async def cancel_all():
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
          t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
      try:
        self._call(cancel_all()).result(timeout=60)
      except (concurrent.futures.TimeoutError, RuntimeError):
        pass
      self._loop.call_soon_threadsafe(self._loop.stop)
      self._thread.join(timeout=10)
      if not self._thread.is_alive():
        self._loop.close()
    self.gateway.close()
    self.engine.stop()


def scaffold_config(config: ml_collections.ConfigDict,
                    temperature: Optional[float] = None) -> ScaffoldConfig:
  """The episodes of a run: the react scaffold with the limits and sampling of `config.rl`.

  Args:
    config: the run's config (`rl.max_turns`, `rl.max_new_tokens`, `rl.max_context_tokens`,
      `rl.episode_timeout_s`, `rl.temperature`, `rl.top_p`, `rl.top_k`).
    temperature: replaces `rl.temperature` (an eval's `eval.temperature`); None keeps it.

  Returns:
    The ScaffoldConfig.
  """
  rl = config.rl
  return ScaffoldConfig(max_turns=rl.max_turns, max_new_tokens=rl.max_new_tokens,
                        max_context_tokens=rl.max_context_tokens, timeout_s=rl.episode_timeout_s,
                        temperature=rl.temperature if temperature is None else temperature,
                        top_p=rl.top_p, top_k=rl.top_k)


def engine_config(config: ml_collections.ConfigDict, model_cfg=None) -> EngineConfig:
  """The engine of a run's rollouts.

  A slot per concurrent episode (`rl.concurrency`), as many rows for prefix reuse, rows long
  enough for `rl.max_context_tokens` (rounded up to a multiple of 128); it records every
  position's experts when the policy is MoE and `rl.routing_replay` is on; the cache is
  contiguous or paged (`rl.kv_cache`, `rl.kv_page_size`, `rl.kv_pages`). With
  `rl.rollout_qtype` (a qwix type, e.g. "int8", "float8_e4m3fn"; absent or None: the policy's
  own weights) the engine samples from a weight-only quantized copy of the policy, re-quantized
  at every weight sync (`EngineConfig.weight_qtype`), and with `rl.rollout_act_qtype` from a
  copy whose projections quantize their inputs too (`EngineConfig.act_qtype`); the trainer
  keeps full precision and its mismatch correction (`rl.correction`) sees the quantization error
  in the log-probs.

  Args:
    config: the run's config (`rl.concurrency`, `rl.max_context_tokens`, `seed`,
      `rl.routing_replay`, `rl.kv_cache`, `rl.kv_page_size`, `rl.kv_pages`,
      `rl.rollout_qtype`, `rl.rollout_act_qtype`; `rl.branch.entropy_top_k` log-probs per
      token for ARPO's step entropy, `rl.branch.entropy_measure="arpo"`).
    model_cfg: the policy's ModelConfig; None: no expert recording (evaluation).

  Returns:
    The EngineConfig.

  Raises:
    ValueError: `rl.rollout_qtype` for a LoRA policy (its engine keeps the frozen base and
      takes adapters alone; quantize the base with `ModelConfig.base_qtype` instead).
  """
  rl = config.rl
  replay = bool(model_cfg is not None and model_cfg.is_moe and rl.routing_replay)
  qtype = rl.get("rollout_qtype")
  if qtype is not None and model_cfg is not None and model_cfg.lora_rank:
    raise ValueError(f"rl.rollout_qtype={qtype!r}: the policy has LoRA adapters "
                     f"(lora_rank={model_cfg.lora_rank}); its engine samples from the frozen "
                     "base plus adapters; quantize the base with ModelConfig.base_qtype instead")
  # ARPO's step entropy reads each token's most likely alternatives
  branch = rl.get("branch") or {}
  arpo = rl.get("rollout") == "branching" and branch.get("entropy_measure") == "arpo"
  return EngineConfig(slots=rl.concurrency, max_seq_len=-(-rl.max_context_tokens // 128) * 128,
                      prefix_cache_rows=rl.concurrency, prefill_chunk=512, seed=config.seed,
                      return_expert_ids=replay, cache=rl.kv_cache, page_size=rl.kv_page_size,
                      num_pages=rl.kv_pages, weight_qtype=qtype,
                      act_qtype=rl.get("rollout_act_qtype"),
                      top_logprobs=branch.get("entropy_top_k", 10) if arpo else 0)


ENGINE_MESHES = ("none", "colocated")


def engine_mesh(config: ml_collections.ConfigDict, mesh=None):
  """The mesh a run's engine decodes on (`Engine(mesh=...)`), from `rl.engine_mesh`: "none"
  (absent: one device) or "colocated" (the trainer's devices, as `decode_mesh` lays them out,
  in the engine's decode layout: weights tensor/expert-parallel, slots over the data axes;
  weight syncs reshard on device).

  Args:
    config: the run's config.
    mesh: the trainer's mesh, or None.

  Returns:
    The mesh, or None.

  Raises:
    ValueError: an unknown `rl.engine_mesh`, or "colocated" without a trainer mesh.
  """
  kind = config.rl.get("engine_mesh", "none")
  if kind not in ENGINE_MESHES:
    raise ValueError(f"rl.engine_mesh={kind!r}: expected one of {ENGINE_MESHES}")
  if kind == "colocated" and mesh is None:
    raise ValueError("rl.engine_mesh='colocated': the run has no device mesh")
  return decode_mesh(config, mesh) if kind == "colocated" else None


def decode_mesh(config: ml_collections.ConfigDict, mesh):
  """The trainer's devices as the engine decodes on them: `rl.engine_mesh_shape` ("tensor=4":
  those axes' sizes, fsdp the rest), or the trainer's mesh itself when it is "".

  The devices keep the trainer's order (`models.sharding.make_mesh` over its flat device
  list), so a weight sync is one program over the same device assignment.

  Args:
    config: the run's config.
    mesh: the trainer's mesh.

  Returns:
    The engine's mesh.

  Raises:
    ValueError: a shape that does not parse or does not cover the mesh's devices.
  """
  text = config.rl.get("engine_mesh_shape", "")
  if not text:
    return mesh
  try:
    return sharding.make_mesh(sharding.MeshConfig.parse(text), list(mesh.devices.flat))
  except ValueError as e:
    raise ValueError(f"rl.engine_mesh_shape={text!r}: {e}") from e


def branch_config(config: ml_collections.ConfigDict) -> Optional[BranchConfig]:
  """The tree rollouts of a run: `rl.branch` when `rl.rollout` is "branching", else None."""
  if config.rl.rollout != "branching":
    return None
  return BranchConfig(**config.rl.branch.to_dict())
