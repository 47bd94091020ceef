"""One simulated worker for all (gossamer.comm.mirror): a symmetric method's prediction equals
the timing-only simulation of every worker, exactly; what is not symmetric is refused."""

from __future__ import annotations

import pytest
import torch

from gossamer.algorithms import available, create
from gossamer.comm import ComputeModel, NetworkModel
from gossamer.comm.mirror import MirrorWorld, NotSymmetric, homogeneous
from gossamer.plan.models import MODELS
from gossamer.plan.predict import predict
from gossamer.train.compare import parse_algorithms

NETWORK = NetworkModel(latency=50e-6, bandwidth="1gbit")
COMPUTE = ComputeModel(step_time=0.01)
DIGITS = MODELS["digits-mlp"][0]
FIELDS = ("step_time", "mean_step_time", "bytes_per_step", "idle_fraction")
#: options that change a symmetric method's pattern: groups, hierarchy, topologies, periods
VARIANTS = ("allreduce:compression=topk:node_size=4,diloco:replica_size=4,localsgd:period=3,"
            "sgp:allreduce_every=2,dpsgd:topology=exponential,gossipgrad:local_group_size=2,"
            "gossipgrad:topology=cube")


def _both(spec, workers=16):
    kwargs = {"network": NETWORK, "compute": COMPUTE, "warmup": 1, "steps": 1}
    one = predict(spec, workers, DIGITS, simulate="one", **kwargs)
    every = predict(spec, workers, DIGITS, simulate="every", **kwargs)
    return one, every


@pytest.mark.slow
@pytest.mark.parametrize("label,spec", parse_algorithms(",".join(available()) + ","
                                                         + VARIANTS))
def test_one_worker_predicts_what_every_worker_does(label, spec):
    """At 16 workers, for every registered method that declares itself symmetric (and the
    variants above): the same step times (slowest and mean), bytes per worker (the mean over
    workers, which one worker's own counters are not: a ring's chunks differ by an element)
    and idle fraction as simulating all 16; a method that is not symmetric is refused."""
    algorithm = (create(spec, None) if isinstance(spec, str) else spec).resolve(16)
    if not algorithm.symmetric():
        with pytest.raises(ValueError, match="needs every worker simulated"):
            predict(spec, 16, DIGITS, network=NETWORK, compute=COMPUTE, simulate="one")
        return
    one, every = _both(spec)
    for field in FIELDS:
        assert getattr(one, field) == pytest.approx(getattr(every, field), rel=1e-12,
                                                    abs=1e-15), field
    assert every.step_time == pytest.approx(every.mean_step_time, rel=1e-12)  # all alike


def test_the_symmetric_methods_are_most_of_them():
    """The declaration matters: the collective and circulant-gossip methods are symmetric,
    Streaming DiLoCo's all-to-all by offset is, NoLoCo's one peer a call (an even number of
    replicas) is, WAGMA's groups whose members send to each
    other are (mirrored as partners, checked as the simulation goes); a synchronous group
    average (WAGMA with tau=0, whose waits depend on each member's place in the senders'
    queues) and AD-PSGD's requests, answered as they come, are not."""
    symmetric = {name for name in available() if create(name, None).resolve(16).symmetric()}
    assert {"allreduce", "dgc", "qsgd", "powersgd", "localsgd", "diloco", "demo", "sparta",
            "sgp", "osgp", "dpsgd", "gossipgrad", "streaming-diloco", "wagma",
            "noloco"} <= symmetric
    assert not symmetric & {"adpsgd"}
    assert create("wagma", None).mirror == "partners"
    for label, spec in parse_algorithms("sgp:topology=complete,dgc:aggregation=sparse_allreduce,"
                                        "wagma:tau=0"):
        assert not spec.resolve(8).symmetric(), label
    assert not create("noloco", None).resolve(15).symmetric()  # a group of three


