"""Rollout queue (envs.queue): at-least-once delivery, re-claim after a consumer dies, restart
recovery, dead letters, task leases, group assembly, auth and TLS. Both backends where the
semantics are shared; the Redis ones against a real redis-server (tests/redis_fixture.py)."""

import os
import signal
import socket
import subprocess
import sys
import time

import msgpack
import pytest

from envs.queue import (Counters, Delivery, GroupAssembler, InMemoryQueue, RedisQueue,
                        TaskLease, check_claim_timeout, drop_stale, filter_unseen, make_queue,
                        task_order)
from envs.trajectory import LLMCall, Trajectory
from tests.redis_fixture import start_redis

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLAIM = 0.4  # seconds before a Redis entry / lease of a dead holder is taken back


@pytest.fixture(scope="module")
def server():
  s = start_redis(tls=True)
  yield s
  s.stop()


class FakeClock:
  def __init__(self):
    self.t = 1000.0

  def __call__(self) -> float:
    return self.t


class Backend:
  """Makes queues of one backend and lets time pass (fake clock in memory, real for Redis)."""

  def __init__(self, kind, server):
    self.kind, self.server = kind, server
    self.clock = FakeClock()
    self.prefix = server.prefix() if server else None
    self.first = None

  def make(self, consumer="trainer", **kw):
    kw.setdefault("claim_timeout", CLAIM)
    if self.kind == "memory":
      if self.first is None:
        self.first = InMemoryQueue(consumer=consumer, clock=self.clock, **kw)
        return self.first
      return InMemoryQueue(consumer=consumer, clock=self.clock, _state=self.first._s, **kw)
    return RedisQueue(self.server.url, password=self.server.password, prefix=self.prefix,
                      consumer=consumer, **kw)

  def wait(self, seconds):
    if self.kind == "memory":
      self.clock.t += seconds
    else:
      time.sleep(seconds)


@pytest.fixture(params=["memory", "redis"])
def backend(request, server):
  return Backend(request.param, server if request.param == "redis" else None)


def traj(i=0, group="g0", version=0, group_size=None):
  meta = {"group_size": group_size} if group_size else {}
  return Trajectory(calls=[LLMCall([1, 2, i], [3, 4], [-0.5, -0.25], policy_version=version)],
                    reward=float(i), task_id="t", group_id=group, termination="submitted",
                    metadata=meta)


def ids(deliveries):
  return sorted(d.trajectory.trajectory_id for d in deliveries)


def test_put_get_ack_roundtrip_and_acked_never_redelivered(backend):
  q = backend.make()
  sent = [traj(i) for i in range(5)]
  for t in sent:
    q.put(t)
  got = q.get_batch(3, timeout=1) + q.get_batch(10, timeout=0.2)
  assert ids(got) == sorted(t.trajectory_id for t in sent)
  assert all(d.deliveries == 1 for d in got)
  by_id = {d.trajectory.trajectory_id: d.trajectory for d in got}
  assert by_id[sent[2].trajectory_id].calls[0].input_ids == [1, 2, 2]
  assert q.backlog() == 5
  assert q.ack([d.entry_id for d in got]) == 5
  assert q.backlog() == 0
  backend.wait(CLAIM * 2)
  assert q.get_batch(10, timeout=0.2) == []
  assert q.with_consumer("other").get_batch(10, timeout=0.2) == []  # nor to anyone else


def test_unacked_redelivered_to_another_consumer_after_claim_timeout(backend):
  a, b = backend.make("a"), backend.make("b")
  for i in range(4):
    a.put(traj(i))
  got = a.get_batch(4, timeout=1)
  a.ack([got[0].entry_id])
  assert b.get_batch(10, timeout=0.1) == []  # still a's: not idle long enough
  backend.wait(CLAIM * 1.5)
  again = b.get_batch(10, timeout=0.5)
  assert ids(again) == ids(got[1:])
  assert all(d.deliveries == 2 for d in again)
  assert b.counters["redelivered"] == 3


def test_restarted_consumer_takes_back_its_pending_entries_at_once(backend):
  q = backend.make("trainer", claim_timeout=60)
  for i in range(5):
    q.put(traj(i))
  first = q.get_batch(3, timeout=1)
  q.ack([first[0].entry_id])
  restarted = backend.make("trainer", claim_timeout=60)  # same name, long before the timeout
  got = restarted.get_batch(10, timeout=0.5)
  rest = got + restarted.get_batch(10, timeout=0.1)
  assert ids(rest[:2]) == ids(first[1:])  # own pending first, then the unread ones
  assert sorted(d.deliveries for d in rest) == [1, 1, 2, 2]
  assert first[0].trajectory.trajectory_id not in ids(rest)


