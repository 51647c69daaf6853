"""Bug injection by program transformation: small, plausible bugs planted in Python source.

Given a file's text, `mutations` returns candidate bugs, each a complete mutated file that
differs from the original in one small place inside one function body. Only the source segment
of the changed node is rewritten, so comments and formatting elsewhere stay byte-identical and
the patch is a one- or few-line diff. Nothing is executed: the module only writes text. Every
candidate is checked by parsing: the smallest statement around the edit must parse to exactly
the intended AST (so operator precedence or indentation cannot silently change the meaning;
an edited node is parenthesised where precedence needs it), and that AST must differ from the
original one (no no-op mutations such as swapping identical arguments).

`commit_reverts` turns one commit of a git repository into several tasks: for each module-level
function or method whose code (docstring aside) the commit changed, the file at the commit
with only that function put back to its parent's version.

Kinds (`KINDS`):
  operator        `+` <-> `-`, `*` <-> `//`, `&` <-> `|`, `^` -> `|` (binary and augmented
                  assignments; string concatenation and list repetition are left alone),
                  `and` <-> `or`, `not x` -> `x`.
  comparison      `<` <-> `<=`, `>` <-> `>=`, `==` <-> `!=`, `in` <-> `not in`, `is` <-> `is not`.
  off_by_one      `range` start/stop +-1, slice bounds +-1, integer index constants +-1,
                  `len(x) - 1` <-> `len(x)`.
  drop_condition  an `if` guard removed keeping its body (bodies of at most 4 lines that do not
                  end in a jump); a check or filter removed whole (an `if` whose body ends in
                  `raise`, `continue` or `break`); one operand of an `and`/`or` in an
                  `if`/`while`/conditional-expression/comprehension condition removed; the
                  `else` block or one `elif` branch of an `if` removed.
  early_return    (a) a guard's `return` dropped: an `if` whose body ends in `return` and that
                  is followed by more code loses that `return` (the whole `if` when the return
                  is its only statement); (b) a returned value replaced by `None` in a function
                  with at least two value-returning `return` statements.
  swap_arguments  two adjacent positional arguments of a call swapped (not identical
                  expressions, not a string literal with a non-string; `min`/`max` are
                  symmetric and `print` only formats, so they are skipped).
  wrong_variable  a loaded local name replaced by another local of the same function of the
                  same plausible type that is certainly bound at that point. Types come from
                  annotations (`x: int`), literal assignments (`x = 0`, `x = []`, parameter
                  defaults) and loop targets (`for i in range(...)` is an `int`; two loop
                  variables over the same iterable expression share a type); a name bound with
                  two different types, or ever bound any other way, has no type. "Certainly
                  bound" means a parameter, a name assigned by an earlier statement of the same
                  or an enclosing block, or the target of an enclosing `for` loop.

No candidate removes or rewrites more than 8 lines. Never mutated: test files (`is_test_file`),
module- and class-level code, decorators, default values, annotations, docstrings, f-strings,
`assert` statements, and `__repr__`/`__str__`.

Example:
    from envs.mutate import mutations
    text = open("pkg/stats.py").read()
    for m in mutations(text, "pkg/stats.py", kinds=("comparison",), max_per_kind=3, seed=1):
      print(m.description)
      print(m.diff(text))

    python -m envs.mutate pkg/stats.py --kinds comparison off_by_one --max-per-kind 3 --diffs
    python -m envs.mutate --repo DIR --commit HEAD           # commit_reverts
"""

from __future__ import annotations

import argparse
import ast
import collections
import copy
import dataclasses
import json
import os
import random
import re
import sys
from typing import Iterable, Iterator, Optional, Sequence

from envs import safe_git
from envs.tasks import make_patch

KINDS = ("operator", "comparison", "off_by_one", "drop_condition", "early_return",
         "swap_arguments", "wrong_variable")
REVERT = "revert"

_SKIP_FUNCTIONS = frozenset({"__repr__", "__str__"})
_MAX_KEPT_LINES = 4   # an `if` guard is removed keeping its body only for bodies this short
_MAX_EDIT_LINES = 8   # no candidate removes or rewrites more lines than this
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_BUILTIN_TYPES = frozenset({"int", "float", "complex", "str", "bytes", "bool", "list", "dict",
                            "set", "frozenset", "tuple"})
_ATOMS = (ast.Name, ast.Constant, ast.Call, ast.Attribute, ast.Subscript, ast.List, ast.Tuple,
          ast.Dict, ast.Set)

# Binary operator -> (token in the source, replacement token).
_BINOPS = {ast.Add: ("+", "-"), ast.Sub: ("-", "+"), ast.Mult: ("*", "//"),
           ast.FloorDiv: ("//", "*"), ast.BitAnd: ("&", "|"), ast.BitOr: ("|", "&"),
           ast.BitXor: ("^", "|")}
