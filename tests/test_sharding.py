"""Sharded models: R replicas x S shards equal R unsharded replicas, step by step.

The proof of :mod:`gossamer.sharding`: on gloo, 2 replicas x 2 shards (4 processes; the
model sharded with FSDP2's ``fully_shard`` over each replica's 2 ranks, the method run on the
local shards across the replicas) give, after every step and after ``finish()``, the
parameters of the unsharded run of 2 replicas in which each replica's batch is the union of
its 2 shard-ranks' batches. The unsharded run is made by the same processes, over the same
replica dimension (ranks 0 and 2 run it, and ranks 1 and 3 the same once more), so that one
start of 4 processes serves the whole file. The loss is a mean over the batch and FSDP2
averages the gradients over the shard ranks, so the gradient is the same mean in both; every
method below is element-wise or per tensor between the replicas, so each shard meets its own
in the other replica. The bytes that a replica's shards send together are the unsharded
replica's, but for the 4 bytes a message of AllReduce (its flag of non-finite gradients) or
push-sum (its weight) adds per shard.

Tolerance: what differs is only the order of float32 additions. A shard-rank sums the loss
over its half of the batch and FSDP's reduce-scatter adds the two halves' gradients, where the
unsharded replica sums the whole batch at once, and the matrix products of the forward and
backward passes are blocked differently for 4 rows than for 8. Each gradient then differs in
its last bits (float32's epsilon is 1.2e-7 relative), which a few steps of momentum SGD carry
into the parameters (magnitude below 1): ``ATOL`` = 1e-6 absolute over 6 steps (6.0e-8
measured, the worst of every method), where the largest change of a parameter in one step is
3e-2 to 5e-2, so a method that mixed the wrong shards, averaged one shard and not the other,
or drew other positions, fails it.

Laid out as 4 replicas of one shard (S = 1: FSDP2 over a mesh of one rank), every float
operation of the sharded path is the plain run's: the parameters are equal exactly, and so are
the bytes the communicator counts.

SPARTA draws its positions over the whole tensors and each shard averages those in its rows,
and Streaming DiLoCo cuts its fragments by the whole tensors' sizes: both are held to the
unsharded run (Streaming DiLoCo in float32). The compressors compress each local shard as a
tensor of its own (top-k of a shard, PowerSGD's matrix of its rows, int4's scale of a shard's
message), and DeMo chunks a shard's rows, which selects or rounds otherwise than the unsharded
run: they are held to running, leaving the replicas identical and sending less than the dense
average.

The model's last layer has one row, so that its second shard is empty: every method takes it.

Also: a sharded model given a communicator that is not the replica dimension (the whole world,
or none), and a method that does not run on shards, are ValueErrors that name them, raised
before any tensor moves.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gossamer
from gossamer.algorithms import (
    DPSGD,
    OSGP,
    QSR,
    SGP,
    SPARTA,
    WAGMA,
    AllReduce,
    DeMo,
    DiLoCo,
    GossipGraD,
    LocalSGD,
    NoLoCo,
    StreamingDiLoCo,
)
from gossamer.patterns.parts import Part, keep_part, mark_part, part_of
from gossamer.testing import spawn_gloo

REPLICAS, SHARDS, STEPS = 2, 2, 6
BATCH = 4  # examples per shard-rank; an unsharded replica takes SHARDS times as many
LR = 0.05
ATOL = 1e-6  # float32 reduction order (module docs)
TIMEOUT = 60.0  # seconds any collective may wait

#: each method of the proof, by name (every one of them runs on local shards)
METHODS = {
    "allreduce": AllReduce(),
    "allreduce-overlap-off": AllReduce(overlap=False, bucket_mb=0.001),
    "localsgd": LocalSGD(period=2, average_at_end=True),
    "qsr": QSR(period=2, alpha=0.1),  # H = (alpha / lr)^2 = 4
    "diloco": DiLoCo(period=2),
    "diloco-groups": DiLoCo(period=3, replica_size=2),
    "sgp": SGP(),
    "osgp": OSGP(tau=1),
    "dpsgd": DPSGD(),
    # fragments cut by the whole tensors' sizes; pseudo-gradients in float32 (int4's scale
    # would be a shard's: below)
    "streaming-diloco": StreamingDiLoCo(period=4, fragments=2, tau=1, precision="float32"),
    # positions drawn over the whole tensors, each shard averaging those in its rows
    "sparta": SPARTA(fraction=0.3),
    "sparta-partitioned": SPARTA(fraction=0.3, selector="partitioned"),
    # the pair's mean and the outer step are element-wise (4 replicas of one shard: pairs
    # drawn among 4)
    "noloco": NoLoCo(period=2),
}
#: compression per local shard: it runs, and the replicas end identical (what it selects or
#: how it scales differs from the unsharded run's, which takes whole tensors: docs/sharding.md)
COMPRESSED = {
    "topk": AllReduce(compression="topk:ratio=0.25"),
    "powersgd": AllReduce(compression="powersgd:rank=1"),
    "streaming-diloco-int4": StreamingDiLoCo(period=4, fragments=2, tau=1),
    "demo": DeMo(compression_topk=4),  # chunks of a shard's rows
}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    # 10, 5 and 1 rows over 2 shards: even, uneven (3 + 2), and one shard empty (1 + 0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 5), nn.Tanh(),
                         nn.Linear(5, 1))


def batch(shard_rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shard-rank ``shard_rank``'s batch at ``step`` (``replica * SHARDS + shard``)."""
    g = torch.Generator().manual_seed(1000 * step + shard_rank)
    x = torch.randn(BATCH, 6, generator=g)
    return x, torch.sin(x[:, :1]) + 0.1 * x[:, 3:4]


