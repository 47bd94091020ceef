"""Gossip methods against AllReduce: accuracy, bytes and simulated speed.

    gossamer bench gossip accuracy --data ../shared/data --workers 8 16
    gossamer bench gossip accuracy --data ../shared/data --reuse allreduce sgp dpsgd
    gossamer bench gossip speed --workers 8 32 128 --gbits 1 10 100

accuracy: the MNIST CNN (recipes/mnist-cnn.yaml) with AllReduce, SGP, Overlap SGP, D-PSGD and
AD-PSGD, the same number of epochs at every worker count (300 steps at 8 workers, 150 at 16);
final eval accuracy against AllReduce's, consensus-distance curves, and bytes sent per worker
per step against the analytic minimum of each method.

speed: simulated seconds per step of a model of ResNet-50's size (25.6M parameters, computed
with a 0.1M-parameter stand-in and NetworkModel.size_scale) with 0.25 s of compute per step.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.common import add_data_argument, add_steps_argument, cnn_bytes, mnist_cnn
from gossamer.bench import Results, mlp, new_figure, sgd_step, timed_steps
from gossamer.bench.models import STAND_IN_MLP

METHODS = ["allreduce", "sgp", "osgp", "dpsgd", "adpsgd"]


def analytic_bytes_per_step(name: str, n: int, model_bytes: int, element: int = 4) -> float:
    """The least bytes per worker per step each method must send (push-sum adds its weight)."""
    if name == "allreduce":
        return 2 * (n - 1) / n * model_bytes
    if name in ("sgp", "osgp"):
        return model_bytes + element  # one out-peer per step: parameters and weight
    if name == "dpsgd":
        return 2 * model_bytes if n > 2 else model_bytes  # ring: both neighbours
    if name == "adpsgd":
        return model_bytes  # a request (active) or a reply (passive) per step on average
    raise ValueError(name)


def accuracy(args: argparse.Namespace, results: Results) -> None:
    from gossamer.train.compare import run_compare
    from gossamer.train.report import load_metrics

    base = mnist_cnn(args.data, steps=args.steps)
    model_bytes = cnn_bytes()
    rows = []
    for n in args.workers:
        steps = base.steps * 8 // n  # the same epochs at every worker count
        config = base.replace(sim=n, steps=steps, eval_every=max(1, steps // 6))
        out = results.folder / f"gossip-mnist-{n}"
        fresh = [m for m in METHODS if m not in args.reuse or not _finished(out / m)]
        if fresh:
            run_compare(",".join(fresh), config, out)
        runs = {m: load_metrics(out / m) for m in METHODS}
        for method, run in runs.items():
            final = run.final
            per_step = final["bytes_sent"] / steps
            rows.append({
                "workers": n, "method": method, "steps": steps,
                "eval_accuracy": final["eval_accuracy"],
                "delta_vs_allreduce_points": 100 * (final["eval_accuracy"]
                                                    - runs["allreduce"].final["eval_accuracy"]),
                "bytes_per_step": per_step,
                "analytic_bytes_per_step": analytic_bytes_per_step(method, n, model_bytes),
                "consensus": [(e["step"], e["consensus_distance"]) for e in run.evals],
            })
            rows[-1]["bytes_ratio"] = per_step / rows[-1]["analytic_bytes_per_step"]
            print(f"n={n:3d} {method:9s} acc {100 * final['eval_accuracy']:.2f}% "
                  f"({rows[-1]['delta_vs_allreduce_points']:+.2f}) bytes/step "
                  f"{per_step / 1e6:.3f} MB = {rows[-1]['bytes_ratio']:.4f} x minimum")
        results.wrote(plot_consensus(rows, n, out / "consensus_distance.png"))
    results.write("gossip_accuracy", {"rows": rows})


def _finished(run: Path) -> bool:
    """Whether ``run`` holds a finished run (its metrics end with the summary)."""
    metrics = run / "metrics.jsonl"
    return metrics.exists() and '"kind": "summary"' in metrics.read_text().splitlines()[-1]


def plot_consensus(rows: list[dict], n: int, path: Path) -> Path:
    fig = new_figure(6.4, 4.2)
    ax = fig.add_subplot()
    for row in rows:
        if row["workers"] != n or row["method"] == "allreduce":
            continue
        steps, values = zip(*row["consensus"][:-1], strict=True)  # the last is after averaging
        ax.plot(steps, values, marker=".", label=row["method"])
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("consensus distance (mean ||x_i - x_mean||^2)")
    ax.set_title(f"MNIST CNN, {n} simulated workers")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return path


def speed_worker(comm, method: str, steps: int) -> tuple[float, float]:
    """(simulated seconds per step, pairwise averagings per step for AD-PSGD), the first two
    steps left out (pipelines such as OSGP's fill up)."""
    import gossamer
    from gossamer.algorithms import create

    model = mlp(*STAND_IN_MLP)
    algorithm = create(method, {"average_at_end": "false"} if method != "allreduce" else {})
    opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.01), algorithm,
                              comm)
    x, y = torch.randn(4, 256), torch.randint(0, 10, (4,))  # from mlp()'s seed
    averaged = []

    def count() -> None:
        averaged.append(getattr(opt.runtime, "averagings", 0))

    times = timed_steps(sgd_step(model, opt, (x, y)), steps - 2, warmup=2, clock=comm.clock,
                        before_timing=count)
    averagings = getattr(opt.runtime, "averagings", 0) - averaged[0]
    return times.per_step, averagings / (steps - 2)


