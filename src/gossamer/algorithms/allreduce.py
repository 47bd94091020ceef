"""AllReduce-SGD: synchronous data-parallel SGD, the baseline every method is compared with.

After each backward pass the gradients of all workers are averaged exactly (packed into flat
buckets, one ring all-reduce per bucket), so every worker takes the same optimizer step and the
replicas stay identical. This is what ``torch.nn.parallel.DistributedDataParallel`` computes;
here it is written only against a :class:`~gossamer.comm.Communicator`, so it also runs in the
simulator.

Reference: Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" (2017).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from gossamer.algorithms.base import Algorithm, Runtime
from gossamer.algorithms.buckets import Buckets
from gossamer.comm.base import Communicator


@dataclass(frozen=True, kw_only=True)
class AllReduce(Algorithm):
    """Average gradients exactly over all workers after every backward pass.

    Args:
        bucket_mb: size of the flat gradient buckets in MiB (default 25, as DDP). Higher:
            fewer, larger messages (less latency); lower: more messages.

    Example::

        optimizer = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                        AllReduce(bucket_mb=25))
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()  # gradients are averaged here, then SGD steps
    """

    name: ClassVar[str] = "allreduce"

    bucket_mb: float = 25.0  # higher: fewer all-reduce calls, each paying latency once

    def __post_init__(self) -> None:
        if not (isinstance(self.bucket_mb, (int, float)) and math.isfinite(self.bucket_mb)
                and self.bucket_mb > 0):
            raise ValueError(f"bucket_mb must be a number > 0, got {self.bucket_mb!r}")

    def bind(
        self, comm: Communicator, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> AllReduceRuntime:
        return AllReduceRuntime(self, comm, model, optimizer)


class AllReduceRuntime(Runtime):
    """One worker's AllReduce state: the gradient buckets and the step counter."""

    replicas_identical: ClassVar[bool] = True

    def __init__(
        self, config: AllReduce, comm: Communicator, model: nn.Module,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        super().__init__(comm, model, optimizer)
        self.config = config
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = Buckets(self.params, bucket_bytes=int(config.bucket_mb * 2**20))

    @torch.no_grad()
    def after_backward(self) -> None:
        grads = [p.grad for p in self.params]
        self.buckets.gather(grads)
        for buffer in self.buckets.buffers:
            self.comm.all_reduce(buffer, op="mean")
        for p, averaged in zip(self.params, self.buckets.views, strict=True):
            if p.grad is None:
                # Unused on this worker but maybe not on others: take the average anyway,
                # so the replicas stay identical.
                p.grad = averaged.clone()
            else:
                p.grad.copy_(averaged)
        self.synchronizations += 1
