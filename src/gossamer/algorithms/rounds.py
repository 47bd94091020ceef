"""How long the rounds of the local methods last: a period rule, a warm-up before it, a cap at
the end. Objects a method's configuration holds (:class:`~gossamer.algorithms.LocalSGD`,
:class:`~gossamer.algorithms.QSR`, :class:`~gossamer.algorithms.DiLoCo`), not base classes.

A round starts at step ``s`` (0-based: ``s`` steps done) and lasts H steps, H chosen then:

- in the warm-up (``s < warmup_steps``): H = ``warmup_period``;
- otherwise the rule's: :class:`ConstantPeriod` (H = ``period``) or :class:`QuadraticRule`,
  the Quadratic Synchronization Rule (Gu, Lyu, Arora, Zhang, Huang, ICLR 2024):
  ``H = max(period, floor((alpha / lr) ** power))`` with ``lr`` the learning rate of ``s``;
- with ``cap_to_end``, H is at most the steps left (when they are known), so that the last
  step ends a round.

Example::

    schedule = RoundSchedule(QuadraticRule(period=2, alpha=0.01), warmup_steps=100,
                             cap_to_end=True)
    schedule.period(step=500, lr=0.001, previous_lr=0.002, steps_left=None)  # 100
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from gossamer.checks import check_int

#: QSR's warm-up rules: keyed on ``warmup_steps`` (the QSR code) or on a rising learning rate
QSR_WARMUPS = ("steps", "rising_lr")

__all__ = ["QSR_WARMUPS", "ConstantPeriod", "PeriodRule", "QuadraticRule", "RoundSchedule"]


class PeriodRule(Protocol):
    """H of a round that starts at 0-based ``step`` with learning rate ``lr``;
    ``previous_lr``: that of the previous round's first step (None: this is the first)."""

    def __call__(self, step: int, lr: float, previous_lr: float | None) -> int: ...


@dataclass(frozen=True)
class ConstantPeriod:
    """H = ``period`` for every round."""

    period: int

    def __post_init__(self) -> None:
        check_int("period", self.period, 1)

    def __call__(self, step: int, lr: float, previous_lr: float | None) -> int:
        return self.period


@dataclass(frozen=True)
class QuadraticRule:
    """The Quadratic Synchronization Rule: ``H = max(period, floor((alpha / lr) ** power))``.

    ``rising_lr``: H = ``period`` for a round whose learning rate is higher than the previous
    round's, and for the first round (a learning-rate warm-up's small early rates would give
    one huge period)."""

    period: int
    alpha: float
    power: float = 2.0
    rising_lr: bool = False

    def __post_init__(self) -> None:
        check_int("period", self.period, 1)
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha)
                and self.alpha >= 0):
            raise ValueError(f"alpha must be a number >= 0, got {self.alpha!r}")
        if not (isinstance(self.power, (int, float)) and math.isfinite(self.power)
                and self.power > 0):
            raise ValueError(f"power must be a number > 0, got {self.power!r}")

    def __call__(self, step: int, lr: float, previous_lr: float | None) -> int:
        if self.rising_lr and (previous_lr is None or lr > previous_lr):
            return self.period
        if lr <= 0:
            raise ValueError(f"QSR needs a positive learning rate, got lr={lr} at step {step}")
        return max(self.period, math.floor((self.alpha / lr) ** self.power))


@dataclass(frozen=True)
class RoundSchedule:
    """A period rule after a warm-up of ``warmup_steps`` steps whose rounds last
    ``warmup_period``; ``cap_to_end``: no round outlasts the steps left."""

    rule: PeriodRule
    warmup_steps: int = 0
    warmup_period: int = 1
    cap_to_end: bool = False

    def __post_init__(self) -> None:
        check_int("warmup_steps", self.warmup_steps, 0)
        check_int("warmup_period", self.warmup_period, 1)

    def period(self, step: int, lr: float, previous_lr: float | None,
               steps_left: int | None) -> int:
        """H of the round that starts at 0-based ``step``; ``steps_left``: the steps from it
        to the end, it included (None: unknown)."""
        period = self.warmup_period if step < self.warmup_steps else self.rule(
            step, lr, previous_lr)
        if self.cap_to_end and steps_left is not None and steps_left > 0:
            period = min(period, steps_left)  # so that the last step ends a round
        return period
