"""A scripted stand-in for the policy gateway, for checking that a scaffold runs end to end.

    with StubGateway(token="t") as gw:        # http://127.0.0.1:PORT, on a thread
      result = await run_blackbox_episode(task, "codex", gw.url, model="stub", token="t")
      gw.calls                                # [{"method", "path", "session", "stream"}, ...]

Every model call is answered with a final assistant reply, "Done.", in the protocol of its path
(Chat Completions, Responses, Anthropic Messages; as server-sent events when the request asks
to stream), so a CLI's run ends after one call. One exception: a Chat Completions request
offering a tool named `bash` whose messages name mini-swe-agent's submit command (its only
tool must be called every turn) is answered with a call of it running that command. Calls are
filed like the policy server files them: under the body's `session_id`, else the
`x-session-id` header; a request without the bearer token gets 401. Standard library only;
loopback only.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from typing import Optional

TEXT = "Done."
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
MAX_BODY = 64 << 20


def _chat(model: str, body: dict) -> tuple[dict, list[dict]]:
  """(reply, stream chunks) of a Chat Completions request."""
  tools = [t.get("function", {}).get("name") for t in body.get("tools") or []]
  usage = {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
  if "bash" in tools and SUBMIT.split()[1] in json.dumps(body.get("messages")):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"command": SUBMIT})}}
    message, finish = {"role": "assistant", "content": "", "tool_calls": [call]}, "tool_calls"
    delta = {"role": "assistant", "tool_calls": [{"index": 0, **call}]}
  else:
    message, finish = {"role": "assistant", "content": TEXT}, "stop"
    delta = {"role": "assistant", "content": TEXT}
  base = {"id": "chatcmpl-stub", "created": int(time.time()), "model": model}
  reply = {**base, "object": "chat.completion", "usage": usage,
           "choices": [{"index": 0, "message": message, "finish_reason": finish}]}
  chunk = {**base, "object": "chat.completion.chunk"}
  chunks = [{**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
            {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}],
             "usage": usage}]
  return reply, chunks


def _responses(model: str) -> tuple[dict, list[tuple[str, dict]]]:
  """(reply, stream events) of a Responses request."""
  item = {"type": "message", "id": "msg_stub", "role": "assistant", "status": "completed",
          "content": [{"type": "output_text", "text": TEXT, "annotations": []}]}
  usage = {"input_tokens": 10, "output_tokens": 2, "total_tokens": 12,
           "input_tokens_details": {"cached_tokens": 0},
           "output_tokens_details": {"reasoning_tokens": 0}}
  done = {"id": "resp_stub", "object": "response", "created_at": int(time.time()),
          "model": model, "status": "completed", "output": [item], "usage": usage}
  started = {**done, "status": "in_progress", "output": [], "usage": None}
  events = [("response.created", {"response": started}),
            ("response.output_item.added", {"output_index": 0, "item": {
                **item, "status": "in_progress", "content": []}}),
            ("response.output_text.delta", {"item_id": "msg_stub", "output_index": 0,
                                            "content_index": 0, "delta": TEXT}),
            ("response.output_item.done", {"output_index": 0, "item": item}),
            ("response.completed", {"response": done})]
  return done, [(name, {"type": name, "sequence_number": i, **data})
                for i, (name, data) in enumerate(events)]


def _messages(model: str) -> tuple[dict, list[tuple[str, dict]]]:
  """(reply, stream events) of an Anthropic Messages request."""
  reply = {"id": "msg_stub", "type": "message", "role": "assistant", "model": model,
           "content": [{"type": "text", "text": TEXT}], "stop_reason": "end_turn",
           "stop_sequence": None, "usage": {"input_tokens": 10, "output_tokens": 2}}
  events = [("message_start", {"message": {**reply, "content": [], "stop_reason": None,
                                           "usage": {"input_tokens": 10, "output_tokens": 1}}}),
            ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
            ("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": TEXT}}),
            ("content_block_stop", {"index": 0}),
            ("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                               "usage": {"output_tokens": 2}}),
            ("message_stop", {})]
  return reply, [(name, {"type": name, **data}) for name, data in events]


class StubGateway:
  """The scripted gateway (module docstring). Use as a context manager.

  Args:
    token: the bearer token it requires, or None for none.
    host: the address it listens on (loopback).

  Attributes:
    url: "http://HOST:PORT".
    calls: {"method", "path", "session", "stream", "status"} of every request, in order.
  """

  def __init__(self, token: Optional[str] = None, host: str = "127.0.0.1"):
    self.token, self.calls = token, []
    stub = self

    class Handler(http.server.BaseHTTPRequestHandler):
      protocol_version = "HTTP/1.0"  # a reply ends with its connection (streams too)

      def log_message(self, *a):
        pass

      def _json(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

      def _events(self, events) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        for name, data in events:
          head = f"event: {name}\n" if name else ""
          payload = data if isinstance(data, str) else json.dumps(data)
          self.wfile.write(f"{head}data: {payload}\n\n".encode())
          self.wfile.flush()

      def _record(self, body: dict, status: int) -> None:
        stub.calls.append({"method": self.command, "path": self.path.split("?")[0],
                           "session": body.get("session_id", self.headers.get("x-session-id")),
                           "stream": bool(body.get("stream")), "status": status})

      def _authorized(self) -> bool:
        return stub.token is None or self.headers.get("Authorization") == f"Bearer {stub.token}"

      def do_GET(self):
        status = 200 if self._authorized() else 401
        self._record({}, status)
        self._json(status, {"object": "list", "data": [
            {"id": "stub", "object": "model", "created": 0, "owned_by": "arbor"}]}
            if status == 200 else {"error": {"message": "bad token"}})

      def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        try:
          body = json.loads(self.rfile.read(min(length, MAX_BODY)) or b"{}")
        except ValueError:
          body = {}
        body = body if isinstance(body, dict) else {}
        path, model = self.path.split("?")[0], str(body.get("model", "stub"))
        if not self._authorized():
          self._record(body, 401)
          return self._json(401, {"error": {"message": "bad token"}})
        self._record(body, 200)
        stream = bool(body.get("stream"))
        if path.endswith("/messages/count_tokens"):
          return self._json(200, {"input_tokens": 10})
        if path.endswith("/chat/completions"):
          reply, chunks = _chat(model, body)
          return self._events([(None, c) for c in chunks] + [(None, "[DONE]")]) \
              if stream else self._json(200, reply)
        if path.endswith("/responses"):
          reply, events = _responses(model)
        elif path.endswith("/messages"):
          reply, events = _messages(model)
        else:
          return self._json(404, {"error": {"message": f"no route {path}"}})
        return self._events(events) if stream else self._json(200, reply)

    self._server = http.server.ThreadingHTTPServer((host, 0), Handler)
    self.url = f"http://{host}:{self._server.server_port}"
    self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
    self._thread.start()

  def close(self) -> None:
    """Stops the server."""
    self._server.shutdown()
    self._server.server_close()

  def __enter__(self) -> "StubGateway":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
