"""Benchmarks: not tests. Run them with ``gossamer bench NAME``; each writes its figures to
benchmarks/results/, and the numbers that matter are copied, with the command that made them,
into BENCHMARKS.md. A benchmark is a module here with ``add_arguments(parser)`` and
``run(args, results)`` (see :mod:`gossamer.bench`); the other modules are its helpers."""
