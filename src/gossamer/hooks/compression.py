"""Gradient compression as DDP comm hooks: DGC, top-k, QSGD and PowerSGD.

For people who already train with ``torch.nn.parallel.DistributedDataParallel``:
``ddp.register_comm_hook(state, compression_hook)``. Each bucket of gradients that DDP hands
the hook goes through the same :class:`~gossamer.compress.CompressedReducer` as
``AllReduce(compressor=..., memory=...)`` (compensate, compress, all-gather or all-reduce,
decompress, update the memory), so the hook and gossamer's own runtime compute the same
average. The traffic goes through a :class:`~gossamer.comm.TorchCommunicator` over DDP's
process group, on gloo and NCCL, and its ``stats`` count the compressed bytes.

Tensors are named by the model's parameter names, so the memories, seeds and checkpoints do
not depend on how DDP buckets them (DDP rebuilds its buckets after the first step).
``state.step`` advances once per optimizer step: after the iteration's last bucket
(``GradBucket.is_last()``). Under ``ddp.no_sync()`` DDP does not call the hook.

**Momentum with DGC.** Momentum correction applies the momentum before sparsification, so the
optimizer must not apply it again: pass ``optimizer=`` to :class:`DGCState` and it takes the
momentum, Nesterov and weight decay of a ``torch.optim.SGD`` over (setting them to 0 there), as
gossamer's own DGC does; or build the optimizer without them and give ``momentum=`` and
``weight_decay=`` to the state. The weight decay is added by each worker to the reduced
bucket, dense and never compressed, through the same momentum (every parameter decays every
step); ``weight_decay_in_gradient=True`` adds it to the gradient before compression instead.

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
    state = DGCState(ddp, ratio=0.001, optimizer=optimizer)
    ddp.register_comm_hook(state, dgc_hook)
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(ddp(x), y).backward()  # the hook averages the compressed gradients here
        optimizer.step()
    torch.save({"model": ddp.state_dict(), "hook": state.state_dict()}, path)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gossamer.algorithms.nonfinite import (
    all_finite,
    describe_nonfinite,
    flag_words,
    ranks_from_flags,
    set_flag,
)
from gossamer.checks import check_positive
from gossamer.comm.base import Communicator
from gossamer.compress import (
    QSGD,
    Compressor,
    DGCCompressor,
    DGCMemory,
    ErrorFeedback,
    Memory,
    PowerSGD,
    TopK,
    take_over_momentum,
)
from gossamer.compress.dgc import apply_weight_decay, decay_in_gradient
from gossamer.compress.reducer import CompressedReducer
from gossamer.hooks.agreement import HookState

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
        compressor: a :class:`~gossamer.compress.Compressor`.
        memory: a :class:`~gossamer.compress.Memory`, or None (default).
        aggregation: ``"allreduce"``, ``"allgather"`` or None (default: the compressor's).
        node_size: ranks per node for hierarchical aggregation (default 1).
        weight_decay: ``{param: decay}`` or one number for all (default 0), for a memory that
            applies momentum (the optimizer then has none): added by each worker to the
            reduced gradient, dense and never compressed, through the momentum of a
            :class:`~gossamer.compress.DGCMemory`; or, with
            ``DGCMemory(weight_decay_in_gradient=True)``, to each gradient before compensation.
        comm: the communicator (default: a :class:`~gossamer.comm.TorchCommunicator` over
            ``process_group``).
        process_group: DDP's process group (default: the default group); only used when
            ``comm`` is None.
        timeout: seconds a collective may wait (default: the backend's, 300 s on gloo, 600 s
            on NCCL); only used when ``comm`` is None.
        scaler: the ``torch.amp.GradScaler`` of the training loop (default None): see the
            module docs.
    """

    def __init__(
        self,
        model: nn.Module,
        compressor: Compressor,
        memory: Memory | None = None,
        *,
        aggregation: str | None = None,
        node_size: int = 1,
        weight_decay: float | dict[torch.Tensor, float] = 0.0,
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
        # hyperparameters
        self.names = {id(p): name for name, p in module.named_parameters()}
        if isinstance(weight_decay, dict):
            self.weight_decay = {id(p): float(d) for p, d in weight_decay.items() if d}
        else:
            check_positive("weight_decay", weight_decay, allow_zero=True)
            self.weight_decay = {id(p): float(weight_decay) for p in module.parameters()} \
                if weight_decay else {}
        if comm is None:
            from gossamer.comm.torch_comm import TorchCommunicator

            comm = TorchCommunicator(process_group, timeout=timeout)
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

    The collectives are done when the hook returns (the future is already complete), so DDP
    copies the average into ``param.grad`` before the optimizer steps.
    """
    buffer = bucket.buffer()
    grads = bucket.gradients()  # views of buffer
    scale = state.scale()
    if scale != 1.0:  # memories and weight decay see true gradients, whatever the scale
        for g in grads:
            g.div_(scale)
    named = []
    for p, g in zip(bucket.parameters(), grads, strict=True):
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
        return state.bucket_done(bucket)
    if not decay_in_gradient(state.reducer.memory):  # each worker's own, dense, never sent
        for p, (name, g) in zip(bucket.parameters(), named, strict=True):
            decay = state.weight_decay.get(id(p))
            if decay:
                apply_weight_decay(state.reducer.memory, name, p, g, decay)
    storage = buffer.untyped_storage().data_ptr()
    if any(g.untyped_storage().data_ptr() != storage for g in grads):  # copies: write back
        torch.cat([g.reshape(-1) for g in grads], out=buffer)
    if scale != 1.0:
        buffer.mul_(scale)  # scaled again, as the scaler's unscale_ expects
    return state.bucket_done(bucket)


# DDP checks the hook's annotations against the classes themselves, and this module's are
# strings (``from __future__ import annotations``).
compression_hook.__annotations__.update(bucket=dist.GradBucket,
                                        **{"return": torch.futures.Future[torch.Tensor]})

dgc_hook = compression_hook
topk_hook = compression_hook
qsgd_hook = compression_hook
powersgd_hook = compression_hook


class DGCState(CompressionState):
    """Deep Gradient Compression for :func:`dgc_hook` (see :mod:`gossamer.compress.dgc`).

    Args:
        model: the DDP model.
        ratio, sample_ratio, warmup_steps, warmup_stages, fp16_values, seed: those of
            :class:`~gossamer.compress.DGCCompressor` (defaults 0.001, 0.01, 0, 4, True, 0).
        optimizer: a ``torch.optim.SGD`` whose momentum, Nesterov and weight decay are taken
            over (default None: give ``momentum`` and ``weight_decay`` instead).
        momentum: momentum correction's ``m`` when no optimizer is given (default 0).
        nesterov: Nesterov momentum when no optimizer is given (default False).
        weight_decay: weight decay when no optimizer is given (default 0).
        weight_decay_in_gradient: add the weight decay to each gradient before compression,
            sparsified and delayed with it (default False: each worker adds it to the reduced
            gradient, dense, through the momentum). See :class:`~gossamer.compress.DGCMemory`.
        momentum_masking: zero the momentum of sent elements (default True).
        clip_norm: local clipping threshold of each tensor's gradient norm on each worker
            (default None).
        node_size: hierarchical aggregation (default 1).
        comm, process_group, timeout, scaler: as :class:`CompressionState`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        ratio: float = 0.001,
        sample_ratio: float = 0.01,
        warmup_steps: int = 0,
        warmup_stages: int = 4,
        fp16_values: bool = True,
        seed: int = 0,
        optimizer: torch.optim.Optimizer | None = None,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        weight_decay_in_gradient: bool = False,
        momentum_masking: bool = True,
        clip_norm: float | None = None,
        node_size: int = 1,
        comm: Communicator | None = None,
        process_group: dist.ProcessGroup | None = None,
        timeout: float | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        compressor = DGCCompressor(ratio=ratio, sample_ratio=sample_ratio,
                                   warmup_steps=warmup_steps, warmup_stages=warmup_stages,
                                   fp16_values=fp16_values, seed=seed)
        memory = DGCMemory(momentum=momentum, nesterov=nesterov, masking=momentum_masking,
                           clip_norm=clip_norm, weight_decay_in_gradient=weight_decay_in_gradient)
        decays: float | dict[torch.Tensor, float] = weight_decay
        if optimizer is not None:
            if momentum or nesterov or weight_decay:
                raise ValueError("optimizer: give either an optimizer to take momentum and "
                                 "weight decay over from, or momentum=/weight_decay=, not both")
            momentum, nesterov, decays = take_over_momentum(optimizer, model.parameters())
            memory = dataclasses.replace(memory, momentum=momentum, nesterov=nesterov)
        super().__init__(model, compressor, memory, node_size=node_size, weight_decay=decays,
                         comm=comm, process_group=process_group, timeout=timeout,
                         scaler=scaler)


class TopKState(CompressionState):
    """Exact top-k with error feedback for :func:`topk_hook`.

    Args:
        model: the DDP model.
        ratio: fraction of each tensor sent (default 0.01).
        error_feedback: keep what was not sent (default True).
        fp16_values: send values as float16 (default False).
        comm, process_group, timeout, scaler: as :class:`CompressionState`.
    """

    def __init__(self, model: nn.Module, *, ratio: float = 0.01, error_feedback: bool = True,
                 fp16_values: bool = False, comm: Communicator | None = None,
                 process_group: dist.ProcessGroup | None = None,
                 timeout: float | None = None,
                 scaler: torch.amp.GradScaler | None = None) -> None:
        super().__init__(model, TopK(ratio=ratio, fp16_values=fp16_values),
                         ErrorFeedback() if error_feedback else None, comm=comm,
                         process_group=process_group, timeout=timeout,
                         scaler=scaler)


class QSGDState(CompressionState):
    """QSGD quantization for :func:`qsgd_hook`.

    Args:
        model: the DDP model.
        levels: levels per sign (default 127).
        bucket_size: elements per norm (default 512).
        error_feedback: keep the quantization error (default False).
        seed: seeds the rounding (default 0).
        comm, process_group, timeout, scaler: as :class:`CompressionState`.
    """

    def __init__(self, model: nn.Module, *, levels: int = 127, bucket_size: int = 512,
                 error_feedback: bool = False, seed: int = 0, comm: Communicator | None = None,
                 process_group: dist.ProcessGroup | None = None,
                 timeout: float | None = None,
                 scaler: torch.amp.GradScaler | None = None) -> None:
        super().__init__(model, QSGD(levels=levels, bucket_size=bucket_size, seed=seed),
                         ErrorFeedback() if error_feedback else None, comm=comm,
                         process_group=process_group, timeout=timeout,
                         scaler=scaler)


class PowerSGDState(CompressionState):
    """PowerSGD with error feedback for :func:`powersgd_hook`.

    Args:
        model: the DDP model.
        rank: rank of the approximation (default 2).
        warm_start: reuse the previous step's Q (default True).
        error_feedback: keep what the approximation missed (default True).
        seed: seeds the initial Q (default 0).
        comm, process_group, timeout, scaler: as :class:`CompressionState`.
    """

    def __init__(self, model: nn.Module, *, rank: int = 2, warm_start: bool = True,
                 error_feedback: bool = True, seed: int = 0, comm: Communicator | None = None,
                 process_group: dist.ProcessGroup | None = None,
                 timeout: float | None = None,
                 scaler: torch.amp.GradScaler | None = None) -> None:
        super().__init__(model, PowerSGD(rank=rank, warm_start=warm_start, seed=seed),
                         ErrorFeedback() if error_feedback else None, comm=comm,
                         process_group=process_group, timeout=timeout,
                         scaler=scaler)
