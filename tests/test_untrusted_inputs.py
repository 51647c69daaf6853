"""Hostile datasets and network clients: what they send is refused within bounds, with an error
naming the row and field (or the request field and value), and the rest keeps working.

- envs.untrusted: nesting measured exactly before parsing (strings with brackets, quotes and
  escapes included), deeper documents refused, inflation stopped at its cap.
- LiveCodeBench rows: a zlib bomb (2 GiB of test input in a 2.8 MB row) is refused after
  inflating at most the cap, in bounded memory; rows nested thousands deep (the line itself, a
  JSON test field, metadata, a functional test's input, a compressed test set, an already-decoded
  field) are refused with the reason, skipped under skip_bad, and the other rows still load.
- The policy server: tokenless connections dribbling their headers neither hold every connection
  slot (a real request is served, not 503'd) nor live past the header deadline; out-of-range
  numbers (token ids beyond the vocabulary or 2**63, infinite or NaN temperatures, top_p outside
  (0, 1], huge top_k, max_tokens, seed) and bodies nested 10000 deep get a 400 naming the field,
  never a 500, and reach no engine.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
import zlib

import pytest

from envs.livecodebench import (encode_test_cases, load_livecodebench_jsonl,
                                load_livecodebench_rows)
from envs.tasks import TaskFormatError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LCB = os.path.join(ROOT, "envs", "data", "livecodebench", "problems.jsonl")
DEEP = 10_000


def lcb_rows() -> dict:
  with open(LCB) as f:
    rows = [json.loads(line) for line in f]
  return {r["question_id"]: r for r in rows}


def nested(depth: int, leaf: str = "1") -> str:
  return "[" * depth + leaf + "]" * depth


def write_jsonl(path, lines) -> str:
  with open(path, "w") as f:
    for line in lines:
      f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
  return str(path)


# ----------------------------------------------------------------------------- envs.untrusted


def test_nesting_is_measured_exactly_without_parsing():
  """`nesting_bound` equals the depth json builds, strings holding brackets, quotes and escapes
  included; `loads` refuses deeper documents before parsing; `inflate` stops at its cap."""
  import random
  from envs.untrusted.decode import TooDeep, TooLarge, inflate, loads, nesting_bound

  def depth(v):
    if isinstance(v, (list, dict)):
      return 1 + max(map(depth, v.values() if isinstance(v, dict) else v), default=0)
    return 0

  def value(d, rng):
    r = rng.random()
    if d and r < 0.3:
      return [value(d - 1, rng) for _ in range(rng.randint(0, 3))]
    if d and r < 0.6:
      return {rng.choice(["a", "[", '\\"{', '}]"']): value(d - 1, rng)
              for _ in range(rng.randint(0, 3))}
    return rng.choice([1, "x[", '\\"]', '"{\\', None, 2.5, "\u00e9[", '"'])

  rng = random.Random(0)
  for _ in range(500):
    v = value(rng.randint(0, 12), rng)
    text = json.dumps(v, ensure_ascii=rng.random() < 0.5)
    assert nesting_bound(text) == depth(v), text
  assert nesting_bound(json.dumps([[1, 2]] * 50_000)) == 2  # long runs of brackets
  assert loads(nested(100).encode("utf-16"), 100) == json.loads(nested(100))
  with pytest.raises(TooDeep, match="field 'x': nested 101 deep, more than max_json_depth=100"):
    loads(nested(101), 100, "field 'x'")
  with pytest.raises(TooDeep):
    loads("[" * 1_000_000, 100)
  packed = zlib.compress(b"a" * 100_000)
  assert inflate(packed, 100_000) == b"a" * 100_000
  with pytest.raises(TooLarge, match="more than 99999 bytes"):
    inflate(packed, 99_999)
  with pytest.raises(ValueError, match="truncated"):
    inflate(packed[:-6], 10**6)


# ----------------------------------------------------------------------------- zlib bomb


def bomb_field(spaces: int, block: int = 1 << 24) -> str:
  """base64(zlib(pickle(JSON))) of one stdin test whose input is `spaces` spaces, built without
  holding them: raw deflate blocks ended by a full flush are byte-identical for identical input,
  so one compressed block is repeated, framed by a zlib header and the true Adler-32."""
  assert spaces % block == 0
  text_head, text_tail = b'[{"input": "', b'", "output": "1\\n", "testtype": "stdin"}]'
  length = len(text_head) + spaces + len(text_tail)
  head = b"\x80\x04\x8d" + struct.pack("<Q", length) + text_head  # PROTO 4, BINUNICODE8
  tail = text_tail + b"\x94."                                      # MEMOIZE, STOP
  c = zlib.compressobj(9, zlib.DEFLATED, -15)
  first = c.compress(head) + c.flush(zlib.Z_FULL_FLUSH)
  zeros = b" " * block
  repeated = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
  last = c.compress(tail) + c.flush()
  check = zlib.adler32(head)
  for _ in range(spaces // block):
    check = zlib.adler32(zeros, check)
  check = zlib.adler32(tail, check)
  stream = (b"\x78\xda" + first + repeated * (spaces // block) + last
            + struct.pack(">I", check))
  return base64.b64encode(stream).decode("ascii")


def test_bomb_field_is_a_valid_stream():
  """The test's own bomb builder writes what zlib and pickle read (checked on a small one)."""
  field = bomb_field(4 << 20, block=1 << 20)
  text = pickle.loads(zlib.decompress(base64.b64decode(field)))
  tests = json.loads(text)
  assert tests[0]["input"] == " " * (4 << 20) and tests[0]["testtype"] == "stdin"


