"""Gradient compression: compression speed, bytes on the wire, accuracy.

    gossamer bench compress speed --threads 1 --reps 30
    gossamer bench compress speed --device cuda --reps 100 --slow-reps 30
    gossamer bench compress bytes --workers 8
    gossamer bench compress accuracy --data ../shared/data --dgc-warmup 60
    gossamer bench compress accuracy --workers 16 --methods allreduce --sparse-warmup 125
    gossamer bench compress accuracy --workers 16 --methods allreduce --sparse-warmup 125 \
        --steps 600 --seed 1
    gossamer bench compress digits

speed: seconds to compress one 25.6M-element float32 gradient (ResNet-50's size) on this CPU
with DGC (density 0.001), exact top-k (``torch.topk``), random-k, QSGD and PowerSGD (rank 2,
compress and reconstruct, as a 5120 x 5000 matrix), each against a read-only one-pass floor
measured in the same run, interleaved with it (``torch.aminmax(x)``). Targets: DGC <= 4x the
floor and >= 10x faster than exact top-k. Timings on a busy machine are noisy: the median and
the minimum of each are reported.
With ``--device cuda`` the gradient, the matrix and every compressor's work (torch's PowerSGD
included) are on the GPU, and each timing brackets the call with ``torch.cuda.synchronize()``:
it measures the kernels, not their launch. The CPU-time columns are left out there (a thread's
CPU time says nothing of a GPU's), and the result file (``compress_speed_cuda`` by default)
records the GPU's name. Target on the GPU: QSGD, PowerSGD and DGC side by side with the floor,
DGC <= 3x the floor.

bytes: per step and worker, DGC at density 0.001 against the dense all-reduce, for ResNet-20
and the MNIST CNN: what each worker puts on the wire for the compressed tensors (its packed
payload, header included, against the float32 gradient: target >= 250x), the total with the
tensors sent dense (biases, BatchNorm), and the bytes the communicator's counters record in an
n-worker simulated step (a ring all-gather forwards every worker's payload, n - 1 of them; a
ring all-reduce sends 2 (n - 1) / n of the gradient), and the same for DGC through the sparse
all-reduce (``aggregation="sparse_allreduce"``: about two payloads per worker whatever n;
everything it sends counted: byte counts, entries to the owners, the all-gather of the kept
sums, the dense tensors). One step: the sparse all-reduce's first reduction, which keeps the
owners' quotas alone (no threshold yet); its steady state is measured by ``accuracy``.

accuracy: the MNIST CNN (recipes/mnist-cnn.yaml, 8 simulated workers, 300 steps) with AllReduce,
DGC at 0.001, top-k, QSGD and PowerSGD (``--methods``), and DGC through the sparse all-reduce
(``--sparse-warmup``); ``--steps`` and ``--seed`` other than the recipe's write to their own
folder and result file; final eval accuracy against AllReduce's (target: DGC within 0.5 points)
and bytes per worker per step, over the run and over its last evaluation interval (after the
density warm-up: the sparse all-reduce's threshold at work, which one step of ``bytes`` does
not show).

digits: ``gossamer train --sim 4 --algorithm NAME`` (the defaults) for dgc, topk, qsgd and
powersgd; target >= 85% eval accuracy.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.common import (
    RUN_DIR_UNSAFE,
    add_data_argument,
    add_steps_argument,
    cnn_bytes,
    mnist_cnn,
    split_entry,
)
from gossamer.bench import Results, machine

NUMEL = 25_600_000  # ResNet-50's parameters
DENSITY = 0.001


# ------------------------------------------------------------------------------ speed


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this thread): with one torch thread the second leaves
    out the time this process waited for a core on a busy machine."""
    start, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - start, time.thread_time() - cpu


