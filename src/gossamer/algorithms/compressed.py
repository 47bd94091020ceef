"""Compressed AllReduce-SGD under registry names: ``dgc``, ``topk``, ``randomk``, ``qsgd``,
``powersgd``, ``fp16``.

Each is an alias of ``allreduce`` with the registered compressor of the same name
(:mod:`gossamer.compress.registry`): its options are that compressor's (inherited from its
:class:`~gossamer.compress.Compression` entry, where they are written) and AllReduce's
``bucket_mb`` and ``overlap`` (and ``node_size`` for ``dgc``, ``aggregation`` for ``dgc``
and ``topk``).
``--algorithm dgc --option ratio=0.001`` and ``--algorithm allreduce --compressor
dgc:ratio=0.001`` build the same thing. Python users can
equally write ``AllReduce(compression="dgc:ratio=0.001")`` or ``AllReduce(compressor=...,
memory=...)``.

Example::

    gossamer train --sim 4 --algorithm dgc      # warm-up: the first quarter of the run
    gossamer train --sim 4 --algorithm dgc --option ratio=0.001 --option warmup_steps=60

    optimizer = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1,
                                                           momentum=0.9), DGC(ratio=0.001),
                                    total_steps=1000)  # density warm-up: its first 250 steps
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from gossamer.algorithms.allreduce import AllReduce, AllReduceRuntime
from gossamer.algorithms.base import Algorithm
from gossamer.comm.base import Communicator
from gossamer.compress.registry import (
    Compression,
    DGCCompression,
    FP16Compression,
    PowerSGDCompression,
    QSGDCompression,
    RandomKCompression,
    TopKCompression,
    lookup_compression,
    option_of,
)

__all__ = ["DGC", "CompressedAllReduce", "FP16AllReduce", "PowerSGDAllReduce", "QSGDAllReduce",
           "RandomKAllReduce", "TopKAllReduce"]

_ALLREDUCE_OPTIONS = frozenset(f.name for f in dataclasses.fields(AllReduce) if f.init)


@dataclass(frozen=True, kw_only=True)
class CompressedAllReduce(Algorithm):
    """What the aliases share: ``allreduce`` with the compressor registered under
    :attr:`name`. A subclass also derives from that compressor's entry, whose options it
    offers; its other options are AllReduce's."""

    bucket_mb: float = option_of(AllReduce, "bucket_mb")
    overlap: bool = option_of(AllReduce, "overlap")

    def __post_init__(self) -> None:
        self.allreduce(1)  # the compressor's checks and AllReduce's, naming the option

    def __str__(self) -> str:
        return repr(self)  # an algorithm, not a compressor spec

    @property
    def compression(self) -> Compression:
        """The registered compressor with this configuration's options."""
        entry = lookup_compression(self.name)
        return entry(**{f.name: getattr(self, f.name) for f in dataclasses.fields(entry)
                        if f.init})

    def allreduce(self, world_size: int) -> AllReduce:
        """The AllReduce configuration this stands for, for ``world_size`` workers."""
        # with the hierarchy, the compressed exchange averages the nodes' means
        nodes = max(1, world_size // getattr(self, "node_size", 1))
        compressor, memory = self.compression.build(nodes)
        options = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if f.init and f.name in _ALLREDUCE_OPTIONS}
        return AllReduce(compressor=compressor, memory=memory, **options)

    def validate(self, world_size: int) -> None:
        self.allreduce(world_size).validate(world_size)

    def symmetric(self) -> bool:
        return self.allreduce(1).symmetric()

    def bind(
        self, comm: Communicator, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> AllReduceRuntime:
        return AllReduceRuntime(self.allreduce(comm.world_size), comm, model, optimizer)


@dataclass(frozen=True, kw_only=True)
class DGC(CompressedAllReduce, DGCCompression):
    """Deep Gradient Compression (Lin et al., ICLR 2018): sparse, momentum-corrected gradients.

    Threshold sparsification of about ``ratio`` of each gradient, momentum correction, local
    accumulation, momentum factor masking, optional local clipping and density warm-up (by
    default the paper's schedule over the first quarter of the run, where the training loop
    tells its length; none where it does not); fp16 values and int32 positions, all-gathered.
    See :mod:`gossamer.compress.dgc`.

    The momentum, Nesterov and weight decay of a ``torch.optim.SGD`` are taken over when bound
    (momentum correction applies the momentum before sparsification); the optimizer then steps
    with the averaged sparse velocities. The weight decay is applied by each worker to its own
    parameters after the exchange, dense and never compressed, through the same momentum (as
    the reference implementation): every parameter decays every step, and at ``ratio=1``
    without masking this is exactly momentum SGD with weight decay.

    Options: those of :class:`~gossamer.compress.registry.DGCCompression` (``ratio``,
    ``sample_ratio``, ``warmup_steps``, ``warmup_stages``, ``momentum_masking``,
    ``clip_norm``, ``fp16_values``, ``weight_decay_in_gradient``, ``seed``), and AllReduce's
    ``bucket_mb``, ``node_size`` (hierarchy: dense inside nodes, sparse between) and
    ``aggregation`` (``"sparse_allreduce"``: bytes per worker that do not grow with n, see
    :mod:`gossamer.compress.sparse_allreduce`).
    """

    name: ClassVar[str] = "dgc"

    node_size: int = option_of(AllReduce, "node_size")
    aggregation: str | None = option_of(AllReduce, "aggregation")


@dataclass(frozen=True, kw_only=True)
class TopKAllReduce(CompressedAllReduce, TopKCompression):
    """Exact top-k sparsification with error feedback, all-gathered.

    Options: those of :class:`~gossamer.compress.registry.TopKCompression` (``ratio``,
    ``error_feedback``, ``fp16_values``), ``bucket_mb`` and ``aggregation``
    (``"sparse_allreduce"``, see :mod:`gossamer.compress.sparse_allreduce`).
    """

    name: ClassVar[str] = "topk"

    aggregation: str | None = option_of(AllReduce, "aggregation")


@dataclass(frozen=True, kw_only=True)
class RandomKAllReduce(CompressedAllReduce, RandomKCompression):
    """Random-k sparsification with error feedback, at positions every worker draws alike;
    only the values travel, all-reduced.

    Options: those of :class:`~gossamer.compress.registry.RandomKCompression` (``ratio``,
    ``error_feedback``, ``seed``) and ``bucket_mb``.
    """

    name: ClassVar[str] = "randomk"
    needs: ClassVar[str] = (
        "its defaults (ratio 0.01, error feedback) diverge with momentum SGD on digits (24.5% "
        "after 300 steps); ratio=0.1 with error_feedback=false reaches 90.5%, ratio=0.25 89.4%, "
        "against 96.9% for allreduce")


@dataclass(frozen=True, kw_only=True)
class QSGDAllReduce(CompressedAllReduce, QSGDCompression):
    """QSGD stochastic quantization (Alistarh et al., NeurIPS 2017), all-gathered.

    Options: those of :class:`~gossamer.compress.registry.QSGDCompression` (``levels``,
    ``bucket_size``, ``error_feedback``, ``seed``) and ``bucket_mb``.
    """

    name: ClassVar[str] = "qsgd"


@dataclass(frozen=True, kw_only=True)
class PowerSGDAllReduce(CompressedAllReduce, PowerSGDCompression):
    """PowerSGD low-rank compression (Vogels et al., NeurIPS 2019), in two all-reduces.

    Options: those of :class:`~gossamer.compress.registry.PowerSGDCompression` (``rank``,
    ``warm_start``, ``error_feedback``, ``seed``) and ``bucket_mb``.
    """

    name: ClassVar[str] = "powersgd"


@dataclass(frozen=True, kw_only=True)
class FP16AllReduce(CompressedAllReduce, FP16Compression):
    """Gradients all-reduced in float16 or bfloat16: half the bytes.

    Options: ``dtype`` (:class:`~gossamer.compress.registry.FP16Compression`) and
    ``bucket_mb``.
    """

    name: ClassVar[str] = "fp16"
