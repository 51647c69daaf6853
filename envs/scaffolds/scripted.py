"""A scripted policy for the real policy server: a bug fix played through whatever tools a
scaffold's CLI offers.

    fix = BugFix("calc.py", "a - b", "a + b", "python3 -m unittest -v")
    policy = ScriptedPolicy(make_chat("qwen2.5", tokenizer), fix, completion=Completion)
    server = PolicyServer(policy, ServerConfig(port=0), tokenizer=tokenizer, chat=policy.chat)

`ScriptedPolicy` has the generation engine's interface (`submit`, `pending`, `start`, `stop`,
`capacity`, `cfg.top_logprobs`, `model_cfg.vocab_size`, `version`, `counters`) so that
`trainer.serving.PolicyServer` serves it like a model: the server renders each request
through the chat format to token ids, and the policy reads those ids back as text (the
tokenizer's decode) to choose its reply:
- the tools the request offers: the JSON schemas of the format's tools block (Hermes/Qwen's
  `<tools>` lines), so a CLI's own names and arguments are used: Claude Code's Read / Edit /
  Bash, Codex's shell or exec_command (and apply_patch when it is a function tool),
  mini-swe-agent's bash;
- how far the episode is: the tool results in the prompt (`<tool_response>` blocks).
The reply is the next step of `BugFix`: read the file, replace the buggy text, run the tests,
finish (a final text reply, or the submit command of a scaffold whose only tool must be
called every turn), written as the exact ids the format gives an assistant turn with those
tool calls (`ChatFormat.assistant_ids`), so the server's tool-call parsing reads them back.
A request without tools (a CLI's side call: a title, a summary) gets a short text reply.
Log-probs are a fixed value; `max_tokens` cuts a reply (finish "length").

The engine's result type (`models.engine.Completion`) is given by the caller: envs imports
no model code.

Every decision is kept in `calls` (the prompt's text, the tools seen, the step and the reply)
for tests and for looking at what a CLI sends.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import re
import threading
import types
from typing import Any, Callable

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"  # mini-swe-agent's end of an episode
_TOOLS = re.compile(r"\n<tools>\n(.*?)\n</tools>\n", re.S)
_RESULT = "<tool_response>"
_SHELL_NAMES = ("Bash", "bash", "shell", "exec_command", "run_shell_command", "shell_command")


@dataclasses.dataclass(frozen=True)
class BugFix:
  """What the scripted policy does: the bug and the command that tests the fix.

  Attributes:
    path: the buggy file, relative to the workspace.
    old: the buggy text (it occurs once in the file).
    new: its replacement.
    test_command: the shell command that runs the tests, in the workspace.
    workspace: the workspace's absolute path in the sandbox.
    final: the final reply's text.
  """

  path: str
  old: str
  new: str
  test_command: str
  workspace: str = "/workspace"
  final: str = "Fixed the bug; the tests pass."

  @property
  def abspath(self) -> str:
    return f"{self.workspace}/{self.path}"


def offered_tools(prompt: str) -> dict[str, dict]:
  """The tools a rendered prompt offers: name -> parameters schema (from the format's tools
  block: one JSON object a line, `{"type": "function", "function": {...}}`)."""
  m = _TOOLS.search(prompt)
  if not m:
    return {}
  out = {}
  for line in m.group(1).split("\n"):
    try:
      t = json.loads(line)
    except ValueError:
      continue
    fn = t.get("function", t) if isinstance(t, dict) else {}
    if isinstance(fn, dict) and isinstance(fn.get("name"), str):
      out[fn["name"]] = fn.get("parameters") or {}
  return out


def _shell_call(name: str, schema: dict, command: str, workspace: str) -> dict:
  """A call of a shell tool, its arguments shaped by the tool's schema."""
  props = schema.get("properties") or {}
  if "cmd" in props:  # Codex's exec_command
    args = {"cmd": command}
  elif (props.get("command") or {}).get("type") == "array":  # Codex's shell
    args = {"command": ["bash", "-lc", command]}
  else:
    args = {"command": command}
  if "workdir" in props:
    args["workdir"] = workspace
  if "description" in (schema.get("required") or ()):
    args["description"] = "Run: " + command[:60]
  return {"name": name, "arguments": args}


def _patch(fix: BugFix, content_line: str) -> str:
  """An apply_patch envelope replacing the buggy line."""
  return (f"*** Begin Patch\n*** Update File: {fix.path}\n@@\n-{content_line}\n"
          f"+{content_line.replace(fix.old, fix.new)}\n*** End Patch\n")


