"""The command line: training end to end, topology printing, errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from default_runs import default_run

from gossamer.cli import main, summary_text
from gossamer.train.config import TrainConfig


def test_default_training_reaches_90_percent_on_digits():
    result = default_run("allreduce")
    assert result["eval_accuracy"] >= 0.90
    assert result["world_size"] == 4
    assert result["bytes_sent"] > 0
    assert result["wall_clock"] > 0
    assert result["synchronizations"] == TrainConfig().steps
    # the same run as the README's first command (scripts/train: gossamer train, 4 simulated
    # workers): the summary it shows is this run's
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    shown = re.search(r"a summary like:\n\n```\n(.*?)```", readme, re.S)
    assert shown, "README.md: the summary of scripts/train"
    assert shown[1].split() == summary_text(result).split()


def test_train_command_prints_summary_and_writes_json(tmp_path, capsys):
    out = tmp_path / "result.json"
    code = main(["train", "--sim", "2", "--steps", "30", "--eval-every", "10", "--quiet",
                 "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "eval accuracy" in printed and "bytes sent per worker" in printed
    data = json.loads(out.read_text())
    assert data["config"]["steps"] == 30
    assert [h["step"] for h in data["result"]["history"]] == [10, 20, 30]


def test_progress_is_shown_unless_quiet(capsys):
    assert main(["train", "--sim", "2", "--steps", "10"]) == 0
    printed = capsys.readouterr()
    assert "step 10/10" in printed.err
    # the bar counts rank 0's bytes, the summary the mean over workers: each says which
    assert re.search(r"step 10/10 .* rank 0 sent \d", printed.err)
    assert re.search(r"^bytes sent per worker \(mean\) +\d", printed.out, re.M)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--algorithm", "nope"], "known algorithms: adpsgd, allreduce"),
        (["train", "--bandwidth", "-1"], "bandwidth"),
        (["train", "--latency", "-1"], "latency"),
        (["train", "--steps", "0"], "steps"),
        (["train", "--option", "bucket_mb"], "KEY=VALUE"),
        (["train", "--steps", "2", "--compute-time", "-1"], "compute_time"),
        (["topology", "hypercube", "--workers", "6"], "n=6"),
        (["topology", "ring", "--workers", "0"], "n must be >= 1"),
    ],
)
def test_bad_input_is_a_clear_error(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_topology_command(capsys):
    assert main(["topology", "exponential", "--workers", "8"]) == 0
    out = capsys.readouterr().out
    assert "spectral gap" in out and "0 -> 1" in out


def test_algorithms_command(capsys):
    assert main(["algorithms"]) == 0
    assert "allreduce" in capsys.readouterr().out


def test_algorithms_lists_each_method_and_compressor_with_its_options_help(capsys):
    assert main(["algorithms"]) == 0
    out = capsys.readouterr().out
    qsr = next(line for line in out.splitlines() if line.startswith("qsr:"))
    assert "lasts ``H = max(period, floor((alpha / lr) ** power))``" in qsr  # the paragraph
    assert "ratio (float, default 0.01): fraction of each tensor sent" in out  # a compressor's
    assert "compressors (--compressor" in out


def test_version(capsys):
    import gossamer

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"gossamer {gossamer.__version__}"


def test_help_shows_what_each_command_takes(capsys):
    for argv in (["train", "--help"], ["compare", "--help"], ["launch", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
    out = capsys.readouterr().out
    train, compare, launch = out.split("usage: gossamer ")[1:]
    assert "(default: 4 without a launcher, 0 under one)" in " ".join(train.split())
    for flag in ("--option", "--compressor", "--run-dir", "--resume", "--sim "):
        assert flag in train and flag not in compare  # compare names them per entry
    assert "required, except with --cleanup" in " ".join(launch.split())

