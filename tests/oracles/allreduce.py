"""Oracle: synchronous data-parallel SGD (AllReduce-SGD).

Every step each of the n workers computes a stochastic gradient at its own parameters; the
gradients are averaged exactly over all workers, ``g = (1/n) sum_i g_i``, and every worker then
takes the same optimizer step with ``g``. This is minibatch SGD, Goyal et al., "Accurate, Large
Minibatch SGD: Training ImageNet in 1 Hour" (2017), eq. (2) ``w_{t+1} = w_t - eta (1/|B|)
sum_{x in B} grad l(x, w_t)``, over the union B of equal per-worker minibatches, so that the
mean over B is the mean of the workers' own means; and it is what ``DistributedDataParallel``
computes, Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training"
(VLDB 2020): gradients are all-reduced (averaged) before the optimizer step, so training equals
local training on the union of the batches. Gradient bucketing there only groups values into
fewer messages; each coordinate's average does not depend on it, so no bucket size appears here.

The optimizer is ``torch.optim.SGD``'s update written out (dampening 0, no Nesterov):
``d = g + wd * x``; ``v = mu * v + d`` (``v`` starts at 0, so the first ``v`` is ``d``);
``x = x - lr * v``. Plain SGD is ``mu = wd = 0``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

#: ``grad(worker, step, x)``: worker ``worker``'s stochastic gradient at ``x`` at ``step``.
GradFn = Callable[[int, int, torch.Tensor], torch.Tensor]


def sgd_update(x: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *, lr: float,
               momentum: float, weight_decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of ``torch.optim.SGD`` (dampening 0, no Nesterov), written out:
    ``(x_next, v_next)``."""
    d = g + weight_decay * x
    v = momentum * v + d
    return x - lr * v, v


def mean(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """The exact average of the workers' values, summed in worker order."""
    return sum(values[1:], values[0]) / len(values)


def allreduce_sgd(x0: Sequence[torch.Tensor], grad: GradFn, steps: int, *, lr: float,
                  momentum: float = 0.0, weight_decay: float = 0.0) -> list[list[torch.Tensor]]:
    """Run AllReduce-SGD on n workers from ``x0`` (one flat float64 tensor per worker).

    Returns ``trajectory[k][i]``: worker ``i``'s parameters after step ``k + 1``.
    """
    n = len(x0)
    x = [t.clone() for t in x0]
    v = [torch.zeros_like(t) for t in x0]
    trajectory = []
    for k in range(steps):
        grads = [grad(i, k, x[i]) for i in range(n)]  # every worker at its own parameters
        g = mean(grads)  # the exact average over the workers
        for i in range(n):
            x[i], v[i] = sgd_update(x[i], v[i], g, lr=lr, momentum=momentum,
                                    weight_decay=weight_decay)
        trajectory.append([t.clone() for t in x])
    return trajectory