def test_poison_entry_goes_to_dead_letter_after_max_deliveries(backend):
  q = backend.make("a", max_deliveries=2)
  q.put(traj(0))
  assert q.get_batch(1, timeout=1)[0].deliveries == 1
  backend.wait(CLAIM * 1.5)
  assert q.get_batch(1, timeout=0.5)[0].deliveries == 2
  backend.wait(CLAIM * 1.5)
  q.put(traj(1))
  got = q.get_batch(5, timeout=0.5)
  assert [d.trajectory.reward for d in got] == [1.0]  # the consumer carries on with the next
  dead = q.dead_letters()
  assert len(dead) == 1 and "delivered 2 times" in dead[0]["reason"]
  assert dead[0]["data"] and Trajectory.from_bytes(dead[0]["data"]).reward == 0.0
  assert q.counters["dead_letter"] == 1
  backend.wait(CLAIM * 1.5)
  q.ack([got[0].entry_id])
  assert q.get_batch(5, timeout=0.2) == []  # dead-lettered entries are acked on the main stream
  assert q.backlog() == 0 and q.metrics()["queue/dead_letter_total"] == 1


def test_malformed_entries_go_to_dead_letter_without_crashing(backend):
  q = backend.make()
  q.put_raw(b"\x93\x01\x02")              # valid msgpack, not a trajectory
  q.put_raw(b"\xc1 not msgpack at all")   # invalid msgpack
  bad = traj(1).to_dict()
  bad["calls"][0]["output_ids"] = "ab"     # the right shape, the wrong types
  bad["calls"][0]["output_logprobs"] = "cd"
  q.put_raw(msgpack.packb(bad))
  q.put_raw(msgpack.packb({**traj(2).to_dict(), "reward": float("nan")}))
  q.put(traj(7))
  got = q.get_batch(5, timeout=0.3)
  assert [d.trajectory.reward for d in got] == [7.0]
  assert q.counters["malformed"] == 4 and q.counters["dead_letter"] == 4
  reasons = [d["reason"] for d in q.dead_letters()]
  assert len(reasons) == 4 and all("not a serialised Trajectory" in r for r in reasons[:2])
  assert "calls[0].output_ids='ab'" in reasons[2] and "reward=nan" in reasons[3]
  assert q.backlog() == 1  # only the good one, pending


_CONSUMER = """
import os, sys, time
from envs.queue import RedisQueue
q = RedisQueue(os.environ["URL"], password=os.environ["PASSWORD"], prefix=os.environ["PREFIX"],
               consumer=sys.argv[1], claim_timeout=float(os.environ["CLAIM"]))
batch = q.get_batch(int(sys.argv[2]), timeout=10)
q.ack([d.entry_id for d in batch[:2]])  # the part a checkpoint already covered
print(" ".join(d.trajectory.trajectory_id for d in batch), flush=True)
time.sleep(60)                            # "training" the rest when SIGKILL arrives
"""


def _consumer(server, prefix, name, n):
  env = dict(os.environ, URL=server.url, PASSWORD=server.password, PREFIX=prefix,
             CLAIM=str(CLAIM), PYTHONPATH=ROOT)
  proc = subprocess.Popen([sys.executable, "-c", _CONSUMER, name, str(n)], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, text=True)
  line = proc.stdout.readline().split()
  return proc, line


def test_consumer_sigkilled_mid_batch_loses_nothing(server):
  prefix = server.prefix()
  q = RedisQueue(server.url, password=server.password, prefix=prefix, consumer="b",
                 claim_timeout=CLAIM)
  sent = [traj(i) for i in range(10)]
  for t in sent:
    q.put(t)
  proc, got = _consumer(server, prefix, "a", 6)
  try:
    assert len(got) == 6
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
  acked, unacked = got[:2], got[2:]
  time.sleep(CLAIM * 1.5)
  rest = []
  for _ in range(3):
    rest += q.get_batch(20, timeout=0.2)
    q.ack([d.entry_id for d in rest])  # as the trainer would, before the claim timeout
  rest_ids = ids(rest)
  assert sorted(rest_ids) == sorted(set(t.trajectory_id for t in sent) - set(acked))
  redelivered = {d.trajectory.trajectory_id: d.deliveries for d in rest}
  assert all(redelivered[i] == 2 for i in unacked)  # a's unacked entries came back
  assert not set(acked) & set(rest_ids)             # acked ones never do


