"""envs.pypi_tasks: packages.json agrees with the bundled tarballs (sha256, licence inside,
PKG-INFO name and version), a tampered tarball is refused, and tasks synthesized from the
fastest bundled suite verify in fresh sandboxes (gold patch passes every FAIL_TO_PASS and
PASS_TO_PASS test, the unfixed tree fails some FAIL_TO_PASS test): a shipped sample of ten, and
a live synthesis of two candidates that goes on to the combined eval file and an export."""

import email.parser
import hashlib
import json
import os
import shutil
import tarfile

import pytest

from envs import pypi_tasks, synth
from envs.tasks import apply_patch, is_cache_path, load_repo_files, load_swe_jsonl, patch_files
from envs.validate import validate

LICENCE_WORDS = {"MIT": "Permission is hereby granted, free of charge",
                 "BSD-3-Clause": "Neither the name of"}


def test_packages_json_matches_the_bundled_tarballs():
  packages = pypi_tasks.bundled_packages()
  assert len(packages) >= 3
  with open(os.path.join(pypi_tasks.DATA_DIR, "packages.json")) as f:
    entries = json.load(f)
  assert [p.name for p in packages] == [e["name"] for e in entries]
  for p in packages:
    with open(p.source, "rb") as f:
      assert hashlib.sha256(f.read()).hexdigest() == p.sha256
    assert p.url.startswith("https://files.pythonhosted.org/packages/")
    assert p.url.endswith("/" + os.path.basename(p.source))
    assert p.test_command.startswith("python3 -m pytest")
    with tarfile.open(p.source) as tar:
      names = tar.getnames()
      assert all(n == p.root or n.startswith(p.root + "/") for n in names)
      licence = tar.extractfile(f"{p.root}/{p.licence_file}").read().decode()
      info = email.parser.Parser().parsestr(tar.extractfile(f"{p.root}/PKG-INFO").read().decode())
    assert LICENCE_WORDS[p.licence] in licence
    assert (info["Name"], info["Version"]) == (p.name, p.version)


