"""The network benchmarks' library pieces: fitting the alpha-beta model to measured
all-reduce times, and the emulated-network runner of ``benchmarks/`` (skipped unless this
machine can emulate: root, ip, tc with tbf)."""

from __future__ import annotations

import math
import os
import shutil
import sys
from pathlib import Path

import pytest

from gossamer.comm.cost import fit_ring_all_reduce, ring_all_reduce_time
from gossamer.comm.network import NetworkModel


def _times(net: NetworkModel, sizes, workers=(2, 4)):
    return [(n, s, ring_all_reduce_time(n, s // 4, 4, net, list(range(n))))
            for n in workers for s in sizes]


def test_fit_recovers_the_model_that_made_the_times():
    truth = NetworkModel(latency=120e-6, bandwidth=118e6)
    fitted = fit_ring_all_reduce(_times(truth, [4096, 65536, 10**6, 10**7, 10**8]))
    assert math.isclose(fitted.latency, truth.latency, rel_tol=1e-6)
    assert math.isclose(fitted.bandwidth, truth.bandwidth, rel_tol=1e-6)


def test_fit_weighs_relative_errors_so_small_messages_set_the_latency():
    truth = NetworkModel(latency=1e-3, bandwidth=125e6)
    samples = _times(truth, [4096, 10**8])
    # 10% noise on the large message's time moves the bandwidth, not the latency, much
    noisy = [(n, s, t * (1.1 if s == 10**8 else 1.0)) for n, s, t in samples]
    fitted = fit_ring_all_reduce(noisy)
    assert abs(fitted.latency - 1e-3) / 1e-3 < 0.05
    assert 0.88 < fitted.bandwidth / 125e6 < 0.94


def test_fit_clamps_a_negative_latency_to_zero():
    # times that shrink less than proportionally at small sizes would need alpha < 0
    samples = [(2, 10**6, 0.004), (2, 10**8, 0.8)]
    fitted = fit_ring_all_reduce(samples)
    assert fitted.latency == 0.0
    assert 125e6 < fitted.bandwidth < 250e6


def test_fit_bounded_by_the_link_rate_refits_the_latency_alone():
    truth = NetworkModel(latency=500e-6, bandwidth=125e6)
    # times that look faster than a 125 MB/s link (a token bucket's burst, say)
    seen = NetworkModel(latency=500e-6, bandwidth=140e6)
    samples = _times(seen, [4096, 65536, 10**6, 10**7, 10**8])
    free = fit_ring_all_reduce(samples)
    assert free.bandwidth == pytest.approx(140e6)  # faster than the link: not physical
    bounded = fit_ring_all_reduce(samples, max_bandwidth=125e6)
    assert bounded.bandwidth == 125e6
    assert 0 <= bounded.latency < seen.latency  # the latency absorbs what the rate cannot
    # a fit already below the bound is left as it is
    assert fit_ring_all_reduce(_times(truth, [4096, 10**8]), max_bandwidth=250e6).bandwidth \
        == pytest.approx(125e6)
    with pytest.raises(ValueError, match="max_bandwidth"):
        fit_ring_all_reduce(samples, max_bandwidth=0)


@pytest.mark.parametrize("samples, match", [
    ([(1, 10**6, 0.1), (2, 10**7, 1.0)], "1 worker"),
    ([(2, 10**6, 0.0), (2, 10**7, 1.0)], "> 0 seconds"),
    ([(2, 10**6, 0.1), (2, 10**6, 0.2)], "two different message sizes"),
    ([(2, 10**6, 0.2), (2, 10**8, 0.1)], "do not grow"),
])
def test_fit_rejects_samples_that_cannot_determine_the_model(samples, match):
    with pytest.raises(ValueError, match=match):
        fit_ring_all_reduce(samples)


def _benchmarks_importable() -> None:
    root = str(Path(__file__).resolve().parents[1])  # benchmarks/ is not installed
    if root not in sys.path:
        sys.path.insert(0, root)


def _can_emulate() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network emulation needs root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "network emulation needs iproute2 (ip, tc)"
    _benchmarks_importable()
    from benchmarks.emulation import EmulationUnavailable, require_emulation

    try:
        require_emulation()
    except EmulationUnavailable as exc:
        return str(exc)
    return None


@pytest.mark.slow
@pytest.mark.gloo
def test_emulated_all_reduce_of_two_workers_reports_each_rank_and_the_link_traffic():
    reason = _can_emulate()
    if reason:
        pytest.skip(reason)
    from benchmarks.emulation import run_task
    from gossamer.launch import LinkSpec
    from gossamer.launch.netem import leftovers

    size = 10**6
    results, traffic = run_task(
        [LinkSpec(bandwidth="1gbit", mtu=9000)] * 2,
        {"kind": "collectives", "args": {"sizes": [size], "reps": {str(size): 2}}},
        timeout=60, echo=False)
    assert [r["rank"] for r in results] == [0, 1]
    times = results[0]["rows"][0]["times"]
    assert len(times) == 2
    # 1 MB over 1 Gbit/s is 8 ms of wire time per direction, less what the token bucket's
    # burst (1 ms of the rate, 125 kB) lets through at once: 7 ms at least
    assert all(t >= 0.007 for t in times)
    # 1 untimed + 2 timed all-reduces, each sending the whole megabyte at 2 workers
    assert traffic[0]["tx_bytes"] >= 3 * size
    assert traffic[0]["tcp_retransmitted"] >= 0  # the namespace's TCP counter, read
    assert not [n for n in leftovers(include_live=True) if n.startswith(f"gsm-{os.getpid()}-")]


def test_an_emulated_worker_uses_gloo_also_where_cuda_would_make_nccl_the_default(
        tmp_path, monkeypatch):
    # the tasks' tensors are on the CPU: NCCL, the default where CUDA is available, fails
    # every collective on them ("No backend type associated with device type cpu")
    import json

    import torch

    import benchmarks.emulation as emulation
    from benchmarks.netbench_tasks import TASKS
    from gossamer.comm import TorchCommunicator

    asked = {}

    class Fake:
        def close(self):
            asked["closed"] = True

    def from_env(**kwargs):
        asked.update(kwargs)
        return Fake()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(TorchCommunicator, "from_env", staticmethod(from_env))
    monkeypatch.setitem(TASKS, "probe", lambda comm: {"ran": True})
    task, out = tmp_path / "task.json", tmp_path / "out.json"
    task.write_text(json.dumps({"kind": "probe", "args": {}}))
    emulation._worker(str(task), str(out))
    assert asked["backend"] == "gloo" and asked["closed"]
    assert json.loads(out.read_text()) == {"ran": True}


def test_the_suite_takes_a_frame_size_and_reuses_only_results_of_the_same_one(tmp_path):
    import json

    from benchmarks.network import QUICK, load_part, with_mtu

    assert with_mtu(QUICK, 65535).mtu == 65535 and QUICK.mtu == 9000
    for bad in (1279, 65536, 9000.0, True):
        with pytest.raises(ValueError, match="--mtu"):
            with_mtu(QUICK, bad)
    (tmp_path / "network_a.json").write_text(json.dumps(
        {"mode": "quick", "settings": {"mtu": 9000}, "result": {"rows": [1]}}))
    assert load_part(tmp_path, "a", "quick", mtu=9000) == {"rows": [1]}
    assert load_part(tmp_path, "a", "quick") == {"rows": [1]}  # any frames
    assert load_part(tmp_path, "a", "quick", False, mtu=65535) is None
    with pytest.raises(ValueError, match="65535-byte frames"):
        load_part(tmp_path, "a", "quick", mtu=65535)
    with pytest.raises(ValueError, match="full mode"):
        load_part(tmp_path, "a", "full", mtu=9000)


def _sleeping_steps(sleep: float) -> dict:
    from benchmarks.netbench_tasks import training_steps
    from gossamer.comm import TorchCommunicator

    comm = TorchCommunicator.from_env(timeout=60)
    try:
        return training_steps(comm, "allreduce", warmup=1, steps=2, batch=4,
                              compute_sleep=sleep)
    finally:
        comm.close()


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.timing  # its sleeps are measured against the wall clock within 2 ms
def test_the_steps_can_sleep_in_place_of_the_forward_and_backward():
    _benchmarks_importable()
    from benchmarks.netbench_tasks import training_steps
    from gossamer.testing import spawn_gloo

    for bad in (-0.1, float("nan"), "0.1", True):
        with pytest.raises(ValueError, match="compute_sleep"):
            training_steps(None, "allreduce", warmup=0, steps=1, batch=1, compute_sleep=bad)
    # a sleep far longer than the MLP's forward and backward at a batch of 4
    results = spawn_gloo(_sleeping_steps, 2, args=(0.4,), timeout=120)
    for r in results:
        assert 0.4 <= r["compute_per_step"] < 0.6
        assert r["seconds_per_step"] >= 0.4
        assert r["bytes_per_step"] > 0  # the all-reduce still runs
        # each timed step's local work in two parts: before and after the all-reduce of its
        # one bucket (not overlapped: no small first bucket)
        assert len(r["local_parts"]) == 2
        for parts, local in zip(r["local_parts"], r["local_steps"], strict=True):
            assert len(parts) == 2 and parts[0] >= 0.4 and min(parts) >= 0
            assert sum(parts) == pytest.approx(local, abs=2e-3)


def test_the_prediction_replays_each_ranks_measured_steps_from_the_first_timed_one():
    _benchmarks_importable()
    from benchmarks.network import traced_compute
    from gossamer.comm import ComputeModel

    ranks = [{"local_steps": [1.0, 2.0, 3.0, 4.0], "local_per_step": 2.5},
             {"local_steps": [5.0, 6.0, 7.0, 8.0], "local_per_step": 6.5}]
    model = ComputeModel(**traced_compute(ranks, warmup=3))
    # the simulation's steps 3 to 6 are the timed ones: the measured steps in their order
    assert [model.step_duration(0, None, k) for k in range(3, 7)] == [1.0, 2.0, 3.0, 4.0]
    assert [model.step_duration(1, None, k) for k in range(3, 7)] == [5.0, 6.0, 7.0, 8.0]
    assert model.step_time == 4.5
    # measured in parts between the communicator's calls: the parts are replayed
    ranks[0]["local_parts"] = [[0.5, 0.5], [1.0, 1.0], [1.0, 2.0], [3.0, 1.0]]
    model = ComputeModel(**traced_compute(ranks, warmup=1))
    assert [model.step_parts(0, k) for k in (1, 2)] == [(0.5, 0.5), (1.0, 1.0)]
    assert model.step_parts(1, 1) is None  # rank 1: whole steps


def test_plan_reuse_needs_a_saved_measurement_of_the_same_frames(tmp_path):
    import json

    from gossamer.bench import cli as bench_cli
    from gossamer.cli import build_parser

    results = tmp_path / "results"
    results.mkdir()
    (results / "network_a.json").write_text(json.dumps(
        {"mode": "quick", "settings": {"mtu": 9000}, "result": {"rows": []}}))
    argv = ["bench", "--results", str(results), "--figures", str(tmp_path), "plan",
            "--parts", "emulated8", "--reuse"]
    with pytest.raises(SystemExit, match="--reuse: .*plan_emulated8.json holds no measurement "
                                         "of 8 workers with 9000-byte frames"):
        bench_cli.run(build_parser().parse_args(argv))
    (results / "plan_emulated8.json").write_text(json.dumps(
        {"part": "emulated8", "result": {"mtu": 65535, "measured": {}}}))
    with pytest.raises(SystemExit, match="9000-byte frames"):  # saved with other frames
        bench_cli.run(build_parser().parse_args(argv))


@pytest.mark.slow
def test_a_variant_is_measured_by_its_label_with_each_steps_time_and_the_runtimes_counts():
    _benchmarks_importable()
    from benchmarks.netbench_tasks import method_spec, training_steps
    from gossamer.comm import SimWorld

    assert method_spec("wagma tau=0") == ("wagma", {"group_size": 2, "tau": 0})
    with pytest.raises(ValueError, match="'wagma tau=9' is not one of the network suite's: "
                                         "'allreduce', .*'wagma tau=0'"):
        method_spec("wagma tau=9")
    rows = SimWorld(4).run(training_steps, "wagma tau=0", warmup=1, steps=3, batch=2,
                           simulated=True)
    for r in rows:
        assert len(r["step_seconds"]) == 3
        assert sum(r["step_seconds"]) == pytest.approx(3 * r["seconds_per_step"])
        # synchronous groups of 2 (tau 0): a group average in each of the 4 steps (the
        # global average comes every 10 rounds), nobody stale
        counters = r["counters"]
        assert counters["group_averages"] == 4
        assert counters["rounds_skipped"] == 0 and set(counters["ages"]) == {"0"}


def test_plan_methods_measures_the_labels_asked_for_under_a_name_of_their_own(tmp_path):
    import json

    from benchmarks.plan import result_name
    from gossamer.bench import cli as bench_cli
    from gossamer.cli import build_parser

    assert result_name("emulated8", 0.05, ["wagma", "wagma tau=0"]) == \
        "plan_emulated8_sleep50ms_wagma_wagma-tau-0"
    assert result_name("published", 0.0, ["wagma"]) == "plan_published"
    results = tmp_path / "results"
    results.mkdir()
    (results / "network_a.json").write_text(json.dumps(
        {"mode": "quick", "settings": {"mtu": 9000}, "result": {"rows": []}}))
    argv = ["bench", "--results", str(results), "--figures", str(tmp_path), "plan",
            "--parts", "emulated8", "--methods", "wagma", "wagma tau=9"]
    with pytest.raises(SystemExit, match="--methods: method 'wagma tau=9' is not one"):
        bench_cli.run(build_parser().parse_args(argv))


def test_the_comm_timer_counts_a_subgroups_collective_as_one_call():
    # the simulator's subgroups make one call of a collective; a real run's P2PGroup carries
    # it in exchanges: timed as one call, the parts of a measured step match the simulator's
    _benchmarks_importable()
    import torch

    from benchmarks.netbench_tasks import CommTimer
    from gossamer.comm import SimWorld
    from gossamer.comm.p2p_group import P2PGroup

    def worker(comm):
        timer = CommTimer(comm)
        group = comm.group([0, 1])
        over_exchanges = P2PGroup(comm, [0, 1])  # what a TorchCommunicator's group is
        timer._install(over_exchanges)
        group.all_reduce(torch.ones(3))
        over_exchanges.all_reduce(torch.ones(3))
        handle = comm.exchange({1 - comm.rank: torch.ones(2)}, [1 - comm.rank])
        handle.wait()
        return len(timer.calls), all(end >= start for start, end in timer.calls)

    assert SimWorld(2).run(worker) == [(4, True), (4, True)]
