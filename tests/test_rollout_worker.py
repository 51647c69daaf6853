"""Rollout worker (envs.rollout_worker): leases, groups, re-issue after a SIGKILL, graceful
SIGTERM, backpressure, bad task lines. Episodes are fakes here (the queue/lease/signal logic is
tested on its own); `test_react_episode_end_to_end` wires the real scaffold, sandbox and
verifier with a scripted policy."""

import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from envs.episode import episode_seed, load_task_file, run_task_group
from envs.queue import InMemoryQueue, RedisQueue
from envs.rollout_worker import RolloutWorker, WorkerConfig, WorkerThread
from envs.tasks import Task
from envs.trajectory import LLMCall, Trajectory
from tests.redis_fixture import start_redis

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def exact_task(instance_id):
  return Task(instance_id, "exact", (f"What is {instance_id}?",), answers=("42",))


TASKS = [exact_task(f"t{i}") for i in range(3)]


@pytest.fixture(scope="module")
def server():
  s = start_redis()
  yield s
  s.stop()


def fake_trajectory(task, group_id, metadata, reward=1.0):
  return Trajectory([LLMCall([1, 2], [3], [-0.1])], reward=reward, task_id=task.instance_id,
                    group_id=group_id, termination="submitted", metadata=dict(metadata or {}))


def fake_episode(seconds=0.0, fail_index=None, running=None):
  """An episode that sleeps; `running` tracks how many run at once."""
  async def episode(task, index, seed, *, group_id="", metadata=None):
    if running is not None:
      running["now"] += 1
      running["max"] = max(running["max"], running["now"])
    try:
      await asyncio.sleep(seconds)
      if index == fail_index:
        raise RuntimeError("sandbox exploded")
      return fake_trajectory(task, group_id, metadata, reward=float(index))
    finally:
      if running is not None:
        running["now"] -= 1
  return episode


def drain(q, n=1000):
  got = q.get_batch(n, timeout=0.05)
  q.ack([d.entry_id for d in got])
  return [d.trajectory for d in got]


def test_worker_puts_whole_groups_and_respects_concurrency():
  q = InMemoryQueue()
  running = {"now": 0, "max": 0}
  cfg = WorkerConfig(group_size=3, concurrency=4, max_draws=5, poll=0.01)
  stats = asyncio.run(RolloutWorker(q, TASKS, fake_episode(0.1, running=running), cfg).run())
  trajs = drain(q)
  groups = collections.Counter(t.group_id for t in trajs)
  assert len(groups) == 5 and set(groups.values()) == {3}
  assert {g.split("/")[1] for g in groups} == {str(d) for d in range(5)}  # group = task/draw
  assert all(t.metadata["group_size"] == 3 and t.task_id == t.group_id.split("/")[0]
             for t in trajs)
  epoch0 = [t.task_id for t in trajs if int(t.metadata["draw"]) < 3]
  assert sorted(set(epoch0)) == ["t0", "t1", "t2"]  # each task once per epoch
  assert running["max"] == 4                         # 2 slots x 3, capped at concurrency 4
  assert stats["groups_done"] == 5 and stats["trajectories_put"] == 15
  assert q.task_status() == {"draws": 5, "open": 0, "done": 5, "dead": 0}


def test_failed_episode_leaves_a_partial_group_and_the_worker_goes_on():
  q = InMemoryQueue()
  cfg = WorkerConfig(group_size=3, concurrency=3, max_draws=2, poll=0.01)
  stats = asyncio.run(RolloutWorker(q, TASKS, fake_episode(0, fail_index=1), cfg).run())
  trajs = drain(q)
  assert len(trajs) == 4 and sorted({t.metadata["index"] for t in trajs}) == [0, 2]
  assert stats["episodes_failed"] == 2 and stats["groups_partial"] == 2


def test_worker_thread_for_the_trainer():
  q = InMemoryQueue()
  cfg = WorkerConfig(group_size=2, concurrency=2, max_backlog=4, grace=5, poll=0.01)
  thread = WorkerThread(RolloutWorker(q, TASKS, fake_episode(0.05), cfg)).start()
  got = []
  for _ in range(200):                       # the trainer's synchronous loop
    batch = q.get_batch(4, timeout=0.05)
    q.ack([d.entry_id for d in batch])
    got += batch
    if len(got) >= 6:
      break
  stats = thread.stop(timeout=10)
  got += q.get_batch(100, timeout=0.05)     # what was finished during the stop
  assert stats["trajectories_put"] == len(got) >= 6
  assert all(n == 2 for n in collections.Counter(d.trajectory.group_id for d in got).values())


