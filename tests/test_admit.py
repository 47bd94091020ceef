"""Restarted workers rejoining the members (``on_failure="continue"``, ``gossamer train``).

The members average exactly over themselves (DiLoCo: the outer step of the round so far), one
of them gives its state to every worker, old and new, and every worker then rebuilds what
depends on the ranks with ``Runtime.rejoin``, which averages no second time: a rejoin is one
synchronisation, and for DiLoCo one outer step, as in the paper's Algorithm 1 (a second one,
on a pseudo-gradient of zero, would still move the parameters by the outer momentum). A crash
(``change_membership``, no average before it) still makes its outer step.

Against the oracles (``tests/oracles/``): the members' run up to the rejoin is the oracle's
run of that many steps on as many workers, whose last round is cut to end there.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from oracles import diloco as oracle
from oracles import local_sgd as local_oracle
from test_oracle_local_sgd import DIM, LRS, STEPS, X0, _data, _grad
from torch import nn

import gossamer
from gossamer.algorithms import LocalSGD
from gossamer.algorithms.diloco import DiLoCo
from gossamer.algorithms.dpsgd import DPSGD
from gossamer.algorithms.gossip import GossipRuntime
from gossamer.comm import SimWorld
from gossamer.comm.membership import _PREFIX, REJOIN_EVERY, Membership, _SimStore
from gossamer.train.config import TrainConfig
from gossamer.train.data import load_dataset
from gossamer.train.elastic import share_state
from gossamer.train.loop import train_worker

ATOL = 1e-6
MEMBERS = (0, 1, 3)  # rank 2 failed before the first step; it rejoins after BEFORE steps
BEFORE = REJOIN_EVERY  # steps the members train alone: the training loop's first look


def _model() -> nn.Linear:
    model = nn.Linear(DIM, 1, dtype=torch.float64)
    with torch.no_grad():
        model.weight.copy_(X0[:DIM].view(1, DIM))
        model.bias.copy_(X0[DIM:])
    return model


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def _train(optimizer, model: nn.Module, data: int, steps: range) -> None:
    """Steps ``steps`` on the oracle's data of worker ``data``, at the oracle's rates."""
    for k in steps:
        for group in optimizer.param_groups:
            group["lr"] = LRS[k]
        a, b = _data(data, k)
        optimizer.zero_grad()
        (0.5 * (model(a).squeeze(1) - b).pow(2).mean()).backward()
        optimizer.step()


def _rejoin(algorithm, after: int = 0) -> list[dict]:
    """Ranks 0, 1 and 3 train BEFORE steps (on the data of the oracle's workers 0, 1, 2);
    then rank 2 rejoins as the training loop's admit() has it, and all four train ``after``
    steps. What each worker held at each point."""

    def worker(comm):
        model = _model()
        inner = torch.optim.SGD(model.parameters(), lr=LRS[0], momentum=0.9)
        record: dict = {}
        if comm.rank in MEMBERS:
            old = comm.regroup(MEMBERS.index(comm.rank), MEMBERS, "test/1")
            optimizer = gossamer.distribute(model, inner, algorithm, old, total_steps=STEPS)
            runtime = optimizer.runtime
            _train(optimizer, model, old.rank, range(BEFORE))
            record["trained"] = runtime.synchronizations
            runtime.settle()
            runtime.average_parameters()
            record["averaged"] = (_flat(model), runtime.synchronizations)
        new = comm.regroup(comm.rank, (0, 1, 2, 3), "test/2")
        if comm.rank == 2:  # restarted: its runtime is made over the new communicator
            optimizer = gossamer.distribute(model, inner, algorithm, new, broadcast=False,
                                            total_steps=STEPS)
            runtime = optimizer.runtime
        step = share_state(new, 0, model, optimizer, runtime, BEFORE, joining=comm.rank == 2)
        runtime.rejoin(new, algorithm.for_members(4))
        record["rejoined"] = (_flat(model), runtime.synchronizations, step, runtime.step)
        _train(optimizer, model, new.rank, range(BEFORE, BEFORE + after))
        record["after"] = (_flat(model), runtime.synchronizations, list(runtime.periods))
        return record

    return SimWorld(4).run(worker)


def _check_one_synchronization(results: list[dict], expected: local_oracle.Run,
                               syncs_before: int) -> None:
    """The members' average is the oracle's last step; the rejoin changes nothing of it and
    counts no synchronisation of its own, on every worker."""
    source = results[0]["averaged"][0]
    for rank in MEMBERS:
        r = results[rank]
        assert r["trained"] == syncs_before
        for i, want in enumerate(expected.trajectory[-1]):
            assert (r["averaged"][0] - want).abs().max().item() <= ATOL, (rank, i)
        assert r["averaged"][1] == len(expected.syncs)
    for r in results:
        parameters, syncs, step, runtime_step = r["rejoined"]
        assert torch.equal(parameters, source)  # not moved by a second outer step
        assert syncs == len(expected.syncs) and step == runtime_step == BEFORE


def test_a_diloco_rejoin_mid_round_makes_one_outer_step():
    # the round that started at step 8 ends at the rejoin, after 2 of its 4 steps, with the
    # outer step over the members' pseudo-gradients; the next round starts at the rejoin
    results = _rejoin(DiLoCo(period=4), after=4)
    expected = oracle.diloco(X0, 3, _grad, LRS[:BEFORE], local_oracle.constant_period(4),
                             momentum=0.9)
    assert expected.syncs == [3, 7, 9]
    _check_one_synchronization(results, expected, syncs_before=2)
    for r in results:  # one round of 4 over the four workers, from the rejoin on
        parameters, syncs, periods = r["after"]
        assert periods[-1] == (BEFORE, 4) and syncs == 4
        assert torch.equal(parameters, results[0]["after"][0])


def test_a_diloco_rejoin_after_a_round_ended_makes_no_outer_step():
    # the round of steps 5..9 ended with its outer step: the members hold the global
    # parameters, and neither the average nor the rejoin steps again (the pseudo-gradient is 0)
    results = _rejoin(DiLoCo(period=5))
    expected = oracle.diloco(X0, 3, _grad, LRS[:BEFORE], local_oracle.constant_period(5),
                             momentum=0.9)
    assert expected.syncs == [4, 9]
    _check_one_synchronization(results, expected, syncs_before=2)


def test_a_diloco_rejoin_rebuilds_the_compression_for_every_worker():
    results = _rejoin(DiLoCo(period=4, compression="fp16"), after=4)
    for r in results:
        assert r["rejoined"][1] == 3  # the members' outer step, and no other
        parameters, syncs, periods = r["after"]
        assert periods[-1] == (BEFORE, 4) and syncs == 4
        assert torch.equal(parameters, results[0]["after"][0])


def test_a_local_sgd_rejoin_averages_once():
    results = _rejoin(LocalSGD(period=4), after=4)
    expected = local_oracle.local_sgd(X0, 3, _grad, LRS[:BEFORE],
                                      local_oracle.constant_period(4), cap_to_end=True,
                                      momentum=0.9)
    assert expected.syncs == [3, 7, 9]
    _check_one_synchronization(results, expected, syncs_before=2)
    for r in results:
        parameters, syncs, periods = r["after"]
        assert periods[-1] == (BEFORE, 4) and syncs == 4
        assert torch.equal(parameters, results[0]["after"][0])


def test_a_diloco_crash_still_makes_its_outer_step():
    # the survivors change membership without an average before it: the outer step of the
    # round so far is theirs to make
    def worker(comm):
        if comm.rank not in MEMBERS:
            return None
        model = _model()
        inner = torch.optim.SGD(model.parameters(), lr=LRS[0], momentum=0.9)
        old = comm.regroup(MEMBERS.index(comm.rank), MEMBERS, "test/1")
        optimizer = gossamer.distribute(model, inner, DiLoCo(period=4), old, total_steps=STEPS)
        _train(optimizer, model, old.rank, range(BEFORE))
        survivors = old.regroup(old.rank, MEMBERS, "test/2")
        optimizer.runtime.change_membership(survivors, DiLoCo(period=4).for_members(3))
        return _flat(model), optimizer.runtime.synchronizations

    expected = oracle.diloco(X0, 3, _grad, LRS[:BEFORE], local_oracle.constant_period(4),
                             momentum=0.9)
    results = SimWorld(4).run(worker)
    for rank in MEMBERS:
        parameters, syncs = results[rank]
        assert syncs == len(expected.syncs) == 3
        assert (parameters - expected.trajectory[-1][0]).abs().max().item() <= ATOL


def _crash_after_an_outer_step(missed: bool) -> list:
    """Three workers train a round of 4 steps and its outer step; rank 1 is then stuck (in
    the failure's all-reduce) while ranks 0 and 2 train 2 more steps; the survivors change
    membership at step 6. ``missed``: the outer step's result never reached rank 1."""

    def worker(comm):
        model = _model()
        inner = torch.optim.SGD(model.parameters(), lr=LRS[0], momentum=0.9)
        optimizer = gossamer.distribute(model, inner, DiLoCo(period=4), comm, total_steps=STEPS)
        runtime = optimizer.runtime
        _train(optimizer, model, comm.rank, range(3))
        saved = (copy.deepcopy(runtime.state_dict()), _flat(model))
        _train(optimizer, model, comm.rank, range(3, 4))  # the outer step
        if comm.rank == 1 and missed:
            runtime.load_state_dict(saved[0])
            torch.nn.utils.vector_to_parameters(saved[1], model.parameters())
        if comm.rank != 1:
            _train(optimizer, model, comm.rank, range(4, 6))
        runtime.step = 6  # the step the survivors agreed on
        survivors = comm.regroup(comm.rank, (0, 1, 2), "test/2")
        runtime.change_membership(survivors, DiLoCo(period=4).for_members(3))
        outer = runtime.outer
        momentum = [outer.optimizer.state[g]["momentum_buffer"] for g in outer.global_params]
        return (_flat(model), torch.cat([g.detach().flatten() for g in outer.global_params]),
                torch.cat([m.flatten() for m in momentum]), runtime.synchronizations)

    return SimWorld(3).run(worker)


def test_a_diloco_member_that_missed_the_outer_step_goes_on_as_if_it_had_taken_it():
    # a failure during an outer step's all-reduce: ranks 0 and 2 took the step in, rank 1
    # never got its result. Its pseudo-gradient was in it: the survivors take the global
    # parameters and outer state of the members that have them, and end as if rank 1 had
    # taken the step in (its pseudo-gradient since: zero)
    missed, taken = _crash_after_an_outer_step(True), _crash_after_an_outer_step(False)
    for got, want in zip(missed, taken, strict=True):
        for a, b in zip(got[:3], want[:3], strict=True):
            assert torch.equal(a, b)
        assert got[3] == want[3] == 2
    for r in missed:  # one state on every member
        assert all(torch.equal(a, b) for a, b in zip(r[:3], missed[0][:3], strict=True))


def test_rejoin_defaults_to_change_membership():
    # the exact-average methods: an average of identical replicas leaves them identical
    algorithm = DPSGD()
    with mock.patch.object(GossipRuntime, "change_membership") as change:

        def worker(comm):
            model = _model()
            optimizer = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                            algorithm, comm)
            optimizer.runtime.rejoin(comm, algorithm)

        SimWorld(2).run(worker)
    assert change.call_count == 2
    assert all(call.args[1] is algorithm for call in change.call_args_list)


def test_a_rejoin_of_an_exact_average_method_counts_no_synchronization():
    # the members' average counted the rejoin's synchronisation; change_membership's average
    # of the identical replicas is not a second one, and leaves them identical
    algorithm = DPSGD()

    def worker(comm):
        model = _model()
        optimizer = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                        algorithm, comm)
        runtime = optimizer.runtime
        _train(optimizer, model, comm.rank, range(3))
        runtime.average_parameters()
        before = runtime.synchronizations
        runtime.rejoin(comm, algorithm)
        return before, runtime.synchronizations, _flat(model)

    results = SimWorld(4).run(worker)
    assert all(after == before for before, after, _ in results)
    assert all(torch.equal(r[2], results[0][2]) for r in results)


