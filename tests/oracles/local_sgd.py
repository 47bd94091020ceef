"""Oracle: local SGD (constant period, post-local SGD), the Quadratic Synchronization Rule and
Local AdamW.

Local SGD, Lin, Stich, Patel, Jaggi, "Don't Use Large Mini-Batches, Use Local SGD" (ICLR
2020), Algorithm 1: the K workers start from the same model; in round ``(t)`` each runs H local
steps from the averaged model, ``w^k_{(t)+h+1} = w^k_{(t)+h} - gamma g^k_{(t)+h}`` for
``h = 0 .. H-1``, and then the models are averaged exactly, ``w_{(t+1)} = (1/K) sum_k
w^k_{(t)+H}``. So the averages follow steps H-1, 2H-1, ... (0-based); the authors' code
averages after steps 0, H, 2H, ... instead (its counter is read before it is incremented: a
first round of one step), and so does torch's ``PeriodicModelAverager``. Post-local SGD, the
same paper: H = 1 (an average after every step, mini-batch SGD) for the first ``t'`` steps,
then rounds of H. With momentum each worker keeps its own momentum buffer and only the models
are averaged, as in the authors' code (their ``LocalSGD`` optimizer); averaging the buffers too
is an option here (``average_state``), as in the library.

The Quadratic Synchronization Rule, Gu, Lyu, Arora, Zhang, Huang, "A Quadratic Synchronization
Rule for Distributed Deep Learning" (ICLR 2024), Algorithm 1 (local gradient methods: round s
is H^(s) local steps of the optimizer OPT, then an exact average of the parameters) with the
rule the paper proposes: the round that starts at step t lasts ``H^(s) = max(H_base,
floor((alpha / eta_t) ** 2))`` steps, ``eta_t`` the learning rate at t, so that H grows as the
schedule decays. The warm-up is their code's (``LocalOptimizer.adjust_h``): a round that starts
before ``warmup_steps`` lasts ``init_h`` steps (``warmup_period`` here), and every period is
capped by the steps left, so the last step averages (their code does not cap the warm-up's:
the same unless the warm-up reaches the end). ``rising_lr`` is the library's other rule: H_base
for the first round and for a round whose learning rate is higher than the previous round's.

Local AdamW is the same rounds around AdamW: Loshchilov and Hutter, "Decoupled Weight Decay
Regularization" (ICLR 2019), Algorithm 2, in torch's parametrisation (the decay is scaled by
the learning rate): ``x = x (1 - lr wd)``; ``m = b1 m + (1 - b1) g``; ``v = b2 v + (1 - b2)
g^2``; ``x = x - lr (m / (1 - b1^k)) / (sqrt(v / (1 - b2^k)) + eps)`` at the k-th step (1-based).
The moments stay local (the QSR code's default) unless ``average_state``.

SGD is ``torch.optim.SGD``'s update written out: ``v = mu v + g`` (v starts at 0), ``x = x - lr
v``. Everything here is float64 and sequential; nothing of gossamer is used.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

#: ``grad(worker, step, x)``: worker ``worker``'s stochastic gradient at ``x`` at ``step``.
GradFn = Callable[[int, int, torch.Tensor], torch.Tensor]
#: ``period(step, lr, previous_lr)``: H of the round starting at ``step`` (0-based), whose
#: first step has learning rate ``lr``; ``previous_lr`` is that of the round before (or None).
PeriodFn = Callable[[int, float, float | None], int]


def constant_period(period: int, warmup_steps: int = 0, warmup_period: int = 1) -> PeriodFn:
    """Local SGD's H; with ``warmup_steps``, post-local SGD (``warmup_period`` 1)."""
    return lambda step, lr, previous: warmup_period if step < warmup_steps else period


def qsr_period(h_base: int, alpha: float, power: float = 2.0, warmup_steps: int = 0,
               warmup_period: int = 1, rising_lr: bool = False) -> PeriodFn:
    """The Quadratic Synchronization Rule (``power`` 2), with the warm-up described above."""

    def period(step: int, lr: float, previous: float | None) -> int:
        if step < warmup_steps:
            return warmup_period
        if rising_lr and (previous is None or lr > previous):
            return h_base
        return max(h_base, math.floor((alpha / lr) ** power))

    return period


@dataclass
class Run:
    """What an oracle run produced."""

    trajectory: list[list[torch.Tensor]] = field(default_factory=list)  # [k][i] after step k+1
    syncs: list[int] = field(default_factory=list)  # the steps (0-based) followed by an average
    periods: list[tuple[int, int]] = field(default_factory=list)  # (a round's first step, H)


def _mean(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """The exact average over the workers."""
    return torch.stack(list(values)).mean(dim=0)


def local_sgd(x0: torch.Tensor, n: int, grad: GradFn, lrs: Sequence[float],
              period: PeriodFn, *, cap_to_end: bool = False, optimizer: str = "sgd",
              momentum: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
              eps: float = 1e-8, weight_decay: float = 0.0,
              average_state: bool = False) -> Run:
    """Run local SGD (or Local AdamW, ``optimizer="adamw"``) on ``n`` workers that start from
    ``x0``, for ``len(lrs)`` steps with learning rate ``lrs[k]`` at step k. ``period`` chooses
    each round's H; ``cap_to_end`` caps it by the steps left (QSR)."""
    steps = len(lrs)
    x = [x0.clone() for _ in range(n)]
    # the optimizer state of each worker: SGD's momentum buffer, or AdamW's two moments
    first = [torch.zeros_like(x0) for _ in range(n)]
    second = [torch.zeros_like(x0) for _ in range(n)]
    run, end, previous = Run(), -1, None
    for k in range(steps):
        lr = lrs[k]
        if k > end:  # a round starts here: its H, from this step's learning rate
            h = period(k, lr, previous)
            previous = lr
            if cap_to_end:
                h = min(h, steps - k)
            run.periods.append((k, h))
            end = k + h - 1
        for i in range(n):  # the local steps, each worker at its own parameters
            g = grad(i, k, x[i])
            if optimizer == "sgd":
                first[i] = momentum * first[i] + g
                x[i] = x[i] - lr * first[i]
            else:
                b1, b2 = betas
                x[i] = x[i] * (1 - lr * weight_decay)
                first[i] = b1 * first[i] + (1 - b1) * g
                second[i] = b2 * second[i] + (1 - b2) * g * g
                m_hat = first[i] / (1 - b1 ** (k + 1))
                v_hat = second[i] / (1 - b2 ** (k + 1))
                x[i] = x[i] - lr * m_hat / (v_hat.sqrt() + eps)
        if k == end:  # the round's last step: the exact average
            x = [_mean(x)] * n
            if average_state:
                first, second = [_mean(first)] * n, [_mean(second)] * n
            run.syncs.append(k)
        run.trajectory.append([t.clone() for t in x])
    return run
