"""Mixture of experts: DeepSeek-V3 and Qwen3-MoE routers, dropless dispatch, shared experts.

Routing (per token, fp32):
  softmax scoring (Qwen3-MoE): s = softmax(x·W_r); choose top-k of s.
  sigmoid scoring (DeepSeek-V3): s = sigmoid(x·W_r); choose top-k of s + b, where b is the
    aux-loss-free bias (selection only), optionally restricted to the `topk_group` best of
    `n_group` groups (group score = sum of its top-2 choice scores).
  gate weights = s of the chosen experts, renormalised when `norm_topk_prob`, times
  `routed_scaling_factor`.
Experts (`moe_impl`): "ragged" sorts the token copies by expert and runs `jax.lax.ragged_dot`
(no capacity, no drops); "dense" runs every expert on every token (the test reference).
Dispatch (`moe_dispatch`, "ragged" only): "global" sorts all copies at once and leaves the
partitioning to XLA, which replicates the copies (or the expert stacks) across devices; it is
the reference. On a mesh whose expert axis is > 1, "all_to_all" sends each copy to the device
holding its expert and back (models/expert_parallel.py). Routing (on each device's own
tokens under a mesh), load statistics and shared experts are the same for every path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from models import expert_parallel
from models.config import ModelConfig
from models.layers import MLP, RouterBias, dtype_of, param
from models.sharding import constrain


def route(cfg: ModelConfig, logits: jax.Array, bias: jax.Array | None,
          expert_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Choose experts for each token.

  Args:
    cfg: the model config (`score_func`, `n_group`, `topk_group`, `experts_per_token`,
      `norm_topk_prob`, `routed_scaling_factor`).
    logits: [tokens, experts] fp32 router logits.
    bias: [experts] selection bias, or None.
    expert_ids: [tokens, k] given choices (routing replay); a token whose ids are negative
      (not recorded) chooses its own. None = every token chooses.

  Returns:
    (expert_ids [tokens, k] int32, gate weights [tokens, k] fp32, scores [tokens, experts]).

  References:
    DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437, §2.1.2.
  """
  if cfg.score_func == "softmax":
    scores = jax.nn.softmax(logits, axis=-1)
  else:
    scores = jax.nn.sigmoid(logits)
  choice = scores if bias is None else scores + bias
  if cfg.n_group > 1:
    t = choice.shape[0]
    grouped = choice.reshape(t, cfg.n_group, -1)
    group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [t, n_group]
    _, keep = jax.lax.top_k(group_scores, cfg.topk_group)
    group_mask = jnp.zeros_like(group_scores, bool).at[jnp.arange(t)[:, None], keep].set(True)
    choice = jnp.where(group_mask[:, :, None], grouped, -jnp.inf).reshape(t, -1)
  _, chosen = jax.lax.top_k(choice, cfg.experts_per_token)
  if expert_ids is not None:
    recorded = jnp.all(expert_ids >= 0, axis=-1, keepdims=True)
    chosen = jnp.where(recorded, expert_ids, chosen)
  expert_ids = chosen.astype(jnp.int32)
  weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
  if cfg.norm_topk_prob:
    weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
  return expert_ids, weights * cfg.routed_scaling_factor, scores


def _route_and_flips(cfg: ModelConfig, logits, given, bias):
  """`route`, plus under replay a per-token [tokens, 2] (own choice differs from the recorded
  one, the token has a recording): how often the trainer would have routed differently."""
  ids, gates, scores = route(cfg, logits, bias, given)
  if given is None:
    return ids, gates, scores
  own = route(cfg, logits, bias)[0]
  recorded = jnp.all(given >= 0, axis=-1)
  flipped = recorded & jnp.any(jnp.sort(own, -1) != jnp.sort(ids, -1), axis=-1)
  return ids, gates, scores, jnp.stack([flipped, recorded], -1).astype(jnp.float32)


