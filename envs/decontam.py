"""Decontamination: word n-gram and exact-match overlap of training data against eval sets.

    index = EvalIndex(load_items("heldout_tasks.jsonl"), n=13)
    report = index.report(load_items("sft.jsonl"))       # which records overlap which eval items
    kept = [r for r in rows if r["id"] not in report["flagged"]]

    python -m envs.decontam --train sft.jsonl --eval heldout.jsonl --report r.json --out kept.jsonl

An item is any JSON record (a task row, an SFT record, a trajectory): its texts are every string
in it with at least `n` words (problem statements, patches, test files, messages, tool
arguments); shorter strings (ids, paths, test names) are left out, since they repeat across
unrelated items. Texts are normalised to lower-case runs of letters, digits and underscores, so
case, punctuation, indentation and diff markers do not hide a copy. A training item overlaps an
eval item when they share a word n-gram (13 words by default, as in the GPT-3 and Llama
decontamination reports) or a whole normalised text. An n-gram found in more than `common` eval
items is boilerplate (a task template's sentence, a diff header, a licence line), not a leak,
and is not counted. The report gives, per flagged item, each eval item it overlaps, the shared
n-grams and the share of the item's n-grams found in it.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import re
import sys
from typing import Any, Iterable, Mapping, Optional

from envs.tasks import jsonl_records

DEFAULT_N = 13
DEFAULT_COMMON = 8
_WORD = re.compile(r"[a-z0-9_]+")


def words(text: str) -> list[str]:
  """The normalised words of a text: lower-case runs of letters, digits and underscores."""
  return _WORD.findall(text.lower())


def texts_of(item: Any, n: int = DEFAULT_N) -> list[str]:
  """Every string of at least `n` words anywhere in a JSON-like item (dicts, lists, strings)."""
  out, stack = [], [item]
  while stack:
    x = stack.pop()
    if isinstance(x, str):
      if len(words(x)) >= n:
        out.append(x)
    elif isinstance(x, Mapping):
      stack.extend(x.values())
    elif isinstance(x, (list, tuple)):
      stack.extend(x)
  return out


def _digest(tokens: Iterable[str]) -> bytes:
  return hashlib.blake2b(" ".join(tokens).encode(), digest_size=8).digest()


def ngrams(text: str, n: int = DEFAULT_N) -> set[bytes]:
  """8-byte digests of the text's word n-grams (none for a text shorter than n words)."""
  w = words(text)
  return {_digest(w[i:i + n]) for i in range(len(w) - n + 1)}


class EvalIndex:
  """The n-grams and whole texts of the eval items, to check training items against.

  Args:
    items: eval item id -> the item (any JSON-like record; its texts by `texts_of`).
    n: n-gram length in words (>= 1).
    common: an n-gram (or whole text) in more than this many eval items is boilerplate and
      ignored (>= 1).

  Raises:
    ValueError: n < 1 or common < 1.
  """

  def __init__(self, items: Mapping[str, Any], n: int = DEFAULT_N,
               common: int = DEFAULT_COMMON):
    for name, value in (("n", n), ("common", common)):
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: expected an integer >= 1")
    self.n = n
    grams: dict[bytes, set[str]] = collections.defaultdict(set)
    exact: dict[bytes, set[str]] = collections.defaultdict(set)
    for eval_id, item in items.items():
      for text in texts_of(item, n):
        exact[_digest(words(text))].add(eval_id)
        for g in ngrams(text, n):
          grams[g].add(eval_id)
    self.grams = {g: ids for g, ids in grams.items() if len(ids) <= common}
    self.exact = {g: ids for g, ids in exact.items() if len(ids) <= common}
    self.boilerplate = len(grams) - len(self.grams)  # n-grams ignored as too common

  def matches(self, item: Any) -> list[dict]:
    """The eval items one training item overlaps.

    Args:
      item: the training item.

    Returns:
      [{"eval_id", "shared" (n-grams in common), "containment" (share of the item's n-grams
      found in that eval item), "exact" (a whole normalised text in common)}], most shared first.
    """
    texts = texts_of(item, self.n)
    grams = set().union(*(ngrams(t, self.n) for t in texts)) if texts else set()
    shared: collections.Counter = collections.Counter()
    for g in grams:
      for eval_id in self.grams.get(g, ()):
        shared[eval_id] += 1
    exact = {e for t in texts for e in self.exact.get(_digest(words(t)), ())}
    return [{"eval_id": e, "shared": shared[e], "exact": e in exact,
             "containment": shared[e] / max(len(grams), 1)}
            for e in sorted(set(shared) | exact, key=lambda e: (-shared[e], e))]

  def report(self, items: Mapping[str, Any]) -> dict:
    """Checks training items against the index.

    Args:
      items: training item id -> item.

    Returns:
      {"n", "checked", "flagged": {item id: `matches`}, "eval_items_hit": sorted eval ids,
      "boilerplate_ngrams": n-grams of the eval items ignored as too common}.
    """
    flagged = {i: m for i, item in items.items() if (m := self.matches(item))}
    hit = sorted({x["eval_id"] for m in flagged.values() for x in m})
    return {"n": self.n, "checked": len(items), "flagged": flagged, "eval_items_hit": hit,
            "boilerplate_ngrams": self.boilerplate}


def load_items(path: str, id_field: Optional[str] = None) -> dict[str, Any]:
  """The records of a JSONL file by id.

  Args:
    path: the file; one JSON object per line (blank lines skipped).
    id_field: the field naming a record (default: "instance_id", else "id", else
      "<file>:<line>").

  Returns:
    id -> record, in file order.

  Raises:
    ValueError: a line that is not JSON, naming file:line.
  """
  out = {}
  for where, _, record in jsonl_records(path):
    if isinstance(record, ValueError):
      raise ValueError(f"{where}: not JSON ({record})")
    key = None
    if isinstance(record, dict):
      key = record.get(id_field) if id_field else (record.get("instance_id") or record.get("id"))
    out[str(key) if key is not None else where] = record
  return out


def main(argv: Optional[list[str]] = None) -> int:
  """Command line: report (and optionally filter out) training records that overlap eval sets.

  Returns:
    0; the report's summary is printed as JSON.
  """
  p = argparse.ArgumentParser(prog="python -m envs.decontam", description=__doc__.split("\n")[0])
  p.add_argument("--train", required=True, nargs="+", help="training JSONL files")
  p.add_argument("--eval", required=True, nargs="+", help="eval JSONL files")
  p.add_argument("--n", type=int, default=DEFAULT_N, help="n-gram length in words")
  p.add_argument("--common", type=int, default=DEFAULT_COMMON,
                 help="n-grams in more than this many eval items are boilerplate")
  p.add_argument("--report", help="write the full report (JSON) here")
  p.add_argument("--out", help="write the training records that overlap nothing here (JSONL)")
  args = p.parse_args(argv)
  index = EvalIndex({k: v for path in args.eval for k, v in load_items(path).items()}, args.n,
                    args.common)
  train = {k: v for path in args.train for k, v in load_items(path).items()}
  report = index.report(train)
  if args.report:
    with open(args.report, "w") as f:
      json.dump(report, f, indent=1)
  if args.out:
    with open(args.out, "w") as f:
      for key, record in train.items():
        if key not in report["flagged"]:
          f.write(json.dumps(record) + "\n")
  json.dump({"checked": report["checked"], "flagged": len(report["flagged"]),
             "eval_items_hit": len(report["eval_items_hit"]), "n": args.n}, sys.stdout)
  print()
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
