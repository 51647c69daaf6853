"""Applying a model's patch as the swebench harness does: exactly if it can, else with fuzz.

swebench tries `git apply`, then `git apply --3way` and `--reject`, then
`patch --batch --forward --fuzz=5 -p1`; the last one tries fuzz 0 (exact context, as `git apply`)
before more. `apply_fuzzy` follows GNU patch's rules: each hunk is placed at the match nearest
the line its header names (after the lines earlier hunks consumed, later lines first on a tie,
carrying earlier hunks' offsets); a hunk that does not match drops context lines at its start
and end, one more per fuzz level up to FUZZ; a hunk with less context on one side (one at the
start or end of its file) counts the difference as fuzz already spent and is anchored to that
end of the file until the fuzz covers it; the context lines keep the file's text.
A hunk that adds lines only may so lose all its context and is then placed at its line
number, as GNU patch places it.
Changed lines (removed and added) must always match exactly. Nothing here runs a program: the
patch is untrusted text, read by a parser of lines.
"""

from __future__ import annotations

import re
from typing import Mapping, Optional

FUZZ = 5  # swebench's `patch --fuzz=5`
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _split(text: str) -> list[str]:
  """Lines with their "\n" (the last may lack one); only "\n" ends a line, as for patch."""
  parts = text.split("\n")
  return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _path(header: str) -> Optional[str]:
  """The repository path of a "--- " / "+++ " header line (None for /dev/null)."""
  name = header[4:].rstrip("\n").split("\t", 1)[0].strip()
  if name == "/dev/null":
    return None
  name = name[2:] if name.startswith(("a/", "b/")) else name
  parts = name.split("/")
  if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\0" in name:
    raise ValueError(f"patch: {name!r} is not a clean repository-relative path")
  return name


def _hunks(lines: list[str], i: int
           ) -> tuple[list[tuple[int, int, list[tuple[str, str]]]], int]:
  """The hunks from line i: [(old start line, index of its first old line, [(tag, line)])],
  and the index after them."""
  hunks = []
  while i < len(lines) and lines[i].startswith("@@"):
    m = _HUNK.match(lines[i])
    if not m:
      raise ValueError(f"patch line {i + 1}: bad hunk header {lines[i]!r:.80}")
    n_old = 1 if m.group(2) is None else int(m.group(2))
    n_new = 1 if m.group(4) is None else int(m.group(4))
    start = int(m.group(1)) - 1 if n_old else int(m.group(1))  # "-k,0" inserts after line k
    i += 1
    body: list[tuple[str, str]] = []
    old = new = 0
    while (old < n_old or new < n_new) and i < len(lines):
      tag, text = lines[i][:1], lines[i][1:]
      if tag == "\n":  # an empty context line whose space was dropped
        tag, text = " ", "\n"
      if tag not in " -+":
        raise ValueError(f"patch line {i + 1}: unexpected {lines[i]!r:.80} inside a hunk")
      i += 1
      if i < len(lines) and lines[i].startswith("\\"):  # "\ No newline at end of file"
        text = text.removesuffix("\n")
        i += 1
      body.append((tag, text))
      old += tag != "+"
      new += tag != "-"
    if (old, new) != (n_old, n_new):
      raise ValueError("patch: a hunk is truncated")
    hunks.append((int(m.group(1)), start, body))
  return hunks, i


def _matches(text: list[str], start: int, pattern: list[str], prefix: int, suffix: int) -> bool:
  """Whether `pattern`, less `prefix` lines at its start and `suffix` at its end, is in `text`
  where the whole pattern would start at `start`."""
  core = pattern[prefix:len(pattern) - suffix]
  at = start + prefix
  return start >= 0 and at + len(core) <= len(text) and text[at:at + len(core)] == core


