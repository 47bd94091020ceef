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


def summary(comm, worker, *args) -> tuple[torch.Tensor, list[int], int, dict[str, int]]:
    """``worker(comm, *args)``'s :func:`rounds_run` as it must agree across backends: (the last
    parameters, the steps that synchronised, the bytes sent, the operations counted)."""
    comm.stats.reset()  # run_in_turn opens each run with a barrier
    trajectory, syncs, sent = worker(comm, *args)
    return trajectory[-1], syncs, sent, dict(comm.stats.operations)


def assert_gloo_agrees(worker, algorithms: dict[str, object], n: int, syncs: list[int]
                       ) -> None:
    """Each of ``algorithms`` run by the module-level ``worker(comm, algorithm)`` on ``n``
    gloo processes and in SimWorld: the same steps synchronise (``syncs``), the same bytes and
    operations, the same parameters to 1e-6."""
    from gossamer.comm import SimWorld
    from gossamer.testing import collect, run_in_turn, spawn_gloo

    runs = [(key, (worker, algorithm)) for key, algorithm in algorithms.items()]
    results = spawn_gloo(run_in_turn, n, args=(summary, runs), timeout=120)
    for key, algorithm in algorithms.items():
        sim = SimWorld(n).run(summary, worker, algorithm)
        for s, g in zip(sim, collect(results, key), strict=True):
            assert s[1] == g[1] == syncs, key
            assert s[2] == g[2] and s[3] == g[3], key
            assert torch.allclose(s[0], g[0], rtol=0, atol=1e-6), key
