"""The synchronous methods against their oracles: AllReduce-SGD, D-PSGD and GossipGraD.

Each test runs the library in SimWorld on a per-worker least-squares problem (float64, a few
parameter tensors, data that depends on the worker and the step), records every worker's
parameters after every step, and matches them to the oracle in ``tests/oracles`` (a plain
sequential program from the paper) to 1e-6. The gradients the oracles use are written out by
hand (``A^T (A x - b)``), not taken from autograd.
"""

from __future__ import annotations

import pytest
import torch
from oracles import allreduce as allreduce_oracle
from oracles import dpsgd as dpsgd_oracle
from oracles import gossipgrad as gossipgrad_oracle
from torch import nn

import gossamer
from gossamer.algorithms import DPSGD, AllReduce, GossipGraD
from gossamer.comm import SimWorld
from gossamer.topology import GossipGradSchedule, build

SHAPES = [(2, 3), (3,), (4,)]  # several tensors, so that small buckets split them
DIM = sum(torch.Size(s).numel() for s in SHAPES)
ROWS = 5
LR = 0.02
ATOL = 1e-6


def _data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``rank``'s least-squares data at ``step``: ``(A, b)``."""
    g = torch.Generator().manual_seed(10_000 * (rank + 1) + step)
    a = torch.randn(ROWS, DIM, generator=g, dtype=torch.float64)
    b = torch.randn(ROWS, generator=g, dtype=torch.float64) * (rank + 1)
    return a, b


def _grad(rank: int, step: int, x: torch.Tensor) -> torch.Tensor:
    """The gradient of ``0.5 ||A x - b||^2``, by hand."""
    a, b = _data(rank, step)
    return a.T @ (a @ x - b)


