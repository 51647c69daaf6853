"""The instances' SWE rows and where their repositories live: the git mirror (every row) and
the working trees (optional, the layout of earlier versions).

Mirror (`OUT/mirror/<owner>__<name>.git`, bare, written by `envs.synth.mirror.MirrorWriter`):
branch `main` is the clean source as one root commit ("<package> <version>"); each instance is
a branch named after its `instance_id` whose head is the bug commit ("Bug Patch", parent the
clean commit), SWE-smith's layout of one branch per instance. In the bug commit the mutated
file holds the bug and, with `hide_tests`, the files of the FAIL_TO_PASS tests are removed.
`git diff BUG CLEAN` is then exactly `patch` (the fix of the code) plus `test_patch` (the
hidden test files put back): a pull request split the way SWE-bench splits one. All commits
carry the source commit's date (a git source) or `SOURCE_EPOCH`, and a fixed author, so the
same source and options give the same commit ids.

The mirror's history shows each bug commit's diff: hand agents a checkout of `base_commit`
(what `envs.tasks` does), never the mirror.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from typing import Mapping, Optional, Sequence

from envs import environments
from envs.synth.mirror import EXECUTABLE, FILE, MirrorWriter
from envs.synth.runs import TestCommand, test_file
from envs.synth.source import Source
from envs.tasks import apply_patch, reverse_patch

MAIN = "main"            # the mirror's branch of the clean source
BUG_SUBJECT = "Bug Patch"  # SWE-smith's subject of the commit that plants the bug


def slug(text: str) -> str:
  """`text` with runs of characters other than letters, digits, "_", "." and "-" as "_"."""
  return re.sub(r"[^\w.-]+", "_", text).strip("_") or "repo"


def mirror_dir(out: str, repo: str) -> str:
  """OUT/mirror/<owner>__<name>.git: where `envs.tasks.find_mirror(OUT/mirror, repo)` looks."""
  return os.path.join(out, "mirror", repo.replace("/", "__") + ".git")


def buggy_file(source: Source, row: Mapping) -> bytes:
  """The mutated file of a row's instance (its fix reversed on the clean file)."""
  path = row["mutation"]["path"]
  return apply_patch({path: source.files[path]}, reverse_patch(row["patch"]))[path]


def hidden_tests(row: Mapping, command: TestCommand, paths: Sequence[str]) -> list[str]:
  """The files of a row's FAIL_TO_PASS tests (`envs.synth.runs.test_file`) that exist in the
  source and are not the runner's own; tests whose file the id does not tell stay."""
  files = {test_file(t, command.runner, paths) for t in row["FAIL_TO_PASS"]}
  return sorted(f for f in files if f in set(paths) and f not in command.runner_files)


def _clean(writer: MirrorWriter, source: Source) -> tuple[dict, str]:
  """Writes the clean source's commit (branch `main`, HEAD); (its {path: (mode, blob)}, id)."""
  blobs = writer.blobs(source.files)
  entries = {p: (EXECUTABLE if p in source.executables else FILE, blobs[p])
             for p in sorted(source.files)}
  message = f"{source.package} {source.version}".strip() + "\n"
  if source.base_commit:
    message += f"\nSource commit {source.base_commit}\n"
  clean = writer.commit(writer.tree(entries), [], message, source.date)
  writer.set_branch(MAIN, clean)
  writer.set_head(MAIN)
  return entries, clean


def clean_commit(out: str, repo: str, source: Source) -> str:
  """The mirror's clean commit (written now if it is not there yet: the same id either way)."""
  return _clean(MirrorWriter(mirror_dir(out, repo)), source)[1]


