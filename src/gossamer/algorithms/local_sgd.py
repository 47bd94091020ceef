"""Local SGD: every worker steps its own optimizer; after each round of H steps the replicas
are averaged.

A round starts at step ``s`` (0-based: ``s`` steps done), lasts H steps, and ends with an
exact average after its last step, ``s + H - 1``; the next round starts at ``s + H``. H is
chosen when the round starts:

- in the warm-up (``s < warmup_steps``): H = ``warmup_period`` (default 1: an average after
  every step, post-local SGD);
- constant (``localsgd``): H = ``period``;
- the Quadratic Synchronization Rule (``qsr``): ``H = max(period, floor((alpha / lr) ** power))``
  with ``lr`` the learning rate of step ``s``, the round's first step, so H grows as the
  learning rate decays; capped by the steps left, when the number of steps is known, so that
  the last step averages. ``warmup="rising_lr"`` instead holds H at ``period`` while the
  learning rate still rises.

These are Lin et al.'s rounds of H local steps and the QSR authors' code (their
``LocalOptimizer``: ``init_h`` while ``step < warmup_steps``, then the rule). torch's
``PeriodicModelAverager`` averages after step ``warmup_steps`` and every H steps from there;
with its ``warmup_steps = H - 1`` it averages at the same steps as ``LocalSGD(period=H)``.

Only parameters are averaged (and the optimizer state, if asked: momentum, Adam's moments).
BatchNorm running statistics stay local and are re-estimated before each evaluation, on
training batches of each worker with its current parameters, then averaged, as in the QSR
code; ``average_buffers=True`` averages them with the parameters at every average instead.
Works with any ``torch.optim`` optimizer: Local AdamW is local SGD around AdamW.

References: Lin, Stich, Patel, Jaggi, "Don't Use Large Mini-Batches, Use Local SGD" (ICLR
2020); Gu, Lyu, Arora, Zhang, Huang, "A Quadratic Synchronization Rule for Distributed Deep
Learning" (ICLR 2024).

Example::

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer = gossamer.distribute(model, optimizer, QSR(period=2, alpha=0.01), comm)
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from gossamer.algorithms.base import Algorithm, Runtime, average_tensors
from gossamer.algorithms.rounds import QSR_WARMUPS, ConstantPeriod, QuadraticRule, RoundSchedule
from gossamer.checks import check_choice, check_int
from gossamer.comm.base import Communicator
from gossamer.options import option
from gossamer.patterns.nonfinite import all_finite


@dataclass(frozen=True, kw_only=True)
class LocalSGD(Algorithm):
    """Local SGD with a constant averaging period.

    Args:
        period: H, the steps of a round: an average after every H steps (default 4).
            1 averages after every step.
        warmup_steps: rounds that start before this step last ``warmup_period`` steps
            (default 0). Set it to the learning-rate warm-up's length, as the QSR code does.
        warmup_period: H in the warm-up (default 1: average every step, post-local SGD).
        average_optimizer_state: also average the optimizer's floating-point state, e.g.
            momentum buffers or Adam's moments (default False: they stay local).
        average_buffers: also average floating-point buffers (BatchNorm statistics) at every
            average (default False: parameters only; the statistics are re-estimated before
            evaluation, see ``reestimate_batchnorm``).
        reestimate_batchnorm: before each evaluation, re-estimate BatchNorm statistics on this
            many minibatches of each worker's training data, with its current parameters,
            and average them over the workers (default 8; 0: never). The runtime needs
            training inputs for it: ``gossamer train`` gives them (``training_inputs``).
        average_at_end: exact average after the last step (default True).

    The rounds' lengths are :attr:`schedule`'s, a :class:`~gossamer.algorithms.rounds.
    RoundSchedule` of a constant period.
    """

    name: ClassVar[str] = "localsgd"
    continues_after_failure: ClassVar[bool] = True

    period: int = option(4,
                         "H_base; higher: fewer averages, fewer bytes, more drift between replicas")
    warmup_steps: int = option(0, "rounds starting before this step last warmup_period steps")
    warmup_period: int = option(1, "H in the warm-up; 1: every step (post-local SGD)")
    average_optimizer_state: bool = option(False, "also average momentum / Adam moments")
    average_buffers: bool = option(False, "True: BatchNorm statistics averaged with the parameters")
    reestimate_batchnorm: int = option(8, "minibatches per worker to re-estimate them before eval")
    average_at_end: bool = option(True, "all replicas equal after the last step")

    def __post_init__(self) -> None:
        self.schedule  # noqa: B018 - its checks name the options
        check_int("reestimate_batchnorm", self.reestimate_batchnorm, 0)

    @property
    def schedule(self) -> RoundSchedule:
        """How long each round lasts."""
        return RoundSchedule(ConstantPeriod(self.period), self.warmup_steps, self.warmup_period)

    def symmetric(self) -> bool:
        return True  # the same all-reduces on every worker (and on every group)

    def sharding_refusal(self) -> str | None:
        return optimizer_state_refusal(self)

    def bind(self, comm: Communicator, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> LocalSGDRuntime:
        return LocalSGDRuntime(self, comm, model, optimizer)


@dataclass(frozen=True, kw_only=True)
class QSR(LocalSGD):
    """Local SGD whose period follows the Quadratic Synchronization Rule: a round starting
    at a step with learning rate ``lr`` lasts ``H = max(period, floor((alpha / lr) ** power))``.

    The rule is a :class:`~gossamer.algorithms.rounds.QuadraticRule`; rounds are capped by
    the steps left, so that the last step averages.

    Args:
        period: H_base, the smallest period (default 2).
        alpha: the rule's scale (default 0.01): H exceeds H_base once lr < alpha / H_base^(1/power).
        power: the exponent (default 2, the quadratic rule).
        warmup: what keeps the rule off while the learning rate warms up (default
            ``"steps"``: the rounds starting before ``warmup_steps`` last ``warmup_period``
            steps, as in the QSR code; set ``warmup_steps`` to the learning-rate warm-up).
            ``"rising_lr"``: also H = H_base for a round whose learning rate is higher than
            the previous round's, and for the first round (no length to set).
        (and the options of :class:`LocalSGD`)
    """

    name: ClassVar[str] = "qsr"

    period: int = option(2, "H_base, the shortest period; higher: fewer averages")
    alpha: float = option(0.01, "higher: longer periods at the same learning rate")
    power: float = option(2.0, "2: the quadratic rule; 1: a linear one")
    warmup: str = option("steps",
                         "\"steps\": warmup_steps; \"rising_lr\": H_base while the lr rises")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("warmup", self.warmup, QSR_WARMUPS)

    @property
    def schedule(self) -> RoundSchedule:
        rule = QuadraticRule(self.period, self.alpha, self.power, self.warmup == "rising_lr")
        return RoundSchedule(rule, self.warmup_steps, self.warmup_period, cap_to_end=True)


class RoundsConfig(Protocol):
    """What :class:`LocalSGDRuntime` reads of its configuration (LocalSGD's, QSR's, DiLoCo's
    and Streaming DiLoCo's)."""

    @property
    def schedule(self) -> RoundSchedule: ...
    @property
    def average_optimizer_state(self) -> bool: ...
    @property
    def average_buffers(self) -> bool: ...
    @property
    def reestimate_batchnorm(self) -> int: ...
    @property
    def average_at_end(self) -> bool: ...


class LocalSGDRuntime(Runtime):
    """One worker of local SGD and the state of its averaging schedule."""

    def __init__(self, config: RoundsConfig, comm: Communicator, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        super().__init__(comm, model, optimizer)
        self.config = config
        self.schedule = config.schedule
        # internal state
        self.next_average: int | None = None  # the current round's last step; None: none yet
        self.current_period = 0  # H of the current round
        self.last_averaged = -1  # the last step that averaged
        self.last_lr: float | None = None  # the learning rate of the last round's first step
        # statistics
        self.periods: list[tuple[int, int]] = []  # (first step of a round, its H)

    def _steps_left(self) -> int | None:
        """Steps from this one to the end, this one included (None: unknown)."""
        return None if self.total_steps is None else self.total_steps - self.step

    @torch.no_grad()
    def after_step(self) -> None:
        step = self.step
        if self.next_average is None:  # this step starts a round: its H, from its lr
            self._start_round(step)
        if step == self.next_average:
            self._average()
            self.next_average = None

    def _start_round(self, step: int) -> None:
        lr = float(self.optimizer.param_groups[0]["lr"])
        period = self.schedule.period(step, lr, self.last_lr, self._steps_left())
        self.last_lr = lr
        self.current_period = period
        self.next_average = step + period - 1
        self.periods.append((step, period))

    def _average(self) -> None:
        """The round's exact average: the parameters, and what the options add."""
        tensors = self._parameter_tensors()
        if self.config.average_optimizer_state:
            tensors += optimizer_state_tensors(self.optimizer)
        self._exact_average(tensors)
        self.last_averaged = self.step

    def _parameter_tensors(self) -> list[torch.Tensor]:
        """The parameters, and the floating-point buffers under ``average_buffers``."""
        tensors = [p.data for p in self.model.parameters()]
        if self.config.average_buffers:
            tensors += [b for b in self.model.buffers() if torch.is_floating_point(b)]
        return tensors

    def _exact_average(self, tensors: list[torch.Tensor]) -> None:
        """Replace ``tensors`` by their mean over the workers: one synchronisation."""
        # checked before they are sent: only here, since local steps send nothing
        if not all_finite(tensors):
            raise self.nonfinite_error("parameters")
        average_tensors(self.comm, tensors)
        self.synchronizations += 1

    @torch.no_grad()
    def prepare_eval(self) -> None:
        """Re-estimate BatchNorm statistics (``reestimate_batchnorm``), when the training loop
        gave training inputs, for the model that is evaluated: the average of the replicas.
        Every worker estimates them on its own inputs with the averaged parameters (inside a
        round the replicas differ), they are averaged, and each worker goes on with its own
        parameters. For the evaluation only: training in train mode never reads the
        statistics, and the next evaluation estimates them afresh. Right after a round's
        average the replicas are equal: only the statistics are all-reduced. Collective."""
        count = self.config.reestimate_batchnorm
        if not count or self.training_inputs is None or not batchnorm_layers(self.model):
            return
        if self._replicas_equal():  # the average is every worker's own parameters
            reestimate_batchnorm(self.comm, self.model, self.training_inputs(count))
            return
        params = [p.data for p in self.model.parameters()]
        own = [p.clone() for p in params]
        average_tensors(self.comm, params)
        try:
            reestimate_batchnorm(self.comm, self.model, self.training_inputs(count))
        finally:
            for p, mine in zip(params, own, strict=True):
                p.copy_(mine)

    def _replicas_equal(self) -> bool:
        """Whether every worker's parameters are the same now: the step before this one
        ended a round (its exact average), or a membership change averaged them."""
        return self.last_averaged == self.step - 1

    def finish(self) -> None:
        if self.config.average_at_end and not self._replicas_equal():
            self.average_parameters()

    @torch.no_grad()
    def average_parameters(self) -> None:
        """The exact average, of what the options say (buffers, optimizer state)."""
        self._average()

    @torch.no_grad()
    def change_membership(self, comm: Communicator, algorithm: Algorithm) -> None:
        """The members average now; the next step starts a round."""
        self.comm = comm
        self._average()
        self._start_afresh()

    def rejoin(self, comm: Communicator, algorithm: Algorithm) -> None:
        """The workers, old and new, hold the members' exact average already: no average
        again (it would count a second synchronisation); the next step starts a round."""
        self.comm = comm
        self._start_afresh()

    def _start_afresh(self) -> None:
        """After the average that ends the step before this one: the next step starts a
        round (and ``finish()`` knows that this step's predecessor averaged)."""
        self.last_averaged = self.step - 1
        self.next_average = None

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "next_average": self.next_average,
                "current_period": self.current_period, "last_averaged": self.last_averaged,
                "last_lr": self.last_lr,
                "periods": [list(p) for p in self.periods]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        next_average = state["next_average"]
        self.next_average = None if next_average is None else int(next_average)
        self.current_period = int(state["current_period"])
        self.last_averaged = int(state["last_averaged"])
        last_lr = state.get("last_lr")
        self.last_lr = None if last_lr is None else float(last_lr)
        self.periods = [(int(a), int(b)) for a, b in state["periods"]]


def optimizer_state_refusal(config: RoundsConfig) -> str | None:
    """Why a method of rounds does not run on a sharded model (None: it does, averaging the
    local shards of the parameters): ``average_optimizer_state``, whose state is then made of
    DTensors, which the average does not take apart yet."""
    if config.average_optimizer_state:
        return ("average_optimizer_state=True: the optimizer's state of a sharded model is "
                "made of DTensors, which its average does not take yet; leave it False")
    return None


def optimizer_state_tensors(optimizer: torch.optim.Optimizer,
                            params: Sequence[torch.Tensor] | None = None,
                            keys: Collection[str] | None = None) -> list[torch.Tensor]:
    """The floating-point tensors of the optimizer's per-parameter state (momentum buffers,
    Adam's moments) of ``params`` (default: all of its parameters), in their order, each
    parameter's in the order of its state; step counters and other scalars are left out.
    ``keys``: only the states of these names (``"exp_avg"``, ...; default: all)."""
    if params is None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
    return [value for p in params for key, value in optimizer.state.get(p, {}).items()
            if (keys is None or key in keys) and isinstance(value, torch.Tensor)
            and value.is_floating_point() and value.dim() > 0]


def batchnorm_layers(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The BatchNorm layers of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


@torch.no_grad()
def reestimate_batchnorm(comm: Communicator, model: nn.Module,
                         batches: Iterable[torch.Tensor]) -> bool:
    """Recompute BatchNorm running statistics of ``model`` from ``batches`` (an iterable of
    inputs, only read when there is a BatchNorm layer), as the cumulative average over them,
    then average them over the workers.

    Collective. Returns False (and does nothing) when the model has no BatchNorm layer.
    Reference: the BatchNorm estimation of Gu et al.'s code (ICLR 2024), which sets the
    momentum of the i-th batch to 1 / (1 + i) and then averages the running means and
    variances over the workers.
    """
    norms = batchnorm_layers(model)
    if not norms:
        return False
    saved = [(m, m.momentum) for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative moving average: every batch weighs the same
    was_training = model.training
    model.train()
    for x in batches:
        model(x)
    model.train(was_training)
    for m, momentum in saved:
        m.momentum = momentum
    average_tensors(comm, [b for m in norms for b in (m.running_mean, m.running_var)])
    return True
