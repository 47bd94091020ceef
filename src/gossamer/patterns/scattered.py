"""The mean of a vector over the workers as a reduce-scatter and an all-gather made of
point-to-point exchanges, optionally in low precision with error feedback, started at once and
advanced without blocking (Streaming DiLoCo's outer average, overlapping inner steps); and
:class:`MeanInFlight`, one such mean at a time with the errors it feeds back: dropped without
a trace, saved in a checkpoint mid-flight and started again with the same payloads.

Example::

    mean = ScatteredMean(comm, vector, LowBit("int4"), residuals, key="fragment 0")
    ...                       # inner steps; mean.progress() at each, never blocking
    averaged = mean.wait()
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gossamer.comm.base import Communicator, CommunicatorBase
from gossamer.compress.lowbit import LowBit

__all__ = ["Exchange", "MeanInFlight", "ScatteredMean"]


class ScatteredMean:
    """The mean over the workers of a flat float32 vector, as two exchanges started now and
    advanced by :meth:`progress` (never blocks) and :meth:`wait`.

    Each of the n workers owns one of n equal chunks (the vector padded with zeros): first
    every worker sends chunk j, encoded by ``codec``, to worker j; worker j adds the decoded
    chunks in rank order (its own included, as decoded), divides by n, encodes the mean and
    sends it to everyone. A worker sends to the others in the order of their offset from it
    (``rank + 1``, ``rank + 2``, ...), as an all-to-all is scheduled: no worker is everyone's
    first, every rank's messages arrive alike, and one worker can stand for all in the
    planner (:mod:`gossamer.comm.mirror`). ``residuals`` (a dict kept by the caller) holds
    each worker's encoding errors, added to what it next encodes under the same key:
    ``(key, "sent")`` for the whole vector, ``(key, "mean")`` for the chunk it owns.

    One mean at a time over a communicator (:class:`MeanInFlight` keeps it so): messages
    between two workers match in the order they are posted, so a worker whose first mean has
    reached its all-gather would send that before a second mean's chunks, which another
    worker's receives of the second mean would take.
    """

    def __init__(self, comm: Communicator, vector: torch.Tensor, codec: LowBit,
                 residuals: dict[Any, torch.Tensor], key: Any, counted_before: int = 0) -> None:
        self.comm, self.codec, self.residuals, self.key = comm, codec, residuals, key
        #: the exchanges (1: the first, 2: both) whose messages were counted before, by a run
        #: that saved this mean in flight: sent again uncounted
        self.counted_before = counted_before
        n, me = comm.world_size, comm.rank
        self.numel = vector.numel()
        self.chunk = math.ceil(self.numel / n) if self.numel else 0
        # unquantised, a float64 model's pseudo-gradients are averaged in float64
        exact = codec.precision == "float32" and vector.dtype == torch.float64
        dtype = torch.float64 if exact else torch.float32
        padded = torch.zeros(n * self.chunk, dtype=dtype, device=vector.device)
        padded[: self.numel] = vector
        sent = self.residuals.get((key, "sent"))
        if sent is not None and sent.dim() == 1 and sent.numel() <= padded.numel():
            # (shorter: kept across a membership change without the old size's padding)
            padded[: sent.numel()] += sent.to(padded)
        parts = padded.view(n, self.chunk)
        payloads = [codec.encode(part) for part in parts]
        decoded = torch.stack([codec.decode(p, self.chunk) for p in payloads]) if n else parts
        self.residuals[(key, "sent")] = padded - decoded.reshape(-1)
        self.own = decoded[me]
        self.others = [(me + k) % n for k in range(1, n)]  # by offset
        self.mean: torch.Tensor | None = None
        self.phase = 1
        if n == 1:
            self._reduce({})
            return
        # receives posted first: a message then lands in its buffer as it arrives
        with self._counting(1):
            self.received = comm.exchange({}, self.others, recv_like=payloads[me])
            self.sent = [comm.exchange({r: payloads[r] for r in self.others}, [])]

    def _counting(self, phase: int) -> contextlib.AbstractContextManager[Any]:
        """Where exchange ``phase``'s messages were counted before: uncounted."""
        if self.counted_before >= phase and isinstance(self.comm, CommunicatorBase):
            return self.comm.uncounted()
        return contextlib.nullcontext()

    def _residual(self, key: Any, like: torch.Tensor) -> torch.Tensor:
        residual = self.residuals.get(key)
        if residual is None or residual.shape != like.shape:
            return torch.zeros_like(like)
        return residual

    def progress(self) -> None:
        """Start the second exchange if the first has arrived (never blocks)."""
        if self.phase == 1 and self.received.ready():
            self._reduce(self.received.wait())

    def _reduce(self, received: dict[int, torch.Tensor]) -> None:
        n, me = self.comm.world_size, self.comm.rank
        total = torch.zeros_like(self.own)
        for r in range(n):  # in rank order, the same sum on every backend
            total += self.own if r == me else self.codec.decode(received[r], self.chunk)
        mean = total / n
        mean = mean + self._residual((self.key, "mean"), mean)
        payload = self.codec.encode(mean)
        self.mean = self.codec.decode(payload, self.chunk)
        self.residuals[(self.key, "mean")] = mean - self.mean
        self.phase = 2
        if n == 1:
            return
        with self._counting(2):
            self.gathered = self.comm.exchange({}, self.others, recv_like=payload)
            self.sent.append(self.comm.exchange({r: payload for r in self.others}, []))

    def wait(self) -> torch.Tensor:
        """The mean (blocks, within the communicator's timeout)."""
        if self.phase == 1:
            self._reduce(self.received.wait())
        assert self.mean is not None
        n, me = self.comm.world_size, self.comm.rank
        if n == 1:
            return self.mean[: self.numel]
        gathered = self.gathered.wait()
        for handle in self.sent:
            handle.wait()
        chunks = [self.mean if r == me else self.codec.decode(gathered[r], self.chunk)
                  for r in range(n)]
        return torch.cat(chunks)[: self.numel]


