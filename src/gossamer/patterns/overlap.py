"""Gradient communication started during backward, bucket by bucket, as DDP starts it.

The trainable parameters go into buckets in reverse registration order (backward produces the
last layers' gradients first, so the first buckets fill first), the first of them at most 1 MiB
as DDP's (only to overlap: without it a small first bucket would be one collective more, one
more latency, for nothing). On a communicator of real processes (one that declares
:class:`~gossamer.comm.base.AsyncCollectives`: the :class:`~gossamer.comm.TorchCommunicator`),
a hook on each parameter's gradient accumulation notes that its gradient is ready; as soon as
every gradient of a bucket is, and every bucket before it has started, the bucket's
communication starts, while backward goes on computing the gradients of the layers below.
Buckets start in the same order on every worker, whatever the order the gradients arrive in,
so every worker's collectives match. When backward ends (an autograd engine callback) the
buckets not started yet start (a parameter without a gradient counts as zeros), everything is
waited for, and the results are written into the gradients.
:class:`BackwardSchedule` is that bookkeeping; what a bucket's communication is belongs to
its subclasses:

- :class:`GradientBuckets`, AllReduce's dense average: flat buckets, each averaged with
  ``all_reduce_async(op="mean")``; the non-finite flags of
  :mod:`gossamer.patterns.nonfinite` ride at the end of the last bucket (their mean names
  the same ranks as their sum).
- :class:`CompressedBuckets`, AllReduce with a compressor: each bucket goes through the
  :class:`~gossamer.compress.CompressedReducer` (compensate, compress, collectives,
  decompress, memory) on a :class:`CommThread`, one bucket after the other, while backward
  computes; the flags ride on the last bucket's first collective.

This is DDP's schedule and semantics: after each ``backward()`` the gradients hold the average.
With gradient accumulation, wrap all but the last micro-batch in
:meth:`~gossamer.api.DistributedOptimizer.no_sync`, and only the last one's backward averages
the accumulated gradients (the dense average may also run at every backward, since averaging
is linear; a compressed one may not: its memory would be updated once per micro-batch, which
is an error).

Elsewhere (the simulator) the same buckets go through the same calls one after the other in
``after_backward``: the same collectives, bytes and averages, only not overlapped with
backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from gossamer.comm.base import AsyncCollectives, Communicator, without_grad
from gossamer.comm.buckets import Buckets, layout
from gossamer.compress.reducer import CompressedReducer
from gossamer.patterns.nonfinite import (
    all_finite,
    describe_nonfinite,
    ranks_from_flags,
    set_flag,
)

#: id(parameter) -> (the parameter, the BackwardSchedule whose hook it carries), both weakly
#: (a model must stay picklable: nothing is stored on the parameter itself)
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}

#: the first bucket (the last layers') holds at most this many bytes, as DDP's
#: ``first_bucket_bytes``: it fills, and starts, early in backward
FIRST_BUCKET_BYTES = 2**20

NamedParameters = Sequence[tuple[str, nn.Parameter]]


def first_bucket_bytes(bucket_bytes: int, overlap: bool) -> int | None:
    """The first bucket's limit: :data:`FIRST_BUCKET_BYTES` (at most ``bucket_bytes``) when the
    buckets are to overlap backward, where it starts early; otherwise None, the same limit as
    the others (a small first bucket would cost a collective more per step, and gain nothing).
    ``overlap`` is the configuration's, not whether this communicator can overlap, so that the
    simulator's buckets are those of a real run."""
    return min(FIRST_BUCKET_BYTES, bucket_bytes) if overlap else None


def overlaps(comm: Communicator) -> bool:
    """Whether ``comm`` talks between processes that run on while it waits (it declares
    :class:`~gossamer.comm.base.AsyncCollectives`), so that communication can overlap
    backward. The simulator's workers take turns on its scheduler: there, nothing may run on
    another thread."""
    return isinstance(comm, AsyncCollectives)


