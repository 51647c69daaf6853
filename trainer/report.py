"""End-of-run report: curves from metrics.jsonl and summary tables, as a PNG and an HTML page.

    paths = report({"seed 0": "runs/s0/rl", "seed 1": "runs/s1/rl"}, out_dir="runs",
                   tables={"Held-out pass@1": [{"seed": 0, "SFT": 0.31, "RL": 0.47}, ...],
                           "RL - SFT, paired bootstrap": [{"mean": 0.14, "95% low": 0.08,
                                                           "95% high": 0.20}]})
    # -> {"png": "runs/report.png", "html": "runs/report.html"}

Each entry of `keys` is one panel: a metric name or an fnmatch pattern ("time/*": every phase
time in one panel). Runs (one logdir each, e.g. one per seed) are overlaid in every panel. The
default panels are the RL metrics the trainer logs, those that exist; if none does, one panel
per numeric metric. `tables` (name -> rows, each a dict column -> value) are drawn under the
curves and written as HTML tables; the HTML also lists each curve's last value. The HTML embeds
the PNG, so it is one self-contained file. matplotlib is used through its object API (no pyplot
state, no display needed).
"""

from __future__ import annotations

import base64
import fnmatch
import html
import math
import logging
import os
from typing import Any, Mapping, Optional, Sequence

import jax

from trainer.metrics import JSONL, read_jsonl

DEFAULT_KEYS = ("*reward/mean", "*pass_rate", "*loss", "*kl", "*entropy", "*length*",
                "tokens_per_s", "time/*")
_NOT_CURVES = ("step", "wall_time")
_MAX_PANELS = 16


def load_runs(runs: str | os.PathLike | Sequence[str] | Mapping[str, str]
              ) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
  """Reads each run's metrics.jsonl into curves.

  Args:
    runs: a logdir, a list of logdirs (labelled by their base names), or {label: logdir}.

  Returns:
    {label: {metric: (steps, values)}} for every numeric (non-bool) metric but step and wall_time.

  Raises:
    FileNotFoundError: a logdir has no metrics.jsonl.
  """
  if isinstance(runs, (str, os.PathLike)):
    runs = [os.fspath(runs)]
  if not isinstance(runs, Mapping):
    runs = {os.path.basename(os.path.normpath(d)) or d: d for d in runs}
  out = {}
  for label, logdir in runs.items():
    path = os.path.join(logdir, JSONL)
    if not os.path.exists(path):
      raise FileNotFoundError(f"report: run {label!r} has no {JSONL} in {logdir}")
    curves: dict[str, tuple[list[int], list[float]]] = {}
    for step, record in read_jsonl(path).items():
      for key, value in record.items():
        if key in _NOT_CURVES or isinstance(value, bool) or not isinstance(value, (int, float)):
          continue
        steps, values = curves.setdefault(key, ([], []))
        steps.append(step)
        values.append(float(value))
    out[label] = curves
  return out


def choose_panels(names: Sequence[str], keys: Optional[Sequence[str]] = None,
                  skip_missing: bool = False) -> list[tuple[str, list[str]]]:
  """Groups metric names into panels, one per pattern that matches.

  Args:
    names: the metric names logged by the runs.
    keys: metric names or fnmatch patterns, one panel each; None: DEFAULT_KEYS (those that match).
    skip_missing: leave out a pattern of `keys` that matches nothing instead of raising.

  Returns:
    [(panel title, metric names)], at most 16 panels; one panel per metric when no pattern
    matches. The title is the metric's name when the pattern matched one, else the pattern.

  Raises:
    ValueError: a pattern of `keys` matches no metric (without `skip_missing`).
  """
  names = sorted(names)
  panels = []
  for pattern in keys or DEFAULT_KEYS:
    matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
    if matched:
      panels.append((matched[0] if len(matched) == 1 else pattern, matched))
    elif keys and not skip_missing:
      raise ValueError(f"report: no metric matches {pattern!r}; metrics: {names}")
  if not panels:
    panels = [(n, [n]) for n in names]
  return panels[:_MAX_PANELS]


