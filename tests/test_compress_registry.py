"""The compressor registry: specs that round-trip, errors that name the argument, and every
compressor composed by name with allreduce and gossipgrad."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_compress import _Net
from test_compress import _train as train
from torch import nn

from gossamer.algorithms import (
    DGC,
    SGP,
    AllReduce,
    FP16AllReduce,
    GossipGraD,
    PowerSGDAllReduce,
    QSGDAllReduce,
    RandomKAllReduce,
    TopKAllReduce,
    create,
    describe,
    lookup,
    with_compression,
)
from gossamer.algorithms.registry import describe_help
from gossamer.comm import SimWorld
from gossamer.compress import (
    DGCCompressor,
    DGCMemory,
    ErrorFeedback,
    TopK,
    available_compressors,
    lookup_compression,
    parse_compression,
)
from gossamer.compress.registry import DGCCompression, TopKCompression
from gossamer.hooks import CompressionState, DGCState, TopKState
from gossamer.options import option_help
from gossamer.train.config import resolve_algorithm

ALIASES = [DGC, TopKAllReduce, RandomKAllReduce, QSGDAllReduce, PowerSGDAllReduce,
           FP16AllReduce]
# a spec per compressor that sets options away from their defaults
SPECS = ["dgc:ratio=0.05:warmup_steps=3:clip_norm=2.0:fp16_values=false",
         "topk:ratio=0.05:fp16_values=true", "randomk:ratio=0.25:seed=3",
         "qsgd:levels=7:bucket_size=32:error_feedback=true", "powersgd:rank=1:warm_start=false",
         "fp16:dtype=bfloat16"]


def test_every_compressor_has_a_preset_of_its_name():
    assert available_compressors() == sorted(preset.name for preset in ALIASES)
    for preset in ALIASES:
        entry = lookup_compression(preset.name)
        assert lookup(preset.name) is preset and not isinstance(preset, type)  # no class
        # the preset offers the entry's options, with the same defaults and help
        rows = {row[0]: (row[2], row[3]) for row in describe_help(preset.name)}
        assert {k: rows[k][1] for k in option_help(entry)} == option_help(entry)
        assert all(rows[f.name][0] == f.default for f in dataclasses.fields(entry))
        # and builds AllReduce with it: the same object as by the compressor's spec
        built = preset()
        assert type(built) is AllReduce and built == AllReduce(compression=entry())
        assert create(preset.name) == built and built.label == preset.name
        assert create(preset.name, {"bucket_mb": "5"}) == AllReduce(compression=entry(),
                                                                    bucket_mb=5.0)
    with pytest.raises(ValueError, match="algorithm 'topk' has no option 'rank'; its options: "
                                         "aggregation, bucket_mb, error_feedback"):
        create("topk", {"rank": "2"})
    with pytest.raises(ValueError, match="ratio must be in"):
        create("topk", {"ratio": "0"})


# ------------------------------------------------------------------------ specs


@pytest.mark.parametrize("spec", SPECS)
def test_str_and_as_dict_parse_back(spec):
    c = parse_compression(spec)
    assert parse_compression(str(c)) == c
    assert parse_compression(c.as_dict()) == c
    assert parse_compression(c) is c
    assert c != type(c)()  # the spec set something
    assert str(type(c)()) == c.name  # defaults are left out of the spec


def test_spec_converts_values_to_the_options_types():
    c = parse_compression(" dgc : ratio=1e-3 : clip_norm=none : momentum_masking=off ")
    assert c == DGCCompression(ratio=0.001, clip_norm=None, momentum_masking=False)
    assert parse_compression({"name": "topk", "ratio": 0.5}) == TopKCompression(ratio=0.5)
    assert parse_compression({"name": "topk", "ratio": "0.5"}) == TopKCompression(ratio=0.5)
    assert str(DGCCompression(ratio=0.01, clip_norm=2.0)) == "dgc:ratio=0.01:clip_norm=2.0"
    assert DGCCompression().as_dict()["ratio"] == 0.001  # every option, for a record


def test_unknown_names_and_options_are_named_with_the_known_ones():
    with pytest.raises(ValueError, match="compressor 'zip' is unknown; known compressors: "
                                         "dgc, fp16, powersgd, qsgd, randomk, topk"):
        parse_compression("zip:ratio=0.1")
    with pytest.raises(ValueError, match="compressor 'topk' has no option 'rato'; its options: "
                                         "error_feedback, fp16_values, ratio"):
        parse_compression("topk:rato=0.1")
    with pytest.raises(ValueError, match="'ratio' is not KEY=VALUE"):
        parse_compression("topk:ratio")
    with pytest.raises(ValueError, match="a mapping needs a 'name'"):
        parse_compression({"ratio": 0.1})
    with pytest.raises(ValueError, match="compressor 'topk': ratio must be in"):
        parse_compression("topk:ratio=0")
    with pytest.raises(ValueError, match="option levels='seven' of compressor 'qsgd' is not"):
        parse_compression("qsgd:levels=seven")
    with pytest.raises(ValueError, match="compressor must be a spec"):
        parse_compression(3)
    with pytest.raises(ValueError, match="rank must be an int >= 1"):
        lookup_compression("powersgd")(rank=0)


def test_with_compression_names_the_argument_and_the_methods_that_take_it():
    with pytest.raises(ValueError, match="compressor: algorithm 'sgp' does not take a "
                                         "compressor; the methods that do: allreduce, "
                                         "diloco, gossipgrad"):
        with_compression(SGP(), "topk")
    with pytest.raises(ValueError, match="compressor: algorithm 'dgc' is allreduce with dgc's "
                                         "compressor already"):
        resolve_algorithm("dgc", compressor="topk")
    with pytest.raises(ValueError, match="compression 'powersgd' cannot go through "
                                         "gossipgrad's.*gossipgrad takes fp16, qsgd, randomk, "
                                         "topk"):
        with_compression(GossipGraD(), "powersgd")
    with pytest.raises(ValueError, match="compression 'dgc' cannot go through gossipgrad"):
        GossipGraD(compression="dgc")
    with pytest.raises(ValueError, match="compression: AllReduce is an algorithm"):
        AllReduce(compression=DGC())
    with pytest.raises(ValueError, match="compression: give either"):
        AllReduce(compression="topk", compressor=TopK())
    with pytest.raises(ValueError, match="aggregation='allreduce' cannot carry TopK's"):
        AllReduce(compression="topk", aggregation="allreduce")


def test_with_compression_keeps_the_other_options():
    algorithm = with_compression(AllReduce(bucket_mb=10), "dgc:ratio=0.01")
    assert algorithm == AllReduce(bucket_mb=10, compression=DGCCompression(ratio=0.01))
    assert with_compression(algorithm, "topk").compression == TopKCompression()  # replaced
    gossip = with_compression(GossipGraD(topology="cube"), {"name": "qsgd", "levels": 7})
    assert gossip.topology == "cube" and gossip.compression.levels == 7
    # the same by option, as the command line's --option and recipes give it
    assert create("allreduce", {"bucket_mb": "10", "compression": "dgc:ratio=0.01"}) == \
        algorithm
    assert create("gossipgrad", {"topology": "cube", "compression": {"name": "qsgd",
                                                                     "levels": 7}}) == gossip
    assert any(row[0] == "compression" for row in describe("allreduce"))


def test_build_gives_what_the_aliases_gave():
    compressor, memory = parse_compression("dgc:ratio=0.01:clip_norm=2.0").build(4)
    assert compressor == DGCCompressor(ratio=0.01)
    # the global threshold times workers ** 0.5: the paper clips a worker's share g / n at
    # the threshold times n ** -0.5 (Algorithm 1, Section 3.2)
    assert memory == DGCMemory(clip_norm=4.0)
    assert parse_compression("topk").build(4)[1] == ErrorFeedback()
    assert parse_compression("topk:error_feedback=false").build(4)[1] is None
    assert parse_compression("qsgd").build(4)[1] is None
    built = DGC(ratio=0.01, clip_norm=2.0, node_size=2, bucket_mb=5)
    # nodes of 2: the memory holds a node's mean, one of 2 averaged between the nodes
    assert (*built.compressor_and_memory(4), built.node_size, built.bucket_mb) == (
        compressor, DGCMemory(clip_norm=2.0 * 2 ** 0.5), 2, 5)


# ------------------------------------------------------------------------ in the simulator


def _train(comm, algorithm, steps: int = 4):
    """Each worker's parameters after ``steps`` steps (test_compress's task), and its bytes."""
    params, _ = train(comm, algorithm, steps)
    return params, comm.stats.total_bytes_sent


def _same(a, b) -> bool:
    return all(torch.equal(a[r][0][name], b[r][0][name]) for r in range(len(a))
               for name in a[r][0])


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.split(":")[0])
def test_compressor_by_name_with_allreduce_is_its_alias_bit_for_bit(spec):
    compression = parse_compression(spec)
    alias = create(compression.name, compression.options() | {"bucket_mb": 0.001})
    by_name = with_compression(AllReduce(bucket_mb=0.001), spec)
    a = SimWorld(4).run(lambda comm: _train(comm, alias))
    b = SimWorld(4).run(lambda comm: _train(comm, by_name))
    assert _same(a, b)
    assert [bytes_ for _, bytes_ in a] == [bytes_ for _, bytes_ in b]
    assert not torch.equal(a[0][0]["first.weight"], _initial_weight())  # it trained


def _initial_weight() -> torch.Tensor:
    return _Net(reverse=False).first.weight.detach()


@pytest.mark.parametrize("spec", ["topk:ratio=1.0", "topk:ratio=1.0:error_feedback=false",
                                  "randomk:ratio=1.0"])
def test_full_density_by_name_is_allreduce_exactly(spec):
    exact = SimWorld(4).run(lambda comm: _train(comm, AllReduce()))
    compressed = SimWorld(4).run(lambda comm: _train(comm, AllReduce(compression=spec)))
    assert _same(exact, compressed)


@pytest.mark.parametrize("topology,local_group_size",
                         [("dissemination", 1), ("cube", 1), ("cube", 2)])
@pytest.mark.parametrize("spec", ["topk:ratio=1.0", "randomk:ratio=1.0"])
def test_gossipgrad_at_full_density_is_gossipgrad_exactly(spec, topology, local_group_size):
    config = GossipGraD(topology=topology, local_group_size=local_group_size,
                        average_at_end=False)
    exact = SimWorld(4).run(lambda comm: _train(comm, config))
    compressed = SimWorld(4).run(lambda comm: _train(
        comm, with_compression(config, spec)))
    assert _same(exact, compressed)
    assert not torch.equal(compressed[0][0]["first.weight"], _initial_weight())  # it trained


@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "qsgd:levels=3", "fp16",
                                  "randomk:ratio=0.2"])
def test_gossipgrad_compressed_pairs_agree_and_send_fewer_bytes(spec):
    """On CUBE the partners average the same two sent gradients: a node pair stays equal
    bit for bit; and fewer bytes travel than with exact gradients."""
    config = GossipGraD(topology="cube", average_at_end=False)
    exact = SimWorld(2).run(lambda comm: _train(comm, config))
    compressed = SimWorld(2).run(lambda comm: _train(comm, with_compression(config, spec)))
    assert _same([compressed[0]], [compressed[1]])
    assert not _same(exact, compressed)
    assert compressed[0][1] < 0.6 * exact[0][1]


def test_gossipgrad_error_feedback_keeps_what_was_not_sent():
    """After a step the residual is what the compensated gradient did not send, and the
    memory is saved and restored with the runtime."""
    def worker(comm):
        config = GossipGraD(compression="topk:ratio=0.1", average_at_end=False)
        torch.manual_seed(0)
        model = nn.Linear(20, 5)
        runtime = config.bind(comm, model, torch.optim.SGD(model.parameters(), lr=0.1))
        grad = torch.randn(5, 20, generator=torch.Generator().manual_seed(comm.rank))
        model.weight.grad, model.bias.grad = grad.clone(), torch.zeros(5)
        runtime.after_backward()
        residual = runtime.memory.residual("weight")
        kept = residual != 0
        assert int(kept.sum()) == 100 - 10  # all but the top 10% stay
        assert torch.equal(residual[kept], grad[kept])
        restored = config.bind(comm, model, torch.optim.SGD(model.parameters(), lr=0.1))
        restored.load_state_dict(runtime.state_dict())
        assert torch.equal(restored.memory.residual("weight"), residual)

    SimWorld(2).run(worker)


def test_nonfinite_gradient_is_never_kept_by_gossipgrad_memory():
    def worker(comm):
        config = GossipGraD(compression="topk:ratio=0.5", average_at_end=False)
        model = nn.Linear(4, 2)
        runtime = config.bind(comm, model, torch.optim.SGD(model.parameters(), lr=0.1))
        runtime.nonfinite = "skip"
        model.weight.grad = torch.full((2, 4), float("nan") if comm.rank == 0 else 1.0)
        model.bias.grad = torch.ones(2)
        runtime.after_backward()
        assert torch.isfinite(runtime.memory.residual("weight")).all()
        return runtime.skipped_steps

    assert SimWorld(2).run(worker) == [1, 0]


# ------------------------------------------------------------------------ DDP hook states


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))


def test_one_hook_state_serves_every_compressor():
    def worker(comm):
        for spec in SPECS:
            compression = parse_compression(spec)
            state = CompressionState(_model(), spec, comm=comm)
            compressor, memory = compression.build(comm.world_size)
            assert state.reducer.compressor == compressor
            if isinstance(memory, DGCMemory):  # no optimizer: momentum= (0) applies
                memory = dataclasses.replace(memory, momentum=0.0)
            assert state.reducer.memory == memory
        # the aliases are the same state, their options as keywords
        assert TopKState(_model(), ratio=0.05, comm=comm).reducer.compressor == TopK(ratio=0.05)
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
        state = DGCState(model, ratio=0.05, clip_norm=2.0, optimizer=optimizer, comm=comm)
        assert state.reducer.memory == DGCMemory(momentum=0.9, clip_norm=2.0 * 2 ** 0.5)
        assert set(state.weight_decay.values()) == {0.1}
        # an optimizer is left alone by memories without momentum correction
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        CompressionState(model, "topk", optimizer=optimizer, comm=comm)
        assert optimizer.param_groups[0]["momentum"] == 0.9
        with pytest.raises(ValueError, match="momentum: only a memory with momentum"):
            CompressionState(model, "topk", momentum=0.9, comm=comm)
        with pytest.raises(ValueError, match="memory: a registered compressor brings its own"):
            CompressionState(model, "topk", ErrorFeedback(), comm=comm)
        with pytest.raises(ValueError, match="compressor 'topk' has no option 'levels'"):
            TopKState(model, levels=3, comm=comm)

    SimWorld(2).run(worker)


@pytest.mark.parametrize("name", ["dgc", "topk"])
def test_sparse_aliases_take_the_sparse_all_reduce(name):
    alias = create(name, {"aggregation": "sparse_allreduce"})
    assert alias.aggregation == "sparse_allreduce"
    assert create(name, {}).aggregation is None  # the compressor's own
    with pytest.raises(ValueError, match="aggregation"):
        create(name, {"aggregation": "allreduce"})  # sparse payloads cannot be summed