def _torch_powersgd(matrix: torch.Tensor, rank: int):
    """One worker's compute in torch's PowerSGD DDP hook (``powerSGD_hook``, a tensor it
    compresses, without the all-reduces and the error feedback): ``P = M Q``, P orthogonalized
    (its Gram-Schmidt for rank <= 2), ``Q = M^T P``, and ``P Q^T`` written into the bucket's
    buffer (``out=``, as the hook writes into the gradient), from a fixed normal ``Q``."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

    n, m = matrix.shape
    q0 = torch.randn(m, rank, generator=torch.Generator().manual_seed(0)).to(matrix.device)
    p, q, out = torch.empty(n, rank, device=matrix.device), q0.clone(), torch.empty_like(matrix)

    def run() -> None:
        q.copy_(q0)
        torch.matmul(matrix, q, out=p)
        _orthogonalize(p.unsqueeze(0))
        torch.matmul(matrix.t(), p, out=q)
        torch.matmul(p, q.t(), out=out)
    return run


SLOW = {"topk", "powersgd", "torch-powersgd"}  # seconds each on a CPU: fewer repetitions


def compressor_calls(x: torch.Tensor, names) -> tuple[dict, object]:
    """One call each of the compressors ``names`` (of dgc, topk, randomk, qsgd, powersgd,
    torch-powersgd) on the flat gradient ``x``, PowerSGD's on ``x`` as a matrix of 5000
    columns (the first multiple of 5000 elements); and DGC's compressor (its last
    selection)."""
    from gossamer.compress import QSGD, DGCCompressor, PowerSGD, RandomK, TopK

    matrix = x[: x.numel() // 5000 * 5000].view(-1, 5000)
    dgc = DGCCompressor(ratio=DENSITY)
    topk = TopK(ratio=DENSITY)
    randomk = RandomK(ratio=DENSITY)
    qsgd = QSGD(levels=127)
    powersgd = PowerSGD(rank=2)

    def powersgd_round() -> None:  # one worker's compute of both rounds and the result
        p = powersgd.compress(matrix, "g")
        q = powersgd.next_round(p, "g")
        powersgd.decompress_sum(q, "g")

    calls = {
        "dgc": lambda: dgc.compress(x, "g"),
        "topk": lambda: topk.compress(x, "g"),
        "randomk": lambda: randomk.compress(x, "g"),
        "qsgd": lambda: qsgd.compress(x, "g"),
        "powersgd": powersgd_round,
        "torch-powersgd": _torch_powersgd(matrix, rank=2),
    }
    return {name: fn for name, fn in calls.items() if name in names}, dgc


def floor_call(x: torch.Tensor):
    """The read-only one-pass floor: read every element of ``x`` once, write nothing."""
    return lambda: torch.aminmax(x)


def interleaved_times(floor, methods: dict, reps: int, slow_reps: int, cuda: bool
                      ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and CPU seconds of ``floor`` and each of ``methods`` (name -> call), after one
    warm-up call each, every method's call right after one of the floor's, ``reps`` times
    (``slow_reps`` for the names in ``SLOW``). With ``cuda``: wall seconds from an idle
    device to the end of the call's kernels (the CPU times, meaningless there, are 0)."""

    def timed(fn) -> tuple[float, float]:
        if not cuda:
            return _timed(fn)
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start, 0.0

    for fn in [floor, *methods.values()]:  # warm-up: allocations, workspaces, kernels
        fn()
    if cuda:
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in ["floor", *methods]}
    cpu: dict[str, list[float]] = {name: [] for name in ["floor", *methods]}
    for rep in range(reps):
        for name, fn in methods.items():
            if name in SLOW and rep >= slow_reps:
                continue
            for label, run in (("floor", floor), (name, fn)):
                wall, used = timed(run)
                times[label].append(wall)
                cpu[label].append(used)
    return times, cpu


