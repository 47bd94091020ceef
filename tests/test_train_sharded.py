"""`gossamer train --shards S`: the training loop on R replicas x S shards, and its checkpoints.

On gloo, 2 replicas x 2 shards (4 processes) train the digits MLP with DiLoCo, each replica's
model sharded with FSDP2 over its 2 ranks (tests/test_sharding.py proves that the method gives
there what the unsharded run of the union batches gives). One start of the 4 processes makes
three runs: one straight through, one stopped after its step-4 checkpoint, and that one
resumed. Checked: the loss falls; DiLoCo's promise (the replicas drift apart between outer
steps and are equal after ``finish()``); what config.yaml, the summary and each rank's DCP
checkpoint hold; and the resumed run ends bit-equal to the straight one.

The refusals are in-process and fast.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from gossamer.testing import spawn_gloo
from gossamer.train.config import TrainConfig

REPLICAS, SHARDS, STEPS = 2, 2, 8
SETTINGS = {"algorithm": "diloco", "options": {"period": 3}, "shards": SHARDS,
            "steps": STEPS, "eval_every": 4, "log_every": 1, "checkpoint_every": 4,
            "checkpoint_format": "dcp", "timeout": 60.0, "quiet": True}


class Stop(RuntimeError):
    pass


def _run(run_dir: str, stop_at: int | None = None, resume: bool = False) -> dict | None:
    """A sharded run in ``run_dir`` (one rank's summary); with ``stop_at``, stopped as that
    step begins (None returned)."""
    import gossamer.train.loop as loop
    from gossamer.train.run import run_training

    real = loop.learning_rate

    def stopping(config: TrainConfig, step: int) -> float:
        if step + 1 == stop_at:
            raise Stop(f"stopped at step {stop_at}")
        return real(config, step)

    loop.learning_rate = stopping
    try:
        return run_training(TrainConfig(run_dir=run_dir, resume=resume, **SETTINGS))
    except Stop:
        return None
    finally:
        loop.learning_rate = real


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A straight run (root/a), and one stopped at step 6 after its step-4 checkpoint and
    resumed (root/b): every rank's summaries of the straight and the resumed run (each run a
    rendezvous of its own, in the same 4 processes)."""
    root = tmp_path_factory.mktemp("sharded")
    n = REPLICAS * SHARDS
    straight = spawn_gloo(_run, n, args=(str(root / "a"),), timeout=240)
    assert spawn_gloo(_run, n, args=(str(root / "b"), 6), timeout=240) == [None] * n
    resumed = spawn_gloo(_run, n, args=(str(root / "b"), None, True), timeout=240)
    return root, list(zip(straight, resumed, strict=True))


def _records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.mark.slow
@pytest.mark.gloo
def test_sharded_diloco_trains_and_ends_with_equal_replicas(runs):
    root, results = runs
    summary = results[0][0]
    train = _records(root / "a", "train")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert sum(r["train_loss"] for r in train[-2:]) < sum(r["train_loss"] for r in train[:2])
    assert summary["eval_loss"] < train[0]["train_loss"]
    # DiLoCo: apart after an inner step (step 4, one after the outer step of step 3), equal
    # after finish()'s outer step; one figure per replica
    middle = _records(root / "a", "eval")[0]
    assert middle["step"] == 4 and middle["consensus_distance"] > 0
    assert len(set(middle["worker_eval_loss"])) == REPLICAS
    assert summary["consensus_distance"] == 0
    assert len(summary["worker_eval_loss"]) == REPLICAS
    assert len(set(summary["worker_eval_loss"])) == 1
    assert (summary["replicas"], summary["shards"], summary["world_size"]) == (
        REPLICAS, SHARDS, REPLICAS * SHARDS)
    assert summary["bytes_sent"] > 0  # the method's, over the replica dimension
    from gossamer.cli import summary_text

    text = summary_text(summary)  # what gossamer train prints
    assert re.search(r"workers +4: 2 replicas x 2 shards", text)
    assert re.search(r"bytes sent per rank between replicas \(mean\) +\d", text)
    import yaml

    config = yaml.safe_load((root / "a" / "config.yaml").read_text())
    assert (config["shards"], config["world_size"]) == (SHARDS, REPLICAS * SHARDS)


@pytest.mark.slow
@pytest.mark.gloo
def test_sharded_checkpoint_holds_each_ranks_shard_and_resumes_bit_equal(runs):
    from torch.distributed.checkpoint import FileSystemReader

    from gossamer.train.dcp import load_averaged_model
    from gossamer.train.models import MLP

    root, results = runs
    straight, resumed = results[0]  # rank 0's summaries: the run's figures
    for key in ("eval_loss", "eval_accuracy", "worker_eval_loss", "bytes_sent",
                "consensus_distance", "train_loss"):
        assert resumed[key] == straight[key], key
    timed = ("wall_clock", "examples_per_second")
    evals = [[{k: v for k, v in r.items() if k not in timed} for r in _records(root / run, "eval")]
             for run in ("a", "b")]
    assert evals[0] == evals[1]
    # every rank saved its own shard: half the rows of each weight, under its rank
    last = f"step-{STEPS:08d}"
    meta = FileSystemReader(root / "a" / "checkpoints" / last / "dcp").read_metadata()
    entries = meta.state_dict_metadata
    for rank in range(REPLICAS * SHARDS):
        assert tuple(entries[f"workers.{rank}.model.net.1.weight"].size) == (64, 64)
    assert tuple(entries["model.net.1.weight"].size) == (128, 64)  # the averaged, whole
    models = []
    for run in ("a", "b"):
        model = MLP(64, 10)
        assert load_averaged_model(root / run / "checkpoints" / last / "dcp", model) == STEPS
        models.append(model.state_dict())
    for name, tensor in models[0].items():
        assert torch.equal(tensor, models[1][name]), name


def _accumulated(run_dir: str, accumulation: int) -> dict:
    from gossamer.train.run import run_training

    return run_training(TrainConfig(
        algorithm="diloco", options={"period": 3}, shards=SHARDS, steps=4, eval_every=0,
        accumulation=accumulation, batch_size=32 // accumulation, run_dir=run_dir,
        timeout=60.0, quiet=True))


@pytest.mark.slow
@pytest.mark.gloo
def test_sharded_accumulation_is_the_whole_batch(tmp_path):
    """Two micro-batches of 16 (FSDP2 reduce-scatters their sum once) train as one batch of
    the same 32 examples, within float32 reduction order."""
    n = REPLICAS * SHARDS
    two = spawn_gloo(_accumulated, n, args=(str(tmp_path / "two"), 2), timeout=240)[0]
    one = spawn_gloo(_accumulated, n, args=(str(tmp_path / "one"), 1), timeout=240)[0]
    for key in ("eval_loss", "train_loss"):
        assert two[key] == pytest.approx(one[key], rel=1e-5), key


def test_shards_refusals_name_the_option():
    with pytest.raises(ValueError, match="shards must be"):
        TrainConfig(shards=0)
    with pytest.raises(ValueError, match=r"--shards\) needs real processes: the simulator "
                                         "has no FSDP"):
        TrainConfig(sim=4, shards=2)
    with pytest.raises(ValueError, match=r"--shards\): wagma.* does not run on a model "
                                         "sharded with FSDP2: it is asynchronous"):
        TrainConfig(algorithm="wagma", shards=2)
    refused = {"on_failure": {"on_failure": "continue", "algorithm": "localsgd"},
               "nonfinite": {"nonfinite": "skip"},
               "optimizer": {"optimizer": "muon"},
               "checkpoint_format": {"run_dir": "d", "checkpoint_every": 5}}
    for name, settings in refused.items():
        with pytest.raises(ValueError, match=rf"--shards\): {name}=.* is refused on shards"):
            TrainConfig(shards=2, **settings)
    TrainConfig(shards=2, run_dir="d", checkpoint_every=5, checkpoint_format="dcp")


def test_resume_on_another_number_of_shards_is_refused(tmp_path):
    from gossamer.train.run import _check_same_settings, _write_config

    settings = {"run_dir": str(tmp_path), "checkpoint_every": 4, "checkpoint_format": "dcp"}
    _write_config(TrainConfig(shards=2, **settings), 4)
    with pytest.raises(ValueError, match=r"shards=2 \(now 1\)"):
        _check_same_settings(TrainConfig(resume=True, **settings))


def test_shards_must_divide_the_world_size(monkeypatch):
    from gossamer.train.run import _shard_layout

    for name, value in {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"shards=2 \(--shards\) must divide the world size, "
                                         "3 processes"):
        _shard_layout(TrainConfig(shards=2))


def test_gossamer_train_takes_shards_on_the_command_line(capsys):
    from gossamer.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--shards" in capsys.readouterr().out
    assert main(["train", "--sim", "4", "--shards", "2"]) != 0
    assert "the simulator has no FSDP" in capsys.readouterr().err
