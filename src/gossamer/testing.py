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

Starting a process costs seconds (it imports torch), so the processes are kept: a call runs in
the resident processes of a pool, one per world size, each of which runs one call after
another with a fresh process group, the environment of the call, and the random states a fresh
process starts with. A call that lets a rank exit (``allow_exit``) or asks for ``fresh=True``
runs in new processes; a call that fails or times out closes its pool (whose state is then
unknown), and the next call starts a new one. ``GOSSAMER_FRESH_SPAWN=1`` makes every call fresh.

Tests that compare many runs can also make them all in one call, one after another
(:func:`run_in_turn`, :func:`collect`)::

    results = spawn_gloo(run_in_turn, 4, args=(train, [("sgp", (SGP(),)), ("dpsgd", (DPSGD(),))]))
    sgp = collect(results, "sgp")  # train(comm, SGP()) of each rank
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import pickle
import sys
import tempfile
import traceback
from collections.abc import Callable, Collection, Hashable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing import spawn as mp_spawn
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gossamer.comm.environment import (
    BACKEND_VARIABLE,
    free_port,
    torchrun_variables,
    without_launcher,
)
from gossamer.launch.supervisor import Supervisor

# (imported first, so that its exit handler, which closes the warm process, runs after
# close_pools: the pools' processes are its children)
from gossamer.warm import start_python

if TYPE_CHECKING:
    from gossamer.comm.recording import Recorder

__all__ = ["FRESH_VARIABLE", "Failed", "close_pools", "collect", "destroy_process_group",
           "free_port", "recording", "run_in_turn",
           "spawn_gloo", "state_tensors"]

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
            destroy_process_group()
        except Exception:  # noqa: BLE001 - the result is written; teardown errors don't matter
            pass


def destroy_process_group() -> None:
    """``torch.distributed.destroy_process_group()``, once gloo's worker threads are idle.

    A gloo process group's destructor joins its worker threads while the caller holds the GIL,
    and a worker thread that is destroying a finished operation may need the GIL (torch 2.13):
    the two wait for each other for ever. Seen in a process that ran DDP and then dropped its
    last reference to the group (a hang about one run in ten). So: collect what is garbage
    (a DDP reducer holds the group), let the worker threads finish with the GIL free, then
    destroy. A caller drops its own references to DDP models first."""
    import gc
    import time

    import torch.distributed as dist

    gc.collect()
    time.sleep(0.05)  # (sleeping releases the GIL)
    dist.destroy_process_group()


