"""The history of the headline benchmark figures: docs/benchmarks_history.jsonl.

    history.record("rl_step", {"tree_vs_tunix": 3.9}, "higher")      # appends one line
    records = history.load()
    findings = history.compare({("rl_step", "tree_vs_tunix"): 3.5}, records, kind)

One JSON object a line, never rewritten, only appended to:

    {"benchmark": "rl_step", "figure": "tree_vs_tunix", "value": 3.9, "better": "higher",
     "date": "2026-11-23", "machine": "vm, Intel(R) Xeon(R) Processor, 2 cores, cpu cpu",
     "kind": "cpu x2 Intel Xeon", "commit": "55cf495", "note": "..."}

- `figure` names a number inside the benchmark's result; "/" separates a part of the result
  from the number ("seed_0/rl_pass@1", "bwrap/lifecycles_per_s").
- `better`: "higher" or "lower" (minutes, losses, latencies).
- `machine`: `benchmarks.common.machine()` where it was measured (host, CPU model, cores,
  backend and device kind).
- `kind`: `kind(machine)`: the same facts without the host name and with the CPU model
  stripped of trademarks, "CPU"/"Processor" and the clock ("Intel(R) Xeon(R) Processor @
  2.50GHz" -> "Intel Xeon"), so two VMs of one type compare. Figures are only compared within
  a kind: a speed on another machine says nothing about a regression here.
- `commit`: `git rev-parse --short HEAD`, "+dirty" when tracked files differ from it (as
  `git describe --dirty`), "unknown" outside a git checkout.
- `note`: optional free text (what was unusual about the run).

A regression is a figure more than `tolerance` (relative) worse than the best value recorded
for the same benchmark, figure and kind. A figure with no history on the kind is "new".
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import re
import subprocess
from typing import Iterable, Mapping, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(ROOT, "docs", "benchmarks_history.jsonl")
BETTER = ("higher", "lower")
# field -> accepted types; "note" is the only optional field.
FIELDS = {"benchmark": str, "figure": str, "value": (int, float), "better": str, "date": str,
          "machine": str, "kind": str, "commit": str, "note": str}
OPTIONAL = ("note",)


class HistoryError(ValueError):
  """A malformed history line; the message names the file, the line number and the field."""


# ----------------------------------------------------------------------------- machine facts

_MACHINE = re.compile(r"^(?P<node>[^,]*), (?P<cpu>.*), (?P<cores>\d+) cores, "
                      r"(?P<backend>\S+) (?P<device>.*)$")


def cpu_family(cpu: str) -> str:
  """The CPU model without what varies between VMs of one type: "Intel(R) Xeon(R) Platinum
  8481C CPU @ 2.70GHz" -> "Intel Xeon Platinum 8481C", "Intel(R) Xeon(R) Processor" ->
  "Intel Xeon", "AMD EPYC 7B13 64-Core Processor" -> "AMD EPYC 7B13"."""
  cpu = re.sub(r"\((R|TM|tm|r)\)", "", cpu)
  cpu = re.sub(r"@.*$", "", cpu)  # the clock (some VMs report it, others of the type do not)
  cpu = re.sub(r"\b(\d+-Core|CPU|Processor)\b", "", cpu)
  return " ".join(cpu.split()) or "unknown cpu"


def kind(machine: str) -> str:
  """The machine-kind key of a `benchmarks.common.machine()` string.

  "vm, Intel(R) Xeon(R) Processor @ 2.50GHz, 2 cores, cpu cpu" -> "cpu x2 Intel Xeon";
  "host, AMD EPYC 7B13, 16 cores, gpu NVIDIA H100 80GB HBM3" ->
  "gpu NVIDIA H100 80GB HBM3, cpu x16 AMD EPYC 7B13". A string of another shape is its own kind.
  """
  m = _MACHINE.match(machine.strip())
  if not m:
    return machine.strip()
  host = f"cpu x{m['cores']} {cpu_family(m['cpu'])}"
  if m["backend"] == "cpu":
    return host
  return f"{m['backend']} {m['device'].strip()}, {host}"


def current_machine() -> str:
  """`benchmarks.common.machine()` of this process."""
  # Imported here, not at the top: it starts JAX (and would claim an accelerator), which
  # load / compare / the --latest report do not need.
  from benchmarks import common
  return common.machine()


def commit(root: str = ROOT) -> str:
  """`git rev-parse --short HEAD` of `root`, + "+dirty" when tracked files differ from it;
  "unknown" when `root` is not a git checkout (or git is missing)."""
  try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, check=True,
                          capture_output=True, text=True).stdout.strip()
    changes = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                             cwd=root, check=True, capture_output=True, text=True).stdout
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return head + ("+dirty" if changes.strip() else "")


def today() -> str:
  """Today's date in UTC, YYYY-MM-DD (as benchmarks.common.today)."""
  return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


