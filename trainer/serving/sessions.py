"""The policy server's session log: the exact ids and log-probs of each call, per session id,
bounded in size.

A call's record (one per sample; JSON as GET /v1/sessions/<id> serves it):
  protocol        the endpoint it came in by: "chat_completions" | "completions" | "responses"
                  | "anthropic_messages" | "generate"
  input_ids       the prompt as the engine saw it (a forced tool-call opening included)
  output_ids      every sampled id (stop strings are cut from the reply's text only)
  logprobs        per output id, the log-probability the sampler drew it with
  token_versions  per output id, the policy version that sampled it
  policy_version  the policy version at the end of the sample
  finish_reason   "stop" | "length"
  constrained     whether the reply was sampled under a grammar (response_format, a forced
                  tool choice): its log-probs are then those of the model's distribution
                  renormalised over the tokens the grammar allowed (temperature 1, no
                  truncation; `models.engine.constraint`), not the unmasked model's
  params          temperature, top_p, top_k, max_tokens, stop, stop_token_ids, seed, and the
                  request's n and tool_choice
  expert_ids      only from an engine that records MoE routing (`return_expert_ids`): the
                  experts of every position the model was fed (input_ids + output_ids[:-1]),
                  [positions, moe_layers, experts_per_token] as `envs.policy.encode_expert_ids`
                  writes it ({"shape", "int16": base64}; `decode_expert_ids` reads it back)
  time            when the sample ended (Unix seconds)
"""

from __future__ import annotations

import collections
import logging
import threading

from trainer.serving.validate import HTTPError

logger = logging.getLogger("trainer.serve")

class SessionLog:
  """Exact ids and log-probs of each call, per session id, bounded in size.

  Args:
    max_sessions: sessions kept (the least recently used is dropped first).
    max_session_tokens: logged input + output tokens per session.
    max_total_tokens: logged tokens over all sessions (least recently used dropped first).
  """

  def __init__(self, max_sessions: int, max_session_tokens: int, max_total_tokens: int):
    self.max_sessions, self.max_session_tokens = max_sessions, max_session_tokens
    self.max_total_tokens = max_total_tokens
    self._sessions: collections.OrderedDict[str, list[dict]] = collections.OrderedDict()
    self._tokens: dict[str, int] = {}
    self._lock = threading.Lock()

  def reserve_check(self, session: str, tokens: int) -> None:
    """Checks that logging `tokens` more fits the session's limit.

    Args:
      session: the session id.
      tokens: the most tokens the coming call may log (n x (input + max_tokens)).

    Raises:
      HTTPError: 413 when the session's log would exceed `max_session_tokens`.
    """
    with self._lock:
      used = self._tokens.get(session, 0)
    if used + tokens > self.max_session_tokens:
      raise HTTPError(413, f"session {session!r}: its log holds {used} tokens and this call may "
                           f"add {tokens}, over the limit of {self.max_session_tokens}",
                      "session_id")

  def add(self, session: str, call: dict) -> None:
    """Appends one call's record to a session, dropping least recently used sessions when full.

    Args:
      session: the session id.
      call: the call's record; its "input_ids" and "output_ids" count against the limits.
    """
    n = len(call["input_ids"]) + len(call["output_ids"])
    with self._lock:
      self._sessions.setdefault(session, []).append(call)
      self._sessions.move_to_end(session)
      self._tokens[session] = self._tokens.get(session, 0) + n
      while len(self._sessions) > self.max_sessions or \
          (sum(self._tokens.values()) > self.max_total_tokens and len(self._sessions) > 1):
        old, _ = self._sessions.popitem(last=False)
        self._tokens.pop(old)
        logger.warning("session log full: dropped session %s", old)

  def get(self, session: str) -> list[dict]:
    """Returns a copy of a session's call records (HTTPError 404 for an unknown session)."""
    with self._lock:
      if session not in self._sessions:
        raise HTTPError(404, f"unknown session {session!r}", "session_id")
      return list(self._sessions[session])

  def delete(self, session: str) -> None:
    """Frees a session's log (HTTPError 404 for an unknown session)."""
    with self._lock:
      if self._sessions.pop(session, None) is None:
        raise HTTPError(404, f"unknown session {session!r}", "session_id")
      self._tokens.pop(session)
