"""What the DDP hook states share: the step counter, and non-finite gradients under a
GradScaler.

DDP's own all-reduce spreads a NaN or inf to every worker, so that a ``torch.amp.GradScaler``
finds the overflow on every worker and every worker skips the step and lowers its scale
alike. A hook that compresses or gossips must keep that property by itself: it learns that a
scaler is in use from its state's ``scaler`` option, and then

- every worker learns which workers had non-finite values in a bucket (one bit per rank: on
  the bucket's first collective for the compression hook, nothing more sent; a small
  all-reduce of its own for GossipGraD's hook, whose exchange reaches one partner only);
- if any had, every worker's reduced bucket is NaN, so that every scaler finds the overflow;
  a worker with non-finite values compresses zeros in their place, so that no error-feedback
  residual or DGC momentum holds them;
- the iteration is not an optimizer step: ``state.step`` does not advance (so the partner
  and warm-up schedules stay the same on every worker) and ``state.skipped_steps`` counts it.

Without a scaler the compression hook raises a
:class:`~gossamer.patterns.nonfinite.NonFiniteError` on every worker, naming the workers
with non-finite gradients (they agree on the same bits, so none waits); GossipGraD's hook does
not check (as DDP's all-reduce, it passes the values on).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gossamer.comm.base import Communicator
from gossamer.patterns.nonfinite import NonFiniteError
from gossamer.patterns.overlap import CommThread, SideStream, overlaps

__all__ = ["HookState"]


def hook_communicator(process_group: dist.ProcessGroup | None,
                      timeout: float | None) -> Communicator:
    """The communicator of a hook's traffic: a :class:`~gossamer.comm.TorchCommunicator`
    over a process group of its own, with the members of ``process_group`` (default: every
    rank). The hook's collectives run on a thread of their own while DDP's (the search for
    unused parameters, the buffers' broadcast) run on DDP's group, and two threads must never
    share a group: the order of their collectives could differ between ranks. Collective:
    every rank of the default group calls it (``dist.new_group``'s rule)."""
    from gossamer.comm.torch_comm import TorchCommunicator

    ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
    return TorchCommunicator(dist.new_group(ranks), timeout=timeout)


class HookState:
    """The step counter of a DDP hook's state, its statistics and its GradScaler (if any).

    Args:
        scaler: the ``torch.amp.GradScaler`` the training loop steps the optimizer with
            (default None: none); see the module docs.
    """

    def __init__(self, scaler: torch.amp.GradScaler | None = None) -> None:
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise ValueError(f"scaler must be a torch.amp.GradScaler or None, got {scaler!r}")
        # hyperparameters
        self.scaler = scaler
        # internal state
        self.step = 0  # optimizer steps (iterations whose last bucket was reduced, no overflow)
        self.overflow = False  # this iteration: a bucket overflowed (the scaler skips it)
        # statistics
        self.buckets = 0  # buckets reduced, all steps together
        self.skipped_steps = 0  # iterations that overflowed under the scaler
        self._thread: CommThread | None = None  # started with the first bucket that overlaps
        self._side: SideStream | None = None  # the thread's stream, on a GPU

    @property
    def comm(self) -> Communicator:
        """The communicator of the hook's traffic."""
        raise NotImplementedError

    @property
    def scaling(self) -> bool:
        """Whether a GradScaler (enabled) steps the optimizer."""
        return self.scaler is not None and self.scaler.is_enabled()

    def scale(self) -> float:
        """The scaler's current scale (1.0 without an enabled scaler)."""
        return self.scaler.get_scale() if self.scaler is not None else 1.0

    def nonfinite(self, buffer: torch.Tensor, ranks: Sequence[int], found: str | None) -> None:
        """Every worker learned that ``ranks`` had non-finite values in this bucket (``found``:
        which, on those ranks): under a scaler, make ``buffer`` NaN on every worker, so that
        every scaler finds the overflow; without one, raise on every worker."""
        if self.scaling:
            buffer.fill_(math.nan)
            self.overflow = True
            return
        rank, step = self.comm.rank, self.step + 1
        where = f" in {found}" if found else ""
        raise NonFiniteError(
            f"rank {rank}: non-finite gradients at step {step} on rank(s) "
            f"{', '.join(map(str, ranks))}{where}; nothing non-finite was sent or kept in a "
            "memory. Under a GradScaler give it to the hook's state (scaler=...)",
            rank=rank, step=step, ranks=ranks)

    def start(self, bucket: dist.GradBucket,
              reduce: Callable[[torch.Tensor, list[torch.Tensor], list[torch.Tensor]], None]
              ) -> torch.futures.Future[torch.Tensor]:
        """The future DDP waits for: ``reduce(buffer, gradients, parameters)`` of ``bucket``
        (in place in ``buffer``), then the bucket counted and, after the iteration's last
        one, the step advanced (unless it overflowed).

        Where the communicator overlaps (real processes), ``reduce`` runs on this state's
        communication thread, buckets one after the other in the order DDP hands them over
        (the same on every worker), and the hook returns at once: backward goes on while the
        bucket travels, and the future completes (or fails with ``reduce``'s error) when it
        is done. Elsewhere it runs before the hook returns.
        """
        buffer, grads, params = bucket.buffer(), bucket.gradients(), bucket.parameters()
        last = bucket.is_last()
        # on a GPU, a future that records the stream its result was set on (the job's), so that
        # DDP's wait orders its own stream after that work
        cuda = buffer.device.type == "cuda" and overlaps(self.comm)
        future: torch.futures.Future[torch.Tensor] = (
            torch.futures.Future(devices=[buffer.device]) if cuda else torch.futures.Future())

        def job() -> torch.Tensor:
            reduce(buffer, grads, params)
            self._count(last)
            return buffer

        if not overlaps(self.comm):
            future.set_result(job())  # its error is raised here, by the hook
            return future

        def on_thread() -> None:
            try:
                future.set_result(job())
            except BaseException as exc:  # noqa: BLE001 - DDP raises it from the future
                future.set_exception(exc)

        if self._thread is None:
            self._thread = CommThread()
        if self._side is None:  # on a GPU the jobs run on a stream of their own
            self._side = SideStream(buffer.device)
        self._thread.submit(self._side.run, self._side.handoff(), on_thread)
        return future

    def _count(self, last: bool) -> None:
        """Count a bucket; after the iteration's ``last`` one, advance the step (unless it
        overflowed)."""
        self.buckets += 1
        if last:
            if self.overflow:
                self.skipped_steps += 1
            else:
                self.step += 1
            self.overflow = False

    def steps_state(self) -> dict[str, Any]:
        return {"step": self.step, "buckets": self.buckets, "skipped_steps": self.skipped_steps}

    def load_steps_state(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.buckets = int(state["buckets"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
