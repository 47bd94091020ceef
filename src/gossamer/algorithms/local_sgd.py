"""Local SGD: every worker steps its own optimizer; every H steps the replicas are averaged.

The averaging period H follows a schedule:

- constant (``localsgd``): H = ``period``;
- the Quadratic Synchronization Rule (``qsr``): after each averaging,
  ``H = max(period, floor((alpha / lr) ** power))``, with ``lr`` the wrapped optimizer's
  learning rate at that moment, so H grows as the learning rate decays; while the learning
  rate still rises (a learning-rate warm-up) and at the first average H stays at ``period``,
  as in the paper's code;
- either with a warm-up of ``warmup_steps`` steps that average after every step (post-local
  SGD); QSR's periods are capped so that the last step averages when the number of steps is
  known.

Averaging follows ``torch.distributed.algorithms.model_averaging.PeriodicModelAverager``: the
first average comes after the first step past the warm-up, then every H steps. Works with any
``torch.optim`` optimizer — Local AdamW is local SGD around AdamW — and can average the
optimizer state (momentum, Adam's moments) with the parameters.

References: Lin, Stich, Patel, Jaggi, "Don't Use Large Mini-Batches, Use Local SGD" (ICLR
2020); Gu, Lyu, Arora, Zhang, Huang, "A Quadratic Synchronization Rule for Distributed Deep
Learning" (ICLR 2024).

Example::

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer = gossamer.distribute(model, optimizer, QSR(period=2, alpha=0.01), comm)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from gossamer.algorithms.base import Algorithm, Runtime, average_tensors
from gossamer.algorithms.nonfinite import all_finite
from gossamer.checks import check_int
from gossamer.comm.base import Communicator


@dataclass(frozen=True, kw_only=True)
class LocalSGD(Algorithm):
    """Local SGD with a constant averaging period.

    Args:
        period: H, local steps between averages (default 4). 1 averages after every step.
        warmup_steps: average after every step for this many first steps (default 0).
        average_optimizer_state: also average the optimizer's floating-point state, e.g.
            momentum buffers or Adam's moments (default False).
        average_buffers: average floating-point buffers (BatchNorm statistics) with the
            parameters (default True); False keeps them local.
        reestimate_batchnorm: after the final average, re-estimate BatchNorm statistics on
            this many minibatches of each worker and average them (default 0: no). The
            training loop does it (it has the data); see ``reestimate_batchnorm()``.
        average_at_end: exact average after the last step (default True).
    """

    name: ClassVar[str] = "localsgd"
    #: cap each period by the steps left, so that the last step averages (QSR does)
    cap_to_end: ClassVar[bool] = False

    period: int = 4  # H_base; higher: fewer averages, fewer bytes, more drift between replicas
    warmup_steps: int = 0  # steps that average every step first (post-local SGD)
    average_optimizer_state: bool = False  # also average momentum / Adam moments
    average_buffers: bool = True  # BatchNorm statistics averaged with the parameters
    reestimate_batchnorm: int = 0  # batches to re-estimate BatchNorm statistics at the end
    average_at_end: bool = True  # all replicas equal after the last step

    def __post_init__(self) -> None:
        check_int("period", self.period, 1)
        check_int("warmup_steps", self.warmup_steps, 0)
        check_int("reestimate_batchnorm", self.reestimate_batchnorm, 0)

    def next_period(self, lr: float) -> int:
        """H after an average, given the learning rate at that moment."""
        return self.period

    def bind(self, comm: Communicator, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> LocalSGDRuntime:
        return LocalSGDRuntime(self, comm, model, optimizer)


@dataclass(frozen=True, kw_only=True)
class QSR(LocalSGD):
    """Local SGD whose period follows the Quadratic Synchronization Rule:
    ``H = max(period, floor((alpha / lr) ** power))`` after each average.

    Args:
        period: H_base, the smallest period (default 2).
        alpha: the rule's scale (default 0.01): H exceeds H_base once lr < alpha / H_base^(1/power).
        power: the exponent (default 2, the quadratic rule).
        (and the options of :class:`LocalSGD`)
    """

    name: ClassVar[str] = "qsr"
    cap_to_end: ClassVar[bool] = True

    period: int = 2  # H_base
    alpha: float = 0.01  # higher: longer periods at the same learning rate
    power: float = 2.0  # 2: the quadratic rule; 1: a linear one

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha)
                and self.alpha >= 0):
            raise ValueError(f"alpha must be a number >= 0, got {self.alpha!r}")
        if not (isinstance(self.power, (int, float)) and math.isfinite(self.power)
                and self.power > 0):
            raise ValueError(f"power must be a number > 0, got {self.power!r}")

    def next_period(self, lr: float) -> int:
        if lr <= 0:
            raise ValueError(f"QSR needs a positive learning rate, got lr={lr}")
        return max(self.period, math.floor((self.alpha / lr) ** self.power))


class LocalSGDRuntime(Runtime):
    """One worker of local SGD and the state of its averaging schedule."""

    def __init__(self, config: LocalSGD, comm: Communicator, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        super().__init__(comm, model, optimizer)
        self.config = config
        # internal state
        self.next_average = config.warmup_steps  # the step (0-based) that averages next
        self.current_period = 1 if config.warmup_steps else config.period
        self.last_averaged = -1  # the last step that averaged
        self.last_lr: float | None = None  # the learning rate at the last average
        # statistics
        self.periods: list[tuple[int, int]] = []  # (step, H chosen after averaging there)

    def _steps_left(self) -> int | None:
        return None if self.total_steps is None else self.total_steps - 1 - self.step

    @torch.no_grad()
    def after_step(self) -> None:
        step, config = self.step, self.config
        lr = float(self.optimizer.param_groups[0]["lr"])
        if step < config.warmup_steps:
            self._average()
            self.last_lr = lr
            return
        if step != self.next_average:
            return
        self._average()
        # While the learning rate still rises (a learning-rate warm-up), and at the first
        # average, H stays at H_base: the rule is meant for the decaying learning rate, and
        # a warm-up's small early rates would give one huge period.
        rising = self.last_lr is None or lr > self.last_lr
        period = config.period if rising else config.next_period(lr)
        self.last_lr = lr
        left = self._steps_left()
        if config.cap_to_end and left is not None and left > 0:
            period = min(period, left)  # so that the last step averages
        self.current_period = period
        self.next_average = step + period
        if left is None or left > 0:  # (after the last step there is no next period)
            self.periods.append((step, period))

    def _average(self) -> None:
        tensors = [p.data for p in self.model.parameters()]
        if self.config.average_buffers:
            tensors += [b for b in self.model.buffers() if torch.is_floating_point(b)]
        if self.config.average_optimizer_state:
            tensors += optimizer_state_tensors(self.optimizer)
        # checked before they are sent: only here, since local steps send nothing
        if not all_finite(tensors):
            raise self.nonfinite_error("parameters")
        average_tensors(self.comm, tensors)
        self.synchronizations += 1
        self.last_averaged = self.step

    def finish(self) -> None:
        if self.config.average_at_end and self.last_averaged != self.step - 1:
            self.average_parameters()

    @torch.no_grad()
    def average_parameters(self) -> None:
        """The exact average, of what the options say (buffers, optimizer state)."""
        self._average()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "next_average": self.next_average,
                "current_period": self.current_period, "last_averaged": self.last_averaged,
                "last_lr": self.last_lr,
                "periods": [list(p) for p in self.periods]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.next_average = int(state["next_average"])
        self.current_period = int(state["current_period"])
        self.last_averaged = int(state["last_averaged"])
        last_lr = state.get("last_lr")
        self.last_lr = None if last_lr is None else float(last_lr)
        self.periods = [(int(a), int(b)) for a, b in state["periods"]]


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The floating-point tensors of the optimizer's per-parameter state (momentum buffers,
    Adam's moments), in parameter order; step counters and other scalars are left out."""
    tensors = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            for value in optimizer.state.get(p, {}).values():
                if isinstance(value, torch.Tensor) and value.is_floating_point() \
                        and value.dim() > 0:
                    tensors.append(value)
    return tensors


@torch.no_grad()
def reestimate_batchnorm(comm: Communicator, model: nn.Module, batches) -> bool:
    """Recompute BatchNorm running statistics of ``model`` from ``batches`` (an iterable of
    inputs), as the cumulative average over them, then average them over the workers.

    Collective. Returns False (and does nothing) when the model has no BatchNorm layer.
    Reference: the "BN re-estimation" of Gu et al. (ICLR 2024), Appendix.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
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