def speed(args: argparse.Namespace, results: Results) -> None:
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"--device cuda: CUDA is not available to this torch "
                         f"({torch.__version__}, CUDA {torch.version.cuda or 'not built in'}); "
                         f"run on a machine with a GPU, or give --device cpu")
    torch.set_num_threads(args.threads)
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0)).to(args.device)
    methods, dgc = compressor_calls(x, args.methods)
    times, cpu = interleaved_times(floor_call(x), methods, args.reps, args.slow_reps, cuda)
    selection = dgc.last_selection
    rows = {}
    floor_med, floor_min = statistics.median(times["floor"]), min(times["floor"])
    floor_cpu = statistics.median(cpu["floor"])
    for name, samples in times.items():
        med, best = statistics.median(samples), min(samples)
        rows[name] = {"median_ms": 1e3 * med, "min_ms": 1e3 * best, "runs": len(samples),
                      "x_floor_median": med / floor_med, "x_floor_min": best / floor_min}
        line = (f"{name:9s} median {1e3 * med:9.2f} ms  min {1e3 * best:9.2f} ms  "
                f"= {med / floor_med:6.2f}x floor (median), {best / floor_min:6.2f}x (min)")
        if not cuda:
            cpu_med = statistics.median(cpu[name])
            rows[name].update(cpu_median_ms=1e3 * cpu_med, x_floor_cpu=cpu_med / floor_cpu)
            line += f", {cpu_med / floor_cpu:6.2f}x (CPU time, median)"
        print(line)
    result = {"numel": NUMEL, "density": DENSITY, "device": args.device,
              "threads": torch.get_num_threads(), "reps": args.reps, "rows": rows}
    if cuda:
        result["device_name"] = torch.cuda.get_device_name()
        print(f"device: {result['device_name']} (wall times, synchronized)")
    if "dgc" in rows and "topk" in rows:
        result["topk_over_dgc_median"] = rows["topk"]["median_ms"] / rows["dgc"]["median_ms"]
        result["topk_over_dgc_min"] = rows["topk"]["min_ms"] / rows["dgc"]["min_ms"]
        if not cuda:
            result["topk_over_dgc_cpu"] = (rows["topk"]["cpu_median_ms"]
                                           / rows["dgc"]["cpu_median_ms"])
        print(f"exact top-k / DGC: {result['topk_over_dgc_median']:.1f}x (median), "
              f"{result['topk_over_dgc_min']:.1f}x (min)")
    if "powersgd" in rows and "torch-powersgd" in rows:
        for stat in ("median_ms", "min_ms") if cuda else ("median_ms", "min_ms", "cpu_median_ms"):
            result[f"powersgd_over_torch_{stat}"] = (rows["powersgd"][stat]
                                                     / rows["torch-powersgd"][stat])
        print(f"PowerSGD / torch's PowerSGD: {result['powersgd_over_torch_median_ms']:.2f}x "
              f"(median), {result['powersgd_over_torch_min_ms']:.2f}x (min)")
    if selection is not None:
        result["dgc_selection"] = vars(selection)
        print(f"DGC selected {selection.selected} of target {selection.target} "
              f"({selection.path})")
    results.write(args.name or ("compress_speed_cuda" if cuda else "compress_speed"), result)


# ------------------------------------------------------------------------------ bytes


def _models():
    from gossamer.train.models import build_model

    return {"resnet20": (build_model("resnet20", (3, 32, 32), 10), (3, 32, 32)),
            "mnist-cnn": (build_model("cnn", (1, 28, 28), 10), (1, 28, 28))}