# ----------------------------------------------------------------------------- the file


def validate(rec: object, where: str) -> dict:
  """Checks one decoded history line.

  Args:
    rec: the decoded JSON value of the line.
    where: "path:line", the start of every error message.

  Returns:
    rec, with "value" as a float.

  Raises:
    HistoryError: not an object, a missing or unknown field, a field of the wrong type, a value
      that is not finite, `better` not "higher"/"lower", a date that is not YYYY-MM-DD.
  """
  if not isinstance(rec, dict):
    raise HistoryError(f"{where}: expected a JSON object, got {type(rec).__name__}")
  for field, types in FIELDS.items():
    if field not in rec:
      if field in OPTIONAL:
        continue
      raise HistoryError(f"{where}: field '{field}' is missing")
    value = rec[field]
    if isinstance(value, bool) or not isinstance(value, types):
      raise HistoryError(f"{where}: field '{field}' has the wrong type "
                         f"({type(value).__name__}): {value!r}")
  unknown = sorted(set(rec) - set(FIELDS))
  if unknown:
    raise HistoryError(f"{where}: unknown field '{unknown[0]}'")
  if not math.isfinite(rec["value"]):
    raise HistoryError(f"{where}: field 'value' is not finite: {rec['value']!r}")
  if rec["better"] not in BETTER:
    raise HistoryError(f"{where}: field 'better' must be 'higher' or 'lower', "
                       f"got {rec['better']!r}")
  try:
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", rec["date"]):
      raise ValueError
    datetime.date.fromisoformat(rec["date"])
  except ValueError:
    raise HistoryError(f"{where}: field 'date' is not a YYYY-MM-DD date: {rec['date']!r}") from None
  for field in ("benchmark", "figure", "kind"):
    if not rec[field].strip():
      raise HistoryError(f"{where}: field '{field}' is empty")
  return dict(rec, value=float(rec["value"]))


def load(path: Optional[str] = None) -> list[dict]:
  """Reads and validates a history file.

  Args:
    path: the file (default docs/benchmarks_history.jsonl). Blank lines are skipped.

  Returns:
    The records in file order (= the order they were appended); [] when the file does not
    exist.

  Raises:
    HistoryError: a line that is not JSON or not a valid record ("path:N: field 'x' ...").
  """
  path = path or PATH
  if not os.path.exists(path):
    return []
  records = []
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        rec = json.loads(line)
      except json.JSONDecodeError as e:
        raise HistoryError(f"{path}:{n}: not valid JSON ({e.msg}, column {e.colno})") from None
      records.append(validate(rec, f"{path}:{n}"))
  return records


def make_records(benchmark: str, figures: Mapping[str, float],
                 better: Mapping[str, str] | str, machine: str, *, date: Optional[str] = None,
                 commit_id: Optional[str] = None, note: Optional[str] = None) -> list[dict]:
  """The history records of one measurement (validated; nothing is written).

  Args:
    benchmark: the benchmark's name (its module in benchmarks/, or "demo", "demo_sft").
    figures: figure name -> value.
    better: "higher" / "lower" for every figure, or figure name -> that.
    machine: `benchmarks.common.machine()` where it was measured.
    date: YYYY-MM-DD (default: today, UTC).
    commit_id: the commit measured (default: `commit()` of this checkout).
    note: optional text stored with every record.

  Raises:
    HistoryError: a figure without a direction, or a record that would not load.
  """
  date = date or today()
  commit_id = commit_id or commit()
  out = []
  for figure, value in figures.items():
    direction = better if isinstance(better, str) else better.get(figure)
    if direction is None:
      raise HistoryError(f"{benchmark}/{figure}: no 'better' direction given")
    rec = {"benchmark": benchmark, "figure": figure, "value": value, "better": direction,
           "date": date, "machine": machine, "kind": kind(machine), "commit": commit_id}
    if note:
      rec["note"] = note
    out.append(validate(rec, f"{benchmark}/{figure}"))
  return out


def append(records: Iterable[dict], path: Optional[str] = None) -> None:
  """Appends records to a history file as whole lines in one write, then flushes and fsyncs.

  The file is opened for appending and never rewritten, so a concurrent reader sees whole
  lines and a crash loses at most this call's lines. If the file does not end with a newline
  (an earlier writer died mid-line), a newline is written first so the new lines stay whole
  (`load` then names the broken line).
  """
  path = path or PATH
  text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
  if not text:
    return
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  if os.path.exists(path) and os.path.getsize(path) > 0:
    with open(path, "rb") as f:
      f.seek(-1, os.SEEK_END)
      if f.read(1) != b"\n":
        text = "\n" + text
  with open(path, "ab") as f:
    f.write(text.encode("utf-8"))
    f.flush()
    os.fsync(f.fileno())


