"""The decision table: which method, on which network, how much faster, at what measured cost.

    gossamer bench decision --update-docs     # the table, written into BENCHMARKS.md
    gossamer bench decision --models resnet50 --bandwidths 1gbit --workers 32   # one row
    gossamer bench decision --workers 8 --bandwidths 1gbit --methods allreduce osgp localsgd

For each model class, link bandwidth and worker count, every method's time per step is
predicted by the planner (:func:`gossamer.plan.predict`, the timing-only simulator: the real
runtimes on a model of shapes only; docs/plan.md), and its speed-up per step over AllReduce
computed. The recommended methods of a cell are the fastest (``--top``, one setting per
method, each at least ``--min-speed-up``) among those whose cost measured on the class's proxy
task is within bounds: for the CNN class the MNIST CNN's accuracy (``--max-accuracy-drop``
points below AllReduce), for the transformer class the character transformer's validation loss
(``--max-loss-rise`` nats above AllReduce's). The costs are figures measured at equal steps on
8 simulated workers and copied here from the pages under docs/benchmarks/ (:data:`METHODS`,
each with its source); a method not measured on a proxy task is never recommended for its
class. The per-step speed-up is not a speed-up to a target accuracy: that also counts the steps
each method needs (docs/benchmarks/network.md, "Per-step speed-up against time to accuracy").

Compute per step (``--compute-time``; the planner's forward, backward and optimizer time):
0.25 s for ResNet-50 (a batch of 256 images on one data-centre GPU of the V100 class in mixed
precision; the planner's default); 1.0 s for the 1B-parameter transformer (16,384 tokens a
step, 6 x 1e9 x 16,384 = 9.8e13 floating-point operations, at about 100 TFLOP/s, 30-40% of an
A100's bf16 peak). Links: 50 us of latency, one NIC per worker, the rate given.

Writes ``decision.json`` (every prediction, the costs and each cell's recommendation; rewritten
after every prediction, so that a stopped run keeps what it found and ``--reuse`` goes on from
it) and ``decision.md`` (the summary tables of BENCHMARKS.md, the cost table, and the full
tables of docs/benchmarks/decision.md); with ``--update-docs`` it also rewrites those blocks
of the two pages (between ``<!-- decision:NAME -->`` and ``<!-- /decision:NAME -->``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT
from gossamer.bench import Results, markdown_table


@dataclass(frozen=True)
class Method:
    """One setting of a method: what the planner times, what to run, and its measured costs."""

    label: str  # as the tables write it
    plan: str  # the `gossamer plan --algorithms` entry that times it (its steady state)
    use: str  # the setting the costs were measured with, as a compare/--algorithm entry
    cnn: float | None  # MNIST CNN eval accuracy minus AllReduce's, points (None: not measured)
    cnn_source: str | None  # key of SOURCES
    text: float | None  # character transformer validation loss minus AllReduce's, nats
    text_source: str | None  # key of SOURCES
    note: str = ""  # what the figures assume
    #: False: shown, never recommended (its cost depends on the link, not only on the steps)
    recommendable: bool = True
    family: str = ""  # one recommended setting per family (default: the planner entry's name)

    def kin(self) -> str:
        return self.family or self.plan.split(":")[0]


#: where each measured cost comes from (the page under docs/benchmarks/, its section)
SOURCES = {
    "defaults": ("accuracy.md#every-method-with-its-defaults-digits-and-the-mnist-cnn",
                 "MNIST CNN, 8 workers, 300 steps, one seed, every method with its defaults"),
    "local-cnn": ("local-methods.md#mnist-cnn-eval-accuracy-mean-of-3-seeds-min-max",
                  "MNIST CNN, 8 workers, mean of 3 seeds"),
    "compress-cnn": ("compression.md#accuracy-mnist-cnn-8-simulated-workers",
                     "MNIST CNN, 8 workers, one seed"),
    "gossipgrad": ("gossip.md#mnist-cnn-8-and-16-simulated-workers",
                   "MNIST CNN, 8 workers, one seed"),
    "local-text": ("local-methods.md#character-transformer-validation-loss-mean-of-2-seeds-min-max",
                   "character transformer, 8 workers, 400 steps, mean of 2 seeds"),
    "outer": ("local-methods.md"
              "#the-outer-optimizer-family-on-the-character-transformer-8-simulated-workers",
              "character transformer, 8 workers, 400 steps, mean of 2 seeds"),
}

# Where one setting was measured in several runs, the worse figure is the one kept.
METHODS = [
    Method("AllReduce", "allreduce", "allreduce", 0.0, "defaults", 0.0, "outer"),
    Method("fp16", "fp16", "fp16", 0.0, "defaults", None, None),
    Method("QSGD 8 bits", "qsgd", "qsgd", -0.05, "defaults", None, None),
    Method("SGP", "sgp", "sgp", -0.10, "defaults", None, None),
    Method("Overlap SGP", "osgp", "osgp", -0.15, "defaults", None, None),
    Method("D-PSGD", "dpsgd", "dpsgd", -0.10, "defaults", None, None),
    Method("AD-PSGD", "adpsgd", "adpsgd", -0.25, "defaults", None, None,
           "never recommended: it never waits, so its step is the compute's, and the slower the "
           "link the fewer averages it completes a step; its cost at equal steps was measured "
           "where they were frequent", recommendable=False),
    Method("WAGMA", "wagma", "wagma", -0.15, "defaults", None, None),
    Method("local SGD H=2", "localsgd:period=2", "localsgd:period=2", +0.18, "local-cnn",
           +0.060, "local-text", "the transformer run: the old round rule"),
    Method("local SGD H=4", "localsgd", "localsgd", -0.35, "defaults", +0.106, "local-text",
           "CNN: -0.15 as the mean of 3 seeds; the transformer run: the old round rule"),
    Method("local SGD H=8", "localsgd:period=8", "localsgd:period=8", -0.10, "local-cnn",
           +0.105, "local-text", "the transformer run: the old round rule"),
    Method("Local AdamW H=16", "localsgd:period=16", "localsgd:period=16:warmup_steps=30",
           None, None, +0.136, "outer"),
    Method("QSR H_base=2", "qsr", "qsr (CNN); qsr:alpha=0.0045:warmup_steps=30 (transformer)",
           -0.35, "defaults", +0.080, "local-text",
           "timed at H=2: QSR's period grows as the learning rate decays, so its speed-up is "
           "at least this; the transformer run: alpha 0.0045, the old round rule",
           family="localsgd"),
    Method("DiLoCo", "diloco", "diloco (CNN); diloco:warmup_steps=30 (transformer)", -0.25,
           "defaults", +0.139, "outer",
           "the paper's outer step (lr 0.7, momentum 0.9); timed without the warm-up"),
    Method("DiLoCo, tuned outer step", "diloco:period=16:outer_lr=1.0:outer_momentum=0.5",
           "diloco:period=16:outer_lr=1.0:outer_momentum=0.5:warmup_steps=30", None, None,
           +0.095, "outer", "recipes/shakespeare-char-diloco.yaml; timed without the warm-up"),
    Method("Streaming DiLoCo", "streaming-diloco",
           "streaming-diloco (CNN); streaming-diloco:warmup_steps=30 (transformer)", -0.20,
           "defaults", +0.110, "outer", "timed without the warm-up"),
    Method("SPARTA", "sparta", "sparta", -1.20, "defaults", +0.227, "outer"),
    Method("DeMo, lr 0.002", "demo", "demo, --lr 0.002 (CNN); demo (transformer)", +0.35,
           "defaults", +0.146, "outer",
           "needs a sign step's learning rate: -86.85 at the CNN's lr 0.05"),
    Method("DGC, no warm-up", "dgc", "dgc:warmup_steps=0", -1.45, "defaults", None, None,
           "measured as dgc's default before the default warmed the density up"),
    Method("DGC, 4-epoch warm-up", "dgc", "dgc:warmup_steps=125", -0.50, "compress-cnn", None,
           None, "timed at its final density 0.001, after the warm-up"),
    Method("top-k 1%", "topk", "topk", -0.40, "defaults", None, None),
    Method("PowerSGD rank 2", "powersgd", "powersgd", -0.85, "compress-cnn", None, None,
           "-0.50 in the defaults table"),
    Method("random-k", "randomk", "randomk", -87.00, "defaults", None, None),
    Method("GossipGraD", "gossipgrad", "gossipgrad", -2.55, "defaults", None, None),
    Method("GossipGraD, average every 10", "gossipgrad:allreduce_every=10",
           "gossipgrad:allreduce_every=10", -0.10, "gossipgrad", None, None),
]


@dataclass(frozen=True)
class ModelClass:
    """A model the planner builds, its compute per step, and the proxy task of its costs."""

    title: str
    compute_time: float  # seconds of forward, backward and optimizer per step
    proxy: str  # "cnn" or "text": which Method cost applies


MODELS = {
    "resnet50": ModelClass("ResNet-50-sized CNN (25.6M parameters)", 0.25, "cnn"),
    "gpt-1b": ModelClass("1B-parameter transformer", 1.0, "text"),
}
BANDWIDTHS = ["100mbit", "1gbit", "10gbit", "100gbit"]
WORKERS = [8, 32, 128, 1024]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--bandwidths", nargs="+", default=BANDWIDTHS,
                        help="link rates, e.g. 100mbit 1gbit (default: 100mbit to 100gbit)")
    parser.add_argument("--workers", type=int, nargs="+", default=WORKERS,
                        help="worker counts (default: 8 32 128 1024)")
    parser.add_argument("--methods", nargs="+", default=None, metavar="ENTRY",
                        help="planner entries to time (default: every setting of METHODS); "
                        "AllReduce is always timed")
    parser.add_argument("--compute-time", nargs="+", default=[], metavar="MODEL=SECONDS",
                        help="compute per step (default: resnet50=0.25 gpt-1b=1.0)")
    parser.add_argument("--latency", type=float, default=50e-6,
                        help="seconds per message (default 50e-6)")
    parser.add_argument("--max-accuracy-drop", type=float, default=0.5,
                        help="CNN class: the most MNIST CNN accuracy points below AllReduce a "
                        "recommended method may lose (default 0.5)")
    parser.add_argument("--max-loss-rise", type=float, default=0.10,
                        help="transformer class: the most validation loss, in nats, above "
                        "AllReduce's (default 0.10)")
    parser.add_argument("--min-speed-up", type=float, default=1.1,
                        help="a recommended method is at least this much faster per step "
                        "(default 1.1)")
    parser.add_argument("--top", type=int, default=3, help="methods per cell (default 3)")
    parser.add_argument("--every-worker-up-to", type=int, default=None, metavar="N",
                        help="a method the planner simulates worker by worker (not symmetric: "
                        "AD-PSGD) is left out above N workers (default: none; the published "
                        "tables were made with 32, when WAGMA and AD-PSGD took minutes to "
                        "hours above it)")
    parser.add_argument("--reuse", action="store_true",
                        help="keep the predictions of an earlier decision.json of the same "
                        "settings, and time only the missing ones")
    parser.add_argument("--name", default="decision", help="results file stem")
    parser.add_argument("--update-docs", action="store_true",
                        help="also rewrite the decision blocks of BENCHMARKS.md and "
                        "docs/benchmarks/decision.md with the tables")


def _compute_times(entries: list[str]) -> dict[str, float]:
    times = {name: model.compute_time for name, model in MODELS.items()}
    for entry in entries:
        name, sep, seconds = entry.partition("=")
        if not sep or name not in MODELS:
            raise ValueError(f"--compute-time expects MODEL=SECONDS with MODEL one of "
                             f"{', '.join(MODELS)}, got {entry!r}")
        times[name] = float(seconds)
    return times


def _gbit(bandwidth: str) -> str:
    """``"100mbit"`` -> ``"100 Mbit/s"``, from the rate the network model reads."""
    from gossamer.comm import NetworkModel

    bits = NetworkModel(bandwidth=bandwidth).bandwidth * 8
    return f"{bits / 1e9:g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:g} Mbit/s"


def cost(method: Method, proxy: str) -> float | None:
    """The method's measured cost on the proxy task: accuracy points (cnn) or nats (text)."""
    return method.cnn if proxy == "cnn" else method.text


