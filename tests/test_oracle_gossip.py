"""SGP, Overlap SGP, AD-PSGD and WAGMA against their oracles (tests/oracles), step by step.

Each worker minimises its own least-squares loss 0.5 ||A_i x - b_i||^2 on one float64 vector,
so every worker's gradient differs and depends on its parameters: a method that loses or
delays progress, or mixes the wrong models, leaves the oracle's trajectory at once. The
asynchronous methods run with network delays and a late worker too; their oracles replay the
order of exchanges the library recorded and recompute all the arithmetic themselves.
"""

from __future__ import annotations

import pytest
import torch
from oracles import adpsgd as adpsgd_oracle
from oracles import sgp as sgp_oracle
from oracles import wagma as wagma_oracle
from torch import nn

import gossamer
from gossamer.algorithms import ADPSGD, OSGP, SGP, WAGMA
from gossamer.comm import ComputeModel, NetworkModel, SimWorld
from gossamer.topology import build, from_matrix

DIM, LR = 6, 0.05


def _problem(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = [torch.randn(DIM + 2, DIM, generator=g, dtype=torch.float64) / 2 for _ in range(n)]
    b = [torch.randn(DIM + 2, generator=g, dtype=torch.float64) for _ in range(n)]
    x0 = torch.randn(DIM, generator=g, dtype=torch.float64)
    return a, b, x0


def _grad(problem):
    a, b, _ = problem
    return lambda i, x: a[i].T @ (a[i] @ x - b[i])


class _Vector(nn.Module):
    def __init__(self, x0: torch.Tensor) -> None:
        super().__init__()
        self.x = nn.Parameter(x0.clone())


def _library(comm, algorithm, problem, steps: int):
    """The library's run: parameters after every step, after finish(), and the record."""
    a, b, x0 = problem
    model = _Vector(x0)
    opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=LR), algorithm,
                              comm)
    opt.runtime.events = []
    trajectory = []
    for _ in range(steps):
        opt.zero_grad()
        residual = a[comm.rank] @ model.x - b[comm.rank]
        (0.5 * residual @ residual).backward()
        opt.step()
        trajectory.append(model.x.detach().clone())
    opt.finish()
    return trajectory, model.x.detach().clone(), opt.runtime.events


def _world(n: int, timing: str) -> SimWorld:
    if timing == "equal":
        return SimWorld(n, compute=ComputeModel(step_time=0.01))
    # messages take about half a step, worker 1 is 3x slower, every step jitters
    return SimWorld(n, network=NetworkModel(latency=4e-3, bandwidth=1e6),
                    compute=ComputeModel(step_time=0.01, jitter=0.2, stragglers={1: 3.0}),
                    seed=3)


def _assert_trajectories(library, expected, steps: int) -> None:
    for k in range(steps):
        for i, (trajectory, _, _) in enumerate(library):
            assert torch.allclose(trajectory[k], expected[k][i], atol=1e-6, rtol=0), (k, i)


def _mixing(topology):
    def at(k: int):
        rows = []
        for i in range(topology.world_size):
            w = topology.weights(i, k)
            rows.append((float(w.self_weight), {j: float(p) for j, p in w.peers.items()}))
        return rows
    return at


def _column_stochastic(n: int) -> torch.Tensor:
    """A column-stochastic, strongly connected matrix with unequal weights, so the push-sum
    weights drift away from 1 even in synchronous SGP."""
    g = torch.Generator().manual_seed(7)
    w = torch.rand(n, n, generator=g, dtype=torch.float64) * (torch.rand(n, n, generator=g) < 0.5)
    w += torch.roll(torch.eye(n, dtype=torch.float64), 1, 0) + torch.eye(n, dtype=torch.float64)
    return w / w.sum(0, keepdim=True)


@pytest.mark.parametrize("n, topology, tau, timing", [
    (5, "exponential", 0, "equal"),
    (8, "exponential", 1, "equal"),
    (8, "exponential", 2, "delayed"),
    (4, "matrix", 0, "equal"),
    (4, "matrix", 1, "delayed"),
    (6, "matrix", 3, "delayed"),
])
def test_sgp_and_overlap_sgp_match_algorithms_1_and_2(n, topology, tau, timing):
    problem, steps = _problem(n), 25
    topo = from_matrix(_column_stochastic(n)) if topology == "matrix" else build(topology, n)
    cls = OSGP if tau else SGP
    library = _world(n, timing).run(_library, cls(topology=topo, tau=tau), problem, steps)
    expected, average = sgp_oracle.run([problem[2]] * n, _grad(problem), LR, steps,
                                       _mixing(topo), tau)
    _assert_trajectories(library, expected, steps)
    for _, final, _ in library:  # finish(): in-flight mass mixed, then the exact average
        assert torch.allclose(final, average, atol=1e-6, rtol=0)
    assert not torch.allclose(expected[-1][0], expected[-1][1], atol=1e-6)  # still apart


@pytest.mark.parametrize("n, timing", [(4, "equal"), (8, "equal"), (4, "delayed"),
                                       (8, "delayed")])
def test_adpsgd_matches_algorithm_1_in_the_recorded_order(n, timing):
    problem, steps = _problem(n, seed=1), 30
    algorithm = ADPSGD(average_at_end=False)
    library = _world(n, timing).run(_library, algorithm, problem, steps)
    events = [record for _, _, record in library]
    expected, final = adpsgd_oracle.run([problem[2]] * n, _grad(problem), LR, steps, events)
    _assert_trajectories(library, expected, steps)
    for i, (_, settled, _) in enumerate(library):
        assert torch.allclose(settled, final[i], atol=1e-6, rtol=0)
    requested = {(i, peer, number): step for i, record in enumerate(events)
                 for step, kind, peer, number in record if kind == "request"}
    lags = [step - requested[(i, peer, number)] for i, record in enumerate(events)
            for step, kind, peer, number in record if kind == "take"]
    assert len(lags) >= steps * n // 12  # the workers did average, many times
    if timing == "delayed":  # some replies arrived several steps after their request
        assert max(lags) >= 2


@pytest.mark.parametrize("n, options, timing", [
    (8, {"group_size": 2, "tau": 0, "allreduce_every": 0}, "equal"),
    (8, {"group_size": 4, "tau": 1, "allreduce_every": 5}, "equal"),
    (8, {"group_size": 2, "tau": 1, "allreduce_every": 0}, "delayed"),
    (8, {"group_size": 4, "tau": 2, "allreduce_every": 7}, "delayed"),
    (16, {"group_size": 4, "tau": 3, "allreduce_every": 0}, "delayed"),
])
def test_wagma_matches_algorithm_1_in_the_recorded_order(n, options, timing):
    problem, steps = _problem(n, seed=2), 30
    library = _world(n, timing).run(_library, WAGMA(**options), problem, steps)
    events = [record for _, _, record in library]
    expected, last = wagma_oracle.run([problem[2]] * n, _grad(problem), LR, steps, events)
    _assert_trajectories(library, expected, steps)
    mean = torch.stack(last).mean(0)
    for _, final, _ in library:  # finish(): the exact average of the last models
        assert torch.allclose(final, mean, atol=1e-6, rtol=0)
    ages = [age for record in events for *_, recorded in record for age in recorded.values()]
    assert max(ages) <= options["tau"]
    if timing == "equal":
        assert max(ages) == 0  # nobody late: every member contributed its current model
    else:
        assert max(ages) > 0  # the late worker's older model was used
