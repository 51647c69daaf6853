"""Problem statements of synthesized instances: templates built from the failing tests' own
messages, or a teacher model's reports, never showing the fix (`leak_reason` guards both).

"template": the failing tests' names and their failure messages (pytest's `E` lines, or the
last lines of a unittest-style traceback; truncated, any line holding a line of the patch left
out) and the module under test, in three phrasings. "teacher": an OpenAI-compatible chat
completions endpoint is shown the failing tests' output and the buggy function (never the
fix); a reply holding a changed line of the fix, or an identifier found only in the fix, is
rejected and the template is used in its place.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import keyword
import os
import re
import urllib.request
from typing import Mapping, Optional, Sequence

_MESSAGE_LINES = 4    # failure message lines kept per test in a statement
_MESSAGE_WIDTH = 160  # characters kept per message line
_LISTED_TESTS = 5     # failing tests listed in a statement
_MIN_GUARD = 6        # patch lines shorter than this (")", "else:") are not leak evidence



@dataclasses.dataclass(frozen=True)
class Teacher:
  """An OpenAI-compatible chat completions endpoint that writes problem statements.

  Attributes:
    base_url: the API root, e.g. "http://localhost:8000/v1" (POST {base_url}/chat/completions).
    model: the model name sent in the request.
    api_key_env: the environment variable holding the API key (no Authorization header when
      it is unset, as local servers expect).
    temperature: sampling temperature.
    timeout: seconds per request.
  """

  base_url: str
  model: str
  api_key_env: str = "OPENAI_API_KEY"
  temperature: float = 0.7
  timeout: float = 60.0



def failure_messages(output: str, tests: Sequence[str]) -> dict[str, list[str]]:
  """The exception and assertion messages a run printed for each failing test.

  pytest: the `E` lines of the test's section ("___ NAME ___"), else the message of its
  short-summary line ("FAILED ID - MESSAGE"). unittest-style logs (Django's runner, `unittest
  -v`): the unindented lines of the traceback under "FAIL: NAME" / "ERROR: NAME" other than
  its "Traceback" line (the exception and its message).

  Args:
    output: the run's whole output.
    tests: the test ids (pytest node ids, or the names a log parser gives).

  Returns:
    {test id: message lines}; [] for a test the output says nothing about.
  """
  sections: dict[str, list[str]] = {}
  title, pytest_section = None, False
  for line in output.splitlines():
    # A section title is "___ NAME ___" (one "_" a side when NAME is long); a traceback's
    # frames are parted by "_ _ _ _" lines, which are no title.
    m = re.match(r"^_+ (.+?) _+$", line)
    u = re.match(r"^(?:FAIL|ERROR): (.+)$", line)
    if m and m.group(1).strip("_ "):
      title = re.sub(r"^ERROR at (?:setup|teardown|call) of ", "", m.group(1))
      pytest_section = True
      sections.setdefault(title, [])
    elif u:
      title, pytest_section = u.group(1).strip(), False
      sections.setdefault(title, [])
    elif re.match(r"^={3,}", line):
      title = None
    elif title is None:
      continue
    elif pytest_section:
      if line.startswith("E ") and line[1:].strip() not in sections[title]:
        sections[title].append(line[1:].strip())
    elif line and not line[0].isspace() and not re.match(
        r"^(?:-{3,}|Traceback \(most recent call last\):|Ran \d+ tests?)", line):
      if line.strip() not in sections[title]:
        sections[title].append(line.strip())
  summary = dict(re.findall(r"^(?:FAILED|ERROR) (\S+) - (.*)$", output, re.M))
  out = {}
  for test in tests:
    tail = test.split("::", 1)[-1].replace("::", ".")
    lines = [l for l in sections.get(tail if "::" in test else test, []) if l]
    out[test] = lines or ([summary[test]] if test in summary else [])
  return out


def patch_lines(patch: str, context: bool = True) -> list[str]:
  """The stripped code lines of a diff (changed lines, and context lines when `context`)."""
  out = []
  for line in patch.splitlines():
    if line.startswith(("+++", "---", "@@", "diff ", "index ", "\\")):
      continue
    if line[:1] in "+-" or context and line[:1] == " ":
      body = line[1:].strip()
      if len(body) >= _MIN_GUARD:
        out.append(body)
  return out


def _squash(text: str) -> str:
  return re.sub(r"\s+", " ", text).strip()


def leak_reason(statement: str, fix: str, buggy_source: str) -> Optional[str]:
  """Why a problem statement gives the fix away, or None when it does not.

  Args:
    statement: the statement.
    fix: the fix (unified diff, buggy -> original).
    buggy_source: the buggy file's text.

  Returns:
    The reason: the statement holds a changed line of the fix, or an identifier that appears
    in the fix's added lines but nowhere in the buggy file.
  """
  flat = _squash(statement)
  for line in patch_lines(fix, context=False):
    if _squash(line) in flat:
      return f"holds a changed line of the fix: {line[:80]!r}"
  ident = re.compile(r"[A-Za-z_]\w*")
  added = {w for l in fix.splitlines() if l.startswith("+") and not l.startswith("+++")
           for w in ident.findall(l[1:])}
  only_fix = {w for w in added - set(ident.findall(buggy_source))
              if len(w) >= 3 and not keyword.iskeyword(w)}
  words = set(ident.findall(statement))
  if only_fix & words:
    return f"names an identifier only the fix has: {sorted(only_fix & words)[0]!r}"
  return None


def module_name(path: str) -> str:
  """The dotted module of a file ("src/pkg/a.py" -> "pkg.a"); the path when not importable."""
  parts = path.removesuffix(".py").split("/")
  if parts[0] == "src" and len(parts) > 1:
    parts = parts[1:]
  if parts[-1] == "__init__" and len(parts) > 1:
    parts = parts[:-1]
  return ".".join(parts) if all(p.isidentifier() for p in parts) else path


def template_statements(module: str, messages: Mapping[str, Sequence[str]],
                        fix: str) -> list[str]:
  """Three phrasings (expert, short, colloquial) from the failing tests and their messages.

  A message line holding any line of the fix (changed or context, `patch_lines`) is left out.

  Args:
    module: the module under test.
    messages: {failing node id: message lines} (`failure_messages`).
    fix: the fix, only to keep its lines out.

  Returns:
    The statements.
  """
  guard = [_squash(l) for l in patch_lines(fix)]
  clean = {}
  for test, lines in messages.items():
    kept = [l[:_MESSAGE_WIDTH] + ("..." if len(l) > _MESSAGE_WIDTH else "") for l in lines
            if not any(g in _squash(l) for g in guard)]
    clean[test] = kept[:_MESSAGE_LINES]
  tests = sorted(clean)
  listed = []
  for test in tests[:_LISTED_TESTS]:
    body = "".join(f"\n      {l}" for l in clean[test])
    listed.append(f"  - `{test}`" + (f":{body}" if body else ""))
  more = (f"\n  ... and {len(tests) - _LISTED_TESTS} more" if len(tests) > _LISTED_TESTS
          else "")
  expert = (f"Tests of `{module}` fail:\n\n" + "\n".join(listed) + more
            + f"\n\nThe tests are correct. Fix the code of `{module}` so that they pass, "
              "without breaking the other tests.")
  first = tests[0]
  why = f" with `{clean[first][0]}`" if clean[first] else ""
  name = first.rsplit("::", 1)[-1]
  more = len(tests) - 1
  others = f" ({more} more test{'s' if more > 1 else ''} fail{'' if more > 1 else 's'} too)"
  others = others if more else ""
  short = f"`{first}` fails{why}{others}. The bug is in `{module}`; the tests are right."
  casual = (f"hey, {name} started failing{why}{others}. pretty sure something in {module} is "
            "off, can you take a look and fix it? don't touch the tests")
  return [expert, short, casual]


_TEACHER_SYSTEM = (
    "You write bug reports for a Python project, as a user or maintainer would file them on "
    "its issue tracker. Describe the wrong behaviour that the failing tests show (inputs, "
    "expected and actual results). Never say which line is wrong, never propose a fix, and "
    "never include code from the fix. Reply with the report only.")
_TEACHER_STYLES = (
    "Write a precise report, as an experienced maintainer would.",
    "Write a short report: a title line and two or three sentences.",
    "Write a casual, colloquial message from a user who hit the problem.")


def teacher_reply(teacher: Teacher, messages: Sequence[Mapping[str, str]]) -> str:
  """One chat completion: POST {base_url}/chat/completions, choices[0].message.content.

  Args:
    teacher: the endpoint.
    messages: the chat ([{"role", "content"}]).

  Returns:
    The reply's text.

  Raises:
    OSError: the request failed (urllib.error.URLError is one).
    ValueError: the reply is not a chat completion.
  """
  body = json.dumps({"model": teacher.model, "messages": list(messages),
                     "temperature": teacher.temperature}).encode()
  headers = {"Content-Type": "application/json"}
  key = os.environ.get(teacher.api_key_env)
  if key:
    headers["Authorization"] = f"Bearer {key}"
  req = urllib.request.Request(teacher.base_url.rstrip("/") + "/chat/completions", data=body,
                               headers=headers, method="POST")
  with urllib.request.urlopen(req, timeout=teacher.timeout) as resp:
    data = json.loads(resp.read().decode("utf-8"))
  try:
    content = data["choices"][0]["message"]["content"]
  except (KeyError, IndexError, TypeError):
    raise ValueError(f"not a chat completion: {json.dumps(data)[:200]}") from None
  if not isinstance(content, str) or not content.strip():
    raise ValueError("the chat completion's content is empty")
  return content.strip()


def teacher_statements(teacher: Teacher, messages: Mapping[str, Sequence[str]], fix: str,
                       buggy_source: str, function_source: str,
                       styles: Sequence[str] = _TEACHER_STYLES
                       ) -> tuple[list[str], list[str]]:
  """Statements written by a teacher model, each checked by `leak_reason`.

  The teacher sees the failing tests with their messages (lines of the fix left out, as in
  the template) and the buggy function, never the fix.

  Args:
    teacher: the endpoint.
    messages: {failing node id: message lines}.
    fix: the fix (only to check the replies).
    buggy_source: the buggy file's text (identifiers already there are no leak).
    function_source: the buggy function's source ("" when unknown).
    styles: one request per style.

  Returns:
    (accepted statements, reasons the others were rejected).
  """
  guard = [_squash(l) for l in patch_lines(fix)]
  shown = "\n".join(f"{test}\n" + "".join(f"    {l}\n" for l in lines[:_MESSAGE_LINES]
                                          if not any(g in _squash(l) for g in guard))
                    for test, lines in sorted(messages.items())[:_LISTED_TESTS])
  user = f"Failing tests and their messages:\n{shown}"
  if function_source:
    user += f"\nThe function the tests exercise:\n```python\n{function_source}\n```\n"
  accepted, rejected = [], []
  for style in styles:
    try:
      reply = teacher_reply(teacher, [{"role": "system", "content": _TEACHER_SYSTEM},
                                      {"role": "user", "content": f"{user}\n{style}"}])
    except (OSError, ValueError) as e:
      rejected.append(f"request failed: {e}")
      continue
    reason = leak_reason(reply, fix, buggy_source)
    if reason:
      rejected.append(reason)
    else:
      accepted.append(reply)
  return accepted, rejected


def problem_statements(messages: Mapping[str, Sequence[str]], fix: str, path: str,
                       buggy_source: str, lineno: int, teacher: Optional[Teacher] = None
                       ) -> tuple[list[str], dict]:
  """An instance's phrasings: the teacher's accepted ones, else the template's.

  Args:
    messages: {failing node id: message lines} (`failure_messages`).
    fix: the fix (never shown; only to keep its lines out).
    path: the buggy file.
    buggy_source: its text.
    lineno: a line of the buggy function (the teacher is shown that function).
    teacher: the endpoint; None: template statements.

  Returns:
    (statements, {"method": "teacher" | "template", "teacher_rejected": [reasons]}).
  """
  template = template_statements(module_name(path), messages, fix)
  if teacher is None:
    return template, {"method": "template"}
  accepted, rejected = teacher_statements(teacher, messages, fix, buggy_source,
                                          function_source(buggy_source, lineno))
  how = {"method": "teacher" if accepted else "template", "teacher_rejected": rejected}
  return accepted or template, how


def function_source(source: str, lineno: int) -> str:
  """The source of the innermost function (or class) holding line `lineno`; "" when none."""
  try:
    tree = ast.parse(source)
  except SyntaxError:
    return ""
  best = None
  for node in ast.walk(tree):
    if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.lineno <= lineno <= (node.end_lineno or node.lineno)):
      if best is None or node.lineno >= best.lineno:
        best = node
  return (ast.get_source_segment(source, best) or "") if best else ""