def speed(args: argparse.Namespace, results: Results) -> None:
    from gossamer.comm import ComputeModel, NetworkModel, SimWorld

    params = sum(p.numel() for p in mlp(*STAND_IN_MLP).parameters())
    scale = 25.6e6 / params
    rows = []
    for n in args.workers:
        for gbits in args.gbits:
            network = NetworkModel(latency=args.latency, bandwidth=gbits * 1e9 / 8,
                                   size_scale=scale)
            row = {"workers": n, "gbits": gbits}
            for method in METHODS:
                world = SimWorld(n, network=network,
                                 compute=ComputeModel(step_time=args.compute_time,
                                                      jitter=args.jitter), seed=0)
                ranks = world.run(speed_worker, method, args.steps)
                row[method] = max(t for t, _ in ranks)
                if method == "adpsgd":
                    row["adpsgd_averagings_per_step"] = sum(a for _, a in ranks) / n
            rows.append(row)
            print(f"n={n:4d} {gbits:5g} Gbit/s: " + "  ".join(
                f"{m} {row[m]:.3f}s ({row['allreduce'] / row[m]:.2f}x)" for m in METHODS)
                + f"  adpsgd averagings/step {row['adpsgd_averagings_per_step']:.2f}")
    results.wrote(plot_speed(rows, results.folder / f"{args.name}.png"))
    results.write(args.name, {"parameters": 25.6e6, "stand_in": params,
                              "compute_time": args.compute_time, "jitter": args.jitter,
                              "latency": args.latency, "rows": rows})


def plot_speed(rows: list[dict], path: Path) -> Path:
    gbits = sorted({r["gbits"] for r in rows})
    fig = new_figure(4.0 * len(gbits), 4.0)
    for i, g in enumerate(gbits):
        ax = fig.add_subplot(1, len(gbits), i + 1)
        subset = sorted((r for r in rows if r["gbits"] == g), key=lambda r: r["workers"])
        for method in METHODS:
            ax.plot([r["workers"] for r in subset], [r[method] for r in subset], marker="o",
                    label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers")
        ax.set_ylabel("simulated seconds per step")
        ax.set_title(f"{g:g} Gbit/s, 25.6M parameters")
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="part", required=True)
    a = sub.add_parser("accuracy")
    add_data_argument(a)
    a.add_argument("--workers", type=int, nargs="+", default=[8, 16])
    a.add_argument("--reuse", nargs="*", default=[], metavar="METHOD",
                   help="methods whose finished runs in benchmarks/results are reused "
                        "instead of run again (e.g. after a change to other methods only)")
    add_steps_argument(a)
    s = sub.add_parser("speed")
    s.add_argument("--workers", type=int, nargs="+", default=[8, 32, 128])
    s.add_argument("--gbits", type=float, nargs="+", default=[1, 10, 100])
    s.add_argument("--steps", type=int, default=12)
    s.add_argument("--compute-time", type=float, default=0.25)
    s.add_argument("--latency", type=float, default=50e-6)
    s.add_argument("--jitter", type=float, default=0.0, help="log-normal spread of step times")
    s.add_argument("--name", default="gossip_speed", help="result file name")


def run(args: argparse.Namespace, results: Results) -> int:
    {"accuracy": accuracy, "speed": speed}[args.part](args, results)
    return 0