# Binary operator class -> the class of its replacement (the intended AST of augmented assignments).
_BINOPS_NEW = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult,
               ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd, ast.BitXor: ast.BitOr}


# Comparison operator -> (regex of its token, the token, replacement token).
_CMPOPS = {ast.Lt: (r"<", "<", "<="), ast.LtE: (r"<=", "<=", "<"), ast.Gt: (r">", ">", ">="),
           ast.GtE: (r">=", ">=", ">"), ast.Eq: (r"==", "==", "!="), ast.NotEq: (r"!=", "!=", "=="),
           ast.In: (r"\bin\b", "in", "not in"), ast.NotIn: (r"\bnot\s+in\b", "not in", "in"),
           ast.Is: (r"\bis\b", "is", "is not"), ast.IsNot: (r"\bis\s+not\b", "is not", "is")}


@dataclasses.dataclass(frozen=True)
class Mutation:
  """One candidate bug: a whole mutated file.

  Attributes:
    kind: one of `KINDS`, or "revert" for `commit_reverts`.
    path: file path relative to the repository root, "/" separated.
    function: qualified name of the enclosing function ("Class.method",
      "outer.<locals>.inner").
    lineno: first line (1-based) of the changed node in the original text.
    description: short human text, e.g. "`<` -> `<=` in `if lo < hi:`".
    source: the whole mutated file text.
  """

  kind: str
  path: str
  function: str
  lineno: int
  description: str
  source: str

  def diff(self, original: str) -> str:
    """Returns the unified diff (git-style a/ b/ headers) from `original` to this mutation."""
    return make_patch({self.path: original.encode("utf-8")},
                      {self.path: self.source.encode("utf-8")})


def is_test_file(path: str) -> bool:
  """Whether `path` is a test file: test_*.py, *_test.py, conftest.py, or under tests/ or test/.

  Args:
    path: file path relative to the repository root ("/" or "\\" separated).
  """
  parts = path.replace("\\", "/").split("/")
  name = parts[-1]
  return (name == "conftest.py" or (name.startswith("test_") and name.endswith(".py"))
          or name.endswith("_test.py") or any(p in ("tests", "test") for p in parts[:-1]))


# ----------------------------------------------------------------------------- source text


class _Source:
  """A file's text with conversions from ast positions (UTF-8 byte columns) to str offsets."""

  def __init__(self, text: str):
    self.text = text
    self.lines = re.findall(r"[^\n]*\n|[^\n]+\Z", text)
    self._encoded = [line.encode("utf-8") for line in self.lines]
    self.starts = [0]
    for line in self.lines:
      self.starts.append(self.starts[-1] + len(line))

  def offset(self, lineno: int, col: int) -> int:
    return self.starts[lineno - 1] + len(self._encoded[lineno - 1][:col].decode("utf-8"))

  def span(self, node: ast.AST) -> tuple[int, int]:
    return (self.offset(node.lineno, node.col_offset),
            self.offset(node.end_lineno, node.end_col_offset))

  def seg(self, node: ast.AST) -> str:
    start, end = self.span(node)
    return self.text[start:end]

  def line(self, lineno: int) -> str:
    return self.lines[lineno - 1] if 0 < lineno <= len(self.lines) else ""

  def indent(self, lineno: int) -> str:
    line = self.line(lineno)
    return line[:len(line) - len(line.lstrip(" \t"))]

  def lines_span(self, first: int, last: int) -> tuple[int, int]:
    """Offsets of whole lines first..last (inclusive, newline included)."""
    return self.starts[first - 1], self.starts[last]

  def owns_lines(self, stmt: ast.stmt) -> bool:
    """Whether `stmt` alone fills its lines (nothing before it, at most a comment after)."""
    start, end = self.span(stmt)
    before = self.text[self.starts[stmt.lineno - 1]:start]
    after = self.text[end:self.starts[stmt.end_lineno]]
    return not before.strip() and (not after.strip() or after.strip().startswith("#"))


def _short(text: str, limit: int = 60) -> str:
  text = " ".join(text.split())
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _apply(text: str, edits: Sequence[tuple[int, int, str]]) -> str:
  for start, end, new in sorted(edits, reverse=True):
    text = text[:start] + new + text[end:]
  return text


def _edit_lines(text: str, edits: Sequence[tuple[int, int, str]]) -> int:
  """How many lines `edits` remove or rewrite in `text` (the size of the diff's `-` side)."""
  total = 0
  for start, end, new in edits:
    # whole lines around the edit, before and after
    lo = text.rfind("\n", 0, start) + 1
    hi = text.find("\n", end)
    hi = len(text) if hi < 0 else hi
    old_lines = text[lo:hi].split("\n")
    new_lines = (text[lo:start] + new + text[end:hi]).split("\n")
    while old_lines and new_lines and old_lines[0] == new_lines[0]:
      old_lines.pop(0), new_lines.pop(0)
    while old_lines and new_lines and old_lines[-1] == new_lines[-1]:
      old_lines.pop(), new_lines.pop()
    total += max(len(old_lines), len(new_lines))
  return total


