"""Turning candidate edits into checked mutated files (`mutations`)."""

from __future__ import annotations

import ast
import dataclasses
import random
from typing import Optional, Sequence

from envs.mutate.base import (KINDS, Mutation, _Cand, _Fn, _MAX_EDIT_LINES, _SKIP_FUNCTIONS,
                              _Source, _apply, _edit_lines, _functions, _substitute, is_test_file)
from envs.mutate.kinds import _GENERATORS


# ----------------------------------------------------------------------------- checking


def _parse_region(text: str, nested: bool, lead: str, lineno: int) -> Optional[ast.AST]:
  """Parses `text`, one statement starting at line `lineno` after `lead`, in place.

  `nested`: the statement is indented in its file, so it is parsed inside an `if` block.
  """
  prefix = ("\n" * (lineno - 2) + "if 1:\n" + lead) if nested else "\n" * (lineno - 1) + lead
  try:
    tree = ast.parse(prefix + text)
  except SyntaxError:
    return None
  body = tree.body[0].body if nested else tree.body
  return body[0] if len(body) == 1 else None


def _anchor(fn: _Fn, parents: dict, cand: _Cand) -> ast.AST:
  """The smallest statement (or the function) whose AST shows the whole edit."""
  node = cand.target
  if isinstance(node, ast.stmt) and not isinstance(cand.new, list):
    return node
  node = parents.get(id(node))
  while node is not fn.node and not isinstance(node, ast.stmt):
    node = parents[id(node)]
  return node


def _realize(src: _Source, fn: _Fn, parents: dict, cand: _Cand,
             whole: bool = False) -> Optional[str]:
  """The mutated text of `cand`, or None when it does not give exactly its intended AST.

  Only the smallest statement around the edit is parsed again: the text outside it is
  unchanged, so if that statement parses to the intended AST, so does the file.
  """
  anchor = fn.node if whole else _anchor(fn, parents, cand)
  expected = ast.dump(_substitute(anchor, cand.target, cand.new))
  if expected == ast.dump(anchor):
    return None
  if anchor is fn.node:
    first = min([fn.node.lineno] + [d.lineno for d in fn.node.decorator_list])
    start, end = src.starts[first - 1], src.starts[fn.node.end_lineno]
    nested, lead = bool(src.indent(first)), ""
  else:
    start, end = src.span(anchor)
    before = src.text[src.starts[anchor.lineno - 1]:start]
    lead = before if not before.strip() else " " * len(before)
    nested, first = bool(lead), anchor.lineno
  for edits in (cand.edits, cand.fallback):
    if not edits:
      continue
    text = _apply(src.text, edits)
    if text == src.text:
      continue
    stop = max([end] + [e for _, e, _ in edits]) + len(text) - len(src.text)
    got = _parse_region(text[start:stop], nested, lead, first)
    if got is None and anchor is not fn.node:
      # e.g. an `elif` clause, which does not parse alone: check the whole function
      text = _realize(src, fn, parents, dataclasses.replace(cand, edits=edits, fallback=None),
                      whole=True)
      if text is not None:
        return text
      continue
    if got is not None and ast.dump(got) == expected:
      return text
  return None


# ----------------------------------------------------------------------------- public API


def mutations(source: str, path: str, kinds: Sequence[str] = KINDS, *,
              max_per_kind: Optional[int] = None, seed: int = 0) -> list[Mutation]:
  """Candidate bugs for one Python file, each a whole mutated text differing in one place.

  Args:
    source: the file's text.
    path: its path relative to the repository root ("/" separated); test files give [].
    kinds: which kinds of mutation to make (a subset of `KINDS`).
    max_per_kind: keep at most this many candidates of each kind, drawn with `seed`; None
      keeps all.
    seed: seed of that draw.

  Returns:
    Mutations ordered by line, then by kind (in `KINDS` order), then by position in the line;
    no two have the same text. The same arguments always give the same list.

  Raises:
    ValueError: an unknown kind, a negative `max_per_kind`, an empty `path`, or a `source`
      that does not parse.
  """
  if isinstance(kinds, str):
    raise ValueError(f"kinds must be a sequence of kind names, got the string {kinds!r}")
  unknown = [k for k in kinds if k not in KINDS]
  if unknown:
    raise ValueError(f"kinds: unknown kind(s) {unknown!r}; known: {KINDS}")
  if max_per_kind is not None and max_per_kind < 0:
    raise ValueError(f"max_per_kind must be >= 0 or None, got {max_per_kind!r}")
  if not isinstance(path, str) or not path:
    raise ValueError(f"path must be a non-empty relative path, got {path!r}")
  if is_test_file(path):
    return []
  try:
    tree = ast.parse(source)
  except SyntaxError as e:
    raise ValueError(f"source of {path!r} does not parse: {e}") from e
  src = _Source(source)
  found = []   # (lineno, kind index, serial, Mutation)
  seen = {source}
  for fn in _functions(tree):
    if fn.node.name in _SKIP_FUNCTIONS:
      continue
    parents = {id(c): n for n in ast.walk(fn.node) for c in ast.iter_child_nodes(n)}
    for kind in KINDS:
      if kind not in kinds:
        continue
      for cand in _GENERATORS[kind](src, fn):
        if cand is None or _edit_lines(source, cand.edits) > _MAX_EDIT_LINES:
          continue
        text = _realize(src, fn, parents, cand)
        if text is None or text in seen:
          continue
        seen.add(text)
        found.append((cand.lineno, KINDS.index(kind), len(found),
                      Mutation(kind, path, fn.qualname, cand.lineno, cand.description, text)))
  if max_per_kind is not None:
    keep = set()
    for kind in kinds:
      serials = [f[2] for f in found if f[3].kind == kind]
      rng = random.Random(f"{seed}:{kind}")
      keep.update(rng.sample(serials, min(max_per_kind, len(serials))))
    found = [f for f in found if f[2] in keep]
  return [f[3] for f in sorted(found, key=lambda f: f[:3])]
