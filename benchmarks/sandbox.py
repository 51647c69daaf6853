"""Sandbox throughput and exec latency per backend.

    sudo python -m benchmarks.sandbox [--n=200 --concurrency=4 --execs=200 --backends=...]

For each backend (bwrap, local, remote = the sandbox server over loopback backed by bwrap):

- **lifecycle/s**: `--n` sandboxes each created, running one `echo` and closed, `--concurrency`
  at a time, divided by the wall time (goal: >= 20/s for bwrap on 2 cores);
- **exec latency**: `--execs` sequential `true` execs in one sandbox, median and p99 (ms).

With `--flood=N` (e.g. `--flood=500 --backends=`): a sandbox server's exec latency (p99 of
`--execs` sequential `true` execs through the remote client) on an idle server, then while
another process holds N connections open against it, half of them silent and half sending a
request's headers one byte every 0.5 s (slow headers), each reopened as soon as the server
closes it; the goal is a p99 within 2x of the idle one.

Sandboxes use default Limits. The remote server keeps `--warm` sandboxes pre-created. Prints
one JSON line per backend and rewrites the sandbox section of docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

from absl import app, flags

from benchmarks.common import DOCS, machine, today, write_section
from envs.sandbox import create_sandbox

flags.DEFINE_integer("n", 200, "sandboxes created + exec'd + closed per backend")
flags.DEFINE_integer("concurrency", 4, "sandbox lifecycles in flight at once")
flags.DEFINE_integer("execs", 200, "sequential execs timed for the latency figures")
flags.DEFINE_integer("warm", 8, "remote: the server's warm pool")
flags.DEFINE_list("backends", ["bwrap", "local", "remote"], "backends to measure")
flags.DEFINE_integer("flood", 0, "connections held open against the server while its exec "
                     "latency is measured (0: no flood measurement)")
flags.DEFINE_integer("flood_rounds", 3, "flood measurements (each: idle, flood, idle), "
                     "one row each: a shared 2-core machine's p99 varies from run to run")
flags.DEFINE_bool("update_docs", False,
                  "also rewrite the sandbox section of docs/benchmarks.md")
FLAGS = flags.FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def measure(kw: dict) -> dict:
  async def lifecycle():
    sb = await create_sandbox(**kw)
    try:
      r = await sb.exec("echo hi")
      assert r.stdout == "hi\n", r
    finally:
      await sb.close()

  for _ in range(3):  # warm-up: imports, cgroup parents, server threads
    await lifecycle()
  sem = asyncio.Semaphore(FLAGS.concurrency)

  async def limited():
    async with sem:
      await lifecycle()

  t0 = time.perf_counter()
  await asyncio.gather(*(limited() for _ in range(FLAGS.n)))
  rate = FLAGS.n / (time.perf_counter() - t0)
  lat = []
  async with await create_sandbox(**kw) as sb:
    for _ in range(FLAGS.execs):
      t = time.perf_counter()
      r = await sb.exec("true")
      lat.append(time.perf_counter() - t)
      assert r.exit_code == 0, r
  lat.sort()
  p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
  return {"lifecycles_per_s": round(rate, 1),
          "exec_median_ms": round(statistics.median(lat) * 1e3, 2),
          "exec_p99_ms": round(p99 * 1e3, 2)}


async def exec_latencies(kw: dict, n: int) -> list[float]:
  """Seconds of `n` sequential `true` execs in one sandbox, after 10 unmeasured ones."""
  lat = []
  async with await create_sandbox(**kw) as sb:
    for i in range(n + 10):
      t = time.perf_counter()
      r = await sb.exec("true")
      if i >= 10:
        lat.append(time.perf_counter() - t)
      assert r.exit_code == 0, r
  return sorted(lat)


def p99(lat: list[float]) -> float:
  return lat[min(len(lat) - 1, int(0.99 * len(lat)))]


def _flood(port: int, n: int, ready, stop) -> None:
  """Holds `n` connections to 127.0.0.1:port (half silent, half dribbling headers) until
  `stop` is set, reopening each one the server closes; sets `ready` once all are open."""
  async def silent():
    while not stop.is_set():
      try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
      except OSError:
        await asyncio.sleep(0.1)
        continue
      opened.append(1)
      await r.read()  # returns once the server closes it
      w.close()

  async def slow():
    line = b"POST /sandboxes HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 4096
    while not stop.is_set():
      try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
      except OSError:
        await asyncio.sleep(0.1)
        continue
      opened.append(1)
      try:
        for i in range(len(line)):
          w.write(line[i:i + 1])
          await w.drain()
          await asyncio.sleep(0.5)
          if r.at_eof() or w.is_closing():
            break
      except OSError:
        pass
      w.close()

  async def main():
    tasks = [asyncio.ensure_future(silent() if i % 2 else slow()) for i in range(n)]
    while len(opened) < n:
      await asyncio.sleep(0.05)
    ready.set()
    while not stop.is_set():
      await asyncio.sleep(0.1)
    for t in tasks:
      t.cancel()
    reopened.append(len(opened) - n)

  opened, reopened = [], []
  asyncio.run(main())


def measure_flood(tmp: str) -> dict:
  """Exec latency p99 of a sandbox server idle and under a flood of `--flood` connections."""
  proc, url, token = start_server(tmp, ["--max_connections", str(2 * FLAGS.flood + 64)])
  kw = {"backend": "remote", "url": url, "token": token}
  try:
    idle = asyncio.run(exec_latencies(kw, FLAGS.execs))
    ctx = multiprocessing.get_context("fork")
    ready, stop = ctx.Event(), ctx.Event()
    flood = ctx.Process(target=_flood, args=(int(url.rsplit(":", 1)[1]), FLAGS.flood, ready,
                                             stop), daemon=True)
    flood.start()
    if not ready.wait(60):
      raise RuntimeError(f"could not open {FLAGS.flood} connections")
    try:
      flooded = asyncio.run(exec_latencies(kw, FLAGS.execs))
      with open(f"/proc/{proc.pid}/status") as f:  # one thread per connection would show here
        threads = int(next(l.split()[1] for l in f if l.startswith("Threads:")))
    finally:
      stop.set()
      flood.join(10)
      if flood.is_alive():
        flood.kill()
    idle_again = asyncio.run(exec_latencies(kw, FLAGS.execs))
  finally:
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
  idle_p99 = max(p99(idle), p99(idle_again))  # the idle machine's own spread, both sides
  return {"connections": FLAGS.flood, "server_threads": threads,
          "load": round(os.getloadavg()[0], 1),
          "idle_p99_ms": round(p99(idle) * 1e3, 2),
          "idle_after_p99_ms": round(p99(idle_again) * 1e3, 2),
          "flood_p99_ms": round(p99(flooded) * 1e3, 2),
          "idle_median_ms": round(statistics.median(idle) * 1e3, 2),
          "flood_median_ms": round(statistics.median(flooded) * 1e3, 2),
          "p99_ratio": round(p99(flooded) / idle_p99, 2)}


def start_server(tmp: str, extra=()) -> tuple[subprocess.Popen, str, str]:
  token = secrets.token_hex(16)
  tmp = tempfile.mkdtemp(dir=tmp)  # a fresh port file per server
  token_file, port_file = os.path.join(tmp, "token"), os.path.join(tmp, "port")
  with open(os.open(token_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
    f.write(token)
  proc = subprocess.Popen([sys.executable, "-m", "envs.sandbox_server", "--port", "0",
                           "--port_file", port_file, "--token_file", token_file,
                           "--max_sandboxes", str(FLAGS.concurrency + FLAGS.warm + 4),
                           "--warm", str(FLAGS.warm), *extra], cwd=REPO,
                          stderr=subprocess.DEVNULL)
  deadline = time.monotonic() + 60
  while not os.path.exists(port_file):
    if proc.poll() is not None or time.monotonic() > deadline:
      raise RuntimeError("sandbox server did not start")
    time.sleep(0.05)
  time.sleep(1.0)  # let the warm pool fill
  return proc, f"http://127.0.0.1:{open(port_file).read()}", token


def main(argv):
  del argv
  results = {}
  load = os.getloadavg()[0]  # other work on the machine shows up in every number
  with tempfile.TemporaryDirectory() as tmp:
    for backend in FLAGS.backends:
      proc = None
      if backend == "local":
        kw = {"backend": "local", "allow_unsafe": True}
      elif backend == "remote":
        proc, url, token = start_server(tmp)
        kw = {"backend": "remote", "url": url, "token": token}
      else:
        kw = {"backend": backend}
      try:
        results[backend] = asyncio.run(measure(kw))
      finally:
        if proc is not None:
          proc.send_signal(signal.SIGTERM)
          proc.wait(60)
      print(json.dumps({"backend": backend, **results[backend]}), flush=True)
    flood = []
    for _ in range(FLAGS.flood_rounds if FLAGS.flood else 0):
      flood.append(measure_flood(tmp))
      print(json.dumps({"flood": flood[-1]}), flush=True)
  if FLAGS.update_docs:
    update_docs(results, flood or None, load)


FLOOD_START, FLOOD_END = "<!-- sandbox-flood:start -->", "<!-- sandbox-flood:end -->"


def _current_part(start: str, end: str) -> Optional[str]:
  """The text between two markers in docs/benchmarks.md now (None if absent)."""
  text = open(DOCS).read() if os.path.exists(DOCS) else ""
  if start in text and end in text:
    return text[text.index(start) + len(start):text.index(end)].strip("\n")
  return None


def update_docs(results: dict, flood: Optional[list[dict]], load: float) -> None:
  """Rewrites the sandbox section; the part a run did not measure is kept as it was."""
  table_start, table_end = "<!-- sandbox-throughput:start -->", "<!-- sandbox-throughput:end -->"
  table = _current_part(table_start, table_end)
  if results:
    rows = [f"| {today()} | {b} | {r['lifecycles_per_s']} | {r['exec_median_ms']} | "
            f"{r['exec_p99_ms']} |" for b, r in results.items()]
    table = "\n".join([
        f"Machine: {machine()}. Default Limits; lifecycle = create, `echo hi`, close, "
        f"{FLAGS.n} of them {FLAGS.concurrency} at a time; latency = {FLAGS.execs} sequential "
        f"`true` execs in one sandbox. remote = sandbox server over loopback (bwrap, warm pool "
        f"{FLAGS.warm}). bwrap runs with its defaults: the seccomp filter, a fresh keyring per "
        f"exec, a generated /etc. Goal: >= 20 lifecycles/s for bwrap on 2 cores. Load average "
        f"at the start: {load:.1f}.",
        "",
        "| date | backend | lifecycles/s | exec median ms | exec p99 ms |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "```",
        f"python -m benchmarks.sandbox --update_docs --n={FLAGS.n} "
        f"--concurrency={FLAGS.concurrency} --execs={FLAGS.execs}",
        "```"])
  part = _current_part(FLOOD_START, FLOOD_END)
  if flood is not None:
    f = flood[0]
    ratios = sorted(r["p99_ratio"] for r in flood)
    part = "\n".join([
        "### sandbox server under a connection flood",
        "",
        f"Machine: {machine()}. Exec latency of a real client (the remote backend: "
        f"{FLAGS.execs} sequential `true` execs in one bwrap sandbox) on an idle server, then "
        f"while another process holds {f['connections']} connections open (half silent, half "
        "sending headers one byte every 0.5 s, each reopened when the server closes it), then "
        "idle again. Ratio = flood p99 / the larger idle p99; goal <= 2. Server threads: "
        f"the server process's threads during the flood (the earlier thread-per-connection "
        f"server held one per connection). One row per round; median ratio "
        f"{ratios[len(ratios) // 2]}, worst {ratios[-1]}.",
        "",
        "| date | connections | load avg | server threads | idle p99 ms | flood p99 ms | "
        "idle-after p99 ms | idle median ms | flood median ms | p99 ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(f"| {today()} | {r['connections']} | {r['load']} | {r['server_threads']} | "
          f"{r['idle_p99_ms']} | {r['flood_p99_ms']} | {r['idle_after_p99_ms']} | "
          f"{r['idle_median_ms']} | {r['flood_median_ms']} | {r['p99_ratio']} |"
          for r in flood),
        "",
        "```",
        f"python -m benchmarks.sandbox --update_docs --backends= --flood={f['connections']} "
        f"--flood_rounds={len(flood)} --execs={FLAGS.execs}",
        "```"])
  write_section("sandbox", "\n".join([
      "## sandbox: create+exec+close per second, exec latency",
      "",
      table_start, table or "(not measured)", table_end,
      "",
      FLOOD_START, part or "(not measured)", FLOOD_END]))


if __name__ == "__main__":
  app.run(main)