class CommThread:
    """One background thread that runs communication jobs one after the other, in the order
    they were submitted: the same order on every worker, so their collectives match."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gossamer-comm")
        weakref.finalize(self, self._executor.shutdown, wait=False)

    def submit(self, fn: Callable[..., object], *args: object) -> Future:
        """Run ``fn(*args)`` (without autograd) after the jobs submitted before."""
        return self._executor.submit(without_grad, fn, *args)

    @staticmethod
    def wait(jobs: Sequence[Future]) -> None:
        """Wait for every job (each one's collectives wait at most the communicator's
        timeout), then raise the first one's error, if any."""
        errors = [job.exception() for job in jobs]
        for error in errors:
            if error is not None:
                raise error


class SideStream:
    """Where a :class:`CommThread`'s jobs run when the model is on a CUDA device: a stream of
    their own, so that compression and its collectives overlap backward's kernels rather than
    queue behind them on one stream. A job starts after the work its caller queued before
    handing it over (an event recorded on the caller's stream, :meth:`handoff`), and the
    caller's stream waits for every job's work before it reads the results (:meth:`join`).
    Elsewhere (the CPU, the meta device of timing-only runs) there is nothing to order: a job's
    operations run when its thread runs them.

    (:class:`GradientBuckets` needs none: an ``all_reduce_async`` of NCCL runs on the process
    group's own stream, ordered after the caller's, and its handle's ``wait`` orders the
    caller's stream after it.)"""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def handoff(self) -> torch.cuda.Event | None:
        """An event after the work queued so far on the current stream (None: not CUDA)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.stream.device))
        return event

    def run(self, ready: torch.cuda.Event | None, fn: Callable[..., object],
            *args: object) -> object:
        """``fn(*args)`` on the side stream, after ``ready`` (a :meth:`handoff`'s event)."""
        if self.stream is None:
            return fn(*args)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            return fn(*args)

    def join(self) -> None:
        """Order the current stream after everything queued on the side stream."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


class BackwardSchedule:
    """Buckets of parameters, and the hooks that start them, in order, during backward.

    Args:
        named: ``(name, parameter)`` in bucket order (the last layers' first, for overlap).
        bucket_of: each parameter's bucket (non-decreasing from 0).
        overlap: install the hooks (only where the communicator overlaps, see
            :func:`overlaps`).

    A subclass starts a bucket in :meth:`_start` and completes every one in
    :meth:`_complete`; ``syncing`` (default True) turns the hooks off when False
    (``no_sync``), and ``averaged`` tells whether a backward since :meth:`new_step` has
    averaged the gradients already.
    """

    def __init__(self, named: NamedParameters, bucket_of: Sequence[int], overlap: bool) -> None:
        self.named = list(named)
        self.params = [p for _, p in self.named]
        count = max(bucket_of, default=-1) + 1
        #: the positions (in ``self.params``) of each bucket's parameters
        self.members: list[list[int]] = [[] for _ in range(count)]
        self._bucket_of: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, position)
        for position, (p, bucket) in enumerate(zip(self.params, bucket_of, strict=True)):
            self.members[bucket].append(position)
            self._bucket_of[id(p)] = (bucket, position)
        self.overlapping = overlap
        self.syncing = True
        self._hooks = []
        if overlap:
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
        self.averaged = False

    def _clear(self) -> None:
        self._fired: list[set[int]] = [set() for _ in self.members]
        self._started = 0  # buckets started this backward (in order)
        self._queued = False

    def new_step(self) -> None:
        """Forget the last step."""
        self.averaged = False
        self._clear()

    def remove_hooks(self) -> None:
        """Stop starting communication during backward (it then runs in after_backward)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.overlapping = False

    def _ready(self, param: torch.Tensor) -> None:
        if not self.syncing or not self._during_backward():
            return
        bucket, position = self._bucket_of[id(param)]
        if not self._queued:  # the first gradient of this backward
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._queued = True
            self._begin()
        self._fired[bucket].add(position)
        while (self._started < len(self.members)
               and len(self._fired[self._started]) == len(self.members[self._started])):
            self._started += 1
            self._start(self._started - 1)

    def _end_of_backward(self) -> None:
        """Start what has not started, complete everything."""
        while self._started < len(self.members):
            self._started += 1
            self._start(self._started - 1)
        self._clear()
        self._complete()
        self.averaged = True

    def _gather(self, bucket: int, views: Sequence[torch.Tensor]
                ) -> list[tuple[str, torch.Tensor]]:
        """Copy bucket ``bucket``'s gradients into their ``views`` (a flat buffer's parts, by
        position; a missing gradient as zeros); the ``(name, gradient)`` of those present."""
        present, targets, grads = [], [], []
        for i in self.members[bucket]:
            grad = self.params[i].grad
            if grad is None:
                views[i].zero_()
            else:
                targets.append(views[i])
                grads.append(grad)
                present.append((self.named[i][0], grad))
        if grads:
            torch._foreach_copy_(targets, grads)  # one call: a small bucket's copies are calls
        return present

    def _during_backward(self) -> bool:
        """Whether this backward's buckets start during it (default: yes)."""
        return True

    def _begin(self) -> None:
        """A backward starts (its first gradient is ready)."""

    def _start(self, bucket: int) -> None:
        raise NotImplementedError

    def _complete(self) -> None:
        raise NotImplementedError


class GradientBuckets(BackwardSchedule):
    """The buckets of the dense all-reduce, started during backward with
    ``all_reduce_async``.

    Args:
        comm: the communicator.
        named: ``(name, parameter)`` of the trainable parameters, in registration order.
        flags: the non-finite flags (zeros of the flags' length, dtype and device).
        bucket_bytes: bytes per bucket at most (a larger tensor gets one of its own).
        overlap: start the all-reduces during backward where the communicator can.
    """

    def __init__(self, comm: Communicator, named: NamedParameters,
                 flags: torch.Tensor, bucket_bytes: int, overlap: bool = True) -> None:
        self.comm = comm
        #: the communicator that starts the all-reduces during backward (None: it cannot)
        self._async = comm if isinstance(comm, AsyncCollectives) else None
        ordered = list(reversed(named))  # bucket order
        self.buckets = Buckets([p for _, p in ordered] + [flags], bucket_bytes=bucket_bytes,
                               first_bytes=first_bucket_bytes(bucket_bytes, overlap))
        self.flags = self.buckets.views[-1]
        self.views = self.buckets.views[:-1]
        super().__init__(ordered, [bucket for bucket, _, _ in self.buckets.slots[:-1]],
                         overlap and overlaps(comm))
        #: per bucket, the part of its buffer that holds its gradients (without the flags)
        self._spans = [self.buckets.buffers[bucket][:sum(self.views[i].numel() for i in members)]
                       for bucket, members in enumerate(self.members)]
        self._nonfinite: list[tuple[str, torch.Tensor]] = []  # this step's, (name, gradient)
        self._handles: list = []
        self._flags_dirty = False  # whether the flags may hold anything but zeros

    def new_step(self) -> None:
        """Forget the last step (its averages; the flags are zeroed where a reduction
        starts)."""
        self._nonfinite = []
        super().new_step()

    def _begin(self) -> None:
        self._zero_flags()  # this backward's: a non-finite gradient is found again

    def _zero_flags(self) -> None:
        """Zero the flags, unless they are zeros already (one tensor operation less a step:
        a small model's step is made of such calls)."""
        if self._flags_dirty:
            self.flags.zero_()
            self._flags_dirty = False

    def _pack(self, bucket: int, nonfinite: bool = False) -> torch.Tensor:
        """Copy bucket ``bucket``'s gradients into its buffer (None: zeros), with zeros and this
        rank's flag in place of non-finite gradients (or of every one, with ``nonfinite``: a
        GradScaler found an overflow here); the buffer."""
        present = self._gather(bucket, self.views)
        if nonfinite or not all_finite([self._spans[bucket]]):  # one sum: the flat copies
            self._nonfinite += present  # described (the non-finite ones) only on error
            for i in self.members[bucket]:
                self.views[i].zero_()
            set_flag(self.flags, self.comm.rank)
        self._flags_dirty = True  # the reduction writes the flags' sum (until it is read)
        return self.buckets.buffers[bucket]

    @property
    def found(self) -> str | None:
        """This step's non-finite gradients, described (None: none)."""
        return describe_nonfinite(self._nonfinite, "gradient")

    @property
    def flagged(self) -> bool:
        """Whether a worker flagged a non-finite gradient in this step's reduction (read once
        the averages are written; then the gradients were left as they were)."""
        return self._flags_dirty

    def _start(self, bucket: int) -> None:
        """Pack bucket ``bucket`` and start its all-reduce."""
        buffer = self._pack(bucket)
        assert self._async is not None  # started during backward only where it overlaps
        self._handles.append(self._async.all_reduce_async(buffer, op="mean"))

    def _complete(self) -> None:
        """Wait for every bucket, write the averages."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.wait()
        self._write_averages()

    # -- the path after backward --------------------------------------------------------------

    def reduce(self, overflow: bool | None) -> None:
        """All-reduce every bucket now (unless a backward did already), one after the other,
        then write the averages; ``overflow`` (a GradScaler's finding here) flags this rank."""
        if self.averaged:
            return
        self._zero_flags()
        for bucket in range(len(self.members)):  # the flags' bucket last, as during backward
            self.comm.all_reduce(self._pack(bucket, nonfinite=bool(overflow)), op="mean")
        self._write_averages()
        self.averaged = True

    def ranks(self) -> list[int]:
        """The ranks that flagged a non-finite gradient in this step's reduction."""
        return ranks_from_flags(self.flags, mean_of=self.comm.world_size)

    def _write_averages(self) -> None:
        """Copy the averages into the gradients, unless a worker flagged a non-finite gradient
        (then the gradients stay as they were: the step is dropped)."""
        # the flags' mean is 0 exactly when no bit was set
        self._flags_dirty = any(self.flags.tolist())  # a few numbers: cheaper than a reduction
        if self._flags_dirty:
            return
        targets, averages = [], []
        for p, average in zip(self.params, self.views, strict=True):
            if p.grad is None:
                # Unused on this worker but maybe not on others: take the average anyway,
                # so the replicas stay identical.
                p.grad = torch.empty_like(average)
            targets.append(p.grad)
            averages.append(average)
        # the buckets were averaged by the collective (the simulator divides each sum once
        # for all its members; real processes divide their own, as the division here did)
        torch._foreach_copy_(targets, averages)


class ThreadedBuckets(BackwardSchedule):
    """A :class:`BackwardSchedule` whose buckets are sent by calls that block (a compressed
    reduction, a gossip exchange): during backward on a :class:`CommThread`, one bucket
    after the other, where the communicator overlaps; elsewhere by :meth:`reduce`, after
    backward, through the same calls in the same order.

    A subclass prepares a bucket on the caller's thread (:meth:`_prepare`: its arguments for
    :meth:`_send`, which may run on the communication thread) and writes the results when
    every bucket is done (:meth:`_finish`). It describes the non-finite gradients it replaced by
    zeros in ``found`` (:meth:`_finite_or_zeros`).

    ``scaled`` (set by the runtime while a GradScaler steps the optimizer) keeps everything
    after backward, where the gradients have been unscaled and the workers agreed on an
    overflow. A second backward before the step (without ``no_sync``) is an error: these
    reductions are not linear (a memory is updated once per step; a gossip average is not
    idempotent).
    """

    def __init__(self, named: NamedParameters, bucket_of: Sequence[int], overlap: bool) -> None:
        super().__init__(named, bucket_of, overlap)
        self.thread = CommThread() if overlap else None
        #: where the thread's jobs run on a GPU (the model's first parameter's device)
        self.side = SideStream(self.params[0].device if self.params else torch.device("cpu"))
        self.scaled = False
        self._jobs: list[Future] = []
        self._found: list[str] = []  # this step's non-finite gradients, described

    def new_step(self) -> None:
        self._found = []
        super().new_step()

    def abandon(self) -> None:
        """Drop this step's sends, never waited on (their communicator failed): a new
        communication thread takes the next step's (a send still blocked on the old one fails
        within its timeout, alone), and the step is forgotten."""
        self._jobs = []
        if self.thread is not None:
            self.thread = CommThread()
        self.new_step()

    @property
    def found(self) -> str | None:
        """This step's non-finite gradients, described (None: none)."""
        return "; ".join(self._found) or None

    def _during_backward(self) -> bool:
        if self.scaled:
            return False
        if self.averaged and not self._queued:
            raise RuntimeError(
                f"{self.what}: a second backward() before optimizer.step(), which this "
                "reduction cannot take twice in a step: wrap every micro-batch's backward but "
                "the last in optimizer.no_sync()")
        return True

    what = "averaging during backward"

    def _prepare(self, bucket: int, overflow: bool = False) -> tuple:
        raise NotImplementedError

    def _send(self, *args: object) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        """Every bucket is done (default: nothing to write)."""

    def _start(self, bucket: int) -> None:
        """Prepare bucket ``bucket`` here, and send it on the communication thread."""
        assert self.thread is not None
        args = self._prepare(bucket)
        self._jobs.append(self.thread.submit(self.side.run, self.side.handoff(), self._send,
                                             *args))

    def _complete(self) -> None:
        jobs, self._jobs = self._jobs, []
        CommThread.wait(jobs)
        self.side.join()
        self._finish()

    def reduce(self, overflow: bool | None = None) -> None:
        """Send every bucket now (unless a backward did already), one after the other;
        ``overflow`` (a GradScaler's finding here) counts every gradient as non-finite."""
        if self.averaged:
            return
        self._begin()
        for bucket in range(len(self.members)):
            self._send(*self._prepare(bucket, bool(overflow)))
        self._finish()
        self.averaged = True

    def _finite_or_zeros(self, named: Sequence[tuple[str, torch.Tensor]],
                         overflow: bool = False, zeros: torch.Tensor | None = None) -> bool:
        """Whether the gradients ``named`` are finite (and not ``overflow``); if not, they
        are described (in ``found``) and become zeros, or ``zeros`` (their flat copy) does,
        so that no message or memory ever holds such a value."""
        if not overflow and all_finite([zeros] if zeros is not None else [g for _, g in named]):
            return True
        self._found.append(describe_nonfinite(named, "gradient") or "the gradient")
        for t in [zeros] if zeros is not None else [g for _, g in named]:
            t.zero_()
        return False


class CompressedBuckets(ThreadedBuckets):
    """AllReduce's compressed average, bucket by bucket through a
    :class:`~gossamer.compress.CompressedReducer`.

    Args:
        comm: the communicator.
        named: ``(name, parameter)`` of the trainable parameters in bucket order: reverse
            registration order to overlap, or any order that every worker shares.
        reducer: the reducer (only this object's calls use it while backward runs).
        flags: the non-finite flags; they ride on the last bucket's first collective.
        bucket_bytes: bytes per bucket at most (the first at most 1 MiB to overlap).
        step: the optimizer step of the gradients being reduced (it seeds compressors).
        prepare: called on each bucket's ``(name, parameter)`` before it is compressed, with
            the gradients present (a missing one is zeros): weight decay in the gradient.
        overlap: start the buckets during backward where the communicator can.
    """

    what = "compressed averaging"

    def __init__(self, comm: Communicator, named: NamedParameters, reducer: CompressedReducer,
                 flags: torch.Tensor, bucket_bytes: int, *, step: Callable[[], int],
                 prepare: Callable[[NamedParameters], None], overlap: bool = True) -> None:
        self.comm, self.reducer, self.flags = comm, reducer, flags
        self._step, self._prepare_bucket = step, prepare
        slots, _, _ = layout([p for _, p in named], bucket_bytes,
                             first_bucket_bytes(bucket_bytes, overlap))
        super().__init__(named, [bucket for bucket, _, _ in slots], overlap and overlaps(comm))

    def _begin(self) -> None:
        self.flags.zero_()

    def _prepare(self, bucket: int, overflow: bool = False) -> tuple:
        """Bucket ``bucket``'s gradients, ready to compress: zeros for missing ones, prepared,
        and zeros with this rank's flag in place of non-finite ones (of every one with
        ``overflow``); with the step and whether it is the last bucket."""
        named = [self.named[i] for i in self.members[bucket]]
        for _, p in named:
            if p.grad is None:  # unused here, maybe not elsewhere: its gradient is zero
                p.grad = torch.zeros_like(p)
        self._prepare_bucket(named)
        grads = [(name, p.grad) for name, p in named]
        if not self._finite_or_zeros(grads, overflow):
            set_flag(self.flags, self.comm.rank)
        return grads, self._step(), bucket == len(self.members) - 1

    def _send(self, grads: list[tuple[str, torch.Tensor]], step: int, last: bool) -> None:
        self.reducer.reduce(grads, step, flags=self.flags if last else None, checked=True)
