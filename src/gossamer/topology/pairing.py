"""NoLoCo's pairing: the random groups of two that average together at each outer step.

At the outer step that ends step ``s`` (1-based: ``s`` steps done), every worker draws the same
permutation of the ``n`` workers from a generator seeded with ``s + 1`` (numpy's
``default_rng``), and the permutation is dealt into ``n // 2`` groups: its ``i``-th worker
goes to group ``i mod (n // 2)``, so group ``g`` is ``order[g], order[g + n // 2]``. Every
worker computes the same groups without talking, and a resumed run draws the same ones.

This is the authors' code (jkolehm/noloco, ``src/noloco/sparse_optimizer_c.py``:
``create_random_permutation(world_size, step)`` and ``batched(ranks, 2)``), for an even ``n``.
For an odd ``n``, where the authors' code stops, the last worker of the order joins the
first group (a group of three); one worker alone is a group of one.

Reference: Kolehmainen, Blagoev, Donaghy, Ersoy, Nies, "NoLoCo: No-all-reduce Low
Communication Training Method for Large Models" (2025, arXiv 2506.10911).

Example::

    pairs = RandomPairs(8)
    pairs.groups(step=50)          # [[3, 5], [1, 2], [0, 7], [6, 4]], the same on every rank
    pairs.group(rank=1, step=50)   # [1, 2]: rank 1 averages with rank 2
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gossamer.checks import check_int

__all__ = ["RandomPairs"]


@dataclass(frozen=True)
class RandomPairs:
    """The groups of every outer step (pure data: no ranks of this process, no communication).

    Args:
        workers: the number of workers paired (>= 1).
    """

    workers: int

    def __post_init__(self) -> None:
        check_int("workers", self.workers, 1)

    def order(self, step: int) -> list[int]:
        """The permutation of the workers drawn at the outer step after ``step`` steps."""
        check_int("step", step, 0)
        return [int(r) for r in np.random.default_rng(step + 1).permutation(self.workers)]

    def groups(self, step: int) -> list[list[int]]:
        """The groups at the outer step after ``step`` steps, each in its order of the
        permutation (its first worker is the authors' root, which sums first)."""
        order = self.order(step)
        count = max(1, self.workers // 2)
        return [order[g::count] for g in range(count)]

    def group(self, rank: int, step: int) -> list[int]:
        """The group of ``rank`` at the outer step after ``step`` steps (``rank`` in it)."""
        return next(g for g in self.groups(step) if rank in g)
