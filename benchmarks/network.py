"""The network suite: collectives, steps, simulator, stragglers, accuracy on emulated links.

gossamer on an emulated network (issue 8): collectives, training steps, the simulator,
stragglers, time to accuracy.

    gossamer bench network --quick          # every part, under 20 minutes on 2 cores
    gossamer bench network                  # full: more sizes, steps and repetitions
    gossamer bench network --quick --parts b c
    gossamer bench network --quick --parts a b c --mtu 65535   # 64 KiB frames

Needs Linux, root, iproute2 (ip, tc) and the tbf qdisc; without them it says so and exits with
code 2. Writes ``benchmarks/results/network_{a..e}.json``, figures to ``benchmarks/figures/``
and the markdown draft ``benchmarks/results/network_section.md``. Ctrl-C stops it; the
emulated network is removed either way.

Every worker is a gloo process in a Linux network namespace of its own, joined to the others
by a veth link to a bridge; tc's token bucket (``tbf``) limits each link's upload and download
(:class:`gossamer.launch.Network`, what ``gossamer launch --emulate`` uses). Links carry
9000-byte frames (``mtu=9000``, jumbo frames): with 1500-byte frames and no segmentation
offload the kernel's per-frame work for four links saturates this machine's two cores below
1 Gbit/s (part a measures both). ``--mtu 65535`` gives the links 64 KiB frames: what a real
NIC's segmentation offload hands the kernel, so that the host's per-frame work is a cluster
node's, not that of a machine forwarding every worker's frames on the cores that also compute.
The kernel has no netem, so links add no delay: latency is what the stack and the processes
add.

- (a) all-reduce of 1, 10 and 100 MB (and 4, 64 KiB for the fit) at 2 and 4 workers over
  1 and 10 Gbit/s links against the alpha-beta model (:func:`gossamer.comm.cost.
  ring_all_reduce_time`), with alpha and beta fitted to the measurements
  (:func:`gossamer.comm.cost.fit_ring_all_reduce`); point-to-point messages too.
- (b) time per training step of every algorithm, 4 workers at 1 Gbit/s, an MLP 784-2048-2048-10
  (5.8M parameters), and the speed-up over AllReduce.
- (c) SimWorld's prediction of (b): the same worker code (:mod:`benchmarks.netbench_tasks`)
  with each rank's measured local work per step as compute and (a)'s fitted alpha and beta
  as network.
- (d) one straggler (rank 3): 4x the compute, or a quarter of the bandwidth; throughput
  relative to (b).
- (e) the small CNN on MNIST at 1 Gbit/s until 97% eval accuracy, per algorithm.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import network_report
from benchmarks.common import add_data_argument
from benchmarks.network_model import all_reduce_model, fitted_network, nominal_network
from gossamer.bench import Results, machine

MB = 10**6
PARTS = ("a", "b", "c", "d", "e")


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What one run of the suite measures; :data:`QUICK` and :data:`FULL`."""

    mode: str
    # (a) collectives
    workers: tuple[int, ...] = (2, 4)
    gbits: tuple[float, ...] = (1.0, 10.0)
    sizes: tuple[int, ...] = (4096, 65536, MB, 10 * MB, 100 * MB)  # all-reduce bytes
    table_sizes: tuple[int, ...] = (MB, 10 * MB, 100 * MB)  # the ones in the table
    p2p_sizes: tuple[int, ...] = (MB, 10 * MB)
    reps: tuple[tuple[int, int], ...] = ((4096, 10), (65536, 10), (MB, 5), (10 * MB, 5),
                                         (100 * MB, 3))
    mtu: int = network_report.DEFAULT_MTU  # bytes per frame on every link of every part
    # (a) also with these frame sizes, for one all-reduce size at the largest worker count
    mtu_compare: tuple[int, ...] = (1500, 65535)
    mtu_compare_size: int = 100 * MB
    # (b) - (e)
    train_workers: int = 4
    train_gbits: float = 1.0
    warmup: int = 3  # steps not timed
    steps: int = 16  # steps timed: a multiple of local SGD's 8 and QSR's 4
    batch: int = 32  # per worker
    # (b), (d): seconds each worker sleeps in place of its forward and backward passes (fixed
    # gradients instead): an accelerator's compute, which leaves the host's cores to the
    # communication; 0: the MLP's real forward and backward on the host's cores
    compute_sleep: float = 0.0
    # (b): the methods to measure, labels of benchmarks.netbench_tasks (empty: all of ALGORITHMS)
    algorithms: tuple[str, ...] = ()
    # (c): the simulator's network and compute: "fitted" (a's fit at the training setting) or
    # "nominal" (the link's rate, 50 us), with the measured spread of the local work unless
    # ", no jitter"; ", compute only": forward, backward and optimizer time instead of the
    # local work, no jitter. The first is the prediction, the others are shown next to it
    sim_variants: tuple[str, ...] = ("fitted",)
    sim_stragglers: bool = False  # (d) also predicted by the simulator
    straggler_rank: int = 3
    straggler_factor: float = 4.0
    straggler_bandwidth: float = 250e6
    target: float = 0.97
    tta_max_steps: int = 300
    tta_eval_every: int = 10

    def __post_init__(self) -> None:
        timed = dict(self.reps)
        for size in {*self.sizes, *self.p2p_sizes, self.mtu_compare_size}:
            if size not in timed:
                raise ValueError(f"reps gives no repetitions for {size} bytes")
        if self.steps % 8:
            raise ValueError(f"steps={self.steps} must be a multiple of 8, local SGD's period")

    def repetitions(self, size: int) -> int:
        return dict(self.reps)[size]


