"""SimWorld overhead: real time of one simulated AllReduce step of n workers, against n times
one bare step of the same model without any communication (target <= 1.5 at n = 64), and the
largest worker counts the simulator handles.

    python -m benchmarks.sim_overhead --workers 64 256 1024
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
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))  # digits' MLP


def batch(seed: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(size, 64, generator=g), torch.randint(0, 10, (size,), generator=g)


def bare_step_seconds(steps: int, size: int) -> float:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = batch(0, size)
    times = []
    for i in range(steps + 10):
        start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if i >= 10:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def sim_worker(comm, steps: int, size: int) -> float:
    import gossamer

    model = make_model()
    opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                              "allreduce", comm)
    x, y = batch(comm.rank, size)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(3):  # warm-up
        step()
    comm.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    from gossamer.comm import SimWorld

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for n in args.workers:
        bare, simulated = [], []
        for _ in range(args.repeats):  # alternate, so that both see the same machine load
            bare.append(bare_step_seconds(args.steps * 5, args.batch))
            simulated.append(SimWorld(n).run(sim_worker, args.steps, args.batch)[0])
        row = {
            "workers": n,
            "bare_step_ms": 1e3 * statistics.median(bare),
            "simulated_step_ms": 1e3 * statistics.median(simulated),
        }
        row["ratio"] = row["simulated_step_ms"] / (n * row["bare_step_ms"])
        rows.append(row)
        print(f"{n} workers: simulated step {row['simulated_step_ms']:.1f} ms, "
              f"{n} x bare step {n * row['bare_step_ms']:.1f} ms, ratio {row['ratio']:.2f}")
    path = write_result("sim_overhead", {"batch": args.batch, "steps": args.steps,
                                         "threads": 1, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
