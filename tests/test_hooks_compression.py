"""The compression DDP comm hooks: the same parameters as gossamer's own compressed
AllReduce, checkpoints that resume exactly, on gloo (and NCCL where there are GPUs)."""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gossamer
from gossamer.algorithms import (
    DGC,
    AllReduce,
    PowerSGDAllReduce,
    QSGDAllReduce,
    TopKAllReduce,
)
from gossamer.comm import SimWorld
from gossamer.hooks import (
    DGCState,
    PowerSGDState,
    QSGDState,
    TopKState,
    compression_hook,
    dgc_hook,
)

STEPS = 6
WORLD = 2
LR, MOMENTUM, DECAY = 0.05, 0.9, 1e-3

# name: (gossamer's algorithm, the hook's state for (ddp, optimizer), optimizer momentum)
CASES = {
    "dgc": (DGC(ratio=0.02, warmup_steps=2),
            lambda ddp, opt: DGCState(ddp, ratio=0.02, warmup_steps=2, optimizer=opt)),
    "topk": (TopKAllReduce(ratio=0.05), lambda ddp, opt: TopKState(ddp, ratio=0.05)),
    "qsgd": (QSGDAllReduce(levels=7), lambda ddp, opt: QSGDState(ddp, levels=7)),
    "powersgd": (PowerSGDAllReduce(rank=2), lambda ddp, opt: PowerSGDState(ddp, rank=2)),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(),
                         nn.Linear(48, 10))


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=DECAY)


def _batches(rank: int):
    g = torch.Generator().manual_seed(500 + rank)
    return torch.randn(STEPS, 16, 32, generator=g), torch.randint(0, 10, (STEPS, 16), generator=g)


def _steps(model, optimizer, rank: int, first: int = 0, last: int = STEPS) -> None:
    xs, ys = _batches(rank)
    for step in range(first, last):
        optimizer.zero_grad()
        F.cross_entropy(model(xs[step]), ys[step]).backward()
        optimizer.step()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def gossamer_worker(comm, name: str) -> dict[str, torch.Tensor]:
    model = _model()
    optimizer = gossamer.distribute(model, _optimizer(model), CASES[name][0], comm)
    _steps(model, optimizer, comm.rank)
    return _params(model)


def ddp_worker(names: list[str]) -> dict[str, object]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gossamer.testing import destroy_process_group

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out: dict[str, object] = {}
    try:
        for name in names:
            ddp = DistributedDataParallel(_model())
            optimizer = _optimizer(ddp)
            state = CASES[name][1](ddp, optimizer)
            ddp.register_comm_hook(state, compression_hook)
            _steps(ddp, optimizer, rank)
            out[name] = {"params": _params(ddp), "step": state.step, "buckets": state.buckets,
                         "bytes": state.comm.stats.total_bytes_sent}
        out["resume"] = _resume(rank)
    finally:
        ddp = None  # DDP's reducer holds the group: freed first (see destroy_process_group)
        destroy_process_group()
    return out


