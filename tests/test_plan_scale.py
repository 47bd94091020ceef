"""The planner at scale: the shortcuts that let it predict 10,000 workers of WAGMA and AD-PSGD
(one WAGMA worker for all, its partners mirrored; AD-PSGD worker by worker on a stand-in of the
model; the end of training left out where nobody waits for it) give the figures of the full
timing-only simulation of every worker on the model itself, exactly."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from gossamer.algorithms import ADPSGD, WAGMA
from gossamer.comm import ComputeModel, NetworkModel, SimWorld
from gossamer.plan import predict, transformer
from gossamer.plan.predict import Prediction, cycle, flat_model, step_worker

NETWORK = NetworkModel(latency=50e-6, bandwidth="1gbit")
COMPUTE = ComputeModel(step_time=0.01)
FIELDS = ("step_time", "mean_step_time", "bytes_per_step", "idle_fraction")


def _model() -> nn.Module:
    """A 50k-parameter transformer stand-in: 25 tensors, 200 KB (1.6 ms a message at
    1 Gbit/s)."""
    return transformer(50_000)


def _every_worker(algorithm, workers, *, network=NETWORK, compute=COMPUTE) -> Prediction:
    """The planner's figures as they were: every worker simulated on the model itself, each
    finishing training after its measured steps."""
    algorithm = algorithm.resolve(workers)
    steps = cycle(algorithm)
    world = SimWorld(workers, network=network, compute=compute, timing_only=True)
    rows = world.run(step_worker, algorithm, _model, warmup=1, steps=steps, size_only=True)
    return Prediction.of_rows(algorithm.label, rows, steps, 0.0)


def _same(found: Prediction, expected: Prediction) -> None:
    assert found.steps == expected.steps
    for field in FIELDS:
        assert getattr(found, field) == pytest.approx(getattr(expected, field), rel=1e-12,
                                                      abs=1e-15), field


@pytest.mark.parametrize("workers,algorithm,network,compute", [
    (16, WAGMA(), NETWORK, COMPUTE),
    pytest.param(64, WAGMA(allreduce_every=2), NETWORK, COMPUTE, id="64",
                 marks=pytest.mark.slow),  # 6 s
    (16, WAGMA(group_size=2, tau=2, allreduce_every=4), NetworkModel(bandwidth="10gbit"),
     ComputeModel(step_time=0.25)),
    (16, WAGMA(group_size=8, allreduce_every=0), NetworkModel(latency=1e-3, bandwidth="10gbit"),
     COMPUTE),
], ids=["16", "64", "16-g2-tau2", "16-g8-latency"])
def test_one_wagma_worker_stands_for_all(workers, algorithm, network, compute):
    """WAGMA's members send their models to each other and find the others' there when they
    average: one worker, its partners mirrored, predicts what every worker does."""
    one = predict(algorithm, workers, _model, network=network, compute=compute, warmup=1,
                  steps=1, simulate="one")
    _same(one, _every_worker(algorithm, workers, network=network, compute=compute))


def test_wagma_out_of_step_is_simulated_worker_by_worker():
    """Where a partner's model has arrived on some workers and not on others when they look
    (a step far shorter than the latency), one worker cannot stand for all: it says so, and
    the prediction simulates every worker."""
    network, compute = NetworkModel(latency=1e-3, bandwidth="1gbit"), ComputeModel(step_time=1e-4)
    algorithm = WAGMA(tau=2, allreduce_every=4)
    with pytest.raises(ValueError, match="arrived on some workers and not on others"):
        predict(algorithm, 16, _model, network=network, compute=compute, warmup=1, steps=1,
                simulate="one")
    found = predict(algorithm, 16, _model, network=network, compute=compute, warmup=1, steps=1)
    _same(found, _every_worker(algorithm, 16, network=network, compute=compute))


@pytest.mark.parametrize("workers,algorithm,compute", [
    (16, ADPSGD(), COMPUTE),
    (64, ADPSGD(), COMPUTE),
    (16, ADPSGD(), ComputeModel(step_time=0.01, stragglers={3: 3.0}, jitter=0.2)),
    (16, WAGMA(allreduce_every=4), ComputeModel(step_time=0.01, stragglers={3: 3.0},
                                                jitter=0.2)),
], ids=["adpsgd-16", "adpsgd-64", "adpsgd-straggler-jitter", "wagma-straggler-jitter"])
def test_every_worker_on_the_stand_in(workers, algorithm, compute):
    """Simulated worker by worker (AD-PSGD, and WAGMA on unlike workers), on the stand-in of
    the model (one flat tensor) and, for AD-PSGD, without the end of training: the figures of
    every worker on the model itself."""
    found = predict(algorithm, workers, _model, network=NETWORK, compute=compute, warmup=1,
                    steps=1)
    _same(found, _every_worker(algorithm, workers, compute=compute))


def test_the_stand_in_holds_the_model_by_dtype():
    """One parameter per dtype and requires_grad, one buffer per dtype, each as large as the
    model's of its kind, in the order they first appear."""
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.empty(3, 4))
            self.frozen = nn.Parameter(torch.empty(5), requires_grad=False)
            self.b = nn.Parameter(torch.empty(7))
            self.register_buffer("mean", torch.empty(2, dtype=torch.float64))
            self.register_buffer("count", torch.empty((), dtype=torch.int64))

    with torch.device("meta"):
        flat = flat_model(Mixed)()
    assert [(p.dtype, p.requires_grad, p.shape) for p in flat.parameters()] == [
        (torch.float32, True, (19,)), (torch.float32, False, (5,))]
    assert [(b.dtype, b.shape) for b in flat.buffers()] == [
        (torch.float64, (2,)), (torch.int64, (1,))]


def test_ten_thousand_wagma_workers_cost_one():
    """WAGMA at 10,000 workers of ResNet-50 is simulated as one worker: seconds, not hours."""
    from gossamer.plan import resnet50

    started = time.process_time()
    found = predict("wagma", 10_000, resnet50, network=NetworkModel(bandwidth="10gbit"),
                    compute=ComputeModel(step_time=0.25))
    assert time.process_time() - started < 30
    # each worker sends its model (102 MB) to the 3 others of its group every round but the
    # global one, and 2 (n - 1) / n of it in that round's all-reduce
    assert found.bytes_per_step == pytest.approx((9 * 3 + 2) * 102.2e6 / 10, rel=1e-2)
