"""``gossamer plan``: a table and a plot of every method's predicted cost on a cluster.

For each worker count and method, :func:`~gossamer.plan.predict.predict` runs the method's
real runtime in the timing-only simulator; the table gives the time per step, the bytes each
worker sends per step, the share of the time spent waiting and the speed-up over AllReduce.
Given the directory of a ``gossamer compare`` run and a target accuracy, it also gives each
method's predicted time to that target: the steps the method needed there, times its predicted
step time here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HELP = "predict every method's step time, bytes and speed-up on a cluster"
DESCRIPTION = ("Predict each method's time per step, bytes per worker per step, idle fraction "
               "and speed-up over AllReduce at each worker count, from the timing-only "
               "simulator (the real runtimes on a model of shapes only); write plan.md, "
               "plan.json and plan.png. See docs/plan.md.")

#: the method every speed-up is over
BASELINE = "allreduce"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, nargs="+", default=[8, 32, 128],
                   help="worker counts (default: 8 32 128)")
    p.add_argument("--model", default="resnet50",
                   help="resnet50, gpt-1b, digits-mlp, or a parameter count such as 25.6M or "
                   "1e9 (a transformer-shaped stand-in); default resnet50")
    p.add_argument("--compute-time", type=float, default=0.25,
                   help="seconds of forward, backward and optimizer per step (default 0.25)")
    p.add_argument("--latency", type=float, default=50e-6,
                   help="seconds per message between nodes (default 50e-6)")
    p.add_argument("--bandwidth", default="10gbit",
                   help="each worker's link, e.g. 1gbit, 10gbit, 125MB/s (default 10gbit)")
    p.add_argument("--node-size", type=int, default=1,
                   help="workers per node, sharing faster links (default 1: none)")
    p.add_argument("--node-bandwidth", default=None,
                   help="the rate inside a node, e.g. 1000gbit (default: --bandwidth)")
    p.add_argument("--node-latency", type=float, default=None,
                   help="seconds per message inside a node (default: --latency)")
    p.add_argument("--straggler", action="append", default=[], metavar="RANK=FACTOR",
                   help="rank RANK computes FACTOR times slower (repeatable)")
    p.add_argument("--jitter", type=float, default=0.0,
                   help="log-normal spread of the step times (default 0)")
    p.add_argument("--algorithms", default=None,
                   help="comma-separated NAME or NAME:KEY=VALUE entries (default: every "
                   "registered method; with --compare-dir, the methods of its runs)")
    p.add_argument("--every-worker-up-to", type=int, default=None, metavar="N",
                   help="deprecated, no longer needed: every method is predicted at every "
                   "worker count (10,000 workers of AD-PSGD, simulated worker by worker, take "
                   "about a minute). Given, a method that is not symmetric is left out above "
                   "N workers, as before (default: none)")
    p.add_argument("--warmup", type=int, default=2, help="steps before the measured ones "
                   "(default 2)")
    p.add_argument("--steps", type=int, default=3, help="measured steps (default 3)")
    p.add_argument("--compare-dir", default=None,
                   help="a `gossamer compare` output directory: predict the time to "
                   "--target from the steps each method needed there")
    p.add_argument("--target", type=float, default=None,
                   help="eval accuracy to reach, in [0, 1] (with --compare-dir)")
    p.add_argument("--out", default="gossamer-plan",
                   help="directory for plan.md, plan.json and plan.png (default gossamer-plan)")


def parse_stragglers(entries: list[str]) -> dict[int, float]:
    """``["3=4", "7=2.5"]`` -> ``{3: 4.0, 7: 2.5}`` (ValueError naming --straggler)."""
    out = {}
    for entry in entries:
        rank, sep, factor = entry.partition("=")
        try:
            out[int(rank)] = float(factor)
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"--straggler expects RANK=FACTOR, got {entry!r}")
    return out


def steps_to_target(compare_dir: str | Path, target: float) -> dict[str, tuple[str, int | None]]:
    """For each run of a ``gossamer compare`` directory: its method's spec (``NAME`` or
    ``NAME:KEY=VALUE...``) and the first evaluated step whose accuracy reached ``target``
    (None: never), by the run's directory name."""
    import yaml

    root = Path(compare_dir)
    if not root.is_dir():
        raise ValueError(f"--compare-dir {str(root)!r} is not a directory")
    out: dict[str, tuple[str, int | None]] = {}
    for run in sorted(p for p in root.iterdir() if (p / "metrics.jsonl").is_file()):
        config = yaml.safe_load((run / "config.yaml").read_text()) or {}
        algorithm = config.get("algorithm") or {}
        spec = ":".join([algorithm.get("name", run.name)] + [
            f"{k}={v}" for k, v in sorted((algorithm.get("options") or {}).items())])
        reached = None
        for line in (run / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line) if line.strip() else {}
            if record.get("kind") == "eval" and record.get("eval_accuracy", 0.0) >= target:
                reached = int(record["step"])
                break
        out[run.name] = (spec, reached)
    if not out:
        raise ValueError(f"--compare-dir {str(root)!r} holds no run (no */metrics.jsonl)")
    return out


