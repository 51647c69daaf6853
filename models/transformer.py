"""The Transformer: one Flax NNX module for dense GQA and MoE + MLA decoders.

Layers are stored stacked (leading `layers` axis) in up to two stacks, scanned with
`jax.lax.scan` (or looped, `ModelConfig.scan_layers`): `dense_layers` (a dense model's layers,
or a MoE model's first `first_k_dense_replace` layers) and `moe_layers`. Forward:

    logits, aux = model(tokens, positions, end)

with tokens, positions, end: [batch, seq] int32; `end` follows the tree rule of
models/kernels/attention.py. aux holds `max_logits` [layers, heads] (QK-Clip), and for MoE
models `moe_load` [moe_layers, experts], `balance_loss` and `expert_ids`
[moe_layers, batch, seq, k]. `init` (host) and `init_sharded` (on a mesh) build initialised
models.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import lora
from models.attention import GQA, MLA
from models.config import ModelConfig
from models.layers import MLP, RMSNorm, dtype_of, initial_value, param, round_to
from models.moe import MoE, update_router_bias
from models.rope import cos_sin
from models.sharding import constrain, shard_model, state_shardings

REMAT_POLICIES = {
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}


class LayerInputs(NamedTuple):
  """What every layer of one forward pass reads besides the residual stream and its cache.

  Attributes:
    cos: rotary cosines of the positions (`models.rope.cos_sin`).
    sin: rotary sines of the positions.
    end: [batch, seq] int32 tree-rule ends, or None when attending to a decode cache (the
      cache view then defines what each query sees).
    token_weights: [batch, seq] fp32 logical token counts for MoE load statistics.
    index: [batch] int32 cache slot of each row's first token, or None without a cache.
    page_table: [batch, pages_per_seq] int32 pages of each row with a paged cache
      (`init_paged_cache`), else None.
  """

  cos: jax.Array
  sin: jax.Array
  end: jax.Array | None
  token_weights: jax.Array
  index: jax.Array | None
  page_table: jax.Array | None = None


class Block(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x)) (dense or MoE).

  Args:
    cfg: the model config (`attention` picks MLA or GQA).
    moe: a MoE block (else a dense SwiGLU MLP of `intermediate_size`).
  """

  def __init__(self, cfg: ModelConfig, moe: bool):
    self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    self.attn = MLA(cfg) if cfg.attention == "mla" else GQA(cfg)
    self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    self.mlp = MoE(cfg) if moe else MLP(cfg.hidden_size, cfg.intermediate_size, cfg)

  def __call__(self, x: jax.Array, inputs: LayerInputs, cache: dict | None = None,
               expert_ids: jax.Array | None = None) -> tuple[jax.Array, dict, dict | None]:
    """Apply the block.

    Args:
      x: [batch, seq, hidden] residual stream.
      inputs: the forward pass's per-layer inputs.
      cache: this layer's decode cache, or None.
      expert_ids: [batch, seq, k] expert choices to replay (MoE blocks), or None to route.

    Returns:
      The new residual stream, the aux dict (`max_logits` [heads], plus the MoE entries) and
      the updated cache (None without one).
    """
    h, max_logits, cache = self.attn(self.attn_norm(x), inputs.cos, inputs.sin, inputs.end,
                                     cache, inputs.index, inputs.page_table)
    # Residual sums are rounded where the program says (`round_to`): XLA may otherwise feed
    # the next norm an unrounded sum in one program and the rounded stream in another.
    x = round_to(x + h, x.dtype)
    aux = {"max_logits": max_logits}
    if isinstance(self.mlp, MoE):
      h, moe_aux = self.mlp(self.mlp_norm(x), inputs.token_weights, expert_ids)
      aux.update(moe_aux)
    else:
      h = self.mlp(self.mlp_norm(x))
    return round_to(x + h, x.dtype), aux, cache


def _stacked_blocks(cfg: ModelConfig, moe: bool, n: int) -> Block:
  """A Block whose variables carry a leading `layers` axis of size n (placeholder values;
  `init` draws each layer's parameters independently)."""
  block = Block(cfg, moe)
  for _, var in nnx.iter_graph(block):
    if isinstance(var, nnx.Variable):
      var.set_value(jnp.broadcast_to(var[...], (n,) + var.shape))
      var.set_metadata(axes=("layers",) + tuple(var.get_metadata()["axes"]))
  return block


