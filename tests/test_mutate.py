"""envs.mutate: every kind of planted bug on a small module yields candidates that parse, change
exactly one small region inside a function body (comments, docstrings, constants and test files
untouched) and change behaviour; commit_reverts on a throwaway repository puts back exactly the
functions a commit changed."""

import ast
import difflib
import json
import os
import subprocess

import pytest

from envs.mutate import KINDS, Mutation, commit_reverts, is_test_file, main, mutations

MODULE = '''"""Inventory helpers: clamping, window sums and a priced basket."""

import math

MAX_ITEMS = 100  # the largest basket we accept
NAMES = ["a", "b", "c"]
LIMIT = MAX_ITEMS - 1


def clamp(value: int, lo: int, hi: int) -> int:
    """Clamp `value` into [lo, hi]; say `lo < hi` and `x + 1`."""
    # below the range
    if value < lo:
        return lo
    if value > hi:  # above the range
        return hi
    return value


def window_sums(xs: list, size: int) -> list:
    """Sums of each window of `size` consecutive items of `xs`."""
    out = []
    for i in range(len(xs) - size + 1):
        total = 0
        for j in range(i, i + size):
            total += xs[j]
        out.append(total)
    return out


def describe(count, limit=10):
    """Describes a count in words."""
    if count == 0:
        label = "none"
    elif count >= limit and count is not None:
        label = "many"
    else:
        label = "some"
    return label


def scale(n: int, flags=0):
    early = 1
    result = n * early | flags
    late = 2
    if result < 0:
        raise ValueError("negative")
    return result + late


class Basket:
    """A basket of priced items."""

    def __init__(self, prices=None):
        self.prices = list(prices or [])

    def __repr__(self):
        return "Basket(%d)" % (len(self.prices) - 1 + 0)

    def total(self, discount: float = 0.0) -> float:
        # apply the discount to the sum
        subtotal = sum(self.prices)
        if discount > 1:
            discount = 1.0
        if discount and subtotal > 0:
            return subtotal * (1 - discount)
        return subtotal

    def last(self):
        if not self.prices:
            return None
        return self.prices[-1]

    def ratios(self):
        result = []
        for k in range(len(self.prices) - 1):
            result.append(math.pow(self.prices[k], self.prices[k + 1]))
        return result[1:]
'''

def _function_spans(text):
  spans = {}
  tree = ast.parse(text)
  for node in tree.body:
    members = ([(f"{node.name}.", m) for m in node.body] if isinstance(node, ast.ClassDef)
               else [("", node)])
    for prefix, fn in members:
      if isinstance(fn, ast.FunctionDef):
        body = fn.body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
          body = body[1:]
        spans[prefix + fn.name] = (body[0].lineno, fn.end_lineno)
  return spans


SPANS = _function_spans(MODULE)


@pytest.fixture(scope="module")
def all_mutations():
  return mutations(MODULE, "shop/inventory.py")


def _region(original, mutated):
  """The one changed region: (first original line, old lines, new lines); fails if several."""
  a, b = original.splitlines(True), mutated.splitlines(True)
  ops = [op for op in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
         if op[0] != "equal"]
  assert len(ops) == 1, ops
  _, i1, i2, j1, j2 = ops[0]
  return i1 + 1, a[i1:i2], b[j1:j2]


def test_every_kind_yields_candidates(all_mutations):
  counts = {k: sum(m.kind == k for m in all_mutations) for k in KINDS}
  assert all(counts[k] > 0 for k in KINDS), counts
  assert len({m.source for m in all_mutations}) == len(all_mutations)
  keys = [(m.lineno, KINDS.index(m.kind)) for m in all_mutations]
  assert keys == sorted(keys)


def test_candidates_parse_and_change_one_small_region_in_a_function_body(all_mutations):
  original_dump = ast.dump(ast.parse(MODULE))
  doc_and_constant_lines = {1, 5, 6, 7, 11, 21, 32, 52}
  for m in all_mutations:
    assert isinstance(m, Mutation) and m.path == "shop/inventory.py"
    assert ast.dump(ast.parse(m.source)) != original_dump
    first, old, new = _region(MODULE, m.source)
    last = first + max(len(old), 1) - 1
    lo, hi = SPANS[m.function]
    assert lo <= first and last <= hi, (m.description, first, last, m.function)
    assert not doc_and_constant_lines & set(range(first, last + 1)), m.description
    assert m.function != "Basket.__repr__"
    if m.kind in ("operator", "comparison", "off_by_one", "swap_arguments", "wrong_variable"):
      assert len(old) == len(new) == 1, m.description     # one line edited in place
      assert first == m.lineno
    else:
      assert len(old) <= 3 and len(new) <= 2, m.description
    # comments elsewhere survive byte for byte
    for line in MODULE.splitlines(True):
      if "#" in line and line not in old:
        assert line in m.source
    # the diff is the same one region, with git-style headers
    diff = m.diff(MODULE)
    assert diff.startswith("diff --git a/shop/inventory.py b/shop/inventory.py\n")
    removed = [line for line in diff.splitlines()[3:] if line.startswith("-")]
    assert len(removed) == len(old)


