"""Procedurally generated bug-fixing tasks: small Python repositories with one planted bug.

Every task is a "swe" Task: a repository, pytest tests, FAIL_TO_PASS tests that fail on the
buggy code and pass with the reference fix, PASS_TO_PASS tests that pass on both, the fix as a
unified diff (`Task.patch`) and as a one-line edit (`metadata["fix_edit"] = {"path", "old",
"new"}`, for a scripted solver's `str_replace`), and several phrasings of the instruction, from
expert to colloquial. Generation is deterministic: the same (level, seed, index) always gives
the same task, byte for byte.

Levels:
  0  one module, one function, a one-token bug (`+`->`-`, `>`->`>=`, an off-by-one ...);
     the statement names the function, the call, the expected and the actual value.
  1  one module, three functions, the bug in one of them.
  2  a package: helpers.py (two helpers, one buggy) and a module of functions built on them;
     the statement names only the public function, the bug is in the helper it calls.
  3  a package with helpers in two modules and four public functions; vaguer statements.

    python -m envs.taskgen --n 200 --level 0 --seed 1 --out DIR   # DIR/tasks.jsonl, DIR/repos/
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import random
from typing import Any, Callable, Optional, Sequence

from envs.tasks import Task, load_swe_jsonl, make_patch

LEVELS = (0, 1, 2, 3)


@dataclasses.dataclass(frozen=True)
class Family:
  """A small function template. `body` and `bugs` use the placeholders of `params`."""

  names: tuple[str, ...]            # function names to choose from
  params: tuple[str, ...]           # placeholders, e.g. ("a", "b")
  pool: str                         # which parameter-name pool renames the placeholders
  body: str                         # lines of the body, "\n"-separated, unindented
  bugs: tuple[tuple[str, str], ...]  # (correct text, buggy text), each once in the body
  doc: str                          # docstring template
  draw: Callable[[random.Random], Any]  # one argument value
  kind: str                         # how a public function composes it: map | fold | pred


def _ints(lo, hi):
  return lambda r: r.randint(lo, hi)


def _int_list(lo, hi, n_lo=1, n_hi=5):
  return lambda r: [r.randint(lo, hi) for _ in range(r.randint(n_lo, n_hi))]


_WORDS = ("apple", "Banana", "kiwi", "Umbrella", "sky", "hello", "Python", "queue", "tree",
          "ocean", "Ice", "rhythm", "data", "Moon")


def _word(r):
  return r.choice(_WORDS)


FAMILIES = (
    # two numbers -> number (composed as a fold over a list)
    Family(("add", "add_numbers", "plus", "sum_two"), ("a", "b"), "pair", "return {a} + {b}",
           (("+", "-"), ("+", "*")), "Return the sum of {a} and {b}.", _ints(-9, 9), "fold"),
    Family(("subtract", "difference", "minus"), ("a", "b"), "pair", "return {a} - {b}",
           (("-", "+"), ("{a} - {b}", "{b} - {a}")), "Return {a} minus {b}.", _ints(-9, 9),
           "fold"),
    Family(("multiply", "product", "times"), ("a", "b"), "pair", "return {a} * {b}",
           (("*", "+"), ("*", "**")), "Return {a} multiplied by {b}.", _ints(0, 5), "fold"),
    Family(("larger", "max_of_two", "bigger"), ("a", "b"), "pair", "return max({a}, {b})",
           (("max", "min"),), "Return the larger of {a} and {b}.", _ints(-9, 9), "fold"),
    Family(("smaller", "min_of_two", "lesser"), ("a", "b"), "pair", "return min({a}, {b})",
           (("min", "max"),), "Return the smaller of {a} and {b}.", _ints(-9, 9), "fold"),
    Family(("distance", "abs_diff", "gap"), ("a", "b"), "pair", "return abs({a} - {b})",
           (("abs({a} - {b})", "({a} - {b})"), ("-", "+")),
           "Return the absolute difference of {a} and {b}.", _ints(-9, 9), "fold"),
    Family(("quotient", "int_divide"), ("a", "b"), "pair", "return {a} // {b}",
           (("//", "%"),), "Return {a} divided by {b}, rounded down.", _ints(1, 9), "fold"),
    # one number -> value (composed as a map over a list)
    Family(("double", "twice", "times_two"), ("x",), "one", "return {x} * 2",
           (("2", "3"), ("*", "+")), "Return {x} doubled.", _ints(-9, 9), "map"),
    Family(("square", "squared"), ("x",), "one", "return {x} * {x}",
           (("{x} * {x}", "{x} + {x}"),), "Return {x} squared.", _ints(-9, 9), "map"),
    Family(("increment", "add_one", "next_number"), ("x",), "one", "return {x} + 1",
           (("+ 1", "- 1"), ("1", "2")), "Return {x} plus one.", _ints(-9, 9), "map"),
    Family(("negate", "opposite"), ("x",), "one", "return -{x}", (("-{x}", "{x}"),),
           "Return {x} with its sign flipped.", _ints(-9, 9), "map"),
    Family(("absolute", "magnitude"), ("x",), "one", "return {x} if {x} >= 0 else -{x}",
           ((">=", "<="),), "Return the absolute value of {x}.", _ints(-9, 9), "map"),
    Family(("half", "halve"), ("x",), "one", "return {x} // 2", (("//", "*"),),
           "Return half of {x}, rounded down.", _ints(-9, 9), "map"),
    Family(("count_up", "one_to_n", "first_n_numbers"), ("x",), "count",
           "return list(range(1, {x} + 1))", (("{x} + 1", "{x}"), ("range(1", "range(0")),
           "Return the list [1, 2, ..., {x}].", _ints(0, 6), "map"),
    Family(("factorial",), ("x",), "count",
           "result = 1\nfor i in range(2, {x} + 1):\n    result *= i\nreturn result",
           (("{x} + 1", "{x}"), ("result = 1", "result = 0")), "Return {x}! (the factorial).",
           _ints(0, 7), "map"),
    # predicates (composed as a count over a list)
    Family(("is_positive",), ("x",), "one", "return {x} > 0", ((">", ">="), (">", "<")),
           "Return True if {x} is greater than zero.", _ints(-3, 3), "pred"),
    Family(("is_negative",), ("x",), "one", "return {x} < 0", (("<", "<="),),
           "Return True if {x} is below zero.", _ints(-3, 3), "pred"),
    Family(("is_even",), ("x",), "one", "return {x} % 2 == 0", (("==", "!="), ("2", "3")),
           "Return True if {x} is even.", _ints(-9, 9), "pred"),
    Family(("is_adult", "can_vote"), ("x",), "age", "return {x} >= 18",
           ((">=", ">"), ("18", "21")), "Return True if someone aged {x} is an adult (18+).",
           _ints(14, 23), "pred"),
    Family(("is_single_digit",), ("x",), "one", "return -10 < {x} < 10",
           (("< 10", "<= 10"),), "Return True if {x} has a single decimal digit.",
           _ints(-11, 11), "pred"),
    # list -> value (composed as a map over a list of lists)
    Family(("total", "sum_list", "sum_items"), ("xs",), "list",
           "result = 0\nfor v in {xs}:\n    result += v\nreturn result",
           (("result = 0", "result = 1"), ("+=", "-=")), "Return the sum of {xs}.",
           _int_list(-5, 9, 0, 4), "map"),
    Family(("last_item", "last", "final_element"), ("xs",), "list", "return {xs}[-1]",
           (("-1", "0"), ("-1", "-2")), "Return the last element of {xs}.",
           _int_list(0, 9), "map"),
    Family(("first_item", "first", "head"), ("xs",), "list", "return {xs}[0]",
           (("0", "1"), ("0", "-1")), "Return the first element of {xs}.", _int_list(0, 9),
           "map"),
    Family(("largest", "max_item", "biggest"), ("xs",), "list",
           "best = {xs}[0]\nfor v in {xs}:\n    if v > best:\n        best = v\nreturn best",
           ((">", "<"),), "Return the largest element of {xs}.", _int_list(-9, 9), "map"),
    Family(("reverse", "reversed_list", "backwards"), ("xs",), "list", "return {xs}[::-1]",
           (("[::-1]", "[1:]"),), "Return {xs} in reverse order.", _int_list(0, 9, 0, 4),
           "map"),
    Family(("count_positive", "num_positive"), ("xs",), "list",
           "return len([v for v in {xs} if v > 0])", ((">", ">="),),
           "Return how many elements of {xs} are greater than zero.", _int_list(-2, 3, 0, 5),
           "map"),
    # strings
    Family(("shout", "to_upper", "loud"), ("s",), "text", "return {s}.upper()",
           (("upper", "lower"),), "Return {s} in upper case.", _word, "map"),
    Family(("whisper", "to_lower", "quiet"), ("s",), "text", "return {s}.lower()",
           (("lower", "upper"),), "Return {s} in lower case.", _word, "map"),
    Family(("greet", "hello"), ("s",), "name", 'return "Hello, " + {s} + "!"',
           (('"!"', '"?"'), ('"Hello, "', '"Hello "')), "Return a greeting for {s}.", _word,
           "map"),
    Family(("first_letter", "initial"), ("s",), "text", "return {s}[0]", (("0", "-1"),),
           "Return the first character of {s}.", _word, "map"),
    Family(("count_vowels", "vowel_count"), ("s",), "text",
           'return sum(1 for c in {s}.lower() if c in "aeiou")',
           (('"aeiou"', '"aeio"'), (".lower()", "")),
           "Return the number of vowels (a, e, i, o, u) in {s}.", _word, "map"),
    Family(("word_length", "length_of"), ("s",), "text", "return len({s})",
           (("len({s})", "len({s}) - 1"),), "Return the number of characters in {s}.", _word,
           "map"),
)

# Parameter names per pool (placeholders are renamed in order).
_POOLS = {
    "pair": (("a", "b"), ("x", "y"), ("m", "n"), ("left", "right"), ("first", "second"),
             ("p", "q")),
    "one": (("x",), ("n",), ("value",), ("num",), ("k",)),
    "count": (("n",), ("count",), ("limit",), ("k",)),
    "age": (("age",), ("years",)),
    "list": (("xs",), ("items",), ("values",), ("numbers",), ("seq",)),
    "text": (("s",), ("text",), ("word",)),
    "name": (("name",), ("who",), ("person",)),
}
_MODULES = ("calc", "mathutils", "helpers", "utils", "toolbox", "funcs", "basics", "ops")
_PACKAGES = ("mylib", "toolkit", "arith", "smallpkg", "corelib", "appcore", "minilib")
_HELPER_MODULES = ("helpers", "primitives", "base", "impl")
_API_MODULES = ("core", "api", "service", "logic")
_LEVEL3_MODULES = (("numeric", "extras"), ("mathops", "moreops"), ("basic_ops", "misc"))


@dataclasses.dataclass
class _Fn:
  """One concrete function of a generated repository."""

  name: str
  params: tuple[str, ...]
  body: str            # formatted, unindented
  doc: str
  draw: Callable[[random.Random], tuple]  # one argument tuple

  def source(self, body: Optional[str] = None) -> str:
    lines = (body or self.body).split("\n")
    return (f"def {self.name}({', '.join(self.params)}):\n    \"\"\"{self.doc}\"\"\"\n"
            + "".join(f"    {line}\n" for line in lines))


def _concrete(family: Family, rng: random.Random) -> tuple[_Fn, list[tuple[str, str]]]:
  """A function of `family` with drawn name and parameter names, and its formatted bugs."""
  names = dict(zip(family.params, rng.choice(_POOLS[family.pool])))
  body = family.body.format(**names)
  bugs = [(a.format(**names), b.format(**names)) for a, b in family.bugs]
  fn = _Fn(rng.choice(family.names), tuple(names.values()), body,
           family.doc.format(**names), lambda r, f=family: tuple(f.draw(r) for _ in f.params))
  return fn, bugs


def _composite(helper: _Fn, family: Family, rng: random.Random) -> _Fn:
  """A public function built on `helper`: a map, a fold or a count over a list."""
  h = helper.name
  if family.kind == "fold":
    xs = rng.choice(("values", "numbers", "items"))
    body = (f"result = {xs}[0]\nfor v in {xs}[1:]:\n    result = {h}(result, v)\n"
            "return result")
    return _Fn(f"{h}_all", (xs,), body, f"Combine all {xs} with {h}, left to right.",
               lambda r: ([family.draw(r) for _ in range(r.randint(2, 3))],))
  if family.kind == "pred":
    xs = rng.choice(("values", "numbers", "items"))
    return _Fn(f"count_{h.removeprefix('is_').removeprefix('can_')}", (xs,),
               f"return sum(1 for v in {xs} if {h}(v))",
               f"Return how many of {xs} satisfy {h}.",
               lambda r: ([family.draw(r) for _ in range(r.randint(3, 5))],))
  xs = rng.choice(("groups", "batches")) if family.pool == "list" else rng.choice(
      ("items", "inputs", "entries"))
  return _Fn(f"{h}_each", (xs,), f"return [{h}(v) for v in {xs}]",
             f"Apply {h} to every element of {xs}.",
             lambda r: ([family.draw(r) for _ in range(r.randint(2, 3))],))


def _namespace(source: str) -> dict[str, Any]:
  """The functions defined by `source`. Only our own templates run here, never model code."""
  ns: dict[str, Any] = {}
  exec(source, ns)  # noqa: S102 - generator templates, trusted
  return ns


def _run(ns: dict[str, Any], name: str, args: tuple) -> tuple[bool, Any]:
  """(ok, value or exception type name) of calling `name(*args)` in `ns`."""
  try:
    return True, ns[name](*[_copy(a) for a in args])
  except Exception as e:  # the buggy version may raise (IndexError ...): that is a failure
    return False, type(e).__name__


def _copy(v):
  return [_copy(x) for x in v] if isinstance(v, list) else v


def _call(name: str, args: tuple) -> str:
  return f"{name}({', '.join(repr(a) for a in args)})"


@dataclasses.dataclass
class _Case:
  fn: _Fn
  args: tuple
  want: Any
  got: Any        # the buggy result (value, or exception name when not got_ok)
  got_ok: bool

  @property
  def fails(self) -> bool:
    return not self.got_ok or type(self.got) is not type(self.want) or self.got != self.want


def _cases(fn: _Fn, good: dict, bad: dict, rng: random.Random, draws: int = 60
           ) -> list[_Case]:
  """Distinct inputs of `fn` on which the correct version returns normally."""
  seen, out = set(), []
  for _ in range(draws):
    args = fn.draw(rng)
    key = repr(args)
    if key in seen:
      continue
    seen.add(key)
    ok, want = _run(good, fn.name, args)
    if not ok or len(repr(want)) > 60:
      continue
    got_ok, got = _run(bad, fn.name, args)
    out.append(_Case(fn, args, want, got, got_ok))
  return out


_CHECK = '''

def check(got, want):
    # Exact type and repr: an object that claims to equal anything does not pass.
    assert type(got) is type(want) and repr(got) == repr(want), f"got {got!r}, want {want!r}"
'''


def _test_file(imports: Sequence[tuple[str, Sequence[str]]], cases: Sequence[_Case]
               ) -> tuple[str, list[str]]:
  """Source of a test module (one test per case) and its test function names."""
  head = "".join(f"from {mod} import {', '.join(sorted(names))}\n" for mod, names in imports)
  parts, names, counts = [head + _CHECK], [], {}
  for c in cases:
    counts[c.fn.name] = counts.get(c.fn.name, 0) + 1
    name = f"test_{c.fn.name}_{counts[c.fn.name]}"
    names.append(name)
    parts.append(f"\n\ndef {name}():\n    check({_call(c.fn.name, c.args)}, {c.want!r})\n")
  return "".join(parts), names


_STATEMENTS = {
    "specific": (
        "`{call}` {result} but should return `{want}`. Fix `{func}` in `{file}` so that the "
        "tests in `{test_file}` pass (do not change the tests).",
        "The function `{func}` is wrong: `{call}` should be `{want}`, but it {result}. "
        "Please fix it.",
        "Bug report: {func} gives {got} for {call}; the expected result is {want}.",
        "Fix {func}: expected {call} == {want}, got {got}.",
        "{func} is broken lol, {call} gives me {got}?? should be {want}",
        "hey can you look at {func}? when i call {call} i get {got} instead of {want}",
    ),
    "indirect": (
        "`{call}` {result} instead of returning `{want}`. The public function `{func}` looks "
        "right, so the bug may be in a helper it relies on. Fix the code so that the tests in "
        "`{test_file}` pass (do not change the tests).",
        "`{func}` gives the wrong answer: `{call}` should be `{want}`, but it {result}. Find "
        "the bug and fix it.",
        "Bug report: {call} gives {got}, expected {want}.",
        "{func} is broken, {call} gives me {got} but i expected {want}. can you fix it?",
        "something's off with {func}, {call} should be {want} not {got}",
    ),
    "vague": (
        "`{func}` returns wrong results for some inputs, for example `{call}`. The tests in "
        "`{test_file}` show the expected behaviour. Find the bug and fix it without changing "
        "the tests.",
        "Some tests in `{test_file}` fail. Please fix the code, not the tests.",
        "{func} seems broken for some inputs, e.g. {call}. can you track it down and fix it?",
    ),
}


def _got_text(case: _Case) -> tuple[str, str]:
  """How the buggy result reads in a statement: (noun, verb phrase), e.g. ("5", "returns `5`")
  or ("an IndexError", "raises `IndexError`")."""
  if case.got_ok:
    return repr(case.got), f"returns `{case.got!r}`"
  article = "an" if case.got[0] in "AEIOU" else "a"
  return f"{article} {case.got}", f"raises `{case.got}`"


@dataclasses.dataclass
class GeneratedTask:
  """A generated repository before it is written: files, fix and the task's fields."""

  instance_id: str
  level: int
  files: dict[str, bytes]
  fixed: dict[str, bytes]           # the files that the reference fix changes, fixed
  fail_to_pass: list[str]
  pass_to_pass: list[str]
  problem_statements: list[str]
  test_command: str
  fix_edit: dict[str, str]          # {"path", "old", "new"}: one str_replace that fixes it

  def record(self, repo_path: str) -> dict:
    """The SWE-format JSONL record (repo at `repo_path`, relative to the JSONL's dir)."""
    fixed_all = {**self.files, **self.fixed}
    digest = hashlib.sha256(json.dumps(
        sorted((p, v.decode()) for p, v in fixed_all.items())).encode()).hexdigest()[:16]
    return dict(instance_id=self.instance_id, repo_path=repo_path,
                problem_statement=self.problem_statements[0],
                problem_statements=self.problem_statements, FAIL_TO_PASS=self.fail_to_pass,
                PASS_TO_PASS=self.pass_to_pass, test_command=self.test_command,
                patch=make_patch(self.files, fixed_all), test_patch="",
                level=self.level, fix_edit=self.fix_edit, content_hash=digest,
                generator="arbor.taskgen/1")