def test_run_task_group_abort_returns_finished_episodes():
  async def main():
    abort = asyncio.Event()

    async def episode(task, index, seed, *, group_id="", metadata=None):
      await asyncio.sleep(0.01 if index == 0 else 60)
      return fake_trajectory(task, group_id, metadata)
    asyncio.get_running_loop().call_later(0.2, abort.set)
    counters = {}
    out = await run_task_group(exact_task("x"), 3, episode, draw=7, abort=abort,
                               counters=counters)
    return out, counters
  start = time.monotonic()
  out, counters = asyncio.run(main())
  assert time.monotonic() - start < 5
  assert [(t.group_id, t.metadata["index"]) for t in out] == [("x/7", 0)]
  assert counters == {"episodes_cancelled": 2}


def test_run_task_group_builds_ids_into_each_episode_and_refuses_others():
  seeds = {}

  async def episode(task, index, seed, *, group_id="", metadata=None):
    seeds[index] = seed
    return fake_trajectory(task, group_id if index else "another/3", metadata)
  counters = {}
  out = asyncio.run(run_task_group(exact_task("x"), 2, episode, draw=3, seed=1,
                                   counters=counters))
  assert [(t.task_id, t.group_id, t.metadata) for t in out] == [
      ("x", "x/3", {"group_size": 2, "draw": 3, "index": 1})]
  assert counters == {"episodes_failed": 1}
  assert seeds == {i: episode_seed(1, 3, i) for i in range(2)}


def test_backpressure_waits_for_the_trainer():
  q = InMemoryQueue()
  cfg = WorkerConfig(group_size=2, concurrency=2, max_backlog=2, max_draws=3, poll=0.02)

  async def until_full():
    for _ in range(500):
      if q.backlog() == 2:
        return
      await asyncio.sleep(0.02)
    raise AssertionError("the worker never filled the queue")

  async def main():
    run = asyncio.ensure_future(RolloutWorker(q, TASKS, fake_episode(0), cfg).run())
    held = []
    for _ in range(3):
      await until_full()
      await asyncio.sleep(0.3)
      held.append((q.backlog(), q.task_status()["draws"]))  # no new lease while full
      q.ack([d.entry_id for d in q.get_batch(1000, timeout=0)])  # the trainer consumes
    return held, await asyncio.wait_for(run, 10)
  held, stats = asyncio.run(main())
  assert held == [(2, 1), (2, 2), (2, 3)]
  assert stats["backpressure_waits"] == 3 and stats["groups_done"] == 3


def test_entries_taken_but_not_yet_acked_do_not_hold_workers_back():
  """The trainer acks only after a checkpoint; until then its entries are pending, not unread,
  and the workers go on (else max_backlog below a checkpoint interval's entries deadlocks)."""
  q = InMemoryQueue()
  cfg = WorkerConfig(group_size=2, concurrency=2, max_backlog=2, max_draws=3, poll=0.02)

  async def main():
    run = asyncio.ensure_future(RolloutWorker(q, TASKS, fake_episode(0), cfg).run())
    taken = []
    while len(taken) < 6:
      taken += await asyncio.to_thread(q.get_batch, 6, 0.05)  # taken, never acked
    return taken, await asyncio.wait_for(run, 10)
  taken, stats = asyncio.run(main())
  assert len(taken) == 6 and q.backlog() == 6 and q.unread() == 0
  assert stats["groups_done"] == 3


