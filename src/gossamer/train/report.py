"""Plots and a Markdown report comparing training runs, read back from their run directories.

A run directory holds ``config.yaml`` (the resolved config) and ``metrics.jsonl`` (one JSON
record per line: ``train``, ``eval`` and a final ``summary``). Reading is forgiving on purpose:
unknown record kinds and fields are ignored so that older reports read newer runs, and a line cut
short by a crash mid-write is skipped with a warning, so that a crashed run can still be plotted.

Example::

    runs = [load_metrics(d) for d in ("runs/allreduce", "runs/gossip")]
    write_report(runs, "plots")  # plots/report.md and plots/*.png
"""

from __future__ import annotations

import argparse
import json
import math
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gossamer.loggers import TensorBoardLogger  # noqa: F401  (moved there; still importable here)

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
REPORT_FILE = "report.md"
DEFAULT_OUT = "gossamer-plots"  # `gossamer plot` output for several runs, relative to the cwd

# inches, the legend beside the axes included: fits a Markdown page without scaling text down
_FIGSIZE = (8.0, 4.2)
_BYTE_UNITS = ("B", "kB", "MB", "GB", "TB")  # powers of 1000, as `gossamer train` prints them

# (file name part, x field of the records)
_AXES = (("steps", "step"), ("wall_clock", "wall_clock"), ("bytes", "bytes_sent"))


@dataclass
class RunMetrics:
    """What one run directory recorded: its config and its metrics, grouped by kind."""

    name: str  # the algorithm, or the directory name when the config does not say
    config: dict[str, Any]
    evals: list[dict[str, Any]]  # ``eval`` records, in file order (by step)
    trains: list[dict[str, Any]]  # ``train`` records, in file order (by step)
    summary: dict[str, Any] | None  # None when the run did not finish
    path: Path | None = None  # the run directory; names runs apart when algorithms repeat

    @property
    def final(self) -> dict[str, Any]:
        """The final metrics: the summary, or the last eval of a run that did not finish."""
        if self.summary is not None:
            return self.summary
        return self.evals[-1] if self.evals else {}

    @property
    def mode(self) -> str | None:
        """``"simulated"``, ``"torch.distributed"``, or None when nothing says."""
        if self.summary is not None and isinstance(self.summary.get("mode"), str):
            return self.summary["mode"]
        sim = self.config.get("sim")
        if isinstance(sim, int) and not isinstance(sim, bool):
            return "simulated" if sim > 0 else "torch.distributed"
        return None

    @property
    def workers(self) -> int | None:
        """The number of workers, from the summary or else from the config's ``world_size``
        (a run directory's config.yaml records it) or ``sim``."""
        for value in (self.final.get("world_size"), self.config.get("world_size"),
                      self.config.get("sim")):
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None


def load_metrics(run_dir: str | Path) -> RunMetrics:
    """Read ``config.yaml`` and ``metrics.jsonl`` from ``run_dir``.

    Raises:
        ValueError: ``run_dir`` is not a directory or has no ``metrics.jsonl``, or its
            ``config.yaml`` is not a mapping.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run_dir {str(run_dir)!r} is not a directory")
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.is_file():
        raise ValueError(f"run_dir {str(run_dir)!r} has no {METRICS_FILE}")

    config: dict[str, Any] = {}
    config_path = run_dir / CONFIG_FILE
    if config_path.is_file():
        loaded = yaml.safe_load(config_path.read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"{str(config_path)!r} is not a YAML mapping")
        config = loaded or {}

    evals: list[dict[str, Any]] = []
    trains: list[dict[str, Any]] = []
    summary: dict[str, Any] | None = None
    for number, line in enumerate(metrics_path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            # Most likely the run was killed mid-write; what came before is still good.
            warnings.warn(
                f"{metrics_path}:{number}: skipping a line that is not valid JSON "
                "(truncated by a crash?)",
                stacklevel=2,
            )
            continue
        if not isinstance(record, dict):
            warnings.warn(f"{metrics_path}:{number}: skipping a record that is not an object",
                          stacklevel=2)
            continue
        kind = record.get("kind")
        if kind == "eval":
            evals.append(record)
        elif kind == "train":
            trains.append(record)
        elif kind == "summary":
            summary = record
        # other kinds come from newer writers: ignored

    algorithm = config.get("algorithm")
    if isinstance(algorithm, dict):  # {name, options}, as config.yaml writes it
        algorithm = algorithm.get("name")
    if summary is not None and isinstance(summary.get("algorithm"), str):
        algorithm = summary["algorithm"]
    name = algorithm if isinstance(algorithm, str) and algorithm else run_dir.resolve().name
    return RunMetrics(name=name, config=config, evals=evals, trains=trains, summary=summary,
                      path=run_dir)


# ----------------------------------------------------------------------------- formatting


def _number(record: dict[str, Any], key: str) -> float | None:
    """``record[key]`` as a finite float, or None when absent, not a number, or NaN/inf."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _byte_unit(n: float) -> tuple[str, float]:
    """The largest unit in which ``n`` bytes is at least 1, and its size in bytes."""
    factor = 1.0
    for unit in _BYTE_UNITS:
        if abs(n) < 1000 * factor or unit == _BYTE_UNITS[-1]:
            return unit, factor
        factor *= 1000
    raise AssertionError("unreachable")