def test_a_cluster_of_unlike_workers_needs_every_worker():
    assert homogeneous(8, NETWORK, COMPUTE) == ""
    assert homogeneous(8, NETWORK, ComputeModel(stragglers={3: 4.0})) == "stragglers"
    assert homogeneous(8, NETWORK, ComputeModel(jitter=0.1)) == "jitter"
    nodes = NetworkModel(node_size=4, node_bandwidth="100gbit")
    assert homogeneous(8, nodes, COMPUTE) == "nodes with their own links"
    with pytest.raises(ValueError, match="stragglers"):
        MirrorWorld(8, compute=ComputeModel(stragglers={1: 2.0}))
    with pytest.raises(ValueError, match="stragglers"):
        predict("allreduce", 8, DIGITS, network=NETWORK,
                compute=ComputeModel(stragglers={1: 2.0}), simulate="one")
    # auto: every worker, the straggler's pace
    slow = predict("allreduce", 8, DIGITS, network=NETWORK,
                   compute=ComputeModel(step_time=0.01, stragglers={1: 2.0}))
    assert slow.step_time > predict("allreduce", 8, DIGITS, network=NETWORK,
                                    compute=COMPUTE).step_time


def test_a_receive_nothing_mirrors_is_refused():
    """A receive waited for before anything that mirrors it was sent (WAGMA's, AD-PSGD's)
    cannot be stood for; nor one whose call sends to peers that do not mirror it."""
    def waits(comm):
        comm.exchange({}, [1], recv_like=torch.zeros(4)).wait()

    with pytest.raises(NotSymmetric, match="no call of this worker mirrors"):
        MirrorWorld(4).run(waits)

    def unmirrored(comm):
        comm.exchange({1: torch.zeros(4), 2: torch.zeros(4)}, [1], recv_like=torch.zeros(4))

    with pytest.raises(NotSymmetric, match="sent nothing that mirrors"):
        MirrorWorld(4).run(unmirrored)


@pytest.mark.parametrize("workers", [2, 5, 8])
def test_an_all_to_all_posted_first_is_stood_for(workers):
    """Streaming DiLoCo's exchange (receives from every other rank posted first, then the
    sends by offset, twice): the same virtual times as SimWorld's timing-only run of every
    worker, which are every rank's alike."""
    from gossamer.comm import SimWorld
    from gossamer.compress.lowbit import LowBit
    from gossamer.patterns.scattered import ScatteredMean

    def worker(comm):
        mean = ScatteredMean(comm, torch.ones(1000), LowBit("int8"), {}, "x")
        comm.compute_step()
        mean.progress()
        mean.wait()
        return comm.clock()

    network = NetworkModel(latency=1e-3, bandwidth="100mbit")
    one = MirrorWorld(workers, network=network).run(worker)
    every = SimWorld(workers, network=network, timing_only=True).run(worker)
    assert one > 0.002
    assert every == pytest.approx([one] * workers, rel=1e-12)


def test_ten_thousand_workers_cost_one():
    """The prediction's cost does not grow with the workers for a method that does no work
    per member: AllReduce at 10,000 workers of a 1B-parameter model."""
    import time

    started = time.perf_counter()
    found = predict("allreduce", 10_000, MODELS["gpt-1b"][0], network=NETWORK,
                    compute=ComputeModel(step_time=0.5), warmup=1, steps=1)
    assert time.perf_counter() - started < 60
    # the ring's bytes per worker: 2 (n - 1) / n of the 4 GB of gradients (and its flags)
    assert found.bytes_per_step == pytest.approx(2 * 9_999 / 10_000 * 4e9, rel=1e-3)


def test_control_values_follow_the_collectives_as_in_simworld():
    """A value a program wrote (a flag, a count) comes out of a sum, a mean and a gather the
    same in the one-worker simulation as in the timing-only simulation of every worker."""
    def worker(comm):
        total, mean = torch.tensor([2.0]), torch.tensor([3.0, 1.0])
        comm.all_reduce(total, op="sum")
        comm.all_reduce(mean, op="mean")
        parts = comm.all_gather(torch.tensor([5], dtype=torch.int64))
        return float(total), mean.tolist(), [int(p) for p in parts]

    expected = (8.0, [3.0, 1.0], [5, 5, 5, 5])
    assert MirrorWorld(4).run(worker) == expected
    from gossamer.comm import SimWorld
    assert SimWorld(4, timing_only=True).run(worker) == [expected] * 4