def _parse_expr(text: str) -> Optional[ast.expr]:
  try:
    return ast.parse("(" + text + ")", mode="eval").body
  except SyntaxError:
    return None


# ----------------------------------------------------------------------------- functions


@dataclasses.dataclass
class _Fn:
  qualname: str
  node: ast.AST           # FunctionDef | AsyncFunctionDef
  body: list              # statements, docstring left out


def _functions(tree: ast.AST) -> list[_Fn]:
  """Every function and method, nested ones included, with Python-style qualified names."""
  out = []

  def visit(node: ast.AST, prefix: str) -> None:
    for child in ast.iter_child_nodes(node):
      if isinstance(child, ast.ClassDef):
        visit(child, f"{prefix}{child.name}.")
      elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
        qual = prefix + child.name
        body = child.body
        if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
          body = body[1:]
        out.append(_Fn(qual, child, body))
        visit(child, f"{qual}.<locals>.")
      elif isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)):
        visit(child, prefix)

  visit(tree, "")
  return out


def _nodes(stmts: Iterable[ast.AST]) -> Iterator[ast.AST]:
  """All nodes under `stmts` that belong to the function itself, in source order.

  Nested functions and classes, f-strings, annotations and asserts are not entered.
  """
  stack = list(reversed(list(stmts)))
  while stack:
    node = stack.pop()
    if isinstance(node, (_DEFS, ast.JoinedStr, ast.Assert)):
      continue
    yield node
    children = []
    for name, value in ast.iter_fields(node):
      if isinstance(node, ast.AnnAssign) and name == "annotation":
        continue
      for child in (value if isinstance(value, list) else [value]):
        if isinstance(child, ast.AST):
          children.append(child)
    stack.extend(reversed(children))


def _blocks(stmts: list) -> Iterator[tuple[list, bool]]:
  """Statement lists of a function body, each with whether code may run after the block."""

  def visit(block: list, after: bool) -> Iterator[tuple[list, bool]]:
    yield block, after
    for i, stmt in enumerate(block):
      if isinstance(stmt, _DEFS):
        continue
      follows = after or i < len(block) - 1
      loop = isinstance(stmt, (ast.For, ast.AsyncFor, ast.While))
      for name in ("body", "orelse", "finalbody"):
        inner = getattr(stmt, name, None)
        if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
          yield from visit(inner, follows or (loop and name == "body"))
      for handler in getattr(stmt, "handlers", []):
        yield from visit(handler.body, follows)
      for case in getattr(stmt, "cases", []):
        yield from visit(case.body, follows)

  if stmts:
    yield from visit(stmts, False)


def _substitute(node, target: ast.AST, new):
  """A copy of `node` with `target` replaced by `new` (a node, or a list spliced into a list)."""
  if node is target:
    return new
  if not isinstance(node, ast.AST):
    return node
  fields = {}
  for name, value in ast.iter_fields(node):
    if isinstance(value, list):
      items = []
      for item in value:
        item = _substitute(item, target, new)
        items.extend(item if isinstance(item, list) else [item])
      fields[name] = items
    else:
      fields[name] = _substitute(value, target, new)
  return type(node)(**fields)


# ----------------------------------------------------------------------------- candidates


@dataclasses.dataclass
class _Cand:
  """A proposed edit: text replacements plus the AST it must produce."""

  kind: str
  lineno: int
  description: str
  edits: list             # [(start, end, new text)], str offsets in the original
  target: ast.AST         # node replaced in the function's AST ...
  new: object             # ... by this node or list of statements
  fallback: Optional[list] = None  # edits to try when `edits` parse to another AST


def _expr_cand(src: _Source, kind: str, node: ast.AST, text: str, description: str,
               parens: bool = True) -> Optional[_Cand]:
  """Replace expression `node` by `text`; `(text)` is tried when precedence requires it."""
  new = _parse_expr(text)
  if new is None:
    return None
  start, end = src.span(node)
  return _Cand(kind, node.lineno, description, [(start, end, text)], node, new,
               [(start, end, "(" + text + ")")] if parens else None)


def _token_swap(src: _Source, node: ast.AST, pairs: Sequence[tuple[ast.AST, ast.AST]],
                pattern: str, new_token: str) -> Optional[str]:
  """`node`'s text with the operator token between each (left, right) pair replaced."""
  base, _ = src.span(node)
  text = src.seg(node)
  edits = []
  for left, right in pairs:
    lo, hi = src.span(left)[1] - base, src.span(right)[0] - base
    match = re.search(pattern, text[lo:hi])
    if match is None:
      return None
    edits.append((lo + match.start(), lo + match.end(), new_token))
  return _apply(text, edits)


