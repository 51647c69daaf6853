"""Sampling math of the decode program: per-row temperature, min-p, top-k and top-p sampling
(Gumbel-max), the entropy of a next-token distribution, and token masks (a packed bitmask
unpacked to allowed tokens; a row's stop ids held back until it has `min_tokens` tokens).

Pure functions of [batch, vocab] fp32 logits, traced inside `programs.decode`; nothing here
is jitted on its own.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           keys: jax.Array, min_p: Optional[jax.Array] = None) -> jax.Array:
  """Sample one token per row with per-row settings (Gumbel-max).

  The logits are divided by the temperature; min-p then keeps the tokens whose probability
  (at that temperature) is at least min_p times the most likely one's; top-k is applied next,
  then top-p keeps the smallest prefix of the renormalised top-k distribution whose mass
  reaches top_p. Tokens masked out beforehand (logit -inf) are never drawn.

  Args:
    logits: [batch, vocab] fp32.
    temperature: [batch]; 0 = greedy (argmax).
    top_k: [batch] int; 0 = off.
    top_p: [batch]; 1 = off.
    keys: [batch] one PRNG key per row.
    min_p: [batch] in [0, 1]; 0 = off (None: off for every row).

  Returns:
    [batch] int32 token ids.

  References:
    Holtzman et al., "The Curious Case of Neural Text Degeneration" (top-p), arXiv:1904.09751.
  """
  greedy = jnp.argmax(logits, -1).astype(jnp.int32)

  def draw(_):
    x = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    if min_p is not None:
      x = jax.lax.cond(jnp.any(min_p > 0), _min_p, lambda x, _: x, x, min_p)
    x = jax.lax.cond(jnp.any((top_k > 0) | (top_p < 1)), _truncate, lambda x, *_: x,
                     x, top_k, top_p)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, x.shape[-1:], jnp.float32))(keys)
    return jnp.argmax(x + gumbel, -1).astype(jnp.int32)

  drawn = jax.lax.cond(jnp.any(temperature > 0), draw, lambda _: greedy, None)
  return jnp.where(temperature > 0, drawn, greedy)


def entropy(logp: jax.Array) -> jax.Array:
  """Entropy in nats, -sum_v p_v log p_v, of each row of log-probs [batch, vocab] (fp32).

  Tokens with p = 0 (log p = -inf, or exp underflowing to 0) add 0, not 0 * -inf = nan. One
  elementwise pass and one sum over `logp`, which XLA fuses with the log-softmax: in
  `programs.decode` it adds no [batch, vocab] buffer to peak memory.
  """
  p = jnp.exp(logp)
  return -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)


def _min_p(x: jax.Array, min_p: jax.Array) -> jax.Array:
  """Set logits [batch, vocab] of tokens with p < min_p * p_max to -inf: in logit space,
  x < max(x) + log(min_p) (min_p = 0 keeps every token)."""
  threshold = jnp.max(x, axis=-1, keepdims=True) + jnp.log(min_p)[:, None]
  return jnp.where(x >= threshold, x, -jnp.inf)


def allowed_tokens(mask: jax.Array, vocab: int) -> jax.Array:
  """Unpacks a token bitmask [batch, ceil(vocab / 32)] uint32 (bit t % 32 of word t // 32 set:
  token t allowed) to bool [batch, vocab]."""
  ids = jnp.arange(vocab, dtype=jnp.uint32)
  words = jnp.take(mask, (ids // 32).astype(jnp.int32), axis=1)
  return ((words >> (ids % 32)[None]) & 1).astype(bool)


def restrict(logits: jax.Array, allowed: jax.Array, count: jax.Array, min_tokens: jax.Array,
             stop_ids: jax.Array) -> jax.Array:
  """Logits [batch, vocab] with the disallowed tokens at -inf: those off in `allowed` [batch,
  vocab] bool, and a row's stop ids [batch, n_stop] while it has fewer than `min_tokens`
  [batch] tokens (`count` [batch]), unless that would leave the row no token at all (the
  grammar's end: the stop token is then its only way on)."""
  rows = jnp.arange(logits.shape[0])[:, None]
  hold = (count < min_tokens)[:, None] & (stop_ids >= 0)
  held = allowed.at[rows, jnp.where(hold, stop_ids, logits.shape[-1])].set(False, mode="drop")
  allowed = jnp.where(jnp.any(held, axis=-1, keepdims=True), held, allowed)
  return jnp.where(allowed, logits, -jnp.inf)


def _truncate(x: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Set logits outside each row's top-k / top-p set to -inf."""
  v = x.shape[-1]
  sorted_x = jnp.sort(x, axis=-1)[:, ::-1]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
  ranks = jnp.arange(v)[None]
  in_k = ranks < k[:, None]
  p = jax.nn.softmax(jnp.where(in_k, sorted_x, -jnp.inf), axis=-1)
  mass_before = jnp.cumsum(p, axis=-1) - p
  n_keep = jnp.maximum(jnp.sum(in_k & (mass_before < top_p[:, None]), -1), 1)
  threshold = jnp.take_along_axis(sorted_x, (n_keep - 1)[:, None], axis=-1)
  return jnp.where(x >= threshold, x, -jnp.inf)

