"""GossipGraD: gradient gossip with one partner per step, on CUBE or DISSEMINATION schedules.

After each backward pass a worker's gradient is first averaged exactly inside its *local group*
(``local_group_size`` consecutive ranks, e.g. the GPUs of one node: ranks ``0 .. g-1`` are node
0), and then each node exchanges its gradient with one partner node chosen by the
:class:`~gossamer.topology.gossipgrad.GossipGradSchedule` and the two are averaged (1/2 each).
Every rank of a node exchanges with the rank of the same local index in the partner node, so
all ranks of a node take the same result and a node's replicas stay identical. The partner
rotates every step (offset ``2^p`` at step ``p`` of a round); the node order is reshuffled,
seeded and identical on all ranks, every round of ``ceil(log2 nodes)`` steps: over a round
every node is paired, directly or through others, with every other (the product of a round's
averages mixes them all; with ``cube`` it is the exact average). Each step averages a *fresh*
gradient, though, so a gradient reaches only the partner of its step: nothing is forwarded,
and the replicas drift apart (only the exact parameter averages, ``average_at_end`` and
``allreduce_every``, bring them together). Each worker sends one model's worth of bytes per
step (plus the local all-reduce), whatever the number of nodes.

With a ``compression`` (a registered compressor by name, :mod:`gossamer.compress.registry`),
each node sends its partner the compressed gradient instead, tensor by tensor with error
feedback: ``sent = decompress(compress(g + e))``, ``e = g + e - sent``, and the two sent
gradients are averaged. Compressors of one round whose memory is error feedback or none apply
(``topk``, ``randomk``, ``qsgd``, ``fp16``); PowerSGD's second round needs the sum over a
pair that the DISSEMINATION schedule does not form, and DGC's momentum correction is
AllReduce's.

The gradients that different nodes apply differ, so their parameters drift apart (gossip):
an exact average of the parameters is taken at the end (``average_at_end``, default True),
and optionally before evaluations or every K steps.

Reference: Daily, Vishnu, Siegel, Warfel, Amatya, "GossipGraD: Scalable Deep Learning using
Gossip Communication based Asynchronous Gradient Descent" (2018); for PyTorch as torchdistx's
GossipGraD comm hook. The DDP comm hook is :mod:`gossamer.hooks.gossipgrad`; both exchange
through :class:`~gossamer.patterns.pairwise.GradientGossip`.

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
from typing import Any, ClassVar

import torch
from torch import nn

from gossamer.algorithms.allreduce import compression_argument
from gossamer.algorithms.base import Algorithm, ExactAverages, Runtime
from gossamer.checks import check_int
from gossamer.comm.base import Communicator
from gossamer.comm.buckets import Buckets
from gossamer.compress.base import Compressor, Memory
from gossamer.compress.registry import Compression
from gossamer.options import option
from gossamer.patterns.overlap import ThreadedBuckets, first_bucket_bytes, overlaps
from gossamer.patterns.pairwise import (
    GradientGossip,
    check_gossip_compression,
    check_local_group_size,
)
from gossamer.topology.gossipgrad import check_gossipgrad_topology

__all__ = ["GossipGraD", "GossipGraDRuntime"]


class GossipBuckets(ThreadedBuckets):
    """GossipGraD's exchange, bucket by bucket: each bucket combined with the partner's
    (:meth:`GradientGossip.combine`, or :meth:`GradientGossip.combine_compressed` with the
    runtime's compressor), during backward where the communicator overlaps.

    Args:
        runtime: the worker's runtime (its gossip, compressor, memory and step).
        named: ``(name, parameter)`` in bucket order (reverse registration order).
        bucket_bytes: bytes per bucket at most (the first at most 1 MiB to overlap).
        overlap: start the buckets during backward where the communicator can.
    """

    what = "gossipgrad"

    def __init__(self, runtime: GossipGraDRuntime, named: Sequence[tuple[str, nn.Parameter]],
                 bucket_bytes: int, overlap: bool = True) -> None:
        self.runtime = runtime
        self.buckets = Buckets([p for _, p in named], bucket_bytes=bucket_bytes,
                               first_bytes=first_bucket_bytes(bucket_bytes, overlap))
        super().__init__(named, [bucket for bucket, _, _ in self.buckets.slots],
                         overlap and overlaps(runtime.comm))

    def _prepare(self, bucket: int, overflow: bool = False) -> tuple:
        """Bucket ``bucket``'s gradients (zeros for missing ones, and in place of non-finite
        ones), flat or named, with the step."""
        members = self.members[bucket]
        step = self.runtime.step
        if self.runtime.compressor is not None:
            for i in members:
                p = self.params[i]
                if p.grad is None:  # unused here, maybe not at the partner: its gradient is 0
                    p.grad = torch.zeros_like(p)
            named = [(self.named[i][0], self.params[i].grad) for i in members]
            self._finite_or_zeros(named, overflow)
            return named, step
        buffer = self.buckets.buffers[bucket]
        self._finite_or_zeros(self._gather(bucket, self.buckets.views), overflow, zeros=buffer)
        return buffer, step

    def _send(self, what: torch.Tensor | list[tuple[str, torch.Tensor]], step: int) -> None:
        runtime = self.runtime
        if isinstance(what, torch.Tensor):
            runtime.gossip.combine([what], step)
        else:
            assert runtime.compressor is not None
            runtime.gossip.combine_compressed(what, step, runtime.compressor, runtime.memory)

    def _finish(self) -> None:
        if self.runtime.compressor is not None:
            return  # combined in place in the gradients
        for p, combined in zip(self.params, self.buckets.views, strict=True):
            if p.grad is None:
                # Unused here but maybe not at the partner: take the combined gradient anyway.
                p.grad = combined.clone()
            else:
                p.grad.copy_(combined)


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
        compression: a registered compressor and its options, sending each partner the
            compressed gradient with error feedback: a
            :class:`~gossamer.compress.Compression` or its spec, ``"topk:ratio=0.01"``
            (default None: exact gradients). One-round compressors without momentum
            correction: ``topk``, ``randomk``, ``qsgd``, ``fp16``.
        overlap: on real processes, exchange each bucket during backward as soon as its
            gradients are ready, buckets in reverse registration order, on a communication
            thread (default True; the simulator exchanges the same buckets after backward).
            Every worker must register the parameters in the same order, and gradient
            accumulation needs ``no_sync()``.

    Example::

        GossipGraD(topology="cube", local_group_size=2)  # 8 workers: 4 nodes of 2
        # command line: gossamer train --sim 8 --algorithm gossipgrad \\
        #                   --option topology=cube --option local_group_size=2
    """

    name: ClassVar[str] = "gossipgrad"
    #: the partner schedule follows from the number of nodes and the step alone
    continues_after_failure: ClassVar[bool] = True
    needs: ClassVar[str] = (
        "allreduce_every=10 (an exact parameter average every 10 steps) for the MNIST CNN: "
        "with its defaults the replicas drift apart (consensus distance 54) and their average "
        "reaches 95.95% at 8 workers, 89.4% at 16, against 98.50% and 97.65% for allreduce; "
        "with it 98.40% and 97.75% (docs/benchmarks/gossip.md)")

    topology: str = "dissemination"  # cube mixes exactly in one round; needs 2^k nodes
    local_group_size: int = 1  # higher: fewer nodes to gossip among (faster mixing), more
    #                            local all-reduce traffic per worker (2 (g-1)/g of the model)
    seed: int = 0  # node-order shuffles; any value, the same on every rank
    shuffle: bool = True  # False: the same partners every round (slower mixing across rounds)
    bucket_mb: float = 25.0  # higher: fewer, larger messages (less latency paid)
    allreduce_every: int = 0  # an exact average every K steps (0: never); lower: closer
    average_before_eval: bool = False  # exact average before each evaluation
    average_at_end: bool = True  # exact average after the last step, so all end equal
    compression: Compression | str | None = option(
        None, "a compressor spec NAME[:KEY=VALUE...] for the partner exchange, with error "
        "feedback (topk, randomk, qsgd, fp16); none: exact gradients")
    overlap: bool = option(True, "start each bucket's exchange during backward, as soon as "
                           "its gradients are ready (DDP's schedule, on real processes)")

    def __post_init__(self) -> None:
        if self.compression is not None:
            object.__setattr__(self, "compression", compression_argument(self.compression))
            check_gossip_compression(self.compression)
        object.__setattr__(self, "topology", check_gossipgrad_topology(self.topology))
        check_int("local_group_size", self.local_group_size, 1)
        check_int("seed", self.seed, 0)
        check_int("allreduce_every", self.allreduce_every, 0)
        for flag in ("shuffle", "average_before_eval", "average_at_end", "overlap"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        if not (isinstance(self.bucket_mb, (int, float)) and not isinstance(self.bucket_mb, bool)
                and math.isfinite(self.bucket_mb) and self.bucket_mb > 0):
            raise ValueError(f"bucket_mb must be a number > 0, got {self.bucket_mb!r}")

    def sharding_refusal(self) -> str | None:
        return ("its gradient exchange is not proven on local shards yet")

    def symmetric(self) -> bool:
        return True  # one partner a step, and the same local all-reduces

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
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self._connect(comm)
        # DDP's buckets: reverse registration order, which every worker must share
        self.exchange = GossipBuckets(self, list(reversed(named)),
                                      int(config.bucket_mb * 2**20), overlap=config.overlap)

    def _connect(self, comm: Communicator) -> None:
        """The local group, the partner schedule and the compressor for ``comm``'s workers
        (a memory empty)."""
        config = self.config
        self.gossip = GradientGossip(comm, topology=config.topology,
                                     local_group_size=config.local_group_size,
                                     seed=config.seed, shuffle=config.shuffle)
        self.compressor: Compressor | None = None
        self.memory: Memory | None = None
        if config.compression is not None:
            assert isinstance(config.compression, Compression)
            compressor, memory = config.compression.build(comm.world_size)
            # the members of a node compress the same mean: the same draws and memory
            self.compressor = compressor.for_worker(self.gossip.node)
            self.memory = memory.fresh() if memory is not None else None

    @torch.no_grad()
    def change_membership(self, comm: Communicator, algorithm: Algorithm) -> None:
        """Go on over ``comm`` (``local_group_size`` must divide the members, and ``cube``
        needs a power of two of nodes: an error naming them otherwise). The step's exchange
        over the old communicator is dropped, never waited on (its communication thread is
        replaced: a job still blocked there fails within the timeout, alone); the local
        groups, the partner schedule (a function of the number of nodes and the step) and the
        compressor are rebuilt for the new ranks, with empty error-feedback memories (the
        members of a node must hold the same one); then the members' exact average."""
        assert isinstance(algorithm, GossipGraD)
        algorithm.validate(comm.world_size)
        self.exchange.abandon()
        self.comm, self.config = comm, algorithm
        self._connect(comm)
        self.average_parameters()

    def check_gradients(self) -> None:
        """Nothing here: after_backward checks the flat copy it sends."""
        self.skip_update = False

    @torch.no_grad()
    def after_backward(self) -> None:
        # combined during backward already (overlap), or here; a worker with a non-finite
        # gradient sent zeros in place of each bucket that held one (its partners wait for a
        # message) and applies what the combination gives, or raises afterwards
        self.exchange.reduce()
        found = self.exchange.found
        self.exchange.new_step()
        if found is not None:
            if self.nonfinite == "raise":
                raise self.nonfinite_error("gradient", found=found)
            self.skipped_steps += 1

    def pause_gradient_sync(self, paused: bool) -> None:
        self.exchange.syncing = not paused

    def use_scaler(self, scaled: bool) -> None:
        self.exchange.scaled = scaled  # exchange only what the workers agreed is finite

    def after_step(self) -> None:
        self.periodic_average()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.compressor is not None:
            state["compression"] = {
                "compressor": self.compressor.state_dict(),
                "memory": self.memory.state_dict() if self.memory is not None else None}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.compressor is not None:
            self.compressor.load_state_dict(state["compression"]["compressor"])
            if self.memory is not None:
                self.memory.load_state_dict(state["compression"]["memory"])