def bytes_worker(comm, model_name: str) -> dict[str, int]:
    """One step's gradient of ``model_name``, reduced with DGC and with a dense all-reduce, the
    compressed and the dense tensors apart, in AllReduce's buckets (reverse registration
    order, the first at most 1 MiB, then 25 MiB: one reduction each); bytes sent by this
    worker for each."""
    from gossamer.comm.buckets import layout
    from gossamer.compress import CompressedReducer, DGCCompressor, DGCMemory, NoCompression
    from gossamer.patterns.overlap import FIRST_BUCKET_BYTES

    model, shape = _models()[model_name]
    g = torch.Generator().manual_seed(comm.rank)
    x, y = torch.randn(8, *shape, generator=g), torch.randint(0, 10, (8,), generator=g)
    F.cross_entropy(model(x), y).backward()
    named = list(reversed([(n, p.grad) for n, p in model.named_parameters()]))
    slots, sizes, _ = layout([t for _, t in named], 25 * 2**20, FIRST_BUCKET_BYTES)
    buckets: list[list[tuple[str, torch.Tensor]]] = [[] for _ in sizes]
    for item, (bucket, _, _) in zip(named, slots, strict=True):
        buckets[bucket].append(item)
    compressor = DGCCompressor(ratio=DENSITY)
    out = {"buckets": len(buckets)}
    for label, compressed in (("compressed", True), ("dense", False)):
        for method, reducer in (
            ("dgc", CompressedReducer(comm, compressor, DGCMemory(momentum=0.9),
                                      bucket_bytes=25 * 2**20)),
            ("sparse", CompressedReducer(comm, compressor, DGCMemory(momentum=0.9),
                                         aggregation="sparse_allreduce",
                                         bucket_bytes=25 * 2**20)),
            ("allreduce", CompressedReducer(comm, NoCompression(), bucket_bytes=25 * 2**20)),
        ):
            before = comm.stats.total_bytes_sent
            for bucket in buckets:
                subset = [(n, t.clone()) for n, t in bucket
                          if compressor.compresses(t) == compressed]
                if subset:
                    reducer.reduce(subset, step=0)
            out[f"{method}_{label}_wire"] = comm.stats.total_bytes_sent - before
            out[f"{method}_{label}_payload"] = reducer.payload_bytes + reducer.dense_bytes
    out["compressed_numel"] = sum(t.numel() for _, t in named if compressor.compresses(t))
    out["dense_numel"] = sum(t.numel() for _, t in named if not compressor.compresses(t))
    return out


def bytes_(args: argparse.Namespace, results: Results) -> None:
    from gossamer.comm import SimWorld

    torch.set_num_threads(args.threads)
    rows = []
    for model_name in ("resnet20", "mnist-cnn"):
        for n in args.workers:
            r = SimWorld(n).run(bytes_worker, model_name)[0]
            payload_dense = 4 * r["compressed_numel"]
            row = {
                "model": model_name, "workers": n, "density": DENSITY,
                "compressed_params": r["compressed_numel"], "dense_params": r["dense_numel"],
                # what one worker puts on the wire (its own message), n-independent
                "payload_compressed_bytes": r["dgc_compressed_payload"],
                "payload_ratio_compressed": payload_dense / r["dgc_compressed_payload"],
                "payload_ratio_total": 4 * (r["compressed_numel"] + r["dense_numel"])
                / (r["dgc_compressed_payload"] + 4 * r["dense_numel"]),
                # what the communicator counted for this worker in one step
                "wire_dgc_compressed": r["dgc_compressed_wire"],
                "wire_allreduce_compressed": r["allreduce_compressed_wire"],
                "wire_dgc_total": r["dgc_compressed_wire"] + r["dgc_dense_wire"],
                "wire_allreduce_total": r["allreduce_compressed_wire"]
                + r["allreduce_dense_wire"],
            }
            row["wire_ratio_compressed"] = (row["wire_allreduce_compressed"]
                                            / row["wire_dgc_compressed"])
            row["wire_ratio_total"] = row["wire_allreduce_total"] / row["wire_dgc_total"]
            # the sparse all-reduce: everything this worker sent (byte counts, its entries to
            # the owners, the ring all-gather of the kept sums, the dense tensors' all-reduce)
            row["wire_sparse_compressed"] = r["sparse_compressed_wire"]
            row["wire_sparse_total"] = r["sparse_compressed_wire"] + r["sparse_dense_wire"]
            row["wire_ratio_sparse_compressed"] = (row["wire_allreduce_compressed"]
                                                   / row["wire_sparse_compressed"])
            row["wire_ratio_sparse_total"] = (row["wire_allreduce_total"]
                                              / row["wire_sparse_total"])
            rows.append(row)
            print(f"{model_name:9s} n={n:3d}: compressed tensors {r['compressed_numel']:,} "
                  f"params, payload {row['payload_compressed_bytes']:,} B = "
                  f"{row['payload_ratio_compressed']:.0f}x less; with the "
                  f"{r['dense_numel']:,} dense ones {row['payload_ratio_total']:.0f}x; on the "
                  f"wire (ring, n={n}) {row['wire_ratio_compressed']:.0f}x / "
                  f"{row['wire_ratio_total']:.0f}x; sparse all-reduce "
                  f"{row['wire_sparse_total']:,} B of {row['wire_allreduce_total']:,} B, "
                  f"{row['wire_ratio_sparse_compressed']:.0f}x / "
                  f"{row['wire_ratio_sparse_total']:.0f}x")
    results.write("compress_bytes", {"rows": rows})


