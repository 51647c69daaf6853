"""The Redis Streams rollout queue: many processes on many machines (envs/queue/base.py).

Trajectories live in a stream read through a consumer group (XADD / XREADGROUP / XACK /
XAUTOCLAIM); the stream is never trimmed past an unacked entry. Task leases live in Lua scripts,
so that check-and-set is atomic on the server and expiry uses the server's clock. Connections
authenticate with a password (AUTH) and may use TLS (`rediss://`).
"""

from __future__ import annotations

import time
from typing import Iterable, Optional, Sequence
from urllib.parse import urlsplit, urlunsplit

import redis

from envs.queue.base import Fetched, RolloutQueue, TaskLease

# Lease bookkeeping lives in Lua so that check-and-set is atomic on the server, and expiry uses
# the server's clock (workers' clocks may disagree). KEYS/ARGV are documented per script.
# info[draw] = "<deliveries>|<worker_id>"; leases = zset draw -> expiry in ms.
_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: draws, leases, info, dead_tasks. ARGV: worker, ttl_ms, max_draws (-1: none), max_deliv.
# Returns {draw or -1 when max_draws are out, deliveries, draws moved to dead_tasks}.
_LEASE = _NOW_MS + """
local dead = 0
while true do
  local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 1)
  if #expired == 0 then break end
  local draw = expired[1]
  local info = redis.call('HGET', KEYS[3], draw) or '0|'
  local count = tonumber(string.match(info, '^(%d+)')) + 1
  if count > tonumber(ARGV[4]) then
    redis.call('ZREM', KEYS[2], draw)
    redis.call('HDEL', KEYS[3], draw)
    redis.call('RPUSH', KEYS[4], draw)
    dead = dead + 1
  else
    redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), draw)
    redis.call('HSET', KEYS[3], draw, count .. '|' .. ARGV[1])
    return {tonumber(draw), count, dead}
  end
end
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[3]) >= 0 and n >= tonumber(ARGV[3]) then return {-1, 0, dead} end
redis.call('SET', KEYS[1], n + 1)
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), n)
redis.call('HSET', KEYS[3], n, '1|' .. ARGV[1])
return {n, 1, dead}
"""

# KEYS: leases, info. ARGV: draw, "<deliveries>|<worker>", ttl_ms.
_RENEW = _NOW_MS + """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
return 1
"""

# KEYS: leases, info, stream, done. ARGV: draw, "<deliveries>|<worker>", trajectory bytes...
_COMPLETE = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
for i = 3, #ARGV do redis.call('XADD', KEYS[3], '*', 'data', ARGV[i]) end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('INCR', KEYS[4])
return 1
"""

# KEYS: leases, info. ARGV: draw, "<deliveries>|<worker>", deliveries - 1.
_RELEASE = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('ZADD', KEYS[1], 0, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3] .. '|')
return 1
"""


def _redact(url: str) -> str:
  """The URL without its password (for messages and logs)."""
  parts = urlsplit(url)
  if parts.password is None:
    return url
  netloc = parts.netloc.rsplit("@", 1)[1]
  user = parts.username or ""
  return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def _s(x) -> str:
  return x.decode() if isinstance(x, bytes) else str(x)


def _next_id(entry_id: str) -> str:
  ms, seq = entry_id.split("-")
  return f"{ms}-{int(seq) + 1}"


def _id_key(entry_id: str) -> tuple[int, int]:
  ms, seq = entry_id.split("-")
  return int(ms), int(seq)


def _connect(url: str, password: Optional[str], ca_file: Optional[str]) -> redis.Redis:
  """A client that has answered a PING; errors name the (redacted) URL."""
  kwargs = dict(password=password, socket_connect_timeout=10, health_check_interval=30)
  if urlsplit(url).scheme == "rediss" and ca_file:
    kwargs["ssl_ca_certs"] = ca_file
  client = redis.Redis.from_url(url, **kwargs)
  try:
    client.ping()
  except redis.AuthenticationError as e:
    raise PermissionError(f"Redis at {_redact(url)} refused authentication (password "
                          f"wrong or missing): {e}") from e
  except redis.ResponseError as e:
    if "NOAUTH" in str(e):
      raise PermissionError(f"Redis at {_redact(url)} requires a password") from e
    raise
  except redis.ConnectionError as e:
    raise ConnectionError(f"cannot reach Redis at {_redact(url)}: {e}") from e
  return client