def _where(src: _Source, node: ast.AST) -> str:
  return _short(src.line(node.lineno), 80)


def _is_str(node: ast.AST) -> bool:
  return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant)
                                             and isinstance(node.value, (str, bytes)))


def _int_value(node: ast.AST) -> Optional[int]:
  if isinstance(node, ast.Constant) and type(node.value) is int:
    return node.value
  if (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
      and isinstance(node.operand, ast.Constant) and type(node.operand.value) is int):
    return -node.operand.value
  return None


def _operator(src: _Source, fn: _Fn) -> Iterator[_Cand]:
  for node in _nodes(fn.body):
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
      old, new = _BINOPS[type(node.op)]
      if isinstance(node.op, (ast.Add, ast.Sub)) and (_is_str(node.left) or _is_str(node.right)
                                                      or _int_value(node.right) == 0):
        continue  # string concatenation, or x + 0 == x - 0
      if isinstance(node.op, ast.Mult) and any(_is_str(x) or isinstance(x, (ast.List, ast.Tuple))
                                               for x in (node.left, node.right)):
        continue  # sequence repetition
      text = _token_swap(src, node, [(node.left, node.right)], re.escape(old), new)
      if text is not None:
        yield _expr_cand(src, "operator", node, text,
                         f"`{old}` -> `{new}` in `{_where(src, node)}`")
    elif isinstance(node, ast.AugAssign) and type(node.op) in _BINOPS:
      old, new = _BINOPS[type(node.op)]
      if isinstance(node.op, (ast.Add, ast.Sub)) and (_is_str(node.value)
                                                      or _int_value(node.value) == 0):
        continue
      base, _ = src.span(node)
      lo, hi = src.span(node.target)[1] - base, src.span(node.value)[0] - base
      text = src.seg(node)
      match = re.search(re.escape(old + "="), text[lo:hi])
      if match is None:
        continue
      start, end = base + lo + match.start(), base + lo + match.end()
      yield _Cand("operator", node.lineno, f"`{old}=` -> `{new}=` in `{_where(src, node)}`",
                  [(start, end, new + "=")], node,
                  ast.AugAssign(node.target, _BINOPS_NEW[type(node.op)](), node.value))
    elif isinstance(node, ast.BoolOp):
      old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
      pairs = list(zip(node.values, node.values[1:]))
      text = _token_swap(src, node, pairs, rf"\b{old}\b", new)
      if text is not None:
        yield _expr_cand(src, "operator", node, text,
                         f"`{old}` -> `{new}` in `{_where(src, node)}`")
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
      yield _expr_cand(src, "operator", node, src.seg(node.operand),
                       f"`not` dropped in `{_where(src, node)}`")


def _comparison(src: _Source, fn: _Fn) -> Iterator[_Cand]:
  for node in _nodes(fn.body):
    if not isinstance(node, ast.Compare):
      continue
    operands = [node.left] + node.comparators
    for i, op in enumerate(node.ops):
      pattern, old, new = _CMPOPS[type(op)]
      text = _token_swap(src, node, [(operands[i], operands[i + 1])], pattern, new)
      if text is not None:
        yield _expr_cand(src, "comparison", node, text,
                         f"`{old}` -> `{new}` in `{_where(src, node)}`", parens=False)


def _shift(src: _Source, node: ast.AST, delta: int) -> str:
  """Source text of `node` plus `delta` (folded into an integer constant where there is one)."""
  value = _int_value(node)
  if value is not None:
    return str(value + delta)
  if (isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub))
      and _int_value(node.right) is not None and _int_value(node.right) >= 0):
    k = _int_value(node.right) * (1 if isinstance(node.op, ast.Add) else -1) + delta
    left = src.seg(node.left)
    return left if k == 0 else f"{left} {'+' if k > 0 else '-'} {abs(k)}"
  text = src.seg(node)
  if not isinstance(node, _ATOMS):
    text = f"({text})"
  return f"{text} {'+' if delta > 0 else '-'} 1"


def _off_by_one(src: _Source, fn: _Fn) -> Iterator[_Cand]:
  nodes = list(_nodes(fn.body))
  len_minus_one = set()
  for node in nodes:
    if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and _is_len(node.left)
        and _int_value(node.right) == 1):
      len_minus_one.add(id(node.left))
      yield _expr_cand(src, "off_by_one", node, src.seg(node.left),
                       f"`{_short(src.seg(node))}` -> `{_short(src.seg(node.left))}` in "
                       f"`{_where(src, node)}`")
  for node in nodes:
    bounds = []
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range"
        and 1 <= len(node.args) <= 3 and not node.keywords
        and not any(isinstance(a, ast.Starred) for a in node.args)):
      bounds = node.args[:2]
    elif isinstance(node, ast.Slice):
      bounds = [b for b in (node.lower, node.upper) if b is not None]
    elif isinstance(node, ast.Subscript) and _int_value(node.slice) is not None:
      bounds = [node.slice]
    elif _is_len(node) and id(node) not in len_minus_one:
      yield _expr_cand(src, "off_by_one", node, src.seg(node) + " - 1",
                       f"`{_short(src.seg(node))}` -> `{_short(src.seg(node))} - 1` in "
                       f"`{_where(src, node)}`")
    for bound in bounds:
      for delta in (1, -1):
        text = _shift(src, bound, delta)
        yield _expr_cand(src, "off_by_one", bound, text,
                         f"`{_short(src.seg(bound))}` -> `{_short(text)}` in "
                         f"`{_where(src, bound)}`")


