"""Oracle: GossipGraD, gradient gossip with one partner node per step.

Daily, Vishnu, Siegel, Warfel, Amatya, "GossipGraD: Scalable Deep Learning using Gossip
Communication based Asynchronous Gradient Descent" (2018, arXiv:1803.05880). Of its features
(abstract, items 1-3) this program writes out the synchronous core: each compute node
exchanges its gradient with a single partner per step (O(1) messages instead of an
all-reduce's Theta(log p)); the partners follow a hypercube (CUBE) or dissemination
(DISSEMINATION) pattern whose offset doubles every step, so a node's update reaches every other
node indirectly within ``log2(p)`` steps; and the partners rotate. The details follow the
paper's PyTorch port, torchdistx's ``gossip_grad_hook``:

1. the workers of a node (``g`` consecutive ranks) first average their gradients exactly:
   ``h_m = (1/g) sum_{i in node m} g_i``;
2. the nodes sit in an order that is reshuffled every round of ``period = ceil(log2 M)`` steps
   (M nodes; ``period = 1`` for one node); at step k, with ``p = k mod period`` and node m at
   position ``s`` of the round's order:
   CUBE: m swaps with the node at position ``s XOR 2^p``;
   DISSEMINATION: m sends to position ``(s + 2^p) mod M`` and receives from ``(s - 2^p) mod M``;
3. the node combines what it received with its own, 1/2 each: ``c_m = (h_m + h_recv) / 2``
   (one node: ``c_m = h_m``), and every worker of the node steps with ``c_m``.

The shuffled orders are plain data (``orders[round]``, position -> node); the partner rule,
the local averages and the combination are computed here. Library options written as plain
steps: an exact average of all workers' parameters after every ``allreduce_every``-th step, and
heavy-ball momentum ``v = mu v + c; x -= lr v`` (``torch.optim.SGD`` without weight decay).
The paper's asynchronous sample shuffle and overlapped communication change no arithmetic and
are not modelled.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .allreduce import GradFn, mean, sgd_update


def period_of(nodes: int) -> int:
    """Steps per round: ``ceil(log2 nodes)``, and 1 for a single node."""
    return max(1, (nodes - 1).bit_length())  # ceil(log2 nodes), in integers


def received_from(node: int, step: int, topology: str, order: Sequence[int]) -> int | None:
    """The node whose (locally averaged) gradient ``node`` receives at ``step``, given the
    round's order; None for a single node."""
    nodes = len(order)
    if nodes == 1:
        return None
    offset = 2 ** (step % period_of(nodes))
    position = list(order).index(node)
    if topology == "cube":
        return order[position ^ offset]  # a swap: sent to and received from the same node
    if topology == "dissemination":
        return order[(position - offset) % nodes]
    raise ValueError(f"topology must be 'cube' or 'dissemination', got {topology!r}")


def gossipgrad(x0: Sequence[torch.Tensor], grad: GradFn, steps: int, *, lr: float,
               topology: str, local_group_size: int, orders: Sequence[Sequence[int]],
               momentum: float = 0.0, allreduce_every: int = 0) -> list[list[torch.Tensor]]:
    """Run GossipGraD on n workers from ``x0`` (one flat float64 tensor per worker).

    ``orders[r]`` is round r's node order; enough rounds must be given for ``steps``.
    Returns ``trajectory[k][i]``: worker ``i``'s parameters after step ``k + 1``.
    """
    n, g = len(x0), local_group_size
    assert n % g == 0
    nodes = n // g
    period = period_of(nodes)
    x = [t.clone() for t in x0]
    v = [torch.zeros_like(t) for t in x0]
    trajectory = []
    for k in range(steps):
        grads = [grad(i, k, x[i]) for i in range(n)]
        local = [mean(grads[m * g:(m + 1) * g]) for m in range(nodes)]  # 1. local average
        order = orders[k // period]  # 2. this round's order
        assert sorted(order) == list(range(nodes))
        combined = []
        for m in range(nodes):
            r = received_from(m, k, topology, order)
            combined.append(local[m] if r is None else (local[m] + local[r]) / 2)  # 3.
        for i in range(n):  # every worker of node m steps with c_m
            x[i], v[i] = sgd_update(x[i], v[i], combined[i // g], lr=lr, momentum=momentum,
                                    weight_decay=0.0)
        if allreduce_every and (k + 1) % allreduce_every == 0:
            x = [mean(x) for _ in range(n)]
        trajectory.append([t.clone() for t in x])
    return trajectory