def _entries(args: argparse.Namespace, runs: dict[str, tuple[str, int | None]] | None
             ) -> list[tuple[str, Any]]:
    from gossamer.algorithms import available
    from gossamer.train.compare import parse_algorithms

    if args.algorithms:
        spec = args.algorithms
    elif runs is not None:
        spec = ",".join(dict.fromkeys(spec for spec, _ in runs.values()))
    else:
        spec = ",".join(available())
    entries = parse_algorithms(spec)
    if not any(label == BASELINE for label, _ in entries):  # the speed-ups need it
        entries = parse_algorithms(BASELINE) + entries
    return entries


#: a bare --bandwidth below this many bytes per second (1 Mbit/s) is taken for a missing unit
UNITLESS_FLOOR = 125e3


def _check_rate(arg: str, value: str | None) -> None:
    """A bare number is bytes per second; one below 1 Mbit/s is almost surely a rate whose
    unit was left out (``--bandwidth 10`` meant 10gbit, not 10 bytes/s): refuse it."""
    if value is None:
        return
    try:
        rate = float(value)
    except ValueError:
        return  # it has a unit: parse_rate checks it
    if rate < UNITLESS_FLOOR:
        raise ValueError(f"{arg} {value} has no unit and reads as {rate:g} bytes per second; "
                         f"write the unit, e.g. {arg} {value}gbit, {value}mbit or "
                         f"{value}MB/s (a bare number below {UNITLESS_FLOOR:g}, 1 Mbit/s, "
                         "is refused)")


def _admitted(entries: list[tuple[str, Any]], workers: list[int], every_up_to: int | None
              ) -> dict[int, list[tuple[str, Any]]]:
    """The entries that can be predicted at each worker count, found before any simulation
    of the model: each method is built and resolved for every worker count (a group size
    that does not divide one leaves the method out of that row, said once on stderr), and run
    for one step at 2 workers on a small model, timing-only, so that an option that fails
    only at run time (``dgc:aggregation=sparse_allreduce``) stops the plan at once, naming
    the method, rather than after the others have run. ValueError for a method that cannot
    be predicted at any worker count."""
    from gossamer.algorithms import create
    from gossamer.comm import ComputeModel, NetworkModel
    from gossamer.comm.sim import SimulationError
    from gossamer.plan.models import transformer
    from gossamer.plan.predict import predict

    admitted: dict[int, list[tuple[str, Any]]] = {n: [] for n in workers}
    for label, spec in entries:
        try:
            algorithm = create(spec, None) if isinstance(spec, str) else spec
            if isinstance(spec, str):
                spec = algorithm
        except ValueError as error:
            raise ValueError(f"--algorithms {label}: {error}") from None
        fits, limited = [], []
        for n in workers:
            try:
                resolved = algorithm.resolve(n)
            except ValueError as error:  # e.g. a group size that does not divide n
                print(f"  {label} at {n} workers: left out ({error})", file=sys.stderr)
                continue
            if every_up_to is not None and n > every_up_to and not resolved.symmetric():
                print(f"  {label} at {n} workers: left out (simulated worker by worker, above "
                      f"--every-worker-up-to {every_up_to}: leave the option out to include "
                      "it)", file=sys.stderr)
                limited.append(n)
                continue
            admitted[n].append((label, spec))
            fits.append(n)
        if not fits:
            if not limited:
                raise ValueError(f"--algorithms {label}: fits none of --workers {workers}")
            continue
        try:
            predict(spec, 2 if all(n >= 2 for n in fits) else 1, lambda: transformer(4096),
                    network=NetworkModel(), compute=ComputeModel(), warmup=1, steps=1)
        except ValueError as error:  # resolve() at 2 workers, where 2 is not a row
            if any(n == 2 for n in fits):
                raise ValueError(f"--algorithms {label}: {error}") from None
        except SimulationError as error:
            cause = error.__cause__ or error
            raise ValueError(f"--algorithms {label} cannot be predicted: "
                             f"{type(cause).__name__}: {cause}") from None
    return admitted


