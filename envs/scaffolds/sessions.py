"""A gateway session as training data: records -> `Trajectory`, and the trie its calls form.

    records = server.sessions.get(result.session_id)        # or GET /v1/sessions/<id>["calls"]
    traj = trajectory_from_session(records, reward=result.reward, task_id=task.instance_id,
                                   group_id=f"{task.instance_id}/0",
                                   termination=result.termination)
    print(format_session(records))                           # calls and trie, readable

A session record (`trainer.serving.sessions`) is one call exactly as the engine saw it:
"input_ids", "output_ids", "logprobs" (the sampler's), "token_versions", "policy_version",
"finish_reason", "params", "time", and where the gateway records them "protocol" and
"expert_ids" (as `envs.policy.encode_expert_ids` writes it, or the array itself). Each record
becomes one `LLMCall`, in the order logged; a black-box scaffold's calls need not extend each
other (compacted histories, sub-agents, retries): every call is one path from a root of the
group's token trie, where shared prefixes merge (`rl.tree.build_tree`).

Terminations of a black-box episode (`envs.scaffolds.runner.BlackboxResult.termination`) map
onto `envs.trajectory.TERMINATIONS` with `TERMINATION_MAP`: "exited" stays "exited" (the CLI
exited 0: finished or at its own turn limit), "exit_error" becomes "scaffold_error", "timeout"
and "sandbox_error" stay.

`session_tree(records)` describes the trie of one session's calls (nodes, roots, branch
points, per call the tokens shared with earlier calls); `python -m envs.scaffolds show` prints
both for a saved session file or a running gateway.
"""

from __future__ import annotations

import numbers
from typing import Any, Optional, Sequence

import numpy as np

from envs.policy import decode_expert_ids
from envs.trajectory import TERMINATIONS, LLMCall, Trajectory

# BlackboxResult.termination -> Trajectory.termination (terminations already in TERMINATIONS
# map to themselves).
TERMINATION_MAP = {"exited": "exited", "exit_error": "scaffold_error", "timeout": "timeout",
                   "sandbox_error": "sandbox_error"}


def map_termination(termination: str) -> str:
  """The Trajectory termination of a black-box episode's ending.

  Args:
    termination: a `BlackboxResult.termination` or a member of TERMINATIONS.

  Returns:
    A member of `envs.trajectory.TERMINATIONS`.

  Raises:
    ValueError: naming the unknown termination.
  """
  if termination in TERMINATION_MAP:
    return TERMINATION_MAP[termination]
  if termination in TERMINATIONS:
    return termination
  raise ValueError(f"termination={termination!r}: expected one of "
                   f"{sorted(set(TERMINATION_MAP) | set(TERMINATIONS))}")


def _ids(value: Any, where: str, allow_empty: bool = True) -> list[int]:
  if not isinstance(value, (list, tuple, np.ndarray)):
    raise ValueError(f"{where}: expected a list of token ids, got {type(value).__name__}")
  out = []
  for j, x in enumerate(value):
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 0:
      raise ValueError(f"{where}[{j}]={x!r}: expected a non-negative int token id")
    out.append(int(x))
  if not out and not allow_empty:
    raise ValueError(f"{where} is empty: a call has at least one context token")
  return out


def _floats(value: Any, where: str, n: int, what: str) -> list[float]:
  if not isinstance(value, (list, tuple, np.ndarray)):
    raise ValueError(f"{where}: expected a list of {n} numbers, got {type(value).__name__}")
  if len(value) != n:
    raise ValueError(f"{where} has {len(value)} entries for {n} output_ids ({what})")
  out = []
  for j, x in enumerate(value):
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
      raise ValueError(f"{where}[{j}]={x!r}: expected a number")
    out.append(float(x))
  return out


def _expert_ids(value: Any, where: str, want: int) -> Optional[np.ndarray]:
  if value is None:
    return None
  try:
    ids = decode_expert_ids(value) if isinstance(value, dict) else np.asarray(value)
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"{where}: not expert ids ({{'shape', 'int16'}} or an int array): "
                     f"{type(e).__name__}: {e}") from e
  if ids.ndim != 3 or len(ids) != want or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"{where} has shape {ids.shape} ({ids.dtype}); expected [{want} (input + "
                     "output tokens - 1), moe_layers, k] ints")
  return ids


