"""One rank's side-by-side blocks of gossamer's AllReduce and torch DDP steps (and the
compressed variants): the task :mod:`benchmarks.allreduce_vs_ddp` runs on gloo processes,
and :mod:`benchmarks.netbench_tasks` on the emulated network."""

from __future__ import annotations

import torch

from gossamer.bench import mlp, sgd_step, timed_steps
from gossamer.bench.models import DDP_MLP


def model_of(name: str) -> tuple[torch.nn.Module, tuple[int, ...]]:
    """The model of ``name`` (the same initial one on every rank) and one input's shape."""
    torch.manual_seed(0)
    if name == "mlp":
        return mlp(*DDP_MLP), (784,)
    from gossamer.train.models import build_model

    return build_model(name, (3, 32, 32), 10), (3, 32, 32)


def compare(comm, rounds: int, steps_per_block: int, batch: int,
            model: str = "mlp", powersgd: int = 0) -> dict[str, list[float]]:
    """Blocks of ``steps_per_block`` steps of each variant (gossamer's AllReduce, DDP, ...),
    alternated for ``rounds`` rounds on this rank (its default process group is DDP's); the
    seconds per step of each block."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import gossamer

    _, shape = model_of(model)
    g = torch.Generator().manual_seed(comm.rank)
    x, y = torch.randn(batch, *shape, generator=g), torch.randint(0, 10, (batch,), generator=g)

    def step(net: torch.nn.Module, algorithm=None, hook=None, one_bucket: bool = False):
        """A step of ``net`` (a fresh copy of the model): through gossamer's ``algorithm``,
        or in DDP, with ``hook(ddp)`` registering a comm hook, and with ``one_bucket`` all
        gradients in a single bucket."""
        if algorithm is not None:
            optimizer = gossamer.distribute(net, torch.optim.SGD(net.parameters(), lr=0.01),
                                            algorithm, comm)
            return sgd_step(net, optimizer, (x, y))
        first = dist._DEFAULT_FIRST_BUCKET_BYTES
        if one_bucket:  # DDP caps its first bucket at this (read when it is constructed)
            dist._DEFAULT_FIRST_BUCKET_BYTES = 2**40
        try:
            ddp = DistributedDataParallel(net, bucket_cap_mb=2**20 if one_bucket else 25)
        finally:
            dist._DEFAULT_FIRST_BUCKET_BYTES = first
        if hook is not None:
            hook(ddp)
        return sgd_step(ddp, torch.optim.SGD(ddp.parameters(), lr=0.01), (x, y))

    def torch_powersgd(ddp) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=powersgd, start_powerSGD_iter=2,
            use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

    def gossamer_powersgd(ddp) -> None:
        from gossamer.hooks import PowerSGDState, compression_hook

        ddp.register_comm_hook(PowerSGDState(ddp, rank=powersgd), compression_hook)

    steps = {"gossamer": step(model_of(model)[0], gossamer.AllReduce()),
             "ddp": step(model_of(model)[0]),
             # the same, averaging after backward (no overlap): what the overlap buys
             "after_backward": step(model_of(model)[0], gossamer.AllReduce(overlap=False))}
    if powersgd:
        steps.update({
            # torch's hook launches each bucket's second all-reduce from the first one's
            # callback thread: with several buckets on gloo their order differs between ranks
            # (a collective mismatch), so it runs with one bucket, and gossamer's hook both so
            # and with DDP's buckets
            "torch_powersgd_hook": step(model_of(model)[0], hook=torch_powersgd,
                                        one_bucket=True),
            "gossamer_powersgd_hook_one_bucket": step(model_of(model)[0], hook=gossamer_powersgd,
                                                      one_bucket=True),
            "gossamer_powersgd_hook": step(model_of(model)[0], hook=gossamer_powersgd),
            "gossamer_powersgd": step(model_of(model)[0],
                                      gossamer.algorithms.PowerSGDAllReduce(rank=powersgd))})
    times: dict[str, list[float]] = {name: [] for name in steps}
    for run in steps.values():  # warm-up (torch's hook compresses from its second step)
        for _ in range(3):
            run()
    order = list(steps)
    for r in range(rounds):
        shift = r % len(order)
        for name in order[shift:] + order[:shift]:  # each first as often as the others
            times[name].append(timed_steps(steps[name], steps_per_block,
                                           before_timing=dist.barrier).per_step)
    return times