def _is_len(node: ast.AST) -> bool:
  return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len"
          and len(node.args) == 1 and not node.keywords)


def _is_elif(src: _Source, node: ast.AST) -> bool:
  return isinstance(node, ast.If) and src.line(node.lineno).lstrip().startswith("elif")


def _drop_condition(src: _Source, fn: _Fn) -> Iterator[_Cand]:
  for node in _nodes(fn.body):
    tests = []
    if isinstance(node, (ast.If, ast.While, ast.IfExp)):
      tests = [node.test]
    elif isinstance(node, ast.comprehension):
      tests = node.ifs
    for test in tests:
      for sub in _nodes([test]):
        if isinstance(sub, ast.BoolOp):
          word = " and " if isinstance(sub.op, ast.And) else " or "
          for i, value in enumerate(sub.values):
            rest = [v for j, v in enumerate(sub.values) if j != i]
            text = word.join(src.seg(v) if isinstance(v, _ATOMS + (ast.Compare, ast.UnaryOp,
                                                                    ast.BinOp))
                             else f"({src.seg(v)})" for v in rest)
            yield _expr_cand(src, "drop_condition", sub, text,
                             f"`{_short(src.seg(value))}` removed from `{_where(src, sub)}`")
    if not isinstance(node, ast.If) or not src.owns_lines(node):
      continue
    header = src.line(node.lineno).strip()
    exit_ = node.body[-1]
    if node.orelse or _is_elif(src, node):
      pass
    elif isinstance(exit_, (ast.Raise, ast.Continue, ast.Break)):
      # a check or a filter: the whole statement goes
      start, end = src.lines_span(node.lineno, node.end_lineno)
      yield _Cand("drop_condition", node.lineno,
                  f"check `{_short(header)}` (`{_short(src.seg(exit_), 40)}`) removed",
                  [(start, end, "")], node, [])
    elif (not isinstance(exit_, ast.Return) and node.body[0].lineno > node.test.end_lineno
          and node.end_lineno - node.body[0].lineno < _MAX_KEPT_LINES):
      # the guard goes, its body moves out one level
      outer, inner = src.indent(node.lineno), src.indent(node.body[0].lineno)
      if inner.startswith(outer) and len(inner) > len(outer):
        lines = [outer + line[len(inner):] if line.startswith(inner) else line
                 for line in src.lines[node.body[0].lineno - 1:node.end_lineno]]
        start, end = src.lines_span(node.lineno, node.end_lineno)
        yield _Cand("drop_condition", node.lineno, f"guard `{_short(header)}` removed (body kept)",
                    [(start, end, "".join(lines))], node, node.body)
    if node.orelse:
      last = node.body[-1].end_lineno
      branch = node.orelse[0]
      if len(node.orelse) == 1 and _is_elif(src, branch):
        stop = branch.body[-1].end_lineno if branch.orelse else branch.end_lineno
        start, end = src.lines_span(branch.lineno, stop)
        new = copy.copy(node)
        new.orelse = branch.orelse
        yield _Cand("drop_condition", branch.lineno,
                    f"branch `{_short(src.line(branch.lineno).strip())}` removed",
                    [(start, end, "")], node, new)
      else:
        keyword = [n for n in range(last + 1, branch.lineno)
                   if src.line(n).strip().startswith("else")]
        if keyword:
          start, end = src.lines_span(last + 1, node.orelse[-1].end_lineno)
          new = copy.copy(node)
          new.orelse = []
          yield _Cand("drop_condition", keyword[0], f"`else` branch of `{_short(header)}` removed",
                      [(start, end, "")], node, new)


def _returns(fn: _Fn) -> list[ast.Return]:
  return [n for n in _nodes(fn.body) if isinstance(n, ast.Return)]


