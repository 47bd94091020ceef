"""GossipGraD: gradient gossip with one partner per step, on CUBE or DISSEMINATION schedules.

After each backward pass a worker's gradient is first averaged exactly inside its *local group*
(``local_group_size`` consecutive ranks, e.g. the GPUs of one node: ranks ``0 .. g-1`` are node
0), and then each node exchanges its gradient with one partner node chosen by the
:class:`~gossamer.topology.gossipgrad.GossipGradSchedule` and the two are averaged (1/2 each).
Every rank of a node exchanges with the rank of the same local index in the partner node, so
all ranks of a node take the same result and a node's replicas stay identical. The partner
rotates every step (offset ``2^p`` at step ``p`` of a round); the node order is reshuffled,
seeded and identical on all ranks, every round of ``ceil(log2 nodes)`` steps. After one round
every node's gradient has reached every other node, yet each worker sends one model's worth of
bytes per step (plus the local all-reduce), whatever the number of nodes.

The gradients that different nodes apply differ, so their parameters drift apart (gossip):
an exact average of the parameters is taken at the end (``average_at_end``, default True),
and optionally before evaluations or every K steps.

Reference: Daily, Vishnu, Siegel, Warfel, Amatya, "GossipGraD: Scalable Deep Learning using
Gossip Communication based Asynchronous Gradient Descent" (2018); for PyTorch as torchdistx's
GossipGraD comm hook. The DDP comm hook is :mod:`gossamer.hooks.gossipgrad`.

Example::

    optimizer = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    GossipGraD(topology="cube", local_group_size=4), comm)
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()  # local average, partner exchange, then SGD steps
    optimizer.finish()  # exact average of the parameters after the last step
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from gossamer.algorithms.base import Algorithm, ExactAverages, Runtime
from gossamer.algorithms.buckets import Buckets
from gossamer.algorithms.nonfinite import all_finite
from gossamer.checks import check_int
from gossamer.comm.base import Communicator
from gossamer.topology.gossipgrad import GossipGradSchedule, check_gossipgrad_topology

__all__ = ["GossipGraD", "GossipGraDRuntime", "GradientGossip", "check_local_group_size"]


def check_local_group_size(local_group_size: object, world_size: int) -> int:
    """The number of nodes, ``world_size // local_group_size``; ValueError naming
    ``local_group_size`` unless it is an int >= 1 that divides ``world_size``."""
    check_int("local_group_size", local_group_size, 1)
    g = int(local_group_size)  # type: ignore[call-overload]
    if world_size % g:
        raise ValueError(f"local_group_size={local_group_size} does not divide the world "
                         f"size {world_size}: every node must have the same number of workers")
    return world_size // g


class GradientGossip:
    """One worker's side of GossipGraD's gradient averaging, over a communicator.

    The algorithm (:class:`GossipGraDRuntime`) and the DDP comm hook
    (:func:`gossamer.hooks.gossipgrad_hook`) both call :meth:`combine`, so they compute the
    same thing. Builds the local group's communicator on construction: every worker of the
    communicator must construct it (with the same arguments).

    Args:
        comm: this worker's communicator; its ranks ``node * g .. node * g + g - 1`` form node
            ``node``.
        topology: ``"dissemination"`` (default) or ``"cube"`` (a power-of-two node count).
        local_group_size: workers per node, averaged exactly first (default 1: none).
        seed: seed of the node-order shuffles (default 0).
        shuffle: reshuffle the node order every round (default True).
    """

    def __init__(self, comm: Communicator, *, topology: str = "dissemination",
                 local_group_size: int = 1, seed: int = 0, shuffle: bool = True) -> None:
        self.comm = comm
        self.local_group_size = local_group_size
        self.nodes = check_local_group_size(local_group_size, comm.world_size)
        self.node, self.local_rank = divmod(comm.rank, local_group_size)
        self.schedule = GossipGradSchedule(self.nodes, topology, seed, shuffle)
        first = self.node * local_group_size
        self.local: Communicator | None = (
            comm.group(list(range(first, first + local_group_size)))
            if local_group_size > 1 else None
        )

    def partner_ranks(self, step: int) -> tuple[int, int] | None:
        """(rank sent to, rank received from) at ``step``: the workers of the same local index
        in the partner nodes; None with a single node."""
        partners = self.schedule.partners(self.node, step)
        if partners is None:
            return None
        g = self.local_group_size
        return partners.send_to * g + self.local_rank, partners.recv_from * g + self.local_rank

    @torch.no_grad()
    def combine(self, buffers: Sequence[torch.Tensor], step: int) -> None:
        """Replace each buffer, in place, by GossipGraD's average at ``step``: the mean over
        the local group, then the mean of that and the partner node's."""
        if self.local is not None:
            for buffer in buffers:
                self.local.all_reduce(buffer, op="mean")
        peers = self.partner_ranks(step)
        if peers is None:
            return
        send_to, recv_from = peers
        # Post every bucket's exchange before waiting for any: they travel together.
        handles = [self.comm.exchange({send_to: b}, [recv_from], recv_like=b) for b in buffers]
        for buffer, handle in zip(buffers, handles, strict=True):
            received = handle.wait()[recv_from]
            buffer.add_(received).mul_(0.5)  # a + b == b + a: CUBE partners agree bit for bit


