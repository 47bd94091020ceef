"""`gossamer plan` at scale, against the emulated network, and against published settings.

    gossamer bench plan --parts scale --workers 10000 --models gpt-1b resnet50
    gossamer bench plan --parts emulated          # needs the network suite's results (a, b)
    gossamer bench plan --parts emulated8         # 8 emulated workers at 100 Mbit/s: root
    gossamer bench plan --parts emulated emulated8 --mtu 65535   # after the suite's a, b
                                                                 # with the same --mtu
    gossamer bench plan --parts published

- ``scale``: real time, CPU time and peak memory of one timing-only prediction (1 warm-up and
  1 measured step of AllReduce and SGP) at each worker count and model.
- ``emulated``: the plan's timing-only prediction of part (b) of the network suite (4 gloo
  workers at 1 Gbit/s, the 5.8M-parameter MLP), with part (c)'s declared parameters: each
  rank's measured local work as compute, with its spread, and (a)'s fitted alpha and beta.
- ``emulated8``: part (b) again with 8 workers at 100 Mbit/s, measured here (Linux, root, tc),
  and its prediction with the same declared parameters (the network: the links' rate and
  (a)'s fitted latency at 4 workers and 1 Gbit/s; (a) fits no 8-worker all-reduces).
- ``published``: the settings of the SGP paper (32 nodes on 10 Gbit/s Ethernet, ResNet-50,
  against AllReduce) and of the DGC paper (1 Gbit/s Ethernet, ResNet-50), predicted.
"""

from __future__ import annotations

import argparse
import dataclasses
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
    with part (c)'s declared compute (each rank's measured local work and its spread)."""
    from benchmarks.netbench_tasks import ALGORITHMS
    from benchmarks.network import compute_model
    from gossamer.algorithms import create
    from gossamer.comm import ComputeModel
    from gossamer.plan import predict

    out = {}
    for label, row in measured["algorithms"].items():
        name, options = ALGORITHMS[label]
        compute = ComputeModel(**compute_model(row["ranks"]))
        p = predict(create(name, options), len(row["ranks"]), _netbench_mlp, network=network,
                    compute=compute, warmup=warmup, steps=steps, label=label,
                    lr=0.01)  # the network suite's
        out[label] = {"measured": row["seconds_per_step"], "predicted": p.step_time,
                      "ratio": p.step_time / row["seconds_per_step"],
                      "measured_bytes": row["bytes_per_step"],
                      "predicted_bytes": p.bytes_per_step}
        print(f"{label:13s} measured {row['seconds_per_step'] * 1e3:7.1f} ms, predicted "
              f"{p.step_time * 1e3:7.1f} ms: {out[label]['ratio']:.2f}", flush=True)
    for key in ("measured", "predicted"):
        base = out["allreduce"][key]
        for row in out.values():
            row[f"{key}_speedup"] = base / row[key]
    return out


def part_emulated(results: Results, mtu: int) -> dict[str, Any]:
    import json

    from benchmarks.network import load_part
    from benchmarks.network_model import fitted_network

    b = json.loads((results.folder / "network_b.json").read_text())
    settings = b["settings"]
    if settings["mtu"] != mtu:
        raise ValueError(f"the network suite's part b ran with {settings['mtu']}-byte frames, "
                         f"not --mtu {mtu}: run `gossamer bench network --quick --parts a b "
                         f"--mtu {mtu}` first")
    a = load_part(results.folder, "a", b["mode"], mtu=mtu)
    network = fitted_network(a, settings["train_workers"], settings["train_gbits"])
    return {"network": {"latency": network.latency, "bandwidth": network.bandwidth},
            "mtu": mtu, "algorithms": predict_measured(b["result"], network, settings["warmup"],
                                           settings["steps"])}


def part_emulated8(results: Results, mtu: int) -> dict[str, Any]:
    from benchmarks.network import QUICK, load_part, part_b, with_mtu
    from benchmarks.network_model import fitted_network
    from gossamer.comm import NetworkModel

    settings = dataclasses.replace(with_mtu(QUICK, mtu), train_workers=8, train_gbits=0.1)
    a = load_part(results.folder, "a", settings.mode, mtu=mtu)  # before minutes of part b
    measured = part_b(settings)
    latency = fitted_network(a, 4, 1.0).latency
    network = NetworkModel(latency=latency, bandwidth=0.1e9 / 8)
    return {"network": {"latency": latency, "bandwidth": network.bandwidth}, "mtu": mtu,
            "measured": measured,
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
    for part in args.parts:
        if part == "scale":
            data: Any = part_scale(args)
        elif part == "emulated":
            data = part_emulated(results, args.mtu)
        elif part == "emulated8":
            data = part_emulated8(results, args.mtu)
        else:
            data = part_published()
        results.write(f"plan_{part}", {"part": part, "result": data})
    return 0
