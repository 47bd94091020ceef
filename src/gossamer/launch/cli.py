"""``gossamer launch --nproc N [--emulate SPEC] [--emulate-rank R:SPEC] -- TRAIN ARGUMENTS``.

Examples::

    gossamer launch --nproc 4 -- --steps 100 --run-dir runs/ar
    gossamer launch --nproc 4 --max-restarts 2 -- --run-dir runs/ar --checkpoint-every 50
    gossamer launch --nproc 4 --max-restarts 1 -- --algorithm sgp --on-failure continue
    gossamer launch --nproc 4 --emulate bandwidth=1gbit,delay=1ms \\
        --emulate-rank 3:bandwidth=250mbit -- --algorithm sgp --run-dir runs/sgp-slow
    gossamer launch --cleanup
"""

from __future__ import annotations

import argparse
import sys

from gossamer.launch.launcher import GRACE, launch
from gossamer.launch.netem import (
    EmulationUnavailable,
    LinkSpec,
    NetworkSetupError,
    check_prerequisites,
    cleanup,
    parse_link_spec,
)

__all__ = ["add_arguments", "links_from_args", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``launch`` subcommand's arguments to ``parser``."""
    parser.add_argument("--nproc", type=int, default=None, metavar="N",
                        help="number of workers (processes) to start; required, except with "
                        "--cleanup")
    parser.add_argument(
        "--emulate", nargs="?", const="", default=None, metavar="SPEC",
        help="run each worker in its own network namespace, linked to a bridge; SPEC shapes "
        "every link: bandwidth=RATE each way (bits: 1gbit, 100mbit; bytes: 125MB/s; a bare "
        "number is bytes per second), delay=TIME and jitter=TIME (e.g. 1ms, 200us), "
        "loss=PERCENT%% (or a fraction), mtu=BYTES; keys may be left out (needs root, ip "
        "and tc)",
    )
    parser.add_argument(
        "--emulate-rank", action="append", default=[], metavar="RANK:SPEC",
        help="override keys of one rank's link, e.g. 3:bandwidth=250mbit for one slow link; "
        "repeatable; implies --emulate",
    )
    parser.add_argument("--grace", type=float, default=GRACE, metavar="SECONDS",
                        help="seconds workers get to exit after SIGTERM when they are stopped "
                        f"(default: {GRACE:g})")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="when a worker fails, restart every worker up to N times, as "
                        "torchrun --max-restarts N does; a run with --run-dir resumes from its "
                        "latest checkpoint; with the train argument --on-failure continue, "
                        "restart only the failed worker, which rejoins the others (default: 0)")
    parser.add_argument("--cleanup", action="store_true",
                        help="remove the namespaces left by launchers that were killed, and "
                        "the processes still in them; then exit")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, metavar="-- TRAIN ARGUMENTS",
                        help="arguments of `gossamer train`, after --")


def links_from_args(args: argparse.Namespace) -> list[LinkSpec] | None:
    """One link per rank from ``--emulate`` and ``--emulate-rank``; None without either."""
    if args.emulate is None and not args.emulate_rank:
        return None
    base = parse_link_spec(args.emulate or "", option="--emulate")
    links = [base] * args.nproc
    for item in args.emulate_rank:
        rank_text, sep, spec = item.partition(":")
        option = f"--emulate-rank {item!r}"
        if not sep or not rank_text.strip().isdigit():
            raise ValueError(f"{option}: expected RANK:SPEC, e.g. 3:bandwidth=250mbit")
        rank = int(rank_text)
        if rank >= args.nproc:
            raise ValueError(f"{option}: rank {rank} does not exist with --nproc "
                             f"{args.nproc} (ranks 0 to {args.nproc - 1})")
        links[rank] = parse_link_spec(spec, links[rank], option=option)
    return links


def run(args: argparse.Namespace) -> int:
    """Run the ``launch`` subcommand; the exit code (2 when emulation is unavailable)."""
    train_args = list(args.train_args)
    if train_args[:1] == ["--"]:
        train_args = train_args[1:]
    try:
        if args.cleanup:
            if args.nproc is not None or train_args:
                raise ValueError("--cleanup takes no --nproc and no train arguments")
            check_prerequisites()
            removed = cleanup()
            print(f"removed {len(removed)} namespace(s)" +
                  (f": {', '.join(removed)}" if removed else ""))
            return 0
        if args.nproc is None:
            raise ValueError("--nproc is required: the number of workers to start")
        if args.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
        links = links_from_args(args)
        if links is not None:
            check_prerequisites()
        return launch(train_args, args.nproc, links=links, grace=args.grace,
                      max_restarts=args.max_restarts)
    except EmulationUnavailable as exc:
        print(f"gossamer launch: error: {exc}", file=sys.stderr)
        return 2
    except NetworkSetupError as exc:
        print(f"gossamer launch: error: cannot set up the emulated network: {exc}",
              file=sys.stderr)
        return 1
