"""Run a benchmark task as N gloo workers on an emulated network, with time limits.

The host side (:func:`run_task`) builds a :class:`gossamer.launch.Network` (one network
namespace per worker, tc-shaped veth links to a bridge), starts one process per rank inside its
namespace with the environment torchrun would give it (``MASTER_ADDR`` is rank 0's namespace
address, ``GLOO_SOCKET_IFNAME`` the namespace's link), waits for them with a deadline, and
collects each rank's JSON result. Whatever happens (a worker fails, the deadline passes,
Ctrl-C), the workers are killed and the namespaces removed before it returns or raises.

The worker side is this module's ``__main__``::

    python -m benchmarks.emulation worker TASK.json OUT.json

which runs :data:`benchmarks.netbench_tasks.TASKS` ``[task["kind"]]`` on a
:class:`~gossamer.comm.TorchCommunicator`.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gossamer.launch.netem import EmulationUnavailable, LinkSpec, Network, check_prerequisites

__all__ = ["EmulationUnavailable", "WorkerFailed", "require_emulation", "run_task"]

ROOT = Path(__file__).resolve().parents[1]
MASTER_PORT = 29500  # rank 0's namespace is a machine of its own: nothing else listens there
COMM_TIMEOUT = 120.0  # seconds any collective or exchange may wait for a peer
# the variables of an outer launcher, which must not leak into the workers
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")


class WorkerFailed(RuntimeError):
    """A worker exited with an error, or the task ran past its deadline."""


def require_emulation() -> None:
    """Raise :class:`EmulationUnavailable` saying what is missing (root, ip, tc, the tbf
    qdisc), by building and removing a one-node shaped network."""
    check_prerequisites()
    with Network([LinkSpec(bandwidth=1e9)]):
        pass


def run_task(
    links: Sequence[LinkSpec],
    task: dict[str, Any],
    *,
    timeout: float,
    threads: int = 1,
    echo: bool = True,
) -> tuple[list[dict[str, Any]], list[dict[str, int]]]:
    """Run ``task`` (``{"kind": ..., "args": {...}}``) on ``len(links)`` emulated workers.

    Args:
        links: one link per rank.
        task: what every worker runs (see :data:`benchmarks.netbench_tasks.TASKS`).
        timeout: seconds for the whole task, start-up included; past it the workers are
            killed and :class:`WorkerFailed` is raised.
        threads: torch threads per worker (default 1: the workers share this machine's cores).
        echo: print rank 0's output lines, indented (default True).

    Returns each rank's result and the traffic each rank's interface counted during the task
    (bytes and frames, headers included).
    """
    n = len(links)
    with tempfile.TemporaryDirectory(prefix="gossamer-netbench-") as tmp:
        task_path = Path(tmp) / "task.json"
        task_path.write_text(json.dumps(task))
        outs = [Path(tmp) / f"rank{r}.json" for r in range(n)]
        procs: list[subprocess.Popen] = []
        tails: list[collections.deque[str]] = [collections.deque(maxlen=40) for _ in range(n)]
        pumps: list[threading.Thread] = []
        with Network(links) as net:
            try:
                before = [net.counters(r) for r in range(n)]
                for rank in range(n):
                    env = _worker_env(net, rank, n, threads)
                    cmd = [*net.exec_prefix(rank), sys.executable, "-m", "benchmarks.emulation",
                           "worker", str(task_path), str(outs[rank])]
                    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            start_new_session=True)
                    procs.append(proc)
                    pump = threading.Thread(target=_pump, daemon=True,
                                            args=(proc, tails[rank], echo and rank == 0))
                    pump.start()
                    pumps.append(pump)
                _wait(procs, tails, timeout)
                after = [net.counters(r) for r in range(n)]
            finally:
                _kill(procs)
                for pump in pumps:
                    pump.join(timeout=5.0)
        results = []
        for rank, out in enumerate(outs):
            if not out.is_file():
                raise WorkerFailed(f"rank {rank} exited without a result:\n" +
                                   "\n".join(tails[rank]))
            results.append(json.loads(out.read_text()))
    traffic = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
    return results, traffic


def _worker_env(net: Network, rank: int, n: int, threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
    path = [str(ROOT / "src"), str(ROOT)]
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR=net.address(0), MASTER_PORT=str(MASTER_PORT),
               GLOO_SOCKET_IFNAME=net.interface(rank), OMP_NUM_THREADS=str(threads),
               PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(path))
    return env


def _pump(proc: subprocess.Popen, tail: collections.deque[str], echo: bool) -> None:
    assert proc.stdout is not None
    with proc.stdout:
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip()
            tail.append(line)
            if echo:
                print(line, flush=True)


def _wait(procs: list[subprocess.Popen], tails: list[collections.deque[str]],
          timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        for rank, code in enumerate(codes):
            if code not in (None, 0):
                time.sleep(0.2)  # the pump's last lines
                raise WorkerFailed(f"rank {rank} exited with code {code}; its last lines:\n" +
                                   "\n".join(tails[rank]))
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            running = [r for r, c in enumerate(codes) if c is None]
            raise WorkerFailed(f"ranks {running} still running after {timeout:g} s; rank "
                               f"{running[0]}'s last lines:\n" + "\n".join(tails[running[0]]))
        time.sleep(0.05)


def _kill(procs: list[subprocess.Popen]) -> None:
    """SIGKILL each worker's process group (its own session) and reap it."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for proc in procs:
        try:
            proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            pass


def _worker(task_path: str, out_path: str) -> None:
    import torch

    from benchmarks.netbench_tasks import TASKS
    from gossamer.comm import TorchCommunicator

    task = json.loads(Path(task_path).read_text())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    comm = TorchCommunicator.from_env(timeout=task.get("comm_timeout", COMM_TIMEOUT))
    try:
        result = TASKS[task["kind"]](comm, **task["args"])
    finally:
        comm.close()
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "worker":
        sys.exit("usage: python -m benchmarks.emulation worker TASK.json OUT.json")
    _worker(sys.argv[2], sys.argv[3])
