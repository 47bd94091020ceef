"""What communicators share and what each declares it can do; no capability is probed."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest
import torch

import gossamer.comm
from gossamer.algorithms import Algorithm, Runtime, lookup
from gossamer.algorithms.allreduce import AllReduce
from gossamer.algorithms.streaming_diloco import StreamingDiLoCo
from gossamer.comm import (
    AsyncCollectives,
    Communicator,
    CommunicatorBase,
    DeviceBound,
    FaultInjection,
    IdleTime,
    MembershipChange,
    ProcessGroupBacked,
    SharedState,
    SimWorld,
    TorchCommunicator,
    VirtualClock,
)
from gossamer.comm.mirror import MirrorComm
from gossamer.comm.p2p_group import P2PGroup
from gossamer.comm.sim import SimComm

SRC = Path(gossamer.comm.__file__).resolve().parents[1]  # src/gossamer

CAPABILITIES = (AsyncCollectives, IdleTime, VirtualClock, DeviceBound, FaultInjection,
                MembershipChange, SharedState, ProcessGroupBacked)

#: what each communicator of gossamer declares it can do
DECLARED = {
    TorchCommunicator: {AsyncCollectives, IdleTime, DeviceBound, FaultInjection,
                        MembershipChange, ProcessGroupBacked},
    SimComm: {IdleTime, VirtualClock, FaultInjection, MembershipChange, SharedState},
    MirrorComm: {IdleTime, VirtualClock, FaultInjection, MembershipChange, SharedState},
    P2PGroup: {DeviceBound},
}


def _communicator_classes() -> set[type]:
    """Every class of gossamer.comm that implements the collectives and the exchange (the
    protocol itself aside)."""
    found = set()
    for info in pkgutil.iter_modules(gossamer.comm.__path__, "gossamer.comm."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if (cls.__module__ == module.__name__ and cls is not Communicator
                    and not inspect.isabstract(cls)
                    and all(callable(getattr(cls, op, None)) for op in
                            ("all_reduce", "all_gather", "broadcast", "exchange", "group"))):
                found.add(cls)
    return found


def test_every_communicator_derives_from_the_base_and_is_listed_here():
    classes = _communicator_classes()
    assert classes == set(DECLARED)
    for cls in classes:
        assert issubclass(cls, CommunicatorBase), cls
        assert not inspect.isabstract(cls), (cls, cls.__abstractmethods__)


@pytest.mark.parametrize("cls", list(DECLARED), ids=lambda c: c.__name__)
def test_each_communicator_declares_what_it_supports(cls):
    declared = {capability for capability in CAPABILITIES if issubclass(cls, capability)}
    assert declared == DECLARED[cls]


def test_the_simulators_workers_and_their_groups_are_what_their_class_declares():
    def worker(comm):
        pair = comm.group([0, 1])
        over = P2PGroup(comm, [0, 1])
        return [{c.__name__ for c in CAPABILITIES if isinstance(x, c)}
                for x in (comm, pair, over)] + [type(pair), over.device]

    world, pair, over, pair_type, device = SimWorld(2).run(worker)[0]
    assert world == pair == {"IdleTime", "VirtualClock", "FaultInjection", "MembershipChange",
                             "SharedState"}
    assert pair_type is SimComm
    assert over == {"DeviceBound"} and device == torch.device("cpu")  # the parent has none


def test_the_base_holds_rank_world_size_and_the_accounting():
    def worker(comm):
        counted = comm.exchange({1 - comm.rank: torch.ones(4)}, [1 - comm.rank])
        counted.wait()
        with comm.uncounted():
            comm.exchange({1 - comm.rank: torch.ones(8)}, [1 - comm.rank]).wait()
        group = P2PGroup(comm, [1, 0])  # collectives over the parent's exchanges
        group.all_reduce(torch.ones(6))
        return (comm.rank, comm.world_size, group.rank, group.world_size,
                dict(comm.stats.bytes_sent), dict(comm.stats.operations),
                dict(group.stats.bytes_sent), dict(group.stats.operations))

    for rank, result in enumerate(SimWorld(2).run(worker)):
        me, size, group_rank, group_size, sent, ops, group_sent, group_ops = result
        assert (me, size, group_rank, group_size) == (rank, 2, 1 - rank, 2)
        # one counted exchange of 16 bytes, then the group's all-reduce of 24 bytes counted
        # by name, as the ring moves it (half of it each way), not the exchanges that carry it
        assert sent == {1 - rank: 16 + 24} and group_sent == {rank: 24}
        assert ops == {"exchange": 1, "all_reduce": 1} and group_ops == {"all_reduce": 1}


def test_the_runtime_declares_every_hook_and_the_algorithm_its_flags():
    hooks = ("start", "check_gradients", "after_backward", "use_scaler", "pause_gradient_sync",
             "after_step", "before_forward", "before_eval", "prepare_eval", "pause", "settle",
             "finish", "average_parameters", "change_membership", "rejoin", "state_dict",
             "load_state_dict")
    assert all(callable(vars(Runtime).get(name)) for name in hooks)
    assert Runtime.config is None
    assert Algorithm.continues_after_failure is False and not Algorithm.retired_options
    # no field inherited and refused: streaming-diloco has no compression option at all
    assert "compression" not in {f.name for f in dataclasses.fields(StreamingDiLoCo)}
    assert lookup("sgp").continues_after_failure and not AllReduce.continues_after_failure

    def worker(comm):
        model = torch.nn.Linear(2, 1)
        runtime = AllReduce().bind(comm, model, torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(NotImplementedError, match="cannot change its membership"):
            runtime.change_membership(comm, AllReduce())
        return True

    assert SimWorld(1).run(worker) == [True]


# -- no probes -------------------------------------------------------------------------------

#: names that hold a communicator, a runtime or what holds a runtime
PROBED = {"comm", "communicator", "parent", "runtime", "target", "optimizer", "self.comm",
          "self.communicator", "self._parent", "self.runtime", "self.optimizer"}
#: what communicators, runtimes and algorithms declare: never looked up by name
DECLARED_NAMES = {"all_reduce_async", "idle_time", "device", "shared", "fail", "slow_down",
                  "sleep", "simulation_state", "load_simulation_state", "process_group",
                  "backend", "store", "timeout", "peer_alive", "regroup", "uncounted",
                  "_uncounted", "record_group_collective", "_record_group", "runtime",
                  "change_membership", "continues_after_failure", "retired_options",
                  "schedule", "outer_step"}
#: (file, name) where getattr is no capability probe: a user's dotted factory path resolved
ALLOWED = {("train/factory.py", "target")}


def _text(node: ast.AST) -> str:
    return ast.unparse(node)


def _sources() -> list[tuple[str, ast.Module]]:
    return [(path.relative_to(SRC).as_posix(), ast.parse(path.read_text(), str(path)))
            for path in sorted(SRC.rglob("*.py"))]


def test_no_communicator_or_runtime_is_probed_with_getattr_or_hasattr():
    probes = []
    for name, tree in _sources():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2):
                continue
            receiver, attribute = _text(node.args[0]), node.args[1]
            named = isinstance(attribute, ast.Constant) and attribute.value in DECLARED_NAMES
            if (receiver in PROBED or named) and (name, receiver) not in ALLOWED:
                probes.append(f"{name}:{node.lineno}: {_text(node)}")
    assert probes == []


def test_no_private_method_of_a_communicator_or_runtime_is_called_from_outside():
    calls = []
    for name, tree in _sources():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr.startswith("_") and not node.func.attr.startswith("__")
                    and _text(node.func.value) in PROBED):
                calls.append(f"{name}:{node.lineno}: {_text(node)}")
    assert calls == []