def test_a_tampered_or_malformed_bundle_is_refused(tmp_path):
  p = pypi_tasks.bundled_packages()[0]
  shutil.copy(os.path.join(pypi_tasks.DATA_DIR, "packages.json"), tmp_path)
  with open(p.source, "rb") as f:
    data = bytearray(f.read())
  data[len(data) // 2] ^= 1
  (tmp_path / os.path.basename(p.source)).write_bytes(bytes(data))
  for other in pypi_tasks.bundled_packages()[1:]:
    shutil.copy(other.source, tmp_path)
  with pytest.raises(ValueError, match=r"\[0\]\.sha256="):
    pypi_tasks.bundled_packages(str(tmp_path))
  entries = json.loads((tmp_path / "packages.json").read_text())
  entries[1]["test_command"] = ""
  (tmp_path / "packages.json").write_text(json.dumps(entries))
  with pytest.raises(ValueError, match=r"\[1\]\.test_command=''"):
    pypi_tasks.bundled_packages(str(tmp_path), check=False)
  with pytest.raises(ValueError, match="package='nope'"):
    pypi_tasks.get_package("nope")


# The fastest bundled suite (455 tests in about 0.2 s): the sample's package.
FAST = "inflection"
SAMPLE = os.path.join(pypi_tasks.DATA_DIR, "sample", "tasks.jsonl")


def release_files(package: pypi_tasks.Package) -> dict[str, bytes]:
  """The files of the unmodified sdist, as `envs.tasks` reads a tree (caches left out)."""
  with tarfile.open(package.source) as tar:
    files = {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar if m.isfile()}
  return {p: data for p, data in files.items() if not is_cache_path(p)}


def check_one_bug(task, package: pypi_tasks.Package, release: dict[str, bytes]) -> None:
  """The task's tree is the release with one changed file, which the gold patch restores."""
  assert task.repo == package.repo
  # Rows of envs.synth carry the command with -rA (the shipped sample predates that).
  assert task.test_command in (package.test_command,
                               synth.parse_test_command(package.test_command).command)
  assert task.fail_to_pass and task.pass_to_pass
  buggy = load_repo_files(task)
  assert buggy.keys() == release.keys()
  changed = [p for p in release if buggy[p] != release[p]]
  assert len(changed) == 1 and changed == patch_files(task.patch)
  assert apply_patch(buggy, task.patch) == release


def test_sample_tasks_validate_in_fresh_sandboxes():
  """Ten rows envs.synth wrote for the package (shipped in envs/data/pypi/sample/)."""
  package = pypi_tasks.get_package(FAST)
  release = release_files(package)
  tasks = load_swe_jsonl(SAMPLE)
  assert len(tasks) == 10 and len({t.metadata["mutation"]["kind"] for t in tasks}) >= 5
  for task in tasks:
    check_one_bug(task, package, release)
    assert task.environment == pypi_tasks.package_environment(package)
  report = validate(tasks, runs=1, workers=2)  # in sandboxes of that environment
  assert report["rejected"] == {} and len(report["accepted"]) == len(tasks)
  for task in tasks:
    (gold,), (empty,) = (report["instances"][task.instance_id][k] for k in ("gold", "empty"))
    assert all(gold[t] == "passed" for t in task.fail_to_pass + task.pass_to_pass)
    assert any(empty[t] in ("failed", "error") for t in task.fail_to_pass)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
  """A live synthesis of two candidates (both give a task at seed 0)."""
  out = tmp_path_factory.mktemp("pypi")
  report = pypi_tasks.synthesize(FAST, str(out / FAST), kinds=("comparison", "wrong_variable"),
                                 max_per_kind=1, runs=1, workers=2)
  return out, report


def test_live_synthesis_and_the_combined_file(live):
  out, report = live
  package = pypi_tasks.get_package(FAST)
  release = release_files(package)
  assert (report["candidates"], report["evaluated"], report["instances"]) == (2, 2, 2)
  assert report["tests"] == report["candidate_tests"] == 455
  assert pypi_tasks.combine(str(out), [FAST]) == 2
  tasks = load_swe_jsonl(str(out / pypi_tasks.COMBINED))  # repo_path relative to `out`
  assert len({t.instance_id for t in tasks}) == 2
  for task in tasks:
    check_one_bug(task, package, release)
    # validated in the package's environment, and graded there (tests/test_task_environments.py)
    assert task.environment == pypi_tasks.package_environment(package)


def test_export_packs_each_tree_into_one_tarball(live, tmp_path):
  out, _ = live
  tasks = load_swe_jsonl(str(out / FAST / "tasks.jsonl"))
  ids = [t.instance_id for t in reversed(tasks)]
  assert pypi_tasks.export(str(out / FAST / "tasks.jsonl"), str(tmp_path), ids) == 2
  exported = load_swe_jsonl(str(tmp_path / "tasks.jsonl"))
  assert [t.instance_id for t in exported] == ids
  for a, b in zip(reversed(tasks), exported):
    assert b.repo_path.endswith(".tar.gz") and load_repo_files(a) == load_repo_files(b)
    assert (a.patch, a.fail_to_pass, a.pass_to_pass) == (b.patch, b.fail_to_pass, b.pass_to_pass)
  with pytest.raises(ValueError, match="instance_id='nope'"):
    pypi_tasks.export(str(out / FAST / "tasks.jsonl"), str(tmp_path), ["nope"])


@pytest.mark.parametrize("repo_path", ["/etc", "../outside", "link"])
def test_export_packs_nothing_from_outside_the_tasks_folder(tmp_path, repo_path):
  data, outside = tmp_path / "data", tmp_path / "outside"
  data.mkdir(), outside.mkdir()
  (outside / "secret.txt").write_text("host file")
  (data / "link").symlink_to(outside)
  (data / "tasks.jsonl").write_text(json.dumps({"instance_id": "x", "repo_path": repo_path}) + "\n")
  with pytest.raises(ValueError, match=r"instance_id='x' field 'repo_path'"):
    pypi_tasks.export(str(data / "tasks.jsonl"), str(tmp_path / "out"), ["x"])
  assert not list((tmp_path / "out" / "repos").iterdir())
