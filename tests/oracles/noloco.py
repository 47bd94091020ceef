"""Oracle: NoLoCo, written from the paper's equations, and the authors' outer step transcribed.

Kolehmainen, Blagoev, Donaghy, Ersoy, Nies, "NoLoCo: No-all-reduce Low Communication Training
Method for Large Models" (2025, arXiv 2506.10911), its modified Nesterov outer step. Every
worker i keeps slow weights ``phi_i`` and an outer momentum ``Delta_i`` (zero at the start);
its fast weights ``theta_i`` take H inner steps (plain SGD here) from ``phi_i``; then, for the
group G of i drawn at that outer step,

    delta_j  = phi_j - theta_j                                          the outer gradient
    Delta_i  = alpha Delta_i - beta mean_G(delta) - gamma (phi_i - mean_G(phi))
    phi_i    = phi_i + Delta_i,   theta_i = phi_i

(the paper's modified Nesterov step: the ``gamma`` term is its addition to DiLoCo's). The
groups are the authors' seeded pairing (jkolehm/noloco, ``src/noloco/sparse_optimizer_c.py``:
``np.random.default_rng(step + 1).permutation(n)``, ``step`` the inner steps done, dealt into
``n // 2`` groups by ``i mod (n // 2)``); an odd ``n`` puts its last worker in the first group.

:func:`authors_outer_step` is the arithmetic of ``outer_step`` in that file, at commit
37d1a8a11adf5070ec544d63d0d0e6d97e6c5b08, for one group, sequentially: the root (the group's
first worker) sums the slow weights and the ``theta - phi`` of the group in its order and
multiplies by ``1 / len(group)``, and every member then takes ``m += (mu - 1) m + lr mean_g +
lr (mean - p_old)``, ``p_old += m``, ``p = p_old``: ``beta = gamma = lr``, ``alpha = mu``.

Everything is sequential; nothing of gossamer is used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

GradFn = Callable[[int, int, list[torch.Tensor]], list[torch.Tensor]]
Params = list[torch.Tensor]


def pairing(n: int, step: int) -> list[list[int]]:
    """The authors' groups of two at the outer step after ``step`` inner steps."""
    order = [int(x) for x in np.random.default_rng(step + 1).permutation(n)]
    count = max(1, n // 2)
    groups: list[list[int]] = [[] for _ in range(count)]
    for i, rank in enumerate(order):  # the authors' batched(ranks, 2)
        groups[i % count].append(rank)
    return groups


def paper_outer_step(
    group: Sequence[int],
    phi: list[Params],
    theta: list[Params],
    delta_m: list[Params],
    alpha: float,
    beta: float,
    gamma: float,
) -> None:
    """The paper's update of the members of ``group``, in place."""
    k = len(group)
    for t in range(len(phi[group[0]])):
        mean_delta = sum(phi[j][t] - theta[j][t] for j in group) / k
        mean_phi = sum(phi[j][t] for j in group) / k
        new_phi = {}
        for i in group:
            delta_m[i][t] = (
                alpha * delta_m[i][t] - beta * mean_delta - gamma * (phi[i][t] - mean_phi)
            )
            new_phi[i] = phi[i][t] + delta_m[i][t]
        for i in group:
            phi[i][t] = new_phi[i]
            theta[i][t] = new_phi[i].clone()


def authors_outer_step(
    group: Sequence[int],
    params: list[Params],
    step_params: list[Params],
    momentum: list[Params],
    outer_lr: float,
    outer_momentum: float,
) -> None:
    """``outer_step(group, model, params, momentum, outer_lr, outer_momentum)`` of
    ``src/noloco/sparse_optimizer_c.py`` (commit 37d1a8a), every member of ``group`` in turn:
    ``params`` the models' (fast) weights ``p``, ``step_params`` the prior outer step's
    ``p_old``, ``momentum`` the ``m``; in place."""
    root = group[0]
    for t in range(len(params[root])):
        mean = torch.zeros_like(params[root][t])
        mean_g = params[root][t] - step_params[root][t]
        mean.add_(step_params[root][t])
        for other in group[1:]:  # the root's recv loop
            mean.add_(step_params[other][t])
            mean_g.add_(params[other][t] - step_params[other][t])
        mean.mul_(1.0 / len(group))
        mean_g.mul_(1.0 / len(group))
        for rank in group:  # every member, with the root's mean and mean_g
            p, p_old, m = params[rank][t], step_params[rank][t], momentum[rank][t]
            m_ = (outer_momentum - 1.0) * m + outer_lr * mean_g + outer_lr * (mean - p_old)
            m.add_(m_)
            p.mul_(0.0)
            p_old.add_(m)
            p.add_(p_old)


def noloco(
    n: int,
    steps: int,
    period: int,
    lr: float,
    alpha: float,
    beta: float,
    gamma: float,
    x0: Params,
    grad: GradFn,
    *,
    authors: bool = False,
) -> list[list[Params]]:
    """Every worker's fast weights after every step: inner SGD of learning rate ``lr``, an
    outer step after every ``period`` steps with the paper's update (``authors``: the
    authors' code's, which needs ``gamma == beta``)."""
    phi = [[t.clone() for t in x0] for _ in range(n)]
    theta = [[t.clone() for t in x0] for _ in range(n)]
    delta_m = [[torch.zeros_like(t) for t in x0] for _ in range(n)]
    trajectory = []
    for step in range(steps):
        for i in range(n):
            theta[i] = [t - lr * g for t, g in zip(theta[i], grad(i, step, theta[i]), strict=True)]
        if (step + 1) % period == 0:
            for group in pairing(n, step + 1):
                if authors:
                    assert gamma == beta, "the authors' code takes gamma = beta"
                    authors_outer_step(group, theta, phi, delta_m, beta, alpha)
                else:
                    paper_outer_step(group, phi, theta, delta_m, alpha, beta, gamma)
        trajectory.append([[t.clone() for t in w] for w in theta])
    return trajectory