def _ema(values: list[float], smooth: float) -> list[float]:
  out, avg = [], None
  for v in values:
    if math.isfinite(v):
      avg = v if avg is None else smooth * avg + (1 - smooth) * v
    out.append(avg if avg is not None else v)
  return out


def _fmt(value: Any) -> str:
  if isinstance(value, float):
    return f"{value:.4g}"
  return str(value)


def _table_cells(rows: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
  columns = list(dict.fromkeys(c for row in rows for c in row))
  return columns, [[_fmt(row.get(c, "")) for c in columns] for row in rows]


def render_png(runs: Mapping[str, Mapping[str, tuple[list[int], list[float]]]],
               panels: Sequence[tuple[str, list[str]]], tables: Mapping[str, Sequence[Mapping]],
               path: str, *, title: str = "", smooth: float = 0.0) -> None:
  """Draws the panels (3 per row), then one full-width row per table, to a PNG.

  Args:
    runs: {label: {metric: (steps, values)}} as `load_runs` returns; runs are overlaid.
    panels: [(title, metric names)] as `choose_panels` returns.
    tables: {name: rows}, each row a dict column -> value.
    path: the PNG file to write.
    title: the figure's title ("" for none).
    smooth: EMA factor in [0, 1); > 0 draws the raw curve faint behind the smoothed one.
  """
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  ncols = 3
  curve_rows = math.ceil(len(panels) / ncols)
  heights = [3.0] * curve_rows + [0.6 + 0.3 * (len(rows) + 1) for rows in tables.values()]
  fig = Figure(figsize=(5 * ncols, sum(heights) + 0.6), dpi=100)
  FigureCanvasAgg(fig)
  grid = fig.add_gridspec(len(heights), ncols, height_ratios=heights)
  styles = ["-", "--", ":", "-."]
  for i, (name, metrics) in enumerate(panels):
    ax = fig.add_subplot(grid[i // ncols, i % ncols])
    n = 0
    for r, (label, curves) in enumerate(runs.items()):
      for m, metric in enumerate(metrics):
        if metric not in curves:
          continue
        steps, values = curves[metric]
        # One metric: a colour per run. Several (e.g. time/*): a colour per metric, a line
        # style per run.
        color = f"C{(m if len(metrics) > 1 else r) % 10}"
        style = styles[r % len(styles)] if len(metrics) > 1 else "-"
        parts = [p for p in (label if len(runs) > 1 else "", metric if len(metrics) > 1 else "")
                 if p]
        if smooth > 0:
          ax.plot(steps, values, color=color, linestyle=style, alpha=0.25, linewidth=1)
          values = _ema(values, smooth)
        ax.plot(steps, values, color=color, linestyle=style, linewidth=1.6,
                label=" ".join(parts) or None, marker="o" if len(steps) < 30 else None,
                markersize=3)
        n += 1
    ax.set_title(name, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    if n > 1:
      ax.legend(fontsize=7)
  for j, (name, rows) in enumerate(tables.items()):
    ax = fig.add_subplot(grid[curve_rows + j, :])
    ax.axis("off")
    ax.set_title(name, fontsize=10)
    columns, cells = _table_cells(rows)
    if cells:
      table = ax.table(cellText=cells, colLabels=columns, loc="center", cellLoc="center")
      table.scale(1, 1.2)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path)


def render_html(runs: Mapping[str, Mapping[str, tuple[list[int], list[float]]]],
                panels: Sequence[tuple[str, list[str]]], tables: Mapping[str, Sequence[Mapping]],
                png_path: str, path: str, *, title: str = "") -> None:
  """Writes a self-contained page: the PNG (embedded), the tables, and each curve's last value.

  Args:
    runs: {label: {metric: (steps, values)}} as `load_runs` returns.
    panels: [(title, metric names)]; the last-value table lists these metrics.
    tables: {name: rows}, each row a dict column -> value.
    png_path: the PNG written by `render_png`, embedded as base64.
    path: the HTML file to write.
    title: the page's heading ("" for none).
  """
  def table_html(rows: Sequence[Mapping[str, Any]]) -> str:
    columns, cells = _table_cells(rows)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                   for row in cells)
    return f"<table><tr>{head}</tr>{body}</table>"

  last = [{"run": label, "metric": metric, "step": curves[metric][0][-1],
           "last": curves[metric][1][-1]}
          for label, curves in runs.items()
          for _, metrics in panels for metric in metrics if metric in curves]
  with open(png_path, "rb") as f:
    png = base64.b64encode(f.read()).decode()
  parts = [f"<h1>{html.escape(title)}</h1>" if title else "",
           f'<img alt="curves" src="data:image/png;base64,{png}">']
  for name, rows in tables.items():
    parts += [f"<h2>{html.escape(name)}</h2>", table_html(rows)]
  parts += ["<h2>Last values</h2>", table_html(last)]
  style = ("body{font-family:sans-serif;margin:2em} img{max-width:100%} "
           "table{border-collapse:collapse;margin:0.5em 0} "
           "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}")
  with open(path, "w") as f:
    f.write(f"<!doctype html><html><head><meta charset='utf-8'><title>"
            f"{html.escape(title or 'Arbor report')}</title><style>{style}</style></head>"
            f"<body>{''.join(parts)}</body></html>\n")


def report(runs: str | os.PathLike | Sequence[str] | Mapping[str, str],
           out_dir: Optional[str] = None, *, keys: Optional[Sequence[str]] = None,
           tables: Optional[Mapping[str, Sequence[Mapping[str, Any]]]] = None,
           title: str = "Arbor report", smooth: float = 0.0,
           skip_missing: bool = False) -> dict[str, str]:
  """Writes report.png and report.html for one or more runs.

  Args:
    runs: a logdir holding metrics.jsonl, a list of them, or {label: logdir} (overlaid).
    out_dir: where to write; None: the first run's logdir.
    keys: panels, each a metric name or fnmatch pattern (default: DEFAULT_KEYS that exist).
    tables: {name: rows} shown under the curves, e.g. pass@1 per seed and a bootstrap CI.
    title: the figure's and the page's title.
    smooth: EMA factor in [0, 1) for the curves (the raw curve is drawn faint behind).
    skip_missing: leave out the `keys` that match no metric (a loop's optional metrics, e.g.
      "kl" without a KL term) instead of raising.

  Returns:
    {"png": path, "html": path}.

  Raises:
    ValueError: `smooth` outside [0, 1), no numeric metric, or a key that matches nothing.
    FileNotFoundError: a logdir has no metrics.jsonl.
  """
  if not 0 <= smooth < 1:
    raise ValueError(f"report: smooth must be in [0, 1), got {smooth}")
  data = load_runs(runs)
  names = sorted({n for curves in data.values() for n in curves})
  if not names:
    raise ValueError(f"report: no numeric metrics in {list(data)}")
  panels = choose_panels(names, keys, skip_missing)
  tables = dict(tables or {})
  if out_dir is None:
    first = runs if isinstance(runs, (str, os.PathLike)) else (
        next(iter(runs.values())) if isinstance(runs, Mapping) else runs[0])
    out_dir = os.fspath(first)
  os.makedirs(out_dir, exist_ok=True)
  paths = {"png": os.path.join(out_dir, "report.png"),
           "html": os.path.join(out_dir, "report.html")}
  render_png(data, panels, tables, paths["png"], title=title, smooth=smooth)
  render_html(data, panels, tables, paths["png"], paths["html"], title=title)
  return paths


def end_of_run_report(config, logdir: str, keys: Sequence[str], title: str
                      ) -> Optional[dict[str, str]]:
  """Draws a trainer run's `report` of `keys` (those the run logged) into its logdir.

  Drawn when `config.metrics.report` and this is process 0.

  Args:
    config: the run's config (reads `metrics.report`).
    logdir: the run's logdir, holding metrics.jsonl.
    keys: the panels' metric names or patterns; those the run did not log are left out.
    title: the report's title.

  Returns:
    {"png": path, "html": path}; None when not drawn, or (with a warning) when it cannot be
    drawn (no matplotlib, no metrics yet).
  """
  if not (config.metrics.report and jax.process_index() == 0
          and os.path.exists(os.path.join(logdir, JSONL))):
    return None
  try:
    return report(logdir, keys=keys, skip_missing=True, title=title)
  except (ImportError, ValueError) as e:
    logging.getLogger(__name__).warning("no report: %s", e)
    return None