def acceptable(method: Method, proxy: str, args: argparse.Namespace) -> bool:
    """Whether the measured cost is within the bound of the class (unmeasured: no)."""
    c = cost(method, proxy)
    if c is None:
        return False
    return c >= -args.max_accuracy_drop if proxy == "cnn" else c <= args.max_loss_rise


def recommend(speed_ups: dict[str, float], proxy: str, args: argparse.Namespace
              ) -> list[tuple[Method, float]]:
    """The fastest acceptable settings, one per method (its first name), at most ``--top``,
    each at least ``--min-speed-up`` faster than AllReduce; ``speed_ups`` by planner entry."""
    ranked = sorted(((m, speed_ups[m.plan]) for m in METHODS
                     if m.plan in speed_ups and m.plan != "allreduce" and m.recommendable
                     and acceptable(m, proxy, args)),
                    key=lambda pair: -pair[1])
    chosen: list[tuple[Method, float]] = []
    for method, speed_up in ranked:
        if speed_up < args.min_speed_up or any(c.kin() == method.kin() for c, _ in chosen):
            continue
        chosen.append((method, speed_up))
        if len(chosen) == args.top:
            break
    return chosen


def _predict(entry: str, model: str, bandwidth: str, workers: int, compute_time: float,
             latency: float, every_up_to: int | None) -> dict[str, Any]:
    from gossamer.comm import ComputeModel, NetworkModel
    from gossamer.plan import model_builder, predict
    from gossamer.train.compare import parse_algorithms

    ((label, algorithm),) = parse_algorithms(entry)
    if every_up_to is not None and workers > every_up_to \
            and not algorithm.resolve(workers).symmetric():
        raise ValueError(f"simulated worker by worker, not predicted above {every_up_to} "
                         "workers (docs/plan.md, Scale)")
    build, _ = model_builder(model)
    found = predict(algorithm, workers, build, label=label,
                    network=NetworkModel(latency=latency, bandwidth=bandwidth),
                    compute=ComputeModel(step_time=compute_time))
    return found.as_dict()


