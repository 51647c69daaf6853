"""A value head and a critic: one scalar per position from a Transformer's final hidden states.

    critic = value_head.init(cfg, seed)              # the policy's architecture with a head
    values, aux = critic(tokens, positions, end)     # [batch, seq] f32

The value at position i is V(context up to and including token i): the value of the state the
next token is sampled from. On a tree-packed batch the value of a sampled token's state is the
one at its predicting position (`TreeBatch.seq_pred`, see `rl.advantages.tree_gae`); the tree
rule makes it equal to the value on the unpacked sequence, as for logits.

`ValueHead` also applies to the policy's own hidden states (`Transformer.hidden`), for a head
sharing the policy's trunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models import transformer
from models.config import ModelConfig
from models.layers import param


class ValueHead(nnx.Module):
  """V = h·w + b in fp32, from final-normed hidden states h.

  w and b start at 0, so an untrained critic predicts V = 0 everywhere and the first GAE
  advantages are the plain discounted returns, rather than returns shifted by a random head.

  Args:
    hidden_size: the model's hidden size.
  """

  def __init__(self, hidden_size: int):
    self.weight = param((hidden_size,), ("embed",), init="zeros")
    self.bias = param((), (), init="zeros")

  def __call__(self, hidden: jax.Array) -> jax.Array:
    """[batch, seq, hidden] hidden states -> [batch, seq] f32 values."""
    return jnp.dot(hidden.astype(jnp.float32), self.weight[...]) + self.bias[...]


class Critic(nnx.Module):
  """A Transformer trunk with a `ValueHead` (a separate model from the policy).

  Args:
    model: the trunk, typically a copy of the policy's initial weights (`nnx.clone(policy)`:
      the module itself would share, and train, the policy's parameters); its lm_head, if any,
      is kept but unused.
  """

  def __init__(self, model: transformer.Transformer):
    self.model = model
    self.head = ValueHead(model.cfg.hidden_size)

  def __call__(self, tokens: jax.Array, positions: jax.Array, end: jax.Array, **kwargs
               ) -> tuple[jax.Array, dict]:
    """Values [batch, seq] f32 and the trunk's aux dict (arguments as `Transformer.hidden`)."""
    hidden, aux, _ = self.model.hidden(tokens, positions, end, **kwargs)
    return self.head(hidden), aux


def init(cfg: ModelConfig, seed: int = 0) -> Critic:
  """A critic of architecture `cfg`: `transformer.init(cfg, seed)` plus a zero head.

  With the policy's seed (or, via `Critic(model)`, the policy's loaded weights) the critic
  starts from the policy's trunk, the usual PPO initialisation for language models.
  """
  return Critic(transformer.init(cfg, seed))


def abstract(cfg: ModelConfig) -> Critic:
  """The critic with ShapeDtypeStruct leaves: shapes and axes, nothing allocated."""
  return nnx.eval_shape(lambda: Critic(transformer.Transformer(cfg)))
