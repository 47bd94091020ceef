"""Streaming DiLoCo: DiLoCo whose fragments synchronise at staggered steps, each exchange
overlapping the next ``tau`` inner steps, in low precision.

Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a Distributed Free
Lunch" (2025, arXiv 2501.18512), Algorithm 2, and torchft's ``DiLoCo`` with fragments. The
model's parameter tensors are split into P fragments (``fragments``; ``pattern="strided"``:
tensor i in fragment i mod P, the paper's better pattern; ``"sequential"``: consecutive runs
of about equal size). Each fragment is synchronised every H steps (``period``), fragment p
first after ``(p + 1) H / P`` steps, so one fragment's exchange is under way at a time and the
peak bandwidth is 1/P of DiLoCo's. For fragment p, synchronised at the end of step s (1-based):

1. at the end of step ``s - tau``, its pseudo-gradient ``Delta_p = theta_p^global - theta_p``
   is computed and its average over the workers starts (in ``precision``: float32, bfloat16,
   int8 or int4; the quantisation error each worker makes is kept by that worker and added to
   its next pseudo-gradient of the fragment);
2. the workers take the next ``tau`` inner steps while it travels;
3. at the end of step s the average is waited for, the outer optimizer steps the fragment's
   global copy, and the local fragment becomes ``alpha theta_p + (1 - alpha) theta_p^global``
   (``mixing``, the paper's alpha; 0: the global value, as DiLoCo).

With one fragment, ``tau`` 0, ``mixing`` 0 and float32 this is DiLoCo.

The average is a reduce-scatter and an all-gather made of two point-to-point exchanges (each
worker owns 1/n of the fragment: it receives everyone's part of it, adds them in rank order,
and sends the mean back to all; in int8 or int4 the owner quantises the mean again and keeps
that error too). Its bytes are a ring all-reduce's, ``2 (n - 1) / n`` of the fragment per
worker, at the precision's width. It starts at once and progresses at each of the runtime's
hooks that finds the first exchange arrived, so on real processes the messages travel while
the workers compute; the wait comes ``tau`` steps later.

Under ``on_failure="continue"`` the members drop the exchange in flight (each one's
quantisation error goes back to what it was before it), take rank 0's global parameters and
outer optimizer, and make one exact outer step of every fragment over the new members; the
schedule goes on from the step (see :meth:`StreamingDiLoCoRuntime.change_membership`).

Example::

    inner = torch.optim.AdamW(model.parameters(), lr=4e-4)
    optimizer = gossamer.distribute(model, inner, StreamingDiLoCo(
        period=100, fragments=4, tau=5, mixing=0.5, precision="int4"))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from gossamer.algorithms.base import average_tensors
from gossamer.algorithms.diloco import DiLoCo, DiLoCoRuntime
from gossamer.algorithms.nonfinite import all_finite
from gossamer.checks import check_int
from gossamer.comm.base import Communicator
from gossamer.comm.state import broadcast_object
from gossamer.compress.lowbit import PRECISIONS, LowBit
from gossamer.options import option

PATTERNS = ("strided", "sequential")


@dataclass(frozen=True, kw_only=True)
class StreamingDiLoCo(DiLoCo):
    """Streaming DiLoCo (Douillard et al. 2025): DiLoCo in P fragments synchronised at
    staggered steps, each exchange overlapping ``tau`` inner steps, in low precision.

    Args:
        period: H, steps between two synchronisations of the same fragment (default 16);
            a multiple of ``fragments``.
        fragments: P, the number of fragments (default 4).
        pattern: ``"strided"`` (default: parameter tensor i in fragment i mod P) or
            ``"sequential"`` (consecutive tensors, about equal sizes).
        tau: inner steps that a fragment's exchange overlaps (default 1); less than H / P.
        mixing: the paper's alpha: the local fragment becomes ``mixing * local + (1 - mixing)
            * global`` after its outer step (default 0.5).
        precision: of the pseudo-gradients on the wire: ``float32`` (unquantised: a float64
            model's travel in float64), ``bfloat16``, ``int8`` or ``int4`` (default ``int4``,
            the paper's 4 bits), with error feedback.
        warmup_steps: a plain exact average after each step before this one (synchronous
            training while the learning rate warms up); the fragments' schedule starts
            after it (default 0).
        (the outer optimizer, ``group_size``, ``average_at_end`` and the other options of
        :class:`DiLoCo`; the period is constant: ``alpha``, ``warmup_period`` and
        ``compression`` are not taken.)
    """

    name: ClassVar[str] = "streaming-diloco"
    continues_after_failure: ClassVar[bool] = True
    #: its pseudo-gradients travel in ``precision``, not through a compressor
    takes_compression: ClassVar[bool] = False

    period: int = option(16, "H: steps between two synchronisations of a fragment; a multiple "
                         "of fragments")
    fragments: int = option(4, "P: fragments, synchronised one after another every H / P "
                            "steps")
    pattern: str = option("strided", "strided: tensor i in fragment i mod P; sequential: "
                          "consecutive tensors")
    tau: int = option(1, "inner steps each exchange overlaps; < H / P")
    mixing: float = option(0.5, "the paper's alpha: local = mixing * local + (1 - mixing) * "
                           "global after a fragment's outer step")
    precision: str = option("int4", "pseudo-gradients on the wire: float32, bfloat16, int8, "
                            "int4 (error feedback)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("fragments", self.fragments, 1)
        check_int("tau", self.tau, 0)
        if self.period % self.fragments:
            raise ValueError(f"period={self.period} must be a multiple of fragments="
                             f"{self.fragments}")
        if self.tau >= self.period // self.fragments:
            raise ValueError(f"tau={self.tau} must be less than period / fragments = "
                             f"{self.period // self.fragments}: a fragment's exchange must end "
                             "before the next one starts")
        if self.pattern not in PATTERNS:
            raise ValueError(f"pattern must be one of {', '.join(PATTERNS)}, "
                             f"got {self.pattern!r}")
        if not (isinstance(self.mixing, (int, float)) and not isinstance(self.mixing, bool)
                and 0 <= self.mixing <= 1):
            raise ValueError(f"mixing must be a number in [0, 1], got {self.mixing!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, "
                             f"got {self.precision!r}")
        for name, value, default in (("alpha", self.alpha, 0.0),
                                     ("warmup_period", self.warmup_period, 1),
                                     ("compression", self.compression, None)):
            if value != default:
                raise ValueError(f"{name}={value!r} is not taken by streaming-diloco (a "
                                 "constant period, its own precision); use diloco")

    def bind(self, comm: Communicator, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> StreamingDiLoCoRuntime:
        self.validate(comm.world_size)
        return StreamingDiLoCoRuntime(self, comm, model, optimizer)


def split_fragments(sizes: Sequence[int], count: int, pattern: str) -> list[list[int]]:
    """The tensor indices of each of ``count`` fragments of tensors of ``sizes`` elements:
    ``strided`` (i mod count) or ``sequential`` (consecutive, cut where the running total
    passes each multiple of total / count). A fragment may be empty if there are fewer
    tensors than fragments."""
    if pattern == "strided":
        return [list(range(p, len(sizes), count)) for p in range(count)]
    total = sum(sizes)
    fragments: list[list[int]] = [[] for _ in range(count)]
    running = 0
    for i, size in enumerate(sizes):
        # the fragment of the tensor's middle element
        p = min(count - 1, int((running + size / 2) * count // max(total, 1)))
        fragments[p].append(i)
        running += size
    return fragments


class ScatteredMean:
    """The mean over the workers of a flat float32 vector, as two exchanges started now and
    advanced by :meth:`progress` (never blocks) and :meth:`wait`.

    Each of the n workers owns one of n equal chunks (the vector padded with zeros): first
    every worker sends chunk j, encoded by ``codec``, to worker j; worker j adds the decoded
    chunks in rank order (its own included, as decoded), divides by n, encodes the mean and
    sends it to everyone. ``residuals`` (a dict kept by the caller) holds each worker's
    encoding errors, added to what it next encodes under the same key: ``(key, "sent")`` for
    the whole vector, ``(key, "mean")`` for the chunk it owns.
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
        self.others = [r for r in range(n) if r != me]
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


class StreamingDiLoCoRuntime(DiLoCoRuntime):
    """One worker of Streaming DiLoCo: its fragments, the exchange in flight, the errors."""

    def __init__(self, config: StreamingDiLoCo, comm: Communicator, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        super().__init__(config, comm, model, optimizer)
        self.config: StreamingDiLoCo = config
        self.fragment_indices = split_fragments([p.numel() for p in self.trained],
                                                config.fragments, config.pattern)
        self.codec = LowBit(config.precision)
        self.residuals: dict[Any, torch.Tensor] = {}  # this worker's encoding errors
        self.in_flight: tuple[int, ScatteredMean] | None = None  # (fragment, its mean)
        self.sent_before: torch.Tensor | None = None  # its error before the exchange in flight
        self.fragment_syncs = [0] * config.fragments  # statistics: outer steps per fragment

    def _schedule(self, step: int) -> tuple[int, int]:
        """(fragment, position in its slot) of 0-based ``step``: a slot of H / P steps ends
        with one fragment's synchronisation; fragment p is synchronised in slots p, p + P..."""
        slot, position = divmod(step, self.config.period // self.config.fragments)
        return slot % self.config.fragments, position

    def before_forward(self) -> None:
        self._progress()

    def after_backward(self) -> None:
        super().after_backward()
        self._progress()

    def _progress(self) -> None:
        if self.in_flight is not None:
            self.in_flight[1].progress()

    @torch.no_grad()
    def after_step(self) -> None:
        if self.step < self.config.warmup_steps:  # synchronous: a plain average every step
            self.outer.warm_up(self.across)
            self.synchronizations += 1
            self.last_averaged = self.step
            return
        fragment, position = self._schedule(self.step - self.config.warmup_steps)
        slot = self.config.period // self.config.fragments
        self._progress()
        if position == slot - 1 - self.config.tau:
            self._prepare(fragment)
        if position == slot - 1:
            self._perform(fragment)

    def _prepare(self, fragment: int) -> None:
        indices = self.fragment_indices[fragment]
        tensors = [self.trained[i] for i in indices]
        if not all_finite(tensors):
            raise self.nonfinite_error("parameters")
        deltas = self.outer.pseudo_gradients(indices)
        vector = (torch.cat([d.reshape(-1) for d in deltas]) if deltas
                  else torch.zeros(0))
        # the error kept before this exchange: what this worker still owes if it is dropped
        self.sent_before = self.residuals.get((fragment, "sent"))
        try:
            self.in_flight = (fragment, ScatteredMean(self.across, vector, self.codec,
                                                      self.residuals, fragment))
        except BaseException:  # (a send that failed at once: nothing of it is in flight)
            self._restore_sent(fragment)
            raise

    def _restore_sent(self, fragment: int) -> None:
        """The fragment's error as before its last exchange (which will never be applied)."""
        if self.sent_before is None:
            self.residuals.pop((fragment, "sent"), None)
        else:
            self.residuals[(fragment, "sent")] = self.sent_before

    def _perform(self, fragment: int) -> None:
        if self.in_flight is None:
            # taken in early, by settle() or a membership change (which synchronised every
            # fragment at once since): nothing to synchronise at its scheduled end
            return
        assert self.in_flight[0] == fragment
        mean = self.in_flight[1].wait()
        self.in_flight = None
        indices = self.fragment_indices[fragment]
        self._outer_step(indices, mean, self.config.mixing)
        self.fragment_syncs[fragment] += 1
        self.synchronizations += 1
        self.last_averaged = self.step

    def _outer_step(self, indices: Sequence[int], mean: torch.Tensor, mixing: float) -> None:
        sizes = [self.trained[i].numel() for i in indices]
        self.outer.step(indices, list(torch.split(mean, sizes)))
        for i in indices:
            local, global_ = self.trained[i], self.outer.global_params[i]
            local.copy_(global_.detach().lerp(local, mixing))

    @torch.no_grad()
    def settle(self) -> None:
        """Take in the fragment's exchange in flight (its outer step and merge)."""
        if self.in_flight is not None:
            self._perform(self.in_flight[0])

    @torch.no_grad()
    def finish(self) -> None:
        """Take in the exchange in flight; then, with ``average_at_end``, one outer step of the
        whole model, unquantised, after which every worker holds the global parameters (the
        replicas differ after any fragment's synchronisation: the other fragments, and the
        local share ``mixing``)."""
        self.settle()
        if self.config.average_at_end:
            self.average_parameters()

    @torch.no_grad()
    def average_parameters(self) -> None:
        """An outer step of every fragment at once, unquantised, mixing 0: every worker
        ends with the global parameters. Collective."""
        self.settle()
        indices = list(range(len(self.trained)))
        deltas = self.outer.pseudo_gradients(indices)
        self.reduce(deltas)
        self._outer_step(indices, torch.cat([d.reshape(-1) for d in deltas]), 0.0)
        if self.config.average_buffers:
            average_tensors(self.comm, [b for b in self.model.buffers()
                                        if torch.is_floating_point(b)])
        self.synchronizations += 1
        self.last_averaged = self.step

    @torch.no_grad()
    def change_membership(self, comm: Communicator, algorithm: Any) -> None:
        """Go on over the members of ``comm`` (``on_failure="continue"``; ``group_size``
        must divide their number).

        1. The fragment's exchange in flight is dropped, never waited on: its messages
           travel over the old communicator, whose members are no longer those that must
           answer. Each member's quantisation error of that fragment goes back to what it
           was before the exchange (what it sent will never be applied), and the errors of
           the means each member kept for its chunk (chunks of the old ranks) are dropped;
           the errors of its own pseudo-gradients are kept, without the old size's padding.
        2. The groups are rebuilt for the new members, and the global parameters and the
           outer optimizer's state of the member of rank 0 are sent to every member (a
           failure in the middle of an exchange may have let some members take in a
           fragment's outer step that the others did not).
        3. An outer step of every fragment at once over the members, exact (unquantised,
           ``mixing`` 0), as :meth:`average_parameters`: each fragment's pseudo-gradient
           since its last synchronisation reaches the global parameters as it would have at
           its own synchronisation, and every member continues from the same global
           parameters. During the warm-up (``warmup_steps``): a plain exact average.

        The fragments' schedule goes on from the step: a fragment whose exchange was dropped
        is not synchronised at its scheduled end (the outer step above took it in); the next
        starts at its usual step. The dead worker's share of the dropped exchange is lost. A
        worker that rejoins has received a member's state without its errors
        (:meth:`load_state_dict`): it starts with none.
        """
        if self.in_flight is not None:
            self._restore_sent(self.in_flight[0])
            self.in_flight = None
        self.sent_before = None
        fragment_sizes = [sum(self.trained[i].numel() for i in indices)
                          for indices in self.fragment_indices]
        kept = {}
        for (fragment, kind), error in self.residuals.items():
            if kind == "sent" and error.numel() >= fragment_sizes[fragment]:
                kept[(fragment, kind)] = error[: fragment_sizes[fragment]].clone()
        self.residuals = kept
        algorithm.validate(comm.world_size)
        self.comm = comm
        self._connect(comm)
        if self.inner is not None:
            self.inner.start(nonfinite=self.nonfinite)
        self._share_outer(comm)
        if self.step < self.config.warmup_steps:
            if not all_finite(self.trained):
                raise self.nonfinite_error("parameters")
            self.outer.warm_up(self.across)
            if self.config.average_buffers:
                average_tensors(comm, [b for b in self.model.buffers()
                                       if torch.is_floating_point(b)])
            self.synchronizations += 1
        else:
            self.average_parameters()
        self.last_averaged = self.step - 1

    def _share_outer(self, comm: Communicator) -> None:
        """The global parameters and the outer optimizer's state of the member of rank 0,
        on every member (a fragment never synchronised has no outer state yet).
        Collective."""
        state = broadcast_object(comm, 0, self.outer.state_dict() if comm.rank == 0 else None)
        if comm.rank != 0:
            self.outer.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        if self.in_flight is not None:
            raise RuntimeError("streaming-diloco: a fragment's exchange is in flight; save "
                               "after a fragment's synchronisation or after finish()")
        return {**super().state_dict(), "fragment_syncs": list(self.fragment_syncs),
                "residuals": [[list(k), v.clone()] for k, v in sorted(
                    self.residuals.items(), key=lambda item: repr(item[0]))],
                # whose errors these are: a worker's rank and the number of workers
                "residuals_of": [self.comm.rank, self.comm.world_size]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Also each worker's quantisation errors, when the state is its own (saved at the
        same rank of as many workers): a worker that rejoins receives a member's state, and
        starts with no errors of its own instead of that member's."""
        super().load_state_dict(state)
        self.fragment_syncs = [int(x) for x in state["fragment_syncs"]]
        owner = state.get("residuals_of")
        own = owner is None or [int(x) for x in owner] == [self.comm.rank,
                                                           self.comm.world_size]
        self.residuals = ({(int(k[0]), str(k[1])): v.clone() for k, v in state["residuals"]}
                          if own else {})