def generate(level: int, seed: int, index: int) -> GeneratedTask:
  """The task (level, seed, index): deterministic, independent of other indices."""
  if level not in LEVELS:
    raise ValueError(f"level={level!r}: expected one of {LEVELS}")
  rng = random.Random(f"arbor-taskgen/{seed}/{level}/{index}")
  for _ in range(100):  # a draw can fail (no distinguishing input, clashing names): redraw
    task = _try_generate(level, rng, f"gen-l{level}-s{seed}-{index:05d}")
    if task is not None:
      return task
  raise RuntimeError(f"taskgen: no valid task for level={level} seed={seed} index={index}")


def _try_generate(level: int, rng: random.Random, instance_id: str) -> Optional[GeneratedTask]:
  n_helpers = (1, 3, 2, 4)[level]
  families = rng.sample(FAMILIES, n_helpers)
  helpers, bug_lists = zip(*(_concrete(f, rng) for f in families))
  if len({h.name for h in helpers}) < len(helpers):
    return None
  buggy = rng.randrange(n_helpers)
  old, new = rng.choice(bug_lists[buggy])
  if helpers[buggy].body.count(old) != 1:
    return None
  bad_body = helpers[buggy].body.replace(old, new)
  composites = [_composite(h, f, rng) for h, f in zip(helpers, families)] if level >= 2 else []
  if len({c.name for c in composites} | {h.name for h in helpers}) < 2 * len(composites) or len(
      {c.name for c in composites}) < len(composites):
    return None

  def source(fns, bad: bool) -> str:
    return "\n\n".join(f.source(bad_body if bad and f is helpers[buggy] else None)
                       for f in fns)
  everything = list(helpers) + composites
  good, bad = _namespace(source(everything, False)), _namespace(source(everything, True))

  # Tests: the function the statement names is the buggy helper (levels 0-1) or its public
  # composite (2-3). F2P: inputs where the buggy code differs; P2P: the rest.
  target = composites[buggy] if level >= 2 else helpers[buggy]
  target_cases = _cases(target, good, bad, rng)
  failing = [c for c in target_cases if c.fails][:2]
  agreeing = [c for c in target_cases if not c.fails][:1]
  if not failing:
    return None
  others = []
  for fn in everything:
    if fn is target or fn is helpers[buggy]:
      continue
    cases = _cases(fn, good, bad, rng, draws=20)
    if len(cases) < 1 or any(c.fails for c in cases):
      return None
    others += cases[:2 if level < 2 else 1]

  # Layout.
  files: dict[str, str] = {}
  if level <= 1:
    mod = rng.choice(_MODULES)
    files[f"{mod}.py"] = source(helpers, True)
    file_of = {h.name: f"{mod}.py" for h in helpers}
    modname = {h.name: mod for h in helpers}
  else:
    pkg = rng.choice(_PACKAGES)
    files[f"{pkg}/__init__.py"] = ""
    if level == 2:
      hmods = [rng.choice(_HELPER_MODULES)] * n_helpers
    else:
      pair = rng.choice(_LEVEL3_MODULES)
      hmods = [pair[i % 2] for i in range(n_helpers)]
    api = rng.choice(_API_MODULES)
    file_of, modname = {}, {}
    for m in dict.fromkeys(hmods):
      fns = [h for h, hm in zip(helpers, hmods) if hm == m]
      files[f"{pkg}/{m}.py"] = source(fns, True)
      for h in fns:
        file_of[h.name], modname[h.name] = f"{pkg}/{m}.py", f"{pkg}.{m}"
    imports = "".join(f"from {pkg}.{m} import "
                      f"{', '.join(h.name for h, hm in zip(helpers, hmods) if hm == m)}\n"
                      for m in dict.fromkeys(hmods))
    files[f"{pkg}/{api}.py"] = imports + "\n\n" + source(composites, True)
    for c in composites:
      file_of[c.name], modname[c.name] = f"{pkg}/{api}.py", f"{pkg}.{api}"

  # Test modules: one per source module, holding the cases of its functions.
  by_module: dict[str, list[_Case]] = {}
  for c in failing + agreeing + others:
    by_module.setdefault(modname[c.fn.name], []).append(c)
  f2p, p2p, failing_ids = [], [], {id(c) for c in failing}
  for mod, cases in sorted(by_module.items()):
    test_path = f"tests/test_{mod.rsplit('.', 1)[-1]}.py"
    src, names = _test_file([(mod, {c.fn.name for c in cases})], cases)
    files[test_path] = src
    for c, name in zip(cases, names):
      (f2p if id(c) in failing_ids else p2p).append(f"{test_path}::{name}")
  test_files = sorted({i.split("::")[0] for i in f2p + p2p})

  # The fix: one line of the buggy helper's file.
  path = file_of[helpers[buggy].name]
  bad_text = files[path]
  good_text = bad_text.replace(helpers[buggy].source(bad_body), helpers[buggy].source())
  bad_lines, good_lines = bad_text.split("\n"), good_text.split("\n")
  changed = [i for i, (a, b) in enumerate(zip(bad_lines, good_lines)) if a != b]
  if len(changed) != 1 or bad_text.count(bad_lines[changed[0]]) != 1:
    return None
  fix_edit = {"path": path, "old": bad_lines[changed[0]], "new": good_lines[changed[0]]}

  # Statements.
  case = failing[0]
  style = "specific" if level <= 1 else "indirect" if level == 2 else "vague"
  got, result = _got_text(case)
  fields = dict(call=_call(case.fn.name, case.args), got=got, result=result, want=repr(case.want),
                func=case.fn.name, file=file_of[case.fn.name],
                test_file=f2p[0].split("::")[0])
  statements = [s.format(**fields) for s in _STATEMENTS[style]]
  if level == 3:  # also a few concrete ones: vagueness varies per episode
    statements += [s.format(**fields) for s in _STATEMENTS["indirect"][:2]]
  return GeneratedTask(
      instance_id=instance_id, level=level,
      files={p: v.encode() for p, v in sorted(files.items())},
      fixed={path: good_text.encode()}, fail_to_pass=f2p, pass_to_pass=p2p,
      problem_statements=statements,
      test_command="python3 -m pytest -q " + " ".join(test_files), fix_edit=fix_edit)


