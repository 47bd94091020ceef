"""Gossip methods against AllReduce: accuracy, bytes and simulated speed.

    python -m benchmarks.gossip accuracy --data ../shared/data --workers 8 16
    python -m benchmarks.gossip accuracy --data ../shared/data --reuse allreduce sgp dpsgd
    python -m benchmarks.gossip speed --workers 8 32 128 --gbits 1 10 100

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
import torch.nn.functional as F
from torch import nn

from benchmarks.common import RESULTS, write_result

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


def accuracy(args: argparse.Namespace) -> None:
    from gossamer.train.compare import run_compare
    from gossamer.train.config import TrainConfig, load_recipe
    from gossamer.train.report import load_metrics

    recipes = Path(__file__).resolve().parents[1] / "recipes"
    base = TrainConfig(**load_recipe(recipes / "mnist-cnn.yaml"),
                       data_path=str(Path(args.data) / "mnist"), quiet=True)
    rows = []
    for n in args.workers:
        steps = base.steps * 8 // n  # the same epochs at every worker count
        config = base.replace(sim=n, steps=steps, eval_every=max(1, steps // 6))
        out = RESULTS / f"gossip-mnist-{n}"
        fresh = [m for m in METHODS if m not in args.reuse or not _finished(out / m)]
        if fresh:
            run_compare(",".join(fresh), config, out)
        model_bytes = None
        runs = {m: load_metrics(out / m) for m in METHODS}
        for method, run in runs.items():
            final = run.final
            if model_bytes is None:
                from gossamer.train.models import build_model

                model = build_model("cnn", (1, 28, 28), 10)
                model_bytes = 4 * sum(p.numel() for p in model.parameters())
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
        plot_consensus(rows, n, out / "consensus_distance.png")
    print(f"wrote {write_result('gossip_accuracy', {'rows': rows})}")


def _finished(run: Path) -> bool:
    """Whether ``run`` holds a finished run (its metrics end with the summary)."""
    metrics = run / "metrics.jsonl"
    return metrics.exists() and '"kind": "summary"' in metrics.read_text().splitlines()[-1]


def plot_consensus(rows: list[dict], n: int, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2), dpi=120)
    FigureCanvasAgg(fig)
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
    print(f"wrote {path}")


def _stand_in() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 384), nn.ReLU(), nn.Linear(384, 10))  # 102,538 params


def speed_worker(comm, method: str, steps: int) -> tuple[float, float]:
    """(simulated seconds per step, pairwise averagings per step for AD-PSGD)."""
    import gossamer
    from gossamer.algorithms import create

    model = _stand_in()
    algorithm = create(method, {"average_at_end": "false"} if method != "allreduce" else {})
    opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.01), algorithm,
                              comm)
    x, y = torch.randn(4, 256), torch.randint(0, 10, (4,))
    start, averaged = 0.0, 0
    for step in range(steps):
        if step == 2:  # after warm-up, when pipelines (OSGP) are full
            start, averaged = comm.clock(), getattr(opt.runtime, "averagings", 0)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    averagings = getattr(opt.runtime, "averagings", 0) - averaged
    return (comm.clock() - start) / (steps - 2), averagings / (steps - 2)


def speed(args: argparse.Namespace) -> None:
    from gossamer.comm import ComputeModel, NetworkModel, SimWorld

    params = sum(p.numel() for p in _stand_in().parameters())
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
                results = world.run(speed_worker, method, args.steps)
                row[method] = max(t for t, _ in results)
                if method == "adpsgd":
                    row["adpsgd_averagings_per_step"] = sum(a for _, a in results) / n
            rows.append(row)
            print(f"n={n:4d} {gbits:5g} Gbit/s: " + "  ".join(
                f"{m} {row[m]:.3f}s ({row['allreduce'] / row[m]:.2f}x)" for m in METHODS)
                + f"  adpsgd averagings/step {row['adpsgd_averagings_per_step']:.2f}")
    plot_speed(rows, RESULTS / f"{args.name}.png")
    path = write_result(args.name, {"parameters": 25.6e6, "stand_in": params,
                                         "compute_time": args.compute_time, "jitter": args.jitter,
                                         "latency": args.latency, "rows": rows})
    print(f"wrote {path}")


def plot_speed(rows: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    gbits = sorted({r["gbits"] for r in rows})
    fig = Figure(figsize=(4.0 * len(gbits), 4.0), dpi=120)
    FigureCanvasAgg(fig)
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
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="part", required=True)
    a = sub.add_parser("accuracy")
    a.add_argument("--data", default="../shared/data")
    a.add_argument("--workers", type=int, nargs="+", default=[8, 16])
    a.add_argument("--reuse", nargs="*", default=[], metavar="METHOD",
                   help="methods whose finished runs in benchmarks/results are reused "
                        "instead of run again (e.g. after a change to other methods only)")
    s = sub.add_parser("speed")
    s.add_argument("--workers", type=int, nargs="+", default=[8, 32, 128])
    s.add_argument("--gbits", type=float, nargs="+", default=[1, 10, 100])
    s.add_argument("--steps", type=int, default=12)
    s.add_argument("--compute-time", type=float, default=0.25)
    s.add_argument("--latency", type=float, default=50e-6)
    s.add_argument("--jitter", type=float, default=0.0, help="log-normal spread of step times")
    s.add_argument("--name", default="gossip_speed", help="result file name")
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    if args.part == "accuracy":
        accuracy(args)
    else:
        speed(args)


if __name__ == "__main__":
    main()
