"""The figure style (gossamer.train.style), the planner's figures (gossamer.plan.figure) and
`gossamer bench report`, which regenerates the documentation's figures beside their tables."""

from __future__ import annotations

from pathlib import Path

import pytest

import gossamer.train.style as style
from gossamer.cli import main
from gossamer.plan.figure import bandwidth_table, plot, plot_bandwidth, rate_label

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_drawn_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert len(data) > 10_000, f"{path} is {len(data)} bytes: nothing drawn?"


@pytest.fixture
def figures(monkeypatch) -> list:
    """The figures that gossamer saves during the test, kept for inspection."""
    kept, save = [], style.save_figure
    monkeypatch.setattr(style, "save_figure", lambda fig, path: kept.append(fig) or save(fig, path))
    return kept


def _overlap(a, b) -> bool:
    return (min(a.x1, b.x1) - max(a.x0, b.x0) > 1) and (min(a.y1, b.y1) - max(a.y0, b.y0) > 1)


def _labels_apart(ax, axis) -> list[str]:
    """The visible tick labels of ``axis``, checked not to overlap each other."""
    renderer = ax.figure.canvas.get_renderer()
    low, high = sorted(axis.get_view_interval())
    index = 0 if axis is ax.xaxis else 1
    shown = [t for t in axis.get_ticklabels()
             if t.get_text() and low <= t.get_position()[index] <= high]
    boxes = [t.get_window_extent(renderer) for t in shown]
    assert not any(_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]), \
        [t.get_text() for t in shown]
    return [t.get_text() for t in shown]


# ----------------------------------------------------------------------------- the style


def test_every_registered_method_has_a_style_of_its_own():
    from gossamer.algorithms import available

    names = available()
    assert set(style.METHOD_STYLES) == set(names)  # a new method is given its place
    looks = {(s.color, s.marker, s.linestyle) for s in map(style.method_style, names)}
    assert len(looks) == len(names)
    families = [("sgp", "osgp", "dpsgd", "adpsgd", "gossipgrad", "wagma", "noloco"),
                ("localsgd", "qsr", "diloco", "streaming-diloco", "sparta", "demo",
                 "sparseloco", "desloc", "muloco"),
                ("dgc", "fp16", "powersgd", "qsgd", "topk", "randomk")]
    for family in families:  # a family never shares a colour, nor with AllReduce
        colours = [style.method_style(name).color for name in ("allreduce", *family)]
        assert len(set(colours)) == len(colours), family


def test_series_styles_stay_distinct_and_keep_a_method_its_own():
    labels = [f"run{i}" for i in range(30)] + ["sgp", "dgc", "dgc:ratio=0.01"]
    styles = style.series_styles(labels)
    assert len({s.index for s in styles}) == len(labels)
    by = dict(zip(labels, styles, strict=True))
    assert by["sgp"] == style.method_style("sgp")  # whatever came before it
    assert by["dgc"] == style.method_style("dgc")
    variant = by["dgc:ratio=0.01"]
    assert variant.color == by["dgc"].color and variant.linestyle != by["dgc"].linestyle


def test_plain_numbers_and_a_log_axis_under_a_decade(tmp_path):
    assert [style.plain_number(v) for v in (0.3, 8, 2500, 123456, 1e-5, 3e7)] == \
        ["0.3", "8", "2500", "123000", "1e-05", "3e+07"]
    fig = style.new_figure(4, 3, layout="constrained")
    ax = fig.add_subplot()
    ax.plot([0.31, 0.42], [1, 2])
    ax.set_xscale("log")
    style.readable_log_axis(ax.xaxis)
    style.save_figure(fig, tmp_path / "axis.png")
    labels = _labels_apart(ax, ax.xaxis)
    assert len(labels) >= 2 and all("e" not in text for text in labels)  # 0.35, not 3.5e-01


# ----------------------------------------------------------------------------- the planner


def _plan(bandwidth: float, workers=(8, 32, 128)) -> dict:
    """A plan as gossamer.plan.cli.plan returns one: AllReduce's step grows with the workers
    and shrinks with the bandwidth; SGP's less so."""
    rows = []
    for n in workers:
        base = 0.25 + 2e8 * (n - 1) / n / bandwidth
        for method, step in (("allreduce", base), ("sgp", 0.25 + 1e8 / bandwidth),
                             ("localsgd", 0.25 + 2e6 / bandwidth)):
            rows.append({"workers": n, "method": method, "step_time": step,
                         "bytes_per_step": 1e6, "idle_fraction": 0.1,
                         "speed_up": base / step})
    return {"model": "resnet50", "compute_time": 0.25, "latency": 50e-6,
            "bandwidth": bandwidth, "rows": rows}


def test_the_plan_figure_labels_worker_counts_as_numbers(tmp_path, figures):
    plot(_plan(1.25e9), tmp_path / "plan.png")
    assert_drawn_png(tmp_path / "plan.png")
    [fig] = figures
    left, right = fig.axes
    for ax in (left, right):
        assert _labels_apart(ax, ax.xaxis) == ["8", "32", "128"]  # not 2^3 2^5 2^7
    renderer = fig.canvas.get_renderer()
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == ["allreduce", "sgp", "localsgd"]
    for ax in (left, right):
        assert not _overlap(legend.get_window_extent(renderer), ax.get_window_extent(renderer))
    sgp = next(line for line in right.get_lines() if line.get_label() == "sgp")
    assert list(sgp.get_xdata()) == [8, 32, 128]
    assert sgp.get_ydata()[0] == pytest.approx((0.25 + 2e8 * 7 / 8 / 1.25e9)
                                               / (0.25 + 1e8 / 1.25e9))


