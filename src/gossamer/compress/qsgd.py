"""QSGD: stochastic quantization to ``s`` levels per sign.

Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient Quantization and Encoding"
(NeurIPS 2017). Each bucket of ``d`` elements is sent as its norm and, per element, a signed
level ``l`` in ``{-s..s}``: with ``r = s |x_i| / ||x||``, ``|l| = floor(r)`` or ``floor(r) + 1``
with probability ``r - floor(r)``. The decoded ``||x|| l / s`` is unbiased, each element is off
by less than ``||x|| / s``, and the variance is at most ``min(d / s^2, sqrt(d) / s) ||x||^2``.

The rounding is computed signed, as ``l = floor(s x_i / ||x|| + u_i)`` with ``u_i`` uniform on
[0, 1): for ``x_i >= 0`` it rounds ``r`` up when ``u_i >= 1 - frac(r)``, for ``x_i < 0`` when
``u_i < frac(r)``, each with probability ``frac(r)``, so ``l`` has exactly the distribution of the
paper's ``sgn(x_i) |l|`` (unbiased, the same variance). The draws: ``u_i = (pi(i mod p) + v) / p``
for a random permutation ``pi`` of ``0..p-1`` (``p = min(numel, 2^16)``) and a random shift ``v``
in [0, 1), fresh at every call. Each ``u_i`` is uniform on [0, 1) as in the paper; unlike the
paper's, the draws are not independent (positions ``2^16`` apart share one, nearer ones are
distinct), which changes neither the expectation nor the variance of any element, so neither the
paper's unbiasedness nor its variance bound, and costs 2^16 draws instead of one per element.
On the CPU the tensor is quantized in chunks that stay in its cache; on another device in one
pass, with counter-based draws made there (:mod:`gossamer.compress.draws`: the same on every
device; the CPU keeps its generator's draws, so a CPU run rounds as it always has).

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
from gossamer.compress import draws
from gossamer.compress.base import Aggregation, Compressor, value_dtype
from gossamer.compress.payloads import Payload, QuantizedPayload
from gossamer.options import option

MAX_LEVELS = 2**15 - 1  # 2 s + 1 values must fit in 16 bits
DITHER_PERIOD = 1 << 16  # positions this far apart share a uniform draw
CHUNK = 1 << 18  # elements quantized at a time (1 MiB of float32): its passes stay in cache


def dither(numel: int, generator: torch.Generator) -> torch.Tensor:
    """The uniform draws of QSGD's rounding, float64: ``(pi(i) + v) / p`` for ``i < p``,
    ``p = min(numel, 2^16)``, ``pi`` a random permutation of ``0..p-1`` and ``v`` a random shift
    in [0, 1) (drawn in that order from ``generator``, on its device). Position ``i`` uses
    draw ``i mod p``."""
    period = max(1, min(numel, DITHER_PERIOD))
    perm = torch.randperm(period, generator=generator, dtype=torch.float64,
                          device=generator.device)
    shift = torch.rand((), generator=generator, dtype=torch.float64, device=generator.device)
    return perm.add_(shift).div_(period)


def counter_dither(numel: int, seed: int, device: torch.device) -> torch.Tensor:
    """:func:`dither` from counter-based draws on ``device`` (the same on every device):
    ``pi`` is :func:`gossamer.compress.draws.permutation` and ``v`` the first
    :func:`gossamer.compress.draws.uniform` of stream 1."""
    period = max(1, min(numel, DITHER_PERIOD))
    perm = draws.permutation(seed, period, device).to(torch.float64)
    shift = draws.uniform(seed, 1, device, stream=1)
    return perm.add_(shift).div_(period)


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
        norms = flat.new_zeros(max(1, math.ceil(numel / d)))
        codes = torch.empty(numel, dtype=torch.uint8 if self.bits <= 8 else torch.int16,
                            device=flat.device)
        if draws.on_host(flat.device):
            uniforms = dither(numel, self.generator(key, flat.device, per_worker=True))
            chunk = d * max(1, CHUNK // d)  # in the CPU's cache
        else:  # one pass over the whole tensor, with the same draws on every device
            uniforms = counter_dither(numel, self.draw_seed(key, per_worker=True), flat.device)
            chunk = d * max(1, -(-numel // d))
        period = uniforms.numel()
        # s + u_i, repeated so that any chunk reads its draws as one slice
        offset = (uniforms + s).to(flat.dtype).repeat(-(-(period + chunk) // period))
        work = flat.new_empty(chunk)
        whole = torch.empty(chunk, dtype=torch.int32, device=flat.device)
        for start in range(0, numel, chunk):
            stop = min(start + chunk, numel)
            size, part = stop - start, flat[start:stop]
            buckets = -(-size // d)
            if size % d:  # the last bucket, zero-padded
                part = torch.cat([part, part.new_zeros(buckets * d - size)])
            rows = part.view(buckets, d)
            first = start // d
            mine = norms[first:first + buckets]
            torch.linalg.vector_norm(rows, dim=1, out=mine)
            scale = torch.where(mine > 0, s / mine, torch.zeros_like(mine))
            level = work[:buckets * d]
            torch.mul(rows, scale.unsqueeze(1), out=level.view(buckets, d))  # in [-s, s]
            level = level[:size].add_(offset[start % period:start % period + size])
            level.clamp_(0, 2 * s)  # s x / |x| + s + u, floored below: a code in [0, 2 s]
            whole[:size].copy_(level)  # truncation: the floor of a non-negative number
            codes[start:stop].copy_(whole[:size])
        return QuantizedPayload(norms, pack_codes(codes, self.bits), self.bits, numel,
                                tensor.shape)

    def decompress(self, payload: Payload, key: str) -> torch.Tensor:
        assert isinstance(payload, QuantizedPayload)
        numel, d, s = payload.numel, self.bucket_size, self.levels
        codes = unpack_codes(payload.codes, payload.bits, numel).to(payload.norms.dtype) - s
        buckets = payload.norms.numel()
        padded = torch.zeros(buckets * d, dtype=codes.dtype, device=codes.device)
        padded[:numel] = codes
        values = padded.view(buckets, d).mul_((payload.norms / s).unsqueeze(1))
        return values.reshape(-1)[:numel].view(payload.shape).clone()