def _initial(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(77 + rank)
    return torch.randn(DIM, generator=g, dtype=torch.float64)


class LeastSquares(nn.Module):
    """One vector ``x`` of parameters, stored as several tensors; loss ``0.5 ||A x - b||^2``."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__()
        parts, start = [], 0
        for shape in SHAPES:
            size = torch.Size(shape).numel()
            parts.append(nn.Parameter(x[start:start + size].reshape(shape).clone()))
            start += size
        self.parts = nn.ParameterList(parts)

    def flat(self) -> torch.Tensor:
        return torch.cat([p.detach().flatten() for p in self.parts])

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        x = torch.cat([p.flatten() for p in self.parts])
        return 0.5 * ((a @ x - b) ** 2).sum()


def _run(n: int, algorithm, steps: int, *, momentum: float = 0.0, weight_decay: float = 0.0,
         broadcast: bool = False) -> list[list[torch.Tensor]]:
    """The library's trajectory: ``result[k][i]`` is worker i's parameters after step k + 1."""

    def worker(comm) -> list[torch.Tensor]:
        model = LeastSquares(_initial(comm.rank))
        sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum,
                              weight_decay=weight_decay)
        optimizer = gossamer.distribute(model, sgd, algorithm, comm, broadcast=broadcast)
        record = []
        for k in range(steps):
            optimizer.zero_grad()
            model(*_data(comm.rank, k)).backward()
            optimizer.step()
            record.append(model.flat().clone())
        return record

    per_worker = SimWorld(n).run(worker)
    return [[per_worker[i][k] for i in range(n)] for k in range(steps)]


def _assert_trajectories_match(library: list[list[torch.Tensor]],
                               oracle: list[list[torch.Tensor]]) -> None:
    assert len(library) == len(oracle)
    for k, (got, want) in enumerate(zip(library, oracle, strict=True)):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            err = (g - w).abs().max().item()
            assert err <= ATOL, f"step {k + 1}, worker {i}: library and oracle differ by {err:g}"


def _assert_workers_differ(trajectory: list[list[torch.Tensor]]) -> None:
    """The replicas drift apart (so the test would see a wrong mixing) and move."""
    last = trajectory[-1]
    assert max((t - last[0]).abs().max().item() for t in last) > 1e-3
    assert (trajectory[0][0] - trajectory[-1][0]).abs().max().item() > 1e-3


# ---------------------------------------------------------------------------- AllReduce-SGD


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("bucket_bytes", [25 * 2**20, 40, 8])
@pytest.mark.parametrize(("momentum", "weight_decay"), [(0.0, 0.0), (0.9, 0.01)])
def test_allreduce_matches_oracle(n, bucket_bytes, momentum, weight_decay):
    steps = 12
    library = _run(n, AllReduce(bucket_mb=bucket_bytes / 2**20), steps, momentum=momentum,
                   weight_decay=weight_decay, broadcast=True)
    # broadcast: every worker starts from rank 0's parameters, as DDP does
    oracle = allreduce_oracle.allreduce_sgd([_initial(0)] * n, _grad, steps, lr=LR,
                                            momentum=momentum, weight_decay=weight_decay)
    _assert_trajectories_match(library, oracle)
    for params in library[-1][1:]:  # one model: the replicas are identical, bit for bit
        assert torch.equal(params, library[-1][0])
    assert (library[-1][0] - _initial(0)).abs().max().item() > 1e-3


def test_allreduce_oracle_is_not_local_sgd():
    """The average matters: without it (each worker on its own gradient) the result differs,
    so the match above is not a coincidence of the data."""
    averaged = allreduce_oracle.allreduce_sgd([_initial(0)] * 4, _grad, 5, lr=LR)
    local = _initial(0)
    for k in range(5):
        local = local - LR * _grad(1, k, local)
    assert (averaged[-1][1] - local).abs().max().item() > 1e-3


# ---------------------------------------------------------------------------- D-PSGD


@pytest.mark.parametrize(("n", "topology", "momentum", "allreduce_every"), [
    (4, "ring", 0.0, 0),
    (8, "ring", 0.0, 0),
    (4, "bipartite_exponential", 0.0, 0),
    (8, "bipartite_exponential", 0.0, 0),
    (8, "exponential", 0.0, 0),
    (8, "hypercube", 0.0, 0),
    (8, "random_regular", 0.9, 0),
    (8, "bipartite_exponential", 0.9, 5),
])
def test_dpsgd_matches_oracle(n, topology, momentum, allreduce_every):
    steps = 14
    options = {"degree": 3, "seed": 1} if topology == "random_regular" else {}
    topo = build(topology, n, **options)
    algorithm = DPSGD(topology=topo, allreduce_every=allreduce_every)
    library = _run(n, algorithm, steps, momentum=momentum)
    mixing = [topo.matrix(p) for p in range(topo.period)]  # the topology as plain data
    oracle = dpsgd_oracle.dpsgd([_initial(i) for i in range(n)], mixing, _grad, steps, lr=LR,
                                momentum=momentum, allreduce_every=allreduce_every)
    _assert_trajectories_match(library, oracle)
    if not allreduce_every or steps % allreduce_every:
        _assert_workers_differ(library)


def test_dpsgd_directed_phase_is_pulled_by_the_receiver():
    """On the directed bipartite exponential graph, row j (what j receives) is mixed, not
    column j: the oracle with W transposed would be a different method."""
    n, steps = 8, 3
    topo = build("bipartite_exponential", n)
    x0 = [_initial(i) for i in range(n)]
    rows = dpsgd_oracle.dpsgd(x0, [topo.matrix(p) for p in range(topo.period)], _grad, steps,
                              lr=LR)
    cols = dpsgd_oracle.dpsgd(x0, [topo.matrix(p).T for p in range(topo.period)], _grad,
                              steps, lr=LR)
    assert max((a - b).abs().max().item() for a, b in zip(rows[-1], cols[-1], strict=True)) > 1e-3
    _assert_trajectories_match(_run(n, DPSGD(topology=topo), steps), rows)


# ---------------------------------------------------------------------------- GossipGraD


@pytest.mark.parametrize(("n", "topology", "local_group_size", "shuffle", "allreduce_every"), [
    (4, "cube", 1, True, 0),
    (8, "cube", 1, True, 0),
    (4, "dissemination", 1, True, 0),
    (8, "dissemination", 1, True, 0),
    (8, "dissemination", 1, False, 0),
    (8, "cube", 2, True, 0),
    (8, "dissemination", 2, True, 4),
    (4, "dissemination", 2, True, 0),
    (6, "dissemination", 2, True, 0),  # three nodes: not a power of two
    (8, "cube", 4, True, 0),
    (8, "cube", 1, True, 5),
])
def test_gossipgrad_matches_oracle(n, topology, local_group_size, shuffle, allreduce_every):
    steps, seed = 13, 3
    algorithm = GossipGraD(topology=topology, local_group_size=local_group_size, seed=seed,
                           shuffle=shuffle, allreduce_every=allreduce_every, bucket_mb=40 / 2**20)
    momentum = 0.9 if allreduce_every else 0.0
    library = _run(n, algorithm, steps, momentum=momentum)
    nodes = n // local_group_size
    schedule = GossipGradSchedule(nodes, topology, seed=seed, shuffle=shuffle)
    orders = [schedule.order(r) for r in range(steps // schedule.period + 1)]  # data
    assert schedule.period == gossipgrad_oracle.period_of(nodes)
    oracle = gossipgrad_oracle.gossipgrad(
        [_initial(i) for i in range(n)], _grad, steps, lr=LR, topology=topology,
        local_group_size=local_group_size, orders=orders, momentum=momentum,
        allreduce_every=allreduce_every)
    _assert_trajectories_match(library, oracle)
    if not allreduce_every or steps % allreduce_every:
        _assert_workers_differ(library)


def test_gossipgrad_orders_change_the_trajectory():
    """The reshuffles matter: the oracle on the unshuffled order is another trajectory, so the
    match above checks the shuffled partners."""
    n, steps = 8, 9
    schedule = GossipGradSchedule(n, "dissemination", seed=3)
    shuffled = [schedule.order(r) for r in range(steps // schedule.period + 1)]
    plain = [list(range(n))] * len(shuffled)
    x0 = [_initial(i) for i in range(n)]
    a = gossipgrad_oracle.gossipgrad(x0, _grad, steps, lr=LR, topology="dissemination",
                                     local_group_size=1, orders=shuffled)
    b = gossipgrad_oracle.gossipgrad(x0, _grad, steps, lr=LR, topology="dissemination",
                                     local_group_size=1, orders=plain)
    assert max((u - w).abs().max().item() for u, w in zip(a[-1], b[-1], strict=True)) > 1e-4
