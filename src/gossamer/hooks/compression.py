"""Gradient compression as DDP comm hooks: every registered compressor, by name.

For people who already train with ``torch.nn.parallel.DistributedDataParallel``:
``ddp.register_comm_hook(CompressionState(ddp, "dgc:ratio=0.001"), compression_hook)``, with
any compressor spec of :mod:`gossamer.compress.registry` (the same options as
``--compressor``), or a compressor object and a memory. Each bucket of gradients that DDP hands
the hook goes through the same :class:`~gossamer.compress.CompressedReducer` as
``AllReduce(compressor=..., memory=...)`` (compensate, compress, all-gather or all-reduce,
decompress, update the memory), so the hook and gossamer's own runtime compute the same
average. The traffic goes through a :class:`~gossamer.comm.TorchCommunicator` over a
process group of its own with the members of DDP's, on gloo and NCCL, and its ``stats``
count the compressed bytes. The hook does not block: the buckets are reduced on a
communication thread while backward goes on (see
:meth:`~gossamer.hooks.agreement.HookState.start`).

Tensors are named by the model's parameter names, so the memories, seeds and checkpoints do
not depend on how DDP buckets them (DDP rebuilds its buckets after the first step).
``state.step`` advances once per optimizer step: after the iteration's last bucket
(``GradBucket.is_last()``). Under ``ddp.no_sync()`` DDP does not call the hook.

**Momentum with DGC.** Momentum correction applies the momentum before sparsification, so the
optimizer must not apply it again: pass ``optimizer=`` to the state and it takes the
momentum, Nesterov and weight decay of a ``torch.optim.SGD`` over (setting them to 0 there), as
gossamer's own DGC does, and again at every step what a scheduler wrote back (``OneCycleLR``'s
momentum: see :func:`~gossamer.compress.dgc.follow_momentum`); or build the optimizer without
them and give ``momentum=`` and ``weight_decay=`` to the state. The weight decay is added by
each worker to the reduced bucket, dense and never compressed, through the same momentum (every
parameter decays every step); ``weight_decay_in_gradient=True`` adds it to the gradient before
compression instead.

**Mixed precision.** Give the ``torch.amp.GradScaler`` to the state (``scaler=``): the hook
then divides each bucket by the scale before anything else and multiplies the average by it
again, so that memories, DGC's momentum and the weight decay see true gradients whatever the
scale (the casting compressors' wires then carry true gradients too: prefer bfloat16 there);
and if a worker's bucket holds a NaN or inf (an overflow), every worker's reduced bucket is
NaN, so that every scaler skips the step and backs off alike, and no memory keeps the value.
Without a scaler every worker raises instead. See :mod:`gossamer.hooks.agreement`.

Example::

    dist.init_process_group("gloo")
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    state = CompressionState(ddp, "dgc:ratio=0.001", optimizer=optimizer)
    ddp.register_comm_hook(state, compression_hook)
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(ddp(x), y).backward()  # the hook averages the compressed gradients here
        optimizer.step()
    torch.save({"model": ddp.state_dict(), "hook": state.state_dict()}, path)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from gossamer.checks import check_positive
from gossamer.comm.base import Communicator
from gossamer.compress import Compressor, DGCMemory, Memory, take_over_momentum
from gossamer.compress.dgc import apply_weight_decay, decay_in_gradient, follow_momentum
from gossamer.compress.reducer import CompressedReducer, check_node_size
from gossamer.compress.registry import Compression, parse_compression
from gossamer.hooks.agreement import HookState, hook_communicator
from gossamer.patterns.nonfinite import (
    all_finite,
    describe_nonfinite,
    flag_words,
    ranks_from_flags,
    set_flag,
)

__all__ = [
    "CompressionState",
    "DGCState",
    "PowerSGDState",
    "QSGDState",
    "TopKState",
    "compression_hook",
    "dgc_hook",
    "powersgd_hook",
    "qsgd_hook",
    "topk_hook",
]


class CompressionState(HookState):
    """What :func:`compression_hook` needs: parameter names, the reducer, the step counter.

    Construct it on every rank after ``dist.init_process_group`` and before the first
    backward pass.

    Args:
        model: the DDP model (or the module it wraps): its parameter names key the memory.
        compression: a registered compressor with its options and memory: its spec
            (``"dgc:ratio=0.001"``, ``{"name": "dgc", "ratio": 0.001}``) or a
            :class:`~gossamer.compress.Compression`, built as gossamer's AllReduce builds it;
            or a :class:`~gossamer.compress.Compressor` object, with ``memory``.
        memory: with a compressor object, a :class:`~gossamer.compress.Memory`, or None
            (default).
        optimizer: the training's optimizer. A memory with momentum correction (DGC's) takes
            the momentum, Nesterov and weight decay of a ``torch.optim.SGD`` over from it
            (setting them to 0 there), as ``gossamer.distribute`` does; other memories leave
            it alone (default None).
        momentum: momentum correction's ``m`` when no optimizer is given (default 0: build
            the optimizer without momentum and give it here); only for DGC's memory.
        nesterov: Nesterov momentum when no optimizer is given (default False).
        weight_decay: ``{param: decay}`` or one number for all (default 0), when no optimizer
            is given: added by each worker to the reduced gradient, dense and never
            compressed, through the momentum of a :class:`~gossamer.compress.DGCMemory`; or,
            with ``weight_decay_in_gradient``, to each gradient before compensation.
        aggregation: ``"allreduce"``, ``"allgather"`` or None (default: the compressor's).
        node_size: ranks per node for hierarchical aggregation (default 1).
        comm: the communicator (default: a :class:`~gossamer.comm.TorchCommunicator` over a
            process group of its own with ``process_group``'s members: see
            :func:`~gossamer.hooks.agreement.hook_communicator`). One given here must not be
            used by DDP or anything else while backward runs.
        process_group: DDP's process group (default: the default group); only used when
            ``comm`` is None.
        timeout: seconds a collective may wait (default: the backend's, 300 s on gloo, 600 s
            on NCCL); only used when ``comm`` is None.
        scaler: the ``torch.amp.GradScaler`` of the training loop (default None): see the
            module docs.

    Example::

        state = CompressionState(ddp, "topk:ratio=0.01")
        state = CompressionState(ddp, "dgc:ratio=0.001:warmup_steps=500", optimizer=optimizer)
        state = CompressionState(ddp, TopK(ratio=0.01), ErrorFeedback())  # objects
        ddp.register_comm_hook(state, compression_hook)
    """

    def __init__(
        self,
        model: nn.Module,
        compression: Compression | str | Mapping[str, Any] | Compressor,
        memory: Memory | None = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float | dict[torch.Tensor, float] = 0.0,
        aggregation: str | None = None,
        node_size: int = 1,
        comm: Communicator | None = None,
        process_group: dist.ProcessGroup | None = None,
        timeout: float | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        super().__init__(scaler)
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) \
            else model
        if comm is None:
            comm = hook_communicator(process_group, timeout)
        if isinstance(compression, Compressor):
            compressor = compression
        else:
            if memory is not None:
                raise ValueError("memory: a registered compressor brings its own memory; give "
                                 "memory= only with a Compressor object")
            check_node_size(node_size, comm.world_size)
            # with the hierarchy, the compressed exchange averages the nodes' means
            compressor, memory = parse_compression(compression).build(
                comm.world_size // node_size)
        # hyperparameters
        self.names = {id(p): name for name, p in module.named_parameters()}
        decays: float | dict[torch.Tensor, float] = weight_decay
        # the optimizer whose momentum schedule DGC follows at every step (None: none)
        self.optimizer: torch.optim.Optimizer | None = None
        if isinstance(memory, DGCMemory) and memory.momentum is None:
            if optimizer is not None:
                if momentum or nesterov or weight_decay:
                    raise ValueError("optimizer: give either an optimizer to take momentum and "
                                     "weight decay over from, or momentum=/weight_decay=, not "
                                     "both")
                momentum, nesterov, decays = take_over_momentum(optimizer, module.parameters())
                self.optimizer = optimizer
            memory = dataclasses.replace(memory, momentum=momentum, nesterov=nesterov)
        elif momentum or nesterov:
            raise ValueError(f"momentum: only a memory with momentum correction (DGC's) "
                             f"applies it; {type(memory).__name__} does not (leave the "
                             f"momentum to the optimizer)")
        self.params = list(module.parameters())
        if isinstance(decays, dict):
            self.weight_decay = {id(p): float(d) for p, d in decays.items() if d}
        else:
            check_positive("weight_decay", decays, allow_zero=True)
            self.weight_decay = {id(p): float(decays) for p in module.parameters()} \
                if decays else {}
        self.reducer = CompressedReducer(comm, compressor, memory, aggregation=aggregation,
                                         node_size=node_size)

    @property
    def comm(self) -> Communicator:
        return self.reducer.comm

    def state_dict(self) -> dict[str, Any]:
        """The step, the memory and compressor state, the statistics (never the process
        group)."""
        return {**self.steps_state(), "compression": self.reducer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_steps_state(state)
        self.reducer.load_state_dict(state["compression"])


def compression_hook(
    state: CompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the compressed average of one gradient bucket (see the module docs).

    On real processes the bucket is reduced on the state's communication thread and the hook
    returns at once: backward goes on computing while the bucket travels, and DDP waits for
    the future (which completes when the average is in the bucket) before the optimizer
    steps (:meth:`~gossamer.hooks.agreement.HookState.start`).
    """
    return state.start(bucket, lambda buffer, grads, params: _reduce_bucket(
        state, buffer, grads, params))


def _reduce_bucket(state: CompressionState, buffer: torch.Tensor, grads: list[torch.Tensor],
                   params: list[torch.Tensor]) -> None:
    """Replace ``buffer`` (whose parts are ``grads``, of ``params``) by the compressed
    average."""
    if state.optimizer is not None:  # a scheduler may have written the momentum back
        _follow_momentum(state)
    scale = state.scale()
    if scale != 1.0:  # memories and weight decay see true gradients, whatever the scale
        for g in grads:
            g.div_(scale)
    named = []
    for p, g in zip(params, grads, strict=True):
        decay = state.weight_decay.get(id(p))
        if decay and decay_in_gradient(state.reducer.memory):
            g.add_(p.detach(), alpha=decay)
        named.append((state.names[id(p)], g))
    # One bit per rank rides on the bucket's first collective: every worker learns who had
    # non-finite values, and those compress zeros, so that no memory ever holds the value.
    # (in the values' dtype where sums of bits stay exact, so that they share its message)
    dtype = buffer.dtype if buffer.dtype in (torch.float32, torch.float64) else torch.float32
    flags = torch.zeros(flag_words(state.comm.world_size), dtype=dtype, device=buffer.device)
    found = None
    if not all_finite(grads):
        found = None if state.scaling else describe_nonfinite(named, "gradient")
        for g in grads:
            g.zero_()
        set_flag(flags, state.comm.rank)
    state.reducer.reduce(named, state.step, flags=flags)
    ranks = ranks_from_flags(flags)
    if ranks:
        state.nonfinite(buffer, ranks, found)  # NaN on every worker (or raises)
        return
    if not decay_in_gradient(state.reducer.memory):  # each worker's own, dense, never sent
        for p, (name, g) in zip(params, named, strict=True):
            decay = state.weight_decay.get(id(p))
            if decay:
                apply_weight_decay(state.reducer.memory, name, p, g, decay)
    storage = buffer.untyped_storage().data_ptr()
    if any(g.untyped_storage().data_ptr() != storage for g in grads):  # copies: write back
        torch.cat([g.reshape(-1) for g in grads], out=buffer)
    if scale != 1.0:
        buffer.mul_(scale)  # scaled again, as the scaler's unscale_ expects


def _follow_momentum(state: CompressionState) -> None:
    """DGC's momentum and weight decay as the optimizer's groups now have them (before every
    bucket: the step's first one takes over what a scheduler wrote since the last step, before
    the optimizer steps)."""
    assert state.optimizer is not None and isinstance(state.reducer.memory, DGCMemory)
    decays = {p: state.weight_decay[id(p)] for p in state.params if id(p) in state.weight_decay}
    follow_momentum(state.optimizer, state.params, state.reducer.memory, decays)
    state.weight_decay = {id(p): d for p, d in decays.items() if d}


# DDP checks the hook's annotations against the classes themselves, and this module's are
# strings (``from __future__ import annotations``).
compression_hook.__annotations__.update(bucket=dist.GradBucket,
                                        **{"return": torch.futures.Future[torch.Tensor]})

# the hook of every compressor, under the names it had when each had its own
dgc_hook = compression_hook
topk_hook = compression_hook
qsgd_hook = compression_hook
powersgd_hook = compression_hook


class _NamedState(CompressionState):
    """A :class:`CompressionState` for the registered compressor :attr:`compression_name`:
    its options as keywords, with the state's own (``optimizer``, ``node_size``, ``comm``...).
    """

    compression_name: ClassVar[str]

    def __init__(self, model: nn.Module, **kwargs: Any) -> None:
        own = {key: kwargs.pop(key) for key in list(kwargs) if key in _STATE_KEYWORDS}
        super().__init__(model, parse_compression({"name": self.compression_name, **kwargs}),
                         **own)


_STATE_KEYWORDS = frozenset({"optimizer", "momentum", "nesterov", "weight_decay",
                             "aggregation", "node_size", "comm", "process_group", "timeout",
                             "scaler"})


class DGCState(_NamedState):
    """``CompressionState(model, "dgc", ...)`` with DGC's options as keywords: those of
    :class:`~gossamer.compress.registry.DGCCompression` (``ratio``, ``sample_ratio``,
    ``warmup_steps``, ``warmup_stages``, ``momentum_masking``, ``clip_norm`` (global: each of
    n workers clips its own gradient at ``clip_norm * sqrt(n)``, n the number of nodes with
    ``node_size``, as ``--algorithm dgc``), ``fp16_values``,
    ``weight_decay_in_gradient``, ``seed``) and the keywords of :class:`CompressionState`.

    Example::

        state = DGCState(ddp, ratio=0.001, warmup_steps=500, optimizer=optimizer)
    """

    compression_name = "dgc"


class TopKState(_NamedState):
    """``CompressionState(model, "topk", ...)``: ``ratio``, ``error_feedback``,
    ``fp16_values`` (:class:`~gossamer.compress.registry.TopKCompression`) as keywords."""

    compression_name = "topk"


class QSGDState(_NamedState):
    """``CompressionState(model, "qsgd", ...)``: ``levels``, ``bucket_size``,
    ``error_feedback``, ``seed`` (:class:`~gossamer.compress.registry.QSGDCompression`)."""

    compression_name = "qsgd"


class PowerSGDState(_NamedState):
    """``CompressionState(model, "powersgd", ...)``: ``rank``, ``warm_start``,
    ``error_feedback``, ``seed`` (:class:`~gossamer.compress.registry.PowerSGDCompression`)."""

    compression_name = "powersgd"
