"""`gossamer plan` at scale, against the emulated network, and against published settings.

    gossamer bench plan --parts scale --workers 10000 --models gpt-1b resnet50
    gossamer bench plan --parts emulated          # needs the network suite's results (a, b)
    gossamer bench plan --parts emulated8         # 8 emulated workers at 100 Mbit/s: root
    gossamer bench plan --parts emulated emulated8 --mtu 65535   # after the suite's a, b
                                                                 # with the same --mtu
    gossamer bench plan --parts published
    gossamer bench plan --parts emulated emulated8 --mtu 65535 --compute-sleep 50
    gossamer bench plan --parts emulated8 --mtu 65535 --reuse   # predict the saved measurement
    gossamer bench plan --parts emulated8 --mtu 65535 --methods wagma "wagma tau=0" sgp

- ``scale``: real time, CPU time and peak memory of one timing-only prediction (1 warm-up and
  1 measured step of AllReduce and SGP) at each worker count and model.
- ``emulated``: the plan's timing-only prediction of part (b) of the network suite (4 gloo
  workers at 1 Gbit/s, the 5.8M-parameter MLP): each rank's measured local work replayed
  step by step as its compute, each step in its parts between the communicator's calls
  (``ComputeModel(trace=...)``), and (a)'s fitted alpha and beta.
  Beside it, the prediction with part (c)'s compute: each rank's mean local work and the
  steps' spread as log-normal jitter.
- ``emulated8``: part (b) again with 8 workers at 100 Mbit/s, measured here (Linux, root, tc),
  and its prediction with the same declared parameters (the network: the links' rate and
  (a)'s fitted latency at 4 workers and 1 Gbit/s; (a) fits no 8-worker all-reduces).
- With ``--compute-sleep MS`` each emulated worker sleeps MS milliseconds in place of its
  forward and backward passes (fixed gradients): an accelerator's compute, which leaves the
  host's cores to the messages and the methods' own work; the 4-worker part is then measured
  here too.
- ``--methods LABEL ...`` measures and predicts only those methods of the network suite's
  tables, or variants of them that it measures only when asked (``wagma tau=0``: WAGMA's
  synchronous group averaging), saved under a name of their own (e.g.
  ``plan_emulated8_wagma_wagma-tau-0_sgp.json``). Each rank's record has each timed step's
  time and the runtime's counts (waits, stale contributions).
- ``published``: the settings of the SGP paper (32 nodes on 10 Gbit/s Ethernet, ResNet-50,
  against AllReduce) and of the DGC paper (1 Gbit/s Ethernet, ResNet-50), predicted.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import resource
import time
from typing import Any

from gossamer.bench import Results

PARTS = ("scale", "emulated", "emulated8", "published")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=["published"])
    parser.add_argument("--workers", type=int, nargs="+", default=[1000, 10000],
                        help="worker counts of the scale part")
    parser.add_argument("--models", nargs="+", default=["gpt-1b", "resnet50"],
                        help="models of the scale part")
    parser.add_argument("--algorithms", nargs="+", default=["allreduce", "sgp"],
                        help="methods of the scale part")
    parser.add_argument("--methods", nargs="+", default=None, metavar="LABEL",
                        help="the emulated parts: the network suite's methods to measure and "
                        "predict, by the labels of its tables, variants too (e.g. wagma "
                        "'wagma tau=0'); default: every method of its tables. The results "
                        "are saved under a name of their own")
    parser.add_argument("--compute-sleep", type=float, default=0.0, metavar="MS",
                        help="the emulated parts: each worker sleeps MS milliseconds in place "
                        "of its forward and backward passes, as an accelerator's compute "
                        "leaves the host's cores to the communication (part b is then "
                        "measured here, 4 workers too; default 0: the MLP's real passes)")
    parser.add_argument("--reuse", action="store_true",
                        help="the parts that measure part b here: predict from the "
                        "measurement an earlier run of the same part, frames and compute "
                        "saved, instead of measuring again")
    from benchmarks.network import add_mtu_argument

    add_mtu_argument(parser)  # the emulated parts' frames


def part_scale(args: argparse.Namespace) -> list[dict[str, Any]]:
    from gossamer.comm import ComputeModel, NetworkModel
    from gossamer.plan import model_builder, predict

    rows = []
    for model in args.models:
        build, _ = model_builder(model)
        for n in args.workers:
            for algorithm in args.algorithms:
                wall, cpu = time.perf_counter(), time.process_time()
                p = predict(algorithm, n, build, network=NetworkModel(bandwidth="10gbit"),
                            compute=ComputeModel(step_time=0.25), warmup=1, steps=1)
                row = {"model": model, "workers": n, "algorithm": algorithm,
                       "step_time": p.step_time, "bytes_per_step": p.bytes_per_step,
                       "wall_seconds": time.perf_counter() - wall,
                       "cpu_seconds": time.process_time() - cpu,
                       # the peak of this process so far (the runs go from small to large)
                       "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}
                rows.append(row)
                print(f"{model} {n} workers {algorithm}: {p.step_time:.4g} s per step, "
                      f"{row['wall_seconds']:.0f} s real, {row['cpu_seconds']:.0f} s CPU, "
                      f"peak {row['peak_rss_gb']:.1f} GB", flush=True)
    return rows


def _netbench_mlp():
    from benchmarks.netbench_tasks import MLP_WIDTHS
    from gossamer.bench import mlp

    return mlp(*MLP_WIDTHS)


def predict_measured(measured: dict[str, Any], network, warmup: int, steps: int
                     ) -> dict[str, Any]:
    """The timing-only prediction of every algorithm of a network-suite part (b) result,
    with each rank's measured local work per step as its compute, replayed step by step in
    its parts between the communicator's calls (``predicted``), and, as part (c) declares it,
    each rank's mean local work with the steps' spread drawn as log-normal jitter
    (``predicted_jitter``)."""
    from benchmarks.netbench_tasks import method_spec
    from benchmarks.network import compute_model, traced_compute
    from gossamer.algorithms import create
    from gossamer.comm import ComputeModel
    from gossamer.plan import predict

    out = {}
    for label, row in measured["algorithms"].items():
        name, options = method_spec(label)
        found = {}
        for key, compute in (("predicted", traced_compute(row["ranks"], warmup)),
                             ("predicted_jitter", compute_model(row["ranks"]))):
            found[key] = predict(create(name, options), len(row["ranks"]), _netbench_mlp,
                                 network=network, compute=ComputeModel(**compute),
                                 warmup=warmup, steps=steps, label=label,
                                 lr=0.01)  # the network suite's
        p = found["predicted"]
        out[label] = {"measured": row["seconds_per_step"], "predicted": p.step_time,
                      "ratio": p.step_time / row["seconds_per_step"],
                      "predicted_jitter": found["predicted_jitter"].step_time,
                      "measured_bytes": row["bytes_per_step"],
                      "predicted_bytes": p.bytes_per_step}
        print(f"{label:13s} measured {row['seconds_per_step'] * 1e3:7.1f} ms, predicted "
              f"{p.step_time * 1e3:7.1f} ms: {out[label]['ratio']:.2f} (with jitter "
              f"{found['predicted_jitter'].step_time * 1e3:.1f} ms)", flush=True)
    for key in ("measured", "predicted"):
        base = out["allreduce"][key] if "allreduce" in out else math.nan  # (--methods)
        for row in out.values():
            row[f"{key}_speedup"] = base / row[key]
    print_table(out)
    return out


def print_table(rows: dict[str, dict[str, Any]], target: float = 0.15) -> None:
    """docs/benchmarks/planner.md's table of an emulated part: each algorithm's measured and
    predicted time per step, speed-up and bytes, and whether the prediction is within
    ``target``."""
    from gossamer.bench import markdown_table

    cells = [[label, f"{r['measured'] * 1e3:.1f}", f"{r['predicted'] * 1e3:.1f}",
              f"{r['ratio']:.2f}", "yes" if abs(r["ratio"] - 1) <= target else "no",
              *(f"{r[k]:.2f}x" if not math.isnan(r[k]) else "-"  # no AllReduce measured
                for k in ("measured_speedup", "predicted_speedup")),
              f"{r['measured_bytes'] / 1e6:.2f}", f"{r['predicted_bytes'] / 1e6:.2f}",
              f"{r['predicted_jitter'] / r['measured']:.2f}" if "predicted_jitter" in r
              else "-"]
             for label, r in rows.items()]
    header = ["algorithm", "measured ms / step", "predicted ms / step", "predicted / measured",
              f"within {target:.0%}", "emulated speed-up", "predicted speed-up",
              "MB sent / worker / step, measured", "predicted",
              "predicted / measured, mean compute with jitter"]
    missed = [label for label, r in rows.items() if abs(r["ratio"] - 1) > target]
    print("\n" + "\n".join(markdown_table(header, cells)) + "\n")
    print(f"Within {target:.0%}: {len(rows) - len(missed)} of {len(rows)}"
          + (f"; missed: {', '.join(missed)}." if missed else "."), flush=True)


def part_emulated(results: Results, mtu: int, compute_sleep: float = 0.0,
                  reuse: bool = False, methods: list[str] | None = None) -> dict[str, Any]:
    import json

    from benchmarks.network import load_part
    from benchmarks.network_model import fitted_network

    if compute_sleep:
        return _measured_here(results, mtu, compute_sleep, workers=4, gbits=1.0,
                              reuse=reuse, methods=methods)
    b = json.loads((results.folder / "network_b.json").read_text())
    settings = b["settings"]
    if settings["mtu"] != mtu:
        raise ValueError(f"the network suite's part b ran with {settings['mtu']}-byte frames, "
                         f"not --mtu {mtu}: run `gossamer bench network --quick --parts a b "
                         f"--mtu {mtu}` first")
    measured = b["result"]
    if methods:
        missing = [m for m in methods if m not in measured["algorithms"]]
        if missing:
            raise SystemExit(f"--methods: the network suite's part b measured no "
                             f"{', '.join(map(repr, missing))}: without --compute-sleep the "
                             f"4-worker part predicts part b's methods only")
        measured = {**measured, "algorithms": {m: measured["algorithms"][m] for m in methods}}
    a = load_part(results.folder, "a", b["mode"], mtu=mtu)
    network = fitted_network(a, settings["train_workers"], settings["train_gbits"])
    return {"network": {"latency": network.latency, "bandwidth": network.bandwidth},
            "mtu": mtu, "algorithms": predict_measured(measured, network, settings["warmup"],
                                           settings["steps"])}


def part_emulated8(results: Results, mtu: int, compute_sleep: float = 0.0,
                   reuse: bool = False, methods: list[str] | None = None) -> dict[str, Any]:
    return _measured_here(results, mtu, compute_sleep, workers=8, gbits=0.1, reuse=reuse,
                          methods=methods)


def result_name(part: str, compute_sleep: float, methods: list[str] | None = None) -> str:
    """The name of a part's results (``benchmarks/results/NAME.json``); ``methods``, the
    labels asked for, tag the name of an emulated part's."""
    emulated = part.startswith("emulated")
    tag = f"_sleep{compute_sleep * 1e3:g}ms" if compute_sleep and emulated else ""
    if methods and emulated:
        tag += "_" + "_".join("".join(c if c.isalnum() else "-" for c in m) for m in methods)
    return f"plan_{part}{tag}"


