"""envs.tools against a real (local, unsafe-for-production) sandbox: each tool's behaviour, its
errors as observations, argument validation and output truncation."""

import asyncio
import re

import pytest

from envs.chat.toolcalls import validate
from envs.sandbox.base import Limits
from envs.sandbox.local import LocalSandbox
from envs.tools import (Bash, ReadFile, RunTests, Search, StrReplace, call_tool, default_tools,
                        truncate)

CALC = "def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n"
TOOLS = default_tools(test_command="python3 test_calc.py", timeout=5.0)


def run(coro_fn, limits=Limits()):
  """Run `coro_fn(sandbox)` in a fresh local sandbox holding calc.py."""
  async def main():
    async with LocalSandbox(limits, allow_unsafe=True) as sb:
      await sb.write_file("calc.py", CALC)
      return await coro_fn(sb)
  return asyncio.run(main())


def call(sb, name, **args):
  return call_tool(TOOLS, sb, name, args)


def test_read_file_ranges_and_errors():
  async def main(sb):
    await sb.write_file("empty.txt", "")
    await sb.write_file("blob.bin", b"\x00\x01\x02")
    return [await call(sb, "read_file", path="calc.py"),
            await call(sb, "read_file", path="calc.py", start_line=2, end_line=2),
            await call(sb, "read_file", path="calc.py", start_line=5, end_line=99),
            await call(sb, "read_file", path="calc.py", start_line=7),
            await call(sb, "read_file", path="calc.py", start_line=3, end_line=2),
            await call(sb, "read_file", path="missing.py"),
            await call(sb, "read_file", path="../etc/passwd"),
            await call(sb, "read_file", path="/etc/passwd"),
            await call(sb, "read_file", path="empty.txt"),
            await call(sb, "read_file", path="blob.bin")]
  whole, line2, tail, past, backwards, missing, up, absolute, empty, blob = run(main)
  assert whole.output == "\n".join(f"{i:>6}\t{ln}" for i, ln in enumerate(CALC.splitlines(), 1))
  assert not whole.error
  assert line2.output == "[lines 2-2 of 6]\n     2\t    return a - b"
  assert tail.output == "[lines 5-6 of 6]\n     5\tdef sub(a, b):\n     6\t    return a - b"
  assert past.error and "past the end of calc.py (6 lines)" in past.output
  assert backwards.error and "before start_line=3" in backwards.output
  assert missing.error and "no such file" in missing.output
  assert up.error and "'..' is not allowed" in up.output
  assert absolute.error and "absolute" in absolute.output
  assert not empty.error and empty.output == "empty.txt is empty"
  assert blob.error and "binary" in blob.output


def test_write_file_and_limits():
  async def main(sb):
    ok = await call(sb, "write_file", path="pkg/new.py", content="x = 1\n")
    back = await sb.read_file("pkg/new.py")
    big = await call(sb, "write_file", path="big.txt", content="x" * 2000)
    out = await call(sb, "write_file", path="../outside.txt", content="x")
    return ok, back, big, out
  ok, back, big, out = run(main, Limits(file_bytes=1000))
  assert not ok.error and ok.output == "wrote 6 bytes to pkg/new.py" and back == b"x = 1\n"
  assert big.error and "2000 bytes" in big.output and "1000" in big.output
  assert out.error and "'..'" in out.output


def test_str_replace_unique_match_required():
  async def main(sb):
    many = await call(sb, "str_replace", path="calc.py", old_str="return a - b", new_str="x")
    none = await call(sb, "str_replace", path="calc.py", old_str="return a * b", new_str="x")
    ok = await call(sb, "str_replace", path="calc.py",
                    old_str="def add(a, b):\n    return a - b", new_str="def add(a, b):\n"
                    "    return a + b")
    return many, none, ok, (await sb.read_file("calc.py")).decode()
  many, none, ok, text = run(main)
  assert many.error and "occurs 2 times" in many.output and "lines 2, 6" in many.output
  assert none.error and "not found" in none.output
  assert not ok.error and text == CALC.replace("a - b", "a + b", 1)
  assert ok.output.startswith("edited calc.py; lines 1-5 now read:\n     1\tdef add(a, b):\n"
                              "     2\t    return a + b")
  empty = run(lambda sb: call(sb, "str_replace", path="calc.py", old_str="", new_str="x"))
  assert empty.error and "old_str" in empty.output  # schema: minLength 1


def test_search_bash_run_tests_submit():
  async def main(sb):
    await sb.write_file("test_calc.py", "from calc import add\nassert add(2, 2) == 4, add(2, 2)\n"
                        "print('ok')\n")
    return dict(
        hits=await call(sb, "search", pattern="def (add|sub)"),
        scoped=await call(sb, "search", pattern="add", path="test_calc.py"),
        nohit=await call(sb, "search", pattern="multiply"),
        badre=await call(sb, "search", pattern="("),
        bash=await call(sb, "bash", command="echo out; echo err >&2; exit 3"),
        slow=await call(sb, "bash", command="sleep 5", timeout=1),
        tests=await call(sb, "run_tests"),
        submit=await call(sb, "submit", answer="42"))
  r = run(main)
  assert r["hits"].output == "calc.py:1:def add(a, b):\ncalc.py:5:def sub(a, b):"
  assert r["scoped"].output == "test_calc.py:1:from calc import add\ntest_calc.py:2:assert " \
      "add(2, 2) == 4, add(2, 2)"
  assert not r["nohit"].error and "no matches for 'multiply'" in r["nohit"].output
  assert r["badre"].error and "search failed" in r["badre"].output
  assert r["bash"].output == "out\n[stderr]\nerr\n[exit code 3]" and not r["bash"].error
  assert r["slow"].output.endswith("[timed out after 1 s]")
  assert "AssertionError: 0" in r["tests"].output and r["tests"].output.endswith("[exit code 1]")
  assert r["submit"].submitted and r["submit"].answer == "42"


