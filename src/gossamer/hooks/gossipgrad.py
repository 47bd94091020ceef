"""GossipGraD as a DDP comm hook: ``ddp.register_comm_hook(GossipGraDState(...), gossipgrad_hook)``.

For people who already train with ``torch.nn.parallel.DistributedDataParallel``: each gradient
bucket is averaged inside its local group and then with the partner node's, exactly as the
:class:`~gossamer.algorithms.GossipGraD` algorithm does (both call
:class:`~gossamer.patterns.pairwise.GradientGossip`), so the two give the same parameters.
Works on gloo and NCCL; the traffic goes through a
:class:`~gossamer.comm.TorchCommunicator`, whose ``stats`` count every byte.

**The step counter.** The partner of a step must be the same for every bucket of that step,
so ``state.step`` advances once per backward pass that reaches the hook, when DDP hands it the
iteration's last bucket (``GradBucket.is_last()``), after that bucket's exchange: once per
optimizer step, never once per bucket. Under ``ddp.no_sync()`` (gradient accumulation) DDP
does not call the hook, so only the synchronising backward of each optimizer step counts.

**Mixed precision.** Give the ``torch.amp.GradScaler`` to the state (``scaler=``): every
worker then learns, from one small all-reduce per bucket (the exchange reaches one partner
only), whether any worker's bucket holds a NaN or inf (an overflow); if one does, no bucket is
exchanged, every worker's is NaN, so that every scaler skips the step and backs off alike,
and ``state.step`` does not advance. Without a scaler the hook makes no check (as DDP's own
all-reduce, it passes non-finite values on). See :mod:`gossamer.hooks.agreement`.

Reference: Daily et al., "GossipGraD: Scalable Deep Learning using Gossip Communication based
Asynchronous Gradient Descent" (2018); torchdistx's GossipGraD comm hook.

Example::

    dist.init_process_group("gloo")
    ddp = DistributedDataParallel(model)
    state = GossipGraDState(topology="cube", local_group_size=2)
    ddp.register_comm_hook(state, gossipgrad_hook)
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(ddp(x), y).backward()  # the hook gossips the gradients here
        optimizer.step()
    # the replicas differ: average them exactly before saving (see average_parameters)
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gossamer.algorithms.base import average_tensors, model_tensors
from gossamer.comm.base import Communicator
from gossamer.hooks.agreement import HookState, hook_communicator
from gossamer.patterns.nonfinite import agree, all_finite
from gossamer.patterns.pairwise import GradientGossip

__all__ = ["GossipGraDState", "gossipgrad_hook"]


class GossipGraDState(HookState):
    """What :func:`gossipgrad_hook` needs: the options, the communicator and the step counter.

    Construct it on every rank, after ``dist.init_process_group`` (it builds the local group's
    communicator, and checks the options against the world size).

    Args:
        topology: ``"dissemination"`` (default; any node count) or ``"cube"`` (the number of
            nodes must be a power of two).
        local_group_size: consecutive ranks that form a node and average exactly first
            (default 1: none); must divide the world size.
        seed: seed of the node-order shuffles, the same on every rank (default 0).
        shuffle: reshuffle the node order every ``ceil(log2 nodes)`` steps (default True).
        comm: the communicator (default: a :class:`~gossamer.comm.TorchCommunicator` over a
            process group of its own with ``process_group``'s members: see
            :func:`~gossamer.hooks.agreement.hook_communicator`). One given here must not be
            used by DDP or anything else while backward runs.
        process_group: the DDP process group (default: the default group); only used when
            ``comm`` is None.
        timeout: seconds an exchange may wait for a peer (default: the backend's, 300 s on
            gloo, 600 s on NCCL); only used when ``comm`` is None.
        scaler: the ``torch.amp.GradScaler`` of the training loop (default None): see the
            module docs.
    """

    def __init__(
        self,
        *,
        topology: str = "dissemination",
        local_group_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        comm: Communicator | None = None,
        process_group: dist.ProcessGroup | None = None,
        timeout: float | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        super().__init__(scaler)
        if comm is None:
            comm = hook_communicator(process_group, timeout)
        # hyperparameters (the checks are GradientGossip's)
        self.gossip = GradientGossip(comm, topology=topology, local_group_size=local_group_size,
                                     seed=seed, shuffle=shuffle)

    @property
    def comm(self) -> Communicator:
        return self.gossip.comm

    def state_dict(self) -> dict[str, Any]:
        """The step counter and statistics (the schedule is a function of the step alone;
        never the communicator or process groups)."""
        return self.steps_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_steps_state(state)

    @torch.no_grad()
    def average_parameters(self, model: nn.Module) -> None:
        """Make every replica the exact average of all (parameters and floating-point
        buffers), e.g. after training or before evaluating. Collective: every rank calls it."""
        average_tensors(self.comm, model_tensors(model))


def gossipgrad_hook(
    state: GossipGraDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: GossipGraD's average of one gradient bucket (see the module docstring).

    On real processes the exchange runs on the state's communication thread and the hook
    returns at once; DDP waits for the future before the optimizer steps
    (:meth:`~gossamer.hooks.agreement.HookState.start`).
    """
    return state.start(bucket, lambda buffer, grads, params: _combine_bucket(state, buffer))


def _combine_bucket(state: GossipGraDState, buffer: torch.Tensor) -> None:
    """Replace ``buffer`` by GossipGraD's average of it."""
    if state.scaling:  # every worker learns of an overflow anywhere: one bit per rank
        ranks = agree(state.comm, not all_finite([buffer]), buffer.device)
        if ranks:
            state.nonfinite(buffer, ranks, None)  # NaN on every worker, nothing exchanged
            return
    state.gossip.combine([buffer], state.step)
