"""Local SGD, post-local SGD, QSR and Local AdamW against their oracle.

The library runs in SimWorld (4 workers, float64) on a per-worker least-squares problem: a
``Linear(3, 1)`` whose data depend on the worker and the step, under a learning-rate schedule
(linear warm-up, then cosine) whose decay makes QSR lengthen its rounds. After every step each
worker's parameters must match the oracle's (``tests/oracles/local_sgd.py``, a plain sequential
program from the papers, gradients written out by hand) to 1e-6, and the steps that averaged
and the rounds' lengths must be the oracle's exactly.
"""

from __future__ import annotations

import math

import pytest
import torch
from oracles import local_sgd as oracle
from torch import nn

import gossamer
from gossamer.algorithms import QSR, AllReduce, LocalSGD
from gossamer.comm import SimWorld

N = 4
DIM = 3  # inputs of the Linear layer; its parameters are DIM weights and a bias
ROWS = 6
STEPS = 40
ATOL = 1e-6


def _data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``rank``'s minibatch at ``step``: inputs (ROWS, DIM) and targets (ROWS,)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    a = torch.randn(ROWS, DIM, generator=g, dtype=torch.float64) + 0.3 * rank
    b = torch.randn(ROWS, generator=g, dtype=torch.float64) + rank
    return a, b


def _grad(rank: int, step: int, x: torch.Tensor) -> torch.Tensor:
    """The gradient of ``0.5 mean((a w + c - b)^2)`` in ``x = [w, c]``, by hand."""
    a, b = _data(rank, step)
    a1 = torch.cat([a, torch.ones(ROWS, 1, dtype=torch.float64)], dim=1)
    return a1.T @ (a1 @ x - b) / ROWS


X0 = torch.tensor([0.5, -0.3, 0.8, 0.1], dtype=torch.float64)  # [w, c]


def _schedule(steps: int = STEPS, peak: float = 0.1, low: float = 0.001,
              warmup: int = 4) -> list[float]:
    """A linear warm-up of ``warmup`` steps, then a cosine from ``peak`` to ``low``."""
    def lr(t: int) -> float:
        if t < warmup:
            return peak * (t + 1) / warmup
        progress = (t - warmup) / (steps - warmup)
        return low + (peak - low) * 0.5 * (1 + math.cos(math.pi * progress))

    return [lr(t) for t in range(steps)]


LRS = _schedule()


def _library(algorithm, lrs: list[float], optimizer: str = "sgd", momentum: float = 0.0,
             weight_decay: float = 0.0) -> oracle.Run:
    """The library's run, recorded as the oracle records its own."""

    def worker(comm):
        model = nn.Linear(DIM, 1, dtype=torch.float64)
        with torch.no_grad():
            model.weight.copy_(X0[:DIM].view(1, DIM))
            model.bias.copy_(X0[DIM:])
        if optimizer == "adamw":
            inner = torch.optim.AdamW(model.parameters(), lr=lrs[0], weight_decay=weight_decay)
        else:
            inner = torch.optim.SGD(model.parameters(), lr=lrs[0], momentum=momentum)
        opt = gossamer.distribute(model, inner, algorithm, comm)
        runtime = opt.runtime
        runtime.total_steps = len(lrs)
        trajectory, syncs = [], []
        for k, lr in enumerate(lrs):
            for group in opt.param_groups:
                group["lr"] = lr
            a, b = _data(comm.rank, k)
            opt.zero_grad()
            (0.5 * (model(a).squeeze(1) - b).pow(2).mean()).backward()
            before = runtime.synchronizations
            opt.step()
            if runtime.synchronizations > before:
                syncs.append(k)
            trajectory.append(torch.cat([model.weight.detach().flatten(),
                                         model.bias.detach()]).clone())
        return trajectory, syncs, list(getattr(runtime, "periods", []))

    results = SimWorld(N).run(worker)
    for _, syncs, periods in results[1:]:  # every worker kept the same schedule
        assert (syncs, periods) == (results[0][1], results[0][2])
    return oracle.Run(trajectory=[[r[0][k] for r in results] for k in range(len(lrs))],
                      syncs=results[0][1], periods=results[0][2])


