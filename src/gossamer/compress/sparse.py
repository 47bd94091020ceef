"""Sparsifiers: exact top-k and random-k.

- :class:`TopK` sends the ``k = ceil(ratio * numel)`` elements of largest magnitude, as int32
  positions and values (Aji & Heafield, "Sparse Communication for Distributed Gradient
  Descent", 2017). Payloads differ between workers, so they are all-gathered, or reduced by
  the sparse all-reduce (:mod:`gossamer.compress.sparse_allreduce`).
- :class:`RandomK` sends the elements at ``k`` distinct positions, a uniform random k-subset
  drawn from a generator seeded alike on every worker (Stich et al., "Sparsified SGD with
  Memory", 2018, ``rand_k``): the positions need not travel and the values can be
  all-reduced.

Both are biased (they drop most of the gradient), so use them with
:class:`~gossamer.compress.ErrorFeedback`.

Example::

    AllReduce(compressor=TopK(ratio=0.01), memory=ErrorFeedback())
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from gossamer.checks import check_int
from gossamer.compress import draws
from gossamer.compress.base import Aggregation, Compressor, check_ratio, value_dtype
from gossamer.compress.payloads import Payload, SharedIndexPayload, SparsePayload
from gossamer.options import option

MAX_NUMEL = 2**31 - 1  # int32 positions on the wire


def selected_count(ratio: float, numel: int) -> int:
    """``ceil(ratio * numel)``, at least 1 for a non-empty tensor, at most ``numel`` (the
    product's rounding error is ignored: 0.05 * 120 is 6, not 7)."""
    return min(numel, max(1, math.ceil(ratio * numel * (1 - 1e-12)))) if numel else 0


def check_numel(tensor: torch.Tensor) -> None:
    if tensor.numel() > MAX_NUMEL:
        raise ValueError(f"tensor of {tensor.numel()} elements is too large for int32 "
                         f"positions (at most {MAX_NUMEL})")


def sparse_values(values: torch.Tensor, fp16: bool) -> torch.Tensor:
    """The values as they travel: float16 (clamped to its range), or else float32 (float64 for
    float64 values)."""
    if not fp16:
        return values.to(value_dtype(values.dtype))
    limit = torch.finfo(torch.float16).max
    return values.clamp(-limit, limit).to(torch.float16)


class SparseCompressor(Compressor):
    """Base of the compressors whose payloads hold positions: decompression by index_add_."""

    def decompress(self, payload: Payload, key: str) -> torch.Tensor:
        assert isinstance(payload, (SparsePayload, SharedIndexPayload))
        out = torch.zeros(math.prod(payload.shape), dtype=value_dtype(payload.values.dtype),
                          device=payload.values.device)
        self.decompress_add(payload, key, out)
        return out.view(payload.shape)

    def decompress_add(self, payload: Payload, key: str, out: torch.Tensor) -> None:
        assert isinstance(payload, (SparsePayload, SharedIndexPayload))
        if payload.indices.numel():
            out.view(-1).index_add_(0, payload.indices, payload.values.to(out.dtype))

    def target_count(self, numel: int) -> int:
        """How many of a tensor's ``numel`` elements this compressor means to select at the
        current step (the sparse all-reduce keeps about this many of the sum)."""
        raise NotImplementedError(f"{type(self).__name__} has no target count")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TopK(SparseCompressor):
    """The ``ceil(ratio * numel)`` largest-magnitude elements of each tensor (exact,
    ``torch.topk``).

    Args:
        ratio: fraction of the elements sent, in (0, 1] (default 0.01). Lower: more
            compression, more delay in the error-feedback memory.
        fp16_values: send the values as float16 (default False: float32, or float64 for a
            float64 tensor).
    """

    aggregations: ClassVar[tuple[Aggregation, ...]] = ("allgather", "sparse_allreduce")

    ratio: float = option(0.01, "fraction of each tensor sent, in (0, 1]; lower: fewer bytes, "
                          "more of the gradient delayed")
    fp16_values: bool = option(False, "values as float16: 6 bytes per element sent instead of 8")

    def __post_init__(self) -> None:
        check_ratio("ratio", self.ratio)

    def compress(self, tensor: torch.Tensor, key: str) -> SparsePayload:
        check_numel(tensor)
        flat = tensor.detach().reshape(-1)
        k = selected_count(self.ratio, flat.numel())
        indices = torch.topk(flat.abs(), k, sorted=False).indices
        values = sparse_values(flat.index_select(0, indices), self.fp16_values)
        return SparsePayload(indices.to(torch.int32), values, tensor.shape)

    def target_count(self, numel: int) -> int:
        return selected_count(self.ratio, numel)


def distinct_draws(numel: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` distinct values of ``range(numel)``, a uniform random subset, ascending.

    Uniform draws with replacement, in batches of ``torch.randint``, until at least ``count``
    distinct values have come; then a uniform random ``count`` of them (the first
    ``distinct - count`` of a ``torch.randperm`` of their places are dropped). Given its size,
    the set of distinct values of independent uniform draws is a uniform random subset (every
    relabelling of ``range(numel)`` is as likely), so the result is one too. With ``have``
    distinct values and ``need`` more wanted, a batch is ``need + need * (have + need) //
    (numel - have - need) + 16`` draws, more than enough on average (each draw is new with
    probability at least ``(numel - have - need) / numel``), so one batch is nearly always
    the last. The work is about ``count`` draws and their sort, whatever ``numel``: cheap
    while ``count`` is a small part of it.
    """
    device = generator.device
    values = torch.empty(0, dtype=torch.int64, device=device)
    while values.numel() < count:
        have, need = values.numel(), count - values.numel()
        batch = need + need * (have + need) // max(1, numel - have - need) + 16
        values = torch.unique(torch.cat([values, torch.randint(numel, (batch,),
                                                               generator=generator,
                                                               device=device)]))
    extra = values.numel() - count
    if extra:
        keep = torch.ones(values.numel(), dtype=torch.bool, device=device)
        keep[torch.randperm(values.numel(), generator=generator, device=device)[:extra]] = False
        values = values[keep]
    return values


def random_positions(numel: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """A uniform random k-subset of ``range(numel)``, ascending (int64).

    The smaller of the subset and its complement, ``m = min(k, numel - k)`` positions, is
    drawn: by :func:`distinct_draws` when ``m <= numel / 4`` (the work then grows with ``m``:
    a 25M-element tensor at ratio 0.001 in a few milliseconds), else as the first ``m`` of
    ``torch.randperm(numel)``, cheaper than sorting that many draws. Nothing is drawn at
    ``k == numel``.
    """
    m, device = min(k, numel - k), generator.device
    if m == 0:
        return torch.arange(k, device=device)
    if 4 * m <= numel:
        drawn = distinct_draws(numel, m, generator)
        if m == k:
            return drawn
    else:
        drawn = torch.randperm(numel, generator=generator, device=device)[:m]
    chosen = torch.full((numel,), m != k, dtype=torch.bool, device=device)
    chosen[drawn] = m == k  # the positions drawn are those sent, or those left out
    return chosen.nonzero().view(-1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RandomK(SparseCompressor):
    """The elements at ``k = ceil(ratio * numel)`` distinct positions, a uniform random
    k-subset, the same on every worker and new at every step (only the values are sent, and
    they are all-reduced).

    The positions are drawn without replacement from ``(seed, tensor name, step)``: on the
    CPU by :func:`random_positions` from the CPU generator of that seed, on any other device by
    :func:`gossamer.compress.draws.subset` on the device itself, the same on every GPU
    (:mod:`gossamer.compress.draws`; the workers of a job compute on one kind of device).

    Args:
        ratio: fraction of the elements sent, in (0, 1] (default 0.01).
        seed: seeds the positions (default 0); every worker must use the same.
    """

    aggregations: ClassVar[tuple[Aggregation, ...]] = ("allreduce", "allgather")

    ratio: float = option(0.01, "fraction of each tensor sent, in (0, 1]; lower: fewer bytes, "
                          "more of the gradient delayed")
    seed: int = option(0, "seeds the positions, the same on every worker (they are not sent)")

    def __post_init__(self) -> None:
        check_ratio("ratio", self.ratio)
        check_int("seed", self.seed, minimum=0)

    def compress(self, tensor: torch.Tensor, key: str) -> SharedIndexPayload:
        flat = tensor.detach().reshape(-1)
        numel = flat.numel()
        k = selected_count(self.ratio, numel)
        if draws.on_host(flat.device):
            indices = random_positions(numel, k, self.generator(key, flat.device))
        else:
            indices = draws.subset(self.draw_seed(key), numel, k, flat.device)
        return SharedIndexPayload(indices, flat.index_select(0, indices).to(
            value_dtype(flat.dtype)), tensor.shape)
