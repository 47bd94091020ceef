"""Oracle: DeMo, Decoupled Momentum Optimization.

Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization", arXiv:2411.19870 (2024),
Algorithm 1, per worker and step t::

    m_t     = beta m_t + g_t                    (local gradient, no all-reduce)
    q_t     = ExtractFastComponents(m_t, s, k)  (chunks of s, top-k DCT coefficients)
    m_{t+1} = m_t - q_t
    Q_t     = Synchronize(q_t)                  (all-gather, average)
    x_{t+1} = x_t - eta_t Q_t

as the authors' code computes it (github.com/bloc97/DeMo, ``DeMo.step``): the learning rate is
folded into the momentum (``delta = decay * delta + lr * grad``), the weight decay is
decoupled (``x = x (1 - lr wd)``), a chunk spans the largest divisor of each dimension not above
``compression_chunk`` (``_get_smaller_split``) in each direction of a matrix (a vector: one
direction), its 2-D orthonormal DCT-II is taken (``TransformDCT.encode``), the ``topk``
coefficients of largest magnitude are kept (``CompressDCT.compress``; all where a chunk has
fewer), each position's gathered values are averaged over the workers that sent it
(``scatter_reduce(..., "mean", include_self=False)``), and the step is the signum ``x = x - lr
sign(Q)`` (``p.grad.sign_()`` then SGD's step).

The DCT is written from its definition: ``X[k] = a_k sum_j x[j] cos(pi (2 j + 1) k / (2 N))``
with ``a_0 = sqrt(1 / N)``, ``a_k = sqrt(2 / N)``, applied along both directions of a chunk; its
inverse is its transpose. Everything is float64 and sequential; nothing of gossamer is used.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

#: ``grad(worker, step, x)``: worker ``worker``'s gradients at its parameters ``x`` (a list of
#: tensors) at ``step``, a list like ``x``.
GradFn = Callable[[int, int, list[torch.Tensor]], list[torch.Tensor]]


def smaller_split(size: int, target: int) -> int:
    """The reference's ``_get_smaller_split``: the largest divisor of ``size`` <= target."""
    return max(d for d in range(1, size + 1) if size % d == 0 and d <= target)


def dct_basis(n: int) -> torch.Tensor:
    """``B[k, j] = a_k cos(pi (2 j + 1) k / (2 n))``: X = B x."""
    basis = torch.empty(n, n, dtype=torch.float64)
    for k in range(n):
        a = math.sqrt((1 if k == 0 else 2) / n)
        for j in range(n):
            basis[k, j] = a * math.cos(math.pi * (2 * j + 1) * k / (2 * n))
    return basis


def _matrix(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, -1) if t.dim() <= 1 else t.reshape(t.shape[0], -1)


def chunks(shape: torch.Size, chunk: int) -> tuple[int, int, int, int]:
    """(rows, cols, n1, n2): the matrix view and a chunk's sides."""
    rows, cols = _matrix(torch.zeros(shape)).shape
    return rows, cols, smaller_split(rows, chunk), smaller_split(cols, chunk)


def extract(m: torch.Tensor, chunk: int, topk: int) -> dict[tuple[int, int], dict[int, float]]:
    """Per chunk (its row and column block), the top-k coefficients {position: value}."""
    rows, cols, n1, n2 = chunks(m.shape, chunk)
    b1, b2 = dct_basis(n1), dct_basis(n2)
    x = _matrix(m)
    out = {}
    for a in range(rows // n1):
        for c in range(cols // n2):
            coefficients = (b1 @ x[a * n1:(a + 1) * n1, c * n2:(c + 1) * n2] @ b2.T).flatten()
            k = min(topk, coefficients.numel())
            order = sorted(range(coefficients.numel()), key=lambda i: -abs(coefficients[i]))
            out[(a, c)] = {i: float(coefficients[i]) for i in order[:k]}
    return out


def inverse(coefficients: dict[tuple[int, int], dict[int, float]], shape: torch.Size,
            chunk: int) -> torch.Tensor:
    """The tensor whose chunks' DCTs are the given sparse coefficients (zeros elsewhere)."""
    rows, cols, n1, n2 = chunks(shape, chunk)
    b1, b2 = dct_basis(n1), dct_basis(n2)
    x = torch.zeros(rows, cols, dtype=torch.float64)
    for (a, c), values in coefficients.items():
        dense = torch.zeros(n1 * n2, dtype=torch.float64)
        for i, v in values.items():
            dense[i] = v
        x[a * n1:(a + 1) * n1, c * n2:(c + 1) * n2] = b1.T @ dense.view(n1, n2) @ b2
    return x.reshape(shape)


@dataclass
class Run:
    """What an oracle run produced: after each step k, ``params[k][i]`` and ``momenta[k][i]``
    of worker i (lists of tensors)."""

    params: list[list[list[torch.Tensor]]] = field(default_factory=list)
    momenta: list[list[list[torch.Tensor]]] = field(default_factory=list)


def demo(x0: list[torch.Tensor], n: int, grad: GradFn, lrs: list[float], beta: float = 0.999,
         topk: int = 32, chunk: int = 64, weight_decay: float = 0.0) -> Run:
    """DeMo on ``n`` workers from ``x0`` for ``len(lrs)`` steps, lr ``lrs[k]`` at step k."""
    x = [[t.clone() for t in x0] for _ in range(n)]
    m = [[torch.zeros_like(t) for t in x0] for _ in range(n)]
    run = Run()
    for k, lr in enumerate(lrs):
        grads = [grad(i, k, x[i]) for i in range(n)]
        for j, shape in enumerate(t.shape for t in x0):
            sent = []
            for i in range(n):
                m[i][j] = beta * m[i][j] + lr * grads[i][j]
                q = extract(m[i][j], chunk, topk)
                m[i][j] = m[i][j] - inverse(q, shape, chunk)
                sent.append(q)
            averaged = {}
            for block in sent[0]:
                positions = sorted({p for q in sent for p in q[block]})
                averaged[block] = {p: sum(q[block][p] for q in sent if p in q[block])
                                   / sum(1 for q in sent if p in q[block]) for p in positions}
            direction = torch.sign(inverse(averaged, shape, chunk))
            for i in range(n):
                x[i][j] = x[i][j] * (1 - lr * weight_decay) - lr * direction
        run.params.append([[t.clone() for t in xi] for xi in x])
        run.momenta.append([[t.clone() for t in mi] for mi in m])
    return run