@dataclass(frozen=True, kw_only=True)
class GossipGraD(Algorithm):
    """GossipGraD: local-group average, then one partner node's gradient per step (1/2 each).

    Args:
        topology: ``"dissemination"`` (default: send to ``i + 2^k``, receive from
            ``i - 2^k``, any node count) or ``"cube"`` (swap with ``i XOR 2^k``; the number of
            nodes must be a power of two).
        local_group_size: consecutive ranks that form one node and average exactly first
            (default 1: every worker is a node). Must divide the world size.
        seed: seed of the node-order shuffles, identical on all ranks (default 0).
        shuffle: reshuffle the node order every ``ceil(log2 nodes)`` steps (default True).
        bucket_mb: size of the flat gradient buckets in MiB (default 25).
        allreduce_every: an exact average of the parameters every K steps (default 0: never).
        average_before_eval: exact average of the parameters before each evaluation
            (default False; changes the trajectory).
        average_at_end: exact average after the last step, so all replicas end equal
            (default True).

    Example::

        GossipGraD(topology="cube", local_group_size=2)  # 8 workers: 4 nodes of 2
        # command line: gossamer train --sim 8 --algorithm gossipgrad \\
        #                   --option topology=cube --option local_group_size=2
    """

    name: ClassVar[str] = "gossipgrad"

    topology: str = "dissemination"  # cube mixes exactly in one round; needs 2^k nodes
    local_group_size: int = 1  # higher: fewer nodes to gossip among (faster mixing), more
    #                            local all-reduce traffic per worker (2 (g-1)/g of the model)
    seed: int = 0  # node-order shuffles; any value, the same on every rank
    shuffle: bool = True  # False: the same partners every round (slower mixing across rounds)
    bucket_mb: float = 25.0  # higher: fewer, larger messages (less latency paid)
    allreduce_every: int = 0  # an exact average every K steps (0: never); lower: closer
    average_before_eval: bool = False  # exact average before each evaluation
    average_at_end: bool = True  # exact average after the last step, so all end equal

    def __post_init__(self) -> None:
        object.__setattr__(self, "topology", check_gossipgrad_topology(self.topology))
        check_int("local_group_size", self.local_group_size, 1)
        check_int("seed", self.seed, 0)
        check_int("allreduce_every", self.allreduce_every, 0)
        for flag in ("shuffle", "average_before_eval", "average_at_end"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        if not (isinstance(self.bucket_mb, (int, float)) and not isinstance(self.bucket_mb, bool)
                and math.isfinite(self.bucket_mb) and self.bucket_mb > 0):
            raise ValueError(f"bucket_mb must be a number > 0, got {self.bucket_mb!r}")

    def validate(self, world_size: int) -> None:
        nodes = check_local_group_size(self.local_group_size, world_size)
        check_gossipgrad_topology(self.topology, nodes)

    def bind(self, comm: Communicator, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> GossipGraDRuntime:
        return GossipGraDRuntime(self, comm, model, optimizer)


class GossipGraDRuntime(ExactAverages, Runtime):
    """One worker of GossipGraD: its gradient buckets, local group and partner schedule.

    The schedule is a function of the step counter alone, so the step counter (saved by
    :meth:`state_dict`) is all the state a resumed run needs.
    """

    def __init__(self, config: GossipGraD, comm: Communicator, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        super().__init__(comm, model, optimizer)
        config.validate(comm.world_size)
        self.config = config
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = Buckets(self.params, bucket_bytes=int(config.bucket_mb * 2**20))
        self.gossip = GradientGossip(comm, topology=config.topology,
                                     local_group_size=config.local_group_size,
                                     seed=config.seed, shuffle=config.shuffle)

    def check_gradients(self) -> None:
        """Nothing here: after_backward checks the flat copy it sends."""
        self.skip_update = False

    @torch.no_grad()
    def after_backward(self) -> None:
        self.buckets.gather([p.grad for p in self.params])
        if not all_finite(self.buckets.buffers):
            if self.nonfinite == "raise":
                raise self.nonfinite_error("gradient")
            # skip: this worker's gradient is dropped; it sends zeros in its place (the
            # partners wait for a message) and applies what the combination gives
            for buffer in self.buckets.buffers:
                buffer.zero_()
            self.skipped_steps += 1
        self.gossip.combine(self.buckets.buffers, self.step)
        for p, combined in zip(self.params, self.buckets.views, strict=True):
            if p.grad is None:
                # Unused here but maybe not at the partner: take the combined gradient anyway.
                p.grad = combined.clone()
            else:
                p.grad.copy_(combined)

    def after_step(self) -> None:
        self.periodic_average()