def _key(row: dict[str, Any]) -> tuple:
    return (row["model"], row["bandwidth"], row["workers"], row["entry"])


def run(args: argparse.Namespace, results: Results) -> int:
    compute = _compute_times(args.compute_time)
    entries = list(dict.fromkeys(["allreduce", *(args.methods or [m.plan for m in METHODS])]))
    unknown = [e for e in entries if e not in {m.plan for m in METHODS}]
    if unknown:
        print(f"decision: no measured cost for {', '.join(unknown)}: timed, never recommended",
              file=sys.stderr)
    settings = {"models": args.models, "bandwidths": args.bandwidths, "workers": args.workers,
                "compute_time": {m: compute[m] for m in args.models}, "latency": args.latency,
                "max_accuracy_drop": args.max_accuracy_drop,
                "max_loss_rise": args.max_loss_rise, "min_speed_up": args.min_speed_up,
                "top": args.top}
    path = results.folder / f"{args.name}.json"
    done: dict[tuple, dict[str, Any]] = {}
    if args.reuse and path.is_file():
        old = json.loads(path.read_text())
        for row in old.get("predictions", []):
            if "error" not in row and row.get("compute_time") == compute.get(row["model"]) \
                    and row.get("latency") == args.latency:  # failures are tried again
                done[_key(row)] = row
    predictions: list[dict[str, Any]] = []
    started = time.perf_counter()

    def save() -> None:
        results.folder.mkdir(parents=True, exist_ok=True)
        data = {"settings": settings, "sources": SOURCES,
                "methods": [asdict(m) for m in METHODS], "predictions": predictions,
                "cells": cells(predictions, args), "real_seconds": time.perf_counter() - started}
        path.write_text(json.dumps({"machine": _machine(), "command": results.command, **data},
                                   indent=1))

    for model in args.models:
        for bandwidth in args.bandwidths:
            for n in args.workers:
                for entry in entries:
                    key = (model, bandwidth, n, entry)
                    if key in done:
                        predictions.append(done[key])
                        continue
                    row = {"model": model, "bandwidth": bandwidth, "workers": n, "entry": entry,
                           "compute_time": compute[model], "latency": args.latency}
                    try:
                        row.update(_predict(entry, model, bandwidth, n, compute[model],
                                            args.latency, args.every_worker_up_to))
                        print(f"  {model}, {bandwidth}, {n} workers, {entry}: "
                              f"{row['step_time']:.4g} s per step "
                              f"({row['real_seconds']:.1f} s to simulate)", file=sys.stderr,
                              flush=True)
                    except Exception as error:  # one method that cannot run: left out, said
                        lines = str(error).splitlines() or [""]
                        said = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
                        row["error"] = f"{type(error).__name__}: {said}"
                        print(f"  {model}, {bandwidth}, {n} workers, {entry}: left out "
                              f"({row['error']})", file=sys.stderr, flush=True)
                    predictions.append(row)
                    save()
    save()
    results.wrote(path)
    blocks = parts(predictions, args, compute, results.command)
    out = results.folder / f"{args.name}.md"
    out.write_text("\n".join(["# BENCHMARKS.md", "", *blocks["summary"],
                              "# docs/benchmarks/decision.md: the costs", "", *blocks["costs"],
                              "# docs/benchmarks/decision.md: every method", "",
                              *blocks["full"]]))
    results.wrote(out)
    if args.update_docs:
        for path in update_docs(ROOT, blocks):
            results.wrote(path)
    return 0