class Transformer(nnx.Module):
  """Decoder-only transformer (see module docstring).

  `stacked=False` keeps each layer as its own Block in an `nnx.List`, applied by a Python loop
  (made with `unstack`, for decoding: a scanned stack copies every layer's weights and cache
  slice on each step on CPU; compile time then grows with depth, and `remat` is not applied).

  Args:
    cfg: the model config.
    stacked: hold each stack's layers as one Block with a leading `layers` axis (scanned).
  """

  def __init__(self, cfg: ModelConfig, stacked: bool = True):
    self.cfg = cfg
    self.embed = param((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"),
                       std=cfg.initializer_range)
    n_dense, n_moe = cfg.num_dense_layers, cfg.num_moe_layers
    if stacked:
      self.dense_layers = _stacked_blocks(cfg, False, n_dense) if n_dense else None
      self.moe_layers = _stacked_blocks(cfg, True, n_moe) if n_moe else None
    else:
      self.dense_layers = nnx.List([Block(cfg, False) for _ in range(n_dense)]) if n_dense else None
      self.moe_layers = nnx.List([Block(cfg, True) for _ in range(n_moe)]) if n_moe else None
    self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    self.lm_head = None if cfg.tie_embeddings else param(
        (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), std=cfg.initializer_range)

  def lm_head_weight(self) -> jax.Array:
    """[hidden, vocab] fp32 output projection (the embedding, transposed, when tied)."""
    return self.embed[...].T if self.lm_head is None else self.lm_head[...]

  def stacks(self) -> list[Block]:
    """The layer stacks the model has, in order (dense first)."""
    return [s for s in (self.dense_layers, self.moe_layers) if s is not None]

  def hidden(self, tokens: jax.Array, positions: jax.Array, end: jax.Array | None, *,
             token_weights: jax.Array | None = None, expert_ids: jax.Array | None = None,
             cache: dict | None = None, index: jax.Array | None = None,
             page_table: jax.Array | None = None) -> tuple[jax.Array, dict, dict | None]:
    """Final-normed hidden states of the tokens.

    Args:
      tokens: [batch, seq] int32 token ids.
      positions: [batch, seq] int32 RoPE positions.
      end: [batch, seq] int32 tree-rule ends; None (ignored) when `cache` is given, since the
        cache view then defines what each query sees.
      token_weights: [batch, seq] logical token counts for MoE load statistics (default 1).
      expert_ids: [moe_layers, batch, seq, k] expert choices to replay instead of routing.
      cache: decode caches from `init_cache`, or None.
      index: [batch] cache slot of each row's first token (with `cache`).
      page_table: [batch, pages_per_seq] int32 pages of each row when `cache` is paged
        (`init_paged_cache`); index is then each row's position.

    Returns:
      hidden [batch, seq, hidden], the aux dict (module docstring) and the updated cache
      (None without one).

    Raises:
      ValueError: `end` is None without a cache.
    """
    cfg = self.cfg
    if end is None and cache is None:
      raise ValueError("Transformer.hidden: `end` is required without a cache")
    # Gather the FSDP shards of the table first: the batch is sharded over fsdp too, and XLA
    # cannot move a gather result from embed-sharded to batch-sharded without replicating.
    table = constrain(self.embed[...], ("vocab", None), cfg)
    x = jnp.take(table, tokens, axis=0).astype(dtype_of(cfg))
    x = constrain(x, ("batch", "seq", "act_embed"), cfg)
    cos, sin = cos_sin(cfg, positions)
    if token_weights is None:
      token_weights = jnp.ones(tokens.shape, jnp.float32)
    inputs = LayerInputs(cos, sin, end, token_weights, index, page_table)
    aux: dict[str, Any] = {}
    new_cache = {}
    for name, stack in (("dense", self.dense_layers), ("moe", self.moe_layers)):
      if stack is None:
        continue
      ids = expert_ids if name == "moe" else None
      layer_cache = None if cache is None else cache[name]
      apply = (_loop if isinstance(stack, nnx.List) else _scan if cfg.scan_layers
               else _sliced_loop)
      x, stack_aux, new_cache[name] = apply(stack, cfg, x, inputs, layer_cache, ids)
      for key, value in stack_aux.items():
        aux.setdefault(key, []).append(value)
    aux = {k: v[0] if len(v) == 1 else jnp.concatenate(v) for k, v in aux.items()}
    if "balance_loss" in aux:
      aux["balance_loss"] = aux["balance_loss"].sum()
      aux["moe_load"] = aux.pop("load")
    return self.final_norm(x), aux, (new_cache if cache is not None else None)

  def __call__(self, tokens: jax.Array, positions: jax.Array, end: jax.Array | None, **kwargs
               ) -> tuple[jax.Array, dict]:
    """Full fp32 logits [batch, seq, vocab] and the aux dict (arguments as `hidden`)."""
    h, aux, _ = self.hidden(tokens, positions, end, **kwargs)
    logits = jnp.dot(h.astype(jnp.float32), self.lm_head_weight())
    return constrain(logits, ("batch", "seq", "act_vocab"), self.cfg), aux

  def update_router_bias(self, moe_load: jax.Array) -> None:
    """Aux-loss-free balancing, outside the gradient.

    Nudges each MoE layer's selection bias by `bias_update_rate` towards the mean load.

    Args:
      moe_load: [moe_layers, experts] a step's aux["moe_load"] (averaged over micro-batches
        and data-parallel replicas).

    Raises:
      ValueError: the model is unstacked or has no router bias.

    References:
      Wang et al., "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts",
      arXiv:2408.15664.
    """
    if isinstance(self.moe_layers, nnx.List):
      raise ValueError("update_router_bias: the model is unstacked (update the stacked model)")
    bias = None if self.moe_layers is None else self.moe_layers.mlp.router_bias
    if bias is None:
      raise ValueError("update_router_bias: the model has no router bias "
                       f"(num_experts={self.cfg.num_experts}, router_bias={self.cfg.router_bias})")
    bias[...] = update_router_bias(bias[...], moe_load, self.cfg.bias_update_rate)

  def init_cache(self, batch: int, capacity: int) -> dict:
    """Zeroed decode caches.

    Args:
      batch: rows of the cache.
      capacity: tokens each row holds.

    Returns:
      {stack: {name: [layers, batch, ...]}} (see the attention layers' `init_cache` for the
      rest of the shape); an unstacked model has a list of per-layer {name: [batch, ...]} per
      stack.
    """
    return self._per_layer(lambda attn: attn.init_cache(batch, capacity))

  def init_paged_cache(self, num_pages: int, page_size: int) -> dict:
    """Zeroed paged decode caches: one pool of pages per layer, shared by all sequences.

    Args:
      num_pages: pages in each layer's pool.
      page_size: token positions per page.

    Returns:
      {stack: {name: [layers, kv_heads, num_pages, page_size, dim]}} (see the attention
      layers' `init_paged_cache`); an unstacked model has a list of per-layer
      {name: [kv_heads, num_pages, page_size, dim]} per stack.
    """
    return self._per_layer(lambda attn: attn.init_paged_cache(num_pages, page_size))

  def _per_layer(self, make) -> dict:
    """{stack: make(attention) per layer}: a list on an unstacked model, else stacked."""
    out = {}
    for name, stack in (("dense", self.dense_layers), ("moe", self.moe_layers)):
      if isinstance(stack, nnx.List):
        out[name] = [make(block.attn) for block in stack]
      elif stack is not None:
        n = _num_layers(stack)
        out[name] = jax.tree.map(lambda a: jnp.broadcast_to(a, (n,) + a.shape), make(stack.attn))
    return out

  def decode_step(self, tokens: jax.Array, cache: dict, index: jax.Array,
                  positions: jax.Array | None = None, page_table: jax.Array | None = None
                  ) -> tuple[jax.Array, dict]:
    """Run new tokens against the cache (s = 1 when decoding, more when prefilling).

    Args:
      tokens: [batch, s] int32 new tokens.
      cache: decode caches from `init_cache`, or paged ones from `init_paged_cache`.
      index: [batch] cache slot of each row's first new token (its current length).
      positions: [batch, s] RoPE positions; default the cache slots.
      page_table: [batch, pages_per_seq] int32 pages of each row, with a paged cache.

    Returns:
      fp32 logits [batch, s, vocab] and the updated cache.
    """
    s = tokens.shape[1]
    if positions is None:
      positions = index[:, None] + jnp.arange(s, dtype=jnp.int32)[None]
    h, _, cache = self.hidden(tokens, positions, None, cache=cache, index=index,
                              page_table=page_table)
    return jnp.dot(h.astype(jnp.float32), self.lm_head_weight()), cache


def _num_layers(stack: Block) -> int:
  return jax.tree.leaves(nnx.state(stack, nnx.Param))[0].shape[0]


def _layer_body(graphdef, cfg: ModelConfig, inputs: LayerInputs):
  """(x, (layer_state, layer_cache, expert_ids)) -> (x, (aux, layer_cache)): one block of a
  stack, rematerialised as `cfg.remat` says."""
  def body(x, xs):
    layer_state, layer_cache, ids = xs
    y, aux, layer_cache = nnx.merge(graphdef, layer_state)(x, inputs, layer_cache, ids)
    return y, (aux, layer_cache)

  if cfg.remat == "full":
    return jax.checkpoint(body)
  if cfg.remat != "none":
    return jax.checkpoint(body, policy=REMAT_POLICIES[cfg.remat])
  return body


def _scan(stack: Block, cfg: ModelConfig, x, inputs: LayerInputs, cache, expert_ids):
  """Apply the stacked blocks in order with lax.scan (one compiled body for all layers)."""
  graphdef, state = nnx.split(stack)
  body = _layer_body(graphdef, cfg, inputs)
  x, (aux, cache) = jax.lax.scan(body, x, (state, cache, expert_ids))
  return x, aux, cache


def _sliced_loop(stack: Block, cfg: ModelConfig, x, inputs: LayerInputs, cache, expert_ids):
  """Apply the stacked blocks by a Python loop over layer slices of the stacked weights (and
  cache): the backward pass keeps each layer's residuals in buffers of their own, where
  lax.scan stacks them into [layers, ...] buffers (copies on CPU). Compile time grows with
  depth. Outputs as `_scan`."""
  graphdef, state = nnx.split(stack)
  body = _layer_body(graphdef, cfg, inputs)
  outs = []
  for i in range(_num_layers(stack)):
    x, out = body(x, jax.tree.map(lambda a: a[i], (state, cache, expert_ids)))
    outs.append(out)
  aux, cache = jax.tree.map(lambda *a: jnp.stack(a), *outs)
  return x, aux, cache


def _loop(blocks: nnx.List, cfg: ModelConfig, x, inputs: LayerInputs, caches, expert_ids):
  """Apply unstacked blocks in order; aux gets a leading layer axis, as from `_scan`."""
  del cfg  # unstacked blocks are not rematerialised
  auxes, new_caches = [], []
  for i, block in enumerate(blocks):
    ids = None if expert_ids is None else expert_ids[i]
    x, aux, cache = block(x, inputs, None if caches is None else caches[i], ids)
    auxes.append(aux)
    new_caches.append(cache)
  return x, jax.tree.map(lambda *a: jnp.stack(a), *auxes), (None if caches is None else new_caches)


def unstack(model: Transformer) -> Transformer:
  """The same model with each layer as a Block of its own.

  Each layer's Block is the stacked Block's graph merged with that layer's slice of every
  variable, so whatever the Blocks hold (LoRA adapters, qwix-quantized kernels) carries over.

  Args:
    model: a stacked Transformer.

  Returns:
    A `Transformer(stacked=False)` (the same class, adapters included) holding copies of the
    model's weights.
  """
  out = nnx.clone(model)
  for name in ("dense_layers", "moe_layers"):
    stack = getattr(model, name)
    if stack is None:
      continue
    graphdef, state = nnx.split(stack)
    blocks = []
    for i in range(_num_layers(stack)):
      block = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))
      for _, var in nnx.iter_graph(block):
        if isinstance(var, nnx.Variable) and var.get_metadata().get("axes", ())[:1] == ("layers",):
          var.set_metadata(axes=var.get_metadata()["axes"][1:])
      blocks.append(block)
    setattr(out, name, nnx.List(blocks))
  return out


