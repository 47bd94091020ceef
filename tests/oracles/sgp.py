"""Stochastic Gradient Push and Overlap SGP as a sequential program.

Assran, Loizou, Ballas, Rabbat, "Stochastic Gradient Push for Distributed Deep Learning"
(ICML 2019). Algorithm 1 (SGP), for every worker i at iteration k:

    z_k = x_k / w_k                                  (de-biased parameters)
    x_{k+1/2} = x_k - lr * grad F_i(z_k)             (the numerator takes the step)
    send p_{j,i} x_{k+1/2}, p_{j,i} w_k to each out-neighbour j
    x_{k+1} = sum_j p_{i,j} x_{k+1/2}^{(j)};  w_{k+1} = sum_j p_{i,j} w_k^{(j)}

Algorithm 2 (Overlap SGP, tau >= 1): the messages sent at iteration k are received at
iteration k + tau. As in the authors' code, a worker first adds what arrived to its numerator
and weight, then keeps its own share and sends the others: mass in flight is never lost.
At the end every message still in flight is received.

``mixing(k)`` gives, for iteration k, one entry per sender i: ``(p_{i,i}, {j: p_{j,i}})``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

Mixing = Callable[[int], list[tuple[float, dict[int, float]]]]


def run(x0: list[torch.Tensor], grad: Callable[[int, torch.Tensor], torch.Tensor], lr: float,
        steps: int, mixing: Mixing, tau: int = 0) -> tuple[list[list[torch.Tensor]],
                                                           torch.Tensor]:
    """Returns the de-biased parameters of every worker after each iteration, and the exact
    average at the end (sum of numerators over sum of weights, messages in flight received)."""
    n = len(x0)
    x = [t.clone() for t in x0]
    w = [1.0] * n
    in_flight: deque[list[tuple[torch.Tensor, float]]] = deque()
    trajectory = []
    for k in range(steps):
        half = [x[i] - lr * grad(i, x[i] / w[i]) for i in range(n)]
        weight = list(w)
        if tau:  # Algorithm 2: what iteration k - tau sent arrives now
            while len(in_flight) >= tau:
                for i, (dx, dw) in enumerate(in_flight.popleft()):
                    half[i] = half[i] + dx
                    weight[i] += dw
        shares = mixing(k)
        new_x = [shares[i][0] * half[i] for i in range(n)]
        new_w = [shares[i][0] * weight[i] for i in range(n)]
        sent = [(torch.zeros_like(x[0]), 0.0) for _ in range(n)]
        for i in range(n):
            for j, p in shares[i][1].items():
                sent[j] = (sent[j][0] + p * half[i], sent[j][1] + p * weight[i])
        if tau:
            in_flight.append(sent)
        else:
            new_x = [new_x[j] + sent[j][0] for j in range(n)]
            new_w = [new_w[j] + sent[j][1] for j in range(n)]
        x, w = new_x, new_w
        trajectory.append([x[i] / w[i] for i in range(n)])
    while in_flight:
        for i, (dx, dw) in enumerate(in_flight.popleft()):
            x[i] = x[i] + dx
            w[i] += dw
    return trajectory, sum(x) / sum(w)
