"""Token constraints: per-request token masks for the generation engine (grammar-constrained
decoding, min_tokens, ignore_eos, min_p), and the host side of feeding them to the sampler.

A request constrains its output with `SamplingParams.constraint`, an object whose `start()`
gives each sample a fresh `TokenConstraint` (a grammar matcher's state). The engine knows only
this protocol; grammars, tokenizers and JSON schemas live outside models/ (e.g.
trainer/serving/constrain.py builds constraints from JSON schemas and tool definitions).

Before every decode call the engine asks each constrained slot for its mask
(`TokenConstraint.allowed`) and runs one step, so that the mask is fresh for every token;
unconstrained slots get an all-allowed mask, and the compiled decode call is the same whether
or not any slot is constrained (one program, no retrace). After the call it feeds the sampled
token to `advance`; a constraint whose `is_done()` turns true finishes its request ("stop").

Masks reach the device as a packed bitmask [slots, ceil(vocab / 32)] uint32: bit t % 32 of
word t // 32 is set when token t is allowed (`sampling.allowed_tokens` unpacks it).

Log-probs of a masked request: the sampler draws from the model's distribution with the
disallowed tokens removed, and the engine reports log-probs, entropies and top log-probs of
that renormalised distribution (temperature 1, no top-k/top-p/min-p truncation), so that
log p(token) is the behaviour policy's. A teacher-forced forward pass of the same sequence
gives the unmasked log-probs; they agree exactly where the mask allows every token.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Protocol, Sequence

import numpy as np

ALL_ALLOWED = np.uint32(0xFFFFFFFF)


class TokenConstraint(Protocol):
  """One sample's constraint state (e.g. a grammar matcher). Called from the engine thread."""

  def allowed(self) -> Optional[np.ndarray]:
    """The tokens the next sampled token may be.

    Returns:
      bool [n] (token t allowed iff allowed[t]; ids >= n are not), or a packed bitmask
      int32/uint32 [ceil(n / 32)] (bit t % 32 of word t // 32), or None: every token.
    """

  def advance(self, token_id: int) -> None:
    """Takes the sampled token (one `allowed` allowed)."""

  def is_done(self) -> bool:
    """Whether the constraint reached its end state (the sample is complete)."""


class Constraint(Protocol):
  """What `SamplingParams.constraint` holds: a factory of per-sample constraint states."""

  def start(self) -> TokenConstraint:
    """A fresh state for one sample (nothing generated yet)."""