QUICK = Settings(mode="quick")
FULL = Settings(
    mode="full",
    sizes=(4096, 65536, MB, 10 * MB, 100 * MB, 500 * MB),
    table_sizes=(MB, 10 * MB, 100 * MB, 500 * MB),
    p2p_sizes=(MB, 10 * MB, 100 * MB),
    reps=((4096, 30), (65536, 30), (MB, 15), (10 * MB, 10), (100 * MB, 5), (500 * MB, 3)),
    mtu_compare=(1500, 65535),
    warmup=4,
    steps=40,
    sim_variants=("fitted", "fitted, no jitter", "fitted, compute only", "nominal"),
    sim_stragglers=True,
    tta_max_steps=600,
    tta_eval_every=5,
)


def _say(message: str) -> None:
    print(message, flush=True)


def _links(settings: Settings, n: int, gbits: float, mtu: int | None = None,
           slow: dict[int, float] | None = None):
    from gossamer.launch import LinkSpec

    # LinkSpec keeps bytes per second; the settings give bits per second
    links = [LinkSpec(bandwidth=gbits * 1e9 / 8, mtu=mtu or settings.mtu)] * n
    for rank, rate in (slow or {}).items():
        links[rank] = LinkSpec(bandwidth=rate / 8, mtu=mtu or settings.mtu)
    return links


def _run(links, task: dict[str, Any], timeout: float) -> tuple[list[dict], list[dict]]:
    from benchmarks.emulation import run_task

    return run_task(links, task, timeout=timeout)


# --------------------------------------------------------------------------------------------
# (a) collectives
# --------------------------------------------------------------------------------------------