def _locate(text: list[str], body: list[tuple[str, str]], guess: int, first_line: int,
            floor: int, fuzz: int) -> Optional[int]:
  """Where the hunk's old lines start in `text` at a fuzz level, or None (GNU patch's rules).

  Args:
    text: the file's lines, earlier hunks applied.
    body: the hunk's (tag, line) pairs.
    guess: the index its header names, moved as earlier hunks moved.
    first_line: the header's old start line (a hunk at line 1 may only match at the start).
    floor: the first index not consumed by earlier hunks.
    fuzz: the fuzz level.
  """
  pattern = [x for t, x in body if t != "+"]
  if not pattern:  # nothing to match: the line the header names
    return min(max(guess, floor), len(text))
  lead = next((k for k, (t, _) in enumerate(body) if t != " "), len(body))
  trail = next((k for k, (t, _) in enumerate(reversed(body)) if t != " "), len(body))
  context = max(lead, trail)
  # The side with less context (a hunk at either end of its file) counts the difference as
  # fuzz already spent; below zero, the hunk is anchored to that end of the file.
  prefix, suffix = fuzz + lead - context, fuzz + trail - context
  if prefix < 0 and first_line <= 1:
    return 0 if floor <= lead and _matches(text, 0, pattern, 0, suffix) else None
  prefix = max(prefix, 0)
  if suffix < 0:
    start = len(text) - len(pattern)
    return start if start >= floor and _matches(text, start, pattern, prefix, 0) else None
  last = len(text) - (len(pattern) - suffix)
  if last < floor:
    return None
  for d in range(max(last - guess, guess - floor, 0) + 1):
    for start in ((guess,) if d == 0 else (guess + d, guess - d)):  # later lines first
      if floor <= start <= last and _matches(text, start, pattern, prefix, suffix):
        return start
  return None


def apply_fuzzy(files: Mapping[str, bytes], patch: str, fuzz: int = FUZZ
                ) -> tuple[dict[str, bytes], int]:
  """`files` with a unified diff applied with up to `fuzz` lines of context ignored per hunk
  end (module docstring).

  Args:
    files: {repository path: content}.
    patch: the diff ("--- a/X" / "+++ b/Y" headers, git's or plain).
    fuzz: most context lines dropped at each end of a hunk.

  Returns:
    (the new files, the largest fuzz a hunk needed).

  Raises:
    ValueError: a malformed or unsafe patch, a hunk that does not apply, a missing source
      file, a created file that exists, or a file that is not UTF-8 text.
  """
  out = dict(files)
  lines = _split(patch)
  used, i = 0, 0
  while i < len(lines):
    if not lines[i].startswith("--- "):
      i += 1
      continue
    if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
      raise ValueError(f"patch line {i + 1}: '---' header without '+++'")
    src, dst = _path(lines[i]), _path(lines[i + 1])
    if src is not None and src not in out:
      raise ValueError(f"patch: {src!r} does not exist")
    if src is None and dst is not None and dst in out:
      raise ValueError(f"patch: creates {dst!r}, which already exists")
    text = [] if src is None else _split(out[src].decode("utf-8"))
    hunks, i = _hunks(lines, i + 2)
    offset = growth = floor = 0  # found offsets, lines added less removed, lines consumed
    for n, (first, start, body) in enumerate(hunks, 1):
      context = max(next((k for k, (t, _) in enumerate(seq) if t != " "), len(body))
                    for seq in (body, body[::-1]))
      for level in range(min(fuzz, context) + 1):
        at = _locate(text, body, start + offset + growth, first, floor, level)
        if at is not None:
          break
      else:
        raise ValueError(f"patch: hunk #{n} (line {first}) of {dst or src!r} does not apply: its "
                         f"removed and context lines are not in the file, even with up to "
                         f"{min(fuzz, context)} context lines ignored at each end")
      used = max(used, level)
      offset = at - start - growth
      # Context lines keep the file's text (fuzz may have ignored them); removed lines go.
      new, k, frozen = [], at, 0
      for tag, x in body:
        if tag == " ":
          if k < len(text):
            new.append(text[k])
          k += 1
        elif tag == "-":
          k += 1
          frozen = len(new)
        else:
          new.append(x)
          frozen = len(new)
      text[at:min(k, len(text))] = new
      growth += sum(t == "+" for t, _ in body) - sum(t == "-" for t, _ in body)
      floor = at + frozen
    # A line that lost its newline ("\ No newline at end of file") gets it back when lines
    # follow it, as patch writes it.
    text = [x if x.endswith("\n") or k == len(text) - 1 else x + "\n" for k, x in enumerate(text)]
    if src is not None and src != dst:
      del out[src]
    if dst is not None:
      out[dst] = "".join(text).encode("utf-8")
  return out, used


def apply_prediction(files: Mapping[str, bytes], patch: str
                     ) -> tuple[dict[str, bytes], str]:
  """A model patch applied as swebench applies it (module docstring).

  Args:
    files: the repository at its base commit.
    patch: the model patch.

  Returns:
    (the patched files, how: "exact" or "fuzz N", N the most context lines a hunk dropped).

  Raises:
    ValueError: it does not apply; the message names the hunk and file.
  """
  try:
    patched, used = apply_fuzzy(files, patch, FUZZ)
  except UnicodeDecodeError as e:
    raise ValueError(f"patch: a file it changes is not UTF-8 text ({e.reason})") from None
  return patched, "exact" if used == 0 else f"fuzz {used}"
