"""Run a function in several gloo processes on 127.0.0.1, for tests.

Each child is a fresh Python process, started and watched by
:class:`gossamer.launch.supervisor.Supervisor`, with the environment torchrun would give it
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; see
:mod:`gossamer.comm.environment`), so ``fn`` typically starts with
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

import os
import pickle
import sys
import tempfile
import traceback
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass
from multiprocessing import spawn as mp_spawn
from pathlib import Path
from typing import Any

from gossamer.comm.environment import (
    BACKEND_VARIABLE,
    free_port,
    torchrun_variables,
    without_launcher,
)
from gossamer.launch.supervisor import Supervisor

__all__ = ["Failed", "collect", "free_port", "run_in_turn", "spawn_gloo", "state_tensors"]

_LINGER = 10.0  # seconds the others get to report once one rank failed: they usually fail fast
_GRACE = 2.0  # seconds between SIGTERM and SIGKILL when the children are stopped
# what each child runs: its spawn folder and rank follow on the command line
_CHILD = "from gossamer.testing import _child_main; _child_main()"


def _returned(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.returned"  # the pickled result


def _raised(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.raised"  # the traceback


def _child_main() -> None:
    """A child of :func:`spawn_gloo`: ``fn(*args)`` into its result file, or its traceback."""
    folder, rank = Path(sys.argv[1]), int(sys.argv[2])
    failed = False
    try:
        with open(folder / "call.pkl", "rb") as f:
            # as multiprocessing's spawn does: the parent's sys.path and __main__ first, so
            # that fn and args unpickle as they were pickled
            mp_spawn.prepare(pickle.load(f))
            fn, args = pickle.load(f)
        import torch

        torch.set_num_threads(1)  # two cores for several processes: threads would only fight
        # Pickled here, so that an unpicklable result is reported like any other error.
        _write(_returned(folder, rank), pickle.dumps(fn(*args)))
    except BaseException:
        failed = True
        _write(_raised(folder, rank), traceback.format_exc().encode())
    finally:
        _destroy_process_group()
    sys.exit(1 if failed else 0)


def _write(path: Path, data: bytes) -> None:
    """All of it or nothing: the parent reads the file once the child has exited."""
    partial = path.with_suffix(".partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the result is written; teardown errors don't matter
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
    always stopped and reaped before this returns (by :class:`gossamer.launch.supervisor.
    Supervisor`; once one rank failed, the others get 10 s to report).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    with tempfile.TemporaryDirectory(prefix="gossamer-spawn-") as tmp:
        folder = Path(tmp)
        with open(folder / "call.pkl", "wb") as f:
            preparation = mp_spawn.get_preparation_data("gossamer-spawn")
            preparation.pop("authkey", None)  # no multiprocessing between parent and child
            pickle.dump(preparation, f)
            pickle.dump((fn, tuple(args)), f)

        def is_failure(rank: int, code: int) -> bool:
            # a rank that wrote its result succeeded, whatever its exit (an abort at exit)
            return _raised(folder, rank).exists() or (
                not _returned(folder, rank).exists() and rank not in allow_exit)

        # Each child is its own job: an outer launcher's variables (a torchrun agent's store)
        # must not be used.
        # gloo also where CUDA would make NCCL from_env's default (a child that asks for
        # NCCL by name still gets it)
        env = {**without_launcher(), "OMP_NUM_THREADS": "1", BACKEND_VARIABLE: "gloo"}
        port = free_port()
        with Supervisor(grace=_GRACE, linger=_LINGER, is_failure=is_failure) as children:
            for rank in range(world_size):
                children.start(rank, [sys.executable, "-c", _CHILD, str(folder), str(rank)],
                               {**env, **torchrun_variables(rank, world_size, "127.0.0.1",
                                                            port)})
            outcome = children.wait(timeout)
        results = {}
        failures = []
        for rank in range(world_size):
            if _raised(folder, rank).exists():
                failures.append(f"--- rank {rank} raised:\n"
                                f"{_raised(folder, rank).read_text(errors='replace')}")
            elif _returned(folder, rank).exists():
                results[rank] = _returned(folder, rank).read_bytes()
            elif rank not in allow_exit and outcome.failed is not None:
                failures.append(f"--- rank {rank} exited without a result (exit code "
                                f"{outcome.codes[rank]})")
    if failures:
        raise RuntimeError(f"spawn_gloo({_name(fn)}): {len(failures)} rank(s) failed\n"
                           + "\n".join(failures))
    missing = [r for r in range(world_size) if r not in results and r not in allow_exit]
    if missing:
        raise TimeoutError(
            f"spawn_gloo({_name(fn)}): ranks {missing} did not report within {timeout:g} s"
        )
    return [pickle.loads(results[r]) if r in results else None for r in range(world_size)]


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


def state_tensors(state: Any) -> list[Any]:
    """Every tensor in a state (a ``state_dict()``: dicts, lists and tuples of them), in
    order."""
    import torch

    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in state_tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in state_tensors(v)]
    return []
