"""Fault injection, for tests and demonstrations: one worker crashes, hangs, slows down or
produces a non-finite gradient at a given step.

A fault is written ``RANK:STEP:KIND`` (``gossamer train --fault 1:5:crash``, repeatable; a
recipe's ``faults`` list). Steps count from 1, as the progress bar and the metrics do. KIND is:

- ``crash``: at the start of step STEP the worker's process exits at once (exit code
  :data:`CRASH_EXIT_CODE`, no clean-up, as a killed process). In the simulator the worker stops
  there, as a dead process would: whoever waits for it times out, naming it.
- ``hang``: at the start of step STEP the worker stops answering without exiting: it never
  communicates again, and its heartbeat stops too (as in a process stuck in a call that holds
  the GIL). In the simulator it blocks for ever; the run ends when everyone else has finished
  or failed.
- ``slow:FACTOR``: from step STEP on, the worker's compute takes FACTOR (>= 1) times as long.
  In the simulator its virtual compute time is multiplied; in real processes it sleeps
  (FACTOR - 1) x the measured compute time (forward and backward) of each step.
- ``nan``: at step STEP, one element of the first parameter's gradient is NaN, put in as
  backward computes it (what the non-finite checks, ``nonfinite``, are for).

Faults fire only in the first attempt of an elastic job: when ``TORCHELASTIC_RESTART_COUNT``
is set and > 0 (torchrun restarted the workers), none is injected, so that a job restarted
after an injected crash can complete.

Example::

    injector = FaultInjector(["1:5:crash", "2:1:slow:3"], comm.rank, comm.world_size)
    for step in range(1, steps + 1):
        injector.begin_step(comm, step)
        started = time.perf_counter()
        injector.before_backward(step, model.parameters())
        loss_fn(model(x), y).backward()
        injector.after_backward(step, time.perf_counter() - started)
        optimizer.step()
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from gossamer.comm.base import FaultInjection, VirtualClock

__all__ = ["CRASH_EXIT_CODE", "KINDS", "Fault", "FaultInjector", "InjectedFault", "check_faults",
           "crash_process", "hang_process", "parse_fault"]

KINDS = ("crash", "hang", "slow", "nan")
CRASH_EXIT_CODE = 17  # what a crashed worker's process exits with: tells it from real errors
_ARG = "faults (--fault)"  # how error messages name the setting


class InjectedFault(BaseException):
    """A simulated worker crashed or hung on purpose (a BaseException: like a real crash, no
    ``except Exception`` in the training code stops it)."""


@dataclass(frozen=True)
class Fault:
    """One fault: worker ``rank`` does ``kind`` at step ``step`` (1-based)."""

    rank: int
    step: int
    kind: str  # one of KINDS
    factor: float = 1.0  # slow: how many times as long the compute takes

    def __str__(self) -> str:
        suffix = f":{self.factor:g}" if self.kind == "slow" else ""
        return f"{self.rank}:{self.step}:{self.kind}{suffix}"

    def describe(self) -> str:
        what = {"crash": "crashed", "hang": "hung", "nan": "put a NaN in a gradient",
                "slow": f"slowed down {self.factor:g}x"}[self.kind]
        return f"rank {self.rank} {what} at step {self.step} (fault injected: --fault {self})"


def parse_fault(text: str) -> Fault:
    """``"RANK:STEP:KIND"`` (``KIND`` ``crash``, ``hang``, ``nan`` or ``slow:FACTOR``) -> Fault.

    Raises a ValueError naming the setting and saying what is wrong.
    """
    if not isinstance(text, str):
        raise ValueError(f"{_ARG}: expected RANK:STEP:KIND strings, got {text!r}")
    parts = [part.strip() for part in text.strip().split(":")]
    if len(parts) < 3:
        raise ValueError(f"{_ARG} {text!r}: expected RANK:STEP:KIND, e.g. 1:5:crash "
                         f"(KIND one of crash, hang, slow:FACTOR, nan)")
    rank, step = _integer(text, "RANK", parts[0], 0), _integer(text, "STEP", parts[1], 1)
    kind, args = parts[2].lower(), parts[3:]
    if kind not in KINDS:
        raise ValueError(f"{_ARG} {text!r}: unknown kind {parts[2]!r}; known: crash, hang, "
                         "slow:FACTOR, nan")
    if kind != "slow":
        if args:
            raise ValueError(f"{_ARG} {text!r}: {kind} takes no argument")
        return Fault(rank, step, kind)
    if len(args) != 1 or not args[0]:
        raise ValueError(f"{_ARG} {text!r}: slow needs one factor, e.g. {rank}:{step}:slow:3")
    try:
        factor = float(args[0])
    except ValueError:
        factor = math.nan
    if not (math.isfinite(factor) and factor >= 1):
        raise ValueError(f"{_ARG} {text!r}: the slow-down factor must be a number >= 1, got "
                         f"{args[0]!r}")
    return Fault(rank, step, kind, factor)


def _integer(text: str, name: str, value: str, minimum: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{_ARG} {text!r}: {name} must be an integer, got {value!r}") from None
    if number < minimum:
        raise ValueError(f"{_ARG} {text!r}: {name} must be >= {minimum}, got {number}")
    return number


def check_faults(faults: Iterable[str | Fault], world_size: int | None = None,
                 steps: int | None = None) -> tuple[Fault, ...]:
    """Parse ``faults`` and check them against the world size and the number of steps (when
    known); ValueError naming the setting otherwise."""
    parsed = tuple(f if isinstance(f, Fault) else parse_fault(f) for f in faults)
    for fault in parsed:
        if world_size is not None and fault.rank >= world_size:
            raise ValueError(f"{_ARG} {str(fault)!r}: rank {fault.rank} does not exist: there "
                             f"are {world_size} workers (ranks 0 to {world_size - 1})")
        if steps is not None and fault.step > steps:
            raise ValueError(f"{_ARG} {str(fault)!r}: step {fault.step} is past the last step "
                             f"({steps}), so it would never fire")
    return parsed


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """torchelastic's attempt number: 0 in the first attempt (and outside torchelastic)."""
    value = (os.environ if environ is None else environ).get("TORCHELASTIC_RESTART_COUNT", "")
    try:
        return int(value)
    except ValueError:
        return 0


