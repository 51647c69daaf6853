"""Optimizers: AdamW, Muon and MuonClip (Muon + QK-Clip) as optax transformations, the routing
of every parameter to one of them, the learning-rate schedules and the optimizer state's dtype.

    opt = optim.build(config.optimizer, model_cfg)     # routing comes from the model's axes
    print(optim.format_table(opt.table))               # path, shape, optimizer, dimension numbers
    params = nnx.as_pure(nnx.state(model, nnx.Param))  # optax works on the pure parameter tree
    state = opt.init(params)
    updates, state = opt.update(grads, state, params, max_logits=aux["max_logits"])
    params = optax.apply_updates(params, updates)
    optim.metrics(opt, state)                          # grad_norm, lr, qk_clipped_heads, max_logit

What `opt.tx` (an `optax.GradientTransformationExtraArgs`, built by `make_tx` in optimizer.py)
does per update:

1. `clip_by_global_norm_with_stats` (transforms.py): clip the (already summed) gradient by its
   global norm, recording the pre-clip norm in the state (`metrics(...)["grad_norm"]`).
2. The base optimizer.
   - `adamw`: `optax.adamw` on every parameter.
   - `muon` / `muon_clip`: `optax.partition` into a Muon branch
     (`optax.contrib.scale_by_muon`: bias-corrected EMA momentum with Nesterov, 5 Newton–Schulz
     steps with (3.4445, −4.7750, 2.0315), with an explicit `MuonDimensionNumbers` per leaf;
     then the shape scale, `scale_by_shape`; decoupled weight decay λ·W; ×(−lr)) and an AdamW
     branch (embeddings, lm_head, norm gains, biases, router weights; β2 = `muon.adam_b2`).
     This is the chain `optax.contrib.muon` builds, composed here from its public pieces so
     that the AdamW branch is plain AdamW (optax.contrib.muon turns on Nesterov in its Adam
     branch and has no weight-decay mask there) and so that no leaf is routed by rank alone
     (optax.contrib.muon's default sends every 2-D leaf, embeddings included, to Muon).
     Which leaf goes where, with which dimension numbers and scale: routing.py.
3. `muon_clip` / `adamw_clip`: `qk_clip` (qk_clip.py), which takes this step's `max_logits`
   [layers, heads] (from the forward aux) as an extra argument and returns, as part of the
   update, the weight change that clips every head whose max logit exceeds τ.

The learning rate follows `schedule` (schedules.py). Gradient accumulation: the losses are
masked sums normalised by global counts, so the train step (trainer/step.py) *sums* the
micro-batch gradients, never averages them (optax.MultiSteps averages, which would divide a
second time), and clipping happens once, in `tx`, on the sum.

Optimizer state is kept in `state_dtype` (`with_state_dtype`: fp32 default; bf16 stores the
moment trees in bf16 and computes in fp32) and sharded like the parameters
(`Optimizer.state_shardings`). Settings: config.py (`OptimizerConfig`, read from the
`config.optimizer` section whose defaults live in configs/base.py).

References:
  Keller Jordan, "Muon: An optimizer for hidden layers in neural networks", 2024.
  Liu et al., "Muon is Scalable for LLM Training" (Moonlight), arXiv 2502.16982, 2025.
  Kimi Team, "Kimi K2: Open Agentic Intelligence", arXiv 2507.20534, 2025 (MuonClip, QK-Clip).
"""

from trainer.optim.config import (NAMES, SCALE_RULES, SCHEDULES, STATE_DTYPES, WSD_DECAY_SHAPES,
                                  MuonConfig, OptimizerConfig, QKClipConfig)
from trainer.optim.optimizer import (Optimizer, build, make_tx, metrics, print_table,
                                      tx_state_shardings)
from trainer.optim.qk_clip import QKClipState, qk_clip
from trainer.optim.routing import (Route, format_table, param_suffix, path_names, route,
                                   routing_table)
from trainer.optim.schedules import schedule
from trainer.optim.transforms import (ClipState, clip_by_global_norm_with_stats, scale_by_shape,
                                      with_state_dtype)
