"""Helpers of the tests of DiLoCo's family: one worker's run, step by step."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import gossamer


def rounds_run(comm, model: nn.Module, inner: torch.optim.Optimizer, algorithm,
               batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]], steps: int
               ) -> tuple[list[torch.Tensor], list[int], int]:
    """``steps`` steps of ``model`` (mean squared error on ``batch(rank, step)``) under
    ``algorithm``: (the flat parameters after every step, the steps that synchronised, the
    bytes this worker sent)."""
    opt = gossamer.distribute(model, inner, algorithm, comm, total_steps=steps)
    trajectory, syncs = [], []
    for step in range(steps):
        x, y = batch(comm.rank, step)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        before = opt.runtime.synchronizations
        opt.step()
        if opt.runtime.synchronizations > before:
            syncs.append(step)
        trajectory.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    opt.finish()
    return trajectory, syncs, comm.stats.total_bytes_sent


def regression_batch(rank: int, step: int, n_in: int, n_out: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``rank``'s 6 examples of step ``step``: random inputs and targets."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, n_in, generator=g), torch.randn(6, n_out, generator=g)
