"""The planner's figures, in gossamer's figure style (:mod:`gossamer.train.style`).

- :func:`plot`: one plan (what :func:`gossamer.plan.cli.plan` returns): each method's predicted
  step time and speed-up over AllReduce against the worker count;
- :func:`plot_bandwidth`: several plans, one per bandwidth: each method's predicted speed-up
  over AllReduce against the bandwidth, a panel per worker count; :func:`bandwidth_table` is
  its numbers.

Example::

    results = [plan(args_at(bandwidth)) for bandwidth in ("100mbit", "1gbit", "10gbit")]
    plot_bandwidth(results, Path("speed_up.png"))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["bandwidth_table", "plot", "plot_bandwidth", "rate_label"]

#: the method every speed-up is over (as gossamer.plan.cli.BASELINE)
BASELINE = "allreduce"


def rate_label(bytes_per_second: float, short: bool = False) -> str:
    """A link's rate as people name it: ``"100 Mbit/s"``, ``"10 Gbit/s"``; with ``short``,
    ``"100M"``, ``"10G"`` (tick labels, under an axis label that gives the unit)."""
    bits = 8 * bytes_per_second
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3), ("", 1.0)):
        if bits >= size or not unit:
            return f"{bits / size:.3g}{unit}" if short else f"{bits / size:.3g} {unit}bit/s"
    raise AssertionError("unreachable")


def _methods(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The methods of ``rows``, AllReduce first, then in order of appearance."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    return sorted(methods, key=lambda m: m != BASELINE)


def _speed_up(row: dict[str, Any] | None) -> float:
    value = None if row is None else row.get("speed_up")
    return math.nan if value is None else float(value)


def plot(result: dict[str, Any], path: Path) -> None:
    """Step time and speed-up over AllReduce against the worker count, one line per method;
    the legend to the right, worker counts labelled as numbers."""
    from gossamer.train.style import (
        legend_outside,
        new_figure,
        readable_log_axis,
        save_figure,
        series_styles,
        workers_axis,
    )

    rows = result["rows"]
    methods = _methods(rows)
    fig = new_figure(11, 4.5, layout="constrained")
    left, right = fig.subplots(1, 2)
    for method, style in zip(methods, series_styles(methods), strict=True):
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["workers"])
        workers = [r["workers"] for r in mine]
        left.plot(workers, [r["step_time"] for r in mine], label=method, markersize=5,
                  **style.kwargs())
        right.plot(workers, [_speed_up(r) for r in mine], label=method, markersize=5,
                   **style.kwargs())
    counts = [r["workers"] for r in rows]
    for ax, label in ((left, "predicted seconds per step"), (right, "speed-up over AllReduce")):
        workers_axis(ax, counts)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    left.set_yscale("log")
    readable_log_axis(left.yaxis)
    right.axhline(1.0, color="black", linewidth=0.8)
    legend_outside(fig, *left.get_legend_handles_labels())
    fig.suptitle(f"{result['model']}, {result['compute_time']:g} s compute, "
                 f"{rate_label(result['bandwidth'])} links")
    save_figure(fig, path)


def _by_bandwidth(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    if not results:
        raise ValueError("results must hold at least one plan")
    return sorted(results, key=lambda r: r["bandwidth"])


def plot_bandwidth(results: Sequence[dict[str, Any]], path: Path) -> None:
    """Predicted speed-up over AllReduce against the link's bandwidth, one line per method,
    a panel per worker count; ``results`` are plans (as :func:`gossamer.plan.cli.plan`
    returns them) that differ in their bandwidth. The speed-up axis is log where it spans
    more than a factor of 10."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    from gossamer.train.style import (
        legend_outside,
        new_figure,
        readable_log_axis,
        save_figure,
        series_styles,
    )

    results = _by_bandwidth(results)
    rows = [r for result in results for r in result["rows"]]
    methods = _methods(rows)
    workers = sorted({r["workers"] for r in rows})
    rates = [result["bandwidth"] * 8 for result in results]
    fig = new_figure(3.2 + 3.6 * len(workers), 4.2, layout="constrained")
    axes = fig.subplots(1, len(workers), squeeze=False, sharey=True)[0]
    speed_ups = []
    for ax, n in zip(axes, workers, strict=True):
        for method, style in zip(methods, series_styles(methods), strict=True):
            ys = [_speed_up(next((r for r in result["rows"]
                                  if r["method"] == method and r["workers"] == n), None))
                  for result in results]
            ax.plot(rates, ys, label=method, markersize=5, **style.kwargs())
            speed_ups += [y for y in ys if y > 0]
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator(rates))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: rate_label(v / 8, short=True)))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.margins(x=0.08)
        ax.set_xlabel("bandwidth per worker (bit/s)")
        ax.set_title(f"{n} workers", fontsize="medium")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("predicted speed-up over AllReduce")
    if speed_ups and max(speed_ups) > 10 * min(speed_ups):
        axes[0].set_yscale("log")
        readable_log_axis(axes[0].yaxis)
    legend_outside(fig, *axes[0].get_legend_handles_labels())
    first = results[0]
    fig.suptitle(f"{first['model']}, {first['compute_time']:g} s compute per step")
    save_figure(fig, path)


def bandwidth_table(results: Sequence[dict[str, Any]]) -> list[str]:
    """The markdown lines of :func:`plot_bandwidth`'s numbers: a row per worker count and
    method, a column per bandwidth, each cell the speed-up over AllReduce and the step time."""
    from gossamer.train.style import markdown_table

    results = _by_bandwidth(results)
    rows = [r for result in results for r in result["rows"]]
    header = ["workers", "method", *(rate_label(r["bandwidth"]) for r in results)]
    lines = []
    for n in sorted({r["workers"] for r in rows}):
        for method in _methods(rows):
            cells: list[Any] = [n, method]
            for result in results:
                row = next((r for r in result["rows"]
                            if r["method"] == method and r["workers"] == n), None)
                speed_up = _speed_up(row)
                cells.append("-" if row is None else
                             ("-" if math.isnan(speed_up) else f"{speed_up:.2f}x")
                             + f" ({row['step_time']:.3g} s)")
            lines.append(cells)
    return markdown_table(header, lines)