def crash_process(reason: str) -> NoReturn:
    """Exit this process at once (no clean-up, no ``finally``), as a crash would."""
    sys.stderr.write(f"gossamer: {reason}: exiting with code {CRASH_EXIT_CODE}\n")
    sys.stderr.flush()
    os._exit(CRASH_EXIT_CODE)


def hang_process(reason: str) -> NoReturn:
    """Never return and never communicate again (the launcher or the test harness kills us)."""
    sys.stderr.write(f"gossamer: {reason}: this worker stops answering\n")
    sys.stderr.flush()
    while True:
        time.sleep(3600)


def fail(comm: Any, fault: Fault) -> NoReturn:
    """Crash or hang this worker: through ``comm.fail`` where the communicator declares
    :class:`~gossamer.comm.base.FaultInjection` (the simulator's workers, the torch
    communicator's heartbeat), else the process itself."""
    if isinstance(comm, FaultInjection):
        comm.fail(fault.kind, fault.describe())
    if fault.kind == "crash":
        crash_process(fault.describe())
    hang_process(fault.describe())


class FaultInjector:
    """The faults of one worker, fired at the step boundaries of its training loop.

    Args:
        faults: ``RANK:STEP:KIND`` strings (or :class:`Fault` objects) of every worker.
        rank: this worker's rank; only its own faults fire.
        world_size: the number of workers (a fault naming a rank past it is a ValueError).
        environ: the environment to read ``TORCHELASTIC_RESTART_COUNT`` from (default
            ``os.environ``): in a restarted attempt no fault fires.
    """

    def __init__(self, faults: Iterable[str | Fault], rank: int, world_size: int, *,
                 environ: Mapping[str, str] | None = None) -> None:
        parsed = check_faults(faults, world_size)
        self.restarted = restart_count(environ) > 0
        self.faults = [] if self.restarted else [f for f in parsed if f.rank == rank]
        self.slowdown = 1.0  # real processes: sleep (slowdown - 1) x each step's compute
        self.fired: list[Fault] = []

    def _due(self, step: int, kinds: Sequence[str]) -> list[Fault]:
        return [f for f in self.faults if f.step == step and f.kind in kinds]

    def begin_step(self, comm: Any, step: int) -> None:
        """At the start of ``step`` (1-based): crash, hang, or start being slow."""
        for fault in self._due(step, ("slow",)):
            self.fired.append(fault)
            if isinstance(comm, VirtualClock):  # its compute is a model: slow the model
                comm.slow_down(fault.factor)
            else:
                self.slowdown = fault.factor
        for fault in self._due(step, ("crash", "hang")):
            self.fired.append(fault)
            fail(comm, fault)

    @torch.no_grad()
    def before_backward(self, step: int, parameters: Iterable[torch.Tensor]) -> None:
        """Before the backward pass of ``step``: a due NaN goes into the first parameter's
        gradient as backward computes it (a gradient hook, once), so that a method that sends
        gradients during backward sends it too."""
        for fault in self._due(step, ("nan",)):
            param = next((p for p in parameters if p.requires_grad), None)
            if param is None:
                continue
            self.fired.append(fault)
            handles = []

            def poison(grad: torch.Tensor, handles: list = handles) -> torch.Tensor:
                handles.pop().remove()  # once
                grad = grad.clone()
                grad[(0,) * grad.dim()] = math.nan
                return grad
            handles.append(param.register_hook(poison))

    def after_backward(self, step: int, compute_seconds: float) -> None:
        """After the backward pass of ``step``: sleep if slow (real time)."""
        if self.slowdown > 1 and compute_seconds > 0:
            time.sleep((self.slowdown - 1) * compute_seconds)