def _find(all_mutations, kind, function, needle):
  hits = [m for m in all_mutations if m.kind == kind and m.function == function and needle(m)]
  assert hits, (kind, function, [m.description for m in all_mutations if m.function == function])
  return hits


def _line(m, lineno):
  return m.source.splitlines()[lineno - 1]


def test_specific_candidates_of_each_kind(all_mutations):
  a = all_mutations
  _find(a, "comparison", "clamp", lambda m: _line(m, 13) == "    if value <= lo:")
  _find(a, "comparison", "describe", lambda m: "count is None" in m.source)
  _find(a, "operator", "window_sums", lambda m: "total -= xs[j]" in m.source)
  _find(a, "operator", "scale", lambda m: "result = n * early & flags" in m.source)
  _find(a, "operator", "Basket.last", lambda m: "        if self.prices:\n" in m.source)
  _find(a, "off_by_one", "window_sums", lambda m: "range(len(xs) - size + 2)" in m.source)
  _find(a, "off_by_one", "window_sums", lambda m: "range(len(xs) - size)" in m.source)
  _find(a, "off_by_one", "Basket.last", lambda m: "self.prices[-2]" in m.source)
  _find(a, "off_by_one", "Basket.ratios", lambda m: "range(len(self.prices))" in m.source)
  _find(a, "off_by_one", "Basket.ratios", lambda m: "result[2:]" in m.source)
  _find(a, "drop_condition", "describe", lambda m: "elif count >= limit:\n" in m.source)
  _find(a, "drop_condition", "describe",
        lambda m: "else:" not in m.source.split("def describe")[1].split("def scale")[0])
  _find(a, "drop_condition", "describe", lambda m: "elif" not in m.source)
  _find(a, "drop_condition", "Basket.total",
        lambda m: "        subtotal = sum(self.prices)\n        discount = 1.0\n" in m.source)
  _find(a, "drop_condition", "scale",
        lambda m: "    late = 2\n    return result + late\n" in m.source)
  # a guard that returns is left to early_return: keeping its body would end the function there
  assert not any(m.kind == "drop_condition" and "removed (body kept)" in m.description
                 for m in a if m.function == "clamp")
  _find(a, "early_return", "clamp", lambda m: "        return lo\n    return value\n" in m.source)
  _find(a, "early_return", "Basket.total",
        lambda m: "            return None\n        return subtotal\n" in m.source)
  # `return None` plus one value-returning `return` is not enough for a `None` mutant
  assert not any(m.kind == "early_return" and m.function == "Basket.last" 
                 and "-> `return None`" in m.description for m in a)
  _find(a, "swap_arguments", "Basket.ratios",
        lambda m: "math.pow(self.prices[k + 1], self.prices[k])" in m.source)
  _find(a, "wrong_variable", "clamp", lambda m: _line(m, 14) == "        return hi")
  _find(a, "wrong_variable", "window_sums", lambda m: "total += xs[i]" in m.source)
  # `late` is bound only after `result = ...`: never a replacement there
  for m in a:
    if m.kind == "wrong_variable" and m.function == "scale":
      assert "late" not in _line(m, 44), m.description
  assert any(m.kind == "wrong_variable" and "| n" in _line(m, 44) for m in a)
  # a commutative `+` swap or an identical-argument swap never appears: every candidate is a
  # different program (checked above); string concatenation is left alone
  assert not any('"Basket(%d)"' in m.description for m in a)


def test_nothing_in_test_files_docstrings_or_constants():
  for path in ("tests/test_inventory.py", "pkg/test/helpers.py", "conftest.py", "pkg/x_test.py",
               "test_a.py"):
    assert is_test_file(path)
    assert mutations(MODULE, path) == []
  for path in ("pkg/testing.py", "pkg/latest.py", "contest.py", "tests.py"):
    assert not is_test_file(path)
  constants_only = 'X = 1 + 2\nY = [i for i in range(3) if i < 2]\n"""doc a < b"""\n'
  assert mutations(constants_only, "pkg/consts.py") == []
  decorated = ("import functools\n\n@functools.lru_cache(maxsize=2 + 1)\n"
               "def f(a: int = 1 + 1, b=2 - 1):\n    return a\n")
  assert mutations(decorated, "pkg/dec.py") == []