def test_leases_are_renewed_and_a_lost_lease_aborts_its_group():
  offset = [0.0]
  q = InMemoryQueue(clock=lambda: time.monotonic() + offset[0])
  cfg = WorkerConfig(group_size=2, concurrency=2, lease_ttl=0.3, max_draws=1, poll=0.02)

  async def main():
    # Episodes 4x longer than the ttl: renewals keep the draw with its worker.
    slow = RolloutWorker(q, TASKS, fake_episode(1.2), cfg, worker_id="slow")
    rival = RolloutWorker(q, TASKS, fake_episode(0), cfg, worker_id="rival")
    kept = await asyncio.wait_for(asyncio.gather(slow.run(), rival.run()), 10)
    # A worker presumed dead (its lease expired and went to another) stops its episodes.
    q2 = InMemoryQueue(clock=q.clock)
    worker = RolloutWorker(q2, TASKS, fake_episode(60), cfg, worker_id="doomed")
    doomed = asyncio.ensure_future(worker.run())
    while q2.task_status()["open"] == 0:
      await asyncio.sleep(0.01)
    offset[0] += 10                               # time jumps past the lease
    thief = q2.lease_task("thief", ttl=60)
    assert thief.deliveries == 2
    for _ in range(500):
      if worker.counters.get("groups_lost_lease"):
        break
      await asyncio.sleep(0.01)
    q2.complete_task(thief, [])                   # now every draw is done: the worker exits
    return kept, await asyncio.wait_for(doomed, 10)
  (slow, rival), doomed = asyncio.run(main())
  assert slow["groups_done"] == 1 and "groups_done" not in rival
  assert "leases_reissued" not in slow and "leases_reissued" not in rival
  assert doomed["episodes_cancelled"] == 2 and doomed["groups_lost_lease"] == 1


_WORKER = """
import asyncio, json, os, sys
from envs.queue import RedisQueue
from envs.rollout_worker import RolloutWorker, WorkerConfig
from envs.tasks import Task
from envs.trajectory import LLMCall, Trajectory
durations = json.loads(os.environ["DURATIONS"])

async def episode(task, index, seed, *, group_id="", metadata=None):
  print("start", task.instance_id, index, flush=True)
  await asyncio.sleep(durations[index])
  return Trajectory([LLMCall([1], [2], [-0.1])], reward=float(index), task_id=task.instance_id,
                    group_id=group_id, termination="submitted", metadata=dict(metadata))

q = RedisQueue(os.environ["URL"], password=os.environ["PASSWORD"], prefix=os.environ["PREFIX"])
cfg = WorkerConfig(**json.loads(os.environ["CONFIG"]))
tasks = [Task(f"t{i}", "exact", (f"What is t{i}?",), answers=("42",)) for i in range(3)]
stats = asyncio.run(RolloutWorker(q, tasks, episode, cfg, worker_id=sys.argv[1]).run(
    handle_signals=True))
print("stats", json.dumps(stats), flush=True)
"""


def _start_worker(server, prefix, name, durations, **config):
  env = dict(os.environ, URL=server.url, PASSWORD=server.password, PREFIX=prefix,
             DURATIONS=json.dumps(durations), CONFIG=json.dumps(config), PYTHONPATH=ROOT)
  return subprocess.Popen([sys.executable, "-c", _WORKER, name], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, text=True)


def _queue(server, prefix):
  return RedisQueue(server.url, password=server.password, prefix=prefix)


def test_worker_killed_mid_task_has_its_task_reissued(server):
  prefix = server.prefix()
  proc = _start_worker(server, prefix, "doomed", [60, 60], group_size=2, concurrency=2,
                       lease_ttl=0.6, max_draws=3, poll=0.05)
  try:
    lines = [proc.stdout.readline().split() for _ in range(2)]
    assert [line[2] for line in lines] == ["0", "1"]  # both episodes of its draw running
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
  q = _queue(server, prefix)
  assert q.task_status()["open"] == 1
  cfg = WorkerConfig(group_size=2, concurrency=4, lease_ttl=0.6, max_draws=3, poll=0.05)
  stats = asyncio.run(asyncio.wait_for(
      RolloutWorker(q, TASKS, fake_episode(0.05), cfg, worker_id="rescuer").run(), 20))
  assert stats["leases_reissued"] == 1 and stats["groups_done"] == 3
  trajs = drain(q)
  groups = collections.Counter(t.group_id for t in trajs)
  assert sorted(int(g.split("/")[1]) for g in groups) == [0, 1, 2]  # draw 0 done by the rescuer
  assert set(groups.values()) == {2}
  assert q.task_status() == {"draws": 3, "open": 0, "done": 3, "dead": 0}


