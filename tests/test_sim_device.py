"""The simulator with a model, data and gradients on a device: the same run as on the CPU.

Four simulated workers train a small MLP for a few steps with dense AllReduce, DGC through the
all-gather and through the sparse all-reduce, SGP, and local SGD, once with everything on the
CPU (the reference) and once on the device under test. The runs must agree: each worker's
parameters within a float tolerance (the device's kernels round differently), and exactly the
bytes each worker sent, its communicator's count of every operation (collectives and
exchanges), and the runtime's averagings. And nothing may have left the device: the
parameters, the optimizer's state, and every tensor the algorithm keeps (DGC's momentum and
velocity, its compressor's workspace, SGP's message buffer and messages in flight...).

The run and the comparison are :mod:`gossamer.device_parity`'s, which ``scripts/gpu-check``
runs for every registered method.

On a machine without CUDA the ``cuda`` case is skipped, and the ``cpu`` case runs the CPU
against itself: it checks the test's own plumbing (and the simulator's determinism).
"""

from __future__ import annotations

import functools

import pytest
import torch

from gossamer.algorithms import DGC, SGP, Algorithm, AllReduce, LocalSGD
from gossamer.device_parity import Outcome, compare, simulated_run

WORKERS, STEPS = 4, 6

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


@functools.cache
def _reference(case: str) -> tuple[Outcome, ...]:
    return simulated_run(CASES[case], "cpu", WORKERS, STEPS)


@pytest.mark.parametrize("device", DEVICES)
def test_a_simulated_run_on_a_device_matches_the_cpu(device):
    problems = []
    for case, algorithm in CASES.items():
        runs = simulated_run(algorithm, device, WORKERS, STEPS)
        problems += compare(case, runs, _reference(case), device,
                            expected=EXPECTED.get(case, ()))
    assert not problems, "\n".join(problems)
