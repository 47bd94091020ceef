"""Oracle: DiLoCo and Streaming DiLoCo, written from the papers' pseudo-code.

DiLoCo, Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models"
(2023, arXiv 2311.08105), Algorithm 1: for each outer step t, every worker i copies the global
parameters, ``theta_i = theta^(t-1)``, takes H inner steps on its data, then

    Delta^(t) = (1/k) sum_i (theta^(t-1) - theta_i)        (line 10)
    theta^(t) = OuterOpt(theta^(t-1), Delta^(t))            (line 12)

The outer optimizer is SGD with Nesterov momentum as torch's ``SGD(nesterov=True)`` has it
(the paper's choice, lr 0.7, momentum 0.9): ``b = mu b + Delta`` (b = Delta the first time),
``theta = theta - lr (Delta + mu b)``; without Nesterov ``theta = theta - lr b``. The inner
optimizers' states stay local. The round's length H comes from a ``PeriodFn`` as in
:mod:`oracles.local_sgd` (a constant H, or the Quadratic Synchronization Rule), the last
round cut to end at the last step. With ``replica_size`` G, the workers of a replica (consecutive
ranks) average their gradients before each inner step.

Streaming DiLoCo, Douillard et al., "Streaming DiLoCo with overlapping communication" (2025,
arXiv 2501.18512), Algorithm 2, in float32 on the wire: the parameters are split into
fragments (lists of flat indices); in slot s (H / P steps long) fragment ``s mod P`` is
synchronised: its pseudo-gradient is taken at the end of the slot's step ``H / P - 1 - tau``
(0-based within the slot), averaged, and at the end of the slot's last step the outer
optimizer steps that fragment's global copy, and each worker's fragment becomes ``alpha
theta_i + (1 - alpha) theta^global`` (Algorithm 2's merge, alpha the mixing factor).

The end (the library's, not the paper's: Algorithm 2 stops after its last outer step): the
exchange in flight, if any, is taken in (its outer step and merge); then each fragment with
inner steps since its last synchronisation takes one more outer step with its exact averaged
pseudo-gradient and alpha 0, and a fragment synchronised since the last inner step takes none,
as Algorithm 2 makes one outer step per synchronisation of a fragment, never one without inner
steps before it; with alpha > 0 the workers' values of such a fragment, which differ by what
each kept of its own, become their plain average. Every worker ends with the same parameters.

The warm-up (the library's, not the papers'): the paper's DiLoCo starts from a model trained
synchronously; here the rounds that start before ``warmup_steps`` (one step long, in both
methods) end with a plain exact average of the replicas, which also becomes the global copy,
and the outer optimizer starts after them. Everything here is float64 and sequential; nothing
of gossamer is used.

Overlapped DiLoCo, Kale, Douillard, Donchev, "Eager Updates For Overlapped Communication and
Computation in DiLoCo" (2025, arXiv 2502.12996): the average of round t's outer gradients
``Delta_i^(t) = theta_i^(t-1) - theta_i`` travels during round t + 1 and is known at its end.
The delayed form (the paper's naive delayed outer gradients, its Algorithm 2) steps with it
one round late, ``theta^(t) = OuterOpt(theta^(t-1), Delta^(t-1))`` (nothing after the first
round); the eager form (its eager updates, Algorithm 3) steps each worker i at once with its
own outer gradient for its share and the others' of the round before, ``OuterOpt(theta_i^(t-1),
Delta_i^(t) / n + (1/n) sum_{j != i} Delta_j^(t-1))``, written ``Delta_i^(t) / n + (mean
Delta^(t-1) - Delta_i^(t-1) / n)``. Each worker keeps its own global copy and outer momentum
(equal on every worker in the delayed form). The end (the library's): the last average, still
in flight after the last step, is taken in: its outer step (delayed), or an outer step with
the others' share of it and then the workers' plain average (eager, with more than one
worker; with one there is no other share and nothing to do).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from oracles.local_sgd import GradFn, PeriodFn, Run


def _mean(values: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack(list(values)).mean(dim=0)


class _Inner:
    """Each worker's inner optimizer: SGD with momentum, or AdamW (torch's formulas)."""

    def __init__(self, n: int, like: torch.Tensor, optimizer: str, momentum: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        self.optimizer, self.momentum, self.betas = optimizer, momentum, betas
        self.eps, self.weight_decay = eps, weight_decay
        self.first = [torch.zeros_like(like) for _ in range(n)]
        self.second = [torch.zeros_like(like) for _ in range(n)]

    def step(self, i: int, k: int, x: torch.Tensor, g: torch.Tensor, lr: float) -> torch.Tensor:
        if self.optimizer == "sgd":
            self.first[i] = self.momentum * self.first[i] + g
            return x - lr * self.first[i]
        b1, b2 = self.betas
        x = x * (1 - lr * self.weight_decay)
        self.first[i] = b1 * self.first[i] + (1 - b1) * g
        self.second[i] = b2 * self.second[i] + (1 - b2) * g * g
        m_hat = self.first[i] / (1 - b1 ** (k + 1))
        v_hat = self.second[i] / (1 - b2 ** (k + 1))
        return x - lr * m_hat / (v_hat.sqrt() + self.eps)


class _OuterSGD:
    """torch's SGD on the global parameters, one momentum buffer per element (each fragment
    is made of whole tensors, so a buffer starts when its tensor's first outer step does)."""

    def __init__(self, like: torch.Tensor, lr: float, momentum: float, nesterov: bool) -> None:
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.buffer = torch.zeros_like(like)
        self.started = torch.zeros(like.shape, dtype=torch.bool)

    def step(self, theta: torch.Tensor, delta: torch.Tensor, index: torch.Tensor) -> None:
        """``theta[index] = OuterOpt(theta[index], delta)``, in place."""
        if self.momentum:
            b = torch.where(self.started[index], self.momentum * self.buffer[index] + delta,
                            delta)
            self.buffer[index], self.started[index] = b, True
            d = delta + self.momentum * b if self.nesterov else b
        else:
            d = delta
        theta[index] = theta[index] - self.lr * d


