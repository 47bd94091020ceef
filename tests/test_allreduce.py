"""AllReduce-SGD: the same parameters in the simulator, on gloo, and in torch DDP."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gossamer
from gossamer.algorithms import AllReduce, available, create
from gossamer.comm import SimWorld

STEPS = 20
WORLD = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def _batches(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(STEPS, 16, 64, generator=g), torch.randint(0, 10, (STEPS, 16), generator=g)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)


def _train(model: nn.Module, optimizer, rank: int) -> torch.Tensor:
    xs, ys = _batches(rank)
    for x, y in zip(xs, ys, strict=True):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def gossamer_worker(comm) -> torch.Tensor:
    model = _model()
    # a tiny bucket size: several buckets, as a large model would have
    optimizer = gossamer.distribute(model, _optimizer(model), AllReduce(bucket_mb=0.004), comm)
    return _train(model, optimizer, comm.rank)


def gloo_gossamer_worker() -> torch.Tensor:
    from gossamer.comm import TorchCommunicator

    comm = TorchCommunicator.from_env(timeout=60)
    try:
        return gossamer_worker(comm)
    finally:
        comm.close()


def gloo_ddp_worker() -> torch.Tensor:
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    model = DistributedDataParallel(_model())
    result = _train(model, _optimizer(model), int(os.environ["RANK"]))
    dist.destroy_process_group()
    return result


@pytest.fixture(scope="module")
def sim_params() -> list[torch.Tensor]:
    return SimWorld(WORLD).run(gossamer_worker)


def test_replicas_identical_in_simulator(sim_params):
    for params in sim_params[1:]:
        assert torch.equal(params, sim_params[0])
    # and training did something
    xs, _ = _batches(0)
    assert not torch.allclose(sim_params[0], torch.cat(
        [p.detach().flatten() for p in _model().parameters()]))


def test_allreduce_equals_single_process_large_batch():
    """Averaging gradients of 4 batches equals one step on their concatenation (no momentum)."""
    def worker(comm):
        model = _model()
        opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), "allreduce",
                                  comm)
        x, y = _batches(comm.rank)
        opt.zero_grad()
        F.cross_entropy(model(x[0]), y[0]).backward()
        opt.step()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    distributed = SimWorld(WORLD).run(worker)[0]
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.cat([_batches(r)[0][0] for r in range(WORLD)])
    y = torch.cat([_batches(r)[1][0] for r in range(WORLD)])
    F.cross_entropy(model(x), y).backward()
    opt.step()
    single = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.allclose(distributed, single, atol=1e-6)


@pytest.mark.slow
@pytest.mark.gloo
def test_parity_simulator_gloo_ddp(sim_params):
    from gossamer.testing import spawn_gloo

    gloo = spawn_gloo(gloo_gossamer_worker, WORLD, timeout=180)
    ddp = spawn_gloo(gloo_ddp_worker, WORLD, timeout=180)
    for rank in range(WORLD):
        assert torch.allclose(gloo[rank], sim_params[rank], atol=1e-6)
        assert torch.allclose(ddp[rank], sim_params[rank], atol=1e-6)


def test_registry():
    assert "allreduce" in available()
    assert create("allreduce", {"bucket_mb": "10"}) == AllReduce(bucket_mb=10.0)
    with pytest.raises(ValueError, match="known algorithms: .*allreduce"):
        create("no-such-method")
    with pytest.raises(ValueError, match="bucket_mb"):
        create("allreduce", {"bucket_mb": "-1"})
    with pytest.raises(ValueError, match="no option 'bucket'"):
        create("allreduce", {"bucket": "1"})
    with pytest.raises(ValueError, match="bucket_mb"):
        create("allreduce", {"bucket_mb": "many"})


def test_distribute_rejects_bad_arguments():
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="model"):
        gossamer.distribute("not a model", opt, "allreduce")
    with pytest.raises(ValueError, match="optimizer"):
        gossamer.distribute(model, "sgd", "allreduce")
    with pytest.raises(ValueError, match="known algorithms"):
        gossamer.distribute(model, opt, "nope")


def test_state_dict_round_trip():
    def worker(comm):
        model = _model()
        opt = gossamer.distribute(model, _optimizer(model), "allreduce", comm)
        _train(model, opt, comm.rank)
        return opt.state_dict()

    state = SimWorld(2).run(worker)[0]
    assert state["algorithm"]["step"] == STEPS
    assert state["algorithm"]["synchronizations"] == STEPS
    def loader(comm):
        model = _model()
        opt = gossamer.distribute(model, _optimizer(model), "allreduce", comm)
        opt.load_state_dict(state)
        return opt.runtime.step, len(opt.optimizer.state)

    assert SimWorld(1).run(loader) == [(STEPS, 4)]
