"""Compressed AllReduce-SGD under registry names: ``dgc``, ``topk``, ``randomk``, ``qsgd``,
``powersgd``, ``fp16``.

Each is a frozen configuration with plain options (numbers, booleans, strings), so that
``--option KEY=VALUE`` and recipes can set them; binding builds
:class:`~gossamer.algorithms.AllReduce` with the matching compressor and memory from
:mod:`gossamer.compress`, whose runtime does the work. Python users can equally write
``AllReduce(compressor=..., memory=...)``.

Example::

    gossamer train --sim 4 --algorithm dgc --option ratio=0.001 --option warmup_steps=60

    optimizer = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1,
                                                           momentum=0.9), DGC(ratio=0.001))
"""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from gossamer.algorithms.allreduce import AllReduce, AllReduceRuntime
from gossamer.algorithms.base import Algorithm
from gossamer.checks import check_int, check_positive
from gossamer.comm.base import Communicator
from gossamer.compress import (
    BF16,
    FP16,
    QSGD,
    Compressor,
    DGCCompressor,
    DGCMemory,
    ErrorFeedback,
    Memory,
    PowerSGD,
    RandomK,
    TopK,
)
from gossamer.compress.base import check_ratio
from gossamer.compress.reducer import check_node_size

__all__ = ["DGC", "FP16AllReduce", "PowerSGDAllReduce", "QSGDAllReduce", "RandomKAllReduce",
           "TopKAllReduce"]


def _check_bucket_mb(value: float) -> None:
    check_positive("bucket_mb", value, allow_zero=False)
    if not math.isfinite(value):
        raise ValueError(f"bucket_mb must be finite, got {value}")


