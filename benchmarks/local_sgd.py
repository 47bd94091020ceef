"""Local SGD and QSR against AllReduce: synchronisations, bytes and final quality.

    gossamer bench local_sgd mnist --data ../shared/data --seeds 0 1 2 --naive --threads 1
    gossamer bench local_sgd text --data ../shared/data --seeds 0 1 --threads 1

mnist: the CNN of recipes/mnist-cnn.yaml (8 simulated workers, SGD with momentum, 20 warm-up
steps then a cosine decay to 0, 300 steps); text: the character transformer of
recipes/shakespeare-char-qsr.yaml (8 simulated workers, AdamW, 30 warm-up steps then a cosine
decay to lr / 10, 400 steps, 32 characters of context). On each: AllReduce, local SGD with a
constant period H = 2, 4, 8, and QSR (Gu et al., ICLR 2024), H = max(H_base, floor((alpha / lr)
** 2)) after each average, with the same steps, seed and data split.

QSR averages after every step of the learning-rate warm-up (its ``warmup_steps``): there the
learning rate starts near 0 and the rule alone would choose one period for the whole run;
``--naive`` adds a QSR run without it to show that.

Per run: the synchronisations (exact all-reduce averages of the whole world; AllReduce has one
gradient all-reduce per step), the bytes each worker sent against AllReduce's, the final eval
accuracy and loss of the averaged model, and the periods QSR chose. The periods are replayed from
the learning-rate schedule by the algorithm's own runtime on one simulated worker (the training
front end keeps no handle on it) and checked against the count the run recorded.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from benchmarks.common import ROOT, add_data_argument, recipe_config, split_entry
from gossamer.bench import Results, markdown_table, new_figure

if TYPE_CHECKING:
    from gossamer.train.config import TrainConfig

# task: (recipe, data file or folder under --data, the quality metric, QSR's (H_base, alpha)).
# alpha is picked so that (alpha / peak lr) ** 2 is about H_base: H starts at H_base and grows
# as the cosine schedule decays, as in the paper's ViT setting (H_base 4, alpha 0.0175, peak lr
# 0.008).
TASKS: dict[str, tuple[str, str, str, list[tuple[int, float]]]] = {
    "mnist": ("mnist-cnn.yaml", "mnist", "eval_accuracy", [(2, 0.075), (4, 0.1)]),
    "text": ("shakespeare-char-qsr.yaml", "tinyshakespeare.txt", "eval_loss",
             [(2, 0.0045), (4, 0.006)]),
}
CONSTANT_PERIODS = (2, 4, 8)


def entries(warmup: int, qsr: list[tuple[int, float]], naive: bool) -> list[str]:
    """The algorithms as ``gossamer compare`` takes them: ``name:key=value:...``."""
    out = ["allreduce"] + [f"localsgd:period={h}" for h in CONSTANT_PERIODS]
    for base, alpha in qsr:
        out.append(f"qsr:period={base}:alpha={alpha:g}:warmup_steps={warmup}")
    if naive:
        base, alpha = qsr[0]
        out.append(f"qsr:period={base}:alpha={alpha:g}")
    return out


def _replay_worker(comm, config: TrainConfig) -> tuple[list[tuple[int, int]], int]:
    import gossamer
    from gossamer.train.config import learning_rate

    model = nn.Linear(1, 1)
    optimizer = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=config.lr),
                                    config.algorithm, comm, total_steps=config.steps)
    runtime = optimizer.runtime
    for step in range(config.steps):  # no gradients: the schedule depends on the lr alone
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step)
        optimizer.step()
    optimizer.finish()
    periods = [(s, h) for s, h in getattr(runtime, "periods", []) if s < config.steps]
    return periods, runtime.synchronizations


def replay(config: TrainConfig) -> tuple[list[tuple[int, int]], int]:
    """(first step of a round, its H) for every round of ``config``'s run, warm-up rounds
    included, and the run's synchronisations."""
    from gossamer.comm import SimWorld

    return SimWorld(1).run(_replay_worker, config)[0]


def run_lengths(periods: list[tuple[int, int]]) -> str:
    """The periods' H as runs: H = 2, 2, 2, 3, 5 -> ``"2x3 3 5"``."""
    out: list[list[int]] = []
    for _, h in periods:
        if out and out[-1][0] == h:
            out[-1][1] += 1
        else:
            out.append([h, 1])
    return " ".join(f"{h}x{n}" if n > 1 else str(h) for h, n in out)


