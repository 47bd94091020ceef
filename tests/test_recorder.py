"""gossamer.metrics.Recorder: a user's own loop recorded as `gossamer train` records, read back
by `gossamer plot` and `gossamer bench report` with every column filled."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import yaml

import gossamer
from gossamer.cli import main
from gossamer.comm import ComputeModel, SimWorld
from gossamer.metrics import Recorder, consensus_distance
from gossamer.train.report import load_metrics, markdown_table

WORKERS = 4


def loop(comm, run_dir, algorithm, steps=20, eval_every=10, again=True):
    """A user's loop: a linear model on each worker's own data, recorded; with ``again``,
    the consensus distance measured a second time after each evaluation."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    algorithm, comm)
    g = torch.Generator().manual_seed(comm.rank)
    distances = []
    with Recorder(run_dir, optimizer, algorithm=algorithm, batch_size=16, log_every=5,
                  config={"dataset": "random", "model": "linear", "steps": steps}) as recorder:
        for step in range(1, steps + 1):
            x = torch.randn(16, 8, generator=g)
            y = (x[:, 0] > 0).long()
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            recorder.step(loss)
            if step % eval_every == 0:
                with torch.no_grad():
                    accuracy = (model(x).argmax(1) == y).float().mean().item()
                record = recorder.eval(eval_loss=loss.item(), eval_accuracy=accuracy)
                # the same figure, measured again at the same point, by the public function
                # (its traffic, not the recorder's, is then counted as the loop's)
                distances.append((record["consensus_distance"],
                                  consensus_distance(optimizer) if again else None))
    return distances, optimizer.runtime.synchronizations


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_recorded_loop_reads_back_with_workers_syncs_and_consensus(tmp_path, capsys):
    run_dir = tmp_path / "dpsgd"
    world = SimWorld(WORKERS, compute=ComputeModel(step_time=0.01))
    results = world.run(loop, run_dir, "dpsgd")
    distances, syncs = results[0]
    assert all(recorded == again > 0 for recorded, again in distances)  # replicas apart

    kinds = [r["kind"] for r in records(run_dir)]
    assert kinds == ["train", "train", "eval", "train", "train", "eval", "summary"]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["algorithm"] == {"name": "dpsgd", "options": {}}
    assert config["world_size"] == WORKERS and config["sim"] == WORKERS
    assert config["dataset"] == "random" and config["steps"] == 20

    run = load_metrics(run_dir)
    assert run.name == "dpsgd" and run.workers == WORKERS and run.mode == "simulated"
    assert run.final["synchronizations"] == syncs
    assert run.final["consensus_distance"] == distances[-1][0]
    row = markdown_table([run]).splitlines()[2]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert "-" not in cells, row  # workers, accuracy, loss, bytes, syncs, clock, consensus
    assert cells[1] == str(WORKERS) and cells[5] == str(syncs)

    out = tmp_path / "plots"
    assert main(["plot", str(run_dir), "--out", str(out)]) == 0
    assert (out / "accuracy_vs_wall_clock.png").stat().st_size > 10_000
    report_row = next(line for line in (out / "report.md").read_text().splitlines()
                      if line.startswith("| dpsgd"))
    assert "-" not in [c.strip() for c in report_row.strip("|").split("|")]

    figures = tmp_path / "figures"
    assert main(["bench", "report", "--only", "accuracy_vs_time_gossip", "--out",
                 str(figures), "--gossip-runs", str(run_dir)]) == 0
    page = (figures / "accuracy_vs_time_gossip.md").read_text()
    page_row = next(line for line in page.splitlines() if line.startswith("| dpsgd"))
    assert "-" not in [c.strip() for c in page_row.strip("|").split("|")]
    capsys.readouterr()


def test_bytes_and_time_are_the_algorithms_not_the_recorders(tmp_path):
    """AllReduce sends the same bytes and takes the same time every step: at step 20 the
    record shows twice step 10's, although the recorder's own all-reduces and barriers ran
    in between."""
    world = SimWorld(WORKERS, compute=ComputeModel(step_time=0.01))
    world.run(loop, tmp_path / "ar", gossamer.AllReduce(), again=False)
    first, second = [r for r in records(tmp_path / "ar") if r["kind"] == "eval"]
    assert first["bytes_sent"] > 0 and first["messages_sent"] > 0
    assert second["bytes_sent"] == 2 * first["bytes_sent"]
    assert second["messages_sent"] == 2 * first["messages_sent"]
    assert second["wall_clock"] == pytest.approx(2 * first["wall_clock"], rel=1e-9)
    assert first["consensus_distance"] == 0.0  # identical replicas, exactly
    assert first["synchronizations"] == 10 and second["synchronizations"] == 20
    assert first["examples_per_second"] == pytest.approx(16 * WORKERS * 10
                                                         / first["wall_clock"])
    trains = [r for r in records(tmp_path / "ar") if r["kind"] == "train"]
    assert [r["step"] for r in trains] == [5, 10, 15, 20]
    # rank 0's own (as gossamer train's), its share of the recorder's all-reduces left out
    assert trains[3]["bytes_sent"] == 2 * trains[1]["bytes_sent"] > 0
    assert all(r["lr"] == 0.1 for r in trains)
    summary = records(tmp_path / "ar")[-1]
    assert summary["algorithm"] == "allreduce" and summary["world_size"] == WORKERS


def test_the_recorder_names_a_bad_argument(tmp_path):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="optimizer must be the optimizer distribute"):
        Recorder(tmp_path, torch.optim.SGD(model.parameters(), lr=0.1))

    def worker(comm):
        optimizer = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                        "allreduce", comm)
        for bad in ({"log_every": 0}, {"batch_size": 0}, {"algorithm": 3}):
            with pytest.raises(ValueError, match=next(iter(bad))):
                Recorder(tmp_path / "bad", optimizer, **bad)
        recorder = Recorder(tmp_path / "ok", optimizer)
        recorder.close()
        with pytest.raises(ValueError, match="closed"):
            recorder.step(1.0)

    SimWorld(1).run(worker)
