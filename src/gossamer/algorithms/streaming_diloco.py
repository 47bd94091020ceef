"""Streaming DiLoCo: DiLoCo whose fragments synchronise at staggered steps, each exchange
overlapping the next ``tau`` inner steps, in low precision.

Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a Distributed Free
Lunch" (2025, arXiv 2501.18512), Algorithm 2, and torchft's ``DiLoCo`` with fragments. The
model is split into P fragments (``fragments``) of whole layers (:func:`split_fragments`:
``pattern="strided"``, the paper's better pattern, puts the i-th block of a ``ModuleList`` or
``Sequential`` (a transformer block) in fragment i mod P, as the paper's Fig. 2;
``"sequential"`` cuts consecutive layers at about equal sizes; by the whole tensors' sizes,
so that a sharded model's ranks cut it as the unsharded model is cut, see
:mod:`gossamer.patterns.parts`). Each fragment is synchronised
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

What gossamer adds to the paper (docs/algorithms.md says each in full): error feedback of the
quantisation; uniform int4 (one max-abs scale per chunk, where the paper uses E3M0 floats), and
int8, bfloat16, float32; a synchronous warm-up (``warmup_steps``); a final average that leaves
every replica the same (``average_at_end``); DiLoCo's ``replica_size``, ``average_buffers``
and ``average_optimizer_state``; checkpoints mid-exchange (the exchange in flight starts again
with the same payloads, so a resumed run is the uninterrupted one); and going on without a
failed worker (``on_failure="continue"``: :meth:`StreamingDiLoCoRuntime.change_membership`,
:meth:`StreamingDiLoCoRuntime.rejoin`).

Example::

    inner = torch.optim.AdamW(model.parameters(), lr=4e-4)
    optimizer = gossamer.distribute(model, inner, StreamingDiLoCo(
        period=100, fragments=4, tau=5, mixing=0.5, precision="int4"))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torch import nn

from gossamer.algorithms.base import Algorithm
from gossamer.algorithms.diloco import DiLoCo
from gossamer.algorithms.local_sgd import LocalSGD, optimizer_state_refusal
from gossamer.algorithms.outer import (
    OuterFactory,
    OuterStep,
    check_replicas,
    check_replicas_divide,
)
from gossamer.algorithms.rounds import ConstantPeriod, RoundSchedule
from gossamer.algorithms.streaming_fragments import FragmentRuntime
from gossamer.checks import check_choice, check_int
from gossamer.comm.base import Communicator
from gossamer.compress.lowbit import PRECISIONS
from gossamer.options import ANY_VALUE, option, option_of
from gossamer.patterns.nonfinite import all_finite

PATTERNS = ("strided", "sequential")


@dataclass(frozen=True, kw_only=True)
class StreamingDiLoCo(Algorithm):
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
        reestimate_batchnorm: as :class:`~gossamer.algorithms.LocalSGD`'s.
        outer, outer_lr, outer_momentum, outer_nesterov, outer_optimizer, replica_size,
            bucket_mb: as :class:`DiLoCo`'s (the outer step:
            :class:`~gossamer.algorithms.outer.OuterStep`).

    DiLoCo's ``alpha``, ``power``, ``warmup``, ``warmup_period`` and ``compression`` are not
    options of this method (a constant period, its own precision); files written when it
    accepted them at their defaults still load, with a note.
    """

    name: ClassVar[str] = "streaming-diloco"
    continues_after_failure: ClassVar[bool] = True
    renamed_options: ClassVar[Mapping[str, str]] = DiLoCo.renamed_options
    retired_options: ClassVar[Mapping[str, tuple[Any, str]]] = MappingProxyType({
        "alpha": (0.0, "a constant period; use diloco for QSR"),
        "warmup_period": (1, "the warm-up averages every step"),
        "compression": (None, "its pseudo-gradients travel in precision"),
        "power": (ANY_VALUE, "a constant period: QSR's exponent had no effect"),
        "warmup": (ANY_VALUE, "a constant period: QSR's warm-up rule had no effect")})

    period: int = option(16, "H: steps between two synchronisations of a fragment; a multiple "
                         "of fragments")
    warmup_steps: int = option(0, "a plain exact average after each step before this one "
                               "(synchronous warm-up); the fragments' schedule starts after it")
    average_optimizer_state: bool = option_of(LocalSGD, "average_optimizer_state")
    average_buffers: bool = option_of(LocalSGD, "average_buffers")
    reestimate_batchnorm: int = option_of(LocalSGD, "reestimate_batchnorm")
    average_at_end: bool = option_of(LocalSGD, "average_at_end")
    outer: str = option_of(OuterStep, "outer")
    outer_lr: float = option_of(OuterStep, "outer_lr")
    outer_momentum: float = option_of(OuterStep, "outer_momentum")
    outer_nesterov: bool = option_of(OuterStep, "outer_nesterov")
    outer_optimizer: OuterFactory | None = option_of(OuterStep, "outer_optimizer")
    replica_size: int = option_of(DiLoCo, "replica_size")
    bucket_mb: float = option_of(DiLoCo, "bucket_mb")
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
        self.schedule  # noqa: B018 - its checks name the options
        check_int("reestimate_batchnorm", self.reestimate_batchnorm, 0)
        self.outer_step  # noqa: B018
        check_replicas(self.replica_size, self.bucket_mb)
        check_int("fragments", self.fragments, 1)
        check_int("tau", self.tau, 0)
        if self.period % self.fragments:
            raise ValueError(f"period={self.period} must be a multiple of fragments="
                             f"{self.fragments}")
        if self.tau >= self.period // self.fragments:
            raise ValueError(f"tau={self.tau} must be less than period / fragments = "
                             f"{self.period // self.fragments}: a fragment's exchange must end "
                             "before the next one starts")
        check_choice("pattern", self.pattern, PATTERNS)
        if not (isinstance(self.mixing, (int, float)) and not isinstance(self.mixing, bool)
                and 0 <= self.mixing <= 1):
            raise ValueError(f"mixing must be a number in [0, 1], got {self.mixing!r}")
        check_choice("precision", self.precision, PRECISIONS)

    @property
    def schedule(self) -> RoundSchedule:
        """Each fragment's rounds: H steps after a warm-up of rounds of one step (the runtime
        staggers the fragments)."""
        return RoundSchedule(ConstantPeriod(self.period), self.warmup_steps, 1, cap_to_end=True)

    @property
    def outer_step(self) -> OuterStep:
        """The outer optimizer that the ``outer*`` options name."""
        return OuterStep.of(self)

    def validate(self, world_size: int) -> None:
        check_replicas_divide(self.replica_size, world_size)

    def sharding_refusal(self) -> str | None:
        """None, but for ``average_optimizer_state``: the fragments are cut by the whole
        tensors' sizes, so a sharded model's are the unsharded one's, each rank holding its
        shards of them; a fragment's pseudo-gradients are quantised per shard (``int4``,
        ``int8``: one scale per shard's message)."""
        return optimizer_state_refusal(self)

    def symmetric(self) -> bool:
        # every rank sends its all-to-all by offset (ScatteredMean): a rotation of rank 0's
        return True

    def bind(self, comm: Communicator, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> StreamingDiLoCoRuntime:
        self.validate(comm.world_size)
        return StreamingDiLoCoRuntime(self, comm, model, optimizer)


class StreamingDiLoCoRuntime(FragmentRuntime):
    """One worker of Streaming DiLoCo: the fragments' staggered schedule, each exchange
    started ``tau`` steps before its outer step (:class:`FragmentRuntime` holds the
    fragments, the exchange in flight and the errors)."""

    config: StreamingDiLoCo

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
        self.means.progress(self.across)

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
        self.means.start(self.across, fragment, torch.cat([d.reshape(-1) for d in deltas]))

    def _perform(self, fragment: int, done: int) -> None:
        """Take in the fragment's exchange: its outer step and merge, after ``done`` steps."""
        if self.in_flight is None:
            # taken in early, by settle() or a membership change (which synchronised every
            # fragment at once since), or an empty fragment: nothing to synchronise here
            return
        assert self.in_flight.fragment == fragment
        mean = self.means.take(self.across)
        indices = self.fragment_indices[fragment]
        sizes = [self.trained[i].numel() for i in indices]
        self._outer_step(indices, torch.split(mean, sizes), self.config.mixing)
        self._average_options(indices)
        self._synced([fragment], done, kept_local=self.config.mixing > 0)
        self.fragment_syncs[fragment] += 1
        self.synchronizations += 1
        self.last_averaged = self.step

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