def spawn_gloo(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout: float = 120.0,
    allow_exit: Collection[int] = (),
    fresh: bool = False,
) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` processes and return their results by rank.

    ``fn`` must be picklable (a module-level function). A rank that raises sends its
    traceback, and a RuntimeError with every failed rank's traceback is raised. Ranks in
    ``allow_exit`` may exit without a result (None is returned for them), e.g. a test that
    kills a worker on purpose; any other rank that exits without a result is a failure. After
    ``timeout`` seconds a TimeoutError names the ranks that did not report.

    The processes are the resident ones of a pool (see the module docs) unless ``fresh``,
    ``allow_exit`` or ``GOSSAMER_FRESH_SPAWN=1``: then they are new, and always stopped and
    reaped before this returns (by :class:`gossamer.launch.supervisor.Supervisor`). Either way,
    once one rank failed the others get 10 s to report; a pool in which a call failed or timed
    out is closed, and the next call starts a new one.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if fresh or allow_exit or os.environ.get(FRESH_VARIABLE, "") not in ("", "0"):
        return _spawn_fresh(fn, world_size, args, timeout, allow_exit)
    return _pooled(fn, world_size, args, timeout)


def _spawn_fresh(fn: Callable[..., Any], world_size: int, args: Sequence[Any], timeout: float,
                 allow_exit: Collection[int]) -> list[Any]:
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
        env = _child_environment()
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


#: set to 1: every spawn_gloo call starts fresh processes (no pool)
FRESH_VARIABLE = "GOSSAMER_FRESH_SPAWN"
_RESIDENT = "from gossamer.testing import _resident_main; _resident_main()"
_POLL = 0.01  # seconds between the parent's looks for results
_pools: dict[int, _Pool] = {}


class _Pool:
    """``world_size`` resident children, each running the calls written to ``folder`` in turn
    (``callN.pkl``; results ``rankR.returnedN`` or ``rankR.raisedN``). A child waits for its
    next call blocked on its standard input, where the parent writes a line per call: an idle
    child takes no CPU, and reads end-of-file when the parent closes the pool or dies."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.folder = Path(tempfile.mkdtemp(prefix="gossamer-pool-"))
        self.calls = 0
        env = _child_environment()
        self.children = []
        self._calls: list[int] = []  # the write ends of the children's call pipes
        for rank in range(world_size):
            # a named pipe for the calls, held open here read-write (opening it does not
            # wait for the child); the children are forked from a process that has imported
            # torch (gossamer.warm): a pool starts without seconds of imports per process
            pipe = self.folder / f"rank{rank}.calls"
            os.mkfifo(pipe)
            self._calls.append(os.open(pipe, os.O_RDWR))
            log = self.folder / f"rank{rank}.log"  # the child's output
            self.children.append(start_python(
                ["-c", _RESIDENT, str(self.folder), str(rank), str(world_size),
                 str(os.getpid()), str(pipe)], cwd=os.getcwd(), env=env, stdout=log,
                stderr=log))

    def call(self, fn: Callable[..., Any], args: Sequence[Any], timeout: float) -> list[Any]:
        """``fn(*args)`` on every rank: their results, or the errors of :func:`spawn_gloo`
        (after which the pool is closed: its processes' state is unknown)."""
        import time

        n, self.calls = self.calls, self.calls + 1
        preparation = mp_spawn.get_preparation_data("gossamer-spawn")
        preparation.pop("authkey", None)
        environ = _child_environment()
        # two pickles: the second unpickles once the first has prepared sys.path and __main__
        _write(self.folder / f"call{n}.pkl", pickle.dumps((preparation, environ, free_port()))
               + pickle.dumps((fn, tuple(args))))
        for calls in self._calls:  # (a child gone shows below, as one that failed)
            os.write(calls, b"%d\n" % n)
        ranks = range(self.world_size)
        returned = [self.folder / f"rank{r}.returned{n}" for r in ranks]
        raised = [self.folder / f"rank{r}.raised{n}" for r in ranks]
        deadline, failed_at = time.monotonic() + timeout, None
        while True:
            now = time.monotonic()
            if all(path.exists() for path in returned):
                results = [pickle.loads(path.read_bytes()) for path in returned]
                for path in returned:
                    path.unlink()
                return results
            codes = [child.poll() for child in self.children]
            over = [raised[r].exists() or codes[r] is not None for r in ranks]
            if failed_at is None and any(over):
                failed_at = now  # the others get a while to report, as fresh ones would
            if now > deadline or failed_at is not None and (
                    now - failed_at > _LINGER or all(over[r] or returned[r].exists()
                                                     for r in ranks)):
                break
            time.sleep(_POLL)
        failures, missing = [], []
        for r in ranks:
            if raised[r].exists():
                failures.append(f"--- rank {r} raised:\n"
                                f"{raised[r].read_text(errors='replace')}")
            elif codes[r] is not None and not returned[r].exists():
                failures.append(f"--- rank {r} exited without a result (exit code {codes[r]})")
            elif not returned[r].exists():
                missing.append(r)
        self.close()
        if failures:
            raise RuntimeError(f"spawn_gloo({_name(fn)}): {len(failures)} rank(s) failed\n"
                               + "\n".join(failures))
        raise TimeoutError(
            f"spawn_gloo({_name(fn)}): ranks {missing} did not report within {timeout:g} s")

    def close(self) -> None:
        import shutil

        for calls in self._calls:  # the children read end of file
            with contextlib.suppress(OSError):
                os.close(calls)
        self._calls = []
        for child in self.children:
            if child.poll() is None:
                child.kill()
        for child in self.children:
            child.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def _pooled(fn: Callable[..., Any], world_size: int, args: Sequence[Any], timeout: float
            ) -> list[Any]:
    """``fn(*args)`` on the pool's processes of ``world_size`` (a new pool if there is none,
    or if the last call failed)."""
    pool = _pools.get(world_size)
    if pool is None:
        pool = _pools[world_size] = _Pool(world_size)
    try:
        return pool.call(fn, args, timeout)
    except BaseException:
        _pools.pop(world_size, None)
        pool.close()
        raise


def close_pools() -> None:
    """Stop every resident process (also done at exit)."""
    while _pools:
        _pools.popitem()[1].close()


atexit.register(close_pools)


def _resident_main() -> None:
    """A resident child of the pool: each call in turn, in the state of a fresh process."""
    import random

    import numpy as np
    import torch

    folder, rank = Path(sys.argv[1]), int(sys.argv[2])
    world_size = int(sys.argv[3])  # (argv[4], the parent's pid, names the pool in ps)
    calls = open(sys.argv[5], "rb")  # noqa: SIM115 - read until the parent closes it
    torch.set_num_threads(1)  # two cores for several processes: threads would only fight
    states = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
    n = 0
    while True:
        if not calls.readline():  # end of file: the parent closed the pool, or is gone
            return
        call = folder / f"call{n}.pkl"
        stream = io.BytesIO(call.read_bytes())
        preparation, environ, port = pickle.load(stream)
        os.environ.clear()
        os.environ.update({**environ, **torchrun_variables(rank, world_size, "127.0.0.1",
                                                           port)})
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        try:
            mp_spawn.prepare(preparation)
            fn, args = pickle.load(stream)
            _write(folder / f"rank{rank}.returned{n}", pickle.dumps(fn(*args)))
        except BaseException:  # noqa: BLE001 - reported to the parent
            _write(folder / f"rank{rank}.raised{n}", traceback.format_exc().encode())
        finally:
            _destroy_process_group()
        n += 1


def _child_environment() -> dict[str, str]:
    """A child's environment: this process's without a launcher's variables, one thread, and
    gloo also where CUDA would make NCCL from_env's default (a child that asks for NCCL by
    name still gets it)."""
    return {**without_launcher(), "OMP_NUM_THREADS": "1", BACKEND_VARIABLE: "gloo"}


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


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    """Record this process's calls to ``torch.distributed`` and its P2PGroups' operations
    (:class:`gossamer.comm.recording.Recorder`), for the checks of NCCL's rules.

    The communication thread of :mod:`gossamer.patterns.overlap` tells the recorder what it
    waits for: a job follows what its submitter did before submitting it, and
    ``CommThread.wait`` follows what its jobs did (their vector clocks are merged).
    """
    from gossamer.comm.recording import Recorder
    from gossamer.patterns.overlap import CommThread

    recorder = Recorder()
    submit, wait = CommThread.submit, CommThread.__dict__["wait"]
    finished: dict[int, dict[str, dict[int, int]]] = {}  # id(job) -> its clock when done

    def recorded_submit(self: CommThread, fn: Callable[..., Any], *args: Any) -> Any:
        token, done = recorder.release(), {}

        def job(*job_args: Any) -> Any:
            recorder.acquire(token)
            try:
                return fn(*job_args)
            finally:
                done["clock"] = recorder.release()

        future = submit(self, job, *args)
        finished[id(future)] = done
        return future

    def recorded_wait(jobs: Sequence[Any]) -> None:
        try:
            wait.__func__(jobs)
        finally:
            for job in jobs:
                done = finished.pop(id(job), {})
                if "clock" in done:
                    recorder.acquire(done["clock"])

    CommThread.submit = recorded_submit  # type: ignore[method-assign]
    CommThread.wait = staticmethod(recorded_wait)  # type: ignore[method-assign]
    try:
        with recorder.installed():
            yield recorder
    finally:
        CommThread.submit = submit  # type: ignore[method-assign]
        CommThread.wait = wait  # type: ignore[method-assign]


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