def _early_return(src: _Source, fn: _Fn) -> Iterator[_Cand]:
  for block, after in _blocks(fn.body):
    for i, stmt in enumerate(block):
      if not (isinstance(stmt, ast.If) and not stmt.orelse and isinstance(stmt.body[-1], ast.Return)
              and (after or i < len(block) - 1)):
        continue
      ret = stmt.body[-1]
      gone = stmt if len(stmt.body) == 1 else ret
      if src.owns_lines(gone) and not _is_elif(src, gone):
        start, end = src.lines_span(gone.lineno, gone.end_lineno)
        header, value = _short(src.line(stmt.lineno).strip()), _short(src.seg(ret))
        what = (f"guard `{header}` (`{value}`) removed" if gone is stmt
                else f"`{value}` removed from `{header}`")
        yield _Cand("early_return", gone.lineno, what, [(start, end, "")], gone, [])
  valued = [r for r in _returns(fn) if r.value is not None
            and not (isinstance(r.value, ast.Constant) and r.value.value is None)]
  if len(valued) >= 2:
    for ret in valued:
      yield _expr_cand(src, "early_return", ret.value, "None",
                       f"`{_short(src.seg(ret))}` -> `return None`", parens=False)


def _swap_arguments(src: _Source, fn: _Fn) -> Iterator[_Cand]:
  for node in _nodes(fn.body):
    if not isinstance(node, ast.Call) or (isinstance(node.func, ast.Name)
                                          and node.func.id in ("min", "max", "print")):
      continue
    for a, b in zip(node.args, node.args[1:]):
      if isinstance(a, ast.Starred) or isinstance(b, ast.Starred) or ast.dump(a) == ast.dump(b):
        continue
      if _is_str(a) != _is_str(b) or (isinstance(a, ast.Constant) and isinstance(b, ast.Constant)
                                      and type(a.value) is not type(b.value)):
        continue  # a type error at once (or garbled text), not a plausible bug
      base, _ = src.span(node)
      text = src.seg(node)
      (a0, a1), (b0, b1) = src.span(a), src.span(b)
      text = _apply(text, [(a0 - base, a1 - base, src.seg(b)), (b0 - base, b1 - base, src.seg(a))])
      yield _expr_cand(src, "swap_arguments", node, text,
                       f"arguments `{_short(src.seg(a), 30)}` and `{_short(src.seg(b), 30)}` "
                       f"swapped in `{_where(src, node)}`", parens=False)


def _literal_type(node: Optional[ast.AST]) -> Optional[str]:
  if isinstance(node, ast.Constant) and node.value is not None and node.value is not Ellipsis:
    return type(node.value).__name__
  if _int_value(node) is not None:
    return "int"
  kinds = {ast.List: "list", ast.ListComp: "list", ast.Dict: "dict", ast.DictComp: "dict",
           ast.Set: "set", ast.SetComp: "set", ast.Tuple: "tuple", ast.JoinedStr: "str"}
  return kinds.get(type(node))


def _annotation_type(node: Optional[ast.AST]) -> Optional[str]:
  if node is None:
    return None
  if isinstance(node, ast.Name) and node.id in _BUILTIN_TYPES:
    return node.id
  return "annotation:" + ast.dump(node)


def _loop_type(node: ast.For) -> str:
  it = node.iter
  if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range":
    return "int"
  return "element:" + ast.dump(it)


def _local_types(fn: _Fn) -> dict[str, str]:
  """{local name: plausible type} for the locals of `fn` bound only in recognisable ways."""
  types = collections.defaultdict(set)
  args = fn.node.args
  positional = args.posonlyargs + args.args
  defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
  pairs = list(zip(positional, defaults)) + list(zip(args.kwonlyargs, args.kw_defaults))
  for arg, default in pairs:
    types[arg.arg].add(_annotation_type(arg.annotation) or _literal_type(default))
  for arg in (args.vararg, args.kwarg):
    if arg is not None:
      types[arg.arg].add(None)
  typed = set()
  for node in _nodes(fn.body):
    if (isinstance(node, ast.Assign) and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)):
      types[node.targets[0].id].add(_literal_type(node.value))
      typed.add(id(node.targets[0]))
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
      types[node.target.id].add(_annotation_type(node.annotation))
      typed.add(id(node.target))
    elif isinstance(node, (ast.For, ast.AsyncFor)) and isinstance(node.target, ast.Name):
      types[node.target.id].add(_loop_type(node))
      typed.add(id(node.target))
    elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
      typed.add(id(node.target))  # keeps the type of the earlier binding
    elif (isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load)
          and id(node) not in typed):
      types[node.id].add(None)
    elif isinstance(node, (ast.Global, ast.Nonlocal)):
      for name in node.names:
        types[name].add(None)
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      for alias in node.names:
        types[(alias.asname or alias.name).split(".")[0]].add(None)
    elif isinstance(node, ast.ExceptHandler) and node.name:
      types[node.name].add(None)
  for node in ast.walk(fn.node):  # names bound by nested definitions, walrus, match patterns
    if isinstance(node, _DEFS) and node is not fn.node:
      types[node.name].add(None)
    elif isinstance(node, ast.NamedExpr):
      types[node.target.id].add(None)
    elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
      types[node.name].add(None)
    elif isinstance(node, ast.MatchMapping) and node.rest:
      types[node.rest].add(None)
  return {name: next(iter(t)) for name, t in types.items() if len(t) == 1 and None not in t}