def _inner_steps(x: list[torch.Tensor], k: int, grad: GradFn, lr: float, inner: _Inner,
                 replica_size: int) -> list[torch.Tensor]:
    n = len(x)
    grads = [grad(i, k, x[i]) for i in range(n)]
    if replica_size > 1:  # the members of a replica all-reduce their gradients
        r = replica_size
        grads = [_mean(grads[(i // r) * r:(i // r + 1) * r]) for i in range(n)]
    return [inner.step(i, k, x[i], grads[i], lr) for i in range(n)]


def diloco(x0: torch.Tensor, n: int, grad: GradFn, lrs: Sequence[float], period: PeriodFn, *,
           optimizer: str = "sgd", momentum: float = 0.0, weight_decay: float = 0.0,
           outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
           replica_size: int = 1, warmup_steps: int = 0) -> Run:
    """DiLoCo (Algorithm 1) on ``n`` workers from ``x0``, ``len(lrs)`` inner steps; a round
    that starts before ``warmup_steps`` ends with a plain average (synchronous training)."""
    steps = len(lrs)
    theta = x0.clone()
    x = [x0.clone() for _ in range(n)]
    inner = _Inner(n, x0, optimizer, momentum, weight_decay=weight_decay)
    outer = _OuterSGD(x0, outer_lr, outer_momentum, nesterov)
    everything = torch.arange(x0.numel())
    run, end, previous = Run(), -1, None
    for k in range(steps):
        lr = lrs[k]
        if k > end:
            h = min(period(k, lr, previous), steps - k)
            previous = lr
            run.periods.append((k, h))
            end = k + h - 1
        x = _inner_steps(x, k, grad, lr, inner, replica_size)
        if k == end and run.periods[-1][0] < warmup_steps:
            theta = _mean(x)
            x = [theta.clone() for _ in range(n)]
            run.syncs.append(k)
        elif k == end:
            delta = _mean([theta - xi for xi in x])  # line 10
            outer.step(theta, delta, everything)  # line 12
            x = [theta.clone() for _ in range(n)]
            run.syncs.append(k)
        run.trajectory.append([t.clone() for t in x])
    return run


def streaming_diloco(x0: torch.Tensor, n: int, grad: GradFn, lrs: Sequence[float],
                     period: int, fragments: Sequence[Sequence[int]], tau: int, mixing: float,
                     *, optimizer: str = "sgd", momentum: float = 0.0, outer_lr: float = 0.7,
                     outer_momentum: float = 0.9, nesterov: bool = True,
                     warmup_steps: int = 0) -> Run:
    """Streaming DiLoCo (Algorithm 2, float32 exchange modelled exactly) on ``n`` workers;
    ``fragments`` lists each fragment's flat indices into ``x0``. The end (see the module's
    docstring), where it changes anything, is recorded as the last entry of ``syncs`` (-1)."""
    steps, count = len(lrs), len(fragments)
    slot = period // count
    theta = x0.clone()
    x = [x0.clone() for _ in range(n)]
    inner = _Inner(n, x0, optimizer, momentum)
    outer = _OuterSGD(x0, outer_lr, outer_momentum, nesterov)
    indices = [torch.tensor(list(f), dtype=torch.long) for f in fragments]
    run = Run()
    pending: tuple[int, torch.Tensor] | None = None
    # each fragment's last synchronisation: the inner steps done then, and whether the
    # workers kept a share of their own values of it (alpha > 0)
    synced_after, kept = [0] * count, [False] * count
    for k in range(steps):
        x = _inner_steps(x, k, grad, lrs[k], inner, 1)
        if k < warmup_steps:  # synchronous: a plain average after every step
            theta = _mean(x)
            x = [theta.clone() for _ in range(n)]
            synced_after = [k + 1] * count
            run.syncs.append(k)
            run.trajectory.append([t.clone() for t in x])
            continue
        s, position = divmod(k - warmup_steps, slot)
        p = s % count
        if position == slot - 1 - tau:  # the fragment's pseudo-gradient, sent now
            pending = (p, _mean([theta[indices[p]] - xi[indices[p]] for xi in x]))
        if position == slot - 1:  # received: the outer step and the merge
            assert pending is not None and pending[0] == p
            outer.step(theta, pending[1], indices[p])
            for xi in x:
                xi[indices[p]] = mixing * xi[indices[p]] + (1 - mixing) * theta[indices[p]]
            pending = None
            synced_after[p], kept[p] = k + 1, mixing > 0
            run.syncs.append(k)
        run.trajectory.append([t.clone() for t in x])
    changed = False
    if pending is not None:  # the last exchange, taken in at the end
        p, delta = pending
        outer.step(theta, delta, indices[p])
        for xi in x:
            xi[indices[p]] = mixing * xi[indices[p]] + (1 - mixing) * theta[indices[p]]
        synced_after[p], kept[p], changed = steps, mixing > 0, True
    due = [p for p in range(count) if synced_after[p] < steps]
    if due:  # one exact outer step of the fragments with inner steps since their last one
        index = torch.cat([indices[p] for p in due])
        outer.step(theta, _mean([theta[index] - xi[index] for xi in x]), index)
        for xi in x:
            xi[index] = theta[index]
    for p in range(count):
        if p not in due and kept[p]:  # synchronised at the end: the workers' plain average
            mean = _mean([xi[indices[p]] for xi in x])
            for xi in x:
                xi[indices[p]] = mean
    if changed or due or any(kept[p] for p in range(count) if p not in due):
        run.syncs.append(-1)
        run.trajectory.append([t.clone() for t in x])
    return run


def overlapped_diloco(x0: torch.Tensor, n: int, grad: GradFn, lrs: Sequence[float],
                      period: int, form: str, *, optimizer: str = "sgd",
                      momentum: float = 0.0, weight_decay: float = 0.0, outer_lr: float = 0.7,
                      outer_momentum: float = 0.9, nesterov: bool = True) -> Run:
    """DiLoCo with its outer all-reduce overlapping the next round, ``form`` "delayed" or
    "eager" (see the module's docstring), rounds of ``period`` steps, the last cut to end at
    the last step; the end, where it changes anything, is the last entry of ``syncs`` (-1)."""
    steps = len(lrs)
    theta = [x0.clone() for _ in range(n)]
    outer = [_OuterSGD(x0, outer_lr, outer_momentum, nesterov) for _ in range(n)]
    x = [x0.clone() for _ in range(n)]
    inner = _Inner(n, x0, optimizer, momentum, weight_decay=weight_decay)
    everything = torch.arange(x0.numel())
    run, end = Run(), -1
    pending: tuple[list[torch.Tensor], torch.Tensor] | None = None  # the round before's
    for k in range(steps):
        if k > end:
            h = min(period, steps - k)
            run.periods.append((k, h))
            end = k + h - 1
        x = _inner_steps(x, k, grad, lrs[k], inner, 1)
        if k == end:
            deltas = [theta[i] - x[i] for i in range(n)]
            for i in range(n):
                if form == "delayed":
                    if pending is not None:
                        outer[i].step(theta[i], pending[1], everything)
                elif pending is None:
                    outer[i].step(theta[i], deltas[i] / n, everything)
                else:
                    outer[i].step(theta[i], deltas[i] / n + (pending[1] - pending[0][i] / n),
                                  everything)
                x[i] = theta[i].clone()
            pending = (deltas, _mean(deltas))
            run.syncs.append(k)
        run.trajectory.append([t.clone() for t in x])
    if pending is not None and (form == "delayed" or n > 1):
        for i in range(n):
            delta = pending[1] if form == "delayed" else pending[1] - pending[0][i] / n
            outer[i].step(theta[i], delta, everything)
            x[i] = theta[i].clone()
        if form == "eager":
            average = _mean(x)
            x = [average.clone() for _ in range(n)]
        run.syncs.append(-1)
        run.trajectory.append([t.clone() for t in x])
    return run
