"""Oracle: D-PSGD, decentralized parallel stochastic gradient descent.

Lian, Zhang, Zhang, Hsieh, Zhang, Liu, "Can Decentralized Algorithms Outperform Centralized
Algorithms? A Case Study for Decentralized Parallel Stochastic Gradient Descent" (NeurIPS 2017),
Algorithm 1, on every node i at iteration k:

- line 4: compute the local stochastic gradient ``g_i = grad F_i(x_{k,i}; xi_{k,i})`` at the
  node's *current* variable;
- line 5: the neighbourhood weighted average ``x_{k+1/2,i} = sum_j W_ij x_{k,j}``;
- line 6: ``x_{k+1,i} = x_{k+1/2,i} - gamma g_i``;

in matrix form (section 3 there) ``X_{k+1} = X_k W - gamma dF(X_k; xi_k)``, with the nodes'
variables as the columns of ``X_k``. The paper's W is symmetric and doubly stochastic, so
"node i weighs node j by W_ij" and "by W_ji" agree. For the time-varying, possibly directed
topologies here, row ``j`` of ``W_k`` (``W_k[j, i]``: the weight of ``i``'s value at ``j``)
holds what node ``j`` combines: ``x_{k+1} = W_k x_k - gamma g(x_k)``, node by node. W comes in
as plain data (one matrix per phase; step k uses phase ``k % period``).

Options of the library that the paper does not have, written as plain steps here:
an exact average of all nodes after every ``allreduce_every``-th step, and the step
``x -= lr * v`` with heavy-ball momentum ``v = mu v + g`` (``torch.optim.SGD`` without weight
decay) in place of ``x -= lr * g``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .allreduce import GradFn, mean, sgd_update


def dpsgd(x0: Sequence[torch.Tensor], mixing: Sequence[np.ndarray], grad: GradFn, steps: int,
          *, lr: float, momentum: float = 0.0,
          allreduce_every: int = 0) -> list[list[torch.Tensor]]:
    """Run D-PSGD on n workers from ``x0`` (one flat float64 tensor per worker) with the
    mixing matrices ``mixing`` (one n x n matrix per phase).

    Returns ``trajectory[k][i]``: worker ``i``'s parameters after step ``k + 1``.
    """
    n = len(x0)
    x = [t.clone() for t in x0]
    v = [torch.zeros_like(t) for t in x0]
    trajectory = []
    for k in range(steps):
        W = mixing[k % len(mixing)]
        assert W.shape == (n, n)
        grads = [grad(i, k, x[i]) for i in range(n)]  # line 4: at x_k, before the averaging
        half = [sum(float(W[j, i]) * x[i] for i in range(n) if W[j, i] != 0)  # line 5
                for j in range(n)]
        for j in range(n):  # line 6 (with momentum 0: x_{k+1} = x_{k+1/2} - gamma g)
            x[j], v[j] = sgd_update(half[j], v[j], grads[j], lr=lr, momentum=momentum,
                                    weight_decay=0.0)
        if allreduce_every and (k + 1) % allreduce_every == 0:
            x = [mean(x) for _ in range(n)]
        trajectory.append([t.clone() for t in x])
    return trajectory
