"""Lists the scaffolds, checks that their install recipes build and run, shows a session.

    python -m envs.scaffolds list
    python -m envs.scaffolds check [NAME ...] [--suite bookworm] [--backend bwrap|docker]
    python -m envs.scaffolds probe [NAME ...] [--suite bookworm] [--backend bwrap|docker]
    python -m envs.scaffolds show SESSION.json [--json]
    python -m envs.scaffolds show http://127.0.0.1:8000 --session ID [--token-file F] [--json]
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

`show` prints one gateway session (`envs.scaffolds.sessions.format_session`): per call its
protocol, input and output lengths, the tokens shared with earlier calls, whether it extends
the previous call, its finish reason and policy versions; then the token trie the calls form
(nodes, shared tokens, roots, branch points). The session comes from a JSON file (the reply of
GET /v1/sessions/<id>, or a list of its records) or from a running gateway's
GET <URL>/v1/sessions/<ID> (bearer token from --token-file, else $ARBOR_SERVE_TOKEN). With
--json it prints `session_tree`'s dict instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import urllib.parse
import urllib.request

from envs.environments import build
from envs.environments.spec import Environment
from envs.sandbox import Limits, create_sandbox
from envs.scaffolds.registry import REGISTRY, get, scaffolds_environment, with_scaffold
from envs.scaffolds.runner import run_blackbox_episode
from envs.scaffolds.sessions import format_session, session_tree
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


MAX_SESSION_BYTES = 1 << 30  # a session file or reply read by `show`


def load_session(source: str, session: str = "", token: str = "") -> tuple[str, list[dict]]:
  """A session's records from a JSON file or a gateway (see the module docstring).

  Args:
    source: a file path, or the gateway's root "http(s)://HOST:PORT".
    session: the session id (required for a gateway; a file's own "session_id" otherwise).
    token: the gateway's bearer token ("" = none).

  Returns:
    (session id, records).

  Raises:
    ValueError: no session id for a gateway, or JSON that is not a session.
    OSError: the file or the gateway cannot be read.
  """
  if source.startswith(("http://", "https://")):
    if not session:
      raise ValueError("--session: the session id to fetch from the gateway is required")
    url = f"{source.rstrip('/')}/v1/sessions/{urllib.parse.quote(session, safe='')}"
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token
                                 else {})
    with urllib.request.urlopen(req, timeout=60) as r:
      data = json.loads(r.read(MAX_SESSION_BYTES))
  else:
    with open(source, "rb") as f:
      data = json.loads(f.read(MAX_SESSION_BYTES))
  if isinstance(data, dict) and isinstance(data.get("calls"), list):
    return str(data.get("session_id") or session), data["calls"]
  if isinstance(data, list):
    return session, data
  raise ValueError(f"{source}: expected a session ({{'session_id', 'calls': [...]}}) or a list "
                   "of call records")


def _show(a) -> int:
  try:
    token = ""
    if a.token_file:
      with open(a.token_file) as f:
        token = f.read().strip()
    token = token or os.environ.get("ARBOR_SERVE_TOKEN", "")
    session, records = load_session(a.names[0], a.session, token)
    print(json.dumps(session_tree(records)) if a.json else format_session(records, session))
  except (OSError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  return 0


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m envs.scaffolds", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("command", choices=("list", "check", "probe", "build", "show"))
  p.add_argument("names", nargs="*", help="scaffolds to check (default: every sandboxed one); "
                 "show: a session file or gateway URL")
  p.add_argument("--suite", default="bookworm", help="the Debian suite of the environment")
  p.add_argument("--backend", default="bwrap", choices=("bwrap", "docker"))
  p.add_argument("--session", default="", help="show: the session id (from a gateway)")
  p.add_argument("--token-file", default="", help="show: a file holding the gateway's token")
  p.add_argument("--json", action="store_true", help="show: print the trie as JSON")
  a = p.parse_args(argv)
  if a.command == "show":
    if len(a.names) != 1:
      print("error: show takes one session file or gateway URL", file=sys.stderr)
      return 2
    return _show(a)
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