# ------------------------------------------------------------ through gossamer train's loop


def _train_with_a_rejoin(algorithm, steps: int = 2 * REJOIN_EVERY) -> list[dict]:
    """``train_worker`` under on_failure="continue": rank 2 failed before the first step and
    asks to rejoin; the members let it in at their first look (after REJOIN_EVERY steps).
    Each worker's summary (rank 0's has the metrics)."""
    config = TrainConfig(algorithm=algorithm, steps=steps, eval_every=0, quiet=True,
                         on_failure="continue", batch_size=16)
    dataset = load_dataset("digits", seed=0)
    history = [{"step": 0, "members": list(MEMBERS)},
               {"step": REJOIN_EVERY, "members": [0, 1, 2, 3]}]

    def worker(comm):
        if comm.rank == 2:  # restarted: it asked to rejoin, and meets the members' epoch 2
            _SimStore(comm).set("rejoin/2", "waiting")
            new = comm.regroup(2, (0, 1, 2, 3), f"{_PREFIX}/2")
            membership = Membership(new)
            membership.me, membership.size, membership.epoch = 2, 4, 2
            membership.joined_at, membership.history = REJOIN_EVERY, history
            return train_worker(new, config, dataset, membership=membership)
        old = comm.regroup(MEMBERS.index(comm.rank), MEMBERS, f"{_PREFIX}/1")
        membership = Membership(old)
        membership.me, membership.size, membership.members = comm.rank, 4, MEMBERS
        membership.epoch, membership.history = 1, history[:1]
        return train_worker(old, config, dataset, membership=membership)

    return SimWorld(4, timeout=600.0).run(worker)


@pytest.mark.parametrize(("period", "outer_steps"), [
    (4, 6),  # rounds end at steps 3, 7; the rejoin's at 9; then 13, 17 and the cut 19
    (5, 4),  # rounds end at steps 4, 9 (the rejoin makes none), 14, 19
])
def test_gossamer_train_makes_one_outer_step_per_round_across_a_rejoin(period, outer_steps):
    summary = _train_with_a_rejoin(DiLoCo(period=period))[0]  # rank 0's, with the metrics
    assert summary["membership"][-1] == {"step": REJOIN_EVERY, "members": [0, 1, 2, 3]}
    # the examples of 3 members, then of 4 (not 4 workers' for every step)
    assert summary["examples_per_second"] * summary["wall_clock"] == pytest.approx(
        16 * (3 + 4) * REJOIN_EVERY, rel=1e-12)
    assert summary["synchronizations"] == outer_steps
    assert summary["consensus_distance"] == 0  # every worker ends at the same model
