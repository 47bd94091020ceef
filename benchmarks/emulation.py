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

import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gossamer.comm.environment import torchrun_variables, without_launcher
from gossamer.launch.netem import EmulationUnavailable, LinkSpec, Network, check_prerequisites
from gossamer.launch.supervisor import Output, Supervisor, describe_exit

__all__ = ["EmulationUnavailable", "WorkerFailed", "require_emulation", "run_task"]

ROOT = Path(__file__).resolve().parents[1]
MASTER_PORT = 29500  # rank 0's namespace is a machine of its own: nothing else listens there
COMM_TIMEOUT = 120.0  # seconds any collective or exchange may wait for a peer


class WorkerFailed(RuntimeError):
    """A worker exited with an error, or the task ran past its deadline."""


def require_emulation() -> None:
    """Raise :class:`EmulationUnavailable` saying what is missing (root, ip, tc, the tbf
    qdisc), by building and removing a one-node shaped network."""
    check_prerequisites()
    with Network([LinkSpec(bandwidth="1gbit")]):
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
        # rank 0's lines as they come, every rank's in its tail; stopped with SIGKILL at once
        workers = Supervisor(output=Output(sys.stdout, sys.stdout), grace=0.0)
        with Network(links) as net, workers:
            before = [net.counters(r) for r in range(n)]
            for rank in range(n):
                cmd = [*net.exec_prefix(rank), sys.executable, "-m", "benchmarks.emulation",
                       "worker", str(task_path), str(outs[rank])]
                workers.start(rank, cmd, _worker_env(net, rank, n, threads), cwd=ROOT,
                              echo="" if echo and rank == 0 else None)
            outcome = workers.wait(timeout)
            if outcome.failed is not None:
                raise WorkerFailed(f"rank {outcome.failed} "
                                   f"{describe_exit(outcome.codes[outcome.failed])}; its last "
                                   "lines:\n" + "\n".join(workers.tail(outcome.failed)))
            if outcome.timed_out:
                first = outcome.stopped[0]
                raise WorkerFailed(f"ranks {list(outcome.stopped)} still running after "
                                   f"{timeout:g} s; rank {first}'s last lines:\n"
                                   + "\n".join(workers.tail(first)))
            after = [net.counters(r) for r in range(n)]
        results = []
        for rank, out in enumerate(outs):
            if not out.is_file():
                raise WorkerFailed(f"rank {rank} exited without a result:\n" +
                                   "\n".join(workers.tail(rank)))
            results.append(json.loads(out.read_text()))
    traffic = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
    return results, traffic


def _worker_env(net: Network, rank: int, n: int, threads: int) -> dict[str, str]:
    env = without_launcher()
    path = [str(ROOT / "src"), str(ROOT)]
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env.update(torchrun_variables(rank, n, net.address(0), MASTER_PORT, local_rank=0,
                                  local_world_size=1),
               GLOO_SOCKET_IFNAME=net.interface(rank), OMP_NUM_THREADS=str(threads),
               PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(path))
    return env


def _worker(task_path: str, out_path: str) -> None:
    import torch

    from benchmarks.netbench_tasks import TASKS
    from gossamer.comm import TorchCommunicator

    task = json.loads(Path(task_path).read_text())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # gloo: the tasks' tensors are on the CPU, also where a GPU would make NCCL the default
    comm = TorchCommunicator.from_env(backend="gloo",
                                      timeout=task.get("comm_timeout", COMM_TIMEOUT))
    try:
        result = TASKS[task["kind"]](comm, **task["args"])
    finally:
        comm.close()
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "worker":
        sys.exit("usage: python -m benchmarks.emulation worker TASK.json OUT.json")
    _worker(sys.argv[2], sys.argv[3])
