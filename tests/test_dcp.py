"""Checkpoints through torch.distributed.checkpoint: every worker's own state round-trips on 4
gloo workers whose replicas differ (SGP), and the averaged model loads into a plain module."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from gossamer import distribute
from gossamer.algorithms.sgp import SGP
from gossamer.comm.sim import SimWorld
from gossamer.train import checkpoint as ckpt
from gossamer.train import dcp as gdcp

WORKERS, STEPS, SAVE_AT = 4, 8, 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each worker's own data at each step: the replicas drift apart between gossip rounds."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


def _setup(comm):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, distribute(model, optimizer, SGP(), comm)


def _train(model, optimizer, comm, start: int, stop: int) -> None:
    for step in range(start, stop):
        x, y = _batch(comm.rank, step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _straight(comm, path: str, run_dir: str):
    """The uninterrupted run; saves both ways at SAVE_AT (and to the run directory at the end)."""
    model, optimizer = _setup(comm)
    _train(model, optimizer, comm, 0, SAVE_AT)
    at_save = _params(model)
    extra = {"sampler": {"position": torch.tensor([SAVE_AT, comm.rank])}, "offsets": [1.5, 2]}
    gdcp.save_dcp(path, model, optimizer, comm, SAVE_AT, extra=extra)
    gdcp.save_dcp_checkpoint(comm, run_dir, SAVE_AT, model, optimizer, extra=extra, keep=2)
    _train(model, optimizer, comm, SAVE_AT, STEPS)
    gdcp.save_dcp_checkpoint(comm, run_dir, STEPS, model, optimizer, keep=2)
    return at_save, _params(model)


def _resumed(comm, path: str, run_dir: str | None):
    """Fresh workers: load the DCP checkpoint (or resume the run directory's) and go on."""
    model, optimizer = _setup(comm)
    if run_dir is None:
        step, extra = gdcp.load_dcp(path, model, optimizer, comm)
    else:
        if comm.rank == 0:  # back to SAVE_AT's: as a run that stopped after it
            ckpt.atomic_write_bytes(Path(run_dir) / "checkpoints" / "latest",
                                    f"step-{SAVE_AT:08d}".encode())
        comm.barrier()
        step, extra = gdcp.resume_dcp_checkpoint(comm, run_dir, model, optimizer)
    _train(model, optimizer, comm, step, STEPS)
    return step, extra, _params(model)


@pytest.mark.slow
@pytest.mark.gloo
def test_dcp_save_at_4_load_at_4_ends_equal_and_averaged_model_loads_plainly(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from gossamer.testing import collect, run_in_turn, spawn_gloo

    path, run_dir = str(tmp_path / "ckpt"), str(tmp_path / "run")
    straight = collect(spawn_gloo(run_in_turn, WORKERS, args=(_straight, [(0, (path, run_dir))]),
                                  timeout=180), 0)
    at_save = [s[0] for s in straight]
    final = [s[1] for s in straight]
    # the test means something only if the replicas differ
    assert not torch.equal(at_save[0]["0.weight"], at_save[1]["0.weight"])

    runs = [("direct", (path, None)), ("run_dir", (path, run_dir))]
    results = spawn_gloo(run_in_turn, WORKERS, args=(_resumed, runs), timeout=180)
    for key in ("direct", "run_dir"):
        for rank, (step, extra, params) in enumerate(collect(results, key)):
            assert step == SAVE_AT
            assert torch.equal(extra["sampler"]["position"], torch.tensor([SAVE_AT, rank]))
            assert extra["offsets"] == [1.5, 2]
            for name in params:
                assert torch.equal(params[name], final[rank][name]), (key, rank, name)

    # the averaged model: the exact mean over workers, loaded in this process (no group)
    mean = {k: torch.stack([p[k].double() for p in at_save]).mean(0).float() for k in at_save[0]}
    plain = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    assert gdcp.load_averaged_model(path, plain) == SAVE_AT
    for name, tensor in plain.state_dict().items():
        assert torch.equal(tensor, mean[name]), name
    # and through torch's own conversion to a torch.save file
    dcp_to_torch_save(path, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    other = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    other.load_state_dict(whole["model"])
    for name, tensor in other.state_dict().items():
        assert torch.equal(tensor, mean[name]), name
    assert int(whole["step"]) == SAVE_AT and set(whole["workers"]) == {"0", "1", "2", "3"}

    # the run directory: meta.json with checksums, the format named, gossamer's loader refuses
    meta = json.loads((Path(run_dir) / "checkpoints" / f"step-{STEPS:08d}" / "meta.json")
                      .read_text())
    assert meta["format"] == "dcp" and "dcp/.metadata" in meta["files"]
    with pytest.raises(ValueError, match="'dcp' format"):
        ckpt.load_checkpoint(run_dir, 0, WORKERS)


def _resume_other_size(comm, path: str):
    model, optimizer = _setup(comm)
    try:
        gdcp.load_dcp(path, model, optimizer, comm)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.slow
@pytest.mark.gloo
def test_dcp_load_by_another_number_of_workers_is_refused_naming_both(tmp_path):
    from gossamer.testing import collect, run_in_turn, spawn_gloo

    path = str(tmp_path / "ckpt")
    spawn_gloo(run_in_turn, 2, args=(_straight, [(0, (path, str(tmp_path / "run")))]),
               timeout=180)
    errors = collect(spawn_gloo(run_in_turn, 3, args=(_resume_other_size, [(0, (path,))]),
                                timeout=180), 0)
    assert all("written by 2 workers; this run has 3" in e for e in errors)


@pytest.mark.slow
def test_a_run_without_dcp_checkpoints_does_not_import_torch_distributed_checkpoint():
    # it costs every worker half a second to import: only a DCP checkpoint's save or load does
    import subprocess
    import sys

    code = ("import sys, gossamer.train.loop, gossamer.train.run, gossamer.cli; "
            "print('torch.distributed.checkpoint' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


def test_split_and_join_round_trip_nested_state():
    state = {"model": {"w": torch.ones(2)}, "optimizer": {"state": {0: {"b": torch.zeros(3)}},
                                                          "param_groups": [{"params": [0]}]},
             "algorithm": {"weight": 0.5, "in_flight": [{1: torch.arange(3)}], "t": (1, None)},
             "clash": {0: torch.ones(1), "0": torch.zeros(1)}}
    tensors, where = {}, []
    structure = gdcp._split(state, (), tensors, where)
    assert "algorithm.in_flight.0.1" in tensors and len(tensors) == 5
    back = gdcp._join(structure, (), {p: tensors[n] for p, n in where})
    assert back["algorithm"]["t"] == (1, None) and back["algorithm"]["weight"] == 0.5
    assert torch.equal(back["clash"][0], torch.ones(1))
    assert torch.equal(back["clash"]["0"], torch.zeros(1))
    assert torch.equal(back["optimizer"]["state"][0]["b"], torch.zeros(3))


def test_dcp_needs_torch_distributed_workers(tmp_path):
    def worker(comm):
        model, optimizer = _setup(comm)
        with pytest.raises(ValueError, match="SimComm|process group"):
            gdcp.save_dcp(tmp_path / "c", model, optimizer, comm, 1)

    SimWorld(2).run(worker)


def _summary(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return [r for r in records if r["kind"] == "summary"][-1]


@pytest.mark.slow
@pytest.mark.gloo
def test_gossamer_train_checkpoints_and_resumes_through_dcp(tmp_path):
    """`--checkpoint-format dcp`: a run killed after its step-5 checkpoint and resumed ends
    with the figures of the run that was never stopped."""
    import io

    from gossamer.launch.launcher import launch

    common = ["--algorithm", "sgp", "--steps", "10", "--eval-every", "0", "--quiet",
              "--checkpoint-every", "5", "--checkpoint-format", "dcp"]

    def run(*args: str) -> int:
        err = io.StringIO()
        code = launch([*common, *args], 2, stdout=io.StringIO(), stderr=err)
        return code if code == 0 or "crash" in err.getvalue() else -1

    assert run("--run-dir", str(tmp_path / "a")) == 0
    assert run("--run-dir", str(tmp_path / "b"), "--fault", "1:8:crash") != 0
    assert (tmp_path / "b" / "checkpoints" / "latest").read_text().strip()
    assert run("--run-dir", str(tmp_path / "b"), "--resume") == 0
    straight, resumed = _summary(tmp_path / "a"), _summary(tmp_path / "b")
    for key in ("eval_loss", "eval_accuracy", "bytes_sent", "consensus_distance"):
        assert resumed[key] == straight[key], key


def test_dcp_checkpoints_need_real_processes():
    from gossamer.train.config import TrainConfig

    with pytest.raises(ValueError, match="checkpoint_format 'dcp' needs real processes"):
        TrainConfig(sim=4, run_dir="d", checkpoint_every=5,
                    checkpoint_format="dcp").check_mode(simulated=True)
    with pytest.raises(ValueError, match="checkpoint_format 'zip' is unknown"):
        TrainConfig(checkpoint_format="zip")