def record_to_call(record: dict, index: int = 0) -> LLMCall:
  """One session record as an `LLMCall` (see the module docstring).

  Args:
    record: the record (a dict with at least "input_ids", "output_ids", "logprobs").
    index: its position in the session (for error messages).

  Returns:
    The call: exact ids, the sampler's log-probs, policy_version, token_versions, expert_ids
    (expert_start 0) and meta {"protocol", "finish_reason"}.

  Raises:
    ValueError: naming `records[index].<field>` of a malformed record.
  """
  at = f"records[{index}]"
  if not isinstance(record, dict):
    raise ValueError(f"{at}: expected a dict (a session record), got {type(record).__name__}")
  for field in ("input_ids", "output_ids", "logprobs"):
    if field not in record:
      raise ValueError(f"{at}.{field} is missing")
  input_ids = _ids(record["input_ids"], f"{at}.input_ids", allow_empty=False)
  output_ids = _ids(record["output_ids"], f"{at}.output_ids")
  n = len(output_ids)
  logprobs = _floats(record["logprobs"], f"{at}.logprobs", n, "one log-prob per sampled token")
  versions = record.get("token_versions")
  if versions is not None:
    versions = _ids(versions, f"{at}.token_versions")
    if len(versions) != n:
      raise ValueError(f"{at}.token_versions has {len(versions)} entries for {n} output_ids")
  version = record.get("policy_version", 0)
  if isinstance(version, bool) or not isinstance(version, numbers.Integral):
    raise ValueError(f"{at}.policy_version={version!r}: expected an int")
  experts = _expert_ids(record.get("expert_ids"), f"{at}.expert_ids",
                        len(input_ids) + n - 1)
  meta = {"protocol": record.get("protocol"), "finish_reason": record.get("finish_reason")}
  return LLMCall(input_ids=input_ids, output_ids=output_ids, output_logprobs=logprobs,
                 policy_version=int(version), token_versions=versions, meta=meta,
                 expert_ids=experts, expert_start=0)


def trajectory_from_session(records: Sequence[dict], *, reward: float, task_id: str,
                            group_id: str, termination: str,
                            metadata: Optional[dict] = None) -> Trajectory:
  """A gateway session's calls as one episode's `Trajectory`.

  Args:
    records: the session's records in the order logged (`SessionLog.get`, or the "calls" of
      GET /v1/sessions/<id>).
    reward: the verifier's reward.
    task_id: the task's id.
    group_id: the group the episode belongs to (normally f"{task_id}/{draw}").
    termination: a `BlackboxResult.termination` ("exited", "exit_error", "timeout",
      "sandbox_error") or a member of TERMINATIONS (`map_termination`).
    metadata: extras for the trajectory's metadata (e.g. {"scaffold", "session_id"}).

  Returns:
    The Trajectory: one LLMCall per record (`record_to_call`), in order.

  Raises:
    ValueError: records is not a list, a malformed record (naming `records[i].field`), or an
      unknown termination.
  """
  if not isinstance(records, (list, tuple)):
    raise ValueError(f"records: expected a list of session records, got "
                     f"{type(records).__name__}")
  calls = [record_to_call(r, i) for i, r in enumerate(records)]
  return Trajectory(calls=calls, reward=float(reward), task_id=task_id, group_id=group_id,
                    termination=map_termination(termination), metadata=dict(metadata or {}))


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
  n = min(len(a), len(b))
  i = 0
  while i < n and a[i] == b[i]:
    i += 1
  return i