def words(vocab: int) -> int:
  """Words of a packed bitmask over `vocab` tokens."""
  return -(-vocab // 32)


def pack(allowed: np.ndarray, vocab: int) -> np.ndarray:
  """A `TokenConstraint.allowed` result as a packed bitmask [words(vocab)] uint32.

  Args:
    allowed: bool [n], or packed int32/uint32 [ceil(n / 32)].
    vocab: the model's vocabulary size; tokens past `allowed`'s end are disallowed.

  Returns:
    The bitmask; bits of ids >= vocab are ignored by the sampler.

  Raises:
    ValueError: `allowed` is neither a 1-D bool array nor a 1-D 32-bit integer array.
  """
  a = np.asarray(allowed)
  if a.ndim != 1:
    raise ValueError(f"TokenConstraint.allowed(): expected a 1-D array, got shape {a.shape}")
  if a.dtype == np.bool_:
    a = a[:vocab]
    a = np.pad(a, (0, 32 * words(vocab) - len(a)))
    return np.packbits(a, bitorder="little").view("<u4").astype(np.uint32)
  if a.dtype not in (np.int32, np.uint32):
    raise ValueError(f"TokenConstraint.allowed(): expected bool [n] or a packed int32/uint32 "
                     f"bitmask, got dtype {a.dtype}")
  a = a.view(np.uint32)[:words(vocab)]
  return np.pad(a, (0, words(vocab) - len(a)))


def stop_ids(params: Any) -> tuple[int, ...]:
  """The token ids that end a request's sample: its stop_token_ids, none with ignore_eos."""
  return () if getattr(params, "ignore_eos", False) else tuple(params.stop_token_ids)


def check(params: Any) -> None:
  """Checks a request's min_p, min_tokens, ignore_eos and constraint (read structurally: an
  object without these fields takes the neutral values).

  Raises:
    ValueError: naming the field and its value.
  """
  min_p = getattr(params, "min_p", 0.0)
  if not 0 <= min_p <= 1:
    raise ValueError(f"min_p={min_p!r}: must be in [0, 1]")
  min_tokens = getattr(params, "min_tokens", 0)
  if not isinstance(min_tokens, (int, np.integer)) or isinstance(min_tokens, bool) or \
      not 0 <= min_tokens <= params.max_tokens:
    raise ValueError(f"min_tokens={min_tokens!r}: must be an integer in [0, max_tokens="
                     f"{params.max_tokens}]")
  ignore_eos = getattr(params, "ignore_eos", False)
  if not isinstance(ignore_eos, (bool, np.bool_)):
    raise ValueError(f"ignore_eos={ignore_eos!r}: must be a bool")
  constraint = getattr(params, "constraint", None)
  if constraint is not None and not callable(getattr(constraint, "start", None)):
    raise ValueError(f"constraint={constraint!r}: expected an object with start() giving a "
                     "models.engine.constraint.TokenConstraint")


def start(params: Any) -> Optional[TokenConstraint]:
  """A fresh constraint state for one sample of a request, or None when unconstrained."""
  constraint = getattr(params, "constraint", None)
  return None if constraint is None else constraint.start()


@dataclasses.dataclass
class Controls:
  """The masking inputs of one decode call (arrays [slots] unless noted)."""

  mask: np.ndarray         # [slots, words(vocab)] uint32 token bitmask
  min_p: np.ndarray        # float32
  min_tokens: np.ndarray   # int32
  constrained: bool        # some slot has a token constraint: run one step
  failed: list[tuple[int, Exception]]  # (slot, error): constraints that allow no token

  def kwargs(self) -> dict:
    """Keyword arguments of the decode program (`KVCache.decode`, `programs.decode`)."""
    return {"mask": self.mask, "min_p": self.min_p, "min_tokens": self.min_tokens}


def controls(requests: Sequence[Optional[Any]], vocab: int) -> Controls:
  """Builds the masking inputs of a decode call from the slots' requests.

  Args:
    requests: per slot, None or a request with `.params` and `.constraint` (its
      TokenConstraint state or None).
    vocab: the model's vocabulary size.

  Returns:
    The Controls; an empty slot and an unconstrained request allow every token.
  """
  s = len(requests)
  out = Controls(np.full((s, words(vocab)), ALL_ALLOWED, np.uint32), np.zeros(s, np.float32),
                 np.zeros(s, np.int32), False, [])
  for i, req in enumerate(requests):
    if req is None:
      continue
    out.min_p[i] = getattr(req.params, "min_p", 0.0)
    out.min_tokens[i] = getattr(req.params, "min_tokens", 0)
    if req.constraint is None:
      continue
    out.constrained = True  # its next mask depends on this call's token: one step
    allowed = req.constraint.allowed()
    if allowed is None:
      continue
    out.mask[i] = pack(allowed, vocab)
    if not out.mask[i].any():
      out.failed.append((i, RuntimeError(
          f"constraint: no token of the vocabulary [0, {vocab}) can continue the output "
          f"after {len(req.output)} tokens")))
  return out


def advance(constraint: Optional[TokenConstraint], tokens: Sequence[int]) -> bool:
  """Feeds a request's new tokens to its constraint state.

  Returns:
    Whether the constraint reached its end state (False without a constraint).
  """
  if constraint is None:
    return False
  for t in tokens:
    constraint.advance(int(t))
  return constraint.is_done()