def part_a(settings: Settings) -> dict[str, Any]:
    from gossamer.comm.cost import fit_ring_all_reduce

    rows, p2p, mtu_rows = [], [], []
    reps = {str(s): settings.repetitions(s) for s in settings.sizes}
    for gbits in settings.gbits:
        for n in settings.workers:
            _say(f"(a) all-reduce, {n} workers, {gbits:g} Gbit/s, mtu {settings.mtu}")
            task = {"kind": "collectives", "args": {
                "sizes": list(settings.sizes), "reps": reps,
                "p2p_sizes": list(settings.p2p_sizes)}}
            results, traffic = _run(_links(settings, n, gbits), task, timeout=900)
            for row in results[0]["rows"]:
                rows.append({"workers": n, "gbits": gbits, "mtu": settings.mtu, **row,
                             "median": statistics.median(row["times"])})
                model = all_reduce_model(n, row["bytes"], nominal_network(gbits))
                _say(f"    {row['bytes'] / MB:8.3f} MB: median {rows[-1]['median'] * 1e3:9.2f} "
                     f"ms, model {model * 1e3:9.2f} ms")
            for row in results[0]["p2p"]:
                p2p.append({"workers": n, "gbits": gbits, "mtu": settings.mtu, **row,
                            "median": statistics.median(row["times"])})
    big = settings.mtu_compare_size
    n = max(settings.workers)
    for gbits in settings.gbits:
        for mtu in settings.mtu_compare:
            _say(f"(a) all-reduce of {big / MB:g} MB, {n} workers, {gbits:g} Gbit/s, mtu {mtu}")
            task = {"kind": "collectives", "args": {
                "sizes": [big], "reps": {str(big): settings.repetitions(big)}}}
            results, _ = _run(_links(settings, n, gbits, mtu=mtu), task, timeout=900)
            row = results[0]["rows"][0]
            mtu_rows.append({"workers": n, "gbits": gbits, "mtu": mtu, **row,
                             "median": statistics.median(row["times"])})
    for r in rows:
        if r["bytes"] == big and r["workers"] == n:
            mtu_rows.append(r)
    fits = []
    for gbits in settings.gbits:
        for group in [[n] for n in settings.workers] + [list(settings.workers)]:
            samples = [(r["workers"], r["bytes"], r["median"]) for r in rows
                       if r["gbits"] == gbits and r["workers"] in group]
            # the links' rate bounds the fit: tbf's 1 ms burst lets small messages faster
            net = fit_ring_all_reduce(samples, max_bandwidth=gbits * 1e9 / 8)
            fits.append({"gbits": gbits, "workers": group, "latency": net.latency,
                         "bandwidth": net.bandwidth,
                         "efficiency": net.bandwidth * 8 / (gbits * 1e9)})
            _say(f"    fit {gbits:g} Gbit/s, workers {group}: alpha {net.latency * 1e6:.0f} us, "
                 f"1/beta {net.bandwidth * 8 / 1e9:.3f} Gbit/s")
    for r in rows:
        r["model"] = all_reduce_model(r["workers"], r["bytes"], nominal_network(r["gbits"]))
        r["fitted"] = all_reduce_model(r["workers"], r["bytes"], fitted_network(
            {"fits": fits}, r["workers"], r["gbits"]))
    for r in p2p:
        r["model"] = nominal_network(r["gbits"]).message_time(0, 1, r["bytes"])
    return {"rows": rows, "p2p": p2p, "mtu_rows": mtu_rows, "fits": fits}


# --------------------------------------------------------------------------------------------
# (b) and (d): training steps on the emulated network
# --------------------------------------------------------------------------------------------


def _algorithms() -> list[str]:
    from benchmarks.netbench_tasks import ALGORITHMS

    return list(ALGORITHMS)


def _steps_task(settings: Settings, straggler: dict[str, float] | None = None):
    return {"kind": "training_steps", "args": {
        "algorithms": list(settings.algorithms) or _algorithms(), "warmup": settings.warmup,
        "steps": settings.steps, "batch": settings.batch, "straggler": straggler,
        "compute_sleep": settings.compute_sleep}}


def summarize_steps(results: list[dict], traffic: list[dict] | None = None) -> dict[str, Any]:
    """Per algorithm: the ranks' records, the slowest rank's time per step, the summed
    throughput in steps per second, and the means of the per-rank figures."""
    out = {}
    for algorithm in results[0]["algorithms"]:
        ranks = [r["algorithms"][algorithm] for r in results]
        out[algorithm] = {
            "ranks": ranks,
            "seconds_per_step": max(r["seconds_per_step"] for r in ranks),
            "steps_per_second": sum(1 / r["seconds_per_step"] for r in ranks),
            **{key: statistics.fmean(r[key] for r in ranks)
               for key in ("compute_per_step", "local_per_step", "comm_per_step",
                           "cpu_per_step", "bytes_per_step")},
            "machine_busy": ranks[0]["machine_busy"],
        }
    return {"algorithms": out, "traffic": traffic}


