"""WAGMA against AllReduce, local SGD and SGP with one straggler: steps per second.

    gossamer bench wagma sim --workers 8 --steps 100
    gossamer bench wagma gloo --workers 4 --steps 60

sim: SimWorld with 10 ms of compute per step (20% jitter) and a 1 Gbit/s network; rank 3
takes 4x as long. Each method trains the same small MLP for the same number of steps; the
figure is the fast workers' steps per second of virtual time (the slowest fast worker), next
to the straggler's and to the same run without a straggler.

gloo: the same on real processes over loopback; every step sleeps 20 ms, rank 3 sleeps
80 ms (4x), so the figure does not depend on how busy the CPU is.
"""

from __future__ import annotations

import argparse
import time

import torch

from gossamer.bench import Results, markdown_table, mlp, sgd_step, timed_steps
from gossamer.bench.models import WAGMA_MLP

METHODS = {
    "allreduce": ("allreduce", {}),
    "localsgd H=4": ("localsgd", {"period": 4}),
    "sgp": ("sgp", {}),
    "wagma tau=1": ("wagma", {"tau": 1}),
    "wagma tau=2": ("wagma", {"tau": 2}),
    "wagma tau=3": ("wagma", {"tau": 3}),
    "wagma tau=3 K=0": ("wagma", {"tau": 3, "allreduce_every": 0}),
}


def _train(comm, name: str, options: dict, steps: int, sleep: float = 0.0):
    import gossamer
    from gossamer.algorithms import create

    model = mlp(*WAGMA_MLP)
    opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.05),
                              create(name, options), comm)
    g = torch.Generator().manual_seed(comm.rank)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:  # a fresh one every step
        return torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)

    step = sgd_step(model, opt, batch, after_backward=(lambda: time.sleep(sleep)) if sleep
                    else None)
    duration = timed_steps(step, steps, clock=comm.clock).elapsed
    opt.finish()
    return {"duration": duration, "bytes": comm.stats.total_bytes_sent}


def _summary(results: list[dict], steps: int, straggler: int) -> dict:
    fast = max(r["duration"] for i, r in enumerate(results) if i != straggler)
    return {"fast_steps_per_s": steps / fast,
            "straggler_steps_per_s": steps / results[straggler]["duration"],
            "bytes_per_worker_step": sum(r["bytes"] for r in results) / len(results) / steps}


def sim(args: argparse.Namespace, results: Results) -> None:
    from gossamer.comm import ComputeModel, NetworkModel, SimWorld

    rows = []
    for label, (name, options) in METHODS.items():
        row = {"method": label}
        for slow, key in ((4.0, "straggler"), (1.0, "none")):
            world = SimWorld(args.workers, network=NetworkModel(bandwidth=125e6),
                             compute=ComputeModel(step_time=0.01, jitter=0.2,
                                                  stragglers={3: slow}), seed=1)
            row[key] = _summary(world.run(_train, name, options, args.steps), args.steps, 3)
        rows.append(row)
        print(f"{label:18s} fast {row['straggler']['fast_steps_per_s']:7.1f} steps/s with "
              f"straggler, {row['none']['fast_steps_per_s']:7.1f} without", flush=True)
    _report("sim", rows, args, results)


def _gloo_worker(name: str, options: dict, steps: int, base: float):
    from gossamer.comm import TorchCommunicator

    comm = TorchCommunicator.from_env(backend="gloo", timeout=120)  # CPU tensors
    try:
        return _train(comm, name, options, steps, sleep=base * (4 if comm.rank == 3 else 1))
    finally:
        comm.close()


def gloo(args: argparse.Namespace, results: Results) -> None:
    from gossamer.testing import spawn_gloo

    rows = []
    for label, (name, options) in METHODS.items():
        ranks = spawn_gloo(_gloo_worker, args.workers, args=(name, options, args.steps, 0.02),
                           timeout=600)
        row = {"method": label, "straggler": _summary(ranks, args.steps, 3)}
        rows.append(row)
        print(f"{label:18s} fast {row['straggler']['fast_steps_per_s']:7.1f} steps/s, "
              f"straggler {row['straggler']['straggler_steps_per_s']:6.1f}", flush=True)
    _report("gloo", rows, args, results)


def _report(kind: str, rows: list[dict], args: argparse.Namespace, results: Results) -> None:
    base = rows[0]["straggler"]["fast_steps_per_s"]
    header = ["method", "fast workers, steps/s", "vs AllReduce", "straggler, steps/s",
              *(["no straggler, steps/s"] if kind == "sim" else []), "bytes/worker/step"]
    cells = []
    for row in rows:
        s = row["straggler"]
        cells.append([row["method"], f"{s['fast_steps_per_s']:.1f}",
                      f"{s['fast_steps_per_s'] / base:.2f}x", f"{s['straggler_steps_per_s']:.1f}",
                      *([f"{row['none']['fast_steps_per_s']:.1f}"] if kind == "sim" else []),
                      f"{s['bytes_per_worker_step']:.0f}"])
    print("\n" + "\n".join(markdown_table(header, cells)))
    results.write(f"wagma_{kind}", {"workers": args.workers, "steps": args.steps, "rows": rows})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="part", required=True)
    p = sub.add_parser("sim", help="SimWorld, one 4x straggler")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--steps", type=int, default=100)
    p = sub.add_parser("gloo", help="gloo processes on this machine, one 4x straggler")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=60)


def run(args: argparse.Namespace, results: Results) -> int:
    {"sim": sim, "gloo": gloo}[args.part](args, results)
    return 0