def record(benchmark: str, figures: Mapping[str, float], better: Mapping[str, str] | str,
           note: Optional[str] = None, path: Optional[str] = None) -> list[dict]:
  """Appends the figures of a measurement made now, on this machine, at this commit.

  Args:
    benchmark: the benchmark's name.
    figures: figure name -> value.
    better: "higher" / "lower" for every figure, or figure name -> that.
    note: optional text stored with every record.
    path: the history file (default docs/benchmarks_history.jsonl).

  Returns:
    The records appended.
  """
  records = make_records(benchmark, figures, better, current_machine(), note=note)
  append(records, path)
  return records


# ----------------------------------------------------------------------------- comparison


@dataclasses.dataclass
class Finding:
  """One figure compared with its history on one machine kind.

  `change` = (value - best) / |best|, signed (negative: lower than the best); `worse` is the
  same share in the direction that is worse (positive: worse than the best). `verdict`:
  "new" (no history on the kind), "regression" (worse by more than the tolerance, or not a
  finite number), "better" (better than the best), "ok" (equal, or worse within the
  tolerance).
  """
  benchmark: str
  figure: str
  kind: str
  value: float
  verdict: str
  better: Optional[str] = None
  best: Optional[float] = None
  best_date: Optional[str] = None
  best_commit: Optional[str] = None
  change: Optional[float] = None
  worse: Optional[float] = None
  date: Optional[str] = None  # when `value` was recorded (--latest; None: measured now)
  commit: Optional[str] = None  # and at which commit

  @property
  def regression(self) -> bool:
    return self.verdict == "regression"

  def to_dict(self) -> dict:
    return dict(dataclasses.asdict(self), regression=self.regression)


def best(records: Iterable[dict], benchmark: str, figure: str, kind: str) -> Optional[dict]:
  """The best record of a figure on a machine kind (the earliest one on a tie), or None.

  Raises:
    HistoryError: the figure's records disagree on whether higher or lower is better.
  """
  found = [r for r in records
           if r["benchmark"] == benchmark and r["figure"] == figure and r["kind"] == kind]
  if not found:
    return None
  directions = {r["better"] for r in found}
  if len(directions) > 1:
    raise HistoryError(f"{benchmark}/{figure} on {kind!r}: records disagree on 'better'")
  pick = max if directions == {"higher"} else min
  return pick(found, key=lambda r: r["value"])  # max/min return the first of equal values


def _relative(value: float, ref: float) -> float:
  if value == ref:
    return 0.0
  if ref == 0:
    return math.copysign(math.inf, value - ref)
  return (value - ref) / abs(ref)


def compare(current: Mapping[tuple[str, str], float], records: Iterable[dict], kind: str,
            tolerance: float = 0.05) -> list[Finding]:
  """Compares figures measured now with the best recorded on the same machine kind.

  Args:
    current: (benchmark, figure) -> value measured now.
    records: the history (`load()`).
    kind: the machine kind the current figures were measured on (`kind(machine)`).
    tolerance: how much worse than the best (relative) still passes: 0.05 = 5%.

  Returns:
    One Finding per current figure, in `current`'s order.
  """
  records = list(records)
  findings = []
  for (benchmark, figure), value in current.items():
    ref = best(records, benchmark, figure, kind)
    if ref is None:
      findings.append(Finding(benchmark, figure, kind, float(value), "new"))
      continue
    change = _relative(value, ref["value"])
    worse = -change if ref["better"] == "higher" else change
    if not math.isfinite(value) or worse > tolerance:  # a NaN figure is a broken run
      verdict = "regression"
    else:
      verdict = "better" if worse < 0 else "ok"
    findings.append(Finding(benchmark, figure, kind, float(value), verdict, ref["better"],
                            ref["value"], ref["date"], ref["commit"], change, worse))
  return findings


def latest(records: Iterable[dict], tolerance: float = 0.05) -> list[Finding]:
  """For every (benchmark, figure, kind): its newest record against the best earlier one.

  Newest = the latest date, and of one date the last appended. A figure recorded once on a
  kind is "new".
  """
  groups: dict[tuple[str, str, str], list[tuple[int, dict]]] = {}
  for i, r in enumerate(records):
    groups.setdefault((r["benchmark"], r["figure"], r["kind"]), []).append((i, r))
  findings = []
  for (benchmark, figure, kind_), rows in groups.items():
    rows.sort(key=lambda x: (x[1]["date"], x[0]))
    newest = rows[-1][1]
    earlier = [r for _, r in rows[:-1]]
    for f in compare({(benchmark, figure): newest["value"]}, earlier, kind_, tolerance):
      f.date, f.commit = newest["date"], newest["commit"]
      findings.append(f)
  return findings
