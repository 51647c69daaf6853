"""The candidate bugs of a source: seeded samples of `envs.mutate` mutations per kind, and
reverts of chosen commits' changed functions."""

from __future__ import annotations

import hashlib
import logging
import random
from typing import Collection, Mapping, Sequence

from envs import safe_git
from envs.mutate import Mutation, commit_reverts, is_test_file, mutations
from envs.synth.source import Source
from envs.verifiers.swe import is_test_path, refused_reason

log = logging.getLogger(__name__)

REVERT = "revert"  # the kind of commit_reverts' candidates
# Top-level folders whose code the test suite does not exercise as the package.
_SKIP_TOP = {"docs", "doc", "examples", "example", "benchmarks", "bench", "scripts", "tools",
             "build", "dist", ".tox", ".nox", ".venv", "venv"}


def mutable_paths(files: Mapping[str, bytes], runner_files: Collection[str] = ()) -> list[str]:
  """The .py files that candidates may change: not tests (by `envs.mutate.is_test_file` and the
  verifier's rules, which would restore them), not the test runner's own files
  (`runner_files`, restored like tests), not configuration the verifier refuses to change, not
  docs / examples / build folders."""
  return [p for p in sorted(files) if p.endswith(".py") and not is_test_file(p)
          and not is_test_path(p) and refused_reason(p) is None and p not in runner_files
          and p.split("/", 1)[0] not in _SKIP_TOP]


def difficulty(fix: str, n_fail_to_pass: int) -> str:
  """"easy" | "medium" | "hard" from the fix's changed lines and the FAIL_TO_PASS count (the
  rule is in the module docstring)."""
  changed = sum(1 for l in fix.splitlines()
                if l[:1] in "+-" and not l.startswith(("+++", "---")))
  if changed <= 2 and n_fail_to_pass >= 3:
    return "easy"
  if changed >= 6 or n_fail_to_pass == 1 and changed >= 3:
    return "hard"
  return "medium"


def candidate_key(m: Mutation) -> str:
  """A stable id of a candidate: its kind, file and mutated text."""
  return hashlib.sha256(f"{m.kind}\0{m.path}\0{m.source}".encode()).hexdigest()[:16]


def draw_candidates(source: Source, config, runner_files: Collection[str] = ()
                    ) -> tuple[list[Mutation], dict]:
  """The candidates to evaluate, in evaluation order (kinds interleaved).

  Args:
    source: the source.
    config: a `SynthConfig` (its kinds, max_per_kind, commits and seed).
    runner_files: the test runner's files (never mutated).

  Returns:
    (candidates, {"no_change", "syntax_error", "duplicate", "skipped_files"}: counts of
    mutations dropped before any test run).
  """
  dropped = {"no_change": 0, "syntax_error": 0, "duplicate": 0, "skipped_files": 0,
             "revert_of_changed_file": 0}
  kinds = tuple(k for k in config.kinds if k != REVERT)
  pool: dict[str, list[Mutation]] = {k: [] for k in config.kinds}
  texts = {}
  for path in mutable_paths(source.files, runner_files):
    try:
      texts[path] = source.files[path].decode("utf-8")
      found = mutations(texts[path], path, kinds, seed=config.seed) if kinds else []
    except (UnicodeDecodeError, SyntaxError, ValueError) as e:
      log.warning("synth: %s skipped: %s", path, e)
      dropped["skipped_files"] += 1
      continue
    for m in found:
      pool.setdefault(m.kind, []).append(m)
  if config.commits:
    if not source.repo_dir:
      raise ValueError(f"commits={list(config.commits)!r}: only a git repository has commits")
    git_dir = safe_git.find_git_dir(source.repo_dir)
    for rev in config.commits:
      for m in commit_reverts(source.repo_dir, rev):
        # The mutated text is the file at `rev`: it fits HEAD's tree only if HEAD has that file.
        if m.path in texts and safe_git.read_blob(git_dir, rev, m.path).decode(
            "utf-8", "replace").strip() == texts[m.path].strip():
          pool.setdefault(REVERT, []).append(m)
        else:
          dropped["revert_of_changed_file"] += 1
  seen = set()
  per_kind = []
  for kind, found in pool.items():
    kept = []
    for m in found:
      key = candidate_key(m)
      if m.source == texts.get(m.path):
        dropped["no_change"] += 1
      elif key in seen:
        dropped["duplicate"] += 1
      else:
        try:
          compile(m.source, m.path, "exec", dont_inherit=True)
        except (SyntaxError, ValueError):
          dropped["syntax_error"] += 1
          continue
        seen.add(key)
        kept.append(m)
    if config.max_per_kind is not None and len(kept) > config.max_per_kind:
      rng = random.Random(f"{config.seed}/{kind}")
      kept = [kept[i] for i in sorted(rng.sample(range(len(kept)), config.max_per_kind))]
    per_kind.append(kept)
  order = [m for round_ in _zip_longest(per_kind) for m in round_]
  return order, dropped


def _zip_longest(lists: Sequence[list]) -> list[list]:
  return [[l[i] for l in lists if i < len(l)] for i in range(max(map(len, lists), default=0))]

