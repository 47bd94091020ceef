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

    from gossamer.testing import destroy_process_group

    dist.init_process_group("gloo")
    model = DistributedDataParallel(_model())
    result = _train(model, _optimizer(model), int(os.environ["RANK"]))
    del model  # DDP's reducer holds the group: freed first (see destroy_process_group)
    destroy_process_group()
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


def test_a_cpu_model_goes_over_gloo_and_is_refused_by_an_nccl_communicator(monkeypatch):
    from gossamer.comm import ProcessGroupBacked, TorchCommunicator

    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class NcclComm(ProcessGroupBacked):  # what distribute reads of a communicator first
        backend, rank, world_size = "nccl", 0, 2
        process_group = store = timeout = None

    with pytest.raises(ValueError, match=r"model: its tensors are on cpu.*NCCL"):
        gossamer.distribute(model, opt, "allreduce", NcclComm())
    # no communicator given: gloo for a CPU model, also where CUDA is available
    asked = {}

    def from_env(**kwargs):
        asked.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(TorchCommunicator, "from_env", staticmethod(from_env))
    with pytest.raises(RuntimeError, match="stop here"):
        gossamer.distribute(model, opt, "allreduce")
    assert asked == {"backend": "gloo"}
    meta = nn.Linear(2, 2, device="meta")
    with pytest.raises(RuntimeError, match="stop here"):
        gossamer.distribute(meta, torch.optim.SGD(meta.parameters(), lr=0.1), "allreduce")
    assert asked == {"backend": None}  # the default: NCCL where CUDA is available


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


