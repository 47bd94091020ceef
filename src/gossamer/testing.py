"""Run a function in several gloo processes on 127.0.0.1, for tests.

Each child gets the environment torchrun would give it (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so ``fn`` typically starts with
``TorchCommunicator.from_env()``. Example::

    def worker(n):
        comm = TorchCommunicator.from_env(timeout=30)
        return comm.all_reduce(torch.ones(n)).tolist()

    assert spawn_gloo(worker, 2, args=(3,)) == [[2.0] * 3] * 2

Starting the processes costs seconds, so tests that compare many runs make them all in one
spawn, one after another (:func:`run_in_turn`, :func:`collect`)::

    results = spawn_gloo(run_in_turn, 4, args=(train, [("sgp", (SGP(),)), ("dpsgd", (DPSGD(),))]))
    sgp = collect(results, "sgp")  # train(comm, SGP()) of each rank
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Failed", "collect", "free_port", "run_in_turn", "spawn_gloo"]

_GRACE = 10.0  # seconds the others get to report once one rank failed: they usually fail fast


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (the OS picked it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(
    fn: Callable[..., Any], args: Sequence[Any], rank: int, world_size: int, port: int,
    results: Any,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    # Each child is its own job: an outer torchrun's agent store must not be used.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    # Imported here so that importing gossamer.testing stays cheap for the parent.
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # two cores for several processes: threads would only fight
    try:
        # Pickled here, so that an unpicklable result is reported like any other error.
        message = (rank, True, pickle.dumps(fn(*args)))
    except BaseException:
        message = (rank, False, traceback.format_exc())
    results.put(message)
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the result is sent; teardown errors don't matter
            pass


def spawn_gloo(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout: float = 120.0,
    allow_exit: Collection[int] = (),
) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` fresh processes and return their results by rank.

    ``fn`` must be picklable (a module-level function). A rank that raises sends its
    traceback, and a RuntimeError with every failed rank's traceback is raised. Ranks in
    ``allow_exit`` may exit without a result (None is returned for them), e.g. a test that
    kills a worker on purpose; any other rank that exits without a result is a failure. After
    ``timeout`` seconds a TimeoutError names the ranks that did not report. Children are
    always killed and reaped before this returns.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, tuple(args), rank, world_size, port, results),
                    name=f"gossamer-rank{rank}", daemon=True)
        for rank in range(world_size)
    ]
    reported: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    first_failure: float | None = None
    try:
        for p in procs:
            p.start()
        while len(reported) < world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            if first_failure is not None and now >= first_failure + _GRACE:
                break
            try:
                rank, ok, payload = results.get(timeout=0.1)
            except queue.Empty:
                pass
            else:
                reported[rank] = (ok, payload)
                if not ok and first_failure is None:
                    first_failure = time.monotonic()
                continue
            if first_failure is None and _vanished(procs, reported, allow_exit, results):
                first_failure = time.monotonic()
            if all(not p.is_alive() for p in procs) and results.empty():
                break  # nobody is left to report
    finally:
        # Children that reported exit by themselves in a moment; the others are stuck.
        _reap(procs, grace=5.0 if len(reported) == world_size else 0.0)
        _drain(results, reported)
        results.close()
        results.join_thread()

    failures = []
    for rank, p in enumerate(procs):
        if rank in reported and not reported[rank][0]:
            failures.append(f"--- rank {rank} raised:\n{reported[rank][1]}")
        elif rank not in reported and rank not in allow_exit and first_failure is not None:
            failures.append(f"--- rank {rank} exited without a result (exit code "
                            f"{p.exitcode})")
    if failures:
        raise RuntimeError(f"spawn_gloo({_name(fn)}): {len(failures)} rank(s) failed\n"
                           + "\n".join(failures))
    missing = [r for r in range(world_size) if r not in reported and r not in allow_exit]
    if missing:
        raise TimeoutError(
            f"spawn_gloo({_name(fn)}): ranks {missing} did not report within {timeout:g} s"
        )
    return [pickle.loads(reported[r][1]) if r in reported else None for r in range(world_size)]


def _vanished(procs: list, reported: dict, allow_exit: Collection[int], results: Any) -> bool:
    """Whether a rank outside ``allow_exit`` died without a result (draining late results)."""
    dead = [r for r, p in enumerate(procs)
            if r not in reported and r not in allow_exit and not p.is_alive()]
    if not dead:
        return False
    # A child writes its result before it exits, so what it sent is in the pipe by now.
    _drain(results, reported)
    return any(r not in reported for r in dead)


def _drain(results: Any, reported: dict) -> None:
    while True:
        try:
            rank, ok, payload = results.get_nowait()
        except Exception:  # noqa: BLE001 - empty, closed, or cut short by a killed child
            return
        reported[rank] = (ok, payload)


def _reap(procs: list, grace: float) -> None:
    """Give the children ``grace`` seconds to exit, then terminate, then kill; join them all."""
    end = time.monotonic() + grace
    for p in procs:
        if p.pid is not None:
            p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join()


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", repr(fn))


@dataclass(frozen=True)
class Failed:
    """A run of :func:`run_in_turn` that raised, with its traceback."""

    traceback: str


def run_in_turn(
    fn: Callable[..., Any], runs: Sequence[tuple[Hashable, Sequence[Any]]],
    timeout: float = 30.0,
) -> dict[Hashable, Any]:
    """In a process of :func:`spawn_gloo`: ``fn(comm, *args)`` for each ``(key, args)`` of
    ``runs``, one after another, each with a communicator of its own (its own byte counters;
    the same process group) that starts with a barrier, so that a run begins when the one
    before it has ended on every rank.

    Returns ``{key: result}``. A run that raises gives :class:`Failed` with its traceback and
    ends the sequence: after a failure the process group is in an undefined state. ``timeout``
    is every communicator's (seconds), so that the other ranks soon fail too instead of
    waiting for the failed one. ``fn`` must be picklable (a module-level function).
    """
    from gossamer.comm.torch_comm import TorchCommunicator

    owner = TorchCommunicator.from_env(timeout=timeout)
    results: dict[Hashable, Any] = {}
    try:
        for key, args in runs:
            comm = TorchCommunicator(timeout=timeout)
            try:
                comm.barrier()
                results[key] = fn(comm, *args)
            except Exception:  # noqa: BLE001 - reported to the parent, with the run named
                results[key] = Failed(traceback.format_exc())
                break
    finally:
        owner.close()
    return results


def collect(results: Sequence[dict[Hashable, Any]], key: Hashable) -> list[Any]:
    """The results of run ``key`` on every rank, from ``spawn_gloo(run_in_turn, ...)``.

    Raises AssertionError naming the run and the rank if a rank raised in it (with its
    traceback) or never got to it (an earlier run failed).
    """
    out = []
    for rank, per_rank in enumerate(results):
        if key not in per_rank:
            raise AssertionError(f"{key}: rank {rank} did not run it (an earlier run failed)")
        if isinstance(per_rank[key], Failed):
            raise AssertionError(f"{key}: rank {rank} raised:\n{per_rank[key].traceback}")
        out.append(per_rank[key])
    return out
