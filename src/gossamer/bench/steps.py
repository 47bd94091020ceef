"""The benchmarks' timed-step loop: warm-up steps, then timed ones, on any clock."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["StepTimes", "sgd_step", "timed_steps"]

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class StepTimes:
    """What :func:`timed_steps` measured."""

    seconds: list[float]  # each timed step's duration, in order
    elapsed: float  # from the first timed step's start to the last one's end

    @property
    def per_step(self) -> float:
        """Mean seconds per timed step: the elapsed time over the number of steps."""
        return self.elapsed / len(self.seconds)

    @property
    def median(self) -> float:
        """Median of the steps' durations."""
        return statistics.median(self.seconds)


def sgd_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch | Callable[[], Batch],
    *,
    after_backward: Callable[[], None] | None = None,
) -> Callable[[], None]:
    """One training step of ``model`` as a closure for :func:`timed_steps`: zero the
    gradients, cross-entropy of ``batch`` (a fixed ``(x, y)``, or a function that draws one
    per step), backward, ``after_backward()`` (a straggler's sleep, say), ``optimizer.step()``.
    """

    def step() -> None:
        x, y = batch() if callable(batch) else batch
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if after_backward is not None:
            after_backward()
        optimizer.step()

    return step


def timed_steps(
    step: Callable[[], None],
    steps: int,
    *,
    warmup: int = 0,
    clock: Callable[[], float] = time.perf_counter,
    before_timing: Callable[[], None] | None = None,
) -> StepTimes:
    """Run ``warmup`` untimed steps, ``before_timing()`` (a barrier, a reading of the byte
    counters), then ``steps`` steps timed on ``clock``.

    Args:
        step: one step (see :func:`sgd_step`).
        steps: how many steps to time (>= 1).
        warmup: steps run first and not timed (default 0): allocations, pipelines filling up.
        clock: seconds as a float (default ``time.perf_counter``; ``comm.clock`` for a
            worker's own clock, virtual in SimWorld).
        before_timing: called once between the warm-up and the timed steps (default none).

    Example::

        times = timed_steps(sgd_step(model, opt, (x, y)), 20, warmup=3,
                            clock=comm.clock, before_timing=comm.barrier)
        print(times.per_step)
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    for _ in range(warmup):
        step()
    if before_timing is not None:
        before_timing()
    seconds = []
    start = clock()
    for _ in range(steps):
        t0 = clock()
        step()
        seconds.append(clock() - t0)
    return StepTimes(seconds, clock() - start)