def plan_step(fix: BugFix, tools: dict[str, dict], step: int, prompt: str = "") -> dict:
  """The assistant message of step `step` (0 read, 1 edit, 2 test, 3+ finish) with `tools`
  offered: {"role": "assistant", "content": ..., "tool_calls": [...]} (no tool_calls for a
  final text reply)."""
  shell = next((n for n in _SHELL_NAMES if n in tools), None)
  only_shell = shell is not None and len(tools) == 1  # mini-swe-agent: a call every turn
  sh = (lambda cmd: _shell_call(shell, tools[shell], cmd, fix.workspace))
  say = lambda text, *calls: {"role": "assistant", "content": text, "tool_calls": list(calls)}
  if not tools or shell is None and "Read" not in tools:
    return {"role": "assistant", "content": fix.final}
  if step == 0:
    if "Read" in tools:
      return say("Let me read the code.", {"name": "Read",
                                            "arguments": {"file_path": fix.abspath}})
    return say("Let me read the code.", sh(f"cat {fix.path}"))
  if step == 1:
    if "Edit" in tools:
      return say("Fixing the bug.", {"name": "Edit", "arguments": {
          "file_path": fix.abspath, "old_string": fix.old, "new_string": fix.new}})
    line = next((ln.strip("\n") for ln in prompt.split("\n") if fix.old in ln and
                 "<" not in ln), None)
    if "apply_patch" in tools and line is not None:
      props = (tools["apply_patch"].get("properties") or {})
      key = "input" if "input" in props or not props else next(iter(props))
      return say("Fixing the bug.", {"name": "apply_patch",
                                     "arguments": {key: _patch(fix, line)}})
    old, new = (re.sub(r"([/&\\.*\[\]^$])", r"\\\1", s) for s in (fix.old, fix.new))
    return say("Fixing the bug.", sh(f"sed -i 's/{old}/{new}/' {fix.path}"))
  if step == 2:
    return say("Running the tests.", sh(fix.test_command) if shell else {
        "name": "Read", "arguments": {"file_path": fix.abspath}})
  if only_shell:
    return say(fix.final, sh(SUBMIT))
  return {"role": "assistant", "content": fix.final}


class ScriptedPolicy:
  """The scripted policy (module docstring), with the engine's interface.

  Args:
    chat: the `envs.chat` format the server renders with (its tokenizer decodes prompts).
    fix: the bug fix to play.
    completion: the engine's result type (`models.engine.Completion`), called with
      (output_ids, logprobs, finish_reason, token_versions, policy_version, prompt_tokens,
      cached_tokens).
    capacity: the longest sequence it accepts (the engine's max_seq_len).
    logprob: the log-prob reported for every sampled token.
    version: the policy version it reports.

  Attributes:
    calls: per request, {"prompt", "tools", "step", "reply", "output_ids"}.
  """

  def __init__(self, chat, fix: BugFix, *, completion: Callable[..., Any],
               capacity: int = 1 << 20, logprob: float = -0.25, version: int = 0):
    self.chat, self.fix, self.tokenizer = chat, fix, chat.tokenizer
    self.completion = completion
    self.capacity, self.logprob, self.version = capacity, logprob, version
    self.cfg = types.SimpleNamespace(top_logprobs=0, max_seq_len=capacity)
    self.model_cfg = types.SimpleNamespace(vocab_size=self.tokenizer.vocab_size)
    self.counters: dict[str, Any] = {"requests": 0}
    self.calls: list[dict] = []
    self._lock = threading.Lock()

  def reply(self, prompt: str) -> tuple[dict, dict[str, dict], int]:
    """(assistant message, tools offered, step) for a decoded prompt."""
    tools = offered_tools(prompt)
    end = _TOOLS.search(prompt)
    step = prompt.count(_RESULT, end.end() if end else 0)
    return plan_step(self.fix, tools, step, prompt), tools, step

  def submit(self, input_ids, params, on_tokens=None) -> concurrent.futures.Future:
    """Answers one request: a finished future of a `completion`."""
    prompt = self.tokenizer.decode(list(input_ids))
    message, tools, step = self.reply(prompt)
    ids = self.chat.assistant_ids(message)
    finish = "stop"
    limit = getattr(params, "max_tokens", None)
    if limit is not None and len(ids) > limit:
      ids, finish = ids[:limit], "length"
    lps = [self.logprob] * len(ids)
    with self._lock:
      self.counters["requests"] += 1
      self.calls.append({"prompt": prompt, "tools": sorted(tools), "step": step,
                         "reply": message, "output_ids": list(ids)})
    if on_tokens is not None:
      on_tokens(list(ids), list(lps), None)
    f = concurrent.futures.Future()
    f.set_result(self.completion(list(ids), lps, finish, [self.version] * len(ids), self.version,
                            len(input_ids), 0))
    return f

  def pending(self) -> int:
    return 0

  def start(self) -> None:
    pass

  def stop(self) -> None:
    pass


def tool_summary(calls: list[dict], limit: int = 400) -> list[dict]:
  """A short view of `ScriptedPolicy.calls`: the tools, step and reply of each, and the
  prompt's last `limit` characters."""
  return [{"tools": c["tools"], "step": c["step"], "reply": c["reply"],
           "prompt_tail": c["prompt"][-limit:], "prompt_chars": len(c["prompt"])}
          for c in calls]
