"""AllReduce step time against torch DistributedDataParallel, side by side in one run.

The same model, data and optimizer in both; each process alternates blocks of gossamer steps
and DDP steps, so both see the same machine load, and the figure is the ratio of the median
block times (target <= 1.05 over loopback; no longer than DDP on the emulated network).

    gossamer bench allreduce_vs_ddp --workers 2 4
    gossamer bench allreduce_vs_ddp --workers 4 --model resnet20 --emulate 1gbit

Over loopback the model is an MLP of about 1M parameters; ``--model resnet20`` (CIFAR-sized
inputs, batch 32) has a backward long enough to hide communication. ``--emulate RATE`` runs the
workers on an emulated network (a network namespace per worker, links of RATE: root, ``ip``
and ``tc`` needed), as ``gossamer launch --emulate bandwidth=RATE``.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from gossamer.bench import Results, mlp, sgd_step, timed_steps
from gossamer.bench.models import DDP_MLP


def _model(name: str) -> tuple[torch.nn.Module, tuple[int, ...]]:
    """The model of ``name`` (the same initial one on every rank) and one input's shape."""
    torch.manual_seed(0)
    if name == "mlp":
        return mlp(*DDP_MLP), (784,)
    from gossamer.train.models import build_model

    return build_model(name, (3, 32, 32), 10), (3, 32, 32)


def compare(comm, rounds: int, steps_per_block: int, batch: int,
            model: str = "mlp") -> dict[str, list[float]]:
    """Blocks of ``steps_per_block`` gossamer AllReduce steps and DDP steps, alternated for
    ``rounds`` rounds on this rank (its default process group is DDP's); the seconds per step
    of each block."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import gossamer

    ours, shape = _model(model)
    after, _ = _model(model)
    theirs = DistributedDataParallel(_model(model)[0])
    g = torch.Generator().manual_seed(comm.rank)
    x, y = torch.randn(batch, *shape, generator=g), torch.randint(0, 10, (batch,), generator=g)
    ours_opt = gossamer.distribute(ours, torch.optim.SGD(ours.parameters(), lr=0.01),
                                   gossamer.AllReduce(), comm)
    # the same, averaging after backward (no overlap): what the overlap buys
    after_opt = gossamer.distribute(after, torch.optim.SGD(after.parameters(), lr=0.01),
                                    gossamer.AllReduce(overlap=False), comm)
    theirs_opt = torch.optim.SGD(theirs.parameters(), lr=0.01)
    steps = {"gossamer": sgd_step(ours, ours_opt, (x, y)),
             "ddp": sgd_step(theirs, theirs_opt, (x, y)),
             "after_backward": sgd_step(after, after_opt, (x, y))}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():  # warm-up
        for _ in range(3):
            step()
    order = list(steps)
    for r in range(rounds):
        for name in order[r % 3:] + order[:r % 3]:  # each first as often as the others
            times[name].append(timed_steps(steps[name], steps_per_block,
                                           before_timing=dist.barrier).per_step)
    return times


def worker(rounds: int, steps_per_block: int, batch: int,
           model: str = "mlp") -> dict[str, list[float]]:
    from gossamer.comm import TorchCommunicator

    comm = TorchCommunicator.from_env(timeout=120)
    try:
        return compare(comm, rounds, steps_per_block, batch, model)
    finally:
        comm.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed block")
    parser.add_argument("--batch", type=int, default=None,
                        help="minibatch per worker (default: 64 for the MLP, 32 for resnet20)")
    parser.add_argument("--model", choices=["mlp", "resnet20"], default="mlp")
    parser.add_argument("--emulate", metavar="RATE", default=None,
                        help="run on an emulated network whose links have this bandwidth "
                             "(e.g. 1gbit; needs root, ip and tc)")


def run(args: argparse.Namespace, results: Results) -> int:
    from gossamer.testing import spawn_gloo

    batch = args.batch or (64 if args.model == "mlp" else 32)
    params = sum(p.numel() for p in _model(args.model)[0].parameters())
    rows = []
    for n in args.workers:
        task_args = {"rounds": args.rounds, "steps_per_block": args.steps, "batch": batch,
                     "model": args.model}
        if args.emulate:
            from benchmarks.emulation import run_task
            from gossamer.launch.netem import LinkSpec

            links = [LinkSpec(bandwidth=args.emulate, mtu=9000) for _ in range(n)]
            per_rank, _ = run_task(links, {"kind": "allreduce_vs_ddp", "args": task_args},
                                   timeout=1800)
        else:
            per_rank = spawn_gloo(worker, n, args=tuple(task_args.values()), timeout=900)
        # a step is as slow as its slowest rank: the max over ranks per block
        median = {name: 1e3 * statistics.median(
            max(r[name][i] for r in per_rank) for i in range(args.rounds))
            for name in ("gossamer", "ddp", "after_backward")}
        row = {"workers": n, "gossamer_step_ms": median["gossamer"],
               "ddp_step_ms": median["ddp"], "after_backward_step_ms": median["after_backward"],
               "ratio": median["gossamer"] / median["ddp"],
               "after_backward_ratio": median["after_backward"] / median["ddp"]}
        rows.append(row)
        print(f"{n} workers: gossamer {row['gossamer_step_ms']:.2f} ms/step, "
              f"DDP {row['ddp_step_ms']:.2f} ms/step, ratio {row['ratio']:.3f}; gossamer "
              f"without overlap {row['after_backward_step_ms']:.2f} ms/step "
              f"({row['after_backward_ratio']:.3f})")
    name = "allreduce_vs_ddp" + (f"_{args.model}" if args.model != "mlp" else "") + (
        f"_{args.emulate}" if args.emulate else "")
    results.write(name, {"parameters": params, "batch": batch, "model": args.model,
                         "emulate": args.emulate, "rounds": args.rounds, "steps": args.steps,
                         "rows": rows})
    return 0