class RedisQueue(RolloutQueue):
  """Redis Streams backend.

  Keys: `{prefix}:rollouts` (stream, consumer group `group`), `{prefix}:dead` (dead-letter
  stream), `{prefix}:task:*` (draw counter, leases, done count, dead draws, task-list
  fingerprint), braces included.

  Args:
    url: `redis://[:password@]host:port[/db]` or `rediss://...` (TLS).
    password: sent with AUTH (else the URL's, if any).
    ca_file: verifies a `rediss://` server's certificate.
    prefix: the queue's key prefix (one per run).
    consumer: must be stable across restarts of the same trainer, so a restarted one takes its
      own pending entries back at once instead of after `claim_timeout`.
    group: the consumer group.
    claim_timeout: seconds before a pending entry of a silent consumer is re-claimed.
    max_deliveries: deliveries of one entry before it goes to the dead letters.
    task_max_deliveries: issues of one draw before it is given up.

  Raises:
    ValueError: the URL is not redis:// or rediss://, claim_timeout <= 0, or a delivery
      limit < 1.
    PermissionError: the server refuses the password, or needs one.
    ConnectionError: the server cannot be reached.
  """

  def __init__(self, url: str, *, password: Optional[str] = None, ca_file: Optional[str] = None,
               prefix: str = "arbor", consumer: str = "trainer", group: str = "trainer",
               claim_timeout: float = 600.0, max_deliveries: int = 5,
               task_max_deliveries: int = 3, _client=None):
    super().__init__(consumer=consumer, claim_timeout=claim_timeout,
                     max_deliveries=max_deliveries, task_max_deliveries=task_max_deliveries)
    if urlsplit(url).scheme not in ("redis", "rediss"):
      raise ValueError(f"queue url={_redact(url)!r}: expected redis:// or rediss://")
    self.url, self.prefix, self.group = url, prefix, group
    # "{prefix}" is a hash tag: in a Redis Cluster all keys of a queue share one slot, which
    # the Lua scripts (several keys each) need.
    tag = f"{{{prefix}}}"
    self.stream, self.dead = f"{tag}:rollouts", f"{tag}:dead"
    self._task_keys = {k: f"{tag}:task:{k}"
                       for k in ("draws", "leases", "info", "dead", "done", "fingerprint")}
    self._r = _client if _client is not None else _connect(url, password, ca_file)
    try:
      self._r.xgroup_create(self.stream, group, id="0", mkstream=True)
    except redis.ResponseError as e:
      if "BUSYGROUP" not in str(e):
        raise
    self._lease_script = self._r.register_script(_LEASE)
    self._renew_script = self._r.register_script(_RENEW)
    self._complete_script = self._r.register_script(_COMPLETE)
    self._release_script = self._r.register_script(_RELEASE)
    self._history = "0"         # cursor through our own pending entries (restart recovery)
    self._claim_cursor = "0-0"  # XAUTOCLAIM cursor

  def with_consumer(self, consumer: str) -> "RedisQueue":
    """Another consumer on the same stream and connection pool."""
    return RedisQueue(self.url, prefix=self.prefix, consumer=consumer, group=self.group,
                      claim_timeout=self.claim_timeout, max_deliveries=self.max_deliveries,
                      task_max_deliveries=self.task_max_deliveries, _client=self._r)

  # Trajectories.

  def put_raw(self, data: bytes) -> str:
    """XADDs serialised bytes as they are (never trimmed: no MAXLEN)."""
    entry_id = _s(self._r.xadd(self.stream, {"data": bytes(data)}))
    self.counters.count("put")
    return entry_id

  def _fetch(self, n: int, deadline: float) -> list[Fetched]:
    got: list[tuple[str, Optional[bytes], Optional[int]]] = []
    if self._history is not None:
      reply = self._r.xreadgroup(self.group, self.consumer, {self.stream: self._history},
                                 count=n)
      entries = reply[0][1] if reply else []
      if not entries:
        self._history = None
      else:  # return before reading new entries: they would join our pending list and the
        # next history read would return them a second time
        self._history = _s(entries[-1][0])
        got = [(_s(i), (f or {}).get(b"data"), None) for i, f in entries]
        return self._with_counts(got)
    if len(got) < n:
      cursor, entries, _deleted = self._r.xautoclaim(
          self.stream, self.group, self.consumer, min_idle_time=int(self.claim_timeout * 1000),
          start_id=self._claim_cursor, count=n - len(got))
      self._claim_cursor = _s(cursor)
      got += [(_s(i), (f or {}).get(b"data"), None) for i, f in entries]
    if len(got) < n:
      remaining = deadline - time.monotonic()
      block_ms = max(1, int(remaining * 1000)) if remaining > 0 else None
      reply = self._r.xreadgroup(self.group, self.consumer, {self.stream: ">"},
                                 count=n - len(got), block=None if got else block_ms)
      got += [(_s(i), (f or {}).get(b"data"), 1) for i, f in (reply[0][1] if reply else [])]
    return self._with_counts(got)

  def _with_counts(self, got: list) -> list[Fetched]:
    """Fill in the delivery counts of re-read entries (None) from the pending list, where
    XREADGROUP and XAUTOCLAIM incremented them."""
    unknown = [i for i, _, c in got if c is None]
    if not unknown:
      return got
    pipe = self._r.pipeline(transaction=False)
    for entry_id in unknown:
      pipe.xpending_range(self.stream, self.group, entry_id, entry_id, 1)
    counts = {i: (r[0]["times_delivered"] if r else 1) for i, r in zip(unknown, pipe.execute())}
    return [(i, d, counts[i] if c is None else c) for i, d, c in got]

  def _dead_letter(self, entry_id: str, data: Optional[bytes], deliveries: int,
                   reason: str) -> None:
    pipe = self._r.pipeline(transaction=True)  # both or neither
    pipe.xadd(self.dead, {"data": data or b"", "entry_id": entry_id, "reason": reason,
                          "deliveries": deliveries, "stream": self.stream})
    pipe.xack(self.stream, self.group, entry_id)
    pipe.execute()

  def ack(self, entry_ids: Iterable[str]) -> int:
    ids, n = list(entry_ids), 0
    for start in range(0, len(ids), 1000):
      n += int(self._r.xack(self.stream, self.group, *ids[start:start + 1000]))
    self.counters.count("acked", n)
    return n

  def _group_info(self) -> Optional[dict]:
    """XINFO GROUPS of our consumer group; None before the group exists."""
    for g in self._r.xinfo_groups(self.stream):
      if _s(g["name"]) == self.group:
        return g
    return None

  def backlog(self) -> int:
    g = self._group_info()
    if g is None:
      return int(self._r.xlen(self.stream))
    return int(g["pending"]) + self._unread(g)

  def unread(self) -> int:
    g = self._group_info()
    return int(self._r.xlen(self.stream)) if g is None else self._unread(g)

  def _unread(self, group_info: dict) -> int:
    lag = group_info.get("lag")  # Redis >= 7; else count the entries past the last delivered
    if lag is not None:
      return int(lag)
    last = _s(group_info["last-delivered-id"])
    return len(self._r.xrange(self.stream, min="(" + last if last != "0-0" else "-", max="+",
                              count=100_000))

  def trim_acked(self) -> int:
    """Deletes entries that are delivered and acked (never an unread or pending one).

    Call now and then in long runs: the stream otherwise keeps every trajectory.

    Returns:
      How many entries were deleted.
    """
    g = self._group_info()
    last = None if g is None else _s(g["last-delivered-id"])
    if last is None or last == "0-0":
      return 0
    threshold = _next_id(last)  # everything below was delivered
    pending = self._r.xpending(self.stream, self.group)
    if pending["pending"]:
      threshold = min(threshold, _s(pending["min"]), key=_id_key)
    return int(self._r.xtrim(self.stream, minid=threshold, approximate=False))

  def dead_letters(self, count: int = 100) -> list[dict]:
    out = []
    for _, fields in self._r.xrange(self.dead, count=count):
      d = {_s(k): v for k, v in fields.items()}
      out.append({"entry_id": _s(d["entry_id"]), "data": d["data"],
                  "deliveries": int(d["deliveries"]), "reason": _s(d["reason"])})
    return out

  def _dead_letter_total(self) -> int:
    return int(self._r.xlen(self.dead))

  # Tasks.

  def _store_fingerprint(self, fingerprint: str) -> tuple[str, str]:
    key = self._task_keys["fingerprint"]
    self._r.set(key, fingerprint, nx=True)
    return _s(self._r.get(key)), f" at {key}"

  def _lease(self, worker_id: str, ttl: float,
             max_draws: Optional[int]) -> tuple[Optional[TaskLease], int]:
    if "|" in worker_id:
      raise ValueError(f"worker_id={worker_id!r}: must not contain '|'")
    k = self._task_keys
    draw, count, dead = self._lease_script(
        keys=[k["draws"], k["leases"], k["info"], k["dead"]],
        args=[worker_id, max(1, int(ttl * 1000)), -1 if max_draws is None else int(max_draws),
              self.task_max_deliveries])
    lease = TaskLease(int(draw), worker_id, int(count)) if int(draw) >= 0 else None
    return lease, int(dead)

  def _holder(self, lease: TaskLease) -> str:
    return f"{lease.deliveries}|{lease.worker_id}"

  def _renew(self, lease: TaskLease, ttl: float) -> bool:
    k = self._task_keys
    return bool(self._renew_script(keys=[k["leases"], k["info"]],
                                   args=[lease.draw, self._holder(lease),
                                         max(1, int(ttl * 1000))]))

  def _complete(self, lease: TaskLease, blobs: Sequence[bytes]) -> bool:
    k = self._task_keys
    return bool(self._complete_script(keys=[k["leases"], k["info"], self.stream, k["done"]],
                                      args=[lease.draw, self._holder(lease), *blobs]))

  def release_task(self, lease: TaskLease) -> bool:
    k = self._task_keys
    return bool(self._release_script(keys=[k["leases"], k["info"]],
                                     args=[lease.draw, self._holder(lease),
                                           lease.deliveries - 1]))

  def task_status(self) -> dict[str, int]:
    k = self._task_keys
    pipe = self._r.pipeline(transaction=False)
    pipe.get(k["draws"]), pipe.zcard(k["leases"]), pipe.get(k["done"]), pipe.llen(k["dead"])
    draws, open_, done, dead = pipe.execute()
    return {"draws": int(draws or 0), "open": int(open_), "done": int(done or 0),
            "dead": int(dead)}

  def close(self) -> None:
    self._r.close()