def part_b(settings: Settings) -> dict[str, Any]:
    n, gbits = settings.train_workers, settings.train_gbits
    _say(f"(b) one training step of each algorithm, {n} workers, {gbits:g} Gbit/s, "
         f"mtu {settings.mtu}"
         + (f", compute: a sleep of {settings.compute_sleep * 1e3:g} ms"
            if settings.compute_sleep else ""))
    results, traffic = _run(_links(settings, n, gbits), _steps_task(settings), timeout=1800)
    summary = summarize_steps(results, traffic)
    if "allreduce" in summary["algorithms"]:  # (not among the methods asked for: no speed-up)
        base = summary["algorithms"]["allreduce"]["seconds_per_step"]
        for row in summary["algorithms"].values():
            row["speedup"] = base / row["seconds_per_step"]
    return summary


def part_d(settings: Settings) -> dict[str, Any]:
    n, gbits, slow = settings.train_workers, settings.train_gbits, settings.straggler_rank
    out = {}
    _say(f"(d) straggler: rank {slow} computes {settings.straggler_factor:g}x as long")
    results, traffic = _run(_links(settings, n, gbits),
                            _steps_task(settings, {str(slow): settings.straggler_factor}),
                            timeout=2400)
    out["compute"] = summarize_steps(results, traffic)
    _say(f"(d) straggler: rank {slow}'s link at {settings.straggler_bandwidth / 1e6:g} Mbit/s")
    results, traffic = _run(
        _links(settings, n, gbits, slow={slow: settings.straggler_bandwidth}),
        _steps_task(settings), timeout=2400)
    out["bandwidth"] = summarize_steps(results, traffic)
    return out


# --------------------------------------------------------------------------------------------
# (c) the simulator's prediction
# --------------------------------------------------------------------------------------------


def compute_model(ranks: list[dict[str, Any]], jitter: bool = True,
                  local: bool = True) -> dict[str, Any]:
    """The simulator's compute parameters from the measured ranks of one algorithm: each
    rank's mean local work per step (with ``local=False``: its forward, backward and optimizer
    step only, without jitter), and the spread of the steps' local work (the standard
    deviation of its logarithm, averaged over the ranks) as log-normal jitter. The step time
    is scaled so that each rank's expected step equals its measured mean.
    """
    import math

    means = [r["local_per_step" if local else "compute_per_step"] for r in ranks]
    sigma = 0.0
    if jitter and local:
        sigma = statistics.fmean(
            statistics.stdev(math.log(max(t, 1e-6)) for t in r["local_steps"])
            if len(r["local_steps"]) > 1 else 0.0 for r in ranks)
    mean = statistics.fmean(means)
    return {"step_time": mean / math.exp(sigma**2 / 2),
            "stragglers": {r: t / mean for r, t in enumerate(means)}, "jitter": sigma}


