"""In-process rollouts: react episodes in sandboxes, sampled by an in-process engine.

    rollouts = Rollouts(engine, chat, scaffold, sandbox="bwrap", concurrency=8)
    groups = rollouts.groups([(task, draw), ...], group_size=8, seed=0).result()
    trajectories = rollouts.episodes([(task, seed), ...]).result()      # one episode each
    rollouts.close()

Episodes are `envs.rollout_worker.make_react_episode` (fresh sandbox with the task's repository,
the react scaffold with the default tools, the task's verifier for the reward), exactly what a
remote rollout worker runs, with `trainer.serve.EnginePolicy` as the policy. They run on an
asyncio loop in a background thread, at most `concurrency` at once, so the engine batches the
calls of concurrent episodes together; `groups` and `episodes` return concurrent Futures, so the
RL loop can train on one step's rollouts while the next step's are sampled (async mode).

Sampling is reproducible: episode i of (task, draw) samples with `episode_seed(seed, draw, i)`
(its prompt phrasing and every call's sampling seed follow from it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
from typing import Any, Optional, Sequence

from envs.rollout_worker import make_react_episode, make_sandbox_factory, run_task_group
from envs.scaffold import ScaffoldConfig


class Rollouts:
  """Runs episodes of `engine`'s policy (see the module docstring). Not picklable; one per run."""

  def __init__(self, engine, chat, scaffold: ScaffoldConfig, *, sandbox: str = "bwrap",
               concurrency: int = 8, limits=None, sandbox_url: str = "",
               sandbox_token_file: str = ""):
    from trainer.serve import EnginePolicy

    if concurrency < 1:
      raise ValueError(f"concurrency={concurrency!r}: expected an integer >= 1")
    self.engine = engine
    self.scaffold = scaffold
    # "local" runs no isolation: acceptable only for the scripted tests that ask for it
    # sandbox "remote": a sandbox server (envs.sandbox_server) at sandbox_url
    self._make_sandbox = make_sandbox_factory(sandbox, limits=limits,
                                              allow_unsafe=sandbox == "local",
                                              url=sandbox_url or None,
                                              token_file=sandbox_token_file or None)
    self.policy = EnginePolicy(engine)  # starts the engine's thread
    self._chat = chat
    self._episode = make_react_episode(self.policy, chat, self._make_sandbox, scaffold)
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

  def groups(self, tasks: Sequence[tuple[Any, int]], group_size: int, seed: int = 0,
             scaffold: Optional[ScaffoldConfig] = None) -> concurrent.futures.Future:
    """Future of one list of trajectories per (task, draw), `group_size` episodes each (an
    episode that raised is logged and left out, so a group may come back short)."""
    episode = self._with(scaffold)

    async def run():
      return await asyncio.gather(*(run_task_group(
          task, group_size, episode, draw=draw, seed=seed, limiter=self._limiter,
          counters=self.counters) for task, draw in tasks))
    return self._call(run())

  def episodes(self, runs: Sequence[tuple[Any, int]],
               scaffold: Optional[ScaffoldConfig] = None) -> concurrent.futures.Future:
    """Future of one trajectory (or the exception it raised) per (task, seed), in order."""
    episode = self._with(scaffold)

    async def one(task, seed):
      async with self._limiter:
        return await episode(task, 0, seed)

    async def run():
      return await asyncio.gather(*(one(t, s) for t, s in runs), return_exceptions=True)
    return self._call(run())

  def _with(self, scaffold: Optional[ScaffoldConfig]):
    if scaffold is None or scaffold == self.scaffold:
      return self._episode
    return make_react_episode(self.policy, self._chat, self._make_sandbox, scaffold)

  def close(self) -> None:
    """Cancel running episodes (their sandboxes are closed), stop the loop and the engine."""
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
    self.engine.stop()


def scaffold_config(base: ScaffoldConfig, **sampling: Any) -> ScaffoldConfig:
  """`base` with sampling fields replaced (temperature, top_p, top_k, max_new_tokens, ...)."""
  return dataclasses.replace(base, **sampling)
