"""DDP's bucket reducer (gossamer.patterns.overlap) by itself, driven as AllReduce drives it:
flat buckets all-reduced (GradientBuckets) and buckets through a compressed reducer on the
communication thread (CompressedBuckets), with and without overlap. On a model whose heads'
gradients arrive in another order on odd ranks, the buckets are issued in the same order on
every rank, during backward on gloo when they overlap, and the gradients are the plain mean
(exact: integer gradients), with the same bytes and messages with and without overlap, in the
simulator and on gloo. (tests/test_overlap_compressed.py checks the algorithms built on
them.)"""

import functools
import threading
import time

import pytest
import torch
from torch import nn

from gossamer.comm import SimWorld
from gossamer.compress.reducer import CompressedReducer
from gossamer.compress.registry import parse_compression
from gossamer.patterns.nonfinite import flag_words
from gossamer.patterns.overlap import (
    FIRST_BUCKET_BYTES,
    CommThread,
    CompressedBuckets,
    GradientBuckets,
    first_bucket_bytes,
    overlaps,
)
from gossamer.testing import collect, run_in_turn, spawn_gloo

WORLD = 4  # a power of two: every mean of integers is exact
STEPS = 2
BUCKET_BYTES = 144  # a head's weight and bias; the trunk's two tensors apart


class _Forked(nn.Module):
    """A trunk and two heads, with integer weights; ``unused`` (registered first, so in the
    last bucket) never gets a gradient. ``right_first`` computes the right head first: its
    gradients then come after the left head's."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Parameter(torch.ones(3))
        self.trunk = nn.Linear(6, 8)
        self.left = nn.Linear(8, 4)
        self.right = nn.Linear(8, 4)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randint(-2, 3, p.shape, generator=g))

    def forward(self, x: torch.Tensor, right_first: bool) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        first, second = (self.right, self.left) if right_first else (self.left, self.right)
        a = first(h)
        return a + second(h)


def _loss(model: _Forked, rank: int, step: int) -> torch.Tensor:
    """Worker ``rank``'s loss at ``step``: integers in, integer gradients out."""
    g = torch.Generator().manual_seed(10 * rank + step)
    x = torch.randint(-3, 4, (4, 6), generator=g).float()
    weights = torch.randint(-2, 3, (4, 4), generator=g).float()
    return (model(x, right_first=rank % 2 == 1) * weights).sum()


@functools.cache
def _mean_gradients(step: int) -> dict[str, torch.Tensor]:
    """The plain mean of every worker's gradient at ``step`` (zeros for ``unused``)."""
    model = _Forked()
    total = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    used = [(name, p) for name, p in model.named_parameters() if name != "unused"]
    for rank in range(WORLD):
        grads = torch.autograd.grad(_loss(model, rank, step), [p for _, p in used])
        for (name, _), grad in zip(used, grads, strict=True):
            total[name] += grad
    return {name: t / WORLD for name, t in total.items()}


def _record(comm, model: _Forked, kind: str, overlap: bool) -> tuple:
    """The buckets of ``kind`` over ``model`` and the list of events they leave: ``("grad",
    name)`` a gradient accumulated, ``("start", bucket)`` a compressed bucket handed over,
    ``("issue", bucket, thread)`` its collectives called, on that thread."""
    events: list = []
    named = list(model.named_parameters())
    for name, p in named:  # (before the buckets' hooks: they run first)
        p.register_post_accumulate_grad_hook(lambda _, name=name: events.append(("grad", name)))
    flags = torch.zeros(flag_words(comm.world_size))
    if kind == "dense":
        buckets = GradientBuckets(comm, named, flags, BUCKET_BYTES, overlap=overlap)
        buffers = buckets.buckets.buffers

        def issued(fn):
            def call(t, op="sum"):
                events.append(("issue", [b is t for b in buffers].index(True),
                               threading.current_thread().name))
                return fn(t, op)
            return call

        comm.all_reduce = issued(comm.all_reduce)
        if overlaps(comm):  # (the simulator has no all_reduce_async)
            comm.all_reduce_async = issued(comm.all_reduce_async)
        return buckets, events
    compressor, memory = parse_compression(kind).build(comm.world_size)
    buckets = CompressedBuckets(comm, list(reversed(named)), CompressedReducer(
        comm, compressor, memory), flags, BUCKET_BYTES, step=lambda: 0,
        prepare=lambda named: None, overlap=overlap)
    prepare, send = buckets._prepare, buckets._send

    def preparing(bucket, overflow=False):
        events.append(("start", bucket))
        return prepare(bucket, overflow)

    def sending(grads, step, last):
        names = [name for name, _ in grads]
        events.append(("issue", [[buckets.named[i][0] for i in members] == names
                                 for members in buckets.members].index(True),
                       threading.current_thread().name))
        send(grads, step, last)

    buckets._prepare, buckets._send = preparing, sending
    return buckets, events


def _life(comm, kind: str, overlap: bool) -> dict:
    """STEPS backward passes, each followed by the reduction after backward (done already
    where the buckets overlapped it): per step the averaged gradients and the events, with
    ``("backward",)`` where backward() returned."""
    stats = comm.stats
    before = stats.total_bytes_sent, stats.total_messages_sent
    model = _Forked()
    buckets, events = _record(comm, model, kind, overlap)
    grads, steps = [], []
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        events.clear()
        _loss(model, comm.rank, step).backward()
        events.append(("backward",))
        buckets.reduce(None)
        buckets.new_step()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        steps.append(list(events))
    return {"grads": grads, "events": steps, "buckets": len(buckets.members),
            "overlaps": overlaps(comm), "traffic": (stats.total_bytes_sent - before[0],
                                                    stats.total_messages_sent - before[1])}


