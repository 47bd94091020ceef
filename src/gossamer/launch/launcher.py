"""Start N workers of ``gossamer train`` and watch them: on this host, or one per emulated node.

Without emulation each worker is a process on this host with the environment torchrun gives
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``).
With emulation (:mod:`gossamer.launch.netem`) each worker runs in its own network namespace
under its own torchrun, as a node of a multi-node job: the torchrun agents meet through the
static rendezvous at rank 0's namespace address, and gloo uses the namespace's link
(``GLOO_SOCKET_IFNAME``), so every byte between workers crosses the shaped links.

The workers are watched by :class:`~gossamer.launch.supervisor.Supervisor`: every line a
worker prints is prefixed with ``[rank R]``; when a worker fails, the others are
stopped (SIGTERM, then SIGKILL after a grace period) and the launcher exits with the failed
worker's code, unless ``max_restarts`` allows a restart: then every worker starts again, as
under ``torchrun --max-restarts`` (``TORCHELASTIC_RESTART_COUNT`` counts the restarts, and a
run with a run directory resumes from its latest checkpoint). When the launcher gets SIGINT,
SIGTERM or SIGHUP it stops the workers, removes the network and exits with 128 + the signal's
number.

Example::

    code = launch(["--steps", "100", "--run-dir", "runs/ar"], nproc=2,
                  links=[LinkSpec(bandwidth="1gbit")] * 2)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

from gossamer.comm.environment import torchrun_variables, without_launcher
from gossamer.launch.continuing import run_continuing
from gossamer.launch.netem import Interrupted, LinkSpec, Network, SignalGuard
from gossamer.launch.supervisor import GRACE, Outcome, Output, Supervisor, describe_exit

__all__ = ["launch", "train_config"]

MASTER_PORT = 29500  # emulated: rank 0's namespace is a machine of its own, nothing else uses it
NETWORK_REPORT = "network.json"  # written to the run directory of an emulated run


class _TrainArgs(argparse.ArgumentParser):
    """The train subcommand's flags; an error is a ValueError, not an exit."""

    def error(self, message: str):  # type: ignore[override]
        raise ValueError(f"train arguments: {message}")


def train_config(train_args: Sequence[str]):
    """Check the arguments for ``gossamer train`` before any worker starts; the config.

    Raises ValueError for what every worker would reject, and for ``--sim N``: under the
    launcher each process is one worker.
    """
    from gossamer.train.config import add_config_arguments, config_from_args

    parser = _TrainArgs(prog="gossamer launch ... --", add_help=False)
    add_config_arguments(parser)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(list(train_args))
    if args.sim:
        raise ValueError(f"train arguments: --sim {args.sim} would simulate {args.sim} workers "
                         "in every process; gossamer launch runs one worker per process, so "
                         "leave --sim out")
    return config_from_args(args, sim=0)


