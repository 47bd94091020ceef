"""`gossamer plan`: the predictions, their table and plot, the time to a target, the nodes."""

from __future__ import annotations

import json

import pytest

from gossamer.cli import main
from gossamer.comm import NetworkModel
from gossamer.plan import cycle, model_builder, parameter_count
from gossamer.plan.cli import steps_to_target


def _compare_dir(root, runs):
    for name, (spec, accuracies) in runs.items():
        run = root / name
        run.mkdir(parents=True)
        algorithm, *options = spec.split(":")
        opts = dict(o.split("=") for o in options)
        (run / "config.yaml").write_text(
            f"algorithm:\n  name: {algorithm}\n  options: {json.dumps(opts)}\n")
        (run / "metrics.jsonl").write_text("\n".join(
            json.dumps({"kind": "eval", "step": 10 * (i + 1), "eval_accuracy": a})
            for i, a in enumerate(accuracies)) + "\n")
    return root


def test_plan_writes_table_plot_and_time_to_target(tmp_path, capsys):
    cmp = _compare_dir(tmp_path / "cmp", {
        "allreduce": ("allreduce", [0.5, 0.9, 0.96]),
        "sgp": ("sgp", [0.5, 0.8, 0.9, 0.95]),
        "localsgd": ("localsgd:period=2", [0.5, 0.6]),
    })
    out = tmp_path / "plan"
    status = main(["plan", "--workers", "4", "8", "--model", "1M", "--compute-time", "0.1",
                   "--bandwidth", "1gbit", "--latency", "0", "--compare-dir", str(cmp),
                   "--target", "0.95", "--warmup", "1", "--steps", "2", "--out", str(out)])
    assert status == 0
    result = json.loads((out / "plan.json").read_text())
    rows = {(r["method"], r["workers"]): r for r in result["rows"]}
    assert set(rows) == {(m, n) for m in ("allreduce", "sgp", "localsgd:period=2")
                         for n in (4, 8)}
    for n in (4, 8):
        allreduce, sgp = rows["allreduce", n], rows["sgp", n]
        assert allreduce["speed_up"] == 1.0
        # a ring all-reduce sends 2 (n - 1) / n of the 4 MB model (and the flags) per step
        assert allreduce["bytes_per_step"] == pytest.approx(2 * (n - 1) / n * 4e6, rel=1e-3)
        assert sgp["bytes_per_step"] == pytest.approx(4e6, rel=1e-3)  # one peer, one copy
        # latency 0: the all-reduce's transfers take 2 (n - 1) / n * 4 MB / 125 MB/s
        assert allreduce["step_time"] == pytest.approx(0.1 + 2 * (n - 1) / n * 0.032,
                                                       rel=1e-3)
        assert sgp["speed_up"] == pytest.approx(allreduce["step_time"] / sgp["step_time"])
        assert 0 < allreduce["idle_fraction"] < 1
        assert allreduce["time_to_target"] == pytest.approx(30 * allreduce["step_time"])
        assert sgp["steps_to_target"] == 40
        assert rows["localsgd:period=2", n]["time_to_target"] is None  # never reached
    assert (out / "plan.png").stat().st_size > 10_000
    text = (out / "plan.md").read_text()
    assert "| 8 | sgp |" in text and "not reached" in text
    assert "speed-up over AllReduce" in capsys.readouterr().out


def test_plan_rejects_bad_settings(tmp_path, capsys):
    assert main(["plan", "--model", "resnet51", "--out", str(tmp_path)]) == 2
    assert "model must be one of" in capsys.readouterr().err
    assert main(["plan", "--straggler", "3:4", "--out", str(tmp_path)]) == 2
    assert "--straggler expects RANK=FACTOR" in capsys.readouterr().err
    assert main(["plan", "--target", "0.9", "--out", str(tmp_path)]) == 2
    assert "go together" in capsys.readouterr().err


def test_steps_to_target_reads_a_compare_directory(tmp_path):
    cmp = _compare_dir(tmp_path, {"a": ("wagma:group_size=2", [0.2, 0.99])})
    assert steps_to_target(cmp, 0.9) == {"a": ("wagma:group_size=2", 20)}
    with pytest.raises(ValueError, match="holds no run"):
        steps_to_target(tmp_path / "a", 0.9)


def test_models_and_counts():
    assert parameter_count("25.6M") == 25_600_000
    assert parameter_count("1e9") == parameter_count("1B") == 10**9
    assert parameter_count("resnet50") is None
    import torch

    for name, count in (("resnet50", 25_557_032), ("gpt-1b", 10**9), ("3.5k", 3500)):
        build, _ = model_builder(name)
        with torch.device("meta"):
            assert sum(p.numel() for p in build().parameters()) == count


def test_measured_steps_cover_whole_cycles():
    from gossamer.algorithms import create

    assert cycle(create("allreduce")) == 1
    assert cycle(create("localsgd", {"period": "4"})) == 4
    assert cycle(create("wagma", {"allreduce_every": "10"})) == 10