def display(entry: str) -> str:
    """A table's name for an entry: ``"localsgd:period=4"`` -> ``"localsgd H=4"``."""
    name, options = split_entry(entry)
    if name == "localsgd":
        return f"localsgd H={options['period']}"
    if name == "qsr":
        text = f"qsr H_base={options['period']} alpha={options['alpha']}"
        return text if "warmup_steps" in options else text + " (no warm-up option)"
    return name


def find_runs(out: Path, names: list[str]) -> dict[str, Any]:
    """The run directory of each entry under ``out``, told apart by algorithm and options."""
    from gossamer.train.config import resolve_algorithm
    from gossamer.train.report import load_metrics

    runs = [load_metrics(d) for d in sorted(out.iterdir()) if (d / "metrics.jsonl").is_file()]
    # a run's algorithm as its config.yaml holds it: a name with options, or a spec mapping
    held = [resolve_algorithm(r.config.get("algorithm"), r.config.get("options")) for r in runs]
    found = {}
    for label in names:
        wanted = resolve_algorithm(*split_entry(label))
        match = [r for r, algorithm in zip(runs, held, strict=True) if algorithm == wanted]
        if len(match) != 1:
            raise RuntimeError(f"{out}: {len(match)} run directories for {label!r}")
        found[label] = match[0]
    return found


def finished(out: Path, names: list[str], base: TrainConfig) -> bool:
    """Whether ``out`` holds a finished run of every entry with exactly ``base``'s settings."""
    if not out.is_dir():
        return False
    try:
        runs = find_runs(out, names)
    except RuntimeError:
        return False
    skip = {"algorithm", "options", "run_dir", "quiet", "resume", "model"}
    expected = {k: v for k, v in base.as_dict().items() if k not in skip}
    return all(run.summary is not None
               and all(run.config.get(k) == v for k, v in expected.items())
               for run in runs.values())


def run(args: argparse.Namespace, results: Results) -> int:
    from gossamer.train.compare import run_compare

    if args.threads:
        torch.set_num_threads(args.threads)
    recipe, data, metric, qsr = TASKS[args.task]
    qsr = args.qsr or qsr
    base = recipe_config(recipe, args.data / data, steps=args.steps or None,
                         eval_every=args.eval_every or (25 if args.task == "mnist" else 50),
                         eval_workers=False, quiet=False)
    names = entries(base.warmup_steps, qsr, args.naive)
    schedules = {}
    for name in names:
        algorithm, options = split_entry(name)
        config = base.replace(algorithm=algorithm, options=options)
        schedules[name] = replay(config)
        if algorithm != "allreduce":
            print(f"{display(name):40s} H after each average: {run_lengths(schedules[name][0])}")
    rows = []
    for seed in args.seeds:
        out = results.folder / f"local_sgd-{args.task}-seed{seed}"
        if args.reuse and finished(out, names, base.replace(seed=seed)):
            print(f"seed {seed}: reusing the finished runs in {out}")
        else:
            started = time.perf_counter()
            run_compare(",".join(names), base.replace(seed=seed), out)
            print(f"seed {seed}: {time.perf_counter() - started:.0f} s for {len(names)} runs")
        runs = find_runs(out, names)
        reference = runs["allreduce"].final
        for name, run_metrics in runs.items():
            final = run_metrics.final
            periods, replayed = schedules[name]
            if final["synchronizations"] != replayed:
                print(f"WARNING: {name}: the run recorded {final['synchronizations']} "
                      f"synchronisations, the replay {replayed}: the H sequence printed is wrong")
            rows.append({
                "method": display(name), "entry": name, "seed": seed, "steps": base.steps,
                "synchronizations": final["synchronizations"],
                "replayed_synchronizations": replayed,
                "syncs_vs_allreduce": final["synchronizations"] / reference["synchronizations"],
                "bytes_sent": final["bytes_sent"],
                "bytes_vs_allreduce": final["bytes_sent"] / reference["bytes_sent"],
                "eval_accuracy": final["eval_accuracy"], "eval_loss": final["eval_loss"],
                "delta_vs_allreduce": final[metric] - reference[metric],
                "periods": periods,
                "history": [(e["step"], e["synchronizations"], e[metric])
                            for e in run_metrics.evals],
            })
            print(f"seed {seed} {display(name):40s} syncs {final['synchronizations']:4d} "
                  f"bytes {rows[-1]['bytes_vs_allreduce']:.3f}x  "
                  f"acc {100 * final['eval_accuracy']:.2f}%  loss {final['eval_loss']:.4f}")
    print_table(rows, names, metric)
    figure = results.figure_path(f"local_sgd_{args.task}.png")
    results.wrote(plot(rows, names, metric, args.seeds[0], f"{args.task}, {base.sim} simulated "
                       f"workers, {base.steps} steps, cosine lr", figure))
    results.write(f"local_sgd_{args.task}", {
        "task": args.task, "config": base.as_dict(), "metric": metric, "seeds": args.seeds,
        "figure": str(figure.relative_to(ROOT) if figure.is_relative_to(ROOT) else figure),
        "rows": rows})
    return 0


