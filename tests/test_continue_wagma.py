"""WAGMA going on without a failed worker (``on_failure="continue"``): the groups are rebuilt
for the members (the largest group size not above the configured one that divides their
number), what was in flight over the old communicator is dropped, the members agree on the
round and start from their exact average; a rejoining worker ends in the members' state."""

from __future__ import annotations

import functools
import math
from unittest import mock

import pytest
import torch

import gossamer
from gossamer.algorithms.wagma import WAGMA, WAGMARuntime, member_group_size
from gossamer.comm import SimWorld
from gossamer.topology import build
from gossamer.train.config import TrainConfig
from gossamer.train.elastic import share_state
from gossamer.train.run import run_training


@functools.cache
def _recorded(faults: tuple[str, ...], sim: int = 4, steps: int = 6,
              **options: int) -> tuple[dict, tuple[dict, ...]]:
    """A simulated run with on_failure="continue", and what each member's change_membership
    did: its parameters and round before and after, the group size, and (``events``) the
    rounds it averaged afterwards."""
    calls: list[dict] = []
    original = WAGMARuntime.change_membership

    def recording(runtime, comm, algorithm):
        before, round_before = runtime.read_parameters(), runtime.round
        original(runtime, comm, algorithm)
        calls.append({"runtime": runtime, "before": before, "round_before": round_before,
                      "after": runtime.read_parameters(), "round": runtime.round,
                      "group_size": algorithm.group_size,
                      "stamps": {m: dict(k) for m, k in runtime.models.items()}})
        runtime.events = []  # what it averages from now on

    with mock.patch.object(WAGMARuntime, "change_membership", recording):
        result = run_training(TrainConfig(algorithm="wagma", sim=sim, steps=steps, quiet=True,
                                          timeout=3, faults=faults, on_failure="continue",
                                          options=options))
    return result, tuple(calls)


# ------------------------------------------------------------------- the group size rule


def test_the_members_group_size_is_the_largest_divisor_not_above_the_configured_one():
    # (configured, members) -> the group size they go on with
    table = {(4, 4): 4, (4, 3): 3, (4, 2): 2, (4, 1): 1, (4, 6): 3, (4, 7): 7, (4, 15): 3,
             (2, 3): 3, (2, 5): 5, (2, 6): 2, (3, 8): 2, (8, 12): 6}
    assert {k: member_group_size(*k) for k in table} == table
    assert WAGMA().for_members(3).group_size == 3
    adapted = WAGMA(group_size=4, tau=2, allreduce_every=5).for_members(6)
    assert (adapted.group_size, adapted.tau, adapted.allreduce_every) == (3, 2, 5)
    assert adapted.topology.groups(0) == [[0, 1, 2], [3, 4, 5]]
    assert WAGMA().for_members(8).group_size == 4  # a rejoin brings the configured groups back


def test_a_topology_object_cannot_be_adapted_and_the_error_names_it():
    topology = build("butterfly_groups", 4, group_size=4)
    assert WAGMA(topology=topology).for_members(4).topology is topology
    with pytest.raises(ValueError, match=r"^topology: .*built for 4 workers.*3 members"):
        WAGMA(topology=topology).for_members(3)


# ------------------------------------------------------------------------- the simulator


@pytest.mark.parametrize("kind", ["crash", "hang"])
def test_survivors_of_a_crash_or_a_hang_finish_every_step_in_groups_of_3(kind):
    result, calls = _recorded((f"1:3:{kind}",))
    assert result["membership"][-1]["members"] == [0, 2, 3] and result["world_size"] == 3
    assert result["step"] == 6 and math.isfinite(result["eval_loss"])
    assert result["consensus_distance"] == 0  # averaged at the end
    assert [c["group_size"] for c in calls] == [3, 3, 3]


def test_two_crashes_of_8_leave_6_members_in_two_groups_of_3_each_round():
    result, calls = _recorded(("1:2:crash", "5:2:crash"), sim=8, steps=8)
    assert result["membership"][-1]["members"] == [0, 2, 3, 4, 6, 7]
    assert result["step"] == 8 and math.isfinite(result["eval_loss"])
    assert len(calls) == 6 and {c["group_size"] for c in calls} == {3}
    for c in calls:  # two groups per round: each member averages with 2 of the 5 others
        assert any(kind == "group" for _, _, kind, _, _ in c["runtime"].events)
        assert all(len(stamps) == 2 for _, _, kind, stamps, _ in c["runtime"].events
                   if kind == "group")


def test_in_a_run_the_members_start_from_their_exact_average_and_average_only_new_models():
    K = 2  # an exact average of all every 2 rounds
    _, calls = _recorded(("1:3:crash",), steps=8, allreduce_every=K)
    assert len(calls) == 3
    mean = torch.stack([c["before"] for c in calls]).mean(0)
    rounds = {c["round"] for c in calls}
    assert rounds == {max(c["round_before"] for c in calls)}  # one round, the front
    (start,) = rounds
    for c in calls:
        assert torch.allclose(c["after"], mean, atol=1e-6, rtol=0)
        # every partner's model for that round is the average this member holds
        assert sorted(c["stamps"]) == sorted(c["runtime"].partners) and all(
            list(known) == [start] for known in c["stamps"].values())
    schedules = []
    for c in calls:
        events = c["runtime"].events
        assert events and all(q >= start for _, q, _, _, _ in events)
        # nothing published over the old communicator is averaged: only stamps from then on
        assert all(stamp >= start for _, _, kind, stamps, _ in events for stamp in
                   stamps.values())
        assert all((kind == "global") == ((q + 1) % K == 0) for _, q, kind, _, _ in events)
        schedules.append([(q, kind) for _, q, kind, _, _ in events])
    assert schedules[0] == schedules[1] == schedules[2]  # the same rounds on every member


