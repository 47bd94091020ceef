"""The GPU check: what to run first whenever a GPU is lent (``scripts/gpu-check``).

Each part is timed and guarded: one that fails or raises is reported and the next one runs; one
that outlives its share of the global budget (``--budget``, 450 s by default: the whole check
ends before 8 minutes) is stopped, and a part that cannot start in what is left is skipped with
the reason. The report (``report.md`` and ``report.json`` in ``--out``) is rewritten after every
part, so that a check killed from outside still leaves what it found.

    scripts/gpu-check                      # on a GPU: every part, full sizes
    scripts/gpu-check --device cpu         # a short version of every part a CPU can run
    scripts/gpu-check --parts parity amp   # some parts only

The parts (``--device cpu``: smaller sizes, the speed limits reported but not applied):

- environment: Python, torch, CUDA, the GPU, and torch's privates that gossamer uses
  (:func:`gossamer.torch_internals.check`).
- parity: every registered method in :class:`~gossamer.comm.SimWorld` with CUDA tensors against
  the CPU run (:mod:`gossamer.device_parity`): the same bytes and operations, no tensor off the
  device, parameters within ``ATOL``.
- compress: the compressors' time against the read-only floor (``torch.aminmax`` of the
  gradient), on a 25.6M-element gradient: DGC <= 3x, QSGD <= 10x, PowerSGD <= 1.2x torch's own
  PowerSGD hook's compute on the same matrix (``benchmarks/compress.py``).
- nccl: a one-rank NCCL process group through ``TorchCommunicator``: every collective, its
  asynchronous all-reduce, an exchange, a subgroup, and three AllReduce steps of ``distribute``.
- amp: bf16 autocast with a ``GradScaler`` through ``distribute`` (and fp16 on a GPU): finite
  parameters, a falling loss, the same scale on every worker.
- compile: a ``torch.compile``d model under ``distribute`` for AllReduce, DiLoCo and SGP, against
  the eager run: the same bytes, parameters within ``COMPILE_ATOL``.
- memory: peak GPU memory of each method against plain AdamW, for a 100M-parameter MLP on four
  simulated workers, and the bytes each worker keeps (parameters, gradients, optimizer and
  method state) against AdamW's.
- sim64: 64 simulated workers of ResNet-20 on one device: the real time of a simulated step
  against 64 bare steps.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.metadata
import json
import os
import platform
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

BUDGET = 450.0  # seconds of the parts; with the imports first the check ends before 8 minutes
CPU_BUDGET = 120.0  # with --device cpu: its parts take about 15 s of CPU time (one thread)
# what each part may take at most on a GPU; it gets less when less of the budget is left
CAPS = {"environment": 30, "parity": 90, "compress": 60, "nccl": 60, "amp": 45,
        "compile": 150, "memory": 90, "sim64": 60}
CPU_CAPS = dict.fromkeys(CAPS, 30)  # the short version's: generous, for a busy machine
MIN_START = 5.0  # seconds a part needs at least: with less left it is skipped
# Inductor's kernels fuse and reorder float32 work, so a compiled run's parameters may differ
# from the eager run's in the last bits, grown over a few steps (aot_eager on a CPU: none); a
# wrong graph or a lost update differs by O(1e-2).
COMPILE_ATOL = 1e-3
LIMITS = {"dgc": 3.0, "qsgd": 10.0, "powersgd": 1.2}  # the compress part's targets (GPU)
# short runs: periods small enough to average within them
SHORT_OPTIONS: dict[str, dict[str, Any]] = {
    "diloco": {"period": 2}, "localsgd": {"period": 2},
    "streaming-diloco": {"period": 4, "fragments": 2},
}


class PartTimeout(BaseException):
    """A part outlived its time (a BaseException: no ``except Exception`` of the code under
    check swallows it)."""


_expired = False  # the last part's time ran out (set by the alarm, cleared for the next part)


@dataclasses.dataclass
class Part:
    """One part's outcome, as the report writes it."""

    name: str
    status: str = "not run"  # passed, failed, error, timeout, skipped
    seconds: float = 0.0
    summary: str = ""
    checks: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None

    def check(self, name: str, value: float, limit: float, *, applied: bool = True,
              at_least: bool = False) -> None:
        """Record ``value`` against ``limit`` (at most, or ``at_least``); ``applied=False``:
        reported only (a GPU's limit on a CPU)."""
        ok = value >= limit if at_least else value <= limit
        self.checks.append({"name": name, "value": value, "limit": limit,
                            "relation": ">=" if at_least else "<=",
                            "ok": ok if applied else None})

    def problem(self, text: str) -> None:
        self.checks.append({"name": text, "ok": False})


