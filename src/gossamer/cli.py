"""The ``gossamer`` command: ``train``, ``topology`` and ``algorithms``.

Examples::

    gossamer train                        # 4 simulated workers, AllReduce, digits
    gossamer train --sim 64 --bandwidth 12.5e6
    torchrun --nproc-per-node 4 -m gossamer train
    gossamer topology exponential --workers 8
    gossamer algorithms
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from gossamer.train.loop import TrainConfig

DEFAULT_SIM_WORKERS = 4


def _parse_options(pairs: Sequence[str]) -> dict[str, str]:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--option expects KEY=VALUE, got {pair!r}")
        options[key.strip().replace("-", "_")] = value.strip()
    return options


def _add_train(sub: argparse._SubParsersAction) -> None:
    d = TrainConfig()
    p = sub.add_parser(
        "train",
        help="train a model with a distributed algorithm",
        description="Train a model with a distributed algorithm, in the simulator (--sim N) or "
        "as one process of a torchrun / SLURM / mpirun job. Without --sim and without a "
        f"launcher, {DEFAULT_SIM_WORKERS} workers are simulated.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--algorithm", default=d.algorithm,
                   help="registered algorithm name (see `gossamer algorithms`)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the algorithm, repeatable (e.g. --option bucket_mb=10)")
    p.add_argument("--dataset", default=d.dataset, help="data set")
    p.add_argument("--model", default=d.model, help="model")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps per worker")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="minibatch per worker")
    p.add_argument("--lr", type=float, default=d.lr, help="learning rate")
    p.add_argument("--momentum", type=float, default=d.momentum, help="SGD momentum")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="L2 weight decay")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of model, split and sampling")
    p.add_argument("--eval-every", type=int, default=d.eval_every,
                   help="steps between evaluations (0: only at the end)")
    p.add_argument("--sim", type=int, default=None, metavar="N",
                   help=f"simulate N workers in this process (default {DEFAULT_SIM_WORKERS} "
                   "when not started by a launcher)")
    p.add_argument("--latency", type=float, default=d.latency,
                   help="simulator: seconds per message")
    p.add_argument("--bandwidth", type=float, default=d.bandwidth,
                   help="simulator: bytes per second per link")
    p.add_argument("--compute-time", type=float, default=d.compute_time,
                   help="simulator: seconds of computation per step")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write the result as JSON to PATH")
    p.add_argument("--quiet", action="store_true", help="no progress bar, summary only")


def _train(args: argparse.Namespace) -> int:
    from gossamer.train.loop import format_bytes, launched_by_launcher, run_training

    sim = args.sim
    if sim is None:
        sim = 0 if launched_by_launcher() else DEFAULT_SIM_WORKERS
    if sim < 0:
        raise ValueError(f"--sim must be >= 0, got {sim}")
    config = TrainConfig(
        algorithm=args.algorithm, options=_parse_options(args.option), dataset=args.dataset,
        model=args.model, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
        momentum=args.momentum, weight_decay=args.weight_decay, seed=args.seed,
        eval_every=args.eval_every, sim=sim, latency=args.latency, bandwidth=args.bandwidth,
        compute_time=args.compute_time, quiet=args.quiet,
    )
    result = run_training(config)
    if result["rank"] != 0:
        return 0
    clock = "simulated" if result["mode"] == "simulated" else "real"
    rows = [
        ("algorithm", config.algorithm),
        ("workers", f"{result['world_size']} ({result['mode']})"),
        ("steps", str(config.steps)),
        ("eval accuracy", f"{100 * result['eval_accuracy']:.2f}%"),
        ("eval loss", f"{result['eval_loss']:.4f}"),
        ("bytes sent per worker", format_bytes(result["bytes_sent_per_worker"])),
        ("synchronizations", str(result["synchronizations"])),
        (f"wall-clock ({clock})", f"{result['wall_clock']:.3f} s"),
        ("examples per second", f"{result['examples_per_second']:.0f}"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": config.as_dict(), "result": result}, f, indent=2)
    return 0


def _add_topology(sub: argparse._SubParsersAction) -> None:
    from gossamer.topology import cli as topology_cli

    p = sub.add_parser(
        "topology", help="print a topology's peers, mixing matrices and spectral gap",
        description="Print a topology's peers per phase, mixing matrices, checks and "
        "spectral gap.",
    )
    topology_cli.add_arguments(p)


def _algorithms(args: argparse.Namespace) -> int:
    from gossamer.algorithms import available, describe, lookup

    for name in available():
        doc = (lookup(name).__doc__ or "").strip().splitlines()[0]
        print(f"{name}: {doc}")
        for option, type_name, default in describe(name):
            print(f"    {option} ({type_name}, default {default!r})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gossamer",
        description="Communication-efficient data-parallel training for PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train(sub)
    _add_topology(sub)
    sub.add_parser("algorithms", help="list the registered algorithms and their options")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers: dict[str, Any] = {"train": _train, "algorithms": _algorithms}
    try:
        if args.command == "topology":
            from gossamer.topology import cli as topology_cli

            return topology_cli.run(args)
        return handlers[args.command](args)
    except ValueError as error:
        print(f"gossamer {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