def print_table(rows: list[dict], names: list[str], metric: str) -> None:
    """The markdown table of docs/benchmarks/local-methods.md: the mean over seeds, and
    min-max with several."""
    label = "eval accuracy" if metric == "eval_accuracy" else "validation loss"
    cells = []
    for name in names:
        mine = [r for r in rows if r["entry"] == name]
        values = [r[metric] for r in mine]
        deltas = [r["delta_vs_allreduce"] for r in mine]
        mean, delta = sum(values) / len(values), sum(deltas) / len(deltas)
        if metric == "eval_accuracy":
            quality = f"{100 * mean:.2f}%"
            spread = f" ({100 * min(values):.2f}-{100 * max(values):.2f})" if len(mine) > 1 else ""
            change = f"{100 * delta:+.2f}"
        else:
            quality = f"{mean:.4f}"
            spread = f" ({min(values):.4f}-{max(values):.4f})" if len(mine) > 1 else ""
            change = f"{delta:+.4f}"
        first = mine[0]
        cells.append([first["method"], first["synchronizations"],
                      f"{100 * first['syncs_vs_allreduce']:.1f}%",
                      f"{sum(r['bytes_sent'] for r in mine) / len(mine) / 1e6:.1f} MB",
                      f"{sum(r['bytes_vs_allreduce'] for r in mine) / len(mine):.3f}",
                      f"{quality}{spread}", "—" if name == "allreduce" else change])
    header = ["method", "synchronisations", "vs AllReduce", "bytes / worker", "vs AllReduce",
              label, "vs AllReduce"]
    print("\n" + "\n".join(markdown_table(header, cells)) + "\n")


def plot(rows: list[dict], names: list[str], metric: str, seed: int, title: str,
         path: Path) -> Path:
    """Quality against synchronisations, and the period H against the step."""
    fig = new_figure(11, 4.2)
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for i, name in enumerate(names):
        row = next(r for r in rows if r["entry"] == name and r["seed"] == seed)
        color = f"C{i}"
        _, syncs, values = zip(*row["history"], strict=True)
        if metric == "eval_accuracy":
            values = [100 * v for v in values]
        left.plot(syncs, values, marker=".", color=color, label=row["method"])
        if row["periods"]:
            steps, periods = zip(*row["periods"], (row["steps"], row["periods"][-1][1]),
                                 strict=True)  # the last period lasts to the end
            right.step(steps, periods, where="post", color=color, label=row["method"])
    if metric == "eval_accuracy":
        left.set_ylim(90, 100)  # the end of training, where the methods differ
    left.set_xscale("log")
    left.set_xlabel("synchronisations (exact all-reduce averages)")
    left.set_ylabel("eval accuracy (%)" if metric == "eval_accuracy" else "validation loss")
    left.set_title(title, fontsize=9)
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    right.set_yscale("log", base=2)
    right.set_xlabel("step")
    right.set_ylabel("H chosen after the average at that step")
    right.set_title(f"averaging period (seed {seed})", fontsize=9)
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _qsr_spec(text: str) -> tuple[int, float]:
    base, sep, alpha = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected H_BASE:ALPHA, got {text!r}")
    return int(base), float(alpha)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("task", choices=sorted(TASKS))
    add_data_argument(parser)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--qsr", type=_qsr_spec, nargs="+", default=None, metavar="H_BASE:ALPHA",
                        help="QSR settings to run (default: the task's, see TASKS)")
    parser.add_argument("--naive", action="store_true",
                        help="also run QSR without warmup_steps (the rule during lr warm-up)")
    parser.add_argument("--steps", type=int, default=None, help="override the recipe's steps")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="steps between evaluations (default: 25 mnist, 50 text)")
    parser.add_argument("--reuse", action="store_true",
                        help="skip a seed whose finished runs of the same settings are on disk")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's); 1 on a shared machine")
