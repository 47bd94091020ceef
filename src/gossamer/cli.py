"""The ``gossamer`` command: ``train``, ``compare``, ``plot``, ``topology``, ``launch``,
``bench``, ``plan``, ``algorithms``.

Examples::

    gossamer train                                   # 4 simulated workers, AllReduce, digits
    gossamer train --config recipes/mnist-cnn.yaml --sim 8 --data-path ../shared/data/mnist
    torchrun --nproc-per-node 4 -m gossamer train --run-dir runs/ar
    gossamer compare --algorithms allreduce,allreduce:bucket_mb=0.01 --workers 8
    gossamer plot runs/ar
    gossamer topology exponential --workers 8
    gossamer launch --nproc 4 --emulate bandwidth=1gbit,delay=1ms -- --run-dir runs/emu
    gossamer bench                                   # list the benchmarks
    gossamer bench sim_overhead --workers 16
    gossamer plan --workers 8 32 128 --model resnet50 --bandwidth 10gbit
    gossamer algorithms
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from collections.abc import Sequence

from gossamer.comm.base import CommError
from gossamer.comm.sim import SimulationError


def _add_train(sub: argparse._SubParsersAction) -> None:
    from gossamer.train.config import DEFAULT_SIM_WORKERS, add_config_arguments

    p = sub.add_parser(
        "train",
        help="train a model with a distributed algorithm",
        description="Train a model with a distributed algorithm, in the simulator (--sim N) or "
        "as one process of a torchrun / SLURM / mpirun job. Without --sim and without a "
        f"launcher, {DEFAULT_SIM_WORKERS} workers are simulated. Settings come from the "
        "defaults, then --config RECIPE.yaml, then the flags given.",
    )
    add_config_arguments(p)
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write the result as JSON to PATH")


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else value


def _summary_rows(result: dict) -> list[tuple[str, str]]:
    from gossamer.train.metrics import format_bytes
    from gossamer.train.report import final_consensus

    clock = "simulated" if result["mode"] == "simulated" else "real"
    acc = result.get("eval_accuracy", float("nan"))
    workers = f"{result['world_size']} ({result['mode']})"
    bytes_label = "bytes sent per worker (mean)"
    if result.get("shards", 1) > 1:  # the method's bytes: the replica dimension's, per rank
        workers = (f"{result['world_size']}: {result['replicas']} replicas x "
                   f"{result['shards']} shards ({result['mode']})")
        bytes_label = "bytes sent per rank between replicas (mean)"
    return [
        ("algorithm", result["algorithm"]),
        ("workers", workers),
        ("steps", str(result.get("step", "-"))),
        ("eval accuracy", f"{100 * acc:.2f}%"),
        ("eval loss", f"{result.get('eval_loss', float('nan')):.4f}"),
        ("consensus distance", f"{_or_nan(final_consensus(result)):.3g}"),
        (bytes_label, format_bytes(result.get("bytes_sent", 0.0))),
        ("synchronizations", str(result.get("synchronizations", "-"))),
        *([("non-finite updates skipped", str(result["skipped_steps"]))]
          if result.get("skipped_steps") else []),
        *([("membership", _membership(result["membership"]))]
          if len(result.get("membership", ())) > 1 else []),
        (f"wall-clock ({clock})", f"{result.get('wall_clock', float('nan')):.3f} s"),
        ("examples per second", f"{result.get('examples_per_second', float('nan')):.0f}"),
    ]


def summary_text(result: dict) -> str:
    """What ``gossamer train`` prints at the end of a run: its summary, one row a metric."""
    rows = _summary_rows(result)
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _membership(history: list[dict]) -> str:
    """``0,1,2,3; 0,1,3 from step 101``: the members (by their first rank) of each epoch."""
    epochs = [",".join(map(str, e["members"])) + (f" from step {e['step']}" if e["step"] else "")
              for e in history]
    return "; ".join(epochs)


def _train(args: argparse.Namespace) -> int:
    from gossamer.train.config import DEFAULT_SIM_WORKERS, config_from_args
    from gossamer.train.run import launched_by_launcher, run_training

    config = config_from_args(args)
    if args.sim is None:
        # Under a launcher each process is one worker, whatever a recipe says; without one,
        # simulate.
        if launched_by_launcher():
            config = config.replace(sim=0)
        elif config.sim == 0:
            config = config.replace(sim=DEFAULT_SIM_WORKERS)
    result = run_training(config)
    if result["rank"] != 0:
        return 0
    if result.get("already_complete"):
        print(f"gossamer train: run_dir {config.run_dir!r} is already complete (step "
              f"{result.get('step', config.steps)} of {config.steps}): nothing to train; its "
              "summary, kept in metrics.jsonl, is below (pass a larger --steps to train on)",
              file=sys.stderr)
    print(summary_text(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": config.as_dict(), "result": result}, f, indent=2)
    return 0


def _add_compare(sub: argparse._SubParsersAction) -> None:
    from gossamer.train.config import add_config_arguments

    p = sub.add_parser(
        "compare",
        help="run several algorithms on the same task and write a report with plots",
        description="Run several algorithms on the same task, seed and partition in the "
        "simulator, and write report.md (a table) and PNG plots of loss and accuracy against "
        "steps, simulated wall-clock and bytes sent. Task settings are those of "
        "`gossamer train`.",
    )
    p.add_argument("--algorithms", default=None,
                   help="comma-separated NAME or NAME:KEY=VALUE:... entries (default: every "
                   "registered algorithm that learns with its defaults)")
    p.add_argument("--workers", type=int, default=8, help="simulated workers (default: 8)")
    p.add_argument("--out", default="gossamer-compare",
                   help="output directory (default: gossamer-compare)")
    # each entry names its method; the runs go under --out; --workers is the simulator's size
    add_config_arguments(p, hidden=("algorithm", "run_dir", "resume", "sim"))


def _compare(args: argparse.Namespace) -> int:
    from gossamer.train.compare import default_algorithms, run_compare
    from gossamer.train.config import config_from_args

    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    for flag, given in (("--algorithm", args.algorithm), ("--option", args.option),
                        ("--group-size", args.group_size),
                        ("--replica-size", args.replica_size),
                        ("--compressor", args.compressor), ("--run-dir", args.run_dir),
                        ("--resume", args.resume), ("--sim", args.sim)):
        if given:
            raise ValueError(f"compare does not take {flag}: name algorithms and their options "
                             "as --algorithms NAME:KEY=VALUE,...; runs go under --out, and "
                             "--workers sets the simulated workers")
    base = config_from_args(args, sim=args.workers)
    report = run_compare(args.algorithms or default_algorithms(), base, args.out)
    print(f"report: {report}")
    return 0


def _add_plot(sub: argparse._SubParsersAction) -> None:
    from gossamer.train.report import add_plot_arguments

    p = sub.add_parser("plot", help="redraw the plots of run directories",
                       description="Redraw the plots and the report from the metrics.jsonl of "
                       "one or more run directories.")
    add_plot_arguments(p)


def _add_topology(sub: argparse._SubParsersAction) -> None:
    from gossamer.topology import cli as topology_cli

    p = sub.add_parser(
        "topology", help="print a topology's peers, mixing matrices and spectral gap",
        description="Print a topology's peers per phase, mixing matrices, checks and "
        "spectral gap.",
    )
    topology_cli.add_arguments(p)


def _add_launch(sub: argparse._SubParsersAction) -> None:
    from gossamer.launch import cli as launch_cli

    p = sub.add_parser(
        "launch", help="start N workers of `gossamer train`, optionally on an emulated network",
        description="Start N worker processes of `gossamer train` on this host and watch "
        "them. With --emulate each worker runs in its own network namespace, linked to a "
        "bridge by a link shaped with tc, and the workers meet as the nodes of a multi-node "
        "torchrun job. Train arguments follow --.",
    )
    launch_cli.add_arguments(p)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from gossamer.bench import cli as bench_cli

    p = sub.add_parser(
        "bench", help="run a benchmark of the checkout's benchmarks/ (no name: list them)",
        description="Run one benchmark through the shared harness (stand-in models, timed "
        "steps, results written as JSON with the machine and the command). Without a name, "
        "list the benchmarks. Arguments after NAME go to the benchmark.",
    )
    bench_cli.add_arguments(p)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    from gossamer.plan import cli as plan_cli

    plan_cli.add_arguments(sub.add_parser("plan", help=plan_cli.HELP,
                                          description=plan_cli.DESCRIPTION))


def summary(cls: type) -> str:
    """The first paragraph of ``cls``'s docstring, on one line."""
    paragraph = (cls.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(line.strip() for line in paragraph.splitlines())


def _algorithms(args: argparse.Namespace) -> int:
    from gossamer.algorithms import available, lookup
    from gossamer.algorithms.registry import describe_help
    from gossamer.algorithms.registry import summary as algorithm_summary
    from gossamer.compress.registry import available_compressors, lookup_compression
    from gossamer.options import describe_options

    def show(name: str, text: str, needs: str,
             options: list[tuple[str, str, object, str]]) -> None:
        print(f"{name}: {text}")
        if needs:
            print(f"    NEEDS: {needs}")
        for option, type_name, default, help_text in options:
            print(f"    {option} ({type_name}, default {default!r})"
                  + (f": {help_text}" if help_text else ""))

    for name in available():
        show(name, algorithm_summary(name), lookup(name).needs, describe_help(name))
    print("\ncompressors (--compressor NAME[:KEY=VALUE...], with a gradient-level method):")
    for name in available_compressors():
        cls = lookup_compression(name)
        show(name, summary(cls), "", describe_options(cls))
    return 0


def build_parser() -> argparse.ArgumentParser:
    import gossamer

    parser = argparse.ArgumentParser(
        prog="gossamer",
        description="Communication-efficient data-parallel training for PyTorch.",
    )
    parser.add_argument("--version", action="version",
                        version=f"gossamer {gossamer.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train(sub)
    _add_compare(sub)
    _add_plot(sub)
    _add_topology(sub)
    _add_launch(sub)
    _add_bench(sub)
    _add_plan(sub)
    sub.add_parser("algorithms", help="list the registered algorithms and their options")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "topology":
            from gossamer.topology import cli as topology_cli

            return topology_cli.run(args)
        if args.command == "launch":
            from gossamer.launch import cli as launch_cli

            return launch_cli.run(args)
        if args.command == "bench":
            from gossamer.bench import cli as bench_cli

            return bench_cli.run(args)
        if args.command == "plan":
            from gossamer.plan import cli as plan_cli

            return plan_cli.run(args)
        if args.command == "plot":
            from gossamer.train.report import run_plot

            return run_plot(args)
        handlers = {"train": _train, "compare": _compare, "algorithms": _algorithms}
        return handlers[args.command](args)
    except (ValueError, FileNotFoundError, pickle.UnpicklingError) as error:
        print(f"gossamer {args.command}: error: {error}", file=sys.stderr)
        return 2
    except SimulationError as error:
        print(f"gossamer {args.command}: {error}", file=sys.stderr)
        return 1
    except (CommError, FloatingPointError) as error:
        # a worker of a real job: a peer stopped answering, or a non-finite value (the
        # message names the operation, the peer, the rank and the step)
        from gossamer.comm.environment import launched_rank

        rank = launched_rank()
        where = f" (rank {rank})" if rank is not None else ""
        print(f"gossamer {args.command}{where}: {type(error).__name__}: {error}",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