# ------------------------------------------------------------------------------ accuracy


def accuracy(args: argparse.Namespace, results: Results) -> None:
    from gossamer.train.report import load_metrics, write_report
    from gossamer.train.run import run_training

    base = mnist_cnn(args.data, steps=args.steps)
    torch.set_num_threads(args.threads)
    # the final accuracy is what is compared: evaluate the average only, every 100 steps
    config = base.replace(sim=args.workers, eval_every=100, eval_workers=False, seed=args.seed)
    dgc = f"dgc:ratio={DENSITY}"
    entries = {"allreduce": "allreduce", "dgc": dgc, "topk": "topk", "qsgd": "qsgd",
               "powersgd": "powersgd"}
    entries = {name: entries[name] for name in args.methods}
    for steps in args.dgc_warmup:  # DGC with the paper's density warm-up, as extra rows
        entries[f"dgc-warmup{steps}"] = f"{dgc}:warmup_steps={steps}"
    # DGC through the sparse all-reduce: AllReduce with the DGC spec and the aggregation
    specs = {name: split_entry(label) for name, label in entries.items()}
    for steps in args.sparse_warmup:
        spec = f"{dgc}:warmup_steps={steps}"  # 0: none (the default warms up)
        name = f"dgc-sparse-warmup{steps}"
        entries[name] = f"{spec}:aggregation=sparse_allreduce"
        specs[name] = ("allreduce", {"compression": spec, "aggregation": "sparse_allreduce"})
    # runs of another length or seed go to their own folder and result file
    suffix = (f"-seed{args.seed}" if args.seed else "") + (f"-steps{args.steps}"
                                                           if args.steps else "")
    out = results.folder / f"compress-mnist-{args.workers}{suffix}"
    runs = {}
    for name, label in entries.items():
        run_dir = out / re.sub(RUN_DIR_UNSAFE, "_", label)
        if not (args.reuse and (run_dir / "metrics.jsonl").is_file()):
            algorithm, options = specs[name]
            print(f"  {label}: {config.steps} steps of {args.workers} simulated workers ...",
                  flush=True)
            started = time.perf_counter()
            run_training(config.replace(algorithm=algorithm, options=options,
                                        run_dir=str(run_dir)))
            print(f"  {label}: {time.perf_counter() - started:.0f} s")
        runs[name] = load_metrics(run_dir)
        runs[name].name = label
    write_report(list(runs.values()), out, title="gradient compression, MNIST CNN")
    model_bytes = cnn_bytes()
    reference = runs["allreduce"].final
    rows = []
    reference_tail = _tail_bytes_per_step(runs["allreduce"])
    for name, run in runs.items():
        final = run.final
        per_step = final["bytes_sent"] / config.steps
        tail = _tail_bytes_per_step(run)
        rows.append({"method": name, "entry": entries[name], "workers": args.workers,
                     "seed": args.seed,
                     "steps": config.steps, "eval_accuracy": final["eval_accuracy"],
                     "delta_vs_allreduce_points": 100 * (final["eval_accuracy"]
                                                         - reference["eval_accuracy"]),
                     "bytes_per_step": per_step,
                     "bytes_vs_allreduce": final["bytes_sent"] / reference["bytes_sent"],
                     # the last evaluation interval, after any density warm-up
                     "tail_bytes_per_step": tail,
                     "tail_allreduce_over_this": reference_tail / tail if tail else None,
                     "model_bytes": model_bytes})
        print(f"{name:15s} acc {100 * final['eval_accuracy']:.2f}% "
              f"({rows[-1]['delta_vs_allreduce_points']:+.2f}) bytes/step "
              f"{per_step / 1e3:.1f} kB = {rows[-1]['bytes_vs_allreduce']:.4f} x AllReduce; "
              f"last {config.eval_every} steps {tail / 1e3:.2f} kB/step = "
              f"{reference_tail / tail:.0f}x fewer than AllReduce")
    results.write("compress_accuracy" + suffix.replace("-", "_"),
                  {"recipe": "recipes/mnist-cnn.yaml", "seed": args.seed, "rows": rows})