@dataclasses.dataclass
class Settings:
    """The check's sizes: full on a GPU, short on a CPU."""

    device: str
    short: bool
    compile_backend: str
    comm_backend: str | None
    part_time: float | None = None  # each part's limit instead of its cap

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _algorithm(name: str):
    from gossamer.algorithms import create

    return create(name, SHORT_OPTIONS.get(name, {}))


def _guarded(part: Part, label: str, fn: Callable[[], Any]) -> Any:
    """``fn()``; an exception (not a timeout) is a problem of ``part`` named ``label``."""
    if _expired:
        raise PartTimeout("the part's time is up")
    try:
        return fn()
    except PartTimeout:
        raise
    except Exception as exc:  # one method's failure must not hide the others'
        if _expired:  # the timeout, as a simulated worker's failure
            raise PartTimeout("the part's time is up") from exc
        part.problem(f"{label}: {type(exc).__name__}: {exc}".splitlines()[0][:300])
        part.data.setdefault("tracebacks", {})[label] = traceback.format_exc()[-2000:]
        return None


# ------------------------------------------------------------------------------ parts


def environment(s: Settings, part: Part) -> None:
    from gossamer import __version__
    from gossamer.torch_internals import check

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda_built": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "gossamer": __version__, "device": s.device,
            "nccl_available": torch.distributed.is_nccl_available()}
    if s.cuda:
        props = torch.cuda.get_device_properties(s.device)
        info.update(gpu=props.name, gpu_memory_gib=props.total_memory / 2**30,
                    multiprocessors=props.multi_processor_count,
                    capability=f"{props.major}.{props.minor}")
        with contextlib.suppress(Exception):  # a tuple in recent torch, an int before
            version = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) \
                else str(version)
    for name in ("greenlet", "numpy", "scikit-learn", "pyyaml", "matplotlib"):
        try:  # the installed versions, without importing them (seconds for some)
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            part.problem(f"{name} is not installed (scripts/gpu-check --prepare)")
    part.data.update(info)
    for problem in check():
        part.problem(problem)
    part.summary = (f"Python {info['python']}, torch {info['torch']}"
                    + (f", {info['gpu']}" if s.cuda else ", no GPU"))


def parity(s: Settings, part: Part) -> None:
    from gossamer.algorithms import available
    from gossamer.device_parity import compare, max_difference, simulated_run

    workers, steps = 4, 6
    rows = {}
    for name in available():
        def one(name=name):
            algorithm = _algorithm(name)
            cpu = simulated_run(algorithm, "cpu", workers, steps)
            runs = simulated_run(algorithm, s.device, workers, steps)
            problems = compare(name, runs, cpu, s.device.split(":")[0], need_averaging=False)
            return {"max_difference": max_difference(runs, cpu),
                    "bytes_sent": runs[0].bytes_sent, "averagings": runs[0].averagings,
                    "problems": problems}
        row = _guarded(part, name, one)
        if row is not None:
            rows[name] = row
            for problem in row["problems"]:
                part.problem(problem)
    part.data.update(workers=workers, steps=steps, methods=rows)
    agree = sum(not r["problems"] for r in rows.values())
    worst = max((r["max_difference"] for r in rows.values()), default=0.0)
    part.summary = (f"{agree} of {len(available())} methods agree with the CPU "
                    f"(largest parameter difference {worst:.2g})")


