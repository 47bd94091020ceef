"""The simulator with a model, data and gradients on a device: the same run as on the CPU.

Four simulated workers train a small MLP for a few steps with dense AllReduce, DGC through the
all-gather and through the sparse all-reduce, SGP, and local SGD, once with everything on the
CPU (the reference) and once on the device under test. The runs must agree: each worker's
parameters within a float tolerance (the device's kernels round differently), and exactly the
bytes each worker sent, its communicator's count of every operation (collectives and
exchanges), and the runtime's averagings. And nothing may have left the device: the
parameters, the optimizer's state, and every tensor the algorithm keeps (DGC's momentum and
velocity, its compressor's workspace, SGP's message buffer and messages in flight...).

The middle layer (64 x 64) is large enough for DGC's sampled-threshold path (its per-block
maxima, the candidate blocks), the first and last take the exact top-k of small tensors.

On a machine without CUDA the ``cuda`` case is skipped, and the ``cpu`` case runs the CPU
against itself: it checks the test's own plumbing (and the simulator's determinism).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import deque
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gossamer
from gossamer.algorithms import DGC, SGP, Algorithm, AllReduce, LocalSGD
from gossamer.algorithms.sgp import SGPRuntime
from gossamer.comm import SimWorld
from gossamer.testing import state_tensors

WORKERS, STEPS = 4, 6
# Parameters are O(0.1). The device's float32 kernels (matmul, reductions) differ from the
# CPU's in the last bits, and DGC's float16 values may then round the other way: a few 1e-7
# after these steps. A device bug (another random draw, a lost update) is O(1e-2).
ATOL = 1e-4

CASES: dict[str, Algorithm] = {
    "allreduce": AllReduce(),
    "dgc-allgather": DGC(ratio=0.05),
    "dgc-sparse-allreduce": DGC(ratio=0.05, aggregation="sparse_allreduce"),
    "sgp": SGP(),
    "localsgd": LocalSGD(period=2),
}
# what the device check must have seen of a case's runtime (DGC: its memory, and the
# threshold path's workspace; SGP: its message buffer)
EXPECTED = {
    "dgc-allgather": ("memory._u", "memory._v", "_workspace.high"),
    "dgc-sparse-allreduce": ("memory._u", "memory._v", "_workspace.high"),
    "sgp": ("runtime._message",),
}
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="CUDA is not available")]),
]


@dataclasses.dataclass
class Outcome:
    """What one worker reports of a run."""

    params: torch.Tensor  # after the last step and finish(), on the CPU
    bytes_sent: int
    operations: dict[str, int]
    averagings: int
    devices: set[tuple[str, str]]  # (where, device type) of every tensor the worker kept


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 4))


def _kept(obj: Any, where: str, seen: set[int], out: set[tuple[str, str]]) -> None:
    """(path, device type) of every tensor reachable from ``obj`` through gossamer's own
    objects (not its communicators: the simulator's bookkeeping is not the algorithm's),
    dicts, lists, tuples and deques."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.add((where, obj.device.type))
    elif isinstance(obj, dict):
        for i, (key, value) in enumerate(obj.items()):  # an optimizer's state: by parameter
            label = repr(key) if isinstance(key, (str, int)) else str(i)
            _kept(value, f"{where}[{label}]", seen, out)
    elif isinstance(obj, (list, tuple, deque)):
        for i, value in enumerate(obj):
            _kept(value, f"{where}[{i}]", seen, out)
    elif type(obj).__module__.startswith("gossamer.") \
            and not type(obj).__module__.startswith("gossamer.comm") and hasattr(obj, "__dict__"):
        for name, value in vars(obj).items():
            _kept(value, f"{where}.{name}", seen, out)


def train(comm, algorithm: Algorithm, device: str) -> Outcome:
    """``STEPS`` steps of the MLP on ``device``, this worker's own data, then ``finish()``."""
    model = _model().to(device)
    optimizer = gossamer.distribute(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), algorithm, comm)
    g = torch.Generator().manual_seed(100 + comm.rank)  # the same data on every device
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        optimizer.zero_grad()
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        optimizer.step()
    optimizer.finish()
    runtime = optimizer.runtime
    devices: set[tuple[str, str]] = set()
    seen: set[int] = set()
    for name, p in model.named_parameters():
        _kept(p, f"parameter {name}", seen, devices)
    _kept(optimizer.optimizer.state, "optimizer state", seen, devices)
    _kept(runtime, "runtime", seen, devices)
    for i, t in enumerate(state_tensors(optimizer.state_dict())):
        _kept(t, f"state_dict tensor {i}", seen, devices)
    if isinstance(runtime, SGPRuntime):  # its gossip rounds
        averagings = comm.stats.operations["exchange"] + runtime.synchronizations
    else:
        averagings = runtime.synchronizations
    params = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()
    return Outcome(params, comm.stats.total_bytes_sent, dict(comm.stats.operations),
                   averagings, devices)


@functools.cache
def _reference(case: str) -> tuple[Outcome, ...]:
    return tuple(SimWorld(WORKERS).run(train, CASES[case], "cpu"))


@pytest.mark.parametrize("device", DEVICES)
def test_a_simulated_run_on_a_device_matches_the_cpu(device):
    problems = []
    for case, algorithm in CASES.items():
        cpu = _reference(case)
        runs = SimWorld(WORKERS).run(train, algorithm, device)
        for rank, (mine, ref) in enumerate(zip(runs, cpu, strict=True)):
            what = f"{case}, rank {rank}"
            if not torch.allclose(mine.params, ref.params, rtol=0, atol=ATOL):
                problems.append(f"{what}: parameters differ from the CPU's by "
                                f"{float((mine.params - ref.params).abs().max()):.3g}")
            if mine.bytes_sent != ref.bytes_sent:
                problems.append(f"{what}: sent {mine.bytes_sent} bytes, "
                                f"{ref.bytes_sent} on the CPU")
            if mine.operations != ref.operations:
                problems.append(f"{what}: operations {mine.operations}, "
                                f"{ref.operations} on the CPU")
            if mine.averagings != ref.averagings or not mine.averagings:
                problems.append(f"{what}: {mine.averagings} averagings, "
                                f"{ref.averagings} on the CPU")
            elsewhere = sorted(where for where, kind in mine.devices if kind != device)
            if elsewhere:
                problems.append(f"{what}: not on {device}: {', '.join(elsewhere)}")
        inspected = {where for where, _ in runs[0].devices}
        for part in EXPECTED.get(case, ()):
            if not any(part in where for where in inspected):
                problems.append(f"{case}: no tensor of {part} was inspected")
    assert not problems, "\n".join(problems)