def _loads(nodes: Iterable[ast.AST]) -> Iterator[ast.Name]:
  """Loaded names evaluated directly in `nodes` (not in lambdas, comprehensions or callees)."""
  stack = list(reversed(list(nodes)))
  while stack:
    node = stack.pop()
    if isinstance(node, (_DEFS, ast.JoinedStr, ast.Assert, ast.Lambda) + _COMPREHENSIONS):
      continue
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
      yield node
    children = []
    for name, value in ast.iter_fields(node):
      if ((isinstance(node, ast.AnnAssign) and name == "annotation")
          or (isinstance(node, ast.Call) and name == "func" and isinstance(value, ast.Name))):
        continue
      children.extend(c for c in (value if isinstance(value, list) else [value])
                      if isinstance(c, ast.AST))
    stack.extend(reversed(children))


def _wrong_variable(src: _Source, fn: _Fn) -> Iterator[_Cand]:
  types = _local_types(fn)
  args = fn.node.args
  params = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
  params |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
  found = []

  def visit(block: list, bound: frozenset) -> None:
    for stmt in block:
      if isinstance(stmt, _DEFS):
        continue
      if isinstance(stmt, (ast.If, ast.While)):
        found.extend((n, bound) for n in _loads([stmt.test]))
        visit(stmt.body, bound)
        visit(stmt.orelse, bound)
      elif isinstance(stmt, (ast.For, ast.AsyncFor)):
        found.extend((n, bound) for n in _loads([stmt.iter]))
        target = {stmt.target.id} if isinstance(stmt.target, ast.Name) else set()
        visit(stmt.body, bound | target)
        visit(stmt.orelse, bound)
      elif isinstance(stmt, (ast.With, ast.AsyncWith)):
        found.extend((n, bound) for n in _loads([i.context_expr for i in stmt.items]))
        visit(stmt.body, bound)
      elif isinstance(stmt, (ast.Try, getattr(ast, "TryStar", ast.Try))):
        for inner in (stmt.body, stmt.orelse, stmt.finalbody):
          visit(inner, bound)
        for handler in stmt.handlers:
          visit(handler.body, bound)
      elif isinstance(stmt, ast.Match):
        found.extend((n, bound) for n in _loads([stmt.subject]))
        for case in stmt.cases:
          visit(case.body, bound)
      else:
        found.extend((n, bound) for n in _loads([stmt]))
        targets = getattr(stmt, "targets", None) or [getattr(stmt, "target", None)]
        if not (isinstance(stmt, ast.AnnAssign) and stmt.value is None):
          bound = bound | {t.id for t in targets if isinstance(t, ast.Name)}

  visit(fn.body, frozenset(params))
  for name, bound in found:
    kind = types.get(name.id)
    if kind is None:
      continue
    for other in sorted(n for n in bound if n != name.id and types.get(n) == kind):
      yield _expr_cand(src, "wrong_variable", name, other,
                       f"`{name.id}` -> `{other}` in `{_where(src, name)}`", parens=False)


_GENERATORS = {"operator": _operator, "comparison": _comparison, "off_by_one": _off_by_one,
               "drop_condition": _drop_condition, "early_return": _early_return,
               "swap_arguments": _swap_arguments, "wrong_variable": _wrong_variable}


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


def _top_functions(tree: ast.AST) -> dict[tuple[str, int], ast.AST]:
  """{(qualified name, occurrence): node} of module-level functions and methods (not nested)."""
  out, counts = {}, collections.Counter()
  for fn in _functions(tree):
    if "<locals>" in fn.qualname:
      continue
    out[(fn.qualname, counts[fn.qualname])] = fn.node
    counts[fn.qualname] += 1
  return out


def _without_docstring(node: ast.AST) -> str:
  node = copy.copy(node)
  body = node.body
  if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
      and isinstance(body[0].value.value, str)):
    node.body = body[1:]
  return ast.dump(node)