def abstract(cfg: ModelConfig) -> Transformer:
  """The model with ShapeDtypeStruct leaves: shapes and axes without allocating anything
  (with `cfg.lora_rank`, its adapters and quantized base too)."""
  return nnx.eval_shape(lambda: with_adapters(Transformer(cfg)))


def with_adapters(model: Transformer, cfg: ModelConfig | None = None, seed: int = 0
                  ) -> Transformer:
  """The model with the LoRA adapters (and quantized base) a config asks for (`models.lora`).

  Args:
    model: a Transformer, e.g. a plain base loaded from a checkpoint.
    cfg: the config with the adapter settings (default the model's own).
    seed: seed of the adapters' A matrices.

  Returns:
    The model itself when `cfg.lora_rank` is 0 or it has adapters already, else a new model
    (sharing the base's arrays) whose `cfg` is `cfg`.
  """
  cfg = cfg or model.cfg
  if not cfg.lora_rank or lora.has_adapters(model):
    return model
  return lora.apply(model, cfg, Transformer, seed)


def merge_adapters(model: Transformer) -> Transformer:
  """The plain model a LoRA model computes: every adapted kernel or expert stack
  W + (alpha / rank) A B, every quantized kernel dequantized (`lora.merge`), the rest shared.

  Args:
    model: a stacked Transformer with adapters or quantized kernels.

  Returns:
    A stacked fp32-parameter Transformer of `lora.base_config(model.cfg)`.
  """
  kernels = lora.merge(model, model.cfg)
  graphdef, state = nnx.split(abstract(lora.base_config(model.cfg)))
  flat = []
  for path, var in nnx.to_flat_state(state):
    if path in kernels:
      value = kernels[path]
    else:
      value = lora.module_at(model, path[:-1]).__dict__[path[-1]].get_value()
    flat.append((path, var.replace(value)))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))