def test_zlib_bomb_row_is_refused_in_bounded_memory_and_time(tmp_path):
  """A 2.8 MB row whose private tests inflate to 2 GiB: refused at the cap with an error naming
  the line and field, skipped under skip_bad with the other rows loaded; the loading process
  stays far below the 2 GiB it would take (its address space is capped at 1.5 GiB)."""
  rows = lcb_rows()
  bomb = {**rows["arb101_a"], "question_id": "bomb", "private_test_cases": bomb_field(2 << 30)}
  path = write_jsonl(tmp_path / "bomb.jsonl", [rows["arb101_a"], bomb, rows["3901"]])
  assert os.path.getsize(path) < 4 << 20
  script = textwrap.dedent(f"""
      import json, resource, sys, time
      resource.setrlimit(resource.RLIMIT_AS, (3 << 29, 3 << 29))

      def peak_mib():  # this process's own peak (ru_maxrss would include the forking parent's)
        with open("/proc/self/status") as f:
          line = next(l for l in f if l.startswith("VmHWM:"))
        return int(line.split()[1]) / 1024

      from envs.livecodebench import load_livecodebench_jsonl
      from envs.tasks import TaskFormatError
      t0 = time.monotonic()
      errors = []
      tasks = load_livecodebench_jsonl({path!r}, skip_bad=True, errors=errors)
      try:
        load_livecodebench_jsonl({path!r})
        raised = None
      except TaskFormatError as e:
        raised = str(e)
      print(json.dumps({{"tasks": [t.instance_id for t in tasks],
                         "errors": [str(e) for e in errors], "raised": raised,
                         "seconds": time.monotonic() - t0,
                         "maxrss_mib": peak_mib()}}))
      """)
  proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  assert got["tasks"] == ["lcb-arb101_a", "lcb-3901"]
  for message in got["errors"] + [got["raised"]]:
    assert f"{path}:2" in message and "private_test_cases" in message, message
    assert "max_decompressed_bytes" in message, message
  assert len(got["errors"]) == 1
  assert got["maxrss_mib"] < 600, got
  assert got["seconds"] < 60, got  # a sanity bound only: it takes well under a second


def test_decompression_cap_is_a_parameter(tmp_path):
  """The cap is `max_decompressed_bytes` (default MAX_DECOMPRESSED_BYTES): a legitimate
  compressed test set over a lowered cap is refused, under the default it loads."""
  from envs.livecodebench import MAX_DECOMPRESSED_BYTES
  assert 16 << 20 <= MAX_DECOMPRESSED_BYTES <= 256 << 20
  row = dict(lcb_rows()["arb101_a"])
  row["private_test_cases"] = encode_test_cases(
      [{"input": "1" * 200_000 + "\n", "output": "1\n", "testtype": "stdin"}], compress=True)
  path = write_jsonl(tmp_path / "big.jsonl", [row])
  assert len(load_livecodebench_jsonl(path)[0].tests) == 3
  with pytest.raises(TaskFormatError, match=r":1: field 'private_test_cases': inflates to more "
                                            r"than 100000 bytes"):
    load_livecodebench_jsonl(path, max_decompressed_bytes=100_000)
  with pytest.raises(TaskFormatError, match=r"rows\[0\]: field 'private_test_cases'"):
    load_livecodebench_rows([row], max_decompressed_bytes=100_000)


