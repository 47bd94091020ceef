"""What each worker does in the network benchmarks, on any communicator.

The same functions run on gloo inside the emulated network (:mod:`benchmarks.emulation`) and
in :class:`~gossamer.comm.SimWorld`, so the simulator's prediction of a step comes from the
code that was measured, with only the compute and network parameters declared:

- :func:`collectives`: timed all-reduces of several sizes (part a);
- :func:`training_steps`: warm-up, then timed steps of one algorithm on the 5.8M-parameter
  MLP (parts b, c, d), with an optional compute straggler;
- :func:`time_to_accuracy`: the small CNN on MNIST until a target eval accuracy (part e).

Each returns a JSON-friendly dict for its rank.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gossamer.bench import mlp, timed_steps
from gossamer.bench.models import NETBENCH_MLP

# label -> (registry name, options). WAGMA's default group is 4 workers, at 4 workers the whole
# world (3 model copies sent per step); groups of 2 (sqrt(4)) keep it a group method.
# AllReduce, its compressed aliases (DGC, PowerSGD) and GossipGraD average after backward here
# (overlap=False): the simulator does not model the overlap with backward, and the time in the
# communicator is what these tables split off from the local work. Overlapped, a dense bucket's
# all-reduce waits inside backward, and a compressed or gossiped bucket is exchanged on a
# communication thread while backward runs, so its collectives' time (which then includes
# waiting for the ranks still in backward) is no longer a part of the step apart from the local
# work. The overlap is measured against DDP by benchmarks/allreduce_vs_ddp.py.
ALGORITHMS: dict[str, tuple[str, dict[str, Any]]] = {
    "allreduce": ("allreduce", {"overlap": False}),
    "sgp": ("sgp", {}),
    "osgp": ("osgp", {}),
    "dpsgd": ("dpsgd", {}),
    "adpsgd": ("adpsgd", {}),
    "localsgd H=8": ("localsgd", {"period": 8}),
    "qsr": ("qsr", {"period": 4, "alpha": 0.1}),
    "wagma": ("wagma", {"group_size": 2}),
    "dgc": ("dgc", {"overlap": False}),
    "powersgd": ("powersgd", {"overlap": False}),
    "gossipgrad": ("gossipgrad", {"overlap": False}),
}
# Measured only when asked for by label (``gossamer bench plan --methods``): variants of the
# methods above that explain their figures, e.g. WAGMA's synchronous group averaging.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "wagma tau=0": ("wagma", {"group_size": 2, "tau": 0}),
}


def method_spec(label: str) -> tuple[str, dict[str, Any]]:
    """(registry name, options) of ``label``, a key of :data:`ALGORITHMS` or
    :data:`VARIANTS`; a ValueError naming the known labels otherwise."""
    found = ALGORITHMS.get(label) or VARIANTS.get(label)
    if found is None:
        known = ", ".join(repr(k) for k in [*ALGORITHMS, *VARIANTS])
        raise ValueError(f"method {label!r} is not one of the network suite's: {known}")
    return found


MLP_WIDTHS = NETBENCH_MLP  # 784-2048-2048-10 on MNIST-shaped input: 23.3 MB of float32


def machine_busy(since: tuple[int, int] | None = None):
    """From /proc/stat: (busy, total) jiffies of all cores now, or, given an earlier reading,
    the fraction of the time since then that the cores were busy (None without /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    now = (sum(fields) - idle, sum(fields))
    if since is None:
        return now
    return (now[0] - since[0]) / max(1, now[1] - since[1])


class CommTimer:
    """Adds up the real time this process spends inside a communicator's calls (collectives,
    posting exchanges and waiting for them), by wrapping the methods of the instance.

    What is left of a step is the worker's local work: forward, backward, the optimizer, the
    algorithm's own computation (compression, mixing). :func:`training_steps` gives that to the
    simulator as its compute time, in the parts between the calls (:attr:`calls`), where the
    simulator charges them (:class:`gossamer.comm.ComputeModel`'s ``trace``).

    The subgroups that ``comm.group`` makes are timed alike, and one of their collectives is one
    call (the exchanges that carry it are inside it), as the simulator's subgroups make one.
    """

    def __init__(self, comm) -> None:
        self.total = 0.0
        self.calls: list[tuple[float, float]] = []  # (start, end) of each call, in order
        self._depth = 0  # a call made inside another is not counted twice
        self._install(comm)
        comm._netbench_timer = self

    def _install(self, comm) -> None:
        for name in ("all_reduce", "all_gather", "broadcast", "barrier"):
            setattr(comm, name, self._timed(getattr(comm, name)))
        exchange = self._timed(comm.exchange)
        group = comm.group

        def timed_exchange(*args: Any, **kwargs: Any):
            handle = exchange(*args, **kwargs)
            handle.wait = self._timed(handle.wait)
            return handle

        def timed_group(*args: Any, **kwargs: Any):
            made = group(*args, **kwargs)
            self._install(made)
            return made

        comm.exchange = timed_exchange
        comm.group = timed_group

    def _timed(self, fn):
        def wrapper(*args: Any, **kwargs: Any):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                end = time.perf_counter()
                self.total += end - start
                self.calls.append((start, end))
                self._depth -= 1

        return wrapper

    @classmethod
    def of(cls, comm) -> CommTimer:
        """The timer installed on ``comm`` (installed now if there is none)."""
        return getattr(comm, "_netbench_timer", None) or cls(comm)


def _gather(comm, values: list[float]) -> list[list[float]]:
    """Every rank's ``values`` (float64), in rank order."""
    parts = comm.all_gather(torch.tensor(values, dtype=torch.float64))
    return [p.tolist() for p in parts]


def collectives(comm, sizes: list[int], reps: dict[str, int],
                p2p_sizes: list[int] | None = None) -> dict[str, Any]:
    """Time ``comm.all_reduce`` of float32 tensors of ``sizes`` bytes, and point-to-point
    patterns of ``p2p_sizes`` bytes (see :data:`P2P_PATTERNS`).

    Each timed operation starts right after a barrier; its time is the slowest rank's. One
    untimed operation of each size comes first (connections, buffers). ``reps[str(size)]`` is
    how many are timed.
    """
    rows = []
    for size in sizes:
        tensor = torch.ones(size // 4, dtype=torch.float32)
        comm.all_reduce(tensor)
        times = []
        for _ in range(reps[str(size)]):
            comm.barrier()
            start = time.perf_counter()
            comm.all_reduce(tensor)
            times.append(time.perf_counter() - start)
        rows.append({"bytes": size, "times": _slowest(comm, times)})
        del tensor
    p2p = []
    for pattern, run in P2P_PATTERNS.items():
        for size in p2p_sizes or []:
            tensor = torch.ones(size // 4, dtype=torch.float32)
            run(comm, tensor)
            times = []
            for _ in range(reps[str(size)]):
                comm.barrier()
                start = time.perf_counter()
                run(comm, tensor)
                times.append(time.perf_counter() - start)
            p2p.append({"pattern": pattern, "bytes": size, "times": _slowest(comm, times)})
    return {"rank": comm.rank, "world_size": comm.world_size, "rows": rows, "p2p": p2p}


def _slowest(comm, times: list[float]) -> list[float]:
    return [max(ts) for ts in zip(*_gather(comm, times), strict=True)]


def _shift(comm, tensor: torch.Tensor) -> None:
    n = comm.world_size
    comm.exchange({(comm.rank + 1) % n: tensor}, [(comm.rank - 1) % n]).wait()


def _swap(comm, tensor: torch.Tensor) -> None:
    peer = comm.rank ^ 1
    comm.exchange({peer: tensor}, [peer]).wait()


def _swap_receive_first(comm, tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    peer = comm.rank ^ 1
    buffer = torch.empty_like(tensor)
    works = [dist.irecv(buffer, peer), dist.isend(tensor, peer)]
    for work in works:
        work.wait()


#: Point-to-point patterns, one message of the size on every link in use:
#: ``shift``, rank i sends to i + 1 and receives from i - 1 (``comm.exchange``; each TCP
#: connection carries one direction when n > 2); ``swap``, ranks 2k and 2k + 1 send to each
#: other (``comm.exchange``, which posts its receive before its send); ``swap, receive first``,
#: the same with torch.distributed's irecv posted before the isend, to compare.
P2P_PATTERNS = {"shift": _shift, "swap": _swap, "swap, receive first": _swap_receive_first}


def training_steps(
    comm,
    algorithm: str,
    *,
    warmup: int,
    steps: int,
    batch: int,
    straggler: dict[str, float] | None = None,
    simulated: bool = False,
    compute_sleep: float = 0.0,
) -> dict[str, Any]:
    """Train the MLP of :data:`MLP_WIDTHS` with ``algorithm`` (a key of :data:`ALGORITHMS`) on
    a fixed random batch; time ``steps`` steps after ``warmup``, on this rank's own clock.

    ``straggler`` ({rank: factor}, gloo only): that rank sleeps ``factor - 1`` times the
    median of its forward-backward time so far after each backward, so its compute takes
    ``factor`` times as long without taking CPU from the others. In the simulator
    (``simulated``) the compute model does this instead, and the forward and backward passes
    are replaced by copying fixed random gradients into ``.grad``: their time is declared by
    the compute model, so running them would only cost real time.

    ``compute_sleep`` (seconds, gloo only): the forward and backward passes replaced the same
    way, and the rank sleeps that long instead: compute that, like an accelerator's, leaves
    the host's cores to the communication and the method's own work (compression, averaging,
    the optimizer's step), which still run.

    Returns the seconds per step on this rank, the compute per step (forward, backward, any
    straggler sleep and the inner optimizer's step: what the simulator's compute model stands
    for; meaningless in the simulator), and the bytes sent per step.
    """
    import gossamer
    from gossamer.algorithms import create

    if isinstance(compute_sleep, bool) or not isinstance(compute_sleep, (int, float)) \
            or not compute_sleep >= 0:
        raise ValueError(f"compute_sleep must be a number of seconds >= 0, got "
                         f"{compute_sleep!r}")
    name, options = method_spec(algorithm)
    model = mlp(*MLP_WIDTHS)
    inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    optimizer_time = [0.0, 0.0]  # running total, start of the current step

    def pre(*_: Any) -> None:
        optimizer_time[1] = time.perf_counter()

    def post(*_: Any) -> None:
        optimizer_time[0] += time.perf_counter() - optimizer_time[1]

    inner.register_step_pre_hook(pre)
    inner.register_step_post_hook(post)
    # before the runtime is bound: the subgroups it makes are timed too
    timer = None if simulated else CommTimer.of(comm)
    opt = gossamer.distribute(model, inner, create(name, options), comm)
    g = torch.Generator().manual_seed(1000 + comm.rank)
    x = torch.randn(batch, MLP_WIDTHS[0], generator=g)
    y = torch.randint(0, MLP_WIDTHS[-1], (batch,), generator=g)
    factor = (straggler or {}).get(str(comm.rank), 1.0) if not simulated else 1.0
    sleep = 0.0 if simulated else compute_sleep
    fixed = [torch.randn(p.shape, generator=g) * 1e-3 for p in model.parameters()] \
        if simulated or sleep else None
    # per step, the warm-up's included
    forward_backward: list[float] = []
    computes: list[float] = []
    in_comm_steps: list[float] = []  # real time inside the communicator's calls
    parts: list[list[float]] = []  # the local work before, between and after those calls

    def step() -> None:
        t0, comm_before = time.perf_counter(), timer.total if timer else 0.0
        calls_before = len(timer.calls) if timer else 0
        if fixed is None:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
        else:
            for p, grad in zip(model.parameters(), fixed, strict=True):
                p.grad = grad.clone()
            if sleep:
                time.sleep(sleep)
        forward_backward.append(time.perf_counter() - t0)
        if factor != 1.0:
            time.sleep((factor - 1) * statistics.median(forward_backward))
        compute = time.perf_counter() - t0
        before = optimizer_time[0]
        opt.step()
        computes.append(compute + optimizer_time[0] - before)
        in_comm_steps.append((timer.total - comm_before) if timer else 0.0)
        if timer:
            ends = [t0] + [end for _, end in timer.calls[calls_before:]]
            starts = [start for start, _ in timer.calls[calls_before:]] + [time.perf_counter()]
            parts.append([start - end for start, end in zip(starts, ends, strict=True)])

    at_start: dict[str, Any] = {}

    def before_timing() -> None:
        at_start.update(sent=comm.stats.total_bytes_sent, cpu=time.process_time(),
                        busy=None if simulated else machine_busy(),
                        comm=timer.total if timer else 0.0)

    comm.barrier()
    times = timed_steps(step, steps, warmup=warmup, clock=comm.clock,
                        before_timing=before_timing)
    elapsed = times.elapsed
    in_comm = (timer.total - at_start["comm"]) if timer else 0.0
    cpu = time.process_time() - at_start["cpu"]
    busy = None if at_start["busy"] is None else machine_busy(at_start["busy"])
    sent = comm.stats.total_bytes_sent - at_start["sent"]
    # per timed step: its time outside the communicator
    locals_ = [t - c for t, c in zip(times.seconds, in_comm_steps[warmup:], strict=True)]
    opt.finish()
    return {
        "rank": comm.rank,
        "algorithm": algorithm,
        "seconds_per_step": elapsed / steps,
        # forward, backward (and a straggler's sleep) and the inner optimizer's step: median
        "compute_per_step": statistics.median(computes[warmup:]),
        # real time inside the communicator's calls, and the rest of the step: local work
        "comm_per_step": in_comm / steps,
        "local_per_step": (elapsed - in_comm) / steps,
        "local_steps": locals_,
        # per timed step: its time on this rank's clock
        "step_seconds": list(times.seconds),
        # the runtime's own counts since its start, warm-up included (see _counters)
        "counters": _counters(opt.runtime),
        # per timed step: the local work between its communicator calls (ComputeModel's trace)
        "local_parts": parts[warmup:],
        "bytes_per_step": sent / steps,
        # CPU seconds of this process (all its threads, gloo's included) per step
        "cpu_per_step": cpu / steps,
        # fraction of the machine's cores busy (user, system, softirq: the emulated network's
        # packet processing included) while this rank ran its timed steps
        "machine_busy": busy,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def _counters(runtime: Any) -> dict[str, Any]:
    """The counts a runtime keeps of what it did, those it has: averagings, waits, skipped
    rounds, and how many contributions it averaged of each age in rounds (WAGMA)."""
    out: dict[str, Any] = {}
    for name in ("synchronizations", "group_averages", "waits", "rounds_skipped"):
        if isinstance(getattr(runtime, name, None), int):
            out[name] = getattr(runtime, name)
    ages = getattr(runtime, "ages", None)
    if isinstance(ages, dict):
        out["ages"] = {str(age): count for age, count in sorted(ages.items())}
    return out


def training_steps_all(comm, algorithms: list[str], **kwargs: Any) -> dict[str, Any]:
    """:func:`training_steps` of each algorithm in turn, in the same processes."""
    out = {}
    for algorithm in algorithms:
        out[algorithm] = training_steps(comm, algorithm, **kwargs)
        if comm.rank == 0:
            r = out[algorithm]
            print(f"  {algorithm:13s} rank 0: {r['seconds_per_step'] * 1e3:7.1f} ms/step, "
                  f"compute {r['compute_per_step'] * 1e3:6.1f} ms", flush=True)
    return {"rank": comm.rank, "algorithms": out}


@torch.no_grad()
def _averaged_accuracy(comm, model: nn.Module, dataset) -> float:
    """Eval accuracy of the average of the replicas (every rank gets rank 0's figure)."""
    from gossamer.algorithms import model_tensors
    from gossamer.train.metrics import evaluate

    averaged = copy.deepcopy(model)
    tensors = model_tensors(averaged)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    comm.all_reduce(flat, op="mean")
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    accuracy = torch.zeros(1, dtype=torch.float64)
    if comm.rank == 0:
        accuracy[0] = evaluate(averaged, dataset.x_test, dataset.y_test)[1]
    comm.all_reduce(accuracy)  # only rank 0's is non-zero
    return float(accuracy[0])


def time_to_accuracy(
    comm,
    algorithm: str,
    *,
    data_path: str,
    target: float,
    max_steps: int,
    eval_every: int,
    batch: int = 32,
    lr: float = 0.05,
    warmup_steps: int = 20,
    seed: int = 0,
) -> dict[str, Any]:
    """Train the small CNN on MNIST (first 8,000 t10k images; the last 2,000 evaluate) with
    ``algorithm`` until the averaged model's eval accuracy reaches ``target``, or for
    ``max_steps``. SGD with momentum 0.9, ``warmup_steps`` of linear warm-up to ``lr``, then a
    cosine decay to 0 at ``max_steps``.

    The clock counts training only: each evaluation (its averaging all-reduce, the forward
    passes, the algorithm's pause) is left out, on every rank. Returns per evaluation the
    step, the slowest rank's training seconds so far and the accuracy.
    """
    import gossamer
    from gossamer.algorithms import create
    from gossamer.train.config import TrainConfig, learning_rate
    from gossamer.train.data import ShardSampler, load_mnist, partition
    from gossamer.train.metrics import loss_fn
    from gossamer.train.models import SmallCNN

    name, options = method_spec(algorithm)
    if name == "qsr":  # QSR holds H_base during the learning-rate warm-up
        options = {**options, "warmup_steps": warmup_steps}
    dataset = load_mnist(data_path)
    schedule = TrainConfig(lr=lr, schedule="cosine", warmup_steps=warmup_steps, steps=max_steps)
    torch.manual_seed(seed)
    model = SmallCNN()
    opt = gossamer.distribute(
        model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
        create(name, options), comm, total_steps=max_steps)
    runtime = opt.runtime
    shards = partition(dataset.y_train.numpy(), comm.world_size, seed=seed)
    sampler = ShardSampler(shards[comm.rank], batch, seed=seed * 7919 + comm.rank)
    trained = 0.0
    history = []
    reached = None
    comm.barrier()
    for step in range(max_steps):
        start = comm.clock()
        for group in opt.param_groups:
            group["lr"] = learning_rate(schedule, step)
        opt.zero_grad()
        index = sampler.next_batch()
        loss_fn(model(dataset.x_train[index]), dataset.y_train[index]).backward()
        opt.step()
        trained += comm.clock() - start
        done = step + 1
        if done % eval_every == 0 or done == max_steps:
            runtime.before_eval()
            accuracy = _averaged_accuracy(comm, model, dataset)
            seconds = max(t for (t,) in _gather(comm, [trained]))
            history.append({"step": done, "seconds": seconds, "accuracy": accuracy})
            if comm.rank == 0:
                print(f"  {algorithm:13s} step {done:4d}: {100 * accuracy:5.2f}% after "
                      f"{seconds:6.2f} s", flush=True)
            if accuracy >= target:
                reached = history[-1]
                break
    opt.finish()
    return {"rank": comm.rank, "algorithm": algorithm, "history": history, "reached": reached,
            "target": target, "max_steps": max_steps}


def time_to_accuracy_all(comm, algorithms: list[str], **kwargs: Any) -> dict[str, Any]:
    """:func:`time_to_accuracy` of each algorithm in turn, in the same processes."""
    return {"rank": comm.rank,
            "algorithms": {a: time_to_accuracy(comm, a, **kwargs) for a in algorithms}}


def allreduce_vs_ddp(comm, **kwargs: Any) -> dict[str, Any]:
    """:func:`benchmarks.ddp_compare.compare` on this rank."""
    from benchmarks.ddp_compare import compare

    return compare(comm, **kwargs)


TASKS = {
    "allreduce_vs_ddp": allreduce_vs_ddp,
    "collectives": collectives,
    "training_steps": training_steps_all,
    "time_to_accuracy": time_to_accuracy_all,
}
