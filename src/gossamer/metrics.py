"""What a training loop can measure about the workers, from the object ``distribute()`` returned.

Two calls, usable in any loop (``gossamer train`` uses the same ones):

- :func:`consensus_distance` (collective: every worker calls it at the same point) is how far
  the replicas are apart: the mean over workers of ``||x_i - mean(x)||^2`` over the parameters.
- :func:`snapshot` (local: no communication) is what this worker's communicator counted: bytes
  and messages sent and received per peer and in total, the synchronisations and skipped steps
  of the algorithm, and the time spent waiting for communication where the communicator
  measures it.

Example::

    optimizer = gossamer.distribute(model, optimizer, "sgp")
    for step, (x, y) in enumerate(loader, 1):
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
        if step % 100 == 0:
            distance = gossamer.metrics.consensus_distance(optimizer)  # on every worker
            counts = gossamer.metrics.snapshot(optimizer)
            print(step, distance, counts["bytes_sent"], counts["idle_time"])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gossamer.algorithms import Runtime, model_tensors
from gossamer.comm.base import Communicator

__all__ = ["consensus_distance", "replica_mean", "snapshot"]


@torch.no_grad()
def replica_mean(model: nn.Module, comm: Communicator) -> tuple[list[torch.Tensor], float]:
    """Collective: the mean over workers of each of ``model``'s tensors, and this worker's
    squared distance to it.

    Returns the means, in float64, of the parameters then the floating-point buffers
    (:func:`gossamer.algorithms.model_tensors`), and ``||x_i - mean||^2`` of this worker's
    parameters (buffers left out). One all-reduce.
    """
    tensors = model_tensors(model)  # parameters first, then float buffers
    # In float64, so that the mean of identical replicas is exact and their consensus
    # distance exactly 0 (float32 sums would leave rounding noise).
    own = [t.detach().double() for t in tensors]
    mean = torch.cat([t.reshape(-1) for t in own])
    comm.all_reduce(mean, op="mean")
    means = list(torch.split(mean, [t.numel() for t in own]))
    n_params = sum(1 for _ in model.parameters())
    own_sq = sum(float((t.reshape(-1) - m).pow(2).sum())
                 for t, m in zip(own[:n_params], means, strict=False))
    return means, own_sq


def consensus_distance(target: Any, comm: Communicator | None = None) -> float:
    """Collective: the mean over workers of ``||x_i - mean(x)||^2`` over the parameters.

    Computed in float64, so that identical replicas give exactly 0. Every worker must call it
    at the same point of its loop; every worker gets the same value. Its traffic goes through
    ``comm`` and is counted in its stats like any other.

    Args:
        target: the :class:`~gossamer.DistributedOptimizer` that ``distribute()`` returned, or
            the model (then ``comm`` is needed).
        comm: the communicator; default: the optimizer's.

    Example::

        distance = gossamer.metrics.consensus_distance(optimizer)
    """
    model, comm = _model_and_comm(target, comm)
    _, own_sq = replica_mean(model, comm)
    total = torch.tensor([own_sq], dtype=torch.float64)
    comm.all_reduce(total, op="mean")
    return float(total[0])


def snapshot(target: Any) -> dict[str, Any]:
    """Local (no communication): what this worker has counted so far.

    Args:
        target: the :class:`~gossamer.DistributedOptimizer` that ``distribute()`` returned, or
            a communicator (then the algorithm's fields are None).

    Returns a dict of:

    - ``rank``, ``world_size``;
    - ``bytes_sent``, ``bytes_received``, ``messages_sent``, ``messages_received``: totals;
    - the same four with ``_per_peer``: ``{peer rank: count}``; collectives are counted as the
      ring algorithm moves them (:mod:`gossamer.comm.cost`);
    - ``synchronizations``: exact averages of the whole world; ``skipped_steps``: updates this
      worker skipped (or gradients it dropped) for non-finite values; ``step``: the steps taken;
    - ``clock``: seconds since the communicator started (virtual in the simulator);
    - ``idle_time``: seconds this worker spent blocked waiting for communication to complete:
      virtual seconds waiting for other workers or the network in :class:`~gossamer.SimWorld`;
      real seconds in the waits of :class:`~gossamer.TorchCommunicator` (which include the
      transfer itself); None for a communicator that does not measure it.

    The counts only grow; subtract two snapshots for an interval.
    """
    runtime = target.runtime if isinstance(getattr(target, "runtime", None), Runtime) else None
    comm = runtime.comm if runtime is not None else target
    stats = comm.stats
    idle = getattr(comm, "idle_time", None)
    return {
        "rank": comm.rank,
        "world_size": comm.world_size,
        "bytes_sent": stats.total_bytes_sent,
        "bytes_received": stats.total_bytes_received,
        "messages_sent": stats.total_messages_sent,
        "messages_received": sum(stats.messages_received.values()),
        "bytes_sent_per_peer": dict(sorted(stats.bytes_sent.items())),
        "bytes_received_per_peer": dict(sorted(stats.bytes_received.items())),
        "messages_sent_per_peer": dict(sorted(stats.messages_sent.items())),
        "messages_received_per_peer": dict(sorted(stats.messages_received.items())),
        "synchronizations": runtime.synchronizations if runtime is not None else None,
        "skipped_steps": runtime.skipped_steps if runtime is not None else None,
        "step": runtime.step if runtime is not None else None,
        "clock": comm.clock(),
        "idle_time": float(idle) if idle is not None else None,
    }


def _model_and_comm(target: Any, comm: Communicator | None) -> tuple[nn.Module, Communicator]:
    runtime = getattr(target, "runtime", None)
    if isinstance(runtime, Runtime):
        return runtime.model, comm if comm is not None else runtime.comm
    if isinstance(target, nn.Module):
        if comm is None:
            raise ValueError("comm is needed with a model (or pass the optimizer that "
                             "distribute() returned)")
        return target, comm
    raise ValueError(f"target must be the optimizer distribute() returned or an nn.Module, "
                     f"got {type(target).__name__}")