def test_sampling_is_seeded_and_bounded(all_mutations):
  one = mutations(MODULE, "shop/inventory.py", max_per_kind=2, seed=3)
  assert one == mutations(MODULE, "shop/inventory.py", max_per_kind=2, seed=3)
  assert all(sum(m.kind == k for m in one) == 2 for k in KINDS)
  assert all(m in all_mutations for m in one)
  seeds = {tuple(m.source for m in mutations(MODULE, "shop/inventory.py", max_per_kind=2, seed=s))
           for s in range(4)}
  assert len(seeds) > 1
  only = mutations(MODULE, "shop/inventory.py", kinds=("comparison",))
  assert only == [m for m in all_mutations if m.kind == "comparison"]
  assert mutations(MODULE, "shop/inventory.py", max_per_kind=0) == []


def test_bad_input_is_named():
  with pytest.raises(ValueError, match="kinds.*'typo'"):
    mutations(MODULE, "a.py", kinds=("typo",))
  with pytest.raises(ValueError, match="max_per_kind"):
    mutations(MODULE, "a.py", max_per_kind=-1)
  with pytest.raises(ValueError, match="path must be"):
    mutations(MODULE, "")
  with pytest.raises(ValueError, match="'broken.py' does not parse"):
    mutations("def f(:\n", "broken.py")


TINY = '''def first_above(xs, threshold, start=0):
    # index of the first item above threshold at an even index >= start, -1 if none
    for i in range(start, len(xs)):
        if xs[i] > threshold and i % 2 == 0:
            return i
    return -1
'''


def test_mutants_change_behaviour():
  inputs = [([], 0, 0), ([1, 2, 3], 0, 0), ([1, 2, 3], 2, 0), ([5, 1, 5], 4, 1), ([3, 3], 3, 0),
            ([0, 9, 9], 8, 1), ([7, 0, 7, 7], 6, 1)]

  def run(text):
    namespace = {}
    exec(compile(text, "tiny.py", "exec"), namespace)
    out = []
    for xs, threshold, start in inputs:
      try:
        out.append(namespace["first_above"](list(xs), threshold, start))
      except Exception as e:  # a crash is a behaviour too
        out.append(type(e).__name__)
    return out

  expected = run(TINY)
  assert expected == [-1, 0, 2, 2, -1, 2, 2]
  mutants = mutations(TINY, "tiny.py")
  assert {m.kind for m in mutants} == set(KINDS)
  for m in mutants:
    assert run(m.source) != expected, m.description


def _git(cwd, *args):
  subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                 cwd=cwd, check=True, capture_output=True)


OLD_A = '''def area(w, h):
    """Area of a rectangle."""
    return w * h
'''
NEW_A = '''def area(w, h):
    """Area of a rectangle."""
    if w < 0 or h < 0:
        raise ValueError("negative side")
    return w * h
'''
OLD_M = '''    @property
    def size(self):
        return len(self.items)
'''
NEW_M = '''    @property
    def size(self):
        # count only the real items
        return sum(1 for x in self.items if x is not None)
'''
OLD_DOC = '''def name():
    """Old words."""
    return "box"
'''
NEW_DOC = '''def name():
    """New words, same code."""
    return "box"
'''
ADDED = '''

def volume(w, h, d):
    return area(w, h) * d
'''


def _geometry(a, m, doc, extra=""):
  return ("# geometry helpers\n\n\n" + a + "\n\nclass Box:\n    items = []\n\n" + m + "\n\n" + doc
          + extra)


def test_commit_reverts(tmp_path, capsys):
  repo = str(tmp_path)
  _git(repo, "init", "-q")
  os.makedirs(tmp_path / "pkg")
  os.makedirs(tmp_path / "tests")
  old = _geometry(OLD_A, OLD_M, OLD_DOC)
  new = _geometry(NEW_A, NEW_M, NEW_DOC, ADDED)
  (tmp_path / "pkg" / "geo.py").write_text(old)
  (tmp_path / "tests" / "test_geo.py").write_text("def test_a():\n    assert 1\n")
  (tmp_path / "notes.txt").write_text("v1\n")
  _git(repo, "add", ".")
  _git(repo, "commit", "-q", "-m", "one")
  assert commit_reverts(repo) == []          # a root commit has no parent
  (tmp_path / "pkg" / "geo.py").write_text(new)
  (tmp_path / "tests" / "test_geo.py").write_text("def test_a():\n    assert 2\n")
  (tmp_path / "notes.txt").write_text("v2\n")
  _git(repo, "add", ".")
  _git(repo, "commit", "-q", "-m", "two")
  reverts = commit_reverts(repo)
  assert [(m.kind, m.path, m.function) for m in reverts] == [
      ("revert", "pkg/geo.py", "area"), ("revert", "pkg/geo.py", "Box.size")]
  area, size = reverts
  assert area.source == new.replace(NEW_A, OLD_A)
  assert size.source == new.replace(NEW_M, OLD_M)
  assert new.splitlines()[area.lineno - 1] == "def area(w, h):"
  assert new.splitlines()[size.lineno - 1] == "    @property"
  assert commit_reverts(repo, "HEAD", paths=["pkg/other.py"]) == []
  assert commit_reverts(repo, "HEAD~0", paths=["pkg/geo.py"]) == reverts
  with pytest.raises(ValueError, match="nope"):
    commit_reverts(repo, "nope")
  assert main(["--repo", repo]) == 0
  assert json.loads(capsys.readouterr().out.splitlines()[0]) == {"pkg/geo.py": {"revert": 2}}