def session_tree(records: Sequence[dict]) -> dict:
  """The token trie of one session's calls: each call's input + output is one path from a root.

  Args:
    records: the session's records (or LLMCalls), in order.

  Returns:
    {"calls": [{"index", "protocol", "input_tokens", "output_tokens", "finish_reason",
    "policy_version", "token_versions" ([min, max] or None), "shared_tokens" (prefix already
    in the trie from earlier calls), "new_tokens", "extends_previous" (its input starts with
    the previous call's whole sequence)}], "tokens" (over all calls), "nodes" (distinct
    prefixes: the trie's size), "roots", "branch_points" [{"depth", "children", "calls"}],
    "shared_tokens" (tokens - nodes)}.

  Raises:
    ValueError: a malformed record (as `record_to_call`).
  """
  calls = [r if isinstance(r, LLMCall) else record_to_call(r, i) for i, r in enumerate(records)]
  seqs = [tuple(c.input_ids) + tuple(c.output_ids) for c in calls]
  out_calls = []
  for i, (c, s) in enumerate(zip(calls, seqs)):
    shared = max((_lcp(s, seqs[j]) for j in range(i)), default=0)
    prev = seqs[i - 1] if i else None
    tv = c.token_versions
    out_calls.append({
        "index": i, "protocol": c.meta.get("protocol"), "input_tokens": len(c.input_ids),
        "output_tokens": len(c.output_ids), "finish_reason": c.meta.get("finish_reason"),
        "policy_version": c.policy_version,
        "token_versions": [min(tv), max(tv)] if tv else None,
        "shared_tokens": shared, "new_tokens": len(s) - shared,
        "extends_previous": prev is not None and tuple(c.input_ids[:len(prev)]) == prev})
  # Distinct prefixes = sum of lengths - common prefixes of neighbours in sorted order.
  order = sorted(range(len(seqs)), key=lambda i: seqs[i])
  nodes = sum(len(s) for s in seqs)
  children: dict[tuple, set] = {}  # branch node (prefix) -> its next tokens
  for a, b in zip(order, order[1:]):
    sa, sb = seqs[a], seqs[b]
    n = _lcp(sa, sb)
    nodes -= n
    if n < len(sa) and n < len(sb) and n > 0:
      key = sa[:n]
      children.setdefault(key, set()).update((sa[n], sb[n]))
  branch_points = sorted(
      ({"depth": len(k), "children": len(v),
        "calls": [i for i, s in enumerate(seqs) if s[:len(k)] == k]}
       for k, v in children.items()), key=lambda d: (d["depth"], d["calls"]))
  tokens = sum(len(s) for s in seqs)
  return {"calls": out_calls, "tokens": tokens, "nodes": nodes,
          "roots": len({s[0] for s in seqs if s}), "branch_points": branch_points,
          "shared_tokens": tokens - nodes}


def format_session(records: Sequence[dict], session_id: str = "") -> str:
  """`session_tree` as readable text: one line per call, then the trie's summary.

  Args:
    records: the session's records, in order.
    session_id: shown in the header.

  Returns:
    The text (no trailing newline).
  """
  t = session_tree(records)
  lines = [f"session {session_id or '?'}: {len(t['calls'])} calls, {t['tokens']} tokens, "
           f"trie {t['nodes']} nodes ({t['shared_tokens']} tokens shared), {t['roots']} "
           f"root(s), {len(t['branch_points'])} branch point(s)",
           f"{'call':>4} {'protocol':<18} {'in':>6} {'out':>5} {'shared':>6} {'new':>6} "
           f"{'extends':>7} {'finish':<10} versions"]
  for c in t["calls"]:
    versions = (f"{c['policy_version']}" if c["token_versions"] is None else
                f"{c['policy_version']} (tokens {c['token_versions'][0]}.."
                f"{c['token_versions'][1]})")
    lines.append(f"{c['index']:>4} {str(c['protocol'] or '-'):<18} {c['input_tokens']:>6} "
                 f"{c['output_tokens']:>5} {c['shared_tokens']:>6} {c['new_tokens']:>6} "
                 f"{'yes' if c['extends_previous'] else 'no':>7} "
                 f"{str(c['finish_reason'] or '-'):<10} {versions}")
  for b in t["branch_points"]:
    lines.append(f"branch at depth {b['depth']}: {b['children']} children (calls "
                 f"{', '.join(map(str, b['calls']))})")
  return "\n".join(lines)
