"""Tensors that are a part of a larger one: the local shards of a sharded model.

On a model sharded with FSDP2 (:mod:`gossamer.sharding`) a method sees each parameter's local
shard: a run of consecutive elements (whole rows) of the whole tensor, in its row-major
order. Most methods need no more: their arithmetic is element-wise or per tensor. Those that
draw or group by whole tensors ask here what the whole is, so that every shard takes its share
of what the whole tensor would take and the sharded run does what the unsharded one does:
SPARTA draws its positions over the whole tensor and keeps those of its part, Streaming DiLoCo
cuts the model into fragments by the whole tensors' sizes.

A tensor never marked is a whole of its own (``Part(numel, 0)``).

Example::

    mark_part(shard, numel=64 * 20, start=32 * 20)  # rows 32 to 63 of a 64 x 20 weight
    part_of(shard)  # Part(numel=1280, start=640)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["Part", "keep_part", "mark_part", "part_of"]


class Part(NamedTuple):
    """Where a tensor lies in the whole tensor it is part of."""

    numel: int  # elements of the whole tensor
    start: int  # flat position, in the whole's row-major order, of the part's first element


#: tensor -> its Part, weakly (by identity: a part dropped is forgotten)
_PARTS = WeakTensorKeyDictionary()


def mark_part(t: torch.Tensor, numel: int, start: int) -> None:
    """Record that ``t``'s elements are those at flat positions ``start`` to ``start +
    t.numel()`` of a whole tensor of ``numel`` elements."""
    if not 0 <= start <= start + t.numel() <= numel:
        raise ValueError(f"start: a part of {t.numel()} elements at {start} does not lie in a "
                         f"whole of {numel}")
    _PARTS[t] = Part(int(numel), int(start))


def part_of(t: torch.Tensor) -> Part:
    """Where ``t`` lies in its whole tensor (itself, where it was never marked)."""
    return _PARTS.get(t, Part(t.numel(), 0))


def keep_part(t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Of ``positions`` (flat, in the whole tensor of ``t``: sorted or not), those that fall
    in ``t``, as positions in ``t``, in the order given."""
    numel, start = part_of(t)
    if numel == t.numel():
        return positions
    inside = (positions >= start) & (positions < start + t.numel())
    return positions[inside] - start