def format_bytes(n: float) -> str:
    """``n`` bytes in human units: ``"512 B"``, ``"12.3 MB"``."""
    unit, factor = _byte_unit(n)
    return f"{n:.0f} B" if unit == "B" else f"{n / factor:.1f} {unit}"


def _labels(runs: Sequence[RunMetrics]) -> list[str]:
    """One distinct label per run: its name, or its directory name where names repeat."""
    counts = Counter(run.name for run in runs)
    labels = [
        run.path.resolve().name if counts[run.name] > 1 and run.path is not None else run.name
        for run in runs
    ]
    # still ambiguous (e.g. a/run and b/run): number them in order
    totals, seen = Counter(labels), Counter[str]()
    unique = []
    for label in labels:
        seen[label] += 1
        unique.append(f"{label} ({seen[label]})" if totals[label] > 1 else label)
    return unique


def _task(runs: Sequence[RunMetrics]) -> str:
    """``"digits / mlp"``: the data sets and models of the runs, for titles."""
    parts = []
    for key in ("dataset", "model"):
        values = dict.fromkeys(str(r.config[key]) for r in runs if r.config.get(key) is not None)
        if values:
            parts.append(", ".join(values))
    return " / ".join(parts)


# ----------------------------------------------------------------------------- plots


def _series(records: Sequence[dict[str, Any]], x_key: str, y_key: str,
            positive_x: bool = False) -> tuple[list[float], list[float]]:
    """The (x, y) points of the records that have both fields (finite, x > 0 if asked)."""
    xs, ys = [], []
    for record in records:
        x, y = _number(record, x_key), _number(record, y_key)
        if x is None or y is None or (positive_x and x <= 0):
            continue
        xs.append(x)
        ys.append(y)
    return xs, ys


def _has_accuracy(run: RunMetrics) -> bool:
    return any(_number(r, "eval_accuracy") is not None for r in run.evals)


def plot_runs(runs: Sequence[RunMetrics], out_dir: str | Path) -> list[Path]:
    """Write loss (and, when recorded, accuracy) against steps, wall-clock and bytes sent:
    :func:`plot_metric` for each.

    Returns:
        The PNG files written to ``out_dir`` (created if needed).
    """
    if not runs:
        raise ValueError("runs must not be empty")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = ["loss"]
    if any(_has_accuracy(run) for run in runs):
        metrics.append("accuracy")
    return [plot_metric(runs, metric, stem, out_dir / f"{metric}_vs_{stem}.png")
            for metric in metrics for stem, _ in _AXES]


