"""The policy protocol: token ids in; sampled token ids, their log-probs and the policy version
out. `envs` reaches a policy only through this, in-process (`Policy` implementations such as the
engine's adapter) or over HTTP (`HTTPPolicy`, the client of the policy server's `/generate`), so
a rollout worker on a CPU VM needs no JAX.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import urllib.error
import urllib.request
from typing import Optional, Protocol, Sequence

import numpy as np

FINISH_REASONS = ("stop", "length")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to sample one completion."""

  max_tokens: int = 256                 # new tokens at most
  temperature: float = 1.0              # 0 = greedy
  top_p: float = 1.0                    # nucleus mass (1 = off)
  top_k: int = 0                        # 0 = off
  stop_token_ids: tuple[int, ...] = ()  # generation stops after emitting one of these
  stop: tuple[str, ...] = ()            # stop strings (checked on detokenised text)
  seed: Optional[int] = None            # per-request seed (None: the engine's stream)

  def to_dict(self) -> dict:
    """The parameters as a JSON-ready dict (tuples as lists)."""
    d = dataclasses.asdict(self)
    d["stop_token_ids"], d["stop"] = list(self.stop_token_ids), list(self.stop)
    return d


@dataclasses.dataclass(frozen=True)
class Generation:
  """One completion. logprobs[i] is the sampler's log-prob of output_ids[i]."""

  output_ids: list[int]
  logprobs: list[float]
  finish_reason: str                    # "stop" (a stop token/string) or "length"
  policy_version: int = 0               # the version that produced the first token
  token_versions: Optional[list[int]] = None  # per-token versions, when the engine tags them
  # MoE routing replay: [len(input) + len(output) - 1, moe_layers, k] experts of every position
  # the engine fed to the model, when it records them
  expert_ids: Optional[np.ndarray] = None
  # per output token, the policy's next-token entropy in nats, when the policy reports it
  entropies: Optional[list[float]] = None


class Policy(Protocol):
  """What a rollout needs from a policy: one completion per call."""

  async def generate(self, input_ids: Sequence[int], params: SamplingParams) -> Generation:
    """Samples one completion.

    Args:
      input_ids: the prompt's token ids.
      params: how to sample.

    Returns:
      The sampled ids, their log-probs and the policy version.
    """
    ...


def encode_expert_ids(ids: Optional[np.ndarray]) -> Optional[dict]:
  """Expert ids [positions, moe_layers, k] as JSON: {"shape": [...], "int16": base64}."""
  if ids is None:
    return None
  return {"shape": list(ids.shape),
          "int16": base64.b64encode(np.asarray(ids, "<i2").tobytes()).decode()}


def decode_expert_ids(data: Optional[dict]) -> Optional[np.ndarray]:
  """Inverse of `encode_expert_ids`."""
  if data is None:
    return None
  return np.frombuffer(base64.b64decode(data["int16"]), "<i2").reshape(data["shape"])


def _floats(values: Optional[list]) -> Optional[list[float]]:
  """A JSON list of numbers as floats; None stays None."""
  return None if values is None else [float(x) for x in values]


class PolicyError(RuntimeError):
  """The policy could not answer (server unreachable, 4xx/5xx, malformed reply)."""


class HTTPPolicy:
  """Client of `POST {url}/generate` (the policy server of trainer.serve).

  Request JSON: {"input_ids": [...], **SamplingParams.to_dict()}; reply JSON: {"output_ids",
  "logprobs", "finish_reason", "policy_version"[, "token_versions"][, "entropies"]
  [, "expert_ids"]}, with entropies one per output token (nats) and expert_ids as
  `encode_expert_ids` writes it.

  Args:
    url: the server's base URL (a trailing "/" is ignored).
    token: sent as a bearer token (required by servers bound to non-loopback addresses);
      None: no Authorization header.
    timeout: seconds to wait for one reply.
  """

  def __init__(self, url: str, token: Optional[str] = None, timeout: float = 600.0):
    self.url = url.rstrip("/")
    self.token = token
    self.timeout = timeout

  def _post(self, body: dict) -> dict:
    headers = {"Content-Type": "application/json"}
    if self.token:
      headers["Authorization"] = f"Bearer {self.token}"
    req = urllib.request.Request(self.url + "/generate", json.dumps(body).encode(), headers)
    try:
      with urllib.request.urlopen(req, timeout=self.timeout) as resp:
        return json.loads(resp.read())
    except urllib.error.HTTPError as e:
      raise PolicyError(f"{self.url}/generate answered {e.code}: {e.read()[:500]!r}") from e
    except (urllib.error.URLError, OSError, json.JSONDecodeError) as e:
      raise PolicyError(f"{self.url}/generate failed: {e}") from e

  async def generate(self, input_ids: Sequence[int], params: SamplingParams) -> Generation:
    """Samples one completion on the server (the request runs in a worker thread).

    Args:
      input_ids: the prompt's token ids.
      params: how to sample.

    Returns:
      The server's completion.

    Raises:
      PolicyError: the server is unreachable, answers an HTTP error, or its reply is malformed.
    """
    reply = await asyncio.to_thread(self._post, {"input_ids": list(map(int, input_ids)),
                                                 **params.to_dict()})
    try:
      return Generation(output_ids=[int(t) for t in reply["output_ids"]],
                        logprobs=[float(x) for x in reply["logprobs"]],
                        finish_reason=str(reply["finish_reason"]),
                        policy_version=int(reply.get("policy_version", 0)),
                        token_versions=reply.get("token_versions"),
                        expert_ids=decode_expert_ids(reply.get("expert_ids")),
                        entropies=_floats(reply.get("entropies")))
    except (KeyError, TypeError, ValueError) as e:
      raise PolicyError(f"{self.url}/generate: malformed reply {reply!r:.500}") from e
