"""AllReduce-SGD: synchronous data-parallel SGD, the baseline every method is compared with.

After each backward pass the gradients of all workers are averaged exactly (packed into flat
buckets, one ring all-reduce per bucket), so every worker takes the same optimizer step and the
replicas stay identical. This is what ``torch.nn.parallel.DistributedDataParallel`` computes;
here it is written only against a :class:`~gossamer.comm.Communicator`, so it also runs in the
simulator.

With a ``compression`` (a registered compressor by name, :mod:`gossamer.compress.registry`),
or a ``compressor`` object (and optionally a ``memory``), the gradients are averaged through
:class:`~gossamer.compress.CompressedReducer` instead: compensated by the memory, compressed,
all-reduced or all-gathered as the compressor declares, and decompressed; every worker still
gets the same average, so the replicas stay identical. Either way the buckets start during
backward, in reverse registration order, as soon as their gradients are ready (``overlap``).

Non-finite gradients: a worker that has one sends zeros in its place and sets its bit in flags
that ride at the end of the step's reduction (one more float32: no message of their own), so
every worker learns who it was, and all raise or all skip the step
(:mod:`gossamer.patterns.nonfinite`); the values are never sent nor compressed. Under a
GradScaler the same bits tell every worker of an overflow: all skip, none raises.

Reference: Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" (2017).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from gossamer.algorithms.base import Algorithm, Runtime
from gossamer.comm.base import Communicator, without_grad
from gossamer.compress.base import Compressor, Memory, resolve_aggregation
from gossamer.compress.dgc import (
    DGCMemory,
    apply_weight_decay,
    check_no_momentum,
    decay_in_gradient,
    follow_momentum,
    take_over_momentum,
)
from gossamer.compress.reducer import CompressedReducer, check_node_size
from gossamer.compress.registry import Compression, parse_compression
from gossamer.options import option
from gossamer.patterns.nonfinite import (
    flag_words,
    ranks_from_flags,
)
from gossamer.patterns.overlap import CompressedBuckets, GradientBuckets


@dataclass(frozen=True, kw_only=True)
class AllReduce(Algorithm):
    """Average gradients exactly over all workers after every backward pass.

    Args:
        bucket_mb: size of the flat gradient buckets in MiB (default 25, as DDP). Higher:
            fewer, larger messages (less latency); lower: more messages.
        compression: a registered compressor with its options and memory: a
            :class:`~gossamer.compress.Compression` or its spec, ``"dgc:ratio=0.001"`` or
            ``{"name": "dgc", "ratio": 0.001}`` (default None: the exact float32 average).
            The command line's ``--compressor``.
        compressor: a :class:`~gossamer.compress.Compressor` object, instead of
            ``compression`` (default None). Each worker uses its own copy.
        memory: what the compressor did not send, e.g.
            :class:`~gossamer.compress.ErrorFeedback` or :class:`~gossamer.compress.DGCMemory`
            (default None); needs a compressor. A ``DGCMemory(momentum=None)`` takes the
            momentum, Nesterov and weight decay of a ``torch.optim.SGD`` over when bound, and
            again at every step what a scheduler wrote back (``OneCycleLR``'s momentum: see
            :func:`~gossamer.compress.dgc.follow_momentum`); the weight decay is then applied
            by each worker after the exchange, dense, unless
            ``DGCMemory(weight_decay_in_gradient=True)``.
        aggregation: ``"allreduce"``, ``"allgather"`` or ``"sparse_allreduce"`` (default
            None: the compressor's own); a sparse compressor cannot be all-reduced, which is a
            ValueError here. ``"sparse_allreduce"`` (top-k, DGC) reduces the sparse payloads by
            regions and all-gathers about k kept sums: each worker sends about two payloads
            whatever the world size, instead of n - 1 (see
            :mod:`gossamer.compress.sparse_allreduce`).
        node_size: with a compressor, average dense inside groups of this many consecutive
            ranks first and exchange compressed between them (default 1: flat); must divide
            the world size.
        overlap: start each bucket's communication during backward as soon as its
            gradients are ready, buckets in reverse registration order, as DDP does (default
            True; on real processes: the simulator reduces the same buckets after backward).
            Dense, buckets are all-reduced asynchronously; compressed, each bucket goes
            through the reducer on a communication thread. Every worker must then register
            the parameters in the same order (as DDP requires); ``overlap=False`` buckets the
            compressed gradients in the order of their names instead, whatever the
            registration order. With a compressor, gradient accumulation needs
            :meth:`~gossamer.api.DistributedOptimizer.no_sync`. See
            :mod:`gossamer.patterns.overlap`.

    Example::

        optimizer = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                        AllReduce(bucket_mb=25))
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()  # gradients are averaged here, then SGD steps

        # compressed: top 1% of each gradient, the rest kept for later steps
        AllReduce(compression="topk:ratio=0.01")
        AllReduce(compression="dgc:ratio=0.001", aggregation="sparse_allreduce")
        AllReduce(compressor=TopK(ratio=0.01), memory=ErrorFeedback())  # the same
    """

    name: ClassVar[str] = "allreduce"

    # higher: fewer all-reduce calls, each paying latency once
    bucket_mb: float = option(25.0, "MiB of gradients per collective")
    compression: Compression | str | None = option(
        None, "a compressor spec NAME[:KEY=VALUE...] (see gossamer.compress.registry); none: "
        "the exact float32 average")
    compressor: Compressor | None = option(None, "a Compressor object (Python), instead of "
                                           "compression")
    memory: Memory | None = option(None, "a Memory object for compressor (error feedback, "
                                   "DGC's)")
    aggregation: str | None = option(None, "allreduce, allgather or sparse_allreduce (top-k, "
                                     "DGC: about 2 payloads per worker whatever n); none: the "
                                     "compressor's own")
    node_size: int = option(1, "hierarchy: dense all-reduce inside groups of this many "
                            "consecutive ranks, compressed between them")
    overlap: bool = option(True, "start each bucket's communication during backward, as soon "
                           "as its gradients are ready (DDP's schedule); false: after "
                           "backward, compressed buckets in the order of the names")

    def __post_init__(self) -> None:
        if not (isinstance(self.bucket_mb, (int, float)) and math.isfinite(self.bucket_mb)
                and self.bucket_mb > 0):
            raise ValueError(f"bucket_mb must be a number > 0, got {self.bucket_mb!r}")
        if self.compression is not None:
            object.__setattr__(self, "compression", compression_argument(self.compression))
            if self.compressor is not None or self.memory is not None:
                raise ValueError("compression: give either compression= (a registered "
                                 "compressor by name) or compressor=/memory= objects, not both")
        if self.compressor is not None and not isinstance(self.compressor, Compressor):
            raise ValueError(f"compressor must be a Compressor or None, got {self.compressor!r}")
        if self.memory is not None and not isinstance(self.memory, Memory):
            raise ValueError(f"memory must be a Memory or None, got {self.memory!r}")
        check_node_size(self.node_size)
        compressor, _ = self.compressor_and_memory(1)
        if compressor is None:
            for name, value, default in (("memory", self.memory, None),
                                         ("aggregation", self.aggregation, None),
                                         ("node_size", self.node_size, 1)):
                if value != default:
                    raise ValueError(f"{name}={value!r} needs a compressor")
        else:
            resolve_aggregation(compressor, self.aggregation)

    def compressor_and_memory(self, world_size: int) -> tuple[Compressor | None, Memory | None]:
        """The compressor and memory for ``world_size`` workers: built from ``compression``,
        or the objects given (each worker copies them); (None, None) without compression."""
        if isinstance(self.compression, Compression):
            # with the hierarchy, the compressed exchange averages the nodes' means
            return self.compression.build(max(1, world_size // self.node_size))
        return self.compressor, self.memory

    @property
    def label(self) -> str:
        """``allreduce``, or with a registered compressor its name, the preset's that builds
        it (``--algorithm dgc`` and ``--algorithm allreduce --compressor dgc`` alike)."""
        if isinstance(self.compression, Compression):
            return self.compression.name
        return self.name

    def symmetric(self) -> bool:
        # every worker makes the same collectives; the sparse all-reduce's all-to-all of
        # sizes is not a rotation of the ranks (each sends in rank order)
        return self.aggregation != "sparse_allreduce"

    def validate(self, world_size: int) -> None:
        check_node_size(self.node_size, world_size)

    def sharding_refusal(self) -> str | None:
        """None: on a sharded model the gradients FSDP2 reduce-scattered are averaged across
        the replicas, each rank's shard with its own in the others, and a compressor
        compresses each local shard as a tensor of its own (top-k per shard, PowerSGD's
        matrix of the shard's rows). DGC's memory is refused: it takes over the momentum of
        the optimizer's parameters, which are then DTensors it does not look for yet."""
        _, memory = self.compressor_and_memory(1)
        if isinstance(memory, DGCMemory):
            return ("DGC's memory takes over the optimizer's momentum by parameter, and a "
                    "sharded model's are DTensors, which it does not take yet; use another "
                    "compressor (topk, randomk, qsgd, powersgd, fp16) or error feedback")
        return None

    def bind(
        self, comm: Communicator, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> AllReduceRuntime:
        return AllReduceRuntime(self, comm, model, optimizer)


class AllReduceRuntime(Runtime):
    """One worker's AllReduce state: the gradient buckets and the step counter."""

    replicas_identical: ClassVar[bool] = True
    agrees_on_gradients: ClassVar[bool] = True  # the flags ride on the gradient reduction

    def __init__(
        self, config: AllReduce, comm: Communicator, model: nn.Module,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        super().__init__(comm, model, optimizer)
        self.config = config
        self.params = [p for p in model.parameters() if p.requires_grad]
        bucket_bytes = int(config.bucket_mb * 2**20)
        self.reducer: CompressedReducer | None = None
        self._found: str | None = None  # this step's non-finite gradients (error messages)
        # the non-finite agreement: one bit per rank (see gossamer.patterns.nonfinite)
        device = self.params[0].device if self.params else torch.device("cpu")
        dtype = self.params[0].dtype if self.params else torch.float32
        if dtype not in (torch.float32, torch.float64):  # sums of bits stay exact in these
            dtype = torch.float32
        self.flags = torch.zeros(flag_words(comm.world_size), dtype=dtype, device=device)
        compressor, memory = config.compressor_and_memory(comm.world_size)
        self.gradients: GradientBuckets | None = None
        self.compressed: CompressedBuckets | None = None
        if compressor is None:
            # the flags ride at the end of the last bucket: no message of their own
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            self.gradients = GradientBuckets(comm, named, self.flags, bucket_bytes,
                                             overlap=config.overlap)
            self.flags = self.gradients.flags
            return
        config.validate(comm.world_size)
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        # by name: the same order on every worker, whatever order the model registers them in
        self.named = sorted(named, key=lambda item: item[0])
        self.weight_decay: dict[torch.Tensor, float] = {}  # taken over from the optimizer
        self.decay_in_gradient = decay_in_gradient(memory)  # else dense, after the exchange
        # DGC's momentum: None, or whether it follows the optimizer's (else: the memory's own)
        self.follows_momentum: bool | None = None
        if isinstance(memory, DGCMemory):
            self.follows_momentum = memory.momentum is None
            if memory.momentum is None:
                momentum, nesterov, self.weight_decay = take_over_momentum(
                    optimizer, [p for _, p in self.named])
                memory = dataclasses.replace(memory, momentum=momentum, nesterov=nesterov)
            else:
                check_no_momentum(optimizer)
        self.reducer = CompressedReducer(
            comm, compressor, memory, aggregation=config.aggregation,
            node_size=config.node_size, bucket_bytes=bucket_bytes,
        )
        # overlap: DDP's buckets (reverse registration order, which every worker must share);
        # otherwise in the order of the names
        self.compressed = CompressedBuckets(
            comm, list(reversed(named)) if config.overlap else self.named, self.reducer,
            self.flags, bucket_bytes, step=lambda: self.step, prepare=self._prepare,
            overlap=config.overlap)

    def start(self, **kwargs: Any) -> None:
        """As :meth:`Runtime.start`; the compressor learns the run's length too (DGC fits its
        default density warm-up to it)."""
        super().start(**kwargs)
        if self.reducer is not None:
            self.reducer.compressor.set_total_steps(self.total_steps)

    def check_gradients(self) -> None:
        """Nothing here: the workers agree on non-finite gradients in after_backward."""
        self.skip_update = False

    def _agree(self, ranks: list[int]) -> bool:
        """Whether every worker's gradient is finite, from the ``ranks`` the all-reduced flags
        name (raises under the "raise" policy, on every worker alike)."""
        if not ranks:
            return True
        if self.nonfinite == "raise" and self.overflow is None:  # a scaler's overflow skips
            raise self.nonfinite_error("gradient", ranks, self._found)
        self.skip_update = True  # every worker skips: the replicas stay identical
        return False

    def after_backward(self) -> None:
        without_grad(self._compressed if self.reducer is not None else self._dense)

    def _dense(self) -> None:
        assert self.gradients is not None
        # averaged during backward already (overlap), or here; a worker with a non-finite
        # gradient sent zeros and its bit, and then no worker's gradients were replaced
        self.gradients.reduce(self.overflow)
        # the flags were read once after the reduction: unless a worker set its bit, every
        # gradient was finite (the usual case, without reading them again)
        self._found = self.gradients.found if self.gradients.flagged else None
        if not self.gradients.flagged or self._agree(self.gradients.ranks()):
            self.synchronizations += 1
        self.gradients.new_step()

    def pause_gradient_sync(self, paused: bool) -> None:
        schedule = self.gradients or self.compressed
        assert schedule is not None
        schedule.syncing = not paused

    def use_scaler(self, scaled: bool) -> None:
        if self.compressed is not None:  # compress unscaled gradients only: after backward
            self.compressed.scaled = scaled

    def _prepare(self, named: Sequence[tuple[str, nn.Parameter]]) -> None:
        """Before a bucket is compensated: DGC's momentum as the optimizer's groups now have
        it (a scheduler may have written it back since the last step; before the first bucket
        of a step, so the whole step uses it, and before the optimizer steps), and the weight
        decay taken over from the optimizer, added to the gradients where the memory wants it
        there."""
        assert self.reducer is not None
        if self.follows_momentum:
            memory = self.reducer.memory
            assert isinstance(memory, DGCMemory)
            follow_momentum(self.optimizer, self.params, memory, self.weight_decay)
        elif self.follows_momentum is False:
            check_no_momentum(self.optimizer)
        if self.decay_in_gradient:
            for _, p in named:
                decay = self.weight_decay.get(p)
                if decay:
                    p.grad.add_(p.detach(), alpha=decay)

    def _compressed(self) -> None:
        # compressed during backward already (overlap), or here. A worker whose gradient is
        # non-finite compresses zeros instead, so that no message, residual or momentum ever
        # holds the value; the flags ride with the reduction and every worker learns who it
        # was before anything is applied.
        assert self.reducer is not None and self.compressed is not None
        self.compressed.reduce(self.overflow)
        self._found = self.compressed.found
        self.compressed.new_step()
        if not self._agree(ranks_from_flags(self.flags)):  # skip: every worker drops it
            return
        if not self.decay_in_gradient:  # each worker decays its own parameters: nothing sent
            for name, p in self.named:
                decay = self.weight_decay.get(p)
                if decay:
                    apply_weight_decay(self.reducer.memory, name, p, p.grad, decay)
        self.synchronizations += 1

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.reducer is not None:
            state["compression"] = self.reducer.state_dict()  # DGC's: its momentum too
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.reducer is not None:
            self.reducer.load_state_dict(state["compression"])


def compression_argument(value: Compression | str | Mapping[str, Any]) -> Compression:
    """The ``compression`` option of a gradient-level method: a registered
    :class:`~gossamer.compress.Compression` or its spec (ValueError naming ``compression``
    for anything else, such as a registry algorithm like ``DGC(...)``)."""
    if isinstance(value, Algorithm):
        raise ValueError(f"compression: {type(value).__name__} is an algorithm; give a "
                         f"compressor spec such as {value.name!r} or its Compression")
    return parse_compression(value)
