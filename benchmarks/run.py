"""The network benchmark suite (issue 8): gossamer's workers on an emulated network.

    python -m benchmarks.run --quick          # every part, under 20 minutes on 2 cores
    python -m benchmarks.run                  # full: more sizes, steps and repetitions
    python -m benchmarks.run --quick --parts b c

Parts (see :mod:`benchmarks.network`): (a) all-reduce of 1-100 MB at 2 and 4 workers over
1 and 10 Gbit/s against the alpha-beta model, with fitted alpha and beta; (b) one training step
of every algorithm, 4 workers at 1 Gbit/s, 5.8M parameters; (c) SimWorld's prediction of (b);
(d) one straggler (4x compute or a quarter of the bandwidth); (e) time to 97% on MNIST.

Needs Linux, root, iproute2 (ip, tc) and the tbf qdisc; without them it says so and exits with
code 2. Writes ``benchmarks/results/network_{a..e}.json``, figures to ``benchmarks/figures/``
and the markdown draft ``benchmarks/results/network_section.md``. Ctrl-C stops it; the
emulated network is removed either way.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from benchmarks import network

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 1)[1])
    parser.add_argument("--quick", action="store_true",
                        help="fewer sizes, steps and repetitions (under 20 minutes)")
    parser.add_argument("--parts", nargs="+", choices=network.PARTS, default=list(network.PARTS),
                        help="which parts to run (default: all); c reuses a's and b's saved "
                        "results of the same mode when they are not run")
    parser.add_argument("--data", type=Path, default=network.DATA,
                        help=f"folder holding mnist/ for part e (default: {network.DATA})")
    args = parser.parse_args(argv)
    settings = network.QUICK if args.quick else network.FULL
    parts = [p for p in network.PARTS if p in args.parts]
    command = "python -m benchmarks.run " + " ".join(argv if argv is not None else sys.argv[1:])
    try:
        return network.run_suite(settings, parts, args.data, command)
    except KeyboardInterrupt:
        print("interrupted; the emulated network (if any) was removed", file=sys.stderr)
        return 130
    except BaseException as exc:
        from gossamer.launch.netem import Interrupted

        if isinstance(exc, Interrupted):
            print(f"{exc} received; the emulated network was removed", file=sys.stderr)
            return exc.exit_code
        raise


if __name__ == "__main__":
    sys.exit(main())
