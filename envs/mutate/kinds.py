"""The mutation kinds of `envs.mutate.KINDS`: one generator of candidate edits per kind
(the kinds are described in `envs.mutate`'s docstring)."""

from __future__ import annotations

import ast
import collections
import copy
import re
from typing import Iterable, Iterator, Optional

from envs.mutate.base import (_ATOMS, _BINOPS, _BINOPS_NEW, _BUILTIN_TYPES, _CMPOPS,
                              _COMPREHENSIONS, _Cand, _DEFS, _Fn, _MAX_KEPT_LINES, _Source, _apply,
                              _blocks, _expr_cand, _int_value, _is_str, _nodes, _short, _token_swap,
                              _where)


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
