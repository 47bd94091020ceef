"""``gossamer bench NAME [ARGS...]``: run one benchmark of the checkout's ``benchmarks/``.

``gossamer bench`` (or ``--list``) lists them, one line each; ``gossamer bench NAME -h`` shows
a benchmark's own arguments. Results go to ``benchmarks/results/`` and figures to
``benchmarks/figures/`` unless ``--results`` / ``--figures`` say otherwise (given before NAME).

``gossamer bench report`` is built in (:mod:`gossamer.bench.doc_figures`): it regenerates the
documentation's figures, each beside a page of its numbers (``gossamer bench report -h``).
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from gossamer.bench.harness import available, find_root, load
from gossamer.bench.results import Results

__all__ = ["REPORT", "add_arguments", "run"]

#: the built-in name of ``gossamer bench report`` (gossamer.bench.doc_figures)
REPORT = "report"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench`` subcommand's arguments to ``parser``."""
    parser.add_argument("name", nargs="?", default=None,
                        help=f"the benchmark (none: list them), or {REPORT}: regenerate the "
                        "documentation's figures")
    parser.add_argument("args", nargs=argparse.REMAINDER,
                        help="the benchmark's own arguments (see gossamer bench NAME -h)")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    parser.add_argument("--results", type=Path, default=None, metavar="DIR",
                        help="where results go (default: benchmarks/results of the checkout)")
    parser.add_argument("--figures", type=Path, default=None, metavar="DIR",
                        help="where figures for BENCHMARKS.md go (default: benchmarks/figures)")


def run(args: argparse.Namespace) -> int:
    """List the benchmarks, or run ``args.name`` with ``args.args``; its exit code.

    An unknown name raises ValueError listing the known ones."""
    if args.name == REPORT:
        return _report(args)
    root = find_root()
    if args.list or args.name is None:
        known = available(root)
        width = max(map(len, known), default=0)
        print("\n".join(f"{name:<{width}}  {summary}" for name, summary in known.items()))
        return 0
    module = load(root, args.name)
    parser = argparse.ArgumentParser(
        prog=f"gossamer bench {args.name}", description=module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    options = parser.parse_args(args.args)
    command = shlex.join(["gossamer", "bench", args.name, *args.args])
    results = Results(folder=args.results or root / "benchmarks" / "results",
                      figures=args.figures or root / "benchmarks" / "figures", command=command)
    results.folder.mkdir(parents=True, exist_ok=True)
    return module.run(options, results)


def _report(args: argparse.Namespace) -> int:
    """``gossamer bench report ARGS``: the documentation's figures (a benchmark's
    ``--results`` and ``--figures`` do not apply: it takes ``--runs`` and ``--out``)."""
    from gossamer.bench import doc_figures

    parser = argparse.ArgumentParser(
        prog=f"gossamer bench {REPORT}", description=doc_figures.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    doc_figures.add_arguments(parser)
    options = parser.parse_args(args.args)
    return doc_figures.run(options, command=doc_figures.command_line(args.args))
