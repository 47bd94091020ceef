"""Typed payloads: what one worker sends for one tensor, and its exact size on the wire.

Two ways to move payloads, one collective per bucket of tensors each:

- all-reduce: :meth:`Payload.wire` is a flat tensor whose sum over workers is the wire of the
  sum (fp16 values, low-rank factors, random-k values at shared indices);
  :meth:`Payload.with_wire` rebuilds the payload around the summed tensor.
- all-gather: :meth:`Payload.to_bytes` is a flat uint8 tensor, padded to 4 bytes so that the
  next payload's int32 and float fields stay aligned; :meth:`Payload.from_bytes` reads one
  back, given this worker's payload of the same tensor as the template (shape, dtypes).

:func:`pack_bytes` / :func:`unpack_bytes` put a bucket's payloads in one uint8 tensor behind an
int32 header of their lengths: the header is sent, so it is counted.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

ALIGN = 4  # bytes: every payload starts at a multiple of this in a packed bucket


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _padded(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The bytes of ``parts`` one after the other, zero-padded to a multiple of ALIGN."""
    data = [_bytes(p) for p in parts]
    size = sum(d.numel() for d in data)
    pad = -size % ALIGN
    device = parts[0].device if parts else torch.device("cpu")
    if pad:
        data.append(torch.zeros(pad, dtype=torch.uint8, device=device))
    if not data:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.cat(data)


def _take(data: torch.Tensor, offset: int, count: int, dtype: torch.dtype
          ) -> tuple[torch.Tensor, int]:
    """``count`` elements of ``dtype`` at byte ``offset`` of ``data``; the next offset."""
    itemsize = dtype.itemsize
    size = count * itemsize
    chunk = data[offset : offset + size]
    if chunk.numel() != size:
        raise ValueError(f"payload truncated: {size} bytes expected at {offset}, "
                         f"{chunk.numel()} there")
    if chunk.storage_offset() % itemsize:  # a view needs aligned storage
        chunk = chunk.clone()
    return chunk.view(dtype), offset + size


class Payload(ABC):
    """One worker's message for one tensor."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes this payload puts on the wire (all-gather: before the 4-byte alignment)."""

    def wire(self) -> torch.Tensor:
        """The flat tensor that is all-reduced."""
        raise ValueError(f"{type(self).__name__} cannot be all-reduced")

    def with_wire(self, wire: torch.Tensor) -> Payload:
        """This payload around ``wire`` (the sum of every worker's :meth:`wire`)."""
        raise ValueError(f"{type(self).__name__} cannot be all-reduced")

    @abstractmethod
    def to_bytes(self) -> torch.Tensor:
        """The bytes that are all-gathered, padded to a multiple of 4."""

    @abstractmethod
    def from_bytes(self, data: torch.Tensor) -> Payload:
        """Another worker's payload of the same tensor, read from its bytes (``self`` is the
        template: shapes and dtypes)."""


class _ValuesPayload(Payload):
    """A payload whose wire is its ``values`` alone (the rest is known to every worker)."""

    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size()

    def wire(self) -> torch.Tensor:
        return self.values

    def with_wire(self, wire: torch.Tensor) -> _ValuesPayload:
        return replace(self, values=wire)

    def to_bytes(self) -> torch.Tensor:
        return _padded([self.values])

    def from_bytes(self, data: torch.Tensor) -> _ValuesPayload:
        values, _ = _take(data, 0, self.values.numel(), self.values.dtype)
        return replace(self, values=values)


@dataclass(frozen=True)
class DensePayload(_ValuesPayload):
    """Every element, possibly in a narrower dtype (fp16, bf16), divided by ``divisor``: a
    share of an average over that many workers, which the all-reduce sums (1: the tensor
    itself). The divisor is known to every worker and does not travel."""

    values: torch.Tensor  # flat
    shape: torch.Size
    divisor: int = 1


@dataclass(frozen=True)
class SparsePayload(Payload):
    """Selected elements: int32 positions in the flattened tensor and their values."""

    indices: torch.Tensor  # int32
    values: torch.Tensor  # float16, float32 or float64
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        return 4 * self.indices.numel() + self.values.numel() * self.values.element_size()

    def to_bytes(self) -> torch.Tensor:
        return _padded([self.indices, self.values])  # int32 first: the values stay aligned

    def from_bytes(self, data: torch.Tensor) -> SparsePayload:
        count = data.numel() // (4 + self.values.element_size())
        indices, offset = _take(data, 0, count, torch.int32)
        values, _ = _take(data, offset, count, self.values.dtype)
        return SparsePayload(indices, values, self.shape)


@dataclass(frozen=True)
class SharedIndexPayload(_ValuesPayload):
    """Values at positions every worker draws alike (random-k): only the values travel."""

    indices: torch.Tensor  # int64, the same on every worker; not sent
    values: torch.Tensor
    shape: torch.Size


@dataclass(frozen=True)
class QuantizedPayload(Payload):
    """QSGD: one norm per bucket of elements (float32, float64 for a float64 tensor) and a
    packed signed level per element; the statistical quantiser: its shift and bin table in
    ``norms`` and a packed bin per element."""

    norms: torch.Tensor  # one per bucket
    codes: torch.Tensor  # uint8, levels + s packed at ``bits`` bits each
    bits: int
    numel: int
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        return self.norms.numel() * self.norms.element_size() + self.codes.numel()

    def to_bytes(self) -> torch.Tensor:
        return _padded([self.norms, self.codes])

    def from_bytes(self, data: torch.Tensor) -> QuantizedPayload:
        norms, offset = _take(data, 0, self.norms.numel(), self.norms.dtype)
        codes, _ = _take(data, offset, self.codes.numel(), torch.uint8)
        return replace(self, norms=norms, codes=codes)


@dataclass(frozen=True)
class LowRankPayload(Payload):
    """One PowerSGD factor (P, n x r, then Q, m x r); the factors of a sum are summed."""

    factor: torch.Tensor
    shape: torch.Size  # of the tensor it approximates

    @property
    def nbytes(self) -> int:
        return self.factor.numel() * self.factor.element_size()

    def wire(self) -> torch.Tensor:
        return self.factor.reshape(-1)

    def with_wire(self, wire: torch.Tensor) -> LowRankPayload:
        return replace(self, factor=wire.view(self.factor.shape))

    def to_bytes(self) -> torch.Tensor:
        return _padded([self.factor])

    def from_bytes(self, data: torch.Tensor) -> LowRankPayload:
        values, _ = _take(data, 0, self.factor.numel(), self.factor.dtype)
        return replace(self, factor=values.view(self.factor.shape))


def pack_bytes(payloads: Sequence[Payload]) -> torch.Tensor:
    """One uint8 tensor: an int32 header (each payload's padded length), then the payloads."""
    bodies = [p.to_bytes() for p in payloads]
    device = bodies[0].device if bodies else torch.device("cpu")
    header = torch.tensor([b.numel() for b in bodies], dtype=torch.int32, device=device)
    return torch.cat([_bytes(header), *bodies])


def unpack_bytes(data: torch.Tensor, templates: Sequence[Payload]) -> list[Payload]:
    """The payloads of another worker's :func:`pack_bytes`, read with this worker's payloads
    of the same tensors as templates."""
    lengths, offset = _take(data, 0, len(templates), torch.int32)
    out = []
    for template, length in zip(templates, lengths.tolist(), strict=True):
        out.append(template.from_bytes(data[offset : offset + length]))
        offset += length
    if offset != data.numel():
        raise ValueError(f"packed payloads hold {data.numel()} bytes, the header accounts "
                         f"for {offset}")
    return out
