"""NoLoCo: DiLoCo's rounds with no collective at all; at each outer step every worker averages
with one random peer, and a modified Nesterov step pulls each replica towards its pair.

Kolehmainen, Blagoev, Donaghy, Ersoy, Nies, "NoLoCo: No-all-reduce Low Communication Training
Method for Large Models" (2025, arXiv 2506.10911), its modified Nesterov outer step. Each worker i
keeps its own slow weights ``phi_i`` and outer momentum ``Delta_i``; it takes H steps of its
inner optimizer from ``phi_i`` to ``theta_i``, and then, with the group G it is drawn into
(:class:`~gossamer.topology.RandomPairs`: two workers, the same draw on every worker):

    delta_j   = phi_j - theta_j                                       each one's pseudo-gradient
    Delta_i  <- alpha Delta_i - beta mean_G(delta) - gamma (phi_i - mean_G(phi))
    phi_i    <- phi_i + Delta_i,   theta_i <- phi_i

With ``gamma = 0`` and G every worker this is DiLoCo with heavy-ball outer momentum; the
gamma term draws the pair's slow weights together, which keeps the replicas close without an
all-reduce. Summed over a group the gamma terms cancel: the mean of every worker's ``phi`` and
``Delta`` moves exactly as DiLoCo's global parameters and momentum would on the mean of every
worker's pseudo-gradient (``tests/test_noloco.py`` checks it).

Here the update is the outer SGD of :mod:`gossamer.algorithms.outer` (learning rate beta,
momentum alpha, no Nesterov) stepping on ``mean_G(delta) + (gamma / beta) (phi_i -
mean_G(phi))``: torch's momentum buffer is ``-Delta_i / beta``, the same recursion. Each worker
sends its slow weights and its pseudo-gradient to its peer, as the authors' code does: twice
the model per outer step, whatever the number of workers.

Defaults: the authors' configurations of NoLoCo (jkolehm/noloco, ``configs/no_reduce_exp``,
the ``*noloco_mean*`` files, ``SparseOptimizerC``): H = 50, groups of 2, outer learning rate
0.7, outer momentum 0.5, and ``gamma = beta`` as their ``sparse_optimizer_c.outer_step``
computes (``consensus = gamma / beta = 1``).

What this library adds: the Quadratic Synchronization Rule for the period (DiLoCo's
``alpha``, ``power`` and ``warmup``; the paper's alpha is ``outer_momentum``); replicas of
several workers (``replica_size``: the pairs are then drawn between replicas); an odd number
of workers (a group of three); checkpoints (each worker's slow weights and momentum);
continuing after a failure (the members average exactly once, then pair among themselves);
sharded models (the pair's mean and the outer step are element-wise).

Example::

    inner = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1)
    optimizer = gossamer.distribute(model, inner, NoLoCo(period=50))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from gossamer.algorithms.base import Algorithm, average_tensors
from gossamer.algorithms.diloco import DiLoCo, DiLoCoRuntime
from gossamer.algorithms.local_sgd import LocalSGD, optimizer_state_tensors
from gossamer.algorithms.outer import OuterStep, check_replicas, check_replicas_divide
from gossamer.algorithms.rounds import QSR_WARMUPS, QuadraticRule, RoundSchedule
from gossamer.checks import check_choice, check_int, check_positive
from gossamer.comm.base import Communicator
from gossamer.comm.buckets import apply_flat
from gossamer.options import option, option_of
from gossamer.patterns.nonfinite import all_finite
from gossamer.patterns.pairwise import group_mean
from gossamer.topology.pairing import RandomPairs

__all__ = ["NoLoCo", "NoLoCoRuntime"]


@dataclass(frozen=True, kw_only=True)
class NoLoCo(Algorithm):
    """NoLoCo (Kolehmainen et al. 2025): rounds of H inner steps, then an outer step in which
    each worker averages with one random peer, its outer momentum pulled towards the pair.

    Args:
        period: H, inner steps per round (default 50, the authors'); H_base when
            ``alpha > 0``.
        outer_lr: beta, the outer learning rate (default 0.7, the authors').
        outer_momentum: alpha of the paper, the outer momentum (default 0.5, the authors').
        consensus: gamma / beta, the weight of the pull of each worker's slow weights towards
            its pair's mean (default 1: gamma = beta, the authors' code); 0: none.
        alpha, power, warmup: the Quadratic Synchronization Rule of the period, as
            :class:`DiLoCo`'s (default ``alpha`` 0: a constant period).
        replica_size, bucket_mb: as :class:`DiLoCo`'s: the members of a replica all-reduce
            their gradients every step, and the pairs are drawn between replicas.
        reestimate_batchnorm: as :class:`LocalSGD`'s.
        average_at_end: an outer step with the pair after the last step if it did not end a
            round (default True), as DiLoCo's. The replicas end apart either way: the
            evaluation measures their average.
    """

    name: ClassVar[str] = "noloco"
    continues_after_failure: ClassVar[bool] = True
    #: DiLoCo's runtime reads these; NoLoCo sends nothing but the pair's exchange
    compression: ClassVar[None] = None
    average_optimizer_state: ClassVar[bool] = False
    average_buffers: ClassVar[bool] = False
    warmup_steps: ClassVar[int] = 0
    warmup_period: ClassVar[int] = 1

    period: int = option(
        50, "H: inner steps per outer step (the authors' 50); H_base when alpha > 0"
    )
    outer_lr: float = option(0.7, "beta: the outer learning rate (the authors' 0.7)")
    outer_momentum: float = option(0.5, "the paper's alpha: the outer momentum (the authors' 0.5)")
    consensus: float = option(
        1.0,
        "gamma / beta: the pull of each worker's slow weights "
        "towards its pair's mean (1: gamma = beta, the authors'); 0: none",
    )
    alpha: float = option_of(DiLoCo, "alpha")
    power: float = option_of(DiLoCo, "power")
    warmup: str = option(
        "steps",
        'with alpha > 0: "rising_lr": H_base while the lr rises; "steps": no warm-up '
        "(NoLoCo makes no synchronous one)",
    )
    replica_size: int = option(
        1,
        "workers per replica: they all-reduce gradients every step, "
        "and the pairs are drawn between replicas",
    )
    bucket_mb: float = option_of(DiLoCo, "bucket_mb")
    reestimate_batchnorm: int = option_of(LocalSGD, "reestimate_batchnorm")
    average_at_end: bool = option(
        True,
        "an outer step with the pair after the last step if it did not end a round "
        "(the run's length unknown), so that no inner step is left out",
    )

    # the world size resolve() was given (0: not resolved): whether the pairing is symmetric
    _resolved_for: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        QuadraticRule(self.period, self.alpha, self.power)  # its checks, also with alpha 0
        self.schedule  # noqa: B018 - its checks name the options
        self.outer_step  # noqa: B018
        check_positive("consensus", self.consensus, allow_zero=True)
        check_choice("warmup", self.warmup, QSR_WARMUPS)
        check_int("reestimate_batchnorm", self.reestimate_batchnorm, 0)
        check_replicas(self.replica_size, self.bucket_mb)

    @property
    def schedule(self) -> RoundSchedule:
        """How long each round lasts: DiLoCo's rule, without its synchronous warm-up."""
        return DiLoCo.schedule.fget(self)  # type: ignore[attr-defined]

    @property
    def outer_step(self) -> OuterStep:
        """The outer SGD of learning rate beta and momentum alpha (heavy-ball, the paper's
        ``phi + Delta`` form)."""
        return OuterStep(
            outer="sgd",
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
            outer_nesterov=False,
        )

    def validate(self, world_size: int) -> None:
        check_replicas_divide(self.replica_size, world_size)

    def resolve(self, world_size: int) -> NoLoCo:
        """This configuration for ``world_size`` workers, which :meth:`symmetric` reads."""
        self.validate(world_size)
        if self._resolved_for == world_size:
            return self
        resolved = dataclasses.replace(self)
        object.__setattr__(resolved, "_resolved_for", world_size)
        return resolved

    def symmetric(self) -> bool:
        # every worker sends to one peer and receives from it in each call, at the same time:
        # an even number of replicas (an odd one makes a group of three), or one (no peer)
        replicas = self._resolved_for // self.replica_size
        return replicas == 1 or (replicas > 0 and replicas % 2 == 0)

    def sharding_refusal(self) -> str | None:
        return None  # the pair's mean and the outer step are element-wise

    def bind(
        self, comm: Communicator, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> NoLoCoRuntime:
        self.validate(comm.world_size)
        return NoLoCoRuntime(self, comm, model, optimizer)


class NoLoCoRuntime(DiLoCoRuntime):
    """One worker of NoLoCo: DiLoCo's rounds (and replicas), its all-reduce replaced by the
    mean over a random pair and its outer step by NoLoCo's."""

    def __init__(
        self, config: NoLoCo, comm: Communicator, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> None:
        super().__init__(config, comm, model, optimizer)  # type: ignore[arg-type]
        self.config: NoLoCo = config  # type: ignore[assignment]
        # the momentum buffers exist from the start (zero: torch's first step gives the same
        # buffer), so that every worker's state has the same tensors after any failure
        if config.outer_momentum > 0:
            for g in self.outer.global_params:
                self.outer.optimizer.state[g]["momentum_buffer"] = torch.zeros_like(g)

    def _connect(self, comm: Communicator) -> None:
        super()._connect(comm)
        self.pairs = RandomPairs(self.across.world_size)

    def _average(self) -> None:
        """The outer step that ends a round (in ``after_step``: ``step + 1`` steps done)."""
        self._outer_step(self.step + 1)

    @torch.no_grad()
    def _outer_step(self, done: int) -> None:
        """NoLoCo's outer step with this worker's group, drawn from the ``done`` steps."""
        if not all_finite(self.trained):
            raise self.nonfinite_error("parameters")
        indices = list(range(len(self.trained)))
        deltas = self.outer.pseudo_gradients(indices)  # phi_i - theta_i
        means = [g.detach().clone() for g in self.outer.global_params] + deltas
        group = self.pairs.group(self.across.rank, done)
        apply_flat(means, lambda buffer: group_mean(self.across, [buffer], group))
        consensus = self.config.consensus
        for i, delta in enumerate(deltas):  # mean_G(delta) + (gamma / beta)(phi_i - mean_G(phi))
            delta.add_(self.outer.global_params[i] - means[i], alpha=consensus)
        self.outer.step(indices, deltas)
        for p, g in zip(self.trained, self.outer.global_params, strict=True):
            p.copy_(g)
        self.synchronizations += 1
        self.last_averaged = done - 1

    def _replicas_equal(self) -> bool:
        return False  # NoLoCo's outer step leaves every pair's replicas apart

    @torch.no_grad()
    def average_parameters(self) -> None:
        """The exact average over every worker (one all-reduce) of the parameters, the slow
        weights and the outer momentum: the replicas then hold one state. For a restarted
        worker's admission and the members after a failure."""
        tensors = [p.data for p in self.trained] + [g.data for g in self.outer.global_params]
        average_tensors(self.comm, tensors + optimizer_state_tensors(self.outer.optimizer))
        self.synchronizations += 1

    def finish(self) -> None:
        """An outer step over the last round if it did not end at the last step (and the
        run had a step)."""
        if self.config.average_at_end and self.step > 0 and self.last_averaged != self.step - 1:
            self._outer_step(self.step)

    @torch.no_grad()
    def change_membership(self, comm: Communicator, algorithm: Any) -> None:
        """The replicas' groups and the pairing rebuilt for the new members, which average
        exactly (:meth:`average_parameters`): a member whose outer step the failure cut goes
        on from the same state as the others. The next step starts a round."""
        self._reconnect(comm, algorithm)
        self.average_parameters()
        self._start_afresh()
