"""GossipGraD's gradient exchange (gossamer.patterns.pairwise) by itself: the partner ranks it
takes from the schedule, the pairwise average that combine gives, exact and through a
compressor, and the checks of its arguments; in the simulator and on gloo, with the same
results and the same bytes and messages counted in both."""

import pytest
import torch

from gossamer.comm import SimWorld
from gossamer.compress.registry import parse_compression
from gossamer.patterns.pairwise import (
    GradientGossip,
    check_gossip_compression,
    check_local_group_size,
)
from gossamer.testing import collect, run_in_turn, spawn_gloo
from gossamer.topology import GossipGradSchedule

STEPS = 3  # more than a round of 4 nodes (2 steps): the second round's order is reshuffled
SIZES = (5, 3)  # two buffers, as two buckets of one step
SEED = 3


def _gradient(rank: int, step: int, size: int) -> torch.Tensor:
    """Worker ``rank``'s gradient of ``step``: integers, so every mean below is exact."""
    return torch.arange(size, dtype=torch.float64) * (rank + 1) + 16.0 * step - 8.0 * rank


def _partners_of(comm, topology: str, g: int) -> list:
    gossip = GradientGossip(comm, topology=topology, local_group_size=g, seed=SEED)
    return [gossip.partner_ranks(step) for step in range(STEPS)]


@pytest.mark.parametrize(("topology", "world", "g"), [
    ("dissemination", 6, 2), ("dissemination", 5, 1), ("cube", 8, 2), ("cube", 4, 4),
])
def test_gossip_partners_are_the_schedules_nodes_at_the_same_local_index(topology, world, g):
    nodes = world // g
    schedule = GossipGradSchedule(nodes, topology, SEED)
    for rank, partners in enumerate(SimWorld(world).run(_partners_of, topology, g)):
        node, local = divmod(rank, g)
        for step, ranks in enumerate(partners):
            p = schedule.partners(node, step)
            if nodes == 1:
                assert p is None and ranks is None
            else:
                assert ranks == (p.send_to * g + local, p.recv_from * g + local)


def _exact_life(comm, topology: str, g: int) -> list[torch.Tensor]:
    """STEPS combines of fresh gradients in two buffers: what each gave."""
    gossip = GradientGossip(comm, topology=topology, local_group_size=g, seed=SEED)
    combined = []
    for step in range(STEPS):
        buffers = [_gradient(comm.rank, step, size) for size in SIZES]
        gossip.combine(buffers, step)
        combined += buffers
    return combined


