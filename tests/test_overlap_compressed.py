"""Averaging on a communication thread during backward: AllReduce with a compressor and
GossipGraD (exact or compressed) start each bucket's reduction as soon as its gradients are
ready, and the DDP comm hooks return their futures without waiting for the reduction; they
give what the reduction after backward (the simulator's) gives, with the same bytes."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from test_allreduce import _deep_model as _model  # several buckets, an unused parameter
from torch import nn

import gossamer
from gossamer.algorithms import DGC, GossipGraD, PowerSGDAllReduce
from gossamer.comm import SimWorld

STEPS = 4
WORLD = 2
METHODS = {"dgc": DGC(ratio=0.05, warmup_steps=2, bucket_mb=0.004),
           "powersgd": PowerSGDAllReduce(rank=2, bucket_mb=0.004),
           "gossipgrad": GossipGraD(bucket_mb=0.004, average_at_end=False),
           "gossipgrad topk": GossipGraD(compression="topk:ratio=0.1", bucket_mb=0.004,
                                         average_at_end=False)}


def _batches(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + rank)
    return torch.randn(STEPS, 16, 64, generator=g), torch.randint(0, 10, (STEPS, 16), generator=g)


def _params(model: nn.Module) -> torch.Tensor:
    module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def train(comm, name: str, accumulation: str = "none") -> dict:
    """STEPS steps of a compressed AllReduce or GossipGraD; on gloo, the order of the last
    step's events: a bucket handed to the communication thread, the first layer's gradient
    computed."""
    model = _model()
    optimizer = gossamer.distribute(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), METHODS[name], comm)
    events: list[str] = []
    runtime = optimizer.runtime
    compressed = runtime.exchange if name.startswith("gossipgrad") else runtime.compressed
    if compressed.thread is not None:
        submit = compressed.thread.submit
        compressed.thread.submit = lambda *a: (events.append("bucket"), submit(*a))[1]
    model[0].weight.register_hook(lambda g: events.append("first layer"))
    threads: set[str] = set()
    gather, exchange = comm.all_gather, comm.exchange
    comm.all_gather = lambda t: (threads.add(threading.current_thread().name), gather(t))[1]
    comm.exchange = lambda *a, **k: (threads.add(threading.current_thread().name),
                                     exchange(*a, **k))[1]
    before = comm.stats.total_bytes_sent
    xs, ys = _batches(comm.rank)
    error = None
    for step in range(STEPS):
        events.clear()
        optimizer.zero_grad()
        halves = [(xs[step], ys[step])] if accumulation == "none" else \
            [(xs[step][:8], ys[step][:8]), (xs[step][8:], ys[step][8:])]
        try:
            for i, (x, y) in enumerate(halves):
                if accumulation == "no_sync" and i < len(halves) - 1:
                    with optimizer.no_sync():
                        (F.cross_entropy(model(x), y) / len(halves)).backward()
                else:
                    (F.cross_entropy(model(x), y) / len(halves)).backward()
        except RuntimeError as exc:
            error = str(exc)
            break
        optimizer.step()
    return {"params": _params(model), "events": events, "threads": threads, "error": error,
            "bytes": comm.stats.total_bytes_sent - before,
            "buckets": len(compressed.members)}


def ddp_train(name: str) -> dict:
    """DDP with the compression hook (one bucket per layer): whether each future was still
    pending when the hook returned, and the thread that reduced."""
    from torch.nn.parallel import DistributedDataParallel

    from gossamer.hooks import CompressionState, compression_hook

    ddp = DistributedDataParallel(_model(), bucket_cap_mb_list=[1e-5] * 4,
                                  find_unused_parameters=True)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    state = CompressionState(ddp, "topk:ratio=0.05" if name == "topk" else "powersgd:rank=2")
    pending: list[bool] = []
    threads: set[str] = set()
    reduce = state.reducer.reduce
    state.reducer.reduce = lambda *a, **k: (threads.add(threading.current_thread().name),
                                            reduce(*a, **k))[1]

    def hook(state, bucket):
        future = compression_hook(state, bucket)
        pending.append(not future.done())
        return future

    ddp.register_comm_hook(state, hook)
    xs, ys = _batches(torch.distributed.get_rank())
    for step in range(STEPS):
        optimizer.zero_grad()
        F.cross_entropy(ddp(xs[step]), ys[step]).backward()
        optimizer.step()
    return {"params": _params(ddp), "pending": pending, "threads": threads,
            "step": state.step}


def gloo_worker() -> dict:
    from gossamer.comm import TorchCommunicator

    comm = TorchCommunicator.from_env(timeout=60)
    try:
        out = {name: train(comm, name) for name in METHODS}
        out["no_sync"] = train(comm, "dgc", "no_sync")
        out["each"] = train(comm, "dgc", "each")
        out["ddp topk"] = ddp_train("topk")
        return out
    finally:
        comm.close()


@pytest.fixture(scope="module")
def gloo_results() -> list[dict]:
    from gossamer.testing import spawn_gloo

    return spawn_gloo(gloo_worker, WORLD, timeout=180)


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("name", list(METHODS))
def test_buckets_start_during_backward_and_equal_the_simulator(gloo_results, name):
    sim = SimWorld(WORLD).run(train, name)
    for rank, result in enumerate(gloo_results):
        mine = result[name]
        assert mine["error"] is None
        assert torch.allclose(mine["params"], sim[rank]["params"], atol=1e-6), name
        assert mine["bytes"] == sim[rank]["bytes"]
        assert mine["buckets"] >= 3
        # the last layers' buckets were handed over before backward reached the first layer,
        # and the collectives ran on the communication thread
        first = mine["events"].index("first layer")
        assert mine["events"][:first].count("bucket") >= 1, mine["events"]
        assert mine["events"].count("bucket") == mine["buckets"]
        if name != "powersgd":  # all-gathered or exchanged (PowerSGD: all-reduced)
            assert mine["threads"] == {"gossamer-comm_0"}
        # the simulator reduces the same buckets after backward
        assert sim[rank]["events"] == ["first layer"]


@pytest.mark.slow
@pytest.mark.gloo
def test_compressed_accumulation_needs_no_sync(gloo_results):
    """With no_sync the compressed average of the accumulated gradient, once a step (what
    one backward over the whole batch gives up to rounding); without it, an error naming
    no_sync at the second backward, before any memory was updated twice."""
    for result in gloo_results:
        assert result["no_sync"]["error"] is None
        assert torch.allclose(result["no_sync"]["params"], result["dgc"]["params"], atol=1e-5)
        assert result["no_sync"]["bytes"] == result["dgc"]["bytes"]
        assert "no_sync" in result["each"]["error"]


@pytest.mark.slow
@pytest.mark.gloo
def test_ddp_hook_returns_before_the_reduction_ends(gloo_results):
    """The hook hands the bucket to its communication thread and returns a pending future;
    DDP waits for it: the same parameters on every rank, every step counted."""
    results = [r["ddp topk"] for r in gloo_results]
    for result in results:
        assert result["threads"] == {"gossamer-comm_0"}
        assert any(result["pending"]), result["pending"]
        assert result["step"] == STEPS
    assert torch.equal(results[0]["params"], results[1]["params"])
