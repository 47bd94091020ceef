"""Reading run directories back, plots, the Markdown report, `gossamer plot`, TensorBoard."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path

import pytest
import yaml

from gossamer.train.report import (
    TensorBoardLogger,
    add_plot_arguments,
    format_bytes,
    load_metrics,
    markdown_table,
    plot_runs,
    run_plot,
    write_report,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LOSS_PLOTS = {"loss_vs_steps.png", "loss_vs_wall_clock.png", "loss_vs_bytes.png"}
ACCURACY_PLOTS = {"accuracy_vs_steps.png", "accuracy_vs_wall_clock.png", "accuracy_vs_bytes.png"}


def write_run(
    run_dir: Path,
    algorithm: str = "allreduce",
    *,
    dataset: str = "digits",
    model: str = "mlp",
    workers: int = 4,
    bytes_per_step: float = 1.2e5,
    accuracy: bool = True,
    truncated: bool = False,
    finished: bool = True,
) -> Path:
    """A run directory like the training loop writes, with a known final state."""
    run_dir.mkdir(parents=True)
    config = {"algorithm": algorithm, "options": {}, "dataset": dataset, "model": model,
              "steps": 40, "seed": 0, "sim": workers}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    records = []
    for step in range(5, 41, 5):
        records.append({"kind": "train", "step": step, "train_loss": 2.3 / (1 + 0.1 * step),
                        "lr": 0.05, "bytes_sent": bytes_per_step * step,
                        "wall_clock": 0.011 * step})
        if step % 10 == 0:
            record = {
                "kind": "eval", "step": step, "train_loss": 2.3 / (1 + 0.1 * step),
                "eval_loss": 2.5 / (1 + 0.08 * step),
                "worker_eval_loss": [2.5 / (1 + 0.08 * step)] * workers,
                "consensus_distance": 1e-3 / step, "bytes_sent": bytes_per_step * step,
                "messages_sent": 2.0 * step, "synchronizations": step,
                "wall_clock": 0.011 * step, "examples_per_second": 11636.4,
                "a_field_from_the_future": {"nested": True},
            }
            if accuracy:
                record["eval_accuracy"] = 0.5 + 0.01 * step
                record["worker_eval_accuracy"] = [0.5 + 0.01 * step] * workers
            else:
                record["eval_accuracy"] = math.nan  # language models: no accuracy
            records.append(record)
    records.insert(3, {"kind": "checkpoint", "step": 15, "path": "ckpt.pt"})  # unknown kind
    if finished:
        summary = {**records[-1], "kind": "summary", "algorithm": algorithm,
                   "world_size": workers, "mode": "simulated"}
        records.append(summary)
    lines = [json.dumps(r) for r in records]
    if truncated:
        lines.append(json.dumps(records[-1])[:25])  # a crash mid-write: no newline, cut short
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + ("" if truncated else "\n"))
    return run_dir


def assert_drawn_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert len(data) > 10_000, f"{path} is {len(data)} bytes: nothing drawn?"


# ----------------------------------------------------------------------------- load_metrics


def test_load_metrics_groups_records_and_ignores_unknown_kinds(tmp_path):
    run = load_metrics(write_run(tmp_path / "r1", "gossip"))
    assert run.name == "gossip"
    assert run.config["dataset"] == "digits" and run.config["sim"] == 4
    assert [r["step"] for r in run.evals] == [10, 20, 30, 40]
    assert [r["step"] for r in run.trains] == list(range(5, 41, 5))
    assert run.summary is not None and run.summary["world_size"] == 4
    assert run.final["eval_accuracy"] == pytest.approx(0.9)
    assert run.mode == "simulated" and run.workers == 4


def test_load_metrics_skips_a_truncated_last_line_with_a_warning(tmp_path):
    run_dir = write_run(tmp_path / "crashed", truncated=True)
    with pytest.warns(UserWarning, match=r"metrics\.jsonl:\d+.*not valid JSON"):
        run = load_metrics(run_dir)
    assert len(run.evals) == 4 and run.summary is not None


def test_unfinished_run_falls_back_to_last_eval_and_config(tmp_path):
    run = load_metrics(write_run(tmp_path / "r", finished=False, workers=8))
    assert run.summary is None
    assert run.final["step"] == 40
    assert run.workers == 8 and run.mode == "simulated"  # from config.sim


def test_name_is_the_directory_without_an_algorithm(tmp_path):
    run_dir = tmp_path / "my-run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "step": 1}) + "\n")
    assert load_metrics(run_dir).name == "my-run"


def test_missing_directory_or_metrics_raises_naming_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="nope"):
        load_metrics(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"empty.*metrics\.jsonl"):
        load_metrics(empty)


# ----------------------------------------------------------------------------- plots


@pytest.mark.slow
def test_plot_runs_writes_six_drawn_pngs(tmp_path):
    runs = [load_metrics(write_run(tmp_path / "a", "allreduce")),
            load_metrics(write_run(tmp_path / "b", "powersgd", bytes_per_step=3e3))]
    paths = plot_runs(runs, tmp_path / "out")
    assert {p.name for p in paths} == LOSS_PLOTS | ACCURACY_PLOTS
    for path in paths:
        assert path.parent == tmp_path / "out"
        assert_drawn_png(path)


def test_language_model_without_accuracy_gets_only_loss_plots(tmp_path):
    runs = [load_metrics(write_run(tmp_path / "lm", dataset="tinyshakespeare", model="gpt",
                                   accuracy=False))]
    paths = plot_runs(runs, tmp_path / "out")
    assert {p.name for p in paths} == LOSS_PLOTS
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(LOSS_PLOTS)
    table = markdown_table(runs)
    row = table.splitlines()[2]
    assert row.split("|")[3].strip() == "-"  # accuracy column


def test_plot_runs_rejects_no_runs(tmp_path):
    with pytest.raises(ValueError, match="runs"):
        plot_runs([], tmp_path)


# ----------------------------------------------------------------------------- report


def test_markdown_table_has_one_row_per_run_with_formatted_numbers(tmp_path):
    runs = [load_metrics(write_run(tmp_path / "a", "allreduce")),
            load_metrics(write_run(tmp_path / "b", "powersgd", bytes_per_step=3e3))]
    table = markdown_table(runs)
    lines = table.strip().splitlines()
    assert len(lines) == 4  # header, rule, two runs
    assert lines[1].count(":") == 9 and "---:" in lines[1]  # numbers right-aligned
    allreduce, powersgd = lines[2], lines[3]
    assert "allreduce" in allreduce and "powersgd" in powersgd
    assert "90.00" in allreduce  # accuracy in %
    assert f"{2.5 / (1 + 0.08 * 40):.4f}" in allreduce
    assert "4.8 MB" in allreduce and "120.0 kB" in powersgd
    assert "2.50e-05" in allreduce  # consensus distance
    assert "0.44" in allreduce and "11636" in allreduce
    assert len({len(line) for line in lines}) == 1  # padded into columns


def test_repeated_algorithms_are_named_by_directory(tmp_path):
    runs = [load_metrics(write_run(tmp_path / "lr0.1", "gossip")),
            load_metrics(write_run(tmp_path / "lr0.01", "gossip"))]
    table = markdown_table(runs)
    assert "lr0.1" in table and "lr0.01" in table


@pytest.mark.slow
def test_write_report_embeds_the_plots_and_names_the_task(tmp_path):
    runs = [load_metrics(write_run(tmp_path / "a", "allreduce")),
            load_metrics(write_run(tmp_path / "b", "gossip"))]
    report = write_report(runs, tmp_path / "out", title="digits shoot-out")
    text = report.read_text()
    assert report == tmp_path / "out" / "report.md"
    assert text.startswith("# digits shoot-out\n")
    assert "digits / mlp, 4 workers (simulated), 40 steps, seed 0" in text
    assert "| allreduce" in text and "| gossip" in text
    for name in LOSS_PLOTS | ACCURACY_PLOTS:
        assert f"]({name})" in text
        assert_drawn_png(tmp_path / "out" / name)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(12_345_678) == "12.3 MB"
    assert format_bytes(2e12) == "2.0 TB"


# ----------------------------------------------------------------------------- gossamer plot


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_plot_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.slow
def test_run_plot_defaults_to_the_run_dirs_plots_folder(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run")
    assert run_plot(parse([str(run_dir)])) == 0
    printed = capsys.readouterr().out
    assert str(run_dir / "plots" / "report.md") in printed
    assert str(run_dir / "plots" / "loss_vs_bytes.png") in printed


@pytest.mark.slow
def test_run_plot_several_runs_to_out(tmp_path, capsys):
    a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b", "gossip")
    out = tmp_path / "cmp"
    assert run_plot(parse([str(a), str(b), "--out", str(out)])) == 0
    assert (out / "report.md").is_file()
    assert str(out / "accuracy_vs_steps.png") in capsys.readouterr().out


@pytest.mark.slow
def test_run_plot_several_runs_default_to_cwd_folder(tmp_path, monkeypatch):
    a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b", "gossip")
    monkeypatch.chdir(tmp_path)
    assert run_plot(parse([str(a), str(b)])) == 0
    assert (tmp_path / "gossamer-plots" / "report.md").is_file()


def test_run_plot_missing_dir_raises(tmp_path):
    with pytest.raises(ValueError, match="missing-run"):
        run_plot(parse([str(tmp_path / "missing-run")]))


# ----------------------------------------------------------------------------- TensorBoard


def test_tensorboard_logger_writes_events_or_says_how_to_install(tmp_path):
    record = {"kind": "eval", "step": 10, "eval_loss": 0.5, "worker_eval_loss": [0.5, 0.6],
              "mode": "simulated"}
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(ImportError, match="pip install tensorboard"):
            TensorBoardLogger(tmp_path / "tb")
    else:
        with TensorBoardLogger(tmp_path / "tb") as logger:
            logger.log(record)
            logger.log({"kind": "summary", "step": 10, "eval_loss": 0.5})  # ignored
        events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
        assert len(events) == 1 and events[0].stat().st_size > 0


def _overlap(a, b) -> bool:
    """Whether two display boxes share more than a pixel's width."""
    return (min(a.x1, b.x1) - max(a.x0, b.x0) > 1) and (min(a.y1, b.y1) - max(a.y0, b.y0) > 1)


