"""``gossamer compare``: several algorithms on the same task, seed and partition, one report.

Each algorithm is given as ``NAME`` or ``NAME:KEY=VALUE:KEY=VALUE`` (its options), e.g.
``allreduce,allreduce:bucket_mb=1``. Every run gets its own run directory under the output
directory; the report (``report.md``, a table and PNG plots of loss and accuracy against steps,
wall-clock and bytes) is written beside them.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

from gossamer.algorithms import Algorithm, available, create
from gossamer.train.config import TrainConfig, parse_options


def parse_algorithms(spec: str) -> list[tuple[str, Algorithm]]:
    """``"a,b:k=v"`` -> ``[(label, algorithm), ...]``: each entry resolved once, into its
    configuration object (unknown names and bad options fail here, before any run)."""
    entries = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            raise ValueError(f"algorithms {spec!r} has an empty entry")
        name, *pairs = item.split(":")
        entries.append((item, create(name, parse_options(pairs))))
    labels = [label for label, _ in entries]
    if len(set(labels)) != len(labels):
        raise ValueError(f"algorithms {spec!r} names the same entry twice")
    return entries


def run_compare(algorithms: str, base: TrainConfig, out_dir: str | Path) -> Path:
    """Run every algorithm of ``algorithms`` with ``base``'s task; write and return the report."""
    from gossamer.train.report import load_metrics, write_report
    from gossamer.train.run import run_training

    entries = parse_algorithms(algorithms)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    run_dirs = []
    for i, (label, algorithm) in enumerate(entries, 1):
        run_dir = out / re.sub(r"[^A-Za-z0-9_.=-]+", "_", label)
        config = base.replace(algorithm=algorithm, run_dir=str(run_dir),
                              resume=False, quiet=True)
        started = time.perf_counter()
        if not base.quiet:
            print(f"[{i}/{len(entries)}] {label} ...", end="", file=sys.stderr, flush=True)
        result = run_training(config)
        if not base.quiet:
            acc = result.get("eval_accuracy", float("nan"))
            print(f" eval accuracy {100 * acc:.2f}%, {time.perf_counter() - started:.1f} s",
                  file=sys.stderr)
        run_dirs.append(run_dir)
    runs = [load_metrics(d) for d in run_dirs]
    for run, (label, _) in zip(runs, entries, strict=True):
        run.name = label  # the entry as given, options included
    return write_report(runs, out, title="gossamer compare")


def default_algorithms() -> str:
    """Every registered method that learns the default task and the MNIST CNN with its
    defaults (a method's ``needs`` says what it needs otherwise)."""
    from gossamer.algorithms import lookup

    return ",".join(name for name in available() if not lookup(name).needs)