SPLITS = ("train", "eval")
EVAL_PERCENT = 50  # share of the program space (by task_key) held out for evaluation


def task_key(g: GeneratedTask) -> str:
  """The task's program: the buggy file and the fix (statement wording and ids aside). Two
  tasks with one key are the same exercise; the train/eval split is made on it."""
  return hashlib.sha256(g.files[g.fix_edit["path"]] + b"\0" +
                        g.fix_edit["new"].encode()).hexdigest()


def split_of(g: GeneratedTask) -> str:
  """"eval" for EVAL_PERCENT % of the programs (by task_key), else "train": held-out tasks
  never share a program with a training task, however many of either are drawn."""
  return "eval" if int(task_key(g)[:8], 16) % 100 < EVAL_PERCENT else "train"


class SplitStream:
  """Generator indices of one split, in order: position p is the p-th task of (level, seed)
  whose `split_of` is `split` (`unique`: the p-th distinct program). Walks lazily; cached."""

  def __init__(self, level: int, seed: int, split: str, unique: bool = False,
               max_draws: int = 20_000):
    if split not in SPLITS:
      raise ValueError(f"split={split!r}: expected one of {SPLITS}")
    self.level, self.seed, self.split, self.unique = level, seed, split, unique
    self.max_draws = max_draws
    self._indices: list[int] = []
    self._keys: set[str] = set()
    self._next = 0

  def __getitem__(self, position: int) -> int:
    while len(self._indices) <= position:
      if self._next >= self.max_draws:
        raise ValueError(f"taskgen: only {len(self._indices)} {'distinct ' if self.unique else ''}"
                         f"{self.split!r} tasks at level={self.level} within {self.max_draws} "
                         "draws; ask for fewer or use a higher level")
      g = generate(self.level, self.seed, self._next)
      key = task_key(g)
      if split_of(g) == self.split and not (self.unique and key in self._keys):
        self._indices.append(self._next)
        self._keys.add(key)
      self._next += 1
    return self._indices[position]


