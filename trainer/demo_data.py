"""Demo SFT data: real tool-call episodes of a scripted solver on generated bug-fixing tasks.

    chat = make_chat("chatml", load_tokenizer("tok_dir"))
    trajectories = demo_trajectories(chat, n=200, level=0, seed=0)   # bwrap sandboxes
    records = [chat_record(t) for t in trajectories]                 # the same, as chat records

Each episode is the react scaffold (`envs.scaffold.run_episode`, the rollout worker's loop and
tools) driven by a `ScriptedPolicy` on an `envs.taskgen` task, in a sandbox holding the task's
repository, so observations are real tool outputs:

    search("def ") -> read_file(the fix's file) -> [a failed str_replace]
      -> str_replace(the few characters around the bug) -> submit

With probability `error_rate` the solver first makes a typical mistake (an old_str too short to
be unique, or a wrong path); the tool answers with an error, the turn is
marked `meta["tool_error"]` and error-masked SFT trains the recovery but not the mistake.

With probability `early_submit_rate` the solver is a noisy demonstrator: it submits right after
reading the file, without the fix (as a teacher that declares success early). No tool fails, so
SFT imitates it; only a reward (the tests) tells the two endings apart, which is what the
demo's RL stage learns from.

Sandboxes: "bwrap" (default; isolated) or "local" (a plain temporary directory, no isolation).
"local" is acceptable here only because the scripted solver runs no code: read_file and
str_replace just read and write files. `demo_corpus` (text for the tokenizer) uses it, with a
byte-level stand-in tokenizer, since the real tokenizer does not exist yet at that point.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import re
import tempfile
from typing import Optional, Sequence

import numpy as np

from envs import aio
from envs.chat.formats import ChatFormat, make_chat
from envs.episode import make_sandbox_factory
from envs.scaffold import ScaffoldConfig, ScriptedPolicy, run_episode
from envs import task_environments
from envs.taskgen import write_tasks
from envs.tasks import Task, load_repo_files
from envs.tools import default_tools
from envs.trajectory import Trajectory
from envs.verifiers import verify_tests, workspace_files
from trainer.tokenizer_train import BOS_EOS, chat_symbols

SANDBOXES = ("bwrap", "local")
# Short episodes: the demo trains a tiny model on a 2-core CPU.
DEMO_SCAFFOLD = ScaffoldConfig(max_turns=6, max_new_tokens=512, max_context_tokens=8192,
                               timeout_s=60.0)


def _call(name: str, **arguments) -> dict:
  return {"role": "assistant", "content": None,
          "tool_calls": [{"function": {"name": name, "arguments": arguments}}]}


def buggy_file(task: Task) -> tuple[str, str]:
  """The file a taskgen task's fix edits (`metadata["fix_edit"]["path"]`).

  Args:
    task: an envs.taskgen task.

  Returns:
    (path, text) of the file.

  Raises:
    ValueError: the file defines no function above the fix line.
  """
  fix = task.metadata["fix_edit"]
  text = load_repo_files(task)[fix["path"]].decode()
  if not re.search(r"^\s*def \w+\(", text[:text.index(fix["old"])], flags=re.M):
    raise ValueError(f"task {task.instance_id!r}: no function defined above the fix line")
  return fix["path"], text


def minimal_edit(text: str, old: str, new: str) -> tuple[str, str]:
  """The shortest unique str_replace arguments that turn line `old` into `new`.

  The part of `old` that differs from `new` (whole words and operators: `!=` -> `==`, not
  `!` -> `=`) is widened a character at a time on both sides until it occurs exactly once in
  `text`. Short edits keep the demo agent's copying local (a token or two around the bug).

  Args:
    text: the file's text; `old` occurs in it.
    old: the buggy line.
    new: the fixed line.

  Returns:
    (old_str, new_str) for str_replace; the whole lines when no shorter part is unique.
  """
  at = text.index(old)
  p = 0
  while p < min(len(old), len(new)) and old[p] == new[p]:
    p += 1
  q = 0
  while q < min(len(old), len(new)) - p and old[-1 - q] == new[-1 - q]:
    q += 1
  a, b = p, len(old) - q  # old[a:b] -> new[a:len(new) - q]
  kind = lambda ch: "w" if ch.isalnum() or ch == "_" else (" " if ch.isspace() else "p")
  if b > a:  # whole operators / words: `!=` -> `==`, not `!` -> `=`
    while a > 0 and kind(old[a - 1]) == kind(old[a]) != " ":
      a -= 1
    while b < len(old) and kind(old[b]) == kind(old[b - 1]) != " ":
      b += 1
  elif 0 < a < len(old):  # pure insertion: take the neighbouring operator / word
    a -= 1
    while a > 0 and kind(old[a - 1]) == kind(old[a]) != " ":
      a -= 1
  while not (b > a and text.count(old[a:b]) == 1 and text.find(old[a:b]) >= at):
    if a == 0 and b == len(old):
      break
    a, b = max(a - 1, 0), min(b + 1, len(old))
  return old[a:b], new[a:len(new) - (len(old) - b)]


def scripted_turns(task: Task, rng: random.Random, error_rate: float = 0.0,
                   early_submit_rate: float = 0.0) -> list[dict]:
  """The scripted solver's assistant turns for one task.

  List the functions with `search("def ")`, read the file the fix is in, str_replace the few
  characters around the bug (`minimal_edit`), submit. The solver uses only what an agent can
  see: tool outputs and the statement.

  Args:
    task: an envs.taskgen task (metadata["fix_edit"]: {"path", "old", "new"}).
    rng: draws the mistakes (no draw for a rate of 0).
    error_rate: probability of a failed str_replace (a too short old_str or a wrong path)
      before the fix.
    early_submit_rate: probability of submitting right after the read, without a fix.

  Returns:
    The assistant messages, each one tool call.

  Raises:
    ValueError: the task has no fix_edit (not a taskgen task) or its file defines no function
      above the fix line.
  """
  fix = task.metadata.get("fix_edit")
  if not fix:
    raise ValueError(f"task {task.instance_id!r}: metadata has no fix_edit (not an "
                     "envs.taskgen task?)")
  path, text = buggy_file(task)
  old, new = minimal_edit(text, fix["old"], fix["new"])
  turns = [_call("search", pattern="def "), _call("read_file", path=path)]
  # (no draw at rate 0: the episodes of configs without the noisy demonstrator stay the same)
  if early_submit_rate and rng.random() < early_submit_rate:
    return turns + [_call("submit")]
  if rng.random() < error_rate:
    if rng.random() < 0.5 and text.count(old.strip()) > 1:  # too short: "occurs N times"
      turns.append(_call("str_replace", path=path, old_str=old.strip(),
                         new_str=new.strip()))
    else:  # the file's base name under a directory that does not exist: "no such file"
      turns.append(_call("str_replace", path="src/" + os.path.basename(path), old_str=old,
                         new_str=new))
  return turns + [_call("str_replace", path=path, old_str=old, new_str=new), _call("submit")]


async def _episode(task: Task, chat: ChatFormat, sandbox: str, seed: int, error_rate: float,
                   early_submit_rate: float, config: ScaffoldConfig, verify: bool
                   ) -> Trajectory:
  """One scripted episode, set up as `envs.episode.make_react_episode` does (prompt
  drawn with the episode seed, fresh sandbox with the repository, default tools)."""
  make_sandbox = make_sandbox_factory(sandbox, allow_unsafe=sandbox == "local")
  prompt = task.prompt(np.random.default_rng(seed))
  policy = ScriptedPolicy(chat, scripted_turns(task, random.Random(seed), error_rate,
                                                      early_submit_rate))
  box = await make_sandbox(task)
  try:
    for path, data in load_repo_files(task).items():
      await box.write_file(path, data)
    result = await run_episode(policy, box, prompt, default_tools(task.test_command), chat,
                               dataclasses.replace(config, seed=seed))
    reward, meta = 0.0, {"verified": False}
    if verify and result.termination == "submitted":
      verdict = await verify_tests(task, await workspace_files(box), make_sandbox)
      reward, meta = float(verdict.reward), {"verified": True}
  finally:
    await box.close()
  if result.termination != "submitted":
    raise RuntimeError(f"demo episode of {task.instance_id} ended with {result.termination!r} "
                       f"({result.error or result.messages[-1:]!r:.300})")
  meta.update(messages=result.messages, tools=[t.schema() for t in
                                               default_tools(task.test_command)],
              fix_edit=dict(task.metadata["fix_edit"]))
  return result.to_trajectory(reward, task.instance_id, task.instance_id, metadata=meta)


def demo_trajectories(chat: ChatFormat, n: int, *, level: int = 0, seed: int = 0,
                      start: int = 0, split: Optional[str] = None, error_rate: float = 0.0,
                      early_submit_rate: float = 0.0, sandbox: str = "bwrap",
                      config: ScaffoldConfig = DEMO_SCAFFOLD, verify: bool = False,
                      concurrency: int = 4, environment: str = "") -> list[Trajectory]:
  """Scripted episodes on the taskgen tasks (level, seed, start..start+n-1), in task order.

  Every call's input extends the previous call's input + output (the scaffold never
  re-tokenizes).

  Args:
    chat: the chat format (and tokenizer) the episodes are rendered with.
    n: the number of tasks (one episode each).
    level: the taskgen difficulty level.
    seed: the taskgen seed; also seeds each episode's prompt and mistakes.
    start: the first task's index (with `split`: its position in that split).
    split: a taskgen split ("train" | "eval"), or None for plain generator indices.
    error_rate: probability of an episode with a failed (error-masked) tool call.
    early_submit_rate: probability of an episode that submits without the fix.
    sandbox: one of SANDBOXES.
    config: the scaffold's limits (turns, tokens, timeout).
    verify: reward from the `tests` verifier (a second sandbox runs pytest: ~15x slower).
    concurrency: episodes run at once.
    environment: the environment the sandboxes start from: "" (the backend's own root), a
      preset or a spec file (`envs.task_environments.default_environment`); built (or found
      in the cache) before the first episode.

  Returns:
    The trajectories. metadata: "messages" and "tools" (the transcript as a chat record, see
    `chat_record`), "fix_edit", "verified". reward: the verifier's reward when `verify`, else
    0.0 with verified=False.

  Raises:
    ValueError: an unknown sandbox or environment, or a rate outside [0, 1].
    RuntimeError: an episode did not end with a submit.
  """
  if sandbox not in SANDBOXES:
    raise ValueError(f"sandbox={sandbox!r}: expected one of {SANDBOXES}")
  for name, rate in (("error_rate", error_rate), ("early_submit_rate", early_submit_rate)):
    if not 0.0 <= rate <= 1.0:
      raise ValueError(f"{name}={rate!r}: expected a probability in [0, 1]")
  with tempfile.TemporaryDirectory(prefix="arbor-demo-tasks-") as d:
    tasks = task_environments.with_environments(
        write_tasks(d, n, level, seed, start, split=split),
        default=task_environments.default_environment(environment, "environment"))
    task_environments.build_all(tasks[:1], sandbox)

    async def run_all():
      limit = asyncio.Semaphore(concurrency)

      async def one(i: int, task: Task) -> Trajectory:
        async with limit:
          return await _episode(task, chat, sandbox, seed * 1_000_003 + start + i, error_rate,
                                early_submit_rate, config, verify)
      return await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))
    return list(aio.run(run_all()))


def chat_record(trajectory: Trajectory) -> dict:
  """A demo trajectory as an SFT chat record.

  Rendering the record with the episode's chat format gives the trajectory's tokens exactly.

  Args:
    trajectory: a `demo_trajectories` trajectory (metadata "messages" and "tools").

  Returns:
    {"messages", "tools", "id"}; assistant turns whose call had meta["tool_error"] carry
    "tool_error": true.
  """
  messages, k = [], 0
  for m in trajectory.metadata["messages"]:
    m = {key: v for key, v in m.items() if key != "text"}
    if m["role"] == "assistant":
      m["tool_error"] = bool(trajectory.calls[k].meta.get("tool_error"))
      k += 1
    messages.append(m)
  return {"messages": messages, "tools": trajectory.metadata["tools"],
          "id": trajectory.trajectory_id}


class ByteTokenizer:
  """A stand-in tokenizer: UTF-8 bytes as ids 0..255, then named control tokens.

  It lets the chat formats render text before a real tokenizer has been trained.

  Args:
    control: the control tokens' names (ids from 258 on, after bos and eos).
    bos: the name of id 256.
    eos: the name of id 257.
  """

  def __init__(self, control: Sequence[str], bos: str = "<s>", eos: str = "</s>"):
    self.names = [bos, eos] + [t for t in control if t not in (bos, eos)]
    self.vocab_size = 256 + len(self.names)
    self.bos_id, self.eos_id, self.pad_id = 256, 257, None
    self.special_ids = frozenset(range(256, self.vocab_size))

  def encode(self, text: str) -> list[int]:
    """The UTF-8 bytes of `text` (control-token names are not matched)."""
    return list(text.encode("utf-8"))

  def decode(self, ids: Sequence[int]) -> str:
    """The text of `ids`, control tokens as their names; invalid UTF-8 is replaced."""
    out, run = [], bytearray()
    for i in ids:
      if i >= 256:
        out += [run.decode("utf-8", "replace"), self.names[i - 256]]
        run = bytearray()
      else:
        run.append(i)
    return "".join(out) + run.decode("utf-8", "replace")

  def token_to_id(self, token: str) -> Optional[int]:
    """The id of a control token or a one-byte string, else None."""
    if token in self.names:
      return 256 + self.names.index(token)
    b = token.encode("utf-8")
    return b[0] if len(b) == 1 else None


def demo_corpus(chat_format: str = "chatml", n: int = 64, *, level: int = 0, seed: int = 12345,
                control: Sequence[str] = (), split: Optional[str] = "train") -> list[str]:
  """Tokenizer training text from scripted demo episodes.

  Episodes use the "local" sandbox (the solver runs no code) and half of them carry an error
  turn.

  Args:
    chat_format: the chat format whose control tokens separate the texts.
    n: the number of episodes.
    level: the taskgen difficulty level.
    seed: the taskgen seed.
    control: extra control tokens (never part of a text).
    split: the taskgen split the tasks come from ("train": no held-out program's text, fixed
      lines included, shapes the vocabulary).

  Returns:
    The texts that `chat_format` puts between control tokens (system prompt, tool schemas,
    task statements, tool calls, file contents, tool outputs), one string per run of text.
  """
  tok = ByteTokenizer(list(chat_symbols(chat_format)[0]) + list(control),
                      *BOS_EOS.get(chat_format, ("<s>", "</s>")))
  chat = make_chat(chat_format, tok)
  texts = []
  for t in demo_trajectories(chat, n, level=level, seed=seed, split=split, error_rate=0.5,
                             sandbox="local"):
    last = t.calls[-1]
    ids = list(last.input_ids) + list(last.output_ids)
    run: list[int] = []
    for i in ids + [tok.eos_id]:
      if i in tok.special_ids:
        if run:
          texts.append(tok.decode(run))
        run = []
      else:
        run.append(i)
  return texts
