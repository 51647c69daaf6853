"""On-policy distillation template (KAT-Coder-V2 style): one student, per-domain expert teachers.

    python -m trainer.main --config=configs/distill.py:qwen2.5-coder \\
        --config.model.init=ckpt:/ckpt/sft7b --config.tokenizer.path=/ckpt/Qwen2.5-Coder-7B \\
        --config.distill.teachers="('swe=ckpt:/ckpt/swe', 'terminal=ckpt:/ckpt/terminal')" \\
        --config.rl.tasks=/data/mixed_tasks.jsonl --config.eval.tasks=/data/heldout_tasks.jsonl \\
        --config.metrics.dir=/tmp/opd7b_metrics --workdir=gs://BUCKET/runs/opd7b

ARG picks the family (default qwen2.5-coder), as in configs/rl.py:
  qwen2.5-coder  "qwen2.5" chat format;  qwen3  "chatml";  deepseek-v3  "deepseek_v3"
"Specialize, then unify": each domain expert was trained on its own (configs/rl.py on that
domain's tasks); the student samples episodes on a mix of all domains' tasks in sandboxes,
and the expert of each task's domain scores every sampled token (teacher log-probs in one
forward over the student's tree). The loss is CISPO on the tasks' rewards plus
`distill.opd_coef` x OPD: a_t = sg(log π_teacher - log π_θ) per token, the policy gradient of
the reverse KL(π_θ || π_teacher) (rl.losses.opd). `loss.name = "opd"` alone distills without
the reward term.

Teachers: "domain=ckpt:<dir>", <dir> an Arbor run's workdir or a `python -m models.hf import`
directory (import HF experts first). They must share the student's tokenizer (the scores are
of the student's token ids). A task's domain is its task-file field "domain" (any extra field
of a task line lands in Task.metadata), else its kind ("swe", "code", "exact", "judge"); a
domain without a teacher goes to the first teacher (`distill.choose = "single"`: always it).
The /path/to/ values are placeholders: the run refuses to start until model.init and rl.tasks
point at real files; the teachers' directories are read when the run loads them (start-up
checks only their "domain=ckpt:<dir>" form), eval.tasks by mode "eval".
Sizes are for a TPU slice (bf16 compute, full remat); each teacher adds its weights and a
scoring forward per micro-batch.
"""

import ml_collections

from configs import rl as rl_template
from configs.base import FAMILIES  # family -> (chat format, example checkpoint)

TEACHERS = (  # domain=ckpt:<expert dir> (placeholders)
    "swe=ckpt:/path/to/swe_expert",
    "terminal=ckpt:/path/to/terminal_expert",
)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  family = arg or "qwen2.5-coder"
  if family not in FAMILIES:
    raise ValueError(f"configs/distill.py:{family}: expected one of {sorted(FAMILIES)}")
  c = rl_template.get_config(family)  # model, tokenizer, mesh, rollouts: configs/rl.py
  c.mode = "distill"

  c.distill.teachers = TEACHERS  # one expert checkpoint per domain
  c.distill.choose = "by_domain"  # teacher of a task: its "domain" field, else its kind
  c.distill.opd_coef = 1.0  # weight of the OPD term added to the RL loss (sets loss.opd_coef)

  c.loss.name = "cispo"  # the RL term on the tasks' rewards ("opd": distillation only)
  c.loss.aggregation = "token_mean"  # the OPD term is aggregated the same way
  c.loss.eps_low = 1.0  # IS weight >= 0 (no lower clip)
  c.loss.eps_high = 4.0  # IS weight <= 5
  c.loss.kl_coef = 0.0  # the teachers anchor the policy: no KL-to-reference term
  c.loss.opd_coef = 0.0  # unused here: mode "distill" takes distill.opd_coef

  c.optimizer.learning_rate = 1e-6  # peak learning rate
  c.rl.drop_constant_groups = False  # all-pass / all-fail groups still carry the teacher signal
  c.rl.prompts_per_step = 32  # tasks (groups) per step, mixed over the domains
  c.rl.group_size = 8  # episodes per task: distillation needs fewer than reward-only RL
  c.rl.tasks = "/path/to/mixed_domain_tasks.jsonl"  # task JSONL with "domain" fields (placeholder)
  c.train.steps = 300  # distillation steps
  return c
