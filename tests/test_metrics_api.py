"""gossamer.metrics: the consensus distance and the per-worker counts, from a user's own loop."""

import time

import pytest
import torch
import torch.nn.functional as F

import gossamer
from gossamer.comm import ComputeModel, SimWorld
from gossamer.metrics import consensus_distance, snapshot

WORKERS = 4


def _distributed(comm, method="allreduce"):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    method, comm)
    return model, optimizer


def _train(model, optimizer, rank, steps):
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = torch.randn(8, 3, generator=g), torch.randint(2, (8,), generator=g)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def test_consensus_distance_is_the_mean_squared_distance_to_the_average():
    def worker(comm):
        model, optimizer = _distributed(comm)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(comm.rank)  # replica r is r everywhere; the average is 1.5
        return consensus_distance(optimizer), consensus_distance(model, comm)

    results = SimWorld(WORKERS).run(worker)
    numel = 3 * 2 + 2
    expected = numel * sum((r - 1.5) ** 2 for r in range(WORKERS)) / WORKERS
    assert results == [(expected, expected)] * WORKERS


def test_consensus_distance_of_identical_replicas_is_exactly_zero():
    def worker(comm):
        model, optimizer = _distributed(comm)
        _train(model, optimizer, comm.rank, steps=3)  # AllReduce keeps replicas identical
        return consensus_distance(optimizer)

    assert SimWorld(WORKERS).run(worker) == [0.0] * WORKERS


def test_consensus_distance_under_gossip_is_positive_and_the_same_everywhere():
    def worker(comm):
        model, optimizer = _distributed(comm, gossamer.DPSGD())
        _train(model, optimizer, comm.rank, steps=5)
        return consensus_distance(optimizer)

    distances = SimWorld(WORKERS).run(worker)
    assert len(set(distances)) == 1 and distances[0] > 0


def test_consensus_distance_names_a_bad_target():
    with pytest.raises(ValueError, match="comm is needed"):
        consensus_distance(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="target"):
        consensus_distance(object(), comm=None)


def test_snapshot_counts_what_the_communicator_counted_without_communicating():
    world = SimWorld(WORKERS, compute=ComputeModel(step_time=0.01, stragglers={3: 5.0}))

    def worker(comm):
        model, optimizer = _distributed(comm)
        _train(model, optimizer, comm.rank, steps=4)
        before = (comm.stats.total_bytes_sent, comm.clock())
        counts = snapshot(optimizer)
        assert (comm.stats.total_bytes_sent, comm.clock()) == before  # local: no traffic
        return counts, optimizer.runtime.synchronizations, dict(comm.stats.bytes_sent)

    results = world.run(worker)
    for rank, (counts, synchronizations, per_peer) in enumerate(results):
        assert counts["rank"] == rank and counts["world_size"] == WORKERS
        assert counts["bytes_sent_per_peer"] == per_peer
        assert counts["bytes_sent"] == sum(per_peer.values()) > 0
        assert counts["messages_sent"] == sum(counts["messages_sent_per_peer"].values()) > 0
        assert counts["bytes_received"] == sum(counts["bytes_received_per_peer"].values()) > 0
        assert counts["synchronizations"] == synchronizations
        assert counts["skipped_steps"] == 0 and counts["step"] == 4
        assert counts["idle_time"] == world.report.idle_time[rank]
    # the straggler's peers wait for it; the straggler itself hardly waits
    idle = [counts["idle_time"] for counts, _, _ in results]
    assert min(idle[:3]) > 0.1 > idle[3]


def test_snapshot_of_a_communicator_has_no_algorithm_fields():
    def worker(comm):
        return snapshot(comm)

    counts = SimWorld(2).run(worker)[0]
    assert counts["bytes_sent"] == 0 and counts["synchronizations"] is None
    assert counts["idle_time"] == 0.0


def _gloo_idle() -> float:
    comm = gossamer.TorchCommunicator.from_env(backend="gloo")
    try:
        if comm.rank == 1:
            time.sleep(0.5)  # rank 0 waits for it in the all-reduce
        comm.all_reduce(torch.ones(4))
        return snapshot(comm)["idle_time"]
    finally:
        comm.close()


@pytest.mark.slow
@pytest.mark.gloo
def test_torch_communicator_measures_the_time_it_waits():
    from gossamer.testing import spawn_gloo

    idle = spawn_gloo(_gloo_idle, 2)
    assert idle[0] >= 0.4
    assert 0 <= idle[1] < 0.4
