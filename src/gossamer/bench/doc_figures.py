"""``gossamer bench report``: the documentation's figures, regenerated in one command.

    gossamer bench report                       # every figure, into docs/figures/
    gossamer bench report --workers 8 32 --model gpt-1b --compute-time 1.0
    gossamer bench report --local-runs runs/local --gossip-runs runs/gossip   # redraw only

Three figures, each a PNG beside a page ``NAME.md`` that shows it with its numbers, its
settings and the command that made it:

- ``speed_up_vs_bandwidth``: each method's predicted speed-up per step over AllReduce against
  the link's bandwidth (100 Mbit/s to 100 Gbit/s), a panel per worker count, from the planner
  (``gossamer plan`` at each bandwidth; docs/plan.md);
- ``loss_vs_bytes_local``: the eval loss of the averaged model against the bytes each worker
  sent, for the local and outer-optimizer methods (local SGD, QSR, DiLoCo, Streaming DiLoCo,
  SPARTA, DeMo) and AllReduce;
- ``accuracy_vs_time_gossip``: the eval accuracy of the averaged model against the simulated
  wall-clock, for the gossip methods (SGP, OSGP, D-PSGD, AD-PSGD, GossipGraD) and AllReduce.

The last two come from ``gossamer compare``-style runs: made here (the default task of
``gossamer train`` on 8 simulated workers with links of 100 Mbit/s, where the methods' times
differ; ``--set KEY=VALUE`` changes any setting), each under ``--runs`` in a directory of its
own, or read from run directories given with ``--local-runs`` / ``--gossip-runs`` (e.g. the
``--out`` of a ``gossamer compare``).
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

__all__ = ["add_arguments", "run"]

#: the planner's methods by default: a few of each family, among those it times fastest (the
#: all-gather methods, QSGD, WAGMA and DeMo take the longest; name them with
#: --plan-algorithms)
PLAN_ALGORITHMS = ("allreduce,sgp,osgp,adpsgd,localsgd,diloco,streaming-diloco,powersgd,"
                   "topk,fp16")
LOCAL_ALGORITHMS = "allreduce,localsgd,qsr,diloco,streaming-diloco,sparta,demo"
GOSSIP_ALGORITHMS = "allreduce,sgp,osgp,dpsgd,adpsgd,gossipgrad"
BANDWIDTHS = ("100mbit", "1gbit", "10gbit", "100gbit")
#: the training runs' settings unless --set says otherwise: links slow enough for the digits
#: MLP's communication to show in the simulated time, and an evaluation every 25 steps for
#: the curves
TRAIN_SETTINGS = {"bandwidth": "100mbit", "eval_every": 25}

SPEED_UP = "speed_up_vs_bandwidth"
LOCAL = "loss_vs_bytes_local"
GOSSIP = "accuracy_vs_time_gossip"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``gossamer bench report``."""
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="where the PNGs and their pages go (default: docs/figures of the "
                        "checkout, else ./docs/figures)")
    parser.add_argument("--only", nargs="+", choices=(SPEED_UP, LOCAL, GOSSIP), default=None,
                        metavar="FIGURE", help=f"draw only these figures ({SPEED_UP}, {LOCAL}, "
                        f"{GOSSIP}; default: all)")
    plan = parser.add_argument_group("the planner's figure")
    plan.add_argument("--workers", type=int, nargs="+", default=[8],
                      help="worker counts, a panel each (default: 8)")
    plan.add_argument("--model", default="resnet50",
                      help="the planner's model: resnet50, gpt-1b, digits-mlp or a parameter "
                      "count (default resnet50)")
    plan.add_argument("--compute-time", type=float, default=0.25,
                      help="seconds of compute per step (default 0.25)")
    plan.add_argument("--bandwidths", nargs="+", default=list(BANDWIDTHS), metavar="RATE",
                      help=f"link rates (default: {' '.join(BANDWIDTHS)})")
    plan.add_argument("--plan-algorithms", default=PLAN_ALGORITHMS, metavar="SPEC",
                      help=f"the planner's methods, NAME or NAME:KEY=VALUE, comma-separated "
                      f"(default: {PLAN_ALGORITHMS})")
    train = parser.add_argument_group("the training runs' figures")
    train.add_argument("--sim", type=int, default=8,
                       help="simulated workers of the training runs (default 8)")
    train.add_argument("--steps", type=int, default=None,
                       help="steps of each run (default: gossamer train's)")
    train.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                       dest="settings", help="a setting of gossamer train for every run "
                       "(repeatable, e.g. --set lr=0.02 --set stragglers=3:2); defaults: "
                       + ", ".join(f"{k}={v}" for k, v in TRAIN_SETTINGS.items()))
    train.add_argument("--local-algorithms", default=LOCAL_ALGORITHMS, metavar="SPEC",
                       help=f"the local and outer methods (default: {LOCAL_ALGORITHMS})")
    train.add_argument("--gossip-algorithms", default=GOSSIP_ALGORITHMS, metavar="SPEC",
                       help=f"the gossip methods (default: {GOSSIP_ALGORITHMS})")
    train.add_argument("--local-runs", nargs="+", type=Path, default=None, metavar="DIR",
                       help="draw these run directories (or directories of them) instead of "
                       "training the local methods")
    train.add_argument("--gossip-runs", nargs="+", type=Path, default=None, metavar="DIR",
                       help="draw these run directories (or directories of them) instead of "
                       "training the gossip methods")
    train.add_argument("--runs", type=Path, default=None, metavar="DIR",
                       help="where the training runs go, a directory each (default: "
                       "benchmarks/results/report of the checkout, else a temporary one)")