def compress(s: Settings, part: Part) -> None:
    from benchmarks.compress import NUMEL, compressor_calls, floor_call, interleaved_times

    numel, reps, slow_reps = (1_000_000, 3, 2) if s.short else (NUMEL, 30, 10)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(s.device)
    names = ["dgc", "qsgd", "powersgd", "torch-powersgd", "topk"]
    calls, _ = compressor_calls(x, names)
    times, _ = interleaved_times(floor_call(x), calls, reps, slow_reps, s.cuda)
    med = {name: statistics.median(t) for name, t in times.items()}
    rows = {name: {"median_ms": 1e3 * t, "min_ms": 1e3 * min(times[name]),
                   "x_floor": t / med["floor"], "runs": len(times[name])}
            for name, t in med.items()}
    part.data.update(numel=numel, rows=rows)
    ratios = {"dgc": rows["dgc"]["x_floor"], "qsgd": rows["qsgd"]["x_floor"],
              "powersgd": med["powersgd"] / med["torch-powersgd"]}
    part.check("DGC / floor", ratios["dgc"], LIMITS["dgc"], applied=s.cuda)
    part.check("QSGD / floor", ratios["qsgd"], LIMITS["qsgd"], applied=s.cuda)
    part.check("PowerSGD / torch's PowerSGD", ratios["powersgd"], LIMITS["powersgd"],
               applied=s.cuda)
    part.summary = (f"{numel:,} elements, floor {rows['floor']['median_ms']:.3g} ms: DGC "
                    f"{ratios['dgc']:.2f}x, QSGD {ratios['qsgd']:.2f}x the floor; PowerSGD "
                    f"{ratios['powersgd']:.2f}x torch's")


def nccl(s: Settings, part: Part) -> None:
    from gossamer.api import distribute
    from gossamer.comm import TorchCommunicator
    from gossamer.comm.environment import free_port, torchrun_variables

    backend = s.comm_backend or "nccl"
    env = torchrun_variables(0, 1, "127.0.0.1", free_port())
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    ran = []
    try:
        started = time.perf_counter()
        comm = TorchCommunicator.from_env(backend=backend, timeout=60)
        part.data["init_seconds"] = time.perf_counter() - started
        try:
            device = comm.device
            x = torch.arange(4.0, device=device)

            def expect(label: str, got: torch.Tensor, want: torch.Tensor) -> None:
                ran.append(label)
                if got.device != want.device or not torch.equal(got, want):
                    part.problem(f"{label}: {got.tolist()} on {got.device}, expected "
                                 f"{want.tolist()}")

            expect("all_reduce sum", comm.all_reduce(x.clone()), x)
            expect("all_reduce mean", comm.all_reduce(x.clone(), "mean"), x)
            expect("all_reduce_async", comm.all_reduce_async(x.clone()).wait(), x)
            gathered = comm.all_gather(x.clone())
            expect("all_gather", torch.cat(gathered), x)
            expect("broadcast", comm.broadcast(x.clone(), 0), x)
            comm.barrier()
            ran.append("barrier")
            received = comm.exchange({}, [], recv_like=x).wait()
            ran.append("exchange")
            if received != {}:
                part.problem(f"exchange with no peers received {received}")
            sub = comm.group([0])
            expect("subgroup all_reduce", sub.all_reduce(x.clone()), x)
            torch.manual_seed(0)
            model = nn.Linear(16, 4).to(device)
            optimizer = distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   "allreduce", comm)
            for _ in range(3):
                optimizer.zero_grad()
                F.cross_entropy(model(torch.randn(8, 16, device=device)),
                                torch.randint(0, 4, (8,), device=device)).backward()
                optimizer.step()
            optimizer.finish()
            ran.append("distribute allreduce, 3 steps")
            _side_streams(comm, device, part, ran)
            part.data.update(backend=comm.backend, device=str(device),
                             operations=dict(comm.stats.operations))
        finally:
            comm.close()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    part.data["ran"] = ran
    part.summary = f"{backend}, one rank: {len(ran)} operations ran ({', '.join(ran)})"