def test_sigterm_delivers_finished_trajectories_then_exits(server):
  prefix = server.prefix()
  # Episode 0 ends before SIGTERM, 1 during the grace period, 2 would outlive it.
  proc = _start_worker(server, prefix, "w", [0.1, 1.0, 60], group_size=3, concurrency=3,
                       lease_ttl=5, grace=2.0, poll=0.05)
  try:
    for _ in range(3):
      assert proc.stdout.readline().startswith("start")
    time.sleep(0.4)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    took = time.monotonic() - start
  finally:
    proc.kill()
  assert proc.returncode == 0, out
  assert 1.5 < took < 6  # waited for the grace period, not for episode 2
  stats = json.loads(out.split("stats ", 1)[1])
  assert stats["groups_done"] == 1 and stats["episodes_cancelled"] == 1
  q = _queue(server, prefix)
  trajs = drain(q)
  assert sorted(t.metadata["index"] for t in trajs) == [0, 1]
  assert len({t.group_id for t in trajs}) == 1
  assert q.task_status() == {"draws": 1, "open": 0, "done": 1, "dead": 0}


def test_worker_rides_out_a_redis_restart():
  servers = [start_redis()]
  try:
    s = servers[0]
    prefix = s.prefix()
    q = RedisQueue(s.url, password=s.password, prefix=prefix)
    cfg = WorkerConfig(group_size=2, concurrency=2, lease_ttl=5, max_draws=4, poll=0.05,
                       queue_patience=30)

    async def main():
      run = asyncio.ensure_future(RolloutWorker(q, TASKS, fake_episode(0.3), cfg).run())
      while (await asyncio.to_thread(q.task_status))["done"] < 1:
        await asyncio.sleep(0.02)
      await asyncio.to_thread(s.stop, True)            # Redis goes away mid-run ...
      await asyncio.sleep(0.5)
      servers.append(await asyncio.to_thread(start_redis, False, s))  # ... and comes back
      return await asyncio.wait_for(run, 30)
    stats = asyncio.run(main())
    # Calls failed in the outage are retried (by redis-py, then by the worker). A completion
    # whose reply was lost is refused on retry: counted lost, yet delivered once.
    assert stats["groups_done"] + stats.get("groups_lost_lease", 0) == 4
    trajs = drain(q)                  # the stream and the draw counter survived (append-only)
    groups = collections.Counter(t.group_id for t in trajs)
    assert sorted(int(g.split("/")[1]) for g in groups) == [0, 1, 2, 3]
    assert set(groups.values()) == {2}
  finally:
    for server in servers:
      server.stop()


def test_task_file_bad_lines_are_counted_and_skipped(tmp_path):
  path = tmp_path / "tasks.jsonl"
  good = {"id": "q1", "kind": "exact", "prompt": "6 * 7?", "answer": "42"}
  path.write_text("\n".join([json.dumps(good), "{not json", json.dumps({"id": "q2"}),
                             json.dumps({**good, "id": "q3"})]) + "\n")
  tasks, bad = load_task_file(str(path))
  assert [t.instance_id for t in tasks] == ["q1", "q3"] and bad == 2


# ---------------------------------------------------------------------------------------------
# End to end: `python -m envs.rollout_worker` with the react scaffold, local sandboxes, the tests
# verifier, an HTTP policy (a scripted solver behind a tiny /generate server) and Redis.


