"""Dense compressors: none (float32 as it is), fp16 and bf16 (half the bytes).

Their payloads are all-reduced or, with ``aggregation="allgather"``, gathered and added in
float32. All-reduced, a casting compressor sends each worker's share of the average, in DDP's
order (``fp16_compress_hook``: ``buffer.to(dtype).div_(world_size)``): the values are cast
to the narrow dtype, then divided by the number of workers in it, and the shares are summed
in the narrow dtype. The sum is then the average, so it stays in range wherever the average
does (summing first and dividing afterwards overflows float16 as soon as the sum passes
65504, although every value and the average fit).

Example::

    AllReduce(compressor=FP16())  # half the bytes of AllReduce, the same replicas everywhere
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import torch

from gossamer.compress.base import Aggregation, Compressor
from gossamer.compress.payloads import DensePayload, Payload


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoCompression(Compressor):
    """Every element in its own dtype: the reference the others are measured against."""

    aggregations: ClassVar[tuple[Aggregation, ...]] = ("allreduce", "allgather")

    def compress(self, tensor: torch.Tensor, key: str) -> DensePayload:
        return DensePayload(tensor.detach().reshape(-1).clone(), tensor.shape)

    def decompress(self, payload: Payload, key: str) -> torch.Tensor:
        assert isinstance(payload, DensePayload)
        return payload.values.view(payload.shape).clone()


@functools.lru_cache(maxsize=64)  # per bucket and step otherwise: the same few pairs
def share_limit(dtype: torch.dtype, world_size: int) -> float:
    """The largest magnitude of ``dtype`` that ``world_size`` shares may each have so that
    their sum, added in ``dtype`` in any order (a ring, a tree), is finite.

    Each addition rounds to nearest, at most a factor ``1 + eps / 2`` up, and a share goes
    through at most ``world_size - 1`` of them, so ``world_size * limit * (1 + eps / 2) **
    (world_size - 1) <= max`` is enough (float16, 4 workers: 16352, against 65504 / 4 = 16376).
    """
    info = torch.finfo(dtype)
    bound = info.max / (world_size * (1 + info.eps / 2) ** (world_size - 1))
    limit = torch.tensor(bound, dtype=torch.float64).to(dtype)
    if float(limit) > bound:  # rounded up: the next one down
        limit = torch.nextafter(limit, torch.zeros_like(limit))
    return float(limit)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FP16(Compressor):
    """Values rounded to float16: 2 bytes per element, relative error <= 2^-11 in range
    (|x| in [6.1e-5, 65504]; larger magnitudes are clamped to 65504).

    All-reduced over ``n`` workers (see :meth:`share`), each worker sends its share
    ``fp16(x) / n``, rounded once more where the division is not exact (n not a power of two,
    or a share below float16's normal range), and clamped so that the sum of the shares
    cannot overflow (:func:`share_limit`: about 65504 / n). With error feedback, the residual
    keeps what the roundings and clamps left out.
    """

    aggregations: ClassVar[tuple[Aggregation, ...]] = ("allreduce", "allgather")
    dtype: ClassVar[torch.dtype] = torch.float16

    def compress(self, tensor: torch.Tensor, key: str) -> DensePayload:
        return self.share(tensor, key, 1)

    def share(self, tensor: torch.Tensor, key: str, world_size: int) -> DensePayload:
        """The payload of ``tensor``; with ``world_size`` > 1, its share of an all-reduced
        average over that many workers: cast, then divided by ``world_size`` in the narrow
        dtype, as DDP's ``fp16_compress_hook`` does, so that the shares' sum is the
        average."""
        limit = torch.finfo(self.dtype).max
        values = tensor.detach().reshape(-1).clamp(-limit, limit)  # inf would poison the sum
        values = values.to(self.dtype)
        if world_size > 1:
            share = share_limit(self.dtype, world_size)
            values = values.div(world_size).clamp_(-share, share)
        return DensePayload(values, tensor.shape, divisor=world_size)

    def decompress(self, payload: Payload, key: str) -> torch.Tensor:
        """The tensor the payload stands for, in float32: a share times its divisor (what this
        worker contributed to the sum, exactly: a float16 or bfloat16 value times a small
        integer is a float32 one)."""
        assert isinstance(payload, DensePayload)
        out = payload.values.to(torch.float32).view(payload.shape)
        return out.mul_(payload.divisor) if payload.divisor != 1 else out

    def decompress_average(self, summed: Payload, key: str, world_size: int) -> torch.Tensor:
        """The average from the all-reduced sum of the workers' shares: that sum itself, in
        float32 (the sum of the workers' tensors, ``decompress_sum``, is n times it)."""
        assert isinstance(summed, DensePayload)
        return summed.values.to(torch.float32).view(summed.shape)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BF16(FP16):
    """Values rounded to bfloat16: 2 bytes per element, float32's range, relative error
    <= 2^-8 (shares of an all-reduce as :class:`FP16`'s)."""

    dtype: ClassVar[torch.dtype] = torch.bfloat16