# ----------------------------------------------------------------------------- nesting


def deep_rows() -> list:
  """(line, what the error names) of rows nested DEEP levels somewhere."""
  rows = lcb_rows()
  good, func = rows["arb101_a"], rows["3901"]
  compressed = base64.b64encode(zlib.compress(pickle.dumps(nested(DEEP)))).decode()
  return [
      (json.dumps({**good, "question_id": "q1"})[:-1] + ', "extra": ' + nested(DEEP) + "}",
       "invalid JSON"),
      ({**good, "question_id": "q2", "public_test_cases": nested(DEEP)}, "public_test_cases"),
      ({**good, "question_id": "q3", "metadata": '{"a": ' + nested(DEEP) + "}"}, "metadata"),
      ({**func, "question_id": "q4", "public_test_cases": json.dumps(
          [{"input": nested(DEEP), "output": "1", "testtype": "functional"}])},
       "public_test_cases[0]"),
      ({**func, "question_id": "q5", "public_test_cases": json.dumps(
          [{"input": "[1]", "output": nested(DEEP), "testtype": "functional"}])},
       "public_test_cases[0]"),
      ({**good, "question_id": "q6", "private_test_cases": compressed}, "private_test_cases"),
  ]


def test_deeply_nested_rows_are_skipped_with_a_reason(tmp_path):
  rows = lcb_rows()
  bad = deep_rows()
  lines = [rows["arb101_a"]] + [line for line, _ in bad] + [rows["3902"]]
  path = write_jsonl(tmp_path / "deep.jsonl", lines)
  errors = []
  tasks = load_livecodebench_jsonl(path, skip_bad=True, errors=errors)
  assert [t.instance_id for t in tasks] == ["lcb-arb101_a", "lcb-3902"]
  assert len(errors) == len(bad)
  for lineno, (error, (_, field)) in enumerate(zip(errors, bad), 2):
    assert isinstance(error, TaskFormatError)
    assert str(error).startswith(f"{path}:{lineno}: ") and field in str(error), str(error)
    assert "max_json_depth=" in str(error), str(error)
  for lineno, (line, field) in enumerate(bad, 1):  # without skip_bad: a clear error
    one = write_jsonl(tmp_path / f"one{lineno}.jsonl", [line])
    with pytest.raises(TaskFormatError, match="max_json_depth=") as e:
      load_livecodebench_jsonl(one)
    assert str(e.value).startswith(f"{one}:1: ") and field in str(e.value)


def test_nesting_within_the_limit_still_loads(tmp_path):
  """Functional tests take nested lists: a few levels are ordinary input."""
  func = lcb_rows()["3902"]
  row = {**func, "public_test_cases": json.dumps(
      [{"input": nested(20) + "\n3", "output": nested(20), "testtype": "functional"}])}
  task = load_livecodebench_rows([row])[0]
  assert task.tests[0]["expected"] == json.loads(nested(20))


def test_deeply_nested_decoded_rows_are_skipped(tmp_path):
  """Rows given as objects (e.g. a `datasets` split) are measured as well."""
  rows = lcb_rows()
  deep = 1
  for _ in range(DEEP):
    deep = {"k": deep}
  bad = [{**rows["arb101_a"], "question_id": "d1", "private_test_cases": [
             {"input": "1", "output": "1", "testtype": "stdin", "x": deep}]},
         {**rows["3901"], "question_id": "d2", "metadata": {"func_name": "f", "x": deep}},
         {**rows["arb101_a"], "question_id": "d3", "contest_id": [deep]}]
  errors = []
  tasks = load_livecodebench_rows([rows["arb101_c"]] + bad, skip_bad=True, errors=errors,
                                  source="split")
  assert [t.instance_id for t in tasks] == ["lcb-arb101_c"]
  assert [str(e).split(":")[0] for e in errors] == ["split[1]", "split[2]", "split[3]"]
  assert all("max_json_depth=" in str(e) for e in errors), errors
  with pytest.raises(TaskFormatError, match=r"split\[0\]: .*max_json_depth="):
    load_livecodebench_rows(bad[:1], source="split")


