"""Oracles: each method as a plain sequential program written from its paper's pseudo-code.

An oracle holds the n workers' parameters as a list of float64 tensors and steps them in one
loop, exactly as the paper's algorithm reads; it imports nothing of gossamer but topology data
(peers, weights, groups), passed in as plain values. The tests under ``tests/test_oracle_*.py``
run the library in SimWorld and match its trajectory to the oracle's step by step. Where the
order of events depends on timing (asynchronous methods with delays or late workers), the
oracle replays the order the library recorded, so the arithmetic is checked under any timing.
"""