def _resume(rank: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """DGC under DDP: straight through, and from a checkpoint of step 3 in fresh objects."""
    from torch.nn.parallel import DistributedDataParallel

    def build():
        ddp = DistributedDataParallel(_model())
        optimizer = _optimizer(ddp)
        state = DGCState(ddp, ratio=0.02, warmup_steps=2, optimizer=optimizer)
        ddp.register_comm_hook(state, dgc_hook)
        return ddp, optimizer, state

    ddp, optimizer, state = build()
    _steps(ddp, optimizer, rank, 0, 3)
    buffer = io.BytesIO()
    torch.save({"model": ddp.module.state_dict(), "optimizer": optimizer.state_dict(),
                "hook": state.state_dict()}, buffer)
    _steps(ddp, optimizer, rank, 3, STEPS)
    straight = _params(ddp)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    ddp, optimizer, state = build()
    ddp.module.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    state.load_state_dict(saved["hook"])
    assert state.step == 3
    _steps(ddp, optimizer, rank, 3, STEPS)
    return straight, _params(ddp)


@pytest.fixture(scope="module")
def gloo_results() -> list[dict[str, object]]:
    from gossamer.testing import spawn_gloo

    return spawn_gloo(ddp_worker, WORLD, args=(list(CASES),), timeout=240)


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("name", list(CASES))
def test_hook_matches_gossamer(gloo_results, name):
    """DDP with the hook on 2 gloo processes = gossamer's compressed AllReduce (simulator)."""
    sim = SimWorld(WORLD).run(gossamer_worker, name)
    for rank in range(WORLD):
        got = gloo_results[rank][name]
        assert got["step"] == STEPS  # once per optimizer step, not per bucket
        assert got["buckets"] >= STEPS
        for param, value in sim[rank].items():
            assert torch.allclose(got["params"][param], value, atol=1e-6), (name, param)
    # training moved the parameters, and the replicas agree
    initial = _params(_model())
    assert any(not torch.allclose(v, initial[k]) for k, v in sim[0].items())
    for param, value in gloo_results[0][name]["params"].items():
        assert torch.equal(gloo_results[1][name]["params"][param], value)


@pytest.mark.gloo
def test_hook_bytes_are_compressed(gloo_results):
    numel = sum(p.numel() for p in _model().parameters())
    dense = STEPS * 4 * numel  # a 2-rank ring all-reduce sends the gradient once per step
    sent = {name: gloo_results[0][name]["bytes"] for name in CASES}
    assert sent["topk"] < 0.2 * dense
    assert sent["qsgd"] < 0.3 * dense
    assert sent["powersgd"] < 0.3 * dense
    assert sent["dgc"] < 0.5 * dense  # its first steps are warm-up, at 25%


@pytest.mark.gloo
def test_hook_checkpoint_resumes_exactly(gloo_results):
    for rank in range(WORLD):
        straight, resumed = gloo_results[rank]["resume"]
        for param, value in straight.items():
            assert torch.equal(resumed[param], value), param


def test_state_dict_round_trip_and_checks():
    def worker(comm):
        model = _model()
        optimizer = _optimizer(model)
        state = DGCState(model, ratio=0.1, optimizer=optimizer, comm=comm)
        assert all(g["momentum"] == 0 and g["weight_decay"] == 0
                   for g in optimizer.param_groups)  # taken over
        assert state.reducer.memory.momentum == MOMENTUM
        grads = [(name, torch.randn_like(p)) for name, p in model.named_parameters()]
        state.reducer.reduce(grads, step=0)
        state.step = 1
        saved = state.state_dict()
        fresh = DGCState(_model(), ratio=0.1, momentum=MOMENTUM, comm=comm)
        fresh.load_state_dict(saved)
        velocity = saved["compression"]["memory"]["velocity"]
        assert set(velocity) == {name for name, _ in model.named_parameters()}
        for key, value in velocity.items():
            assert torch.equal(fresh.reducer.memory.velocity_of(key), value)
        return fresh.step

    assert SimWorld(1).run(worker) == [1]

    def both(comm):
        model = _model()
        DGCState(model, optimizer=_optimizer(model), momentum=0.9, comm=comm)

    with pytest.raises(Exception, match="optimizer: give either"):
        SimWorld(1).run(both)
    with pytest.raises(Exception, match="ratio must be in"):
        SimWorld(1).run(lambda comm: TopKState(_model(), ratio=0.0, comm=comm))
    with pytest.raises(Exception, match="rank must be an int >= 1"):
        SimWorld(1).run(lambda comm: PowerSGDState(_model(), rank=0, comm=comm))
    with pytest.raises(Exception, match="levels must be an int >= 1"):
        SimWorld(1).run(lambda comm: QSGDState(_model(), levels=0, comm=comm))


class _Bucket:
    """What the hook reads of a DDP ``GradBucket``: here the whole model's gradient."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.flat = torch.cat([p.grad.reshape(-1) for p in params])

    def buffer(self) -> torch.Tensor:
        return self.flat

    def gradients(self) -> list[torch.Tensor]:
        views = self.flat.split([p.numel() for p in self.params])
        return [v.view_as(p) for v, p in zip(views, self.params, strict=True)]

    def parameters(self) -> list[nn.Parameter]:
        return self.params

    def is_last(self) -> bool:
        return True


def hook_worker(comm, in_gradient: bool) -> dict[str, torch.Tensor]:
    """DGC's hook in the simulator, with a stand-in for DDP's bucket."""
    model = _model()
    optimizer = _optimizer(model)
    state = DGCState(model, ratio=0.02, warmup_steps=2, optimizer=optimizer, comm=comm,
                     weight_decay_in_gradient=in_gradient)
    xs, ys = _batches(comm.rank)
    for step in range(STEPS):
        optimizer.zero_grad()
        F.cross_entropy(model(xs[step]), ys[step]).backward()
        params = list(model.parameters())
        bucket = _Bucket(params)
        reduced = dgc_hook(state, bucket).value()
        for p, g in zip(params, reduced.split([p.numel() for p in params]), strict=True):
            p.grad.copy_(g.view_as(p))
        optimizer.step()
    return _params(model)


@pytest.mark.parametrize("in_gradient", [False, True])
def test_hook_weight_decay_matches_gossamer(in_gradient):
    """The hook applies the weight decay as gossamer's DGC does, in either place: dense after
    the exchange (the default) or in the gradient before compression."""
    def ours(comm):
        model = _model()
        algorithm = DGC(ratio=0.02, warmup_steps=2, weight_decay_in_gradient=in_gradient)
        optimizer = gossamer.distribute(model, _optimizer(model), algorithm, comm)
        _steps(model, optimizer, comm.rank)
        return _params(model)

    hooked = SimWorld(WORLD).run(hook_worker, in_gradient)
    reference = SimWorld(WORLD).run(ours)
    other = SimWorld(WORLD).run(hook_worker, not in_gradient)
    for name, value in reference[0].items():
        for rank in range(WORLD):
            assert torch.allclose(hooked[rank][name], value, atol=1e-6), name
    assert any(not torch.allclose(other[0][k], v, atol=1e-6) for k, v in reference[0].items())


def test_hook_follows_a_momentum_schedule():
    """OneCycleLR writes the momentum into the optimizer every step: the hook's DGC takes it
    over again before the step, so at density 1 without masking it is AllReduce with momentum
    SGD under the same schedule, and a checkpoint keeps the scheduled momentum."""
    def hooked(comm):
        model = _model()
        optimizer = _optimizer(model)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=LR, total_steps=STEPS)
        state = DGCState(model, ratio=1.0, momentum_masking=False, fp16_values=False,
                         optimizer=optimizer, comm=comm)
        xs, ys = _batches(comm.rank)
        for step in range(STEPS):
            optimizer.zero_grad()
            F.cross_entropy(model(xs[step]), ys[step]).backward()
            params = list(model.parameters())
            reduced = dgc_hook(state, _Bucket(params)).value()
            for p, g in zip(params, reduced.split([p.numel() for p in params]), strict=True):
                p.grad.copy_(g.view_as(p))
            optimizer.step()
            scheduler.step()
        memory = state.reducer.memory
        fresh = DGCState(_model(), ratio=1.0, optimizer=_optimizer(_model()), comm=comm)
        fresh.load_state_dict(state.state_dict())
        assert fresh.reducer.memory.momentum == memory.momentum != MOMENTUM
        return _params(model)

    def reference(comm):
        model = _model()
        optimizer = _optimizer(model)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=LR, total_steps=STEPS)
        wrapped = gossamer.distribute(model, optimizer, AllReduce(), comm)
        xs, ys = _batches(comm.rank)
        for step in range(STEPS):
            wrapped.zero_grad()
            F.cross_entropy(model(xs[step]), ys[step]).backward()
            wrapped.step()
            scheduler.step()
        return _params(model)

    got, want = SimWorld(WORLD).run(hooked), SimWorld(WORLD).run(reference)
    for name, value in want[0].items():
        for rank in range(WORLD):
            # float32: the averages of u and SGD's buffer round apart (so without a schedule)
            assert torch.allclose(got[rank][name], value, atol=1e-4), name


def test_hook_clip_norm_is_the_threshold_of_the_average():
    """Each worker clips its own gradient at clip_norm * sqrt(n), n the nodes with node_size."""
    flat = SimWorld(4).run(lambda comm: DGCState(_model(), clip_norm=1.0, comm=comm)
                           .reducer.memory.clip_norm)
    tiered = SimWorld(4).run(lambda comm: DGCState(_model(), clip_norm=1.0, node_size=2,
                                                   comm=comm).reducer.memory.clip_norm)
    assert flat == [pytest.approx(2.0)] * 4
    assert tiered == [pytest.approx(2.0 ** 0.5)] * 4


def nccl_worker() -> dict[str, torch.Tensor]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    try:
        ddp = DistributedDataParallel(_model().cuda(), device_ids=[rank])
        optimizer = _optimizer(ddp)
        state = DGCState(ddp, ratio=0.02, warmup_steps=2, optimizer=optimizer)
        ddp.register_comm_hook(state, dgc_hook)
        xs, ys = _batches(rank)
        for step in range(STEPS):
            optimizer.zero_grad()
            F.cross_entropy(ddp(xs[step].cuda()), ys[step].cuda()).backward()
            optimizer.step()
        return {k: v.cpu() for k, v in _params(ddp).items()}
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA devices: NCCL runs one rank per GPU")
def test_dgc_hook_on_nccl():
    from gossamer.testing import spawn_gloo

    nccl = spawn_gloo(nccl_worker, WORLD, timeout=240)
    sim = SimWorld(WORLD).run(gossamer_worker, "dgc")
    for param, value in sim[0].items():
        assert torch.allclose(nccl[0][param], value, atol=1e-4), param
        assert torch.equal(nccl[1][param], nccl[0][param])
