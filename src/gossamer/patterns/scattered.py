"""The mean of a vector over the workers as a reduce-scatter and an all-gather made of
point-to-point exchanges, optionally in low precision with error feedback, started at once and
advanced without blocking (Streaming DiLoCo's outer average, overlapping inner steps).

Example::

    mean = ScatteredMean(comm, vector, LowBit("int4"), residuals, key="fragment 0")
    ...                       # inner steps; mean.progress() at each, never blocking
    averaged = mean.wait()
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gossamer.comm.base import Communicator
from gossamer.compress.lowbit import LowBit

__all__ = ["ScatteredMean"]


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
    """

    def __init__(self, comm: Communicator, vector: torch.Tensor, codec: LowBit,
                 residuals: dict[Any, torch.Tensor], key: Any) -> None:
        self.comm, self.codec, self.residuals, self.key = comm, codec, residuals, key
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
        self.received = comm.exchange({}, self.others, recv_like=payloads[me])
        self.sent = [comm.exchange({r: payloads[r] for r in self.others}, [])]

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