class MoE(nnx.Module):
  """Routed experts (+ shared experts) replacing the dense MLP of a block.

  Args:
    cfg: the model config (`num_experts`, `moe_intermediate_size`, `num_shared_experts`,
      routing fields, `moe_impl`, `moe_dispatch`).
  """

  def __init__(self, cfg: ModelConfig):
    self.cfg = cfg
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    std = cfg.initializer_range
    self.router = param((d, e), ("embed", "experts"), std=std)
    self.router_bias = RouterBias(jnp.zeros((e,), jnp.float32), axes=("experts",)) \
        if cfg.router_bias else None
    self.gate_proj = param((e, d, f), ("experts", "embed", "expert_mlp"), std=std)
    self.up_proj = param((e, d, f), ("experts", "embed", "expert_mlp"), std=std)
    self.down_proj = param((e, f, d), ("experts", "expert_mlp", "embed"), std=std)
    self.shared = MLP(d, f * cfg.num_shared_experts, cfg) if cfg.num_shared_experts \
        else None

  def __call__(self, x: jax.Array, token_weights: jax.Array,
               expert_ids: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """Route each token to its experts and combine their outputs.

    Args:
      x: [batch, seq, hidden].
      token_weights: [batch, seq] logical token counts for the load statistics.
      expert_ids: [batch, seq, k] choices to replay, or None to route.

    Returns:
      (y [batch, seq, hidden], aux) with aux holding `load` [experts] (weighted share of
      assignments), `balance_loss`, `expert_ids` [batch, seq, k] and, when replaying,
      `replay_flips` [2]: logical tokens whose own choice differs from the replayed one, and
      tokens replayed (those with a recording).
    """
    cfg = self.cfg
    b, s, d = x.shape
    xt = x.reshape(b * s, d)
    logits = jnp.dot(xt.astype(jnp.float32), self.router[...])
    bias = None if self.router_bias is None else self.router_bias[...]
    bias = None if bias is None else jax.lax.stop_gradient(bias)
    given = None if expert_ids is None else expert_ids.reshape(b * s, -1)
    ids, gates, scores, *flips = expert_parallel.token_local(
        cfg, functools.partial(_route_and_flips, cfg), (logits, given), (bias,))
    dt = dtype_of(cfg)
    # a stack quantized by qwix (`models.lora`) is passed on as it is, for its grouped matmul
    # interception to read
    w_gate, w_up, w_down = (_stack(p, dt) for p in (self.gate_proj, self.up_proj,
                                                    self.down_proj))
    if cfg.moe_impl == "dense":
      h = jax.nn.silu(jnp.einsum("td,edf->tef", xt.astype(dt), w_gate)) \
          * jnp.einsum("td,edf->tef", xt.astype(dt), w_up)
      y_all = jnp.einsum("tef,efd->ted", h, w_down)
      combine = jnp.zeros((b * s, cfg.num_experts), jnp.float32).at[
          jnp.arange(b * s)[:, None], ids].add(gates)
      y = jnp.einsum("te,ted->td", combine.astype(dt), y_all)
    elif layout := expert_parallel.plan(cfg):
      y = expert_parallel.all_to_all_experts(layout, xt.astype(dt), ids, gates.astype(dt),
                                             w_gate, w_up, w_down)
    else:
      y = _ragged_experts(xt.astype(dt), ids, gates.astype(dt), w_gate, w_up, w_down)
    y = y.reshape(b, s, d)
    if self.shared is not None:
      y = y + self.shared(x)
    aux = _statistics(cfg, ids.reshape(b, s, -1), scores.reshape(b, s, -1), token_weights)
    aux["expert_ids"] = ids.reshape(b, s, -1)
    if flips:  # replay: (flipped, recorded) logical tokens of this layer
      aux["replay_flips"] = jax.lax.stop_gradient(
          (flips[0] * token_weights.reshape(-1, 1).astype(jnp.float32)).sum(0))
    return constrain(y.astype(x.dtype), ("batch", "seq", "act_embed"), cfg), aux


def _stack(w, dtype) -> jax.Array:
  w = w.get_value() if isinstance(w, nnx.Variable) else w
  return w.astype(dtype) if isinstance(w, jax.Array) else w


def _ragged_experts(x, ids, gates, w_gate, w_up, w_down):
  """Global dispatch: sort all T·k token copies by expert, grouped matmuls, scatter-add."""
  t, k = ids.shape
  flat = ids.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  token = order // k
  sizes = jnp.bincount(flat, length=w_gate.shape[0]).astype(jnp.int32)
  ys = expert_parallel.grouped_ffn(x[token], sizes, w_gate, w_up, w_down) \
      * gates.reshape(-1)[order][:, None]
  return jnp.zeros_like(x).at[token].add(ys)


def _statistics(cfg: ModelConfig, ids, scores, token_weights) -> dict:
  """Expert load and the DeepSeek-V3 sequence-wise balance loss.

  load_i = Σ_tokens w_t·[i chosen] / Σ_tokens w_t·k (a token shared by n sequences has w = n).
  Per sequence (row): f_i = E/(k·T)·#(tokens routed to i), P_i = mean_t s_i/Σ_j s_j,
  loss = coef·Σ_i f_i·P_i, averaged over rows.
  """
  e, k = cfg.num_experts, cfg.experts_per_token
  onehot = jax.nn.one_hot(ids, e, dtype=jnp.float32).sum(-2)  # [b, s, e]
  w = token_weights.astype(jnp.float32)[..., None]
  load = (onehot * w).sum((0, 1)) / jnp.maximum(w.sum() * k, 1e-9)
  n = jnp.maximum(w.sum(1), 1e-9)  # [b, 1] logical tokens per row
  f = e / k * (onehot * w).sum(1) / n
  p = ((scores / scores.sum(-1, keepdims=True)) * w).sum(1) / n
  balance = cfg.seq_balance_coef * jnp.mean((f * p).sum(-1))
  return {"load": jax.lax.stop_gradient(load), "balance_loss": balance}


def update_router_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
  """Aux-loss-free balancing step: b_i += rate·sign(mean_load − load_i), outside the gradient.

  Args:
    bias: [..., experts] selection bias (e.g. stacked over layers).
    load: [..., experts] observed load.
    rate: step size.

  Returns:
    The new bias.

  References:
    Wang et al., "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts",
    arXiv:2408.15664; DeepSeek-V3 Technical Report, arXiv:2412.19437, §2.1.2.
  """
  return bias + rate * jnp.sign(load.mean(-1, keepdims=True) - load)
