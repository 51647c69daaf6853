"""A trained reward model in the RL loop (`rl.reward_model`): scores, rewards, advantages.

    scorer = Scorer(rm_workdir)                    # a mode "reward_model" run's latest weights
    scored = outcome_rewards(groups, scorer.groups(groups), weight=0.5)   # ORM: into the reward
    scored = outcome_rewards(groups, scorer.groups(groups), 0.5, dense=True)       # PRM: ...
    adv = process_advantages(kept, groups.advantages_of(kept, "grpo"), 0.5)        # ... per call
    line.update(score_stats(scored))               # "rm/score_mean", "rm/score_passed", ...

The score of a step or trajectory is σ(value) in (0, 1), the head's value read as in
`trainer.reward_model` (a trajectory's at its last token, a step's at its call's last token):
an ORM's / PRM's success probability; for a model trained with the pairwise loss alone, a
monotone squash of its logit. One device; the reward model must share the policy's tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import ml_collections
import numpy as np

from envs.trajectory import Trajectory
from models import hf, value_head
from trainer import checkpoint
from trainer.reward_model import CHECKPOINTS, PASS, episode, make_model, score_episodes


class Scorer:
  """A trained reward model (a mode "reward_model" workdir) scoring trajectories for RL.

  Args:
    path: the reward model's workdir (config.json, model_config.json, rm_checkpoints/).
    batch_rows: trajectories per forward pass.

  Raises:
    FileNotFoundError: the workdir has no run files or no checkpoint.
  """

  def __init__(self, path: str, batch_rows: int = 8):
    for name in ("config.json", "model_config.json"):
      if not os.path.isfile(os.path.join(path, name)):
        raise FileNotFoundError(f"{path!r} is not a reward model's workdir: no {name}")
    with open(os.path.join(path, "config.json")) as f:
      config = ml_collections.ConfigDict(json.load(f))
    with open(os.path.join(path, "model_config.json")) as f:
      self.model_cfg = hf.config_from_json(json.load(f))
    self.rm = make_model(config, self.model_cfg)
    template = self.rm.init(value_head.init(self.model_cfg, 0))
    with checkpoint.Checkpointer(os.path.join(path, CHECKPOINTS)) as ckpt:
      restored = ckpt.restore_latest(template)
    if restored is None:
      raise FileNotFoundError(f"no reward-model checkpoint in {os.path.join(path, CHECKPOINTS)}")
    self.state, self.step = restored.state, restored.step
    self.max_len, self.batch_rows = int(config.reward_model.max_len), batch_rows

  def __call__(self, trajectories: Sequence[Trajectory]) -> list[np.ndarray]:
    """Per trajectory, σ(value) at each of its steps ([k], NaN for an unscored step); the last
    entry is the trajectory's score.

    Raises:
      ValueError: a token id outside the reward model's vocabulary (another tokenizer).
    """
    episodes = [episode(t, self.max_len) for t in trajectories]
    top = max((int(e.tokens.max()) for e in episodes), default=0)
    if top >= self.model_cfg.vocab_size:
      raise ValueError(f"rl.reward_model: token id {top} is outside the reward model's "
                       f"vocabulary ({self.model_cfg.vocab_size}); train it with the policy's "
                       "tokenizer")
    _, steps = score_episodes(self.rm, self.state, episodes, self.batch_rows)
    return [1.0 / (1.0 + np.exp(-s)) for s in steps]

  def groups(self, groups: list[list[Trajectory]]) -> list[list[np.ndarray]]:
    """`self(...)` of every trajectory of the groups, scored together, in the groups' shape."""
    flat = self([t for g in groups for t in g])
    bounds = np.cumsum([0] + [len(g) for g in groups])
    return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def outcome_rewards(groups: list[list[Trajectory]], scores: list[list[np.ndarray]],
                    weight: float, dense: bool = False) -> list[list[Trajectory]]:
  """The groups with the reward model's scores: reward = verifier reward + weight x score.

  The trajectory's score is its last step's (the value at its last token). Copies of the
  trajectories (same ids) with metadata "verifier_reward" and "rm_score" (and "rm_step_scores").

  Args:
    groups: the step's groups.
    scores: `Scorer` scores, in the groups' order.
    weight: the reward model's weight; 0 keeps the verifier's reward.
    dense: the reward stays the verifier's; the step scores enter the advantages instead
      (`process_advantages`).
  """
  out = []
  for g, gs in zip(groups, scores):
    new = []
    for t, s in zip(g, gs):
      meta = {**t.metadata, "verifier_reward": float(t.reward), "rm_score": float(s[-1]),
              "rm_step_scores": [float(x) for x in s]}
      reward = float(t.reward) + (0.0 if dense else weight * float(s[-1]))
      new.append(dataclasses.replace(t, reward=reward, metadata=meta))
    out.append(new)
  return out


def process_advantages(groups: list[list[Trajectory]], group_advantages: Sequence[np.ndarray],
                       weight: float) -> list[np.ndarray]:
  """Per-call advantages: the outcome advantage plus weight x the centred process return.

      A_{i,k} = A_i^outcome + w · Σ_{j >= k} (s_{i,j} - b),   b = mean of the group's s_{i,j}

  (PRIME's combination of outcome and dense process rewards, γ = 1, with the group's mean step
  score as the baseline). Unscored steps count as b.

  Args:
    groups: the kept groups, with "rm_step_scores" in their metadata (`outcome_rewards`).
    group_advantages: their `trainer.groups.advantages_of`: [G] per trajectory or [G, C] per
      call ("treerl").
    weight: w.

  Returns:
    Per group [G, most calls] f32 (0 past a trajectory's calls), for `trainer.groups.micro_batches`.
  """
  out = []
  for g, adv in zip(groups, group_advantages):
    steps = [np.asarray(t.metadata["rm_step_scores"], np.float64) for t in g]
    baseline = np.nanmean(np.concatenate(steps))
    width = max(max(len(s) for s in steps), adv.shape[1] if adv.ndim == 2 else 0)
    res = np.zeros((len(g), width), np.float32)
    for i, s in enumerate(steps):
      centred = np.where(np.isnan(s), 0.0, s - baseline)
      ret = np.cumsum(centred[::-1])[::-1]
      base = adv[i, :len(s)] if adv.ndim == 2 else np.full(len(s), adv[i])
      res[i, :len(s)] = base + weight * ret
    out.append(res)
  return out


def score_stats(groups: list[list[Trajectory]]) -> dict:
  """"rm/score_mean", "rm/score_passed", "rm/score_failed": the mean scores of all, of the
  verified and of the failed episodes of `outcome_rewards`' groups (NaN when there are none)."""
  pairs = [(t.metadata["rm_score"], t.metadata["verifier_reward"] >= PASS) for g in groups
           for t in g]
  mean = lambda xs: float(np.mean(xs)) if xs else float("nan")
  return {"rm/score_mean": mean([s for s, _ in pairs]),
          "rm/score_passed": mean([s for s, p in pairs if p]),
          "rm/score_failed": mean([s for s, p in pairs if not p])}
