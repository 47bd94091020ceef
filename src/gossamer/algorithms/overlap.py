"""The dense gradient all-reduce of AllReduce, started during backward as DDP starts it.

The trainable parameters go into flat buckets in reverse registration order (backward produces
the last layers' gradients first, so the first buckets fill first), the first of them at most
1 MiB as DDP's, and the non-finite flags of :mod:`gossamer.algorithms.nonfinite` ride at the end
of the last bucket.

On a communicator that starts collectives asynchronously (``all_reduce_async``: the
:class:`~gossamer.comm.TorchCommunicator`), a hook on each parameter's gradient accumulation
notes that its gradient is ready; as soon as every gradient of a bucket is, and every bucket
before it has started, the bucket's all-reduce starts, while backward goes on computing the
gradients of the layers below. Buckets start in the same order on every worker, whatever the
order the gradients arrive in, so every worker's collectives match. When backward ends (an
autograd engine callback) the buckets not started yet start (a parameter without a gradient
counts as zeros), every bucket is waited for, and the averages are written into the gradients.

This is DDP's schedule and semantics: after each ``backward()`` the gradients hold the average.
With gradient accumulation, each backward would average (correct, since averaging is linear,
but one all-reduce per micro-batch): wrap all but the last micro-batch in
:meth:`~gossamer.api.DistributedOptimizer.no_sync`, and only the last one's backward averages
the accumulated gradients.

Elsewhere (the simulator) the same buckets are all-reduced one after the other in
``after_backward``: the same collectives, bytes and averages, only not overlapped with
backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn

from gossamer.algorithms.buckets import Buckets
from gossamer.algorithms.nonfinite import all_finite, describe_nonfinite, set_flag
from gossamer.comm.base import Communicator

#: id(parameter) -> (the parameter, the GradientBuckets whose hook it carries), both weakly
#: (a model must stay picklable: nothing is stored on the parameter itself)
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}

#: the first bucket (the last layers') holds at most this many bytes, as DDP's
#: ``first_bucket_bytes``: it fills, and starts, early in backward
FIRST_BUCKET_BYTES = 2**20


class GradientBuckets:
    """The buckets of the dense all-reduce, and the hooks that start them during backward.

    Args:
        comm: the communicator.
        named: ``(name, parameter)`` of the trainable parameters, in registration order.
        flags: the non-finite flags (zeros of the flags' length, dtype and device).
        bucket_bytes: bytes per bucket at most (a larger tensor gets one of its own).
        overlap: start the all-reduces during backward where the communicator can.

    ``syncing`` (default True) turns the hooks off when False (``no_sync``).
    """

    def __init__(self, comm: Communicator, named: Sequence[tuple[str, nn.Parameter]],
                 flags: torch.Tensor, bucket_bytes: int, overlap: bool = True) -> None:
        self.comm = comm
        self.named = list(reversed(named))  # bucket order
        self.params = [p for _, p in self.named]
        self.buckets = Buckets(self.params + [flags], bucket_bytes=bucket_bytes,
                               first_bytes=min(FIRST_BUCKET_BYTES, bucket_bytes))
        self.flags = self.buckets.views[-1]
        self.views = self.buckets.views[:-1]
        slots = self.buckets.slots[:-1]
        count = len(self.buckets.buffers)
        #: the positions (in ``self.params``) of each bucket's parameters
        self.members: list[list[int]] = [[] for _ in range(count)]
        self._bucket_of: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, position)
        for position, (p, (bucket, _, _)) in enumerate(zip(self.params, slots, strict=True)):
            self.members[bucket].append(position)
            self._bucket_of[id(p)] = (bucket, position)
        self.overlapping = overlap and callable(getattr(comm, "all_reduce_async", None))
        self.syncing = True
        self._nonfinite: list[tuple[str, torch.Tensor]] = []  # this step's, (name, gradient)
        self._hooks = []
        if self.overlapping:
            for key in [k for k, (param, _) in _OWNERS.items() if param() is None]:
                del _OWNERS[key]  # parameters gone
            for p in self.params:  # a model distributed again: the newest runtime's hooks only
                param, owner = _OWNERS.get(id(p), (None, None))
                if param is not None and param() is p and owner() is not None:
                    owner().remove_hooks()
                _OWNERS[id(p)] = (weakref.ref(p), weakref.ref(self))
            self._hooks = [p.register_post_accumulate_grad_hook(self._ready)
                           for p in self.params]
        self._clear()
        #: whether a backward since the last step() has averaged the gradients already
        self.averaged = False

    def _clear(self) -> None:
        self._fired: list[set[int]] = [set() for _ in self.members]
        self._started = 0  # buckets started this backward (in order)
        self._handles: list = []
        self._queued = False

    def new_step(self) -> None:
        """Forget the last step (its flags and averages)."""
        self.flags.zero_()
        self._nonfinite = []
        self.averaged = False
        self._clear()

    def remove_hooks(self) -> None:
        """Stop starting all-reduces during backward (they then run in after_backward)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.overlapping = False

    # -- the overlapped path ------------------------------------------------------------------

    def _ready(self, param: torch.Tensor) -> None:
        if not self.syncing:
            return
        bucket, position = self._bucket_of[id(param)]
        if not self._queued:  # the first gradient of this backward
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._queued = True
            self.flags.zero_()  # this backward's: a non-finite gradient is found again
        self._fired[bucket].add(position)
        while (self._started < len(self.members)
               and len(self._fired[self._started]) == len(self.members[self._started])):
            self._start(self._started)

    def _pack(self, bucket: int, nonfinite: bool = False) -> torch.Tensor:
        """Copy bucket ``bucket``'s gradients into its buffer (None: zeros), with zeros and this
        rank's flag in place of non-finite gradients (or of every one, with ``nonfinite``: a
        GradScaler found an overflow here); the buffer."""
        members = self.members[bucket]
        present = [(self.named[i][0], self.params[i].grad) for i in members
                   if self.params[i].grad is not None]
        for i in members:
            grad = self.params[i].grad
            if grad is None:
                self.views[i].zero_()
            else:
                self.views[i].copy_(grad)
        if nonfinite or not all_finite([g for _, g in present]):
            self._nonfinite += present  # described (the non-finite ones) only on error
            for i in members:
                self.views[i].zero_()
            set_flag(self.flags, self.comm.rank)
        return self.buckets.buffers[bucket]

    @property
    def found(self) -> str | None:
        """This step's non-finite gradients, described (None: none)."""
        return describe_nonfinite(self._nonfinite, "gradient")

    def _start(self, bucket: int) -> None:
        """Pack bucket ``bucket`` and start its all-reduce."""
        buffer = self._pack(bucket)
        self._started += 1
        self._handles.append(self.comm.all_reduce_async(buffer))  # type: ignore[attr-defined]

    def _end_of_backward(self) -> None:
        """Start what has not started, wait for everything, write the averages."""
        while self._started < len(self.members):
            self._start(self._started)
        for handle in self._handles:
            handle.wait()
        self._clear()
        self._write_averages()
        self.averaged = True

    # -- the path after backward --------------------------------------------------------------

    def reduce(self, overflow: bool | None) -> None:
        """All-reduce every bucket now (unless a backward did already), one after the other,
        then write the averages; ``overflow`` (a GradScaler's finding here) flags this rank."""
        if self.averaged:
            return
        self.flags.zero_()
        for bucket in range(len(self.members)):  # the flags' bucket last, as during backward
            self.comm.all_reduce(self._pack(bucket, nonfinite=bool(overflow)), op="sum")
        self._write_averages()
        self.averaged = True

    def _write_averages(self) -> None:
        """Divide by the world size and copy into the gradients, unless a worker flagged a
        non-finite gradient (then the gradients stay as they were: the step is dropped)."""
        if bool(self.flags.any()):
            return
        for buffer in self.buckets.buffers:
            buffer.div_(self.comm.world_size)  # the flags are zero: dividing them is harmless
        for p, averaged in zip(self.params, self.views, strict=True):
            if p.grad is None:
                # Unused on this worker but maybe not on others: take the average anyway,
                # so the replicas stay identical.
                p.grad = averaged.clone()
            else:
                p.grad.copy_(averaged)
