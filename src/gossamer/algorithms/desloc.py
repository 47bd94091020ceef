"""DES-LOC: Local Adam whose parameters, first moments and second moments are averaged on
periods of their own.

Iacob, Sani, Safaryan, Giampouras, Horváth, Jovanović, Kurmanji, Aleksandrov, Shen, Qiu,
Lane, "DES-LOC: Desynced Low Communication Adaptive Optimizers for Training Foundation
Models" (2025, arXiv 2505.22549), Algorithm 1. Every worker steps its own optimizer (Adam or
AdamW: Local Adam); the parameters are averaged every K_x steps, the first moments
(``exp_avg``) every K_u steps and the second moments (``exp_avg_sq``) every K_v steps. The
moments change more slowly than the parameters (their half-lives, ``ln 0.5 / ln beta``, are
long), so they can be averaged less often: the paper recommends ``K_u = 3 K_x`` and
``K_v = 6 K_x``, the defaults here, which send half of Local Adam's bytes (Local Adam averages
all three every K_x steps: 3 / K_x models a step against 1.5 / K_x).

Each of the three follows rounds as local SGD's do (:mod:`gossamer.algorithms.rounds`): a
round of K steps ends with the exact average after its last step, so a state is averaged
after 0-based steps K - 1, 2K - 1, ... (the paper writes ``t mod K = 0`` on a counter of
steps done, the same steps). Where several end at one step they travel in one all-reduce.
The parameters' period can follow the Quadratic Synchronization Rule (``alpha > 0``) and a
warm-up, as local SGD's; the moments' periods are constant. With ``K_u = K_v = K_x`` this is
:class:`~gossamer.algorithms.LocalSGD` with ``average_optimizer_state=True``, bit for bit.

The moments are read from the torch optimizer's state: Adam's and AdamW's ``exp_avg`` and
``exp_avg_sq``. The method is a family (any optimizer's states on periods of their own): SGD's
momentum buffer is a first moment too, averaged every K_u steps (there is no second). An
optimizer with neither (SGD without momentum) is refused, naming ``optimizer``. The paper's
per-coordinate gradient clipping (for its theory) is not the method's: clip in the training
loop where it is wanted.

Example::

    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    optimizer = gossamer.distribute(model, inner, DESLOC(period=16), comm)
    # parameters every 16 steps, exp_avg every 48, exp_avg_sq every 96
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from gossamer.algorithms.base import Algorithm
from gossamer.algorithms.local_sgd import (
    LocalSGD,
    LocalSGDRuntime,
    optimizer_state_tensors,
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
from gossamer.options import option, option_of

#: The moments DES-LOC averages on periods of their own, and the names of the torch
#: optimizers' states that hold them (Adam/AdamW; SGD's momentum buffer is a first moment).
MOMENTS: dict[str, tuple[str, ...]] = {
    "first": ("exp_avg", "momentum_buffer"),
    "second": ("exp_avg_sq",),
}
#: The paper's ratios of the moments' periods to the parameters': K_u = 3 K_x, K_v = 6 K_x.
PERIOD_RATIOS = {"first": 3, "second": 6}


@dataclass(frozen=True, kw_only=True)
class DESLOC(Algorithm):
    """DES-LOC: Local Adam with parameters, first and second moments averaged every K_x,
    K_u and K_v steps.

    Args:
        period: K_x, the steps between averages of the parameters (default 16, DiLoCo's H,
            so that the two compare at equal parameter periods); H_base when ``alpha > 0``.
        momentum_period: K_u, the steps between averages of the first moments (default None:
            ``3 * period``, the paper's ratio).
        variance_period: K_v, the steps between averages of the second moments (default None:
            ``6 * period``, the paper's ratio).
        alpha: 0 (default): a constant K_x; > 0: K_x follows the Quadratic Synchronization
            Rule, ``max(period, floor((alpha / lr) ** power))``, the last round cut to end at
            the last step.
        power, warmup: the rule's, as :class:`~gossamer.algorithms.QSR`'s.
        warmup_steps, warmup_period, average_buffers, reestimate_batchnorm, average_at_end:
            as :class:`~gossamer.algorithms.LocalSGD`'s, for the parameters' rounds (the
            moments keep their periods in the warm-up). The average at the end, and the one
            of a membership change, take the moments too.
    """

    name: ClassVar[str] = "desloc"
    continues_after_failure: ClassVar[bool] = True
    #: The moments are averaged (each on its own period): local SGD's runtime reads this.
    average_optimizer_state: ClassVar[bool] = True

    period: int = option(16, "K_x: steps between parameter averages; higher: fewer bytes, "
                         "more drift between replicas; H_base when alpha > 0")
    momentum_period: int | None = option(
        None, "K_u: steps between averages of the first moments (exp_avg); none: 3 x period, "
        "the paper's")
    variance_period: int | None = option(
        None, "K_v: steps between averages of the second moments (exp_avg_sq); none: "
        "6 x period, the paper's")
    alpha: float = option(0.0, "0: constant K_x; > 0: the QSR rule from the lr, "
                          "K_x = max(period, floor((alpha / lr) ** power))")
    power: float = option(2.0, "the rule's exponent (alpha > 0)")
    warmup: str = option("steps", "the rule's warm-up (alpha > 0): \"steps\" or \"rising_lr\"")
    warmup_steps: int = option_of(LocalSGD, "warmup_steps")
    warmup_period: int = option_of(LocalSGD, "warmup_period")
    average_buffers: bool = option_of(LocalSGD, "average_buffers")
    reestimate_batchnorm: int = option_of(LocalSGD, "reestimate_batchnorm")
    average_at_end: bool = option_of(LocalSGD, "average_at_end")

    def __post_init__(self) -> None:
        QuadraticRule(self.period, self.alpha, self.power)  # its checks, also with alpha 0
        check_choice("warmup", self.warmup, QSR_WARMUPS)
        self.schedule  # noqa: B018 - its checks name the options
        for name in ("momentum_period", "variance_period"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        check_int("reestimate_batchnorm", self.reestimate_batchnorm, 0)

    @property
    def schedule(self) -> RoundSchedule:
        """The parameters' rounds: K_x, constant or QSR's."""
        rule: PeriodRule = ConstantPeriod(self.period) if self.alpha == 0 else QuadraticRule(
            self.period, self.alpha, self.power, self.warmup == "rising_lr")
        return RoundSchedule(rule, self.warmup_steps, self.warmup_period,
                             cap_to_end=self.alpha > 0)

    @property
    def moment_periods(self) -> dict[str, int]:
        """K_u and K_v, by moment (``"first"``, ``"second"``)."""
        given = {"first": self.momentum_period, "second": self.variance_period}
        return {moment: PERIOD_RATIOS[moment] * self.period if period is None else period
                for moment, period in given.items()}

    def symmetric(self) -> bool:
        return True  # the same all-reduces on every worker

    def optimizer_refusal(self, optimizer: str, momentum: float) -> str | None:
        if optimizer == "sgd" and momentum == 0:
            return ("desloc averages the optimizer's moments, and SGD without momentum keeps "
                    "none: use --optimizer adamw, or --momentum above 0")
        return None

    def sharding_refusal(self) -> str | None:
        return ("desloc averages the optimizer's moments, which on a sharded model are "
                "DTensors that its average does not take apart yet")

    def bind(self, comm: Communicator, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> DESLOCRuntime:
        return DESLOCRuntime(self, comm, model, optimizer)


class DESLOCRuntime(LocalSGDRuntime):
    """One worker of DES-LOC: local SGD's rounds for the parameters, a constant period for
    each moment."""

    config: DESLOC

    def __init__(self, config: DESLOC, comm: Communicator, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        super().__init__(config, comm, model, optimizer)
        self.moment_schedules = {moment: RoundSchedule(ConstantPeriod(period))
                                 for moment, period in config.moment_periods.items()}
        # internal state: the last step of each moment's current round (None: none yet)
        self.moment_ends: dict[str, int | None] = dict.fromkeys(MOMENTS)
        self.checked_optimizer = False  # whether its state has a moment (read once)

    @torch.no_grad()
    def after_step(self) -> None:
        step = self.step
        if not self.checked_optimizer and not self.skip_update:
            self._check_optimizer()
        if self.next_average is None:
            self._start_round(step)
        moments = [moment for moment in MOMENTS if self._moment_round_ends(moment, step)]
        if step == self.next_average:
            self.next_average = None
            self._average(moments)
        elif moments:
            self._exact_average(self._moment_tensors(moments))

    def _moment_round_ends(self, moment: str, step: int) -> bool:
        """Whether ``moment``'s round ends at ``step`` (starting one where none runs)."""
        end = self.moment_ends[moment]
        if end is None:
            period = self.moment_schedules[moment].period(step, 0.0, None, None)
            end = step + period - 1
        self.moment_ends[moment] = None if step == end else end
        return step == end

    def _average(self, moments: Collection[str] = tuple(MOMENTS)) -> None:
        """The parameters' exact average, with the ``moments`` whose rounds end too (default:
        both, at the end and at a membership change); one all-reduce."""
        self._exact_average(self._parameter_tensors() + self._moment_tensors(moments))
        self.last_averaged = self.step

    def _moment_tensors(self, moments: Collection[str]) -> list[torch.Tensor]:
        """The optimizer's state tensors of ``moments``, parameter by parameter (the order of
        :func:`optimizer_state_tensors`, as local SGD averages them)."""
        keys = {key for moment in moments for key in MOMENTS[moment]}
        return optimizer_state_tensors(self.optimizer, keys=keys)

    def _check_optimizer(self) -> None:
        """Refuse an optimizer whose state holds no moment (read after its first update,
        when the state exists), naming ``optimizer``."""
        states = [s for s in self.optimizer.state.values() if s]
        known = {key for keys in MOMENTS.values() for key in keys}
        if not any(isinstance(s.get(key), torch.Tensor) for s in states for key in known):
            kept = sorted({key for s in states for key in s})
            raise ValueError(
                f"optimizer: desloc averages the optimizer's moments on periods of their own "
                f"(Adam's and AdamW's exp_avg and exp_avg_sq, or SGD's momentum_buffer); "
                f"{type(self.optimizer).__name__} keeps none (its state: {kept}): use "
                f"torch.optim.AdamW, or SGD with momentum")
        self.checked_optimizer = True

    def _start_afresh(self) -> None:
        super()._start_afresh()
        self.moment_ends = dict.fromkeys(MOMENTS)  # the moments were averaged with them

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "moment_ends": dict(self.moment_ends)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.moment_ends = {moment: None if state["moment_ends"][moment] is None
                            else int(state["moment_ends"][moment]) for moment in MOMENTS}
