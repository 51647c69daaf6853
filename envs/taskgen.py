"""Procedurally generated bug-fixing tasks: small Python repositories with one planted bug.

Every task is a "swe" Task: a repository, pytest tests, FAIL_TO_PASS tests that fail on the
buggy code and pass with the reference fix, PASS_TO_PASS tests that pass on both, the fix as a
unified diff (`Task.patch`) and as a one-line edit (`metadata["fix_edit"] = {"path", "old",
"new"}`, for a scripted solver's `str_replace`), and several phrasings of the instruction, from
expert to colloquial. Generation is deterministic: the same (level, seed, index) always gives
the same task, byte for byte. The tables it draws from (function families and their bugs,
names, phrasings) are in envs/taskgen_templates.py.

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
from typing import Any, Callable, Mapping, Optional, Sequence

from envs.taskgen_templates import (API_MODULES, FAMILIES, HELPER_MODULES, LEVEL3_MODULES,
                                    MODULES, PACKAGES, POOLS, STATEMENTS, Family)
from envs.tasks import Task, load_swe_jsonl, make_patch

LEVELS = (0, 1, 2, 3)


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
  names = dict(zip(family.params, rng.choice(POOLS[family.pool])))
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
    """The SWE-format JSONL record of the task.

    Args:
      repo_path: where the repository is written, relative to the JSONL's directory.

    Returns:
      The record (`envs.tasks.swe_task_from_dict` reads it), with a content hash of the fixed
      repository and the fix as `fix_edit`.
    """
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
  """The task (level, seed, index): deterministic, independent of other indices.

  Args:
    level: difficulty, one of LEVELS.
    seed: the generator seed.
    index: the task's index.

  Returns:
    The generated task (not yet written).

  Raises:
    ValueError: level is not one of LEVELS.
    RuntimeError: no valid task within 100 draws (never seen in practice).
  """
  if level not in LEVELS:
    raise ValueError(f"level={level!r}: expected one of {LEVELS}")
  rng = random.Random(f"arbor-taskgen/{seed}/{level}/{index}")
  for _ in range(100):  # a draw can fail (no distinguishing input, clashing names): redraw
    task = _try_generate(level, rng, f"gen-l{level}-s{seed}-{index:05d}")
    if task is not None:
      return task
  raise RuntimeError(f"taskgen: no valid task for level={level} seed={seed} index={index}")


@dataclasses.dataclass
class _Program:
  """The functions of one generated repository and its planted bug."""

  helpers: list[_Fn]
  composites: list[_Fn]  # public functions built on the helpers (levels 2-3), one per helper
  buggy: int             # index of the helper with the bug
  bad_body: str          # that helper's buggy body

  @property
  def functions(self) -> list[_Fn]:
    return self.helpers + self.composites

  def source(self, fns: Sequence[_Fn], bad: bool) -> str:
    """Source of `fns`, with the bug when `bad`."""
    return "\n\n".join(f.source(self.bad_body if bad and f is self.helpers[self.buggy] else None)
                       for f in fns)


def _draw_program(level: int, rng: random.Random) -> Optional[_Program]:
  """The helpers (one buggy), and their public composites at levels 2-3; None on a name clash
  or an ambiguous bug."""
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
  return _Program(list(helpers), composites, buggy, bad_body)


def _draw_cases(level: int, program: _Program, rng: random.Random
                ) -> Optional[tuple[list[_Case], list[_Case], list[_Case]]]:
  """(failing, agreeing, others): cases of the function the statement names (the buggy helper
  at levels 0-1, its public composite at 2-3) that the bug fails (F2P) or not, and passing
  cases of every other function (P2P); None when the bug shows on no input, or leaks into
  another function."""
  functions = program.functions
  good = _namespace(program.source(functions, False))
  bad = _namespace(program.source(functions, True))
  helper = program.helpers[program.buggy]
  target = program.composites[program.buggy] if level >= 2 else helper
  target_cases = _cases(target, good, bad, rng)
  failing = [c for c in target_cases if c.fails][:2]
  agreeing = [c for c in target_cases if not c.fails][:1]
  if not failing:
    return None
  others = []
  for fn in functions:
    if fn is target or fn is helper:
      continue
    cases = _cases(fn, good, bad, rng, draws=20)
    if len(cases) < 1 or any(c.fails for c in cases):
      return None
    others += cases[:2 if level < 2 else 1]
  return failing, agreeing, others


def _layout(level: int, program: _Program, rng: random.Random
            ) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
  """(files, file of each function, module of each function): one module at levels 0-1, a
  package of helper modules and an API module at 2-3. Sources hold the bug."""
  helpers, composites = program.helpers, program.composites
  files: dict[str, str] = {}
  if level <= 1:
    mod = rng.choice(MODULES)
    files[f"{mod}.py"] = program.source(helpers, True)
    return files, {h.name: f"{mod}.py" for h in helpers}, {h.name: mod for h in helpers}
  pkg = rng.choice(PACKAGES)
  files[f"{pkg}/__init__.py"] = ""
  if level == 2:
    hmods = [rng.choice(HELPER_MODULES)] * len(helpers)
  else:
    pair = rng.choice(LEVEL3_MODULES)
    hmods = [pair[i % 2] for i in range(len(helpers))]
  api = rng.choice(API_MODULES)
  file_of, modname = {}, {}
  for m in dict.fromkeys(hmods):
    fns = [h for h, hm in zip(helpers, hmods) if hm == m]
    files[f"{pkg}/{m}.py"] = program.source(fns, True)
    for h in fns:
      file_of[h.name], modname[h.name] = f"{pkg}/{m}.py", f"{pkg}.{m}"
  imports = "".join(f"from {pkg}.{m} import "
                    f"{', '.join(h.name for h, hm in zip(helpers, hmods) if hm == m)}\n"
                    for m in dict.fromkeys(hmods))
  files[f"{pkg}/{api}.py"] = imports + "\n\n" + program.source(composites, True)
  for c in composites:
    file_of[c.name], modname[c.name] = f"{pkg}/{api}.py", f"{pkg}.{api}"
  return files, file_of, modname


def _write_tests(files: dict[str, str], modname: Mapping[str, str], failing: list[_Case],
                 cases: list[_Case]) -> tuple[list[str], list[str]]:
  """Adds one test module per source module to `files`, holding the cases of its functions;
  (FAIL_TO_PASS ids: the `failing` ones, PASS_TO_PASS ids)."""
  by_module: dict[str, list[_Case]] = {}
  for c in cases:
    by_module.setdefault(modname[c.fn.name], []).append(c)
  f2p, p2p, failing_ids = [], [], {id(c) for c in failing}
  for mod, mod_cases in sorted(by_module.items()):
    test_path = f"tests/test_{mod.rsplit('.', 1)[-1]}.py"
    src, names = _test_file([(mod, {c.fn.name for c in mod_cases})], mod_cases)
    files[test_path] = src
    for c, name in zip(mod_cases, names):
      (f2p if id(c) in failing_ids else p2p).append(f"{test_path}::{name}")
  return f2p, p2p


def _fix(files: Mapping[str, str], file_of: Mapping[str, str], program: _Program
         ) -> Optional[tuple[str, dict[str, str]]]:
  """(the fixed file's text, the one-line str_replace that fixes it); None unless the fix is
  exactly one unique line."""
  helper = program.helpers[program.buggy]
  path = file_of[helper.name]
  bad_text = files[path]
  good_text = bad_text.replace(helper.source(program.bad_body), helper.source())
  bad_lines, good_lines = bad_text.split("\n"), good_text.split("\n")
  changed = [i for i, (a, b) in enumerate(zip(bad_lines, good_lines)) if a != b]
  if len(changed) != 1 or bad_text.count(bad_lines[changed[0]]) != 1:
    return None
  return good_text, {"path": path, "old": bad_lines[changed[0]], "new": good_lines[changed[0]]}


def _statements(level: int, case: _Case, file_of: Mapping[str, str], test_file: str
                ) -> list[str]:
  """The phrasings of the instruction about a failing `case`, from expert to colloquial:
  specific at levels 0-1, indirect at 2, vague at 3 (plus two indirect ones)."""
  style = "specific" if level <= 1 else "indirect" if level == 2 else "vague"
  got, result = _got_text(case)
  fields = dict(call=_call(case.fn.name, case.args), got=got, result=result, want=repr(case.want),
                func=case.fn.name, file=file_of[case.fn.name], test_file=test_file)
  statements = [s.format(**fields) for s in STATEMENTS[style]]
  if level == 3:  # also a few concrete ones: vagueness varies per episode
    statements += [s.format(**fields) for s in STATEMENTS["indirect"][:2]]
  return statements


def _try_generate(level: int, rng: random.Random, instance_id: str) -> Optional[GeneratedTask]:
  """One draw of a task; None when the draw fails (then `generate` draws again)."""
  program = _draw_program(level, rng)
  if program is None:
    return None
  cases = _draw_cases(level, program, rng)
  if cases is None:
    return None
  failing, agreeing, others = cases
  files, file_of, modname = _layout(level, program, rng)
  f2p, p2p = _write_tests(files, modname, failing, failing + agreeing + others)
  fix = _fix(files, file_of, program)
  if fix is None:
    return None
  good_text, fix_edit = fix
  test_files = sorted({i.split("::")[0] for i in f2p + p2p})
  return GeneratedTask(
      instance_id=instance_id, level=level,
      files={p: v.encode() for p, v in sorted(files.items())},
      fixed={fix_edit["path"]: good_text.encode()}, fail_to_pass=f2p, pass_to_pass=p2p,
      problem_statements=_statements(level, failing[0], file_of, f2p[0].split("::")[0]),
      test_command="python3 -m pytest -q " + " ".join(test_files), fix_edit=fix_edit)


SPLITS = ("train", "eval")
EVAL_PERCENT = 50  # share of the program space (by task_key) held out for evaluation


def task_key(g: GeneratedTask) -> str:
  """The task's program: the buggy file and the fix (statement wording and ids aside).

  Two tasks with one key are the same exercise; the train/eval split is made on it.

  Args:
    g: a generated task.

  Returns:
    A sha256 hex digest.
  """
  return hashlib.sha256(g.files[g.fix_edit["path"]] + b"\0" +
                        g.fix_edit["new"].encode()).hexdigest()


def split_of(g: GeneratedTask) -> str:
  """The split a task's program belongs to.

  Held-out tasks never share a program with a training task, however many of either are drawn.

  Args:
    g: a generated task.

  Returns:
    "eval" for EVAL_PERCENT % of the programs (by `task_key`), else "train".
  """
  return "eval" if int(task_key(g)[:8], 16) % 100 < EVAL_PERCENT else "train"


class SplitStream:
  """Generator indices of one split, in order, found lazily and cached.

  `stream[p]` is the index of the p-th task of (level, seed) whose `split_of` is `split` (with
  `unique`: of the p-th distinct program).

  Args:
    level: difficulty, one of LEVELS.
    seed: the generator seed.
    split: "train" or "eval".
    unique: skip tasks whose program (`task_key`) was already taken.
    max_draws: generator indices walked at most; asking past them raises ValueError.

  Raises:
    ValueError: split is not one of SPLITS.
  """

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
  """Generates tasks into out_dir/repos/<id>/ and out_dir/tasks.jsonl (which is replaced).

  Args:
    out_dir: the output directory.
    n: how many tasks.
    level: difficulty, one of LEVELS.
    seed: the generator seed.
    start: the first generator index (or, with `split`, the first position in that split).
    split: "train" | "eval": positions start.. of that split's stream (`SplitStream`) instead
      of generator indices.
    unique: with `split`, distinct programs only.

  Returns:
    The tasks, as loaded from the written file.

  Raises:
    ValueError: n < 1, a bad level or split, or the split has too few tasks.
  """
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
  """The command line: `python -m envs.taskgen --n N --level L --seed S --out DIR`."""
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
