"""What every planted bug is built from: the `Mutation` record, source positions, the
functions of a module and the shapes of candidate edits."""

from __future__ import annotations

import ast
import dataclasses
import re
from typing import Iterable, Iterator, Optional, Sequence

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