def _check_exact(results: list[dict], topology: str, g: int) -> None:
    """Each worker holds the mean of its node's and the partner node's local means."""
    nodes = len(results) // g
    schedule = GossipGradSchedule(nodes, topology, SEED)
    for step in range(STEPS):
        for i, size in enumerate(SIZES):
            means = [sum(_gradient(r, step, size) for r in range(k * g, k * g + g)) / g
                     for k in range(nodes)]
            for rank, r in enumerate(results):
                p = schedule.partners(rank // g, step)
                expected = means[rank // g] if p is None else (
                    (means[rank // g] + means[p.recv_from]) / 2)
                assert torch.equal(r["combined"][step * len(SIZES) + i], expected), (step, rank)


def _compressed_life(comm, topology: str, g: int) -> list[torch.Tensor]:
    """One combine through fp16 with error feedback, as GossipGraD builds it."""
    gossip = GradientGossip(comm, topology=topology, local_group_size=g, seed=SEED)
    compressor, memory = parse_compression("fp16").build(gossip.nodes)
    compressor = compressor.for_worker(gossip.node)
    memory = memory.fresh() if memory is not None else None
    grads = [(f"g{i}", _gradient(comm.rank, 0, size).float().div_(3)) for i, size in
             enumerate(SIZES)]
    gossip.combine_compressed(grads, 0, compressor, memory)
    return [g for _, g in grads]


def _check_compressed(results: list[dict], topology: str, g: int) -> None:
    """The mean of the two nodes' means, each rounded to float16 (what each sent)."""
    nodes = len(results) // g
    schedule = GossipGradSchedule(nodes, topology, SEED)
    for i, size in enumerate(SIZES):
        node_sum = [sum(_gradient(r, 0, size).float().div_(3) for r in range(k * g, k * g + g))
                    for k in range(nodes)]
        sent = [(s / g).half().float() for s in node_sum]
        for rank, r in enumerate(results):
            p = schedule.partners(rank // g, 0)
            expected = (sent[rank // g] + sent[p.recv_from]).mul_(0.5)
            assert torch.equal(r["combined"][i], expected), (i, rank)
    # per worker: the payload's size, then the float16 payload (plus the local mean's traffic)
    assert all(r["bytes"] >= 8 + 2 * sum(SIZES) for r in results)


# each on 4 workers: cube with nodes of 2 (a swap), dissemination over 4 single-worker nodes
# (send to one, receive from another), and the fp16 exchange over nodes of 2
RUNS = [("cube/2", (_exact_life, "cube", 2)),
        ("dissemination/1", (_exact_life, "dissemination", 1)),
        ("fp16", (_compressed_life, "dissemination", 2))]


def _run(comm, life, topology: str, g: int) -> dict:
    """What ``life`` gave, and the bytes and messages it sent (from here: on gloo, the
    communicator has passed a barrier already)."""
    stats = comm.stats
    bytes_before, messages_before = stats.total_bytes_sent, stats.total_messages_sent
    combined = life(comm, topology, g)
    return {"combined": combined, "bytes": stats.total_bytes_sent - bytes_before,
            "messages": stats.total_messages_sent - messages_before}


def _check(key: str, results: list[dict]) -> None:
    life, topology, g = dict(RUNS)[key]
    check = _check_exact if life is _exact_life else _check_compressed
    check(results, topology, g)


def _simulated() -> dict[str, list[dict]]:
    return {key: SimWorld(4).run(_run, *args) for key, args in RUNS}


def test_gossip_combine_gives_the_pairwise_average_in_the_simulator():
    sim = _simulated()
    for key, results in sim.items():
        _check(key, results)
    # without a local group: one model's worth of float64 to one partner per step
    assert all(r["bytes"] == STEPS * 8 * sum(SIZES) for r in sim["dissemination/1"])
    assert all(r["messages"] == STEPS * len(SIZES) for r in sim["dissemination/1"])


def test_a_single_node_gossip_is_its_local_mean():
    _check_exact(SimWorld(2).run(_run, _exact_life, "dissemination", 2), "dissemination", 2)


@pytest.mark.slow
@pytest.mark.gloo
def test_gossip_on_gloo_gives_and_counts_what_the_simulator_does():
    """Backend parity: 4 gloo processes give the same tensors, bit for bit, and send the same
    bytes and messages."""
    results = spawn_gloo(run_in_turn, 4, args=(_run, RUNS), timeout=120)
    for key, sim in _simulated().items():
        real = collect(results, key)
        _check(key, real)
        for mine, theirs in zip(real, sim, strict=True):
            assert (mine["bytes"], mine["messages"]) == (theirs["bytes"], theirs["messages"])
            assert all(torch.equal(a, b) for a, b in zip(mine["combined"], theirs["combined"],
                                                          strict=True)), key


def test_gossip_checks_name_the_argument():
    assert check_local_group_size(2, 8) == 4
    with pytest.raises(ValueError, match="local_group_size=3 does not divide the world size 8"):
        check_local_group_size(3, 8)
    with pytest.raises(ValueError, match="local_group_size"):
        check_local_group_size(0, 8)
    for spec in ("topk:ratio=0.5", "fp16", "qsgd", "randomk:ratio=0.5"):
        check_gossip_compression(parse_compression(spec))
    with pytest.raises(ValueError, match="PowerSGD.* makes 2 collective rounds; gossipgrad "
                                         "takes .*topk"):
        check_gossip_compression(parse_compression("powersgd"))
    with pytest.raises(ValueError, match="'dgc'.*momentum correction"):
        check_gossip_compression(parse_compression("dgc"))
