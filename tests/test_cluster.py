"""Cluster mode on one machine: Redis, 2 sandbox servers, 2 rollout-worker processes and the
trainer (mode "rl", rollout_workers="queue") with its policy server, as separate processes.

The trainer runs 3 RL steps of 2 groups; the workers hold exactly the 6 draws it needs (6
tasks, one epoch). Once worker 0 holds a lease and the queue has delivered something, it is
SIGKILLed: its draw must expire and be re-issued to worker 1, or the trainer could never finish
(so "training completes" already proves that no draw was lost). Then, from the trainer's logged
trajectory ids and the Redis stream itself: every trajectory put in the queue was trained
exactly once, every draw produced exactly one group, and every entry was acknowledged (after
the checkpoint that includes it).
"""

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest

from envs.trajectory import Trajectory
from launch import local_fleet as fleet_lib
from trainer.metrics import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, PROMPTS, GROUP = 3, 2, 2
TASKS = STEPS * PROMPTS  # draws: exactly what the trainer consumes

CONFIG = '''
from configs import demo


def get_config(arg=None):
  c = demo.get_config().rl  # the demo's RL stage (CISPO, Muon, tree-packed), shrunk
  c.seed = 0
  c.compile_cache_dir = {cache!r}
  c.model.init = "random"  # no SFT stage here: a random policy (every task fails)
  c.model.preset = "tiny-moe-mla"  # half the demo model's width
  c.model.overrides.num_layers = 2
  c.model.overrides.vocab_size = 512
  c.model.overrides.attention_impl = "xla"
  c.tokenizer.path = {tokenizer!r}
  c.rl.rollout_workers = "queue"
  c.rl.queue_url = {redis!r}
  c.rl.queue_password_file = {password!r}
  c.rl.tasks = {tasks!r}
  c.rl.prompts_per_step = {prompts}
  c.rl.group_size = {group}
  c.rl.max_new_tokens = 24
  c.rl.max_turns = 2
  c.rl.max_context_tokens = 2048
  c.rl.concurrency = 4
  c.rl.drop_constant_groups = False  # a random policy fails every task: train anyway
  c.rl.max_staleness = 10  # no group dropped as stale: the 6 draws are exactly the 3 steps'
  c.data.row_len = 2048
  c.train.steps = {steps}
  c.train.checkpoint_every = 1
  c.checkpoint.async_save = False
  c.metrics.report = False
  c.serve.port = {port}
  return c
'''


def _wait(what, ready, timeout, procs=()):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    value = ready()
    if value:
      return value
    for name, p in procs:
      assert p.poll() is None, f"{name} exited with {p.returncode} while waiting for {what}"
    time.sleep(0.2)
  raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _health(url):
  try:
    with urllib.request.urlopen(url + "/health", timeout=2) as r:
      return json.loads(r.read())
  except OSError:
    return None


def _tail(path, n=3000):
  try:
    with open(path, errors="replace") as f:
      return f.read()[-n:]
  except OSError:
    return ""


@pytest.mark.skipif(not (shutil.which("redis-server") and shutil.which("bwrap")),
                    reason="needs redis-server and bwrap (make test installs them)")
