"""Helpers of the resume tests: a run that stops at a given step, then resumes."""

from __future__ import annotations

from pathlib import Path

import pytest

import gossamer.train.loop as loop
from gossamer.train.config import TrainConfig
from gossamer.train.run import run_training


class Crash(RuntimeError):
    pass


def crash_at(step_to_crash: int):
    """A stand-in for the loop's learning_rate that raises at ``step_to_crash`` (0-based)."""
    real = loop.learning_rate

    def crashing(config, step):
        if step == step_to_crash:
            raise Crash(f"stopped at step {step}")
        return real(config, step)

    return crashing


def straight_and_resumed(monkeypatch, root: Path, crash_step: int, **settings) -> tuple[
        Path, Path, dict]:
    """Run ``settings`` once without stopping (in root/a) and once stopped at ``crash_step``
    and resumed (in root/b); returns both run directories and the resumed run's result."""
    straight, stopped = root / "a", root / "b"
    run_training(TrainConfig(run_dir=str(straight), **settings))
    monkeypatch.setattr(loop, "learning_rate", crash_at(crash_step))
    with pytest.raises(Exception, match=f"stopped at step {crash_step}"):
        run_training(TrainConfig(run_dir=str(stopped), **settings))
    monkeypatch.undo()
    resumed = run_training(TrainConfig(run_dir=str(stopped), resume=True, **settings))
    return straight, stopped, resumed
