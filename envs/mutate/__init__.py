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
import collections
import json
import os
import sys
from typing import Optional

from envs import safe_git
from envs.mutate.base import KINDS, REVERT, Mutation, is_test_file
from envs.mutate.plant import mutations
from envs.mutate.reverts import commit_reverts

__all__ = ["KINDS", "REVERT", "Mutation", "commit_reverts", "is_test_file", "main", "mutations"]


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