class _Compressed(Algorithm):
    """What the registry classes share: they bind an AllReduce with a compressor."""

    bucket_mb: float

    @abstractmethod
    def allreduce(self, world_size: int) -> AllReduce:
        """The AllReduce configuration this stands for, for ``world_size`` workers."""

    def validate(self, world_size: int) -> None:
        self.allreduce(world_size).validate(world_size)

    def bind(
        self, comm: Communicator, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> AllReduceRuntime:
        return AllReduceRuntime(self.allreduce(comm.world_size), comm, model, optimizer)


def _with_memory(compressor: Compressor, error_feedback: bool, bucket_mb: float) -> AllReduce:
    memory: Memory | None = ErrorFeedback() if error_feedback else None
    return AllReduce(bucket_mb=bucket_mb, compressor=compressor, memory=memory)


@dataclass(frozen=True, kw_only=True)
class DGC(_Compressed):
    """Deep Gradient Compression (Lin et al., ICLR 2018): sparse, momentum-corrected gradients.

    Threshold sparsification of about ``ratio`` of each gradient, momentum correction, local
    accumulation, momentum factor masking, optional local clipping and density warm-up; fp16
    values and int32 positions, all-gathered. See :mod:`gossamer.compress.dgc`.

    The momentum, Nesterov and weight decay of a ``torch.optim.SGD`` are taken over when bound
    (momentum correction applies the momentum before sparsification); the optimizer then steps
    with the averaged sparse velocities. The weight decay is applied by each worker to its own
    parameters after the exchange, dense and never compressed, through the same momentum (as
    the reference implementation): every parameter decays every step, and at ``ratio=1``
    without masking this is exactly momentum SGD with weight decay.

    Args:
        ratio: density, in (0, 1] (default 0.001). Lower: fewer bytes.
        sample_ratio: fraction sampled to estimate the threshold (default 0.01).
        warmup_steps: steps of density warm-up from 25% (default 0: none).
        warmup_stages: exponential stages of the warm-up (default 4).
        momentum_masking: zero the momentum of sent elements (default True).
        clip_norm: local gradient clipping: each worker clips each tensor's gradient norm to
            ``clip_norm / sqrt(workers)`` (default None: no clipping).
        fp16_values: send values as float16 (default True).
        weight_decay_in_gradient: add the weight decay to each gradient before momentum
            correction, so that it is sparsified and delayed with it (default False: dense and
            local, after the exchange). See :class:`~gossamer.compress.DGCMemory`.
        node_size: hierarchy: dense inside nodes of this many ranks, sparse between (default 1).
        bucket_mb: MiB of gradients per all-gather (default 25).
        seed: seeds the threshold samples (default 0).
    """

    name: ClassVar[str] = "dgc"

    ratio: float = 0.001  # lower: fewer bytes, more gradient delayed
    sample_ratio: float = 0.01  # higher: better first threshold, slower
    warmup_steps: int = 0  # the paper warms up over 4 epochs
    warmup_stages: int = 4  # the density falls at each stage, from 25% to ratio
    momentum_masking: bool = True  # no stale momentum for elements just sent
    clip_norm: float | None = None  # global threshold; each worker clips at / sqrt(n)
    fp16_values: bool = True  # 6 bytes per sent element (False: 8)
    weight_decay_in_gradient: bool = False  # True: decay sparsified and delayed with the grad
    node_size: int = 1  # > 1: dense all-reduce inside each node first
    bucket_mb: float = 25.0  # higher: fewer, larger all-gathers
    seed: int = 0

    def __post_init__(self) -> None:
        self.compressor()  # checks ratio, sample_ratio, warmup_*, seed
        if self.clip_norm is not None:
            check_positive("clip_norm", self.clip_norm, allow_zero=False)
        self.memory(1)  # checks weight_decay_in_gradient
        check_node_size(self.node_size)
        _check_bucket_mb(self.bucket_mb)

    def compressor(self) -> DGCCompressor:
        return DGCCompressor(ratio=self.ratio, sample_ratio=self.sample_ratio,
                             warmup_steps=self.warmup_steps, warmup_stages=self.warmup_stages,
                             fp16_values=self.fp16_values, seed=self.seed)

    def memory(self, world_size: int) -> DGCMemory:
        """The memory of each worker: the global ``clip_norm`` scaled by ``world_size ** -0.5``."""
        clip = None if self.clip_norm is None else self.clip_norm / math.sqrt(world_size)
        return DGCMemory(momentum=None, masking=self.momentum_masking, clip_norm=clip,
                         weight_decay_in_gradient=self.weight_decay_in_gradient)

    def allreduce(self, world_size: int) -> AllReduce:
        return AllReduce(bucket_mb=self.bucket_mb, compressor=self.compressor(),
                         memory=self.memory(world_size), node_size=self.node_size)


@dataclass(frozen=True, kw_only=True)
class TopKAllReduce(_Compressed):
    """Exact top-k sparsification with error feedback, all-gathered.

    See :class:`~gossamer.compress.TopK`.

    Args:
        ratio: fraction of each tensor sent, in (0, 1] (default 0.01).
        error_feedback: keep what was not sent for later steps (default True).
        fp16_values: send values as float16 (default False).
        bucket_mb: MiB of gradients per all-gather (default 25).
    """

    name: ClassVar[str] = "topk"

    ratio: float = 0.01  # lower: fewer bytes
    error_feedback: bool = True  # without it top-k drops most of the gradient for good
    fp16_values: bool = False
    bucket_mb: float = 25.0

    def __post_init__(self) -> None:
        check_ratio("ratio", self.ratio)
        _check_bucket_mb(self.bucket_mb)

    def allreduce(self, world_size: int) -> AllReduce:
        return _with_memory(TopK(ratio=self.ratio, fp16_values=self.fp16_values),
                            self.error_feedback, self.bucket_mb)


@dataclass(frozen=True, kw_only=True)
class RandomKAllReduce(_Compressed):
    """Random-k sparsification with error feedback, at positions every worker draws alike.

    Only the values travel, all-reduced. See :class:`~gossamer.compress.RandomK`.

    Args:
        ratio: fraction of each tensor sent, in (0, 1] (default 0.01).
        error_feedback: keep what was not sent (default True).
        seed: seeds the positions (default 0).
        bucket_mb: MiB of gradients per all-reduce (default 25).
    """

    name: ClassVar[str] = "randomk"

    ratio: float = 0.01  # lower: fewer bytes
    error_feedback: bool = True
    seed: int = 0
    bucket_mb: float = 25.0

    def __post_init__(self) -> None:
        check_ratio("ratio", self.ratio)
        check_int("seed", self.seed, minimum=0)
        _check_bucket_mb(self.bucket_mb)

    def allreduce(self, world_size: int) -> AllReduce:
        return _with_memory(RandomK(ratio=self.ratio, seed=self.seed), self.error_feedback,
                            self.bucket_mb)


@dataclass(frozen=True, kw_only=True)
class QSGDAllReduce(_Compressed):
    """QSGD stochastic quantization (Alistarh et al., NeurIPS 2017), all-gathered.

    See :class:`~gossamer.compress.QSGD`.

    Args:
        levels: levels per sign, >= 1 (default 127: 8 bits per element).
        bucket_size: elements per norm (default 512).
        error_feedback: keep the quantization error (default False: QSGD is unbiased).
        seed: seeds the rounding (default 0).
        bucket_mb: MiB of gradients per all-gather (default 25).
    """

    name: ClassVar[str] = "qsgd"

    levels: int = 127  # lower: fewer bits, more variance
    bucket_size: int = 512  # lower: less variance, more norms
    error_feedback: bool = False
    seed: int = 0
    bucket_mb: float = 25.0

    def __post_init__(self) -> None:
        self.compressor()  # checks levels, bucket_size, seed
        _check_bucket_mb(self.bucket_mb)

    def compressor(self) -> QSGD:
        return QSGD(levels=self.levels, bucket_size=self.bucket_size, seed=self.seed)

    def allreduce(self, world_size: int) -> AllReduce:
        return _with_memory(self.compressor(), self.error_feedback, self.bucket_mb)


@dataclass(frozen=True, kw_only=True)
class PowerSGDAllReduce(_Compressed):
    """PowerSGD low-rank compression (Vogels et al., NeurIPS 2019), in two all-reduces.

    Rank-r power iteration with warm start and error feedback. See
    :class:`~gossamer.compress.PowerSGD`.

    Args:
        rank: rank of the approximation, >= 1 (default 2).
        warm_start: reuse the previous step's Q (default True).
        error_feedback: keep what the approximation missed (default True, as the paper).
        seed: seeds the initial Q (default 0).
        bucket_mb: MiB of gradients per all-reduce (default 25).
    """

    name: ClassVar[str] = "powersgd"

    rank: int = 2  # lower: fewer bytes, coarser approximation
    warm_start: bool = True
    error_feedback: bool = True
    seed: int = 0
    bucket_mb: float = 25.0

    def __post_init__(self) -> None:
        self.compressor()  # checks rank, seed
        _check_bucket_mb(self.bucket_mb)

    def compressor(self) -> PowerSGD:
        return PowerSGD(rank=self.rank, warm_start=self.warm_start, seed=self.seed)

    def allreduce(self, world_size: int) -> AllReduce:
        return _with_memory(self.compressor(), self.error_feedback, self.bucket_mb)


@dataclass(frozen=True, kw_only=True)
class FP16AllReduce(_Compressed):
    """Gradients all-reduced in float16 or bfloat16: half the bytes.

    See :class:`~gossamer.compress.FP16`.

    Args:
        dtype: ``"float16"`` (default) or ``"bfloat16"``.
        bucket_mb: MiB of gradients per all-reduce (default 25).
    """

    name: ClassVar[str] = "fp16"

    dtype: str = "float16"  # bfloat16: float32's range, fewer mantissa bits
    bucket_mb: float = 25.0

    def __post_init__(self) -> None:
        if self.dtype not in ("float16", "bfloat16"):
            raise ValueError(f"dtype must be 'float16' or 'bfloat16', got {self.dtype!r}")
        _check_bucket_mb(self.bucket_mb)

    def allreduce(self, world_size: int) -> AllReduce:
        compressor = FP16() if self.dtype == "float16" else BF16()
        return AllReduce(bucket_mb=self.bucket_mb, compressor=compressor)