def _tail_bytes_per_step(run) -> float:
    """Bytes per worker per step between a run's last two evaluations (after a density
    warm-up that ends before them: the steady state; the sparse all-reduce's threshold
    included)."""
    (before, last) = run.evals[-2:]
    return (last["bytes_sent"] - before["bytes_sent"]) / (last["step"] - before["step"])


def digits(args: argparse.Namespace, results: Results) -> None:
    from gossamer.train.config import TrainConfig
    from gossamer.train.run import run_training

    rows = []
    for name in args.methods:
        started = time.perf_counter()
        result = run_training(TrainConfig(sim=4, algorithm=name, quiet=True))
        rows.append({"method": name, "eval_accuracy": result["eval_accuracy"],
                     "bytes_sent": result["bytes_sent"],
                     "real_seconds": time.perf_counter() - started})
        print(f"{name:9s} digits, 4 simulated workers, defaults: eval accuracy "
              f"{100 * result['eval_accuracy']:.2f}%, {result['bytes_sent'] / 1e3:.1f} kB sent "
              f"per worker")
    results.write("compress_digits", {"rows": rows})


PARTS = {"speed": speed, "bytes": bytes_, "accuracy": accuracy, "digits": digits}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="part", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    s.add_argument("--reps", type=int, default=30)
    s.add_argument("--slow-reps", type=int, default=5, help="repetitions of top-k and "
                   "the two PowerSGDs (slow ones)")
    s.add_argument("--methods", nargs="+", default=["dgc", "topk", "randomk", "qsgd",
                                                    "powersgd", "torch-powersgd"])
    s.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the gradient and the compressors' work are (default cpu); "
                   "cuda: synchronized wall times on the GPU")
    s.add_argument("--name", default=None, help="result file name (default compress_speed, "
                   "with --device cuda compress_speed_cuda)")
    b = sub.add_parser("bytes")
    b.add_argument("--workers", type=int, nargs="+", default=[8])
    b.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    a = sub.add_parser("accuracy")
    add_data_argument(a)
    a.add_argument("--workers", type=int, default=8)
    a.add_argument("--dgc-warmup", type=int, nargs="*", default=[],
                   help="also DGC with these warm-up steps")
    a.add_argument("--methods", nargs="+", default=["allreduce", "dgc", "topk", "qsgd",
                                                    "powersgd"],
                   choices=["allreduce", "dgc", "topk", "qsgd", "powersgd"],
                   help="the methods run (allreduce is needed: the others are compared to it)")
    a.add_argument("--sparse-warmup", type=int, nargs="*", default=[],
                   help="also DGC through the sparse all-reduce with these warm-up steps "
                   "(0: none)")
    a.add_argument("--reuse", action="store_true", help="keep runs already in the results")
    a.add_argument("--seed", type=int, default=0, help="the runs' seed (default 0)")
    a.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    add_steps_argument(a)
    d = sub.add_parser("digits")
    d.add_argument("--methods", nargs="+", default=["dgc", "topk", "qsgd", "powersgd"])


def run(args: argparse.Namespace, results: Results) -> int:
    print(machine())
    PARTS[args.part](args, results)
    return 0
