"""Faults found by trying to break the command line (issue 20): a finished run resumed, bad
files and settings; each is a one-line error naming the argument or file, or is refused, and
nothing a finished run wrote is lost."""

from __future__ import annotations

import json

import pytest
import yaml

from gossamer.cli import main
from gossamer.train.config import TrainConfig
from gossamer.train.run import finished_run, run_training

RUN = ["train", "--sim", "2", "--steps", "4", "--eval-every", "2", "--checkpoint-every", "2",
       "--quiet"]


def _error(capsys, argv, code=2) -> str:
    """The stderr of ``gossamer ARGV``, which must exit ``code`` with one error line."""
    assert main(argv) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


# ------------------------------------------------------------- 1: resuming a finished run


@pytest.mark.slow
def test_resuming_a_finished_run_says_so_and_keeps_its_summary(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    assert main([*RUN, "--run-dir", run_dir]) == 0
    first = capsys.readouterr().out
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert json.loads(before.splitlines()[-1])["eval_accuracy"] > 0
    assert main([*RUN, "--run-dir", run_dir, "--resume"]) == 0
    out, err = capsys.readouterr()
    assert "already complete" in err and "nan" not in out
    assert out == first  # the kept summary, printed again
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before
    # fewer steps than the run has: refused, not an empty run
    err = _error(capsys, [*RUN[:4], "2", *RUN[5:], "--run-dir", run_dir, "--resume"])
    assert "trained to step 4" in err and "--steps 4" in err
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before


@pytest.mark.slow
def test_a_summary_lost_after_the_last_checkpoint_is_rebuilt_not_emptied(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main([*RUN, "--run-dir", str(run_dir)]) == 0
    capsys.readouterr()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "metrics.jsonl").write_text("".join(lines[:-1]))  # a crash before the summary
    assert main([*RUN, "--run-dir", str(run_dir), "--resume"]) == 0
    assert "already complete" in capsys.readouterr().err
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1]) == json.loads(
        lines[-1])


def _as_real_run(run_dir) -> None:
    """config.yaml as a run of real processes (launched) records it."""
    path = run_dir / "config.yaml"
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "sim": 0}))


@pytest.mark.slow
def test_an_elastic_restart_of_a_finished_run_keeps_its_summary(tmp_path, monkeypatch):
    settings = dict(steps=4, eval_every=2, batch_size=8, quiet=True)
    for every in (2, 0):  # with checkpoints, and without (the restart would start over)
        run_dir = tmp_path / f"run{every}"
        run_training(TrainConfig(sim=2, run_dir=str(run_dir), checkpoint_every=every,
                                 **settings))
        _as_real_run(run_dir)
        before = (run_dir / "metrics.jsonl").read_text()
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
        config = TrainConfig(sim=0, run_dir=str(run_dir), checkpoint_every=every, **settings)
        result = run_training(config)  # returns before any rendezvous
        assert result["already_complete"] and result["step"] == 4
        assert result["eval_accuracy"] == json.loads(before.splitlines()[-1])["eval_accuracy"]
        assert (run_dir / "metrics.jsonl").read_text() == before
        # another run's records in the run_dir: the restart starts over, as before
        assert finished_run(config.replace(lr=0.1)) is None
        monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
        assert finished_run(config) is None  # not restarted: a new run starts over


# ------------------------------------------------------- 3: a one-line error, no traceback


