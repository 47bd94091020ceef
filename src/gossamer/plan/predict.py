"""Predict a method's step time, bytes and idle time on a cluster, from SimWorld's clock.

:func:`predict` runs the real algorithm runtime on every simulated worker for a few steps,
with the forward and backward passes replaced by gradients of the model's shapes (their time
is the compute model's), in the timing-only simulator (:mod:`gossamer.comm.timing`): the
model is built on the ``meta`` device, so 10,000 replicas of a billion parameters cost no
memory. :func:`step_worker` is the per-worker function; with ``size_only=False`` it runs the
same steps on real tensors in the full simulator, which gives the same virtual times and
bytes (the contract of the timing-only mode, tested on every registered method).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gossamer.algorithms import Algorithm, create
from gossamer.comm import ComputeModel, NetworkModel, SimWorld
from gossamer.comm.mirror import MirrorComm, MirrorWorld, NotSymmetric, homogeneous
from gossamer.comm.timing import META

__all__ = ["Prediction", "cycle", "flat_model", "predict", "step_worker"]


def step_worker(comm, algorithm: Algorithm, build: Callable[[], nn.Module], *, warmup: int,
                steps: int, size_only: bool, lr: float = 0.05,
                finish: bool = True) -> dict[str, float]:
    """One worker: a barrier, then ``warmup`` and ``steps`` training steps of ``algorithm`` on
    the model ``build()`` makes (on the meta device with ``size_only``), SGD with momentum at
    ``lr`` (QSR's period follows it); what the measured steps cost on this worker's virtual
    clock. Real gradients are fixed random tensors seeded by the rank; size-only ones have
    shapes only. The run's length is not given to the method: a last local SGD round would
    average at the end of the measured steps. With ``finish`` the method then settles and
    averages as at the end of training (``optimizer.finish()``), which the figures returned
    never include; :func:`predict` leaves it out where no other worker waits for it
    (:attr:`~gossamer.algorithms.Algorithm.peers_wait_for_finish`)."""
    import gossamer

    if size_only:
        with torch.device(META):
            model = build()
    else:
        torch.manual_seed(0)  # the same initial replica everywhere, without a broadcast
        model = build()
    params = [p for p in model.parameters() if p.requires_grad]
    inner = torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=True)  # one call a step
    with warnings.catch_warnings():
        # the inner optimizer is a stand-in here: times and bytes do not depend on it, so a
        # method's warning that it expects another one (MuLoCo's Muon) says nothing
        warnings.filterwarnings("ignore", message=r"\w+: the inner optimizer is")
        optimizer = gossamer.distribute(model, inner, algorithm, comm, broadcast=False)
    generator = torch.Generator().manual_seed(1000 + comm.rank)
    fixed = None if size_only else [torch.randn(p.shape, generator=generator) * 1e-3
                                    for p in params]

    def step() -> None:
        for i, p in enumerate(params):
            if fixed is not None:
                p.grad = fixed[i].clone()
            elif p.grad is None:  # size-only: a gradient has no values to renew
                p.grad = torch.empty(p.shape, device=META)
        optimizer.step()

    comm.barrier()  # every worker starts together, whatever its set-up took
    for _ in range(warmup):
        step()
    start = (comm.clock(), comm.idle_time, *_sent(comm))
    for _ in range(steps):
        step()
    end = (comm.clock(), comm.idle_time, *_sent(comm))
    if finish:
        optimizer.finish()
    seconds, idle, sent, messages = (b - a for a, b in zip(start, end, strict=True))
    return {"seconds": seconds, "idle": idle, "bytes": sent, "messages": messages}


def _sent(comm) -> tuple[float, float]:
    """Bytes and messages sent so far per worker: this worker's, or the mean over the world
    that one :class:`~gossamer.comm.mirror.MirrorComm` stands for."""
    if isinstance(comm, MirrorComm):
        return comm.mean_sent
    return comm.stats.total_bytes_sent, comm.stats.total_messages_sent


class _Flat(nn.Module):
    """Parameters and buffers of given dtypes and sizes, one flat tensor each, in order."""

    def __init__(self, parameters: list[tuple[torch.dtype, bool, int]],
                 buffers: list[tuple[torch.dtype, int]]) -> None:
        super().__init__()
        for i, (dtype, grad, numel) in enumerate(parameters):
            self.register_parameter(f"parameters{i}", nn.Parameter(
                torch.empty(numel, dtype=dtype), requires_grad=grad))
        for i, (dtype, numel) in enumerate(buffers):
            self.register_buffer(f"buffers{i}", torch.empty(numel, dtype=dtype))


def flat_model(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """A builder of the stand-in of ``build()``'s model for a method that moves flat copies
    of it (:attr:`~gossamer.algorithms.Algorithm.flat_parameters`): one parameter per dtype
    and ``requires_grad`` and one buffer per dtype, each as large as all of the model's of
    its kind, in the order of their first appearance (the order of the flat buffers). Its
    flat copies, and their messages, are the model's; a worker's step works on a few
    tensors instead of hundreds (ResNet-50's 161 parameters and 212 buffers). Shapes only:
    build it on the ``meta`` device."""
    with torch.device(META):
        model = build()
    parameters: dict[tuple[torch.dtype, bool], int] = {}
    for p in model.parameters():
        parameters[p.dtype, p.requires_grad] = parameters.get((p.dtype, p.requires_grad),
                                                              0) + p.numel()
    buffers: dict[torch.dtype, int] = {}
    for b in model.buffers():
        buffers[b.dtype] = buffers.get(b.dtype, 0) + b.numel()
    kinds = [(dtype, grad, numel) for (dtype, grad), numel in parameters.items()]
    return lambda: _Flat(kinds, list(buffers.items()))


def cycle(algorithm: Algorithm) -> int:
    """The steps after which ``algorithm``'s pattern of communication repeats: the least
    common multiple of its averaging period and its exact-average interval (1 when it
    communicates alike every step). A measurement over whole cycles counts the periodic
    averages at their rate."""
    every = [getattr(algorithm, name, 0) for name in ("period", "allreduce_every")]
    return math.lcm(1, *(int(v) for v in every if isinstance(v, int) and v > 0))


@dataclass(frozen=True)
class Prediction:
    """What :func:`predict` found for one method at one worker count."""

    method: str  # the label given
    workers: int
    steps: int  # measured steps (whole cycles of the method, see cycle())
    step_time: float  # seconds per step of the slowest worker (a synchronous method's pace)
    mean_step_time: float  # seconds per step, mean over workers (an asynchronous one's pace)
    bytes_per_step: float  # bytes sent per worker per step, mean over workers
    idle_fraction: float  # of the measured time, the share spent waiting, mean over workers
    real_seconds: float  # what the simulation took on this machine

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def of_rows(cls, method: str, rows: list[dict[str, float]], steps: int,
                real_seconds: float) -> Prediction:
        """The prediction of :func:`step_worker`'s rows, one per worker (of ``steps``
        measured steps each)."""
        workers = len(rows)
        per_step = [r["seconds"] / steps for r in rows]
        return cls(
            method=method,
            workers=workers,
            steps=steps,
            step_time=max(per_step),
            mean_step_time=sum(per_step) / workers,
            bytes_per_step=sum(r["bytes"] for r in rows) / workers / steps,
            idle_fraction=sum(r["idle"] / r["seconds"] if r["seconds"] else 0.0
                              for r in rows) / workers,
            real_seconds=real_seconds,
        )


def predict(algorithm: str | Algorithm, workers: int, build: Callable[[], nn.Module], *,
            network: NetworkModel, compute: ComputeModel, warmup: int = 2, steps: int = 3,
            label: str | None = None, options: Mapping[str, Any] | None = None,
            seed: int = 0, lr: float = 0.05, simulate: str = "auto") -> Prediction:
    """Simulate ``steps`` steps (after ``warmup``) of ``algorithm`` on ``workers`` workers of
    the model ``build()`` makes, timing-only; the time per step, bytes per step and idle
    fraction. ``steps`` is rounded up to whole cycles of the method (:func:`cycle`: local
    SGD's period, WAGMA's global rounds); ``lr`` is the inner SGD's learning rate.

    ``simulate``: ``"auto"`` (default) simulates one worker for all
    (:class:`~gossamer.comm.mirror.MirrorWorld`) where the method is symmetric
    (:meth:`~gossamer.algorithms.Algorithm.symmetric`) and the workers and links are alike,
    every worker otherwise (also where the one-worker simulation finds that the workers do
    not keep in step: WAGMA's partners, checked as it goes); ``"every"`` always simulates
    every worker (the same figures, slower); ``"one"`` insists on one (ValueError where it
    cannot stand for all). A method that moves flat copies of the model
    (:attr:`~gossamer.algorithms.Algorithm.flat_parameters`) is simulated on its stand-in
    (:func:`flat_model`): the same figures.

    Example::

        from gossamer.plan.models import resnet50
        p = predict("sgp", 32, resnet50, network=NetworkModel(bandwidth="10gbit"),
                    compute=ComputeModel(step_time=0.25))
        p.step_time, p.bytes_per_step
    """
    import time

    if simulate not in ("auto", "every", "one"):
        raise ValueError(f"simulate must be 'auto', 'every' or 'one', got {simulate!r}")
    if isinstance(algorithm, str):
        label = label or algorithm
        algorithm = create(algorithm, options)
    algorithm = algorithm.resolve(workers)
    steps = -(-steps // cycle(algorithm)) * cycle(algorithm)
    one = simulate != "every" and algorithm.symmetric() and not homogeneous(
        workers, network, compute)
    if simulate == "one" and not one:
        raise ValueError(f"simulate='one': {label or algorithm.label} at {workers} workers needs "
                         "every worker simulated (" + (homogeneous(workers, network, compute)
                                                       or "not a symmetric method") + ")")
    started = time.perf_counter()
    # the end of training comes after the measured steps: it is left out where nobody waits
    # for it (one worker for all; AD-PSGD, whose settling grows with the square of the workers)
    kwargs = {"warmup": warmup, "steps": steps, "size_only": True, "lr": lr,
              "finish": algorithm.peers_wait_for_finish}
    if algorithm.flat_parameters:
        build = flat_model(build)
    if one:
        try:
            rows = [MirrorWorld(workers, network=network, compute=compute, seed=seed,
                                mirror=algorithm.mirror).run(
                step_worker, algorithm, build, **{**kwargs, "finish": False})] * workers
        except NotSymmetric as error:
            if simulate == "one":
                raise ValueError(f"simulate='one': {label or algorithm.label} at {workers} "
                                 f"workers needs every worker simulated ({error})") from None
            one = False
    if not one:
        world = SimWorld(workers, network=network, compute=compute, seed=seed,
                         timing_only=True)
        rows = world.run(step_worker, algorithm, build, **kwargs)
    return Prediction.of_rows(label or algorithm.label, rows, steps,
                              time.perf_counter() - started)
