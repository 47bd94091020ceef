"""NCCL's rules, checked on gloo: what every method asks of ``torch.distributed`` would also
run on NCCL.

NCCL requires (1) every rank of a communicator to issue the same collectives (operation, sizes,
dtype) in the same order, (2) no two threads to issue on one communicator at once, unless a
wait orders them (then every rank issues in the same order), and (3) point-to-point sends and
receives posted in batches (``batch_isend_irecv``: one NCCL group call), every send received at
the peer, per pair and in order, with the same size and dtype. gloo forgives much of this, so
each method trains a few steps on 4 gloo processes with a
:class:`~gossamer.comm.recording.Recorder` installed (:func:`gossamer.testing.recording`), and
the checks of :mod:`gossamer.comm.recording` read every rank's record: the process group's,
and each P2PGroup subgroup's (DiLoCo's and Streaming DiLoCo's replicas, WAGMA's groups).

The cases are every registered method (the compressed presets included), AllReduce without
overlap, DiLoCo and Streaming DiLoCo between replicas of 2, DiLoCo's delayed and eager outer
steps, and the asynchronous methods with
their steps paced, in four families (one set of processes runs a family's cases in turn).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gossamer
from gossamer.algorithms import (
    ADPSGD,
    DESLOC,
    QSR,
    SPARTA,
    WAGMA,
    AllReduce,
    DeMo,
    DiLoCo,
    LocalSGD,
    MuLoCo,
    NoLoCo,
    SparseLoCo,
    StreamingDiLoCo,
    available,
    create,
)
from gossamer.comm.recording import (
    Call,
    check_collectives,
    check_point_to_point,
    check_threads,
)

WORKERS, STEPS = 4, 6
PACE = 0.01  # seconds per step of the asynchronous methods (they decide from arrivals)

FAMILIES = {
    "allreduce": [
        ("allreduce", create("allreduce")),
        ("allreduce-no-overlap", AllReduce(overlap=False)),
        *[(name, create(name)) for name in ("dgc", "fp16", "powersgd", "qsgd", "randomk",
                                            "topk")],
        ("topk-no-overlap", AllReduce(compression="topk:ratio=0.1", overlap=False)),
    ],
    "local": [
        ("localsgd", LocalSGD(period=2)),
        ("qsr", QSR(period=2)),
        ("diloco", DiLoCo(period=2)),
        ("diloco-replicas-of-2", DiLoCo(period=2, replica_size=2)),
        # the outer average in flight during the next round, from the main thread in order
        ("diloco-delayed", DiLoCo(period=2, overlap="delayed")),
        ("diloco-eager-replicas-of-2", DiLoCo(period=2, overlap="eager", replica_size=2)),
        ("streaming-diloco", StreamingDiLoCo(period=4, fragments=2)),
        ("streaming-diloco-replicas-of-2",
         StreamingDiLoCo(period=6, fragments=2, tau=2, replica_size=2, precision="int8")),
        ("sparta", SPARTA(fraction=0.05)),
        ("demo", DeMo()),
        ("sparseloco", SparseLoCo(period=2)),
        ("desloc", DESLOC(period=2, momentum_period=3)),
        ("muloco", MuLoCo(period=2)),
        ("noloco", NoLoCo(period=2)),
        ("noloco-replicas-of-2", NoLoCo(period=3, replica_size=2)),
    ],
    "gossip": [(name, create(name)) for name in ("sgp", "osgp", "dpsgd", "gossipgrad")],
    "asynchronous": [
        ("adpsgd", ADPSGD()),
        ("wagma", WAGMA(allreduce_every=3)),
        ("wagma-groups-of-2", WAGMA(group_size=2, allreduce_every=0)),
    ],
}
ASYNCHRONOUS = {"adpsgd", "wagma", "wagma-groups-of-2"}


def test_every_registered_method_is_checked():
    covered = {algorithm.label for cases in FAMILIES.values() for _, algorithm in cases}
    missing = sorted(set(available()) - covered)
    assert not missing, f"no NCCL-rules case for {missing}: add one to FAMILIES"


def train(comm, algorithm, pace: float) -> list[Call]:
    """A few steps of a small MLP with ``algorithm``, then ``finish()``; the calls recorded."""
    from gossamer.testing import recording

    with recording() as recorder:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        optimizer = gossamer.distribute(
            model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), algorithm, comm)
        g = torch.Generator().manual_seed(100 + comm.rank)
        inputs = torch.randn(STEPS, 8, 16, generator=g)
        labels = torch.randint(0, 4, (STEPS, 8), generator=g)
        for x, y in zip(inputs, labels, strict=True):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            time.sleep(pace)  # the asynchronous methods' steps last a while
            optimizer.step()
        optimizer.finish()
    return recorder.calls


def problems(logs: list[list[Call]]) -> list[str]:
    return check_collectives(logs) + check_threads(logs) + check_point_to_point(logs)


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_method_keeps_nccls_rules(family):
    from gossamer.testing import collect, run_in_turn, spawn_gloo

    runs = [(name, (algorithm, PACE if name in ASYNCHRONOUS else 0.0))
            for name, algorithm in FAMILIES[family]]
    results = spawn_gloo(run_in_turn, WORKERS, args=(train, runs), timeout=120)
    failures = []
    for name, _ in FAMILIES[family]:
        try:
            logs = collect(results, name)
        except AssertionError as exc:
            failures.append(str(exc))
            continue
        if not any(logs):
            failures.append(f"{name}: nothing recorded")
        failures += [f"{name}: {problem}" for problem in problems(logs)]
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------- the checks


def _call(index: int, op: str = "all_reduce", sizes=(8,), rank: int = 0, kind="collective",
          parts=(), thread: int = 1, clock=None) -> Call:
    return Call("pg:0", (0, 1), rank, index, kind, op, tuple(sizes), "float32", tuple(parts),
                f"thread-{thread}", thread, clock if clock is not None else {thread: index + 1})


def test_the_checks_find_what_nccl_refuses():
    same = [[_call(0), _call(1, "broadcast", (8, 0))],
            [_call(0, rank=1), _call(1, "broadcast", (8, 0), rank=1)]]
    assert problems(same) == []
    # another size, another order, one missing
    assert check_collectives([same[0], [_call(0, sizes=(9,), rank=1)]])
    assert check_collectives([same[0], [same[1][1], same[1][0]]])
    assert check_collectives([same[0], same[1][:1]])
    # two threads: unordered is a problem, a wait (thread 2 saw thread 1's first call) is not
    racing = [_call(0), _call(1, thread=2, clock={2: 1})]
    assert check_threads([racing, []])
    waited = [_call(0), _call(1, thread=2, clock={1: 1, 2: 1})]
    assert check_threads([waited, []]) == []
    # point to point: lone calls, and a send without its receive (or of another size)
    send, recv = ("send", 1, 4, "float32"), ("recv", 0, 4, "float32")
    batched = [[_call(0, "batch_isend_irecv", (), kind="batch", parts=[send])],
               [_call(0, "batch_isend_irecv", (), rank=1, kind="batch", parts=[recv])]]
    assert check_point_to_point(batched) == []
    lone = [[_call(0, "isend", (), kind="p2p", parts=[send])], batched[1]]
    assert check_point_to_point(lone)
    assert check_point_to_point([batched[0], []])
    other = ("recv", 0, 5, "float32")
    assert check_point_to_point(
        [batched[0], [_call(0, "batch_isend_irecv", (), rank=1, kind="batch", parts=[other])]])