@functools.lru_cache(maxsize=16)
def _stream(level: int, seed: int, split: str, unique: bool) -> SplitStream:
  return SplitStream(level, seed, split, unique)


def write_tasks(out_dir: str, n: int, level: int, seed: int, start: int = 0,
                split: Optional[str] = None, unique: bool = False) -> list[Task]:
  """Generate tasks start..start+n-1 into out_dir/repos/<id>/ and out_dir/tasks.jsonl (which
  is replaced); returns them as loaded from that file. With `split` ("train" | "eval"),
  positions start.. of that split's stream instead (SplitStream; `unique`: distinct programs)."""
  if n < 1:
    raise ValueError(f"n={n!r}: expected >= 1")
  if split is None:
    indices = list(range(start, start + n))
  else:
    stream = _stream(level, seed, split, unique)
    indices = [stream[p] for p in range(start, start + n)]
  os.makedirs(out_dir, exist_ok=True)
  jsonl = os.path.join(out_dir, "tasks.jsonl")
  with open(jsonl + ".tmp", "w", encoding="utf-8") as f:
    for index in indices:
      g = generate(level, seed, index)
      rel = f"repos/{g.instance_id}"
      for path, data in g.files.items():
        full = os.path.join(out_dir, rel, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as fh:
          fh.write(data)
      f.write(json.dumps(g.record(rel), sort_keys=True) + "\n")
  os.replace(jsonl + ".tmp", jsonl)
  return load_swe_jsonl(jsonl)


def main(argv: Optional[Sequence[str]] = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--n", type=int, required=True, help="number of tasks")
  p.add_argument("--level", type=int, default=0, choices=LEVELS, help="difficulty")
  p.add_argument("--seed", type=int, default=0, help="generator seed")
  p.add_argument("--start", type=int, default=0, help="index of the first task")
  p.add_argument("--out", required=True, help="output directory (tasks.jsonl + repos/)")
  args = p.parse_args(argv)
  tasks = write_tasks(args.out, args.n, args.level, args.seed, args.start)
  print(f"wrote {len(tasks)} level-{args.level} tasks to {os.path.join(args.out, 'tasks.jsonl')}")


if __name__ == "__main__":
  main()