# ----------------------------------------------------------------------------- policy server

TOKEN = "front-door-token-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def start_server(header_timeout_s: float):
  """A token-protected policy server over a scripted engine (no model to compile) with 6
  connection slots; (server, engine, vocabulary size)."""
  from envs.chat.tokenizer import HFTokenizer
  from tests.test_chat import _tiny_bpe
  from tests.test_serve import ScriptedEngine
  from trainer.serve import PolicyServer, ServerConfig
  tok = HFTokenizer(_tiny_bpe(), eos_token="<|im_end|>")
  engine = ScriptedEngine(tok.vocab_size, capacity=512)
  engine.replies = [[5, 6]]
  srv = PolicyServer(engine, ServerConfig(port=0, token=TOKEN, max_connections=6,
                                          header_timeout_s=header_timeout_s,
                                          body_timeout_s=5.0), tokenizer=tok)
  srv.start_in_thread()
  return srv, engine, tok.vocab_size


@pytest.fixture(scope="module")
def door_server():
  """Headers due 1.5 s after the connection opens (or the previous response ends)."""
  srv, engine, vocab = start_server(1.5)
  yield srv, engine, vocab
  srv.stop()


@pytest.fixture(scope="module")
def patient_server():
  """Headers due after 60 s: only the connection cap stands between a crowd and a client."""
  srv, engine, vocab = start_server(60.0)
  yield srv, engine, vocab
  srv.stop()


def post(srv, path: str, raw: bytes, headers=None, timeout: float = 30) -> tuple[int, dict]:
  req = urllib.request.Request(f"http://127.0.0.1:{srv.port}{path}", data=raw, method="POST",
                               headers={"Content-Type": "application/json", **AUTH,
                                        **(headers or {})})
  try:
    with urllib.request.urlopen(req, timeout=timeout) as resp:
      return resp.status, json.loads(resp.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read() or b"{}")


def closed_by_server(sock: socket.socket, within: float) -> bool:
  """Whether the server closes `sock` (EOF or reset) within `within` seconds."""
  sock.settimeout(within)
  try:
    while sock.recv(65536):
      pass
    return True
  except ConnectionResetError:
    return True
  except socket.timeout:
    return False


class Dribblers:
  """`n` tokenless connections each sending one byte of a request's headers every `every` s."""

  def __init__(self, port: int, n: int, every: float):
    self.socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n)]
    self.stop, self.every = threading.Event(), every
    self.thread = threading.Thread(target=self._run, daemon=True)
    self.thread.start()

  def _run(self):
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 10_000  # never ends
    for byte in head:
      for s in self.socks:
        try:
          s.send(bytes([byte]))
        except OSError:
          pass
      if self.stop.wait(self.every):
        return

  def close(self):
    self.stop.set()
    self.thread.join(5)
    for s in self.socks:
      s.close()


def test_dribbling_connections_do_not_lock_out_a_real_client(patient_server):
  """max_connections tokenless sockets dribbling their headers a byte a second: each real
  request is served (an idle tokenless connection is closed to make room), none is 503'd."""
  srv, _, _ = patient_server
  crowd = Dribblers(srv.port, 6, every=1.0)
  try:
    time.sleep(0.3)
    for _ in range(3):
      status, reply = post(srv, "/generate", json.dumps({"input_ids": [1, 2]}).encode())
      assert status == 200 and reply["output_ids"] == [5, 6], (status, reply)
      time.sleep(0.2)
  finally:
    crowd.close()


