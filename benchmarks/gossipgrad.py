"""GossipGraD against AllReduce (and SGP): bytes per worker per step, and accuracy.

    gossamer bench gossipgrad bytes --workers 8 16 32 64 128 256
    gossamer bench gossipgrad accuracy --data ../shared/data --workers 8 16
    gossamer bench gossipgrad accuracy --data ../shared/data --workers 8 \
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
(300 steps at 8 workers, 150 at 16, as the gossip benchmark); final eval accuracy (after the
exact average at the end) against AllReduce's, the consensus distance before that average, and
bytes per worker per step. ``--algorithms`` runs other entries (the first is the reference) and
``--name`` keeps their results apart (NAME_accuracy.json, NAME-mnist-N/).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from benchmarks.common import (
    RUN_DIR_UNSAFE,
    add_data_argument,
    add_steps_argument,
    cnn_bytes,
    mnist_cnn,
)
from gossamer.bench import Results, mlp, new_figure, sgd_step, timed_steps
from gossamer.bench.models import STAND_IN_MLP

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


def bytes_worker(comm, name: str, options: dict, steps: int) -> tuple[float, float, float]:
    """(bytes sent per step, of which to other nodes, simulated seconds per step) of one
    worker, after the set-up. A node is ``local_group_size`` consecutive ranks."""
    import gossamer
    from gossamer.algorithms import create

    model = mlp(*STAND_IN_MLP)
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

    total, inter = sent()  # the set-up broadcast is not counted
    times = timed_steps(sgd_step(model, opt, (x, y)), steps, clock=comm.clock)
    total_end, inter_end = sent()
    return (total_end - total) / steps, (inter_end - inter) / steps, times.per_step


def bytes_per_step(args: argparse.Namespace, results: Results) -> None:
    from gossamer.comm import ComputeModel, NetworkModel, SimWorld

    params = sum(p.numel() for p in mlp(*STAND_IN_MLP).parameters())
    model_bytes = 4 * params
    network = NetworkModel(latency=50e-6, bandwidth=10e9 / 8, size_scale=25.6e6 / params)
    rows = []
    for n in args.workers:
        for label, name, options in BYTES_METHODS:
            if n % options.get("local_group_size", 1):
                continue
            world = SimWorld(n, network=network, compute=ComputeModel(step_time=0.25), seed=0)
            ranks = world.run(bytes_worker, name, options, args.steps)
            sent = [b for b, _, _ in ranks]
            inter = sum(i for _, i, _ in ranks) / n
            analytic = analytic_bytes_per_step(name, options, n, model_bytes)
            row = {"workers": n, "method": label, "bytes_per_step_mean": sum(sent) / n,
                   "bytes_per_step_max": max(sent), "analytic_bytes_per_step": analytic,
                   "inter_node_bytes_per_step": inter, "model_bytes": model_bytes,
                   "models_per_step": sum(sent) / n / model_bytes,
                   "inter_node_models_per_step": inter / model_bytes,
                   "sim_seconds_per_step": max(t for _, _, t in ranks)}
            rows.append(row)
            print(f"n={n:4d} {label:30s} {row['bytes_per_step_mean'] / 1e3:9.1f} kB/step "
                  f"= {row['models_per_step']:.4f} models (analytic "
                  f"{analytic / model_bytes:.4f}, to other nodes "
                  f"{row['inter_node_models_per_step']:.4f}); "
                  f"{row['sim_seconds_per_step']:.3f} sim s/step")
    results.wrote(plot_bytes(rows, results.folder / "gossipgrad_bytes.png"))
    results.write("gossipgrad_bytes", {"parameters": params, "rows": rows})


def plot_bytes(rows: list[dict], path: Path) -> Path:
    fig = new_figure(6.4, 4.2)
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
    return path


def accuracy(args: argparse.Namespace, results: Results) -> None:
    from gossamer.train.compare import run_compare
    from gossamer.train.report import load_metrics

    base = mnist_cnn(args.data, steps=args.steps)
    model_bytes = cnn_bytes()
    labels = [entry.strip() for entry in args.algorithms.split(",")]
    rows = []
    for n in args.workers:
        steps = base.steps * 8 // n  # the same epochs at every worker count
        config = base.replace(sim=n, steps=steps, eval_every=max(1, steps // 6))
        out = results.folder / f"{args.name}-mnist-{n}"
        if not (args.reuse and (out / "report.md").exists()):
            run_compare(args.algorithms, config, out)
        reference = None
        for label in labels:
            run = load_metrics(out / re.sub(RUN_DIR_UNSAFE, "_", label))
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
    results.write(f"{args.name}_accuracy", {"model_bytes": model_bytes, "rows": rows})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="part", required=True)
    b = sub.add_parser("bytes")
    b.add_argument("--workers", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    b.add_argument("--steps", type=int, default=4)
    a = sub.add_parser("accuracy")
    add_data_argument(a)
    a.add_argument("--workers", type=int, nargs="+", default=[8, 16])
    a.add_argument("--algorithms", default=ACCURACY_METHODS,
                   help="gossamer compare entries; the first is the reference")
    a.add_argument("--name", default="gossipgrad",
                   help="results: NAME_accuracy.json and NAME-mnist-N/ run directories")
    a.add_argument("--reuse", action="store_true",
                   help="tabulate the run directories of an earlier run instead of training")
    add_steps_argument(a)


def run(args: argparse.Namespace, results: Results) -> int:
    {"bytes": bytes_per_step, "accuracy": accuracy}[args.part](args, results)
    return 0