def union(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What an unsharded replica trains on: the batches of its SHARDS shard-ranks."""
    parts = [batch(replica * SHARDS + s, step) for s in range(SHARDS)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def shard(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def full(model: nn.Module) -> list[torch.Tensor]:
    """The whole parameters (a sharded model's gathered from its shards)."""
    from gossamer.sharding import is_sharded

    if is_sharded(model):
        return [p.full_tensor().detach().clone() for p in model.parameters()]
    return [p.detach().clone() for p in model.parameters()]


def train(model: nn.Module, algorithm, comm, data) -> dict:
    """``STEPS`` steps of momentum SGD under ``algorithm``; the parameters after each step
    and after ``finish()``, and the bytes the communicator counted."""
    sent = comm.stats.total_bytes_sent  # before this run
    optimizer = gossamer.distribute(
        model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), algorithm, comm,
        total_steps=STEPS)
    steps = []
    for step in range(STEPS):
        x, y = data(step)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        steps.append(full(model))
    optimizer.finish()
    steps.append(full(model))
    return {"steps": steps, "bytes": comm.stats.total_bytes_sent - sent}


def runs_on_four(methods: dict, compressed: dict) -> dict:
    """On each of REPLICAS x SHARDS processes: every method on the sharded model (key
    ``name``), and on the unsharded one over the same replica dimension, each replica training
    on its shard-ranks' union (key ``(name, "unsharded")``: ranks s and SHARDS + s each run
    it, alike); the compressors on the sharded model; then, laid out as 4 replicas of one
    shard, every method through the sharded path and the plain one (keys ``(name, "S=1")``
    and ``(name, "plain")``); and the refusals."""
    from gossamer.sharding import ShardLayout

    results = {}
    with ShardLayout.from_env(shards=SHARDS, timeout=TIMEOUT) as layout:
        rank, replica, comm = layout.world.rank, layout.replica, layout.comm
        for key, algorithm in {**methods, **compressed}.items():
            results[key] = train(shard(make_model(), layout.shard_mesh), algorithm, comm,
                                 lambda step: batch(rank, step))
            if key not in compressed:
                results[key, "unsharded"] = train(make_model(), algorithm, comm,
                                                  lambda step: union(replica, step))
        with ShardLayout.from_env(shards=1, timeout=TIMEOUT) as one:
            for key, algorithm in methods.items():
                results[key, "S=1"] = train(shard(make_model(), one.shard_mesh), algorithm,
                                            one.comm, lambda step: batch(rank, step))
                results[key, "plain"] = train(make_model(), algorithm, one.comm,
                                              lambda step: batch(rank, step))
        results["refusals"] = refusals(layout)
    return results


def refusals(layout) -> dict[str, str]:
    """The messages of what distribute() refuses on a sharded model (raised before any
    collective, so every rank raises alone)."""
    messages = {}
    cases = {
        "whole world": (AllReduce(), layout.world),
        "no comm": (AllReduce(), None),
        "wagma": (WAGMA(), layout.comm),
        "gossipgrad": (GossipGraD(), layout.comm),
        "dgc": (AllReduce(compression="dgc"), layout.comm),
        "optimizer state": (LocalSGD(average_optimizer_state=True), layout.comm),
    }
    for key, (algorithm, comm) in cases.items():
        model = shard(make_model(), layout.shard_mesh)
        try:
            gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=LR), algorithm,
                                comm)
        except ValueError as error:
            messages[key] = str(error)
        else:
            messages[key] = "(no error)"
    return messages


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return spawn_gloo(runs_on_four, REPLICAS * SHARDS, args=(METHODS, COMPRESSED),
                      timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(METHODS))