def _machine() -> str:
    from gossamer.bench.results import machine

    return machine()


def speed_ups(predictions: list[dict[str, Any]]) -> dict[tuple, dict[str, float]]:
    """(model, bandwidth, workers) -> {planner entry: speed-up per step over AllReduce}."""
    base = {(r["model"], r["bandwidth"], r["workers"]): r["step_time"] for r in predictions
            if r["entry"] == "allreduce" and "step_time" in r}
    out: dict[tuple, dict[str, float]] = {}
    for r in predictions:
        cell = (r["model"], r["bandwidth"], r["workers"])
        if cell in base and r.get("step_time"):
            out.setdefault(cell, {})[r["entry"]] = base[cell] / r["step_time"]
    return out


def cells(predictions: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each (model, bandwidth, workers) with AllReduce's step and the recommended settings."""
    base = {(r["model"], r["bandwidth"], r["workers"]): r for r in predictions
            if r["entry"] == "allreduce" and "step_time" in r}
    out = []
    for cell, found in speed_ups(predictions).items():
        proxy = MODELS[cell[0]].proxy
        chosen = recommend(found, proxy, args)
        out.append({"model": cell[0], "bandwidth": cell[1], "workers": cell[2],
                    "allreduce_step_time": base[cell]["step_time"],
                    "allreduce_idle": base[cell]["idle_fraction"],
                    "recommended": [{"method": m.label, "use": m.use, "speed_up": s,
                                     "cost": cost(m, proxy)} for m, s in chosen]})
    return out


def _recommended_text(found: dict[str, float], proxy: str, args: argparse.Namespace) -> str:
    chosen = recommend(found, proxy, args)
    if not chosen:
        return f"AllReduce (nothing acceptable {args.min_speed_up:g}x faster)"
    unit = "pt" if proxy == "cnn" else "nats"
    return ", ".join(f"{m.label} **{s:.1f}x** ({cost(m, proxy):+.{2 if proxy == 'cnn' else 3}f}"
                     f" {unit})" for m, s in chosen)


def _cost_cell(value: float | None, source: str | None, spec: str) -> str:
    """A cost with a link to where it was measured (pages under docs/benchmarks/)."""
    if value is None or source is None:
        return "not measured"
    return f"[{value:{spec}}]({SOURCES[source][0]})"


def _cost_text(method: Method, proxy: str, args: argparse.Namespace) -> str:
    """The cost as the full tables write it: its value, and whether it is within bounds."""
    c = cost(method, proxy)
    if c is None:
        return "not measured"
    value = f"{c:+.2f} points" if proxy == "cnn" else f"{c:+.3f} nats"
    if not acceptable(method, proxy, args):
        return f"{value}, over the bound"
    return value if method.recommendable else f"{value}, not recommended (see its note)"


def parts(predictions: list[dict[str, Any]], args: argparse.Namespace,
          compute: dict[str, float], command: str) -> dict[str, list[str]]:
    """The markdown blocks: ``summary`` (BENCHMARKS.md's decision table), ``costs`` and
    ``full`` (docs/benchmarks/decision.md: the measured costs, every method's speed-up)."""
    found = speed_ups(predictions)
    base = {(r["model"], r["bandwidth"], r["workers"]): r for r in predictions
            if r["entry"] == "allreduce" and "step_time" in r}
    summary = [f"Made by `{command}` (costs within {args.max_accuracy_drop:g} points or "
               f"{args.max_loss_rise:g} nats, at least {args.min_speed_up:g}x, {args.top} "
               "methods at most).", ""]
    for model in args.models:
        m = MODELS[model]
        summary += [f"**{m.title}**, {compute[model]:g} s of compute per step; cost: "
                    + ("MNIST CNN accuracy, points" if m.proxy == "cnn" else
                       "character transformer validation loss, nats"), ""]
        # one row per link, one column per worker count: the table fits a screen
        rows = []
        for bandwidth in args.bandwidths:
            row = [_gbit(bandwidth)]
            for n in args.workers:
                cell = (model, bandwidth, n)
                if cell not in found:
                    row.append("-")
                    continue
                row.append(f"AllReduce {base[cell]['step_time']:.3g} s "
                           f"({100 * base[cell]['idle_fraction']:.0f}% idle): "
                           + _recommended_text(found[cell], m.proxy, args))
            rows.append(row)
        summary += markdown_table(["link", *(f"{n:,} workers" for n in args.workers)],
                                  rows)
        summary += ["", f"A cell again: `gossamer bench decision --models {model} "
                    "--bandwidths LINK --workers N`.", ""]
    rows = []
    for method in METHODS:
        rows.append([method.label, _cost_cell(method.cnn, method.cnn_source, "+.2f"),
                     _cost_cell(method.text, method.text_source, "+.3f"), f"`{method.use}`",
                     method.note])
    costs = markdown_table(["method", "MNIST CNN, points", "character transformer, nats",
                            "setting measured", "note"], rows) + [""]
    full = [f"Made by `{command}`. Each cell: the speed-up per step over AllReduce "
            "(the predicted seconds per step).", ""]
    for model in args.models:
        m = MODELS[model]
        for bandwidth in args.bandwidths:
            by_entry = {(r["workers"], r["entry"]): r for r in predictions
                        if r["model"] == model and r["bandwidth"] == bandwidth}
            rows = []
            for method in METHODS:
                cells_ = []
                for n in args.workers:
                    r = by_entry.get((n, method.plan))
                    s = found.get((model, bandwidth, n), {}).get(method.plan)
                    if r is None:
                        cells_.append("")
                    elif "error" in r:
                        cells_.append("left out")
                    else:
                        cells_.append(f"{s:.2f}x ({r['step_time']:.3g} s)" if s else
                                      f"({r['step_time']:.3g} s)")
                if any(cells_):
                    rows.append([method.label, _cost_text(method, m.proxy, args), *cells_])
            if rows:
                full += [f"### {m.title}, {_gbit(bandwidth)}", ""]
                full += markdown_table(["method", "cost", *(f"{n:,} workers"
                                                            for n in args.workers)], rows)
                full += [""]
    errors = [f"{r['entry']} ({r['model']}, {_gbit(r['bandwidth'])}, {r['workers']:,} workers): "
              f"{r['error']}" for r in predictions if "error" in r]
    if errors:
        full += ["Left out:", "", *(f"- {e}" for e in errors), ""]
    return {"summary": summary, "costs": costs, "full": full}


#: the pages whose blocks ``--update-docs`` rewrites, and the blocks of each
PAGES = {"BENCHMARKS.md": ["summary"], "docs/benchmarks/decision.md": ["costs", "full"]}


def update_docs(root: Path, blocks: dict[str, list[str]]) -> list[Path]:
    """Rewrite each block between ``<!-- decision:NAME -->`` and ``<!-- /decision:NAME -->``
    of :data:`PAGES` under ``root``; the pages written. ValueError naming a missing block."""
    written = []
    for page, names in PAGES.items():
        path = root / page
        text = path.read_text()
        for name in names:
            begin, end = f"<!-- decision:{name} -->", f"<!-- /decision:{name} -->"
            i, j = text.find(begin), text.find(end)
            if i < 0 or j < i:
                raise ValueError(f"{page} has no {begin} ... {end} block to update")
            body = "\n".join(blocks[name]).strip()
            text = text[:i + len(begin)] + "\n\n" + body + "\n\n" + text[j:]
        path.write_text(text)
        written.append(path)
    return written