def test_restarted_consumer_process_resumes_from_the_stream(server):
  prefix = server.prefix()
  q = RedisQueue(server.url, password=server.password, prefix=prefix, consumer="x",
                 claim_timeout=CLAIM)
  sent = [traj(i) for i in range(8)]
  for t in sent:
    q.put(t)
  proc, first = _consumer(server, prefix, "trainer", 4)
  proc.kill(), proc.wait(10)
  proc, second = _consumer(server, prefix, "trainer", 6)  # same name, right away
  proc.kill(), proc.wait(10)
  assert len(first) == 4 and len(second) == 6
  assert second[:2] == first[2:]                  # its unacked entries first
  assert not set(first[:2]) & set(second)         # acked: never again
  assert set(second[2:]) <= {t.trajectory_id for t in sent} - set(first)


def test_password_required(server):
  with socket.create_connection(("127.0.0.1", server.port), timeout=5) as conn:  # raw RESP
    conn.sendall(b"XADD x * data 1\r\n")
    assert conn.recv(200).startswith(b"-NOAUTH")
  with pytest.raises(PermissionError, match="refused authentication|requires a password"):
    RedisQueue(server.url, password="wrong", prefix=server.prefix())
  with pytest.raises(PermissionError):
    RedisQueue(server.url, prefix=server.prefix())
  url = f"redis://:{server.password}@127.0.0.1:{server.port}"  # password in the URL works too
  RedisQueue(url, prefix=server.prefix()).close()


def test_tls_url(server, tmp_path):
  pw = tmp_path / "pw"
  pw.write_text(server.password + "\n")
  q = make_queue(server.tls_url, password_file=str(pw), ca_file=server.ca_file,
                 prefix=server.prefix())
  assert isinstance(q, RedisQueue)
  q.put(traj(3))
  assert [d.trajectory.reward for d in q.get_batch(1, timeout=1)] == [3.0]
  with pytest.raises(ConnectionError):  # plain text against the TLS port
    RedisQueue(f"redis://127.0.0.1:{server.tls_port}", password=server.password,
               prefix=server.prefix())


def test_task_leases(backend):
  q = backend.make(task_max_deliveries=2)
  a = q.lease_task("wa", ttl=CLAIM)
  b = q.lease_task("wb", ttl=60)
  assert (a.draw, b.draw, a.deliveries) == (0, 1, 1)
  assert q.renew_task(a, ttl=CLAIM)
  backend.wait(CLAIM * 1.5)            # wa died: its lease expires and draw 0 is re-issued
  c = q.lease_task("wc", ttl=60)
  assert (c.draw, c.deliveries) == (0, 2)
  assert not q.renew_task(a, ttl=60)
  assert not q.complete_task(a, [traj(1)])   # too late: nothing is put
  assert q.counters["lease_lost"] == 1
  assert q.complete_task(c, [traj(2, group="0/0"), traj(3, group="0/0")])
  assert not q.complete_task(c, [traj(4)])   # a draw completes once
  got = q.get_batch(10, timeout=0.5)
  assert sorted(d.trajectory.reward for d in got) == [2.0, 3.0]
  assert q.release_task(b)                   # handed back: re-issued at once, not counted
  d = q.lease_task("wd", ttl=CLAIM, max_draws=2)
  assert (d.draw, d.deliveries) == (1, 1)
  assert q.lease_task("we", ttl=60, max_draws=2) is None  # all draws out, none expired
  backend.wait(CLAIM * 1.5)
  e = q.lease_task("we", ttl=CLAIM, max_draws=2)
  assert (e.draw, e.deliveries) == (1, 2)
  backend.wait(CLAIM * 1.5)                  # died again: over task_max_deliveries=2
  assert q.lease_task("wf", ttl=60, max_draws=2) is None
  assert q.task_status() == {"draws": 2, "open": 0, "done": 1, "dead": 1}
  assert q.counters["dead_task"] == 1


def test_task_source_fingerprint(backend):
  q = backend.make()
  q.check_task_source("abc")
  q.check_task_source("abc")
  with pytest.raises(ValueError, match="fingerprint=xyz"):
    backend.make("w2").check_task_source("xyz")


