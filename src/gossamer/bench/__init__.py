"""The benchmark harness behind ``gossamer bench``: the stand-in models, the timed-step loop,
the results writer and the report helpers that every benchmark of ``benchmarks/`` shares.

A benchmark is a module ``benchmarks/NAME.py`` of a source checkout with
``add_arguments(parser)`` and ``run(args, results) -> int`` (see :mod:`gossamer.bench.harness`).
"""

from gossamer.bench.models import mlp
from gossamer.bench.results import Results, machine
from gossamer.bench.steps import StepTimes, sgd_step, timed_steps
from gossamer.train.style import markdown_table, new_figure

__all__ = ["Results", "StepTimes", "machine", "markdown_table", "mlp", "new_figure",
           "sgd_step", "timed_steps"]