def plot_metric(runs: Sequence[RunMetrics], metric: str, against: str, path: str | Path,
                title: str | None = None, train: bool = True) -> Path:
    """Draw ``metric`` (``"loss"`` or ``"accuracy"``) of each run against ``against``
    (``"steps"``, ``"wall_clock"`` or ``"bytes"``) to the PNG ``path``; return it.

    In gossamer's figure style (:mod:`gossamer.train.style`): each run in its method's
    colour, marker and line style, the legend beside the data. On a loss plot the eval loss of
    the averaged model is the full line with markers and, with ``train``, the train loss a thin
    faint line in the same style; the loss axis is log where the losses span more than a
    decade. Bytes are on a log axis, since compressed and uncompressed runs differ by orders
    of magnitude. ``title`` replaces the one made from the metric and the task.
    """
    # Imported here so that reading metrics and the CLI do not pay for matplotlib.
    from matplotlib.lines import Line2D

    from gossamer.train.style import (
        legend_outside,
        loss_axis,
        new_figure,
        readable_log_axis,
        save_figure,
        series_styles,
    )

    if not runs:
        raise ValueError("runs must not be empty")
    if metric not in ("loss", "accuracy"):
        raise ValueError(f"metric must be 'loss' or 'accuracy', got {metric!r}")
    x_key = dict(_AXES).get(against)
    if x_key is None:
        raise ValueError(f"against must be one of {', '.join(dict(_AXES))}, got {against!r}")
    labels = _labels(runs)
    simulated = all(run.mode == "simulated" for run in runs)
    max_bytes = max(
        (b for run in runs for r in (*run.evals, *run.trains)
         if (b := _number(r, "bytes_sent")) is not None),
        default=0.0,
    )
    byte_unit, byte_factor = _byte_unit(max_bytes)
    x_labels = {
        "steps": "step",
        "wall_clock": "simulated wall-clock (s)" if simulated else "wall-clock (s)",
        "bytes": f"{byte_unit} sent per worker",
    }
    x_titles = {"steps": "steps", "wall_clock": "wall-clock", "bytes": "bytes sent"}

    fig = new_figure(*_FIGSIZE, layout="constrained")
    ax = fig.add_subplot()
    log_x = against == "bytes"
    x_scale = 1 / byte_factor if log_x else 1.0
    y_key = "eval_loss" if metric == "loss" else "eval_accuracy"
    y_scale = 100.0 if metric == "accuracy" else 1.0
    train = train and metric == "loss"
    values = []
    for run, label, style in zip(runs, labels, series_styles(labels), strict=True):
        xs, ys = _series(run.evals, x_key, y_key, positive_x=log_x)
        ax.plot([x * x_scale for x in xs], [y * y_scale for y in ys], markersize=4,
                linewidth=1.6, label=label, **style.kwargs())
        values += ys
        if train:
            # train records are denser; older runs only have train_loss on evals
            xs, ys = _series(run.trains or run.evals, x_key, "train_loss", positive_x=log_x)
            ax.plot([x * x_scale for x in xs], ys, color=style.color,
                    linestyle=style.linestyle, linewidth=0.9, alpha=0.45)
            values += ys
    if metric == "loss":
        loss_axis(ax, values)
    else:
        ax.set_ylabel("eval accuracy (%)")
    if log_x:
        ax.set_xscale("log")
        readable_log_axis(ax.xaxis)
    ax.set_xlabel(x_labels[against])
    if title is None:
        task = _task(runs)
        what = "loss" if metric == "loss" else "accuracy of the averaged model"
        title = f"{what} vs {x_titles[against]}" + (f" — {task}" if task else "")
    ax.set_title(title, fontsize="medium")
    ax.grid(True, alpha=0.3)
    handles, names = ax.get_legend_handles_labels()
    if train:
        # how eval and train differ is shared by all runs: explained once, in grey
        handles += [Line2D([], [], color="0.4", linewidth=1.6, marker="o", markersize=4),
                    Line2D([], [], color="0.4", linewidth=0.9, alpha=0.45)]
        names += ["eval (averaged model)", "train"]
    legend_outside(fig, handles, names)
    return save_figure(fig, path)


def loss_scale(losses: Sequence[float]) -> str:
    """``"log"`` when the losses span more than a decade (16 curves from 2.3 down to 0.1
    pile up near 0 on a linear axis; a diverged run would flatten every other curve), else
    ``"linear"``: :func:`gossamer.train.style.loss_scale`."""
    from gossamer.train.style import loss_scale as scale

    return scale(losses)


# ----------------------------------------------------------------------------- report