EDGES = '''def same(x, y):
    return max(x, y) + pow(x, x) + (x + 0)


def bits(a, b, c, x):
    flag = x and not (a or b)
    return a ^ b & c


def label(a, b):
    s = "café · naïve"; t = s if a < b else s.upper()
    return t


async def outer(items):
    def inner(v: int, w: int):
        return v - w
    return [inner(i, 1) for i in items]
'''


def test_no_ops_skipped_precedence_kept_and_positions_exact():
  found = mutations(EDGES, "pkg/edges.py")
  by_function = {}
  for m in found:
    by_function.setdefault(m.function, []).append(m)
  same = [m.description for m in by_function["same"]]
  # no swap of identical arguments or of a symmetric max, no `x + 0` -> `x - 0`
  assert not any("swapped" in d and ("max" in d or "pow(x, x)" in d) for d in same), same
  assert not any("(x - 0)" in m.source for m in by_function["same"]), same
  assert len(same) == 2   # the two outer `+`
  bits = {m.source.splitlines()[m.lineno - 1].strip() for m in by_function["bits"]}
  # precedence: the edited node is parenthesised where the new text would bind differently
  assert "return a ^ (b | c)" in bits
  assert "flag = x and (a or b)" in bits
  for m in by_function["bits"]:
    assert ast.dump(ast.parse(m.source)) != ast.dump(ast.parse(EDGES))
  # columns after non-ASCII text on the same line
  labels = {m.source.splitlines()[m.lineno - 1] for m in by_function["label"]}
  assert '    s = "café · naïve"; t = s if a <= b else s.upper()' in labels
  # async functions and nested functions (qualified like Python does)
  assert any(m.function == "outer.<locals>.inner" and "return v + w" in m.source for m in found)
  assert any(m.function == "outer.<locals>.inner" and m.kind == "wrong_variable"
             and "return w - w" in m.source for m in found)


BRANCHY = '''def pick(flag: bool, n: int):
    if flag:
        a = 1
    else:
        b = 2
    c = 3
    for i in range(n):
        d = 4
        c += i * d
    total = 0
    return c + total + n
'''


def test_wrong_variable_never_reads_an_unbound_name():
  mutants = mutations(BRANCHY, "pkg/pick.py", kinds=("wrong_variable",))
  assert len(mutants) >= 6
  for m in mutants:
    namespace = {}
    exec(compile(m.source, "pick.py", "exec"), namespace)
    for flag in (True, False):
      for n in (0, 1, 3):
        namespace["pick"](flag, n)   # an UnboundLocalError or NameError would fail the test
  used = {m.description.split("`")[3] for m in mutants}   # the replacement names
  assert not used & {"a", "b"}                 # bound on one branch only
  assert "d" in used and "i" in used           # inside the loop, after their binding
  after_loop = {m.description.split("`")[3] for m in mutants if m.lineno == 11}
  assert after_loop == {"c", "n", "total"}     # a loop's names may be unbound after it


def test_command_line(tmp_path, monkeypatch, capsys):
  (tmp_path / "shop").mkdir()
  (tmp_path / "shop" / "inventory.py").write_text(MODULE)
  monkeypatch.chdir(tmp_path)
  assert main(["shop/inventory.py", "--kinds", "comparison", "off_by_one", "--diffs"]) == 0
  out = capsys.readouterr().out
  expected = mutations(MODULE, "shop/inventory.py", kinds=("comparison", "off_by_one"))
  assert json.loads(out.splitlines()[0]) == {"shop/inventory.py": {
      k: sum(m.kind == k for m in expected) for k in ("comparison", "off_by_one")}}
  assert out.count("diff --git a/shop/inventory.py b/shop/inventory.py") == len(expected)
