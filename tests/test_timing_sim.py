"""The timing-only simulator (size-only tensors) against the full one: the same virtual times,
idle times and bytes for every registered method, with and without a straggler."""

from __future__ import annotations

import pytest
import torch

from gossamer.algorithms import available, create
from gossamer.bench.models import DIGITS_MLP, mlp
from gossamer.comm import ComputeModel, NetworkModel, SimWorld
from gossamer.comm.timing import META, SizeOnlyMode
from gossamer.plan import step_worker


def _digits_mlp():
    return mlp(*DIGITS_MLP)


def _report(name: str, stragglers: dict[int, float], timing_only: bool):
    world = SimWorld(16, network=NetworkModel(latency=50e-6, bandwidth="1gbit"),
                     compute=ComputeModel(step_time=0.01, stragglers=stragglers), seed=0,
                     timing_only=timing_only)
    algorithm = create(name).resolve(16)
    rows = world.run(step_worker, algorithm, _digits_mlp, warmup=1, steps=2,
                     size_only=timing_only)
    return world.report, rows


@pytest.mark.parametrize("stragglers", [  # with a straggler: the slow tier
    pytest.param({}, id="uniform"), pytest.param({3: 4.0}, id="straggler", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", [  # the slowest to simulate (over 2 s each): the slow tier
    pytest.param(name, marks=pytest.mark.slow) if name in ("qsgd", "topk", "demo") else name
    for name in available()])
def test_timing_only_equals_full_simulator(name, stragglers):
    full, full_rows = _report(name, stragglers, timing_only=False)
    timed, timed_rows = _report(name, stragglers, timing_only=True)
    assert sum(full.bytes_sent) > 0 or name == "qsr"  # something was sent (QSR: later)
    assert timed.clocks == full.clocks
    assert timed.idle_time == full.idle_time
    assert timed.bytes_sent == full.bytes_sent
    assert timed.bytes_per_link == full.bytes_per_link
    assert timed.messages_sent == full.messages_sent
    assert timed_rows == full_rows


def test_known_values_ride_through_cat_and_arithmetic():
    with SizeOnlyMode():
        header = torch.tensor([5, 7], dtype=torch.int32, device=META)
        body = torch.empty(10, dtype=torch.uint8, device=META)
        packed = torch.cat([header.view(torch.uint8), body])
        assert packed[:8].view(torch.int32).tolist() == [5, 7]
        model = torch.empty(100, device=META)
        message = torch.cat([model, model.new_tensor([1.0])])
        total = message.clone()
        total.add_(message).div_(2)  # as the simulator's all-reduce of a mean
        assert float(total[-1]) == 1.0
        assert float(total[0]) == 0.0  # a model's values read as zeros
        assert torch.nonzero(torch.empty(6, device=META) > 0).shape == (6, 1)  # all selected


def test_timing_only_needs_no_memory_for_the_model():
    from gossamer.plan import predict, transformer

    p = predict("allreduce", 4, lambda: transformer(10**9), warmup=1, steps=1,
                network=NetworkModel(bandwidth="10gbit"), compute=ComputeModel(step_time=0.1))
    # 2 (n - 1) / n of 4 GB per worker per step, at 10 Gbit/s: 2 * 3 * 1e9 / 1.25e9 s + 0.1 s
    assert p.bytes_per_step == pytest.approx(1.5 * 4e9, rel=1e-3)
    assert p.step_time == pytest.approx(0.1 + 6 * 1e9 / 1.25e9, rel=1e-2)


def test_timing_only_refuses_measured_compute():
    with pytest.raises(ValueError, match="timing_only"):
        SimWorld(2, compute=ComputeModel(measured=True), timing_only=True)


def test_the_sparse_allreduce_is_refused_with_its_reason():
    """Its routing and the owners' choices depend on the values: sizes alone cannot time it."""
    from gossamer.algorithms import AllReduce

    algorithm = AllReduce(compression="dgc:ratio=0.01", aggregation="sparse_allreduce")
    world = SimWorld(4, timing_only=True)
    with pytest.raises(Exception, match="aggregation='sparse_allreduce' cannot be timed"):
        world.run(step_worker, algorithm.resolve(4), _digits_mlp, warmup=0, steps=1,
                  size_only=True)
