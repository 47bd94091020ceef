"""AllReduce step time against torch DistributedDataParallel, gloo over loopback.

The same model (about 1M parameters), data and optimizer in both; each process alternates
blocks of gossamer steps and DDP steps, so both see the same machine load, and the figure is
the ratio of the median block times (target <= 1.05).

    gossamer bench allreduce_vs_ddp --workers 2 4
"""

from __future__ import annotations

import argparse
import statistics

import torch

from gossamer.bench import Results, mlp, sgd_step, timed_steps
from gossamer.bench.models import DDP_MLP


def worker(rounds: int, steps_per_block: int, batch: int) -> dict[str, list[float]]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import gossamer
    from gossamer.comm import TorchCommunicator

    comm = TorchCommunicator.from_env(timeout=120)
    g = torch.Generator().manual_seed(comm.rank)
    x, y = torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g)

    ours = mlp(*DDP_MLP)
    ours_opt = gossamer.distribute(ours, torch.optim.SGD(ours.parameters(), lr=0.01),
                                   gossamer.AllReduce(), comm)
    theirs = DistributedDataParallel(mlp(*DDP_MLP))
    theirs_opt = torch.optim.SGD(theirs.parameters(), lr=0.01)
    steps = {"gossamer": sgd_step(ours, ours_opt, (x, y)),
             "ddp": sgd_step(theirs, theirs_opt, (x, y))}
    times: dict[str, list[float]] = {"gossamer": [], "ddp": []}
    for step in steps.values():  # warm-up
        for _ in range(3):
            step()
    for r in range(rounds):
        for name in ("gossamer", "ddp") if r % 2 == 0 else ("ddp", "gossamer"):
            times[name].append(timed_steps(steps[name], steps_per_block,
                                           before_timing=dist.barrier).per_step)
    comm.close()
    return times


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed block")
    parser.add_argument("--batch", type=int, default=64, help="minibatch per worker")


def run(args: argparse.Namespace, results: Results) -> int:
    from gossamer.testing import spawn_gloo

    params = sum(p.numel() for p in mlp(*DDP_MLP).parameters())
    rows = []
    for n in args.workers:
        per_rank = spawn_gloo(worker, n, args=(args.rounds, args.steps, args.batch), timeout=900)
        # a step is as slow as its slowest rank: take the max over ranks per block
        ours = [max(r["gossamer"][i] for r in per_rank) for i in range(args.rounds)]
        ddp = [max(r["ddp"][i] for r in per_rank) for i in range(args.rounds)]
        row = {
            "workers": n,
            "gossamer_step_ms": 1e3 * statistics.median(ours),
            "ddp_step_ms": 1e3 * statistics.median(ddp),
        }
        row["ratio"] = row["gossamer_step_ms"] / row["ddp_step_ms"]
        rows.append(row)
        print(f"{n} workers: gossamer {row['gossamer_step_ms']:.2f} ms/step, "
              f"DDP {row['ddp_step_ms']:.2f} ms/step, ratio {row['ratio']:.3f}")
    results.write("allreduce_vs_ddp", {"parameters": params, "batch": args.batch,
                                       "rounds": args.rounds, "steps": args.steps, "rows": rows})
    return 0