def _measured_here(results: Results, mtu: int, compute_sleep: float, *, workers: int,
                   gbits: float, reuse: bool = False, methods: list[str] | None = None
                   ) -> dict[str, Any]:
    """Part (b) of the network suite measured here with ``workers`` at ``gbits`` Gbit/s and
    frames of ``mtu`` bytes (the forward and backward a sleep of ``compute_sleep`` seconds
    unless 0), and its prediction: the links' rate and (a)'s fitted latency at 4 workers and
    1 Gbit/s ((a) fits no 8-worker all-reduce). ``methods``: the labels to measure (default
    every method of the suite). With ``reuse``, the measurement that an earlier run of the
    same settings saved instead of a new one."""
    import json

    from benchmarks.netbench_tasks import method_spec
    from benchmarks.network import QUICK, load_part, part_b, with_mtu
    from benchmarks.network_model import fitted_network
    from gossamer.comm import NetworkModel

    for label in methods or ():
        try:
            method_spec(label)
        except ValueError as exc:
            raise SystemExit(f"--methods: {exc}") from None
    settings = dataclasses.replace(with_mtu(QUICK, mtu), train_workers=workers,
                                   train_gbits=gbits, compute_sleep=compute_sleep,
                                   algorithms=tuple(methods or ()))
    a = load_part(results.folder, "a", settings.mode, mtu=mtu)  # before minutes of part b
    part = "emulated8" if workers == 8 else "emulated"
    saved = results.folder / f"{result_name(part, compute_sleep, methods)}.json"
    if reuse:
        earlier = json.loads(saved.read_text())["result"] if saved.is_file() else {}
        if earlier.get("mtu") != mtu or "measured" not in earlier:
            raise SystemExit(f"--reuse: {saved} holds no measurement of {workers} workers "
                             f"with {mtu}-byte frames: run without --reuse")
        measured = earlier["measured"]
        print(f"{part}: the measurement saved in {saved}", flush=True)
    else:
        measured = part_b(settings)
    latency = fitted_network(a, 4, 1.0).latency
    network = NetworkModel(latency=latency, bandwidth=gbits * 1e9 / 8)
    return {"network": {"latency": latency, "bandwidth": network.bandwidth}, "mtu": mtu,
            "compute_sleep": compute_sleep, "measured": measured,
            "algorithms": predict_measured(measured, network, settings.warmup, settings.steps)}


