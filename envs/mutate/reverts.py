"""`commit_reverts`: one task per function a commit changed, that function put back."""

from __future__ import annotations

import ast
import collections
import copy
from typing import Iterable, Optional

from envs import safe_git
from envs.mutate.base import Mutation, REVERT, _Source, _functions, is_test_file


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
