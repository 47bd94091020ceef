"""``gossamer topology NAME --workers N``: print a topology's peers, matrices and properties.

Useful to check, before a run, who talks to whom and how fast a topology mixes.
"""

from __future__ import annotations

import argparse

import numpy as np

from gossamer.topology.base import Topology
from gossamer.topology.builders import TOPOLOGIES, build

__all__ = ["add_arguments", "run"]

_MAX_PHASES = 16
_MAX_RANKS = 32
_MAX_MATRIX_N = 16
#: The most workers described: the spectral gap is computed from dense n x n matrices.
MAX_WORKERS = 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``topology`` subcommand's arguments to ``parser``."""
    parser.add_argument("name", help=f"the topology: one of {', '.join(TOPOLOGIES)}")
    parser.add_argument("--workers", type=int, required=True,
                        help=f"number of workers (at most {MAX_WORKERS})")
    parser.add_argument("--peers-per-step", type=int, default=None, help="exponential only")
    parser.add_argument("--group-size", type=int, default=None, help="butterfly_groups only")
    parser.add_argument("--degree", type=int, default=None, help="random_regular only")
    parser.add_argument("--seed", type=int, default=None, help="random_regular only")


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _describe(topo: Topology) -> list[str]:
    n = topo.world_size
    lines = [repr(topo)]
    for p in range(min(topo.period, _MAX_PHASES)):
        lines.append(f"phase {p}:")
        for i in range(min(n, _MAX_RANKS)):
            w = topo.weights(i, p)
            peers = ", ".join(f"{j}: {x:.3f}" for j, x in w.peers.items()) or "-"
            lines.append(f"  {i} -> {peers}  (self {w.self_weight:.3f})")
        if n > _MAX_RANKS:
            lines.append(f"  ... ({n - _MAX_RANKS} more ranks)")
        if n <= _MAX_MATRIX_N:
            lines.append("  matrix (W[j, i] = weight of i's value at j):")
            with np.printoptions(precision=3, floatmode="fixed", suppress=True, linewidth=200):
                lines.extend("    " + row for row in str(topo.matrix(p)).splitlines())
    if topo.period > _MAX_PHASES:
        lines.append(f"... ({topo.period - _MAX_PHASES} more phases)")
    lines += [
        "checks:",
        f"  non-negative:                        {_yes(topo.is_nonnegative())}",
        f"  column-stochastic:                   {_yes(topo.is_column_stochastic())}",
        f"  row-stochastic:                      {_yes(topo.is_row_stochastic())}",
        f"  doubly stochastic:                   {_yes(topo.is_doubly_stochastic())}",
        f"  strongly connected over a period:    {_yes(topo.is_strongly_connected())}",
        f"spectral gap (one period): {topo.spectral_gap():.6f}",
    ]
    return lines


def run(args: argparse.Namespace) -> int:
    """Build the topology named in ``args`` and print it; builder ValueErrors propagate."""
    # Only the flags actually given are passed, so build() can reject ones the topology lacks.
    keys = ("peers_per_step", "group_size", "degree", "seed")
    options = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    if args.workers > MAX_WORKERS:  # before building anything of n x n size
        raise ValueError(f"--workers {args.workers} is more than gossamer topology describes: "
                         f"at most {MAX_WORKERS} (its spectral gap comes from dense n x n "
                         "matrices)")
    topo = build(args.name, args.workers, **options)
    print("\n".join(_describe(topo)))
    return 0