def test_the_bandwidth_figure_and_its_table(tmp_path, figures):
    rates = [12.5e6, 125e6, 1.25e9, 12.5e9]  # 100 Mbit/s .. 100 Gbit/s
    results = [_plan(r, workers=(8, 32)) for r in reversed(rates)]  # any order
    plot_bandwidth(results, tmp_path / "bw.png")
    assert_drawn_png(tmp_path / "bw.png")
    [fig] = figures
    assert [ax.get_title() for ax in fig.axes] == ["8 workers", "32 workers"]
    ax = fig.axes[0]
    assert _labels_apart(ax, ax.xaxis) == ["100M", "1G", "10G", "100G"]
    sgp = next(line for line in ax.get_lines() if line.get_label() == "sgp")
    expected = [(0.25 + 2e8 * 7 / 8 / r) / (0.25 + 1e8 / r) for r in rates]
    assert list(sgp.get_ydata()) == pytest.approx(expected)
    assert ax.get_yscale() == "log"  # speed-ups from 1 to about 35

    table = bandwidth_table(results)
    assert table[0] == "| workers | method | 100 Mbit/s | 1 Gbit/s | 10 Gbit/s | 100 Gbit/s |"
    assert len(table) == 2 + 2 * 3
    sgp_row = next(line for line in table if line.startswith("| 8 | sgp |"))
    assert f"{expected[0]:.2f}x" in sgp_row
    assert rate_label(12.5e6) == "100 Mbit/s" and rate_label(1.25e9, short=True) == "10G"


def test_a_missing_speed_up_is_a_gap_not_an_error(tmp_path):
    result = _plan(1.25e9)
    result["rows"][1]["speed_up"] = None
    plot_bandwidth([result], tmp_path / "bw.png")
    assert "| 8 | sgp | - (" in "\n".join(bandwidth_table([result]))


# ----------------------------------------------------------------------------- bench report


@pytest.mark.slow
def test_bench_report_writes_each_figure_beside_its_table(tmp_path, capsys):
    """Tiny settings: the planner on the digits MLP at 4 workers, one method trained for 10
    steps on 2 simulated workers; then the gossip figure redrawn from that run directory."""
    out, runs = tmp_path / "figures", tmp_path / "runs"
    assert main(["bench", "report", "--out", str(out), "--runs", str(runs),
                 "--only", "speed_up_vs_bandwidth", "loss_vs_bytes_local",
                 "--workers", "4", "--model", "digits-mlp",
                 "--bandwidths", "100mbit", "10gbit", "--plan-algorithms", "allreduce,sgp",
                 "--sim", "2", "--steps", "10", "--set", "eval_every=5",
                 "--local-algorithms", "localsgd:period=2"]) == 0
    assert main(["bench", "report", "--out", str(out), "--only", "accuracy_vs_time_gossip",
                 "--gossip-runs", str(runs)]) == 0
    printed = capsys.readouterr().out
    pages = {}
    for name in ("speed_up_vs_bandwidth", "loss_vs_bytes_local", "accuracy_vs_time_gossip"):
        assert_drawn_png(out / f"{name}.png")
        pages[name] = (out / f"{name}.md").read_text()
        assert f"]({name}.png)" in pages[name]
        assert f"wrote {out / name}.png" in printed and f"wrote {out / name}.md" in printed
        assert "Made by `gossamer bench report " in pages[name]
    speed_up = pages["speed_up_vs_bandwidth"]
    assert "| workers | method | 100 Mbit/s | 10 Gbit/s |" in speed_up
    assert "| 4 | allreduce | 1.00x (" in speed_up and "| 4 | sgp |" in speed_up
    assert "--plan-algorithms allreduce,sgp" in speed_up  # the command that made it
    local = pages["loss_vs_bytes_local"]
    rows = [line for line in local.splitlines() if line.startswith("| ")][1:]
    assert [row.split("|")[1].strip() for row in rows] == ["localsgd:period=2"]
    assert "2 workers (simulated), 10 steps" in local
    gossip = pages["accuracy_vs_time_gossip"]
    rows = [line for line in gossip.splitlines() if line.startswith("| ")][1:]
    # read back from --gossip-runs: named by their config
    assert [row.split("|")[1].strip() for row in rows] == ["localsgd"]
    assert [p.name for p in runs.iterdir()] == ["localsgd_period=2"]


def test_bench_report_refuses_a_bad_setting_before_any_run(tmp_path, capsys):
    for argv, message in (
            (["--set", "algorithm=sgp"], "the report sets algorithm itself"),
            (["--local-algorithms", "allreduce,nope"], "nope"),
            (["--plan-algorithms", "allreduce,nope"], "nope"),
            (["--set", "nonsense=1"], "nonsense")):
        assert main(["bench", "report", "--out", str(tmp_path / "f"), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("gossamer bench: error: ") and message in err, err
        assert not (tmp_path / "f").exists()
