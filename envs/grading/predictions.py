"""Reading model predictions in swebench's format.

A prediction is an object {"instance_id": str, "model_name_or_path": str, "model_patch": str
or null}, other fields kept. A file holds a JSON list of them, a JSON object {instance_id:
prediction} (SWE-agent's layout), or one a line (JSONL). Files are untrusted: JSON is read with
a nesting bound (`envs.untrusted.decode`).
"""

from __future__ import annotations

from typing import Any, Sequence

from envs import tasks as tasks_lib
from envs.tasks import Task
from envs.untrusted import decode


class PredictionError(ValueError):
  """A predictions file is malformed; the message names the file, line (or index) and field."""


def _check_prediction(record: Any) -> dict:
  if not isinstance(record, dict):
    raise ValueError(f"expected a JSON object, got {type(record).__name__}")
  for field in ("instance_id", "model_name_or_path"):
    value = record.get(field)
    if not isinstance(value, str) or not value:
      raise ValueError(f"field {field!r}: expected a non-empty string, got {value!r:.100}")
  if "model_patch" not in record:
    raise ValueError("field 'model_patch': missing (a unified diff, \"\" or null for none)")
  if not isinstance(record["model_patch"], (str, type(None))):
    raise ValueError(f"field 'model_patch': expected a string or null, got "
                     f"{type(record['model_patch']).__name__}")
  return record


def load_predictions(path: str, tasks: Sequence[Task] = ()) -> dict[str, dict]:
  """The predictions of a file, by instance_id.

  Args:
    path: a .json file (a list of predictions, or an object {instance_id: prediction}), a
      .jsonl file (one prediction a line), or "gold": each task's reference patch, model "gold".
    tasks: the dataset's tasks (for "gold").

  Returns:
    {instance_id: {"instance_id", "model_name_or_path", "model_patch", ...}} in file order.

  Raises:
    PredictionError: "PATH:LINE: field 'NAME': ..." (JSONL) or "PATH[INDEX]: ..." (JSON) for
      a malformed prediction or a repeated instance_id; a file of another kind.
  """
  if path == "gold":
    return {t.instance_id: {"instance_id": t.instance_id, "model_name_or_path": "gold",
                            "model_patch": t.patch} for t in tasks}
  if path.endswith(".jsonl"):
    records = ((where, record) for where, _, record in tasks_lib.jsonl_records(path))
  elif path.endswith(".json"):
    with open(path, "rb") as f:
      try:
        data = decode.loads(f.read(), what=path)
      except ValueError as e:
        raise PredictionError(f"{path}: not JSON: {e}") from None
    if isinstance(data, dict):  # SWE-agent writes {instance_id: prediction}
      records = ((f"{path}[{k!r}]", v) for k, v in data.items())
    elif isinstance(data, list):
      records = ((f"{path}[{i}]", v) for i, v in enumerate(data))
    else:
      raise PredictionError(f"{path}: expected a list of predictions or an object "
                            f"{{instance_id: prediction}}, got {type(data).__name__}")
  else:
    raise PredictionError(f"--predictions={path!r}: expected a .json or .jsonl file, or 'gold'")
  out: dict[str, dict] = {}
  seen: dict[str, str] = {}
  for where, record in records:
    try:
      if isinstance(record, ValueError):
        raise record
      pred = _check_prediction(record)
      iid = pred["instance_id"]
      if iid in seen:
        raise ValueError(f"field 'instance_id': {iid!r} already given at {seen[iid]}")
    except ValueError as e:
      raise PredictionError(f"{where}: {e}") from None
    seen[iid] = where
    out[iid] = pred
  return out