def commit_reverts(repo_dir: str, commit: str = "HEAD",
                   paths: Optional[Iterable[str]] = None) -> list[Mutation]:
  """One task per function a commit changed: that function put back to the parent's version.

  For each module-level function or method (nested functions belong to their enclosing one)
  whose code (docstring aside) `commit` changed in a modified, non-test .py file, a Mutation
  of kind "revert" whose source is the file at `commit` with only that function's lines
  (decorators included) replaced by the parent commit's version. Functions added or deleted by
  the commit, renamed files, files that are not UTF-8 and root commits give nothing.

  Args:
    repo_dir: a git working tree.
    commit: the commit (any revision name); its first parent is the reference.
    paths: only these files (relative, "/" separated); None for all.

  Returns:
    Mutations ordered by path, then by line in the file at `commit`; `lineno` is the first
    line of the function there.

  Raises:
    ValueError: `repo_dir` is not a git repository, one that `envs.safe_git.check_repository`
      refuses (git reads it through `envs.safe_git`: none of its configured programs runs), or
      `commit` is not a commit in it.
    envs.safe_git.GitError: git failed otherwise.
  """
  git_dir = safe_git.check_repository(safe_git.find_git_dir(repo_dir))
  sha = safe_git.rev_parse(git_dir, commit)
  if sha is None:
    raise ValueError(f"commit={commit!r}: not a commit of {repo_dir!r}")
  parents = safe_git.git(git_dir, "rev-list", "--parents", "-n", "1", sha).split()[1:]
  if not parents:
    return []
  parent = parents[0].decode()
  wanted = None if paths is None else set(paths)
  status = safe_git.git(git_dir, "diff-tree", "-r", "--name-status", "--no-renames",
                        "--no-ext-diff", "--no-textconv", "-z", parent, sha, "--")
  fields = status.decode("utf-8", "surrogateescape").split("\0")
  out = []
  for code, path in zip(fields[0::2], fields[1::2]):
    if (code != "M" or not path.endswith(".py") or is_test_file(path)
        or (wanted is not None and path not in wanted)):
      continue
    try:
      old_text = safe_git.read_blob(git_dir, parent, path).decode("utf-8")
      new_text = safe_git.read_blob(git_dir, sha, path).decode("utf-8")
      old_fns, new_fns = _top_functions(ast.parse(old_text)), _top_functions(ast.parse(new_text))
    except (UnicodeDecodeError, SyntaxError):
      continue
    old_src, new_src = _Source(old_text), _Source(new_text)
    for key, new_fn in sorted(new_fns.items(), key=lambda kv: kv[1].lineno):
      old_fn = old_fns.get(key)
      if old_fn is None or _without_docstring(old_fn) == _without_docstring(new_fn):
        continue
      old_first = min([old_fn.lineno] + [d.lineno for d in old_fn.decorator_list])
      new_first = min([new_fn.lineno] + [d.lineno for d in new_fn.decorator_list])
      old_indent, new_indent = old_src.indent(old_first), new_src.indent(new_first)
      lines = old_src.lines[old_first - 1:old_fn.end_lineno]
      if old_indent != new_indent:
        lines = [new_indent + line[len(old_indent):] if line.startswith(old_indent) else line
                 for line in lines]
      if lines and not lines[-1].endswith("\n") and new_fn.end_lineno < len(new_src.lines):
        lines[-1] += "\n"
      start, end = new_src.lines_span(new_first, new_fn.end_lineno)
      text = new_text[:start] + "".join(lines) + new_text[end:]
      try:
        ast.parse(text)
      except SyntaxError:
        continue
      if text != new_text:
        out.append(Mutation(REVERT, path, key[0], new_first,
                            f"`{key[0]}` put back to its version before {sha[:12]}", text))
  return out


def main(argv: Optional[list[str]] = None) -> int:
  """Command line: candidate bugs of Python files (or reverts of a commit), counted per kind.

  Returns:
    0; {path: {kind: count}} is printed as JSON, then with --diffs every candidate's
    description and diff.
  """
  p = argparse.ArgumentParser(prog="python -m envs.mutate", description=__doc__.split("\n")[0])
  p.add_argument("files", nargs="*", help="Python files (diff paths relative to the current "
                 "directory)")
  p.add_argument("--kinds", nargs="+", default=list(KINDS), help=f"a subset of {KINDS}")
  p.add_argument("--max-per-kind", type=int, default=None, help="seeded sample per kind")
  p.add_argument("--seed", type=int, default=0, help="seed of the sample")
  p.add_argument("--repo", help="a git working tree: list the reverts of --commit instead")
  p.add_argument("--commit", default="HEAD", help="the commit for --repo")
  p.add_argument("--diffs", action="store_true", help="also print every candidate's diff")
  args = p.parse_args(argv)
  found = {}
  if args.repo:
    for m in commit_reverts(args.repo, args.commit):
      original = safe_git.read_blob(safe_git.find_git_dir(args.repo), args.commit,
                                    m.path).decode("utf-8")
      found.setdefault(m.path, []).append((m, original))
  for file in args.files:
    with open(file, encoding="utf-8") as f:
      text = f.read()
    path = os.path.relpath(file).replace(os.sep, "/")
    found[path] = [(m, text) for m in mutations(text, path, args.kinds,
                                                 max_per_kind=args.max_per_kind, seed=args.seed)]
  counts = {path: dict(collections.Counter(m.kind for m, _ in ms)) for path, ms in found.items()}
  print(json.dumps(counts))
  if args.diffs:
    for ms in found.values():
      for m, original in ms:
        print(f"# {m.kind} {m.path}:{m.lineno} {m.function}: {m.description}")
        sys.stdout.write(m.diff(original))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