def _root() -> Path | None:
    from gossamer.bench.harness import find_root

    try:
        return find_root()
    except FileNotFoundError:
        return None


def run(args: argparse.Namespace, command: str = "gossamer bench report") -> int:
    """Draw the figures that ``args`` asks for, each beside its page; print what it wrote."""
    if any(n < 1 for n in args.workers) or args.sim < 1:
        raise ValueError(f"--workers and --sim must be >= 1, got {args.workers}, {args.sim}")
    root = _root()
    out = args.out or (root or Path.cwd()) / "docs" / "figures"
    only = set(args.only or (SPEED_UP, LOCAL, GOSSIP))
    training = {LOCAL: (args.local_algorithms, args.local_runs),
                GOSSIP: (args.gossip_algorithms, args.gossip_runs)}
    # every setting and method is checked before the first (long) simulation
    specs = {name: _entries(spec) for name, (spec, given) in training.items()
             if name in only and given is None}
    base = _base_config(args) if specs else None
    for entries in specs.values():
        for _, algorithm in entries:
            algorithm.resolve(args.sim)  # e.g. a group size that does not divide --sim
    plan_args = [_plan_args(args, bandwidth, "-") for bandwidth in args.bandwidths] \
        if SPEED_UP in only else []
    out.mkdir(parents=True, exist_ok=True)

    written: list[Path] = []
    if plan_args:
        written += _speed_up_figure(plan_args, args, out, command)
    # (run directory, its label: the entry as given, or None for its config's method)
    runs: dict[str, list[tuple[Path, str | None]]] = {
        name: [(path, None) for path in _read_runs(given)]
        for name, (_, given) in training.items() if name in only and given is not None}
    if specs:
        assert base is not None
        with tempfile.TemporaryDirectory() as scratch:
            folder = args.runs or (root / "benchmarks" / "results" / "report" if root
                                   else Path(scratch))
            made = _train(specs, base, folder)
            runs.update({name: [(made[label], label) for label, _ in entries]
                         for name, entries in specs.items()})
    for name in (LOCAL, GOSSIP):
        if name in runs:
            written += _training_figure(name, runs[name], out, command)
    for path in written:
        print(f"wrote {path}", flush=True)
    return 0


# ----------------------------------------------------------------------------- the planner


def _plan_args(args: argparse.Namespace, bandwidth: str, out: str) -> argparse.Namespace:
    """``gossamer plan``'s arguments at ``bandwidth``, its parser's defaults for the rest."""
    from gossamer.plan import cli as plan_cli
    from gossamer.train.compare import parse_algorithms

    parse_algorithms(args.plan_algorithms)  # a bad name or option fails here, at once
    parser = argparse.ArgumentParser(prog="gossamer plan")
    plan_cli.add_arguments(parser)
    return parser.parse_args([
        "--workers", *map(str, args.workers), "--model", args.model,
        "--compute-time", str(args.compute_time), "--bandwidth", bandwidth,
        "--algorithms", args.plan_algorithms, "--out", out])


def _speed_up_figure(plan_args: Sequence[argparse.Namespace], args: argparse.Namespace,
                     out: Path, command: str) -> list[Path]:
    from gossamer.plan import cli as plan_cli
    from gossamer.plan.figure import bandwidth_table, plot_bandwidth, rate_label

    results = []
    with tempfile.TemporaryDirectory() as scratch:  # what plan writes itself is not kept
        for i, plan in enumerate(plan_args):
            print(f"[plan {i + 1}/{len(plan_args)}] {rate_label(_rate(plan.bandwidth))}",
                  file=sys.stderr, flush=True)
            plan.out = str(Path(scratch) / f"plan{i}")
            results.append(plan_cli.plan(plan))
    png = out / f"{SPEED_UP}.png"
    plot_bandwidth(results, png)
    first = results[0]
    workers = ", ".join(map(str, args.workers))
    text = [
        "# Predicted speed-up over AllReduce against bandwidth", "",
        f"Each method's time per step on {workers} workers of {first['model']} "
        f"({first['compute_time']:g} s of compute per step, {first['latency'] * 1e6:g} us "
        "of latency per message), predicted by the planner (`gossamer plan`, "
        "[plan.md](../plan.md)) at each bandwidth; a cell is the speed-up per step over "
        "AllReduce and the predicted seconds per step. A speed-up per step is not a speed-up "
        "to a target accuracy: a method that needs more steps loses part of it.", "",
        f"Made by `{command}`.", "",
        f"![predicted speed-up over AllReduce against bandwidth]({png.name})", "",
        *bandwidth_table(results), ""]
    page = out / f"{SPEED_UP}.md"
    page.write_text("\n".join(text))
    return [png, page]