def plan(args: argparse.Namespace, *, on_row: Any = None) -> dict[str, Any]:
    """Every prediction of the command line's settings, as plan.json holds them; ``on_row``
    (optional) is called with the result so far after each prediction."""
    from gossamer.comm import ComputeModel, NetworkModel
    from gossamer.plan.models import model_builder
    from gossamer.plan.predict import predict

    if any(n < 1 for n in args.workers):
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    if args.steps < 1 or args.warmup < 0:
        raise ValueError(f"--steps must be >= 1 and --warmup >= 0, got {args.steps}, "
                         f"{args.warmup}")
    if (args.compare_dir is None) != (args.target is None):
        raise ValueError("--compare-dir and --target go together")
    _check_rate("--bandwidth", args.bandwidth)
    _check_rate("--node-bandwidth", args.node_bandwidth)
    build, model_label = model_builder(args.model)
    network = NetworkModel(latency=args.latency, bandwidth=args.bandwidth,
                           node_size=args.node_size, node_bandwidth=args.node_bandwidth,
                           node_latency=args.node_latency)
    stragglers = parse_stragglers(args.straggler)
    runs = steps_to_target(args.compare_dir, args.target) if args.compare_dir else None
    if args.every_worker_up_to is not None:
        if args.every_worker_up_to < 1:
            raise ValueError(f"--every-worker-up-to must be >= 1, got {args.every_worker_up_to}")
        print("  --every-worker-up-to is deprecated: every method is predicted at every worker "
              "count without it", file=sys.stderr)
    admitted = _admitted(_entries(args, runs), args.workers, args.every_worker_up_to)
    result = {"model": model_label, "compute_time": args.compute_time,
              "latency": args.latency, "bandwidth": network.bandwidth,
              "node_size": args.node_size, "node_bandwidth": network.node_bandwidth,
              "node_latency": args.node_latency, "stragglers": stragglers,
              "jitter": args.jitter, "warmup": args.warmup, "steps": args.steps,
              "target": args.target, "rows": []}
    rows = result["rows"]
    for n in args.workers:
        compute = ComputeModel(step_time=args.compute_time, jitter=args.jitter,
                               stragglers={r: f for r, f in stragglers.items() if r < n})
        for label, algorithm in admitted[n]:
            found = predict(algorithm, n, build, network=network, compute=compute,
                            warmup=args.warmup, steps=args.steps, label=label)
            print(f"  {n} workers, {label}: {found.step_time:.4g} s per step "
                  f"({found.real_seconds:.1f} s to simulate)", file=sys.stderr)
            rows.append(found.as_dict())
            _speed_ups(rows)
            if runs is not None:
                _to_target(rows[-1], runs)
            if on_row is not None:
                on_row(result)
    return result


def _to_target(row: dict[str, Any], runs: dict[str, tuple[str, int | None]]) -> None:
    reached = [steps for name, (spec, steps) in runs.items() if row["method"] in (spec, name)]
    row["steps_to_target"] = reached[0] if reached else None
    row["time_to_target"] = (None if not reached or reached[0] is None
                             else reached[0] * row["step_time"])


def _speed_ups(rows: list[dict[str, Any]]) -> None:
    baseline = {r["workers"]: r["step_time"] for r in rows if r["method"] == BASELINE}
    for row in rows:
        base = baseline.get(row["workers"])
        row["speed_up"] = base / row["step_time"] if base and row["step_time"] else None


def table(result: dict[str, Any]) -> list[str]:
    """The markdown lines of plan.md's table."""
    from gossamer.train.style import markdown_table

    target = result.get("target")
    header = ["workers", "method", "s / step", "speed-up over AllReduce",
              "MB sent / worker / step", "idle"]
    if target is not None:
        header += ["steps to target", "time to target"]
    lines = []
    for r in result["rows"]:
        cells = [r["workers"], r["method"], f"{r['step_time']:.4g}",
                 "-" if r["speed_up"] is None else f"{r['speed_up']:.2f}x",
                 f"{r['bytes_per_step'] / 1e6:.4g}", f"{100 * r['idle_fraction']:.0f}%"]
        if target is not None:
            steps, seconds = r.get("steps_to_target"), r.get("time_to_target")
            cells += ["not reached" if steps is None else steps,
                      "-" if seconds is None else f"{seconds:.4g} s"]
        lines.append(cells)
    return markdown_table(header, lines)


def _settings(result: dict[str, Any]) -> str:
    settings = (f"Model {result['model']}, {result['compute_time']:g} s of compute per step, "
                f"links of {result['bandwidth'] * 8 / 1e9:g} Gbit/s and "
                f"{result['latency'] * 1e6:g} us")
    if result["node_size"] > 1:
        settings += f", nodes of {result['node_size']} workers"
    if result["stragglers"]:
        settings += ", stragglers " + ", ".join(
            f"rank {r} x{f:g}" for r, f in result["stragglers"].items())
    return settings


def write(result: dict[str, Any], out: Path, *, figure: bool = True) -> list[str]:
    """plan.md and plan.json (and plan.png with ``figure``) of ``result`` in ``out``; the
    table's lines. Written after each prediction, so that a stopped plan keeps its rows."""
    from gossamer.plan.figure import plot

    out.mkdir(parents=True, exist_ok=True)
    lines = table(result)
    picture = "\n\n![step time and speed-up](plan.png)\n" if figure else "\n"
    _replace(out / "plan.md", "# gossamer plan\n\n" + _settings(result) + ".\n\n"
             + "\n".join(lines) + picture)
    _replace(out / "plan.json", json.dumps(result, indent=1))
    if figure:
        plot(result, out / "plan.png")
    return lines


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file: a reader never sees half."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    result = plan(args, on_row=lambda partial: write(partial, out, figure=False))
    lines = write(result, out)
    print("\n".join(lines))
    print(f"plan: {out / 'plan.md'}")
    return 0
