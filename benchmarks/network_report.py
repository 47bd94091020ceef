"""Figures and the markdown draft of the network benchmarks (:mod:`benchmarks.network`).

Both read the parts' results as :func:`benchmarks.network.run_suite` keeps them (a part that
was not run and has no saved result in the same mode is None and is left out).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.netbench_tasks import ALGORITHMS
from benchmarks.network_model import all_reduce_model, nominal_network
from gossamer.bench import new_figure

MB = 10**6
DEFAULT_MTU = 9000  # bytes per frame on the suite's links unless --mtu says otherwise
SIM_TARGET = 0.15  # (c): predicted time per step within 15% of the measured
SPEEDUP_FLAG = 0.20  # emulated and predicted speed-ups that differ by more are flagged


def _options(algorithm: str) -> str:
    name, options = ALGORITHMS[algorithm]
    text = ":".join([name] + [f"{k}={v}" for k, v in options.items()])
    return f"`{text}`"


def _size(nbytes: int) -> str:
    if nbytes >= MB:
        return f"{nbytes / MB:g} MB"
    return f"{nbytes / 1024:g} KiB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}" if seconds < 10 else f"{seconds * 1e3:.0f}"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


# --------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------


def plots(parts: dict[str, Any], settings, folder: Path) -> list[Path]:
    """Write the figures of the parts that are there; their paths. Frames other than the
    suite's default size name their figures apart (``network_steps_mtu65535.png``)."""
    tail = "" if settings.mtu == DEFAULT_MTU else f"_mtu{settings.mtu}"
    out = []
    if parts.get("a"):
        out.append(_plot_collectives(parts["a"], folder / f"network_collectives{tail}.png"))
    if parts.get("b"):
        out.append(_plot_steps(parts["b"], parts.get("c"), folder / f"network_steps{tail}.png"))
    if parts.get("b") and parts.get("d"):
        out.append(_plot_stragglers(parts["b"], parts["d"], settings,
                                    folder / f"network_stragglers{tail}.png"))
    if parts.get("e"):
        out.append(_plot_accuracy(parts["e"], settings,
                                  folder / f"network_accuracy{tail}.png"))
    return out


def _plot_collectives(a: dict[str, Any], path: Path) -> Path:
    gbits = sorted({r["gbits"] for r in a["rows"]})
    fig = new_figure(5.0 * len(gbits), 4.2)
    for i, g in enumerate(gbits):
        ax = fig.add_subplot(1, len(gbits), i + 1)
        for n in sorted({r["workers"] for r in a["rows"]}):
            rows = sorted((r for r in a["rows"] if r["gbits"] == g and r["workers"] == n),
                          key=lambda r: r["bytes"])
            sizes = [r["bytes"] for r in rows]
            line = ax.plot(sizes, [r["median"] for r in rows], "o", label=f"{n} workers, "
                           "measured")[0]
            ax.plot(sizes, [r["model"] for r in rows], "-", color=line.get_color(),
                    label=f"{n} workers, model ({g:g} Gbit/s)")
            ax.plot(sizes, [r["fitted"] for r in rows], ":", color=line.get_color(),
                    label=f"{n} workers, fitted alpha-beta")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("all-reduce size (bytes)")
        ax.set_ylabel("seconds")
        ax.set_title(f"all-reduce over emulated {g:g} Gbit/s links")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _plot_steps(b: dict[str, Any], c: dict[str, Any] | None, path: Path) -> Path:
    algorithms = list(b["algorithms"])
    fig = new_figure(9.0, 4.2)
    ax = fig.add_subplot()
    xs = range(len(algorithms))
    width = 0.4 if c else 0.8
    ax.bar([x - width / 2 if c else x for x in xs],
           [b["algorithms"][a]["seconds_per_step"] * 1e3 for a in algorithms], width,
           label="measured (emulated, gloo)")
    if c:
        sim = next(iter(c.values()))["algorithms"]
        ax.bar([x + width / 2 for x in xs], [sim[a]["seconds_per_step"] * 1e3
                                             for a in algorithms], width,
               label="SimWorld (fitted alpha-beta, measured local work)")
    return _finish_bars(fig, ax, algorithms, "ms per step (slowest worker)",
                        "one training step, 4 workers, 1 Gbit/s, MLP of 5.8M parameters", path)


