"""The policy protocol: token ids in; sampled token ids, their log-probs and the policy version
out. `envs` reaches a policy only through this, in-process (`Policy` implementations such as the
engine's adapter) or over HTTP (`HTTPPolicy`, the client of the policy server's `/generate`;
`CompletionsPolicy`, any OpenAI-compatible `/v1/completions` that takes token-id prompts and
returns token ids: vLLM, Arbor's trainer.serve), so a rollout worker on a CPU VM needs no JAX.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import urllib.error
import urllib.request
import uuid
from typing import Any, Optional, Protocol, Sequence

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
  min_p: float = 0.0                    # keep tokens with p >= min_p * p_max (0 = off)
  min_tokens: int = 0                   # stop_token_ids cannot be sampled before this many
                                        # tokens (0 = off)
  ignore_eos: bool = False              # True: stop_token_ids never end the sample
  # Grammar-constrained decoding (in-process engines only): an object whose `start()` gives
  # each sample a fresh `models.engine.constraint.TokenConstraint` (token masks; the sample
  # stops when its grammar ends), e.g. from trainer.serving.constrain. None: unconstrained.
  constraint: Optional[Any] = dataclasses.field(default=None, compare=False)

  def to_dict(self) -> dict:
    """The parameters as a JSON-ready dict (tuples as lists).

    Raises:
      ValueError: a `constraint` is set (it is a live object, not JSON).
    """
    if self.constraint is not None:
      raise ValueError("SamplingParams.constraint: a grammar constraint cannot be sent as "
                       "JSON; constrain on the server that runs the engine")
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "constraint"}
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
  # per output token, the most likely tokens of its next-token distribution as (id, log-prob)
  # pairs, best first, when the policy reports them (the engine's EngineConfig.top_logprobs)
  top_logprobs: Optional[list[list[tuple[int, float]]]] = None


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


def _top_pairs(values: Optional[list]) -> Optional[list[list[tuple[int, float]]]]:
  """JSON top log-probs (per token, [id, log-prob] pairs) as (int, float) tuples; None stays
  None."""
  return None if values is None else [[(int(i), float(x)) for i, x in tok] for tok in values]


class PolicyError(RuntimeError):
  """The policy could not answer (server unreachable, 4xx/5xx, malformed reply)."""


class HTTPPolicy:
  """Client of `POST {url}/generate` (the policy server of trainer.serve).

  Request JSON: {"input_ids": [...], **SamplingParams.to_dict()}; reply JSON: {"output_ids",
  "logprobs", "finish_reason", "policy_version"[, "token_versions"][, "entropies"]
  [, "top_logprobs"][, "expert_ids"]}, with entropies one per output token (nats), top_logprobs
  one list of [id, log-prob] pairs per output token (best first) and expert_ids as
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
                        entropies=_floats(reply.get("entropies")),
                        top_logprobs=_top_pairs(reply.get("top_logprobs")))
    except (KeyError, TypeError, ValueError) as e:
      raise PolicyError(f"{self.url}/generate: malformed reply {reply!r:.500}") from e


def _token_id(token) -> Optional[int]:
  """vLLM's "token_id:N" (return_tokens_as_token_ids) as N, else None."""
  if isinstance(token, str) and token.startswith("token_id:") and token[9:].isdigit():
    return int(token[9:])
  return None