def launch(
    train_args: Sequence[str],
    nproc: int,
    *,
    links: Sequence[LinkSpec] | None = None,
    grace: float = GRACE,
    max_restarts: int = 0,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> int:
    """Run ``gossamer train TRAIN_ARGS`` as ``nproc`` workers; return the exit code.

    Args:
        train_args: arguments of ``gossamer train`` (e.g. ``["--steps", "100"]``).
        nproc: number of workers, >= 1.
        links: one :class:`LinkSpec` per rank to run each worker in an emulated network
            (needs root, ``ip`` and ``tc``); None: plain processes on this host (default).
        grace: seconds the workers get to exit after SIGTERM when they are stopped
            (default 5.0).
        max_restarts: how many times every worker is restarted after one failed (default 0),
            as torchrun's ``--max-restarts``: on this host the launcher restarts them with
            ``TORCHELASTIC_RESTART_COUNT`` set; emulated, each node's torchrun does.
        stdout, stderr: where the workers' prefixed output goes (default: ``sys.stdout``,
            ``sys.stderr`` at call time).

    Returns 0 when every worker succeeded, the first failed worker's exit code (128 + signal
    for a signal) otherwise, and 128 + signal when the launcher itself was interrupted. An
    emulated run with a run directory also writes ``network.json`` there: per rank, its link
    and the bytes and frames its interface sent and received during the run.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc must be an integer >= 1, got {nproc!r}")
    if links is not None and len(links) != nproc:
        raise ValueError(f"links must give one link per rank: {len(links)} for {nproc} ranks")
    if not grace >= 0:
        raise ValueError(f"--grace must be >= 0 seconds, got {grace!r}")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"--max-restarts must be an integer >= 0, got {max_restarts!r}")
    config = train_config(train_args)
    if config.on_failure == "continue" and links is not None:
        raise ValueError("--on-failure continue does not combine with --emulate yet: each "
                         "emulated node's torchrun stops every worker when one fails")
    output = Output(stdout if stdout is not None else sys.stdout,
                    stderr if stderr is not None else sys.stderr)
    # an outer launcher's variables (a launcher started under torchrun or srun) stay out
    env = without_launcher()
    env["PYTHONUNBUFFERED"] = "1"  # lines reach the prefixer as they are printed
    # the workers share this host's cores: one OpenMP pool per worker would oversubscribe
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    with SignalGuard() as guard:
        try:
            if config.on_failure == "continue":
                return run_continuing(list(train_args), nproc, env, guard, grace, output,
                                      config.timeout, max_restarts)
            if links is None:
                return _run_local(list(train_args), nproc, env, guard, grace, output,
                                  max_restarts)
            return _run_emulated(list(train_args), links, env, guard, grace, output,
                                 config.run_dir, max_restarts)
        except Interrupted as exc:
            # while the network was built or the workers started: they are stopped already
            _say(output, f"{exc} received; stopping")
            return exc.exit_code


def _say(output: Output, message: str) -> None:
    output.write(output.err, f"gossamer launch: {message}")


def _supervisor(guard: SignalGuard, grace: float, output: Output) -> Supervisor:
    def on_failure(rank: int, code: int, running: list[int]) -> None:
        if running:
            _say(output, f"rank {rank} {describe_exit(code)}; stopping the other workers "
                 "(their output is not shown from here on)")

    return Supervisor(output=output, grace=grace, on_failure=on_failure, shield=guard.shielded)


def wait_or_stop(workers: Supervisor, guard: SignalGuard, output: Output) -> Outcome | int:
    """Wait for the workers; when the launcher is interrupted, stop them and return the exit
    code (128 + the signal's number)."""
    try:
        return workers.wait()
    except Interrupted as exc:
        _say(output, f"{exc} received; stopping the workers (their output is not shown from "
             "here on)")
        with guard.shielded(reraise=False):
            workers.stop()
        return exc.exit_code


def _watch(workers: Supervisor, guard: SignalGuard, output: Output) -> tuple[int, bool]:
    """Wait for the workers (stopped when one fails); the exit code, and whether the launcher
    was interrupted."""
    outcome = wait_or_stop(workers, guard, output)
    if isinstance(outcome, int):
        return outcome, True
    if outcome.failed is None:
        return 0, False
    _say(output, f"failed: rank {outcome.failed} {describe_exit(outcome.codes[outcome.failed])}")
    return outcome.exit_code, False


def _run_local(train_args: list[str], nproc: int, env: dict[str, str], guard: SignalGuard,
               grace: float, output: Output, max_restarts: int = 0) -> int:
    from gossamer.comm.environment import free_port

    for attempt in range(max_restarts + 1):
        port = free_port()  # a fresh rendezvous: rank 0 hosts a new store
        with _supervisor(guard, grace, output) as workers:
            for rank in range(nproc):
                worker_env = {**env, **torchrun_variables(rank, nproc, "127.0.0.1", port),
                              "GROUP_RANK": "0", "TORCHELASTIC_RESTART_COUNT": str(attempt),
                              "TORCHELASTIC_MAX_RESTARTS": str(max_restarts)}
                cmd = [sys.executable, "-m", "gossamer", "train", *train_args]
                workers.start(rank, cmd, worker_env, echo=f"[rank {rank}] ")
            code, interrupted = _watch(workers, guard, output)
        if code == 0 or interrupted or attempt == max_restarts:
            return code
        _say(output, f"restarting every worker (restart {attempt + 1} of {max_restarts}); with "
             "a run directory the run resumes from its latest checkpoint")
    raise AssertionError("unreachable")


def _run_emulated(train_args: list[str], links: Sequence[LinkSpec], env: dict[str, str],
                  guard: SignalGuard, grace: float, output: Output, run_dir: str | None,
                  max_restarts: int = 0) -> int:
    nproc = len(links)
    with Network(links) as net:
        _describe_network(net, output)
        before = [net.counters(rank) for rank in range(nproc)]
        with _supervisor(guard, grace, output) as workers:
            for rank in range(nproc):
                cmd = [*net.exec_prefix(rank), sys.executable, "-m", "torch.distributed.run",
                       "--nnodes", str(nproc), "--node-rank", str(rank), "--nproc-per-node",
                       "1", "--master-addr", net.address(0), "--master-port", str(MASTER_PORT),
                       "--max-restarts", str(max_restarts), "--monitor-interval", "0.1",
                       "-m", "gossamer", "train", *train_args]
                worker_env = {**env, "GLOO_SOCKET_IFNAME": net.interface(rank)}
                workers.start(rank, cmd, worker_env, echo=f"[rank {rank}] ")
            code, _ = _watch(workers, guard, output)
        after = [net.counters(rank) for rank in range(nproc)]
        report = _network_report(net, before, after)
        # the workers are gone; the network goes next
    if code == 0:
        _print_traffic(report, output)
    if run_dir:
        path = Path(run_dir) / NETWORK_REPORT
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
    return code


def _describe_network(net: Network, output: Output) -> None:
    specs = [link.describe() for link in net.links]
    common = max(specs, key=specs.count)  # ties: the lowest rank's
    odd = ", ".join(f"rank {r}: {s}" for r, s in enumerate(specs) if s != common)
    _say(output, f"emulated network of {net.world_size} nodes ({net.tag}-*, "
               f"{net.address(0)}...): {common}" + (f"; {odd}" if odd else ""))


def _network_report(net: Network, before: list[dict[str, int]],
                    after: list[dict[str, int]]) -> dict[str, Any]:
    ranks = []
    for rank, (b, a) in enumerate(zip(before, after, strict=True)):
        ranks.append({
            "rank": rank,
            "namespace": net.namespace(rank),
            "address": net.address(rank),
            "interface": net.interface(rank),
            "link": {**asdict(net.links[rank]), "describe": net.links[rank].describe()},
            **{key: a[key] - b[key] for key in a},
        })
    return {"ranks": ranks}


def _print_traffic(report: dict[str, Any], output: Output) -> None:
    from gossamer.train.metrics import format_bytes

    lines = ["traffic on the emulated links (frames with their headers, whole run):"]
    for r in report["ranks"]:
        lines.append(f"  rank {r['rank']} ({r['address']}, {r['link']['describe']}): sent "
                     f"{format_bytes(r['tx_bytes'])} in {r['tx_packets']} frames, received "
                     f"{format_bytes(r['rx_bytes'])}, {r['tcp_retransmitted']} TCP segments "
                     "sent again")
    output.write(output.out, "\n".join(lines))