def traced_compute(ranks: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """The simulator's compute parameters that replay each rank's measured local work step
    by step (:class:`gossamer.comm.ComputeModel`'s ``trace``), turned so that the first step
    after ``warmup`` untimed ones takes the first timed step's time. Each step is in its parts
    between the communicator's calls where the measurement has them (``local_parts``), so
    that each part is charged where the real run did that work."""
    trace = {}
    for r, rank in enumerate(ranks):
        times = list(rank.get("local_parts") or rank["local_steps"])
        shift = -warmup % len(times)
        trace[r] = times[shift:] + times[:shift]
    return {"step_time": statistics.fmean(r["local_per_step"] for r in ranks), "trace": trace}


def _simulate_one(algorithm: str, compute: dict[str, Any], network: dict[str, Any],
                  warmup: int, steps: int, batch: int) -> list[dict[str, Any]]:
    """One algorithm in SimWorld (run in a pool process): the ranks' results."""
    import torch

    from benchmarks.netbench_tasks import training_steps
    from gossamer.comm import ComputeModel, NetworkModel, SimWorld

    torch.set_num_threads(1)
    links = {tuple(k): v for k, v in network.pop("link_bandwidth", [])}
    world = SimWorld(len(compute["stragglers"]),
                     network=NetworkModel(**network, link_bandwidth=links),
                     compute=ComputeModel(**compute), seed=0)
    return world.run(training_steps, algorithm, warmup=warmup, steps=steps, batch=batch,
                     simulated=True)


def simulate(settings: Settings, measured: dict[str, Any], network, label: str,
             jitter: bool = True, local: bool = True) -> dict[str, Any]:
    """Run every algorithm of ``measured`` (a :func:`summarize_steps` result) in SimWorld
    with ``network`` and the compute model of :func:`compute_model` (each rank's measured
    local work per step; with ``jitter``, its measured spread).

    The simulations are independent: they run in a pool of one process per core (nothing
    else runs meanwhile, and virtual time does not depend on how fast they run)."""
    import multiprocessing as mp
    import os
    from concurrent.futures import ProcessPoolExecutor

    spec = {"latency": network.latency, "bandwidth": network.bandwidth,
            "link_bandwidth": [[list(k), v] for k, v in network.link_bandwidth.items()]}
    models = {a: compute_model(row["ranks"], jitter, local)
              for a, row in measured["algorithms"].items()}
    out = {}
    with ProcessPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)),
                             mp_context=mp.get_context("spawn")) as pool:
        futures = {
            algorithm: pool.submit(_simulate_one, algorithm, models[algorithm], dict(spec),
                                   settings.warmup, settings.steps, settings.batch)
            for algorithm in measured["algorithms"]}
        for algorithm, future in futures.items():
            ranks = future.result(timeout=1800)
            row = measured["algorithms"][algorithm]
            predicted = max(r["seconds_per_step"] for r in ranks)
            out[algorithm] = {
                "seconds_per_step": predicted,
                "rank_seconds_per_step": [r["seconds_per_step"] for r in ranks],
                "steps_per_second": sum(1 / r["seconds_per_step"] for r in ranks),
                "bytes_per_step": statistics.fmean(r["bytes_per_step"] for r in ranks),
                # the part of a step that is not local work: waiting and communicating
                "waiting_per_step": statistics.fmean(
                    p["seconds_per_step"] - m["local_per_step"]
                    for p, m in zip(ranks, row["ranks"], strict=True)),
                "compute": {**models[algorithm],
                            "stragglers": list(models[algorithm]["stragglers"].values())},
                "ratio": predicted / row["seconds_per_step"],
            }
            _say(f"    {label} {algorithm:13s} predicted {predicted * 1e3:7.1f} ms, measured "
                 f"{row['seconds_per_step'] * 1e3:7.1f} ms: {out[algorithm]['ratio']:.2f}")
    base = out["allreduce"]["seconds_per_step"]
    for row in out.values():
        row["speedup"] = base / row["seconds_per_step"]
    return out


def _describe(network) -> dict[str, float]:
    return {"latency": network.latency, "bandwidth": network.bandwidth}