def _side_stream_steps(comm, device: torch.device, train: Callable[[nn.Module], None]
                       ) -> list[torch.Tensor]:
    """A 4-layer MLP (several buckets) after ``train``, its parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).to(device)
    train(model)
    return [p.detach().clone() for p in model.parameters()]


def _batches(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    return [(torch.randn(64, 256, device=device), torch.randn(64, 256, device=device))
            for _ in range(3)]


def _side_streams(comm, device: torch.device, part: Part, ran: list[str]) -> None:
    """The overlapped buckets' jobs on their side stream (patterns/overlap.py's SideStream):
    top-k through ``distribute`` overlapped against not overlapped, and DDP's compression hook
    against the same hook waited for and synchronised before it returns: the same bits, unless
    a job reads a gradient before it is written or the step reads a result before it is."""
    from torch.nn.parallel import DistributedDataParallel

    from gossamer.algorithms import create
    from gossamer.api import distribute
    from gossamer.hooks import TopKState, compression_hook

    def through_distribute(overlap: bool) -> Callable[[nn.Module], None]:
        def train(model: nn.Module) -> None:
            optimizer = distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   create("topk", {"ratio": 0.1, "overlap": overlap,
                                                   "bucket_mb": 0.3}), comm)
            for x, y in _batches(device):
                optimizer.zero_grad()
                F.mse_loss(model(x), y).backward()
                optimizer.step()
            optimizer.finish()
        return train

    def through_ddp(blocking: bool) -> Callable[[nn.Module], None]:
        def hook(state, bucket):
            if not blocking:
                return compression_hook(state, bucket)
            synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda _: None
            synchronize(device)
            future = compression_hook(state, bucket)
            future.wait()
            synchronize(device)
            return future

        def train(model: nn.Module) -> None:
            ddp = DistributedDataParallel(model, bucket_cap_mb=0.3)
            optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
            ddp.register_comm_hook(TopKState(ddp, ratio=0.1, comm=comm), hook)
            for x, y in _batches(device):
                optimizer.zero_grad()
                F.mse_loss(ddp(x), y).backward()
                optimizer.step()
        return train

    checks = (("distribute topk: overlapped = not", through_distribute(True),
               through_distribute(False)),
              ("DDP topk hook = the hook waited for", through_ddp(False), through_ddp(True)))
    for label, fast, reference in checks:
        got, want = (_side_stream_steps(comm, device, train) for train in (fast, reference))
        ran.append(label)
        if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
            worst = max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))
            part.problem(f"{label}: parameters differ by up to {worst:.3g}")


def _amp_worker(comm, algorithm, device: str, dtype: torch.dtype, steps: int) -> dict:
    from gossamer.api import distribute
    from gossamer.device_parity import parity_model

    kind = device.split(":")[0]
    model = parity_model().to(device)
    scaler = torch.amp.GradScaler(kind, init_scale=2.0**10, growth_interval=2)
    optimizer = distribute(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                           algorithm, comm, scaler=scaler)
    g = torch.Generator().manual_seed(100 + comm.rank)
    x, y = torch.randn(32, 16, generator=g).to(device), torch.randint(0, 4, (32,), generator=g)
    losses, out_dtype = [], None
    for _ in range(steps):
        optimizer.zero_grad()
        with torch.autocast(kind, dtype=dtype):
            out = model(x)
            loss = F.cross_entropy(out, y.to(device))
        out_dtype = str(out.dtype)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(float(loss.detach()))
    optimizer.finish()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"losses": losses, "scale": float(scaler.get_scale()), "out_dtype": out_dtype,
            "finite": bool(torch.isfinite(params).all()), "bytes": comm.stats.total_bytes_sent}


def amp(s: Settings, part: Part) -> None:
    from gossamer.comm import SimWorld

    dtypes = {"bf16": torch.bfloat16, **({"fp16": torch.float16} if s.cuda else {})}
    rows = {}
    for label, dtype in dtypes.items():
        for name in ("allreduce", "dgc", "sgp", "diloco"):
            key = f"{name} {label}"

            def one(name=name, dtype=dtype, key=key):
                runs = SimWorld(2).run(_amp_worker, _algorithm(name), s.device, dtype, 8)
                first = runs[0]
                if first["out_dtype"] != str(dtype):
                    part.problem(f"{key}: the model's output is {first['out_dtype']} under "
                                 f"autocast, not {dtype}")
                if not all(r["finite"] for r in runs):
                    part.problem(f"{key}: non-finite parameters")
                if len({r["scale"] for r in runs}) != 1:
                    part.problem(f"{key}: the scales differ: {[r['scale'] for r in runs]}")
                if not first["losses"][-1] < first["losses"][0]:
                    part.problem(f"{key}: the loss did not fall: {first['losses']}")
                return {"loss_first": first["losses"][0], "loss_last": first["losses"][-1],
                        "scale": first["scale"], "bytes": first["bytes"]}
            row = _guarded(part, key, one)
            if row is not None:
                rows[key] = row
    part.data["runs"] = rows
    part.summary = f"{len(rows)} runs of 2 workers, 8 steps ({', '.join(rows)})"


def compile_(s: Settings, part: Part) -> None:
    from gossamer.comm import SimWorld
    from gossamer.device_parity import train

    torch._dynamo.reset()
    rows = {}
    for name in ("allreduce", "diloco", "sgp"):
        def one(name=name):
            eager = SimWorld(2).run(train, _algorithm(name), s.device, 6)
            started = time.perf_counter()
            compiled = SimWorld(2).run(train, _algorithm(name), s.device, 6, s.compile_backend)
            seconds = time.perf_counter() - started
            diff = max(float((c.params - e.params).abs().max())
                       for c, e in zip(compiled, eager, strict=True))
            part.check(f"{name}: compiled parameters - eager", diff, COMPILE_ATOL)
            if [c.bytes_sent for c in compiled] != [e.bytes_sent for e in eager]:
                part.problem(f"{name}: compiled run sent {[c.bytes_sent for c in compiled]} "
                             f"bytes, eager {[e.bytes_sent for e in eager]}")
            return {"max_difference": diff, "compiled_run_seconds": seconds}
        row = _guarded(part, name, one)
        if row is not None:
            rows[name] = row
    part.data.update(backend=s.compile_backend, methods=rows)
    part.summary = (f"backend {s.compile_backend}: "
                    + ", ".join(f"{n} {r['max_difference']:.2g} off eager in "
                                f"{r['compiled_run_seconds']:.1f} s" for n, r in rows.items()))


def _big_mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def _memory_worker(comm, name: str | None, device: str, width: int, depth: int,
                   steps: int) -> int:
    """Bytes this worker keeps after ``steps`` AdamW steps (under ``name``, or plain)."""
    from gossamer.api import distribute
    from gossamer.device_parity import kept_tensors, tensor_bytes

    model = _big_mlp(width, depth).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    stepped = optimizer if name is None else distribute(model, optimizer, _algorithm(name),
                                                        comm)
    g = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(64, width, generator=g).to(device)
    y = torch.randint(0, width, (64,), generator=g).to(device)
    for _ in range(steps):
        stepped.zero_grad()
        F.cross_entropy(model(x), y).backward()
        stepped.step()
    kept: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    kept_tensors(list(model.parameters()), "parameters", seen, kept)
    kept_tensors([p.grad for p in model.parameters() if p.grad is not None], "grads", seen,
                 kept)
    kept_tensors(optimizer.state, "optimizer state", seen, kept)
    if name is not None:
        kept_tensors(stepped.runtime, "runtime", seen, kept)
        stepped.finish()
    return tensor_bytes(kept.values())


def memory(s: Settings, part: Part) -> None:
    from gossamer.algorithms import available
    from gossamer.comm import SimWorld

    width, depth, workers, steps = (256, 4, 4, 3) if s.short else (4096, 6, 4, 3)
    params = depth * (width * width + width)
    rows = {}
    for name in [None, *available()]:
        label = name or "adamw"

        def one(name=name):
            gc.collect()
            if s.cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(s.device)
                base = torch.cuda.memory_allocated(s.device)
            kept = SimWorld(workers).run(_memory_worker, name, s.device, width, depth, steps)
            row = {"kept_bytes_per_worker": max(kept)}
            if s.cuda:
                row["peak_bytes"] = torch.cuda.max_memory_allocated(s.device) - base
            return row
        row = _guarded(part, label, one)
        if row is not None:
            rows[label] = row
    if "adamw" in rows:
        base = rows["adamw"]
        for row in rows.values():
            row["kept_x_adamw"] = row["kept_bytes_per_worker"] / base["kept_bytes_per_worker"]
            if "peak_bytes" in row:
                row["peak_x_adamw"] = row["peak_bytes"] / base["peak_bytes"]
    part.data.update(parameters=params, workers=workers, steps=steps, methods=rows)
    key = "peak_x_adamw" if s.cuda else "kept_x_adamw"
    worst = max((r.get(key, 0.0), n) for n, r in rows.items())
    part.summary = (f"{params / 1e6:.1f}M parameters, {workers} workers: "
                    f"{'peak GPU memory' if s.cuda else 'bytes kept'} up to {worst[0]:.2f}x "
                    f"plain AdamW's ({worst[1]})")


def _resnet20_step(model: nn.Module, optimizer, device: str, seed: int, batch: int
                   ) -> Callable[[], None]:
    from gossamer.bench import sgd_step

    g = torch.Generator().manual_seed(seed)
    data = (torch.randn(batch, 3, 32, 32, generator=g).to(device),
            torch.randint(0, 10, (batch,), generator=g).to(device))
    return sgd_step(model, optimizer, data)


def _resnet20(device: str) -> nn.Module:
    from gossamer.train.models import build_model

    torch.manual_seed(0)
    return build_model("resnet20", (3, 32, 32), 10).to(device)


def _sim64_worker(comm, device: str, batch: int, steps: int) -> float:
    from gossamer.api import distribute

    model = _resnet20(device)
    optimizer = distribute(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                           "allreduce", comm)
    step = _resnet20_step(model, optimizer, device, comm.rank, batch)
    step()  # warm-up
    comm.barrier()
    sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    comm.barrier()
    sync(device)
    return (time.perf_counter() - started) / steps


def sim64(s: Settings, part: Part) -> None:
    from gossamer.comm import SimWorld

    workers, batch, steps = (4, 8, 2) if s.short else (64, 32, 5)
    model = _resnet20(s.device)
    step = _resnet20_step(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                          s.device, 0, batch)
    for _ in range(3):
        step()
    sync(s.device)
    started = time.perf_counter()
    for _ in range(steps * 4):
        step()
    sync(s.device)
    bare = (time.perf_counter() - started) / (steps * 4)
    simulated = SimWorld(workers).run(_sim64_worker, s.device, batch, steps)[0]
    ratio = simulated / (workers * bare)
    part.data.update(workers=workers, batch=batch, steps=steps, bare_step_ms=1e3 * bare,
                     simulated_step_ms=1e3 * simulated, ratio=ratio)
    # benchmarks/sim_overhead.py's target at 64 workers (an MLP on a CPU there)
    part.check(f"simulated step / {workers} bare steps", ratio, 1.5, applied=not s.short)
    part.summary = (f"{workers} workers of ResNet-20, batch {batch}: simulated step "
                    f"{1e3 * simulated:.1f} ms against {workers} x {1e3 * bare:.2f} ms bare: "
                    f"{ratio:.2f}x")


PARTS: dict[str, Callable[[Settings, Part], None]] = {
    "environment": environment, "parity": parity, "compress": compress, "nccl": nccl,
    "amp": amp, "compile": compile_, "memory": memory, "sim64": sim64,
}
TITLES = {
    "environment": "Python, torch, the GPU; torch's privates gossamer uses",
    "parity": "SimWorld with device tensors against the CPU, every registered method",
    "compress": "compressors against the read-only floor, PowerSGD against torch's",
    "nccl": "one-rank NCCL process group through TorchCommunicator",
    "amp": "bf16 autocast and GradScaler through distribute",
    "compile": "torch.compile'd model under distribute: AllReduce, DiLoCo, SGP",
    "memory": "peak GPU memory of each method against plain AdamW, 100M parameters",
    "sim64": "64 simulated workers of ResNet-20 on one device against the bare step",
}


# ------------------------------------------------------------------------------ running


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise :class:`PartTimeout` in this thread after ``seconds`` (between Python
    bytecodes: a long kernel ends first)."""

    global _expired

    def expired(signum, frame):
        global _expired
        _expired = True
        raise PartTimeout(f"stopped after {seconds:.0f} s")

    _expired = False
    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)  # _expired stays: the caller reads it


