"""Oracle: SPARTA, sparse parameter averaging.

EXO Gym's ``SPARTAStrategy`` (``exogym/strategy/sparta.py``; EXO Labs, "SPARTA: Sparse
Parameter Averaging for Distributed Training", 2025): every step, each node first takes its own
optimizer step (``CommunicateOptimizeStrategy.step``: ``optim.step()``, then
``_communicate()``), then for every parameter tensor draws a mask of about ``p`` of its
elements (``RandomIndexSelector``: ``bernoulli(full(shape, p))``), the same on every node
(EXO Gym broadcasts rank 0's), and replaces the masked elements by their mean over the nodes
(``all_reduce(SUM)`` of ``param[mask]``, divided by the number of nodes, ``masked_scatter_``
back). ``PartitionedIndexSelector``: each tensor's elements get random labels
``argsort(rand(numel)) % P`` with ``P = max(1, min(ceil(1/p), numel))``, and the k-th call
(0-based) of a cycle of P calls selects label k; a new labelling every cycle.

The masks: the shared generator of the library's documented rule (a CPU ``torch.Generator``
seeded with the first 8 bytes, little-endian, of BLAKE2b of ``"seed/step"``, or of
``"seed/cycle/tensor"`` for the partitioned labels; ``rand(numel) < p`` per tensor in order) is
the specification of which positions are drawn, so it is written out here again. At the end,
an exact average of everything (the library's ``average_at_end``).

SGD is ``torch.optim.SGD``'s update written out: ``v = mu v + g`` (v starts at 0), ``x = x -
lr v``; each worker keeps its own momentum. Everything is float64 and sequential; nothing of
gossamer is used.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence

import torch

#: ``grad(worker, step, x)``: worker ``worker``'s gradient at its parameters ``x`` (a list of
#: tensors) at ``step``, a list like ``x``.
GradFn = Callable[[int, int, list[torch.Tensor]], list[torch.Tensor]]


def generator(*numbers: int) -> torch.Generator:
    text = "/".join(str(n) for n in numbers).encode()
    seed = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")
    return torch.Generator().manual_seed(seed)


def masks(p: float, seed: int, step: int, sizes: Sequence[int],
          selector: str = "random") -> list[torch.Tensor]:
    """The boolean flat mask of each tensor at ``step``."""
    if selector == "random":
        g = generator(seed, step)
        return [torch.rand(n, generator=g) < p for n in sizes]
    out = []
    for i, n in enumerate(sizes):
        parts = max(1, min(math.ceil(1 / p), n))
        cycle, part = divmod(step, parts)
        labels = torch.argsort(torch.rand(n, generator=generator(seed, cycle, i))) % parts
        out.append(labels == part)
    return out


def sparta(x0: list[torch.Tensor], n: int, grad: GradFn, steps: int, lr: float, p: float,
           seed: int = 0, momentum: float = 0.0, selector: str = "random",
           average_at_end: bool = True) -> list[list[list[torch.Tensor]]]:
    """``steps`` steps of SPARTA on ``n`` workers from ``x0``; the trajectory ``[k][i]``: worker
    i's tensors after step k (and, with ``average_at_end``, one last entry: after the final
    average)."""
    x = [[t.clone() for t in x0] for _ in range(n)]
    v = [[torch.zeros_like(t) for t in x0] for _ in range(n)]
    trajectory = []
    for k in range(steps):
        for i in range(n):  # each worker's own optimizer step
            g = grad(i, k, x[i])
            for j in range(len(x0)):
                v[i][j] = momentum * v[i][j] + g[j]
                x[i][j] = x[i][j] - lr * v[i][j]
        for j, mask in enumerate(masks(p, seed, k, [t.numel() for t in x0], selector)):
            flat = [x[i][j].reshape(-1).clone() for i in range(n)]
            mean = sum(f[mask] for f in flat) / n
            for i in range(n):
                flat[i][mask] = mean
                x[i][j] = flat[i].reshape(x0[j].shape)
        trajectory.append([[t.clone() for t in xi] for xi in x])
    if average_at_end:
        final = [sum(x[i][j] for i in range(n)) / n for j in range(len(x0))]
        trajectory.append([[t.clone() for t in final] for _ in range(n)])
    return trajectory
