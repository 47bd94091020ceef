"""GossipGraD against AllReduce (and SGP): bytes per worker per step, and accuracy.

    python -m benchmarks.gossipgrad bytes --workers 8 16 32 64 128 256
    python -m benchmarks.gossipgrad accuracy --data ../shared/data --workers 8 16
    python -m benchmarks.gossipgrad accuracy --data ../shared/data --workers 8 \
        --algorithms allreduce,gossipgrad:allreduce_every=10 --name gossipgrad_sync

bytes: simulated workers train a 102,538-parameter MLP for a few steps with GossipGraD
(local groups of 1 and of 4, both topologies) and with AllReduce; bytes sent per worker per
step, measured by the communicator's counters (the initial broadcast excluded), against the
analytic figures: GossipGraD sends one model to its partner plus a local ring all-reduce of
``2 (g-1)/g`` models, whatever n; AllReduce ``2 (n-1)/n`` models. Also the simulated seconds per
step of a model of ResNet-50's size (25.6M parameters via NetworkModel.size_scale) on a
10 Gbit/s network with 0.25 s of compute per step.

accuracy: the MNIST CNN (recipes/mnist-cnn.yaml) with AllReduce, SGP and GossipGraD (both
topologies, and CUBE with local groups of 2), the same number of epochs at every worker count
(300 steps at 8 workers, 150 at 16, as benchmarks/gossip.py); final eval accuracy (after the
exact average at the end) against AllReduce's, the consensus distance before that average, and
bytes per worker per step. ``--algorithms`` runs other entries (the first is the reference) and
``--name`` keeps their results apart (NAME_accuracy.json, NAME-mnist-N/).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import RESULTS, write_result

# (label, registry name, options) of the byte-count runs
BYTES_METHODS = [
    ("allreduce", "allreduce", {}),
    ("gossipgrad", "gossipgrad", {}),
    ("gossipgrad:topology=cube", "gossipgrad", {"topology": "cube"}),
    ("gossipgrad:local_group_size=4", "gossipgrad", {"local_group_size": 4}),
]
ACCURACY_METHODS = ("allreduce,sgp,gossipgrad,gossipgrad:topology=cube,"
                    "gossipgrad:topology=cube:local_group_size=2")


def analytic_bytes_per_step(name: str, options: dict, n: int, model_bytes: int) -> float:
    """The bytes per worker per step each method sends, by the ring all-reduce's count."""
    if name == "allreduce":
        return 2 * (n - 1) / n * model_bytes
    g = options.get("local_group_size", 1)
    return model_bytes + 2 * (g - 1) / g * model_bytes  # partner + local all-reduce


def _stand_in() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 384), nn.ReLU(), nn.Linear(384, 10))  # 102,538 params


