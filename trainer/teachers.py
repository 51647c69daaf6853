"""On-policy distillation teachers: one expert checkpoint per domain scores the student's tokens.

    teachers = Teachers(config, mesh)             # config.distill.teachers "domain=ckpt:<dir>"
    domain = teachers.domain_of(task)             # the task's "domain" field, else its kind
    mb = mb.with_fields(teacher_logprobs=teachers.logprobs_of_groups(mb, groups, tasks))

"Specialize, then unify" (KAT-Coder-V2): the loss adds `distill.opd_coef` x OPD, whose
per-token advantage is sg(log π_teacher - log π_θ) (rl.losses.opd).
"""

from __future__ import annotations

import jax
import ml_collections
import numpy as np

from trainer import config as config_lib
from trainer import harness
from trainer import step as step_lib


class Teachers:
  """Per domain, a teacher's weights and its score function.

  Args:
    config: a mode "distill" config (`distill.teachers`, `distill.choose`).
    mesh: the device mesh the teachers score on (None: one device).

  Raises:
    ConfigError: no teacher.
  """

  def __init__(self, config: ml_collections.ConfigDict, mesh=None):
    self.choose = config.distill.choose
    self.by_domain = {}
    for entry in config.distill.teachers:
      domain, _, ckpt = entry.partition("=")
      sub = ml_collections.ConfigDict(config.to_dict())
      sub.model.init, sub.model.preset = ckpt, ""
      cfg = config_lib.model_config(sub)
      model = harness.initial_model(sub, cfg)
      self.by_domain[domain] = (step_lib.make_score_fn(cfg, mesh=mesh), model)
    if not self.by_domain:
      raise config_lib.ConfigError("config.distill.teachers=(): mode 'distill' needs at least "
                                   "one teacher 'domain=ckpt:<dir>'")

  def domain_of(self, task) -> str:
    """The teacher domain of `task`.

    Its metadata "domain", else its kind; the first teacher's when no teacher has it (or always,
    with `distill.choose = "single"`).
    """
    if self.choose == "single":
      return next(iter(self.by_domain))
    meta = getattr(task, "metadata", {}) or {}
    domain = meta.get("domain", getattr(task, "kind", ""))
    return domain if domain in self.by_domain else next(iter(self.by_domain))

  def logprobs(self, mb, domain_per_seq: np.ndarray) -> np.ndarray:
    """Teacher log-probs, each sequence scored by its domain's teacher.

    Args:
      mb: the MicroBatches.
      domain_per_seq: [M, S] the domain of each sequence ("" for padding).

    Returns:
      [M, S, T] f32 teacher log-probs (0 where no teacher scored).
    """
    out = np.zeros(np.shape(mb.seq_valid), np.float32)
    mb = mb.replace(expert_ids=None)  # a teacher routes itself (replay is the student's routing)
    for domain, (score, model) in self.by_domain.items():
      here = domain_per_seq == domain
      if here.any():
        lp = np.asarray(jax.device_get(score(model, mb)), np.float32)
        out = np.where(here[..., None], lp, out)
    return out

  def logprobs_of_groups(self, mb, groups: list[list], tasks: list) -> np.ndarray:
    """Teacher log-probs of `mb`, each group scored by its task's teacher.

    Args:
      mb: the MicroBatches packing `groups`, in order.
      groups: the packed groups (lists of trajectories of one task each).
      tasks: the step's tasks; a group's domain is that of its task (matched by task id; an
        unknown task gets the first teacher's).

    Returns:
      [M, S, T] f32 teacher log-probs (0 at padding).
    """
    by_id = {task.instance_id: task for task in tasks}
    flat = [self.domain_of(by_id.get(g[0].task_id)) for g in groups for _ in g]
    sid = np.asarray(mb.seq_id)
    domain_per_seq = np.full(sid.shape, "", object)
    domain_per_seq[sid >= 0] = [flat[k] for k in sid[sid >= 0]]
    return self.logprobs(mb, domain_per_seq)
