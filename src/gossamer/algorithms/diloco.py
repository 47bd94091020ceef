"""DiLoCo: H local steps of any inner optimizer, then one step of an outer optimizer on the
averaged pseudo-gradient.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models" (2023,
arXiv 2311.08105), Algorithm 1. Every worker starts a round from the global parameters
``theta^(t-1)``, takes H steps of its inner optimizer (AdamW in the paper; any ``torch.optim``
optimizer here, the one given to :func:`gossamer.distribute`) on its own data, and then

    Delta^(t) = (1/k) sum_i (theta^(t-1) - theta_i^(t))      the averaged pseudo-gradient
    theta^(t) = OuterOpt(theta^(t-1), Delta^(t))              (SGD, Nesterov, lr 0.7, mom. 0.9)

and every worker continues from ``theta^(t)``. The inner optimizer's state stays local. With
an outer SGD of learning rate 1 and no momentum, ``theta^(t)`` is the average of the workers'
parameters: local SGD.

What this library adds to the paper:

- **The period** H is constant (``period``) or follows the Quadratic Synchronization Rule from
  the inner learning rate (``alpha > 0``: ``H = max(period, floor((alpha / lr) ** power))``,
  see :class:`~gossamer.algorithms.QSR`), with the same warm-up options; the last round is cut
  to end at the last step when the number of steps is known.
- **Compression**: the pseudo-gradients can go through any compressor of the library
  (``compression="topk:ratio=0.01"``, ...) with its error feedback: what a worker did not
  send is added to its next pseudo-gradient.
- **Replicas of several workers** (``replica_size`` R > 1): consecutive ranks form a replica
  whose members all-reduce their gradients after every backward pass, so that it trains as one
  data-parallel replica (torchft's replica groups); DiLoCo runs between the replicas. The
  members of a replica hold the same parameters, so each worker all-reduces the
  pseudo-gradient only with the workers of the same position in the other replicas.
  (``group_size``, this option's old name, is read with a note for one more release.)

- **Overlapped outer steps** (``overlap``), Kale, Douillard, Donchev, "Eager Updates For
  Overlapped Communication and Computation in DiLoCo" (2025, arXiv 2502.12996): the average of
  round t's pseudo-gradients travels during round t + 1's inner steps
  (:class:`OverlappedDiLoCoRuntime`). ``"delayed"``: the paper's naive delayed outer gradients
  (its Algorithm 2), ``theta^(t) = OuterOpt(theta^(t-1), Delta^(t-1))``, every worker alike.
  ``"eager"``: the paper's eager updates (its Algorithm 3), each worker m stepping at once with
  its own fresh pseudo-gradient for its share and the others' of the round before,
  ``OuterOpt(theta_m^(t-1), (1/k) Delta_m^(t) + (1/k) sum_{j != m} Delta_j^(t-1))``, so every
  worker's pseudo-gradient enters once with weight 1/k. With one worker the eager form is
  DiLoCo.

The global parameters and the outer optimizer's state are part of the runtime's state, so
checkpoints hold them.

Example::

    inner = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1)
    optimizer = gossamer.distribute(model, inner, DiLoCo(period=500))
    # any outer optimizer (Python): a factory over the global parameters
    DiLoCo(period=50, outer_optimizer=lambda params: torch.optim.Adam(params, lr=1e-3))
    # the outer all-reduce hidden behind the next round, eager updates
    DiLoCo(period=500, overlap="eager")
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torch import nn

from gossamer.algorithms.allreduce import AllReduce, AllReduceRuntime, compression_argument
from gossamer.algorithms.base import Algorithm, average_tensors
from gossamer.algorithms.local_sgd import (
    QSR,
    LocalSGD,
    LocalSGDRuntime,
    optimizer_state_refusal,
    optimizer_state_tensors,
)
from gossamer.algorithms.outer import (
    OuterFactory,
    OuterState,
    OuterStep,
    check_replicas,
    check_replicas_divide,
    group_communicators,
)
from gossamer.algorithms.rounds import (
    QSR_WARMUPS,
    ConstantPeriod,
    PeriodRule,
    QuadraticRule,
    RoundSchedule,
)
from gossamer.checks import check_choice, check_int
from gossamer.comm.base import Communicator
from gossamer.comm.buckets import apply_flat
from gossamer.comm.state import broadcast_object
from gossamer.compress.lowbit import LowBit
from gossamer.compress.reducer import CompressedReducer
from gossamer.compress.registry import Compression, DGCCompression
from gossamer.options import option, option_of
from gossamer.patterns.nonfinite import all_finite
from gossamer.patterns.scattered import MeanInFlight

#: the choices of DiLoCo's ``overlap``: the paper's blocking outer step, the delayed and the
#: eager forms of arXiv 2502.12996
OVERLAPS = ("none", "delayed", "eager")


@dataclass(frozen=True, kw_only=True)
class DiLoCo(Algorithm):
    """DiLoCo (Douillard et al. 2023): rounds of H inner steps, then an outer optimizer step
    on the pseudo-gradient averaged over the workers (or groups).

    Args:
        period: H, inner steps per round (default 16); H_base when ``alpha > 0``.
        alpha: 0 (default): a constant period; > 0: the period follows the Quadratic
            Synchronization Rule from the inner learning rate (see :class:`QSR`, ``power``).
        outer, outer_lr, outer_momentum, outer_nesterov, outer_optimizer: the outer step
            (:class:`~gossamer.algorithms.outer.OuterStep`, :attr:`outer_step`): a
            ``torch.optim`` class name (default ``"sgd"``), its learning rate (0.7), SGD's
            momentum (0.9) and Nesterov (True), the paper's; or a Python factory
            ``params -> torch.optim.Optimizer`` over the global parameters instead.
        compression: a compressor spec for the pseudo-gradients, ``"topk:ratio=0.01"`` (see
            :mod:`gossamer.compress.registry`), with its error feedback (default None: the
            exact float32 average). DGC's memory is a gradient method's and is refused.
        replica_size: workers per replica (default 1: every worker is a replica of its own);
            the members of a replica all-reduce gradients every step (``bucket_mb`` per
            collective).
        bucket_mb: MiB per gradient all-reduce inside a replica (default 25).
        overlap: ``"none"`` (default): the outer step waits for the all-reduce (the paper's
            DiLoCo); ``"delayed"``: the all-reduce of a round's pseudo-gradients runs during
            the next round and its average is applied one round late; ``"eager"``: each
            worker steps at once with its own pseudo-gradient standing in for its share
            (arXiv 2502.12996; :class:`OverlappedDiLoCoRuntime`). Not with ``compression``
            nor ``on_failure="continue"``.
        warmup_steps: rounds that start before this step last ``warmup_period`` steps (1)
            and end with a plain exact average, no outer step: synchronous training while the
            learning rate warms up, as the paper's DiLoCo starts from a model trained
            synchronously (default 0: none). The parameters are averaged after each worker's
            own step: exactly synchronous training for SGD, close to it for AdamW, whose
            moments stay each worker's own.
        power, warmup: the rule's, as :class:`QSR`'s (with ``alpha > 0``).
        warmup_period, average_optimizer_state (the inner state, averaged at each outer
            step), average_buffers, reestimate_batchnorm, average_at_end (an outer step after
            the last step if it did not end a round): as :class:`LocalSGD`'s.

    The rounds' lengths are :attr:`schedule`'s (:mod:`gossamer.algorithms.rounds`): a
    constant period, or with ``alpha > 0`` the Quadratic Synchronization Rule, after the
    warm-up, the last round cut to end at the last step.
    """

    name: ClassVar[str] = "diloco"
    continues_after_failure: ClassVar[bool] = True
    renamed_options: ClassVar[Mapping[str, str]] = MappingProxyType(
        {"group_size": "replica_size"})

    period: int = option(16, "H: inner steps per outer step; H_base when alpha > 0")
    warmup_steps: int = option(0, "rounds starting before this step last warmup_period steps "
                               "and end with a plain average (synchronous warm-up), no outer "
                               "step")
    warmup_period: int = option_of(LocalSGD, "warmup_period")
    average_optimizer_state: bool = option_of(LocalSGD, "average_optimizer_state")
    average_buffers: bool = option_of(LocalSGD, "average_buffers")
    reestimate_batchnorm: int = option_of(LocalSGD, "reestimate_batchnorm")
    average_at_end: bool = option_of(LocalSGD, "average_at_end")
    alpha: float = option(0.0, "0: constant period; > 0: the QSR rule from the inner lr, "
                          "H = max(period, floor((alpha / lr) ** power))")
    power: float = option_of(QSR, "power")
    warmup: str = option_of(QSR, "warmup")
    outer: str = option_of(OuterStep, "outer")
    outer_lr: float = option_of(OuterStep, "outer_lr")
    outer_momentum: float = option_of(OuterStep, "outer_momentum")
    outer_nesterov: bool = option_of(OuterStep, "outer_nesterov")
    outer_optimizer: OuterFactory | None = option_of(OuterStep, "outer_optimizer")
    compression: Compression | str | None = option(
        None, "pseudo-gradients through a compressor spec NAME[:KEY=VALUE...], with its error "
        "feedback (topk, randomk, qsgd, powersgd, fp16); none: the exact float32 average")
    replica_size: int = option(1, "workers per replica: they all-reduce gradients every step, "
                               "and DiLoCo runs between the replicas")
    bucket_mb: float = option(25.0, "MiB per gradient all-reduce inside a replica")
    overlap: str = option("none", "none: the outer step waits for the all-reduce; delayed: "
                          "the all-reduce runs during the next round, its average applied "
                          "one round late; eager: each worker steps at once with its own "
                          "pseudo-gradient for its share (arXiv 2502.12996)")

    def __post_init__(self) -> None:
        check_rounds(self)
        check_choice("overlap", self.overlap, OVERLAPS)
        if self.overlap != "none" and self.compression is not None:
            raise ValueError(f"overlap={self.overlap!r} sends the exact float32 average; "
                             "compression is taken only with overlap='none'")
        if self.compression is not None:
            compression = compression_argument(self.compression)
            if isinstance(compression, DGCCompression):
                raise ValueError("compression: dgc's memory takes over a gradient optimizer's "
                                 "momentum; use topk, randomk, qsgd, powersgd or fp16 for "
                                 "pseudo-gradients")
            object.__setattr__(self, "compression", compression)

    @property
    def schedule(self) -> RoundSchedule:
        """How long each round lasts."""
        rule: PeriodRule = ConstantPeriod(self.period) if self.alpha == 0 else QuadraticRule(
            self.period, self.alpha, self.power, self.warmup == "rising_lr")
        return RoundSchedule(rule, self.warmup_steps, self.warmup_period, cap_to_end=True)

    @property
    def outer_step(self) -> OuterStep:
        """The outer optimizer that the ``outer*`` options name."""
        return OuterStep.of(self)

    def symmetric(self) -> bool:
        return True  # the same all-reduces on every worker (and on every group)

    def validate(self, world_size: int) -> None:
        check_replicas_divide(self.replica_size, world_size)

    def sharding_refusal(self) -> str | None:
        if self.overlap != "none":
            return f"overlap={self.overlap!r}: not proven on local shards yet"
        return optimizer_state_refusal(self)

    def failure_refusal(self) -> str | None:
        if self.overlap != "none":
            return (f"diloco's overlap={self.overlap!r} does not go on without a failed "
                    "worker (its all-reduce in flight spans the old members); use "
                    "overlap='none'")
        return None

    def bind(self, comm: Communicator, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> DiLoCoRuntime:
        self.validate(comm.world_size)
        if self.overlap != "none":
            return OverlappedDiLoCoRuntime(self, comm, model, optimizer)
        return DiLoCoRuntime(self, comm, model, optimizer)


def check_rounds(config: Any) -> None:
    """The checks of the options of DiLoCo's rounds, outer step and replicas, for the methods
    that take them (DiLoCo, SparseLoCo, MuLoCo): each ValueError names the option."""
    QuadraticRule(config.period, config.alpha, config.power)  # its checks, also with alpha 0
    config.schedule  # noqa: B018 - its checks name the options
    check_int("reestimate_batchnorm", config.reestimate_batchnorm, 0)
    check_choice("warmup", config.warmup, QSR_WARMUPS)
    config.outer_step  # noqa: B018
    check_replicas(config.replica_size, config.bucket_mb)


class DiLoCoRuntime(LocalSGDRuntime):
    """One worker of DiLoCo: the rounds of local SGD, an outer step where they average."""

    def __init__(self, config: DiLoCo, comm: Communicator, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        super().__init__(config, comm, model, optimizer)
        self.config: DiLoCo = config
        self.trained = [p for p in model.parameters() if p.requires_grad]
        self.names = [name for name, p in model.named_parameters() if p.requires_grad]
        self.outer = OuterState(config.outer_step, self.trained)
        self._connect(comm)

    def _connect(self, comm: Communicator) -> None:
        """The group, the communicator across the groups and the compressor over it, for
        the workers of ``comm``."""
        config = self.config
        self.group, self.across = group_communicators(comm, config.replica_size)
        # the group's gradient all-reduce: a group trains as one data-parallel replica
        self.inner: AllReduceRuntime | None = None
        if self.group is not None:
            self.inner = AllReduce(bucket_mb=config.bucket_mb).bind(self.group, self.model,
                                                                    self.optimizer)
        self.reducer: CompressedReducer | None = None
        compression = self._compression()
        if compression is not None:
            compressor, memory = compression.build(self.across.world_size)
            self.reducer = CompressedReducer(self.across, compressor, memory,
                                             bucket_bytes=int(config.bucket_mb * 2**20))

    def _compression(self) -> Compression | None:
        """What the pseudo-gradients travel through (None: the exact average)."""
        compression = self.config.compression
        return compression if isinstance(compression, Compression) else None

    def start(self, **kwargs: Any) -> None:
        super().start(**kwargs)
        if self.inner is not None:
            self.inner.start(nonfinite=self.nonfinite)

    @torch.no_grad()
    def change_membership(self, comm: Communicator, algorithm: Any) -> None:
        """The groups (``replica_size`` must divide the new world size) and the compression
        (its memory emptied) rebuilt for the new members; the members agree on the global
        parameters and the outer optimizer (:meth:`_agree_on_outer`); then an outer step over
        them. Collective over ``comm``."""
        self._reconnect(comm, algorithm)
        self._agree_on_outer(comm)
        super().change_membership(comm, algorithm)

    @torch.no_grad()
    def _agree_on_outer(self, comm: Communicator) -> None:
        """The global parameters and the outer optimizer of the member that took in the most
        outer steps (the lowest rank among them) on every member. A failure during an outer
        step's all-reduce may have let some members take it in and not others, and the global
        parameters would then differ for good; a member that missed it had sent its
        pseudo-gradient into it, so it goes on from the step's global parameters, as the
        others did. Collective over ``comm``."""
        device = self.trained[0].device if self.trained else None
        counts = [int(c.reshape(-1)[0]) for c in comm.all_gather(
            torch.tensor([self.synchronizations], dtype=torch.int64, device=device))]
        if min(counts) == max(counts):  # every member took in the same outer steps
            return
        source = counts.index(max(counts))
        state = broadcast_object(comm, source,
                                 self.outer.state_dict() if comm.rank == source else None)
        if self.synchronizations < counts[source]:
            self.outer.load_state_dict(state)
            for p, g in zip(self.trained, self.outer.global_params, strict=True):
                p.copy_(g)
            self.synchronizations = counts[source]

    @torch.no_grad()
    def rejoin(self, comm: Communicator, algorithm: Any) -> None:
        """The groups and the compression rebuilt as at :meth:`change_membership`, without its
        outer step: the members made one over themselves before their state was shared (one
        outer step per round, as in the paper; a second, on a pseudo-gradient of zero, would
        still move the parameters by the outer momentum)."""
        self._reconnect(comm, algorithm)
        super().rejoin(comm, algorithm)

    def _reconnect(self, comm: Communicator, algorithm: Any) -> None:
        """Over the workers of ``comm``: the communicator, the groups (``replica_size`` must
        divide the new world size) and the compression (its memory emptied)."""
        algorithm.validate(comm.world_size)
        self.comm = comm
        self._connect(comm)
        if self.inner is not None:
            self.inner.start(nonfinite=self.nonfinite)

    def check_gradients(self) -> None:
        if self.inner is None:
            super().check_gradients()
            return
        self.inner.overflow = self.overflow
        self.inner.check_gradients()
        self.skip_update = self.inner.skip_update

    def after_backward(self) -> None:
        if self.inner is not None:
            self.inner.step = self.step
            self.inner.after_backward()
            self.skip_update = self.inner.skip_update

    @torch.no_grad()
    def average_parameters(self) -> None:
        """An outer step over the round so far (collective), unless the replicas were
        synchronised after the step before this one (a round's end, a membership change):
        every worker holds the global parameters then, and an outer step on that zero
        pseudo-gradient would still move them by the outer momentum."""
        if not self._replicas_equal():
            self._average()

    @torch.no_grad()
    def _average(self) -> None:
        """The outer step: average the pseudo-gradients, step the global parameters, and
        continue every worker from them."""
        if not all_finite(self.trained):
            raise self.nonfinite_error("parameters")
        if self.periods and self.periods[-1][0] < self.config.warmup_steps:
            self.outer.warm_up(self.across)  # a plain average: synchronous training
        else:
            indices = list(range(len(self.trained)))
            deltas = self.outer.pseudo_gradients(indices)
            self.reduce(deltas)
            self.outer.step(indices, deltas)
            for p, g in zip(self.trained, self.outer.global_params, strict=True):
                p.copy_(g)
        self._average_extras()
        self.synchronizations += 1
        self.last_averaged = self.step

    def _average_extras(self) -> None:
        """What ``average_buffers`` and ``average_optimizer_state`` average exactly at a
        round's end: the floating-point buffers, the inner optimizer's state. Collective."""
        extra = []
        if self.config.average_buffers:
            extra += [b for b in self.model.buffers() if torch.is_floating_point(b)]
        if self.config.average_optimizer_state:
            extra += optimizer_state_tensors(self.optimizer)
        if extra:
            average_tensors(self.comm, extra)

    def reduce(self, deltas: list[torch.Tensor]) -> None:
        """Replace each pseudo-gradient by its average over the groups, in place."""
        if self.reducer is not None:
            self.reducer.reduce(list(zip(self.names, deltas, strict=True)),
                                self.synchronizations)
        else:
            apply_flat(deltas, lambda buffer: self.across.all_reduce(buffer, op="mean"))

    def state_dict(self) -> dict[str, Any]:
        state = {**super().state_dict(), **self.outer.state_dict()}
        if self.reducer is not None:
            state["compression"] = self.reducer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.outer.load_state_dict(state)
        if self.reducer is not None:
            self.reducer.load_state_dict(state["compression"])


class OverlappedDiLoCoRuntime(DiLoCoRuntime):
    """One worker of DiLoCo whose outer all-reduce overlaps the next round (``overlap``
    ``"delayed"`` or ``"eager"``), Kale, Douillard, Donchev (2025, arXiv 2502.12996).

    At the end of round t each worker computes ``Delta_m^(t) = theta_m^(t-1) - theta_m`` and
    starts its average over the replicas (:class:`~gossamer.patterns.scattered.MeanInFlight`,
    exact, float32 or the model's float64: a reduce-scatter and an all-gather of
    point-to-point exchanges, a ring all-reduce's bytes, that travel while the next round
    computes); the average of round t - 1, started a round ago, is taken in first. Then:

    - ``"delayed"``: ``theta^(t) = OuterOpt(theta^(t-1), mean Delta^(t-1))`` (no step after the
      first round: nothing has arrived); every worker alike.
    - ``"eager"``: ``theta_m^(t) = OuterOpt(theta_m^(t-1), Delta_m^(t) / k + mean Delta^(t-1) -
      Delta_m^(t-1) / k)``: this worker's fresh pseudo-gradient for its share, the others' of
      the round before for theirs (k the replicas); the workers' global copies differ by
      their last own share.

    Every worker continues from its global parameters. At the end (:meth:`finish`) an open
    round ends as the others, and the average in flight is taken in: ``"delayed"``, its outer
    step; ``"eager"``, an outer step with the others' share of it, then the replicas are
    averaged exactly, so that every worker ends with the same parameters. A checkpoint holds
    the average in flight (this worker's vector): loaded on every worker, it starts again at
    once with the same payloads, uncounted, and the run goes on as the one that saved it."""

    config: DiLoCo

    def __init__(self, config: DiLoCo, comm: Communicator, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        super().__init__(config, comm, model, optimizer)
        self.means = MeanInFlight(LowBit("float32"))
        self.sizes = [p.numel() for p in self.trained]

    def before_forward(self) -> None:
        self.means.progress(self.across)

    def after_backward(self) -> None:
        super().after_backward()
        self.means.progress(self.across)

    def _replicas_equal(self) -> bool:
        """After a round's end the replicas are equal, except under the eager form with
        several replicas: each stepped with its own share."""
        return super()._replicas_equal() and (self.config.overlap == "delayed"
                                              or self.across.world_size == 1)

    def _apply(self, delta: torch.Tensor, keep_local: bool = False) -> None:
        """An outer step with the flat ``delta``; every worker continues from the result, or
        (``keep_local``, inside a round) moves by as much as the global parameters did, so
        that the round's pseudo-gradient so far stays what it was."""
        indices = list(range(len(self.trained)))
        before = [g.detach().clone() for g in self.outer.global_params] if keep_local else []
        self.outer.step(indices, torch.split(delta, self.sizes))
        for i, (p, g) in enumerate(zip(self.trained, self.outer.global_params, strict=True)):
            if keep_local:
                p.add_(g - before[i])
            else:
                p.copy_(g)

    @torch.no_grad()
    def _average(self) -> None:
        """A round's end: the last round's average taken in, this round's started, the outer
        step of the form."""
        if self.periods and self.periods[-1][0] < self.config.warmup_steps:
            super()._average()  # a plain average: synchronous training, nothing in flight
            return
        if not all_finite(self.trained):
            raise self.nonfinite_error("parameters")
        own = torch.cat([d.reshape(-1) for d in self.outer.pseudo_gradients(
            range(len(self.trained)))])
        before = self._take()
        self.means.start(self.across, 0, own)
        k = self.across.world_size
        if self.config.overlap == "delayed":
            if before is not None:
                self._apply(before[1])
            else:  # the first round: nothing has arrived, every worker starts it again
                for p, g in zip(self.trained, self.outer.global_params, strict=True):
                    p.copy_(g)
        elif before is None:
            self._apply(own / k)
        else:
            self._apply(own / k + (before[1] - before[0] / k))
        self._average_extras()
        self.synchronizations += 1
        self.last_averaged = self.step

    def _take(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(this worker's vector, the mean) of the average in flight, waited for; None if
        none is."""
        exchange = self.means.in_flight
        if exchange is None:
            return None
        return exchange.vector, self.means.take(self.across)

    @torch.no_grad()
    def settle(self) -> None:
        """Take in the average in flight: ``"delayed"``, its outer step; ``"eager"``, an
        outer step with the others' share of it (none with one replica: it has none), then
        the replicas, which differ by their own shares, averaged exactly. Inside a round
        (steps since its start) each worker keeps its progress of the round, moved by as
        much as the global parameters, and no replica is averaged: the round goes on."""
        before = self._take()
        if before is None:
            return
        k = self.across.world_size
        if self.config.overlap == "eager" and k == 1:
            return
        own, mean = before
        inside = self.last_averaged != self.step - 1
        self._apply(mean if self.config.overlap == "delayed" else mean - own / k, inside)
        self.synchronizations += 1
        if inside:
            return
        if self.config.overlap == "eager":
            apply_flat(self.trained, lambda buffer: self.across.all_reduce(buffer, op="mean"))
            for p, g in zip(self.trained, self.outer.global_params, strict=True):
                g.copy_(p)
        self.last_averaged = self.step - 1

    @torch.no_grad()
    def average_parameters(self) -> None:
        """Every replica the same: an open round ends as every round does, then the average
        in flight is taken in (:meth:`settle`). Collective."""
        if self.last_averaged != self.step - 1:
            self._average()
            self.last_averaged = self.step - 1  # (after the steps: the last one's)
        self.settle()

    def finish(self) -> None:
        """With ``average_at_end``, :meth:`average_parameters`; otherwise the average in
        flight is taken in."""
        if self.config.average_at_end:
            self.average_parameters()
        else:
            self.settle()

    def change_membership(self, comm: Communicator, algorithm: Any) -> None:
        raise ValueError(self.config.failure_refusal())

    def rejoin(self, comm: Communicator, algorithm: Any) -> None:
        raise ValueError(self.config.failure_refusal())

    def state_dict(self) -> dict[str, Any]:
        """Also the average in flight, if any: the vector this worker sent."""
        return {**super().state_dict(), **self.means.state_dict(),
                "in_flight_of": [self.across.rank, self.across.world_size]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Also the average in flight, when the state is this worker's own (saved at the same
        rank of as many replicas): it starts again at once, before the next step's compute,
        with the same payload, uncounted; every worker must load its own state (a resumed
        run, collective)."""
        super().load_state_dict(state)
        owner = [int(x) for x in state.get("in_flight_of", [])]
        own = owner == [self.across.rank, self.across.world_size]
        if state.get("in_flight") is not None and not own:
            raise ValueError("overlap: this state holds another worker's average in flight; "
                             "resume every worker from its own state")
        self.means.load_state_dict(state, self.across, own)
