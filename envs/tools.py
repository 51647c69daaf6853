"""Tools the agent calls, each with a JSON schema, each run against a `Sandbox`.

    tools = default_tools(test_command="python -m pytest -q")
    result = await call_tool(tools, sandbox, "read_file", {"path": "app.py"}, max_output=8000)

`call_tool` validates the arguments against the tool's schema, runs it and truncates its output
to a budget (characters or tokens, with a marker). Everything the model can get wrong (unknown
tool, bad arguments, missing file, no unique match, a path outside the workspace, an oversize
write) comes back as a `ToolResult` with `error=True` and a message for the model; only a
failure of the sandbox itself (`SandboxError`) is raised.
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import Any, Mapping, Optional, Sequence, Union

from envs.chat.toolcalls import check_call
from envs.sandbox.base import ExecResult, Sandbox

UNITS = ("chars", "tokens")


@dataclasses.dataclass
class ToolResult:
  """What one tool call gives back to the agent."""

  output: str                      # what the model sees
  error: bool = False              # the call could not be carried out as asked
  submitted: bool = False          # the agent declared it is done (`submit`)
  answer: Optional[str] = None     # submit's optional answer (for answer-checking verifiers)


class Tool:
  """A named action with a JSON schema for its arguments (an object)."""

  name: str = ""
  description: str = ""
  parameters: dict = {"type": "object", "properties": {}, "additionalProperties": False}

  def schema(self) -> dict:
    """The OpenAI function schema shown to the model."""
    return {"type": "function", "function": {"name": self.name, "description": self.description,
                                             "parameters": self.parameters}}

  async def run(self, sandbox: Sandbox, **args) -> ToolResult:
    """Runs the tool.

    Args:
      sandbox: the workspace the tool acts on.
      **args: the call's arguments, already checked against `parameters`.

    Returns:
      The result; a mistake of the model is a result with error=True, not an exception.
    """
    raise NotImplementedError


def _obj(properties: dict, required: Sequence[str] = ()) -> dict:
  return {"type": "object", "properties": properties, "required": list(required),
          "additionalProperties": False}


def format_exec(result: ExecResult, timeout: float) -> str:
  """Formats a command's result for the model: stdout, stderr, and how it ended.

  Args:
    result: what the command did.
    timeout: the command's timeout in seconds, shown when it timed out.

  Returns:
    The text, ending with "[exit code N]" or "[timed out after T s]".
  """
  parts = []
  if result.stdout:
    parts.append(result.stdout.rstrip("\n"))
  if result.stderr:
    parts.append("[stderr]\n" + result.stderr.rstrip("\n"))
  if result.stdout_truncated or result.stderr_truncated:
    parts.append("[output shortened to its beginning and end by the sandbox's output limit]")
  parts.append(f"[timed out after {timeout:g} s]" if result.timed_out else
               f"[exit code {result.exit_code}]")
  return "\n".join(parts)


class Bash(Tool):
  """Runs a shell command in the workspace.

  Args:
    timeout: seconds a command may run: the default, and the most a call may ask for.
  """

  name = "bash"
  description = ("Run a shell command (/bin/sh -c) in the repository root and return its output "
                 "and exit code. No network. Each call starts a fresh shell.")

  def __init__(self, timeout: float = 60.0):
    self.timeout = timeout  # seconds; also the most a call may ask for
    self.parameters = _obj({
        "command": {"type": "string", "description": "the command line"},
        "timeout": {"type": "integer", "minimum": 1, "maximum": max(1, int(timeout)),
                    "description": f"seconds (default and maximum {timeout:g})"},
    }, ["command"])

  async def run(self, sandbox, command: str, timeout: Optional[int] = None) -> ToolResult:
    """Runs a command with `/bin/sh -c` in the workspace root.

    Args:
      sandbox: the workspace.
      command: the command line.
      timeout: seconds, at most the tool's timeout (the schema's maximum); None: the tool's.

    Returns:
      The `format_exec` text.
    """
    timeout = float(timeout or self.timeout)
    return ToolResult(format_exec(await sandbox.exec(command, timeout=timeout), timeout))


def _text(data: bytes) -> Optional[str]:
  """File bytes as text, or None for a binary file."""
  if b"\x00" in data[:8192]:
    return None
  return data.decode("utf-8", errors="replace")


def _numbered(lines: Sequence[str], first: int) -> str:
  return "\n".join(f"{i:>6}\t{line}" for i, line in enumerate(lines, first))


class ReadFile(Tool):
  """Shows a text file, or a range of its lines, with line numbers."""

  name = "read_file"
  description = ("Read a text file of the repository, or the lines start_line..end_line of it "
                 "(1-based, inclusive). Lines are shown with their numbers.")
  parameters = _obj({
      "path": {"type": "string", "description": "path relative to the repository root"},
      "start_line": {"type": "integer", "minimum": 1, "description": "first line (default 1)"},
      "end_line": {"type": "integer", "minimum": 1, "description": "last line (default: end)"},
  }, ["path"])

  async def run(self, sandbox, path: str, start_line: int = 1,
                end_line: Optional[int] = None) -> ToolResult:
    """Reads lines start_line..end_line of a file.

    Args:
      sandbox: the workspace.
      path: workspace-relative path.
      start_line: first line shown, 1-based.
      end_line: last line shown, inclusive (past the end: the end); None: the end.

    Returns:
      The numbered lines, headed "[lines a-b of n]" when not the whole file; error=True for a
      binary file or a range outside the file.
    """
    data = await sandbox.read_file(path)
    text = _text(data)
    if text is None:
      return ToolResult(f"{path} is a binary file ({len(data)} bytes)", error=True)
    lines = text.splitlines()
    if not lines:
      return ToolResult(f"{path} is empty")
    if start_line > len(lines):
      return ToolResult(f"start_line={start_line} is past the end of {path} "
                        f"({len(lines)} lines)", error=True)
    end = len(lines) if end_line is None else min(end_line, len(lines))
    if end < start_line:
      return ToolResult(f"end_line={end_line} is before start_line={start_line}", error=True)
    body = _numbered(lines[start_line - 1:end], start_line)
    if start_line > 1 or end < len(lines):
      body = f"[lines {start_line}-{end} of {len(lines)}]\n" + body
    return ToolResult(body)


class WriteFile(Tool):
  """Creates or overwrites a file."""

  name = "write_file"
  description = "Create or overwrite a file of the repository with the given content."
  parameters = _obj({
      "path": {"type": "string", "description": "path relative to the repository root"},
      "content": {"type": "string", "description": "the whole new content of the file"},
  }, ["path", "content"])

  async def run(self, sandbox, path: str, content: str) -> ToolResult:
    """Creates or overwrites a file.

    Args:
      sandbox: the workspace.
      path: workspace-relative path.
      content: the whole new content.

    Returns:
      How many bytes were written; error=True above the sandbox's `limits.file_bytes`.
    """
    size, limit = len(content.encode()), sandbox.limits.file_bytes
    if size > limit:
      return ToolResult(f"content is {size} bytes, more than the {limit} bytes a file may have",
                        error=True)
    await sandbox.write_file(path, content)
    return ToolResult(f"wrote {size} bytes to {path}")


class StrReplace(Tool):
  """Replaces the one occurrence of a text in a file, and shows the edited lines."""

  name = "str_replace"
  description = ("Edit a file: replace the one occurrence of old_str (exact text, whitespace "
                 "included) with new_str. old_str must occur exactly once; add surrounding "
                 "lines to make it unique.")
  parameters = _obj({
      "path": {"type": "string", "description": "path relative to the repository root"},
      "old_str": {"type": "string", "minLength": 1, "description": "exact text to replace"},
      "new_str": {"type": "string", "description": "replacement text"},
  }, ["path", "old_str", "new_str"])

  context_lines = 3  # lines shown around the edit

  async def run(self, sandbox, path: str, old_str: str, new_str: str) -> ToolResult:
    """Replaces `old_str` by `new_str` in a file.

    Args:
      sandbox: the workspace.
      path: workspace-relative path.
      old_str: exact text that must occur exactly once.
      new_str: the replacement.

    Returns:
      The edited lines with `context_lines` around them, numbered; error=True for a binary file
      or when old_str occurs zero or several times (their lines are named).
    """
    text = _text(await sandbox.read_file(path))
    if text is None:
      return ToolResult(f"{path} is a binary file", error=True)
    count = text.count(old_str)
    if count == 0:
      return ToolResult(f"old_str was not found in {path}; it must match the file exactly, "
                        "whitespace and indentation included (without line numbers)", error=True)
    if count > 1:
      lines, at = [], -1
      while (at := text.find(old_str, at + 1)) >= 0:
        lines.append(str(text.count("\n", 0, at) + 1))
      return ToolResult(f"old_str occurs {count} times in {path} (starting on lines "
                        f"{', '.join(lines)}); include more surrounding lines to make it unique",
                        error=True)
    at = text.find(old_str)
    new_text = text[:at] + new_str + text[at + len(old_str):]
    await sandbox.write_file(path, new_text)
    first = new_text.count("\n", 0, at) + 1  # first edited line
    last = first + new_str.count("\n")
    lines = new_text.splitlines()
    lo, hi = max(1, first - self.context_lines), min(len(lines), last + self.context_lines)
    return ToolResult(f"edited {path}; lines {lo}-{hi} now read:\n"
                      + _numbered(lines[lo - 1:hi], lo))


class Search(Tool):
  """Greps the workspace's text files for an extended regular expression.

  Args:
    timeout: seconds a search may run.
    max_matches: matching lines returned at most (the rest are counted).
  """

  name = "search"
  description = ("Search the repository's text files for a regular expression (grep -E); "
                 "returns matching lines as path:line:text.")
  parameters = _obj({
      "pattern": {"type": "string", "minLength": 1, "description": "extended regular expression"},
      "path": {"type": "string", "description": "file or directory to search (default: all)"},
  }, ["pattern"])

  def __init__(self, timeout: float = 30.0, max_matches: int = 100):
    self.timeout = timeout
    self.max_matches = max_matches  # lines returned at most

  async def run(self, sandbox, pattern: str, path: str = ".") -> ToolResult:
    """Searches text files for a pattern.

    Args:
      sandbox: the workspace.
      pattern: an extended regular expression (grep -E).
      path: workspace-relative file or directory to search.

    Returns:
      Matching lines as path:line:text, at most `max_matches`; error=True on timeout or a
      grep error.
    """
    cmd = (f"grep -rnHIE --color=never --exclude-dir=.git -e {shlex.quote(pattern)} -- "
           f"{shlex.quote(path)}")
    r = await sandbox.exec(cmd, timeout=self.timeout)
    if r.timed_out:
      return ToolResult(f"search timed out after {self.timeout:g} s; narrow the path", error=True)
    if r.exit_code == 1:
      return ToolResult(f"no matches for {pattern!r} in {path}")
    if r.exit_code != 0:
      return ToolResult(f"search failed: {r.stderr.strip() or r.stdout.strip()}", error=True)
    lines = [ln[2:] if ln.startswith("./") else ln for ln in r.stdout.splitlines()]
    more = len(lines) - self.max_matches
    out = "\n".join(lines[:self.max_matches])
    return ToolResult(out + (f"\n[{more} more matches not shown]" if more > 0 else ""))


class RunTests(Tool):
  """Runs the task's test command.

  Args:
    command: the test command, run from the repository root.
    timeout: seconds the tests may run.
  """

  name = "run_tests"
  description = "Run the task's tests and return their output."

  def __init__(self, command: str, timeout: float = 300.0):
    self.command = command  # the task's test command, run from the repository root
    self.timeout = timeout

  async def run(self, sandbox) -> ToolResult:
    """Runs the test command; returns its `format_exec` text."""
    return ToolResult(format_exec(await sandbox.exec(self.command, timeout=self.timeout),
                                  self.timeout))


class Submit(Tool):
  """Ends the episode: the agent declares the task done."""

  name = "submit"
  description = ("Finish: call when the task is done. Your changes to the repository are what "
                 "gets evaluated; `answer` is for tasks that ask for one.")
  parameters = _obj({"answer": {"type": "string", "description": "final answer, if asked"}})

  async def run(self, sandbox, answer: Optional[str] = None) -> ToolResult:
    """Marks the episode submitted.

    Args:
      sandbox: unused.
      answer: the agent's final answer, for tasks that ask for one; None: none.

    Returns:
      A result with submitted=True.
    """
    return ToolResult("submitted", submitted=True, answer=answer)


def default_tools(test_command: Optional[str] = None, *, timeout: float = 60.0,
                  test_timeout: float = 300.0) -> list[Tool]:
  """The standard tool set.

  Args:
    test_command: the task's test command; None or "": no run_tests tool.
    timeout: bash's timeout, seconds.
    test_timeout: run_tests' timeout, seconds.

  Returns:
    bash, read_file, write_file, str_replace, search, run_tests (when there is a test command)
    and submit.
  """
  tools = [Bash(timeout), ReadFile(), WriteFile(), StrReplace(), Search()]
  if test_command:
    tools.append(RunTests(test_command, test_timeout))
  return tools + [Submit()]


def truncate(text: str, budget: Optional[int], unit: str = "chars", tokenizer=None) -> str:
  """Cuts text to a budget, keeping its head and tail halves.

  Args:
    text: the text.
    budget: characters or tokens kept at most; None: no limit.
    unit: "chars" or "tokens".
    tokenizer: encodes and decodes the text when unit is "tokens".

  Returns:
    The text itself if within budget, else its head and tail with a marker between them saying
    how much was cut.

  Raises:
    ValueError: an unknown unit, or unit "tokens" without a tokenizer.
  """
  if unit not in UNITS:
    raise ValueError(f"unit={unit!r}: expected one of {UNITS}")
  if budget is None:
    return text
  if unit == "tokens":
    if tokenizer is None:
      raise ValueError("truncate(unit='tokens') needs a tokenizer")
    ids = tokenizer.encode(text)
    if len(ids) <= budget:
      return text
    head, tail = budget // 2, budget - budget // 2
    return (tokenizer.decode(ids[:head]) + f"\n[... {len(ids) - budget} tokens truncated ...]\n"
            + (tokenizer.decode(ids[-tail:]) if tail else ""))
  if len(text) <= budget:
    return text
  head, tail = budget // 2, budget - budget // 2
  return (text[:head] + f"\n[... {len(text) - budget} characters truncated ...]\n"
          + (text[-tail:] if tail else ""))


async def call_tool(tools: Union[Sequence[Tool], Mapping[str, Tool]], sandbox: Sandbox,
                    name: str, arguments: Any, *, max_output: Optional[int] = None,
                    unit: str = "chars", tokenizer=None) -> ToolResult:
  """Validates and runs one tool call.

  Args:
    tools: the tools, as a list or by name.
    sandbox: the workspace the tool acts on.
    name: the called tool.
    arguments: the call's decoded arguments (checked against the tool's schema).
    max_output: the output's budget (see `truncate`); None: no limit.
    unit: "chars" or "tokens".
    tokenizer: needed when unit is "tokens".

  Returns:
    The result; the model's mistakes (unknown tool, bad arguments, missing file, path outside
    the workspace...) come back as error=True results.

  Raises:
    SandboxError: the sandbox itself failed.
  """
  by_name = tools if isinstance(tools, Mapping) else {t.name: t for t in tools}
  error = check_call(name, arguments, list(by_name.values()))
  if error:
    return ToolResult(error, error=True)
  try:
    result = await by_name[name].run(sandbox, **arguments)
  except (OSError, ValueError, UnicodeError) as e:
    # FileNotFoundError, PathError (a ValueError), oversize files... : the model's mistake.
    result = ToolResult(f"{name} failed: {e}", error=True)
  result.output = truncate(result.output, max_output, unit, tokenizer)
  return result
