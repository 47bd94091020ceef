"""Dense compressors: none (float32 as it is), fp16 and bf16 (half the bytes).

Their payloads are all-reduced (the sum is taken in the narrow dtype, as DDP's
``fp16_compress_hook`` does) or, with ``aggregation="allgather"``, gathered and added in
float32.

Example::

    AllReduce(compressor=FP16())  # half the bytes of AllReduce, the same replicas everywhere
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class FP16(Compressor):
    """Values rounded to float16: 2 bytes per element, relative error <= 2^-11 in range
    (|x| in [6.1e-5, 65504]; larger magnitudes are clamped to 65504)."""

    aggregations: ClassVar[tuple[Aggregation, ...]] = ("allreduce", "allgather")
    dtype: ClassVar[torch.dtype] = torch.float16

    def compress(self, tensor: torch.Tensor, key: str) -> DensePayload:
        values = tensor.detach().reshape(-1)
        if self.dtype == torch.float16:
            limit = torch.finfo(torch.float16).max
            values = values.clamp(-limit, limit)  # inf would poison the sum
        return DensePayload(values.to(self.dtype), tensor.shape)

    def decompress(self, payload: Payload, key: str) -> torch.Tensor:
        assert isinstance(payload, DensePayload)
        return payload.values.to(torch.float32).view(payload.shape)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BF16(FP16):
    """Values rounded to bfloat16: 2 bytes per element, float32's range, relative error
    <= 2^-8."""

    dtype: ClassVar[torch.dtype] = torch.bfloat16
