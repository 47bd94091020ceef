"""Flat buckets: many small tensors packed into a few large buffers, so that one collective
moves them all (fewer messages, so less latency paid)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Slot = tuple[int, int, int]  # a tensor's (bucket, offset, numel)
Kind = tuple[torch.dtype, torch.device]  # a bucket's


class Buckets:
    """Tensors packed into flat buffers of at most ``bucket_bytes`` each.

    A bucket holds tensors of one dtype and device; a tensor larger than ``bucket_bytes`` gets
    a bucket of its own. ``bucket_bytes=None`` puts each dtype/device in a single bucket.
    ``first_bytes`` caps the first bucket instead (default: ``bucket_bytes``).

    Example::

        buckets = Buckets([p for p in model.parameters()], bucket_bytes=25 * 2**20)
        buckets.gather([p.grad for p in model.parameters()])
        for buffer in buckets.buffers:
            comm.all_reduce(buffer, op="mean")
        buckets.scatter([p.grad for p in model.parameters()])
    """

    def __init__(self, tensors: Sequence[torch.Tensor], bucket_bytes: int | None,
                 first_bytes: int | None = None) -> None:
        if bucket_bytes is not None and bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        if first_bytes is not None and first_bytes <= 0:
            raise ValueError(f"first_bytes must be > 0, got {first_bytes}")
        self.shapes = [t.shape for t in tensors]
        # (bucket, offset, numel) per tensor
        self.slots, sizes, kinds = layout(tensors, bucket_bytes, first_bytes)
        self.buffers = [
            torch.zeros(size, dtype=dtype, device=device)
            for size, (dtype, device) in zip(sizes, kinds, strict=True)
        ]
        #: per tensor, the part of its bucket that holds it, shaped like it
        self.views = [
            self.buffers[bucket][offset : offset + numel].view(shape)
            for (bucket, offset, numel), shape in zip(self.slots, self.shapes, strict=True)
        ]

    @torch.no_grad()
    def gather(self, tensors: Sequence[torch.Tensor | None]) -> None:
        """Copy ``tensors`` into the buckets (None counts as zeros)."""
        views, sources = [], []
        for view, t in zip(self.views, tensors, strict=True):
            if t is None:
                view.zero_()
            else:
                views.append(view)
                sources.append(t)
        _copy_all(views, sources)

    @torch.no_grad()
    def scatter(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy the buckets back into ``tensors``."""
        _copy_all(list(tensors), self.views)


def _copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for every i, as one call where the devices allow (a
    model's hundreds of tensors are otherwise hundreds of calls)."""
    if targets and len({t.device for t in (*targets, *sources)}) == 1:
        torch._foreach_copy_(targets, sources)
    else:
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source)


@torch.no_grad()
def apply_flat(tensors: Sequence[torch.Tensor], fn: Callable[[torch.Tensor], object]) -> None:
    """Pack ``tensors`` into one flat buffer per dtype and device, let ``fn`` change each
    buffer in place (e.g. a collective), and copy the result back: one message per dtype
    instead of one per tensor."""
    buckets = Buckets(tensors, bucket_bytes=None)
    buckets.gather(tensors)
    for buffer in buckets.buffers:
        fn(buffer)
    buckets.scatter(tensors)


def layout(tensors: Sequence[torch.Tensor], bucket_bytes: int | None,
           first_bytes: int | None = None) -> tuple[list[Slot], list[int], list[Kind]]:
    """Where :class:`Buckets` puts ``tensors`` (only their sizes, dtypes and devices are read):
    ``(bucket, offset, numel)`` per tensor, the elements of each bucket, and each bucket's
    dtype and device."""
    slots: list[Slot] = []
    sizes: list[int] = []
    kinds: list[Kind] = []
    open_bucket: dict[Kind, int] = {}
    for t in tensors:
        kind = (t.dtype, t.device)
        numel = t.numel()
        index = open_bucket.get(kind)
        # the first bucket may be smaller (DDP's first_bucket_bytes: it starts sooner)
        limit = first_bytes if index == 0 and first_bytes is not None else bucket_bytes
        if index is None or (
            limit is not None
            and (sizes[index] + numel) * t.element_size() > limit
            and sizes[index] > 0
        ):
            index = len(sizes)
            sizes.append(0)
            kinds.append(kind)
            open_bucket[kind] = index
        slots.append((index, sizes[index], numel))
        sizes[index] += numel
    return slots, sizes, kinds
