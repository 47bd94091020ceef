"""What a benchmark shows: markdown tables for BENCHMARKS.md and figures drawn off-screen,
in the one style of every gossamer figure.

The style keeps a figure legible at page width with many methods on it:

- :func:`series_styles`: each method its own colour x marker x line style, the same in every
  figure (a fixed map for the registered methods, chosen so that the methods of one family
  never share a colour), distinct within a figure for 40 series;
- :func:`legend_outside`: the legend to the right of the data, never over it;
- :func:`readable_log_axis`: a log axis labelled with plain numbers and few enough ticks not
  to overlap, also when it spans less than a decade;
- :func:`workers_axis`: worker counts on a log-2 axis, labelled 8, 32, 128;
- :func:`loss_axis`: a log loss axis where the losses span more than a factor of 10, its top
  capped so that one diverged run does not flatten the others.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Style", "legend_outside", "loss_axis", "markdown_table", "method_style",
           "new_figure", "plain_number", "readable_log_axis", "save_figure", "series_styles",
           "workers_axis"]


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


def new_figure(width: float, height: float, layout: str | None = None):
    """A matplotlib Figure of ``width`` x ``height`` inches at 120 dpi on the Agg canvas: no
    display and no pyplot state, so benchmarks draw the same in worker processes.
    ``layout="constrained"`` makes room for a legend outside the axes (:func:`legend_outside`);
    then call :func:`save_figure` rather than ``tight_layout``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=120, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Any, path: str | Path) -> Path:
    """Write ``fig`` to ``path`` (a PNG), the legend outside the axes included."""
    path = Path(path)
    fig.savefig(path, bbox_inches="tight", pad_inches=0.08)
    return path


# ----------------------------------------------------------------------------- series styles

#: ten colours that stay apart on screen and in print: black (AllReduce, the baseline), then
#: matplotlib's tab10 without its grey (too close to black and to the grid)
PALETTE = ("#000000", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
           "#e377c2", "#bcbd22", "#17becf")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", "h")
LINESTYLES = ("-", "--", "-.", ":")
#: every style there is: a colour (slot) in each line style (band)
STYLES = len(PALETTE) * len(LINESTYLES)

#: (band, slot) of each registered method: solid for AllReduce, the gossip methods and local
#: SGD's family, dashed for the rest (dash-dotted: the newer outer methods). Methods of one
#: family (the gossip methods and NoLoCo, which gossips between rounds; local SGD, QSR, DiLoCo,
#: Streaming DiLoCo, SPARTA, DeMo, SparseLoCo, DES-LOC and MuLoCo; the compressors) have
#: colours of their own; two methods sharing a colour differ in line style and marker too.
METHOD_STYLES: dict[str, tuple[int, int]] = {
    "allreduce": (0, 0), "sgp": (0, 1), "osgp": (0, 2), "dpsgd": (0, 3), "adpsgd": (0, 4),
    "gossipgrad": (0, 5), "wagma": (0, 6), "localsgd": (0, 7), "diloco": (0, 8),
    "streaming-diloco": (0, 9),
    "qsr": (1, 1), "dgc": (1, 2), "demo": (1, 3), "sparta": (1, 4), "qsgd": (1, 5),
    "topk": (1, 6), "randomk": (1, 7), "powersgd": (1, 8), "fp16": (1, 9),
    "sparseloco": (2, 2), "desloc": (2, 5), "muloco": (2, 6), "noloco": (2, 7),
}


@dataclass(frozen=True)
class Style:
    """How one series is drawn: pass :meth:`kwargs` to ``Axes.plot``."""

    index: int  # band * len(PALETTE) + slot, in [0, STYLES)

    @property
    def color(self) -> str:
        return PALETTE[self.index % len(PALETTE)]

    @property
    def linestyle(self) -> str:
        return LINESTYLES[self.index // len(PALETTE) % len(LINESTYLES)]

    @property
    def marker(self) -> str:
        # shifted by 3 per band: a colour repeated in another band has another marker
        band, slot = divmod(self.index % STYLES, len(PALETTE))
        return MARKERS[(slot + 3 * band) % len(MARKERS)]

    def kwargs(self) -> dict[str, Any]:
        return {"color": self.color, "linestyle": self.linestyle, "marker": self.marker}


def _preferred(label: str) -> int:
    """The style index ``label`` asks for: its method's (``NAME`` of ``NAME:KEY=VALUE``), or a
    stable hash of the label for a name not in :data:`METHOD_STYLES`."""
    name = label.split(":", 1)[0].strip()
    if name in METHOD_STYLES:
        band, slot = METHOD_STYLES[name]
        return band * len(PALETTE) + slot
    return zlib.crc32(label.encode()) % STYLES


def method_style(label: str) -> Style:
    """The style of ``label`` (a method, or ``NAME:KEY=VALUE`` of one) when nothing else in
    its figure asks for it: the same in every figure."""
    return Style(_preferred(label))


def series_styles(labels: Iterable[str]) -> list[Style]:
    """One style per label, all distinct while there are at most :data:`STYLES` labels.

    Each label gets :func:`method_style`'s unless another label took it; then the same
    colour in the next line style (so ``dgc`` and ``dgc:ratio=0.01`` share a colour and differ
    in dashes), else the next free style. The registered methods choose first, then their
    variants (``NAME:KEY=VALUE``), then other names, so that a method keeps its style whatever
    else is in the figure.

    Example::

        for (label, xs, ys), style in zip(series, series_styles(s[0] for s in series)):
            ax.plot(xs, ys, label=label, **style.kwargs())
    """
    labels = list(labels)

    def rank(label: str) -> int:
        if label in METHOD_STYLES:
            return 0
        return 1 if label.split(":", 1)[0].strip() in METHOD_STYLES else 2

    taken: set[int] = set()
    chosen: dict[int, Style] = {}
    for i in sorted(range(len(labels)), key=lambda i: rank(labels[i])):  # stable: in order
        want = _preferred(labels[i])
        candidates = [(want + band * len(PALETTE)) % STYLES for band in range(len(LINESTYLES))]
        candidates += [(want + k) % STYLES for k in range(STYLES)]
        index = next((c for c in candidates if c not in taken), want)
        taken.add(index)
        chosen[i] = Style(index)
    return [chosen[i] for i in range(len(labels))]


def legend_outside(fig: Any, handles: Sequence[Any] | None = None,
                   labels: Sequence[str] | None = None, ax: Any = None,
                   title: str | None = None) -> Any:
    """The legend to the right of the data, in as many columns as its height needs.

    Of ``ax``'s lines (or ``handles`` and ``labels``, e.g. those of several axes). On a figure
    made with ``layout="constrained"`` it is placed outside every axes; otherwise outside
    ``ax`` (then save with :func:`save_figure`, which keeps it in the picture)."""
    if handles is None or labels is None:
        source = ax if ax is not None else fig.axes[0]
        handles, labels = source.get_legend_handles_labels()
    rows = max(1, int(fig.get_figheight() * 4.5))  # entries of "small" text per column
    ncol = max(1, math.ceil(len(labels) / rows))
    options = {"fontsize": "small", "ncol": ncol, "frameon": False, "title": title,
               "title_fontsize": "small"}
    if ax is None and fig.get_layout_engine() is not None:
        return fig.legend(handles, labels, loc="outside right upper", **options)
    ax = ax if ax is not None else fig.axes[-1]
    return ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                     borderaxespad=0.0, **options)