def _assert_runs_match(library: oracle.Run, expected: oracle.Run) -> None:
    assert library.periods == expected.periods
    assert library.syncs == expected.syncs
    for k, (got, want) in enumerate(zip(library.trajectory, expected.trajectory, strict=True)):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            err = (g - w).abs().max().item()
            assert err <= ATOL, f"step {k}, worker {i}: library and oracle differ by {err:g}"
    # the replicas are equal after an average and apart after a local step, which the data
    # (different per worker) make them: a misplaced or missing average shows
    for k, replicas in enumerate(library.trajectory):
        spread = max((r - replicas[0]).abs().max().item() for r in replicas)
        assert (spread == 0) == (k in library.syncs), f"step {k}: spread {spread:g}"


ALPHA = 0.06  # with LRS: H = 2 at the peak, then 3, 7 and the end's 4
CASES = {
    # name: (library algorithm, oracle period rule, cap_to_end, optimizer settings)
    "local SGD, momentum kept local": (
        LocalSGD(period=3), oracle.constant_period(3), False,
        {"momentum": 0.9}),
    "post-local SGD, momentum averaged": (
        LocalSGD(period=4, warmup_steps=6, average_optimizer_state=True),
        oracle.constant_period(4, warmup_steps=6), False,
        {"momentum": 0.9, "average_state": True}),
    "QSR, warm-up of warmup_steps": (
        QSR(period=2, alpha=ALPHA, warmup_steps=4),
        oracle.qsr_period(2, ALPHA, warmup_steps=4), True, {}),
    "QSR, warm-up rounds of 3, momentum": (
        QSR(period=2, alpha=ALPHA, warmup_steps=4, warmup_period=3),
        oracle.qsr_period(2, ALPHA, warmup_steps=4, warmup_period=3), True,
        {"momentum": 0.9}),
    "QSR, no warm-up (the rule at the warm-up's lr)": (
        QSR(period=2, alpha=ALPHA), oracle.qsr_period(2, ALPHA), True, {}),
    "QSR, H_base while the lr rises": (
        QSR(period=2, alpha=ALPHA, warmup="rising_lr"),
        oracle.qsr_period(2, ALPHA, rising_lr=True), True, {}),
    "Local AdamW with QSR, moments local": (
        QSR(period=2, alpha=ALPHA, warmup_steps=4),
        oracle.qsr_period(2, ALPHA, warmup_steps=4), True,
        {"optimizer": "adamw", "weight_decay": 0.01}),
    "Local AdamW, moments averaged": (
        LocalSGD(period=3, average_optimizer_state=True), oracle.constant_period(3), False,
        {"optimizer": "adamw", "weight_decay": 0.01, "average_state": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_oracle_step_by_step(case):
    algorithm, period, cap, settings = CASES[case]
    library_settings = {k: v for k, v in settings.items() if k != "average_state"}
    library = _library(algorithm, LRS, **library_settings)
    expected = oracle.local_sgd(X0, N, _grad, LRS, period, cap_to_end=cap, **settings)
    _assert_runs_match(library, expected)
    assert len(expected.syncs) > 3


def test_qsr_oracle_case_changes_h_with_the_schedule():
    """The QSR cases above exercise the rule: after the warm-up H takes several values."""
    run = oracle.local_sgd(X0, N, _grad, LRS, oracle.qsr_period(2, ALPHA, warmup_steps=4),
                           cap_to_end=True)
    assert run.periods[:4] == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert len({h for s, h in run.periods if s >= 4}) >= 3
    assert run.syncs[-1] == STEPS - 1  # capped: the last step averages


def test_period_one_equals_allreduce_sgd():
    """Averaging the parameters after every plain SGD step is AllReduce-SGD: the same
    parameters on every worker at every step (to rounding: the mean is taken of x - lr g_i
    instead of x - lr mean(g_i))."""
    local = _library(LocalSGD(period=1), LRS)
    allreduce = _library(AllReduce(), LRS)
    assert local.syncs == list(range(STEPS))
    for got, want in zip(local.trajectory, allreduce.trajectory, strict=True):
        for g, w in zip(got, want, strict=True):
            assert (g - w).abs().max().item() <= 1e-12