def preload() -> None:
    """Import what the parts use before any time limit runs: a limit that stops an import
    halfway leaves a broken module behind for every later part."""
    import torch._dynamo  # noqa: F401 - and sympy, which distribute's checks reach too

    import gossamer.api  # noqa: F401
    import gossamer.device_parity  # noqa: F401
    import gossamer.train.models  # noqa: F401
    from benchmarks import compress  # noqa: F401


def skip_reason(name: str, s: Settings) -> str | None:
    if name == "nccl" and not s.cuda and s.comm_backend in (None, "nccl"):
        return "NCCL needs a CUDA device (--comm-backend gloo runs this part on the CPU)"
    if name == "nccl" and s.comm_backend in (None, "nccl") \
            and not torch.distributed.is_nccl_available():
        return "this torch has no NCCL"
    return None


def run_part(name: str, s: Settings, deadline: float) -> Part:
    part = Part(name)
    reason = skip_reason(name, s)
    left = deadline - time.perf_counter()
    if reason is None and left < MIN_START:
        reason = f"the budget is spent ({left:.0f} s left)"
    if reason is not None:
        part.status, part.summary = "skipped", reason
        return part
    allowed = min(s.part_time or (CAPS if s.cuda else CPU_CAPS)[name], left)
    started, cpu = time.perf_counter(), time.process_time()
    try:
        with _time_limit(allowed):
            PARTS[name](s, part)
        failed = [c for c in part.checks if c["ok"] is False]
        part.status = "failed" if failed else "passed"
    except PartTimeout as exc:
        part.status, part.error = "timeout", f"{exc} (its share of the budget)"
    except Exception as exc:
        if _expired:  # the timeout, as a simulated worker's failure
            part.status, part.error = "timeout", f"stopped after {allowed:.0f} s"
        else:
            part.status, part.error = "error", f"{type(exc).__name__}: {exc}"
        part.data["traceback"] = traceback.format_exc()[-4000:]
    finally:
        part.seconds = time.perf_counter() - started
        # this process's CPU seconds: on a busy machine far below the wall seconds
        part.data["cpu_seconds"] = time.process_time() - cpu
        gc.collect()
        if s.cuda:
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    return part


