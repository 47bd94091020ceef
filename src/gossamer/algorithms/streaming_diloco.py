"""Streaming DiLoCo: DiLoCo whose fragments synchronise at staggered steps, each exchange
overlapping the next ``tau`` inner steps, in low precision.

Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a Distributed Free
Lunch" (2025, arXiv 2501.18512), Algorithm 2, and torchft's ``DiLoCo`` with fragments. The
model is split into P fragments (``fragments``) of whole layers (:func:`split_fragments`:
``pattern="strided"``, the paper's better pattern, puts the i-th block of a ``ModuleList`` or
``Sequential`` (a transformer block) in fragment i mod P, as the paper's Fig. 2;
``"sequential"`` cuts consecutive layers at about equal sizes). Each fragment is synchronised
every H steps (``period``), fragment p first after ``(p + 1) H / P`` steps, so one fragment's
exchange is under way at a time: the peak bandwidth is the largest fragment's share of
DiLoCo's (1/P when the fragments are equal; see ``fragment_sizes`` of the runtime). For
fragment p, synchronised at the end of step s (1-based):

1. at the end of step ``s - tau``, its pseudo-gradient ``Delta_p = theta_p^global - theta_p``
   is computed and its average over the workers starts (in ``precision``: float32, bfloat16,
   int8 or int4);
2. the workers take the next ``tau`` inner steps while it travels;
3. at the end of step s the average is waited for, the outer optimizer steps the fragment's
   global copy, and the local fragment becomes ``alpha theta_p + (1 - alpha) theta_p^global``
   (``mixing``, the paper's alpha; 0: the global value, as DiLoCo).

With one fragment, ``tau`` 0, ``mixing`` 0 and float32 this is DiLoCo, its end included.

The average is a reduce-scatter and an all-gather made of two point-to-point exchanges (each
worker owns 1/n of the fragment: it receives everyone's part of it, adds them in rank order,
and sends the mean back to all). Its bytes are a ring all-reduce's, ``2 (n - 1) / n`` of the
fragment per worker, at the precision's width. It starts at once and progresses at each of the
runtime's hooks that finds the first exchange arrived, so on real processes the messages travel
while the workers compute; the wait comes ``tau`` steps later.

What gossamer adds to the paper:

- **Error feedback** of the quantisation: each worker keeps the error it made encoding its
  pseudo-gradient of a fragment (and, in int8 or int4, the owner of a chunk the error of the
  mean it sends) and adds it to what it next encodes of that fragment.
- **Uniform int4**: symmetric integers with one max-abs float32 scale per chunk
  (:mod:`gossamer.compress.lowbit`), where the paper uses the E3M0 4-bit float; also int8,
  bfloat16 and float32.
- **A synchronous warm-up** (``warmup_steps``): a plain exact average after each step before
  it; the fragments' schedule starts after it.
- **The final average** (``average_at_end``): after the last step the exchange in flight is
  taken in (its outer step and merge); then each fragment with inner steps since its last
  synchronisation takes one exact outer step (unquantised, mixing 0), and a fragment
  synchronised at the last step takes none: with ``mixing`` > 0 its replicas, which differ by
  the local share each kept, become their exact average. Every replica ends the same.
- **DiLoCo's options**: ``replica_size``; ``average_buffers`` (the floating-point buffers,
  averaged exactly at every fragment's synchronisation) and ``average_optimizer_state`` (the
  inner optimizer's state of a fragment's parameters, averaged exactly at its
  synchronisation).
- **Checkpoints mid-exchange**: the runtime's state holds the exchange in flight (the vector
  each worker sent, and its errors as they were before); a runtime that loads it sends the
  same payloads again at once (uncounted), so a resumed run is the uninterrupted one.

Under ``on_failure="continue"`` the members drop the exchange in flight (each one's
quantisation error goes back to what it was before it), take rank 0's global parameters and
outer optimizer, and make one exact outer step of every fragment over the new members; the
schedule goes on from the step (see :meth:`StreamingDiLoCoRuntime.change_membership`; a
restarted worker that rejoins: :meth:`StreamingDiLoCoRuntime.rejoin`).

Example::

    inner = torch.optim.AdamW(model.parameters(), lr=4e-4)
    optimizer = gossamer.distribute(model, inner, StreamingDiLoCo(
        period=100, fragments=4, tau=5, mixing=0.5, precision="int4"))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from gossamer.algorithms.base import average_tensors
from gossamer.algorithms.diloco import DiLoCo, DiLoCoRuntime
from gossamer.checks import check_int
from gossamer.comm.base import Communicator, CommunicatorBase
from gossamer.comm.buckets import apply_flat
from gossamer.comm.state import broadcast_object
from gossamer.compress.lowbit import PRECISIONS, LowBit
from gossamer.options import option
from gossamer.patterns.fragments import split_fragments
from gossamer.patterns.nonfinite import all_finite
from gossamer.patterns.scattered import ScatteredMean

PATTERNS = ("strided", "sequential")


@dataclass(frozen=True, kw_only=True)
class StreamingDiLoCo(DiLoCo):
    """Streaming DiLoCo (Douillard et al. 2025): DiLoCo in P fragments synchronised at
    staggered steps, each exchange overlapping ``tau`` inner steps, in low precision.

    Args:
        period: H, steps between two synchronisations of the same fragment (default 16);
            a multiple of ``fragments``.
        fragments: P, the number of fragments (default 4).
        pattern: how the fragments are made of whole layers (:func:`split_fragments`):
            ``"strided"`` (default, the paper's better pattern: the i-th block of a
            ``ModuleList`` or ``Sequential`` in fragment i mod P, the other layers where they
            keep the fragments balanced) or ``"sequential"`` (consecutive layers, cut at
            about equal sizes).
        tau: inner steps that a fragment's exchange overlaps (default 1); less than H / P.
        mixing: the paper's alpha: the local fragment becomes ``mixing * local + (1 - mixing)
            * global`` after its outer step (default 0.5).
        precision: of the pseudo-gradients on the wire: ``float32`` (unquantised: a float64
            model's travel in float64), ``bfloat16``, ``int8`` or ``int4`` (default ``int4``,
            the paper's 4 bits), with error feedback.
        warmup_steps: a plain exact average after each step before this one (synchronous
            training while the learning rate warms up); the fragments' schedule starts
            after it (default 0).
        average_at_end: after the last step, every replica the same: an exact outer step of
            each fragment with inner steps since its last synchronisation, none for one
            synchronised at the last step (default True; see
            :meth:`StreamingDiLoCoRuntime.average_parameters`).
        average_buffers, average_optimizer_state: the floating-point buffers, and the inner
            optimizer's state of a fragment's parameters, averaged exactly at each fragment's
            synchronisation (default False).
        (the outer optimizer, ``replica_size`` and the other options of :class:`DiLoCo`; the
        period is constant: ``alpha``, ``warmup_period`` and ``compression`` are not taken.)
    """

    name: ClassVar[str] = "streaming-diloco"
    continues_after_failure: ClassVar[bool] = True
    #: its pseudo-gradients travel in ``precision``, not through a compressor
    takes_compression: ClassVar[bool] = False

    period: int = option(16, "H: steps between two synchronisations of a fragment; a multiple "
                         "of fragments")
    fragments: int = option(4, "P: fragments, synchronised one after another every H / P "
                            "steps")
    pattern: str = option("strided", "strided: block i of the model in fragment i mod P; "
                          "sequential: consecutive layers")
    tau: int = option(1, "the paper's tau: inner steps each exchange overlaps; < H / P")
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

    def symmetric(self) -> bool:
        # every rank sends its all-to-all by offset (ScatteredMean): a rotation of rank 0's
        return True

    def bind(self, comm: Communicator, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> StreamingDiLoCoRuntime:
        self.validate(comm.world_size)
        return StreamingDiLoCoRuntime(self, comm, model, optimizer)


@dataclass
class Exchange:
    """A fragment's exchange in flight on this worker, with what starting it again needs."""

    fragment: int
    vector: torch.Tensor  # this worker's pseudo-gradient of the fragment, as it was sent
    sent_before: torch.Tensor | None  # its errors of the fragment before the exchange
    mean_before: torch.Tensor | None
    mean: ScatteredMean | None = None  # None: not started here (loaded from a state)
    #: its first messages were sent, and counted, before a checkpoint: sent again uncounted
    counted: bool = False


def _optimizer_state(optimizer: torch.optim.Optimizer,
                     params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The floating-point tensors of ``optimizer``'s state of ``params`` (momentum buffers,
    Adam's moments; not step counters), in their order."""
    return [value for p in params for value in optimizer.state.get(p, {}).values()
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0]


class StreamingDiLoCoRuntime(DiLoCoRuntime):
    """One worker of Streaming DiLoCo: its fragments, the exchange in flight, the errors."""

    def __init__(self, config: StreamingDiLoCo, comm: Communicator, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        super().__init__(config, comm, model, optimizer)
        self.config: StreamingDiLoCo = config
        sizes = [p.numel() for p in self.trained]
        self.fragment_indices = split_fragments(self.names, sizes, config.fragments,
                                                config.pattern)
        #: elements of each fragment: the largest is the peak of an exchange
        self.fragment_sizes = [sum(sizes[i] for i in f) for f in self.fragment_indices]
        self.codec = LowBit(config.precision)
        self.residuals: dict[Any, torch.Tensor] = {}  # this worker's encoding errors
        self.in_flight: Exchange | None = None
        # each fragment's last synchronisation: the steps done then, and whether each worker
        # kept a local share of it (mixing > 0), so that the replicas differ
        self.synced_after = [0] * config.fragments
        self.kept_local = [False] * config.fragments
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
            self._started().progress()

    @torch.no_grad()
    def after_step(self) -> None:
        done = self.step + 1
        if self.step < self.config.warmup_steps:  # synchronous: a plain average every step
            self.outer.warm_up(self.across)
            self._average_options(range(len(self.trained)))
            self._synced(range(self.config.fragments), done, kept_local=False)
            self.synchronizations += 1
            self.last_averaged = self.step
            return
        fragment, position = self._schedule(self.step - self.config.warmup_steps)
        slot = self.config.period // self.config.fragments
        self._progress()
        if position == slot - 1 - self.config.tau:
            self._prepare(fragment)
        if position == slot - 1:
            self._perform(fragment, done)

    def _prepare(self, fragment: int) -> None:
        indices = self.fragment_indices[fragment]
        if not indices:  # (fewer units than fragments): nothing to exchange in this slot
            return
        if not all_finite([self.trained[i] for i in indices]):
            raise self.nonfinite_error("parameters")
        deltas = self.outer.pseudo_gradients(indices)
        self.in_flight = Exchange(fragment, torch.cat([d.reshape(-1) for d in deltas]),
                                  self.residuals.get((fragment, "sent")),
                                  self.residuals.get((fragment, "mean")))
        try:
            self._started()
        except BaseException:  # (a send that failed at once: nothing of it is in flight)
            self._drop_exchange()
            raise

    def _started(self) -> ScatteredMean:
        """The exchange in flight, started now if it was not (loaded from a state): this
        worker's errors of the fragment as they were before it, the same vector, so the same
        payloads as the first time and the same mean."""
        exchange = self.in_flight
        assert exchange is not None
        if exchange.mean is None:
            fragment = exchange.fragment
            self._restore_errors(exchange)
            again = exchange.counted and isinstance(self.across, CommunicatorBase)
            with self.across.uncounted() if again else contextlib.nullcontext():
                exchange.mean = ScatteredMean(self.across, exchange.vector, self.codec,
                                              self.residuals, fragment)
        return exchange.mean

    def _restore_errors(self, exchange: Exchange) -> None:
        for kind, before in (("sent", exchange.sent_before), ("mean", exchange.mean_before)):
            if before is None:
                self.residuals.pop((exchange.fragment, kind), None)
            else:
                self.residuals[(exchange.fragment, kind)] = before

    def _drop_exchange(self) -> None:
        """Forget the exchange in flight, never waited on: this worker's errors of the
        fragment go back to what they were before it (what it sent will never be applied)."""
        if self.in_flight is not None:
            self._restore_errors(self.in_flight)
            self.in_flight = None

    def _perform(self, fragment: int, done: int) -> None:
        """Take in the fragment's exchange: its outer step and merge, after ``done`` steps."""
        if self.in_flight is None:
            # taken in early, by settle() or a membership change (which synchronised every
            # fragment at once since), or an empty fragment: nothing to synchronise here
            return
        assert self.in_flight.fragment == fragment
        mean = self._started().wait()
        self.in_flight = None
        indices = self.fragment_indices[fragment]
        sizes = [self.trained[i].numel() for i in indices]
        self._outer_step(indices, torch.split(mean, sizes), self.config.mixing)
        self._average_options(indices)
        self._synced([fragment], done, kept_local=self.config.mixing > 0)
        self.fragment_syncs[fragment] += 1
        self.synchronizations += 1
        self.last_averaged = self.step

    def _outer_step(self, indices: Sequence[int], averaged: Sequence[torch.Tensor],
                    mixing: float) -> None:
        """The outer step of the parameters ``indices`` with their averaged pseudo-gradients,
        then each local value becomes ``mixing * local + (1 - mixing) * global``."""
        self.outer.step(indices, averaged)
        for i in indices:
            local, global_ = self.trained[i], self.outer.global_params[i]
            local.copy_(global_.detach().lerp(local, mixing))

    def _average_options(self, indices: Sequence[int]) -> None:
        """What the options average exactly at a synchronisation of the parameters
        ``indices``: every floating-point buffer (``average_buffers``) and the inner
        optimizer's state of those parameters (``average_optimizer_state``). Collective."""
        tensors = []
        if self.config.average_buffers:
            tensors += [b for b in self.model.buffers() if torch.is_floating_point(b)]
        if self.config.average_optimizer_state:
            tensors += _optimizer_state(self.optimizer, [self.trained[i] for i in indices])
        if tensors:
            average_tensors(self.comm, tensors)

    def _synced(self, fragments: Iterable[int], done: int, kept_local: bool) -> None:
        for fragment in fragments:
            self.synced_after[fragment] = done
            self.kept_local[fragment] = kept_local

    @torch.no_grad()
    def settle(self) -> None:
        """Take in the fragment's exchange in flight (its outer step and merge)."""
        if self.in_flight is not None:
            self._perform(self.in_flight.fragment, self.step)

    @torch.no_grad()
    def finish(self) -> None:
        """Take in the exchange in flight; then, with ``average_at_end``, make every replica
        the same (:meth:`average_parameters`)."""
        self.settle()
        if self.config.average_at_end:
            self.average_parameters()

    def _replicas_equal(self) -> bool:
        """Not known from the last synchronisation: a fragment's leaves the others as they
        are (an evaluation's re-estimation averages the parameters first)."""
        return False

    @torch.no_grad()
    def average_parameters(self) -> None:
        """Every replica the same, as the fragments' schedule would have it: after the last
        step, and before restarted workers join. Collective.

        The exchange in flight is taken in first. Then each fragment with inner steps since
        its last synchronisation takes one outer step, exact (unquantised, mixing 0: every
        worker holds its global value), and a fragment synchronised since the last inner step
        takes none (an outer step on a pseudo-gradient of zero would still move it by the outer
        momentum); where each worker kept a local share of it (``mixing`` > 0), the replicas
        become their exact average. One all-reduce for both; nothing where nothing differs."""
        self.settle()
        done, fragments = self.step, range(self.config.fragments)
        due = [p for p in fragments if self.synced_after[p] < done]
        mixed = [p for p in fragments if p not in due and self.kept_local[p]]
        stepped = [i for p in due for i in self.fragment_indices[p]]
        merged = [i for p in mixed for i in self.fragment_indices[p]]
        if stepped or merged:
            self._exact(stepped, merged)
            self.synchronizations += 1
            self.last_averaged = self.step
        self._synced(due + mixed, done, kept_local=False)

    def _exact(self, stepped: Sequence[int], merged: Sequence[int]) -> None:
        """An outer step of the parameters ``stepped`` with their exact mean pseudo-gradient
        (mixing 0), the replicas of ``merged`` set to their exact mean, in one all-reduce;
        then what the options average for ``stepped``. Collective."""
        if not all_finite([self.trained[i] for i in [*stepped, *merged]]):
            raise self.nonfinite_error("parameters")
        deltas = self.outer.pseudo_gradients(stepped)
        apply_flat(deltas + [self.trained[i].data for i in merged],
                   lambda buffer: self.across.all_reduce(buffer, op="mean"))
        if deltas:
            self._outer_step(stepped, deltas, 0.0)
        self._average_options(stepped)

    def _keep_own_errors(self) -> None:
        """Of this worker's errors, those of its own pseudo-gradients, without the old size's
        padding; those of the means it owned (chunks of the old ranks) are dropped."""
        kept = {}
        for (fragment, kind), error in self.residuals.items():
            size = self.fragment_sizes[fragment]
            if kind == "sent" and error.numel() >= size:
                kept[(fragment, kind)] = error[:size].clone()
        self.residuals = kept

    @torch.no_grad()
    def change_membership(self, comm: Communicator, algorithm: Any) -> None:
        """Go on over the members of ``comm`` (``on_failure="continue"``; ``replica_size``
        must divide their number).

        1. The fragment's exchange in flight is dropped, never waited on: its messages
           travel over the old communicator, whose members are no longer those that must
           answer. Each member's quantisation errors of that fragment go back to what they
           were before the exchange (what it sent will never be applied), and the errors of
           the means each member kept for its chunk (chunks of the old ranks) are dropped;
           the errors of its own pseudo-gradients are kept, without the old size's padding.
        2. The groups are rebuilt for the new members, and the global parameters and the
           outer optimizer's state of the member of rank 0 are sent to every member (a
           failure in the middle of an exchange may have let some members take in a
           fragment's outer step that the others did not).
        3. An outer step of every fragment at once over the members, exact (unquantised,
           ``mixing`` 0): each fragment's pseudo-gradient since its last synchronisation
           reaches the global parameters as it would have at its own synchronisation, and
           every member continues from the same global parameters. During the warm-up
           (``warmup_steps``): a plain exact average.

        The fragments' schedule goes on from the step: a fragment whose exchange was dropped
        is not synchronised at its scheduled end (the outer step above took it in); the next
        starts at its usual step. The dead worker's share of the dropped exchange is lost.
        """
        self._drop_exchange()
        self._keep_own_errors()
        self._reconnect(comm, algorithm)
        self._share_outer(comm)
        if self.step < self.config.warmup_steps:
            if not all_finite(self.trained):
                raise self.nonfinite_error("parameters")
            self.outer.warm_up(self.across)
            self._average_options(range(len(self.trained)))
        else:
            self._exact(range(len(self.trained)), [])
        self._synced(range(self.config.fragments), self.step, kept_local=False)
        self.synchronizations += 1
        self.last_averaged = self.step - 1

    @torch.no_grad()
    def rejoin(self, comm: Communicator, algorithm: Any) -> None:
        """Go on over ``comm`` once restarted workers joined the members: as
        :meth:`change_membership` without its outer step and without sharing the outer state.

        Every worker holds one state already: the members took in the exchange in flight and
        made every replica the same (:meth:`settle`, :meth:`average_parameters`), then one of
        them gave its state to every worker. A second outer step, on a pseudo-gradient of
        zero, would still move the parameters by the outer momentum. So only what depends on
        the ranks is rebuilt: the groups, and each member's errors (those of its own
        pseudo-gradients kept, those of the means of old chunks dropped). A worker that
        rejoins received a member's state without its errors (:meth:`load_state_dict`): it
        starts with none."""
        self._drop_exchange()  # (none: the members settled before sharing their state)
        self._keep_own_errors()
        self._reconnect(comm, algorithm)
        self.last_averaged = self.step - 1

    def _share_outer(self, comm: Communicator) -> None:
        """The global parameters and the outer optimizer's state of the member of rank 0,
        on every member (a fragment never synchronised has no outer state yet).
        Collective."""
        state = broadcast_object(comm, 0, self.outer.state_dict() if comm.rank == 0 else None)
        if comm.rank != 0:
            self.outer.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        """Also the exchange in flight, if any: its fragment, the vector this worker sent and
        its errors of the fragment as they were before (see :meth:`load_state_dict`)."""
        state = {**super().state_dict(), "fragment_syncs": list(self.fragment_syncs),
                 "synced_after": list(self.synced_after), "kept_local": list(self.kept_local),
                 "residuals": [[list(k), v.clone()] for k, v in sorted(
                     self.residuals.items(), key=lambda item: repr(item[0]))],
                 # whose errors these are: a worker's rank and the number of workers, and
                 # the fragments they are of
                 "residuals_of": [self.comm.rank, self.comm.world_size],
                 "fragment_sizes": list(self.fragment_sizes)}
        if self.in_flight is not None:
            exchange = self.in_flight
            state["in_flight"] = {"fragment": exchange.fragment,
                                  "vector": exchange.vector.clone()}
            for key, before in (("sent_before", exchange.sent_before),
                                ("mean_before", exchange.mean_before)):
                if before is not None:
                    state["in_flight"][key] = before.clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Also each worker's quantisation errors and its exchange in flight, when the state
        is its own (saved at the same rank of as many workers, with the same fragments): a
        worker that rejoins receives a member's state, and starts with no errors of its own
        instead of that member's. An exchange in flight starts again at once, before the next
        step's compute, with the same payloads, uncounted (they were counted before the
        checkpoint): every worker must load its own state (a resumed run, collective), and
        the run goes on as the one that saved it."""
        super().load_state_dict(state)
        count = self.config.fragments
        self.fragment_syncs = [int(x) for x in state["fragment_syncs"]]
        # (a state of an earlier version: every fragment takes an outer step at the end)
        self.synced_after = [int(x) for x in state.get("synced_after", [-1] * count)]
        self.kept_local = [bool(x) for x in state.get("kept_local", [False] * count)]
        owner = state.get("residuals_of")
        own = (owner is None or [int(x) for x in owner] == [self.comm.rank,
                                                            self.comm.world_size]) \
            and [int(x) for x in state.get("fragment_sizes", [])] == self.fragment_sizes
        self.residuals = ({(int(k[0]), str(k[1])): v.clone() for k, v in state["residuals"]}
                          if own else {})
        self.in_flight = None
        saved = state.get("in_flight")
        if saved is not None and own:
            def before(key: str) -> torch.Tensor | None:
                return saved[key].clone() if saved.get(key) is not None else None

            self.in_flight = Exchange(int(saved["fragment"]), saved["vector"].clone(),
                                      before("sent_before"), before("mean_before"),
                                      counted=True)
            # sent again now, as the run that saved it had sent it before its next step
            self._started()
