"""Tensors that are a part of a larger one: the local shards of a sharded model.

On a model sharded with FSDP2 (:mod:`gossamer.sharding`) a method sees each parameter's local
shard: a run of consecutive elements (whole rows) of the whole tensor, in its row-major
order. Most methods need no more: their arithmetic is element-wise or per tensor. Those that
draw or group by whole tensors ask here what the whole is, so that every shard takes its share
of what the whole tensor would take and the sharded run does what the unsharded one does:
SPARTA draws its positions over the whole tensor and keeps those of its part, Streaming DiLoCo
cuts the model into fragments by the whole tensors' sizes. And a method that reads the
optimizer's settings of a parameter (DeMo's learning rate and weight decay) looks up the
tensor the optimizer holds in the part's place (:func:`held`): the sharded parameter.

A tensor never marked is a whole of its own (``Part(numel, 0)``), which the optimizer holds
itself.

Example::

    mark_part(shard, numel=64 * 20, start=32 * 20)  # rows 32 to 63 of a 64 x 20 weight
    part_of(shard)  # Part(numel=1280, start=640)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["Part", "held", "keep_part", "mark_part", "part_of"]


class Part(NamedTuple):
    """Where a tensor lies in the whole tensor it is part of."""

    numel: int  # elements of the whole tensor
    start: int  # flat position, in the whole's row-major order, of the part's first element


#: tensor -> its Part, and the tensor an optimizer holds in its place; weakly (by identity:
#: a part dropped is forgotten)
_PARTS = WeakTensorKeyDictionary()
_HELD = WeakTensorKeyDictionary()


def mark_part(t: torch.Tensor, numel: int, start: int,
              held_as: torch.Tensor | None = None) -> None:
    """Record that ``t``'s elements are those at flat positions ``start`` to ``start +
    t.numel()`` of a whole tensor of ``numel`` elements, and that an optimizer holds
    ``held_as`` in its place (default: ``t`` itself)."""
    if not 0 <= start <= start + t.numel() <= numel:
        raise ValueError(f"start: a part of {t.numel()} elements at {start} does not lie in a "
                         f"whole of {numel}")
    _PARTS[t] = Part(int(numel), int(start))
    if held_as is not None:
        _HELD[t] = held_as


def held(t: torch.Tensor) -> torch.Tensor:
    """The tensor that an optimizer over the model holds in ``t``'s place: the sharded
    parameter whose local shard ``t`` is, or ``t`` itself."""
    return _HELD.get(t, t)


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