def _byte_tokenizer(d):
  """A byte-level tiktoken tokenizer: 256 byte tokens + [BOS] 256, [EOS] 257."""
  import base64
  os.makedirs(d, exist_ok=True)
  with open(os.path.join(d, "tiktoken.model"), "w") as f:
    f.write("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
  with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
    json.dump({"added_tokens_decoder": {"256": {"content": "[BOS]"}, "257": {"content": "[EOS]"}},
               "bos_token": "[BOS]", "eos_token": "[EOS]"}, f)
  return d


class _SolverServer:
  """POST /generate: the first turn of every other episode applies the task's known fix with
  str_replace, the others submit at once; any later turn submits."""

  def __init__(self, chat, tasks):
    import http.server
    import threading
    self.chat, self.tasks, self.first_calls, self.lock = chat, tasks, 0, threading.Lock()
    solver = self

    class Handler(http.server.BaseHTTPRequestHandler):
      def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ids = solver.reply(body["input_ids"])
        out = json.dumps({"output_ids": ids, "logprobs": [-0.1] * len(ids),
                          "finish_reason": "stop", "policy_version": 3}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

      def log_message(self, *args):
        pass

    self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
    threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

  def reply(self, input_ids):
    text = self.chat.tokenizer.decode(input_ids)
    submit = {"role": "assistant", "content": "", "tool_calls": [{"name": "submit",
                                                                   "arguments": {}}]}
    msg = submit
    if "### Tool" not in text:  # first turn
      with self.lock:
        self.first_calls += 1
        fix = self.first_calls % 2 == 1
      if fix:
        task = next(t for t in self.tasks if any(s in text for s in t.problem_statements))
        e = task.metadata["fix_edit"]
        msg = {"role": "assistant", "content": "Fixing it.", "tool_calls": [{
            "name": "str_replace",
            "arguments": {"path": e["path"], "old_str": e["old"], "new_str": e["new"]}}]}
    return self.chat.assistant_ids(msg)

  def close(self):
    self.httpd.shutdown()


def test_react_episode_end_to_end(server, tmp_path):
  from envs.chat import load_tokenizer, make_chat
  from envs.taskgen import write_tasks
  tasks = write_tasks(str(tmp_path / "tasks"), n=2, level=0, seed=3)
  task_file = tmp_path / "tasks" / "tasks.jsonl"
  with open(task_file, "a") as f:
    f.write("{broken json\n" + json.dumps({"instance_id": "no-fields"}) + "\n")
  tok_dir = _byte_tokenizer(str(tmp_path / "tok"))
  chat = make_chat("plain", load_tokenizer(tok_dir))
  policy = _SolverServer(chat, tasks)
  (tmp_path / "pw").write_text(server.password)
  prefix = server.prefix()
  try:
    proc = subprocess.run(
        [sys.executable, "-m", "envs.rollout_worker", "--policy_url", policy.url,
         "--queue", server.url, "--queue_password_file", str(tmp_path / "pw"),
         "--queue_prefix", prefix, "--tasks", str(task_file), "--group_size", "2",
         "--concurrency", "2", "--sandbox", "local", "--allow_unsafe_sandbox",
         "--tokenizer", tok_dir, "--chat", "plain", "--epochs", "1", "--max_turns", "4"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
        timeout=120)
  finally:
    policy.close()
  assert proc.returncode == 0, proc.stderr[-3000:]
  stats = json.loads(proc.stdout.strip().splitlines()[-1])
  assert stats["groups_done"] == 2 and stats["bad_task_lines"] == 2
  trajs = drain(_queue(server, prefix))
  groups = collections.defaultdict(list)
  for t in trajs:
    groups[t.group_id].append(t)
  assert sorted(g.rsplit("/", 1)[1] for g in groups) == ["0", "1"]  # group = task/draw
  assert sorted(g.rsplit("/", 1)[0] for g in groups) == sorted(t.instance_id for t in tasks)
  assert all(len(g) == 2 for g in groups.values())
  for t in trajs:
    fixed = "str_replace" in chat.tokenizer.decode(t.calls[0].output_ids)
    assert t.reward == (1.0 if fixed else 0.0), t.metadata["verdict"]
    assert t.termination == "submitted" and len(t.calls) == (2 if fixed else 1)
    assert all(c.policy_version == 3 for c in t.calls)
    if fixed:  # the next input extends the previous input + the sampled ids verbatim
      first, second = t.calls
      assert second.input_ids[:len(first.input_ids) + len(first.output_ids)] == \
          first.input_ids + first.output_ids
  assert sorted(t.reward for t in trajs) == [0.0, 0.0, 1.0, 1.0]


def test_the_command_line_gives_tasks_their_environments(caplog):
  """--env_from / --default_environment are read as the trainer reads rl.env_from and
  rl.default_environment; a bad value stops the worker before it connects anywhere."""
  from envs import rollout_worker
  base = ["--policy_url", "http://127.0.0.1:9", "--queue", "redis://127.0.0.1:9",
          "--tokenizer", "unused", "--tasks",
          os.path.join(ROOT, "envs", "data", "swe", "tasks.jsonl")]
  args = rollout_worker.parse_args(base + ["--env_from", "repository",
                                           "--default_environment", "bookworm-pytest"])
  assert (args.env_from, args.default_environment) == ("repository", "bookworm-pytest")
  with pytest.raises(SystemExit):
    rollout_worker.parse_args(base + ["--env_from", "conda"])
  assert rollout_worker.main(base + ["--default_environment", "nope"]) == 2
  assert "--default_environment='nope': expected" in caplog.text