@dataclass
class Exchange:
    """A mean in flight on this worker, with what starting it again needs."""

    fragment: int  # its key: the fragment (or whatever the caller averages) it is of
    vector: torch.Tensor  # this worker's vector, as it was sent
    sent_before: torch.Tensor | None  # its errors of the key before the exchange
    mean_before: torch.Tensor | None
    mean: ScatteredMean | None = None  # None: not started here (loaded from a state)
    #: the exchanges of its mean sent, and counted, before a checkpoint (1: the first, 2:
    #: both): sent again uncounted
    counted: int = 0


class MeanInFlight:
    """At most one :class:`ScatteredMean` in flight, keyed by an int, and this worker's
    encoding errors of every key (``residuals``, fed back into the next mean of the same key).

    A mean in flight can be dropped (:meth:`drop`: the errors go back to what they were
    before it, since what it sent will never be applied) and saved mid-flight
    (:meth:`state_dict`): a worker that loads its own state starts it again at once with the
    same vector and errors, so the same payloads, uncounted (they were counted before the
    checkpoint)."""

    def __init__(self, codec: LowBit) -> None:
        self.codec = codec
        self.residuals: dict[Any, torch.Tensor] = {}
        self.in_flight: Exchange | None = None

    def start(self, comm: Communicator, key: int, vector: torch.Tensor) -> None:
        """Start the mean of ``vector`` under ``key`` over ``comm``'s workers."""
        self.in_flight = Exchange(key, vector, self.residuals.get((key, "sent")),
                                  self.residuals.get((key, "mean")))
        try:
            self.started(comm)
        except BaseException:  # (a send that failed at once: nothing of it is in flight)
            self.drop()
            raise

    def started(self, comm: Communicator) -> ScatteredMean:
        """The mean in flight, started now if it was not (loaded from a state): this worker's
        errors of the key as they were before it, the same vector, so the same payloads as
        the first time and the same mean."""
        exchange = self.in_flight
        assert exchange is not None
        if exchange.mean is None:
            self._restore_errors(exchange)
            exchange.mean = ScatteredMean(comm, exchange.vector, self.codec, self.residuals,
                                          exchange.fragment, counted_before=exchange.counted)
        return exchange.mean

    def progress(self, comm: Communicator) -> None:
        """Advance the mean in flight, if any (never blocks)."""
        if self.in_flight is not None:
            self.started(comm).progress()

    def take(self, comm: Communicator) -> torch.Tensor:
        """The mean in flight, waited for; nothing is in flight after it."""
        mean = self.started(comm).wait()
        self.in_flight = None
        return mean

    def _restore_errors(self, exchange: Exchange) -> None:
        for kind, before in (("sent", exchange.sent_before), ("mean", exchange.mean_before)):
            if before is None:
                self.residuals.pop((exchange.fragment, kind), None)
            else:
                self.residuals[(exchange.fragment, kind)] = before

    def drop(self) -> None:
        """Forget the mean in flight, never waited on: this worker's errors of its key go back
        to what they were before it."""
        if self.in_flight is not None:
            self._restore_errors(self.in_flight)
            self.in_flight = None

    def keep_own_errors(self, sizes: Sequence[int]) -> None:
        """Of this worker's errors, those of its own vectors (key k of ``sizes[k]`` elements),
        without the padding of the old number of workers; those of the means it owned
        (chunks of the old ranks) are dropped: for a new set of workers."""
        self.residuals = {(key, kind): error[:sizes[key]].clone()
                          for (key, kind), error in self.residuals.items()
                          if kind == "sent" and error.numel() >= sizes[key]}

    def state_dict(self) -> dict[str, Any]:
        """The errors and the mean in flight, if any: its key, the vector this worker sent and
        its errors of the key as they were before."""
        state: dict[str, Any] = {"residuals": [[list(k), v.clone()] for k, v in sorted(
            self.residuals.items(), key=lambda item: repr(item[0]))]}
        if self.in_flight is not None:
            exchange = self.in_flight
            phase = exchange.mean.phase if exchange.mean is not None else exchange.counted
            state["in_flight"] = {"fragment": exchange.fragment,
                                  "vector": exchange.vector.clone(),
                                  "phase": max(phase, exchange.counted)}
            for key, before in (("sent_before", exchange.sent_before),
                                ("mean_before", exchange.mean_before)):
                if before is not None:
                    state["in_flight"][key] = before.clone()
        return state

    def load_state_dict(self, state: dict[str, Any], comm: Communicator, own: bool) -> None:
        """This worker's errors and its mean in flight when the state is its ``own`` (then
        the mean starts again at once over ``comm``, collective); none otherwise (a worker
        that rejoins with another's state)."""
        self.residuals = ({(int(k[0]), str(k[1])): v.clone() for k, v in state["residuals"]}
                          if own else {})
        self.in_flight = None
        saved = state.get("in_flight")
        if saved is not None and own:
            def before(key: str) -> torch.Tensor | None:
                return saved[key].clone() if saved.get(key) is not None else None

            self.in_flight = Exchange(int(saved["fragment"]), saved["vector"].clone(),
                                      before("sent_before"), before("mean_before"),
                                      counted=int(saved.get("phase", 1)))
            self.started(comm)