def test_sharded_equals_unsharded_step_by_step(runs, name):
    for rank, result in enumerate(runs):
        reference = result[name, "unsharded"]["steps"]
        for step, (got, want) in enumerate(zip(result[name]["steps"], reference, strict=True)):
            for i, (a, b) in enumerate(zip(got, want, strict=True)):
                torch.testing.assert_close(
                    a, b, rtol=0, atol=ATOL,
                    msg=lambda m, rank=rank, step=step, i=i: (
                        f"{name}: rank {rank}, step {step + 1}, parameter {i}: {m}"))
    # the same arithmetic on the replica dimension: a replica's shards together send what
    # the unsharded replica sends, but for what each message adds of its own (AllReduce's
    # flag of non-finite gradients, push-sum's weight): at most 4 bytes a step per shard
    for replica in range(REPLICAS):
        ranks = range(replica * SHARDS, (replica + 1) * SHARDS)
        together = sum(runs[r][name]["bytes"] for r in ranks)
        alone = runs[replica * SHARDS][name, "unsharded"]["bytes"]
        assert alone <= together <= alone + 4 * SHARDS * STEPS, (name, together, alone)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(METHODS))
def test_one_shard_per_replica_is_the_unsharded_run_exactly(runs, name):
    for rank, result in enumerate(runs):
        for got, want in zip(result[name, "S=1"]["steps"], result[name, "plain"]["steps"],
                             strict=True):
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b), (name, rank)
        assert result[name, "S=1"]["bytes"] == result[name, "plain"]["bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMPRESSED))
def test_compressors_run_per_local_shard(runs, name):
    for s in range(SHARDS):  # AllReduce keeps the replicas identical, compressed too
        for replica in range(1, REPLICAS):
            for a, b in zip(runs[s][name]["steps"][-1],
                            runs[replica * SHARDS + s][name]["steps"][-1], strict=True):
                assert torch.equal(a, b)
    for rank, result in enumerate(runs):
        assert result[name]["bytes"] < result["allreduce"]["bytes"], (name, rank)
        first, last = result[name]["steps"][0], result[name]["steps"][-1]
        assert not torch.equal(first[0], last[0])  # it trained


@pytest.mark.slow
def test_the_wrong_communicator_and_a_refused_method_are_value_errors(runs):
    messages = runs[0]["refusals"]
    assert "comm: it spans ranks [0, 1]" in messages["whole world"]
    assert "ShardLayout.from_env(shards=S).comm" in messages["whole world"]
    assert "comm: none given" in messages["no comm"]
    assert messages["wagma"].startswith("algorithm: wagma does not run on a model sharded")
    assert "asynchronous" in messages["wagma"]
    assert messages["gossipgrad"].startswith("algorithm: gossipgrad does not run")
    assert "DGC's memory" in messages["dgc"]
    assert "average_optimizer_state" in messages["optimizer state"]
    assert not any("DTensor" in m and "mixed" in m for m in messages.values())


def test_a_part_keeps_the_positions_of_the_whole_that_fall_in_it():
    whole = torch.arange(20.0).view(5, 4)
    rows = whole[2:4]  # a shard of rows 2 and 3: flat positions 8 to 15 of the whole
    mark_part(rows, numel=whole.numel(), start=8)
    assert part_of(rows) == Part(20, 8)
    positions = torch.tensor([0, 8, 9, 15, 16, 12])
    kept = keep_part(rows, positions)
    assert kept.tolist() == [0, 1, 7, 4]
    assert rows.reshape(-1)[kept].tolist() == [8.0, 9.0, 15.0, 12.0]  # the whole's values
    alone = torch.zeros(3)  # never marked: a whole of its own, every position kept
    assert part_of(alone) == Part(3, 0) and keep_part(alone, positions) is positions
    with pytest.raises(ValueError, match="start"):
        mark_part(rows, numel=10, start=4)


def test_the_layout_needs_a_number_of_shards():
    from gossamer.sharding import ShardLayout

    with pytest.raises(ValueError, match="shards"):
        ShardLayout.from_env(shards=0)
