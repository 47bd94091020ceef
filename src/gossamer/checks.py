"""Argument checks shared by every layer: each raises a ValueError that names the argument."""

from __future__ import annotations

import math


def check_int(name: str, value: object, minimum: int) -> None:
    """``value`` must be an int (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def check_positive(name: str, value: float, *, allow_zero: bool) -> None:
    """``value`` must be a number > 0 (or >= 0 with ``allow_zero``), not NaN."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value}")


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    """``value`` must be one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