# ----------------------------------------------------------------------------- axes


def plain_number(value: float) -> str:
    """A tick label without exponents where a number reads plainly: ``0.3``, ``8``,
    ``2500``, ``120000``; ``1e-05`` and ``3e+07`` beyond. Three significant digits."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    if not 1e-3 <= abs(value) < 1e6:
        return f"{value:.3g}"
    rounded = float(f"{value:.3g}")
    text = f"{rounded:.6f}".rstrip("0").rstrip(".")
    return text


def readable_log_axis(axis: Any) -> None:
    """Label a log axis (``ax.xaxis`` or ``ax.yaxis``, after the data is drawn) with plain
    numbers and as many ticks as its length holds: over less than a decade, evenly spaced
    ones (where matplotlib labels every minor tick and "3e-01" runs into "4e-01"); over up to
    three decades, 1-2-5 steps; beyond, the decades. Minor ticks are not labelled."""
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    ax = axis.axes
    box = ax.get_position()
    # labels that fit side by side: about 0.6 inch each along x, a line's height (0.3) along y
    if axis is ax.xaxis:
        room = max(2, int(box.width * ax.figure.get_figwidth() / 0.6))
    else:
        room = max(2, int(box.height * ax.figure.get_figheight() / 0.3))
    low, high = sorted(axis.get_view_interval())
    decades = math.log10(high / low) if low > 0 and high > 0 else math.inf
    if decades < 1:
        axis.set_major_locator(MaxNLocator(nbins=min(4, room), steps=[1, 2, 2.5, 5, 10]))
    elif decades <= 3 and 3 * decades + 1 <= room:
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    else:
        axis.set_major_locator(LogLocator(base=10, numticks=room))
    axis.set_major_formatter(FuncFormatter(lambda v, _: plain_number(v)))
    axis.set_minor_formatter(NullFormatter())


def workers_axis(ax: Any, workers: Iterable[int], label: str = "workers") -> None:
    """The x axis of worker counts: log 2, a tick at each count, labelled ``8 32 128``."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    counts = sorted({int(n) for n in workers})
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(counts))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.0f}"))
    ax.xaxis.set_minor_locator(NullLocator())
    if len(counts) == 1:  # one count: some room around it
        ax.set_xlim(counts[0] / 1.5, counts[0] * 1.5)
    ax.set_xlabel(label)


#: where the losses span more than this factor, the loss axis is log
LOG_LOSS_SPAN = 10.0
#: the loss axis ends at this multiple of the 90th percentile of the losses when the largest
#: is above it: a diverged run leaves the top instead of flattening every other curve
LOSS_CAP = 5.0


def loss_scale(losses: Iterable[float]) -> str:
    """``"log"`` when the positive finite losses span more than :data:`LOG_LOSS_SPAN`
    (e.g. 16 runs from 2.3 down to 0.05-0.3, which pile up near 0 on a linear axis), else
    ``"linear"``."""
    positive = [y for y in losses if y > 0 and math.isfinite(y)]
    return "log" if positive and max(positive) > LOG_LOSS_SPAN * min(positive) else "linear"


def loss_axis(ax: Any, losses: Iterable[float], label: str = "loss") -> None:
    """The y axis of losses drawn on ``ax``: log where they span more than a decade (plain
    tick labels), linear otherwise; its top capped at :data:`LOSS_CAP` times the 90th
    percentile of the losses."""
    values = sorted(y for y in losses if math.isfinite(y))
    ax.set_ylabel(label)
    if not values:
        return
    scale = loss_scale(values)
    ax.set_yscale(scale)
    cap = LOSS_CAP * values[min(len(values) - 1, int(0.9 * len(values)))]
    if values[-1] > cap > 0:
        low, _ = ax.get_ylim()
        ax.set_ylim(low, cap)
    if scale == "log":
        readable_log_axis(ax.yaxis)
