"""The statistical quantiser of SparseLoCo's and MuLoCo's authors: values in 2, 4 or 8 bits
around their mean, each bin decoded to the mean of the values it holds.

Over a vector v (a whole tensor, or the kept values of a sparse one):

    shift = mean(v),  c = v - shift
    scale = range_in_sigmas * std(c) / B          B = 2^bits bins, std unbiased;
                                                  1 where that is 0 or not finite
    code  = clamp(round(c / scale + B / 2), 0, B - 1)
    table[b] = mean of the c whose code is b (0 for an empty bin)
    decode(code) = table[code] + shift

The payload is ``shift`` and the table (``1 + B`` float32), then the codes packed ``8 / bits``
to a byte, the first in the low bits. Every worker's table differs, so payloads are
all-gathered, decoded and averaged.

Sources: Sarfi et al., "SparseLoCo" (arXiv 2508.15706), Section 3, and the quantiser of
Therien et al., "MuLoCo: Muon is a practical inner optimizer for DiLoCo" (arXiv 2505.23725),
in the authors' code (github.com/facebookresearch/MuLoCo at 15ee278b,
``torchtitan/torchtitan/components/quantized_outer_sgd.py``, ``QuantizationCompressor``:
``_quantize`` with ``range_in_sigmas`` 6 and ``n_bins`` 4 for 2 bits).

Example::

    compressor = Statistical(bits=2)             # 2 bits per element + 20 bytes per tensor
    payload = compressor.compress(delta, "w")
    approx = compressor.decompress(payload, "w")
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from gossamer.compress.base import Aggregation, Compressor
from gossamer.compress.memory import ErrorFeedback
from gossamer.compress.payloads import Payload, QuantizedPayload
from gossamer.compress.qsgd import pack_codes, unpack_codes
from gossamer.compress.registry import Compression
from gossamer.options import option, option_of

__all__ = ["QUANTISER_BITS", "Statistical", "StatisticalCompression", "StatisticalQuantiser"]

#: the widths the quantiser takes
QUANTISER_BITS = (2, 4, 8)


def check_range(value: object) -> None:
    """``range_in_sigmas``: a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"range_in_sigmas: must be a number > 0, got {value!r}")


class StatisticalQuantiser:
    """The quantiser of a 1-D vector into ``bits`` bits (2, 4 or 8): a shift (the mean),
    ``B = 2^bits`` bins of width ``range_in_sigmas * std / B`` around it, and each bin decoded
    to the mean of the centred values in it."""

    def __init__(self, bits: int, range_in_sigmas: float) -> None:
        if bits not in QUANTISER_BITS:
            raise ValueError(f"bits: must be one of {', '.join(map(str, QUANTISER_BITS))}, "
                             f"got {bits!r}")
        check_range(range_in_sigmas)
        self.bits = bits
        self.bins = 2 ** bits
        self.range_in_sigmas = range_in_sigmas

    def header_bytes(self) -> int:
        """The shift and the table: ``1 + B`` float32."""
        return 4 * (1 + self.bins)

    def code_bytes(self, count: int) -> int:
        return -(-count * self.bits // 8)

    def encode(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the header, float32 ``[shift, table...]``; the codes, int64) of the 1-D
        ``values``."""
        v = values.detach().to(torch.float32)
        shift = v.mean() if v.numel() else v.new_zeros(())
        centred = v - shift
        std = centred.norm() / math.sqrt(v.numel() - 1) if v.numel() > 1 else \
            v.new_zeros(())
        scale = self.range_in_sigmas * std / self.bins
        scale = torch.where((scale > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))
        codes = torch.round(centred / scale + self.bins // 2).clamp_(0, self.bins - 1).long()
        sums = torch.zeros(self.bins, dtype=torch.float32, device=v.device).index_add_(
            0, codes, centred)
        # (counted by index_add_, exact below 2^24 values: bincount has no meta kernel for
        # the timing-only simulator)
        counts = torch.zeros_like(sums).index_add_(0, codes, torch.ones_like(centred))
        table = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
        return torch.cat([shift.view(1), table]), codes

    def decode(self, header: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """The float32 values of ``codes`` under ``header`` (or of each row of ``codes`` under
        the same row of ``header``)."""
        if header.dim() == 1:
            return header[1:].index_select(0, codes) + header[0]
        return torch.gather(header[:, 1:], 1, codes) + header[:, :1]  # one row per payload

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes`` (each below B) packed ``8 / bits`` to a uint8, the first in the low bits."""
        return pack_codes(codes, self.bits)

    def unpack(self, data: torch.Tensor, count: int) -> torch.Tensor:
        """The ``count`` codes :meth:`pack` packed into ``data`` (int64), or those of each row
        of a 2-D ``data``."""
        if data.dim() == 1:
            return unpack_codes(data, self.bits, count).long()
        shifts = torch.arange(0, 8, self.bits, dtype=torch.uint8, device=data.device)
        codes = (data.unsqueeze(-1) >> shifts) & (2**self.bits - 1)
        return codes.flatten(-2)[..., :count].long()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Statistical(Compressor):
    """Each tensor quantised whole by :class:`StatisticalQuantiser`, all-gathered.

    Args:
        bits: 2 (default), 4 or 8 bits per element. Lower: fewer bytes, coarser values.
        range_in_sigmas: the bins span this many standard deviations (default 6, the
            authors'). Lower: finer bins, more values clamped into the outer ones.
    """

    aggregations: ClassVar[tuple[Aggregation, ...]] = ("allgather",)

    bits: int = option(2, "bits per element: 2, 4 or 8; lower: fewer bytes, coarser values")
    range_in_sigmas: float = option(6.0, "the bins span this many standard deviations of the "
                                    "tensor")

    def __post_init__(self) -> None:
        self.quantiser  # noqa: B018 - its checks name the options

    @property
    def quantiser(self) -> StatisticalQuantiser:
        return StatisticalQuantiser(self.bits, self.range_in_sigmas)

    def compress(self, tensor: torch.Tensor, key: str) -> QuantizedPayload:
        quantiser = self.quantiser
        header, codes = quantiser.encode(tensor.detach().reshape(-1))
        return QuantizedPayload(header, quantiser.pack(codes), self.bits, tensor.numel(),
                                tensor.shape)

    def decompress(self, payload: Payload, key: str) -> torch.Tensor:
        assert isinstance(payload, QuantizedPayload)
        quantiser = self.quantiser
        codes = quantiser.unpack(payload.codes, payload.numel)
        return quantiser.decode(payload.norms, codes).view(payload.shape)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StatisticalCompression(Compression):
    """:class:`Statistical` with error feedback whose residual decays by ``error_decay``:
    the pseudo-gradient compression of MuLoCo (:class:`~gossamer.algorithms.MuLoCo` builds it
    from its options; it is not a ``--compressor`` name)."""

    name: ClassVar[str] = "statistical"

    bits: int = option_of(Statistical, "bits")
    range_in_sigmas: float = option_of(Statistical, "range_in_sigmas")
    error_decay: float = option(1.0, "beta: the residual's factor before the next "
                                "pseudo-gradient is added")

    def build(self, world_size: int) -> tuple[Statistical, ErrorFeedback]:
        return (Statistical(bits=self.bits, range_in_sigmas=self.range_in_sigmas),
                ErrorFeedback(decay=self.error_decay))
