"""QSGD: stochastic quantization to ``s`` levels per sign.

Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient Quantization and Encoding"
(NeurIPS 2017). Each bucket of ``d`` elements is sent as its norm and, per element, a signed
level ``l`` in ``{-s..s}``: with ``r = s |x_i| / ||x||``, ``|l| = floor(r)`` or ``floor(r) + 1``
with probability ``r - floor(r)``. The decoded ``||x|| l / s`` is unbiased, each element is off
by less than ``||x|| / s``, and the variance is at most ``min(d / s^2, sqrt(d) / s) ||x||^2``.

Levels are packed at 2, 4, 8 or 16 bits (the fewest that hold ``2 s + 1`` values): ``s = 1``
costs 2 bits per element, ``s <= 7`` 4 bits, ``s <= 127`` 8 bits. Payloads differ between
workers (their norms), so they are all-gathered. Rounding is seeded per worker.

Example::

    AllReduce(compressor=QSGD(levels=7))  # 4 bits per element, 8x fewer bytes
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from gossamer.checks import check_int
from gossamer.compress.base import Aggregation, Compressor, value_dtype
from gossamer.compress.payloads import Payload, QuantizedPayload
from gossamer.options import option

MAX_LEVELS = 2**15 - 1  # 2 s + 1 values must fit in 16 bits


def code_bits(levels: int) -> int:
    """Bits per element for ``levels`` levels per sign: 2, 4, 8 or 16."""
    for bits in (2, 4, 8, 16):
        if 2 * levels + 1 <= 2**bits:
            return bits
    raise ValueError(f"levels must be <= {MAX_LEVELS}, got {levels}")


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative integer codes (< 2^bits) packed into uint8, little end first."""
    if bits == 16:
        return codes.to(torch.int16).view(torch.uint8) if codes.numel() else \
            torch.empty(0, dtype=torch.uint8, device=codes.device)
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes
    per_byte = 8 // bits
    pad = -codes.numel() % per_byte
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    groups = codes.view(-1, per_byte)
    packed = groups[:, 0].clone()
    for j in range(1, per_byte):
        packed |= groups[:, j] << (bits * j)
    return packed


def unpack_codes(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The int32 codes of :func:`pack_codes`."""
    if bits == 16:
        return (packed.view(torch.int16).to(torch.int32) & 0xFFFF)[:numel]  # unsigned
    if bits == 8:
        return packed.to(torch.int32)[:numel]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(1) >> shifts) & (2**bits - 1)
    return codes.reshape(-1)[:numel].to(torch.int32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class QSGD(Compressor):
    """Unbiased stochastic quantization of each bucket of elements to ``levels`` levels.

    Args:
        levels: levels per sign, ``s`` >= 1 (default 127: 8 bits per element). Lower: fewer
            bits, more variance.
        bucket_size: elements that share one norm (default 512, as the paper). Lower: less
            variance, 4 more bytes per bucket.
        seed: seeds the rounding, mixed with the worker's index (default 0).
    """

    aggregations: ClassVar[tuple[Aggregation, ...]] = ("allgather",)

    levels: int = option(127, "levels per sign (127: 8 bits per element; 7: 4 bits; 1: 2 "
                         "bits); lower: fewer bits, noisier gradient")
    bucket_size: int = option(512, "elements per norm; lower: less variance, more norms sent")
    seed: int = option(0, "seeds the rounding (mixed with the worker's index)")

    def __post_init__(self) -> None:
        check_int("levels", self.levels, minimum=1)
        if self.levels > MAX_LEVELS:
            raise ValueError(f"levels must be <= {MAX_LEVELS}, got {self.levels}")
        check_int("bucket_size", self.bucket_size, minimum=1)
        check_int("seed", self.seed, minimum=0)

    @property
    def bits(self) -> int:
        return code_bits(self.levels)

    def compress(self, tensor: torch.Tensor, key: str) -> QuantizedPayload:
        flat = tensor.detach().reshape(-1).to(value_dtype(tensor.dtype))
        numel, d, s = flat.numel(), self.bucket_size, self.levels
        buckets = max(1, math.ceil(numel / d))
        padded = torch.zeros(buckets * d, dtype=flat.dtype, device=flat.device)
        padded[:numel] = flat
        rows = padded.view(buckets, d)
        norms = torch.linalg.vector_norm(rows, dim=1)
        scale = torch.where(norms > 0, s / norms, torch.zeros_like(norms))
        level = rows.abs().mul_(scale.unsqueeze(1))  # in [0, s]
        floor = level.floor()
        generator = self.generator(key, torch.device("cpu"), per_worker=True)
        noise = torch.rand(level.shape, generator=generator).to(flat.device, flat.dtype)
        floor += (noise < level - floor).to(floor.dtype)  # round up with prob. frac
        codes = (floor.clamp_(max=s) * rows.sign()).reshape(-1)[:numel] + s  # in [0, 2 s]
        return QuantizedPayload(norms, pack_codes(codes.to(torch.int32), self.bits),
                                self.bits, numel, tensor.shape)

    def decompress(self, payload: Payload, key: str) -> torch.Tensor:
        assert isinstance(payload, QuantizedPayload)
        numel, d, s = payload.numel, self.bucket_size, self.levels
        codes = unpack_codes(payload.codes, payload.bits, numel).to(payload.norms.dtype) - s
        buckets = payload.norms.numel()
        padded = torch.zeros(buckets * d, dtype=codes.dtype, device=codes.device)
        padded[:numel] = codes
        values = padded.view(buckets, d).mul_((payload.norms / s).unsqueeze(1))
        return values.reshape(-1)[:numel].view(payload.shape).clone()