def _rate(value: Any) -> float:
    from gossamer.comm.rate import parse_rate

    return parse_rate(value, arg="--bandwidths")


# ----------------------------------------------------------------------------- training runs


def _entries(spec: str) -> list[tuple[str, Any]]:
    from gossamer.train.compare import parse_algorithms

    return parse_algorithms(spec)


def _base_config(args: argparse.Namespace):
    """The training runs' settings: gossamer train's defaults, :data:`TRAIN_SETTINGS`, then
    ``--set``, ``--sim`` and ``--steps``."""
    from gossamer.train.config import TrainConfig, parse_options

    settings: dict[str, Any] = dict(TRAIN_SETTINGS)
    for key, value in parse_options(args.settings or []).items():
        if key in ("algorithm", "options", "compressor", "run_dir", "resume", "sim"):
            raise ValueError(f"--set {key}=...: the report sets {key} itself (methods with "
                             "--local-algorithms / --gossip-algorithms, workers with --sim)")
        settings[key] = yaml.safe_load(value) if value else value
    if args.steps is not None:
        settings["steps"] = args.steps
    for key in ("stragglers", "links", "faults", "milestones", "loggers"):
        if isinstance(settings.get(key), str | int):
            settings[key] = (settings[key],)
    try:
        config = TrainConfig(**settings, sim=args.sim, quiet=True)
    except TypeError as error:  # an unknown field
        raise ValueError(f"--set: {error}") from None
    config.check_effect()
    return config


def _train(specs: dict[str, list[tuple[str, Any]]], base: Any, folder: Path) -> dict[str, Path]:
    """Run each entry of ``specs`` once (AllReduce is in both figures), a run directory each
    under ``folder``; the run directory by label."""
    from gossamer.train.run import run_training

    entries = {label: algorithm for named in specs.values() for label, algorithm in named}
    made = {}
    for i, (label, algorithm) in enumerate(entries.items(), 1):
        run_dir = folder / re.sub(r"[^A-Za-z0-9_.=-]+", "_", label)
        print(f"[run {i}/{len(entries)}] {label} -> {run_dir}", file=sys.stderr, flush=True)
        run_training(base.replace(algorithm=algorithm, run_dir=str(run_dir), resume=False))
        made[label] = run_dir
    return made


def _read_runs(paths: Sequence[Path]) -> list[Path]:
    """The run directories of ``paths``: each one that holds ``metrics.jsonl``, or else the
    directories in it that do."""
    found = []
    for path in paths:
        if (path / "metrics.jsonl").is_file():
            found.append(path)
            continue
        inside = sorted(p for p in path.iterdir() if (p / "metrics.jsonl").is_file()) \
            if path.is_dir() else []
        if not inside:
            raise ValueError(f"{str(path)!r} is not a run directory and holds none "
                             "(no metrics.jsonl)")
        found += inside
    return found


def _training_figure(name: str, run_dirs: Sequence[tuple[Path, str | None]], out: Path,
                     command: str) -> list[Path]:
    from gossamer.train.report import load_metrics, markdown_table, plot_metric, task_line

    runs = []
    for path, label in run_dirs:
        runs.append(load_metrics(path))
        if label is not None:  # the entry as given, options included (as compare names it)
            runs[-1].name = label
    png = out / f"{name}.png"
    if name == LOCAL:
        title = "Loss against bytes sent: the local and outer-optimizer methods"
        plot_metric(runs, "loss", "bytes", png, title="eval loss vs bytes sent per worker",
                    train=False)
        about = ("The eval loss of the averaged model against the bytes each worker sent (a "
                 "log axis): the further left a curve reaches a loss, the less it sent for it.")
    else:
        title = "Accuracy against simulated time: the gossip methods"
        plot_metric(runs, "accuracy", "wall_clock", png,
                    title="eval accuracy vs simulated wall-clock")
        about = ("The eval accuracy of the averaged model against the simulated wall-clock: "
                 "the further left a curve reaches an accuracy, the sooner.")
    task = task_line(runs[0])
    network = runs[0].config.get("bandwidth")
    if isinstance(network, int | float):
        from gossamer.plan.figure import rate_label

        task += f", links of {rate_label(network)}"
    text = [f"# {title}", "", about, "", f"Task: {task}." if task else "",
            "", f"Made by `{command}`.", "",
            f"![{title.lower()}]({png.name})", "", markdown_table(runs)]
    page = out / f"{name}.md"
    page.write_text("\n".join(text))
    return [png, page]


def command_line(argv: Sequence[str]) -> str:
    """The command as typed: ``gossamer bench report ARGS``."""
    return shlex.join(["gossamer", "bench", "report", *argv])