def write_mirror(out: str, repo: str, source: Source, rows: Sequence[dict],
                 command: TestCommand, hide_tests: bool) -> dict[str, dict]:
  """Writes the mirror (module docstring) and returns each row's repository fields.

  Args:
    out: the output directory.
    repo: the rows' "owner/name".
    source: the clean source.
    rows: the accepted rows (instance_id, patch, FAIL_TO_PASS, mutation).
    command: the test command (the runner tells test files from test ids).
    hide_tests: remove the FAIL_TO_PASS tests' files in the bug commits.

  Returns:
    {instance_id: {"base_commit", "environment_setup_commit", "test_patch", "hidden_tests"}}.
  """
  writer = MirrorWriter(mirror_dir(out, repo))
  paths = sorted(source.files)
  entries, clean = _clean(writer, source)
  out_fields = {}
  for row in rows:
    path = row["mutation"]["path"]
    hidden = hidden_tests(row, command, paths) if hide_tests else []
    bug_entries = dict(entries)
    bug_entries[path] = (entries[path][0],
                         writer.blobs({path: buggy_file(source, row)})[path])
    for p in hidden:
      del bug_entries[p]
    bug = writer.commit(writer.tree(bug_entries), [clean], BUG_SUBJECT + "\n", source.date)
    writer.set_branch(row["instance_id"], bug)
    out_fields[row["instance_id"]] = {
        "base_commit": bug, "environment_setup_commit": clean,
        "test_patch": writer.diff(bug, clean, hidden) if hidden else "", "hidden_tests": hidden}
  return out_fields


def write_tree(out: str, base: str, files: Mapping[str, bytes], changed: Mapping[str, bytes],
               removed: Sequence[str], name: str) -> str:
  """OUT/repos/NAME: the files (less `removed`, with `changed`), unchanged ones hard-linked to
  `base` (copied when linking fails); written to a temporary folder renamed into place."""
  final = os.path.join(out, "repos", name)
  if os.path.isdir(final):
    return final
  os.makedirs(os.path.dirname(final), exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(final))
  try:
    for path in files:
      if path in removed:
        continue
      target = os.path.join(tmp, path)
      os.makedirs(os.path.dirname(target), exist_ok=True)
      if path in changed:
        with open(target, "wb") as f:
          f.write(changed[path])
        continue
      try:
        os.link(os.path.join(base, path), target)
      except OSError:
        shutil.copyfile(os.path.join(base, path), target)
    os.rename(tmp, final)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return final


def write_base(out: str, files: Mapping[str, bytes]) -> str:
  """OUT/base: the clean source's files, written once (the trees' hard links point here)."""
  base = os.path.join(out, "base")
  if not os.path.isdir(base):
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=out)
    for path, data in files.items():
      os.makedirs(os.path.dirname(os.path.join(tmp, path)), exist_ok=True)
      with open(os.path.join(tmp, path), "wb") as f:
        f.write(data)
    os.rename(tmp, base)
  return base


def environment(files: Mapping[str, bytes], repository: str):
  """The spec that `envs.environments`' `from_repository` reads from the clean source's
  metadata (an `envs.environments` Environment), or None while it offers none.

  Args:
    files: the clean source's files.
    repository: "owner/name@<clean commit>": what the spec's install step builds from (the
      same for every instance, as SWE-bench's environment_setup_commit is).

  Raises:
    ValueError: the metadata gives no valid spec (the spec's SpecError names the field).
  """
  return environments.from_repository(files, repository=repository)


def swe_row(row: Mapping, fields: Mapping, command: TestCommand, trees: bool,
            env: Optional[dict]) -> dict:
  """A journal row as written to OUT/tasks.jsonl: SWE-bench's fields in SWE-bench's types
  (FAIL_TO_PASS / PASS_TO_PASS as JSON strings), then Arbor's.

  Args:
    row: the journal's row (lists of test ids; older journals' rows too).
    fields: its `write_mirror` fields.
    command: the test command.
    trees: give `repo_path` (OUT/repos/<instance_id>).
    env: the `environment`, or None.
  """
  def ids(field):
    v = row[field]
    return v if isinstance(v, str) else json.dumps(list(v))
  out = {"instance_id": row["instance_id"], "repo": row["repo"],
         "base_commit": fields["base_commit"], "patch": row["patch"],
         "test_patch": fields["test_patch"], "problem_statement": row["problem_statement"],
         "hints_text": row.get("hints_text", ""), "created_at": row["created_at"],
         "version": row["version"], "FAIL_TO_PASS": ids("FAIL_TO_PASS"),
         "PASS_TO_PASS": ids("PASS_TO_PASS"),
         "environment_setup_commit": fields["environment_setup_commit"],
         "test_command": command.command, "log_parser": command.log_parser,
         "timeout": row["timeout"], "problem_statements": row["problem_statements"],
         "difficulty": row["difficulty"], "mutation": row["mutation"], "source": row["source"],
         "statement_source": row["statement_source"]}
  if trees:
    out["repo_path"] = f"repos/{row['instance_id']}"
  if env is not None:
    out["environment"] = env
  return out
