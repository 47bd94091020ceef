"""SimWorld overhead: real time of a simulated step of n workers against n bare steps.

Real time of one simulated AllReduce step of n workers, against n times one bare step of the
same model without any communication (target <= 1.5 at n = 64), and the largest worker counts
the simulator handles. The bare step is the median of its steps' times; the ratio to their
mean is reported beside it (the simulated step is a mean: the run's time over its steps).

    gossamer bench sim_overhead --workers 64 256 1024

With ``--like-for-like``, also against a bare step whose optimizer is called as gossamer calls
the wrapped one (gradients set to None directly, no profiler record around the step while no
profiler runs): the ratio then leaves out what gossamer saves over torch's own loop.

With ``--breakdown``, two steps in between, each against the same bare step: n separate models
stepped one after the other without the simulator (what n models' memory costs alone), and
the simulator's workers stepping a plain torch optimizer with a barrier per step (what the
switching between workers adds); the AllReduce step adds the method's own work.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from gossamer.bench import Results, StepTimes, mlp, sgd_step, timed_steps
from gossamer.bench.models import DIGITS_MLP


def batch(seed: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(size, 64, generator=g), torch.randint(0, 10, (size,), generator=g)


class LeanOptimizer:
    """A torch optimizer's ``zero_grad`` and ``step`` as gossamer's ``DistributedOptimizer``
    calls them: the gradients set to None directly, the step without torch's profiler record
    (no profiler runs), its hooks as torch runs them."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.params = [p for group in optimizer.param_groups for p in group["params"]]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        from gossamer.api import _step_wrapped

        _step_wrapped(self.optimizer)


def bare_step_times(steps: int, size: int, lean: bool = False) -> StepTimes:
    """Real times of ``steps`` steps of the model alone (after 10 untimed steps); ``lean``:
    with the optimizer called as gossamer calls it (:class:`LeanOptimizer`)."""
    model = mlp(*DIGITS_MLP)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    stepped = LeanOptimizer(opt) if lean else opt
    return timed_steps(sgd_step(model, stepped, batch(0, size)), steps,  # type: ignore[arg-type]
                       warmup=10)


def sim_worker(comm, steps: int, size: int) -> float:
    """Real seconds per step of one simulated worker, all workers' steps included."""
    import gossamer

    model = mlp(*DIGITS_MLP)
    opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                              "allreduce", comm)
    step = sgd_step(model, opt, batch(comm.rank, size))
    return timed_steps(step, steps, warmup=3, before_timing=comm.barrier).per_step


def separate_models_seconds(n: int, steps: int, size: int) -> float:
    """Real seconds per step of n separate models, each stepped in turn, without a
    simulator (after 3 untimed steps)."""
    step_fns = []
    for rank in range(n):
        model = mlp(*DIGITS_MLP)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        step_fns.append(sgd_step(model, opt, batch(rank, size)))

    def all_models() -> None:
        for step in step_fns:
            step()

    return timed_steps(all_models, steps, warmup=3).per_step


def sim_barrier_worker(comm, steps: int, size: int) -> float:
    """Real seconds per step of one simulated worker with a plain torch optimizer and a
    barrier after each step, all workers' steps included."""
    model = mlp(*DIGITS_MLP)
    step = sgd_step(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                    batch(comm.rank, size))

    def step_and_barrier() -> None:
        step()
        comm.barrier()

    return timed_steps(step_and_barrier, steps, warmup=3, before_timing=comm.barrier).per_step


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--like-for-like", action="store_true",
                        help="also time the bare step with its optimizer called as gossamer "
                             "calls the wrapped one (gradients set to None directly, no "
                             "profiler record around the step), and the ratio to it")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time n separate models without the simulator, and the "
                             "simulated workers with a plain optimizer and a barrier")


def run(args: argparse.Namespace, results: Results) -> int:
    from gossamer.comm import SimWorld

    torch.set_num_threads(1)
    rows = []
    for n in args.workers:
        bare, bare_mean, lean, simulated, separate, barrier = [], [], [], [], [], []
        for _ in range(args.repeats):  # alternate, so that both see the same machine load
            times = bare_step_times(args.steps * 5, args.batch)
            bare.append(times.median)
            bare_mean.append(times.per_step)
            if args.like_for_like:
                lean.append(bare_step_times(args.steps * 5, args.batch, lean=True).median)
            if args.breakdown:
                separate.append(separate_models_seconds(n, args.steps, args.batch))
                barrier.append(SimWorld(n).run(sim_barrier_worker, args.steps, args.batch)[0])
            simulated.append(SimWorld(n).run(sim_worker, args.steps, args.batch)[0])
        row = {
            "workers": n,
            "bare_step_ms": 1e3 * statistics.median(bare),
            "simulated_step_ms": 1e3 * statistics.median(simulated),
        }
        row["ratio"] = row["simulated_step_ms"] / (n * row["bare_step_ms"])
        # each repeat's own ratio (its simulated step against the bare step measured just
        # before it): their spread is the machine's noise, which a target of 1.5 must beat
        ratios = [s / (n * b) for s, b in zip(simulated, bare, strict=True)]
        row["ratio_min"], row["ratio_max"] = min(ratios), max(ratios)
        # The simulated step is a mean (the run's elapsed time over its steps), so it holds the
        # machine's hiccups (a garbage collection, another process's turn); the median bare
        # step leaves them out. The same statistic on both sides: the bare steps' mean.
        row["bare_step_mean_ms"] = 1e3 * statistics.median(bare_mean)
        row["ratio_to_mean"] = row["simulated_step_ms"] / (n * row["bare_step_mean_ms"])
        if args.like_for_like:
            row["bare_lean_step_ms"] = 1e3 * statistics.median(lean)
            row["ratio_like_for_like"] = row["simulated_step_ms"] / (n * row["bare_lean_step_ms"])
            print(f"{n} workers, like for like: bare step {row['bare_lean_step_ms']:.3f} ms "
                  f"with the optimizer called as gossamer calls it ({row['bare_step_ms']:.3f} "
                  f"ms as torch's loop calls it), ratio {row['ratio_like_for_like']:.2f}")
        if args.breakdown:
            for key, times in (("separate_models", separate), ("simulated_barrier", barrier)):
                row[f"{key}_step_ms"] = 1e3 * statistics.median(times)
                row[f"{key}_ratio"] = row[f"{key}_step_ms"] / (n * row["bare_step_ms"])
            print(f"{n} workers, breakdown: {n} separate models {row['separate_models_ratio']:.2f},"
                  f" simulated with a barrier {row['simulated_barrier_ratio']:.2f}, "
                  f"AllReduce {row['ratio']:.2f} (x {n} bare steps)")
        rows.append(row)
        print(f"{n} workers: simulated step {row['simulated_step_ms']:.1f} ms, "
              f"{n} x bare step {n * row['bare_step_ms']:.1f} ms, ratio {row['ratio']:.2f} "
              f"(repeats {row['ratio_min']:.2f} to {row['ratio_max']:.2f}); against the bare "
              f"steps' mean {row['ratio_to_mean']:.2f}")
    results.write("sim_overhead", {"batch": args.batch, "steps": args.steps, "threads": 1,
                                   "rows": rows})
    return 0
