"""The benchmark harness behind ``gossamer bench``: finding and listing the benchmarks, an
unknown name, one tiny benchmark end to end, and the timed-step loop."""

from __future__ import annotations

import json

import pytest
import torch

from gossamer.bench import cli as bench_cli
from gossamer.bench import markdown_table, mlp, sgd_step, timed_steps
from gossamer.bench.harness import available, find_root
from gossamer.cli import build_parser, main

EXPECTED = {"accuracy", "allreduce_vs_ddp", "compress", "decision", "gossip", "gossipgrad",
            "local_sgd", "network", "outer", "plan", "sim_overhead", "wagma"}


def _bench(argv: list[str]) -> int:
    """``gossamer bench ARGV``, through the ``gossamer`` command's own parser."""
    return bench_cli.run(build_parser().parse_args(["bench", *argv]))


def test_every_benchmark_is_found_and_the_helpers_are_not():
    found = available(find_root())
    assert set(found) == EXPECTED  # emulation, netbench_tasks, network_report, common: helpers
    assert all(summary and "\n" not in summary for summary in found.values())


@pytest.mark.parametrize("argv", [[], ["--list"]])
def test_listing_prints_one_line_per_benchmark(argv, capsys):
    assert _bench(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sorted(line.split()[0] for line in lines) == sorted(EXPECTED)
    wagma = next(line for line in lines if line.startswith("wagma "))
    assert "straggler" in wagma  # the module docstring's first line


def test_an_unknown_name_lists_the_known_ones(capsys):
    assert main(["bench", "nope"]) == 2
    assert "gossamer bench: error: no benchmark named 'nope'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no benchmark named 'nope'") as error:
        _bench(["nope"])
    for name in EXPECTED:
        assert name in str(error.value)


def test_a_tiny_benchmark_runs_end_to_end_and_writes_its_results(tmp_path, capsys):
    threads = torch.get_num_threads()  # the benchmark runs with one torch thread
    try:
        code = _bench(["--results", str(tmp_path / "results"), "--figures", str(tmp_path),
                       "sim_overhead", "--workers", "2", "--steps", "2", "--repeats", "1",
                       "--batch", "4"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    path = tmp_path / "results" / "sim_overhead.json"
    data = json.loads(path.read_text())
    assert data["command"] == ("gossamer bench sim_overhead --workers 2 --steps 2 --repeats 1 "
                               "--batch 4")
    assert "cores" in data["machine"]
    [row] = data["rows"]
    assert row["workers"] == 2 and data["steps"] == 2 and data["batch"] == 4
    assert row["bare_step_ms"] > 0 and row["simulated_step_ms"] > 0
    assert row["ratio"] == pytest.approx(row["simulated_step_ms"] / (2 * row["bare_step_ms"]))
    assert row["ratio_min"] == row["ratio_max"] == pytest.approx(row["ratio"])  # one repeat
    assert f"wrote {path}" in capsys.readouterr().out


def test_the_sim_overhead_breakdown_times_separate_models_a_barrier_and_a_lean_loop(tmp_path):
    threads = torch.get_num_threads()
    try:
        code = _bench(["--results", str(tmp_path), "--figures", str(tmp_path), "sim_overhead",
                       "--workers", "3", "--steps", "2", "--repeats", "1", "--batch", "4",
                       "--breakdown", "--like-for-like"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    [row] = json.loads((tmp_path / "sim_overhead.json").read_text())["rows"]
    assert row["bare_lean_step_ms"] > 0
    assert row["ratio_like_for_like"] == pytest.approx(row["simulated_step_ms"]
                                                       / (3 * row["bare_lean_step_ms"]))
    for key in ("separate_models", "simulated_barrier"):
        assert row[f"{key}_step_ms"] > 0
        assert row[f"{key}_ratio"] == pytest.approx(row[f"{key}_step_ms"]
                                                    / (3 * row["bare_step_ms"]))
    assert row["bare_step_mean_ms"] > 0
    assert row["ratio_to_mean"] == pytest.approx(row["simulated_step_ms"]
                                                 / (3 * row["bare_step_mean_ms"]))


def test_timed_steps_runs_the_warm_up_then_times_each_step_on_the_clock():
    now = [0.0]
    events = []

    def step() -> None:
        events.append("step")
        now[0] += 2.0  # every step takes 2 "seconds" of the fake clock

    times = timed_steps(step, 3, warmup=2, clock=lambda: now[0],
                        before_timing=lambda: events.append("timing"))
    assert events == ["step", "step", "timing", "step", "step", "step"]
    assert times.seconds == [2.0, 2.0, 2.0]
    assert times.elapsed == 6.0 and times.per_step == 2.0 and times.median == 2.0
    with pytest.raises(ValueError, match="steps"):
        timed_steps(step, 0)


def test_sgd_step_trains_and_draws_a_batch_per_step_when_given_a_function():
    model = mlp(4, 8, 3)
    again = mlp(4, 8, 3)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters(),
                                                  strict=True))  # seeded: same on every worker
    g = torch.Generator().manual_seed(0)
    drawn = []

    def batch():
        drawn.append(1)
        return torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)

    fixed = batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = lambda: torch.nn.functional.cross_entropy(model(fixed[0]), fixed[1]).item()  # noqa: E731
    before = loss()
    timed_steps(sgd_step(model, opt, fixed), 5)
    assert loss() < before
    timed_steps(sgd_step(model, opt, batch), 3)
    assert len(drawn) == 1 + 3


def test_markdown_table_checks_the_row_width():
    assert markdown_table(["a", "b"], [[1, "x"]]) == ["| a | b |", "|---|---|", "| 1 | x |"]
    with pytest.raises(ValueError, match="3 cells"):
        markdown_table(["a", "b"], [[1, 2, 3]])


def test_the_lean_optimizer_steps_as_the_plain_one():
    """The like-for-like bare loop's optimizer: gradients set to None, the same parameters
    after three steps as torch's own loop."""
    from benchmarks.sim_overhead import LeanOptimizer

    def train(lean: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        stepped = LeanOptimizer(opt) if lean else opt
        for step in range(3):
            stepped.zero_grad()
            model(torch.full((4, 3), float(step))).square().sum().backward()
            stepped.step()
        stepped.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        return [p.detach() for p in model.parameters()]

    for a, b in zip(train(True), train(False), strict=True):
        assert torch.equal(a, b)
