"""Oracle: DES-LOC, Local Adam whose parameters and two moments are averaged on periods of
their own.

Iacob et al., "DES-LOC: Desynced Low Communication Adaptive Optimizers for Training Foundation
Models" (2025, arXiv 2505.22549), Algorithm 1 (DES-LOC) with Adam's update as the optimizer
OPT: M workers start from the same x_0 with zero moments; at step t each worker m takes its
stochastic gradient g at its own x^m and updates its states, ``u^m = b1 u^m + (1 - b1) g``
and ``v^m = b2 v^m + (1 - b2) g^2``, then its parameters with them; the first moments are
replaced by their average E_m[u^m] when ``t mod K_u = 0``, the second by E_m[v^m] when
``t mod K_v = 0``, the parameters by E_m[x^m] when ``t mod K_x = 0``, with t counting the
steps done: after the K-th, 2K-th, ... step (0-based K - 1, 2K - 1, ...). The paper's
per-coordinate clipping of g (radius rho, for its theory) is left out: rho = infinity.

Adam's update is AdamW's in torch's parametrisation (Loshchilov and Hutter, ICLR 2019,
Algorithm 2; the decay scaled by the learning rate), with bias correction at the k-th step
(1-based): ``x = x (1 - lr wd)``, then ``x = x - lr (u / (1 - b1^k)) / (sqrt(v / (1 - b2^k))
+ eps)``. The parameters' period may follow a rule (``period``, as in
``tests/oracles/local_sgd.py``: QSR's rounds, each H chosen when it starts, capped by the
steps left when ``cap_to_end``). Everything is float64 and sequential; nothing of gossamer is
used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from oracles.local_sgd import GradFn, PeriodFn


@dataclass
class Run:
    """What a DES-LOC oracle run produced."""

    trajectory: list[list[torch.Tensor]] = field(default_factory=list)  # [k][i] after step k
    first: list[list[torch.Tensor]] = field(default_factory=list)  # [k][i]: u after step k
    second: list[list[torch.Tensor]] = field(default_factory=list)  # [k][i]: v after step k
    # the steps (0-based) after which each state was averaged
    averages: dict[str, list[int]] = field(
        default_factory=lambda: {"x": [], "u": [], "v": []})
    periods: list[tuple[int, int]] = field(default_factory=list)  # (a round's first step, K_x)


def desloc(x0: torch.Tensor, m: int, grad: GradFn, lrs: Sequence[float], period: PeriodFn,
           k_u: int, k_v: int, *, cap_to_end: bool = False,
           betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
           weight_decay: float = 0.0) -> Run:
    """DES-LOC on ``m`` workers from ``x0`` for ``len(lrs)`` steps (learning rate ``lrs[t]``
    at step t); ``period`` chooses each of the parameters' rounds (K_x), ``k_u`` and ``k_v``
    are the moments' periods."""
    b1, b2 = betas
    steps = len(lrs)
    # every worker's parameters and moments (each update makes new tensors: shared is safe)
    x, u, v = [x0.clone()] * m, [torch.zeros_like(x0)] * m, [torch.zeros_like(x0)] * m
    run, x_end, previous = Run(), -1, None
    for t, lr in enumerate(lrs):
        if t > x_end:  # a round of the parameters starts: its K_x, from this step's lr
            k_x, previous = period(t, lr, previous), lr
            x_end = t + (min(k_x, steps - t) if cap_to_end else k_x) - 1
            run.periods.append((t, x_end - t + 1))
        for w in range(m):  # each worker's Adam step at its own parameters and states
            g = grad(w, t, x[w])
            u[w] = b1 * u[w] + (1 - b1) * g
            v[w] = b2 * v[w] + (1 - b2) * g * g
            u_hat = u[w] / (1 - b1 ** (t + 1))
            v_hat = v[w] / (1 - b2 ** (t + 1))
            x[w] = x[w] * (1 - lr * weight_decay) - lr * u_hat / (v_hat.sqrt() + eps)
        done = t + 1  # the paper's t: steps done
        if done % k_u == 0:
            u = [torch.stack(u).mean(dim=0)] * m
            run.averages["u"].append(t)
        if done % k_v == 0:
            v = [torch.stack(v).mean(dim=0)] * m
            run.averages["v"].append(t)
        if t == x_end:
            x = [torch.stack(x).mean(dim=0)] * m
            run.averages["x"].append(t)
        run.trajectory.append([s.clone() for s in x])
        run.first.append([s.clone() for s in u])
        run.second.append([s.clone() for s in v])
    return run
