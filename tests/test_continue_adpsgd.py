"""AD-PSGD under ``--on-failure continue``: the survivors drop the exchanges of the old
communicator, pair again by their new ranks (``bipartite_exponential`` for any number of
workers) and start from their exact average; a restarted worker rejoins with a member's state."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gossamer
from gossamer.algorithms import ADPSGD
from gossamer.comm import ComputeModel, SimWorld
from gossamer.topology import bipartite_exponential
from gossamer.train.config import TrainConfig
from gossamer.train.elastic import share_state
from gossamer.train.run import run_training

SURVIVORS = (0, 2, 3)  # rank 1 (passive) fails; renumbered 0, 1, 2: 0 and 2 active, 1 passive


def _tiny(*faults: str, steps: int = 6) -> dict:
    return run_training(TrainConfig(algorithm="adpsgd", sim=4, steps=steps, quiet=True,
                                    timeout=3, faults=faults, on_failure="continue"))


# ------------------------------------------------------------------------- whole runs


@pytest.mark.parametrize("kind", ["crash", "hang"])
def test_survivors_of_a_crash_or_a_hang_finish_every_step(kind):
    result = _tiny(f"1:3:{kind}")
    assert result["membership"][-1]["members"] == [0, 2, 3] and result["world_size"] == 3
    assert result["step"] == 6 and math.isfinite(result["eval_loss"])
    assert result["consensus_distance"] == 0  # averaged at the end, as without the fault


def test_survivors_go_on_pairing_after_the_next_look_for_rejoining_workers():
    # nothing in AD-PSGD waits for the dead worker; the survivors all notice it at the
    # loop's next collective (the look for rejoining workers before step 11) and gossip as 3
    result = _tiny("1:3:crash", steps=12)
    assert result["membership"] == [{"step": 0, "members": [0, 1, 2, 3]},
                                    {"step": 11, "members": [0, 2, 3]}]
    assert result["step"] == 12 and math.isfinite(result["eval_loss"])


# ------------------------------------------------- the change itself, step by step


def _steps(optimizer, model, count: int, generator: torch.Generator) -> None:
    for _ in range(count):
        x, y = torch.randn(8, 4, generator=generator), torch.randint(0, 3, (8,),
                                                                     generator=generator)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _pairs_agree(runtime_events: list[list[tuple[int, str, int, int]]]) -> bool:
    """Each active worker took exactly the replies its passive peers answered, in number."""
    takes: dict[tuple[int, int], int] = {}
    answers: dict[tuple[int, int], int] = {}
    for rank, events in enumerate(runtime_events):
        for _, kind, peer, _ in events:
            if kind == "take":
                takes[rank, peer] = takes.get((rank, peer), 0) + 1
            elif kind == "answer":
                answers[peer, rank] = answers.get((peer, rank), 0) + 1
    return takes == answers and sum(takes.values()) > 0


def _fail_then_go_on(comm, steps_after: int):
    """4 workers with different models (lr 0: only the averages move them); rank 1 stops
    after 3 steps with exchanges in flight; the others go on over a new communicator."""
    torch.manual_seed(comm.rank)
    model = nn.Linear(4, 3)
    optimizer = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.0),
                                    ADPSGD(), comm, broadcast=False)
    runtime = optimizer.runtime
    g = torch.Generator().manual_seed(comm.rank)
    _steps(optimizer, model, 3, g)
    if comm.rank == 1:
        return None  # gone: its requests, answers and posted receives stay half done
    comm.sleep(1.0)  # the replies already sent arrive (into receives of the old world)
    pending = any(reply.ready() for _, reply in runtime.outstanding.values())
    new = comm.regroup(SURVIVORS.index(comm.rank), SURVIVORS, "epoch-1")
    before = _flat(model)
    parts = new.all_gather(before)
    mean = parts[0].clone()
    for part in parts[1:]:
        mean.add_(part)
    mean.div_(3)
    runtime.change_membership(new, ADPSGD().for_members(3))
    after = _flat(model)
    runtime.events = []
    _steps(optimizer, model, steps_after, g)
    runtime.settle()  # a pair that counts differently would block here (and time out)
    return pending, before, mean, after, _flat(model), runtime.events, runtime.neighbors


def _world() -> SimWorld:
    return SimWorld(4, compute=ComputeModel(step_time=0.01, jitter=0.3), seed=3, timeout=3)


def test_the_survivors_start_from_their_exact_average_and_apply_nothing_of_the_old_world():
    results = [r for r in _world().run(_fail_then_go_on, 8) if r is not None]
    # the setting has a reply of the old world that had arrived when the membership changed
    assert any(pending for pending, *_ in results)
    before = [r[1] for r in results]
    assert not all(torch.equal(before[0], b) for b in before[1:])
    for _, _, mean, after, end, _, _ in results:
        assert torch.allclose(after, mean, rtol=0, atol=1e-7)  # the exact average
        # with lr 0, the new pairs' averages of equal models change nothing; a reply of the
        # old world applied later would
        assert torch.equal(end, results[0][3])
    # new ranks 0 and 2 active, 1 passive: both pair with 1, which answers both
    assert [r[6] for r in results] == [[1], [0, 2], [1]]
    assert _pairs_agree([r[5] for r in results])


def _rejoin(comm, steps_after: int):
    """Rank 1 rejoins 4 workers: the members (0, 2, 3) trained as 3, settle and average over
    their communicator, rank 0 shares its state, and everyone goes on over the world of 4."""
    torch.manual_seed(comm.rank)
    model = nn.Linear(4, 3)
    members = (0, 2, 3)
    g = torch.Generator().manual_seed(comm.rank)
    if comm.rank in members:
        old = comm.group(members)
        optimizer = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1,
                                                               momentum=0.9),
                                        ADPSGD(), old, broadcast=False)
        _steps(optimizer, model, 4, g)
        optimizer.runtime.settle()
        optimizer.runtime.average_parameters()
        new = old.regroup(comm.rank, (0, 1, 2, 3), "epoch-2")  # (rank = id: all four)
    else:  # restarted: its runtime is made over the new communicator (the same epoch's)
        new = comm.regroup(comm.rank, (0, 1, 2, 3), "epoch-2")
        optimizer = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1,
                                                               momentum=0.9),
                                        ADPSGD().for_members(4), new, broadcast=False)
    runtime = optimizer.runtime
    step = share_state(new, 0, model, optimizer, runtime, 4, joining=comm.rank == 1)
    runtime.change_membership(new, ADPSGD().for_members(4))
    joined = _flat(model)
    inner = optimizer.optimizer
    momentum = torch.cat([inner.state[p]["momentum_buffer"].flatten()
                          for p in model.parameters()])
    for group in inner.param_groups:
        group["lr"] = 0.0
    runtime.events = []
    _steps(optimizer, model, steps_after, g)
    runtime.settle()
    return step, joined, momentum, _flat(model), runtime.events


def test_a_rejoining_passive_worker_pairs_with_every_member_and_all_end_equal():
    results = _world().run(_rejoin, 8)
    assert [r[0] for r in results] == [4, 4, 4, 4]
    source = results[0]
    for _, joined, _, end, _ in results:
        assert torch.equal(joined, source[1]) and torch.equal(end, source[1])
    assert torch.equal(results[1][2], source[2])  # the source's optimizer state, too
    # rank 1 (passive) answered each active peer exactly as often as it asked: its receives,
    # posted when its runtime was made, were kept (a second one would swallow a request)
    assert _pairs_agree([r[4] for r in results])
    assert {peer for _, kind, peer, _ in results[1][4] if kind == "answer"} == {0, 2}


# ------------------------------------------------------------------ the topology


def _old_formula(n: int) -> list[np.ndarray]:
    """The even-n graph as it was first defined: r -> r +- d (mod n), weights 1/2."""
    offsets = [1] + [(1 << i) + 1 for i in range(1, (n - 1).bit_length())]
    phases = []
    for d in offsets:
        for sign in (1, -1):
            w = np.zeros((n, n))
            for r in range(n):
                w[r, r] += 0.5
                w[(r + sign * d) % n, r] += 0.5
            phases.append(w)
    return phases


@pytest.mark.parametrize("n", [3, 5, 7, 9, 15, 33])
def test_bipartite_exponential_for_odd_n_joins_only_even_and_odd_ranks(n):
    topo = bipartite_exponential(n)
    cut = bipartite_exponential(n + 1)
    assert topo.period == cut.period and topo.is_column_stochastic()
    topo.require_strongly_connected()
    union = {r: set() for r in range(n)}
    for k in range(topo.period):
        for r in range(n):
            peers = topo.out_peers(r, k)
            # the graph of n + 1 without rank n; one who would send to n keeps its value
            assert peers == [p for p in cut.out_peers(r, k) if p < n]
            assert len(topo.in_peers(r, k)) <= 1
            assert all((r - p) % 2 == 1 for p in peers)
            union[r].update(peers)
    assert all(r in union[p] for r in union for p in union[r])  # every pair both ways
    ADPSGD().validate(n)  # AD-PSGD accepts it


def test_bipartite_exponential_for_3_is_a_star_and_even_n_is_unchanged():
    topo = bipartite_exponential(3)
    assert [[topo.out_peers(r, k) for k in range(4)] for r in range(3)] == [
        [[1], [], [], [1]], [[2], [0], [0], [2]], [[], [1], [1], []]]
    for n in range(2, 41, 2):
        built = bipartite_exponential(n)
        old = _old_formula(n)
        assert built.period == len(old)
        assert all(np.array_equal(built.matrix(k), w) for k, w in enumerate(old))
