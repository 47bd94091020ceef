"""Start N workers of ``gossamer train`` and watch them: on this host, or one per emulated node.

Without emulation each worker is a process on this host with the environment torchrun gives
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``).
With emulation (:mod:`gossamer.launch.netem`) each worker runs in its own network namespace
under its own torchrun, as a node of a multi-node job: the torchrun agents meet through the
static rendezvous at rank 0's namespace address, and gloo uses the namespace's link
(``GLOO_SOCKET_IFNAME``), so every byte between workers crosses the shaped links.

Every line a worker prints is prefixed with ``[rank R]``. When a worker fails, the others are
stopped (SIGTERM, then SIGKILL after a grace period) and the launcher exits with the failed
worker's code, unless ``max_restarts`` allows a restart: then every worker starts again, as
under ``torchrun --max-restarts`` (``TORCHELASTIC_RESTART_COUNT`` counts the restarts, and a
run with a run directory resumes from its latest checkpoint). When the launcher gets SIGINT,
SIGTERM or SIGHUP it stops the workers, removes the network and exits with 128 + the signal's
number.

Example::

    code = launch(["--steps", "100", "--run-dir", "runs/ar"], nproc=2,
                  links=[LinkSpec(bandwidth=1e9)] * 2)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from gossamer.launch.netem import Interrupted, LinkSpec, Network, SignalGuard

__all__ = ["launch", "train_config"]

GRACE = 5.0  # seconds the workers get to exit after SIGTERM before they are killed
MASTER_PORT = 29500  # emulated: rank 0's namespace is a machine of its own, nothing else uses it
NETWORK_REPORT = "network.json"  # written to the run directory of an emulated run
# torchrun's variables: a launcher started under torchrun must not pass its own on
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT")


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


@dataclass
class _Output:
    """Where the workers' lines and the launcher's own go, one whole line at a time."""

    out: IO[str]
    err: IO[str]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def write(self, sink: IO[str], line: str) -> None:
        with self.lock:
            sink.write(line + "\n")
            sink.flush()

    def say(self, message: str) -> None:
        self.write(self.err, f"gossamer launch: {message}")


@dataclass
class _Worker:
    rank: int
    process: subprocess.Popen
    pumps: list[threading.Thread] = field(default_factory=list)
    # set when the launcher stops this worker: what it prints while dying is noise
    muted: threading.Event = field(default_factory=threading.Event)


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
    output = _Output(stdout if stdout is not None else sys.stdout,
                     stderr if stderr is not None else sys.stderr)
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
    env["PYTHONUNBUFFERED"] = "1"  # lines reach the prefixer as they are printed
    # the workers share this host's cores: one OpenMP pool per worker would oversubscribe
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    workers: list[_Worker] = []
    with SignalGuard() as guard:
        try:
            if links is None:
                code = _run_local(list(train_args), nproc, env, workers, guard, grace, output,
                                  max_restarts)
            else:
                code = _run_emulated(list(train_args), links, env, workers, guard, grace,
                                     output, config.run_dir, max_restarts)
        except Interrupted as exc:
            # while the network was built or the workers started: they are stopped below
            output.say(f"{exc} received; stopping")
            code = exc.exit_code
        finally:
            with guard.shielded(reraise=False):
                _stop(workers, grace)
                for w in workers:
                    for pump in w.pumps:
                        pump.join(timeout=5.0)
    return code


def _run_local(train_args: list[str], nproc: int, env: dict[str, str], workers: list[_Worker],
               guard: SignalGuard, grace: float, output: _Output, max_restarts: int = 0) -> int:
    from gossamer.testing import free_port

    for attempt in range(max_restarts + 1):
        port = str(free_port())  # a fresh rendezvous: rank 0 hosts a new store
        first = len(workers)  # those of earlier attempts are stopped and reaped already
        for rank in range(nproc):
            worker_env = {**env, "RANK": str(rank), "WORLD_SIZE": str(nproc),
                          "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nproc),
                          "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                          "TORCHELASTIC_RESTART_COUNT": str(attempt),
                          "TORCHELASTIC_MAX_RESTARTS": str(max_restarts)}
            cmd = [sys.executable, "-m", "gossamer", "train", *train_args]
            workers.append(_start(rank, cmd, worker_env, output))
        code, interrupted = _supervise(workers[first:], guard, grace, output)
        if code == 0 or interrupted or attempt == max_restarts:
            return code
        output.say(f"restarting every worker (restart {attempt + 1} of {max_restarts}); with "
                   "a run directory the run resumes from its latest checkpoint")
    raise AssertionError("unreachable")


def _run_emulated(train_args: list[str], links: Sequence[LinkSpec], env: dict[str, str],
                  workers: list[_Worker], guard: SignalGuard, grace: float, output: _Output,
                  run_dir: str | None, max_restarts: int = 0) -> int:
    nproc = len(links)
    with Network(links) as net:
        _describe_network(net, output)
        before = [net.counters(rank) for rank in range(nproc)]
        for rank in range(nproc):
            cmd = [*net.exec_prefix(rank), sys.executable, "-m", "torch.distributed.run",
                   "--nnodes", str(nproc), "--node-rank", str(rank), "--nproc-per-node", "1",
                   "--master-addr", net.address(0), "--master-port", str(MASTER_PORT),
                   "--max-restarts", str(max_restarts), "--monitor-interval", "0.1",
                   "-m", "gossamer", "train", *train_args]
            worker_env = {**env, "GLOO_SOCKET_IFNAME": net.interface(rank)}
            workers.append(_start(rank, cmd, worker_env, output))
        code, _ = _supervise(workers, guard, grace, output)
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


def _start(rank: int, cmd: list[str], env: dict[str, str], output: _Output) -> _Worker:
    # Its own session: a Ctrl-C in the terminal reaches the launcher, which stops the workers
    # in order, and the worker's whole process group can be signalled.
    process = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True)
    worker = _Worker(rank, process)
    for source, sink in ((process.stdout, output.out), (process.stderr, output.err)):
        pump = threading.Thread(target=_pump, args=(source, sink, f"[rank {rank}] ", output,
                                                    worker.muted),
                                name=f"gossamer-launch-pump-{rank}", daemon=True)
        pump.start()
        worker.pumps.append(pump)
    return worker


def _pump(source: IO[bytes], sink: IO[str], prefix: str, output: _Output,
          muted: threading.Event) -> None:
    """Copy ``source`` to ``sink`` line by line, each line prefixed, until ``muted``."""
    with source:
        for raw in iter(source.readline, b""):
            if muted.is_set():
                continue  # keep draining, so that the worker never blocks on a full pipe
            # a progress bar redraws with \r: keep the latest state of the line
            line = raw.decode(errors="replace").rstrip("\r\n").rsplit("\r", 1)[-1]
            output.write(sink, prefix + line)


def _supervise(workers: list[_Worker], guard: SignalGuard, grace: float,
               output: _Output) -> tuple[int, bool]:
    """Wait for the workers; when one fails, stop the others. The exit code, and whether
    the launcher was interrupted."""
    failed: tuple[int, int] | None = None
    try:
        while True:
            codes = [w.process.poll() for w in workers]
            for w, code in zip(workers, codes, strict=True):
                if code not in (None, 0) and failed is None:
                    failed = (w.rank, code)
                    if any(c is None for c in codes):
                        output.say(f"rank {w.rank} {_exit_text(code)}; stopping the other "
                                   "workers (their output is not shown from here on)")
                    with guard.shielded():
                        _stop(workers, grace)
            if all(c is not None for c in codes):
                break
            time.sleep(0.05)
    except Interrupted as exc:
        output.say(f"{exc} received; stopping the workers (their output is not shown from "
                   "here on)")
        with guard.shielded(reraise=False):
            _stop(workers, grace)
        return exc.exit_code, True
    if failed is None:
        return 0, False
    rank, code = failed
    output.say(f"failed: rank {rank} {_exit_text(code)}")
    return (code if code > 0 else 128 - code), False


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _stop(workers: list[_Worker], grace: float) -> None:
    """SIGTERM every running worker's process group; SIGKILL what is left after ``grace``."""
    running = [w for w in workers if w.process.poll() is None]
    for w in running:
        w.muted.set()
        _signal_group(w.process, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for w in running:
        try:
            w.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for w in workers:
        # also the groups of workers that exited: their children may live on
        _signal_group(w.process, signal.SIGKILL)
        w.process.wait()


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _describe_network(net: Network, output: _Output) -> None:
    specs = [link.describe() for link in net.links]
    common = max(specs, key=specs.count)  # ties: the lowest rank's
    odd = ", ".join(f"rank {r}: {s}" for r, s in enumerate(specs) if s != common)
    output.say(f"emulated network of {net.world_size} nodes ({net.tag}-*, "
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


def _print_traffic(report: dict[str, Any], output: _Output) -> None:
    from gossamer.train.loop import format_bytes

    lines = ["traffic on the emulated links (frames with their headers, whole run):"]
    for r in report["ranks"]:
        lines.append(f"  rank {r['rank']} ({r['address']}, {r['link']['describe']}): sent "
                     f"{format_bytes(r['tx_bytes'])} in {r['tx_packets']} frames, received "
                     f"{format_bytes(r['rx_bytes'])}")
    output.write(output.out, "\n".join(lines))