def test_cluster_mode_survives_a_killed_worker(tmp_path):
  import redis

  from envs.chat import load_tokenizer, make_chat
  from envs.taskgen import write_tasks
  from trainer.demo_data import demo_corpus
  from trainer.tokenizer_train import train_tokenizer

  train_tokenizer(demo_corpus("chatml", 8), 512, str(tmp_path / "tok"))
  make_chat("chatml", load_tokenizer(str(tmp_path / "tok")))  # loads: the workers' format
  write_tasks(str(tmp_path / "tasks"), TASKS, level=0, seed=3, split="train")
  tasks = str(tmp_path / "tasks" / "tasks.jsonl")
  port = fleet_lib.free_port()
  policy_url = f"http://127.0.0.1:{port}"
  fleet = fleet_lib.LocalFleet(
      workers=2, sandbox_servers=2, policy_url=policy_url, tasks=tasks,
      tokenizer=str(tmp_path / "tok"), group_size=GROUP, concurrency=GROUP, epochs=1,
      lease_ttl=4.0, max_backlog=2 * GROUP, max_turns=2, max_new_tokens=24,
      max_context_tokens=2048, grace=5.0)
  trainer = None
  try:
    info = fleet.start_services()
    config = tmp_path / "cluster_config.py"
    config.write_text(CONFIG.format(
        cache=str(tmp_path / "xla_cache"), tokenizer=str(tmp_path / "tok"),
        redis=info["redis"], password=info["redis_password_file"], tasks=tasks,
        prompts=PROMPTS, group=GROUP, steps=STEPS, port=port))
    workdir = tmp_path / "run"
    log = open(tmp_path / "trainer.log", "wb")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    trainer = subprocess.Popen([sys.executable, "-m", "trainer.main", f"--config={config}",
                                f"--workdir={workdir}"], cwd=ROOT, env=env, stdout=log,
                               stderr=subprocess.STDOUT)
    log.close()
    procs = [("trainer", trainer)]
    _wait("the trainer's policy server", lambda: _health(policy_url), 300, procs)
    workers = [fleet.start_worker(i) for i in range(2)]

    r = redis.Redis(host="127.0.0.1", port=int(info["redis"].rsplit(":", 1)[1]),
                    password=open(info["redis_password_file"]).read().strip())
    stream, leases = "{arbor}:rollouts", "{arbor}:task:info"

    def worker0_mid_run():  # worker 0 holds a lease, and the queue has delivered something
      held = [int(d) for d, who in r.hgetall(leases).items() if who.endswith(b"|local-0")]
      return held if held and r.xlen(stream) > 0 else None
    held = _wait("worker 0 to hold a lease mid-run", worker0_mid_run, 300, procs)
    workers[0].kill()  # SIGKILL: no grace, its lease is simply never renewed
    workers[0].wait()

    try:
      trainer.wait(300)
    except subprocess.TimeoutExpired:
      raise AssertionError("the trainer did not finish:\n" + _tail(tmp_path / "trainer.log")
                           + "\nworker-0:\n" + _tail(os.path.join(fleet.dir, "worker-0.log"))
                           + "\nworker-1:\n" + _tail(os.path.join(fleet.dir, "worker-1.log")))
    assert trainer.returncode == 0, _tail(tmp_path / "trainer.log")

    # --- what the trainer trained (its metrics) and what its last checkpoint consumed
    metrics = read_jsonl(workdir / "rl" / "metrics.jsonl")
    assert sorted(metrics) == list(range(1, STEPS + 1))
    trained = [i for s in sorted(metrics) for i in metrics[s]["trajectory_ids"]]
    assert len(trained) == len(set(trained)) == TASKS * GROUP, "a trajectory trained twice"
    assert all(metrics[s]["groups_trained"] == PROMPTS for s in metrics)
    assert not any(k.startswith("dropped/") and v for s in metrics for k, v in metrics[s].items())
    assert all(metrics[s]["tests_run"] == 1.0 for s in metrics)  # rewards from sandbox runs
    # --- what the workers put in the queue: one group per draw, every one trained, none lost
    entries = r.xrange(stream)
    put = [Trajectory.from_bytes(fields[b"data"]) for _, fields in entries]
    assert sorted(t.trajectory_id for t in put) == sorted(trained)
    draws = sorted(t.group_id.rsplit("/", 1)[1] for t in put)
    assert draws == sorted(str(d) for d in range(TASKS) for _ in range(GROUP))
    assert set(str(d) for d in held) <= set(draws)  # the killed worker's draw was redone
    assert r.get("{arbor}:task:done") == str(TASKS).encode()
    assert r.llen("{arbor}:task:dead") == 0 and r.zcard("{arbor}:task:leases") == 0
    # acknowledged after the final checkpoint: nothing left pending
    assert r.xpending(stream, "trainer")["pending"] == 0
    assert "step 3" in _tail(tmp_path / "trainer.log", 20000)
  finally:
    if trainer is not None and trainer.poll() is None:
      trainer.kill()
      trainer.wait()
    fleet.stop()
