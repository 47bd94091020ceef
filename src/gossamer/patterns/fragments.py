"""A model's parameters split into fragments of whole layers, for methods that synchronise
part of the model at a time (Streaming DiLoCo's fragments, Douillard et al. 2025, Fig. 2).

Example::

    names, sizes = zip(*((n, p.numel()) for n, p in model.named_parameters()))
    fragments = split_fragments(names, sizes, 4, "strided")  # parameter indices per fragment
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["Unit", "layer_units", "split_fragments"]


class Unit(NamedTuple):
    """Parameters that go into one fragment together: a block or a module."""

    name: str  # the module's name ("" for the model itself)
    indices: list[int]  # the parameters', in registration order
    size: int  # elements
    block: bool  # a member of a ModuleList or Sequential, whole


def layer_units(names: Sequence[str], sizes: Sequence[int], limit: float) -> list[Unit]:
    """The parameters ``names`` (as ``named_parameters`` gives them) of ``sizes`` elements,
    grouped into units of whole layers, in registration order.

    A parameter's unit is the block of a ``ModuleList`` or ``Sequential`` that holds it, its
    name up to the first numeric component ("blocks.3.attn.qkv.weight" -> "blocks.3"), or else
    the module that owns it ("head.weight", "head.bias" -> "head"). A unit larger than
    ``limit`` elements is split into its children, one name component deeper, again while a
    piece is larger, down to single modules: a module's parameters always stay together."""
    parts = [name.split(".") for name in names]

    def owner(i: int) -> int:  # components of the module that owns parameter i
        return len(parts[i]) - 1

    def split(key: tuple[str, ...], indices: list[int], top: bool) -> list[Unit]:
        size = sum(sizes[i] for i in indices)
        groups: dict[tuple[str, ...], list[int]] = {}
        if size > limit:
            for i in indices:  # one component deeper, never past the owning module
                deeper = tuple(parts[i][:len(key) + 1]) if len(key) < owner(i) else key
                groups.setdefault(deeper, []).append(i)
        if not groups or list(groups) == [key]:  # small enough, or a single module
            block = top and bool(key) and key[-1].isdigit()
            return [Unit(".".join(key), indices, size, block)]
        return [unit for sub, members in groups.items()
                for unit in split(sub, members, top=False)]

    units: dict[tuple[str, ...], list[int]] = {}
    for i, components in enumerate(parts):
        numeric = next((j for j, c in enumerate(components) if c.isdigit()), None)
        key = components[:numeric + 1] if numeric is not None else components[:-1]
        units.setdefault(tuple(key), []).append(i)
    return [unit for key, indices in units.items() for unit in split(key, indices, top=True)]


def split_fragments(names: Sequence[str], sizes: Sequence[int], count: int,
                    pattern: str) -> list[list[int]]:
    """The parameter indices of each of ``count`` fragments of whole layers, for the
    parameters ``names`` of ``sizes`` elements.

    The parameters are grouped into units (:func:`layer_units`: blocks of a ``ModuleList`` or
    ``Sequential``, other modules), a unit larger than 1/count of the model split into its
    children so that the fragments can balance. Then:

    - ``strided`` (the paper's Fig. 2): the i-th block (a whole member of a ``ModuleList`` or
      ``Sequential``: a transformer block) goes into fragment i mod count; the other units
      (embeddings, final norm, head, the pieces of a block too large to stay whole), largest
      first, each into the fragment with the fewest elements so far (the first on ties).
      Equal blocks make equal fragments.
    - ``sequential``: consecutive units, cut so that the largest fragment is as small as it
      can be: each fragment takes the units that fit under that bound, leaving one unit for
      each fragment after it.

    A function of the names and sizes only: every worker finds the same fragments. A fragment
    is empty when there are fewer units than fragments; each lists its indices in increasing
    order."""
    total = sum(sizes)
    units = layer_units(names, sizes, total / count)
    fragments: list[list[int]] = [[] for _ in range(count)]
    if pattern == "strided":
        load = [0] * count
        blocks = [unit for unit in units if unit.block]
        others = sorted((unit for unit in units if not unit.block), key=lambda u: -u.size)
        for i, unit in enumerate(blocks):
            fragments[i % count] += unit.indices
            load[i % count] += unit.size
        for unit in others:  # (sorted is stable: registration order among equal sizes)
            p = min(range(count), key=load.__getitem__)
            fragments[p] += unit.indices
            load[p] += unit.size
    else:
        for p, members in enumerate(_consecutive([unit.size for unit in units], count)):
            fragments[p] = [i for u in members for i in units[u].indices]
    return [sorted(fragment) for fragment in fragments]


def _consecutive(sizes: Sequence[int], count: int) -> list[range]:
    """``count`` runs of consecutive indices into ``sizes`` whose largest sum is the smallest
    possible, none empty while there are enough items."""

    def parts(bound: int) -> int:  # runs that a greedy cut under ``bound`` makes
        runs, running = 1, 0
        for size in sizes:
            if running + size > bound:
                runs, running = runs + 1, 0
            running += size
        return runs

    low, high = max(sizes, default=0), sum(sizes)
    while low < high:  # the smallest bound under which count runs suffice
        middle = (low + high) // 2
        low, high = (low, middle) if parts(middle) <= count else (middle + 1, high)
    runs, start = [], 0
    for p in range(count):
        end, running = start, 0
        reserve = len(sizes) - (count - p - 1)  # leave one item for each run after this
        while end < len(sizes) and (end == start or (running + sizes[end] <= low
                                                     and end < reserve)):
            running += sizes[end]
            end += 1
        if p == count - 1:
            end = len(sizes)
        runs.append(range(start, end))
        start = end
    return runs