def test_run_tests_keeps_the_summary_of_an_over_long_run():
  """A real pytest run whose output is far over the sandbox's output limit: the agent sees its
  beginning, how much was left out, and its end, where pytest's summary line is."""
  async def main(sb):
    await sb.write_file("test_noisy.py", "def test_noisy():\n"
                        "    print('x' * 20000)\n    assert False\n")
    return await RunTests("python3 -m pytest -q -p no:cacheprovider test_noisy.py",
                          timeout=60).run(sb)
  out = run(main, Limits(output_bytes=4096)).output
  head, rest = out.split("bytes left out of", 1)
  assert head.count("\n[... ") == 1 and "test_noisy.py" in head  # the head, then the marker
  assert re.search(r"\n1 failed in [\d.]+s\n\[output shortened .*\]\n\[exit code 1\]$", rest), \
      out[-400:]


def test_search_caps_matches():
  async def main(sb):
    await sb.write_file("many.txt", "hit\n" * 30)
    return await call_tool([Search(max_matches=10)], sb, "search", {"pattern": "hit"})
  r = run(main)
  assert r.output.splitlines()[:2] == ["many.txt:1:hit", "many.txt:2:hit"]
  assert r.output.endswith("[20 more matches not shown]") and len(r.output.splitlines()) == 11


def test_validation_errors_never_run_the_tool():
  async def main(sb):
    return [await call_tool(TOOLS, sb, "rm", {}),
            await call_tool(TOOLS, sb, "bash", {}),
            await call_tool(TOOLS, sb, "bash", {"command": 5}),
            await call_tool(TOOLS, sb, "bash", {"command": "ls", "timeout": 999}),
            await call_tool(TOOLS, sb, "read_file", {"path": "calc.py", "line": 3}),
            await call_tool(TOOLS, sb, "bash", ["ls"]),
            await call_tool(TOOLS, sb, "bash", {"command": "echo \x00"})]
  results = run(main)
  assert all(r.error for r in results)
  msgs = [r.output for r in results]
  assert "unknown tool 'rm'" in msgs[0] and "bash, read_file" in msgs[0]
  assert "missing required 'command'" in msgs[1]
  assert "arguments.command must be string, got int" in msgs[2]
  assert "arguments.timeout must be <= 5" in msgs[3]
  assert "unknown key 'line'" in msgs[4]
  assert "must be a JSON object" in msgs[5]
  assert "bash failed" in msgs[6]  # the sandbox refused the command: still an observation


def test_output_truncation_chars_and_tokens():
  async def main(sb):
    cmd = "python3 -c \"print('a' * 3000 + 'END')\""
    return (await call_tool(TOOLS, sb, "bash", {"command": cmd}, max_output=200),
            await call_tool(TOOLS, sb, "bash", {"command": cmd}))
  short, full = run(main)
  assert len(full.output) > 3000 and "truncated" not in full.output
  assert short.output.startswith("a" * 100) and short.output.endswith("END\n[exit code 0]")
  assert f"[... {len(full.output) - 200} characters truncated ...]" in short.output
  assert len(short.output) < 260

  class Chars:  # a tokenizer with one token per character
    encode = staticmethod(lambda s: [ord(c) for c in s])
    decode = staticmethod(lambda ids: "".join(map(chr, ids)))
  assert truncate("abcdefghij", 4, "tokens", Chars()) == "ab\n[... 6 tokens truncated ...]\nij"
  assert truncate("abc", 4, "tokens", Chars()) == "abc"
  assert truncate("abcdefghij", 5) == "ab\n[... 5 characters truncated ...]\nhij"
  assert truncate("abcdefghij", None) == "abcdefghij"
  with pytest.raises(ValueError, match="unit='words'"):
    truncate("x", 3, "words")


def test_schemas_are_valid_and_strict():
  names = [t.schema()["function"]["name"] for t in TOOLS]
  assert names == ["bash", "read_file", "write_file", "str_replace", "search", "run_tests",
                   "submit"]
  assert "run_tests" not in [t.name for t in default_tools()]
  examples = {"bash": {"command": "ls", "timeout": 3}, "read_file": {"path": "a", "start_line": 2},
              "write_file": {"path": "a", "content": ""},
              "str_replace": {"path": "a", "old_str": "x", "new_str": ""},
              "search": {"pattern": "x", "path": "src"}, "run_tests": {}, "submit": {}}
  for tool in TOOLS:
    fn = tool.schema()["function"]
    assert fn["description"] and fn["parameters"]["type"] == "object"
    assert validate(examples[fn["name"]], fn["parameters"]) is None
    assert validate({**examples[fn["name"]], "bogus": 1}, fn["parameters"]) is not None
  assert isinstance(Bash(), Bash) and ReadFile().name == "read_file" and StrReplace.context_lines
