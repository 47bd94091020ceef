"""AllReduce step time against torch DistributedDataParallel, side by side in one run.

The same model, data and optimizer in both; each process alternates blocks of gossamer steps
and DDP steps, so both see the same machine load, and the figure is the ratio of the median
block times (target <= 1.05 over loopback; no longer than DDP on the emulated network).

    gossamer bench allreduce_vs_ddp --workers 2 4
    gossamer bench allreduce_vs_ddp --workers 4 --model resnet20 --emulate 1gbit
    gossamer bench allreduce_vs_ddp --workers 4 --model resnet20 --emulate 1gbit --powersgd 2

``--powersgd RANK`` adds compressed variants to the same rounds: DDP with torch's own
PowerSGD hook (``powerSGD_hook``: rank RANK, error feedback, warm start, compressing from the
second step) in one bucket (on gloo it mismatches its collectives with several), DDP with
gossamer's ``compression_hook`` and ``PowerSGDState(rank=RANK)`` in one bucket and in DDP's
buckets, and gossamer's ``PowerSGDAllReduce(rank=RANK)``; their ratios are to torch's hook.

Over loopback the model is an MLP of about 1M parameters; ``--model resnet20`` (CIFAR-sized
inputs, batch 32) has a backward long enough to hide communication. ``--emulate RATE`` runs the
workers on an emulated network (a network namespace per worker, links of RATE: root, ``ip``
and ``tc`` needed), as ``gossamer launch --emulate bandwidth=RATE``.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.ddp_compare import compare, model_of
from gossamer.bench import Results

COMPRESSED = ("torch_powersgd_hook", "gossamer_powersgd_hook_one_bucket",
              "gossamer_powersgd_hook", "gossamer_powersgd")


def worker(rounds: int, steps_per_block: int, batch: int,
           model: str = "mlp", powersgd: int = 0) -> dict[str, list[float]]:
    from gossamer.comm import TorchCommunicator

    comm = TorchCommunicator.from_env(backend="gloo", timeout=120)  # CPU tensors
    try:
        return compare(comm, rounds, steps_per_block, batch, model, powersgd)
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
    parser.add_argument("--powersgd", metavar="RANK", type=int, default=0,
                        help="also time PowerSGD of this rank: torch's DDP hook, gossamer's "
                             "DDP hook and gossamer's PowerSGDAllReduce (default 0: not)")


def run(args: argparse.Namespace, results: Results) -> int:
    from gossamer.testing import spawn_gloo

    batch = args.batch or (64 if args.model == "mlp" else 32)
    params = sum(p.numel() for p in model_of(args.model)[0].parameters())
    rows = []
    for n in args.workers:
        task_args = {"rounds": args.rounds, "steps_per_block": args.steps, "batch": batch,
                     "model": args.model, "powersgd": args.powersgd}
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
            for name in per_rank[0]}
        row = {"workers": n, "gossamer_step_ms": median["gossamer"],
               "ddp_step_ms": median["ddp"], "after_backward_step_ms": median["after_backward"],
               "ratio": median["gossamer"] / median["ddp"],
               "after_backward_ratio": median["after_backward"] / median["ddp"]}
        print(f"{n} workers: gossamer {row['gossamer_step_ms']:.2f} ms/step, "
              f"DDP {row['ddp_step_ms']:.2f} ms/step, ratio {row['ratio']:.3f}; gossamer "
              f"without overlap {row['after_backward_step_ms']:.2f} ms/step "
              f"({row['after_backward_ratio']:.3f})")
        if args.powersgd:
            torch_hook = median["torch_powersgd_hook"]
            for name in COMPRESSED:
                row[f"{name}_step_ms"] = median[name]
                row[f"{name}_ratio"] = median[name] / torch_hook
            print(f"  PowerSGD rank {args.powersgd}: torch's hook (one bucket) "
                  f"{torch_hook:.2f} ms/step; gossamer's hook, one bucket "
                  f"{median['gossamer_powersgd_hook_one_bucket']:.2f} "
                  f"({row['gossamer_powersgd_hook_one_bucket_ratio']:.3f}), DDP's buckets "
                  f"{median['gossamer_powersgd_hook']:.2f} "
                  f"({row['gossamer_powersgd_hook_ratio']:.3f}); gossamer's PowerSGDAllReduce "
                  f"{median['gossamer_powersgd']:.2f} ({row['gossamer_powersgd_ratio']:.3f})")
        rows.append(row)
    name = "allreduce_vs_ddp" + (f"_{args.model}" if args.model != "mlp" else "") + (
        f"_{args.emulate}" if args.emulate else "") + (
        f"_powersgd{args.powersgd}" if args.powersgd else "")
    results.write(name, {"parameters": params, "batch": batch, "model": args.model,
                         "emulate": args.emulate, "rounds": args.rounds, "steps": args.steps,
                         "powersgd": args.powersgd,
                         "rows": rows})
    return 0