def bytes_worker(comm, name: str, options: dict, steps: int) -> tuple[float, float, float]:
    """(bytes sent per step, of which to other nodes, simulated seconds per step) of one
    worker, after the set-up. A node is ``local_group_size`` consecutive ranks."""
    import gossamer
    from gossamer.algorithms import create

    model = _stand_in()
    if name != "allreduce":
        options = {**options, "average_at_end": False}
    opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.01),
                              create(name, options), comm)
    g = torch.Generator().manual_seed(comm.rank)
    x, y = torch.randn(4, 256, generator=g), torch.randint(0, 10, (4,), generator=g)
    local = options.get("local_group_size", 1)

    def sent() -> tuple[int, int]:
        per_peer = comm.stats.bytes_sent
        return (sum(per_peer.values()),
                sum(b for peer, b in per_peer.items() if peer // local != comm.rank // local))

    (total, inter), start = sent(), comm.clock()  # the set-up broadcast is not counted
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    (total_end, inter_end) = sent()
    return ((total_end - total) / steps, (inter_end - inter) / steps,
            (comm.clock() - start) / steps)


def bytes_per_step(args: argparse.Namespace) -> None:
    from gossamer.comm import ComputeModel, NetworkModel, SimWorld

    params = sum(p.numel() for p in _stand_in().parameters())
    model_bytes = 4 * params
    network = NetworkModel(latency=50e-6, bandwidth=10e9 / 8, size_scale=25.6e6 / params)
    rows = []
    for n in args.workers:
        for label, name, options in BYTES_METHODS:
            if n % options.get("local_group_size", 1):
                continue
            world = SimWorld(n, network=network, compute=ComputeModel(step_time=0.25), seed=0)
            results = world.run(bytes_worker, name, options, args.steps)
            sent = [b for b, _, _ in results]
            inter = sum(i for _, i, _ in results) / n
            analytic = analytic_bytes_per_step(name, options, n, model_bytes)
            row = {"workers": n, "method": label, "bytes_per_step_mean": sum(sent) / n,
                   "bytes_per_step_max": max(sent), "analytic_bytes_per_step": analytic,
                   "inter_node_bytes_per_step": inter, "model_bytes": model_bytes,
                   "models_per_step": sum(sent) / n / model_bytes,
                   "inter_node_models_per_step": inter / model_bytes,
                   "sim_seconds_per_step": max(t for _, _, t in results)}
            rows.append(row)
            print(f"n={n:4d} {label:30s} {row['bytes_per_step_mean'] / 1e3:9.1f} kB/step "
                  f"= {row['models_per_step']:.4f} models (analytic "
                  f"{analytic / model_bytes:.4f}, to other nodes "
                  f"{row['inter_node_models_per_step']:.4f}); "
                  f"{row['sim_seconds_per_step']:.3f} sim s/step")
    plot_bytes(rows, RESULTS / "gossipgrad_bytes.png")
    print(f"wrote {write_result('gossipgrad_bytes', {'parameters': params, 'rows': rows})}")


def plot_bytes(rows: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for label, _, _ in BYTES_METHODS:
        subset = sorted((r for r in rows if r["method"] == label), key=lambda r: r["workers"])
        ax.plot([r["workers"] for r in subset], [r["models_per_step"] for r in subset],
                marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("simulated workers")
    ax.set_ylabel("bytes sent per worker per step / model bytes")
    ax.set_title("GossipGraD vs AllReduce: traffic per worker")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def accuracy(args: argparse.Namespace) -> None:
    from gossamer.train.compare import parse_algorithms, run_compare
    from gossamer.train.config import TrainConfig, load_recipe
    from gossamer.train.models import build_model
    from gossamer.train.report import load_metrics

    recipes = Path(__file__).resolve().parents[1] / "recipes"
    base = TrainConfig(**load_recipe(recipes / "mnist-cnn.yaml"),
                       data_path=str(Path(args.data) / "mnist"), quiet=True)
    model = build_model("cnn", (1, 28, 28), 10)
    model_bytes = 4 * sum(p.numel() for p in model.parameters())
    entries = parse_algorithms(args.algorithms)
    rows = []
    for n in args.workers:
        steps = base.steps * 8 // n  # the same epochs at every worker count
        config = base.replace(sim=n, steps=steps, eval_every=max(1, steps // 6))
        out = RESULTS / f"{args.name}-mnist-{n}"
        if not (args.reuse and (out / "report.md").exists()):
            run_compare(args.algorithms, config, out)
        reference = None
        for label, _, _ in entries:
            run = load_metrics(out / re.sub(r"[^A-Za-z0-9_.=-]+", "_", label))  # as compare
            final = run.final
            if reference is None:
                reference = final["eval_accuracy"]  # the first entry: allreduce
            before = run.evals[-2] if len(run.evals) > 1 else final  # before the final average
            before_end = before["consensus_distance"]
            workers = before["worker_eval_accuracy"]
            rows.append({
                "workers": n, "method": label, "steps": steps,
                "eval_accuracy": final["eval_accuracy"],
                "delta_vs_allreduce_points": 100 * (final["eval_accuracy"] - reference),
                "bytes_per_step": final["bytes_sent"] / steps,
                "models_per_step": final["bytes_sent"] / steps / model_bytes,
                "consensus_before_final_average": before_end,
                "worker_accuracy_before_final_average": sum(workers) / len(workers),
            })
            r = rows[-1]
            print(f"n={n:3d} {label:42s} acc {100 * r['eval_accuracy']:.2f}% "
                  f"({r['delta_vs_allreduce_points']:+.2f}) bytes/step "
                  f"{r['bytes_per_step'] / 1e6:.3f} MB = {r['models_per_step']:.3f} models, "
                  f"consensus {before_end:.3g}, workers before the average "
                  f"{100 * r['worker_accuracy_before_final_average']:.2f}%")
    path = write_result(f"{args.name}_accuracy", {"model_bytes": model_bytes, "rows": rows})
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="part", required=True)
    b = sub.add_parser("bytes")
    b.add_argument("--workers", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    b.add_argument("--steps", type=int, default=4)
    a = sub.add_parser("accuracy")
    a.add_argument("--data", default="../shared/data")
    a.add_argument("--workers", type=int, nargs="+", default=[8, 16])
    a.add_argument("--algorithms", default=ACCURACY_METHODS,
                   help="gossamer compare entries; the first is the reference")
    a.add_argument("--name", default="gossipgrad",
                   help="results: NAME_accuracy.json and NAME-mnist-N/ run directories")
    a.add_argument("--reuse", action="store_true",
                   help="tabulate the run directories of an earlier run instead of training")
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    if args.part == "bytes":
        bytes_per_step(args)
    else:
        accuracy(args)


if __name__ == "__main__":
    main()