class CompletionsPolicy:
  """A Policy over an OpenAI-compatible `POST {base_url}/completions` with a token-id prompt.

  Each `generate` sends {"model", "prompt": input_ids, "max_tokens", "temperature", "top_p",
  "top_k" (when > 0), "stop", "stop_token_ids" (not with ignore_eos), "seed", "min_p",
  "min_tokens", "ignore_eos" (when not neutral), "logprobs": 0,
  "return_tokens_as_token_ids": true, "return_token_ids": true, "session_id"} and reads the
  sampled ids and their log-probs back, without re-tokenizing text, from the first of:
    - choices[0]["token_ids"] (vLLM with return_token_ids) with logprobs.token_logprobs;
    - choices[0].logprobs.tokens as "token_id:N" strings (vLLM with
      return_tokens_as_token_ids, or a server started with --return-tokens-as-token-ids);
    - the session log of Arbor's policy server (`python -m trainer.serve`): the request's unique
      session_id makes it log the exact ids and log-probs, read from GET /sessions/{id} and
      then deleted.
  A reply with none of these (a server that returns only text tokens) is a PolicyError: text is
  never re-tokenized. What each server needs: vLLM, a version that accepts
  return_tokens_as_token_ids or return_token_ids in the body (or the server flag
  --return-tokens-as-token-ids); Arbor's trainer.serve, nothing (its session log); SGLang and
  others, a completions reply carrying the ids in one of the forms above.
  The stop token a call stopped on is expected as its last output id (trainer.serve's and vLLM's
  token ids include it); check this on other servers.

  Args:
    base_url: the API root, e.g. "http://127.0.0.1:8000/v1" (a trailing "/" is ignored).
    model: the served model's name.
    api_key: sent as a bearer token (None: no Authorization header).
    timeout: seconds to wait for one reply.

  Raises:
    ValueError: an empty base_url or model.
  """

  def __init__(self, base_url: str, model: str, api_key: Optional[str] = None,
               timeout: float = 600.0):
    if not base_url:
      raise ValueError(f"base_url={base_url!r}: expected an http(s) URL such as "
                       "http://127.0.0.1:8000/v1")
    if not model:
      raise ValueError(f"model={model!r}: expected the served model's name")
    self.base_url, self.model = base_url.rstrip("/"), model
    self.api_key, self.timeout = api_key, timeout

  def _request(self, method: str, path: str, body: Optional[dict] = None) -> dict:
    headers = {"Content-Type": "application/json"}
    if self.api_key:
      headers["Authorization"] = f"Bearer {self.api_key}"
    url = self.base_url + path
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, headers, method=method)
    try:
      with urllib.request.urlopen(req, timeout=self.timeout) as resp:
        return json.loads(resp.read())
    except urllib.error.HTTPError as e:
      raise PolicyError(f"{method} {url} answered {e.code}: {e.read()[:500]!r}") from e
    except (urllib.error.URLError, OSError, json.JSONDecodeError) as e:
      raise PolicyError(f"{method} {url} failed: {e}") from e

  def body(self, input_ids: Sequence[int], params: SamplingParams, session_id: str) -> dict:
    """The completions request of one call (see the class docstring)."""
    body = {"model": self.model, "prompt": [int(t) for t in input_ids],
            "max_tokens": params.max_tokens, "temperature": params.temperature,
            "top_p": params.top_p, "logprobs": 0, "return_tokens_as_token_ids": True,
            "return_token_ids": True, "session_id": session_id}
    if params.top_k > 0:  # vLLM's "off" is -1 in older versions, 0 in newer: leave it out
      body["top_k"] = params.top_k
    if params.stop:
      body["stop"] = list(params.stop)
    if params.stop_token_ids and not params.ignore_eos:  # ignore_eos: they never stop
      body["stop_token_ids"] = list(params.stop_token_ids)
    if params.seed is not None:
      body["seed"] = params.seed
    if params.constraint is not None:
      raise ValueError("SamplingParams.constraint: a grammar constraint cannot be sent to a "
                       "completions server")
    for name, neutral in (("min_p", 0.0), ("min_tokens", 0), ("ignore_eos", False)):
      if getattr(params, name) != neutral:  # as vLLM names them
        body[name] = getattr(params, name)
    return body

  def _call(self, input_ids: Sequence[int], params: SamplingParams) -> Generation:
    session = "arbor-" + uuid.uuid4().hex
    reply = self._request("POST", "/completions", self.body(input_ids, params, session))
    try:
      choice = reply["choices"][0]
      lp = choice.get("logprobs") or {}
      tokens, logprobs = lp.get("tokens"), lp.get("token_logprobs")
      ids = choice.get("token_ids")
      if ids is None and tokens is not None and all(_token_id(t) is not None for t in tokens):
        ids = [_token_id(t) for t in tokens]
      if ids is None and reply.get("session_id") == session:  # Arbor's server: its session log
        call = self._request("GET", f"/sessions/{session}")["calls"][-1]
        self._request("DELETE", f"/sessions/{session}")
        ids, logprobs = call["output_ids"], call["logprobs"]
      if ids is None:
        raise PolicyError(f"{self.base_url}/completions: the reply carries no token ids "
                          "(expected choices[0].token_ids, logprobs tokens as 'token_id:N', or "
                          f"an Arbor session log): {reply!r:.300}")
      if logprobs is None or len(logprobs) != len(ids):
        raise PolicyError(f"{self.base_url}/completions: {len(ids)} token ids but log-probs "
                          f"{logprobs!r:.200}")
      reason = choice.get("finish_reason")
      return Generation(output_ids=[int(t) for t in ids],
                        logprobs=[float(x) for x in logprobs],
                        finish_reason="length" if reason == "length" else "stop")
    except (KeyError, IndexError, TypeError, ValueError) as e:
      raise PolicyError(f"{self.base_url}/completions: malformed reply {reply!r:.500}") from e

  async def generate(self, input_ids: Sequence[int], params: SamplingParams) -> Generation:
    """Samples one completion on the server (the request runs in a worker thread).

    Args:
      input_ids: the prompt's token ids.
      params: how to sample.

    Returns:
      The sampled ids and their log-probs (policy_version 0: the server's weights are fixed).

    Raises:
      PolicyError: the server is unreachable, answers an HTTP error, or its reply has no token
        ids or log-probs for them.
    """
    return await asyncio.to_thread(self._call, input_ids, params)
