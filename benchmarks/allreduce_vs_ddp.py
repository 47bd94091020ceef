"""AllReduce step time against torch DistributedDataParallel, gloo over loopback.

The same model (about 1M parameters), data and optimizer in both; each process alternates
blocks of gossamer steps and DDP steps, so both see the same machine load, and the figure is
the ratio of the median block times (target <= 1.05).

    python -m benchmarks.allreduce_vs_ddp --workers 2 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import write_result


def make_model() -> nn.Module:
    torch.manual_seed(0)
    # 784*1024 + 1024*256 + 256*10 weights and biases: 1,068,810 parameters
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def _steps(model, optimizer, x, y, count: int) -> None:
    for _ in range(count):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def worker(rounds: int, steps_per_block: int, batch: int) -> dict[str, list[float]]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import gossamer
    from gossamer.comm import TorchCommunicator

    comm = TorchCommunicator.from_env(timeout=120)
    g = torch.Generator().manual_seed(comm.rank)
    x, y = torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g)

    ours = make_model()
    ours_opt = gossamer.distribute(ours, torch.optim.SGD(ours.parameters(), lr=0.01),
                                   gossamer.AllReduce(), comm)
    theirs = DistributedDataParallel(make_model())
    theirs_opt = torch.optim.SGD(theirs.parameters(), lr=0.01)
    times: dict[str, list[float]] = {"gossamer": [], "ddp": []}
    _steps(ours, ours_opt, x, y, 3)  # warm-up
    _steps(theirs, theirs_opt, x, y, 3)
    for r in range(rounds):
        order = [("gossamer", ours, ours_opt), ("ddp", theirs, theirs_opt)]
        for name, model, opt in order if r % 2 == 0 else order[::-1]:
            dist.barrier()
            start = time.perf_counter()
            _steps(model, opt, x, y, steps_per_block)
            times[name].append((time.perf_counter() - start) / steps_per_block)
    comm.close()
    return times


def main() -> None:
    from gossamer.testing import spawn_gloo

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed block")
    parser.add_argument("--batch", type=int, default=64, help="minibatch per worker")
    args = parser.parse_args()
    params = sum(p.numel() for p in make_model().parameters())
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
    path = write_result("allreduce_vs_ddp", {"parameters": params, "batch": args.batch,
                                             "rounds": args.rounds, "steps": args.steps,
                                             "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