def _cell(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def write_report(out: Path, header: dict[str, Any], parts: list[Part]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    body = {**header, "parts": [dataclasses.asdict(p) for p in parts]}
    (out / "report.json").write_text(json.dumps(body, indent=1, default=str) + "\n")
    lines = [f"# GPU check: {header['device_name']}", "",
             f"`{header['command']}`: {header['finished'] or 'running'}; "
             f"{header['seconds']:.1f} s: imports {header.get('preload_seconds', 0.0):.1f} s, "
             f"then the parts, in a budget of {header['budget']:.0f} s. "
             f"Python {header['python']}, torch {header['torch']}.", "",
             "| part | what | status | seconds | summary |", "|---|---|---|---:|---|"]
    for p in parts:
        lines.append(f"| {p.name} | {TITLES[p.name]} | {p.status} | {p.seconds:.1f} | "
                     f"{(p.error or p.summary).replace('|', '/')} |")
    for p in parts:
        if not p.checks:
            continue
        lines += ["", f"## {p.name}", ""]
        for c in p.checks:
            mark = {True: "ok", False: "FAILED", None: "reported"}[c["ok"]]
            if "value" in c:
                lines.append(f"- {mark}: {c['name']} = {_cell(c['value'])} "
                             f"(limit {c['relation']} {_cell(c['limit'])})")
            else:
                lines.append(f"- {mark}: {c['name']}")
    (out / "report.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu-check", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu: a short "
                        "version of every part a CPU can run")
    parser.add_argument("--out", default="gpu-check-report", help="the report's folder "
                        "(default gpu-check-report)")
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole "
                        f"check (default {BUDGET:.0f}; {CPU_BUDGET:.0f} with --device cpu)")
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--compile-backend", default=None, help="torch.compile's backend "
                        "(default inductor on a GPU, aot_eager on a CPU: no C++ build)")
    parser.add_argument("--comm-backend", default=None, help="the nccl part's backend "
                        "(default nccl; gloo runs it on a CPU)")
    parser.add_argument("--part-time", type=float, default=None, help="seconds each part "
                        "may take, instead of its own cap (a slow machine, the tests)")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print(f"--device {args.device}: CUDA is not available to torch {torch.__version__}; "
              "give --device cpu for the short CPU version", file=sys.stderr)
        return 2
    s = Settings(device=args.device, short=not cuda,
                 compile_backend=args.compile_backend or ("inductor" if cuda else "aot_eager"),
                 comm_backend=args.comm_backend, part_time=args.part_time)
    budget = args.budget if args.budget is not None else (BUDGET if cuda else CPU_BUDGET)
    # one thread: the CPU's work here is small tensors, which more threads only slow down
    # (40x the CPU time of one thread on a busy 2-core machine), and on a GPU the kernels
    torch.set_num_threads(1)
    start = time.perf_counter()
    out = Path(args.out)
    header = {"command": " ".join(["scripts/gpu-check", *(argv if argv is not None
                                                           else sys.argv[1:])]),
              "device": args.device, "budget": budget, "finished": None, "seconds": 0.0,
              "python": platform.python_version(), "torch": torch.__version__,
              "device_name": torch.cuda.get_device_name(args.device) if cuda
              else f"CPU ({os.cpu_count()} cores)", "skipped": []}
    parts = [Part(name) for name in args.parts]
    write_report(out, header, parts)
    preload()
    header["preload_seconds"] = time.perf_counter() - start
    deadline = time.perf_counter() + budget  # the parts' budget: the imports come first
    for i, name in enumerate(args.parts):
        print(f"[{i + 1}/{len(parts)}] {name}: {TITLES[name]} ...", flush=True)
        parts[i] = run_part(name, s, deadline)
        p = parts[i]
        if p.status == "skipped":
            header["skipped"].append({"part": name, "reason": p.summary})
        print(f"    {p.status} in {p.seconds:.1f} s: {p.error or p.summary}", flush=True)
        for c in p.checks:
            if c["ok"] is False:
                print(f"    FAILED: {c['name']}"
                      + (f" = {_cell(c['value'])}" if "value" in c else ""), flush=True)
        header["seconds"] = time.perf_counter() - start
        write_report(out, header, parts)
    header["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    header["seconds"] = time.perf_counter() - start
    write_report(out, header, parts)
    bad = [p.name for p in parts if p.status in ("failed", "error", "timeout")]
    print(f"report: {out / 'report.md'} ({header['seconds']:.0f} s; "
          + (f"not passed: {', '.join(bad)})" if bad else "every part that ran passed)"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
