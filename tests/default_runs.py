"""The default task's runs, made once per test process: several tests check a method's run of
the default task (4 simulated workers, the default settings, ``--quiet``), each something
else of it. A run in the simulator is deterministic, so the second test gets the first's."""

from __future__ import annotations

import copy
import functools

from gossamer.train.config import TrainConfig
from gossamer.train.run import run_training


@functools.cache
def _run(algorithm: str) -> dict:
    return run_training(TrainConfig(sim=4, algorithm=algorithm, quiet=True))


def default_run(algorithm: str = "allreduce") -> dict:
    """``run_training(TrainConfig(sim=4, algorithm=algorithm, quiet=True))``'s result (a copy:
    a test may change it)."""
    return copy.deepcopy(_run(algorithm))
