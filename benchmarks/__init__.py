"""Benchmarks: not tests. Each writes its figures to benchmarks/results/; the numbers that
matter are copied, with the command that made them, into BENCHMARKS.md."""