def test_bad_recipe_files_are_one_line_errors_naming_the_file(tmp_path, capsys):
    cases = {
        "malformed.yaml": (b"steps: [1\nlr: 0.1\n", "is not valid YAML"),
        "evil.yaml": (b'steps: !!python/object/apply:os.system ["echo hi"]\n', "is refused"),
        "binary.yaml": (b"\xff\xfe: 1\n", "is not UTF-8 text"),
        "types.yaml": (b"milestones: {a: 1}\n", "each of milestones must be an integer"),
        "model.yaml": (b"model: 3\n", "model must be a string"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        err = _error(capsys, ["train", "--sim", "2", "--steps", "2", "--config", str(path)])
        assert err.startswith("gossamer train: error: config file") and str(path) in err
        assert message in err and err.count("\n") == 1
    err = _error(capsys, ["train", "--sim", "2", "--steps", "2", "--config", str(tmp_path)])
    assert "is a directory" in err


def test_a_run_dir_that_is_a_file_is_an_error_naming_it(tmp_path, capsys):
    file = tmp_path / "afile"
    file.write_text("")
    err = _error(capsys, [*RUN, "--run-dir", str(file)])
    assert f"run_dir {str(file)!r} is a file, not a directory" in err
    err = _error(capsys, [*RUN, "--run-dir", str(file / "sub")])
    assert f"is under {str(file)!r}, which is a file" in err


def test_a_huge_topology_is_refused_at_once_naming_workers(capsys):
    import time

    started = time.perf_counter()
    err = _error(capsys, ["topology", "complete", "--workers", "100000"])
    assert time.perf_counter() - started < 1
    assert "--workers 100000" in err and "at most 1024" in err


@pytest.mark.slow
def test_a_damaged_config_yaml_on_resume_is_an_error_naming_it(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main([*RUN, "--run-dir", str(run_dir)]) == 0
    for content in (b"steps: [1\n", b"\x9f\x00\xff", b"milestones: {a: 1}\n",
                    b"algorithm: !!python/name:os.system\n"):
        (run_dir / "config.yaml").write_bytes(content)
        err = _error(capsys, [*RUN[:4], "6", *RUN[5:], "--run-dir", str(run_dir), "--resume"])
        assert "config.yaml that cannot be read" in err and str(run_dir / "config.yaml") in err


# --------------------------------------------------------- 4: messages that say what to do


def test_a_model_that_does_not_fit_the_data_set_names_model_and_dataset(tmp_path, capsys):
    err = _error(capsys, ["train", "--sim", "2", "--steps", "2", "--model", "transformer"])
    assert "--model transformer needs a token data set" in err and "--dataset text" in err
    assert "--dataset digits" in err and "indices" not in err
    text = tmp_path / "a.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    err = _error(capsys, ["train", "--sim", "2", "--steps", "2", "--dataset", "text",
                          "--data-path", str(text), "--model", "mlp", "--batch-size", "2"])
    assert "--model mlp needs features" in err and "--dataset text" in err


def test_a_text_file_that_is_not_utf8_is_an_error_naming_it(tmp_path, capsys):
    binary = tmp_path / "binary.txt"
    binary.write_bytes(bytes(range(256)) * 8)
    err = _error(capsys, ["train", "--sim", "2", "--steps", "2", "--dataset", "text",
                          "--data-path", str(binary)])
    assert f"text file {binary} is not UTF-8 text" in err and "codec" not in err
    err = _error(capsys, ["train", "--sim", "2", "--steps", "2", "--dataset", "text",
                          "--data-path", str(tmp_path)])
    assert f"text file {tmp_path} is a directory" in err


# ------------------------------------- 4 and 5: resuming without the run's recorded settings


@pytest.mark.slow
def test_resuming_without_config_yaml_is_refused_whatever_the_settings(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main([*RUN, "--run-dir", str(run_dir)]) == 0
    capsys.readouterr()
    (run_dir / "config.yaml").unlink()
    before = (run_dir / "metrics.jsonl").read_text()
    again = [*RUN[:4], "8", *RUN[5:], "--run-dir", str(run_dir), "--resume"]
    # another algorithm (its state does not fit: KeyError 'weight' before), another learning
    # rate (silently continued before), and the same settings: none can be checked
    for extra in (["--algorithm", "sgp"], ["--lr", "0.1"], []):
        err = _error(capsys, [*again, *extra])
        assert f"run_dir {str(run_dir)!r} has no config.yaml" in err
        assert "KeyError" not in err
    assert (run_dir / "metrics.jsonl").read_text() == before


@pytest.mark.slow
def test_a_finished_run_whose_last_checkpoint_is_damaged_resumes_as_before(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main([*RUN, "--run-dir", str(run_dir)]) == 0
    capsys.readouterr()
    last = run_dir / "checkpoints" / "step-00000004" / "rank-00001.pt"
    last.write_bytes(last.read_bytes()[:-10])
    assert finished_run(TrainConfig(sim=2, steps=4, run_dir=str(run_dir), resume=True)) is None
    with pytest.warns(UserWarning, match="falling back"):  # to step 2, and trains to 4 again
        assert main([*RUN, "--run-dir", str(run_dir), "--resume"]) == 0
    out, err = capsys.readouterr()
    assert "already complete" not in err and "nan" not in out
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 4


# ----------------------------------------------------------------- 5: accepted in silence


def test_a_cosine_floor_above_the_learning_rate_is_refused_naming_both(tmp_path, capsys):
    err = _error(capsys, ["train", "--sim", "2", "--steps", "2", "--schedule", "cosine",
                          "--min-lr", "5"])
    assert "min_lr=5.0 is above lr=0.05" in err and "--min-lr" in err and "--lr" in err
    recipe = tmp_path / "r.yaml"
    recipe.write_text("schedule: cosine\nlr: 0.01\nmin_lr: 0.02\n")
    err = _error(capsys, ["train", "--sim", "2", "--steps", "2", "--config", str(recipe)])
    assert "min_lr=0.02 is above lr=0.01" in err
    assert TrainConfig(schedule="cosine", lr=0.1, min_lr=0.1).min_lr == 0.1  # flat: allowed