def part_c(settings: Settings, a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    n, gbits = settings.train_workers, settings.train_gbits
    networks = {"fitted": fitted_network(a, n, gbits), "nominal": nominal_network(gbits)}
    out = {}
    for variant in settings.sim_variants:
        net = networks[variant.split(",")[0]]
        local = "compute only" not in variant
        jitter = local and "no jitter" not in variant
        _say(f"(c) SimWorld, {variant}: alpha {net.latency * 1e6:.0f} us, 1/beta "
             f"{net.bandwidth * 8 / 1e9:.3f} Gbit/s, "
             + ("local work" if local else "forward, backward and optimizer time")
             + " of (b)" + (" with its spread" if jitter else ""))
        out[variant] = {"network": _describe(net), "jitter": jitter, "local": local,
                        "algorithms": simulate(settings, b, net, variant, jitter, local)}
    return out


def simulate_stragglers(settings: Settings, a: dict[str, Any],
                        d: dict[str, Any]) -> dict[str, Any]:
    """(d) in the simulator: the compute straggler through the measured local work, the slow
    link as that rank's link bandwidth in both directions."""
    from gossamer.comm import NetworkModel

    n, gbits, slow = settings.train_workers, settings.train_gbits, settings.straggler_rank
    fitted = fitted_network(a, n, gbits)
    scale = settings.straggler_bandwidth / (gbits * 1e9)
    links = {}
    for peer in range(n):
        if peer != slow:
            links[(slow, peer)] = links[(peer, slow)] = fitted.bandwidth * scale
    slow_net = NetworkModel(latency=fitted.latency, bandwidth=fitted.bandwidth,
                            link_bandwidth=links)
    _say("(d) SimWorld with the compute straggler")
    out = {"compute": simulate(settings, d["compute"], fitted, "compute straggler")}
    _say("(d) SimWorld with the slow link")
    out["bandwidth"] = simulate(settings, d["bandwidth"], slow_net, "slow link")
    return out


# --------------------------------------------------------------------------------------------
# (e) time to accuracy
# --------------------------------------------------------------------------------------------


def part_e(settings: Settings, data: Path) -> dict[str, Any]:
    n, gbits = settings.train_workers, settings.train_gbits
    _say(f"(e) MNIST CNN to {100 * settings.target:g}% eval accuracy, {n} workers, "
         f"{gbits:g} Gbit/s, at most {settings.tta_max_steps} steps")
    task = {"kind": "time_to_accuracy", "args": {
        "algorithms": _algorithms(), "data_path": str(data / "mnist"),
        "target": settings.target, "max_steps": settings.tta_max_steps,
        "eval_every": settings.tta_eval_every}}
    results, traffic = _run(_links(settings, n, gbits), task, timeout=3600)
    return {"algorithms": results[0]["algorithms"], "traffic": traffic}


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def check_mnist(data: Path) -> None:
    folder = data / "mnist"
    for stem in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        if not any((folder / (stem + ext)).is_file() for ext in ("", ".gz")):
            raise SystemExit(f"part e needs MNIST: {folder / stem}[.gz] is missing (give "
                             "--data DIR, the folder that holds mnist/)")


def load_part(folder: Path, part: str, mode: str, required: bool = True,
              mtu: int | None = None) -> dict[str, Any] | None:
    """Part ``part``'s saved result in ``folder`` of a run in ``mode`` with frames of ``mtu``
    bytes (default: any) (None, or ValueError if ``required``, when there is none)."""
    path = folder / f"network_{part}.json"
    saved = json.loads(path.read_text()) if path.is_file() else None
    saved_mtu = (saved or {}).get("settings", {}).get("mtu")
    if saved is None or saved.get("mode") != mode or (mtu is not None and saved_mtu != mtu):
        if required:
            frames = f" with {mtu}-byte frames" if mtu is not None else ""
            raise ValueError(f"part {part}'s results in {mode} mode{frames} ({path}) are "
                             f"needed: run part {part} too")
        return None
    return saved["result"]


def run_suite(settings: Settings, parts: list[str], data: Path, results: Results) -> int:
    """Run ``parts``, write each one's JSON, the figures and the markdown draft; the exit
    code (1 when a part failed)."""
    from benchmarks.emulation import EmulationUnavailable, WorkerFailed, require_emulation
    from gossamer.launch.netem import cleanup

    emulated = [p for p in parts if p != "c"]
    if emulated:
        try:
            require_emulation()
        except EmulationUnavailable as exc:
            _say(f"network benchmarks: cannot emulate a network here: {exc}")
            _say("they need Linux, root, iproute2 (ip, tc) and the kernel's tbf qdisc; "
                 "nothing was run")
            return 2
        removed = cleanup()
        if removed:
            _say(f"removed namespaces left by killed runs: {', '.join(removed)}")
    if "e" in parts:
        check_mnist(data)
    _say(f"network benchmarks, {settings.mode} mode, parts {' '.join(parts)}; {machine()}")
    started = time.perf_counter()
    done: dict[str, Any] = {}
    failed = []

    def saved(part: str) -> dict[str, Any] | None:  # this run's, else an earlier one's
        return done.get(part) or load_part(results.folder, part, settings.mode, mtu=settings.mtu)

    steps: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("a", lambda: part_a(settings)),
        ("b", lambda: part_b(settings)),
        ("c", lambda: part_c(settings, saved("a"), saved("b"))),
        ("d", lambda: part_d(settings)),
        ("e", lambda: part_e(settings, data)),
    ]
    for part, fn in steps:
        if part not in parts:
            continue
        t0 = time.perf_counter()
        try:
            done[part] = fn()
        except (WorkerFailed, ValueError, RuntimeError) as exc:
            _say(f"part {part} failed: {type(exc).__name__}: {exc}")
            failed.append(part)
            continue
        if part == "d" and settings.sim_stragglers:
            try:
                done[part]["simulated"] = simulate_stragglers(settings, saved("a"), done[part])
            except (ValueError, RuntimeError) as exc:
                _say(f"part d's simulation failed: {type(exc).__name__}: {exc}")
        seconds = time.perf_counter() - t0
        path = results.write(f"network_{part}", {
            "mode": settings.mode, "seconds": seconds,
            "settings": dataclasses.asdict(settings), "result": done[part]})
        _say(f"part {part} done in {seconds:.0f} s: {path}")
    total = time.perf_counter() - started
    available = {p: done[p] if p in done
                 else load_part(results.folder, p, settings.mode, False, mtu=settings.mtu)
                 for p in PARTS}
    results.figures.mkdir(parents=True, exist_ok=True)
    for path in network_report.plots(available, settings, results.figures):
        results.wrote(path)
    text = network_report.markdown(available, settings, results.command, total, machine())
    out = results.folder / "network_section.md"
    out.write_text(text)
    results.wrote(out)
    _say(f"total {total:.0f} s ({total / 60:.1f} min)")
    return 1 if failed else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="fewer sizes, steps and repetitions (under 20 minutes)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="which parts to run (default: all); c reuses a's and b's saved "
                        "results of the same mode and frame size when they are not run")
    add_mtu_argument(parser)
    add_data_argument(parser)


