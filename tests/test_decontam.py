"""envs.decontam: planted copies of eval text are found whatever their case, punctuation or
surroundings; template boilerplate and unrelated text are not; the shipped eval sets (SWE
instances, LiveCodeBench rows, Terminal-Bench tasks, the PyPI sample) share nothing with
generated training tasks or the SFT demo's episodes; the command line filters a file."""

import json
import os

import pytest

from envs import decontam, taskgen
from envs.decontam import EvalIndex, load_items
from trainer.demo_data import demo_corpus

DATA = os.path.join(os.path.dirname(__file__), "..", "envs", "data")
SWE = os.path.join(DATA, "swe", "tasks.jsonl")


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
  d = tmp_path_factory.mktemp("gen")
  taskgen.write_tasks(str(d), 30, 0, 3, split="train")
  return load_items(str(d / "tasks.jsonl"))


def test_planted_overlaps_are_found_and_nothing_else(generated):
  swe = load_items(SWE)
  target = swe["intervals-1"]
  statement, patch = target["problem_statement"], target["patch"]
  span = " ".join(statement.split()[:16])
  train = dict(generated)
  train["copied_statement"] = {"messages": [
      {"role": "user", "content": "Here is an old report.\n\n" + statement.upper() + "\nThanks!"}]}
  train["copied_patch"] = {"patch": patch}
  train["copied_span"] = {"text": "As someone wrote: " + span.replace(" ", " ,  ") + " -- end."}
  report = EvalIndex(swe).report(train)
  assert set(report["flagged"]) == {"copied_statement", "copied_patch", "copied_span"}
  assert report["eval_items_hit"] == ["intervals-1"]
  (patch_hit,) = report["flagged"]["copied_patch"]
  assert patch_hit["exact"] and patch_hit["containment"] == 1.0
  span_hit = report["flagged"]["copied_span"][0]
  assert not span_hit["exact"] and span_hit["shared"] == len(decontam.words(span)) - 13 + 1
  # the shipped eval instances and generated training tasks share nothing
  assert EvalIndex(swe).report(generated)["flagged"] == {}


def test_boilerplate_is_not_a_leak():
  template = "please fix the function so that all of the tests in the test file pass again now"
  evals = {f"e{i}": {"problem_statement": f"{template} (case {i})"} for i in range(12)}
  evals["e_unique"] = {"problem_statement": "the parser drops the last token of every quoted "
                                             "string when the input ends without a newline"}
  train = {"t0": {"text": template + " for the parser"},
           "t1": {"text": "Why does the parser drop the last token of every quoted string when "
                          "the input ends without a newline?"}}
  report = EvalIndex(evals, common=8).report(train)
  assert set(report["flagged"]) == {"t1"} and report["boilerplate_ngrams"] > 0
  assert set(EvalIndex(evals, common=20).report(train)["flagged"]) == {"t0", "t1"}
  with pytest.raises(ValueError, match="n=0"):
    EvalIndex(evals, n=0)


def test_command_line_writes_the_clean_records(tmp_path, capsys):
  rows = [{"id": "clean", "text": "nothing to see here at all, just some ordinary training text "
                                  "about sorting lists and dictionaries in python"},
          {"id": "leak", "text": json.loads(open(SWE).readline())["problem_statement"]}]
  train = tmp_path / "train.jsonl"
  train.write_text("".join(json.dumps(r) + "\n" for r in rows))
  out, rep = tmp_path / "kept.jsonl", tmp_path / "report.json"
  assert decontam.main(["--train", str(train), "--eval", SWE, "--out", str(out),
                        "--report", str(rep)]) == 0
  assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["clean"]
  assert list(json.loads(rep.read_text())["flagged"]) == ["leak"]
  assert json.loads(capsys.readouterr().out)["flagged"] == 1
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"id": 1}\nnot json\n')
  with pytest.raises(ValueError, match="bad.jsonl:2"):
    load_items(str(bad))


def shipped_eval_items() -> dict:
  """Every bundled eval set, as decontam items: rows as stored, Terminal-Bench tasks as the
  text of each file of the task directory."""
  items = {}
  for path in (SWE, os.path.join(DATA, "livecodebench", "problems.jsonl"),
               os.path.join(DATA, "livecodebench", "solutions.jsonl"),
               os.path.join(DATA, "pypi", "sample", "tasks.jsonl")):
    items.update({f"{path}:{k}": v for k, v in load_items(path).items()})
  tb = os.path.join(DATA, "terminal_bench")
  for task in sorted(os.listdir(tb)):
    for root, _, files in os.walk(os.path.join(tb, task)):
      for f in files:
        with open(os.path.join(root, f)) as fh:
          items[f"{task}/{f}"] = {"text": fh.read()}
  return items


def test_shipped_eval_sets_share_nothing_with_training_data(tmp_path):
  evals = shipped_eval_items()
  assert len(evals) > 40
  train = {}
  for level in range(4):
    taskgen.write_tasks(str(tmp_path / str(level)), 20, level, 1, split="train")
    train.update({f"{level}:{k}": v for k, v in
                  load_items(str(tmp_path / str(level) / "tasks.jsonl")).items()})
  train.update({f"sft_demo:{i}": {"text": t} for i, t in enumerate(demo_corpus(n=16))})
  report = EvalIndex(evals).report(train)
  assert report["flagged"] == {}
  # and the index does see into these sets: a copied LiveCodeBench statement is found
  lcb = next(v for k, v in evals.items() if "problems.jsonl" in k)
  train["copy"] = {"text": lcb["question_content"]}
  assert set(EvalIndex(evals).report(train)["flagged"]) == {"copy"}
