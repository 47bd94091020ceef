"""The per-worker least-squares problem of the SPARTA and DeMo oracle tests.

Worker ``rank``'s loss at ``step`` is ``0.5 mean_rows |a W^T + b - y|^2`` for a
``Linear(n_in, n_out)`` in float64, on data that depend on the worker and the step; its
gradient is written out by hand, so an oracle needs nothing of gossamer.
"""

from __future__ import annotations

import torch
from torch import nn


class LeastSquares:
    """Data, hand-written gradients, the model and its start for ``Linear(n_in, n_out)``."""

    def __init__(self, n_in: int, n_out: int, rows: int) -> None:
        self.n_in, self.n_out, self.rows = n_in, n_out, rows

    def data(self, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + rank)
        a = torch.randn(self.rows, self.n_in, generator=g, dtype=torch.float64) + 0.2 * rank
        y = torch.randn(self.rows, self.n_out, generator=g, dtype=torch.float64) + rank
        return a, y

    def grad(self, rank: int, step: int, x: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradient of ``0.5 mean_rows |a W^T + b - y|^2`` in (W, b), by hand."""
        a, y = self.data(rank, step)
        w, b = x
        r = a @ w.T + b - y
        return [r.T @ a / self.rows, r.sum(0) / self.rows]

    def model(self) -> nn.Linear:
        torch.manual_seed(3)
        return nn.Linear(self.n_in, self.n_out, dtype=torch.float64)

    def x0(self) -> list[torch.Tensor]:
        return [t.detach().clone() for t in self.model().parameters()]
