"""A simple batched decode loop over the Transformer's caches: the reference that tests check
the model's decode path with. Serving and rollouts use the engine, models/engine/ (continuous
batching, prefix reuse, per-request sampling, weight updates).

This module stays beside the model rather than in the engine's package: it is the model's own
plain decoder (one batch, one cache, no scheduling), and a reference shares no code with the
engine it is compared against.

    tokens, logprobs = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=8)

Prompts are right-padded and prefilled in one call; each row then decodes from its own length.
Padding slots are overwritten before any query can see them (the cache view hides slots past a
query), so ragged prompts decode exactly as if run alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def sample(logits: jax.Array, key: jax.Array, temperature: float = 0.0, top_k: int = 0,
           top_p: float = 1.0) -> jax.Array:
  """Sample one token per row, with the same settings for every row.

  Args:
    logits: [batch, vocab] fp32.
    key: PRNG key.
    temperature: 0 = greedy.
    top_k: keep the k largest logits (0 = off).
    top_p: keep the smallest prefix of the sorted distribution reaching this mass (1 = off).

  Returns:
    [batch] int32 token ids.
  """
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / temperature
  if top_k:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1.0:
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
    # keep the smallest prefix whose mass reaches top_p (the top token always stays)
    cutoff_index = jnp.sum(cum < top_p, axis=-1, keepdims=True)
    cutoff = jnp.take_along_axis(sorted_logits, cutoff_index, axis=-1)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@nnx.jit(static_argnums=(4, 5, 6))
def _step(model, tokens, cache, index, temperature, top_k, top_p, key):
  logits, cache = model.decode_step(tokens, cache, index)
  last = logits[:, -1]
  nxt = sample(last, key, temperature, top_k, top_p)
  logp = jnp.take_along_axis(jax.nn.log_softmax(last, -1), nxt[:, None], -1)[:, 0]
  return nxt, logp, cache


@nnx.jit
def _prefill(model, tokens, cache, lengths):
  logits, cache = model.decode_step(tokens, cache, jnp.zeros_like(lengths))
  return jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0], cache


def generate(model, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_id: int | None = None
             ) -> tuple[list[list[int]], list[list[float]]]:
  """Decode up to `max_new_tokens` per prompt.

  Args:
    model: a Transformer.
    prompts: token ids of each prompt (non-empty).
    max_new_tokens: tokens to generate per prompt.
    temperature: sampling temperature; 0 = greedy (see `sample`).
    top_k: keep the k most likely tokens; 0 = off.
    top_p: nucleus mass kept; 1 = off.
    seed: PRNG seed.
    eos_id: cut each row after this token.

  Returns:
    (new token ids, their log-probs) per row. Log-probs are of the unmodified (temperature 1)
    model.

  Raises:
    ValueError: no prompts or an empty one.
  """
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("generate: every prompt needs at least one token")
  lengths = np.array([len(p) for p in prompts], np.int32)
  padded = np.zeros((len(prompts), lengths.max()), np.int32)
  for row, p in enumerate(prompts):
    padded[row, :len(p)] = p
  cache = model.init_cache(len(prompts), int(lengths.max()) + max_new_tokens)
  last, cache = _prefill(model, jnp.asarray(padded), cache, jnp.asarray(lengths))
  key = jax.random.key(seed)
  key, sub = jax.random.split(key)
  nxt = sample(last, sub, temperature, top_k, top_p)
  logp = jnp.take_along_axis(jax.nn.log_softmax(last, -1), nxt[:, None], -1)[:, 0]
  out, out_logp = [np.asarray(nxt)], [np.asarray(logp)]
  index = jnp.asarray(lengths)
  for _ in range(max_new_tokens - 1):
    key, sub = jax.random.split(key)
    nxt, logp, cache = _step(model, nxt[:, None], cache, index, temperature, top_k, top_p, sub)
    index = index + 1
    out.append(np.asarray(nxt))
    out_logp.append(np.asarray(logp))
  tokens, logps = np.stack(out, 1).tolist(), np.stack(out_logp, 1).tolist()
  if eos_id is not None:
    for row, seq in enumerate(tokens):
      if eos_id in seq:
        cut = seq.index(eos_id) + 1
        tokens[row], logps[row] = seq[:cut], logps[row][:cut]
  return tokens, logps