def test_trim_keeps_unacked_entries(server):
  q = RedisQueue(server.url, password=server.password, prefix=server.prefix())
  for i in range(6):
    q.put(traj(i))
  got = q.get_batch(4, timeout=1)
  q.ack([got[0].entry_id, got[1].entry_id, got[3].entry_id])
  assert q.trim_acked() == 2                 # the two before the oldest pending entry
  assert q.backlog() == 3                    # pending got[2] + 2 unread
  q.ack([got[2].entry_id])
  assert q.trim_acked() == 2                 # got[2], got[3]; never the unread ones
  assert sorted(d.trajectory.reward for d in q.get_batch(5, timeout=0.5)) == [4.0, 5.0]


def _deliveries(trajs, start=0):
  return [Delivery(f"{start + i}-0", t, 1) for i, t in enumerate(trajs)]


def test_group_assembler_rule():
  clock, counters = FakeClock(), Counters()
  asm = GroupAssembler(group_size=4, min_group_size=2, deadline=10, counters=counters,
                       clock=clock)
  whole = [traj(i, group="A") for i in range(4)]
  asm.add(_deliveries(whole[:3]))
  assert asm.pop_ready() == ([], [])
  asm.add(_deliveries(whole[3:], 3))
  ready, dropped = asm.pop_ready()
  assert [g.group_id for g in ready] == ["A"] and not ready[0].partial and dropped == []
  asm.add(_deliveries([traj(0, group="B"), traj(1, group="B")], 10))
  asm.add(_deliveries([traj(0, group="C")], 20))
  clock.t += 11                                   # deadline: B (2 >= min 2) trains partial,
  ready, dropped = asm.pop_ready()                # C (1 < 2) is dropped
  assert [(g.group_id, g.partial, len(g.deliveries)) for g in ready] == [("B", True, 2)]
  assert [d.trajectory.group_id for d in dropped] == ["C"]
  late = _deliveries([traj(5, group="A"), traj(6, group="C")], 30)  # closed groups
  asm.add(late)
  dup = traj(1, group="D", group_size=2)
  asm.add(_deliveries([dup, dup], 40))           # the same trajectory twice
  ready, dropped = asm.pop_ready()
  assert ready == [] and len(dropped) == 3
  assert counters["dropped_partial_group"] == 3 and counters["duplicate"] == 1
  asm.add(_deliveries([traj(2, group="D", group_size=2)], 50))  # per-trajectory group size
  ready, _ = asm.pop_ready()
  assert [(g.group_id, len(g.deliveries)) for g in ready] == [("D", 2)]
  with pytest.raises(ValueError, match="min_group_size=5"):
    GroupAssembler(group_size=4, min_group_size=5)


def test_drop_stale_and_filter_unseen():
  counters = Counters()
  asm = GroupAssembler(group_size=2)
  asm.add(_deliveries([traj(0, "old", version=1), traj(1, "old", version=3),
                       traj(2, "new", version=3), traj(3, "new", version=4)]))
  groups, _ = asm.pop_ready()
  fresh, stale = drop_stale(groups, policy_version=4, max_staleness=2, counters=counters)
  assert [g.group_id for g in fresh] == ["new"] and len(stale) == 2  # oldest token decides
  assert counters["dropped_stale"] == 2
  a, b = traj(0), traj(1)
  batch = _deliveries([a, b, a])
  fresh, seen = filter_unseen(batch, {b.trajectory_id})
  assert [d.entry_id for d in fresh] == ["0-0"] and [d.entry_id for d in seen] == ["1-0", "2-0"]


def test_validation_and_task_order():
  with pytest.raises(ValueError, match="claim_timeout=60s must be longer than checkpoint"):
    check_claim_timeout(60, checkpoint_interval_s=50, group_deadline_s=20)
  check_claim_timeout(600, checkpoint_interval_s=300, group_deadline_s=120)
  with pytest.raises(ValueError, match="max_deliveries=0"):
    InMemoryQueue(max_deliveries=0)
  with pytest.raises(ValueError, match="url="):
    RedisQueue("http://127.0.0.1:1")
  with pytest.raises(ValueError, match="ttl=0"):
    InMemoryQueue().lease_task("w", ttl=0)
  orders = [task_order(5, epoch) for epoch in range(3)]
  assert all(sorted(o) == list(range(5)) for o in orders)
  assert (task_order(5, 1) == orders[1]).all() and not (orders[0] == orders[1]).all()
  assert isinstance(make_queue(None), InMemoryQueue)
  lease = TaskLease(0, "w")
  assert lease.deliveries == 1