def _train(optimizer, model, steps: int, rank: int) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 3) + rank).pow(2).sum().backward()
        optimizer.step()


def test_a_change_mid_flight_drops_the_old_messages_and_agrees_on_the_front_round():
    # 4 workers with messages in flight; rank 3 is gone; the others are at different rounds
    # (as after a member skipped ahead): they go on over a new communicator
    config = WAGMA(tau=1, allreduce_every=4)

    def worker(comm):
        torch.manual_seed(comm.rank)
        model = torch.nn.Linear(3, 2)
        optimizer = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                        config.resolve(4), comm, broadcast=False)
        runtime = optimizer.runtime
        _train(optimizer, model, 2, comm.rank)
        if comm.rank == 3:
            return None  # (its models of round 2 are in flight to its partners)
        runtime.round += comm.rank  # 2, 3, 4
        new = comm.regroup(comm.rank, (0, 1, 2), "test/1")
        before = runtime.read_parameters()
        runtime.change_membership(new, config.for_members(3))
        after, start = runtime.read_parameters(), runtime.round
        runtime.events = []
        _train(optimizer, model, 5, comm.rank)
        optimizer.finish()
        return before, after, start, runtime.events, runtime.read_parameters(), runtime.round

    results = [r for r in SimWorld(4).run(worker) if r is not None]
    mean = torch.stack([r[0] for r in results]).mean(0)
    assert all(torch.allclose(r[1], mean, atol=1e-6, rtol=0) for r in results)
    assert [r[2] for r in results] == [4, 4, 4]
    for r in results:
        rounds = [q for _, q, _, _, _ in r[3]]
        assert rounds == [4, 5, 6, 7, 8]  # round 7: the exact average of all
        assert all(stamp >= 4 for _, _, _, stamps, _ in r[3] for stamp in stamps.values())
        assert all(len(stamps) == 2 for _, _, kind, stamps, _ in r[3] if kind == "group")
    assert all(torch.equal(r[4], results[0][4]) for r in results)  # finish() averaged
    assert len({r[5] for r in results}) == 1


def test_a_rejoining_worker_takes_a_members_state_and_every_member_ends_the_same():
    # rank 2 failed and rejoins: ranks 0, 1, 3 trained in a group of 3, then it binds over
    # the new communicator of 4, receives rank 0's state and every worker changes membership
    config = WAGMA(tau=1, allreduce_every=0)

    def worker(comm):
        torch.manual_seed(comm.rank)
        model = torch.nn.Linear(3, 2)
        sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        optimizer = runtime = None
        step = 0
        if comm.rank != 2:
            old = comm.regroup([0, 1, 3].index(comm.rank), (0, 1, 3), "test/1")
            optimizer = gossamer.distribute(model, sgd, config.for_members(3), old,
                                            broadcast=False)
            runtime = optimizer.runtime
            _train(optimizer, model, 3, comm.rank)
            runtime.round += comm.rank  # members at different rounds (0 + 3, 1 + 3, 3 + 3)
            runtime.settle()  # what the members do first at a rejoin
            runtime.average_parameters()
            step = runtime.step
        new = comm.regroup(comm.rank, (0, 1, 2, 3), "test/2")
        if comm.rank == 2:  # the restarted worker binds over the members' communicator
            optimizer = gossamer.distribute(model, sgd, config.for_members(4), new,
                                            broadcast=False)
            runtime = optimizer.runtime
        step = share_state(new, 0, model, optimizer, runtime, step, joining=comm.rank == 2)
        runtime.change_membership(new, config.for_members(4))
        state = (runtime.read_parameters(), runtime.round, runtime.step, runtime.partners)
        _train(optimizer, model, 3, comm.rank)
        optimizer.finish()
        return (step, state, runtime.read_parameters(), runtime.round, runtime.group_averages,
                dict(runtime.sent), dict(runtime.taken))

    results = SimWorld(4).run(worker)
    assert [r[0] for r in results] == [3, 3, 3, 3]
    first = results[0][1]
    for rank, r in enumerate(results):
        parameters, round_, step, partners = r[1]
        assert torch.equal(parameters, first[0]) and round_ == 6 and step == 3
        assert partners == sorted(set(range(4)) - {rank})
        assert torch.equal(r[2], results[0][2]) and r[3] == results[0][3]
    assert results[2][4] == results[0][4]  # it took the members' statistics, then averaged
    # every message sent over the new communicator was taken by its receiver (none went to a
    # receive posted twice, or left over from before), but for the closing messages beyond
    # the first (settle() waits for those without counting them)
    pairs = [(i, j) for i in range(4) for j in range(4) if i != j]
    assert all(results[i][5][j] - results[j][6][i] == config.tau for i, j in pairs)
