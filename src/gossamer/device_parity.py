"""A simulated run with the model, data and gradients on a device, against the same run on the
CPU: shared by ``tests/test_sim_device.py`` and ``scripts/gpu-check``.

A few workers of :class:`~gossamer.comm.SimWorld` train a small MLP (16 -> 64 -> 64 -> 4) for a
few steps with momentum SGD under ``distribute``, each on its own seeded data, then
``finish()``. A run on the device must agree with the CPU's: each worker's parameters within a
float tolerance (the device's kernels round differently), and exactly the bytes each worker
sent, its communicator's count of every operation (collectives and exchanges), and the
runtime's averagings. And nothing may have left the device: the parameters, the optimizer's
state, and every tensor the algorithm keeps (reachable from its runtime through gossamer's own
objects).

The middle layer (64 x 64) is large enough for DGC's sampled-threshold path (its per-block
maxima, the candidate blocks); the first and last take the exact top-k of small tensors.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gossamer.algorithms import Algorithm
from gossamer.algorithms.sgp import SGPRuntime
from gossamer.api import distribute
from gossamer.comm import SimWorld
from gossamer.testing import state_tensors

__all__ = ["ATOL", "Outcome", "compare", "kept_tensors", "max_difference", "parity_model",
           "simulated_run", "tensor_bytes", "train"]

# Parameters are O(0.1). The device's float32 kernels (matmul, reductions) differ from the
# CPU's in the last bits, and DGC's float16 values may then round the other way: a few 1e-7
# after six steps. A device bug (another random draw, a lost update) is O(1e-2).
ATOL = 1e-4


@dataclasses.dataclass
class Outcome:
    """What one worker reports of a run."""

    params: torch.Tensor  # after the last step and finish(), on the CPU
    bytes_sent: int
    operations: dict[str, int]
    averagings: int
    devices: set[tuple[str, str]]  # (where, device type) of every tensor the worker kept


def parity_model() -> nn.Module:
    """The MLP of the comparison, seeded: the same initial weights on every worker."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 4))


def kept_tensors(obj: Any, where: str, seen: set[int], out: dict[str, torch.Tensor]) -> None:
    """Every tensor reachable from ``obj`` through gossamer's own objects (not its
    communicators: the simulator's bookkeeping is not the algorithm's), dicts, lists, tuples
    and deques, into ``out`` by path; ``seen`` holds the ids already visited."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out[where] = obj
    elif isinstance(obj, dict):
        for i, (key, value) in enumerate(obj.items()):  # an optimizer's state: by parameter
            label = repr(key) if isinstance(key, (str, int)) else str(i)
            kept_tensors(value, f"{where}[{label}]", seen, out)
    elif isinstance(obj, (list, tuple, deque)):
        for i, value in enumerate(obj):
            kept_tensors(value, f"{where}[{i}]", seen, out)
    elif type(obj).__module__.startswith("gossamer.") \
            and not type(obj).__module__.startswith("gossamer.comm") and hasattr(obj, "__dict__"):
        for name, value in vars(obj).items():
            kept_tensors(value, f"{where}.{name}", seen, out)


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view counts once, with its base)."""
    storages: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        storages[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def _kept_by_worker(model: nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """Every tensor the worker keeps: parameters, the optimizer's state, the runtime's."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        kept_tensors(p, f"parameter {name}", seen, out)
    kept_tensors(optimizer.optimizer.state, "optimizer state", seen, out)
    kept_tensors(optimizer.runtime, "runtime", seen, out)
    for i, t in enumerate(state_tensors(optimizer.state_dict())):
        kept_tensors(t, f"state_dict tensor {i}", seen, out)
    return out


def train(comm, algorithm: Algorithm, device: str, steps: int = 6,
          compile_backend: str | None = None) -> Outcome:
    """``steps`` steps of the MLP on ``device``, this worker's own data, then ``finish()``;
    with ``compile_backend``, of the MLP that ``torch.compile`` made with that backend."""
    model = parity_model().to(device)
    run = torch.compile(model, backend=compile_backend) if compile_backend else model
    optimizer = distribute(
        run, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), algorithm, comm)
    g = torch.Generator().manual_seed(100 + comm.rank)  # the same data on every device
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        optimizer.zero_grad()
        F.cross_entropy(run(x.to(device)), y.to(device)).backward()
        optimizer.step()
    optimizer.finish()
    runtime = optimizer.runtime
    kept = _kept_by_worker(model, optimizer)
    if isinstance(runtime, SGPRuntime):  # its gossip rounds
        averagings = comm.stats.operations["exchange"] + runtime.synchronizations
    else:
        averagings = runtime.synchronizations
    params = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()
    return Outcome(params, comm.stats.total_bytes_sent, dict(comm.stats.operations),
                   averagings, {(where, t.device.type) for where, t in kept.items()})


def simulated_run(algorithm: Algorithm, device: str, workers: int = 4,
                  steps: int = 6) -> tuple[Outcome, ...]:
    """Each worker's :class:`Outcome` of one simulated run of ``algorithm`` on ``device``."""
    return tuple(SimWorld(workers).run(train, algorithm, device, steps))


def compare(label: str, runs: tuple[Outcome, ...], cpu: tuple[Outcome, ...], device: str, *,
            atol: float = ATOL, expected: Iterable[str] = (),
            need_averaging: bool = True) -> list[str]:
    """What differs between a run on ``device`` and the CPU's, one line each (none: they
    agree). ``expected``: parts of the paths of tensors the run must have kept (so that the
    device check saw them); ``need_averaging``: a run without any averaging is a problem."""
    problems = []
    for rank, (mine, ref) in enumerate(zip(runs, cpu, strict=True)):
        what = f"{label}, rank {rank}"
        if not torch.allclose(mine.params, ref.params, rtol=0, atol=atol):
            problems.append(f"{what}: parameters differ from the CPU's by "
                            f"{float((mine.params - ref.params).abs().max()):.3g}")
        if mine.bytes_sent != ref.bytes_sent:
            problems.append(f"{what}: sent {mine.bytes_sent} bytes, {ref.bytes_sent} on the CPU")
        if mine.operations != ref.operations:
            problems.append(f"{what}: operations {mine.operations}, {ref.operations} on the CPU")
        if mine.averagings != ref.averagings or (need_averaging and not mine.averagings):
            problems.append(f"{what}: {mine.averagings} averagings, {ref.averagings} on the CPU")
        elsewhere = sorted(where for where, kind in mine.devices if kind != device)
        if elsewhere:
            problems.append(f"{what}: not on {device}: {', '.join(elsewhere)}")
    inspected = {where for where, _ in runs[0].devices}
    for part in expected:
        if not any(part in where for where in inspected):
            problems.append(f"{label}: no tensor of {part} was inspected")
    return problems


def max_difference(runs: tuple[Outcome, ...], cpu: tuple[Outcome, ...]) -> float:
    """The largest difference of any worker's parameters from the CPU run's."""
    return max(float((a.params - b.params).abs().max()) for a, b in zip(runs, cpu, strict=True))