def _finish_bars(fig, ax, algorithms: list[str], ylabel: str, title: str, path: Path) -> Path:
    """Label a bar chart with one group of bars per algorithm, and write it to ``path``."""
    ax.set_xticks(list(range(len(algorithms))))
    ax.set_xticklabels(algorithms, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return path


def _plot_stragglers(b: dict[str, Any], d: dict[str, Any], settings, path: Path) -> Path:
    algorithms = list(b["algorithms"])
    fig = new_figure(9.0, 4.2)
    ax = fig.add_subplot()
    xs = range(len(algorithms))
    for k, (key, label) in enumerate((
            ("compute", f"rank {settings.straggler_rank} computes "
                        f"{settings.straggler_factor:g}x as long"),
            ("bandwidth", f"rank {settings.straggler_rank}'s link at "
                          f"{settings.straggler_bandwidth / 1e6:g} Mbit/s"))):
        if key not in d:
            continue
        ax.bar([x + (k - 0.5) * 0.4 for x in xs],
               [d[key]["algorithms"][a]["steps_per_second"]
                / b["algorithms"][a]["steps_per_second"] for a in algorithms], 0.4,
               label=label)
    ax.axhline(1.0, color="grey", lw=0.8)
    return _finish_bars(fig, ax, algorithms, "throughput relative to no straggler",
                        "one straggler, 4 workers, 1 Gbit/s", path)


def _plot_accuracy(e: dict[str, Any], settings, path: Path) -> Path:
    fig = new_figure(7.0, 4.5)
    ax = fig.add_subplot()
    for i, (algorithm, run) in enumerate(e["algorithms"].items()):
        history = run["history"]
        ax.plot([h["seconds"] for h in history], [100 * h["accuracy"] for h in history],
                marker=".", ls="-" if i < 10 else "--", label=algorithm)
    ax.axhline(100 * settings.target, color="grey", lw=0.8, ls="--")
    ax.set_ylim(80, 100)
    ax.set_xlabel("training seconds (evaluations left out)")
    ax.set_ylabel("eval accuracy of the averaged model (%)")
    ax.set_title("MNIST CNN, 4 workers, 1 Gbit/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    return path


# --------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------


def markdown(parts: dict[str, Any], settings, command: str, seconds: float,
             machine: str) -> str:
    """The draft of docs/benchmarks/network.md's sections (a)-(e)."""
    s = settings
    lines = [
        "## On an emulated network: collectives, one step of each algorithm, the simulator, "
        "stragglers, time to accuracy",
        "",
        "```",
        command.strip(),
        "```",
        "",
        f"Machine: {machine}. {s.mode.capitalize()} mode; this run took {seconds / 60:.1f} "
        "minutes.",
        "",
        "Every worker is a gloo process in a network namespace of its own, on a veth link to a "
        "bridge, with tc's token bucket (`tbf`) limiting the link's upload and download "
        f"(`gossamer.launch.Network`, as `gossamer launch --emulate bandwidth=1gbit,mtu={s.mtu}`"
        f"). Frames of {s.mtu} bytes; the kernel has no `sch_netem`, so the "
        "links add no delay and the latency is what the stack and the processes add. All "
        f"workers share the machine's {_cores(machine)} cores.",
        "",
    ]
    sections = [
        ("a", ("a",), _section_a), ("b", ("b",), _section_b), ("c", ("b", "c"), _section_c),
        ("d", ("b", "d"), _section_d), ("e", ("e",), _section_e)]
    for part, needs, section in sections:
        if not all(parts.get(p) for p in needs):
            continue
        try:
            extra = {"a": parts.get("a")} if part == "c" else {}
            lines += section(*(parts[p] for p in needs), s, **extra)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            # results saved by an older version of the suite: say so, keep the rest
            lines += [f"### ({part})", "", f"(not drawn: {type(exc).__name__}: {exc}; run "
                      f"part {part} again)", ""]
    return "\n".join(lines) + "\n"


def _cores(machine: str) -> str:
    for part in machine.split(","):
        if part.strip().endswith("cores"):
            return part.strip().split()[0]
    return "?"


def _section_a(a: dict[str, Any], s) -> list[str]:
    lines = [
        "### (a) All-reduce against the alpha-beta model",
        "",
        "`comm.all_reduce` of float32 tensors (gloo's ring), each timed right after a barrier "
        "as the slowest rank's time; median of "
        + ", ".join(f"{r} ({_size(size)})" for size, r in s.reps) + " repetitions. Model: "
        "`ring_all_reduce_time` with `NetworkModel(bandwidth=link rate, latency=50 us)`; "
        "fitted: alpha and beta fitted to all sizes of that worker count and rate "
        "(`gossamer.comm.cost.fit_ring_all_reduce`, least squares on relative errors, 1/beta "
        "at most the link's rate: the token bucket's 1 ms burst lets small messages through "
        "faster than the rate, which would otherwise fit a bandwidth the link never gives; "
        "sizes below 1 MB are in the fit, not in the table).",
        "",
        "| workers | Gbit/s | size | measured ms | model ms | measured / model "
        "| fitted model ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(a["rows"], key=lambda r: (r["gbits"], r["workers"], r["bytes"])):
        if r["bytes"] not in s.table_sizes:
            continue
        lines.append(f"| {r['workers']} | {r['gbits']:g} | {_size(r['bytes'])} | "
                     f"{_ms(r['median'])} | {_ms(r['model'])} | "
                     f"{r['median'] / r['model']:.2f} | {_ms(r['fitted'])} |")
    lines += [
        "",
        "Effective alpha and beta (fitted):",
        "",
        "| Gbit/s | workers | alpha | 1/beta | of the link's rate |",
        "|---|---|---|---|---|",
    ]
    for f in a["fits"]:
        lines.append(f"| {f['gbits']:g} | {', '.join(map(str, f['workers']))} | "
                     f"{f['latency'] * 1e6:.0f} us | {f['bandwidth'] * 8 / 1e9:.3f} Gbit/s | "
                     f"{_pct(f['efficiency'])} |")
    if a.get("p2p"):
        lines += [
            "",
            "Point to point (`comm.exchange`), one message of the size on every link in use: "
            "`shift`, rank i sends to i + 1 (with more than 2 workers each TCP connection "
            "carries one direction); `swap`, ranks 2k and 2k + 1 send to each other over the "
            "same connection; `swap, receive first`, the same with `torch.distributed`'s "
            "`irecv` posted before its `isend`, directly (`comm.exchange` also posts its "
            "receives first: the two should agree). Model: alpha + size / rate with the "
            "link's nominal rate and alpha = 50 us.",
            "",
            "| pattern | workers | Gbit/s | size | measured ms | model ms | measured / model |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in sorted(a["p2p"], key=lambda r: (r["gbits"], r["workers"], r["pattern"],
                                                 r["bytes"])):
            lines.append(f"| {r['pattern']} | {r['workers']} | {r['gbits']:g} | "
                         f"{_size(r['bytes'])} | {_ms(r['median'])} | {_ms(r['model'])} | "
                         f"{r['median'] / r['model']:.2f} |")
    if a.get("mtu_rows"):
        lines += [
            "",
            "Frame size: one all-reduce size at the largest worker count with 1500-byte "
            "frames (`gossamer launch`'s default), the suite's frames and 64 KiB frames. "
            "Segmentation offload is off on the emulated links, so the kernel handles every "
            "frame on its own: small frames cost CPU time that real NICs spend in hardware.",
            "",
            "| Gbit/s | MTU | workers | size | measured ms | model ms | measured / model |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in sorted(a["mtu_rows"], key=lambda r: (r["gbits"], r["mtu"])):
            model = all_reduce_model(r["workers"], r["bytes"], nominal_network(r["gbits"]))
            lines.append(f"| {r['gbits']:g} | {r['mtu']} | {r['workers']} | "
                         f"{_size(r['bytes'])} | {_ms(r['median'])} | {_ms(model)} | "
                         f"{r['median'] / model:.2f} |")
    lines += ["", "![all-reduce against the model](benchmarks/figures/network_collectives.png)",
              ""]
    return lines


def _section_b(b: dict[str, Any], s) -> list[str]:
    rows = b["algorithms"]
    params = rows["allreduce"]["ranks"][0]["parameters"]
    lines = [
        f"### (b) One training step of each algorithm ({s.train_workers} workers, "
        f"{s.train_gbits:g} Gbit/s)",
        "",
        f"MLP 784-2048-2048-10 ({params:,} parameters, {4 * params / MB:.1f} MB in float32) on "
        f"a fixed random batch of {s.batch} MNIST-shaped inputs per worker, SGD with momentum; "
        f"{s.warmup} warm-up steps, then {s.steps} timed steps on each rank's clock; the time "
        "per step is the slowest rank's. One process per worker, one torch thread each. "
        "Compute is forward, backward and the inner optimizer's step (median); local work is "
        "the rest of the step outside the communicator's calls (compute plus the algorithm's "
        "own work: flattening, compression, mixing); in communicator is the time inside them "
        "(sends, receives, collectives, waiting for peers).",
        "",
        "| algorithm | registry name and options | ms / step | speed-up over AllReduce | "
        "compute ms | local work ms | in communicator ms | MB sent / worker / step | "
        "CPU s / step / process |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for algorithm, r in rows.items():
        lines.append(
            f"| {algorithm} | {_options(algorithm)} | {_ms(r['seconds_per_step'])} | "
            f"{r['speedup']:.2f}x | {_ms(r['compute_per_step'])} | {_ms(r['local_per_step'])} | "
            f"{_ms(r['comm_per_step'])} | {r['bytes_per_step'] / MB:.2f} | "
            f"{r['cpu_per_step']:.3f} |")
    busy = [r["machine_busy"] for r in rows.values() if r.get("machine_busy") is not None]
    if busy:
        lines += ["", f"The machine's cores were {_pct(min(busy))}-{_pct(max(busy))} busy "
                  "(user, system and softirq time in /proc/stat, everything on the machine) "
                  "while the timed steps ran."]
    lines.append("")
    return lines


def _section_c(b: dict[str, Any], c: dict[str, Any], s,
               a: dict[str, Any] | None = None) -> list[str]:
    main, *others = list(c)
    predicted = c[main]
    net = predicted["network"]
    lines = [
        "### (c) The simulator against the emulated run",
        "",
        "SimWorld runs the same worker code (`benchmarks/netbench_tasks.py`, "
        f"`training_steps`) with {s.train_workers} simulated workers; the forward and backward "
        "passes are replaced by fixed random gradients, whose time the compute model declares. "
        "Declared parameters: each rank's compute per step is its local work measured in (b) "
        "(`ComputeModel(step_time, stragglers={rank: own mean / mean}, jitter)`), with "
        "log-normal jitter of the measured spread (the standard deviation of the logarithm of "
        "the steps' local work, averaged over ranks) and the step time scaled so that the "
        "expected step is the measured mean; the network is "
        + (f"the alpha-beta fit of (a) at {s.train_workers} workers and {s.train_gbits:g} "
           "Gbit/s" if main.startswith("fitted") else "the links' nominal rate")
        + f": alpha {net['latency'] * 1e6:.0f} us, 1/beta {net['bandwidth'] * 8 / 1e9:.3f} "
        f"Gbit/s. Target: predicted time per step within {_pct(SIM_TARGET)} of the measured; "
        f"predicted speed-ups that differ from the emulated by more than {_pct(SPEEDUP_FLAG)} "
        "are **bold**. Waiting is the step's time outside local work: in the communicator "
        "(measured) and in the simulator's virtual time (predicted).",
        "",
    ]
    header = ("| algorithm | measured ms | predicted ms | predicted / measured | within "
              f"{_pct(SIM_TARGET)} | emulated speed-up | predicted speed-up | jitter | "
              "waiting ms, measured | waiting ms, predicted |")
    rule = "|---|---|---|---|---|---|---|---|---|---|"
    for other in others:
        header += f" {other}: predicted / measured |"
        rule += "---|"
    lines += [header, rule]
    met = []
    for algorithm, row in b["algorithms"].items():
        p = predicted["algorithms"][algorithm]
        ok = abs(p["ratio"] - 1) <= SIM_TARGET
        met.append((algorithm, ok))
        emulated, speedup = row["speedup"], p["speedup"]
        flag = abs(speedup / emulated - 1) > SPEEDUP_FLAG
        cell = f"**{speedup:.2f}x**" if flag else f"{speedup:.2f}x"
        line = (f"| {algorithm} | {_ms(row['seconds_per_step'])} | "
                f"{_ms(p['seconds_per_step'])} | {p['ratio']:.2f} | {'yes' if ok else 'no'} | "
                f"{emulated:.2f}x | {cell} | {p['compute']['jitter']:.2f} | "
                f"{_ms(row['comm_per_step'])} | {_ms(max(0.0, p['waiting_per_step']))} |")
        for other in others:
            line += f" {c[other]['algorithms'][algorithm]['ratio']:.2f} |"
        lines.append(line)
    good = [a for a, ok in met if ok]
    bad = [a for a, ok in met if not ok]
    if a and a.get("p2p"):
        swaps = {r["pattern"]: r for r in a["p2p"] if r["workers"] == s.train_workers
                 and r["gbits"] == s.train_gbits and r["bytes"] == max(s.p2p_sizes)}
        if "swap" in swaps and "swap, receive first" in swaps:
            swap, first = swaps["swap"]["median"], swaps["swap, receive first"]["median"]
            sizes = (f"in (a), two ranks swapping {_size(max(s.p2p_sizes))} with "
                     f"`comm.exchange` took {_ms(swap)} ms, and {_ms(first)} ms with torch's "
                     f"irecv posted before its isend (model {_ms(swaps['swap']['model'])} ms)")
            both = ("Exchanges that go both ways over one connection in the same step "
                    "(D-PSGD's ring; SGP's and Overlap SGP's exponential graph at every other "
                    f"step at {s.train_workers} workers; GossipGraD's partners; WAGMA's pairs)")
            if swap > 1.3 * first:
                lines += ["", f"{both} are slower than the model assumes: {sizes}."]
            else:  # comm.exchange posts its receives first (gloo's sends posted first: 2x)
                lines += ["", f"{both} take the model's time: `comm.exchange` posts its "
                          f"receives before its sends ({sizes}; with the sends posted first, "
                          "gloo took twice the model's time)."]
    lines += ["", f"Within {_pct(SIM_TARGET)}: {len(good)} of {len(met)}"
              + (f" ({', '.join(good)})" if good else "")
              + (f"; missed: {', '.join(bad)}." if bad else ".")]
    for other in others:
        net = c[other]["network"]
        what = ("compute = forward, backward and optimizer step only (the algorithm's own "
                "work left out)" if not c[other].get("local", True) else "compute = local work")
        lines.append(f"`{other}`: alpha {net['latency'] * 1e6:.0f} us, 1/beta "
                     f"{net['bandwidth'] * 8 / 1e9:.3f} Gbit/s, {what}"
                     + ("" if c[other]["jitter"] else ", no jitter") + ".")
    lines += ["", "![measured and predicted time per step](benchmarks/figures/network_steps.png)",
              ""]
    return lines


def _section_d(b: dict[str, Any], d: dict[str, Any], s) -> list[str]:
    slow = s.straggler_rank
    sim = d.get("simulated") or {}
    lines = [
        "### (d) One straggler",
        "",
        f"The runs of (b) again with rank {slow} slowed down: its compute takes "
        f"{s.straggler_factor:g}x as long (it sleeps {s.straggler_factor - 1:g}x its median "
        "forward-backward time after each backward, so it takes no CPU from the others), or "
        f"its link runs at {s.straggler_bandwidth / 1e6:g} Mbit/s "
        f"(`--emulate-rank {slow}:bandwidth={s.straggler_bandwidth / 1e6:g}mbit`). Throughput "
        "is the steps per second of all workers together (each worker's own rate, summed: "
        "samples per second / batch); relative to (b)'s. The slowest worker's rate is the "
        "pace of a synchronous method.",
        "",
    ]
    header = ("| algorithm | no straggler, steps/s | slow compute, steps/s | relative | slowest "
              "worker, steps/s | slow link, steps/s | relative | slowest worker, steps/s |")
    rule = "|---|---|---|---|---|---|---|---|"
    if sim:
        header += " simulated relative, slow compute | simulated relative, slow link |"
        rule += "---|---|"
    lines += [header, rule]
    for algorithm, base in b["algorithms"].items():
        cells = [algorithm, f"{base['steps_per_second']:.2f}"]
        for key in ("compute", "bandwidth"):
            r = d.get(key, {}).get("algorithms", {}).get(algorithm)
            if r is None:
                cells += ["-", "-", "-"]
                continue
            cells += [f"{r['steps_per_second']:.2f}",
                      f"{r['steps_per_second'] / base['steps_per_second']:.2f}",
                      f"{1 / r['seconds_per_step']:.2f}"]
        if sim:
            for key in ("compute", "bandwidth"):
                p = sim.get(key, {}).get(algorithm)
                q = d[key]["algorithms"][algorithm]
                cells.append("-" if p is None else
                             f"{p['steps_per_second'] / base['steps_per_second']:.2f} "
                             f"(measured {q['steps_per_second'] / base['steps_per_second']:.2f})")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "![throughput with a straggler](benchmarks/figures/network_stragglers.png)", ""]
    return lines


def _section_e(e: dict[str, Any], s) -> list[str]:
    runs = e["algorithms"]
    lines = [
        f"### (e) Time to {100 * s.target:g}% on MNIST ({s.train_workers} workers, "
        f"{s.train_gbits:g} Gbit/s)",
        "",
        "The small CNN (0.42M parameters), the first 8,000 t10k images split IID over the "
        "workers, the last 2,000 evaluate; batch 32 per worker, SGD with momentum 0.9, lr "
        f"0.05 after 20 warm-up steps, cosine decay to 0 at step {s.tta_max_steps} (the budget). "
        f"Every {s.tta_eval_every} steps the average of the replicas is evaluated; the clock "
        "counts training only (evaluations, with their averaging all-reduce, are left out), "
        "as the slowest worker's. QSR's `warmup_steps` is the learning-rate warm-up.",
        "",
        f"| algorithm | steps to {100 * s.target:g}% | seconds | vs AllReduce | accuracy at "
        "the stop |",
        "|---|---|---|---|---|",
    ]
    base = (runs.get("allreduce") or {}).get("reached")
    missed = []
    for algorithm, run in runs.items():
        reached = run["reached"]
        last = run["history"][-1] if run["history"] else {"step": 0, "seconds": 0.0,
                                                          "accuracy": float("nan")}
        if reached:
            vs = f"{base['seconds'] / reached['seconds']:.2f}x" if base else "-"
            lines.append(f"| {algorithm} | {reached['step']} | {reached['seconds']:.1f} | {vs} "
                         f"| {100 * reached['accuracy']:.2f}% |")
        else:
            missed.append(algorithm)
            best = max((h["accuracy"] for h in run["history"]), default=float("nan"))
            lines.append(f"| {algorithm} | not reached in {last['step']} | "
                         f"({last['seconds']:.1f} s trained) | - | {100 * last['accuracy']:.2f}% "
                         f"(best {100 * best:.2f}%) |")
    lines += ["", f"Reached {100 * s.target:g}% within {s.tta_max_steps} steps: "
              f"{len(runs) - len(missed)} of {len(runs)}"
              + (f"; not reached: {', '.join(missed)}." if missed else ".")]
    lines += ["", "![accuracy against time](benchmarks/figures/network_accuracy.png)", ""]
    return lines
