"""Lists the scaffolds, or checks that their install recipes build and run.

    python -m envs.scaffolds list
    python -m envs.scaffolds check [NAME ...] [--suite bookworm] [--backend bwrap|docker]
    python -m envs.scaffolds probe [NAME ...] [--suite bookworm] [--backend bwrap|docker]
    python -m envs.scaffolds build NAME ... [--suite bookworm] [--backend bwrap|docker]

`check` extends a bare environment of the suite with each sandboxed scaffold
(`with_scaffold`), builds it (cached by its key: the first build downloads from npm / PyPI),
starts a sandbox of it and runs the entry's version command there, without network. One JSON
line per scaffold goes to stdout ({"name", "ok", "seconds", "output" or "error"}); the exit
status is 1 when any failed.

`probe` runs each scaffold's black-box episode (`run_blackbox_episode`) on a one-line shell task
against a scripted gateway (`envs.scaffolds.stub`: one final reply per call, in the call's
protocol) through the episode's channel, and reports the CLI's exit, the calls the gateway saw
(path, session, whether streamed) and the output's tail: "ok" when the CLI exited 0 and every
call landed in the episode's session.

`build` builds ONE environment with every named scaffold installed together
(`registry.scaffolds_environment`: the same names give the same cached build, whatever their
order), ahead of the tests and runs that use it, and prints {"names", "tools", "key", "path",
"seconds"}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from envs.environments import build
from envs.environments.spec import Environment
from envs.sandbox import Limits, create_sandbox
from envs.scaffolds.registry import REGISTRY, get, scaffolds_environment, with_scaffold
from envs.scaffolds.runner import run_blackbox_episode
from envs.scaffolds.stub import StubGateway
from envs.tasks import Task


async def _check(name: str, suite: str, backend: str) -> dict:
  sc = get(name)
  start = time.monotonic()
  out = {"name": name, "tools": list(sc.tools)}
  try:
    env = with_scaffold(Environment.create(suite=suite), sc)
    made = await asyncio.to_thread(
        build.rootfs if backend == "bwrap" else build.docker_image, env, None, None,
        lambda line: None)
    out["built_seconds"] = round(time.monotonic() - start, 1)
    kw = {"rootfs": made} if backend == "bwrap" else {"image": made}
    async with await create_sandbox(backend, limits=Limits(memory_mb=2048, pids=256), **kw) as sb:
      res = await sb.exec(list(sc.version_argv), timeout=120)
    text = (res.stdout + res.stderr).strip()
    out.update(ok=res.exit_code == 0, exit_code=res.exit_code, output=text[-600:])
  except Exception as e:  # one failed recipe must not stop the others
    out.update(ok=False, error=f"{type(e).__name__}: {str(e)[-2000:]}")
  out["seconds"] = round(time.monotonic() - start, 1)
  return out


async def _probe(name: str, suite: str, backend: str) -> dict:
  start = time.monotonic()
  task = Task(instance_id=f"probe-{name}", kind="shell", check_script="true",
              check_parser="exit_code", agent_timeout=120,
              problem_statements=("Reply with the single word: done. Do not run any tool.",),
              environment=Environment.create(suite=suite))
  out = {"name": name}
  try:
    with StubGateway(token="probe-token") as gw:
      r = await run_blackbox_episode(task, name, gw.url, model="stub", token="probe-token",
                                     session_id=f"probe-{name}", backend=backend, max_turns=3)
      calls = list(gw.calls)
    out.update(ok=r.exit_code == 0 and bool(calls) and all(
        c["session"] == r.session_id and c["status"] == 200 for c in calls),
        termination=r.termination, exit_code=r.exit_code, calls=calls,
        channel=[list(x) for x in r.requests], stdout=r.stdout[-800:], stderr=r.stderr[-800:])
  except Exception as e:  # one failed scaffold must not stop the others
    out.update(ok=False, error=f"{type(e).__name__}: {str(e)[-2000:]}")
  out["seconds"] = round(time.monotonic() - start, 1)
  return out


def _build(names, suite: str, backend: str) -> dict:
  start = time.monotonic()
  env = scaffolds_environment(names, suite)
  made = (build.rootfs if backend == "bwrap" else build.docker_image)(env, None, None, None)
  return {"names": list(names), "tools": list(env.tools), "key": env.key, "path": made,
          "seconds": round(time.monotonic() - start, 1)}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m envs.scaffolds", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("command", choices=("list", "check", "probe", "build"))
  p.add_argument("names", nargs="*", help="scaffolds to check (default: every sandboxed one)")
  p.add_argument("--suite", default="bookworm", help="the Debian suite of the environment")
  p.add_argument("--backend", default="bwrap", choices=("bwrap", "docker"))
  a = p.parse_args(argv)
  if a.command == "list":
    for sc in REGISTRY.values():
      print(json.dumps({"name": sc.name, "protocol": sc.protocol, "tools": list(sc.tools),
                        "host_side": sc.host_side, "description": sc.description}))
    return 0
  try:
    names = a.names or [n for n, sc in REGISTRY.items() if not sc.host_side]
    for n in names:
      if get(n).host_side:
        raise ValueError(f"scaffold={n!r} runs host-side: nothing to install")
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if a.command == "build":
    print(json.dumps(_build(names, a.suite, a.backend)), flush=True)
    return 0
  failed = False
  for n in names:
    r = asyncio.run((_check if a.command == "check" else _probe)(n, a.suite, a.backend))
    failed |= not r["ok"]
    print(json.dumps(r), flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