def _deep_model() -> nn.Module:
    """Several buckets at bucket_mb=0.004 (4 KiB), and a parameter that never gets a
    gradient (``unused``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 10))
    model.unused = nn.Parameter(torch.ones(3))
    return model


def overlap_worker(overlap: bool, accumulation: str) -> dict:
    """Four steps of AllReduce on gloo; records, for the last step, the order in which the
    buckets' all-reduces started and the first layer's gradient was computed."""
    from gossamer.comm import TorchCommunicator

    comm = TorchCommunicator.from_env(timeout=60)
    try:
        model = _deep_model()
        optimizer = gossamer.distribute(model, _optimizer(model),
                                        AllReduce(bucket_mb=0.004, overlap=overlap), comm)
        events: list[str] = []
        start = comm.all_reduce_async
        comm.all_reduce_async = lambda t, op="sum": (events.append("all_reduce"), start(t, op))[1]
        model[0].weight.register_hook(lambda g: events.append("first layer"))
        xs, ys = _batches(comm.rank)
        before = comm.stats.total_bytes_sent  # distribute()'s broadcast of the parameters
        for step in range(4):
            events.clear()
            optimizer.zero_grad()
            halves = [(xs[step][:8], ys[step][:8]), (xs[step][8:], ys[step][8:])]
            if accumulation == "none":
                halves = [(xs[step], ys[step])]
            for i, (x, y) in enumerate(halves):
                last = i == len(halves) - 1
                scope = optimizer.no_sync() if accumulation == "no_sync" and not last else None
                if scope is not None:
                    with scope:
                        (F.cross_entropy(model(x), y) / len(halves)).backward()
                else:
                    (F.cross_entropy(model(x), y) / len(halves)).backward()
            optimizer.step()
        result = {"params": torch.cat([p.detach().flatten() for p in model.parameters()]),
                  "events": list(events), "buckets": len(optimizer.runtime.gradients.members),
                  "bytes": comm.stats.total_bytes_sent - before}
        # the same model distributed again: only the new runtime's hooks start all-reduces
        again = gossamer.distribute(model, _optimizer(model), AllReduce(bucket_mb=0.004), comm)
        events.clear()
        again.zero_grad()
        F.cross_entropy(model(xs[0]), ys[0]).backward()
        again.step()
        result["again"] = events.count("all_reduce")
        return result
    finally:
        comm.close()


@pytest.mark.slow
@pytest.mark.gloo
def test_overlapped_all_reduce_starts_during_backward_and_equals_the_plain_one():
    from gossamer.testing import spawn_gloo

    plain = spawn_gloo(overlap_worker, 2, (False, "none"), timeout=180)
    overlapped = spawn_gloo(overlap_worker, 2, (True, "none"), timeout=180)
    for rank in range(2):
        mine = overlapped[rank]
        assert torch.allclose(mine["params"], plain[rank]["params"], atol=1e-6)
        assert mine["bytes"] == plain[rank]["bytes"]
        assert mine["buckets"] >= 3
        # the buckets of the last layers were on the wire before backward reached the first
        first = mine["events"].index("first layer")
        assert mine["events"][:first].count("all_reduce") >= 1, mine["events"]
        assert mine["events"].count("all_reduce") == mine["buckets"]
        assert mine["again"] == mine["buckets"]  # not twice: the first runtime's hooks left
        # after backward (the plain one): nothing started before the first layer's gradient
        assert plain[rank]["events"][0] == "first layer"
    # gradient accumulation: with no_sync one all-reduce per step, without it one per
    # micro-batch (DDP's semantics); the same parameters either way
    synced = spawn_gloo(overlap_worker, 2, (True, "no_sync"), timeout=180)
    each = spawn_gloo(overlap_worker, 2, (True, "each"), timeout=180)
    for rank in range(2):
        assert torch.allclose(synced[rank]["params"], plain[rank]["params"], atol=1e-5)
        assert torch.allclose(each[rank]["params"], plain[rank]["params"], atol=1e-5)
        assert synced[rank]["bytes"] == plain[rank]["bytes"]
        assert each[rank]["bytes"] == 2 * plain[rank]["bytes"]


@pytest.mark.parametrize("name, overlapped, plain", [
    ("allreduce", 2, 1),  # the first bucket (the last layer's, 1 MiB at most), then the rest
    # overlapped: the first bucket's P and Q of its last layer (its biases ride with P), then
    # the first layer's P and Q; plain: P of both layers with the biases, then Q of both
    ("powersgd", 4, 2),
])
def test_a_small_first_bucket_only_where_the_buckets_overlap_backward(name, overlapped, plain):
    # 784-2048-10: 6.5 MB of gradients, one 25 MiB bucket; to overlap, DDP's first bucket of
    # at most 1 MiB starts early, and costs one collective more per step. Without the
    # overlap it gains nothing: the buckets are all of bucket_mb.
    def worker(comm, overlap):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 10))
        opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  create(name, {"overlap": overlap}), comm)
        x = torch.randn(4, 784, generator=torch.Generator().manual_seed(comm.rank))
        before = comm.stats.operations["all_reduce"]
        model(x).square().mean().backward()
        opt.step()
        return comm.stats.operations["all_reduce"] - before, [p.detach().clone()
                                                              for p in model.parameters()]

    (calls, params), _ = SimWorld(2).run(worker, True)
    (calls_plain, params_plain), _ = SimWorld(2).run(worker, False)
    assert (calls, calls_plain) == (overlapped, plain)
    for a, b in zip(params, params_plain, strict=True):  # the same average either way
        torch.testing.assert_close(a, b, rtol=0, atol=0 if name == "allreduce" else 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_averaged_flags_name_every_rank_with_a_non_finite_gradient(dtype):
    """The buckets are averaged (op="mean"), the non-finite flags with them: at 47 workers
    (three flag words) every worker names exactly the ranks whose gradient was NaN, those at
    the words' edges included."""
    from gossamer.patterns.nonfinite import NonFiniteError

    bad = [0, 21, 22, 43, 44, 46]

    def run(comm):
        torch.manual_seed(0)
        model = nn.Linear(3, 2).to(dtype)
        optimizer = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                        AllReduce(), comm)
        model(torch.ones(1, 3, dtype=dtype)).sum().backward()
        if comm.rank in bad:
            model.weight.grad[0, 0] = float("nan")
        try:
            optimizer.step()
        except NonFiniteError as exc:
            return list(exc.ranks)
        return None

    assert SimWorld(47).run(run) == [bad] * 47