def test_header_deadline_closes_a_dribbling_connection(door_server):
  """Bytes keep coming, but the headers are not complete 1.5 s after the connection opened."""
  srv, _, _ = door_server
  crowd = Dribblers(srv.port, 1, every=0.25)
  try:
    t0 = time.monotonic()
    assert closed_by_server(crowd.socks[0], 8)
    assert 1.0 < time.monotonic() - t0 < 8
  finally:
    crowd.close()
  # and a keep-alive connection gets the same deadline for its next request's headers
  sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
  sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
  assert sock.recv(65536).startswith(b"HTTP/1.1 200")
  sock.sendall(b"GET /health HTTP/1.1\r\n")
  assert closed_by_server(sock, 8)
  sock.close()


@pytest.mark.parametrize("path, raw, param, value", [
    ("/generate", '{"input_ids": [1, 9223372036854775808]}', "input_ids", "9223372036854775808"),
    ("/generate", '{"input_ids": [1, VOCAB]}', "input_ids", "VOCAB"),
    ("/generate", '{"input_ids": [1, -1]}', "input_ids", "-1"),
    ("/generate", '{"input_ids": [1], "stop_token_ids": [9223372036854775808]}',
     "stop_token_ids", "9223372036854775808"),
    ("/generate", '{"input_ids": [1], "temperature": 1e400}', "temperature", "inf"),
    ("/generate", '{"input_ids": [1], "temperature": Infinity}', "temperature", "inf"),
    ("/generate", '{"input_ids": [1], "temperature": NaN}', "temperature", "nan"),
    ("/generate", '{"input_ids": [1], "temperature": -0.5}', "temperature", "-0.5"),
    ("/generate", '{"input_ids": [1], "temperature": 1' + "0" * 400 + '}', "temperature",
     "1000"),
    ("/generate", '{"input_ids": [1], "top_p": 0}', "top_p", "0"),
    ("/generate", '{"input_ids": [1], "top_p": 1.5}', "top_p", "1.5"),
    ("/generate", '{"input_ids": [1], "top_p": NaN}', "top_p", "nan"),
    ("/generate", '{"input_ids": [1], "top_k": -1}', "top_k", "-1"),
    ("/generate", '{"input_ids": [1], "top_k": 4294967296}', "top_k", "4294967296"),
    ("/generate", '{"input_ids": [1], "max_tokens": 9223372036854775808}', "max_tokens",
     "9223372036854775808"),
    ("/generate", '{"input_ids": [1], "max_tokens": 0}', "max_tokens", "0"),
    ("/generate", '{"input_ids": [1], "seed": 36893488147419103232}', "seed",
     "36893488147419103232"),
    ("/generate", '{"input_ids": [1], "seed": ' + "7" * 5000 + '}', None, "digits"),
    ("/generate", '{"input_ids": ' + nested(DEEP) + '}', None, "max_json_depth="),
    ("/v1/completions", '{"prompt": [[1, 9223372036854775808]]}', "prompt",
     "9223372036854775808"),
    ("/v1/completions", '{"prompt": [1, VOCAB]}', "prompt", "VOCAB"),
    ("/v1/completions", '{"prompt": [1, 2], "temperature": 1e400}', "temperature", "inf"),
    ("/v1/completions", '{"prompt": [1, 2], "n": 9223372036854775808}', "n",
     "9223372036854775808"),
    ("/v1/completions", '{"prompt": [1, 2], "logprobs": 9223372036854775808}', "logprobs",
     "9223372036854775808"),
    ("/v1/completions", '{"prompt": [1, 2], "x": ' + nested(DEEP) + '}', None,
     "max_json_depth="),
])
def test_out_of_range_and_deep_requests_get_400_naming_the_field(door_server, path, raw, param,
                                                                 value):
  srv, engine, vocab = door_server
  raw, value = raw.replace("VOCAB", str(vocab)), value.replace("VOCAB", str(vocab))
  engine.submitted.clear()
  status, reply = post(srv, path, raw.encode())
  assert status == 400, (status, reply)
  error = reply["error"]
  assert error["type"] == "invalid_request_error" and error["param"] == param, error
  assert value in error["message"] and (param is None or param in error["message"]), error
  assert engine.submitted == []  # refused before the engine
  status, reply = post(srv, "/generate", b'{"input_ids": [1, 2], "temperature": 0.7}')
  assert status == 200 and reply["output_ids"] == [5, 6]