def add_mtu_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mtu", type=int, default=Settings.mtu,
                        help=f"bytes per frame on the emulated links (default {Settings.mtu}; "
                        "65535 stands for a NIC's segmentation offload, which the emulated "
                        "links lack: the kernel then handles 64 KiB at a time)")


def with_mtu(settings: Settings, mtu: int) -> Settings:
    """``settings`` with frames of ``mtu`` bytes (1280 to 65535: IPv6's least, veth's most)."""
    if isinstance(mtu, bool) or not isinstance(mtu, int) or not 1280 <= mtu <= 65535:
        raise ValueError(f"--mtu must be an int from 1280 to 65535 bytes, got {mtu!r}")
    return dataclasses.replace(settings, mtu=mtu)


def run(args: argparse.Namespace, results: Results) -> int:
    settings = with_mtu(QUICK if args.quick else FULL, args.mtu)
    parts = [p for p in PARTS if p in args.parts]
    try:
        return run_suite(settings, parts, args.data, results)
    except KeyboardInterrupt:
        print("interrupted; the emulated network (if any) was removed", file=sys.stderr)
        return 130
    except BaseException as exc:
        from gossamer.launch.netem import Interrupted

        if isinstance(exc, Interrupted):
            print(f"{exc} received; the emulated network was removed", file=sys.stderr)
            return exc.exit_code
        raise