def _drawn_figures(monkeypatch) -> list:
    """The figures that gossamer saves from now on, kept for inspection."""
    import gossamer.train.style as style

    figures, save = [], style.save_figure
    monkeypatch.setattr(style, "save_figure",
                        lambda fig, path: figures.append(fig) or save(fig, path))
    return figures


@pytest.mark.slow
def test_nineteen_runs_are_told_apart_beside_the_data_on_a_log_loss_axis(tmp_path,
                                                                          monkeypatch):
    """compare's 19 default methods: 19 styles, a method's the same in every figure, the
    legend beside the axes, a log loss axis, and a byte axis spanning less than a decade
    labelled with plain numbers that do not overlap."""
    from gossamer.train.compare import default_algorithms
    from gossamer.train.report import loss_scale, plot_metric

    figures = _drawn_figures(monkeypatch)
    names = default_algorithms().split(",")
    assert len(names) == 19
    runs = [load_metrics(write_run(tmp_path / name, name, bytes_per_step=1e4 * (1 + 0.02 * i)))
            for i, name in enumerate(names)]
    plot_metric(runs, "loss", "bytes", tmp_path / "loss.png", train=False)  # 10 to 40 steps
    plot_metric(runs[::-1][:5], "loss", "bytes", tmp_path / "five.png")
    fig, five = figures
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()
             if not line.get_label().startswith("_")}
    assert sorted(lines) == sorted(names)
    looks = {name: (line.get_color(), line.get_marker(), line.get_linestyle())
             for name, line in lines.items()}
    assert len(set(looks.values())) == 19
    colour = {name: look[0] for name, look in looks.items()}
    assert len({colour["sgp"], colour["osgp"], colour["sparta"]}) == 3
    assert colour["qsgd"] != colour["wagma"]
    again = {line.get_label(): (line.get_color(), line.get_marker(), line.get_linestyle())
             for line in five.axes[0].get_lines() if not line.get_label().startswith("_")}
    assert all(again[name] == looks[name] for name in again)  # the same in every figure

    renderer = fig.canvas.get_renderer()
    legend = fig.legends[0] if fig.legends else ax.get_legend()
    assert not _overlap(legend.get_window_extent(renderer), ax.get_window_extent(renderer))
    assert ax.get_yscale() == "linear"  # losses from 1.4 to 0.6: a factor under 10
    assert ax.get_xscale() == "log"
    low, high = ax.get_xlim()
    assert high / low < 10  # less than a decade of bytes
    shown = [t for t in ax.get_xticklabels()
             if t.get_text() and low <= t.get_position()[0] <= high]
    assert len(shown) >= 2
    assert all("e" not in t.get_text() for t in shown)  # 0.4, not 4e-01
    boxes = [t.get_window_extent(renderer) for t in shown]
    assert not any(_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:])

    # a diverged run: a log axis whose top leaves it, so the others keep their room
    diverged = write_run(tmp_path / "diverged", "sgp:lr=9")
    records = [json.loads(line) for line in (diverged / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        if "eval_loss" in record:
            record["eval_loss"] = 10.0 ** record["step"]
    (diverged / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    plot_metric([*runs, load_metrics(diverged)], "loss", "steps", tmp_path / "diverged.png")
    ax = figures[-1].axes[0]
    assert ax.get_yscale() == "log" and ax.get_ylim()[1] < 1e3

    assert loss_scale([2.3, 0.5, 0.1]) == "log"  # 16 curves would pile up near 0
    assert loss_scale([2.3, 1.1, 0.5]) == "linear"
    assert loss_scale([2.3, 0.1, 1e13, float("nan")]) == "log"