_COLUMNS = (  # (header, right-aligned)
    ("algorithm", False),
    ("workers", True),
    ("eval accuracy (%)", True),
    ("eval loss", True),
    ("bytes / worker", True),
    ("syncs", True),
    ("wall-clock (s)", True),
    ("consensus distance", True),
    ("examples/s", True),
)


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def final_consensus(final: dict[str, Any]) -> float | None:
    """The replicas' consensus distance at the last step, before the final exact average
    (``average_at_end``) made it 0; older runs recorded only the one after it."""
    before = _number(final, "consensus_distance_before_finish")
    return before if before is not None else _number(final, "consensus_distance")


def markdown_table(runs: Sequence[RunMetrics]) -> str:
    """A Markdown table of each run's final metrics, one row per run, numbers right-aligned."""
    rows = []
    for run, label in zip(runs, _labels(runs), strict=True):
        final = run.final
        accuracy = _number(final, "eval_accuracy")
        nbytes = _number(final, "bytes_sent")
        syncs = _number(final, "synchronizations")
        rows.append([
            label,
            "-" if run.workers is None else str(run.workers),
            _cell(None if accuracy is None else 100 * accuracy, ".2f"),
            _cell(_number(final, "eval_loss"), ".4f"),
            "-" if nbytes is None else format_bytes(nbytes),
            _cell(syncs, ".0f"),
            _cell(_number(final, "wall_clock"), ".2f"),
            _cell(final_consensus(final), ".2e"),
            _cell(_number(final, "examples_per_second"), ".0f"),
        ])
    headers = [header for header, _ in _COLUMNS]
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        padded = [
            cell.rjust(width) if right else cell.ljust(width)
            for cell, width, (_, right) in zip(cells, widths, _COLUMNS, strict=True)
        ]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(
        "-" * (width + 1) + ":" if right else ":" + "-" * (width + 1)
        for width, (_, right) in zip(widths, _COLUMNS, strict=True)
    ) + "|"
    return "\n".join([line(headers), rule, *(line(row) for row in rows)]) + "\n"


def task_line(run: RunMetrics) -> str:
    """``"digits / mlp, 4 workers (simulated), 300 steps, seed 0"`` from one run."""
    config = run.config
    task = _task([run])
    parts = [task] if task else []
    if run.workers is not None:
        parts.append(f"{run.workers} workers" + (f" ({run.mode})" if run.mode else ""))
    if config.get("steps") is not None:
        parts.append(f"{config['steps']} steps")
    if config.get("seed") is not None:
        parts.append(f"seed {config['seed']}")
    return ", ".join(parts)


def write_report(runs: Sequence[RunMetrics], out_dir: str | Path,
                 title: str = "gossamer compare") -> Path:
    """Write ``report.md`` (task, table of final metrics, plots) and its PNGs to ``out_dir``.

    The task line is taken from the first run's config.
    """
    if not runs:
        raise ValueError("runs must not be empty")
    out_dir = Path(out_dir)
    plots = plot_runs(runs, out_dir)
    parts = [f"# {title}", ""]
    task = task_line(runs[0])
    if task:
        parts += [f"Task: {task}.", ""]
    parts += [markdown_table(runs)]
    for path in plots:
        parts += [f"![{path.stem.replace('_', ' ')}]({path.name})", ""]
    report = out_dir / REPORT_FILE
    report.write_text("\n".join(parts))
    return report


# ----------------------------------------------------------------------------- command line


def add_plot_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``gossamer plot RUN_DIR... [--out DIR]`` to ``parser``."""
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="run directories written by `gossamer train`")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="where to write the plots and report.md (default: RUN_DIR/plots "
                        f"for one run, ./{DEFAULT_OUT} for several)")
    parser.add_argument("--title", default="gossamer plot",
                        help="title of report.md (default: gossamer plot)")


def run_plot(args: argparse.Namespace) -> int:
    """Run ``gossamer plot``: load the runs, write plots and report, print the paths."""
    runs = [load_metrics(run_dir) for run_dir in args.run_dirs]
    if args.out is not None:
        out_dir = Path(args.out)
    elif len(args.run_dirs) == 1:
        out_dir = Path(args.run_dirs[0]) / "plots"
    else:
        out_dir = Path(DEFAULT_OUT)
    report = write_report(runs, out_dir, title=getattr(args, "title", "gossamer plot"))
    for path in sorted(out_dir.glob("*.png")):
        print(path)
    print(report)
    return 0
