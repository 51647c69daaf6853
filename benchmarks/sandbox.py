"""Sandbox throughput and exec latency per backend.

    sudo python -m benchmarks.sandbox [--n=200 --concurrency=4 --execs=200 --backends=...]

For each backend (bwrap, local, remote = the sandbox server over loopback backed by bwrap):

- **lifecycle/s**: `--n` sandboxes each created, running one `echo` and closed, `--concurrency`
  at a time, divided by the wall time (goal: >= 20/s for bwrap on 2 cores);
- **exec latency**: `--execs` sequential `true` execs in one sandbox, median and p99 (ms).

Sandboxes use default Limits. The remote server keeps `--warm` sandboxes pre-created. Prints
one JSON line per backend and rewrites the sandbox section of docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from benchmarks.common import machine, today, write_section
from envs.sandbox import create_sandbox

flags.DEFINE_integer("n", 200, "sandboxes created + exec'd + closed per backend")
flags.DEFINE_integer("concurrency", 4, "sandbox lifecycles in flight at once")
flags.DEFINE_integer("execs", 200, "sequential execs timed for the latency figures")
flags.DEFINE_integer("warm", 8, "remote: the server's warm pool")
flags.DEFINE_list("backends", ["bwrap", "local", "remote"], "backends to measure")
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


def start_server(tmp: str) -> tuple[subprocess.Popen, str, str]:
  token = secrets.token_hex(16)
  token_file, port_file = os.path.join(tmp, "token"), os.path.join(tmp, "port")
  with open(os.open(token_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
    f.write(token)
  proc = subprocess.Popen([sys.executable, "-m", "envs.sandbox_server", "--port", "0",
                           "--port_file", port_file, "--token-file", token_file,
                           "--max_sandboxes", str(FLAGS.concurrency + FLAGS.warm + 4),
                           "--warm", str(FLAGS.warm)], cwd=REPO, stderr=subprocess.DEVNULL)
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
  if FLAGS.update_docs:
    rows = [f"| {today()} | {b} | {r['lifecycles_per_s']} | {r['exec_median_ms']} | "
            f"{r['exec_p99_ms']} |" for b, r in results.items()]
    write_section("sandbox", "\n".join([
        "## sandbox: create+exec+close per second, exec latency",
        "",
        f"Machine: {machine()}. Default Limits; lifecycle = create, `echo hi`, close, "
        f"{FLAGS.n} of them {FLAGS.concurrency} at a time; latency = {FLAGS.execs} sequential "
        f"`true` execs in one sandbox. remote = sandbox server over loopback (bwrap, warm pool "
        f"{FLAGS.warm}). Goal: >= 20 lifecycles/s for bwrap on 2 cores. Load average at the "
        f"start: {load:.1f}.",
        "",
        "| date | backend | lifecycles/s | exec median ms | exec p99 ms |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "```",
        f"python -m benchmarks.sandbox --update_docs --n={FLAGS.n} --concurrency={FLAGS.concurrency} "
        f"--execs={FLAGS.execs}",
        "```",
    ]))


if __name__ == "__main__":
  app.run(main)