RUNS = [(f"{kind}{' overlap' * overlap}", (kind, overlap))
        for kind in ("dense", "topk:ratio=1.0", "topk:ratio=0.25") for overlap in (False, True)]
EXACT = ("dense", "topk:ratio=1.0")


def _of(events: list, what: str) -> list:
    return [e for e in events if e[0] == what]


def _check(key: str, results: list[dict]) -> None:
    """The buckets handed over and issued in order on every rank, whatever order the heads'
    gradients came in; the same gradients everywhere; the mean (exact) when nothing is
    dropped."""
    kind = key.split()[0]
    for rank, r in enumerate(results):
        assert r["buckets"] >= 4
        for step, events in enumerate(r["events"]):
            order = list(range(r["buckets"]))
            assert [e[1] for e in _of(events, "issue")] == order, (key, rank, events)
            if kind != "dense":
                assert [e[1] for e in _of(events, "start")] == order, (key, rank, events)
            heads = [name.split(".")[0] for _, name in _of(events, "grad")[:4]]
            assert heads == (["left"] * 2 + ["right"] * 2 if rank % 2 else
                             ["right"] * 2 + ["left"] * 2), events
            for name, grad in r["grads"][step].items():
                assert torch.equal(grad, results[0]["grads"][step][name]), (key, rank, name)
                if kind in EXACT:
                    assert torch.equal(grad, _mean_gradients(step)[name]), (key, rank, name)
    if kind not in EXACT:  # lossy: not the mean
        assert not torch.equal(results[0]["grads"][0]["trunk.weight"],
                                _mean_gradients(0)["trunk.weight"])


def _issued(results: list[dict], during_backward: bool) -> None:
    """Every bucket handed over and issued before backward() returned, or every one after."""
    for r in results:
        for events in r["events"]:
            end = events.index(("backward",))
            buckets = [e for e in events if e[0] in ("start", "issue")]
            assert buckets and all((events.index(e) < end) == during_backward
                                   for e in buckets), events


def _simulated() -> dict[str, list[dict]]:
    return {key: SimWorld(WORLD).run(_life, *args) for key, args in RUNS}


def test_buckets_give_the_mean_in_order_in_the_simulator():
    """The simulator overlaps nothing: the same calls after backward, on the caller's thread,
    whether the buckets were made to overlap or not, with the same bytes and messages."""
    sim = _simulated()
    for key, results in sim.items():
        _check(key, results)
        _issued(results, during_backward=False)
        assert all(not r["overlaps"] for r in results)
        assert all(e[2] == "MainThread" for r in results for events in r["events"]
                   for e in _of(events, "issue"))
    for key, results in sim.items():
        if key.endswith(" overlap"):
            plain = sim[key.removesuffix(" overlap")]
            assert [r["traffic"] for r in results] == [r["traffic"] for r in plain], key
    # the dense buckets, as a ring all-reduces them: every gradient and the flags, 2 (n - 1)
    # messages per bucket
    numel = sum(p.numel() for p in _Forked().parameters()) + flag_words(WORLD)
    assert all(r["traffic"] == (STEPS * 2 * (WORLD - 1) * 4 * numel // WORLD,
                                STEPS * r["buckets"] * 2 * (WORLD - 1)) for r in sim["dense"])


def test_the_first_bucket_is_small_only_to_overlap():
    assert first_bucket_bytes(BUCKET_BYTES, overlap=True) == BUCKET_BYTES
    assert first_bucket_bytes(2 * FIRST_BUCKET_BYTES, overlap=True) == FIRST_BUCKET_BYTES
    assert first_bucket_bytes(2 * FIRST_BUCKET_BYTES, overlap=False) is None


def test_the_communication_thread_runs_jobs_in_order_without_autograd():
    thread = CommThread()
    ran: list = []

    def job(i: int) -> None:
        if i == 0:
            time.sleep(0.05)  # a thread pool of more than one would let 1 and 2 go first
        ran.append((i, threading.current_thread().name, torch.is_grad_enabled()))
        if i == 1:
            raise ValueError("bucket 1")

    jobs = [thread.submit(job, i) for i in range(3)]
    with pytest.raises(ValueError, match="bucket 1"):
        CommThread.wait(jobs)
    assert [i for i, _, _ in ran] == [0, 1, 2]
    assert {name for _, name, _ in ran} == {"gossamer-comm_0"}
    assert not any(grad for _, _, grad in ran)


@pytest.mark.slow
@pytest.mark.gloo
def test_buckets_on_gloo_overlap_backward_and_count_what_the_simulator_does():
    """Backend parity: 4 gloo processes give the same gradients, bit for bit, and send the
    same bytes and messages; with overlap the first bucket is issued before backward ends
    (the compressed ones on the communication thread), without it after."""
    results = spawn_gloo(run_in_turn, WORLD, args=(_life, RUNS), timeout=180)
    for key, sim in _simulated().items():
        real = collect(results, key)
        _check(key, real)
        for mine, theirs in zip(real, sim, strict=True):
            assert mine["overlaps"]
            assert mine["traffic"] == theirs["traffic"], key
            for ours, others in zip(mine["grads"], theirs["grads"], strict=True):
                assert all(torch.equal(ours[name], others[name]) for name in ours), key
        if not key.endswith(" overlap"):
            _issued(real, during_backward=False)
            continue
        _issued(real, during_backward=True)
        thread = "MainThread" if key.startswith("dense") else "gossamer-comm_0"
        for r in real:
            for events in r["events"]:
                assert {e[2] for e in _of(events, "issue")} == {thread}, (key, events)
                # the heads' bucket went before the trunk's gradients were computed
                first = next(e for e in events if e[0] in ("start", "issue"))
                assert events.index(first) < events.index(("grad", "trunk.weight")), events
