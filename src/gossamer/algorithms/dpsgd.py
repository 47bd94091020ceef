"""D-PSGD: decentralized parallel SGD with doubly stochastic gossip averaging.

Every step each worker averages its parameters with its neighbours' — weighted by a doubly
stochastic mixing matrix, so the mean of the replicas is preserved — and then applies its own
gradient, computed at its parameters before the mixing: ``x_{k+1} = W x_k - lr * g(x_k)``.
Synchronous: a step waits for the neighbours' parameters of the same step. The paper's W is
symmetric; a directed doubly stochastic W (e.g. SGP's bipartite exponential graph) is mixed
by rows: each worker combines what it receives.

The wrapped optimizer steps from the mixed parameters, so what it adds besides the gradient is
taken there too: torch SGD's ``weight_decay`` makes ``x_{k+1} = W x_k - lr (g(x_k) +
wd W x_k)``, where the paper's update with an L2 term in each loss would decay ``x_k``:
``W x_k - lr (g(x_k) + wd x_k)``. The two differ by ``lr * wd * (W x_k - x_k)``, of the order
of ``lr * wd`` times the consensus distance (nothing once the replicas agree); put the L2 term
in the loss to follow the paper exactly.

Reference: Lian, Zhang, Zhang, Hsieh, Zhang, Liu, "Can Decentralized Algorithms Outperform
Centralized Algorithms? A Case Study for Decentralized Parallel Stochastic Gradient Descent"
(NeurIPS 2017).

Example::

    optimizer = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    DPSGD(topology="ring"), comm)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from gossamer.algorithms.gossip import GossipAlgorithm, GossipRuntime
from gossamer.comm.base import Communicator
from gossamer.topology import Topology


@dataclass(frozen=True, kw_only=True)
class DPSGD(GossipAlgorithm):
    """Decentralized parallel SGD over a doubly stochastic (e.g. undirected) topology.

    Args:
        topology: doubly stochastic and connected (default ``"ring"``; also
            ``"bipartite_exponential"``, ``"hypercube"``, ``"random_regular"`` ...).
        allreduce_every: an exact average every K steps (default 0: never).
        average_before_eval: exact average before each evaluation (default False).
        average_at_end: exact average after the last step (default True).
    """

    name: ClassVar[str] = "dpsgd"
    default_topology: ClassVar[str] = "ring"
    continues_after_failure: ClassVar[bool] = True

    def symmetric(self) -> bool:
        # sends in offset order (after_backward): any circulant graph mirrors
        return isinstance(self.topology, Topology) and self.topology.mirrored(by_offset=True)

    def sharding_refusal(self) -> str | None:
        return None  # the mixing is element-wise: each shard mixes with its own in the others

    def check_topology(self, topology: Topology) -> None:
        topology.require_doubly_stochastic(arg="topology")
        topology.require_strongly_connected(arg="topology")

    def bind(self, comm: Communicator, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> DPSGDRuntime:
        return DPSGDRuntime(self, comm, model, optimizer)


class DPSGDRuntime(GossipRuntime):
    """One worker of D-PSGD: mixes with its neighbours before applying its gradient."""

    @torch.no_grad()
    def after_backward(self) -> None:
        # The flat buffer is sent as it is, then (the sends done: wait() returned) mixed in
        # place; the received tensors are ours to scale. No copy of the model is made.
        self.flat.gather(self.params)
        x = self.flat.buffers[0]
        topo, rank, step = self.topology, self.comm.rank, self.step
        # in the order of their offsets from this rank: on a ring every worker sends to its
        # right first, so that all workers' messages travel alike (values do not depend on it)
        n = self.comm.world_size
        sends = {peer: x for peer in sorted(topo.out_peers(rank, step),
                                            key=lambda p: (p - rank) % n)}
        received = self.comm.exchange(sends, topo.in_peers(rank, step), recv_like=x).wait()
        weights = topo.in_weights(rank, step)
        x.mul_(weights.self_weight)
        for peer in sorted(received):
            x.add_(received[peer].mul_(weights.peers[peer]))
        self.flat.scatter(self.params)  # the optimizer now applies g(x_k) to W x_k

    def after_step(self) -> None:
        self.check_parameters()  # what the next step sends: checked at the step that made it
        self.periodic_average()
