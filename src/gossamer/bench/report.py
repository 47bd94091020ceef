"""What a benchmark shows: markdown tables for BENCHMARKS.md and figures drawn off-screen."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["markdown_table", "new_figure"]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """The lines of a markdown table: ``header``, the rule, one line per row (cells are
    written with ``str``).

    Example::

        print("\\n".join(markdown_table(["workers", "ms"], [[2, "10.9"], [4, "24.5"]])))
    """
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"a row has {len(row)} cells, the header {len(header)}: {row}")
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows)]


def new_figure(width: float, height: float):
    """A matplotlib Figure of ``width`` x ``height`` inches at 120 dpi on the Agg canvas: no
    display and no pyplot state, so benchmarks draw the same in worker processes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=120)
    FigureCanvasAgg(fig)
    return fig