def init(cfg: ModelConfig, seed: int = 0) -> Transformer:
  """A randomly initialised Transformer on the default device, drawn on the host with NumPy.

  Host drawing compiles nothing (XLA's CPU compile of one random program per parameter costs
  ~0.5 s each). On a mesh use `init_sharded`, which draws directly sharded with `jax.random`
  (different numbers for the same seed).

  Args:
    cfg: the model config.
    seed: NumPy generator seed.

  Returns:
    The model, each parameter drawn by the initialiser `layers.param` recorded.
  """
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg)))
  rng = np.random.default_rng(seed)

  def value(var):
    meta = var.get_metadata()
    if meta.get("init") == "normal":
      return jnp.asarray(meta["std"] * rng.standard_normal(var.shape, np.float32))
    return (jnp.ones if meta.get("init") == "ones" else jnp.zeros)(var.shape, var.dtype)

  return with_adapters(nnx.merge(graphdef, jax.tree.map(
      lambda v: v.replace(value(v)), state, is_leaf=lambda x: isinstance(x, nnx.Variable))),
      seed=seed)


def initial_state(abstract_state: nnx.State, key: jax.Array) -> nnx.State:
  """Initial values for every variable of a model state, with `jax.random`.

  Args:
    abstract_state: the state of `abstract(cfg)` (or any state of variables made by
      `layers.param`).
    key: PRNG key; each variable draws from it folded with its position in the state.

  Returns:
    The state with every variable drawn by its recorded initialiser.
  """
  leaves, treedef = jax.tree.flatten(abstract_state,
                                     is_leaf=lambda x: isinstance(x, nnx.Variable))
  return jax.tree.unflatten(treedef, [
      var.replace(initial_value(var, jax.random.fold_in(key, i))) for i, var in enumerate(leaves)])


def init_sharded(cfg: ModelConfig, mesh: jax.sharding.Mesh, seed: int = 0) -> Transformer:
  """A randomly initialised Transformer drawn directly sharded on `mesh`.

  All variables are drawn in one jit whose out_shardings follow the config's rules, so no
  device ever holds a full copy. The numbers differ from `init`'s for the same seed.

  Args:
    cfg: the model config (its `sharding_rules` place the parameters).
    mesh: the device mesh (`models.sharding.make_mesh`).
    seed: PRNG seed.

  Returns:
    The model with every variable sharded on `mesh`.
  """
  graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg)))
  shardings = state_shardings(abstract_state, cfg, mesh)
  create = jax.jit(lambda key: initial_state(abstract_state, key), out_shardings=shardings)
  with jax.set_mesh(mesh):
    state = create(jax.random.key(seed))
  model = nnx.merge(graphdef, state)
  return shard_model(with_adapters(model, seed=seed), mesh) if cfg.lora_rank else model
