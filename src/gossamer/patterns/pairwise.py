"""GossipGraD's gradient exchange: each worker's gradient averaged exactly inside its local
group (a node), then with one partner node's (1/2 each), the partner rotating every step on a
:class:`~gossamer.topology.gossipgrad.GossipGradSchedule` (CUBE or DISSEMINATION); exact, or
through a one-round compressor with error feedback.

The :class:`~gossamer.algorithms.GossipGraD` algorithm and the DDP comm hook
(:mod:`gossamer.hooks.gossipgrad`) both go through :class:`GradientGossip`, so they compute
the same thing. Reference: Daily et al., "GossipGraD: Scalable Deep Learning using Gossip
Communication based Asynchronous Gradient Descent" (2018).

Example::

    gossip = GradientGossip(comm, topology="cube", local_group_size=2)
    gossip.combine([flat_gradient], step)  # replaced in place by GossipGraD's average
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gossamer.checks import check_int
from gossamer.comm.base import Communicator
from gossamer.comm.buckets import apply_flat
from gossamer.compress.base import Compressor, Memory, value_dtype
from gossamer.compress.cast import NoCompression
from gossamer.compress.dgc import DGCMemory
from gossamer.compress.payloads import Payload, pack_bytes, unpack_bytes
from gossamer.compress.registry import (
    Compression,
    available_compressors,
    lookup_compression,
)
from gossamer.topology.gossipgrad import GossipGradSchedule

__all__ = ["GradientGossip", "check_gossip_compression", "check_local_group_size",
           "group_mean"]


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

    The algorithm (:class:`~gossamer.algorithms.gossipgrad.GossipGraDRuntime`) and the DDP
    comm hook (:func:`gossamer.hooks.gossipgrad_hook`) both call :meth:`combine`, so they
    compute the same thing. Builds the local group's communicator on construction: every
    worker of the communicator must construct it (with the same arguments).

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

    @torch.no_grad()
    def combine_compressed(self, grads: Sequence[tuple[str, torch.Tensor]], step: int,
                           compressor: Compressor, memory: Memory | None) -> None:
        """:meth:`combine` through ``compressor`` (this worker's own copy) and ``memory``:
        replace each named gradient, in place, by the mean of what this node and its partner
        sent (the local group's mean first, exact). Every worker passes the same names and
        shapes in the same order. The members of a node compress the same mean with the same
        seeds and memory, so they stay equal."""
        local = self.local
        if local is not None:
            apply_flat([g for _, g in grads], lambda buffer: local.all_reduce(buffer, op="mean"))
        peers = self.partner_ranks(step)
        if peers is None:
            return
        send_to, recv_from = peers
        compressor.set_step(step)
        dense = NoCompression()
        items = []  # (name, gradient, compensated, its compressor, payload)
        for key, g in grads:
            c = memory.compensate(key, g) if memory is not None else g
            own = compressor if compressor.compresses(c) else dense
            if own is dense and c.dtype != value_dtype(c.dtype):
                c = c.to(value_dtype(c.dtype))
            items.append((key, g, c, own, own.compress(c, key)))
        payloads: list[Payload] = [item[4] for item in items]
        packed = pack_bytes(payloads)
        # the payloads' sizes may differ between workers (a threshold's): the size goes first
        size = torch.tensor([packed.numel()], dtype=torch.int64, device=packed.device)
        theirs_size = int(self.comm.exchange({send_to: size}, [recv_from]).wait()[recv_from])
        received = self.comm.exchange({send_to: packed}, [recv_from], recv_like=torch.empty(
            theirs_size, dtype=torch.uint8, device=packed.device)).wait()[recv_from]
        theirs = unpack_bytes(received, payloads)
        for (key, g, c, own, payload), other in zip(items, theirs, strict=True):
            out = torch.zeros(c.numel(), dtype=value_dtype(c.dtype), device=c.device)
            own.decompress_add(payload, key, out)
            own.decompress_add(other, key, out)  # a + b == b + a: CUBE partners agree
            if memory is not None:
                memory.update(key, c, payload, own)
            g.copy_(out.mul_(0.5).view_as(g))


@torch.no_grad()
def group_mean(comm: Communicator, buffers: Sequence[torch.Tensor], group: Sequence[int]
               ) -> None:
    """Replace each buffer, in place, by its exact mean over the ranks ``group`` (this rank
    among them): one exchange with each other member, every bucket's posted before any is
    waited on; the members' values summed in the order of ``group``, then multiplied by
    ``1 / len(group)``, so that every member computes the same bits. NoLoCo's pair (or
    triple) average; a group of one leaves the buffers as they are."""
    others = [r for r in group if r != comm.rank]
    if not others:
        return
    handles = [comm.exchange(dict.fromkeys(others, b), others, recv_like=b) for b in buffers]
    for buffer, handle in zip(buffers, handles, strict=True):
        received = handle.wait()
        total = None
        for r in group:
            x = buffer if r == comm.rank else received[r]
            total = x.clone() if total is None else total.add_(x)
        assert total is not None
        buffer.copy_(total.mul_(1.0 / len(group)))


def check_gossip_compression(compression: Compression) -> None:
    """ValueError naming ``compression`` unless a gossip exchange can carry it: one round
    (PowerSGD's second needs a sum over every worker of the first) and a memory that is
    error feedback or none (DGC's momentum correction is AllReduce's)."""
    compressor, memory = compression.build(1)
    problem = None
    if compressor.rounds > 1:
        problem = f"{type(compressor).__name__} makes {compressor.rounds} collective rounds"
    elif isinstance(memory, DGCMemory):
        problem = "its momentum correction needs every worker's average (allreduce)"
    if problem is not None:
        usable = [name for name in available_compressors()
                  if _gossipable(lookup_compression(name)())]
        raise ValueError(f"compression {compression.name!r} cannot go through gossipgrad's "
                         f"pairwise exchange: {problem}; gossipgrad takes "
                         f"{', '.join(usable)}")


def _gossipable(compression: Compression) -> bool:
    compressor, memory = compression.build(1)
    return compressor.rounds == 1 and not isinstance(memory, DGCMemory)