def part_published() -> dict[str, Any]:
    from gossamer.comm import ComputeModel, NetworkModel
    from gossamer.plan import predict, resnet50

    out: dict[str, Any] = {"sgp": [], "dgc": []}
    # SGP (Assran et al., ICML 2019): 32 nodes of 8 GPUs, 10 Gbit/s Ethernet, ResNet-50; a
    # simulated worker is a node (its GPUs all-reduce inside it over NVLink, left out here)
    for compute in (0.1, 0.25, 0.5):
        for method in ("allreduce", "sgp", "osgp"):
            p = predict(method, 32, resnet50, network=NetworkModel(bandwidth="10gbit"),
                        compute=ComputeModel(step_time=compute), warmup=2, steps=3)
            out["sgp"].append({"compute": compute, "method": method, "step_time": p.step_time,
                               "idle": p.idle_fraction, "bytes": p.bytes_per_step})
            print(f"SGP setting, compute {compute} s, {method}: {p.step_time:.3f} s per step",
                  flush=True)
    # DGC (Lin et al., ICLR 2018): ResNet-50 on 1 Gbit/s Ethernet, density 0.1%
    for n in (4, 16, 64):
        for method in ("allreduce", "dgc"):
            p = predict(method, n, resnet50, network=NetworkModel(bandwidth="1gbit"),
                        compute=ComputeModel(step_time=0.25), warmup=1, steps=2)
            out["dgc"].append({"workers": n, "method": method, "step_time": p.step_time,
                               "idle": p.idle_fraction, "bytes": p.bytes_per_step})
            print(f"DGC setting, {n} workers, {method}: {p.step_time:.3f} s per step, "
                  f"{p.bytes_per_step / 1e6:.2f} MB", flush=True)
    return out


def run(args: argparse.Namespace, results: Results) -> int:
    if not args.compute_sleep >= 0:
        raise SystemExit(f"--compute-sleep must be >= 0 ms, got {args.compute_sleep}")
    sleep = args.compute_sleep / 1e3
    for part in args.parts:
        if part == "scale":
            data: Any = part_scale(args)
        elif part == "emulated":
            data = part_emulated(results, args.mtu, sleep, args.reuse, args.methods)
        elif part == "emulated8":
            data = part_emulated8(results, args.mtu, sleep, args.reuse, args.methods)
        else:
            data = part_published()
        results.write(result_name(part, sleep, args.methods), {"part": part, "result": data})
    return 0