def test_nodes_have_faster_links_inside():
    net = NetworkModel(latency=1e-4, bandwidth="1gbit", node_size=4, node_bandwidth="100gbit",
                       node_latency=1e-6, link_bandwidth={(0, 1): "10mbit"})
    assert net.message_time(4, 7, 10**6) == pytest.approx(1e-6 + 1e6 / 12.5e9)
    assert net.message_time(3, 4, 10**6) == pytest.approx(1e-4 + 1e6 / 125e6)
    assert net.transfer_time(0, 1, 10**6) == pytest.approx(1e6 / 1.25e6)  # an override wins
    with pytest.raises(ValueError, match="node_size"):
        NetworkModel(node_size=0)


def test_a_bandwidth_without_its_unit_is_refused(tmp_path, capsys):
    """A bare number is bytes per second: `--bandwidth 10` (meant 10gbit) predicted 1.8e7 s
    per step; below 1 Mbit/s a bare number is refused, naming the unit to write."""
    assert main(["plan", "--bandwidth", "10", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--bandwidth 10 has no unit" in err and "10gbit" in err
    assert main(["plan", "--node-size", "2", "--node-bandwidth", "900", "--out",
                 str(tmp_path)]) == 2
    assert "--node-bandwidth 900 has no unit" in capsys.readouterr().err


def test_every_method_is_checked_before_the_first_simulation(tmp_path, capsys):
    """An option that fails only when the method runs (the sparse all-reduce cannot be timed
    from sizes) stops the plan before any method is simulated on the model, said once."""
    status = main(["plan", "--workers", "4", "--model", "1M", "--algorithms",
                   "allreduce,sgp,dgc:aggregation=sparse_allreduce", "--out", str(tmp_path)])
    assert status == 2
    err = capsys.readouterr().err
    assert "--algorithms dgc:aggregation=sparse_allreduce cannot be predicted" in err
    assert "workers, allreduce" not in err  # nothing was simulated
    assert err.count("cannot be timed from sizes alone") == 1
    assert not (tmp_path / "plan.json").exists()


def test_rows_are_written_as_each_method_finishes(tmp_path, monkeypatch):
    """A plan stopped part-way keeps the rows it finished in plan.md and plan.json."""
    import sys

    predict_module = sys.modules["gossamer.plan.predict"]  # the package exports the function
    original = predict_module.predict

    def stopping(algorithm, workers, build, **kwargs):
        if kwargs.get("label") == "sgp" and workers == 8:
            raise KeyboardInterrupt
        return original(algorithm, workers, build, **kwargs)

    monkeypatch.setattr(predict_module, "predict", stopping)
    with pytest.raises(KeyboardInterrupt):
        main(["plan", "--workers", "4", "8", "--model", "1M", "--algorithms", "allreduce,sgp",
              "--warmup", "1", "--steps", "1", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "plan.json").read_text())["rows"]
    assert [(r["workers"], r["method"]) for r in rows] == [(4, "allreduce"), (4, "sgp"),
                                                          (8, "allreduce")]
    assert "| 8 | allreduce |" in (tmp_path / "plan.md").read_text()


def test_a_method_simulated_worker_by_worker_is_left_out_above_the_limit(tmp_path, capsys):
    """AD-PSGD is not symmetric: above --every-worker-up-to (deprecated, still obeyed where
    given) it is left out, said on stderr with the flag; AllReduce (one worker for all) is
    predicted at every count."""
    status = main(["plan", "--workers", "4", "8", "--model", "1M", "--algorithms",
                   "allreduce,adpsgd", "--every-worker-up-to", "4", "--warmup",
                   "1", "--steps", "1", "--out", str(tmp_path)])
    assert status == 0
    err = capsys.readouterr().err
    assert "adpsgd at 8 workers: left out (simulated worker by worker" in err
    assert "--every-worker-up-to 4" in err
    assert "--every-worker-up-to is deprecated" in err
    rows = json.loads((tmp_path / "plan.json").read_text())["rows"]
    assert sorted((r["workers"], r["method"]) for r in rows) == [
        (4, "adpsgd"), (4, "allreduce"), (8, "allreduce")]


def test_every_method_is_predicted_at_every_count_by_default(tmp_path, capsys):
    """Without --every-worker-up-to nothing is left out: WAGMA (one worker for all, its
    partners mirrored) and AD-PSGD (every worker) at 40 workers too."""
    status = main(["plan", "--workers", "4", "40", "--model", "1M", "--algorithms",
                   "allreduce,wagma:group_size=2,adpsgd", "--warmup", "1", "--steps", "1",
                   "--out", str(tmp_path)])
    assert status == 0
    assert "left out" not in capsys.readouterr().err
    rows = json.loads((tmp_path / "plan.json").read_text())["rows"]
    assert sorted((r["workers"], r["method"]) for r in rows) == [
        (n, m) for n in (4, 40) for m in ("adpsgd", "allreduce", "wagma:group_size=2")]
